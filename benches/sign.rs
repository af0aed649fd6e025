//! Raw signing rate (criterion): hwkey's key layer against a bare `cryptoki` / `tss-esapi` loop
//! on the *same* key, so the ratio is hwkey's own overhead (software hashing, DER encoding,
//! the session pool, the signature counter) and nothing else.
//!
//! * SoftHSM P-256 and RSA-2048 (PSS, what TLS 1.3 uses), 1 and 2 threads. The bare loop
//!   signs a precomputed digest on sessions it opened itself; hwkey signs the whole
//!   CertificateVerify message through [`Key::sign`], as a handshake does.
//! * swtpm P-256, 1 thread (the TPM runs one command at a time). swtpm serves one TCP client at
//!   a time, so the bare context and hwkey's key are never open together: the key is
//!   persistent (`tpm:handle=`), the bare loop reaches it with `tr_from_tpm_public`.
//!
//! Each benchmark is measured in flat sampling mode, so every sample is one rate; the report
//! shows the median rate with its p25–p75 and writes `target/hwkey-bench/sign.json`.
//! `HWKEY_BENCH_QUICK=1` shortens everything (see `hsm-fixtures/bench.sh --quick`).

use support::bench as common;

use std::path::Path;
use std::str::FromStr;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use cryptoki::context::{CInitializeArgs, CInitializeFlags, Pkcs11};
use cryptoki::error::{Error as CkError, RvError};
use cryptoki::mechanism::rsa::{PkcsMgfType, PkcsPssParams};
use cryptoki::mechanism::{Mechanism, MechanismType};
use cryptoki::object::{Attribute, ObjectClass, ObjectHandle};
use cryptoki::session::{Session, UserType};
use cryptoki::types::AuthPin;
use hwkey::key::{Key, KeyAlgorithm, KeyUri, SignScheme};
use tss_esapi::constants::tss::{TPM2_RH_NULL, TPM2_ST_HASHCHECK};
use tss_esapi::handles::{KeyHandle, PersistentTpmHandle, TpmHandle};
use tss_esapi::interface_types::algorithm::HashingAlgorithm;
use tss_esapi::interface_types::session_handles::AuthSession;
use tss_esapi::structures::{Digest, HashScheme, HashcheckTicket, SignatureScheme};
use tss_esapi::tss2_esys::TPMT_TK_HASHCHECK;
use tss_esapi::{Context, TctiNameConf};

use common::{Row, Stat};
use support::{SoftHsm, Swtpm, SOFTHSM_MODULE, USER_PIN};

const TOKEN: &str = "bench";
const TPM_HANDLE: u32 = 0x8100_0101;
const AREA: &str = "signing, raw";

/// What a TLS 1.3 client signs in CertificateVerify: 64 spaces, the context string, a zero
/// byte and the transcript hash (here a fixed stand-in of the right length).
fn certificate_verify_message() -> Vec<u8> {
    let mut m = vec![b' '; 64];
    m.extend_from_slice(b"TLS 1.3, client CertificateVerify\0");
    m.extend_from_slice(&[0x5a; 32]);
    m
}

fn sha256(message: &[u8]) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, message)
        .as_ref()
        .to_vec()
}

/// A bare cryptoki view of the token: the module (kept for the whole process; hwkey's module
/// cache has initialised the same library, so `CryptokiAlreadyInitialized` is expected), and
/// logged-in sessions of its own.
struct BareToken {
    ctx: Pkcs11,
    slot: cryptoki::slot::Slot,
}

impl BareToken {
    fn open() -> BareToken {
        let ctx = Pkcs11::new(SOFTHSM_MODULE).expect("load SoftHSM");
        match ctx.initialize(CInitializeArgs::new(CInitializeFlags::OS_LOCKING_OK)) {
            Ok(()) | Err(CkError::Pkcs11(RvError::CryptokiAlreadyInitialized, _)) => {}
            Err(e) => panic!("C_Initialize: {e}"),
        }
        let slot = ctx
            .get_slots_with_token()
            .expect("slots")
            .into_iter()
            .find(|s| {
                ctx.get_token_info(*s)
                    .map(|i| i.label().trim_end() == TOKEN)
                    .unwrap_or(false)
            })
            .expect("the bench token");
        BareToken { ctx, slot }
    }

    fn session(&self) -> Session {
        let s = self.ctx.open_ro_session(self.slot).expect("C_OpenSession");
        match s.login(UserType::User, Some(&AuthPin::from(USER_PIN))) {
            Ok(()) | Err(CkError::Pkcs11(RvError::UserAlreadyLoggedIn, _)) => {}
            Err(e) => panic!("C_Login: {e}"),
        }
        s
    }

    fn private_key(&self, session: &Session, label: &str) -> ObjectHandle {
        let found = session
            .find_objects(&[
                Attribute::Class(ObjectClass::PRIVATE_KEY),
                Attribute::Label(label.as_bytes().to_vec()),
            ])
            .expect("C_FindObjects");
        assert_eq!(found.len(), 1, "one private key labelled {label}");
        found[0]
    }
}

/// One PKCS#11 key under test: its label, hwkey's scheme, and the bare mechanism that does
/// the same device operation on a precomputed digest.
struct Pkcs11Case {
    group: &'static str,
    label: &'static str,
    algorithm: KeyAlgorithm,
    scheme: SignScheme,
    /// Built on each signing thread: a `Mechanism` holds raw pointers and is not `Sync`.
    mechanism: fn() -> Mechanism<'static>,
}

fn pkcs11_cases() -> Vec<Pkcs11Case> {
    vec![
        Pkcs11Case {
            group: "softhsm-p256",
            label: "p256",
            algorithm: KeyAlgorithm::EcP256,
            scheme: SignScheme::EcdsaP256Sha256,
            mechanism: || Mechanism::Ecdsa,
        },
        Pkcs11Case {
            group: "softhsm-rsa2048",
            label: "rsa2048",
            algorithm: KeyAlgorithm::Rsa { bits: 2048 },
            scheme: SignScheme::RsaPssSha256,
            mechanism: || {
                Mechanism::RsaPkcsPss(PkcsPssParams {
                    hash_alg: MechanismType::SHA256,
                    mgf: PkcsMgfType::MGF1_SHA256,
                    s_len: 32u64.into(),
                })
            },
        },
    ]
}

/// Runs `work(thread, n)` on `threads` threads splitting `iters` between them; returns the
/// wall time from the common start to the last thread's end.
fn timed_on_threads(threads: usize, iters: u64, work: impl Fn(usize, u64) + Sync) -> Duration {
    let barrier = Barrier::new(threads + 1);
    let per = iters.div_ceil(threads as u64);
    std::thread::scope(|s| {
        for t in 0..threads {
            let (barrier, work) = (&barrier, &work);
            let n = per.min(iters.saturating_sub(per * t as u64));
            s.spawn(move || {
                barrier.wait();
                work(t, n);
            });
        }
        barrier.wait();
        let start = Instant::now();
        // The scope joins every thread before returning.
        start
    })
    .elapsed()
}

fn bench_pkcs11(c: &mut Criterion, bare: &BareToken, hsm_uri: impl Fn(&str) -> String) {
    let message = certificate_verify_message();
    let digest = sha256(&message);
    for case in pkcs11_cases() {
        let uri: KeyUri = hsm_uri(case.label).parse().expect("key URI");
        let key = Key::open(&uri).expect("open the key with hwkey");
        let mut sessions: Vec<Session> = (0..2).map(|_| bare.session()).collect();
        let handle = bare.private_key(&sessions[0], case.label);
        let mut group = c.benchmark_group(case.group);
        group
            .throughput(Throughput::Elements(1))
            .sampling_mode(SamplingMode::Flat);
        for threads in [1usize, 2] {
            let param = format!("{threads}t");
            group.bench_function(BenchmarkId::new("bare", &param), |b| {
                b.iter_custom(|iters| {
                    let slots: Vec<std::sync::Mutex<&mut Session>> =
                        sessions.iter_mut().map(std::sync::Mutex::new).collect();
                    timed_on_threads(threads, iters, |t, n| {
                        // Each thread owns one session for the whole run: no contention.
                        bare_signs(&slots[t], &case, handle, &digest, n)
                    })
                })
            });
            group.bench_function(BenchmarkId::new("hwkey", &param), |b| {
                b.iter_custom(|iters| {
                    timed_on_threads(threads, iters, |_, n| {
                        for _ in 0..n {
                            key.sign(case.scheme, &message).expect("hwkey sign");
                        }
                    })
                })
            });
        }
        group.finish();
    }
}

/// The bare loop: `n` raw `C_Sign` calls on this thread's own session (from `slots[t]`) over a
/// precomputed digest.
fn bare_signs(
    session: &std::sync::Mutex<&mut Session>,
    case: &Pkcs11Case,
    handle: ObjectHandle,
    digest: &[u8],
    n: u64,
) {
    let session = session.lock().expect("session");
    let mechanism = (case.mechanism)();
    for _ in 0..n {
        session
            .sign(&mechanism, handle, digest)
            .expect("bare C_Sign");
    }
}

/// 2 threads ÷ 1 thread in paired rounds, for hwkey and for the bare loop: criterion measures
/// one benchmark after the other, and on a shared 2-core machine the minutes between "1 thread"
/// and "2 threads" moved the ratio by ±30 %. Each round here signs `n` times on 1 thread and on
/// 2 threads, for hwkey and for the bare loop, in an order that flips every round; ratios are
/// taken per round. Returns the rates (hwkey 1t, hwkey 2t, bare 1t, bare 2t) and the session
/// pool's peak sessions in use (2 when the two threads really signed at once).
fn paired_scaling(bare: &BareToken, uri: &KeyUri, case: &Pkcs11Case) -> ([Vec<f64>; 4], u64) {
    let message = certificate_verify_message();
    let digest = sha256(&message);
    let key = Key::open(uri).expect("open the key with hwkey");
    let mut sessions: Vec<Session> = (0..2).map(|_| bare.session()).collect();
    let handle = bare.private_key(&sessions[0], case.label);
    let slots: Vec<std::sync::Mutex<&mut Session>> =
        sessions.iter_mut().map(std::sync::Mutex::new).collect();
    let n = common::pick(
        if case.group.contains("rsa") {
            400
        } else {
            4000
        },
        200,
    );
    let rounds = common::pick(10, 3);
    let run = |series: usize| {
        let threads = 1 + series % 2;
        let took = if series < 2 {
            timed_on_threads(threads, n, |_, m| {
                for _ in 0..m {
                    key.sign(case.scheme, &message).expect("hwkey sign");
                }
            })
        } else {
            timed_on_threads(threads, n, |t, m| {
                bare_signs(&slots[t], case, handle, &digest, m)
            })
        };
        n as f64 / took.as_secs_f64()
    };
    // One unmeasured pass: the pool opens its second session here.
    for series in 0..4 {
        run(series);
    }
    let mut rates: [Vec<f64>; 4] = Default::default();
    for round in 0..rounds {
        let order: Vec<usize> = if round % 2 == 0 {
            vec![0, 1, 2, 3]
        } else {
            vec![3, 2, 1, 0]
        };
        for series in order {
            rates[series].push(run(series));
        }
    }
    let peak = key.session_stats().map_or(0, |s| s.peak_in_use);
    (rates, peak)
}

/// swtpm P-256: the bare TSS loop (a context of its own, the persistent key by handle,
/// TPM2_Sign on a digest under the password session: what hwkey does, minus hwkey) against
/// hwkey, in alternating rounds rather than through criterion. swtpm is a separate process
/// whose speed swings with the machine's load, and it serves one TCP client at a time, so
/// criterion's "all of A, then all of B" would compare two different minutes; each round here
/// connects, signs `n` times and disconnects, for each side in turn.
fn bench_tpm(tcti: &str, uri: &KeyUri) -> (Vec<f64>, Vec<f64>) {
    let message = certificate_verify_message();
    let digest = sha256(&message);
    let n = common::pick(400, 150);
    let rounds = common::pick(10, 4);
    let scheme = SignatureScheme::EcDsa {
        hash_scheme: HashScheme::new(HashingAlgorithm::Sha256),
    };
    let bare_round = || {
        let mut ctx =
            Context::new(TctiNameConf::from_str(tcti).expect("TCTI")).expect("bare TPM context");
        let persistent = PersistentTpmHandle::new(TPM_HANDLE).expect("persistent handle");
        let object = ctx
            .execute_without_session(|ctx| {
                ctx.tr_from_tpm_public(TpmHandle::Persistent(persistent))
            })
            .expect("TR_FromTPMPublic");
        let key = KeyHandle::from(object);
        let start = Instant::now();
        for _ in 0..n {
            ctx.execute_with_session(Some(AuthSession::Password), |ctx| {
                let ticket = HashcheckTicket::try_from(TPMT_TK_HASHCHECK {
                    tag: TPM2_ST_HASHCHECK,
                    hierarchy: TPM2_RH_NULL,
                    digest: Default::default(),
                })?;
                ctx.sign(key, Digest::try_from(digest.as_slice())?, scheme, ticket)
            })
            .expect("bare TPM2_Sign");
        }
        n as f64 / start.elapsed().as_secs_f64()
        // Dropping the context closes the connection: swtpm serves one client at a time.
    };
    let hwkey_round = || {
        let key = Key::open(uri).expect("open the TPM key with hwkey");
        let start = Instant::now();
        for _ in 0..n {
            key.sign(SignScheme::EcdsaP256Sha256, &message)
                .expect("sign");
        }
        n as f64 / start.elapsed().as_secs_f64()
    };
    // One unmeasured round each: the first connection to a fresh swtpm is slower.
    bare_round();
    hwkey_round();
    let (mut bare, mut hw) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        if round % 2 == 0 {
            bare.push(bare_round());
            hw.push(hwkey_round());
        } else {
            hw.push(hwkey_round());
            bare.push(bare_round());
        }
    }
    eprintln!("swtpm-p256: bare {bare:.0?} signs/s, hwkey {hw:.0?} signs/s");
    (hw, bare)
}

/// Signatures per second of every sample criterion saved for `id` (`group/function/param`).
fn rates(criterion_dir: &Path, id: &str) -> Option<Stat> {
    let mut dir = criterion_dir.to_path_buf();
    for part in id.split('/') {
        dir.push(part);
    }
    let text = std::fs::read_to_string(dir.join("new/sample.json")).ok()?;
    let sample: serde_json::Value = serde_json::from_str(&text).ok()?;
    let iters = sample["iters"].as_array()?;
    let times = sample["times"].as_array()?;
    let per_sample: Vec<f64> = iters
        .iter()
        .zip(times)
        .filter_map(|(i, t)| Some(i.as_f64()? / t.as_f64()? * 1e9))
        .collect();
    (!per_sample.is_empty()).then(|| Stat::of(&per_sample))
}

/// subject / baseline for samples that are not paired: the ratio of the medians, spread from
/// the least to the most favourable pairing of quartiles.
fn unpaired_ratio(s: Option<Stat>, b: Option<Stat>) -> Option<Stat> {
    let (s, b) = (s?, b?);
    Some(Stat {
        median: s.median / b.median,
        p25: s.p25 / b.p75,
        p75: s.p75 / b.p25,
        min: s.min / b.max,
        max: s.max / b.min,
        n: s.n.min(b.n),
    })
}

fn met(ratio: Option<Stat>, at_least: f64) -> Option<bool> {
    ratio.map(|r| r.median >= at_least)
}

fn rows(dir: &Path, scaling: &[([Vec<f64>; 4], u64)], tpm: (Vec<f64>, Vec<f64>)) -> Vec<Row> {
    let mut rows = Vec::new();
    for ((group, name), (paired, peak)) in [
        ("softhsm-p256", "SoftHSM P-256"),
        ("softhsm-rsa2048", "SoftHSM RSA-2048 PSS"),
    ]
    .into_iter()
    .zip(scaling)
    {
        for t in ["1t", "2t"] {
            let threads = if t == "1t" { "1 thread" } else { "2 threads" };
            let s = rates(dir, &format!("{group}/hwkey/{t}"));
            let b = rates(dir, &format!("{group}/bare/{t}"));
            let r = unpaired_ratio(s, b);
            rows.push(
                Row::new(AREA, &format!("{name}, {threads}"), "signs/s", s)
                    .versus("bare cryptoki loop, same key", b, r)
                    .target("≥ 0.95×", met(r, 0.95)),
            );
        }
        let r = common::paired_ratios(&paired[1], &paired[0]);
        let bare_scaling = Stat::of(&common::paired_ratios(&paired[3], &paired[2]));
        rows.push(
            Row::new(
                AREA,
                &format!("{name}, 2 threads ÷ 1 thread (hwkey)"),
                "signs/s",
                Some(Stat::of(&paired[1])),
            )
            .versus(
                "hwkey, 1 thread",
                Some(Stat::of(&paired[0])),
                Some(Stat::of(&r)),
            )
            .target("≥ 1.7×", Some(Stat::of(&r).median >= 1.7))
            .note(format!(
                "paired rounds (not criterion), ratio per round; the bare loop scales {:.2}× [{:.2}–{:.2}] in the same rounds; hwkey's session pool had {peak} sessions signing at once",
                bare_scaling.median, bare_scaling.p25, bare_scaling.p75
            )),
        );
    }
    let (hw, bare) = tpm;
    let ratios = common::paired_ratios(&hw, &bare);
    rows.push(
        Row::new(
            AREA,
            "swtpm P-256, 1 thread",
            "signs/s",
            Some(Stat::of(&hw)),
        )
        .versus(
            "bare tss-esapi loop, same key",
            Some(Stat::of(&bare)),
            Some(Stat::of(&ratios)),
        )
        .target("≥ 0.95×", Some(Stat::of(&ratios).median >= 0.95))
        .note("alternating rounds (not criterion), ratio per round"),
    );
    rows
}

fn main() {
    if common::skip_unless_cargo_bench("sign") {
        return;
    }
    let started = Instant::now();
    let load_before = common::before();

    let hsm = SoftHsm::new();
    hsm.init_token(TOKEN);
    // Before the first module load: SoftHSM reads its configuration in C_Initialize.
    std::env::set_var("SOFTHSM2_CONF", hsm.conf_path());
    for case in pkcs11_cases() {
        let uri: KeyUri = hsm.key_uri(TOKEN, case.label).parse().expect("URI");
        Key::create(&uri, case.algorithm).expect("create the SoftHSM key");
    }
    let bare = BareToken::open();

    let tpm = Swtpm::start();
    let tpm_uri: KeyUri = format!("tpm:handle={TPM_HANDLE:#010x}?tcti={}", tpm.tcti())
        .parse()
        .expect("TPM URI");
    drop(Key::create(&tpm_uri, KeyAlgorithm::EcP256).expect("create the TPM key"));

    let criterion_dir = common::results_dir().join("criterion");
    let mut c = Criterion::default()
        .configure_from_args()
        .output_directory(&criterion_dir)
        .without_plots()
        .sample_size(common::pick(30, 10))
        .warm_up_time(common::pick(
            Duration::from_millis(1000),
            Duration::from_millis(200),
        ))
        .measurement_time(common::pick(
            Duration::from_secs(3),
            Duration::from_millis(700),
        ));
    bench_pkcs11(&mut c, &bare, |label| hsm.key_uri(TOKEN, label));
    c.final_summary();
    let scaling: Vec<_> = pkcs11_cases()
        .iter()
        .map(|case| {
            let uri: KeyUri = hsm.key_uri(TOKEN, case.label).parse().expect("URI");
            let (rates, peak) = paired_scaling(&bare, &uri, case);
            eprintln!(
                "{}: signs/s hwkey 1t {:.0?}, 2t {:.0?}; bare 1t {:.0?}, 2t {:.0?}",
                case.group, rates[0], rates[1], rates[2], rates[3]
            );
            (rates, peak)
        })
        .collect();
    let tpm_rates = bench_tpm(&tpm.tcti(), &tpm_uri);

    common::finish(
        "sign",
        load_before,
        started,
        rows(&criterion_dir, &scaling, tpm_rates),
    );
}
