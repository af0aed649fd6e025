//! The copy and read-ahead buffers of the data path, and a small per-thread pool of them.
//!
//! A connection holds a buffer only while bytes are in flight (the relay and the read-ahead
//! give theirs back as soon as a read returns `Pending`), so idle connections hold none. Without
//! a pool every burst would allocate a fresh 16–64 KiB buffer that the allocator zero-fills, on
//! every poll that finds nothing to read too: on a stream of small keep-alive requests that
//! `memset` dominates the proxy's profile (docs/BENCHMARKS.md). So a buffer given back goes to
//! its thread's free list (at most [`KEPT_PER_SIZE`] of each size) and the next burst on that thread takes
//! it again: in steady state a request allocates nothing and zero-fills nothing.
//!
//! A buffer goes back to the pool with the bytes it held wiped (only those: a 200-byte request
//! costs a 200-byte wipe, not 64 KiB), so API responses never linger in the free list, and a
//! reader only ever sees what it read itself. (A buffer the full pool frees goes back to the
//! allocator unwiped, as any freed memory does.) [`buffers_in_use`] counts buffers held by
//! connections (`hwkey_copy_buffers`), [`buffers_allocated`] the fresh allocations since start
//! (`hwkey_copy_buffer_allocations_total`), which is how the tests see the pool work.

use std::cell::RefCell;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// The sizes that are pooled: the relay's first buffer, its doubled one, and the largest
/// (also the read-ahead's). Other sizes are allocated and freed as before.
const POOLED_SIZES: [usize; 3] = [16 * 1024, 32 * 1024, 64 * 1024];
/// Free buffers a thread keeps of each pooled size: enough for the bursts one worker thread
/// has in flight at once on a busy proxy, little memory (448 KiB per thread at most).
pub const KEPT_PER_SIZE: usize = 4;

static IN_USE: AtomicI64 = AtomicI64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static FREE: RefCell<[Vec<Box<[u8]>>; 3]> = const { RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
}

/// Copy and read-ahead buffers held by all connections right now.
pub fn buffers_in_use() -> i64 {
    IN_USE.load(Ordering::Relaxed)
}

/// Buffers allocated (and zero-filled) since the process started; buffers taken again from
/// the pool are not counted.
pub fn buffers_allocated() -> u64 {
    ALLOCATED.load(Ordering::Relaxed)
}

fn class(size: usize) -> Option<usize> {
    POOLED_SIZES.iter().position(|&s| s == size)
}

/// A copy buffer (or a read-ahead buffer), counted while a connection holds it.
pub(super) struct Buffer {
    bytes: Box<[u8]>,
    /// `bytes[..dirty]` may hold data read into it: wiped before the buffer is pooled.
    dirty: usize,
}

impl Buffer {
    /// A buffer of `size` bytes: one from this thread's pool when it has one.
    pub(super) fn new(size: usize) -> Buffer {
        IN_USE.fetch_add(1, Ordering::Relaxed);
        let pooled = class(size).and_then(|c| {
            FREE.try_with(|free| free.borrow_mut()[c].pop())
                .ok()
                .flatten()
        });
        let bytes = pooled.unwrap_or_else(|| {
            ALLOCATED.fetch_add(1, Ordering::Relaxed);
            vec![0u8; size].into_boxed_slice()
        });
        Buffer { bytes, dirty: 0 }
    }

    pub(super) fn len(&self) -> usize {
        self.bytes.len()
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The whole buffer to read into; `filled` must then be told how much was read.
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }

    /// Records that `bytes[..n]` now holds data (so it is wiped before reuse).
    pub(super) fn filled(&mut self, n: usize) {
        self.dirty = self.dirty.max(n.min(self.bytes.len()));
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        IN_USE.fetch_sub(1, Ordering::Relaxed);
        let Some(c) = class(self.bytes.len()) else {
            return;
        };
        // A plain fill (memset): the buffer lives on in the pool, so the writes cannot be
        // elided, and zeroize's byte-by-byte volatile loop cost 3 % of a small request's CPU.
        self.bytes[..self.dirty].fill(0);
        let bytes = std::mem::take(&mut self.bytes);
        let _ = FREE.try_with(|free| {
            let mut free = free.borrow_mut();
            if free[c].len() < KEPT_PER_SIZE {
                free[c].push(bytes);
            }
        });
    }
}

/// The buffer count is one for the process: unit tests that take buffers, or assert on the
/// count, run one at a time under this lock (an assertion of "none held" failed now and then
/// while another module's test held one).
#[cfg(test)]
pub(crate) static TEST_SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer given back is taken again on the same thread, wiped, with no new allocation;
    /// the pool keeps at most KEPT_PER_SIZE of a size.
    #[test]
    fn a_returned_buffer_is_reused_wiped_and_the_pool_is_bounded() {
        let _serial = TEST_SERIAL.blocking_lock();
        std::thread::spawn(|| {
            let before = buffers_allocated();
            let mut a = Buffer::new(16 * 1024);
            a.bytes_mut()[..5].copy_from_slice(b"token");
            a.filled(5);
            let first = a.bytes().as_ptr();
            drop(a);
            let b = Buffer::new(16 * 1024);
            assert_eq!(b.bytes().as_ptr(), first, "the same buffer again");
            assert!(b.bytes().iter().all(|&x| x == 0), "wiped before reuse");
            drop(b);
            let held: Vec<Buffer> = (0..KEPT_PER_SIZE + 3)
                .map(|_| Buffer::new(16 * 1024))
                .collect();
            drop(held);
            let kept = FREE.with(|f| f.borrow()[0].len());
            assert_eq!(kept, KEPT_PER_SIZE);
            // Other threads allocate concurrently in other tests: only a lower bound holds.
            assert!(buffers_allocated() - before >= (KEPT_PER_SIZE + 3 - 1) as u64);
            // Sizes outside the pool are not kept.
            drop(Buffer::new(1000));
        })
        .join()
        .unwrap();
    }
}
