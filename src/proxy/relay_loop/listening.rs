//! A loop's copy of the UNIX socket's listener ([`super::accepting`]), as the loop holds it.

use std::os::unix::net::UnixListener;
use std::sync::Arc;

use super::opening::Opener;

/// The token of a loop's listener.
pub(super) const LISTENER: u64 = u64::MAX - 1;

/// A loop's copy of the listener, and what decides on what it accepts.
pub(super) struct Listening {
    pub(super) listener: UnixListener,
    pub(super) opener: Arc<dyn Opener>,
    /// When a resting listener is waited for again (None: it is waited for now).
    pub(super) resting_until: Option<u64>,
}
