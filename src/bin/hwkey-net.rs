//! `hwkey-net`: the proxy's network side (see `hwkey::cli::net_main`). `hwkey proxy` starts the
//! signer side and then runs this in its place; it links no PKCS#11 or TSS code.

fn main() -> std::process::ExitCode {
    hwkey::cli::net_main()
}
