//! ferry's NBD client parsers (option replies and transmission replies) on
//! arbitrary server bytes.
#![no_main]

use bytes::BytesMut;
use ferry_nbd::client::{decode_option_reply, decode_reply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut b = BytesMut::from(data);
    while let Ok(Some(_)) = decode_option_reply(&mut b) {}
    let mut b = BytesMut::from(data);
    let len = data.first().copied().unwrap_or(0) as u32 * 3;
    while let Ok(Some(r)) = decode_reply(&mut b, |_| len) {
        let _ = r.error();
    }
});
