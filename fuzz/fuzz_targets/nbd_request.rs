//! The transmission-phase decoder and validator on arbitrary bytes.
#![no_main]

use bytes::BytesMut;
use ferry_nbd::{validate, RequestDecoder, TransmissionLimits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let lim = TransmissionLimits {
        size: 1 << 20,
        read_only: data.first().is_some_and(|b| b & 1 != 0),
        structured: data.first().is_some_and(|b| b & 2 != 0),
        extended: data.first().is_some_and(|b| b & 16 != 0),
        has_meta_contexts: data.first().is_some_and(|b| b & 4 != 0),
        min_block: if data.first().is_some_and(|b| b & 8 != 0) {
            512
        } else {
            1
        },
        resizable: data.first().is_some_and(|b| b & 32 != 0),
    };
    let mut d = RequestDecoder::with_headers(lim.extended);
    let mut b = BytesMut::new();
    for piece in data.chunks(97) {
        b.extend_from_slice(piece);
        loop {
            match d.decode(&mut b) {
                Ok(Some(r)) => {
                    if validate(&r, &lim).is_ok() {
                        let end = r.offset.saturating_add(r.length);
                        assert!(
                            end <= lim.size
                                || matches!(
                                    r.command,
                                    ferry_nbd::Command::Flush
                                        | ferry_nbd::Command::Disc
                                        | ferry_nbd::Command::Resize
                                )
                        );
                        if let Some(p) = &r.payload {
                            assert_eq!(p.len() as u64, r.length);
                        }
                    }
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
