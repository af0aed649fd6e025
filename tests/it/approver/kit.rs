//! What the approver's tests share: the shipped manifest and its Deployment's arguments, a
//! replica started as the Deployment starts it, requests made and submitted as a joining node
//! would, the trust ConfigMap, a TPM with a key, and waiting for a decision.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use support::kube::KubeCluster;
use support::*;

use crate::lifecycle::kit::csr_field;

/// The manifest operators apply.
pub(crate) const MANIFEST: &str = include_str!("../../../deploy/approver.yaml");
pub(crate) const KUBELET_SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";
/// The people overlay operators apply on top.
pub(crate) const PEOPLE_MANIFEST: &str = include_str!("../../../deploy/approver-people.yaml");
/// People's signer.
pub(crate) const CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client";
/// A person's request's usages.
pub(crate) const USAGES: &str = "[digital signature, key encipherment, client auth]";

/// Every authenticated identity may create, get and watch CertificateSigningRequests, so that
/// each attacker reaches the approver (RBAC is not what stops them here).
pub(crate) const ANYONE_MAY_REQUEST: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: anyone-requests-certificates
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: system:node-bootstrapper
subjects:
- apiGroup: rbac.authorization.k8s.io
  kind: Group
  name: system:authenticated
"#;

/// The Deployment in the manifest, as shipped (as JSON, for field access).
pub(crate) fn deployment() -> serde_json::Value {
    use serde::Deserialize as _;
    for doc in serde_yaml_ng::Deserializer::from_str(MANIFEST) {
        let value = serde_yaml_ng::Value::deserialize(doc).expect("deploy/approver.yaml parses");
        if value["kind"] == "Deployment" {
            return serde_json::to_value(&value).expect("YAML as JSON");
        }
    }
    panic!("deploy/approver.yaml has no Deployment");
}

/// The Deployment's container arguments, as shipped.
fn deployment_args() -> Vec<String> {
    deployment()["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("the container has args")
        .iter()
        .map(|a| a.as_str().expect("string arg").to_string())
        .collect()
}

/// Installs the approver as shipped (`deploy/approver.yaml`) and registers the nodes in `trust`
/// (one file per node) in its ConfigMap.
pub(crate) fn install_approver(cluster: &KubeCluster, trust: &Path) {
    cluster.apply(MANIFEST);
    cluster.kubectl_ok(&[
        "-n",
        "hwkey-system",
        "create",
        "configmap",
        "hwkey-approver-trust",
        &format!("--from-file={}", trust.display()),
    ]);
}

/// The holder of the approver's Lease ("" when released).
pub(crate) fn lease_holder(cluster: &KubeCluster) -> String {
    let out = cluster.kubectl_ok(&[
        "-n",
        "hwkey-system",
        "get",
        "lease",
        "hwkey-approver",
        "-o",
        "jsonpath={.spec.holderIdentity}",
    ]);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Stops the proxy `hwkey bootstrap` left running in `state` (for the node's kubelet).
pub(crate) fn stop_bootstrap_proxy(state: &Path) {
    if let Some(pid) = std::fs::read_to_string(state.join("proxy.pid"))
        .ok()
        .and_then(|p| p.trim().parse::<i32>().ok())
    {
        let _ = Command::new("kill").arg(pid.to_string()).status();
    }
}

/// A replica's lease timings.
#[derive(Clone, Copy)]
pub(crate) enum Leases {
    /// Lease 15 s, renew deadline 10 s, retry 500 ms: a leader on a slow machine keeps its
    /// lease (a handover after SIGTERM still takes under a second: the lease is released).
    Steady,
    /// Lease 4 s, renew deadline 3 s: for the test of a leader whose API server stops
    /// answering, which must step down by the renew deadline.
    Short,
}

impl Leases {
    fn args(self) -> [&'static str; 3] {
        match self {
            Leases::Steady => [
                "--leader-elect-lease-duration=15s",
                "--leader-elect-renew-deadline=10s",
                "--leader-elect-retry-period=500ms",
            ],
            Leases::Short => [
                "--leader-elect-lease-duration=4s",
                "--leader-elect-renew-deadline=3s",
                "--leader-elect-retry-period=500ms",
            ],
        }
    }
}

/// One approver replica: the Deployment's arguments, the service account's kubeconfig and a
/// loopback metrics port.
pub(crate) struct Replica {
    pub(crate) child: ChildGuard,
    port: u16,
}

impl Replica {
    pub(crate) fn start(kubeconfig: &Path, dir: &Path, name: &str) -> Replica {
        Replica::start_with(hwkey(), kubeconfig, dir, name, Leases::Steady)
    }

    /// As [`Replica::start`], running `cmd` (another build of hwkey) with `leases`.
    pub(crate) fn start_with(
        cmd: Command,
        kubeconfig: &Path,
        dir: &Path,
        name: &str,
        leases: Leases,
    ) -> Replica {
        Replica::spawn(cmd, kubeconfig, dir, name, leases, &[])
    }

    /// As [`Replica::start`], with `extra` arguments after the Deployment's (e.g. the people
    /// policy's, as deploy/approver-people.yaml says to add them).
    pub(crate) fn start_extra(
        kubeconfig: &Path,
        dir: &Path,
        name: &str,
        extra: &[String],
    ) -> Replica {
        Replica::spawn(hwkey(), kubeconfig, dir, name, Leases::Steady, extra)
    }

    fn spawn(
        mut cmd: Command,
        kubeconfig: &Path,
        dir: &Path,
        name: &str,
        leases: Leases,
        extra: &[String],
    ) -> Replica {
        let port = free_port();
        for arg in deployment_args() {
            if arg.starts_with("--metrics-listen=") {
                cmd.arg(format!("--metrics-listen=127.0.0.1:{port}"));
            } else if arg.starts_with("--health-listen=") {
                cmd.arg(format!("--health-listen=127.0.0.1:{}", free_port()));
            } else {
                cmd.arg(arg);
            }
        }
        cmd.args(extra)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(leases.args())
            .env("HWKEY_LOG", "info");
        let mut child = ChildGuard::spawn(&mut cmd, name, &dir.join(format!("{name}.log")));
        child
            .wait_for_port(port, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{name} did not start: {e}"));
        Replica { child, port }
    }

    /// One value from `/metrics` (the first sample line starting with `series`).
    pub(crate) fn metric(&self, series: &str) -> f64 {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "5"])
            .arg(format!("http://127.0.0.1:{}/metrics", self.port))
            .output()
            .expect("run curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .find_map(|l| l.strip_prefix(series))
            .and_then(|rest| rest.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in:\n{text}\n{}", self.child.log()))
    }

    pub(crate) fn leading(&self) -> bool {
        self.metric("hwkey_approver_leader ") == 1.0
    }

    pub(crate) fn decided(&self, decision: &str, reason: &str) -> f64 {
        self.metric(&format!(
            "hwkey_approver_decisions_total{{decision=\"{decision}\",reason=\"{reason}\"}}"
        ))
    }

    /// SIGTERM, as the kubelet stops a pod; the exit status.
    pub(crate) fn terminate(mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "the approver did not stop on SIGTERM:\n{}",
                self.child.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

pub(crate) fn wait_until(what: &str, limit: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A node-client request for `CN=system:node:NODE` whose key is a software key made by openssl
/// (what a thief with the bootstrap token would send), created as the bootstrap identity.
pub(crate) fn submit_software_request(
    cluster: &KubeCluster,
    dir: &Path,
    name: &str,
    node: &str,
    signer: &str,
) {
    let subject = format!("/O=system:nodes/CN=system:node:{node}");
    let pem = openssl_request(dir, name, &subject, None);
    submit_request(cluster, dir, name, &pem, signer);
}

/// A software-key request made by openssl for `subject` (OpenSSL style), with `-addext EXT`
/// when given: PEM. Its key is DIR/NAME.key.
pub(crate) fn openssl_request(dir: &Path, name: &str, subject: &str, ext: Option<&str>) -> Vec<u8> {
    let out = dir.join(format!("{name}.csr"));
    let mut cmd = Command::new("openssl");
    cmd.args([
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
    ])
    .args(["-nodes", "-subj", subject]);
    if let Some(ext) = ext {
        cmd.args(["-addext", ext]);
    }
    run_ok(
        cmd.arg("-keyout")
            .arg(dir.join(format!("{name}.key")))
            .arg("-out")
            .arg(&out),
    );
    std::fs::read(&out).expect("read CSR")
}

/// Creates CertificateSigningRequest `name` for the PEM request `pem`, as the bootstrap identity.
pub(crate) fn submit_request(
    cluster: &KubeCluster,
    dir: &Path,
    name: &str,
    pem: &[u8],
    signer: &str,
) {
    let object = csr_object(dir, name, pem, signer, NODE_USAGES);
    create_as_bootstrap(cluster, &object);
}

/// The usages kubelet asks for.
pub(crate) const NODE_USAGES: &str = "[digital signature, key encipherment, client auth]";

/// Writes a CertificateSigningRequest object for `pem` with `usages` (a YAML list). It carries
/// a label and an annotation of the test kit's, which an approval must keep.
pub(crate) fn csr_object(
    dir: &Path,
    name: &str,
    pem: &[u8],
    signer: &str,
    usages: &str,
) -> std::path::PathBuf {
    csr_object_with(dir, name, pem, signer, usages, &[])
}

/// The kit's annotation on every request it makes ([`csr_object`]).
pub(crate) const KIT_ANNOTATION: (&str, &str) = ("hwkey-test/note", "made by the test kit");

/// As [`csr_object`], with more annotations.
pub(crate) fn csr_object_with(
    dir: &Path,
    name: &str,
    pem: &[u8],
    signer: &str,
    usages: &str,
    annotations: &[(&str, &str)],
) -> std::path::PathBuf {
    use base64::Engine as _;
    let request = base64::engine::general_purpose::STANDARD.encode(pem);
    let object = dir.join(format!("{name}.yaml"));
    let annotations: String = std::iter::once(KIT_ANNOTATION)
        .chain(annotations.iter().copied())
        .map(|(k, v)| format!("    {k}: \"{v}\"\n"))
        .collect();
    std::fs::write(
        &object,
        format!(
            "apiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\nmetadata:\n  name: {name}\n  labels:\n    hwkey-test/made-by: kit\n  annotations:\n{annotations}spec:\n  signerName: {signer}\n  usages: {usages}\n  request: {request}\n"
        ),
    )
    .expect("write CSR object");
    object
}

/// `kubectl create -f OBJECT` as the bootstrap identity (a joining node's).
pub(crate) fn create_as_bootstrap(cluster: &KubeCluster, object: &Path) {
    run_ok(
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&cluster.bootstrap_kubeconfig)
            .args(["create", "-f"])
            .arg(object),
    );
}

/// The Approved/Denied conditions of request `name`, e.g. ["Denied"].
pub(crate) fn decisions_on(cluster: &KubeCluster, name: &str) -> Vec<String> {
    csr_field(cluster, name, "{.status.conditions[*].type}")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// A TPM with a key of its own.
pub(crate) struct Tpm {
    _tpm: Option<Swtpm>,
    pub(crate) tcti: String,
    pub(crate) key: String,
}

impl Tpm {
    pub(crate) fn new(dir: &Path, name: &str) -> Tpm {
        let tpm = Swtpm::start();
        let tcti = tpm.tcti();
        Tpm::with(Some(tpm), tcti, dir, name)
    }

    pub(crate) fn with(tpm: Option<Swtpm>, tcti: String, dir: &Path, name: &str) -> Tpm {
        let key = format!(
            "tpm:path={}?tcti={tcti}",
            dir.join(format!("{name}.tpm.pem")).display()
        );
        run_ok(hwkey().args(["key", "create", "--key", &key, "--algorithm", "ec-p256"]));
        Tpm {
            _tpm: tpm,
            tcti,
            key,
        }
    }

    pub(crate) fn enrollment(&self) -> String {
        let out = run_ok(hwkey().args([
            "attest",
            "enroll",
            "--key",
            &format!("tpm:?tcti={}", self.tcti),
        ]));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `hwkey csr --attest` for `subject` (extra arguments: `--dns`, `--ip`): PEM.
    pub(crate) fn request(&self, subject: &str, extra: &[&str]) -> Vec<u8> {
        run_ok(
            hwkey()
                .args(["csr", "--key", &self.key, "--subject", subject, "--attest"])
                .args(extra),
        )
        .stdout
    }
}

/// `kubectl create -f OBJECT` with `kubeconfig`.
pub(crate) fn create_with(kubeconfig: &Path, object: &Path) {
    run_ok(
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["create", "-f"])
            .arg(object),
    );
}

/// Waits for `name`'s decision; asserts it is `want` with `reason`, and (when denied) that no
/// certificate was issued.
pub(crate) fn assert_decided(
    cluster: &KubeCluster,
    name: &str,
    want: &str,
    reason: &str,
    log: &dyn Fn() -> String,
) {
    if let Err(e) = decided_as(cluster, name, want, reason, Duration::from_secs(30)) {
        panic!("{e}\n{}", log());
    }
}

/// Waits up to `limit` for `name`'s decision: Ok when it is `want` with `reason` (and, when
/// denied, nothing was issued), else what happened instead, in words.
pub(crate) fn decided_as(
    cluster: &KubeCluster,
    name: &str,
    want: &str,
    reason: &str,
    limit: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    while decisions_on(cluster, name).is_empty() {
        if Instant::now() >= deadline {
            return Err(format!("{name} is never decided (waited {limit:?})"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let got = (
        csr_field(cluster, name, "{.status.conditions[0].type}"),
        csr_field(cluster, name, "{.status.conditions[0].reason}"),
    );
    if (got.0.as_str(), got.1.as_str()) != (want, reason) {
        std::thread::sleep(Duration::from_millis(500));
        let issued = issued_subject(cluster, name);
        return Err(format!(
            "{name}: {} {} ({}), not {want} {reason}{}",
            got.0,
            got.1,
            csr_field(cluster, name, "{.status.conditions[0].message}"),
            issued
                .map(|s| format!("; issued a certificate for {s}"))
                .unwrap_or_default()
        ));
    }
    if want == "Denied" {
        std::thread::sleep(Duration::from_millis(300));
        if let Some(s) = issued_subject(cluster, name) {
            return Err(format!("{name} was denied, yet issued for {s}"));
        }
    }
    Ok(())
}

/// The subject of the certificate issued for `name`, if one was.
fn issued_subject(cluster: &KubeCluster, name: &str) -> Option<String> {
    use base64::Engine as _;
    let cert = csr_field(cluster, name, "{.status.certificate}");
    let pem = base64::engine::general_purpose::STANDARD
        .decode(cert.trim())
        .ok()?;
    let der = pem::parse(pem).ok()?.into_contents();
    let (_, parsed) = x509_parser::parse_x509_certificate(&der).ok()?;
    Some(parsed.subject().to_string())
}

/// The trust ConfigMap from `entries` (name → text), replacing what is there.
pub(crate) fn apply_trust(cluster: &KubeCluster, dir: &Path, entries: &[(&str, String)]) {
    apply_config_map(cluster, dir, "hwkey-approver-trust", entries);
}

/// ConfigMap `hwkey-system/NAME` from `entries` (name → text), replacing what is there.
pub(crate) fn apply_config_map(
    cluster: &KubeCluster,
    dir: &Path,
    name: &str,
    entries: &[(&str, String)],
) {
    let folder = dir.join(format!("{name}-{}", entries.len()));
    let _ = std::fs::remove_dir_all(&folder);
    std::fs::create_dir(&folder).expect("entries folder");
    for (name, text) in entries {
        std::fs::write(folder.join(name), text).expect("entry");
    }
    let yaml = cluster.kubectl_ok(&[
        "-n",
        "hwkey-system",
        "create",
        "configmap",
        name,
        &format!("--from-file={}", folder.display()),
        "--dry-run=client",
        "-o",
        "yaml",
    ]);
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, &yaml.stdout).expect("write");
    cluster.kubectl_ok(&["apply", "-f", &path.display().to_string()]);
}
