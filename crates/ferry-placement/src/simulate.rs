//! A simulated cluster driven through the controller's own core
//! ([`cycle::drive`](crate::cycle::drive), the service's step):
//! sites in a ring of distances, VMs that switch between I/O-bound and
//! CPU-bound phases, disks placed away from their VMs at the start. Each
//! tick the VMs' load is what their placement lets them do (a closed-loop
//! I/O-bound guest issues one request per round trip); the policy plans;
//! the plan is applied at once (the move's cost is charged). Each site has
//! twice the CPUs its guests need on average (at least 16), so the cluster
//! has room; in the middle third of the run the guests whose home is a
//! spiking site (the first, and every tenth after it) need three times the
//! CPU (a load spike that overfills that site): a site asked for more CPU
//! than it has slows every guest on it in proportion (CPU contention,
//! priced as lost guest-seconds). The report counts, per
//! policy, the guests' lost seconds (I/O and CPU), bytes moved, moves, the
//! slowest decision cycle, and in the maintenance run how long the drained
//! site took to empty.

use crate::cluster::{Cluster, Link, Placement, Site, VmLoad, VmState};
use crate::cycle::{drive, ControllerCore, Ended, NoJournal, World};
use crate::model::access_cost;
use crate::policy::{Action, Decision, Policy};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct SimConfig {
    pub sites: usize,
    pub vms: usize,
    pub ticks: usize,
    pub tick_s: f64,
    /// Share of VMs whose disk starts at another site than the VM.
    pub remote_share: f64,
    /// Chance per tick that a VM switches between I/O- and CPU-bound.
    pub flip: f64,
    /// CPU a guest of a spiking site needs during the spike (middle third
    /// of the ticks); 1.0 elsewhere and otherwise.
    pub spike_cpu: f64,
    /// Drain this site for maintenance from this tick on.
    pub maintenance: Option<(usize, String)>,
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            sites: 4,
            vms: 100,
            ticks: 30,
            tick_s: 60.0,
            remote_share: 0.5,
            flip: 0.05,
            spike_cpu: 3.0,
            maintenance: None,
            seed: 1,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SimResult {
    pub policy: String,
    /// Guest-seconds of work lost to remote access, to moves and to CPU
    /// contention.
    pub lost_s: f64,
    /// The part of `lost_s` lost to CPU contention (a site asked for more
    /// CPU than it has).
    pub cpu_lost_s: f64,
    pub bytes_moved: f64,
    pub moves: usize,
    pub vm_moves: usize,
    pub disk_moves: usize,
    pub teleports: usize,
    /// The slowest decision cycle (ms).
    pub max_cycle_ms: f64,
    /// With a site drained for maintenance: the first tick after which no
    /// guest ran there and no disk lived there (`None`: never).
    pub drained_at_tick: Option<usize>,
    /// With a site drained: guests running there or with their disk there
    /// at the end (a drain is limited by the moves each link carries at
    /// once, `max_moves_per_link`).
    pub drain_left: usize,
    /// The most CPU the guests asked for at one tick, as a share of all
    /// the sites' CPUs: above 1, no placement avoids contention.
    pub peak_cpu_share: f64,
}

/// CPUs each simulated site has: twice the guests it starts with on
/// average, at least 16.
pub fn site_capacity(cfg: &SimConfig) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let per_site = cfg.vms as f64 / cfg.sites.max(1) as f64;
    (2.0 * per_site).ceil().max(16.0)
}

/// Whether the guests of site `i` spike: the first and every tenth.
fn spiking(i: usize) -> bool {
    i.is_multiple_of(10)
}

/// Service time of one request on local storage (s).
const SERVICE_S: f64 = 0.0003;

fn build(cfg: &SimConfig) -> (Cluster, Vec<bool>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    let names: Vec<String> = (0..cfg.sites).map(|i| format!("s{i}")).collect();
    let sites = names
        .iter()
        .map(|n| Site {
            name: n.clone(),
            cpu_capacity: site_capacity(cfg),
        })
        .collect();
    let mut links = Vec::new();
    for i in 0..cfg.sites {
        for j in i + 1..cfg.sites {
            // Distance around a ring: 2 ms per hop, 100 Mbit/s to 1 Gbit/s.
            let hops = (j - i).min(cfg.sites - (j - i));
            #[allow(clippy::cast_precision_loss)]
            let rtt = 2.0 * hops as f64;
            links.push(Link {
                a: names[i].clone(),
                b: names[j].clone(),
                rtt_ms: rtt,
                bandwidth: if hops <= 1 { 125e6 } else { 12.5e6 },
            });
        }
    }
    let mut io_bound = Vec::new();
    let vms = (0..cfg.vms)
        .map(|k| {
            let h = rng.gen_range(0..cfg.sites);
            let d = if rng.gen_bool(cfg.remote_share) && cfg.sites > 1 {
                (h + rng.gen_range(1..cfg.sites)) % cfg.sites
            } else {
                h
            };
            io_bound.push(rng.gen_bool(0.5));
            VmState {
                name: format!("vm{k}"),
                placement: Placement {
                    host_site: names[h].clone(),
                    disk_site: names[d].clone(),
                },
                memory_bytes: f64::from(rng.gen_range(1u32..=8)) * 256e6,
                disk_bytes: f64::from(rng.gen_range(4u32..=40)) * 1e9,
                missing_at: Default::default(),
                missing_link_at: Default::default(),
                printed_at: Default::default(),
                copy_at: Default::default(),
                shares_extents_at: Default::default(),
                rebuild_bps_at: Default::default(),
                nonzero_share: None,
                memory_link_share: None,
                memory_stream_bps: None,
                memory_move_setup_s: None,
                memory_link_efficiency: None,
                vm_move_pauses: Vec::new(),
                teleport_pauses: Vec::new(),
                disk_switch_hold_s: None,
                disk_switch_holds_s: Vec::new(),
                disk_move_setups_s: Vec::new(),
                disk_move_host_s: Vec::new(),
                disk_link_share: None,
                accel: None,
                home_site: None,
                load: VmLoad {
                    iops: 0.0,
                    io_bytes: 8192.0,
                    latency_ms: 0.0,
                    cpu: 1.0,
                    dirty_rate: 2e6,
                    write_rate: 1e6,
                },
                clients: Vec::new(),
                host: None,
                since_move_s: f64::INFINITY,
            }
        })
        .collect();
    (
        Cluster {
            sites,
            links,
            vms,
            local_rtt_ms: 0.1,
            hosts: Vec::new(),
            link_index: Default::default(),
        },
        io_bound,
    )
}

/// CPU lost this tick to contention: a site whose guests ask for more
/// CPU than it has runs each of them at capacity / demand of its speed.
fn cpu_lost(c: &Cluster, tick_s: f64) -> f64 {
    let mut demand: std::collections::BTreeMap<&str, f64> = Default::default();
    for v in &c.vms {
        *demand.entry(v.placement.host_site.as_str()).or_default() += v.load.cpu;
    }
    c.sites
        .iter()
        .filter_map(|s| {
            let d = *demand.get(s.name.as_str())?;
            (d > s.cpu_capacity).then_some(tick_s * (d - s.cpu_capacity))
        })
        .sum()
}

/// What each VM measures at its placement this tick.
fn measure(c: &mut Cluster, io_bound: &[bool]) {
    let links: Vec<(f64, f64)> = c
        .vms
        .iter()
        .map(|v| {
            c.link(&v.placement.host_site, &v.placement.disk_site)
                .map_or((0.1, 1.25e9), |l| (l.rtt_ms, l.bandwidth))
        })
        .collect();
    for ((v, io), (rtt, bw)) in c.vms.iter_mut().zip(io_bound).zip(links) {
        let lat = SERVICE_S + rtt / 1000.0 + v.load.io_bytes / bw;
        v.load.latency_ms = lat * 1000.0;
        v.load.iops = if *io { 1.0 / lat } else { 0.2 };
    }
}

/// Run one policy (`None`: no automation) over the configured cluster.
pub fn run(cfg: &SimConfig, name: &str, policy: Option<&Policy>) -> SimResult {
    let (mut c, mut io_bound) = build(cfg);
    let spiking_sites: Vec<String> = (0..cfg.sites)
        .filter(|i| spiking(*i))
        .map(|i| format!("s{i}"))
        .collect();
    let home: Vec<bool> = c
        .vms
        .iter()
        .map(|v| spiking_sites.contains(&v.placement.host_site))
        .collect();
    let all_cpus: f64 = c.sites.iter().map(|s| s.cpu_capacity).sum();
    let mut policy = policy.cloned();
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed ^ 0x5eed);
    let mut core = ControllerCore::default();
    let mut done = Vec::new();
    let mut r = SimResult {
        policy: name.into(),
        lost_s: 0.0,
        cpu_lost_s: 0.0,
        bytes_moved: 0.0,
        moves: 0,
        vm_moves: 0,
        disk_moves: 0,
        teleports: 0,
        max_cycle_ms: 0.0,
        drained_at_tick: None,
        drain_left: 0,
        peak_cpu_share: 0.0,
    };
    for tick in 0..cfg.ticks {
        let spike = (cfg.ticks / 3..2 * cfg.ticks / 3).contains(&tick);
        for (v, from_s0) in c.vms.iter_mut().zip(&home) {
            v.load.cpu = if spike && *from_s0 {
                cfg.spike_cpu
            } else {
                1.0
            };
        }
        if let (Some((at, site)), Some(p)) = (&cfg.maintenance, policy.as_mut()) {
            if tick == *at {
                p.maintenance = vec![site.clone()];
            }
        }
        for io in &mut io_bound {
            if rng.gen_bool(cfg.flip) {
                *io = !*io;
            }
        }
        measure(&mut c, &io_bound);
        for v in &c.vms {
            let l = c
                .link(&v.placement.host_site, &v.placement.disk_site)
                .expect("every pair of sites is linked");
            if let Ok(a) = access_cost(v, &c, l.rtt_ms, l.bandwidth, cfg.tick_s) {
                r.lost_s += a.lost_s;
            }
        }
        let asked: f64 = c.vms.iter().map(|v| v.load.cpu).sum();
        r.peak_cpu_share = r.peak_cpu_share.max(asked / all_cpus);
        let cpu = cpu_lost(&c, cfg.tick_s);
        r.cpu_lost_s += cpu;
        r.lost_s += cpu;
        let Some(p) = policy.as_ref() else { continue };
        let t = Instant::now();
        #[allow(clippy::cast_precision_loss)]
        let now = tick as f64 * cfg.tick_s;
        let mut world = Simulated {
            c: &mut c,
            r: &mut r,
            done: &mut done,
        };
        drive(&mut core, &mut world, &mut NoJournal, p, now, true)
            .expect("a consistent simulated cluster");
        r.max_cycle_ms = r.max_cycle_ms.max(t.elapsed().as_secs_f64() * 1000.0);
        for v in &mut c.vms {
            v.since_move_s += cfg.tick_s;
        }
        if let Some((at, site)) = &cfg.maintenance {
            r.drain_left = c
                .vms
                .iter()
                .filter(|v| v.placement.host_site == *site || v.placement.disk_site == *site)
                .count();
            if tick >= *at && r.drain_left == 0 && r.drained_at_tick.is_none() {
                r.drained_at_tick = Some(tick);
            }
        }
    }
    r
}

/// The simulated cluster as the core's world: a move is carried out at
/// once (its cost charged) and reported ended at the next step.
struct Simulated<'a> {
    c: &'a mut Cluster,
    r: &'a mut SimResult,
    done: &'a mut Vec<Ended>,
}

impl World for Simulated<'_> {
    fn measure(&mut self, _now: f64) -> Result<Cluster, String> {
        Ok(self.c.clone())
    }

    fn start(&mut self, d: &Decision, now: f64) -> Result<(), String> {
        let Some(v) = self.c.vms.iter_mut().find(|v| v.name == d.vm) else {
            return Err(format!("no guest {}", d.vm));
        };
        v.placement = d.to.clone();
        v.since_move_s = 0.0;
        v.home_site = crate::cluster::home_after_move(
            v.home_site.take(),
            d.burst_from.as_deref(),
            &v.placement.host_site,
        );
        let r = &mut *self.r;
        r.lost_s += d.cost.lost_s;
        r.bytes_moved += d.cost.bytes;
        r.moves += 1;
        match d.action {
            Action::MoveVm => r.vm_moves += 1,
            Action::MoveDisk => r.disk_moves += 1,
            Action::Teleport => r.teleports += 1,
        }
        self.done.push(Ended {
            vm: d.vm.clone(),
            completed: true,
            reason: None,
            at_s: now,
        });
        Ok(())
    }

    fn cancel(&mut self, _vm: &str, _why: &str) {}

    fn ended(&mut self, _now: f64) -> Vec<Ended> {
        std::mem::take(self.done)
    }
}

/// Every policy on the same cluster and traces.
pub fn compare(cfg: &SimConfig) -> Vec<SimResult> {
    let locality = Policy::default();
    let thresholds = Policy {
        latency_trigger_ms: 15.0,
        hold_s: 300.0,
        ..Policy::default()
    };
    let bursting = Policy {
        burst: true,
        ..Policy::default()
    };
    let drain = SimConfig {
        maintenance: Some((cfg.ticks / 6, "s1".into())),
        ..cfg.clone()
    };
    vec![
        run(cfg, "none", None),
        run(cfg, "thresholds (15 ms for 300 s)", Some(&thresholds)),
        run(cfg, "locality", Some(&locality)),
        run(cfg, "locality + bursting", Some(&bursting)),
        run(
            &drain,
            &format!(
                "locality + bursting, s1 drained from tick {}",
                cfg.ticks / 6
            ),
            Some(&bursting),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locality_loses_less_than_doing_nothing() {
        let cfg = SimConfig::default();
        let rs = compare(&cfg);
        let (none, thr, loc) = (&rs[0], &rs[1], &rs[2]);
        assert_eq!(none.moves, 0);
        assert!(loc.moves > 0);
        assert!(loc.lost_s < none.lost_s * 0.5, "{rs:?}");
        assert!(thr.lost_s <= none.lost_s, "{rs:?}");
        // The spike overfills the first site: doing nothing, its guests
        // lose CPU time; bursting never loses more than locality alone.
        let burst = &rs[3];
        assert!(none.cpu_lost_s > 0.0, "{rs:?}");
        assert!(burst.cpu_lost_s <= loc.cpu_lost_s, "{rs:?}");
        // The drained site empties, and stays empty.
        let drained = &rs[4];
        assert!(drained.drained_at_tick.is_some(), "{rs:?}");
        // With every disk at home, locality has nothing to move and the
        // spike costs CPU time; bursting relieves the site.
        let home = SimConfig {
            remote_share: 0.0,
            ..cfg.clone()
        };
        let loc_home = run(&home, "locality", Some(&Policy::default()));
        let burst_home = run(
            &home,
            "locality + bursting",
            Some(&Policy {
                burst: true,
                ..Policy::default()
            }),
        );
        assert!(loc_home.cpu_lost_s > 0.0, "{loc_home:?}");
        assert!(
            burst_home.cpu_lost_s < loc_home.cpu_lost_s / 2.0,
            "{burst_home:?} {loc_home:?}"
        );
        assert!(burst_home.vm_moves > 0);
        // Same seed, same answer.
        assert_eq!(
            run(&cfg, "locality", Some(&Policy::default())).moves,
            loc.moves
        );
    }
}
