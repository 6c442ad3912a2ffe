//! Dirty bitmaps: one bit per `granularity` bytes, set by every write, zero
//! and trim of the volume.
//!
//! Marking is a lock-free `fetch_or` on 64-bit words, done after the data has
//! reached the file and before the write is acknowledged. Consumers take dirty
//! bits with an atomic swap ([`DirtyBitmap::take`]) and then read the data. So
//! a write racing with a take is never lost: either its bit is set after the
//! swap (and the next take sees it), or it was set before, in which case the
//! data was already in the file when the consumer read it.
//!
//! Persisted layout (little endian), read with a size limit:
//!
//! ```text
//! 0   magic "FRYDBMP1"
//! 8   u32 version (1)
//! 12  u32 granularity
//! 16  u64 volume size
//! 24  u64 word count
//! 32  word count * u64 bits
//! end 32-byte BLAKE3 of everything before it
//! ```

use crate::{Result, StorageError};
use parking_lot::RwLock;
use serde::Serialize;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

const MAGIC: &[u8; 8] = b"FRYDBMP1";
const VERSION: u32 = 1;
/// Bitmap files larger than this are refused rather than read.
pub(crate) const MAX_FILE: u64 = 1 << 30;

/// Summary of a bitmap for listings.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct BitmapInfo {
    pub name: String,
    pub granularity: u32,
    pub persistent: bool,
    pub dirty_bytes: u64,
    pub dirty_chunks: u64,
}

/// A named dirty bitmap of one volume.
#[derive(Debug)]
pub struct DirtyBitmap {
    name: String,
    granularity: u32,
    persistent: bool,
    words: RwLock<Vec<AtomicU64>>,
    size: AtomicU64,
}

fn words_for(size: u64, granularity: u32) -> usize {
    let chunks = size.div_ceil(u64::from(granularity));
    usize::try_from(chunks.div_ceil(64)).unwrap_or(usize::MAX)
}

impl DirtyBitmap {
    /// A clean bitmap for a volume of `size` bytes. `granularity` must be a
    /// power of two between 512 B and 64 MiB.
    pub fn new(name: &str, granularity: u32, size: u64, persistent: bool) -> Result<Self> {
        if !granularity.is_power_of_two() || !(512..=64 << 20).contains(&granularity) {
            return Err(StorageError::Invalid(format!(
                "bitmap granularity {granularity} must be a power of two from 512 to 64 MiB"
            )));
        }
        let words = (0..words_for(size, granularity))
            .map(|_| AtomicU64::new(0))
            .collect();
        Ok(DirtyBitmap {
            name: name.to_string(),
            granularity,
            persistent,
            words: RwLock::new(words),
            size: AtomicU64::new(size),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn granularity(&self) -> u32 {
        self.granularity
    }
    pub fn persistent(&self) -> bool {
        self.persistent
    }

    fn chunk_range(&self, offset: u64, len: u64) -> Option<(u64, u64)> {
        if len == 0 {
            return None;
        }
        let g = u64::from(self.granularity);
        Some((offset / g, (offset.saturating_add(len) - 1) / g))
    }

    /// Mark `[offset, offset+len)` dirty.
    pub fn mark(&self, offset: u64, len: u64) {
        let Some((first, last)) = self.chunk_range(offset, len) else {
            return;
        };
        let words = self.words.read();
        let mut c = first;
        while c <= last {
            let w = usize::try_from(c / 64).unwrap_or(usize::MAX);
            let Some(word) = words.get(w) else { break };
            let bit = c % 64;
            let upto = last.min(c - bit + 63);
            let n = upto - c + 1;
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            word.fetch_or(mask, Ordering::AcqRel);
            c = upto + 1;
        }
    }

    /// Mark everything dirty (used after an unclean shutdown).
    pub fn mark_all(&self) {
        let size = self.size.load(Ordering::Acquire);
        self.mark(0, size);
    }

    /// Is any chunk of `[offset, offset+len)` dirty?
    pub fn is_dirty(&self, offset: u64, len: u64) -> bool {
        let Some((first, last)) = self.chunk_range(offset, len) else {
            return false;
        };
        let words = self.words.read();
        (first..=last).any(|c| {
            let w = usize::try_from(c / 64).unwrap_or(usize::MAX);
            words
                .get(w)
                .is_some_and(|word| word.load(Ordering::Acquire) & (1 << (c % 64)) != 0)
        })
    }

    /// Atomically take (read and clear) all dirty chunks; returns the byte
    /// offsets of the chunks that were dirty, in order.
    pub fn take(&self) -> Vec<u64> {
        let words = self.words.read();
        let g = u64::from(self.granularity);
        let mut out = Vec::new();
        for (i, word) in words.iter().enumerate() {
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = word.swap(0, Ordering::AcqRel);
            while bits != 0 {
                let b = u64::from(bits.trailing_zeros());
                out.push((i as u64 * 64 + b) * g);
                bits &= bits - 1;
            }
        }
        out
    }

    /// Clear every bit.
    pub fn clear(&self) {
        for w in self.words.read().iter() {
            w.store(0, Ordering::Release);
        }
    }

    /// Number of dirty chunks.
    pub fn dirty_chunks(&self) -> u64 {
        self.words
            .read()
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }

    /// The chunk numbers of the dirty chunks at positions `ranks` (sorted,
    /// counted from 0 in volume order; ranks past the last dirty chunk are
    /// left out), found by counting bits a word at a time.
    pub fn dirty_at_ranks(&self, ranks: &[u64]) -> Vec<u64> {
        let words = self.words.read();
        let mut out = Vec::with_capacity(ranks.len());
        let mut want = ranks.iter().copied().peekable();
        let mut seen = 0u64;
        for (i, word) in words.iter().enumerate() {
            let Some(&next) = want.peek() else { break };
            let mut bits = word.load(Ordering::Acquire);
            let n = u64::from(bits.count_ones());
            if next >= seen + n {
                seen += n;
                continue;
            }
            while bits != 0 {
                if want.peek() == Some(&seen) {
                    want.next();
                    out.push(i as u64 * 64 + u64::from(bits.trailing_zeros()));
                }
                bits &= bits - 1;
                seen += 1;
            }
        }
        out
    }

    /// Dirty bytes (chunks times granularity, capped at the volume size).
    pub fn dirty_bytes(&self) -> u64 {
        (self.dirty_chunks() * u64::from(self.granularity)).min(self.size.load(Ordering::Relaxed))
    }

    /// Runs of `(length, dirty)` covering `[offset, offset+len)`, clipped to
    /// the volume size, at most `max` runs.
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> Vec<(u64, bool)> {
        let size = self.size.load(Ordering::Acquire);
        let end = offset.saturating_add(len).min(size);
        let g = u64::from(self.granularity);
        let words = self.words.read();
        let dirty_at = |pos: u64| {
            let c = pos / g;
            let w = usize::try_from(c / 64).unwrap_or(usize::MAX);
            words
                .get(w)
                .is_some_and(|word| word.load(Ordering::Acquire) & (1 << (c % 64)) != 0)
        };
        let mut out: Vec<(u64, bool)> = Vec::new();
        let mut pos = offset;
        while pos < end {
            let next = ((pos / g) + 1) * g;
            let stop = next.min(end);
            let d = dirty_at(pos);
            match out.last_mut() {
                Some((l, ld)) if *ld == d => *l += stop - pos,
                _ => {
                    if out.len() == max {
                        break;
                    }
                    out.push((stop - pos, d));
                }
            }
            pos = stop;
        }
        out
    }

    /// Follow a volume resize: new chunks start dirty when growing (their
    /// content is new to any consumer).
    pub fn resize(&self, new_size: u64) {
        let old = self.size.swap(new_size, Ordering::AcqRel);
        {
            let mut words = self.words.write();
            words.resize_with(words_for(new_size, self.granularity), || AtomicU64::new(0));
        }
        if new_size > old {
            self.mark(old, new_size - old);
        }
    }

    pub fn info(&self) -> BitmapInfo {
        BitmapInfo {
            name: self.name.clone(),
            granularity: self.granularity,
            persistent: self.persistent,
            dirty_bytes: self.dirty_bytes(),
            dirty_chunks: self.dirty_chunks(),
        }
    }

    /// Encode in the persisted layout.
    pub fn encode(&self) -> Vec<u8> {
        let words = self.words.read();
        let mut v = Vec::with_capacity(32 + words.len() * 8 + 32);
        v.extend_from_slice(MAGIC);
        v.extend_from_slice(&VERSION.to_le_bytes());
        v.extend_from_slice(&self.granularity.to_le_bytes());
        v.extend_from_slice(&self.size.load(Ordering::Acquire).to_le_bytes());
        v.extend_from_slice(&(words.len() as u64).to_le_bytes());
        for w in words.iter() {
            v.extend_from_slice(&w.load(Ordering::Acquire).to_le_bytes());
        }
        let h = blake3::hash(&v);
        v.extend_from_slice(h.as_bytes());
        v
    }

    /// Decode the persisted layout, checking magic, version, sizes and hash.
    pub fn decode(name: &str, bytes: &[u8], path: &Path) -> Result<Self> {
        let corrupt = |detail: String| StorageError::Corrupt {
            what: "dirty bitmap",
            path: path.to_path_buf(),
            detail,
        };
        if bytes.len() < 64 || bytes.len() as u64 > MAX_FILE {
            return Err(corrupt(format!("file of {} bytes", bytes.len())));
        }
        let (body, hash) = bytes.split_at(bytes.len() - 32);
        if blake3::hash(body).as_bytes() != hash {
            return Err(corrupt("checksum mismatch".into()));
        }
        if &body[..8] != MAGIC {
            return Err(corrupt("bad magic".into()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(body[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(body[o..o + 8].try_into().expect("8 bytes"));
        if u32_at(8) != VERSION {
            return Err(corrupt(format!("unknown version {}", u32_at(8))));
        }
        let gran = u32_at(12);
        let size = u64_at(16);
        let n = u64_at(24);
        // Check the counts against the file before allocating anything: the
        // size field alone must never decide how much memory is taken.
        if gran == 0 || !gran.is_power_of_two() {
            return Err(corrupt(format!("granularity {gran}")));
        }
        let body_words = (body.len() as u64 - 32) / 8;
        if n != body_words
            || body.len() as u64 != 32 + n * 8
            || u64::try_from(words_for(size, gran)).ok() != Some(n)
        {
            return Err(corrupt(format!(
                "word count {n} does not match size {size} and a body of {body_words} words"
            )));
        }
        let bm = DirtyBitmap::new(name, gran, size, true).map_err(|e| corrupt(e.to_string()))?;
        {
            let words = bm.words.read();
            for (i, w) in words.iter().enumerate() {
                w.store(u64_at(32 + i * 8), Ordering::Relaxed);
            }
        }
        Ok(bm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A valid header and checksum that claim an enormous volume must be
    /// refused from the counts, before anything is allocated.
    #[test]
    fn a_huge_claimed_size_is_refused_without_allocating() {
        let mut body = Vec::new();
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&VERSION.to_le_bytes());
        body.extend_from_slice(&512u32.to_le_bytes());
        body.extend_from_slice(&(1u64 << 62).to_le_bytes());
        body.extend_from_slice(&1u64.to_le_bytes());
        body.extend_from_slice(&0u64.to_le_bytes());
        let h = blake3::hash(&body);
        body.extend_from_slice(h.as_bytes());
        let e = DirtyBitmap::decode("x", &body, Path::new("x")).unwrap_err();
        assert!(e.to_string().contains("word count"), "{e}");
        // Granularity 0 is refused too (it would divide by zero).
        body[12..16].copy_from_slice(&0u32.to_le_bytes());
        let n = body.len() - 32;
        let h = blake3::hash(&body[..n]);
        body[n..].copy_from_slice(h.as_bytes());
        assert!(DirtyBitmap::decode("x", &body, Path::new("x")).is_err());
    }

    #[test]
    fn dirty_chunks_are_found_by_their_rank() {
        let b = DirtyBitmap::new("b", 4096, 4096 * 1000, false).unwrap();
        let marked = [3u64, 64, 65, 127, 128, 700, 999];
        for &c in &marked {
            b.mark(c * 4096, 1);
        }
        assert_eq!(b.dirty_at_ranks(&[0, 1, 2, 3, 4, 5, 6]), marked.to_vec());
        assert_eq!(b.dirty_at_ranks(&[1, 4, 6, 7, 50]), vec![64, 128, 999]);
        assert!(b.dirty_at_ranks(&[]).is_empty());
        // Nothing is cleared by looking.
        assert_eq!(b.dirty_chunks(), 7);
    }

    #[test]
    fn mark_take_extents() {
        let b = DirtyBitmap::new("b", 4096, 1 << 20, false).unwrap();
        b.mark(4095, 2);
        b.mark(65536 * 2, 65536 * 4 + 1);
        assert!(b.is_dirty(0, 1));
        assert!(b.is_dirty(4096, 1));
        assert!(!b.is_dirty(8192, 4096));
        assert_eq!(b.dirty_chunks(), 2 + 64 + 1);
        let e = b.extents(0, 1 << 20, 100);
        assert_eq!(e[0], (8192, true));
        assert_eq!(e.iter().map(|x| x.0).sum::<u64>(), 1 << 20);
        let taken = b.take();
        assert_eq!(taken.len(), 67);
        assert_eq!(taken[0], 0);
        assert_eq!(b.dirty_chunks(), 0);
    }

    #[test]
    fn zero_length_marks_nothing_and_bad_granularity_refused() {
        let b = DirtyBitmap::new("b", 512, 4096, false).unwrap();
        b.mark(100, 0);
        assert_eq!(b.dirty_chunks(), 0);
        assert!(DirtyBitmap::new("x", 1000, 4096, false).is_err());
        assert!(DirtyBitmap::new("x", 256, 4096, false).is_err());
    }

    #[test]
    fn persist_round_trip_and_corruption_detected() {
        let b = DirtyBitmap::new("b", 65536, 10 << 20, true).unwrap();
        b.mark(3 << 20, 100);
        let enc = b.encode();
        let d = DirtyBitmap::decode("b", &enc, Path::new("x")).unwrap();
        assert_eq!(d.take(), vec![3 << 20]);
        let mut bad = enc.clone();
        bad[40] ^= 1;
        assert!(DirtyBitmap::decode("b", &bad, Path::new("x")).is_err());
        assert!(DirtyBitmap::decode("b", &enc[..50], Path::new("x")).is_err());
    }

    #[test]
    fn grow_marks_new_space() {
        let b = DirtyBitmap::new("b", 512, 4096, false).unwrap();
        b.resize(8192);
        assert_eq!(b.dirty_chunks(), 8);
        b.resize(1024);
        assert_eq!(b.dirty_bytes(), 1024);
    }

    proptest::proptest! {
        #[test]
        fn marks_match_a_reference_model(ops in proptest::collection::vec((0u64..100_000, 0u64..20_000), 1..50)) {
            let size = 120_000u64;
            let g = 1024u64;
            let b = DirtyBitmap::new("b", u32::try_from(g).unwrap(), size, false).unwrap();
            let mut model = vec![false; usize::try_from(size.div_ceil(g)).unwrap()];
            for (off, len) in ops {
                b.mark(off, len);
                if len > 0 {
                    for c in off / g..=(off + len - 1) / g {
                        if let Some(m) = model.get_mut(usize::try_from(c).unwrap()) { *m = true; }
                    }
                }
            }
            let expect: Vec<u64> = model.iter().enumerate().filter(|(_, d)| **d).map(|(i, _)| i as u64 * g).collect();
            proptest::prop_assert_eq!(b.take(), expect);
        }
    }
}
