//! How long this daemon's small disk moves take besides their link:
//! learned from its own recent migrations as their source (the whole time
//! less the round trips it waited and the pause) and told with every
//! volume sample (`move_setups_s`), so that the placement model prices a
//! move from here at this daemon's own fixed work (TLS, the copy's
//! opening, the prints' scan and answer on threads of background
//! priority, the digest) on the machine it runs on, not at a constant
//! fitted on another.
//!
//! Kept in `<pool>/move-setup.json` (a `ferry-state-file` log of seconds,
//! the last eight), so a restart keeps it. Only a migration on one
//! connection, not held for its caller, whose first pass sent at most
//! 4 MiB and went on to the pause, is measured: in a larger one the
//! fixed part is lost in the bytes' time.

use ferry_state_file::rate_log::{Seconds, SecondsLog};
use ferry_state_file::Kind;
use std::path::PathBuf;
use std::time::Duration;

/// The file in the pool's directory.
pub const FILE: &str = "move-setup.json";

/// Its format.
pub const KIND: Kind = Kind {
    format: "ferry-move-setup",
    version: 1,
    max_bytes: 1 << 14,
};

/// The daemon's recent small moves' fixed work.
#[derive(Debug, Default)]
pub struct MoveSetup {
    log: SecondsLog,
}

impl MoveSetup {
    /// The measures kept in `file`.
    pub fn open(file: PathBuf) -> MoveSetup {
        MoveSetup {
            log: SecondsLog::open(file, KIND, "the daemon's move set-up"),
        }
    }

    /// A small move took `fixed` besides its link. Known at once; written
    /// to the file on a blocking thread when called inside a runtime,
    /// else here.
    pub fn record(&self, fixed: Duration) {
        crate::keep_measure::keep(&self.log, Seconds(fixed.as_secs_f64()));
    }

    /// The measures kept (seconds), oldest first: the model weighs them
    /// against its constant while they are few.
    pub fn kept(&self) -> Vec<f64> {
        self.log.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_setup_is_kept_and_outlives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join(FILE);
        let m = MoveSetup::open(file.clone());
        assert!(m.kept().is_empty(), "no file yet");
        m.record(Duration::from_millis(80));
        m.record(Duration::from_millis(70));
        drop(m);
        let again = MoveSetup::open(file.clone());
        let kept = again.kept();
        assert_eq!(kept.len(), 2);
        assert!(
            (kept[0] - 0.08).abs() < 1e-9 && (kept[1] - 0.07).abs() < 1e-9,
            "{kept:?}"
        );
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("\"ferry-move-setup\""), "{text}");
    }
}
