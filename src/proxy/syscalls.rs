//! The system calls the network side may make once confined: an allow-list, every other call
//! answering `EPERM`, with the arguments checked where a call does more than one thing.
//!
//! The list is what the network side does (an epoll runtime, TLS, file reads in its state
//! directory, the signer's socket, name resolution), measured by tracing `hwkey-net` through
//! the proxy, exec, lifecycle and approver tests (`strace -f` from `HWKEY_NET_BIN`), plus what
//! the same code does on other machines: time calls where the vDSO is missing, the resolver's
//! `sendmmsg`, an abort's `tgkill`. What it leaves out is every call that changes the host,
//! another process or the process's privileges: `execve`, `ptrace`, mounts, modules,
//! keyrings, BPF, namespaces, io_uring, `chmod`/`chown`, xattrs, `mknod`, links, host name,
//! `syslog`, clocks, and the hundreds of calls it never needs.
//!
//! Checked arguments: `clone` without namespace flags; `socket` only for UNIX, TCP, and, when
//! a name is resolved, UDP, with netlink only for `NETLINK_SOCK_DIAG` (admission by uid) and
//! `NETLINK_ROUTE` (the resolver's address sorting); `socketpair` only for UNIX; `ioctl`
//! only for non-blocking mode, close-on-exec, the bytes waiting and the terminal check (never
//! `TIOCSTI`, which types into the terminal that started the proxy); `prctl` only for thread
//! names and reading the dumpable flag; `prlimit64` only reading its own limits.

use std::collections::BTreeMap;

use seccompiler::SeccompCmpArgLen::{self, Dword, Qword};
use seccompiler::{SeccompCmpOp, SeccompCondition, SeccompRule};

use super::sandbox::FilterError;

/// The calls allowed with any arguments.
const ANY_ARGUMENTS: &[libc::c_long] = &[
    // Memory and threads.
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_mlock,
    libc::SYS_munlock,
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_set_tid_address,
    libc::SYS_rseq,
    // Allowed here so the `clone3` filter's ENOSYS (glibc then falls back to `clone`, whose
    // flags are checked) is the answer, not this filter's EPERM, which would stop threads.
    libc::SYS_clone3,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_getcpu,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_restart_syscall,
    libc::SYS_wait4,
    libc::SYS_waitid,
    // Identity and time (the vDSO's calls are real ones where it is missing).
    libc::SYS_getpid,
    libc::SYS_getppid,
    libc::SYS_gettid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_getresuid,
    libc::SYS_getresgid,
    libc::SYS_getgroups,
    libc::SYS_uname,
    libc::SYS_sysinfo,
    libc::SYS_getrusage,
    libc::SYS_times,
    libc::SYS_getrandom,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_clock_nanosleep,
    libc::SYS_gettimeofday,
    libc::SYS_nanosleep,
    // Signals: its own handlers and masks; an abort signals its own thread (Landlock's scope
    // keeps every signal inside the network side).
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_tgkill,
    // Descriptors and events.
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_pread64,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_pwrite64,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_fcntl,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_pipe2,
    libc::SYS_lseek,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_eventfd2,
    libc::SYS_ppoll,
    // Files (Landlock decides which): the state directory, the system's CA and DNS files.
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_readlinkat,
    libc::SYS_getdents64,
    libc::SYS_getcwd,
    libc::SYS_mkdirat,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_unlinkat,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_ftruncate,
    libc::SYS_flock,
    // Sockets (`socket` and `socketpair` are checked below).
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_shutdown,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendmmsg,
    libc::SYS_recvmmsg,
];

/// The older spellings x86_64 still has, which glibc and std may use there.
#[cfg(target_arch = "x86_64")]
const LEGACY: &[libc::c_long] = &[
    libc::SYS_open,
    libc::SYS_stat,
    libc::SYS_lstat,
    libc::SYS_access,
    libc::SYS_readlink,
    libc::SYS_mkdir,
    libc::SYS_rename,
    libc::SYS_unlink,
    libc::SYS_rmdir,
    libc::SYS_poll,
    libc::SYS_select,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_create,
    libc::SYS_eventfd,
    libc::SYS_pipe,
    libc::SYS_dup2,
    libc::SYS_getrlimit,
    libc::SYS_time,
    libc::SYS_arch_prctl,
];

#[cfg(not(target_arch = "x86_64"))]
const LEGACY: &[libc::c_long] = &[];

/// Namespace flags a `clone` must not carry.
pub const NEW_NAMESPACES: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u64;

/// `ioctl` requests allowed: FIONBIO, FIOCLEX, FIONCLEX, FIONREAD, TCGETS.
const IOCTLS: [u64; 5] = [0x5421, 0x5451, 0x5450, 0x541B, 0x5401];

/// `prctl` options allowed: PR_SET_NAME, PR_GET_NAME, PR_GET_DUMPABLE.
const PRCTLS: [u64; 3] = [15, 16, 3];

/// `NETLINK_ROUTE`: glibc's resolver reads the interfaces' addresses to sort its answers.
const NETLINK_ROUTE: u64 = 0;

/// The allow-list as seccompiler rules: a call with no rules is allowed whatever its
/// arguments; one with rules when any rule's conditions all hold.
pub fn allowed(dns: bool) -> Result<BTreeMap<i64, Vec<SeccompRule>>, FilterError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = ANY_ARGUMENTS
        .iter()
        .chain(LEGACY)
        .map(|nr| (*nr, Vec::new()))
        .collect();
    rules.insert(
        libc::SYS_clone,
        vec![rule(&[(
            0,
            Qword,
            SeccompCmpOp::MaskedEq(NEW_NAMESPACES),
            0,
        )])?],
    );
    rules.insert(libc::SYS_socket, socket_rules(dns)?);
    rules.insert(
        libc::SYS_socketpair,
        vec![rule(&[(0, Dword, SeccompCmpOp::Eq, libc::AF_UNIX as u64)])?],
    );
    rules.insert(libc::SYS_ioctl, one_of(1, &IOCTLS)?);
    rules.insert(libc::SYS_prctl, one_of(0, &PRCTLS)?);
    rules.insert(
        libc::SYS_prlimit64,
        // Its own process, and no new limit (a pointer: all 64 bits compared).
        vec![rule(&[
            (0, Dword, SeccompCmpOp::Eq, 0),
            (2, Qword, SeccompCmpOp::Eq, 0),
        ])?],
    );
    Ok(rules)
}

/// The sockets allowed: UNIX; IPv4 and IPv6 streams, and datagrams when names are resolved
/// (`dns`); netlink for socket diagnostics, and for routes when names are resolved.
fn socket_rules(dns: bool) -> Result<Vec<SeccompRule>, FilterError> {
    // The type's low bits, its flags (SOCK_NONBLOCK, SOCK_CLOEXEC) aside.
    let of_type = |t: libc::c_int| (1, Dword, SeccompCmpOp::MaskedEq(0xf), t as u64);
    let family = |f: libc::c_int| (0, Dword, SeccompCmpOp::Eq, f as u64);
    let mut rules = vec![
        rule(&[family(libc::AF_UNIX)])?,
        rule(&[family(libc::AF_INET), of_type(libc::SOCK_STREAM)])?,
        rule(&[family(libc::AF_INET6), of_type(libc::SOCK_STREAM)])?,
        rule(&[
            family(libc::AF_NETLINK),
            (2, Dword, SeccompCmpOp::Eq, libc::NETLINK_SOCK_DIAG as u64),
        ])?,
    ];
    if dns {
        rules.extend([
            rule(&[family(libc::AF_INET), of_type(libc::SOCK_DGRAM)])?,
            rule(&[family(libc::AF_INET6), of_type(libc::SOCK_DGRAM)])?,
            rule(&[
                family(libc::AF_NETLINK),
                (2, Dword, SeccompCmpOp::Eq, NETLINK_ROUTE),
            ])?,
        ]);
    }
    Ok(rules)
}

/// One rule per allowed value of argument `arg`.
fn one_of(arg: u8, values: &[u64]) -> Result<Vec<SeccompRule>, FilterError> {
    values
        .iter()
        .map(|v| rule(&[(arg, Dword, SeccompCmpOp::Eq, *v)]))
        .collect()
}

/// A rule whose conditions (argument, its width, comparison, value) must all hold. An `int`
/// argument is compared as the kernel reads it, 32 bits; a pointer or `unsigned long`, 64.
fn rule(
    conditions: &[(u8, SeccompCmpArgLen, SeccompCmpOp, u64)],
) -> Result<SeccompRule, FilterError> {
    let conditions = conditions
        .iter()
        .map(|(arg, len, op, value)| SeccompCondition::new(*arg, len.clone(), op.clone(), *value))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(SeccompRule::new(conditions)?)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    use rustix::io::Errno;
    use rustix::net::{netlink, AddressFamily, SocketType};

    use crate::proxy::sandbox::try_filters::{on_a_thread_filtered_for, untried};

    /// `ioctl(fd, TIOCSTI, "x")`: types a byte into `fd`'s terminal. Its errno.
    #[allow(
        unsafe_code,
        reason = "a raw ioctl: no safe binding makes TIOCSTI, which is what is tried"
    )]
    fn tiocsti(fd: std::os::fd::BorrowedFd<'_>) -> i32 {
        use std::os::fd::AsRawFd;
        let byte = b'x';
        // SAFETY: TIOCSTI reads one byte from the pointer, which points at a local; the
        // descriptor is open for the call's duration.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCSTI, &byte as *const u8) };
        assert_eq!(r, -1, "TIOCSTI on a pipe did something");
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    /// What the network side does works under the allow-list: TCP listen, connect, accept
    /// and non-blocking mode (FIONBIO), a UNIX socket pair, reading a file, a thread, the
    /// clock, the terminal check, its own limits, thread names; with `dns`, resolving
    /// `localhost` and a UDP socket.
    #[test]
    fn what_the_network_side_does_is_allowed() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("f");
        std::fs::write(&file, "state").expect("write");
        for dns in [false, true] {
            let file = file.clone();
            let done = on_a_thread_filtered_for(dns, move || -> std::io::Result<()> {
                let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
                let mut client = std::net::TcpStream::connect(listener.local_addr()?)?;
                let (server, _) = listener.accept()?;
                server.set_nonblocking(true)?;
                client.write_all(b"x")?;
                client.set_nonblocking(true)?;
                let (a, _b) = std::os::unix::net::UnixStream::pair()?;
                drop(a);
                let mut text = String::new();
                std::fs::File::open(&file)?.read_to_string(&mut text)?;
                assert_eq!(text, "state");
                assert_eq!(std::thread::spawn(|| 7).join().ok(), Some(7));
                let _ = std::time::SystemTime::now();
                let _ = std::io::IsTerminal::is_terminal(&std::io::stderr());
                rustix::process::getrlimit(rustix::process::Resource::Nofile);
                rustix::thread::set_name(c"hwkey-test")?;
                if dns {
                    let found = std::net::ToSocketAddrs::to_socket_addrs(&("localhost", 80))?;
                    assert!(found.count() > 0, "localhost resolves to nothing");
                    std::net::UdpSocket::bind("127.0.0.1:0")?;
                }
                Ok(())
            });
            assert!(done.is_ok(), "dns={dns}: {done:?}");
        }
    }

    /// Calls the deny list let through answer EPERM under the allow-list: TIOCSTI (typing into
    /// the terminal that started the proxy), a symbolic link in a writable directory, a
    /// dumpable flag set, a raised limit; UDP and route netlink sockets without a name to
    /// resolve, and packet sockets always; socket diagnostics stay allowed. Each is tried
    /// without the filter too: it must not be EPERM there, or the test would prove nothing.
    #[test]
    fn the_allow_list_refuses_what_the_deny_list_let_through() {
        let dir = tempfile::tempdir().expect("dir");
        let link = dir.path().join("link");
        let probe = move || {
            let (reader, _writer) = std::io::pipe().expect("pipe");
            let udp = rustix::net::socket(AddressFamily::INET, SocketType::DGRAM, None);
            // Protocol 0: NETLINK_ROUTE.
            let route = rustix::net::socket(AddressFamily::NETLINK, SocketType::RAW, None);
            let diag = rustix::net::socket(
                AddressFamily::NETLINK,
                SocketType::DGRAM,
                Some(netlink::SOCK_DIAG),
            );
            let symlink = std::os::unix::fs::symlink("/etc/passwd", &link);
            let _ = std::fs::remove_file(&link);
            let limit = rustix::process::getrlimit(rustix::process::Resource::Core);
            (
                tiocsti(reader.as_fd()),
                udp.map(drop),
                route.map(drop),
                diag.map(drop),
                symlink.map_err(|e| e.raw_os_error()),
                rustix::process::setrlimit(rustix::process::Resource::Core, limit),
                rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::Dumpable),
            )
        };
        let unfiltered = std::thread::spawn(probe.clone()).join().expect("thread");
        if unfiltered.0 == libc::EPERM || unfiltered.4 == Err(Some(libc::EPERM)) {
            return untried("TIOCSTI or symlink is refused without the filter");
        }
        let eperm = Err(Errno::PERM);
        let filtered = on_a_thread_filtered_for(false, probe.clone());
        assert_eq!(filtered.0, libc::EPERM, "TIOCSTI");
        assert_eq!(filtered.1, eperm, "a UDP socket without a name to resolve");
        assert_eq!(filtered.2, eperm, "a route netlink socket without a name");
        assert_eq!(filtered.3, Ok(()), "a socket diagnostics socket");
        assert_eq!(filtered.4, Err(Some(libc::EPERM)), "symlink");
        assert_eq!(filtered.5, eperm, "setrlimit");
        assert_eq!(filtered.6, eperm, "PR_SET_DUMPABLE");
        let resolving = on_a_thread_filtered_for(true, probe);
        assert_eq!(resolving.0, libc::EPERM, "TIOCSTI while resolving names");
        assert_eq!(resolving.1, Ok(()), "UDP while resolving names");
        assert_eq!(resolving.2, Ok(()), "route netlink while resolving names");
    }
}
