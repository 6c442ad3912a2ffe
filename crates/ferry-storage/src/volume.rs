//! One volume: its backing file, positional I/O, zeroing and trimming, the
//! allocation map, and its dirty bitmaps.
//!
//! Invariant: every write, zero and trim marks every dirty bitmap of the
//! volume after the data reached the file and before the call returns, even
//! when the operation failed part-way (a partial write may have changed bytes).

use crate::alloc::{self, Extent};
use crate::bitmap::{BitmapInfo, DirtyBitmap};
use crate::gate::{WriteGate, WriteTicket};
use crate::meta::{write_atomic, Backing, BitmapSpec, IncomingMigration, PeerPort, VolumeMeta};
use crate::page_cache;
use crate::shared::Home;
use crate::{Result, StorageError};
use parking_lot::{Mutex, RwLock};
use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

mod sanitize;
pub use sanitize::{SanitizeJob, SanitizeOp, SanitizeStatus};

/// Marker file present while a volume is open; found at start-up it means the
/// last run did not close the volume cleanly.
const IN_USE: &str = "in-use";
const ALIGN: usize = 4096;

/// How WRITE_ZEROES may be carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ZeroMode {
    /// The range may be deallocated (NBD: NO_HOLE not set).
    pub may_punch: bool,
    /// Fail with [`StorageError::NotFast`] rather than write zeroes slowly.
    pub fast_only: bool,
}

/// Where an open volume's bytes are.
#[derive(Debug)]
enum Data {
    /// A raw file (in the pool, or external): positional I/O, page cache.
    /// Shared so that a reply sent from it by the kernel
    /// ([`Volume::cached_file`]) keeps it open until sent.
    File(Arc<File>),
    /// An RBD image, its exclusive lock held while writable.
    Rbd(RbdData),
}

/// An open RBD image, closed (watch and lock released) before the image
/// is removed: Ceph refuses to remove an image someone still watches.
#[derive(Debug)]
struct RbdData {
    image: RwLock<Option<ferry_rbd::Image>>,
}

impl RbdData {
    /// Run `f` on the image, `op` naming it in errors.
    fn with<T>(
        &self,
        op: &'static str,
        f: impl FnOnce(&ferry_rbd::Image) -> ferry_rbd::Result<T>,
    ) -> Result<T> {
        let img = self.image()?;
        f(&img).map_err(|e| StorageError::rbd(op, e))
    }

    /// The open image (an error once it is closed).
    fn image(&self) -> Result<parking_lot::MappedRwLockReadGuard<'_, ferry_rbd::Image>> {
        parking_lot::RwLockReadGuard::try_map(self.image.read(), Option::as_ref).map_err(|_| {
            StorageError::Invalid("the volume's RBD image is closed (volume deleted)".into())
        })
    }
}

/// An open volume. Cheap to share (`Arc<Volume>`); the data path takes no
/// lock other than a read lock on the bitmap list.
#[derive(Debug)]
pub struct Volume {
    dir: PathBuf,
    data_path: PathBuf,
    data: Data,
    /// Metadata, bitmaps and the in-use marker in the image's metadata
    /// (a shared volume, [`crate::shared`]) instead of `dir`.
    shared: bool,
    direct: bool,
    meta: Mutex<VolumeMeta>,
    /// Held while `meta` is being stored, so that stores land in the order
    /// of the states they store (one may be taken from memory after the
    /// state changed there: [`Volume::mark_moved`]).
    meta_store: Mutex<()>,
    // Immutable after creation; kept outside the mutex for the data path.
    name: String,
    block_size: u32,
    read_only: bool,
    sparse: bool,
    size: AtomicU64,
    bitmaps: RwLock<Vec<Arc<DirtyBitmap>>>,
    deleted: AtomicBool,
    /// Cleared when the file system refuses RWF_NOWAIT buffered writes.
    nowait_writes: AtomicBool,
    /// Cleared when the file system refuses to share extents with another
    /// file (FICLONERANGE: ext4 does not; XFS with reflink and btrfs do).
    shares_extents: AtomicBool,
    /// Pauses and throttles writers during a migration.
    gate: Arc<WriteGate>,
    /// Set once the volume has moved to another server: writes fail.
    moved: AtomicBool,
    /// Whether its last migration switched is unknown: writes fail and it
    /// is not served until the destination is asked.
    in_doubt: AtomicBool,
    /// Clients and migrations that hold it.
    holders: crate::holders::Holders,
    /// A sanitize running, or failed (I/O refused).
    sanitize: sanitize::SanitizeCell,
    /// The slowest write, zeroing, trim or flush since
    /// [`Volume::take_slowest_write`], in µs (gate waits included).
    slowest_write_us: AtomicU64,
}

/// Times one write-side operation into [`Volume::slowest_write_us`] however
/// it ends.
struct WriteTimer<'a> {
    slowest: &'a AtomicU64,
    start: std::time::Instant,
}

impl Drop for WriteTimer<'_> {
    fn drop(&mut self) {
        let us = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.slowest.fetch_max(us, Ordering::Relaxed);
    }
}

/// `preadv2`/`pwritev2` on one buffer; `Ok(n)` bytes done.
///
/// # Safety
///
/// `ptr` must point to `len` bytes that stay valid for the whole call:
/// readable when `write`, writable (possibly uninitialised) otherwise, and
/// not accessed by anything else meanwhile.
unsafe fn rw_raw(
    file: &File,
    write: bool,
    ptr: *mut u8,
    len: usize,
    offset: u64,
    flags: libc::c_int,
) -> std::io::Result<usize> {
    let off = libc::off_t::try_from(offset)
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let iov = libc::iovec {
        iov_base: ptr.cast(),
        iov_len: len,
    };
    // SAFETY: `iov` describes `len` bytes at `ptr`, which this function's
    // contract makes valid (readable for writes, writable for reads) for the
    // call; the descriptor is owned by `file`.
    let r = unsafe {
        if write {
            libc::pwritev2(file.as_raw_fd(), &iov, 1, off, flags)
        } else {
            libc::preadv2(file.as_raw_fd(), &iov, 1, off, flags)
        }
    };
    usize::try_from(r).map_err(|_| std::io::Error::last_os_error())
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAGAIN) | Some(libc::EOPNOTSUPP)
    )
}

fn fallocate(file: &File, mode: libc::c_int, offset: u64, len: u64) -> std::io::Result<()> {
    let off = libc::off_t::try_from(offset)
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let l =
        libc::off_t::try_from(len).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: fallocate on a valid descriptor owned by `file`; no memory is passed.
    let r = unsafe { libc::fallocate(file.as_raw_fd(), mode, off, l) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// A heap buffer aligned for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    fn zeroed(len: usize) -> AlignedBuf {
        let layout =
            std::alloc::Layout::from_size_align(len.max(ALIGN), ALIGN).expect("valid layout");
        // SAFETY: layout has non-zero size; a null result is handled below.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, layout }
    }
    fn as_mut_slice(&mut self, len: usize) -> &mut [u8] {
        assert!(len <= self.layout.size());
        // SAFETY: ptr is valid for layout.size() bytes, initialised (zeroed), uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated with exactly this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl Volume {
    /// Open the volume stored in `dir`.
    pub(crate) fn open(
        dir: &Path,
        direct: bool,
        ceph: Option<&crate::CephStore>,
    ) -> Result<Volume> {
        let meta = VolumeMeta::load(&dir.join("meta.json"))?;
        let (data, data_path, direct) = match &meta.backing {
            Backing::Rbd { pool, image } => {
                let store = ceph.filter(|c| c.pool.name() == pool).ok_or_else(|| {
                    StorageError::Invalid(format!(
                        "volume {} lives in Ceph pool {pool}, which this daemon is not configured with ([storage.ceph] pool = {pool:?})",
                        meta.name
                    ))
                })?;
                let img = store
                    .pool
                    .open_breaking(image, meta.read_only, &store.dead_owners)
                    .map_err(|e| StorageError::rbd("open", e))?;
                let path = PathBuf::from(format!("rbd:{pool}/{image}"));
                (
                    Data::Rbd(RbdData {
                        image: RwLock::new(Some(img)),
                    }),
                    path,
                    false,
                )
            }
            _ => {
                let (file, path) = Self::open_file(&meta, dir, direct)?;
                (Data::File(Arc::new(file)), path, direct)
            }
        };
        Self::open_on(dir, meta, data, data_path, direct, Home::Dir)
    }

    /// A shared volume this gateway has just claimed (see
    /// [`crate::shared`]); `dir` is only its name's place in the pool.
    pub(crate) fn open_shared(dir: &Path, claimed: crate::shared::Claimed) -> Result<Volume> {
        let path = PathBuf::from(format!("rbd:{}", claimed.image.spec()));
        let data = Data::Rbd(RbdData {
            image: RwLock::new(Some(claimed.image)),
        });
        Self::open_on(
            dir,
            claimed.meta,
            data,
            path,
            false,
            Home::Cluster {
                unclean: claimed.unclean,
            },
        )
    }

    /// Open and lock a volume's backing file.
    fn open_file(meta: &VolumeMeta, dir: &Path, direct: bool) -> Result<(File, PathBuf)> {
        let data_path = match &meta.backing {
            Backing::External { path } => path.clone(),
            _ => dir.join("data.raw"),
        };
        let mut oo = OpenOptions::new();
        oo.read(true).write(!meta.read_only);
        if direct {
            oo.custom_flags(libc::O_DIRECT);
        }
        let file = oo
            .open(&data_path)
            .map_err(|e| StorageError::io("open", &data_path, e))?;
        // One writer per data file: a second volume (or another ferry)
        // aliasing it would write behind the first one's dirty bitmaps.
        // Read-only volumes may share a file with each other.
        let how = if meta.read_only {
            libc::LOCK_SH
        } else {
            libc::LOCK_EX
        };
        // SAFETY: flock on a descriptor `file` owns; no memory is involved.
        if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                StorageError::Invalid(format!(
                    "data file {} is in use by another volume or process",
                    data_path.display()
                ))
            } else {
                StorageError::io("lock", &data_path, e)
            });
        }
        Ok((file, data_path))
    }

    fn open_on(
        dir: &Path,
        meta: VolumeMeta,
        data: Data,
        data_path: PathBuf,
        direct: bool,
        home: Home,
    ) -> Result<Volume> {
        let (unclean, shared) = match home {
            Home::Dir => (dir.join(IN_USE).exists(), false),
            Home::Cluster { unclean } => (unclean, true),
        };
        let mut bitmaps = Vec::new();
        for spec in &meta.bitmaps {
            let loaded = match (&data, shared) {
                (Data::Rbd(r), true) => r
                    .image()
                    .and_then(|img| crate::shared::read_bitmap(&img, &spec.name))
                    .and_then(|b| DirtyBitmap::decode(&spec.name, &b, &data_path)),
                _ => {
                    let p = dir.join("bitmaps").join(format!("{}.bitmap", spec.name));
                    fs::read(&p)
                        .map_err(|e| StorageError::io("read", &p, e))
                        .and_then(|b| DirtyBitmap::decode(&spec.name, &b, &p))
                }
            };
            let bm = match loaded {
                Ok(b) if b.granularity() == spec.granularity => b,
                other => {
                    if let Err(e) = other {
                        tracing::warn!(volume = %meta.name, bitmap = %spec.name, error = %e, "bitmap unreadable; marking it all dirty");
                    }
                    let b = DirtyBitmap::new(&spec.name, spec.granularity, meta.size, true)?;
                    b.mark_all();
                    b
                }
            };
            bm.resize(meta.size);
            if unclean {
                tracing::warn!(volume = %meta.name, bitmap = %spec.name, "volume was not closed cleanly; marking persistent bitmap all dirty");
                bm.mark_all();
            }
            bitmaps.push(Arc::new(bm));
        }
        if !meta.read_only && !shared {
            fs::write(dir.join(IN_USE), b"")
                .map_err(|e| StorageError::io("create", dir.join(IN_USE), e))?;
            crate::meta::sync_dir(dir)?;
        }
        Ok(Volume {
            dir: dir.to_path_buf(),
            data_path,
            data,
            shared,
            direct,
            size: AtomicU64::new(meta.size),
            name: meta.name.clone(),
            block_size: meta.block_size,
            read_only: meta.read_only,
            sparse: !matches!(meta.backing, Backing::Preallocated),
            moved: AtomicBool::new(meta.moved_to.is_some()),
            in_doubt: AtomicBool::new(meta.outgoing.as_ref().is_some_and(|o| o.switch_sent)),
            sanitize: sanitize::SanitizeCell::from_journal(meta.sanitize.as_ref()),
            meta: Mutex::new(meta),
            meta_store: Mutex::new(()),
            bitmaps: RwLock::new(bitmaps),
            deleted: AtomicBool::new(false),
            holders: Default::default(),
            nowait_writes: AtomicBool::new(true),
            shares_extents: AtomicBool::new(true),
            gate: Arc::default(),
            slowest_write_us: AtomicU64::new(0),
        })
    }

    fn write_timer(&self) -> WriteTimer<'_> {
        WriteTimer {
            slowest: &self.slowest_write_us,
            start: std::time::Instant::now(),
        }
    }

    /// The slowest write, zeroing, trim or flush a client made since the
    /// last call (its time in the engine, waits at a migration's write
    /// gate included), and start again: what a migration cost its volume's
    /// writers beyond the switch's own hold (throttle delays, a flush slowed
    /// by a burst of writeback).
    pub fn take_slowest_write(&self) -> std::time::Duration {
        std::time::Duration::from_micros(self.slowest_write_us.swap(0, Ordering::Relaxed))
    }

    pub fn name(&self) -> String {
        self.name.clone()
    }
    pub fn meta(&self) -> VolumeMeta {
        self.meta.lock().clone()
    }
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }
    pub fn direct_io(&self) -> bool {
        self.direct
    }
    pub fn data_path(&self) -> &Path {
        &self.data_path
    }
    /// Whether reads and writes go through this host's page cache (a file
    /// without O_DIRECT): a write is then quick once on a thread, and a
    /// read may be tried without blocking. An RBD image's I/O always waits
    /// for the cluster.
    pub fn page_cached(&self) -> bool {
        matches!(self.data, Data::File(_)) && !self.direct
    }

    /// The backing file, to send `len` bytes at `offset` from without
    /// reading them here (sendfile), when the range is valid to read now
    /// and the page cache holds every page of it: the send then copies
    /// from memory and does not wait for the disk. `Ok(None)`: read it
    /// as usual (an RBD image, O_DIRECT, pages not cached, or a kernel
    /// without `cachestat(2)`).
    ///
    /// What is sent is what the file holds when the kernel sends it: a
    /// write acknowledged before then is seen, as with any read answered
    /// later; one racing with the send may be seen in part, as with a read
    /// racing with it.
    pub fn cached_file(&self, offset: u64, len: u64) -> Result<Option<Arc<File>>> {
        self.check(offset, len, false)?;
        let file = match &self.data {
            Data::File(f) if !self.direct => f,
            _ => return Ok(None),
        };
        Ok(page_cache::holds_all(file, offset, len).then(|| file.clone()))
    }

    /// Whether the data is an RBD image in Ceph.
    pub fn on_ceph(&self) -> bool {
        matches!(self.data, Data::Rbd(_))
    }
    pub fn is_sparse(&self) -> bool {
        self.sparse
    }

    fn check(&self, offset: u64, len: u64, write: bool) -> Result<()> {
        if self.deleted.load(Ordering::Acquire) {
            return Err(StorageError::NotFound(self.name.clone()));
        }
        if write && self.read_only {
            return Err(StorageError::ReadOnly(self.name.clone()));
        }
        // Reads too: a client still connected here would see data that is
        // no longer current.
        self.check_not_moved()?;
        let size = self.size();
        if offset.checked_add(len).is_none_or(|e| e > size) {
            return Err(StorageError::OutOfRange { offset, len, size });
        }
        if self.direct {
            let bs = u64::from(self.block_size);
            if !offset.is_multiple_of(bs) || !len.is_multiple_of(bs) {
                return Err(StorageError::Invalid(format!(
                    "O_DIRECT volume needs {bs}-byte aligned I/O (offset {offset}, length {len})"
                )));
            }
        }
        Ok(())
    }

    /// Fails once the volume has moved (checked inside the write gate, so a
    /// write held by a migration's pause fails if the switch happened), and
    /// while a sanitize runs or after one failed.
    fn check_not_moved(&self) -> Result<()> {
        self.sanitize.check(&self.name)?;
        self.check_here()
    }

    /// Fails once the volume has moved, or while its last move is in doubt.
    fn check_here(&self) -> Result<()> {
        if self.in_doubt.load(Ordering::SeqCst) {
            let to = self
                .meta
                .lock()
                .outgoing
                .as_ref()
                .map(|o| o.to.clone())
                .unwrap_or_default();
            return Err(StorageError::InDoubt {
                name: self.name.clone(),
                to,
            });
        }
        if self.moved.load(Ordering::SeqCst) {
            let to = self.meta.lock().moved_to.clone().unwrap_or_default();
            return Err(StorageError::Moved {
                name: self.name.clone(),
                to,
            });
        }
        Ok(())
    }

    fn io_err(&self, op: &'static str, e: std::io::Error) -> StorageError {
        StorageError::io(op, &self.data_path, e)
    }

    fn mark(&self, offset: u64, len: u64) {
        for b in self.bitmaps.read().iter() {
            b.mark(offset, len);
        }
    }

    /// Read `buf.len()` bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check(offset, buf.len() as u64, false)?;
        self.read_backing(offset, buf)
    }

    /// Read from the backing store, no check made.
    fn read_backing(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let file = match &self.data {
            Data::Rbd(r) => return r.with("read", |img| img.read_at(buf, offset)),
            Data::File(f) => f,
        };
        if self.direct {
            let mut a = AlignedBuf::zeroed(buf.len());
            file.read_exact_at(a.as_mut_slice(buf.len()), offset)
                .map_err(|e| self.io_err("read", e))?;
            buf.copy_from_slice(a.as_mut_slice(buf.len()));
            return Ok(());
        }
        file.read_exact_at(buf, offset)
            .map_err(|e| self.io_err("read", e))
    }

    /// Write to the backing store, no check made, no bitmap marked.
    fn write_backing(&self, offset: u64, data: &[u8]) -> Result<()> {
        let file = match &self.data {
            Data::Rbd(r) => return r.with("write", |img| img.write_at(data, offset)),
            Data::File(f) => f,
        };
        let r = if self.direct {
            let mut a = AlignedBuf::zeroed(data.len());
            a.as_mut_slice(data.len()).copy_from_slice(data);
            file.write_all_at(a.as_mut_slice(data.len()), offset)
        } else {
            file.write_all_at(data, offset)
        };
        r.map_err(|e| self.io_err("write", e))
    }

    /// Read like [`Volume::read_at`], but fill the backing file's holes
    /// with zeroes here instead of reading them. Reading a hole makes the
    /// kernel allocate and zero a page-cache page for every 4 KiB of it:
    /// for a bulk reader of a mostly empty volume (a migration's
    /// fingerprint pass) that was most of its CPU, taken from the guests,
    /// and a page cache full of zeroes. A write racing with this read is
    /// seen or not, as with `read_at`; callers track writes with a bitmap.
    pub fn read_sparse_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let file = match &self.data {
            Data::File(f) if !self.direct && self.sparse => f,
            // An RBD image's missing objects cost no OSD read (object map).
            _ => return self.read_at(offset, buf),
        };
        self.check(offset, buf.len() as u64, false)?;
        let len = buf.len() as u64;
        let mut done = 0u64;
        for e in alloc::extents(file, offset, len, 256) {
            let (from, to) = (e.offset - offset, e.offset - offset + e.length);
            let (a, b) = (
                usize::try_from(from).unwrap_or(usize::MAX),
                usize::try_from(to).unwrap_or(usize::MAX),
            );
            if e.hole {
                buf[a..b].fill(0);
            } else {
                file.read_exact_at(&mut buf[a..b], e.offset)
                    .map_err(|e| self.io_err("read", e))?;
            }
            done = to;
        }
        if done < len {
            // More extents than asked for: read the rest.
            let a = usize::try_from(done).unwrap_or(usize::MAX);
            file.read_exact_at(&mut buf[a..], offset + done)
                .map_err(|e| self.io_err("read", e))?;
        }
        Ok(())
    }

    /// Read `len` bytes at `offset`, appending them to `out` without
    /// zero-filling first. With `nowait`, give up (`Ok(false)`, `out`
    /// unchanged) rather than block, e.g. when the data is not in the page
    /// cache; the caller then retries without `nowait` on a worker thread.
    pub fn read_append(
        &self,
        offset: u64,
        len: usize,
        out: &mut bytes::BytesMut,
        nowait: bool,
    ) -> Result<bool> {
        self.check(offset, len as u64, false)?;
        let file = match &self.data {
            Data::File(f) if !self.direct => f,
            _ => {
                if nowait {
                    return Ok(false);
                }
                let start = out.len();
                out.resize(start + len, 0);
                return self.read_backing(offset, &mut out[start..]).map(|()| true);
            }
        };
        out.reserve(len);
        let start = out.len();
        let flags = if nowait { libc::RWF_NOWAIT } else { 0 };
        let mut done = 0usize;
        while done < len {
            let spare = &mut out.spare_capacity_mut()[done..len];
            // SAFETY: `spare` is this vector's own spare capacity, at least
            // `len - done` bytes, borrowed mutably for the call.
            let r = unsafe {
                rw_raw(
                    file,
                    false,
                    spare.as_mut_ptr().cast(),
                    len - done,
                    offset + done as u64,
                    flags,
                )
            };
            match r {
                Ok(0) => {
                    return Err(self.io_err(
                        "read",
                        std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                    ));
                }
                Ok(n) => done += n,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if nowait && would_block(&e) => return Ok(false),
                Err(e) => return Err(self.io_err("read", e)),
            }
        }
        // SAFETY: the kernel initialised exactly `len` bytes after `start`.
        unsafe { out.set_len(start + len) };
        Ok(true)
    }

    /// Try to write without blocking (page cache has room, no allocation
    /// wait). `Ok(false)` means retry with [`Volume::write_at`]; bitmaps are
    /// marked whenever any byte may have changed.
    pub fn try_write_nowait(&self, offset: u64, data: &[u8]) -> Result<bool> {
        self.check(offset, data.len() as u64, true)?;
        if !self.nowait_writes() {
            return Ok(false);
        }
        let Data::File(file) = &self.data else {
            return Ok(false);
        };
        let Some(_ticket) = self.gate.try_enter() else {
            return Ok(false);
        };
        self.check_not_moved()?;
        let mut done = 0usize;
        let result = loop {
            if done == data.len() {
                break Ok(true);
            }
            let rest = &data[done..];
            // SAFETY: `rest` is a live borrowed slice; a write only reads it.
            let r = unsafe {
                rw_raw(
                    file,
                    true,
                    rest.as_ptr().cast_mut(),
                    rest.len(),
                    offset + done as u64,
                    libc::RWF_NOWAIT,
                )
            };
            match r {
                Ok(0) => break Ok(false),
                Ok(n) => done += n,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    self.nowait_writes.store(false, Ordering::Relaxed);
                    break Ok(false);
                }
                Err(e) if would_block(&e) => break Ok(false),
                Err(e) => break Err(self.io_err("write", e)),
            }
        };
        if done > 0 || result.is_err() {
            self.mark(offset, data.len() as u64);
        }
        result
    }

    /// A buffered write (a server's, up to 1 MiB) done on the caller's
    /// thread right away, for its event loop: `Ok(false)` (nothing
    /// written) when the volume bypasses the page cache or the write gate
    /// is paused or throttled (a migration needs the write to wait).
    /// Without RWF_NOWAIT support it is a plain `pwrite` into the page
    /// cache, which can only wait on the kernel's dirty-page throttling.
    /// Bitmaps are marked as by `write_at`.
    pub fn write_buffered_now(&self, offset: u64, data: &[u8]) -> Result<bool> {
        if self.nowait_writes() {
            return self.try_write_nowait(offset, data);
        }
        self.check(offset, data.len() as u64, true)?;
        let file = match &self.data {
            Data::File(f) if !self.direct => f,
            _ => return Ok(false),
        };
        let Some(_ticket) = self.gate.try_enter() else {
            return Ok(false);
        };
        self.check_not_moved()?;
        let r = file.write_all_at(data, offset);
        self.mark(offset, data.len() as u64);
        r.map_err(|e| self.io_err("write", e))?;
        Ok(true)
    }

    /// False once the file system refused a non-blocking buffered write
    /// (ext4 does): callers should go straight to a worker thread.
    pub fn nowait_writes(&self) -> bool {
        self.page_cached() && self.nowait_writes.load(Ordering::Relaxed)
    }

    /// Start a write of an RBD image's volume without blocking, for an
    /// event loop: the returned future ends when librbd acknowledged it,
    /// marks every bitmap and leaves the write gate (held from now to
    /// then, so a migration's pause waits for it). `Ok(None)`: do it with
    /// [`Volume::write_at`] on a thread instead (not an image, or the gate
    /// paused or throttled).
    pub fn start_write_async(
        self: &Arc<Self>,
        offset: u64,
        data: bytes::Bytes,
    ) -> Result<Option<impl std::future::Future<Output = Result<()>> + Send + 'static>> {
        let Data::Rbd(r) = &self.data else {
            return Ok(None);
        };
        let start = std::time::Instant::now();
        let len = data.len() as u64;
        self.check(offset, len, true)?;
        let Some(ticket) = self.gate.try_enter_owned() else {
            return Ok(None);
        };
        self.check_not_moved()?;
        let started = r.with("write", |img| img.write_async(data, offset));
        let write = match started {
            Ok(w) => w,
            Err(e) => {
                self.mark(offset, len);
                return Err(e);
            }
        };
        let v = self.clone();
        Ok(Some(async move {
            let r = write.await.map_err(|e| StorageError::rbd("write", e));
            v.mark(offset, len);
            let us = u64::try_from(start.elapsed().as_micros()).unwrap_or(u64::MAX);
            v.slowest_write_us.fetch_max(us, Ordering::Relaxed);
            drop(ticket);
            r
        }))
    }

    /// Write `data` at `offset`; with `fua` it is durable before this returns.
    pub fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<()> {
        let _timer = self.write_timer();
        self.check(offset, data.len() as u64, true)?;
        let _ticket = self.gate.enter();
        self.check_not_moved()?;
        let r = self.write_backing(offset, data);
        self.mark(offset, data.len() as u64);
        r?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// A mark of this volume's writes for [`Volume::written_since`]; `None`
    /// while a write is under way.
    pub fn write_mark(&self) -> Option<u64> {
        self.gate.quiet_mark()
    }

    /// Whether a write may have landed since `mark` (of
    /// [`Volume::write_mark`]).
    pub fn written_since(&self, mark: u64) -> bool {
        self.gate.entered_since(mark)
    }

    /// Checks before writing `[offset, offset+len)` from the same range of
    /// `src` at `src_offset`, and this volume's write entered (timed, and
    /// through its gate) until the result is dropped (the ticket first, as
    /// for any write).
    fn enter_copy(
        &self,
        src: &Volume,
        src_offset: u64,
        offset: u64,
        len: u64,
    ) -> Result<(WriteTicket<'_>, WriteTimer<'_>)> {
        src.check(src_offset, len, false)?;
        let timer = self.write_timer();
        self.check(offset, len, true)?;
        let ticket = self.gate.enter();
        self.check_not_moved()?;
        Ok((ticket, timer))
    }

    /// Write `[offset, offset+len)` as the same range of `src` at
    /// `src_offset` by sharing its extents (FICLONERANGE), not copying its
    /// bytes: both files in one file system that shares extents (XFS with
    /// reflink, btrfs), offsets and length in whole 4 KiB blocks. Later
    /// writes to either copy their blocks first. `Ok(false)`: not shared
    /// (another file system, an RBD image, misaligned), nothing written;
    /// the caller writes the bytes. The caller checks what it shared:
    /// read `src` between [`Volume::write_mark`] and
    /// [`Volume::written_since`] of `src` around this call.
    pub fn share_from(&self, src: &Volume, src_offset: u64, offset: u64, len: u64) -> Result<bool> {
        const BLOCK: u64 = 4096;
        let (Data::File(to), Data::File(from)) = (&self.data, &src.data) else {
            return Ok(false);
        };
        if !self.shares_extents.load(Ordering::Relaxed)
            || !(src_offset | offset | len).is_multiple_of(BLOCK)
            || len == 0
        {
            return Ok(false);
        }
        let _entered = self.enter_copy(src, src_offset, offset, len)?;
        let range = libc::file_clone_range {
            src_fd: i64::from(from.as_raw_fd()),
            src_offset,
            src_length: len,
            dest_offset: offset,
        };
        // SAFETY: FICLONERANGE on a descriptor owned by self.data, reading
        // `range`, which lives across the call; no memory is written.
        let r = unsafe { libc::ioctl(to.as_raw_fd(), libc::FICLONERANGE, &range) };
        if r == 0 {
            self.mark(offset, len);
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            // Not a file system that shares extents: this volume writes
            // its bytes from now on.
            Some(libc::EOPNOTSUPP | libc::ENOTTY) => {
                self.shares_extents.store(false, Ordering::Relaxed);
                Ok(false)
            }
            // Not the same file system (an external file), or a range it
            // will not share: nothing was shared; another volume may do.
            Some(libc::EXDEV | libc::EINVAL) => Ok(false),
            // Anything else may have shared part of the range: it is
            // written over by the caller, so mark it as written.
            _ => {
                self.mark(offset, len);
                tracing::debug!(volume = %self.name, error = %e, "sharing extents failed; writing the bytes");
                Ok(false)
            }
        }
    }

    /// Write `[offset, offset+len)` as a copy of the same range of `src` at
    /// `src_offset`, the kernel moving the bytes (`copy_file_range`: no
    /// trip through this process): both raw files, offsets and length in
    /// whole 4 KiB blocks. `Ok(false)`: not copied (an RBD image,
    /// misaligned, a pair of files the kernel will not copy between, or a
    /// copy cut short, then marked as written); the caller writes the
    /// bytes. The caller checks what was copied as for
    /// [`Volume::share_from`].
    pub fn copy_from(&self, src: &Volume, src_offset: u64, offset: u64, len: u64) -> Result<bool> {
        const BLOCK: u64 = 4096;
        let (Data::File(to), Data::File(from)) = (&self.data, &src.data) else {
            return Ok(false);
        };
        if !(src_offset | offset | len).is_multiple_of(BLOCK) || len == 0 {
            return Ok(false);
        }
        let (Ok(mut off_in), Ok(mut off_out)) = (
            libc::off64_t::try_from(src_offset),
            libc::off64_t::try_from(offset),
        ) else {
            return Ok(false);
        };
        let _entered = self.enter_copy(src, src_offset, offset, len)?;
        let mut left = len;
        while left > 0 {
            let want = usize::try_from(left).unwrap_or(usize::MAX);
            // SAFETY: both descriptors are owned by the volumes' `data` and
            // live across the call; the offsets are locals it updates.
            let r = unsafe {
                libc::copy_file_range(
                    from.as_raw_fd(),
                    &mut off_in,
                    to.as_raw_fd(),
                    &mut off_out,
                    want,
                    0,
                )
            };
            let Ok(n) = u64::try_from(r) else {
                let e = std::io::Error::last_os_error();
                if left == len
                    && matches!(
                        e.raw_os_error(),
                        Some(libc::EXDEV | libc::EINVAL | libc::EOPNOTSUPP | libc::ENOSYS)
                    )
                {
                    // Nothing was copied: the caller writes the bytes.
                    return Ok(false);
                }
                tracing::debug!(volume = %self.name, error = %e, "copying in the kernel failed; writing the bytes");
                break;
            };
            if n == 0 {
                break;
            }
            left = left.saturating_sub(n);
        }
        // Whatever part was copied was written: the caller writes the rest
        // over it when the copy was cut short.
        self.mark(offset, len);
        Ok(left == 0)
    }

    /// Make `[offset, offset+len)` read as zeroes.
    pub fn write_zeroes(&self, offset: u64, len: u64, mode: ZeroMode, fua: bool) -> Result<()> {
        let _timer = self.write_timer();
        self.check(offset, len, true)?;
        let _ticket = self.gate.enter();
        self.check_not_moved()?;
        let r = self.zero_range(offset, len, mode);
        self.mark(offset, len);
        r?;
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    fn zero_range(&self, offset: u64, len: u64, mode: ZeroMode) -> Result<()> {
        let file = match &self.data {
            // Done by the OSDs: whole objects removed, partial ones zeroed.
            Data::Rbd(r) => return r.with("write zeroes", |img| img.write_zeroes(offset, len)),
            Data::File(f) => f,
        };
        if mode.may_punch && self.is_sparse() {
            let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            if fallocate(file, punch, offset, len).is_ok() {
                return Ok(());
            }
        }
        if fallocate(
            file,
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        )
        .is_ok()
        {
            return Ok(());
        }
        if mode.fast_only {
            return Err(StorageError::NotFast);
        }
        const CHUNK: u64 = 1 << 20;
        let mut zeros = AlignedBuf::zeroed(1 << 20);
        let mut pos = offset;
        while pos < offset + len {
            let n = usize::try_from(CHUNK.min(offset + len - pos)).unwrap_or(usize::MAX);
            file.write_all_at(zeros.as_mut_slice(n), pos)
                .map_err(|e| self.io_err("write zeroes", e))?;
            pos += n as u64;
        }
        Ok(())
    }

    /// Discard `[offset, offset+len)`. On sparse volumes the blocks are
    /// deallocated and read back as zeroes; preallocated volumes keep them.
    pub fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        let _timer = self.write_timer();
        self.check(offset, len, true)?;
        let _ticket = self.gate.enter();
        self.check_not_moved()?;
        // Trim is advisory: a file system that cannot punch, or a cluster
        // that fails the discard, keeps the data.
        match &self.data {
            Data::Rbd(r) => {
                if let Err(e) = r.with("discard", |img| img.discard(offset, len)) {
                    tracing::debug!(volume = %self.name, error = %e, "discard failed");
                }
            }
            Data::File(f) if self.is_sparse() => {
                let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                let _ = fallocate(f, punch, offset, len);
            }
            Data::File(_) => {}
        }
        self.mark(offset, len);
        if fua {
            self.flush()?;
        }
        Ok(())
    }

    /// Make every completed write durable (`fdatasync`).
    pub fn flush(&self) -> Result<()> {
        let _timer = self.write_timer();
        match &self.data {
            Data::Rbd(r) => r.with("flush", |img| img.flush()),
            Data::File(f) => f.sync_data().map_err(|e| self.io_err("fdatasync", e)),
        }
    }

    /// Bounded write-behind for a bulk writer that flushes later (a
    /// migration's destination): wait for the writeback the previous call
    /// started, then start writing back everything dirty now, without
    /// waiting for it. Called every few MiB, it keeps the volume's dirty
    /// page cache to about two calls' worth, so that the writer's flush is
    /// short and the disk is written at the pace the data arrives instead
    /// of in one burst that delays every other writer on the same disk.
    pub fn write_behind(&self) -> Result<()> {
        let fd = match &self.data {
            Data::File(f) if !self.direct => f.as_raw_fd(),
            _ => return Ok(()),
        };
        for flags in [
            libc::SYNC_FILE_RANGE_WAIT_BEFORE,
            libc::SYNC_FILE_RANGE_WRITE,
        ] {
            // SAFETY: sync_file_range on a valid descriptor owned by
            // self.data; offset 0, length 0 means the whole file; no memory
            // is passed.
            if unsafe { libc::sync_file_range(fd, 0, 0, flags) } != 0 {
                return Err(self.io_err("sync_file_range", std::io::Error::last_os_error()));
            }
        }
        Ok(())
    }

    /// Ask the kernel to read `[offset, offset+len)` into the page cache
    /// (NBD_CMD_CACHE, SCSI PRE-FETCH). Advisory: errors are ignored.
    pub fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.check(offset, len, false).or_else(|e| match e {
            StorageError::Invalid(_) => Ok(()),
            e => Err(e),
        })?;
        // An RBD image has no page cache here to warm.
        let Data::File(file) = &self.data else {
            return Ok(());
        };
        if let (Ok(o), Ok(l)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) {
            // SAFETY: posix_fadvise on a valid descriptor owned by self.data; no memory is passed.
            let _ =
                unsafe { libc::posix_fadvise(file.as_raw_fd(), o, l, libc::POSIX_FADV_WILLNEED) };
        }
        Ok(())
    }

    /// Allocation extents covering `[offset, offset+len)`.
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<Extent>> {
        self.check(offset, len, false).or_else(|e| match e {
            StorageError::Invalid(_) => Ok(()),
            e => Err(e),
        })?;
        match &self.data {
            Data::File(f) => Ok(alloc::extents(f, offset, len, max)),
            Data::Rbd(r) => Ok(r
                .with("allocation map", |img| img.extents(offset, len, max))?
                .into_iter()
                .map(|e| Extent {
                    offset: e.offset,
                    length: e.length,
                    hole: !e.allocated,
                })
                .collect()),
        }
    }

    /// Bytes of the backing file actually allocated.
    pub fn allocated_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        match &self.data {
            Data::File(f) => f.metadata().map_or(0, |m| m.blocks() * 512),
            Data::Rbd(r) => r
                .with("allocation map", |img| img.allocated_bytes())
                .unwrap_or(0),
        }
    }

    // ---- dirty bitmaps ----

    pub fn create_bitmap(
        &self,
        name: &str,
        granularity: u32,
        persistent: bool,
    ) -> Result<Arc<DirtyBitmap>> {
        crate::pool::check_name(name)?;
        let bm = Arc::new(DirtyBitmap::new(
            name,
            granularity,
            self.size(),
            persistent,
        )?);
        {
            let mut list = self.bitmaps.write();
            if list.iter().any(|b| b.name() == name) {
                return Err(StorageError::BitmapExists(name.into()));
            }
            list.push(bm.clone());
        }
        if persistent {
            let mut m = self.meta.lock();
            m.bitmaps.push(BitmapSpec {
                name: name.into(),
                granularity,
            });
            if let Err(e) = self.store_meta(&m) {
                m.bitmaps.retain(|b| b.name != name);
                self.bitmaps.write().retain(|b| b.name() != name);
                return Err(e);
            }
        }
        Ok(bm)
    }

    pub fn bitmap(&self, name: &str) -> Result<Arc<DirtyBitmap>> {
        self.bitmaps
            .read()
            .iter()
            .find(|b| b.name() == name)
            .cloned()
            .ok_or_else(|| StorageError::BitmapNotFound(name.into()))
    }

    pub fn bitmaps(&self) -> Vec<BitmapInfo> {
        self.bitmaps.read().iter().map(|b| b.info()).collect()
    }

    pub fn bitmap_names(&self) -> Vec<String> {
        self.bitmaps
            .read()
            .iter()
            .map(|b| b.name().to_string())
            .collect()
    }

    pub fn delete_bitmap(&self, name: &str) -> Result<()> {
        let bm = self.bitmap(name)?;
        self.bitmaps.write().retain(|b| b.name() != name);
        if bm.persistent() {
            let mut m = self.meta.lock();
            m.bitmaps.retain(|b| b.name != name);
            self.store_meta(&m)?;
            if let Some(r) = self.shared_image() {
                let key = crate::shared::bitmap_key(name);
                r.with("remove metadata", |img| img.metadata_remove(&key))?;
            } else {
                let _ = fs::remove_file(self.dir.join("bitmaps").join(format!("{name}.bitmap")));
            }
        }
        Ok(())
    }

    /// Save persistent bitmaps (done at close; callable any time).
    pub fn save_bitmaps(&self) -> Result<()> {
        let list: Vec<_> = self
            .bitmaps
            .read()
            .iter()
            .filter(|b| b.persistent())
            .cloned()
            .collect();
        if list.is_empty() {
            return Ok(());
        }
        if let Some(r) = self.shared_image() {
            for b in list {
                let v = crate::shared::encode_bitmap(&b.encode())?;
                let key = crate::shared::bitmap_key(b.name());
                r.with("write metadata", |img| img.metadata_set(&key, &v))?;
            }
            return Ok(());
        }
        let dir = self.dir.join("bitmaps");
        fs::create_dir_all(&dir).map_err(|e| StorageError::io("mkdir", &dir, e))?;
        for b in list {
            write_atomic(&dir.join(format!("{}.bitmap", b.name())), &b.encode())?;
        }
        Ok(())
    }

    /// Change the size. Shrinking discards data and needs `allow_shrink`.
    /// Refused while a migration holds the volume: the copy it builds has
    /// the size the migration started with.
    pub fn resize(&self, new_size: u64, allow_shrink: bool) -> Result<()> {
        self.sanitize.check(&self.name)?;
        let held = self.held_by();
        if held.has_migration() {
            return Err(StorageError::InUse {
                name: self.name(),
                held_by: held,
                hint: "; resize it after the migration ends",
            });
        }
        let mut m = self.meta.lock();
        if m.read_only {
            return Err(StorageError::ReadOnly(m.name.clone()));
        }
        if !new_size.is_multiple_of(u64::from(m.block_size)) || new_size == 0 {
            return Err(StorageError::Invalid(format!(
                "size {new_size} must be a non-zero multiple of the block size {}",
                m.block_size
            )));
        }
        if new_size < m.size && !allow_shrink {
            return Err(StorageError::Invalid(format!(
                "shrinking from {} to {new_size} bytes discards data; ask for it explicitly",
                m.size
            )));
        }
        let old = m.size;
        if let Backing::External { .. } = m.backing {
            return Err(StorageError::Invalid(
                "external volumes cannot be resized by ferry".into(),
            ));
        }
        // All or nothing: the metadata in memory changes only after the
        // file and meta.json both did; a failure puts the file back.
        let mut next = m.clone();
        next.size = new_size;
        if new_size > old {
            // Grow the data first; an unchanged meta.json keeps the old size.
            let done = self
                .set_backing_len(old, new_size, &m.backing)
                .and_then(|()| self.store_meta(&next));
            if let Err(e) = done {
                let _ = self.set_backing_len(new_size, old, &m.backing);
                return Err(e);
            }
        } else {
            // Shrink the metadata first: data left longer is harmless.
            self.store_meta(&next)?;
            self.set_backing_len(old, new_size, &m.backing)?;
        }
        *m = next;
        self.size.store(new_size, Ordering::Release);
        for b in self.bitmaps.read().iter() {
            b.resize(new_size);
        }
        Ok(())
    }

    /// Make the backing store `new` bytes long (from `old`), durably.
    fn set_backing_len(&self, old: u64, new: u64, backing: &Backing) -> Result<()> {
        let file = match &self.data {
            Data::Rbd(r) => return r.with("resize", |img| img.resize(new, true)),
            Data::File(f) => f,
        };
        let r = match backing {
            Backing::Preallocated if new > old => {
                fallocate(file, 0, old, new - old).map_err(|e| self.io_err("fallocate", e))
            }
            _ => file.set_len(new).map_err(|e| self.io_err("truncate", e)),
        };
        r.and_then(|()| file.sync_all().map_err(|e| self.io_err("fsync", e)))
    }

    /// Flush data, save bitmaps, and record a clean close.
    pub fn close(&self) -> Result<()> {
        self.sanitize.stop();
        if self.deleted.load(Ordering::Acquire) || self.read_only() {
            return Ok(());
        }
        self.flush()?;
        self.save_bitmaps()?;
        if let Some(r) = self.shared_image() {
            return r.with("remove metadata", crate::shared::clear_holder);
        }
        let marker = self.dir.join(IN_USE);
        match fs::remove_file(&marker) {
            Ok(()) => crate::meta::sync_dir(&self.dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StorageError::io("remove", marker, e)),
        }
    }

    /// The write gate a migration pauses and throttles.
    pub fn gate(&self) -> &WriteGate {
        &self.gate
    }

    /// Where the volume went, once it has moved.
    pub fn moved_to(&self) -> Option<String> {
        if !self.moved.load(Ordering::SeqCst) {
            return None;
        }
        self.meta.lock().moved_to.clone()
    }

    /// Whether this is the copy the volume `uuid` left here when it moved
    /// away (and nothing is filling it): a return's basis.
    pub fn is_moved_away_copy_of(&self, uuid: &[u8; 16]) -> bool {
        self.moved_to().is_some()
            && self.incoming().is_none()
            && self.meta.lock().uuid.as_bytes() == uuid
    }

    /// The migration this moved-away copy left by, while it is one (not
    /// reclaimed, nothing filling it): the copy is as that migration's
    /// switch left it.
    pub fn left_under(&self) -> Option<String> {
        self.moved_to()?;
        let m = self.meta.lock();
        m.incoming.is_none().then(|| m.left_under.clone()).flatten()
    }

    /// Where the volume's new daemon takes admin calls, once it has moved
    /// (if that daemon advertised it).
    pub fn moved_admin(&self) -> Option<String> {
        if !self.moved.load(Ordering::SeqCst) {
            return None;
        }
        self.meta.lock().moved_admin.clone()
    }

    /// Record (durably) that the volume now lives at `location` (NBD), its
    /// daemon's admin API at `admin` ("" if unknown) and its SCSI port
    /// `peer`, moved there by migration `migration`; from here on every
    /// write fails with [`StorageError::Moved`]. Call with the gate paused
    /// so no write is half-way through.
    pub fn set_moved(
        &self,
        location: &str,
        admin: &str,
        peer: Option<PeerPort>,
        migration: &str,
    ) -> Result<()> {
        self.mark_moved(location, admin, peer, migration);
        self.store_state()
    }

    /// [`Volume::set_moved`] in memory only, so that the writers a
    /// migration's pause holds can be let go (they fail with
    /// [`StorageError::Moved`] and follow the volume) before the state is
    /// stored ([`Volume::store_state`]): the guest's pause then holds no
    /// fsync of the source's. Only after the destination committed, and
    /// with the switch journalled (`switch_sent`): a daemon that stops
    /// before the state is stored finds the volume in doubt and asks the
    /// destination, which says it committed.
    pub fn mark_moved(&self, location: &str, admin: &str, peer: Option<PeerPort>, migration: &str) {
        let mut m = self.meta.lock();
        m.moved_to = Some(location.to_string());
        m.moved_admin = (!admin.is_empty()).then(|| admin.to_string());
        m.left_under = Some(migration.to_string());
        if peer.is_some() {
            m.peer_port = peer;
        }
        // The migration is over: nothing left to resume.
        m.outgoing = None;
        self.moved.store(true, Ordering::SeqCst);
    }

    /// Store the volume's state as it is in memory now (after
    /// [`Volume::mark_moved`]).
    pub fn store_state(&self) -> Result<()> {
        let _order = self.meta_store.lock();
        let m = self.meta.lock().clone();
        self.store_meta(&m)
    }

    /// Turn this moved-away copy into the target of a migration bringing
    /// the volume back (same identity): it becomes the unfinished copy of
    /// `incoming` (not served, writable by the migration only), and the
    /// migration keeps every chunk of it that still matches.
    pub fn reclaim_for_incoming(&self, incoming: IncomingMigration) -> Result<()> {
        self.update_meta(|m| {
            if m.moved_to.is_none() {
                return Err(StorageError::Invalid(format!(
                    "volume {} has not moved away",
                    m.name
                )));
            }
            m.moved_to = None;
            m.moved_admin = None;
            m.left_under = None;
            m.incoming = Some(incoming);
            Ok(())
        })?;
        self.moved.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Make the volume writable here again after a move was undone by an
    /// operator (`ferry volume reclaim`).
    pub fn clear_moved(&self) -> Result<()> {
        self.update_meta(|m| {
            m.moved_to = None;
            m.moved_admin = None;
            m.left_under = None;
            Ok(())
        })?;
        self.moved.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// The unfinished incoming migration this volume is the copy of, if any.
    pub fn incoming(&self) -> Option<IncomingMigration> {
        self.meta.lock().incoming.clone()
    }

    /// Hand this incomplete copy (durably) to migration `id` from
    /// `source`, which resumes into it: the copy keeps when it was begun
    /// and counts as touched now. Refused if the volume is not an
    /// incomplete copy.
    pub fn adopt_incoming(&self, id: &str, source: &str) -> Result<()> {
        self.update_meta(|m| {
            let Some(inc) = m.incoming.as_mut() else {
                return Err(StorageError::Invalid(format!(
                    "volume {} is not an incomplete copy",
                    m.name
                )));
            };
            // Another migration's leftover is no tracked return's basis
            // any more: what that one wrote is not what this one's source
            // tracked.
            if inc.id != id {
                inc.tracked_since = None;
            }
            inc.id = id.to_string();
            inc.source = source.to_string();
            inc.touched_unix = crate::meta::unix_now();
            Ok(())
        })
    }

    /// Stop treating this incomplete copy as a tracked return's basis
    /// (its digest did not match what the source claimed): the next
    /// attempt prints every chunk. Nothing for a complete volume.
    pub fn untrack_incoming(&self) -> Result<()> {
        self.update_meta(|m| {
            if let Some(inc) = m.incoming.as_mut() {
                inc.tracked_since = None;
            }
            Ok(())
        })
    }

    /// Record (durably) that a migration touched this incomplete copy now
    /// (began or stopped filling it); nothing for a complete volume.
    pub fn touch_incoming(&self) -> Result<()> {
        self.update_meta(|m| {
            if let Some(inc) = m.incoming.as_mut() {
                inc.touched_unix = crate::meta::unix_now();
            }
            Ok(())
        })
    }

    /// Mark (durably) the copy of an incoming migration complete: it is
    /// exported from now on, and remembers which migration brought it and
    /// the SCSI port of the site it came from (`source`).
    pub fn complete_incoming(&self, source: Option<PeerPort>) -> Result<()> {
        self.update_meta(|m| {
            if let Some(done) = m.incoming.take() {
                m.arrived = Some(done);
            }
            m.peer_port = source;
            Ok(())
        })
    }

    /// Record (durably) the SCSI port of the site this volume is migrating
    /// to, once its daemon has described it.
    pub fn set_peer_port(&self, peer: Option<PeerPort>) -> Result<()> {
        if self.meta.lock().peer_port == peer {
            return Ok(());
        }
        self.update_meta(|m| {
            m.peer_port = peer;
            Ok(())
        })
    }

    /// The other site of the volume's current or last migration.
    pub fn peer_port(&self) -> Option<PeerPort> {
        self.meta.lock().peer_port.clone()
    }

    /// Whether a migration of this volume to another daemon is under way
    /// (journaled and not switched).
    pub fn migrating_out(&self) -> bool {
        self.meta.lock().outgoing.is_some()
    }

    /// Mark (durably) an image import as begun (`true`) or finished: while
    /// it is marked, the volume holds a partial image and is not exported,
    /// also after a crash and restart.
    pub fn set_importing(&self, importing: bool) -> Result<()> {
        self.update_meta(|m| {
            m.importing = importing;
            Ok(())
        })
    }

    /// The journaled outgoing migration, if one began and did not switch.
    pub fn outgoing(&self) -> Option<crate::OutgoingMigration> {
        self.meta.lock().outgoing.clone()
    }

    /// Journal (durably) an outgoing migration, or clear the journal.
    pub fn set_outgoing(&self, o: Option<crate::OutgoingMigration>) -> Result<()> {
        self.update_meta(|m| {
            m.outgoing = o;
            Ok(())
        })
    }

    /// Change the metadata all or nothing: `edit` works on a copy, which
    /// replaces the one in memory only once it is stored (temp, fsync,
    /// rename). Nothing is written when the edit changes nothing.
    fn update_meta(&self, edit: impl FnOnce(&mut VolumeMeta) -> Result<()>) -> Result<()> {
        let _order = self.meta_store.lock();
        let mut m = self.meta.lock();
        let mut next = m.clone();
        edit(&mut next)?;
        if next != *m {
            self.store_meta(&next)?;
            *m = next;
        }
        Ok(())
    }

    /// Store `m` where the volume's state lives: `meta.json` (atomically)
    /// or, for a shared volume, the image's metadata.
    fn store_meta(&self, m: &VolumeMeta) -> Result<()> {
        match self.shared_image() {
            Some(r) => {
                let json = crate::shared::meta_to_json(m)?;
                r.with("write metadata", |img| {
                    img.metadata_set(crate::shared::META_KEY, &json)
                })
            }
            None => m.store(&self.dir.join("meta.json")),
        }
    }

    /// The image holding a shared volume's data and state.
    fn shared_image(&self) -> Option<&RbdData> {
        match &self.data {
            Data::Rbd(r) if self.shared => Some(r),
            _ => None,
        }
    }

    /// Whether the volume is shared: its state in the cluster, served by
    /// whichever gateway claimed it ([`crate::shared`]).
    pub fn shared(&self) -> bool {
        self.shared
    }

    /// Journal (durably) whether the outgoing migration's switch may have
    /// been sent. Clearing it also releases a volume held in doubt: the
    /// destination has said it did not commit. No journal, no change.
    pub fn set_switch_sent(&self, sent: bool) -> Result<()> {
        let Some(mut o) = self.outgoing() else {
            return Ok(());
        };
        o.switch_sent = sent;
        self.set_outgoing(Some(o))?;
        if !sent {
            self.set_in_doubt(false);
        }
        Ok(())
    }

    /// An import began and did not finish.
    pub fn importing(&self) -> bool {
        self.meta.lock().importing
    }

    /// Offered to clients (NBD export, iSCSI LUN): not moved away, not an
    /// unfinished migration copy, not a half-done import, not in doubt.
    pub fn is_serving(&self) -> bool {
        let m = self.meta.lock();
        m.moved_to.is_none()
            && m.incoming.is_none()
            && !m.importing
            && !self.in_doubt.load(Ordering::SeqCst)
    }

    /// Whether the last migration's switch is unknown (see
    /// [`crate::OutgoingMigration::switch_sent`]).
    pub fn in_doubt(&self) -> bool {
        self.in_doubt.load(Ordering::SeqCst)
    }

    /// Hold the volume (no writes, not served) until its migration's
    /// outcome is known, or release it (`false`): the destination answered
    /// that it did not commit.
    pub fn set_in_doubt(&self, doubt: bool) {
        self.in_doubt.store(doubt, Ordering::SeqCst);
    }

    /// The completed migration that brought this volume here, if any.
    pub fn arrived(&self) -> Option<IncomingMigration> {
        self.meta.lock().arrived.clone()
    }

    /// Whether migration `id` brought this volume here and committed it
    /// (no copy is being filled since).
    pub fn arrived_by(&self, id: &str) -> bool {
        let m = self.meta.lock();
        m.incoming.is_none() && m.arrived.as_ref().is_some_and(|a| a.id == id)
    }

    /// Count `kind` as holding the volume until the guard is dropped.
    pub fn hold(self: &Arc<Self>, kind: crate::Holder) -> crate::HoldGuard {
        crate::HoldGuard::new(self.clone(), kind)
    }

    /// Who holds the volume now.
    pub fn held_by(&self) -> crate::HeldBy {
        self.holders.snapshot()
    }

    pub(crate) fn holders(&self) -> &crate::holders::Holders {
        &self.holders
    }

    /// Close the RBD image (waiting for I/O in flight), so that it can be
    /// removed; the volume answers no more I/O. Nothing for a file.
    pub(crate) fn close_backing(&self) {
        if let Data::Rbd(r) = &self.data {
            drop(r.image.write().take());
        }
    }

    pub(crate) fn mark_deleted(&self) {
        self.deleted.store(true, Ordering::Release);
    }
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }
}
