//! What the NBD and iSCSI listeners share: the accept loop (with a cap on
//! open connections overall and per peer address, each connection served
//! on its own task, all drained at shutdown). Over a cap a client is not
//! left hanging in the kernel's queue: it is accepted and refused the way
//! its protocol can say so. The writer task is `ferry_nbd_server`'s.

use crate::ServerState;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How many connections a listener takes.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max: usize,
    /// Per peer IP address; 0 is no cap of its own.
    pub per_peer: usize,
}

/// Why a connection is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The listener holds `max` connections.
    Full,
    /// This peer address holds `per_peer` connections.
    PeerFull,
}

/// Refusals answered at once at most; beyond, sockets are just closed.
const MAX_REFUSING: usize = 64;
/// Longest a refused client is talked to.
pub const REFUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections per peer address, released by [`PeerSlot`].
#[derive(Debug, Default)]
struct PeerCounts(Mutex<HashMap<IpAddr, usize>>);

struct PeerSlot(Arc<PeerCounts>, IpAddr);

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = (self.0).0.lock();
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

impl PeerCounts {
    fn take(self: &Arc<Self>, ip: IpAddr, cap: usize) -> Option<PeerSlot> {
        let mut m = self.0.lock();
        let n = m.entry(ip).or_insert(0);
        if cap > 0 && *n >= cap {
            return None;
        }
        *n += 1;
        Some(PeerSlot(self.clone(), ip))
    }
}

/// Accept on `listener` until `shutdown` fires; each connection runs
/// `serve` on its own task (and counts in the connections gauge), or, over
/// a limit, `refuse` (bounded by [`REFUSE_TIMEOUT`]). Returns once every
/// connection has finished.
pub async fn accept_loop<F, Fut, R, RFut>(
    listener: TcpListener,
    limits: ConnLimits,
    state: Arc<ServerState>,
    shutdown: CancellationToken,
    serve: F,
    refuse: R,
) where
    F: Fn(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
    R: Fn(TcpStream, SocketAddr, Refusal) -> RFut,
    RFut: Future<Output = ()> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(limits.max.max(1)));
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    let peers = Arc::new(PeerCounts::default());
    let tracker = TaskTracker::new();
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let admitted = match slots.clone().try_acquire_owned() {
            Err(_) => Err(Refusal::Full),
            Ok(permit) => match peers.take(peer.ip(), limits.per_peer) {
                Some(slot) => Ok((permit, slot)),
                None => Err(Refusal::PeerFull),
            },
        };
        match admitted {
            Ok((permit, slot)) => {
                let conn = serve(stream, peer);
                let state = state.clone();
                tracker.spawn(async move {
                    let _held = (permit, slot);
                    state.metrics.connections.inc();
                    conn.await;
                    state.metrics.connections.dec();
                });
            }
            Err(why) => {
                state.metrics.connections_refused.inc();
                tracing::warn!(%peer, ?why, "connection refused: over the limit");
                if let Ok(p) = refusing.clone().try_acquire_owned() {
                    let answer = refuse(stream, peer, why);
                    tracker.spawn(async move {
                        let _ = tokio::time::timeout(REFUSE_TIMEOUT, answer).await;
                        drop(p);
                    });
                }
            }
        }
    }
    tracker.close();
    tracker.wait().await;
}

pub use ferry_nbd_server::{write_loop, Frames, Held, HeldFrames};

/// Return freed heap to the system once a connection is gone: glibc keeps
/// what large replies used in its arenas otherwise, and the daemon would
/// look as big as its busiest moment forever.
pub async fn give_back_memory() {
    let _ = tokio::task::spawn_blocking(|| {
        // SAFETY: malloc_trim only releases free memory of the allocator;
        // it takes no pointers and is safe to call from any thread.
        unsafe { libc::malloc_trim(0) }
    })
    .await;
}

/// The byte budget all connections of one protocol share: `total` bytes,
/// at least one connection's `per_connection` (and 64 MiB), at most what
/// a semaphore can count.
pub fn shared_budget(
    per_connection: usize,
    total: usize,
) -> std::sync::Arc<tokio::sync::Semaphore> {
    use tokio::sync::Semaphore;
    let floor = per_connection.clamp(64 << 20, Semaphore::MAX_PERMITS);
    std::sync::Arc::new(Semaphore::new(total.clamp(floor, Semaphore::MAX_PERMITS)))
}
