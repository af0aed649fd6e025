//! `hwkey-credential`: the client-go exec plugin alone (see `hwkey::cli::credential_main`).
//!
//! kubectl starts it for every call, so its start-up is on the path of every `kubectl get`. It
//! starts without std's runtime start-up (`no_main`): that start-up looks up the main thread's
//! stack through glibc, which reads and parses all of `/proc/self/maps`, and sets up a signal
//! stack for stack overflows: about 130 µs of the plugin's 1.9 ms as kubectl starts it, more
//! than its control request (docs/BENCHMARKS.md, round nineteen). What of that start-up the
//! plugin needs is done here: standard descriptors 0–2 open, SIGPIPE ignored. Arguments and
//! the environment work as in any std program (glibc hands them to std before `main`).
#![no_main]

/// The C entry point, in place of std's.
// The reviewed exception to the crate's `unsafe_code = "deny"` (Cargo.toml) for this binary:
// `no_mangle` defines the process's `main` symbol, which nothing else in the binary defines.
#[allow(unsafe_code)]
#[unsafe(no_mangle)]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    // SAFETY: what std's start-up does before `main`, with the same calls: poll(2) reads
    // three pollfd structs owned by this frame; open(2) gets a NUL-terminated literal;
    // signal(2) changes a disposition before any other thread exists. A descriptor 0–2 that is
    // closed becomes /dev/null, so that no socket the plugin opens takes its number and
    // receives the credential meant for stdout; an ignored SIGPIPE makes a write to a proxy
    // that exited an error the plugin reports, not its silent death.
    unsafe {
        let mut fds = [0, 1, 2].map(|fd| libc::pollfd {
            fd,
            events: 0,
            revents: 0,
        });
        while libc::poll(fds.as_mut_ptr(), 3, 0) == -1 {
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return 1;
            }
        }
        for pfd in &fds {
            if pfd.revents & libc::POLLNVAL != 0
                && libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) == -1
            {
                return 1;
            }
        }
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    // Exits through std, which flushes stdout (a return from `main` would not).
    std::process::exit(i32::from(hwkey::cli::credential_main()))
}
