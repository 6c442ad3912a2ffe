//! The index of a whole pool: one [`VolumeRun`] per volume under
//! `<pool>/index/<volume>.fidx`, looked up together.

use crate::run::VolumeRun;
use crate::scan::{scan_source, BlockSource, ScanPace};
use crate::{check_block_size, Fingerprint, IndexError, ScanStats};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
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
        for entry in std::fs::read_dir(dir).map_err(|e| IndexError::io("readdir", dir, e))? {
            let entry = entry.map_err(|e| IndexError::io("readdir", dir, e))?;
            let path = entry.path();
            if path.extension().and_then(|e| e.to_str()) == Some("tmp") {
                // A run whose writing a crash cut short.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if path.extension().and_then(|e| e.to_str()) != Some("fidx") {
                continue;
            }
            let Some(name) = path
                .file_stem()
                .and_then(|s| s.to_str())
                .map(str::to_string)
            else {
                continue;
            };
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
        let f = File::open(data).map_err(|e| IndexError::io("open", data, e))?;
        self.rebuild_from(volume, &f, data, pace)
    }

    /// (Re)build the run of one volume from `source` (`what` names it in
    /// errors).
    pub fn rebuild_from(
        &self,
        volume: &str,
        source: &dyn BlockSource,
        what: &Path,
        pace: ScanPace,
    ) -> Result<ScanStats, IndexError> {
        let (mut entries, stats) = scan_source(source, what, self.block_size, pace)?;
        let run = VolumeRun::write(
            &self.dir.join(format!("{volume}.fidx")),
            self.block_size,
            stats.bytes,
            &mut entries,
        )?;
        self.runs
            .write()
            .insert(volume.to_string(), volume_index(run));
        Ok(stats)
    }

    /// Re-hash `blocks` of an indexed volume from its backing file (after
    /// they were written) and record them in the volume's delta. Returns how
    /// many blocks were refreshed; 0 if the volume is not indexed.
    pub fn refresh(&self, volume: &str, data: &Path, blocks: &[u64]) -> Result<usize, IndexError> {
        if !self.contains(volume) {
            return Ok(0);
        }
        let f = File::open(data).map_err(|e| IndexError::io("open", data, e))?;
        self.refresh_from(volume, &f, data, blocks)
    }

    /// [`PoolIndex::refresh`] reading from `source` (`what` names it in errors).
    pub fn refresh_from(
        &self,
        volume: &str,
        source: &dyn BlockSource,
        what: &Path,
        blocks: &[u64],
    ) -> Result<usize, IndexError> {
        let Some(vi) = self.runs.read().get(volume).cloned() else {
            return Ok(0);
        };
        let size = source
            .byte_len()
            .map_err(|e| IndexError::io("stat", what, e))?;
        let bs = u64::from(self.block_size);
        let mut buf = vec![0u8; self.block_size as usize];
        let mut keys = Vec::with_capacity(blocks.len());
        for &b in blocks {
            let off = b * bs;
            if off >= size {
                keys.push((b, None));
                continue;
            }
            let n = usize::try_from(bs.min(size - off)).unwrap_or(usize::MAX);
            source
                .read_at(&mut buf[..n], off)
                .map_err(|e| IndexError::io("read", what, e))?;
            let blk = &buf[..n];
            keys.push((
                b,
                (!crate::is_zero(blk)).then(|| Fingerprint::of(blk).key()),
            ));
        }
        let merge = {
            let mut d = vi.delta.lock();
            for (b, k) in keys {
                d.set(b, k);
            }
            d.block_key.len() >= MERGE_AT
        };
        if merge {
            self.merge(volume)?;
        }
        Ok(blocks.len())
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

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
