//! The controller's core, pure: one step takes what was measured, the
//! moves in flight and what the controller remembers (triggers, when each
//! guest last moved, the moves failing in a row), and answers the plan and
//! its effects: entries to journal, moves to start, moves to cancel. No
//! I/O and no clock: the caller gives the time.
//!
//! Its only drivers are the service, `ferry control plan --apply`, the
//! simulator and the replay, each through [`drive`] with its own
//! [`World`] (measure, start a move, cancel one, say which ended) and
//! [`JournalSink`]. Moves run on their own: a step never waits for one;
//! the world reports each end at a later step.

use crate::backoff::{Backoff, HeldMove};
use crate::cluster::{Cluster, ClusterError};
use crate::policy::{plan_around, Commitments, Decision, InFlightMove, Plan, Policy, Triggers};
use std::collections::{BTreeMap, BTreeSet};

/// The longest a move may run before the controller cancels it (seconds).
pub const MOVE_LIMIT_S: f64 = 900.0;

/// What one step asks of its driver, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Journal the decision. `acted`: a [`Effect::Start`] of it follows,
    /// which may only be carried out once this entry is durable.
    Journal { decision: Decision, acted: bool },
    /// Start the move (the driver reports its end through
    /// [`ControllerCore::ended`], or at once if it could not start).
    Start(Decision),
    /// Cancel the running move of `vm`; its end is reported as any other.
    Cancel { vm: String, why: String },
}

/// A step's answer: the whole plan (shown by the API and the page, acted
/// on or not) and what to do about it.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub plan: Plan,
    pub effects: Vec<Effect>,
}

/// How a move ended, as the world reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Ended {
    pub vm: String,
    pub completed: bool,
    pub reason: Option<String>,
    /// When it ended (seconds on the driver's clock).
    pub at_s: f64,
}

#[derive(Debug, Clone)]
struct Running {
    decision: Decision,
    started_s: f64,
    cancelling: bool,
}

impl Running {
    /// The move as the planner counts it.
    fn flight(&self) -> InFlightMove {
        let d = &self.decision;
        InFlightMove {
            vm: d.vm.clone(),
            action: d.action,
            from: d.from.clone(),
            to: d.to.clone(),
            to_host: d.to_host.clone(),
            started_s: self.started_s,
        }
    }
}

/// What the controller remembers from one step to the next.
#[derive(Debug, Default)]
pub struct ControllerCore {
    triggers: Triggers,
    /// When each guest's last move ended (seconds).
    moved_at: BTreeMap<String, f64>,
    /// Moves failing in a row, held back.
    backoff: Backoff,
    /// The decisions of the last step not acted on: the same one again is
    /// not journaled again.
    unacted: BTreeSet<String>,
    running: BTreeMap<String, Running>,
}

impl ControllerCore {
    /// One step at `now` over the snapshot `c`. The plan is made as if
    /// automation ran, so a paused controller still shows what it would
    /// do; moves start only when it runs and `may_act` (this controller
    /// leads and holds its lease).
    pub fn step(
        &mut self,
        c: &Cluster,
        p: &Policy,
        now: f64,
        may_act: bool,
    ) -> Result<Step, ClusterError> {
        let mut c = c.clone();
        for v in &mut c.vms {
            if let Some(at) = self.moved_at.get(&v.name) {
                v.since_move_s = v.since_move_s.min(now - at);
            }
        }
        let cm = Commitments {
            in_flight: self.in_flight(),
            held: self.backoff.holding(now),
        };
        let unpaused = Policy {
            paused: false,
            ..p.clone()
        };
        let plan = plan_around(&c, &unpaused, &mut self.triggers, now, &cm)?;
        let mut effects = self.cancels(p, now);
        let act = !p.paused && may_act;
        let mut unacted = BTreeSet::new();
        for d in &plan.decisions {
            let k = crate::backoff::key(d);
            let repeated = !act && self.unacted.contains(&k);
            if !act {
                unacted.insert(k);
            }
            if repeated {
                continue;
            }
            effects.push(Effect::Journal {
                decision: d.clone(),
                acted: act,
            });
            if act {
                effects.push(Effect::Start(d.clone()));
                self.adopt(d.clone(), now);
            }
        }
        self.unacted = unacted;
        Ok(Step { plan, effects })
    }

    /// Moves to cancel: those running past [`MOVE_LIMIT_S`], and those
    /// going to a site the operator has since put in maintenance. Each is
    /// asked once.
    fn cancels(&mut self, p: &Policy, now: f64) -> Vec<Effect> {
        let mut out = Vec::new();
        for r in self.running.values_mut().filter(|r| !r.cancelling) {
            let d = &r.decision;
            let why = if now - r.started_s > MOVE_LIMIT_S {
                format!("still running after {MOVE_LIMIT_S:.0} s")
            } else if let Some(s) = [&d.to.host_site, &d.to.disk_site]
                .into_iter()
                .find(|s| p.maintenance.contains(s))
            {
                format!("its destination {s} is now in maintenance")
            } else {
                continue;
            };
            let vm = d.vm.clone();
            r.cancelling = true;
            out.push(Effect::Cancel { vm, why });
        }
        out
    }

    /// A move ended (or never started: the world said so at once). A
    /// completed one starts its guest's cooldown and forgets its failures;
    /// a failed one counts toward holding it back.
    pub fn ended(&mut self, e: &Ended) {
        let Some(r) = self.running.remove(&e.vm) else {
            return;
        };
        if e.completed {
            self.moved_at.insert(e.vm.clone(), e.at_s);
        }
        self.backoff
            .ended(&r.decision, e.completed, e.reason.as_deref(), e.at_s);
    }

    /// A started move whose journal entry could not be made durable: it
    /// is not carried out, and counts as nothing.
    pub fn not_started(&mut self, vm: &str) {
        self.running.remove(vm);
    }

    /// A move in flight from `started_s`: one this core starts, or one
    /// started before this controller took over (a restart, a new leader)
    /// found in the journal, followed and counted like its own.
    pub fn adopt(&mut self, d: Decision, started_s: f64) {
        self.running.insert(
            d.vm.clone(),
            Running {
                decision: d,
                started_s,
                cancelling: false,
            },
        );
    }

    /// The moves running now.
    pub fn in_flight(&self) -> Vec<InFlightMove> {
        self.running.values().map(Running::flight).collect()
    }

    /// The moves held back at `now` after failing in a row.
    pub fn holding(&self, now: f64) -> Vec<HeldMove> {
        self.backoff.holding(now)
    }
}

/// The world a driver acts on.
pub trait World {
    /// The snapshot to plan from, at `now`.
    fn measure(&mut self, now: f64) -> Result<Cluster, String>;
    /// Begin `d` without waiting for its end; Err: it did not start.
    fn start(&mut self, d: &Decision, now: f64) -> Result<(), String>;
    /// Ask the running move of `vm` to stop.
    fn cancel(&mut self, vm: &str, why: &str);
    /// The moves that ended since last asked.
    fn ended(&mut self, now: f64) -> Vec<Ended>;
}

/// Where a driver's decisions are journaled.
pub trait JournalSink {
    /// Journal `d`; false when it could not be made durable.
    fn decided(&mut self, d: &Decision, acted: bool) -> bool;
}

/// A journal that keeps nothing (the simulator and the replay, whose
/// decisions are their result).
pub struct NoJournal;

impl JournalSink for NoJournal {
    fn decided(&mut self, _: &Decision, _: bool) -> bool {
        true
    }
}

/// One cycle through `world`: collect the moves that ended, measure, step,
/// carry out the effects in order (a move starts only after its decision
/// is durable). The plan is returned for the driver to show.
pub fn drive(
    core: &mut ControllerCore,
    world: &mut impl World,
    journal: &mut impl JournalSink,
    p: &Policy,
    now: f64,
    may_act: bool,
) -> Result<Plan, DriveError> {
    for e in world.ended(now) {
        core.ended(&e);
    }
    let c = world.measure(now).map_err(DriveError::Measure)?;
    c.validate()?;
    let step = core.step(&c, p, now, may_act)?;
    let mut durable = BTreeSet::new();
    for effect in step.effects {
        match effect {
            Effect::Journal { decision, acted } => {
                if journal.decided(&decision, acted) {
                    durable.insert(decision.vm);
                }
            }
            Effect::Start(d) => {
                if !durable.contains(&d.vm) {
                    core.not_started(&d.vm);
                } else if let Err(why) = world.start(&d, now) {
                    let e = Ended {
                        vm: d.vm.clone(),
                        completed: false,
                        reason: Some(why),
                        at_s: now,
                    };
                    core.ended(&e);
                }
            }
            Effect::Cancel { vm, why } => world.cancel(&vm, &why),
        }
    }
    Ok(step.plan)
}

/// Why a cycle could not plan.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error("cannot measure: {0}")]
    Measure(String),
    #[error("cannot plan: {0}")]
    Plan(#[from] ClusterError),
}

#[cfg(test)]
mod tests {
    //! The core fed through a harness world: moves take their predicted
    //! time, any of them can be made to fail, the hosts can stop
    //! answering, the journal can stop being durable.

    use super::*;
    use crate::fixtures::{remote_vm, two_sites};
    use crate::policy::Action;
    use crate::reason::Refusal;

    #[derive(Default)]
    struct Harness {
        c: Option<Cluster>,
        /// Running moves: guest -> (decision, ends at, cancelled).
        running: BTreeMap<String, (Decision, f64, bool)>,
        refuse_start: BTreeSet<String>,
        fail_end: BTreeSet<String>,
        unreachable: bool,
        started: Vec<String>,
        cancelled: Vec<(String, String)>,
    }

    impl World for Harness {
        fn measure(&mut self, _now: f64) -> Result<Cluster, String> {
            if self.unreachable {
                return Err("host a: connection refused".into());
            }
            Ok(self.c.clone().expect("a cluster"))
        }

        fn start(&mut self, d: &Decision, now: f64) -> Result<(), String> {
            if self.refuse_start.contains(&d.vm) {
                return Err("the destination refused the move".into());
            }
            self.started.push(d.vm.clone());
            let ends = now + d.cost.seconds;
            self.running.insert(d.vm.clone(), (d.clone(), ends, false));
            Ok(())
        }

        fn cancel(&mut self, vm: &str, why: &str) {
            self.cancelled.push((vm.into(), why.into()));
            if let Some(r) = self.running.get_mut(vm) {
                r.2 = true;
            }
        }

        fn ended(&mut self, now: f64) -> Vec<Ended> {
            let done: Vec<String> = self
                .running
                .iter()
                .filter(|(_, (_, ends, cancelled))| *ends <= now || *cancelled)
                .map(|(vm, _)| vm.clone())
                .collect();
            let mut out = Vec::new();
            for vm in done {
                let (d, _, cancelled) = self.running.remove(&vm).expect("listed");
                let completed = !cancelled && !self.fail_end.contains(&vm);
                if completed {
                    let c = self.c.as_mut().expect("a cluster");
                    let v = c.vms.iter_mut().find(|v| v.name == vm).expect("a guest");
                    v.placement = d.to.clone();
                }
                out.push(Ended {
                    vm,
                    completed,
                    reason: (!completed).then(|| "aborted".to_string()),
                    at_s: now,
                });
            }
            out
        }
    }

    /// A journal that keeps each decision, durable or not at will.
    struct Book {
        entries: Vec<(String, bool)>,
        durable: bool,
    }

    impl JournalSink for Book {
        fn decided(&mut self, d: &Decision, acted: bool) -> bool {
            if self.durable {
                self.entries.push((d.vm.clone(), acted));
            }
            self.durable
        }
    }

    fn book() -> Book {
        Book {
            entries: Vec::new(),
            durable: true,
        }
    }

    /// `n` I/O-bound guests at `a` with their disks at `b`, 16 ms away.
    fn world(n: usize) -> Harness {
        let vms = (0..n)
            .map(|i| remote_vm(&format!("v{i}"), 55.0, 16.3))
            .collect();
        Harness {
            c: Some(two_sites(16.0, 12.5e6, vms)),
            ..Harness::default()
        }
    }

    fn refusals<'a>(pl: &'a Plan, vm: &str) -> Vec<&'a Refusal> {
        pl.candidates
            .iter()
            .filter(|c| c.vm == vm)
            .filter_map(|c| c.refused.as_ref())
            .collect()
    }

    #[test]
    fn moves_run_side_by_side_within_the_link_limit_and_the_next_start_as_they_end() {
        let (mut core, mut w, mut j, p) = (
            ControllerCore::default(),
            world(5),
            book(),
            Policy::default(),
        );
        let pl = drive(&mut core, &mut w, &mut j, &p, 0.0, true).unwrap();
        assert_eq!(w.started, ["v0", "v1"], "two per link, started together");
        assert_eq!(pl.decisions.len(), 2);
        let limited = refusals(&pl, "v2");
        assert!(
            limited.iter().any(|r| matches!(
                r,
                Refusal::LinkLimit {
                    moves: 2,
                    limit: 2,
                    ..
                }
            )),
            "{limited:?}"
        );
        let seconds = pl.decisions[0].cost.seconds;
        // A cycle while they run starts nothing and shows them in flight.
        let pl = drive(&mut core, &mut w, &mut j, &p, 1.0, true).unwrap();
        assert!(pl.decisions.is_empty() && w.started.len() == 2);
        assert!(matches!(
            refusals(&pl, "v0")[..],
            [Refusal::InFlight { .. }]
        ));
        assert_eq!(core.in_flight().len(), 2);
        // Once they end, the next two start (and the moved ones cool down).
        let pl = drive(&mut core, &mut w, &mut j, &p, seconds + 1.0, true).unwrap();
        assert_eq!(w.started, ["v0", "v1", "v2", "v3"]);
        assert!(matches!(
            refusals(&pl, "v0")[..],
            [Refusal::Cooldown { .. }]
        ));
        assert_eq!(j.entries.len(), 4, "each decision journaled once, acted");
        assert!(j.entries.iter().all(|(_, acted)| *acted));
    }

    #[test]
    fn a_move_failing_twice_is_held_back_with_its_reason() {
        let (mut core, mut w, mut j, p) = (
            ControllerCore::default(),
            world(1),
            book(),
            Policy::default(),
        );
        w.refuse_start.insert("v0".into());
        drive(&mut core, &mut w, &mut j, &p, 0.0, true).unwrap();
        assert!(
            core.in_flight().is_empty(),
            "a refused start is not in flight"
        );
        drive(&mut core, &mut w, &mut j, &p, 1.0, true).unwrap();
        let pl = drive(&mut core, &mut w, &mut j, &p, 2.0, true).unwrap();
        // The VM move is held back; the next best (its disk) is weighed
        // on its own.
        assert!(
            pl.decisions.iter().all(|d| d.action != Action::MoveVm),
            "{pl:?}"
        );
        let r = refusals(&pl, "v0");
        let held = r
            .iter()
            .find(|r| matches!(r, Refusal::HeldBack { .. }))
            .unwrap_or_else(|| panic!("{r:?}"));
        assert!(held
            .to_string()
            .contains("the destination refused the move"));
        assert_eq!(core.holding(2.0).len(), 1);
        // After the hold, tried again; a success forgets it.
        w.refuse_start.clear();
        let t = 2.0 + 3600.0;
        let pl = drive(&mut core, &mut w, &mut j, &p, t, true).unwrap();
        assert_eq!(w.started, ["v0"]);
        assert_eq!(pl.decisions[0].action, Action::MoveVm);
        let ends = t + pl.decisions[0].cost.seconds;
        drive(&mut core, &mut w, &mut j, &p, ends, true).unwrap();
        assert!(core.in_flight().is_empty());
        assert!(core
            .holding(ends)
            .iter()
            .all(|h| h.action != Action::MoveVm));
    }

    #[test]
    fn a_move_that_ends_failed_frees_its_slot_and_counts_toward_the_backoff() {
        let (mut core, mut w, mut j, p) = (
            ControllerCore::default(),
            world(1),
            book(),
            Policy::default(),
        );
        w.fail_end.insert("v0".into());
        let pl = drive(&mut core, &mut w, &mut j, &p, 0.0, true).unwrap();
        let t = pl.decisions[0].cost.seconds + 1.0;
        drive(&mut core, &mut w, &mut j, &p, t, true).unwrap();
        assert_eq!(w.started, ["v0", "v0"], "retried once at once");
        let pl = drive(&mut core, &mut w, &mut j, &p, 2.0 * t, true).unwrap();
        // Held back after the second failure: the next best move instead.
        assert!(refusals(&pl, "v0")
            .iter()
            .any(|r| matches!(r, Refusal::HeldBack { failures: 2, .. })));
        assert!(pl.decisions.iter().all(|d| d.action != Action::MoveVm));
    }

    #[test]
    fn hosts_that_stop_answering_plan_nothing_and_the_moves_in_flight_stay_counted() {
        let (mut core, mut w, mut j, p) = (
            ControllerCore::default(),
            world(3),
            book(),
            Policy::default(),
        );
        drive(&mut core, &mut w, &mut j, &p, 0.0, true).unwrap();
        w.unreachable = true;
        let e = drive(&mut core, &mut w, &mut j, &p, 1.0, true).unwrap_err();
        assert!(e.to_string().contains("connection refused"), "{e}");
        assert_eq!(core.in_flight().len(), 2);
        w.unreachable = false;
        let pl = drive(&mut core, &mut w, &mut j, &p, 2.0, true).unwrap();
        assert!(pl.decisions.is_empty(), "the link is still full: {pl:?}");
        assert_eq!(w.started.len(), 2);
    }

    #[test]
    fn a_controller_that_loses_its_lease_starts_nothing_and_its_successor_adopts_the_move() {
        let (mut old, mut w, mut j, p) = (
            ControllerCore::default(),
            world(3),
            book(),
            Policy {
                max_moves_per_link: 1,
                ..Policy::default()
            },
        );
        let pl = drive(&mut old, &mut w, &mut j, &p, 0.0, true).unwrap();
        assert_eq!(w.started, ["v0"]);
        // The lease is lost mid-move: decisions are journaled as not
        // acted on, nothing starts.
        w.c.as_mut()
            .unwrap()
            .vms
            .push(remote_vm("late", 55.0, 16.3));
        let pl2 = drive(&mut old, &mut w, &mut j, &p, 1.0, false).unwrap();
        assert_eq!(w.started, ["v0"]);
        assert!(pl2.decisions.is_empty(), "the link's one slot is v0's");
        // The successor adopts the journaled move: it counts against the
        // link and is not started twice.
        let mut new = ControllerCore::default();
        new.adopt(pl.decisions[0].clone(), 2.0);
        let pl3 = drive(&mut new, &mut w, &mut j, &p, 2.0, true).unwrap();
        assert!(pl3.decisions.is_empty(), "{pl3:?}");
        assert_eq!(w.started, ["v0"]);
        assert!(matches!(
            refusals(&pl3, "v0")[..],
            [Refusal::InFlight { .. }]
        ));
        // Without a slot taken, a controller without its lease journals
        // what it would do, acted = false.
        let mut lone = ControllerCore::default();
        let mut w2 = world(1);
        let mut j2 = book();
        drive(&mut lone, &mut w2, &mut j2, &p, 0.0, false).unwrap();
        assert_eq!(j2.entries, [("v0".to_string(), false)]);
        assert!(w2.started.is_empty() && lone.in_flight().is_empty());
    }

    #[test]
    fn a_decision_the_journal_could_not_keep_is_not_carried_out() {
        let (mut core, mut w, p) = (ControllerCore::default(), world(1), Policy::default());
        let mut j = Book {
            entries: Vec::new(),
            durable: false,
        };
        drive(&mut core, &mut w, &mut j, &p, 0.0, true).unwrap();
        assert!(w.started.is_empty() && core.in_flight().is_empty());
        assert!(core.holding(0.0).is_empty(), "not a failure of the move");
        j.durable = true;
        drive(&mut core, &mut w, &mut j, &p, 1.0, true).unwrap();
        assert_eq!(w.started, ["v0"]);
    }

    #[test]
    fn moves_into_a_drained_site_and_moves_past_the_limit_are_cancelled_once() {
        let (mut core, mut w, mut j) = (ControllerCore::default(), world(2), book());
        let p = Policy::default();
        drive(&mut core, &mut w, &mut j, &p, 0.0, true).unwrap();
        assert_eq!(w.started.len(), 2);
        // Make v1's move never end by itself.
        w.running.get_mut("v1").unwrap().1 = f64::INFINITY;
        w.running.get_mut("v0").unwrap().1 = f64::INFINITY;
        let drained = Policy {
            maintenance: vec!["b".into()],
            ..Policy::default()
        };
        // Both go to b, now drained: each cancelled once.
        drive(&mut core, &mut w, &mut j, &drained, 1.0, true).unwrap();
        assert_eq!(w.cancelled.len(), 2, "{:?}", w.cancelled);
        assert!(w.cancelled[0].1.contains("b is now in maintenance"));
        drive(&mut core, &mut w, &mut j, &drained, 2.0, true).unwrap();
        assert_eq!(w.cancelled.len(), 2, "asked once");
        // A move running past the limit is cancelled.
        let (mut core, mut w) = (ControllerCore::default(), world(1));
        drive(&mut core, &mut w, &mut j, &p, 0.0, true).unwrap();
        w.running.get_mut("v0").unwrap().1 = f64::INFINITY;
        drive(&mut core, &mut w, &mut j, &p, MOVE_LIMIT_S + 1.0, true).unwrap();
        assert!(w.cancelled.len() == 1 && w.cancelled[0].1.contains("still running"));
        drive(&mut core, &mut w, &mut j, &p, MOVE_LIMIT_S + 2.0, true).unwrap();
        // Its end was reported (the slot freed): tried again.
        assert_eq!(w.started, ["v0", "v0"]);
        assert_eq!(w.cancelled.len(), 1);
    }

    #[test]
    fn a_paused_controller_shows_its_plan_journals_each_decision_once_and_starts_nothing() {
        let (mut core, mut w, mut j) = (ControllerCore::default(), world(1), book());
        let p = Policy {
            paused: true,
            ..Policy::default()
        };
        for t in 0..3 {
            let pl = drive(&mut core, &mut w, &mut j, &p, f64::from(t), true).unwrap();
            assert_eq!(pl.decisions.len(), 1, "the plan is shown");
        }
        assert_eq!(j.entries, [("v0".to_string(), false)]);
        assert!(w.started.is_empty());
        let p = Policy { paused: false, ..p };
        drive(&mut core, &mut w, &mut j, &p, 3.0, true).unwrap();
        assert_eq!(w.started, ["v0"]);
    }
}
