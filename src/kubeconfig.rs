//! Writing kubeconfigs in which kubectl (or kubelet) reaches the API server through hwkey.
//!
//! The generated entries: a cluster whose `server` is the proxy's loopback address, with the
//! proxy's loopback CA and an extension named `hwkey/settings` carrying the
//! upstream URL, its CA and the key URI; a user whose `exec` block runs `hwkey credential` with
//! the same settings and the server in its env ([`CLUSTER_ENV`], so they reach the plugin
//! without `provideClusterInfo`); and a context. An existing
//! file is merged: entries of other names are kept as they are, the file is replaced atomically
//! and stays mode 0600.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_yaml_ng::{Mapping, Value};

use crate::endpoint::UpstreamTarget;
use crate::key::KeyUri;
use crate::pki::loopback_ca::LoopbackCa;

/// The file name of the plugin-only binary (`src/bin/hwkey-credential.rs`).
pub const PLUGIN_BINARY: &str = "hwkey-credential";

/// Whether `path` names the plugin-only binary, which takes no subcommand (so an exec block that
/// runs it has no `credential` argument).
pub fn is_plugin_binary(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n == PLUGIN_BINARY)
}

/// The extension name client-go passes to exec plugins as `spec.cluster.config`: where hwkey
/// wrote its settings before [`SETTINGS_EXTENSION`], still read in older kubeconfigs.
pub const EXEC_EXTENSION: &str = "client.authentication.k8s.io/exec";

/// The extension name of hwkey's settings in the cluster entry [`write`] makes. Not
/// [`EXEC_EXTENSION`]: client-go copies that one into the exec config it dumps as text (its
/// bytes hex-dumped) for every client kubectl builds, one per object of a list.
pub const SETTINGS_EXTENSION: &str = "hwkey/settings";

/// Whether a cluster extension of this name holds hwkey's settings (written now, or by an
/// older hwkey).
pub fn is_settings_extension(name: &str) -> bool {
    name == SETTINGS_EXTENSION || name == EXEC_EXTENSION
}

/// The exec block's env variable that hands the plugin its cluster: the object client-go would
/// pass as `spec.cluster` with `provideClusterInfo: true` (`server`, and the extension as
/// `config`), which [`write`] does not set because of what it costs kubectl per object of a list
/// ([`crate::exec::credential::ExecInfo::with_cluster_env`]).
pub const CLUSTER_ENV: &str = "HWKEY_EXEC_CLUSTER";

/// hwkey's settings in a cluster's [`SETTINGS_EXTENSION`] extension and the exec block's
/// [`CLUSTER_ENV`]: written by [`write`], read by
/// the exec plugin ([`crate::exec::settings`]), `hwkey renew --kubeconfig`
/// ([`crate::lifecycle::context`]) and `hwkey doctor`. One type, so a renamed field is a compile
/// error rather than a setting silently lost; values arrive parsed (a bad key URI in the file is
/// an error naming it, not a string carried along).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HwkeyExtension {
    /// The hardware key the proxy signs with.
    #[serde(
        default,
        with = "crate::serde_text::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub key: Option<KeyUri>,
    /// Its certificate chain file, when not stored with the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    /// The real API server.
    #[serde(
        default,
        with = "crate::serde_text::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub upstream: Option<UpstreamTarget>,
    /// The API server's CA bundle.
    #[serde(
        rename = "upstreamCA",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    pub upstream_ca: Option<PathBuf>,
    /// The name the API server's certificate is checked against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_server_name: Option<String>,
    /// The forward proxy to the API server (the original cluster's `proxy-url`): the kubeconfig
    /// kubectl uses points at loopback, which client-go never proxies, so the hwkey proxy
    /// takes it over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upstream_proxy: Option<String>,
    /// The proxy's state directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    /// How long a proxy started by the plugin lives without clients.
    #[serde(
        default,
        with = "crate::serde_text::duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub idle_exit: Option<Duration>,
    /// A proxy started by the plugin renews its certificate through the CSR API before it
    /// expires (`hwkey proxy --renew`): a person's identity stays valid while they work, with
    /// an approver's self-renewal policy and no human step.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub renew: bool,
    /// With `renew`: each renewal request carries fresh TPM2_Certify evidence by the
    /// attestation key at this persistent handle (`hwkey proxy --attest --ak-handle`), the
    /// hardware proof an approver asks of a person at every issuance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attest_ak_handle: Option<u32>,
}

impl HwkeyExtension {
    /// Reads the extension from the value client-go passes (`spec.cluster.config`) or a
    /// kubeconfig holds (`extension:`).
    pub fn from_json(value: &serde_json::Value) -> Result<HwkeyExtension, serde_json::Error> {
        HwkeyExtension::deserialize(value)
    }

    /// The extension of cluster `cluster` in a kubeconfig read by kube's [`kube::config::Kubeconfig`]:
    /// None when the cluster has none.
    pub fn of_cluster(
        cluster: &kube::config::Cluster,
    ) -> Option<Result<HwkeyExtension, serde_json::Error>> {
        cluster
            .extensions
            .as_ref()?
            .iter()
            .find(|e| is_settings_extension(&e.name))
            .map(|e| HwkeyExtension::from_json(&e.extension))
    }
}

/// Why an existing kubeconfig cannot be merged into, for [`KubeconfigError::Read`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum ReadProblem {
    #[error("{0}")]
    Io(#[source] std::io::Error),
    #[error("{0}")]
    Yaml(#[source] serde_yaml_ng::Error),
    #[error("it is not a YAML mapping")]
    NotAMapping,
    #[error("'{0}' is not a list")]
    NotAList(&'static str),
}

/// Errors of kubeconfig generation.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum KubeconfigError {
    #[error("cannot read kubeconfig {path}: {problem}; fix or move it, hwkey does not overwrite a file it cannot parse")]
    Read {
        path: PathBuf,
        #[source]
        problem: ReadProblem,
    },

    #[error("cannot encode the plugin's cluster settings ({CLUSTER_ENV}): {0}")]
    EncodeCluster(#[source] serde_json::Error),

    #[error("cannot encode the kubeconfig: {0}")]
    Encode(#[source] serde_yaml_ng::Error),

    #[error("cannot write kubeconfig {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{what} {path} does not exist: {hint}")]
    MissingFile {
        what: &'static str,
        path: PathBuf,
        hint: &'static str,
    },

    #[error("invalid --key '{given}': it carries a pin-value, which would put the PIN into the kubeconfig; use pin-source=file:/path or pin-source=env:VAR (or no PIN source: kubectl then asks for the PIN)")]
    PinInKey { given: String },

    #[error("invalid loopback port 'auto': cannot find a free one: {0}")]
    NoFreePort(#[source] std::io::Error),

    #[error("cannot prepare the proxy's loopback CA: {0}")]
    LoopbackCa(String),

    #[error("kubeconfig {path} stays locked by {lock} (kubectl or another hwkey is changing it); waited {waited:?}: if neither runs, a crash left the lock behind: remove {lock} and try again")]
    Locked {
        path: PathBuf,
        lock: PathBuf,
        waited: Duration,
    },

    #[error("cannot lock kubeconfig {path} (creating {lock}): {source}")]
    Lock {
        path: PathBuf,
        lock: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Who will use the kubeconfig.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Consumer {
    /// A person with kubectl: the plugin may prompt for a PIN.
    Kubectl,
    /// kubelet (a service): never interactive; the proxy runs under systemd.
    Kubelet,
}

/// The `client.authentication.k8s.io` version of the exec block. client-go before 1.22 (e.g.
/// kubelet 1.20/1.21) knows only `v1beta1`; `v1` needs `interactiveMode`, which `v1beta1`
/// clients of that age do not know, so it is left out there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ExecApiVersion {
    #[default]
    /// `client.authentication.k8s.io/v1` (kubectl ≥ 1.22).
    V1,
    /// `client.authentication.k8s.io/v1beta1`, for older kubectl.
    V1beta1,
}

impl ExecApiVersion {
    /// The apiVersion string of the exec block.
    pub fn api_version(self) -> &'static str {
        match self {
            ExecApiVersion::V1 => "client.authentication.k8s.io/v1",
            ExecApiVersion::V1beta1 => "client.authentication.k8s.io/v1beta1",
        }
    }

    /// The version a kubelet of a cluster at `major.minor` understands: kubelets may be two
    /// minor versions older than the API server, and `v1` arrived in client-go 1.22, so
    /// clusters before 1.24 get `v1beta1` (which newer clients still accept).
    pub fn for_cluster(major: &str, minor: &str) -> ExecApiVersion {
        let minor: u32 = minor
            .trim_end_matches(|c: char| !c.is_ascii_digit())
            .parse()
            .unwrap_or(u32::MAX);
        if major == "1" && minor < 24 {
            ExecApiVersion::V1beta1
        } else {
            ExecApiVersion::V1
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct Request {
    /// Name of the cluster, user and context entries.
    pub name: String,
    /// The hardware key the proxy signs with.
    pub key: KeyUri,
    /// Its certificate chain file, when not stored with the key.
    pub cert: Option<PathBuf>,
    /// The API server, e.g. `https://10.0.0.1:6443`.
    pub upstream: UpstreamTarget,
    /// CA bundle of the API server.
    pub upstream_ca: PathBuf,
    /// The name the API server's certificate is checked against.
    pub tls_server_name: Option<String>,
    /// The forward proxy to the API server; None: the replaced cluster entry's `proxy-url`
    /// (or, for an entry hwkey wrote, its extension's), if any.
    pub upstream_proxy: Option<String>,
    /// Loopback port of the proxy; default: the one this name had before, else a free one.
    pub port: Option<u16>,
    /// The proxy's state directory (loopback CA, control socket).
    pub state_dir: PathBuf,
    /// `--idle-exit` of a proxy the plugin starts (None: the plugin's default).
    pub idle_exit: Option<Duration>,
    /// The started proxy renews its certificate (`hwkey proxy --renew`).
    pub renew: bool,
    /// Its renewals carry TPM evidence by the AK at this handle (`--attest`).
    pub attest: Option<u32>,
    /// Absolute path of the binary the exec block runs: `hwkey-credential`, or `hwkey` (then
    /// with the argument `credential`).
    pub command: PathBuf,
    /// Who runs the plugin: a person (may be prompted) or kubelet (never interactive).
    pub consumer: Consumer,
    /// The exec block's apiVersion.
    pub exec_api_version: ExecApiVersion,
}

impl Request {
    /// The cluster extension that carries this request's settings to the plugin.
    pub fn extension(&self) -> HwkeyExtension {
        HwkeyExtension {
            key: Some(self.key.clone()),
            cert: self.cert.clone(),
            upstream: Some(self.upstream.clone()),
            upstream_ca: Some(self.upstream_ca.clone()),
            tls_server_name: self.tls_server_name.clone(),
            upstream_proxy: self.upstream_proxy.clone(),
            state_dir: Some(self.state_dir.clone()),
            idle_exit: self.idle_exit,
            renew: self.renew,
            attest_ak_handle: self.attest,
        }
    }
}

/// Merges the entries for `request` into the kubeconfig at `out` (created if absent).
/// Returns the loopback server URL.
pub fn write(request: &Request, out: &Path) -> Result<String, KubeconfigError> {
    if let KeyUri::Pkcs11(u) = &request.key {
        if matches!(u.pin, Some(crate::key::pin::PinSource::Value(_))) {
            return Err(KubeconfigError::PinInKey {
                given: request.key.to_string(),
            });
        }
    }
    // A symlinked kubeconfig stays a symlink: write its target, as kubectl does.
    let given = out;
    let out = &resolve_symlink(out);
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| KubeconfigError::Write {
            path: out.to_path_buf(),
            source,
        })?;
    }
    // Read, merge and replace under kubectl's lock: two writers at once (two `hwkey kubeconfig`,
    // or one and `kubectl config set-context`) would otherwise each write what it read, and the
    // entries of the first would be lost.
    let _locks = (
        ConfigLock::acquire(given)?,
        (given != out)
            .then(|| ConfigLock::acquire(out))
            .transpose()?,
    );
    let mut doc = read_existing(out)?;
    for list in ["clusters", "users", "contexts"] {
        if let Some(v) = doc.get(list) {
            if !(v.is_sequence() || v.is_null()) {
                return Err(KubeconfigError::Read {
                    path: out.to_path_buf(),
                    problem: ReadProblem::NotAList(list),
                });
            }
        }
    }
    let port = match request.port {
        Some(p) => p,
        None => existing_port(&doc, &request.name).unwrap_or(free_port()?),
    };
    let ca = LoopbackCa::load_or_create(&request.state_dir)
        .map_err(|e| KubeconfigError::LoopbackCa(e.to_string()))?;
    let server = format!("https://127.0.0.1:{port}");
    let mut extension = request.extension();
    if extension.upstream_proxy.is_none() {
        extension.upstream_proxy = existing_proxy(&doc, &request.name);
    }
    let cluster_env = serde_json::json!({
        "server": server,
        "config": serde_json::to_value(&extension).map_err(KubeconfigError::EncodeCluster)?,
    })
    .to_string();
    let ext = serde_yaml_ng::to_value(extension).map_err(KubeconfigError::Encode)?;
    merge(
        &mut doc,
        request,
        (ext, cluster_env),
        &server,
        ca.cert_pem(),
    );
    let text = serde_yaml_ng::to_string(&doc).map_err(KubeconfigError::Encode)?;
    crate::atomic_file::write_atomic(out, text.as_bytes(), 0o600).map_err(|source| {
        KubeconfigError::Write {
            path: out.to_path_buf(),
            source,
        }
    })?;
    Ok(server)
}

/// How long a writer waits for another one's lock before it gives up (kubectl gives up at once;
/// a second `hwkey kubeconfig` started beside a first should simply follow it).
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// client-go's lock on a kubeconfig it modifies: the file `<kubeconfig>.lock`, created
/// exclusively and removed when done (`clientcmd.lockFile`). hwkey takes the same lock, so it
/// and kubectl exclude each other too. A lock that stays (a writer killed while holding it) is
/// reported with its path, never broken: another writer may really be at work.
struct ConfigLock {
    lock: PathBuf,
}

impl ConfigLock {
    fn acquire(path: &Path) -> Result<ConfigLock, KubeconfigError> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut name = path.as_os_str().to_os_string();
        name.push(".lock");
        let lock = PathBuf::from(name);
        let start = std::time::Instant::now();
        loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&lock)
            {
                Ok(_) => return Ok(ConfigLock { lock }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if start.elapsed() >= LOCK_WAIT {
                        return Err(KubeconfigError::Locked {
                            path: path.to_path_buf(),
                            lock,
                            waited: LOCK_WAIT,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(source) => {
                    return Err(KubeconfigError::Lock {
                        path: path.to_path_buf(),
                        lock,
                        source,
                    })
                }
            }
        }
    }
}

impl Drop for ConfigLock {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.lock) {
            tracing::warn!(lock = %self.lock.display(), error = %e, "cannot remove the kubeconfig lock: remove it by hand");
        }
    }
}

/// The file a kubeconfig path really names (following symlinks, even dangling ones to a file
/// that does not exist yet).
fn resolve_symlink(path: &Path) -> PathBuf {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::read_link(&p) {
            Ok(target) => {
                p = match p.parent() {
                    Some(dir) if target.is_relative() => dir.join(target),
                    _ => target,
                };
            }
            Err(_) => break,
        }
    }
    p
}

/// The largest kubeconfig read (kubeconfigs with hundreds of clusters are a few MiB): a larger
/// file is not read into memory while kubectl's lock is held.
const MAX_KUBECONFIG: u64 = 64 << 20;

/// The kubeconfig at `path`, or an empty one where there is none. Only a regular file is read
/// (opened without waiting): a FIFO or device given as `--out` is refused at once, not waited
/// on with kubectl's lock held.
fn read_existing(path: &Path) -> Result<Value, KubeconfigError> {
    let read = crate::small_file::open_regular(path).and_then(|(file, _)| {
        let mut text = String::new();
        std::io::Read::read_to_string(
            &mut std::io::Read::take(file, MAX_KUBECONFIG + 1),
            &mut text,
        )?;
        if text.len() as u64 > MAX_KUBECONFIG {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "it is longer than {} MiB: not a kubeconfig",
                    MAX_KUBECONFIG >> 20
                ),
            ));
        }
        Ok(text)
    });
    match read {
        Ok(text) if text.trim().is_empty() => Ok(empty_config()),
        Ok(text) => {
            let v: Value = serde_yaml_ng::from_str(&text).map_err(|e| KubeconfigError::Read {
                path: path.to_path_buf(),
                problem: ReadProblem::Yaml(e),
            })?;
            if !v.is_mapping() {
                return Err(KubeconfigError::Read {
                    path: path.to_path_buf(),
                    problem: ReadProblem::NotAMapping,
                });
            }
            Ok(v)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(empty_config()),
        Err(e) => Err(KubeconfigError::Read {
            path: path.to_path_buf(),
            problem: ReadProblem::Io(e),
        }),
    }
}

fn empty_config() -> Value {
    let mut m = Mapping::new();
    m.insert("apiVersion".into(), "v1".into());
    m.insert("kind".into(), "Config".into());
    m.insert("preferences".into(), Value::Mapping(Mapping::new()));
    Value::Mapping(m)
}

fn free_port() -> Result<u16, KubeconfigError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(KubeconfigError::NoFreePort)
}

/// The port this cluster name's proxy already uses, so regenerating keeps its address. Only
/// an entry hwkey wrote (it carries the exec extension) names a proxy port: the user's own
/// entry for the cluster names the API server's port, which the proxy must not take.
fn existing_port(doc: &Value, name: &str) -> Option<u16> {
    let cluster = existing_cluster(doc, name)?;
    hwkey_extension(cluster)?;
    let server = cluster.get("server")?.as_str()?;
    server.parse::<hyper::Uri>().ok()?.port_u16()
}

/// The `cluster` body of the entry named `name`.
fn existing_cluster<'a>(doc: &'a Value, name: &str) -> Option<&'a Value> {
    doc.get("clusters")?
        .as_sequence()?
        .iter()
        .find(|c| c.get("name").and_then(Value::as_str) == Some(name))?
        .get("cluster")
}

/// The hwkey exec extension of a cluster body, if hwkey wrote it.
fn hwkey_extension(cluster: &Value) -> Option<&Value> {
    cluster
        .get("extensions")?
        .as_sequence()?
        .iter()
        .find(|e| {
            e.get("name")
                .and_then(Value::as_str)
                .is_some_and(is_settings_extension)
        })?
        .get("extension")
}

/// The forward proxy of the cluster entry about to be replaced: its `proxy-url` (a cluster
/// kubectl reached through a proxy), or the hwkey extension's (a regenerated entry).
fn existing_proxy(doc: &Value, name: &str) -> Option<String> {
    let cluster = existing_cluster(doc, name)?;
    if let Some(url) = cluster.get("proxy-url").and_then(Value::as_str) {
        return Some(url.to_string());
    }
    hwkey_extension(cluster)?
        .get("upstreamProxy")?
        .as_str()
        .map(str::to_string)
}

fn named(name: &str, field: &str, body: Value) -> Value {
    let mut m = Mapping::new();
    m.insert("name".into(), name.into());
    m.insert(field.into(), body);
    Value::Mapping(m)
}

fn upsert(doc: &mut Value, list: &str, entry: Value) {
    let Some(map) = doc.as_mapping_mut() else {
        return;
    };
    let name = entry.get("name").cloned();
    let seq = map
        .entry(list.into())
        .or_insert_with(|| Value::Sequence(Vec::new()));
    if !seq.is_sequence() {
        *seq = Value::Sequence(Vec::new());
    }
    if let Some(items) = seq.as_sequence_mut() {
        // client-go refuses a kubeconfig with two entries of one name ("duplicate name in
        // list"): the new entry takes the first one's place and the others go.
        let same = |i: &Value| i.get("name") == name.as_ref();
        match items.iter().position(same) {
            Some(at) => {
                items[at] = entry;
                let mut index = 0;
                items.retain(|i| {
                    let keep = index == at || !same(i);
                    index += 1;
                    keep
                });
            }
            None => items.push(entry),
        }
    }
}

/// `ext`: the cluster extension, and the same settings as [`CLUSTER_ENV`]'s JSON.
fn merge(
    doc: &mut Value,
    r: &Request,
    (ext, cluster_env): (Value, String),
    server: &str,
    loopback_ca_pem: &str,
) {
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);

    let mut cluster = Mapping::new();
    cluster.insert("server".into(), server.into());
    cluster.insert(
        "certificate-authority-data".into(),
        b64(loopback_ca_pem).into(),
    );
    cluster.insert(
        "extensions".into(),
        Value::Sequence(vec![named(SETTINGS_EXTENSION, "extension", ext)]),
    );

    let mut exec = Mapping::new();
    exec.insert("apiVersion".into(), r.exec_api_version.api_version().into());
    exec.insert("command".into(), r.command.display().to_string().into());
    // `hwkey-credential` is the plugin itself; the full binary needs its subcommand.
    if !is_plugin_binary(&r.command) {
        exec.insert("args".into(), Value::Sequence(vec!["credential".into()]));
    }
    if r.exec_api_version == ExecApiVersion::V1 {
        exec.insert(
            "interactiveMode".into(),
            match r.consumer {
                Consumer::Kubectl => "IfAvailable",
                Consumer::Kubelet => "Never",
            }
            .into(),
        );
    }
    // The cluster reaches the plugin in its env, not through `provideClusterInfo: true`, which
    // costs kubectl CPU per object of a list (see CLUSTER_ENV).
    let mut env = Mapping::new();
    env.insert("name".into(), CLUSTER_ENV.into());
    env.insert("value".into(), cluster_env.into());
    exec.insert("env".into(), Value::Sequence(vec![Value::Mapping(env)]));
    exec.insert(
        "installHint".into(),
        "hwkey keeps this cluster's client key in hardware. Install it with `cargo install --path .` from the hwkey repository and see its README."
            .into(),
    );
    let mut user = Mapping::new();
    user.insert("exec".into(), Value::Mapping(exec));

    let mut context = Mapping::new();
    context.insert("cluster".into(), r.name.clone().into());
    context.insert("user".into(), r.name.clone().into());

    upsert(
        doc,
        "clusters",
        named(&r.name, "cluster", Value::Mapping(cluster)),
    );
    upsert(doc, "users", named(&r.name, "user", Value::Mapping(user)));
    upsert(
        doc,
        "contexts",
        named(&r.name, "context", Value::Mapping(context)),
    );
    if let Some(map) = doc.as_mapping_mut() {
        let current = map
            .get("current-context")
            .and_then(Value::as_str)
            .unwrap_or("");
        if current.is_empty() {
            map.insert("current-context".into(), r.name.clone().into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ExecApiVersion;

    #[test]
    fn kubelets_of_clusters_before_1_24_get_v1beta1() {
        assert_eq!(
            ExecApiVersion::for_cluster("1", "20"),
            ExecApiVersion::V1beta1
        );
        assert_eq!(
            ExecApiVersion::for_cluster("1", "23+"),
            ExecApiVersion::V1beta1
        );
        assert_eq!(ExecApiVersion::for_cluster("1", "24"), ExecApiVersion::V1);
        assert_eq!(ExecApiVersion::for_cluster("1", "32"), ExecApiVersion::V1);
        assert_eq!(ExecApiVersion::for_cluster("2", "0"), ExecApiVersion::V1);
    }
}
