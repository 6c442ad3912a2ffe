//! The writer task of a connection: sends queued buffers with vectored
//! writes (NBD replies here; the daemon's iSCSI connections use it too).

use bytes::Bytes;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

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
