//! The deadlines a relay loop enforces itself ([`super::watch`]): the idle timeout, a newer
//! certificate under `--rotation-close immediate`, the stop, how long the loop sleeps, and the
//! log line said before a retired connection closes.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::sync::Arc;
use std::time::Duration;

use super::tests::{
    configs, connect, ended, read_to_close, relay, relay_watched, sees_the_end, server,
};
use super::watch::sleep_for;
use super::{OnEnd, Pair, RelayLoops, Watch};
use crate::proxy::buffers::TEST_SERIAL;
use crate::proxy::rotation::{CertEpoch, RotationClose};
use std::os::unix::net::UnixStream;

/// What the test's upstream does with its one connection.
enum Upstream {
    /// Sends back what it read, then `close_notify`.
    Echo,
    /// Reads until the end, whatever it is.
    Drain,
}

/// A connection to a test upstream, ready to hand off, with the test's end of the client's
/// socket and the upstream's thread.
fn to(upstream: Upstream) -> (Pair, UnixStream, std::thread::JoinHandle<()>) {
    let (server_config, client_config) = configs(false);
    let (port, thread) = server(server_config, move |s| match upstream {
        Upstream::Echo => {
            let got = read_to_close(s);
            s.write_all(&got).unwrap();
            s.conn.send_close_notify();
            s.flush().unwrap();
        }
        Upstream::Drain => {
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        }
    });
    let (pair, client) = connect(port, client_config);
    (pair, client, thread)
}

/// A connection nothing moves on is ended by its loop at its idle timeout, without its task
/// (it has none): both the client and the upstream see the end, and the outcome says why.
#[test]
fn an_idle_connection_is_ended_by_its_loop() {
    let _serial = TEST_SERIAL.blocking_lock();
    let loops = RelayLoops::start(1).unwrap();
    let (server_config, client_config) = configs(false);
    let (port, upstream) = server(server_config, |s| {
        let mut rest = Vec::new();
        // The proxy's close is not a clean one: no close_notify, just the end.
        let r = s.read_to_end(&mut rest);
        assert!(r.is_err() || rest.is_empty());
    });
    let (pair, mut client) = connect(port, client_config);
    let watch = Watch {
        idle: Some(Duration::from_millis(300)),
        ..Watch::none()
    };
    let handed = std::time::Instant::now();
    let relayed = relay_watched(&loops, pair, watch);
    let outcome = ended(&relayed);
    let after = handed.elapsed();
    let e = outcome.result.unwrap_err();
    assert_eq!(
        (e.kind(), e.to_string().as_str()),
        (io::ErrorKind::TimedOut, "idle timeout")
    );
    // Not before its timeout, and not missed: the loop slept until it (a deadline nobody
    // looked at would end it only at the next event, here none).
    assert!(
        after >= Duration::from_millis(300) && after < Duration::from_secs(5),
        "ended {after:?} after the hand-off, with an idle timeout of 300 ms"
    );
    sees_the_end(&mut client);
    upstream.join().unwrap();
    loops.shutdown();
}

/// A byte moved puts the idle timeout off: a connection active more often than its timeout
/// lasts as long as it is active, and its bytes are counted.
#[test]
fn activity_puts_the_idle_timeout_off() {
    let _serial = TEST_SERIAL.blocking_lock();
    let loops = RelayLoops::start(1).unwrap();
    let (pair, mut client, upstream) = to(Upstream::Echo);
    let watch = Watch {
        idle: Some(Duration::from_millis(1_000)),
        ..Watch::none()
    };
    let relayed = relay_watched(&loops, pair, watch);
    // Six bytes, 250 ms apart: 1.5 s in all, longer than the timeout.
    for b in b"abcdef" {
        client.write_all(&[*b]).unwrap();
        std::thread::sleep(Duration::from_millis(250));
    }
    client.shutdown(Shutdown::Write).unwrap();
    let mut echoed = Vec::new();
    client.read_to_end(&mut echoed).unwrap();
    assert_eq!(echoed, b"abcdef");
    let outcome = ended(&relayed);
    outcome.result.unwrap();
    assert_eq!((outcome.up, outcome.down), (6, 6));
    upstream.join().unwrap();
    loops.shutdown();
}

/// A newer certificate ends, at once, the connections opened with an older one under
/// `--rotation-close immediate`, and only those; one handed to the loop after it learnt of
/// the newer certificate ends as soon as it arrives.
#[test]
fn a_newer_certificate_ends_only_immediate_connections_opened_before_it() {
    let _serial = TEST_SERIAL.blocking_lock();
    let loops = RelayLoops::start(1).unwrap();
    let watch = |generation, mode| Watch {
        epoch: CertEpoch {
            generation,
            not_after_unix: None,
        },
        mode,
        ..Watch::none()
    };
    let mut conns = Vec::new();
    for w in [
        watch(1, RotationClose::Immediate),
        watch(1, RotationClose::Expiry),
        watch(2, RotationClose::Immediate),
    ] {
        let (pair, client, upstream) = to(Upstream::Echo);
        conns.push((relay_watched(&loops, pair, w), client, upstream));
    }
    loops.retire(2);
    let (relayed, mut client, upstream) = conns.remove(0);
    let e = ended(&relayed).result.unwrap_err();
    assert_eq!(e.to_string(), "certificate rotated");
    let mut rest = Vec::new();
    let _ = client.read_to_end(&mut rest);
    assert!(rest.is_empty());
    let _ = upstream.join();
    // The others still relay, and end cleanly.
    for (relayed, mut client, upstream) in conns {
        client.write_all(b"still here").unwrap();
        client.shutdown(Shutdown::Write).unwrap();
        let mut echoed = Vec::new();
        client.read_to_end(&mut echoed).unwrap();
        assert_eq!(echoed, b"still here");
        ended(&relayed).result.unwrap();
        upstream.join().unwrap();
    }
    // Opened with generation 1, arriving after the loop learnt of 2.
    let (pair, mut client, upstream) = to(Upstream::Drain);
    let late = relay_watched(&loops, pair, watch(1, RotationClose::Immediate));
    let e = ended(&late).result.unwrap_err();
    assert_eq!(e.to_string(), "certificate rotated");
    let mut rest = Vec::new();
    let _ = client.read_to_end(&mut rest);
    upstream.join().unwrap();
    loops.shutdown();
}

/// Stopping the loops ends every connection on them, and each one's end runs (what it held is
/// given back).
#[test]
fn stopping_the_loops_ends_their_connections() {
    let _serial = TEST_SERIAL.blocking_lock();
    let loops = RelayLoops::start(1).unwrap();
    let (pair, mut client, upstream) = to(Upstream::Drain);
    let relayed = relay(&loops, pair);
    loops.shutdown();
    assert_eq!(
        ended(&relayed).result.unwrap_err().kind(),
        io::ErrorKind::Interrupted
    );
    sees_the_end(&mut client);
    upstream.join().unwrap();
}

/// A loop sleeps until its next deadline, but never longer than an hour: a certificate's
/// expiry weeks away would otherwise be a wait only `epoll_pwait2` takes, which older kernels
/// refuse (and a loop whose wait fails ends its connections).
#[test]
fn a_loop_sleeps_until_its_next_deadline_and_at_most_an_hour() {
    let ms =
        |t: Option<rustix::event::Timespec>| t.map(|t| t.tv_sec * 1000 + t.tv_nsec / 1_000_000);
    assert_eq!(ms(sleep_for(false, None, 5)), None);
    assert_eq!(ms(sleep_for(true, None, 5)), Some(0));
    assert_eq!(ms(sleep_for(true, Some(10_000), 5)), Some(0));
    assert_eq!(ms(sleep_for(false, Some(1_234), 1_000)), Some(234));
    assert_eq!(ms(sleep_for(false, Some(900), 1_000)), Some(0));
    let weeks = 30 * 24 * 3_600_000;
    assert_eq!(ms(sleep_for(false, Some(weeks), 0)), Some(3_600_000));
    assert_eq!(ms(sleep_for(false, Some(u64::MAX), 0)), Some(3_600_000));
}

/// What the proxy logs, for tests that look at it: a global subscriber (the loops log on their
/// own threads), installed once, that keeps every line.
fn captured_log() -> Arc<std::sync::Mutex<Vec<u8>>> {
    static LOG: std::sync::OnceLock<Arc<std::sync::Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let writer = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || Captured(writer.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        log
    })
    .clone()
}

struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A connection ended for its certificate is said in the log before it is closed: its client
/// sees the end as soon as the loop closes it, and an operator (or a test) reading the log then
/// finds why. Looked at from the connection's end, which runs once its sockets are closed.
#[test]
fn a_retirement_is_logged_before_the_connection_closes() {
    let _serial = TEST_SERIAL.blocking_lock();
    let log = captured_log();
    let loops = RelayLoops::start(1).unwrap();
    let (pair, _client, upstream) = to(Upstream::Drain);
    let (tx, rx) = std::sync::mpsc::channel();
    let in_end = log.clone();
    let on_end: OnEnd = Box::new(move |outcome| {
        let text = String::from_utf8_lossy(&in_end.lock().unwrap()).into_owned();
        let _ = tx.send((outcome, text));
    });
    let watch = Watch {
        epoch: CertEpoch {
            generation: 1,
            not_after_unix: None,
        },
        mode: RotationClose::Immediate,
        ..Watch::none()
    };
    assert!(loops.hand_off(pair, watch, on_end));
    loops.retire(2);
    let (outcome, logged) = rx.recv_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(
        outcome.result.unwrap_err().to_string(),
        "certificate rotated"
    );
    assert!(
        logged.contains("closing a connection opened with a certificate that was replaced"),
        "the log when the connection had closed: {logged:?}"
    );
    upstream.join().unwrap();
    loops.shutdown();
}
