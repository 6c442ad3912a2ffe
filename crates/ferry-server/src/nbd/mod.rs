//! The NBD server: a listener that accepts connections up to a cap, runs the
//! handshake, then serves requests pipelined and answered out of order.
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
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Serve NBD on `listener` until `shutdown` fires, then let open connections
/// finish their in-flight requests and return.
pub async fn serve(listener: TcpListener, state: Arc<ServerState>, shutdown: CancellationToken) {
    let slots = Arc::new(Semaphore::new(state.config.nbd.max_connections.max(1)));
    let tracker = TaskTracker::new();
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            () = shutdown.cancelled() => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let state = state.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            let _permit = permit;
            state.metrics.connections.inc();
            if let Err(e) = connection::run(stream, &state, shutdown).await {
                tracing::info!(%peer, error = %e, "NBD connection closed");
            } else {
                tracing::debug!(%peer, "NBD connection finished");
            }
            state.metrics.connections.dec();
        });
    }
    tracker.close();
    tracker.wait().await;
}
