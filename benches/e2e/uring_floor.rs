//! The bytes floor on io_uring (issue 38 asks "whether io_uring lowers CPU per request on this
//! kernel"). The same relay as [`super::floor`]'s bytes mode — one thread, UNIX clients, a
//! loopback TCP connection upstream per client, the client's TLS passing through, 64 KiB per
//! read — with its socket work done through an io_uring instead of epoll and `read`/`write`:
//! a receive is always pending on each socket, a completed receive becomes a send to the other
//! side, and a completed send becomes the next receive. One `io_uring_enter` submits what the
//! completions asked for and waits for the next ones. The ring is set up the way a relay that
//! wants io_uring's best would set it up: one thread submits (`SINGLE_ISSUER`) and completions
//! run only when that thread asks for them (`DEFER_TASKRUN`, no interrupts of its work).
//!
//! The proxy's cost above the epoll floor is its own user-space work (docs/BENCHMARKS.md), so
//! io_uring can only lower the proxy's CPU per request by what it lowers the floor's: if this
//! floor is not below the epoll floor, a runtime on io_uring has nothing to win here.

use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream as StdUnix};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};
use rustls::ClientConfig;

/// The relay's receive size: the epoll floor's and the proxy's largest read.
const COPY: usize = 64 * 1024;

/// The listener's readiness; other operations carry `pair << 2 | op`.
const ACCEPT: u64 = u64::MAX;
/// The four operations of a pair, in its user data's low two bits.
const RECV_CLIENT: u64 = 0;
const RECV_UPSTREAM: u64 = 1;
const SEND_UPSTREAM: u64 = 2;
const SEND_CLIENT: u64 = 3;

/// One direction's bytes: received into `buf`; sent on from `buf[..len]` (bytes mode) or from
/// `out[..len]` (TLS mode: the records sealed, or the plain bytes opened, by rustls),
/// `sent` of them so far. One operation per direction is in flight at a time, so neither is
/// touched while the kernel holds it.
struct Direction {
    /// A `Vec`, not a `Box`: the kernel writes into it while Rust code holds the pair, and a
    /// `Box` asserts unique access wherever it is moved.
    buf: Vec<u8>,
    out: Vec<u8>,
    len: usize,
    sent: usize,
}

impl Direction {
    fn new() -> Direction {
        Direction {
            buf: vec![0u8; COPY],
            out: Vec::with_capacity(COPY + 1024),
            len: 0,
            sent: 0,
        }
    }

    /// What is still to be sent.
    fn rest(&self, tls: bool) -> &[u8] {
        let from = if tls { &self.out[..] } else { &self.buf[..] };
        &from[self.sent..self.len]
    }
}

/// One client, its upstream connection, a buffer per direction, and how many of its
/// operations the kernel still holds (its sockets and buffers live until that is 0).
struct Pair {
    client: StdUnix,
    upstream: std::net::TcpStream,
    up: Direction,
    down: Direction,
    in_flight: u32,
    closing: bool,
    /// TLS mode: the connection to the upstream (its handshake done at accept).
    tls: Option<rustls::ClientConnection>,
}

impl Pair {
    /// Both sockets shut down, so the kernel completes the operations still pending on them.
    fn close(&mut self) {
        if !self.closing {
            self.closing = true;
            let _ = self.client.shutdown(std::net::Shutdown::Both);
            let _ = self.upstream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// The operation `op` of pair `i`, on this pair's sockets and buffers.
    fn entry(&mut self, i: usize, op: u64) -> squeue::Entry {
        let client = types::Fd(self.client.as_raw_fd());
        let upstream = types::Fd(self.upstream.as_raw_fd());
        let entry = match op {
            RECV_CLIENT => opcode::Recv::new(client, self.up.buf.as_mut_ptr(), COPY as u32).build(),
            RECV_UPSTREAM => {
                opcode::Recv::new(upstream, self.down.buf.as_mut_ptr(), COPY as u32).build()
            }
            SEND_UPSTREAM => {
                let rest = self.up.rest(self.tls.is_some());
                opcode::Send::new(upstream, rest.as_ptr(), rest.len() as u32)
                    .flags(libc::MSG_NOSIGNAL)
                    .build()
            }
            _ => {
                let rest = self.down.rest(self.tls.is_some());
                opcode::Send::new(client, rest.as_ptr(), rest.len() as u32)
                    .flags(libc::MSG_NOSIGNAL)
                    .build()
            }
        };
        self.in_flight += 1;
        entry.user_data((i as u64) << 2 | op)
    }

    /// What follows the completion of `op` with `result`: the next operation, or None when
    /// the pair is done (end of stream or an error).
    fn next(&mut self, op: u64, result: i32) -> Option<u64> {
        if result <= 0 || self.closing {
            return None;
        }
        let n = result as usize;
        let (dir, send) = match op {
            RECV_CLIENT | SEND_UPSTREAM => (&mut self.up, SEND_UPSTREAM),
            _ => (&mut self.down, SEND_CLIENT),
        };
        match op {
            RECV_CLIENT | RECV_UPSTREAM => {
                dir.sent = 0;
                dir.len = match &mut self.tls {
                    None => n,
                    Some(tls) if op == RECV_CLIENT => seal(tls, &dir.buf[..n], &mut dir.out)?,
                    Some(tls) => open(tls, &dir.buf[..n], &mut dir.out)?,
                };
                // A record not yet whole: receive the rest of it first.
                Some(if dir.len == 0 { op } else { send })
            }
            _ => {
                dir.sent += n;
                if dir.sent < dir.len {
                    Some(send)
                } else if op == SEND_UPSTREAM {
                    Some(RECV_CLIENT)
                } else {
                    Some(RECV_UPSTREAM)
                }
            }
        }
    }
}

/// Seals the client's `plain` bytes into records in `out`; their length.
fn seal(tls: &mut rustls::ClientConnection, plain: &[u8], out: &mut Vec<u8>) -> Option<usize> {
    use std::io::Write;
    tls.writer().write_all(plain).ok()?;
    out.clear();
    while tls.wants_write() {
        tls.write_tls(out).ok()?;
    }
    Some(out.len())
}

/// Opens the upstream's `records` (rustls takes at most 4 KiB per `read_tls`) into plain bytes
/// in `out`; their length (0 when no record is whole yet). None also when rustls has to answer
/// (a key update): a send of the other direction may be in flight, and writing past it would
/// reorder the stream, so the pair ends instead (the benchmark's keep-alive traffic never asks).
fn open(
    tls: &mut rustls::ClientConnection,
    mut records: &[u8],
    out: &mut Vec<u8>,
) -> Option<usize> {
    use std::io::Read;
    out.clear();
    while !records.is_empty() {
        tls.read_tls(&mut records).ok()?;
        tls.process_new_packets().ok()?;
        match tls.reader().read_to_end(out) {
            Ok(_) => return None, // the upstream closed the connection
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(_) => return None,
        }
    }
    if tls.wants_write() {
        return None;
    }
    Some(out.len())
}

/// Queues `entry`, submitting what is queued first when the submission queue is full.
#[allow(
    unsafe_code,
    reason = "io_uring's submission is unsafe: the kernel uses the buffers until completion"
)]
fn push(ring: &mut IoUring, entry: &squeue::Entry) {
    loop {
        // SAFETY: every entry points into a `Pair`'s heap buffers (or at no buffer, for the
        // listener's poll); a pair and its sockets are dropped only when the kernel holds none
        // of its operations (`in_flight == 0`), and pairs still holding some at the end are
        // leaked rather than freed. The buffers' heap memory does not move when `pairs` grows,
        // and a direction's `out` is only rewritten when its own operation has completed.
        if unsafe { ring.submission().push(entry) }.is_ok() {
            return;
        }
        ring.submit().expect("io_uring submit");
    }
}

/// The floor's ring: one thread submits, completions run when it asks for them (kernel 6.1 or
/// later, `kernel.io_uring_disabled` = 0). Made on the thread that uses it.
pub(super) fn ring() -> std::io::Result<IoUring> {
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_cqsize(4096)
        .build(1024)
}

/// The event loop until `stop`.
pub(super) fn serve(
    listener: UnixListener,
    upstream_port: u16,
    tls: Option<Arc<ClientConfig>>,
    stop: &AtomicBool,
) {
    let mut ring = ring().expect("io_uring");
    listener
        .set_nonblocking(true)
        .expect("nonblocking listener");
    let readable = libc::POLLIN as u32;
    let poll_listener = || {
        opcode::PollAdd::new(types::Fd(listener.as_raw_fd()), readable)
            .build()
            .user_data(ACCEPT)
    };
    push(&mut ring, &poll_listener());
    let mut pairs: Vec<Option<Pair>> = Vec::new();
    let tick = types::Timespec::from(Duration::from_millis(100));
    let args = types::SubmitArgs::new().timespec(&tick);
    let mut done = Vec::with_capacity(256);
    while !stop.load(Ordering::SeqCst) {
        match ring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR)) => {}
            Err(e) => panic!("io_uring_enter: {e}"),
        }
        done.clear();
        done.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        for &(data, result) in &done {
            if data == ACCEPT {
                while let Ok((client, _)) = listener.accept() {
                    client.set_nonblocking(false).expect("blocking client");
                    let mut upstream = std::net::TcpStream::connect(("127.0.0.1", upstream_port))
                        .expect("floor upstream");
                    upstream.set_nodelay(true).expect("nodelay");
                    let tls = tls
                        .as_ref()
                        .map(|config| super::floor_tls::handshake(config, &mut upstream));
                    let i = pairs.len();
                    let mut pair = Pair {
                        client,
                        upstream,
                        up: Direction::new(),
                        down: Direction::new(),
                        in_flight: 0,
                        closing: false,
                        tls,
                    };
                    let recv_client = pair.entry(i, RECV_CLIENT);
                    let recv_upstream = pair.entry(i, RECV_UPSTREAM);
                    pairs.push(Some(pair));
                    push(&mut ring, &recv_client);
                    push(&mut ring, &recv_upstream);
                }
                push(&mut ring, &poll_listener());
                continue;
            }
            let (i, op) = ((data >> 2) as usize, data & 3);
            let Some(pair) = &mut pairs[i] else { continue };
            pair.in_flight -= 1;
            match pair.next(op, result) {
                Some(next) => {
                    let entry = pair.entry(i, next);
                    push(&mut ring, &entry);
                }
                None => {
                    pair.close();
                    if pair.in_flight == 0 {
                        pairs[i] = None;
                    }
                }
            }
        }
    }
    drain(&mut ring, pairs);
}

/// Shuts every pair down and waits (at most a second) for the kernel to give their operations
/// back; a pair it still holds then is leaked, never freed under it.
fn drain(ring: &mut IoUring, mut pairs: Vec<Option<Pair>>) {
    for pair in pairs.iter_mut().flatten() {
        pair.close();
    }
    let deadline = Instant::now() + Duration::from_secs(1);
    let tick = types::Timespec::from(Duration::from_millis(10));
    let args = types::SubmitArgs::new().timespec(&tick);
    while pairs.iter().flatten().any(|p| p.in_flight > 0) && Instant::now() < deadline {
        let _ = ring.submitter().submit_with_args(1, &args);
        let done: Vec<u64> = ring.completion().map(|c| c.user_data()).collect();
        for data in done {
            if data == ACCEPT {
                continue;
            }
            if let Some(pair) = &mut pairs[(data >> 2) as usize] {
                pair.in_flight -= 1;
            }
        }
    }
    for pair in pairs.into_iter().flatten() {
        if pair.in_flight > 0 {
            std::mem::forget(pair);
        }
    }
}
