//! The `hwkey` binary: parse arguments, run, map errors to an exit code.

fn main() -> std::process::ExitCode {
    // libtss2 prints its own ERROR lines to stderr (e.g. while hwkey recovers a TPM key after a
    // reset); hwkey reports failures itself, so silence it unless the user asked for its logs.
    // Set before any thread exists.
    if std::env::var_os("TSS2_LOG").is_none() {
        std::env::set_var("TSS2_LOG", "all+none");
    }
    hwkey::cli::main()
}
