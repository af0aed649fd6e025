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
//! - **People** (issue 36): a person's same-key renewals decided per second through the API
//!   server by the people policy, against the node policy's attested requests in the same run;
//!   and (issue 50) the same person's renewals carrying a YubiKey's PIV attestation (hardware
//!   proof at every renewal, a chain of three signatures checked each time), against the
//!   same-key renewals in the same run (goal: ≥ 0.9×).
//!
//! - **Kubelet serving certificates**: serving requests decided per second, each checked
//!   against its Node's addresses read at the decision, against the node client policy's
//!   attested requests in the same run.
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
    let load_before = common::before();
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
            ek_sha256: None,
            addresses: None,
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

    match ApiBench::start(&attested, &plain, &registration, dir, &tpm, &tcti) {
        Ok(bench) => rows.extend(bench.rows()),
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
    drop(tpm);
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

/// The approver through a real kube-apiserver 1.20 (the binaries hsm-fixtures/build-kube.sh
/// builds), this build against a baseline build when `HWKEY_BENCH_BASELINE_BIN` names one
/// (hsm-fixtures/bench.sh builds `--baseline REF`), the two alternating in the same cluster.
struct ApiBench<'a> {
    cluster: KubeCluster,
    dir: &'a std::path::Path,
    trust: std::path::PathBuf,
    attested: &'a [Vec<u8>],
    plain: &'a [Vec<u8>],
    /// A key in the bench's swtpm whose fresh attested requests are node renewals.
    renewal_key: String,
    /// The node bench-0's own kubeconfig (its renewals come from it).
    as_node: std::path::PathBuf,
    baseline: Option<(std::path::PathBuf, String)>,
    people: People,
}

/// What the enrolments row needs: a TPM with an EK certificate, its CA, a credential key,
/// 8 carrier requests (PEM) for 8 node names, its enrollment and the trust ConfigMap.
struct Enrolments {
    _tpm: Swtpm,
    ca: std::path::PathBuf,
    key: std::path::PathBuf,
    carriers: Vec<Vec<u8>>,
    enrollment: String,
}

impl Enrolments {
    fn new(cluster: &KubeCluster, dir: &std::path::Path) -> Result<Enrolments, String> {
        let (tpm, ca) = Swtpm::start_with_ek_certificate();
        let tcti = tpm.tcti();
        let enrollment = String::from_utf8_lossy(
            &run_ok(hwkey().args(["attest", "enroll", "--key", &format!("tpm:?tcti={tcti}")]))
                .stdout,
        )
        .into_owned();
        let mut carriers = Vec::new();
        for i in 0..8 {
            let key = format!(
                "tpm:path={}?tcti={tcti}",
                dir.join(format!("e{i}.pem")).display()
            );
            run_ok(hwkey().args(["key", "create", "--key", &key, "--algorithm", "ec-p256"]));
            carriers.push(
                run_ok(hwkey().args([
                    "csr",
                    "--key",
                    &key,
                    "--subject",
                    &format!("CN=system:node:bench-e{i},O=system:nodes"),
                    "--attest",
                ]))
                .stdout,
            );
        }
        let key = dir.join("credential.key");
        std::fs::write(&key, [0x5au8; 32]).map_err(|e| e.to_string())?;
        cluster.apply("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: hwkey-system\n---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: hwkey-approver-trust\n  namespace: hwkey-system\n");
        Ok(Enrolments {
            _tpm: tpm,
            ca,
            key,
            carriers,
            enrollment,
        })
    }

    /// Creates `n` carrier requests and decides them with `--once`: decisions per second and
    /// the approver's peak resident set (MiB, polled every 20 ms).
    fn once(&self, bench: &ApiBench<'_>, n: usize) -> (f64, f64) {
        use base64::Engine as _;
        let annotation: String = self
            .enrollment
            .lines()
            .map(|l| format!("      {l}\n"))
            .collect();
        let mut objects = String::new();
        for i in 0..n {
            let request = base64::engine::general_purpose::STANDARD
                .encode(&self.carriers[i % self.carriers.len()]);
            objects.push_str(&format!(
                "---\napiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\nmetadata:\n  name: carrier-{i:05}\n  annotations:\n    hwkey.dev/tpm-enrollment: |\n{annotation}spec:\n  signerName: hwkey.dev/tpm-credential\n  usages: [digital signature]\n  request: {request}\n"
            ));
        }
        let file = bench.dir.join("carriers.yaml");
        std::fs::write(&file, objects).expect("write objects");
        run_ok(
            Command::new("kubectl")
                .arg("--kubeconfig")
                .arg(&bench.cluster.bootstrap_kubeconfig)
                .args(["create", "-o", "name", "-f"])
                .arg(&file),
        );
        let start = Instant::now();
        let mut child = hwkey()
            .arg("approver")
            .arg("--kubeconfig")
            .arg(&bench.cluster.admin_kubeconfig)
            .args([
                "--signer-name",
                SIGNER,
                "--signer-name",
                "hwkey.dev/tpm-credential",
                "--once",
            ])
            .args(["--bootstrap-group", support::kube::BOOTSTRAP_GROUP])
            .args(["--trust-configmap", "hwkey-system/hwkey-approver-trust"])
            .arg("--ek-ca")
            .arg(&self.ca)
            .arg("--credential-key")
            .arg(&self.key)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start the approver");
        let mut stdout = child.stdout.take().expect("stdout");
        let reader = std::thread::spawn(move || {
            let mut out = String::new();
            std::io::Read::read_to_string(&mut stdout, &mut out).expect("read stdout");
            out
        });
        let mut peak_kib = 0.0f64;
        while child.try_wait().expect("wait").is_none() {
            let hwm = std::fs::read_to_string(format!("/proc/{}/status", child.id()))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("VmHWM:"))
                        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
                });
            if let Some(kib) = hwm {
                peak_kib = peak_kib.max(kib);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let rate = n as f64 / start.elapsed().as_secs_f64();
        let out = reader.join().expect("stdout");
        let issued = out
            .lines()
            .filter(|l| l.contains("EKCertificateVerified"))
            .count();
        assert_eq!(issued, n, "{issued} of {n} carriers issued:\n{out}");
        bench.clear();
        (rate, peak_kib / 1024.0)
    }
}

/// A person for the people policy's rows: benchp, opted in by name under certificateOnly (for
/// the same-key row) and with a YubiKey registered (for the PIV row).
struct People {
    /// benchp's kubeconfig (a software login certificate of the cluster CA).
    login: std::path::PathBuf,
    /// The people trust directory (`_allow` names benchp).
    trust: std::path::PathBuf,
    /// The cluster CA (the client CA).
    ca: std::path::PathBuf,
    /// A renewal request carrying its current certificate (PEM).
    request: Vec<u8>,
    /// A renewal request carrying a YubiKey's PIV attestation of its key (PEM).
    piv_request: Vec<u8>,
    /// The stand-in YubiKey chain's root and intermediates (`--piv-roots`).
    piv_roots: std::path::PathBuf,
}

impl People {
    fn new(cluster: &KubeCluster, ca: &TestCa, dir: &std::path::Path) -> Result<People, String> {
        use support::requests::{self as rq, Node, RequestTree, SoftwareKey};
        let trust = dir.join("people");
        std::fs::create_dir_all(&trust).map_err(|e| e.to_string())?;
        std::fs::write(trust.join("_allow"), "certificateOnly: [benchp]\n")
            .map_err(|e| e.to_string())?;
        std::fs::write(trust.join("benchp"), "piv:\n  serials: [4242]\n")
            .map_err(|e| e.to_string())?;
        cluster.apply("apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: benchp-requests\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: system:node-bootstrapper\nsubjects:\n- apiGroup: rbac.authorization.k8s.io\n  kind: User\n  name: benchp\n");
        let (cert, key) = ca.client_cert(dir, "benchp-login", "benchp", Some("devs"));
        let login = cluster.cert_kubeconfig("benchp", &cert, &key);
        let software = SoftwareKey::generate();
        let subject = Node::seq(vec![
            Node::rdn(rq::O, rq::tag::UTF8, "devs"),
            Node::rdn(rq::CN, rq::tag::UTF8, "benchp"),
        ]);
        let signed = |attributes| {
            let tree = RequestTree::new(subject.clone(), &software.spki(), attributes);
            rq::pem(&tree.signed(|info| software.sign(info), &[]))
        };
        let current = ca.sign_csr_pem(&signed(vec![]), 1);
        let current = pem::parse(current)
            .map_err(|e| e.to_string())?
            .into_contents();
        let request = signed(vec![Node::Raw(hwkey::pki::same_key::attribute(&current))]);
        // A 5.7.4-shaped chain: three signatures from the attestation to the root.
        use support::piv::{ChainShape, PivDevice, Slot, TOUCH_ALWAYS};
        let device = PivDevice::new(&ChainShape {
            intermediates: 2,
            ..ChainShape::default()
        });
        let attestation = device.attest(&software.spki(), Slot::new(4242, TOUCH_ALWAYS));
        let piv_request = signed(vec![Node::Raw(hwkey::pki::piv::attribute(
            &attestation,
            &device.f9_der(),
        ))]);
        let piv_roots = dir.join("piv-roots.pem");
        std::fs::write(&piv_roots, device.roots_pem()).map_err(|e| e.to_string())?;
        Ok(People {
            login,
            trust,
            ca: ca.ca_path(),
            request: request.into_bytes(),
            piv_request: piv_request.into_bytes(),
            piv_roots,
        })
    }
}

/// Which proof a person's renewal carries.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Proof {
    /// The current certificate (certificate only).
    SameKey,
    /// A YubiKey's PIV attestation.
    Piv,
}

/// Which build runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Build {
    This,
    Baseline,
}

impl<'a> ApiBench<'a> {
    fn start(
        attested: &'a [Vec<u8>],
        plain: &'a [Vec<u8>],
        registration: &str,
        dir: &'a std::path::Path,
        _tpm: &Swtpm,
        tcti: &str,
    ) -> Result<ApiBench<'a>, String> {
        if std::env::var_os("HWKEY_KUBE_BIN").is_none() {
            return Err("HWKEY_KUBE_BIN is not set (hsm-fixtures/bench.sh sets it)".into());
        }
        let ca_dir = dir.join("ca");
        std::fs::create_dir_all(&ca_dir).map_err(|e| e.to_string())?;
        let ca = TestCa::new(&ca_dir);
        let cluster = KubeCluster::start_with(&ca, "10m", Approval::TestSigner);
        let trust = dir.join("trust");
        std::fs::create_dir_all(&trust).map_err(|e| e.to_string())?;
        std::fs::write(trust.join("bench-0"), registration).map_err(|e| e.to_string())?;
        let renewal_key = format!("tpm:path={}?tcti={tcti}", dir.join("k0.pem").display());
        let (cert, key) = ca.client_cert(
            dir,
            "bench-0-client",
            "system:node:bench-0",
            Some("system:nodes"),
        );
        let as_node = cluster.cert_kubeconfig("bench-0", &cert, &key);
        let people = People::new(&cluster, &ca, dir)?;
        let baseline = std::env::var_os("HWKEY_BENCH_BASELINE_BIN").map(|bin| {
            let label =
                std::env::var("HWKEY_BENCH_BASELINE_REF").unwrap_or_else(|_| "baseline".into());
            (std::path::PathBuf::from(bin), label)
        });
        Ok(ApiBench {
            cluster,
            dir,
            trust,
            attested,
            plain,
            renewal_key,
            as_node,
            baseline,
            people,
        })
    }

    fn hwkey(&self, build: Build) -> Command {
        match (build, &self.baseline) {
            (Build::Baseline, Some((bin, _))) => Command::new(bin),
            _ => hwkey(),
        }
    }

    fn builds(&self) -> Vec<Build> {
        if self.baseline.is_some() {
            vec![Build::This, Build::Baseline]
        } else {
            vec![Build::This]
        }
    }

    fn baseline_label(&self) -> String {
        self.baseline
            .as_ref()
            .map(|(_, label)| format!("the approver of {label}, same cluster, alternating"))
            .unwrap_or_default()
    }

    fn rows(&self) -> Vec<Row> {
        let mut rows = vec![
            self.decisions(),
            self.attested_vs_plain(),
            self.person_vs_node(),
            self.piv_vs_same_key(),
        ];
        rows.push(self.flood_at_start());
        rows.push(self.flood_while_running());
        rows.push(self.restart_with_large_requests());
        rows.push(self.enrolments());
        rows.push(self.serving_vs_node());
        rows
    }

    /// Kubelet serving requests (`kubernetes.io/kubelet-serving`) decided per second by
    /// `hwkey approver --once`, each checked against its Node's addresses read when the decision
    /// is written (a GET, then the approval: two API round trips), against the node client
    /// policy's attested requests in the same run (one round trip each), alternating.
    fn serving_vs_node(&self) -> Row {
        let n = common::pick(1000, 200);
        let what = format!("{n} kubelet serving requests decided per second through kube-apiserver 1.20 (--once; each checked against its Node's addresses)");
        let request = match self.serving_request() {
            Ok(r) => r,
            Err(why) => {
                return Row::new(AREA, &what, "CSRs/s", None).note(format!("not measured: {why}"))
            }
        };
        let rounds = common::pick(3, 1);
        let (mut serving, mut node) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            serving.push(self.once_serving(n, &request));
            node.push(self.once(Build::This, "attested", n, self.attested));
        }
        let ratio = Stat::of(&common::paired_ratios(&serving, &node));
        Row::new(AREA, &what, "CSRs/s", Some(Stat::of(&serving))).versus(
            "the node client policy's attested requests, same cluster, alternating",
            Some(Stat::of(&node)),
            Some(ratio),
        )
    }

    /// Node bench-0 (its status: its name and 10.0.0.1) and a serving request of its for them.
    fn serving_request(&self) -> Result<Vec<u8>, String> {
        let node = self.dir.join("bench-0-node.json");
        std::fs::write(
            &node,
            r#"{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "bench-0"}, "status": {"addresses": [{"type": "Hostname", "address": "bench-0"}, {"type": "InternalIP", "address": "10.0.0.1"}]}}"#,
        )
        .map_err(|e| e.to_string())?;
        let _ = self
            .cluster
            .kubectl()
            .args(["delete", "node", "bench-0"])
            .output();
        self.cluster
            .kubectl_ok(&["create", "-f", &node.display().to_string()]);
        let out = self.dir.join("serving.csr");
        run_ok(
            Command::new("openssl")
                .args(["req", "-new", "-newkey", "ec", "-pkeyopt"])
                .args(["ec_paramgen_curve:P-256", "-nodes"])
                .args(["-subj", "/O=system:nodes/CN=system:node:bench-0"])
                .args(["-addext", "subjectAltName=DNS:bench-0,IP:10.0.0.1"])
                .arg("-keyout")
                .arg(self.dir.join("serving.key"))
                .arg("-out")
                .arg(&out),
        );
        std::fs::read(&out).map_err(|e| e.to_string())
    }

    /// `hwkey approver --once` for the serving signer over `n` copies of `request`, created as
    /// bench-0: decisions per second (all approved).
    fn once_serving(&self, n: usize, request: &[u8]) -> f64 {
        const SERVING_SIGNER: &str = "kubernetes.io/kubelet-serving";
        self.create_objects(
            SERVING_SIGNER,
            "[digital signature, key encipherment, server auth]",
            &self.as_node,
            "serving",
            n,
            &[request.to_vec()],
        );
        let start = Instant::now();
        let out = run_ok(
            hwkey()
                .arg("approver")
                .arg("--kubeconfig")
                .arg(&self.cluster.admin_kubeconfig)
                .args(["--signer-name", SERVING_SIGNER, "--once"]),
        );
        let rate = n as f64 / start.elapsed().as_secs_f64();
        let approved = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("NodeAddressesVerified"))
            .count();
        assert_eq!(approved, n, "serving: {approved} of {n} approved");
        self.clear();
        rate
    }

    /// Issue 52: TPMs joining by their EK certificate. N carrier requests (8 distinct ones, of
    /// a swtpm with an EK certificate, for 8 node names) decided by `hwkey approver --once`:
    /// each has its EK chain checked, a credential made and a carrier certificate written
    /// (approval, then status: four API round trips); against the same number of attested
    /// kubelet requests decided in the same run (one round trip each). The approver's peak
    /// resident set over the carriers' pass is the memory figure.
    fn enrolments(&self) -> Row {
        let n = common::pick(1000, 200);
        let setup = match Enrolments::new(&self.cluster, self.dir) {
            Ok(s) => s,
            Err(why) => {
                return Row::new(AREA, "enrolments decided per second", "CSRs/s", None)
                    .note(format!("not measured: {why}"))
            }
        };
        let rounds = common::pick(3, 1);
        let (mut carriers, mut kubelet, mut peaks) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let (rate, peak) = setup.once(self, n);
            carriers.push(rate);
            peaks.push(peak);
            kubelet.push(self.once(Build::This, "attested", n, self.attested));
        }
        let peak = Stat::of(&peaks);
        Row::new(
            AREA,
            &format!("{n} pending enrolments (carrier requests of TPMs joining by their EK certificate) decided per second through kube-apiserver 1.20 (--once)"),
            "CSRs/s",
            Some(Stat::of(&carriers)),
        )
        .versus(
            "attested kubelet requests (node policy), same count, same run",
            Some(Stat::of(&kubelet)),
            Some(Stat::of(&common::paired_ratios(&carriers, &kubelet))),
        )
        .target("peak RSS ≤ 64 MiB", Some(peak.median <= 64.0))
        .note(format!(
            "approver peak resident set over the {n} enrolments: {:.1} MiB (median of {rounds})",
            peak.median
        ))
    }

    /// Creates `count` CSR objects named `PREFIX-N` holding `requests` (in turn) as `kubeconfig`.
    fn create(
        &self,
        kubeconfig: &std::path::Path,
        prefix: &str,
        count: usize,
        requests: &[Vec<u8>],
    ) {
        self.create_for(SIGNER, kubeconfig, prefix, count, requests);
    }

    /// [`ApiBench::create`] for `signer`.
    fn create_for(
        &self,
        signer: &str,
        kubeconfig: &std::path::Path,
        prefix: &str,
        count: usize,
        requests: &[Vec<u8>],
    ) {
        let usages = "[digital signature, key encipherment, client auth]";
        self.create_objects(signer, usages, kubeconfig, prefix, count, requests);
    }

    /// [`ApiBench::create_for`] with `usages` (a YAML list).
    fn create_objects(
        &self,
        signer: &str,
        usages: &str,
        kubeconfig: &std::path::Path,
        prefix: &str,
        count: usize,
        requests: &[Vec<u8>],
    ) {
        use base64::Engine as _;
        let mut objects = String::new();
        for i in 0..count {
            let request =
                base64::engine::general_purpose::STANDARD.encode(&requests[i % requests.len()]);
            objects.push_str(&format!(
                "---\napiVersion: certificates.k8s.io/v1\nkind: CertificateSigningRequest\nmetadata:\n  name: {prefix}-{i:05}\nspec:\n  signerName: {signer}\n  usages: {usages}\n  request: {request}\n"
            ));
        }
        let file = self.dir.join(format!("{prefix}.yaml"));
        std::fs::write(&file, objects).expect("write objects");
        run_ok(
            Command::new("kubectl")
                .arg("--kubeconfig")
                .arg(kubeconfig)
                .args(["create", "-o", "name", "-f"])
                .arg(&file),
        );
    }

    fn clear(&self) {
        self.cluster
            .kubectl_ok(&["delete", "csr", "--all", "--wait=false"]);
        std::thread::sleep(Duration::from_secs(2));
    }

    /// `hwkey approver --once` over `requests` as the bootstrap identity: decisions per second.
    fn once(&self, build: Build, label: &str, n: usize, requests: &[Vec<u8>]) -> f64 {
        self.create(&self.cluster.bootstrap_kubeconfig, label, n, requests);
        let start = Instant::now();
        let out = run_ok(
            self.hwkey(build)
                .arg("approver")
                .arg("--kubeconfig")
                .arg(&self.cluster.admin_kubeconfig)
                .args(["--signer-name", SIGNER, "--once"])
                .args([
                    "--bootstrap-group",
                    support::kube::BOOTSTRAP_GROUP,
                    "--trust",
                ])
                .arg(&self.trust),
        );
        let rate = n as f64 / start.elapsed().as_secs_f64();
        let decided = String::from_utf8_lossy(&out.stdout).lines().count();
        assert_eq!(decided, n, "{label}: {decided} of {n} decided");
        self.clear();
        rate
    }

    /// Attested requests decided per second, this build against the baseline build.
    fn decisions(&self) -> Row {
        let n = common::pick(1000, 200);
        let rounds = if self.baseline.is_some() {
            common::pick(3, 1)
        } else {
            1
        };
        let (mut this, mut base) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            for build in self.builds() {
                let rate = self.once(build, "attested", n, self.attested);
                if build == Build::This {
                    this.push(rate)
                } else {
                    base.push(rate)
                }
            }
        }
        let row = Row::new(
            AREA,
            &format!("{n} attested requests decided per second through kube-apiserver 1.20 (one --once pass each)"),
            "CSRs/s",
            Some(Stat::of(&this)),
        );
        if base.is_empty() {
            return row.note("no baseline build (bench.sh --baseline REF)");
        }
        let ratio = Stat::of(&common::paired_ratios(&this, &base));
        row.versus(&self.baseline_label(), Some(Stat::of(&base)), Some(ratio))
            .target("≥ 0.9× (issue 37: within 10 %)", Some(ratio.median >= 0.9))
    }

    /// The existing figure: attested requests against requests without evidence (no
    /// cryptography), this build.
    fn attested_vs_plain(&self) -> Row {
        let n = common::pick(1000, 200);
        let subject = self.once(Build::This, "attested", n, self.attested);
        let baseline = self.once(Build::This, "plain", n, self.plain);
        Row::new(
            AREA,
            &format!("{n} requests decided per second through kube-apiserver 1.20, attested against none"),
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
        ))
    }

    /// The people policy (issue 36): a person's same-key renewals decided per second, against
    /// the node policy's attested requests, alternating in the same cluster, this build.
    fn person_vs_node(&self) -> Row {
        let n = common::pick(1000, 200);
        let rounds = common::pick(3, 1);
        let (mut person, mut node) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            person.push(self.once_people(n, Proof::SameKey));
            node.push(self.once(Build::This, "attested", n, self.attested));
        }
        let ratio = Stat::of(&common::paired_ratios(&person, &node));
        Row::new(
            AREA,
            &format!("{n} people's same-key renewals decided per second through kube-apiserver 1.20 (one --once pass each)"),
            "CSRs/s",
            Some(Stat::of(&person)),
        )
        .versus(
            "the node policy's attested requests, same cluster, alternating",
            Some(Stat::of(&node)),
            Some(ratio),
        )
    }

    /// Issue 50: a person's renewals with hardware proof at every renewal (a YubiKey's PIV
    /// attestation) against the same person's same-key renewals, alternating, this build.
    fn piv_vs_same_key(&self) -> Row {
        let n = common::pick(1000, 200);
        let rounds = common::pick(3, 1);
        let (mut piv, mut same_key) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            piv.push(self.once_people(n, Proof::Piv));
            same_key.push(self.once_people(n, Proof::SameKey));
        }
        let ratio = Stat::of(&common::paired_ratios(&piv, &same_key));
        Row::new(
            AREA,
            &format!("{n} people's renewals with a YubiKey's PIV attestation decided per second through kube-apiserver 1.20 (one --once pass each)"),
            "CSRs/s",
            Some(Stat::of(&piv)),
        )
        .versus(
            "the same person's same-key renewals (certificate only), same cluster, alternating",
            Some(Stat::of(&same_key)),
            Some(ratio),
        )
        .note("goal: at least 0.9x: hardware proof at every renewal costs under 10 % of the decision rate")
    }

    /// `hwkey approver --once` with the people policy over `n` renewals of benchp carrying
    /// `proof`, created as benchp: decisions per second.
    fn once_people(&self, n: usize, proof: Proof) -> f64 {
        const CLIENT_SIGNER: &str = "kubernetes.io/kube-apiserver-client";
        let people = &self.people;
        let (request, reason) = match proof {
            Proof::SameKey => (&people.request, "SameKeyRenewal"),
            Proof::Piv => (&people.piv_request, "AttestedPIVKey"),
        };
        self.create_for(
            CLIENT_SIGNER,
            &people.login,
            "person",
            n,
            std::slice::from_ref(request),
        );
        let start = Instant::now();
        let out = run_ok(
            hwkey()
                .arg("approver")
                .arg("--kubeconfig")
                .arg(&self.cluster.admin_kubeconfig)
                .args(["--signer-name", CLIENT_SIGNER, "--once", "--people-trust"])
                .arg(&people.trust)
                .arg("--people-client-ca")
                .arg(&people.ca)
                .arg("--piv-roots")
                .arg(&people.piv_roots),
        );
        let rate = n as f64 / start.elapsed().as_secs_f64();
        let approved = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains(reason))
            .count();
        assert_eq!(approved, n, "person: {approved} of {n} approved ({reason})");
        self.clear();
        rate
    }

    /// A fresh attested renewal of bench-0, created as the node itself: its name.
    fn renewal(&self, name: &str) {
        let pem = run_ok(hwkey().args([
            "csr",
            "--key",
            &self.renewal_key,
            "--subject",
            "CN=system:node:bench-0,O=system:nodes",
            "--attest",
        ]))
        .stdout;
        self.create(&self.as_node, name, 1, &[pem]);
    }

    /// A running approver of `build` (no election, a metrics port): the process.
    fn running(&self, build: Build, name: &str) -> ChildGuard {
        let port = free_port();
        let mut cmd = self.hwkey(build);
        cmd.arg("approver")
            .arg("--kubeconfig")
            .arg(&self.cluster.admin_kubeconfig)
            .args(["--signer-name", SIGNER, "--leader-elect=false"])
            .args([
                "--bootstrap-group",
                support::kube::BOOTSTRAP_GROUP,
                "--trust",
            ])
            .arg(&self.trust)
            .arg(format!("--metrics-listen=127.0.0.1:{port}"));
        let mut child = ChildGuard::spawn(&mut cmd, name, &self.dir.join(format!("{name}.log")));
        child
            .wait_for_port(port, Duration::from_secs(30))
            .expect("the approver starts");
        child
    }

    /// Waits until `name` has a decision; the time it took from `since`. A `kubectl get
    /// --watch` reports each change of the request as it happens (polling with a process per
    /// look would load the machine whose latency is measured).
    fn decided(&self, name: &str, since: Instant, limit: Duration) -> Option<f64> {
        use std::io::BufRead;
        let mut watch = self
            .cluster
            .kubectl()
            .args(["get", "csr", name, "--watch", "-o"])
            .arg("jsonpath={.status.conditions[*].type}{\"\\n\"}")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("kubectl get --watch");
        let stdout = watch.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !line.trim().is_empty() {
                    let _ = tx.send(since.elapsed().as_secs_f64());
                    break;
                }
            }
        });
        let took = rx.recv_timeout(limit.saturating_sub(since.elapsed())).ok();
        let _ = watch.kill();
        let _ = watch.wait();
        took
    }

    /// Software requests for node bench-x without evidence: the flood's content.
    fn flood_requests(&self) -> Vec<Vec<u8>> {
        self.plain.to_vec()
    }

    /// 3,000 requests from one bootstrap token and a node's renewal wait when an approver
    /// starts: seconds until the renewal is decided.
    fn flood_at_start(&self) -> Row {
        let n = common::pick(3000, 1000);
        let flood = self.flood_requests();
        let (mut this, mut base) = (Vec::new(), Vec::new());
        for build in self.builds() {
            self.create(&self.cluster.bootstrap_kubeconfig, "flood", n, &flood);
            self.renewal("zzzz-renewal");
            let started = Instant::now();
            let approver = self.running(build, "approver-flood");
            let took = self.decided("zzzz-renewal-00000", started, Duration::from_secs(300));
            drop(approver);
            self.clear();
            let took = took.unwrap_or(f64::NAN);
            if build == Build::This {
                this.push(took)
            } else {
                base.push(took)
            }
        }
        let row = Row::new(
            AREA,
            &format!("seconds from an approver's start to a node's renewal being decided, {n} requests from one bootstrap token waiting too"),
            "s",
            Some(Stat::of(&this)),
        )
        .note("the renewal is listed last by name; this build serves one lane per requester in turn");
        match base.is_empty() {
            true => row,
            false => row.versus(
                &self.baseline_label(),
                Some(Stat::of(&base)),
                Some(Stat::of(&common::paired_ratios(&this, &base))),
            ),
        }
    }

    /// 3,000 requests from one bootstrap token arrive while an approver runs; a node's renewal
    /// made meanwhile: seconds from its creation to its decision.
    fn flood_while_running(&self) -> Row {
        let n = common::pick(3000, 1000);
        let flood = self.flood_requests();
        let (mut this, mut base) = (Vec::new(), Vec::new());
        for build in self.builds() {
            let approver = self.running(build, "approver-steady");
            let took = std::thread::scope(|scope| {
                let creating = scope
                    .spawn(|| self.create(&self.cluster.bootstrap_kubeconfig, "flood", n, &flood));
                std::thread::sleep(Duration::from_secs(3));
                let asked = Instant::now();
                self.renewal("renewal");
                let took = self.decided("renewal-00000", asked, Duration::from_secs(300));
                creating.join().expect("create the flood");
                took
            });
            drop(approver);
            self.clear();
            let took = took.unwrap_or(f64::NAN);
            if build == Build::This {
                this.push(took)
            } else {
                base.push(took)
            }
        }
        let s = Stat::of(&this);
        let row = Row::new(
            AREA,
            &format!("seconds from a node's renewal to its decision while {n} requests from one bootstrap token arrive"),
            "s",
            Some(s),
        )
        .target("≤ 2 s (issue 34)", Some(s.median <= 2.0));
        match base.is_empty() {
            true => row,
            false => row.versus(
                &self.baseline_label(),
                Some(Stat::of(&base)),
                Some(Stat::of(&common::paired_ratios(&this, &base))),
            ),
        }
    }

    /// 100 requests of 1.3 MB in the cluster, decided: an approver starts with a node's
    /// renewal waiting. Its peak resident set (VmHWM) and seconds to the renewal's decision.
    fn restart_with_large_requests(&self) -> Row {
        use support::requests::{self as rq, Node, RequestTree, SoftwareKey};
        let key = SoftwareKey::generate();
        let junk = Node::seq(vec![
            Node::oid(&[1, 3, 6, 1, 4, 1, 99999, 1]),
            Node::set(vec![Node::Prim(rq::tag::OCTET_STRING, vec![0x5a; 950_000])]),
        ]);
        let large = rq::pem(
            &RequestTree::new(
                Node::seq(vec![
                    Node::rdn(rq::O, rq::tag::UTF8, "system:nodes"),
                    Node::rdn(rq::CN, rq::tag::UTF8, "system:node:bench-x"),
                ]),
                &key.spki(),
                vec![junk],
            )
            .signed(|info| key.sign(info), &[]),
        )
        .into_bytes();
        let (mut peak, mut base_peak, mut took, mut base_took) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for chunk in 0..10 {
            self.create(
                &self.cluster.bootstrap_kubeconfig,
                &format!("large{chunk}"),
                10,
                std::slice::from_ref(&large),
            );
        }
        // Decided once, as in a cluster where they were denied at once.
        run_ok(
            hwkey()
                .arg("approver")
                .arg("--kubeconfig")
                .arg(&self.cluster.admin_kubeconfig)
                .args(["--signer-name", SIGNER, "--once", "--trust"])
                .arg(&self.trust),
        );
        for build in self.builds() {
            self.renewal("renewal");
            let started = Instant::now();
            let approver = self.running(build, "approver-large");
            let t = self
                .decided("renewal-00000", started, Duration::from_secs(120))
                .unwrap_or(f64::NAN);
            let kib = std::fs::read_to_string(format!("/proc/{}/status", approver.id()))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("VmHWM:"))
                        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
                })
                .unwrap_or(f64::NAN);
            drop(approver);
            self.cluster.kubectl_ok(&["delete", "csr", "renewal-00000"]);
            if build == Build::This {
                peak.push(kib / 1024.0);
                took.push(t);
            } else {
                base_peak.push(kib / 1024.0);
                base_took.push(t);
            }
        }
        self.clear();
        let s = Stat::of(&peak);
        let mut row = Row::new(
            AREA,
            "peak resident set (VmHWM) of an approver starting with 100 requests of 1.3 MB in the cluster",
            "MiB",
            Some(s),
        )
        .target("≤ 64 MiB (issue 34)", Some(s.median <= 64.0))
        .note(format!(
            "a node's renewal decided {:.1} s after the start (goal ≤ 5 s){}",
            took[0],
            base_took
                .first()
                .map(|b| format!("; the baseline's: {b:.1} s"))
                .unwrap_or_default()
        ));
        if !base_peak.is_empty() {
            row = row.versus(
                &self.baseline_label(),
                Some(Stat::of(&base_peak)),
                Some(Stat::of(&common::paired_ratios(&peak, &base_peak))),
            );
        }
        row
    }
}
