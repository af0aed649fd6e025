//! Build facts for `hwkey --version`: the git commit when built from a checkout (with `-dirty`
//! when the work tree has changes), else "not built from a git checkout" (a release tarball, a
//! Debian source package).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/index");
    let commit = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(c) if !c.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{c}-dirty")
            } else {
                c
            }
        }
        _ => "not built from a git checkout".to_string(),
    };
    println!("cargo:rustc-env=HWKEY_GIT_COMMIT={commit}");
    // The integration tests' binary exports its `socket` (tests/it/cloexec.rs), so that the
    // shared libraries it loads (tpm2-tss's TCTIs) open their sockets close-on-exec too.
    println!("cargo:rustc-link-arg-tests=-Wl,--export-dynamic-symbol=socket");
}
