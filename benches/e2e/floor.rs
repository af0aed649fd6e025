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
//!
//! The same relay in its TLS mode ([`FloorRelay::start_tls`], issue 38) is the floor of a relay
//! that does the proxy's job: plain bytes from a UNIX client, TLS 1.3 to the upstream with
//! rustls (the buffered API tokio-rustls uses, the same provider and cipher suite), still one
//! thread, no runtime, no buffer of its own per request (rustls allocates its records). What
//! the proxy spends above *it* is its runtime and bridge; what it spends above the bytes-only
//! floor is TLS itself.

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
    /// Every socket it listens on: `socket` alone, but for a relay of several threads in a
    /// process of its own ([`FloorRelay::start_tls2_own_process`]), one per thread.
    pub(crate) sockets: Vec<PathBuf>,
    /// The loopback TCP port of the two-sided TLS floor ([`FloorRelay::start_both_tls`]); 0
    /// for the floors on a UNIX socket.
    pub(crate) port: u16,
    tid: Arc<AtomicI32>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The relay's process when it runs in one of its own ([`FloorRelay::start_own_process`]).
    child: Option<i32>,
    _dir: tempfile::TempDir,
}

/// What the relay does with the bytes, and how it waits for them.
enum Mode {
    /// Copies them (epoll, `read`/`write`).
    Bytes,
    /// Speaks TLS to the upstream with this configuration (epoll, `read`/`write`).
    Tls(Arc<ClientConfig>),
    /// Copies them through an io_uring.
    Uring,
    /// Speaks TLS to the upstream through an io_uring.
    UringTls(Arc<ClientConfig>),
    /// Terminates TLS from loopback TCP clients with the first configuration and speaks TLS to
    /// the upstream with the second (epoll, `read`/`write`): the loopback path's floor.
    BothTls(Arc<rustls::ServerConfig>, Arc<ClientConfig>),
}

/// The relay's read size: the proxy's largest copy buffer and read-ahead.
const COPY: usize = 64 * 1024;

/// One client and its upstream connection (with its TLS state in TLS mode).
struct Pair {
    client: StdUnix,
    upstream: std::net::TcpStream,
    tls: Option<rustls::ClientConnection>,
}

impl FloorRelay {
    pub(crate) fn start(upstream_port: u16) -> FloorRelay {
        FloorRelay::spawn(upstream_port, Mode::Bytes)
    }

    /// The bytes floor on io_uring instead of epoll ([`super::uring_floor`]); None (said on
    /// stderr) when this kernel gives no ring with the floor's flags.
    pub(crate) fn start_uring(upstream_port: u16) -> Option<FloorRelay> {
        if let Err(e) = super::uring_floor::ring() {
            eprintln!("e2e: no io_uring here ({e}): the io_uring floor's rows are left out");
            return None;
        }
        Some(FloorRelay::spawn(upstream_port, Mode::Uring))
    }

    /// The TLS floor on io_uring ([`super::uring_floor`]); None as for [`FloorRelay::start_uring`].
    pub(crate) fn start_uring_tls(
        upstream_port: u16,
        config: Arc<ClientConfig>,
    ) -> Option<FloorRelay> {
        super::uring_floor::ring().ok()?;
        Some(FloorRelay::spawn(upstream_port, Mode::UringTls(config)))
    }

    /// The relay in TLS mode: clients speak plain HTTP on its UNIX socket, and it speaks TLS
    /// with `config` to the upstream (the handshake, done at accept, is not what is measured).
    pub(crate) fn start_tls(upstream_port: u16, config: Arc<ClientConfig>) -> FloorRelay {
        FloorRelay::spawn(upstream_port, Mode::Tls(config))
    }

    /// The two-sided TLS floor: clients speak TLS to it on a loopback TCP port (`server`, the
    /// proxy's loopback configuration), and it speaks TLS to the upstream (`client`); each
    /// client's handshake is done at accept, blocking, on the relay's thread
    /// ([`super::loopback_floor`]).
    pub(crate) fn start_both_tls(
        upstream_port: u16,
        server: Arc<rustls::ServerConfig>,
        client: Arc<ClientConfig>,
    ) -> FloorRelay {
        FloorRelay::spawn(upstream_port, Mode::BothTls(server, client))
    }

    fn spawn(upstream_port: u16, mode: Mode) -> FloorRelay {
        let dir = temp_dir();
        let socket = dir.path().join("floor.sock");
        if let Mode::BothTls(server, client) = mode {
            let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("floor TCP port");
            let port = listener.local_addr().expect("floor port").port();
            let (tid, stop) = (
                Arc::new(AtomicI32::new(0)),
                Arc::new(AtomicBool::new(false)),
            );
            let (t, s) = (tid.clone(), stop.clone());
            let thread = std::thread::Builder::new()
                .name("loopback-floor".into())
                .spawn(move || {
                    t.store(
                        rustix::thread::gettid().as_raw_nonzero().get(),
                        Ordering::SeqCst,
                    );
                    super::loopback_floor::serve(listener, upstream_port, &server, &client, &s)
                })
                .expect("loopback floor thread");
            return FloorRelay::started(socket, port, tid, stop, thread, dir);
        }
        let listener = UnixListener::bind(&socket).expect("floor relay socket");
        let tid = Arc::new(AtomicI32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (t, s) = (tid.clone(), stop.clone());
        let name = match mode {
            Mode::Bytes => "floor-relay",
            Mode::Tls(_) => "tls-floor",
            Mode::Uring => "uring-floor",
            Mode::UringTls(_) => "uring-tls-floor",
            Mode::BothTls(..) => unreachable!("started above"),
        };
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                t.store(
                    rustix::thread::gettid().as_raw_nonzero().get(),
                    Ordering::SeqCst,
                );
                match mode {
                    Mode::Bytes => serve(listener, upstream_port, None, &s),
                    Mode::Tls(config) => serve(listener, upstream_port, Some(config), &s),
                    Mode::Uring => super::uring_floor::serve(listener, upstream_port, None, &s),
                    Mode::UringTls(config) => {
                        super::uring_floor::serve(listener, upstream_port, Some(config), &s)
                    }
                    Mode::BothTls(..) => unreachable!("started above"),
                }
            })
            .expect("floor relay thread");
        FloorRelay::started(socket, 0, tid, stop, thread, dir)
    }

    /// The bytes floor in a process of its own: forked from this one once its socket is bound,
    /// the child runs the relay's loop and nothing else, and is killed on drop. A relay is never
    /// a thread of its clients' process: each switch between the load generator and a relay in
    /// another process changes address space, as it does for hwkey, which a floor thread in the
    /// bench's own process does not pay.
    pub(crate) fn start_own_process(upstream_port: u16) -> FloorRelay {
        FloorRelay::fork(upstream_port, None, 1, false).expect("the bytes floor's process")
    }

    /// The two-thread TLS floor (two TLS floor relays, a thread each, connections in turn) in a
    /// process of its own, as [`FloorRelay::start_own_process`] is the bytes floor: the proxy's
    /// job on a thread per core, done by the least relay, paying what hwkey pays for being
    /// another process than its clients. Its sockets are [`FloorRelay::sockets`]. `seccomp`:
    /// under the proxy's own seccomp filters (`hwkey::proxy::sandbox::install_seccomp_filters`),
    /// as hwkey's network side runs, so that each of its system calls costs what one of hwkey's
    /// does. None (said on stderr) when this kernel takes no seccomp filter.
    pub(crate) fn start_tls2_own_process(
        upstream_port: u16,
        config: Arc<ClientConfig>,
        seccomp: bool,
    ) -> Option<FloorRelay> {
        FloorRelay::fork(upstream_port, Some(config), 2, seccomp)
    }

    /// A child process serving `threads` listeners, a thread each (the child's first thread
    /// serves the first), under the proxy's seccomp filters if `seccomp`: None when they could
    /// not be installed. A panic on any of its threads ends the child (and so the trials that
    /// use it fail rather than wait on a listener nobody serves).
    #[allow(
        unsafe_code,
        reason = "fork, and _exit in the child: no safe binding forks a process"
    )]
    fn fork(
        upstream_port: u16,
        tls: Option<Arc<ClientConfig>>,
        threads: usize,
        seccomp: bool,
    ) -> Option<FloorRelay> {
        /// The child's exit status when the filters could not be installed.
        const NO_FILTERS: i32 = 3;
        let dir = temp_dir();
        let sockets: Vec<PathBuf> = (0..threads)
            .map(|i| dir.path().join(format!("floor-{i}.sock")))
            .collect();
        let listeners: Vec<UnixListener> = sockets
            .iter()
            .map(|s| UnixListener::bind(s).expect("floor relay socket"))
            .collect();
        // SAFETY: the child only closes the descriptors it does not keep (listing
        // /proc/self/fd), names its thread, installs the proxy's seccomp filters (prctl and
        // seccomp calls), starts its threads and runs `serve` on each (epoll, sockets and the
        // allocator, whose locks glibc resets in a forked child); it leaves with `_exit`
        // whatever happens (its panic hook too): no destructor of the parent's state runs in
        // it.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            // The child keeps only its listeners (and the standard streams): a copy of any
            // other descriptor of the bench's (a pipe, a client's socket) would keep it open
            // for its peer after the bench closes its own.
            let keep: Vec<i32> = listeners
                .iter()
                .map(std::os::fd::AsRawFd::as_raw_fd)
                .collect();
            let open: Vec<i32> = std::fs::read_dir("/proc/self/fd")
                .map(|dir| {
                    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                        .filter(|fd| *fd > 2 && !keep.contains(fd))
                        .collect()
                })
                .unwrap_or_default();
            for fd in open {
                // SAFETY: the child owns nothing it uses through these descriptors.
                unsafe { libc::close(fd) };
            }
            // Its threads' names tell them from the bench's in a profile.
            let _ = rustix::thread::set_name(c"floor-proc");
            // A panic on any thread ends the child, after the usual message.
            let report = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                report(info);
                // SAFETY: ends the child without running anything of the parent's.
                unsafe { libc::_exit(1) };
            }));
            if seccomp {
                // Before its threads: the filters are the whole process's either way.
                if let Err(e) = hwkey::proxy::sandbox::install_seccomp_filters(false) {
                    eprintln!("e2e: the proxy's seccomp filters cannot be installed here ({e}): the rows of the floor under them are left out");
                    // SAFETY: as above.
                    unsafe { libc::_exit(NO_FILTERS) };
                }
            }
            let stop: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
            let mut listeners = listeners.into_iter();
            let first = listeners.next().expect("a listener");
            for listener in listeners {
                let tls = tls.clone();
                std::thread::Builder::new()
                    .name("floor-proc".into())
                    .spawn(move || serve(listener, upstream_port, tls, stop))
                    .expect("floor relay thread");
            }
            serve(first, upstream_port, tls, stop);
            // SAFETY: as above.
            unsafe { libc::_exit(0) };
        }
        drop(listeners);
        // Its threads, once all are running (a thread's CPU is read from its task directory).
        let tasks = || std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
        let started = Instant::now();
        while tasks() < threads {
            let mut status = 0;
            // SAFETY: a plain system call on the child forked above.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == NO_FILTERS {
                    return None;
                }
                panic!("the floor relay's process {pid} ended before it served (status {status}; it says why on stderr)");
            }
            if started.elapsed() > Duration::from_secs(10) {
                // SAFETY: as above.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
                panic!("the floor relay's process {pid} did not start its {threads} threads in 10 s (killed)");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Some(FloorRelay {
            socket: sockets[0].clone(),
            sockets,
            port: 0,
            tid: Arc::new(AtomicI32::new(pid)),
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
            child: Some(pid),
            _dir: dir,
        })
    }

    /// The relay once its thread has said which it is.
    fn started(
        socket: PathBuf,
        port: u16,
        tid: Arc<AtomicI32>,
        stop: Arc<AtomicBool>,
        thread: std::thread::JoinHandle<()>,
        dir: tempfile::TempDir,
    ) -> FloorRelay {
        while tid.load(Ordering::SeqCst) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        FloorRelay {
            sockets: vec![socket.clone()],
            socket,
            port,
            tid,
            stop,
            thread: Some(thread),
            child: None,
            _dir: dir,
        }
    }

    /// Every thread's `/proc` directory: the relay's thread, or each of its process's.
    pub(crate) fn task_dirs(&self) -> Vec<PathBuf> {
        match self.child {
            Some(pid) => std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|d| d.filter_map(|t| Some(t.ok()?.path())).collect())
                .unwrap_or_default(),
            None => vec![self.task_dir()],
        }
    }

    /// The relay thread's `/proc` directory (its CPU clock and context switches).
    pub(crate) fn task_dir(&self) -> PathBuf {
        let tid = self.tid.load(Ordering::SeqCst);
        match self.child {
            Some(pid) => PathBuf::from(format!("/proc/{pid}/task/{tid}")),
            None => PathBuf::from(format!("/proc/self/task/{tid}")),
        }
    }
}

impl Drop for FloorRelay {
    #[allow(
        unsafe_code,
        reason = "kill and waitpid of the relay's own child process"
    )]
    fn drop(&mut self) {
        if let Some(pid) = self.child.take() {
            // SAFETY: plain system calls on the child this relay forked.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        }
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The event loop: token 0 is the listener, 2i+1 client i, 2i+2 its upstream.
fn serve(
    listener: UnixListener,
    upstream_port: u16,
    tls: Option<Arc<ClientConfig>>,
    stop: &AtomicBool,
) {
    let ep = epoll::create(epoll::CreateFlags::CLOEXEC).expect("epoll");
    let readable = epoll::EventFlags::IN;
    epoll::add(&ep, &listener, epoll::EventData::new_u64(0), readable).expect("epoll add");
    let mut pairs: Vec<Option<Pair>> = Vec::new();
    let mut events = Vec::with_capacity(64);
    // Bytes mode copies through 64 KiB; TLS mode reads records into one half and plain bytes
    // out of rustls into the other.
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
                let (client, _) = listener.accept().expect("floor accept");
                let mut upstream = std::net::TcpStream::connect(("127.0.0.1", upstream_port))
                    .expect("floor upstream");
                upstream.set_nodelay(true).expect("nodelay");
                let tls = tls
                    .as_ref()
                    .map(|config| super::floor_tls::handshake(config, &mut upstream));
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
                pairs.push(Some(Pair {
                    client,
                    upstream,
                    tls,
                }));
                continue;
            }
            let i = (token - 1) / 2;
            let Some(pair) = &mut pairs[i] else { continue };
            let copied = match (&mut pair.tls, token % 2 == 1) {
                (None, true) => copy_once(&mut pair.client, &mut pair.upstream, &mut buf[..COPY]),
                (None, false) => copy_once(&mut pair.upstream, &mut pair.client, &mut buf[..COPY]),
                (Some(tls), true) => {
                    encrypt_once(&mut pair.client, tls, &mut pair.upstream, &mut buf[..COPY])
                }
                (Some(tls), false) => {
                    decrypt_once(&mut pair.upstream, tls, &mut pair.client, &mut buf)
                }
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

/// One read of the client's plain bytes (it is readable), sealed into records and written to
/// the upstream; false at end of stream or on an error.
fn encrypt_once(
    client: &mut StdUnix,
    tls: &mut rustls::ClientConnection,
    upstream: &mut std::net::TcpStream,
    buf: &mut [u8],
) -> bool {
    let n = match client.read(buf) {
        Ok(0) | Err(_) => return false,
        Ok(n) => n,
    };
    if tls.writer().write_all(&buf[..n]).is_err() {
        return false;
    }
    flush_tls(tls, upstream)
}

/// One read of the upstream's records (it is readable; up to 64 KiB, as the proxy's read-ahead
/// takes them), handed to rustls from memory (it takes at most 4 KiB per `read_tls`), opened,
/// and their plain bytes written to the client; false at end of stream or on an error.
fn decrypt_once(
    upstream: &mut std::net::TcpStream,
    tls: &mut rustls::ClientConnection,
    client: &mut StdUnix,
    buf: &mut [u8],
) -> bool {
    let (ahead, plain) = buf.split_at_mut(buf.len() / 2);
    let n = match upstream.read(ahead) {
        Ok(0) | Err(_) => return false,
        Ok(n) => n,
    };
    let mut records = &ahead[..n];
    while !records.is_empty() {
        if tls.read_tls(&mut records).is_err() || tls.process_new_packets().is_err() {
            return false;
        }
        loop {
            match tls.reader().read(plain) {
                Ok(0) => return false,
                Ok(n) => {
                    if client.write_all(&plain[..n]).is_err() {
                        return false;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(_) => return false,
            }
        }
    }
    flush_tls(tls, upstream)
}

/// Writes every pending record (one `writev` each time, as the proxy's stream does).
fn flush_tls(tls: &mut rustls::ClientConnection, upstream: &mut std::net::TcpStream) -> bool {
    while tls.wants_write() {
        if tls.write_tls(upstream).is_err() {
            return false;
        }
    }
    true
}
