//! Issue 38's comparisons with ghostunnel 1.11.1 that the other steps do not make, in the same
//! rounds: new connections with 8 clients at once, and the proxy's CPU per GB of a bulk
//! download. Both proxies listen on a UNIX socket in front of the same upstream and sign with
//! the same SoftHSM key; the series alternate, and ratios are taken per round.

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
    rows.extend(bulk(&peers).await);
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

/// One keep-alive connection per proxy downloading 64 MiB per round.
async fn bulk(peers: &[(PathBuf, u32); 2]) -> Vec<Row> {
    let sockets = [
        (peers[0].0.as_path(), peers[0].1),
        (peers[1].0.as_path(), peers[1].1),
    ];
    let (size, cpu, rate) = downloads(&sockets, pick(7, 2)).await;
    let cpu_row = ratio_row(
        "against ghostunnel",
        &format!(
            "proxy CPU per GB relayed vs ghostunnel, {} MiB download, UNIX socket",
            size >> 20
        ),
        "s/GB",
        &cpu[0],
        "ghostunnel 1.11.1",
        &cpu[1],
    );
    let met = cpu_row.ratio.map(|r| r.median <= 0.5);
    vec![
        cpu_row.target("≤ 0.5×", met),
        ratio_row(
            "against ghostunnel",
            &format!("download {} MiB vs ghostunnel, UNIX socket", size >> 20),
            "MB/s",
            &rate[0],
            "ghostunnel 1.11.1",
            &rate[1],
        ),
    ]
}
