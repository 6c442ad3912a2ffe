//! The accept loop every ferry listener shares: a cap on open connections
//! overall and per peer address, each connection served on its own task,
//! all drained at shutdown. Over a cap a client is not left hanging in the
//! kernel's queue: it is accepted and refused the way its protocol can say
//! so (or just closed).

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

/// What a listener counts (its metrics); `()` counts nothing.
pub trait ConnGauge: Send + Sync + 'static {
    fn opened(&self) {}
    fn closed(&self) {}
    fn refused(&self) {}
}

impl ConnGauge for () {}

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
/// `serve` on its own task, or, over a limit, `refuse` (bounded by
/// [`REFUSE_TIMEOUT`]). Returns once every connection has finished, or
/// `drain` after `shutdown` (whichever is first; `None` waits for all).
pub async fn accept_loop<F, Fut, R, RFut>(
    listener: TcpListener,
    limits: ConnLimits,
    gauge: Arc<dyn ConnGauge>,
    shutdown: CancellationToken,
    drain: Option<Duration>,
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
                let gauge = gauge.clone();
                tracker.spawn(async move {
                    let _held = (permit, slot);
                    gauge.opened();
                    conn.await;
                    gauge.closed();
                });
            }
            Err(why) => {
                gauge.refused();
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
    // Stop listening at once, not after the drain: the address may be
    // wanted by another listener now (a site portal handed over), and a
    // connection that never drains must not keep it.
    drop(listener);
    tracker.close();
    match drain {
        None => tracker.wait().await,
        Some(d) => {
            let _ = tokio::time::timeout(d, tracker.wait()).await;
        }
    }
}
