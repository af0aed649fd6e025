//! SoftHSM with a smart card's session limit: `hsm-fixtures/session-limit.c` built with gcc
//! into a test's directory (a pass-through module like pkcs11-spy; SoftHSM does the signing).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::run_ok;

/// A built session-limited module and the log of its `C_OpenSession` calls.
pub struct LimitedModule {
    pub module: PathBuf,
    pub log: PathBuf,
}

impl LimitedModule {
    /// Builds DIR/limit-N.so allowing `limit` sessions at once; `report` says whether
    /// `C_GetTokenInfo` tells that limit (`ulMaxSessionCount`) or says "effectively infinite".
    pub fn build(dir: &Path, limit: u32, report: bool) -> LimitedModule {
        Self::build_with(dir, limit, report, 0)
    }

    /// A module (64 sessions) whose first `hidden` listings of slots with a token find none, as
    /// SoftHSM finds none when another process rewrites the token's file during its
    /// `C_Initialize`.
    pub fn hiding_first_listings(dir: &Path, hidden: u32) -> LimitedModule {
        Self::build_with(dir, 64, true, hidden)
    }

    fn build_with(dir: &Path, limit: u32, report: bool, hidden: u32) -> LimitedModule {
        crate::require_tool("gcc", "build-essential");
        assert!(
            Path::new("/usr/include/p11-kit-1/p11-kit/pkcs11.h").exists(),
            "pkcs11.h is missing: apt-get install libp11-kit-dev"
        );
        let source = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../hsm-fixtures/session-limit.c"
        );
        let name = format!("limit-{limit}-{}-{hidden}", u8::from(report));
        let module = dir.join(format!("{name}.so"));
        let log = dir.join(format!("{name}.log"));
        run_ok(
            Command::new("gcc")
                .args([
                    "-shared",
                    "-fPIC",
                    "-Wall",
                    "-Werror",
                    "-I/usr/include/p11-kit-1",
                ])
                .arg(format!("-DLIMIT_SESSIONS={limit}"))
                .arg(format!("-DLIMIT_REPORT={}", u8::from(report)))
                .arg(format!("-DLIMIT_LOG=\"{}\"", log.display()))
                .args((hidden > 0).then(|| format!("-DHIDE_LISTINGS={hidden}")))
                .arg("-o")
                .arg(&module)
                .arg(source)
                .args(["-ldl", "-lpthread"]),
        );
        LimitedModule { module, log }
    }

    /// (sessions open at most at once, `CKR_SESSION_COUNT` answers given).
    pub fn counts(&self) -> (u32, usize) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let peak = text
            .lines()
            .filter_map(|l| l.strip_prefix("open "))
            .filter_map(|n| n.parse().ok())
            .max()
            .unwrap_or(0);
        (peak, text.lines().filter(|l| *l == "refused").count())
    }
}
