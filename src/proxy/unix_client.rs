//! A UNIX-socket client's stream, registered with the runtime for readability only.
//!
//! tokio registers every socket for reading *and* writing, edge-triggered. On a UNIX stream
//! socket the kernel signals "writable" each time the peer reads what was written to it
//! (`unix_write_space` runs as the peer consumes each buffer), where TCP does so only after a
//! write found the send buffer full. So with tokio's `UnixStream`, every keep-alive response a
//! client reads signalled the connection's runtime once more, for an event no task was waiting
//! for: when the runtime was asleep between requests (kubelet's pace on its UNIX socket), a
//! third wake-up per request beside the request's and the upstream answer's.
//!
//! Here the socket is registered for reading, and for writing only while a write is waiting
//! for room: a write that would block switches the registration to both interests, and a flush
//! after writes that never blocked switches it back. A switch is two
//! `epoll_ctl` calls (the old registration out, the new one in) and one more poll of the
//! connection's task, which registers its wakers again (those of the old registration are
//! dropped with it); the read readiness is learnt again from the new registration. A direction
//! that keeps meeting back-pressure (a bulk download to a slow reader) keeps both interests, so
//! an episode of back-pressure costs two switches, not two per write; until the next flush
//! after a burst that did not block, the client's reads of that tail still wake the runtime.
//!
//! Reads follow tokio's own stream: a read that returns fewer bytes than asked clears the
//! readiness, so the next read waits for the next edge instead of calling `recv` for an
//! `EAGAIN`.

use std::io::{self, IoSlice, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// A client's UNIX stream whose registration asks for writability only while a write waits,
/// and which is registered with the runtime only once it must wait for the socket at all: a
/// client whose request came with its connect, and whose connection then moves to a relay loop
/// ([`super::relay_loop`]), never is (an `epoll_ctl` to add it and another to take it out
/// again, per connection, saved).
pub struct ClientUnixStream {
    io: Io,
    /// The registration includes writability.
    writable: bool,
    /// A write would have blocked since the last flush.
    blocked: bool,
}

/// The socket, and the runtime's registration of it once there is one.
enum Io {
    /// Not registered (non-blocking all the same).
    Plain(UnixStream),
    Registered(AsyncFd<UnixStream>),
    /// Only while the registration is being replaced (or after that failed).
    Gone,
}

impl ClientUnixStream {
    /// Takes `stream` (made non-blocking here); it is registered with the current runtime when
    /// it first has to wait.
    pub fn new(stream: UnixStream) -> io::Result<ClientUnixStream> {
        stream.set_nonblocking(true)?;
        Ok(ClientUnixStream::accepted(stream))
    }

    /// [`ClientUnixStream::new`] for a socket that is non-blocking already (accepted with
    /// `SOCK_NONBLOCK`, [`super::accept`]): no system call here.
    pub fn accepted(stream: UnixStream) -> ClientUnixStream {
        ClientUnixStream {
            io: Io::Plain(stream),
            writable: false,
            blocked: false,
        }
    }

    /// The socket, taken back from the runtime (deregistered if it was registered; still
    /// non-blocking), for a relay that waits for it itself ([`super::relay_loop`]).
    pub fn into_std(mut self) -> io::Result<UnixStream> {
        self.take()
    }

    /// The connected socket (for the peer's credentials, and reads tried before waiting).
    pub fn socket(&self) -> Option<&UnixStream> {
        match &self.io {
            Io::Plain(s) => Some(s),
            Io::Registered(fd) => Some(fd.get_ref()),
            Io::Gone => None,
        }
    }

    fn stream(&self) -> io::Result<&UnixStream> {
        self.socket().ok_or_else(lost)
    }

    /// The registration, made now (for reading) if there is none yet.
    fn registration(&mut self) -> io::Result<&AsyncFd<UnixStream>> {
        if let Io::Plain(_) = self.io {
            let stream = self.take()?;
            self.io = Io::Registered(register(stream, Interest::READABLE)?);
            self.writable = false;
        }
        match &self.io {
            Io::Registered(fd) => Ok(fd),
            _ => Err(lost()),
        }
    }

    /// The socket out of its registration, if any, leaving [`Io::Gone`].
    fn take(&mut self) -> io::Result<UnixStream> {
        match std::mem::replace(&mut self.io, Io::Gone) {
            Io::Plain(s) => Ok(s),
            Io::Registered(fd) => Ok(fd.into_inner()),
            Io::Gone => Err(lost()),
        }
    }

    /// Whether the registration asks for writability (what the tests check).
    #[cfg(test)]
    fn registered_for_writing(&self) -> bool {
        self.writable
    }

    /// Whether the socket is registered with the runtime at all (what the tests check).
    #[cfg(test)]
    fn registered(&self) -> bool {
        matches!(self.io, Io::Registered(_))
    }

    /// Registers the socket again with `writable` or without it. Wakers registered with the old
    /// registration are dropped with it, so the task is woken to register them again.
    fn reregister(&mut self, writable: bool, cx: &mut Context<'_>) -> io::Result<()> {
        let interest = if writable {
            Interest::READABLE | Interest::WRITABLE
        } else {
            Interest::READABLE
        };
        let stream = self.take()?;
        self.io = Io::Registered(register(stream, interest)?);
        self.writable = writable;
        cx.waker().wake_by_ref();
        Ok(())
    }

    /// Writes with `write` (one buffer or several), waiting for room through the registration
    /// once a write has found none.
    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        write: impl Fn(&UnixStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            if !self.writable {
                match write(self.stream()?) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.blocked = true;
                        self.reregister(true, cx)?;
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    r => return Poll::Ready(r),
                }
            }
            let io = self.registration()?;
            let mut guard = ready!(io.poll_write_ready(cx))?;
            match guard.try_io(|s| write(s.get_ref())) {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => self.blocked = true,
            }
        }
    }
}

fn lost() -> io::Error {
    io::Error::other("the client socket lost its registration")
}

/// Registers `stream` with the current runtime for `interest`.
#[allow(unsafe_code)]
fn register(stream: UnixStream, interest: Interest) -> io::Result<AsyncFd<UnixStream>> {
    // SAFETY: `register_with_interest` asks that the descriptor stay open and the same while
    // registered. A `UnixStream` owns its descriptor and closes it only when dropped, and the
    // `AsyncFd` owns the stream: it is dropped, or taken back with `into_inner` (which
    // deregisters first), never closed or replaced while registered.
    Ok(unsafe { AsyncFd::register_with_interest(stream, interest) }?)
}

impl AsyncRead for ClientUnixStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let io = self.get_mut().registration()?;
        loop {
            let mut guard = ready!(io.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let wanted = unfilled.len();
            match guard.try_io(|s| s.get_ref().read(unfilled)) {
                Ok(Ok(n)) => {
                    if n > 0 && n < wanted {
                        // Drained: the next read waits for the next edge.
                        guard.clear_ready();
                    }
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for ClientUnixStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_write_with(cx, |mut s: &UnixStream| s.write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_write_with(cx, |mut s: &UnixStream| s.write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Nothing is buffered here; a flush after writes that all found room gives the
    /// registration's writability back.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.writable && !this.blocked {
            this.reregister(false, cx)?;
        }
        this.blocked = false;
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.stream()?.shutdown(Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The kernel fact this module rests on: a UNIX stream socket registered for writability
    /// (edge-triggered, as tokio registers) is signalled writable again each time its peer
    /// reads, with room to spare all along; one registered for reading only is not woken.
    #[test]
    fn a_peer_reading_signals_writability_on_a_unix_socket() {
        use rustix::event::epoll;
        let now = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let ready = |ep: &std::os::fd::OwnedFd| {
            let mut events = Vec::with_capacity(4);
            epoll::wait(ep, rustix::buffer::spare_capacity(&mut events), Some(&now)).unwrap();
            events.len()
        };
        let events_after_peer_reads = |flags: epoll::EventFlags| {
            let (a, mut b) = UnixStream::pair().unwrap();
            let ep = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
            epoll::add(&ep, &a, epoll::EventData::new_u64(1), flags).unwrap();
            ready(&ep); // the registration's own first report
            (&a).write_all(b"response").unwrap();
            assert_eq!(ready(&ep), 0, "nothing new before the peer reads");
            let mut got = [0u8; 8];
            b.read_exact(&mut got).unwrap();
            ready(&ep)
        };
        let both = epoll::EventFlags::IN | epoll::EventFlags::OUT | epoll::EventFlags::ET;
        let read_only = epoll::EventFlags::IN | epoll::EventFlags::ET;
        assert_eq!(events_after_peer_reads(both), 1, "signalled writable again");
        assert_eq!(events_after_peer_reads(read_only), 0, "not woken");
    }

    /// The relay's two directions share one task. After a burst to the client that had to
    /// wait for room, the flush that gives writability back drops the registration holding the
    /// client-side read's waker; the stream wakes the task so the read registers again. Without
    /// that, a request the client sends next would sit unread (until the idle timeout).
    #[tokio::test]
    async fn a_request_after_a_burst_that_waited_still_reaches_the_upstream() {
        let _serial = super::super::buffers::TEST_SERIAL.lock().await;
        let (a, b) = UnixStream::pair().unwrap();
        let mut client = ClientUnixStream::new(a).unwrap();
        let (mut upstream, mut near) = tokio::io::duplex(256 * 1024);
        let relay = tokio::spawn(async move {
            super::super::relay::copy_bidirectional(&mut client, &mut near).await
        });
        let big = vec![7u8; 4 * 1024 * 1024];
        let mut peer = b;
        peer.set_nonblocking(false).unwrap();
        // The peer reads the burst only after the relay has filled its socket.
        let reader = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            let mut all = vec![0u8; 4 * 1024 * 1024 + 4];
            peer.read_exact(&mut all).unwrap();
            assert_eq!(&all[all.len() - 4..], b"tail");
            peer.write_all(b"request").unwrap();
            peer
        });
        upstream.write_all(&big).await.unwrap();
        // A second burst, after the relay flushed the first: this one finds room, and its
        // flush gives writability back.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        upstream.write_all(b"tail").await.unwrap();
        let mut request = [0u8; 7];
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            upstream.read_exact(&mut request),
        )
        .await
        .expect("the client's request reached the upstream")
        .unwrap();
        assert_eq!(&request, b"request");
        drop(reader.join().unwrap());
        drop(upstream);
        let _ = relay.await;
    }

    /// The socket is registered with the runtime only once something must wait for it: writes
    /// that find room and a read tried on the socket itself leave it unregistered (a client
    /// that goes to a relay loop costs no `epoll_ctl` here), a read that finds nothing
    /// registers it, and the bytes that arrive later wake that read.
    #[tokio::test]
    async fn a_socket_is_registered_only_once_something_waits_for_it() {
        let (a, mut peer) = UnixStream::pair().unwrap();
        let mut client = ClientUnixStream::new(a).unwrap();
        peer.write_all(b"request").unwrap();
        let mut got = [0u8; 7];
        (&mut client.socket().unwrap())
            .read_exact(&mut got)
            .unwrap();
        client.write_all(b"answer").await.unwrap();
        client.flush().await.unwrap();
        assert!(!client.registered(), "nothing waited: not registered");
        let mut answer = [0u8; 6];
        peer.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"answer");

        let writer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(100));
            peer.write_all(b"next").unwrap();
            peer
        });
        let mut next = [0u8; 4];
        tokio::time::timeout(
            std::time::Duration::from_secs(10),
            client.read_exact(&mut next),
        )
        .await
        .expect("the later bytes woke the read")
        .unwrap();
        assert_eq!(&next, b"next");
        assert!(client.registered(), "a read waited: registered");
        let _peer = writer.join().unwrap();
        let socket = client.into_std().unwrap();
        let e = (&socket).read(&mut next).unwrap_err();
        assert_eq!(
            e.kind(),
            io::ErrorKind::WouldBlock,
            "taken back non-blocking"
        );
    }

    /// Small writes never register for writing; a write that finds the socket full does, the
    /// bytes all arrive once the peer reads, and the flush after a burst that no longer blocks
    /// gives the interest back.
    #[tokio::test]
    async fn writability_is_asked_for_only_while_a_write_waits() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut client = ClientUnixStream::new(a).unwrap();
        b.set_nonblocking(false).unwrap();
        let mut peer = b;

        client.write_all(b"small response").await.unwrap();
        client.flush().await.unwrap();
        assert!(!client.registered_for_writing());
        let mut got = [0u8; 14];
        peer.read_exact(&mut got).unwrap();

        // More than the socket holds, nobody reading yet: writes fill it until one must wait.
        let big: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
        let mut sent = 0;
        while let Poll::Ready(n) = std::future::poll_fn(|cx| {
            Poll::Ready(Pin::new(&mut client).poll_write(cx, &big[sent..]))
        })
        .await
        {
            sent += n.unwrap();
            assert!(sent < big.len(), "the socket took 4 MiB without waiting");
        }
        assert!(client.registered_for_writing(), "a write waited for room");
        let expect = big.clone();
        let reader = std::thread::spawn(move || {
            let mut all = vec![0u8; expect.len()];
            peer.read_exact(&mut all).unwrap();
            assert!(all == expect, "the bytes arrived in order");
            peer
        });
        client.write_all(&big[sent..]).await.unwrap();
        client.flush().await.unwrap();
        assert!(client.registered_for_writing(), "the burst blocked: kept");
        let mut peer = reader.join().unwrap();

        client.write_all(b"next").await.unwrap();
        client.flush().await.unwrap();
        assert!(
            !client.registered_for_writing(),
            "a burst without back-pressure gives it back"
        );
        let mut next = [0u8; 4];
        peer.read_exact(&mut next).unwrap();
        assert_eq!(&next, b"next");

        // Reads still work after the switches, and a half-close reaches the peer.
        std::io::Write::write_all(&mut peer, b"request").unwrap();
        let mut req = [0u8; 7];
        client.read_exact(&mut req).await.unwrap();
        assert_eq!(&req, b"request");
        client.shutdown().await.unwrap();
        let mut rest = Vec::new();
        peer.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
    }
}
