//! Figure: established streams while a TPM handshake runs.

use super::*;

/// Bytes/s on established connections through a TPM-backed proxy: without handshakes (series
/// 0); with full handshakes (and so TPM signatures) running back to back (series 1); and with
/// one full handshake waiting the whole window inside a TPM that does not answer (series 2:
/// swtpm under SIGSTOP, a hardware TPM's slow signature taken to the limit, with no TPM work on
/// the host's cores). A full handshake is forced by SIGHUP, which reloads the certificate and
/// empties the proxy's session store.
pub(crate) fn tpm_stall(rt: &tokio::runtime::Runtime) -> Vec<Row> {
    const STREAMS: usize = 2;
    let id = Identity::tpm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let window = pick(Duration::from_millis(2000), Duration::from_millis(800));
    let rounds = pick(5, 2);
    let chunk = format!("/bytes?n={}", 4u64 << 20);
    let mut streams: Vec<UnixStream> = rt.block_on(async {
        let mut v = Vec::new();
        for _ in 0..STREAMS {
            v.push(
                UnixStream::connect(&proxy.socket)
                    .await
                    .expect("UNIX connect"),
            );
        }
        v
    });
    let mut bufs: Vec<Vec<u8>> = (0..STREAMS).map(|_| vec![0u8; 256 * 1024]).collect();
    let full_series = "hwkey_upstream_handshakes_total{resumed=\"false\"}";
    let swtpm = match &id.backend {
        support::proxy::Backend::Tpm(t) => t,
        _ => unreachable!("a TPM identity"),
    };
    let swtpm_pid = swtpm.pid();
    let mut handshake_rates = Vec::new();
    let mut results = vec![Vec::new(); 3];
    // Per series: the machine's busy share, and swtpm's share of the machine.
    let mut busy = vec![Vec::new(); 3];
    let mut swtpm_share = Vec::new();
    // Series 2: full handshakes that were still waiting for the TPM when the window ended.
    let mut pending_at_end = Vec::new();
    for series in schedule(rounds, 3) {
        // A full handshake waiting in a stopped TPM for the whole window.
        let frozen = (series == 2).then(|| {
            empty_session_store(&proxy);
            let paused = swtpm.pause();
            let socket = proxy.socket.clone();
            let waiting = std::thread::spawn(move || {
                let mut http = RawHttp::connect(&socket);
                http.send("GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
                http.read_response().0
            });
            (paused, waiting)
        });
        let bytes = AtomicU64::new(0);
        let stop = AtomicBool::new(false);
        let stop_driver = AtomicBool::new(false);
        let full_before = metric_in(&proxy.metrics(), full_series);
        let cpu_before = machine_cpu_ticks();
        let swtpm_before = process_cpu_ns(swtpm_pid);
        let start = Instant::now();
        std::thread::scope(|scope| {
            // The driver has its own thread and blocking I/O: it neither waits for nor slows
            // the readers' runtime; only the proxy, the upstream and the TPM are shared.
            let driver =
                (series == 1).then(|| scope.spawn(|| force_full_handshakes(&proxy, &stop_driver)));
            rt.block_on(async {
                let readers = streams.iter_mut().zip(bufs.iter_mut()).map(|(s, buf)| {
                    let (bytes, stop, chunk) = (&bytes, &stop, chunk.as_str());
                    async move {
                        while !stop.load(Ordering::Relaxed) {
                            let n = http1_get(s, chunk, buf).await;
                            bytes.fetch_add(n, Ordering::Relaxed);
                        }
                    }
                });
                let timer = async {
                    tokio::time::sleep(window).await;
                    stop.store(true, Ordering::Relaxed);
                };
                let ((), ()) = tokio::join!(futures_join_all(readers), timer);
            });
            stop_driver.store(true, Ordering::Relaxed);
            if let Some(d) = driver {
                d.join().expect("handshake driver");
            }
        });
        let elapsed = start.elapsed().as_secs_f64();
        let cpu_after = machine_cpu_ticks();
        let total = (cpu_after.0 - cpu_before.0) as f64;
        busy[series].push((cpu_after.1 - cpu_before.1) as f64 / total.max(1.0));
        if series == 1 {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
            let swtpm_s = (process_cpu_ns(swtpm_pid) - swtpm_before) as f64 / 1e9;
            swtpm_share.push(swtpm_s / (elapsed * cores));
            let full_after = metric_in(&proxy.metrics(), full_series);
            handshake_rates.push((full_after - full_before) / elapsed);
        }
        results[series].push(bytes.load(Ordering::Relaxed) as f64 / elapsed / 1e6);
        if let Some((paused, waiting)) = frozen {
            pending_at_end.push(
                metric_in(&proxy.metrics(), full_series) == full_before && !waiting.is_finished(),
            );
            drop(paused);
            assert_eq!(
                waiting.join().expect("the waiting handshake"),
                200,
                "GET /version once the TPM answered again"
            );
        }
    }
    let all_pending = pending_at_end.iter().all(|p| *p);
    let h = Stat::of(&handshake_rates);
    let (idle_busy, hs_busy, tpm) = (
        Stat::of(&busy[0]).median * 100.0,
        Stat::of(&busy[1]).median * 100.0,
        Stat::of(&swtpm_share).median * 100.0,
    );
    vec![
        at_least(
            ratio_row(
                "TPM stall",
                &format!("MB/s on {STREAMS} established connections while a full handshake waits in a stopped TPM"),
                "MB/s",
                &results[2],
                "same connections, no handshakes",
                &results[0],
            ),
            0.9,
        )
        .note(format!(
            "swtpm under SIGSTOP for the whole window, after SIGHUP emptied the session store: a new connection's handshake waits for its signature, as on a hardware TPM that takes its time, with no TPM work on the host's cores; the handshake was still waiting when every window ended: {all_pending}; it completed once swtpm resumed"
        )),
        at_least(
        ratio_row(
            "TPM stall",
            &format!("MB/s on {STREAMS} established connections while full TPM handshakes run"),
            "MB/s",
            &results[1],
            "same connections, no handshakes",
            &results[0],
        ),
        0.9,
    )
    .note(format!(
        "swtpm P-256 key; {:.0} full handshakes/s [{:.0}–{:.0}] during the window, one at a time (each forced by SIGHUP, which empties the session store); each window ends after the 4 MiB responses in flight; the machine was {idle_busy:.0} % busy without handshakes and {hs_busy:.0} % with them, swtpm alone using {tpm:.1} % of it",
        h.median, h.p25, h.p75
    )),
    ]
}

/// SIGHUP the proxy and wait until it reloaded: its session store is empty, so the next
/// connection makes a full handshake (a TPM signature).
fn empty_session_store(proxy: &ProxyProcess) {
    let reloads = || metric_in(&proxy.metrics(), "hwkey_cert_reloads_total{result=\"ok\"}");
    let before = reloads();
    proxy.signal(libc::SIGHUP);
    for _ in 0..2000 {
        if reloads() > before {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("the proxy did not reload within 2 s of SIGHUP");
}

/// Until `stop`: SIGHUP the proxy, wait until it reloaded (so its session store is empty),
/// then open a connection and GET /version through it, which makes a full handshake.
pub(crate) fn force_full_handshakes(proxy: &ProxyProcess, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        empty_session_store(proxy);
        let mut http = RawHttp::connect(&proxy.socket);
        http.send("GET /version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
        let (status, _) = http.read_response();
        assert_eq!(status, 200, "GET /version through the TPM proxy");
    }
}

/// Awaits every future of `futs` concurrently on the current task.
pub(crate) async fn futures_join_all<F: Future<Output = ()>>(futs: impl Iterator<Item = F>) {
    let mut set: Vec<std::pin::Pin<Box<F>>> = futs.map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        set.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if set.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

/// (all, busy) CPU ticks of the whole machine so far, from the first line of `/proc/stat`
/// (busy: everything but idle and iowait).
pub(crate) fn machine_cpu_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").expect("/proc/stat");
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let all: u64 = fields.iter().take(8).sum();
    let idle = fields.get(3).copied().unwrap_or(0) + fields.get(4).copied().unwrap_or(0);
    (all, all - idle)
}
