//! kubectl end to end with nothing but the kubeconfig `hwkey kubeconfig` writes: the exec plugin
//! (`hwkey credential`) starts the proxy on first use, hands kubectl a loopback credential, and
//! the proxy signs the upstream handshake inside SoftHSM or the TPM. Real kubectl, real
//! SoftHSM/swtpm, the kube-apiserver stand-in from tests/support/upstream.rs.

// Tests here run on both backends; in a single-backend build the other half is compiled out
// and its helpers are unused.
#![cfg_attr(not(all(feature = "pkcs11", feature = "tpm")), allow(unused))]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use support::flow::{fails_with, stdout};
use support::kubectl::{alive, require_kubectl, stop_pid};
use support::proxy::Identity;
use support::upstream::TestUpstream;
use support::{free_port, hwkey, run_ok, temp_dir};
use tempfile::TempDir;

/// One user's view: a hardware identity, an upstream, and a generated kubeconfig.
struct Cluster {
    id: Identity,
    upstream: TestUpstream,
    dir: TempDir,
    kubeconfig: PathBuf,
    state: PathBuf,
}

impl Cluster {
    fn new(identity: fn() -> Identity, idle_exit: &str) -> Cluster {
        require_kubectl();
        let id = identity();
        let upstream = TestUpstream::start(&id.ca);
        let dir = temp_dir();
        let kubeconfig = dir.path().join("kubeconfig");
        let state = dir.path().join("state");
        let c = Cluster {
            id,
            upstream,
            dir,
            kubeconfig,
            state,
        };
        c.generate(idle_exit);
        c
    }

    /// `hwkey kubeconfig` for this cluster into its kubeconfig (merging, as a user's rerun).
    fn generate(&self, idle_exit: &str) {
        run_ok(
            hwkey()
                .envs(self.id.envs())
                .args(["kubeconfig", "--name", "e2e", "--key", &self.id.key_uri])
                .arg("--cert")
                .arg(&self.id.cert)
                .args(["--server", &self.upstream.url()])
                .arg("--ca")
                .arg(self.id.ca.ca_path())
                .arg("--out")
                .arg(&self.kubeconfig)
                .arg("--state-dir")
                .arg(&self.state)
                .args(["--idle-exit", idle_exit]),
        );
    }

    /// `hwkey doctor --kubeconfig KUBECONFIG` with this cluster's key environment.
    fn doctor(&self, kubeconfig: &Path) -> Command {
        let mut cmd = hwkey();
        cmd.envs(self.id.envs())
            .arg("doctor")
            .arg("--kubeconfig")
            .arg(kubeconfig);
        cmd
    }

    fn kubectl(&self) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.envs(self.id.envs())
            .env("HOME", self.dir.path())
            .env_remove("KUBERNETES_EXEC_INFO")
            .arg("--kubeconfig")
            .arg(&self.kubeconfig);
        cmd
    }

    /// How many times a plugin started a proxy for this cluster.
    fn proxy_starts(&self) -> usize {
        std::fs::read_to_string(self.state.join("proxy.log"))
            .unwrap_or_default()
            .matches("--- hwkey credential starting the proxy")
            .count()
    }

    fn proxy_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.state.join("proxy.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// hwkey's settings extension of the kubeconfig's cluster (the `config` of the exec block's
    /// HWKEY_EXEC_CLUSTER too; what client-go passed as spec.cluster.config for an older one).
    fn extension(&self) -> serde_json::Value {
        let text = std::fs::read_to_string(&self.kubeconfig).expect("kubeconfig");
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("YAML");
        let ext = &doc["clusters"][0]["cluster"]["extensions"][0];
        assert_eq!(ext["name"], "hwkey/settings");
        serde_json::to_value(&ext["extension"]).expect("JSON")
    }

    /// The name of the kubeconfig's cluster extension.
    fn extension_name(&self) -> String {
        let text = std::fs::read_to_string(&self.kubeconfig).expect("kubeconfig");
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("YAML");
        doc["clusters"][0]["cluster"]["extensions"][0]["name"]
            .as_str()
            .expect("an extension")
            .to_string()
    }

    fn server(&self) -> String {
        let text = std::fs::read_to_string(&self.kubeconfig).expect("kubeconfig");
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("YAML");
        doc["clusters"][0]["cluster"]["server"]
            .as_str()
            .expect("server")
            .to_string()
    }

    /// `hwkey credential` run the way client-go runs it, with the given exec info.
    fn credential(&self, exec_info: &str, args: &[&str]) -> Command {
        let mut cmd = hwkey();
        cmd.envs(self.id.envs())
            .env("KUBERNETES_EXEC_INFO", exec_info)
            .arg("credential")
            .args(args);
        cmd
    }

    /// [`Cluster::credential`] run as the generated kubeconfig runs it: `hwkey-credential`.
    fn plugin(&self, exec_info: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(support::hwkey_bin().with_file_name("hwkey-credential"));
        cmd.envs(self.id.envs())
            .env("KUBERNETES_EXEC_INFO", exec_info)
            .args(args);
        cmd
    }

    /// The cluster extension with its own state directory (so a failing case starts its own
    /// proxy instead of finding the shared one).
    fn extension_in(&self, state: &str) -> serde_json::Value {
        let mut ext = self.extension();
        ext["stateDir"] = self.dir.path().join(state).display().to_string().into();
        ext
    }

    /// Non-interactive v1 exec info for `server` with the extension `ext`.
    fn exec_info_with(&self, server: &str, ext: serde_json::Value) -> String {
        serde_json::json!({
            "apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
            "spec": {"interactive": false, "cluster": {"server": server, "config": ext}},
        })
        .to_string()
    }

    fn exec_info(&self, api_version: &str) -> String {
        serde_json::json!({
            "apiVersion": api_version,
            "kind": "ExecCredential",
            "spec": {"interactive": false, "cluster": {
                "server": self.server(),
                "config": self.extension(),
            }},
        })
        .to_string()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(pid) = self.proxy_pid() {
            stop_pid(pid);
        }
    }
}

fn ok(out: Output) -> String {
    stdout(&out)
}

fn version_and_whoami(c: &Cluster) {
    let version: serde_json::Value =
        serde_json::from_str(&ok(run_ok(c.kubectl().args(["get", "--raw", "/version"]))))
            .expect("/version is JSON");
    assert_eq!(version["user"], "alice", "{version}");
    let whoami = ok(run_ok(c.kubectl().args(["auth", "whoami"])));
    assert!(whoami.contains("alice"), "{whoami}");
    assert!(whoami.contains("devs"), "{whoami}");
}

#[cfg(feature = "pkcs11")]
#[test]
fn kubectl_works_with_only_the_generated_kubeconfig_softhsm() {
    let c = Cluster::new(Identity::softhsm, "10m");
    version_and_whoami(&c);
    let first = c.proxy_pid().expect("the first kubectl started a proxy");
    // The second call (and the third) reuse that proxy.
    run_ok(c.kubectl().args(["get", "--raw", "/version"]));
    assert_eq!(c.proxy_starts(), 1, "one proxy start");
    assert_eq!(c.proxy_pid(), Some(first));
    assert!(alive(first));
    // Upstream saw the hardware identity on every connection.
    let stats = c.upstream.stats();
    assert!(!stats.connections.is_empty());
    assert!(stats.connections.iter().all(|r| r.cn == "alice"));
}

/// client-go keys its exec authenticators by a text dump of the exec config and, with
/// `provideClusterInfo: true`, of the cluster (its CA and extension bytes hex-dumped), and
/// kubectl builds a client per object of a list: the flag cost kubectl about 60 µs of CPU per
/// object, 1.13× a plain kubeconfig's time for a 1,000-object list. The generated kubeconfig
/// hands the plugin its cluster in the exec env instead, and names its settings extension
/// `hwkey/settings` (client-go copies a `client.authentication.k8s.io/exec` one into the exec
/// config it dumps): real kubectl passes no cluster, and the plugin still finds its proxy and
/// key. `hwkey doctor` fails a kubeconfig whose env copy
/// disagrees with the cluster entry.
#[cfg(feature = "pkcs11")]
#[test]
fn kubectl_hands_the_plugin_no_cluster_and_it_still_finds_its_settings() {
    let c = Cluster::new(Identity::softhsm, "10m");
    let text = std::fs::read_to_string(&c.kubeconfig).expect("kubeconfig");
    let mut doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("YAML");
    let exec = &mut doc["users"][0]["user"]["exec"];
    assert!(exec["provideClusterInfo"].is_null(), "{exec:?}");
    let plugin = exec["command"].as_str().expect("command").to_string();
    let seen = c.dir.path().join("exec-info.json");
    let wrapper = c.dir.path().join("record-exec-info");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nprintf '%s' \"$KUBERNETES_EXEC_INFO\" > '{}'\nexec '{plugin}' \"$@\"\n",
            seen.display()
        ),
    )
    .expect("write the wrapper");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    exec["command"] = wrapper.display().to_string().into();
    std::fs::write(&c.kubeconfig, serde_yaml_ng::to_string(&doc).expect("YAML")).expect("write");

    version_and_whoami(&c);
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&seen).expect("the plugin ran"))
            .expect("KUBERNETES_EXEC_INFO is JSON");
    assert_eq!(info["kind"], "ExecCredential", "{info}");
    assert!(
        info["spec"]["cluster"].is_null(),
        "kubectl passed the cluster: {info}"
    );
    assert_eq!(
        c.proxy_starts(),
        1,
        "the plugin started the proxy it was told of"
    );

    // The started proxy's environment holds none of the plugin's inputs.
    let pid = c.proxy_pid().expect("the plugin started a proxy");
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("the proxy's environ");
    for var in ["HWKEY_EXEC_CLUSTER=", "KUBERNETES_EXEC_INFO="] {
        assert!(
            !environ
                .split(|b| *b == 0)
                .any(|v| v.starts_with(var.as_bytes())),
            "the proxy inherited {var}"
        );
    }

    // The doctor passes the kubeconfig as written, and names a cluster server edited away from
    // the env's copy.
    let doctor = || c.doctor(&c.kubeconfig);
    let text = stdout(&run_ok(&mut doctor()));
    assert!(
        text.contains("ok    plugin settings: HWKEY_EXEC_CLUSTER matches the cluster entry"),
        "{text}"
    );
    let mut doc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&c.kubeconfig).expect("kubeconfig"))
            .expect("YAML");
    doc["clusters"][0]["cluster"]["server"] = "https://127.0.0.2:6443".into();
    std::fs::write(&c.kubeconfig, serde_yaml_ng::to_string(&doc).expect("YAML")).expect("write");
    let text = stdout(&support::run_fail(&mut doctor()));
    assert!(
        text.contains(
            "FAIL  plugin settings: its HWKEY_EXEC_CLUSTER names the server https://127.0.0.1:"
        ),
        "{text}"
    );
    assert!(
        text.contains("the cluster entry https://127.0.0.2:6443")
            && text.contains("hwkey kubeconfig"),
        "{text}"
    );
}

/// A kubeconfig an older hwkey wrote (its settings in the cluster's
/// `client.authentication.k8s.io/exec` extension, which client-go passes with
/// `provideClusterInfo: true`, and no env) still works with kubectl, doctor passes it (and fails
/// the flag beside the new name, which passes nothing), and regenerating it keeps its port.
#[cfg(feature = "pkcs11")]
#[test]
fn a_kubeconfig_an_older_hwkey_wrote_still_works() {
    let c = Cluster::new(Identity::softhsm, "10m");
    let text = std::fs::read_to_string(&c.kubeconfig).expect("kubeconfig");
    let mut doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("YAML");
    let ext = &mut doc["clusters"][0]["cluster"]["extensions"][0];
    assert_eq!(ext["name"], "hwkey/settings");
    ext["name"] = "client.authentication.k8s.io/exec".into();
    let exec = doc["users"][0]["user"]["exec"]
        .as_mapping_mut()
        .expect("exec block");
    assert!(exec.remove("env").is_some());
    exec.insert("provideClusterInfo".into(), true.into());
    std::fs::write(&c.kubeconfig, serde_yaml_ng::to_string(&doc).expect("YAML")).expect("write");

    version_and_whoami(&c);
    assert_eq!(c.proxy_starts(), 1);
    let out = run_ok(&mut c.doctor(&c.kubeconfig));
    let text = stdout(&out);
    assert!(
        text.contains("ok    plugin settings: client-go passes the cluster's client.authentication.k8s.io/exec extension"),
        "{text}"
    );
    assert!(!text.contains("FAIL"), "{text}");

    // The same flag beside an extension named hwkey/settings passes the plugin nothing:
    // doctor says so (kubectl would fail with "no key URI").
    let mut broken = doc.clone();
    broken["clusters"][0]["cluster"]["extensions"][0]["name"] = "hwkey/settings".into();
    let path = c.dir.path().join("broken.kubeconfig");
    std::fs::write(&path, serde_yaml_ng::to_string(&broken).expect("YAML")).expect("write");
    let text = stdout(&support::run_fail(&mut c.doctor(&path)));
    assert!(
        text.contains("FAIL  plugin settings: the exec block has no HWKEY_EXEC_CLUSTER"),
        "{text}"
    );

    // Regenerating over the older entry keeps its port and writes the new form.
    let server = c.server();
    c.generate("10m");
    assert_eq!(c.server(), server, "the older entry's port is kept");
    assert_eq!(c.extension_name(), "hwkey/settings");
}

#[cfg(feature = "tpm")]
#[test]
fn kubectl_works_with_only_the_generated_kubeconfig_tpm() {
    let c = Cluster::new(Identity::tpm, "10m");
    version_and_whoami(&c);
    assert_eq!(c.proxy_starts(), 1);
}

#[cfg(feature = "pkcs11")]
#[test]
fn watch_streams_survives_a_killed_kubectl_and_idle_exit_ends_the_proxy() {
    // An idle period long enough for the next kubectl to reach the proxy after the kill, however
    // slowly it starts; the exit afterwards is waited for, not timed.
    let c = Cluster::new(Identity::softhsm, "15s");
    let mut watch = c
        .kubectl()
        .args([
            "get",
            "--raw",
            "/api/v1/namespaces/default/configmaps?watch=1",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("kubectl watch");
    let lines = BufReader::new(watch.stdout.take().expect("stdout")).lines();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    // The watch is live once an event comes back (the request may still be on its way when
    // the first ones are emitted).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "the watch never delivered an event"
        );
        c.upstream.emit_watch_event();
        if rx.recv_timeout(Duration::from_secs(1)).is_ok() {
            break;
        }
    }
    // From now on each event arrives before the next one is emitted (late lines of the
    // events above are skipped).
    for _ in 0..3 {
        let n = c.upstream.emit_watch_event();
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("event {n} did not arrive"));
            if line.contains(&format!("\"cm-{n}\"")) {
                break;
            }
        }
    }
    let pid = c.proxy_pid().expect("proxy started");
    // kubectl dies mid-watch; the proxy stays healthy.
    watch.kill().expect("kill kubectl");
    let _ = watch.wait();
    run_ok(c.kubectl().args(["get", "--raw", "/version"]));
    assert_eq!(c.proxy_pid(), Some(pid));
    assert_eq!(c.proxy_starts(), 1);
    // Without clients, --idle-exit (15s here) ends it.
    let deadline = Instant::now() + Duration::from_secs(60);
    while alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!alive(pid), "the proxy did not exit after its idle period");
    assert!(
        !c.state.join("control.sock").exists(),
        "control socket removed"
    );
}

#[cfg(feature = "pkcs11")]
#[test]
fn two_kubectl_at_the_same_moment_start_one_proxy() {
    let c = Cluster::new(Identity::softhsm, "10m");
    let spawn = || {
        c.kubectl()
            .args(["get", "--raw", "/version"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl")
    };
    let (a, b) = (spawn(), spawn());
    for child in [a, b] {
        let out = child.wait_with_output().expect("kubectl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout(&out).contains("alice"));
    }
    assert_eq!(c.proxy_starts(), 1, "exactly one proxy was started");
}

fn parse_pem_cert(pem_text: &str) -> Vec<u8> {
    pem::parse(pem_text).expect("PEM").into_contents()
}

#[cfg(feature = "pkcs11")]
#[test]
fn exec_contract_v1_and_v1beta1_and_the_key_is_never_the_hardware_key() {
    let c = Cluster::new(Identity::softhsm, "10m");
    let hardware_cert = std::fs::read_to_string(&c.id.cert).expect("cert");
    let hardware_der = parse_pem_cert(&hardware_cert);
    let (_, hw) = x509_parser::parse_x509_certificate(&hardware_der).expect("x509");
    let hardware_spki = hw.tbs_certificate.subject_pki.raw.to_vec();
    let hardware_not_after = hw.validity().not_after.timestamp();

    for version in [
        "client.authentication.k8s.io/v1",
        "client.authentication.k8s.io/v1beta1",
    ] {
        let out = run_ok(&mut c.credential(&c.exec_info(version), &[]));
        let text = stdout(&out);
        let cred: serde_json::Value =
            serde_json::from_str(&text).expect("stdout is one JSON object");
        assert_eq!(cred["apiVersion"], version);
        assert_eq!(cred["kind"], "ExecCredential");
        let status = &cred["status"];
        let cert_pem = status["clientCertificateData"].as_str().expect("cert");
        let key_pem = status["clientKeyData"].as_str().expect("key");
        let cert_der = parse_pem_cert(cert_pem);
        let (_, loopback) = x509_parser::parse_x509_certificate(&cert_der).expect("x509");
        // Not the hardware certificate, not the hardware key.
        assert_ne!(loopback.tbs_certificate.subject_pki.raw, &hardware_spki[..]);
        assert!(!key_pem.is_empty());
        let key_der = pem::parse(key_pem).expect("key PEM").into_contents();
        let kp = rcgen::KeyPair::try_from(key_der.as_slice()).expect("a software key");
        assert_eq!(
            rcgen::PublicKeyData::subject_public_key_info(&kp),
            loopback.tbs_certificate.subject_pki.raw,
            "the emitted key belongs to the emitted loopback certificate"
        );
        // Expiry: before the loopback cert's NotAfter, never after the hardware cert's.
        let expiry = time::OffsetDateTime::parse(
            status["expirationTimestamp"].as_str().expect("expiry"),
            &time::format_description::well_known::Rfc3339,
        )
        .expect("RFC 3339")
        .unix_timestamp();
        assert!(expiry < loopback.validity().not_after.timestamp());
        assert!(expiry <= hardware_not_after);
        assert!(expiry > time::OffsetDateTime::now_utc().unix_timestamp());
    }

    // --cert-only: the hardware chain and proxyConfig, no key (KEP-2718 shape).
    let out = run_ok(&mut c.credential(
        &c.exec_info("client.authentication.k8s.io/v1"),
        &["--cert-only"],
    ));
    let cred: serde_json::Value = serde_json::from_str(&stdout(&out)).expect("JSON");
    let status = &cred["status"];
    assert!(status.get("clientKeyData").is_none(), "{cred}");
    let chain = status["clientCertificateData"].as_str().expect("chain");
    assert_eq!(parse_pem_cert(chain), hardware_der);
    assert_eq!(status["proxyConfig"]["url"], c.server());
    assert!(status["proxyConfig"]["certificate-authority-data"]
        .as_str()
        .is_some_and(|s| !s.is_empty()));
}

#[cfg(feature = "pkcs11")]
#[test]
fn exec_errors_leave_stdout_empty_and_say_what_to_fix() {
    let c = Cluster::new(Identity::softhsm, "10m");
    fails_with(
        &mut c.credential("{not json", &[]),
        &["KUBERNETES_EXEC_INFO"],
    );
    fails_with(
        &mut c.credential(&c.exec_info("client.authentication.k8s.io/v2"), &[]),
        &["unsupported exec credential apiVersion", "v1beta1"],
    );
    // No key anywhere.
    let no_key = serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
        "spec": {"interactive": false, "cluster": {"server": c.server()}},
    })
    .to_string();
    fails_with(
        &mut c.credential(&no_key, &[]),
        &["no key URI", "hwkey kubeconfig"],
    );

    // Unreadable certificate: the proxy cannot start, and the error says why.
    let mut ext = c.extension_in("state-badcert");
    ext["cert"] = "/nonexistent/alice.pem".into();
    fails_with(
        &mut c.credential(&c.exec_info_with(&c.server(), ext), &[]),
        &["cannot start hwkey proxy", "/nonexistent/alice.pem"],
    );

    // Port taken: something else listens where the proxy should.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let server = format!("https://127.0.0.1:{port}");
    fails_with(
        &mut c.credential(
            &c.exec_info_with(&server, c.extension_in("state-taken")),
            &[],
        ),
        &[
            "cannot start hwkey proxy",
            &port.to_string(),
            "Address already in use",
        ],
    );

    // A PKCS#11 key without a PIN source, non-interactive: says how to give one.
    let mut ext = c.extension_in("state-nopin");
    ext["key"] = without_pin_source(&ext["key"]).into();
    fails_with(
        &mut c.credential(&c.exec_info_with(&c.server(), ext), &[]),
        &["needs a PIN", "pin-source"],
    );
}

/// `strace` recording into `trace` the plugin's connections and writes (every call that can
/// write: the tests count them), run with `plugin`'s environment; the caller adds what to run.
fn traced(plugin: &Command, trace: &Path) -> Command {
    traced_calls(plugin, trace, WRITES)
}

/// The plugin's connections and every call that can write.
const WRITES: &str = "connect,write,writev,sendto,sendmsg";

/// Runs `plugin` under strace recording the system calls `calls` names into `trace`; asserts it
/// succeeded.
fn run_traced(plugin: &Command, trace: &Path, calls: &str) -> std::process::Output {
    run_ok(
        traced_calls(plugin, trace, calls)
            .arg(plugin.get_program())
            .args(plugin.get_args()),
    )
}

/// [`traced`] for the system calls `calls` names (strace's `trace=` list).
fn traced_calls(plugin: &Command, trace: &Path, calls: &str) -> Command {
    let mut cmd = Command::new("strace");
    cmd.args(["-f", "-qq", "-s", "200", "-e"])
        .arg(format!("trace={calls}"))
        .arg("-o")
        .arg(trace)
        .envs(
            plugin
                .get_envs()
                .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned()))),
        );
    cmd
}

/// kubectl runs the plugin once per process, so its control requests are on the path of every
/// `kubectl get`: with the proxy running, one request (the credential names the proxy that gave
/// it) instead of `/v1/info` and then `/v1/credential`. Counted as the plugin's connections to
/// the control socket, under strace. On c3b946d there were 2, both with and without
/// `--cert-only`.
///
/// And each of them is one write: the request in one (a6d3f41 wrote it in three, `write!` on
/// the unbuffered socket, each able to wake the proxy for a part of it) and the answer on
/// stdout in one (a6d3f41: two, the object and then its newline).
#[cfg(feature = "pkcs11")]
#[test]
fn a_running_proxy_answers_the_plugin_in_one_control_request() {
    support::tools::require_tool("strace", "strace");
    let c = Cluster::new(Identity::softhsm, "10m");
    let info = c.exec_info("client.authentication.k8s.io/v1");
    // The first call starts the proxy.
    run_ok(&mut c.credential(&info, &[]));
    for (args, plugin) in [&[][..], &["--cert-only"][..]]
        .into_iter()
        .flat_map(|args| {
            [
                (args, c.credential(&info, args)),
                (args, c.plugin(&info, args)),
            ]
        })
    {
        let trace = c.dir.path().join("connects");
        let args = (plugin.get_program(), args);
        let out = run_traced(&plugin, &trace, WRITES);
        let cred: serde_json::Value =
            serde_json::from_str(&stdout(&out)).expect("stdout is one JSON object");
        assert_eq!(cred["kind"], "ExecCredential", "{cred}");
        let text = std::fs::read_to_string(&trace).expect("strace output");
        let control: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("connect(") && l.contains("control.sock"))
            .collect();
        assert_eq!(
            control.len(),
            1,
            "plugin {args:?}: one control request with the proxy running: {control:#?}"
        );
        // The control socket's descriptor, from `connect(3, {…control.sock…}, …)`.
        let fd = control[0]
            .split_once("connect(")
            .and_then(|(_, rest)| rest.split_once(','))
            .map(|(fd, _)| fd.trim().to_string())
            .expect("the connect call's descriptor");
        let writes_to = |fd: &str| -> Vec<&str> {
            text.lines()
                .filter(|l| {
                    ["write(", "writev(", "sendto(", "sendmsg("]
                        .iter()
                        .any(|call| l.contains(&format!("{call}{fd},")))
                })
                .collect()
        };
        let request = writes_to(&fd);
        assert_eq!(
            request.len(),
            1,
            "plugin {args:?}: the control request in one write: {request:#?}"
        );
        let answer = writes_to("1");
        assert_eq!(
            answer.len(),
            1,
            "plugin {args:?}: the ExecCredential in one write on stdout: {answer:#?}"
        );
    }
    assert_eq!(c.proxy_starts(), 1);
}

/// `hwkey-credential` starts without std's runtime (src/bin/hwkey-credential.rs) and does itself
/// what of it the plugin needs. One is SIGPIPE ignored: a kubectl that went away before the
/// answer (its end of stdout closed) gets the plugin's error on stderr and exit status 1, as
/// any std program's, not a plugin killed by the signal without a word. The other is closed
/// standard descriptors opened on /dev/null: with stdout closed, the control socket would take
/// its number and the credential would be written to the proxy.
#[cfg(feature = "pkcs11")]
#[test]
fn the_plugin_says_so_when_nobody_reads_its_answer_and_writes_no_credential_to_a_socket() {
    use std::os::unix::process::ExitStatusExt;
    let c = Cluster::new(Identity::softhsm, "10m");
    let info = c.exec_info("client.authentication.k8s.io/v1");
    // The first call starts the proxy.
    run_ok(&mut c.plugin(&info, &[]));
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = c
        .plugin(&info, &[])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("run the plugin");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.signal(),
        None,
        "the plugin was killed by a signal: {err}"
    );
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("hwkey: error:") && err.contains("Broken pipe"),
        "{err}"
    );

    // Standard descriptors closed: the answer goes to /dev/null, not into the control socket.
    let trace = c.dir.path().join("closed");
    let plugin = c.plugin(&info, &[]);
    run_ok(
        traced(&plugin, &trace)
            .args(["sh", "-c", r#"exec "$0" >&- <&-"#])
            .arg(plugin.get_program()),
    );
    let text = std::fs::read_to_string(&trace).expect("strace output");
    let connect = text
        .lines()
        .find(|l| l.contains("connect(") && l.contains("control.sock"))
        .expect("the control request");
    assert!(
        !connect.contains("connect(0,") && !connect.contains("connect(1,"),
        "the control socket took a standard descriptor's number: {connect}"
    );
    let credential = text
        .lines()
        .filter(|l| l.contains("ExecCredential"))
        .collect::<Vec<_>>();
    assert!(
        credential.len() == 1 && credential[0].contains("write(1,"),
        "the credential in one write to fd 1, nowhere else: {credential:#?}"
    );
}

/// Issue 55, round nineteen: `hwkey-credential`, which kubectl starts on every call, skips the
/// parts of std's runtime start-up it does not need (a90bfd8: its own C `main`). glibc's lookup
/// of the main thread's stack for std opens and parses all of /proc/self/maps, and std gives
/// the main thread a signal stack (`sigaltstack`): about 130 µs a start here. Counted under
/// strace: `hwkey-credential` makes neither call, while `hwkey credential` (the same plugin
/// behind std's `main`) makes both, which shows the trace sees them where they happen. On
/// a6d3f41, whose `hwkey-credential` had std's `main`, it opened /proc/self/maps.
#[cfg(feature = "pkcs11")]
#[test]
fn the_plugin_binary_starts_without_stds_runtime_start_up() {
    support::tools::require_tool("strace", "strace");
    let c = Cluster::new(Identity::softhsm, "10m");
    let info = c.exec_info("client.authentication.k8s.io/v1");
    // The first call starts the proxy.
    run_ok(&mut c.plugin(&info, &[]));
    let start_up = |plugin: Command, name: &str| -> Vec<String> {
        let trace = c.dir.path().join(name);
        let out = run_traced(&plugin, &trace, "open,openat,sigaltstack");
        assert!(
            stdout(&out).contains("ExecCredential"),
            "{name}: no credential"
        );
        let text = std::fs::read_to_string(&trace).expect("strace output");
        // The trace saw the binary start: its shared libraries are opened.
        assert!(
            text.lines()
                .any(|l| l.contains("openat(") && l.contains(".so")),
            "{name}: strace recorded no library being opened:\n{text}"
        );
        text.lines()
            .filter(|l| l.contains("/proc/self/maps") || l.contains("sigaltstack("))
            .map(str::to_string)
            .collect()
    };
    let std_main = start_up(c.credential(&info, &[]), "std-main");
    assert!(
        std_main.iter().any(|l| l.contains("/proc/self/maps"))
            && std_main.iter().any(|l| l.contains("sigaltstack(")),
        "`hwkey credential` (std's main) should show std's start-up in the trace: {std_main:#?}"
    );
    let own = start_up(c.plugin(&info, &[]), "own-main");
    assert!(
        own.is_empty(),
        "hwkey-credential did std's runtime start-up work: {own:#?}"
    );
}

/// Files the plugin writes in a state directory are not followed through a symbolic link, nor
/// waited on as a FIFO: root's plugin (kubelet's) writes in the proxy service user's directory,
/// and a link planted there made root append its log line to any file (`proxy.log`) or create
/// any file (`start.lock`); a FIFO as `start.lock` blocked the plugin for good. Each case
/// fails with the file's name, stdout empty, and the planted target untouched.
#[cfg(feature = "pkcs11")]
#[test]
fn the_plugin_follows_no_link_and_waits_on_no_fifo_in_its_state_directory() {
    use std::os::unix::fs::{symlink, DirBuilderExt};
    let c = Cluster::new(Identity::softhsm, "10m");
    let victim = c.dir.path().join("victim");
    std::fs::write(&victim, "victim\n").expect("victim");
    let absent = c.dir.path().join("created-by-the-plugin");
    let state = |name: &str| {
        let dir = c.dir.path().join(name);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .expect("state dir");
        dir
    };
    // The proxy cannot start (its certificate is missing), so the plugin opens its log to
    // report why: the log is a link to the victim.
    let mut ext = c.extension_in("state-log-link");
    ext["cert"] = "/nonexistent/alice.pem".into();
    symlink(&victim, state("state-log-link").join("proxy.log")).expect("link");
    fails_with(
        &mut c.credential(&c.exec_info_with(&c.server(), ext), &[]),
        &["proxy.log", "symbolic link"],
    );
    assert_eq!(
        std::fs::read_to_string(&victim).expect("victim"),
        "victim\n"
    );

    symlink(&absent, state("state-lock-link").join("start.lock")).expect("link");
    fails_with(
        &mut c.credential(
            &c.exec_info_with(&c.server(), c.extension_in("state-lock-link")),
            &[],
        ),
        &["start.lock", "symbolic link"],
    );
    assert!(!absent.exists(), "the plugin created the link's target");

    let fifo = state("state-lock-fifo").join("start.lock");
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .expect("mkfifo");
    let out = support::run_fail_within(
        &mut c.credential(
            &c.exec_info_with(&c.server(), c.extension_in("state-lock-fifo")),
            &[],
        ),
        Duration::from_secs(20),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.stdout.is_empty(), "stdout must stay empty on error");
    assert!(
        err.contains("start.lock") && err.contains("not a regular file"),
        "{err}"
    );
}

/// `hwkey-credential` copied somewhere without `hwkey` beside it cannot start the proxy, and
/// says what to install; nothing reaches stdout.
#[cfg(feature = "pkcs11")]
#[test]
fn the_plugin_binary_without_hwkey_beside_it_says_what_to_install() {
    let c = Cluster::new(Identity::softhsm, "10m");
    let lonely = c.dir.path().join("bin");
    std::fs::create_dir(&lonely).expect("mkdir");
    let plugin = lonely.join("hwkey-credential");
    std::fs::copy(
        support::hwkey_bin().with_file_name("hwkey-credential"),
        &plugin,
    )
    .expect("copy the plugin");
    let info = c.exec_info_with(&c.server(), c.extension_in("state-lonely"));
    let out = support::run_fail(
        Command::new(&plugin)
            .envs(c.id.envs())
            .env("KUBERNETES_EXEC_INFO", info),
    );
    assert!(out.stdout.is_empty(), "a credential was printed");
    let text = support::output_text(&out);
    assert!(
        text.contains("hwkey binary next to it") && text.contains("cargo install --path ."),
        "{text}"
    );
}

/// A key URI string without its `pin-source`.
fn without_pin_source(key: &serde_json::Value) -> String {
    let key = key.as_str().expect("key URI");
    key.split("&pin-source").next().unwrap_or(key).to_string()
}

#[cfg(feature = "pkcs11")]
#[test]
fn kubectl_shows_the_plugins_message() {
    let c = Cluster::new(Identity::softhsm, "10m");
    // Point the kubeconfig at a key that does not exist.
    let text = std::fs::read_to_string(&c.kubeconfig).expect("kubeconfig");
    std::fs::write(&c.kubeconfig, text.replace("object=alice", "object=nobody")).expect("write");
    let out = Command::new("kubectl")
        .envs(c.id.envs())
        .env("HOME", c.dir.path())
        .arg("--kubeconfig")
        .arg(&c.kubeconfig)
        .args(["get", "--raw", "/version"])
        .stdin(Stdio::null())
        .output()
        .expect("kubectl");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("key object='nobody' not found"),
        "kubectl stderr: {err}"
    );
}

#[cfg(feature = "pkcs11")]
#[test]
fn kubeconfig_merges_without_disturbing_other_entries() {
    let dir = temp_dir();
    let out = dir.path().join("config");
    std::fs::write(
        &out,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: other\n  cluster:\n    server: https://10.9.9.9:6443\nusers:\n- name: other\n  user:\n    token: abc\ncontexts:\n- name: other\n  context:\n    cluster: other\n    user: other\ncurrent-context: other\n",
    )
    .expect("write");
    let ca = support::TestCa::new(dir.path());
    let gen = |port: Option<u16>| {
        let mut cmd = hwkey();
        cmd.args([
            "kubeconfig",
            "--name",
            "hw",
            "--key",
            "pkcs11:token=t;object=o?module-path=/x.so&pin-source=file:/p",
        ])
        .args(["--server", "https://10.0.0.1:6443", "--ca"])
        .arg(ca.ca_path())
        .arg("--out")
        .arg(&out)
        .arg("--state-dir")
        .arg(dir.path().join("state"));
        if let Some(p) = port {
            cmd.args(["--port", &p.to_string()]);
        }
        run_ok(&mut cmd);
    };
    gen(Some(free_port()));
    let first = std::fs::read_to_string(&out).expect("read");
    gen(None);
    let second = std::fs::read_to_string(&out).expect("read");
    assert_eq!(
        first, second,
        "regenerating keeps the port and changes nothing"
    );
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&second).expect("YAML");
    assert_eq!(
        doc["current-context"], "other",
        "the user's current context is kept"
    );
    assert_eq!(
        doc["users"][0]["user"]["token"], "abc",
        "other entries are kept"
    );
    assert_eq!(doc["clusters"].as_sequence().expect("seq").len(), 2);
    let exec = &doc["users"][1]["user"]["exec"];
    assert_eq!(exec["apiVersion"], "client.authentication.k8s.io/v1");
    assert!(exec["provideClusterInfo"].is_null(), "{exec:?}");
    assert_eq!(exec["env"][0]["name"], "HWKEY_EXEC_CLUSTER");
    assert_eq!(exec["interactiveMode"], "IfAvailable");
    let command = Path::new(exec["command"].as_str().expect("command"));
    assert!(command.is_absolute());
    // The plugin-only binary, which takes no subcommand.
    assert_eq!(
        command.file_name().and_then(|n| n.to_str()),
        Some("hwkey-credential")
    );
    assert!(exec["args"].is_null(), "{exec:?}");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&out).expect("meta").permissions().mode() & 0o777,
        0o600
    );

    // Bad input: nothing written.
    fails_with(
        hwkey()
            .args([
                "kubeconfig",
                "--name",
                "hw2",
                "--key",
                "pkcs11:token=t;object=o",
                "--server",
                "https://10.0.0.1:6443",
                "--ca",
                "/nonexistent/ca.pem",
                "--out",
            ])
            .arg(&out),
        &["--ca /nonexistent/ca.pem does not exist"],
    );
    assert_eq!(std::fs::read_to_string(&out).expect("read"), second);
}

/// A PKCS#11 key URI without a PIN source, interactive session: the plugin prompts on the
/// terminal (no echo), the proxy gets the PIN on a pipe (its stdin) — never argv, never its
/// environment (/proc/PID/environ, readable for the proxy's whole life) — and stdout still
/// carries the credential.
#[cfg(feature = "pkcs11")]
#[test]
fn interactive_sessions_are_prompted_for_a_missing_pin() {
    support::require_tool("script", "bsdutils");
    let c = Cluster::new(Identity::softhsm, "10m");
    let mut ext = c.extension();
    ext["key"] = without_pin_source(&ext["key"]).into();
    let info = serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
        "spec": {"interactive": true, "cluster": {"server": c.server(), "config": ext}},
    })
    .to_string();
    // The plugin under a terminal; the PIN is typed once the prompt appears.
    let mut envs = c.id.envs();
    envs.push(("KUBERNETES_EXEC_INFO".into(), info));
    let text = support::terminal::answer_prompt(
        &format!("{} credential", env!("CARGO_BIN_EXE_hwkey")),
        envs,
        "PIN for token",
        support::USER_PIN,
    );
    assert!(text.contains("PIN for token 'kube'"), "{text}");
    let before_json = text.split('{').next().unwrap_or_default();
    assert!(
        !before_json.contains(support::USER_PIN),
        "the PIN was echoed: {before_json}"
    );
    assert!(text.contains("\"kind\":\"ExecCredential\""), "{text}");
    let pid = c.proxy_pid().expect("the proxy started");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(support::USER_PIN),
        "the PIN is not in the proxy's argv"
    );
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("environ");
    let environ = String::from_utf8_lossy(&environ);
    assert!(
        !environ.contains(support::USER_PIN) && !environ.contains("PIN"),
        "the PIN (or a PIN variable) is in the proxy's environment"
    );
    let log = std::fs::read_to_string(c.state.join("proxy.log")).expect("log");
    assert!(!log.contains(support::USER_PIN), "the PIN is not logged");
}

#[cfg(feature = "pkcs11")]
#[test]
fn doctor_checks_the_key_certificate_and_kubeconfig() {
    let c = Cluster::new(Identity::softhsm, "10m");
    run_ok(c.kubectl().args(["get", "--raw", "/version"]));
    let out = run_ok(&mut c.doctor(&c.kubeconfig));
    let text = stdout(&out);
    for line in [
        "ok    exec plugin",
        "ok    proxy: running (pid",
        "ok    open key",
        "ok    sign",
        "ok    certificate: holds this key's public key",
        "ok    validity: CN=alice",
    ] {
        assert!(text.contains(line), "missing '{line}' in:\n{text}");
    }
    // A broken setup: the key is gone. Non-zero exit, the failing step named with its fix.
    let missing = c.id.sibling_uri("nobody");
    let out = support::run_fail(
        hwkey()
            .envs(c.id.envs())
            .args(["doctor", "--key", &missing]),
    );
    let text = stdout(&out);
    assert!(text.contains("FAIL  open key"), "{text}");
    assert!(text.contains("keys present: 'alice'"), "{text}");
}

/// Runs the plugin of `c` with its state directory `name` (mode 0700), where a process of the
/// same user listens on the control socket and hands each connection to `answer`: the
/// plugin's failed run (within 20 s), the state directory and the socket.
fn plugin_against_a_posing_control_socket(
    c: &Cluster,
    name: &str,
    answer: fn(std::os::unix::net::UnixStream),
) -> (Output, PathBuf, PathBuf) {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let state = c.dir.path().join(name);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&state)
        .expect("state dir");
    let sock = state.join("control.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || answer(conn));
        }
    });
    let out = support::run_fail_within(
        &mut c.credential(&c.exec_info_with(&c.server(), c.extension_in(name)), &[]),
        Duration::from_secs(20),
    );
    assert!(out.stdout.is_empty(), "stdout must stay empty on error");
    (out, state, sock)
}

/// A control socket a process listens on but that does not answer as a proxy (a proxy stopped
/// with SIGSTOP times out, one of another hwkey version answers otherwise; here a listener that
/// closes each connection unanswered) was taken for a dead proxy's: the plugin removed it and
/// started a second proxy, and the first ran on without its socket. Now the plugin says what it
/// found and leaves the socket; stdout stays empty.
#[cfg(feature = "pkcs11")]
#[test]
fn the_plugin_leaves_a_control_socket_someone_listens_on() {
    let c = Cluster::new(Identity::softhsm, "10m");
    let (out, state, sock) = plugin_against_a_posing_control_socket(&c, "state-live", drop);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("listens on the control socket") && err.contains("proxy.pid"),
        "{err}"
    );
    assert!(sock.exists(), "the live socket was removed");
    assert!(
        !state.join("proxy.pid").exists(),
        "a second proxy was started"
    );
}

/// Whatever listens on the control socket (a process of the same user posing as the proxy)
/// cannot make the plugin read without end: an answer of 64 MiB, then silence, was read whole
/// into memory and then waited on for 30 s per request (on 523bbf5 the plugin had not finished
/// after 20 s). Now an answer longer than 1 MiB is refused at once, and the plugin says what
/// listens there; stdout stays empty and no proxy is started.
#[cfg(feature = "pkcs11")]
#[test]
fn the_plugin_reads_no_endless_answer_from_its_control_socket() {
    let c = Cluster::new(Identity::softhsm, "10m");
    let endless = |mut conn: std::os::unix::net::UnixStream| {
        use std::io::Write;
        let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{");
        let block = vec![b' '; 1 << 16];
        for _ in 0..1024 {
            if conn.write_all(&block).is_err() {
                return;
            }
        }
        std::thread::sleep(Duration::from_secs(120));
    };
    let (out, state, _) = plugin_against_a_posing_control_socket(&c, "state-endless", endless);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("longer than 1048576 bytes") && err.contains("listens on the control socket"),
        "{err}"
    );
    assert!(
        !state.join("proxy.pid").exists(),
        "a second proxy was started"
    );
}

/// A proxy running in the state directory but listening on another port than the kubeconfig's
/// (the kubeconfig regenerated with another `--port`, or a second kubeconfig with the same
/// state directory) was taken as this kubeconfig's: the plugin handed out a credential for a
/// port nobody served, and kubectl failed with "connection refused". Now the plugin names both
/// addresses and the proxy's pid.
#[cfg(feature = "pkcs11")]
#[test]
fn the_plugin_refuses_a_proxy_listening_on_another_port() {
    let c = Cluster::new(Identity::softhsm, "10m");
    run_ok(&mut c.credential(&c.exec_info("client.authentication.k8s.io/v1"), &[]));
    let pid = c.proxy_pid().expect("the proxy started");
    let other = format!("https://127.0.0.1:{}", support::free_port());
    let failed = support::flow::fails_with(
        &mut c.credential(&c.exec_info_with(&other, c.extension()), &[]),
        &[&c.server(), &other, &pid.to_string()],
    );
    assert!(!failed.is_empty());
    // The right address still gets its credential from the running proxy.
    run_ok(&mut c.credential(&c.exec_info("client.authentication.k8s.io/v1"), &[]));
    assert_eq!(c.proxy_starts(), 1);
}
