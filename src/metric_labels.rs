//! Metric labels whose values are all known in advance, declared once with [`label_values!`]:
//! the enum, every value in order (each series starts at zero, so a dashboard never sees a
//! series appear from nothing) and the text operators match on. The proxy and the approver use
//! the same idiom.

/// Declares a label's values once: the enum, every value in declaration order (each series is
/// created at zero from the start) and the text operators match on, as prometheus-client's
/// `EncodeLabelValue`. A family's handles can be kept in that order and indexed
/// ([`LabelValue::index`]), so a data path never looks a series up.
#[macro_export]
macro_rules! label_values {
    ($(#[$meta:meta])* pub enum $name:ident {
        $($(#[$vmeta:meta])* $variant:ident => $text:literal),+ $(,)?
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $crate::metric_labels::LabelValue for $name {
            const ALL: &'static [$name] = &[$($name::$variant),+];

            fn index(self) -> usize {
                // No explicit discriminants: the n-th variant is n, its place in ALL.
                self as usize
            }

            fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl prometheus_client::encoding::EncodeLabelValue for $name {
            fn encode(&self, encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(encoder, $crate::metric_labels::LabelValue::as_str(*self))
            }
        }
    };
}

/// A label whose values are all known in advance (see [`label_values!`]).
pub trait LabelValue:
    Copy
    + Eq
    + std::hash::Hash
    + std::fmt::Debug
    + prometheus_client::encoding::EncodeLabelValue
    + Send
    + Sync
    + 'static
{
    /// Every value, in declaration order.
    const ALL: &'static [Self];
    /// The value's place in [`LabelValue::ALL`].
    fn index(self) -> usize;
    /// The label value as operators see it.
    fn as_str(self) -> &'static str;
}
