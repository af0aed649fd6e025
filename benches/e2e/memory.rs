//! Figure: resident memory of the proxy with many open connections.

use super::*;

pub(crate) fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kb / 1024.0
}

/// RSS of a fresh proxy after one connection (idle), then with 1,000 client connections open,
/// each having finished one request (so its upstream connection exists too); and again, in
/// another fresh proxy, with every open connection having moved `moved` bytes first: what a
/// connection costs once data went through it (its buffers touched), as a watch's would.
pub(crate) async fn open_connections(f: &Fixture, path: &str) -> (f64, f64, f64, f64) {
    const OPEN: usize = 1000;
    let proxy = ProxyProcess::start_with(&f.id, &f.upstream, ProxyOptions::default());
    let pid = proxy.guard.id();
    let mut buf = vec![0u8; 256 * 1024];
    {
        let mut s = UnixStream::connect(&proxy.socket)
            .await
            .expect("UNIX connect");
        http1_get(&mut s, "/version", &mut buf).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = rss_mib(pid);
    let mut open = Vec::with_capacity(OPEN);
    for _ in 0..OPEN {
        let mut s = UnixStream::connect(&proxy.socket)
            .await
            .expect("UNIX connect");
        http1_get(&mut s, path, &mut buf).await;
        open.push(s);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let active = metric_in(&proxy.metrics(), "hwkey_connections_active");
    let loaded = rss_mib(pid);
    drop(open);
    tokio::time::sleep(Duration::from_millis(500)).await;
    (idle, loaded, rss_mib(pid), active)
}

pub(crate) async fn memory(f: &Fixture) -> Vec<Row> {
    let moved = 256u64 << 10;
    let (idle, loaded, after, active) = open_connections(f, "/version").await;
    let (idle2, busy, after2, active2) = open_connections(f, &format!("/bytes?n={moved}")).await;
    let per = |total: f64, base: f64| (total - base) * 1024.0 / 1000.0;
    vec![
        Row::new("memory", "proxy RSS, idle (after one connection)", "MiB", Some(Stat::of(&[idle]))),
        Row::new("memory", "proxy RSS, 1,000 open client connections (one GET /version each)", "MiB", Some(Stat::of(&[loaded])))
            .target("≤ 40 MiB", Some(loaded <= 40.0))
            .note(format!(
                "hwkey_connections_active = {active}; each is a UNIX client plus an upstream TLS connection; {:.1} KiB per connection above idle; {after:.1} MiB once they closed",
                per(loaded, idle)
            )),
        Row::new("memory", &format!("proxy RSS, 1,000 open client connections that each moved {} KiB", moved >> 10), "MiB", Some(Stat::of(&[busy])))
            .target("≤ 40 MiB", Some(busy <= 40.0))
            .note(format!(
                "a fresh proxy (idle {idle2:.1} MiB); hwkey_connections_active = {active2}; {:.1} KiB per connection above idle; {after2:.1} MiB once they closed",
                per(busy, idle2)
            )),
    ]
}
