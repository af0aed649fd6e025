//! Whether the API server keeps `spec.expirationSeconds` (1.22 and later), which decides if a
//! person's request must ask for a lifetime within `--people-max-lifetime`.
//!
//! Learned at start and read again every [`RELEARN`] while the approver runs: an in-place
//! upgrade of the API server from 1.21 to 1.22 or later turns lifetime checks on within that
//! period, without a restart (learned once, they stayed off until one). A reading that fails
//! keeps the previous answer: an outage of `/version` neither turns the checks off nor denies
//! every request for a missing lifetime (a denial is final).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often the API server's version is read again.
pub const RELEARN: Duration = Duration::from_secs(10);

/// The shared answer: cloned into the rules, updated by [`follow`].
#[derive(Debug, Clone)]
pub struct LifetimeSupport(Arc<AtomicBool>);

impl LifetimeSupport {
    /// An answer that starts as `known` (true, the strict answer, until a reading says
    /// otherwise).
    pub fn new(known: bool) -> LifetimeSupport {
        LifetimeSupport(Arc::new(AtomicBool::new(known)))
    }

    /// Whether the API server keeps `spec.expirationSeconds`, as last read.
    pub fn known(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, known: bool) -> bool {
        self.0.swap(known, Ordering::Relaxed)
    }
}

/// Whether a server of this version keeps `spec.expirationSeconds`. A minor version is read
/// as its leading digits (`22+` on some distributions).
pub fn keeps_expiration(major: &str, minor: &str) -> bool {
    let digits: String = minor.chars().take_while(char::is_ascii_digit).collect();
    let minor: u32 = digits.parse().unwrap_or(0);
    major != "1" || minor >= 22
}

/// Reads the API server's version once and updates `support`, saying so in the log when the
/// answer changes (or, at `first`, when lifetimes go unchecked). A failed reading keeps the
/// previous answer.
pub async fn learn(client: &kube::Client, support: &LifetimeSupport, first: bool) {
    match client.apiserver_version().await {
        Ok(info) => {
            let known = keeps_expiration(&info.major, &info.minor);
            let before = support.set(known);
            if !known && (first || before) {
                tracing::warn!(server = %info.git_version, "this API server ignores spec.expirationSeconds: a person's certificate lives for kube-controller-manager's --cluster-signing-duration, not --people-max-lifetime");
            } else if known && !before {
                tracing::info!(server = %info.git_version, "this API server keeps spec.expirationSeconds now: people's requests must ask for a lifetime of at most --people-max-lifetime");
            }
        }
        Err(e) if first => {
            tracing::warn!(error = %e, "cannot read the API server's version: people's requests must ask for a lifetime (spec.expirationSeconds)");
        }
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the API server's version again; the last answer stands");
        }
    }
}

/// Reads the version again every `every`, for as long as the task runs.
pub async fn follow(client: kube::Client, support: LifetimeSupport, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        learn(&client, &support, false).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn versions_from_1_22_keep_the_expiration() {
        for (major, minor, keeps) in [
            ("1", "20", false),
            ("1", "21+", false),
            ("1", "22", true),
            ("1", "32+", true),
            ("2", "0", true),
            ("1", "", false),
        ] {
            assert_eq!(keeps_expiration(major, minor), keeps, "{major}.{minor}");
        }
    }

    /// An API server's `/version` on loopback whose minor version is read from `minor` at
    /// each request; `fail` makes it answer 500; `served` counts the answers.
    async fn version_server(
        minor: Arc<AtomicU32>,
        fail: Arc<AtomicBool>,
        served: Arc<AtomicU32>,
    ) -> String {
        use http_body_util::Full;
        use hyper::body::Bytes;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                let (minor, fail, served) = (minor.clone(), fail.clone(), served.clone());
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |_req| {
                        served.fetch_add(1, Ordering::SeqCst);
                        let m = minor.load(Ordering::Relaxed);
                        let body = format!(
                            r#"{{"major":"1","minor":"{m}","gitVersion":"v1.{m}.0","gitCommit":"x","gitTreeState":"clean","buildDate":"2020-01-01T00:00:00Z","goVersion":"go1.19","compiler":"gc","platform":"linux/amd64"}}"#
                        );
                        let mut response = hyper::Response::new(Full::new(Bytes::from(body)));
                        if fail.load(Ordering::Relaxed) {
                            *response.status_mut() = hyper::StatusCode::INTERNAL_SERVER_ERROR;
                        }
                        async move { Ok::<_, std::convert::Infallible>(response) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(conn), service)
                        .await;
                });
            }
        });
        url
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upgrade_in_place_turns_lifetime_checks_on_without_a_restart() {
        let (minor, fail, served) = (
            Arc::new(AtomicU32::new(20)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU32::new(0)),
        );
        let url = version_server(minor.clone(), fail.clone(), served.clone()).await;
        let config = kube::Config::new(url.parse().expect("URL"));
        let client = kube::Client::try_from(config).expect("client");
        let support = LifetimeSupport::new(true);
        learn(&client, &support, true).await;
        assert!(!support.known(), "1.20 keeps no spec.expirationSeconds");
        let follower = tokio::spawn(follow(
            client.clone(),
            support.clone(),
            Duration::from_millis(50),
        ));
        // A failing /version keeps the last answer: three failed readings (counted by the
        // server, whatever the machine's speed) leave it as it was.
        fail.store(true, Ordering::SeqCst);
        let failing_from = served.load(Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while served.load(Ordering::SeqCst) < failing_from + 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the version is not read again"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!support.known(), "a failed reading changed the answer");
        fail.store(false, Ordering::Relaxed);
        minor.store(22, Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !support.known() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the upgrade to 1.22 was never learned"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        follower.abort();
    }
}
