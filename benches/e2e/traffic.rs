//! Figures: throughput and latency over established connections.

use super::*;

/// One established connection of each kind: direct TLS, proxy UNIX, proxy loopback TLS.
pub(crate) enum Conn {
    Tls(Box<TlsStream<TcpStream>>),
    Unix(UnixStream),
    /// TLS to the upstream through a byte relay's UNIX socket (the floor relay).
    TlsUnix(Box<TlsStream<UnixStream>>),
}

impl Conn {
    /// One GET; a response that stops arriving for 30 s fails the run, naming the connection,
    /// instead of hanging it.
    pub(crate) async fn get(&mut self, path: &str, buf: &mut [u8]) -> u64 {
        let kind = match self {
            Conn::Tls(s) => format!(
                "TLS to port {}",
                s.get_ref().0.peer_addr().map_or(0, |a| a.port())
            ),
            Conn::Unix(_) => "UNIX socket".to_string(),
            Conn::TlsUnix(_) => "TLS over a UNIX socket".to_string(),
        };
        let get = async {
            match self {
                Conn::Tls(s) => http1_get(s.as_mut(), path, buf).await,
                Conn::Unix(s) => http1_get(s, path, buf).await,
                Conn::TlsUnix(s) => http1_get(s.as_mut(), path, buf).await,
            }
        };
        match tokio::time::timeout(Duration::from_secs(30), get).await {
            Ok(n) => n,
            Err(_) => panic!("GET {path} over the {kind} connection stalled for 30 s"),
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
    let pid = f.proxy.guard.id();
    let mut results = vec![Vec::new(); 3];
    // Proxy CPU seconds per GB through the proxy (series 1 and 2), and the same round's AEAD
    // floor; the direct series (0) does not involve the proxy.
    let mut cpu = vec![Vec::new(); 3];
    let mut floor = vec![Vec::new(); 3];
    let mut aead = vec![Vec::new(); 3];
    let mut copies = vec![Vec::new(); 3];
    for series in schedule(rounds, 3) {
        let cpu_before = process_cpu_ns(pid);
        let start = Instant::now();
        let got = conns[series].get(&path, &mut buf).await;
        results[series].push(got as f64 / start.elapsed().as_secs_f64() / 1e6);
        if series > 0 {
            let used = (process_cpu_ns(pid) - cpu_before) as f64 / 1e9;
            cpu[series].push(used / (got as f64 / 1e9));
            // Series 1 decrypts upstream records and writes them to a UNIX socket; series 2
            // also encrypts them again and writes them to a TCP socket.
            let crypto = aead_seconds_per_gb(size, series == 2);
            let kernel = copy_seconds_per_gb(size, series == 2);
            aead[series].push(crypto);
            copies[series].push(kernel);
            floor[series].push(crypto + kernel);
        }
    }
    let size_mib = size >> 20;
    // The target is absolute (the s/GB), so the floor is shown beside it, not as a ratio.
    let cpu_row = |series: usize, path: &str, floor_label: &str| {
        let used = Stat::of(&cpu[series]);
        let ratios = Stat::of(&paired_ratios(&cpu[series], &floor[series]));
        let floor = Stat::of(&floor[series]);
        Row::new(
            "throughput",
            &format!("proxy CPU per GB relayed, {path}"),
            "s/GB",
            Some(used),
        )
        .versus(floor_label, Some(floor), None)
        .target("≤ 0.6 s/GB", Some(used.median <= 0.6))
        .note(format!(
            "CPU time of the proxy process (its CPU clock, all threads) during each {size_mib} MiB download, {:.2}× [{:.2}–{:.2}] of the floor measured in this process right after it; of the floor's median, AES-GCM {:.2} s/GB and the two socket copies {:.2} s/GB",
            ratios.median, ratios.p25, ratios.p75,
            Stat::of(&aead[series]).median,
            Stat::of(&copies[series]).median,
        ))
    };
    vec![
        cpu_row(
            1,
            "UNIX socket",
            "floor: AES-128-GCM decryption of the same bytes (ring, 16 KiB records) + relaying them in plain from a TCP socket to a UNIX socket",
        ),
        cpu_row(
            2,
            "loopback TLS",
            "floor: AES-128-GCM decryption + encryption of the same bytes + relaying them in plain from one TCP socket to another",
        ),
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

/// CPU time (ns) process `pid` has used so far, all its threads together, those that already
/// exited included (the kernel's process CPU clock, `clock_getcpuclockid`). Summing the live
/// threads' `schedstat` instead went backwards when a thread exited during a trial (a
/// blocking-pool thread retiring), and the difference wrapped around.
#[allow(
    unsafe_code,
    reason = "two libc calls with out-pointers; no safe binding reads another process's CPU clock"
)]
pub(crate) fn process_cpu_ns(pid: u32) -> u64 {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: clock_getcpuclockid writes one clockid_t through the valid pointer it is given.
    let found = unsafe { libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) };
    assert_eq!(found, 0, "no CPU clock for process {pid}");
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through the valid pointer it is given.
    let read = unsafe { libc::clock_gettime(clock, &mut now) };
    assert_eq!(read, 0, "cannot read the CPU clock of process {pid}");
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// The CPU seconds per GB a relay spends in the kernel at minimum: `bytes` read from a loopback
/// TCP socket in 64 KiB reads and written to a UNIX socket (`to_tcp`: another loopback TCP
/// socket), as the proxy's two hops do, with no TLS. A feeder thread writes and a drain thread
/// reads the far ends; only the relaying thread's CPU clock counts. The kernel work of the TCP
/// receive path lands where it does for the proxy (loopback delivers in the sender's context).
pub(crate) fn copy_seconds_per_gb(bytes: u64, to_tcp: bool) -> f64 {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream as StdTcp};
    let chunk = 64 * 1024;
    let listener = TcpListener::bind("127.0.0.1:0").expect("floor listener");
    let addr = listener.local_addr().expect("floor address");
    let feeder = std::thread::spawn(move || {
        let mut s = StdTcp::connect(addr).expect("floor feeder");
        let block = vec![0x5au8; chunk];
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk as u64) as usize;
            s.write_all(&block[..n]).expect("floor feed");
            left -= n as u64;
        }
    });
    let (mut from, _) = listener.accept().expect("floor accept");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut sink = vec![0u8; chunk];
            while r.read(&mut sink).map(|n| n > 0).unwrap_or(false) {}
        })
    };
    let (mut to, drained): (Box<dyn Write>, _) = if to_tcp {
        let far = TcpListener::bind("127.0.0.1:0").expect("floor drain listener");
        let out = StdTcp::connect(far.local_addr().expect("drain address")).expect("drain connect");
        let (theirs, _) = far.accept().expect("drain accept");
        (Box::new(out), drain(Box::new(theirs)))
    } else {
        let (out, theirs) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        (Box::new(out), drain(Box::new(theirs)))
    };
    let mut buf = vec![0u8; chunk];
    let seconds = thread_cpu_seconds(|| loop {
        let n = from.read(&mut buf).expect("floor read");
        if n == 0 {
            break;
        }
        to.write_all(&buf[..n]).expect("floor write");
    });
    drop(to);
    feeder.join().expect("floor feeder thread");
    drained.join().expect("floor drain thread");
    seconds / (bytes as f64 / 1e9)
}

/// CPU seconds this thread spends in `work` (its own CPU clock: other processes and threads
/// sharing the cores do not count).
fn thread_cpu_seconds(work: impl FnOnce()) -> f64 {
    let clock = || rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    let start = clock();
    work();
    let end = clock();
    (end.tv_sec - start.tv_sec) as f64 + (end.tv_nsec - start.tv_nsec) as f64 / 1e9
}

/// The CPU seconds per GB of the AEAD work a proxy must do at minimum: AES-128-GCM opening of
/// `bytes` in 16 KiB records (the suite the upstream negotiates), and sealing them again when
/// `reseal`. Timed with this thread's CPU clock; each record is restored from its sealed copy
/// before it is opened again, and the time of those copies alone is taken apart and subtracted
/// (a relay opens records where they arrived, with no such copy).
pub(crate) fn aead_seconds_per_gb(bytes: u64, reseal: bool) -> f64 {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};
    let key = LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &[7u8; 16]).expect("AES key"));
    let record = 16 * 1024;
    let mut sealed = vec![0u8; record];
    let tag = key
        .seal_in_place_separate_tag(
            Nonce::assume_unique_for_key([0; 12]),
            Aad::empty(),
            &mut sealed,
        )
        .expect("seal");
    sealed.extend_from_slice(tag.as_ref());
    let mut work = sealed.clone();
    let records = bytes.div_ceil(record as u64);
    let copies = thread_cpu_seconds(|| {
        for _ in 0..records {
            work.copy_from_slice(&sealed);
            std::hint::black_box(&mut work);
        }
    });
    let seconds = thread_cpu_seconds(|| {
        for _ in 0..records {
            work.copy_from_slice(&sealed);
            let plain = key
                .open_in_place(
                    Nonce::assume_unique_for_key([0; 12]),
                    Aad::empty(),
                    &mut work,
                )
                .expect("open");
            if reseal {
                let tag = key
                    .seal_in_place_separate_tag(
                        Nonce::assume_unique_for_key([0; 12]),
                        Aad::empty(),
                        plain,
                    )
                    .expect("seal");
                let _ = std::hint::black_box(tag);
            }
        }
    });
    (seconds - copies).max(0.0) / (bytes as f64 / 1e9)
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

/// What [`downloads`] measured, per proxy and round.
pub(crate) struct Downloads {
    /// Bytes per download.
    pub size: u64,
    /// The proxy's CPU seconds per GB.
    pub cpu: Vec<Vec<f64>>,
    /// MB/s.
    pub rate: Vec<Vec<f64>>,
    /// Context switches per MB (all the relay's threads): how often it slept and was woken,
    /// which tells apart rounds of the same download that cost different CPU.
    pub switches: Vec<Vec<f64>>,
    /// AES-128-GCM alone on the download's bytes, s/GB ([`aead_seconds_per_gb`]), taken right
    /// after each round of the relay `aes_after` names (empty when it names none).
    pub aes: Vec<f64>,
}

/// Alternating 64 MiB downloads over one keep-alive connection per `(conn, whose)`, for
/// `rounds` rounds: per relay, its CPU seconds per GB (`whose`'s CPU clock: a process's, or a
/// floor relay's thread's), MB/s and context switches per MB per round; after each round of
/// relay `aes_after`, AES-GCM alone on the same bytes.
pub(crate) async fn downloads(
    relays: &mut [(Conn, Whose)],
    rounds: usize,
    aes_after: Option<usize>,
) -> Downloads {
    let size: u64 = pick(64, 16) << 20;
    let path = format!("/bytes?n={size}");
    let mut buf = vec![0u8; 256 * 1024];
    for (c, _) in relays.iter_mut() {
        c.get(&path, &mut buf).await;
    }
    let mut cpu = vec![Vec::new(); relays.len()];
    let mut rate = vec![Vec::new(); relays.len()];
    let mut switches = vec![Vec::new(); relays.len()];
    let mut aes = Vec::new();
    for series in schedule(rounds, relays.len()) {
        let (conn, whose) = &mut relays[series];
        let switches_before = whose.switches();
        let before = whose.cpu_ns();
        let start = Instant::now();
        let got = conn.get(&path, &mut buf).await as f64;
        rate[series].push(got / start.elapsed().as_secs_f64() / 1e6);
        cpu[series].push((whose.cpu_ns() - before) as f64 / 1e9 / (got / 1e9));
        let switched = whose.switches().since(&switches_before);
        switches[series].push(switched as f64 / (got / 1e6));
        if aes_after == Some(series) {
            aes.push(aead_seconds_per_gb(size, false));
        }
    }
    Downloads {
        size,
        cpu,
        rate,
        switches,
        aes,
    }
}

/// A plain keep-alive connection to a relay's UNIX socket.
pub(crate) async fn unix_conn(socket: &Path) -> Conn {
    Conn::Unix(UnixStream::connect(socket).await.expect("UNIX"))
}

/// Every thread of some processes, and of the bench itself, kept on one CPU until dropped.
///
/// On two cores a relay's CPU per GB depends on where the scheduler puts it: the same download
/// cost hwkey and ghostunnel alike up to twice the CPU in one round as in the next, and their
/// context switches per MB tell those rounds apart (docs/BENCHMARKS.md, issue 38 round three).
/// On one core every relay takes turns with its sender and receiver, so the rounds agree. The
/// relays keep the threads they sized for two CPUs (hwkey's two connection runtimes, Go's
/// GOMAXPROCS), now sharing one.
pub(crate) struct OneCore {
    /// Each pinned process with the CPUs its first thread had before.
    before: Vec<(u32, rustix::thread::CpuSet)>,
    cpu: usize,
}

impl OneCore {
    /// Pins `pids` (all their threads) and this process to the last CPU this thread may run
    /// on; None (said on stderr) when affinity cannot be set here.
    pub(crate) fn pin(pids: &[u32]) -> Option<OneCore> {
        let mine = match rustix::thread::sched_getaffinity(None) {
            Ok(set) => set,
            Err(e) => {
                eprintln!("e2e: cannot read this thread's CPU affinity ({e}): no one-core figures");
                return None;
            }
        };
        let Some(cpu) = (0..rustix::thread::CpuSet::MAX_CPU)
            .rev()
            .find(|&c| mine.is_set(c))
        else {
            eprintln!("e2e: this thread may run on no CPU it can name: no one-core figures");
            return None;
        };
        let mut before = Vec::new();
        for pid in pids.iter().copied().chain([std::process::id()]) {
            match rustix::process::Pid::from_raw(pid as i32)
                .map(|p| rustix::thread::sched_getaffinity(Some(p)))
            {
                Some(Ok(set)) => before.push((pid, set)),
                _ => {
                    eprintln!("e2e: cannot read process {pid}'s CPU affinity: no one-core figures");
                    return None;
                }
            }
        }
        let pinned = OneCore { before, cpu };
        let mut one = rustix::thread::CpuSet::new();
        one.set(cpu);
        for (pid, _) in &pinned.before {
            if let Err(e) = settle(*pid, one) {
                eprintln!("e2e: cannot pin process {pid} to CPU {cpu} ({e}): no one-core figures");
                return None; // dropping `pinned` restores what was pinned
            }
        }
        Some(pinned)
    }

    /// Threads of the pinned processes that run elsewhere now (started by a thread not yet
    /// pinned while the pinning went on); 0 is what the figures need.
    pub(crate) fn escaped(&self) -> usize {
        let mut out = 0;
        for (pid, _) in &self.before {
            for tid in tasks(*pid) {
                match rustix::thread::sched_getaffinity(Some(tid)) {
                    Ok(set) if set.count() == 1 && set.is_set(self.cpu) => {}
                    Ok(_) => out += 1,
                    Err(_) => {} // exited
                }
            }
        }
        out
    }
}

impl Drop for OneCore {
    fn drop(&mut self) {
        // Every thread, those started while pinned included, gets its process's CPUs back.
        for (pid, set) in &self.before {
            if let Err(e) = settle(*pid, *set) {
                eprintln!("e2e: could not give process {pid} its CPUs back ({e})");
            }
        }
    }
}

/// The threads of `pid` now.
fn tasks(pid: u32) -> Vec<rustix::process::Pid> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|t| {
                let name = t.ok()?.file_name();
                rustix::process::Pid::from_raw(name.to_str()?.parse().ok()?)
            })
            .collect()
        })
        .unwrap_or_default()
}

/// Gives every thread of `pid` the affinity `target`, again and again until a pass finds every
/// thread already set (a thread started meanwhile by one not yet set is caught by the next
/// pass); at most 20 passes.
fn settle(pid: u32, target: rustix::thread::CpuSet) -> std::io::Result<()> {
    for _ in 0..20 {
        let mut changed = false;
        for tid in tasks(pid) {
            match rustix::thread::sched_getaffinity(Some(tid)) {
                Ok(set) if set == target => continue,
                Ok(_) => {}
                Err(rustix::io::Errno::SRCH) => continue, // exited
                Err(e) => return Err(e.into()),
            }
            match rustix::thread::sched_setaffinity(Some(tid), &target) {
                Ok(()) => changed = true,
                Err(rustix::io::Errno::SRCH) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if !changed {
            return Ok(());
        }
    }
    Err(std::io::Error::other(format!(
        "process {pid} kept starting threads faster than they could be set"
    )))
}
