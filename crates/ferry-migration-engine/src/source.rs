//! The source side of a migration: fingerprints the volume, answers the
//! destination's wants, sends dirty rounds while the guest keeps writing,
//! then pauses writers, sends the rest, checks the digest and switches.
//!
//! A link failure before `Done` reconnects and resumes (same migration id)
//! until `retry_for` runs out; the destination keeps what already matches.

use super::converge::{self, ConvergePolicy, RoundStats, Step};
use super::tls::{server_name, CertStore};
use super::transport::{BoxStream, Counted, FrameReader, RateLimit};
use super::{
    blocking, bulk, coalesce, hex, idx, short, unexpected, ChunkTable, KnownPrints, MigrationError,
    MigrationId, MigrationResult, MigrationRun, Phase, Report, ReportBytes, ReportChunks,
    ReportDigest, ReportThrottle, ReportTime, StorageDaemon,
};
use bytes::{Bytes, BytesMut};
use ferry_migration::{Encoding, Message, PrintEntry, SourceOrder, VolumeDescriptor, VERSION};
use ferry_storage::{DirtyBitmap, Volume};
use parking_lot::Mutex;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// Largest `Data` frame, raw.
const DATA_FRAME: u64 = 1 << 20;
/// Fingerprints per `Prints` frame.
const PRINTS_FRAME: usize = 8192;
/// Chunks of `Same` runs per `Prints` frame, at most: the destination
/// reads and hashes them before it answers the frame (256 MiB at 4 KiB
/// chunks, about a second of disk), so an unchanged volume of any size
/// keeps the answers coming well within [`ANSWER_TIMEOUT`].
const SAME_PER_FRAME: u64 = 1 << 16;
/// Keys printed but not yet answered, at most: the scan waits beyond it,
/// so that what the answers say (how much the destination finds) can
/// still change what is sent.
const PRINTS_AHEAD: u64 = 4 * PRINTS_FRAME as u64;
/// Keys answered before the hit rate is judged.
const THIN_SAMPLE: u64 = 2 * PRINTS_FRAME as u64;
/// If the destination wants at least this share (per mille) of the keys
/// it was sent, the rest of the volume goes as data without prints: they
/// would cost more than the few blocks they save.
const THIN_WANTED_PERMILLE: u64 = 970;
/// How long to wait for an answer that needs no disk work on the peer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);
/// How long the paused source waits for the destination's answers beyond
/// the time the last data needs on the link.
const PAUSE_ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// Link rate assumed before one is measured (100 Mbit/s).
const DEFAULT_RATE: f64 = 12.5e6;
/// Longest wait for writes in flight to finish when pausing.
const PAUSE_DRAIN: Duration = Duration::from_secs(10);
/// While held before the switch, send what the guest dirtied this often.
const HOLD_ROUND: Duration = Duration::from_millis(200);
/// A first pass that sent more than this measures the link's rate, and
/// waits for its round's answer before going on; one that sent less (a
/// return, or a move whose destination lacked little) goes on at once.
const MEASURED_PASS: u64 = 4 << 20;

/// What `ferry migrate` asks for.
#[derive(Debug, Clone)]
pub struct MigrateRequest {
    /// The caller's name for the migration; a fresh one when absent.
    pub id: Option<MigrationId>,
    pub volume: String,
    /// `HOST:PORT` of the destination's migration listener.
    pub to: String,
    /// No TLS: only allowed when both ends are on loopback.
    pub plaintext: bool,
    /// Target for the final pause.
    pub max_downtime: Duration,
    /// Bytes per second on the link; 0 is unlimited.
    pub bwlimit: u64,
    /// Dirty rounds before pausing anyway.
    pub max_rounds: u32,
    /// Send fingerprints first (off: the seed's full-copy baseline).
    pub dedup: bool,
    /// zstd for literal data where it pays.
    pub compress: bool,
    /// Keep reconnecting after link failures this long.
    pub retry_for: Duration,
    /// Converge, then wait for [`MigrationRun::release_switch`] before
    /// pausing the guest.
    pub hold_switch: bool,
    /// Only learn how an earlier switch of this (journaled) migration
    /// ended: done there, the volume is marked moved; not, it is served
    /// here again and the migration ends instead of resuming (the daemon's
    /// own look at a volume held in doubt, `in_doubt::run`).
    pub resolve_only: bool,
}

impl Default for MigrateRequest {
    fn default() -> Self {
        MigrateRequest {
            id: None,
            volume: String::new(),
            to: String::new(),
            plaintext: false,
            max_downtime: Duration::from_millis(100),
            bwlimit: 0,
            max_rounds: 30,
            dedup: true,
            compress: true,
            retry_for: Duration::from_secs(60),
            hold_switch: false,
            resolve_only: false,
        }
    }
}

/// A migration the caller asked for: a new one, or the one it already
/// started under the same id.
#[derive(Debug, Clone)]
pub enum Started {
    New(Arc<MigrationRun>),
    Existing(Arc<MigrationRun>),
}

impl Started {
    pub fn run(&self) -> &Arc<MigrationRun> {
        match self {
            Started::New(r) | Started::Existing(r) => r,
        }
    }
}

/// Validate and start a migration in the background. A request naming the
/// id of a migration already started for the same volume and destination
/// answers that migration (idempotent retry).
pub fn start(host: Arc<dyn StorageDaemon>, req: MigrateRequest) -> Result<Started, MigrationError> {
    if let Some(id) = &req.id {
        if let Some(r) = host.registry().get(id) {
            if r.volume == req.volume && r.to == req.to {
                return Ok(Started::Existing(r));
            }
            return Err(MigrationError::IdTaken {
                id: id.clone(),
                volume: r.volume.clone(),
                to: r.to.clone(),
            });
        }
    }
    let vol = host.pool().get(&req.volume)?;
    let state_err = |reason: String| MigrationError::VolumeState {
        volume: req.volume.clone(),
        reason,
    };
    if let Some(to) = vol.moved_to() {
        return Err(state_err(format!("has already moved to {to}")));
    }
    if vol.incoming().is_some() {
        return Err(state_err(
            "is the unfinished copy of an incoming migration".into(),
        ));
    }
    if vol.read_only() {
        return Err(state_err("is read-only".into()));
    }
    if let Some(r) = host.registry().active_for(&req.volume) {
        return Err(MigrationError::AlreadyMigrating {
            volume: req.volume.clone(),
            id: r.id.clone(),
        });
    }
    super::check_chunks(vol.size(), host.chunk_size())?;
    if req.to.is_empty() {
        return Err(MigrationError::BadRequest("no destination given".into()));
    }
    // In doubt (the journal says the switch may have been sent), only the
    // journaled migration may run: it asks the destination what happened.
    if let Some(o) = vol.outgoing().filter(|_| vol.in_doubt()) {
        let other_id = req.id.as_ref().is_some_and(|id| id.as_str() != o.id);
        if o.to != req.to || other_id {
            return Err(state_err(format!(
                "is held: its migration {} to {} may have switched; run that migration again to find out",
                o.id, o.to
            )));
        }
    }
    // A migration to the same destination that began before (this daemon
    // crashed or restarted, or it failed) resumes under its id, so the
    // destination keeps the chunks of its copy that already match.
    let journaled = vol
        .outgoing()
        .filter(|o| o.to == req.to)
        .and_then(|o| o.id.parse::<MigrationId>().ok());
    let id = match (&req.id, journaled) {
        (Some(id), _) => id.clone(),
        (None, Some(j)) => {
            tracing::info!(volume = %req.volume, migration = %j, "resuming the journaled migration");
            j
        }
        (None, None) => MigrationId::random(),
    };
    let run = Arc::new(MigrationRun::new(id, &req.volume, &req.to, req.hold_switch));
    host.registry().insert(run.clone());
    let r = run.clone();
    tokio::spawn(async move {
        let report = migrate(&host, &r, &req, vol).await;
        let ok = report.result == MigrationResult::Switched;
        host.migration_finished(&report);
        if !ok {
            *r.error.lock() = report.error.clone();
        }
        *r.report.lock() = Some(report);
        r.set_phase(if ok { Phase::Switched } else { Phase::Failed });
    });
    Ok(Started::New(run))
}

/// The report's word for a `Welcome`'s copy basis (its wire number).
fn copy_basis(wire: u8) -> ferry_api::DestinationCopy {
    use ferry_api::DestinationCopy as D;
    use ferry_migration::CopyBasis as B;
    match wire {
        w if w == B::Resumed as u8 => D::Resumed,
        w if w == B::LeftoverResumed as u8 => D::LeftoverResumed,
        w if w == B::LeftoverReplaced as u8 => D::LeftoverReplaced,
        w if w == B::Returned as u8 => D::Returned,
        w if w == B::ReturnedTracked as u8 => D::ReturnedTracked,
        _ => D::New,
    }
}

/// How one attempt ended well.
struct Switched {
    location: String,
    admin: String,
    pause: Duration,
    converged: bool,
    source_digest: [u8; 32],
    dest_digest: [u8; 32],
    fingerprints_s: f64,
    rounds_s: f64,
    held_s: f64,
}

async fn migrate(
    state: &Arc<dyn StorageDaemon>,
    run: &Arc<MigrationRun>,
    req: &MigrateRequest,
    vol: Arc<Volume>,
) -> Report {
    let chunk = state.chunk_size();
    let _hold = vol.hold(ferry_storage::Holder::OutgoingMigration);
    let bm_name = format!("migration-{}", &run.id.as_str()[..12]);
    // Journal the migration first, so that a restart resumes it (and, held
    // in doubt, keeps saying the switch may have been sent).
    let journal = ferry_storage::OutgoingMigration {
        id: run.id.to_string(),
        to: run.to.clone(),
        switch_sent: vol.in_doubt(),
        plaintext: req.plaintext,
    };
    let v = vol.clone();
    let journaled = blocking(move || Ok(v.set_outgoing(Some(journal))?)).await;
    vol.take_slowest_write();
    vol.gate().take_throttled();
    let outcome = match journaled.and_then(|()| Ok(vol.create_bitmap(&bm_name, chunk, false)?)) {
        Err(e) => Err(e),
        Ok(bm) => {
            let job = Job {
                run,
                req,
                vol: &vol,
                bm: &bm,
                chunk,
                index: state.index(),
            };
            let last = attempts(state, &job).await;
            if let Err(e) = vol.delete_bitmap(&bm_name) {
                tracing::warn!(error = %e, "could not remove the migration bitmap");
            }
            last
        }
    };
    let c = &run.counters;
    let g = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let throttled = vol.gate().take_throttled();
    let (result, error, sw) = match outcome {
        Ok(s) => (MigrationResult::Switched, None, Some(s)),
        Err(e) => {
            tracing::error!(migration = %run.id, error = %e, "migration failed; the source volume stays authoritative");
            (MigrationResult::Failed, Some(e.to_string()), None)
        }
    };
    let total = run.started.elapsed();
    // One connection, no hold for the caller: the hold is the switch's own
    // work and one round trip, which the migration timed.
    if let (Some(s), Some(rtt)) = (&sw, c.link_rtt()) {
        if !req.hold_switch && g(&c.attempts) == 1 {
            state.switch_hold_measured(s.pause, rtt);
            if g(&c.rounds) == 0 && g(&run.wire.tx) <= MEASURED_PASS {
                state.move_setup_measured(fixed_work(total, rtt, s.pause));
            }
        }
    }
    let wire_rx = g(&run.wire.rx);
    Report {
        id: run.id.clone(),
        volume: run.volume.clone(),
        to: run.to.clone(),
        result,
        error,
        new_location: sw.as_ref().map(|s| s.location.clone()),
        new_admin: sw
            .as_ref()
            .map(|s| s.admin.clone())
            .filter(|a| !a.is_empty()),
        size: vol.size(),
        chunk_size: chunk,
        dedup: req.dedup,
        compress: req.compress,
        tls: !req.plaintext,
        bytes: ReportBytes {
            fingerprints: g(&c.bytes_fingerprints),
            data: g(&c.bytes_data),
            data_raw: g(&c.bytes_data_raw),
            protocol: g(&c.bytes_protocol),
            wire_tx: g(&run.wire.tx),
            wire_rx,
            resent_after_failures: g(&c.bytes_lost_to_failures),
        },
        chunks: ReportChunks {
            total: g(&c.chunks_total),
            zero: g(&c.chunks_zero),
            local: g(&c.chunks_local),
            buddy: g(&c.chunks_buddy),
            resumed: g(&c.chunks_resumed),
            sent: g(&c.chunks_sent),
            dirty_resent: g(&c.chunks_dirty_sent),
            unprinted: g(&c.chunks_unprinted),
            unchanged: g(&c.chunks_unchanged),
            unread: g(&c.chunks_unread),
        },
        time: ReportTime {
            total_s: total.as_secs_f64(),
            fingerprints_s: sw.as_ref().map_or(0.0, |s| s.fingerprints_s),
            rounds_s: sw.as_ref().map_or(0.0, |s| s.rounds_s),
            held_s: sw.as_ref().map_or(0.0, |s| s.held_s),
            pause_ms: sw.as_ref().map_or(0.0, |s| s.pause.as_secs_f64() * 1e3),
            slowest_write_ms: vol.take_slowest_write().as_secs_f64() * 1e3,
            link_rtt_ms: c.link_rtt().map(|r| r.as_secs_f64() * 1e3),
        },
        rounds: g(&c.rounds),
        converged: sw.as_ref().is_some_and(|s| s.converged),
        auto_converge: ReportThrottle {
            max_delay_us: u64::try_from(throttled.longest.as_micros()).unwrap_or(u64::MAX),
            writes_delayed: throttled.writes,
        },
        attempts: g(&c.attempts),
        destination_copy: copy_basis(c.destination_copy.load(Ordering::Relaxed)),
        digest: ReportDigest {
            source: sw
                .as_ref()
                .map(|s| hex(&s.source_digest))
                .unwrap_or_default(),
            destination: sw.as_ref().map(|s| hex(&s.dest_digest)).unwrap_or_default(),
            matches: sw.is_some(),
        },
    }
}

/// What a migration that sent little took besides its link
/// ([`StorageDaemon::move_setup_measured`]): its whole time less the
/// pause (the switch's hold, one round trip in it) and the three round
/// trips it waited before the pause (TLS, `Hello`'s answer, the prints'
/// answer; a first pass of at most [`MEASURED_PASS`] does not wait for
/// round 0's). The bytes' own time, at most 4 MiB's, stays in it.
fn fixed_work(total: Duration, rtt: Duration, pause: Duration) -> Duration {
    total.saturating_sub(rtt * 3).saturating_sub(pause)
}

fn frame_bytes(run: &MigrationRun) -> u64 {
    let c = &run.counters;
    c.bytes_fingerprints.load(Ordering::Relaxed)
        + c.bytes_data.load(Ordering::Relaxed)
        + c.bytes_protocol.load(Ordering::Relaxed)
}

async fn connect(
    state: &dyn StorageDaemon,
    req: &MigrateRequest,
    run: &MigrationRun,
) -> Result<BoxStream, MigrationError> {
    dial(state, &req.to, req.plaintext, run.wire.clone()).await
}

/// Connect to another daemon's migration listener: TLS with pinned
/// certificates, or plaintext when asked and both ends are loopback.
pub(crate) async fn dial(
    state: &dyn StorageDaemon,
    to: &str,
    plaintext: bool,
    wire: Arc<super::WireCounters>,
) -> Result<BoxStream, MigrationError> {
    let tcp = tokio::time::timeout(Duration::from_secs(10), tokio::net::TcpStream::connect(to))
        .await
        .map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, format!("connecting to {to}"))
        })??;
    tcp.set_nodelay(true)?;
    let loopback = tcp.peer_addr()?.ip().is_loopback() && tcp.local_addr()?.ip().is_loopback();
    let counted = Counted::new(tcp, wire);
    if plaintext {
        if !loopback {
            return Err(MigrationError::BadRequest(
                "plaintext migrations are only allowed between two loopback addresses".into(),
            ));
        }
        tracing::warn!(%to, "PLAINTEXT migration link (no TLS): loopback only, never across sites");
        return Ok(Box::new(counted));
    }
    let cfg = CertStore::new(state.pool().root()).client_config()?;
    let tls = tokio_rustls::TlsConnector::from(cfg)
        .connect(server_name(), counted)
        .await
        .map_err(handshake_error)?;
    Ok(Box::new(tls))
}

/// A TLS handshake that failed for any TLS reason (not a cut link) fails
/// the migration at once: another attempt would fail the same way.
fn handshake_error(e: std::io::Error) -> MigrationError {
    let tls = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        .cloned();
    match tls {
        // What a plaintext ferry listener answers a TLS client with.
        Some(rustls::Error::AlertReceived(rustls::AlertDescription::ProtocolVersion)) => {
            MigrationError::PeerWithoutTls
        }
        Some(t) => MigrationError::Handshake(t.to_string()),
        None => MigrationError::Link(e),
    }
}

/// Run attempts until the migration switches, fails for good, or the link
/// stays down past `retry_for` (one second between attempts); then settle
/// what the outcome leaves: a switch in doubt holds the volume, a failure
/// clears the journaled switch, and the volume's writes go on.
async fn attempts(
    state: &Arc<dyn StorageDaemon>,
    job: &Job<'_>,
) -> Result<Switched, MigrationError> {
    let Job { run, req, vol, .. } = *job;
    let mut last;
    // Held since a restart: the switch may have happened; the first
    // Hello asks the destination.
    let mut pending: Option<PendingSwitch> = vol.in_doubt().then(|| PendingSwitch {
        pause_start: Instant::now(),
        source_digest: [0; 32],
        converged: false,
        fingerprints_s: 0.0,
        rounds_s: 0.0,
        held_s: 0.0,
    });
    let mut streak: Option<Instant> = None;
    loop {
        run.counters.attempts.fetch_add(1, Ordering::Relaxed);
        let sent_before = frame_bytes(run);
        let began = Instant::now();
        last = attempt(state, job, &mut pending).await;
        // The retry window counts from the first of consecutive
        // failures; an attempt that ran a while was progress.
        if began.elapsed() > Duration::from_secs(10) {
            streak = None;
        }
        let since = *streak.get_or_insert_with(Instant::now);
        match &last {
            Err(e) if e.transient() && since.elapsed() < req.retry_for => {
                let lost = frame_bytes(run) - sent_before;
                run.counters
                    .bytes_lost_to_failures
                    .fetch_add(lost, Ordering::Relaxed);
                if pending.is_some() {
                    tracing::warn!(migration = %run.id, error = %e, "link lost during the switch; guest writes stay held until the destination says whether it committed");
                } else {
                    tracing::warn!(migration = %run.id, error = %e, "migration link failed; resuming");
                    run.set_phase(Phase::Connecting);
                }
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    () = run.cancel.cancelled() => break,
                }
            }
            _ => break,
        }
    }
    if pending.is_some() {
        tracing::error!(migration = %run.id, volume = %run.volume, "the link failed during the switch and the destination did not answer again: the volume is held (no I/O) until the same migration is run again and the destination says whether it committed");
        vol.set_in_doubt(true);
        last = Err(MigrationError::SwitchUnknown);
    } else if last.is_err() {
        // The destination did not commit: nothing is in doubt.
        let v = vol.clone();
        let _ = blocking(move || Ok(v.set_switch_sent(false)?)).await;
    }
    vol.gate().set_throttle(Duration::ZERO);
    vol.gate().resume();
    if last.is_ok() {
        state.volume_moved(vol);
    }
    last
}

/// An encoded frame for the writer task, and what it counts as.
struct Outgoing {
    kind: Kind,
    bytes: Bytes,
}

#[derive(Clone, Copy)]
enum Kind {
    Prints,
    Data,
    Protocol,
}

fn frame(kind: Kind, m: &Message) -> Outgoing {
    let mut b = BytesMut::new();
    m.encode(&mut b);
    Outgoing {
        kind,
        bytes: b.freeze(),
    }
}

fn link_closed() -> MigrationError {
    MigrationError::Link(std::io::Error::new(
        std::io::ErrorKind::BrokenPipe,
        "the migration link closed",
    ))
}

/// Context the blocking helpers share.
struct Sender {
    tx: mpsc::Sender<Outgoing>,
    vol: Arc<Volume>,
    table: Arc<ChunkTable>,
    run: Arc<MigrationRun>,
    chunk: u64,
    /// Keys in each `Prints` frame sent and not yet answered, oldest first.
    unanswered: parking_lot::Mutex<std::collections::VecDeque<u64>>,
    /// The connection's zstd stream, when compressing.
    stream: Option<parking_lot::Mutex<super::stream::StreamEncoder>>,
    /// The chunks written since the volume arrived here, when the
    /// destination kept the copy it left by that migration
    /// ([`ferry_migration::CopyBasis::ReturnedTracked`]): every other
    /// non-zero chunk goes as a `Same` run.
    written_since_arrival: Option<Arc<ferry_storage::DirtyBitmap>>,
    /// The site's index, when it hashes blocks of the chunk size (its
    /// prints of the volume stand in for reading it).
    indexed: Option<Arc<ferry_index::PoolIndex>>,
}

impl Sender {
    /// The index's prints of `n` chunks from `first`, or `None` (no
    /// current prints: read them all). A write that lands after this look
    /// is in the migration's own bitmap and goes in a round.
    fn known_prints(&self, first: u64, n: usize) -> Option<KnownPrints> {
        super::known_prints(self.indexed.as_ref()?, &self.vol, self.chunk, first, n)
    }

    /// Read what `known` does not vouch for (all of it without `known`)
    /// into `buf`, the segment at `pos`.
    fn read_segment(
        &self,
        pos: u64,
        buf: &mut [u8],
        known: Option<&KnownPrints>,
    ) -> Result<(), MigrationError> {
        let Some(k) = known else {
            self.vol.read_sparse_at(pos, buf)?;
            return Ok(());
        };
        let chunk = usize::try_from(self.chunk).unwrap_or(usize::MAX);
        for (first, count) in coalesce(
            k.written
                .iter()
                .enumerate()
                .filter(|(_, w)| **w)
                .map(|(i, _)| i as u64),
        ) {
            let from = idx(first) * chunk;
            let to = (from + idx(u64::from(count)) * chunk).min(buf.len());
            self.vol
                .read_sparse_at(pos + from as u64, &mut buf[from..to])?;
        }
        Ok(())
    }

    fn send(&self, o: Outgoing) -> Result<(), MigrationError> {
        self.tx.blocking_send(o).map_err(|_| link_closed())
    }

    /// Read, record, compress and queue the chunks of `ranges` (blocking).
    fn send_ranges(&self, ranges: &[(u64, u32)], dirty: bool) -> Result<(), MigrationError> {
        let size = self.vol.size();
        let per_frame = (DATA_FRAME / self.chunk).max(1);
        let mut buf = Vec::new();
        for &(first, count) in ranges {
            let mut c = first;
            let end = first + u64::from(count);
            while c < end {
                let n = (end - c).min(per_frame);
                let off = c * self.chunk;
                let len = (n * self.chunk).min(size.saturating_sub(off));
                if len == 0 {
                    break;
                }
                buf.resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
                self.vol.read_sparse_at(off, &mut buf)?;
                self.table.record(c, &buf);
                let k = &self.run.counters;
                k.bytes_data_raw.fetch_add(len, Ordering::Relaxed);
                if dirty {
                    k.chunks_dirty_sent.fetch_add(n, Ordering::Relaxed);
                } else {
                    k.chunks_sent.fetch_add(n, Ordering::Relaxed);
                }
                self.send_data(off, &buf)?;
                c += n;
            }
        }
        Ok(())
    }

    /// Queue one `Data` frame; literal data goes through the connection's
    /// zstd stream (under its lock, so pieces leave in stream order).
    fn send_data(&self, offset: u64, raw: &[u8]) -> Result<(), MigrationError> {
        let raw_len = u32::try_from(raw.len())
            .map_err(|_| MigrationError::BadRequest("data frame over 4 GiB".into()))?;
        let data = |encoding, bytes| Message::Data {
            offset,
            encoding,
            raw_len,
            bytes,
        };
        match &self.stream {
            Some(st) => {
                let mut st = st.lock();
                let z = st.piece(raw)?;
                self.send(frame(
                    Kind::Data,
                    &data(Encoding::ZstdStream, Bytes::from(z)),
                ))
            }
            None => self.send(frame(
                Kind::Data,
                &data(Encoding::Raw, Bytes::copy_from_slice(raw)),
            )),
        }
    }

    /// Phase 1: fingerprint every chunk; zero runs as intervals. When
    /// fingerprints are off, the non-zero chunks go to `literal_tx` segment
    /// by segment instead (they are all sent).
    fn scan(
        &self,
        dedup: bool,
        literal_tx: &mpsc::UnboundedSender<Vec<(u64, u32)>>,
    ) -> Result<(), MigrationError> {
        let size = self.vol.size();
        let chunks = self.table.chunks();
        const SEGMENT: u64 = 8 << 20;
        let mut entries: Vec<PrintEntry> = Vec::with_capacity(PRINTS_FRAME);
        let mut first = 0u64;
        let mut literal = Vec::new();
        let mut buf = Vec::new();
        let k = &self.run.counters;
        let mut pos = 0u64;
        let mut printing = dedup;
        let mut keys_sent = 0u64;
        let mut same_in_frame = 0u64;
        let mut flush = |entries: &mut Vec<PrintEntry>, first: &mut u64, next: u64| {
            if entries.is_empty() {
                *first = next;
                return Ok(());
            }
            let keys = entries
                .iter()
                .filter(|e| matches!(e, PrintEntry::Key(_)))
                .count() as u64;
            // Stay at most PRINTS_AHEAD keys ahead of the answers.
            while keys > 0
                && keys_sent.saturating_sub(k.keys_answered.load(Ordering::Relaxed)) > PRINTS_AHEAD
            {
                if self.run.cancel.is_cancelled() {
                    return Err(MigrationError::Cancelled);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            keys_sent += keys;
            self.unanswered.lock().push_back(keys);
            let m = Message::Prints {
                first_chunk: *first,
                entries: std::mem::take(entries),
            };
            *first = next;
            self.send(frame(Kind::Prints, &m))
        };
        while pos < size {
            if self.run.cancel.is_cancelled() {
                return Err(MigrationError::Cancelled);
            }
            let seg = SEGMENT.min(size - pos);
            buf.resize(usize::try_from(seg).unwrap_or(usize::MAX), 0);
            let known = self.known_prints(pos / self.chunk, idx(seg.div_ceil(self.chunk)));
            self.read_segment(pos, &mut buf, known.as_ref())?;
            let mut off = 0usize;
            while off < buf.len() {
                let ci = (pos + off as u64) / self.chunk;
                let n = self.table.len_of(ci).min(buf.len() - off);
                let data = &buf[off..off + n];
                let written =
                    |a: &ferry_storage::DirtyBitmap| a.is_dirty(pos + off as u64, n as u64);
                // Its print as the index keeps it (`None`: read and hashed).
                let kept = known.as_ref().and_then(|kn| {
                    let i = idx((ci * self.chunk - pos) / self.chunk);
                    (!kn.written[i]).then_some(kn.entries[i])
                });
                if kept.is_some() {
                    k.chunks_unread.fetch_add(1, Ordering::Relaxed);
                }
                let zero = match kept {
                    Some(e) => e == ferry_index::prints::ZERO_ENTRY,
                    None => ferry_index::is_zero(data),
                };
                let print = || kept.unwrap_or_else(|| short(blake3::hash(data).as_bytes()));
                if zero {
                    k.chunks_zero.fetch_add(1, Ordering::Relaxed);
                    match entries.last_mut() {
                        Some(PrintEntry::Zero(z)) if *z < u32::MAX => *z += 1,
                        _ => entries.push(PrintEntry::Zero(1)),
                    }
                } else if self
                    .written_since_arrival
                    .as_deref()
                    .is_some_and(|a| !written(a))
                {
                    // As the migration that brought it here left it, at
                    // both ends: the destination hashes its own copy. A
                    // write racing this read is in this migration's own
                    // bitmap, and goes in a round.
                    self.table.set_short(ci, print());
                    k.chunks_unchanged.fetch_add(1, Ordering::Relaxed);
                    same_in_frame += 1;
                    match entries.last_mut() {
                        Some(PrintEntry::Same(z)) if *z < u32::MAX => *z += 1,
                        _ => entries.push(PrintEntry::Same(1)),
                    }
                } else {
                    let p = print();
                    self.table.set_short(ci, p);
                    if printing {
                        entries.push(PrintEntry::Key(ferry_index::prints::key_of(&p)));
                    } else {
                        // Without fingerprints a gap between entries means
                        // "sent as data".
                        literal.push(ci);
                        if dedup {
                            k.chunks_unprinted.fetch_add(1, Ordering::Relaxed);
                        }
                        flush(&mut entries, &mut first, ci + 1)?;
                        same_in_frame = 0;
                    }
                }
                k.chunks_printed.fetch_add(1, Ordering::Relaxed);
                if entries.len() >= PRINTS_FRAME || same_in_frame >= SAME_PER_FRAME {
                    flush(&mut entries, &mut first, ci + 1)?;
                    same_in_frame = 0;
                    if printing && prints_pay_too_little(k) {
                        printing = false;
                        tracing::info!(
                            volume = %self.vol.name(),
                            answered = k.keys_answered.load(Ordering::Relaxed),
                            wanted = k.chunks_wanted.load(Ordering::Relaxed),
                            "the destination finds almost none of this volume's blocks: the rest goes as data, without fingerprints"
                        );
                    }
                }
                off += n;
            }
            if !literal.is_empty() {
                literal_tx
                    .send(coalesce(literal.drain(..)))
                    .map_err(|_| link_closed())?;
            }
            pos += seg;
        }
        flush(&mut entries, &mut first, chunks)?;
        self.send(frame(Kind::Protocol, &Message::PrintsDone))
    }
}

/// Whether the destination has answered enough prints to judge, and
/// wanted nearly all of them.
fn prints_pay_too_little(k: &super::Counters) -> bool {
    let answered = k.keys_answered.load(Ordering::Relaxed);
    let wanted = k.chunks_wanted.load(Ordering::Relaxed);
    answered >= THIN_SAMPLE && wanted.saturating_mul(1000) >= answered * THIN_WANTED_PERMILLE
}

/// Resumes the volume's writers when dropped, unless disarmed (the switch
/// happened, or its outcome is unknown).
struct PauseGuard<'a> {
    vol: &'a Volume,
    armed: bool,
}
impl Drop for PauseGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.vol.gate().resume();
        }
    }
}

/// A switch whose answer was lost with the link: the guest's writes stay
/// paused until a new connection learns whether the destination committed.
struct PendingSwitch {
    pause_start: Instant,
    source_digest: [u8; 32],
    converged: bool,
    fingerprints_s: f64,
    rounds_s: f64,
    held_s: f64,
}

/// End round `round` and wait for its `Synced`: the destination has written
/// and flushed everything sent so far (so the final pause has little left
/// to flush). With `release`, stop waiting once it fires (`Ok(false)`): the
/// switch was released while the answer was on its way, and the pause
/// reads it before the verdict rather than keep a stopped guest waiting a
/// round trip for it (the destination still flushes the round first).
async fn sync_round(
    link: &Link<'_>,
    in_rx: &mut mpsc::UnboundedReceiver<Result<Message, MigrationError>>,
    cancel: &tokio_util::sync::CancellationToken,
    round: u32,
    dirty_bytes: u64,
    release: Option<&tokio_util::sync::CancellationToken>,
) -> Result<bool, MigrationError> {
    link.send(Message::RoundEnd { round, dirty_bytes }).await?;
    let never = tokio_util::sync::CancellationToken::new();
    let release = release.unwrap_or(&never);
    // `recv` is cancel-safe: an answer not taken here stays queued.
    tokio::select! {
        biased;
        r = synced(in_rx, cancel, round) => r.map(|()| true),
        () = release.cancelled() => Ok(false),
    }
}

/// Wait for the `Synced` of round `round`, ended before.
async fn synced(
    in_rx: &mut mpsc::UnboundedReceiver<Result<Message, MigrationError>>,
    cancel: &tokio_util::sync::CancellationToken,
    round: u32,
) -> Result<(), MigrationError> {
    match next_msg(in_rx, ANSWER_TIMEOUT, Some(cancel)).await? {
        Message::Synced { round: r } if r == round => Ok(()),
        m => Err(unexpected(&m, "waiting for the end of a round")),
    }
}

/// The protocol messages of one connection go out through here, so the
/// order checker knows what was sent before the answers come back.
struct Link<'a> {
    tx: &'a mpsc::Sender<Outgoing>,
    order: &'a Mutex<SourceOrder>,
    pings: &'a Mutex<Pings>,
}

/// The `Ping`s of one connection.
#[derive(Default)]
struct Pings {
    sent: u64,
    /// When each one not yet answered was sent, oldest first.
    waiting: std::collections::VecDeque<Instant>,
}

impl Link<'_> {
    async fn send(&self, m: Message) -> Result<(), MigrationError> {
        self.order.lock().sent(&m);
        self.tx
            .send(frame(Kind::Protocol, &m))
            .await
            .map_err(|_| link_closed())
    }

    /// Ask for one round trip the destination answers at once; the
    /// reader times it when its `Pong` comes
    /// ([`crate::Counters::link_rtt_timed`]). Sent where nothing else
    /// waits ahead of it on the link (before the prints, before each
    /// round), so the fastest is the link's own.
    async fn ping(&self) -> Result<(), MigrationError> {
        let nonce = {
            let mut p = self.pings.lock();
            p.waiting.push_back(Instant::now());
            p.sent += 1;
            p.sent
        };
        self.send(Message::Ping { nonce }).await
    }
}

/// What every attempt of one migration works on.
struct Job<'a> {
    run: &'a Arc<MigrationRun>,
    req: &'a MigrateRequest,
    vol: &'a Arc<Volume>,
    /// The migration's dirty bitmap (granularity = chunk).
    bm: &'a Arc<DirtyBitmap>,
    chunk: u32,
    /// This site's index, whose prints of the volume stand in for reading
    /// what was not written since it was hashed.
    index: &'a Arc<ferry_index::PoolIndex>,
}

async fn attempt(
    state: &Arc<dyn StorageDaemon>,
    job: &Job<'_>,
    pending: &mut Option<PendingSwitch>,
) -> Result<Switched, MigrationError> {
    let Job { run, req, .. } = *job;
    if pending.is_none() {
        run.set_phase(Phase::Connecting);
    }
    let stream = connect(state.as_ref(), req, run).await?;
    let (rd, mut wr) = tokio::io::split(stream);
    let mut reader = FrameReader::new(rd);
    let order = Arc::new(Mutex::new(SourceOrder::new(pending.is_some())));
    let hello = hello(state.as_ref(), job);
    let n = super::transport::send(&mut wr, &hello).await?;
    run.counters
        .bytes_protocol
        .fetch_add(n as u64, Ordering::Relaxed);
    let answer = reader.expect(ANSWER_TIMEOUT).await?;
    order.lock().receive(&answer)?;
    if let Some(done) = greeted(state, job, pending, answer).await? {
        return Ok(done);
    }

    // The writer task owns the socket's write half.
    let (tx, mut rx) = mpsc::channel::<Outgoing>(16);
    let wrun = run.clone();
    let bw = req.bwlimit;
    let writer = tokio::spawn(async move {
        let mut limit = RateLimit::new(bw);
        while let Some(Outgoing { kind, bytes }) = rx.recv().await {
            limit.take(bytes.len()).await;
            wr.write_all(&bytes).await?;
            let c = &wrun.counters;
            let counter = match kind {
                Kind::Prints => &c.bytes_fingerprints,
                Kind::Data => &c.bytes_data,
                Kind::Protocol => &c.bytes_protocol,
            };
            counter.fetch_add(bytes.len() as u64, Ordering::Relaxed);
            if rx.is_empty() {
                wr.flush().await?;
            }
        }
        wr.flush().await?;
        let _ = wr.shutdown().await;
        Ok::<(), std::io::Error>(())
    });
    // The reader task forwards what the destination says, but for the
    // answers to this attempt's `Ping`s, which it times.
    let (in_tx, mut in_rx) = mpsc::unbounded_channel::<Result<Message, MigrationError>>();
    let reader_order = order.clone();
    let pings = Arc::new(Mutex::new(Pings::default()));
    let (pinged, rrun) = (pings.clone(), run.clone());
    let reader_task = tokio::spawn(async move {
        loop {
            let r = reader.next().await;
            let end = !matches!(r, Ok(Some(_)));
            let item = match r {
                Ok(Some(m)) => match reader_order.lock().receive(&m) {
                    Ok(_) if matches!(m, Message::Pong { .. }) => {
                        if let Some(t) = pinged.lock().waiting.pop_front() {
                            rrun.counters.link_rtt_timed(t.elapsed());
                        }
                        continue;
                    }
                    Ok(_) => Ok(m),
                    Err(v) => Err(unexpected_or(&m, v)),
                },
                Ok(None) => Err(link_closed()),
                Err(e) => Err(e),
            };
            if in_tx.send(item).is_err() || end {
                break;
            }
        }
    });
    let link = Link {
        tx: &tx,
        order: &order,
        pings: &pings,
    };
    // The link's share of the switch's hold, told apart from the work at
    // either end ([`StorageDaemon::switch_hold_measured`]).
    let result = match link.ping().await {
        Ok(()) => run_phases(job, &link, &mut in_rx, pending).await,
        Err(e) => Err(e),
    };
    drop(tx);
    match result {
        Ok(s) => {
            let _ = writer.await;
            reader_task.abort();
            Ok(s)
        }
        Err(e) => {
            writer.abort();
            reader_task.abort();
            Err(e)
        }
    }
}

/// What the destination answered `Hello` with: `Welcome` (the migration
/// goes on: `None`; a switch left pending is known not to have happened),
/// `Done` (a pending switch did happen: the volume is marked moved and the
/// migration is over), or `Refuse`.
async fn greeted(
    state: &Arc<dyn StorageDaemon>,
    job: &Job<'_>,
    pending: &mut Option<PendingSwitch>,
    answer: Message,
) -> Result<Option<Switched>, MigrationError> {
    let Job { run, req, vol, .. } = *job;
    match answer {
        Message::Welcome { basis, iscsi, .. } => {
            super::check_port_groups(state.as_ref(), &iscsi, &run.volume);
            let v = vol.clone();
            blocking(move || Ok(v.set_peer_port(super::peer_port(&iscsi))?)).await?;
            run.counters
                .destination_copy
                .store(basis as u8, Ordering::Relaxed);
            if basis != ferry_migration::CopyBasis::New {
                tracing::info!(migration = %run.id, destination_copy = %copy_basis(basis as u8).describe(), "the destination holds an incomplete copy");
            }
            if pending.take().is_some() {
                tracing::warn!(migration = %run.id, "the destination had not committed; the guest writes again and the migration resumes");
                let v = vol.clone();
                blocking(move || Ok(v.set_switch_sent(false)?)).await?;
                vol.gate().resume();
                if req.resolve_only {
                    return Err(MigrationError::NotSwitched);
                }
            }
            Ok(None)
        }
        // The destination committed before the link failed: finish here.
        Message::Done {
            location,
            admin,
            iscsi,
        } => {
            let Some(p) = pending.take() else {
                return Err(unexpected(
                    &Message::Done {
                        location,
                        admin,
                        iscsi,
                    },
                    "waiting for Welcome",
                ));
            };
            let v = vol.clone();
            let (loc, adm) = (location.clone(), admin.clone());
            let peer = super::peer_port(&iscsi);
            let id = run.id.to_string();
            let moved =
                blocking(move || v.set_moved(&loc, &adm, peer, &id).map_err(Into::into)).await;
            if moved.is_ok() {
                vol.set_in_doubt(false);
            }
            vol.gate().resume();
            moved?;
            tracing::info!(migration = %run.id, to = %location, "the destination had committed; switched");
            Ok(Some(Switched {
                location,
                admin,
                pause: p.pause_start.elapsed(),
                converged: p.converged,
                source_digest: p.source_digest,
                dest_digest: p.source_digest,
                fingerprints_s: p.fingerprints_s,
                rounds_s: p.rounds_s,
                held_s: p.held_s,
            }))
        }
        Message::Refuse { reason } => {
            if pending.take().is_some() {
                vol.gate().resume();
            }
            Err(MigrationError::Refused(reason))
        }
        m => Err(unexpected(&m, "waiting for Welcome")),
    }
}

/// The `Hello` that opens every attempt: the volume as this daemon holds it
/// and its iSCSI port.
fn hello(state: &dyn StorageDaemon, job: &Job<'_>) -> Message {
    let Job {
        run, vol, chunk, ..
    } = *job;
    let meta = vol.meta();
    let id = run.id.bytes();
    let arrived_under = super::arrival_tracking(vol, chunk).map(|(id, _)| id);
    Message::Hello {
        min_version: VERSION,
        max_version: VERSION,
        migration_id: id,
        volume: VolumeDescriptor {
            name: meta.name.clone(),
            size: vol.size(),
            block_size: meta.block_size,
            chunk_size: chunk,
            uuid: *meta.uuid.as_bytes(),
            wwn: meta.wwn.clone(),
            allocated: vol.allocated_bytes(),
            physical_block_size: meta.physical_block_size.unwrap_or(meta.block_size),
        },
        iscsi: state.iscsi_port(None),
        arrived_under: arrived_under.unwrap_or_default(),
    }
}

/// An out-of-order message, unless it is the peer's `Abort` (its reason
/// says more than the order does).
fn unexpected_or(m: &Message, v: ferry_migration::ProtocolViolation) -> MigrationError {
    match m {
        Message::Abort { reason } => MigrationError::PeerAborted(reason.clone()),
        _ => MigrationError::Order(v),
    }
}

async fn next_msg(
    in_rx: &mut mpsc::UnboundedReceiver<Result<Message, MigrationError>>,
    timeout: Duration,
    cancel: Option<&tokio_util::sync::CancellationToken>,
) -> Result<Message, MigrationError> {
    let never = tokio_util::sync::CancellationToken::new();
    let cancel = cancel.unwrap_or(&never);
    let r = tokio::select! {
        r = tokio::time::timeout(timeout, in_rx.recv()) => r,
        () = cancel.cancelled() => return Err(MigrationError::Cancelled),
    };
    match r {
        Err(_) => Err(MigrationError::Link(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("destination silent for {timeout:?}"),
        ))),
        Ok(None) => Err(link_closed()),
        Ok(Some(r)) => r,
    }
}

/// One connection's conversation, phase by phase (seed 002, Fig. 3): the
/// counters are reset (a resumed attempt counts again), then
/// [`fingerprint_phase`], [`dirty_rounds`] and [`pause_and_switch`].
async fn run_phases(
    job: &Job<'_>,
    link: &Link<'_>,
    in_rx: &mut mpsc::UnboundedReceiver<Result<Message, MigrationError>>,
    pending: &mut Option<PendingSwitch>,
) -> Result<Switched, MigrationError> {
    let Job {
        run,
        req,
        vol,
        chunk,
        index,
        ..
    } = *job;
    let c = &run.counters;
    let table = Arc::new(ChunkTable::zeroed(vol.size(), chunk));
    c.chunks_total.store(table.chunks(), Ordering::Relaxed);
    for a in [
        &c.chunks_printed,
        &c.chunks_zero,
        &c.chunks_local,
        &c.chunks_buddy,
        &c.chunks_resumed,
        &c.chunks_wanted,
        &c.keys_answered,
        &c.chunks_unprinted,
        &c.chunks_unchanged,
        &c.chunks_unread,
        &c.chunks_sent,
        &c.chunks_dirty_sent,
        &c.rounds,
    ] {
        a.store(0, Ordering::Relaxed);
    }
    let sender = Arc::new(Sender {
        tx: link.tx.clone(),
        vol: vol.clone(),
        table: table.clone(),
        run: run.clone(),
        chunk: u64::from(chunk),
        unanswered: parking_lot::Mutex::new(std::collections::VecDeque::new()),
        stream: if req.compress {
            Some(parking_lot::Mutex::new(super::stream::StreamEncoder::new()?))
        } else {
            None
        },
        written_since_arrival: (c.destination_copy.load(Ordering::Relaxed)
            == ferry_migration::CopyBasis::ReturnedTracked as u8)
            .then(|| super::arrival_tracking(vol, chunk).map(|(_, b)| b))
            .flatten(),
        indexed: (index.block_size() == chunk).then(|| index.clone()),
    });
    // The compressor set up beside the prints' round trip, not in the
    // first piece of data (see `StreamEncoder::prepare`); a first piece
    // sent before it is done waits for it under the lock.
    if sender.stream.is_some() {
        let s = sender.clone();
        drop(super::bulk("prepare", move || {
            if let Some(e) = &s.stream {
                e.lock().prepare()?;
            }
            Ok(())
        }));
    }

    let first = fingerprint_phase(job, link, in_rx, &sender).await?;
    let fingerprints_s = first.seconds;
    let rounds = dirty_rounds(job, link, in_rx, &sender, first).await?;
    let switched = pause_and_switch(
        job,
        link,
        in_rx,
        &sender,
        &table,
        pending,
        fingerprints_s,
        rounds,
    )
    .await;
    // The compressor's 128 MiB window and the chunk table take tens of
    // milliseconds to free: not on the way to saying the volume switched
    // (a teleport's guest is stopped until it is said).
    tokio::task::spawn_blocking(move || drop((sender, table)));
    switched
}

/// How the first pass ended.
struct FirstPass {
    /// When it started, and its seconds.
    start: Instant,
    seconds: f64,
    /// The link's rate it measured (or the assumed one).
    rate: f64,
    /// Round 0, ended without waiting for its `Synced` (a pass that
    /// sent little: [`MEASURED_PASS`]); whoever sends the next round
    /// waits for it first, and the pause reads it before the verdict.
    unsynced: Option<u32>,
}

/// Phases 1 and 2: fingerprints out, wants answered with data, until the
/// destination has everything but what the guest dirtied (round 0 ended;
/// synced too where the pass sent more than [`MEASURED_PASS`]).
async fn fingerprint_phase(
    job: &Job<'_>,
    link: &Link<'_>,
    in_rx: &mut mpsc::UnboundedReceiver<Result<Message, MigrationError>>,
    sender: &Arc<Sender>,
) -> Result<FirstPass, MigrationError> {
    let Job { run, req, bm, .. } = *job;
    let c = &run.counters;
    // Phases 1 and 2. Everything written from here on is marked in `bm`;
    // what was written before, the scan reads.
    run.set_phase(Phase::Fingerprints);
    let t_start = Instant::now();
    let tx_start = run.wire.tx.load(Ordering::Relaxed);
    bm.take();
    let s = sender.clone();
    let dedup = req.dedup;
    let (want_tx, mut want_rx) = mpsc::unbounded_channel::<Vec<(u64, u32)>>();
    let literal_tx = want_tx.clone();
    let mut scan = Box::pin(bulk("scan", move || s.scan(dedup, &literal_tx)));
    let s = sender.clone();
    let data_task = bulk("send", move || {
        while let Some(r) = want_rx.blocking_recv() {
            s.send_ranges(&r, false)?;
        }
        Ok::<(), MigrationError>(())
    });
    let mut scan_done = false;
    loop {
        tokio::select! {
            r = &mut scan, if !scan_done => {
                scan_done = true;
                r?;
                tracing::debug!(elapsed = ?t_start.elapsed(), "first pass: every block read and printed");
            }
            m = next_msg(in_rx, ANSWER_TIMEOUT, Some(&run.cancel)) => match m? {
                Message::Want { ranges } => {
                    // One Want answers each Prints frame, in order.
                    let n: u64 = ranges.iter().map(|r| u64::from(r.1)).sum();
                    c.chunks_wanted.fetch_add(n, Ordering::Relaxed);
                    let keys = sender.unanswered.lock().pop_front().unwrap_or(0);
                    c.keys_answered.fetch_add(keys, Ordering::Relaxed);
                    if !ranges.is_empty() {
                        let _ = want_tx.send(ranges);
                    }
                }
                Message::WantDone { local_chunks, buddy_chunks, resumed_chunks } => {
                    tracing::debug!(elapsed = ?t_start.elapsed(), local_chunks, "first pass: the destination answered every print");
                    c.chunks_resumed.store(resumed_chunks, Ordering::Relaxed);
                    c.chunks_local.store(local_chunks, Ordering::Relaxed);
                    c.chunks_buddy.store(buddy_chunks, Ordering::Relaxed);
                    if scan_done { break; }
                    // The destination finished before our scan did: wait for it.
                    (&mut scan).await?;
                    break;
                }
                m => return Err(unexpected(&m, "waiting for wants")),
            }
        }
    }
    drop(want_tx);
    data_task.await?;
    tracing::debug!(elapsed = ?t_start.elapsed(), "first pass: wanted data sent");
    // A pass that sent little (a return: what was written since the
    // volume left) does not wait a round trip for round 0's answer: the
    // next step is most often the pause, whose verdict the destination
    // sends after it, having flushed round 0 first (a few milliseconds
    // for that little). A larger one waits: its time gives the link's
    // rate, and its flush stays out of the pause.
    let sent = run.wire.tx.load(Ordering::Relaxed) - tx_start;
    link.send(Message::RoundEnd {
        round: 0,
        dirty_bytes: bm.dirty_bytes(),
    })
    .await?;
    let unsynced = if sent > MEASURED_PASS {
        synced(in_rx, &run.cancel, 0).await?;
        None
    } else {
        Some(0)
    };
    let fingerprints_s = t_start.elapsed().as_secs_f64();
    let mut rate = if job.req.bwlimit > 0 {
        converge::to_f64(req.bwlimit)
    } else {
        DEFAULT_RATE
    };
    if sent > MEASURED_PASS {
        rate = converge::to_f64(sent) / fingerprints_s.max(1e-3);
    }
    tracing::info!(
        migration = %run.id,
        seconds = fingerprints_s,
        sent,
        link_rate = rate,
        synced = unsynced.is_none(),
        "first pass done (prints answered, wanted data sent, round 0 ended)"
    );

    Ok(FirstPass {
        start: t_start,
        seconds: fingerprints_s,
        rate,
        unsynced,
    })
}

/// How the dirty rounds ended.
struct RoundsDone {
    converged: bool,
    rounds_s: f64,
    held_s: f64,
    /// The link rate last measured.
    rate: f64,
}

/// Phase 3: dirty rounds until the rest fits the downtime target; held
/// before the switch until released when the caller asked for a hold.
async fn dirty_rounds(
    job: &Job<'_>,
    link: &Link<'_>,
    in_rx: &mut mpsc::UnboundedReceiver<Result<Message, MigrationError>>,
    sender: &Arc<Sender>,
    first: FirstPass,
) -> Result<RoundsDone, MigrationError> {
    let FirstPass {
        start: t_start,
        mut rate,
        mut unsynced,
        ..
    } = first;
    let Job {
        run,
        req,
        vol,
        bm,
        chunk,
        ..
    } = *job;
    let c = &run.counters;
    // Phase 3: dirty rounds until the rest fits the downtime target
    // (`converge::decide`); with a hold, keep the delta small by sending
    // rounds until the caller releases the switch.
    run.set_phase(Phase::Rounds);
    let t_rounds = Instant::now();
    let policy = ConvergePolicy {
        max_downtime: req.max_downtime,
        max_rounds: req.max_rounds,
        ..ConvergePolicy::default()
    };
    let mut throttle = Duration::ZERO;
    let mut since_take = t_start;
    let mut converged = true;
    let mut held: Option<Instant> = None;
    // Rounds sent while held do not count against `max_rounds`.
    let mut held_rounds = 0u32;
    loop {
        let dirty = bm.dirty_bytes();
        c.dirty_bytes.store(dirty, Ordering::Relaxed);
        let round = u32::try_from(c.rounds.load(Ordering::Relaxed)).unwrap_or(u32::MAX);
        let go = run.switch_go.is_cancelled();
        let stats = RoundStats {
            round: round.saturating_sub(held_rounds),
            dirty_bytes: dirty,
            since_take_s: since_take.elapsed().as_secs_f64(),
            link_rate: rate,
            throttle,
        };
        let step = converge::decide(&stats, &policy);
        match step {
            Step::Pause | Step::PauseUnconverged if go => {
                tracing::debug!(migration = %run.id, dirty, "switch released; pausing");
                if step == Step::PauseUnconverged {
                    converged = false;
                    tracing::warn!(migration = %run.id, dirty, "round limit reached; pausing longer than the target");
                }
                break;
            }
            Step::Pause | Step::PauseUnconverged => {
                // Ready, and held: wait for the release (or a little while,
                // then send what the guest dirtied meanwhile).
                if held.is_none() {
                    held = Some(Instant::now());
                    run.set_phase(Phase::ReadyToSwitch);
                    tracing::info!(migration = %run.id, "converged; holding before the switch until released");
                }
                // Keep the digest groups hashed while waiting: the release
                // comes when the guest is stopped, and hashing every group
                // then would cost it tens of milliseconds.
                let t = sender.table.clone();
                bulk("digest", move || Ok(t.digest())).await?;
                tokio::select! {
                    () = run.switch_go.cancelled() => {}
                    () = run.cancel.cancelled() => return Err(MigrationError::Cancelled),
                    () = tokio::time::sleep(HOLD_ROUND) => {}
                }
                // Released: decide again on what is dirty now. What the
                // guest wrote while this waited goes with the pause unless
                // it is too much for it; a round here would cost the stopped
                // guest a round trip.
                if run.switch_go.is_cancelled() {
                    continue;
                }
                held_rounds = held_rounds.saturating_add(1);
            }
            Step::Round { throttle: t } => {
                if t != throttle {
                    throttle = t;
                    vol.gate().set_throttle(throttle);
                    c.throttle_us.fetch_max(
                        u64::try_from(throttle.as_micros()).unwrap_or(u64::MAX),
                        Ordering::Relaxed,
                    );
                    tracing::info!(migration = %run.id, ?throttle, dirty, link_rate = rate, "auto-converge: slowing guest writes");
                }
            }
        }
        since_take = Instant::now();
        let t = Instant::now();
        let tx0 = run.wire.tx.load(Ordering::Relaxed);
        // A round ended without waiting is answered before the next.
        if let Some(r) = unsynced.take() {
            synced(in_rx, &run.cancel, r).await?;
        }
        // The link is idle here (the last round was answered): a round
        // trip timed now is the link's own.
        link.ping().await?;
        let ranges = coalesce(bm.take().into_iter().map(|o| o / u64::from(chunk)));
        let s = sender.clone();
        bulk("round", move || s.send_ranges(&ranges, true)).await?;
        let round = round.saturating_add(1);
        c.rounds.store(u64::from(round), Ordering::Relaxed);
        // A round sent while held gives way to the release (the guest of a
        // teleport is stopped by then).
        let release = held.map(|_| &run.switch_go);
        if !sync_round(link, in_rx, &run.cancel, round, dirty, release).await? {
            tracing::debug!(migration = %run.id, round, "switch released during a held round; pausing without waiting for its answer");
            break;
        }
        let moved = run.wire.tx.load(Ordering::Relaxed) - tx0;
        if moved > (1 << 20) {
            rate = converge::to_f64(moved) / t.elapsed().as_secs_f64().max(1e-3);
        }
        if run.cancel.is_cancelled() {
            return Err(MigrationError::Cancelled);
        }
    }
    let held_s = held.map_or(0.0, |h| h.elapsed().as_secs_f64());
    let rounds_s = t_rounds.elapsed().as_secs_f64();

    Ok(RoundsDone {
        converged,
        rounds_s,
        held_s,
        rate,
    })
}

/// The guest's writes held for the switch, the last chunks and the digest
/// sent.
struct WritesHeld<'a> {
    /// Opens the gate again if the switch goes no further.
    guard: PauseGuard<'a>,
    /// When the writes were held: the pause as the guest sees it.
    pause_start: Instant,
    /// Raw data sent before then (what the pause sent is the rest).
    data_before_pause: u64,
    source_digest: [u8; 32],
}

/// The destination's answers to `Digest` and `Switch`.
struct SwitchAnswers {
    dest_digest: [u8; 32],
    /// The volume's NBD address there, and its admin API's.
    location: String,
    admin: String,
    iscsi: ferry_migration::IscsiPort,
}

/// Hold the guest's writes (`Pause`, the gate drained), queue the chunks
/// they dirtied since the last round and send the digest.
async fn hold_and_send_last<'a>(
    job: &Job<'a>,
    link: &Link<'_>,
    sender: &Arc<Sender>,
    table: &Arc<ChunkTable>,
) -> Result<WritesHeld<'a>, MigrationError> {
    let Job {
        run,
        vol,
        bm,
        chunk,
        ..
    } = *job;
    run.set_phase(Phase::Paused);
    link.send(Message::Pause).await?;
    vol.gate().set_throttle(Duration::ZERO);
    let v = vol.clone();
    let t_pause = Instant::now();
    let paused = blocking(move || Ok(v.gate().pause(PAUSE_DRAIN))).await?;
    tracing::debug!(elapsed = ?t_pause.elapsed(), "pause: writers drained");
    if !paused {
        return Err(MigrationError::PauseTimeout(PAUSE_DRAIN));
    }
    let pause_start = Instant::now();
    let data_before_pause = run.counters.bytes_data_raw.load(Ordering::Relaxed);
    let guard = PauseGuard { vol, armed: true };
    let ranges = coalesce(bm.take().into_iter().map(|o| o / u64::from(chunk)));
    let s = sender.clone();
    blocking(move || s.send_ranges(&ranges, true)).await?;
    let source_digest = table.digest();
    tracing::debug!(elapsed = ?pause_start.elapsed(), "pause: last chunks queued, digest computed");
    link.send(Message::Digest {
        digest: source_digest,
    })
    .await?;
    Ok(WritesHeld {
        guard,
        pause_start,
        data_before_pause,
        source_digest,
    })
}

/// Wait for the destination's answers to `Digest` and `Switch`: its
/// digest, which must be `source_digest`, then `Done` with where the
/// volume now lives.
async fn switch_answers(
    in_rx: &mut mpsc::UnboundedReceiver<Result<Message, MigrationError>>,
    wait: Duration,
    source_digest: &[u8; 32],
    pause_start: Instant,
) -> Result<SwitchAnswers, MigrationError> {
    let dest_digest = loop {
        match next_msg(in_rx, wait, None).await? {
            // The answer to a round not waited for: a held one the
            // release cut short, or a small first pass's (the order
            // checker let through only one for each ended round).
            Message::Synced { .. } => {}
            Message::DigestResult { matches, digest } => {
                if !matches || digest != *source_digest {
                    return Err(MigrationError::DigestMismatch {
                        source_digest: hex(source_digest),
                        destination_digest: hex(&digest),
                    });
                }
                break digest;
            }
            m => return Err(unexpected(&m, "waiting for the digest")),
        }
    };
    tracing::debug!(elapsed = ?pause_start.elapsed(), "pause: digest answered");
    match next_msg(in_rx, wait, None).await? {
        Message::Done {
            location,
            admin,
            iscsi,
        } => Ok(SwitchAnswers {
            dest_digest,
            location,
            admin,
            iscsi,
        }),
        m => Err(unexpected(&m, "waiting for Done")),
    }
}

/// Phase 4: pause the guest's writes, send the last chunks, the digest and
/// `Switch`, and on `Done` mark the volume moved. A link lost after
/// `Switch` leaves the outcome unknown: the writes stay held (`pending`).
#[allow(clippy::too_many_arguments)]
async fn pause_and_switch(
    job: &Job<'_>,
    link: &Link<'_>,
    in_rx: &mut mpsc::UnboundedReceiver<Result<Message, MigrationError>>,
    sender: &Arc<Sender>,
    table: &Arc<ChunkTable>,
    pending: &mut Option<PendingSwitch>,
    fingerprints_s: f64,
    rounds: RoundsDone,
) -> Result<Switched, MigrationError> {
    let Job { run, vol, .. } = *job;
    // Phase 4: pause, send the rest, digest, switch.
    //
    // Journal that the switch may happen from here: a crash from now on
    // leaves the volume held until the destination is asked. Its fsync
    // starts first and runs beside the digest groups' hashing, the pause,
    // the last chunks and the digest (a teleport's guest is stopped
    // already, so each millisecond here is its pause), and is on disk
    // before `Switch` leaves: the destination cannot commit before. Every
    // way out below waits for it, so a failure's reset of the journal
    // comes after it.
    let t0 = Instant::now();
    let v = vol.clone();
    let journal = tokio::task::spawn_blocking(move || v.set_switch_sent(true));
    // Hash the digest groups before the writes are held, so the pause
    // re-hashes only what the last chunks change.
    let t = table.clone();
    let hashed = blocking(move || Ok(t.digest())).await;
    tracing::debug!(elapsed = ?t0.elapsed(), "pause: digest groups hashed");
    let paused = match hashed {
        Ok(_) => hold_and_send_last(job, link, sender, table).await,
        Err(e) => Err(e),
    };
    let journalled = journal
        .await
        .map_err(|e| MigrationError::Worker(e.to_string()))
        .and_then(|r| r.map_err(MigrationError::from));
    tracing::debug!(elapsed = ?t0.elapsed(), "pause: switch journalled");
    let WritesHeld {
        mut guard,
        pause_start,
        data_before_pause,
        source_digest,
    } = paused?;
    journalled?;
    // The destination commits on Switch only if its digest matched, so
    // both go in one round trip.
    link.send(Message::Switch).await?;
    // From here a lost link leaves the outcome unknown: keep the guest
    // paused and ask again on a new connection.
    let last_bytes = run.counters.bytes_data_raw.load(Ordering::Relaxed) - data_before_pause;
    let wait =
        PAUSE_ANSWER_TIMEOUT + converge::drain_time(last_bytes.saturating_mul(2), rounds.rate);
    let SwitchAnswers {
        dest_digest,
        location,
        admin,
        iscsi,
    } = match switch_answers(in_rx, wait, &source_digest, pause_start).await {
        Ok(x) => x,
        Err(e) if e.transient() => {
            guard.armed = false;
            *pending = Some(PendingSwitch {
                pause_start,
                source_digest,
                converged: rounds.converged,
                fingerprints_s,
                rounds_s: rounds.rounds_s,
                held_s: rounds.held_s,
            });
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    vol.mark_moved(
        &location,
        &admin,
        super::peer_port(&iscsi),
        &run.id.to_string(),
    );
    // Writers held by the pause now fail with "moved" and follow the volume.
    drop(guard);
    let pause = pause_start.elapsed();
    // Stored once the writers are let go (an fsync, 1-11 ms on a busy
    // disk, no longer in the pause). Until it is, the switch's journal
    // stands: a daemon stopped before this asks the destination, which
    // committed. A store that fails leaves the same journal; the volume is
    // the destination's either way.
    let v = vol.clone();
    if let Err(e) = blocking(move || Ok(v.store_state()?)).await {
        tracing::error!(migration = %run.id, volume = %run.volume, error = %e, "the volume switched but its moved state could not be stored; a restart asks the destination again");
    }
    tracing::info!(migration = %run.id, volume = %run.volume, to = %location, pause_ms = pause.as_secs_f64() * 1e3, "migration switched");
    Ok(Switched {
        location,
        admin,
        pause,
        converged: rounds.converged,
        source_digest,
        dest_digest,
        fingerprints_s,
        rounds_s: rounds.rounds_s,
        held_s: rounds.held_s,
    })
}
