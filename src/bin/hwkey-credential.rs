//! `hwkey-credential`: the client-go exec plugin alone (see `hwkey::cli::credential_main`).
//!
//! kubectl starts it for every call, so its start-up is on the path of every `kubectl get`. It
//! starts without std's runtime start-up (`no_main`): that start-up looks up the main thread's
//! stack through glibc, which reads and parses all of `/proc/self/maps`, and sets up a signal
//! stack for stack overflows: about 130 µs of a plugin run of about 1.9 ms as kubectl starts
//! it, two thirds of what its control request takes (docs/BENCHMARKS.md, round nineteen). What
//! of that start-up the plugin needs is done here:
//! - standard descriptors 0–2 open;
//! - SIGPIPE ignored;
//! - a panic caught (exit status 101, as std's), so that destructors run and wipe the PIN and
//!   the throw-away key.
//!
//! Arguments and the environment reach std from glibc before `main` (`.init_array`), which
//! only glibc does: the binary is built for glibc targets only. The test harness keeps its own
//! `main` (`cargo test` builds this file too).
#![cfg_attr(not(test), no_main)]

#[cfg(not(target_env = "gnu"))]
compile_error!("hwkey-credential's own `main` relies on glibc handing std the arguments; build it for a -gnu target");

/// The C entry point, in place of std's.
// The reviewed exception to the crate's `unsafe_code = "deny"` (Cargo.toml) for this binary:
// `no_mangle` defines the process's `main` symbol, which nothing else in the binary defines.
#[cfg(not(test))]
#[allow(unsafe_code)]
#[unsafe(no_mangle)]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    if !standard_descriptors_open() {
        return 1;
    }
    // SAFETY: signal(2) changes one disposition before any other thread exists; an ignored
    // SIGPIPE makes a write to a proxy that exited an error the plugin reports, not its silent
    // death. It cannot fail for SIGPIPE with SIG_IGN.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    // Exits through std, which flushes stdout (a return from `main` would not).
    let status = std::panic::catch_unwind(hwkey::cli::credential_main).map_or(101, i32::from);
    std::process::exit(status)
}

/// Opens /dev/null on each of descriptors 0–2 that is closed, as std's start-up does, so that no
/// socket the plugin opens takes such a number and receives the credential meant for stdout.
/// False when that cannot be made sure of.
#[cfg(not(test))]
#[allow(unsafe_code)]
fn standard_descriptors_open() -> bool {
    let mut fds = [0, 1, 2].map(|fd| libc::pollfd {
        fd,
        events: 0,
        revents: 0,
    });
    let closed: Vec<libc::c_int> = loop {
        // SAFETY: poll(2) reads and writes (`revents`) the three pollfd structs of `fds`,
        // which live in this frame for the whole call.
        if unsafe { libc::poll(fds.as_mut_ptr(), 3, 0) } != -1 {
            break fds
                .iter()
                .filter(|p| p.revents & libc::POLLNVAL != 0)
                .map(|p| p.fd)
                .collect();
        }
        match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EINTR) => continue,
            // poll itself unusable (RLIMIT_NOFILE below 3, no memory): ask each descriptor, as
            // std does.
            Some(libc::EINVAL | libc::ENOMEM | libc::EAGAIN) => {
                break (0..3)
                    .filter(|fd| {
                        // SAFETY: fcntl(F_GETFD) only queries the descriptor's flags.
                        let failed = unsafe { libc::fcntl(*fd, libc::F_GETFD) } == -1;
                        failed
                            && std::io::Error::last_os_error().raw_os_error() == Some(libc::EBADF)
                    })
                    .collect();
            }
            _ => return false,
        }
    };
    // The lowest free number is taken first: descriptors are filled in order.
    closed.iter().all(|_| {
        // SAFETY: open(2) gets a NUL-terminated literal; the descriptor it returns is kept
        // open for the life of the process, as the standard descriptor it stands in for.
        unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) != -1 }
    })
}
