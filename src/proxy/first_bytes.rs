//! A UNIX-socket client's first bytes: read before anything goes upstream, to tell the HTTP/2
//! preface from HTTP/1.1 (the upstream is offered the matching protocol), then replayed
//! upstream untouched.
//!
//! The first read is tried on the socket at once and takes whatever is there, up to one
//! record's plaintext, so a request that came with the connect goes upstream whole, in one
//! record (docs/BENCHMARKS.md, "the first request whole").

use tokio::io::AsyncReadExt;

use super::unix_client::ClientUnixStream;

/// The HTTP/2 client connection preface (RFC 9113, section 3.4).
pub const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What the first read of a UNIX-socket client may take: one TLS record's plaintext, so what
/// arrived with the preface (or a whole HTTP/1.1 request) goes upstream in one record.
pub(crate) const FIRST_READ: usize = 16 * 1024;

/// Whether `first` (a client's first bytes) tells the HTTP/2 preface from anything else: the
/// whole preface, or a byte that differs from it. Read until it does, by [`sniff`] and by a
/// relay loop that opens the connection itself.
pub(crate) fn decided(first: &[u8]) -> bool {
    let seen = first.len().min(H2_PREFACE.len());
    seen == H2_PREFACE.len() || first[..seen] != H2_PREFACE[..seen]
}

/// Reads the client's first bytes: at least enough to tell the HTTP/2 preface from anything
/// else, and whatever else one read finds. A request that came in one piece is then replayed
/// upstream in one piece (one record sealed, one write, one read for the API server), where
/// reading only the preface's 24 bytes split every first request in two.
pub async fn sniff(stream: &mut ClientUnixStream) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; FIRST_READ];
    let mut len = 0;
    while !decided(&buf[..len]) {
        let at_once = if len == 0 {
            first_read(stream, &mut buf)
        } else {
            None
        };
        let n = match at_once {
            Some(n) => n?,
            None => stream.read(&mut buf[len..]).await?,
        };
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        len += n;
    }
    // Held while the upstream connects (a stalled upstream, a thousand clients): only what
    // arrived, not the read's whole 16 KiB.
    buf.truncate(len);
    buf.shrink_to_fit();
    Ok(buf)
}

/// The first read, tried on the socket at once: a client writes its request with its connect,
/// so it is usually there, while a fresh registration with the runtime knows of no readiness
/// yet and would wait for `epoll_wait` to report it (one more system call and one more poll of
/// the task per connection). None when it must wait after all.
fn first_read(stream: &ClientUnixStream, buf: &mut [u8]) -> Option<std::io::Result<usize>> {
    use std::io::Read;
    match stream.socket()?.read(buf) {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => None,
        r => Some(r),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::io::Write;
    use std::task::{Context, Poll};
    use std::time::Duration;

    /// Polls `f` once, with a waker that does nothing.
    fn poll_once<F: Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        f.poll(&mut Context::from_waker(std::task::Waker::noop()))
    }

    /// A request the client wrote with its connect is read at the first poll, whole
    /// (a fresh registration with the runtime knows no readiness yet: waiting for it cost an
    /// `epoll_wait` and a poll more per connection), and all of it is kept for the upstream,
    /// not just the 24 bytes that tell HTTP/2 from HTTP/1.1; the read's 16 KiB buffer is not
    /// held beyond what arrived (on 69e186c it was, while the upstream connected).
    #[tokio::test]
    async fn a_request_already_there_is_read_whole_at_the_first_poll() {
        let request = b"GET /version HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n";
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        theirs.write_all(request).unwrap();
        let mut stream = ClientUnixStream::new(ours).unwrap();
        let mut read = std::pin::pin!(sniff(&mut stream));
        match poll_once(read.as_mut()) {
            Poll::Ready(Ok(got)) => {
                assert_eq!(got, request);
                assert!(
                    got.capacity() < 1024,
                    "{} bytes held for a {}-byte request while the upstream connects",
                    got.capacity(),
                    request.len()
                );
            }
            Poll::Ready(Err(e)) => panic!("{e}"),
            Poll::Pending => panic!("the first poll waited for bytes that were already there"),
        }
    }

    /// A request a megabyte long: the first read takes one record's plaintext, and the rest
    /// stays in the socket, in order, for the relay.
    #[tokio::test]
    async fn a_megabyte_request_is_read_one_record_at_first() {
        use std::io::Read;
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let request: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 251) as u8).collect();
        let sent = request.clone();
        let writer = std::thread::spawn(move || {
            theirs.write_all(&sent).unwrap();
            theirs
        });
        let mut stream = ClientUnixStream::new(ours).unwrap();
        let got = sniff(&mut stream).await.unwrap();
        assert!(!got.is_empty() && got.len() <= FIRST_READ, "{}", got.len());
        let mut socket = stream.into_std().unwrap();
        socket.set_nonblocking(false).unwrap();
        let mut rest = vec![0u8; request.len() - got.len()];
        socket.read_exact(&mut rest).unwrap();
        drop(writer.join().unwrap());
        assert!(got == request[..got.len()] && rest == request[got.len()..]);
    }

    /// The HTTP/2 preface is still told apart when it comes in pieces, and what follows it in
    /// the same read is kept; a client that closes before 24 bytes is an error.
    #[tokio::test]
    async fn the_preface_in_pieces_is_still_recognised() {
        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut stream = ClientUnixStream::new(ours).unwrap();
        let writer = std::thread::spawn(move || {
            theirs.write_all(&H2_PREFACE[..10]).unwrap();
            std::thread::sleep(Duration::from_millis(50));
            let mut rest = H2_PREFACE[10..].to_vec();
            rest.extend_from_slice(b"\0\0\0\x04\0\0\0\0\0");
            theirs.write_all(&rest).unwrap();
            theirs
        });
        let got = sniff(&mut stream).await.unwrap();
        assert!(got.starts_with(H2_PREFACE), "{got:?}");
        assert_eq!(&got[24..], b"\0\0\0\x04\0\0\0\0\0");
        drop(writer.join().unwrap());

        let (ours, mut theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut stream = ClientUnixStream::new(ours).unwrap();
        theirs.write_all(&H2_PREFACE[..10]).unwrap();
        drop(theirs);
        let e = sniff(&mut stream).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
