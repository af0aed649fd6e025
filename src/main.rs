//! The `hwkey` binary: parse arguments, run, map errors to an exit code.

fn main() -> std::process::ExitCode {
    hwkey::cli::main()
}
