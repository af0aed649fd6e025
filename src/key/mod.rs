//! The hardware key layer: one abstraction over keys that live in a PKCS#11 token or a TPM 2.0.
//!
//! A [`Key`] knows its algorithm and public key and can sign; the private key never leaves the
//! device in any code path (keys are created sensitive and non-extractable, and no function here
//! reads private key material). Backends implement [`KeyBackend`]; the rustls and rcgen adapters
//! ([`tls`], [`rcgen_signer`]) sit on top and never the other way round.
//!
//! Concurrency: [`Key::sign`] is blocking and may be called from many threads at once. The
//! PKCS#11 backend runs concurrent signatures on a pool of sessions (one per signer at a time);
//! the TPM backend serialises them on the single thread that owns the TPM context. Async callers
//! must not call `sign` on a runtime worker without `block_in_place` (the rustls adapter does so).

pub mod algorithm;
pub mod attestation;
pub mod backend;
mod backends;
pub mod der;
mod error;
mod opened;
pub mod p11kit;
pub mod pin;
pub mod pin_memory;
#[cfg(feature = "pkcs11")]
pub mod pkcs11;
pub mod protection;
pub(crate) mod pss;
pub mod purpose;
pub mod rcgen_signer;
pub mod rotation;
pub mod signing_path;
pub mod tls;
#[cfg(feature = "tpm")]
pub mod tpm;
pub mod uri;
pub mod verify;

pub use algorithm::{HashAlg, KeyAlgorithm, SignScheme};
pub use backend::{KeyBackend, KeyListing, PivAttestationCerts, SessionStats};
pub use error::{
    CapabilityError, Cause, DeviceError, KeyError, LocateError, Malformation, ParentProblem,
    PinError, Tss2Problem, Unusable,
};
pub use opened::Key;
pub use protection::{KeyPolicy, Protection};
pub use purpose::{Purpose, HEALTH_CHECK_MESSAGE};
pub use signing_path::SigningPath;
pub use uri::{KeyUri, KeyUriParser, Pkcs11Uri, TpmKeyLocation, TpmUri};

pub use backends::{activate, delete, enroll, list, store_chain};
