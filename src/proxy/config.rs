//! The proxy's settings as typed values, and the two text forms they arrive in: command-line
//! values (`unix:PATH`, `tcp:HOST:PORT`, `https://HOST:PORT`, `30s`) and a `--config` file
//! (TOML or YAML) holding the same settings under the flags' names.
//!
//! Everything is parsed at the edge; the rest of the proxy only sees [`ListenAddr`],
//! [`UpstreamTarget`] and [`Duration`]s (defined below the proxy, in [`crate::endpoint`] and
//! [`crate::duration`], because the exec plugin, the lifecycle and the CLI read them too).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::ProxyError;
pub use crate::duration::parse_duration;
pub use crate::endpoint::{ListenAddr, UpstreamTarget};
use crate::key::KeyUri;

/// serde: an optional persistent TPM handle, written as text (`"0x81010002"`) or a number.
fn handle<'de, D>(d: D) -> Result<Option<u32>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Handle {
        Number(u32),
        Text(String),
    }
    Option::<Handle>::deserialize(d)?
        .map(|h| {
            let text = match h {
                Handle::Number(n) => n.to_string(),
                Handle::Text(s) => s,
            };
            crate::key::attestation::parse_persistent_handle(&text)
                .map_err(serde::de::Error::custom)
        })
        .transpose()
}

/// The settings a `--config` file may hold: the flags' long names, without the dashes' prefix
/// (`upstream-ca: /etc/kubernetes/ca.crt`). Flags given on the command line or in the
/// environment win over the file. Unknown keys are an error, so a typo is not silently ignored.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default, deserialize_with = "crate::serde_text::option::deserialize")]
    /// `key`: the hardware key.
    pub key: Option<KeyUri>,
    /// `cert`: its certificate chain file.
    pub cert: Option<PathBuf>,
    #[serde(default, deserialize_with = "crate::serde_text::list::one_or_many")]
    /// `upstream`: the API server URL, or a list of them (round robin over those that are up).
    pub upstream: Vec<UpstreamTarget>,
    /// `upstream-ca`: the API server's CA bundle.
    pub upstream_ca: Option<PathBuf>,
    /// `upstream-proxy`: the forward proxy to the API server (its URL may carry the
    /// credentials here, in a file).
    pub upstream_proxy: Option<String>,
    /// `upstream-proxy-auth`: `file:PATH` or `env:VAR` holding the proxy's `user:password`.
    pub upstream_proxy_auth: Option<String>,
    /// `key-exchange`: `hybrid` (X25519MLKEM768, then X25519) or `classical`.
    pub key_exchange: Option<crate::pki::tls::KeyExchange>,
    /// `tls-server-name`: the name the API server's certificate is checked against.
    pub tls_server_name: Option<String>,
    #[serde(default, deserialize_with = "crate::serde_text::list::deserialize")]
    /// `listen`: the client listeners.
    pub listen: Vec<ListenAddr>,
    #[serde(default, deserialize_with = "crate::serde_text::option::deserialize")]
    /// `admin`: the /healthz and /metrics listener.
    pub admin: Option<ListenAddr>,
    /// `state-dir`.
    pub state_dir: Option<PathBuf>,
    /// `lock-file`: exit when its flock holder goes away.
    pub lock_file: Option<PathBuf>,
    #[serde(default, deserialize_with = "crate::serde_text::duration::deserialize")]
    /// `idle-exit`.
    pub idle_exit: Option<Duration>,
    #[serde(default, deserialize_with = "crate::serde_text::duration::deserialize")]
    /// `handshake-timeout`.
    pub handshake_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "crate::serde_text::duration::deserialize")]
    /// `idle-timeout`.
    pub idle_timeout: Option<Duration>,
    #[serde(default, deserialize_with = "crate::serde_text::duration::deserialize")]
    /// `drain-timeout`.
    pub drain_timeout: Option<Duration>,
    /// `max-connections`.
    pub max_connections: Option<usize>,
    #[serde(default)]
    /// `allow-uid`: more UNIX-socket peers.
    pub allow_uid: Vec<u32>,
    /// `unsafe-listen`.
    pub unsafe_listen: Option<bool>,
    /// `allow-tls12-fallback`.
    pub allow_tls12_fallback: Option<bool>,
    /// `renew`.
    pub renew: Option<bool>,
    /// `rotate-key`.
    pub rotate_key: Option<bool>,
    /// `attest`: renewal requests carry TPM2_Certify evidence.
    pub attest: Option<bool>,
    #[serde(default, deserialize_with = "handle")]
    /// `ak-handle`: the attestation key's persistent handle.
    pub ak_handle: Option<u32>,
    /// `rotation-close`.
    pub rotation_close: Option<super::rotation::RotationClose>,
    #[serde(default, deserialize_with = "crate::serde_text::duration::deserialize")]
    /// `credential-validity`.
    pub credential_validity: Option<Duration>,
    #[serde(default, deserialize_with = "crate::serde_text::duration::deserialize")]
    /// `reload-interval`.
    pub reload_interval: Option<Duration>,
    /// `require-non-extractable`.
    pub require_non_extractable: Option<bool>,
}

/// Why a `--config` file does not parse, for [`ProxyError::BadConfig`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum ConfigProblem {
    #[error("{0}")]
    Toml(#[source] toml::de::Error),
    #[error("{0}")]
    Yaml(#[source] serde_yaml_ng::Error),
    #[error("neither TOML ({toml}) nor YAML ({yaml}); name the file .toml or .yaml for a precise message")]
    Neither {
        toml: toml::de::Error,
        #[source]
        yaml: serde_yaml_ng::Error,
    },
}

impl FileConfig {
    /// Reads a TOML (`.toml`) or YAML (`.yaml`, `.yml`) file; other names are tried as TOML,
    /// then YAML.
    pub fn load(path: &Path) -> Result<FileConfig, ProxyError> {
        let text =
            crate::small_file::read_to_string(path).map_err(|source| ProxyError::ReadConfig {
                path: path.to_path_buf(),
                source,
            })?;
        let bad = |problem| ProxyError::BadConfig {
            path: path.to_path_buf(),
            problem: Box::new(problem),
        };
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        match ext.as_str() {
            "toml" => toml::from_str(&text).map_err(|e| bad(ConfigProblem::Toml(e))),
            "yaml" | "yml" => {
                serde_yaml_ng::from_str(&text).map_err(|e| bad(ConfigProblem::Yaml(e)))
            }
            _ => toml::from_str(&text).or_else(|toml| {
                serde_yaml_ng::from_str(&text)
                    .map_err(|yaml| bad(ConfigProblem::Neither { toml, yaml }))
            }),
        }
    }
}

/// A loopback address set for the loopback server certificate's SANs.
pub(crate) fn loopback_names(listen: &[ListenAddr]) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = vec![
        IpAddr::from([127, 0, 0, 1]),
        IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
    ];
    for l in listen {
        if let ListenAddr::Tcp(a) = l {
            if !ips.contains(&a.ip()) && !a.ip().is_unspecified() {
                ips.push(a.ip());
            }
        }
    }
    ips
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn listen_addrs() {
        assert_eq!(
            "unix:/run/x.sock".parse::<ListenAddr>().unwrap(),
            ListenAddr::Unix("/run/x.sock".into())
        );
        let tcp: ListenAddr = "tcp:127.0.0.1:8443".parse().unwrap();
        assert!(tcp.is_local());
        let any: ListenAddr = "tcp:0.0.0.0:8443".parse().unwrap();
        assert!(!any.is_local());
        assert!("127.0.0.1:8443".parse::<ListenAddr>().is_err());
    }

    #[test]
    fn upstreams() {
        let u: UpstreamTarget = "https://[::1]:6443".parse().unwrap();
        assert_eq!(u.host, "::1");
        assert_eq!(u.authority(), "[::1]:6443");
        let d: UpstreamTarget = "https://api.example".parse().unwrap();
        assert_eq!(d.port, 443);
        assert!("http://x:1".parse::<UpstreamTarget>().is_err());
        assert!("https://x:1/api".parse::<UpstreamTarget>().is_err());
        // Issue 22, finding 10: out-of-range ports were read as "no port" (443).
        for bad in [
            "https://127.0.0.1:99999",
            "https://127.0.0.1:0",
            "https://[::1]:65536",
        ] {
            let e = bad.parse::<UpstreamTarget>().expect_err(bad).to_string();
            assert!(
                e.contains("out of range") || e.contains("port 0"),
                "{bad}: {e}"
            );
        }
        let top: UpstreamTarget = "https://[::1]:65535".parse().unwrap();
        assert_eq!(top.port, 65535);
    }

    #[test]
    fn file_config_toml_and_yaml() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("p.toml");
        std::fs::write(
            &t,
            "upstream = \"https://127.0.0.1:6443\"\nlisten = [\"unix:/tmp/a\"]\nallow-uid = [1000]\n",
        )
        .unwrap();
        let c = FileConfig::load(&t).unwrap();
        assert_eq!(c.listen, vec![ListenAddr::Unix("/tmp/a".into())]);
        assert_eq!(c.allow_uid, vec![1000]);
        assert_eq!(c.upstream.first().map(|u| u.port), Some(6443));
        let y = dir.path().join("p.yaml");
        std::fs::write(&y, "upstream-ca: /ca.pem\nmax-connections: 7\n").unwrap();
        let c = FileConfig::load(&y).unwrap();
        assert_eq!(c.max_connections, Some(7));
        std::fs::write(&y, "upstream_typo: x\n").unwrap();
        assert!(FileConfig::load(&y).is_err());
    }

    #[test]
    fn file_values_are_typed_with_the_flags_syntax() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("p.toml");
        std::fs::write(
            &t,
            "idle-exit = \"1h30m\"\nhandshake-timeout = 5\ndrain-timeout = \"1h 2m\"\nadmin = \"tcp:127.0.0.1:0\"\n",
        )
        .unwrap();
        let c = FileConfig::load(&t).unwrap();
        assert_eq!(c.idle_exit, Some(Duration::from_secs(5400)));
        assert_eq!(c.handshake_timeout, Some(Duration::from_secs(5)));
        assert_eq!(c.drain_timeout, Some(Duration::from_secs(3720)));
        assert!(matches!(c.admin, Some(ListenAddr::Tcp(_))));
        // A bad value names the key it is in.
        std::fs::write(&t, "upstream = \"http://x:1\"\n").unwrap();
        let e = FileConfig::load(&t).unwrap_err().to_string();
        assert!(e.contains("https://") && e.contains("upstream"), "{e}");
        std::fs::write(&t, "idle-exit = \"ten minutes\"\n").unwrap();
        let e = FileConfig::load(&t).unwrap_err().to_string();
        assert!(e.contains("ten minutes") && e.contains("idle-exit"), "{e}");
    }

    #[test]
    fn attestation_keys_are_persistent_handles() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path().join("p.toml");
        std::fs::write(&t, "attest = true\nak-handle = \"0x81010003\"\n").unwrap();
        let c = FileConfig::load(&t).unwrap();
        assert_eq!((c.attest, c.ak_handle), (Some(true), Some(0x8101_0003)));
        std::fs::write(&t, "ak-handle = 2164326403\n").unwrap();
        assert_eq!(FileConfig::load(&t).unwrap().ak_handle, Some(0x8101_0003));
        // A transient or NV handle is refused with the range to use.
        std::fs::write(&t, "ak-handle = \"0x80000001\"\n").unwrap();
        let e = FileConfig::load(&t).unwrap_err().to_string();
        assert!(
            e.contains("0x81000000-0x81ffffff") && e.contains("ak-handle"),
            "{e}"
        );
    }

    #[test]
    fn durations_take_humantime_and_bare_seconds() {
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2d").unwrap(), Duration::from_secs(172_800));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("10 parsecs").is_err());
    }
}
