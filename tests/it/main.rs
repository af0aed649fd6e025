//! hwkey's integration tests: one test binary (linking the library, the fixtures and the test
//! code once instead of once per file), one room per part of hwkey — `key`, `proxy` (with
//! `proxy::stress`), `exec`, `lifecycle`, `approver` and `shipping` — so a test's path says what
//! it tests (`cargo test --test it proxy::stress::`).
//!
//! Each test drives real parts: SoftHSMv2 tokens, swtpm simulators, openssl, curl, nginx,
//! kubectl and a real kube-apiserver; fixtures come from the `hwkey-test-support` crate
//! (imported as `support`). Modules that need a backend are compiled only with its Cargo
//! feature, so `--no-default-features --features pkcs11` (or `tpm`) runs that build's tests.

#[cfg(feature = "tpm")]
mod approver;
mod cloexec;
mod exec;
mod fixtures;
mod key;
mod lifecycle;
mod proxy;
mod shipping;
