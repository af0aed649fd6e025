//! kubectl as a user runs it: a kubeconfig written by `hwkey kubeconfig`, whose exec plugin
//! starts the proxy on first use. The proxy the plugin started is stopped on Drop.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::{find_tool, hwkey, run_ok, temp_dir};

/// Fails (never skips) when kubectl is missing.
pub fn require_kubectl() {
    if find_tool("kubectl").is_none() {
        panic!("kubectl not found: install kubectl >= 1.24 (Debian's kubernetes-client 1.20 is too old for client.authentication.k8s.io/v1)");
    }
}

/// One user's kubectl, pointed at `server` through hwkey.
pub struct KubectlUser {
    // Dropped first (fields drop in order): the proxy is stopped while its state directory,
    // which names its pid, still exists.
    proxy: PluginProxy,
    dir: TempDir,
    kubeconfig: PathBuf,
    state: PathBuf,
    envs: Vec<(String, String)>,
}

impl KubectlUser {
    /// Writes the kubeconfig for `key_uri` + `cert` against `server` (trusting `ca`); `envs`
    /// are the key's environment (TCTI, module settings), which kubectl passes on to the plugin.
    pub fn new(
        key_uri: &str,
        cert: &Path,
        server: &str,
        ca: &Path,
        envs: Vec<(String, String)>,
    ) -> KubectlUser {
        KubectlUser::over(None, key_uri, cert, server, ca, envs)
    }

    /// Like [`KubectlUser::new`], merged into a kubeconfig that holds `existing` (YAML) first:
    /// the user's own entries, e.g. the cluster's entry with a `proxy-url`, named `hw`.
    pub fn over(
        existing: Option<&str>,
        key_uri: &str,
        cert: &Path,
        server: &str,
        ca: &Path,
        envs: Vec<(String, String)>,
    ) -> KubectlUser {
        require_kubectl();
        let dir = temp_dir();
        let kubeconfig = dir.path().join("kubeconfig");
        let state = dir.path().join("state");
        if let Some(yaml) = existing {
            std::fs::write(&kubeconfig, yaml).expect("write the existing kubeconfig");
        }
        run_ok(
            hwkey()
                .envs(envs.clone())
                .args(["kubeconfig", "--name", "hw", "--key", key_uri])
                .arg("--cert")
                .arg(cert)
                .args(["--server", server])
                .arg("--ca")
                .arg(ca)
                .arg("--out")
                .arg(&kubeconfig)
                .arg("--state-dir")
                .arg(&state)
                .args(["--idle-exit", "10m"]),
        );
        KubectlUser {
            dir,
            kubeconfig,
            proxy: PluginProxy::in_state_dir(&state),
            state,
            envs,
        }
    }

    /// kubectl with this user's kubeconfig.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.envs(self.envs.clone())
            .env("HOME", self.dir.path())
            .env_remove("KUBERNETES_EXEC_INFO")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig);
        cmd
    }

    /// The kubeconfig file.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The state directory the plugin and its proxy use.
    pub fn state_dir(&self) -> &Path {
        &self.state
    }

    /// The proxy the plugin started, if one runs.
    pub fn proxy_pid(&self) -> Option<i32> {
        self.proxy.pid()
    }

    /// What the proxies the plugin started wrote.
    pub fn proxy_log(&self) -> String {
        std::fs::read_to_string(self.state.join("proxy.log")).unwrap_or_default()
    }

    /// Stops the proxy the plugin started (the next kubectl starts a new one).
    pub fn stop_proxy(&self) {
        self.proxy.stop();
    }
}

/// The proxy an exec plugin started in a state directory, stopped on Drop. A test that runs
/// kubectl with a kubeconfig of its own holds one for each state directory, so no proxy it
/// started outlives it (hsm-fixtures/test.sh fails the run when one does).
pub struct PluginProxy {
    state: PathBuf,
}

impl PluginProxy {
    /// The proxy (if any) that a plugin starts in `state`.
    pub fn in_state_dir(state: &Path) -> PluginProxy {
        PluginProxy {
            state: state.to_path_buf(),
        }
    }

    /// Its pid, while `proxy.pid` names one.
    pub fn pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.state.join("proxy.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Stops it now (the next kubectl starts a new one).
    pub fn stop(&self) {
        if let Some(pid) = self.pid() {
            stop_pid(pid);
        }
    }
}

impl Drop for PluginProxy {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether process `pid` runs (a zombie has exited).
pub fn alive(pid: i32) -> bool {
    // A zombie has exited too: look at /proc state.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// SIGTERM, then SIGKILL if the process is still there after 20 s.
pub fn stop_pid(pid: i32) {
    let _ = Command::new("kill")
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if alive(pid) {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
}
