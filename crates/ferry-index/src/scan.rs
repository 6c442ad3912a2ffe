//! Hashing a volume: one thread reads large sequential chunks (skipping holes
//! with SEEK_DATA), every core hashes blocks of the previous chunk meanwhile,
//! so indexing runs at the speed of reading, not of hashing. A
//! [`ScanPace::Background`] scan reads and hashes on the calling thread
//! alone, for work that must not take the cores from guests (a volume that
//! just arrived by migration while its guest resumes), and yields to the
//! rest of its process ([`Yielder`]): while the process's other threads are
//! busy (serving clients), it hashes one chunk per [`YIELD_FOR`].

use crate::{check_block_size, Fingerprint, IndexError};
use rayon::prelude::*;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

/// Bytes read per chunk.
const CHUNK: u64 = 8 << 20;

/// How long a background scan waits after a chunk while the rest of its
/// process is busy: a chunk (2-5 ms of one core to read and hash) per this
/// is a few percent of a core, and 1 GiB still indexed in 13 s.
pub const YIELD_FOR: Duration = Duration::from_millis(100);

/// The share of one core the rest of the process may use, between two
/// chunks of a background scan, for the process to count as idle: its
/// periodic work stays below it, serving a client at speed far above.
const BUSY_SHARE: f64 = 0.2;

/// How many cores a scan may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScanPace {
    /// Every core hashes (rayon's pool): as fast as the disk reads.
    #[default]
    Full,
    /// The calling thread reads and hashes, one chunk after another, and
    /// waits [`YIELD_FOR`] after a chunk while the rest of the process is
    /// busy ([`Yielder`]).
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
    /// Times a background scan waited for the rest of its process.
    pub yields: u64,
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
    if pace == ScanPace::Background {
        return scan_in_background(file, path, size, block_size, stats, start, f);
    }
    let (tx, rx) = std::sync::mpsc::sync_channel::<Result<(u64, Option<Vec<u8>>), IndexError>>(2);
    std::thread::scope(|s| {
        s.spawn(move || {
            let mut off = 0u64;
            while off < size {
                let len = CHUNK.min(size - off);
                let item = if holds_data(file, off, len) {
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
            let prints: Vec<Option<Fingerprint>> = match &buf {
                Some(b) => b.par_chunks(block_size as usize).map(print).collect(),
                None => vec![None; hole_blocks(size, off, bs)],
            };
            stats.count(buf.as_deref(), &prints);
            f(first, &prints);
        }
        Ok::<(), IndexError>(())
    })?;
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(stats)
}

/// A block's fingerprint; `None` for an all-zero block.
fn print(blk: &[u8]) -> Option<Fingerprint> {
    (!crate::is_zero(blk)).then(|| Fingerprint::of(blk))
}

/// Whether the `len` bytes of `file` at `off` may hold data (not all hole).
fn holds_data(file: &dyn BlockSource, off: u64, len: u64) -> bool {
    file.next_data(off).is_some_and(|d| d < off + len)
}

/// Blocks of the chunk at `off` (of a source of `size` bytes).
fn hole_blocks(size: u64, off: u64, bs: u64) -> usize {
    usize::try_from(CHUNK.min(size - off).div_ceil(bs)).unwrap_or(usize::MAX)
}

impl ScanStats {
    fn count(&mut self, buf: Option<&[u8]>, prints: &[Option<Fingerprint>]) {
        self.read_bytes += buf.map_or(0, |b| b.len() as u64);
        self.blocks += prints.len() as u64;
        self.zero_blocks += prints.iter().filter(|p| p.is_none()).count() as u64;
    }
}

/// [`scan_blocks`] at [`ScanPace::Background`]: each chunk read and
/// hashed on this thread, then a wait of [`YIELD_FOR`] whenever the rest
/// of the process was busy meanwhile.
fn scan_in_background(
    file: &dyn BlockSource,
    path: &Path,
    size: u64,
    block_size: u32,
    mut stats: ScanStats,
    start: Instant,
    mut f: impl FnMut(u64, &[Option<Fingerprint>]),
) -> Result<ScanStats, IndexError> {
    let bs = u64::from(block_size);
    let mut yielder = Yielder::new();
    let mut buf = Vec::new();
    let mut off = 0u64;
    while off < size {
        let len = CHUNK.min(size - off);
        let prints: Vec<Option<Fingerprint>> = if holds_data(file, off, len) {
            buf.resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
            file.read_at(&mut buf, off)
                .map_err(|e| IndexError::io("read", path, e))?;
            let prints: Vec<Option<Fingerprint>> =
                buf.chunks(block_size as usize).map(print).collect();
            stats.count(Some(&buf), &prints);
            prints
        } else {
            let prints = vec![None; hole_blocks(size, off, bs)];
            stats.count(None, &prints);
            prints
        };
        f(off / bs, &prints);
        off += len;
        if off < size && yielder.others_busy() {
            std::thread::sleep(YIELD_FOR);
            yielder.restart();
            stats.yields += 1;
        }
    }
    stats.seconds = start.elapsed().as_secs_f64();
    Ok(stats)
}

/// Whether the rest of the process (its threads but the calling one) used
/// more than [`BUSY_SHARE`] of a core since the last look: the CPU time of
/// the process less that of this thread, over the wall time between.
pub struct Yielder {
    at: Instant,
    others: Duration,
}

impl Yielder {
    pub fn new() -> Yielder {
        Yielder {
            at: Instant::now(),
            others: others_cpu(),
        }
    }

    /// Busy since the last look (or [`restart`](Self::restart))? Starts
    /// the next interval.
    pub fn others_busy(&mut self) -> bool {
        let (now, others) = (Instant::now(), others_cpu());
        let used = others.saturating_sub(self.others);
        let wall = now - self.at;
        (self.at, self.others) = (now, others);
        busy(used, wall)
    }

    /// Start a new interval now (after a wait, which is not counted).
    pub fn restart(&mut self) {
        (self.at, self.others) = (Instant::now(), others_cpu());
    }
}

impl Default for Yielder {
    fn default() -> Self {
        Yielder::new()
    }
}

/// `used` CPU time of the others over `wall`: more than [`BUSY_SHARE`] of
/// a core.
fn busy(used: Duration, wall: Duration) -> bool {
    used.as_secs_f64() > BUSY_SHARE * wall.as_secs_f64().max(1e-3)
}

/// CPU time (user and system) of the process less that of this thread.
fn others_cpu() -> Duration {
    let usage = |who| {
        // SAFETY: getrusage fills the zeroed struct it is given.
        let mut r: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: a valid `who` and a pointer to a live rusage.
        if unsafe { libc::getrusage(who, &mut r) } != 0 {
            return Duration::ZERO;
        }
        let tv = |t: libc::timeval| {
            Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
                + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
        };
        tv(r.ru_utime) + tv(r.ru_stime)
    };
    usage(libc::RUSAGE_SELF).saturating_sub(usage(libc::RUSAGE_THREAD))
}

/// Open a volume's data file for the index to read, with
/// `POSIX_FADV_RANDOM` on this open file: what a scan or a refresh brings
/// into the page cache then comes in page-sized folios, as the volume's
/// own small writes make them.
///
/// Read ahead in large runs (a plain sequential read), it comes in large
/// folios (up to 2 MiB on ext4 since Linux 6.16), and each later 4 KiB
/// write into one costs the volume's clients about ten times the kernel
/// CPU, ext4 walking every block of the folio: 4 KiB writes into a 1 GiB
/// file read cold ran at 20k a second here, against 400k once read this
/// way. The scan's reads are 8 MiB each already; read-ahead only ran them
/// faster from a cold disk (1.2 against 0.77 GB/s here).
pub fn open_data(path: &Path) -> Result<File, IndexError> {
    let file = File::open(path).map_err(|e| IndexError::io("open", path, e))?;
    // SAFETY: posix_fadvise on a valid descriptor owned by `file`; no
    // memory is passed. Advisory: a file system that ignores it is read
    // as before.
    let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
    Ok(file)
}

/// Index entries `(key, block)` for every non-zero block of the file at `path`.
pub fn scan_file(
    path: &Path,
    block_size: u32,
    pace: ScanPace,
) -> Result<(Vec<(u64, u64)>, ScanStats), IndexError> {
    let file = open_data(path)?;
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

    /// How many of the pages of `path` (all cached) sit in large folios
    /// (compound pages), from the PFNs of a mapping of it
    /// (`/proc/self/pagemap`) and their flags (`/proc/kpageflags`); `None`
    /// where those cannot be read (PFNs need root).
    fn pages_in_large_folios(path: &Path) -> Option<usize> {
        const PAGE: usize = 4096;
        const COMPOUND: u64 = (1 << 15) | (1 << 16); // KPF_COMPOUND_HEAD | _TAIL
        let pagemap = File::open("/proc/self/pagemap").ok()?;
        let flags = File::open("/proc/kpageflags").ok()?;
        let file = File::open(path).unwrap();
        let len = usize::try_from(file.metadata().unwrap().len()).unwrap();
        // SAFETY: a fresh read-only shared mapping of `len` bytes of an
        // open file, unmapped below; nothing else refers to it.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        let mut large = Some(0);
        for i in 0..len / PAGE {
            // SAFETY: inside the mapping; every page of the file is cached,
            // so the read maps it and allocates nothing.
            let addr = unsafe { map.cast::<u8>().add(i * PAGE) };
            // SAFETY: `addr` is a readable byte of the mapping.
            std::hint::black_box(unsafe { addr.read_volatile() });
            let mut e = [0u8; 8];
            pagemap
                .read_exact_at(&mut e, (addr as u64 / PAGE as u64) * 8)
                .unwrap();
            let pfn = u64::from_le_bytes(e) & ((1 << 55) - 1);
            if pfn == 0 {
                large = None; // PFNs hidden: not root
                break;
            }
            let mut f = [0u8; 8];
            if flags.read_exact_at(&mut f, pfn * 8).is_err() {
                large = None;
                break;
            }
            if u64::from_le_bytes(f) & COMPOUND != 0 {
                large = large.map(|n| n + 1);
            }
        }
        // SAFETY: the mapping made above, of `len` bytes.
        unsafe { libc::munmap(map, len) };
        large
    }

    #[test]
    fn a_scan_brings_a_cold_file_into_the_cache_in_page_sized_folios() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("img");
        let data: Vec<u8> = (0..(32u32 << 20))
            .map(|i| (i / 4096 % 251) as u8 + 1)
            .collect();
        std::fs::write(&p, &data).unwrap();
        for pace in [ScanPace::Full, ScanPace::Background] {
            // Written back and dropped from the cache.
            let f = File::open(&p).unwrap();
            f.sync_all().unwrap();
            // SAFETY: posix_fadvise on a valid descriptor; no memory is passed.
            let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            assert_eq!(r, 0);
            drop(f);
            let (entries, _) = scan_file(&p, 4096, pace).unwrap();
            assert_eq!(entries.len(), 8192);
            match pages_in_large_folios(&p) {
                // Read ahead as usual, the scan left 6,144 of the 8,192
                // pages in large folios here (Linux 6.18, ext4).
                Some(n) => assert_eq!(n, 0, "{pace:?}: {n} of 8192 pages in large folios"),
                None => {
                    eprintln!("skipped: the page flags need root");
                    return;
                }
            }
        }
    }

    #[test]
    fn the_rest_of_the_process_is_busy_above_a_fifth_of_a_core() {
        let ms = Duration::from_millis;
        assert!(!busy(ms(0), ms(100)));
        assert!(!busy(ms(19), ms(100)));
        assert!(busy(ms(21), ms(100)));
        // Two threads flat out.
        assert!(busy(ms(200), ms(100)));
        // No time passed: nothing to judge by, not busy.
        assert!(!busy(Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn a_background_scan_waits_for_a_busy_process_and_still_indexes_everything() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("img");
        let data: Vec<u8> = (0..(48u32 << 20)).map(|i| (i / 4096 % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let (full, _) = scan_file(&p, 4096, ScanPace::Full).unwrap();
        // Another thread of this process works flat out meanwhile.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spin = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
            })
        };
        let (alone, st) = scan_file(&p, 4096, ScanPace::Background).unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spin.join().unwrap();
        assert_eq!(alone, full);
        // Six chunks: a wait after each but the last.
        assert_eq!(st.yields, 5, "{st:?}");
    }
}
