//! What a PIV attestation says about a slot's key, and what a registration may require of it:
//! the PIN and touch policies (ordered by strength) and the firmware version. Kept apart from
//! [`super::piv`] so registrations read them without the attestation check.

/// The PIN policy of a slot, weakest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PinPolicy {
    /// No PIN.
    Never,
    /// The PIN once per session.
    Once,
    /// The PIN for every signature.
    Always,
}

/// The touch policy of a slot, weakest first (`cached` asks for a touch at most every 15 s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TouchPolicy {
    /// No touch.
    Never,
    /// A touch, remembered for 15 s.
    Cached,
    /// A touch for every signature.
    Always,
}

impl PinPolicy {
    pub(super) fn from_byte(b: u8) -> Option<PinPolicy> {
        match b {
            1 => Some(PinPolicy::Never),
            2 => Some(PinPolicy::Once),
            3 => Some(PinPolicy::Always),
            _ => None,
        }
    }
}

impl TouchPolicy {
    pub(super) fn from_byte(b: u8) -> Option<TouchPolicy> {
        match b {
            1 => Some(TouchPolicy::Never),
            2 => Some(TouchPolicy::Always),
            3 => Some(TouchPolicy::Cached),
            _ => None,
        }
    }
}

impl std::fmt::Display for PinPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PinPolicy::Never => "never",
            PinPolicy::Once => "once",
            PinPolicy::Always => "always",
        })
    }
}

impl std::fmt::Display for TouchPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TouchPolicy::Never => "never",
            TouchPolicy::Cached => "cached",
            TouchPolicy::Always => "always",
        })
    }
}

/// A firmware version, compared as (major, minor, patch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Firmware(pub u8, pub u8, pub u8);

impl std::fmt::Display for Firmware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// A firmware version that is not MAJOR.MINOR.PATCH.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not a firmware version MAJOR.MINOR.PATCH (5.4.3)")]
pub struct BadFirmware(pub String);

impl std::str::FromStr for Firmware {
    type Err = BadFirmware;

    fn from_str(s: &str) -> Result<Firmware, BadFirmware> {
        let parts: Vec<Option<u8>> = s.split('.').map(|p| p.parse().ok()).collect();
        match parts.as_slice() {
            [Some(a), Some(b), Some(c)] => Ok(Firmware(*a, *b, *c)),
            _ => Err(BadFirmware(s.to_string())),
        }
    }
}
