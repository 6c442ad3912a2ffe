//! How fast this daemon's pool rebuilds, into a copy a migration brings,
//! the blocks it already holds: learned from its own recent incoming
//! migrations and told with every index lookup (`rebuild_bps`), so that
//! the placement model prices a move here at this pool's rate, not at a
//! constant fitted on another machine's disk.
//!
//! Kept in `<pool>/rebuild-rate.json` (`ferry-state-file`), so a restart
//! keeps it; a daemon that has not yet rebuilt
//! [`ferry_migration_engine::destination::MIN_MEASURED_REBUILD`] in one
//! migration tells nothing, and the model uses its constant.

use ferry_state_file::Kind;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

/// How many recent migrations the rate is taken over.
const KEPT: usize = 8;

/// The file in the pool's directory.
pub const FILE: &str = "rebuild-rate.json";

/// Its format.
pub const KIND: Kind = Kind {
    format: "ferry-rebuild-rate",
    version: 1,
    max_bytes: 1 << 14,
};

/// One migration's rebuild: bytes placed from held blocks, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Measure {
    pub bytes: u64,
    pub seconds: f64,
}

/// The longest rebuild a measure may claim (a year): with at most
/// [`KEPT`] of them their seconds add up to a finite sum.
const MAX_SECONDS: f64 = 365.0 * 86_400.0;

impl Measure {
    /// One a rebuild could make: bytes, and a time that is positive,
    /// bounded and not so short that its rate is infinite. The rate over
    /// any [`KEPT`] of them is then positive and finite (it is at most
    /// the largest of theirs).
    #[allow(clippy::cast_precision_loss)]
    fn usable(&self) -> bool {
        self.bytes > 0
            && self.seconds > 0.0
            && self.seconds <= MAX_SECONDS
            && (self.bytes as f64 / self.seconds).is_finite()
    }
}

/// What the file holds.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Saved {
    pub recent: Vec<Measure>,
}

/// The recent measurements, newest last, and where they are kept.
#[derive(Debug, Default)]
pub struct RebuildRate {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    recent: parking_lot::Mutex<VecDeque<Measure>>,
    file: Option<PathBuf>,
    /// Held while the file is written, so that the last write is of the
    /// newest measures.
    writing: parking_lot::Mutex<()>,
}

impl RebuildRate {
    /// The measures kept in `file` (none if it is absent; a damaged file
    /// is reported and replaced by the next measure).
    pub fn open(file: PathBuf) -> RebuildRate {
        let saved = match ferry_state_file::load::<Saved>(&file, KIND) {
            Ok(s) => s.unwrap_or_default(),
            Err(e) => {
                tracing::warn!(error = %e, "the pool's rebuild rate is not read; measured again from the next migrations");
                Saved::default()
            }
        };
        let mut recent = VecDeque::new();
        for m in saved.recent {
            push_newest(&mut recent, m);
        }
        RebuildRate {
            inner: Arc::new(Inner {
                recent: parking_lot::Mutex::new(recent),
                file: Some(file),
                writing: parking_lot::Mutex::new(()),
            }),
        }
    }

    /// A migration rebuilt `bytes` from held blocks in `seconds`. Known at
    /// once; written to the file on a blocking thread when called inside
    /// a runtime (the destination tells it as it commits, while the
    /// source's guest may be paused), else here.
    pub fn record(&self, bytes: u64, seconds: f64) {
        if !push_newest(&mut self.inner.recent.lock(), Measure { bytes, seconds })
            || self.inner.file.is_none()
        {
            return;
        }
        let inner = self.inner.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || inner.save())),
            Err(_) => inner.save(),
        }
    }

    /// Bytes per second over the recent migrations, each weighted by what
    /// it rebuilt (a large move says more about the disk than a small one
    /// the page cache absorbed); `None` before the first.
    #[allow(clippy::cast_precision_loss)]
    pub fn bytes_per_second(&self) -> Option<f64> {
        let r = self.inner.recent.lock();
        let (bytes, secs) = r.iter().fold((0u64, 0.0f64), |(b, s), m| {
            (b.saturating_add(m.bytes), s + m.seconds)
        });
        (secs > 0.0).then(|| bytes as f64 / secs)
    }
}

/// Keep `m` as the newest of `recent` if it is usable, forgetting the
/// oldest beyond [`KEPT`]; whether it was kept.
fn push_newest(recent: &mut VecDeque<Measure>, m: Measure) -> bool {
    if !m.usable() {
        return false;
    }
    recent.push_back(m);
    while recent.len() > KEPT {
        recent.pop_front();
    }
    true
}

impl Inner {
    fn save(&self) {
        let Some(file) = &self.file else {
            return;
        };
        let _w = self.writing.lock();
        let saved = Saved {
            recent: self.recent.lock().iter().copied().collect(),
        };
        if let Err(e) = ferry_state_file::save(file, KIND, &saved) {
            tracing::warn!(error = %e, "the pool's rebuild rate is not saved");
        }
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

    #[test]
    fn the_rate_outlives_a_restart_and_a_damaged_file_only_forgets_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(FILE);
        let r = RebuildRate::open(file.clone());
        assert_eq!(r.bytes_per_second(), None, "no file yet");
        r.record(400_000_000, 1.0);
        r.record(200_000_000, 1.0);
        drop(r);
        let again = RebuildRate::open(file.clone());
        assert_eq!(again.bytes_per_second(), Some(3e8));
        // Entries no measure could make are dropped, the rest kept.
        ferry_state_file::save(
            &file,
            KIND,
            &serde_json::json!({"recent": [
                {"bytes": 0, "seconds": 1.0},
                {"bytes": 5, "seconds": -1.0},
                {"bytes": u64::MAX, "seconds": 1e-310},
                {"bytes": 5, "seconds": 1e300},
                {"bytes": 5, "seconds": 1e300},
                {"bytes": 100_000_000, "seconds": 0.5},
            ]}),
        )
        .unwrap();
        assert_eq!(
            RebuildRate::open(file.clone()).bytes_per_second(),
            Some(2e8)
        );
        // Damaged, too large, another format: read as nothing measured,
        // and the next measure replaces the file.
        for bad in [
            b"{\"format\": \"ferry-rebuild-rate\", \"version\": 1, \"state\": {\"recent\": [{\"bytes\": \"x\"}]}}".to_vec(),
            vec![b' '; 1 << 15],
            b"{\"format\": \"ferry-vm-spec\", \"version\": 1, \"state\": {}}".to_vec(),
            b"\xff\x00not json".to_vec(),
        ] {
            std::fs::write(&file, &bad).unwrap();
            let r = RebuildRate::open(file.clone());
            assert_eq!(r.bytes_per_second(), None);
            r.record(100_000_000, 1.0);
            assert_eq!(RebuildRate::open(file.clone()).bytes_per_second(), Some(1e8));
        }
    }
}
