//! How long this daemon's switches hold a volume's writes besides the
//! link: learned from its own recent migrations as their source (the hold
//! less the round trip the migration timed with `Ping`) and told with
//! every volume sample (`switch_hold_s`), so that the placement model
//! prices a disk move's pause from here at this daemon's own work (its
//! journal's fsync, the destination's commit), not at a constant fitted
//! on another machine.
//!
//! Kept in `<pool>/switch-hold.json` (a `ferry-state-file` log of
//! seconds, the median of the last eight), so a restart keeps it; the
//! median told once [`TOLD_FROM`] are kept, the holds themselves
//! (`switch_holds_s`) from the first: the model weighs a few of them
//! against its constant, which keeps one outlier from pricing alone.
//! Only a
//! switch made on the migration's first connection, not held for a
//! caller (a teleport's disk switches beside its guest's memory), and
//! whose round trip was timed, is measured.

use ferry_state_file::rate_log::{Seconds, SecondsLog};
use ferry_state_file::Kind;
use std::path::PathBuf;
use std::time::Duration;

/// The file in the pool's directory.
pub const FILE: &str = "switch-hold.json";

/// Its format.
pub const KIND: Kind = Kind {
    format: "ferry-switch-hold",
    version: 1,
    max_bytes: 1 << 14,
};

/// The fewest holds whose median is told. A daemon's first switch may
/// hold twice as long as its next (an fsync on a shared disk, the first
/// use of the migration's paths), and a median of one or two is that
/// outlier: a model check of 2026-12-01 held its first switch 22.7 ms
/// beside the link, and priced the next two at 22.4 and 17.2 ms where
/// they held 12.9 and 10.4. Until then the model prices at its constant.
pub const TOLD_FROM: usize = 3;

/// The daemon's recent switch holds, each less its link's round trip.
#[derive(Debug, Default)]
pub struct SwitchHold {
    log: SecondsLog,
}

impl SwitchHold {
    /// The measures kept in `file`.
    pub fn open(file: PathBuf) -> SwitchHold {
        SwitchHold {
            log: SecondsLog::open(file, KIND, "the daemon's switch hold"),
        }
    }

    /// A switch held the writes `hold` over a link whose round trip was
    /// `rtt`. Known at once; written to the file on a blocking thread when
    /// called inside a runtime, else here.
    pub fn record(&self, hold: Duration, rtt: Duration) {
        let own = hold.saturating_sub(rtt).as_secs_f64();
        crate::keep_measure::keep(&self.log, Seconds(own));
    }

    /// The median hold besides the link of the recent switches (seconds);
    /// `None` before [`TOLD_FROM`] are kept.
    pub fn seconds(&self) -> Option<f64> {
        self.log.median_of_at_least(TOLD_FROM)
    }

    /// The holds kept (seconds), oldest first.
    pub fn kept(&self) -> Vec<f64> {
        self.log.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_switch_hold_is_its_own_part_and_outlives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(FILE);
        let h = SwitchHold::open(file.clone());
        assert_eq!(h.seconds(), None, "no file yet");
        let ms = Duration::from_millis;
        h.record(ms(30), ms(9));
        // One hold, or two, is not told: a first switch's outlier would
        // be the median.
        assert_eq!(h.seconds(), None);
        h.record(ms(15), ms(9));
        assert_eq!(h.seconds(), None);
        assert_eq!(h.kept().len(), 2);
        h.record(ms(12), ms(9));
        assert!((h.seconds().unwrap() - 0.006).abs() < 1e-9);
        // A hold shorter than the round trip timed before it (the link
        // got faster) counts as none, not as a negative time.
        h.record(ms(5), ms(9));
        drop(h);
        let again = SwitchHold::open(file.clone());
        let median = again.seconds().unwrap();
        assert!((median - 0.0045).abs() < 1e-9, "{median}");
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("\"ferry-switch-hold\""), "{text}");
    }
}
