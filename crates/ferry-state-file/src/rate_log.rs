//! What a daemon learns from its own recent work and keeps in a state
//! file across restarts: a rate (bytes in seconds over the last few
//! measures, each weighted by its bytes: a storage daemon's rebuild of
//! held blocks, a VM host's memory stream) or a fixed cost (the median
//! of the last few: a VM host's set-up of a move) or a share (the median
//! of the last few: how much of its link a VM host's memory stream
//! kept busy), or the pauses of its recent moves with what set them (a
//! VM host's memory moves: each pause with its link's round trip and the
//! guest's memory, which the placement model takes apart). A damaged file
//! is reported and read as nothing measured; an entry no measure could
//! make is dropped, so a rate is always absent or positive and finite, a
//! cost absent or finite and not negative, a share absent or above zero
//! and at most one, and a pause positive and finite with a finite round
//! trip.

use crate::Kind;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;

/// How many recent measures a log keeps.
pub const KEPT: usize = 8;

/// The longest time a measure may claim (a year): with at most [`KEPT`]
/// of them their seconds add up to a finite sum.
const MAX_SECONDS: f64 = 365.0 * 86_400.0;

/// What a log keeps: one measure, which says whether real work could
/// have made it.
pub trait Sample: Copy + std::fmt::Debug + Serialize + DeserializeOwned + Send + 'static {
    fn usable(&self) -> bool;
}

/// One measure of a rate: bytes, in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Measure {
    pub bytes: u64,
    pub seconds: f64,
}

impl Sample for Measure {
    /// Bytes, and a time that is positive, bounded and not so short that
    /// its rate is infinite. The rate over any [`KEPT`] of them is then
    /// positive and finite (it is at most the largest of theirs).
    #[allow(clippy::cast_precision_loss)]
    fn usable(&self) -> bool {
        self.bytes > 0
            && self.seconds > 0.0
            && self.seconds <= MAX_SECONDS
            && (self.bytes as f64 / self.seconds).is_finite()
    }
}

/// One measure of a fixed cost: seconds, zero or more, at most a year.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Seconds(pub f64);

impl Sample for Seconds {
    fn usable(&self) -> bool {
        (0.0..=MAX_SECONDS).contains(&self.0)
    }
}

/// One measure of a share of something: above zero, at most one.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Share(pub f64);

impl Sample for Share {
    fn usable(&self) -> bool {
        self.0 > 0.0 && self.0 <= 1.0
    }
}

/// One move's pause, with what the placement model prices it from: the
/// round trip of the link it crossed and the guest's memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Pause {
    pub pause_s: f64,
    pub rtt_s: f64,
    pub memory_bytes: u64,
}

impl Sample for Pause {
    /// A pause above zero and a round trip of zero or more, each at most
    /// a year, of a guest with memory.
    fn usable(&self) -> bool {
        self.pause_s > 0.0
            && self.pause_s <= MAX_SECONDS
            && (0.0..=MAX_SECONDS).contains(&self.rtt_s)
            && self.memory_bytes > 0
    }
}

/// A measure that is one number, whose log's summary is the median.
pub trait Scalar: Sample {
    fn value(&self) -> f64;
}

impl Scalar for Seconds {
    fn value(&self) -> f64 {
        self.0
    }
}

impl Scalar for Share {
    fn value(&self) -> f64 {
        self.0
    }
}

/// What the file holds.
#[derive(Debug, Serialize, Deserialize)]
#[serde(bound = "M: Sample")]
pub struct Saved<M> {
    pub recent: Vec<M>,
}

/// The recent measures, newest last, and the file they are kept in.
/// Clones share them.
#[derive(Debug)]
pub struct RecentLog<M> {
    inner: Arc<Inner<M>>,
}

/// A rate learned from recent work.
pub type RateLog = RecentLog<Measure>;
/// A fixed cost learned from recent work.
pub type SecondsLog = RecentLog<Seconds>;
/// A share learned from recent work.
pub type ShareLog = RecentLog<Share>;
/// Recent moves' pauses.
pub type PauseLog = RecentLog<Pause>;

impl<M> Clone for RecentLog<M> {
    fn clone(&self) -> Self {
        RecentLog {
            inner: self.inner.clone(),
        }
    }
}

impl<M> Default for RecentLog<M> {
    fn default() -> Self {
        RecentLog {
            inner: Arc::new(Inner {
                recent: parking_lot::Mutex::new(VecDeque::new()),
                file: None,
                writing: parking_lot::Mutex::new(()),
            }),
        }
    }
}

#[derive(Debug)]
struct Inner<M> {
    recent: parking_lot::Mutex<VecDeque<M>>,
    file: Option<(PathBuf, Kind)>,
    /// Held while the file is written, so that the last write is of the
    /// newest measures.
    writing: parking_lot::Mutex<()>,
}

impl<M: Sample> RecentLog<M> {
    /// The measures kept in `file` (none if it is absent; a damaged file
    /// is reported, naming `what` is measured, and replaced at the next
    /// save).
    pub fn open(file: PathBuf, kind: Kind, what: &str) -> Self {
        let saved = match crate::load::<Saved<M>>(&file, kind) {
            Ok(s) => s.map_or_else(Vec::new, |s| s.recent),
            Err(e) => {
                tracing::warn!(error = %e, "{what} is not read; measured again from the next work");
                Vec::new()
            }
        };
        let mut recent = VecDeque::new();
        for m in saved {
            push_newest(&mut recent, m);
        }
        RecentLog {
            inner: Arc::new(Inner {
                recent: parking_lot::Mutex::new(recent),
                file: Some((file, kind)),
                writing: parking_lot::Mutex::new(()),
            }),
        }
    }

    /// Keep `m` in memory as the newest measure if real work could have
    /// made it; whether it was (and the file is then due a
    /// [`RecentLog::save`]).
    pub fn record(&self, m: M) -> bool {
        push_newest(&mut self.inner.recent.lock(), m)
    }

    /// The recent measures, oldest first.
    pub fn recent(&self) -> Vec<M> {
        self.inner.recent.lock().iter().copied().collect()
    }

    /// Write the measures to the file (an fsync: callers on an async
    /// runtime run it on a blocking thread). A failure is logged: the
    /// measures stay known until the process ends.
    pub fn save(&self) {
        let Some((file, kind)) = &self.inner.file else {
            return;
        };
        let _w = self.inner.writing.lock();
        let saved = Saved {
            recent: self.recent(),
        };
        if let Err(e) = crate::save(file, *kind, &saved) {
            tracing::warn!(error = %e, "a measured rate is not saved");
        }
    }
}

impl RecentLog<Measure> {
    /// Bytes per second over the recent measures, each weighted by its
    /// bytes (a large piece of work says more than a small one); `None`
    /// before the first.
    #[allow(clippy::cast_precision_loss)]
    pub fn bytes_per_second(&self) -> Option<f64> {
        let r = self.inner.recent.lock();
        let (bytes, secs) = r.iter().fold((0u64, 0.0f64), |(b, s), m| {
            (b.saturating_add(m.bytes), s + m.seconds)
        });
        (secs > 0.0).then(|| bytes as f64 / secs)
    }
}

impl<M: Scalar> RecentLog<M> {
    /// The recent measures' values, oldest first.
    pub fn values(&self) -> Vec<f64> {
        self.inner.recent.lock().iter().map(Scalar::value).collect()
    }

    /// The median of the recent measures (the mean of the middle two of
    /// an even count); `None` before the first.
    pub fn median(&self) -> Option<f64> {
        self.median_of_at_least(1)
    }

    /// [`RecentLog::median`], or `None` while fewer than `least` measures
    /// are kept (a median of one or two is its outlier).
    pub fn median_of_at_least(&self, least: usize) -> Option<f64> {
        let mut v = self.values();
        let n = v.len();
        if n == 0 || n < least {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        })
    }
}

/// Keep `m` as the newest of `recent` if it is usable, forgetting the
/// oldest beyond [`KEPT`]; whether it was kept.
fn push_newest<M: Sample>(recent: &mut VecDeque<M>, m: M) -> bool {
    if !m.usable() {
        return false;
    }
    recent.push_back(m);
    while recent.len() > KEPT {
        recent.pop_front();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIND: Kind = Kind {
        format: "ferry-test-rate",
        version: 1,
        max_bytes: 1 << 14,
    };

    #[test]
    fn the_rate_weighs_each_measure_by_its_bytes_and_forgets_old_ones() {
        let r = RateLog::default();
        assert_eq!(r.bytes_per_second(), None);
        assert!(!r.record(Measure {
            bytes: 0,
            seconds: 1.0
        }));
        assert!(!r.record(Measure {
            bytes: 100,
            seconds: 0.0
        }));
        assert!(!r.record(Measure {
            bytes: 100,
            seconds: f64::NAN
        }));
        assert_eq!(r.bytes_per_second(), None, "nothing measured");
        // 1 GB in 4 s and 100 MB in 0.1 s: 1.1 GB in 4.1 s, not the mean
        // of 250 MB/s and 1 GB/s.
        assert!(r.record(Measure {
            bytes: 1_000_000_000,
            seconds: 4.0
        }));
        r.record(Measure {
            bytes: 100_000_000,
            seconds: 0.1,
        });
        let bps = r.bytes_per_second().unwrap();
        assert!((bps - 1.1e9 / 4.1).abs() < 1.0, "{bps}");
        // Eight newer measures at 500 MB/s push both out.
        for _ in 0..KEPT {
            r.record(Measure {
                bytes: 500_000_000,
                seconds: 1.0,
            });
        }
        assert!((r.bytes_per_second().unwrap() - 5e8).abs() < 1.0);
    }

    #[test]
    fn the_rate_outlives_a_restart_and_a_damaged_file_only_forgets_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("rate.json");
        let open = || RateLog::open(file.clone(), KIND, "the test's rate");
        let r = open();
        assert_eq!(r.bytes_per_second(), None, "no file yet");
        r.record(Measure {
            bytes: 400_000_000,
            seconds: 1.0,
        });
        r.record(Measure {
            bytes: 200_000_000,
            seconds: 1.0,
        });
        r.save();
        drop(r);
        assert_eq!(open().bytes_per_second(), Some(3e8));
        // Entries no measure could make are dropped, the rest kept.
        crate::save(
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
        assert_eq!(open().bytes_per_second(), Some(2e8));
        // Damaged, too large, another format: read as nothing measured,
        // and the next save replaces the file.
        for bad in [
            b"{\"format\": \"ferry-test-rate\", \"version\": 1, \"state\": {\"recent\": [{\"bytes\": \"x\"}]}}".to_vec(),
            vec![b' '; 1 << 15],
            b"{\"format\": \"ferry-vm-spec\", \"version\": 1, \"state\": {}}".to_vec(),
            b"\xff\x00not json".to_vec(),
        ] {
            std::fs::write(&file, &bad).unwrap();
            let r = open();
            assert_eq!(r.bytes_per_second(), None);
            r.record(Measure { bytes: 100_000_000, seconds: 1.0 });
            r.save();
            assert_eq!(open().bytes_per_second(), Some(1e8));
        }
    }

    #[test]
    fn a_fixed_cost_is_the_median_of_its_recent_measures_and_outlives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("setup.json");
        let open = || SecondsLog::open(file.clone(), KIND, "the test's set-up");
        let s = open();
        assert_eq!(s.median(), None);
        for bad in [-0.1, f64::NAN, f64::INFINITY, 1e300] {
            assert!(!s.record(Seconds(bad)), "{bad}");
        }
        assert_eq!(s.median(), None);
        for x in [0.5, 0.2, 9.0] {
            s.record(Seconds(x));
        }
        assert_eq!(s.median(), Some(0.5), "one slow move does not move it");
        s.record(Seconds(0.1));
        assert_eq!(s.median(), Some(0.35), "the middle two of four");
        s.save();
        assert_eq!(open().median(), Some(0.35));
    }

    #[test]
    fn a_pause_is_kept_with_its_round_trip_and_memory_and_outlives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pauses.json");
        let open = || PauseLog::open(file.clone(), KIND, "the test's pauses");
        let p = open();
        let at = |pause_s, rtt_s, memory_bytes| Pause {
            pause_s,
            rtt_s,
            memory_bytes,
        };
        for bad in [
            at(0.0, 0.01, 1 << 28),
            at(-0.01, 0.01, 1 << 28),
            at(f64::NAN, 0.01, 1 << 28),
            at(0.03, -0.001, 1 << 28),
            at(0.03, f64::INFINITY, 1 << 28),
            at(1e300, 0.01, 1 << 28),
            at(0.03, 0.01, 0),
        ] {
            assert!(!p.record(bad), "{bad:?}");
        }
        assert!(p.recent().is_empty());
        for i in 0..10u32 {
            assert!(p.record(at(0.030 + f64::from(i) / 1000.0, 0.008, 1 << 28)));
        }
        let kept = p.recent();
        assert_eq!(kept.len(), KEPT, "the newest eight");
        assert_eq!(kept[0], at(0.032, 0.008, 1 << 28));
        p.save();
        assert_eq!(open().recent(), kept);
    }

    #[test]
    fn a_share_is_above_zero_and_at_most_one_and_its_summary_is_the_median() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("share.json");
        let open = || ShareLog::open(file.clone(), KIND, "the test's share");
        let s = open();
        for bad in [0.0, -0.5, 1.01, f64::NAN, f64::INFINITY] {
            assert!(!s.record(Share(bad)), "{bad}");
        }
        assert_eq!(s.median(), None);
        for x in [0.8, 1.0, 0.3] {
            assert!(s.record(Share(x)));
        }
        assert_eq!(s.median(), Some(0.8));
        s.save();
        assert_eq!(open().median(), Some(0.8));
    }
}
