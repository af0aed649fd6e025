//! `hwkey doctor`: checks an installation step by step and says what to fix.
//!
//! Each check prints `ok`, `warn` or `FAIL` with the fix; the exit status is non-zero when any
//! check failed. It changes nothing (a test signature is not a change).

use std::path::PathBuf;

use clap::Args;

use crate::exec::control_client;
use crate::key::{verify, Key, KeyUri};
use crate::kubeconfig::{HwkeyExtension, CLUSTER_ENV, EXEC_EXTENSION};
use crate::pki::cert;

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// The key to check (default: the one in the kubeconfig context, with --kubeconfig).
    #[arg(long, env = "HWKEY_KEY")]
    key: Option<String>,
    /// Certificate chain to check instead of the stored one.
    #[arg(long)]
    cert: Option<PathBuf>,
    /// A kubeconfig written by `hwkey kubeconfig` to check (exec block, proxy, CA).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The context to check in --kubeconfig (default: its current-context).
    #[arg(long)]
    context: Option<String>,
}

#[derive(Default)]
struct Report {
    failed: usize,
}

impl Report {
    fn ok(&mut self, what: &str, detail: impl std::fmt::Display) {
        println!("ok    {what}: {detail}");
    }
    fn warn(&mut self, what: &str, detail: impl std::fmt::Display) {
        println!("warn  {what}: {detail}");
    }
    fn fail(&mut self, what: &str, detail: impl std::fmt::Display) {
        self.failed += 1;
        println!("FAIL  {what}: {detail}");
    }
}

pub fn run(args: DoctorArgs) -> anyhow::Result<()> {
    let mut r = Report::default();
    let mut key_text = args.key.clone();
    let mut cert_path = args.cert.clone();
    if let Some(path) = &args.kubeconfig {
        if let Some((k, c)) = check_kubeconfig(&mut r, path, args.context.as_deref()) {
            key_text = key_text.or(Some(k));
            cert_path = cert_path.or(c);
        }
    }
    match key_text {
        Some(k) => check_key(&mut r, &k, cert_path),
        None if args.kubeconfig.is_none() => {
            anyhow::bail!("nothing to check: pass --key URI and/or --kubeconfig FILE")
        }
        None => {}
    }
    if r.failed > 0 {
        anyhow::bail!("{} check(s) failed", r.failed);
    }
    Ok(())
}

fn check_key(r: &mut Report, text: &str, cert_path: Option<PathBuf>) {
    let uri: KeyUri = match text.parse() {
        Ok(u) => u,
        Err(e) => return r.fail("key URI", e),
    };
    r.ok("key URI", &uri);
    let key = match Key::open(&uri) {
        Ok(k) => k,
        Err(e) => return r.fail("open key", e),
    };
    r.ok(
        "open key",
        format!("{} ({})", key.describe(), key.algorithm()),
    );
    if key.protection().is_ok_and(|p| p.pin_always()) {
        r.ok(
            "PIN always",
            "every signature presents the PIN again (CKA_ALWAYS_AUTHENTICATE)",
        );
    }
    match crate::key::tls::protocol_versions(&key, false) {
        Ok(_) => r.ok("signing path", key.signing_path()),
        Err(e) => r.fail("signing path", e),
    }
    if !check_signature(r, &key) {
        return;
    }
    let chain = match cert::chain_for_key(&key, cert_path.as_deref()) {
        Ok(c) => c,
        Err(e) => return r.fail("certificate", e),
    };
    let leaf = &chain[0];
    match cert::matches_key(leaf, &key) {
        Ok(true) => r.ok("certificate", "holds this key's public key"),
        Ok(false) => {
            return r.fail(
                "certificate",
                "it is for another key: import the certificate issued for this key",
            )
        }
        Err(e) => return r.fail("certificate", e),
    }
    if let Ok(s) = cert::summarize(leaf) {
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let left = s.not_after_unix - now;
        if left <= 0 {
            r.fail(
                "validity",
                format!(
                    "expired {} ({}): it can no longer authenticate `hwkey renew`; get a new one (hwkey bootstrap for a node, or hwkey csr --k8s-name, approval, hwkey cert import)",
                    s.not_after, s.subject
                ),
            );
        } else if left < 7 * 24 * 3600 {
            r.warn(
                "validity",
                format!(
                    "expires {} (in {} h): renew it soon",
                    s.not_after,
                    left / 3600
                ),
            );
        } else {
            r.ok("validity", format!("{} until {}", s.subject, s.not_after));
        }
        if left > 0 {
            renewal_state(r, leaf, now);
        }
    }
}

/// One test signature, verified against the key's public key; false when the key cannot sign.
fn check_signature(r: &mut Report, key: &Key) -> bool {
    let Some(scheme) = key.schemes().first().copied() else {
        r.fail(
            "sign",
            "the key offers no signature scheme this device can make",
        );
        return false;
    };
    let message = b"hwkey doctor test signature";
    match key.sign(scheme, message) {
        Ok(sig) => match verify::verify_signature(key.spki_der(), scheme, message, &sig) {
            Ok(true) => r.ok(
                "sign",
                format!("a {scheme} signature verifies against the public key"),
            ),
            Ok(false) => r.fail(
                "sign",
                "the device's signature does not verify: check the device's health",
            ),
            Err(e) => r.fail("sign", e),
        },
        Err(e) => r.fail("sign", e),
    }
    true
}

/// Where the certificate is in its lifetime, against the 70–90 % window in which
/// `hwkey proxy --renew` renews.
fn renewal_state(r: &mut Report, leaf: &[u8], now: i64) {
    let Ok((_, c)) = x509_parser::parse_x509_certificate(leaf) else {
        return;
    };
    let (from, to) = (
        c.validity().not_before.timestamp(),
        c.validity().not_after.timestamp(),
    );
    let lifetime = (to - from).max(1);
    let used = (now - from).clamp(0, lifetime) * 100 / lifetime;
    if used < 70 {
        r.ok(
            "renewal",
            format!("not due ({used}% of the lifetime used; `hwkey proxy --renew` renews between 70% and 90%)"),
        );
    } else if used < 90 {
        r.warn(
            "renewal",
            format!("due ({used}% of the lifetime used): a proxy with --renew renews now; otherwise run `hwkey renew`"),
        );
    } else {
        r.warn(
            "renewal",
            format!("overdue ({used}% of the lifetime used): run `hwkey renew` now; with --renew, check the proxy's log and hwkey_renewal_failures_total"),
        );
    }
}

/// Checks the hwkey entries of a kubeconfig; returns the key URI and cert of the context.
fn check_kubeconfig(
    r: &mut Report,
    path: &std::path::Path,
    context: Option<&str>,
) -> Option<(String, Option<PathBuf>)> {
    let doc = read_kubeconfig(r, path)?;
    let (cluster, user, user_name) = resolve_context(r, &doc, path, context)?;
    check_exec_block(r, &user["user"]["exec"], &user_name)?;
    let ext = hwkey_extension(r, &cluster)?;
    check_cluster_reaches_plugin(r, &user["user"]["exec"], &cluster, &ext);
    check_running_proxy(r, &ext);
    let Some(key) = ext.key else {
        r.fail(
            "cluster extension",
            "it names no key: regenerate with `hwkey kubeconfig`",
        );
        return None;
    };
    Some((key.to_string(), ext.cert))
}

type Yaml = serde_yaml_ng::Value;

fn read_kubeconfig(r: &mut Report, path: &std::path::Path) -> Option<Yaml> {
    let parsed = std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_yaml_ng::from_str(&t).map_err(|e| e.to_string()));
    match parsed {
        Ok(d) => Some(d),
        Err(e) => {
            r.fail("kubeconfig", format!("{}: {e}", path.display()));
            None
        }
    }
}

/// The context's cluster and user entries (and the user's name).
fn resolve_context(
    r: &mut Report,
    doc: &Yaml,
    path: &std::path::Path,
    context: Option<&str>,
) -> Option<(Yaml, Yaml, String)> {
    let name = context
        .map(str::to_string)
        .or_else(|| doc["current-context"].as_str().map(str::to_string))
        .unwrap_or_default();
    let find = |list: &str, n: &str| {
        doc[list]
            .as_sequence()
            .and_then(|s| s.iter().find(|e| e["name"].as_str() == Some(n)).cloned())
    };
    let Some(ctx) = find("contexts", &name) else {
        r.fail(
            "kubeconfig",
            format!("no context '{name}' in {}: pass --context", path.display()),
        );
        return None;
    };
    let field = |f: &str| ctx["context"][f].as_str().unwrap_or_default().to_string();
    let (cluster_name, user_name) = (field("cluster"), field("user"));
    let (Some(cluster), Some(user)) = (find("clusters", &cluster_name), find("users", &user_name))
    else {
        r.fail(
            "kubeconfig",
            format!("context '{name}' names a cluster or user that is not in the file"),
        );
        return None;
    };
    Some((cluster, user, user_name))
}

/// The user's exec block runs an existing hwkey with the cluster info it needs.
fn check_exec_block(r: &mut Report, exec: &Yaml, user_name: &str) -> Option<()> {
    match exec["command"].as_str() {
        Some(cmd) if std::path::Path::new(cmd).is_file() => r.ok("exec plugin", cmd),
        Some(cmd) => r.fail(
            "exec plugin",
            format!("{cmd} does not exist: regenerate with `hwkey kubeconfig` or fix the path"),
        ),
        None => {
            r.fail(
                "exec plugin",
                format!("user '{user_name}' has no exec block: regenerate with `hwkey kubeconfig`"),
            );
            return None;
        }
    }
    Some(())
}

/// The plugin sees its settings: in its env ([`CLUSTER_ENV`], what `hwkey kubeconfig` writes),
/// the same as the cluster entry, or through `provideClusterInfo: true`, which passes a
/// cluster extension only under the name [`EXEC_EXTENSION`] (older kubeconfigs).
fn check_cluster_reaches_plugin(r: &mut Report, exec: &Yaml, cluster: &Yaml, ext: &HwkeyExtension) {
    let what = "plugin settings";
    let env = exec["env"].as_sequence().and_then(|vars| {
        vars.iter()
            .find(|v| v["name"].as_str() == Some(CLUSTER_ENV))
    });
    let Some(var) = env else {
        let passed = exec["provideClusterInfo"].as_bool() == Some(true)
            && cluster["cluster"]["extensions"]
                .as_sequence()
                .is_some_and(|list| {
                    list.iter()
                        .any(|e| e["name"].as_str() == Some(EXEC_EXTENSION))
                });
        if passed {
            r.ok(what, format!("client-go passes the cluster's {EXEC_EXTENSION} extension (provideClusterInfo: true)"));
        } else {
            r.fail(
                what,
                format!("the exec block has no {CLUSTER_ENV} in its env, and client-go passes the settings only with provideClusterInfo: true and an extension named {EXEC_EXTENSION}: the plugin cannot see them; regenerate with `hwkey kubeconfig`"),
            );
        }
        return;
    };
    let text = var["value"].as_str().unwrap_or_default();
    let seen = match serde_json::from_str::<crate::exec::credential::Cluster>(text) {
        Ok(seen) => seen,
        Err(e) => {
            r.fail(
                what,
                format!(
                    "its {CLUSTER_ENV} does not parse ({e}): regenerate with `hwkey kubeconfig`"
                ),
            );
            return;
        }
    };
    let server = cluster["cluster"]["server"].as_str().unwrap_or_default();
    let settings = seen.config.as_ref().map(HwkeyExtension::from_json);
    match settings {
        _ if seen.server != server => r.fail(
            what,
            format!("its {CLUSTER_ENV} names the server {}, the cluster entry {server}: the plugin starts the proxy on the first; regenerate with `hwkey kubeconfig`", seen.server),
        ),
        None => r.fail(what, format!("its {CLUSTER_ENV} holds no config: regenerate with `hwkey kubeconfig`")),
        Some(Err(e)) => r.fail(
            what,
            format!("the config in its {CLUSTER_ENV} does not parse ({e}): regenerate with `hwkey kubeconfig`"),
        ),
        Some(Ok(settings)) if settings != *ext => r.fail(
            what,
            format!("the config in its {CLUSTER_ENV} differs from the cluster's settings extension, and the plugin follows {CLUSTER_ENV}: regenerate with `hwkey kubeconfig`"),
        ),
        Some(Ok(_)) => r.ok(what, format!("{CLUSTER_ENV} matches the cluster entry")),
    }
}

/// hwkey's extension of the cluster entry (key URI, certificate, state directory).
fn hwkey_extension(r: &mut Report, cluster: &Yaml) -> Option<HwkeyExtension> {
    let ext = cluster["cluster"]["extensions"]
        .as_sequence()
        .and_then(|s| {
            s.iter().find(|e| {
                e["name"]
                    .as_str()
                    .is_some_and(crate::kubeconfig::is_settings_extension)
            })
        });
    let Some(ext) = ext else {
        r.fail(
            "cluster extension",
            "missing: regenerate with `hwkey kubeconfig`",
        );
        return None;
    };
    match serde_yaml_ng::from_value(ext["extension"].clone()) {
        Ok(ext) => Some(ext),
        Err(e) => {
            r.fail(
                "cluster extension",
                format!("does not parse ({e}): regenerate with `hwkey kubeconfig`"),
            );
            None
        }
    }
}

/// Whether a proxy answers in the extension's state directory (not running is fine: kubectl's
/// first call starts it).
fn check_running_proxy(r: &mut Report, ext: &HwkeyExtension) {
    let Some(dir) = &ext.state_dir else {
        r.warn("proxy", "the extension names no stateDir");
        return;
    };
    let sock = crate::state_dir::StateDir::new(dir.clone()).control_socket();
    match control_client::info(&sock) {
        Ok(info) => r.ok(
            "proxy",
            format!(
                "running (pid {}) at {} for {}",
                info.pid,
                info.server.as_deref().unwrap_or("UNIX sockets only"),
                info.upstream
            ),
        ),
        Err(_) => r.ok("proxy", "not running (kubectl's first call starts it)"),
    }
}
