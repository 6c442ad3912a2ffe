//! A simulated cluster driven through the very same [`policy::plan`]:
//! sites in a ring of distances, VMs that switch between I/O-bound and
//! CPU-bound phases, disks placed away from their VMs at the start. Each
//! tick the VMs' load is what their placement lets them do (a closed-loop
//! I/O-bound guest issues one request per round trip); the policy plans;
//! the plan is applied at once (the move's cost is charged). The report
//! counts, per policy, the guests' lost seconds, bytes moved, moves, and
//! the slowest decision cycle.

use crate::cluster::{Cluster, Link, Placement, Site, VmLoad, VmState};
use crate::model::access_cost;
use crate::policy::{plan, Action, Policy, Triggers};
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
            seed: 1,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SimResult {
    pub policy: String,
    /// Guest-seconds of work lost to remote access and to moves.
    pub lost_s: f64,
    pub bytes_moved: f64,
    pub moves: usize,
    pub vm_moves: usize,
    pub disk_moves: usize,
    pub teleports: usize,
    /// The slowest decision cycle (ms).
    pub max_cycle_ms: f64,
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
            cpu_capacity: 64.0,
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
                load: VmLoad {
                    iops: 0.0,
                    io_bytes: 8192.0,
                    latency_ms: 0.0,
                    cpu: 1.0,
                    dirty_rate: 2e6,
                    write_rate: 1e6,
                },
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
            link_index: Default::default(),
        },
        io_bound,
    )
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
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed ^ 0x5eed);
    let mut triggers = Triggers::default();
    let mut r = SimResult {
        policy: name.into(),
        lost_s: 0.0,
        bytes_moved: 0.0,
        moves: 0,
        vm_moves: 0,
        disk_moves: 0,
        teleports: 0,
        max_cycle_ms: 0.0,
    };
    for tick in 0..cfg.ticks {
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
        let Some(p) = policy else { continue };
        let t = Instant::now();
        #[allow(clippy::cast_precision_loss)]
        let now = tick as f64 * cfg.tick_s;
        let pl = plan(&c, p, &mut triggers, now).expect("a consistent simulated cluster");
        r.max_cycle_ms = r.max_cycle_ms.max(t.elapsed().as_secs_f64() * 1000.0);
        for d in pl.decisions {
            let Some(v) = c.vms.iter_mut().find(|v| v.name == d.vm) else {
                continue;
            };
            v.placement = d.to.clone();
            v.since_move_s = 0.0;
            r.lost_s += d.cost.lost_s;
            r.bytes_moved += d.cost.bytes;
            r.moves += 1;
            match d.action {
                Action::MoveVm => r.vm_moves += 1,
                Action::MoveDisk => r.disk_moves += 1,
                Action::Teleport => r.teleports += 1,
            }
        }
        for v in &mut c.vms {
            v.since_move_s += cfg.tick_s;
        }
    }
    r
}

/// Every policy on the same cluster and traces.
pub fn compare(cfg: &SimConfig) -> Vec<SimResult> {
    let locality = Policy::default();
    let thresholds = Policy {
        latency_trigger_ms: 15.0,
        hold_s: 300.0,
        ..Policy::default()
    };
    vec![
        run(cfg, "none", None),
        run(cfg, "thresholds (15 ms for 300 s)", Some(&thresholds)),
        run(cfg, "locality", Some(&locality)),
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
        // Same seed, same answer.
        assert_eq!(
            run(&cfg, "locality", Some(&Policy::default())).moves,
            loc.moves
        );
    }
}
