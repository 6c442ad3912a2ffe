//! Sockets for migrations: TCP with byte counters underneath TLS (so the
//! counts are what crossed the link), frame reading and writing, and the
//! bandwidth cap.

use super::MigrationError;
use bytes::BytesMut;
use ferry_migration::{FrameDecoder, Message};
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// Bytes that crossed a socket, TLS records and TCP payload included.
#[derive(Debug, Default)]
pub struct WireCounters {
    pub tx: AtomicU64,
    pub rx: AtomicU64,
}

/// A stream that counts what it reads and writes.
pub struct Counted<S> {
    inner: S,
    counters: Arc<WireCounters>,
}

impl<S> Counted<S> {
    pub fn new(inner: S, counters: Arc<WireCounters>) -> Self {
        Counted { inner, counters }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = (buf.filled().len() - before) as u64;
        self.counters.rx.fetch_add(n, Ordering::Relaxed);
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.counters.tx.fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Any byte stream a migration runs over (TLS or loopback plaintext).
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}
pub type BoxStream = Box<dyn Stream>;

/// Reads whole frames.
pub struct FrameReader<R> {
    r: R,
    buf: BytesMut,
    dec: FrameDecoder,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(r: R) -> Self {
        FrameReader {
            r,
            buf: BytesMut::with_capacity(1 << 20),
            dec: FrameDecoder::new(),
        }
    }

    /// The next message; `Ok(None)` at a clean end of stream between frames.
    pub async fn next(&mut self) -> Result<Option<Message>, MigrationError> {
        loop {
            match self.dec.decode(&mut self.buf) {
                Ok(Some(m)) => return Ok(Some(m)),
                Ok(None) => {}
                Err(_) if tls_record(&self.buf) => return Err(MigrationError::PeerSpeaksTls),
                Err(e) => return Err(e.into()),
            }
            let want = self.dec.wanted(&self.buf).max(64 << 10);
            self.buf.reserve(want);
            let n = self.r.read_buf(&mut self.buf).await?;
            if n == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                if tls_record(&self.buf) {
                    return Err(MigrationError::PeerSpeaksTls);
                }
                return Err(MigrationError::Link(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "connection closed in the middle of a frame",
                )));
            }
        }
    }

    /// The next message within `timeout`; end of stream is an error.
    pub async fn expect(&mut self, timeout: Duration) -> Result<Message, MigrationError> {
        match tokio::time::timeout(timeout, self.next()).await {
            Err(_) => Err(MigrationError::Link(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("peer sent nothing for {timeout:?}"),
            ))),
            Ok(Ok(Some(m))) => Ok(m),
            Ok(Ok(None)) => Err(MigrationError::Link(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection",
            ))),
            Ok(Err(e)) => Err(e),
        }
    }
}

/// Do `buf`'s first bytes look like a TLS record (change cipher spec,
/// alert, handshake or data, version 3.x)? A TLS listener answers a
/// plaintext Hello with an alert; no migration frame starts like that
/// (frames start with their magic).
pub(crate) fn tls_record(buf: &[u8]) -> bool {
    matches!(buf, [0x14..=0x17, 0x03, 0x00..=0x04, ..])
}

/// Write one message.
pub async fn send<W: AsyncWrite + Unpin>(w: &mut W, m: &Message) -> Result<usize, MigrationError> {
    let mut b = BytesMut::new();
    m.encode(&mut b);
    w.write_all(&b).await?;
    w.flush().await?;
    Ok(b.len())
}

/// Keeps a sender at or under `bytes_per_sec` on average (a token bucket
/// with a quarter second of burst).
pub struct RateLimit {
    bytes_per_sec: u64,
    start: Instant,
    sent: u64,
}

impl RateLimit {
    pub fn new(bytes_per_sec: u64) -> Self {
        RateLimit {
            bytes_per_sec,
            start: Instant::now(),
            sent: 0,
        }
    }

    /// Account for `n` bytes about to be sent and wait as long as needed.
    pub async fn take(&mut self, n: usize) {
        if self.bytes_per_sec == 0 {
            return;
        }
        self.sent += n as u64;
        let due = Duration::from_secs_f64(self.sent as f64 / self.bytes_per_sec as f64);
        let elapsed = self.start.elapsed();
        let burst = Duration::from_millis(250);
        if due > elapsed + burst {
            tokio::time::sleep(due - elapsed - burst).await;
        }
        // Forget history older than a few seconds so an idle spell does not
        // become a long burst later.
        if elapsed > Duration::from_secs(4) && due + Duration::from_secs(1) < elapsed {
            self.start = Instant::now();
            self.sent = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn first(bytes: &'static [u8]) -> Result<Option<Message>, MigrationError> {
        FrameReader::new(bytes).next().await
    }

    #[tokio::test]
    async fn a_tls_answer_to_a_plaintext_link_is_named_and_not_retried() {
        // A TLS 1.2/1.3 alert (what a TLS listener answers a plaintext
        // Hello with), and a longer handshake record.
        let e = first(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x32])
            .await
            .unwrap_err();
        assert!(matches!(e, MigrationError::PeerSpeaksTls), "{e}");
        assert!(!e.transient());
        let e = first(&[0x16, 0x03, 0x01, 0x00, 0x40, 1, 2, 3, 4, 5, 6, 7, 8, 9])
            .await
            .unwrap_err();
        assert!(matches!(e, MigrationError::PeerSpeaksTls), "{e}");
        // Anything else cut short stays a (retried) link error.
        let e = first(&[0x46, 0x52, 0x59]).await.unwrap_err();
        assert!(e.transient(), "{e}");
        assert!(first(&[]).await.unwrap().is_none());
    }
}
