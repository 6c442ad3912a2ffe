//! The server handshake fed arbitrary bytes, in arbitrary pieces, in each
//! TLS mode (as if every STARTTLS were followed by a TLS handshake that
//! worked): it must never panic, and whatever it sends back must parse as
//! option replies.
#![no_main]

use bytes::BytesMut;
use ferry_nbd::client::decode_option_reply;
use ferry_nbd::{ExportCatalog, ExportInfo, HandshakeProgress, ServerHandshake, TlsMode};
use libfuzzer_sys::fuzz_target;

struct Cat;
impl ExportCatalog for Cat {
    fn export(&self, name: &str) -> Option<ExportInfo> {
        (name == "vol" || name.is_empty()).then(|| ExportInfo {
            name: "vol".into(),
            description: "fuzz".into(),
            size: 1 << 30,
            read_only: name.is_empty(),
            min_block: 1,
            preferred_block: 4096,
            max_block: 32 << 20,
            block_size_required: false,
            dirty_bitmaps: vec!["a".into(), "b".into()],
            resizable: true,
        })
    }
    fn exports(&self) -> Vec<ExportInfo> {
        self.export("vol").into_iter().collect()
    }
}

fuzz_target!(|data: &[u8]| {
    let (split, body) = match data.split_first() {
        Some((s, b)) => (*s as usize + 1, b),
        None => return,
    };
    let mode = match split % 3 {
        0 => TlsMode::Off,
        1 => TlsMode::Optional,
        _ => TlsMode::Forced,
    };
    let extended = split % 2 == 0;
    let split = split / 3 + 1;
    let mut hs = ServerHandshake::with_tls(mode).offer_extended_headers(extended);
    let mut input = BytesMut::new();
    let mut out = BytesMut::new();
    for piece in body.chunks(split) {
        input.extend_from_slice(piece);
        match hs.feed(&mut input, &Cat, &mut out) {
            Ok(HandshakeProgress::NeedMore) => continue,
            Ok(HandshakeProgress::StartTls) => {
                hs.tls_started();
                continue;
            }
            _ => break,
        }
    }
    // Replies before the final EXPORT_NAME answer are well-formed.
    while let Ok(Some(_)) = decode_option_reply(&mut out) {}
});
