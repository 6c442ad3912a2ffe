//! Ending the moves whose outcome this daemon did not see: those a
//! stopped daemon left unfinished (found in `<state>/moves/` at start),
//! and one whose destination did not answer at the end.
//!
//! The guest ends up running at exactly one site. QEMU here tells how far
//! its migration got: still sending (or waiting at `pre-switchover`), it
//! is cancelled and the guest runs on here; finished, the destination is
//! asked (`Finish`, which it answers again for a guest that already
//! arrived): it runs the guest, so the copy here is handed over; it says
//! it does not, so the guest resumes here; it cannot be reached, so the
//! move stays `resolving` and is asked again. The disks a teleport
//! switched stay where they went and the guest's spec follows them; the
//! disk migrations it did not switch are cancelled.

use crate::guest::Guest;
use crate::peer::{PeerRequest, SwitchedDisk};
use crate::{VmError, VmHost};
use ferry_api::{
    AdminClient, DiskMigrationRef, MigrationId, MigrationPhase,
    MigrationStatus as DiskMigrationStatus, VmMovePhase,
};
use ferry_qmp::MigrationStatus;
use std::sync::Arc;
use std::time::Duration;

/// How an unfinished move ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolution {
    /// The guest runs at the destination; this host no longer has it.
    There,
    /// The guest runs (or is stopped, if QEMU was gone) here; why.
    Here(String),
    /// It ran at the destination and died there: it runs nowhere, and
    /// the paused copy here is not resumed (see [`lost_there`]).
    Lost(String),
    /// Not known yet: the destination could not be asked. Ask again.
    Unknown(String),
}

impl Resolution {
    /// The move's final phase and what to say, once known.
    pub fn phase(&self) -> VmMovePhase {
        match self {
            Resolution::There => VmMovePhase::Completed,
            Resolution::Here(_) => VmMovePhase::Aborted,
            Resolution::Lost(_) => VmMovePhase::Failed,
            Resolution::Unknown(_) => VmMovePhase::Resolving,
        }
    }
}

/// What the destination says of move `id`.
enum Answer {
    RunsThere,
    /// It never ran there: the guest may resume here.
    NotThere(String),
    /// It arrived there (and may have run) and no longer runs.
    LostThere(String),
    Unreachable(String),
}

/// Why a move whose guest ran at the destination and died there is not
/// resumed here.
pub fn lost_there(why: Option<&str>) -> String {
    format!(
        "the guest arrived and ran at the destination, and does not run there now ({}): it is not resumed here, which would rewind it under the writes it made there; start it again where its disk is",
        why.unwrap_or("no reason given")
    )
}

async fn ask(host: &VmHost, to_host: &str, id: &MigrationId, disks: Vec<SwitchedDisk>) -> Answer {
    let req = PeerRequest::Finish {
        id: id.clone(),
        disks,
    };
    match crate::tunnel::exchange(&host.certs, to_host, &req, Duration::from_secs(90)).await {
        Ok((a, _, _)) if a.ok => Answer::RunsThere,
        Ok((a, _, _)) if a.arrived => Answer::LostThere(lost_there(a.error.as_deref())),
        Ok((a, _, _)) => Answer::NotThere(a.error.unwrap_or_else(|| "refused".into())),
        Err(e) => Answer::Unreachable(e.to_string()),
    }
}

/// Tell the destination to drop what it received (best effort: a
/// waiting QEMU whose stream ended exits, and its host removes it).
async fn abort_there(host: &VmHost, to_host: &str, id: &MigrationId) {
    let req = PeerRequest::Abort { id: id.clone() };
    if let Err(e) = crate::tunnel::call(&host.certs, to_host, &req, Duration::from_secs(30)).await {
        tracing::info!(move_id = %id, error = %e, "could not tell the destination to drop the move");
    }
}

async fn migrate_status(g: &Guest) -> Option<MigrationStatus> {
    let rt = g.runtime()?;
    Some(rt.qmp.query_migrate().await.ok()?.status)
}

/// Cancel QEMU's outgoing migration and wait (bounded, 10 s) until QEMU
/// has really stopped it (it then resumes the guest).
pub(crate) async fn cancel_migration(g: &Guest) {
    let Some(rt) = g.runtime() else { return };
    let _ = rt.qmp.migrate_cancel().await;
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < end {
        // Taken before the query: a MIGRATION event after it wakes the wait.
        let mark = rt.qmp.mark();
        if let Ok(info) = rt.qmp.query_migrate().await {
            if info.status.ended() || info.status == MigrationStatus::None {
                return;
            }
        }
        let _ = rt
            .qmp
            .wait_named(mark, "MIGRATION", Duration::from_millis(50))
            .await;
    }
}

/// Run the guest here: `cont` unless QEMU already runs it.
async fn run_here(g: &Guest) -> Result<(), VmError> {
    let Some(rt) = g.runtime() else {
        return Err(crate::QemuFault::NotRunning.into());
    };
    if g.qemu_status().await.as_deref() != Some("running") {
        rt.qmp.cont().await?;
    }
    Ok(())
}

/// How long settling a disk waits for a migration it cancelled, or found
/// switching, to end.
const SETTLE_WAIT: Duration = Duration::from_secs(20);

/// `d`'s migration as its storage daemon reports it; `None` if that
/// daemon does not answer or no longer knows it.
async fn migration_of(d: &DiskMigrationRef) -> Option<DiskMigrationStatus> {
    status_at(&d.admin, &d.id).await
}

/// Migration `id` as the storage daemon at `admin` reports it now.
async fn status_at(admin: &str, id: &MigrationId) -> Option<DiskMigrationStatus> {
    let (c, id) = (AdminClient::new(admin), id.clone());
    tokio::task::spawn_blocking(move || c.migration(&id))
        .await
        .ok()?
        .ok()
}

/// `id` followed on `admin`'s event stream until it ends, at most
/// `limit`; if the stream breaks or the limit passes, its status asked
/// once more (`None`: the daemon cannot be asked). Its last status,
/// ended or not.
pub(crate) async fn until_ended(
    admin: &str,
    id: &MigrationId,
    limit: Duration,
) -> Option<DiskMigrationStatus> {
    let (c, i) = (AdminClient::new(admin).limited(limit), id.clone());
    match tokio::task::spawn_blocking(move || c.watch_migration(&i, |_| {})).await {
        Ok(Ok(s)) => Some(s),
        _ => status_at(admin, id).await,
    }
}

/// Where a switched migration put its volume: (NBD address, the admin
/// API the destination advertised).
fn moved(s: &DiskMigrationStatus) -> Option<(String, Option<String>)> {
    let r = s.report.as_ref()?;
    Some((r.new_location.clone()?, r.new_admin.clone()))
}

/// Where `d`'s volume is once its migration has ended: a migration still
/// running is cancelled and waited for (bounded): one released to switch
/// may still end switched, and then the volume is there. `None`: it stays
/// where the guest's spec says (or that could not be learnt: a note says).
async fn settled_place(
    d: &DiskMigrationRef,
    notes: &mut Vec<String>,
) -> Option<(String, Option<String>)> {
    match migration_of(d).await {
        Some(s) if s.phase == MigrationPhase::Switched => return moved(&s),
        Some(s) if s.phase == MigrationPhase::Failed => return None,
        Some(s) => {
            let was = s.phase;
            let (c, id) = (AdminClient::new(&d.admin), d.id.clone());
            match tokio::task::spawn_blocking(move || c.cancel_migration(&id)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => notes.push(format!("disk {}: cancel failed: {e}", d.volume)),
                Err(e) => notes.push(format!("disk {}: cancel failed: {e}", d.volume)),
            }
            match until_ended(&d.admin, &d.id, SETTLE_WAIT).await {
                Some(s) if s.phase.is_terminal() => {
                    notes.push(format!(
                        "disk {}: migration cancelled ({} when asked; it ended {})",
                        d.volume,
                        was.as_str(),
                        s.phase.as_str()
                    ));
                    return moved(&s);
                }
                Some(s) => {
                    notes.push(format!(
                        "disk {}: its migration did not end within {} s of being cancelled ({}); the disk stays as the guest's spec says",
                        d.volume,
                        SETTLE_WAIT.as_secs(),
                        s.phase.as_str()
                    ));
                    return None;
                }
                None => {}
            }
        }
        None => {}
    }
    // The storage daemon restarted (and forgot its runs) or is away: the
    // volume's own record says whether it moved.
    let (c, v) = (AdminClient::new(&d.admin), d.volume.clone());
    match tokio::task::spawn_blocking(move || c.volume(&v)).await {
        Ok(Ok(Some(view))) => view.moved_to.map(|to| (to, view.moved_admin)),
        _ => {
            notes.push(format!(
                "disk {}: its storage daemon ({}) did not answer; the disk stays as the guest's spec says",
                d.volume, d.admin
            ));
            None
        }
    }
}

/// Where a teleport's disks went, for its `Finish`: those whose migration
/// has switched (the destination refuses a `Finish` that leaves one of
/// its pending disks out, and the guest then resumes here).
async fn switched_places(disks: &[DiskMigrationRef]) -> Vec<SwitchedDisk> {
    let mut out = Vec::new();
    for d in disks {
        if let Some(s) = migration_of(d).await {
            if let Some((server, advertised)) = moved(&s) {
                out.push(SwitchedDisk {
                    volume: d.volume.clone(),
                    server,
                    admin: d.to_admin.clone().or(advertised),
                });
            }
        }
    }
    out
}

/// Finish what a move's disks left: a migration that switched moved the
/// disk, so the guest's spec follows it (server and, if the move was
/// told, admin API); one that did not is cancelled. Returns what was done.
pub async fn settle_disks(g: &Guest, disks: &[DiskMigrationRef]) -> Vec<String> {
    let mut notes = Vec::new();
    let mut changed = false;
    for d in disks {
        let Some((location, advertised)) = settled_place(d, &mut notes).await else {
            continue;
        };
        let mut spec = g.spec.lock();
        if let Some(disk) = spec.disks.iter_mut().find(|x| x.volume == d.volume) {
            if disk.server != location {
                disk.server.clone_from(&location);
                if let Some(a) = d.to_admin.as_ref().or(advertised.as_ref()) {
                    disk.admin = Some(a.clone());
                }
                changed = true;
                notes.push(format!(
                    "disk {} had switched to {location}; the guest's spec follows it",
                    d.volume
                ));
            }
        }
    }
    if changed {
        if let Err(e) = g.save_spec() {
            notes.push(format!("saving the guest's spec failed: {e}"));
        }
    }
    notes
}

/// Find out how move `id` of guest `g` to `to_host` ended and make it so
/// (see the module's note). Called with the guest's `op` lock held.
pub async fn resolve(
    host: &Arc<VmHost>,
    g: &Arc<Guest>,
    id: &MigrationId,
    to_host: Option<&str>,
    disks: &[DiskMigrationRef],
) -> Resolution {
    let alive = g.runtime().is_some_and(|r| crate::guest::pid_alive(r.pid));
    let status = if alive { migrate_status(g).await } else { None };
    // "completed" may be the migration that brought the guest here; one
    // that sent it away leaves the guest stopped (`postmigrate`).
    let sent_away = status == Some(MigrationStatus::Completed)
        && g.qemu_status().await.as_deref() != Some("running");
    let needs_answer = !alive || sent_away;
    if status.is_some_and(MigrationStatus::postcopy) {
        return Resolution::Unknown(
            "post-copy was under way: the guest's memory is split between the sites until QEMU recovers the stream".into(),
        );
    }
    if needs_answer {
        let Some(to) = to_host else {
            return Resolution::Here(
                "QEMU is not running here and the move had no destination".into(),
            );
        };
        match ask(host, to, id, switched_places(disks).await).await {
            Answer::RunsThere => {
                settle_disks(g, disks).await;
                crate::moves::hand_over(host, g, id).await;
                return Resolution::There;
            }
            Answer::LostThere(why) => {
                settle_disks(g, disks).await;
                return Resolution::Lost(why);
            }
            Answer::Unreachable(e) => {
                return Resolution::Unknown(format!(
                    "QEMU here finished sending the guest and the destination ({to}) cannot be asked whether it runs it ({e}); the guest stays paused here until it answers"
                ));
            }
            Answer::NotThere(why) => {
                abort_there(host, to, id).await;
                let mut notes = settle_disks(g, disks).await;
                let ran = if alive {
                    run_here(g)
                        .await
                        .map(|()| "the guest resumed here".to_string())
                } else {
                    Ok("QEMU is not running here either: start the guest".to_string())
                };
                notes.insert(
                    0,
                    format!(
                        "the destination does not run the guest ({why}); {}",
                        ran.unwrap_or_else(|e| format!("resuming it here failed: {e}"))
                    ),
                );
                return Resolution::Here(notes.join("; "));
            }
        }
    }
    // QEMU had not finished: its migration is cancelled (or had failed),
    // and the guest runs on here.
    cancel_migration(g).await;
    if let Some(to) = to_host {
        abort_there(host, to, id).await;
    }
    let mut notes = settle_disks(g, disks).await;
    notes.insert(
        0,
        match run_here(g).await {
            Ok(()) => "the guest runs on here".to_string(),
            Err(e) => format!("resuming the guest here failed: {e}"),
        },
    );
    Resolution::Here(notes.join("; "))
}

/// Resolve every move a stopped daemon left unfinished, asking again
/// (every 2 s, then up to every 30 s) until each is known.
pub fn resume_unfinished(host: &Arc<VmHost>) {
    let unfinished: Vec<ferry_api::VmMoveStatus> = host
        .past_moves
        .lock()
        .values()
        .filter(|s| s.phase == VmMovePhase::Resolving)
        .cloned()
        .collect();
    for st in unfinished {
        let host = host.clone();
        tokio::spawn(async move { finish_record(&host, st).await });
    }
}

async fn finish_record(host: &Arc<VmHost>, mut st: ferry_api::VmMoveStatus) {
    let mut wait = Duration::from_secs(2);
    let said = st.error.clone().unwrap_or_default();
    loop {
        let r = match host.guest(&st.vm) {
            Ok(g) => {
                let _op = g.op.lock().await;
                *g.moving.lock() = Some(st.id.clone());
                let r = resolve(host, &g, &st.id, st.to_host.as_deref(), &st.disk_migrations).await;
                *g.moving.lock() = None;
                r
            }
            // Not here: only the destination can have it.
            Err(_) => match st.to_host.as_deref() {
                Some(to) => match ask(host, to, &st.id, Vec::new()).await {
                    Answer::RunsThere => Resolution::There,
                    Answer::NotThere(why) => Resolution::Here(format!(
                        "the guest is not on this host, and the destination does not run it ({why})"
                    )),
                    Answer::LostThere(why) => Resolution::Lost(why),
                    Answer::Unreachable(e) => Resolution::Unknown(e),
                },
                None => Resolution::Here("the guest is not on this host".into()),
            },
        };
        let how = match &r {
            Resolution::There => "the destination runs the guest: the move completed".to_string(),
            Resolution::Here(why) | Resolution::Lost(why) | Resolution::Unknown(why) => why.clone(),
        };
        st.phase = r.phase();
        st.convergence.push(how.clone());
        st.error = match r {
            Resolution::There => None,
            _ => Some(format!("{said}; {how}")),
        };
        tracing::info!(move_id = %st.id, vm = %st.vm, phase = st.phase.as_str(), "{how}");
        let record = host.root.join("moves").join(format!("{}.json", st.id));
        if let Err(e) = crate::guest::write_json(&record, crate::guest::files::MOVE, &st) {
            tracing::warn!(move_id = %st.id, error = %e, "cannot record the move");
        }
        host.past_moves.lock().insert(st.id.clone(), st.clone());
        if !matches!(r, Resolution::Unknown(_)) {
            return;
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(30));
    }
}
