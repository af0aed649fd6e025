//! What `deploy/` ships for kubelet: the example proxy config parses, a proxy run as a
//! `Type=notify` systemd service tells systemd when it is ready, and `hwkey kubeconfig
//! --for kubelet` writes a never-interactive exec block.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::{hwkey, run_ok, temp_dir};

#[test]
fn the_example_kubelet_config_is_a_valid_proxy_config() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubelet.toml.example");
    let config = hwkey::proxy::FileConfig::load(std::path::Path::new(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(config.key.as_deref().is_some_and(|k| k.starts_with("tpm:")));
    assert_eq!(config.listen.len(), 2);
    assert!(config.upstream.is_some() && config.upstream_ca.is_some());
}

#[test]
fn the_proxy_notifies_systemd_when_ready() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let notify_path = dir.path().join("notify.sock");
    let receiver = UnixDatagram::bind(&notify_path).expect("bind notify socket");
    receiver
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            envs: vec![("NOTIFY_SOCKET".into(), notify_path.display().to_string())],
            ..Default::default()
        },
    );
    let mut buf = [0u8; 256];
    let n = receiver.recv(&mut buf).expect("READY=1 from the proxy");
    assert_eq!(&buf[..n], b"READY=1");
    // And it really is ready: the admin endpoint answers.
    let (status, _) = proxy.admin_get("/healthz");
    assert_eq!(status, 200);
}

#[test]
fn kubelet_kubeconfig_is_never_interactive() {
    let dir = temp_dir();
    let ca = support::TestCa::new(dir.path());
    let out = dir.path().join("kubelet.conf");
    run_ok(
        hwkey()
            .args(["kubeconfig", "--for", "kubelet", "--name", "kubelet"])
            .args(["--key", "tpm:path=/var/lib/hwkey/node.tpm.pem"])
            .args([
                "--server",
                "https://10.0.0.1:6443",
                "--port",
                "6444",
                "--ca",
            ])
            .arg(ca.ca_path())
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--out")
            .arg(&out),
    );
    let doc: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(&out).expect("read")).expect("YAML");
    assert_eq!(doc["users"][0]["user"]["exec"]["interactiveMode"], "Never");
    assert_eq!(
        doc["clusters"][0]["cluster"]["server"],
        "https://127.0.0.1:6444"
    );
}
