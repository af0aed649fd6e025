//! Merging into existing kubeconfigs without losing anything (issue 9, finding 15): a
//! symlinked kubeconfig stays a symlink and its target is updated (as kubectl does); a file
//! whose `clusters` is not a list is refused and left byte for byte; a key URI with a
//! `pin-value` is refused instead of silently losing the PIN (or writing it into the file).

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use support::proxy::Identity;
use support::upstream::TestUpstream;
use support::*;

fn kubeconfig_cmd(
    id: &Identity,
    upstream: &TestUpstream,
    key: &str,
    out: &Path,
    state: &Path,
) -> std::process::Command {
    kubeconfig_cmd_named("hw", id, upstream, key, out, state)
}

fn kubeconfig_cmd_named(
    name: &str,
    id: &Identity,
    upstream: &TestUpstream,
    key: &str,
    out: &Path,
    state: &Path,
) -> std::process::Command {
    let mut cmd = kubeconfig_base(name, id, upstream, key);
    cmd.arg("--out").arg(out).arg("--state-dir").arg(state);
    cmd
}

/// `hwkey kubeconfig` for `name` with no `--out` and no `--state-dir` (their defaults).
fn kubeconfig_base(
    name: &str,
    id: &Identity,
    upstream: &TestUpstream,
    key: &str,
) -> std::process::Command {
    let mut cmd = hwkey();
    cmd.envs(id.envs())
        .args(["kubeconfig", "--name", name, "--key", key])
        .args(["--server", &upstream.url(), "--ca"])
        .arg(id.ca.ca_path());
    cmd
}

const OTHER: &str = "apiVersion: v1\nkind: Config\nclusters:\n- name: other\n  cluster:\n    server: https://example.invalid:6443\ncontexts: []\nusers: []\ncurrent-context: other\n";

#[test]
fn a_symlinked_kubeconfig_stays_a_symlink_and_its_target_is_updated() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let real = dir.path().join("real.yaml");
    std::fs::write(&real, OTHER).expect("write");
    let link = dir.path().join("config");
    std::os::unix::fs::symlink("real.yaml", &link).expect("symlink");
    run_ok(&mut kubeconfig_cmd(
        &id,
        &upstream,
        &id.key_uri,
        &link,
        &dir.path().join("state"),
    ));
    assert!(
        std::fs::symlink_metadata(&link)
            .expect("lstat")
            .file_type()
            .is_symlink(),
        "the kubeconfig symlink was replaced by a file"
    );
    let text = std::fs::read_to_string(&real).expect("read");
    assert!(
        text.contains("name: other") && text.contains("name: hw"),
        "{text}"
    );
}

#[test]
fn a_kubeconfig_whose_clusters_is_not_a_list_is_refused_and_kept() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    let odd = "apiVersion: v1\nkind: Config\nclusters: {a: 1}\n";
    std::fs::write(&out, odd).expect("write");
    let failed = run_fail(&mut kubeconfig_cmd(
        &id,
        &upstream,
        &id.key_uri,
        &out,
        &dir.path().join("state"),
    ));
    assert!(
        output_text(&failed).contains("'clusters' is not a list"),
        "{}",
        output_text(&failed)
    );
    assert_eq!(std::fs::read_to_string(&out).expect("read"), odd);
}

#[test]
fn a_key_uri_with_a_pin_value_is_refused_not_silently_stripped() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    let uri = id
        .key_uri
        .split("&pin-source")
        .next()
        .expect("uri")
        .to_string()
        + "&pin-value=1234";
    let failed = run_fail(&mut kubeconfig_cmd(
        &id,
        &upstream,
        &uri,
        &out,
        &dir.path().join("state"),
    ));
    let text = output_text(&failed);
    assert!(
        text.contains("pin-value") && text.contains("pin-source=file:"),
        "{text}"
    );
    assert!(!text.contains("1234"), "{text}");
    assert!(!out.exists(), "a kubeconfig was written");
}

/// Issue 23: the cluster extension is one typed value, so a setting that cannot work is refused
/// when the kubeconfig is written, not carried along as text for the first kubectl call to trip
/// over (the old generator wrote any `--idle-exit` text into the file, and the plugin's proxy
/// then refused to start).
#[test]
fn an_idle_exit_that_is_no_duration_is_refused_and_nothing_is_written() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    let failed = run_fail(
        kubeconfig_cmd(&id, &upstream, &id.key_uri, &out, &dir.path().join("state"))
            .args(["--idle-exit", "half an hour"]),
    );
    let text = output_text(&failed);
    assert!(
        text.contains("half an hour") && text.contains("30s, 10m"),
        "the error names the value and the syntax: {text}"
    );
    assert!(!out.exists(), "a kubeconfig was written");

    // A duration is written in the duration syntax the plugin reads back.
    run_ok(
        kubeconfig_cmd(&id, &upstream, &id.key_uri, &out, &dir.path().join("state"))
            .args(["--idle-exit", "90m"]),
    );
    let written = std::fs::read_to_string(&out).expect("read");
    assert!(written.contains("idleExit: 1h 30m"), "{written}");
}

/// Replacing the user's own entry for the cluster (which names the API server, and perhaps a
/// forward proxy): the proxy gets a loopback port of its own, not the API server's (found with
/// the forward-proxy tests: the proxy then could not listen, "Address already in use"), and
/// the entry's `proxy-url` moves into the hwkey extension, since client-go would send even
/// loopback through it. Regenerating keeps both.
#[test]
fn a_users_own_entry_lends_its_proxy_url_but_not_its_port() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    let own = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: hw\n  cluster:\n    server: {}\n    proxy-url: socks5://127.0.0.1:1080\ncontexts: []\nusers: []\n",
        upstream.url()
    );
    std::fs::write(&out, own).expect("write");
    let state = dir.path().join("state");
    let read = || -> serde_yaml_ng::Value {
        serde_yaml_ng::from_str(&std::fs::read_to_string(&out).expect("read")).expect("YAML")
    };
    for round in 0..2 {
        run_ok(&mut kubeconfig_cmd(
            &id,
            &upstream,
            &id.key_uri,
            &out,
            &state,
        ));
        let doc = read();
        let cluster = &doc["clusters"][0]["cluster"];
        let server = cluster["server"].as_str().expect("server");
        assert_ne!(
            server.rsplit(':').next(),
            Some(upstream.port().to_string().as_str()),
            "round {round}: the proxy was given the API server's port"
        );
        assert!(cluster.get("proxy-url").is_none(), "round {round}");
        assert_eq!(
            cluster["extensions"][0]["extension"]["upstreamProxy"], "socks5://127.0.0.1:1080",
            "round {round}"
        );
    }
}

/// Two of one name: a kubeconfig holding two cluster (and user) entries named like the one
/// hwkey writes. kubectl refuses such a file ("duplicate name in list"), and the old merge
/// replaced only the first, leaving the file unusable; now one entry of each name remains,
/// hwkey's, and kubectl reads the file.
#[test]
fn two_entries_of_one_name_become_one_that_kubectl_reads() {
    support::kubectl::require_kubectl();
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    std::fs::write(
        &out,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: hw\n  cluster:\n    server: https://127.0.0.1:1\n- name: other\n  cluster:\n    server: https://example.invalid:6443\n- name: hw\n  cluster:\n    server: https://127.0.0.1:2\nusers:\n- name: hw\n  user: {}\n- name: hw\n  user: {}\ncontexts: []\n",
    )
    .expect("write");
    run_ok(&mut kubeconfig_cmd(
        &id,
        &upstream,
        &id.key_uri,
        &out,
        &dir.path().join("state"),
    ));
    let doc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&out).expect("read")).expect("YAML");
    let names = |list: &str| -> Vec<String> {
        doc[list]
            .as_sequence()
            .expect("list")
            .iter()
            .map(|e| e["name"].as_str().unwrap_or_default().to_string())
            .collect()
    };
    assert_eq!(names("clusters"), ["hw", "other"]);
    assert_eq!(names("users"), ["hw"]);
    let view = run_ok(
        std::process::Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(&out)
            .args(["config", "view", "--minify", "--context", "hw", "-o"])
            .arg("jsonpath={.clusters[0].cluster.server}"),
    );
    assert!(
        output_text(&view).starts_with("https://127.0.0.1:"),
        "{}",
        output_text(&view)
    );
    assert!(doc["clusters"][0]["cluster"]["extensions"][0]["name"] == "hwkey/settings");
}

/// Eight `hwkey kubeconfig` runs at once into one file, each adding its own name: every entry
/// is there afterwards. Each run read the file, merged and replaced it; without a lock, a run
/// that read before another's rename wrote its own view back and the other's entries were lost.
#[test]
fn eight_writers_at_once_lose_no_entry() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    let state = dir.path().join("state");
    // The loopback CA exists before the race: the race under test is the kubeconfig's.
    run_ok(&mut kubeconfig_cmd(
        &id,
        &upstream,
        &id.key_uri,
        &out,
        &state,
    ));
    for round in 0..3 {
        let names: Vec<String> = (0..8).map(|i| format!("r{round}-w{i}")).collect();
        let children: Vec<_> = names
            .iter()
            .map(|name| {
                let mut cmd = kubeconfig_cmd_named(name, &id, &upstream, &id.key_uri, &out, &state);
                cmd.stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped());
                cmd.spawn().expect("spawn hwkey kubeconfig")
            })
            .collect();
        for child in children {
            let done = child.wait_with_output().expect("wait");
            assert!(
                done.status.success(),
                "{}",
                String::from_utf8_lossy(&done.stderr)
            );
        }
        let doc: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(&out).expect("read")).expect("YAML");
        for list in ["clusters", "users", "contexts"] {
            let have: Vec<&str> = doc[list]
                .as_sequence()
                .expect("list")
                .iter()
                .filter_map(|e| e["name"].as_str())
                .collect();
            for name in &names {
                assert!(
                    have.contains(&name.as_str()),
                    "round {round}: {list} lost {name}: {have:?}"
                );
            }
        }
        assert!(
            !dir.path().join("config.lock").exists(),
            "the lock was left behind"
        );
    }
}

/// The lock is kubectl's own (`<kubeconfig>.lock`, as real kubectl shows by refusing to write
/// beside it): hwkey waits for it, writes once it is gone, and when it stays, fails naming the
/// lock and how to clear it, leaving the kubeconfig and the lock as they were.
#[test]
fn kubectls_lock_is_waited_for_and_one_that_stays_is_named() {
    support::kubectl::require_kubectl();
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    let lock = dir.path().join("config.lock");
    std::fs::write(&out, OTHER).expect("write");
    std::fs::write(&lock, "").expect("lock");
    let kubectl = std::process::Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(&out)
        .args([
            "config",
            "set-cluster",
            "x",
            "--server",
            "https://x.invalid",
        ])
        .output()
        .expect("kubectl");
    assert!(
        !kubectl.status.success()
            && String::from_utf8_lossy(&kubectl.stderr).contains("config.lock"),
        "kubectl does not take the lock hwkey takes: {}",
        String::from_utf8_lossy(&kubectl.stderr)
    );

    let state = dir.path().join("state");
    let failed = run_fail(&mut kubeconfig_cmd(
        &id,
        &upstream,
        &id.key_uri,
        &out,
        &state,
    ));
    let text = output_text(&failed);
    assert!(
        text.contains(&lock.display().to_string()) && text.contains("remove"),
        "{text}"
    );
    assert_eq!(std::fs::read_to_string(&out).expect("read"), OTHER);
    assert!(lock.exists(), "hwkey broke a lock it did not take");

    // Released while hwkey waits: it goes on and writes.
    let mut cmd = kubeconfig_cmd(&id, &upstream, &id.key_uri, &out, &state);
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    std::thread::sleep(std::time::Duration::from_millis(300));
    std::fs::remove_file(&lock).expect("release");
    let done = child.wait_with_output().expect("wait");
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    let written = std::fs::read_to_string(&out).expect("read");
    assert!(
        written.contains("name: hw") && written.contains("name: other"),
        "{written}"
    );
    assert!(!lock.exists());
}

/// `--name` also names the default state directory (`~/.kube/cache/hwkey/NAME`): a name of
/// `..` parts or an absolute one put the proxy's state, loopback CA key included, wherever it
/// pointed (as root with `--for kubelet`, into any root-owned directory). Such names are
/// refused before anything is written; a name with slashes inside (an EKS ARN) still works.
#[test]
fn a_name_that_leaves_the_state_directory_is_refused() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let home = dir.path().join("home");
    std::fs::create_dir(&home).expect("home");
    let out = dir.path().join("config");
    for name in ["../../../escaped", "/abs", "a/./b", "", ".."] {
        let mut cmd = kubeconfig_base(name, &id, &upstream, &id.key_uri);
        cmd.env("HOME", &home)
            .env_remove("KUBECONFIG")
            .arg("--out")
            .arg(&out);
        let failed = run_fail(&mut cmd);
        let text = output_text(&failed);
        assert!(
            text.contains("--name") && text.contains("state directory"),
            "{name}: {text}"
        );
    }
    assert!(!out.exists(), "a kubeconfig was written");
    assert!(
        !dir.path().join("escaped").exists(),
        "state outside its directory"
    );
    assert!(
        !home.join(".kube").exists(),
        "state was created for a refused name"
    );
    let arn = "arn:aws:eks:eu-west-1:1:cluster/prod";
    let mut cmd = kubeconfig_base(arn, &id, &upstream, &id.key_uri);
    cmd.env("HOME", &home)
        .env_remove("KUBECONFIG")
        .arg("--out")
        .arg(&out);
    run_ok(&mut cmd);
    assert!(home
        .join(".kube/cache/hwkey/arn:aws:eks:eu-west-1:1:cluster/prod/loopback-ca.pem")
        .exists());
}

/// A FIFO given as `--out` was opened to be read and waited for a writer for good (holding the
/// kubeconfig lock, now). It is refused at once, saying what it is, and left as it was.
#[test]
fn a_fifo_as_the_kubeconfig_is_refused_at_once() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    rustix::fs::mkfifoat(
        rustix::fs::CWD,
        &out,
        rustix::fs::Mode::from_raw_mode(0o600),
    )
    .expect("mkfifo");
    let failed = run_fail_within(
        &mut kubeconfig_cmd(&id, &upstream, &id.key_uri, &out, &dir.path().join("state")),
        std::time::Duration::from_secs(20),
    );
    let text = output_text(&failed);
    assert!(
        text.contains(&out.display().to_string()) && text.contains("not a regular file"),
        "{text}"
    );
    assert!(std::fs::symlink_metadata(&out)
        .expect("lstat")
        .file_type()
        .is_fifo());
    assert!(
        !dir.path().join("config.lock").exists(),
        "the lock was left behind"
    );
}

/// The `stateDir` the plugin reads from the kubeconfig.
fn state_dir_in(kubeconfig: &Path, name: &str) -> String {
    let doc: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(kubeconfig).expect("read")).expect("YAML");
    let cluster = doc["clusters"]
        .as_sequence()
        .expect("clusters")
        .iter()
        .find(|c| c["name"].as_str() == Some(name))
        .expect("the cluster entry");
    cluster["cluster"]["extensions"][0]["extension"]["stateDir"]
        .as_str()
        .expect("stateDir")
        .to_string()
}

/// A relative `--state-dir` went into the kubeconfig as given: the plugin, run from wherever
/// kubectl is, made a new state directory (and loopback CA, and proxy) in each place, and kubectl
/// failed on a CA it did not pin. It is written absolute now.
#[test]
fn a_relative_state_directory_is_written_absolute() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    let mut cmd = kubeconfig_cmd(&id, &upstream, &id.key_uri, &out, Path::new("st"));
    cmd.current_dir(dir.path());
    run_ok(&mut cmd);
    assert_eq!(
        state_dir_in(&out, "hw"),
        dir.path().join("st").display().to_string()
    );
}

/// A state directory whose control socket path is longer than a UNIX socket's can be (a long
/// `--name` under the default directory) made a kubeconfig that could never work: every
/// kubectl run failed binding the socket. Refused now, nothing written.
#[test]
fn a_state_directory_too_long_for_its_socket_is_refused() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    let state = dir.path().join("s".repeat(110));
    let failed = run_fail(&mut kubeconfig_cmd(
        &id,
        &upstream,
        &id.key_uri,
        &out,
        &state,
    ));
    let text = output_text(&failed);
    assert!(
        text.contains("longer than a UNIX socket path") && text.contains("--state-dir"),
        "{text}"
    );
    assert!(!out.exists() && !state.exists(), "something was written");
}

/// `KUBECONFIG=:FILE` (or set to nothing): client-go skips the empty entry, hwkey took it as the
/// file to write (creating `.lock` in the working directory, then failing with an empty path).
/// Now the first named file is written, as kubectl would read it.
#[test]
fn an_empty_kubeconfig_entry_is_skipped_as_kubectl_does() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work");
    let file = dir.path().join("config");
    let mut cmd = kubeconfig_base("hw", &id, &upstream, &id.key_uri);
    cmd.current_dir(&work)
        .env("KUBECONFIG", format!(":{}", file.display()))
        .arg("--state-dir")
        .arg(dir.path().join("state"));
    run_ok(&mut cmd);
    assert!(std::fs::read_to_string(&file)
        .expect("the named file")
        .contains("name: hw"));
    assert_eq!(
        std::fs::read_dir(&work).expect("work").count(),
        0,
        "files were made in the working directory"
    );
}

/// A kubeconfig larger than any real one (64 MiB of nothing, sparse) is refused without being
/// read into memory under the lock, and left as it was.
#[test]
fn a_huge_kubeconfig_is_refused_unread() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let dir = temp_dir();
    let out = dir.path().join("config");
    let f = std::fs::File::create(&out).expect("create");
    f.set_len((64 << 20) + 1).expect("truncate");
    drop(f);
    let failed = run_fail(&mut kubeconfig_cmd(
        &id,
        &upstream,
        &id.key_uri,
        &out,
        &dir.path().join("state"),
    ));
    let text = output_text(&failed);
    assert!(text.contains("longer than 64 MiB"), "{text}");
    assert_eq!(std::fs::metadata(&out).expect("stat").len(), (64 << 20) + 1);
    assert!(!dir.path().join("config.lock").exists());
}
