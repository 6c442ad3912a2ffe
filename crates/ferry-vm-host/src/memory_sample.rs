//! How many link bytes a memory move of a guest would send per byte of its
//! resident RAM, estimated from a sample of its resident pages read out of
//! its QEMU process: a zero page costs QEMU a marker, any other crosses the
//! link as ferry's tunnel frames it (zstd level 1, 1 MiB frames of QEMU's
//! stream, which walks the RAM in address order).
//!
//! The controller's model needs this share for each guest; a single
//! constant calibrated on one guest (0.32) under-prices a guest whose
//! memory compresses worse. The sample reads `/proc/PID/pagemap` (only the
//! "present" bit, which needs no privilege) and `/proc/PID/mem` (which
//! needs the right to trace QEMU: the same user with no Yama restriction,
//! or `CAP_SYS_PTRACE`); without it there is no estimate and the model
//! keeps its constant. Only pages mapped by QEMU alone are sampled: after
//! a migration's zero-page checks, half of a guest's RAM can be "present"
//! as the shared zero page without being resident (measured: 256 MiB
//! present, 120 MiB resident; the share over all present pages came out
//! 0.16 where the move sent 0.33).
//!
//! The sample is runs of neighbouring resident pages, evenly spaced over
//! all of them from a random start. Neighbours compress together in the
//! move's stream; single pages drawn at random lose that and priced the
//! test guest's memory 11% high (sd 4% between samples), where runs of 32
//! at even spacing came within 1% (sd 1%), against the whole memory
//! compressed as the tunnel frames it (docs/placement-model.md).

use crate::guest::guest_ram;
use crate::peer::{encode_frame, MAX_FRAME};
use rand::Rng;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Runs of resident pages sampled.
const RUNS: usize = 128;
/// Resident pages per run (the sample reads `RUNS` × `RUN_PAGES` pages:
/// 16 MiB).
const RUN_PAGES: usize = 32;
const PAGE_BYTES: usize = 4096;
/// The same, as a step between addresses.
const PAGE: u64 = PAGE_BYTES as u64;
/// Pagemap entries read at a time.
const PAGEMAP_BATCH: usize = 8192;
/// Bytes QEMU's stream spends on a zero page (its header and a marker).
const ZERO_PAGE_BYTES: f64 = 9.0;

/// Link bytes per resident byte of QEMU `pid`'s guest RAM of
/// `memory_bytes`, from a sample; None when the process or its memory
/// cannot be read, or nothing of it is resident.
pub fn sample(pid: u32, memory_bytes: u64) -> Option<f64> {
    sample_from(pid, memory_bytes, |step| {
        rand::thread_rng().gen_range(0..step)
    })
}

/// [`sample`] with its runs from the resident page of rank
/// `offset(spacing)` on.
fn sample_from(pid: u32, memory_bytes: u64, offset: impl FnOnce(usize) -> usize) -> Option<f64> {
    let ram = guest_ram(pid, memory_bytes)?;
    let pagemap = File::open(format!("/proc/{pid}/pagemap")).ok()?;
    let mem = File::open(format!("/proc/{pid}/mem")).ok()?;
    let pages = usize::try_from((ram.end - ram.start) / PAGE).ok()?;
    if pages == 0 || ram.resident == 0 {
        return None;
    }
    let resident = ResidentPages::read(&pagemap, ram.start / PAGE, pages)?;
    if resident.count == 0 {
        return None;
    }
    let offset = offset(spacing(resident.count));
    let mut contents = Vec::new();
    for page in resident.runs(offset) {
        let mut p = vec![0u8; PAGE_BYTES];
        mem.read_exact_at(&mut p, ram.start + page as u64 * PAGE)
            .ok()?;
        contents.push(p);
    }
    share_of(&contents)
}

/// Resident pages between the sampled runs' starts.
fn spacing(resident: usize) -> usize {
    (resident / RUNS).max(RUN_PAGES)
}

/// Which pages of a mapping are resident and QEMU's alone, one bit each.
struct ResidentPages {
    bits: Vec<u64>,
    count: usize,
}

impl ResidentPages {
    /// From the pagemap entries of `pages` pages from page number `first`.
    fn read(pagemap: &File, first: u64, pages: usize) -> Option<ResidentPages> {
        let mut out = ResidentPages::empty(pages);
        let mut buf = vec![0u8; PAGEMAP_BATCH * 8];
        let mut done = 0;
        while done < pages {
            let n = (pages - done).min(PAGEMAP_BATCH);
            let chunk = &mut buf[..n * 8];
            pagemap
                .read_exact_at(chunk, (first + done as u64) * 8)
                .ok()?;
            for (i, e) in chunk.as_chunks::<8>().0.iter().enumerate() {
                let e = u64::from_le_bytes(*e);
                // Bit 63: present; bit 56: mapped by this process alone. A
                // page QEMU only read (its migration code checks every page
                // for zeroes) is present as the kernel's shared zero page,
                // which is not in the resident count the share multiplies:
                // leave it out.
                if e >> 63 == 1 && (e >> 56) & 1 == 1 {
                    out.set(done + i);
                }
            }
            done += n;
        }
        Some(out)
    }

    fn empty(pages: usize) -> ResidentPages {
        ResidentPages {
            bits: vec![0; pages.div_ceil(64)],
            count: 0,
        }
    }

    fn set(&mut self, page: usize) {
        let (w, b) = (page / 64, page % 64);
        if self.bits[w] & (1 << b) == 0 {
            self.bits[w] |= 1 << b;
            self.count += 1;
        }
    }

    /// The sample's pages (numbers within the mapping): `RUN_PAGES`
    /// resident pages from the resident page of rank `offset`, then from
    /// every `spacing` ranks after it.
    fn runs(&self, offset: usize) -> Vec<usize> {
        let step = spacing(self.count);
        let mut out = Vec::new();
        let mut rank = 0;
        for (w, word) in self.bits.iter().enumerate() {
            let mut word = *word;
            while word != 0 {
                let page = w * 64 + word.trailing_zeros() as usize;
                word &= word - 1;
                if rank >= offset && (rank - offset) % step < RUN_PAGES {
                    out.push(page);
                }
                rank += 1;
            }
        }
        out
    }
}

/// Link bytes per byte of `pages` (each 4 KiB): zero pages as QEMU's
/// markers, the rest concatenated and framed as the tunnel frames QEMU's
/// stream.
fn share_of(pages: &[Vec<u8>]) -> Option<f64> {
    if pages.is_empty() {
        return None;
    }
    let mut zero = 0usize;
    let mut data = Vec::new();
    for p in pages {
        if p.iter().all(|b| *b == 0) {
            zero += 1;
        } else {
            data.extend_from_slice(p);
        }
    }
    let mut link = Vec::new();
    for chunk in data.chunks(MAX_FRAME) {
        encode_frame(chunk, true, &mut link);
    }
    #[allow(clippy::cast_precision_loss)]
    let (sent, raw) = (
        link.len() as f64 + zero as f64 * ZERO_PAGE_BYTES,
        (pages.len() * PAGE_BYTES) as f64,
    );
    Some(sent / raw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng};

    #[test]
    fn zero_pages_cost_nothing_random_ones_all_and_text_in_between() {
        let zero = vec![0u8; 4096];
        let mut random = vec![0u8; 4096];
        let text: Vec<u8> = b"ferry moves guests. "
            .iter()
            .copied()
            .cycle()
            .take(4096)
            .collect();
        let mut pages = Vec::new();
        for _ in 0..64 {
            rand::thread_rng().fill_bytes(&mut random);
            pages.push(random.clone());
        }
        let all_random = share_of(&pages).unwrap();
        assert!((0.99..1.01).contains(&all_random), "{all_random}");
        let all_zero = share_of(&vec![zero.clone(); 64]).unwrap();
        assert!(all_zero < 0.01, "{all_zero}");
        // Half zero, half random: about half.
        let half: Vec<Vec<u8>> = pages[..32]
            .iter()
            .cloned()
            .chain(std::iter::repeat_n(zero, 32))
            .collect();
        let h = share_of(&half).unwrap();
        assert!((0.49..0.51).contains(&h), "{h}");
        let t = share_of(&vec![text; 64]).unwrap();
        assert!(t < 0.05, "{t}");
        assert_eq!(share_of(&[]), None);
    }

    #[test]
    fn runs_of_resident_pages_are_spread_evenly_from_the_offset() {
        // Every other page resident: four runs' worth of resident pages
        // per run sampled.
        let pages = 2 * RUNS * RUN_PAGES * 4;
        let mut r = ResidentPages::empty(pages);
        for p in (0..pages).step_by(2) {
            r.set(p);
        }
        r.set(0);
        assert_eq!(r.count, pages / 2);
        let step = spacing(r.count);
        assert_eq!(step, 4 * RUN_PAGES);
        let chosen = r.runs(5);
        assert_eq!(chosen.len(), RUNS * RUN_PAGES);
        // Each run: RUN_PAGES resident pages in a row (every other page),
        // the first at rank 5 + k * step.
        for (k, run) in chosen.chunks(RUN_PAGES).enumerate() {
            let first_rank = 5 + k * step;
            let want: Vec<usize> = (first_rank..first_rank + RUN_PAGES)
                .map(|rank| rank * 2)
                .collect();
            assert_eq!(run, want.as_slice(), "run {k}");
        }
        // A guest with fewer resident pages than one sample: all of them
        // after the offset.
        let mut few = ResidentPages::empty(1000);
        for p in [3, 10, 11, 500, 999] {
            few.set(p);
        }
        assert_eq!(few.runs(0), vec![3, 10, 11, 500, 999]);
        assert_eq!(few.runs(2), vec![11, 500, 999]);
        assert!(ResidentPages::empty(10).runs(0).is_empty());
    }

    /// 4 KiB pages of three kinds in turn, in regions of 16 to 79 pages:
    /// random bytes, near copies of the region's own random page (which
    /// compress only beside each other, as a guest's page tables or copies
    /// of one file do), and text.
    fn kinds_in_regions(pages: usize) -> Vec<Vec<u8>> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut out = Vec::with_capacity(pages);
        let mut kind = 0;
        while out.len() < pages {
            let len = rng.gen_range(16..80).min(pages - out.len());
            kind = (kind + 1) % 3;
            let mut template = vec![0u8; PAGE_BYTES];
            rng.fill_bytes(&mut template);
            for i in 0..len {
                let p = match kind {
                    0 => {
                        let mut p = vec![0u8; PAGE_BYTES];
                        rng.fill_bytes(&mut p);
                        p
                    }
                    1 => {
                        let mut p = template.clone();
                        p[rng.gen_range(0..PAGE_BYTES)] = rng.gen();
                        p
                    }
                    _ => format!("page {i} of a text region; ")
                        .bytes()
                        .cycle()
                        .take(PAGE_BYTES)
                        .collect(),
                };
                out.push(p);
            }
        }
        out
    }

    #[test]
    fn a_process_s_memory_is_priced_as_its_whole_stream_compresses() {
        // Our own memory stands for a guest's: a mapping of an unusual size
        // (the sampler finds the RAM by its size), every page written.
        const SIZE: usize = 88 << 20;
        let pages = kinds_in_regions(SIZE / PAGE_BYTES);
        let mut ram = vec![0u8; SIZE];
        for (i, p) in pages.iter().enumerate() {
            ram[i * PAGE_BYTES..(i + 1) * PAGE_BYTES].copy_from_slice(p);
        }
        let whole = share_of(&pages).unwrap();
        // Single pages at random price the near copies at their full size.
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let single: Vec<Vec<u8>> = (0..4096)
            .map(|_| pages[rng.gen_range(0..pages.len())].clone())
            .collect();
        let single = share_of(&single).unwrap();
        assert!(single > whole * 1.3, "single pages {single}, whole {whole}");
        // Runs, from every 11th offset a sample can start at.
        let step = spacing(SIZE / PAGE_BYTES);
        let seen: Vec<f64> = (0..step)
            .step_by(11)
            .map(|o| sample_from(std::process::id(), SIZE as u64, |s| o.min(s - 1)).unwrap())
            .collect();
        let mean = seen.iter().sum::<f64>() / seen.len() as f64;
        assert!(
            (mean / whole - 1.0).abs() < 0.05,
            "mean {mean} of {seen:?}, whole {whole}"
        );
        for s in &seen {
            assert!(
                (s / whole - 1.0).abs() < 0.2,
                "sampled {seen:?}, whole {whole}"
            );
        }
        assert!(sample(std::process::id(), SIZE as u64).is_some());
        std::hint::black_box(&ram);
    }

    #[test]
    fn a_process_that_is_not_there_has_no_share() {
        assert_eq!(sample(u32::MAX, 256 << 20), None);
    }
}
