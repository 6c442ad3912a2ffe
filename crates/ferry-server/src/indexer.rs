//! Keeps the fingerprint index current as volumes are written.
//!
//! Every indexed volume carries a persistent dirty bitmap named
//! [`INDEX_BITMAP`] whose granularity is the index block size. It is created
//! (and emptied) before a volume is scanned, so a write during or after the
//! scan is always marked. A background task takes the marked chunks every
//! `[index] refresh_interval_ms` and re-hashes them into the index. After a
//! crash the bitmap comes back all dirty, so the whole volume is re-hashed:
//! slower, never stale. (Even a stale entry could not corrupt a disk:
//! candidates are verified by full BLAKE3 before use.) A volume the index
//! holds without prints in block order (indexed before they existed, or
//! its prints dropped by a failed write) is indexed again in the
//! background, one such scan at a time.

use crate::ServerState;
use ferry_index::{IndexError, PoolIndex, ScanPace, ScanStats};
use ferry_storage::{StorageError, Volume};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Name of the dirty bitmap reserved for the indexer.
pub use ferry_index::INDEX_BITMAP;

#[derive(Debug, thiserror::Error)]
pub enum IndexerError {
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Storage(#[from] StorageError),
}

/// Make sure the volume has its indexer bitmap, and empty it: the scan that
/// follows covers everything written so far. The volume's prints are
/// dropped first: once its marks are gone, nothing would tell which of
/// their entries are stale (the rebuild makes new ones).
fn reset_bitmap(index: &PoolIndex, v: &Volume) -> Result<(), StorageError> {
    index.forget_prints(&v.name());
    match v.bitmap(INDEX_BITMAP) {
        Ok(b) => {
            b.clear();
            Ok(())
        }
        Err(StorageError::BitmapNotFound(_)) => v
            .create_bitmap(INDEX_BITMAP, index.block_size(), true)
            .map(drop),
        Err(e) => Err(e),
    }
}

/// A volume whose data is not a file the index can open (an RBD image),
/// read through the volume.
struct VolumeBlocks<'a>(&'a Volume);

impl ferry_index::BlockSource for VolumeBlocks<'_> {
    fn byte_len(&self) -> std::io::Result<u64> {
        Ok(self.0.size())
    }
    fn next_data(&self, offset: u64) -> Option<u64> {
        let size = self.0.size();
        match self.0.extents(offset, size.saturating_sub(offset), 64) {
            Ok(ext) => {
                let covered = ext.last().map_or(offset, |e| e.offset + e.length);
                ext.iter()
                    .find(|e| !e.hole)
                    .map(|e| e.offset)
                    // Past the extents listed: maybe data.
                    .or((covered < size).then_some(covered))
            }
            // Unknown: read it.
            Err(_) => Some(offset),
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.0.read_at(offset, buf).map_err(std::io::Error::other)
    }
}

/// Scan a whole volume into the index (blocking).
///
/// A shared volume another gateway may hold, read through a read-only
/// handle, is scanned without a bitmap: what its holder writes later is
/// not re-hashed here (a stale entry costs a lookup, never data: blocks
/// are checked before use).
pub fn rebuild_volume(index: &PoolIndex, v: &Volume) -> Result<ScanStats, IndexerError> {
    rebuild_paced(index, v, ScanPace::Full)
}

/// [`rebuild_volume`] at `pace`.
fn rebuild_paced(index: &PoolIndex, v: &Volume, pace: ScanPace) -> Result<ScanStats, IndexerError> {
    if !(v.shared() && v.read_only()) {
        reset_bitmap(index, v)?;
    }
    rebuild_at(index, v, pace)
}

/// Scan a volume's data, from its file or through the volume.
fn rebuild_at(index: &PoolIndex, v: &Volume, pace: ScanPace) -> Result<ScanStats, IndexerError> {
    if v.on_ceph() {
        return Ok(index.rebuild_from(&v.name(), &VolumeBlocks(v), v.data_path(), pace)?);
    }
    Ok(index.rebuild_at(&v.name(), v.data_path(), pace)?)
}

/// Index a volume that just arrived by migration, on a thread of its own
/// that runs only when a CPU would otherwise idle (`SCHED_IDLE`, idle I/O
/// class) and hashes on that one thread: the volume's guest resumes at
/// this site right now, and a scan of all cores would slow it for as long
/// as the scan takes (seen as a slow start after teleports).
pub fn index_arrived(index: Arc<PoolIndex>, scans: &BackgroundScans, v: &Arc<Volume>) {
    index_in_background(index, scans, v, "the migrated volume");
}

/// Index a volume whose data came whole without passing the index (an
/// import, or a file made a volume) as [`index_arrived`] does, in the idle
/// classes on one thread: its clients may read it at once, and an all-core
/// scan would take their CPU (a 1 GiB file's scan slowed the first read
/// over TLS by a third on two cores). Even so it took a tenth to a fifth
/// of that read's speed, in the gaps between the client's and the
/// server's turns, so while the daemon serves, the scan hashes one chunk
/// per `ScanPace::Background`'s wait. `what` names it in the log.
pub fn index_new_data(
    index: Arc<PoolIndex>,
    scans: &BackgroundScans,
    v: &Arc<Volume>,
    what: &'static str,
) {
    index_in_background(index, scans, v, what);
}

/// How many of a daemon's volumes are being indexed on a background
/// thread, and when the refresh loop started such a scan of each within
/// the last [`REPRINT_AFTER`] (by data path: one volume's in its pool).
#[derive(Debug, Default)]
pub struct BackgroundScanList {
    running: usize,
    started: HashMap<PathBuf, Instant>,
    /// The volumes the refresh loop's last pass found without prints.
    missing: HashSet<PathBuf>,
}

/// [`BackgroundScanList`] as the daemon and its scanning threads share it.
pub type BackgroundScans = Arc<Mutex<BackgroundScanList>>;

/// A volume the refresh loop found without prints is not scanned again for
/// it sooner than this after its last such scan began (one that fails,
/// say for a full disk, is not retried in a loop).
const REPRINT_AFTER: Duration = Duration::from_secs(600);

/// [`index_arrived`]'s and [`index_new_data`]'s scan, for any volume
/// (`what` names it in the log).
/// One that starts while an older one of the same volume runs replaces
/// its prints (a rebuild seals its own only if none newer began).
fn index_in_background(
    index: Arc<PoolIndex>,
    scans: &BackgroundScans,
    v: &Arc<Volume>,
    what: &'static str,
) {
    scans.lock().running += 1;
    /// Counts the scan as ended however it ends.
    struct Running(BackgroundScans);
    impl Drop for Running {
        fn drop(&mut self) {
            self.0.lock().running -= 1;
        }
    }
    let running = Running(scans.clone());
    // The thread may wait long for an idle CPU: it holds the volume (and
    // so its file and lock) only to reset its bitmap, then scans by path.
    let (volume, name, path) = (Arc::downgrade(v), v.name(), v.data_path().to_path_buf());
    let spawned = std::thread::Builder::new()
        .name("index-background".into())
        .spawn(move || {
            let _running = running;
            run_when_idle();
            let Some(v) = volume.upgrade() else {
                tracing::debug!(volume = %name, "closed before it could be indexed");
                return;
            };
            // A shared volume held read-only has no bitmap of its own
            // (as in [`rebuild_volume`]).
            let reset = if v.shared() && v.read_only() {
                Ok(())
            } else {
                reset_bitmap(&index, &v)
            };
            let r = reset.map_err(IndexerError::from).and_then(|()| {
                if v.on_ceph() {
                    // Read through the volume (its image stays open anyway).
                    return rebuild_at(&index, &v, ScanPace::Background);
                }
                drop(v);
                Ok(index.rebuild_at(&name, &path, ScanPace::Background)?)
            });
            match r {
                Ok(st) => tracing::info!(
                    volume = %name,
                    seconds = st.seconds,
                    waits_for_clients = st.yields,
                    "indexed {what} in the background"
                ),
                Err(e) => tracing::warn!(volume = %name, error = %e, "indexing {what} failed"),
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start indexing {what}");
    }
}

/// Start indexing again, in the background, one volume the index holds
/// without prints in block order (indexed by a daemon from before they
/// existed, or its prints dropped when writing them failed): until then
/// its moves read it whole. One background scan at a time (an arrival's
/// included), a volume found so on two passes in a row, and not again
/// within [`REPRINT_AFTER`].
fn reprint_one(state: &ServerState) {
    // Seen without prints on this pass, and so on the one before: a
    // rebuild under way drops a volume's prints for the moment before it
    // begins new ones, which no two passes see.
    let mut missing = HashSet::new();
    let mut chosen = None;
    let mut bg = state.background_scans.lock();
    // Only the tries that still hold a volume back are kept.
    bg.started.retain(|_, t| t.elapsed() < REPRINT_AFTER);
    for v in state.pool.list() {
        let name = v.name();
        if !state.index.contains(&name)
            || state.index.has_prints(&name)
            || v.incoming().is_some()
            || v.importing()
            || (v.shared() && v.read_only())
        {
            continue;
        }
        let path = v.data_path().to_path_buf();
        if chosen.is_none() && bg.missing.contains(&path) && !bg.started.contains_key(&path) {
            chosen = Some(v);
        }
        missing.insert(path);
    }
    bg.missing = missing;
    let Some(v) = chosen.filter(|_| bg.running == 0) else {
        return;
    };
    bg.started
        .insert(v.data_path().to_path_buf(), Instant::now());
    drop(bg);
    tracing::info!(volume = %v.name(), "the index holds no prints of the volume: indexing it again in the background");
    index_in_background(
        state.index.clone(),
        &state.background_scans,
        &v,
        "the volume again",
    );
}

/// Put the calling thread in the idle scheduling class and the idle I/O
/// class (Linux; best effort: where refused, it runs at normal priority).
fn run_when_idle() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: pid 0 is the calling thread; `param` is a valid sched_param.
    let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if r != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "SCHED_IDLE refused");
    }
    // ioprio_set(IOPRIO_WHO_PROCESS, this thread, IOPRIO_CLASS_IDLE << 13).
    const IOPRIO_WHO_PROCESS: libc::c_long = 1;
    const IOPRIO_CLASS_IDLE: libc::c_long = 3;
    // SAFETY: a plain syscall with integer arguments.
    let r = unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0,
            IOPRIO_CLASS_IDLE << 13,
        )
    };
    if r != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "idle I/O class refused");
    }
}

/// Re-hash what changed in one volume since the last pass (blocking).
fn refresh_volume(state: &ServerState, v: &Volume) -> Result<usize, IndexerError> {
    let name = v.name();
    if !state.index.contains(&name) {
        return Ok(0);
    }
    let bm = match v.bitmap(INDEX_BITMAP) {
        Ok(b) => b,
        // Indexed before this daemon tracked writes: start over.
        Err(StorageError::BitmapNotFound(_)) => {
            return rebuild_volume(&state.index, v)
                .map(|s| usize::try_from(s.blocks).unwrap_or(usize::MAX))
        }
        Err(e) => return Err(e.into()),
    };
    if bm.dirty_chunks() == 0 {
        return Ok(0);
    }
    let bs = u64::from(state.index.block_size());
    // The marks are taken under the prints' lock (see `PoolIndex::refresh_taken`).
    let mut taken = Vec::new();
    let take = || {
        taken = bm.take().into_iter().map(|off| off / bs).collect();
        taken.clone()
    };
    let refreshed = if v.on_ceph() {
        state
            .index
            .refresh_taken(&name, &VolumeBlocks(v), v.data_path(), take)
    } else {
        state.index.refresh_file_taken(&name, v.data_path(), take)
    };
    match refreshed {
        Ok(n) => Ok(n),
        Err(e) => {
            // Try again next time rather than lose the marks.
            for b in &taken {
                bm.mark(b * bs, bs);
            }
            Err(e.into())
        }
    }
}

/// On a shared gateway, index the cluster's shared volumes the index
/// lacks, in the background (blocking; one scan at a time), and remove
/// the images crashed makers left; returns how many were scanned.
pub fn scan_shared(state: &ServerState) -> usize {
    // The same look also clears what crashed volume makers left.
    if let Err(e) = state.pool.remove_half_made() {
        tracing::warn!(error = %e, "looking for half-made images failed");
    }
    let readers = match state.pool.shared_readers() {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "listing the cluster's shared volumes failed");
            return 0;
        }
    };
    let mut n = 0;
    for v in readers {
        let name = v.name();
        if state.index.contains(&name) || v.incoming().is_some() || v.importing() {
            continue;
        }
        match rebuild_paced(&state.index, &v, ScanPace::Background) {
            Ok(st) => {
                n += 1;
                tracing::info!(volume = %name, seconds = st.seconds, "indexed a shared volume of the cluster");
            }
            Err(e) => tracing::warn!(volume = %name, error = %e, "indexing a shared volume failed"),
        }
    }
    n
}

/// A shared gateway's look for the cluster's volumes its index lacks,
/// every `[index] shared_scan_secs`, until `shutdown`.
pub async fn run_shared_scan(state: Arc<ServerState>, shutdown: CancellationToken) {
    let secs = state.config.index.shared_scan_secs;
    if secs == 0 || state.pool.gateway_address().is_none() {
        return;
    }
    crate::periodic::every(
        Duration::from_secs(secs),
        shutdown,
        "scanning the cluster's shared volumes",
        move || {
            scan_shared(&state);
        },
    )
    .await;
}

/// The background loop; ends when `shutdown` fires.
pub async fn run(state: Arc<ServerState>, shutdown: CancellationToken) {
    let ms = state.config.index.refresh_interval_ms;
    if ms == 0 {
        return;
    }
    crate::periodic::every(
        Duration::from_millis(ms),
        shutdown,
        "index refresh",
        move || {
            let mut total = 0;
            for v in state.pool.list() {
                match refresh_volume(&state, &v) {
                    Ok(n) => total += n,
                    Err(e) => {
                        tracing::warn!(volume = %v.name(), error = %e, "index refresh failed")
                    }
                }
            }
            if total > 0 {
                tracing::debug!(blocks = total, "index refreshed");
            }
            reprint_one(&state);
        },
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::run_when_idle;

    /// A background scan's thread runs in the idle scheduling class (a
    /// thread may always lower its own class, root or not).
    #[test]
    fn a_background_scans_thread_runs_only_when_a_cpu_would_idle() {
        let policy = std::thread::spawn(|| {
            run_when_idle();
            // SAFETY: pid 0 is the calling thread.
            unsafe { libc::sched_getscheduler(0) }
        })
        .join()
        .unwrap();
        assert_eq!(policy, libc::SCHED_IDLE);
        // SAFETY: as above, for this thread, which is left as it was.
        assert_eq!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_OTHER);
    }
}
