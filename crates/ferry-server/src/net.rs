//! What the NBD and iSCSI listeners share: the accept loop (with a cap on
//! open connections overall and per peer address, each connection served
//! on its own task, all drained at shutdown). Over a cap a client is not
//! left hanging in the kernel's queue: it is accepted and refused the way
//! its protocol can say so. The writer task is `ferry_nbd_server`'s.

use crate::ServerState;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

pub use ferry_trust::listen::{ConnLimits, Refusal, REFUSE_TIMEOUT};

/// The daemon's connection gauges.
struct Gauge(Arc<ServerState>);

impl ferry_trust::listen::ConnGauge for Gauge {
    fn opened(&self) {
        self.0.metrics.connections.inc();
    }
    fn closed(&self) {
        self.0.metrics.connections.dec();
    }
    fn refused(&self) {
        self.0.metrics.connections_refused.inc();
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
    ferry_trust::listen::accept_loop(
        listener,
        limits,
        Arc::new(Gauge(state)),
        shutdown,
        None,
        serve,
        refuse,
    )
    .await
}

pub use ferry_nbd_server::{write_loop, Frames, Held, HeldFrames};

/// How long a client connection may be silent before TCP asks whether its
/// machine is still there.
pub const CLIENT_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(3);
/// How long data sent to a client (or a keepalive probe) may go
/// unacknowledged before the connection is given up.
pub const CLIENT_USER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Find out within seconds about a client that vanished without closing
/// its connection (its machine died, or a partition cut it off): TCP
/// keepalive probes it when idle and unacknowledged data gives up after
/// [`CLIENT_USER_TIMEOUT`]. Without it such a connection would hold its
/// volume for ever: a shared gateway releases only volumes no client
/// holds, and the client's own failover to another gateway is sent back
/// here while this one answers.
pub fn probe_vanished_client(stream: &TcpStream) {
    let sock = socket2::SockRef::from(stream);
    let ka = socket2::TcpKeepalive::new()
        .with_time(CLIENT_KEEPALIVE)
        .with_interval(std::time::Duration::from_secs(1))
        .with_retries(5);
    if let Err(e) = sock
        .set_tcp_keepalive(&ka)
        .and_then(|()| sock.set_tcp_user_timeout(Some(CLIENT_USER_TIMEOUT)))
    {
        tracing::debug!(error = %e, "cannot set TCP keepalive on a client connection");
    }
}

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
