//! The boundary between the network side and the signer side, tried as an attacker who took
//! over the network side would (calls made inside the running `hwkey-net` under ptrace) and as an
//! operator on a bad day would (a stopped signer, a PIN file fixed while the proxy runs, the
//! binary replaced by an upgrade).

use std::process::Command;
use std::time::{Duration, Instant};

use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

fn code(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A network side started as root holds no capability in any set (it kept them all:
/// `CapEff 000001fffeffffff`), and inside it `mknod` of a character device, a packet socket,
/// a raw socket, a UDP socket (its API server is an address: nothing to resolve), an MPTCP
/// socket, a symbolic link in its state directory and `chmod` of a root-only file all fail, while `/etc/hosts` opens (the calls were made).
#[cfg(target_arch = "x86_64")]
#[test]
fn a_root_network_side_holds_no_capability_and_makes_no_device_or_raw_socket() {
    require_root("this test checks what a network side started as root may do");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--sandbox", "required"]),
    );
    let out = proxy.curl_unix(&["-s", "-o", "/dev/null", "-w", "%{http_code}"], "/version");
    assert_eq!(code(&out), "200", "{}", proxy.log());
    let pid = proxy.guard.id();
    for set in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
        assert_eq!(status_field(pid, set), "0000000000000000", "{set}");
    }
    let dir = temp_dir();
    let node = dir.path().join("kmsg");
    // No link in the state directory it writes (to point a file it reads elsewhere).
    let link = proxy.state_dir.join("planted");
    let secret = dir.path().join("root-only");
    std::fs::write(&secret, "x").expect("write");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    let calls = [
        Call::Open("/etc/hosts".into(), 0),
        // S_IFCHR | 0600, makedev(1, 11) (/dev/kmsg).
        Call::Mknod(node.clone(), 0o20600, 267),
        // AF_PACKET, SOCK_RAW; AF_INET, SOCK_RAW, IPPROTO_ICMP.
        Call::Socket(17, 3, 0),
        Call::Socket(2, 3, 1),
        // The API server is an address: no name to resolve, so no UDP either.
        Call::Socket(2, 2, 0),
        Call::Socket(10, 2, 0),
        // IPPROTO_MPTCP: a stream socket outside Landlock's TCP port rules; TCP itself still opens.
        Call::Socket(2, 1, 262),
        Call::Socket(2, 1, 6),
        Call::Symlink("/etc/shadow".into(), link.clone()),
        Call::Chmod(secret.clone(), 0o666),
    ];
    let got = calls_inside(pid, &calls);
    assert!(got[0] >= 0, "/etc/hosts did not open: {got:?}");
    assert_eq!(got[1], -1, "a character device was made");
    assert!(!node.exists());
    assert_eq!(got[2], -1, "a packet socket");
    assert_eq!(got[3], -1, "a raw socket");
    assert_eq!(got[4], -1, "a UDP socket");
    assert_eq!(got[5], -1, "a UDP6 socket");
    assert_eq!(got[6], -1, "an MPTCP socket");
    assert!(got[7] >= 0, "a TCP socket did not open: {got:?}");
    assert_eq!(got[8], -1, "a symbolic link");
    assert!(
        std::fs::symlink_metadata(&link).is_err(),
        "the link was made"
    );
    assert_eq!(got[9], -1, "chmod of a root-only file");
    let mode = std::fs::metadata(&secret)
        .expect("stat")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    // Still serving.
    let out = proxy.curl_unix(&["-s", "-o", "/dev/null", "-w", "%{http_code}"], "/version");
    assert_eq!(code(&out), "200", "{}", proxy.log());
}

/// A stopped signer (SIGSTOP; a token waiting for a touch, a stalled TPM): a request that
/// needs a signature gets a 502 naming the stalled signer once half the handshake timeout
/// passed, not after the whole stall; `/healthz` answers 503 saying so; the next requests fail
/// at once (no thread waits out the stall again); and after SIGCONT requests are served again.
/// Before, every request waited as long as the stop lasted and `/healthz` did not answer.
#[test]
fn a_stopped_signer_fails_requests_fast_and_the_proxy_recovers() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--handshake-timeout", "2s"]),
    );
    let version = || proxy.curl_unix(&["-s", "-w", "\n%{http_code}"], "/version");
    assert!(code(&version()).ends_with("\n200"), "{}", proxy.log());
    // A full handshake next (the sessions go with a reload, which the signer side reads).
    proxy.signal(libc::SIGHUP);
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"ok\"}", 1.0);
    let signer = proxy.signer_pid();
    run_ok(Command::new("kill").args(["-STOP", &signer.to_string()]));
    let stalled = code(&version());
    assert!(
        stalled.ends_with("\n502") && stalled.contains("did not answer within"),
        "{stalled}\n{}",
        proxy.log()
    );
    let threads = status_field(proxy.guard.id(), "Threads");
    let (status, body) = proxy.admin_get("/healthz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("signer"), "{body}");
    for _ in 0..20 {
        let again = code(&version());
        assert!(again.ends_with("\n502"), "{again}");
    }
    let after = status_field(proxy.guard.id(), "Threads");
    assert!(
        after.parse::<u32>().expect("threads") <= threads.parse::<u32>().expect("threads") + 2,
        "threads grew from {threads} to {after} while the signer was stopped"
    );
    run_ok(Command::new("kill").args(["-CONT", &signer.to_string()]));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !code(&version()).ends_with("\n200") {
        assert!(
            Instant::now() < deadline,
            "not served after SIGCONT:\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A PIN file that went wrong while the proxy ran is presented once (the signer that read it
/// is refused), never again while it stays wrong, and the fixed file is used at the next
/// request that needs a signer (before, the proxy answered 502 for good although its message
/// said "fix the PIN source and try again").
#[test]
fn a_fixed_pin_file_is_used_again_and_an_unchanged_wrong_one_never() {
    let id = Identity::softhsm();
    let support::proxy::Backend::SoftHsm(hsm) = &id.backend else {
        unreachable!("a SoftHSM identity")
    };
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let version = || proxy.curl_unix(&["-s", "-w", "\n%{http_code}"], "/version");
    assert!(code(&version()).ends_with("\n200"), "{}", proxy.log());
    let good = std::fs::read(hsm.pin_path()).expect("PIN");
    std::fs::write(hsm.pin_path(), "999999\n").expect("wrong PIN");
    let first = proxy.signer_pid();
    run_ok(Command::new("kill").args(["-KILL", &first.to_string()]));
    proxy.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !proxy.log().contains("PIN source still holds the same one") {
        assert!(Instant::now() < deadline, "{}", proxy.log());
        let _ = version();
        std::thread::sleep(Duration::from_millis(300));
    }
    // Signers started with the wrong PIN: exactly one, whatever the number of requests.
    let refused = proxy.log().matches("a new signer is serving").count();
    assert_eq!(refused, 0, "{}", proxy.log());
    std::fs::write(hsm.pin_path(), &good).expect("fix the PIN");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !code(&version()).ends_with("\n200") {
        assert!(
            Instant::now() < deadline,
            "the fixed PIN was not used:\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A package upgrade replaces the binary on disk: the supervisor still starts signers, from the
/// binary it was started from (opened at start). Before, a signer killed after the upgrade
/// never came back ("(deleted)").
#[test]
fn a_signer_comes_back_after_the_binary_was_replaced_on_disk() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let bin = temp_dir();
    let hwkey = bin.path().join("hwkey");
    std::fs::copy(hwkey_bin(), &hwkey).expect("copy hwkey");
    std::fs::copy(
        hwkey_bin().with_file_name("hwkey-net"),
        bin.path().join("hwkey-net"),
    )
    .expect("copy hwkey-net");
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            bin: Some(&hwkey),
            ..Default::default()
        },
    );
    let version = || proxy.curl_unix(&["-s", "-w", "\n%{http_code}"], "/version");
    assert!(code(&version()).ends_with("\n200"), "{}", proxy.log());
    // The upgrade: a new file in place of the old one.
    std::fs::remove_file(&hwkey).expect("unlink");
    std::fs::write(&hwkey, "#!/bin/sh\nexit 1\n").expect("replace");
    let first = proxy.signer_pid();
    run_ok(Command::new("kill").args(["-KILL", &first.to_string()]));
    proxy.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !code(&version()).ends_with("\n200") {
        assert!(
            Instant::now() < deadline,
            "no signer after the upgrade:\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_ne!(proxy.signer_pid(), first);
}

/// A chain file cut inside its second certificate is refused whole: at a reload the previous
/// chain stays in use, the refusal is counted and `/healthz` says "degraded" naming it; at a
/// start the proxy refuses, naming the file. Before, the cut block was skipped, the leaf alone
/// installed, `/healthz` said "ok" and nothing was logged.
#[test]
fn a_chain_file_cut_inside_a_certificate_is_refused_at_reload_and_at_start() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let version = || proxy.curl_unix(&["-s", "-w", "\n%{http_code}"], "/version");
    assert!(code(&version()).ends_with("\n200"), "{}", proxy.log());
    let leaf = std::fs::read_to_string(&id.cert).expect("leaf");
    let ca = id.ca.ca_pem();
    let cut = format!("{leaf}{}", &ca[..ca.len() / 2]);
    let tmp = id.cert.with_extension("cut");
    std::fs::write(&tmp, &cut).expect("write");
    std::fs::rename(&tmp, &id.cert).expect("swap");
    proxy.signal(libc::SIGHUP);
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"refused\"}", 1.0);
    let (status, body) = proxy.admin_get("/healthz");
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("degraded") && body.contains("refused whole"),
        "{body}"
    );
    assert!(code(&version()).ends_with("\n200"), "{}", proxy.log());
    drop(proxy);
    let text = id.proxy_refused(
        &upstream,
        &id.key_uri,
        &id.cert.with_file_name("state2"),
        &[],
    );
    assert!(
        text.contains("refused whole") && text.contains(&id.cert.display().to_string()),
        "{text}"
    );
}

/// The node key file in the state directory (where the kubelet example used to keep it): the
/// network side writes there and could `unlink` the node identity, so the proxy refuses to
/// start, naming the key file, in the default `--sandbox auto` too; nothing goes upstream.
#[cfg(feature = "tpm")]
#[test]
fn a_key_file_the_network_side_could_delete_refuses_the_start() {
    let id = Identity::tpm();
    let upstream = TestUpstream::start(&id.ca);
    let key_file = id.dir.path().join("alice.tpm.pem");
    assert!(key_file.exists());
    let text = id.proxy_refused(
        &upstream,
        &id.key_uri,
        id.dir.path(),
        &["--sandbox", "auto"],
    );
    assert!(
        text.contains("read or delete") && text.contains(&key_file.display().to_string()),
        "{text}"
    );
    assert!(key_file.exists(), "the key file is gone");
    assert_eq!(upstream.stats().tcp_connections, 0, "it went upstream");
}

/// A PIN written as a `pin-value` in the configuration file or on the command line never
/// reaches the network side: not its memory (freed heap included), its command line or its
/// environment, while the signer logs in with it. (`hwkey-net` read the file and argv again:
/// the PIN was in its memory.)
#[cfg(feature = "pkcs11")]
#[test]
fn a_pin_value_in_the_configuration_or_argv_never_reaches_the_network_side() {
    require_root("this test reads the undumpable network side's memory");
    const PIN: &str = "pin-8e1f0c7a3b";
    let id = Identity::softhsm();
    let support::proxy::Backend::SoftHsm(hsm) = &id.backend else {
        unreachable!()
    };
    let changed = hsm.pkcs11_tool(&[
        "--token-label",
        "kube",
        "--login",
        "--pin",
        USER_PIN,
        "--change-pin",
        "--new-pin",
        PIN,
    ]);
    assert!(changed.status.success(), "{}", output_text(&changed));
    let key = id.key_uri.replace(
        &format!("pin-source=file:{}", hsm.pin_path().display()),
        &format!("pin-value={PIN}"),
    );
    assert_ne!(key, id.key_uri);
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let config = dir.path().join("proxy.toml");
    let sock = dir.path().join("p.sock");
    std::fs::write(
        &config,
        format!(
            "key = {key:?}\ncert = {cert:?}\nupstream = {up:?}\nupstream-ca = {ca:?}\nlisten = [{listen:?}]\nstate-dir = {state:?}\n",
            cert = id.cert.display().to_string(),
            up = upstream.url(),
            ca = id.ca.ca_path().display().to_string(),
            listen = format!("unix:{}", sock.display()),
            state = dir.path().join("state").display().to_string(),
        ),
    )
    .expect("write the config");
    let mut from_file = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            bare: true,
            args: vec!["--config".into(), config.display().to_string()],
            ..Default::default()
        },
    );
    from_file.socket = sock;
    let from_argv = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            key: Some(&key),
            ..Default::default()
        },
    );
    for proxy in [&from_file, &from_argv] {
        let out = proxy.curl_unix(&["-s", "-o", "/dev/null", "-w", "%{http_code}"], "/version");
        assert_eq!(code(&out), "200", "the signer logs in: {}", proxy.log());
        assert!(
            !memory_holds(proxy.guard.id(), PIN.as_bytes()),
            "the PIN is in the network side's memory"
        );
    }
    let shown = std::fs::read(format!("/proc/{}/cmdline", from_argv.guard.id())).expect("cmdline");
    let shown = String::from_utf8_lossy(&shown).replace('\0', " ");
    assert!(shown.contains("pin-value=<redacted>"), "{shown}");
}
