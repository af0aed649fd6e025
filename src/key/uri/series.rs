//! The names of a rotation series (`hwkey proxy --rotate-key`), shared by each backend's URI: a
//! series key is the configured key's label or file name with a `-r<unix time>` suffix.

use std::path::Path;

/// `name` with a fresh `-r<stamp>` suffix in place of any previous one.
pub(super) fn next_name(name: &str, stamp: u64) -> String {
    format!("{}-r{stamp}", base(name))
}

/// `name` without a `-r<digits>` suffix.
fn base(name: &str) -> &str {
    match name.rsplit_once("-r") {
        Some((b, n)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => b,
        _ => name,
    }
}

/// Whether `name` is `configured`'s base name, with or without a `-r<digits>` suffix.
pub(super) fn named_in(configured: &str, name: &str) -> bool {
    base(name) == base(configured)
}

/// A TPM key file's name without `.tpm.pem` / `.pem`.
pub(super) fn stem(path: &Path) -> &str {
    let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("key");
    file.strip_suffix(".tpm.pem")
        .or_else(|| file.strip_suffix(".pem"))
        .unwrap_or(file)
}
