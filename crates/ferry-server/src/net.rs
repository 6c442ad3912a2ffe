//! What the NBD and iSCSI listeners share: the accept loop (with a cap on
//! open connections, each served on its own task, all drained at
//! shutdown); the writer task is `ferry_nbd_server`'s.

use crate::ServerState;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Accept on `listener` until `shutdown` fires, at most `max` connections
/// at once; each runs `serve` on its own task (and counts in the
/// connections gauge). Returns once every connection has finished.
pub async fn accept_loop<F, Fut>(
    listener: TcpListener,
    max: usize,
    state: Arc<ServerState>,
    shutdown: CancellationToken,
    serve: F,
) where
    F: Fn(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(max.max(1)));
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
        let conn = serve(stream, peer);
        let state = state.clone();
        tracker.spawn(async move {
            let _permit = permit;
            state.metrics.connections.inc();
            conn.await;
            state.metrics.connections.dec();
        });
    }
    tracker.close();
    tracker.wait().await;
}

pub use ferry_nbd_server::{write_loop, Frames};
