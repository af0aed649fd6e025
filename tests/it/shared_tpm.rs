//! A TPM shared as hosts share theirs (issue 24, item 1): swtpm behind tpm2-abrmd, every
//! client through `tabrmd:bus_type=session`. hwkey must not assume it is the TPM's only client:
//! two proxies on one key serve requests while, on the same TPM and at the same time, other
//! hwkey processes enroll an attestation key, create keys and make attested CSRs.

use std::process::Command;

use support::proxy::{Identity, ProxyProcess};
use support::upstream::TestUpstream;
use support::{hwkey, output_text, run_ok};

/// Requests each client makes; a count, not a duration, so the test proves the same on any
/// machine.
const REQUESTS: usize = 25;

#[test]
fn two_proxies_serve_while_other_processes_use_the_same_tpm() {
    let id = Identity::shared_tpm();
    let upstream = TestUpstream::start(&id.ca);
    let first = ProxyProcess::start(&id, &upstream);
    let second = ProxyProcess::start(&id, &upstream);
    let tpm_only = "tpm:?tcti=tabrmd:bus_type=session";
    // The AK the attested CSRs need, made once before the storm (enrolling again is part of it).
    run_ok(
        hwkey()
            .envs(id.envs())
            .args(["attest", "enroll", "--key", tpm_only]),
    );

    let (failures, csrs) = std::thread::scope(|s| {
        // Eight clients on the first proxy, two on the second.
        let clients: Vec<_> = (0..10)
            .map(|c| {
                let proxy = if c < 8 { &first } else { &second };
                s.spawn(move || {
                    (0..REQUESTS)
                        .filter(|_| {
                            let out = proxy.curl_unix(&["-f"], "/version");
                            !out.status.success()
                        })
                        .count()
                })
            })
            .collect();
        // Meanwhile, on the same TPM: enroll again, create keys, make attested requests.
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
        let failures: usize = clients
            .into_iter()
            .map(|c| c.join().expect("client thread"))
            .sum();
        let csrs: Vec<String> = others
            .into_iter()
            .map(|o| o.join().expect("TPM client thread"))
            .collect();
        (failures, csrs)
    });
    assert_eq!(failures, 0, "requests failed while the TPM was shared");
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
