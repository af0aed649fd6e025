//! The network side's sandbox, read from outside the process as an auditor would
//! (`/proc/PID/status`, the proxy's own metrics and log) and tried from inside (its start-up
//! self-check, which must find the PIN file unreadable).

use std::time::Duration;

use support::proxy::{Identity, ProxyOptions, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

/// A field of `/proc/PID/status`.
fn status_field(pid: u32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix(&format!("{field}:"))
                .map(|v| v.trim().to_string())
        })
        .unwrap_or_default()
}

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
    // The filter names what it refuses, io_uring included (src/proxy/sandbox.rs's unit test
    // runs the same filter on a thread and sees io_uring_setup refused).
    assert!(log.contains("BPF, io_uring, namespaces)"), "{log}");
    assert!(!log.contains("self-check"), "{log}");
    // The signer side is not confined this way: it opens the device and reads the PIN.
    assert_eq!(status_field(pid, "NoNewPrivs"), "1");
}

/// The start-up self-check: with the sandbox off the network side can read the PIN file, and
/// says so; with `--sandbox=required` and the PIN file where the network side may read (beside
/// the certificate, whose directory it reads for reloads), the proxy refuses to start, naming
/// the file, and nothing is left running.
#[cfg(feature = "pkcs11")]
#[test]
fn the_self_check_finds_a_readable_pin_file() {
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

    // The PIN file beside the certificate.
    let support::proxy::Backend::SoftHsm(hsm) = &id.backend else {
        unreachable!("a SoftHSM identity")
    };
    let beside = id.cert.with_file_name("pin");
    std::fs::copy(hsm.pin_path(), &beside).expect("copy the PIN file");
    let key = id.key_uri.replace(
        &format!("pin-source=file:{}", hsm.pin_path().display()),
        &format!("pin-source=file:{}", beside.display()),
    );
    assert_ne!(key, id.key_uri);
    let out = run_fail_within(
        hwkey()
            .envs(id.envs())
            .args(["proxy", "--key", &key, "--cert"])
            .arg(&id.cert)
            .args(["--upstream", &upstream.url(), "--upstream-ca"])
            .arg(id.ca.ca_path())
            .args(["--listen", &format!("tcp:127.0.0.1:{}", free_port())])
            .arg("--state-dir")
            .arg(id.cert.with_file_name("state"))
            .args(["--sandbox", "required"]),
        Duration::from_secs(30),
    );
    let text = output_text(&out);
    assert!(
        text.contains("--sandbox=required") && text.contains(&beside.display().to_string()),
        "{text}"
    );
    assert_eq!(upstream.stats().tcp_connections, 0, "it went upstream");
}
