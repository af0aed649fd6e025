//! What a packaged hwkey carries besides the binary (issue 26): `--version` with the build
//! facts, man pages generated from the clap definitions (every flag of `hwkey proxy --help` is
//! in `man hwkey-proxy`), and shell completions bash can source.

use std::process::Command;

use support::flow::stdout;
use support::{hwkey, output_text, require_tool, run_ok, temp_dir};

#[test]
fn version_names_the_commit_the_backends_and_the_tls_provider() {
    let text = stdout(&run_ok(hwkey().arg("--version")));
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some(concat!("hwkey ", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    let commit = lines
        .next()
        .and_then(|l| l.strip_prefix("commit: "))
        .unwrap_or_else(|| panic!("no commit line: {text}"));
    let hash = commit.trim_end_matches("-dirty");
    assert!(
        hash.len() == 12 && hash.chars().all(|c| c.is_ascii_hexdigit()),
        "built from this checkout, so the commit is known: {commit}"
    );
    assert!(
        text.contains("backends: pkcs11 (cryptoki), tpm (tss-esapi)"),
        "{text}"
    );
    assert!(
        text.contains("TLS: rustls") && text.contains("X25519MLKEM768"),
        "{text}"
    );
}

#[test]
fn man_hwkey_proxy_documents_every_flag_of_its_help() {
    require_tool("man", "man-db");
    let dir = temp_dir();
    run_ok(hwkey().args(["man", "--out"]).arg(dir.path()));
    for page in [
        "hwkey.1",
        "hwkey-proxy.1",
        "hwkey-key-create.1",
        "hwkey-attest-enroll.1",
    ] {
        assert!(dir.path().join(page).is_file(), "{page} is missing");
    }
    // The page as `man` shows it.
    let shown = run_ok(
        Command::new("man")
            .env("MANWIDTH", "200")
            .args(["-P", "cat", "-l"])
            .arg(dir.path().join("hwkey-proxy.1")),
    );
    let page = output_text(&shown);
    let help = stdout(&run_ok(hwkey().args(["proxy", "--help"])));
    let flags: Vec<&str> = help
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(|w| w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric() && c != '-'))
        .filter(|w| w.len() > 2)
        .collect();
    assert!(flags.len() > 20, "too few flags in --help: {flags:?}");
    // man renders hyphens as U+2010 in some locales: compare on plain hyphens.
    let page = page.replace(['\u{2010}', '\u{2212}'], "-");
    for flag in flags {
        assert!(
            page.contains(flag),
            "man hwkey-proxy does not document {flag}"
        );
    }
}

#[test]
fn bash_sources_the_completion_script() {
    let dir = temp_dir();
    let script = dir.path().join("hwkey.bash");
    let out = run_ok(hwkey().args(["completions", "bash"]));
    std::fs::write(&script, &out.stdout).expect("write");
    let check = run_ok(
        Command::new("bash")
            .arg("-c")
            .arg(format!("source {} && complete -p hwkey", script.display())),
    );
    assert!(
        output_text(&check).contains("hwkey"),
        "{}",
        output_text(&check)
    );
    for shell in ["zsh", "fish"] {
        let out = run_ok(hwkey().args(["completions", shell]));
        assert!(stdout(&out).contains("proxy"), "{shell}: {}", stdout(&out));
    }
}
