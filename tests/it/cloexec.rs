//! Close-on-exec for every socket the test binary opens, the C libraries' included.

/// Every `socket(2)` call in this test binary makes a close-on-exec socket, whoever calls it:
/// this definition stands in for the C library's `socket` (build.rs exports it from the
/// binary, so the shared libraries' calls resolve here too) and adds `SOCK_CLOEXEC` to the
/// type. (`accept` and `socketpair` are not covered; no C library here uses them.)
///
/// Why: the tests run on several threads and many start programs (swtpm, daemons, tools)
/// while others talk to a TPM in this process, and tpm2-tss's swtpm TCTI opens a connection
/// for each command without close-on-exec. A program started while a command was in flight
/// kept that connection, and swtpm, which serves one connection at a time, waited on it for
/// good: CI hung in `key::tpm` until it was killed at 90 minutes. Rust opens its own
/// descriptors close-on-exec already, and hwkey's processes never start a program while they
/// talk to a TPM; only this binary, a test harness, does both at once
/// (`fixtures::a_program_started_while_a_tpm_command_is_in_flight_leaves_the_tpm_free`).
#[no_mangle]
#[allow(
    unsafe_code,
    reason = "the socket system call itself, for every caller in this process"
)]
pub extern "C" fn socket(
    domain: libc::c_int,
    kind: libc::c_int,
    protocol: libc::c_int,
) -> libc::c_int {
    // SAFETY: socket(2) takes three integers and touches no memory of ours; a failure returns
    // -1 with errno set, as the C library's does.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_socket,
            libc::c_long::from(domain),
            libc::c_long::from(kind | libc::SOCK_CLOEXEC),
            libc::c_long::from(protocol),
        )
    };
    libc::c_int::try_from(fd).unwrap_or(-1)
}
