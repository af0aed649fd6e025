//! TLS sessions on rustls's unbuffered API, for the loopback TLS path.
//!
//! A buffered rustls session (`ServerConnection`, `ClientConnection`) keeps a 4 KiB receive
//! buffer for its whole life, in use or not: a loopback connection holds two sessions (the
//! client's, which the proxy terminates, and the upstream's, which it originates), and at rest
//! the two buffers were 8 of the 17.4 KiB such a connection held (docs/BENCHMARKS.md, "the
//! loopback RSS goal against what two rustls sessions hold"). An unbuffered session keeps
//! nothing of its own between calls: whoever drives it hands it the records it read and takes
//! the records it sealed. Here a connection thread drives the handshakes ([`stream`]), and the
//! relay loop, once established, serves every connection from its own buffers and keeps only
//! what one connection could not pass on yet (a partial record, or records its peer had no
//! room for).
//!
//! [`records`] holds the moves both drivers make; [`stream`] the connection thread's driver.

pub mod records;
pub mod stream;

pub use records::{feed, seal, seal_close_notify, tls_error, Fed, Out, Session};
pub use stream::Lean;
