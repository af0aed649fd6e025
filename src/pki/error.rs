//! The PKI layer's errors, each saying what to fix.

use std::path::PathBuf;

use crate::key::KeyError;

use super::{cert, loopback_ca, name};

/// Errors of the PKI layer.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message, which says what went wrong and how to fix it"
)]
pub enum PkiError {
    #[error("invalid subject '{given}': {problem} (example: --subject \"CN=alice,O=devs\")")]
    InvalidSubject {
        given: String,
        #[source]
        problem: name::SubjectSyntax,
    },

    #[error("invalid --ip '{given}': not an IPv4 or IPv6 address")]
    InvalidIp { given: String },

    #[error("invalid --dns '{given}': it is empty")]
    EmptyDns { given: String },

    #[error("invalid --dns '{given}': '{}' is not allowed in a DNS name; write internationalized domains in punycode (xn--…)", .bad.escape_default())]
    InvalidDns { given: String, bad: char },

    #[error("cannot read certificate file {path}: {source}")]
    ReadCert {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "{path} holds no certificate: expected PEM 'CERTIFICATE' blocks or one DER certificate"
    )]
    NoCertInFile { path: PathBuf },

    #[error("{path} is refused whole: it starts {begins} PEM blocks but only {whole} are complete and well formed (a file cut short or copied while it was written?); write the whole chain again")]
    TruncatedPem {
        path: PathBuf,
        begins: usize,
        whole: usize,
    },

    #[error("{what} is not a valid X.509 certificate: {problem}")]
    BadCert {
        what: String,
        #[source]
        problem: cert::CertProblem,
    },

    #[error("no certificate for {key}: pass --cert FILE, or store one with `hwkey cert import --key URI --cert FILE`")]
    NoCertificate { key: String },

    #[error("cannot use the CA bundle {path}: {source}; pass a PEM file of CA certificates")]
    BadCaBundle {
        path: PathBuf,
        #[source]
        source: crate::key::Cause,
    },

    #[error("no system root certificates could be loaded ({reasons}): install ca-certificates, or pass the API server's CA with --upstream-ca / --ca")]
    NoSystemRoots { reasons: String },

    #[error("cannot build the TLS configuration: {0}")]
    Tls(#[source] rustls::Error),

    #[error("cannot use state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("loopback CA {path}: {problem}")]
    LoopbackCa {
        path: PathBuf,
        #[source]
        problem: loopback_ca::CaProblem,
    },

    #[error("the system random generator failed")]
    Random,

    #[error("cannot use the attestation trust directory {path}: {source}")]
    BadTrust {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("the client CA bundle {path}: certificate {index} is refused ({problem}): give the CA certificate(s) of the cluster's client certificates in PEM")]
    BadClientCa {
        path: PathBuf,
        index: usize,
        #[source]
        problem: super::request::Malformed,
    },

    #[error("{0}")]
    Key(#[from] KeyError),
}
