//! Descriptor budget: a proxy started by `hwkey credential` inherits the shell's soft
//! RLIMIT_NOFILE (often 1024), while `--max-connections` defaults to 4096 and every bridged
//! connection holds two descriptors (client and upstream). At start the soft limit is raised to
//! the hard limit, and `--max-connections` is lowered to what fits, keeping room for the
//! unauthenticated handshakes, the admin and control listeners, the runtimes and the process
//! itself — so the
//! proxy never runs into EMFILE by its own configuration.

/// How many loopback TLS handshakes may be unauthenticated at once: a flood from another local
/// user can hold at most this many descriptors, and never the `--max-connections` slots of
/// authenticated clients. Admission is by uid ([`super::admission`]): the proxy's own uid and
/// `--allow-uid` are never turned away by another uid.
pub const PREAUTH_BUDGET: usize = 128;

/// At most this many admin connections at once, so no local user can exhaust the proxy's
/// descriptors through the admin listener. On loopback TCP they are admitted by uid
/// ([`super::admission`]): another uid's flood sheds its own oldest connections, never the
/// proxy's own uid's (a supervisor's `/healthz` probe runs as the proxy's user or root).
pub const ADMIN_MAX_CONNECTIONS: usize = 32;

/// Descriptors kept for everything but bridged connections: the listeners, the token or TPM,
/// log files, the control socket's clients.
const RESERVED: usize = 64;

/// Raises the soft descriptor limit as far as allowed and returns the number of connections
/// that fit (at most `wanted`), `runtimes` runtimes and `relay_loops` relay loops holding their
/// own descriptors, each loop a copy of each of the `unix_listeners`.
pub fn fit_connections(
    wanted: usize,
    runtimes: usize,
    (relay_loops, unix_listeners): (usize, usize),
) -> usize {
    let limit = raise_nofile();
    let Some(limit) = limit else {
        return wanted;
    };
    let reserved = RESERVED
        + PREAUTH_BUDGET
        + ADMIN_MAX_CONNECTIONS
        + super::spare::DESCRIPTORS
        + runtimes * super::threads::DESCRIPTORS_PER_RUNTIME
        + relay_loops * (super::relay_loop::DESCRIPTORS_PER_LOOP + unix_listeners);
    let fit = (limit.saturating_sub(reserved as u64) / 2).max(1);
    let fit = usize::try_from(fit).unwrap_or(usize::MAX);
    if wanted > fit {
        tracing::warn!(
            wanted,
            using = fit,
            rlimit_nofile = limit,
            "--max-connections does not fit the descriptor limit (2 per connection, {reserved} kept for handshakes, admin and control): lowered; raise `ulimit -n` (LimitNOFILE= under systemd) for more"
        );
        fit
    } else {
        wanted
    }
}

/// Sets the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force.
fn raise_nofile() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let Some(current) = limit.current else {
        return None; // unlimited: nothing to raise, and no number to size the pool with
    };
    if limit.maximum.is_some_and(|max| current < max) {
        // Raising the soft limit up to the hard limit is always permitted.
        let raised = Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if setrlimit(Resource::Nofile, raised).is_ok() {
            return limit.maximum;
        }
    }
    Some(current)
}
