//! Deletes incomplete incoming copies that no migration has touched for
//! `migration.incomplete_ttl_secs`: what a move that failed for good left
//! behind. A migration of the same volume resumes into such a copy while
//! it lasts (see `ferry_migration_engine::destination`).

use crate::ServerState;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the pool is looked over: a tenth of the time to live, from
/// one second to one minute.
fn period(ttl_secs: u64) -> Duration {
    Duration::from_secs((ttl_secs / 10).clamp(1, 60))
}

/// Look the pool over until `shutdown`; nothing when the time to live is 0.
pub async fn run(state: Arc<ServerState>, shutdown: CancellationToken) {
    let ttl = state.config.migration.incomplete_ttl_secs;
    if ttl == 0 {
        return;
    }
    crate::periodic::every(
        period(ttl),
        shutdown,
        "looking for stale incomplete copies",
        move || {
            for (name, inc) in state.pool.delete_stale_incoming(ttl) {
            tracing::warn!(
                volume = %name,
                migration = %inc.id,
                source = %inc.source,
                idle_s = ferry_storage::unix_now().saturating_sub(inc.touched_unix),
                "deleted an incomplete copy no migration had touched for migration.incomplete_ttl_secs"
            );
            }
        },
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::period;
    use std::time::Duration;

    #[test]
    fn the_pool_is_looked_over_often_enough_and_not_too_often() {
        assert_eq!(period(1), Duration::from_secs(1));
        assert_eq!(period(300), Duration::from_secs(30));
        assert_eq!(period(86_400), Duration::from_secs(60));
    }
}
