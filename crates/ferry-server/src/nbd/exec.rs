//! Executing validated requests on a volume, and the one place where storage
//! errors become NBD errno values.

use super::sole_reader::Reader;
use crate::config::SendfileReads;
use crate::metrics::OpMetrics;
use crate::ServerState;
use bytes::{Bytes, BytesMut};
use ferry_nbd::consts::*;
use ferry_nbd::handshake::MetaContext;
use ferry_nbd::{
    validate, Command, ErrorCode, Negotiated, ReplyStyle, ReplyTo, Request, TransmissionLimits,
};
use ferry_nbd_server::FileRange;
use ferry_storage::{StorageError, Volume, ZeroMode};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::Arc;
use std::time::Instant;

/// Most extents sent for one context in one BLOCK_STATUS reply.
const MAX_EXTENTS: usize = 2048;

/// Per-connection state shared by the request tasks.
pub struct ConnContext {
    volume: Arc<Volume>,
    /// Counts this connection as a client of the volume.
    _hold: ferry_storage::HoldGuard,
    /// What was negotiated: validation limits and the reply style come
    /// from it.
    neg: Negotiated,
    in_flight: Gauge,
    reads_from_file: Counter,
    /// When large cached READs may be sent from the file
    /// (`nbd.sendfile_reads`; on TLS connections `Always`, encrypted from
    /// the mapped pages, if `nbd.mapped_tls_reads`, else `Off`).
    sendfile_reads: SendfileReads,
    /// This connection's place in the daemon's
    /// [`SoleReader`](super::sole_reader::SoleReader).
    reader: Reader,
    metrics: [OpMetrics; 8],
    /// RESIZE may not grow past `storage.max_volume_size`, nor by more
    /// than the pool's file system has free.
    max_size: u64,
    pool: Arc<ferry_storage::Pool>,
}

const OPS: [Command; 8] = [
    Command::Read,
    Command::Write,
    Command::Flush,
    Command::Trim,
    Command::Cache,
    Command::WriteZeroes,
    Command::BlockStatus,
    Command::Disc,
];

impl ConnContext {
    pub fn new(volume: Arc<Volume>, neg: &Negotiated, state: &ServerState) -> Self {
        let name = volume.name();
        ConnContext {
            neg: neg.clone(),
            in_flight: state.metrics.in_flight(&name),
            reads_from_file: state.metrics.reads_from_file(&name),
            sendfile_reads: if neg.tls {
                // Each connection encrypts its own: no cost shared with
                // the clients' receive work as sendfile's is.
                if state.config.nbd.mapped_tls_reads {
                    SendfileReads::Always
                } else {
                    SendfileReads::Off
                }
            } else {
                state.config.nbd.sendfile_reads
            },
            reader: state.sole_reader.reader(),
            _hold: volume.hold(ferry_storage::Holder::NbdClient),
            metrics: OPS.map(|c| state.metrics.op(&name, c.name())),
            volume,
            max_size: state.config.storage.max_volume_size,
            pool: state.pool.clone(),
        }
    }

    /// Writes wait for the device (O_DIRECT, or an RBD image): each is
    /// worth a worker of its own rather than a place in a batch.
    pub fn writes_wait(&self) -> bool {
        !self.volume.page_cached()
    }

    /// A WRITE librbd takes asynchronously (an RBD image's volume; a FUA
    /// write goes to a thread, which flushes after it).
    pub fn writes_async(&self, req: &Request) -> bool {
        req.command == Command::Write && !req.has_flag(CMD_FLAG_FUA) && self.volume.on_ceph()
    }

    /// Worth trying a large READ/WRITE without blocking on an async task?
    pub fn may_try_nowait(&self, req: &Request) -> bool {
        match req.command {
            Command::Read => self.volume.page_cached(),
            Command::Write => self.volume.nowait_writes() && !req.has_flag(CMD_FLAG_FUA),
            _ => false,
        }
    }

    /// Whether this large READ may go by sendfile, as `nbd.sendfile_reads`
    /// says (asked once per READ: it counts for [`SoleReader`]).
    fn may_sendfile(&self) -> bool {
        match self.sendfile_reads {
            SendfileReads::Off => false,
            SendfileReads::Always => true,
            SendfileReads::SoleReader => self.reader.note_read(),
        }
    }

    fn op_metrics(&self, c: Command) -> &OpMetrics {
        let i = OPS.iter().position(|x| *x == c).unwrap_or(OPS.len() - 1);
        &self.metrics[i]
    }
}

/// Map a storage error to the errno the client sees.
pub fn errno_for(e: &StorageError, cmd: Command) -> ErrorCode {
    match e {
        StorageError::OutOfRange { .. } if matches!(cmd, Command::Write | Command::WriteZeroes) => {
            ErrorCode::NoSpc
        }
        StorageError::OutOfRange { .. } | StorageError::Invalid(_) => ErrorCode::Inval,
        StorageError::ReadOnly(_) | StorageError::InUse { .. } => ErrorCode::Perm,
        StorageError::NotFast => ErrorCode::NotSup,
        // Until the sanitize ends (NBD has no "not ready").
        StorageError::Sanitizing(_) | StorageError::SanitizeFailed(_) => ErrorCode::Io,
        // The client reconnects and learns the new location (ferry host does).
        StorageError::NotFound(_) | StorageError::Moved { .. } | StorageError::InDoubt { .. } => {
            ErrorCode::Shutdown
        }
        _ => match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorCode::NoSpc,
            Some(libc::ENOMEM) => ErrorCode::NoMem,
            // The cluster fenced this gateway (EBLOCKLISTED): another
            // serves the volume now, and this one is stopping.
            Some(libc::ESHUTDOWN) => ErrorCode::Shutdown,
            _ => ErrorCode::Io,
        },
    }
}

/// Largest READ tried inline on the event loop. Bigger copies are spread
/// over worker threads instead (measured: 1 MiB reads inline ran at half
/// the rate of 1 MiB reads on the worker pool).
const INLINE_READ_MAX: u64 = 128 << 10;
/// READs from this size on, with structured replies, answer the holes of
/// a sparse volume with `OFFSET_HOLE` chunks instead of zeroes on the wire.
const SPARSE_READ_MIN: u32 = 64 << 10;
/// Holes smaller than this go as data: the file system's granularity, and
/// not worth a chunk of their own.
const HOLE_MIN: u64 = 4096;
/// Allocation extents looked at for one READ; the rest goes as data.
const READ_EXTENTS: usize = 64;
/// Largest WRITE tried inline (its payload is already in memory). Up to
/// 1 MiB the copy into the page cache costs less than handing the write to
/// a worker thread and its reply back (measured: 1 MiB writes 9-19% more
/// IOPS on one connection, 21-53% on four; NBD-over-TLS writes of 256 KiB
/// with 17-37% less server CPU; docs/benchmarks.md).
const INLINE_WRITE_MAX: u64 = 1 << 20;

impl ConnContext {
    fn limits(&self) -> TransmissionLimits {
        self.neg.limits(self.volume.size(), self.volume.read_only())
    }

    /// How to frame the reply to `req`.
    fn to(&self, req: &Request) -> ReplyTo {
        ReplyTo::new(self.style(), req)
    }

    fn style(&self) -> ReplyStyle {
        self.neg.reply_style()
    }

    /// Record metrics for a finished request and encode its reply.
    fn finish(&self, req: &Request, start: Instant, out: Outcome) -> Bytes {
        let m = self.op_metrics(req.command);
        m.ops.inc();
        m.size.observe(req.length as f64);
        m.latency.observe(start.elapsed().as_secs_f64());
        match out {
            Ok(bytes) => {
                if matches!(req.command, Command::Read | Command::Write) {
                    m.bytes.inc_by(req.length);
                }
                bytes
            }
            Err((code, msg)) => {
                m.errors.inc();
                tracing::debug!(op = req.command.name(), offset = req.offset, len = req.length, %code, %msg, "request failed");
                error_reply(self, req, code, &msg)
            }
        }
    }
}

/// Try to serve a request on the event loop without blocking: invalid
/// requests, and READs/WRITEs the page cache can take at once (RWF_NOWAIT).
/// `None` means: run [`execute_blocking`] on a worker thread.
pub fn try_inline(ctx: &ConnContext, req: &Request) -> Option<Bytes> {
    let start = Instant::now();
    if let Err(code) = validate(req, &ctx.limits()) {
        let msg = format!("invalid {} request", req.command.name());
        return Some(ctx.finish(req, start, Err((code, msg))));
    }
    let small = match req.command {
        Command::Read => req.length <= INLINE_READ_MAX,
        Command::Write => req.length <= INLINE_WRITE_MAX,
        _ => false,
    };
    if !small {
        return None;
    }
    if req.command == Command::Write && !req.has_flag(CMD_FLAG_FUA) {
        // A small buffered write costs less than handing it to a thread.
        let data = req.payload.as_deref().unwrap_or_default();
        let out = match ctx.volume.write_buffered_now(req.offset, data) {
            Ok(true) => Ok(ok_reply(ctx, req)),
            Ok(false) => return None,
            Err(e) => Err((errno_for(&e, req.command), e.to_string())),
        };
        return Some(ctx.finish(req, start, out));
    }
    attempt_nowait(ctx, req, None).map(|out| ctx.finish(req, start, out))
}

/// How a READ's pieces lie: `(offset, length, hole)`, holes worth a chunk
/// apart from the data.
pub type Pieces = Vec<(u64, u64, bool)>;

/// What [`try_file_reply`] made of a request.
pub enum FileReply {
    /// Answered: the header now, the data from the volume's file.
    Ready(Bytes, FileRange),
    /// A cached READ over a hole worth a chunk: its pieces, for the copy
    /// that answers it (so the extents are not asked for twice).
    Sparse(Pieces),
    /// Answered another way, nothing learnt.
    Elsewhere,
}

/// A large READ whose pages are all in the page cache: answered now with
/// its header, its data to be sent from the volume's file by the kernel
/// (`sendfile`) on a plain connection, or encrypted from the mapped pages
/// over TLS, so no copy into a buffer of ours is made. Otherwise answered
/// another way (`nbd.sendfile_reads` off or not now, `nbd.mapped_tls_reads`
/// off over TLS, a hole worth a chunk,
/// pages not cached, an RBD image or O_DIRECT, or an invalid request).
pub fn try_file_reply(ctx: &ConnContext, req: &Request) -> FileReply {
    if req.command != Command::Read || req.length <= INLINE_READ_MAX || !ctx.may_sendfile() {
        return FileReply::Elsewhere;
    }
    let start = Instant::now();
    if validate(req, &ctx.limits()).is_err() {
        // Answered on the worker thread, which reports it.
        return FileReply::Elsewhere;
    }
    // Asked first: a hole no one read is not cached, so a sparse READ
    // rarely pays for both questions.
    let Ok(Some(file)) = ctx.volume.cached_file(req.offset, req.length) else {
        return FileReply::Elsewhere;
    };
    if let Some(pieces) = sparse_pieces(ctx, req) {
        return FileReply::Sparse(pieces);
    }
    // A validated READ is at most 32 MiB.
    let Ok(len) = u32::try_from(req.length) else {
        return FileReply::Elsewhere;
    };
    let mut head = BytesMut::with_capacity(ctx.style().read_header_len());
    ctx.to(req).read_header(&mut head, len);
    let range = FileRange {
        file,
        offset: req.offset,
        len: len as usize,
    };
    ctx.reads_from_file.inc();
    FileReply::Ready(ctx.finish(req, start, Ok(head.freeze())), range)
}

/// A large READ or WRITE the page cache can take at once: tried without
/// blocking on an async worker (other than the one reading the socket, when
/// one is free), so big copies spread over the cores without a thread hop.
/// `pieces`: a READ's, when already known. `None`: run
/// [`execute_blocking`], which also answers invalid requests.
pub fn try_large_nowait(ctx: &ConnContext, req: &Request, pieces: Option<Pieces>) -> Option<Bytes> {
    if validate(req, &ctx.limits()).is_err() {
        return None;
    }
    let start = Instant::now();
    // A failed try is retried on the worker thread, which reports the error.
    let reply = attempt_nowait(ctx, req, pieces)?.ok()?;
    Some(ctx.finish(req, start, Ok(reply)))
}

/// One non-blocking try of a validated READ, or WRITE without FUA
/// (RWF_NOWAIT). `None` when it would block or the request is of another kind.
fn attempt_nowait(ctx: &ConnContext, req: &Request, pieces: Option<Pieces>) -> Option<Outcome> {
    let done = match req.command {
        Command::Read => read_reply(ctx, req, pieces, true),
        Command::Write if !req.has_flag(CMD_FLAG_FUA) => {
            let data = req.payload.as_deref().unwrap_or_default();
            ctx.volume
                .try_write_nowait(req.offset, data)
                .map(|ok| ok.then(|| ok_reply(ctx, req)))
        }
        _ => return None,
    };
    match done {
        Ok(Some(reply)) => Some(Ok(reply)),
        Ok(None) => None,
        Err(e) => Some(Err((errno_for(&e, req.command), e.to_string()))),
    }
}

/// Serve a request on a worker thread (it may block on the disk).
pub fn execute_blocking(ctx: &ConnContext, req: &Request) -> Bytes {
    let start = Instant::now();
    ctx.in_flight.inc();
    let out = match validate(req, &ctx.limits()) {
        Err(code) => Err((code, format!("invalid {} request", req.command.name()))),
        Ok(()) => execute(ctx, req).map_err(|e| (errno_for(&e, req.command), e.to_string())),
    };
    ctx.in_flight.dec();
    ctx.finish(req, start, out)
}

/// A WRITE of an RBD image's volume started on the event loop through
/// librbd's asynchronous API, its reply when librbd acknowledged it; on a
/// worker thread as [`execute_blocking`] when it cannot start so (the
/// write gate paused or throttled by a migration).
pub async fn write_async(ctx: Arc<ConnContext>, req: Request) -> Bytes {
    let start = Instant::now();
    if let Err(code) = validate(&req, &ctx.limits()) {
        let msg = format!("invalid {} request", req.command.name());
        return ctx.finish(&req, start, Err((code, msg)));
    }
    let payload = req.payload.clone().unwrap_or_default();
    let out = match ctx.volume.start_write_async(req.offset, payload) {
        Ok(Some(write)) => {
            ctx.in_flight.inc();
            let r = write.await;
            ctx.in_flight.dec();
            r.map(|()| ok_reply(&ctx, &req))
        }
        Ok(None) => return execute_on_thread(ctx, req).await,
        Err(e) => Err(e),
    };
    let out = out.map_err(|e| (errno_for(&e, req.command), e.to_string()));
    ctx.finish(&req, start, out)
}

/// [`execute_blocking`] on the blocking pool, awaited from a task.
pub async fn execute_on_thread(ctx: Arc<ConnContext>, req: Request) -> Bytes {
    let (c, r) = (ctx.clone(), req.clone());
    match tokio::task::spawn_blocking(move || execute_blocking(&c, &r)).await {
        Ok(b) => b,
        Err(e) => error_reply(&ctx, &req, ErrorCode::Io, &e.to_string()),
    }
}

pub fn error_reply(ctx: &ConnContext, req: &Request, code: ErrorCode, msg: &str) -> Bytes {
    let mut b = BytesMut::new();
    ctx.to(req).error(&mut b, code, msg);
    b.freeze()
}

fn ok_reply(ctx: &ConnContext, req: &Request) -> Bytes {
    let mut b = BytesMut::with_capacity(ctx.style().header_len());
    ctx.to(req).ok(&mut b);
    b.freeze()
}

/// A buffer holding the reply header of a successful READ, with room for
/// the data (a validated READ is at most 32 MiB).
fn read_header(ctx: &ConnContext, req: &Request, len: u32) -> BytesMut {
    let mut b = ferry_nbd_server::reply_buffer(ctx.style().read_header_len() + len as usize);
    ctx.to(req).read_header(&mut b, len);
    b
}

type Outcome = Result<Bytes, (ErrorCode, String)>;

/// The reply to a validated READ: one data chunk (or simple reply), or,
/// for a large structured READ over holes, data and hole chunks. `None`
/// when `nowait` and the page cache cannot answer at once. `known`: the
/// READ's pieces when already asked for (else they are asked for here).
fn read_reply(
    ctx: &ConnContext,
    req: &Request,
    known: Option<Pieces>,
    nowait: bool,
) -> Result<Option<Bytes>, StorageError> {
    let to = ctx.to(req);
    // A validated READ is at most 32 MiB.
    let length = u32::try_from(req.length).unwrap_or(u32::MAX);
    if let Some(pieces) = known.or_else(|| sparse_pieces(ctx, req)) {
        let data: u64 = pieces.iter().filter(|p| !p.2).map(|p| p.1).sum();
        let hdr = ctx.style().header_len() + 12;
        let mut b = ferry_nbd_server::reply_buffer(
            hdr * (pieces.len() + 1) + usize::try_from(data).unwrap_or(0),
        );
        for (offset, len, hole) in pieces {
            // Pieces lie inside the READ, whose length is a u32.
            let len32 = u32::try_from(len).unwrap_or(u32::MAX);
            if hole {
                to.offset_hole(&mut b, offset, len32);
            } else {
                to.offset_data_piece(&mut b, offset, len32);
                if !ctx
                    .volume
                    .read_append(offset, len32 as usize, &mut b, nowait)?
                {
                    return Ok(None);
                }
            }
        }
        to.done(&mut b);
        return Ok(Some(ferry_nbd_server::pooled(b)));
    }
    let mut b = read_header(ctx, req, length);
    Ok(ctx
        .volume
        .read_append(req.offset, length as usize, &mut b, nowait)?
        .then(|| ferry_nbd_server::pooled(b)))
}

/// How a large structured READ splits into `(offset, length, hole)`
/// pieces, or `None` when it has no hole worth a chunk.
fn sparse_pieces(ctx: &ConnContext, req: &Request) -> Option<Pieces> {
    if !ctx.style().chunks() || req.length < u64::from(SPARSE_READ_MIN) {
        return None;
    }
    let len = req.length;
    let extents = ctx.volume.extents(req.offset, len, READ_EXTENTS).ok()?;
    if !extents.iter().any(|e| e.hole && e.length >= HOLE_MIN) {
        return None;
    }
    let end = req.offset + len;
    let mut pieces: Pieces = Vec::new();
    let mut at = req.offset;
    let mut push = |offset: u64, length: u64, hole: bool| match pieces.last_mut() {
        Some(last) if last.2 == hole && last.0 + last.1 == offset => last.1 += length,
        _ => pieces.push((offset, length, hole)),
    };
    for e in extents {
        let from = e.offset.max(at);
        let to = (e.offset + e.length).min(end);
        if from >= to || from != at {
            continue;
        }
        push(from, to - from, e.hole && to - from >= HOLE_MIN);
        at = to;
    }
    if at < end {
        push(at, end - at, false);
    }
    Some(pieces)
}

fn execute(ctx: &ConnContext, req: &Request) -> Result<Bytes, StorageError> {
    let v = &ctx.volume;
    let (offset, len) = (req.offset, req.length);
    let fua = req.has_flag(CMD_FLAG_FUA);
    match req.command {
        Command::Read => {
            return read_reply(ctx, req, None, false)?
                .ok_or_else(|| StorageError::Invalid("read would block".into()));
        }
        Command::Write => v.write_at(offset, req.payload.as_deref().unwrap_or_default(), fua)?,
        Command::WriteZeroes => {
            let mode = ZeroMode {
                may_punch: !req.has_flag(CMD_FLAG_NO_HOLE),
                fast_only: req.has_flag(CMD_FLAG_FAST_ZERO),
            };
            v.write_zeroes(offset, len, mode, fua)?;
        }
        Command::Trim => v.trim(offset, len, fua)?,
        Command::Flush => v.flush()?,
        Command::Cache => v.cache(offset, len)?,
        Command::BlockStatus => return block_status(ctx, req),
        Command::Resize => resize(ctx, req.offset)?,
        // validate() refuses these; DISC never reaches here.
        Command::Disc | Command::Unknown(_) => {
            return Err(StorageError::Invalid("unsupported command".into()));
        }
    }
    Ok(ok_reply(ctx, req))
}

/// `NBD_CMD_RESIZE` to `size` bytes. Growing is always allowed;
/// shrinking discards data, so only the volume's one client may ask for it
/// (proto.md's resize extension: EPERM when other clients use the export).
/// A migration holding the volume refuses it (`Volume::resize`).
fn resize(ctx: &ConnContext, size: u64) -> Result<(), StorageError> {
    let held = ctx.volume.held_by();
    let shrink = size < ctx.volume.size();
    // This connection is one of the NBD clients counted.
    let others = held.0.iter().map(|(_, n)| *n).sum::<usize>() > 1;
    if shrink && others {
        return Err(StorageError::InUse {
            name: ctx.volume.name(),
            held_by: held,
            hint: "; only its one client may shrink it",
        });
    }
    if size > ctx.max_size {
        return Err(StorageError::Invalid(format!(
            "size {size} is over this daemon's largest volume ({} bytes)",
            ctx.max_size
        )));
    }
    if !shrink {
        let grow = size - ctx.volume.size();
        if grow > ctx.pool.free_bytes_for(&ctx.volume)? {
            // The file would be promised more than its file system holds.
            return Err(StorageError::Io {
                op: "resize",
                path: ctx.volume.data_path().to_path_buf(),
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
    }
    ctx.volume.resize(size, shrink)?;
    tracing::info!(volume = %ctx.volume.name(), size, "resized by an NBD client");
    Ok(())
}

fn block_status(ctx: &ConnContext, req: &Request) -> Result<Bytes, StorageError> {
    let (v, offset, len) = (&ctx.volume, req.offset, req.length);
    let max = if req.has_flag(CMD_FLAG_REQ_ONE) {
        1
    } else {
        MAX_EXTENTS
    };
    let to = ctx.to(req);
    let mut b = BytesMut::new();
    for c in &ctx.neg.meta_contexts {
        let extents: Vec<(u64, u32)> = match c {
            MetaContext::BaseAllocation => v
                .extents(offset, len, max)?
                .iter()
                .map(|e| {
                    let flags = if e.hole { STATE_HOLE | STATE_ZERO } else { 0 };
                    (e.length, flags)
                })
                .collect(),
            MetaContext::DirtyBitmap { name, .. } => v
                .bitmap(name)?
                .extents(offset, len, max)
                .iter()
                .map(|(l, d)| (*l, if *d { STATE_DIRTY } else { 0 }))
                .collect(),
        };
        if extents.is_empty() {
            return Err(StorageError::Invalid(
                "no extents for the requested range".into(),
            ));
        }
        to.block_status(&mut b, c.id(), &extents);
    }
    to.done(&mut b);
    Ok(b.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(code: i32) -> StorageError {
        StorageError::Io {
            op: "write",
            path: "rbd:p/v".into(),
            source: std::io::Error::from_raw_os_error(code),
        }
    }

    #[test]
    fn a_fenced_gateways_failure_sends_the_client_elsewhere() {
        // EBLOCKLISTED is ESHUTDOWN: the client (ferry host) re-issues the
        // request where the volume went, instead of failing it.
        assert_eq!(
            errno_for(&os(libc::ESHUTDOWN), Command::Write),
            ErrorCode::Shutdown
        );
        assert_eq!(errno_for(&os(libc::EIO), Command::Write), ErrorCode::Io);
        assert_eq!(
            errno_for(&os(libc::ENOSPC), Command::Write),
            ErrorCode::NoSpc
        );
    }
}
