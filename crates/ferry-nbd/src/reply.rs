//! Encoders for transmission-phase replies, in the style the handshake
//! negotiated ([`ReplyStyle`]): simple replies, structured chunks, or
//! extended chunks (32-byte headers that echo the request's offset and
//! carry a 64-bit length; no simple replies at all).
//!
//! A [`ReplyTo`] names the request being answered (cookie, offset) and the
//! style, so a server writes the same calls whatever was negotiated:
//! `ok`, `error`, `read_header`, `offset_data_piece`, `offset_hole`,
//! `block_status`, `done`.

use crate::consts::*;
use crate::error::ErrorCode;
use crate::request::{Command, Request};
use bytes::{BufMut, BytesMut};

/// How replies are framed on one connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyStyle {
    /// Neither structured replies nor extended headers: 16-byte simple
    /// replies only.
    Simple,
    /// `NBD_OPT_STRUCTURED_REPLY`: 20-byte chunks (simple replies still
    /// allowed where there is no payload).
    Structured,
    /// `NBD_OPT_EXTENDED_HEADERS`: 32-byte chunks for every reply.
    Extended,
}

impl ReplyStyle {
    /// The style for what the handshake agreed.
    pub fn negotiated(structured: bool, extended: bool) -> ReplyStyle {
        match (structured, extended) {
            (_, true) => ReplyStyle::Extended,
            (true, false) => ReplyStyle::Structured,
            (false, false) => ReplyStyle::Simple,
        }
    }

    /// Replies may carry chunks (content, holes, status, error messages).
    pub fn chunks(self) -> bool {
        self != ReplyStyle::Simple
    }

    /// Bytes of one chunk header (or of a simple reply).
    pub fn header_len(self) -> usize {
        match self {
            ReplyStyle::Simple => SIMPLE_REPLY_LEN,
            ReplyStyle::Structured => STRUCTURED_HEADER_LEN,
            ReplyStyle::Extended => EXTENDED_HEADER_LEN,
        }
    }

    /// Bytes before a successful READ's data in its one-chunk reply.
    pub fn read_header_len(self) -> usize {
        match self {
            ReplyStyle::Simple => SIMPLE_REPLY_LEN,
            s => s.header_len() + 8,
        }
    }
}

/// The request a reply answers, and how to frame it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyTo {
    pub style: ReplyStyle,
    pub cookie: u64,
    /// The request's offset (echoed in every extended header).
    pub offset: u64,
    pub command: Command,
}

impl ReplyTo {
    pub fn new(style: ReplyStyle, req: &Request) -> ReplyTo {
        ReplyTo {
            style,
            cookie: req.cookie,
            offset: req.offset,
            command: req.command,
        }
    }

    /// A chunk header (structured or extended; a simple connection never
    /// gets one).
    fn chunk(&self, out: &mut BytesMut, flags: u16, ty: u16, len: u64) {
        debug_assert!(self.style.chunks(), "chunk on a simple-reply connection");
        if self.style == ReplyStyle::Extended {
            out.put_u32(EXTENDED_REPLY_MAGIC);
            out.put_u16(flags);
            out.put_u16(ty);
            out.put_u64(self.cookie);
            out.put_u64(self.offset);
            out.put_u64(len);
        } else {
            out.put_u32(STRUCTURED_REPLY_MAGIC);
            out.put_u16(flags);
            out.put_u16(ty);
            out.put_u64(self.cookie);
            out.put_u32(u32::try_from(len).unwrap_or(u32::MAX));
        }
    }

    fn simple(&self, out: &mut BytesMut, error: Option<ErrorCode>) {
        out.put_u32(SIMPLE_REPLY_MAGIC);
        out.put_u32(error.map_or(0, ErrorCode::code));
        out.put_u64(self.cookie);
    }

    /// Success with no payload: a simple reply, or (extended) a final
    /// `NONE` chunk.
    pub fn ok(&self, out: &mut BytesMut) {
        match self.style {
            ReplyStyle::Extended => self.done(out),
            _ => self.simple(out, None),
        }
    }

    /// Failure: an `ERROR` chunk with the message where chunks are
    /// negotiated and the request expects them (a READ or BLOCK_STATUS;
    /// every request with extended headers), else a simple reply.
    pub fn error(&self, out: &mut BytesMut, code: ErrorCode, message: &str) {
        let chunk = match self.style {
            ReplyStyle::Simple => false,
            ReplyStyle::Structured => {
                matches!(self.command, Command::Read | Command::BlockStatus)
            }
            ReplyStyle::Extended => true,
        };
        if !chunk {
            return self.simple(out, Some(code));
        }
        let msg = &message.as_bytes()[..message.len().min(4096)];
        self.chunk(out, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6 + msg.len() as u64);
        out.put_u32(code.code());
        out.put_u16(u16::try_from(msg.len()).unwrap_or(0));
        out.put_slice(msg);
    }

    /// The header of a successful READ answered in one piece: a simple
    /// reply, or a final `OFFSET_DATA` chunk at the request's offset;
    /// `data_len` bytes of data follow it.
    pub fn read_header(&self, out: &mut BytesMut, data_len: u32) {
        if self.style == ReplyStyle::Simple {
            return self.simple(out, None);
        }
        self.chunk(
            out,
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            u64::from(data_len) + 8,
        );
        out.put_u64(self.offset);
    }

    /// Header of a non-final `OFFSET_DATA` chunk (one piece of a READ
    /// answered in several); `data_len` bytes of data follow.
    pub fn offset_data_piece(&self, out: &mut BytesMut, offset: u64, data_len: u32) {
        self.chunk(out, 0, REPLY_TYPE_OFFSET_DATA, u64::from(data_len) + 8);
        out.put_u64(offset);
    }

    /// A non-final `OFFSET_HOLE` chunk: `len` bytes at `offset` read as
    /// zeroes.
    pub fn offset_hole(&self, out: &mut BytesMut, offset: u64, len: u32) {
        self.chunk(out, 0, REPLY_TYPE_OFFSET_HOLE, 12);
        out.put_u64(offset);
        out.put_u32(len);
    }

    /// A final `NONE` chunk: success with nothing more to say.
    pub fn done(&self, out: &mut BytesMut) {
        self.chunk(out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
    }

    /// A non-final status chunk for one meta context: `(length, flags)`
    /// extents. Structured replies carry 32-bit lengths
    /// (`BLOCK_STATUS`): the caller keeps each length below 2^32 (a compact
    /// request asks about less than that). Extended ones use
    /// `BLOCK_STATUS_EXT` with 64-bit lengths and status.
    pub fn block_status(&self, out: &mut BytesMut, context: u32, extents: &[(u64, u32)]) {
        let n = extents.len() as u64;
        if self.style == ReplyStyle::Extended {
            self.chunk(out, 0, REPLY_TYPE_BLOCK_STATUS_EXT, 8 + n * 16);
            out.put_u32(context);
            out.put_u32(u32::try_from(n).unwrap_or(u32::MAX));
            for (l, f) in extents {
                out.put_u64(*l);
                out.put_u64(u64::from(*f));
            }
        } else {
            self.chunk(out, 0, REPLY_TYPE_BLOCK_STATUS, 4 + n * 8);
            out.put_u32(context);
            for (l, f) in extents {
                out.put_u32(u32::try_from(*l).unwrap_or(u32::MAX));
                out.put_u32(*f);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to(style: ReplyStyle, command: Command) -> ReplyTo {
        ReplyTo {
            style,
            cookie: 0x0102_0304_0506_0708,
            offset: 1 << 40,
            command,
        }
    }

    #[test]
    fn extended_chunks_echo_the_offset_and_carry_64_bit_lengths() {
        let mut b = BytesMut::new();
        to(ReplyStyle::Extended, Command::Write).ok(&mut b);
        assert_eq!(b.len(), EXTENDED_HEADER_LEN);
        assert_eq!(&b[..4], &EXTENDED_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&b[4..6], &REPLY_FLAG_DONE.to_be_bytes());
        assert_eq!(&b[6..8], &REPLY_TYPE_NONE.to_be_bytes());
        assert_eq!(&b[16..24], &(1u64 << 40).to_be_bytes());
        assert_eq!(&b[24..32], &0u64.to_be_bytes());

        let mut b = BytesMut::new();
        to(ReplyStyle::Extended, Command::BlockStatus).block_status(
            &mut b,
            1,
            &[(5 << 32, STATE_HOLE | STATE_ZERO), (4096, 0)],
        );
        assert_eq!(b.len(), 32 + 8 + 2 * 16);
        assert_eq!(&b[6..8], &REPLY_TYPE_BLOCK_STATUS_EXT.to_be_bytes());
        assert_eq!(&b[24..32], &40u64.to_be_bytes());
        assert_eq!(&b[36..40], &2u32.to_be_bytes(), "descriptor count");
        assert_eq!(&b[40..48], &(5u64 << 32).to_be_bytes());
        assert_eq!(&b[48..56], &3u64.to_be_bytes());
    }

    #[test]
    fn errors_are_chunks_where_the_style_and_command_allow() {
        let mut b = BytesMut::new();
        to(ReplyStyle::Structured, Command::Write).error(&mut b, ErrorCode::NoSpc, "full");
        assert_eq!(b.len(), SIMPLE_REPLY_LEN, "structured WRITE: simple error");
        let mut b = BytesMut::new();
        to(ReplyStyle::Structured, Command::Read).error(&mut b, ErrorCode::Io, "bad");
        assert_eq!(b.len(), STRUCTURED_HEADER_LEN + 6 + 3);
        let mut b = BytesMut::new();
        to(ReplyStyle::Extended, Command::Write).error(&mut b, ErrorCode::NoSpc, "full");
        assert_eq!(b.len(), EXTENDED_HEADER_LEN + 6 + 4);
        assert_eq!(&b[6..8], &REPLY_TYPE_ERROR.to_be_bytes());
        assert_eq!(&b[32..36], &28u32.to_be_bytes());
        let mut b = BytesMut::new();
        to(ReplyStyle::Simple, Command::Read).error(&mut b, ErrorCode::Inval, "x");
        assert_eq!(b.len(), SIMPLE_REPLY_LEN);
    }

    #[test]
    fn read_headers_have_the_length_the_style_says() {
        for s in [
            ReplyStyle::Simple,
            ReplyStyle::Structured,
            ReplyStyle::Extended,
        ] {
            let mut b = BytesMut::new();
            to(s, Command::Read).read_header(&mut b, 512);
            assert_eq!(b.len(), s.read_header_len(), "{s:?}");
        }
    }
}
