//! The order of a move's memory copy, pure: fed QEMU's migration status
//! (`query-migrate`, read at each `MIGRATION` event or poll), a teleport's
//! disk phases, the caller's cancel and the disks' switch, it answers the
//! one thing to do next; `moves.rs` carries each answer out (a QMP
//! command, the disks' switch, cancelling QEMU's migration) and feeds
//! back what came of it. No I/O and no clock: the caller gives the time.
//!
//! ```text
//!   Copying --status precopy--> Copying (the convergence ladder may raise
//!      |                         the pause allowed, start post-copy, give up)
//!      |--status postcopy-*--> Postcopy (a cancel is no longer possible)
//!      |--status pre-switchover (teleport only: QEMU was told to pause
//!      |    before the switchover)--> ReleasingDisks --released--> Continuing
//!      |      (the disks switch while QEMU      `--release failed--> cancel
//!      |       sends the rest; Finish waits for both)
//!      |--status completed--> Completed (memory sent, the guest stopped
//!      |                      here: the Finish step confirms it runs there)
//!      `--status failed/cancelled--> Failed (QEMU resumes the guest)
//!   a cancel asked, a disk failed or lost too long during the copy,
//!   the ladder giving up --> Cancel (QEMU's migration cancelled, the
//!   guest resumes here)
//! ```

use crate::converge::{Action as Rung, Ladder, Sample};
use ferry_api::MigrationPhase;
use ferry_qmp::{MigrationInfo, MigrationStatus as Qemu};
use std::time::Duration;

/// A disk migration lost (not ready to switch) this long during the
/// memory copy ends the move.
pub const DISK_LOST_LIMIT: Duration = Duration::from_secs(3);

/// What the order is fed.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// `query-migrate`'s answer, `elapsed` since the move started.
    Status {
        info: MigrationInfo,
        elapsed: Duration,
    },
    /// A teleport's disk migrations, each `(volume, phase, error)`.
    Disks {
        phases: Vec<(String, MigrationPhase, Option<String>)>,
        elapsed: Duration,
    },
    /// The caller asked to cancel the move.
    CancelAsked,
    /// The disks' switch at the pre-switchover pause was released (or
    /// could not be: a disk was not ready, or its daemon refused).
    DisksReleased(Result<(), String>),
}

/// The next thing to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing: wait for QEMU's next event (or the poll interval).
    Wait,
    /// Allow a longer pause (`migrate-set-parameters downtime-limit`).
    SetDowntime { ms: u64, note: String },
    /// Switch to post-copy (`migrate-start-postcopy`).
    StartPostcopy { note: String },
    /// Post-copy runs (say so; a cancel is no longer possible).
    InPostcopy,
    /// Release the disks' switch now, the guest paused before the
    /// switchover, and feed back [`Input::DisksReleased`]. They switch
    /// while QEMU sends the rest of the guest; the move's Finish waits for
    /// both, so the guest runs at the destination only on switched disks.
    ReleaseDisks,
    /// Let QEMU go on from the pre-switchover pause (`migrate-continue`).
    Continue,
    /// Cancel QEMU's migration (the guest resumes here); the move fails.
    Cancel { why: String },
    /// QEMU's migration ended by itself without completing; the move fails.
    Failed { why: String },
    /// The memory is sent and the guest stopped here.
    Completed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Copying,
    Postcopy,
    ReleasingDisks,
    Continuing,
    Ended,
}

/// One move's memory copy.
#[derive(Debug, Clone)]
pub struct MemoryOrder {
    teleport: bool,
    state: State,
    ladder: Ladder,
    rounds: u64,
    remaining: u64,
    disks_lost_since: Option<Duration>,
}

impl MemoryOrder {
    /// A VM-only move's copy, or a teleport's (whose disks switch at
    /// QEMU's pre-switchover pause), under the convergence `ladder`.
    pub fn new(teleport: bool, ladder: Ladder) -> MemoryOrder {
        MemoryOrder {
            teleport,
            state: State::Copying,
            ladder,
            rounds: 0,
            remaining: 0,
            disks_lost_since: None,
        }
    }

    /// Dirty-sync rounds so far.
    pub fn rounds(&self) -> u64 {
        self.rounds
    }

    /// RAM bytes still to send at the last reading.
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Whether the disks' phases are still wanted (a teleport's, until
    /// they switch).
    pub fn watching_disks(&self) -> bool {
        self.teleport && matches!(self.state, State::Copying | State::Postcopy)
    }

    /// The pause allowed now (ms).
    pub fn downtime_ms(&self) -> u64 {
        self.ladder.downtime_ms
    }

    fn end(&mut self, s: Step) -> Step {
        self.state = State::Ended;
        s
    }

    /// Feed one input; the answer is the next thing to do.
    pub fn feed(&mut self, input: Input) -> Step {
        if self.state == State::Ended {
            return Step::Wait;
        }
        match input {
            Input::CancelAsked => match self.state {
                State::Copying => self.end(Step::Cancel {
                    why: "cancelled by the caller".into(),
                }),
                _ => Step::Wait,
            },
            Input::Disks { phases, elapsed } => self.disks(&phases, elapsed),
            Input::DisksReleased(r) => match (self.state, r) {
                (State::ReleasingDisks, Ok(())) => {
                    self.state = State::Continuing;
                    Step::Continue
                }
                (State::ReleasingDisks, Err(e)) => self.end(Step::Cancel {
                    why: format!("disk switch failed: {e}"),
                }),
                _ => Step::Wait,
            },
            Input::Status { info, elapsed } => self.status(&info, elapsed),
        }
    }

    fn disks(
        &mut self,
        phases: &[(String, MigrationPhase, Option<String>)],
        elapsed: Duration,
    ) -> Step {
        if !self.watching_disks() {
            return Step::Wait;
        }
        if let Some((v, _, e)) = phases.iter().find(|p| p.1 == MigrationPhase::Failed) {
            let why = format!(
                "disk {v} failed during the memory copy: {}",
                e.clone().unwrap_or_default()
            );
            return self.end(Step::Cancel { why });
        }
        if phases.iter().all(|p| p.1 == MigrationPhase::ReadyToSwitch) {
            self.disks_lost_since = None;
            return Step::Wait;
        }
        let since = *self.disks_lost_since.get_or_insert(elapsed);
        if elapsed.saturating_sub(since) > DISK_LOST_LIMIT {
            let list: Vec<String> = phases
                .iter()
                .map(|(v, p, _)| format!("{v} {}", p.as_str()))
                .collect();
            let why = format!(
                "the disk migration stopped holding during the memory copy ({})",
                list.join(", ")
            );
            return self.end(Step::Cancel { why });
        }
        Step::Wait
    }

    fn status(&mut self, info: &MigrationInfo, elapsed: Duration) -> Step {
        let ram = info.ram();
        self.rounds = self.rounds.max(ram.dirty_sync_count);
        self.remaining = ram.remaining;
        match info.status {
            s if s.precopy() => {
                if self.state != State::Copying {
                    return Step::Wait;
                }
                let sample = Sample {
                    remaining: ram.remaining,
                    rounds: self.rounds,
                    elapsed,
                    throttle_pct: info.cpu_throttle_percentage.unwrap_or(0),
                };
                match self.ladder.observe(&sample) {
                    None => Step::Wait,
                    Some(Rung::RaiseDowntime(ms)) => Step::SetDowntime {
                        ms,
                        note: format!(
                            "memory not converging ({} bytes left, round {}, CPU throttle {}%): pause allowed raised to {ms} ms",
                            sample.remaining, sample.rounds, sample.throttle_pct
                        ),
                    },
                    Some(Rung::Postcopy(why)) => {
                        self.state = State::Postcopy;
                        Step::StartPostcopy {
                            note: format!("switching to post-copy: {why}"),
                        }
                    }
                    Some(Rung::Abort(why)) => self.end(Step::Cancel {
                        why: format!("did not converge: {why}"),
                    }),
                }
            }
            s if s.postcopy() => {
                if self.state == State::Postcopy {
                    return Step::Wait;
                }
                self.state = State::Postcopy;
                Step::InPostcopy
            }
            Qemu::PreSwitchover => match self.state {
                State::Copying | State::Postcopy if self.teleport => {
                    self.state = State::ReleasingDisks;
                    Step::ReleaseDisks
                }
                // Not a teleport: nothing to do before the switchover.
                State::Copying | State::Postcopy => {
                    self.state = State::Continuing;
                    Step::Continue
                }
                _ => Step::Wait,
            },
            Qemu::Completed => self.end(Step::Completed),
            Qemu::Failed | Qemu::Cancelled | Qemu::Cancelling => {
                let status = info.status.as_str();
                let why = info.error_desc.as_deref().unwrap_or(status);
                self.end(Step::Failed {
                    why: format!("QEMU's migration {status}: {why}"),
                })
            }
            other => {
                tracing::debug!(status = ?other, "migration status");
                Step::Wait
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_qmp::RamStats;

    fn status(s: Qemu, remaining: u64, rounds: u64) -> Input {
        Input::Status {
            info: MigrationInfo {
                status: s,
                ram: Some(RamStats {
                    remaining,
                    dirty_sync_count: rounds,
                    ..RamStats::default()
                }),
                ..MigrationInfo::default()
            },
            elapsed: Duration::from_secs(rounds),
        }
    }

    fn order(teleport: bool, postcopy: bool) -> MemoryOrder {
        MemoryOrder::new(
            teleport,
            Ladder::new(300, postcopy, Duration::from_secs(600)),
        )
    }

    #[test]
    fn a_teleport_releases_its_disks_at_the_pause_then_continues_then_completes() {
        let mut o = order(true, false);
        assert_eq!(o.feed(status(Qemu::Setup, 0, 0)), Step::Wait);
        assert_eq!(o.feed(status(Qemu::Active, 1 << 20, 1)), Step::Wait);
        assert!(o.watching_disks());
        assert_eq!(
            o.feed(status(Qemu::PreSwitchover, 0, 2)),
            Step::ReleaseDisks
        );
        assert!(!o.watching_disks());
        // Seen again while the release runs: nothing new.
        assert_eq!(o.feed(status(Qemu::PreSwitchover, 0, 2)), Step::Wait);
        assert_eq!(o.feed(Input::CancelAsked), Step::Wait, "too late to cancel");
        assert_eq!(o.feed(Input::DisksReleased(Ok(()))), Step::Continue);
        assert_eq!(o.feed(status(Qemu::Device, 0, 2)), Step::Wait);
        assert_eq!(o.feed(status(Qemu::Completed, 0, 3)), Step::Completed);
        assert_eq!(o.rounds(), 3);
        assert_eq!(o.feed(status(Qemu::Completed, 0, 3)), Step::Wait, "ended");
    }

    #[test]
    fn a_failed_disk_release_cancels_and_a_vm_only_move_never_switches_disks() {
        let mut o = order(true, false);
        o.feed(status(Qemu::PreSwitchover, 0, 2));
        let s = o.feed(Input::DisksReleased(Err("destination gone".into())));
        assert!(
            matches!(s, Step::Cancel { ref why } if why.contains("destination gone")),
            "{s:?}"
        );
        let mut vm = order(false, false);
        assert!(!vm.watching_disks());
        let phases = vec![("root".into(), MigrationPhase::Failed, None)];
        assert_eq!(
            vm.feed(Input::Disks {
                phases,
                elapsed: Duration::ZERO
            }),
            Step::Wait
        );
        assert_eq!(vm.feed(status(Qemu::Completed, 0, 1)), Step::Completed);
    }

    #[test]
    fn disks_that_fail_or_stop_holding_during_the_copy_cancel_it() {
        let disks = |p: MigrationPhase, s: u64| Input::Disks {
            phases: vec![("root".into(), p, Some("no space".into()))],
            elapsed: Duration::from_secs(s),
        };
        let mut o = order(true, false);
        assert_eq!(o.feed(disks(MigrationPhase::ReadyToSwitch, 0)), Step::Wait);
        assert_eq!(o.feed(disks(MigrationPhase::Rounds, 1)), Step::Wait);
        assert_eq!(o.feed(disks(MigrationPhase::Rounds, 3)), Step::Wait);
        // Ready again: the clock starts over.
        assert_eq!(o.feed(disks(MigrationPhase::ReadyToSwitch, 4)), Step::Wait);
        assert_eq!(o.feed(disks(MigrationPhase::Rounds, 5)), Step::Wait);
        let s = o.feed(disks(MigrationPhase::Rounds, 9));
        assert!(
            matches!(s, Step::Cancel { ref why } if why.contains("stopped holding")),
            "{s:?}"
        );
        let mut o = order(true, false);
        let s = o.feed(disks(MigrationPhase::Failed, 0));
        assert!(
            matches!(s, Step::Cancel { ref why } if why.contains("no space")),
            "{s:?}"
        );
    }

    #[test]
    fn a_stalled_copy_raises_the_pause_then_goes_post_copy_or_gives_up() {
        for postcopy in [true, false] {
            let mut o = order(false, postcopy);
            let mut steps = Vec::new();
            for round in 1..40 {
                match o.feed(status(Qemu::Active, 1 << 30, round)) {
                    Step::Wait => {}
                    s => steps.push(s),
                }
            }
            assert!(
                matches!(steps[0], Step::SetDowntime { ms, .. } if ms > 75),
                "{steps:?}"
            );
            let last = steps.last().unwrap();
            if postcopy {
                assert!(matches!(last, Step::StartPostcopy { .. }), "{steps:?}");
                assert_eq!(o.feed(Input::CancelAsked), Step::Wait);
                assert_eq!(o.feed(status(Qemu::PostcopyActive, 0, 41)), Step::Wait);
                assert_eq!(o.feed(status(Qemu::Completed, 0, 42)), Step::Completed);
            } else {
                assert!(
                    matches!(last, Step::Cancel { why } if why.contains("did not converge")),
                    "{steps:?}"
                );
            }
        }
    }

    #[test]
    fn a_cancel_or_qemus_own_failure_ends_the_copy() {
        let mut o = order(true, false);
        assert!(matches!(o.feed(Input::CancelAsked), Step::Cancel { .. }));
        assert_eq!(o.feed(status(Qemu::Completed, 0, 1)), Step::Wait);
        let mut o = order(false, false);
        let failed = Input::Status {
            info: MigrationInfo {
                status: Qemu::Failed,
                error_desc: Some("Unable to write to socket".into()),
                ..MigrationInfo::default()
            },
            elapsed: Duration::ZERO,
        };
        let s = o.feed(failed);
        assert!(
            matches!(s, Step::Failed { ref why } if why.contains("failed: Unable to write")),
            "{s:?}"
        );
        // Post-copy seen without having asked for it (QEMU's own): said once.
        let mut o = order(false, true);
        assert_eq!(o.feed(status(Qemu::PostcopyActive, 0, 1)), Step::InPostcopy);
        assert_eq!(o.feed(status(Qemu::PostcopyActive, 0, 1)), Step::Wait);
    }
}
