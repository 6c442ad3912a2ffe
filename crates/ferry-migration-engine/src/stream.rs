//! One zstd stream per migration connection (`Encoding::ZstdStream`): every
//! `Data` frame is the next flushed piece of it, so a block can refer back
//! to anything sent in the last 128 MiB (long-distance matching). On OS
//! images this sends about a third of what compressing each 1 MiB frame on
//! its own does.

use ferry_migration::STREAM_WINDOW_LOG;
use std::io;
use zstd::stream::raw::{CParameter, DParameter, Decoder, Encoder, InBuffer, Operation, OutBuffer};

/// Compression level of the stream (long mode makes level 3 nearly as
/// tight as level 9 at the speed of level 3).
const LEVEL: i32 = 3;

/// The source's end.
pub struct StreamEncoder {
    enc: Encoder<'static>,
    /// What [`StreamEncoder::prepare`] made the stream emit, if anything:
    /// the head of the next piece.
    held: Vec<u8>,
}

fn room(out: &mut Vec<u8>) {
    if out.capacity() - out.len() < 64 << 10 {
        out.reserve(256 << 10);
    }
}

impl StreamEncoder {
    pub fn new() -> io::Result<StreamEncoder> {
        let mut enc = Encoder::new(LEVEL)?;
        enc.set_parameter(CParameter::WindowLog(STREAM_WINDOW_LOG))?;
        enc.set_parameter(CParameter::EnableLongDistanceMatching(true))?;
        Ok(StreamEncoder {
            enc,
            held: Vec::new(),
        })
    }

    /// Set the compressor up now rather than in the first piece: with a
    /// 128 MiB window and long-distance matching, zstd's first flush
    /// allocates and clears its tables (7.8-8.6 ms of one idle core here,
    /// 2026-12-01, where a later 8 KiB piece takes 0.05-0.15 ms), which a
    /// return, whose first pass sends a few blocks, would otherwise wait
    /// for. Whatever the stream emits (nothing, in zstd 1.5) leads the
    /// next piece.
    pub fn prepare(&mut self) -> io::Result<()> {
        let mut out = std::mem::take(&mut self.held);
        loop {
            room(&mut out);
            let pos = out.len();
            let mut o = OutBuffer::around_pos(&mut out, pos);
            if self.enc.flush(&mut o)? == 0 {
                break;
            }
        }
        self.held = out;
        Ok(())
    }

    /// Compress `raw` and flush: the result decodes after every earlier
    /// piece.
    pub fn piece(&mut self, raw: &[u8]) -> io::Result<Vec<u8>> {
        let mut out = std::mem::take(&mut self.held);
        out.reserve(raw.len() / 2 + 1024);
        let mut input = InBuffer::around(raw);
        while input.pos() < raw.len() {
            room(&mut out);
            let pos = out.len();
            let mut o = OutBuffer::around_pos(&mut out, pos);
            self.enc.run(&mut input, &mut o)?;
        }
        loop {
            room(&mut out);
            let pos = out.len();
            let mut o = OutBuffer::around_pos(&mut out, pos);
            if self.enc.flush(&mut o)? == 0 {
                break;
            }
        }
        Ok(out)
    }
}

/// The destination's end.
pub struct StreamDecoder {
    dec: Decoder<'static>,
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

impl StreamDecoder {
    pub fn new() -> io::Result<StreamDecoder> {
        let mut dec = Decoder::new()?;
        dec.set_parameter(DParameter::WindowLogMax(STREAM_WINDOW_LOG))?;
        Ok(StreamDecoder { dec })
    }

    /// Decode one piece that must hold exactly `raw_len` bytes.
    pub fn piece(&mut self, z: &[u8], raw_len: usize) -> io::Result<Vec<u8>> {
        let mut out: Vec<u8> = Vec::with_capacity(raw_len);
        let mut input = InBuffer::around(z);
        loop {
            let (in_before, out_before) = (input.pos(), out.len());
            {
                let pos = out.len();
                let mut o = OutBuffer::around_pos(&mut out, pos);
                self.dec.run(&mut input, &mut o)?;
            }
            if input.pos() == z.len() && out.len() == raw_len {
                // Anything still buffered in the decoder belongs to no frame.
                let mut probe = [0u8; 1];
                let mut po = OutBuffer::around(&mut probe[..]);
                let mut empty = InBuffer::around(&[]);
                self.dec.run(&mut empty, &mut po)?;
                if po.pos() != 0 {
                    return Err(bad("stream piece holds more than its length"));
                }
                return Ok(out);
            }
            if out.len() == raw_len && input.pos() < z.len() {
                return Err(bad("stream piece holds more than its length"));
            }
            if (input.pos(), out.len()) == (in_before, out_before) {
                return Err(bad(format!(
                    "stream piece ends after {} of {raw_len} bytes",
                    out.len()
                )));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_decode_in_order_and_refer_back() {
        let mut e = StreamEncoder::new().unwrap();
        let mut d = StreamDecoder::new().unwrap();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let a: Vec<u8> = (0..1u32 << 20)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x.to_le_bytes()[0]
            })
            .collect();
        let pa = e.piece(&a).unwrap();
        // The same megabyte again compresses to almost nothing.
        let pb = e.piece(&a).unwrap();
        assert!(pb.len() < pa.len() / 20, "{} vs {}", pb.len(), pa.len());
        assert_eq!(d.piece(&pa, a.len()).unwrap(), a);
        assert_eq!(d.piece(&pb, a.len()).unwrap(), a);
    }

    #[test]
    fn a_prepared_stream_decodes_as_one_that_was_not() {
        let a: Vec<u8> = (0..3u32 << 12).map(|i| (i * 7 % 251) as u8).collect();
        let mut e = StreamEncoder::new().unwrap();
        e.prepare().unwrap();
        e.prepare().unwrap();
        let mut d = StreamDecoder::new().unwrap();
        let (pa, pb) = (e.piece(&a).unwrap(), e.piece(&a).unwrap());
        assert_eq!(d.piece(&pa, a.len()).unwrap(), a);
        assert_eq!(d.piece(&pb, a.len()).unwrap(), a);
        // The same bytes as a stream never prepared.
        let mut plain = StreamEncoder::new().unwrap();
        assert_eq!(plain.piece(&a).unwrap(), pa);
    }

    #[test]
    fn wrong_lengths_and_garbage_are_errors() {
        let mut e = StreamEncoder::new().unwrap();
        let p = e.piece(&[7u8; 4096]).unwrap();
        assert!(StreamDecoder::new().unwrap().piece(&p, 4095).is_err());
        assert!(StreamDecoder::new().unwrap().piece(&p, 8192).is_err());
        assert!(StreamDecoder::new()
            .unwrap()
            .piece(b"definitely not zstd", 4096)
            .is_err());
        // Out of order: the second piece alone does not decode to its bytes.
        let mut e = StreamEncoder::new().unwrap();
        let a = vec![1u8; 1 << 16];
        let _ = e.piece(&a).unwrap();
        let second = e.piece(&a).unwrap();
        let r = StreamDecoder::new().unwrap().piece(&second, a.len());
        assert!(r.map_or(true, |b| b != a));
    }
}
