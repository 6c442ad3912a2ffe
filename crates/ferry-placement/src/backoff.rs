//! Moves that keep failing are held back, so the controller never loops
//! on one: a move (the guest, the action and where to) that has failed
//! twice in a row waits before it is tried again, a minute after the
//! second failure, doubling with each further one up to an hour; a success
//! forgets it. Pure: the caller gives the time.

use crate::cluster::Placement;
use crate::policy::{Action, Decision};
use serde::Serialize;
use std::collections::BTreeMap;

/// The first hold (seconds), after the second failure in a row.
pub const FIRST_HOLD_S: f64 = 60.0;
/// The longest hold (seconds).
pub const MAX_HOLD_S: f64 = 3600.0;

#[derive(Debug, Clone)]
struct Failing {
    vm: String,
    action: Action,
    to: String,
    failures: u32,
    reason: String,
    /// Seconds on the caller's clock.
    until: f64,
}

/// A move held back, as the API, the page and `ferry control status` show
/// it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeldMove {
    pub vm: String,
    pub action: Action,
    /// `host site/disk site` it would go to.
    pub to: String,
    /// Failures in a row.
    pub failures: u32,
    /// The last failure's reason.
    pub reason: String,
    /// Seconds until it may be tried again.
    pub retry_in_s: f64,
}

impl HeldMove {
    /// Whether this is the hold on `vm`'s `action` to `to`.
    pub fn is_for(&self, vm: &str, action: Action, to: &Placement) -> bool {
        self.vm == vm && self.action == action && self.to == destination(to)
    }
}

/// The moves failing now.
#[derive(Debug, Default)]
pub struct Backoff {
    failing: BTreeMap<String, Failing>,
}

/// Where a move goes, as a held move names it: `host site/disk site`.
pub fn destination(to: &Placement) -> String {
    format!("{}/{}", to.host_site, to.disk_site)
}

/// A move's identity: the guest, the action and where to.
pub(crate) fn key(d: &Decision) -> String {
    format!("{}\u{0}{:?}\u{0}{}", d.vm, d.action, destination(&d.to))
}

/// How long a move that failed `failures` times in a row is held.
pub fn hold_for(failures: u32) -> f64 {
    if failures < 2 {
        return 0.0;
    }
    let doublings = (failures - 2).min(16);
    (FIRST_HOLD_S * f64::from(1u32 << doublings)).min(MAX_HOLD_S)
}

impl Backoff {
    /// Record how `d` ended at `now`.
    pub fn ended(&mut self, d: &Decision, completed: bool, reason: Option<&str>, now: f64) {
        let k = key(d);
        if completed {
            self.failing.remove(&k);
            return;
        }
        let e = self.failing.entry(k).or_insert_with(|| Failing {
            vm: d.vm.clone(),
            action: d.action,
            to: destination(&d.to),
            failures: 0,
            reason: String::new(),
            until: now,
        });
        e.failures += 1;
        e.reason = reason.unwrap_or("no reason given").to_string();
        e.until = now + hold_for(e.failures);
    }

    /// Every move held back at `now`.
    pub fn holding(&self, now: f64) -> Vec<HeldMove> {
        self.failing
            .values()
            .filter(|e| e.until > now)
            .map(|e| view(e, now))
            .collect()
    }
}

fn view(e: &Failing, now: f64) -> HeldMove {
    HeldMove {
        vm: e.vm.clone(),
        action: e.action,
        to: e.to.clone(),
        failures: e.failures,
        reason: e.reason.clone(),
        retry_in_s: (e.until - now).max(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hold on `d` at `now`, found as the planner finds it.
    fn held(b: &Backoff, d: &Decision, now: f64) -> Option<HeldMove> {
        b.holding(now)
            .into_iter()
            .find(|h| h.is_for(&d.vm, d.action, &d.to))
    }

    fn decision(vm: &str, to: &str) -> Decision {
        Decision {
            vm: vm.into(),
            action: Action::Teleport,
            from: Placement {
                host_site: "a".into(),
                disk_site: "a".into(),
            },
            to: Placement {
                host_site: to.into(),
                disk_site: to.into(),
            },
            to_host: None,
            lost_here_s: 0.0,
            lost_there_s: 0.0,
            cost: crate::model::MoveCost {
                seconds: 1.0,
                bytes: 1.0,
                pause_s: 0.1,
                lost_s: 0.1,
                converges: true,
            },
            reason: String::new(),
            forced: false,
            burst_from: None,
        }
    }

    #[test]
    fn a_move_failing_twice_is_held_doubling_and_a_success_forgets_it() {
        let (mut b, t0) = (Backoff::default(), 1000.0);
        let d = decision("web", "b");
        b.ended(&d, false, Some("refused by the destination"), t0);
        assert!(held(&b, &d, t0).is_none(), "one failure is retried");
        b.ended(&d, false, Some("refused by the destination"), t0);
        let h = held(&b, &d, t0).expect("held after two");
        assert_eq!((h.failures, h.retry_in_s), (2, 60.0));
        assert_eq!(h.reason, "refused by the destination");
        assert!(
            held(&b, &d, t0 + 61.0).is_none(),
            "tried again after the hold"
        );
        b.ended(&d, false, None, t0 + 61.0);
        assert_eq!(held(&b, &d, t0 + 61.0).unwrap().retry_in_s, 120.0);
        // Another guest, or the same one elsewhere, is not held.
        assert!(held(&b, &decision("db", "b"), t0).is_none());
        assert!(held(&b, &decision("web", "c"), t0).is_none());
        assert_eq!(b.holding(t0).len(), 1);
        b.ended(&d, true, None, t0);
        assert!(held(&b, &d, t0).is_none() && b.holding(t0).is_empty());
    }

    #[test]
    fn holds_double_up_to_an_hour() {
        assert_eq!(hold_for(1), 0.0);
        assert_eq!(hold_for(2), 60.0);
        assert_eq!(hold_for(4), 240.0);
        assert_eq!(hold_for(9), MAX_HOLD_S);
        assert_eq!(hold_for(u32::MAX), MAX_HOLD_S);
    }
}
