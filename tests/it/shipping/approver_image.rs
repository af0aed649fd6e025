//! The approver's OCI image as Kubernetes would run it (issue 26): `hsm-fixtures/package.sh`'s
//! image is unpacked into a runtime bundle (`umoci unpack`) and started by `runc` with what
//! `deploy/approver.yaml`'s Deployment gives the container (its arguments, user, read-only root
//! filesystem, no capabilities, no privilege escalation) and what a pod gets (the in-cluster
//! environment and a service-account token from the TokenRequest API with the cluster CA at
//! /var/run/secrets/kubernetes.io/serviceaccount), against the real kube-apiserver with the
//! manifest's RBAC. It approves an attested request, denies an unattested one, serves /healthz
//! and /metrics, and exits 0 on SIGTERM releasing its Lease.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use support::kube::{Approval, KubeCluster};
use support::proxy::Identity;
use support::*;

use crate::approver::kit::{
    decisions_on, deployment, install_approver, lease_holder, stop_bootstrap_proxy,
    submit_software_request, wait_until, KUBELET_SIGNER,
};
use crate::lifecycle::kit::{bootstrap_attested, csr_field, enroll_node, wait_for_csr};

/// The image's OCI layout directory and tag, as package.sh names them.
fn built_image() -> (PathBuf, String) {
    let layout = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/package/hwkey-approver");
    assert!(
        layout.join("index.json").is_file(),
        "{} is missing: build it with hsm-fixtures/package.sh (hsm-fixtures/test.sh does)",
        layout.display()
    );
    (layout, env!("CARGO_PKG_VERSION").to_string())
}

/// Sum of the sizes of the files under `dir` (what the image occupies).
fn bytes_under(dir: &Path) -> u64 {
    let out = run_ok(Command::new("du").args(["-s", "-b"]).arg(dir));
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("du prints a size")
}

/// A container started by `runc run` in the foreground; deleted (forcibly) on drop.
struct Container {
    id: String,
    runc: ChildGuard,
}

impl Container {
    fn run(bundle: &Path, id: &str, log: &Path) -> Container {
        let mut cmd = Command::new("runc");
        cmd.args(["run", "--no-new-keyring", "--bundle"])
            .arg(bundle)
            .arg(id);
        let runc = ChildGuard::spawn(&mut cmd, id, log);
        Container {
            id: id.to_string(),
            runc,
        }
    }

    /// `runc kill ID TERM`, as the kubelet stops a pod; the container's exit status.
    fn terminate(&mut self) -> std::process::ExitStatus {
        run_ok(Command::new("runc").args(["kill", &self.id, "TERM"]));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.runc.try_wait() {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the approver did not stop on SIGTERM:\n{}",
                self.runc.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new("runc")
            .args(["delete", "--force", &self.id])
            .output();
    }
}

/// The service account's files as the kubelet projects them into a pod.
fn service_account_dir(cluster: &KubeCluster, dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let token = cluster.kubectl_ok(&[
        "-n",
        "hwkey-system",
        "create",
        "token",
        "hwkey-approver",
        "--duration=1h",
    ]);
    let sa = dir.join("serviceaccount");
    std::fs::create_dir(&sa).expect("mkdir serviceaccount");
    std::fs::write(
        sa.join("token"),
        String::from_utf8_lossy(&token.stdout).trim(),
    )
    .expect("write token");
    std::fs::copy(cluster.ca_path(), sa.join("ca.crt")).expect("copy CA");
    std::fs::write(sa.join("namespace"), "hwkey-system").expect("write namespace");
    for (path, mode) in [
        (sa.clone(), 0o755),
        (sa.join("token"), 0o644),
        (sa.join("ca.crt"), 0o644),
        (sa.join("namespace"), 0o644),
    ] {
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }
    sa
}

/// Rewrites the bundle's config.json (made by umoci from the image's config) with what the
/// Deployment and the pod give the container. The metrics and health ports are free loopback
/// ports: the container shares this machine's network (a pod has its own), so they cannot be
/// 9101 and 9102; the health port is the one the Deployment's liveness probe names.
fn configure_bundle(bundle: &Path, sa: &Path, cluster_port: u16, ports: (u16, u16)) {
    let (metrics_port, health_port) = ports;
    let path = bundle.join("config.json");
    let mut config: Value = serde_json::from_str(&read(&path)).expect("umoci wrote a JSON config");
    let pod = deployment();
    let spec = &pod["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    let uid = spec["securityContext"]["runAsUser"]
        .as_u64()
        .expect("the Deployment names runAsUser");
    assert_ne!(uid, 0, "runAsNonRoot");

    // The image's entrypoint with the Deployment's args (it sets no command).
    assert!(container.get("command").is_none());
    let mut args = config["process"]["args"]
        .as_array()
        .expect("args")
        .iter()
        .take(1)
        .cloned()
        .collect::<Vec<_>>();
    for arg in container["args"].as_array().expect("Deployment args") {
        let arg = arg.as_str().expect("string arg");
        if arg.starts_with("--metrics-listen=") {
            args.push(json!(format!("--metrics-listen=127.0.0.1:{metrics_port}")));
        } else if arg.starts_with("--health-listen=") {
            assert_eq!(
                container["livenessProbe"]["httpGet"]["port"], "health",
                "the liveness probe uses the health listener"
            );
            args.push(json!(format!("--health-listen=127.0.0.1:{health_port}")));
        } else {
            args.push(json!(arg));
        }
    }
    let process = &mut config["process"];
    process["args"] = Value::Array(args);
    process["terminal"] = json!(false);
    process["user"] = json!({"uid": uid, "gid": uid});
    let env = process["env"].as_array_mut().expect("env");
    env.push(json!("KUBERNETES_SERVICE_HOST=127.0.0.1"));
    env.push(json!(format!("KUBERNETES_SERVICE_PORT={cluster_port}")));
    env.push(json!("HOSTNAME=hwkey-approver-7d9f8-x2x4z"));
    let security = &container["securityContext"];
    process["noNewPrivileges"] = json!(security["allowPrivilegeEscalation"] == json!(false));
    assert_eq!(security["capabilities"]["drop"], json!(["ALL"]));
    process["capabilities"] =
        json!({"bounding": [], "effective": [], "inheritable": [], "permitted": [], "ambient": []});
    config["root"]["readonly"] = json!(security["readOnlyRootFilesystem"] == json!(true));
    config["mounts"]
        .as_array_mut()
        .expect("mounts")
        .push(json!({
            "destination": "/var/run/secrets/kubernetes.io/serviceaccount",
            "type": "bind",
            "source": sa,
            "options": ["rbind", "ro"],
        }));
    // This machine's network namespace (see above).
    let namespaces = config["linux"]["namespaces"]
        .as_array_mut()
        .expect("namespaces");
    namespaces.retain(|ns| ns["type"] != "network");
    std::fs::write(&path, serde_json::to_vec_pretty(&config).expect("JSON")).expect("write");
}

/// Acceptance (issue 26): the image, at most 40 MiB and non-root, decides both requests under
/// runc against the real API server, serves /healthz and /metrics, and stops cleanly.
#[test]
fn the_approver_image_decides_under_runc_as_a_pod_would_run_it() {
    require_tool("umoci", "umoci");
    require_tool("runc", "runc");
    require_tool("kubectl", "kubectl (from the machine image)");
    let (layout, tag) = built_image();
    // The manifest names this image: same name, the crate version as the tag.
    let image = deployment()["spec"]["template"]["spec"]["containers"][0]["image"]
        .as_str()
        .expect("the container names an image")
        .to_string();
    assert!(
        image.ends_with(&format!("/hwkey-approver:{tag}")),
        "deploy/approver.yaml names {image}, not the image package.sh builds"
    );
    let index: Value = serde_json::from_str(&read(&layout.join("index.json"))).expect("JSON");
    assert_eq!(
        index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"],
        json!(tag)
    );
    let limit = 40 * 1024 * 1024;
    let packed = bytes_under(&layout.join("blobs"));
    assert!(packed <= limit, "the image is {packed} bytes, over 40 MiB");

    let id = Identity::tpm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let (trust, tcti) = enroll_node(&id, dir, "node7");
    install_approver(&cluster, &trust);
    let sa = service_account_dir(&cluster, dir);

    let bundle = dir.join("bundle");
    run_ok(
        Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(format!("{}:{tag}", layout.display()))
            .arg(&bundle),
    );
    let unpacked = bytes_under(&bundle.join("rootfs"));
    assert!(
        unpacked <= limit,
        "the unpacked image is {unpacked} bytes, over 40 MiB"
    );
    let image_config: Value =
        serde_json::from_str(&read(&bundle.join("config.json"))).expect("JSON");
    assert_eq!(
        image_config["process"]["user"]["uid"],
        json!(65532),
        "the image's user"
    );
    let (metrics_port, health_port) = (free_port(), free_port());
    configure_bundle(&bundle, &sa, cluster.port(), (metrics_port, health_port));

    let name = format!("hwkey-approver-test-{metrics_port}");
    let mut container = Container::run(&bundle, &name, &dir.join("container.log"));
    container
        .runc
        .wait_for_port(metrics_port, Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("the container did not start: {e}\n{}", container.runc.log()));
    assert_runs_confined(&name);
    decide_and_serve(
        &cluster,
        dir,
        &tcti,
        (metrics_port, health_port),
        &container,
    );

    let status = container.terminate();
    assert!(
        status.success(),
        "exit {status} on SIGTERM:\n{}",
        container.runc.log()
    );
    assert_eq!(lease_holder(&cluster), "", "the Lease is released");
}

/// An attested bootstrap is approved, a software key's request denied; /healthz and /metrics
/// answer and count both decisions.
fn decide_and_serve(
    cluster: &KubeCluster,
    dir: &Path,
    tcti: &str,
    ports: (u16, u16),
    container: &Container,
) {
    let (metrics_port, health_port) = ports;
    let get_from = |port: u16, path: &str| {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "5", "-w", "\n%{http_code}"])
            .arg(format!("http://127.0.0.1:{port}{path}"))
            .output()
            .expect("run curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let get = |path: &str| get_from(metrics_port, path);
    // The sample line itself (the metric's HELP text also starts with "1 while…").
    wait_until("the container leads", Duration::from_secs(30), || {
        get("/metrics")
            .lines()
            .any(|l| l == "hwkey_approver_leader 1")
    });
    let health = get_from(health_port, "/healthz");
    assert!(
        health.ends_with("\n200") && health.starts_with("ok: leading"),
        "{health}\n{}",
        container.runc.log()
    );
    let holder = lease_holder(cluster);
    assert!(
        holder.starts_with("hwkey-approver-7d9f8-x2x4z_"),
        "the Lease holder is the pod's name: {holder}"
    );

    let key = format!(
        "tpm:path={}?tcti={tcti}",
        dir.join("node7.tpm.pem").display()
    );
    let out = bootstrap_attested(cluster, "node7", &key, dir);
    assert!(
        output_text(&out).contains("bootstrapped: "),
        "{}",
        output_text(&out)
    );
    let node_csr = wait_for_csr(cluster, "hwkey-system-node-node7-");
    assert_eq!(
        csr_field(cluster, &node_csr, "{.status.conditions[0].reason}"),
        "AttestedTPMKey",
        "{}",
        container.runc.log()
    );
    stop_bootstrap_proxy(&dir.join("state"));

    submit_software_request(cluster, dir, "unattested", "node7", KUBELET_SIGNER);
    wait_until(
        "the unattested request is decided",
        Duration::from_secs(30),
        || !decisions_on(cluster, "unattested").is_empty(),
    );
    assert_eq!(decisions_on(cluster, "unattested"), ["Denied"]);
    assert_eq!(
        csr_field(cluster, "unattested", "{.status.conditions[0].reason}"),
        "NoEvidence"
    );
    let metrics = get("/metrics");
    for series in [
        "hwkey_approver_decisions_total{decision=\"approved\",reason=\"AttestedTPMKey\"} 1",
        "hwkey_approver_decisions_total{decision=\"denied\",reason=\"NoEvidence\"} 1",
    ] {
        assert!(metrics.contains(series), "{series} not in:\n{metrics}");
    }
}

/// What the kernel says of the container's process: the Deployment's non-root user, no
/// capabilities, no new privileges, and a read-only root filesystem.
fn assert_runs_confined(id: &str) {
    let state: Value =
        serde_json::from_slice(&run_ok(Command::new("runc").args(["state", id])).stdout)
            .expect("runc state prints JSON");
    let pid = state["pid"].as_u64().expect("the container's pid");
    let status = read(Path::new(&format!("/proc/{pid}/status")));
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .unwrap_or_else(|| panic!("no {name} in {status}"))
    };
    assert_eq!(field("Uid:"), "65532 65532 65532 65532");
    assert_eq!(field("Gid:"), "65532 65532 65532 65532");
    assert_eq!(field("CapEff:"), "0000000000000000");
    assert_eq!(field("CapBnd:"), "0000000000000000");
    assert_eq!(field("NoNewPrivs:"), "1");
    let mounts = read(Path::new(&format!("/proc/{pid}/mountinfo")));
    let root = mounts
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.get(4) == Some(&"/"))
        .unwrap_or_else(|| panic!("no root mount in {mounts}"));
    assert!(
        root[5].split(',').any(|o| o == "ro"),
        "the root filesystem is writable: {root:?}"
    );
}
