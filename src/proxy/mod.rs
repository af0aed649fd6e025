//! `hwkey proxy`: the TLS-offload proxy that lets vanilla kubectl and kubelet use a hardware
//! key. Local clients connect over loopback TLS or a UNIX socket; each connection is
//! re-originated to the API server over mTLS whose CertificateVerify is signed inside the
//! PKCS#11 token or TPM, then bytes are copied both ways (no HTTP parsing).
//!
//! A connection's path (one task per connection, on one of the connection threads of
//! [`threads`]: a single-worker runtime per core, so a request wakes no other thread):
//! 1. [`listener`]: accept; authenticate the local peer (loopback-CA client certificate, or
//!    the UNIX peer's uid) and pick the application protocol. A peer that fails stops here.
//! 2. [`upstream`]: TCP + TLS to the API server offering that protocol, resuming a TLS 1.3
//!    session when one is cached (no hardware signature), else a full handshake whose
//!    signature runs under `block_in_place` on the task's connection thread.
//! 3. [`bridge`]: copy both ways until both sides close (or the idle timeout).
//!
//! The components, each building itself (`build`) from its settings section and the handles of
//! [`parts`] it uses, ordered by [`start`]:
//! - [`settings`]: flags, environment and the config file, merged and checked once;
//! - [`upstream`]: the connector, holding the key in use, its chain and the certificate epoch;
//! - [`listener`] and [`bridge`]: the client connections;
//! - [`control`]: loopback credentials on the control socket;
//! - [`admin`]: `/healthz` and `/metrics`;
//! - [`reload`]: SIGHUP and file changes of the certificate and the CA bundle;
//! - [`renewal`]: renewal through the CSR API (`--renew`);
//! - [`lifetime`]: the stop causes and the drain.
//!
//! Errors: [`settings::SettingsError`] before anything runs, [`error::StartError`] when the
//! proxy cannot start or keep running, [`error::UpstreamError`] for one failed connection.

mod accept;
pub mod admin;
pub mod admission;
pub mod bind;
pub mod bridge;
pub mod buffers;
mod client_hello;
pub mod control;
pub mod cutoff;
mod endpoints;
pub mod error;
mod failure;
mod first_bytes;
pub mod idle;
pub mod lifetime;
pub mod limits;
pub mod listener;
mod loop_dial;
mod loop_spare;
pub mod metrics;
pub mod notify;
pub mod opened;
pub mod origin;
pub mod parts;
pub mod preconnect;
pub mod privileges;
pub mod ratelimit;
pub mod readahead;
pub mod relay;
pub mod relay_loop;
pub mod reload;
pub mod renewal;
pub mod rotation;
pub mod sandbox;
pub mod sandbox_plan;
pub mod sessions;
pub mod settings;
pub mod sockets;
pub mod spare;
pub mod start;
mod syscalls;
pub mod threads;
pub mod unbuffered;
pub mod unix_client;
mod unix_open;
pub mod upstream;
mod write_through;

pub use error::{StartError, UpstreamError};
pub use lifetime::StopReason;
pub use settings::{NetworkSideSettings, Settings, SettingsError, SettingsInput};
pub use start::run;
