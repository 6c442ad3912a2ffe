//! Carrying out decisions through the hosts' move API (a move started,
//! then followed to its end), and what came of each beside what the model
//! predicted; [`OneShot`] is `ferry control plan --apply`'s world.

use ferry_api::{AdminClient, MigrationId, VmMigrateRequest, VmMovePhase};
use ferry_control::cycle::{Ended, World};
use ferry_control::inventory::Inventory;
use ferry_control::policy::{Action, Decision};
use ferry_control::Cluster;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The longest a move is followed before the controller stops waiting
/// (the core asks to cancel it at [`ferry_control::cycle::MOVE_LIMIT_S`],
/// a minute before).
pub const MOVE_LIMIT: Duration = Duration::from_secs(960);

/// A move's end, measured, beside its prediction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoveOutcome {
    pub vm: String,
    pub action: Action,
    pub to_host_site: String,
    pub to_disk_site: String,
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

/// Build the move request for `d`, or say why it cannot be made.
fn request(inv: &Inventory, c: &AdminClient, d: &Decision) -> Result<VmMigrateRequest, String> {
    let to = inv
        .site(&d.to.host_site)
        .ok_or_else(|| format!("unknown site {}", d.to.host_site))?;
    let to_disk = inv
        .site(&d.to.disk_site)
        .ok_or_else(|| format!("unknown site {}", d.to.disk_site))?;
    let mut req = VmMigrateRequest {
        id: Some(MigrationId::random()),
        ..Default::default()
    };
    if matches!(d.action, Action::MoveVm | Action::Teleport) {
        let h = to
            .hosts
            .first()
            .ok_or_else(|| format!("site {} has no host", to.name))?;
        req.to_host = Some(h.moves.clone());
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
        let st = to_disk
            .storage
            .first()
            .ok_or_else(|| format!("site {} has no storage", to_disk.name))?;
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
        from_host_site: d.from.host_site.clone(),
        from_disk_site: d.from.disk_site.clone(),
        result: "not started".into(),
        seconds: 0.0,
        predicted_seconds: d.cost.seconds,
        bytes: 0.0,
        predicted_bytes: d.cost.bytes,
        guest_pause_ms: None,
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
) -> Result<(MigrationId, MoveOutcome), Box<MoveOutcome>> {
    let mut out = not_started(d, None);
    let c = AdminClient::for_host(control).limited(crate::measure::HOST_CALL_LIMIT);
    let req = match request(inv, &c, d) {
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
/// and followed on a thread of its own, every outcome kept.
pub struct OneShot {
    inv: Inventory,
    cluster: Cluster,
    running_on: BTreeMap<String, String>,
    tx: mpsc::Sender<MoveOutcome>,
    rx: mpsc::Receiver<MoveOutcome>,
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
            tx,
            rx,
            outcomes: Vec::new(),
        }
    }

    /// Wait for the next move to end.
    pub fn wait(&mut self) -> Option<Ended> {
        let out = self.rx.recv().ok()?;
        let e = ended(&out);
        self.outcomes.push(out);
        Some(e)
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
            self.outcomes.push(not_started(d, Some(why.clone())));
            return Err(why);
        };
        match start(&self.inv, &control, d) {
            Ok((id, out)) => {
                let tx = self.tx.clone();
                std::thread::spawn(move || {
                    let _ = tx.send(follow(&control, &id, out));
                });
                Ok(())
            }
            Err(out) => {
                let why = out.reason.clone().unwrap_or_default();
                self.outcomes.push(*out);
                Err(why)
            }
        }
    }

    fn cancel(&mut self, _vm: &str, _why: &str) {}

    fn ended(&mut self, _now: f64) -> Vec<Ended> {
        let mut out = Vec::new();
        while let Ok(o) = self.rx.try_recv() {
            out.push(ended(&o));
            self.outcomes.push(o);
        }
        out
    }
}
