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
