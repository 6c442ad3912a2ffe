//! The NBD server of the daemon: a listener that accepts connections up to
//! a cap, each served by `ferry_nbd_server` with the pool as its backend
//! (handshake, then requests pipelined and answered out of order).
//!
//! Each connection is independent: a protocol error, a vanished client or a
//! failed request ends at most that one connection, never the daemon.

mod catalog;
mod connection;
mod exec;
pub mod sole_reader;

pub use catalog::PoolCatalog;
pub use exec::errno_for;

use crate::ServerState;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serve NBD on `listener` until `shutdown` fires, then let open connections
/// finish their in-flight requests and return.
pub async fn serve(listener: TcpListener, state: Arc<ServerState>, shutdown: CancellationToken) {
    let limits = crate::net::ConnLimits {
        max: state.config.nbd.max_connections,
        per_peer: state.config.nbd.max_connections_per_peer,
    };
    let st = state.clone();
    let total = connection::PoolBackend::total_budget(&state);
    crate::net::accept_loop(
        listener,
        limits,
        state,
        shutdown.clone(),
        move |stream, peer| {
            let backend = connection::PoolBackend {
                state: st.clone(),
                total: total.clone(),
            };
            let shutdown = shutdown.clone();
            async move {
                let _ = stream.set_nodelay(true);
                crate::net::probe_vanished_client(&stream);
                let tls = backend.state.nbd_tls.clone().map(|t| {
                    let mode = t.mode(Some(peer.ip()));
                    (t, mode)
                });
                let r = ferry_nbd_server::serve_connection(stream, &backend, tls, shutdown).await;
                crate::net::give_back_memory().await;
                match r {
                    Err(e) => tracing::info!(%peer, error = %e, "NBD connection closed"),
                    Ok(()) => tracing::debug!(%peer, "NBD connection finished"),
                }
            }
        },
        |mut stream, _peer, _why| async move {
            // NBD has no "busy" answer before an export is chosen: the
            // greeting, then a close, so the client fails at once instead
            // of waiting in the listen queue.
            use tokio::io::AsyncWriteExt;
            let _ = stream
                .write_all(&ferry_nbd::ServerHandshake::greeting())
                .await;
            let _ = stream.shutdown().await;
        },
    )
    .await;
}
