//! A persisted fingerprint-index run (`index/<volume>.fidx`) read back
//! after damage: opening never panics, and a run that opens answers
//! lookups and lists its entries without panicking. Half the inputs get
//! their header checksum fixed, so the fuzzer reaches past it.
#![no_main]

use ferry_index::VolumeRun;
use libfuzzer_sys::fuzz_target;

const PAGE: usize = ferry_index::run::PAGE;

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.to_vec();
    if bytes.len() >= PAGE && bytes[0] & 1 == 1 && bytes.len() % PAGE == 0 {
        let mut h = blake3::Hasher::new();
        h.update(&bytes[PAGE..]);
        bytes[32..64].copy_from_slice(h.finalize().as_bytes());
    }
    let path = std::env::temp_dir().join(format!("ferry-fuzz-run-{}.fidx", std::process::id()));
    if std::fs::write(&path, &bytes).is_err() {
        return;
    }
    if let Ok(run) = VolumeRun::open(&path) {
        for key in [0u64, 1, u64::MAX / 2, u64::MAX] {
            let _ = run.lookup(key, 8);
        }
        let _ = run.entries();
    }
    let _ = std::fs::remove_file(&path);
});
