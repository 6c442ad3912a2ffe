//! Encoders for transmission-phase replies: simple replies and structured
//! reply chunks (`OFFSET_DATA`, `OFFSET_HOLE`, `NONE`, `BLOCK_STATUS`,
//! `ERROR`).

use crate::consts::*;
use crate::error::ErrorCode;
use bytes::{BufMut, BytesMut};

/// A simple reply header; for a successful READ the data follows it.
pub fn simple(out: &mut BytesMut, cookie: u64, error: Option<ErrorCode>) {
    out.put_u32(SIMPLE_REPLY_MAGIC);
    out.put_u32(error.map_or(0, ErrorCode::code));
    out.put_u64(cookie);
}

/// A structured chunk header.
pub fn chunk_header(out: &mut BytesMut, flags: u16, ty: u16, cookie: u64, len: u32) {
    out.put_u32(STRUCTURED_REPLY_MAGIC);
    out.put_u16(flags);
    out.put_u16(ty);
    out.put_u64(cookie);
    out.put_u32(len);
}

/// Header of a final `OFFSET_DATA` chunk; `data_len` bytes of data follow.
pub fn offset_data_header(out: &mut BytesMut, cookie: u64, offset: u64, data_len: u32) {
    chunk_header(
        out,
        REPLY_FLAG_DONE,
        REPLY_TYPE_OFFSET_DATA,
        cookie,
        data_len + 8,
    );
    out.put_u64(offset);
}

/// Header of a non-final `OFFSET_DATA` chunk (one piece of a READ answered
/// in several chunks); `data_len` bytes of data follow.
pub fn offset_data_piece(out: &mut BytesMut, cookie: u64, offset: u64, data_len: u32) {
    chunk_header(out, 0, REPLY_TYPE_OFFSET_DATA, cookie, data_len + 8);
    out.put_u64(offset);
}

/// A non-final `OFFSET_HOLE` chunk: `len` bytes at `offset` read as zeroes.
pub fn offset_hole(out: &mut BytesMut, cookie: u64, offset: u64, len: u32) {
    chunk_header(out, 0, REPLY_TYPE_OFFSET_HOLE, cookie, 12);
    out.put_u64(offset);
    out.put_u32(len);
}

/// A final `NONE` chunk: success with nothing more to say.
pub fn done(out: &mut BytesMut, cookie: u64) {
    chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0);
}

/// A final `ERROR` chunk with a human-readable message.
pub fn error(out: &mut BytesMut, cookie: u64, code: ErrorCode, message: &str) {
    let msg = &message.as_bytes()[..message.len().min(4096)];
    let len = u32::try_from(6 + msg.len()).unwrap_or(u32::MAX);
    chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, len);
    out.put_u32(code.code());
    out.put_u16(u16::try_from(msg.len()).unwrap_or(0));
    out.put_slice(msg);
}

/// A `BLOCK_STATUS` chunk for one context: `(length, flags)` extents.
pub fn block_status(
    out: &mut BytesMut,
    cookie: u64,
    context: u32,
    extents: &[(u32, u32)],
    last: bool,
) {
    let len = u32::try_from(4 + extents.len() * 8).unwrap_or(u32::MAX);
    chunk_header(
        out,
        if last { REPLY_FLAG_DONE } else { 0 },
        REPLY_TYPE_BLOCK_STATUS,
        cookie,
        len,
    );
    out.put_u32(context);
    for (l, f) in extents {
        out.put_u32(*l);
        out.put_u32(*f);
    }
}
