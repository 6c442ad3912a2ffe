//! What the controller knows: sites, the links between them, and each VM
//! with its placement and measured load (a snapshot; JSON for
//! `ferry control plan --cluster FILE`).

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use thiserror::Error;

#[derive(Debug, Error, PartialEq)]
pub enum ClusterError {
    #[error("VM {vm}: unknown site {site}")]
    UnknownSite { vm: String, site: String },
    #[error("no link between sites {0} and {1}")]
    NoLink(String, String),
    #[error("{what} must be {rule}, got {value}")]
    Impossible {
        what: String,
        rule: &'static str,
        value: f64,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Site {
    pub name: String,
    /// vCPUs the site's hosts can run.
    pub cpu_capacity: f64,
}

/// One host of a site and what it can run. A site that lists none is
/// one pool of CPUs (its `cpu_capacity`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Host {
    /// How the controller names it (its control API address).
    pub name: String,
    pub site: String,
    /// vCPUs it runs guests on.
    pub cpu_capacity: f64,
    /// Guest memory it can hold (bytes); absent: not limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<f64>,
}

/// A link between two sites, as measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub a: String,
    pub b: String,
    pub rtt_ms: f64,
    /// Bytes per second.
    pub bandwidth: f64,
}

/// Where a VM runs and where its disk lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub host_site: String,
    pub disk_site: String,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.host_site == self.disk_site {
            write!(f, "VM and disk at {}", self.host_site)
        } else {
            write!(f, "VM at {}, disk at {}", self.host_site, self.disk_site)
        }
    }
}

/// A VM's load as its host measured it (forwarder and QEMU).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmLoad {
    /// Disk requests per second.
    pub iops: f64,
    /// Mean bytes per request.
    pub io_bytes: f64,
    /// Mean request latency now (ms), as the forwarder answered.
    pub latency_ms: f64,
    /// vCPUs busy (CPU seconds per second).
    pub cpu: f64,
    /// Guest memory dirtied per second (bytes), QEMU's estimate.
    pub dirty_rate: f64,
    /// Disk bytes written per second.
    pub write_rate: f64,
}

/// One completed move's guest pause (s), the round trip (s) of the link
/// its memory crossed and the guest's memory (bytes), as its host kept
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MovePause {
    pub pause_s: f64,
    pub rtt_s: f64,
    pub memory_bytes: f64,
}

/// A guest's exchanges with clients that sit at one site (measured at
/// its network cards, on the networks whose clients the inventory places
/// there).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientTraffic {
    /// Where those clients are.
    pub site: String,
    /// Request/answer exchanges per second: the smaller of the packets in
    /// and out per second (an exchange needs at least one each way).
    pub exchanges_per_s: f64,
    /// Bytes per second, both directions.
    pub bytes_per_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmState {
    pub name: String,
    pub placement: Placement,
    pub memory_bytes: f64,
    pub disk_bytes: f64,
    /// For each site, the disk bytes that site lacks (from a sample of the
    /// volume's fingerprints asked of its index); absent: all of it.
    #[serde(default)]
    pub missing_at: BTreeMap<String, f64>,
    /// For each site, the link bytes of the data it lacks: the sample's
    /// missing blocks, each at its stream cost (what a disk's return sends,
    /// the blocks written since it left, compresses unlike the rest);
    /// absent: `missing_at` × `disk_link_share`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub missing_link_at: BTreeMap<String, f64>,
    /// Sites holding the copy the disk left when it moved away: a disk move
    /// there is a return, whose basis is that copy (it rebuilds nothing
    /// from the site's other blocks).
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub copy_at: BTreeSet<String>,
    /// Sites whose storage daemon shares the extents of the blocks it
    /// holds with the volume a move brings (its pool's file system shares
    /// extents): it rebuilds them at `model::LOCAL_SHARE_BPS`, not
    /// `model::LOCAL_REBUILD_BPS`.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub shares_extents_at: BTreeSet<String>,
    /// For each site whose storage daemon has measured it (from its own
    /// recent incoming migrations), the bytes per second at which it
    /// rebuilds blocks it holds into the volume a move brings; absent: the
    /// model's constant for its kind of pool.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rebuild_bps_at: BTreeMap<String, f64>,
    /// For each site where a disk move prints fewer than the disk's
    /// non-zero bytes, the bytes it prints: a return to the copy the disk
    /// left there, when its daemon here tracked what was written since it
    /// arrived, prints only that; absent: every non-zero byte.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub printed_at: BTreeMap<String, f64>,
    /// Share of the disk's blocks that are not zero (from the same
    /// sample; only those are fingerprinted on a move); absent: all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nonzero_share: Option<f64>,
    /// Link bytes a memory move sends per byte of `memory_bytes`, from a
    /// sample of the guest's pages its host took; absent: the calibrated
    /// constant (`model::MEMORY_LINK_SHARE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_link_share: Option<f64>,
    /// Raw bytes per second a memory move from its host streams where the
    /// machine, not the link, binds it, as that host measured its own
    /// recent moves; absent: `model::MACHINE_STREAM_RAW_BPS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_stream_bps: Option<f64>,
    /// The fixed time of a memory move from its host besides its stream,
    /// pause and round trips, as that host measured its own recent moves;
    /// absent: `model::VM_MOVE_SETUP_S`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_move_setup_s: Option<f64>,
    /// How busy a memory move from its host keeps a link that holds it
    /// back (link bytes over the stream's span, over the largest delivery
    /// rate it saw), as that host measured its own recent moves: the
    /// stream's time on a link is its bytes over the link's rate times
    /// this; absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_link_efficiency: Option<f64>,
    /// The pauses of its host's recent VM-only moves, each with its
    /// link's round trip and its guest's memory, as that host measured
    /// them: the model prices a VM-only pause from there at what is left
    /// of them besides its own terms for the link and the memory
    /// (`model::vm_pause_base_s`); empty: `model::VM_PAUSE_BASE_S`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vm_move_pauses: Vec<MovePause>,
    /// The same of its host's recent teleports; empty: the VM-only base
    /// and the disks' terms (`model::teleport_cost`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub teleport_pauses: Vec<MovePause>,
    /// How long a switch of its disk's storage daemon holds writes besides
    /// the link's round trip (s), as that daemon measured its own recent
    /// switches as a migration's source; absent: `model::DISK_PAUSE_BASE_S`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_switch_hold_s: Option<f64>,
    /// Its disk's storage daemon's recent switch holds as a migration's
    /// source, each besides the link's round trip (s, oldest first): the
    /// model prices the hold at their median with
    /// `model::DISK_PAUSE_BASE_S` counted as one of them while they are
    /// few (`model::disk_switch_hold_s`); where there are any, they, not
    /// `disk_switch_hold_s`, price it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_switch_holds_s: Vec<f64>,
    /// What its disk's storage daemon's recent small moves as a
    /// migration's source took besides their round trips and pause (s,
    /// oldest first): the fixed work of a disk move from there, priced at
    /// their median with `model::DISK_MOVE_SETUP_S` counted as one of them
    /// while they are few (`model::disk_move_setup_s`); empty: the
    /// constant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_move_setups_s: Vec<f64>,
    /// What its host's own part of its recent disk-only moves took (s,
    /// oldest first): each move's time less its disks' migrations, as
    /// that host measured it; a disk move that host drives is priced with
    /// their median added (`model::disk_move_host_s`), with
    /// `model::DISK_MOVE_HOST_S` counted as one of them while they are
    /// few; empty: the constant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_move_host_s: Vec<f64>,
    /// Link bytes a disk move sends per byte of data the destination
    /// lacks (the sample's non-zero blocks as the migration's stream
    /// compresses them); absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_link_share: Option<f64>,
    /// The accelerator its QEMU runs with ("kvm", "tcg"), as its host
    /// says: an emulated (TCG) guest's vCPU thread burns CPU while the
    /// guest waits on its disk, and less of it once the disk is nearer
    /// (`model::TCG_WAIT_CPU_SHARE`); absent: as KVM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accel: Option<String>,
    pub load: VmLoad,
    /// Its traffic with clients, per site where they are (empty: none
    /// known; the model then prices only its disk).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clients: Vec<ClientTraffic>,
    /// The site it burst from, while it runs away from it (the
    /// controller's journal knows); it goes back when that site has room.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home_site: Option<String>,
    /// The host it runs on, when the snapshot names its site's hosts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Seconds since its last move (for cooldown and minimum stay); never
    /// moved is infinite, written `null` (JSON has no infinity).
    #[serde(default = "long_ago", deserialize_with = "null_is_long_ago")]
    pub since_move_s: f64,
}

fn long_ago() -> f64 {
    f64::INFINITY
}

/// Where a guest belongs after a completed move that took its host to
/// `to_host_site`: a burst (`burst_from`) makes that site its home, a move
/// back home clears it, any other move keeps it. The controller replays
/// its journal with this; the simulator applies it as it goes.
pub fn home_after_move(
    home: Option<String>,
    burst_from: Option<&str>,
    to_host_site: &str,
) -> Option<String> {
    match burst_from {
        Some(h) => Some(h.to_string()),
        None => home.filter(|h| h != to_host_site),
    }
}

fn null_is_long_ago<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::INFINITY))
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub sites: Vec<Site>,
    pub links: Vec<Link>,
    pub vms: Vec<VmState>,
    /// The sites' hosts (absent: each site is one pool of CPUs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<Host>,
    /// Local access latency added per request on the same site (ms).
    #[serde(default = "local_rtt")]
    pub local_rtt_ms: f64,
    /// Links by their two sites, built at the first lookup.
    #[serde(skip)]
    pub link_index: std::sync::OnceLock<std::collections::HashMap<(String, String), usize>>,
}

fn local_rtt() -> f64 {
    0.1
}

fn positive(what: String, v: f64) -> Result<(), ClusterError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ClusterError::Impossible {
            what,
            rule: "positive and finite",
            value: v,
        })
    }
}

/// Whether `v` is a share of something: above zero, at most one (not NaN).
pub fn is_share(v: f64) -> bool {
    v > 0.0 && v <= 1.0
}

fn share(what: String, v: f64) -> Result<(), ClusterError> {
    if is_share(v) {
        Ok(())
    } else {
        Err(ClusterError::Impossible {
            what,
            rule: "above zero and at most one",
            value: v,
        })
    }
}

fn non_negative(what: String, v: f64) -> Result<(), ClusterError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(ClusterError::Impossible {
            what,
            rule: "zero or more and finite",
            value: v,
        })
    }
}

impl Cluster {
    /// The link between two sites (same site: the local one).
    pub fn link(&self, a: &str, b: &str) -> Result<Link, ClusterError> {
        if a == b {
            return Ok(Link {
                a: a.into(),
                b: b.into(),
                rtt_ms: self.local_rtt_ms,
                bandwidth: 1.25e9,
            });
        }
        let idx = self.link_index.get_or_init(|| {
            let mut m = std::collections::HashMap::new();
            for (i, l) in self.links.iter().enumerate() {
                m.insert((l.a.clone(), l.b.clone()), i);
                m.insert((l.b.clone(), l.a.clone()), i);
            }
            m
        });
        idx.get(&(a.to_string(), b.to_string()))
            .map(|i| self.links[*i].clone())
            .ok_or_else(|| ClusterError::NoLink(a.into(), b.into()))
    }

    /// Refuse a snapshot the model cannot reason about.
    pub fn validate(&self) -> Result<(), ClusterError> {
        for s in &self.sites {
            non_negative(format!("site {} cpu_capacity", s.name), s.cpu_capacity)?;
        }
        for l in &self.links {
            non_negative(format!("link {}-{} rtt_ms", l.a, l.b), l.rtt_ms)?;
            positive(format!("link {}-{} bandwidth", l.a, l.b), l.bandwidth)?;
        }
        let known = |s: &str| self.sites.iter().any(|x| x.name == s);
        for h in &self.hosts {
            if !known(&h.site) {
                return Err(ClusterError::UnknownSite {
                    vm: format!("host {}", h.name),
                    site: h.site.clone(),
                });
            }
            non_negative(format!("host {} cpu_capacity", h.name), h.cpu_capacity)?;
            if let Some(m) = h.memory_bytes {
                non_negative(format!("host {} memory_bytes", h.name), m)?;
            }
        }
        for v in &self.vms {
            for s in [&v.placement.host_site, &v.placement.disk_site] {
                if !known(s) {
                    return Err(ClusterError::UnknownSite {
                        vm: v.name.clone(),
                        site: s.clone(),
                    });
                }
            }
            positive(format!("VM {} memory_bytes", v.name), v.memory_bytes)?;
            positive(format!("VM {} disk_bytes", v.name), v.disk_bytes)?;
            for (site, &bps) in &v.rebuild_bps_at {
                positive(format!("VM {} rebuild_bps_at {site}", v.name), bps)?;
            }
            if let Some(bps) = v.memory_stream_bps {
                positive(format!("VM {} memory_stream_bps", v.name), bps)?;
            }
            if let Some(s) = v.memory_move_setup_s {
                non_negative(format!("VM {} memory_move_setup_s", v.name), s)?;
            }
            if let Some(e) = v.memory_link_efficiency {
                share(format!("VM {} memory_link_efficiency", v.name), e)?;
            }
            if let Some(s) = v.disk_switch_hold_s {
                non_negative(format!("VM {} disk_switch_hold_s", v.name), s)?;
            }
            for (what, measures) in [
                ("disk_move_setups_s", &v.disk_move_setups_s),
                ("disk_switch_holds_s", &v.disk_switch_holds_s),
                ("disk_move_host_s", &v.disk_move_host_s),
            ] {
                for s in measures {
                    non_negative(format!("VM {} {what}", v.name), *s)?;
                }
            }
            for (what, pauses) in [
                ("vm_move_pauses", &v.vm_move_pauses),
                ("teleport_pauses", &v.teleport_pauses),
            ] {
                for p in pauses {
                    positive(format!("VM {} {what} pause_s", v.name), p.pause_s)?;
                    non_negative(format!("VM {} {what} rtt_s", v.name), p.rtt_s)?;
                    positive(format!("VM {} {what} memory_bytes", v.name), p.memory_bytes)?;
                }
            }
            let l = &v.load;
            for (what, x) in [
                ("iops", l.iops),
                ("io_bytes", l.io_bytes),
                ("latency_ms", l.latency_ms),
                ("cpu", l.cpu),
                ("dirty_rate", l.dirty_rate),
                ("write_rate", l.write_rate),
            ] {
                non_negative(format!("VM {} {what}", v.name), x)?;
            }
            for t in &v.clients {
                if !known(&t.site) {
                    return Err(ClusterError::UnknownSite {
                        vm: format!("{} (its clients)", v.name),
                        site: t.site.clone(),
                    });
                }
                non_negative(format!("VM {} exchanges_per_s", v.name), t.exchanges_per_s)?;
                non_negative(format!("VM {} bytes_per_s", v.name), t.bytes_per_s)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One site and one VM that never moved, every measure absent.
    fn one_vm_snapshot() -> Cluster {
        Cluster {
            sites: vec![Site {
                name: "a".into(),
                cpu_capacity: 4.0,
            }],
            links: vec![],
            vms: vec![VmState {
                name: "g".into(),
                placement: Placement {
                    host_site: "a".into(),
                    disk_site: "a".into(),
                },
                memory_bytes: 1e8,
                disk_bytes: 1e9,
                missing_at: BTreeMap::new(),
                missing_link_at: BTreeMap::new(),
                printed_at: BTreeMap::new(),
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
                    iops: 1.0,
                    io_bytes: 4096.0,
                    latency_ms: 1.0,
                    cpu: 0.1,
                    dirty_rate: 0.0,
                    write_rate: 0.0,
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
    fn a_disks_daemon_measures_read_back_and_are_checked() {
        let mut moved = one_vm_snapshot();
        // Its disk's daemon's switch hold reads back; not negative.
        moved.vms[0].disk_switch_hold_s = Some(0.004);
        let back: Cluster = serde_json::from_str(&serde_json::to_string(&moved).unwrap()).unwrap();
        assert_eq!(back.vms[0].disk_switch_hold_s, Some(0.004));
        assert!(back.validate().is_ok());
        for bad in [-0.001, f64::NAN, f64::INFINITY] {
            moved.vms[0].disk_switch_hold_s = Some(bad);
            let e = moved.validate().unwrap_err().to_string();
            assert!(e.contains("disk_switch_hold_s"), "{e}");
        }
        moved.vms[0].disk_switch_hold_s = None;
        // Its disk's daemon's recent holds and small moves' fixed work,
        // and its host's part of its disk moves, read back; none negative.
        type Field = fn(&mut VmState) -> &mut Vec<f64>;
        let lists: [(&str, Field, Vec<f64>, Vec<f64>); 3] = [
            (
                "disk_switch_holds_s",
                |v| &mut v.disk_switch_holds_s,
                vec![0.009, 0.011],
                vec![0.009],
            ),
            (
                "disk_move_setups_s",
                |v| &mut v.disk_move_setups_s,
                vec![0.08, 0.07],
                vec![0.08],
            ),
            (
                "disk_move_host_s",
                |v| &mut v.disk_move_host_s,
                vec![0.03],
                vec![],
            ),
        ];
        for (what, field, good, before_bad) in lists {
            *field(&mut moved.vms[0]) = good.clone();
            let mut back: Cluster =
                serde_json::from_str(&serde_json::to_string(&moved).unwrap()).unwrap();
            assert_eq!(*field(&mut back.vms[0]), good, "{what}");
            assert!(back.validate().is_ok(), "{what}");
            for bad in [-0.001, f64::NAN, f64::INFINITY] {
                let mut told = before_bad.clone();
                told.push(bad);
                *field(&mut moved.vms[0]) = told;
                let e = moved.validate().unwrap_err().to_string();
                assert!(e.contains(what), "{e}");
            }
            field(&mut moved.vms[0]).clear();
        }
    }

    #[test]
    fn a_saved_snapshot_reads_back_with_a_never_moved_vm() {
        let c = one_vm_snapshot();
        let text = serde_json::to_string(&c).unwrap();
        assert!(text.contains("\"since_move_s\":null"), "{text}");
        let back: Cluster = serde_json::from_str(&text).unwrap();
        assert!(back.vms[0].since_move_s.is_infinite());
        let mut moved = c.clone();
        moved.vms[0].since_move_s = 12.5;
        let back: Cluster = serde_json::from_str(&serde_json::to_string(&moved).unwrap()).unwrap();
        assert_eq!(back.vms[0].since_move_s, 12.5);
        // A site's measured rebuild rate reads back, and must be positive.
        assert!(
            !text.contains("rebuild_bps_at"),
            "absent when empty: {text}"
        );
        moved.vms[0].rebuild_bps_at.insert("a".into(), 4e8);
        let back: Cluster = serde_json::from_str(&serde_json::to_string(&moved).unwrap()).unwrap();
        assert_eq!(back.vms[0].rebuild_bps_at.get("a"), Some(&4e8));
        assert!(back.validate().is_ok());
        for bad in [0.0, -1.0, f64::INFINITY] {
            moved.vms[0].rebuild_bps_at.insert("a".into(), bad);
            let e = moved.validate().unwrap_err().to_string();
            assert!(e.contains("rebuild_bps_at a"), "{e}");
        }
        moved.vms[0].rebuild_bps_at.clear();
        // Its host's measures read back; a stream rate must be positive,
        // a set-up not negative.
        moved.vms[0].memory_stream_bps = Some(5e7);
        moved.vms[0].memory_move_setup_s = Some(0.0);
        let back: Cluster = serde_json::from_str(&serde_json::to_string(&moved).unwrap()).unwrap();
        assert_eq!(back.vms[0].memory_stream_bps, Some(5e7));
        assert_eq!(back.vms[0].memory_move_setup_s, Some(0.0));
        assert!(back.validate().is_ok());
        for (rate, setup, what) in [
            (0.0, 0.5, "memory_stream_bps"),
            (5e7, -0.1, "memory_move_setup_s"),
            (5e7, f64::NAN, "memory_move_setup_s"),
        ] {
            moved.vms[0].memory_stream_bps = Some(rate);
            moved.vms[0].memory_move_setup_s = Some(setup);
            let e = moved.validate().unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
        moved.vms[0].memory_stream_bps = None;
        moved.vms[0].memory_move_setup_s = None;
        // How busy its host's streams kept their link: a share.
        moved.vms[0].memory_link_efficiency = Some(0.8);
        let back: Cluster = serde_json::from_str(&serde_json::to_string(&moved).unwrap()).unwrap();
        assert_eq!(back.vms[0].memory_link_efficiency, Some(0.8));
        assert!(back.validate().is_ok());
        for bad in [0.0, -0.2, 1.5, f64::NAN] {
            moved.vms[0].memory_link_efficiency = Some(bad);
            let e = moved.validate().unwrap_err().to_string();
            assert!(e.contains("memory_link_efficiency"), "{e}");
        }
        moved.vms[0].memory_link_efficiency = None;
        // Its host's kept pauses read back; each one a move could make.
        let p = MovePause {
            pause_s: 0.03,
            rtt_s: 0.008,
            memory_bytes: 2.5e8,
        };
        moved.vms[0].teleport_pauses = vec![p];
        let back: Cluster = serde_json::from_str(&serde_json::to_string(&moved).unwrap()).unwrap();
        assert_eq!(back.vms[0].teleport_pauses, vec![p]);
        assert!(back.vms[0].vm_move_pauses.is_empty());
        assert!(back.validate().is_ok());
        for (bad, what) in [
            (MovePause { pause_s: 0.0, ..p }, "teleport_pauses pause_s"),
            (
                MovePause {
                    pause_s: f64::NAN,
                    ..p
                },
                "teleport_pauses pause_s",
            ),
            (MovePause { rtt_s: -0.001, ..p }, "teleport_pauses rtt_s"),
            (
                MovePause {
                    memory_bytes: 0.0,
                    ..p
                },
                "teleport_pauses memory_bytes",
            ),
        ] {
            moved.vms[0].teleport_pauses = vec![p, bad];
            let e = moved.validate().unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
    }
}
