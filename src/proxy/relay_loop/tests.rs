use super::*;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use rustls::ClientConnection;

use super::conn::{Counts, PLAIN, ROUNDS_PER_TURN};
use crate::egress::Tunnel;
use crate::proxy::readahead::ReadAhead;
use crate::proxy::unix_client::ClientUnixStream;

use rustls::pki_types::{PrivateKeyDer, ServerName};

use super::super::buffers::{buffers_in_use, TEST_SERIAL};

/// A TLS 1.3 server config (self-signed `localhost`) and a client config trusting it.
pub(super) fn configs(half_rtt: bool) -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let der = made.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(made.signing_key.serialize_der().into());
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![der.clone()], key)
        .unwrap();
    server.send_half_rtt_data = half_rtt;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(der).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    (Arc::new(server), Arc::new(client))
}

/// A TLS server on a loopback port that runs `script` on its one connection (blocking).
pub(super) fn server(
    config: Arc<rustls::ServerConfig>,
    script: impl FnOnce(&mut rustls::StreamOwned<rustls::ServerConnection, std::net::TcpStream>)
        + Send
        + 'static,
) -> (u16, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let thread = std::thread::spawn(move || {
        let (tcp, _) = listener.accept().unwrap();
        let conn = rustls::ServerConnection::new(config).unwrap();
        let mut stream = rustls::StreamOwned::new(conn, tcp);
        script(&mut stream);
    });
    (port, thread)
}

/// Connects to `port`, handshakes (blocking), and returns the pair to hand off with the
/// test's end of the client's UNIX socket.
pub(super) fn connect(port: u16, config: Arc<rustls::ClientConfig>) -> (Pair, UnixStream) {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let mut tls = ClientConnection::new(config, name).unwrap();
    while tls.is_handshaking() {
        tls.complete_io(&mut tcp).unwrap();
    }
    tcp.set_nonblocking(true).unwrap();
    let (ours, theirs) = UnixStream::pair().unwrap();
    theirs.set_nonblocking(true).unwrap();
    let pair = Pair {
        client: theirs,
        upstream: tcp,
        tls,
        records: Vec::new(),
    };
    (pair, ours)
}

/// Hands `pair` to `loops` with `watch`; its outcome comes on the receiver, sent by the loop.
pub(super) fn relay_watched(
    loops: &RelayLoops,
    pair: Pair,
    watch: Watch,
) -> std::sync::mpsc::Receiver<Outcome> {
    let (tx, rx) = std::sync::mpsc::channel();
    let handed = loops.hand_off(
        pair,
        watch,
        Box::new(move |o| {
            let _ = tx.send(o);
        }),
    );
    assert!(handed, "no loop took the connection");
    rx
}

/// [`relay_watched`] with no deadline.
pub(super) fn relay(loops: &RelayLoops, pair: Pair) -> std::sync::mpsc::Receiver<Outcome> {
    relay_watched(loops, pair, Watch::none())
}

/// The outcome the loop sends when the connection ends.
pub(super) fn ended(relayed: &std::sync::mpsc::Receiver<Outcome>) -> Outcome {
    relayed
        .recv_timeout(Duration::from_secs(30))
        .expect("the loop ran the connection's end")
}

/// Reads what the client gets until its end: nothing.
pub(super) fn sees_the_end(client: &mut UnixStream) {
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).unwrap();
    assert!(
        rest.is_empty(),
        "the client got {} bytes before its end",
        rest.len()
    );
}

/// Reads the server's plaintext until `close_notify`.
pub(super) fn read_to_close(
    stream: &mut rustls::StreamOwned<rustls::ServerConnection, std::net::TcpStream>,
) -> Vec<u8> {
    let mut got = Vec::new();
    stream.read_to_end(&mut got).unwrap();
    got
}

/// Bytes go both ways; the client's end of input reaches the upstream as `close_notify`
/// (and the upstream can still answer), and the upstream's reaches the client as the end of
/// its stream; the outcome counts both ways.
#[test]
fn relays_both_ways_and_passes_half_close_on() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(false);
    let (port, upstream) = server(server_config, |s| {
        let got = read_to_close(s);
        s.write_all(format!("got {} bytes", got.len()).as_bytes())
            .unwrap();
        s.write_all(&got[..1000]).unwrap();
        s.conn.send_close_notify();
        s.flush().unwrap();
    });
    let loops = RelayLoops::start(2).unwrap();
    let (pair, mut client) = connect(port, client_config);
    let relayed = relay(&loops, pair);
    let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    client.write_all(&sent).unwrap();
    client.shutdown(Shutdown::Write).unwrap();
    let mut answer = Vec::new();
    client.read_to_end(&mut answer).unwrap();
    let head = b"got 300000 bytes";
    assert_eq!(&answer[..head.len()], head);
    assert_eq!(&answer[head.len()..], &sent[..1000]);
    let outcome = ended(&relayed);
    outcome.result.unwrap();
    assert_eq!((outcome.up, outcome.down), (300_000, answer.len() as u64));
    upstream.join().unwrap();
    loops.shutdown();
}

/// The CPU time (in clock ticks) the relay loops' threads have used.
pub(super) fn loop_ticks() -> u64 {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let name = std::fs::read_to_string(dir.join("comm")).ok()?;
            if !name.starts_with("hwkey-proxy-rel") {
                return None;
            }
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            Some(fields[11].parse::<u64>().ok()? + fields[12].parse::<u64>().ok()?)
        })
        .sum()
}

/// A client that reads nothing: the upstream's bytes wait, the connection holds a counted
/// buffer meanwhile, and the loop sleeps instead of spinning (its threads use next to no
/// CPU while it waits); once the client reads, every byte arrives in order, and the buffer
/// goes back.
#[test]
fn a_client_without_room_stops_the_upstream_and_gets_everything_later() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(false);
    let data: Vec<u8> = (0..8_000_000u32).map(|i| (i % 253) as u8).collect();
    let expected = data.clone();
    let (port, upstream) = server(server_config, move |s| {
        s.write_all(&data).unwrap();
        s.conn.send_close_notify();
        s.flush().unwrap();
        let _ = read_to_close(s);
    });
    let loops = RelayLoops::start(1).unwrap();
    let (pair, mut client) = connect(port, client_config);
    let relayed = relay(&loops, pair);
    let mut waited = 0;
    while buffers_in_use() < 1 {
        std::thread::sleep(Duration::from_millis(10));
        waited += 1;
        assert!(waited < 1000, "no buffer held for a client without room");
    }
    let before = loop_ticks();
    std::thread::sleep(Duration::from_millis(500));
    let spent = loop_ticks() - before;
    assert!(
        spent <= 5,
        "the loop used {spent} ticks in 0.5 s while waiting for the client"
    );
    let mut got = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = client.read(&mut chunk).unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&chunk[..n]);
    }
    assert!(
        got == expected,
        "{} bytes arrived, not the 8,000,000 sent in order",
        got.len()
    );
    client.shutdown(Shutdown::Write).unwrap();
    let outcome = ended(&relayed);
    outcome.result.unwrap();
    assert_eq!(outcome.down, 8_000_000);
    assert_eq!(buffers_in_use(), 0);
    upstream.join().unwrap();
    loops.shutdown();
}

/// What the upstream sent with the end of the handshake (here 100 KB of half-RTT data, as
/// an HTTP/2 server's SETTINGS come) can sit in the read-ahead, in rustls's buffers or in
/// the socket when the connection moves to a loop: all of it reaches the client, in order.
#[test]
fn bytes_read_before_the_hand_off_reach_the_client() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(true);
    let data: Vec<u8> = (0..100_000u32).map(|i| (i % 249) as u8).collect();
    let expected = data.clone();
    let (port, upstream) = server(server_config, move |s| {
        s.conn.set_buffer_limit(None);
        s.conn.writer().write_all(&data).unwrap();
        while s.conn.is_handshaking() || s.conn.wants_write() {
            s.conn.complete_io(&mut s.sock).unwrap();
        }
        s.conn.send_close_notify();
        s.flush().unwrap();
        let _ = read_to_close(s);
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let loops = RelayLoops::start(1).unwrap();
    let (pair, mut client) = runtime.block_on(async {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let tls = tokio_rustls::TlsConnector::from(client_config)
            .connect(name, ReadAhead::new(Tunnel::Tcp(tcp)))
            .await
            .unwrap();
        // Let the rest of the server's flight arrive before the hand-off.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (ours, theirs) = UnixStream::pair().unwrap();
        let theirs = ClientUnixStream::new(theirs).unwrap();
        (Pair::from_runtime(theirs, Box::new(tls)).unwrap(), ours)
    });
    eprintln!(
        "{} bytes of records were in the read-ahead at the hand-off",
        pair.records.len()
    );
    let relayed = relay(&loops, pair);
    let mut got = Vec::new();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let r = client.read_to_end(&mut got);
    assert!(
        r.is_ok() && got == expected,
        "{} bytes arrived, not the 100,000 sent in order ({r:?})",
        got.len()
    );
    client.shutdown(Shutdown::Write).unwrap();
    ended(&relayed).result.unwrap();
    upstream.join().unwrap();
    loops.shutdown();
}

/// A connection's turn ends after [`ROUNDS_PER_TURN`] rounds even with bytes still
/// waiting, so a connection that always has bytes to move (a bulk upload from a fast
/// client) leaves its loop to the others between turns. Here the client has sent more than
/// a turn moves before the turn: the turn ends with `More`, having read less than was
/// waiting. (Without turns it read until the client had nothing left.) Counted in bytes
/// and rounds, not timed.
#[test]
fn a_turn_ends_after_its_rounds_with_bytes_still_waiting() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(false);
    let (port, upstream) = server(server_config, |s| {
        // The connection is dropped mid-stream: no clean end to wait for.
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
    });
    let (pair, mut client) = connect(port, client_config);
    // Room for what is sent before the turn, and for what the turn moves.
    let room = 4 << 20;
    rustix::net::sockopt::set_socket_send_buffer_size(&client, room).unwrap();
    rustix::net::sockopt::set_socket_send_buffer_size(&pair.upstream, room).unwrap();
    client.set_nonblocking(true).unwrap();
    let chunk = vec![1u8; 4096];
    let mut waiting = 0usize;
    while let Ok(n) = client.write(&chunk) {
        waiting += n;
    }
    let a_turn = ROUNDS_PER_TURN * PLAIN;
    assert!(
        waiting > a_turn,
        "only {waiting} bytes fit in the client's socket"
    );
    let deadlines = watch::Deadlines::new(&Watch::none(), 0);
    let mut conn = Box::new(Conn::new(pair, deadlines, Box::new(|_| {})));
    conn.client.readable = true;
    conn.client.writable = true;
    conn.upstream.writable = true;
    let ep = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
    let mut scratch = Scratch::new();
    let step = conn.drive(&ep, 0, &mut scratch).unwrap();
    assert!(
        matches!(step, Step::More),
        "the turn did not end with bytes waiting"
    );
    assert!(
        conn.up > 0 && conn.up <= a_turn as u64 && conn.up < waiting as u64,
        "one turn read {} of the {waiting} bytes waiting (at most {a_turn})",
        conn.up
    );
    drop(conn);
    upstream.join().unwrap();
}

/// A keep-alive exchange costs the loop two rounds each way (one that moves the request or
/// the answer, then the one that finds nothing more), and rustls's reader is polled only
/// after records were opened: twice per answer (the plaintext, then the poll that finds no
/// more). Before, a request took three rounds (read and seal; write; find nothing) and every
/// round of either direction polled the reader, as did the answer's read before its records
/// went in: eight polls per exchange, seven finding nothing. Counted, not timed.
#[test]
fn a_keep_alive_exchange_costs_two_rounds_and_two_reader_polls() {
    let _serial = TEST_SERIAL.blocking_lock();
    const EXCHANGES: usize = 20;
    let (server_config, client_config) = configs(false);
    // No session tickets: they would come between the handshake and the first answer.
    let mut server_config = (*server_config).clone();
    server_config.send_tls13_tickets = 0;
    let (port, upstream) = server(Arc::new(server_config), |s| {
        let mut request = [0u8; 64];
        for i in 0..EXCHANGES {
            let n = s.read(&mut request).unwrap();
            assert_eq!(&request[..n], format!("GET {i}").as_bytes());
            s.write_all(format!("200 {i}").as_bytes()).unwrap();
            s.flush().unwrap();
        }
        let _ = read_to_close(s);
    });
    let (pair, client) = connect(port, client_config);
    let mut by_hand = ByHand::new(pair, client);
    let (mut rounds, mut polls) = (Vec::new(), Vec::new());
    for i in 0..EXCHANGES {
        let (sent, answered) = by_hand.exchange(i);
        rounds.push((sent.rounds, answered.rounds));
        polls.push(sent.polls + answered.polls);
    }
    assert!(
        rounds.iter().all(|&r| r == (2, 2)),
        "rounds (request, answer) per exchange: {rounds:?}"
    );
    assert!(
        polls.iter().all(|&p| p == 2),
        "reader polls per exchange: {polls:?}"
    );
    by_hand.client.shutdown(Shutdown::Write).unwrap();
    by_hand.conn.client.readable = true;
    by_hand.drive();
    drop(by_hand);
    upstream.join().unwrap();
}

/// A connection driven by the test as its loop would drive it, with its events set by hand.
struct ByHand {
    conn: Box<Conn>,
    client: UnixStream,
    /// The upstream's socket (a copy), to wait for the answer's records.
    upstream: TcpStream,
    ep: OwnedFd,
    scratch: Scratch,
}

impl ByHand {
    fn new(pair: Pair, client: UnixStream) -> ByHand {
        let upstream = pair.upstream.try_clone().unwrap();
        let deadlines = watch::Deadlines::new(&Watch::none(), 0);
        let mut conn = Box::new(Conn::new(pair, deadlines, Box::new(|_| {})));
        conn.client.writable = true;
        conn.upstream.writable = true;
        client
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut by_hand = ByHand {
            conn,
            client,
            upstream,
            ep: epoll::create(epoll::CreateFlags::CLOEXEC).unwrap(),
            scratch: Scratch::new(),
        };
        // The connection as handed off may hold plaintext from the handshake: its first turn
        // looks (and finds none).
        by_hand.drive();
        by_hand
    }

    fn drive(&mut self) -> Step {
        self.conn.drive(&self.ep, 0, &mut self.scratch).unwrap()
    }

    /// Request `i` and its answer; what the connection's turns counted for each.
    fn exchange(&mut self, i: usize) -> (Counts, Counts) {
        self.conn.counts = Counts::default();
        self.client
            .write_all(format!("GET {i}").as_bytes())
            .unwrap();
        self.conn.client.readable = true;
        assert!(matches!(self.drive(), Step::Waiting));
        let sent = std::mem::take(&mut self.conn.counts);
        // The answer's records have come when the upstream's socket is readable.
        let mut fds = [rustix::event::PollFd::new(
            &self.upstream,
            rustix::event::PollFlags::IN,
        )];
        let ten_s = rustix::event::Timespec {
            tv_sec: 10,
            tv_nsec: 0,
        };
        assert_eq!(rustix::event::poll(&mut fds, Some(&ten_s)).unwrap(), 1);
        self.conn.upstream.readable = true;
        assert!(matches!(self.drive(), Step::Waiting));
        let mut answer = [0u8; 64];
        let n = self.client.read(&mut answer).unwrap();
        assert_eq!(&answer[..n], format!("200 {i}").as_bytes());
        (sent, self.conn.counts)
    }
}

/// Once the loops have stopped, a connection handed to them is refused (and closed: its
/// client sees the end) instead of waiting in a queue nobody reads.
#[test]
fn a_stopped_loop_takes_no_connection() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(false);
    let (port, upstream) = server(server_config, |s| {
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let loops = RelayLoops::start(2).unwrap();
    loops.shutdown();
    let (pair, mut client) = connect(port, client_config);
    // What the connection holds is given back: its end is dropped, unrun.
    let held = Arc::new(());
    let in_end = held.clone();
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ran_in_end = ran.clone();
    let on_end: OnEnd = Box::new(move |_| {
        let _held = in_end;
        ran_in_end.store(true, Ordering::SeqCst);
    });
    assert!(!loops.hand_off(pair, Watch::none(), on_end));
    assert_eq!(Arc::strong_count(&held), 1, "the connection's end was kept");
    assert!(!ran.load(Ordering::SeqCst));
    sees_the_end(&mut client);
    upstream.join().unwrap();
}

/// Records that open before a bad one in the same read reach the client, and then the
/// connection ends with the error. (The loop gathered their plaintext for one write and
/// returned on the error with it unsent, and unwiped in its buffer.)
#[test]
fn records_before_a_bad_one_reach_the_client_first() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(false);
    let (port, upstream) = server(server_config, |s| {
        while s.conn.is_handshaking() || s.conn.wants_write() {
            s.conn.complete_io(&mut s.sock).unwrap();
        }
        // Two good records and a forged one, in one write: one read of the loop.
        s.conn.writer().write_all(b"hello ").unwrap();
        s.conn.writer().write_all(b"world").unwrap();
        let mut wire = Vec::new();
        while s.conn.wants_write() {
            s.conn.write_tls(&mut wire).unwrap();
        }
        wire.extend_from_slice(&[0x17, 0x03, 0x03, 0x00, 0x20]);
        wire.extend_from_slice(&[0x55; 0x20]);
        s.sock.write_all(&wire).unwrap();
        let mut rest = Vec::new();
        let _ = s.sock.read_to_end(&mut rest);
    });
    let loops = RelayLoops::start(1).unwrap();
    let (pair, mut client) = connect(port, client_config);
    let relayed = relay(&loops, pair);
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut got = Vec::new();
    let _ = client.read_to_end(&mut got);
    assert_eq!(String::from_utf8_lossy(&got), "hello world");
    let outcome = ended(&relayed);
    assert_eq!(
        outcome.result.unwrap_err().kind(),
        io::ErrorKind::InvalidData
    );
    upstream.join().unwrap();
    loops.shutdown();
}

/// However a loop's thread ends, the spares it made and nobody took are closed: here its
/// thread panics (as a bug past the guards around each connection would) with one spare's
/// close not yet due. The close was only in the loop's list, so the spare stayed open until
/// a client found it too old.
#[test]
fn a_loop_whose_thread_panics_still_closes_the_spares_it_made() {
    let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let told = closed.clone();
    let thread = std::thread::spawn(move || {
        let ep = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
        let wake = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        let inbox = Arc::new(Inbox {
            queue: Mutex::new(Queue::default()),
            wake,
            ep: ep.try_clone().unwrap(),
            load: AtomicUsize::new(0),
        });
        let mut lp = Loop::new(ep, inbox);
        let close: Expiry = Box::new(move || told.store(true, Ordering::SeqCst));
        lp.expiries.push((idle::now_ms() + 3_000, close));
        panic!("a bug in the loop (this test's)");
    });
    assert!(thread.join().is_err(), "the loop's thread panicked");
    assert!(
        closed.load(Ordering::SeqCst),
        "the spare the loop made was left open when its thread ended"
    );
}

/// The loops run, under their names, once `start` returns: the proxy says it is ready after
/// it, and the tests (and operators) that find the loops by their threads' names found one
/// loop of two in CI, the other's thread not yet scheduled (a new thread names itself). With
/// every core kept busy, the old `start` returned with 1, 2, 57 and 1 of 64 running.
#[test]
fn the_loops_run_under_their_names_once_started() {
    let _serial = TEST_SERIAL.blocking_lock();
    let tasks = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| Some(t.ok()?.path()))
            .collect()
    };
    // Every core busy, as on a loaded machine: a new thread waits its turn to run.
    let busy = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let spinners: Vec<_> = (0..4)
        .map(|_| {
            let busy = busy.clone();
            std::thread::spawn(move || while busy.load(Ordering::Relaxed) {})
        })
        .collect();
    let before = tasks();
    let loops = RelayLoops::start(64).unwrap();
    // This start's threads: those that were not there before it.
    let named = tasks()
        .into_iter()
        .filter(|task| !before.contains(task))
        .filter_map(|task| std::fs::read_to_string(task.join("comm")).ok())
        .filter(|name| name.starts_with("hwkey-proxy-rel"))
        .count();
    busy.store(false, Ordering::Relaxed);
    for spinner in spinners {
        spinner.join().unwrap();
    }
    assert_eq!(named, 64, "{named} of 64 loops were running");
    loops.shutdown();
}
