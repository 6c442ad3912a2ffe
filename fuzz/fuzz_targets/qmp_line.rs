//! The QMP line decoder on arbitrary bytes fed in arbitrary pieces: never
//! panics, never holds more than one line's bound of unparsed bytes.
#![no_main]

use ferry_qmp::wire::{LineDecoder, MAX_LINE};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut d = LineDecoder::new();
    let step = usize::from(data.first().copied().unwrap_or(1)).max(1);
    for piece in data.chunks(step) {
        d.feed(piece);
        loop {
            match d.next_message() {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(d.pending() <= MAX_LINE + step);
    }
});
