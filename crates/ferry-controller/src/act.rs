//! Carrying out decisions through the hosts' move API (a move started,
//! then followed to its end), and what came of each beside what the model
//! predicted; [`OneShot`] is `ferry control plan --apply`'s world.

use ferry_api::{AdminClient, MigrationId, VmMigrateRequest, VmMovePhase};
use ferry_placement::cycle::{Ended, World};
use ferry_placement::inventory::{Inventory, StorageRef};
use ferry_placement::policy::{Action, Decision};
use ferry_placement::Cluster;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The longest a move is followed before the controller stops waiting
/// (the core asks to cancel it at [`ferry_placement::cycle::MOVE_LIMIT_S`],
/// a minute before).
pub const MOVE_LIMIT: Duration = Duration::from_secs(960);

/// A move's end, measured, beside its prediction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoveOutcome {
    pub vm: String,
    pub action: Action,
    pub to_host_site: String,
    pub to_disk_site: String,
    /// The host it was sent to, when the controller chose one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_host: Option<String>,
    /// Where the guest ran and its disk lived before.
    #[serde(default)]
    pub from_host_site: String,
    #[serde(default)]
    pub from_disk_site: String,
    /// `completed`, `aborted`, `failed`, or `not started`.
    pub result: String,
    pub seconds: f64,
    pub predicted_seconds: f64,
    pub bytes: f64,
    pub predicted_bytes: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest_pause_ms: Option<f64>,
    /// The memory move's own fixed time as its host measured it (the
    /// report's `memory_setup_s`), where it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_setup_s: Option<f64>,
    /// Of `bytes`, the memory stream's (the report's `memory_link`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_bytes: Option<f64>,
    /// How busy the memory stream kept its link, as its host measured it
    /// for this move (the report's `memory_link_efficiency`), where it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_link_efficiency: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// A burst: the site the guest left because it was full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst_from: Option<String>,
}

impl MoveOutcome {
    pub fn completed(&self) -> bool {
        self.result == "completed"
    }

    /// The link the move's bytes crossed (sites in name order), if it
    /// crossed one: memory between host sites, disk between disk sites.
    pub fn link(&self) -> Option<(String, String)> {
        let (a, b) = match self.action {
            Action::MoveDisk => (&self.from_disk_site, &self.to_disk_site),
            Action::MoveVm | Action::Teleport => (&self.from_host_site, &self.to_host_site),
        };
        if a.is_empty() || b.is_empty() || a == b {
            return None;
        }
        Some(if a < b {
            (a.clone(), b.clone())
        } else {
            (b.clone(), a.clone())
        })
    }

    /// One line for people.
    pub fn line(&self) -> String {
        format!(
            "{} {} to VM at {}, disk at {}: {} in {:.1} s (predicted {:.1} s), {:.0} MB (predicted {:.0} MB){}",
            self.vm,
            self.action,
            self.to_host_site,
            self.to_disk_site,
            self.result,
            self.seconds,
            self.predicted_seconds,
            self.bytes / 1e6,
            self.predicted_bytes / 1e6,
            self.reason
                .as_ref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        )
    }
}

/// The storage daemon of the disk's new site a move goes to: the one at
/// `nbd` when given (the one holding most of the disk, or serving fewest
/// disks), else the site's first.
fn target_storage<'i>(
    inv: &'i Inventory,
    d: &Decision,
    nbd: Option<&str>,
) -> Result<&'i StorageRef, String> {
    let site = inv
        .site(&d.to.disk_site)
        .ok_or_else(|| format!("unknown site {}", d.to.disk_site))?;
    match nbd {
        Some(nbd) => site
            .storage
            .iter()
            .find(|s| s.serves(nbd))
            .ok_or_else(|| format!("site {} has no storage daemon at {nbd}", site.name)),
        None => site
            .storage
            .first()
            .ok_or_else(|| format!("site {} has no storage", site.name)),
    }
}

/// `st`, or when it is a shared gateway of a Ceph cluster whose admin API
/// does not accept a connection, the first of its cluster's other gateways
/// at the site that does: the disk goes to the cluster, through any of them.
fn live_gateway<'i>(inv: &'i Inventory, site: &str, st: &'i StorageRef) -> &'i StorageRef {
    let gws = inv.gateways_of(site, st);
    if gws.len() < 2 {
        return st;
    }
    gws.iter()
        .find(|g| {
            ferry_api::client::accepts_connections(&g.admin, std::time::Duration::from_secs(1))
        })
        .copied()
        .unwrap_or(st)
}

/// Build the move request for `d` (to the storage daemon at `storage` of
/// the disk's new site, when given), or say why it cannot be made.
fn request(
    inv: &Inventory,
    c: &AdminClient,
    d: &Decision,
    storage: Option<&str>,
) -> Result<VmMigrateRequest, String> {
    let mut req = VmMigrateRequest {
        id: Some(MigrationId::random()),
        ..Default::default()
    };
    if matches!(d.action, Action::MoveVm | Action::Teleport) {
        req.to_host = Some(
            inv.chosen_host(&d.to.host_site, d.to_host.as_deref())?
                .moves
                .clone(),
        );
    }
    if d.action == Action::MoveVm {
        // The guest's disks, reached the way the new site reaches them.
        let view = c.vm(&d.vm).map_err(|e| e.to_string())?;
        let mut servers = BTreeMap::new();
        for disk in view.spec.disks {
            if let Some((site, st)) = inv.storage_at(&disk.server) {
                let there = st.nbd_from(&site.name, &d.to.host_site);
                if there != disk.server {
                    servers.insert(disk.volume.clone(), there.to_string());
                }
            }
        }
        req.disk_servers = servers;
    }
    if matches!(d.action, Action::MoveDisk | Action::Teleport) {
        let st = live_gateway(inv, &d.to.disk_site, target_storage(inv, d, storage)?);
        req.to_storage = Some(st.migrate.clone());
        req.to_storage_admin = Some(st.admin.clone());
    }
    Ok(req)
}

/// The outcome of `d` before it runs (`not started`, with `reason`).
pub fn not_started(d: &Decision, reason: Option<String>) -> MoveOutcome {
    MoveOutcome {
        vm: d.vm.clone(),
        action: d.action,
        to_host_site: d.to.host_site.clone(),
        to_disk_site: d.to.disk_site.clone(),
        to_host: d.to_host.clone(),
        from_host_site: d.from.host_site.clone(),
        from_disk_site: d.from.disk_site.clone(),
        result: "not started".into(),
        seconds: 0.0,
        predicted_seconds: d.cost.seconds,
        bytes: 0.0,
        predicted_bytes: d.cost.bytes,
        guest_pause_ms: None,
        memory_setup_s: None,
        memory_bytes: None,
        memory_link_efficiency: None,
        reason,
        burst_from: d.burst_from.clone(),
    }
}

/// Ask the host at `control` to carry out `d`. Ok: the move's id there
/// and the outcome to fill in; Err: the outcome of a move that never started.
pub fn start(
    inv: &Inventory,
    control: &str,
    d: &Decision,
    storage: Option<&str>,
) -> Result<(MigrationId, MoveOutcome), Box<MoveOutcome>> {
    let mut out = not_started(d, None);
    let c = AdminClient::for_host(control).limited(crate::measure::HOST_CALL_LIMIT);
    let req = match request(inv, &c, d, storage) {
        Ok(r) => r,
        Err(e) => {
            out.reason = Some(e);
            return Err(Box::new(out));
        }
    };
    match c.migrate_vm(&d.vm, &req) {
        Ok(s) => {
            out.result = "running".into();
            Ok((s.id, out))
        }
        Err(e) => {
            out.reason = Some(e.to_string());
            Err(Box::new(out))
        }
    }
}

/// Wait for move `id` on the host at `control` to end; `out` is what
/// [`start`] returned (or the journal kept of it).
pub fn follow(control: &str, id: &MigrationId, mut out: MoveOutcome) -> MoveOutcome {
    let c = AdminClient::for_host(control).limited(crate::measure::HOST_CALL_LIMIT);
    let t = Instant::now();
    let mut unanswered = 0;
    let end = loop {
        match c.vm_move(id) {
            Ok(s) if s.phase.is_terminal() => break Some(s),
            Ok(_) => unanswered = 0,
            Err(e) => {
                unanswered += 1;
                if unanswered > 50 {
                    out.result = "failed".into();
                    out.reason = Some(format!("the source host stopped answering: {e}"));
                    break None;
                }
            }
        }
        if t.elapsed() > MOVE_LIMIT {
            out.result = "failed".into();
            out.reason = Some(format!(
                "move {id} still running after {} s; left to the host",
                MOVE_LIMIT.as_secs()
            ));
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    out.seconds = t.elapsed().as_secs_f64();
    if let Some(rep) = end.and_then(|s| s.report) {
        out.result = rep.result.as_str().into();
        out.seconds = rep.total_s;
        #[allow(clippy::cast_precision_loss)]
        let bytes = (rep.bytes.memory_link + rep.bytes.disk_link) as f64;
        out.bytes = bytes;
        out.guest_pause_ms = rep.guest_pause_ms;
        out.memory_setup_s = rep.memory_setup_s.filter(|s| s.is_finite() && *s >= 0.0);
        #[allow(clippy::cast_precision_loss)]
        let memory = rep.bytes.memory_link as f64;
        out.memory_bytes = Some(memory);
        out.memory_link_efficiency = rep
            .memory_link_efficiency
            .filter(|e| ferry_placement::cluster::is_share(*e));
        out.reason = if rep.result == VmMovePhase::Completed {
            None
        } else {
            rep.reason
        };
    }
    out
}

/// The sites as `ferry control plan --apply` acts on them through the
/// core: the snapshot it was given, each move asked of the guest's host
/// and followed on a thread of its own, every outcome kept and, given a
/// journal (the controller's state directory, held while it runs), each
/// start and end journaled as the controller journals its own.
pub struct OneShot {
    inv: Inventory,
    cluster: Cluster,
    running_on: BTreeMap<String, String>,
    journal: Option<(std::sync::Arc<crate::journal::Journal>, u64)>,
    /// Each followed move's end, with its id.
    tx: mpsc::Sender<(String, MoveOutcome)>,
    rx: mpsc::Receiver<(String, MoveOutcome)>,
    /// Every move's end, in the order they ended.
    pub outcomes: Vec<MoveOutcome>,
}

impl OneShot {
    pub fn new(inv: Inventory, cluster: Cluster, running_on: BTreeMap<String, String>) -> Self {
        let (tx, rx) = mpsc::channel();
        OneShot {
            inv,
            cluster,
            running_on,
            journal: None,
            tx,
            rx,
            outcomes: Vec::new(),
        }
    }

    /// Journal every move's start and end in `journal`, as cycle `cycle`.
    pub fn journaled(
        mut self,
        journal: std::sync::Arc<crate::journal::Journal>,
        cycle: u64,
    ) -> Self {
        self.journal = Some((journal, cycle));
        self
    }

    fn record(&self, event: crate::journal::Event) {
        if let Some((j, cycle)) = &self.journal {
            if let Err(e) = j.record(*cycle, event) {
                tracing::error!("cannot journal: {e}");
            }
        }
    }

    /// A move's end (`id` "" for one that never started): kept, and
    /// journaled.
    fn end(&mut self, id: String, out: MoveOutcome) -> Ended {
        let e = ended(&out);
        self.record(crate::journal::Event::Finished {
            id,
            outcome: out.clone(),
        });
        self.outcomes.push(out);
        e
    }

    /// Wait for the next move to end.
    pub fn wait(&mut self) -> Option<Ended> {
        let (id, out) = self.rx.recv().ok()?;
        Some(self.end(id, out))
    }
}

fn ended(out: &MoveOutcome) -> Ended {
    Ended {
        vm: out.vm.clone(),
        completed: out.completed(),
        reason: out.reason.clone(),
        at_s: 0.0,
    }
}

impl World for OneShot {
    fn measure(&mut self, _now: f64) -> Result<Cluster, String> {
        Ok(self.cluster.clone())
    }

    fn start(&mut self, d: &Decision, _now: f64) -> Result<(), String> {
        let Some(control) = self.running_on.get(&d.vm).cloned() else {
            let why = "not running on any known host".to_string();
            self.end(String::new(), not_started(d, Some(why.clone())));
            return Err(why);
        };
        match start(&self.inv, &control, d, None) {
            Ok((id, out)) => {
                self.record(crate::journal::Event::Started {
                    vm: d.vm.clone(),
                    id: id.to_string(),
                    control: control.clone(),
                    expect: out.clone(),
                });
                let tx = self.tx.clone();
                std::thread::spawn(move || {
                    let end = follow(&control, &id, out);
                    let _ = tx.send((id.to_string(), end));
                });
                Ok(())
            }
            Err(out) => {
                let why = out.reason.clone().unwrap_or_default();
                self.end(String::new(), *out);
                Err(why)
            }
        }
    }

    fn cancel(&mut self, _vm: &str, _why: &str) {}

    fn ended(&mut self, _now: f64) -> Vec<Ended> {
        let mut out = Vec::new();
        while let Ok((id, o)) = self.rx.try_recv() {
            let e = self.end(id, o);
            out.push(e);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_placement::inventory::SiteInventory;
    use ferry_placement::model::MoveCost;
    use ferry_placement::Placement;

    /// Site `b` with two hosts and two storage daemons.
    fn inventory() -> Inventory {
        let host = |n: &str| ferry_placement::inventory::HostRef {
            control: format!("{n}:1"),
            moves: format!("{n}:2"),
            cpus: None,
            memory_mib: None,
        };
        let storage = |n: &str| StorageRef {
            nbd: format!("{n}:10809"),
            nbd_local: None,
            migrate: format!("{n}:7000"),
            admin: format!("{n}:8000"),
            cluster: None,
        };
        Inventory {
            sites: vec![SiteInventory {
                name: "b".into(),
                cpu_capacity: 8.0,
                hosts: vec![host("b1"), host("b2")],
                storage: vec![storage("s1"), storage("s2")],
                clients: Vec::new(),
            }],
            links: vec![],
        }
    }

    fn teleport(to_host: Option<&str>) -> Decision {
        let at = |s: &str| Placement {
            host_site: s.into(),
            disk_site: s.into(),
        };
        Decision {
            vm: "web".into(),
            action: Action::Teleport,
            from: at("a"),
            to: at("b"),
            to_host: to_host.map(Into::into),
            lost_here_s: 0.0,
            lost_there_s: 0.0,
            cost: MoveCost {
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
    fn a_move_goes_to_the_host_and_storage_daemon_chosen_for_it() {
        let inv = inventory();
        let c = AdminClient::for_host("127.0.0.1:1");
        let req = request(&inv, &c, &teleport(Some("b2:1")), Some("s2:10809")).unwrap();
        assert_eq!(req.to_host.as_deref(), Some("b2:2"));
        assert_eq!(req.to_storage.as_deref(), Some("s2:7000"));
        assert_eq!(req.to_storage_admin.as_deref(), Some("s2:8000"));
        // Nothing chosen: the site's first of each.
        let req = request(&inv, &c, &teleport(None), None).unwrap();
        assert_eq!(req.to_host.as_deref(), Some("b1:2"));
        assert_eq!(req.to_storage.as_deref(), Some("s1:7000"));
        // A host or daemon the site does not list is refused by name.
        let e = request(&inv, &c, &teleport(Some("elsewhere:1")), None).unwrap_err();
        assert!(e.contains("no host elsewhere:1"), "{e}");
        let e = request(&inv, &c, &teleport(None), Some("s9:10809")).unwrap_err();
        assert!(e.contains("no storage daemon at s9:10809"), "{e}");
    }

    #[test]
    fn a_disk_move_to_a_ceph_cluster_goes_through_a_gateway_that_answers() {
        let mut inv = inventory();
        // s1 and s2 are the gateways of one cluster; s1's admin API is a
        // closed port, s2's accepts connections.
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead_addr = dead.local_addr().unwrap().to_string();
        drop(dead);
        let live = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let st = &mut inv.sites[0].storage;
        st[0].admin = dead_addr;
        st[1].admin = live.local_addr().unwrap().to_string();
        for s in st.iter_mut() {
            s.cluster = Some("ceph-b".into());
        }
        let c = AdminClient::for_host("127.0.0.1:1");
        let req = request(&inv, &c, &teleport(None), Some("s1:10809")).unwrap();
        assert_eq!(req.to_storage.as_deref(), Some("s2:7000"));
        // Not one cluster: the chosen daemon, answering or not.
        inv.sites[0].storage[1].cluster = Some("other".into());
        let req = request(&inv, &c, &teleport(None), Some("s1:10809")).unwrap();
        assert_eq!(req.to_storage.as_deref(), Some("s1:7000"));
    }
}
