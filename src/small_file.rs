//! Reading the small files hwkey is pointed at (certificates, CA bundles, config files) with a
//! size bound: a path such as `/dev/zero` or a runaway file must fail with a clear error, not
//! read until memory runs out.

use std::io::Read;
use std::path::Path;

/// The largest certificate chain, CA bundle or config file hwkey reads: far above any real one
/// (a CA bundle of every public root is about 250 KiB).
pub const MAX_SMALL_FILE: u64 = 4 * 1024 * 1024;

/// Reads `path` whole, failing with `InvalidData` when it is longer than [`MAX_SMALL_FILE`].
pub fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    let file = std::fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(MAX_SMALL_FILE + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_SMALL_FILE {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "longer than {} MiB: not a certificate, CA bundle or config file",
                MAX_SMALL_FILE / (1024 * 1024)
            ),
        ));
    }
    Ok(bytes)
}

/// [`read`] as UTF-8 text.
pub fn read_to_string(path: &Path) -> std::io::Result<String> {
    String::from_utf8(read(path)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_file_is_refused() {
        let e = read(Path::new("/dev/zero")).expect_err("/dev/zero never ends");
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("longer than 4 MiB"), "{e}");
    }
}
