//! The relay loop with a loopback TLS client: both sessions, unbuffered, in the connection.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use rustls::client::UnbufferedClientConnection;
use rustls::pki_types::ServerName;
use rustls::server::UnbufferedServerConnection;
use rustls::{ClientConnection, StreamOwned};

use super::tests::{configs, ended, loop_ticks, read_to_close, server};
use super::{OnEnd, Outcome, RelayLoops, TlsPair, Watch};
use crate::proxy::buffers::TEST_SERIAL;
use crate::proxy::unbuffered::stream::LeanParts;
use crate::proxy::unbuffered::{feed, Out, Session};

/// The test's end of a loopback client: a blocking TLS client.
type Client = StreamOwned<ClientConnection, TcpStream>;

/// Runs `session`'s handshake on blocking `tcp`; returns what was read after it and not
/// whole yet, and what its session opened.
fn handshake<S: Session>(tcp: &mut TcpStream, session: &mut S) -> (Vec<u8>, Vec<u8>) {
    let mut incoming = vec![0u8; 80_000];
    let mut have = 0;
    let mut out = Out::default();
    let mut opened = Vec::new();
    loop {
        let fed = feed(session, &mut incoming[..have], &mut out, |p| {
            opened.extend_from_slice(p);
            Ok(())
        })
        .unwrap();
        incoming.copy_within(fed.used..have, 0);
        have -= fed.used;
        tcp.write_all(out.bytes()).unwrap();
        out.clear();
        if fed.traffic {
            return (incoming[..have].to_vec(), opened);
        }
        let n = tcp.read(&mut incoming[have..]).unwrap();
        assert!(n > 0, "the peer closed during the handshake");
        have += n;
    }
}

/// Connects to the upstream at `port` and makes a loopback TLS client, both handshakes done
/// on unbuffered sessions: the pair to hand off (its sockets non-blocking) and the test's
/// end of the client.
fn connect_tls(port: u16, upstream: Arc<rustls::ClientConfig>) -> (TlsPair, Client) {
    let mut up = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let mut remote = UnbufferedClientConnection::new(upstream, name).unwrap();
    let (up_left, _) = handshake(&mut up, &mut remote);
    up.set_nonblocking(true).unwrap();
    let (local_server, local_client) = configs(false);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let local_port = listener.local_addr().unwrap().port();
    let client = std::thread::spawn(move || {
        let mut tcp = TcpStream::connect(("127.0.0.1", local_port)).unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let mut tls = ClientConnection::new(local_client, name).unwrap();
        while tls.is_handshaking() {
            tls.complete_io(&mut tcp).unwrap();
        }
        tcp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        StreamOwned::new(tls, tcp)
    });
    let (mut tcp, _) = listener.accept().unwrap();
    let mut local = UnbufferedServerConnection::new(local_server).unwrap();
    let (left, opened) = handshake(&mut tcp, &mut local);
    tcp.set_nonblocking(true).unwrap();
    let pair = TlsPair {
        client: LeanParts {
            tcp,
            session: local,
            incoming: left,
            out: Vec::new(),
            plain: opened,
            peer_closed: false,
        },
        upstream: LeanParts {
            tcp: up,
            session: remote,
            incoming: up_left,
            out: Vec::new(),
            plain: Vec::new(),
            peer_closed: false,
        },
    };
    (pair, client.join().unwrap())
}

/// Hands `pair` to `loops`; its outcome comes on the receiver.
fn relay(loops: &RelayLoops, pair: TlsPair) -> std::sync::mpsc::Receiver<Outcome> {
    let (tx, rx) = std::sync::mpsc::channel();
    let on_end: OnEnd = Box::new(move |o| {
        let _ = tx.send(o);
    });
    assert!(
        loops.hand_off_tls(pair, Watch::none(), on_end).unwrap(),
        "no loop took the connection"
    );
    rx
}

/// Bytes go both ways between a TLS client and the upstream; the client's `close_notify`
/// reaches the upstream as a clean end (and the upstream can still answer), and the
/// upstream's reaches the client as a `close_notify` of the proxy's own (a clean end: rustls
/// reports a cut stream as an error); the outcome counts plaintext both ways.
#[test]
fn a_tls_client_is_relayed_both_ways_with_close_notify_each_way() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(false);
    let (port, upstream) = server(server_config, |s| {
        let got = read_to_close(s);
        s.write_all(format!("got {} bytes", got.len()).as_bytes())
            .unwrap();
        s.write_all(&got[..100_000]).unwrap();
        s.conn.send_close_notify();
        s.flush().unwrap();
    });
    let loops = RelayLoops::start(2).unwrap();
    let (pair, mut client) = connect_tls(port, client_config);
    let relayed = relay(&loops, pair);
    let sent: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    client.write_all(&sent).unwrap();
    client.conn.send_close_notify();
    client.flush().unwrap();
    let mut answer = Vec::new();
    let end = client.read_to_end(&mut answer);
    assert!(
        end.is_ok(),
        "the client's stream did not end cleanly: {end:?}"
    );
    let head = b"got 300000 bytes";
    assert_eq!(&answer[..head.len()], head);
    assert!(answer[head.len()..] == sent[..100_000]);
    let outcome = ended(&relayed);
    outcome.result.unwrap();
    assert_eq!((outcome.up, outcome.down), (300_000, answer.len() as u64));
    upstream.join().unwrap();
    loops.shutdown();
}

/// A TLS client that ends its TCP stream without `close_notify` (a truncation, which TLS
/// tells from an end) does not end the upstream's side cleanly: the connection ends with an
/// error, and the upstream sees its stream cut, not a `close_notify`, as on the runtime's path.
#[test]
fn a_tls_client_that_cuts_its_stream_does_not_end_the_upstream_cleanly() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(false);
    let (port, upstream) = server(server_config, |s| {
        let mut got = Vec::new();
        let end = s.read_to_end(&mut got);
        assert!(
            end.is_err(),
            "the upstream saw a clean end of a cut client stream"
        );
        assert_eq!(got, b"a request cut short");
    });
    let loops = RelayLoops::start(1).unwrap();
    let (pair, mut client) = connect_tls(port, client_config);
    let relayed = relay(&loops, pair);
    client.write_all(b"a request cut short").unwrap();
    client.flush().unwrap();
    client.sock.shutdown(Shutdown::Write).unwrap();
    let outcome = ended(&relayed);
    assert!(
        outcome.result.is_err(),
        "a cut client stream ended the connection cleanly"
    );
    assert_eq!(outcome.up, 19);
    upstream.join().unwrap();
    loops.shutdown();
}

/// What the client sent before the hand-off reaches the upstream first, in order: plaintext
/// its session had already opened (a request that came with the handshake's last flight),
/// records the runtime had read but not given to rustls, and bytes still in the socket.
#[test]
fn what_a_tls_client_sent_before_the_hand_off_reaches_the_upstream_in_order() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(false);
    let (port, upstream) = server(server_config, |s| {
        let got = read_to_close(s);
        assert_eq!(got, b"opened;records;socket;after");
        s.conn.send_close_notify();
        s.flush().unwrap();
    });
    let loops = RelayLoops::start(1).unwrap();
    let (mut pair, mut client) = connect_tls(port, client_config);
    let t = &mut pair.client;
    t.tcp.set_nonblocking(false).unwrap();
    client.write_all(b"opened;").unwrap();
    client.flush().unwrap();
    // Opened by the session, as the handshake opens a request that came with the client's
    // last flight.
    let mut record = vec![0u8; 5];
    t.tcp.read_exact(&mut record).unwrap();
    let len = u16::from_be_bytes([record[3], record[4]]) as usize;
    record.resize(5 + len, 0);
    t.tcp.read_exact(&mut record[5..]).unwrap();
    let mut out = Out::default();
    feed(&mut t.session, &mut record, &mut out, |p| {
        t.plain.extend_from_slice(p);
        Ok(())
    })
    .unwrap();
    assert_eq!(t.plain, b"opened;");
    client.write_all(b"records;").unwrap();
    client.flush().unwrap();
    // One whole record, read and not given to the session.
    let mut record = vec![0u8; 5];
    t.tcp.read_exact(&mut record).unwrap();
    let len = u16::from_be_bytes([record[3], record[4]]) as usize;
    record.resize(5 + len, 0);
    t.tcp.read_exact(&mut record[5..]).unwrap();
    t.incoming = record;
    client.write_all(b"socket;").unwrap();
    client.flush().unwrap();
    std::thread::sleep(Duration::from_millis(50));
    t.tcp.set_nonblocking(true).unwrap();
    let relayed = relay(&loops, pair);
    client.write_all(b"after").unwrap();
    client.conn.send_close_notify();
    client.flush().unwrap();
    let mut rest = Vec::new();
    client.read_to_end(&mut rest).unwrap();
    let outcome = ended(&relayed);
    outcome.result.unwrap();
    upstream.join().unwrap();
    loops.shutdown();
}

/// A TLS client that reads nothing: the upstream's bytes wait (sealed in the client's
/// session, one read's worth at most), the upstream's own writes stop (it has not sent
/// everything), and the loop goes quiet instead of spinning: a half-second in which its thread
/// uses next to no CPU comes within 20 s (on a loaded machine it may still be working at first;
/// a loop that spins never goes quiet). Once the client reads, every byte arrives in order.
#[test]
fn a_tls_client_without_room_stops_the_upstream_and_gets_everything_later() {
    let _serial = TEST_SERIAL.blocking_lock();
    const SIZE: u32 = 32_000_000;
    let (server_config, client_config) = configs(false);
    let data: Vec<u8> = (0..SIZE).map(|i| (i % 253) as u8).collect();
    let expected = data.clone();
    let sent_all = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = sent_all.clone();
    let (port, upstream) = server(server_config, move |s| {
        s.write_all(&data).unwrap();
        s.flush().unwrap();
        sent.store(true, std::sync::atomic::Ordering::SeqCst);
        s.conn.send_close_notify();
        s.flush().unwrap();
        let _ = read_to_close(s);
    });
    let loops = RelayLoops::start(1).unwrap();
    let (pair, mut client) = connect_tls(port, client_config);
    let relayed = relay(&loops, pair);
    let mut quiet = false;
    for _ in 0..40 {
        let before = loop_ticks();
        std::thread::sleep(Duration::from_millis(500));
        if loop_ticks() - before <= 5 {
            quiet = true;
            break;
        }
    }
    assert!(
        quiet,
        "the loop never went quiet while the client read nothing"
    );
    assert!(
        !sent_all.load(std::sync::atomic::Ordering::SeqCst),
        "the upstream could send everything to a client that read nothing"
    );
    let mut got = Vec::new();
    client.read_to_end(&mut got).unwrap();
    assert!(
        got == expected,
        "{} bytes arrived, not the {SIZE} sent in order",
        got.len()
    );
    client.conn.send_close_notify();
    client.flush().unwrap();
    let outcome = ended(&relayed);
    outcome.result.unwrap();
    assert_eq!(outcome.down, u64::from(SIZE));
    upstream.join().unwrap();
    loops.shutdown();
}

/// A TLS client whose record fails authentication (a peer that lies, or bytes damaged on the
/// way): the records before it, read with it, still reach the upstream (before d85b540 they
/// were sealed for it and dropped with the connection), the client gets an alert instead of a
/// clean end, the upstream sees its stream cut rather than a `close_notify`, and the connection
/// ends with an error.
#[test]
fn a_tls_client_with_a_bad_record_gets_an_alert_and_the_upstream_no_clean_end() {
    let _serial = TEST_SERIAL.blocking_lock();
    let (server_config, client_config) = configs(false);
    let (port, upstream) = server(server_config, |s| {
        let mut got = Vec::new();
        let end = s.read_to_end(&mut got);
        assert!(
            end.is_err(),
            "the upstream saw a clean end after a bad client record"
        );
        assert_eq!(got, b"before the bad record");
    });
    let loops = RelayLoops::start(1).unwrap();
    let (pair, mut client) = connect_tls(port, client_config);
    let relayed = relay(&loops, pair);
    // A good record, and right behind it, in the same write (so that one read of the proxy
    // takes both), an application-data record of the right shape whose tag cannot verify.
    client
        .conn
        .writer()
        .write_all(b"before the bad record")
        .unwrap();
    let mut wire = Vec::new();
    while client.conn.wants_write() {
        client.conn.write_tls(&mut wire).unwrap();
    }
    wire.extend([0x17, 0x03, 0x03, 0x00, 0x40]);
    wire.extend((0..0x40u8).map(|i| i.wrapping_mul(37)));
    client.sock.write_all(&wire).unwrap();
    let mut rest = Vec::new();
    let end = client.read_to_end(&mut rest);
    assert!(
        end.is_err(),
        "the client saw a clean end after its bad record: {end:?}"
    );
    let outcome = ended(&relayed);
    assert_eq!(
        outcome.result.unwrap_err().kind(),
        std::io::ErrorKind::InvalidData
    );
    upstream.join().unwrap();
    loops.shutdown();
}
