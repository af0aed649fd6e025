//! This build against an earlier one, in the same run (issue 35: "keep-alive requests and bulk
//! unchanged (±5 %)" by the signer split). `HWKEY_BENCH_BASELINE_BIN` names the earlier hwkey
//! (hsm-fixtures/baseline.sh REF builds it; `HWKEY_BENCH_BASELINE_REF` labels it): a second
//! proxy of that build runs beside the fixture's, same SoftHSM key, same upstream, and the two
//! alternate round by round: HTTP/1.1 keep-alive `GET /version` on 8 connections, the same
//! request paced (one connection, 1 ms after each answer), and a 64 MiB download, all over the
//! UNIX socket. CPU is each proxy's network-facing process (the signer
//! signs nothing on an established connection).

use super::*;

/// The earlier build's binary and its label, when given.
fn baseline_bin() -> Option<(PathBuf, String)> {
    let bin = std::env::var_os("HWKEY_BENCH_BASELINE_BIN")?;
    let label = std::env::var("HWKEY_BENCH_BASELINE_REF").unwrap_or_else(|_| "baseline".into());
    Some((PathBuf::from(bin), label))
}

/// The rows, or one row saying why they are not measured.
pub(crate) async fn against_baseline(f: &Fixture) -> Vec<Row> {
    let Some((bin, label)) = baseline_bin() else {
        return vec![Row::new(
            "against an earlier build",
            "this build against an earlier one",
            "—",
            None,
        )
        .note("not measured: HWKEY_BENCH_BASELINE_BIN is not set (hsm-fixtures/bench.sh --baseline REF)")];
    };
    let other = ProxyProcess::start_with(
        &f.id,
        &f.upstream,
        ProxyOptions {
            bin: Some(&bin),
            ..Default::default()
        },
    );
    let proxies = [
        (&f.proxy.socket, f.proxy.guard.id()),
        (&other.socket, other.guard.id()),
    ];
    let mut rows = keep_alive(&proxies, &label).await;
    rows.push(paced(&proxies, &label).await);
    rows.extend(bulk(&proxies, &label).await);
    drop(other);
    rows
}

/// HTTP/1.1 keep-alive, 8 connections to each proxy: CPU per request and requests/s.
async fn keep_alive(proxies: &[(&PathBuf, u32); 2], label: &str) -> Vec<Row> {
    let (n, total, rounds) = (8, pick(40_000, 8_000), pick(5, 2));
    let mut conns = Vec::new();
    for (socket, _) in proxies {
        let mut cs = Vec::new();
        for _ in 0..n {
            cs.push(Conn::Unix(UnixStream::connect(socket).await.expect("UNIX")));
        }
        load(&mut cs, n * 20, &Whose::Client).await;
        conns.push(cs);
    }
    let mut trials: [Vec<Trial>; 2] = Default::default();
    for series in schedule(rounds, 2) {
        let whose = Whose::Process(proxies[series].1);
        trials[series].push(load(&mut conns[series], total, &whose).await);
    }
    let field = |t: &[Trial], get: fn(&Trial) -> f64| t.iter().map(get).collect::<Vec<f64>>();
    let versus = format!("hwkey of {label}, same key and upstream, alternating");
    vec![
        no_more_cpu(ratio_row(
            "against an earlier build",
            "proxy CPU per request, HTTP/1.1 keep-alive, 8 connections, UNIX socket",
            "µs",
            &field(&trials[0], |t| t.cpu_us),
            &versus,
            &field(&trials[1], |t| t.cpu_us),
        )),
        no_slower(ratio_row(
            "against an earlier build",
            "requests/s, HTTP/1.1 keep-alive, 8 connections, UNIX socket",
            "req/s",
            &field(&trials[0], |t| t.per_second),
            &versus,
            &field(&trials[1], |t| t.per_second),
        )),
    ]
}

/// Requests at a client's pace rather than as fast as the proxy answers: one connection to
/// each proxy, a pause of 1 ms after each answer, as kubelet's rate-limited requests come. The
/// proxy sleeps between requests here, so what it pays per request includes waking up, which
/// the closed-loop rows above mostly do not see (the proxy is busy when the next event comes).
async fn paced(proxies: &[(&PathBuf, u32); 2], label: &str) -> Row {
    let (requests, rounds) = (pick(1_000, 200), pick(5, 2));
    let mut conns = Vec::new();
    for (socket, _) in proxies {
        let mut c = Conn::Unix(UnixStream::connect(socket).await.expect("UNIX"));
        let mut buf = vec![0u8; 4096];
        for _ in 0..20 {
            c.get("/version", &mut buf).await;
        }
        conns.push(c);
    }
    let mut cpu: [Vec<f64>; 2] = Default::default();
    let mut buf = vec![0u8; 4096];
    for series in schedule(rounds, 2) {
        let whose = Whose::Process(proxies[series].1);
        let before = whose.cpu_ns();
        for _ in 0..requests {
            conns[series].get("/version", &mut buf).await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        cpu[series].push((whose.cpu_ns() - before) as f64 / 1e3 / requests as f64);
    }
    no_more_cpu(ratio_row(
        "against an earlier build",
        "proxy CPU per request, paced (1 connection, 1 ms between requests), UNIX socket",
        "µs",
        &cpu[0],
        &format!("hwkey of {label}, same key and upstream, alternating"),
        &cpu[1],
    ))
}

/// A 64 MiB download through each proxy: proxy CPU per GB and MB/s.
async fn bulk(proxies: &[(&PathBuf, u32); 2], label: &str) -> Vec<Row> {
    let mut relays = [
        (unix_conn(proxies[0].0).await, Whose::Process(proxies[0].1)),
        (unix_conn(proxies[1].0).await, Whose::Process(proxies[1].1)),
    ];
    let Downloads {
        size, cpu, rate, ..
    } = downloads(&mut relays, pick(11, 3), None).await;
    let versus = format!("hwkey of {label}, same key and upstream, alternating");
    let size_mib = size >> 20;
    vec![
        no_more_cpu(ratio_row(
            "against an earlier build",
            &format!("proxy CPU per GB relayed, {size_mib} MiB download, UNIX socket"),
            "s/GB",
            &cpu[0],
            &versus,
            &cpu[1],
        )),
        no_slower(ratio_row(
            "against an earlier build",
            &format!("download {size_mib} MiB, UNIX socket"),
            "MB/s",
            &rate[0],
            &versus,
            &rate[1],
        )),
    ]
}

/// Issue 35's "unchanged (±5 %)" as a bound on regressions: at most 5 % more CPU.
fn no_more_cpu(row: Row) -> Row {
    let met = row.ratio.map(|r| r.median <= 1.05);
    row.target("≤ 1.05× (issue 35: unchanged ±5 %)", met)
}

/// At most 5 % slower.
fn no_slower(row: Row) -> Row {
    let met = row.ratio.map(|r| r.median >= 0.95);
    row.target("≥ 0.95× (issue 35: unchanged ±5 %)", met)
}
