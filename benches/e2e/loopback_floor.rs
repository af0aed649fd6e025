//! The loopback path's floor: the least a relay can spend doing the proxy's job for kubectl and
//! kubelet, which reach it over loopback TLS. One thread, epoll (level-triggered, readable
//! only), no runtime: it terminates TLS from the client with the proxy's own loopback server
//! configuration (`proxy::listener::loopback_server_config`) and speaks TLS
//! to the upstream on the proxy's crypto provider (`pki::tls::provider`: its suites, and its key
//! exchange with the hybrid first, as the proxy originates TLS), opening each read's records and sealing
//! their plain bytes into the other side's records in one pass, with one read and one write per
//! hop and direction. The handshakes are done at accept, blocking, on the relay's thread (its
//! CPU clock counts them, as the proxy's counts its own).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustix::event::epoll;
use rustls::{ClientConfig, Connection, ServerConfig, ServerConnection};

/// The read size: the proxy's largest read-ahead.
const COPY: usize = 64 * 1024;

/// One client, its upstream, and the TLS state of each.
struct Pair {
    client: TcpStream,
    local: Connection,
    upstream: TcpStream,
    remote: Connection,
}

/// The event loop: token 0 is the listener, 2i+1 client i, 2i+2 its upstream.
pub(super) fn serve(
    listener: TcpListener,
    upstream_port: u16,
    server: &Arc<ServerConfig>,
    client: &Arc<ClientConfig>,
    stop: &AtomicBool,
) {
    let ep = epoll::create(epoll::CreateFlags::CLOEXEC).expect("epoll");
    let readable = epoll::EventFlags::IN;
    epoll::add(&ep, &listener, epoll::EventData::new_u64(0), readable).expect("epoll add");
    let mut pairs: Vec<Option<Pair>> = Vec::new();
    let mut events = Vec::with_capacity(64);
    let mut buf = vec![0u8; 2 * COPY];
    let tick = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 100_000_000,
    };
    while !stop.load(Ordering::SeqCst) {
        events.clear();
        epoll::wait(
            &ep,
            rustix::buffer::spare_capacity(&mut events),
            Some(&tick),
        )
        .expect("epoll wait");
        for event in events.drain(..) {
            let token = event.data.u64() as usize;
            if token == 0 {
                let Some(mut pair) = accept(&listener, upstream_port, server, client) else {
                    continue;
                };
                let i = pairs.len() as u64;
                let (c, u) = (2 * i + 1, 2 * i + 2);
                epoll::add(&ep, &pair.client, epoll::EventData::new_u64(c), readable)
                    .expect("epoll add");
                epoll::add(&ep, &pair.upstream, epoll::EventData::new_u64(u), readable)
                    .expect("epoll add");
                // Plain bytes that came with the client's last handshake flight.
                let (_, plain) = buf.split_at_mut(COPY);
                let moved = forward(&mut pair.local, &mut pair.remote, plain)
                    && flush(&mut pair.remote, &mut pair.upstream);
                pairs.push(moved.then_some(pair));
                continue;
            }
            let i = (token - 1) / 2;
            let Some(pair) = &mut pairs[i] else { continue };
            let moved = if token % 2 == 1 {
                relay_once(
                    &mut pair.client,
                    &mut pair.local,
                    &mut pair.remote,
                    &mut pair.upstream,
                    &mut buf,
                )
            } else {
                relay_once(
                    &mut pair.upstream,
                    &mut pair.remote,
                    &mut pair.local,
                    &mut pair.client,
                    &mut buf,
                )
            };
            if !moved {
                pairs[i] = None; // closing both deregisters them
            }
        }
    }
}

/// Accepts a client, completes its TLS handshake, and opens its upstream connection (TLS
/// handshake done); None when the client went away meanwhile.
fn accept(
    listener: &TcpListener,
    upstream_port: u16,
    server: &Arc<ServerConfig>,
    client: &Arc<ClientConfig>,
) -> Option<Pair> {
    let (mut sock, _) = listener.accept().ok()?;
    sock.set_nodelay(true).ok()?;
    let mut local = ServerConnection::new(server.clone()).expect("floor server TLS");
    while local.is_handshaking() {
        local.complete_io(&mut sock).ok()?;
    }
    while local.wants_write() {
        local.write_tls(&mut sock).ok()?;
    }
    let mut upstream =
        TcpStream::connect(("127.0.0.1", upstream_port)).expect("loopback floor upstream");
    upstream.set_nodelay(true).expect("nodelay");
    let mut remote = super::floor_tls::handshake(client, &mut upstream);
    // A read's plain bytes are sealed whole and written in one go: no limit on what waits.
    local.set_buffer_limit(None);
    remote.set_buffer_limit(None);
    Some(Pair {
        client: sock,
        local: local.into(),
        upstream,
        remote: remote.into(),
    })
}

/// One read of `from`'s records (it is readable), opened, their plain bytes sealed into
/// `to_tls`'s records and written to `to` in one go; false at end of stream or on an error.
fn relay_once(
    from: &mut TcpStream,
    from_tls: &mut Connection,
    to_tls: &mut Connection,
    to: &mut TcpStream,
    buf: &mut [u8],
) -> bool {
    let (ahead, plain) = buf.split_at_mut(COPY);
    let n = match from.read(ahead) {
        Ok(0) | Err(_) => return false,
        Ok(n) => n,
    };
    let mut records = &ahead[..n];
    while !records.is_empty() {
        if from_tls.read_tls(&mut records).is_err() || from_tls.process_new_packets().is_err() {
            return false;
        }
        if !forward(from_tls, to_tls, plain) {
            return false;
        }
    }
    // What the reading side owes its peer (a ticket, a key update), then the sealed bytes.
    flush(from_tls, from) && flush(to_tls, to)
}

/// Moves every plain byte `from` has opened into `to`'s writer; false when `from` was closed.
fn forward(from: &mut Connection, to: &mut Connection, plain: &mut [u8]) -> bool {
    loop {
        match from.reader().read(plain) {
            Ok(0) => return false,
            Ok(n) => {
                if to.writer().write_all(&plain[..n]).is_err() {
                    return false;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(_) => return false,
        }
    }
}

/// Writes every pending record (one `writev` each time, as the proxy's stream does).
fn flush(tls: &mut Connection, sock: &mut TcpStream) -> bool {
    while tls.wants_write() {
        if tls.write_tls(sock).is_err() {
            return false;
        }
    }
    true
}
