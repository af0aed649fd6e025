//! The threads that carry the connections: one single-worker runtime per core, each connection
//! on one of them for its whole life.
//!
//! On one multi-thread runtime a keep-alive request woke two threads: the worker whose epoll
//! call saw the client's bytes found more ready tasks than it could run at once and woke a
//! parked worker to steal some (a futex wake, 0.36 per request on 8 connections), and a
//! connection's task moved between workers from one request to the next. Each wake-up is a
//! cross-CPU interrupt; on a virtual machine, an exit to the hypervisor. Here a connection's
//! task is spawned on the least-loaded of N single-worker runtimes (N = the cores), and a
//! single-worker runtime has nobody to steal from it: a request costs its two hops' system
//! calls and no thread wake-up of the proxy's own (the benchmark measured 13.9–16.4 µs of
//! proxy CPU per request before, 12.5–12.7 after; docs/BENCHMARKS.md).
//!
//! A runtime with one worker is still a multi-thread runtime, so a handshake's hardware
//! signature keeps running under `block_in_place`: the runtime's other connections move on to a
//! fresh thread meanwhile instead of waiting for the token (so "one thread" means one at a
//! time, never two at once). Its blocking pool is the process's old one divided among the
//! runtimes, so a stalled token cannot hold more threads than before.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Runtime;
use tokio::sync::mpsc;

/// The blocking threads of the whole proxy before the split (tokio's default), now shared out
/// among the connection runtimes: a stalled token or TPM blocks one thread per waiting
/// handshake, and that must not multiply with the cores.
const BLOCKING_THREADS: usize = 512;

/// Descriptors each runtime holds (its epoll, its waker's eventfd, the signal pipe's copy, and
/// one to spare), for the descriptor budget of [`super::limits`].
pub const DESCRIPTORS_PER_RUNTIME: usize = 4;

/// The connection runtimes; dropped (or [`ConnectionThreads::shutdown`]) after the proxy's
/// main runtime has drained.
pub struct ConnectionThreads {
    runtimes: Vec<Runtime>,
    spawner: Spawner,
}

/// Places connection tasks on the connection threads; cheap to clone.
#[derive(Clone)]
pub struct Spawner {
    /// Each runtime's inbox: its own task spawns what arrives there.
    inboxes: Arc<[mpsc::UnboundedSender<Job>]>,
    /// Live connection tasks per runtime, for placing the next one.
    loads: Arc<[AtomicUsize]>,
    /// Where the search for the least-loaded runtime starts: ties rotate instead of always
    /// going to the first runtime.
    next: Arc<AtomicUsize>,
}

/// What a connection thread runs: made there, so the task and its state are allocated by the
/// thread that uses them (the allocator's arena of that thread), not by the accepting one.
type Job = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

impl ConnectionThreads {
    /// `n` single-worker runtimes, their threads named `hwkey-proxy-conn`.
    pub fn new(n: usize) -> std::io::Result<ConnectionThreads> {
        let n = n.max(1);
        let runtimes = (0..n)
            .map(|_| {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .max_blocking_threads((BLOCKING_THREADS / n).max(8))
                    .thread_name("hwkey-proxy-conn")
                    .enable_all()
                    .build()
            })
            .collect::<std::io::Result<Vec<Runtime>>>()?;
        let inboxes = runtimes
            .iter()
            .map(|r| {
                let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
                r.spawn(async move {
                    while let Some(job) = rx.recv().await {
                        tokio::spawn(job());
                    }
                });
                tx
            })
            .collect();
        let spawner = Spawner {
            inboxes,
            loads: runtimes.iter().map(|_| AtomicUsize::new(0)).collect(),
            next: Arc::new(AtomicUsize::new(0)),
        };
        Ok(ConnectionThreads { runtimes, spawner })
    }

    /// A handle that places tasks on these threads (kept in the proxy's shared state).
    pub fn spawner(&self) -> Spawner {
        self.spawner.clone()
    }

    /// Stops the runtimes, giving them together at most `timeout` (the main runtime's drain
    /// has already waited for open connections): one deadline for all, so a thread stuck in a
    /// stalled token's call cannot make the exit take `timeout` once per core.
    pub fn shutdown(self, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        for r in self.runtimes {
            r.shutdown_timeout(deadline.saturating_duration_since(std::time::Instant::now()));
        }
    }
}

impl Spawner {
    /// Runs the task `make` returns on the connection thread with the fewest live
    /// connections; `make` runs there too. Dropped unrun if the runtimes are shutting down.
    pub fn spawn<F, T>(&self, make: F)
    where
        F: FnOnce() -> T + Send + 'static,
        T: Future<Output = ()> + Send + 'static,
    {
        let n = self.loads.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let i = (0..n)
            .map(|k| (start + k) % n)
            .min_by_key(|&i| self.loads[i].load(Ordering::Relaxed))
            .unwrap_or(0);
        self.loads[i].fetch_add(1, Ordering::Relaxed);
        let done = Done {
            loads: self.loads.clone(),
            i,
        };
        let job: Job = Box::new(move || {
            Box::pin(async move {
                let _done = done;
                make().await
            })
        });
        // A send fails only once the runtime has stopped (the proxy is exiting): the job, its
        // socket and `done` are dropped, closing the connection.
        if self.inboxes[i].send(job).is_err() {
            tracing::warn!(
                thread = i,
                "a connection arrived while its thread was stopping; closed"
            );
        }
    }

    /// How many connection runtimes there are.
    pub fn threads(&self) -> usize {
        self.loads.len()
    }

    /// Live connection tasks per connection thread.
    pub fn loads(&self) -> Vec<usize> {
        self.loads
            .iter()
            .map(|l| l.load(Ordering::Relaxed))
            .collect()
    }
}

/// Counts a connection task out when it ends, however it ends (completed or cancelled at
/// shutdown).
struct Done {
    loads: Arc<[AtomicUsize]>,
    i: usize,
}

impl Drop for Done {
    fn drop(&mut self) {
        self.loads[self.i].fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tasks go to the least-loaded thread and are counted out when they end; each runtime
    /// runs its tasks on one thread.
    #[test]
    fn tasks_go_to_the_least_loaded_thread_and_stay_on_it() {
        let threads = ConnectionThreads::new(2).unwrap();
        let s = threads.spawner();
        let (release_tx, release_rx) = tokio::sync::watch::channel(false);
        let (ids_tx, ids_rx) = std::sync::mpsc::channel();
        for _ in 0..4 {
            let mut release = release_rx.clone();
            let ids = ids_tx.clone();
            s.spawn(move || async move {
                let first = std::thread::current().id();
                release.wait_for(|r| *r).await.unwrap();
                tokio::task::yield_now().await;
                ids.send((first, std::thread::current().id())).unwrap();
            });
        }
        assert_eq!(s.loads(), vec![2, 2]);
        release_tx.send(true).unwrap();
        let ids: Vec<_> = (0..4).map(|_| ids_rx.recv().unwrap()).collect();
        for (first, last) in &ids {
            assert_eq!(first, last, "a task moved to another thread");
        }
        let distinct: std::collections::HashSet<_> = ids.iter().map(|(a, _)| a).collect();
        assert_eq!(distinct.len(), 2, "both threads took tasks");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while s.loads() != vec![0, 0] {
            assert!(std::time::Instant::now() < deadline, "{:?}", s.loads());
            std::thread::sleep(Duration::from_millis(5));
        }
        threads.shutdown(Duration::from_secs(1));
    }
}
