//! The pre-flight estimate of one named move (or of staying put behind a
//! link of another RTT): what `ferry control estimate` prints before an
//! operator moves a guest by hand, computed by the very functions the
//! policies decide with.

use crate::cluster::{Cluster, ClusterError, Placement};
use crate::model::{access_cost, client_cost, AccessCost, MoveCost};
use crate::policy::{cost_of, Action};
use serde::Serialize;
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum EstimateError {
    #[error("no VM {0} in the snapshot (is it running on a host of the inventory?)")]
    UnknownVm(String),
    #[error("no site {0}")]
    UnknownSite(String),
    #[error("{vm} already has {what} at site {site}: nothing to move")]
    AlreadyThere {
        vm: String,
        what: &'static str,
        site: String,
    },
    #[error("{vm} already has its {there} at site {site}: to move only its {other} there, ask --{flag}-to {site}")]
    HalfThere {
        vm: String,
        there: &'static str,
        other: &'static str,
        flag: &'static str,
        site: String,
    },
    #[error("the RTT must be zero or more and finite, got {0}")]
    BadRtt(f64),
    #[error(transparent)]
    Cluster(#[from] ClusterError),
}

/// What is asked: a move of the VM, its disk, or both to a site; or
/// nothing, to see its access cost behind a link of another RTT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Asked {
    Move(Action),
    Stay,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    pub vm: String,
    pub asked: Asked,
    pub from: Placement,
    pub to: Placement,
    /// The move's link (sites, RTT ms, bytes/s) as the snapshot has it
    /// (for staying put: the link between the guest and its disk).
    pub link_sites: (String, String),
    pub link_rtt_ms: f64,
    pub link_bandwidth: f64,
    /// None when nothing moves.
    pub cost: Option<MoveCost>,
    /// The guest's access now (from what its forwarder measured) and at
    /// the placement asked for, over `horizon_s`.
    pub access_now: AccessCost,
    pub access_then: AccessCost,
    /// Client-seconds its clients lose over `horizon_s` to its distance
    /// from them, now and at the placement asked for (0 without client
    /// traffic measured, or with the guest at its clients' site).
    pub clients_now_s: f64,
    pub clients_then_s: f64,
    pub horizon_s: f64,
}

/// Estimate `asked` for `vm`: `to_site` is where it goes (ignored for
/// [`Asked::Stay`]); `rtt_ms`, when given, replaces the RTT of the link
/// between where the guest runs and where its disk is afterwards (a
/// what-if: "and if the link were 16 ms?").
pub fn estimate(
    c: &Cluster,
    vm: &str,
    asked: Asked,
    to_site: &str,
    rtt_ms: Option<f64>,
    horizon_s: f64,
) -> Result<Estimate, EstimateError> {
    let v = c
        .vms
        .iter()
        .find(|v| v.name == vm)
        .ok_or_else(|| EstimateError::UnknownVm(vm.into()))?;
    if let Some(r) = rtt_ms {
        if !(r.is_finite() && r >= 0.0) {
            return Err(EstimateError::BadRtt(r));
        }
    }
    let from = v.placement.clone();
    let site = |s: &str| -> Result<String, EstimateError> {
        c.sites
            .iter()
            .find(|x| x.name == s)
            .map(|x| x.name.clone())
            .ok_or_else(|| EstimateError::UnknownSite(s.into()))
    };
    let there = |what, now: &str| -> Result<String, EstimateError> {
        let s = site(to_site)?;
        if s == now {
            return Err(EstimateError::AlreadyThere {
                vm: vm.into(),
                what,
                site: s,
            });
        }
        Ok(s)
    };
    let to = match asked {
        Asked::Stay => from.clone(),
        Asked::Move(Action::MoveVm) => Placement {
            host_site: there("its VM", &from.host_site)?,
            disk_site: from.disk_site.clone(),
        },
        Asked::Move(Action::MoveDisk) => Placement {
            host_site: from.host_site.clone(),
            disk_site: there("its disk", &from.disk_site)?,
        },
        // Both move, or it is not a teleport (the other moves say so).
        Asked::Move(Action::Teleport) => {
            let half = |there, other, flag| EstimateError::HalfThere {
                vm: vm.into(),
                there,
                other,
                flag,
                site: to_site.into(),
            };
            if from.host_site == to_site && from.disk_site != to_site {
                return Err(half("VM", "disk", "disk"));
            }
            if from.disk_site == to_site && from.host_site != to_site {
                return Err(half("disk", "VM", "vm"));
            }
            let s = there("its VM", &from.host_site)?;
            Placement {
                host_site: s.clone(),
                disk_site: there("its disk", &from.disk_site)?,
            }
        }
    };
    let now_link = c.link(&from.host_site, &from.disk_site)?;
    let (cost, link, link_sites) = match asked {
        Asked::Stay => (
            None,
            now_link.clone(),
            (from.host_site.clone(), from.disk_site.clone()),
        ),
        Asked::Move(a) => {
            let (x, y) = match a {
                Action::MoveDisk => (&from.disk_site, &to.disk_site),
                _ => (&from.host_site, &to.host_site),
            };
            (
                Some(cost_of(c, v, a, &to)?),
                c.link(x, y)?,
                (x.clone(), y.clone()),
            )
        }
    };
    let access_now = access_cost(v, c, now_link.rtt_ms, now_link.bandwidth, horizon_s)?;
    let then_link = c.link(&to.host_site, &to.disk_site)?;
    let access_then = access_cost(
        v,
        c,
        rtt_ms.unwrap_or(then_link.rtt_ms),
        then_link.bandwidth,
        horizon_s,
    )?;
    let clients_now_s = client_cost(v, c, &from.host_site, horizon_s)?;
    let clients_then_s = client_cost(v, c, &to.host_site, horizon_s)?;
    Ok(Estimate {
        vm: vm.into(),
        asked,
        from,
        to,
        link_sites,
        link_rtt_ms: link.rtt_ms,
        link_bandwidth: link.bandwidth,
        cost,
        access_now,
        access_then,
        clients_now_s,
        clients_then_s,
        horizon_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Link, Site, VmLoad, VmState};

    fn two_sites() -> Cluster {
        let site = |n: &str| Site {
            name: n.into(),
            cpu_capacity: 8.0,
        };
        Cluster {
            sites: vec![site("a"), site("b")],
            links: vec![Link {
                a: "a".into(),
                b: "b".into(),
                rtt_ms: 16.0,
                bandwidth: 12.5e6,
            }],
            vms: vec![VmState {
                name: "g".into(),
                placement: Placement {
                    host_site: "a".into(),
                    disk_site: "b".into(),
                },
                memory_bytes: 256e6,
                disk_bytes: 128e6,
                missing_at: [("a".to_string(), 64e6)].into(),
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
                    iops: 55.0,
                    io_bytes: 4096.0,
                    latency_ms: 17.0,
                    cpu: 0.2,
                    dirty_rate: 0.0,
                    write_rate: 1e5,
                },
                clients: Vec::new(),
                host: None,
                since_move_s: f64::INFINITY,
            }],
            local_rtt_ms: 0.1,
            hosts: Vec::new(),
            link_index: Default::default(),
        }
    }

    #[test]
    fn each_move_is_priced_on_its_own_link_and_the_guest_gains_locally() {
        let c = two_sites();
        let vm = estimate(&c, "g", Asked::Move(Action::MoveVm), "b", None, 600.0).unwrap();
        assert_eq!(vm.to.host_site, "b");
        assert_eq!(vm.to.disk_site, "b");
        assert!(vm.cost.unwrap().bytes >= 256e6 * crate::model::MEMORY_LINK_SHARE);
        assert!(
            vm.access_then.rate > 0.9 && vm.access_now.rate < 0.2,
            "{vm:?}"
        );
        let d = estimate(&c, "g", Asked::Move(Action::MoveDisk), "a", None, 600.0).unwrap();
        assert!(d.cost.unwrap().bytes < 128e6, "only what a lacks: {d:?}");
        // A teleport moves both: from b/b to a.
        let mut both = c.clone();
        both.vms[0].placement.host_site = "b".into();
        let t = estimate(&both, "g", Asked::Move(Action::Teleport), "a", None, 600.0).unwrap();
        assert!(t.cost.unwrap().seconds > d.cost.unwrap().seconds);
        assert!(t.cost.unwrap().pause_s > vm.cost.unwrap().pause_s);
        // From a/b, the VM is already there: the error names the move
        // that would do (the disk's).
        let e = estimate(&c, "g", Asked::Move(Action::Teleport), "a", None, 600.0).unwrap_err();
        assert!(matches!(e, EstimateError::HalfThere { flag: "disk", .. }));
        assert!(e.to_string().contains("--disk-to a"), "{e}");
    }

    #[test]
    fn staying_behind_a_slower_link_costs_more() {
        let c = two_sites();
        let at4 = estimate(&c, "g", Asked::Stay, "", Some(4.0), 600.0).unwrap();
        let at16 = estimate(&c, "g", Asked::Stay, "", None, 600.0).unwrap();
        assert!(at4.cost.is_none());
        assert!(at4.access_then.latency_s < at16.access_then.latency_s);
        assert!((at16.access_then.rate - at16.access_now.rate).abs() < 1e-9);
        assert!(
            at4.access_then.rate > at16.access_then.rate * 2.0,
            "{at4:?}"
        );
    }

    #[test]
    fn impossible_asks_get_clear_errors() {
        let c = two_sites();
        let e = |a, s: &str, r| estimate(&c, "g", a, s, r, 600.0).unwrap_err();
        assert_eq!(
            e(Asked::Move(Action::MoveVm), "x", None),
            EstimateError::UnknownSite("x".into())
        );
        assert!(matches!(
            e(Asked::Move(Action::MoveVm), "a", None),
            EstimateError::AlreadyThere { .. }
        ));
        assert!(matches!(
            e(Asked::Move(Action::MoveDisk), "b", None),
            EstimateError::AlreadyThere { .. }
        ));
        assert_eq!(e(Asked::Stay, "", Some(-1.0)), EstimateError::BadRtt(-1.0));
        assert_eq!(
            estimate(&c, "nope", Asked::Stay, "", None, 1.0).unwrap_err(),
            EstimateError::UnknownVm("nope".into())
        );
    }
}
