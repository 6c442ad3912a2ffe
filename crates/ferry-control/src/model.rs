//! The cost model (docs/placement-model.md states it with its inputs).
//!
//! Remote access. A guest keeps `C = iops × latency` requests in flight
//! (Little's law on what its forwarder measured). Each request served
//! across a link costs the local service time plus one round trip plus its
//! bytes over the link's bandwidth. The guest's I/O-bound share of time is
//! `u = min(1, iops × latency / C_eff)` where `C_eff = max(1, C)`; its work
//! rate relative to fully local access is `1 / ((1 - u) + u × L_new/L_local)`.
//! Over a horizon `H` the guest loses `H × (1 - rate)` seconds of work.
//!
//! Moving memory (QEMU pre-copy). Memory `M` over bandwidth `B` with the
//! guest dirtying `D` bytes/s sends about `M / (1 - D/B)` bytes (the
//! geometric series of rounds; infinite when `D >= B`, i.e. it does not
//! converge without throttling or post-copy) in that time, then pauses for
//! the target downtime. Moving the disk sends what the destination lacks
//! plus 8 bytes of fingerprint per 4 KiB block, plus what the guest writes
//! meanwhile. A teleport is the disk pre-copy, then the memory move; one
//! pause. During a move the guest runs at a fraction `MOVE_SLOWDOWN` of
//! its speed on memory moves (auto-converge throttling) and on disk moves
//! (its writes are tracked and may be throttled).

use crate::cluster::{Cluster, ClusterError, VmState};
use serde::Serialize;

/// Share of the guest's speed lost while it is being moved.
pub const MOVE_SLOWDOWN: f64 = 0.05;
/// Print bytes per 4 KiB block on the wire (an 8-byte key and its tag).
pub const FINGERPRINT_BYTES_PER_BLOCK: f64 = 9.0;
/// The pause a memory move aims at (s).
pub const TARGET_PAUSE_S: f64 = 0.3;

/// What a placement costs the guest over a horizon.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AccessCost {
    /// Per-request latency with the disk there (s).
    pub latency_s: f64,
    /// Work rate relative to local access (1 = no loss).
    pub rate: f64,
    /// Guest-seconds of work lost over the horizon.
    pub lost_s: f64,
}

/// A move, predicted.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MoveCost {
    pub seconds: f64,
    pub bytes: f64,
    pub pause_s: f64,
    /// Guest-seconds lost to the move itself (pause + slowdown while moving).
    pub lost_s: f64,
    /// False when the dirty rate outruns the link (it would need
    /// throttling or post-copy).
    pub converges: bool,
}

/// Per-request latency of `vm` with its disk across a link of `rtt_ms`
/// and `bandwidth`, from its latency measured at its current placement.
pub fn latency_at(vm: &VmState, current_rtt_ms: f64, current_bw: f64, rtt_ms: f64, bw: f64) -> f64 {
    let l = &vm.load;
    let measured = l.latency_ms / 1000.0;
    // The service time without the current link's share.
    let service = (measured - current_rtt_ms / 1000.0 - l.io_bytes / current_bw).max(50e-6);
    service + rtt_ms / 1000.0 + l.io_bytes / bw
}

/// The guest's access cost over `horizon_s` with its disk behind a link.
pub fn access_cost(
    vm: &VmState,
    cluster: &Cluster,
    disk_link_rtt_ms: f64,
    bw: f64,
    horizon_s: f64,
) -> Result<AccessCost, ClusterError> {
    let p = &vm.placement;
    let cur = cluster.link(&p.host_site, &p.disk_site)?;
    let local = cluster.link(&p.disk_site, &p.disk_site)?;
    let l_now = (vm.load.latency_ms / 1000.0).max(50e-6);
    let l_local = latency_at(vm, cur.rtt_ms, cur.bandwidth, local.rtt_ms, local.bandwidth);
    let l_new = latency_at(vm, cur.rtt_ms, cur.bandwidth, disk_link_rtt_ms, bw);
    // Requests in flight (at least one while it does I/O at all).
    let in_flight = (vm.load.iops * l_now).max(1.0);
    // Share of time blocked on I/O now, then scaled to local access.
    let u_now = (vm.load.iops * l_now / in_flight).min(1.0);
    let rate_of = |l: f64| 1.0 / ((1.0 - u_now) + u_now * l / l_now);
    let rate = rate_of(l_new) / rate_of(l_local);
    Ok(AccessCost {
        latency_s: l_new,
        rate,
        lost_s: horizon_s * (1.0 - rate).max(0.0),
    })
}

/// Moving the VM's memory across a link.
pub fn vm_move_cost(vm: &VmState, rtt_ms: f64, bw: f64) -> MoveCost {
    let (bytes, converges) = precopy_bytes(vm.memory_bytes, vm.load.dirty_rate, bw);
    let seconds = bytes / bw + 3.0 * rtt_ms / 1000.0;
    let pause = TARGET_PAUSE_S.min(seconds) + rtt_ms / 1000.0;
    move_cost(seconds, bytes, pause, converges)
}

/// Bytes a pre-copy of `base` bytes sends while `rate` bytes/s are
/// dirtied on a link of `bw`: the rounds' geometric series; past 80% of
/// the link it does not converge by itself, and the guest is throttled
/// down to 80% of the link.
fn precopy_bytes(base: f64, rate: f64, bw: f64) -> (f64, bool) {
    let converges = rate < 0.8 * bw;
    let eff = if converges { 1.0 - rate / bw } else { 0.2 };
    (base / eff, converges)
}

/// A move's cost from its duration, bytes and pause.
fn move_cost(seconds: f64, bytes: f64, pause_s: f64, converges: bool) -> MoveCost {
    MoveCost {
        seconds,
        bytes,
        pause_s,
        lost_s: pause_s + MOVE_SLOWDOWN * seconds,
        converges,
    }
}

/// Moving the VM's disk to `to` across a link.
pub fn disk_move_cost(vm: &VmState, to: &str, rtt_ms: f64, bw: f64) -> MoveCost {
    let missing = vm.missing_at.get(to).copied().unwrap_or(vm.disk_bytes);
    let prints = vm.disk_bytes / 4096.0 * FINGERPRINT_BYTES_PER_BLOCK;
    let (bytes, converges) = precopy_bytes(missing + prints, vm.load.write_rate, bw);
    let seconds = bytes / bw + 4.0 * rtt_ms / 1000.0;
    let pause = 0.05 + 2.0 * rtt_ms / 1000.0;
    move_cost(seconds, bytes, pause, converges)
}

/// Disk pre-copy, then memory; one pause (the longer of the two).
pub fn teleport_cost(vm: &VmState, to: &str, rtt_ms: f64, bw: f64) -> MoveCost {
    let d = disk_move_cost(vm, to, rtt_ms, bw);
    let m = vm_move_cost(vm, rtt_ms, bw);
    let pause = d.pause_s.max(m.pause_s) + rtt_ms / 1000.0;
    move_cost(
        d.seconds + m.seconds,
        d.bytes + m.bytes,
        pause,
        d.converges && m.converges,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Link, Placement, Site, VmLoad};

    fn cluster(rtt: f64) -> Cluster {
        Cluster {
            sites: vec![
                Site {
                    name: "a".into(),
                    cpu_capacity: 8.0,
                },
                Site {
                    name: "b".into(),
                    cpu_capacity: 8.0,
                },
            ],
            links: vec![Link {
                a: "a".into(),
                b: "b".into(),
                rtt_ms: rtt,
                bandwidth: 12.5e6,
            }],
            vms: vec![],
            local_rtt_ms: 0.1,
            link_index: Default::default(),
        }
    }

    fn vm(iops: f64, latency_ms: f64, remote: bool) -> VmState {
        VmState {
            name: "v".into(),
            placement: Placement {
                host_site: "a".into(),
                disk_site: if remote { "b" } else { "a" }.into(),
            },
            memory_bytes: 1e9,
            disk_bytes: 10e9,
            missing_at: [("a".to_string(), 1e9)].into(),
            load: VmLoad {
                iops,
                io_bytes: 4096.0,
                latency_ms,
                cpu: 0.5,
                dirty_rate: 1e6,
                write_rate: 1e5,
            },
            since_move_s: f64::INFINITY,
        }
    }

    #[test]
    fn an_io_bound_guest_loses_with_rtt_and_a_cpu_bound_one_barely() {
        let c = cluster(16.0);
        // Queue depth 1, every request waits a round trip: I/O bound.
        let io = vm(60.0, 16.5, true);
        let remote = access_cost(&io, &c, 16.0, 12.5e6, 3600.0).unwrap();
        assert!(remote.rate < 0.1, "{remote:?}");
        // Rare I/O: hardly any loss.
        let cpu = vm(0.5, 16.5, true);
        let r = access_cost(&cpu, &c, 16.0, 12.5e6, 3600.0).unwrap();
        assert!(r.rate > 0.99, "{r:?}");
        // Losses grow with the RTT.
        let r4 = access_cost(&io, &c, 4.0, 12.5e6, 3600.0).unwrap();
        assert!(r4.lost_s < remote.lost_s);
    }

    #[test]
    fn moves_cost_what_they_send() {
        let v = vm(60.0, 16.5, true);
        let m = vm_move_cost(&v, 20.0, 12.5e6);
        assert!(m.converges && (m.bytes - 1e9 / (1.0 - 0.08)).abs() < 1.0);
        let d = disk_move_cost(&v, "a", 20.0, 12.5e6);
        assert!(d.bytes < v.disk_bytes / 5.0, "only what is missing: {d:?}");
        let whole = disk_move_cost(&v, "c", 20.0, 12.5e6);
        assert!(whole.bytes > v.disk_bytes);
        let t = teleport_cost(&v, "a", 20.0, 12.5e6);
        assert!((t.seconds - (d.seconds + m.seconds)).abs() < 1e-9);
        let mut hot = v.clone();
        hot.load.dirty_rate = 20e6;
        assert!(!vm_move_cost(&hot, 20.0, 12.5e6).converges);
    }
}
