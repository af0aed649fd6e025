//! A TPM shared as hosts share theirs (issue 24, item 1): swtpm behind tpm2-abrmd, every
//! client through `tabrmd:bus_type=session`. hwkey must not assume it is the TPM's only client:
//! two proxies on one key serve requests while, on the same TPM and at the same time, other
//! hwkey processes renew the key's certificate with evidence through a real API server, enroll
//! an attestation key, create keys and make attested CSRs.

use std::process::Command;

use std::sync::atomic::{AtomicBool, Ordering};

use support::kube::{Approval, KubeCluster};
use support::proxy::{Identity, ProxyProcess};
use support::upstream::TestUpstream;
use support::{hwkey, output_text, run_ok, ChildGuard};

/// Requests each client makes at least (and more while the other processes still run); a
/// count, not a duration, so the test proves the same on any machine.
const REQUESTS: usize = 25;

#[test]
fn two_proxies_serve_while_other_processes_use_the_same_tpm() {
    let id = Identity::shared_tpm();
    let tpm_only = "tpm:?tcti=tabrmd:bus_type=session";
    // A real control plane where only the hwkey approver decides, trusting this TPM as node
    // `shared`; the identity is that node's.
    let cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = support::temp_dir();
    let trust = work.path().join("trust");
    std::fs::create_dir(&trust).expect("trust dir");
    let enrollment = run_ok(
        hwkey()
            .envs(id.envs())
            .args(["attest", "enroll", "--key", tpm_only]),
    );
    std::fs::write(trust.join("shared"), &enrollment.stdout).expect("register the node");
    id.issue(
        &id.key_uri,
        "CN=system:node:shared,O=system:nodes",
        &id.cert,
    );
    let mut approver = hwkey();
    approver
        .arg("approver")
        .arg("--kubeconfig")
        .arg(&cluster.admin_kubeconfig)
        .args([
            "--signer-name",
            "kubernetes.io/kube-apiserver-client-kubelet",
            "--leader-elect=false",
            "--trust",
        ])
        .arg(&trust);
    let approver = ChildGuard::spawn(&mut approver, "approver", &work.path().join("approver.log"));

    let upstream = TestUpstream::start(&id.ca);
    let first = ProxyProcess::start(&id, &upstream);
    let second = ProxyProcess::start(&id, &upstream);
    let busy = AtomicBool::new(true);

    let (requests, failures, csrs) = std::thread::scope(|s| {
        // Eight clients on the first proxy, two on the second, until the other work is done
        // (and at least REQUESTS each).
        let clients: Vec<_> = (0..10)
            .map(|c| {
                let proxy = if c < 8 { &first } else { &second };
                let busy = &busy;
                s.spawn(move || {
                    let (mut made, mut failed) = (0, 0);
                    while made < REQUESTS || busy.load(Ordering::Relaxed) {
                        let out = proxy.curl_unix(&["-f"], "/version");
                        made += 1;
                        failed += usize::from(!out.status.success());
                    }
                    (made, failed)
                })
            })
            .collect();
        // Meanwhile, on the same TPM: renew the node's certificate with evidence through the
        // real API server, enroll again, create keys, make attested requests.
        let renewal = s.spawn(|| {
            hwkey()
                .envs(id.envs())
                .args(["renew", "--key", &id.key_uri, "--cert"])
                .arg(&id.cert)
                .args(["--server", &cluster.url(), "--ca"])
                .arg(cluster.ca_path())
                .args(["--wait", "120s", "--attest"])
                .output()
                .expect("run hwkey renew")
        });
        let others: Vec<_> = (0..4)
            .map(|i| {
                let id = &id;
                s.spawn(move || {
                    let key = id.sibling_uri(&format!("other-{i}"));
                    run_ok(
                        hwkey()
                            .envs(id.envs())
                            .args(["key", "create", "--key", &key]),
                    );
                    if i == 0 {
                        run_ok(
                            hwkey()
                                .envs(id.envs())
                                .args(["attest", "enroll", "--key", tpm_only]),
                        );
                    }
                    let csr = run_ok(hwkey().envs(id.envs()).args([
                        "csr",
                        "--attest",
                        "--key",
                        &key,
                        "--subject",
                        &format!("CN=system:node:n{i},O=system:nodes"),
                    ]));
                    String::from_utf8_lossy(&csr.stdout).to_string()
                })
            })
            .collect();
        let csrs: Vec<String> = others
            .into_iter()
            .map(|o| o.join().expect("TPM client thread"))
            .collect();
        let renewed = renewal.join().expect("renew thread");
        busy.store(false, Ordering::Relaxed);
        assert!(
            renewed.status.success(),
            "renew --attest failed: {}\n{}",
            output_text(&renewed),
            approver.log()
        );
        let (requests, failures) = clients
            .into_iter()
            .map(|c| c.join().expect("client thread"))
            .fold((0, 0), |(m, f), (made, failed)| (m + made, f + failed));
        (requests, failures, csrs)
    });
    assert_eq!(
        failures, 0,
        "{failures} of {requests} requests failed while the TPM was shared"
    );
    // The renewal was admitted on its evidence, and the new certificate is the node's.
    let reasons = String::from_utf8_lossy(
        &cluster
            .kubectl_ok(&[
                "get",
                "csr",
                "-o",
                "jsonpath={.items[*].status.conditions[0].reason}",
            ])
            .stdout,
    )
    .to_string();
    assert_eq!(reasons.trim(), "AttestedTPMKey", "{}", approver.log());
    let subject = run_ok(
        Command::new("openssl")
            .args(["x509", "-noout", "-subject", "-in"])
            .arg(&id.cert),
    );
    assert!(
        output_text(&subject).contains("system:node:shared"),
        "{}",
        output_text(&subject)
    );
    let dir = support::temp_dir();
    for (i, csr) in csrs.iter().enumerate() {
        let path = dir.path().join(format!("n{i}.csr"));
        std::fs::write(&path, csr).expect("write CSR");
        let verified = run_ok(
            Command::new("openssl")
                .args(["req", "-verify", "-noout", "-in"])
                .arg(&path),
        );
        assert!(
            output_text(&verified).contains("verify OK"),
            "{}",
            output_text(&verified)
        );
    }
    // Both proxies are still healthy, and signed with the one key throughout.
    for proxy in [&first, &second] {
        let out = proxy.curl_unix(&["-f"], "/version");
        assert!(out.status.success(), "{}", output_text(&out));
    }
}

/// Issue 35, finding "a shared TPM through tpm2-abrmd can be denied by any local uid": another
/// process holding tpm2-abrmd's connections (here its only one) made hwkey say "TCTI no
/// connection … check that the TPM is running", which sends an operator to the wrong place.
/// Now the error names the daemon's limit, that any local user can fill it, and the kernel's
/// resource manager a node should use instead (on 1e6941c none of that was said).
#[test]
fn a_full_tpm2_abrmd_is_named_as_the_cause() {
    let shared = support::SharedTpm::start_with(&["--max-connections", "1"]);
    let dir = support::temp_dir();
    let key = format!(
        "tpm:path={}?tcti={}",
        dir.path().join("k.tpm.pem").display(),
        shared.tcti()
    );
    // Another local user's process holds the daemon's only connection while it waits for a
    // password on its standard input.
    let hold = || {
        Command::new("tpm2_dictionarylockout")
            .envs(shared.envs())
            .args(["-T", &shared.tcti(), "--clear-lockout", "-p", "file:-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("run tpm2_dictionarylockout")
    };
    let connection_free = || {
        Command::new("tpm2_getrandom")
            .envs(shared.envs())
            .args(["-T", &shared.tcti(), "8"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("tpm2_getrandom")
            .success()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut holder = hold();
    loop {
        std::thread::sleep(std::time::Duration::from_millis(300));
        if let Ok(Some(_)) = holder.try_wait() {
            // It lost the only connection to this test's own probe: again.
            holder = hold();
            continue;
        }
        if !connection_free() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the holder never connected"
        );
    }
    let out = support::run_fail(
        hwkey()
            .envs(shared.envs())
            .args(["key", "create", "--key", &key]),
    );
    let text = output_text(&out);
    let _ = holder.kill();
    let _ = holder.wait();
    assert!(
        text.contains("tpm2-abrmd did not take the connection")
            && text.contains("--max-connections")
            && text.contains("any local user")
            && text.contains("device:/dev/tpmrm0"),
        "{text}"
    );
}
