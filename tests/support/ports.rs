//! Free loopback ports, handed out once per process so parallel tests never collide.

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Mutex;
use std::thread::sleep;
use std::time::{Duration, Instant};

/// Ports already handed out in this test binary, so parallel tests never get the same one.
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// Records `ports` as handed out; false if any of them was handed out before.
fn reserve(ports: &[u16]) -> bool {
    let mut guard = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let set = guard.get_or_insert_with(HashSet::new);
    if ports.iter().any(|p| set.contains(p)) {
        return false;
    }
    set.extend(ports.iter().copied());
    true
}

/// A currently free TCP port on 127.0.0.1 (never the same one twice in one test binary).
pub fn free_port() -> u16 {
    for _ in 0..1000 {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0");
        let port = listener.local_addr().expect("local_addr").port();
        if reserve(&[port]) {
            return port;
        }
    }
    panic!("no free TCP port found on 127.0.0.1");
}

/// A port P such that P and P+1 are both currently free on 127.0.0.1 (swtpm needs two).
pub fn free_port_pair() -> u16 {
    for _ in 0..1000 {
        let first = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0");
        let port = first.local_addr().expect("local_addr").port();
        if port == u16::MAX {
            continue;
        }
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port + 1)).is_ok() && reserve(&[port, port + 1])
        {
            return port;
        }
    }
    panic!("no free pair of adjacent TCP ports found on 127.0.0.1");
}

/// True if something accepts TCP connections on 127.0.0.1:`port` right now.
pub fn port_is_open(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

/// Waits until 127.0.0.1:`port` accepts connections; panics after `timeout`.
pub fn wait_for_port(port: u16, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if port_is_open(port) {
            return;
        }
        sleep(Duration::from_millis(20));
    }
    panic!("nothing listens on 127.0.0.1:{port} after {timeout:?}");
}
