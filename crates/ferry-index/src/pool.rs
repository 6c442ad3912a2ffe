//! The index of a whole pool: one [`VolumeRun`] per volume under
//! `<pool>/index/<volume>.fidx`, looked up together, and each volume's
//! prints in block order beside it (`<volume>.fprt`, [`VolumePrints`]).

use crate::prints::{entry_of, PrintsView, VolumePrints, ENTRY};
use crate::run::VolumeRun;
use crate::scan::{open_data, scan_blocks, BlockSource, ScanPace};
use crate::{check_block_size, Fingerprint, IndexError, ScanStats};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Per-volume line of [`IndexStatus`].
#[derive(Debug, Clone, Serialize)]
pub struct VolumeIndexStatus {
    pub volume: String,
    pub entries: u64,
    pub memory_bytes: u64,
    pub volume_size: u64,
    /// Its prints in block order are complete ([`PoolIndex::with_prints`]).
    pub prints: bool,
}

/// What `ferry index status` shows.
#[derive(Debug, Clone, Serialize)]
pub struct IndexStatus {
    pub block_size: u32,
    pub entries: u64,
    /// RAM held by the index (fences and bookkeeping).
    pub memory_bytes: u64,
    pub memory_bytes_per_entry: f64,
    pub disk_bytes: u64,
    pub lookups: u64,
    /// Lookups that returned at least one candidate.
    pub hits: u64,
    pub volumes: Vec<VolumeIndexStatus>,
}

/// Blocks re-hashed since the run was written. Their run entries are stale
/// and skipped; lookups see the delta instead. Merged into a new run when it
/// grows past [`MERGE_AT`].
#[derive(Debug, Default)]
struct Delta {
    /// Block number to its current key; `None` if it is now zero.
    block_key: HashMap<u64, Option<u64>>,
    by_key: HashMap<u64, Vec<u64>>,
}

/// Re-hashed blocks kept in memory before they are merged into the run.
const MERGE_AT: usize = 64 * 1024;
/// Rough RAM per delta entry (two hash map slots and a vector element).
const DELTA_ENTRY_BYTES: u64 = 48;

impl Delta {
    fn set(&mut self, block: u64, key: Option<u64>) {
        if let Some(Some(old)) = self.block_key.insert(block, key) {
            if let Some(v) = self.by_key.get_mut(&old) {
                v.retain(|b| *b != block);
                if v.is_empty() {
                    self.by_key.remove(&old);
                }
            }
        }
        if let Some(k) = key {
            self.by_key.entry(k).or_default().push(block);
        }
    }
}

#[derive(Debug)]
struct VolumeIndex {
    run: Arc<VolumeRun>,
    delta: Mutex<Delta>,
}

/// The fingerprint index of one pool.
#[derive(Debug)]
pub struct PoolIndex {
    dir: PathBuf,
    block_size: u32,
    runs: RwLock<BTreeMap<String, Arc<VolumeIndex>>>,
    /// Each volume's prints in block order: complete, or being built.
    prints: Mutex<HashMap<String, Arc<VolumePrints>>>,
    lookups: AtomicU64,
    hits: AtomicU64,
}

fn volume_index(run: VolumeRun) -> Arc<VolumeIndex> {
    Arc::new(VolumeIndex {
        run: Arc::new(run),
        delta: Mutex::new(Delta::default()),
    })
}

impl PoolIndex {
    /// Open the index directory; runs that fail their checks, or were built
    /// with another block size, are dropped (they get rebuilt).
    pub fn open(dir: &Path, block_size: u32) -> Result<PoolIndex, IndexError> {
        check_block_size(block_size)?;
        std::fs::create_dir_all(dir).map_err(|e| IndexError::io("mkdir", dir, e))?;
        let mut runs = BTreeMap::new();
        let mut prints = HashMap::new();
        for entry in std::fs::read_dir(dir).map_err(|e| IndexError::io("readdir", dir, e))? {
            let entry = entry.map_err(|e| IndexError::io("readdir", dir, e))?;
            let path = entry.path();
            let ext = path.extension().and_then(|e| e.to_str());
            if ext == Some("tmp") {
                // A run or prints whose writing a crash cut short.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let Some(name) = path
                .file_stem()
                .and_then(|s| s.to_str())
                .map(str::to_string)
            else {
                continue;
            };
            if ext == Some("fprt") {
                if let Some(p) = VolumePrints::open(&path, block_size) {
                    prints.insert(name, Arc::new(p));
                }
                continue;
            }
            if ext != Some("fidx") {
                continue;
            }
            match VolumeRun::open(&path) {
                Ok(r) if r.block_size() == block_size => {
                    runs.insert(name, volume_index(r));
                }
                _ => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(PoolIndex {
            dir: dir.to_path_buf(),
            block_size,
            runs: RwLock::new(runs),
            prints: Mutex::new(prints),
            lookups: AtomicU64::new(0),
            hits: AtomicU64::new(0),
        })
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Is `volume` indexed?
    pub fn contains(&self, volume: &str) -> bool {
        self.runs.read().contains_key(volume)
    }

    /// (Re)build the run of one volume from its backing file.
    pub fn rebuild(&self, volume: &str, data: &Path) -> Result<ScanStats, IndexError> {
        self.rebuild_at(volume, data, ScanPace::Full)
    }

    /// The same, hashing at `pace`.
    pub fn rebuild_at(
        &self,
        volume: &str,
        data: &Path,
        pace: ScanPace,
    ) -> Result<ScanStats, IndexError> {
        let f = open_data(data)?;
        self.rebuild_from(volume, &f, data, pace)
    }

    /// (Re)build the run of one volume from `source` (`what` names it in
    /// errors), and its prints in block order.
    pub fn rebuild_from(
        &self,
        volume: &str,
        source: &dyn BlockSource,
        what: &Path,
        pace: ScanPace,
    ) -> Result<ScanStats, IndexError> {
        let size = source
            .byte_len()
            .map_err(|e| IndexError::io("stat", what, e))?;
        let prints = self.begin_prints(volume, size)?;
        let mut entries = Vec::new();
        let mut row = Vec::new();
        let mut unwritten = None;
        let scanned = scan_blocks(source, what, size, self.block_size, pace, |first, ps| {
            for (i, p) in ps.iter().enumerate() {
                if let Some(p) = p {
                    entries.push((p.key(), first + i as u64));
                }
            }
            if unwritten.is_none() {
                row.clear();
                row.extend(ps.iter().map(|p| entry_of(p.as_ref())));
                unwritten = write_scanned(&prints, first, &row).err();
            }
        });
        let built = scanned.and_then(|stats| {
            let run = VolumeRun::write(
                &self.dir.join(format!("{volume}.fidx")),
                self.block_size,
                stats.bytes,
                &mut entries,
            )?;
            Ok((run, stats))
        });
        let (run, stats) = match built {
            Ok(b) => b,
            Err(e) => {
                self.drop_prints(volume, &prints);
                return Err(e);
            }
        };
        self.runs
            .write()
            .insert(volume.to_string(), volume_index(run));
        match unwritten {
            None => self.seal_prints(volume, &prints),
            Some(e) => {
                tracing::warn!(volume, error = %e, "the volume's prints could not be written; its migrations read it whole");
                self.drop_prints(volume, &prints);
            }
        }
        Ok(stats)
    }

    /// New prints for `volume` (of `size` bytes), being built: the old
    /// ones are no longer trusted from here on.
    fn begin_prints(&self, volume: &str, size: u64) -> Result<Arc<VolumePrints>, IndexError> {
        static BUILD: AtomicU64 = AtomicU64::new(0);
        let n = BUILD.fetch_add(1, Ordering::Relaxed);
        let tmp = self
            .dir
            .join(format!("{volume}.fprt.{}-{n}.tmp", std::process::id()));
        let fresh = Arc::new(VolumePrints::create(
            &self.dir.join(format!("{volume}.fprt")),
            &tmp,
            self.block_size,
            size,
        )?);
        let old = self.prints.lock().insert(volume.to_string(), fresh.clone());
        if let Some(old) = old {
            spoil(&old);
        }
        Ok(fresh)
    }

    /// A rebuild's prints are whole: seal them and make them the volume's
    /// file, unless another rebuild or a removal replaced them meanwhile.
    fn seal_prints(&self, volume: &str, prints: &Arc<VolumePrints>) {
        let map = self.prints.lock();
        let mut st = prints.state.write();
        let current = map.get(volume).is_some_and(|p| Arc::ptr_eq(p, prints));
        if !current || st.spoiled {
            drop(st);
            drop(map);
            let _ = std::fs::remove_file(prints.file_path());
            return;
        }
        match prints.seal_as_final() {
            Ok(()) => {
                st.complete = true;
                st.refreshed_in_build = None;
            }
            Err(_) => {
                st.spoiled = true;
                drop(st);
                drop(map);
                self.drop_prints(volume, prints);
            }
        }
    }

    /// Forget `prints` (if they are still the volume's) and their file.
    fn drop_prints(&self, volume: &str, prints: &Arc<VolumePrints>) {
        let mut map = self.prints.lock();
        if map.get(volume).is_some_and(|p| Arc::ptr_eq(p, prints)) {
            map.remove(volume);
        }
        drop(map);
        spoil(prints);
    }

    /// Stop trusting the prints of `volume` and remove them: before
    /// anything clears the marks that say which entries are stale.
    pub fn forget_prints(&self, volume: &str) {
        let prints = self.prints.lock().remove(volume);
        if let Some(p) = prints {
            spoil(&p);
        }
    }

    /// Whether `volume` has prints in block order, complete or being
    /// built (false once they were dropped, and for a volume indexed
    /// before they existed).
    pub fn has_prints(&self, volume: &str) -> bool {
        let p = self.prints.lock().get(volume).cloned();
        p.is_some_and(|p| p.state.try_read().is_none_or(|st| !st.spoiled))
    }

    /// Run `f` on the complete prints of `volume` (built for a volume of
    /// `volume_size` bytes), under their lock: no refresh takes a block's
    /// mark or writes its entry until `f` returns, so an entry whose block
    /// the volume's [`crate::INDEX_BITMAP`] does not mark (checked inside
    /// `f`) is current. `None`: no such prints, or a refresh holds them
    /// right now (read the blocks instead).
    pub fn with_prints<T>(
        &self,
        volume: &str,
        volume_size: u64,
        f: impl FnOnce(&PrintsView<'_>) -> T,
    ) -> Option<T> {
        let p = self.prints.lock().get(volume).cloned()?;
        if p.volume_size() != volume_size {
            return None;
        }
        let st = p.state.try_read()?;
        if !st.complete || st.spoiled {
            return None;
        }
        Some(f(&PrintsView { prints: &p }))
    }

    /// Re-hash `blocks` of an indexed volume from its backing file (after
    /// they were written) and record them in the volume's delta. Returns how
    /// many blocks were refreshed; 0 if the volume is not indexed.
    pub fn refresh(&self, volume: &str, data: &Path, blocks: &[u64]) -> Result<usize, IndexError> {
        self.refresh_file_taken(volume, data, || blocks.to_vec())
    }

    /// [`PoolIndex::refresh`] reading from `source` (`what` names it in errors).
    pub fn refresh_from(
        &self,
        volume: &str,
        source: &dyn BlockSource,
        what: &Path,
        blocks: &[u64],
    ) -> Result<usize, IndexError> {
        self.refresh_taken(volume, source, what, || blocks.to_vec())
    }

    /// [`PoolIndex::refresh_taken`] from the volume's backing file.
    pub fn refresh_file_taken(
        &self,
        volume: &str,
        data: &Path,
        take: impl FnOnce() -> Vec<u64>,
    ) -> Result<usize, IndexError> {
        if !self.contains(volume) {
            return Ok(0);
        }
        let f = open_data(data)?;
        self.refresh_taken(volume, &f, data, take)
    }

    /// Re-hash the blocks `take` names (the marks it takes from the
    /// volume's [`crate::INDEX_BITMAP`]) into the delta and the prints.
    /// `take` runs under the prints' lock, held until their entries are
    /// written and synced: a reader of [`PoolIndex::with_prints`] never
    /// sees a block unmarked whose entry is not yet its print. Should
    /// hashing or writing fail, the prints are dropped (the delta keeps
    /// what it had; the caller marks the blocks again).
    pub fn refresh_taken(
        &self,
        volume: &str,
        source: &dyn BlockSource,
        what: &Path,
        take: impl FnOnce() -> Vec<u64>,
    ) -> Result<usize, IndexError> {
        let Some(vi) = self.runs.read().get(volume).cloned() else {
            return Ok(0);
        };
        let prints = self.prints.lock().get(volume).cloned();
        let mut held = prints.as_ref().map(|p| (p, p.state.write()));
        let blocks = take();
        if blocks.is_empty() {
            return Ok(0);
        }
        let hashed = self.hash_blocks(source, what, &blocks);
        let written = hashed.as_ref().map_err(|_| ()).and_then(|prints_of| {
            let Some((p, st)) = held.as_mut() else {
                return Ok(());
            };
            if st.spoiled || (!st.complete && st.refreshed_in_build.is_none()) {
                return Ok(());
            }
            // One write per run of consecutive blocks.
            let mut run: Vec<[u8; ENTRY]> = Vec::new();
            let mut first = 0;
            for (i, &(b, ref fp)) in prints_of.iter().enumerate() {
                if run.is_empty() {
                    first = b;
                }
                run.push(entry_of(fp.as_ref()));
                if prints_of.get(i + 1).is_none_or(|next| next.0 != b + 1) {
                    p.write_run(first, &run).map_err(|_| ())?;
                    run.clear();
                }
                if let Some(r) = st.refreshed_in_build.as_mut() {
                    r.insert(b);
                }
            }
            p.sync().map_err(|_| ())
        });
        if let (Err(()), Some((p, st))) = (written, held.as_mut()) {
            st.spoiled = true;
            st.complete = false;
            let _ = std::fs::remove_file(p.file_path());
        }
        drop(held);
        let keys = hashed?;
        let merge = {
            let mut d = vi.delta.lock();
            for (b, fp) in keys {
                d.set(b, fp.map(|f| f.key()));
            }
            d.block_key.len() >= MERGE_AT
        };
        if merge {
            self.merge(volume)?;
        }
        Ok(blocks.len())
    }

    /// Each block's fingerprint (`None`: zeroes or past the end).
    fn hash_blocks(
        &self,
        source: &dyn BlockSource,
        what: &Path,
        blocks: &[u64],
    ) -> Result<Vec<(u64, Option<Fingerprint>)>, IndexError> {
        let size = source
            .byte_len()
            .map_err(|e| IndexError::io("stat", what, e))?;
        let bs = u64::from(self.block_size);
        let mut buf = vec![0u8; self.block_size as usize];
        let mut out = Vec::with_capacity(blocks.len());
        for &b in blocks {
            let off = b * bs;
            if off >= size {
                out.push((b, None));
                continue;
            }
            let n = usize::try_from(bs.min(size - off)).unwrap_or(usize::MAX);
            source
                .read_at(&mut buf[..n], off)
                .map_err(|e| IndexError::io("read", what, e))?;
            let blk = &buf[..n];
            out.push((b, (!crate::is_zero(blk)).then(|| Fingerprint::of(blk))));
        }
        Ok(out)
    }

    /// Fold every volume's delta into its run (at shutdown: the delta lives
    /// only in memory).
    pub fn merge_all(&self) -> Result<(), IndexError> {
        let names: Vec<String> = self.runs.read().keys().cloned().collect();
        for n in names {
            self.merge(&n)?;
        }
        Ok(())
    }

    /// Fold a volume's delta into a new run.
    pub fn merge(&self, volume: &str) -> Result<(), IndexError> {
        let Some(vi) = self.runs.read().get(volume).cloned() else {
            return Ok(());
        };
        let mut d = vi.delta.lock();
        if d.block_key.is_empty() {
            return Ok(());
        }
        let mut entries: Vec<(u64, u64)> = vi
            .run
            .entries()?
            .into_iter()
            .filter(|(_, b)| !d.block_key.contains_key(b))
            .collect();
        entries.extend(d.block_key.iter().filter_map(|(b, k)| k.map(|k| (k, *b))));
        let run = VolumeRun::write(
            &self.dir.join(format!("{volume}.fidx")),
            self.block_size,
            vi.run.volume_size(),
            &mut entries,
        )?;
        *d = Delta::default();
        drop(d);
        self.runs
            .write()
            .insert(volume.to_string(), volume_index(run));
        Ok(())
    }

    /// Forget a volume.
    pub fn remove(&self, volume: &str) {
        if self.runs.write().remove(volume).is_some() {
            let _ = std::fs::remove_file(self.dir.join(format!("{volume}.fidx")));
        }
        self.forget_prints(volume);
    }

    /// Candidate locations `(volume, block number)` of a block with this
    /// fingerprint, at most `max`. Candidates must be verified before use.
    pub fn lookup(&self, fp: &Fingerprint, max: usize) -> Result<Vec<(String, u64)>, IndexError> {
        self.lookup_key(fp.key(), max)
    }

    /// Candidates for a block whose fingerprint has this key
    /// ([`Fingerprint::key`]), at most `max`.
    pub fn lookup_key(&self, key: u64, max: usize) -> Result<Vec<(String, u64)>, IndexError> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let vols: Vec<(String, Arc<VolumeIndex>)> = self
            .runs
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut out = Vec::new();
        for (name, vi) in vols {
            let d = vi.delta.lock();
            for b in d.by_key.get(&key).into_iter().flatten() {
                out.push((name.clone(), *b));
            }
            // Ask the run for a few extra: some of its answers may be stale.
            let want = max.saturating_sub(out.len()) + d.block_key.len().min(64);
            for b in vi.run.lookup(key, want)? {
                if !d.block_key.contains_key(&b) {
                    out.push((name.clone(), b));
                }
            }
            out.truncate(max);
            if out.len() >= max {
                break;
            }
        }
        if !out.is_empty() {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        Ok(out)
    }

    pub fn status(&self) -> IndexStatus {
        let sealed: HashMap<String, bool> = self
            .prints
            .lock()
            .iter()
            // A refresh holding them: not usable at this moment.
            .map(|(n, p)| {
                let usable = p
                    .state
                    .try_read()
                    .is_some_and(|st| st.complete && !st.spoiled);
                (n.clone(), usable)
            })
            .collect();
        let runs = self.runs.read();
        let volumes: Vec<VolumeIndexStatus> = runs
            .iter()
            .map(|(n, vi)| {
                let d = vi.delta.lock();
                let stale = vi.run.len().min(d.block_key.len() as u64);
                VolumeIndexStatus {
                    volume: n.clone(),
                    entries: vi.run.len() - stale
                        + d.block_key.values().filter(|k| k.is_some()).count() as u64,
                    memory_bytes: vi.run.memory_bytes() as u64
                        + d.block_key.len() as u64 * DELTA_ENTRY_BYTES,
                    volume_size: vi.run.volume_size(),
                    prints: sealed.get(n).copied().unwrap_or(false),
                }
            })
            .collect();
        let entries: u64 = volumes.iter().map(|v| v.entries).sum();
        let memory: u64 = volumes.iter().map(|v| v.memory_bytes).sum::<u64>()
            + std::mem::size_of::<Self>() as u64;
        let disk = runs
            .values()
            .map(|vi| std::fs::metadata(vi.run.path()).map_or(0, |m| m.len()))
            .sum();
        IndexStatus {
            block_size: self.block_size,
            entries,
            memory_bytes: memory,
            memory_bytes_per_entry: if entries == 0 {
                0.0
            } else {
                memory as f64 / entries as f64
            },
            disk_bytes: disk,
            lookups: self.lookups.load(Ordering::Relaxed),
            hits: self.hits.load(Ordering::Relaxed),
            volumes,
        }
    }
}

/// Scanned entries into prints being built, under their lock: blocks a
/// refresh wrote since the build began keep the refresh's entry.
fn write_scanned(
    prints: &VolumePrints,
    first: u64,
    entries: &[[u8; ENTRY]],
) -> Result<(), IndexError> {
    let st = prints.state.write();
    let Some(refreshed) = st.refreshed_in_build.as_ref().filter(|r| !r.is_empty()) else {
        return prints.write_run(first, entries);
    };
    let mut start = 0;
    for i in 0..=entries.len() {
        if i == entries.len() || refreshed.contains(&(first + i as u64)) {
            if start < i {
                prints.write_run(first + start as u64, &entries[start..i])?;
            }
            start = i + 1;
        }
    }
    Ok(())
}

/// Prints no longer kept: untrusted from now on, their file removed.
fn spoil(prints: &VolumePrints) {
    let mut st = prints.state.write();
    st.spoiled = true;
    st.complete = false;
    let _ = std::fs::remove_file(prints.file_path());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prints::ZERO_ENTRY;
    use std::os::unix::fs::FileExt;

    /// The prints of blocks `first..first+n`, if complete.
    fn prints_of(
        idx: &PoolIndex,
        v: &str,
        size: u64,
        first: u64,
        n: usize,
    ) -> Option<Vec<[u8; 16]>> {
        idx.with_prints(v, size, |view| {
            let mut out = vec![[0u8; 16]; n];
            view.read(first, &mut out).unwrap();
            out
        })
    }

    fn entry(b: &[u8]) -> [u8; 16] {
        entry_of(Some(&Fingerprint::of(b)))
    }

    #[test]
    fn prints_follow_refreshes_survive_a_reopen_and_go_with_the_volume() {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("v.raw");
        let f = std::fs::File::create(&img).unwrap();
        let size = (1 << 20) + 100;
        f.set_len(size).unwrap();
        f.write_all_at(&[1u8; 4096], 0).unwrap();
        f.write_all_at(&[9u8; 100], 1 << 20).unwrap();
        let dir = d.path().join("index");
        let idx = PoolIndex::open(&dir, 4096).unwrap();
        assert!(prints_of(&idx, "v", size, 0, 1).is_none());
        idx.rebuild("v", &img).unwrap();
        assert!(idx.status().volumes[0].prints);
        let p = prints_of(&idx, "v", size, 0, 257).unwrap();
        assert_eq!(p[0], entry(&[1u8; 4096]));
        assert_eq!(p[1], ZERO_ENTRY);
        // The short last block is hashed as it is.
        assert_eq!(p[256], entry(&[9u8; 100]));
        // Another size: not these prints.
        assert!(prints_of(&idx, "v", size + 4096, 0, 1).is_none());
        f.write_all_at(&[2u8; 4096], 0).unwrap();
        f.write_all_at(&[3u8; 4096], 4096).unwrap();
        idx.refresh("v", &img, &[0, 1]).unwrap();
        let p = prints_of(&idx, "v", size, 0, 2).unwrap();
        assert_eq!(p, vec![entry(&[2u8; 4096]), entry(&[3u8; 4096])]);
        drop(idx);
        let idx = PoolIndex::open(&dir, 4096).unwrap();
        assert_eq!(
            prints_of(&idx, "v", size, 0, 2).unwrap()[1],
            entry(&[3u8; 4096])
        );
        // Past the end is refused, not read.
        assert!(idx
            .with_prints("v", size, |view| view
                .read(256, &mut [[0u8; 16]; 2])
                .is_err())
            .unwrap());
        idx.remove("v");
        assert!(prints_of(&idx, "v", size, 0, 1).is_none());
        assert!(!dir.join("v.fprt").exists());
        // A file left incomplete (a rebuild a crash cut short) is not trusted.
        idx.rebuild("v", &img).unwrap();
        drop(idx);
        let mut hdr = std::fs::read(dir.join("v.fprt")).unwrap();
        hdr[24] = 0;
        std::fs::write(dir.join("v.fprt"), &hdr).unwrap();
        let idx = PoolIndex::open(&dir, 4096).unwrap();
        assert!(prints_of(&idx, "v", size, 0, 1).is_none());
        assert!(!dir.join("v.fprt").exists());
        // Nor prints of another block size.
        idx.rebuild("v", &img).unwrap();
        drop(idx);
        let idx = PoolIndex::open(&dir, 512).unwrap();
        assert!(prints_of(&idx, "v", size, 0, 1).is_none());
    }

    /// A file whose first read holds until the test lets it go.
    struct HeldFirstRead {
        file: std::fs::File,
        read: std::sync::mpsc::SyncSender<()>,
        go: Mutex<std::sync::mpsc::Receiver<()>>,
    }

    impl BlockSource for HeldFirstRead {
        fn byte_len(&self) -> std::io::Result<u64> {
            BlockSource::byte_len(&self.file)
        }
        fn next_data(&self, offset: u64) -> Option<u64> {
            Some(offset)
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            self.file.read_exact_at(buf, offset)?;
            if offset == 0 {
                let _ = self.read.send(());
                let _ = self.go.lock().recv();
            }
            Ok(())
        }
    }

    #[test]
    fn a_block_refreshed_while_a_rebuild_runs_keeps_the_refresh_s_print() {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("v.raw");
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(16 << 20).unwrap();
        f.write_all_at(&[1u8; 4096], 0).unwrap();
        let idx = PoolIndex::open(&d.path().join("index"), 4096).unwrap();
        idx.rebuild("v", &img).unwrap();
        let (read_tx, read_rx) = std::sync::mpsc::sync_channel(1);
        let (go_tx, go_rx) = std::sync::mpsc::sync_channel(1);
        let src = HeldFirstRead {
            file: std::fs::File::open(&img).unwrap(),
            read: read_tx,
            go: Mutex::new(go_rx),
        };
        std::thread::scope(|s| {
            let rebuild = s.spawn(|| idx.rebuild_from("v", &src, &img, ScanPace::Full).unwrap());
            // The rebuild has read block 0 (its 1s); it is written over
            // and refreshed before the rebuild records what it read.
            read_rx.recv().unwrap();
            assert!(
                prints_of(&idx, "v", 16 << 20, 0, 1).is_none(),
                "trusted while rebuilt"
            );
            f.write_all_at(&[2u8; 4096], 0).unwrap();
            idx.refresh("v", &img, &[0]).unwrap();
            go_tx.send(()).unwrap();
            rebuild.join().unwrap();
        });
        assert_eq!(
            prints_of(&idx, "v", 16 << 20, 0, 1).unwrap()[0],
            entry(&[2u8; 4096])
        );
    }

    #[test]
    fn rebuilds_of_one_volume_at_once_leave_a_whole_run() {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("v.raw");
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(16 << 20).unwrap();
        for i in 0..4096u64 {
            f.write_all_at(&(i + 1).to_le_bytes().repeat(512), i * 4096)
                .unwrap();
        }
        let idx = PoolIndex::open(&d.path().join("index"), 4096).unwrap();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| idx.rebuild("v", &img).unwrap());
            }
        });
        // A leftover of a cut-short write is cleared at the next open.
        std::fs::write(d.path().join("index/v.1-2.tmp"), b"half").unwrap();
        let again = PoolIndex::open(&d.path().join("index"), 4096).unwrap();
        assert_eq!(again.status().entries, 4096);
        assert!(!d.path().join("index/v.1-2.tmp").exists());
    }

    #[test]
    fn refreshed_blocks_replace_stale_entries_and_merge() {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("v.raw");
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(1 << 20).unwrap();
        f.write_all_at(&[1u8; 4096], 0).unwrap();
        let idx = PoolIndex::open(&d.path().join("index"), 4096).unwrap();
        idx.rebuild("v", &img).unwrap();
        let one = Fingerprint::of(&[1u8; 4096]);
        let two = Fingerprint::of(&[2u8; 4096]);
        assert_eq!(idx.lookup(&one, 4).unwrap().len(), 1);
        // Block 0 is overwritten with 2s, block 5 gets the old 1s.
        f.write_all_at(&[2u8; 4096], 0).unwrap();
        f.write_all_at(&[1u8; 4096], 5 * 4096).unwrap();
        assert_eq!(idx.refresh("v", &img, &[0, 5]).unwrap(), 2);
        assert_eq!(idx.lookup(&one, 4).unwrap(), vec![("v".to_string(), 5)]);
        assert_eq!(idx.lookup(&two, 4).unwrap(), vec![("v".to_string(), 0)]);
        assert_eq!(idx.status().entries, 2);
        // Zeroed again: gone from lookups.
        f.write_all_at(&[0u8; 4096], 5 * 4096).unwrap();
        idx.refresh("v", &img, &[5]).unwrap();
        assert!(idx.lookup(&one, 4).unwrap().is_empty());
        idx.merge("v").unwrap();
        assert!(idx.lookup(&one, 4).unwrap().is_empty());
        assert_eq!(idx.lookup(&two, 4).unwrap(), vec![("v".to_string(), 0)]);
        assert_eq!(idx.status().entries, 1);
        assert_eq!(idx.refresh("other", &img, &[0]).unwrap(), 0);
    }

    #[test]
    fn rebuild_lookup_reopen_remove() {
        let d = tempfile::tempdir().unwrap();
        let img = d.path().join("a.raw");
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(&[5u8; 4096], 1 << 20).unwrap();
        drop(f);
        let idx = PoolIndex::open(&d.path().join("index"), 4096).unwrap();
        let st = idx.rebuild("a", &img).unwrap();
        assert_eq!(st.blocks, 2048);
        let fp = Fingerprint::of(&[5u8; 4096]);
        assert_eq!(idx.lookup(&fp, 4).unwrap(), vec![("a".to_string(), 256)]);
        assert!(idx
            .lookup(&Fingerprint::of(&[6u8; 4096]), 4)
            .unwrap()
            .is_empty());
        let s = idx.status();
        assert_eq!((s.entries, s.lookups, s.hits), (1, 2, 1));
        drop(idx);
        let idx = PoolIndex::open(&d.path().join("index"), 4096).unwrap();
        assert!(idx.contains("a"));
        // Another block size: the run is dropped, to be rebuilt.
        drop(idx);
        let idx = PoolIndex::open(&d.path().join("index"), 512).unwrap();
        assert!(!idx.contains("a"));
        idx.rebuild("a", &img).unwrap();
        idx.remove("a");
        assert_eq!(idx.status().entries, 0);
    }
}
