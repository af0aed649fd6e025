//! The threads that carry the connections: one single-worker runtime per core, each connection
//! pinned to one of them for its whole life.
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
//! signature keeps running under `block_in_place` (the worker's other connections move to a
//! fresh thread meanwhile instead of waiting for the token).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Runtime;
use tokio::sync::mpsc;

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
}

/// What a connection thread runs: made there, so the task and its state are allocated by the
/// thread that uses them (the allocator's arena of that thread), not by the accepting one.
type Job = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

impl ConnectionThreads {
    /// `n` single-worker runtimes, their threads named `hwkey-proxy-conn`.
    pub fn new(n: usize) -> std::io::Result<ConnectionThreads> {
        let runtimes = (0..n.max(1))
            .map(|_| {
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
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
        };
        Ok(ConnectionThreads { runtimes, spawner })
    }

    /// A handle that places tasks on these threads (kept in the proxy's shared state).
    pub fn spawner(&self) -> Spawner {
        self.spawner.clone()
    }

    /// Stops the runtimes, giving their tasks at most `timeout` (the main runtime's drain
    /// has already waited for open connections).
    pub fn shutdown(self, timeout: Duration) {
        for r in self.runtimes {
            r.shutdown_timeout(timeout);
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
        let i = (0..self.loads.len())
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
        // A send fails only when the runtime has stopped; the job (and `done`) is dropped.
        let _ = self.inboxes[i].send(job);
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
