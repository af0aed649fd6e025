//! The ASCII form of a non-ASCII name, as Go's `httpproxy` writes a `NO_PROXY` entry before
//! comparing it with a URL's host (`idna.Lookup.ToASCII`): each label lower-cased and, when
//! not ASCII, Punycode-encoded (RFC 3492) behind `xn--`.
//!
//! A label Go's lookup profile refuses (hyphens at its ends or in positions 3–4, characters
//! STD3 forbids in a name) makes the whole name stay as written, as Go keeps it: such an entry
//! then matches no host hwkey can connect to (hosts are ASCII). Compatibility mappings of UTS 46
//! (full-width forms, for instance) are not applied: a name that needs one is kept as written
//! too.

/// The ASCII form of `name`; None when it is ASCII already (Go leaves it alone) or when a
/// label cannot be written in ASCII by the rules above.
pub fn to_ascii(name: &str) -> Option<String> {
    if name.is_ascii() {
        return None;
    }
    let labels: Option<Vec<String>> = name.split('.').map(label).collect();
    labels.map(|l| l.join("."))
}

/// One label in ASCII (empty labels stay empty, as around a leading dot).
fn label(raw: &str) -> Option<String> {
    let lower = raw.to_lowercase();
    if lower.is_empty() {
        return Some(lower);
    }
    if lower.starts_with('-') || lower.ends_with('-') || lower.get(2..4) == Some("--") {
        return None;
    }
    let forbidden = |c: char| c.is_ascii() && !(c.is_ascii_alphanumeric() || c == '-');
    if lower
        .chars()
        .any(|c| forbidden(c) || c.is_whitespace() || c.is_control())
    {
        return None;
    }
    if lower.is_ascii() {
        return Some(lower);
    }
    encode(&lower).map(|p| format!("xn--{p}"))
}

const BASE: u32 = 36;
const T_MIN: u32 = 1;
const T_MAX: u32 = 26;
const SKEW: u32 = 38;
const DAMP: u32 = 700;
const INITIAL_BIAS: u32 = 72;
const INITIAL_N: u32 = 128;

/// RFC 3492 section 6.3, the encoding procedure. None on overflow.
fn encode(input: &str) -> Option<String> {
    let code_points: Vec<u32> = input.chars().map(u32::from).collect();
    let mut output: String = input.chars().filter(char::is_ascii).collect();
    let basic = output.len() as u32;
    let mut handled = basic;
    if basic > 0 {
        output.push('-');
    }
    let (mut n, mut delta, mut bias) = (INITIAL_N, 0u32, INITIAL_BIAS);
    while (handled as usize) < code_points.len() {
        let m = *code_points.iter().filter(|&&c| c >= n).min()?;
        delta = delta.checked_add((m - n).checked_mul(handled + 1)?)?;
        n = m;
        for &c in &code_points {
            if c < n {
                delta = delta.checked_add(1)?;
            }
            if c == n {
                let mut q = delta;
                let mut k = BASE;
                loop {
                    let t = threshold(k, bias);
                    if q < t {
                        break;
                    }
                    output.push(digit(t + (q - t) % (BASE - t)));
                    q = (q - t) / (BASE - t);
                    k += BASE;
                }
                output.push(digit(q));
                bias = adapt(delta, handled + 1, handled == basic);
                delta = 0;
                handled += 1;
            }
        }
        delta = delta.checked_add(1)?;
        n = n.checked_add(1)?;
    }
    Some(output)
}

fn threshold(k: u32, bias: u32) -> u32 {
    if k <= bias {
        T_MIN
    } else if k >= bias + T_MAX {
        T_MAX
    } else {
        k - bias
    }
}

fn digit(d: u32) -> char {
    match d {
        0..=25 => char::from(b'a' + d as u8),
        _ => char::from(b'0' + (d - 26) as u8),
    }
}

fn adapt(delta: u32, points: u32, first: bool) -> u32 {
    let mut delta = if first { delta / DAMP } else { delta / 2 };
    delta += delta / points;
    let mut k = 0;
    while delta > ((BASE - T_MIN) * T_MAX) / 2 {
        delta /= BASE - T_MIN;
        k += BASE;
    }
    k + (BASE - T_MIN + 1) * delta / (delta + SKEW)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc_3492_and_well_known_names() {
        assert_eq!(
            to_ascii("bücher.example").as_deref(),
            Some("xn--bcher-kva.example")
        );
        assert_eq!(
            to_ascii(".MÜNCHEN.de").as_deref(),
            Some(".xn--mnchen-3ya.de")
        );
        assert_eq!(to_ascii("例え.jp").as_deref(), Some("xn--r8jz45g.jp"));
        assert_eq!(to_ascii("ascii.example"), None);
        assert_eq!(to_ascii("-bücher.example"), None);
        assert_eq!(to_ascii("bü_cher.example"), None);
    }
}
