//! The network side's seccomp filters ([`install_filters`]): the system calls it may make once confined,
//! an allow-list, every other call answering `EPERM`, with the arguments checked where a call
//! does more than one thing; `clone3` answered `ENOSYS` and x32 calls `EPERM` before it.
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
//! names and reading the dumpable flag; `prlimit64` only on itself, setting nothing but the
//! descriptor limit; stream and datagram sockets only with the TCP and UDP protocols (not
//! MPTCP, which Landlock's port rules do not cover, nor SCTP).

use std::collections::BTreeMap;

use seccompiler::SeccompCmpArgLen::{self, Dword, Qword};
use seccompiler::{SeccompCmpOp, SeccompCondition, SeccompRule};

use seccompiler::{SeccompAction, SeccompFilter, TargetArch};

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
    libc::SYS_renameat,
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

/// aarch64's older spelling (riscv64 has only `renameat2`).
#[cfg(target_arch = "aarch64")]
const LEGACY: &[libc::c_long] = &[libc::SYS_renameat];

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
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
const NETLINK_ROUTE: libc::c_int = 0;

/// The allow-list as seccompiler rules: a call with no rules is allowed whatever its
/// arguments; one with rules when any rule's conditions all hold.
pub fn allowed_syscalls(dns: bool) -> Result<BTreeMap<i64, Vec<SeccompRule>>, FilterError> {
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
        // Its own process: reading any limit (no new limit: a pointer, all 64 bits compared),
        // and setting the descriptor limit (raised to fit --max-connections, within the hard
        // limit the kernel enforces).
        vec![
            rule(&[
                (0, Dword, SeccompCmpOp::Eq, 0),
                (2, Qword, SeccompCmpOp::Eq, 0),
            ])?,
            rule(&[
                (0, Dword, SeccompCmpOp::Eq, 0),
                (1, Dword, SeccompCmpOp::Eq, libc::RLIMIT_NOFILE as u64),
            ])?,
        ],
    );
    Ok(rules)
}

/// The sockets allowed: UNIX; IPv4 and IPv6 TCP streams (protocol 0 or TCP: not MPTCP, which
/// Landlock's port rules do not cover, nor SCTP), and UDP when names are resolved (`dns`);
/// netlink for socket diagnostics, and for routes when names are resolved.
fn socket_rules(dns: bool) -> Result<Vec<SeccompRule>, FilterError> {
    // The type's low bits, its flags (SOCK_NONBLOCK, SOCK_CLOEXEC) aside.
    let of_type = |t: libc::c_int| (1, Dword, SeccompCmpOp::MaskedEq(0xf), t as u64);
    let family = |f: libc::c_int| (0, Dword, SeccompCmpOp::Eq, f as u64);
    let protocol = |p: libc::c_int| (2, Dword, SeccompCmpOp::Eq, p as u64);
    let mut kinds = vec![(libc::SOCK_STREAM, libc::IPPROTO_TCP)];
    let mut netlink = vec![libc::NETLINK_SOCK_DIAG];
    if dns {
        kinds.push((libc::SOCK_DGRAM, libc::IPPROTO_UDP));
        netlink.push(NETLINK_ROUTE);
    }
    let mut rules = vec![rule(&[family(libc::AF_UNIX)])?];
    for (kind, named) in kinds {
        for f in [libc::AF_INET, libc::AF_INET6] {
            for p in [0, named] {
                rules.push(rule(&[family(f), of_type(kind), protocol(p)])?);
            }
        }
    }
    for p in netlink {
        rules.push(rule(&[family(libc::AF_NETLINK), protocol(p)])?);
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

/// On x86_64 the kernel also takes a system call's number with this bit set (the x32 ABI,
/// where it is built in and enabled), under the same architecture seccomp sees. seccompiler's
/// rules compare whole numbers, so `execve | X32_SYSCALL_BIT` would pass them.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Why the seccomp filters are not (all) on; only logged (`--sandbox=required` then refuses).
#[derive(Debug, thiserror::Error)]
pub(super) enum FilterError {
    #[error(
        "no seccomp filter for the {0} architecture (there is one for x86_64, aarch64 and riscv64)"
    )]
    Architecture(&'static str),
    #[error("{0}")]
    Seccomp(#[from] seccompiler::Error),
    #[error("{0}")]
    Rules(#[from] seccompiler::BackendError),
    #[error("only {installed} of the {total} seccomp filters are on: {error}")]
    Partial {
        installed: usize,
        total: usize,
        error: seccompiler::Error,
    },
}

/// The seccomp filters, on every thread.
pub(super) fn install_filters(dns: bool) -> Result<(), FilterError> {
    let programs = filters(dns)?;
    for (installed, program) in programs.iter().enumerate() {
        if let Err(error) = seccompiler::apply_filter_all_threads(program) {
            return Err(match installed {
                0 => error.into(),
                _ => FilterError::Partial {
                    installed,
                    total: programs.len(),
                    error,
                },
            });
        }
    }
    Ok(())
}

/// The filters' programs, in the order they are installed (the last one installed decides
/// first; a more restrictive answer from any wins).
/// - The first answers `ENOSYS` to `clone3`, whose flags are in memory where seccomp cannot
///   read them: on `ENOSYS` glibc falls back to `clone`, whose flags the allow-list checks
///   (Docker's default profile does the same). Threads are still made that way.
/// - On x86_64 the next answers `EPERM` to every x32 call ([`X32_SYSCALL_BIT`]).
/// - The last is the allow-list ([`super::syscalls`]): every call it does not name, or names
///   with other arguments, answers `EPERM`. Installed last, so it need not allow `seccomp`.
fn filters(dns: bool) -> Result<Vec<seccompiler::BpfProgram>, FilterError> {
    let arch = match std::env::consts::ARCH {
        "x86_64" => TargetArch::x86_64,
        "aarch64" => TargetArch::aarch64,
        "riscv64" => TargetArch::riscv64,
        other => return Err(FilterError::Architecture(other)),
    };
    let clone3 = SeccompFilter::new(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )?;
    let allowed = SeccompFilter::new(
        super::syscalls::allowed_syscalls(dns)?,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        arch,
    )?;
    let mut programs = vec![clone3.try_into()?];
    if cfg!(target_arch = "x86_64") {
        programs.push(x32_refused());
    }
    programs.push(allowed.try_into()?);
    Ok(programs)
}

/// A program that answers `EPERM` to every call numbered with [`X32_SYSCALL_BIT`] (written by
/// hand: seccompiler's rules match single numbers).
fn x32_refused() -> seccompiler::BpfProgram {
    use seccompiler::sock_filter;
    let op = |code: u32, jt: u8, jf: u8, k: u32| sock_filter {
        code: code as u16,
        jt,
        jf,
        k,
    };
    vec![
        // A = seccomp_data.nr
        op(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, 0),
        op(
            libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K,
            0,
            1,
            X32_SYSCALL_BIT,
        ),
        op(
            libc::BPF_RET | libc::BPF_K,
            0,
            0,
            libc::SECCOMP_RET_ERRNO | libc::EPERM as u32,
        ),
        op(libc::BPF_RET | libc::BPF_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    use rustix::io::Errno;
    use rustix::net::{netlink, AddressFamily, SocketType};

    use super::try_filters::{on_a_thread_filtered_for, untried};

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
                let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile);
                // The proxy raises its descriptor limit to fit --max-connections once confined.
                rustix::process::setrlimit(rustix::process::Resource::Nofile, nofile)?;
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
            // IPPROTO_MPTCP: a stream socket Landlock's TCP port rules do not cover.
            let mptcp = rustix::net::socket(
                AddressFamily::INET,
                SocketType::STREAM,
                Some(rustix::net::Protocol::from_raw(
                    rustix::net::RawProtocol::new(262).expect("nonzero"),
                )),
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
                mptcp.map(drop),
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
        assert_eq!(filtered.7, eperm, "an MPTCP socket");
        let resolving = on_a_thread_filtered_for(true, probe);
        assert_eq!(resolving.0, libc::EPERM, "TIOCSTI while resolving names");
        assert_eq!(resolving.1, Ok(()), "UDP while resolving names");
        assert_eq!(resolving.2, Ok(()), "route netlink while resolving names");
    }
}

/// What the filter tests share: running a probe under the filters, and saying why a probe
/// could not be tried.
#[cfg(test)]
pub(super) mod try_filters {
    use super::*;

    /// Runs `probe` on a new thread that has the network side's filters (`apply_filter`: that
    /// thread only, and the threads it makes, not the test process).
    pub(in crate::proxy) fn on_a_filtered_thread<T: Send + 'static>(
        probe: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        on_a_thread_filtered_for(false, probe)
    }

    /// [`on_a_filtered_thread`] with the filters of a network side that resolves names
    /// (`dns`) or not.
    pub(in crate::proxy) fn on_a_thread_filtered_for<T: Send + 'static>(
        dns: bool,
        probe: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        let programs = filters(dns).expect("the filters compile");
        std::thread::spawn(move || {
            for program in &programs {
                seccompiler::apply_filter(program).expect("filter on this thread");
            }
            probe()
        })
        .join()
        .expect("thread")
    }

    /// The system refuses what a probe needs even without the filters, so the filter's effect
    /// cannot be tried here: said on stderr, and a failure under `CI`.
    pub(in crate::proxy) fn untried(why: &str) {
        let why = format!("{why}: the filter's effect was not tried");
        assert!(std::env::var_os("CI").is_none(), "{why}");
        eprintln!("{why}");
    }
}

#[cfg(test)]
mod io_uring_ring {
    use super::try_filters::*;

    /// The network side's filter refuses a ring (io_uring), and still allows what it needs.
    /// The filter goes on one thread of the test process only (`apply_filter`, not the
    /// all-threads variant the proxy uses), and the kernel must make rings for a thread
    /// without it, or the test would prove nothing: where it does not (`io_uring_disabled`, a
    /// container's default seccomp profile), only the list is checked, said on stderr, and
    /// under `CI` that is a failure.
    #[test]
    fn the_filter_refuses_io_uring() {
        let allowed = super::allowed_syscalls(true).expect("rules");
        for call in [
            libc::SYS_io_uring_setup,
            libc::SYS_io_uring_enter,
            libc::SYS_io_uring_register,
        ] {
            assert!(
                !allowed.contains_key(&call),
                "system call {call} is allowed"
            );
        }
        let unfiltered = std::thread::spawn(|| io_uring::IoUring::new(4).map(drop))
            .join()
            .expect("thread");
        if let Err(e) = unfiltered {
            return untried(&format!(
                "this kernel makes no io_uring ring even without the filter ({e}); set \
                 kernel.io_uring_disabled=0 (or run outside a container whose seccomp profile \
                 denies io_uring) to try it"
            ));
        }
        let filtered = on_a_filtered_thread(|| {
            let ring = io_uring::IoUring::new(4).map(drop);
            // What the network side does all day still works under the filter.
            let socket = std::net::TcpListener::bind("127.0.0.1:0").map(drop);
            (ring, socket)
        });
        assert_eq!(
            filtered.0.as_ref().map_err(std::io::Error::raw_os_error),
            Err(Some(libc::EPERM)),
            "io_uring_setup under the filter"
        );
        assert!(
            filtered.1.is_ok(),
            "a socket under the filter: {:?}",
            filtered.1
        );
    }
}

#[cfg(test)]
mod namespaces {
    use super::try_filters::*;

    /// `clone(2)` with `flags` and `SIGCHLD`, like a fork: a child that exits at once, reaped
    /// here. Ok, or the errno.
    #[allow(
        unsafe_code,
        reason = "a raw clone(2): no safe binding makes a process with namespace flags"
    )]
    fn clone_with(flags: libc::c_int) -> Result<(), i32> {
        let flags = (flags | libc::SIGCHLD) as libc::c_ulong;
        // SAFETY: without CLONE_VM the child runs on a copy of this thread's memory and stack;
        // it only calls _exit (async-signal-safe). The parent waits for it.
        let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
        if pid == 0 {
            // SAFETY: the child ends here without running anything of the parent's.
            unsafe { libc::_exit(0) };
        }
        if pid < 0 {
            return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
        }
        let mut status = 0;
        // SAFETY: waits for the child made above, writing its status into a local.
        let waited = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) };
        assert_eq!(waited, pid as libc::pid_t, "waitpid");
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "the child did not exit cleanly: {status:#x}"
        );
        Ok(())
    }

    /// `clone3(2)` with no arguments: its errno (the kernel refuses the empty arguments with
    /// EINVAL, the filter answers before it with ENOSYS).
    #[allow(
        unsafe_code,
        reason = "a raw clone3(2) with a null argument, which makes nothing"
    )]
    fn clone3_errno() -> i32 {
        // SAFETY: a null pointer with size 0 is refused by the kernel (or the filter) before
        // anything is read or made.
        let r = unsafe { libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize) };
        assert_eq!(r, -1, "clone3 with no arguments made something");
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    /// Under the filters a thread cannot make a process in a new user or network namespace
    /// (`unshare` was refused already; `clone` with the flags was not), `clone3` answers
    /// ENOSYS, and threads are still made (glibc falls back to `clone`) as are plain
    /// children. A thread without the filters must be able to make the user namespace, or
    /// the test would prove nothing.
    #[test]
    fn the_filter_refuses_new_namespaces_and_threads_still_start() {
        let unfiltered = std::thread::spawn(|| {
            (
                clone_with(libc::CLONE_NEWUSER).and(clone_with(libc::CLONE_NEWNET)),
                clone3_errno(),
            )
        })
        .join()
        .expect("thread");
        assert_eq!(unfiltered.1, libc::EINVAL, "clone3 without the filter");
        if let Err(e) = unfiltered.0 {
            return untried(&format!(
                "this system makes no user or network namespace even without the filter \
                 (errno {e}); allow unprivileged user namespaces \
                 (kernel.unprivileged_userns_clone=1) or run as root to try it"
            ));
        }
        let (user, net, plain, clone3, thread) = on_a_filtered_thread(|| {
            (
                clone_with(libc::CLONE_NEWUSER),
                clone_with(libc::CLONE_NEWNET),
                clone_with(0),
                clone3_errno(),
                std::thread::spawn(|| 7).join().ok(),
            )
        });
        assert_eq!(
            user,
            Err(libc::EPERM),
            "clone(CLONE_NEWUSER) under the filter"
        );
        assert_eq!(
            net,
            Err(libc::EPERM),
            "clone(CLONE_NEWNET) under the filter"
        );
        assert_eq!(plain, Ok(()), "a plain child under the filter");
        assert_eq!(clone3, libc::ENOSYS, "clone3 under the filter");
        assert_eq!(thread, Some(7), "a thread made under the filter");
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod x32 {
    use super::try_filters::*;
    use super::*;

    /// An x32 system call's errno (getpid, numbered with the x32 bit), or 0 when it ran.
    #[allow(
        unsafe_code,
        reason = "a raw system call by number: no binding makes x32 calls"
    )]
    fn x32_getpid_errno() -> i32 {
        // SAFETY: getpid takes no arguments and changes nothing, whichever ABI runs it.
        let r = unsafe { libc::syscall(X32_SYSCALL_BIT as libc::c_long | libc::SYS_getpid) };
        if r >= 0 {
            return 0;
        }
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    /// Under the filters an x32 call answers EPERM before the kernel looks at it; without them
    /// it runs (x32 enabled) or answers ENOSYS (the usual kernel), never EPERM. Through x32,
    /// `execve` or `clone` would otherwise pass rules that name their x86_64 numbers.
    #[test]
    fn the_filter_refuses_x32_calls() {
        let unfiltered = std::thread::spawn(x32_getpid_errno).join().expect("thread");
        assert_ne!(unfiltered, libc::EPERM, "an x32 call without the filter");
        let filtered = on_a_filtered_thread(|| (x32_getpid_errno(), std::process::id()));
        assert_eq!(filtered.0, libc::EPERM, "an x32 call under the filter");
        assert_eq!(filtered.1, std::process::id(), "getpid under the filter");
    }
}
