//! One NBD connection: the handshake over the socket, then the transmission
//! loop. A reader decodes requests and spawns each (bounded by
//! `max_in_flight`); a writer task sends replies in completion order, batching
//! whatever is ready into one vectored write.

use super::catalog::PoolCatalog;
use super::exec::{self, ConnContext};
use crate::ServerState;
use bytes::{Bytes, BytesMut};
use ferry_nbd::{Command, HandshakeProgress, NbdError, RequestDecoder, ServerHandshake};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a client may take over each handshake step.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Error)]
pub enum ConnError {
    #[error("protocol error: {0}")]
    Protocol(#[from] NbdError),
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("handshake timed out")]
    Timeout,
    #[error("volume {0:?} disappeared during the handshake")]
    Gone(String),
}

pub async fn run(
    mut stream: TcpStream,
    state: &Arc<ServerState>,
    shutdown: CancellationToken,
) -> Result<(), ConnError> {
    stream.set_nodelay(true)?;
    let Some((neg, buf)) = handshake(&mut stream, state).await? else {
        return Ok(());
    };
    let volume = state
        .pool
        .get(&neg.export.name)
        .map_err(|_| ConnError::Gone(neg.export.name.clone()))?;
    tracing::debug!(export = %neg.export.name, structured = neg.structured_replies, "NBD transmission starts");
    transmission(
        stream,
        buf,
        ConnContext::new(volume, &neg, state),
        state,
        shutdown,
    )
    .await
}

async fn handshake(
    stream: &mut TcpStream,
    state: &ServerState,
) -> Result<Option<(ferry_nbd::Negotiated, BytesMut)>, ConnError> {
    stream.write_all(&ServerHandshake::greeting()).await?;
    let mut hs = ServerHandshake::new();
    let mut buf = BytesMut::with_capacity(4096);
    let mut out = BytesMut::new();
    loop {
        let progress = hs.feed(&mut buf, &PoolCatalog(&state.pool), &mut out)?;
        if !out.is_empty() {
            stream.write_all(&out).await?;
            out.clear();
        }
        match progress {
            HandshakeProgress::Done(n) => return Ok(Some((*n, buf))),
            HandshakeProgress::Aborted => return Ok(None),
            HandshakeProgress::NeedMore => {
                let n = tokio::time::timeout(HANDSHAKE_TIMEOUT, stream.read_buf(&mut buf))
                    .await
                    .map_err(|_| ConnError::Timeout)??;
                if n == 0 {
                    return Ok(None);
                }
            }
        }
    }
}

async fn transmission(
    stream: TcpStream,
    mut buf: BytesMut,
    ctx: ConnContext,
    state: &ServerState,
    shutdown: CancellationToken,
) -> Result<(), ConnError> {
    let (mut rd, wr) = stream.into_split();
    let max_in_flight = state.config.nbd.max_in_flight.max(1);
    let (tx, rx) = mpsc::channel::<Bytes>(max_in_flight + 8);
    let writer = tokio::spawn(crate::net::write_loop(wr, rx));
    let slots = Arc::new(Semaphore::new(max_in_flight));
    let tracker = TaskTracker::new();
    let ctx = Arc::new(ctx);
    let mut decoder = RequestDecoder::new();
    let mut result = Ok(());
    'conn: loop {
        loop {
            let req = match decoder.decode(&mut buf) {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) => {
                    result = Err(e.into());
                    break 'conn;
                }
            };
            if req.command == Command::Disc {
                break 'conn;
            }
            if let Some(reply) = exec::try_inline(&ctx, &req) {
                if tx.send(reply).await.is_err() {
                    break 'conn;
                }
                continue;
            }
            let permit = tokio::select! {
                p = slots.clone().acquire_owned() => p.expect("semaphore never closed"),
                () = shutdown.cancelled() => break 'conn,
            };
            let ctx = ctx.clone();
            let tx = tx.clone();
            if ctx.may_try_nowait(&req) {
                tracker.spawn(async move {
                    let reply = match exec::try_large_nowait(&ctx, &req) {
                        Some(r) => r,
                        None => {
                            let c = ctx.clone();
                            match tokio::task::spawn_blocking(move || {
                                exec::execute_blocking(&c, &req)
                            })
                            .await
                            {
                                Ok(r) => r,
                                Err(_) => return,
                            }
                        }
                    };
                    drop(permit);
                    let _ = tx.send(reply).await;
                });
                continue;
            }
            tracker.spawn_blocking(move || {
                let reply = exec::execute_blocking(&ctx, &req);
                drop(permit);
                // The client may be gone; its replies have nowhere to go.
                let _ = tx.blocking_send(reply);
            });
        }
        buf.reserve(decoder.wanted(buf.len()).max(256 * 1024));
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
    // Drain: every accepted request finishes and is answered (flush
    // semantics hold even for a client that sent DISC right after a write).
    tracker.close();
    tracker.wait().await;
    drop(tx);
    let _ = writer.await;
    result
}
