//! How fast each running guest dirties its memory, as QEMU estimates it
//! (`calc-dirty-rate` in page-sampling mode), measured now and then so that
//! the controller prices a memory move with the guest's own figure; the
//! same round takes [`crate::memory_sample`]'s share of each guest.
//!
//! Page sampling hashes a sample of the guest's pages, waits, and counts
//! the sampled pages whose contents changed: it only reads guest RAM, so it
//! costs the guest nothing and can run beside a move. Its resolution is
//! QEMU's unit, 1 MiB/s. The dirty-bitmap mode would count whole pages
//! exactly, but it turns on global dirty logging, and QEMU 7.2 under TCG
//! exited when asked for it on this project's test guest.

use crate::guest::Guest;
use crate::VmError;
use ferry_api::{DirtyRateView, VmState};
use ferry_qmp::DirtyRateInfo;
use ferry_qmp::QmpClient;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Seconds between QEMU's two looks at the sampled pages.
const CALC_TIME_S: u64 = 1;
/// Pages sampled per GiB of guest RAM: QEMU's maximum (its default, 512,
/// samples 128 pages of a 256 MiB guest).
const SAMPLE_PAGES_PER_GIB: u64 = 4096;
/// How long after the calculation's end QEMU may take to say it is done.
const ANSWER_LIMIT: Duration = Duration::from_secs(5);

/// What the host last measured of a guest's memory.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MemoryFigures {
    /// When it was last asked for (None: not since QEMU started here).
    pub sampled: Option<Instant>,
    /// QEMU's latest estimate of how fast the guest dirties its memory.
    pub dirty: Option<DirtyRateView>,
    /// Link bytes a memory move would send per resident byte
    /// ([`crate::memory_sample`]).
    pub link_share: Option<f64>,
}

/// What one `query-dirty-rate` answer says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// Bytes dirtied per second.
    Measured(u64),
    Measuring,
}

fn answer(detail: String) -> VmError {
    crate::QemuFault::Answer {
        command: "query-dirty-rate",
        detail,
    }
    .into()
}

fn parse_answer(v: &DirtyRateInfo) -> Result<Answer, VmError> {
    match v.status.as_str() {
        "measured" => {
            let mib = v
                .dirty_rate
                .and_then(|r| u64::try_from(r).ok())
                .ok_or_else(|| answer(format!("no dirty-rate in {v:?}")))?;
            Ok(Answer::Measured(mib.saturating_mul(1 << 20)))
        }
        "measuring" => Ok(Answer::Measuring),
        "" => Err(answer("no status".into())),
        other => Err(answer(format!("status {other}"))),
    }
}

/// Ask QEMU for one measurement and wait for it: about `CALC_TIME_S`.
pub async fn measure(qmp: &QmpClient) -> Result<u64, VmError> {
    if qmp
        .calc_dirty_rate(CALC_TIME_S, Some(SAMPLE_PAGES_PER_GIB))
        .await
        .is_err()
    {
        // QEMU before 6.1 takes no sample-pages.
        qmp.calc_dirty_rate(CALC_TIME_S, None).await?;
    }
    tokio::time::sleep(Duration::from_secs(CALC_TIME_S)).await;
    let deadline = tokio::time::Instant::now() + ANSWER_LIMIT;
    loop {
        let v = qmp.query_dirty_rate().await?;
        match parse_answer(&v)? {
            Answer::Measured(b) => return Ok(b),
            Answer::Measuring if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Answer::Measuring => return Err(answer("still measuring after its time".into())),
        }
    }
}

/// Measure every running guest of `guests` not measured in the last
/// `every` (or never since its QEMU started), all at once, and keep the
/// figures: its dirty rate, and the link share of its memory
/// ([`crate::memory_sample`]). A guest that is moving, waiting for a move
/// or not running is skipped (its QEMU is busy with the move, or has
/// nothing to say); a failure is logged and leaves the guest's last
/// figure as it was.
pub async fn sample(guests: Vec<Arc<Guest>>, every: Duration) {
    let mut tasks = tokio::task::JoinSet::new();
    for g in guests {
        let due = g.memory.lock().sampled.is_none_or(|t| t.elapsed() >= every);
        if !due || g.moving.lock().is_some() || g.incoming.lock().is_some() {
            continue;
        }
        tasks.spawn(async move {
            // A QEMU that stops answering holds up no one else, nor the
            // next round.
            if tokio::time::timeout(GUEST_LIMIT, sample_one(&g))
                .await
                .is_err()
            {
                tracing::debug!(guest = %g.name(), "its memory sample timed out");
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// How long one guest's measurements may take.
const GUEST_LIMIT: Duration = Duration::from_secs(20);

async fn sample_one(g: &Guest) {
    if g.state().await.0 != VmState::Running {
        return;
    }
    let Some(rt) = g.runtime() else { return };
    g.memory.lock().sampled = Some(Instant::now());
    match measure(&rt.qmp).await {
        Ok(bytes_per_s) => {
            g.memory.lock().dirty = Some(DirtyRateView {
                bytes_per_s,
                measured_unix_ms: unix_ms(),
            });
        }
        Err(e) => tracing::debug!(guest = %g.name(), error = %e, "no dirty rate"),
    }
    let (pid, memory) = (rt.pid, g.spec.lock().memory_mib << 20);
    match tokio::task::spawn_blocking(move || crate::memory_sample::sample(pid, memory)).await {
        Ok(Some(share)) => g.memory.lock().link_share = Some(share),
        _ => tracing::debug!(guest = %g.name(), "no sample of its memory"),
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn answers_are_read_in_bytes_and_odd_ones_are_errors() {
        let read = |v: serde_json::Value| parse_answer(&serde_json::from_value(v).unwrap());
        let measured = json!({"status": "measured", "sample-pages": 4096,
            "dirty-rate": 3, "mode": "page-sampling", "start-time": 1, "calc-time": 1});
        assert_eq!(read(measured).unwrap(), Answer::Measured(3 << 20));
        let busy = json!({"status": "measuring", "calc-time": 1});
        assert_eq!(read(busy).unwrap(), Answer::Measuring);
        // Never asked, or an answer without its figure.
        assert!(read(json!({"status": "unstarted"})).is_err());
        assert!(read(json!({"status": "measured"})).is_err());
        assert!(read(json!({})).is_err());
        assert!(read(json!({"status": "measured", "dirty-rate": -1})).is_err());
    }
}
