//! Transmission-phase requests: a streaming decoder and a validator.
//!
//! The decoder yields whole requests (a WRITE with its payload). Compact
//! headers (28 bytes, 32-bit length) are the default; after
//! `NBD_OPT_EXTENDED_HEADERS` the connection switches to extended headers
//! (32 bytes, 64-bit length; a WRITE's length is its payload, another
//! command has a payload only with `NBD_CMD_FLAG_PAYLOAD_LEN`). A WRITE
//! whose length exceeds [`MAX_REQUEST_LEN`] is yielded without payload and
//! its bytes are skipped afterwards, so the stream stays in step and the
//! client gets an error reply instead of a dropped connection; another
//! command's payload that large ends the connection (proto.md: the server
//! SHOULD disconnect).
//! [`validate`] decides, before any I/O, which errno a request earns.

use crate::consts::*;
use crate::error::{ErrorCode, NbdError};
use crate::MAX_REQUEST_LEN;
use bytes::{Buf, Bytes, BytesMut};

/// An NBD command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Resize,
    Unknown(u16),
}

impl Command {
    pub fn from_wire(v: u16) -> Command {
        match v {
            CMD_READ => Command::Read,
            CMD_WRITE => Command::Write,
            CMD_DISC => Command::Disc,
            CMD_FLUSH => Command::Flush,
            CMD_TRIM => Command::Trim,
            CMD_CACHE => Command::Cache,
            CMD_WRITE_ZEROES => Command::WriteZeroes,
            CMD_BLOCK_STATUS => Command::BlockStatus,
            CMD_RESIZE => Command::Resize,
            other => Command::Unknown(other),
        }
    }

    pub fn to_wire(self) -> u16 {
        match self {
            Command::Read => CMD_READ,
            Command::Write => CMD_WRITE,
            Command::Disc => CMD_DISC,
            Command::Flush => CMD_FLUSH,
            Command::Trim => CMD_TRIM,
            Command::Cache => CMD_CACHE,
            Command::WriteZeroes => CMD_WRITE_ZEROES,
            Command::BlockStatus => CMD_BLOCK_STATUS,
            Command::Resize => CMD_RESIZE,
            Command::Unknown(v) => v,
        }
    }

    /// A short lowercase name, used as a metrics label.
    pub fn name(self) -> &'static str {
        match self {
            Command::Read => "read",
            Command::Write => "write",
            Command::Disc => "disc",
            Command::Flush => "flush",
            Command::Trim => "trim",
            Command::Cache => "cache",
            Command::WriteZeroes => "write_zeroes",
            Command::BlockStatus => "block_status",
            Command::Resize => "resize",
            Command::Unknown(_) => "unknown",
        }
    }
}

/// One decoded request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    /// The payload length of a WRITE, else the effect length (64 bits
    /// only with extended headers).
    pub length: u64,
    /// The payload: a WRITE's data, or (extended headers) whatever a
    /// request with `NBD_CMD_FLAG_PAYLOAD_LEN` carried. `None` without one,
    /// and for a compact WRITE over the size limit (whose data the decoder
    /// skips).
    pub payload: Option<Bytes>,
}

impl Request {
    pub fn has_flag(&self, f: u16) -> bool {
        self.flags & f != 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Header,
    Payload {
        flags: u16,
        command: Command,
        cookie: u64,
        offset: u64,
        length: u32,
    },
    Discard {
        remaining: u64,
    },
}

/// Streaming request decoder (like mini-redis' frame parser: `Ok(None)` means
/// "incomplete, read more").
#[derive(Debug)]
pub struct RequestDecoder {
    state: State,
    extended: bool,
}

impl Default for RequestDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl RequestDecoder {
    /// A decoder of compact headers.
    pub fn new() -> Self {
        Self::with_headers(false)
    }

    /// A decoder of extended headers (`NBD_OPT_EXTENDED_HEADERS` was
    /// acked) or compact ones.
    pub fn with_headers(extended: bool) -> Self {
        RequestDecoder {
            state: State::Header,
            extended,
        }
    }

    fn header_len(&self) -> usize {
        if self.extended {
            EXTENDED_REQUEST_HEADER_LEN
        } else {
            REQUEST_HEADER_LEN
        }
    }

    /// How many more bytes the decoder wants before it can make progress (a
    /// hint for buffer sizing).
    pub fn wanted(&self, buffered: usize) -> usize {
        match self.state {
            State::Header => self.header_len().saturating_sub(buffered),
            State::Payload { length, .. } => (length as usize).saturating_sub(buffered),
            State::Discard { .. } => 0,
        }
    }

    /// The length of the WRITE payload the decoder is waiting for, once
    /// its header has been decoded (a caller may read a large payload
    /// straight into a buffer of that size instead of growing its own).
    pub fn pending_payload(&self) -> Option<usize> {
        match self.state {
            State::Payload { length, .. } => usize::try_from(length).ok(),
            _ => None,
        }
    }

    /// Complete the WRITE whose payload the caller read itself (exactly
    /// [`RequestDecoder::pending_payload`] bytes).
    pub fn complete_payload(&mut self, payload: Bytes) -> Result<Request, NbdError> {
        let len = payload.len();
        match self.state {
            State::Payload { length, .. } if len == length as usize => self.finish_payload(payload),
            _ => None,
        }
        .ok_or_else(|| NbdError::Malformed {
            what: "write payload",
            detail: format!("{len} bytes for a request that does not wait for them"),
        })
    }

    /// The request whose header was decoded, with its whole payload; the
    /// decoder then waits for the next header. `None` outside the payload
    /// state.
    fn finish_payload(&mut self, payload: Bytes) -> Option<Request> {
        let State::Payload {
            flags,
            command,
            cookie,
            offset,
            length,
        } = self.state
        else {
            return None;
        };
        self.state = State::Header;
        Some(Request {
            flags,
            command,
            cookie,
            offset,
            length: u64::from(length),
            payload: Some(payload),
        })
    }

    /// After a WRITE's header: wait for its payload, or (over the size
    /// limit) yield it without one and skip its bytes. `None`: the payload
    /// is still to come.
    fn write_payload(&mut self, req: Request) -> Option<Request> {
        match u32::try_from(req.length) {
            Ok(length) if length <= MAX_REQUEST_LEN => {
                self.state = State::Payload {
                    flags: req.flags,
                    command: req.command,
                    cookie: req.cookie,
                    offset: req.offset,
                    length,
                };
                None
            }
            _ => {
                self.state = State::Discard {
                    remaining: req.length,
                };
                Some(req)
            }
        }
    }

    /// Decode the next request from `buf`.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Request>, NbdError> {
        loop {
            match self.state {
                State::Discard { remaining } => {
                    let n = remaining.min(buf.len() as u64);
                    buf.advance(usize::try_from(n).unwrap_or(usize::MAX));
                    if n < remaining {
                        self.state = State::Discard {
                            remaining: remaining - n,
                        };
                        return Ok(None);
                    }
                    self.state = State::Header;
                }
                State::Payload { length, .. } => {
                    if buf.len() < length as usize {
                        return Ok(None);
                    }
                    let payload = buf.split_to(length as usize).freeze();
                    return Ok(self.finish_payload(payload));
                }
                State::Header => {
                    if buf.len() < self.header_len() {
                        return Ok(None);
                    }
                    let magic = buf.get_u32();
                    let expected = if self.extended {
                        EXTENDED_REQUEST_MAGIC
                    } else {
                        REQUEST_MAGIC
                    };
                    if magic != expected {
                        return Err(NbdError::BadMagic {
                            what: if self.extended {
                                "extended request"
                            } else {
                                "request"
                            },
                            found: u64::from(magic),
                        });
                    }
                    let flags = buf.get_u16();
                    let command = Command::from_wire(buf.get_u16());
                    let cookie = buf.get_u64();
                    let offset = buf.get_u64();
                    let request = |length: u64| Request {
                        flags,
                        command,
                        cookie,
                        offset,
                        length,
                        payload: None,
                    };
                    let length = if self.extended {
                        buf.get_u64()
                    } else {
                        u64::from(buf.get_u32())
                    };
                    if command == Command::Write {
                        // A WRITE's length is its payload, with or without
                        // the flag (QEMU 10 sends it without).
                        match self.write_payload(request(length)) {
                            Some(oversized) => return Ok(Some(oversized)),
                            None => continue,
                        }
                    }
                    if self.extended {
                        // Another command has a payload only with the flag.
                        if flags & CMD_FLAG_PAYLOAD_LEN == 0 {
                            return Ok(Some(request(length)));
                        }
                        let Some(length) =
                            u32::try_from(length).ok().filter(|l| *l <= MAX_REQUEST_LEN)
                        else {
                            return Err(NbdError::Malformed {
                                what: "extended request",
                                detail: format!(
                                    "payload of {length} bytes exceeds the {MAX_REQUEST_LEN} byte limit"
                                ),
                            });
                        };
                        self.state = State::Payload {
                            flags,
                            command,
                            cookie,
                            offset,
                            length,
                        };
                        continue;
                    }
                    return Ok(Some(request(length)));
                }
            }
        }
    }
}

/// What the validator needs to know about the negotiated export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransmissionLimits {
    pub size: u64,
    pub read_only: bool,
    /// Structured replies or extended headers were negotiated.
    pub structured: bool,
    /// Extended headers were negotiated (64-bit lengths, payload flag).
    pub extended: bool,
    /// At least one meta context was selected.
    pub has_meta_contexts: bool,
    /// Requests must be aligned to this (1 = no constraint).
    pub min_block: u32,
    /// `NBD_FLAG_SEND_RESIZE` was advertised.
    pub resizable: bool,
}

/// Decide, before any I/O, whether a request may run; `Err` is the errno to
/// answer with. Flags, read-only, bounds, size and alignment are all checked
/// here so that the executor can trust what it is handed.
pub fn validate(req: &Request, lim: &TransmissionLimits) -> Result<(), ErrorCode> {
    let mut allowed_flags = match req.command {
        Command::Read => CMD_FLAG_FUA | CMD_FLAG_DF,
        Command::Write | Command::Trim | Command::Cache | Command::Flush | Command::Disc => {
            CMD_FLAG_FUA
        }
        Command::WriteZeroes => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
        Command::BlockStatus => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
        Command::Resize if lim.resizable => 0,
        Command::Resize => return Err(ErrorCode::NotSup),
        Command::Unknown(_) => return Err(ErrorCode::Inval),
    };
    if lim.extended && req.command == Command::Write {
        // A WRITE may say that its length is its payload (it always is);
        // no other command has a payload form here.
        allowed_flags |= CMD_FLAG_PAYLOAD_LEN;
    }
    if req.flags & !allowed_flags != 0 {
        return Err(ErrorCode::Inval);
    }
    if req.has_flag(CMD_FLAG_DF) && !lim.structured {
        return Err(ErrorCode::Inval);
    }
    let writes = matches!(
        req.command,
        Command::Write | Command::Trim | Command::WriteZeroes | Command::Resize
    );
    if writes && lim.read_only {
        return Err(ErrorCode::Perm);
    }
    if matches!(
        req.command,
        Command::Flush | Command::Disc | Command::Resize
    ) {
        // RESIZE: the new size travels in the offset field; the volume
        // checks it.
        return Ok(());
    }
    if matches!(req.command, Command::Read | Command::Write)
        && req.length > u64::from(MAX_REQUEST_LEN)
    {
        return Err(ErrorCode::Inval);
    }
    if req.command == Command::Write
        && req.payload.as_ref().map(|p| p.len() as u64) != Some(req.length)
    {
        return Err(ErrorCode::Inval);
    }
    if req.length == 0 {
        return Err(ErrorCode::Inval);
    }
    let end = req.offset.checked_add(req.length);
    if end.is_none_or(|e| e > lim.size) {
        return Err(
            if matches!(req.command, Command::Write | Command::WriteZeroes) {
                ErrorCode::NoSpc
            } else {
                ErrorCode::Inval
            },
        );
    }
    if lim.min_block > 1
        && req.command != Command::BlockStatus
        && (!req.offset.is_multiple_of(u64::from(lim.min_block))
            || !req.length.is_multiple_of(u64::from(lim.min_block)))
    {
        return Err(ErrorCode::Inval);
    }
    if req.command == Command::BlockStatus && (!lim.structured || !lim.has_meta_contexts) {
        return Err(ErrorCode::Inval);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{encode_extended_request, encode_request};

    fn lim() -> TransmissionLimits {
        TransmissionLimits {
            size: 1 << 20,
            read_only: false,
            structured: true,
            extended: false,
            has_meta_contexts: true,
            min_block: 1,
            resizable: false,
        }
    }

    fn req(command: Command, flags: u16, offset: u64, length: u64) -> Request {
        Request {
            flags,
            command,
            cookie: 7,
            offset,
            length,
            payload: (command == Command::Write)
                .then(|| Bytes::from(vec![0u8; usize::try_from(length).unwrap()])),
        }
    }

    /// Every request in `wire`, fed to a decoder in two pieces cut at
    /// `split`.
    fn decode_split(wire: &[u8], split: usize, extended: bool) -> Vec<Request> {
        let mut d = RequestDecoder::with_headers(extended);
        let mut b = BytesMut::from(&wire[..split]);
        let mut got = vec![];
        while let Some(r) = d.decode(&mut b).unwrap() {
            got.push(r);
        }
        b.extend_from_slice(&wire[split..]);
        while let Some(r) = d.decode(&mut b).unwrap() {
            got.push(r);
        }
        got
    }

    #[test]
    fn decodes_write_with_payload_across_splits() {
        let mut wire = BytesMut::new();
        encode_request(&mut wire, 0, Command::Write, 9, 4096, 8);
        wire.extend_from_slice(b"abcdefgh");
        encode_request(&mut wire, 0, Command::Read, 10, 0, 512);
        for split in 0..wire.len() {
            let got = decode_split(&wire, split, false);
            assert_eq!(got.len(), 2, "split {split}");
            assert_eq!(got[0].payload.as_deref(), Some(&b"abcdefgh"[..]));
            assert_eq!(got[1].command, Command::Read);
        }
    }

    #[test]
    fn a_payload_read_by_the_caller_completes_its_write() {
        let mut wire = BytesMut::new();
        encode_request(&mut wire, 1, Command::Write, 9, 4096, 8);
        let mut d = RequestDecoder::new();
        // Nothing pending before a header, and a payload then is refused.
        assert_eq!(d.pending_payload(), None);
        assert!(d.complete_payload(Bytes::from_static(b"x")).is_err());
        assert!(d.decode(&mut wire).unwrap().is_none());
        assert_eq!(d.pending_payload(), Some(8));
        // A payload of the wrong length is refused and changes nothing.
        assert!(d.complete_payload(Bytes::from_static(b"short")).is_err());
        let r = d.complete_payload(Bytes::from_static(b"abcdefgh")).unwrap();
        assert_eq!(
            (r.command, r.cookie, r.offset, r.flags),
            (Command::Write, 9, 4096, 1)
        );
        assert_eq!(r.payload.as_deref(), Some(&b"abcdefgh"[..]));
        assert_eq!(d.pending_payload(), None);
        encode_request(&mut wire, 0, Command::Flush, 10, 0, 0);
        assert_eq!(
            d.decode(&mut wire).unwrap().unwrap().command,
            Command::Flush
        );
    }

    #[test]
    fn oversized_write_is_reported_then_skipped() {
        let mut wire = BytesMut::new();
        let len = MAX_REQUEST_LEN + 1;
        encode_request(&mut wire, 0, Command::Write, 1, 0, len);
        wire.extend_from_slice(&vec![0xaa; len as usize]);
        encode_request(&mut wire, 0, Command::Flush, 2, 0, 0);
        let mut d = RequestDecoder::new();
        let r = d.decode(&mut wire).unwrap().unwrap();
        assert_eq!(r.payload, None);
        assert_eq!(validate(&r, &lim()), Err(ErrorCode::Inval));
        let r = d.decode(&mut wire).unwrap().unwrap();
        assert_eq!(r.command, Command::Flush);
    }

    #[test]
    fn bad_magic_is_fatal() {
        let mut b = BytesMut::from(&[0u8; 28][..]);
        assert!(RequestDecoder::new().decode(&mut b).is_err());
    }

    #[test]
    fn validation_answers() {
        let l = lim();
        assert_eq!(validate(&req(Command::Read, 0, 0, 512), &l), Ok(()));
        assert_eq!(
            validate(&req(Command::Read, 0, (1 << 20) - 1, 2), &l),
            Err(ErrorCode::Inval)
        );
        assert_eq!(
            validate(&req(Command::Write, 0, (1 << 20) - 1, 2), &l),
            Err(ErrorCode::NoSpc)
        );
        assert_eq!(
            validate(&req(Command::WriteZeroes, 0, u64::MAX, 2), &l),
            Err(ErrorCode::NoSpc)
        );
        assert_eq!(
            validate(&req(Command::Unknown(77), 0, 0, 1), &l),
            Err(ErrorCode::Inval)
        );
        assert_eq!(
            validate(&req(Command::Read, CMD_FLAG_NO_HOLE, 0, 1), &l),
            Err(ErrorCode::Inval)
        );
        assert_eq!(
            validate(&req(Command::Read, 0x8000, 0, 1), &l),
            Err(ErrorCode::Inval)
        );
        assert_eq!(
            validate(&req(Command::Read, 0, 0, 0), &l),
            Err(ErrorCode::Inval)
        );
        assert_eq!(validate(&req(Command::Flush, 0, 0, 0), &l), Ok(()));
        assert_eq!(
            validate(&req(Command::Resize, 0, 0, 0), &l),
            Err(ErrorCode::NotSup)
        );
        let ro = TransmissionLimits {
            read_only: true,
            ..l
        };
        assert_eq!(
            validate(&req(Command::Write, 0, 0, 1), &ro),
            Err(ErrorCode::Perm)
        );
        assert_eq!(
            validate(&req(Command::Trim, 0, 0, 1), &ro),
            Err(ErrorCode::Perm)
        );
        assert_eq!(validate(&req(Command::Read, 0, 0, 1), &ro), Ok(()));
        let simple = TransmissionLimits {
            structured: false,
            has_meta_contexts: false,
            ..l
        };
        assert_eq!(
            validate(&req(Command::BlockStatus, 0, 0, 1), &simple),
            Err(ErrorCode::Inval)
        );
        assert_eq!(
            validate(&req(Command::Read, CMD_FLAG_DF, 0, 1), &simple),
            Err(ErrorCode::Inval)
        );
        let aligned = TransmissionLimits {
            min_block: 512,
            ..l
        };
        assert_eq!(
            validate(&req(Command::Read, 0, 1, 512), &aligned),
            Err(ErrorCode::Inval)
        );
        assert_eq!(validate(&req(Command::Read, 0, 512, 512), &aligned), Ok(()));
        let resizable = TransmissionLimits {
            resizable: true,
            ..l
        };
        assert_eq!(
            validate(&req(Command::Resize, 0, 1 << 30, 0), &resizable),
            Ok(())
        );
        assert_eq!(
            validate(&req(Command::Resize, CMD_FLAG_FUA, 1 << 30, 0), &resizable),
            Err(ErrorCode::Inval)
        );
        assert_eq!(
            validate(
                &req(Command::Resize, 0, 1 << 30, 0),
                &TransmissionLimits {
                    read_only: true,
                    ..resizable
                }
            ),
            Err(ErrorCode::Perm)
        );
    }

    fn ext() -> TransmissionLimits {
        TransmissionLimits {
            size: 1 << 50,
            extended: true,
            ..lim()
        }
    }

    #[test]
    fn extended_headers_carry_64_bit_effect_lengths_and_flagged_payloads() {
        let mut wire = BytesMut::new();
        encode_extended_request(&mut wire, CMD_FLAG_PAYLOAD_LEN, Command::Write, 1, 8192, 4);
        wire.extend_from_slice(b"wxyz");
        encode_extended_request(&mut wire, 0, Command::Trim, 2, 0, 5 << 40);
        // A payload on a command without a payload form is consumed,
        // then refused.
        encode_extended_request(
            &mut wire,
            CMD_FLAG_PAYLOAD_LEN,
            Command::BlockStatus,
            3,
            0,
            12,
        );
        wire.extend_from_slice(&[7u8; 12]);
        // QEMU 10 sends WRITEs without the flag: the length is the payload.
        encode_extended_request(&mut wire, CMD_FLAG_FUA, Command::Write, 4, 0, 3);
        wire.extend_from_slice(b"abc");
        encode_extended_request(&mut wire, 0, Command::Flush, 5, 0, 0);
        for split in 0..wire.len() {
            let got = decode_split(&wire, split, true);
            assert_eq!(got.len(), 5, "split {split}");
            assert_eq!(got[0].payload.as_deref(), Some(&b"wxyz"[..]));
            assert_eq!(validate(&got[0], &ext()), Ok(()));
            assert_eq!((got[1].length, got[1].payload.clone()), (5 << 40, None));
            assert_eq!(validate(&got[1], &ext()), Ok(()));
            assert_eq!(got[2].payload.as_ref().map(|p| p.len()), Some(12));
            assert_eq!(validate(&got[2], &ext()), Err(ErrorCode::Inval));
            assert_eq!(got[3].payload.as_deref(), Some(&b"abc"[..]));
            assert_eq!(validate(&got[3], &ext()), Ok(()));
            assert_eq!(got[4].command, Command::Flush);
        }
    }

    #[test]
    fn extended_headers_refuse_compact_magic_and_huge_payloads() {
        // An oversized WRITE is answered, and its bytes skipped.
        let mut wire = BytesMut::new();
        let big = u64::from(MAX_REQUEST_LEN) + 1;
        encode_extended_request(&mut wire, 0, Command::Write, 1, 0, big);
        wire.extend_from_slice(&vec![0xaa; usize::try_from(big).unwrap()]);
        encode_extended_request(&mut wire, 0, Command::Flush, 2, 0, 0);
        let mut d = RequestDecoder::with_headers(true);
        let r = d.decode(&mut wire).unwrap().unwrap();
        assert_eq!(validate(&r, &ext()), Err(ErrorCode::Inval));
        assert_eq!(r.payload, None);
        assert_eq!(
            d.decode(&mut wire).unwrap().unwrap().command,
            Command::Flush
        );

        let mut wire = BytesMut::new();
        encode_request(&mut wire, 0, Command::Read, 1, 0, 512);
        wire.extend_from_slice(&[0u8; 4]);
        assert!(matches!(
            RequestDecoder::with_headers(true).decode(&mut wire),
            Err(NbdError::BadMagic { .. })
        ));
        let mut wire = BytesMut::new();
        let big = u64::from(MAX_REQUEST_LEN) + 1;
        encode_extended_request(&mut wire, CMD_FLAG_PAYLOAD_LEN, Command::Cache, 1, 0, big);
        assert!(matches!(
            RequestDecoder::with_headers(true).decode(&mut wire),
            Err(NbdError::Malformed { .. })
        ));
        // The flag is not a compact-header flag.
        let r = req(Command::Write, CMD_FLAG_PAYLOAD_LEN, 0, 1);
        assert_eq!(validate(&r, &lim()), Err(ErrorCode::Inval));
        // READs stay within the payload limit; 64-bit effect lengths are
        // checked against the size.
        assert_eq!(
            validate(&req(Command::Read, 0, 0, 1 << 33), &ext()),
            Err(ErrorCode::Inval)
        );
        assert_eq!(
            validate(&req(Command::WriteZeroes, 0, 1, 1 << 50), &ext()),
            Err(ErrorCode::NoSpc)
        );
        assert_eq!(
            validate(&req(Command::BlockStatus, 0, 0, 1 << 49), &ext()),
            Ok(())
        );
    }

    proptest::proptest! {
        #[test]
        fn decoder_never_panics(data in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            for extended in [false, true] {
                let mut d = RequestDecoder::with_headers(extended);
                let mut b = BytesMut::from(&data[..]);
                while let Ok(Some(r)) = d.decode(&mut b) {
                    let _ = validate(&r, &TransmissionLimits { extended, ..lim() });
                }
            }
        }
    }
}
