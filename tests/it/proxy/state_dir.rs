//! The state directory belongs to the user running hwkey (issue 9, finding 14): a proxy refuses
//! a state directory (and loopback CA) another user owns or may write, and symbolic links in
//! it; the plugin refuses a control socket that is not its user's. Runs as root in CI (to
//! chown to `nobody`); elsewhere it fails saying so, it never skips.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::proxy::{Identity, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

fn proxy_cmd(id: &Identity, upstream: &TestUpstream, state: &Path) -> Command {
    let mut cmd = hwkey();
    cmd.envs(id.envs())
        .args(["proxy", "--key", &id.key_uri, "--cert"])
        .arg(&id.cert)
        .args(["--upstream", &upstream.url(), "--upstream-ca"])
        .arg(id.ca.ca_path())
        .args(["--listen", &format!("tcp:127.0.0.1:{}", free_port())])
        .arg("--state-dir")
        .arg(state);
    cmd
}

/// A state directory with a loopback CA made by a first proxy run.
fn state_with_ca(
    id: &Identity,
    upstream: &TestUpstream,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = temp_dir();
    let state = dir.path().join("state");
    run_ok(
        hwkey()
            .envs(id.envs())
            .args([
                "kubeconfig",
                "--name",
                "s",
                "--key",
                &id.key_uri,
                "--server",
                &upstream.url(),
                "--ca",
            ])
            .arg(id.ca.ca_path())
            .arg("--out")
            .arg(dir.path().join("kubeconfig"))
            .arg("--state-dir")
            .arg(&state),
    );
    assert!(
        state.join("loopback-ca.key").exists(),
        "no loopback CA was made"
    );
    (dir, state)
}

#[test]
fn another_users_state_directory_is_refused() {
    require_root("this test changes file owners to another user (nobody)");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let (_dir, state) = state_with_ca(&id, &upstream);
    let before: Vec<(String, Vec<u8>)> = std::fs::read_dir(&state)
        .expect("state")
        .filter_map(Result::ok)
        .filter(|e| e.path().is_file())
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).expect("read"),
            )
        })
        .collect();
    run_ok(
        Command::new("chown")
            .args(["-R", "65534:65534"])
            .arg(&state),
    );
    let out = run_fail_within(
        &mut proxy_cmd(&id, &upstream, &state),
        Duration::from_secs(30),
    );
    let text = output_text(&out);
    assert!(text.contains("belongs to uid 65534"), "{text}");
    assert!(text.contains("--state-dir"), "{text}");
    for (name, bytes) in before {
        assert_eq!(
            std::fs::read(state.join(&name)).expect("read"),
            bytes,
            "{name} changed"
        );
    }
    assert_eq!(upstream.stats().tcp_connections, 0);
}

#[test]
fn a_state_directory_others_may_write_is_refused() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let (_dir, state) = state_with_ca(&id, &upstream);
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let out = run_fail_within(
        &mut proxy_cmd(&id, &upstream, &state),
        Duration::from_secs(30),
    );
    let text = output_text(&out);
    assert!(
        text.contains("writable by other users (mode 777)"),
        "{text}"
    );
    assert!(text.contains("chmod go-w"), "{text}");
}

#[test]
fn a_symlinked_loopback_ca_key_is_refused() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let (dir, state) = state_with_ca(&id, &upstream);
    let key = state.join("loopback-ca.key");
    let elsewhere = dir.path().join("planted.key");
    std::fs::rename(&key, &elsewhere).expect("move key");
    std::os::unix::fs::symlink(&elsewhere, &key).expect("symlink");
    let out = run_fail_within(
        &mut proxy_cmd(&id, &upstream, &state),
        Duration::from_secs(30),
    );
    let text = output_text(&out);
    assert!(text.contains("loopback-ca.key"), "{text}");
    assert!(
        text.contains("symbolic link") || text.contains("Too many levels of symbolic links"),
        "{text}"
    );
}

/// The plugin neither uses nor removes a control socket that belongs to another user.
#[test]
fn the_plugin_refuses_another_users_control_socket() {
    require_root("this test changes file owners to another user (nobody)");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).expect("mkdir");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let proxy = {
        let mut p = proxy_cmd(&id, &upstream, &state);
        let log = dir.path().join("proxy.log");
        let mut guard = ChildGuard::spawn(&mut p, "hwkey proxy", &log);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !guard.log().contains("hwkey proxy: ready") {
            assert!(guard.try_wait().is_none(), "{}", guard.log());
            assert!(std::time::Instant::now() < deadline, "{}", guard.log());
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        guard
    };
    let sock = state.join("control.sock");
    run_ok(Command::new("chown").arg("65534:65534").arg(&sock));
    let ext = serde_json::json!({
        "key": id.key_uri, "cert": id.cert.display().to_string(),
        "upstream": upstream.url(), "upstreamCA": id.ca.ca_path().display().to_string(),
        "stateDir": state.display().to_string(),
    });
    let info = serde_json::json!({
        "apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
        "spec": {"interactive": false, "cluster": {"server": format!("https://127.0.0.1:{}", free_port()), "config": ext}},
    });
    let out = run_fail(
        hwkey()
            .envs(id.envs())
            .env("KUBERNETES_EXEC_INFO", info.to_string())
            .arg("credential"),
    );
    assert!(out.stdout.is_empty(), "a credential was printed");
    assert!(
        output_text(&out).contains("belongs to uid 65534"),
        "{}",
        output_text(&out)
    );
    assert!(sock.exists(), "another user's socket was removed");
    drop(proxy);
    let _ = ProxyProcess::start; // the proxy above is a plain ChildGuard: killed on drop
}

/// `hwkey kubeconfig` on an existing state directory (it reads the loopback CA there).
fn kubeconfig_on(id: &Identity, upstream: &TestUpstream, state: &Path) -> Command {
    let mut cmd = hwkey();
    cmd.envs(id.envs())
        .args(["kubeconfig", "--name", "again", "--key", &id.key_uri])
        .args(["--server", &upstream.url(), "--ca"])
        .arg(id.ca.ca_path())
        .arg("--out")
        .arg(state.with_file_name("kubeconfig-again"))
        .arg("--state-dir")
        .arg(state);
    cmd
}

/// Root (kubelet's exec plugin) uses the state of the proxy unit's service user when root gave
/// it (the owners' chain ends at a root-owned directory no one else may write), as systemd's
/// `StateDirectory=` does: the same directory is refused when it belongs to any other user, or
/// when the directory above it may be written by others.
#[test]
fn root_trusts_the_service_users_state_only_where_root_gave_it() {
    require_root("this test changes file owners to another user (nobody)");
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let (dir, state) = state_with_ca(&id, &upstream);
    run_ok(
        Command::new("chown")
            .args(["-R", "65534:65534"])
            .arg(&state),
    );
    // nobody (65534) as the service user: trusted.
    run_ok(kubeconfig_on(&id, &upstream, &state).env("HWKEY_SERVICE_USER", "nobody"));
    // Not the service user: refused, as before.
    let out = run_fail(&mut kubeconfig_on(&id, &upstream, &state));
    assert!(
        output_text(&out).contains("belongs to uid 65534"),
        "{}",
        output_text(&out)
    );
    // The service user's, but under a directory others may write: refused.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let out = run_fail(kubeconfig_on(&id, &upstream, &state).env("HWKEY_SERVICE_USER", "nobody"));
    assert!(
        output_text(&out).contains("belongs to uid 65534"),
        "{}",
        output_text(&out)
    );
}
