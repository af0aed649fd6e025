//! The signer: the key in a process of its own, which signs only handshakes, requests for its
//! own identity and health checks.
//!
//! `hwkey proxy` parses its settings, then forks the [`supervisor`] while it still has one
//! thread and before it reads any network byte. The supervisor starts a signer process
//! ([`server`]) for each request of the network side: only a signer loads the PKCS#11 module or
//! the TSS libraries, reads the PIN source and holds sessions and the PIN memory. The network
//! side talks to its signer over a `socketpair` ([`protocol`]: typed, versioned, one JSON
//! message per datagram) through a [`remote`] key, which the proxy uses like any other
//! [`crate::key::Key`]. Each signature states its purpose and the signer checks the message
//! against it ([`policy`]); a compromised network side can make handshakes, never sign a CSR
//! for another name, a JWT or arbitrary data.

pub mod error;
pub mod policy;
pub mod protocol;
pub mod remote;
pub mod server;
pub mod supervisor;

pub use error::SignerError;
pub use remote::SignerClient;
pub use server::SignerConfig;
pub use supervisor::Supervisor;
