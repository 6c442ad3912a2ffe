//! A persisted dirty bitmap file (`volumes/<name>/bitmaps/*.bitmap`) read
//! back after damage or tampering: decoding never panics and never
//! allocates from an unchecked size field. Half the inputs get a valid
//! checksum appended, so the fuzzer reaches the checks behind it. What
//! decodes re-encodes to the same bytes.
#![no_main]

use ferry_storage::DirtyBitmap;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.to_vec();
    if data.first().is_some_and(|b| b & 1 == 1) {
        let h = blake3::hash(&bytes);
        bytes.extend_from_slice(h.as_bytes());
    }
    if let Ok(bm) = DirtyBitmap::decode("fuzz", &bytes, Path::new("fuzz.bitmap")) {
        assert_eq!(bm.encode(), bytes);
        let _ = bm.extents(0, 1 << 20, 64);
        bm.mark(0, 4096);
        let _ = bm.take();
    }
});
