//! The link between two VM hosts: TLS 1.3 with both certificates pinned
//! (the same trust as the storage daemons: `<state>/tls/trusted/`), one
//! request line and one answer line per connection, and the pipe that
//! carries QEMU's migration stream between a local unix socket and the
//! link, compressed in [`Frame`](crate::peer::Frame)s.

use crate::peer::{decode_frame, decode_line, encode_frame, encode_line, PeerAnswer, PeerRequest};
use crate::VmError;
use ferry_migration_engine::tls::{server_name, CertStore};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

pub type ClientLink = tokio_rustls::client::TlsStream<TcpStream>;
pub type ServerLink = tokio_rustls::server::TlsStream<TcpStream>;

/// How long connecting and the request/answer exchange may take.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(60);

fn peer_err(addr: &str, what: impl std::fmt::Display) -> VmError {
    VmError::Peer(format!("host {addr}: {what}"))
}

/// Open a TLS connection to a peer host's move listener.
pub async fn connect(certs: &CertStore, addr: &str) -> Result<ClientLink, VmError> {
    let cfg = certs.client_config().map_err(|e| peer_err(addr, e))?;
    let tcp = tokio::time::timeout(EXCHANGE_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| peer_err(addr, "connect timed out"))?
        .map_err(|e| peer_err(addr, e))?;
    tcp.set_nodelay(true).ok();
    tokio_rustls::TlsConnector::from(cfg)
        .connect(server_name(), tcp)
        .await
        .map_err(|e| peer_err(addr, format!("TLS: {e}")))
}

/// Read one line-delimited message; bytes after it are returned too.
pub async fn read_message<T: for<'de> serde::Deserialize<'de>, R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<(T, Vec<u8>), VmError> {
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 16 << 10];
    loop {
        if let Some(m) = decode_line::<T>(&mut buf).map_err(|e| VmError::Peer(e.to_string()))? {
            return Ok((m, buf));
        }
        let n = r
            .read(&mut chunk)
            .await
            .map_err(|e| VmError::Peer(format!("reading from peer: {e}")))?;
        if n == 0 {
            return Err(VmError::Peer("peer closed the connection".into()));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Send a request and read the answer; the connection is returned for
/// what follows (a stream), with any bytes read past the answer.
pub async fn exchange(
    certs: &CertStore,
    addr: &str,
    req: &PeerRequest,
    limit: Duration,
) -> Result<(PeerAnswer, ClientLink, Vec<u8>), VmError> {
    let fut = async {
        let mut link = connect(certs, addr).await?;
        link.write_all(&encode_line(req))
            .await
            .map_err(|e| peer_err(addr, e))?;
        link.flush().await.map_err(|e| peer_err(addr, e))?;
        let (a, rest) = read_message::<PeerAnswer, _>(&mut link).await?;
        Ok((a, link, rest))
    };
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| peer_err(addr, "no answer in time"))?
}

/// Send a request and insist on `ok`.
pub async fn call(
    certs: &CertStore,
    addr: &str,
    req: &PeerRequest,
    limit: Duration,
) -> Result<PeerAnswer, VmError> {
    let (a, _, _) = exchange(certs, addr, req, limit).await?;
    if a.ok {
        Ok(a)
    } else {
        Err(peer_err(addr, a.error.unwrap_or_else(|| "refused".into())))
    }
}

/// Bytes through a pipe: as QEMU wrote them, and as they went on the link.
#[derive(Debug, Default)]
pub struct PipeCounters {
    pub raw: AtomicU64,
    pub link: AtomicU64,
}

const CHUNK: usize = 256 << 10;

/// Carry QEMU's stream (`qemu`, a unix socket) over `link` in frames, both
/// ways, until both directions end. `pending` holds link bytes already
/// read. Each side ends its write half when its read half ends, so the
/// end of QEMU's stream reaches the other QEMU.
pub async fn pipe<Q, L>(
    qemu: Q,
    link: L,
    compress: bool,
    pending: Vec<u8>,
    counters: &PipeCounters,
) -> Result<(), VmError>
where
    Q: AsyncRead + AsyncWrite + Unpin,
    L: AsyncRead + AsyncWrite + Unpin,
{
    let (mut qr, mut qw) = tokio::io::split(qemu);
    let (mut lr, mut lw) = tokio::io::split(link);
    // Each direction ends its writer however it ends, so that an error on
    // one side reaches the process on the other as the end of its stream.
    let out = async {
        let r = async {
            let mut buf = vec![0u8; CHUNK];
            let mut frame = Vec::with_capacity(CHUNK + 64);
            loop {
                let n = qr
                    .read(&mut buf)
                    .await
                    .map_err(|e| VmError::Peer(format!("reading QEMU's stream: {e}")))?;
                if n == 0 {
                    break;
                }
                frame.clear();
                encode_frame(&buf[..n], compress, &mut frame);
                counters.raw.fetch_add(n as u64, Ordering::Relaxed);
                counters
                    .link
                    .fetch_add(frame.len() as u64, Ordering::Relaxed);
                lw.write_all(&frame)
                    .await
                    .map_err(|e| VmError::Peer(format!("link: {e}")))?;
            }
            Ok::<(), VmError>(())
        }
        .await;
        lw.shutdown().await.ok();
        r
    };
    let back = async {
        let r = async {
            let mut buf = pending;
            let mut chunk = vec![0u8; CHUNK];
            loop {
                while let Some(raw) =
                    decode_frame(&mut buf).map_err(|e| VmError::Peer(e.to_string()))?
                {
                    qw.write_all(&raw)
                        .await
                        .map_err(|e| VmError::Peer(format!("writing QEMU's stream: {e}")))?;
                }
                let n = lr
                    .read(&mut chunk)
                    .await
                    .map_err(|e| VmError::Peer(format!("link: {e}")))?;
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            if !buf.is_empty() {
                return Err(VmError::Peer("link ended inside a frame".into()));
            }
            Ok::<(), VmError>(())
        }
        .await;
        qw.shutdown().await.ok();
        r
    };
    let (a, b) = tokio::join!(out, back);
    a.and(b)
}
