//! Issue 36, item 3: the README's first command (`hsm-fixtures/demo.sh`) ends with kubectl's
//! real answer through the proxy, from an upstream that speaks what an API server speaks
//! (HTTP/2 with required client certificates), and fails when that step fails. Before, its
//! last step printed `Error from server (ServiceUnavailable) … did not agree to protocol 'h2'`
//! (openssl s_server speaks no HTTP/2) and an `|| true` hid it. The demo runs here with this
//! build, so it cannot rot again.

use support::kubectl::require_kubectl;
use support::{hwkey_bin, output_text, run_ok};

#[test]
fn the_readme_demo_ends_with_kubectls_answer_over_http2() {
    require_kubectl();
    let demo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("hsm-fixtures/demo.sh");
    let out = run_ok(std::process::Command::new(demo).env("HWKEY_BIN", hwkey_bin()));
    let text = output_text(&out);
    let answer = text
        .lines()
        .rfind(|l| l.starts_with("{\"gitVersion\""))
        .unwrap_or_else(|| panic!("no answer from the API server stand-in:\n{text}"));
    assert!(
        answer.contains("CN=alice") && answer.contains("\"http\":\"HTTP/2.0\""),
        "kubectl's answer: {answer}\n{text}"
    );
    assert!(
        text.contains("done: the private key never left the token"),
        "{text}"
    );
}
