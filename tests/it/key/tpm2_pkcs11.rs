//! tpm2-pkcs11 as a second real PKCS#11 module (issue 24, item 5): a token and key made with
//! `tpm2_ptool` on a swtpm shared through tpm2-abrmd (tpm2-pkcs11 needs a resource manager: on
//! a bare swtpm `tpm2_ptool addkey` runs out of object slots), used by hwkey's PKCS#11 backend
//! for `csr`, `cert import`, TLS handshakes with s_server and nginx, and the proxy.

use std::process::Command;

use support::flow::Flow;
use support::kube::KubeCluster;
use support::kubectl::KubectlUser;
use support::proxy::{Backend, Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::{output_text, require_tool, run_ok, temp_dir, write_private, SharedTpm};

const MODULE: &str = "/usr/lib/x86_64-linux-gnu/pkcs11/libtpm2_pkcs11.so";

/// A tpm2-pkcs11 token on a shared swtpm, with one ECC key: (TPM, the module's environment,
/// everything the hwkey commands need, the key's URI, the directory the token lives in).
struct Token {
    tpm: SharedTpm,
    module_envs: Vec<(String, String)>,
    envs: Vec<(String, String)>,
    uri: String,
    _dir: tempfile::TempDir,
}

fn tpm2_pkcs11_token() -> Token {
    require_tool("tpm2_ptool", "libtpm2-pkcs11-tools");
    assert!(
        std::path::Path::new(MODULE).exists(),
        "{MODULE} is missing: apt-get install libtpm2-pkcs11-1"
    );
    let tpm = SharedTpm::start();
    let dir = temp_dir();
    let store = dir.path().join("store");
    std::fs::create_dir_all(&store).expect("mkdir store");
    // tpm2-pkcs11 keeps its token in an SQLite store and reaches the TPM through a TCTI.
    let module_envs = vec![
        ("TPM2_PKCS11_STORE".to_string(), store.display().to_string()),
        ("TPM2_PKCS11_TCTI".to_string(), tpm.tcti()),
        ("TPM2TOOLS_TCTI".to_string(), tpm.tcti()),
    ];
    let mut envs = tpm.envs();
    envs.extend(module_envs.clone());
    let ptool = |args: &[&str]| {
        run_ok(
            Command::new("tpm2_ptool")
                .envs(envs.clone())
                .args(args)
                .arg(format!("--path={}", store.display())),
        )
    };
    ptool(&["init"]);
    ptool(&[
        "addtoken",
        "--pid=1",
        "--label=tpmtoken",
        "--userpin=1234",
        "--sopin=5678",
    ]);
    ptool(&[
        "addkey",
        "--label=tpmtoken",
        "--key-label=alice",
        "--userpin=1234",
        "--algorithm=ecc256",
    ]);
    let pin = dir.path().join("pin");
    write_private(&pin, b"1234");
    let uri = format!(
        "pkcs11:token=tpmtoken;object=alice?module-path={MODULE}&pin-source=file:{}",
        pin.display()
    );
    Token {
        tpm,
        module_envs,
        envs,
        uri,
        _dir: dir,
    }
}

#[test]
fn a_tpm2_pkcs11_key_signs_csrs_and_handshakes() {
    let Token {
        tpm,
        module_envs,
        envs,
        uri,
        _dir,
    } = tpm2_pkcs11_token();
    let flow = Flow::new(envs.clone());
    // The key is what tpm2-pkcs11 says it is: sensitive, never extractable.
    let info = run_ok(flow.hwkey().args(["key", "info", "--key", &uri]));
    assert!(
        output_text(&info).contains("extractable: no"),
        "{}",
        output_text(&info)
    );
    // A CSR openssl verifies, the certificate stored on the token, and handshakes signed by
    // the TPM through tpm2-pkcs11 with s_server (TLS 1.3, 1.2) and nginx.
    flow.certify_and_probe(&uri, "ec-p256");

    // And through the proxy: the TPM signs the upstream handshakes via tpm2-pkcs11.
    let cert = flow.certify(&uri, "alice");
    let Flow {
        ca, dir: flow_dir, ..
    } = flow;
    let id = Identity {
        backend: Backend::SharedTpm(Box::new(tpm)),
        key_uri: uri,
        cert,
        ca,
        dir: flow_dir,
    };
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            envs: module_envs,
            ..Default::default()
        },
    );
    for _ in 0..10 {
        let out = proxy.curl_unix(&["-f"], "/version");
        assert!(out.status.success(), "{}", output_text(&out));
    }
}

/// kubectl, with nothing but the kubeconfig `hwkey kubeconfig` writes, authenticates to the
/// real kube-apiserver as the certificate's user: the TPM signs through tpm2-pkcs11.
#[test]
fn a_tpm2_pkcs11_key_authenticates_kubectl_to_the_real_apiserver() {
    let token = tpm2_pkcs11_token();
    let flow = Flow::new(token.envs.clone());
    let cert = flow.certify(&token.uri, "alice");
    let cluster = KubeCluster::start(&flow.ca, "10m");
    let user = KubectlUser::new(
        &token.uri,
        &cert,
        &cluster.url(),
        &cluster.ca_path(),
        token.envs.clone(),
    );
    let version = run_ok(user.kubectl().args(["get", "--raw", "/version"]));
    assert!(output_text(&version).contains("gitVersion"));
    // Authenticated as alice (who may do nothing): the API server names her in its refusal.
    let out = user
        .kubectl()
        .args(["get", "namespaces"])
        .output()
        .expect("kubectl");
    let text = output_text(&out);
    assert!(
        !out.status.success() && text.contains("User \"alice\" cannot list resource"),
        "{text}"
    );
    drop(user);
    drop(token.tpm);
}
