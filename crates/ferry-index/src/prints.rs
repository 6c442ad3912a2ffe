//! One volume's prints in block order (`<volume>.fprt` beside its run): for
//! every block the first 16 bytes of its BLAKE3, all zero for a block of
//! zeroes, so that a migration's source can send the prints of what was
//! not written since it was indexed without reading or hashing it.
//!
//! Layout (little endian):
//!
//! ```text
//! page 0     magic "FRYFPRT1", u32 version (1), u32 block size,
//!            u64 volume size, u8 complete (1 once every block was
//!            hashed), zero padding to 4096
//! then       16 bytes per block, in block order
//! ```
//!
//! An entry says what its block holds only while the volume's
//! [`crate::INDEX_BITMAP`] does not mark the block: the index writes an
//! entry under the prints' lock in the same hold as it takes the block's
//! mark ([`crate::PoolIndex::refresh_taken`]), and a reader checks the
//! bitmap and reads the entries under the same lock
//! ([`crate::PoolIndex::with_prints`]). Entries are not checksummed: a
//! crash leaves the volume's bitmaps all dirty, so none is trusted until
//! its block is hashed again; an entry wrong for any other reason fails
//! the migration's digest unless it is the true print of other bytes,
//! which only a write that bypassed the volume could make.

use crate::{check_block_size, IndexError};
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"FRYFPRT1";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 4096;
const HEADER: u64 = HEADER_LEN as u64;
/// Bytes per entry.
pub const ENTRY: usize = 16;
/// The entry of a block of zeroes.
pub const ZERO_ENTRY: [u8; ENTRY] = [0; ENTRY];

/// A block's entry: the first 16 bytes of its BLAKE3, or [`ZERO_ENTRY`].
pub fn entry_of(print: Option<&crate::Fingerprint>) -> [u8; ENTRY] {
    let mut e = ZERO_ENTRY;
    if let Some(p) = print {
        e.copy_from_slice(&p.0[..ENTRY]);
    }
    e
}

/// The index key of an entry (its first 8 bytes, as
/// [`crate::Fingerprint::key`] of the block's fingerprint).
pub fn key_of(entry: &[u8; ENTRY]) -> u64 {
    let mut k = [0u8; 8];
    k.copy_from_slice(&entry[..8]);
    u64::from_le_bytes(k)
}

/// What the lock of a volume's prints guards.
#[derive(Debug, Default)]
pub(crate) struct PrintsState {
    /// Every block was hashed into the file: an entry whose block is not
    /// marked is current.
    pub complete: bool,
    /// A rebuild is filling the file; blocks a refresh wrote meanwhile
    /// (fresher than what the rebuild read before them) it leaves alone.
    pub refreshed_in_build: Option<HashSet<u64>>,
    /// Dropped (a write failed, the volume was removed or rebuilt again):
    /// never trusted or sealed again.
    pub spoiled: bool,
}

/// The prints file of one volume.
#[derive(Debug)]
pub struct VolumePrints {
    /// The volume's prints file, once sealed.
    path: PathBuf,
    /// Where the file is: a temporary name while it is built.
    at: parking_lot::Mutex<PathBuf>,
    file: File,
    block_size: u32,
    volume_size: u64,
    pub(crate) state: parking_lot::RwLock<PrintsState>,
}

impl VolumePrints {
    /// A new, incomplete file at `tmp` (being built), to become `path`
    /// once sealed.
    pub(crate) fn create(
        path: &Path,
        tmp: &Path,
        block_size: u32,
        volume_size: u64,
    ) -> Result<VolumePrints, IndexError> {
        check_block_size(block_size)?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(tmp)
            .map_err(|e| IndexError::io("create", tmp, e))?;
        let blocks = volume_size.div_ceil(u64::from(block_size));
        file.set_len(blocks.saturating_mul(ENTRY as u64).saturating_add(HEADER))
            .map_err(|e| IndexError::io("truncate", tmp, e))?;
        let p = VolumePrints {
            path: path.to_path_buf(),
            at: parking_lot::Mutex::new(tmp.to_path_buf()),
            file,
            block_size,
            volume_size,
            state: parking_lot::RwLock::new(PrintsState {
                complete: false,
                refreshed_in_build: Some(HashSet::new()),
                spoiled: false,
            }),
        };
        p.write_header(false)?;
        Ok(p)
    }

    /// Open a file a rebuild completed; `None` (and the file removed) if
    /// it is incomplete, of another block size, or not what it says.
    pub(crate) fn open(path: &Path, block_size: u32) -> Option<VolumePrints> {
        let opened = (|| {
            let file = OpenOptions::new().read(true).write(true).open(path).ok()?;
            let mut hdr = [0u8; HEADER_LEN];
            file.read_exact_at(&mut hdr, 0).ok()?;
            let u32_at = |o: usize| u32::from_le_bytes(hdr[o..o + 4].try_into().expect("4"));
            let volume_size = u64::from_le_bytes(hdr[16..24].try_into().expect("8"));
            let blocks = volume_size.div_ceil(u64::from(block_size));
            let want = blocks.checked_mul(ENTRY as u64)?.checked_add(HEADER)?;
            let len = file.metadata().ok()?.len();
            (&hdr[..8] == MAGIC
                && u32_at(8) == VERSION
                && u32_at(12) == block_size
                && hdr[24] == 1
                && len == want)
                .then(|| VolumePrints {
                    path: path.to_path_buf(),
                    at: parking_lot::Mutex::new(path.to_path_buf()),
                    file,
                    block_size,
                    volume_size,
                    state: parking_lot::RwLock::new(PrintsState {
                        complete: true,
                        refreshed_in_build: None,
                        spoiled: false,
                    }),
                })
        })();
        if opened.is_none() {
            let _ = std::fs::remove_file(path);
        }
        opened
    }

    fn write_header(&self, complete: bool) -> Result<(), IndexError> {
        let mut hdr = [0u8; HEADER_LEN];
        hdr[..8].copy_from_slice(MAGIC);
        hdr[8..12].copy_from_slice(&VERSION.to_le_bytes());
        hdr[12..16].copy_from_slice(&self.block_size.to_le_bytes());
        hdr[16..24].copy_from_slice(&self.volume_size.to_le_bytes());
        hdr[24] = u8::from(complete);
        self.file
            .write_all_at(&hdr, 0)
            .map_err(|e| IndexError::io("write", &self.path, e))
    }

    /// Mark the file complete on disk, after its entries are (fdatasync
    /// before and after the header), and give it the volume's prints name.
    pub(crate) fn seal_as_final(&self) -> Result<(), IndexError> {
        self.sync()?;
        self.write_header(true)?;
        self.sync()?;
        let mut at = self.at.lock();
        std::fs::rename(&*at, &self.path).map_err(|e| IndexError::io("rename", &at, e))?;
        *at = self.path.clone();
        if let Some(dir) = self.path.parent() {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }

    /// Where the file is now (its temporary name while it is built).
    pub(crate) fn file_path(&self) -> PathBuf {
        self.at.lock().clone()
    }

    pub(crate) fn sync(&self) -> Result<(), IndexError> {
        self.file
            .sync_data()
            .map_err(|e| IndexError::io("fdatasync", &self.path, e))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The volume size the file was built for.
    pub fn volume_size(&self) -> u64 {
        self.volume_size
    }

    fn blocks(&self) -> u64 {
        self.volume_size.div_ceil(u64::from(self.block_size))
    }

    /// Write the entries of consecutive blocks from `first` (past the end:
    /// cut off).
    pub(crate) fn write_run(&self, first: u64, entries: &[[u8; ENTRY]]) -> Result<(), IndexError> {
        let n = usize::try_from(self.blocks().saturating_sub(first))
            .unwrap_or(usize::MAX)
            .min(entries.len());
        if n == 0 {
            return Ok(());
        }
        let bytes: Vec<u8> = entries[..n].concat();
        self.file
            .write_all_at(&bytes, HEADER + first * ENTRY as u64)
            .map_err(|e| IndexError::io("write", &self.path, e))
    }

    /// Read the entries of `out.len()` consecutive blocks from `first`.
    pub(crate) fn read_run(&self, first: u64, out: &mut [[u8; ENTRY]]) -> Result<(), IndexError> {
        if first + out.len() as u64 > self.blocks() {
            return Err(IndexError::Corrupt {
                path: self.path.clone(),
                detail: format!(
                    "blocks {first}..{} asked of {}",
                    first + out.len() as u64,
                    self.blocks()
                ),
            });
        }
        let mut bytes = vec![0u8; out.len() * ENTRY];
        self.file
            .read_exact_at(&mut bytes, HEADER + first * ENTRY as u64)
            .map_err(|e| IndexError::io("read", &self.path, e))?;
        let (entries, _) = bytes.as_chunks::<ENTRY>();
        out.copy_from_slice(entries);
        Ok(())
    }
}

/// The view [`crate::PoolIndex::with_prints`] lends a reader, under the
/// prints' lock: no refresh takes a mark or writes an entry meanwhile.
pub struct PrintsView<'a> {
    pub(crate) prints: &'a VolumePrints,
}

impl PrintsView<'_> {
    /// Entries of `out.len()` consecutive blocks from `first`.
    pub fn read(&self, first: u64, out: &mut [[u8; ENTRY]]) -> Result<(), IndexError> {
        self.prints.read_run(first, out)
    }
}
