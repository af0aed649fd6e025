//! The signer's protocol: small, typed and versioned. One JSON message per `SOCK_SEQPACKET`
//! datagram (the kernel keeps message boundaries, and a message is sent atomically, so threads
//! may send at once without a lock). Every request carries an id its reply repeats; the signer
//! speaks first, with [`Reply::Hello`] (or [`Reply::Failed`]) for the key it opened.
//!
//! Nothing in a request chooses which key the signer opens: that comes from the process that
//! started it, before any network input. Requests name keys only by the ids the signer gave.

use std::os::fd::{AsFd, BorrowedFd};

use rustix::net::{RecvFlags, SendFlags};
use serde::{Deserialize, Serialize};

use super::error::SignerError;
use crate::key::attestation::TpmEvidence;
use crate::key::{KeyAlgorithm, Purpose, SignScheme, SigningPath};

/// The protocol version; a signer and a network side of different versions refuse each other.
pub const VERSION: u32 = 1;

/// The largest message either side sends or accepts (a stored chain is the largest).
pub const MAX_MESSAGE: usize = 128 * 1024;

/// The id of the key the signer opened at start.
pub const FIRST_KEY: u32 = 0;

/// A request from the network side, with its id.
#[derive(Debug, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// Chosen by the sender of a request; repeated in its reply (0: the signer's greeting).
    pub id: u64,
    /// The message.
    pub body: T,
}

/// What the network side may ask.
#[allow(missing_docs, reason = "the fields are what their variant's doc names")]
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// A signature by key `key` for `purpose` (the signer checks the message's shape).
    Sign {
        key: u32,
        purpose: Purpose,
        scheme: SignScheme,
        #[serde(with = "b64")]
        message: Vec<u8>,
    },
    /// TPM2_Certify evidence for a request of the DER `subject` made at `made_at`: the signer
    /// checks the subject is its identity's and the time is now, and binds them itself.
    CertifyRequest {
        key: u32,
        ak_handle: u32,
        #[serde(with = "b64")]
        subject: Vec<u8>,
        made_at: u64,
    },
    /// The chain stored with key `key`.
    StoredChain { key: u32 },
    /// Key `key`'s PIV attestation (answered as a chain: attestation, f9), if its device has
    /// one.
    PivAttestation { key: u32 },
    /// Stores `chain` with key `key` (its leaf must be for that key).
    StoreChain {
        key: u32,
        #[serde(with = "b64_list")]
        chain: Vec<Vec<u8>>,
    },
    /// Creates the next key of the configured key's rotation series.
    CreateNext,
    /// Deletes key `key`: only a key of the rotation series, never the configured key nor the
    /// one in use.
    Destroy { key: u32 },
    /// Key `key` is the one in use from now on (after a rotation): the signer records it in
    /// the rotation pointer itself (only which key; never a password source).
    Use { key: u32 },
    /// Installs `chain` in the identity's certificate file (the configured `--cert`), keeping
    /// the previous content as `FILE.prev` when `keep_previous`: only a chain whose leaf is for
    /// key `key` and names the identity's subject. The network side cannot write that file.
    InstallCertificate {
        key: u32,
        #[serde(with = "b64_list")]
        chain: Vec<Vec<u8>>,
        keep_previous: bool,
    },
    /// What a watched file holds now, from byte `offset` (a reply holds at most
    /// [`WATCHED_CHUNK`] bytes; offset 0 reads the file anew, later offsets continue that read).
    ReadWatched {
        file: WatchedFile,
        #[serde(default)]
        offset: u64,
    },
}

/// The most of a watched file one reply carries: a system CA bundle (about 220 KiB) is over the
/// message limit whole.
pub const WATCHED_CHUNK: usize = 64 * 1024;

/// A file the network side reads again while it runs, read for it by the signer side: the
/// network side is confined away from the directories they live in (a home directory holds
/// `~/.ssh`, a CA's directory its key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchedFile {
    /// The identity's certificate file (`--cert`).
    Certificate,
    /// The upstream CA bundle (`--upstream-ca`).
    UpstreamCa,
}

/// What the signer answers.
#[allow(missing_docs, reason = "the fields are what their variant's doc names")]
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Reply {
    /// The greeting: the key the signer opened.
    Hello { version: u32, key: KeyInfo },
    /// The signer could not open its key; it exits with `exit_code` after this.
    Failed { error: RemoteError, exit_code: u8 },
    /// A signature.
    Signature {
        #[serde(with = "b64")]
        signature: Vec<u8>,
    },
    /// Certification evidence.
    Evidence { evidence: EvidenceWire },
    /// A stored chain, if any.
    Chain {
        #[serde(with = "b64_opt_list")]
        chain: Option<Vec<Vec<u8>>>,
    },
    /// Where a chain was stored.
    Stored { place: String },
    /// A key made for a rotation.
    Created { key: KeyInfo },
    /// What a deletion removed.
    Destroyed { removed: Vec<String> },
    /// Part of a watched file's content, and the whole file's length.
    File {
        #[serde(with = "b64")]
        bytes: Vec<u8>,
        total: u64,
    },
    /// Done (for [`Request::Use`]).
    Done,
    /// The request failed or was refused.
    Error { error: RemoteError },
}

/// A key as the network side knows it: public facts only.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeyInfo {
    /// The signer's name for it in requests.
    pub id: u32,
    /// Its URI without the PIN source.
    pub uri: String,
    /// Its algorithm.
    pub algorithm: KeyAlgorithm,
    /// Its DER SubjectPublicKeyInfo.
    #[serde(with = "b64")]
    pub spki: Vec<u8>,
    /// Its description for messages.
    pub describe: String,
    /// How it signs.
    pub signing_path: PathWire,
}

/// Why a request failed, in words, and whether it was refused for its purpose.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoteError {
    /// What kind of failure.
    pub kind: RemoteKind,
    /// The reason in words.
    pub message: String,
}

/// The kinds of failure the network side acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RemoteKind {
    /// The message does not have the shape of its purpose (or the key may not be touched).
    Refused,
    /// The device refused the PIN (or hwkey refused to present one it refused before).
    PinRefused,
    /// Anything else the device or the key layer reported.
    Failed,
}

/// [`SigningPath`] on the wire (its texts are static in-process).
#[allow(missing_docs, reason = "the fields are what their variant's doc names")]
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "path", rename_all = "snake_case")]
pub enum PathWire {
    Native,
    SoftwarePss { mechanism: String },
    Pkcs1Only { missing: String },
    Unusable { missing: String },
}

impl From<&SigningPath> for PathWire {
    fn from(path: &SigningPath) -> PathWire {
        match path {
            SigningPath::Native => PathWire::Native,
            SigningPath::SoftwarePss { mechanism } => PathWire::SoftwarePss {
                mechanism: (*mechanism).into(),
            },
            SigningPath::Pkcs1Only { missing } => PathWire::Pkcs1Only {
                missing: (*missing).into(),
            },
            SigningPath::Unusable { missing } => PathWire::Unusable {
                missing: (*missing).into(),
            },
        }
    }
}

impl PathWire {
    /// The signing path, its texts matched against the ones the backends use.
    pub fn to_path(&self) -> SigningPath {
        fn known(text: &str) -> &'static str {
            const TEXTS: &[&str] = &[
                "CKM_RSA_X_509",
                "TPM2_RSA_Decrypt",
                "CKM_RSA_PKCS_PSS and CKM_RSA_X_509",
                "CKM_RSA_PKCS_PSS, CKM_RSA_X_509 and CKM_RSA_PKCS",
            ];
            TEXTS
                .iter()
                .find(|t| **t == text)
                .copied()
                .unwrap_or("the device's RSA mechanisms")
        }
        match self {
            PathWire::Native => SigningPath::Native,
            PathWire::SoftwarePss { mechanism } => SigningPath::SoftwarePss {
                mechanism: known(mechanism),
            },
            PathWire::Pkcs1Only { missing } => SigningPath::Pkcs1Only {
                missing: known(missing),
            },
            PathWire::Unusable { missing } => SigningPath::Unusable {
                missing: known(missing),
            },
        }
    }
}

/// [`TpmEvidence`] on the wire.
#[allow(missing_docs, reason = "the fields are what their variant's doc names")]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvidenceWire {
    #[serde(with = "b64")]
    pub attest: Vec<u8>,
    #[serde(with = "b64")]
    pub signature: Vec<u8>,
    #[serde(with = "b64")]
    pub key_public: Vec<u8>,
    #[serde(with = "b64")]
    pub ak_public: Vec<u8>,
    pub made_at: Option<u64>,
    #[serde(with = "b64_opt")]
    pub ek_certificate: Option<Vec<u8>>,
}

impl From<TpmEvidence> for EvidenceWire {
    fn from(e: TpmEvidence) -> EvidenceWire {
        EvidenceWire {
            attest: e.attest,
            signature: e.signature,
            key_public: e.key_public,
            ak_public: e.ak_public,
            made_at: e.made_at,
            ek_certificate: e.ek_certificate,
        }
    }
}

impl From<EvidenceWire> for TpmEvidence {
    fn from(e: EvidenceWire) -> TpmEvidence {
        TpmEvidence {
            attest: e.attest,
            signature: e.signature,
            key_public: e.key_public,
            ak_public: e.ak_public,
            made_at: e.made_at,
            ek_certificate: e.ek_certificate,
        }
    }
}

/// Sends one message (one datagram).
pub fn send<T: Serialize>(fd: BorrowedFd<'_>, id: u64, body: &T) -> Result<(), SignerError> {
    // Wiped after sending: a configuration message holds a PIN when it is kept in memory.
    let bytes = zeroize::Zeroizing::new(
        serde_json::to_vec(&Envelope { id, body }).map_err(SignerError::Encode)?,
    );
    if bytes.len() > MAX_MESSAGE {
        return Err(SignerError::TooLarge { len: bytes.len() });
    }
    let sent = rustix::net::send(fd, &bytes, SendFlags::NOSIGNAL).map_err(SignerError::Send)?;
    if sent != bytes.len() {
        return Err(SignerError::TooLarge { len: bytes.len() });
    }
    Ok(())
}

/// Receives one message; `Ok(None)` when the other side has closed. A datagram over
/// [`MAX_MESSAGE`] or one that does not parse as `T` is an error (the connection is then
/// not trusted further by the caller).
pub fn recv<T: for<'de> Deserialize<'de>>(
    fd: impl AsFd,
) -> Result<Option<Envelope<T>>, SignerError> {
    // One system call per message, into this thread's buffer (wiped after each message): the
    // read is whole or nothing, so several threads may read one socket at once (each gets
    // whole datagrams), and a message costs one call, not a peek and a read.
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        if buf.len() < MAX_MESSAGE + 1 {
            buf.resize(MAX_MESSAGE + 1, 0);
        }
        let (len, full) = rustix::net::recv(fd.as_fd(), buf.as_mut_slice(), RecvFlags::TRUNC)
            .map_err(SignerError::Recv)?;
        let result = if full == 0 {
            // The other side closed (an empty datagram, which no side sends, counts as a close).
            Ok(None)
        } else if full > MAX_MESSAGE {
            Err(SignerError::TooLarge { len: full })
        } else {
            serde_json::from_slice(&buf[..len])
                .map(Some)
                .map_err(SignerError::Decode)
        };
        zeroize::Zeroize::zeroize(&mut buf[..len.min(MAX_MESSAGE + 1)]);
        result
    })
}

/// Bytes as standard base64 text.
mod b64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(serde::de::Error::custom)
    }
}

/// Optional bytes as base64 text or null.
mod b64_opt {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(b) => s.serialize_some(&base64::engine::general_purpose::STANDARD.encode(b)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|t| {
                base64::engine::general_purpose::STANDARD
                    .decode(t)
                    .map_err(serde::de::Error::custom)
            })
            .transpose()
    }
}

/// A list of byte strings as base64 texts.
mod b64_list {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(list: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(
            list.iter()
                .map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
        )
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<u8>>, D::Error> {
        Vec::<String>::deserialize(d)?
            .into_iter()
            .map(|t| {
                base64::engine::general_purpose::STANDARD
                    .decode(t)
                    .map_err(serde::de::Error::custom)
            })
            .collect()
    }
}

/// An optional list of byte strings.
pub(crate) mod b64_opt_list {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct List(#[serde(with = "super::b64_list")] Vec<Vec<u8>>);

    pub fn serialize<S: Serializer>(list: &Option<Vec<Vec<u8>>>, s: S) -> Result<S::Ok, S::Error> {
        list.as_ref().map(|l| List(l.clone())).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<Vec<u8>>>, D::Error> {
        Ok(Option::<List>::deserialize(d)?.map(|l| l.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_and_replies_round_trip_through_a_socket_pair() {
        let (a, b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .expect("socketpair");
        let request = Request::Sign {
            key: 0,
            purpose: Purpose::Handshake,
            scheme: SignScheme::EcdsaP256Sha256,
            message: vec![0, 1, 2, 255],
        };
        send(a.as_fd(), 7, &request).expect("send");
        let got: Envelope<Request> = recv(&b).expect("recv").expect("a message");
        assert_eq!(got.id, 7);
        assert!(matches!(got.body, Request::Sign { message, .. } if message == [0, 1, 2, 255]));
        drop(a);
        assert!(recv::<Request>(&b).expect("recv").is_none(), "closed");
    }

    #[test]
    fn an_oversized_datagram_is_refused() {
        let (a, b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .expect("socketpair");
        let big = vec![b'x'; MAX_MESSAGE + 10];
        rustix::net::send(a.as_fd(), &big, SendFlags::empty()).expect("send");
        assert!(matches!(
            recv::<Request>(&b),
            Err(SignerError::TooLarge { .. })
        ));
    }
}
