//! The network side gives up every capability before it confines itself: a proxy started as
//! root (kubelet's, as the README's commands run it) otherwise kept them all
//! (`CapEff 000001fffeffffff`), and a compromised network side could `chmod`/`chown` root's
//! files, make device nodes, open raw sockets or set the host name.
//!
//! Dropped: the bounding set (so nothing can be regained, by any means), the ambient set, then
//! the effective, permitted and inheritable sets; and the securebits are locked so that uid 0
//! means no capability (`SECBIT_NOROOT`, `SECBIT_NO_SETUID_FIXUP`, no ambient raise), as
//! systemd's `CapabilityBoundingSet=` and `SecureBits=` do. Capabilities are per thread: this
//! runs on the main thread before any other thread exists, and every thread made after it
//! inherits the empty sets.

/// Why the capabilities could not all be dropped.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum PrivilegeError {
    #[error("cannot {what}: {source}")]
    Call {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("capabilities remain after dropping them all: {0}")]
    Remain(String),
}

/// A failed call, saying what it was for.
fn call(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> PrivilegeError {
    move |e| PrivilegeError::Call {
        what,
        source: e.into(),
    }
}

/// The kernel's highest capability number.
fn last_cap() -> u64 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(63)
}

/// The `CapEff`, `CapPrm`, `CapInh`, `CapBnd` and `CapAmb` lines of this thread that are not
/// zero.
fn remaining() -> Vec<String> {
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap_or_default();
    status
        .lines()
        .filter(|l| {
            ["CapEff:", "CapPrm:", "CapInh:", "CapBnd:", "CapAmb:"]
                .iter()
                .any(|p| l.starts_with(p))
        })
        .filter(|l| {
            l.split_whitespace()
                .nth(1)
                .is_some_and(|v| !v.trim_start_matches('0').is_empty())
        })
        .map(str::to_string)
        .collect()
}

/// Whether this thread holds any capability (in any set, the bounding set included).
pub fn any_held() -> bool {
    !remaining().is_empty()
}

/// Drops every capability of this thread for good. Without capabilities to begin with (an
/// unprivileged proxy: its bounding set is full but it can never use it) only the bounding
/// set and the securebits need CAP_SETPCAP, which it lacks: then nothing is asked of the
/// kernel but `no_new_privs` (set by the sandbox), which already keeps execve from granting
/// any.
pub fn drop_all() -> Result<(), PrivilegeError> {
    use rustix::thread::{CapabilitiesSecureBits as Bits, CapabilitySet};
    if !holds_setpcap() {
        return clear_sets();
    }
    let bits = Bits::NO_ROOT
        | Bits::NO_ROOT_LOCKED
        | Bits::NO_SETUID_FIXUP
        | Bits::NO_SETUID_FIXUP_LOCKED
        | Bits::KEEP_CAPS_LOCKED
        | Bits::NO_CAP_AMBIENT_RAISE
        | Bits::NO_CAP_AMBIENT_RAISE_LOCKED;
    rustix::thread::set_capabilities_secure_bits(bits).map_err(call("lock the securebits"))?;
    for cap in 0..=last_cap().min(63) {
        match rustix::thread::remove_capability_from_bounding_set(CapabilitySet::from_bits_retain(
            1 << cap,
        )) {
            // A number this kernel does not know.
            Ok(()) | Err(rustix::io::Errno::INVAL) => {}
            Err(e) => return Err(call("drop a bounding capability")(e)),
        }
    }
    clear_sets()?;
    let left = remaining();
    if left.is_empty() {
        Ok(())
    } else {
        Err(PrivilegeError::Remain(left.join(", ")))
    }
}

/// Whether this thread may change the bounding set (CAP_SETPCAP, in CapEff).
fn holds_setpcap() -> bool {
    rustix::thread::capabilities(None)
        .is_ok_and(|c| c.effective.contains(rustix::thread::CapabilitySet::SETPCAP))
}

/// Clears the ambient set, then the effective, permitted and inheritable sets.
fn clear_sets() -> Result<(), PrivilegeError> {
    use rustix::thread::{CapabilitySet, CapabilitySets};
    match rustix::thread::clear_ambient_capability_set() {
        // A kernel before 4.3 has no ambient set.
        Ok(()) | Err(rustix::io::Errno::INVAL) => {}
        Err(e) => return Err(call("clear the ambient capabilities")(e)),
    }
    rustix::thread::set_capabilities(
        None,
        CapabilitySets {
            effective: CapabilitySet::empty(),
            permitted: CapabilitySet::empty(),
            inheritable: CapabilitySet::empty(),
        },
    )
    .map_err(call("clear the capability sets"))
}
