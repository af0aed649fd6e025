//! End-to-end benchmarks on the real fixtures: a SoftHSM token and a swtpm, the kube-apiserver
//! stand-in (`tests/support/upstream.rs`), the release `hwkey proxy` binary, and kubectl.
//!
//! Method: every figure has a baseline measured in the same process, interleaved with it
//! round by round (subject and baseline alternate which goes first), so a compile job that
//! starts on the shared machine slows both sides of a round alike; ratios are taken per round
//! and summarised as median and p25–p75. Loops are bounded by counts, never by "until fast".
//! Everything started here (token dirs, swtpm, upstreams, proxies, the proxy the exec plugin
//! starts) is stopped by PID before the process exits.
//!
//! The baseline for the network figures is a client talking straight to the same upstream with
//! rustls and an in-memory software key (the upstream requires TLS 1.3 client certificates
//! from the same test CA). Clients run on one current-thread runtime: on 2 cores the client,
//! the proxy and the upstream share the machine, as kubectl, hwkey and a local API server would.

use support::bench as common;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hwkey::egress::{Egress, ForwardProxy};
use hwkey::endpoint::UpstreamTarget;
use hwkey::key::tls::{HardwareCertResolver, HardwareSigningKey};
use hwkey::key::{Key, KeyUri};
use hwkey::pki::tls::KeyExchange;
use hwkey::proxy::metrics::Metrics;
use hwkey::proxy::upstream::Upstream;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::client::Resumption;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, HandshakeKind, RootCertStore};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio_rustls::client::TlsStream;

use common::{median_interval, paired_ratios, pick, Row, Stat};
use support::proxy::{metric_in, Identity, ProxyOptions, ProxyProcess, RawHttp};
use support::upstream::TestUpstream;
use support::{hwkey, run_ok, temp_dir};

mod baseline;
mod clients;
mod fixture;
mod floor;
mod floor_tls;
mod handshakes;
mod kubectl;
mod loopback;
mod loopback_floor;
mod memory;
mod peers;
mod requests;
mod tpm_stall;
mod traffic;
mod uring_floor;

use baseline::*;
use clients::*;
use fixture::*;
use floor::*;
use handshakes::*;
use kubectl::*;
use loopback::*;
use memory::*;
use peers::*;
use requests::*;
use tpm_stall::*;
use traffic::*;

/// Lets the process hold the 2,000+ sockets of the memory benchmark (and its children
/// inherit the limit).
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    let _ = setrlimit(
        Resource::Nofile,
        Rlimit {
            current: lim.maximum,
            maximum: lim.maximum,
        },
    );
}

/// The intervals the goal rows print ([`median_interval`]) against the binomial order
/// statistics worked out by hand: none below six values, the extremes at six (96.9 %), the
/// 4th and 12th of 15 (96.5 %), the 14th and 28th of 41 (97.3 %), the order of the values
/// not mattering and a NaN not counted.
fn check_median_interval() {
    let ranks = |n: usize| (1..=n).rev().map(|i| i as f64).collect::<Vec<f64>>();
    assert_eq!(median_interval(&ranks(5)), None);
    assert_eq!(median_interval(&ranks(6)), Some((1.0, 6.0)));
    assert_eq!(median_interval(&ranks(15)), Some((4.0, 12.0)));
    assert_eq!(median_interval(&ranks(41)), Some((14.0, 28.0)));
    let mut with_nan = ranks(6);
    with_nan.push(f64::NAN);
    assert_eq!(median_interval(&with_nan), Some((1.0, 6.0)));
    eprintln!("e2e: the median's interval checked at 5, 6, 15 and 41 values");
}

/// A temporary directory beside the binaries, on their file system: what is made there is
/// dropped from the page cache as they are (on tmpfs nothing is), and can be run as they are (a
/// temp dir may be mounted noexec).
fn dir_beside_binaries() -> tempfile::TempDir {
    let beside = support::hwkey_bin()
        .parent()
        .map(Path::to_path_buf)
        .expect("the binaries' directory");
    tempfile::tempdir_in(beside).expect("a directory beside the binaries")
}

/// What `common::settle` (run on the binaries before every bench) does, seen from outside with
/// util-linux's `fincore`: a file just written has its pages in the page cache, and none after.
fn check_settle() {
    let dir = dir_beside_binaries();
    let file = dir.path().join("binary");
    std::fs::write(&file, vec![7u8; 1 << 20]).expect("write 1 MiB");
    let resident = || {
        let out = run_ok(
            Command::new("fincore")
                .args(["--bytes", "--noheadings", "--output", "RES"])
                .arg(&file),
        );
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<u64>()
            .expect("fincore's RES is a number")
    };
    assert!(resident() > 0, "a file just written is in the page cache");
    common::settle(&file).expect("settle");
    assert_eq!(resident(), 0, "the settled file's pages are dropped");
    eprintln!("e2e: a settled binary leaves the page cache");
}

/// The exec step's baseline plugin ([`usable_baseline_plugin`]): one that fails the call (as
/// 4ea3478's did, which ended a full bench run after 28 minutes) or is missing is left out
/// with what it said; one that answers is used.
fn check_baseline_plugin() {
    use std::os::unix::fs::PermissionsExt;
    let dir = dir_beside_binaries();
    let hwkey = dir.path().join("hwkey");
    let plugin = dir.path().join("hwkey-credential");
    let call = |bin: &Path| Command::new(bin);
    let missing = usable_baseline_plugin(Some(&hwkey), call).expect_err("no plugin there");
    assert!(missing.contains("builds it"), "{missing}");
    let write = |script: &str| {
        std::fs::write(&plugin, script).expect("write the plugin");
        std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755))
            .expect("make it executable");
    };
    write("#!/bin/sh\necho 'hwkey: error: no key URI' >&2\nexit 2\n");
    let refused = usable_baseline_plugin(Some(&hwkey), call).expect_err("a failing plugin");
    assert!(refused.contains("no key URI"), "{refused}");
    write("#!/bin/sh\necho '{}'\n");
    assert_eq!(
        usable_baseline_plugin(Some(&hwkey), call),
        Ok(plugin.clone())
    );
    eprintln!("e2e: a baseline plugin that fails its call is left out with what it said");
}

fn main() {
    if common::skip_unless_cargo_bench("e2e") {
        // Under `cargo test --all-targets`: what the goal rows' intervals rest on, and what
        // every bench does to the binaries it runs.
        check_median_interval();
        check_settle();
        check_baseline_plugin();
        return;
    }
    let started = Instant::now();
    let load_before = common::before();
    raise_fd_limit();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("client runtime");
    let f = Fixture::new();
    // The in-process connector opens the same SoftHSM token as the proxy.
    for (k, v) in f.id.envs() {
        std::env::set_var(k, v);
    }
    let mut rows = Vec::new();
    // HWKEY_BENCH_ONLY=memory,latency runs only those figures (while working on one of them).
    let only = std::env::var("HWKEY_BENCH_ONLY").unwrap_or_default();
    let wanted = |name: &str| only.is_empty() || only.split(',').any(|o| o.trim() == name);
    let step = |name: &str| eprintln!("e2e: {name} ({:.0}s)", started.elapsed().as_secs_f64());
    if wanted("handshakes") {
        step("handshakes");
        rows.extend(rt.block_on(handshakes(&f)));
        step("through the signer process");
        rows.extend(rt.block_on(signer_handshakes(&f)));
        step("through the proxy");
        rows.extend(rt.block_on(through_proxy(&f)));
    }
    if wanted("key-exchange") {
        step("key exchange");
        rows.extend(rt.block_on(key_exchange(&f)));
    }
    if wanted("forward-proxy") {
        step("through a forward proxy");
        rows.extend(rt.block_on(through_forward_proxy(&f)));
    }
    if wanted("throughput") {
        step("throughput");
        rows.extend(rt.block_on(throughput(&f)));
    }
    if wanted("latency") {
        step("latency");
        rows.extend(rt.block_on(latency(&f)));
    }
    if wanted("requests") {
        step("keep-alive requests");
        rows.extend(rt.block_on(requests(&f)));
    }
    // Only when named: its trials repeat the requests step's goal rows, in more rounds.
    if only.split(',').any(|o| o.trim() == "goal") {
        step("the UNIX socket's keep-alive goal, in more rounds");
        rows.extend(rt.block_on(goal(&f)));
    }
    if wanted("loopback") {
        step("the loopback TLS path against its floor");
        rows.extend(rt.block_on(loopback(&f)));
    }
    if wanted("peers") {
        step("against ghostunnel");
        rows.extend(rt.block_on(against_ghostunnel(&f)));
    }
    if wanted("kubectl") {
        step("kubectl and exec");
        rows.extend(kubectl_and_exec(&f));
    }
    if wanted("memory") {
        step("memory");
        rows.extend(rt.block_on(memory(&f)));
        step("growth curve");
        rows.extend(rt.block_on(growth(&f)));
    }
    if wanted("baseline") {
        step("against an earlier build");
        rows.extend(rt.block_on(against_baseline(&f)));
    }
    if wanted("tpm-stall") {
        step("TPM stall");
        rows.extend(tpm_stall(&rt));
    }
    step("done");
    drop(f);
    common::finish("e2e", load_before, started, rows);
}
