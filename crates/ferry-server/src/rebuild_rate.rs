//! How fast this daemon's pool rebuilds, into a copy a migration brings,
//! the blocks it already holds: learned from its own recent incoming
//! migrations and told with every index lookup (`rebuild_bps`), so that
//! the placement model prices a move here at this pool's rate, not at a
//! constant fitted on another machine's disk.
//!
//! Kept in memory since the daemon started: a daemon that has not yet
//! rebuilt [`ferry_migration_engine::destination::MIN_MEASURED_REBUILD`]
//! in one migration tells nothing, and the model uses its constant.

use std::collections::VecDeque;

/// How many recent migrations the rate is taken over.
const KEPT: usize = 8;

/// The recent measurements, newest last.
#[derive(Debug, Default)]
pub struct RebuildRate {
    recent: parking_lot::Mutex<VecDeque<(u64, f64)>>,
}

impl RebuildRate {
    /// A migration rebuilt `bytes` from held blocks in `seconds`.
    pub fn record(&self, bytes: u64, seconds: f64) {
        if bytes == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let mut r = self.recent.lock();
        r.push_back((bytes, seconds));
        while r.len() > KEPT {
            r.pop_front();
        }
    }

    /// Bytes per second over the recent migrations, each weighted by what
    /// it rebuilt (a large move says more about the disk than a small one
    /// the page cache absorbed); `None` before the first.
    #[allow(clippy::cast_precision_loss)]
    pub fn bytes_per_second(&self) -> Option<f64> {
        let r = self.recent.lock();
        let (bytes, secs) = r.iter().fold((0u64, 0.0f64), |(b, s), &(nb, ns)| {
            (b.saturating_add(nb), s + ns)
        });
        (secs > 0.0).then(|| bytes as f64 / secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_weighs_each_move_by_what_it_rebuilt_and_forgets_old_ones() {
        let r = RebuildRate::default();
        assert_eq!(r.bytes_per_second(), None);
        r.record(0, 1.0);
        r.record(100, 0.0);
        r.record(100, f64::NAN);
        assert_eq!(r.bytes_per_second(), None, "nothing measured");
        // 1 GB in 4 s and 100 MB in 0.1 s: 1.1 GB in 4.1 s, not the mean
        // of 250 MB/s and 1 GB/s.
        r.record(1_000_000_000, 4.0);
        r.record(100_000_000, 0.1);
        let bps = r.bytes_per_second().unwrap();
        assert!((bps - 1.1e9 / 4.1).abs() < 1.0, "{bps}");
        // Eight newer moves at 500 MB/s push both out.
        for _ in 0..KEPT {
            r.record(500_000_000, 1.0);
        }
        assert!((r.bytes_per_second().unwrap() - 5e8).abs() < 1.0);
    }
}
