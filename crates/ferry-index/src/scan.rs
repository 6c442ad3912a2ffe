//! Hashing a volume: one thread reads large sequential chunks (skipping holes
//! with SEEK_DATA), every core hashes blocks of the previous chunk meanwhile,
//! so indexing runs at the speed of reading, not of hashing. A
//! [`ScanPace::Background`] scan hashes on the calling thread alone, for
//! work that must not take the cores from guests (a volume that just
//! arrived by migration while its guest resumes).

use crate::{check_block_size, Fingerprint, IndexError};
use rayon::prelude::*;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

/// Bytes read per chunk.
const CHUNK: u64 = 8 << 20;

/// How many cores a scan may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScanPace {
    /// Every core hashes (rayon's pool): as fast as the disk reads.
    #[default]
    Full,
    /// The calling thread hashes, one block after another (plus one
    /// reader thread, which inherits its scheduling class).
    Background,
}

/// What a scan saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScanStats {
    /// Volume bytes covered.
    pub bytes: u64,
    /// Bytes actually read (holes are skipped).
    pub read_bytes: u64,
    pub blocks: u64,
    pub zero_blocks: u64,
    pub seconds: f64,
}

impl ScanStats {
    /// Volume bytes covered per second.
    pub fn rate(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// What a scan reads blocks from: a backing file, or a store that says
/// where its data is some other way (an RBD image).
pub trait BlockSource: Sync {
    /// Bytes in the source.
    fn byte_len(&self) -> std::io::Result<u64>;
    /// The first offset at or after `offset` that may hold data; `None`
    /// if only holes follow.
    fn next_data(&self, offset: u64) -> Option<u64>;
    /// Fill `buf` from `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
}

impl BlockSource for File {
    fn byte_len(&self) -> std::io::Result<u64> {
        Ok(self.metadata()?.len())
    }
    fn next_data(&self, offset: u64) -> Option<u64> {
        next_data(self, offset)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.read_exact_at(buf, offset)
    }
}

/// Offset of the next data at or after `off`, or `None` if only holes follow.
fn next_data(file: &File, off: u64) -> Option<u64> {
    let o = libc::off_t::try_from(off).ok()?;
    // SAFETY: lseek on a valid descriptor owned by `file`; no memory is passed.
    let r = unsafe { libc::lseek(file.as_raw_fd(), o, libc::SEEK_DATA) };
    if r < 0 {
        // ENXIO: nothing but holes; anything else: assume data.
        return (std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO))
            .then_some(off);
    }
    u64::try_from(r).ok()
}

/// Hash every block of `file` (of `size` bytes) in order. `f` receives the
/// number of the first block of each chunk and one entry per block: `None`
/// for an all-zero block, else its fingerprint.
pub fn scan_blocks(
    file: &dyn BlockSource,
    path: &Path,
    size: u64,
    block_size: u32,
    pace: ScanPace,
    mut f: impl FnMut(u64, &[Option<Fingerprint>]),
) -> Result<ScanStats, IndexError> {
    check_block_size(block_size)?;
    let bs = u64::from(block_size);
    let start = Instant::now();
    let mut stats = ScanStats {
        bytes: size,
        ..Default::default()
    };
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<(u64, Option<Vec<u8>>), IndexError>>(2);
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut off = 0u64;
            while off < size {
                let len = CHUNK.min(size - off);
                let has_data = file.next_data(off).is_some_and(|d| d < off + len);
                let item = if has_data {
                    let mut buf = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX)];
                    file.read_at(&mut buf, off)
                        .map(|()| (off, Some(buf)))
                        .map_err(|e| IndexError::io("read", path, e))
                } else {
                    Ok((off, None))
                };
                let failed = item.is_err();
                if tx.send(item).is_err() || failed {
                    return;
                }
                off += len;
            }
        });
        for item in rx {
            let (off, buf) = item?;
            let first = off / bs;
            let print = |blk: &[u8]| (!crate::is_zero(blk)).then(|| Fingerprint::of(blk));
            let prints: Vec<Option<Fingerprint>> = match (&buf, pace) {
                (Some(b), ScanPace::Full) => b.par_chunks(block_size as usize).map(print).collect(),
                (Some(b), ScanPace::Background) => {
                    b.chunks(block_size as usize).map(print).collect()
                }
                (None, _) => {
                    let n = CHUNK.min(size - off).div_ceil(bs);
                    vec![None; usize::try_from(n).unwrap_or(usize::MAX)]
                }
            };
            stats.read_bytes += buf.as_ref().map_or(0, |b| b.len() as u64);
            stats.blocks += prints.len() as u64;
            stats.zero_blocks += prints.iter().filter(|p| p.is_none()).count() as u64;
            f(first, &prints);
        }
        Ok::<(), IndexError>(())
    })?;
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(stats)
}

/// Index entries `(key, block)` for every non-zero block of the file at `path`.
pub fn scan_file(
    path: &Path,
    block_size: u32,
    pace: ScanPace,
) -> Result<(Vec<(u64, u64)>, ScanStats), IndexError> {
    let file = File::open(path).map_err(|e| IndexError::io("open", path, e))?;
    scan_source(&file, path, block_size, pace)
}

/// Index entries `(key, block)` for every non-zero block of `source`
/// (`path` names it in errors).
pub fn scan_source(
    source: &dyn BlockSource,
    path: &Path,
    block_size: u32,
    pace: ScanPace,
) -> Result<(Vec<(u64, u64)>, ScanStats), IndexError> {
    let size = source
        .byte_len()
        .map_err(|e| IndexError::io("stat", path, e))?;
    let mut entries = Vec::new();
    let stats = scan_blocks(source, path, size, block_size, pace, |first, prints| {
        for (i, p) in prints.iter().enumerate() {
            if let Some(p) = p {
                entries.push((p.key(), first + i as u64));
            }
        }
    })?;
    Ok((entries, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::VolumeRun;

    #[test]
    fn scan_finds_blocks_skips_zeroes_and_holes() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("img");
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(40 << 20).unwrap(); // sparse
        f.write_all_at(&[1u8; 4096], 0).unwrap();
        f.write_all_at(&[2u8; 4096], 4096 * 3).unwrap();
        f.write_all_at(&[1u8; 4096], 30 << 20).unwrap();
        drop(f);
        let (entries, st) = scan_file(&p, 4096, ScanPace::Full).unwrap();
        assert_eq!(entries.len(), 3);
        // One thread finds the same.
        let (alone, _) = scan_file(&p, 4096, ScanPace::Background).unwrap();
        assert_eq!(alone, entries);
        assert_eq!(st.blocks, 10240);
        assert_eq!(st.zero_blocks, 10237);
        assert!(
            st.read_bytes < 40 << 20,
            "holes were read: {}",
            st.read_bytes
        );
        let key1 = Fingerprint::of(&[1u8; 4096]).key();
        let mut e = entries.clone();
        let run = VolumeRun::write(&d.path().join("r"), 4096, 40 << 20, &mut e).unwrap();
        let mut hits = run.lookup(key1, 10).unwrap();
        hits.sort_unstable();
        assert_eq!(hits, vec![0, (30 << 20) / 4096]);
    }

    #[test]
    fn odd_tail_block_is_hashed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("img");
        std::fs::write(&p, vec![7u8; 4096 + 100]).unwrap();
        let (entries, st) = scan_file(&p, 4096, ScanPace::Background).unwrap();
        assert_eq!(st.blocks, 2);
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[1].0, Fingerprint::of(&[7u8; 100]).key());
    }
}
