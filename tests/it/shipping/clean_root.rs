//! The Debian package as an operator installs it (issue 26): `hsm-fixtures/package.sh`'s `.deb`
//! goes into a minimal Debian 12 root (mmdebstrap, cached per machine by
//! `hsm-fixtures/clean-root.sh`) that has no Rust toolchain and no `-dev` package, with its
//! dependencies resolved by apt. Inside that root (a chroot in its own mount and pid
//! namespaces): `hwkey --version`, `man hwkey`, the bash completion, and the main job: a SoftHSM
//! token made on the spot, a key, a CSR that `openssl req -verify` accepts, and `hwkey probe`
//! against an `openssl s_server` that requires a client certificate. Anything the binaries need
//! that the package does not declare fails here, because nothing of the build machine is there.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use support::{output_text, require_tool, run_ok, temp_dir};

/// The package `hsm-fixtures/package.sh` built from this checkout.
fn built_package() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/package");
    let deb = dir.join(format!(
        "hwkey_{}-1_{}.deb",
        env!("CARGO_PKG_VERSION"),
        dpkg_architecture()
    ));
    assert!(
        deb.is_file(),
        "{} is missing: build it with hsm-fixtures/package.sh (hsm-fixtures/test.sh does)",
        deb.display()
    );
    deb
}

fn dpkg_architecture() -> String {
    let out = run_ok(Command::new("dpkg").arg("--print-architecture"));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The commit line of `hwkey --version` of this test build, which the packaged binary must
/// share (a package left over from another commit would test the wrong code).
fn this_commit() -> String {
    let out = run_ok(support::hwkey().arg("--version"));
    commit_line(&String::from_utf8_lossy(&out.stdout))
}

/// The commit `--version` names, without `-dirty` (a build script reruns only when git's index
/// changes, so two builds of one work tree may disagree on it).
fn commit_line(version: &str) -> String {
    version
        .lines()
        .find(|l| l.starts_with("commit: "))
        .unwrap_or_else(|| panic!("no commit line in --version: {version}"))
        .trim_end_matches("-dirty")
        .to_string()
}

/// A Debian 12 root unpacked from the cached tarball; removed with the TempDir.
struct CleanRoot {
    dir: tempfile::TempDir,
}

impl CleanRoot {
    fn unpack() -> CleanRoot {
        require_tool("mmdebstrap", "mmdebstrap");
        require_tool("unshare", "util-linux");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("hsm-fixtures/clean-root.sh");
        let tar = run_ok(&mut Command::new(script));
        let tar = String::from_utf8_lossy(&tar.stdout).trim().to_string();
        let dir = temp_dir();
        run_ok(
            Command::new("tar")
                .args(["-x", "--numeric-owner", "-f", &tar, "-C"])
                .arg(dir.path()),
        );
        // Name resolution for apt, as a fresh machine has it.
        std::fs::copy("/etc/resolv.conf", dir.path().join("etc/resolv.conf"))
            .expect("copy resolv.conf");
        CleanRoot { dir }
    }

    fn path(&self, inside: &str) -> PathBuf {
        self.dir.path().join(inside.trim_start_matches('/'))
    }

    /// Runs `script` with bash inside the root (chroot), in new mount and pid namespaces with
    /// its own /proc, so nothing it mounts or starts outlives it.
    fn run(&self, script: &str) -> Output {
        Command::new("unshare")
            .args(["--mount", "--pid", "--fork"])
            .arg(format!("--mount-proc={}", self.path("proc").display()))
            .arg("chroot")
            .arg(self.dir.path())
            .args(["/usr/bin/env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"])
            .args([
                "HOME=/root",
                "LANG=C.UTF-8",
                "DEBIAN_FRONTEND=noninteractive",
            ])
            .args(["/bin/bash", "-euo", "pipefail", "-c", script])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run unshare + chroot")
    }

    fn run_ok(&self, what: &str, script: &str) -> String {
        let out = self.run(script);
        assert!(
            out.status.success(),
            "{what} failed in the clean root ({}):\n{}",
            out.status,
            output_text(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Acceptance (issue 26): the package installs into a clean Debian 12 root and the main job
/// succeeds there.
#[test]
fn the_package_installs_into_a_clean_debian_root_and_the_main_job_runs_there() {
    let deb = built_package();
    let root = CleanRoot::unpack();

    // Clean: no Rust toolchain, no -dev package, no hwkey.
    let before = root.run_ok(
        "listing packages",
        "for c in cargo rustc cc hwkey; do command -v $c || true; done; \
         dpkg-query -W -f '${Package}\\n' | grep -E -- '-dev(:|$)' || true",
    );
    assert!(before.trim().is_empty(), "the root is not clean: {before}");

    // The package, with the dependencies apt resolves from its control file, and nothing else.
    std::fs::copy(&deb, root.path("/tmp/hwkey.deb")).expect("copy the package");
    root.run_ok(
        "apt-get install ./hwkey.deb",
        "apt-get -q update >/dev/null && \
         apt-get -q install -y --no-install-recommends /tmp/hwkey.deb >/dev/null",
    );
    let version = root.run_ok(
        "hwkey --version",
        "hwkey --version && hwkey-credential --help >/dev/null",
    );
    assert!(
        version.starts_with(&format!("hwkey {}\n", env!("CARGO_PKG_VERSION"))),
        "{version}"
    );
    assert_eq!(
        commit_line(&version),
        this_commit(),
        "the package was built from another commit: rerun hsm-fixtures/package.sh"
    );
    // The proxy's network side links no TSS (the key is in the signer process).
    let net = root.run_ok("ldd hwkey-net", "ldd /usr/libexec/hwkey/hwkey-net");
    assert!(
        !net.contains("libtss2") && !net.contains("not found"),
        "{net}"
    );
    let linked = root.run_ok("ldd", "ldd /usr/bin/hwkey /usr/bin/hwkey-credential");
    assert!(!linked.contains("not found"), "{linked}");
    // Root's, writable by no one else: what lets root's exec plugin trust an instance directory
    // systemd gives to the unit's user; traversable by that user.
    let state = root.run_ok("stat /var/lib/hwkey", "stat -c '%a %U %G' /var/lib/hwkey");
    assert_eq!(
        state.trim(),
        "755 root root",
        "the proxy's state-dir check needs this"
    );
    // The system user the proxy unit runs as.
    let user = root.run_ok("getent passwd hwkey", "getent passwd hwkey");
    assert!(
        user.starts_with("hwkey:") && user.trim_end().ends_with(":/usr/sbin/nologin"),
        "{user}"
    );
    let files = root.run_ok("dpkg -L hwkey", "dpkg -L hwkey");
    for shipped in [
        "/usr/lib/systemd/system/hwkey-proxy@.service",
        "/usr/libexec/hwkey/hwkey-net",
        "/usr/lib/systemd/system/hwkey-approver.service",
        "/usr/share/doc/hwkey/examples/proxy.example.toml",
        "/usr/share/zsh/vendor-completions/_hwkey",
        "/usr/share/fish/vendor_completions.d/hwkey.fish",
    ] {
        assert!(
            files.lines().any(|l| l == shipped),
            "{shipped} is not shipped:\n{files}"
        );
    }

    // The tools the job uses (none of them depends on a library hwkey needs), and systemd to
    // check the units.
    root.run_ok(
        "apt-get install softhsm2 openssl man-db systemd",
        "apt-get -q install -y --no-install-recommends softhsm2 openssl man-db systemd >/dev/null",
    );
    // The units as shipped: their binary, paths and man pages exist (a template is checked
    // through an instance). systemd-analyze prints nothing when all is well.
    let verified = root.run_ok(
        "systemd-analyze verify",
        "cd /usr/lib/systemd/system && cp hwkey-proxy@.service /tmp/hwkey-proxy@kubelet.service && \
         systemd-analyze verify hwkey-approver.service /tmp/hwkey-proxy@kubelet.service 2>&1",
    );
    assert!(
        verified.trim().is_empty(),
        "systemd-analyze verify: {verified}"
    );
    check_man_and_completion(&root);
    main_job(&root);
}

/// `man hwkey` and `man hwkey-proxy` show the pages; bash sources the completion and completes
/// a subcommand.
fn check_man_and_completion(root: &CleanRoot) {
    let page = root.run_ok("man hwkey", "MANWIDTH=120 man -P cat hwkey 2>/dev/null");
    assert!(
        page.contains("hwkey-proxy(1)") && page.contains("SUBCOMMANDS"),
        "{page}"
    );
    let page = root.run_ok(
        "man hwkey-proxy",
        "MANWIDTH=120 man -P cat hwkey-proxy 2>/dev/null",
    );
    assert!(page.contains("--upstream"), "{page}");
    let completed = root.run_ok(
        "bash completion",
        "source /usr/share/bash-completion/completions/hwkey; complete -p hwkey; \
         COMP_WORDS=(hwkey pro); COMP_CWORD=1; COMP_LINE='hwkey pro'; COMP_POINT=9; \
         _hwkey hwkey pro hwkey; echo \"${COMPREPLY[@]}\"",
    );
    let mut lines = completed.lines();
    assert!(
        lines.next().is_some_and(|l| l.ends_with("-F _hwkey hwkey")),
        "{completed}"
    );
    // "pro" completes to the two subcommands that start with it.
    assert_eq!(lines.next(), Some("probe proxy"), "{completed}");
}

/// The README's main job, with the installed binary and the root's own openssl and SoftHSM.
fn main_job(root: &CleanRoot) {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dest = root.path("/opt/hwkey-test");
    for dir in ["hsm-fixtures", "softhsm-config"] {
        std::fs::create_dir_all(dest.join(dir)).expect("mkdir");
    }
    for file in [
        "hsm-fixtures/make-token.sh",
        "hsm-fixtures/test-ca.sh",
        "softhsm-config/softhsm2.conf.template",
    ] {
        std::fs::copy(fixtures.join(file), dest.join(file)).expect("copy a fixture");
    }
    // The root shares this machine's network: a free loopback port of its own.
    let port = support::free_port();
    let script = r#"cd /opt/hwkey-test
W=$(mktemp -d)
eval "$(hsm-fixtures/make-token.sh "$W/hsm" demo 2>/dev/null | tail -n 1)"
export SOFTHSM2_CONF
KEY="pkcs11:token=demo;object=alice?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:$W/hsm/pin"
hwkey key create --key "$KEY" --algorithm ec-p256 >&2
hwkey csr --key "$KEY" --subject "CN=alice,O=system:masters" --out "$W/alice.csr" >&2
openssl req -in "$W/alice.csr" -verify -noout 2>&1
hsm-fixtures/test-ca.sh "$W/ca" >/dev/null
hsm-fixtures/test-ca.sh sign "$W/ca" "$W/alice.csr" "$W/alice.crt" 1 >/dev/null
hwkey cert import --key "$KEY" --cert "$W/alice.crt" >&2
openssl s_server -accept 127.0.0.1:4433 -cert "$W/ca/server.pem" -key "$W/ca/server.key" \
  -CAfile "$W/ca/ca.pem" -Verify 1 -verify_return_error -www -tls1_3 >"$W/s_server.log" 2>&1 &
for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/4433) 2>/dev/null && break; sleep 0.1; done
hwkey probe --key "$KEY" --ca "$W/ca/ca.pem" https://127.0.0.1:4433/
kill %1
echo "issued:"; cat "$W/alice.crt"
"#
    .replace("4433", &port.to_string());
    let out = root.run_ok("the main job", &script);
    assert!(
        out.contains("verified OK") || out.contains("verify OK"),
        "{out}"
    );
    assert!(out.contains("CN=alice") || out.contains("alice"), "{out}");
}
