//! kubectl through hwkey against the real kube-apiserver 1.20 (issue 12): `kubectl get` of one
//! object and of a 1,000-object list, with a kubeconfig from `hwkey kubeconfig` (exec plugin,
//! proxy, key in SoftHSM) against the same commands with a plain cert/key kubeconfig, in
//! interleaved rounds of the same run. Goal: ≤ 1.05× (issue 55; issue 12 asked ≤ 1.1×).
//!
//! Two more contenders split that ratio into its parts, in the same rounds:
//! - **the exec floor**: the same kubeconfig with `/bin/cat` of a credential the plugin gave as
//!   its exec command: kubectl's own cost of running any exec plugin (fork, exec, reading and
//!   parsing the credential) plus the proxy. No plugin can cost less than `cat`.
//! - **the proxy alone**: the same loopback credential written into the kubeconfig, no exec
//!   plugin at all: the loopback TLS hop and the proxy.
//! - **an exec plugin, no proxy**: the plain kubeconfig with `/bin/cat` of an ExecCredential
//!   holding the plain certificate and key as its exec plugin: what kubectl's exec machinery
//!   costs by itself, the floor of the goal for any exec plugin.
//!
//! Needs the binaries hsm-fixtures/build-kube.sh builds (`HWKEY_KUBE_BIN`, which
//! hsm-fixtures/bench.sh sets). Results: target/hwkey-bench/apiserver.json.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use support::bench::{self as common, Row, Stat};
use support::kube::KubeCluster;
use support::proxy::Identity;
use support::*;

const AREA: &str = "kubectl, real kube-apiserver";
const OBJECTS: usize = 1000;

fn main() {
    if common::skip_unless_cargo_bench("kubectl_apiserver") {
        return;
    }
    let started = Instant::now();
    let load_before = common::before();
    if std::env::var_os("HWKEY_KUBE_BIN").is_none() {
        let row = Row::new(AREA, "kubectl get through hwkey", "ms", None)
            .note("not measured: HWKEY_KUBE_BIN is not set (hsm-fixtures/bench.sh sets it)");
        common::finish("apiserver", load_before, started, vec![row]);
        return;
    }
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    let work = temp_dir();
    let dir = work.path();

    // Both users may read ConfigMaps: alice (the hardware key) and soft (a software key).
    cluster.apply(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: bench-view\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: view\nsubjects:\n- apiGroup: rbac.authorization.k8s.io\n  kind: User\n  name: alice\n- apiGroup: rbac.authorization.k8s.io\n  kind: User\n  name: soft\n",
    );
    let mut objects = String::new();
    for i in 0..OBJECTS {
        objects.push_str(&format!(
            "---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm-{i}\n  namespace: default\ndata:\n  value: \"{}\"\n",
            "x".repeat(200)
        ));
    }
    cluster.apply(&objects);

    let hwkey_config = dir.join("hwkey.kubeconfig");
    run_ok(
        hwkey()
            .envs(id.envs())
            .args(["kubeconfig", "--name", "bench", "--key", &id.key_uri])
            .arg("--cert")
            .arg(&id.cert)
            .args(["--server", &cluster.url()])
            .arg("--ca")
            .arg(cluster.ca_path())
            .arg("--out")
            .arg(&hwkey_config)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--idle-exit", "15m"]),
    );
    let (soft_cert, soft_key) = id.ca.client_cert(dir, "soft", "soft", None);
    let plain_config = dir.join("plain.kubeconfig");
    std::fs::write(
        &plain_config,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: plain\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: plain\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: plain\n  context: {{cluster: plain, user: plain}}\ncurrent-context: plain\n",
            cluster.url(),
            cluster.ca_path().display(),
            soft_cert.display(),
            soft_key.display()
        ),
    )
    .expect("write the plain kubeconfig");
    let (floor_config, static_config) = decomposition(&id, &hwkey_config, dir);
    let exec_config = plain_by_exec(dir, &cluster, &soft_cert, &soft_key);

    let kubectl = |config: &Path, args: &[&str]| {
        let mut cmd = Command::new("kubectl");
        cmd.envs(id.envs())
            .env("HOME", dir)
            .env_remove("KUBECONFIG")
            .arg("--kubeconfig")
            .arg(config)
            .args(args)
            .stdin(Stdio::null());
        cmd
    };
    let time = |mut cmd: Command| {
        let start = Instant::now();
        let out = cmd.output().expect("run kubectl");
        let ms = start.elapsed().as_secs_f64() * 1e3;
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        ms
    };
    let one: &[&str] = &["get", "configmap", "cm-1", "-o", "name"];
    let list: &[&str] = &["get", "configmaps", "-o", "name"];
    // Warm up: the first hwkey call starts the proxy, each fills kubectl's discovery cache.
    for config in [
        &hwkey_config,
        &floor_config,
        &static_config,
        &exec_config,
        &plain_config,
    ] {
        let out = kubectl(config, list).output().expect("run kubectl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let names = String::from_utf8_lossy(&out.stdout).lines().count();
        assert!(names >= OBJECTS, "the list has {names} objects");
    }

    // One object takes about 75 ms and a round's kubectl runs vary by ±10 %: 150 rounds put the
    // median's interval within about ±2–4 % (1.021–1.065× to 1.005–1.086× in round nineteen),
    // where 30 left it wider than the goal's margin. The list takes 5× as long and sits well
    // inside its goal.
    let mut rows = Vec::new();
    for (label, args, rounds) in [
        ("one object", one, common::pick(150, 4)),
        ("1,000-object list", list, common::pick(30, 4)),
    ] {
        // Through hwkey, the exec floor, the proxy alone, an exec plugin alone, plain; every
        // other round in reverse, so that no contender always runs right after another.
        let configs = [
            &hwkey_config,
            &floor_config,
            &static_config,
            &exec_config,
            &plain_config,
        ];
        let mut times: [Vec<f64>; 5] = Default::default();
        for round in 0..rounds {
            for i in 0..configs.len() {
                let i = if round % 2 == 0 {
                    i
                } else {
                    configs.len() - 1 - i
                };
                times[i].push(time(kubectl(configs[i], args)));
            }
        }
        let [through, floor, alone, exec, plain] = times;
        let ratios = common::paired_ratios(&through, &plain);
        let ratio = Stat::of(&ratios);
        let plugin = Stat::of(&common::paired_ratios(&through, &floor));
        let interval = match common::median_interval(&ratios) {
            Some((lo, hi)) => format!(
                "the median's 95 % interval {lo:.3}–{hi:.3}× ({} of {rounds} rounds at ≤ 1.05×)",
                ratios.iter().filter(|r| **r <= 1.05).count()
            ),
            None => format!("{rounds} rounds: too few for an interval"),
        };
        let versus_plain = |row: Row, subject: &[f64]| {
            row.versus(
                "plain cert/key kubeconfig, same API server",
                Some(Stat::of(&plain)),
                Some(Stat::of(&common::paired_ratios(subject, &plain))),
            )
        };
        let row = |what: &str, subject: &[f64]| {
            Row::new(
                AREA,
                &format!("kubectl get, {label}, {what}"),
                "ms",
                Some(Stat::of(subject)),
            )
        };
        rows.push(
            versus_plain(
                row("through hwkey (exec plugin + proxy, SoftHSM key)", &through),
                &through,
            )
            .target("≤ 1.05×", Some(ratio.median <= 1.05))
            .note(format!(
                "{interval}; one kubectl process per repetition, discovery cached; the proxy stays up between them (--idle-exit 15m); against the exec floor (hwkey's plugin instead of cat): {:.3}× (paired; {:.3}–{:.3})",
                plugin.median, plugin.p25, plugin.p75
            )),
        );
        rows.push(
            versus_plain(
                row("the exec floor: /bin/cat of a credential as the plugin, through the proxy", &floor),
                &floor,
            )
            .note("what any exec plugin costs kubectl at least (its fork, exec and credential parsing), plus the proxy"),
        );
        rows.push(
            versus_plain(
                row(
                    "the proxy alone: a loopback credential in the kubeconfig, no plugin",
                    &alone,
                ),
                &alone,
            )
            .note("the loopback TLS hop and the proxy, without the exec plugin"),
        );
        rows.push(
            versus_plain(
                row(
                    "an exec plugin, no proxy: /bin/cat of the plain certificate and key",
                    &exec,
                ),
                &exec,
            )
            .note("kubectl's exec machinery alone, straight to the API server: the floor of the goal for any exec plugin"),
        );
    }
    common::finish("apiserver", load_before, started, rows);
}

/// The two decomposition kubeconfigs (see the module doc), made from `hwkey_config`: one whose
/// exec plugin is `/bin/cat` of a credential the real plugin gave, one with that credential's
/// certificate and key written in and no plugin.
fn decomposition(id: &Identity, hwkey_config: &Path, dir: &Path) -> (PathBuf, PathBuf) {
    let text = std::fs::read_to_string(hwkey_config).expect("read the hwkey kubeconfig");
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("YAML");
    let cluster = &doc["clusters"][0]["cluster"];
    let ext = &cluster["extensions"][0];
    assert_eq!(ext["name"], "hwkey/settings");
    let info = serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
        "spec": {"interactive": false, "cluster": {
            "server": cluster["server"].as_str().expect("server"),
            "config": serde_json::to_value(&ext["extension"]).expect("JSON"),
        }},
    });
    let plugin = doc["users"][0]["user"]["exec"]["command"]
        .as_str()
        .expect("exec command");
    let out = Command::new(plugin)
        .envs(id.envs())
        .env("KUBERNETES_EXEC_INFO", info.to_string())
        .stdin(Stdio::null())
        .output()
        .expect("run the exec plugin");
    assert!(
        out.status.success(),
        "the plugin: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let credential = dir.join("credential.json");
    std::fs::write(&credential, &out.stdout).expect("write the credential");
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).expect("ExecCredential");
    let data = |name: &str| -> serde_yaml_ng::Value {
        use base64::Engine;
        let pem = answer["status"][name].as_str().expect(name);
        base64::engine::general_purpose::STANDARD
            .encode(pem.as_bytes())
            .into()
    };

    let mut floor = doc.clone();
    let exec = &mut floor["users"][0]["user"]["exec"];
    exec["command"] = "/bin/cat".into();
    exec["args"] = serde_yaml_ng::Value::Sequence(vec![credential.display().to_string().into()]);
    let floor_config = dir.join("floor.kubeconfig");
    std::fs::write(
        &floor_config,
        serde_yaml_ng::to_string(&floor).expect("YAML"),
    )
    .expect("write the floor kubeconfig");

    let mut alone = doc;
    let mut user = serde_yaml_ng::Mapping::new();
    user.insert(
        "client-certificate-data".into(),
        data("clientCertificateData"),
    );
    user.insert("client-key-data".into(), data("clientKeyData"));
    alone["users"][0]["user"] = user.into();
    let static_config = dir.join("static.kubeconfig");
    std::fs::write(
        &static_config,
        serde_yaml_ng::to_string(&alone).expect("YAML"),
    )
    .expect("write the static kubeconfig");
    (floor_config, static_config)
}

/// The plain kubeconfig with its certificate and key handed over by an exec plugin, `/bin/cat`
/// of an ExecCredential that holds them: kubectl's exec machinery with nothing else.
fn plain_by_exec(dir: &Path, cluster: &KubeCluster, cert: &Path, key: &Path) -> PathBuf {
    let read = |p: &Path| std::fs::read_to_string(p).expect("read the plain credential");
    let credential = serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
        "status": {"clientCertificateData": read(cert), "clientKeyData": read(key)},
    });
    let file = dir.join("plain-credential.json");
    std::fs::write(&file, credential.to_string()).expect("write the plain credential");
    let config = dir.join("plain-exec.kubeconfig");
    std::fs::write(
        &config,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: plain\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: plain\n  user:\n    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: /bin/cat\n      args: [{}]\n      interactiveMode: Never\ncontexts:\n- name: plain\n  context: {{cluster: plain, user: plain}}\ncurrent-context: plain\n",
            cluster.url(),
            cluster.ca_path().display(),
            file.display()
        ),
    )
    .expect("write the plain exec kubeconfig");
    config
}
