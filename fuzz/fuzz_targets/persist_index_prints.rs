//! A persisted prints file (`index/<volume>.fprt`) read back after
//! damage: opening the index never panics, and prints that open answer
//! reads of their entries (in range or not) and the index's status
//! without panicking. Half the inputs get a well-formed header for the
//! length they have, so the fuzzer reaches the entries.
#![no_main]

use ferry_index::PoolIndex;
use libfuzzer_sys::fuzz_target;

const HEADER: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.to_vec();
    if data.first().is_some_and(|b| b & 1 == 1) {
        // Magic, version 1, block size 4096, the volume size the entries
        // after the header cover, complete.
        let blocks = bytes.len().saturating_sub(HEADER) / 16;
        bytes.resize(HEADER + blocks * 16, 0);
        bytes[..8].copy_from_slice(b"FRYFPRT1");
        bytes[8..12].copy_from_slice(&1u32.to_le_bytes());
        bytes[12..16].copy_from_slice(&4096u32.to_le_bytes());
        bytes[16..24].copy_from_slice(&(blocks as u64 * 4096).to_le_bytes());
        bytes[24] = 1;
    }
    let dir = std::env::temp_dir().join(format!("ferry-fuzz-prints-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    if std::fs::create_dir_all(&dir).is_err() || std::fs::write(dir.join("v.fprt"), &bytes).is_err() {
        return;
    }
    if let Ok(index) = PoolIndex::open(&dir, 4096) {
        let size = bytes
            .get(16..24)
            .map_or(0, |s| u64::from_le_bytes(s.try_into().expect("8 bytes")));
        let blocks = size.div_ceil(4096);
        let _ = index.with_prints("v", size, |view| {
            for first in [0, blocks.saturating_sub(1), blocks, u64::MAX / 32] {
                let mut out = [[0u8; 16]; 4];
                let _ = view.read(first, &mut out);
            }
        });
        let _ = index.status();
    }
    let _ = std::fs::remove_dir_all(&dir);
});
