//! `hwkey probe`: check a key against an mTLS server.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use crate::key::KeyUri;
use crate::pki::cert;
use crate::probe::{self, ProbeOptions};

#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// The key that signs the handshake.
    #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
    key: KeyUri,
    /// Certificate chain (PEM); default: the one stored with the key.
    #[arg(long, env = "HWKEY_CERT")]
    cert: Option<PathBuf>,
    /// CA bundle that signs the server's certificate; default: the system roots.
    #[arg(long, env = "HWKEY_CA")]
    ca: Option<PathBuf>,
    /// Name to verify the server certificate against (default: the URL's host).
    #[arg(long)]
    tls_server_name: Option<String>,
    /// For an RSA key on a token without RSA-PSS and without raw RSA: use TLS 1.2 with
    /// PKCS#1 v1.5 signatures instead of refusing.
    #[arg(long, env = "HWKEY_ALLOW_TLS12_FALLBACK")]
    allow_tls12_fallback: bool,
    /// Forward proxy to the server (http://, https:// or socks5://HOST:PORT; no credentials
    /// on argv: --proxy-auth). Default: HTTPS_PROXY unless NO_PROXY excludes the server.
    #[arg(long)]
    proxy_url: Option<String>,
    /// file:PATH or env:VAR holding the forward proxy's user:password.
    #[arg(long, env = "HWKEY_PROXY_AUTH")]
    proxy_auth: Option<String>,
    /// TLS 1.3 key exchange offered: hybrid (X25519MLKEM768, then X25519) or classical.
    #[arg(long, value_enum, default_value = "hybrid")]
    key_exchange: crate::pki::tls::KeyExchange,
    /// Give up when the whole exchange (connection, forward proxy, handshake, answer) takes
    /// longer: a server or proxy that accepts and then says nothing must not hang a script.
    #[arg(
        long,
        env = "HWKEY_PROBE_TIMEOUT",
        default_value = "30s",
        value_parser = crate::duration::parse_duration
    )]
    timeout: std::time::Duration,
    /// The URL to GET, e.g. https://127.0.0.1:6443/version
    url: String,
}

pub fn run(args: ProbeArgs) -> anyhow::Result<()> {
    // Every argument is checked before the hardware is touched (no PIN is presented for a
    // command that cannot run).
    let egress = crate::proxy::settings::egress(
        args.proxy_url.as_deref(),
        args.proxy_auth.as_deref(),
        None,
    )?;
    // The key in a signer process of its own, as the proxy's: this process speaks to the
    // network and never holds the module, the TSS libraries or the PIN.
    let key = crate::signer::open_key(
        &args.key,
        args.cert.as_deref(),
        false,
        args.allow_tls12_fallback,
    )?;
    let key = Arc::new(key);
    let chain = cert::chain_for_key(&key, args.cert.as_deref())?;
    cert::ensure_matches(&chain[0], &key)?;
    let options = ProbeOptions {
        url: args.url,
        ca: args.ca,
        server_name: args.tls_server_name,
        allow_tls12_fallback: args.allow_tls12_fallback,
        egress,
        key_exchange: args.key_exchange,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let url = options.url.clone();
    let answer = runtime.block_on(async {
        tokio::time::timeout(args.timeout, probe::probe(key.clone(), chain, &options)).await
    });
    // A hardware call still running (a stalled device) gets a moment to finish; the
    // process does not wait for it for good.
    runtime.shutdown_timeout(std::time::Duration::from_secs(2));
    let report = answer.map_err(|_| {
        anyhow::anyhow!(
            "no answer from {url} within {} (something accepts the connection but does not complete TLS or HTTP: check the URL, the forward proxy and the server; --timeout waits longer)",
            humantime::format_duration(args.timeout)
        )
    })??;
    eprintln!("tls: {} {}", report.tls_version, report.cipher_suite);
    eprintln!(
        "key exchange: {}{}",
        report.key_exchange,
        if report.hello_retry {
            " (after a HelloRetryRequest)"
        } else {
            ""
        }
    );
    eprintln!("signing path: {}", key.signing_path());
    match report.client_scheme {
        Some(s) => eprintln!("client signature: {s} (signed by {})", key.describe()),
        None => {
            eprintln!("client signature: none (the server did not ask for a client certificate)")
        }
    }
    eprintln!("server: {}", report.peer_subject);
    eprintln!("http: {}", report.status);
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(&report.body)?;
    out.flush()?;
    Ok(())
}
