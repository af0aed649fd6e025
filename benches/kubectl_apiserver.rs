//! kubectl through hwkey against the real kube-apiserver 1.20 (issue 12): `kubectl get` of one
//! object and of a 1,000-object list, with a kubeconfig from `hwkey kubeconfig` (exec plugin,
//! proxy, key in SoftHSM) against the same commands with a plain cert/key kubeconfig, in
//! interleaved rounds of the same run. Goal: ≤ 1.1×.
//!
//! Needs the binaries hsm-fixtures/build-kube.sh builds (`HWKEY_KUBE_BIN`, which
//! hsm-fixtures/bench.sh sets). Results: target/hwkey-bench/apiserver.json.

use std::path::Path;
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
    // Warm up: the first hwkey call starts the proxy, both fill kubectl's discovery cache.
    for config in [&hwkey_config, &plain_config] {
        let out = kubectl(config, list).output().expect("run kubectl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let names = String::from_utf8_lossy(&out.stdout).lines().count();
        assert!(names >= OBJECTS, "the list has {names} objects");
    }

    let rounds = common::pick(15, 4);
    let mut rows = Vec::new();
    for (label, args) in [("one object", one), ("1,000-object list", list)] {
        let (mut through, mut plain) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            through.push(time(kubectl(&hwkey_config, args)));
            plain.push(time(kubectl(&plain_config, args)));
        }
        let ratio = Stat::of(&common::paired_ratios(&through, &plain));
        rows.push(
            Row::new(
                AREA,
                &format!("kubectl get, {label}, through hwkey (exec plugin + proxy, SoftHSM key)"),
                "ms",
                Some(Stat::of(&through)),
            )
            .versus(
                "plain cert/key kubeconfig, same API server",
                Some(Stat::of(&plain)),
                Some(ratio),
            )
            .target("≤ 1.1×", Some(ratio.median <= 1.1))
            .note("one kubectl process per repetition, discovery cached; the proxy stays up between them (--idle-exit 15m)"),
        );
    }
    common::finish("apiserver", load_before, started, rows);
}
