//! The client-go exec plugin contract: `KUBERNETES_EXEC_INFO` in, one `ExecCredential` JSON
//! object out, in the same apiVersion (`client.authentication.k8s.io/v1` or `v1beta1`).
//!
//! client-go caches the credential until `expirationTimestamp`, runs the plugin again on a 401,
//! and expects stdout to hold the JSON object and nothing else.

use serde::{Deserialize, Serialize};

use super::ExecError;

/// What is wrong with `KUBERNETES_EXEC_INFO`, for [`ExecError::MalformedExecInfo`].
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum ExecInfoProblem {
    #[error("{0}")]
    Json(#[source] serde_json::Error),
    #[error("kind is '{0}', expected 'ExecCredential'")]
    Kind(String),
    #[error("apiVersion is missing")]
    NoApiVersion,
}

/// The exec credential API versions hwkey speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiVersion {
    /// `client.authentication.k8s.io/v1` (client-go ≥ 1.22).
    V1,
    /// `client.authentication.k8s.io/v1beta1`, for older clients.
    V1Beta1,
}

impl ApiVersion {
    /// The apiVersion string.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiVersion::V1 => "client.authentication.k8s.io/v1",
            ApiVersion::V1Beta1 => "client.authentication.k8s.io/v1beta1",
        }
    }

    /// Parses an apiVersion string.
    pub fn parse(s: &str) -> Result<ApiVersion, ExecError> {
        match s {
            "client.authentication.k8s.io/v1" => Ok(ApiVersion::V1),
            "client.authentication.k8s.io/v1beta1" => Ok(ApiVersion::V1Beta1),
            other => Err(ExecError::UnknownApiVersion {
                given: other.to_string(),
            }),
        }
    }
}

/// What client-go passes in `KUBERNETES_EXEC_INFO`.
#[derive(Debug, Clone)]
pub struct ExecInfo {
    /// The apiVersion the caller speaks; the answer must use the same one.
    pub api_version: ApiVersion,
    /// `spec.interactive`: whether the plugin may prompt on the terminal.
    pub interactive: bool,
    /// `spec.cluster` (with `provideClusterInfo: true`), else the same object from the exec
    /// block's env ([`crate::kubeconfig::CLUSTER_ENV`], what `hwkey kubeconfig` writes).
    pub cluster: Option<Cluster>,
}

/// The cluster client-go is talking to, as it passes it to the plugin.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Cluster {
    /// The server URL from the kubeconfig (for hwkey: the proxy's loopback address).
    #[serde(default)]
    pub server: String,
    #[serde(default)]
    /// The name the API server's certificate is checked against, when not the URL's host.
    pub tls_server_name: Option<String>,
    /// The CA of `server`, base64 in JSON (client-go sends bytes).
    #[serde(default)]
    pub certificate_authority_data: Option<String>,
    /// hwkey's settings: the cluster's `client.authentication.k8s.io/exec` extension (which
    /// client-go passes), or the `config` of [`crate::kubeconfig::CLUSTER_ENV`].
    #[serde(default)]
    pub config: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawInfo {
    api_version: Option<String>,
    kind: Option<String>,
    #[serde(default)]
    spec: RawSpec,
}

#[derive(Deserialize, Default)]
struct RawSpec {
    #[serde(default)]
    interactive: Option<bool>,
    #[serde(default)]
    cluster: Option<Cluster>,
}

impl ExecInfo {
    /// Parses the value of `KUBERNETES_EXEC_INFO`.
    pub fn parse(json: &str) -> Result<ExecInfo, ExecError> {
        let raw: RawInfo =
            serde_json::from_str(json).map_err(|e| ExecError::MalformedExecInfo {
                problem: ExecInfoProblem::Json(e),
            })?;
        if let Some(kind) = &raw.kind {
            if kind != "ExecCredential" {
                return Err(ExecError::MalformedExecInfo {
                    problem: ExecInfoProblem::Kind(kind.clone()),
                });
            }
        }
        let api_version = ApiVersion::parse(raw.api_version.as_deref().ok_or_else(|| {
            ExecError::MalformedExecInfo {
                problem: ExecInfoProblem::NoApiVersion,
            }
        })?)?;
        Ok(ExecInfo {
            api_version,
            interactive: raw.spec.interactive.unwrap_or(false),
            cluster: raw.spec.cluster,
        })
    }

    /// Reads `KUBERNETES_EXEC_INFO`; when it is absent (the plugin run by hand), assumes v1 and
    /// interactive only if stdin is a terminal. The cluster comes from
    /// [`crate::kubeconfig::CLUSTER_ENV`] when client-go passed none.
    pub fn from_env() -> Result<ExecInfo, ExecError> {
        let info = match std::env::var("KUBERNETES_EXEC_INFO") {
            Ok(v) if !v.trim().is_empty() => ExecInfo::parse(&v)?,
            _ => ExecInfo {
                api_version: ApiVersion::V1,
                interactive: std::io::IsTerminal::is_terminal(&std::io::stdin()),
                cluster: None,
            },
        };
        info.with_cluster_env(
            std::env::var(crate::kubeconfig::CLUSTER_ENV)
                .ok()
                .as_deref(),
        )
    }

    /// Takes the cluster from the exec block's env when client-go passed none, or one without
    /// hwkey's settings (`provideClusterInfo: true` set by hand on a kubeconfig whose settings
    /// extension client-go does not pass on).
    ///
    /// `hwkey kubeconfig` hands the plugin its cluster this way rather than with
    /// `provideClusterInfo: true`: client-go keys its exec authenticators by a text dump of the
    /// exec config and, with that flag, of the cluster too (its CA and extension bytes, hex
    /// dumped), and kubectl builds a client per object of a list, so the flag cost kubectl
    /// about 60 µs of CPU per object (docs/BENCHMARKS.md, round twelve). When client-go does
    /// pass the cluster with settings (an older kubeconfig), that one is used; when it passes one
    /// without, its server is kept and only the settings come from the env.
    pub fn with_cluster_env(mut self, env: Option<&str>) -> Result<ExecInfo, ExecError> {
        if self
            .cluster
            .as_ref()
            .and_then(|c| c.config.as_ref())
            .is_none()
        {
            if let Some(text) = env.filter(|t| !t.trim().is_empty()) {
                let from_env: Cluster =
                    serde_json::from_str(text).map_err(ExecError::BadClusterEnv)?;
                self.cluster = Some(match self.cluster.take() {
                    // client-go's server is the one kubectl dials (a `--server` override too).
                    Some(passed) if !passed.server.is_empty() => Cluster {
                        config: from_env.config,
                        ..passed
                    },
                    _ => from_env,
                });
            }
        }
        Ok(self)
    }
}

/// The plugin's answer.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecCredential {
    /// The caller's apiVersion, echoed.
    pub api_version: &'static str,
    /// Always `ExecCredential`.
    pub kind: &'static str,
    /// The credential itself.
    pub status: ExecCredentialStatus,
}

/// `status` of an [`ExecCredential`].
#[derive(Debug, Clone, Serialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ExecCredentialStatus {
    /// RFC 3339; client-go caches the credential until then.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expiration_timestamp: Option<String>,
    /// PEM certificate chain.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_certificate_data: Option<String>,
    /// PEM private key: only ever the throw-away loopback key, never the hardware key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_key_data: Option<zeroize::Zeroizing<String>>,
    /// KEP-2718 shape (`--cert-only`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub proxy_config: Option<ProxyConfig>,
}

/// KEP-2718 `proxyConfig`.
#[derive(Debug, Clone, Serialize)]
pub struct ProxyConfig {
    /// The loopback URL of the proxy that holds the hardware key.
    pub url: String,
    /// Base64 of the PEM CA bundle, as client-go encodes `[]byte`.
    #[serde(rename = "certificate-authority-data")]
    pub certificate_authority_data: String,
}

impl ExecCredential {
    /// A credential in the caller's apiVersion.
    pub fn new(api_version: ApiVersion, status: ExecCredentialStatus) -> ExecCredential {
        ExecCredential {
            api_version: api_version.as_str(),
            kind: "ExecCredential",
            status,
        }
    }

    /// The JSON object client-go reads from stdout.
    pub fn to_json(&self) -> Result<String, ExecError> {
        serde_json::to_string(self).map_err(|e| ExecError::Internal(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_v1_with_cluster_config() {
        let info = ExecInfo::parse(
            r#"{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1",
                "spec":{"interactive":true,"cluster":{"server":"https://127.0.0.1:7443",
                "certificate-authority-data":"QUJD","config":{"key":"pkcs11:token=a;object=b"}}}}"#,
        )
        .expect("valid");
        assert_eq!(info.api_version, ApiVersion::V1);
        assert!(info.interactive);
        let cluster = info.cluster.expect("cluster");
        assert_eq!(cluster.server, "https://127.0.0.1:7443");
        assert_eq!(
            cluster.config.expect("config")["key"],
            "pkcs11:token=a;object=b"
        );
    }

    #[test]
    fn the_settings_come_from_the_exec_env_when_client_go_passed_none() {
        let v1 = r#"{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1"}"#;
        let env =
            r#"{"server":"https://127.0.0.1:7443","config":{"key":"pkcs11:token=a;object=b"}}"#;
        let info = ExecInfo::parse(v1)
            .and_then(|i| i.with_cluster_env(Some(env)))
            .expect("valid");
        let cluster = info.cluster.expect("cluster from the env");
        assert_eq!(cluster.server, "https://127.0.0.1:7443");
        assert_eq!(
            cluster.config.expect("config")["key"],
            "pkcs11:token=a;object=b"
        );

        // client-go's own cluster wins when it carries settings, and only then; no env leaves
        // none; an empty env is no env.
        let with = r#"{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1",
            "spec":{"cluster":{"server":"https://127.0.0.1:9443","config":{"key":"pkcs11:token=c;object=d"}}}}"#;
        let info = ExecInfo::parse(with)
            .and_then(|i| i.with_cluster_env(Some(env)))
            .expect("valid");
        assert_eq!(
            info.cluster.expect("cluster").server,
            "https://127.0.0.1:9443"
        );
        let bare = r#"{"kind":"ExecCredential","apiVersion":"client.authentication.k8s.io/v1",
            "spec":{"cluster":{"server":"https://127.0.0.1:9443"}}}"#;
        let info = ExecInfo::parse(bare)
            .and_then(|i| i.with_cluster_env(Some(env)))
            .expect("valid");
        let cluster = info.cluster.expect("cluster");
        assert_eq!(
            cluster.server, "https://127.0.0.1:9443",
            "the server kubectl dials"
        );
        assert_eq!(
            cluster.config.expect("config")["key"],
            "pkcs11:token=a;object=b"
        );
        for none in [None, Some(""), Some("  ")] {
            let info = ExecInfo::parse(v1)
                .and_then(|i| i.with_cluster_env(none))
                .expect("valid");
            assert!(info.cluster.is_none(), "{none:?}");
        }

        // A broken env is an error naming the variable and the fix, not a cluster-less run.
        let err = ExecInfo::parse(v1)
            .and_then(|i| i.with_cluster_env(Some("{\"server\": 7")))
            .expect_err("broken JSON");
        let text = err.to_string();
        assert!(
            text.contains("HWKEY_EXEC_CLUSTER") && text.contains("hwkey kubeconfig"),
            "{text}"
        );
    }

    #[test]
    fn rejects_what_it_cannot_answer() {
        assert!(matches!(
            ExecInfo::parse("{not json"),
            Err(ExecError::MalformedExecInfo { .. })
        ));
        assert!(matches!(
            ExecInfo::parse(
                r#"{"apiVersion":"client.authentication.k8s.io/v2","kind":"ExecCredential"}"#
            ),
            Err(ExecError::UnknownApiVersion { .. })
        ));
        assert!(matches!(
            ExecInfo::parse(r#"{"apiVersion":"client.authentication.k8s.io/v1","kind":"Pod"}"#),
            Err(ExecError::MalformedExecInfo { .. })
        ));
    }

    #[test]
    fn output_has_only_what_was_set() {
        let cred = ExecCredential::new(
            ApiVersion::V1Beta1,
            ExecCredentialStatus {
                client_certificate_data: Some("CERT".into()),
                ..Default::default()
            },
        );
        let json = cred.to_json().expect("json");
        assert_eq!(
            json,
            r#"{"apiVersion":"client.authentication.k8s.io/v1beta1","kind":"ExecCredential","status":{"clientCertificateData":"CERT"}}"#
        );
    }
}
