//! What to do when a memory move does not converge (pure: QEMU's progress
//! samples in, one action out). QEMU's own auto-converge throttles the
//! guest's CPUs from the start; this ladder watches the bytes still to
//! send at each dirty-sync round and, when they stop shrinking, raises the
//! allowed pause step by step up to the maximum, then switches to
//! post-copy where allowed, then gives up cleanly. The deadline covers
//! the disk pre-copy and the memory move together.

use std::time::Duration;

/// One `query-migrate` reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// RAM bytes still to send.
    pub remaining: u64,
    /// Dirty-sync rounds so far.
    pub rounds: u64,
    /// Since the move started (disk pre-copy included).
    pub elapsed: Duration,
    /// QEMU's CPU throttle, percent.
    pub throttle_pct: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Allow this longer pause (ms).
    RaiseDowntime(u64),
    /// Switch to post-copy now.
    Postcopy(String),
    /// Cancel the move; the guest stays at the source.
    Abort(String),
}

/// Rounds without progress before the next step.
pub const STALL_ROUNDS: u32 = 3;
/// Progress means the remaining bytes fell by at least this share.
const PROGRESS: f64 = 0.10;

/// The state of the ladder for one move.
#[derive(Debug, Clone)]
pub struct Ladder {
    pub downtime_ms: u64,
    max_downtime_ms: u64,
    postcopy_allowed: bool,
    postcopy_started: bool,
    deadline: Duration,
    best: Option<u64>,
    last_round: u64,
    stalled: u32,
}

/// The first pause allowed: a quarter of the maximum, at least 50 ms.
pub fn first_downtime(max_ms: u64) -> u64 {
    (max_ms / 4).max(50).min(max_ms.max(1))
}

impl Ladder {
    pub fn new(max_downtime_ms: u64, postcopy_allowed: bool, deadline: Duration) -> Ladder {
        Ladder {
            downtime_ms: first_downtime(max_downtime_ms),
            max_downtime_ms,
            postcopy_allowed,
            postcopy_started: false,
            deadline,
            best: None,
            last_round: 0,
            stalled: 0,
        }
    }

    fn give_up(&mut self, why: String) -> Option<Action> {
        if self.postcopy_allowed && !self.postcopy_started {
            self.postcopy_started = true;
            return Some(Action::Postcopy(why));
        }
        if self.postcopy_started {
            // Post-copy always finishes; nothing more to do.
            return None;
        }
        Some(Action::Abort(why))
    }

    /// Look at one sample; at most one action per call.
    pub fn observe(&mut self, s: &Sample) -> Option<Action> {
        if s.elapsed > self.deadline {
            let why = format!(
                "deadline of {} s passed with {} bytes of memory left",
                self.deadline.as_secs(),
                s.remaining
            );
            return self.give_up(why);
        }
        if s.rounds <= self.last_round {
            return None;
        }
        self.last_round = s.rounds;
        // The first full pass sets the baseline.
        if s.rounds < 2 {
            self.best = Some(s.remaining);
            return None;
        }
        #[allow(clippy::cast_precision_loss)]
        let progressed = match self.best {
            Some(b) => (s.remaining as f64) < (b as f64) * (1.0 - PROGRESS),
            None => true,
        };
        if progressed {
            self.best = Some(s.remaining);
            self.stalled = 0;
            return None;
        }
        self.stalled += 1;
        if self.stalled < STALL_ROUNDS {
            return None;
        }
        self.stalled = 0;
        if self.downtime_ms < self.max_downtime_ms {
            self.downtime_ms = (self.downtime_ms * 2).min(self.max_downtime_ms);
            return Some(Action::RaiseDowntime(self.downtime_ms));
        }
        let why = format!(
            "memory left stopped shrinking ({} bytes after {} rounds, CPU throttle {}%, pause already at the {} ms maximum)",
            s.remaining, s.rounds, s.throttle_pct, self.max_downtime_ms
        );
        self.give_up(why)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(remaining: u64, rounds: u64, secs: u64) -> Sample {
        Sample {
            remaining,
            rounds,
            elapsed: Duration::from_secs(secs),
            throttle_pct: 20,
        }
    }

    #[test]
    fn a_converging_move_is_left_alone() {
        let mut l = Ladder::new(300, false, Duration::from_secs(60));
        for (i, r) in [1000u64, 500, 250, 100].iter().enumerate() {
            assert_eq!(l.observe(&at(*r, i as u64 + 1, 1)), None);
        }
        assert_eq!(l.downtime_ms, 75);
    }

    #[test]
    fn a_stall_raises_the_pause_then_aborts() {
        let mut l = Ladder::new(300, false, Duration::from_secs(600));
        let mut acts = Vec::new();
        for round in 1..=20 {
            if let Some(a) = l.observe(&at(1000, round, 1)) {
                acts.push(a);
            }
            // Samples within one round change nothing.
            assert_eq!(l.observe(&at(1000, round, 1)), None);
        }
        assert_eq!(acts[0], Action::RaiseDowntime(150));
        assert_eq!(acts[1], Action::RaiseDowntime(300));
        assert!(matches!(&acts[2], Action::Abort(w) if w.contains("stopped shrinking")));
    }

    #[test]
    fn postcopy_comes_before_abort_and_only_once() {
        let mut l = Ladder::new(100, true, Duration::from_secs(600));
        let mut acts = Vec::new();
        for round in 1..30 {
            if let Some(a) = l.observe(&at(1000, round, 1)) {
                acts.push(a);
            }
        }
        assert_eq!(acts.len(), 2, "{acts:?}");
        assert_eq!(acts[0], Action::RaiseDowntime(100));
        assert!(matches!(acts[1], Action::Postcopy(_)));
    }

    #[test]
    fn the_deadline_ends_the_move() {
        let mut l = Ladder::new(300, false, Duration::from_secs(10));
        assert_eq!(l.observe(&at(5, 1, 3)), None);
        assert!(
            matches!(l.observe(&at(5, 1, 11)), Some(Action::Abort(w)) if w.contains("deadline"))
        );
    }
}
