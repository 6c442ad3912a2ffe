//! Buffers for large WRITE payloads and READ replies, reused across
//! requests and connections. A fresh 1 MiB allocation per request costs
//! the daemon a page fault and a zeroed page per 4 KiB whenever the
//! allocator hands the memory back to the kernel in between (glibc does,
//! for large blocks freed on another thread): about a third of the CPU of
//! 1 MiB writes, a tenth of 1 MiB reads. A
//! buffer goes back to the pool when the last [`Bytes`] of its payload is
//! dropped; the pool keeps at most its byte cap, the rest is freed.

use bytes::Bytes;
use std::sync::{Mutex, MutexGuard};

/// Free payload buffers, by capacity.
pub struct PayloadPool {
    free: Mutex<Vec<Vec<u8>>>,
    max_kept: usize,
}

/// A pooled buffer lent to one payload.
struct Lent {
    buf: Vec<u8>,
    pool: &'static PayloadPool,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.pool.put(std::mem::take(&mut self.buf));
    }
}

impl PayloadPool {
    /// A pool that keeps at most `max_kept` bytes of free buffers.
    pub const fn new(max_kept: usize) -> PayloadPool {
        PayloadPool {
            free: Mutex::new(Vec::new()),
            max_kept,
        }
    }

    /// An empty buffer with room for `len` bytes: a free one large enough
    /// (the smallest), or a new one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        let mut free = self.lock();
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        match best {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                Vec::with_capacity(len)
            }
        }
    }

    /// `buf` as a payload whose buffer returns to this pool when dropped.
    pub fn wrap(&'static self, buf: Vec<u8>) -> Bytes {
        Bytes::from_owner(Lent { buf, pool: self })
    }

    fn put(&self, mut buf: Vec<u8>) {
        buf.clear();
        let mut free = self.lock();
        let kept: usize = free.iter().map(Vec::capacity).sum();
        if kept + buf.capacity() <= self.max_kept {
            free.push(buf);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Vec<u8>>> {
        // A panic while holding it leaves a plain list of buffers: usable.
        self.free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Bytes of free buffers kept.
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.lock().iter().map(Vec::capacity).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static POOL: PayloadPool = PayloadPool::new(3 << 20);

    #[test]
    fn buffers_come_back_when_the_payload_is_dropped_up_to_the_cap() {
        let mut a = POOL.take(1 << 20);
        a.extend_from_slice(&[7u8; 1 << 20]);
        let ptr = a.as_ptr();
        let bytes = POOL.wrap(a);
        let part = bytes.slice(10..20);
        drop(bytes);
        assert_eq!(POOL.kept(), 0, "a slice still holds it");
        assert_eq!(&part[..], &[7u8; 10]);
        drop(part);
        assert!(POOL.kept() >= 1 << 20);
        let b = POOL.take(1000);
        assert_eq!(b.as_ptr(), ptr, "reused");
        assert!(b.is_empty());
        // Beyond the cap, buffers are freed.
        let many: Vec<Bytes> = (0..5).map(|_| POOL.wrap(POOL.take(1 << 20))).collect();
        drop(many);
        assert!(POOL.kept() <= 3 << 20);
        drop(b);
    }
}
