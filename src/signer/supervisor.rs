//! The signer's supervisor: a small process started before the network side reads any byte,
//! holding the signer's configuration, which starts a signer whenever the network side asks
//! (at start, and after a signer died) and hands back a socket to it.
//!
//! Why a separate process: the network side is confined (no `execve`, and nothing it says can
//! choose a key), yet a signer killed by a crashing module must come back without a restart of
//! the service. The supervisor gets its configuration once, from the process that started it
//! before any network input; afterwards the network side can only say "a signer, please" and
//! receive a socket (`SCM_RIGHTS`). Each process of the signer side runs this same executable
//! (`hwkey signer-supervisor`, `hwkey signer`) with its socket as standard input and its
//! configuration as the first message on it, and ends when that socket closes: when the
//! network side exits, the whole signer side does.

use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

use super::config::{SignerConfig, SignerConfigWire};
use super::error::SignerError;
use super::protocol;
use super::server;

/// The hidden subcommand that runs the supervisor.
pub const SUPERVISOR_COMMAND: &str = "signer-supervisor";
/// The hidden subcommand that runs a signer.
pub const SIGNER_COMMAND: &str = "signer";

/// The network side's handle on its signer supervisor.
#[derive(Debug)]
pub struct Supervisor {
    control: Option<OwnedFd>,
    child: Option<std::process::Child>,
}

impl Supervisor {
    /// Starts the supervisor (this executable, `hwkey signer-supervisor`) with `config`.
    /// The identity's certificate is read here, once, before any network input
    /// ([`SignerConfig::load_identity`]).
    pub fn start(config: &SignerConfig) -> Result<Supervisor, SignerError> {
        Supervisor::start_with(config, None::<&()>)
    }

    /// Like [`Supervisor::start`], leaving `for_holder` as the first message on the control
    /// socket, for the process that holds it next ([`Supervisor::from_stdin_with`]): how the
    /// network side receives its settings from `hwkey proxy` across `exec`, without argv, the
    /// environment or a file.
    pub fn start_with<T: serde::Serialize>(
        config: &SignerConfig,
        for_holder: Option<&T>,
    ) -> Result<Supervisor, SignerError> {
        let mut config = config.clone();
        config.load_identity().map_err(SignerError::Identity)?;
        let (ours, theirs) = socket_pair()?;
        if let Some(message) = for_holder {
            // Queued at our end before the supervisor exists: nothing can come before it.
            protocol::send(theirs.as_fd(), 0, message)?;
        }
        let child = spawn(SUPERVISOR_COMMAND, theirs)?;
        protocol::send(ours.as_fd(), 0, &SignerConfigWire::from(&config))?;
        Ok(Supervisor {
            control: Some(ours),
            child: Some(child),
        })
    }

    /// The supervisor started by the process this one replaced (`hwkey proxy` before it became
    /// `hwkey-net`): its socket is standard input.
    pub fn from_stdin() -> Result<Supervisor, SignerError> {
        Ok(Supervisor {
            control: Some(stdin_socket()?),
            child: None,
        })
    }

    /// [`Supervisor::from_stdin`], with the message the starting process left for this one
    /// ([`Supervisor::start_with`]).
    pub fn from_stdin_with<T: for<'de> serde::Deserialize<'de>>(
    ) -> Result<(Supervisor, T), SignerError> {
        let supervisor = Supervisor::from_stdin()?;
        let message = protocol::recv::<T>(supervisor.control()?)?.ok_or(SignerError::Gone {
            why: Some("the process that started this one left no settings".into()),
        })?;
        Ok((supervisor, message.body))
    }

    /// The socket to the supervisor, for a process that replaces this one (`exec`): the
    /// supervisor stays, serving whatever runs next with this socket.
    pub fn into_control(mut self) -> Option<OwnedFd> {
        self.child = None;
        self.control.take()
    }

    fn control(&self) -> Result<std::os::fd::BorrowedFd<'_>, SignerError> {
        self.control
            .as_ref()
            .map(|c| c.as_fd())
            .ok_or(SignerError::Gone { why: None })
    }

    /// Resolves when the supervisor is gone (its socket hung up), with the reason in words; the
    /// exited supervisor is reaped. A network side without a supervisor can never get a
    /// signer again: the proxy stops, so a service manager starts a whole new one, instead of
    /// answering every request with an error and leaving a zombie behind.
    pub fn gone(&self) -> Result<tokio::sync::oneshot::Receiver<String>, SignerError> {
        let watched =
            self.control()?
                .try_clone_to_owned()
                .map_err(|source| SignerError::Start {
                    what: "watching the signer supervisor",
                    source,
                })?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("hwkey-supervisor-watch".into())
            .spawn(move || {
                let why = wait_for_hangup(&watched);
                drop(watched);
                // The supervisor is this process's only child (the network side starts none).
                while let Ok(Some(_)) =
                    rustix::process::waitpid(None, rustix::process::WaitOptions::NOHANG)
                {
                }
                let _ = tx.send(why);
            })
            .map_err(|source| SignerError::Start {
                what: "watching the signer supervisor",
                source,
            })?;
        Ok(rx)
    }

    /// Asks for a new signer; returns the socket to it (its greeting comes first).
    pub fn spawn_signer(&self) -> Result<OwnedFd, SignerError> {
        let control = self.control()?;
        rustix::net::send(control, b"s", SendFlags::NOSIGNAL).map_err(SignerError::Send)?;
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut ancillary = RecvAncillaryBuffer::new(&mut space);
        let mut byte = [0u8; 1];
        let got = rustix::net::recvmsg(
            control,
            &mut [std::io::IoSliceMut::new(&mut byte)],
            &mut ancillary,
            RecvFlags::CMSG_CLOEXEC,
        )
        .map_err(SignerError::Recv)?;
        if got.bytes == 0 {
            return Err(SignerError::Gone {
                why: Some("the signer supervisor exited".into()),
            });
        }
        if byte == PIN_UNCHANGED {
            return Err(SignerError::PinUnchanged);
        }
        for message in ancillary.drain() {
            if let RecvAncillaryMessage::ScmRights(mut fds) = message {
                if let Some(fd) = fds.next() {
                    return Ok(fd);
                }
            }
        }
        Err(SignerError::Unexpected("no socket from the supervisor"))
    }
}

/// Blocks until `socket`'s peer hangs up (no event asked for: only a hang-up or an error wakes
/// it, never the supervisor's answers).
fn wait_for_hangup(socket: &OwnedFd) -> String {
    use rustix::event::{poll, PollFd, PollFlags};
    loop {
        let mut fds = [PollFd::new(socket, PollFlags::empty())];
        match poll(&mut fds, None) {
            Ok(_) => {
                let got = fds[0].revents();
                if got.intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL) {
                    return "the signer supervisor exited (killed?): no signer can be started"
                        .into();
                }
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return format!("cannot watch the signer supervisor: {e}"),
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // Closing the control socket ends the supervisor (once its signers' sockets close too);
        // it is reaped if it is already gone, never waited for: a stop must not hang on it.
        if let Some(control) = &self.control {
            let _ = rustix::net::shutdown(control.as_fd(), rustix::net::Shutdown::Both);
        }
        if let Some(child) = &mut self.child {
            let _ = child.try_wait();
        }
    }
}

/// `hwkey signer-supervisor`: reads its configuration from standard input (a socket), then
/// starts a signer per request until the socket closes. Returns the exit code.
///
/// - **One live signer**: a new one replaces the previous (killed if it still runs), and
///   starts come no faster than a backoff allows (200 ms doubling to 5 s, reset by a signer
///   that lived a minute): a network side asking in a loop gets one signer, not hundreds.
/// - **A refused PIN is not presented again unchanged**: a signer whose PIN the device refused
///   says so on its standard output (before the network side hears of it); the next request is
///   answered "unchanged" without a signer while the PIN source holds what was refused, and
///   tried once more after it changed. A network side cannot burn the device's PIN tries.
/// - **Signers run from the binary the supervisor was started from**, opened at start and
///   executed by descriptor: a package upgrade that replaces the file on disk never leaves the
///   proxy without a signer.
pub fn supervisor_main() -> u8 {
    crate::key::pin::protect_process();
    let started = stdin_socket().and_then(|control| {
        let mut config = read_config(&control)?;
        config.load_identity().map_err(SignerError::Identity)?;
        let binary = open_executable()?;
        Ok((control, config, binary))
    });
    let (control, config, binary) = match started {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hwkey signer-supervisor: {e}");
            return 2;
        }
    };
    let mut state = SupervisorState::new(binary);
    let mut byte = [0u8; 1];
    while let Ok((1, _)) = rustix::net::recv(control.as_fd(), &mut byte, RecvFlags::empty()) {
        let answer = state.next_signer(&config);
        let sent = match answer {
            Ok(Some(socket)) => send_socket(&control, socket),
            Ok(None) => rustix::net::send(control.as_fd(), PIN_UNCHANGED, SendFlags::NOSIGNAL)
                .map(|_| ())
                .map_err(SignerError::Send),
            Err(e) => {
                tracing::error!(error = %e, "cannot start a signer");
                break;
            }
        };
        if sent.is_err() {
            break;
        }
    }
    state.stop();
    0
}

/// The supervisor's answer when the PIN source still holds the PIN the device refused.
const PIN_UNCHANGED: &[u8] = b"p";

/// What a signer writes on its standard output when the device refused its PIN.
pub(crate) const PIN_REFUSED_MARK: &[u8] = b"hwkey-signer: pin-refused\n";

/// What a signer writes on its standard output once it opened its key.
pub(crate) const OPENED_MARK: &[u8] = b"hwkey-signer: opened\n";

/// How long the supervisor waits for a signer to say how its opening went before it replaces
/// it: killing a signer in the middle of its login would spend a PIN try unrecorded.
const OPENING_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The supervisor's signer and what it remembers between starts.
struct SupervisorState {
    binary: std::fs::File,
    live: Option<LiveSigner>,
    backoff: crate::backoff::Backoff,
    last_start: Option<std::time::Instant>,
    /// The PIN source's content when the device refused it.
    refused_pin: Option<zeroize::Zeroizing<Vec<u8>>>,
}

/// The signer running now: its process, the pipe of its standard output, and the PIN source's
/// content it started with.
struct LiveSigner {
    child: std::process::Child,
    started: std::time::Instant,
    pin: zeroize::Zeroizing<Vec<u8>>,
}

impl SupervisorState {
    fn new(binary: std::fs::File) -> SupervisorState {
        SupervisorState {
            binary,
            live: None,
            backoff: crate::backoff::Backoff::new(
                std::time::Duration::from_millis(200),
                std::time::Duration::from_secs(5),
            ),
            last_start: None,
            refused_pin: None,
        }
    }

    /// Ends the live signer, then starts the next one, unless the PIN source still holds a
    /// refused PIN (`None`).
    fn next_signer(&mut self, config: &SignerConfig) -> Result<Option<OwnedFd>, SignerError> {
        self.end_live();
        let pin = pin_sources(config);
        if self.refused_pin.as_ref().is_some_and(|r| **r == *pin) {
            return Ok(None);
        }
        self.refused_pin = None;
        if let Some(last) = self.last_start {
            let wait = self.backoff.next_delay();
            let since = last.elapsed();
            if since < wait {
                std::thread::sleep(wait - since);
            }
        }
        self.last_start = Some(std::time::Instant::now());
        let (child, socket) = start_signer(&self.binary, config)?;
        self.live = Some(LiveSigner {
            child,
            started: std::time::Instant::now(),
            pin,
        });
        Ok(Some(socket))
    }

    /// Kills the live signer if it still runs, reaps it, and remembers a PIN it said was
    /// refused. A signer that served a minute resets the backoff.
    fn end_live(&mut self) {
        let Some(mut live) = self.live.take() else {
            return;
        };
        if live.started.elapsed() > std::time::Duration::from_secs(60) {
            self.backoff.reset();
        }
        let refused = live.child.stdout.take().is_some_and(said_pin_refused);
        // `said_pin_refused` waited for the opening's outcome: the signer is past its login.
        if !matches!(live.child.try_wait(), Ok(Some(_))) {
            let _ = live.child.kill();
        }
        let _ = live.child.wait();
        if refused {
            self.refused_pin = Some(live.pin);
        }
    }

    fn stop(&mut self) {
        if let Some(mut live) = self.live.take() {
            // The signer ends when the network side's socket closes; waited for, not killed.
            let _ = live.child.wait();
        }
    }
}

/// Whether a signer's standard output says its PIN was refused: waits (at most
/// [`OPENING_WAIT`]) until it said how its opening went or exited, and looks for the mark
/// anywhere in what it wrote (a PKCS#11 module may print first). A signer that exited or
/// stayed silent without the mark was not refused (a crash, a device that hangs).
fn said_pin_refused(out: std::process::ChildStdout) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let fd = OwnedFd::from(out);
    let _ = rustix::fs::fcntl_setfl(fd.as_fd(), rustix::fs::OFlags::NONBLOCK);
    let deadline = std::time::Instant::now() + OPENING_WAIT;
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let has = |m: &[u8]| seen.windows(m.len()).any(|w| w == m);
        if has(PIN_REFUSED_MARK) {
            return true;
        }
        if has(OPENED_MARK) {
            return false;
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || seen.len() > 64 * 1024 {
            return false;
        }
        let timeout = Timespec {
            tv_sec: i64::try_from(left.as_secs()).unwrap_or(i64::MAX),
            tv_nsec: i64::from(left.subsec_nanos()),
        };
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(0) | Err(rustix::io::Errno::INTR) => continue,
            Ok(_) => {}
            Err(_) => return false,
        }
        match rustix::io::read(&fd, &mut buf) {
            // The signer exited without saying.
            Ok(0) => return false,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => {}
            Err(_) => return false,
        }
    }
}

/// The content of the configured key's PIN sources (files; an environment variable or a value
/// never changes while the supervisor runs), to tell a fixed PIN from the refused one.
fn pin_sources(config: &SignerConfig) -> zeroize::Zeroizing<Vec<u8>> {
    let mut all = zeroize::Zeroizing::new(Vec::new());
    for path in config.key.pin_files() {
        all.extend_from_slice(path.as_os_str().as_encoded_bytes());
        all.push(0);
        if let Ok(bytes) = crate::small_file::read(&path) {
            all.extend_from_slice(&zeroize::Zeroizing::new(bytes));
        }
        all.push(0);
    }
    all
}

/// The binary signers run: `HWKEY_SIGNER_BIN`, else the one this process runs (even if the file
/// on disk was replaced since), opened now.
fn open_executable() -> Result<std::fs::File, SignerError> {
    let path = match std::env::var_os("HWKEY_SIGNER_BIN").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from("/proc/self/exe"),
    };
    std::fs::File::open(&path).map_err(|source| SignerError::Start {
        what: "opening the signer's binary",
        source,
    })
}

/// `hwkey signer`: reads its configuration from standard input (a socket), then serves on it.
pub fn signer_main() -> u8 {
    crate::key::pin::protect_process();
    let socket = match stdin_socket() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("hwkey signer: {e}");
            return 2;
        }
    };
    match read_config(&socket) {
        Ok(config) => server::serve(socket, config),
        Err(e) => {
            eprintln!("hwkey signer: {e}");
            2
        }
    }
}

/// A signer process (run from `binary`, its standard output a pipe to the supervisor) and the
/// network side's end of its socket.
fn start_signer(
    binary: &std::fs::File,
    config: &SignerConfig,
) -> Result<(std::process::Child, OwnedFd), SignerError> {
    let (for_network, for_signer) = socket_pair()?;
    let program = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(binary));
    let child = Command::new(program)
        .arg0("hwkey")
        .arg(SIGNER_COMMAND)
        .stdin(Stdio::from(for_signer))
        .stdout(Stdio::piped())
        .spawn()
        .map_err(|source| SignerError::Start {
            what: "a signer",
            source,
        })?;
    protocol::send(for_network.as_fd(), 0, &SignerConfigWire::from(config))?;
    Ok((child, for_network))
}

fn send_socket(control: &OwnedFd, socket: OwnedFd) -> Result<(), SignerError> {
    let fds = [socket.as_fd()];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut ancillary = SendAncillaryBuffer::new(&mut space);
    ancillary.push(SendAncillaryMessage::ScmRights(&fds));
    rustix::net::sendmsg(
        control.as_fd(),
        &[IoSlice::new(b"s")],
        &mut ancillary,
        SendFlags::NOSIGNAL,
    )
    .map_err(SignerError::Send)?;
    Ok(())
}

/// Runs this executable's `subcommand` with `socket` as its standard input (the way a socket
/// reaches a child without an inherited descriptor table to manage).
fn spawn(subcommand: &str, socket: OwnedFd) -> Result<std::process::Child, SignerError> {
    Command::new(executable()?)
        .arg(subcommand)
        .stdin(Stdio::from(socket))
        .stdout(Stdio::null())
        .spawn()
        .map_err(|source| SignerError::Start {
            what: "a signer-side process",
            source,
        })
}

/// This executable, or `HWKEY_SIGNER_BIN` (the network side's own binary links no hardware
/// library: it names the full `hwkey` that does).
fn executable() -> Result<PathBuf, SignerError> {
    if let Some(p) = std::env::var_os("HWKEY_SIGNER_BIN").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    std::env::current_exe().map_err(|source| SignerError::Start {
        what: "finding this executable",
        source,
    })
}

/// Standard input as a socket.
fn stdin_socket() -> Result<OwnedFd, SignerError> {
    let fd = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map_err(|source| SignerError::Start {
            what: "standard input",
            source,
        })?;
    match rustix::net::sockopt::socket_type(fd.as_fd()) {
        Ok(SocketType::SEQPACKET) => Ok(fd),
        _ => Err(SignerError::Unexpected(
            "standard input is not the signer's socket (this command is started by `hwkey proxy`)",
        )),
    }
}

fn read_config(socket: &OwnedFd) -> Result<SignerConfig, SignerError> {
    let message = protocol::recv::<SignerConfigWire>(socket.as_fd())?.ok_or(SignerError::Gone {
        why: Some("no configuration arrived".into()),
    })?;
    message.body.try_into()
}

fn socket_pair() -> Result<(OwnedFd, OwnedFd), SignerError> {
    rustix::net::socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| SignerError::Start {
        what: "a socket pair",
        source: e.into(),
    })
}
