//! The NBD server of the daemon: a listener that accepts connections up to
//! a cap, each served by `ferry_nbd_server` with the pool as its backend
//! (handshake, then requests pipelined and answered out of order).
//!
//! Each connection is independent: a protocol error, a vanished client or a
//! failed request ends at most that one connection, never the daemon.

mod catalog;
mod connection;
mod exec;

pub use catalog::PoolCatalog;
pub use exec::errno_for;

use crate::ServerState;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serve NBD on `listener` until `shutdown` fires, then let open connections
/// finish their in-flight requests and return.
pub async fn serve(listener: TcpListener, state: Arc<ServerState>, shutdown: CancellationToken) {
    let max = state.config.nbd.max_connections;
    let st = state.clone();
    crate::net::accept_loop(
        listener,
        max,
        state,
        shutdown.clone(),
        move |stream, peer| {
            let state = st.clone();
            let shutdown = shutdown.clone();
            async move {
                let _ = stream.set_nodelay(true);
                let backend = connection::PoolBackend(state);
                if let Err(e) = ferry_nbd_server::serve_connection(stream, &backend, shutdown).await
                {
                    tracing::info!(%peer, error = %e, "NBD connection closed");
                } else {
                    tracing::debug!(%peer, "NBD connection finished");
                }
            }
        },
    )
    .await;
}
