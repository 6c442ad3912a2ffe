//! Live migration of volumes between daemons (seed 002, chapters 3-5): the
//! source side ([`source`]), the destination side ([`destination`]), TLS
//! with pinned certificates ([`tls`]), and what both share: the registry of
//! runs the admin API shows, the report, and the per-chunk digest table.
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

pub mod buddy;
pub mod destination;
pub mod source;
mod stream;
pub mod tls;
mod transport;

use ferry_migration::WireError;
use parking_lot::Mutex;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;
use tokio_util::sync::CancellationToken;

pub use transport::WireCounters;

#[derive(Debug, Error)]
pub enum MigrationError {
    #[error("link: {0}")]
    Link(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Wire(#[from] WireError),
    #[error("protocol: unexpected {got} while {during}")]
    Unexpected {
        got: &'static str,
        during: &'static str,
    },
    #[error("TLS: {0}")]
    Tls(#[from] tls::CertError),
    #[error("refused by the destination: {0}")]
    Refused(String),
    #[error("aborted by the peer: {0}")]
    PeerAborted(String),
    #[error("storage: {0}")]
    Storage(#[from] ferry_storage::StorageError),
    #[error("{0}")]
    Invalid(String),
    #[error("digests differ: source {source_digest}, destination {destination_digest}")]
    DigestMismatch {
        source_digest: String,
        destination_digest: String,
    },
    #[error("cancelled")]
    Cancelled,
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
        .map_err(|e| MigrationError::Invalid(format!("worker failed: {e}")))?
}

fn name_of(m: &ferry_migration::Message) -> &'static str {
    use ferry_migration::Message as M;
    match m {
        M::Hello { .. } => "Hello",
        M::Welcome { .. } => "Welcome",
        M::Refuse { .. } => "Refuse",
        M::Prints { .. } => "Prints",
        M::PrintsDone => "PrintsDone",
        M::Want { .. } => "Want",
        M::WantDone { .. } => "WantDone",
        M::Data { .. } => "Data",
        M::RoundEnd { .. } => "RoundEnd",
        M::Pause => "Pause",
        M::Digest { .. } => "Digest",
        M::DigestResult { .. } => "DigestResult",
        M::Switch { .. } => "Switch",
        M::Done { .. } => "Done",
        M::Abort { .. } => "Abort",
        M::Synced { .. } => "Synced",
        M::Lookup { .. } => "Lookup",
        M::Found { .. } => "Found",
    }
}

fn unexpected(m: &ferry_migration::Message, during: &'static str) -> MigrationError {
    if let ferry_migration::Message::Abort { reason } = m {
        return MigrationError::PeerAborted(reason.clone());
    }
    MigrationError::Unexpected {
        got: name_of(m),
        during,
    }
}

/// Where a migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Connecting,
    Fingerprints,
    Rounds,
    Paused,
    Switched,
    Failed,
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
}

fn get(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// One migration the daemon started (source side), as the admin API shows it.
#[derive(Debug)]
pub struct MigrationRun {
    pub id: String,
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
}

impl MigrationRun {
    pub fn set_phase(&self, p: Phase) {
        let mut cur = self.phase.lock();
        if *cur != p {
            *cur = p;
            self.phase_times.lock().push((p, self.started.elapsed()));
        }
    }

    pub fn phase(&self) -> Phase {
        *self.phase.lock()
    }

    /// What `GET /v1/migrations/ID` answers while it runs and after.
    pub fn status(&self) -> serde_json::Value {
        let c = &self.counters;
        let total = get(&c.chunks_total).max(1);
        let rebuilt = get(&c.chunks_zero) + get(&c.chunks_local) + get(&c.chunks_buddy);
        serde_json::json!({
            "id": self.id,
            "volume": self.volume,
            "to": self.to,
            "phase": self.phase(),
            "elapsed_s": self.started.elapsed().as_secs_f64(),
            "chunks_total": get(&c.chunks_total),
            "chunks_printed": get(&c.chunks_printed),
            "chunks_sent": get(&c.chunks_sent),
            "chunks_wanted": get(&c.chunks_wanted),
            "rebuilt_share": rebuilt as f64 / total as f64,
            "round": get(&c.rounds),
            "dirty_bytes": get(&c.dirty_bytes),
            "wire_tx_bytes": get(&self.wire.tx),
            "wire_rx_bytes": get(&self.wire.rx),
            "throttle_us": get(&c.throttle_us),
            "attempts": get(&c.attempts),
            "error": self.error.lock().clone(),
            "report": self.report.lock().clone(),
        })
    }
}

/// The final account of a migration (`ferry migrate --json`).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub id: String,
    pub volume: String,
    pub to: String,
    pub result: &'static str,
    pub error: Option<String>,
    pub new_location: Option<String>,
    pub size: u64,
    pub chunk_size: u32,
    pub dedup: bool,
    pub compress: bool,
    pub tls: bool,
    pub bytes: ReportBytes,
    pub chunks: ReportChunks,
    pub time: ReportTime,
    pub rounds: u64,
    pub converged: bool,
    pub auto_converge: ReportThrottle,
    pub attempts: u64,
    pub digest: ReportDigest,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReportBytes {
    /// Frame bytes of `Prints` (fingerprints and zero runs).
    pub fingerprints: u64,
    /// Frame bytes of `Data` (after compression).
    pub data: u64,
    /// Raw bytes those `Data` frames carried.
    pub data_raw: u64,
    /// Every other frame, both directions.
    pub protocol: u64,
    /// Bytes that crossed the socket, TLS included: sent / received.
    pub wire_tx: u64,
    pub wire_rx: u64,
    /// Frame bytes sent by attempts that failed before a resume.
    pub resent_after_failures: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReportChunks {
    pub total: u64,
    pub zero: u64,
    pub local: u64,
    pub buddy: u64,
    /// Already in place at the destination from an earlier attempt.
    pub resumed: u64,
    /// Sent because the destination could not rebuild them.
    pub sent: u64,
    /// Sent again because the guest wrote them during the migration.
    pub dirty_resent: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReportTime {
    pub total_s: f64,
    pub fingerprints_s: f64,
    pub rounds_s: f64,
    pub pause_ms: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReportThrottle {
    pub max_delay_us: u64,
    pub writes_delayed: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ReportDigest {
    pub source: String,
    pub destination: String,
    pub matches: bool,
}

/// The migrations this daemon has started.
#[derive(Debug, Default)]
pub struct Registry {
    runs: Mutex<BTreeMap<String, Arc<MigrationRun>>>,
}

impl Registry {
    pub fn insert(&self, r: Arc<MigrationRun>) {
        self.runs.lock().insert(r.id.clone(), r);
    }
    pub fn get(&self, id: &str) -> Option<Arc<MigrationRun>> {
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
            .find(|r| r.volume == volume && !matches!(r.phase(), Phase::Switched | Phase::Failed))
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
pub fn check_chunks(size: u64, chunk: u32) -> Result<(), String> {
    let n = size.div_ceil(u64::from(chunk.max(1)));
    if n > MAX_CHUNKS {
        return Err(format!(
            "a volume of {size} bytes has {n} chunks of {chunk} bytes; a migration tracks at most {MAX_CHUNKS} (use a larger index.block_size)"
        ));
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

impl TableInner {
    fn set(&mut self, i: u64, p: [u8; 16]) {
        if let Some(slot) = self.prints.get_mut(i as usize) {
            if *slot != p {
                *slot = p;
                self.groups[i as usize / GROUP] = None;
            }
        }
    }
}

impl ChunkTable {
    /// A table for a volume that reads as zeroes everywhere.
    pub fn zeroed(size: u64, chunk: u32) -> ChunkTable {
        let chunk = u64::from(chunk);
        let n = size.div_ceil(chunk) as usize;
        let mut prints = vec![short(&zero_print(chunk as usize)); n];
        if let Some(last) = prints.last_mut() {
            let len = (size - (n as u64 - 1) * chunk) as usize;
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
        (self.size - i * self.chunk).min(self.chunk) as usize
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

    pub fn set_zero(&self, first: u64, count: u64) {
        let full = short(&zero_print(self.chunk as usize));
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
