//! The network side's sandbox, read from outside the process as an auditor would
//! (`/proc/PID/status`, the proxy's own metrics and log) and tried from inside (its start-up
//! self-check, which must find the PIN file unreadable).

use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

/// With `--sandbox=required` the network side runs with `no_new_privs` and a seccomp filter
/// (`/proc/PID/status`: NoNewPrivs 1, Seccomp 2 on every thread), Landlock enforced, says so
/// in its log and metrics, and still serves.
#[cfg(feature = "pkcs11")]
#[test]
fn the_network_side_runs_confined() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions::args(&["--sandbox", "required"]),
    );
    let out = proxy.curl_unix(&["-s", "-o", "/dev/null", "-w", "%{http_code}"], "/version");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "200",
        "{}",
        proxy.log()
    );
    let pid = proxy.guard.id();
    let threads: Vec<u32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("tasks")
        .filter_map(|t| t.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    assert!(threads.len() > 2, "only {threads:?}");
    for tid in threads {
        let status = format!("{pid}/task/{tid}");
        let read = |field: &str| {
            std::fs::read_to_string(format!("/proc/{status}/status"))
                .unwrap_or_default()
                .lines()
                .find_map(|l| {
                    l.strip_prefix(&format!("{field}:"))
                        .map(|v| v.trim().to_string())
                })
                .unwrap_or_default()
        };
        assert_eq!(read("NoNewPrivs"), "1", "thread {tid}");
        assert_eq!(read("Seccomp"), "2", "thread {tid}");
    }
    for layer in ["landlock", "seccomp", "no_new_privs"] {
        assert_eq!(
            proxy.metric(&format!("hwkey_sandbox_enforced{{layer=\"{layer}\"}}")),
            1.0,
            "{layer}"
        );
    }
    let log = proxy.log();
    assert!(
        log.contains("sandbox: Landlock ABI") && log.contains("enforced"),
        "{log}"
    );
    // The filter names what it refuses, io_uring included (src/proxy/syscalls.rs's unit test
    // runs the same filter on a thread and sees io_uring_setup refused).
    assert!(
        log.contains("allow-list on (no execve, ptrace, mounts, modules, keyrings, BPF, io_uring, namespaces, chmod/chown, mknod, links, raw sockets, TIOCSTI)"),
        "{log}"
    );
    assert!(log.contains("; no capabilities "), "{log}");
    assert!(!log.contains("self-check"), "{log}");
    // The signer side is not confined this way: it opens the device and reads the PIN.
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
}

/// The start-up self-check: with the sandbox off the network side can read the PIN file, and
/// says so; with the PIN file in the state directory (which the network side writes) the proxy
/// refuses to start, naming the file, in the default `--sandbox=auto` too (before, `auto` only
/// logged it and started), and nothing is left running.
#[cfg(feature = "pkcs11")]
#[test]
fn the_self_check_refuses_a_pin_file_within_reach_in_every_mode_but_off() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let off = ProxyProcess::start_with(&id, &upstream, ProxyOptions::args(&["--sandbox", "off"]));
    let log = off.log();
    assert!(log.contains("sandbox off"), "{log}");
    assert!(
        log.contains("can read what only the signer needs") && log.contains("/pin"),
        "{log}"
    );
    assert_eq!(
        off.metric("hwkey_sandbox_enforced{layer=\"landlock\"}"),
        0.0
    );
    drop(off);

    // The PIN file in the state directory.
    let state = id.cert.with_file_name("state");
    std::fs::create_dir_all(&state).expect("state dir");
    let inside = state.join("pin");
    let key = id.key_uri_with_pin_at(&inside);
    for mode in ["auto", "required"] {
        let text = id.proxy_refused(&upstream, &key, &state, &["--sandbox", mode]);
        assert!(
            text.contains("only the signer side may touch")
                && text.contains(&inside.display().to_string()),
            "{mode}: {text}"
        );
    }
    assert_eq!(upstream.stats().tcp_connections, 0, "it went upstream");
}

/// The rejected-PIN memory in the state directory, where the network side could delete a
/// record (and a restart would then spend one more of the token's tries), refuses the start,
/// naming it, in `auto` and `required`; before, the proxy started (and the memory's default
/// for a person was `~/.local/state/hwkey/rejected-pins`, inside the default state directory:
/// now beside it, `key::pin_memory::tests::the_default_memory_is_beside_the_state_directory`).
#[cfg(feature = "pkcs11")]
#[test]
fn a_rejected_pin_memory_the_network_side_could_delete_refuses_the_start() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let state = temp_dir();
    let memory = state.path().join("rejected-pins");
    for mode in ["auto", "required"] {
        let text = id.proxy_refused_with(
            &upstream,
            &id.key_uri,
            state.path(),
            &["--sandbox", mode],
            &[("HWKEY_PIN_STATE_DIR", &memory)],
        );
        assert!(
            text.contains("only the signer side may touch")
                && text.contains(&memory.display().to_string())
                && text.contains("HWKEY_PIN_STATE_DIR"),
            "{mode}: {text}"
        );
    }
    assert_eq!(upstream.stats().tcp_connections, 0, "it went upstream");
}

/// The call `open(path, flags)`, to make inside the network side.
#[cfg(target_arch = "x86_64")]
fn open_call(path: &std::path::Path, flags: i32) -> Call {
    Call::Open(path.to_path_buf(), flags)
}

/// A person's proxy made as the README says, with the certificate and the PIN file in the home
/// directory: inside the running network side, `~/.ssh/id_ed25519`, the PIN file and the key's
/// token directory cannot be opened, `~/.bashrc` cannot be opened for appending, and a CA key
/// beside `--upstream-ca` cannot be read; `/etc/hosts` (name resolution) still can, which
/// shows the calls were made. Before, the certificate's and the CA bundle's directories were
/// granted whole (and written with `--renew`). Renewals and reloads read and write those files
/// through the signer side.
#[cfg(target_arch = "x86_64")]
#[cfg(feature = "pkcs11")]
#[test]
fn a_persons_proxy_reaches_nothing_in_the_home_directory_beside_its_certificate() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let home = temp_dir();
    let ssh = home.path().join(".ssh");
    std::fs::create_dir(&ssh).expect("mkdir .ssh");
    std::fs::write(ssh.join("id_ed25519"), "PRIVATE").expect("ssh key");
    std::fs::write(home.path().join(".bashrc"), "# rc\n").expect("bashrc");
    let cert = home.path().join("alice.pem");
    std::fs::copy(&id.cert, &cert).expect("cert");
    let pin = home.path().join("alice.pin");
    let key = id.key_uri_with_pin_at(&pin);
    let cadir = temp_dir();
    let ca = cadir.path().join("ca.pem");
    std::fs::copy(id.ca.ca_path(), &ca).expect("ca");
    std::fs::copy(id.ca.key_path(), cadir.path().join("ca.key")).expect("ca key");
    let proxy = ProxyProcess::start_with(
        &id,
        &upstream,
        ProxyOptions {
            key: Some(&key),
            cert: Some(&cert),
            upstream_ca: Some(&ca),
            ..ProxyOptions::args(&["--sandbox", "auto"])
        },
    );
    let out = proxy.curl_unix(&["-s", "-o", "/dev/null", "-w", "%{http_code}"], "/version");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "200",
        "{}",
        proxy.log()
    );
    let pid = proxy.guard.id();
    let support::proxy::Backend::SoftHsm(hsm) = &id.backend else {
        unreachable!("a SoftHSM identity")
    };
    let token_dir = hsm.dir().join("tokens");
    let secrets = [
        ssh.join("id_ed25519"),
        pin.clone(),
        cadir.path().join("ca.key"),
        token_dir,
    ];
    let bashrc = home.path().join(".bashrc");
    let o_wronly_append = libc::O_WRONLY | libc::O_APPEND;
    let mut calls = vec![open_call(std::path::Path::new("/etc/hosts"), 0)];
    calls.extend(secrets.iter().map(|secret| open_call(secret, 0)));
    calls.push(open_call(&bashrc, o_wronly_append));
    let got = calls_inside(pid, &calls);
    assert!(got[0] >= 0, "/etc/hosts did not open: {got:?}");
    for (secret, fd) in secrets.iter().zip(&got[1..]) {
        assert_eq!(*fd, -1, "{} was opened", secret.display());
    }
    assert_eq!(got[5], -1, "~/.bashrc was opened for appending");
    assert_eq!(
        std::fs::read_to_string(home.path().join(".bashrc")).expect("rc"),
        "# rc\n"
    );
    // The certificate is still reloaded (through the signer).
    proxy.signal(libc::SIGHUP);
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"ok\"}", 1.0);
}
