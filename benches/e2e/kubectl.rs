//! Figures: kubectl and the exec plugin against the stand-in API server.

use super::*;

/// A kubeconfig written by `hwkey kubeconfig` (exec plugin, proxy started on first use) and a
/// plain one with the software certificate, both for the same upstream.
pub(crate) struct Kube {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) hwkey_config: PathBuf,
    pub(crate) plain_config: PathBuf,
    pub(crate) state: PathBuf,
    pub(crate) envs: Vec<(String, String)>,
}

impl Kube {
    pub(crate) fn new(f: &Fixture) -> Kube {
        let dir = temp_dir();
        let hwkey_config = dir.path().join("hwkey.kubeconfig");
        let plain_config = dir.path().join("plain.kubeconfig");
        let state = dir.path().join("state");
        run_ok(
            hwkey()
                .envs(f.id.envs())
                .args(["kubeconfig", "--name", "bench", "--key", &f.id.key_uri])
                .arg("--cert")
                .arg(&f.id.cert)
                .args(["--server", &f.upstream.url()])
                .arg("--ca")
                .arg(f.id.ca.ca_path())
                .arg("--out")
                .arg(&hwkey_config)
                .arg("--state-dir")
                .arg(&state)
                .args(["--idle-exit", "15m"]),
        );
        let plain = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: plain\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: plain\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: plain\n  context:\n    cluster: plain\n    user: plain\ncurrent-context: plain\n",
            f.upstream.url(),
            f.id.ca.ca_path().display(),
            f.soft_cert.display(),
            f.soft_key.display()
        );
        std::fs::write(&plain_config, plain).expect("write the plain kubeconfig");
        Kube {
            envs: f.id.envs(),
            dir,
            hwkey_config,
            plain_config,
            state,
        }
    }

    pub(crate) fn kubectl(&self, config: &Path) -> Command {
        let mut cmd = Command::new("/usr/bin/kubectl");
        cmd.envs(self.envs.clone())
            .env("HOME", self.dir.path())
            .env_remove("KUBERNETES_EXEC_INFO")
            .env_remove("KUBECONFIG")
            .arg("--kubeconfig")
            .arg(config)
            .args(["get", "--raw", "/version"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    }

    /// Wall time of one command in ms; panics (with its output) if it fails.
    pub(crate) fn time(cmd: &mut Command) -> f64 {
        let start = Instant::now();
        let out = cmd.output().expect("run");
        let ms = start.elapsed().as_secs_f64() * 1e3;
        assert!(
            out.status.success(),
            "{cmd:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        ms
    }

    /// The environment client-go gives the plugin of the hwkey kubeconfig: KUBERNETES_EXEC_INFO
    /// (no cluster: the kubeconfig does not set provideClusterInfo) and the exec block's env.
    pub(crate) fn exec_env(&self) -> Vec<(String, String)> {
        let text = std::fs::read_to_string(&self.hwkey_config).expect("kubeconfig");
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("YAML");
        let info = serde_json::json!({
            "apiVersion": "client.authentication.k8s.io/v1",
            "kind": "ExecCredential",
            "spec": {"interactive": false},
        });
        let mut env = vec![("KUBERNETES_EXEC_INFO".to_string(), info.to_string())];
        for var in doc["users"][0]["user"]["exec"]["env"]
            .as_sequence()
            .expect("the exec block's env")
        {
            let field = |f: &str| var[f].as_str().expect("name and value").to_string();
            env.push((field("name"), field("value")));
        }
        env
    }

    pub(crate) fn proxy_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.state.join("proxy.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for Kube {
    /// Stops the proxy the exec plugin started (SIGTERM, then SIGKILL), by its PID.
    fn drop(&mut self) {
        if let Some(pid) = self.proxy_pid() {
            let signal = |s| {
                if let Some(p) = rustix::process::Pid::from_raw(pid) {
                    let _ = rustix::process::kill_process(p, s);
                }
            };
            signal(rustix::process::Signal::TERM);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && Path::new(&format!("/proc/{pid}")).exists() {
                std::thread::sleep(Duration::from_millis(20));
            }
            if Path::new(&format!("/proc/{pid}")).exists() {
                signal(rustix::process::Signal::KILL);
            }
        }
    }
}

pub(crate) fn kubectl_and_exec(f: &Fixture) -> Vec<Row> {
    if !Path::new("/usr/bin/kubectl").exists() {
        return vec![
            Row::new("kubectl", "kubectl get --raw /version", "ms", None)
                .note("not measured: /usr/bin/kubectl is missing"),
        ];
    }
    let kube = Kube::new(f);
    // Warm: the first hwkey run starts the proxy; both warm the page cache.
    Kube::time(&mut kube.kubectl(&kube.hwkey_config));
    Kube::time(&mut kube.kubectl(&kube.plain_config));
    let rounds = pick(12, 4);
    let mut hw = Vec::new();
    let mut plain = Vec::new();
    for round in 0..rounds {
        if round % 2 == 0 {
            hw.push(Kube::time(&mut kube.kubectl(&kube.hwkey_config)));
            plain.push(Kube::time(&mut kube.kubectl(&kube.plain_config)));
        } else {
            plain.push(Kube::time(&mut kube.kubectl(&kube.plain_config)));
            hw.push(Kube::time(&mut kube.kubectl(&kube.hwkey_config)));
        }
    }
    let kubectl = ratio_row(
        "kubectl",
        "`kubectl get --raw /version`, hwkey kubeconfig, proxy warm",
        "ms",
        &hw,
        "plain cert/key kubeconfig, same upstream",
        &plain,
    );
    let met = kubectl.ratio.map(|r| r.median <= 1.25);
    let kubectl = kubectl.target("≤ 1.25×", met).note("includes one `hwkey-credential` run per kubectl invocation (client-go caches only in-process)");

    let exec_env = kube.exec_env();
    let runs = pick(30, 8);
    let plugin_bin = support::hwkey_bin().with_file_name("hwkey-credential");
    let plugin_cmd = |bin: &Path, args: &[&str]| {
        let mut cmd = Command::new(bin);
        cmd.envs(kube.envs.clone())
            .env_remove("RUST_LOG")
            .envs(exec_env.clone())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd
    };
    // The exec floor: `cat` of an answer the plugin gave, what no plugin can undercut by much.
    let answer = kube.dir.path().join("answer.json");
    let out = run_ok(&mut plugin_cmd(&plugin_bin, &[]));
    std::fs::write(&answer, &out.stdout).expect("write the plugin's answer");
    // The baseline build's plugin, against the same proxy (the control API is the same).
    let baseline_bin = std::env::var_os("HWKEY_BENCH_BASELINE_BIN").map(PathBuf::from);
    let (baseline_plugin, baseline_note) =
        match usable_baseline_plugin(baseline_bin.as_deref(), |bin| plugin_cmd(bin, &[])) {
            Ok(bin) => (Some(bin), String::new()),
            Err(why) => {
                eprintln!("e2e: the baseline build's plugin is left out: {why}");
                (None, why)
            }
        };
    let (mut plugin, mut full, mut spawn) = (Vec::new(), Vec::new(), Vec::new());
    let (mut cat, mut before) = (Vec::new(), Vec::new());
    for round in 0..runs {
        // What the generated kubeconfig runs, the same plugin as a subcommand of hwkey, `cat`
        // of its answer and the baseline's plugin, every other round in reverse.
        let mut order = vec![0, 1, 2, 3];
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            match i {
                0 => plugin.push(Kube::time(&mut plugin_cmd(&plugin_bin, &[]))),
                1 => full.push(Kube::time(&mut plugin_cmd(
                    &support::hwkey_bin(),
                    &["credential"],
                ))),
                2 => cat.push(Kube::time(
                    Command::new("/bin/cat").arg(&answer).stdout(Stdio::piped()),
                )),
                _ => {
                    if let Some(bin) = &baseline_plugin {
                        before.push(Kube::time(&mut plugin_cmd(bin, &[])));
                    }
                }
            }
        }
        spawn.push(Kube::time(Command::new("/bin/true").stdout(Stdio::null())));
    }
    let c = Stat::of(&plugin);
    let f = Stat::of(&full);
    let exec = ratio_row(
        "exec",
        "`hwkey-credential` wall time (what the kubeconfig runs), proxy warm",
        "ms",
        &plugin,
        "spawning /bin/true (process start cost)",
        &spawn,
    )
    .target("≤ 10 ms median", Some(c.median <= 10.0))
    .note(format!(
        "the ratio is to process start-up only, not a target; `hwkey credential` (the full binary, which links the TSS and OpenSSL) took {:.2} ms [{:.2}–{:.2}] in the same rounds",
        f.median, f.p25, f.p75
    ));
    let floor = ratio_row(
        "exec",
        "`hwkey-credential` wall time, proxy warm, against the exec floor",
        "ms",
        &plugin,
        "`/bin/cat` of an answer the plugin gave (the exec floor)",
        &cat,
    )
    .note("what hwkey's plugin costs kubectl beyond the least any exec plugin costs it: its start-up and one control request");
    let mut rows = vec![kubectl, exec, floor];
    rows.push(
        match (&baseline_plugin, std::env::var("HWKEY_BENCH_BASELINE_REF")) {
            (Some(_), reference) => ratio_row(
                "exec",
                "`hwkey-credential` wall time, proxy warm, against the baseline build's",
                "ms",
                &plugin,
                &format!(
                    "the `hwkey-credential` of {} against the same proxy",
                    reference.unwrap_or_else(|_| "the baseline build".into())
                ),
                &before,
            ),
            (None, _) => Row::new(
                "exec",
                "`hwkey-credential` wall time, proxy warm, against the baseline build's",
                "ms",
                None,
            )
            .note(format!("not measured: {baseline_note}")),
        },
    );
    rows
}

/// The `hwkey-credential` beside the baseline build's `hwkey` (`baseline_bin`), if it answers
/// the call `call` makes of it; else why not. An older build may not take this kubeconfig's
/// call (4ea3478's plugin wants its key in the exec extension of a kubeconfig with
/// provideClusterInfo): its row is then left out with the reason, rather than ending the
/// bench after its other steps ran.
pub(crate) fn usable_baseline_plugin(
    baseline_bin: Option<&Path>,
    call: impl Fn(&Path) -> Command,
) -> Result<PathBuf, String> {
    let Some(bin) = baseline_bin.map(|b| b.with_file_name("hwkey-credential")) else {
        return Err("no HWKEY_BENCH_BASELINE_BIN".into());
    };
    if !bin.is_file() {
        return Err(format!(
            "no {} (hsm-fixtures/bench.sh --baseline REF builds it for a commit that has it)",
            bin.display()
        ));
    }
    let out = call(&bin)
        .output()
        .map_err(|e| format!("{} does not start: {e}", bin.display()))?;
    if out.status.success() {
        return Ok(bin);
    }
    let said = String::from_utf8_lossy(&out.stderr);
    Err(format!(
        "{} does not answer this kubeconfig's call ({}): {}",
        bin.display(),
        out.status,
        said.lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or("nothing on stderr")
    ))
}
