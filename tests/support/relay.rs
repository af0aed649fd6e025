//! A TCP relay that can stop relaying while keeping every connection open: an API server that
//! hangs (accepts, then never answers), for the tests of timeouts and lease deadlines. It can
//! also forget flows that stay idle, as a NAT or a stateful firewall does: once a connection has
//! moved no byte for a while, its bytes are dropped silently in both directions and its
//! sockets stay open (nothing tells either end). It also counts the TLS records its clients
//! send that carry encrypted data (content type 23), following the records' headers through
//! the byte stream: how many pieces the upstream receives.

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
    records: Arc<AtomicU64>,
    connections: Arc<AtomicU64>,
    ended: Arc<AtomicU64>,
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

    /// How many application-data TLS records (type 23) the relay's clients have sent so far.
    pub fn client_records(&self) -> u64 {
        self.records.load(Ordering::SeqCst)
    }

    /// How many connections the relay has accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    /// How many clients have ended their side (end of stream, or an error): every record
    /// they sent has been counted.
    pub fn clients_ended(&self) -> u64 {
        self.ended.load(Ordering::SeqCst)
    }

    /// Waits until every client the relay accepted has ended (so every record it sent is
    /// counted) and returns the records and connections so far. Fails after 20 s: a client
    /// (the proxy) kept a connection open.
    pub fn settled(&self) -> (u64, u64) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.clients_ended() < self.connections() {
            assert!(
                Instant::now() < deadline,
                "a client of the relay kept its connection open"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        (self.client_records(), self.connections())
    }

    fn start_with(upstream: u16, idle: Option<Duration>) -> FreezableRelay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        listener.set_nonblocking(true).expect("nonblocking accept");
        let frozen = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let forgotten = Arc::new(AtomicU64::new(0));
        let records = Arc::new(AtomicU64::new(0));
        let connections = Arc::new(AtomicU64::new(0));
        let ended = Arc::new(AtomicU64::new(0));
        let (f, s, lost) = (frozen.clone(), stop.clone(), forgotten.clone());
        let (counted, accepted, over) = (records.clone(), connections.clone(), ended.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        accepted.fetch_add(1, Ordering::SeqCst);
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
                        for (from, to, count) in [
                            (
                                client.try_clone(),
                                server.try_clone(),
                                Some(counted.clone()),
                            ),
                            (server.try_clone(), client.try_clone(), None),
                        ] {
                            let (Ok(from), Ok(to)) = (from, to) else {
                                continue;
                            };
                            let (f, s, flow) = (f.clone(), s.clone(), flow.clone());
                            let mut records = count.map(|c| Records::new(c, over.clone()));
                            std::thread::spawn(move || {
                                copy(from, to, &f, &s, &flow, records.as_mut())
                            });
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
            records,
            connections,
            ended,
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
    mut records: Option<&mut Records>,
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
                if let Some(r) = records.as_deref_mut() {
                    r.follow(&buf[..n]);
                }
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
    if let Some(r) = records {
        r.ended.fetch_add(1, Ordering::SeqCst);
    }
    // A forgotten flow passes no FIN either.
    if !flow.dead.load(Ordering::SeqCst) {
        let _ = to.shutdown(Shutdown::Write);
    }
}

/// Follows TLS record headers through one direction's bytes, counting application-data records.
struct Records {
    count: Arc<AtomicU64>,
    /// Counts the directions followed to their end.
    ended: Arc<AtomicU64>,
    /// The current record's header bytes seen so far (5 when its body is being skipped).
    header: Vec<u8>,
    /// Body bytes of the current record still to skip.
    body: usize,
}

impl Records {
    fn new(count: Arc<AtomicU64>, ended: Arc<AtomicU64>) -> Records {
        Records {
            count,
            ended,
            header: Vec::with_capacity(5),
            body: 0,
        }
    }

    fn follow(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.body > 0 {
                let n = self.body.min(bytes.len());
                self.body -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (5 - self.header.len()).min(bytes.len());
            self.header.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.header.len() == 5 {
                if self.header[0] == 23 {
                    self.count.fetch_add(1, Ordering::SeqCst);
                }
                self.body = usize::from(u16::from_be_bytes([self.header[3], self.header[4]]));
                self.header.clear();
            }
        }
    }
}

/// Relays 127.0.0.1:`port` to an upstream port, except one connection that resumes a TLS
/// session: the `nth` whose ClientHello offers a pre-shared key (RFC 8446 §4.2.11), counted in
/// the order ClientHellos arrive, is accepted and then never answered, as an API server behind
/// a balancer whose backend hangs. Every other connection passes as it came. Each connection
/// is read on a thread of its own: a client may connect well before it sends its ClientHello
/// (the proxy connects, then waits at its ticket gate).
pub struct StallingRelay {
    /// The relay's own port.
    pub port: u16,
    stalled: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// Stalled connections, open until the relay is dropped.
    hung: Arc<Mutex<Vec<TcpStream>>>,
}

impl StallingRelay {
    /// Starts relaying to 127.0.0.1:`upstream`, stalling the `nth` resumption (1: the first).
    pub fn start(upstream: u16, nth: u64) -> StallingRelay {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let port = listener.local_addr().expect("relay address").port();
        listener.set_nonblocking(true).expect("nonblocking accept");
        let stalled = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let hung = Arc::new(Mutex::new(Vec::new()));
        let resumptions = Arc::new(AtomicU64::new(0));
        let (held, s, kept) = (stalled.clone(), stop.clone(), hung.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let (held, kept, resumptions) = (held.clone(), kept.clone(), resumptions.clone());
                std::thread::spawn(move || {
                    stall_or_pass(client, upstream, nth, &resumptions, &held, &kept)
                });
            }
        });
        StallingRelay {
            port,
            stalled,
            stop,
            hung,
        }
    }

    /// How many connections it has stalled so far (0 or 1).
    pub fn stalled(&self) -> u64 {
        self.stalled.load(Ordering::SeqCst)
    }
}

impl Drop for StallingRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Ok(mut hung) = self.hung.lock() {
            hung.clear();
        }
    }
}

/// One connection of a [`StallingRelay`]: its ClientHello read, then stalled (the `nth`
/// resumption) or passed on to the upstream with everything after it.
fn stall_or_pass(
    mut client: TcpStream,
    upstream: u16,
    nth: u64,
    resumptions: &AtomicU64,
    stalled: &AtomicU64,
    hung: &Mutex<Vec<TcpStream>>,
) {
    let _ = client.set_nonblocking(false);
    let Some(hello) = first_record(&mut client) else {
        return;
    };
    if offers_psk(&hello) && resumptions.fetch_add(1, Ordering::SeqCst) + 1 == nth {
        stalled.fetch_add(1, Ordering::SeqCst);
        hung.lock().expect("the stalled connections").push(client);
        return;
    }
    let Ok(mut server) = TcpStream::connect(("127.0.0.1", upstream)) else {
        return;
    };
    if server.write_all(&hello).is_err() {
        return;
    }
    let (Ok(mut from), Ok(mut to)) = (server.try_clone(), client.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
    });
    let _ = std::io::copy(&mut client, &mut server);
    let _ = server.shutdown(Shutdown::Write);
}

/// The first TLS record a client sends (its ClientHello), header included; None if the
/// connection ends first. (rustls's ClientHello fits one record; one split over records would
/// be read only up to its first record's end, and its PSK extension, last, missed.)
fn first_record(client: &mut TcpStream) -> Option<Vec<u8>> {
    let mut record = vec![0u8; 5];
    client.read_exact(&mut record).ok()?;
    let len = usize::from(u16::from_be_bytes([record[3], record[4]]));
    record.resize(5 + len, 0);
    client.read_exact(&mut record[5..]).ok()?;
    Some(record)
}

/// Whether a ClientHello record offers a pre-shared key (extension 41): a resumption.
fn offers_psk(record: &[u8]) -> bool {
    fn skip(at: usize, len_bytes: usize, b: &[u8]) -> Option<usize> {
        let len = b
            .get(at..at + len_bytes)?
            .iter()
            .fold(0usize, |n, &x| n << 8 | usize::from(x));
        Some(at + len_bytes + len)
    }
    let find = || -> Option<bool> {
        // Record header (5), handshake header (4), version (2), random (32).
        let b = record;
        (b.first() == Some(&0x16) && b.get(5) == Some(&0x01)).then_some(())?;
        let at = skip(5 + 4 + 2 + 32, 1, b)?; // session id
        let at = skip(at, 2, b)?; // cipher suites
        let at = skip(at, 1, b)?; // compression methods
        let end = skip(at, 2, b)?.min(b.len());
        let mut at = at + 2;
        while at + 4 <= end {
            let kind = u16::from_be_bytes([b[at], b[at + 1]]);
            if kind == 41 {
                return Some(true);
            }
            at = skip(at + 2, 2, b)?;
        }
        Some(false)
    };
    find().unwrap_or(false)
}
