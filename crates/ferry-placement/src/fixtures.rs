//! Clusters for the crate's unit tests: two sites `a` and `b` with one
//! link, and a guest running at `a` with its disk at `b`, which each test
//! adjusts to what it checks.

use crate::cluster::{Cluster, Link, Placement, Site, VmLoad, VmState};

/// Sites `a` and `b` (8 CPUs each) joined by one link.
pub fn two_sites(rtt_ms: f64, bandwidth: f64, vms: Vec<VmState>) -> Cluster {
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
            rtt_ms,
            bandwidth,
        }],
        vms,
        local_rtt_ms: 0.1,
        hosts: Vec::new(),
        link_index: Default::default(),
    }
}

/// A guest at `a` whose disk is at `b`, doing `iops` 4 KiB requests of
/// `latency_ms` each; 256 MB of memory, a 4 GB disk, nothing sampled,
/// never moved.
pub fn remote_vm(name: &str, iops: f64, latency_ms: f64) -> VmState {
    VmState {
        name: name.into(),
        placement: Placement {
            host_site: "a".into(),
            disk_site: "b".into(),
        },
        memory_bytes: 256e6,
        disk_bytes: 4e9,
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
            iops,
            io_bytes: 4096.0,
            latency_ms,
            cpu: 1.0,
            dirty_rate: 1e6,
            write_rate: 2e5,
        },
        clients: Vec::new(),
        host: None,
        since_move_s: f64::INFINITY,
    }
}
