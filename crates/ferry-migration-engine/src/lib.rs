//! Live migration of volumes between daemons (seed 002, chapters 3-5): the
//! source side ([`source`]), the destination side ([`destination`]), TLS
//! with pinned certificates ([`tls`]), the convergence policy
//! ([`converge`]), and what both sides share: the registry of runs the
//! admin API shows, the report, and the per-chunk digest table.
//!
//! The engine knows nothing of the daemon around it: what it needs (the
//! pool, the fingerprint index, settings, notifications) comes through
//! [`StorageDaemon`]. The wire format and the order of messages are
//! `ferry-migration`'s; this crate does the I/O.
//!
//! Invariants:
//! - The source volume stays authoritative and writable until the
//!   destination has answered `Done`; any failure before that resumes its
//!   writers and leaves it exactly as the guest left it.
//! - The destination copy carries `incoming` in its metadata (and is not
//!   exported) until `Switch` arrives; a later attempt with the same
//!   migration id resumes into it, keeping every chunk that already matches.
//! - Every chunk written at the destination was either received from the
//!   source or re-hashed from a local volume and found equal to the
//!   source's fingerprint (`ferry_index::verify`).
//! - With `hold_switch`, the guest is never paused before the caller
//!   released the switch; until then the source keeps sending dirty rounds.
//! - A volume that arrived by a migration has its [`ARRIVAL_BITMAP`] from
//!   before it is first served, marked by every write since; a chunk it
//!   leaves unmarked is as that migration's switch left it at both ends.

pub mod buddy;
pub mod converge;
mod daemon;
pub mod destination;
pub mod source;
mod stream;
pub mod tls;
mod transport;

pub use daemon::StorageDaemon;
pub use ferry_api::{
    MigrationId, MigrationPhase as Phase, MigrationResult, MigrationStatus, Report, ReportBytes,
    ReportChunks, ReportDigest, ReportThrottle, ReportTime,
};
pub use transport::WireCounters;

use ferry_migration::{ProtocolViolation, WireError};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio_util::sync::CancellationToken;

/// Why a migration, or one attempt of it, did not go on.
#[derive(Debug, Error)]
pub enum MigrationError {
    #[error("link: {0}")]
    Link(std::io::Error),
    #[error("protocol: {0}")]
    Wire(#[from] WireError),
    #[error("protocol: {0}")]
    Order(#[from] ProtocolViolation),
    #[error("protocol: unexpected {got} while {during}")]
    Unexpected {
        got: &'static str,
        during: &'static str,
    },
    #[error("TLS: {0}")]
    Tls(#[from] tls::CertError),
    /// The peer's certificate was refused, or ours was (`ferry certs`).
    #[error(
        "TLS handshake refused: {0} (are both daemons' certificates trusted? see `ferry certs`)"
    )]
    Handshake(String),
    /// A plaintext link whose peer answered with TLS records: the two
    /// ends disagree on `--plaintext`; retrying cannot help.
    #[error("the peer answered with TLS while this end runs without it (--plaintext): use TLS at both ends, or plaintext at both (loopback only)")]
    PeerSpeaksTls,
    /// The TLS link's peer listens without TLS (`--migrate-plaintext`).
    #[error("the peer listens without TLS (--migrate-plaintext) while this end uses it: use TLS at both ends, or plaintext at both (loopback only)")]
    PeerWithoutTls,
    #[error("refused by the destination: {0}")]
    Refused(String),
    #[error("aborted by the peer: {0}")]
    PeerAborted(String),
    #[error("storage: {0}")]
    Storage(#[from] ferry_storage::StorageError),
    /// The volume cannot be migrated in the state it is in.
    #[error("volume {volume} {reason}")]
    VolumeState { volume: String, reason: String },
    /// Another migration of the volume has not ended.
    #[error("volume {volume} is already migrating ({id})")]
    AlreadyMigrating { volume: String, id: MigrationId },
    /// A caller-named id is taken by a migration of something else.
    #[error("migration id {id} is already used for volume {volume} to {to}")]
    IdTaken {
        id: MigrationId,
        volume: String,
        to: String,
    },
    /// The request itself is wrong (no destination, too many chunks, ...).
    #[error("{0}")]
    BadRequest(String),
    /// The peer sent something that contradicts what it said before.
    #[error("bad data from the peer: {0}")]
    BadData(String),
    #[error("writes in flight did not finish within {0:?}; not pausing")]
    PauseTimeout(Duration),
    #[error("the link failed during the switch and the destination could not be asked whether it committed; the source stays authoritative")]
    SwitchUnknown,
    #[error("the destination had not committed the switch; the volume is served here again (run the migration again to move it)")]
    NotSwitched,
    #[error("a worker thread failed: {0}")]
    Worker(String),
    #[error("cancelled")]
    Cancelled,
    #[error("digests differ: source {source_digest}, destination {destination_digest}")]
    DigestMismatch {
        source_digest: String,
        destination_digest: String,
    },
}

/// Socket errors are link errors (worth resuming), except a TLS peer
/// refusing our certificate or presenting one we refuse: that is a trust
/// problem another attempt would meet again.
impl From<std::io::Error> for MigrationError {
    fn from(e: std::io::Error) -> Self {
        let refused = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .filter(|t| tls::is_trust_failure(t))
            .cloned();
        match refused {
            Some(t) => MigrationError::Handshake(t.to_string()),
            None => MigrationError::Link(e),
        }
    }
}

impl MigrationError {
    /// Worth reconnecting and resuming (a link problem), as opposed to a
    /// refusal or a mismatch that another attempt would repeat.
    pub fn transient(&self) -> bool {
        matches!(self, MigrationError::Link(_) | MigrationError::Wire(_))
    }
}

/// Run blocking engine work on a worker thread.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, MigrationError> + Send + 'static,
) -> Result<T, MigrationError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| MigrationError::Worker(e.to_string()))?
}

/// Bulk migration work (hashing a volume, compressing and writing its
/// copy) on a thread of its own at background CPU priority: on a host whose
/// CPUs are busy, the guests and their disk I/O go first and the migration
/// takes what they leave (at nice 10, about a tenth of a contended CPU at
/// the least, so it never stops). The thread starts at once; the future
/// gives its result. The pause's own work stays at normal priority
/// ([`blocking`]): a guest waits for it.
pub(crate) fn bulk<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> Result<T, MigrationError> + Send + 'static,
) -> impl std::future::Future<Output = Result<T, MigrationError>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name(format!("migrate-{what}"))
        .spawn(move || {
            background_priority();
            let _ = tx.send(f());
        });
    async move {
        spawned.map_err(|e| MigrationError::Worker(format!("{what}: {e}")))?;
        rx.await.map_err(|_| {
            MigrationError::Worker(format!("{what}: the worker ended without an answer"))
        })?
    }
}

/// The nice value of [`bulk`] threads.
const BULK_NICE: libc::c_int = 10;

/// Lower the calling thread's CPU priority (on Linux, nice is per thread).
/// Refused or not, the work goes on.
fn background_priority() {
    // SAFETY: plain syscalls with integer arguments; gettid names the
    // calling thread only.
    let r = unsafe {
        let tid = libc::gettid();
        libc::setpriority(
            libc::PRIO_PROCESS,
            u32::try_from(tid).unwrap_or(0),
            BULK_NICE,
        )
    };
    if r != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "background priority refused");
    }
}

/// Two sites a volume moves between must be distinct target port groups,
/// or initiators cannot tell their paths apart: say so when they are not.
fn check_port_groups(state: &dyn StorageDaemon, peer: &ferry_migration::IscsiPort, volume: &str) {
    let mine = state.iscsi_port(None).port_group;
    if mine != 0 && mine == peer.port_group {
        tracing::warn!(volume, port_group = mine, "both sites of this migration use the same iSCSI target port group: set iscsi.port_group (--iscsi-port-group) to differ, or ALUA reports one group for both");
    }
}

/// What a volume's meta keeps of the other site's iSCSI port.
fn peer_port(p: &ferry_migration::IscsiPort) -> Option<ferry_storage::PeerPort> {
    p.is_some().then(|| ferry_storage::PeerPort {
        portal: p.portal.clone(),
        port_group: p.port_group,
    })
}

fn unexpected(m: &ferry_migration::Message, during: &'static str) -> MigrationError {
    if let ferry_migration::Message::Abort { reason } = m {
        return MigrationError::PeerAborted(reason.clone());
    }
    MigrationError::Unexpected {
        got: m.name(),
        during,
    }
}

/// The persistent dirty bitmap of every chunk written to a volume since it
/// arrived by a migration (`arrived` in its metadata), at the migration's
/// chunk size. Created when an incoming copy is opened, cleared when it is
/// committed, before anything can write it; a crash marks it all dirty,
/// which costs a return its saving, never its correctness.
pub const ARRIVAL_BITMAP: &str = "ferry-arrival";

/// Start tracking what is written to a copy that arrives now (before it is
/// first served): its [`ARRIVAL_BITMAP`], created or cleared.
pub fn track_arrival(v: &ferry_storage::Volume, chunk: u32) -> Result<(), MigrationError> {
    match v.bitmap(ARRIVAL_BITMAP) {
        Ok(b) if b.granularity() == chunk && b.persistent() => {
            b.clear();
            return Ok(());
        }
        Ok(_) => v.delete_bitmap(ARRIVAL_BITMAP)?,
        Err(ferry_storage::StorageError::BitmapNotFound(_)) => {}
        Err(e) => return Err(e.into()),
    }
    v.create_bitmap(ARRIVAL_BITMAP, chunk, true)?;
    Ok(())
}

/// The migration `v` arrived by and its [`ARRIVAL_BITMAP`], when that
/// bitmap tracks chunks of `chunk` bytes: what a return may claim.
pub fn arrival_tracking(
    v: &ferry_storage::Volume,
    chunk: u32,
) -> Option<(String, Arc<ferry_storage::DirtyBitmap>)> {
    let arrived = v.arrived()?;
    let b = v.bitmap(ARRIVAL_BITMAP).ok()?;
    (b.granularity() == chunk).then_some((arrived.id, b))
}

/// Live counters of one migration (source side).
#[derive(Debug, Default)]
pub struct Counters {
    pub chunks_total: AtomicU64,
    pub chunks_printed: AtomicU64,
    pub chunks_zero: AtomicU64,
    pub chunks_local: AtomicU64,
    pub chunks_buddy: AtomicU64,
    pub chunks_resumed: AtomicU64,
    pub chunks_wanted: AtomicU64,
    /// Keys of `Prints` frames the destination has answered (version 4:
    /// one `Want` per frame).
    pub keys_answered: AtomicU64,
    /// Non-zero chunks sent as data without a print, after the prints
    /// were found to pay too little.
    pub chunks_unprinted: AtomicU64,
    /// Non-zero chunks nothing wrote since the volume arrived here, sent
    /// as `Same` runs to a destination that kept the copy it left by
    /// that migration.
    pub chunks_unchanged: AtomicU64,
    /// Chunks printed from the source's index prints, not read.
    pub chunks_unread: AtomicU64,
    pub chunks_sent: AtomicU64,
    pub chunks_dirty_sent: AtomicU64,
    pub bytes_fingerprints: AtomicU64,
    pub bytes_data: AtomicU64,
    pub bytes_data_raw: AtomicU64,
    pub bytes_protocol: AtomicU64,
    pub rounds: AtomicU64,
    pub dirty_bytes: AtomicU64,
    pub attempts: AtomicU64,
    /// Frame bytes sent by attempts that later failed (resent work).
    pub bytes_lost_to_failures: AtomicU64,
    pub throttle_us: AtomicU64,
    /// The destination's last `Welcome`: what it fills
    /// ([`ferry_migration::CopyBasis`] as its wire number).
    pub destination_copy: std::sync::atomic::AtomicU8,
    /// The fastest `Ping` round trip of any attempt (µs; 0: none yet).
    pub link_rtt_us: AtomicU64,
}

impl Counters {
    /// Keep `rtt` if it is the fastest round trip yet.
    pub fn link_rtt_timed(&self, rtt: Duration) {
        let us = u64::try_from(rtt.as_micros()).unwrap_or(u64::MAX).max(1);
        let mut cur = self.link_rtt_us.load(Ordering::Relaxed);
        while cur == 0 || us < cur {
            match self.link_rtt_us.compare_exchange_weak(
                cur,
                us,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
    }

    /// The fastest round trip timed, if any.
    pub fn link_rtt(&self) -> Option<Duration> {
        match self.link_rtt_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }
}

fn get(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// One migration the daemon started (source side), as the admin API shows it.
#[derive(Debug)]
pub struct MigrationRun {
    pub id: MigrationId,
    pub volume: String,
    pub to: String,
    pub started: Instant,
    pub counters: Counters,
    pub wire: Arc<WireCounters>,
    pub phase: Mutex<Phase>,
    pub phase_times: Mutex<Vec<(Phase, Duration)>>,
    pub report: Mutex<Option<Report>>,
    pub error: Mutex<Option<String>>,
    pub cancel: CancellationToken,
    /// Started with `hold_switch`: wait for [`MigrationRun::release_switch`].
    pub hold_switch: bool,
    /// Fired when the caller lets the switch go (or at once without a hold).
    pub switch_go: CancellationToken,
    /// Bumped on every phase change, so watchers wake without polling.
    changed: tokio::sync::watch::Sender<u64>,
}

impl MigrationRun {
    pub(crate) fn new(id: MigrationId, volume: &str, to: &str, hold_switch: bool) -> Self {
        let switch_go = CancellationToken::new();
        if !hold_switch {
            switch_go.cancel();
        }
        MigrationRun {
            id,
            volume: volume.to_string(),
            to: to.to_string(),
            started: Instant::now(),
            counters: Counters::default(),
            wire: Arc::default(),
            phase: Mutex::new(Phase::Connecting),
            phase_times: Mutex::default(),
            report: Mutex::default(),
            error: Mutex::default(),
            cancel: CancellationToken::new(),
            hold_switch,
            switch_go,
            changed: tokio::sync::watch::channel(0).0,
        }
    }

    pub fn set_phase(&self, p: Phase) {
        let mut cur = self.phase.lock();
        if *cur != p {
            *cur = p;
            self.phase_times.lock().push((p, self.started.elapsed()));
            self.changed.send_modify(|v| *v += 1);
        }
    }

    pub fn phase(&self) -> Phase {
        *self.phase.lock()
    }

    /// Wakes on every phase change.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Let a held migration pause the guest and switch. Answers whether the
    /// release can still matter (false once it has ended).
    pub fn release_switch(&self) -> bool {
        self.switch_go.cancel();
        !self.phase().is_terminal()
    }

    /// Release a held migration only if it is ready to switch (holding
    /// at `ReadyToSwitch`): answers whether its switch is released now
    /// (it was before, or this released it), None once it has ended, as
    /// [`MigrationRun::release_switch`]. Checked and released under the
    /// phase's lock: a migration leaving `ReadyToSwitch` (it fails) is
    /// released before it does, or seen after.
    pub fn release_switch_if_ready(&self) -> Option<bool> {
        let phase = self.phase.lock();
        if phase.is_terminal() {
            return None;
        }
        if *phase == Phase::ReadyToSwitch {
            self.switch_go.cancel();
        }
        Some(self.switch_go.is_cancelled())
    }

    /// What `GET /v1/migrations/ID` answers while it runs and after.
    pub fn status(&self) -> MigrationStatus {
        let c = &self.counters;
        let total = get(&c.chunks_total).max(1);
        let rebuilt = get(&c.chunks_zero) + get(&c.chunks_local) + get(&c.chunks_buddy);
        MigrationStatus {
            id: self.id.clone(),
            volume: self.volume.clone(),
            to: self.to.clone(),
            phase: self.phase(),
            elapsed_s: self.started.elapsed().as_secs_f64(),
            chunks_total: get(&c.chunks_total),
            chunks_printed: get(&c.chunks_printed),
            chunks_sent: get(&c.chunks_sent),
            chunks_wanted: get(&c.chunks_wanted),
            rebuilt_share: ratio(rebuilt, total),
            round: get(&c.rounds),
            dirty_bytes: get(&c.dirty_bytes),
            wire_tx_bytes: get(&self.wire.tx),
            wire_rx_bytes: get(&self.wire.rx),
            throttle_us: get(&c.throttle_us),
            attempts: get(&c.attempts),
            hold_switch: self.hold_switch,
            switch_released: self.switch_go.is_cancelled(),
            error: self.error.lock().clone(),
            report: self.report.lock().clone(),
        }
    }
}

/// `a / b` as a share; exact enough for display (both below 2^53 here).
#[allow(clippy::cast_precision_loss)]
fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b as f64
}

/// The migrations this daemon has started.
#[derive(Debug, Default)]
pub struct Registry {
    runs: Mutex<BTreeMap<MigrationId, Arc<MigrationRun>>>,
}

impl Registry {
    pub fn insert(&self, r: Arc<MigrationRun>) {
        self.runs.lock().insert(r.id.clone(), r);
    }
    pub fn get(&self, id: &MigrationId) -> Option<Arc<MigrationRun>> {
        self.runs.lock().get(id).cloned()
    }
    pub fn list(&self) -> Vec<Arc<MigrationRun>> {
        self.runs.lock().values().cloned().collect()
    }
    /// A migration of this volume that has not ended.
    pub fn active_for(&self, volume: &str) -> Option<Arc<MigrationRun>> {
        self.runs
            .lock()
            .values()
            .find(|r| r.volume == volume && !r.phase().is_terminal())
            .cloned()
    }
}

/// The per-chunk fingerprints one side believes the volume holds; the
/// migration digest is BLAKE3 over them in order.
///
/// Entries are the first 16 bytes of each chunk's BLAKE3 (16 B of RAM per
/// chunk). The digest is a two-level tree: groups of [`GROUP`] entries are
/// hashed once and re-hashed only after a change, so computing it during
/// the pause costs time in proportion to what changed, not to the volume.
#[derive(Debug)]
pub struct ChunkTable {
    chunk: u64,
    size: u64,
    inner: Mutex<TableInner>,
}

#[derive(Debug)]
struct TableInner {
    prints: Vec<[u8; 16]>,
    groups: Vec<Option<[u8; 32]>>,
}

/// Most chunks one migration tracks (16 B of RAM each at both ends): 1 TiB
/// at the default 4 KiB chunk. Larger volumes need a larger
/// `index.block_size`.
pub const MAX_CHUNKS: u64 = 1 << 28;

/// Refuse volumes whose chunk table would be too large.
pub fn check_chunks(size: u64, chunk: u32) -> Result<(), MigrationError> {
    let n = size.div_ceil(u64::from(chunk.max(1)));
    if n > MAX_CHUNKS {
        return Err(MigrationError::BadRequest(format!(
            "a volume of {size} bytes has {n} chunks of {chunk} bytes; a migration tracks at most {MAX_CHUNKS} (use a larger index.block_size)"
        )));
    }
    Ok(())
}

/// Entries per digest group.
const GROUP: usize = 4096;

fn short(p: &[u8; 32]) -> [u8; 16] {
    let mut s = [0u8; 16];
    s.copy_from_slice(&p[..16]);
    s
}

/// A chunk number or byte count of a table as an index: a table holds at
/// most [`MAX_CHUNKS`] (2^28) chunks of at most 64 KiB, so it always fits.
fn idx(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Chunks of a volume as its index knows them: each one's print entry,
/// and whether the index's bitmap marks it written since it was hashed
/// (then its entry vouches for nothing and it is read).
struct KnownPrints {
    entries: Vec<[u8; ferry_index::prints::ENTRY]>,
    written: Vec<bool>,
}

/// `index`'s prints of `n` chunks of `vol` from `first` (chunks of
/// `chunk` bytes), or `None` without current prints or with a bitmap of
/// another granularity. Read under the prints' lock, so an entry whose
/// chunk is not marked is its print; a write that lands after this look
/// is marked, and the caller's own bitmap or write mark must cover it.
fn known_prints(
    index: &ferry_index::PoolIndex,
    vol: &ferry_storage::Volume,
    chunk: u64,
    first: u64,
    n: usize,
) -> Option<KnownPrints> {
    index
        .with_prints(&vol.name(), vol.size(), |view| {
            // The marks as they are now, under the prints' lock (a bitmap
            // deleted and made again is another one).
            let bm = vol.bitmap(ferry_index::INDEX_BITMAP).ok()?;
            if u64::from(bm.granularity()) != chunk {
                return None;
            }
            let mut entries = vec![ferry_index::prints::ZERO_ENTRY; n];
            view.read(first, &mut entries).ok()?;
            let written = (first..first + n as u64)
                .map(|c| bm.is_dirty(c * chunk, chunk))
                .collect();
            Some(KnownPrints { entries, written })
        })
        .flatten()
}

impl TableInner {
    fn set(&mut self, i: u64, p: [u8; 16]) {
        if let Some(slot) = self.prints.get_mut(idx(i)) {
            if *slot != p {
                *slot = p;
                self.groups[idx(i) / GROUP] = None;
            }
        }
    }
}

impl ChunkTable {
    /// A table for a volume that reads as zeroes everywhere.
    pub fn zeroed(size: u64, chunk: u32) -> ChunkTable {
        let chunk = u64::from(chunk);
        let n = idx(size.div_ceil(chunk));
        let mut prints = vec![short(&zero_print(idx(chunk))); n];
        if let Some(last) = prints.last_mut() {
            let len = idx(size - (n as u64 - 1) * chunk);
            *last = short(&zero_print(len));
        }
        ChunkTable {
            chunk,
            size,
            inner: Mutex::new(TableInner {
                prints,
                groups: vec![None; n.div_ceil(GROUP)],
            }),
        }
    }

    pub fn chunks(&self) -> u64 {
        self.size.div_ceil(self.chunk)
    }

    /// Bytes in chunk `i` (the last one may be short).
    pub fn len_of(&self, i: u64) -> usize {
        idx((self.size - i * self.chunk).min(self.chunk))
    }

    /// Record `data`, which starts at chunk `first`, hashing each chunk.
    pub fn record(&self, first: u64, data: &[u8]) {
        let mut prints: Vec<(u64, [u8; 16])> = Vec::new();
        let mut off = 0usize;
        let mut i = first;
        while off < data.len() {
            let n = self.len_of(i).min(data.len() - off);
            prints.push((i, short(blake3::hash(&data[off..off + n]).as_bytes())));
            off += n;
            i += 1;
        }
        let mut t = self.inner.lock();
        for (i, p) in prints {
            t.set(i, p);
        }
    }

    pub fn set(&self, i: u64, print: [u8; 32]) {
        self.inner.lock().set(i, short(&print));
    }

    /// Record the first 16 bytes of a chunk's print (all the table keeps).
    pub fn set_short(&self, i: u64, print: [u8; 16]) {
        self.inner.lock().set(i, print);
    }

    pub fn set_zero(&self, first: u64, count: u64) {
        let full = short(&zero_print(idx(self.chunk)));
        let n = self.chunks();
        let mut t = self.inner.lock();
        for i in first..(first + count).min(n) {
            let p = if self.len_of(i) as u64 == self.chunk {
                full
            } else {
                short(&zero_print(self.len_of(i)))
            };
            t.set(i, p);
        }
    }

    /// The digest of the whole table.
    pub fn digest(&self) -> [u8; 32] {
        let mut t = self.inner.lock();
        let TableInner { prints, groups } = &mut *t;
        let mut h = blake3::Hasher::new();
        h.update(&self.size.to_be_bytes());
        for (g, cached) in groups.iter_mut().enumerate() {
            let d = cached.get_or_insert_with(|| {
                let end = ((g + 1) * GROUP).min(prints.len());
                let mut gh = blake3::Hasher::new();
                for p in &prints[g * GROUP..end] {
                    gh.update(p);
                }
                *gh.finalize().as_bytes()
            });
            h.update(d);
        }
        *h.finalize().as_bytes()
    }
}

/// Fingerprint of `len` zero bytes.
pub fn zero_print(len: usize) -> [u8; 32] {
    *blake3::hash(&vec![0u8; len]).as_bytes()
}

pub fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter().fold(String::new(), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// Coalesce sorted chunk numbers into `(first, count)` runs.
pub fn coalesce(chunks: impl IntoIterator<Item = u64>) -> Vec<(u64, u32)> {
    let mut out: Vec<(u64, u32)> = Vec::new();
    for c in chunks {
        match out.last_mut() {
            Some((first, n)) if *first + u64::from(*n) == c && *n < u32::MAX => *n += 1,
            _ => out.push((c, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fastest_round_trip_is_kept() {
        let c = Counters::default();
        assert_eq!(c.link_rtt(), None, "none timed yet");
        let ms = Duration::from_millis;
        c.link_rtt_timed(ms(12));
        c.link_rtt_timed(ms(9));
        c.link_rtt_timed(ms(30));
        assert_eq!(c.link_rtt(), Some(ms(9)));
        // A round trip under a microsecond still counts as one.
        c.link_rtt_timed(Duration::ZERO);
        assert_eq!(c.link_rtt(), Some(Duration::from_micros(1)));
    }

    #[tokio::test]
    async fn bulk_work_runs_at_background_priority_and_a_panic_is_an_error() {
        let nice = bulk("test", || {
            // SAFETY: getpriority of the calling thread; integer arguments.
            let n = unsafe {
                let tid = libc::gettid();
                libc::getpriority(libc::PRIO_PROCESS, u32::try_from(tid).unwrap())
            };
            Ok(n)
        })
        .await
        .unwrap();
        assert_eq!(nice, BULK_NICE);
        let e = bulk::<()>("test", || panic!("a worker's bug"))
            .await
            .unwrap_err();
        assert!(matches!(e, MigrationError::Worker(_)), "{e}");
        // The caller's own thread keeps its priority.
        // SAFETY: as above.
        let mine = unsafe {
            libc::getpriority(libc::PRIO_PROCESS, u32::try_from(libc::gettid()).unwrap())
        };
        assert_ne!(mine, BULK_NICE);
    }

    #[test]
    fn a_switch_released_if_ready_waits_for_ready_and_not_after_the_end() {
        let id = MigrationId::from_bytes([9; 16]);
        let run = MigrationRun::new(id.clone(), "vm", "b:1", true);
        for p in [Phase::Connecting, Phase::Fingerprints, Phase::Rounds] {
            run.set_phase(p);
            assert_eq!(run.release_switch_if_ready(), Some(false), "{p:?}");
            assert!(!run.switch_go.is_cancelled());
        }
        run.set_phase(Phase::ReadyToSwitch);
        assert_eq!(run.release_switch_if_ready(), Some(true));
        assert!(run.switch_go.is_cancelled());
        // Released already: asked again while it pauses, it still is.
        run.set_phase(Phase::Paused);
        assert_eq!(run.release_switch_if_ready(), Some(true));
        run.set_phase(Phase::Switched);
        assert_eq!(run.release_switch_if_ready(), None);

        // One released unconditionally before it was ready counts as released.
        let early = MigrationRun::new(id.clone(), "vm", "b:1", true);
        early.set_phase(Phase::Rounds);
        assert!(early.release_switch());
        assert_eq!(early.release_switch_if_ready(), Some(true));
        // A failed one is ended, released or not.
        let failed = MigrationRun::new(id.clone(), "vm", "b:1", true);
        failed.set_phase(Phase::Failed);
        assert_eq!(failed.release_switch_if_ready(), None);
        assert!(!failed.switch_go.is_cancelled());
        // Without a hold the switch was never held.
        let free = MigrationRun::new(id, "vm", "b:1", false);
        assert_eq!(free.release_switch_if_ready(), Some(true));
    }

    #[test]
    fn coalesce_runs() {
        assert_eq!(coalesce([1, 2, 3, 7, 8, 10]), vec![(1, 3), (7, 2), (10, 1)]);
        assert!(coalesce([]).is_empty());
    }

    #[test]
    fn digest_tracks_content_and_short_last_chunk() {
        let a = ChunkTable::zeroed(10_000, 4096);
        let b = ChunkTable::zeroed(10_000, 4096);
        assert_eq!(a.chunks(), 3);
        assert_eq!(a.len_of(2), 10_000 - 8192);
        assert_eq!(a.digest(), b.digest());
        let mut data = vec![0u8; 10_000];
        data[9_000] = 1;
        a.record(0, &data);
        assert_ne!(a.digest(), b.digest());
        b.record(2, &data[8192..]);
        assert_eq!(a.digest(), b.digest());
        a.set_zero(0, 3);
        assert_eq!(a.digest(), ChunkTable::zeroed(10_000, 4096).digest());
    }

    #[test]
    fn cached_groups_follow_changes() {
        let size = (GROUP as u64 * 3 + 5) * 4096;
        let a = ChunkTable::zeroed(size, 4096);
        let b = ChunkTable::zeroed(size, 4096);
        let d0 = a.digest();
        a.record(GROUP as u64 + 7, &[1u8; 4096]);
        let d1 = a.digest();
        assert_ne!(d0, d1);
        b.record(GROUP as u64 + 7, &[1u8; 4096]);
        assert_eq!(b.digest(), d1);
        a.set_zero(GROUP as u64 + 7, 1);
        assert_eq!(a.digest(), d0);
    }
}
