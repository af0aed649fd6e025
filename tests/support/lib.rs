//! Shared support for hwkey's integration tests and benchmarks: real SoftHSMv2 tokens, real
//! swtpm simulators, a test CA, real TLS servers (`openssl s_server`, nginx), a real
//! kube-apiserver, and the hwkey binary under test. No mocks.
//!
//! Every helper fails loudly (panics) when a tool is missing: a missing fixture is a broken
//! test machine, never a reason to skip. Every process is killed and reaped on Drop and every
//! temporary directory is removed.

pub mod bench;
pub mod ca;
pub mod flow;
pub mod forward_proxies;
#[cfg(target_arch = "x86_64")]
pub mod inject;
pub mod kube;
pub mod kubectl;
pub mod oracle;
pub mod piv;
pub mod ports;
pub mod process;
pub mod proxy;
pub mod relay;
pub mod requests;
pub mod servers;
pub mod session_limit;
pub mod softhsm;
pub mod strace;
pub mod swtpm;
pub mod terminal;
pub mod tools;
pub mod upstream;

pub use ca::*;
#[cfg(target_arch = "x86_64")]
pub use inject::*;
pub use ports::*;
pub use process::*;
pub use servers::*;
pub use softhsm::*;
pub use swtpm::*;
pub use tools::*;
