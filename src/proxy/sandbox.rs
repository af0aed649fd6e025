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

use std::path::{Path, PathBuf};

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, NetPort, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};

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

/// Installs the network side's seccomp filters on every thread of the calling process, and
/// nothing else of its sandbox. For the benchmarks: a floor relay under the same filters pays
/// what they cost per system call (a seccomp'd call takes the kernel's slow entry path), which
/// tells that cost from what the proxy's own code spends (docs/BENCHMARKS.md). `dns`: whether
/// UDP (name resolution) is allowed, as for a proxy that resolves its upstream's name.
///
/// Irreversible, like the sandbox: it sets `no_new_privs`, and from then on every call the
/// allow-list does not name answers `EPERM`. On an error some of the filters may already be
/// on (the error says how many).
#[doc(hidden)]
pub fn install_seccomp_filters(dns: bool) -> std::io::Result<()> {
    super::syscalls::install_filters(dns).map_err(|e| std::io::Error::other(e.to_string()))
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
    match super::syscalls::install_filters(plan.dns) {
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
