//! The source side of a guest's move, and the one report of it.
//!
//! Teleport, in order (ARCHITECTURE.md has the invariants):
//! 1. disk pre-copy: each disk's storage daemon migrates the volume to the
//!    destination storage with `hold_switch`; wait until all are converged
//!    and holding (the source copy stays authoritative, the guest runs);
//! 2. the destination host starts QEMU with `-incoming`, its disks
//!    attached *pending* (described, not yet connected);
//! 3. memory pre-copy: QEMU's live migration, its stream through the TLS
//!    tunnel, with `pause-before-switchover`; the ladder of [`converge`]
//!    acts on stalls;
//! 4. QEMU stops the guest and waits (`pre-switchover`): the disks' last
//!    delta and switch are released now, while no guest write can happen;
//!    once every disk reports `switched`, the destination's pending disks
//!    connect to the new storage, and QEMU is told to continue;
//! 5. QEMU sends the device state; the destination runs the guest. The
//!    source confirms (`Finish`) and only then ends its QEMU.
//!
//! VM-only is steps 2, 3 and 5 with the disks attached at the destination
//! to where they are; disk-only is step 1 without the hold.

use crate::converge::Ladder;
use crate::guest::Guest;
use crate::move_order::{Input, MemoryOrder, Step};
use crate::peer::{DiskArrival, IncomingDisk, PeerRequest, SwitchedDisk};
use crate::tunnel::{call, exchange, pipe, PipeCounters, SendTiming};
use crate::{VmError, VmHost};
use ferry_api::{
    AdminClient, DiskMigrationRef, MigrateRequest, MigrationId, MigrationPhase, MigrationStatus,
    MoveBytes, MoveKind, PhaseTime, VmDisk, VmMigrateRequest, VmMovePhase, VmMoveReport,
    VmMoveStatus, VmState,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

pub const DEFAULT_MAX_DOWNTIME_MS: u64 = 300;
pub const DEFAULT_DEADLINE_S: u64 = 600;
const POLL: Duration = Duration::from_millis(50);
const DISK_POLL: Duration = Duration::from_millis(100);
/// While the guest is stopped, every millisecond of polling is pause.
const SWITCH_POLL: Duration = Duration::from_millis(5);
/// At pre-switchover, how long the disks may take to be holding again
/// (after a link hiccup), and then to switch.
const SWITCH_READY_WAIT: Duration = Duration::from_secs(5);
const SWITCH_WAIT: Duration = Duration::from_secs(20);
/// A link opened ahead is renewed before the destination's request
/// timeout closes it.
const SPARE_LINK_AGE: Duration = Duration::from_secs(40);
/// The fewest raw bytes a memory stream sends before the switchover for
/// its rate to be told to the host's measure: a smaller one is mostly
/// QEMU's set-up and first bitmap sync.
pub const MIN_MEASURED_STREAM: u64 = 16 << 20;

/// When `t` was, in seconds since the Unix epoch by the wall clock now
/// (0 if that is before the epoch).
pub(crate) fn unix_s(t: Instant) -> f64 {
    std::time::SystemTime::now()
        .checked_sub(t.elapsed())
        .and_then(|w| w.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One move this host started.
pub struct MoveRun {
    pub id: MigrationId,
    pub vm: String,
    pub kind: MoveKind,
    pub req: VmMigrateRequest,
    pub started: Instant,
    phase: parking_lot::Mutex<VmMovePhase>,
    phases: parking_lot::Mutex<Vec<(VmMovePhase, Instant)>>,
    convergence: parking_lot::Mutex<Vec<String>>,
    error: parking_lot::Mutex<Option<String>>,
    report: parking_lot::Mutex<Option<VmMoveReport>>,
    memory_remaining: AtomicU64,
    memory_rounds: AtomicU64,
    disk_dirty: AtomicU64,
    pub cancel: CancellationToken,
    pub counters: Arc<PipeCounters>,
    /// The memory stream's bytes and sender's clock as the switchover
    /// began (what the pre-copy sent, and in how long).
    precopy_sent: parking_lot::Mutex<Option<PrecopySent>>,
    /// Where the move's status is kept (`<state>/moves/<id>.json`).
    record: PathBuf,
    /// The disk migrations this move started (recorded with its status).
    disk_migrations: parking_lot::Mutex<Vec<DiskMigrationRef>>,
    /// A client of each storage daemon this move calls, by admin address,
    /// kept for the move (see [`MoveRun::admin_of`]).
    admins: parking_lot::Mutex<BTreeMap<String, AdminClient>>,
}

/// The moves a daemon on `root` recorded. One still running when it
/// stopped reads as `resolving`, with the phase it was in: the new daemon
/// finds out how it ended ([`crate::recover`]).
pub fn past_moves(root: &Path) -> BTreeMap<MigrationId, VmMoveStatus> {
    use crate::guest::files;
    let dir = root.join("moves");
    ferry_state_file::prune(&dir, files::MOVES_KEPT, files::MOVES_MAX_AGE);
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let mut st: VmMoveStatus = match crate::guest::read_json(&p, files::MOVE) {
            Ok(Some(st)) => st,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "an unreadable move record; skipped");
                continue;
            }
        };
        if !st.phase.is_terminal() && st.phase != VmMovePhase::Resolving {
            st.error = Some(format!(
                "the host daemon stopped during the move (in phase {})",
                st.phase.as_str()
            ));
            st.phase = VmMovePhase::Resolving;
            let _ = crate::guest::write_json(&p, files::MOVE, &st);
        }
        out.insert(st.id.clone(), st);
    }
    out
}

/// What a memory stream's pre-copy sent: QEMU's bytes, the link bytes
/// they took, and the sender's clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrecopySent {
    pub raw: u64,
    pub link: u64,
    pub timing: SendTiming,
}

impl MoveRun {
    /// A client of `d`'s storage daemon, the same for every call of this
    /// move: its connection (over TLS beyond loopback) stays open between
    /// the memory copy's polls, so the call made while the guest is
    /// stopped, releasing its disks, opens neither a connection nor a TLS
    /// session. Kept for one move only: trust changes on disk take effect
    /// at the next.
    fn admin_of(&self, d: &VmDisk) -> AdminClient {
        self.admins
            .lock()
            .entry(d.admin.clone().unwrap_or_default())
            .or_insert_with(|| admin_of(d))
            .clone()
    }

    fn set_phase(&self, p: VmMovePhase) {
        let mut cur = self.phase.lock();
        if *cur != p {
            *cur = p;
            self.phases.lock().push((p, Instant::now()));
            if p == VmMovePhase::Switchover {
                self.precopy_sent.lock().get_or_insert_with(|| PrecopySent {
                    raw: self.counters.raw.load(Ordering::Relaxed),
                    link: self.counters.link.load(Ordering::Relaxed),
                    timing: *self.counters.timing.lock(),
                });
            }
            tracing::info!(move_id = %self.id, vm = %self.vm, phase = p.as_str(), "move phase");
            drop(cur);
            self.save();
        }
    }

    /// Record the move's status, so a restarted daemon can answer for it.
    fn save(&self) {
        if let Err(e) =
            crate::guest::write_json(&self.record, crate::guest::files::MOVE, &self.status())
        {
            tracing::warn!(move_id = %self.id, error = %e, "cannot record the move");
        }
    }

    /// Whether the move went through post-copy (the guest may have run at
    /// the destination since).
    fn went_postcopy(&self) -> bool {
        self.phases
            .lock()
            .iter()
            .any(|(p, _)| *p == VmMovePhase::Postcopy)
    }

    pub fn phase(&self) -> VmMovePhase {
        *self.phase.lock()
    }

    fn note(&self, s: String) {
        tracing::info!(move_id = %self.id, "{s}");
        self.convergence.lock().push(s);
    }

    pub fn status(&self) -> VmMoveStatus {
        let report = self.report.lock().clone();
        let ran = self.started.elapsed();
        let started_unix = unix_s(self.started);
        VmMoveStatus {
            id: self.id.clone(),
            vm: self.vm.clone(),
            kind: self.kind,
            phase: self.phase(),
            elapsed_s: report.as_ref().map_or(ran.as_secs_f64(), |r| r.total_s),
            started_unix,
            memory_remaining: self.memory_remaining.load(Ordering::Relaxed),
            disk_dirty: self.disk_dirty.load(Ordering::Relaxed),
            convergence: self.convergence.lock().clone(),
            error: self.error.lock().clone(),
            report,
            to_host: self.req.to_host.clone(),
            disk_migrations: self.disk_migrations.lock().clone(),
        }
    }

    fn phase_times(&self, end: Instant) -> Vec<PhaseTime> {
        let p = self.phases.lock();
        p.iter()
            .enumerate()
            .filter(|(_, (ph, _))| !ph.is_terminal())
            .map(|(i, (ph, t))| PhaseTime {
                phase: *ph,
                seconds: p
                    .get(i + 1)
                    .map_or(end, |n| n.1)
                    .duration_since(*t)
                    .as_secs_f64(),
            })
            .collect()
    }
}

/// How a move ended, before the report is written.
struct Outcome {
    guest_pause_ms: Option<f64>,
    result: VmMovePhase,
    reason: Option<String>,
    running_at: String,
    memory_rounds: u64,
    downtime_ms: Option<u64>,
    disk_gap_ms: Option<f64>,
    disks: Vec<MigrationStatus>,
}

impl Outcome {
    fn aborted(reason: String, here: &str) -> Outcome {
        Outcome {
            guest_pause_ms: None,
            result: VmMovePhase::Aborted,
            reason: Some(reason),
            running_at: here.into(),
            memory_rounds: 0,
            downtime_ms: None,
            disk_gap_ms: None,
            disks: Vec::new(),
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ferry_api::ClientError> + Send + 'static,
) -> Result<T, VmError> {
    tokio::task::spawn_blocking(f)
        .await?
        .map_err(VmError::Storage)
}

/// Start moving guest `name` (answers at once; the move runs on).
pub async fn start(
    host: Arc<VmHost>,
    name: &str,
    req: VmMigrateRequest,
) -> Result<VmMoveStatus, VmError> {
    if let Some(id) = &req.id {
        if let Some(r) = host.moves.lock().get(id) {
            return Ok(r.status());
        }
    }
    let g = host.guest(name)?;
    let kind = match (&req.to_host, &req.to_storage) {
        (Some(_), Some(_)) => MoveKind::Teleport,
        (Some(_), None) => MoveKind::VmOnly,
        (None, Some(_)) => MoveKind::DiskOnly,
        (None, None) => {
            return Err(VmError::BadSpec(
                "say where to: --to-host, --to-storage or both".into(),
            ))
        }
    };
    let spec = g.spec.lock().clone();
    if req.xbzrle_cache_mib > 0 && (kind == MoveKind::DiskOnly || req.multifd > 0) {
        return Err(VmError::BadSpec(if kind == MoveKind::DiskOnly {
            "xbzrle applies to the memory: give --to-host".into()
        } else {
            "xbzrle does nothing with multifd (QEMU 7.2 sends multifd pages whole)".into()
        }));
    }
    if req.multifd > 0 && (req.postcopy || kind == MoveKind::DiskOnly || req.multifd > 16) {
        return Err(VmError::BadSpec(if req.postcopy {
            "multifd and post-copy do not go together (QEMU 7.2)".into()
        } else if kind == MoveKind::DiskOnly {
            "multifd applies to the memory: give --to-host".into()
        } else {
            format!("multifd takes 1 to 16 channels, not {}", req.multifd)
        }));
    }
    if !req.disk_servers.is_empty() && kind != MoveKind::VmOnly {
        return Err(VmError::BadSpec(
            "a disk address for the destination applies to a VM-only move (a moved disk is reached where it went)".into(),
        ));
    }
    if let Some(v) = req
        .disk_servers
        .keys()
        .find(|v| !spec.disks.iter().any(|d| &d.volume == *v))
    {
        return Err(VmError::BadSpec(format!(
            "the guest has no disk {v} (its disks: {})",
            spec.disks
                .iter()
                .map(|d| d.volume.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    if kind != MoveKind::VmOnly {
        if let Some(d) = spec.disks.iter().find(|d| d.admin.is_none()) {
            return Err(VmError::BadSpec(format!(
                "disk {} has no storage admin address in the guest's spec; it cannot be moved",
                d.volume
            )));
        }
        if spec.disks.is_empty() {
            return Err(VmError::BadSpec("the guest has no disk to move".into()));
        }
    }
    let (st, _) = g.state().await;
    if st != VmState::Running {
        return Err(VmError::Busy {
            name: name.into(),
            state: st.as_str().into(),
            what: "only a running guest moves".into(),
        });
    }
    let run = {
        let mut moving = g.moving.lock();
        if let Some(other) = moving.as_ref() {
            return Err(VmError::Busy {
                name: name.into(),
                state: "moving".into(),
                what: format!("move {other} runs"),
            });
        }
        let id = req.id.clone().unwrap_or_else(MigrationId::random);
        *moving = Some(id.clone());
        let now = Instant::now();
        let record = {
            let dir = host.root.join("moves");
            let _ = std::fs::create_dir_all(&dir);
            dir.join(format!("{id}.json"))
        };
        Arc::new(MoveRun {
            id,
            vm: name.into(),
            kind,
            req,
            started: now,
            phase: parking_lot::Mutex::new(VmMovePhase::Preparing),
            phases: parking_lot::Mutex::new(vec![(VmMovePhase::Preparing, now)]),
            convergence: Default::default(),
            error: Default::default(),
            report: Default::default(),
            memory_remaining: AtomicU64::new(0),
            memory_rounds: AtomicU64::new(0),
            disk_dirty: AtomicU64::new(0),
            cancel: CancellationToken::new(),
            counters: Arc::default(),
            precopy_sent: parking_lot::Mutex::default(),
            record,
            disk_migrations: Default::default(),
            admins: Default::default(),
        })
    };
    run.save();
    host.moves.lock().insert(run.id.clone(), run.clone());
    let (h, r) = (host.clone(), run.clone());
    tokio::spawn(async move { run_move(h, g, r).await });
    Ok(run.status())
}

/// The forwarders of the guest's disks at this host.
fn disk_upstreams(host: &VmHost, g: &Guest) -> Vec<Arc<ferry_forwarder::Upstream>> {
    g.spec
        .lock()
        .disks
        .iter()
        .filter_map(|d| host.agent.get(&d.volume))
        .collect()
}

async fn run_move(host: Arc<VmHost>, g: Arc<Guest>, run: Arc<MoveRun>) {
    let _op = g.op.lock().await;
    let here = host.reached_at();
    // The longest guest request from here on is the move's. The forwarders
    // are held until the report: a guest that leaves has its disks
    // detached here before the move ends.
    let upstreams = disk_upstreams(&host, &g);
    for u in &upstreams {
        u.io.take_longest();
    }
    // The guest's memory as the controller priced the move: resident in
    // QEMU, else as configured.
    let memory = g.spec.lock().memory_mib << 20;
    let memory = g
        .runtime()
        .and_then(|r| crate::guest::memory_resident_bytes(r.pid, memory))
        .filter(|b| *b > 0)
        .unwrap_or(memory);
    let outcome = match run.kind {
        MoveKind::DiskOnly => disk_only(&host, &g, &run).await,
        MoveKind::VmOnly | MoveKind::Teleport => memory_move(&host, &g, &run).await,
    };
    let outcome = outcome.unwrap_or_else(|e| Outcome::aborted(e.to_string(), &here));
    let end = Instant::now();
    #[allow(clippy::cast_precision_loss)]
    let longest = upstreams
        .iter()
        .map(|u| u.io.take_longest())
        .max()
        .map(|us| us as f64 / 1000.0);
    let mut bytes = MoveBytes {
        memory_raw: run.counters.raw.load(Ordering::Relaxed),
        memory_link: run.counters.link.load(Ordering::Relaxed),
        ..Default::default()
    };
    let mut disk_rounds = 0;
    let mut disk_pause: Option<f64> = None;
    for d in &outcome.disks {
        disk_rounds = disk_rounds.max(d.round);
        if let Some(r) = &d.report {
            bytes.disk_data += r.bytes.data;
            bytes.disk_fingerprints += r.bytes.fingerprints;
            bytes.disk_link += r.bytes.wire_tx + r.bytes.wire_rx;
            disk_pause = Some(disk_pause.unwrap_or(0.0).max(r.time.pause_ms));
        } else {
            bytes.disk_link += d.wire_tx_bytes + d.wire_rx_bytes;
        }
    }
    let memory_stream_bps = measure_stream(&host, &run, outcome.result);
    let memory_link_efficiency = measure_efficiency(&host, &run, outcome.result);
    let memory_setup_s = measure_setup(&host, &run, &outcome, end);
    measure_pause(&host, &run, &outcome, memory);
    let total = end.duration_since(run.started);
    let disk_move_host_s = measure_disk_move_host(&host, &run, &outcome, total);
    let report = VmMoveReport {
        id: run.id.clone(),
        vm: run.vm.clone(),
        kind: run.kind,
        result: outcome.result,
        reason: outcome.reason.clone(),
        running_at: outcome.running_at,
        bytes,
        phases: run.phase_times(end),
        total_s: total.as_secs_f64(),
        memory_rounds: outcome
            .memory_rounds
            .max(run.memory_rounds.load(Ordering::Relaxed)),
        disk_rounds,
        downtime_ms_qemu: outcome.downtime_ms,
        guest_pause_ms: outcome.guest_pause_ms,
        disk_gap_ms: outcome.disk_gap_ms,
        disk_pause_ms: disk_pause,
        guest_io_longest_ms: longest,
        convergence: run.convergence.lock().clone(),
        max_downtime_ms: run.req.max_downtime_ms.unwrap_or(DEFAULT_MAX_DOWNTIME_MS),
        compress: run.req.compress.unwrap_or(true),
        memory_stream_bps,
        memory_setup_s,
        memory_link_efficiency,
        disk_move_host_s,
    };
    if outcome.result != VmMovePhase::Completed {
        *run.error.lock() = outcome.reason;
    }
    *run.report.lock() = Some(report);
    *g.moving.lock() = None;
    run.set_phase(outcome.result);
}

/// Whether a move that ended as `result` was a completed memory move of
/// one stream (no multifd, no post-copy): the kind its host measures.
fn one_stream_completed(run: &MoveRun, result: VmMovePhase) -> bool {
    result == VmMovePhase::Completed
        && run.kind != MoveKind::DiskOnly
        && run.req.multifd == 0
        && !run.went_postcopy()
}

/// Keep `m` in the host's `log` and write the log on a blocking thread;
/// whether it was kept (one no move could make is not).
fn keep<M: ferry_state_file::rate_log::Sample>(
    log: &ferry_state_file::rate_log::RecentLog<M>,
    m: M,
) -> bool {
    if !log.record(m) {
        return false;
    }
    let log = log.clone();
    drop(tokio::task::spawn_blocking(move || log.save()));
    true
}

/// Tell the host's [`VmHost::stream_rate`] what a completed memory move
/// streamed up to its switchover phase (a teleport's pre-switchover
/// pause; a VM-only move's end, QEMU having completed) where this end set
/// its pace ([`stream_measure`]), for a single stream (no multifd, no
/// post-copy). The rate, if measured.
#[allow(clippy::cast_precision_loss)]
fn measure_stream(host: &VmHost, run: &MoveRun, result: VmMovePhase) -> Option<f64> {
    if !one_stream_completed(run, result) {
        return None;
    }
    let PrecopySent { raw, timing, .. } = (*run.precopy_sent.lock())?;
    let Some((bytes, seconds)) = stream_measure(raw, &timing) else {
        tracing::info!(
            move_id = %run.id, raw, span_s = timing.span().as_secs_f64(),
            link_wait_s = timing.link_wait.as_secs_f64(),
            "the memory stream's rate is not measured: small, or held back by the link or the far end"
        );
        return None;
    };
    if !keep(
        &host.stream_rate,
        ferry_state_file::rate_log::Measure { bytes, seconds },
    ) {
        return None;
    }
    let bps = bytes as f64 / seconds;
    tracing::info!(
        move_id = %run.id, raw, seconds,
        link_wait_s = timing.link_wait.as_secs_f64(),
        bps, host_bps = host.stream_rate.bytes_per_second(),
        "the memory stream's rate measured"
    );
    Some(bps)
}

/// Tell the host's [`VmHost::stream_efficiency`] how busy a completed
/// single-stream memory move kept its link up to its switchover, where
/// the link or the far end held it back ([`efficiency_measure`]). The
/// share, if measured.
fn measure_efficiency(host: &VmHost, run: &MoveRun, result: VmMovePhase) -> Option<f64> {
    if !one_stream_completed(run, result) {
        return None;
    }
    let sent = (*run.precopy_sent.lock())?;
    let share = efficiency_measure(&sent)?;
    if !keep(
        &host.stream_efficiency,
        ferry_state_file::rate_log::Share(share),
    ) {
        return None;
    }
    tracing::info!(
        move_id = %run.id, share, link = sent.link,
        span_s = sent.timing.span().as_secs_f64(),
        peak_bps = sent.timing.delivery_peak_bps,
        host_share = host.stream_efficiency.median(),
        "the memory stream's use of its link measured"
    );
    Some(share)
}

/// How busy a memory stream that the link or the far end held back
/// (the sender waited on it for half its span or more: the other case
/// of [`stream_measure`]) kept them: its link bytes over its span, over
/// the largest delivery rate its acknowledgements showed. Below one
/// where the sender had nothing to send (QEMU syncing its dirty bitmap,
/// walking pages it does not send, the sender compressing) for longer
/// than the window in flight covers; the model takes a memory stream's
/// time on a link as its bytes over this share of the link's rate. `None`
/// for a stream under [`MIN_MEASURED_STREAM`], one the machine bound, or
/// one no delivery rate was measured for.
#[allow(clippy::cast_precision_loss)]
pub(crate) fn efficiency_measure(sent: &PrecopySent) -> Option<f64> {
    let span = sent.timing.span();
    if sent.raw < MIN_MEASURED_STREAM || span.is_zero() || !sent.timing.held_back_by_link() {
        return None;
    }
    let peak = sent.timing.delivery_peak_bps.filter(|p| *p > 0.0)?;
    let share = sent.link as f64 / span.as_secs_f64() / peak;
    (share.is_finite() && share > 0.0).then(|| share.min(1.0))
}

/// Tell the host's [`VmHost::setup_cost`] the fixed time of a completed
/// memory move's own part ([`setup_measure`]), for a single stream (no
/// multifd, no post-copy) whose pause is known. The cost, if measured.
fn measure_setup(host: &VmHost, run: &MoveRun, outcome: &Outcome, end: Instant) -> Option<f64> {
    if !one_stream_completed(run, outcome.result) {
        return None;
    }
    // The memory's part begins with the last preparation (a teleport's
    // disks are copied before it).
    let began = run
        .phases
        .lock()
        .iter()
        .rev()
        .find(|(p, _)| *p == VmMovePhase::Preparing)
        .map(|(_, t)| *t)?;
    let pause = Duration::from_secs_f64(outcome.guest_pause_ms? / 1000.0);
    let timing = *run.counters.timing.lock();
    let setup = setup_measure(end.saturating_duration_since(began), &timing, pause)?;
    if !keep(&host.setup_cost, ferry_state_file::rate_log::Seconds(setup)) {
        return None;
    }
    tracing::info!(
        move_id = %run.id, setup_s = setup, host_setup_s = host.setup_cost.median(),
        "the memory move's fixed time measured"
    );
    Some(setup)
}

/// Keep a completed single-stream memory move's guest pause in the
/// host's log of its kind (VM-only, teleport) with the round trip its
/// stream timed and the guest's `memory` (bytes, as the controller
/// priced the move: resident in QEMU as it began): the placement model
/// prices the next pause of that kind from here at what is left of these
/// once its own terms for the link and the memory are taken out. Whether
/// it was kept.
fn measure_pause(host: &VmHost, run: &MoveRun, outcome: &Outcome, memory: u64) -> bool {
    if !one_stream_completed(run, outcome.result) {
        return false;
    }
    let (Some(pause_ms), Some(rtt)) = (outcome.guest_pause_ms, run.counters.timing.lock().base_rtt)
    else {
        return false;
    };
    let pause = ferry_state_file::rate_log::Pause {
        pause_s: pause_ms / 1000.0,
        rtt_s: rtt.as_secs_f64(),
        memory_bytes: memory,
    };
    let log = if run.kind == MoveKind::Teleport {
        &host.teleport_pauses
    } else {
        &host.vm_move_pauses
    };
    let kept = keep(log, pause);
    if kept {
        tracing::info!(
            move_id = %run.id, pause_s = pause.pause_s, rtt_s = pause.rtt_s,
            memory_bytes = pause.memory_bytes, kind = ?run.kind,
            "the move's pause kept for the model"
        );
    }
    kept
}

/// Tell the host's [`VmHost::disk_move_host`] its own part of a completed
/// disk-only move that took `total` ([`disk_move_host_part`]). The part,
/// if measured.
fn measure_disk_move_host(
    host: &VmHost,
    run: &MoveRun,
    outcome: &Outcome,
    total: Duration,
) -> Option<f64> {
    if run.kind != MoveKind::DiskOnly || outcome.result != VmMovePhase::Completed {
        return None;
    }
    let daemons: Option<Vec<f64>> = outcome
        .disks
        .iter()
        .map(|d| d.report.as_ref().map(|r| r.time.total_s))
        .collect();
    let part = disk_move_host_part(total, &daemons?)?;
    if !keep(
        &host.disk_move_host,
        ferry_state_file::rate_log::Seconds(part),
    ) {
        return None;
    }
    tracing::info!(
        move_id = %run.id, host_part_s = part,
        host_median_s = host.disk_move_host.median(),
        "the host's part of the disk move measured"
    );
    Some(part)
}

/// The host's own part of a disk-only move that took `total` while its
/// disks' migrations (run side by side) took `daemons` seconds as their
/// storage daemons timed them: `total` less the slowest of them (asking
/// the daemons to start, following them to the switch, storing the
/// guest's new disk places). The model adds it to a disk move's price
/// from this host. `None` without a disk, or for a daemon's time that is
/// not a duration or longer than the move.
pub(crate) fn disk_move_host_part(total: Duration, daemons: &[f64]) -> Option<f64> {
    let mut slowest: Option<f64> = None;
    for &d in daemons {
        if !(d.is_finite() && d >= 0.0) {
            return None;
        }
        slowest = Some(slowest.map_or(d, |s| s.max(d)));
    }
    let part = total.as_secs_f64() - slowest?;
    (part >= 0.0).then_some(part)
}

/// The fixed time of a memory move whose own part took `whole`, its
/// stream `timing` and its guest paused `pause`: what is left of `whole`
/// once the stream's span, the pause and three round trips (the stream's
/// opening, the `Finish` and its answer) are taken out: the destination
/// QEMU's start, QEMU's set-up and first bitmap sync, the destination's
/// load of the last round and its answer. The model adds back a stream,
/// a pause and round trips of its own to it. `None` without a stream or
/// a round trip, or if it comes out negative.
pub(crate) fn setup_measure(whole: Duration, timing: &SendTiming, pause: Duration) -> Option<f64> {
    let span = timing.span();
    let rtt = timing.base_rtt?;
    if span.is_zero() {
        return None;
    }
    whole
        .checked_sub(span + pause + rtt * 3)
        .map(|d| d.as_secs_f64())
}

/// What a memory stream that sent `raw` bytes with the sender's clock
/// `timing` tells of this machine: its bytes and its span, when the
/// sender spent most of the span on QEMU's stream and the frames (it
/// waited on the link, for room in the window or for the socket, under
/// half of it), so that this end, not the link nor the far end, set its
/// pace. `None` when it sent less than [`MIN_MEASURED_STREAM`] or waited
/// longer: a far end slow to take the stream holds back its
/// acknowledgements, which the sender cannot tell from a slow link
/// (measured at 1 Gbit/s on two shared cores: waits of 60-65% with the
/// link a fifth used), so such a stream tells nothing. The span, not the
/// span less the waits: QEMU goes on walking the memory while the sender
/// waits, and the difference would overstate the machine's speed.
pub(crate) fn stream_measure(raw: u64, timing: &SendTiming) -> Option<(u64, f64)> {
    let span = timing.span();
    if raw < MIN_MEASURED_STREAM || timing.held_back_by_link() {
        return None;
    }
    Some((raw, span.as_secs_f64()))
}

fn admin_of(d: &VmDisk) -> AdminClient {
    AdminClient::new(d.admin.as_deref().unwrap_or_default())
}

/// `d` as its storage daemons say it is now: a spec whose admin address
/// names a daemon the volume has left (a move made before hosts learnt
/// the new address) follows the volume to the admin address that daemon
/// recorded, a few hops at most; one whose daemon does not answer, a
/// shared gateway of a group this host knows, goes to another gateway of
/// the group that does (the forwarder's current one first).
async fn follow_moved(run: &MoveRun, host: &VmHost, d: &VmDisk) -> Result<VmDisk, VmError> {
    let mut d = d.clone();
    for _ in 0..4 {
        let (c, v) = (admin_of(&d), d.volume.clone());
        let view = match blocking(move || c.get_volume(&v)).await {
            Ok(view) => view,
            Err(e) => match stand_in(run, host, &d).await {
                Some((s, view)) => {
                    d = s;
                    view
                }
                None => return Err(e),
            },
        };
        let (Some(to), Some(next)) = (view.moved_to, view.moved_admin) else {
            return Ok(d);
        };
        run.note(format!(
            "disk {}: the storage daemon at {} saw it move to {to}; its admin address there is {next}",
            d.volume,
            d.admin.as_deref().unwrap_or("-")
        ));
        d.admin = Some(next);
    }
    Ok(d)
}

/// `d` at another gateway of its group whose admin API has the volume,
/// when its own does not answer, with what that gateway says of it.
async fn stand_in(
    run: &MoveRun,
    host: &VmHost,
    d: &VmDisk,
) -> Option<(VmDisk, ferry_api::VolumeView)> {
    let current = host.agent.get(&d.volume).map(|u| u.server());
    let gateways = host.gateways.clone();
    for m in gateways.stand_ins(&d.server, d.admin.as_deref(), current.as_deref()) {
        let Some(admin) = m.admin.clone() else {
            continue;
        };
        let (c, v) = (AdminClient::new(&admin), d.volume.clone());
        if let Ok(view) = blocking(move || c.get_volume(&v)).await {
            run.note(format!(
                "disk {}: the storage daemon at {} does not answer; the gateway at {} (admin {admin}) of its group stands in",
                d.volume,
                d.admin.as_deref().unwrap_or("-"),
                m.nbd
            ));
            let s = VmDisk {
                volume: d.volume.clone(),
                server: m.nbd.clone(),
                admin: Some(admin),
            };
            return Some((s, view));
        }
    }
    None
}

/// Start every disk's migration to `to` (held before the switch or not).
async fn start_disks(
    run: &MoveRun,
    host: &VmHost,
    disks: &[VmDisk],
    to: &str,
    hold: bool,
) -> Result<Vec<(VmDisk, MigrationId)>, VmError> {
    let mut out = Vec::new();
    for d in disks {
        let d = &follow_moved(run, host, d).await?;
        let c = admin_of(d);
        let req = MigrateRequest {
            to: to.into(),
            id: Some(MigrationId::random()),
            plaintext: run.req.disk_plaintext,
            max_downtime_ms: Some(run.req.max_downtime_ms.unwrap_or(DEFAULT_MAX_DOWNTIME_MS)),
            hold_switch: hold,
            ..Default::default()
        };
        let vol = d.volume.clone();
        let s = blocking(move || c.migrate(&vol, &req)).await?;
        run.note(format!(
            "disk {}: migration {} started to {to}",
            d.volume, s.id
        ));
        run.disk_migrations.lock().push(DiskMigrationRef {
            volume: d.volume.clone(),
            admin: d.admin.clone().unwrap_or_default(),
            id: s.id.clone(),
            to_admin: run.req.to_storage_admin.clone(),
        });
        run.save();
        out.push((d.clone(), s.id));
    }
    Ok(out)
}

async fn disk_statuses(
    run: &MoveRun,
    disks: &[(VmDisk, MigrationId)],
) -> Result<Vec<MigrationStatus>, VmError> {
    let mut v = Vec::new();
    for (d, id) in disks {
        let (c, id) = (run.admin_of(d), id.clone());
        v.push(blocking(move || c.migration(&id)).await?);
    }
    Ok(v)
}

async fn cancel_disks(run: &MoveRun, disks: &[(VmDisk, MigrationId)]) {
    for (d, id) in disks {
        let (c, i) = (admin_of(d), id.clone());
        match blocking(move || c.cancel_migration(&i)).await {
            Ok(s) => run.note(format!(
                "disk {}: migration cancelled ({})",
                d.volume,
                s.phase.as_str()
            )),
            Err(e) => run.note(format!("disk {}: cancel failed: {e}", d.volume)),
        }
    }
}

/// A wake-up at every status each disk's migration pushes (its daemon
/// sends one per change of phase), so a wait on the disks sees a switch
/// when it happens rather than at its next poll (a disk-only move ended up
/// to [`DISK_POLL`] late). Each watcher is a thread of its own, detached:
/// it ends with its migration, or at the move's deadline, when its call's
/// limit ends it; the poll still runs if one cannot start or its stream
/// breaks.
fn watch_disks(disks: &[(VmDisk, MigrationId)], deadline: Instant) -> Arc<tokio::sync::Notify> {
    let wake = Arc::new(tokio::sync::Notify::new());
    let limit = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_secs(1));
    for (d, id) in disks {
        let c = admin_of(d).limited(limit);
        let (id, w) = (id.clone(), wake.clone());
        let watcher = std::thread::Builder::new()
            .name("disk-watch".into())
            .spawn(move || {
                let _ = c.watch_migration(&id, |_| w.notify_one());
                w.notify_one();
            });
        if let Err(e) = watcher {
            tracing::debug!(error = %e, "no watcher for a disk's migration; polling only");
        }
    }
    wake
}

/// Wait until every disk migration is in a phase `want` accepts; fails on
/// a failed migration, the deadline or a cancel. Asks every `poll`, and,
/// where the poll is longer than [`SWITCH_POLL`], at once when a disk's
/// migration reports a change ([`watch_disks`]).
async fn wait_disks(
    run: &MoveRun,
    disks: &[(VmDisk, MigrationId)],
    want: impl Fn(MigrationPhase) -> bool,
    deadline: Instant,
    poll: Duration,
) -> Result<Vec<MigrationStatus>, VmError> {
    // The switch's short polls run while the guest is stopped: a watcher
    // there (a thread and a connection per disk) would cost the pause
    // more than it could save.
    let changed = (poll > SWITCH_POLL).then(|| watch_disks(disks, deadline));
    loop {
        let st = disk_statuses(run, disks).await?;
        run.disk_dirty
            .store(st.iter().map(|s| s.dirty_bytes).sum(), Ordering::Relaxed);
        if let Some(f) = st.iter().find(|s| s.phase == MigrationPhase::Failed) {
            return Err(VmError::Disk {
                volume: f.volume.clone(),
                detail: format!("failed to migrate: {}", f.error.clone().unwrap_or_default()),
            });
        }
        if st.iter().all(|s| want(s.phase)) {
            return Ok(st);
        }
        if Instant::now() > deadline {
            return Err(VmError::Deadline(format!(
                "the disks were at {}",
                st.iter()
                    .map(|s| format!(
                        "{} {} ({} dirty bytes)",
                        s.volume,
                        s.phase.as_str(),
                        s.dirty_bytes
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        tokio::select! {
            () = run.cancel.cancelled() => return Err(VmError::Cancelled),
            () = tokio::time::sleep(poll) => {}
            () = async {
                match &changed {
                    Some(c) => c.notified().await,
                    None => std::future::pending().await,
                }
            } => {}
        }
    }
}

fn deadline_of(run: &MoveRun) -> Instant {
    run.started + Duration::from_secs(run.req.deadline_s.unwrap_or(DEFAULT_DEADLINE_S))
}

/// Where every switched disk went: from its migration's report (the
/// source's storage has it at hand), else from the source volume's record.
async fn new_places(
    run: &MoveRun,
    disks: &[(VmDisk, MigrationId)],
    reports: &[MigrationStatus],
) -> Result<Vec<SwitchedDisk>, VmError> {
    let mut out = Vec::new();
    for (i, (d, _)) in disks.iter().enumerate() {
        let report = reports.get(i).and_then(|s| s.report.as_ref());
        let (server, advertised) = match report.and_then(|r| r.new_location.clone()) {
            Some(loc) => (loc, report.and_then(|r| r.new_admin.clone())),
            None => {
                let (c, v) = (admin_of(d), d.volume.clone());
                let view = blocking(move || c.get_volume(&v)).await?;
                let to = view.moved_to.ok_or_else(|| VmError::Disk {
                    volume: d.volume.clone(),
                    detail: "switched, but its daemon names no new place".into(),
                })?;
                (to, view.moved_admin)
            }
        };
        let admin = run.req.to_storage_admin.clone().or(advertised);
        if admin.is_none() {
            run.note(format!(
                "disk {}: its new storage daemon advertised no admin address; \
                 the guest's spec keeps {} (its next disk move needs --to-storage-admin \
                 or `ferry vm set {} --disk-admin {}=ADDR`)",
                d.volume,
                d.admin.as_deref().unwrap_or("none"),
                run.vm,
                d.volume
            ));
        }
        out.push(SwitchedDisk {
            volume: d.volume.clone(),
            server,
            admin,
        });
    }
    Ok(out)
}

async fn disk_only(
    host: &Arc<VmHost>,
    g: &Arc<Guest>,
    run: &Arc<MoveRun>,
) -> Result<Outcome, VmError> {
    let spec = g.spec.lock().clone();
    let to = run.req.to_storage.clone().unwrap_or_default();
    run.set_phase(VmMovePhase::DiskPrecopy);
    let disks = start_disks(run, host, &spec.disks, &to, false).await?;
    let st = match wait_disks(
        run,
        &disks,
        |p| p == MigrationPhase::Switched,
        deadline_of(run),
        DISK_POLL,
    )
    .await
    {
        Ok(st) => st,
        Err(e) => {
            cancel_disks(run, &disks).await;
            let mut o = Outcome::aborted(e.to_string(), &host.reached_at());
            o.disks = disk_statuses(run, &disks).await.unwrap_or_default();
            return Ok(o);
        }
    };
    let places = new_places(run, &disks, &st).await?;
    {
        let mut s = g.spec.lock();
        for p in &places {
            if let Some(d) = s.disks.iter_mut().find(|d| d.volume == p.volume) {
                d.server.clone_from(&p.server);
                if let Some(a) = &p.admin {
                    d.admin = Some(a.clone());
                }
            }
        }
    }
    g.save_spec()?;
    Ok(Outcome {
        guest_pause_ms: None,
        result: VmMovePhase::Completed,
        reason: None,
        running_at: host.reached_at(),
        memory_rounds: 0,
        downtime_ms: None,
        disk_gap_ms: None,
        disks: st,
    })
}

async fn memory_move(
    host: &Arc<VmHost>,
    g: &Arc<Guest>,
    run: &Arc<MoveRun>,
) -> Result<Outcome, VmError> {
    let to_host = run.req.to_host.clone().unwrap_or_default();
    let teleport = run.kind == MoveKind::Teleport;
    let spec = g.spec.lock().clone();
    let max_downtime = run.req.max_downtime_ms.unwrap_or(DEFAULT_MAX_DOWNTIME_MS);
    let deadline = deadline_of(run);
    let compress = run.req.compress.unwrap_or(true);
    let here = host.reached_at();

    // What the destination will be asked to take.
    let mut incoming = Vec::new();
    for d in &spec.disks {
        let up = host.agent.get(&d.volume).ok_or_else(|| VmError::Disk {
            volume: d.volume.clone(),
            detail: "not attached on this host".into(),
        })?;
        incoming.push(IncomingDisk {
            volume: d.volume.clone(),
            server: up.server(),
            pending: teleport,
            size: up.details().size,
            flags: up.details().flags,
            arrival: None,
        });
    }
    let mut there = spec.clone();
    if !teleport {
        for d in &mut there.disks {
            if let Some(server) = run.req.disk_servers.get(&d.volume) {
                d.server.clone_from(server);
            }
        }
        for i in &mut incoming {
            if let Some(server) = run.req.disk_servers.get(&i.volume) {
                i.server.clone_from(server);
            }
        }
    }
    if teleport {
        if let Some(a) = &run.req.to_storage_admin {
            for d in &mut there.disks {
                d.admin = Some(a.clone());
            }
        }
    }
    // 0. Before any disk byte crosses: can the destination take the guest
    // (reachable, trusted, its checks of spec, boot files, disks, QEMU,
    // name and memory)? A teleport that cannot finish leaves no copy.
    if teleport {
        let check = PeerRequest::Check {
            version: crate::peer::PEER_VERSION,
            spec: there.clone(),
            disks: incoming.clone(),
        };
        if let Err(e) = call(&host.certs, &to_host, &check, Duration::from_secs(30)).await {
            return Ok(Outcome::aborted(
                format!(
                    "the destination cannot take the guest (checked before copying any disk): {e}"
                ),
                &here,
            ));
        }
        run.note("the destination can take the guest".into());
    }

    // 1. Disk pre-copy, held before the switch.
    let mut disks = Vec::new();
    if teleport {
        run.set_phase(VmMovePhase::DiskPrecopy);
        let to = run.req.to_storage.clone().unwrap_or_default();
        disks = start_disks(run, host, &spec.disks, &to, true).await?;
        crate::fault::hold(crate::fault::DISK_PRECOPY).await;
        if let Err(e) = wait_disks(
            run,
            &disks,
            |p| p == MigrationPhase::ReadyToSwitch,
            deadline,
            DISK_POLL,
        )
        .await
        {
            cancel_disks(run, &disks).await;
            let mut o = Outcome::aborted(e.to_string(), &here);
            o.disks = disk_statuses(run, &disks).await.unwrap_or_default();
            return Ok(o);
        }
        run.note("disks converged; holding before their switch".into());
        run.set_phase(VmMovePhase::Preparing);
        name_arrivals(&mut incoming, &disks, run.req.to_storage_admin.as_deref());
    }

    // 2. The destination waits for the guest.
    let prepare = PeerRequest::Prepare {
        version: crate::peer::PEER_VERSION,
        id: run.id.clone(),
        spec: there,
        disks: incoming,
        postcopy: run.req.postcopy,
        multifd: run.req.multifd,
    };
    if let Err(e) = call(&host.certs, &to_host, &prepare, Duration::from_secs(120)).await {
        cancel_disks(run, &disks).await;
        let mut o = Outcome::aborted(format!("the destination cannot take the guest: {e}"), &here);
        o.disks = disk_statuses(run, &disks).await.unwrap_or_default();
        return Ok(o);
    }

    let r = memory_phase(
        host,
        g,
        run,
        &to_host,
        &disks,
        max_downtime,
        deadline,
        compress,
    )
    .await;
    match r {
        Ok(o) => Ok(o),
        Err(e) => {
            // Before the point of no return: the guest stays here.
            let _ = call(
                &host.certs,
                &to_host,
                &PeerRequest::Abort { id: run.id.clone() },
                Duration::from_secs(30),
            )
            .await;
            // Disks that switched stay where they went (the guest's spec
            // follows them); the others are cancelled.
            let refs = run.disk_migrations.lock().clone();
            for n in crate::recover::settle_disks(g, &refs).await {
                run.note(n);
            }
            let mut o = Outcome::aborted(e.to_string(), &here);
            o.disks = disk_statuses(run, &disks).await.unwrap_or_default();
            Ok(o)
        }
    }
}

/// Tell the destination where it learns of each pending disk's switch:
/// its migration at the destination storage's admin API `admin`, when the
/// move names one (the destination learns of the switch from its own
/// site's storage, a one-way trip before this host could tell it).
fn name_arrivals(
    incoming: &mut [IncomingDisk],
    disks: &[(VmDisk, MigrationId)],
    admin: Option<&str>,
) {
    let Some(admin) = admin else { return };
    for i in incoming {
        i.arrival = disks
            .iter()
            .find(|(d, _)| d.volume == i.volume)
            .map(|(_, id)| DiskArrival {
                migration: id.clone(),
                admin: admin.into(),
            });
    }
}

/// The unix socket the guest's QEMU sends its migration stream to (a
/// confined QEMU's own to connect to).
fn outgoing_socket(g: &Guest) -> Result<tokio::net::UnixListener, VmError> {
    let path = &g.paths.outgoing;
    let io = |e| VmError::file(path, e);
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path).map_err(io)?;
    if let Some(u) = &g.paths.qemu_user {
        crate::confine::give_socket(path, u).map_err(io)?;
    }
    Ok(listener)
}

/// QEMU's migration settings for this move: capabilities, the first
/// allowed pause, and what the request asked for (xbzrle, multifd).
async fn configure_qemu(
    q: &ferry_qmp::QmpClient,
    run: &MoveRun,
    ladder: &Ladder,
    max_downtime: u64,
) -> Result<(), VmError> {
    let teleport = run.kind == MoveKind::Teleport;
    use ferry_qmp::{Capability, MigrateParameters};
    // Each one set either way: a guest that arrived here keeps the
    // capabilities its incoming migration set (multifd, post-copy), and
    // its next move must not send with them unasked.
    let caps = [
        (Capability::AutoConverge, true),
        (Capability::PauseBeforeSwitchover, teleport),
        (Capability::Events, true),
        (Capability::PostcopyRam, run.req.postcopy),
        (Capability::Multifd, run.req.multifd > 0),
        (Capability::Xbzrle, run.req.xbzrle_cache_mib > 0),
    ];
    q.migrate_set_capabilities(&caps).await?;
    q.migrate_set_parameters(&MigrateParameters {
        downtime_limit: Some(ladder.downtime_ms),
        max_bandwidth: Some(1 << 40),
        ..Default::default()
    })
    .await?;
    if run.req.xbzrle_cache_mib > 0 {
        q.migrate_set_parameters(&MigrateParameters {
            xbzrle_cache_size: Some(u64::from(run.req.xbzrle_cache_mib) << 20),
            ..Default::default()
        })
        .await?;
        run.note(format!(
            "pages dirtied again go as XOR deltas (xbzrle, {} MiB cache)",
            run.req.xbzrle_cache_mib
        ));
    }
    if run.req.multifd > 0 {
        q.migrate_set_parameters(&MigrateParameters {
            multifd_channels: Some(run.req.multifd),
            ..Default::default()
        })
        .await?;
        run.note(format!(
            "memory over {} parallel channels (multifd)",
            run.req.multifd
        ));
    }
    run.note(format!(
        "pause allowed: {} ms (maximum {max_downtime} ms)",
        ladder.downtime_ms
    ));
    Ok(())
}

/// The tunnel of the memory stream: each connection QEMU opens on
/// `listener` becomes a TLS stream to the destination.
fn spawn_tunnel(
    host: &VmHost,
    run: &MoveRun,
    to_host: &str,
    listener: tokio::net::UnixListener,
    compress: bool,
) -> tokio::task::JoinHandle<()> {
    let (certs, to, id, counters) = (
        host.certs.clone(),
        to_host.to_string(),
        run.id.clone(),
        run.counters.clone(),
    );
    // A single stream carries the link alone: what the last one to this
    // peer learnt of the link is its own. Multifd's channels share it.
    let rates = (run.req.multifd == 0).then(|| host.link_rates.clone());
    tokio::spawn(async move {
        let mut pipes = tokio::task::JoinSet::new();
        let mut opened = 0u32;
        loop {
            let Ok((unix, _)) = listener.accept().await else {
                break;
            };
            opened += 1;
            tracing::info!(move_id = %id, connection = opened, "QEMU opened a memory stream");
            // One channel at a time up to the destination's answer (it
            // answers once its QEMU took the connection): QEMU 7.2 takes
            // the first connection it gets for the main channel, so
            // with multifd the channels must reach it in the order
            // this QEMU opened them; the pipes then run side by side.
            let req = PeerRequest::Stream {
                id: id.clone(),
                compress,
            };
            let (link, rest) = match exchange(&certs, &to, &req, Duration::from_secs(60)).await {
                Ok((a, link, rest)) if a.ok => (link, rest),
                Ok((a, _, _)) => {
                    tracing::warn!(error = ?a.error, "the destination refused a memory stream");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot open a memory stream");
                    continue;
                }
            };
            let (counters, id, to, rates) =
                (counters.clone(), id.clone(), to.clone(), rates.clone());
            pipes.spawn(async move {
                let known = rates.as_ref().and_then(|r| r.get(&to, Instant::now()));
                let r = pipe(unix, link, compress, rest, known, &counters).await;
                if let (Ok(()), Some(rates), Some((rate, filled))) =
                    (&r, &rates, *counters.link_rate.lock())
                {
                    if rates.learn(&to, rate, filled, Instant::now()) {
                        let rates = rates.clone();
                        tokio::task::spawn_blocking(move || rates.save());
                    }
                    tracing::debug!(move_id = %id, known, rate, filled, "the link's rate learnt");
                }
                // The move's streams together (one without multifd).
                let raw = counters.raw.load(Ordering::Relaxed);
                let error = r.err().map(|e| e.to_string());
                tracing::info!(move_id = %id, bytes = raw, error, "outgoing memory stream ended");
            });
        }
        // Each pipe logged how it ended.
        while pipes.join_next().await.is_some() {}
    })
}

/// Ends the tunnel when the move's memory phase ends.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Send `Finish` (the destination runs the guest when it arrives) on a
/// link opened ahead if there is one: a round trip, not three.
async fn send_finish(
    host: &VmHost,
    run: &MoveRun,
    to_host: &str,
    spare: Option<(crate::tunnel::ClientLink, Instant)>,
    disks: Vec<SwitchedDisk>,
) -> Result<crate::peer::PeerAnswer, VmError> {
    // The destination runs the guest when this arrives: on the link opened
    // ahead if it is still fresh (one round trip, not three).
    let finish = PeerRequest::Finish {
        id: run.id.clone(),
        disks,
    };
    let limit = Duration::from_secs(90);
    let spare = spare
        .filter(|(_, t)| t.elapsed() < SPARE_LINK_AGE)
        .map(|(l, _)| l);
    if let Some(l) = spare {
        match crate::tunnel::ask_on(l, to_host, &finish, limit).await {
            Ok(a) => return Ok(a),
            Err(e) => tracing::debug!(error = %e, "the link opened ahead failed; a new one"),
        }
    }
    crate::tunnel::exchange(&host.certs, to_host, &finish, limit)
        .await
        .map(|(a, _, _)| a)
}

/// Steps 3 to 5. An error here means the guest still runs at the source.
#[allow(clippy::too_many_arguments)]
async fn memory_phase(
    host: &Arc<VmHost>,
    g: &Arc<Guest>,
    run: &Arc<MoveRun>,
    to_host: &str,
    disks: &[(VmDisk, MigrationId)],
    max_downtime: u64,
    deadline: Instant,
    compress: bool,
) -> Result<Outcome, VmError> {
    let rt = g.runtime().ok_or(crate::QemuFault::NotRunning)?;
    let q = rt.qmp.clone();
    let ladder = Ladder::new(
        max_downtime,
        run.req.postcopy,
        deadline.saturating_duration_since(run.started),
    );
    configure_qemu(&q, run, &ladder, max_downtime).await?;

    // The tunnel: QEMU connects here; each connection becomes a TLS stream.
    let _tunnel = AbortOnDrop(spawn_tunnel(
        host,
        run,
        to_host,
        outgoing_socket(g)?,
        compress,
    ));
    let order = MemoryOrder::new(run.kind == MoveKind::Teleport, ladder);
    let copied = copy_memory(host, g, run, &q, to_host, disks, order).await?;
    conclude(host, g, run, &q, to_host, disks, copied).await
}

/// What the memory copy leaves for the Finish step.
struct Copied {
    /// Taken before `migrate`: the guest's STOP event is after it.
    migrate_mark: ferry_qmp::client::EventMark,
    rounds: u64,
    /// A link to the destination opened ahead, for the `Finish`.
    spare: Option<(crate::tunnel::ClientLink, Instant)>,
}

/// Run QEMU's migration to completion as `order` says: feed it QEMU's
/// status at each `MIGRATION` event (or poll), a teleport's disk phases
/// and the caller's cancel, and carry out each step it answers. An error
/// means the guest runs here (QEMU's migration cancelled or failed).
async fn copy_memory(
    host: &Arc<VmHost>,
    g: &Arc<Guest>,
    run: &Arc<MoveRun>,
    q: &ferry_qmp::QmpClient,
    to_host: &str,
    disks: &[(VmDisk, MigrationId)],
    mut order: MemoryOrder,
) -> Result<Copied, VmError> {
    run.set_phase(VmMovePhase::MemoryPrecopy);
    let migrate_mark = q.mark();
    q.migrate(&format!("unix:{}", g.paths.outgoing.display()))
        .await?;
    let mut polls = 0u64;
    // A link to the destination opened ahead, for the `Finish` sent while
    // the guest is stopped.
    let mut spare = crate::tunnel::connect(&host.certs, to_host)
        .await
        .ok()
        .map(|l| (l, Instant::now()));
    loop {
        if spare
            .as_ref()
            .is_some_and(|(_, t)| t.elapsed() > SPARE_LINK_AGE)
        {
            spare = crate::tunnel::connect(&host.certs, to_host)
                .await
                .ok()
                .map(|l| (l, Instant::now()));
        }
        polls += 1;
        let mut step = Step::Wait;
        if order.watching_disks() && polls.is_multiple_of(10) {
            if let Ok(st) = disk_statuses(run, disks).await {
                let phases = st
                    .into_iter()
                    .map(|s| (s.volume, s.phase, s.error))
                    .collect();
                let elapsed = run.started.elapsed();
                step = order.feed(Input::Disks { phases, elapsed });
            }
        }
        if step == Step::Wait && run.cancel.is_cancelled() {
            step = order.feed(Input::CancelAsked);
        }
        // Taken before the query, so a status change after it wakes the
        // wait below at once (QEMU's MIGRATION events).
        let mark = q.mark();
        if step == Step::Wait {
            let info = q.query_migrate().await?;
            step = order.feed(Input::Status {
                info,
                elapsed: run.started.elapsed(),
            });
            run.memory_rounds.store(order.rounds(), Ordering::Relaxed);
            run.memory_remaining
                .store(order.remaining(), Ordering::Relaxed);
        }
        loop {
            match step {
                Step::Wait => break,
                Step::SetDowntime { ms, note } => {
                    let p = ferry_qmp::MigrateParameters {
                        downtime_limit: Some(ms),
                        ..Default::default()
                    };
                    q.migrate_set_parameters(&p).await?;
                    run.note(note);
                    break;
                }
                Step::StartPostcopy { note } => {
                    run.note(note);
                    q.migrate_start_postcopy().await?;
                    run.set_phase(VmMovePhase::Postcopy);
                    break;
                }
                Step::InPostcopy => {
                    run.set_phase(VmMovePhase::Postcopy);
                    break;
                }
                Step::ReleaseDisks => {
                    run.set_phase(VmMovePhase::Switchover);
                    if tracing::enabled!(tracing::Level::DEBUG) {
                        // How long after the guest stopped QEMU's pause
                        // before the switchover was seen here.
                        let stopped = q.wait_named(migrate_mark, "STOP", Duration::ZERO).await;
                        tracing::debug!(
                            stopped_ms_ago = stopped
                                .map_or(f64::NAN, |e| (unix_s(Instant::now()) - e.timestamp) * 1e3),
                            "pre-switchover seen"
                        );
                    }
                    let r = release_disks(run, disks).await;
                    step = order.feed(Input::DisksReleased(r.map_err(|e| e.to_string())));
                }
                Step::Continue => {
                    run.set_phase(VmMovePhase::Switchover);
                    q.migrate_continue().await?;
                    tracing::debug!("QEMU continues past the switchover");
                    break;
                }
                Step::Cancel { why } => {
                    if why.starts_with("did not converge") {
                        run.note(format!("giving up: {why}"));
                    }
                    // QEMU's migration cancelled: the guest resumes here.
                    crate::recover::cancel_migration(g).await;
                    return Err(VmError::MemoryCopy(why));
                }
                Step::Failed { why } => {
                    // QEMU resumes the guest itself when a migration
                    // fails; wait (bounded) until it is done cancelling.
                    let end = Instant::now() + Duration::from_secs(5);
                    while Instant::now() < end {
                        let m = q.mark();
                        let st = q.query_migrate().await.map(|i| i.status).ok();
                        if st != Some(ferry_qmp::MigrationStatus::Cancelling) {
                            break;
                        }
                        let _ = q.wait_named(m, "MIGRATION", POLL).await;
                    }
                    return Err(VmError::MemoryCopy(why));
                }
                Step::Completed => {
                    return Ok(Copied {
                        migrate_mark,
                        rounds: order.rounds(),
                        spare,
                    })
                }
            }
        }
        let _ = q.wait_named(mark, "MIGRATION", POLL).await;
    }
}

/// Step 5. Completed at the source: the guest is paused here. Confirm it
/// runs there before this copy ends, and say how the move ended.
async fn conclude(
    host: &Arc<VmHost>,
    g: &Arc<Guest>,
    run: &Arc<MoveRun>,
    q: &ferry_qmp::QmpClient,
    to_host: &str,
    disks: &[(VmDisk, MigrationId)],
    copied: Copied,
) -> Result<Outcome, VmError> {
    let Copied {
        migrate_mark,
        mut rounds,
        spare,
    } = copied;
    let done = q.query_migrate().await.unwrap_or_default();
    let downtime = done.downtime;
    rounds = rounds.max(done.ram().dirty_sync_count);
    run.set_phase(VmMovePhase::Switchover);
    let last_here = disk_upstreams(host, g)
        .iter()
        .map(|u| u.io.snapshot("", "", 0).last_io_unix_ms)
        .max();
    // A teleport's disks switch while QEMU sends the rest of the guest,
    // and the guest runs there only once they have. Where the destination
    // learns of each switch from its own site's storage, `Finish` goes
    // now; otherwise once they have switched here.
    let learnt_there =
        !disks.is_empty() && run.req.to_storage_admin.is_some() && !run.went_postcopy();
    let placed = if learnt_there {
        Vec::new()
    } else {
        match placed_disks(g, run, disks).await {
            Ok(p) => p,
            Err(why) => return resume_here(host, g, run, q, to_host, why).await,
        }
    };
    if !disks.is_empty() {
        crate::fault::hold(crate::fault::SWITCHOVER).await;
    }
    crate::fault::hold(crate::fault::FINISH).await;
    tracing::debug!(move_id = %run.id, "sending Finish");
    let mut fin = send_finish(host, run, to_host, spare, placed).await;
    if learnt_there {
        fin = match fin {
            Ok(a) if a.ok => {
                // It runs there; the disks' own ends, for the report.
                let _ = disks_switched(run, disks).await;
                Ok(a)
            }
            // It could not learn of them itself: place them from here.
            Ok(a) if !a.arrived => {
                run.note(format!(
                    "the destination did not learn where its disks switched ({}); placing them from here",
                    a.error.unwrap_or_default()
                ));
                match placed_disks(g, run, disks).await {
                    Ok(p) => send_finish(host, run, to_host, None, p).await,
                    Err(why) => return resume_here(host, g, run, q, to_host, why).await,
                }
            }
            other => other,
        };
    }
    let disk_states = disk_statuses(run, disks).await.unwrap_or_default();
    let mut o = match fin {
        Ok(a) if a.ok => {
            crate::fault::hold(crate::fault::SWITCHED).await;
            hand_over(host, g, &run.id).await;
            #[allow(clippy::cast_precision_loss)]
            let gap = match (last_here, a.first_io_unix_ms) {
                (Some(l), Some(f)) if l > 0 => Some(f.saturating_sub(l) as f64),
                _ => None,
            };
            let stopped = q
                .wait_named(migrate_mark, "STOP", Duration::from_millis(100))
                .await
                .ok()
                .map(|e| e.timestamp);
            let guest_pause_ms = match (stopped, a.resumed_unix_s) {
                (Some(s), Some(r)) if r >= s => Some((r - s) * 1000.0),
                _ => None,
            };
            Outcome {
                guest_pause_ms,
                result: VmMovePhase::Completed,
                reason: None,
                running_at: a.control.clone().unwrap_or_else(|| to_host.into()),
                memory_rounds: rounds,
                downtime_ms: downtime,
                disk_gap_ms: gap,
                disks: Vec::new(),
            }
        }
        Ok(a) if a.arrived => {
            // It ran there and is gone (its QEMU died with its host):
            // resuming the copy here would rewind the guest under the
            // writes it made there. It stays paused here for a person.
            Outcome {
                guest_pause_ms: None,
                result: VmMovePhase::Failed,
                reason: Some(crate::recover::lost_there(a.error.as_deref())),
                running_at: "nowhere".into(),
                memory_rounds: rounds,
                downtime_ms: downtime,
                disk_gap_ms: None,
                disks: Vec::new(),
            }
        }
        Ok(a) => {
            let why = format!(
                "the destination could not run the guest ({}); resumed here",
                a.error.unwrap_or_default()
            );
            resume_here(host, g, run, q, to_host, why).await?
        }
        Err(e) => in_doubt(host, g, run, to_host, &e, downtime).await,
    };
    o.memory_rounds = rounds;
    o.disks = disk_states;
    Ok(o)
}

/// Where a teleport's disks are once they have switched, for a `Finish`
/// that places them; why the guest resumes here if they did not. After
/// post-copy the guest may already run there: it stays there, on its
/// disks wherever they are now.
async fn placed_disks(
    g: &Arc<Guest>,
    run: &Arc<MoveRun>,
    disks: &[(VmDisk, MigrationId)],
) -> Result<Vec<SwitchedDisk>, String> {
    match disks_switched(run, disks).await {
        Ok(p) => Ok(p),
        Err(e) if run.went_postcopy() => {
            run.note(format!(
                "the disks' switch did not complete ({e}); the guest ran at the destination in post-copy and stays there, its disks where they are now"
            ));
            let refs = run.disk_migrations.lock().clone();
            for n in crate::recover::settle_disks(g, &refs).await {
                run.note(n);
            }
            let spec = g.spec.lock().clone();
            Ok(spec
                .disks
                .iter()
                .map(|d| SwitchedDisk {
                    volume: d.volume.clone(),
                    server: d.server.clone(),
                    admin: d.admin.clone(),
                })
                .collect())
        }
        Err(e) => Err(format!(
            "the disks' switch did not complete ({e}); resumed here"
        )),
    }
}

/// The guest never ran there (the destination says so, or was never told
/// to run it): the destination drops its copy and the guest runs here, on
/// its disks wherever they are now.
async fn resume_here(
    host: &Arc<VmHost>,
    g: &Arc<Guest>,
    run: &Arc<MoveRun>,
    q: &ferry_qmp::QmpClient,
    to_host: &str,
    why: String,
) -> Result<Outcome, VmError> {
    let _ = call(
        &host.certs,
        to_host,
        &PeerRequest::Abort { id: run.id.clone() },
        Duration::from_secs(30),
    )
    .await;
    q.cont().await?;
    let refs = run.disk_migrations.lock().clone();
    for n in crate::recover::settle_disks(g, &refs).await {
        run.note(n);
    }
    Ok(Outcome::aborted(why, &host.reached_at()))
}

/// In doubt: the guest may run there. Never run it twice: it stays paused
/// here, and the destination is asked again until it answers (a restarted
/// daemon goes on asking).
async fn in_doubt(
    host: &Arc<VmHost>,
    g: &Arc<Guest>,
    run: &Arc<MoveRun>,
    to_host: &str,
    e: &VmError,
    downtime: Option<u64>,
) -> Outcome {
    run.set_phase(VmMovePhase::Resolving);
    run.note(format!(
        "memory sent, but the destination did not confirm ({e}); the guest stays paused here until it answers"
    ));
    let refs = run.disk_migrations.lock().clone();
    let mut wait = Duration::from_secs(1);
    let resolution = loop {
        match crate::recover::resolve(host, g, &run.id, Some(to_host), &refs).await {
            crate::recover::Resolution::Unknown(why) => {
                tracing::info!(move_id = %run.id, "{why}");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(30));
            }
            known => break known,
        }
    };
    match resolution {
        crate::recover::Resolution::There => Outcome {
            guest_pause_ms: None,
            result: VmMovePhase::Completed,
            reason: None,
            running_at: to_host.into(),
            memory_rounds: 0,
            downtime_ms: downtime,
            disk_gap_ms: None,
            disks: Vec::new(),
        },
        other => Outcome::aborted(
            match other {
                crate::recover::Resolution::Here(why) => why,
                _ => String::new(),
            },
            &host.reached_at(),
        ),
    }
}

/// The guest runs at the destination now: end its QEMU here, forget it
/// and its disks, and keep its files (the serial log above all) under
/// `<state>/moved/NAME.ID` for the record.
pub(crate) async fn hand_over(host: &VmHost, g: &Guest, id: &MigrationId) {
    g.moved.store(true, Ordering::SeqCst);
    g.stop_qemu().await;
    let spec = g.spec.lock().clone();
    host.guests.write().remove(&spec.name);
    host.detach_disks(&spec);
    let moved = host.root.join("moved");
    let _ = std::fs::create_dir_all(&moved);
    let _ = std::fs::remove_file(g.paths.dir.join("runtime.json"));
    if std::fs::rename(&g.paths.dir, moved.join(format!("{}.{id}", spec.name))).is_err() {
        let _ = std::fs::remove_dir_all(&g.paths.dir);
    }
}

/// Step 4: QEMU holds the guest stopped; each disk's last delta and switch
/// are released (they run while QEMU sends the rest of the guest).
async fn release_disks(run: &MoveRun, disks: &[(VmDisk, MigrationId)]) -> Result<(), VmError> {
    // The guest is stopped now: one call per disk, all at once, each
    // releasing its migration only if it is ready to switch (the wait
    // below, bounded and short, is for one that is not yet).
    let t = Instant::now();
    let tries: Vec<_> = disks
        .iter()
        .map(|(d, id)| {
            let (c, i, d) = (run.admin_of(d), id.clone(), d.clone());
            tokio::task::spawn_blocking(move || match c.release_switch_if_ready(&i) {
                // Its kept connection closed under it: once more on a new
                // one (releasing if ready twice is releasing once).
                Err(e) if e.status().is_none() => admin_of(&d).release_switch_if_ready(&i),
                r => r,
            })
        })
        .collect();
    let mut not_ready = Vec::new();
    for ((d, id), task) in disks.iter().zip(tries) {
        if !task.await?.map_err(VmError::Storage)?.switch_released {
            not_ready.push((d.clone(), id.clone()));
        }
    }
    if not_ready.is_empty() {
        tracing::debug!(ms = t.elapsed().as_secs_f64() * 1e3, "disks released");
        return Ok(());
    }
    wait_disks(
        run,
        &not_ready,
        |p| p == MigrationPhase::ReadyToSwitch,
        Instant::now() + SWITCH_READY_WAIT,
        SWITCH_POLL,
    )
    .await?;
    for (d, id) in &not_ready {
        let (c, i) = (run.admin_of(d), id.clone());
        blocking(move || c.release_switch(&i)).await?;
    }
    tracing::debug!(
        ms = t.elapsed().as_secs_f64() * 1e3,
        waited_for = not_ready.len(),
        "disks released"
    );
    Ok(())
}

/// Wait (bounded) until a teleport's released disks have switched; where
/// each is now, for the destination's `Finish`. None for a VM-only move.
async fn disks_switched(
    run: &MoveRun,
    disks: &[(VmDisk, MigrationId)],
) -> Result<Vec<SwitchedDisk>, VmError> {
    if disks.is_empty() {
        return Ok(Vec::new());
    }
    // Each daemon says when its migration ends (its event stream, not a
    // poll: every millisecond here is the guest's pause), all at once.
    let ends: Vec<_> = disks
        .iter()
        .map(|(d, id)| {
            let (admin, id) = (d.admin.clone().unwrap_or_default(), id.clone());
            tokio::spawn(async move { crate::recover::until_ended(&admin, &id, SWITCH_WAIT).await })
        })
        .collect();
    let mut st = Vec::new();
    for ((d, _), end) in disks.iter().zip(ends) {
        match end.await.ok().flatten() {
            Some(s) if s.phase == MigrationPhase::Failed => {
                return Err(VmError::Disk {
                    volume: d.volume.clone(),
                    detail: format!("failed to switch: {}", s.error.clone().unwrap_or_default()),
                })
            }
            Some(s) if s.phase == MigrationPhase::Switched => st.push(s),
            // Not known to have ended (the daemon restarting?): ask as before.
            _ => {
                st = wait_disks(
                    run,
                    disks,
                    |p| p == MigrationPhase::Switched,
                    Instant::now() + SWITCH_WAIT,
                    SWITCH_POLL,
                )
                .await?;
                break;
            }
        }
    }
    let pause: f64 = st
        .iter()
        .filter_map(|s| s.report.as_ref().map(|r| r.time.pause_ms))
        .fold(0.0, f64::max);
    run.note(format!("disks switched (their own pause {pause:.0} ms)"));
    new_places(run, disks, &st).await
}

/// Ask a move to stop (before its point of no return).
pub fn cancel(host: &VmHost, id: &MigrationId) -> Result<VmMoveStatus, VmError> {
    let r = host
        .moves
        .lock()
        .get(id)
        .cloned()
        .ok_or_else(|| VmError::NoMove(id.to_string()))?;
    r.cancel.cancel();
    Ok(r.status())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn status(id: &MigrationId, phase: &str) -> serde_json::Value {
        json!({
            "id": id, "vm": "g", "kind": "vm_only", "phase": phase, "elapsed_s": 1.0,
            "memory_remaining": 0, "disk_dirty": 0, "convergence": [], "error": null, "report": null
        })
    }

    #[test]
    fn a_move_left_running_by_a_stopped_daemon_reads_as_resolving_with_the_phase_it_was_in() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("moves");
        std::fs::create_dir_all(&dir).unwrap();
        let (running, done) = (MigrationId::random(), MigrationId::random());
        for (id, phase) in [(&running, "memory_precopy"), (&done, "completed")] {
            std::fs::write(
                dir.join(format!("{id}.json")),
                status(id, phase).to_string(),
            )
            .unwrap();
        }
        std::fs::write(dir.join("garbage.json"), "{not json").unwrap();
        let past = past_moves(d.path());
        assert_eq!(past.len(), 2);
        let r = &past[&running];
        assert_eq!(r.phase, VmMovePhase::Resolving);
        assert!(
            r.error.as_deref().is_some_and(
                |e| e.contains("host daemon stopped during the move (in phase memory_precopy)")
            ),
            "{r:?}"
        );
        assert_eq!(past[&done].phase, VmMovePhase::Completed);
        assert!(past[&done].error.is_none());
        // Written back: a daemon stopped again before it resolved the move
        // reads the same, with the phase it was first in.
        let again = past_moves(d.path());
        assert_eq!(again[&running].phase, VmMovePhase::Resolving);
        assert_eq!(again[&running].error, r.error);
    }

    /// A stream tells the host's rate only when it is large enough and the
    /// link held it back for less than half of its time; its rate is then
    /// its bytes over its span.
    #[test]
    fn a_stream_is_measured_only_where_the_machine_bound_it() {
        let t0 = Instant::now();
        let timing = |span_ms: u64, wait_ms: u64| SendTiming {
            first: Some(t0),
            last: Some(t0 + Duration::from_millis(span_ms)),
            link_wait: Duration::from_millis(wait_ms),
            base_rtt: None,
            delivery_peak_bps: None,
        };
        let big = 100 << 20;
        let (bytes, secs) = stream_measure(big, &timing(2000, 500)).unwrap();
        assert_eq!(bytes, big);
        assert!((secs - 2.0).abs() < 1e-9, "{secs}");
        assert_eq!(stream_measure(big, &timing(2000, 1000)), None, "link-bound");
        assert_eq!(
            stream_measure(MIN_MEASURED_STREAM - 1, &timing(2000, 0)),
            None,
            "too small"
        );
        assert_eq!(
            stream_measure(big, &SendTiming::default()),
            None,
            "nothing sent"
        );
    }

    /// A move's fixed time is what its stream, its pause and three round
    /// trips leave of its own part.
    #[test]
    fn a_moves_fixed_time_is_what_its_stream_pause_and_round_trips_leave() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let timing = SendTiming {
            first: Some(t0),
            last: Some(t0 + ms(2000)),
            link_wait: ms(1500),
            base_rtt: Some(ms(10)),
            delivery_peak_bps: None,
        };
        let s = setup_measure(ms(2600), &timing, ms(40)).unwrap();
        assert!((s - 0.53).abs() < 1e-9, "{s}");
        assert_eq!(setup_measure(ms(2000), &timing, ms(40)), None, "negative");
        let no_rtt = SendTiming {
            base_rtt: None,
            ..timing
        };
        assert_eq!(setup_measure(ms(2600), &no_rtt, ms(40)), None);
        assert_eq!(
            setup_measure(ms(2600), &SendTiming::default(), ms(40)),
            None,
            "no stream"
        );
    }

    /// A disk-only move's host part is its time less its slowest disk's
    /// migration; a daemon's time that is no duration, or one longer than
    /// the move, and a move without disks measure nothing.
    #[test]
    fn a_disk_moves_host_part_is_what_its_slowest_disk_leaves() {
        let ms = Duration::from_millis;
        let part = disk_move_host_part(ms(150), &[0.08, 0.12]).unwrap();
        assert!((part - 0.03).abs() < 1e-9, "{part}");
        assert_eq!(disk_move_host_part(ms(150), &[]), None);
        assert_eq!(disk_move_host_part(ms(100), &[0.12]), None);
        assert_eq!(disk_move_host_part(ms(150), &[0.08, f64::NAN]), None);
        assert_eq!(disk_move_host_part(ms(150), &[-0.01]), None);
    }

    /// A stream the link held back tells how busy it kept the link: its
    /// link bytes over its span, over the largest delivery rate it saw;
    /// one the machine bound, a small one and one with no delivery rate
    /// tell nothing.
    #[test]
    fn a_held_back_stream_tells_how_busy_it_kept_its_link() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let sent = |wait_ms: u64, peak: Option<f64>| PrecopySent {
            raw: 100 << 20,
            link: 40_000_000,
            timing: SendTiming {
                first: Some(t0),
                last: Some(t0 + ms(2000)),
                link_wait: ms(wait_ms),
                base_rtt: Some(ms(10)),
                delivery_peak_bps: peak,
            },
        };
        // 40 MB in 2 s where the link carried 25 MB/s at its busiest.
        let e = efficiency_measure(&sent(1500, Some(25e6))).unwrap();
        assert!((e - 0.8).abs() < 1e-9, "{e}");
        // A peak sampled below the mean (its samples are short) is one.
        assert_eq!(efficiency_measure(&sent(1500, Some(10e6))), Some(1.0));
        assert_eq!(
            efficiency_measure(&sent(500, Some(25e6))),
            None,
            "machine-bound"
        );
        assert_eq!(efficiency_measure(&sent(1500, None)), None, "no rate");
        let small = PrecopySent {
            raw: MIN_MEASURED_STREAM - 1,
            ..sent(1500, Some(25e6))
        };
        assert_eq!(efficiency_measure(&small), None, "too small");
    }
}
