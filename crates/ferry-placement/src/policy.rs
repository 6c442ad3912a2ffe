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

use crate::backoff::HeldMove;
use crate::cluster::{Cluster, ClusterError, Placement, Site, VmState};
use crate::model::{
    disk_only_move_cost, placement_loss, teleport_cost, vm_move_cost, MoveCost, PlacementLoss,
};
use crate::reason::{Candidate, Refusal};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

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
    /// Moves a site may take part in at once (leaving or arriving),
    /// counting those in flight.
    #[serde(default = "default_max_moves_per_site")]
    pub max_moves_per_site: usize,
    /// Moves a host may take part in at once (a guest leaving it or
    /// arriving), counting those in flight: vMotion's per-host limit.
    #[serde(default = "default_max_moves_per_host")]
    pub max_moves_per_host: usize,
    pub cooldown_s: f64,
    pub paused: bool,
    /// Sites being drained: every guest running there (or whose disk is
    /// there) is moved off, whatever it costs, and nothing moves in.
    #[serde(default)]
    pub maintenance: Vec<String>,
    /// Cloud bursting: a site whose guests use more CPU than
    /// `burst_above` of its capacity sends guests (those that lose least
    /// with their disk left behind: CPU-bound ones) to the linked site
    /// with the most room, VM only; their disks stay home.
    #[serde(default)]
    pub burst: bool,
    #[serde(default = "default_burst_above")]
    pub burst_above: f64,
    /// ... once it has stayed above for this long (seconds): a guest's
    /// boot or a short spike is not a demand worth a move.
    #[serde(default = "default_burst_hold_s")]
    pub burst_hold_s: f64,
}

fn default_burst_above() -> f64 {
    0.9
}

fn default_burst_hold_s() -> f64 {
    30.0
}

fn default_max_moves_per_site() -> usize {
    8
}

fn default_max_moves_per_host() -> usize {
    4
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
            max_moves_per_site: default_max_moves_per_site(),
            max_moves_per_host: default_max_moves_per_host(),
            cooldown_s: 300.0,
            paused: false,
            maintenance: Vec::new(),
            burst: false,
            burst_above: default_burst_above(),
            burst_hold_s: default_burst_hold_s(),
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
        if self.max_moves_per_link == 0
            || self.max_moves_per_site == 0
            || self.max_moves_per_host == 0
        {
            return bad(
                "max_moves_per_link, max_moves_per_site and max_moves_per_host must be at least 1",
            );
        }
        if !(self.burst_above > 0.0 && self.burst_above <= 1.0) {
            return bad("burst_above must be in (0, 1]");
        }
        if !(self.burst_hold_s.is_finite() && self.burst_hold_s >= 0.0) {
            return bad("burst_hold_s must not be negative");
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

impl std::fmt::Display for Action {
    /// The short name in reasons and listings.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Action::MoveVm => "VM move",
            Action::MoveDisk => "disk move",
            Action::Teleport => "teleport",
        })
    }
}

impl Action {
    /// What an operator calls it.
    pub fn describe(self) -> &'static str {
        match self {
            Action::MoveVm => "move the VM (memory only; the disk stays)",
            Action::MoveDisk => "move the disk (the VM stays)",
            Action::Teleport => "teleport (VM and disk together)",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    pub vm: String,
    pub action: Action,
    pub from: Placement,
    pub to: Placement,
    /// The host of the destination site it goes to (the one with most
    /// room), when the snapshot names the site's hosts and the VM moves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_host: Option<String>,
    /// Guest-seconds lost over the horizon where it is, and where it would be.
    pub lost_here_s: f64,
    pub lost_there_s: f64,
    pub cost: MoveCost,
    pub reason: String,
    /// Made for a site (maintenance, bursting), not for the guest's speed.
    pub forced: bool,
    /// A burst: the site the guest leaves because it is full, where it
    /// returns when that site has room again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_from: Option<String>,
}

/// Why a VM was left alone (for the dry run's account): the refusal of
/// the move it would have made, or of every move.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Skip {
    pub vm: String,
    /// The refusal as one line (`refusal` typed).
    pub reason: String,
    pub refusal: Refusal,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Plan {
    pub decisions: Vec<Decision>,
    pub skipped: Vec<Skip>,
    /// Every move weighed, chosen or refused, with its filter's reason.
    pub candidates: Vec<Candidate>,
}

/// A move started and not yet ended, as the planner must count it: its
/// guest is not planned again, and it holds its place against the limits
/// per link and per site.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InFlightMove {
    pub vm: String,
    pub action: Action,
    pub from: Placement,
    pub to: Placement,
    /// The host it goes to, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_host: Option<String>,
    /// When it started (seconds on the planner's clock).
    pub started_s: f64,
}

/// What the planner must respect besides the snapshot: moves in flight
/// and moves held back after failing.
#[derive(Debug, Clone, Default)]
pub struct Commitments {
    pub in_flight: Vec<InFlightMove>,
    pub held: Vec<HeldMove>,
}

/// Memory of the threshold policies across cycles: since when each VM's
/// latency, and each site's CPU, has stayed above its trigger.
#[derive(Debug, Clone, Default)]
pub struct Triggers {
    above_since: BTreeMap<String, f64>,
    site_above_since: BTreeMap<String, f64>,
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

    /// How long (seconds) `site`, using `used` CPUs at `now`, has stayed
    /// above `limit`; `None` when it is not above. Released as soon as
    /// it is back under: a burst must be earned again.
    pub fn site_above(&mut self, site: &str, used: f64, limit: f64, now: f64) -> Option<f64> {
        if used <= limit {
            self.site_above_since.remove(site);
            return None;
        }
        let since = *self.site_above_since.entry(site.to_string()).or_insert(now);
        Some(now - since)
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
    }
    // A guest that burst away keeps its disk at home: only its own return
    // (`return_home`) or a move of the VM to its disk.
    if vm.home_site.as_ref().is_some_and(|h| *h != p.host_site) {
        return out;
    }
    if p.host_site != p.disk_site {
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

/// What moving `vm` to `to` by `a` costs: memory over the link between
/// the host sites, the disk over the one between the disk sites.
pub(crate) fn cost_of(
    c: &Cluster,
    vm: &VmState,
    a: Action,
    to: &Placement,
) -> Result<MoveCost, ClusterError> {
    let p = &vm.placement;
    Ok(match a {
        Action::MoveVm => {
            let l = c.link(&p.host_site, &to.host_site)?;
            vm_move_cost(vm, l.rtt_ms, l.bandwidth)
        }
        Action::MoveDisk => {
            let l = c.link(&p.disk_site, &to.disk_site)?;
            disk_only_move_cost(vm, &to.disk_site, l.rtt_ms, l.bandwidth)
        }
        Action::Teleport => {
            let m = c.link(&p.host_site, &to.host_site)?;
            let d = c.link(&p.disk_site, &to.disk_site)?;
            teleport_cost(vm, &to.disk_site, &d, &m)
        }
    })
}

/// The policies over a snapshot at time `now`, nothing in flight.
pub fn plan(
    c: &Cluster,
    p: &Policy,
    triggers: &mut Triggers,
    now: f64,
) -> Result<Plan, ClusterError> {
    plan_around(c, p, triggers, now, &Commitments::default())
}

/// The policies over a snapshot at time `now`, around the moves in flight
/// and those held back (`cm`): the forced passes first (maintenance,
/// bursting, coming home), then locality. Every move weighed is kept in
/// the plan's `candidates` with the filter that refused it, if one did.
pub fn plan_around(
    c: &Cluster,
    p: &Policy,
    triggers: &mut Triggers,
    now: f64,
    cm: &Commitments,
) -> Result<Plan, ClusterError> {
    let mut st = Planning::new(c, p, cm);
    if p.paused {
        st.refuse("*", None, None, Refusal::Paused);
        return Ok(st.plan);
    }
    for m in &p.maintenance {
        if c.sites.iter().all(|s| &s.name != m) {
            st.refuse("*", None, None, Refusal::NotASite { site: m.clone() });
        }
    }
    drain(c, p, &mut st)?;
    if p.burst {
        burst(c, p, &mut st, triggers, now)?;
    }
    return_home(c, p, &mut st)?;
    if p.locality {
        locality(c, p, &mut st, triggers, now)?;
    }
    let mut plan = st.plan;
    // Forced moves (maintenance, bursting) first, then biggest gains.
    plan.decisions.sort_by(|a, b| {
        b.forced.cmp(&a.forced).then(
            (b.lost_here_s - b.lost_there_s)
                .partial_cmp(&(a.lost_here_s - a.lost_there_s))
                .unwrap_or(std::cmp::Ordering::Equal),
        )
    });
    Ok(plan)
}

/// One move of one guest as the locality pass weighs it.
#[derive(Debug, Clone)]
struct Weighed {
    action: Action,
    to: Placement,
    cost: MoveCost,
    /// Guest-seconds lost over the horizon once there.
    lost_there: f64,
}

impl Weighed {
    /// The locality score: what staying there and getting there lose
    /// (lower is better).
    fn score(&self) -> f64 {
        self.lost_there + self.cost.lost_s
    }
}

/// What a filter sees of one candidate move.
#[derive(Clone, Copy)]
struct Check<'a> {
    p: &'a Policy,
    sites: &'a SiteLoad,
    held: &'a [HeldMove],
    vm: &'a VmState,
    action: Action,
    to: &'a Placement,
    cost: &'a MoveCost,
}

/// A filter: a candidate passes, or is refused with its reason.
type Filter = fn(&Check) -> Result<(), Refusal>;

/// The filters every locality candidate goes through, in order.
const FILTERS: [Filter; 4] = [drain_filter, room_filter, converges_filter, backoff_filter];

/// Nothing moves into a site in maintenance.
fn drain_filter(k: &Check) -> Result<(), Refusal> {
    for site in [&k.to.host_site, &k.to.disk_site] {
        if k.sites.draining(site) {
            return Err(Refusal::Draining { site: site.clone() });
        }
    }
    Ok(())
}

/// A guest that changes site must fit in what its new site may still run.
fn room_filter(k: &Check) -> Result<(), Refusal> {
    let site = &k.to.host_site;
    let (cpu, memory) = (k.vm.load.cpu, k.vm.memory_bytes);
    if *site == k.vm.placement.host_site || k.sites.fits(site, cpu, memory, k.p) {
        return Ok(());
    }
    if !k.sites.draining(site) && k.sites.used(site) + cpu <= k.sites.limit(site, k.p) {
        // The site has the CPUs, but no one host has the room.
        k.sites.host_for(site, cpu, memory, k.p)?;
    }
    Err(Refusal::NoRoom {
        site: site.clone(),
        used_cpu: k.sites.used(site),
        limit_cpu: k.sites.limit(site, k.p),
        cpu: k.vm.load.cpu,
    })
}

/// A move whose guest dirties faster than the link carries never ends.
fn converges_filter(k: &Check) -> Result<(), Refusal> {
    if k.cost.converges {
        Ok(())
    } else {
        Err(Refusal::NotConverging)
    }
}

/// A move that failed in a row lately waits out its hold.
fn backoff_filter(k: &Check) -> Result<(), Refusal> {
    held_back(k.held, &k.vm.name, k.action, k.to)
}

fn held_back(held: &[HeldMove], vm: &str, action: Action, to: &Placement) -> Result<(), Refusal> {
    match held.iter().find(|h| h.is_for(vm, action, to)) {
        Some(h) => Err(Refusal::HeldBack {
            failures: h.failures,
            retry_in_s: h.retry_in_s,
            reason: h.reason.clone(),
        }),
        None => Ok(()),
    }
}

/// A guest moved less than the cooldown ago stays.
fn cooldown_filter(p: &Policy, vm: &VmState) -> Result<(), Refusal> {
    if vm.since_move_s < p.cooldown_s {
        return Err(Refusal::Cooldown {
            left_s: p.cooldown_s - vm.since_move_s,
            cooldown_s: p.cooldown_s,
        });
    }
    Ok(())
}

/// The best move must gain more than its cost by the margin, and a
/// share of the horizon worth its risk.
fn margin_filter(p: &Policy, lost_here: f64, best: &Weighed) -> Result<(), Refusal> {
    let gain = lost_here - best.lost_there;
    if gain <= best.cost.lost_s * p.margin
        || gain < p.min_gain_share * p.horizon_s
        || best.score() >= lost_here
    {
        return Err(Refusal::GainTooSmall {
            gain_s: gain,
            cost_s: best.cost.lost_s,
            horizon_s: p.horizon_s,
            margin: p.margin,
        });
    }
    Ok(())
}

/// Locality (seeds 000/001): every guest not already moved by a forced
/// pass, once triggered and out of its cooldown, takes the move (VM to its
/// disk, disk to the VM, both to a third site) that loses least, when it
/// pays by the margin and the limits let it.
fn locality(
    c: &Cluster,
    p: &Policy,
    st: &mut Planning,
    triggers: &mut Triggers,
    now: f64,
) -> Result<(), ClusterError> {
    for vm in &c.vms {
        if st.moved.contains(&vm.name) || !triggers.observe(p, vm, now) {
            continue;
        }
        if let Err(r) = cooldown_filter(p, vm) {
            st.refuse(&vm.name, None, None, r);
            continue;
        }
        let here = c.link(&vm.placement.host_site, &vm.placement.disk_site)?;
        let loss_here = placement_loss(vm, c, &vm.placement, p.horizon_s)?;
        let lost_here = loss_here.total();
        let mut passed: Vec<Weighed> = Vec::new();
        for (action, to) in options(c, vm) {
            let w = Weighed {
                action,
                cost: cost_of(c, vm, action, &to)?,
                lost_there: placement_loss(vm, c, &to, p.horizon_s)?.total(),
                to,
            };
            let k = Check {
                p,
                sites: &st.sites,
                held: st.held,
                vm,
                action,
                to: &w.to,
                cost: &w.cost,
            };
            match FILTERS.iter().try_for_each(|f| f(&k)) {
                Ok(()) => passed.push(w),
                Err(r) => st.weighed(&vm.name, action, &w.to, r),
            }
        }
        passed.sort_by(|a, b| a.score().total_cmp(&b.score()));
        let Some(best) = passed.first().cloned() else {
            continue;
        };
        for w in &passed[1..] {
            let r = Refusal::Outscored {
                by: best.action,
                to: best.to.clone(),
                lost_s: w.score(),
                best_lost_s: best.score(),
            };
            st.weighed(&vm.name, w.action, &w.to, r);
        }
        if let Err(r) = margin_filter(p, lost_here, &best) {
            if lost_here > 1.0 {
                st.refuse(&vm.name, Some(best.action), Some(&best.to), r);
            } else {
                st.weighed(&vm.name, best.action, &best.to, r);
            }
            continue;
        }
        let to_host = match st.take_slot(vm, &best.to) {
            Ok(h) => h,
            Err(r) => {
                st.refuse(&vm.name, Some(best.action), Some(&best.to), r);
                continue;
            }
        };
        let (action, to, cost) = (best.action, best.to, best.cost);
        let reason = format!(
            "{} costs {lost_here:.1} s of {:.0} s; with {to} it would cost {:.1} s; the {action} costs {:.1} s ({:.0} MB, {:.1} s, pause {:.0} ms)",
            what_it_loses(&loss_here, here.rtt_ms),
            p.horizon_s,
            best.lost_there,
            cost.lost_s,
            cost.bytes / 1e6,
            cost.seconds,
            cost.pause_s * 1000.0
        );
        st.choose(
            Decision {
                to_host,
                vm: vm.name.clone(),
                action,
                from: vm.placement.clone(),
                to,
                lost_here_s: lost_here,
                lost_there_s: best.lost_there,
                cost,
                reason,
                forced: false,
                burst_from: None,
            },
            vm,
        );
    }
    Ok(())
}

/// What a guest loses where it is, in words: its disk's distance, and
/// its clients' when they wait on it.
fn what_it_loses(loss: &PlacementLoss, disk_rtt_ms: f64) -> String {
    if loss.clients_s > 0.0 {
        format!(
            "disk {disk_rtt_ms:.1} ms away ({:.1} s) and clients at another site ({:.1} s)",
            loss.disk_s, loss.clients_s
        )
    } else {
        format!("disk {disk_rtt_ms:.1} ms away")
    }
}

/// The link a move is counted against: between the guest's host sites,
/// or its disk's when the guest stays (sites in name order).
fn link_of(from: &Placement, to: &Placement) -> (String, String) {
    let (a, b) = if from.host_site == to.host_site {
        (&from.disk_site, &to.disk_site)
    } else {
        (&from.host_site, &to.host_site)
    };
    if a < b {
        (a.clone(), b.clone())
    } else {
        (b.clone(), a.clone())
    }
}

/// The sites a move takes part in: those something leaves or reaches.
fn sites_of(from: &Placement, to: &Placement) -> BTreeSet<String> {
    let mut s = BTreeSet::new();
    if from.host_site != to.host_site {
        s.insert(from.host_site.clone());
        s.insert(to.host_site.clone());
    }
    if from.disk_site != to.disk_site {
        s.insert(from.disk_site.clone());
        s.insert(to.disk_site.clone());
    }
    s
}

/// What the passes of one plan share: the sites' load as moves are
/// planned, the moves counted per link and per site (those in flight
/// first), the guests a pass already moved or that are moving (later
/// passes leave them alone), the moves held back, and the plan so far.
struct Planning<'a> {
    sites: SiteLoad,
    per_link: BTreeMap<(String, String), usize>,
    per_site: BTreeMap<String, usize>,
    per_host: BTreeMap<String, usize>,
    moved: BTreeSet<String>,
    held: &'a [HeldMove],
    p: &'a Policy,
    plan: Plan,
}

impl<'a> Planning<'a> {
    fn new(c: &Cluster, p: &'a Policy, cm: &'a Commitments) -> Planning<'a> {
        let mut st = Planning {
            sites: SiteLoad::new(c, p),
            per_link: BTreeMap::new(),
            per_site: BTreeMap::new(),
            per_host: BTreeMap::new(),
            moved: BTreeSet::new(),
            held: &cm.held,
            p,
            plan: Plan::default(),
        };
        for m in &cm.in_flight {
            let source = c
                .vms
                .iter()
                .find(|v| v.name == m.vm)
                .and_then(|v| v.host.clone());
            let hosts = if m.from.host_site == m.to.host_site {
                vec![]
            } else {
                source.into_iter().chain(m.to_host.clone()).collect()
            };
            st.count(&m.from, &m.to, &hosts);
            if let Some(v) = c.vms.iter().find(|v| v.name == m.vm) {
                // Counted where it goes while the snapshot still has it
                // where it was.
                if v.placement.host_site == m.from.host_site {
                    st.sites
                        .shift(&m.from.host_site, &m.to.host_site, v.load.cpu);
                    let (cpu, memory) = (v.load.cpu, v.memory_bytes);
                    st.sites
                        .shift_host(v.host.as_deref(), m.to_host.as_deref(), cpu, memory);
                }
            }
            st.moved.insert(m.vm.clone());
            let r = Refusal::InFlight {
                action: m.action,
                to: m.to.clone(),
            };
            st.plan
                .candidates
                .push(Candidate::new(&m.vm, None, None, Some(r)));
        }
        st
    }

    fn count(&mut self, from: &Placement, to: &Placement, hosts: &[String]) {
        *self.per_link.entry(link_of(from, to)).or_default() += 1;
        for s in sites_of(from, to) {
            *self.per_site.entry(s).or_default() += 1;
        }
        for h in hosts {
            *self.per_host.entry(h.clone()).or_default() += 1;
        }
    }

    /// The host `vm` is given at `to`, when it changes site (a disk move
    /// involves storage daemons, not hosts).
    fn host_there(&self, vm: &VmState, to: &Placement) -> Option<String> {
        if vm.placement.host_site == to.host_site {
            return None;
        }
        self.sites
            .host_for(&to.host_site, vm.load.cpu, vm.memory_bytes, self.p)
            .ok()
            .flatten()
    }

    /// Count a move against the limits per link, per site and per host
    /// (the host it leaves and the one it is given), or say which one it
    /// would break. The host it is given, for its decision.
    fn take_slot(&mut self, vm: &VmState, to: &Placement) -> Result<Option<String>, Refusal> {
        let p = self.p;
        let from = &vm.placement;
        let there = self.host_there(vm, to);
        let hosts: Vec<String> = if from.host_site == to.host_site {
            Vec::new()
        } else {
            vm.host.iter().chain(&there).cloned().collect()
        };
        let (a, b) = link_of(from, to);
        let moves = self
            .per_link
            .get(&(a.clone(), b.clone()))
            .copied()
            .unwrap_or(0);
        if moves >= p.max_moves_per_link {
            return Err(Refusal::LinkLimit {
                a,
                b,
                moves,
                limit: p.max_moves_per_link,
            });
        }
        for site in sites_of(from, to) {
            let moves = self.per_site.get(&site).copied().unwrap_or(0);
            if moves >= p.max_moves_per_site {
                return Err(Refusal::SiteLimit {
                    site,
                    moves,
                    limit: p.max_moves_per_site,
                });
            }
        }
        for host in &hosts {
            let moves = self.per_host.get(host).copied().unwrap_or(0);
            if moves >= p.max_moves_per_host {
                return Err(Refusal::HostLimit {
                    host: host.clone(),
                    moves,
                    limit: p.max_moves_per_host,
                });
            }
        }
        self.count(from, to, &hosts);
        Ok(there)
    }

    /// A guest left where it is: said in the account and kept among the
    /// candidates.
    fn refuse(&mut self, vm: &str, action: Option<Action>, to: Option<&Placement>, r: Refusal) {
        let cand = Candidate::new(vm, action, to, Some(r.clone()));
        let reason = cand
            .line
            .strip_prefix(&format!("{vm}: "))
            .unwrap_or(&cand.line)
            .to_string();
        self.plan.skipped.push(Skip {
            vm: vm.into(),
            reason,
            refusal: r,
        });
        self.plan.candidates.push(cand);
    }

    /// One of a guest's moves refused while another may still be taken.
    fn weighed(&mut self, vm: &str, action: Action, to: &Placement, r: Refusal) {
        self.plan
            .candidates
            .push(Candidate::new(vm, Some(action), Some(to), Some(r)));
    }

    /// A move taken (its slot taken, its host there chosen by
    /// [`Self::take_slot`]): later passes leave its guest alone and see the
    /// CPU and memory where it goes.
    fn choose(&mut self, d: Decision, vm: &VmState) {
        let (cpu, memory) = (vm.load.cpu, vm.memory_bytes);
        if d.from.host_site != d.to.host_site {
            self.sites
                .shift_host(vm.host.as_deref(), d.to_host.as_deref(), cpu, memory);
        }
        self.sites.shift(&d.from.host_site, &d.to.host_site, cpu);
        self.moved.insert(d.vm.clone());
        self.plan
            .candidates
            .push(Candidate::new(&d.vm, Some(d.action), Some(&d.to), None));
        self.plan.decisions.push(d);
    }
}

/// The share of its CPUs a site (or host) may be filled to by moves: below
/// the burst threshold when bursting, so a guest sent away is not brought
/// back to a site that would burst again.
fn fill_share(p: &Policy) -> f64 {
    if p.burst {
        p.burst_above
    } else {
        1.0
    }
}

/// The CPU the guests use at each site, kept up to date as moves are
/// planned, against what each site can run.
struct SiteLoad {
    used: BTreeMap<String, f64>,
    capacity: BTreeMap<String, f64>,
    maintenance: BTreeSet<String>,
    /// The sites' hosts, where the snapshot names them.
    hosts: BTreeMap<String, HostLoad>,
}

/// What one host runs, against what it can.
#[derive(Debug, Clone)]
struct HostLoad {
    site: String,
    cpu_capacity: f64,
    memory_bytes: Option<f64>,
    cpu_used: f64,
    memory_used: f64,
}

impl SiteLoad {
    fn new(c: &Cluster, p: &Policy) -> SiteLoad {
        let mut used: BTreeMap<String, f64> = BTreeMap::new();
        for v in &c.vms {
            *used.entry(v.placement.host_site.clone()).or_default() += v.load.cpu;
        }
        let mut hosts: BTreeMap<String, HostLoad> = c
            .hosts
            .iter()
            .map(|h| {
                let load = HostLoad {
                    site: h.site.clone(),
                    cpu_capacity: h.cpu_capacity,
                    memory_bytes: h.memory_bytes,
                    cpu_used: 0.0,
                    memory_used: 0.0,
                };
                (h.name.clone(), load)
            })
            .collect();
        for v in &c.vms {
            if let Some(h) = v.host.as_ref().and_then(|h| hosts.get_mut(h)) {
                h.cpu_used += v.load.cpu;
                h.memory_used += v.memory_bytes;
            }
        }
        SiteLoad {
            used,
            capacity: c
                .sites
                .iter()
                .map(|s| (s.name.clone(), s.cpu_capacity))
                .collect(),
            maintenance: p.maintenance.iter().cloned().collect(),
            hosts,
        }
    }

    /// The host of `site` a guest needing `cpu` and `memory` goes to:
    /// among those it fits on (CPU up to the site's fill limit, memory),
    /// the one with the most CPU left, so guests spread. `Ok(None)`: the
    /// site names no hosts (one pool); `Err`: it names some and none fits.
    fn host_for(
        &self,
        site: &str,
        cpu: f64,
        memory: f64,
        p: &Policy,
    ) -> Result<Option<String>, Refusal> {
        let mut listed = false;
        let mut best: Option<(f64, &String)> = None;
        for (name, h) in self.hosts.iter().filter(|(_, h)| h.site == site) {
            listed = true;
            let room = h.cpu_capacity * fill_share(p) - h.cpu_used;
            let memory_fits = h.memory_bytes.is_none_or(|m| h.memory_used + memory <= m);
            if cpu <= room && memory_fits && best.is_none_or(|(r, _)| room > r) {
                best = Some((room, name));
            }
        }
        match best {
            Some((_, name)) => Ok(Some(name.clone())),
            None if !listed => Ok(None),
            None => Err(Refusal::NoHost {
                site: site.into(),
                cpu,
                memory_bytes: memory,
            }),
        }
    }

    /// A guest's CPU and memory counted on its new host.
    fn shift_host(&mut self, from: Option<&str>, to: Option<&str>, cpu: f64, memory: f64) {
        if from == to {
            return;
        }
        if let Some(h) = from.and_then(|h| self.hosts.get_mut(h)) {
            h.cpu_used -= cpu;
            h.memory_used -= memory;
        }
        if let Some(h) = to.and_then(|h| self.hosts.get_mut(h)) {
            h.cpu_used += cpu;
            h.memory_used += memory;
        }
    }

    fn draining(&self, site: &str) -> bool {
        self.maintenance.contains(site)
    }

    fn used(&self, site: &str) -> f64 {
        self.used.get(site).copied().unwrap_or(0.0)
    }

    fn capacity(&self, site: &str) -> f64 {
        self.capacity.get(site).copied().unwrap_or(0.0)
    }

    /// The CPUs a site may be filled to by moves ([`fill_share`] of its
    /// capacity).
    fn limit(&self, site: &str, p: &Policy) -> f64 {
        self.capacity(site) * fill_share(p)
    }

    /// Whether a guest needing `cpu` and `memory` fits at `site`: in the
    /// site's CPUs, and on one of its hosts when it names them.
    fn fits(&self, site: &str, cpu: f64, memory: f64, p: &Policy) -> bool {
        !self.draining(site)
            && self.used(site) + cpu <= self.limit(site, p)
            && self.host_for(site, cpu, memory, p).is_ok()
    }

    fn room(&self, site: &str, p: &Policy) -> f64 {
        self.limit(site, p) - self.used(site)
    }

    /// The site linked to `from` with the most room left, among those a
    /// guest using `cpu` fits in.
    fn roomiest<'c>(
        &self,
        c: &'c Cluster,
        from: &str,
        cpu: f64,
        memory: f64,
        p: &Policy,
    ) -> Option<&'c Site> {
        c.sites
            .iter()
            .filter(|t| t.name != from && c.link(from, &t.name).is_ok())
            .filter(|t| self.fits(&t.name, cpu, memory, p))
            .max_by(|a, b| {
                self.room(&a.name, p)
                    .partial_cmp(&self.room(&b.name, p))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
    }

    fn shift(&mut self, from: &str, to: &str, cpu: f64) {
        if from != to {
            *self.used.entry(from.into()).or_default() -= cpu;
            *self.used.entry(to.into()).or_default() += cpu;
        }
    }
}

/// A forced move's decision (maintenance, bursting, coming home), unless
/// it would not converge.
fn forced(
    c: &Cluster,
    p: &Policy,
    vm: &VmState,
    action: Action,
    to: Placement,
    reason: String,
) -> Result<Result<Decision, Refusal>, ClusterError> {
    let cost = cost_of(c, vm, action, &to)?;
    if !cost.converges {
        return Ok(Err(Refusal::NotConverging));
    }
    Ok(Ok(Decision {
        vm: vm.name.clone(),
        to_host: None,
        action,
        from: vm.placement.clone(),
        lost_here_s: placement_loss(vm, c, &vm.placement, p.horizon_s)?.total(),
        lost_there_s: placement_loss(vm, c, &to, p.horizon_s)?.total(),
        to,
        cost,
        reason,
        forced: true,
        burst_from: None,
    }))
}

/// Take a forced move through the filters a forced move still answers to
/// (converges, backoff, the limits): the decision, or its refusal.
fn take_forced(
    c: &Cluster,
    p: &Policy,
    st: &mut Planning,
    vm: &VmState,
    (action, to): (Action, Placement),
    reason: String,
) -> Result<Option<Decision>, ClusterError> {
    let refused = |st: &mut Planning, r| {
        st.refuse(&vm.name, Some(action), Some(&to), r);
        Ok(None)
    };
    if let Err(r) = held_back(st.held, &vm.name, action, &to) {
        return refused(st, r);
    }
    let mut d = match forced(c, p, vm, action, to.clone(), reason)? {
        Ok(d) => d,
        Err(r) => return refused(st, r),
    };
    match st.take_slot(vm, &to) {
        Ok(h) => d.to_host = h,
        Err(r) => return refused(st, r),
    }
    Ok(Some(d))
}

/// Sites in maintenance: every guest running there goes to its disk's
/// site if that can take it, else (and every guest whose disk is there)
/// to the nearest site with room, disk and all.
fn drain(c: &Cluster, p: &Policy, st: &mut Planning) -> Result<(), ClusterError> {
    for vm in &c.vms {
        let (h, d) = (&vm.placement.host_site, &vm.placement.disk_site);
        if (!st.sites.draining(h) && !st.sites.draining(d)) || st.moved.contains(&vm.name) {
            continue;
        }
        st.moved.insert(vm.name.clone());
        let sites = &st.sites;
        let nearest = |from: &str| {
            let mut near: Vec<(f64, &str)> = c
                .sites
                .iter()
                .filter(|s| sites.fits(&s.name, vm.load.cpu, vm.memory_bytes, p))
                .filter_map(|s| {
                    let rtt = if s.name == from {
                        Some(0.0)
                    } else {
                        c.link(from, &s.name).ok().map(|l| l.rtt_ms)
                    };
                    rtt.map(|r| (r, s.name.as_str()))
                })
                .collect();
            near.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
            near.first().map(|(_, s)| (*s).to_string())
        };
        let at = |host: String, disk: String| Placement {
            host_site: host,
            disk_site: disk,
        };
        let choice = if !sites.draining(h) {
            // Only the disk's site drains: the disk comes to the guest.
            Some((Action::MoveDisk, at(h.clone(), h.clone())))
        } else if !sites.draining(d) {
            // The guest alone, to the site nearest its disk that has room
            // (the disk's own first).
            nearest(d).map(|s| (Action::MoveVm, at(s, d.clone())))
        } else {
            // Both drain: guest and disk to the nearest site with room.
            nearest(h).map(|s| (Action::Teleport, at(s.clone(), s)))
        };
        let draining = if sites.draining(h) { h } else { d };
        let Some(choice) = choice else {
            let r = Refusal::NowhereToGo {
                draining: draining.clone(),
            };
            st.refuse(&vm.name, None, None, r);
            continue;
        };
        let why = format!(
            "site {draining} is in maintenance: a {} to {}",
            choice.0, choice.1
        );
        if let Some(dec) = take_forced(c, p, st, vm, choice, why)? {
            st.choose(dec, vm);
        }
    }
    Ok(())
}

/// Cloud bursting: a site that has stayed above `burst_above` of its CPU
/// for `burst_hold_s` sends guests to the linked site with the most room,
/// VM only, those that lose least to their disk being remote first (per
/// CPU they free), until it is back under the threshold.
fn burst(
    c: &Cluster,
    p: &Policy,
    st: &mut Planning,
    triggers: &mut Triggers,
    now: f64,
) -> Result<(), ClusterError> {
    for site in &c.sites {
        let s = site.name.as_str();
        let limit = site.cpu_capacity * p.burst_above;
        let Some(above_s) = triggers.site_above(s, st.sites.used(s), limit, now) else {
            continue;
        };
        if st.sites.draining(s) {
            continue;
        }
        if above_s < p.burst_hold_s {
            let r = Refusal::BurstHold {
                site: s.to_string(),
                used_cpu: st.sites.used(s),
                limit_cpu: limit,
                above_s,
                hold_s: p.burst_hold_s,
            };
            st.refuse("*", None, None, r);
            continue;
        }
        // Candidates, each with where it would go and what it would lose
        // there per CPU it frees.
        let mut cands: Vec<(f64, &VmState)> = Vec::new();
        for vm in c.vms.iter().filter(|v| {
            v.placement.host_site == s && !st.moved.contains(&v.name) && v.load.cpu > 0.0
        }) {
            let Some(t) = st.sites.roomiest(c, s, vm.load.cpu, vm.memory_bytes, p) else {
                continue;
            };
            let there = Placement {
                host_site: t.name.clone(),
                disk_site: vm.placement.disk_site.clone(),
            };
            let lost = placement_loss(vm, c, &there, p.horizon_s)?.total();
            cands.push((lost / vm.load.cpu, vm));
        }
        cands.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
        for (_, vm) in cands {
            if st.sites.used(s) <= site.cpu_capacity * p.burst_above {
                break;
            }
            // The room may have changed with the moves planned before.
            let Some(t) = st.sites.roomiest(c, s, vm.load.cpu, vm.memory_bytes, p) else {
                break;
            };
            let to = Placement {
                host_site: t.name.clone(),
                disk_site: vm.placement.disk_site.clone(),
            };
            let why = format!(
                "site {s} uses {:.1} of {:.0} CPUs (above {:.0}%): {} ({:.2} CPU) bursts to {}, its disk stays at {}",
                st.sites.used(s),
                site.cpu_capacity,
                p.burst_above * 100.0,
                vm.name,
                vm.load.cpu,
                to.host_site,
                to.disk_site
            );
            if let Some(mut dec) = take_forced(c, p, st, vm, (Action::MoveVm, to), why)? {
                // Its home is where it burst from, unless it had burst
                // before and is only moving on.
                dec.burst_from = Some(vm.home_site.clone().unwrap_or_else(|| s.to_string()));
                st.choose(dec, vm);
            }
        }
    }
    Ok(())
}

/// A guest about to start: what it needs and where its disk lives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NewGuest {
    pub name: String,
    /// CPUs it is expected to keep busy.
    pub cpu: f64,
    /// The site whose storage holds its disk.
    pub disk_site: String,
    /// Its memory (bytes; 0 when not counted against the hosts' memory).
    pub memory_bytes: f64,
}

/// Where a new guest starts, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NewPlacement {
    pub vm: String,
    pub site: String,
    /// The host of that site it starts on: the one with the most CPU left
    /// among those with room for its CPU and memory (`None`: the site
    /// lists no hosts in the snapshot; its first host is used).
    pub host: Option<String>,
    pub disk_site: String,
    /// Started away from its disk's site (bursting, or a drained site).
    pub away: bool,
    /// RTT between where it runs and its disk (ms).
    pub disk_rtt_ms: f64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    #[error("a guest named {0} already runs")]
    Exists(String),
    #[error("no site {0} (the guest's disk must be at a site of the inventory)")]
    UnknownSite(String),
    #[error("the guest's CPU need must be above 0 and finite, got {0}")]
    BadCpu(String),
    #[error("{0}")]
    NoRoom(String),
}

/// Where to start `g`: at its disk's site when that has room (up to the
/// burst threshold when bursting is on, so that it does not burst at
/// once); when it is full and bursting is on, or it is being drained, at
/// the linked site with the most room, its disk staying home (cloud
/// bursting for new guests: the live planner may bring it home later);
/// otherwise nowhere, with the reason.
pub fn place_new(c: &Cluster, p: &Policy, g: &NewGuest) -> Result<NewPlacement, PlaceError> {
    if !(g.cpu.is_finite() && g.cpu > 0.0) {
        return Err(PlaceError::BadCpu(g.cpu.to_string()));
    }
    if c.vms.iter().any(|v| v.name == g.name) {
        return Err(PlaceError::Exists(g.name.clone()));
    }
    let home = c
        .sites
        .iter()
        .find(|s| s.name == g.disk_site)
        .ok_or_else(|| PlaceError::UnknownSite(g.disk_site.clone()))?;
    let sites = SiteLoad::new(c, p);
    let at = |site: &str, away: bool, reason: String| -> Result<NewPlacement, PlaceError> {
        let l = c
            .link(site, &home.name)
            .map_err(|e| PlaceError::NoRoom(e.to_string()))?;
        Ok(NewPlacement {
            vm: g.name.clone(),
            site: site.into(),
            host: sites
                .host_for(site, g.cpu, g.memory_bytes, p)
                .ok()
                .flatten(),
            disk_site: home.name.clone(),
            away,
            disk_rtt_ms: l.rtt_ms,
            reason,
        })
    };
    let used = sites.used(&home.name);
    if sites.fits(&home.name, g.cpu, g.memory_bytes, p) {
        return at(
            &home.name,
            false,
            format!(
                "its disk's site {} has room: {:.1} of {:.0} CPUs used, {:.1} more fit",
                home.name,
                used,
                home.cpu_capacity,
                sites.room(&home.name, p)
            ),
        );
    }
    let draining = sites.draining(&home.name);
    let why = if draining {
        format!("its disk's site {} is being drained", home.name)
    } else {
        format!(
            "its disk's site {} uses {:.1} of {:.0} CPUs (limit {:.1}): no room for {:.1} more",
            home.name,
            used,
            home.cpu_capacity,
            sites.limit(&home.name, p),
            g.cpu
        )
    };
    if !draining && !p.burst {
        return Err(PlaceError::NoRoom(format!(
            "{why}; cloud bursting is off (`ferry control burst on` lets new guests start at a linked site)"
        )));
    }
    match sites.roomiest(c, &home.name, g.cpu, g.memory_bytes, p) {
        Some(t) => {
            let room = sites.room(&t.name, p);
            let mut there = at(&t.name, true, String::new())?;
            there.reason = format!(
                "{why}: starts at {} ({room:.1} CPUs free), its disk stays at {}, {:.1} ms away",
                t.name, home.name, there.disk_rtt_ms
            );
            Ok(there)
        }
        None => Err(PlaceError::NoRoom(format!(
            "{why}, and no site linked to it has room for {:.1} CPUs",
            g.cpu
        ))),
    }
}

/// Guests that burst away go back to their home site once it has room
/// for them again (below the burst threshold, so that they do not burst
/// straight out again), VM only, after their cooldown; whether bursting is
/// still on or not.
fn return_home(c: &Cluster, p: &Policy, st: &mut Planning) -> Result<(), ClusterError> {
    for vm in &c.vms {
        let Some(home) = vm.home_site.as_deref() else {
            continue;
        };
        if st.moved.contains(&vm.name)
            || home == vm.placement.host_site
            || c.sites.iter().all(|s| s.name != home)
        {
            continue;
        }
        let to = Placement {
            host_site: home.to_string(),
            disk_site: vm.placement.disk_site.clone(),
        };
        if !st.sites.fits(home, vm.load.cpu, vm.memory_bytes, p) {
            let r = Refusal::HomeFull {
                home: home.into(),
                used_cpu: st.sites.used(home),
                limit_cpu: st.sites.limit(home, p),
            };
            st.refuse(&vm.name, Some(Action::MoveVm), Some(&to), r);
            continue;
        }
        if let Err(r) = cooldown_filter(p, vm) {
            st.refuse(&vm.name, Some(Action::MoveVm), Some(&to), r);
            continue;
        }
        let why = format!(
            "burst from {home}, which has room again ({:.1} of {:.1} CPUs used): back home",
            st.sites.used(home),
            st.sites.limit(home, p)
        );
        if let Some(dec) = take_forced(c, p, st, vm, (Action::MoveVm, to), why)? {
            st.choose(dec, vm);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Link, Site};

    fn cluster(rtt: f64, vms: Vec<VmState>) -> Cluster {
        crate::fixtures::two_sites(rtt, 12.5e6, vms)
    }

    fn vm(name: &str, iops: f64, rtt: f64) -> VmState {
        crate::fixtures::remote_vm(name, iops, 0.3 + rtt)
    }

    /// Each filter alone, on one guest at `a` (disk at `b`) and a
    /// teleport of it to `b`.
    #[test]
    fn each_filter_refuses_with_its_own_reason() {
        let v = vm("web", 55.0, 16.0);
        let c = cluster(16.0, vec![v.clone()]);
        let to = Placement {
            host_site: "b".into(),
            disk_site: "b".into(),
        };
        let cost = cost_of(&c, &v, Action::Teleport, &to).unwrap();
        let p = Policy::default();
        let sites = SiteLoad::new(&c, &p);
        let k = Check {
            p: &p,
            sites: &sites,
            held: &[],
            vm: &v,
            action: Action::Teleport,
            to: &to,
            cost: &cost,
        };
        for f in FILTERS {
            assert_eq!(f(&k), Ok(()), "a plain move passes every filter");
        }
        let draining = Policy {
            maintenance: vec!["b".into()],
            ..Policy::default()
        };
        let d_sites = SiteLoad::new(&c, &draining);
        let r = drain_filter(&Check {
            sites: &d_sites,
            ..k
        });
        assert_eq!(r, Err(Refusal::Draining { site: "b".into() }));
        let mut big = v.clone();
        big.load.cpu = 9.0;
        let r = room_filter(&Check { vm: &big, ..k }).unwrap_err();
        assert!(
            matches!(r, Refusal::NoRoom { cpu, .. } if cpu == 9.0),
            "{r:?}"
        );
        let stuck = MoveCost {
            converges: false,
            ..cost
        };
        assert_eq!(
            converges_filter(&Check { cost: &stuck, ..k }),
            Err(Refusal::NotConverging)
        );
        let held = [HeldMove {
            vm: "web".into(),
            action: Action::Teleport,
            to: "b/b".into(),
            failures: 2,
            reason: "refused".into(),
            retry_in_s: 30.0,
        }];
        assert!(matches!(
            backoff_filter(&Check { held: &held, ..k }),
            Err(Refusal::HeldBack { failures: 2, .. })
        ));
        let mut recent = v.clone();
        recent.since_move_s = 88.0;
        assert_eq!(
            cooldown_filter(&p, &recent),
            Err(Refusal::Cooldown {
                left_s: 212.0,
                cooldown_s: 300.0
            })
        );
        let w = Weighed {
            action: Action::Teleport,
            to: to.clone(),
            cost,
            lost_there: 0.0,
        };
        assert!(margin_filter(&p, 500.0, &w).is_ok());
        assert!(matches!(
            margin_filter(&p, w.cost.lost_s * 1.2, &w),
            Err(Refusal::GainTooSmall { .. })
        ));
    }

    #[test]
    fn moves_in_flight_hold_their_slots_and_their_guests_are_left_alone() {
        let vms: Vec<VmState> = (0..4).map(|i| vm(&format!("v{i}"), 55.0, 16.0)).collect();
        let c = cluster(16.0, vms);
        let to = Placement {
            host_site: "b".into(),
            disk_site: "b".into(),
        };
        let cm = Commitments {
            in_flight: vec![InFlightMove {
                vm: "v0".into(),
                action: Action::MoveVm,
                from: c.vms[0].placement.clone(),
                to,
                to_host: None,
                started_s: 0.0,
            }],
            held: Vec::new(),
        };
        let p = Policy::default();
        let pl = plan_around(&c, &p, &mut Triggers::default(), 0.0, &cm).unwrap();
        assert_eq!(pl.decisions.len(), 1, "one slot of two left: {pl:?}");
        assert!(pl.decisions.iter().all(|d| d.vm != "v0"));
        let site_limited = Policy {
            max_moves_per_site: 1,
            ..Policy::default()
        };
        let pl = plan_around(&c, &site_limited, &mut Triggers::default(), 0.0, &cm).unwrap();
        assert!(pl.decisions.is_empty());
        assert!(pl
            .skipped
            .iter()
            .all(|s| matches!(s.refusal, Refusal::SiteLimit { limit: 1, .. })));
        assert!(
            pl.skipped[0].reason.contains("per-site limit"),
            "{:?}",
            pl.skipped
        );
    }

    /// Site `b` with two hosts: `b1` (8 CPUs, 4 GiB) already running a
    /// guest of 3 CPUs, `b2` (4 CPUs, 1 GiB) empty.
    fn with_hosts(mut c: Cluster) -> Cluster {
        use crate::cluster::Host;
        let host = |name: &str, site: &str, cpus: f64, mem: f64| Host {
            name: name.into(),
            site: site.into(),
            cpu_capacity: cpus,
            memory_bytes: Some(mem),
        };
        c.sites[1].cpu_capacity = 12.0;
        c.hosts = vec![
            host("a1", "a", 8.0, 64e9),
            host("b1", "b", 8.0, 4.0 * 1073741824.0),
            host("b2", "b", 4.0, 1073741824.0),
        ];
        for v in &mut c.vms {
            v.host = Some("a1".into());
        }
        let mut busy = vm("busy", 0.0, 0.0);
        busy.placement = Placement {
            host_site: "b".into(),
            disk_site: "b".into(),
        };
        busy.load.cpu = 3.0;
        busy.host = Some("b1".into());
        c.vms.push(busy);
        c
    }

    #[test]
    fn a_guest_goes_to_the_host_with_most_room_and_one_that_fits_no_host_stays() {
        // 1 CPU, 256 MB: b1 has 5 CPUs left, b2 4: b1.
        let c = with_hosts(cluster(16.0, vec![vm("io", 55.0, 16.0)]));
        c.validate().unwrap();
        let pl = plan(&c, &Policy::default(), &mut Triggers::default(), 0.0).unwrap();
        let d = &pl.decisions[0];
        assert_eq!(
            (d.action, d.to_host.as_deref()),
            (Action::MoveVm, Some("b1"))
        );
        // Two guests: the second goes where the first left most room.
        let c = with_hosts(cluster(
            16.0,
            vec![vm("io", 55.0, 16.0), vm("io2", 55.0, 16.0)],
        ));
        let pl = plan(&c, &Policy::default(), &mut Triggers::default(), 0.0).unwrap();
        let hosts: Vec<_> = pl.decisions.iter().map(|d| d.to_host.clone()).collect();
        assert_eq!(hosts.len(), 2);
        let mut big = vm("big", 55.0, 16.0);
        big.load.cpu = 5.5;
        big.memory_bytes = 2e9;
        let c = with_hosts(cluster(16.0, vec![big.clone()]));
        let pl = plan(&c, &Policy::default(), &mut Triggers::default(), 0.0).unwrap();
        // b has 9 CPUs left, but b1 only 5 and b2 4: the VM move is
        // refused by `fits`, naming the site whose hosts are too full.
        assert!(
            pl.decisions.iter().all(|d| d.action != Action::MoveVm),
            "{pl:?}"
        );
        let r = pl
            .candidates
            .iter()
            .find(|c| c.action == Some(Action::MoveVm))
            .and_then(|c| c.refused.clone())
            .unwrap();
        assert!(
            matches!(r, Refusal::NoHost { ref site, .. } if site == "b"),
            "{r:?}"
        );
        // 4 CPUs fit either host, 2 GB only b1's memory.
        big.load.cpu = 4.0;
        let c = with_hosts(cluster(16.0, vec![big]));
        let pl = plan(&c, &Policy::default(), &mut Triggers::default(), 0.0).unwrap();
        assert_eq!(pl.decisions[0].to_host.as_deref(), Some("b1"), "{pl:?}");
    }

    #[test]
    fn a_host_takes_part_in_no_more_moves_than_its_limit() {
        // Two guests on host a1 both want to go to b: with one move per
        // host, the second is refused naming a1, and a move in flight
        // from a1 counts too.
        let c = with_hosts(cluster(
            16.0,
            vec![vm("io", 55.0, 16.0), vm("io2", 55.0, 16.0)],
        ));
        let one = Policy {
            max_moves_per_host: 1,
            ..Policy::default()
        };
        let pl = plan(&c, &one, &mut Triggers::default(), 0.0).unwrap();
        assert_eq!(pl.decisions.len(), 1, "{pl:?}");
        let refused: Vec<_> = pl
            .skipped
            .iter()
            .filter(
                |s| matches!(&s.refusal, Refusal::HostLimit { host, limit: 1, .. } if host == "a1"),
            )
            .collect();
        assert_eq!(refused.len(), 1, "{:?}", pl.skipped);
        assert!(
            refused[0].reason.contains("per-host limit"),
            "{}",
            refused[0].reason
        );
        let cm = Commitments {
            in_flight: vec![InFlightMove {
                vm: "io".into(),
                action: Action::MoveVm,
                from: c.vms[0].placement.clone(),
                to: Placement {
                    host_site: "b".into(),
                    disk_site: "b".into(),
                },
                to_host: Some("b2".into()),
                started_s: 0.0,
            }],
            held: Vec::new(),
        };
        let pl = plan_around(&c, &one, &mut Triggers::default(), 0.0, &cm).unwrap();
        assert!(pl.decisions.is_empty(), "{pl:?}");
        // The default (4) takes both.
        let pl = plan(&c, &Policy::default(), &mut Triggers::default(), 0.0).unwrap();
        assert_eq!(pl.decisions.len(), 2, "{pl:?}");
        assert!(Policy {
            max_moves_per_host: 0,
            ..Policy::default()
        }
        .validate()
        .is_err());
    }

    #[test]
    fn a_host_is_chosen_by_cpu_room_among_those_with_the_memory() {
        let mut c = with_hosts(cluster(16.0, vec![]));
        c.vms[0].load.cpu = 5.0; // b1: 3 CPUs left; b2: 4 CPUs, 1 GiB
        let p = Policy::default();
        let sites = SiteLoad::new(&c, &p);
        assert_eq!(sites.host_for("b", 1.0, 5e8, &p), Ok(Some("b2".into())));
        assert_eq!(sites.host_for("b", 1.0, 2e9, &p), Ok(Some("b1".into())));
        assert!(matches!(
            sites.host_for("b", 3.5, 2e9, &p),
            Err(Refusal::NoHost { .. })
        ));
        assert_eq!(sites.host_for("nowhere", 1.0, 1.0, &p), Ok(None));
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

    /// Traffic with clients at `site`: `exchanges` a second, 100 kB/s.
    fn serving(site: &str, exchanges: f64) -> Vec<crate::cluster::ClientTraffic> {
        vec![crate::cluster::ClientTraffic {
            site: site.into(),
            exchanges_per_s: exchanges,
            bytes_per_s: 1e5,
        }]
    }

    #[test]
    fn a_guest_serving_clients_stays_with_them_and_a_quiet_one_moves_to_its_disk() {
        // The same I/O-bound guest at a, its disk at b: quiet, its VM goes
        // to its disk (as above); serving clients at a, 200 exchanges a
        // second that would each wait 16 ms more from b, the VM stays at
        // a (its disk may come to it instead).
        let quiet = vm("io", 55.0, 16.0);
        let mut busy = quiet.clone();
        busy.clients = serving("a", 200.0);
        let p = Policy::default();
        let pl = plan(
            &cluster(16.0, vec![quiet]),
            &p,
            &mut Triggers::default(),
            0.0,
        )
        .unwrap();
        assert_eq!(pl.decisions[0].action, Action::MoveVm, "{pl:?}");
        let pl = plan(
            &cluster(16.0, vec![busy.clone()]),
            &p,
            &mut Triggers::default(),
            0.0,
        )
        .unwrap();
        assert!(
            pl.decisions
                .iter()
                .all(|d| d.to.host_site == "a" && d.action == Action::MoveDisk),
            "{pl:?}"
        );
        // The VM move was weighed and lost on its clients' account.
        let vm_move = pl
            .candidates
            .iter()
            .find(|k| k.vm == "io" && k.action == Some(Action::MoveVm));
        assert!(vm_move.is_some_and(|k| k.refused.is_some()), "{pl:?}");

        // Away from its clients with nothing to gain for its disk (no
        // I/O), it goes back to them, and says why.
        let mut away = busy;
        away.load.iops = 0.0;
        away.placement = Placement {
            host_site: "b".into(),
            disk_site: "b".into(),
        };
        let pl = plan(
            &cluster(16.0, vec![away.clone()]),
            &p,
            &mut Triggers::default(),
            0.0,
        )
        .unwrap();
        let d = &pl.decisions[0];
        assert_eq!(d.to.host_site, "a", "{pl:?}");
        assert!(d.reason.contains("clients at another site"), "{}", d.reason);
        assert!(d.lost_here_s > 600.0 && d.lost_there_s < 1.0, "{d:?}");
        // Without clients the same idle guest stays.
        away.clients.clear();
        let pl = plan(
            &cluster(16.0, vec![away]),
            &p,
            &mut Triggers::default(),
            0.0,
        )
        .unwrap();
        assert!(pl.decisions.is_empty(), "{pl:?}");
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

    /// Sites home (8 CPUs), near (8) and cloud (64); home-near 2 ms,
    /// home-cloud 16 ms, near-cloud 16 ms.
    fn three_sites(vms: Vec<VmState>) -> Cluster {
        let link = |a: &str, b: &str, rtt: f64| Link {
            a: a.into(),
            b: b.into(),
            rtt_ms: rtt,
            bandwidth: 12.5e6,
        };
        Cluster {
            sites: [("home", 8.0), ("near", 8.0), ("cloud", 64.0)]
                .iter()
                .map(|(n, c)| Site {
                    name: (*n).into(),
                    cpu_capacity: *c,
                })
                .collect(),
            links: vec![
                link("home", "near", 2.0),
                link("home", "cloud", 16.0),
                link("near", "cloud", 16.0),
            ],
            vms,
            local_rtt_ms: 0.1,
            hosts: Vec::new(),
            link_index: Default::default(),
        }
    }

    fn at(name: &str, host: &str, disk: &str, iops: f64, cpu: f64) -> VmState {
        let mut v = vm(name, iops, 0.0);
        v.placement = Placement {
            host_site: host.into(),
            disk_site: disk.into(),
        };
        v.load.cpu = cpu;
        v.load.latency_ms = 0.3;
        v
    }

    #[test]
    fn a_site_in_maintenance_is_emptied_and_nothing_moves_in() {
        let c = three_sites(vec![
            // Runs at home, disk near: goes to its disk.
            at("split", "home", "near", 100.0, 1.0),
            // Runs and stores at home: goes, disk and all, to the nearest site with room.
            at("local", "home", "home", 100.0, 1.0),
            // Runs near, disk at home: its disk comes to it.
            at("disk-home", "near", "home", 100.0, 1.0),
            // Elsewhere: left alone.
            at("other", "cloud", "cloud", 100.0, 1.0),
        ]);
        let p = Policy {
            maintenance: vec!["home".into()],
            max_moves_per_link: 10,
            ..Policy::default()
        };
        let plan = plan(&c, &p, &mut Triggers::default(), 0.0).unwrap();
        let by = |n: &str| plan.decisions.iter().find(|d| d.vm == n);
        let d = by("split").expect("split moves");
        assert_eq!(
            (d.action, d.to.host_site.as_str()),
            (Action::MoveVm, "near")
        );
        let d = by("local").expect("local moves");
        assert_eq!(
            (d.action, d.to.host_site.as_str(), d.to.disk_site.as_str()),
            (Action::Teleport, "near", "near")
        );
        let d = by("disk-home").expect("disk-home's disk moves");
        assert_eq!(
            (d.action, d.to.disk_site.as_str()),
            (Action::MoveDisk, "near")
        );
        assert!(by("other").is_none());
        assert!(plan
            .decisions
            .iter()
            .all(|d| d.forced && d.reason.contains("maintenance")));
        assert!(plan
            .decisions
            .iter()
            .all(|d| d.to.host_site != "home" && d.to.disk_site != "home"));

        // Near full: the guest stored at home goes to the cloud instead.
        let mut busy = c.clone();
        busy.vms.push(at("filler", "near", "near", 0.0, 6.5));
        let plan = super::plan(&busy, &p, &mut Triggers::default(), 0.0).unwrap();
        let to: Vec<(&str, &str)> = plan
            .decisions
            .iter()
            .map(|d| (d.vm.as_str(), d.to.host_site.as_str()))
            .collect();
        assert!(to.contains(&("local", "cloud")), "{to:?}");
        // Its disk's site is full: the guest alone to the cloud, disk stays.
        let d = plan.decisions.iter().find(|d| d.vm == "split").unwrap();
        assert_eq!(
            (d.action, d.to.host_site.as_str(), d.to.disk_site.as_str()),
            (Action::MoveVm, "cloud", "near")
        );
        assert!(to.iter().all(|(_, s)| *s != "home"), "{to:?}");
    }

    /// Home runs 9 of its 8 CPUs: two CPU-bound crunchers and two
    /// I/O-bound guests, all with their disks at home.
    fn overrun_home() -> Cluster {
        three_sites(vec![
            at("crunch-1", "home", "home", 2.0, 3.0),
            at("crunch-2", "home", "home", 2.0, 3.0),
            at("db", "home", "home", 3000.0, 2.0),
            at("web", "home", "home", 400.0, 1.0),
        ])
    }

    #[test]
    fn a_full_site_bursts_its_cpu_bound_guests_to_the_cloud_and_keeps_the_io_bound() {
        let c = overrun_home();
        // 9 of 8 CPUs in use; without bursting nothing moves (all local).
        let plan0 = plan(&c, &Policy::default(), &mut Triggers::default(), 0.0).unwrap();
        assert!(plan0.decisions.is_empty(), "{plan0:?}");
        let p = Policy {
            burst: true,
            max_moves_per_link: 10,
            ..Policy::default()
        };
        // Above the threshold, but not yet for the hold: nothing moves,
        // and the plan says why.
        let mut triggers = Triggers::default();
        let held = plan(&c, &p, &mut triggers, 0.0).unwrap();
        assert!(held.decisions.is_empty(), "{held:?}");
        assert!(
            held.skipped
                .iter()
                .any(|s| matches!(s.refusal, Refusal::BurstHold { .. })
                    && s.reason.contains("for 0 s of the 30 s hold")),
            "{held:?}"
        );
        let plan = plan(&c, &p, &mut triggers, p.burst_hold_s).unwrap();
        let moved: Vec<&str> = plan.decisions.iter().map(|d| d.vm.as_str()).collect();
        // 9 CPUs against a 7.2 threshold: one 3-CPU cruncher is enough,
        // and the I/O-bound guests stay with their disks.
        assert_eq!(moved, ["crunch-1"], "{plan:?}");
        let d = &plan.decisions[0];
        assert_eq!(d.action, Action::MoveVm);
        assert_eq!(
            (d.to.host_site.as_str(), d.to.disk_site.as_str()),
            ("cloud", "home")
        );
        assert!(
            d.forced && d.reason.contains("bursts to cloud"),
            "{}",
            d.reason
        );

        // Once it runs in the cloud, locality does not bring it back while
        // home would go over the threshold again.
        assert_eq!(d.burst_from.as_deref(), Some("home"));
        let mut after = c.clone();
        after.vms[0].placement.host_site = "cloud".into();
        after.vms[0].home_site = Some("home".into());
        let plan = super::plan(&after, &p, &mut Triggers::default(), 0.0).unwrap();
        assert!(plan.decisions.is_empty(), "{plan:?}");
        assert!(
            plan.skipped
                .iter()
                .any(|s| s.vm == "crunch-1" && s.reason.contains("no room for it yet")),
            "{plan:?}"
        );
        // Away, it is I/O-bound now: locality may bring the VM to its disk
        // but never sends its disk to the cloud.
        let mut hungry = after.clone();
        hungry.vms[0].load.iops = 3000.0;
        hungry.vms[0].load.latency_ms = 20.0;
        let pl = super::plan(&hungry, &p, &mut Triggers::default(), 0.0).unwrap();
        assert!(
            pl.decisions.iter().all(|d| d.action == Action::MoveVm),
            "{pl:?}"
        );
        // Home has room again (a cruncher left): back home, VM only, even
        // with bursting switched off since.
        after.vms.remove(1);
        for pol in [p.clone(), Policy::default()] {
            let pl = super::plan(&after, &pol, &mut Triggers::default(), 0.0).unwrap();
            let d = pl
                .decisions
                .iter()
                .find(|d| d.vm == "crunch-1")
                .expect("comes home");
            assert_eq!(d.action, Action::MoveVm);
            assert_eq!(
                (d.to.host_site.as_str(), d.to.disk_site.as_str()),
                ("home", "home")
            );
            assert!(d.reason.contains("back home"), "{}", d.reason);
        }
        // Not during its cooldown.
        after.vms[0].since_move_s = 10.0;
        let pl = super::plan(&after, &p, &mut Triggers::default(), 0.0).unwrap();
        assert!(pl.decisions.iter().all(|d| d.vm != "crunch-1"), "{pl:?}");
    }

    #[test]
    fn a_site_bursts_only_after_staying_above_its_threshold_for_the_hold() {
        let full = overrun_home();
        let mut calm = full.clone();
        calm.vms[0].load.cpu = 0.5;
        let p = Policy {
            burst: true,
            burst_hold_s: 20.0,
            ..Policy::default()
        };
        let mut tr = Triggers::default();
        let moves = |c: &Cluster, tr: &mut Triggers, now: f64| {
            plan(c, &p, tr, now).unwrap().decisions.len()
        };
        assert_eq!(moves(&full, &mut tr, 0.0), 0);
        assert_eq!(moves(&full, &mut tr, 10.0), 0);
        // A dip under the threshold starts the hold again.
        assert_eq!(moves(&calm, &mut tr, 15.0), 0);
        assert_eq!(moves(&full, &mut tr, 25.0), 0);
        assert_eq!(moves(&full, &mut tr, 40.0), 0);
        assert_eq!(moves(&full, &mut tr, 45.0), 1);
        let bad = Policy {
            burst_hold_s: -1.0,
            ..p.clone()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn a_burst_sends_the_guest_whose_clients_wait_least() {
        // Two equal crunchers; one serves clients at home: the other goes.
        let mut served = at("crunch-1", "home", "home", 2.0, 3.0);
        served.clients = serving("home", 50.0);
        let c = three_sites(vec![
            served,
            at("crunch-2", "home", "home", 2.0, 3.0),
            at("db", "home", "home", 3000.0, 3.0),
        ]);
        let p = Policy {
            burst: true,
            burst_hold_s: 0.0,
            max_moves_per_link: 10,
            ..Policy::default()
        };
        let pl = plan(&c, &p, &mut Triggers::default(), 0.0).unwrap();
        let moved: Vec<&str> = pl.decisions.iter().map(|d| d.vm.as_str()).collect();
        assert_eq!(moved, ["crunch-2"], "{pl:?}");
    }

    #[test]
    fn a_new_guest_starts_on_the_host_with_room_for_it() {
        // Site b: b1 (8 CPUs, 4 GiB, 3 used), b2 (4 CPUs, 1 GiB, empty).
        let c = with_hosts(cluster(16.0, vec![vm("x", 0.0, 0.0)]));
        let g = |cpu: f64, mem: f64| NewGuest {
            name: "new".into(),
            cpu,
            disk_site: "b".into(),
            memory_bytes: mem,
        };
        let p = Policy::default();
        // 1 CPU: b1 has 5 left, b2 4: the roomier.
        let at = place_new(&c, &p, &g(1.0, 0.0)).unwrap();
        assert_eq!((at.site.as_str(), at.host.as_deref()), ("b", Some("b1")));
        // 2 GiB fits b1's memory only.
        let at = place_new(&c, &p, &g(0.5, 2.0 * 1073741824.0)).unwrap();
        assert_eq!(at.host.as_deref(), Some("b1"));
        // 5.5 CPUs fit the site (12 - 3 = 9) but no host of it: refused
        // with bursting off.
        let e = place_new(&c, &p, &g(5.5, 0.0)).unwrap_err();
        assert!(matches!(e, PlaceError::NoRoom(_)), "{e}");
        // A site with no hosts in the snapshot: no host named.
        let plain = cluster(16.0, vec![vm("x", 0.0, 0.0)]);
        let mut g1 = g(1.0, 0.0);
        g1.disk_site = "a".into();
        assert_eq!(place_new(&plain, &p, &g1).unwrap().host, None);
    }

    #[test]
    fn a_new_guest_starts_by_its_disk_or_bursts_when_that_site_is_full() {
        let mut c = cluster(16.0, vec![at("busy", "a", "a", 10.0, 7.5)]);
        c.sites[0].cpu_capacity = 8.0;
        let g = |cpu| NewGuest {
            name: "new".into(),
            cpu,
            disk_site: "a".into(),
            memory_bytes: 0.0,
        };
        let p = Policy::default();
        let here = place_new(&c, &p, &g(0.5)).unwrap();
        assert_eq!((here.site.as_str(), here.away), ("a", false), "{here:?}");
        // Full: refused while bursting is off, with the way out named.
        let e = place_new(&c, &p, &g(1.0)).unwrap_err();
        assert!(e.to_string().contains("bursting is off"), "{e}");
        let burst = Policy {
            burst: true,
            ..Policy::default()
        };
        // With bursting on, home is full above 90%: 7.5 + 0.5 > 7.2.
        let away = place_new(&c, &burst, &g(0.5)).unwrap();
        assert_eq!((away.site.as_str(), away.away), ("b", true), "{away:?}");
        assert_eq!(away.disk_site, "a");
        assert_eq!(away.disk_rtt_ms, 16.0);
        assert!(
            away.reason.contains("its disk stays at a"),
            "{}",
            away.reason
        );
        // Nowhere has room.
        let e = place_new(&c, &burst, &g(100.0)).unwrap_err();
        assert!(
            e.to_string().contains("no site linked to it has room"),
            "{e}"
        );
        // A drained home sends new guests away even without bursting.
        let drained = Policy {
            maintenance: vec!["a".into()],
            ..Policy::default()
        };
        assert_eq!(place_new(&c, &drained, &g(0.5)).unwrap().site, "b");
        // Bad asks.
        assert!(matches!(
            place_new(&c, &p, &g(f64::NAN)),
            Err(PlaceError::BadCpu(_))
        ));
        let mut dup = g(0.5);
        dup.name = "busy".into();
        assert_eq!(
            place_new(&c, &p, &dup),
            Err(PlaceError::Exists("busy".into()))
        );
        let mut nowhere = g(0.5);
        nowhere.disk_site = "mars".into();
        assert_eq!(
            place_new(&c, &p, &nowhere),
            Err(PlaceError::UnknownSite("mars".into()))
        );
    }
}
