//! The migration frame decoder on arbitrary bytes: never panics, and every
//! message it accepts re-encodes to a frame that decodes to the same message.
#![no_main]

use bytes::BytesMut;
use ferry_migration::FrameDecoder;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut d = FrameDecoder::new();
    let mut b = BytesMut::from(data);
    while let Ok(Some(m)) = d.decode(&mut b) {
        let mut again = BytesMut::new();
        m.encode(&mut again);
        let back = FrameDecoder::new()
            .decode(&mut again)
            .expect("re-encoded frame decodes")
            .expect("complete");
        assert_eq!(back, m);
    }
});
