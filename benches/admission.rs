//! What admitting a loopback TCP connection by its peer's uid costs (issue 22): one
//! `NETLINK_SOCK_DIAG` lookup per accepted connection (`proxy::admission::tcp_peer_uid`),
//! against the least any new loopback connection costs, a TCP connect + accept, measured in the
//! same rounds. Printed; docs/BENCHMARKS.md quotes the figures (hand-written section).

use std::time::Instant;

use support::bench as common;

fn main() {
    if common::skip_unless_cargo_bench("admission") {
        return;
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let n = common::pick(5000, 500);
    let mut ratios = Vec::new();
    for round in 0..5 {
        let started = Instant::now();
        let mut held = Vec::new();
        for _ in 0..n {
            let client = std::net::TcpStream::connect(addr).expect("connect");
            let (server, _) = listener.accept().expect("accept");
            held.push((client, server));
            if held.len() > 50 {
                held.clear();
            }
        }
        let connect = started.elapsed().as_secs_f64() / n as f64;
        let client = std::net::TcpStream::connect(addr).expect("connect");
        let (server, peer) = listener.accept().expect("accept");
        let local = server.local_addr().expect("local");
        let started = Instant::now();
        for _ in 0..n {
            assert!(hwkey::proxy::admission::tcp_peer_uid(peer, local).is_some());
        }
        let lookup = started.elapsed().as_secs_f64() / n as f64;
        drop(client);
        ratios.push(lookup / connect);
        println!(
            "admission round {round}: uid lookup {:.1} µs, loopback connect + accept {:.1} µs, ratio {:.2}",
            lookup * 1e6,
            connect * 1e6,
            lookup / connect
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "admission: uid lookup ÷ connect + accept, median {:.2} [{:.2}–{:.2}] over 5 rounds",
        ratios[2], ratios[1], ratios[3]
    );
}
