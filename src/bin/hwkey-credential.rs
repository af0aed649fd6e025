//! `hwkey-credential`: the client-go exec plugin alone (see `hwkey::cli::credential_main`).

fn main() -> std::process::ExitCode {
    hwkey::cli::credential_main()
}
