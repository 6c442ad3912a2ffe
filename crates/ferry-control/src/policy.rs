//! Policies: from a [`Cluster`] snapshot to decisions, each with its
//! reason and numbers (the dry run is the same call; acting is the
//! caller's business).
//!
//! - *locality* (seeds 000/001): for every VM, compare staying with moving
//!   the VM to its disk, the disk to the VM, or both to a third site; take
//!   the best option when its gain over the horizon beats its cost by the
//!   margin.
//! - *thresholds* (seed 003; Storage DRS style): a VM is only considered
//!   once its latency has stayed above the trigger for the hold time; it
//!   is released below the trigger times the hysteresis factor.
//! - *limits*: moves in flight per link, a cooldown per VM, a minimum
//!   stay that must pay back the move's own cost, and a switch that
//!   pauses all automation.

use crate::cluster::{Cluster, ClusterError, Placement, VmState};
use crate::model::{access_cost, disk_move_cost, teleport_cost, vm_move_cost, MoveCost};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    pub locality: bool,
    /// Seconds over which gains are counted.
    pub horizon_s: f64,
    /// The gain must exceed the move's cost by this factor.
    pub margin: f64,
    /// ... and be at least this share of the horizon (small gains are not
    /// worth a move's risk).
    pub min_gain_share: f64,
    /// Only VMs whose latency stayed above this (ms) for `hold_s` count
    /// (0: every VM).
    pub latency_trigger_ms: f64,
    pub hold_s: f64,
    /// Released below trigger × hysteresis.
    pub hysteresis: f64,
    pub max_moves_per_link: usize,
    pub cooldown_s: f64,
    pub paused: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            locality: true,
            horizon_s: 600.0,
            margin: 1.5,
            min_gain_share: 0.1,
            latency_trigger_ms: 0.0,
            hold_s: 0.0,
            hysteresis: 0.8,
            max_moves_per_link: 2,
            cooldown_s: 300.0,
            paused: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy: {0}")]
pub struct PolicyError(String);

impl Policy {
    /// Refuse impossible numbers with the rule they break.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let bad = |m: &str| Err(PolicyError(m.into()));
        if !(self.horizon_s.is_finite() && self.horizon_s > 0.0) {
            return bad("horizon_s must be positive");
        }
        if !(self.margin.is_finite() && self.margin >= 1.0) {
            return bad("margin must be at least 1 (a move must at least pay for itself)");
        }
        if !(self.hysteresis > 0.0 && self.hysteresis <= 1.0) {
            return bad("hysteresis must be in (0, 1]");
        }
        if self.latency_trigger_ms < 0.0 || self.hold_s < 0.0 || self.cooldown_s < 0.0 {
            return bad("trigger, hold and cooldown must not be negative");
        }
        if !(0.0..1.0).contains(&self.min_gain_share) {
            return bad("min_gain_share must be in [0, 1)");
        }
        if self.max_moves_per_link == 0 {
            return bad("max_moves_per_link must be at least 1");
        }
        Ok(())
    }
}

/// What to do with one VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    MoveVm,
    MoveDisk,
    Teleport,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    pub vm: String,
    pub action: Action,
    pub from: Placement,
    pub to: Placement,
    /// Guest-seconds lost over the horizon where it is, and where it would be.
    pub lost_here_s: f64,
    pub lost_there_s: f64,
    pub cost: MoveCost,
    pub reason: String,
}

/// Why a VM was left alone (for the dry run's account).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Skip {
    pub vm: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Plan {
    pub decisions: Vec<Decision>,
    pub skipped: Vec<Skip>,
}

/// Per-VM memory of the threshold policy across cycles.
#[derive(Debug, Clone, Default)]
pub struct Triggers {
    above_since: BTreeMap<String, f64>,
}

impl Triggers {
    /// Whether `vm` is triggered at time `now` (seconds).
    pub fn observe(&mut self, p: &Policy, vm: &VmState, now: f64) -> bool {
        if p.latency_trigger_ms <= 0.0 {
            return true;
        }
        let l = vm.load.latency_ms;
        let held = self.above_since.get(&vm.name).copied();
        match held {
            None if l > p.latency_trigger_ms => {
                self.above_since.insert(vm.name.clone(), now);
                p.hold_s == 0.0
            }
            None => false,
            Some(_) if l < p.latency_trigger_ms * p.hysteresis => {
                self.above_since.remove(&vm.name);
                false
            }
            Some(since) => now - since >= p.hold_s,
        }
    }
}

/// Third sites considered for a teleport, nearest first.
pub const THIRD_SITES: usize = 3;

fn options(c: &Cluster, vm: &VmState) -> Vec<(Action, Placement)> {
    let p = &vm.placement;
    let mut out = Vec::new();
    if p.host_site != p.disk_site {
        out.push((
            Action::MoveVm,
            Placement {
                host_site: p.disk_site.clone(),
                disk_site: p.disk_site.clone(),
            },
        ));
        out.push((
            Action::MoveDisk,
            Placement {
                host_site: p.host_site.clone(),
                disk_site: p.host_site.clone(),
            },
        ));
    }
    // A third site: only the nearest few to where the guest runs now.
    let mut third: Vec<(f64, &str)> = c
        .sites
        .iter()
        .filter(|s| s.name != p.host_site && s.name != p.disk_site)
        .filter_map(|s| {
            c.link(&p.host_site, &s.name)
                .ok()
                .map(|l| (l.rtt_ms, s.name.as_str()))
        })
        .collect();
    third.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
    for (_, name) in third.into_iter().take(THIRD_SITES) {
        out.push((
            Action::Teleport,
            Placement {
                host_site: name.into(),
                disk_site: name.into(),
            },
        ));
    }
    out
}

fn cost_of(c: &Cluster, vm: &VmState, a: Action, to: &Placement) -> Result<MoveCost, ClusterError> {
    let p = &vm.placement;
    Ok(match a {
        Action::MoveVm => {
            let l = c.link(&p.host_site, &to.host_site)?;
            vm_move_cost(vm, l.rtt_ms, l.bandwidth)
        }
        Action::MoveDisk => {
            let l = c.link(&p.disk_site, &to.disk_site)?;
            disk_move_cost(vm, &to.disk_site, l.rtt_ms, l.bandwidth)
        }
        Action::Teleport => {
            let l = c.link(&p.host_site, &to.host_site)?;
            teleport_cost(vm, &to.disk_site, l.rtt_ms, l.bandwidth)
        }
    })
}

/// The locality policy over a snapshot at time `now`.
pub fn plan(
    c: &Cluster,
    p: &Policy,
    triggers: &mut Triggers,
    now: f64,
) -> Result<Plan, ClusterError> {
    let mut plan = Plan::default();
    if p.paused {
        plan.skipped.push(Skip {
            vm: "*".into(),
            reason: "automation is paused".into(),
        });
        return Ok(plan);
    }
    if !p.locality {
        return Ok(plan);
    }
    let mut per_link: BTreeMap<(String, String), usize> = BTreeMap::new();
    for vm in &c.vms {
        let skip = |r: String| Skip {
            vm: vm.name.clone(),
            reason: r,
        };
        if !triggers.observe(p, vm, now) {
            continue;
        }
        if vm.since_move_s < p.cooldown_s {
            plan.skipped.push(skip(format!(
                "moved {:.0} s ago (cooldown {:.0} s)",
                vm.since_move_s, p.cooldown_s
            )));
            continue;
        }
        let here = c.link(&vm.placement.host_site, &vm.placement.disk_site)?;
        let lost_here = access_cost(vm, c, here.rtt_ms, here.bandwidth, p.horizon_s)?.lost_s;
        let mut best: Option<(f64, Action, Placement, MoveCost, f64)> = None;
        for (a, to) in options(c, vm) {
            let l = c.link(&to.host_site, &to.disk_site)?;
            let lost_there = access_cost(vm, c, l.rtt_ms, l.bandwidth, p.horizon_s)?.lost_s;
            let cost = cost_of(c, vm, a, &to)?;
            if !cost.converges {
                continue;
            }
            let total = lost_there + cost.lost_s;
            if best.as_ref().is_none_or(|b| total < b.0) {
                best = Some((total, a, to, cost, lost_there));
            }
        }
        let Some((total, action, to, cost, lost_there)) = best else {
            continue;
        };
        let gain = lost_here - lost_there;
        if gain <= cost.lost_s * p.margin
            || gain < p.min_gain_share * p.horizon_s
            || total >= lost_here
        {
            if lost_here > 1.0 {
                plan.skipped.push(skip(format!(
                    "best move ({action:?}) gains {gain:.1} s over {:.0} s for a cost of {:.1} s (margin {:.1}×)",
                    p.horizon_s, cost.lost_s, p.margin
                )));
            }
            continue;
        }
        let key = {
            let (a, b) = (vm.placement.host_site.clone(), to.host_site.clone());
            if a < b {
                (a, b)
            } else {
                (b, a)
            }
        };
        let n = per_link.entry(key.clone()).or_default();
        if *n >= p.max_moves_per_link {
            plan.skipped.push(skip(format!(
                "link {}-{} already has {} moves planned",
                key.0, key.1, n
            )));
            continue;
        }
        *n += 1;
        plan.decisions.push(Decision {
            vm: vm.name.clone(),
            action,
            from: vm.placement.clone(),
            to: to.clone(),
            lost_here_s: lost_here,
            lost_there_s: lost_there,
            cost,
            reason: format!(
                "disk {:.1} ms away costs {lost_here:.1} s of {:.0} s; at {}/{} it would cost {lost_there:.1} s; the move costs {:.1} s ({:.0} MB, {:.1} s, pause {:.0} ms)",
                here.rtt_ms,
                p.horizon_s,
                to.host_site,
                to.disk_site,
                cost.lost_s,
                cost.bytes / 1e6,
                cost.seconds,
                cost.pause_s * 1000.0
            ),
        });
    }
    // Biggest gains first.
    plan.decisions.sort_by(|a, b| {
        (b.lost_here_s - b.lost_there_s)
            .partial_cmp(&(a.lost_here_s - a.lost_there_s))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Link, Site, VmLoad};

    fn cluster(rtt: f64, vms: Vec<VmState>) -> Cluster {
        Cluster {
            sites: ["a", "b"]
                .iter()
                .map(|n| Site {
                    name: (*n).into(),
                    cpu_capacity: 8.0,
                })
                .collect(),
            links: vec![Link {
                a: "a".into(),
                b: "b".into(),
                rtt_ms: rtt,
                bandwidth: 12.5e6,
            }],
            vms,
            local_rtt_ms: 0.1,
            link_index: Default::default(),
        }
    }

    fn vm(name: &str, iops: f64, rtt: f64) -> VmState {
        VmState {
            name: name.into(),
            placement: Placement {
                host_site: "a".into(),
                disk_site: "b".into(),
            },
            memory_bytes: 256e6,
            disk_bytes: 4e9,
            missing_at: Default::default(),
            load: VmLoad {
                iops,
                io_bytes: 4096.0,
                latency_ms: 0.3 + rtt,
                cpu: 1.0,
                dirty_rate: 1e6,
                write_rate: 2e5,
            },
            since_move_s: f64::INFINITY,
        }
    }

    #[test]
    fn the_io_bound_guest_moves_to_its_data_the_cpu_bound_stays() {
        let c = cluster(16.0, vec![vm("io", 55.0, 16.0), vm("cpu", 0.2, 16.0)]);
        let p = Policy::default();
        let pl = plan(&c, &p, &mut Triggers::default(), 0.0).unwrap();
        assert_eq!(pl.decisions.len(), 1, "{pl:?}");
        let d = &pl.decisions[0];
        assert_eq!(d.vm, "io");
        // Moving 256 MB of memory is cheaper than moving 4 GB of disk.
        assert_eq!(d.action, Action::MoveVm);
        assert_eq!(d.to.host_site, "b");
        assert!(d.reason.contains("16.0 ms away"), "{}", d.reason);
    }

    #[test]
    fn at_low_rtt_nothing_moves_and_limits_hold() {
        // Storage that takes 5 ms a request, half the time busy: 0.5 ms of
        // RTT costs it about 4%, below the 10% worth a move.
        let mut slow = vm("io", 100.0, 0.5);
        slow.load.latency_ms = 5.5;
        let c = cluster(0.5, vec![slow]);
        let plan_low = plan(&c, &Policy::default(), &mut Triggers::default(), 0.0).unwrap();
        assert!(plan_low.decisions.is_empty(), "{plan_low:?}");
        let many: Vec<VmState> = (0..5).map(|i| vm(&format!("v{i}"), 55.0, 16.0)).collect();
        let c = cluster(16.0, many);
        let pl = plan(&c, &Policy::default(), &mut Triggers::default(), 0.0).unwrap();
        assert_eq!(pl.decisions.len(), 2, "two per link");
        assert_eq!(pl.skipped.len(), 3);
        let mut cooled = vm("io", 55.0, 16.0);
        cooled.since_move_s = 10.0;
        let c = cluster(16.0, vec![cooled]);
        let pl = plan(&c, &Policy::default(), &mut Triggers::default(), 0.0).unwrap();
        assert!(pl.decisions.is_empty() && pl.skipped[0].reason.contains("cooldown"));
    }

    #[test]
    fn thresholds_wait_for_the_hold_and_release_with_hysteresis() {
        let p = Policy {
            latency_trigger_ms: 15.0,
            hold_s: 60.0,
            ..Policy::default()
        };
        let mut t = Triggers::default();
        let mut v = vm("io", 55.0, 16.0);
        assert!(!t.observe(&p, &v, 0.0));
        assert!(!t.observe(&p, &v, 30.0));
        assert!(t.observe(&p, &v, 61.0));
        v.load.latency_ms = 13.0; // below the trigger, above the release
        assert!(t.observe(&p, &v, 62.0));
        v.load.latency_ms = 11.0;
        assert!(!t.observe(&p, &v, 63.0));
        assert!(Policy {
            margin: 0.5,
            ..Policy::default()
        }
        .validate()
        .is_err());
        assert!(Policy {
            hysteresis: 2.0,
            ..Policy::default()
        }
        .validate()
        .is_err());
    }
}
