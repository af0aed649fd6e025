//! PKCS#11 modules as hosts register them (issue 24, item 4): `module-name=` resolved through
//! p11-kit's module registry (the `.module` files `p11-kit list-modules` reads), p11-kit's proxy
//! module when a URI names no module, and the RFC 7512 token attributes `manufacturer` and
//! `model` selecting tokens. Against the real SoftHSM, p11-kit and its proxy module.

use std::process::Command;

use support::flow::Flow;
use support::{output_text, require_tool, run_fail, run_ok, temp_dir, SoftHsm, SOFTHSM_MODULE};

/// A URI for `object` on token `token` with `query` instead of a module path.
fn uri(hsm: &SoftHsm, token: &str, object: &str, query: &str) -> String {
    let with_path = hsm.key_uri(token, object);
    let (head, rest) = with_path.split_once('?').expect("a query");
    let pin = rest
        .split('&')
        .find(|p| p.starts_with("pin-source="))
        .expect("a pin source");
    if query.is_empty() {
        format!("{head}?{pin}")
    } else {
        format!("{head}?{query}&{pin}")
    }
}

/// `hwkey` with the token's environment, no `HWKEY_PKCS11_MODULE`, and `home` as the user's
/// home (where p11-kit's per-user module files live).
fn hwkey_at(flow: &Flow, home: &std::path::Path) -> Command {
    let mut cmd = flow.hwkey();
    cmd.env_remove("HWKEY_PKCS11_MODULE")
        .env_remove("XDG_CONFIG_HOME")
        .env("HOME", home);
    cmd
}

#[test]
fn module_name_softhsm2_works_with_no_module_path() {
    let hsm = SoftHsm::new();
    hsm.init_token("named");
    let flow = Flow::new(hsm.envs());
    let home = temp_dir();
    // The package's registration, as p11-kit itself lists it.
    require_tool("p11-kit", "p11-kit");
    let listed = run_ok(
        Command::new("p11-kit")
            .arg("list-modules")
            .env("HOME", home.path()),
    );
    assert!(
        output_text(&listed).contains("softhsm2:"),
        "{}",
        output_text(&listed)
    );
    let key = uri(&hsm, "named", "alice", "module-name=softhsm2");
    // create → CSR that openssl verifies → certificate → probe against s_server and nginx.
    let created = run_ok(hwkey_at(&flow, home.path()).args(["key", "create", "--key", &key]));
    assert!(output_text(&created).contains("BEGIN PUBLIC KEY"));
    flow.certify(&key, "alice");
    let info = run_ok(hwkey_at(&flow, home.path()).args(["key", "info", "--key", &key]));
    assert!(
        output_text(&info).contains("module-name=softhsm2"),
        "the URI keeps the name, not a path: {}",
        output_text(&info)
    );
}

/// A root service must not load a library a file in a home directory names: like p11-kit
/// ("skipping user config in program running as root"), hwkey reads no user module files as
/// root. (The tests run as root; the order of the directories is a unit test of `p11kit`.)
#[test]
fn as_root_a_module_file_in_home_is_not_read_as_p11_kit_does_not() {
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "this test needs root: it checks what root refuses to load"
    );
    let hsm = SoftHsm::new();
    hsm.init_token("mine");
    let flow = Flow::new(hsm.envs());
    let home = temp_dir();
    let dir = home.path().join(".config/pkcs11/modules");
    std::fs::create_dir_all(&dir).expect("mkdir");
    std::fs::write(
        dir.join("my-hsm.module"),
        format!("# planted in a home directory\nmodule: {SOFTHSM_MODULE}\n"),
    )
    .expect("write module file");
    require_tool("p11-kit", "p11-kit");
    let listed = run_ok(
        Command::new("p11-kit")
            .arg("list-modules")
            .env("HOME", home.path())
            .envs(hsm.envs()),
    );
    assert!(
        !output_text(&listed).contains("my-hsm:"),
        "p11-kit as root reads no user module files: {}",
        output_text(&listed)
    );
    let key = uri(&hsm, "mine", "k", "module-name=my-hsm");
    let refused = run_fail(hwkey_at(&flow, home.path()).args(["key", "create", "--key", &key]));
    let text = output_text(&refused);
    assert!(
        text.contains("my-hsm") && text.contains("as root"),
        "the message says why the file was not read: {text}"
    );
    // Nothing was created on the token through another module.
    let listed = run_ok(
        flow.hwkey()
            .args(["key", "list", "--key", &hsm.key_uri("mine", "k")]),
    );
    assert!(
        !output_text(&listed).contains("object=k"),
        "{}",
        output_text(&listed)
    );
}

#[test]
fn an_unknown_module_name_names_the_registered_ones() {
    let hsm = SoftHsm::new();
    hsm.init_token("t");
    let flow = Flow::new(hsm.envs());
    let home = temp_dir();
    let key = uri(&hsm, "t", "k", "module-name=no-such-hsm");
    let failed = run_fail(hwkey_at(&flow, home.path()).args(["key", "create", "--key", &key]));
    let text = output_text(&failed);
    assert!(
        text.contains("no-such-hsm")
            && text.contains("softhsm2")
            && text.contains("/usr/share/p11-kit/modules"),
        "{text}"
    );
    // A path is not a name.
    let failed = run_fail(hwkey_at(&flow, home.path()).args([
        "key",
        "create",
        "--key",
        &uri(
            &hsm,
            "t",
            "k",
            "module-name=/usr/lib/softhsm/libsofthsm2.so",
        ),
    ]));
    assert!(
        output_text(&failed).contains("module-path"),
        "{}",
        output_text(&failed)
    );
}

#[test]
fn a_uri_without_a_module_uses_p11_kits_proxy_module() {
    assert!(
        std::path::Path::new("/usr/lib/x86_64-linux-gnu/p11-kit-proxy.so").is_file(),
        "p11-kit's proxy module is missing: apt-get install p11-kit-modules"
    );
    let hsm = SoftHsm::new();
    hsm.init_token("proxied");
    let flow = Flow::new(hsm.envs());
    let home = temp_dir();
    let key = uri(&hsm, "proxied", "k", "");
    let created = run_ok(hwkey_at(&flow, home.path()).args(["key", "create", "--key", &key]));
    assert!(output_text(&created).contains("BEGIN PUBLIC KEY"));
    flow.certify(&key, "proxied");
}

#[test]
fn manufacturer_and_model_select_tokens_and_two_fitting_tokens_are_refused() {
    let hsm = SoftHsm::new();
    hsm.init_token("twin");
    hsm.init_token("twin");
    hsm.init_token("single");
    let flow = Flow::new(hsm.envs());
    let home = temp_dir();
    let base = |token: &str, attrs: &str| {
        let with_path = hsm.key_uri(token, "k");
        let (head, query) = with_path.split_once('?').expect("query");
        format!("{head};{attrs}?{query}")
    };
    // SoftHSM's own manufacturer and model select its token.
    let right = base(
        "single",
        "manufacturer=SoftHSM%20project;model=SoftHSM%20v2",
    );
    run_ok(hwkey_at(&flow, home.path()).args(["key", "create", "--key", &right]));
    // Another manufacturer: no such token, nothing created.
    let wrong = base("single", "manufacturer=Yubico");
    let failed = run_fail(hwkey_at(&flow, home.path()).args(["key", "info", "--key", &wrong]));
    assert!(
        output_text(&failed).contains("not found"),
        "{}",
        output_text(&failed)
    );
    // Two tokens labelled "twin": which one signs must not depend on slot order.
    let twin = base("twin", "model=SoftHSM%20v2");
    let failed = run_fail(hwkey_at(&flow, home.path()).args(["key", "create", "--key", &twin]));
    let text = output_text(&failed);
    assert!(
        text.contains("2 tokens") && text.contains("serial="),
        "{text}"
    );
}
