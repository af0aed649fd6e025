//! RSA keys on tokens without RSA-PSS, and upstreams without ALPN (issue 13).
//!
//! SoftHSM plays the limited smart cards: `slots.mechanisms = -A,A,…` in its config removes
//! mechanisms (the first name after `-` is ignored, hence the repeat). Which mechanism really
//! reached the token is read from OpenSC's `pkcs11-spy.so` log placed between hwkey and SoftHSM;
//! that openssl accepts the signatures is shown by `openssl s_server -Verify 1`, which checks
//! the client's CertificateVerify itself.

use std::path::{Path, PathBuf};
use std::process::Command;

use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

/// A token without any RSA-PSS mechanism (it keeps CKM_RSA_X_509 and CKM_RSA_PKCS).
const NO_PSS: &str = "slots.mechanisms = -CKM_RSA_PKCS_PSS,CKM_RSA_PKCS_PSS,CKM_SHA1_RSA_PKCS_PSS,\
CKM_SHA224_RSA_PKCS_PSS,CKM_SHA256_RSA_PKCS_PSS,CKM_SHA384_RSA_PKCS_PSS,CKM_SHA512_RSA_PKCS_PSS";

/// A token with PKCS#1 v1.5 only: no PSS, no raw RSA.
const PKCS1_ONLY: &str = "slots.mechanisms = -CKM_RSA_PKCS_PSS,CKM_RSA_PKCS_PSS,\
CKM_SHA1_RSA_PKCS_PSS,CKM_SHA224_RSA_PKCS_PSS,CKM_SHA256_RSA_PKCS_PSS,CKM_SHA384_RSA_PKCS_PSS,\
CKM_SHA512_RSA_PKCS_PSS,CKM_RSA_X_509";

/// OpenSC's PKCS#11 spy module.
const SPY: &str = "/usr/lib/x86_64-linux-gnu/pkcs11-spy.so";

/// The key URI through pkcs11-spy, and the environment that makes the spy log to `log`.
fn spied(id: &Identity, log: &Path) -> (String, Vec<(String, String)>) {
    assert!(
        Path::new(SPY).exists(),
        "{SPY} not found: install it with `apt-get install opensc-pkcs11` (part of opensc)"
    );
    let uri = id.key_uri.replace(
        &format!("module-path={SOFTHSM_MODULE}"),
        &format!("module-path={SPY}"),
    );
    let mut envs = id.envs();
    envs.push(("PKCS11SPY".into(), SOFTHSM_MODULE.into()));
    envs.push(("PKCS11SPY_OUTPUT".into(), log.display().to_string()));
    (uri, envs)
}

/// The mechanisms of every C_SignInit in a spy log.
fn signed_with(log: &Path) -> Vec<String> {
    read(log)
        .lines()
        .filter_map(|l| l.strip_prefix("[in] pMechanism->type = "))
        .map(|m| m.trim().to_string())
        .collect()
}

fn key_info(id: &Identity) -> String {
    let out = run_ok(
        hwkey()
            .envs(id.envs())
            .args(["key", "info", "--key", &id.key_uri]),
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// `openssl s_server -Verify 1 -tls1_3|-tls1_2` with a server certificate from the identity's CA.
fn openssl_server(id: &Identity, tls: TlsVersion) -> OpensslServer {
    let (cert, key) = id.ca.server_cert(id.dir.path());
    OpensslServer::start(&id.ca.ca_path(), &cert, &key, tls)
}

fn probe(
    uri: &str,
    envs: &[(String, String)],
    id: &Identity,
    url: &str,
    extra: &[&str],
) -> Command {
    let mut cmd = hwkey();
    cmd.envs(envs.iter().cloned())
        .args(["probe", "--key", uri, "--cert"])
        .arg(&id.cert)
        .arg("--ca")
        .arg(id.ca.ca_path())
        .args(extra)
        .arg(url);
    cmd
}

/// kubectl with a loopback credential of `proxy` (as `hwkey credential` would hand it out).
fn kubectl_whoami(proxy: &ProxyProcess) -> serde_json::Value {
    require_tool("kubectl", "kubectl (from the machine image)");
    let dir = temp_dir();
    let (ca, cert, key) = proxy.credential_files(dir.path());
    let kubeconfig = dir.path().join("kubeconfig");
    let p = |p: &PathBuf| p.display().to_string();
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: hw\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: hw\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: hw\n  context: {{cluster: hw, user: hw}}\ncurrent-context: hw\n",
            proxy.tls_url(),
            p(&ca),
            p(&cert),
            p(&key)
        ),
    )
    .expect("write kubeconfig");
    let out = run_ok(
        Command::new("kubectl")
            .env("KUBECONFIG", &kubeconfig)
            .args(["auth", "whoami", "-o", "json"]),
    );
    serde_json::from_slice(&out.stdout).expect("kubectl JSON")
}

fn software_pss_on_a_pss_less_token(algorithm: &str) {
    let id = Identity::softhsm_with(SoftHsm::with_config(NO_PSS), algorithm);
    let info = key_info(&id);
    assert!(
        info.contains("signing:   software PSS over raw RSA") && info.contains("CKM_RSA_X_509"),
        "{info}"
    );
    assert!(
        info.contains("rsa_pss_rsae_sha256"),
        "PSS still offered:\n{info}"
    );
    // The key stays in the token.
    assert!(info.contains("CKA_EXTRACTABLE: false"), "{info}");
    assert!(info.contains("private value readable: false"), "{info}");

    // openssl verifies the CertificateVerify of a TLS 1.3 handshake (RSA-PSS only there); the
    // spy shows the token did raw RSA and was never asked for PSS.
    let server = openssl_server(&id, TlsVersion::Tls13);
    let log_dir = temp_dir();
    let log = log_dir.path().join("spy.log");
    let (uri, envs) = spied(&id, &log);
    let out = run_ok(&mut probe(&uri, &envs, &id, &server.url(), &[]));
    let text = output_text(&out);
    assert!(text.contains("tls: TLSv1.3"), "{text}");
    assert!(
        text.contains("client signature: rsa_pss_rsae_sha"),
        "{text}"
    );
    let mechanisms = signed_with(&log);
    assert!(
        !mechanisms.is_empty() && mechanisms.iter().all(|m| m == "CKM_RSA_X_509"),
        "{mechanisms:?}"
    );

    // kubectl through the proxy; the upstream saw TLS 1.3 and the hardware identity.
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let v = kubectl_whoami(&proxy);
    assert_eq!(v["status"]["userInfo"]["username"], "alice", "{v}");
    let stats = upstream.stats();
    assert!(
        !stats.connections.is_empty() && stats.connections.iter().all(|c| c.version == "TLSv1_3"),
        "{stats:?}"
    );
    assert!(proxy.signatures() >= 1);
}

#[test]
fn rsa_2048_on_a_token_without_pss_signs_tls13_with_software_pss() {
    software_pss_on_a_pss_less_token("rsa-2048");
}

#[test]
fn rsa_3072_on_a_token_without_pss_signs_tls13_with_software_pss() {
    software_pss_on_a_pss_less_token("rsa-3072");
}

/// A full-featured token keeps its own PSS mechanism: no software encoding.
#[test]
fn a_token_with_pss_signs_with_its_native_mechanism() {
    let id = Identity::softhsm_with(SoftHsm::new(), "rsa-2048");
    let info = key_info(&id);
    assert!(info.contains("signing:   native"), "{info}");
    let server = openssl_server(&id, TlsVersion::Tls13);
    let log_dir = temp_dir();
    let log = log_dir.path().join("spy.log");
    let (uri, envs) = spied(&id, &log);
    let out = run_ok(&mut probe(&uri, &envs, &id, &server.url(), &[]));
    assert!(output_text(&out).contains("client signature: rsa_pss_rsae_sha"));
    let mechanisms = signed_with(&log);
    assert!(
        !mechanisms.is_empty() && mechanisms.iter().all(|m| m == "CKM_RSA_PKCS_PSS"),
        "{mechanisms:?}"
    );
}

/// PKCS#1 v1.5 only: refused in words by default (proxy, probe, doctor), TLS 1.2 with the flag.
#[test]
fn a_pkcs1_only_token_is_refused_clearly_and_works_over_tls12_with_the_flag() {
    let id = Identity::softhsm_with(SoftHsm::with_config(PKCS1_ONLY), "rsa-2048");
    let info = key_info(&id);
    assert!(info.contains("signing:   TLS 1.2 fallback only"), "{info}");
    assert!(!info.contains("rsa_pss"), "PSS offered:\n{info}");

    let upstream = TestUpstream::start(&id.ca);
    // The proxy refuses to start, naming the missing mechanisms and both ways out.
    let mut cmd = hwkey();
    cmd.envs(id.envs())
        .args(["proxy", "--key", &id.key_uri, "--cert"])
        .arg(&id.cert)
        .args(["--upstream", &upstream.url(), "--upstream-ca"])
        .arg(id.ca.ca_path())
        .args(["--listen", &format!("tcp:127.0.0.1:{}", free_port())]);
    let out = run_fail_within(&mut cmd, std::time::Duration::from_secs(30));
    let text = output_text(&out);
    for needle in [
        "cannot sign a TLS 1.3 handshake",
        "CKM_RSA_PKCS_PSS and CKM_RSA_X_509",
        "ec-p256",
        "--allow-tls12-fallback",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    assert_eq!(upstream.stats().tcp_connections, 0);

    // doctor says the same.
    let out = run_fail(
        hwkey()
            .envs(id.envs())
            .args(["doctor", "--key", &id.key_uri]),
    );
    assert!(output_text(&out).contains("--allow-tls12-fallback"));

    // With the flag: TLS 1.2 with PKCS#1 v1.5, through the proxy and in probe.
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--allow-tls12-fallback"]),
    );
    let v = kubectl_whoami(&proxy);
    assert_eq!(v["status"]["userInfo"]["username"], "alice", "{v}");
    let stats = upstream.stats();
    assert!(
        !stats.connections.is_empty() && stats.connections.iter().all(|c| c.version == "TLSv1_2"),
        "{stats:?}"
    );

    let server = openssl_server(&id, TlsVersion::Tls12);
    let out = run_fail(&mut probe(&id.key_uri, &id.envs(), &id, &server.url(), &[]));
    assert!(output_text(&out).contains("--allow-tls12-fallback"));
    let out = run_ok(&mut probe(
        &id.key_uri,
        &id.envs(),
        &id,
        &server.url(),
        &["--allow-tls12-fallback"],
    ));
    let text = output_text(&out);
    assert!(text.contains("tls: TLSv1.2"), "{text}");
    assert!(text.contains("client signature: rsa_pkcs1_sha"), "{text}");
}

/// An upstream that negotiates no ALPN (`openssl s_server -www` offers none) serves HTTP/1.1
/// clients through the proxy (RFC 7301: such a server simply does not do ALPN).
#[test]
fn http1_through_the_proxy_to_an_upstream_without_alpn() {
    let id = Identity::softhsm();
    let server = openssl_server(&id, TlsVersion::Tls13);
    let proxy = ProxyProcess::start_to(
        &id,
        &format!("https://127.0.0.1:{}", server.port()),
        ProxyOptions::default(),
    );
    let out = proxy.curl_unix(&["--http1.1", "-i"], "/");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success() && text.starts_with("HTTP/1.0 200"),
        "{}\n{}",
        output_text(&out),
        proxy.log()
    );
    assert!(text.contains("TLSv1.3"), "{text}");
}
