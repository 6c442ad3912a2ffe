//! A real cluster replayed in simulation: from a snapshot the controller
//! measured (`ferry control plan --save-snapshot`), with the links' RTTs
//! changed at the times a real run changed them, the controller's own
//! core ([`cycle::drive`](crate::cycle::drive)) decides at every tick,
//! moves in flight counted as the service counts them. Each
//! guest's load follows its placement through the model: its per-request
//! latency from [`latency_at`], its request rate scaled by the access
//! rate of [`access_cost`] (both against what the snapshot measured), so
//! the replay predicts what a real run measures: when the controller acts,
//! what it moves at what cost, and each guest's I/O rate before and after.
//! A decided move takes the predicted time; the guest's I/O follows the
//! new placement once it has ended.

use crate::cluster::{Cluster, ClusterError, Placement, VmState};
use crate::cycle::{drive, ControllerCore, DriveError, Ended, NoJournal, World};
use crate::model::{access_cost, latency_at};
use crate::policy::{Action, Decision, Policy};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A link's RTT set to `rtt_ms` at `at_s` seconds into the replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RttChange {
    pub at_s: f64,
    pub a: String,
    pub b: String,
    pub rtt_ms: f64,
}

impl std::str::FromStr for RttChange {
    type Err = String;

    /// `T:A-B=MS`, e.g. `30:home-cloud=16`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || format!("{s:?}: expected SECONDS:SITE-SITE=RTT_MS, e.g. 30:a-b=16");
        let (at, rest) = s.split_once(':').ok_or_else(bad)?;
        let (sites, rtt) = rest.split_once('=').ok_or_else(bad)?;
        let (a, b) = sites.split_once('-').ok_or_else(bad)?;
        let at_s: f64 = at.trim().parse().map_err(|_| bad())?;
        let rtt_ms: f64 = rtt.trim().parse().map_err(|_| bad())?;
        if !(at_s.is_finite() && at_s >= 0.0 && rtt_ms.is_finite() && rtt_ms >= 0.0) {
            return Err(format!("{s:?}: the time and the RTT must be 0 or more"));
        }
        Ok(RttChange {
            at_s,
            a: a.trim().into(),
            b: b.trim().into(),
            rtt_ms,
        })
    }
}

/// One guest at one tick, as the replay predicts it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GuestAt {
    pub vm: String,
    pub placement: Placement,
    /// Disk requests per second.
    pub iops: f64,
    /// Its I/O rate relative to the snapshot's (1 = as measured then).
    pub rate_vs_snapshot: f64,
    pub latency_ms: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayTick {
    pub t_s: f64,
    pub guests: Vec<GuestAt>,
}

/// A move the policy decided during the replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayMove {
    /// When it was decided, and when it ended (decided + predicted time,
    /// longer when moves in flight shared its link; one still running at
    /// the end of the replay: decided + predicted time).
    pub decided_s: f64,
    pub ends_s: f64,
    pub vm: String,
    pub action: Action,
    pub from: Placement,
    pub to: Placement,
    pub bytes: f64,
    pub seconds: f64,
    pub pause_s: f64,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Replay {
    pub ticks: Vec<ReplayTick>,
    pub moves: Vec<ReplayMove>,
}

/// Replay `snapshot` for `ticks` ticks of `tick_s` seconds under `policy`
/// with the RTT `changes`. An unknown site in a change, or a snapshot
/// whose guests sit on sites without a link, is an error.
pub fn replay(
    snapshot: &Cluster,
    policy: &Policy,
    ticks: usize,
    tick_s: f64,
    changes: &[RttChange],
) -> Result<Replay, ClusterError> {
    for ch in changes {
        snapshot.link(&ch.a, &ch.b)?;
    }
    // In time order, each applied once when due (a later change of the
    // same link wins, whatever order they were given in).
    let mut changes = changes.to_vec();
    changes.sort_by(|x, y| x.at_s.total_cmp(&y.at_s));
    let mut due = changes.iter().peekable();
    let mut core = ControllerCore::default();
    let mut w = Replayed {
        c: snapshot.clone(),
        moves: Vec::new(),
        pending: Vec::new(),
        done: Vec::new(),
        clock: 0.0,
    };
    let mut out_ticks = Vec::with_capacity(ticks);
    for tick in 0..ticks {
        #[allow(clippy::cast_precision_loss)]
        let now = tick as f64 * tick_s;
        while let Some(ch) = due.next_if(|ch| ch.at_s <= now) {
            for l in &mut w.c.links {
                if (l.a == ch.a && l.b == ch.b) || (l.a == ch.b && l.b == ch.a) {
                    l.rtt_ms = ch.rtt_ms;
                }
            }
        }
        w.arrive(now);
        let c = &mut w.c;
        let guests = snapshot
            .vms
            .iter()
            .zip(&c.vms)
            .map(|(base, v)| follow(base, snapshot, c, &v.placement))
            .collect::<Result<Vec<_>, _>>()?;
        for (v, g) in c.vms.iter_mut().zip(&guests) {
            v.load.iops = g.iops;
            v.load.latency_ms = g.latency_ms;
        }
        out_ticks.push(ReplayTick { t_s: now, guests });
        match drive(&mut core, &mut w, &mut NoJournal, policy, now, true) {
            Ok(_) => {}
            Err(DriveError::Plan(e)) => return Err(e),
            Err(DriveError::Measure(e)) => unreachable!("the replay measures itself: {e}"),
        }
        for v in &mut w.c.vms {
            v.since_move_s += tick_s;
        }
    }
    Ok(Replay {
        ticks: out_ticks,
        moves: w.moves,
    })
}

/// The replayed cluster as the core's world: a move takes its predicted
/// time, except that moves in flight on one link share its bandwidth; its
/// guest's I/O follows the new placement once it has ended.
struct Replayed {
    c: Cluster,
    moves: Vec<ReplayMove>,
    /// Moves decided and not yet ended.
    pending: Vec<Flight>,
    done: Vec<Ended>,
    /// How far the moves in flight have been stepped (seconds).
    clock: f64,
}

/// A move in flight in the replay: its fixed part (set-up, the switch)
/// still to run, then the bytes it still has to send over its link, which
/// it shares equally with the other moves sending on that link.
struct Flight {
    /// Index into `moves`.
    idx: usize,
    link: (String, String),
    fixed_left: f64,
    bytes_left: f64,
}

/// Bytes left below this count as sent (rounding).
const SENT: f64 = 1.0;

impl Replayed {
    /// Each link's bandwidth share per move sending on it now.
    fn shares(&self) -> BTreeMap<(String, String), f64> {
        let mut n: BTreeMap<(String, String), usize> = BTreeMap::new();
        for f in self.pending.iter().filter(|f| f.fixed_left <= 0.0) {
            *n.entry(f.link.clone()).or_default() += 1;
        }
        n.into_iter()
            .map(|(l, k)| {
                let bw = self
                    .c
                    .link(&l.0, &l.1)
                    .map_or(f64::INFINITY, |x| x.bandwidth);
                #[allow(clippy::cast_precision_loss)]
                let share = bw / k as f64;
                (l, share)
            })
            .collect()
    }

    /// Step the moves in flight to `now`, event by event (a fixed part
    /// ending, a move's last byte sent); the moves that end take effect.
    fn arrive(&mut self, now: f64) {
        while !self.pending.is_empty() && self.clock < now {
            let shares = self.shares();
            let until = |f: &Flight| {
                if f.fixed_left > 0.0 {
                    f.fixed_left
                } else {
                    f.bytes_left.max(0.0) / shares[&f.link]
                }
            };
            let next = self.pending.iter().map(until).fold(f64::INFINITY, f64::min);
            let dt = next.min(now - self.clock);
            for f in &mut self.pending {
                if f.fixed_left > 0.0 {
                    f.fixed_left -= dt;
                } else {
                    f.bytes_left -= shares[&f.link] * dt;
                }
            }
            self.clock += dt;
            let (moves, c, done, clock) =
                (&mut self.moves, &mut self.c, &mut self.done, self.clock);
            self.pending.retain(|f| {
                if f.fixed_left > 1e-9 || f.bytes_left > SENT {
                    return true;
                }
                let m = &mut moves[f.idx];
                m.ends_s = clock;
                if let Some(v) = c.vms.iter_mut().find(|v| v.name == m.vm) {
                    v.placement = m.to.clone();
                }
                done.push(Ended {
                    vm: m.vm.clone(),
                    completed: true,
                    reason: None,
                    at_s: clock,
                });
                false
            });
        }
        self.clock = now;
    }
}

impl World for Replayed {
    fn measure(&mut self, _now: f64) -> Result<Cluster, String> {
        Ok(self.c.clone())
    }

    fn start(&mut self, d: &Decision, now: f64) -> Result<(), String> {
        let Some(v) = self.c.vms.iter_mut().find(|v| v.name == d.vm) else {
            return Err(format!("no guest {}", d.vm));
        };
        v.since_move_s = 0.0;
        v.home_site = crate::cluster::home_after_move(
            v.home_site.take(),
            d.burst_from.as_deref(),
            &d.to.host_site,
        );
        // The link its bytes cross (the hosts', or the disks' when the
        // guest stays), and its fixed part: what its predicted time holds
        // beyond sending its bytes at that link's bandwidth.
        let link = if d.from.host_site == d.to.host_site {
            (d.from.disk_site.clone(), d.to.disk_site.clone())
        } else {
            (d.from.host_site.clone(), d.to.host_site.clone())
        };
        let link = if link.0 <= link.1 {
            link
        } else {
            (link.1, link.0)
        };
        let bw = self
            .c
            .link(&link.0, &link.1)
            .map_or(f64::INFINITY, |l| l.bandwidth);
        self.clock = self.clock.max(now);
        self.pending.push(Flight {
            idx: self.moves.len(),
            link,
            fixed_left: (d.cost.seconds - d.cost.bytes / bw).max(0.0),
            bytes_left: d.cost.bytes,
        });
        self.moves.push(ReplayMove {
            decided_s: now,
            ends_s: now + d.cost.seconds,
            vm: d.vm.clone(),
            action: d.action,
            from: d.from.clone(),
            to: d.to.clone(),
            bytes: d.cost.bytes,
            seconds: d.cost.seconds,
            pause_s: d.cost.pause_s,
            reason: d.reason.clone(),
        });
        Ok(())
    }

    fn cancel(&mut self, _vm: &str, _why: &str) {}

    fn ended(&mut self, _now: f64) -> Vec<Ended> {
        std::mem::take(&mut self.done)
    }
}

/// What guest `base` (as the snapshot measured it) does at `placement`
/// over the links of `now`.
fn follow(
    base: &VmState,
    snapshot: &Cluster,
    now: &Cluster,
    placement: &Placement,
) -> Result<GuestAt, ClusterError> {
    let was = snapshot.link(&base.placement.host_site, &base.placement.disk_site)?;
    let is = now.link(&placement.host_site, &placement.disk_site)?;
    let at_snapshot = access_cost(base, snapshot, was.rtt_ms, was.bandwidth, 1.0)?;
    let here = access_cost(base, snapshot, is.rtt_ms, is.bandwidth, 1.0)?;
    let ratio = if at_snapshot.rate > 0.0 {
        here.rate / at_snapshot.rate
    } else {
        1.0
    };
    let latency = latency_at(base, was.rtt_ms, was.bandwidth, is.rtt_ms, is.bandwidth);
    Ok(GuestAt {
        vm: base.name.clone(),
        placement: placement.clone(),
        iops: base.load.iops * ratio,
        rate_vs_snapshot: ratio,
        latency_ms: latency * 1000.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sites 0.5 ms apart; an I/O-bound guest at `a` with its disk
    /// at `b`, one request in flight, measured at 0.9 ms per request; and
    /// a CPU-bound guest in the same spot.
    fn two_sites() -> Cluster {
        let vm = |name: &str, iops: f64| {
            let mut v = crate::fixtures::remote_vm(name, iops, 0.9);
            v.memory_bytes = 128e6;
            v.disk_bytes = 128e6;
            v.missing_at = [("a".to_string(), 50e6)].into();
            v.nonzero_share = Some(0.4);
            v.load.cpu = 0.5;
            v.load.write_rate = 1e5;
            v
        };
        crate::fixtures::two_sites(0.5, 25e6, vec![vm("io", 1000.0), vm("cpu", 2.0)])
    }

    /// Guest `vm` as the replay saw it at `t` seconds.
    fn guest_at(r: &Replay, t: f64, vm: &str) -> GuestAt {
        r.ticks
            .iter()
            .find(|x| (x.t_s - t).abs() < 1e-9)
            .unwrap()
            .guests
            .iter()
            .find(|g| g.vm == vm)
            .unwrap()
            .clone()
    }

    #[test]
    fn moves_in_flight_on_one_link_share_its_bandwidth() {
        // Two I/O-bound guests, 16 ms from their disks: both move at once.
        let vms = vec![
            crate::fixtures::remote_vm("v0", 55.0, 16.3),
            crate::fixtures::remote_vm("v1", 55.0, 16.3),
        ];
        let c = crate::fixtures::two_sites(16.0, 12.5e6, vms);
        let alone = replay(
            &Cluster {
                vms: c.vms[..1].to_vec(),
                ..c.clone()
            },
            &Policy::default(),
            200,
            0.5,
            &[],
        )
        .unwrap();
        let both = replay(&c, &Policy::default(), 200, 0.5, &[]).unwrap();
        let m = &alone.moves[0];
        assert!(
            (m.ends_s - m.decided_s - m.seconds).abs() < 1e-6,
            "alone: {m:?}"
        );
        assert_eq!(both.moves.len(), 2);
        let fixed = m.seconds - m.bytes / 12.5e6;
        for m2 in &both.moves {
            // Each sends its bytes at half the link: fixed + 2 × bytes / bw.
            let expect = m2.decided_s + fixed + 2.0 * m2.bytes / 12.5e6;
            assert!((m2.ends_s - expect).abs() < 1e-6, "{m2:?} vs {expect}");
        }
    }

    #[test]
    fn a_rise_of_the_rtt_slows_the_io_bound_guest_until_the_policy_moves_it() {
        let c = two_sites();
        let policy = Policy {
            latency_trigger_ms: 5.0,
            hold_s: 6.0,
            ..Policy::default()
        };
        let rise: RttChange = "10:b-a=16".parse().unwrap();
        let r = replay(&c, &policy, 30, 2.0, &[rise]).unwrap();
        let at = |t: f64, vm: &str| guest_at(&r, t, vm);
        // Before the rise: as measured.
        let before = at(8.0, "io");
        assert!((before.rate_vs_snapshot - 1.0).abs() < 1e-9, "{before:?}");
        // After it, before any move: slower, latency up by about 15.5 ms.
        let slow = at(12.0, "io");
        assert!(slow.rate_vs_snapshot < 0.2, "{slow:?}");
        assert!((slow.latency_ms - 16.4).abs() < 0.5, "{slow:?}");
        // Only the I/O-bound guest is moved, after the hold, not before.
        assert_eq!(r.moves.len(), 1, "{:?}", r.moves);
        let m = &r.moves[0];
        assert_eq!(m.vm, "io");
        assert!(
            m.decided_s >= 10.0 + 6.0 && m.decided_s <= 10.0 + 6.0 + 2.0,
            "{m:?}"
        );
        // Once the move has ended, its disk (or itself) is local: faster
        // than measured at 0.5 ms.
        let t_after = (m.ends_s / 2.0).ceil() * 2.0 + 2.0;
        let after = at(t_after, "io");
        assert_eq!(after.placement.host_site, after.placement.disk_site);
        assert!(after.rate_vs_snapshot > 1.0, "{after:?}");
        // The CPU-bound guest barely notices the rise and stays.
        let cpu = at(40.0 - 2.0, "cpu");
        assert!(cpu.rate_vs_snapshot > 0.95, "{cpu:?}");
        assert_eq!(cpu.placement.disk_site, "b");
    }

    #[test]
    fn changes_apply_in_time_order_whatever_order_they_are_given_in() {
        let c = two_sites();
        // A trigger never reached: nothing moves, the latency follows the link.
        let still = Policy {
            latency_trigger_ms: 1000.0,
            hold_s: 1000.0,
            ..Policy::default()
        };
        let back: RttChange = "20:a-b=0.5".parse().unwrap();
        let rise: RttChange = "10:a-b=16".parse().unwrap();
        let r = replay(&c, &still, 15, 2.0, &[back, rise]).unwrap();
        assert!(r.moves.is_empty(), "{:?}", r.moves);
        let io_ms = |t: f64| guest_at(&r, t, "io").latency_ms;
        assert!((io_ms(8.0) - 0.9).abs() < 1e-6);
        assert!((io_ms(12.0) - 16.4).abs() < 0.5);
        assert!((io_ms(22.0) - 0.9).abs() < 1e-6, "{}", io_ms(22.0));
    }

    #[test]
    fn changes_are_checked() {
        let c = two_sites();
        assert!("x".parse::<RttChange>().is_err());
        assert!("1:a-b".parse::<RttChange>().is_err());
        assert!("1:ab=3".parse::<RttChange>().is_err());
        assert!("-1:a-b=3".parse::<RttChange>().is_err());
        assert!("1:a-b=nan".parse::<RttChange>().is_err());
        let unknown: RttChange = "1:a-z=3".parse().unwrap();
        assert!(replay(&c, &Policy::default(), 3, 1.0, &[unknown]).is_err());
    }
}
