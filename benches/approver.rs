//! The attesting approver's capacity (issue 11): how many attested CSRs it verifies per second,
//! and how many it decides per second against a real kube-apiserver.
//!
//! - **Verification** (in process): `pki::attestation::verify_request` over requests made by
//!   swtpm with `hwkey csr --attest`, against 5,000 registered nodes, on 1 and 2 threads. The
//!   baseline, in the same rounds, is what any approver does without attestation: parse the
//!   request and check its self-signature. Goal: ≥ 200 CSRs/s on 2 cores (5,000 nodes in 25 s).
//! - **Decisions through the API server**: `hwkey approver --once` over N attested requests
//!   for kubelet's signer (kube-controller-manager neither approves nor signs in this cluster,
//!   so nothing is issued during the timing), against the same approver denying N requests
//!   without evidence (no cryptography: the API server's writes alone). The N requests repeat
//!   a few distinct ones: the first of each is approved, its copies denied `EvidenceReused`,
//!   after the same checks.
//!
//! Results go to target/hwkey-bench/approver.json; benches/report.rs puts them in
//! docs/BENCHMARKS.md.

use std::process::Command;
use std::time::{Duration, Instant};

use hwkey::pki::attestation::{self, RegisteredAk};
use hwkey::pki::request::Request;
use support::bench::{self as common, Row, Stat};
use support::kube::{Approval, KubeCluster};
use support::*;

const AREA: &str = "approver";
const NODES: usize = 5000;
const KEYS: usize = 8;
/// The only signer hwkey has a policy for; kube-controller-manager neither approves nor signs
/// in the bench's cluster (`Approval::TestSigner`), so nothing is issued during the timing.
const SIGNER: &str = "kubernetes.io/kube-apiserver-client-kubelet";

fn main() {
    if common::skip_unless_cargo_bench("approver") {
        return;
    }
    let started = Instant::now();
    let load_before = common::loadavg();
    let work = temp_dir();
    let dir = work.path();

    // Requests from a swtpm node: KEYS keys, each with an attested and a plain request.
    let tpm = Swtpm::start();
    let tcti = tpm.tcti();
    let enrollment =
        run_ok(hwkey().args(["attest", "enroll", "--key", &format!("tpm:?tcti={tcti}")]));
    let registration = String::from_utf8_lossy(&enrollment.stdout).into_owned();
    let mut attested = Vec::new();
    let mut plain = Vec::new();
    for i in 0..KEYS {
        let key = format!(
            "tpm:path={}?tcti={tcti}",
            dir.join(format!("k{i}.pem")).display()
        );
        run_ok(hwkey().args(["key", "create", "--key", &key, "--algorithm", "ec-p256"]));
        for (attest, into) in [(true, &mut attested), (false, &mut plain)] {
            let mut cmd = hwkey();
            cmd.args([
                "csr",
                "--key",
                &key,
                "--subject",
                "CN=system:node:bench-0,O=system:nodes",
            ]);
            if attest {
                cmd.arg("--attest");
            }
            let pem = run_ok(&mut cmd).stdout;
            into.push(pem);
        }
    }
    drop(tpm);
    let der = |pem: &Vec<u8>| pem::parse(pem).expect("PEM request").into_contents();
    let attested_der: Vec<Vec<u8>> = attested.iter().map(der).collect();
    let plain_der: Vec<Vec<u8>> = plain.iter().map(der).collect();

    // 5,000 registered nodes; the real AK is the last one looked up.
    let mut trusted: Vec<RegisteredAk> = (1..NODES)
        .map(|i| RegisteredAk {
            node: format!("bench-{i}"),
            ak_name: {
                let mut name = vec![0x00, 0x0b];
                name.extend((0..32u32).map(|b| (b as usize * 7 + i) as u8));
                name
            },
        })
        .collect();
    trusted.push(attestation::parse_registration("bench-0", &registration).expect("registration"));
    let verified = |r: &[u8]| {
        Request::from_der(r.to_vec())
            .is_ok_and(|q| attestation::verify_request(&q, "bench-0", &trusted).is_ok())
    };
    for r in &attested_der {
        assert!(verified(r), "the bench's own evidence verifies");
    }

    let mut rows = Vec::new();
    let rounds = common::pick(9, 3);
    let per_round = common::pick(2000, 400);
    for threads in [1usize, 2] {
        let mut subject = Vec::new();
        let mut baseline = Vec::new();
        for _ in 0..rounds {
            subject.push(rate(threads, per_round, &attested_der, verified));
            baseline.push(rate(threads, per_round, &plain_der, |r| {
                use x509_parser::prelude::FromDer;
                x509_parser::certification_request::X509CertificationRequest::from_der(r)
                    .is_ok_and(|(_, csr)| csr.verify_signature().is_ok())
            }));
        }
        let s = Stat::of(&subject);
        let ratio = Stat::of(&common::paired_ratios(&subject, &baseline));
        let mut row = Row::new(
            AREA,
            &format!(
                "attested CSRs verified per second, {threads} thread(s), {NODES} registered nodes"
            ),
            "CSRs/s",
            Some(s),
        )
        .versus(
            "parse + self-signature check only",
            Some(Stat::of(&baseline)),
            Some(ratio),
        );
        if threads == 2 {
            row = row
                .target("≥ 200 CSRs/s", Some(s.median >= 200.0))
                .note(format!(
                    "{NODES} nodes' requests verified in {:.1} s",
                    NODES as f64 / s.median
                ));
        }
        rows.push(row);
    }

    match api_server_rows(&attested, &plain, &registration, dir) {
        Ok(row) => rows.push(row),
        Err(why) => rows.push(
            Row::new(
                AREA,
                "decisions per second through kube-apiserver",
                "CSRs/s",
                None,
            )
            .note(format!("not measured: {why}")),
        ),
    }
    common::finish("approver", load_before, started, rows);
}

/// Requests checked per second by `threads` threads sharing `total` checks.
fn rate(
    threads: usize,
    total: usize,
    requests: &[Vec<u8>],
    check: impl Fn(&[u8]) -> bool + Sync,
) -> f64 {
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let check = &check;
            s.spawn(move || {
                for i in (t..total).step_by(threads) {
                    assert!(check(&requests[i % requests.len()]));
                }
            });
        }
    });
    total as f64 / start.elapsed().as_secs_f64()
}

/// `hwkey approver --once` over N attested requests vs N without evidence on a real
/// kube-apiserver (needs the binaries hsm-fixtures/build-kube.sh builds).
fn api_server_rows(
    attested: &[Vec<u8>],
    plain: &[Vec<u8>],
    registration: &str,
    dir: &std::path::Path,
) -> Result<Row, String> {
    use base64::Engine as _;
    if std::env::var_os("HWKEY_KUBE_BIN").is_none() {
        return Err("HWKEY_KUBE_BIN is not set (hsm-fixtures/bench.sh sets it)".into());
    }
    let n = common::pick(1000, 200);
    let ca_dir = dir.join("ca");
    std::fs::create_dir_all(&ca_dir).map_err(|e| e.to_string())?;
    let ca = TestCa::new(&ca_dir);
    let cluster = KubeCluster::start_with(&ca, "10m", Approval::TestSigner);
    let trust = dir.join("trust");
    std::fs::create_dir_all(&trust).map_err(|e| e.to_string())?;
    std::fs::write(trust.join("bench-0"), registration).map_err(|e| e.to_string())?;
    let mut timings = Vec::new();
    for (label, requests) in [("attested", attested), ("plain", plain)] {
        let mut objects = String::new();
        for i in 0..n {
            let request =
                base64::engine::general_purpose::STANDARD.encode(&requests[i % requests.len()]);
            objects.push_str(&format!(
                "---\napiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\nmetadata:\n  name: {label}-{i}\nspec:\n  signerName: {SIGNER}\n  usages: [digital signature, key encipherment, client auth]\n  request: {request}\n"
            ));
        }
        let file = dir.join(format!("{label}.yaml"));
        std::fs::write(&file, objects).map_err(|e| e.to_string())?;
        run_ok(
            Command::new("kubectl")
                .arg("--kubeconfig")
                .arg(&cluster.bootstrap_kubeconfig)
                .args(["create", "-o", "name", "-f"])
                .arg(&file),
        );
        let start = Instant::now();
        let out = run_ok(
            hwkey()
                .arg("approver")
                .arg("--kubeconfig")
                .arg(&cluster.admin_kubeconfig)
                .args(["--signer-name", SIGNER, "--once"])
                .args([
                    "--bootstrap-group",
                    support::kube::BOOTSTRAP_GROUP,
                    "--trust",
                ])
                .arg(&trust),
        );
        let seconds = start.elapsed().as_secs_f64();
        let decided = String::from_utf8_lossy(&out.stdout).lines().count();
        if decided != n {
            return Err(format!("{label}: {decided} of {n} decided"));
        }
        timings.push(n as f64 / seconds);
        // Out of the way of the next timing.
        cluster.kubectl_ok(&["delete", "csr", "--all", "--wait=false"]);
        std::thread::sleep(Duration::from_secs(2));
    }
    let (subject, baseline) = (timings[0], timings[1]);
    Ok(Row::new(
        AREA,
        &format!("{n} requests decided per second through kube-apiserver 1.20 (one --once pass)"),
        "CSRs/s",
        Some(Stat::of(&[subject])),
    )
    .versus(
        "the same approver denying requests without evidence (no cryptography)",
        Some(Stat::of(&[baseline])),
        Some(Stat::of(&[subject / baseline])),
    )
    .note(format!(
        "5,000 nodes would clear in {:.0} s at this rate; one pass each, so no spread",
        5000.0 / subject
    )))
}
