//! System calls made inside a running process, as an attacker who took it over would make them:
//! its seccomp filter, Landlock domain and capabilities apply to each.
//!
//! The test attaches with ptrace, points the process's main thread at a `syscall` instruction
//! of its own libc with the call's registers, steps over that one instruction, reads the result
//! and puts every register back. Only the general registers are read and written: gdb's calls
//! into the process (what this replaces) write the whole XSAVE area back, which fails on CPUs
//! with AMX (`Couldn't write extended state status: Bad address`, gdb 13).

use std::ffi::CString;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// One call, named as libc names it; made as the system call libc makes for it.
#[derive(Debug, Clone)]
pub enum Call {
    /// `open(path, flags)` (`openat(AT_FDCWD, ..)`).
    Open(PathBuf, i32),
    /// `mknod(path, mode, dev)` (`mknodat`).
    Mknod(PathBuf, u32, u64),
    /// `socket(domain, type, protocol)`.
    Socket(i32, i32, i32),
    /// `symlink(target, link)` (`symlinkat`).
    Symlink(PathBuf, PathBuf),
    /// `chmod(path, mode)` (`fchmodat`).
    Chmod(PathBuf, u32),
}

/// What each of `calls` returns inside the running process `pid` (its main thread), made one
/// after the other: the file descriptor or 0 on success, -1 on failure, as libc returns them.
/// x86_64 only (its registers and system call numbers).
pub fn calls_inside(pid: u32, calls: &[Call]) -> Vec<i64> {
    let mut tracee = Tracee::attach(pid as libc::pid_t);
    let saved = tracee.regs();
    // Put back when the tracee is let go, whatever happens in between.
    tracee.saved = Some(saved);
    let gadget = syscall_instruction(pid);
    let mem = File::options()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/mem"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/mem: {e}"));
    // Strings go well below the stack pointer (past the red zone), inside the stack's mapping.
    let scratch = (saved.rsp - 16 * 1024) & !0xf;
    assert!(
        mapped(pid, scratch),
        "no stack mapped 16 KiB below the stack pointer of {pid}"
    );
    let results = calls
        .iter()
        .map(|call| {
            let (nr, args) = call.registers(&mem, scratch);
            let mut regs = saved;
            regs.rip = gadget;
            regs.rax = nr;
            // No restart of the system call the thread was stopped in.
            regs.orig_rax = u64::MAX;
            [regs.rdi, regs.rsi, regs.rdx, regs.r10] = args;
            tracee.set_regs(&regs);
            tracee.step();
            let after = tracee.regs();
            assert_eq!(
                after.rip,
                gadget + 2,
                "the step did not run the call {call:?}"
            );
            let ret = after.rax as i64;
            if ret < 0 {
                -1
            } else {
                ret
            }
        })
        .collect();
    drop(tracee);
    results
}

impl Call {
    /// The system call's number and its first four arguments, strings written at `scratch`.
    fn registers(&self, mem: &File, scratch: u64) -> (u64, [u64; 4]) {
        const AT_FDCWD: u64 = -100i64 as u64;
        let put = |at: u64, path: &Path| -> u64 {
            let text = CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
            mem.write_all_at(text.as_bytes_with_nul(), at)
                .expect("write a string into the process");
            at
        };
        match self {
            Call::Open(path, flags) => (
                libc::SYS_openat as u64,
                [AT_FDCWD, put(scratch, path), *flags as u64, 0],
            ),
            Call::Mknod(path, mode, dev) => (
                libc::SYS_mknodat as u64,
                [AT_FDCWD, put(scratch, path), u64::from(*mode), *dev],
            ),
            Call::Socket(domain, kind, protocol) => (
                libc::SYS_socket as u64,
                [*domain as u64, *kind as u64, *protocol as u64, 0],
            ),
            Call::Symlink(target, link) => (
                libc::SYS_symlinkat as u64,
                [put(scratch, target), AT_FDCWD, put(scratch + 4096, link), 0],
            ),
            Call::Chmod(path, mode) => (
                libc::SYS_fchmodat as u64,
                [AT_FDCWD, put(scratch, path), u64::from(*mode), 0],
            ),
        }
    }
}

/// A thread held under ptrace. When dropped: its registers put back (`saved`), and detached
/// with the signal that stopped it meanwhile, if one did, so that signal is still delivered.
struct Tracee {
    pid: libc::pid_t,
    saved: Option<libc::user_regs_struct>,
    signal: libc::c_int,
}

impl Tracee {
    fn attach(pid: libc::pid_t) -> Tracee {
        // SAFETY: ptrace requests on a pid with no pointers; waitpid with a valid status pointer.
        unsafe {
            let null = std::ptr::null_mut::<libc::c_void>();
            if libc::ptrace(libc::PTRACE_SEIZE, pid, null, null) != 0 {
                panic!("ptrace(SEIZE, {pid}): {}", std::io::Error::last_os_error());
            }
            let tracee = Tracee {
                pid,
                saved: None,
                signal: 0,
            };
            if libc::ptrace(libc::PTRACE_INTERRUPT, pid, null, null) != 0 {
                panic!(
                    "ptrace(INTERRUPT, {pid}): {}",
                    std::io::Error::last_os_error()
                );
            }
            tracee.wait_stop();
            tracee
        }
    }

    /// Waits for the next stop; returns its wait status.
    fn wait_stop(&self) -> libc::c_int {
        let mut status = 0;
        // SAFETY: a valid pointer to status.
        let got = unsafe { libc::waitpid(self.pid, &mut status, libc::__WALL) };
        assert_eq!(
            got,
            self.pid,
            "waitpid: {}",
            std::io::Error::last_os_error()
        );
        assert!(
            libc::WIFSTOPPED(status),
            "process {} did not stop (status {status:#x}): did a call kill it?",
            self.pid
        );
        status
    }

    fn regs(&self) -> libc::user_regs_struct {
        // SAFETY: all-zero is a valid user_regs_struct; GETREGS fills it.
        unsafe {
            let mut regs: libc::user_regs_struct = std::mem::zeroed();
            let at = (&mut regs as *mut libc::user_regs_struct).cast::<libc::c_void>();
            if libc::ptrace(
                libc::PTRACE_GETREGS,
                self.pid,
                std::ptr::null_mut::<libc::c_void>(),
                at,
            ) != 0
            {
                panic!("ptrace(GETREGS): {}", std::io::Error::last_os_error());
            }
            regs
        }
    }

    fn set_regs(&self, regs: &libc::user_regs_struct) {
        if let Err(e) = self.try_set_regs(regs) {
            panic!("ptrace(SETREGS): {e}");
        }
    }

    fn try_set_regs(&self, regs: &libc::user_regs_struct) -> std::io::Result<()> {
        let at = (regs as *const libc::user_regs_struct)
            .cast_mut()
            .cast::<libc::c_void>();
        let null = std::ptr::null_mut::<libc::c_void>();
        // SAFETY: SETREGS reads a whole user_regs_struct from the pointer.
        match unsafe { libc::ptrace(libc::PTRACE_SETREGS, self.pid, null, at) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    }

    /// One instruction. A signal that stops the thread first (the instruction has not run:
    /// no restart either, `orig_rax` is -1) is kept for the detach, and the step made again.
    fn step(&mut self) {
        let null = std::ptr::null_mut::<libc::c_void>();
        loop {
            // SAFETY: no pointers.
            if unsafe { libc::ptrace(libc::PTRACE_SINGLESTEP, self.pid, null, null) } != 0 {
                panic!("ptrace(SINGLESTEP): {}", std::io::Error::last_os_error());
            }
            let status = self.wait_stop();
            let signal = libc::WSTOPSIG(status);
            if signal == libc::SIGTRAP && status >> 16 == 0 {
                return;
            }
            if status >> 16 == 0 {
                self.signal = signal;
            }
        }
    }
}

impl Drop for Tracee {
    fn drop(&mut self) {
        // No panic here: this may run while a failed call unwinds.
        if let Some(saved) = self.saved.take() {
            let _ = self.try_set_regs(&saved);
        }
        let null = std::ptr::null_mut::<libc::c_void>();
        // SAFETY: no pointers; the data argument is a signal number.
        unsafe {
            libc::ptrace(
                libc::PTRACE_DETACH,
                self.pid,
                null,
                self.signal as usize as *mut libc::c_void,
            )
        };
    }
}

/// The address of a `syscall` instruction (0f 05) in the process's libc code.
fn syscall_instruction(pid: u32) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mem = File::open(format!("/proc/{pid}/mem")).expect("mem");
    for line in maps.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let libc = fields
            .get(5)
            .is_some_and(|f| f.contains("/libc.so") || f.contains("/libc-"));
        if fields.len() < 6 || fields[1] != "r-xp" || !libc {
            continue;
        }
        let (start, end) = fields[0].split_once('-').expect("a range");
        let start = u64::from_str_radix(start, 16).expect("hex");
        let end = u64::from_str_radix(end, 16).expect("hex");
        let mut code = vec![0; (end - start) as usize];
        mem.read_exact_at(&mut code, start)
            .expect("read libc's code");
        if let Some(at) = code.windows(2).position(|w| w == [0x0f, 0x05]) {
            return start + at as u64;
        }
    }
    panic!("no syscall instruction in the libc of {pid}")
}

/// Whether `addr` lies in a writable mapping of the process.
fn mapped(pid: u32, addr: u64) -> bool {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    maps.lines().any(|line| {
        let mut fields = line.split_whitespace();
        let (Some(range), Some(perms)) = (fields.next(), fields.next()) else {
            return false;
        };
        let Some((start, end)) = range.split_once('-') else {
            return false;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        else {
            return false;
        };
        perms.starts_with("rw") && start <= addr && addr + 8192 <= end
    })
}
