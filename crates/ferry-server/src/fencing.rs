//! A gateway the cluster fenced stops, so that it can rejoin as a new
//! client.
//!
//! Other gateways fence one they take for dead (its lock broken, its
//! client blocklisted) before they claim its volumes or its site portal.
//! A gateway that was only cut off finds, when the cut heals, that every
//! call through its client is refused (`EBLOCKLISTED`): it can serve no
//! Ceph volume and hold no lease again, yet its listeners still answer,
//! so clients and other gateways would take it for alive. It stops
//! instead (`ServerError::Fenced`), and `ferry serve` starts it again as a
//! new client of the cluster, which stands by like any other gateway. Requests
//! that failed on the way are answered as "go elsewhere" (NBD `ESHUTDOWN`,
//! an iSCSI LU in transition), not as I/O errors.

use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the client's fenced mark is looked at.
const LOOK_EVERY: Duration = Duration::from_millis(200);

/// Until `shutdown`: once `cluster` is fenced, stop the daemon (cancel
/// `shutdown`; the daemon's run then ends with `ServerError::Fenced`).
pub async fn watch(cluster: Arc<ferry_rbd::Cluster>, shutdown: CancellationToken) {
    loop {
        if cluster.fenced() {
            tracing::error!(
                client = %cluster.address(),
                "the Ceph cluster fenced this gateway (another took it for dead and blocklisted its client): stopping, to rejoin as a new client"
            );
            shutdown.cancel();
            return;
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(LOOK_EVERY) => {}
        }
    }
}
