//! The index of a whole pool: one [`VolumeRun`] per volume under
//! `<pool>/index/<volume>.fidx`, looked up together.

use crate::run::VolumeRun;
use crate::scan::scan_file;
use crate::{check_block_size, Fingerprint, IndexError, ScanStats};
use parking_lot::RwLock;
use serde::Serialize;
use std::collections::BTreeMap;
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

/// The fingerprint index of one pool.
#[derive(Debug)]
pub struct PoolIndex {
    dir: PathBuf,
    block_size: u32,
    runs: RwLock<BTreeMap<String, Arc<VolumeRun>>>,
    lookups: AtomicU64,
    hits: AtomicU64,
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
                    runs.insert(name, Arc::new(r));
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
        let (mut entries, stats) = scan_file(data, self.block_size)?;
        let run = VolumeRun::write(
            &self.dir.join(format!("{volume}.fidx")),
            self.block_size,
            stats.bytes,
            &mut entries,
        )?;
        self.runs.write().insert(volume.to_string(), Arc::new(run));
        Ok(stats)
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
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let key = fp.key();
        let runs: Vec<(String, Arc<VolumeRun>)> = self
            .runs
            .read()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut out = Vec::new();
        for (name, run) in runs {
            for b in run.lookup(key, max - out.len())? {
                out.push((name.clone(), b));
            }
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
            .map(|(n, r)| VolumeIndexStatus {
                volume: n.clone(),
                entries: r.len(),
                memory_bytes: r.memory_bytes() as u64,
                volume_size: r.volume_size(),
            })
            .collect();
        let entries: u64 = volumes.iter().map(|v| v.entries).sum();
        let memory: u64 = volumes.iter().map(|v| v.memory_bytes).sum::<u64>()
            + std::mem::size_of::<Self>() as u64;
        let disk = runs
            .values()
            .map(|r| std::fs::metadata(r.path()).map_or(0, |m| m.len()))
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
