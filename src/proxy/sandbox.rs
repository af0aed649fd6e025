//! The network side confines itself before it reads any network byte: Landlock (the files it
//! reads and writes, the TCP ports it connects to, no execution, no signals or abstract sockets
//! outside its domain) and a seccomp allow-list (the calls it makes, with their arguments
//! checked where a call does more than one thing, [`super::syscalls`]; `execve`, `ptrace`,
//! mounts, modules, keyrings, BPF, io_uring, new namespaces and the rest answer `EPERM`), with
//! `no_new_privs`.
//!
//! Best effort by default, as ghostunnel does: on a kernel without Landlock the proxy runs and
//! says so (`hwkey_sandbox_enforced{layer}` 0, one log line naming the ABI and what is
//! restricted). `--sandbox=required` refuses to start without both layers; `--sandbox=off`
//! turns it off (for debugging; named in the log). After confining itself the proxy checks the
//! result: it tries to read the PIN file, the PKCS#11 module and a TPM key file, which must
//! fail, and none of them may lie in a directory it writes; a hole stops the start in every
//! mode but `off`.
//!
//! Landlock restricts the calling thread and the threads it starts: [`confine`] runs on the
//! main thread before any other thread exists (the runtimes, the connection threads).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, NetPort, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};
use seccompiler::{SeccompAction, SeccompFilter, TargetArch};

/// Why `--sandbox=required` refused to start.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum SandboxError {
    #[error("--sandbox=required, but the network side cannot be confined: {missing} is missing (use a kernel with Landlock, or --sandbox=auto to run confined as far as possible)")]
    Missing { missing: String },

    #[error("the network side could still read or delete {files}, which only the signer side may touch: keep PIN files, key files and the rejected-PIN memory (HWKEY_PIN_STATE_DIR) out of the state directory and the listeners' socket directories (the network side writes there), or start with --sandbox=off to run unconfined")]
    Hole { files: String },
}

/// How the network side confines itself (`--sandbox`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxMode {
    /// Confine as far as the kernel allows, and say what is not enforced.
    #[default]
    Auto,
    /// Refuse to start unless Landlock and the seccomp filter are both enforced and the
    /// self-check finds no hole.
    Required,
    /// No confinement (debugging).
    Off,
}

/// What the network side may touch once confined.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Files and directories it reads (beneath a directory: everything in it).
    pub read: Vec<PathBuf>,
    /// Directories it writes in (files made, replaced and removed there).
    pub write: Vec<PathBuf>,
    /// TCP ports it connects to.
    pub connect: Vec<u16>,
    /// Whether it resolves names (an API server or a forward proxy given by name): then it
    /// may make UDP sockets (DNS); otherwise an IPv4/IPv6 datagram socket is refused.
    pub dns: bool,
    /// Files it must not be able to read once confined: the self-check.
    pub forbidden: Vec<PathBuf>,
}

/// What was enforced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Report {
    /// Landlock's ABI when it is enforced (fully or partly), else None.
    pub landlock: Option<i32>,
    /// Whether every Landlock restriction asked for is enforced.
    pub landlock_full: bool,
    /// Whether the seccomp filter is installed.
    pub seccomp: bool,
    /// Whether `no_new_privs` is set.
    pub no_new_privs: bool,
    /// Whether every capability was dropped (for a root network side: none left in any set).
    pub no_capabilities: bool,
}

/// Confines this process as `plan` says, per `mode`, and checks the result.
pub fn confine(mode: SandboxMode, plan: &Plan) -> Result<Report, SandboxError> {
    if mode == SandboxMode::Off {
        tracing::warn!("sandbox off (--sandbox=off): the network side is not confined");
        let holes = self_check(plan);
        if !holes.is_empty() {
            tracing::warn!(readable = ?holes, "sandbox off: the network side can read what only the signer needs");
        }
        return Ok(Report::default());
    }
    let mut report = Report::default();
    // Capabilities first: dropping the bounding set needs CAP_SETPCAP, which the seccomp filter
    // and Landlock do not take away but the drop itself does.
    match super::privileges::drop_all() {
        Ok(()) => report.no_capabilities = true,
        Err(e) => tracing::warn!(error = %e, "the network side keeps capabilities"),
    }
    match landlock(plan) {
        Ok((status, abi)) => {
            report.no_new_privs = status.no_new_privs;
            report.landlock_full = status.ruleset == RulesetStatus::FullyEnforced;
            if status.ruleset != RulesetStatus::NotEnforced {
                report.landlock = Some(abi);
            }
        }
        Err(e) => tracing::warn!(error = %e, "Landlock could not be set up"),
    }
    match seccomp(plan.dns) {
        Ok(()) => report.seccomp = true,
        Err(e) => tracing::warn!(error = %e, "the seccomp filter could not be installed"),
    }
    let holes = if report.landlock.is_some() {
        self_check(plan)
    } else {
        Vec::new()
    };
    announce(plan, &report, &holes);
    if mode == SandboxMode::Required {
        required(&report)?;
    }
    // A secret within reach is a refusal in every mode but an explicit `off`: a proxy that
    // only logged it ran with the PIN readable by whoever takes its network side.
    if !holes.is_empty() {
        return Err(SandboxError::Hole {
            files: holes
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        });
    }
    Ok(report)
}

/// `--sandbox=required`: every layer on, or a refusal naming what is missing.
fn required(report: &Report) -> Result<(), SandboxError> {
    let mut missing = Vec::new();
    if report.landlock.is_none() {
        missing.push("Landlock (kernel 5.13 or later, with landlock in the lsm= list)");
    }
    if !report.seccomp {
        missing.push("the seccomp filter");
    }
    if !report.no_capabilities {
        missing.push("dropping every capability");
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(SandboxError::Missing {
            missing: missing.join(" and "),
        })
    }
}

/// The Landlock ruleset: read and write where the plan says, connect to its ports, no
/// execution anywhere, signals and abstract sockets scoped to the sandbox.
fn landlock(plan: &Plan) -> Result<(landlock::RestrictionStatus, i32), landlock::RulesetError> {
    let abi = ABI::V6;
    let all = AccessFs::from_all(abi);
    let read = AccessFs::from_read(abi);
    let write = all & !AccessFs::Execute;
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(all)?
        .handle_access(AccessNet::from_all(abi))?
        .scope(Scope::from_all(abi))?
        .create()?;
    for (paths, access) in [(&plan.read, read), (&plan.write, write)] {
        for path in paths {
            // A path that does not exist (an optional DNS file) is simply not allowed.
            if let Ok(fd) = PathFd::new(path) {
                let access = if path.is_dir() {
                    access
                } else {
                    access & AccessFs::from_file(abi)
                };
                ruleset = ruleset.add_rule(PathBeneath::new(fd, access))?;
            }
        }
    }
    for port in &plan.connect {
        ruleset = ruleset.add_rule(NetPort::new(*port, AccessNet::ConnectTcp))?;
    }
    let status = ruleset.no_new_privs(true).restrict_self()?;
    let abi = match status.landlock {
        landlock::LandlockStatus::Available { effective_abi, .. } => effective_abi as i32,
        _ => 0,
    };
    Ok((status, abi))
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
    #[error(transparent)]
    Seccomp(#[from] seccompiler::Error),
    #[error(transparent)]
    Rules(#[from] seccompiler::BackendError),
    #[error("only {installed} of the {total} seccomp filters are on: {error}")]
    Partial {
        installed: usize,
        total: usize,
        error: seccompiler::Error,
    },
}

/// The seccomp filters, on every thread.
fn seccomp(dns: bool) -> Result<(), FilterError> {
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
        super::syscalls::allowed(dns)?,
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

/// The forbidden files this process can still read (none, when confinement works).
fn self_check(plan: &Plan) -> Vec<PathBuf> {
    plan.forbidden
        .iter()
        .filter(|p| readable(p) || deletable(p, &plan.write))
        .cloned()
        .collect()
}

/// Whether `path` lies in one of the directories the network side writes (where it could
/// delete or replace it), however either is spelled.
fn deletable(path: &Path, write: &[PathBuf]) -> bool {
    let Some(dir) = path.parent().and_then(|d| std::fs::canonicalize(d).ok()) else {
        return false;
    };
    write
        .iter()
        .filter_map(|w| std::fs::canonicalize(w).ok())
        .any(|w| dir.starts_with(&w))
}

fn readable(path: &Path) -> bool {
    std::fs::File::open(path).is_ok()
}

/// One log line: what is enforced and what is not.
fn announce(plan: &Plan, report: &Report, holes: &[PathBuf]) {
    let list = |paths: &[PathBuf]| {
        paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let landlock = match report.landlock {
        Some(abi) if report.landlock_full => format!("Landlock ABI {abi} enforced"),
        Some(abi) => format!("Landlock ABI {abi} partly enforced (an older kernel)"),
        None => "Landlock NOT enforced (kernel without Landlock)".to_string(),
    };
    let ports = plan
        .connect
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",");
    tracing::info!(
        read = %list(&plan.read),
        write = %list(&plan.write),
        connect = %ports,
        seccomp = report.seccomp,
        no_new_privs = report.no_new_privs,
        "sandbox: {landlock}; no execution, no signals outside; seccomp {}; {}",
        if report.seccomp { "allow-list on (no execve, ptrace, mounts, modules, keyrings, BPF, io_uring, namespaces, chmod/chown, mknod, links, raw sockets, TIOCSTI)" } else { "NOT on" },
        if report.no_capabilities { "no capabilities" } else { "capabilities KEPT" }
    );
    if !holes.is_empty() {
        tracing::error!(readable = %list(holes), "sandbox self-check: the network side can still read what only the signer needs");
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
mod tests {
    use super::try_filters::*;

    /// The network side's filter refuses a ring (io_uring), and still allows what it needs.
    /// The filter goes on one thread of the test process only (`apply_filter`, not the
    /// all-threads variant the proxy uses), and the kernel must make rings for a thread
    /// without it, or the test would prove nothing: where it does not (`io_uring_disabled`, a
    /// container's default seccomp profile), only the list is checked, said on stderr, and
    /// under `CI` that is a failure.
    #[test]
    fn the_filter_refuses_io_uring() {
        let allowed = super::super::syscalls::allowed(true).expect("rules");
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
