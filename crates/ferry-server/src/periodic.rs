//! The daemon's periodic background jobs: one blocking job run every
//! period on a worker thread (one run at a time, late ticks delayed, not
//! bunched) until shutdown.

use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Run `job` every `period` until `shutdown`; `what` names it in the log
/// when a run panics.
pub async fn every<F>(period: Duration, shutdown: CancellationToken, what: &'static str, job: F)
where
    F: Fn() + Clone + Send + 'static,
{
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = shutdown.cancelled() => return,
        }
        if let Err(e) = tokio::task::spawn_blocking(job.clone()).await {
            tracing::warn!(error = %e, "{what} failed");
        }
    }
}
