//! Executing validated requests on a volume, and the one place where storage
//! errors become NBD errno values.

use crate::metrics::OpMetrics;
use crate::ServerState;
use bytes::{BufMut, Bytes, BytesMut};
use ferry_nbd::consts::*;
use ferry_nbd::handshake::MetaContext;
use ferry_nbd::{reply, validate, Command, ErrorCode, Negotiated, Request, TransmissionLimits};
use ferry_storage::{StorageError, Volume, ZeroMode};
use prometheus_client::metrics::gauge::Gauge;
use std::sync::Arc;
use std::time::Instant;

/// Most extents sent for one context in one BLOCK_STATUS reply.
const MAX_EXTENTS: usize = 2048;

/// Per-connection state shared by the request tasks.
pub struct ConnContext {
    volume: Arc<Volume>,
    structured: bool,
    contexts: Vec<MetaContext>,
    min_block: u32,
    in_flight: Gauge,
    metrics: [OpMetrics; 8],
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
            structured: neg.structured_replies,
            contexts: neg.meta_contexts.clone(),
            min_block: neg.export.min_block,
            in_flight: state.metrics.in_flight(&name),
            metrics: OPS.map(|c| state.metrics.op(&name, c.name())),
            volume,
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
        StorageError::ReadOnly(_) => ErrorCode::Perm,
        StorageError::NotFast => ErrorCode::NotSup,
        StorageError::NotFound(_) => ErrorCode::Shutdown,
        _ => match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorCode::NoSpc,
            Some(libc::ENOMEM) => ErrorCode::NoMem,
            _ => ErrorCode::Io,
        },
    }
}

/// Serve one request; returns the encoded reply.
pub async fn handle(ctx: &Arc<ConnContext>, req: Request) -> Bytes {
    let start = Instant::now();
    let m = ctx.op_metrics(req.command);
    ctx.in_flight.inc();
    let lim = TransmissionLimits {
        size: ctx.volume.size(),
        read_only: ctx.volume.read_only(),
        structured: ctx.structured,
        has_meta_contexts: !ctx.contexts.is_empty(),
        min_block: ctx.min_block,
    };
    let out = match validate(&req, &lim) {
        Err(code) => Err((code, format!("invalid {} request", req.command.name()))),
        Ok(()) => execute(ctx, &req).await,
    };
    ctx.in_flight.dec();
    m.ops.inc();
    m.size.observe(f64::from(req.length));
    m.latency.observe(start.elapsed().as_secs_f64());
    match out {
        Ok(bytes) => {
            if matches!(req.command, Command::Read | Command::Write) {
                m.bytes.inc_by(u64::from(req.length));
            }
            bytes
        }
        Err((code, msg)) => {
            m.errors.inc();
            tracing::debug!(op = req.command.name(), offset = req.offset, len = req.length, %code, %msg, "request failed");
            error_reply(ctx, &req, code, &msg)
        }
    }
}

fn error_reply(ctx: &ConnContext, req: &Request, code: ErrorCode, msg: &str) -> Bytes {
    let mut b = BytesMut::new();
    if ctx.structured && matches!(req.command, Command::Read | Command::BlockStatus) {
        reply::error(&mut b, req.cookie, code, msg);
    } else {
        reply::simple(&mut b, req.cookie, Some(code));
    }
    b.freeze()
}

fn ok_reply(cookie: u64) -> Bytes {
    let mut b = BytesMut::with_capacity(SIMPLE_REPLY_LEN);
    reply::simple(&mut b, cookie, None);
    b.freeze()
}

type Outcome = Result<Bytes, (ErrorCode, String)>;

async fn blocking<F>(ctx: &Arc<ConnContext>, cmd: Command, f: F) -> Outcome
where
    F: FnOnce(&Volume) -> Result<Bytes, StorageError> + Send + 'static,
{
    let c = ctx.clone();
    match tokio::task::spawn_blocking(move || f(&c.volume)).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => Err((errno_for(&e, cmd), e.to_string())),
        Err(e) => Err((ErrorCode::Io, format!("worker failed: {e}"))),
    }
}

async fn execute(ctx: &Arc<ConnContext>, req: &Request) -> Outcome {
    let cookie = req.cookie;
    let offset = req.offset;
    let len = req.length;
    let fua = req.has_flag(CMD_FLAG_FUA);
    match req.command {
        Command::Read => {
            let structured = ctx.structured;
            blocking(ctx, req.command, move |v| {
                let hdr = if structured {
                    STRUCTURED_HEADER_LEN + 8
                } else {
                    SIMPLE_REPLY_LEN
                };
                let mut b = BytesMut::with_capacity(hdr + len as usize);
                if structured {
                    reply::offset_data_header(&mut b, cookie, offset, len);
                } else {
                    reply::simple(&mut b, cookie, None);
                }
                b.put_bytes(0, len as usize);
                v.read_at(offset, &mut b[hdr..])?;
                Ok(b.freeze())
            })
            .await
        }
        Command::Write => {
            let data = req.payload.clone().unwrap_or_default();
            blocking(ctx, req.command, move |v| {
                v.write_at(offset, &data, fua)?;
                Ok(ok_reply(cookie))
            })
            .await
        }
        Command::WriteZeroes => {
            let mode = ZeroMode {
                may_punch: !req.has_flag(CMD_FLAG_NO_HOLE),
                fast_only: req.has_flag(CMD_FLAG_FAST_ZERO),
            };
            blocking(ctx, req.command, move |v| {
                v.write_zeroes(offset, u64::from(len), mode, fua)?;
                Ok(ok_reply(cookie))
            })
            .await
        }
        Command::Trim => {
            blocking(ctx, req.command, move |v| {
                v.trim(offset, u64::from(len), fua)?;
                Ok(ok_reply(cookie))
            })
            .await
        }
        Command::Flush => {
            blocking(ctx, req.command, move |v| {
                v.flush()?;
                Ok(ok_reply(cookie))
            })
            .await
        }
        Command::Cache => {
            blocking(ctx, req.command, move |v| {
                v.cache(offset, u64::from(len))?;
                Ok(ok_reply(cookie))
            })
            .await
        }
        Command::BlockStatus => {
            let contexts = ctx.contexts.clone();
            let one = req.has_flag(CMD_FLAG_REQ_ONE);
            blocking(ctx, req.command, move |v| {
                block_status(v, &contexts, cookie, offset, len, one)
            })
            .await
        }
        // validate() refuses these; DISC never reaches here.
        Command::Disc | Command::Resize | Command::Unknown(_) => {
            Err((ErrorCode::Inval, "unsupported command".into()))
        }
    }
}

fn block_status(
    v: &Volume,
    contexts: &[MetaContext],
    cookie: u64,
    offset: u64,
    len: u32,
    one: bool,
) -> Result<Bytes, StorageError> {
    let max = if one { 1 } else { MAX_EXTENTS };
    let mut b = BytesMut::new();
    for c in contexts {
        let extents: Vec<(u32, u32)> = match c {
            MetaContext::BaseAllocation => v
                .extents(offset, u64::from(len), max)?
                .iter()
                .map(|e| {
                    let flags = if e.hole { STATE_HOLE | STATE_ZERO } else { 0 };
                    (u32::try_from(e.length).unwrap_or(u32::MAX), flags)
                })
                .collect(),
            MetaContext::DirtyBitmap { name, .. } => v
                .bitmap(name)?
                .extents(offset, u64::from(len), max)
                .iter()
                .map(|(l, d)| {
                    (
                        u32::try_from(*l).unwrap_or(u32::MAX),
                        if *d { STATE_DIRTY } else { 0 },
                    )
                })
                .collect(),
        };
        if extents.is_empty() {
            return Err(StorageError::Invalid(
                "no extents for the requested range".into(),
            ));
        }
        reply::block_status(&mut b, cookie, c.id(), &extents, false);
    }
    reply::done(&mut b, cookie);
    Ok(b.freeze())
}
