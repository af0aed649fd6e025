//! What the lifecycle's tests share with the approver's: finding and reading a
//! CertificateSigningRequest, and enrolling and bootstrapping an attested node.

#[cfg(feature = "tpm")]
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::kube::KubeCluster;
#[cfg(feature = "tpm")]
use support::{hwkey, proxy::Identity, run_ok};

/// The name of the first CertificateSigningRequest whose name starts with `prefix`.
pub(crate) fn wait_for_csr(cluster: &KubeCluster, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = cluster.kubectl_ok(&["get", "csr", "-o", "jsonpath={.items[*].metadata.name}"]);
        let names = String::from_utf8_lossy(&out.stdout).into_owned();
        if let Some(n) = names.split_whitespace().find(|n| n.starts_with(prefix)) {
            return n.to_string();
        }
        assert!(Instant::now() < deadline, "no CSR named {prefix}*: {names}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub(crate) fn csr_field(cluster: &KubeCluster, name: &str, jsonpath: &str) -> String {
    let out = cluster.kubectl_ok(&["get", "csr", name, "-o", &format!("jsonpath={jsonpath}")]);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `hwkey bootstrap --attest` of node `node` with a new TPM key `key`, as the bootstrap
/// identity: the certificate goes to DIR/NODE.pem, the kubelet kubeconfig to DIR/kubelet.conf,
/// the proxy's state to DIR/state. Fails the test if the command fails.
#[cfg(feature = "tpm")]
pub(crate) fn bootstrap_attested(
    cluster: &KubeCluster,
    node: &str,
    key: &str,
    dir: &Path,
) -> std::process::Output {
    run_ok(
        hwkey()
            .arg("bootstrap")
            .arg("--bootstrap-kubeconfig")
            .arg(&cluster.bootstrap_kubeconfig)
            .args(["--node-name", node, "--key", key, "--create-key", "ec-p256"])
            .arg("--attest")
            .arg("--cert")
            .arg(dir.join(format!("{node}.pem")))
            .arg("--out")
            .arg(dir.join("kubelet.conf"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .args(["--wait", "120s"]),
    )
}

/// Registers the TPM of a TPM identity as node `node`: `hwkey attest enroll`'s output stored as
/// DIR/trust/NODE. Returns the trust directory and the TPM's TCTI.
#[cfg(feature = "tpm")]
pub(crate) fn enroll_node(id: &Identity, dir: &Path, node: &str) -> (PathBuf, String) {
    let support::proxy::Backend::Tpm(tpm) = &id.backend else {
        unreachable!("a TPM identity has a TPM backend")
    };
    let trust = dir.join("trust");
    std::fs::create_dir(&trust).expect("trust dir");
    let enrollment = run_ok(hwkey().args([
        "attest",
        "enroll",
        "--key",
        &format!("tpm:?tcti={}", tpm.tcti()),
    ]));
    std::fs::write(trust.join(node), &enrollment.stdout).expect("register the node");
    (trust, tpm.tcti())
}
