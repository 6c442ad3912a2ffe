//! Similarity of two disk images as a function of block size (seed 002,
//! Fig. 8): the share of the target's non-zero blocks whose content the base
//! image already holds somewhere, at any block position.

use crate::scan::{scan_blocks, ScanPace};
use crate::IndexError;
use std::collections::HashSet;
use std::fs::File;
use std::path::Path;

/// One point of the similarity curve.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimilarityPoint {
    pub block_size: u32,
    pub target_blocks: u64,
    pub target_zero_blocks: u64,
    /// Non-zero target blocks found in the base.
    pub found: u64,
}

impl SimilarityPoint {
    /// Found share of the non-zero blocks.
    pub fn share(&self) -> f64 {
        let nz = self.target_blocks - self.target_zero_blocks;
        if nz == 0 {
            1.0
        } else {
            self.found as f64 / nz as f64
        }
    }

    /// Share of the whole target that need not be sent (zero or found).
    pub fn saved(&self) -> f64 {
        if self.target_blocks == 0 {
            1.0
        } else {
            (self.found + self.target_zero_blocks) as f64 / self.target_blocks as f64
        }
    }
}

fn open(p: &Path) -> Result<(File, u64), IndexError> {
    let f = File::open(p).map_err(|e| IndexError::io("open", p, e))?;
    let n = f
        .metadata()
        .map_err(|e| IndexError::io("stat", p, e))?
        .len();
    Ok((f, n))
}

/// Measure the similarity of `target` to `base` at one block size.
pub fn similarity(
    base: &Path,
    target: &Path,
    block_size: u32,
) -> Result<SimilarityPoint, IndexError> {
    let (bf, bn) = open(base)?;
    let mut have: HashSet<[u8; 16]> = HashSet::new();
    scan_blocks(&bf, base, bn, block_size, ScanPace::Full, |_, prints| {
        for p in prints.iter().flatten() {
            have.insert(p.0[..16].try_into().expect("16 bytes"));
        }
    })?;
    let (tf, tn) = open(target)?;
    let mut point = SimilarityPoint {
        block_size,
        target_blocks: 0,
        target_zero_blocks: 0,
        found: 0,
    };
    let st = scan_blocks(&tf, target, tn, block_size, ScanPace::Full, |_, prints| {
        for p in prints.iter().flatten() {
            if have.contains(&<[u8; 16]>::try_from(&p.0[..16]).expect("16 bytes")) {
                point.found += 1;
            }
        }
    })?;
    point.target_blocks = st.blocks;
    point.target_zero_blocks = st.zero_blocks;
    Ok(point)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shifted_content_is_found_at_small_blocks_only() {
        let d = tempfile::tempdir().unwrap();
        let base = d.path().join("base");
        let target = d.path().join("target");
        let mut x: u64 = 1;
        let data: Vec<u8> = (0..(1 << 20))
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                (x >> 33).to_le_bytes()[0]
            })
            .collect();
        std::fs::write(&base, &data).unwrap();
        // Target: the base shifted by 512 bytes, plus 64 KiB of zeroes.
        let mut t = vec![0u8; 512];
        t.extend_from_slice(&data);
        t.extend(vec![0u8; 65536 - 512]);
        std::fs::write(&target, &t).unwrap();
        let small = similarity(&base, &target, 512).unwrap();
        let big = similarity(&base, &target, 4096).unwrap();
        assert!(small.share() > 0.99, "{small:?}");
        assert!(big.share() < 0.01, "{big:?}");
        assert!(small.target_zero_blocks >= 1);
    }
}
