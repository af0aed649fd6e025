//! The signer's errors: the socket between the two processes, and starting the signer.

use std::io;

/// What went wrong between the network side and its signer.
#[derive(Debug, thiserror::Error)]
#[allow(
    missing_docs,
    reason = "each variant is documented by its #[error] message"
)]
pub enum SignerError {
    #[error("cannot encode a message for the signer: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("a message from the other side of the signer's socket does not parse: {0}")]
    Decode(#[source] serde_json::Error),
    #[error("a signer message of {len} bytes is over the limit")]
    TooLarge { len: usize },
    #[error("cannot send to the signer's socket: {0}")]
    Send(#[source] rustix::io::Errno),
    #[error("cannot read the signer's socket: {0}")]
    Recv(#[source] rustix::io::Errno),
    #[error("the signer process is gone{}", .why.as_deref().map(|w| format!(": {w}")).unwrap_or_default())]
    Gone { why: Option<String> },
    #[error("the signer speaks protocol version {theirs}, this process {ours}: both must come from the same hwkey")]
    Version { theirs: u32, ours: u32 },
    #[error("the signer answered with something else than asked ({0})")]
    Unexpected(&'static str),
    #[error("cannot start the signer: {what}: {source}")]
    Start {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the identity's certificate before the network side starts: {0}")]
    Identity(#[source] crate::pki::PkiError),
    #[error("the device refused the PIN and the PIN source still holds the same one: fix it (the next request tries again once it changed)")]
    PinUnchanged,
    #[error("--rotate-key: {0}")]
    RotateKey(#[source] crate::key::KeyError),
    #[error("no answer from the signer within {0:?}")]
    Timeout(std::time::Duration),
}
