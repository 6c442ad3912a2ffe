//! The migration frame decoder on arbitrary bytes: never panics, and every
//! message it accepts re-encodes to a frame that decodes to the same message.
//! The decoded messages also drive both order checkers (destination side
//! and source side), which must never panic and never move on a refusal.
#![no_main]

use bytes::BytesMut;
use ferry_migration::{DestinationOrder, FrameDecoder, SourceOrder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut d = FrameDecoder::new();
    let mut b = BytesMut::from(data);
    let mut dest = DestinationOrder::new();
    let mut src = SourceOrder::new(data.first().is_some_and(|x| x & 1 == 1));
    while let Ok(Some(m)) = d.decode(&mut b) {
        let mut again = BytesMut::new();
        m.encode(&mut again);
        let back = FrameDecoder::new()
            .decode(&mut again)
            .expect("re-encoded frame decodes")
            .expect("complete");
        assert_eq!(back, m);
        let before = dest.state();
        if dest.receive(&m).is_err() {
            assert_eq!(dest.state(), before);
        }
        // The source both sends and receives; feed it both ways.
        src.sent(&m);
        let before = src.state();
        if src.receive(&m).is_err() {
            assert_eq!(src.state(), before);
        }
    }
});
