//! The hypervisor's side of the agent: an NBD server (the same I/O-free
//! handshake and request decoder as the daemon) on TCP or a unix socket
//! whose one export forwards to the [`Upstream`].

use crate::{HostError, Upstream};
use bytes::{Bytes, BytesMut};
use ferry_client::ClientError;
use ferry_nbd::consts::*;
use ferry_nbd::{
    reply, validate, Command, ErrorCode, ExportCatalog, ExportInfo, HandshakeProgress, Request,
    RequestDecoder, ServerHandshake, TransmissionLimits,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const MAX_IN_FLIGHT: usize = 128;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// A TCP or unix listening socket.
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener, std::path::PathBuf),
}

trait Conn: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Conn for T {}

impl Listener {
    /// `unix:PATH` or `HOST:PORT`.
    pub async fn bind(addr: &str) -> Result<Listener, HostError> {
        let err = |source| HostError::Listen {
            addr: addr.to_string(),
            source,
        };
        if let Some(path) = addr.strip_prefix("unix:") {
            let p = std::path::PathBuf::from(path);
            // A socket left by an agent that died; a live one refuses to be removed.
            if p.exists() && std::os::unix::net::UnixStream::connect(&p).is_err() {
                let _ = std::fs::remove_file(&p);
            }
            let l = tokio::net::UnixListener::bind(&p).map_err(err)?;
            Ok(Listener::Unix(l, p))
        } else {
            let l = tokio::net::TcpListener::bind(addr).await.map_err(err)?;
            Ok(Listener::Tcp(l))
        }
    }

    /// The bound TCP address (tests bind port 0).
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        match self {
            Listener::Tcp(l) => l.local_addr().ok(),
            Listener::Unix(..) => None,
        }
    }

    async fn accept(&self) -> std::io::Result<Box<dyn Conn>> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok(Box::new(s))
            }
            Listener::Unix(l, _) => {
                let (s, _) = l.accept().await?;
                Ok(Box::new(s))
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The one export: the volume, under its name and as the default export.
struct OneExport<'a>(&'a Upstream);

impl ExportCatalog for OneExport<'_> {
    fn export(&self, name: &str) -> Option<ExportInfo> {
        if !name.is_empty() && name != self.0.volume() {
            return None;
        }
        let d = self.0.details();
        Some(ExportInfo {
            name: self.0.volume().to_string(),
            description: format!("ferry volume {} via ferry host", self.0.volume()),
            size: d.size,
            read_only: d.flags & FLAG_READ_ONLY != 0,
            min_block: d.min_block.max(1),
            preferred_block: d.preferred_block.max(4096),
            max_block: d.max_block.max(1 << 20),
            block_size_required: false,
            dirty_bitmaps: Vec::new(),
        })
    }

    fn exports(&self) -> Vec<ExportInfo> {
        self.export("").into_iter().collect()
    }
}

/// Accept hypervisor connections until `shutdown`.
pub async fn serve(listener: Listener, up: Arc<Upstream>, shutdown: CancellationToken) {
    let tracker = TaskTracker::new();
    loop {
        let conn = tokio::select! {
            c = listener.accept() => match c {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let up = up.clone();
        let sd = shutdown.clone();
        tracker.spawn(async move {
            if let Err(e) = connection(conn, &up, sd).await {
                tracing::info!(error = %e, "client connection ended");
            }
        });
    }
    tracker.close();
    tracker.wait().await;
}

async fn connection(
    mut s: Box<dyn Conn>,
    up: &Arc<Upstream>,
    shutdown: CancellationToken,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    s.write_all(&ServerHandshake::greeting()).await?;
    let mut hs = ServerHandshake::new();
    let mut buf = BytesMut::with_capacity(4096);
    let mut out = BytesMut::new();
    let neg = loop {
        let p = hs.feed(&mut buf, &OneExport(up), &mut out)?;
        if !out.is_empty() {
            s.write_all(&out).await?;
            out.clear();
        }
        match p {
            HandshakeProgress::Done(n) => break n,
            HandshakeProgress::Aborted => return Ok(()),
            HandshakeProgress::NeedMore => {
                let n = tokio::time::timeout(HANDSHAKE_TIMEOUT, s.read_buf(&mut buf)).await??;
                if n == 0 {
                    return Ok(());
                }
            }
        }
    };
    let limits = TransmissionLimits {
        size: neg.export.size,
        read_only: neg.export.read_only,
        structured: neg.structured_replies,
        has_meta_contexts: !neg.meta_contexts.is_empty(),
        min_block: 1,
    };
    let structured = neg.structured_replies;
    let block_status = !neg.meta_contexts.is_empty();
    let (mut rd, mut wr) = tokio::io::split(s);
    let (tx, mut rx) = mpsc::channel::<Bytes>(MAX_IN_FLIGHT + 8);
    let writer = tokio::spawn(async move {
        while let Some(b) = rx.recv().await {
            if wr.write_all(&b).await.is_err() {
                while rx.recv().await.is_some() {}
                return;
            }
            if rx.is_empty() && wr.flush().await.is_err() {
                while rx.recv().await.is_some() {}
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let tracker = TaskTracker::new();
    let mut decoder = RequestDecoder::new();
    'conn: loop {
        while let Some(req) = decoder.decode(&mut buf)? {
            if req.command == Command::Disc {
                break 'conn;
            }
            let permit = slots.clone().acquire_owned().await?;
            let (up, tx) = (up.clone(), tx.clone());
            tracker.spawn(async move {
                let r = forward(&up, &req, &limits, structured, block_status).await;
                drop(permit);
                let _ = tx.send(r).await;
            });
        }
        buf.reserve(decoder.wanted(buf.len()).max(256 << 10));
        let n = tokio::select! {
            r = rd.read_buf(&mut buf) => r?,
            () = shutdown.cancelled() => break,
        };
        if n == 0 {
            break;
        }
    }
    tracker.close();
    tracker.wait().await;
    drop(tx);
    let _ = writer.await;
    Ok(())
}

fn error_reply(structured: bool, req: &Request, code: ErrorCode, msg: &str) -> Bytes {
    let mut b = BytesMut::new();
    if structured && matches!(req.command, Command::Read | Command::BlockStatus) {
        reply::error(&mut b, req.cookie, code, msg);
    } else {
        reply::simple(&mut b, req.cookie, Some(code));
    }
    b.freeze()
}

fn code_of(e: &ClientError) -> ErrorCode {
    match e {
        ClientError::Request { code, .. } => *code,
        _ => ErrorCode::Io,
    }
}

/// Answer one request by forwarding it upstream.
async fn forward(
    up: &Upstream,
    req: &Request,
    limits: &TransmissionLimits,
    structured: bool,
    block_status: bool,
) -> Bytes {
    if let Err(code) = validate(req, limits) {
        return error_reply(structured, req, code, "invalid request");
    }
    let (off, len, flags) = (req.offset, req.length, req.flags);
    let r: Result<Bytes, ClientError> = match req.command {
        Command::Read => up
            .call(|c| async move { c.read(off, len).await })
            .await
            .map(|data| {
                let mut b = BytesMut::with_capacity(40 + data.len());
                if structured {
                    reply::offset_data_header(&mut b, req.cookie, off, len);
                } else {
                    reply::simple(&mut b, req.cookie, None);
                }
                b.extend_from_slice(&data);
                b.freeze()
            }),
        Command::BlockStatus if block_status => up
            .call(|c| async move {
                c.block_status(off, len, flags & CMD_FLAG_REQ_ONE != 0)
                    .await
            })
            .await
            .map(|ctxs| {
                let mut b = BytesMut::new();
                for (_, extents) in ctxs.iter().take(1) {
                    reply::block_status(
                        &mut b,
                        req.cookie,
                        ferry_nbd::BASE_ALLOCATION_ID,
                        extents,
                        false,
                    );
                }
                reply::done(&mut b, req.cookie);
                b.freeze()
            }),
        Command::BlockStatus => Err(ClientError::Request {
            code: ErrorCode::Inval,
            message: "no meta context selected".into(),
        }),
        cmd => {
            let payload = req.payload.clone();
            up.call(|c| {
                let p = payload.clone();
                async move { c.raw(cmd, flags, off, len, p).await }
            })
            .await
            .map(|()| {
                let mut b = BytesMut::with_capacity(16);
                reply::simple(&mut b, req.cookie, None);
                b.freeze()
            })
        }
    };
    match r {
        Ok(b) => b,
        Err(e) => error_reply(structured, req, code_of(&e), &e.to_string()),
    }
}
