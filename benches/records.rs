//! rustls per small record (issue 38): what one keep-alive request/response pair costs the
//! proxy's upstream hop in rustls alone, beside AES-128-GCM alone on the same bytes, and what
//! rustls's unbuffered API would save.
//!
//! The e2e `requests` step measures a whole process (kernel, tokio, the bridge, rustls); this
//! one isolates rustls, as issue 38 asks ("a micro-bench beside the e2e one"), so that a change
//! to how the proxy drives rustls can be judged before it is built. One thread, memory buffers,
//! no system calls. The client side is what is timed (the proxy is the upstream's TLS client);
//! the server answering it is the same buffered rustls server for every contender and is not
//! timed. Per pair, the client:
//! - encrypts a 256-byte request (one record) and
//! - decrypts a 1 KiB response (one record), handing its plaintext on.
//!
//! Contenders, in interleaved rounds:
//! - **AEAD floor**: ring's AES-128-GCM sealing the request and opening the response, with the
//!   record's header as associated data, and nothing else;
//! - **buffered** (what the proxy runs through tokio-rustls): `writer().write_all` and
//!   `write_tls`; then `read_tls` from the bytes one `recv` gave (as the proxy's read-ahead
//!   hands them), `process_new_packets`, and `reader().read` into the relay's copy buffer;
//! - **unbuffered**: `process_tls_records` and `WriteTraffic::encrypt` into the outgoing
//!   buffer; the response decrypted where it arrived (`ReadTraffic::next_record`), its payload
//!   handed on without a copy of ours.
//!
//! Besides time, each contender's heap allocations per pair are counted (a global counting
//! allocator), a figure that does not depend on the machine's speed. A bulk figure does the
//! same for 64 KiB bursts of 16 KiB records (the download direction), in seconds per GB.
//!
//! Besides, what a session holds on the heap at rest (counted bytes, also independent of the
//! machine's speed): a loopback connection's two buffered sessions as the proxy's hops
//! configure them, and a client session on each API. The RSS goal of issue 55 is judged
//! against these (docs/BENCHMARKS.md, round seven).
//!
//! Run: `cargo bench --bench records` (hsm-fixtures/bench.sh does).

use support::bench as common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Row, Stat};
use rustls::client::UnbufferedClientConnection;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::unbuffered::{ConnectionState, UnbufferedStatus};
use rustls::{
    ClientConfig, ClientConnection, ConnectionCommon, RootCertStore, ServerConfig, ServerConnection,
};

const AREA: &str = "rustls per record";

/// A kubelet-sized request and a small JSON answer.
const REQUEST: usize = 256;
const RESPONSE: usize = 1024;
/// A download burst: four full records, what one 64 KiB `recv` holds.
const BURST: usize = 64 * 1024;

/// Counts heap allocations (including reallocations) of the whole process; the bench has one
/// thread.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// Bytes allocated and not yet freed, for what a session holds at rest.
static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call is passed unchanged to the system allocator; only a counter is added.
#[allow(
    unsafe_code,
    reason = "a global allocator is an unsafe trait; counting allocations needs one"
)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(size(layout.size()), Ordering::Relaxed);
        // SAFETY: the caller's contract is System's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(size(layout.size()), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        LIVE.fetch_add(size(new_size) - size(layout.size()), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(size(layout.size()), Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// An allocation's size as a signed count of bytes.
fn size(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Time and allocations spent inside the timed regions only.
#[derive(Default)]
struct Meter {
    spent: Duration,
    allocations: u64,
    regions: u64,
}

impl Meter {
    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let allocations = ALLOCATIONS.load(Ordering::Relaxed);
        let started = Instant::now();
        let out = f();
        self.spent += started.elapsed();
        self.allocations += ALLOCATIONS.load(Ordering::Relaxed) - allocations;
        self.regions += 1;
        out
    }
}

fn configs() -> (Arc<ClientConfig>, Arc<ServerConfig>) {
    let server = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("server");
    let cert: CertificateDer<'static> = server.cert.der().clone();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server.signing_key.serialize_der()));
    let mut roots = RootCertStore::empty();
    roots.add(cert.clone()).expect("root");
    // The proxy's provider: ring, suites in Go's order (AES-128-GCM first).
    let provider = hwkey::pki::tls::provider_for(hwkey::pki::tls::KeyExchange::Classical);
    let client = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut server = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .expect("server cert");
    server.send_tls13_tickets = 0;
    (Arc::new(client), Arc::new(server))
}

/// Feeds `bytes` to the server and returns its answer of `answer` bytes, encrypted.
fn serve(s: &mut ServerConnection, mut bytes: &[u8], answer: &[u8], out: &mut Vec<u8>) {
    let mut sink = [0u8; 4096];
    while !bytes.is_empty() {
        s.read_tls(&mut bytes).expect("server read_tls");
        s.process_new_packets().expect("server process");
        while let Ok(n) = s.reader().read(&mut sink) {
            if n == 0 {
                break;
            }
        }
    }
    out.clear();
    if !answer.is_empty() {
        s.writer().write_all(answer).expect("server write");
    }
    while s.wants_write() {
        s.write_tls(out).expect("server write_tls");
    }
}

/// The client as the proxy drives it through tokio-rustls.
struct Buffered {
    c: ClientConnection,
    s: ServerConnection,
    wire: Vec<u8>,
    inbound: Vec<u8>,
    relay: Vec<u8>,
}

impl Buffered {
    fn new(client: &Arc<ClientConfig>, server: &Arc<ServerConfig>) -> Buffered {
        let mut c = ClientConnection::new(client.clone(), "localhost".try_into().expect("name"))
            .expect("client");
        let mut s = ServerConnection::new(server.clone()).expect("server");
        let mut buf = Vec::new();
        let mut back = Vec::new();
        let mut flights = 0;
        while c.is_handshaking() || s.is_handshaking() || c.wants_write() {
            flights += 1;
            assert!(flights < 10, "the handshake stalled");
            buf.clear();
            while c.wants_write() {
                c.write_tls(&mut buf).expect("client write_tls");
            }
            serve(&mut s, &buf, &[], &mut back);
            let mut rd: &[u8] = &back;
            while !rd.is_empty() {
                c.read_tls(&mut rd).expect("client read_tls");
                c.process_new_packets().expect("client process");
            }
        }
        let suite = c.negotiated_cipher_suite().expect("suite").suite();
        assert_eq!(suite, rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        Buffered {
            c,
            s,
            wire: Vec::new(),
            inbound: Vec::new(),
            relay: vec![0u8; BURST],
        }
    }

    /// Encrypts `request`; the server answers with `answer`; decrypts it into the relay buffer.
    fn pair(&mut self, m: &mut Meter, request: &[u8], answer: &[u8]) {
        let Buffered {
            c,
            s,
            wire,
            inbound,
            relay,
        } = self;
        wire.clear();
        m.time(|| {
            c.writer().write_all(request).expect("write");
            while c.wants_write() {
                c.write_tls(wire).expect("write_tls");
            }
        });
        serve(s, wire, answer, inbound);
        let got = m.time(|| read_records(c, inbound, relay));
        assert_eq!(got, answer.len());
    }
}

/// As tokio-rustls under the relay: the records one `recv` gave handed to rustls, and the
/// plaintext read out into the relay's copy buffer while it has room (rustls holds at most
/// 16 KiB of plaintext at a time); the bytes read.
fn read_records(c: &mut ClientConnection, mut records: &[u8], relay: &mut [u8]) -> usize {
    let mut got = 0;
    while !records.is_empty() {
        c.read_tls(&mut records).expect("read_tls");
        c.process_new_packets().expect("process");
        loop {
            match c.reader().read(&mut relay[got..]) {
                Ok(n) if n > 0 => got += n,
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("read: {e}"),
            }
        }
    }
    black_box(&relay[..got]);
    got
}

/// The client on rustls's unbuffered API.
struct Unbuffered {
    c: UnbufferedClientConnection,
    s: ServerConnection,
    incoming: Vec<u8>,
    used: usize,
    outgoing: Vec<u8>,
    inbound: Vec<u8>,
}

impl Unbuffered {
    fn new(client: &Arc<ClientConfig>, server: &Arc<ServerConfig>) -> Unbuffered {
        let mut c =
            UnbufferedClientConnection::new(client.clone(), "localhost".try_into().expect("name"))
                .expect("client");
        let mut s = ServerConnection::new(server.clone()).expect("server");
        let mut incoming = vec![0u8; 2 * BURST];
        let mut used = 0;
        let mut outgoing = vec![0u8; 2 * BURST];
        let mut out_used = 0;
        let mut from_server = Vec::new();
        loop {
            let UnbufferedStatus { discard, state } = c.process_tls_records(&mut incoming[..used]);
            let mut need_more = false;
            let mut finished = false;
            match state.expect("handshake") {
                ConnectionState::EncodeTlsData(mut e) => {
                    out_used += e.encode(&mut outgoing[out_used..]).expect("room");
                }
                ConnectionState::TransmitTlsData(t) => {
                    let mut answer = Vec::new();
                    serve(&mut s, &outgoing[..out_used], &[], &mut answer);
                    from_server.extend_from_slice(&answer);
                    out_used = 0;
                    t.done();
                }
                ConnectionState::BlockedHandshake => need_more = true,
                ConnectionState::WriteTraffic(_) => finished = true,
                other => panic!("unexpected state in the handshake: {other:?}"),
            }
            incoming.copy_within(discard..used, 0);
            used -= discard;
            if need_more {
                assert!(!from_server.is_empty(), "the handshake stalled");
                incoming[used..used + from_server.len()].copy_from_slice(&from_server);
                used += from_server.len();
                from_server.clear();
            }
            if finished {
                break;
            }
        }
        let suite = c.negotiated_cipher_suite().expect("suite").suite();
        assert_eq!(suite, rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        Unbuffered {
            c,
            s,
            incoming,
            used,
            outgoing,
            inbound: Vec::new(),
        }
    }

    fn pair(&mut self, m: &mut Meter, request: &[u8], answer: &[u8]) {
        let n = m.time(|| {
            let UnbufferedStatus { discard, state } = self.c.process_tls_records(&mut []);
            assert_eq!(discard, 0);
            match state.expect("state") {
                ConnectionState::WriteTraffic(mut w) => {
                    w.encrypt(request, &mut self.outgoing).expect("room")
                }
                other => panic!("not ready to write: {other:?}"),
            }
        });
        serve(&mut self.s, &self.outgoing[..n], answer, &mut self.inbound);
        // What the kernel's recv does: the records land in the incoming buffer.
        let len = self.inbound.len();
        self.incoming[self.used..self.used + len].copy_from_slice(&self.inbound);
        self.used += len;
        let got = m.time(|| self.read_all());
        assert_eq!(got, answer.len());
    }

    /// Decrypts every record in the incoming buffer, handing each payload on. rustls gives one
    /// record per call; what it has done with is skipped over (an offset), and what is left is
    /// moved to the front once, at the end, as a relay moves a partial record before its next
    /// read.
    fn read_all(&mut self) -> usize {
        let mut got = 0;
        let mut start = 0;
        loop {
            let UnbufferedStatus { mut discard, state } = self
                .c
                .process_tls_records(&mut self.incoming[start..self.used]);
            let done = match state.expect("state") {
                ConnectionState::ReadTraffic(mut r) => {
                    while let Some(record) = r.next_record() {
                        let record = record.expect("record");
                        discard += record.discard;
                        got += black_box(record.payload).len();
                    }
                    false
                }
                ConnectionState::WriteTraffic(_) => true,
                other => panic!("unexpected state: {other:?}"),
            };
            start += discard;
            if done {
                self.incoming.copy_within(start..self.used, 0);
                self.used -= start;
                return got;
            }
        }
    }
}

/// AES-128-GCM alone on the same records (TLS 1.3's nonce and header as associated data).
struct Floor {
    key: ring::aead::LessSafeKey,
    seq: u64,
    record: Vec<u8>,
    sealed: Vec<(Vec<u8>, u64)>,
    work: Vec<u8>,
}

impl Floor {
    fn new() -> Floor {
        let key = ring::aead::LessSafeKey::new(
            ring::aead::UnboundKey::new(&ring::aead::AES_128_GCM, &[7u8; 16]).expect("key"),
        );
        Floor {
            key,
            seq: 0,
            record: Vec::with_capacity(BURST),
            sealed: Vec::new(),
            work: Vec::with_capacity(2 * BURST),
        }
    }

    fn nonce(seq: u64) -> ring::aead::Nonce {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&seq.to_be_bytes());
        ring::aead::Nonce::assume_unique_for_key(n)
    }

    fn header(len: usize) -> [u8; 5] {
        let len = u16::try_from(len).expect("record length");
        let l = len.to_be_bytes();
        [0x17, 0x03, 0x03, l[0], l[1]]
    }

    /// Seals `plain` as one record (copied in, as rustls copies the plaintext into the record).
    fn seal(&mut self, plain: &[u8]) {
        let header = Self::header(plain.len() + 1 + 16);
        self.record.clear();
        self.record.extend_from_slice(&header);
        self.record.extend_from_slice(plain);
        self.record.push(0x17);
        let nonce = Self::nonce(self.seq);
        self.seq += 1;
        let tag = self
            .key
            .seal_in_place_separate_tag(nonce, ring::aead::Aad::from(header), &mut self.record[5..])
            .expect("seal");
        self.record.extend_from_slice(tag.as_ref());
        black_box(&self.record);
    }

    /// Records of `plain`'s bytes in pieces of at most 16 KiB, sealed ahead (untimed).
    fn prepare(&mut self, plain: &[u8]) {
        self.sealed.clear();
        for piece in plain.chunks(16 * 1024) {
            self.seal(piece);
            self.sealed.push((self.record.clone(), self.seq - 1));
        }
        self.work.clear();
        for (r, _) in &self.sealed {
            self.work.extend_from_slice(r);
        }
    }

    /// Opens the prepared records where they lie.
    fn open(&mut self) -> usize {
        let mut at = 0;
        let mut got = 0;
        for (record, seq) in &self.sealed {
            let (header, body) = self.work[at..at + record.len()].split_at_mut(5);
            let header: [u8; 5] = header.try_into().expect("header");
            let plain = self
                .key
                .open_in_place(Self::nonce(*seq), ring::aead::Aad::from(header), body)
                .expect("open");
            got += black_box(&plain[..plain.len() - 1]).len();
            at += record.len();
        }
        got
    }

    fn pair(&mut self, m: &mut Meter, request: &[u8], answer: &[u8]) {
        m.time(|| self.seal(request));
        self.prepare(answer);
        let got = m.time(|| self.open());
        assert_eq!(got, answer.len());
    }
}

/// One contender's rounds: (time, allocations) per pair or per burst.
type Series = (Vec<f64>, Vec<f64>);

/// Contender `of.0` against contender `of.1` of the same figure, with the ratio per round.
fn row(measure: &str, unit: &str, figure: &[Series], of: (usize, usize), baseline: &str) -> Row {
    let (s, b) = (&figure[of.0].0, &figure[of.1].0);
    Row::new(AREA, measure, unit, Some(Stat::of(s))).versus(
        baseline,
        Some(Stat::of(b)),
        Some(Stat::of(&common::paired_ratios(s, b))),
    )
}

/// One contender's figures over a round: ns and allocations per pair (or per burst).
fn per(m: &Meter, n: u32) -> (f64, f64) {
    (
        m.spent.as_nanos() as f64 / f64::from(n),
        m.allocations as f64 / f64::from(n),
    )
}

fn main() {
    if common::skip_unless_cargo_bench("records") {
        return;
    }
    let started = Instant::now();
    let load_before = common::before();
    let (client, server) = configs();
    let rounds = common::pick(15, 4);
    let pairs = common::pick(20_000u32, 4_000);
    let bursts = common::pick(2_000u32, 400);
    let request = vec![0x47u8; REQUEST];
    let answer = vec![0x7bu8; RESPONSE];
    let burst = vec![0x5au8; BURST];

    let mut buffered = Buffered::new(&client, &server);
    let mut unbuffered = Unbuffered::new(&client, &server);
    let mut floor = Floor::new();
    // Warm-up: page faults, lazy tables, buffers at their working size.
    for _ in 0..1000 {
        let mut m = Meter::default();
        buffered.pair(&mut m, &request, &answer);
        unbuffered.pair(&mut m, &request, &answer);
        floor.pair(&mut m, &request, &answer);
        buffered_burst(&mut buffered, &mut m, &burst);
        unbuffered_burst(&mut unbuffered, &mut m, &burst);
        floor.prepare(&burst);
        floor.open();
    }

    // [floor, buffered, unbuffered] × (ns, allocations) per pair and per burst.
    let mut small: Vec<Series> = vec![(Vec::new(), Vec::new()); 3];
    let mut bulk: Vec<Series> = vec![(Vec::new(), Vec::new()); 3];
    for round in 0..rounds {
        // The order rotates, so no contender always runs right after another.
        for k in 0..3 {
            let which = (round + k) % 3;
            let mut m = Meter::default();
            for _ in 0..pairs {
                match which {
                    0 => floor.pair(&mut m, &request, &answer),
                    1 => buffered.pair(&mut m, &request, &answer),
                    _ => unbuffered.pair(&mut m, &request, &answer),
                }
            }
            let (ns, allocs) = per(&m, pairs);
            small[which].0.push(ns);
            small[which].1.push(allocs);
            // Bursts: a download's records, decrypt side only (no request).
            let mut m = Meter::default();
            for _ in 0..bursts {
                match which {
                    0 => {
                        floor.prepare(&burst);
                        assert_eq!(m.time(|| floor.open()), BURST);
                    }
                    1 => buffered_burst(&mut buffered, &mut m, &burst),
                    _ => unbuffered_burst(&mut unbuffered, &mut m, &burst),
                }
            }
            let (ns, allocs) = per(&m, bursts);
            // Seconds per GB: ns per burst / bytes per burst.
            bulk[which].0.push(ns / BURST as f64);
            bulk[which].1.push(allocs);
        }
    }

    // What a timed region costs when it holds nothing (two per pair, one per burst): in every
    // figure alike, said in the notes.
    let mut empty = Meter::default();
    for _ in 0..pairs {
        empty.time(|| black_box(0));
    }
    let timer = per(&empty, pairs).0;

    let [aes, buffered, unbuffered] = [0, 1, 2];
    let names = ["AES-128-GCM alone (ring)", "buffered API", "unbuffered API"];
    let allocations = |figure: &[Series], i: usize| Stat::of(&figure[i].1).median;
    let note_small = format!(
        "client side of one pair: a {REQUEST}-byte request encrypted, a {RESPONSE}-byte response \
         decrypted (one record each), one thread, memory buffers; {pairs} pairs per round, \
         {rounds} rounds, contenders interleaved; each figure includes two timed regions of \
         {timer:.0} ns each when empty"
    );
    let note_bulk = format!(
        "decrypting 64 KiB bursts of four 16 KiB records into the relay (buffered: read_tls from \
         the bytes one recv gave, then reader().read into a 64 KiB copy buffer; unbuffered: \
         decrypted where the bytes arrived, payload handed on, which rustls 0.23 still copies \
         into a Vec); {bursts} bursts per round, {rounds} rounds"
    );
    let mut rows = vec![
        row(
            "request/response pair, rustls buffered API (what the proxy runs)",
            "ns",
            &small,
            (buffered, aes),
            names[aes],
        )
        .note(format!(
            "{note_small}; heap allocations per pair: buffered {:.2}, AES alone {:.2}",
            allocations(&small, buffered),
            allocations(&small, aes)
        )),
        row(
            "request/response pair, rustls unbuffered API",
            "ns",
            &small,
            (unbuffered, buffered),
            names[buffered],
        )
        .note(format!(
            "the same pairs; heap allocations per pair: unbuffered {:.2}, buffered {:.2}; \
             AES alone: {:.0} ns",
            allocations(&small, unbuffered),
            allocations(&small, buffered),
            Stat::of(&small[aes].0).median
        )),
        row(
            "download, rustls buffered API (what the proxy runs)",
            "s/GB",
            &bulk,
            (buffered, aes),
            names[aes],
        )
        .note(format!(
            "{note_bulk}; heap allocations per burst: buffered {:.2}",
            allocations(&bulk, buffered)
        )),
        row(
            "download, rustls unbuffered API",
            "s/GB",
            &bulk,
            (unbuffered, buffered),
            names[buffered],
        )
        .note(format!(
            "the same bursts; heap allocations per burst: unbuffered {:.2}, buffered {:.2}",
            allocations(&bulk, unbuffered),
            allocations(&bulk, buffered)
        )),
    ];
    rows.extend(at_rest(&client, &server));
    for r in &rows {
        let s = r.subject.expect("subject");
        match (r.baseline, r.ratio) {
            (Some(b), Some(q)) => println!(
                "{}: {:.3} {} vs {} {:.3}: {:.2}× [{:.2}–{:.2}]",
                r.measure, s.median, r.unit, r.baseline_label, b.median, q.median, q.p25, q.p75
            ),
            _ => println!("{}: {:.3} {} ({})", r.measure, s.median, r.unit, r.note),
        }
    }
    common::finish("records", load_before, started, rows);
}

fn buffered_burst(b: &mut Buffered, m: &mut Meter, burst: &[u8]) {
    serve(&mut b.s, &[], burst, &mut b.inbound);
    let Buffered {
        c, inbound, relay, ..
    } = b;
    let got = m.time(|| read_records(c, inbound, relay));
    assert_eq!(got, burst.len());
}

fn unbuffered_burst(u: &mut Unbuffered, m: &mut Meter, burst: &[u8]) {
    serve(&mut u.s, &[], burst, &mut u.inbound);
    let len = u.inbound.len();
    u.incoming[u.used..u.used + len].copy_from_slice(&u.inbound);
    u.used += len;
    let got = m.time(|| u.read_all());
    assert_eq!(got, burst.len());
}

/// A loopback connection's two sessions as the proxy holds them between requests: configs as
/// the proxy's two hops have them (a server requiring a client certificate from a CA and
/// sending one ticket, a client presenting one), the ring provider the proxy uses, TLS 1.3.
/// The client resumes (as the proxy's upstream connections do) or, `resume` false, is
/// kubectl: a full handshake each time and no ticket asked for.
fn hop_configs(resume: bool) -> (Arc<ClientConfig>, Arc<ServerConfig>) {
    let ca_key = rcgen::KeyPair::generate().expect("CA key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("CA cert");
    let issuer = rcgen::Issuer::new(ca_params, &ca_key);
    let leaf = |names: Vec<String>| {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(names)
            .expect("params")
            .signed_by(&key, &issuer)
            .expect("cert");
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        (vec![cert.der().clone()], der)
    };
    let (server_chain, server_key) = leaf(vec!["localhost".into()]);
    let (client_chain, client_key) = leaf(Vec::new());
    let mut roots = RootCertStore::empty();
    roots.add(ca.der().clone()).expect("root");
    let roots = Arc::new(roots);
    let provider = hwkey::pki::tls::provider_for(hwkey::pki::tls::KeyExchange::Classical);
    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .expect("verifier");
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_client_cert_verifier(verifier)
        .with_single_cert(server_chain, server_key)
        .expect("server cert");
    server.send_tls13_tickets = 1;
    let mut client = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_client_auth_cert(client_chain, client_key)
        .expect("client cert");
    if !resume {
        client.resumption = rustls::client::Resumption::disabled();
        client.send_ticket_request = Some(rustls::client::TicketRequest {
            new_session_count: 0,
            resumption_count: 0,
        });
    }
    (Arc::new(client), Arc::new(server))
}

/// Everything `from` has to send, read and processed by `to`.
fn flight<A, B>(from: &mut ConnectionCommon<A>, to: &mut ConnectionCommon<B>) {
    let mut wire = Vec::new();
    while from.wants_write() {
        from.write_tls(&mut wire).expect("write_tls");
    }
    let mut rd: &[u8] = &wire;
    while !rd.is_empty() {
        to.read_tls(&mut rd).expect("read_tls");
        to.process_new_packets().expect("process");
    }
}

/// The plaintext `c` has opened, read out; its length.
fn drain<A>(c: &mut ConnectionCommon<A>) -> usize {
    let mut sink = [0u8; 4096];
    let mut got = 0;
    loop {
        match c.reader().read(&mut sink) {
            Ok(0) => return got,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return got,
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// A handshake, then one request and its answer, on buffered sessions.
fn hop(
    client: &Arc<ClientConfig>,
    server: &Arc<ServerConfig>,
) -> (ClientConnection, ServerConnection) {
    let mut c = ClientConnection::new(client.clone(), "localhost".try_into().expect("name"))
        .expect("client");
    let mut s = ServerConnection::new(server.clone()).expect("server");
    for _ in 0..10 {
        flight(&mut c, &mut s);
        flight(&mut s, &mut c);
        if !(c.is_handshaking() || s.is_handshaking() || c.wants_write() || s.wants_write()) {
            break;
        }
    }
    assert!(
        !c.is_handshaking() && !s.is_handshaking(),
        "the handshake stalled"
    );
    c.writer().write_all(&[0x47; REQUEST]).expect("request");
    flight(&mut c, &mut s);
    assert_eq!(drain(&mut s), REQUEST);
    s.writer().write_all(&[0x7b; RESPONSE]).expect("answer");
    flight(&mut s, &mut c);
    assert_eq!(drain(&mut c), RESPONSE);
    (c, s)
}

/// Heap bytes per session at rest, counted (LIVE) while `n` sessions are kept: (client,
/// server) of [`hop`], each with its struct (the proxy boxes both).
fn held_by_hop(client: &Arc<ClientConfig>, server: &Arc<ServerConfig>, n: usize) -> (f64, f64) {
    drop(hop(client, server));
    let mut clients = Vec::with_capacity(n);
    let mut servers = Vec::with_capacity(n);
    let before = LIVE.load(Ordering::Relaxed);
    for _ in 0..n {
        let (c, s) = hop(client, server);
        clients.push(c);
        servers.push(s);
    }
    let loaded = LIVE.load(Ordering::Relaxed);
    servers.clear();
    let without_servers = LIVE.load(Ordering::Relaxed);
    clients.clear();
    let without_both = LIVE.load(Ordering::Relaxed);
    assert!(loaded >= before, "the sessions hold memory");
    let each = |bytes: i64, inline: usize| bytes as f64 / n as f64 + inline as f64;
    (
        each(
            without_servers - without_both,
            std::mem::size_of::<ClientConnection>(),
        ),
        each(
            loaded - without_servers,
            std::mem::size_of::<ServerConnection>(),
        ),
    )
}

/// Heap bytes per client session at rest after its handshake, buffered and unbuffered, with
/// the same configs ([`configs`]); the unbuffered one's buffers are its caller's (a loop's,
/// shared by its connections), so they are not counted.
fn held_by_client(client: &Arc<ClientConfig>, server: &Arc<ServerConfig>, n: usize) -> (f64, f64) {
    let mut buffered = Vec::with_capacity(n);
    let mut unbuffered = Vec::with_capacity(n);
    let start = LIVE.load(Ordering::Relaxed);
    for _ in 0..n {
        buffered.push(Buffered::new(client, server).c);
    }
    let mid = LIVE.load(Ordering::Relaxed);
    for _ in 0..n {
        unbuffered.push(Unbuffered::new(client, server).c);
    }
    let end = LIVE.load(Ordering::Relaxed);
    (
        (mid - start) as f64 / n as f64 + std::mem::size_of::<ClientConnection>() as f64,
        (end - mid) as f64 / n as f64 + std::mem::size_of::<UnbufferedClientConnection>() as f64,
    )
}

/// Rows: what a loopback connection's two sessions hold at rest, and a client session on each
/// API.
fn at_rest(client: &Arc<ClientConfig>, server: &Arc<ServerConfig>) -> Vec<Row> {
    let n = 200;
    // The upstream's session resumes; the loopback client's is kubectl's, a full handshake.
    let (resuming_client, resuming_server) = hop_configs(true);
    let (c, _) = held_by_hop(&resuming_client, &resuming_server, n);
    let (kubectl, loopback_server) = hop_configs(false);
    let (_, s) = held_by_hop(&kubectl, &loopback_server, n);
    let (buffered, unbuffered) = held_by_client(client, server, n);
    let kib = |b: f64| b / 1024.0;
    vec![
        Row::new(
            AREA,
            "heap held at rest by a loopback connection's two TLS sessions, rustls buffered API (what the proxy runs)",
            "KiB",
            Some(Stat::of(&[kib(c + s)])),
        )
        .note(format!(
            "{n} pairs kept after a handshake and one {REQUEST}-byte request and {RESPONSE}-byte answer; counted by a global allocator, each session's struct included: the upstream's client session {:.1} KiB (resumed), the loopback client's server session {:.1} KiB (a full handshake, as kubectl's); rustls keeps a 4 KiB receive buffer in each (its deframer, at rest too)",
            kib(c),
            kib(s)
        )),
        Row::new(
            AREA,
            "heap held at rest by a client TLS session, rustls unbuffered API",
            "KiB",
            Some(Stat::of(&[kib(unbuffered)])),
        )
        .versus(
            "buffered API",
            Some(Stat::of(&[kib(buffered)])),
            Some(Stat::of(&[unbuffered / buffered])),
        )
        .note(format!(
            "{n} sessions kept after their handshake (no client certificate, no ticket), struct included; the unbuffered API's buffers are the caller's (one per loop, not per connection)"
        )),
    ]
}
