//! One volume's fingerprint run: `(key, block)` entries sorted by key in a
//! file, with one fence key per 4 KiB page kept in memory.
//!
//! Layout (little endian):
//!
//! ```text
//! page 0     magic "FRYFIDX1", u32 version (1), u32 block size,
//!            u64 entry count, u64 volume size, 32-byte BLAKE3 of pages 1..,
//!            zero padding to 4096
//! pages 1..  256 entries of (u64 key, u64 block number) each, sorted by
//!            (key, block); the last page is zero padded
//! ```
//!
//! Opening checks magic, version, sizes and the checksum, so a torn or
//! corrupted file is rebuilt rather than trusted. (Even a trusted entry is
//! only a candidate: callers verify the block's full fingerprint.)

use crate::{check_block_size, IndexError};
use rayon::slice::ParallelSliceMut;
use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"FRYFIDX1";
const VERSION: u32 = 1;
pub const PAGE: usize = 4096;
const ENTRY: usize = 16;
const PER_PAGE: usize = PAGE / ENTRY;

/// A sorted, persisted run of one volume's fingerprints.
#[derive(Debug)]
pub struct VolumeRun {
    path: PathBuf,
    file: File,
    block_size: u32,
    entries: u64,
    volume_size: u64,
    /// First key of every entry page.
    fences: Vec<u64>,
}

/// Result of a lookup: block numbers whose fingerprint key matched.
pub type RunLookup = Vec<u64>;

impl VolumeRun {
    /// Sort `entries` (key, block) and write them to `path` atomically.
    pub fn write(
        path: &Path,
        block_size: u32,
        volume_size: u64,
        entries: &mut [(u64, u64)],
    ) -> Result<VolumeRun, IndexError> {
        check_block_size(block_size)?;
        entries.par_sort_unstable();
        // A name of this writer's own: two rebuilds of one volume at once
        // (an import's and an operator's) must not write one file.
        static WRITER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = path.with_extension(format!("{}-{n}.tmp", std::process::id()));
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| IndexError::io("create", &tmp, e))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        let mut hasher = blake3::Hasher::new();
        let wr = |w: &mut BufWriter<File>, b: &[u8]| {
            w.write_all(b).map_err(|e| IndexError::io("write", &tmp, e))
        };
        wr(&mut w, &[0u8; PAGE])?;
        let mut page = [0u8; PAGE];
        for chunk in entries.chunks(PER_PAGE) {
            page.fill(0);
            for (i, (k, b)) in chunk.iter().enumerate() {
                page[i * ENTRY..i * ENTRY + 8].copy_from_slice(&k.to_le_bytes());
                page[i * ENTRY + 8..i * ENTRY + 16].copy_from_slice(&b.to_le_bytes());
            }
            hasher.update(&page);
            wr(&mut w, &page)?;
        }
        let mut f = w
            .into_inner()
            .map_err(|e| IndexError::io("write", &tmp, e.into_error()))?;
        let mut hdr = [0u8; PAGE];
        hdr[..8].copy_from_slice(MAGIC);
        hdr[8..12].copy_from_slice(&VERSION.to_le_bytes());
        hdr[12..16].copy_from_slice(&block_size.to_le_bytes());
        hdr[16..24].copy_from_slice(&(entries.len() as u64).to_le_bytes());
        hdr[24..32].copy_from_slice(&volume_size.to_le_bytes());
        hdr[32..64].copy_from_slice(hasher.finalize().as_bytes());
        f.write_all_at(&hdr, 0)
            .map_err(|e| IndexError::io("write", &tmp, e))?;
        f.sync_all().map_err(|e| IndexError::io("fsync", &tmp, e))?;
        f.flush().map_err(|e| IndexError::io("write", &tmp, e))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| IndexError::io("rename", path, e))?;
        if let Some(dir) = path.parent() {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Self::open(path)
    }

    /// Open and check a run file; keeps only the fences in memory.
    pub fn open(path: &Path) -> Result<VolumeRun, IndexError> {
        let corrupt = |d: &str| IndexError::Corrupt {
            path: path.to_path_buf(),
            detail: d.to_string(),
        };
        let file = File::open(path).map_err(|e| IndexError::io("open", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| IndexError::io("stat", path, e))?
            .len();
        let mut hdr = [0u8; PAGE];
        file.read_exact_at(&mut hdr, 0)
            .map_err(|_| corrupt("short header"))?;
        if &hdr[..8] != MAGIC {
            return Err(corrupt("bad magic"));
        }
        let u32_at = |o: usize| u32::from_le_bytes(hdr[o..o + 4].try_into().expect("4"));
        let u64_at = |o: usize| u64::from_le_bytes(hdr[o..o + 8].try_into().expect("8"));
        if u32_at(8) != VERSION {
            return Err(corrupt("unknown version"));
        }
        let block_size = u32_at(12);
        check_block_size(block_size).map_err(|_| corrupt("bad block size"))?;
        let entries = u64_at(16);
        let volume_size = u64_at(24);
        let pages = entries.div_ceil(PER_PAGE as u64);
        if len != (pages + 1) * PAGE as u64 {
            return Err(corrupt(&format!(
                "{entries} entries need {} bytes, file has {len}",
                (pages + 1) * PAGE as u64
            )));
        }
        let mut fences = Vec::with_capacity(usize::try_from(pages).unwrap_or(0));
        let mut hasher = blake3::Hasher::new();
        let mut r = BufReader::with_capacity(1 << 20, &file);
        let mut skip = [0u8; PAGE];
        r.read_exact(&mut skip)
            .map_err(|e| IndexError::io("read", path, e))?;
        let mut page = [0u8; PAGE];
        for _ in 0..pages {
            r.read_exact(&mut page)
                .map_err(|e| IndexError::io("read", path, e))?;
            hasher.update(&page);
            fences.push(u64::from_le_bytes(page[..8].try_into().expect("8")));
        }
        if hasher.finalize().as_bytes() != &hdr[32..64] {
            return Err(corrupt("checksum mismatch"));
        }
        drop(r);
        Ok(VolumeRun {
            path: path.to_path_buf(),
            file,
            block_size,
            entries,
            volume_size,
            fences,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn block_size(&self) -> u32 {
        self.block_size
    }
    pub fn len(&self) -> u64 {
        self.entries
    }
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }
    pub fn volume_size(&self) -> u64 {
        self.volume_size
    }

    /// Bytes of RAM this run holds (the fences).
    pub fn memory_bytes(&self) -> usize {
        self.fences.capacity() * 8 + std::mem::size_of::<Self>()
    }

    fn read_page(&self, p: usize) -> Result<Vec<(u64, u64)>, IndexError> {
        let mut page = [0u8; PAGE];
        self.file
            .read_exact_at(&mut page, (p as u64 + 1) * PAGE as u64)
            .map_err(|e| IndexError::io("read", &self.path, e))?;
        let left = self.entries.saturating_sub((p * PER_PAGE) as u64);
        let n = usize::try_from(left).map_or(PER_PAGE, |l| l.min(PER_PAGE));
        Ok((0..n)
            .map(|i| {
                let k = u64::from_le_bytes(page[i * ENTRY..i * ENTRY + 8].try_into().expect("8"));
                let b =
                    u64::from_le_bytes(page[i * ENTRY + 8..i * ENTRY + 16].try_into().expect("8"));
                (k, b)
            })
            .collect())
    }

    /// Up to `max` block numbers whose key is `key`.
    pub fn lookup(&self, key: u64, max: usize) -> Result<RunLookup, IndexError> {
        let mut out = Vec::new();
        if self.fences.is_empty() {
            return Ok(out);
        }
        // The first page that can hold `key` is the one before the first fence >= key.
        let first = self.fences.partition_point(|&f| f < key).saturating_sub(1);
        for p in first..self.fences.len() {
            if self.fences[p] > key {
                break;
            }
            for (k, b) in self.read_page(p)? {
                if k == key {
                    out.push(b);
                    if out.len() >= max {
                        return Ok(out);
                    }
                } else if k > key {
                    return Ok(out);
                }
            }
        }
        Ok(out)
    }

    /// Every entry, in order (for merging a run with fresh entries).
    pub fn entries(&self) -> Result<Vec<(u64, u64)>, IndexError> {
        let mut v = Vec::with_capacity(usize::try_from(self.entries).unwrap_or(0));
        for p in 0..self.fences.len() {
            v.extend(self.read_page(p)?);
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_open_lookup_and_corruption() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("v.fidx");
        // Many duplicates of one key spanning page boundaries, plus spread keys.
        let mut e: Vec<(u64, u64)> = (0..2000u64).map(|i| (i * 7919 % 100_003, i)).collect();
        e.extend((0..600u64).map(|i| (42, 10_000 + i)));
        let run = VolumeRun::write(&p, 4096, 1 << 30, &mut e.clone()).unwrap();
        assert_eq!(run.len(), 2600);
        let run = VolumeRun::open(&p).unwrap();
        assert_eq!(
            run.lookup(42, 10_000).unwrap().len(),
            600 + e.iter().filter(|x| x.0 == 42 && x.1 < 10_000).count()
        );
        for (k, b) in e.iter().step_by(37) {
            assert!(run.lookup(*k, 10_000).unwrap().contains(b), "key {k}");
        }
        assert!(run.lookup(100_004, 10).unwrap().is_empty());
        assert!(run.lookup(u64::MAX, 10).unwrap().is_empty());
        assert_eq!(run.entries().unwrap().len(), 2600);
        assert!(run.memory_bytes() < 2600 * 16 / 10);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[5000] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        assert!(matches!(
            VolumeRun::open(&p),
            Err(IndexError::Corrupt { .. })
        ));
        std::fs::write(&p, &bytes[..4096]).unwrap();
        assert!(VolumeRun::open(&p).is_err());
    }

    #[test]
    fn empty_run() {
        let d = tempfile::tempdir().unwrap();
        let run = VolumeRun::write(&d.path().join("e"), 512, 0, &mut []).unwrap();
        assert!(run.is_empty());
        assert!(run.lookup(1, 1).unwrap().is_empty());
    }

    proptest::proptest! {
        #[test]
        fn lookups_match_a_reference(keys in proptest::collection::vec(0u64..500, 0..3000)) {
            let d = tempfile::tempdir().unwrap();
            let mut e: Vec<(u64, u64)> = keys.iter().enumerate().map(|(i, k)| (*k, i as u64)).collect();
            let run = VolumeRun::write(&d.path().join("r"), 4096, 0, &mut e).unwrap();
            for k in 0..500u64 {
                let mut got = run.lookup(k, usize::MAX).unwrap();
                got.sort_unstable();
                let want: Vec<u64> = keys.iter().enumerate().filter(|(_, x)| **x == k).map(|(i, _)| i as u64).collect();
                proptest::prop_assert_eq!(got, want);
            }
        }
    }
}
