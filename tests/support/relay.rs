//! A TCP relay that can stop relaying while keeping every connection open: an API server that
//! hangs (accepts, then never answers), for the tests of timeouts and lease deadlines. It can
//! also forget flows that stay idle, as a NAT or a stateful firewall does: once a connection has
//! moved no byte for a while, its bytes are dropped silently in both directions and its
//! sockets stay open (nothing tells either end).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Relays 127.0.0.1:`port` to an upstream port until dropped.
pub struct FreezableRelay {
    /// The relay's own port.
    pub port: u16,
    frozen: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    forgotten: Arc<AtomicU64>,
}

/// One relayed connection's state, shared by its two directions.
#[derive(Clone)]
struct Flow {
    idle: Option<Duration>,
    last: Arc<Mutex<Instant>>,
    dead: Arc<AtomicBool>,
    forgotten: Arc<AtomicU64>,
}

impl Flow {
    /// Whether bytes that just arrived may pass: not once the flow was idle too long.
    fn passes(&self) -> bool {
        if self.dead.load(Ordering::SeqCst) {
            return false;
        }
        let mut last = self.last.lock().expect("flow lock");
        if self.idle.is_some_and(|idle| last.elapsed() >= idle) {
            self.dead.store(true, Ordering::SeqCst);
            self.forgotten.fetch_add(1, Ordering::SeqCst);
            return false;
        }
        *last = Instant::now();
        true
    }
}

impl FreezableRelay {
    /// Starts relaying to 127.0.0.1:`upstream`.
    pub fn start(upstream: u16) -> FreezableRelay {
        FreezableRelay::start_with(upstream, None)
    }

    /// Starts relaying to 127.0.0.1:`upstream`, forgetting any connection that moved no byte
    /// for `idle` (see the module doc).
    pub fn forgetting_idle(upstream: u16, idle: Duration) -> FreezableRelay {
        FreezableRelay::start_with(upstream, Some(idle))
    }

    /// How many connections were forgotten so far.
    pub fn forgotten(&self) -> u64 {
        self.forgotten.load(Ordering::SeqCst)
    }

    fn start_with(upstream: u16, idle: Option<Duration>) -> FreezableRelay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        listener.set_nonblocking(true).expect("nonblocking accept");
        let frozen = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let forgotten = Arc::new(AtomicU64::new(0));
        let (f, s, lost) = (frozen.clone(), stop.clone(), forgotten.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        let _ = client.set_nonblocking(false);
                        let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                            continue;
                        };
                        let flow = Flow {
                            idle,
                            last: Arc::new(Mutex::new(Instant::now())),
                            dead: Arc::new(AtomicBool::new(false)),
                            forgotten: lost.clone(),
                        };
                        for (from, to) in [
                            (client.try_clone(), server.try_clone()),
                            (server.try_clone(), client.try_clone()),
                        ] {
                            let (Ok(from), Ok(to)) = (from, to) else {
                                continue;
                            };
                            let (f, s, flow) = (f.clone(), s.clone(), flow.clone());
                            std::thread::spawn(move || copy(from, to, &f, &s, &flow));
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        FreezableRelay {
            port,
            frozen,
            stop,
            forgotten,
        }
    }

    /// Stops moving bytes (connections stay open, new ones are accepted and hang too).
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    /// Moves bytes again.
    pub fn thaw(&self) {
        self.frozen.store(false, Ordering::SeqCst);
    }
}

impl Drop for FreezableRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn copy(
    mut from: TcpStream,
    mut to: TcpStream,
    frozen: &AtomicBool,
    stop: &AtomicBool,
    flow: &Flow,
) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(100)));
    let mut buf = [0u8; 16 * 1024];
    while !stop.load(Ordering::SeqCst) {
        if frozen.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if flow.passes() && to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    // A forgotten flow passes no FIN either.
    if !flow.dead.load(Ordering::SeqCst) {
        let _ = to.shutdown(Shutdown::Write);
    }
}
