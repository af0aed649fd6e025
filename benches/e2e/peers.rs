//! Issue 38's comparisons with ghostunnel 1.11.1 that the other steps do not make, in the same
//! rounds: new connections with 8 clients at once, and the proxy's CPU per GB of a bulk
//! download. Both proxies listen on a UNIX socket in front of the same upstream and sign with
//! the same SoftHSM key; the series alternate, and ratios are taken per round.
//!
//! The bulk figures are taken twice: as the scheduler places the processes on both cores,
//! and with everything on one core ([`OneCore`]). On two cores the same download costs a
//! relay up to twice the CPU in one round as in the next, depending on whether it ran beside
//! its sender and receiver or took turns with them (docs/BENCHMARKS.md, issue 38 round
//! three); on one core the rounds agree. Beside them, the bytes-only floor relay plus AES-GCM
//! alone is the least a relay on `read`/`write` spent per GB in the same rounds.

use super::*;

/// hwkey ÷ ghostunnel: new connections per second and CPU per connection with 8 clients, CPU
/// per GB and MB/s of a 64 MiB download. Nothing when ghostunnel is not on this machine.
pub(crate) async fn against_ghostunnel(f: &Fixture) -> Vec<Row> {
    let Some(ghost) = Ghostunnel::start(f) else {
        return Vec::new();
    };
    let peers = [
        (f.proxy.socket.clone(), f.proxy.guard.id()),
        (ghost.socket.clone(), ghost.guard.id()),
    ];
    let mut rows = new_connections(f, &peers).await;
    rows.extend(bulk(f, &peers).await);
    rows
}

/// One round's figures for one proxy.
#[derive(Default)]
struct Series {
    rate: Vec<f64>,
    cpu: Vec<f64>,
}

/// 8 clients, each opening a connection, sending `GET /version`, reading the answer and
/// closing, over and over.
async fn new_connections(f: &Fixture, peers: &[(PathBuf, u32); 2]) -> Vec<Row> {
    let clients = 8;
    let per_client = pick(100, 20);
    let rounds = pick(5, 2);
    let round = |socket: PathBuf| async move {
        let runs = (0..clients).map(|_| {
            let socket = socket.clone();
            async move {
                let mut buf = vec![0u8; 4096];
                for _ in 0..per_client {
                    let mut s = UnixStream::connect(&socket).await.expect("connect");
                    http1_get(&mut s, "/version", &mut buf).await;
                }
            }
        });
        futures::future::join_all(runs).await;
    };
    // Warm: the proxy's upstream session, ghostunnel's first connection.
    for (socket, _) in peers {
        round(socket.clone()).await;
    }
    let sigs_before = f.proxy.signatures();
    let mut series = [Series::default(), Series::default()];
    for i in schedule(rounds, 2) {
        let (socket, pid) = &peers[i];
        let cpu_before = process_cpu_ns(*pid);
        let start = Instant::now();
        round(socket.clone()).await;
        let n = (clients * per_client) as f64;
        series[i].rate.push(n / start.elapsed().as_secs_f64());
        series[i]
            .cpu
            .push((process_cpu_ns(*pid) - cpu_before) as f64 / 1e3 / n);
    }
    let sigs = f.proxy.signatures() - sigs_before;
    let [hw, gt] = &series;
    vec![
        at_least(
            ratio_row(
                "against ghostunnel",
                "new connections/s vs ghostunnel, 8 clients at once, UNIX socket",
                "conn/s",
                &hw.rate,
                "ghostunnel 1.11.1",
                &gt.rate,
            ),
            2.0,
        )
        .note(format!(
            "each connection: connect, GET /version, close; hwkey's hardware signatures in the timed rounds: {sigs} for {} connections (it resumes its upstream sessions)",
            clients * per_client * rounds
        )),
        ratio_row(
            "against ghostunnel",
            "proxy CPU per new connection vs ghostunnel, 8 clients at once, UNIX socket",
            "µs",
            &hw.cpu,
            "ghostunnel 1.11.1",
            &gt.cpu,
        ),
    ]
}

/// One keep-alive connection per relay downloading 64 MiB per round: hwkey, ghostunnel and the
/// bytes-only floor relay (the client does the TLS through it), first as the scheduler places
/// them on both cores, then all on one core ([`OneCore`]). Beside each, the least a relay on
/// `read`/`write` spent here: the bytes floor's thread plus AES-GCM alone on the same bytes.
async fn bulk(f: &Fixture, peers: &[(PathBuf, u32); 2]) -> Vec<Row> {
    let floor = FloorRelay::start(f.upstream.port());
    let mut relays = [
        (unix_conn(&peers[0].0).await, Whose::Process(peers[0].1)),
        (unix_conn(&peers[1].0).await, Whose::Process(peers[1].1)),
        (
            Conn::TlsUnix(Box::new(tls_connect_unix(&f.direct, &floor.socket).await)),
            Whose::Task(floor.task_dir()),
        ),
    ];
    let rounds = pick(15, 2);
    let free = downloads(&mut relays, rounds, Some(2)).await;
    let mut rows = bulk_rows(&free, "", None);
    let Some(pinned) = OneCore::pin(&[peers[0].1, peers[1].1]) else {
        return rows;
    };
    let one = downloads(&mut relays, rounds, Some(2)).await;
    let escaped = pinned.escaped();
    drop(pinned);
    let note = format!(
        "hwkey's two connection runtimes and ghostunnel's GOMAXPROCS were sized for two CPUs and \
         share one; threads found off the core after the downloads: {escaped}"
    );
    rows.extend(bulk_rows(&one, ", all on one core", Some(note)));
    rows
}

/// The rows of one set of downloads; `how` is added to each measure. Issue 38's goal is judged
/// on the one-core set (`one_core` holds its caveat): on two cores the figure follows the
/// scheduler's placement more than the relay.
fn bulk_rows(d: &Downloads, how: &str, one_core: Option<String>) -> Vec<Row> {
    let Downloads {
        size,
        cpu,
        rate,
        switches,
        aes,
    } = d;
    let mib = size >> 20;
    let median = |v: &[f64]| Stat::of(v).median;
    // Per round, how the CPU went with the context switches (on two cores the rounds' spread
    // is wide, and the switches tell the kinds of rounds apart).
    for (who, (c, s)) in ["hwkey", "ghostunnel", "bytes floor"]
        .iter()
        .zip(cpu.iter().zip(switches))
    {
        let rounds: Vec<String> = c
            .iter()
            .zip(s)
            .map(|(c, s)| format!("{c:.2} s/GB {s:.0}/MB"))
            .collect();
        eprintln!("e2e: downloads{how} through {who}: {}", rounds.join(", "));
    }
    let switches_note = format!(
        "context switches per MB relayed: hwkey {:.0}, ghostunnel {:.0}, bytes floor relay {:.0} (medians)",
        median(&switches[0]),
        median(&switches[1]),
        median(&switches[2])
    );
    let vs_ghost = ratio_row(
        "against ghostunnel",
        &format!("proxy CPU per GB relayed vs ghostunnel, {mib} MiB download, UNIX socket{how}"),
        "s/GB",
        &cpu[0],
        "ghostunnel 1.11.1",
        &cpu[1],
    );
    let vs_ghost = match &one_core {
        Some(caveat) => {
            let met = vs_ghost.ratio.map(|r| r.median <= 0.5);
            vs_ghost
                .target("≤ 0.5×", met)
                .note(format!("{switches_note}; {caveat}"))
        }
        None => vs_ghost.note(format!(
            "{switches_note}; issue 38's goal (≤ 0.5×) is judged on the one-core row: here the figure follows where the scheduler puts each relay"
        )),
    };
    // Per round: the bytes floor's thread (64 KiB reads, one thread, epoll, paced as here: its
    // client decrypts) plus AES-GCM alone taken right after it.
    let least: Vec<f64> = cpu[2].iter().zip(aes).map(|(k, a)| k + a).collect();
    let parts = format!(
        "bytes floor relay {:.3} s/GB (its thread's CPU: its reads and writes of the same bytes, in 64 KiB reads, one thread, epoll, as paced here) + AES-128-GCM alone {:.3} s/GB (ring, 16 KiB records, taken after each of its rounds)",
        median(&cpu[2]),
        median(aes)
    );
    vec![
        vs_ghost,
        ratio_row(
            "against ghostunnel",
            &format!("download {mib} MiB vs ghostunnel, UNIX socket{how}"),
            "MB/s",
            &rate[0],
            "ghostunnel 1.11.1",
            &rate[1],
        ),
        ratio_row(
            "against ghostunnel",
            &format!(
                "least CPU per GB of a relay on read/write (bytes floor + AES-GCM) vs ghostunnel, {mib} MiB download{how}"
            ),
            "s/GB",
            &least,
            "ghostunnel 1.11.1",
            &cpu[1],
        )
        .note(parts.clone()),
        ratio_row(
            "against ghostunnel",
            &format!(
                "proxy CPU per GB relayed vs the least of a relay on read/write, {mib} MiB download{how}"
            ),
            "s/GB",
            &cpu[0],
            "bytes floor + AES-GCM",
            &least,
        )
        .note(parts),
    ]
}
