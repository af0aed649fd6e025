//! A private swtpm TPM 2.0 simulator per test, on free loopback ports.

use std::fs::{self};
use std::path::Path;
use std::process::Command;

use tempfile::TempDir;

use crate::*;

/// A TPM 2.0 simulator (swtpm) on 127.0.0.1:P (commands) and P+1 (control); killed on Drop.
pub struct Swtpm {
    guard: ChildGuard,
    port: u16,
    dir: TempDir,
}

impl Swtpm {
    /// Starts swtpm with fresh state in a temp dir on a free port pair and waits until it listens.
    pub fn start() -> Swtpm {
        require_tool("swtpm", "swtpm");
        let dir = temp_dir();
        let (guard, port) = Self::spawn(dir.path(), free_port_pair);
        Swtpm { guard, port, dir }
    }

    /// Spawns swtpm with its state in DIR/state on the port `pick_port` gives (retrying on early exit).
    fn spawn(dir: &Path, pick_port: impl FnMut() -> u16) -> (ChildGuard, u16) {
        let state = dir.join("state");
        fs::create_dir_all(&state).expect("create swtpm state dir");
        let log = dir.join("swtpm.log");
        start_server("swtpm", &log, pick_port, |port| {
            let mut cmd = Command::new("swtpm");
            cmd.arg("socket")
                .arg("--tpmstate")
                .arg(format!("dir={}", state.display()))
                .arg("--tpm2")
                .arg("--server")
                .arg(format!("type=tcp,port={port},bindaddr=127.0.0.1"))
                .arg("--ctrl")
                .arg(format!("type=tcp,port={},bindaddr=127.0.0.1", port + 1))
                .args(["--flags", "not-need-init,startup-clear"]);
            cmd
        })
    }

    /// Kills swtpm and starts it again on the same ports and state (a TPM reset: transient objects are gone, persistent ones stay).
    pub fn restart(&mut self) {
        self.stop();
        self.start_again();
    }

    /// Kills swtpm (the TPM is gone until [`Swtpm::start_again`]).
    pub fn stop(&mut self) {
        self.guard.kill();
    }

    /// Starts a stopped swtpm again on the same ports and state.
    pub fn start_again(&mut self) {
        let port = self.port;
        let mut ports = std::iter::repeat(port);
        let (guard, _) = Self::spawn(self.dir.path(), move || ports.next().unwrap_or(port));
        self.guard = guard;
    }

    /// The simulator's process id (tests pause it with SIGSTOP to play a very slow TPM).
    pub fn pid(&self) -> u32 {
        self.guard.id()
    }

    /// The TCTI string for tpm2-tools / tss-esapi: `swtpm:host=127.0.0.1,port=P`.
    pub fn tcti(&self) -> String {
        format!("swtpm:host=127.0.0.1,port={}", self.port)
    }

    /// The TPM command port P (the control port is P+1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The temp dir holding the TPM state and the log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Environment for tpm2-tools and hwkey: `TPM2TOOLS_TCTI`.
    pub fn envs(&self) -> Vec<(String, String)> {
        vec![("TPM2TOOLS_TCTI".to_string(), self.tcti())]
    }

    /// Runs a tpm2-tools command (`args[0]` is the tool) in `dir` against this TPM, then flushes
    /// the transient objects it left loaded: without a resource manager every tpm2-tools run
    /// leaves its objects in the TPM, and swtpm has three slots.
    pub fn tool(&self, dir: &Path, args: &[&str]) {
        crate::run_ok(
            Command::new(args[0])
                .envs(self.envs())
                .args(&args[1..])
                .current_dir(dir),
        );
        crate::run_ok(
            Command::new("tpm2_flushcontext")
                .envs(self.envs())
                .arg("-t"),
        );
    }

    /// What swtpm wrote to stdout/stderr so far.
    pub fn log(&self) -> String {
        self.guard.log()
    }
}
