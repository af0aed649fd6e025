//! Copying bytes both ways between the client and the upstream, with a copy buffer only while
//! bytes are in flight.
//!
//! `tokio::io::copy_bidirectional` keeps one buffer per direction for the connection's whole
//! life. Most of a node's connections are idle watches, so that is most of the proxy's memory:
//! 32 KiB per connection at 16 KiB per direction. Here a direction takes its buffer when it reads
//! and gives it back as soon as everything read has been written and the reader has nothing
//! more (it returned `Pending`): an idle connection holds no copy buffer. The cost is one
//! allocation per burst of data, against the TLS work on the same bytes. Because idle
//! connections hold nothing, a bulk transfer can afford a larger buffer: a direction whose reads
//! fill its buffer doubles it up to [`MAX_COPY_BUFFER`] (more TLS records per read).
//!
//! Semantics are `copy_bidirectional`'s: a direction whose reader ends shuts its writer down
//! (half-close passes through), the copy ends when both directions are done, and the first
//! error ends it. Buffers come from [`super::buffers`], which counts them and pools them per
//! thread.

use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

#[cfg(test)]
use super::buffers::buffers_in_use;
use super::buffers::Buffer;

/// Size of a direction's first copy buffer: one maximum TLS record (16 KiB), enough for
/// requests, responses and watch events.
pub const COPY_BUFFER: usize = 16 * 1024;
/// The largest copy buffer: a direction whose reads fill its buffer (a bulk transfer) doubles
/// it up to this, so one read takes several TLS records (fewer wake-ups and syscalls per MB).
/// Only busy directions hold one, so the size costs no idle memory.
pub const MAX_COPY_BUFFER: usize = 64 * 1024;

/// One direction's state.
struct Direction {
    buf: Option<Buffer>,
    /// The size of the next buffer taken: grows while reads fill the buffer.
    size: usize,
    /// `buf[pos..cap]` is read but not yet written.
    pos: usize,
    cap: usize,
    read_done: bool,
    need_flush: bool,
    done: bool,
    copied: u64,
}

impl Default for Direction {
    fn default() -> Direction {
        Direction {
            buf: None,
            size: COPY_BUFFER,
            pos: 0,
            cap: 0,
            read_done: false,
            need_flush: false,
            done: false,
            copied: 0,
        }
    }
}

impl Direction {
    fn poll_copy<R, W>(
        &mut self,
        cx: &mut Context<'_>,
        mut reader: Pin<&mut R>,
        mut writer: Pin<&mut W>,
    ) -> Poll<io::Result<u64>>
    where
        R: AsyncRead + ?Sized,
        W: AsyncWrite + ?Sized,
    {
        loop {
            // Write what is pending first.
            if self.pos < self.cap {
                ready!(self.poll_write_pending(cx, writer.as_mut()))?;
                continue;
            }
            if self.read_done {
                ready!(writer.as_mut().poll_flush(cx))?;
                ready!(writer.as_mut().poll_shutdown(cx))?;
                self.done = true;
                return Poll::Ready(Ok(self.copied));
            }
            if self.poll_fill(cx, reader.as_mut())?.is_pending() {
                // Nothing in flight and nothing to read: give the buffer back, and push out
                // what was written so far.
                self.buf = None;
                if self.need_flush {
                    ready!(writer.as_mut().poll_flush(cx))?;
                    self.need_flush = false;
                }
                return Poll::Pending;
            }
        }
    }

    /// Writes (some of) the pending bytes.
    #[inline]
    fn poll_write_pending<W: AsyncWrite + ?Sized>(
        &mut self,
        cx: &mut Context<'_>,
        writer: Pin<&mut W>,
    ) -> Poll<io::Result<()>> {
        let Some(buf) = &self.buf else {
            return Poll::Ready(Err(io::Error::other(
                "relay: pending bytes without a buffer",
            )));
        };
        let n = ready!(writer.poll_write(cx, &buf.bytes()[self.pos..self.cap]))?;
        if n == 0 {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "the peer accepted no more bytes",
            )));
        }
        self.pos += n;
        self.need_flush = true;
        Poll::Ready(Ok(()))
    }

    /// Reads into the buffer (taken from the pool, grown after a full read): Ok(Ready) when
    /// bytes or the end came, Ok(Pending) when nothing is to be read now.
    #[inline]
    fn poll_fill<R: AsyncRead + ?Sized>(
        &mut self,
        cx: &mut Context<'_>,
        reader: Pin<&mut R>,
    ) -> io::Result<Poll<()>> {
        if self.buf.as_ref().is_some_and(|b| b.len() < self.size) {
            self.buf = None; // drained, and a bigger one is due
        }
        let size = self.size;
        let buf = self.buf.get_or_insert_with(|| Buffer::new(size));
        let mut read = ReadBuf::new(buf.bytes_mut());
        match reader.poll_read(cx, &mut read) {
            Poll::Pending => return Ok(Poll::Pending),
            Poll::Ready(r) => r?,
        }
        let n = read.filled().len();
        buf.filled(n);
        if n == 0 {
            self.read_done = true;
            self.buf = None;
        } else {
            if n == buf.len() && self.size < MAX_COPY_BUFFER {
                self.size *= 2;
            }
            self.pos = 0;
            self.cap = n;
            self.copied += n as u64;
        }
        Ok(Poll::Ready(()))
    }
}

/// Copies `a` → `b` and `b` → `a` until both directions have ended; returns the bytes copied
/// each way, or the first error.
pub async fn copy_bidirectional<A, B>(a: &mut A, b: &mut B) -> io::Result<(u64, u64)>
where
    A: AsyncRead + AsyncWrite + Unpin + ?Sized,
    B: AsyncRead + AsyncWrite + Unpin + ?Sized,
{
    let mut a_to_b = Direction::default();
    let mut b_to_a = Direction::default();
    poll_fn(|cx| {
        let forward = if a_to_b.done {
            Poll::Ready(Ok(a_to_b.copied))
        } else {
            a_to_b.poll_copy(cx, Pin::new(&mut *a), Pin::new(&mut *b))
        };
        let backward = if b_to_a.done {
            Poll::Ready(Ok(b_to_a.copied))
        } else {
            b_to_a.poll_copy(cx, Pin::new(&mut *b), Pin::new(&mut *a))
        };
        match (forward, backward) {
            (Poll::Ready(Err(e)), _) | (_, Poll::Ready(Err(e))) => Poll::Ready(Err(e)),
            (Poll::Ready(Ok(x)), Poll::Ready(Ok(y))) => Poll::Ready(Ok((x, y))),
            _ => Poll::Pending,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::super::buffers::TEST_SERIAL as SERIAL;

    /// A bulk transfer (reads that fill the buffer) grows the buffer to MAX_COPY_BUFFER; a
    /// direction that only ever sees small reads stays at COPY_BUFFER.
    #[tokio::test]
    async fn bulk_reads_grow_the_buffer_and_small_ones_do_not() {
        let _serial = SERIAL.lock().await;
        let mut bulk = Direction::default();
        let data = vec![7u8; 1024 * 1024];
        let mut reader: &[u8] = &data;
        let mut sink = tokio::io::sink();
        let copied = poll_fn(|cx| bulk.poll_copy(cx, Pin::new(&mut reader), Pin::new(&mut sink)))
            .await
            .unwrap();
        assert_eq!(copied, data.len() as u64);
        assert_eq!(bulk.size, MAX_COPY_BUFFER);

        let mut small = Direction::default();
        let (mut tx, mut rx) = tokio::io::duplex(1024);
        tx.write_all(b"event\n").await.unwrap();
        drop(tx);
        let mut sink = tokio::io::sink();
        poll_fn(|cx| small.poll_copy(cx, Pin::new(&mut rx), Pin::new(&mut sink)))
            .await
            .unwrap();
        assert_eq!(small.size, COPY_BUFFER);
    }

    /// Both directions, half-close passed on, counts, and no buffer held once idle or done.
    #[tokio::test]
    async fn copies_both_ways_and_holds_no_buffer_while_idle() {
        let _serial = SERIAL.lock().await;
        let (mut client, mut a) = tokio::io::duplex(64 * 1024);
        let (mut b, mut upstream) = tokio::io::duplex(64 * 1024);
        let relay = tokio::spawn(async move { copy_bidirectional(&mut a, &mut b).await });

        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let sent = big.clone();
        let writer = tokio::spawn(async move {
            client.write_all(&sent).await.unwrap();
            client
        });
        let mut got = vec![0u8; big.len()];
        upstream.read_exact(&mut got).await.unwrap();
        assert_eq!(got, big);
        let mut client = writer.await.unwrap();

        // Idle: both sides wait, and the relay has given its buffers back.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(buffers_in_use(), 0);

        upstream.write_all(b"pong").await.unwrap();
        let mut pong = [0u8; 4];
        client.read_exact(&mut pong).await.unwrap();
        assert_eq!(&pong, b"pong");

        // Half-close from the client reaches the upstream, which can still answer.
        client.shutdown().await.unwrap();
        let mut rest = Vec::new();
        upstream.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        upstream.write_all(b"bye").await.unwrap();
        upstream.shutdown().await.unwrap();
        let mut tail = Vec::new();
        client.read_to_end(&mut tail).await.unwrap();
        assert_eq!(tail, b"bye");

        let (forward, backward) = relay.await.unwrap().unwrap();
        assert_eq!((forward, backward), (200_000, 7));
        assert_eq!(buffers_in_use(), 0);
    }
}
