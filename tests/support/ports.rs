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
///
/// The pair is taken below the kernel's ephemeral range (`ip_local_port_range`), where no
/// `connect()` and no `bind(0)` ever lands. Inside it (where this used to look, starting from
/// a `bind(0)` port) the kernel hands odd ports to `bind(0)` and even ones to `connect()`, so
/// under a load of outgoing connections P+1 was taken again and again, and a benchmark failed
/// after 1,000 tries; and a pair found there could be taken by a connection before swtpm bound
/// it.
pub fn free_port_pair() -> u16 {
    use std::hash::BuildHasher;
    let (low, _) = ephemeral_range();
    // Ports from 20000 (never below 1024) up to the range: 12,000 pairs on Linux's default.
    let floor = 20_000.min(low.saturating_sub(2_000)).max(1024);
    let span = u32::from(low.saturating_sub(floor + 1).max(1));
    // A random start (so parallel test binaries spread out), then every candidate in turn.
    let start = (std::collections::hash_map::RandomState::new().hash_one(std::process::id())
        % u64::from(span)) as u32;
    for i in 0..span {
        let port = floor + ((start + i) % span) as u16;
        let pair = (
            TcpListener::bind((Ipv4Addr::LOCALHOST, port)),
            TcpListener::bind((Ipv4Addr::LOCALHOST, port + 1)),
        );
        if pair.0.is_ok() && pair.1.is_ok() && reserve(&[port, port + 1]) {
            return port;
        }
    }
    panic!("no free pair of adjacent TCP ports found on 127.0.0.1 from {floor} to {low}");
}

/// The kernel's ephemeral port range (`/proc/sys/net/ipv4/ip_local_port_range`; Linux's
/// default when unreadable).
pub fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut parts = text.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((parts.next()??, parts.next()??))
        })
        .unwrap_or((32768, 60999))
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
