//! Figures: throughput and latency over established connections.

use super::*;

/// One established connection of each kind: direct TLS, proxy UNIX, proxy loopback TLS.
pub(crate) enum Conn {
    Tls(Box<TlsStream<TcpStream>>),
    Unix(UnixStream),
}

impl Conn {
    pub(crate) async fn get(&mut self, path: &str, buf: &mut [u8]) -> u64 {
        match self {
            Conn::Tls(s) => http1_get(s.as_mut(), path, buf).await,
            Conn::Unix(s) => http1_get(s, path, buf).await,
        }
    }
}

pub(crate) async fn three_conns(f: &Fixture) -> Vec<Conn> {
    vec![
        Conn::Tls(Box::new(tls_connect(&f.direct, f.upstream.port()).await)),
        Conn::Unix(
            UnixStream::connect(&f.proxy.socket)
                .await
                .expect("UNIX connect"),
        ),
        Conn::Tls(Box::new(tls_connect(&f.loopback, f.proxy.tcp_port).await)),
    ]
}

/// Download MB/s on an established keep-alive connection (GET /bytes?n=SIZE).
pub(crate) async fn throughput(f: &Fixture) -> Vec<Row> {
    let size: u64 = pick(64, 16) << 20;
    let rounds = pick(5, 3);
    let path = format!("/bytes?n={size}");
    let mut buf = vec![0u8; 256 * 1024];
    let mut conns = three_conns(f).await;
    for c in conns.iter_mut() {
        c.get(&path, &mut buf).await;
    }
    let mut results = vec![Vec::new(); 3];
    for series in schedule(rounds, 3) {
        let start = Instant::now();
        let got = conns[series].get(&path, &mut buf).await;
        results[series].push(got as f64 / start.elapsed().as_secs_f64() / 1e6);
    }
    let size_mib = size >> 20;
    vec![
        at_least(
            ratio_row(
                "throughput",
                &format!("download {size_mib} MiB through the proxy, UNIX socket"),
                "MB/s",
                &results[1],
                "direct TLS to the same upstream",
                &results[0],
            ),
            0.85,
        ),
        at_least(
            ratio_row(
                "throughput",
                &format!("download {size_mib} MiB through the proxy, loopback TLS"),
                "MB/s",
                &results[2],
                "direct TLS to the same upstream",
                &results[0],
            ),
            0.85,
        ),
    ]
}

/// p50 and p99 (µs) of `samples`.
pub(crate) fn p50_p99(samples: &mut [f64]) -> (f64, f64) {
    samples.sort_by(|a, b| a.total_cmp(b));
    (
        common::percentile_sorted(samples, 50.0),
        common::percentile_sorted(samples, 99.0),
    )
}

/// Request latency on one keep-alive connection, HTTP/1.1 (hand-written client) and h2
/// (hyper): per round, `m` sequential GET /version on each path; the round's p50 and p99.
pub(crate) async fn latency(f: &Fixture) -> Vec<Row> {
    let m = pick(1000, 200);
    let rounds = pick(5, 3);
    let mut buf = vec![0u8; 16 * 1024];
    let mut conns = three_conns(f).await;
    for c in conns.iter_mut() {
        c.get("/version", &mut buf).await;
    }
    let mut h2 = [
        h2_client(tls_connect(&f.direct_h2, f.upstream.port()).await).await,
        h2_client(
            UnixStream::connect(&f.proxy.socket)
                .await
                .expect("UNIX connect"),
        )
        .await,
        h2_client(tls_connect(&f.loopback_h2, f.proxy.tcp_port).await).await,
    ];
    for s in h2.iter_mut() {
        h2_get(s, "https://127.0.0.1/version").await;
    }
    // Series 0..3: HTTP/1.1 direct, UNIX, TLS; 3..6: h2 direct, UNIX, TLS. Each trial yields
    // p50 and p99; they are kept apart below.
    let mut p99s: Vec<Vec<f64>> = vec![Vec::new(); 6];
    let mut p50s: Vec<Vec<f64>> = vec![Vec::new(); 6];
    for series in schedule(rounds, 6) {
        {
            let mut samples = Vec::with_capacity(m);
            for _ in 0..m {
                let start = Instant::now();
                if series < 3 {
                    conns[series].get("/version", &mut buf).await;
                } else {
                    h2_get(&mut h2[series - 3], "https://127.0.0.1/version").await;
                }
                samples.push(start.elapsed().as_secs_f64() * 1e6);
            }
            let (p50, p99) = p50_p99(&mut samples);
            p99s[series].push(p99);
            p50s[series].push(p50);
        }
    }
    let mut rows = Vec::new();
    for (proto, base) in [("HTTP/1.1", 0), ("h2", 3)] {
        for (path, s) in [("UNIX socket", base + 1), ("loopback TLS", base + 2)] {
            let row = ratio_row(
                "latency",
                &format!("p50, {proto} keep-alive, proxy {path}"),
                "µs",
                &p50s[s],
                &format!("direct TLS, {proto}"),
                &p50s[base],
            );
            let overhead: Vec<f64> = p50s[s]
                .iter()
                .zip(&p50s[base])
                .map(|(a, b)| a - b)
                .collect();
            let o = Stat::of(&overhead);
            rows.push(
                row.target("p50 overhead ≤ 100 µs", Some(o.median <= 100.0))
                    .note(format!(
                        "overhead {:.0} µs [{:.0}–{:.0}]",
                        o.median, o.p25, o.p75
                    )),
            );
            let r = ratio_row(
                "latency",
                &format!("p99, {proto} keep-alive, proxy {path}"),
                "µs",
                &p99s[s],
                &format!("direct TLS, {proto}"),
                &p99s[base],
            );
            rows.push(r);
        }
    }
    rows
}
