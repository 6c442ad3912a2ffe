//! What the NBD and iSCSI listeners share: the accept loop (with a cap on
//! open connections, each served on its own task, all drained at
//! shutdown) and the writer task that sends queued buffers with vectored
//! writes.

use crate::ServerState;
use bytes::Bytes;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
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

/// Something the writer task sends: one buffer or several.
pub trait Frames: Send + 'static {
    fn append_to(self, batch: &mut Vec<Bytes>);
}

impl Frames for Bytes {
    fn append_to(self, batch: &mut Vec<Bytes>) {
        batch.push(self);
    }
}

impl Frames for Vec<Bytes> {
    fn append_to(self, batch: &mut Vec<Bytes>) {
        batch.extend(self);
    }
}

/// Send everything queued on `rx`, batching whatever is ready into one
/// vectored write. After a write error the rest is drained and dropped so
/// senders never block on a dead socket; at the end the socket is shut
/// down for writing.
pub async fn write_loop<W: AsyncWrite + Unpin, T: Frames>(mut wr: W, mut rx: mpsc::Receiver<T>) {
    const MOST: usize = 256;
    let mut batch: Vec<Bytes> = Vec::with_capacity(MOST);
    while let Some(first) = rx.recv().await {
        first.append_to(&mut batch);
        while batch.len() < MOST {
            match rx.try_recv() {
                Ok(b) => b.append_to(&mut batch),
                Err(_) => break,
            }
        }
        if let Err(e) = ferry_client::write_all_vectored(&mut wr, &mut batch).await {
            tracing::debug!(error = %e, "write failed; dropping what is still queued");
            while rx.recv().await.is_some() {}
            return;
        }
    }
    let _ = wr.shutdown().await;
}
