//! An error and its causes as one line, for messages and logs.
//!
//! thiserror's `Display` shows one level; TLS and HTTP errors hide the useful part (the alert,
//! the certificate problem) one or two `source()`s down. One helper so every layer prints them
//! alike.

/// `error: cause: cause …`, leaving out a cause whose text the line already holds (io errors
/// that wrap a rustls error print the same text twice otherwise).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        let t = inner.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        source = inner.source();
    }
    s
}
