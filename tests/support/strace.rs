//! Counting a process's system calls of one kind with `strace -c`: a signal of what the process
//! does per unit of work (for example thread wake-ups per request) that does not depend on the
//! machine's speed.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::tools::require_tool;

/// `strace -f -c -e trace=<call>` attached to every thread of a process until [`Strace::stop`].
pub struct Strace {
    child: Child,
    pid: u32,
    summary: PathBuf,
    call: String,
    _dir: TempDir,
}

impl Strace {
    /// Attaches to all threads of `pid` and returns once each is traced.
    pub fn attach(pid: u32, call: &str) -> Strace {
        Strace::start(pid, call, true)
    }

    /// [`Strace::attach`] keeping each call, for [`Strace::stop_by_thread`].
    pub fn attach_calls(pid: u32, call: &str) -> Strace {
        Strace::start(pid, call, false)
    }

    fn start(pid: u32, call: &str, summary_only: bool) -> Strace {
        require_tool("strace", "strace");
        let dir = tempfile::tempdir().expect("temp dir");
        let summary = dir.path().join("summary");
        let child = Command::new("strace")
            .args(["-f", "-qq"])
            .args(summary_only.then_some("-c"))
            .arg("-e")
            .arg(format!("trace={call}"))
            .arg("-o")
            .arg(&summary)
            .arg("-p")
            .arg(pid.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("strace starts");
        let deadline = Instant::now() + Duration::from_secs(10);
        while !all_threads_traced(pid) {
            assert!(Instant::now() < deadline, "strace did not attach to {pid}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Strace {
            child,
            pid,
            summary,
            call: call.to_string(),
            _dir: dir,
        }
    }

    /// Stops strace (SIGINT: it detaches from every thread and writes its output) and returns
    /// what it wrote: the summary, or each call for [`Strace::attach_calls`].
    fn detach(&mut self) -> String {
        let pid = i32::try_from(self.child.id()).expect("pid fits");
        // SAFETY: kill has no memory-safety preconditions; the pid is our own child.
        let rc = unsafe { libc::kill(pid, libc::SIGINT) };
        assert_eq!(rc, 0, "kill({pid}, SIGINT)");
        self.child.wait().expect("strace exits");
        std::fs::read_to_string(&self.summary).expect("strace output")
    }

    /// Detaches ([`Strace::attach_calls`]) and returns how many calls of each kind each thread
    /// made while attached, keyed by (thread name, call): the name is
    /// `/proc/PID/task/TID/comm`, read while the threads still run. Failed calls count too.
    pub fn stop_by_thread(self) -> std::collections::HashMap<(String, String), u64> {
        self.stop_by_thread_failed()
            .into_iter()
            .map(|(k, (calls, _))| (k, calls))
            .collect()
    }

    /// [`Strace::stop_by_thread`], each count with how many of those calls failed (`EAGAIN`
    /// included): (calls, failed).
    pub fn stop_by_thread_failed(
        mut self,
    ) -> std::collections::HashMap<(String, String), (u64, u64)> {
        let pid = self.pid;
        let name = |tid: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
                .map_or_else(|_| format!("gone thread {tid}"), |c| c.trim().to_string())
        };
        let text = self.detach();
        let mut by_thread = std::collections::HashMap::new();
        // "TID call(args) = result" (strace pads TID); "TID <... call resumed> ...) = result"
        // ends a call another thread's line interrupted (counted once, at its start; its
        // result is here), and "+++"/"---" lines are exits and signals.
        for line in text.lines() {
            let line = line.trim_start();
            let Some((tid, rest)) = line.split_once(' ') else {
                continue;
            };
            let rest = rest.trim_start();
            // The result is what follows the line's last " = " (a string argument may hold one).
            let failed = rest
                .rsplit_once(" = ")
                .is_some_and(|(_, result)| result.starts_with("-1 "));
            if let Some(resumed) = rest.strip_prefix("<... ") {
                if let Some((call, _)) = resumed.split_once(" resumed>") {
                    if failed {
                        by_thread
                            .entry((name(tid), call.to_string()))
                            .or_insert((0, 0))
                            .1 += 1;
                    }
                }
                continue;
            }
            let Some((call, _)) = rest.split_once('(') else {
                continue;
            };
            if rest.starts_with("+++") || rest.starts_with("---") {
                continue;
            }
            let entry = by_thread
                .entry((name(tid), call.to_string()))
                .or_insert((0, 0));
            entry.0 += 1;
            if failed {
                entry.1 += 1;
            }
        }
        by_thread
    }

    /// Detaches ([`Strace::attach_calls`]) and returns, per kind of call, how many returned at
    /// least `bytes`: the reads and writes that moved data, told apart from the wake-ups
    /// (eventfd's 8 bytes), small requests and `EAGAIN`s the same calls also make. A call
    /// another thread's line interrupted is counted where it resumes, with its result.
    pub fn stop_moving_at_least(mut self, bytes: i64) -> std::collections::HashMap<String, u64> {
        let text = self.detach();
        let mut counts = std::collections::HashMap::new();
        for line in text.lines() {
            let Some((_tid, rest)) = line.trim_start().split_once(' ') else {
                continue;
            };
            let rest = rest.trim_start();
            let call = match rest.strip_prefix("<... ") {
                Some(resumed) => resumed.split_once(" resumed>").map(|(call, _)| call),
                None if rest.ends_with("<unfinished ...>") => None,
                None => rest.split_once('(').map(|(call, _)| call),
            };
            let result = rest
                .rsplit_once(" = ")
                .and_then(|(_, r)| r.split_whitespace().next()?.parse::<i64>().ok());
            if let (Some(call), Some(result)) = (call, result) {
                if result >= bytes {
                    *counts.entry(call.to_string()).or_insert(0) += 1;
                }
            }
        }
        counts
    }

    /// Detaches and returns how many calls were made while attached (of every call named, when
    /// `call` names several, comma-separated).
    pub fn stop(self) -> u64 {
        self.stop_each().iter().map(|(_, n)| n).sum()
    }

    /// Detaches and returns how many calls of each kind named were made while attached (a
    /// kind not made is left out).
    pub fn stop_each(self) -> Vec<(String, u64)> {
        self.stop_counts()
            .into_iter()
            .map(|c| (c.call, c.calls))
            .collect()
    }

    /// Detaches and returns, for each kind named that was made while attached, how many calls
    /// there were and how many of them failed (`EAGAIN` included).
    pub fn stop_counts(mut self) -> Vec<Counted> {
        let text = self.detach();
        // "% time  seconds  usecs/call  calls  errors  syscall": calls is the 4th column, and
        // the errors column is empty when none failed.
        let names: Vec<&str> = self.call.split(',').collect();
        text.lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .filter(|f| f.len() >= 5 && f.last().is_some_and(|n| names.contains(n)))
            .map(|f| Counted {
                call: f.last().expect("a call name").to_string(),
                calls: f[3].parse::<u64>().expect("a call count"),
                errors: if f.len() >= 6 {
                    f[4].parse::<u64>().expect("an error count")
                } else {
                    0
                },
            })
            .collect()
    }
}

/// One kind of system call in a summary.
#[derive(Debug)]
pub struct Counted {
    /// Its name.
    pub call: String,
    /// How many were made.
    pub calls: u64,
    /// How many of them failed.
    pub errors: u64,
}

/// Whether every thread of `pid` has a tracer.
fn all_threads_traced(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.filter_map(Result::ok).all(|t| {
        std::fs::read_to_string(t.path().join("status")).is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("TracerPid:"))
                .is_some_and(|v| v.trim() != "0")
        })
    })
}
