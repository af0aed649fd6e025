//! The least any user-space relay can spend on one keep-alive request on this machine: a relay
//! with no TLS, no runtime and no allocation, in one thread. It accepts on a UNIX socket, opens
//! a loopback TCP connection to the upstream per client, and copies bytes both ways; the client
//! speaks TLS *through* it to the upstream, so the bytes and the socket calls per request are
//! the proxy's (one read and one write per hop and direction) and so are the kernel's wake-ups
//! of the client and the upstream, which the writer pays for. Sockets are registered for
//! readability only (level-triggered): nothing wakes the relay but bytes to copy.
//!
//! What the proxy spends above this floor is what its own code (TLS, runtime, bookkeeping)
//! costs; the floor itself is the kernel's, and no relay built on `read`/`write` goes below it.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream as StdUnix};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;

use rustix::event::epoll;

use super::*;

/// The floor relay's thread; stopped on drop.
pub(crate) struct FloorRelay {
    pub(crate) socket: PathBuf,
    tid: Arc<AtomicI32>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

/// One client and its upstream connection.
struct Pair {
    client: StdUnix,
    upstream: std::net::TcpStream,
}

impl FloorRelay {
    pub(crate) fn start(upstream_port: u16) -> FloorRelay {
        let dir = temp_dir();
        let socket = dir.path().join("floor.sock");
        let listener = UnixListener::bind(&socket).expect("floor relay socket");
        let tid = Arc::new(AtomicI32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (t, s) = (tid.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("floor-relay".into())
            .spawn(move || {
                t.store(
                    rustix::thread::gettid().as_raw_nonzero().get(),
                    Ordering::SeqCst,
                );
                serve(listener, upstream_port, &s);
            })
            .expect("floor relay thread");
        while tid.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        FloorRelay {
            socket,
            tid,
            stop,
            thread: Some(thread),
            _dir: dir,
        }
    }

    /// The relay thread's `/proc` directory (its CPU clock and context switches).
    pub(crate) fn task_dir(&self) -> PathBuf {
        PathBuf::from(format!(
            "/proc/self/task/{}",
            self.tid.load(Ordering::SeqCst)
        ))
    }
}

impl Drop for FloorRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The event loop: token 0 is the listener, 2i+1 client i, 2i+2 its upstream.
fn serve(listener: UnixListener, upstream_port: u16, stop: &AtomicBool) {
    let ep = epoll::create(epoll::CreateFlags::CLOEXEC).expect("epoll");
    let readable = epoll::EventFlags::IN;
    epoll::add(&ep, &listener, epoll::EventData::new_u64(0), readable).expect("epoll add");
    let mut pairs: Vec<Option<Pair>> = Vec::new();
    let mut events = Vec::with_capacity(64);
    let mut buf = vec![0u8; 64 * 1024];
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
                let (client, _) = listener.accept().expect("floor accept");
                let upstream = std::net::TcpStream::connect(("127.0.0.1", upstream_port))
                    .expect("floor upstream");
                upstream.set_nodelay(true).expect("nodelay");
                let i = pairs.len() as u64;
                epoll::add(&ep, &client, epoll::EventData::new_u64(2 * i + 1), readable)
                    .expect("epoll add");
                epoll::add(
                    &ep,
                    &upstream,
                    epoll::EventData::new_u64(2 * i + 2),
                    readable,
                )
                .expect("epoll add");
                pairs.push(Some(Pair { client, upstream }));
                continue;
            }
            let i = (token - 1) / 2;
            let Some(pair) = &mut pairs[i] else { continue };
            let copied = if token % 2 == 1 {
                copy_once(&mut pair.client, &mut pair.upstream, &mut buf)
            } else {
                copy_once(&mut pair.upstream, &mut pair.client, &mut buf)
            };
            if !copied {
                pairs[i] = None; // closing both deregisters them
            }
        }
    }
}

/// One read (the socket is readable, so it does not block) and a write of all of it; false
/// at end of stream or on an error.
fn copy_once(from: &mut impl Read, to: &mut impl Write, buf: &mut [u8]) -> bool {
    match from.read(buf) {
        Ok(0) | Err(_) => false,
        Ok(n) => to.write_all(&buf[..n]).is_ok(),
    }
}
