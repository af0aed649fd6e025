//! Durations as every hwkey flag and config key writes them.
//!
//! Below every layer that takes one (the proxy's settings, the approver's and renewal's flags,
//! the kubeconfig extension), so there is one syntax and one message for a wrong one.

use std::time::Duration;

/// A duration that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration '{given}': use e.g. 30s, 10m, 1h30m, 500ms")]
pub struct InvalidDuration {
    /// The text given.
    pub given: String,
}

/// Parses a duration the way every hwkey flag and config key takes it: humantime's syntax
/// (`90s`, `10m`, `1h30m`, `1h 30m`, `500ms`, `2d`, `1week`), or a bare number of seconds.
/// `0` means zero.
pub fn parse_duration(s: &str) -> Result<Duration, InvalidDuration> {
    let t = s.trim();
    if let Ok(secs) = t.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(t).map_err(|_| InvalidDuration {
        given: s.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn durations_take_humantime_and_bare_seconds() {
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2d").unwrap(), Duration::from_secs(172_800));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("10 parsecs").is_err());
    }
}
