//! Keys that ask for the PIN at every signature (issue 24, item 3): `CKA_ALWAYS_AUTHENTICATE`, as
//! on a PIV card's slot 9c. SoftHSM enforces it (`pkcs11-tool --keypairgen --always-auth`):
//! without `C_Login(CKU_CONTEXT_SPECIFIC)` right after `C_SignInit`, `C_Sign` fails with
//! `CKR_USER_NOT_LOGGED_IN`. Counted in OpenSC's pkcs11-spy log between hwkey and SoftHSM.

use std::path::Path;

use support::flow::Flow;
use support::proxy::{Backend, Identity, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

const SPY: &str = "/usr/lib/x86_64-linux-gnu/pkcs11-spy.so";

/// A token `kube` with an RSA-2048 key `pa` made by pkcs11-tool with `--always-auth`.
fn pin_always_token() -> SoftHsm {
    let hsm = SoftHsm::new();
    hsm.init_token("kube");
    let out = hsm.pkcs11_tool(&[
        "--token-label",
        "kube",
        "--login",
        "--pin",
        USER_PIN,
        "--keypairgen",
        "--key-type",
        "rsa:2048",
        "--label",
        "pa",
        "--id",
        "0a",
        "--usage-sign",
        "--always-auth",
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
    hsm
}

/// The token's environment with pkcs11-spy in front of SoftHSM, logging to `log` (a URI reaches
/// it with `module-path=`[`SPY`]); checks the spy is installed.
fn spied(hsm: &SoftHsm, log: &Path) -> Vec<(String, String)> {
    assert!(
        Path::new(SPY).exists(),
        "{SPY} is missing: apt-get install opensc-pkcs11"
    );
    let mut envs = hsm.envs();
    envs.push(("PKCS11SPY".into(), SOFTHSM_MODULE.into()));
    envs.push(("PKCS11SPY_OUTPUT".into(), log.display().to_string()));
    envs
}

/// The calls the spy logged, in order (`C_SignInit`, `C_Login`, …), with a `C_Login`'s user type
/// appended (`C_Login CKU_CONTEXT_SPECIFIC`).
fn calls(log: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut out: Vec<String> = Vec::new();
    for line in text.lines() {
        if let Some((_, call)) = line.split_once(": C_") {
            out.push(format!("C_{}", call.trim()));
        } else if let Some(user) = line.strip_prefix("[in] userType = ") {
            if let Some(last) = out.last_mut().filter(|l| *l == "C_Login") {
                last.push(' ');
                last.push_str(user.trim());
            }
        }
    }
    out
}

#[test]
fn a_pin_always_key_signs_csrs_and_handshakes_with_one_context_login_per_signature() {
    assert!(
        Path::new(SPY).exists(),
        "{SPY} is missing: apt-get install opensc-pkcs11"
    );
    let hsm = pin_always_token();
    let work = temp_dir();
    let log = work.path().join("spy.log");
    let envs = spied(&hsm, &log);
    let flow = Flow::new(envs);
    let uri = hsm.key_uri("kube", "pa").replace(SOFTHSM_MODULE, SPY);

    let info = run_ok(flow.hwkey().args(["key", "info", "--key", &uri]));
    assert!(
        output_text(&info).contains("PIN always: yes"),
        "{}",
        output_text(&info)
    );
    assert!(
        !output_text(&info).contains("ERROR"),
        "a successful command logged an error: {}",
        output_text(&info)
    );

    // A CSR openssl verifies, a certificate, and handshakes with s_server (TLS 1.3 and 1.2)
    // and nginx, each signature re-authenticated.
    flow.certify_and_probe(&uri, "rsa-2048");
    let calls = calls(&log);
    let inits: Vec<usize> = (0..calls.len())
        .filter(|&i| calls[i] == "C_SignInit")
        .collect();
    assert!(
        inits.len() >= 4,
        "a CSR and three handshakes sign: {calls:?}"
    );
    for &i in &inits {
        assert_eq!(
            calls.get(i + 1).map(String::as_str),
            Some("C_Login CKU_CONTEXT_SPECIFIC"),
            "C_SignInit not followed by the context login: {:?}",
            &calls[i..(i + 3).min(calls.len())]
        );
    }
    let context_logins = calls
        .iter()
        .filter(|c| *c == "C_Login CKU_CONTEXT_SPECIFIC")
        .count();
    assert_eq!(
        context_logins,
        inits.len(),
        "one context login per signature"
    );
}

#[test]
fn a_pin_always_key_serves_through_the_proxy() {
    let hsm = pin_always_token();
    let key_uri = hsm.key_uri("kube", "pa");
    let id = Identity::of_existing_key(Backend::SoftHsm(hsm), key_uri, temp_dir());
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    for _ in 0..5 {
        let out = proxy.curl_unix(&["-f"], "/version");
        assert!(out.status.success(), "{}", output_text(&out));
    }
    // Resumption keeps PIN-always signatures rare: five requests, at most one full handshake.
    let metrics = proxy.metrics();
    let signatures: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("hwkey_signatures_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("hwkey_signatures_total");
    assert!(
        (1.0..=2.0).contains(&signatures),
        "{signatures} signatures for 5 requests"
    );
}

#[test]
fn a_wrong_pin_for_a_pin_always_key_is_presented_once() {
    assert!(
        Path::new(SPY).exists(),
        "{SPY} is missing: apt-get install opensc-pkcs11"
    );
    let hsm = pin_always_token();
    let work = temp_dir();
    let log = work.path().join("spy.log");
    let records = work.path().join("records");
    let pin = work.path().join("wrong-pin");
    write_private(&pin, b"9999");
    let uri = format!(
        "pkcs11:token=kube;object=pa?module-path={SPY}&pin-source=file:{}",
        pin.display()
    );
    for _ in 0..3 {
        let out = run_fail(
            hwkey()
                .envs(spied(&hsm, &log))
                .env("HWKEY_PIN_STATE_DIR", &records)
                .args(["csr", "--key", &uri, "--subject", "CN=pa"]),
        );
        assert!(output_text(&out).contains("PIN"), "{}", output_text(&out));
    }
    let logins = calls(&log)
        .iter()
        .filter(|c| c.starts_with("C_Login"))
        .count();
    assert_eq!(logins, 1, "the wrong PIN reached the token {logins} times");
}

/// kubectl through the generated kubeconfig with a PIN-always key, and how rare its
/// signatures are: the proxy resumes TLS sessions upstream, so the PIN is presented once per
/// full handshake, not per call. 50 calls; the count is printed for the figure.
#[test]
fn kubectl_with_a_pin_always_key_needs_the_pin_rarely() {
    require_tool("kubectl", "kubectl (from the machine image)");
    assert!(
        Path::new(SPY).exists(),
        "{SPY} is missing: apt-get install opensc-pkcs11"
    );
    let hsm = pin_always_token();
    let work = temp_dir();
    let log = work.path().join("spy.log");
    let envs = spied(&hsm, &log);
    let plain = hsm.key_uri("kube", "pa");
    // kubectl's plugin and proxy reach the token through the spy; the certificate is issued
    // without it, so the count is kubectl's alone.
    let uri = plain.replace(SOFTHSM_MODULE, SPY);
    let id = Identity::of_existing_key(Backend::SoftHsm(hsm), plain, temp_dir());
    let upstream = TestUpstream::start(&id.ca);
    let kubeconfig = work.path().join("kubeconfig");
    let _proxy = support::kubectl::PluginProxy::in_state_dir(&work.path().join("state"));
    run_ok(
        hwkey()
            .envs(envs.clone())
            .args(["kubeconfig", "--name", "pa", "--key", &uri, "--cert"])
            .arg(&id.cert)
            .args(["--server", &upstream.url(), "--ca"])
            .arg(id.ca.ca_path())
            .arg("--out")
            .arg(&kubeconfig)
            .arg("--state-dir")
            .arg(work.path().join("state")),
    );
    let before = calls(&log).iter().filter(|c| *c == "C_SignInit").count();
    const CALLS: usize = 50;
    for call in 0..CALLS {
        let out = run_ok(
            std::process::Command::new("kubectl")
                .envs(envs.clone())
                .env("HOME", work.path())
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .args(["get", "--raw", "/version", "--request-timeout=20s"]),
        );
        assert!(out.status.success(), "call {call}: {}", output_text(&out));
    }
    let calls = calls(&log);
    let signatures = calls.iter().filter(|c| *c == "C_SignInit").count() - before;
    let context_logins = calls
        .iter()
        .filter(|c| *c == "C_Login CKU_CONTEXT_SPECIFIC")
        .count();
    eprintln!(
        "PIN-always: {signatures} signatures for {CALLS} kubectl calls ({} per 1,000)",
        signatures * 1000 / CALLS
    );
    assert!(
        (1..=3).contains(&signatures),
        "{signatures} signatures for {CALLS} kubectl calls"
    );
    assert!(context_logins >= signatures, "{calls:?}");
}

/// A PIN the token rejected was never presented again by that process, even once its source
/// held the right PIN: a proxy whose PIN file was wrong for a moment (a secret rotated in two
/// steps) refused every later full handshake until it was restarted. Now the changed PIN is
/// presented, once, and the proxy signs again; the wrong one is still presented only once.
#[test]
fn a_fixed_pin_file_is_used_without_a_restart() {
    let hsm = pin_always_token();
    let work = temp_dir();
    let pin = work.path().join("pin");
    write_private(&pin, USER_PIN.as_bytes());
    let key_uri = format!(
        "pkcs11:token=kube;object=pa?module-path={SOFTHSM_MODULE}&pin-source=file:{}",
        pin.display()
    );
    let id = Identity::of_existing_key(Backend::SoftHsm(hsm), key_uri, temp_dir());
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        support::proxy::ProxyOptions {
            envs: vec![(
                "HWKEY_PIN_STATE_DIR".into(),
                work.path().join("records").display().to_string(),
            )],
            ..Default::default()
        },
    );
    let get = |reloads: f64| {
        // A reload forgets the session tickets: the next request needs a full handshake.
        proxy.signal(libc::SIGHUP);
        proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"ok\"}", reloads);
        proxy.curl_unix(&["-f"], "/version").status.success()
    };
    assert!(proxy.curl_unix(&["-f"], "/version").status.success());
    write_private(&pin, b"9999");
    assert!(!get(1.0), "signed with a wrong PIN");
    assert!(!get(2.0), "signed with a wrong PIN");
    write_private(&pin, USER_PIN.as_bytes());
    assert!(
        get(3.0),
        "the right PIN was not used again:\n{}",
        proxy.log()
    );
}
