//! The one NBD server loop of ferry. `ferry serve` (volumes of its pool)
//! and `ferry host` (volumes forwarded to whichever server holds them) are
//! both an [`NbdBackend`]: what exports exist, and how a request on one is
//! answered. Everything else is here, once: the newstyle handshake over the
//! socket (the I/O-free `ferry_nbd::ServerHandshake` does the protocol),
//! a per-step handshake timeout, the transmission loop that decodes
//! requests, bounds those in flight, runs each the way its backend says
//! ([`Dispatch`]), and a writer task that sends replies in completion order,
//! batching whatever is ready into one vectored write.
//!
//! Memory: every request is charged, before it is dispatched, the bytes it
//! will hold until its reply is written (a READ its length, a WRITE its
//! payload, others a little), against a per-connection budget and an
//! optional budget shared by all connections ([`ReplyBudget`]). A client
//! that stops reading its replies therefore stops being read, and holds at
//! most its budget; the bytes come back as the writer gets them out.
//!
//! Lifecycle of a connection: greeting, options until `NBD_OPT_GO`, then
//! requests until `NBD_CMD_DISC`, end of stream, a protocol error or
//! shutdown; in every case each request already accepted is finished and
//! answered before the socket closes (FLUSH semantics hold for a client
//! that disconnects right after a write), except when the server stops
//! and its storage leaves a request unanswered for [`CLOSE_GRACE`]: that
//! request is never acknowledged and the socket closes without it.

mod file_reply;
mod locked;
mod mapped;
mod payload;
mod tls;
mod writer;

pub use file_reply::{FileRange, SendFile};
pub use mapped::{MappedRange, PageLost};
pub use tls::{NbdTls, TlsSetupError};
pub use writer::{write_loop, Frames, Held, HeldFrames, Outgoing, Reply};

use bytes::{Bytes, BytesMut};
use ferry_nbd::{
    Command, ExportCatalog, HandshakeProgress, NbdError, Negotiated, Request, RequestDecoder,
    ServerHandshake, TlsMode,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a client may take over each handshake step: an idle client
/// must not hold a connection slot for long before it even chose an export.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a connection of a stopping server waits for its running
/// requests to be answered before it closes without them.
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Why a connection ended early.
#[derive(Debug, Error)]
pub enum ConnError {
    #[error("protocol error: {0}")]
    Protocol(#[from] NbdError),
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("handshake timed out")]
    Timeout,
    #[error("TLS handshake: {0}")]
    Tls(std::io::Error),
    /// The backend could not open the export the client chose.
    #[error("export {0:?} cannot be served: {1}")]
    Open(String, String),
}

/// How a request is answered.
pub enum Dispatch {
    /// Already answered (on the connection's task; it must not block).
    Ready(Bytes),
    /// Answered: the reply's header, then its data sent from a file's
    /// cached pages (a READ whose pages are all cached): by the kernel on
    /// a plain connection, encrypted from the mapped pages on the
    /// writer's task over TLS ([`SendFile`]).
    ReadyFile(Bytes, FileRange),
    /// Answer on tokio's blocking pool, on a thread of its own.
    Blocking(Box<dyn FnOnce() -> Bytes + Send>),
    /// Blocking work that is quick once started (a buffered write): it may
    /// run on one worker with the other such requests decoded from the same
    /// read of the socket, one after another, so a pipeline of small writes
    /// costs one thread hand-off and one reply wake-up instead of one each.
    /// `bytes` is its size, which bounds a batch.
    Batchable {
        work: Box<dyn FnOnce() -> Bytes + Send>,
        bytes: usize,
    },
    /// Answer on an async task.
    Async(Pin<Box<dyn Future<Output = Bytes> + Send>>),
}

/// One negotiated export on one connection: turns requests into answers.
pub trait ExportHandler: Send + Sync + 'static {
    /// How to answer `req`. `Ready` answers skip the in-flight bound.
    fn dispatch(self: &Arc<Self>, req: Request) -> Dispatch;
}

/// How many bytes of requests and replies may wait in memory.
#[derive(Debug, Clone)]
pub struct ReplyBudget {
    /// Per connection (raised to at least one largest request).
    pub per_connection: usize,
    /// Shared by every connection of the server, if bounded.
    pub total: Option<Arc<Semaphore>>,
}

impl Default for ReplyBudget {
    fn default() -> Self {
        ReplyBudget {
            per_connection: DEFAULT_CONNECTION_BUDGET,
            total: None,
        }
    }
}

/// Default bytes one connection may hold in requests and replies.
pub const DEFAULT_CONNECTION_BUDGET: usize = 64 << 20;

/// What one request is charged: the reply or payload it holds, plus room
/// for headers.
fn cost(req: &Request) -> u32 {
    let body = match (&req.payload, req.command) {
        (Some(p), _) => p.len() as u64,
        (None, Command::Read) => req.length,
        (None, _) => 0,
    };
    u32::try_from(body).unwrap_or(u32::MAX).saturating_add(4096)
}

/// What a server serves.
pub trait NbdBackend: Send + Sync + 'static {
    type Handler: ExportHandler;
    /// The exports the handshake offers.
    fn catalog(&self) -> Box<dyn ExportCatalog + '_>;
    /// Open the export the client chose.
    fn open(&self, neg: &Negotiated) -> Result<Arc<Self::Handler>, String>;
    /// Requests in flight per connection, beyond which reading pauses.
    fn max_in_flight(&self) -> usize {
        128
    }
    /// Bytes requests and replies may hold in memory.
    fn reply_budget(&self) -> ReplyBudget {
        ReplyBudget::default()
    }
    /// Offer extended headers (`NBD_OPT_EXTENDED_HEADERS`): the handler
    /// then gets 64-bit effect lengths and must answer in
    /// [`ferry_nbd::ReplyStyle::Extended`] where the negotiation says so.
    fn extended_headers(&self) -> bool {
        false
    }
}

/// A stream that splits into owned halves (TCP, unix).
pub trait SplitStream: std::os::fd::AsRawFd + Send + 'static {
    type Read: AsyncRead + Unpin + Send + 'static;
    type Write: SendFile + 'static;
    fn into_halves(self) -> (Self::Read, Self::Write);
}

impl SplitStream for tokio::net::TcpStream {
    type Read = tokio::net::tcp::OwnedReadHalf;
    type Write = tokio::net::tcp::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

impl SplitStream for tokio::net::UnixStream {
    type Read = tokio::net::unix::OwnedReadHalf;
    type Write = tokio::net::unix::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Read, Self::Write) {
        self.into_split()
    }
}

/// Serve one client connection until it ends or `shutdown` fires. With
/// `tls`, the client may (or, as [`NbdTls::mode`] says for its address,
/// must) upgrade the connection with `NBD_OPT_STARTTLS`.
pub async fn serve_connection<B, S>(
    mut stream: S,
    backend: &B,
    tls: Option<(NbdTls, TlsMode)>,
    shutdown: CancellationToken,
) -> Result<(), ConnError>
where
    B: NbdBackend,
    S: SplitStream + AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(&ServerHandshake::greeting()).await?;
    let mode = tls.as_ref().map_or(TlsMode::Off, |t| t.1);
    let mut hs = ServerHandshake::with_tls(mode).offer_extended_headers(backend.extended_headers());
    let mut buf = BytesMut::with_capacity(4096);
    match negotiate(&mut stream, &mut hs, &mut buf, backend).await? {
        Negotiation::Aborted => Ok(()),
        Negotiation::Done(neg) => {
            let (rd, wr) = stream.into_halves();
            run_export(rd, wr, buf, neg, backend, shutdown).await
        }
        Negotiation::StartTls => {
            let Some((tls, _)) = tls else {
                return Err(ConnError::Tls(std::io::Error::other(
                    "STARTTLS acked without TLS configured",
                )));
            };
            let mut stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.acceptor().accept(stream))
                .await
                .map_err(|_| ConnError::Timeout)?
                .map_err(ConnError::Tls)?;
            hs.tls_started();
            tracing::debug!("NBD client upgraded to TLS");
            match negotiate(&mut stream, &mut hs, &mut buf, backend).await? {
                Negotiation::Done(neg) => {
                    let (rd, wr) = locked::split(stream);
                    run_export(rd, wr, buf, neg, backend, shutdown).await
                }
                // A second STARTTLS is refused by the handshake itself.
                Negotiation::Aborted | Negotiation::StartTls => Ok(()),
            }
        }
    }
}

async fn run_export<B, R, W>(
    rd: R,
    wr: W,
    buf: BytesMut,
    neg: Negotiated,
    backend: &B,
    shutdown: CancellationToken,
) -> Result<(), ConnError>
where
    B: NbdBackend,
    R: AsyncRead + Unpin + Send + 'static,
    W: SendFile + 'static,
{
    let handler = backend
        .open(&neg)
        .map_err(|e| ConnError::Open(neg.export.name.clone(), e))?;
    tracing::debug!(export = %neg.export.name, structured = neg.structured_replies, extended = neg.extended_headers, "NBD transmission starts");
    let limits = Limits {
        in_flight: backend.max_in_flight(),
        budget: backend.reply_budget(),
        extended_headers: neg.extended_headers,
    };
    transmission(rd, wr, buf, handler, limits, shutdown).await
}

/// How option haggling ended.
enum Negotiation {
    Done(Negotiated),
    Aborted,
    StartTls,
}

async fn negotiate<B: NbdBackend, S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    hs: &mut ServerHandshake,
    buf: &mut BytesMut,
    backend: &B,
) -> Result<Negotiation, ConnError> {
    let mut out = BytesMut::new();
    loop {
        let progress = hs.feed(buf, backend.catalog().as_ref(), &mut out)?;
        if !out.is_empty() {
            stream.write_all(&out).await?;
            out.clear();
        }
        match progress {
            HandshakeProgress::Done(n) => return Ok(Negotiation::Done(*n)),
            HandshakeProgress::Aborted => return Ok(Negotiation::Aborted),
            HandshakeProgress::StartTls => {
                stream.flush().await?;
                return Ok(Negotiation::StartTls);
            }
            HandshakeProgress::NeedMore => {
                let n = tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.read_buf(buf))
                    .await
                    .map_err(|_| ConnError::Timeout)??;
                if n == 0 {
                    return Ok(Negotiation::Aborted);
                }
            }
        }
    }
}

struct Limits {
    in_flight: usize,
    budget: ReplyBudget,
    /// Requests come with extended headers.
    extended_headers: bool,
}

/// Requests in one batch at most, and their payload bytes: a batch is cut
/// there so that large writes still spread over the worker threads.
const BATCH_MOST: usize = 32;
const BATCH_BYTES: usize = 256 << 10;

/// One batched request: its work, its in-flight slot and its budget.
type Batched = (
    Box<dyn FnOnce() -> Bytes + Send>,
    OwnedSemaphorePermit,
    Held,
);

/// Batchable requests waiting to run together, each with what it holds,
/// and their payload bytes.
#[derive(Default)]
struct Batch {
    items: Vec<Batched>,
    bytes: usize,
}

impl Batch {
    /// Add a request; a full batch starts running.
    fn push(&mut self, work: Batched, bytes: usize, tracker: &TaskTracker, tx: &mpsc::Sender<Out>) {
        self.items.push(work);
        self.bytes += bytes;
        if self.items.len() >= BATCH_MOST || self.bytes >= BATCH_BYTES {
            self.flush(tracker, tx);
        }
    }

    /// Run the batch on one blocking worker, in order; its replies go to
    /// the writer together.
    fn flush(&mut self, tracker: &TaskTracker, tx: &mpsc::Sender<Out>) {
        self.bytes = 0;
        if self.items.is_empty() {
            return;
        }
        let items = std::mem::take(&mut self.items);
        let tx = tx.clone();
        tracker.spawn_blocking(move || {
            let mut replies = Vec::with_capacity(items.len());
            for (work, permit, held) in items {
                let bytes = work();
                drop(permit);
                replies.push(Reply::new(bytes, held));
            }
            // The client may be gone; its replies have nowhere to go.
            let _ = tx.blocking_send(Out::Many(replies));
        });
    }
}

/// An in-flight slot; when none is free, what is batched runs first (it
/// holds slots too), then this waits. `None`: the connection is ending.
async fn take_slot(
    slots: &Arc<Semaphore>,
    batch: &mut Batch,
    tracker: &TaskTracker,
    tx: &mpsc::Sender<Out>,
    shutdown: &CancellationToken,
) -> Option<OwnedSemaphorePermit> {
    if let Ok(p) = slots.clone().try_acquire_owned() {
        return Some(p);
    }
    batch.flush(tracker, tx);
    tokio::select! {
        p = slots.clone().acquire_owned() => p.ok(),
        () = shutdown.cancelled() => None,
    }
}

/// What starts a connection's requests: its in-flight slots, its tasks,
/// the writer's queue, and the daemon's shutdown.
struct Runner<'a> {
    slots: &'a Arc<Semaphore>,
    tracker: &'a TaskTracker,
    tx: &'a mpsc::Sender<Out>,
    shutdown: &'a CancellationToken,
}

impl Runner<'_> {
    /// Start one dispatched request, its budget charge `held`: answered
    /// at once, batched, or run on a worker thread or a task, its reply
    /// then going to the writer. False: the connection is ending.
    async fn start(&self, d: Dispatch, held: Held, batch: &mut Batch) -> bool {
        let (tracker, tx) = (self.tracker, self.tx);
        match d {
            Dispatch::Ready(bytes) => tx.send(Out::One(Reply::new(bytes, held))).await.is_ok(),
            Dispatch::ReadyFile(bytes, range) => {
                let reply = Reply {
                    bytes,
                    file: Some(range),
                    held,
                };
                tx.send(Out::One(reply)).await.is_ok()
            }
            Dispatch::Batchable { work, bytes } => {
                let Some(permit) = self.slot(batch).await else {
                    return false;
                };
                batch.push((work, permit, held), bytes, tracker, tx);
                true
            }
            Dispatch::Blocking(f) => {
                let Some(permit) = self.slot(batch).await else {
                    return false;
                };
                let tx = tx.clone();
                tracker.spawn_blocking(move || {
                    let bytes = f();
                    drop(permit);
                    // The client may be gone; its replies have nowhere to go.
                    let _ = tx.blocking_send(Out::One(Reply::new(bytes, held)));
                });
                true
            }
            Dispatch::Async(fut) => {
                let Some(permit) = self.slot(batch).await else {
                    return false;
                };
                let tx = tx.clone();
                tracker.spawn(async move {
                    let bytes = fut.await;
                    drop(permit);
                    let _ = tx.send(Out::One(Reply::new(bytes, held))).await;
                });
                true
            }
        }
    }

    /// An in-flight slot (see [`take_slot`]); `None`: the connection ends.
    async fn slot(&self, batch: &mut Batch) -> Option<OwnedSemaphorePermit> {
        take_slot(self.slots, batch, self.tracker, self.tx, self.shutdown).await
    }
}

/// Read a large WRITE payload of `len` bytes into a pooled buffer of its
/// own, starting with what `buf` holds of it (which it takes).
/// `Ok(None)`: the client closed mid-request or the daemon is stopping.
async fn read_payload<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut BytesMut,
    len: usize,
    shutdown: &CancellationToken,
) -> Result<Option<Vec<u8>>, ConnError> {
    let mut payload = PAYLOADS.take(len);
    payload.extend_from_slice(buf);
    buf.clear();
    while payload.len() < len {
        let want = (len - payload.len()) as u64;
        let mut rest = (&mut *rd).take(want);
        let n = tokio::select! {
            r = rest.read_buf(&mut payload) => r?,
            () = shutdown.cancelled() => return Ok(None),
        };
        if n == 0 {
            tracing::info!(bytes = payload.len(), "client closed mid-request");
            return Ok(None);
        }
    }
    Ok(Some(payload))
}

/// What the reader hands the writer: one reply or a batch's replies.
enum Out {
    One(Reply),
    Many(Vec<Reply>),
}

impl Frames for Out {
    fn append_to(self, out: &mut Outgoing, hold: &mut Vec<Held>) {
        match self {
            Out::One(r) => r.append_to(out, hold),
            Out::Many(rs) => {
                for r in rs {
                    r.append_to(out, hold);
                }
            }
        }
    }
}

/// Take `n` bytes of the connection's budget and of the shared one at
/// once, if both have room.
fn try_charge(conn: &Arc<Semaphore>, total: Option<&Arc<Semaphore>>, n: u32) -> Option<Held> {
    let c = conn.clone().try_acquire_many_owned(n).ok()?;
    let t = match total {
        Some(t) => Some(t.clone().try_acquire_many_owned(n).ok()?),
        None => None,
    };
    Some(Held::new(c, t))
}

/// Take `n` bytes of the connection's budget and of the shared one.
async fn charge(conn: &Arc<Semaphore>, total: Option<&Arc<Semaphore>>, n: u32) -> Option<Held> {
    let c = conn.clone().acquire_many_owned(n).await.ok()?;
    let t = match total {
        Some(t) => Some(t.clone().acquire_many_owned(n).await.ok()?),
        None => None,
    };
    Some(Held::new(c, t))
}

/// WRITE payloads at least this large are read into a buffer of their own.
const DIRECT_PAYLOAD_MIN: usize = 128 * 1024;
/// The buffers they are read into, shared by every connection.
static PAYLOADS: payload::PayloadPool = payload::PayloadPool::new(64 << 20);
/// A buffer for a reply of `len` bytes (a large READ's): from
/// [`DIRECT_PAYLOAD_MIN`] on it comes from the pool WRITE payloads use,
/// for the same reason (fresh 1 MiB blocks cost a page fault and a zeroed
/// page per 4 KiB); [`pooled`] freezes it so that it returns there once
/// the reply is written.
pub fn reply_buffer(len: usize) -> BytesMut {
    if len >= DIRECT_PAYLOAD_MIN {
        // An empty vector with room becomes a unique `Bytes`, which turns
        // into a `BytesMut` over the same allocation.
        Bytes::from(PAYLOADS.take(len))
            .try_into_mut()
            .unwrap_or_else(|_| BytesMut::with_capacity(len))
    } else {
        BytesMut::with_capacity(len)
    }
}

/// `reply` frozen; a pool-sized buffer goes back to the pool when its last
/// `Bytes` is dropped.
pub fn pooled(reply: BytesMut) -> Bytes {
    if reply.capacity() >= DIRECT_PAYLOAD_MIN {
        PAYLOADS.wrap(Vec::from(reply))
    } else {
        reply.freeze()
    }
}

/// Room made in the read buffer before each read: many small requests per
/// read, and at most this much of a large payload copied once.
const READ_AHEAD: usize = 64 * 1024;

async fn transmission<H: ExportHandler, R, W>(
    mut rd: R,
    wr: W,
    mut buf: BytesMut,
    handler: Arc<H>,
    limits: Limits,
    shutdown: CancellationToken,
) -> Result<(), ConnError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: SendFile + 'static,
{
    let max_in_flight = limits.in_flight.max(1);
    // At least one largest request must fit, or it would wait forever.
    let floor = usize::try_from(ferry_nbd::MAX_REQUEST_LEN).unwrap_or(usize::MAX) + 8192;
    let per_conn = limits
        .budget
        .per_connection
        .max(floor)
        .min(Semaphore::MAX_PERMITS);
    let budget = Arc::new(Semaphore::new(per_conn));
    let total = limits.budget.total.clone();
    let (tx, rx) = mpsc::channel::<Out>(max_in_flight + 8);
    let writer = tokio::spawn(write_loop(wr, rx));
    let slots = Arc::new(Semaphore::new(max_in_flight));
    let tracker = TaskTracker::new();
    let mut decoder = RequestDecoder::with_headers(limits.extended_headers);
    let mut result = Ok(());
    let mut batch = Batch::default();
    // A request whose payload was read outside `buf`.
    let mut ready: Option<Request> = None;
    let runner = Runner {
        slots: &slots,
        tracker: &tracker,
        tx: &tx,
        shutdown: &shutdown,
    };
    'conn: loop {
        loop {
            let req = match ready.take() {
                Some(r) => r,
                None => match decoder.decode(&mut buf) {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(e) => {
                        result = Err(e.into());
                        break 'conn;
                    }
                },
            };
            if req.command == Command::Disc {
                break 'conn;
            }
            // Wait (not reading further) until the budget has room.
            // An oversized READ is refused by validation; its charge is
            // capped so it cannot wait for more than the budget holds.
            let n = cost(&req).min(u32::try_from(per_conn).unwrap_or(u32::MAX));
            // What is batched runs before waiting: it holds budget too.
            let held = match try_charge(&budget, total.as_ref(), n) {
                Some(h) => h,
                None => {
                    batch.flush(&tracker, &tx);
                    tokio::select! {
                        h = charge(&budget, total.as_ref(), n) => match h {
                            Some(h) => h,
                            None => break 'conn,
                        },
                        () = shutdown.cancelled() => break 'conn,
                    }
                }
            };
            if !runner.start(handler.dispatch(req), held, &mut batch).await {
                break 'conn;
            }
        }
        // Everything decoded from this read is dispatched: run the batch.
        batch.flush(&tracker, &tx);
        // A large WRITE payload is read into a buffer of its own, taken
        // from a pool: growing `buf` under it would copy what was read so
        // far, and fresh memory per request costs a page fault and a
        // zeroed page per 4 KiB (both measured in 1 MiB writes; see
        // docs/benchmarks.md).
        if let Some(len) = decoder.pending_payload() {
            if len >= DIRECT_PAYLOAD_MIN && buf.len() < len {
                let payload = match read_payload(&mut rd, &mut buf, len, &shutdown).await {
                    Ok(Some(p)) => p,
                    Ok(None) => break 'conn,
                    Err(e) => {
                        result = Err(e);
                        break 'conn;
                    }
                };
                match decoder.complete_payload(PAYLOADS.wrap(payload)) {
                    Ok(req) => ready = Some(req),
                    Err(e) => {
                        result = Err(e.into());
                        break 'conn;
                    }
                }
                continue;
            }
        }
        buf.reserve(decoder.wanted(buf.len()).max(READ_AHEAD));
        let n = tokio::select! {
            r = rd.read_buf(&mut buf) => match r {
                Ok(n) => n,
                Err(e) => { result = Err(e.into()); break 'conn; }
            },
            () = shutdown.cancelled() => break 'conn,
        };
        if n == 0 {
            if !buf.is_empty() {
                tracing::info!(bytes = buf.len(), "client closed mid-request");
            }
            break;
        }
    }
    // Drain: every accepted request finishes and is answered, unless the
    // server is stopping and its storage does not answer within
    // [`CLOSE_GRACE`] (a cluster cut off): then the connection closes with
    // those requests unanswered, never acknowledged, so the client
    // re-issues them elsewhere instead of waiting on this server.
    batch.flush(&tracker, &tx);
    tracker.close();
    let drained = tokio::select! {
        () = tracker.wait() => true,
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(CLOSE_GRACE).await;
        } => false,
    };
    drop(tx);
    if !drained {
        // Requests still running hold the writer's queue open; their
        // replies have nowhere to go.
        tracing::warn!(
            running = tracker.len(),
            "closing with requests unanswered: the storage did not answer in time (the client re-issues them)"
        );
        writer.abort();
    }
    let _ = writer.await;
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_nbd::{ExportInfo, ReplyStyle, ReplyTo};

    /// One export whose FLUSH is answered at once and whose WRITE never
    /// is: storage that stopped answering.
    struct Stuck;

    impl ExportCatalog for Stuck {
        fn export(&self, name: &str) -> Option<ExportInfo> {
            (name == "v").then(|| ExportInfo {
                name: "v".into(),
                description: String::new(),
                size: 1 << 20,
                read_only: false,
                min_block: 1,
                preferred_block: 4096,
                max_block: 1 << 25,
                block_size_required: false,
                dirty_bitmaps: Vec::new(),
                resizable: false,
            })
        }
        fn exports(&self) -> Vec<ExportInfo> {
            self.export("v").into_iter().collect()
        }
    }

    struct StuckHandler(ReplyStyle);

    impl ExportHandler for StuckHandler {
        fn dispatch(self: &Arc<Self>, req: Request) -> Dispatch {
            if req.command == Command::Write {
                return Dispatch::Async(Box::pin(std::future::pending()));
            }
            let mut out = BytesMut::new();
            ReplyTo::new(self.0, &req).ok(&mut out);
            Dispatch::Ready(out.freeze())
        }
    }

    impl NbdBackend for Stuck {
        type Handler = StuckHandler;
        fn catalog(&self) -> Box<dyn ExportCatalog + '_> {
            Box::new(Stuck)
        }
        fn open(&self, neg: &Negotiated) -> Result<Arc<StuckHandler>, String> {
            Ok(Arc::new(StuckHandler(ReplyStyle::negotiated(
                neg.structured_replies,
                neg.extended_headers,
            ))))
        }
    }

    #[tokio::test]
    async fn a_stopping_server_closes_a_connection_its_storage_left_unanswered() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        let server = tokio::spawn(async move {
            let (sock, _) = listener.accept().await.unwrap();
            serve_connection(sock, &Stuck, None, stop).await
        });
        let client = Arc::new(
            ferry_client::NbdClient::connect(&addr, "v", &Default::default())
                .await
                .unwrap(),
        );
        let writer = client.clone();
        let write =
            tokio::spawn(async move { writer.write(0, Bytes::from(vec![7u8; 4096]), false).await });
        // The FLUSH is answered after the WRITE was read: it is in flight.
        client.flush().await.unwrap();
        shutdown.cancel();
        let ended = tokio::time::timeout(CLOSE_GRACE * 10, server)
            .await
            .expect("the connection closes without the unanswered write");
        ended.unwrap().unwrap();
        let w = tokio::time::timeout(CLOSE_GRACE * 10, write).await.unwrap();
        assert!(
            w.unwrap().is_err(),
            "the unanswered write is not acknowledged"
        );
    }

    #[test]
    fn large_reply_buffers_come_from_the_pool_and_go_back_to_it() {
        // No other test of this crate uses the shared pool.
        let len = 300 << 10;
        let mut b = reply_buffer(len);
        assert!(b.is_empty() && b.capacity() >= len);
        let ptr = b.as_ptr();
        b.extend_from_slice(&[9u8; 16]);
        b.resize(len, 1);
        let reply = pooled(b);
        assert_eq!(reply.len(), len);
        assert_eq!(&reply[..16], &[9u8; 16]);
        let tail = reply.slice(len - 4..);
        drop(reply);
        // A slice of the reply still holds the buffer.
        assert_ne!(reply_buffer(len).as_ptr(), ptr);
        drop(tail);
        assert_eq!(reply_buffer(len).as_ptr(), ptr, "reused once released");
        // Small replies are plain buffers.
        let small = reply_buffer(100);
        assert!(small.capacity() < DIRECT_PAYLOAD_MIN);
        assert_eq!(&pooled(small)[..], b"");
    }
}
