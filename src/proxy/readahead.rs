//! Reading a TLS peer's socket in large reads, with a buffer only while bytes are arriving.
//!
//! rustls reads a socket into its own record buffer, at most 4 KiB beyond what it already
//! holds, and shrinks that buffer back to 4 KiB whenever it is empty. A 16 KiB record therefore
//! takes four or five `recv` calls, each growing (and zero-filling) the buffer by 4 KiB: on a
//! bulk download that was the largest item in the proxy's profile (docs/BENCHMARKS.md). Under
//! rustls, [`ReadAhead`] takes up to [`READ_AHEAD`] bytes per `recv` and hands rustls its small
//! reads from memory, so a 64 KiB burst costs one system call instead of about sixteen.
//!
//! Like the relay's copy buffers, the read-ahead buffer exists only while bytes are arriving: it
//! is taken for a read and given back as soon as it is drained and the socket has nothing more
//! (`Pending`), so an idle connection holds none. It comes from the per-thread pool of
//! [`super::buffers`] and is counted in `hwkey_copy_buffers`.
//! Writes pass through untouched (rustls writes whole records with `writev`): [`super::write_through`].

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

use super::buffers::Buffer;
use super::write_through::write_through;

/// The largest read from the socket: four maximum-size TLS records.
pub const READ_AHEAD: usize = 64 * 1024;

/// A stream whose reads are taken from the socket [`READ_AHEAD`] bytes at a time.
pub struct ReadAhead<S> {
    inner: S,
    buf: Option<Buffer>,
    /// `buf[pos..cap]` is read from the socket but not yet handed out.
    pos: usize,
    cap: usize,
}

impl<S> ReadAhead<S> {
    /// Wraps `inner`; no buffer is held until the first read.
    pub fn new(inner: S) -> ReadAhead<S> {
        ReadAhead {
            inner,
            buf: None,
            pos: 0,
            cap: 0,
        }
    }

    /// The stream underneath.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The stream and the bytes read from it but not yet handed out (for a reader that takes
    /// the socket over: [`super::relay_loop`]).
    pub fn into_parts(self) -> (S, Vec<u8>) {
        let rest = match &self.buf {
            Some(buf) if self.pos < self.cap => buf.bytes()[self.pos..self.cap].to_vec(),
            _ => Vec::new(),
        };
        (self.inner, rest)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ReadAhead<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if this.pos == this.cap {
            // A caller asking for as much as we would read gets it directly: no second copy.
            if out.remaining() >= READ_AHEAD {
                this.buf = None;
                return Pin::new(&mut this.inner).poll_read(cx, out);
            }
            let buf = this.buf.get_or_insert_with(|| Buffer::new(READ_AHEAD));
            let mut read = ReadBuf::new(buf.bytes_mut());
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) if !read.filled().is_empty() => {
                    this.pos = 0;
                    this.cap = read.filled().len();
                    buf.filled(this.cap);
                }
                other => {
                    // Nothing arrived (Pending), end of stream or an error: idle from here on.
                    this.buf = None;
                    return other;
                }
            }
        }
        let Some(buf) = &this.buf else {
            return Poll::Ready(Err(io::Error::other(
                "read-ahead: pending bytes without a buffer",
            )));
        };
        let n = out.remaining().min(this.cap - this.pos);
        out.put_slice(&buf.bytes()[this.pos..this.pos + n]);
        this.pos += n;
        Poll::Ready(Ok(()))
    }
}

write_through!(ReadAhead<S>, inner);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Small reads are served from one large read, the bytes arrive in order, and the buffer is
    /// given back once the socket has nothing more.
    #[tokio::test]
    async fn small_reads_come_from_one_large_read_and_idle_holds_no_buffer() {
        let _serial = super::super::buffers::TEST_SERIAL.lock().await;
        let (mut tx, rx) = tokio::io::duplex(256 * 1024);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        tx.write_all(&data).await.unwrap();
        let mut r = ReadAhead::new(rx);
        let mut got = Vec::new();
        let mut chunk = [0u8; 4096];
        while got.len() < data.len() {
            let n = r.read(&mut chunk).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&chunk[..n]);
            if got.len() == 4096 {
                assert!(r.buf.is_some(), "the first read took a read-ahead buffer");
                assert_eq!(r.cap, READ_AHEAD, "one read took a whole buffer's worth");
            }
        }
        assert_eq!(got, data);
        // Drained, and the peer sends nothing: the next read is Pending and gives the buffer back.
        let pending = futures::poll!(Box::pin(r.read(&mut chunk)));
        assert!(pending.is_pending());
        assert!(r.buf.is_none(), "an idle stream holds no buffer");
        // Large reads go straight through.
        tx.write_all(&data[..70_000]).await.unwrap();
        let mut big = vec![0u8; READ_AHEAD];
        let n = r.read(&mut big).await.unwrap();
        assert!(r.buf.is_none());
        assert_eq!(&big[..n], &data[..n]);
        drop(tx);
        let mut rest = Vec::new();
        r.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, &data[n..70_000]);
        assert!(r.buf.is_none(), "end of stream holds no buffer");
    }
}
