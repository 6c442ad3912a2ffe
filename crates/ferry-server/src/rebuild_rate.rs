//! How fast this daemon's pool rebuilds, into a copy a migration brings,
//! the blocks it already holds: learned from its own recent incoming
//! migrations and told with every index lookup (`rebuild_bps`), so that
//! the placement model prices a move here at this pool's rate, not at a
//! constant fitted on another machine's disk.
//!
//! Kept in `<pool>/rebuild-rate.json` (a `ferry-state-file` rate log), so
//! a restart keeps it; a daemon that has not yet rebuilt
//! [`ferry_migration_engine::destination::MIN_MEASURED_REBUILD`] in one
//! migration tells nothing, and the model uses its constant.

use ferry_state_file::rate_log::{Measure, RateLog};
use ferry_state_file::Kind;
use std::path::PathBuf;

/// The file in the pool's directory.
pub const FILE: &str = "rebuild-rate.json";

/// Its format.
pub const KIND: Kind = Kind {
    format: "ferry-rebuild-rate",
    version: 1,
    max_bytes: 1 << 14,
};

/// The pool's recent rebuilds.
#[derive(Debug, Default)]
pub struct RebuildRate {
    log: RateLog,
}

impl RebuildRate {
    /// The measures kept in `file`.
    pub fn open(file: PathBuf) -> RebuildRate {
        RebuildRate {
            log: RateLog::open(file, KIND, "the pool's rebuild rate"),
        }
    }

    /// A migration rebuilt `bytes` from held blocks in `seconds`. Known at
    /// once; written to the file on a blocking thread when called inside
    /// a runtime (the destination tells it as it commits, while the
    /// source's guest may be paused), else here.
    pub fn record(&self, bytes: u64, seconds: f64) {
        crate::keep_measure::keep(&self.log, Measure { bytes, seconds });
    }

    /// Bytes per second over the recent migrations, each weighted by what
    /// it rebuilt (a large move says more about the disk than a small one
    /// the page cache absorbed); `None` before the first.
    pub fn bytes_per_second(&self) -> Option<f64> {
        self.log.bytes_per_second()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rebuild_rate_outlives_a_restart_in_its_own_format() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(FILE);
        let r = RebuildRate::open(file.clone());
        assert_eq!(r.bytes_per_second(), None, "no file yet");
        r.record(400_000_000, 1.0);
        r.record(200_000_000, 1.0);
        drop(r);
        assert_eq!(
            RebuildRate::open(file.clone()).bytes_per_second(),
            Some(3e8)
        );
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("\"ferry-rebuild-rate\""), "{text}");
    }
}
