//! A shared gateway ([storage.ceph] shared) lets go of the volumes no
//! client or migration uses here any more, so that another gateway can
//! claim them without breaking a lock (see `ferry_storage::shared`).

use crate::ServerState;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A shared gateway lets go of the volumes no one uses here (see
/// [`ferry_storage::Pool::release_idle`]): looked over every two seconds,
/// a volume idle at two looks in a row is released.
pub async fn run(state: Arc<ServerState>, shutdown: CancellationToken) {
    crate::periodic::every(
        Duration::from_secs(2),
        shutdown,
        "releasing idle shared volumes",
        move || {
            state.pool.release_idle();
        },
    )
    .await;
}
