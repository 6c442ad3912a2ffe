//! Client side of the protocol: option and request encoders, option-reply and
//! transmission-reply decoders. Used by ferry's own client (`ferry bench`,
//! import/export, the host agent) and by the tests.

use crate::consts::*;
use crate::error::{ErrorCode, NbdError};
use crate::request::Command;
use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Encode `IHAVEOPT option len data`.
pub fn encode_option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(16 + data.len());
    v.extend(IHAVEOPT.to_be_bytes());
    v.extend(option.to_be_bytes());
    v.extend(u32::try_from(data.len()).unwrap_or(u32::MAX).to_be_bytes());
    v.extend(data);
    v
}

/// Data of NBD_OPT_INFO / NBD_OPT_GO.
pub fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend(u32::try_from(name.len()).unwrap_or(u32::MAX).to_be_bytes());
    v.extend(name.as_bytes());
    v.extend(u16::try_from(infos.len()).unwrap_or(u16::MAX).to_be_bytes());
    for i in infos {
        v.extend(i.to_be_bytes());
    }
    v
}

/// Data of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT.
pub fn meta_context_data(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend(
        u32::try_from(export.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    v.extend(export.as_bytes());
    v.extend(
        u32::try_from(queries.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    for q in queries {
        v.extend(u32::try_from(q.len()).unwrap_or(u32::MAX).to_be_bytes());
        v.extend(q.as_bytes());
    }
    v
}

/// One option reply from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Bytes,
}

/// Decode one option reply, or `Ok(None)` if more bytes are needed.
pub fn decode_option_reply(buf: &mut BytesMut) -> Result<Option<OptionReply>, NbdError> {
    if buf.len() < 20 {
        return Ok(None);
    }
    let magic = u64::from_be_bytes(buf[..8].try_into().expect("8 bytes"));
    if magic != OPTION_REPLY_MAGIC {
        return Err(NbdError::BadMagic {
            what: "option reply",
            found: magic,
        });
    }
    let len = u32::from_be_bytes(buf[16..20].try_into().expect("4 bytes")) as usize;
    if len > 16 * 1024 * 1024 {
        return Err(NbdError::Malformed {
            what: "option reply",
            detail: format!("length {len}"),
        });
    }
    if buf.len() < 20 + len {
        return Ok(None);
    }
    buf.advance(8);
    let option = buf.get_u32();
    let reply_type = buf.get_u32();
    buf.advance(4);
    let data = buf.split_to(len).freeze();
    Ok(Some(OptionReply {
        option,
        reply_type,
        data,
    }))
}

/// Encode a request header (a WRITE's payload follows it).
pub fn encode_request(
    out: &mut BytesMut,
    flags: u16,
    cmd: Command,
    cookie: u64,
    offset: u64,
    length: u32,
) {
    out.put_u32(REQUEST_MAGIC);
    out.put_u16(flags);
    out.put_u16(cmd.to_wire());
    out.put_u64(cookie);
    out.put_u64(offset);
    out.put_u32(length);
}

/// Encode an extended request header (`NBD_OPT_EXTENDED_HEADERS`); with
/// `CMD_FLAG_PAYLOAD_LEN` in `flags`, `length` bytes of payload follow it.
pub fn encode_extended_request(
    out: &mut BytesMut,
    flags: u16,
    cmd: Command,
    cookie: u64,
    offset: u64,
    length: u64,
) {
    out.put_u32(EXTENDED_REQUEST_MAGIC);
    out.put_u16(flags);
    out.put_u16(cmd.to_wire());
    out.put_u64(cookie);
    out.put_u64(offset);
    out.put_u64(length);
}

/// A reply, or one chunk of a structured reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A simple reply; `data` holds a successful READ's bytes.
    Simple {
        cookie: u64,
        error: Option<ErrorCode>,
        data: Bytes,
    },
    /// A structured chunk with its raw payload.
    Chunk {
        cookie: u64,
        flags: u16,
        ty: u16,
        payload: Bytes,
    },
}

impl Reply {
    pub fn cookie(&self) -> u64 {
        match self {
            Reply::Simple { cookie, .. } | Reply::Chunk { cookie, .. } => *cookie,
        }
    }

    /// True for the last message about this cookie.
    pub fn is_final(&self) -> bool {
        match self {
            Reply::Simple { .. } => true,
            Reply::Chunk { flags, .. } => flags & REPLY_FLAG_DONE != 0,
        }
    }

    /// The error carried by this reply or chunk, if any.
    pub fn error(&self) -> Option<ErrorCode> {
        match self {
            Reply::Simple { error, .. } => *error,
            Reply::Chunk { ty, payload, .. } if ty & 0x8000 != 0 => {
                let code = payload
                    .get(..4)
                    .map_or(22, |b| u32::from_be_bytes(b.try_into().expect("4")));
                Some(ErrorCode::from_wire(code).unwrap_or(ErrorCode::Io))
            }
            Reply::Chunk { .. } => None,
        }
    }
}

/// How many bytes the next reply in `buf` needs in total (header plus
/// payload), when its header is already buffered; lets a reader reserve the
/// whole reply at once instead of growing its buffer piece by piece.
pub fn reply_len(buf: &[u8], read_len: impl Fn(u64) -> u32) -> Option<usize> {
    let magic = u32::from_be_bytes(buf.get(..4)?.try_into().ok()?);
    match magic {
        SIMPLE_REPLY_MAGIC if buf.len() >= SIMPLE_REPLY_LEN => {
            let err = u32::from_be_bytes(buf[4..8].try_into().ok()?);
            let cookie = u64::from_be_bytes(buf[8..16].try_into().ok()?);
            Some(
                SIMPLE_REPLY_LEN
                    + if err == 0 {
                        read_len(cookie) as usize
                    } else {
                        0
                    },
            )
        }
        STRUCTURED_REPLY_MAGIC if buf.len() >= STRUCTURED_HEADER_LEN => {
            let len = u32::from_be_bytes(buf[16..20].try_into().ok()?) as usize;
            Some(STRUCTURED_HEADER_LEN + len.min(MAX_CHUNK))
        }
        EXTENDED_REPLY_MAGIC if buf.len() >= EXTENDED_HEADER_LEN => {
            let len = u64::from_be_bytes(buf[24..32].try_into().ok()?);
            Some(EXTENDED_HEADER_LEN + usize::try_from(len).unwrap_or(MAX_CHUNK).min(MAX_CHUNK))
        }
        _ => None,
    }
}

/// The largest chunk payload a reply may carry: a whole READ plus room
/// for its headers.
const MAX_CHUNK: usize = crate::MAX_REQUEST_LEN as usize + 4096;

/// Decode one reply (simple, structured or extended). `read_len(cookie)` tells how many data bytes follow a
/// successful simple reply (the length of that READ, or 0).
pub fn decode_reply(
    buf: &mut BytesMut,
    read_len: impl Fn(u64) -> u32,
) -> Result<Option<Reply>, NbdError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let magic = u32::from_be_bytes(buf[..4].try_into().expect("4 bytes"));
    match magic {
        SIMPLE_REPLY_MAGIC => {
            if buf.len() < SIMPLE_REPLY_LEN {
                return Ok(None);
            }
            let err = u32::from_be_bytes(buf[4..8].try_into().expect("4"));
            let cookie = u64::from_be_bytes(buf[8..16].try_into().expect("8"));
            let n = if err == 0 {
                read_len(cookie) as usize
            } else {
                0
            };
            if buf.len() < SIMPLE_REPLY_LEN + n {
                return Ok(None);
            }
            buf.advance(SIMPLE_REPLY_LEN);
            let data = buf.split_to(n).freeze();
            Ok(Some(Reply::Simple {
                cookie,
                error: ErrorCode::from_wire(err),
                data,
            }))
        }
        STRUCTURED_REPLY_MAGIC | EXTENDED_REPLY_MAGIC => {
            let extended = magic == EXTENDED_REPLY_MAGIC;
            let header = if extended {
                EXTENDED_HEADER_LEN
            } else {
                STRUCTURED_HEADER_LEN
            };
            if buf.len() < header {
                return Ok(None);
            }
            let len = if extended {
                u64::from_be_bytes(buf[24..32].try_into().expect("8"))
            } else {
                u64::from(u32::from_be_bytes(buf[16..20].try_into().expect("4")))
            };
            let len = match usize::try_from(len) {
                Ok(l) if l <= MAX_CHUNK => l,
                _ => {
                    return Err(NbdError::Malformed {
                        what: "structured reply",
                        detail: format!("chunk length {len}"),
                    })
                }
            };
            if buf.len() < header + len {
                return Ok(None);
            }
            buf.advance(4);
            let flags = buf.get_u16();
            let ty = buf.get_u16();
            let cookie = buf.get_u64();
            buf.advance(header - 16);
            let payload = buf.split_to(len).freeze();
            Ok(Some(Reply::Chunk {
                cookie,
                flags,
                ty,
                payload,
            }))
        }
        other => Err(NbdError::BadMagic {
            what: "reply",
            found: u64::from(other),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::{ReplyStyle, ReplyTo};

    fn to(style: ReplyStyle, cookie: u64, command: Command) -> ReplyTo {
        ReplyTo {
            style,
            cookie,
            offset: 4096,
            command,
        }
    }

    #[test]
    fn reply_round_trips() {
        let mut b = BytesMut::new();
        to(ReplyStyle::Simple, 5, Command::Read).read_header(&mut b, 4);
        b.extend_from_slice(b"data");
        to(ReplyStyle::Simple, 6, Command::Write).error(&mut b, ErrorCode::NoSpc, "full");
        to(ReplyStyle::Structured, 7, Command::Read).read_header(&mut b, 3);
        b.extend_from_slice(b"xyz");
        to(ReplyStyle::Structured, 8, Command::Read).error(&mut b, ErrorCode::Io, "disk on fire");
        let bs = to(ReplyStyle::Structured, 9, Command::BlockStatus);
        bs.block_status(&mut b, 1, &[(4096, 3), (512, 0)]);
        bs.done(&mut b);
        let lens = |c: u64| if c == 5 { 4 } else { 0 };
        let r = decode_reply(&mut b, lens).unwrap().unwrap();
        assert_eq!(
            r,
            Reply::Simple {
                cookie: 5,
                error: None,
                data: Bytes::from_static(b"data")
            }
        );
        let r = decode_reply(&mut b, lens).unwrap().unwrap();
        assert_eq!(r.error(), Some(ErrorCode::NoSpc));
        let r = decode_reply(&mut b, lens).unwrap().unwrap();
        let Reply::Chunk { ty, payload, .. } = &r else {
            panic!()
        };
        assert_eq!(*ty, REPLY_TYPE_OFFSET_DATA);
        assert_eq!(&payload[8..], b"xyz");
        let r = decode_reply(&mut b, lens).unwrap().unwrap();
        assert_eq!(r.error(), Some(ErrorCode::Io));
        assert!(r.is_final());
        let r = decode_reply(&mut b, lens).unwrap().unwrap();
        let Reply::Chunk { payload, .. } = &r else {
            panic!()
        };
        assert_eq!(payload.len(), 4 + 16);
        assert!(decode_reply(&mut b, lens).unwrap().unwrap().is_final());
        assert!(b.is_empty());
    }

    #[test]
    fn extended_replies_decode_as_chunks() {
        let mut b = BytesMut::new();
        let r = to(ReplyStyle::Extended, 3, Command::Read);
        r.read_header(&mut b, 3);
        b.extend_from_slice(b"abc");
        to(ReplyStyle::Extended, 4, Command::Write).ok(&mut b);
        to(ReplyStyle::Extended, 5, Command::Trim).error(&mut b, ErrorCode::NoSpc, "full");
        assert_eq!(reply_len(&b, |_| 0), Some(EXTENDED_HEADER_LEN + 11));
        let r = decode_reply(&mut b, |_| 0).unwrap().unwrap();
        let Reply::Chunk { ty, payload, .. } = &r else {
            panic!()
        };
        assert_eq!((*ty, &payload[8..]), (REPLY_TYPE_OFFSET_DATA, &b"abc"[..]));
        let r = decode_reply(&mut b, |_| 0).unwrap().unwrap();
        assert_eq!((r.cookie(), r.is_final(), r.error()), (4, true, None));
        let r = decode_reply(&mut b, |_| 0).unwrap().unwrap();
        assert_eq!((r.cookie(), r.error()), (5, Some(ErrorCode::NoSpc)));
        assert!(b.is_empty());
    }
}
