//! How many link bytes a memory move of a guest would send per byte of its
//! resident RAM, estimated from a random sample of its resident pages read
//! out of its QEMU process: a zero page costs QEMU a marker, any other
//! crosses the link as ferry's tunnel frames it (zstd level 1).
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

use crate::guest::guest_ram;
use crate::peer::{encode_frame, MAX_FRAME};
use rand::Rng;
use std::fs::File;
use std::os::unix::fs::FileExt;

/// Resident pages sampled (4 MiB read from QEMU).
const SAMPLE_PAGES: usize = 1024;
/// Random pages looked up to find them: a guest with little resident
/// RAM gets a smaller sample rather than a long search.
const LOOKUPS: usize = 16 * SAMPLE_PAGES;
const PAGE: u64 = 4096;
/// Bytes QEMU's stream spends on a zero page (its header and a marker).
const ZERO_PAGE_BYTES: f64 = 9.0;

/// Link bytes per resident byte of QEMU `pid`'s guest RAM of
/// `memory_bytes`, from a sample; None when the process or its memory
/// cannot be read, or nothing of it is resident.
pub fn sample(pid: u32, memory_bytes: u64) -> Option<f64> {
    let ram = guest_ram(pid, memory_bytes)?;
    let pagemap = File::open(format!("/proc/{pid}/pagemap")).ok()?;
    let mem = File::open(format!("/proc/{pid}/mem")).ok()?;
    let pages = (ram.end - ram.start) / PAGE;
    if pages == 0 || ram.resident == 0 {
        return None;
    }
    let mut rng = rand::thread_rng();
    let mut chosen = Vec::with_capacity(SAMPLE_PAGES);
    for _ in 0..LOOKUPS {
        if chosen.len() == SAMPLE_PAGES {
            break;
        }
        let page = ram.start / PAGE + rng.gen_range(0..pages);
        let mut entry = [0u8; 8];
        pagemap.read_exact_at(&mut entry, page * 8).ok()?;
        // Bit 63: present; bit 56: mapped by this process alone. A page
        // QEMU only read (its migration code checks every page for zeroes)
        // is present as the kernel's shared zero page, which is not in the
        // resident count the share multiplies: leave it out.
        let e = u64::from_le_bytes(entry);
        if e >> 63 == 1 && (e >> 56) & 1 == 1 {
            chosen.push(page * PAGE);
        }
    }
    let mut contents = Vec::with_capacity(chosen.len());
    for addr in &chosen {
        let mut p = vec![0u8; 4096];
        mem.read_exact_at(&mut p, *addr).ok()?;
        contents.push(p);
    }
    share_of(&contents)
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
        (pages.len() * 4096) as f64,
    );
    Some(sent / raw)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::RngCore;

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
    fn a_process_that_is_not_there_has_no_share() {
        assert_eq!(sample(u32::MAX, 256 << 20), None);
    }
}
