//! A loop's copies of the UNIX socket listeners ([`super::accepting`]), as the loop holds them,
//! and the tokens they are registered under.

use std::os::unix::net::UnixListener;
use std::sync::Arc;

use super::opening::Opener;

/// The token of a loop's first listener; the next ones count down from it.
const LISTENER: u64 = u64::MAX - 1;
/// The most UNIX socket listeners the loops accept on (`--listen unix:` given this many times).
pub(super) const MAX_LISTENERS: usize = 16;

/// The token listener `i` is registered under.
pub(super) fn token(i: usize) -> u64 {
    LISTENER - i as u64
}

/// The listener a token names, if it names one.
pub(super) fn index(token: u64) -> Option<usize> {
    let i = LISTENER.checked_sub(token)?;
    usize::try_from(i).ok().filter(|&i| i < MAX_LISTENERS)
}

/// A loop's copy of a listener, and what decides on what it accepts.
pub(super) struct Listening {
    pub(super) listener: UnixListener,
    pub(super) opener: Arc<dyn Opener>,
    /// When a resting listener is waited for again (None: it is waited for now).
    pub(super) resting_until: Option<u64>,
}
