//! The fingerprint index (seed 002): for every non-zero block of every volume
//! a server holds, a content fingerprint, so that "do I already hold this
//! block?" is one lookup.
//!
//! - Fingerprints are BLAKE3 (256 bits): [`Fingerprint`]. A false match would
//!   silently corrupt a disk, so the index only proposes candidates: a block
//!   is used only after it is read and its full BLAKE3 equals the wanted one
//!   ([`verify`]).
//! - The index keeps a 64-bit key (the first 8 bytes of the fingerprint) and
//!   the block number: 16 bytes an entry, in per-volume sorted runs on disk
//!   ([`run::VolumeRun`]). Only one fence key per 4 KiB page stays in memory
//!   (8 bytes per 256 blocks), so an index far larger than RAM still works;
//!   the page cache keeps the hot part.
//! - Zero blocks are never indexed: they travel as intervals.
//! - [`scan`] hashes a volume with every core, reading large sequential chunks.
//! - Beside each run, the volume's prints in block order ([`prints`]): what
//!   a migration's source sends for blocks not written since they were
//!   hashed, without reading them.

pub mod pool;
pub mod prints;
pub mod run;
pub mod scan;
pub mod similarity;

use thiserror::Error;

pub use pool::{IndexStatus, PoolIndex};
pub use prints::{PrintsView, VolumePrints};
pub use run::{RunLookup, VolumeRun};
pub use scan::{open_data, scan_file, scan_source, BlockSource, ScanPace, ScanStats};
pub use similarity::{similarity, SimilarityPoint};

/// The persistent dirty bitmap (at the index's block size) that marks
/// every block of a volume written since the index last hashed it: what
/// the indexer re-hashes, and what a volume's prints are not current for.
pub const INDEX_BITMAP: &str = "ferry-index";

/// Smallest and largest supported block sizes.
pub const MIN_BLOCK: u32 = 512;
pub const MAX_BLOCK: u32 = 64 * 1024;

#[derive(Debug, Error)]
pub enum IndexError {
    #[error("block size {0} must be a power of two from 512 B to 64 KiB")]
    BlockSize(u32),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("corrupt index file {path}: {detail}")]
    Corrupt {
        path: std::path::PathBuf,
        detail: String,
    },
}

impl IndexError {
    pub(crate) fn io(op: &'static str, path: &std::path::Path, source: std::io::Error) -> Self {
        IndexError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Check a block size.
pub fn check_block_size(bs: u32) -> Result<(), IndexError> {
    if bs.is_power_of_two() && (MIN_BLOCK..=MAX_BLOCK).contains(&bs) {
        Ok(())
    } else {
        Err(IndexError::BlockSize(bs))
    }
}

/// A block's BLAKE3 fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn of(block: &[u8]) -> Fingerprint {
        Fingerprint(*blake3::hash(block).as_bytes())
    }

    /// The 64-bit key the index sorts by.
    pub fn key(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes"))
    }
}

/// Is the block all zeroes? (Word-wise; the compiler vectorises it.)
pub fn is_zero(block: &[u8]) -> bool {
    let (pre, words, post) = {
        // SAFETY: u64 has no invalid bit patterns; align_to only splits the slice.
        unsafe { block.align_to::<u64>() }
    };
    pre.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && post.iter().all(|&b| b == 0)
}

/// Use a candidate block only if its full fingerprint matches.
pub fn verify(candidate: &[u8], wanted: &Fingerprint) -> bool {
    Fingerprint::of(candidate) == *wanted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection_and_verify() {
        let mut b = vec![0u8; 4096 + 3];
        assert!(is_zero(&b[1..]));
        b[4000] = 1;
        assert!(!is_zero(&b[1..]));
        let f = Fingerprint::of(&b);
        assert!(verify(&b, &f));
        b[0] = 9;
        assert!(!verify(&b, &f));
        assert!(check_block_size(4096).is_ok());
        assert!(check_block_size(3000).is_err());
        assert!(check_block_size(256).is_err());
        assert!(check_block_size(128 << 10).is_err());
    }
}
