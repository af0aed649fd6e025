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
    let config = hwkey::proxy::SettingsInput::from_file(std::path::Path::new(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(matches!(config.key, Some(hwkey::key::KeyUri::Tpm(_))));
    assert_eq!(config.listen.len(), 2);
    assert!(!config.upstream.is_empty() && config.upstream_ca.is_some());
    config.resolve().unwrap_or_else(|e| panic!("{path}: {e}"));
}

/// `deploy/proxy.example.toml` parses, and documents every flag of `hwkey proxy` that a file
/// can set (so a new flag without an example entry fails here).
#[test]
fn the_annotated_example_config_parses_and_covers_every_flag() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/proxy.example.toml");
    let config = hwkey::proxy::SettingsInput::from_file(std::path::Path::new(path))
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(matches!(config.key, Some(hwkey::key::KeyUri::Pkcs11(_))));
    assert_eq!(config.listen.len(), 2);
    let text = std::fs::read_to_string(path).expect("read the example");
    let help = support::flow::stdout(&run_ok(hwkey().args(["proxy", "--help"])));
    let flags: Vec<&str> = help
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("--"))
        .map(|w| w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric() && c != '-'))
        .filter(|f| !f.is_empty() && !["help", "config", "pin-stdin", "log-format"].contains(f))
        .collect();
    assert!(flags.len() > 15, "too few flags found in --help: {flags:?}");
    for flag in flags {
        assert!(
            text.contains(&format!("\n{flag} = ")) || text.contains(&format!("# {flag} = ")),
            "deploy/proxy.example.toml does not document `{flag}`"
        );
    }
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
    assert_eq!(&buf[..n], b"READY=1\n");
    // And it really is ready: the admin endpoint answers.
    let (status, _) = proxy.admin_get("/healthz");
    assert_eq!(status, 200);

    // `systemctl reload` (Type=notify-reload) sends SIGHUP and waits for RELOADING=1 with the
    // monotonic time, then READY=1 when the reload is over.
    proxy.signal(libc::SIGHUP);
    let n = receiver.recv(&mut buf).expect("RELOADING=1 from the proxy");
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(text.starts_with("RELOADING=1\nMONOTONIC_USEC="), "{text}");
    let n = receiver.recv(&mut buf).expect("READY=1 after the reload");
    assert_eq!(&buf[..n], b"READY=1\n");
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
    let doc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&out).expect("read")).expect("YAML");
    assert_eq!(doc["users"][0]["user"]["exec"]["interactiveMode"], "Never");
    assert_eq!(
        doc["clusters"][0]["cluster"]["server"],
        "https://127.0.0.1:6444"
    );
}

/// Both shipped units pass a security audit: `systemd-analyze security --offline=yes` rates
/// each at most 2.0 (the proxy's was 8.9 EXPOSED, the approver's 5.0 MEDIUM), read from the
/// files as shipped.
#[test]
fn the_shipped_units_score_at_most_2_0_in_systemd_analyze_security() {
    support::require_tool("systemd-analyze", "systemd");
    for unit in ["hwkey-proxy@.service", "hwkey-approver.service"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("deploy")
            .join(unit);
        let work = temp_dir();
        let out = run_ok(
            std::process::Command::new("systemd-analyze")
                .args(["security", "--offline=yes", "--no-pager"])
                .arg(&path)
                .current_dir(work.path()),
        );
        let text = support::flow::stdout(&out);
        let score: f64 = text
            .lines()
            .find_map(|l| l.split("Overall exposure level for ").nth(1))
            .and_then(|rest| rest.split(": ").nth(1))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no overall exposure level for {unit}:\n{text}"));
        assert!(score <= 2.0, "{unit} scores {score}:\n{text}");
    }
}

/// The approver's Deployment as shipped: replicas only on control-plane nodes (a worker's
/// kubelet could take the service-account token and approve node certificates for other
/// names), non-root with no privilege, the runtime's default seccomp profile, a read-only root.
#[test]
fn the_approver_runs_only_on_control_plane_nodes_and_confined() {
    use serde::Deserialize as _;
    let manifest = include_str!("../../../deploy/approver.yaml");
    let deployment = serde_yaml_ng::Deserializer::from_str(manifest)
        .map(|doc| serde_yaml_ng::Value::deserialize(doc).expect("YAML"))
        .find(|v| v["kind"] == "Deployment")
        .expect("a Deployment");
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(
        pod["nodeSelector"]["node-role.kubernetes.io/control-plane"], "",
        "{pod:?}"
    );
    assert!(
        pod["tolerations"].as_sequence().is_some_and(|t| t
            .iter()
            .any(|t| t["key"] == "node-role.kubernetes.io/control-plane")),
        "{pod:?}"
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let container = &pod["containers"][0]["securityContext"];
    assert_eq!(container["allowPrivilegeEscalation"], false);
    assert_eq!(container["readOnlyRootFilesystem"], true);
    assert_eq!(container["capabilities"]["drop"][0], "ALL");
}

/// Issue 35, tpm2-abrmd finding: a node's identity must not depend on a broker any local user
/// can fill or lock out. The shipped kubelet deployment reaches the TPM through the kernel's
/// resource manager only: the example's key names `device:/dev/tpmrm0`, the unit may open
/// that device and no other TPM device (not the raw `/dev/tpm0`, which bypasses the resource
/// manager), is not ordered to need tpm2-abrmd, and the package puts the `hwkey` user in
/// group `tss`, which `/dev/tpmrm0` is restricted to.
#[test]
fn the_kubelet_deployment_reaches_the_tpm_through_the_kernel_resource_manager() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |p: &str| std::fs::read_to_string(root.join(p)).expect(p);
    let example = read("deploy/kubelet.toml.example");
    let key = example
        .lines()
        .find_map(|l| l.strip_prefix("key = "))
        .expect("the example names a key");
    assert!(key.contains("tcti=device:/dev/tpmrm0"), "{key}");
    assert!(!example.contains("tabrmd"), "{example}");
    let unit = read("deploy/hwkey-proxy@.service");
    let devices: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("DeviceAllow="))
        .collect();
    assert_eq!(devices, ["/dev/tpmrm0 rw"], "{unit}");
    assert!(unit.lines().any(|l| l == "DevicePolicy=closed"), "{unit}");
    for line in unit.lines() {
        if line.starts_with("Requires=")
            || line.starts_with("Wants=")
            || line.starts_with("BindsTo=")
        {
            assert!(!line.contains("abrmd"), "{line}");
        }
    }
    let postinst = read("debian/postinst");
    assert!(
        postinst.contains("for group in tss softhsm") && postinst.contains("adduser"),
        "{postinst}"
    );
}

/// The kubelet example and the unit agree: the UNIX socket is in the instance's runtime
/// directory (the unit leaves `/run/hwkey` itself to root), and the key file and the
/// certificate are in a state directory of the unit other than the instance's state directory
/// (the network side writes that one: it could delete a key kept there, and a proxy whose key
/// file it could delete refuses to start).
#[test]
fn the_kubelet_example_keeps_its_key_and_socket_where_the_unit_says() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |p: &str| std::fs::read_to_string(root.join(p)).expect(p);
    let config = hwkey::proxy::SettingsInput::from_file(&root.join("deploy/kubelet.toml.example"))
        .expect("the example parses");
    let unit = read("deploy/hwkey-proxy@.service");
    let dirs = |key: &str| -> Vec<String> {
        unit.lines()
            .filter_map(|l| l.strip_prefix(key))
            .flat_map(|v| v.split_whitespace())
            .map(|d| d.replace("%i", "kubelet"))
            .collect()
    };
    let runtime: Vec<String> = dirs("RuntimeDirectory=")
        .iter()
        .map(|d| format!("/run/{d}"))
        .collect();
    let state: Vec<String> = dirs("StateDirectory=")
        .iter()
        .map(|d| format!("/var/lib/{d}"))
        .collect();
    let instance_state = "/var/lib/hwkey/kubelet";
    assert!(state.iter().any(|d| d == instance_state), "{state:?}");
    let sockets: Vec<std::path::PathBuf> = config
        .listen
        .iter()
        .filter_map(|l| {
            l.to_string()
                .strip_prefix("unix:")
                .map(std::path::PathBuf::from)
        })
        .collect();
    assert!(!sockets.is_empty());
    for socket in &sockets {
        let dir = socket.parent().expect("a directory").display().to_string();
        assert!(
            runtime.contains(&dir),
            "{} is not in {runtime:?}",
            socket.display()
        );
    }
    let hwkey::key::KeyUri::Tpm(tpm) = config.key.as_ref().expect("a key") else {
        panic!("a TPM key")
    };
    let Some(hwkey::key::TpmKeyLocation::Path(key_file)) = &tpm.key else {
        panic!("a key file")
    };
    let cert = config.cert.as_ref().expect("a certificate");
    for file in [key_file, cert] {
        let dir = file.parent().expect("a directory").display().to_string();
        assert!(
            state.contains(&dir) && dir != instance_state,
            "{} is not in a state directory of its own: {state:?}",
            file.display()
        );
    }
}
