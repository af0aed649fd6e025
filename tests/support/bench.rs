//! What hwkey's benchmark binaries share (`benches/`): the quick/full switch, order statistics, and the result
//! rows that `benches/report.rs` turns into `docs/BENCHMARKS.md`.
//!
//! Every figure is a distribution (median and p25–p75 over repetitions) measured next to its
//! baseline in the same process and the same minute, because on a shared 2-core machine an
//! absolute number means little: only the ratio to a baseline run under the same load does.

use std::path::PathBuf;

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

/// True when `HWKEY_BENCH_QUICK` is set (`hsm-fixtures/bench.sh --quick`): fewer and shorter
/// repetitions, for a run under a minute while developing.
pub fn quick() -> bool {
    std::env::var_os("HWKEY_BENCH_QUICK").is_some_and(|v| !v.is_empty() && v != "0")
}

/// True when `cargo bench` runs the binary (it passes `--bench`). `cargo test --all-targets`
/// (hsm-fixtures/test.sh) runs bench binaries too, without it: they must then do nothing, or
/// the test suite would spend a minute benchmarking and rewrite docs/BENCHMARKS.md.
///
/// A bench that runs settles the binaries it measures first ([`settle_binaries`]).
pub fn skip_unless_cargo_bench(name: &str) -> bool {
    if std::env::args().any(|a| a == "--bench") {
        settle_binaries();
        return false;
    }
    eprintln!("{name}: not run (benchmarks run under `cargo bench`; see hsm-fixtures/bench.sh)");
    true
}

/// Writes back and drops from the page cache the binaries a bench runs: `hwkey`,
/// `hwkey-credential` and `hwkey-net` of this build and of the baseline build
/// (`HWKEY_BENCH_BASELINE_BIN`). The next start reads them as an installed binary is read.
///
/// Why: a binary still in the page cache the linker wrote it through starts slower than the
/// same bytes read back from disk or copied (`cargo install`, `dpkg`, hsm-fixtures/baseline.sh):
/// `hwkey-credential` took about 240 µs more per start, 1.93 against 1.69 ms as Go's os/exec
/// starts it, with the same number of page faults (docs/BENCHMARKS.md, round nineteen). Every
/// bench ran this build's binaries as linked and the baseline's as copied.
pub fn settle_binaries() {
    let this = crate::hwkey_bin();
    let baseline = std::env::var_os("HWKEY_BENCH_BASELINE_BIN").map(PathBuf::from);
    for hwkey in std::iter::once(this).chain(baseline) {
        for name in ["hwkey", "hwkey-credential", "hwkey-net"] {
            let bin = hwkey.with_file_name(name);
            if bin.is_file() {
                if let Err(e) = settle(&bin) {
                    eprintln!(
                        "bench: cannot drop {} from the page cache: {e}",
                        bin.display()
                    );
                }
            }
        }
    }
}

/// Writes `path` back to disk and asks the kernel to drop its cached pages (those no process
/// has mapped).
pub fn settle(path: &std::path::Path) -> std::io::Result<()> {
    let file = std::fs::File::open(path)?;
    file.sync_all()?;
    rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed)?;
    Ok(())
}

/// `full` normally, `quick` in quick mode.
pub fn pick<T>(full: T, quick_value: T) -> T {
    if quick() {
        quick_value
    } else {
        full
    }
}

/// Where the benchmark binaries leave their results for the report:
/// `$CARGO_TARGET_DIR/hwkey-bench` (default `target/hwkey-bench` in the package).
pub fn results_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target")));
    let dir = target.join("hwkey-bench");
    std::fs::create_dir_all(&dir).expect("create the benchmark results directory");
    dir
}

/// A distribution summarised: median, quartiles, extremes, count.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Stat {
    pub median: f64,
    pub p25: f64,
    pub p75: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Stat {
    /// Summarises `values` (any order); panics on an empty slice, which is a harness bug.
    pub fn of(values: &[f64]) -> Stat {
        assert!(!values.is_empty(), "no values to summarise");
        let mut v = values.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        Stat {
            median: percentile_sorted(&v, 50.0),
            p25: percentile_sorted(&v, 25.0),
            p75: percentile_sorted(&v, 75.0),
            min: v[0],
            max: v[v.len() - 1],
            n: v.len(),
        }
    }
}

/// The `p`-th percentile of sorted values, interpolating linearly between neighbours.
pub fn percentile_sorted(sorted: &[f64], p: f64) -> f64 {
    let rank = (p / 100.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// Per-repetition ratios `subject[i] / baseline[i]` of paired repetitions.
pub fn paired_ratios(subject: &[f64], baseline: &[f64]) -> Vec<f64> {
    subject
        .iter()
        .zip(baseline)
        .map(|(s, b)| if *b == 0.0 { f64::NAN } else { s / b })
        .collect()
}

/// A 95 % interval for the median of `values` that assumes nothing of their distribution
/// (order statistics: the median lies between the j-th smallest and the j-th largest value
/// with probability 1 − 2·P(Binomial(n, ½) < j), at least 95 %: 97 % at 41 values); None with
/// fewer than six values, where even the extremes give less than 95 %. It speaks of the
/// rounds of one run, taken as independent: how far that run's median could move with more
/// rounds, not how far another run's would (the machine's speed moves between runs). Meant
/// for the tens of rounds a bench runs (2^-n underflows past about a thousand values).
pub fn median_interval(values: &[f64]) -> Option<(f64, f64)> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    // P(B = i) for B ~ Binomial(n, ½), built up from P(B = 0) = 2^-n.
    let mut p = 0.5f64.powi(i32::try_from(n).ok()?);
    let mut below = 0.0; // P(B < j)
    let mut j = 0;
    while j < n / 2 {
        // P(B < j + 1) = P(B < j) + P(B = j)
        if 2.0 * (below + p) > 0.05 {
            break;
        }
        below += p;
        p *= (n - j) as f64 / (j + 1) as f64;
        j += 1;
    }
    // The interval [v(j), v(n − j + 1)] (1-based) holds the median with 1 − 2·P(B < j).
    (j >= 1).then(|| (v[j - 1], v[n - j]))
}

/// One line of a result table.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// The area (`signing, raw`, `handshakes`, …): one table per area.
    pub area: String,
    /// What was measured, as a reader would say it.
    pub measure: String,
    /// Unit of `subject` and `baseline` (`signs/s`, `MB/s`, `µs`, …).
    pub unit: String,
    pub subject: Option<Stat>,
    /// What the baseline is, e.g. "bare cryptoki loop".
    pub baseline_label: String,
    pub baseline: Option<Stat>,
    /// subject / baseline: of paired repetitions, or of the medians when the repetitions are
    /// not paired (criterion runs one benchmark after the other).
    pub ratio: Option<Stat>,
    /// The target for this row, as text ("≥ 0.95×").
    pub target: String,
    /// Whether the target was met; None when the row has no target.
    pub met: Option<bool>,
    /// Anything a reader needs to read the figure right.
    pub note: String,
}

impl Row {
    /// A row with a subject only.
    pub fn new(area: &str, measure: &str, unit: &str, subject: Option<Stat>) -> Row {
        Row {
            area: area.into(),
            measure: measure.into(),
            unit: unit.into(),
            subject,
            baseline_label: String::new(),
            baseline: None,
            ratio: None,
            target: String::new(),
            met: None,
            note: String::new(),
        }
    }

    /// Adds a baseline and the ratio.
    pub fn versus(mut self, label: &str, baseline: Option<Stat>, ratio: Option<Stat>) -> Row {
        self.baseline_label = label.into();
        self.baseline = baseline;
        self.ratio = ratio;
        self
    }

    /// Adds the target and whether it was met.
    pub fn target(mut self, target: &str, met: Option<bool>) -> Row {
        self.target = target.into();
        self.met = met;
        self
    }

    /// Adds a note.
    pub fn note(mut self, note: impl Into<String>) -> Row {
        self.note = note.into();
        self
    }
}

/// Results of one benchmark binary, with the load it ran under.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub quick: bool,
    pub load_before: String,
    pub load_after: String,
    pub seconds: f64,
    /// What the run measured: the checkout (`git describe --always --dirty` when it finished)
    /// and, when `HWKEY_BIN` named another binary, that binary. The report names this, not the
    /// commit it is written at, which may be a later one.
    #[serde(default)]
    pub measured: Option<String>,
    /// When the run finished, in seconds since the Unix epoch (the report writes it as a date).
    #[serde(default)]
    pub finished_unix: Option<i64>,
    pub rows: Vec<Row>,
}

/// The 1/5/15-minute load averages now, as text.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// What a run starts from, taken before anything runs: the load average and what it measures.
pub struct Before {
    load: String,
    measured: String,
}

/// The load average and the checkout (and binaries) as a run starts.
pub fn before() -> Before {
    Before {
        load: loadavg(),
        measured: measured(),
    }
}

/// Saves a benchmark binary's rows with the run's facts: quick mode, the load average before
/// (taken at `started`) and now, the seconds the run took, what it measured (said twice when
/// the checkout changed during the run: a commit made meanwhile) and when it finished.
pub fn finish(name: &str, before: Before, started: std::time::Instant, rows: Vec<Row>) {
    let now = measured();
    let measured = if now == before.measured {
        now
    } else {
        format!("{} as it started, {now} as it finished", before.measured)
    };
    save(
        name,
        &Results {
            quick: quick(),
            load_before: before.load,
            load_after: loadavg(),
            seconds: started.elapsed().as_secs_f64(),
            measured: Some(measured),
            finished_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .ok()
                .and_then(|d| i64::try_from(d.as_secs()).ok()),
            rows,
        },
    );
}

/// The checkout (`git describe --always --dirty`), and each binary named by `HWKEY_BIN` or
/// `HWKEY_BENCH_BASELINE_BIN` with its size and modification time (a path alone does not say
/// which build it held).
fn measured() -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let commit = std::process::Command::new("git")
        .args(["-C", root, "describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "an unknown commit".into());
    let mut text = format!("at {commit}");
    for var in ["HWKEY_BIN", "HWKEY_BENCH_BASELINE_BIN"] {
        if let Some(bin) = std::env::var_os(var) {
            let path = std::fs::canonicalize(&bin).unwrap_or_else(|_| bin.into());
            let _ = write!(text, "; {var}={}", path.display());
            if let Ok(meta) = std::fs::metadata(&path) {
                let modified = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .and_then(|d| i64::try_from(d.as_secs()).ok())
                    .map_or_else(|| "unknown".into(), utc);
                let _ = write!(text, " ({} bytes, modified {modified})", meta.len());
            }
        }
    }
    text
}

/// Unix seconds as RFC 3339 UTC text.
pub fn utc(unix: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(unix)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| format!("{unix} (Unix time)"))
}

/// Writes `target/hwkey-bench/NAME.json`.
pub fn save(name: &str, results: &Results) {
    let path = results_dir().join(format!("{name}.json"));
    let text = serde_json::to_string_pretty(results).expect("serialise results");
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    eprintln!("bench: wrote {}", path.display());
}

/// Reads `target/hwkey-bench/NAME.json`, if a run left one.
pub fn load(name: &str) -> Option<Results> {
    let path = results_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text).ok()
}
