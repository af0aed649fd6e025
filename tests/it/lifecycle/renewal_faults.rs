//! Issue 22, findings 5-7: `hwkey proxy --renew` against a signer that misbehaves on purpose,
//! on a real kube-apiserver whose controller manager neither approves nor signs: this test is
//! the signer. Each proxy's node name picks what the signer returns: a serverAuth-only
//! certificate, a CA certificate, one capped at the current NotAfter, the very certificate in
//! use, or a denial (with `--rotate-key`). Nothing the API server would refuse is installed,
//! requests keep working, no proxy asks more than once a minute, and no rotation leaves a key
//! behind.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use support::kube::{Approval, KubeCluster};
use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::*;

/// What the signer does for a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    ServerAuthOnly,
    Ca,
    Capped,
    Identical,
    Deny,
}

impl Mode {
    fn node(self) -> &'static str {
        match self {
            Mode::ServerAuthOnly => "server-only",
            Mode::Ca => "ca",
            Mode::Capped => "capped",
            Mode::Identical => "identical",
            Mode::Deny => "deny",
        }
    }

    fn of(node: &str) -> Option<Mode> {
        [
            Mode::ServerAuthOnly,
            Mode::Ca,
            Mode::Capped,
            Mode::Identical,
            Mode::Deny,
        ]
        .into_iter()
        .find(|m| m.node() == node)
    }
}

/// The signer: answers every new request once, as its node's mode says; counts requests per
/// node.
fn sign_loop(
    cluster: &KubeCluster,
    id: &Identity,
    certs: &BTreeMap<&'static str, PathBuf>,
    dir: &Path,
    seen: &Mutex<BTreeMap<String, u32>>,
    stop: &AtomicBool,
) {
    let mut answered = std::collections::HashSet::new();
    while !stop.load(Ordering::SeqCst) {
        let out = cluster.kubectl_ok(&["get", "csr", "-o", "json"]);
        let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("CSR list");
        for item in list["items"].as_array().cloned().unwrap_or_default() {
            let name = item["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if answered.contains(&name) {
                continue;
            }
            answered.insert(name.clone());
            use base64::Engine as _;
            let pem = base64::engine::general_purpose::STANDARD
                .decode(item["spec"]["request"].as_str().unwrap_or_default())
                .expect("request");
            let der = ::pem::parse(&pem).expect("PEM request").into_contents();
            let node = {
                use x509_parser::prelude::FromDer;
                let (_, csr) =
                    x509_parser::certification_request::X509CertificationRequest::from_der(&der)
                        .expect("request");
                let cn = csr
                    .certification_request_info
                    .subject
                    .iter_common_name()
                    .next()
                    .and_then(|c| c.as_str().ok())
                    .unwrap_or_default()
                    .to_string();
                cn.strip_prefix("system:node:")
                    .unwrap_or_default()
                    .to_string()
            };
            *seen.lock().expect("seen").entry(node.clone()).or_default() += 1;
            let Some(mode) = Mode::of(&node) else {
                continue;
            };
            if mode == Mode::Deny {
                cluster.kubectl_ok(&["certificate", "deny", &name]);
                continue;
            }
            let cert_pem = match mode {
                Mode::Identical => std::fs::read_to_string(&certs[mode.node()]).expect("cert"),
                Mode::Capped => {
                    // NotAfter no later than the certificate in use (which lives 150 s).
                    id.ca.sign_csr_pem_for(
                        &String::from_utf8(pem.clone()).expect("UTF-8"),
                        Duration::from_secs(20),
                    )
                }
                Mode::ServerAuthOnly | Mode::Ca => {
                    let ext = if mode == Mode::Ca {
                        "basicConstraints=critical,CA:TRUE\nkeyUsage=digitalSignature,keyCertSign\n"
                    } else {
                        "extendedKeyUsage=serverAuth\nkeyUsage=digitalSignature\n"
                    };
                    let csr_path = dir.join(format!("{name}.csr"));
                    let out_path = dir.join(format!("{name}.pem"));
                    std::fs::write(&csr_path, &pem).expect("csr");
                    id.ca.sign_with_extensions(&csr_path, ext, &out_path);
                    std::fs::read_to_string(&out_path).expect("signed")
                }
                Mode::Deny => unreachable!("answered above"),
            };
            cluster.kubectl_ok(&["certificate", "approve", &name]);
            let mut object: serde_json::Value = serde_json::from_slice(
                &cluster
                    .kubectl_ok(&["get", "csr", &name, "-o", "json"])
                    .stdout,
            )
            .expect("CSR");
            object["status"]["certificate"] = base64::engine::general_purpose::STANDARD
                .encode(cert_pem)
                .into();
            let path = dir.join(format!("{name}.status.json"));
            std::fs::write(&path, object.to_string()).expect("write");
            cluster.kubectl_ok(&[
                "replace",
                "--raw",
                &format!("/apis/certificates.k8s.io/v1/certificatesigningrequests/{name}/status"),
                "-f",
                &path.display().to_string(),
            ]);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn a_misbehaving_signer_gets_nothing_installed_and_one_request_per_floor() {
    let mut id = Identity::softhsm();
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::TestSigner);
    let work = temp_dir();
    let dir = work.path();
    let modes = [
        Mode::ServerAuthOnly,
        Mode::Ca,
        Mode::Capped,
        Mode::Identical,
        Mode::Deny,
    ];
    // One key and one node certificate per mode, from the cluster CA: an hour into its
    // lifetime, so renewal is due at once, with 150 s left, so it still works when nothing
    // renews it. (The renewal floor is then 10 % of the lifetime, about six minutes.)
    let mut certs = BTreeMap::new();
    let mut keys = BTreeMap::new();
    for mode in modes {
        let uri = id.sibling_uri(mode.node());
        id.create_key(&uri);
        let csr = run_ok(hwkey().envs(id.envs()).args([
            "csr",
            "--key",
            &uri,
            "--subject",
            &format!("CN=system:node:{},O=system:nodes", mode.node()),
        ]));
        let pem = id.ca.sign_csr_pem_window(
            &String::from_utf8(csr.stdout).expect("UTF-8"),
            Duration::from_secs(3600),
            Duration::from_secs(150),
        );
        let path = dir.join(format!("{}.pem", mode.node()));
        std::fs::write(&path, pem).expect("write cert");
        certs.insert(mode.node(), path);
        keys.insert(mode.node(), uri);
    }
    let seen = Mutex::new(BTreeMap::new());
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let states: Vec<PathBuf> = modes
        .iter()
        .map(|m| dir.join(format!("state-{}", m.node())))
        .collect();
    std::thread::scope(|scope| {
        let signer = scope.spawn(|| sign_loop(&cluster, &id, &certs, dir, &seen, &stop));
        let proxies: Vec<ProxyProcess> = modes
            .iter()
            .zip(&states)
            .map(|(mode, state)| {
                let mut args = vec!["--renew".to_string()];
                if *mode == Mode::Deny {
                    args.push("--rotate-key".into());
                }
                ProxyProcess::start_to(
                    &id,
                    &cluster.url(),
                    ProxyOptions {
                        args,
                        key: Some(&keys[mode.node()]),
                        cert: Some(&certs[mode.node()]),
                        state_dir: Some(state),
                        ..Default::default()
                    },
                )
            })
            .collect();
        let originals: Vec<String> = modes
            .iter()
            .map(|m| std::fs::read_to_string(&certs[m.node()]).expect("cert"))
            .collect();
        // Long enough for the old code's 2-4-8-16-32 s backoff to have made six requests.
        while started.elapsed() < Duration::from_secs(75) {
            for (mode, proxy) in modes.iter().zip(&proxies) {
                let out = proxy.curl_unix(
                    &["-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10"],
                    "/api",
                );
                assert_eq!(
                    String::from_utf8_lossy(&out.stdout),
                    "200",
                    "{mode:?}: a request failed: {}\n{}",
                    output_text(&out),
                    proxy.log()
                );
            }
            std::thread::sleep(Duration::from_secs(3));
        }
        stop.store(true, Ordering::SeqCst);
        signer.join().expect("signer");
        let seen = seen.lock().expect("seen").clone();
        for ((mode, proxy), original) in modes.iter().zip(&proxies).zip(&originals) {
            let requests = seen.get(mode.node()).copied().unwrap_or(0);
            assert!(
                requests == 1,
                "{mode:?}: {requests} requests in 75 s (one, then the floor):\n{}",
                proxy.log()
            );
            assert_eq!(
                &std::fs::read_to_string(&certs[mode.node()]).expect("cert"),
                original,
                "{mode:?}: the certificate file changed:\n{}",
                proxy.log()
            );
            assert!(
                proxy.metric("hwkey_renewals_total{result=\"failed\"}") >= 1.0,
                "{mode:?}: no failure counted"
            );
        }
        let capped = &proxies[2];
        assert!(
            capped.log().contains("caps certificate lifetimes"),
            "{}",
            capped.log()
        );
    });
    // The rotation whose requests were denied left no key behind; the configured one is there.
    let token = match &id.backend {
        support::proxy::Backend::SoftHsm(h) => h.token_uri("kube"),
        _ => unreachable!("a SoftHSM identity"),
    };
    let listed = stdout_of(&run_ok(
        hwkey()
            .envs(id.envs())
            .args(["key", "list", "--key", &token]),
    ));
    assert!(
        listed.contains("object=deny") && !listed.contains("object=deny-r"),
        "{listed}"
    );
}

fn stdout_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}
