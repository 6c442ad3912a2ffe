//! The two halves of a stream that cannot be split in the kernel (TLS):
//! each poll takes one plain mutex for its duration.
//!
//! `tokio::io::split` answers `Pending` to the half that finds the stream
//! taken and wakes it once the other half lets go: under load, a task
//! wakeup for every collision between the connection's reader (decrypting
//! requests) and its writer (encrypting replies). A poll holds the stream
//! for microseconds, so here the other half simply waits for it.

use parking_lot::Mutex;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The reading half.
pub struct LockedRead<S>(Arc<Mutex<S>>);

/// The writing half.
pub struct LockedWrite<S>(Arc<Mutex<S>>);

/// Split `stream` into halves that share it under one mutex.
pub fn split<S: AsyncRead + AsyncWrite + Unpin>(stream: S) -> (LockedRead<S>, LockedWrite<S>) {
    let s = Arc::new(Mutex::new(stream));
    (LockedRead(s.clone()), LockedWrite(s))
}

impl<S> LockedWrite<S> {
    /// Run `f` on the stream, holding it for that long (one poll's work).
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        f(&mut self.0.lock())
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for LockedRead<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.lock()).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for LockedWrite<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.lock()).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0.lock()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.lock().is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.lock()).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0.lock()).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn both_halves_work_at_once_in_both_directions() {
        let (a, b) = tokio::io::duplex(4096);
        let (mut ar, mut aw) = split(a);
        let (mut br, mut bw) = split(b);
        let n = 1 << 20;
        let data: Vec<u8> = (0..n).map(|i| u8::try_from(i % 251).unwrap()).collect();
        let d2 = data.clone();
        // Each end writes 1 MiB while it reads the other's: neither may wait
        // for the other half of its own stream to finish.
        let w1 = tokio::spawn(async move { aw.write_all(&d2).await.unwrap() });
        let d3 = data.clone();
        let w2 = tokio::spawn(async move { bw.write_all(&d3).await.unwrap() });
        let mut got_a = vec![0u8; n];
        let mut got_b = vec![0u8; n];
        let (ra, rb) = tokio::join!(ar.read_exact(&mut got_a), br.read_exact(&mut got_b));
        ra.unwrap();
        rb.unwrap();
        w1.await.unwrap();
        w2.await.unwrap();
        assert!(got_a == data && got_b == data);
    }
}
