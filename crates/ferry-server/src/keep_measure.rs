//! Keeping one measure of the daemon's own work (`rebuild_rate`,
//! `switch_hold`): in memory at once, on disk off the caller's path.

use ferry_state_file::rate_log::{RecentLog, Sample};

/// Keep `m` in `log` if real work could have made it, and write the log's
/// file on a blocking thread when called inside a runtime (a migration's
/// end, where a guest may be paused), else here. Whether it was kept.
pub(crate) fn keep<M: Sample>(log: &RecentLog<M>, m: M) -> bool {
    if !log.record(m) {
        return false;
    }
    let log = log.clone();
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn_blocking(move || log.save())),
        Err(_) => log.save(),
    }
    true
}
