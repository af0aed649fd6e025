//! Figure: resident memory of the proxy with many open connections.

use super::*;

pub(crate) fn rss_mib(pid: u32) -> f64 {
    support::rss_kib(pid) as f64 / 1024.0
}

/// The proxy's processes: the network side (the pid `hwkey proxy` was started as, which became
/// `hwkey-net`) and its descendants (the signer supervisor and the signer).
fn process_tree(pid: u32) -> Vec<u32> {
    let mut all = vec![pid];
    let mut i = 0;
    while i < all.len() {
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", all[i])) {
            for task in tasks.flatten() {
                if let Ok(children) = std::fs::read_to_string(task.path().join("children")) {
                    all.extend(
                        children
                            .split_whitespace()
                            .filter_map(|c| c.parse::<u32>().ok()),
                    );
                }
            }
        }
        i += 1;
    }
    all
}

/// One field of `/proc/PID/smaps_rollup`, in KiB (0 when the process is gone).
fn smaps_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                l.strip_prefix(field)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse()
                    .ok()
            })
        })
        .unwrap_or(0)
}

/// Memory of all the proxy's processes together, in MiB: (RSS summed, which counts the pages
/// they share once per process; PSS summed, which shares them out) and how many processes.
pub(crate) fn tree_mib(pid: u32) -> (f64, f64, usize) {
    let pids = process_tree(pid);
    let sum = |field| pids.iter().map(|&p| smaps_kib(p, field)).sum::<u64>() as f64 / 1024.0;
    (sum("Rss:"), sum("Pss:"), pids.len())
}

/// A connection through the proxy's UNIX socket that has made one request for `path` (so its
/// upstream TLS connection exists too).
async fn connected(proxy: &ProxyProcess, path: &str, buf: &mut [u8]) -> UnixStream {
    let mut s = UnixStream::connect(&proxy.socket)
        .await
        .expect("UNIX connect");
    http1_get(&mut s, path, buf).await;
    s
}

/// A fresh proxy with `args`, and its RSS once one connection came and went (its idle RSS).
async fn fresh_proxy(f: &Fixture, args: Vec<String>, buf: &mut [u8]) -> (ProxyProcess, f64) {
    let proxy = ProxyProcess::start_with(
        &f.id,
        &f.upstream,
        ProxyOptions {
            args,
            ..Default::default()
        },
    );
    drop(connected(&proxy, "/version", buf).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = rss_mib(proxy.guard.id());
    (proxy, idle)
}

/// A client connection held open: over the UNIX socket or over loopback TLS.
enum Open {
    Unix(#[allow(dead_code)] UnixStream),
    Loopback(#[allow(dead_code)] Box<TlsStream<TcpStream>>),
}

/// A connection through the proxy's loopback TLS listener (kubectl's and kubelet's way) that
/// has made one request for `path`, with a loopback credential from the proxy.
async fn connected_tls(
    proxy: &ProxyProcess,
    config: &Arc<ClientConfig>,
    path: &str,
    buf: &mut [u8],
) -> TlsStream<TcpStream> {
    let mut s = tls_connect(config, proxy.tcp_port).await;
    http1_get(&mut s, path, buf).await;
    s
}

/// RSS of a fresh proxy after one connection (idle), then with 1,000 client connections open
/// (over loopback TLS when `loopback`, else the UNIX socket), each having finished one request
/// (so its upstream connection exists too); and again, in another fresh proxy, with every open
/// connection having moved `moved` bytes first: what a connection costs once data went through
/// it (its buffers touched), as a watch's would.
pub(crate) async fn open_connections(
    f: &Fixture,
    path: &str,
    loopback: bool,
) -> (f64, f64, f64, f64, (f64, f64, usize)) {
    const OPEN: usize = 1000;
    let mut buf = vec![0u8; 256 * 1024];
    let (proxy, idle) = fresh_proxy(f, Vec::new(), &mut buf).await;
    let pid = proxy.guard.id();
    let config = loopback.then(|| loopback_config(&proxy));
    let mut open = Vec::with_capacity(OPEN);
    for _ in 0..OPEN {
        open.push(match &config {
            Some(c) => Open::Loopback(Box::new(connected_tls(&proxy, c, path, &mut buf).await)),
            None => Open::Unix(connected(&proxy, path, &mut buf).await),
        });
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let active = metric_in(&proxy.metrics(), "hwkey_connections_active");
    let loaded = rss_mib(pid);
    let tree = tree_mib(pid);
    drop(open);
    tokio::time::sleep(Duration::from_millis(500)).await;
    (idle, loaded, rss_mib(pid), active, tree)
}

/// A client configuration holding a loopback credential of `proxy`, HTTP/1.1, resumption on:
/// each connection leaves an entry in the proxy's session cache, the heavier case (kubectl and
/// kubelet, with no session cache, are sent no ticket).
fn loopback_config(proxy: &ProxyProcess) -> Arc<ClientConfig> {
    let cred = proxy.credential();
    let field = |name: &str| cred[name].as_str().expect(name).as_bytes().to_vec();
    client_config(
        &field("certificateAuthorityPem"),
        &field("clientCertificatePem"),
        &field("clientKeyPem"),
        &[b"http/1.1"],
        true,
    )
}

pub(crate) async fn memory(f: &Fixture) -> Vec<Row> {
    let moved = 256u64 << 10;
    let (idle, loaded, after, active, tree) = open_connections(f, "/version", false).await;
    let (idle2, busy, after2, active2, _) =
        open_connections(f, &format!("/bytes?n={moved}"), false).await;
    let (idle3, tls, after3, active3, _) = open_connections(f, "/version", true).await;
    let (tree_rss, tree_pss, processes) = tree;
    let per = |total: f64, base: f64| (total - base) * 1024.0 / 1000.0;
    vec![
        Row::new("memory", "proxy RSS (network side), idle (after one connection)", "MiB", Some(Stat::of(&[idle]))),
        Row::new("memory", "proxy RSS (network side), 1,000 open client connections (one GET /version each)", "MiB", Some(Stat::of(&[loaded])))
            .target("≤ 32 MiB", Some(loaded <= 32.0))
            .note(format!(
                "hwkey_connections_active = {active}; each is a UNIX client plus an upstream TLS connection; {:.1} KiB per connection above idle; {after:.1} MiB once they closed",
                per(loaded, idle)
            )),
        Row::new("memory", "proxy PSS, all its processes (network side, signer supervisor, signer), 1,000 open client connections", "MiB", Some(Stat::of(&[tree_pss])))
            .target("≤ 33 MiB", Some(tree_pss <= 33.0))
            .note(format!(
                "{processes} processes; RSS summed {tree_rss:.1} MiB (counts the pages they share once per process: the binary, libc, the module); the network side alone {loaded:.1} MiB RSS"
            )),
        Row::new("memory", &format!("proxy RSS, 1,000 open client connections that each moved {} KiB", moved >> 10), "MiB", Some(Stat::of(&[busy])))
            .target("≤ 32 MiB", Some(busy <= 32.0))
            .note(format!(
                "a fresh proxy (idle {idle2:.1} MiB); hwkey_connections_active = {active2}; {:.1} KiB per connection above idle; {after2:.1} MiB once they closed",
                per(busy, idle2)
            )),
        Row::new("memory", "proxy RSS (network side), 1,000 open loopback TLS connections (one GET /version each)", "MiB", Some(Stat::of(&[tls])))
            .target("≤ 24 MiB", Some(tls <= 24.0))
            .note(format!(
                "a fresh proxy (idle {idle3:.1} MiB); hwkey_connections_active = {active3}; each is a loopback TLS client (the proxy's server session) plus an upstream TLS connection; {:.1} KiB per connection above idle; {after3:.1} MiB once they closed",
                per(tls, idle3)
            )),
    ]
}

/// Growth curve (issue 12): one proxy, idle keep-alive connections opened in steps of
/// 1 → 10 → 100 → 1,000 (→ 10,000 in full mode), each having made one request (so its upstream
/// TLS connection exists). At each step: RSS per connection above the proxy's idle RSS,
/// p50/p99 of 200 requests on one more keep-alive connection (against the same figure at the
/// first step, measured in this run), and the hardware signatures made so far.
pub(crate) async fn growth(f: &Fixture) -> Vec<Row> {
    // Each open connection costs this process 2 descriptors (client, and the upstream
    // stand-in's side), and so the proxy: the last step is 10,000 or what the limit allows.
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let top = usize::try_from((limit.saturating_sub(1000) / 2 / 1000) * 1000)
        .unwrap_or(10_000)
        .clamp(1000, 10_000);
    let full = [1, 10, 100, 1000, top];
    let steps: &[usize] = if common::quick() { &full[..4] } else { &full };
    let mut buf = vec![0u8; 64 * 1024];
    let args = vec!["--max-connections".into(), "30000".into()];
    let (proxy, idle) = fresh_proxy(f, args, &mut buf).await;
    let pid = proxy.guard.id();
    let mut open: Vec<UnixStream> = Vec::new();
    let mut rows = Vec::new();
    let mut first_p50 = None;
    for &n in steps {
        while open.len() < n {
            open.push(connected(&proxy, "/version", &mut buf).await);
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let rss = rss_mib(pid);
        let per_kib = (rss - idle) * 1024.0 / n as f64;
        // Latency with n idle connections open: one more keep-alive connection.
        let mut s = connected(&proxy, "/version", &mut buf).await;
        let mut micros = Vec::with_capacity(200);
        for _ in 0..200 {
            let t = Instant::now();
            http1_get(&mut s, "/version", &mut buf).await;
            micros.push(t.elapsed().as_secs_f64() * 1e6);
        }
        drop(s);
        let lat = Stat::of(&micros);
        let mut sorted = micros.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let p99 = common::percentile_sorted(&sorted, 99.0);
        let base = *first_p50.get_or_insert(lat.median);
        let metrics = proxy.metrics();
        let signatures = metric_in(&metrics, "hwkey_signatures_total");
        let buffers = metric_in(&metrics, "hwkey_copy_buffers");
        let row = Row::new(
            "memory",
            &format!("growth: {n} idle connections, KiB each above idle"),
            "KiB",
            Some(Stat::of(&[per_kib])),
        );
        // Below 1,000 connections RSS moves in allocator and page steps larger than the
        // connections themselves: the per-connection figure is only meaningful from there.
        let row = if n >= 1000 {
            row.target("≤ 16 KiB", Some(per_kib <= 16.0))
        } else {
            row
        };
        rows.push(
            row.note(format!(
                "RSS {rss:.1} MiB (idle {idle:.1}); hwkey_copy_buffers = {buffers}; request on one more connection: p50 {:.0} µs ({:.2}× the first step's), p99 {p99:.0} µs; hardware signatures so far: {signatures}",
                lat.median,
                lat.median / base
            )),
        );
    }
    drop(open);
    rows
}
