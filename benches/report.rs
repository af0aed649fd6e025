//! Writes `docs/BENCHMARKS.md` from the results the `sign` and `e2e` benchmarks left in
//! `target/hwkey-bench/`: the machine first (a figure means little without it), then one
//! table per area of issue 5, then the areas not measured yet. Everything after the
//! hand-written marker in an existing `docs/BENCHMARKS.md` is kept, so the analysis of what
//! bounds each figure survives a re-run.
//!
//! A bench target (`harness = false`) rather than a script so that it needs nothing beyond
//! the crate's own dependencies; `hsm-fixtures/bench.sh` runs it last.

use support::bench as common;

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use common::{Results, Row, Stat};

/// Everything after this line in docs/BENCHMARKS.md is written by hand and kept.
const MARKER: &str = "<!-- hand-written below this line: hsm-fixtures/bench.sh keeps it -->";

/// The issues' areas, in their order (one table each). A row of an area missing here still
/// gets a table, after these ([`tables`]): the loopback TLS path's rows (issue 55) once
/// reached only the list of missed targets, their table dropped for want of a line here.
const AREAS: [&str; 19] = [
    "signing, raw",
    "handshakes",
    "key exchange",
    "forward proxy",
    "resumption",
    "throughput",
    "latency",
    "requests",
    "loopback",
    "rustls per record",
    "against ghostunnel",
    "kubectl",
    "kubectl, real kube-apiserver",
    "exec",
    "memory",
    "TPM stall",
    "approver",
    "against an earlier build",
    "Crypto provider: aws-lc-rs against ring",
];

/// First line of a command's stdout+stderr, or "unavailable".
fn first_line(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            let mut text = String::from_utf8_lossy(&o.stdout).into_owned();
            text.push_str(&String::from_utf8_lossy(&o.stderr));
            text.lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .unwrap_or("")
                .to_string()
        })
        .filter(|l| !l.is_empty())
        .unwrap_or_else(|| "unavailable".into())
}

fn proc_field(path: &str, key: &str) -> String {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_once(':').or_else(|| l.split_once('=')))
                .map(|(_, v)| v.trim().trim_matches('"').to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn machine(out: &mut String, runs: &[(&str, Option<&Results>)]) {
    let now = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    let nproc = std::thread::available_parallelism()
        .map(|n| n.get().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let dir = env!("CARGO_MANIFEST_DIR");
    let commit = first_line("git", &["-C", dir, "describe", "--always", "--dirty"]);
    let facts = [
        ("report written (UTC)", now),
        ("`nproc`", nproc),
        ("CPU", proc_field("/proc/cpuinfo", "model name")),
        ("memory", proc_field("/proc/meminfo", "MemTotal")),
        ("OS", proc_field("/etc/os-release", "PRETTY_NAME")),
        (
            "kernel",
            std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| s.trim().to_string())
                .unwrap_or_default(),
        ),
        (
            "hwkey (the report's checkout; each run's own below)",
            format!("{} ({commit})", env!("CARGO_PKG_VERSION")),
        ),
        ("rustc", first_line("rustc", &["--version"])),
        ("SoftHSM", first_line("softhsm2-util", &["--version"])),
        ("swtpm", first_line("swtpm", &["--version"])),
        (
            "kubectl",
            first_line("/usr/bin/kubectl", &["version", "--client"]),
        ),
        ("criterion", "0.7 (flat sampling)".into()),
    ];
    out.push_str("| fact | value |\n|---|---|\n");
    for (k, v) in facts {
        let _ = writeln!(out, "| {k} | {v} |");
    }
    for &(name, r) in runs {
        match r {
            Some(r) => {
                let _ = writeln!(
                    out,
                    "| {name} | {} mode, {:.0} s, load average (1/5/15 min) {} before, {} after; measured {}, finished {} |",
                    if r.quick { "**quick**" } else { "full" },
                    r.seconds,
                    r.load_before,
                    r.load_after,
                    r.measured.as_deref().unwrap_or("at an unrecorded commit"),
                    r.finished_unix
                        .map_or_else(|| "at an unrecorded time".into(), common::utc),
                );
            }
            None => {
                let _ = writeln!(out, "| {name} | not run |");
            }
        }
    }
}

/// Three significant digits, without a trailing exponent.
fn num(v: f64) -> String {
    let a = v.abs();
    if !v.is_finite() {
        "—".into()
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

fn stat(s: &Option<Stat>) -> String {
    match s {
        Some(s) if s.n == 1 => num(s.median),
        Some(s) => format!(
            "**{}** [{}–{}] n={}",
            num(s.median),
            num(s.p25),
            num(s.p75),
            s.n
        ),
        None => "—".into(),
    }
}

fn ratio(s: &Option<Stat>) -> String {
    match s {
        Some(s) => format!("**{:.2}×** [{:.2}–{:.2}]", s.median, s.p25, s.p75),
        None => "—".into(),
    }
}

fn table(out: &mut String, rows: &[&Row]) {
    out.push_str(
        "| measure | unit | subject: median [p25–p75] | baseline | baseline: median [p25–p75] | ratio | target | met |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let met = match r.met {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "—",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.measure,
            r.unit,
            stat(&r.subject),
            if r.baseline_label.is_empty() {
                "—"
            } else {
                &r.baseline_label
            },
            stat(&r.baseline),
            ratio(&r.ratio),
            if r.target.is_empty() {
                "—"
            } else {
                &r.target
            },
            met
        );
    }
    let notes: Vec<&&Row> = rows.iter().filter(|r| !r.note.is_empty()).collect();
    if !notes.is_empty() {
        out.push('\n');
        for r in notes {
            let _ = writeln!(out, "- *{}*: {}", r.measure, r.note);
        }
    }
}

const HEAD: &str = "# hwkey benchmarks

Generated by `hsm-fixtures/bench.sh` (issue 5); do not edit above the hand-written marker.
Every figure is the median with its p25–p75 over `n` repetitions, next to a baseline measured
in the same run, and the ratio subject ÷ baseline. The subject is what a row's measure names
first: hwkey, unless it names another relay (a floor relay against another, say). Targets are
what we aim at, not tests.

How the figures are taken:

- **Micro** (`benches/sign.rs`, criterion, flat sampling): each sample is one signing rate. The
  baseline is a bare `cryptoki` / `tss-esapi` loop on the same key, signing a precomputed
  digest; hwkey signs the whole TLS 1.3 CertificateVerify message through `Key::sign`
  (software hash, DER encoding, session pool). The two run one after the other, so the ratio
  is of the medians and its spread pairs the quartiles worst to best. The *2 threads ÷
  1 thread* rows are not criterion's: 1 and 2 threads, hwkey and the bare loop, run in paired
  rounds whose order flips, and the ratio is taken per round.
- **End to end** (`benches/e2e.rs`): real SoftHSM and swtpm, the kube-apiserver stand-in of
  `tests/support/upstream.rs` (TLS 1.3, client certificate required, session tickets), the
  release `hwkey proxy`, `/usr/bin/kubectl`. The baseline is a client going straight to the same
  upstream with rustls and an in-memory software P-256 key; clients offer, and the stand-in
  picks, cipher suites in Go's order (AES-128-GCM first), as kubectl and kube-apiserver do.
  Subject and baseline alternate
  round by round (the order flips every round); the ratio is taken per round, then summarised.
  The client, the proxy and the upstream share the machine's cores, as kubectl, hwkey and a
  local API server would.
- **rustls per record** (`benches/records.rs`, issue 38): rustls alone, one thread, memory
  buffers, the proxy's provider. Timed is the client side (the proxy is the API server's TLS
  client) of a small request/response pair and of a download's records, with the same buffered
  rustls server answering every contender; the baseline is ring's AES-128-GCM on the same
  records, and heap allocations are counted by a counting global allocator. Contenders run in
  interleaved rounds whose order rotates.
";

const NOT_MEASURED: &str = "## Not measured yet

- **Handshakes through the proxy *process* with full handshakes**: the proxy resumes by design
  and offers no switch to stop; full handshakes are measured on the proxy's connector
  (`hwkey::proxy::upstream::Upstream`, the code every proxied connection runs) in the bench
  process, with `reset_sessions()` before each connection.
- **Upload throughput** (POST /echo) and throughput over h2: only HTTP/1.1 downloads are timed.
- **1,000 open h2 *streams***: memory is measured with 1,000 open client *connections*
  (each with its upstream TLS connection), the heavier case.
- **TPM RSA**: the issue asks for swtpm P-256 only; hardware TPMs' PSS salt makes RSA a poor
  choice there anyway.
";

/// One table per area: [`AREAS`] in their order ("Not measured in this run." for one without
/// rows), then every other area the rows name, in the order they first appear, so that no row
/// is left out of the report.
fn tables(out: &mut String, rows: &[&Row]) {
    let mut areas: Vec<&str> = AREAS.to_vec();
    for r in rows {
        if !areas.contains(&r.area.as_str()) {
            areas.push(&r.area);
        }
    }
    for area in areas {
        let in_area: Vec<&Row> = rows.iter().copied().filter(|r| r.area == area).collect();
        let _ = write!(out, "\n## {area}\n\n");
        if in_area.is_empty() {
            out.push_str("Not measured in this run.\n");
        } else {
            table(out, &in_area);
        }
    }
}

/// What `cargo test --all-targets` (hsm-fixtures/test.sh) runs of this target, which has no
/// test harness: [`tables`] gives every row of every area, listed or not, exactly one table
/// line and its area one heading.
fn check_every_row_has_a_table() {
    let areas = AREAS.iter().copied().chain(["an area no list names"]);
    let owned: Vec<Row> = areas
        .enumerate()
        .map(|(i, area)| Row::new(area, &format!("figure {i} of {area}"), "µs", None))
        .collect();
    let rows: Vec<&Row> = owned.iter().collect();
    let mut out = String::new();
    tables(&mut out, &rows);
    for r in &owned {
        let lines = out
            .lines()
            .filter(|line| line.starts_with(&format!("| {} |", r.measure)))
            .count();
        assert_eq!(
            lines, 1,
            "report: the row {:?} of area {:?} has {lines} table lines, not one:\n{out}",
            r.measure, r.area
        );
        let headings = out.matches(&format!("\n## {}\n", r.area)).count();
        assert_eq!(
            headings, 1,
            "report: area {:?} has {headings} headings, not one",
            r.area
        );
    }
    eprintln!(
        "report: every row of {} areas has its table line",
        owned.len()
    );
}

fn main() {
    if common::skip_unless_cargo_bench("report") {
        // Under `cargo test --all-targets`: the self-check instead of a report.
        check_every_row_has_a_table();
        return;
    }
    let sign = common::load("sign");
    let e2e = common::load("e2e");
    let providers = common::load("providers");
    let records = common::load("records");
    let approver = common::load("approver");
    let apiserver = common::load("apiserver");
    let mut out = String::from(HEAD);
    out.push_str("\n## Machine\n\n");
    let runs = [
        ("micro (sign)", sign.as_ref()),
        ("end to end (e2e)", e2e.as_ref()),
        ("rustls per record (records)", records.as_ref()),
        ("crypto providers (providers)", providers.as_ref()),
        ("approver (approver)", approver.as_ref()),
        ("real kube-apiserver (apiserver)", apiserver.as_ref()),
    ];
    machine(&mut out, &runs);
    if runs.iter().any(|(_, r)| r.is_some_and(|r| r.quick)) {
        out.push_str(
            "\n**Quick mode**: few, short repetitions; use the full run for anything you quote.\n",
        );
    }
    let rows: Vec<&Row> = sign
        .iter()
        .chain(e2e.iter())
        .chain(records.iter())
        .chain(providers.iter())
        .chain(approver.iter())
        .chain(apiserver.iter())
        .flat_map(|r| r.rows.iter())
        .collect();
    tables(&mut out, &rows);
    let missed: Vec<&Row> = rows
        .iter()
        .copied()
        .filter(|r| r.met == Some(false))
        .collect();
    out.push_str("\n## Targets missed in this run\n\n");
    if missed.is_empty() {
        out.push_str("None.\n");
    }
    for r in &missed {
        let _ = writeln!(
            out,
            "- {} — {}: {} (target {})",
            r.area,
            r.measure,
            r.ratio
                .map(|x| format!("{:.2}×", x.median))
                .or(r.subject.map(|s| format!("{} {}", num(s.median), r.unit)))
                .unwrap_or_default(),
            r.target
        );
    }
    out.push('\n');
    out.push_str(NOT_MEASURED);

    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/BENCHMARKS.md");
    let kept = std::fs::read_to_string(&path)
        .ok()
        .and_then(|old| old.split_once(MARKER).map(|(_, tail)| tail.to_string()))
        .unwrap_or_else(|| {
            "\n\n## What bounds the figures\n\n(Not written yet: profile the missed targets and write here what bounds them.)\n"
                .into()
        });
    out.push('\n');
    out.push_str(MARKER);
    out.push_str(&kept);
    std::fs::write(&path, out).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    eprintln!("report: wrote {}", path.display());
}
