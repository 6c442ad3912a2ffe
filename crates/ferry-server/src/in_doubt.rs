//! Settles volumes held in doubt without waiting for a person. A volume
//! whose migration's switch may have happened without this daemon learning
//! the answer (it restarted after journaling `switch_sent`, or the link
//! failed at the switch and did not come back in time) is neither read nor
//! written here. Every `migration.in_doubt_check_secs` the daemon asks the
//! destination with a migration that only learns the outcome
//! (`MigrateRequest::resolve_only`, the journaled id): committed there, the
//! volume is marked moved; not, it is served here again.

use crate::ServerState;
use ferry_migration_engine::source::{start, MigrateRequest};
use ferry_migration_engine::StorageDaemon;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub async fn run(state: Arc<ServerState>, shutdown: CancellationToken) {
    let every = Duration::from_secs(state.config.migration.in_doubt_check_secs.max(1));
    loop {
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = shutdown.cancelled() => return,
        }
        for v in state.pool.list() {
            if !v.in_doubt() || state.registry().active_for(&v.name()).is_some() {
                continue;
            }
            let Some(o) = v.outgoing() else { continue };
            let req = MigrateRequest {
                volume: v.name().to_string(),
                to: o.to.clone(),
                plaintext: o.plaintext,
                resolve_only: true,
                retry_for: every,
                ..MigrateRequest::default()
            };
            let host = state.clone() as Arc<dyn StorageDaemon>;
            match start(host, req) {
                Ok(_) => {
                    tracing::info!(volume = %v.name(), migration = %o.id, to = %o.to, "held in doubt: asking the destination how the switch ended")
                }
                Err(e) => {
                    tracing::warn!(volume = %v.name(), error = %e, "held in doubt: cannot ask the destination yet")
                }
            }
        }
    }
}
