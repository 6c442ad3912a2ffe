//! The hypervisor's side of the agent: the agent's volumes as an NBD
//! backend of `ferry_nbd_server` (the same connection loop the daemon
//! uses), on TCP or unix listeners. Each request is forwarded to the
//! volume's [`Upstream`].

use crate::{Agent, HostError, Upstream};
use bytes::{Bytes, BytesMut};
use ferry_client::ClientError;
use ferry_nbd::consts::*;
use ferry_nbd::{
    validate, Command, ErrorCode, ExportCatalog, ExportInfo, Negotiated, ReplyStyle, ReplyTo,
    Request, TransmissionLimits,
};
use ferry_nbd_server::{serve_connection, Dispatch, ExportHandler, NbdBackend};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A TCP or unix listening socket.
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener, std::path::PathBuf),
}

enum Accepted {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

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

    async fn accept(&self) -> std::io::Result<Accepted> {
        match self {
            Listener::Tcp(l) => {
                let (s, _) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok(Accepted::Tcp(s))
            }
            Listener::Unix(l, _) => Ok(Accepted::Unix(l.accept().await?.0)),
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

fn export_info(up: &Upstream) -> ExportInfo {
    let d = up.details();
    ExportInfo {
        name: up.volume().to_string(),
        description: format!("ferry volume {} via ferry host", up.volume()),
        size: d.size,
        read_only: d.flags & FLAG_READ_ONLY != 0,
        min_block: d.min_block.max(1),
        preferred_block: d.preferred_block.max(4096),
        max_block: d.max_block.max(1 << 20),
        block_size_required: false,
        dirty_bitmaps: Vec::new(),
        // Resizing goes to the storage daemon's admin API, not through
        // the agent.
        resizable: false,
    }
}

/// The agent's volumes as exports; the empty (default) name is the volume
/// when the agent forwards exactly one.
struct AgentCatalog<'a>(&'a Agent);

impl ExportCatalog for AgentCatalog<'_> {
    fn export(&self, name: &str) -> Option<ExportInfo> {
        if name.is_empty() {
            let all = self.0.list();
            return match all.as_slice() {
                [only] => Some(export_info(only)),
                _ => None,
            };
        }
        let found = self.0.get(name).map(|u| export_info(&u));
        if found.is_none() {
            // A hypervisor retrying this backs off (QEMU: 1, 2, 4, 8, 16 s),
            // so a refusal here can become a guest's stall of seconds.
            tracing::warn!(volume = %name, "a client asked for a volume not attached here");
        }
        found
    }

    fn exports(&self) -> Vec<ExportInfo> {
        self.0.list().iter().map(|u| export_info(u)).collect()
    }
}

/// One client connection's export.
pub struct Forwarder {
    up: Arc<Upstream>,
    limits: TransmissionLimits,
    /// Compact headers only (the agent does not offer extended ones).
    style: ReplyStyle,
    block_status: bool,
    opened: std::time::Instant,
}

/// A hypervisor's connections come and go with its guest (start, a move's
/// arrival, QEMU's reconnect after an error): each is logged, so a guest's
/// stall can be told from its disk connection being away.
impl Drop for Forwarder {
    fn drop(&mut self) {
        tracing::info!(
            volume = %self.up.volume(),
            after_s = self.opened.elapsed().as_secs_f64(),
            "a client's connection to the volume closed"
        );
    }
}

struct AgentBackend(Arc<Agent>);

impl NbdBackend for AgentBackend {
    type Handler = Forwarder;

    fn reply_budget(&self) -> ferry_nbd_server::ReplyBudget {
        ferry_nbd_server::ReplyBudget {
            total: Some(self.0.budget_total.clone()),
            ..Default::default()
        }
    }

    fn catalog(&self) -> Box<dyn ExportCatalog + '_> {
        Box::new(AgentCatalog(&self.0))
    }

    fn open(&self, neg: &Negotiated) -> Result<Arc<Forwarder>, String> {
        let up = self
            .0
            .get(&neg.export.name)
            .ok_or_else(|| format!("volume {} is no longer attached", neg.export.name))?;
        tracing::info!(volume = %neg.export.name, "a client opened the volume");
        Ok(Arc::new(Forwarder {
            up,
            limits: TransmissionLimits {
                min_block: 1,
                ..neg.limits(neg.export.size, neg.export.read_only)
            },
            style: neg.reply_style(),
            block_status: !neg.meta_contexts.is_empty(),
            opened: std::time::Instant::now(),
        }))
    }
}

impl ExportHandler for Forwarder {
    fn dispatch(self: &Arc<Self>, req: Request) -> Dispatch {
        let f = self.clone();
        Dispatch::Async(Box::pin(async move { f.forward(&req).await }))
    }
}

/// Accept hypervisor connections until `shutdown`; a detached volume
/// stays served on the connections already open to it.
pub async fn serve(listener: Listener, agent: Arc<Agent>, shutdown: CancellationToken) {
    let backend = Arc::new(AgentBackend(agent));
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
        let (b, sd) = (backend.clone(), shutdown.clone());
        tracker.spawn(async move {
            let r = match conn {
                Accepted::Tcp(s) => serve_connection(s, b.as_ref(), None, sd).await,
                Accepted::Unix(s) => serve_connection(s, b.as_ref(), None, sd).await,
            };
            if let Err(e) = r {
                tracing::info!(error = %e, "client connection ended");
            }
        });
    }
    tracker.close();
    tracker.wait().await;
}

fn error_reply(to: ReplyTo, code: ErrorCode, msg: &str) -> Bytes {
    let mut b = BytesMut::new();
    to.error(&mut b, code, msg);
    b.freeze()
}

fn code_of(e: &ClientError) -> ErrorCode {
    match e {
        ClientError::Request { code, .. } => *code,
        _ => ErrorCode::Io,
    }
}

/// A guest request that takes this long is logged (with what it was), so a
/// stall the guest saw can be placed in time against a move's phases.
const SLOW_REQUEST: Duration = Duration::from_millis(100);

impl Forwarder {
    /// Answer one request by forwarding it upstream.
    async fn forward(&self, req: &Request) -> Bytes {
        let t0 = std::time::Instant::now();
        let (reply, ok) = self.forward_inner(req).await;
        let took = t0.elapsed();
        self.up.io.record(req.command, req.length, took, ok);
        if took >= SLOW_REQUEST {
            tracing::warn!(
                volume = %self.up.volume(),
                command = ?req.command,
                offset = req.offset,
                length = req.length,
                ms = took.as_millis(),
                "slow guest request"
            );
        }
        reply
    }

    async fn forward_inner(&self, req: &Request) -> (Bytes, bool) {
        let to = ReplyTo::new(self.style, req);
        if let Err(code) = validate(req, &self.limits) {
            return (error_reply(to, code, "invalid request"), false);
        }
        // Compact requests: every length fits 32 bits.
        let Ok(len) = u32::try_from(req.length) else {
            return (
                error_reply(to, ErrorCode::Overflow, "length over 32 bits"),
                false,
            );
        };
        let up = &self.up;
        let (off, flags) = (req.offset, req.flags);
        let r: Result<Bytes, ClientError> = match req.command {
            Command::Read => up
                .call(|c| async move { c.read(off, len).await })
                .await
                .map(|data| {
                    let mut b = BytesMut::with_capacity(40 + data.len());
                    to.read_header(&mut b, len);
                    b.extend_from_slice(&data);
                    b.freeze()
                }),
            Command::BlockStatus if self.block_status => up
                .call(|c| async move {
                    c.block_status(off, len, flags & CMD_FLAG_REQ_ONE != 0)
                        .await
                })
                .await
                .map(|ctxs| {
                    let mut b = BytesMut::new();
                    for (_, extents) in ctxs.iter().take(1) {
                        let extents: Vec<(u64, u32)> =
                            extents.iter().map(|(l, f)| (u64::from(*l), *f)).collect();
                        to.block_status(&mut b, ferry_nbd::BASE_ALLOCATION_ID, &extents);
                    }
                    to.done(&mut b);
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
                    to.ok(&mut b);
                    b.freeze()
                })
            }
        };
        match r {
            Ok(b) => (b, true),
            Err(e) => (error_reply(to, code_of(&e), &e.to_string()), false),
        }
    }
}
