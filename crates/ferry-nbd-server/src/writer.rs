//! The writer task of a connection: sends queued buffers with vectored
//! writes (NBD replies here; the daemon's iSCSI connections use it too),
//! and releases what each reply held of its connection's byte budget only
//! once its bytes are written.

use bytes::Bytes;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// Bytes of the reply budgets (per connection and overall) a queued reply
/// holds until it is written.
#[derive(Debug, Default)]
pub struct Held {
    _conn: Option<OwnedSemaphorePermit>,
    _total: Option<OwnedSemaphorePermit>,
}

impl Held {
    pub fn new(conn: OwnedSemaphorePermit, total: Option<OwnedSemaphorePermit>) -> Held {
        Held {
            _conn: Some(conn),
            _total: total,
        }
    }
}

/// Something the writer task sends: one buffer or several.
pub trait Frames: Send + 'static {
    /// Append the buffers to `batch`; what must live until they are
    /// written goes to `hold`.
    fn append_to(self, batch: &mut Vec<Bytes>, hold: &mut Vec<Held>);
}

impl Frames for Bytes {
    fn append_to(self, batch: &mut Vec<Bytes>, _: &mut Vec<Held>) {
        batch.push(self);
    }
}

impl Frames for Vec<Bytes> {
    fn append_to(self, batch: &mut Vec<Bytes>, _: &mut Vec<Held>) {
        batch.extend(self);
    }
}

/// Several buffers and the budgets their replies hold (an iSCSI batch).
#[derive(Default)]
pub struct HeldFrames {
    pub frames: Vec<Bytes>,
    pub held: Vec<Held>,
}

impl Frames for HeldFrames {
    fn append_to(self, batch: &mut Vec<Bytes>, hold: &mut Vec<Held>) {
        batch.extend(self.frames);
        hold.extend(self.held);
    }
}

/// A reply and the budget it holds.
pub struct Reply {
    pub bytes: Bytes,
    pub held: Held,
}

impl Frames for Reply {
    fn append_to(self, batch: &mut Vec<Bytes>, hold: &mut Vec<Held>) {
        batch.push(self.bytes);
        hold.push(self.held);
    }
}

/// Send everything queued on `rx`, batching whatever is ready into one
/// vectored write. After a write error the rest is drained and dropped so
/// senders never block on a dead socket; at the end the socket is shut
/// down for writing.
pub async fn write_loop<W: AsyncWrite + Unpin, T: Frames>(mut wr: W, mut rx: mpsc::Receiver<T>) {
    const MOST: usize = 256;
    let mut batch: Vec<Bytes> = Vec::with_capacity(MOST);
    let mut hold: Vec<Held> = Vec::with_capacity(MOST);
    while let Some(first) = rx.recv().await {
        first.append_to(&mut batch, &mut hold);
        while batch.len() < MOST {
            match rx.try_recv() {
                Ok(b) => b.append_to(&mut batch, &mut hold),
                Err(_) => break,
            }
        }
        let r = ferry_client::write_all_vectored(&mut wr, &mut batch).await;
        hold.clear();
        if let Err(e) = r {
            tracing::debug!(error = %e, "write failed; dropping what is still queued");
            while rx.recv().await.is_some() {}
            return;
        }
    }
    let _ = wr.shutdown().await;
}
