//! The messages of the proxy's control socket (`STATE/control.sock`), shared by the server
//! (`proxy::control`) and its clients (`exec`, `cli::doctor`). One set of types on both sides:
//! a field renamed on one side is a compile error, and a field missing from an answer is a
//! decoding error that names it, never an empty string.
//!
//! The wire format is JSON over HTTP/1.1 (`curl --unix-socket STATE/control.sock
//! http://hwkey/v1/info` works), with camelCase names like the Kubernetes objects around it.

use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

/// `apiVersion` of every message.
pub const API_VERSION: &str = "hwkey/v1";

/// `GET /v1/info`: what a running proxy serves and with which key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProxyInfo {
    /// `ProxyInfo`, or `LoopbackCredential` when embedded in one.
    pub kind: String,
    /// [`API_VERSION`].
    pub api_version: String,
    /// The loopback HTTPS URL (`https://127.0.0.1:PORT`); null when the proxy listens on UNIX
    /// sockets only.
    pub server: Option<String>,
    /// The UNIX sockets it listens on.
    pub unix_sockets: Vec<String>,
    /// The API server it forwards to (`host:port`).
    pub upstream: String,
    /// A human description of the hardware key.
    pub key: String,
    /// The key's URI without any PIN. Absent from proxies of hwkey before 0.1 reported it, so
    /// clients compare by upstream only then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_uri: Option<String>,
    /// How its connections to each API server leave ([`crate::egress::Egress::routes`]).
    /// Absent from proxies of hwkey before it was reported: clients do not compare it then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<String>,
    /// The proxy's process id (to tell the user which process to stop).
    pub pid: u32,
    /// The loopback CA (PEM) that signs the proxy's loopback server certificate.
    pub certificate_authority_pem: String,
    /// The hardware certificate chain (PEM, public): what `hwkey credential --cert-only` returns.
    pub certificate_chain_pem: String,
}

/// `GET /v1/credential[?validity=10m]`: a loopback client credential for the local hop.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoopbackCredential {
    /// What `/v1/info` says, with `kind` = `LoopbackCredential`.
    #[serde(flatten)]
    pub info: ProxyInfo,
    /// The short-lived client certificate (PEM) issued by the loopback CA.
    pub client_certificate_pem: String,
    /// Its throw-away software key (PEM): wiped from memory when dropped, never logged, never
    /// written to disk by the proxy.
    pub client_key_pem: Zeroizing<String>,
    /// The certificate's NotAfter, RFC 3339.
    pub expiration_timestamp: String,
    /// The same, Unix seconds.
    pub expiration_unix: i64,
}

/// The body of every non-200 answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlError {
    /// What went wrong, in words.
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> ProxyInfo {
        ProxyInfo {
            kind: "ProxyInfo".into(),
            api_version: API_VERSION.into(),
            server: Some("https://127.0.0.1:6443".into()),
            unix_sockets: vec!["/run/hwkey/kube.sock".into()],
            upstream: "api.example:6443".into(),
            key: "PKCS#11 token 'kube', object 'alice'".into(),
            key_uri: Some("pkcs11:token=kube;object=alice".into()),
            egress: Some("api.example:6443 direct".into()),
            pid: 42,
            certificate_authority_pem: "CA".into(),
            certificate_chain_pem: "CHAIN".into(),
        }
    }

    #[test]
    fn a_credential_round_trips_with_the_wire_names() {
        let cred = LoopbackCredential {
            info: ProxyInfo {
                kind: "LoopbackCredential".into(),
                ..info()
            },
            client_certificate_pem: "CERT".into(),
            client_key_pem: Zeroizing::new("KEY".into()),
            expiration_timestamp: "2026-11-23T07:00:00Z".into(),
            expiration_unix: 1_795_417_200,
        };
        let text = serde_json::to_string(&cred).expect("encode");
        for name in [
            "\"kind\":\"LoopbackCredential\"",
            "\"apiVersion\":\"hwkey/v1\"",
            "\"keyUri\"",
            "\"unixSockets\"",
            "\"certificateAuthorityPem\"",
            "\"certificateChainPem\"",
            "\"clientCertificatePem\"",
            "\"clientKeyPem\":\"KEY\"",
            "\"expirationUnix\"",
        ] {
            assert!(text.contains(name), "{name} missing in {text}");
        }
        let back: LoopbackCredential = serde_json::from_str(&text).expect("decode");
        assert_eq!(back.info, cred.info);
        assert_eq!(back.client_key_pem.as_str(), "KEY");
    }

    #[test]
    fn a_missing_field_is_an_error_that_names_it() {
        let mut v = serde_json::to_value(info()).expect("encode");
        v.as_object_mut().expect("object").remove("upstream");
        let e = serde_json::from_value::<ProxyInfo>(v).expect_err("must fail");
        assert!(e.to_string().contains("upstream"), "{e}");
    }

    #[test]
    fn an_older_proxy_without_key_uri_still_decodes() {
        let mut v = serde_json::to_value(info()).expect("encode");
        v.as_object_mut().expect("object").remove("keyUri");
        let back: ProxyInfo = serde_json::from_value(v).expect("decode");
        assert_eq!(back.key_uri, None);
    }
}
