//! rustls crypto providers side by side (issue 10): `ring` (what hwkey ships) against
//! `aws-lc-rs`, in the same process, in interleaved rounds, so each ratio compares figures taken
//! under the same load.
//!
//! What is timed is the provider's share of hwkey's work, with software keys on both ends (the
//! hardware signature is the same whichever provider runs the rest):
//! - full mutual-TLS 1.3 handshakes (ECDHE, certificate verification, ECDSA P-256 signatures
//!   on both sides; no resumption), client and server in one thread over memory buffers;
//! - bulk records: 64 MiB of application data encrypted by one end and decrypted by the other
//!   (AES-256-GCM, the suite both providers prefer), i.e. what the proxy does per byte relayed.
//!
//! aws-lc-rs also offers the X25519MLKEM768 hybrid key exchange that Go ≥ 1.24 (kubectl, the
//! API server) proposes first; its handshake is measured as a third column. Build-time figures
//! come from hsm-fixtures/bench.sh (they cannot be measured from inside a built binary).
//!
//! Run: `cargo bench --features bench-aws-lc --bench providers` (hsm-fixtures/bench.sh does).

use support::bench as common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use common::{Row, Stat};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};

const AREA: &str = "Crypto provider: aws-lc-rs against ring";

/// One contender: a provider, restricted to one key-exchange group.
struct Contender {
    label: &'static str,
    provider: Arc<CryptoProvider>,
}

fn contenders() -> [Contender; 3] {
    let only = |mut p: CryptoProvider, group: rustls::NamedGroup| {
        p.kx_groups.retain(|g| g.name() == group);
        assert_eq!(p.kx_groups.len(), 1, "provider lacks {group:?}");
        Arc::new(p)
    };
    [
        Contender {
            label: "ring, X25519",
            provider: only(
                rustls::crypto::ring::default_provider(),
                rustls::NamedGroup::X25519,
            ),
        },
        Contender {
            label: "aws-lc-rs, X25519",
            provider: only(
                rustls::crypto::aws_lc_rs::default_provider(),
                rustls::NamedGroup::X25519,
            ),
        },
        Contender {
            label: "aws-lc-rs, X25519MLKEM768",
            provider: only(
                rustls::crypto::aws_lc_rs::default_provider(),
                rustls::NamedGroup::X25519MLKEM768,
            ),
        },
    ]
}

/// A CA-less pair of self-signed P-256 identities, each trusting the other.
struct Pki {
    server_cert: CertificateDer<'static>,
    server_key: Vec<u8>,
    client_cert: CertificateDer<'static>,
    client_key: Vec<u8>,
}

fn pki() -> Pki {
    let server = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("server");
    let client = rcgen::generate_simple_self_signed(vec!["client".into()]).expect("client");
    Pki {
        server_cert: server.cert.der().clone(),
        server_key: server.signing_key.serialize_der(),
        client_cert: client.cert.der().clone(),
        client_key: client.signing_key.serialize_der(),
    }
}

fn configs(pki: &Pki, provider: &Arc<CryptoProvider>) -> (Arc<ClientConfig>, Arc<ServerConfig>) {
    let key = |der: &[u8]| PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(der.to_vec()));
    let mut client_roots = RootCertStore::empty();
    client_roots.add(pki.server_cert.clone()).expect("root");
    let mut server_roots = RootCertStore::empty();
    server_roots.add(pki.client_cert.clone()).expect("root");
    let mut client = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(client_roots)
        .with_client_auth_cert(vec![pki.client_cert.clone()], key(&pki.client_key))
        .expect("client auth");
    client.resumption = rustls::client::Resumption::disabled();
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(server_roots), provider.clone())
            .build()
            .expect("client verifier");
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![pki.server_cert.clone()], key(&pki.server_key))
        .expect("server cert");
    server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    server.send_tls13_tickets = 0;
    (Arc::new(client), Arc::new(server))
}

/// Moves every pending TLS byte from one end to the other.
fn pump(from: &mut impl DerefConn, to: &mut impl DerefConn, buf: &mut Vec<u8>) {
    buf.clear();
    while from.conn().wants_write() {
        from.conn().write_tls(buf).expect("write_tls");
    }
    let mut rd: &[u8] = buf;
    while !rd.is_empty() {
        to.conn().read_tls(&mut rd).expect("read_tls");
        to.conn()
            .process_new_packets()
            .expect("process_new_packets");
    }
}

/// Both connection kinds as the common connection type.
trait DerefConn {
    fn conn(&mut self) -> &mut rustls::ConnectionCommon<Self::Data>;
    type Data;
}

impl DerefConn for ClientConnection {
    type Data = rustls::client::ClientConnectionData;
    fn conn(&mut self) -> &mut rustls::ConnectionCommon<Self::Data> {
        self
    }
}

impl DerefConn for ServerConnection {
    type Data = rustls::server::ServerConnectionData;
    fn conn(&mut self) -> &mut rustls::ConnectionCommon<Self::Data> {
        self
    }
}

fn handshake(
    client: &Arc<ClientConfig>,
    server: &Arc<ServerConfig>,
    buf: &mut Vec<u8>,
) -> (ClientConnection, ServerConnection) {
    let mut c = ClientConnection::new(client.clone(), "localhost".try_into().expect("name"))
        .expect("client");
    let mut s = ServerConnection::new(server.clone()).expect("server");
    while c.is_handshaking() || s.is_handshaking() {
        pump(&mut c, &mut s, buf);
        pump(&mut s, &mut c, buf);
    }
    (c, s)
}

/// Full handshakes per second over `n` handshakes.
fn handshakes_per_second(client: &Arc<ClientConfig>, server: &Arc<ServerConfig>, n: u32) -> f64 {
    let mut buf = Vec::with_capacity(1 << 16);
    let started = Instant::now();
    for _ in 0..n {
        let (c, _s) = handshake(client, server, &mut buf);
        assert!(c.peer_certificates().is_some());
    }
    f64::from(n) / started.elapsed().as_secs_f64()
}

/// MB/s of application data encrypted by the client and decrypted by the server.
fn bulk_mb_per_second(client: &Arc<ClientConfig>, server: &Arc<ServerConfig>, mib: usize) -> f64 {
    let mut buf = Vec::with_capacity(1 << 20);
    let (mut c, mut s) = handshake(client, server, &mut buf);
    let suite = c.negotiated_cipher_suite().expect("suite").suite();
    assert_eq!(suite, rustls::CipherSuite::TLS13_AES_256_GCM_SHA384);
    c.set_buffer_limit(None);
    let chunk = vec![0x5au8; 256 * 1024];
    let mut sink = vec![0u8; 256 * 1024];
    let total = mib * 1024 * 1024;
    let started = Instant::now();
    let mut received = 0usize;
    while received < total {
        c.writer().write_all(&chunk).expect("write");
        buf.clear();
        while c.wants_write() {
            c.write_tls(&mut buf).expect("write_tls");
        }
        // Feed the records in and drain the plaintext as it comes, as the proxy's copy loop does.
        let mut rd: &[u8] = &buf;
        while !rd.is_empty() {
            s.read_tls(&mut rd).expect("read_tls");
            s.process_new_packets().expect("process_new_packets");
            loop {
                match s.reader().read(&mut sink) {
                    Ok(0) => break,
                    Ok(n) => received += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => panic!("read: {e}"),
                }
            }
        }
    }
    total as f64 / 1e6 / started.elapsed().as_secs_f64()
}

fn main() {
    if common::skip_unless_cargo_bench("providers") {
        return;
    }
    let started = Instant::now();
    let load_before = common::before();
    let pki = pki();
    let contenders = contenders();
    let configs: Vec<_> = contenders
        .iter()
        .map(|c| configs(&pki, &c.provider))
        .collect();
    let rounds = common::pick(15, 4);
    let per_round = common::pick(300, 60);
    let mib = common::pick(64, 16);

    // Warm-up (page faults, lazy tables), then interleaved rounds.
    for (client, server) in &configs {
        handshakes_per_second(client, server, 20);
        bulk_mb_per_second(client, server, 4);
    }
    let mut hs = vec![Vec::new(); configs.len()];
    let mut bulk = vec![Vec::new(); configs.len()];
    for _ in 0..rounds {
        for (i, (client, server)) in configs.iter().enumerate() {
            hs[i].push(handshakes_per_second(client, server, per_round));
            bulk[i].push(bulk_mb_per_second(client, server, mib));
        }
    }

    let mut rows = Vec::new();
    let ring = contenders[0].label;
    for (i, c) in contenders.iter().enumerate().skip(1) {
        rows.push(
            Row::new(
                AREA,
                &format!("full mTLS 1.3 handshakes, {}", c.label),
                "handshakes/s",
                Some(Stat::of(&hs[i])),
            )
            .versus(
                ring,
                Some(Stat::of(&hs[0])),
                Some(Stat::of(&common::paired_ratios(&hs[i], &hs[0]))),
            )
            .target("≥ 0.95×", None)
            .note(format!("{per_round} handshakes per round, {rounds} rounds")),
        );
    }
    rows.push(
        Row::new(
            AREA,
            "bulk AES-256-GCM, encrypt + decrypt, aws-lc-rs",
            "MB/s",
            Some(Stat::of(&bulk[1])),
        )
        .versus(
            ring,
            Some(Stat::of(&bulk[0])),
            Some(Stat::of(&common::paired_ratios(&bulk[1], &bulk[0]))),
        )
        .target("≥ 0.95×", None)
        .note(format!(
            "{mib} MiB per round in 256 KiB writes, {rounds} rounds"
        )),
    );

    println!("| measure | unit | aws-lc-rs | ring | ratio (median, p25–p75) |");
    println!("|---|---|---|---|---|");
    for r in &rows {
        let med = |s: &Option<Stat>| s.map(|s| format!("{:.1}", s.median)).unwrap_or_default();
        let ratio = r
            .ratio
            .map(|s| format!("{:.2}× ({:.2}–{:.2})", s.median, s.p25, s.p75))
            .unwrap_or_default();
        println!(
            "| {} | {} | {} | {} | {} |",
            r.measure,
            r.unit,
            med(&r.subject),
            med(&r.baseline),
            ratio
        );
    }
    common::finish("providers", load_before, started, rows);
}
