//! Tests of the test fixtures themselves (tests/support), against the real programs:
//! SoftHSMv2, swtpm, openssl, nginx and curl. If these fail, every other integration test's
//! result is meaningless.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use support::*;

/// Makes a software client key + CSR with openssl (`openssl req -new -newkey ec ...`).
fn openssl_csr(dir: &Path, name: &str, subj: &str, san: Option<&str>) -> (PathBuf, PathBuf) {
    require_tool("openssl", "openssl");
    let key = dir.join(format!("{name}.key"));
    let csr = dir.join(format!("{name}.csr"));
    let mut cmd = Command::new("openssl");
    cmd.args(["req", "-new", "-newkey", "ec"])
        .args(["-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"])
        .arg("-keyout")
        .arg(&key)
        .args(["-subj", subj])
        .arg("-out")
        .arg(&csr);
    if let Some(san) = san {
        cmd.args(["-addext", &format!("subjectAltName={san}")]);
    }
    run_ok(&mut cmd);
    (key, csr)
}

/// A CA-signed client certificate whose key openssl made (the CA signs the CSR).
fn openssl_client(ca: &TestCa, dir: &Path, cn: &str) -> (PathBuf, PathBuf) {
    let (key, csr) = openssl_csr(dir, "client", &format!("/O=devs/CN={cn}"), None);
    let cert = dir.join("client.pem");
    ca.sign_csr_file(&csr, 1, &cert);
    (cert, key)
}

/// Runs `openssl s_client` against 127.0.0.1:port, sends a GET, returns the output.
fn s_client(port: u16, ca: &Path, client: Option<(&Path, &Path)>) -> std::process::Output {
    require_tool("timeout", "coreutils");
    let mut cmd = Command::new("timeout");
    cmd.args([
        "20",
        "openssl",
        "s_client",
        "-quiet",
        "-verify_return_error",
    ])
    .args(["-connect", &format!("127.0.0.1:{port}")])
    .args(["-verify_ip", "127.0.0.1"])
    .arg("-CAfile")
    .arg(ca);
    if let Some((cert, key)) = client {
        cmd.arg("-cert").arg(cert).arg("-key").arg(key);
    }
    let mut child = cmd
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn openssl s_client");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(b"GET / HTTP/1.0\r\n\r\n")
            .expect("write request");
    }
    child.wait_with_output().expect("wait for s_client")
}

#[test]
fn softhsm_token_is_listed_and_usable() {
    let hsm = SoftHsm::new();
    hsm.init_token("fixture-token");

    let out = hsm.pkcs11_tool(&["--list-slots"]);
    assert!(out.status.success(), "{}", output_text(&out));
    let text = output_text(&out);
    assert!(text.contains("fixture-token"), "label not listed:\n{text}");

    // The PIN file: exactly the user PIN, owner-only.
    let pin = hsm.pin_path();
    assert_eq!(fs::read(&pin).unwrap(), USER_PIN.as_bytes());
    assert_eq!(
        fs::metadata(&pin).unwrap().permissions().mode() & 0o777,
        0o600
    );

    // A key pair made with pkcs11-tool shows up when logged in with that PIN.
    hsm.pkcs11_keygen("fixture-token", "fixture-key", "EC:prime256v1");
    let out = hsm.pkcs11_tool(&[
        "--token-label",
        "fixture-token",
        "--login",
        "--pin",
        USER_PIN,
        "--list-objects",
    ]);
    let text = output_text(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("Private Key Object; EC"), "{text}");
    assert!(text.contains("fixture-key"), "{text}");

    let conf = hsm.conf_path();
    assert_eq!(
        hsm.envs(),
        vec![(
            "SOFTHSM2_CONF".to_string(),
            conf.to_str().unwrap().to_string()
        )]
    );
    assert_eq!(
        hsm.key_uri("fixture-token", "fixture-key"),
        format!(
            "pkcs11:token=fixture-token;object=fixture-key?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:{}",
            pin.display()
        )
    );

    // Everything lives in the temp dir, which goes away with the SoftHsm.
    let dir = hsm.dir().to_path_buf();
    assert!(dir.join("tokens").read_dir().unwrap().next().is_some());
    drop(hsm);
    assert!(!dir.exists(), "{} not removed", dir.display());
}

#[test]
fn two_softhsm_setups_are_independent() {
    let a = SoftHsm::new();
    let b = SoftHsm::new();
    a.init_token("only-in-a");
    let out = b.pkcs11_tool(&["--list-slots"]);
    assert!(!output_text(&out).contains("only-in-a"));
}

#[test]
fn swtpm_answers_tpm2_tools_and_closes_its_port_on_drop() {
    require_tool("tpm2_getrandom", "tpm2-tools");
    let tpm = Swtpm::start();
    let port = tpm.port();
    assert_eq!(tpm.tcti(), format!("swtpm:host=127.0.0.1,port={port}"));

    let out = run_ok(
        Command::new("tpm2_getrandom")
            .envs(tpm.envs())
            .args(["8", "--hex"]),
    );
    let hex = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(hex.len(), 16, "expected 8 random bytes in hex, got {hex:?}");
    assert!(hex.chars().all(|c| c.is_ascii_hexdigit()), "{hex:?}");

    let dir = tpm.dir().to_path_buf();
    drop(tpm);
    assert!(!port_is_open(port), "swtpm still listens on {port}");
    assert!(!port_is_open(port + 1), "swtpm control still listens");
    assert!(!dir.exists(), "{} not removed", dir.display());
}

#[test]
fn swtpm_restart_keeps_ports_and_works() {
    require_tool("tpm2_getrandom", "tpm2-tools");
    let mut tpm = Swtpm::start();
    let tcti = tpm.tcti();
    tpm.restart();
    assert_eq!(tpm.tcti(), tcti);
    run_ok(
        Command::new("tpm2_getrandom")
            .envs(tpm.envs())
            .args(["8", "--hex"]),
    );
}

#[test]
fn test_ca_signs_an_openssl_csr_that_openssl_verifies() {
    let dir = temp_dir();
    let ca = TestCa::new(dir.path());
    let (_key, csr) = openssl_csr(
        dir.path(),
        "node",
        "/O=system:nodes/CN=system:node:worker-1",
        Some("DNS:worker-1.example,IP:10.0.0.7"),
    );
    let cert = dir.path().join("node.pem");
    ca.sign_csr_file(&csr, 7, &cert);

    let out = run_ok(
        Command::new("openssl")
            .args(["verify", "-purpose", "sslclient", "-CAfile"])
            .arg(ca.ca_path())
            .arg(&cert),
    );
    assert!(output_text(&out).contains(": OK"), "{}", output_text(&out));

    // The certificate carries the CSR's subject and SANs and the client profile.
    let pem_text = read(&cert);
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem_text.as_bytes()).unwrap();
    let x = pem.parse_x509().unwrap();
    assert_eq!(
        x.subject().to_string(),
        "O=system:nodes, CN=system:node:worker-1"
    );
    assert_eq!(
        x.issuer().to_string(),
        "CN=hwkey test CA",
        "issuer is the test CA"
    );
    let san = x.subject_alternative_name().unwrap().unwrap();
    use x509_parser::extensions::GeneralName;
    assert_eq!(
        san.value.general_names,
        [
            GeneralName::DNSName("worker-1.example"),
            GeneralName::IPAddress(&[10, 0, 0, 7]),
        ]
    );
    let eku = x.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.client_auth && !eku.server_auth);
    let ku = x.key_usage().unwrap().unwrap().value;
    assert!(ku.digital_signature() && !ku.key_cert_sign());
    assert!(!x.is_ca());
    let validity = x.validity().time_to_expiration().unwrap();
    assert!(validity.whole_days() == 6 || validity.whole_days() == 7);

    // The server certificate verifies as a TLS server cert for localhost and 127.0.0.1.
    let (server, _server_key) = ca.server_cert(dir.path());
    for check in [
        ["-verify_hostname", "localhost"],
        ["-verify_ip", "127.0.0.1"],
    ] {
        run_ok(
            Command::new("openssl")
                .args(["verify", "-purpose", "sslserver"])
                .args(check)
                .arg("-CAfile")
                .arg(ca.ca_path())
                .arg(&server),
        );
    }
    // A software-key client certificate straight from the CA verifies as a TLS client cert.
    let (sw_cert, _sw_key) = ca.client_cert(dir.path(), "sw", "carol", Some("devs"));
    run_ok(
        Command::new("openssl")
            .args(["verify", "-purpose", "sslclient", "-CAfile"])
            .arg(ca.ca_path())
            .arg(&sw_cert),
    );
    // A certificate from another CA does not verify.
    let other_dir = temp_dir();
    let other = TestCa::new(other_dir.path());
    run_fail(
        Command::new("openssl")
            .args(["verify", "-CAfile"])
            .arg(other.ca_path())
            .arg(&cert),
    );
}

#[test]
fn test_ca_rejects_a_tampered_csr() {
    let dir = temp_dir();
    let ca = TestCa::new(dir.path());
    let (_key, csr) = openssl_csr(dir.path(), "x", "/CN=mallory", None);
    let block = pem::parse(read(&csr)).unwrap();
    let mut der = block.contents().to_vec();
    // Flip a byte inside the subject CN ("mallory" appears once).
    let at = der.windows(7).position(|w| w == b"mallory").unwrap();
    der[at] = b'n';
    let tampered = pem::encode(&pem::Pem::new("CERTIFICATE REQUEST", der));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ca.sign_csr_pem(&tampered, 1)
    }));
    assert!(result.is_err(), "a CSR with a bad signature was signed");
}

fn openssl_server_requires_client_cert(tls: TlsVersion) {
    let dir = temp_dir();
    let ca = TestCa::new(dir.path());
    let (server_cert, server_key) = ca.server_cert(dir.path());
    let server = OpensslServer::start(&ca.ca_path(), &server_cert, &server_key, tls);
    assert_eq!(
        server.url(),
        format!("https://127.0.0.1:{}/", server.port())
    );

    let out = s_client(server.port(), &ca.ca_path(), None);
    let text = output_text(&out);
    assert!(!out.status.success(), "no client cert accepted:\n{text}");
    assert!(!text.contains("200 ok"), "{text}");

    let (cert, key) = openssl_client(&ca, dir.path(), "alice");
    let out = s_client(server.port(), &ca.ca_path(), Some((&cert, &key)));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        text.starts_with("HTTP/1.0 200 ok"),
        "{text}\n{}",
        output_text(&out)
    );
    assert!(text.contains("Subject: O=devs, CN=alice"), "{text}");
    let want = match tls {
        TlsVersion::Tls12 => "Protocol  : TLSv1.2",
        TlsVersion::Tls13 => "Protocol  : TLSv1.3",
    };
    assert!(text.contains(want), "{text}");

    let log = server.log();
    assert!(log.contains("depth=0 O = devs, CN = alice"), "{log}");
    assert!(log.contains("peer did not return a certificate"), "{log}");

    let port = server.port();
    drop(server);
    assert!(!port_is_open(port));
}

#[test]
fn openssl_server_tls13_requires_client_cert() {
    openssl_server_requires_client_cert(TlsVersion::Tls13);
}

#[test]
fn openssl_server_tls12_requires_client_cert() {
    openssl_server_requires_client_cert(TlsVersion::Tls12);
}

#[test]
fn nginx_requires_client_cert() {
    require_tool("curl", "curl");
    let dir = temp_dir();
    let ca = TestCa::new(dir.path());
    let (server_cert, server_key) = ca.server_cert(dir.path());
    let nginx = Nginx::start(&ca.ca_path(), &server_cert, &server_key);
    let (cert, key) = openssl_client(&ca, dir.path(), "bob");

    let curl = |args: &[&str], client: bool| {
        let mut cmd = Command::new("curl");
        cmd.args(["-sS", "--max-time", "20", "--cacert"])
            .arg(ca.ca_path())
            .args(args);
        if client {
            cmd.arg("--cert").arg(&cert).arg("--key").arg(&key);
        }
        cmd.arg(nginx.url());
        cmd
    };

    // $ssl_client_s_dn is RFC 2253: last RDN first, so /O=devs/CN=bob reads CN=bob,O=devs.
    let out = run_ok(&mut curl(&[], true));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "client=CN=bob,O=devs proto=TLSv1.3\n"
    );
    let out = run_ok(&mut curl(&["--tlsv1.2", "--tls-max", "1.2"], true));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "client=CN=bob,O=devs proto=TLSv1.2\n"
    );

    // Without a client certificate nginx completes the handshake and answers HTTP 400.
    let out = run_ok(&mut curl(&["-o", "/dev/null", "-w", "%{http_code}"], false));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "400");
    run_fail(&mut curl(&["--fail"], false));
    let log = nginx.log();
    assert!(
        log.contains("client sent no required SSL certificate"),
        "{log}"
    );
    assert!(nginx.access_log().contains("\" 200 "));

    let port = nginx.port();
    drop(nginx);
    assert!(!port_is_open(port));
}

#[test]
fn hwkey_command_points_at_the_built_binary() {
    // The crate's binary exists at the path Cargo gives integration tests, without RUST_LOG.
    let cmd = hwkey();
    assert!(Path::new(cmd.get_program()).is_file());
    assert!(cmd.get_envs().any(|(k, v)| k == "RUST_LOG" && v.is_none()));
}

#[test]
fn free_ports_are_distinct_and_free() {
    let a = free_port();
    let b = free_port();
    assert_ne!(a, b);
    let p = free_port_pair();
    assert!(std::net::TcpListener::bind(("127.0.0.1", p)).is_ok());
    assert!(std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok());
}

/// swtpm's two ports lie below the ephemeral range, where no outgoing connection can take
/// them: the approver benchmark used to fail with "no free pair of adjacent TCP ports" when
/// its connections held the even ports next to every port bind(0) offered.
#[test]
fn port_pairs_come_from_below_the_ephemeral_range() {
    let (low, _) = ephemeral_range();
    for _ in 0..20 {
        let p = free_port_pair();
        assert!(p + 1 < low, "{p} is in the ephemeral range from {low}");
    }
}

#[test]
#[should_panic(
    expected = "definitely-not-a-tool-xyz not found: install it with `apt-get install nope`"
)]
fn require_tool_fails_loudly() {
    require_tool("definitely-not-a-tool-xyz", "nope");
}

/// Whether this process has a TCP connection open to 127.0.0.1:`port` (its descriptors
/// matched by inode against `/proc/net/tcp`).
#[cfg(feature = "tpm")]
fn connected_to(port: u16) -> bool {
    let inodes: Vec<String> = fs::read_to_string("/proc/net/tcp")
        .expect("/proc/net/tcp")
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let remote = u16::from_str_radix(fields.get(2)?.rsplit_once(':')?.1, 16).ok()?;
            (remote == port && *fields.get(3)? == "01").then(|| format!("socket:[{}]", fields[9]))
        })
        .collect();
    fs::read_dir("/proc/self/fd")
        .expect("this process's descriptors")
        .filter_map(|fd| fs::read_link(fd.ok()?.path()).ok())
        .any(|target| inodes.iter().any(|i| target.as_os_str() == i.as_str()))
}

/// The test binary runs tests on several threads, and many of them start programs (swtpm,
/// daemons, tools) while others talk to a TPM in this process. tpm2-tss's swtpm TCTI opens a
/// connection for each command without close-on-exec, so a program started on another thread
/// while a command was in flight kept that connection, and swtpm (one connection at a time)
/// then waited on it for good: every later command of that TPM hung. In CI two `key::tpm`
/// tests hung, most likely this way, until the run was killed at 90 minutes. A program
/// started mid-command now gets no such descriptor: every `socket(2)` call in this process
/// makes a close-on-exec socket (tests/it/cloexec.rs). The command is held in flight by
/// stopping swtpm, so the test does not depend on timing.
#[cfg(feature = "tpm")]
#[test]
fn a_program_started_while_a_tpm_command_is_in_flight_leaves_the_tpm_free() {
    use hwkey::key::{Key, KeyAlgorithm, SignScheme};
    require_tool("tpm2_getrandom", "tpm2-tools");
    let tpm = Swtpm::start();
    let dir = temp_dir();
    let uri = format!(
        "tpm:path={}?tcti={}",
        dir.path().join("k.pem").display(),
        tpm.tcti()
    )
    .parse()
    .expect("key URI");
    let key = std::sync::Arc::new(Key::create(&uri, KeyAlgorithm::EcP256).expect("create a key"));
    let paused = tpm.pause();
    let signer = key.clone();
    let signing =
        std::thread::spawn(move || signer.sign(SignScheme::EcdsaP256Sha256, b"in flight"));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !connected_to(tpm.port()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the signature never reached the TPM"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // Another thread starts a long-lived program while the command waits for its answer.
    let mut program = ChildGuard::spawn(
        Command::new("sleep").arg("600"),
        "a program started meanwhile",
        &dir.path().join("sleep.log"),
    );
    drop(paused);
    joined(signing, "the signature in flight").expect("the signature in flight");
    // The key's next command (its flush as it closes), and the next client, get the TPM while
    // that program still runs.
    joined(std::thread::spawn(move || drop(key)), "closing the key");
    let envs = tpm.envs();
    let client = std::thread::spawn(move || {
        Command::new("tpm2_getrandom")
            .envs(envs)
            .args(["8", "--hex"])
            .output()
            .expect("run tpm2_getrandom")
    });
    let out = joined(client, "tpm2_getrandom");
    assert!(out.status.success(), "tpm2_getrandom: {out:?}");
    program.kill();
}

/// `thread`'s result, or a failure after 30 s (a hang must fail this test, not stall the run).
#[cfg(feature = "tpm")]
fn joined<T>(thread: std::thread::JoinHandle<T>, what: &str) -> T {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !thread.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} waited 30 s for the TPM: the program started mid-command holds its connection"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    thread.join().expect(what)
}
