//! Server side of the fixed-newstyle handshake as a pure state machine.
//!
//! States: `ClientFlags` -> `Options` (any number of options, each answered)
//! -> `Finished` (after `NBD_OPT_GO`, `NBD_OPT_EXPORT_NAME` or `NBD_OPT_ABORT`).
//! The machine reads from an input buffer and appends replies to an output
//! buffer; what the exports are is asked of an [`ExportCatalog`], so the policy
//! stays with the daemon and the parsing stays here.
//!
//! TLS (`NBD_OPT_STARTTLS`) is the caller's to run: the machine acks the
//! option and says [`HandshakeProgress::StartTls`]; the caller sends the
//! ack, runs the TLS handshake on the socket, calls
//! [`ServerHandshake::tls_started`] and goes on feeding what it decrypts.
//! [`TlsMode`] is the server's mode for one connection (proto.md "TLS
//! support": NOTLS, FORCEDTLS, or SELECTIVETLS with no TLS-only export).

use crate::consts::*;
use crate::error::NbdError;
use crate::reply::ReplyStyle;
use crate::{BASE_ALLOCATION, BASE_ALLOCATION_ID, DIRTY_BITMAP_ID_BASE, DIRTY_BITMAP_PREFIX};
use bytes::{Buf, BufMut, BytesMut};

/// Largest option payload accepted. Longer options are answered
/// `NBD_REP_ERR_TOO_BIG` and their data skipped.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;
/// A client that sends more options than this is dropped (no endless loops).
pub const MAX_OPTIONS: usize = 4096;

/// What the daemon tells the handshake about one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
    pub size: u64,
    pub read_only: bool,
    pub min_block: u32,
    pub preferred_block: u32,
    pub max_block: u32,
    /// The client must negotiate `NBD_INFO_BLOCK_SIZE` (for example O_DIRECT
    /// volumes, which cannot serve unaligned requests).
    pub block_size_required: bool,
    /// Names of the dirty bitmaps offered as `ferry:dirty-bitmap:<name>`.
    pub dirty_bitmaps: Vec<String>,
    /// `NBD_CMD_RESIZE` is served (advertised on writable exports only).
    pub resizable: bool,
}

impl ExportInfo {
    /// Transmission flags for this export, given whether structured replies
    /// (or extended headers) were negotiated.
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        let mut f = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_CAN_MULTI_CONN | FLAG_SEND_CACHE;
        if self.read_only {
            f |= FLAG_READ_ONLY;
        } else {
            f |= FLAG_SEND_FUA | FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FAST_ZERO;
            if self.resizable {
                f |= FLAG_SEND_RESIZE;
            }
        }
        if structured {
            f |= FLAG_SEND_DF;
        }
        f
    }
}

/// The daemon's view of its exports, consulted during negotiation.
pub trait ExportCatalog {
    /// The export with this name, if any. The empty name means the default
    /// export, if the daemon has one.
    fn export(&self, name: &str) -> Option<ExportInfo>;
    /// All exports, for `NBD_OPT_LIST`.
    fn exports(&self) -> Vec<ExportInfo>;
    /// Where an export that is no longer here went (`HOST:PORT` of its new
    /// NBD server), if it moved. Answered as an unknown export whose message
    /// starts with [`MOVED_PREFIX`], so agents such as `ferry host` follow it.
    fn moved(&self, _name: &str) -> Option<String> {
        None
    }
}

/// Start of the error message for an export that moved; the new `HOST:PORT`
/// follows it.
pub const MOVED_PREFIX: &str = "ferry: export moved to ";

fn unknown_export_message(catalog: &dyn ExportCatalog, name: &str) -> String {
    match catalog.moved(name) {
        Some(to) => format!("{MOVED_PREFIX}{to}"),
        None => format!("no export named {name:?}"),
    }
}

/// A metadata context selected with `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaContext {
    BaseAllocation,
    /// `ferry:dirty-bitmap:<name>` with its index in the export's list.
    DirtyBitmap {
        name: String,
        id: u32,
    },
}

impl MetaContext {
    pub fn id(&self) -> u32 {
        match self {
            MetaContext::BaseAllocation => BASE_ALLOCATION_ID,
            MetaContext::DirtyBitmap { id, .. } => *id,
        }
    }

    pub fn wire_name(&self) -> String {
        match self {
            MetaContext::BaseAllocation => BASE_ALLOCATION.to_string(),
            MetaContext::DirtyBitmap { name, .. } => format!("{DIRTY_BITMAP_PREFIX}{name}"),
        }
    }
}

/// The outcome of a successful handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub export: ExportInfo,
    /// Structured replies were negotiated (also true with extended headers,
    /// which include them).
    pub structured_replies: bool,
    /// Extended headers were negotiated: 32-byte requests and replies.
    pub extended_headers: bool,
    pub meta_contexts: Vec<MetaContext>,
    /// Transmission flags sent to the client.
    pub flags: u16,
    /// The connection runs over TLS: replies are encrypted on their way
    /// out, so none can be sent from a file by the kernel.
    pub tls: bool,
}

impl Negotiated {
    /// How this connection's replies are framed.
    pub fn reply_style(&self) -> ReplyStyle {
        ReplyStyle::negotiated(self.structured_replies, self.extended_headers)
    }

    /// What [`crate::validate`] checks requests against, for an export of
    /// `size` bytes now.
    pub fn limits(&self, size: u64, read_only: bool) -> crate::TransmissionLimits {
        crate::TransmissionLimits {
            size,
            read_only,
            structured: self.structured_replies,
            extended: self.extended_headers,
            has_meta_contexts: !self.meta_contexts.is_empty(),
            min_block: self.export.min_block,
            resizable: self.flags & FLAG_SEND_RESIZE != 0,
        }
    }
}

/// How a connection treats TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// No TLS: `NBD_OPT_STARTTLS` is answered `NBD_REP_ERR_UNSUP`.
    #[default]
    Off,
    /// TLS at the client's choice (proto.md's SELECTIVETLS with no
    /// TLS-only export), e.g. for loopback clients of a TLS server.
    Optional,
    /// Every option but STARTTLS and ABORT is answered
    /// `NBD_REP_ERR_TLS_REQD` until TLS runs; `NBD_OPT_EXPORT_NAME` before
    /// it closes the connection (proto.md's FORCEDTLS).
    Forced,
}

/// Where the handshake stands after consuming input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HandshakeProgress {
    /// More input is needed; send what was written to the output first.
    NeedMore,
    /// The client asked for TLS and was told yes: send the output, run the
    /// TLS handshake as the server, call [`ServerHandshake::tls_started`],
    /// then feed what comes over TLS.
    StartTls,
    /// Transmission begins (after the output is sent).
    Done(Box<Negotiated>),
    /// The client aborted or the handshake ended without an export; close
    /// after sending the output.
    Aborted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    ClientFlags,
    Options,
    Discard { option: u32, remaining: u32 },
    Finished,
}

/// The server half of the fixed-newstyle handshake.
#[derive(Debug)]
pub struct ServerHandshake {
    state: State,
    tls: TlsMode,
    tls_on: bool,
    no_zeroes: bool,
    structured: bool,
    /// The server offers `NBD_OPT_EXTENDED_HEADERS`.
    offer_extended: bool,
    extended: bool,
    options_seen: usize,
    /// Contexts chosen by SET_META_CONTEXT, and the export they were chosen for.
    selected: Option<(String, Vec<MetaContext>)>,
}

impl Default for ServerHandshake {
    fn default() -> Self {
        Self::new()
    }
}

impl ServerHandshake {
    pub fn new() -> Self {
        Self::with_tls(TlsMode::Off)
    }

    /// A handshake whose connection treats TLS as `tls` says.
    pub fn with_tls(tls: TlsMode) -> Self {
        ServerHandshake {
            state: State::ClientFlags,
            tls,
            tls_on: false,
            no_zeroes: false,
            structured: false,
            offer_extended: false,
            extended: false,
            options_seen: 0,
            selected: None,
        }
    }

    /// Offer extended headers (`NBD_OPT_EXTENDED_HEADERS`) to clients
    /// that ask; without this they are answered `NBD_REP_ERR_UNSUP` and
    /// the connection stays compact.
    pub fn offer_extended_headers(mut self, offer: bool) -> Self {
        self.offer_extended = offer;
        self
    }

    /// Structured replies or extended headers were negotiated, so replies
    /// may carry chunks (and meta contexts may be chosen).
    fn chunks(&self) -> bool {
        self.structured || self.extended
    }

    /// The TLS handshake the last [`HandshakeProgress::StartTls`] asked for
    /// succeeded: what was negotiated in clear is forgotten (proto.md), and
    /// options go on over TLS.
    pub fn tls_started(&mut self) {
        self.tls_on = true;
        self.structured = false;
        self.extended = false;
        self.selected = None;
    }

    /// Whether TLS runs on this connection.
    pub fn tls_on(&self) -> bool {
        self.tls_on
    }

    /// The server's first 18 bytes.
    pub fn greeting() -> [u8; 18] {
        let mut b = [0u8; 18];
        b[..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
        b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[16..].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        b
    }

    /// Consume as much of `input` as forms whole messages, appending replies
    /// to `out`.
    pub fn feed(
        &mut self,
        input: &mut BytesMut,
        catalog: &dyn ExportCatalog,
        out: &mut BytesMut,
    ) -> Result<HandshakeProgress, NbdError> {
        loop {
            match self.state {
                State::Finished => return Ok(HandshakeProgress::Aborted),
                State::ClientFlags => {
                    if input.len() < 4 {
                        return Ok(HandshakeProgress::NeedMore);
                    }
                    let flags = input.get_u32();
                    if flags & FLAG_C_FIXED_NEWSTYLE == 0 {
                        return Err(NbdError::NotFixedNewstyle(flags));
                    }
                    if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                        return Err(NbdError::UnknownClientFlags(flags));
                    }
                    self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                    self.state = State::Options;
                }
                State::Discard { option, remaining } => {
                    let n = remaining.min(u32::try_from(input.len()).unwrap_or(u32::MAX));
                    input.advance(n as usize);
                    if n < remaining {
                        self.state = State::Discard {
                            option,
                            remaining: remaining - n,
                        };
                        return Ok(HandshakeProgress::NeedMore);
                    }
                    error_reply(out, option, REP_ERR_TOO_BIG, "option data too long");
                    self.state = State::Options;
                }
                State::Options => {
                    if input.len() < 16 {
                        return Ok(HandshakeProgress::NeedMore);
                    }
                    let magic = u64::from_be_bytes(input[..8].try_into().expect("8 bytes"));
                    if magic != IHAVEOPT {
                        return Err(NbdError::BadMagic {
                            what: "option request",
                            found: magic,
                        });
                    }
                    let option = u32::from_be_bytes(input[8..12].try_into().expect("4 bytes"));
                    let len = u32::from_be_bytes(input[12..16].try_into().expect("4 bytes"));
                    self.options_seen += 1;
                    if self.options_seen > MAX_OPTIONS {
                        return Err(NbdError::TooManyOptions(self.options_seen));
                    }
                    if len > MAX_OPTION_LEN {
                        if option == OPT_EXPORT_NAME {
                            return Err(NbdError::OptionTooLong {
                                option,
                                len,
                                max: MAX_OPTION_LEN,
                            });
                        }
                        input.advance(16);
                        self.state = State::Discard {
                            option,
                            remaining: len,
                        };
                        continue;
                    }
                    if input.len() < 16 + len as usize {
                        return Ok(HandshakeProgress::NeedMore);
                    }
                    input.advance(16);
                    let data = input.split_to(len as usize);
                    match self.handle_option(option, &data, catalog, out)? {
                        None => {}
                        Some(HandshakeProgress::StartTls) => {
                            // Bytes sent after STARTTLS but before its
                            // answer would be clear text taken as if it
                            // came over TLS (the STARTTLS injection attack).
                            if !input.is_empty() {
                                return Err(NbdError::Malformed {
                                    what: "NBD_OPT_STARTTLS",
                                    detail: format!(
                                        "{} bytes sent before the TLS handshake",
                                        input.len()
                                    ),
                                });
                            }
                            return Ok(HandshakeProgress::StartTls);
                        }
                        Some(p) => {
                            self.state = State::Finished;
                            return Ok(p);
                        }
                    }
                }
            }
        }
    }

    fn handle_option(
        &mut self,
        option: u32,
        data: &[u8],
        catalog: &dyn ExportCatalog,
        out: &mut BytesMut,
    ) -> Result<Option<HandshakeProgress>, NbdError> {
        if self.tls == TlsMode::Forced && !self.tls_on {
            match option {
                OPT_STARTTLS | OPT_ABORT => {}
                OPT_EXPORT_NAME => return Err(NbdError::TlsRequired),
                _ => {
                    error_reply(
                        out,
                        option,
                        REP_ERR_TLS_REQD,
                        "this server requires TLS: send NBD_OPT_STARTTLS first",
                    );
                    return Ok(None);
                }
            }
        }
        match option {
            OPT_EXPORT_NAME => {
                if self.extended {
                    // It cannot be refused, and has no way to say the
                    // headers are extended (proto.md: MUST NOT).
                    return Err(NbdError::Malformed {
                        what: "NBD_OPT_EXPORT_NAME",
                        detail: "sent after extended headers were negotiated".into(),
                    });
                }
                let name = String::from_utf8_lossy(data).into_owned();
                let Some(export) = catalog.export(&name) else {
                    return Err(NbdError::UnknownExport(name));
                };
                let flags = export.transmission_flags(self.structured);
                out.put_u64(export.size);
                out.put_u16(flags);
                if !self.no_zeroes {
                    out.put_bytes(0, 124);
                }
                let contexts = self.contexts_for(&export.name);
                return Ok(Some(HandshakeProgress::Done(Box::new(Negotiated {
                    export,
                    structured_replies: self.structured,
                    extended_headers: false,
                    meta_contexts: contexts,
                    flags,
                    tls: self.tls_on,
                }))));
            }
            OPT_ABORT => {
                ack(out, option);
                return Ok(Some(HandshakeProgress::Aborted));
            }
            OPT_LIST => {
                if !data.is_empty() {
                    error_reply(out, option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data");
                    return Ok(None);
                }
                for e in catalog.exports() {
                    let mut d = BytesMut::new();
                    d.put_u32(wire_len(e.name.len()));
                    d.put_slice(e.name.as_bytes());
                    d.put_slice(e.description.as_bytes());
                    reply(out, option, REP_SERVER, &d);
                }
                ack(out, option);
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    error_reply(out, option, REP_ERR_INVALID, "option takes no data");
                } else if self.extended {
                    error_reply(
                        out,
                        option,
                        REP_ERR_EXT_HEADER_REQD,
                        "extended headers are already negotiated",
                    );
                } else {
                    self.structured = true;
                    ack(out, option);
                }
            }
            OPT_EXTENDED_HEADERS => {
                if !self.offer_extended {
                    error_reply(
                        out,
                        option,
                        REP_ERR_UNSUP,
                        "extended headers are not offered here",
                    );
                } else if !data.is_empty() {
                    error_reply(out, option, REP_ERR_INVALID, "option takes no data");
                } else {
                    self.extended = true;
                    ack(out, option);
                }
            }
            OPT_INFO | OPT_GO => return Ok(self.info_or_go(option, data, catalog, out)),
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                self.meta_context(option, data, catalog, out);
            }
            OPT_STARTTLS => {
                if self.tls == TlsMode::Off {
                    error_reply(
                        out,
                        option,
                        REP_ERR_UNSUP,
                        "TLS is not offered by this server (see nbd.tls_dir)",
                    );
                } else if self.tls_on {
                    error_reply(out, option, REP_ERR_INVALID, "TLS is already on");
                } else if !data.is_empty() {
                    error_reply(
                        out,
                        option,
                        REP_ERR_INVALID,
                        "NBD_OPT_STARTTLS takes no data",
                    );
                } else {
                    ack(out, option);
                    return Ok(Some(HandshakeProgress::StartTls));
                }
            }
            _ => {
                error_reply(out, option, REP_ERR_UNSUP, "option not supported");
            }
        }
        Ok(None)
    }

    fn contexts_for(&self, export: &str) -> Vec<MetaContext> {
        match &self.selected {
            Some((name, c)) if name == export => c.clone(),
            _ => Vec::new(),
        }
    }

    fn info_or_go(
        &mut self,
        option: u32,
        data: &[u8],
        catalog: &dyn ExportCatalog,
        out: &mut BytesMut,
    ) -> Option<HandshakeProgress> {
        let Some((name, requests)) = parse_info_request(data) else {
            error_reply(
                out,
                option,
                REP_ERR_INVALID,
                "malformed NBD_OPT_INFO/GO data",
            );
            return None;
        };
        let Some(export) = catalog.export(&name) else {
            error_reply(
                out,
                option,
                REP_ERR_UNKNOWN,
                &unknown_export_message(catalog, &name),
            );
            return None;
        };
        let asked_block_size = requests.contains(&INFO_BLOCK_SIZE);
        if option == OPT_GO && export.block_size_required && !asked_block_size {
            error_reply(
                out,
                option,
                REP_ERR_BLOCK_SIZE_REQD,
                "this export needs aligned requests: negotiate NBD_INFO_BLOCK_SIZE",
            );
            return None;
        }
        let flags = export.transmission_flags(self.chunks());
        for r in &requests {
            match *r {
                INFO_NAME => {
                    let mut d = BytesMut::new();
                    d.put_u16(INFO_NAME);
                    d.put_slice(export.name.as_bytes());
                    reply(out, option, REP_INFO, &d);
                }
                INFO_DESCRIPTION => {
                    let mut d = BytesMut::new();
                    d.put_u16(INFO_DESCRIPTION);
                    d.put_slice(export.description.as_bytes());
                    reply(out, option, REP_INFO, &d);
                }
                _ => {}
            }
        }
        let mut d = BytesMut::new();
        d.put_u16(INFO_BLOCK_SIZE);
        d.put_u32(export.min_block);
        d.put_u32(export.preferred_block);
        d.put_u32(export.max_block);
        reply(out, option, REP_INFO, &d);
        let mut d = BytesMut::new();
        d.put_u16(INFO_EXPORT);
        d.put_u64(export.size);
        d.put_u16(flags);
        reply(out, option, REP_INFO, &d);
        ack(out, option);
        if option == OPT_INFO {
            return None;
        }
        let contexts = self.contexts_for(&export.name);
        Some(HandshakeProgress::Done(Box::new(Negotiated {
            export,
            structured_replies: self.chunks(),
            extended_headers: self.extended,
            meta_contexts: contexts,
            flags,
            tls: self.tls_on,
        })))
    }

    fn meta_context(
        &mut self,
        option: u32,
        data: &[u8],
        catalog: &dyn ExportCatalog,
        out: &mut BytesMut,
    ) {
        let set = option == OPT_SET_META_CONTEXT;
        if !self.chunks() {
            error_reply(
                out,
                option,
                REP_ERR_INVALID,
                "negotiate structured replies first",
            );
            return;
        }
        let Some((name, queries)) = parse_meta_request(data) else {
            error_reply(
                out,
                option,
                REP_ERR_INVALID,
                "malformed meta context request",
            );
            return;
        };
        let Some(export) = catalog.export(&name) else {
            error_reply(
                out,
                option,
                REP_ERR_UNKNOWN,
                &unknown_export_message(catalog, &name),
            );
            return;
        };
        let all: Vec<MetaContext> =
            std::iter::once(MetaContext::BaseAllocation)
                .chain(export.dirty_bitmaps.iter().enumerate().map(|(i, b)| {
                    MetaContext::DirtyBitmap {
                        name: b.clone(),
                        id: DIRTY_BITMAP_ID_BASE
                            + u32::try_from(i).unwrap_or(u32::MAX - DIRTY_BITMAP_ID_BASE),
                    }
                }))
                .collect();
        let mut chosen: Vec<MetaContext> = Vec::new();
        if queries.is_empty() {
            if !set {
                chosen = all.clone();
            }
        } else {
            for q in &queries {
                for c in &all {
                    let wire = c.wire_name();
                    let matches = if set {
                        *q == wire
                    } else {
                        *q == wire
                            || (q.ends_with(':') && wire.starts_with(q.as_str()))
                            || (q == "ferry:" && wire.starts_with(DIRTY_BITMAP_PREFIX))
                    };
                    if matches && !chosen.contains(c) {
                        chosen.push(c.clone());
                    }
                }
            }
        }
        for c in &chosen {
            let mut d = BytesMut::new();
            d.put_u32(c.id());
            d.put_slice(c.wire_name().as_bytes());
            reply(out, option, REP_META_CONTEXT, &d);
        }
        ack(out, option);
        if set {
            self.selected = Some((export.name, chosen));
        }
    }
}

fn wire_len(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn take_string(d: &mut &[u8], len: usize) -> Option<String> {
    if d.len() < len || len > 4096 {
        return None;
    }
    let s = std::str::from_utf8(&d[..len]).ok()?.to_string();
    *d = &d[len..];
    Some(s)
}

/// `u32 name length, name, u16 count, count * u16` (NBD_OPT_INFO and GO).
fn parse_info_request(mut d: &[u8]) -> Option<(String, Vec<u16>)> {
    if d.len() < 4 {
        return None;
    }
    let nlen = d.get_u32() as usize;
    let name = take_string(&mut d, nlen)?;
    if d.len() < 2 {
        return None;
    }
    let n = d.get_u16() as usize;
    if d.len() != n * 2 {
        return None;
    }
    let reqs = (0..n).map(|_| d.get_u16()).collect();
    Some((name, reqs))
}

/// `u32 export length, export, u32 count, count * (u32 length, query)`.
fn parse_meta_request(mut d: &[u8]) -> Option<(String, Vec<String>)> {
    if d.len() < 4 {
        return None;
    }
    let nlen = d.get_u32() as usize;
    let name = take_string(&mut d, nlen)?;
    if d.len() < 4 {
        return None;
    }
    let n = d.get_u32() as usize;
    let mut queries = Vec::new();
    for _ in 0..n {
        if d.len() < 4 {
            return None;
        }
        let qlen = d.get_u32() as usize;
        queries.push(take_string(&mut d, qlen)?);
    }
    if !d.is_empty() {
        return None;
    }
    Some((name, queries))
}

/// Append an option reply.
pub fn reply(out: &mut BytesMut, option: u32, reply_type: u32, data: &[u8]) {
    out.put_u64(OPTION_REPLY_MAGIC);
    out.put_u32(option);
    out.put_u32(reply_type);
    out.put_u32(wire_len(data.len()));
    out.put_slice(data);
}

fn ack(out: &mut BytesMut, option: u32) {
    reply(out, option, REP_ACK, &[]);
}

fn error_reply(out: &mut BytesMut, option: u32, reply_type: u32, msg: &str) {
    reply(out, option, reply_type, msg.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client;

    struct Cat(Vec<ExportInfo>);
    impl ExportCatalog for Cat {
        fn export(&self, name: &str) -> Option<ExportInfo> {
            self.0.iter().find(|e| e.name == name).cloned()
        }
        fn exports(&self) -> Vec<ExportInfo> {
            self.0.clone()
        }
    }

    fn cat() -> Cat {
        Cat(vec![ExportInfo {
            name: "vol".into(),
            description: "a volume".into(),
            size: 1 << 20,
            read_only: false,
            min_block: 1,
            preferred_block: 4096,
            max_block: crate::MAX_REQUEST_LEN,
            block_size_required: false,
            dirty_bitmaps: vec!["mig".into()],
            resizable: true,
        }])
    }

    fn run(bytes: &[u8]) -> (Result<HandshakeProgress, NbdError>, BytesMut) {
        let mut hs = ServerHandshake::new();
        let mut input = BytesMut::from(bytes);
        let mut out = BytesMut::new();
        let r = hs.feed(&mut input, &cat(), &mut out);
        (r, out)
    }

    fn flags() -> Vec<u8> {
        (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
            .to_be_bytes()
            .to_vec()
    }

    fn replies(out: &[u8]) -> Vec<u32> {
        let mut out = BytesMut::from(out);
        let mut v = Vec::new();
        while let Some(r) = client::decode_option_reply(&mut out).unwrap() {
            v.push(r.reply_type);
        }
        v
    }

    #[test]
    fn forced_tls_refuses_every_option_but_starttls_and_forgets_clear_text_state() {
        let mut hs = ServerHandshake::with_tls(TlsMode::Forced);
        let mut b = flags();
        b.extend(client::encode_option(OPT_STRUCTURED_REPLY, &[]));
        b.extend(client::encode_option(OPT_LIST, &[]));
        b.extend(client::encode_option(OPT_GO, &client::go_data("vol", &[])));
        b.extend(client::encode_option(OPT_STARTTLS, &[]));
        let (mut input, mut out) = (BytesMut::from(&b[..]), BytesMut::new());
        let r = hs.feed(&mut input, &cat(), &mut out).unwrap();
        assert_eq!(r, HandshakeProgress::StartTls);
        assert_eq!(
            replies(&out),
            [
                REP_ERR_TLS_REQD,
                REP_ERR_TLS_REQD,
                REP_ERR_TLS_REQD,
                REP_ACK
            ]
        );
        hs.tls_started();
        assert!(hs.tls_on());
        // Over TLS: a second STARTTLS is invalid, GO works, and structured
        // replies asked for in clear text are not on.
        let mut b = client::encode_option(OPT_STARTTLS, &[]);
        b.extend(client::encode_option(OPT_GO, &client::go_data("vol", &[])));
        let (mut input, mut out) = (BytesMut::from(&b[..]), BytesMut::new());
        let HandshakeProgress::Done(n) = hs.feed(&mut input, &cat(), &mut out).unwrap() else {
            panic!("not done")
        };
        assert!(!n.structured_replies);
        assert_eq!(replies(&out)[0], REP_ERR_INVALID);
    }

    #[test]
    fn forced_tls_closes_on_export_name_and_on_bytes_after_starttls() {
        let mut b = flags();
        b.extend(client::encode_option(OPT_EXPORT_NAME, b"vol"));
        let mut hs = ServerHandshake::with_tls(TlsMode::Forced);
        let (mut input, mut out) = (BytesMut::from(&b[..]), BytesMut::new());
        assert_eq!(
            hs.feed(&mut input, &cat(), &mut out),
            Err(NbdError::TlsRequired)
        );
        // Clear text queued behind STARTTLS must not be taken as TLS data.
        let mut b = flags();
        b.extend(client::encode_option(OPT_STARTTLS, &[]));
        b.extend(client::encode_option(OPT_GO, &client::go_data("vol", &[])));
        let mut hs = ServerHandshake::with_tls(TlsMode::Forced);
        let (mut input, mut out) = (BytesMut::from(&b[..]), BytesMut::new());
        assert!(matches!(
            hs.feed(&mut input, &cat(), &mut out),
            Err(NbdError::Malformed { .. })
        ));
    }

    #[test]
    fn optional_tls_serves_clear_text_and_off_says_unsupported() {
        let mut b = flags();
        b.extend(client::encode_option(OPT_STARTTLS, b"x"));
        b.extend(client::encode_option(OPT_GO, &client::go_data("vol", &[])));
        let mut hs = ServerHandshake::with_tls(TlsMode::Optional);
        let (mut input, mut out) = (BytesMut::from(&b[..]), BytesMut::new());
        assert!(matches!(
            hs.feed(&mut input, &cat(), &mut out),
            Ok(HandshakeProgress::Done(_))
        ));
        assert_eq!(replies(&out)[0], REP_ERR_INVALID);
        let mut b = flags();
        b.extend(client::encode_option(OPT_STARTTLS, &[]));
        let (r, out) = run(&b);
        assert_eq!(r.unwrap(), HandshakeProgress::NeedMore);
        assert_eq!(replies(&out), [REP_ERR_UNSUP]);
    }

    #[test]
    fn greeting_layout() {
        let g = ServerHandshake::greeting();
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
    }

    #[test]
    fn go_with_structured_and_meta_context() {
        let mut b = flags();
        b.extend(client::encode_option(OPT_STRUCTURED_REPLY, &[]));
        b.extend(client::encode_option(
            OPT_SET_META_CONTEXT,
            &client::meta_context_data("vol", &["base:allocation", "ferry:dirty-bitmap:mig"]),
        ));
        b.extend(client::encode_option(
            OPT_GO,
            &client::go_data("vol", &[INFO_BLOCK_SIZE]),
        ));
        let (r, _) = run(&b);
        let HandshakeProgress::Done(n) = r.unwrap() else {
            panic!("not done")
        };
        assert!(n.structured_replies);
        assert_eq!(n.meta_contexts.len(), 2);
        assert_eq!(n.meta_contexts[1].id(), DIRTY_BITMAP_ID_BASE);
        assert!(n.flags & FLAG_SEND_DF != 0);
    }

    #[test]
    fn extended_headers_are_acked_only_when_offered_and_take_precedence() {
        let mut b = flags();
        b.extend(client::encode_option(OPT_EXTENDED_HEADERS, &[]));
        b.extend(client::encode_option(OPT_EXTENDED_HEADERS, b"x"));
        b.extend(client::encode_option(OPT_STRUCTURED_REPLY, &[]));
        b.extend(client::encode_option(
            OPT_SET_META_CONTEXT,
            &client::meta_context_data("vol", &["base:allocation"]),
        ));
        b.extend(client::encode_option(OPT_GO, &client::go_data("vol", &[])));
        let mut hs = ServerHandshake::new().offer_extended_headers(true);
        let mut out = BytesMut::new();
        let r = hs.feed(&mut BytesMut::from(&b[..]), &cat(), &mut out);
        let HandshakeProgress::Done(n) = r.unwrap() else {
            panic!("not done")
        };
        assert_eq!(
            replies(&out),
            vec![
                REP_ACK,
                REP_ERR_INVALID,
                REP_ERR_EXT_HEADER_REQD,
                REP_META_CONTEXT,
                REP_ACK,
                REP_INFO,
                REP_INFO,
                REP_ACK
            ]
        );
        assert!(n.extended_headers && n.structured_replies);
        assert_eq!(n.reply_style(), ReplyStyle::Extended);
        assert_eq!(n.meta_contexts.len(), 1);
        assert!(n.flags & FLAG_SEND_DF != 0 && n.flags & FLAG_SEND_RESIZE != 0);
        assert!(n.limits(1 << 20, false).extended);

        // Not offered: unsupported, and the connection stays compact.
        let mut b = flags();
        b.extend(client::encode_option(OPT_EXTENDED_HEADERS, &[]));
        b.extend(client::encode_option(OPT_GO, &client::go_data("vol", &[])));
        let (r, out) = run(&b);
        let HandshakeProgress::Done(n) = r.unwrap() else {
            panic!("not done")
        };
        assert_eq!(replies(&out)[0], REP_ERR_UNSUP);
        assert_eq!(n.reply_style(), ReplyStyle::Simple);

        // EXPORT_NAME after extended headers cannot say so: the
        // connection ends.
        let mut b = flags();
        b.extend(client::encode_option(OPT_EXTENDED_HEADERS, &[]));
        b.extend(client::encode_option(OPT_EXPORT_NAME, b"vol"));
        let mut hs = ServerHandshake::new().offer_extended_headers(true);
        let r = hs.feed(&mut BytesMut::from(&b[..]), &cat(), &mut BytesMut::new());
        assert!(matches!(r, Err(NbdError::Malformed { .. })));
    }

    #[test]
    fn go_unknown_export_is_an_error_reply_not_a_close() {
        let mut b = flags();
        b.extend(client::encode_option(OPT_GO, &client::go_data("nope", &[])));
        let (r, out) = run(&b);
        assert_eq!(r.unwrap(), HandshakeProgress::NeedMore);
        let rep = client::decode_option_reply(&mut BytesMut::from(&out[..]))
            .unwrap()
            .unwrap();
        assert_eq!(rep.reply_type, REP_ERR_UNKNOWN);
    }

    #[test]
    fn export_name_unknown_closes() {
        let mut b = flags();
        b.extend(client::encode_option(OPT_EXPORT_NAME, b"nope"));
        assert!(matches!(run(&b).0, Err(NbdError::UnknownExport(_))));
    }

    #[test]
    fn export_name_sends_zero_padding_unless_no_zeroes() {
        let mut b = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        b.extend(client::encode_option(OPT_EXPORT_NAME, b"vol"));
        let (r, out) = run(&b);
        assert!(matches!(r, Ok(HandshakeProgress::Done(_))));
        assert_eq!(out.len(), 8 + 2 + 124);
    }

    #[test]
    fn bad_option_magic_and_client_flags() {
        let mut b = flags();
        b.extend([0u8; 16]);
        assert!(matches!(run(&b).0, Err(NbdError::BadMagic { .. })));
        assert!(matches!(
            run(&[0, 0, 0, 0]).0,
            Err(NbdError::NotFixedNewstyle(_))
        ));
        assert!(matches!(
            run(&[0, 0, 1, 1]).0,
            Err(NbdError::UnknownClientFlags(_))
        ));
    }

    #[test]
    fn unknown_option_and_meta_without_structured() {
        let mut b = flags();
        b.extend(client::encode_option(99, b"xyz"));
        b.extend(client::encode_option(
            OPT_SET_META_CONTEXT,
            &client::meta_context_data("vol", &["base:allocation"]),
        ));
        let (r, out) = run(&b);
        assert_eq!(r.unwrap(), HandshakeProgress::NeedMore);
        let mut out = BytesMut::from(&out[..]);
        assert_eq!(
            client::decode_option_reply(&mut out)
                .unwrap()
                .unwrap()
                .reply_type,
            REP_ERR_UNSUP
        );
        assert_eq!(
            client::decode_option_reply(&mut out)
                .unwrap()
                .unwrap()
                .reply_type,
            REP_ERR_INVALID
        );
    }

    #[test]
    fn oversized_option_is_skipped_with_too_big() {
        let mut b = flags();
        b.extend(IHAVEOPT.to_be_bytes());
        b.extend(OPT_LIST.to_be_bytes());
        b.extend((MAX_OPTION_LEN + 10).to_be_bytes());
        b.extend(vec![0u8; (MAX_OPTION_LEN + 10) as usize]);
        b.extend(client::encode_option(OPT_ABORT, &[]));
        let (r, out) = run(&b);
        assert_eq!(r.unwrap(), HandshakeProgress::Aborted);
        let mut out = BytesMut::from(&out[..]);
        assert_eq!(
            client::decode_option_reply(&mut out)
                .unwrap()
                .unwrap()
                .reply_type,
            REP_ERR_TOO_BIG
        );
        assert_eq!(
            client::decode_option_reply(&mut out)
                .unwrap()
                .unwrap()
                .reply_type,
            REP_ACK
        );
    }

    #[test]
    fn list_and_list_meta_all() {
        let mut b = flags();
        b.extend(client::encode_option(OPT_LIST, &[]));
        b.extend(client::encode_option(OPT_STRUCTURED_REPLY, &[]));
        b.extend(client::encode_option(
            OPT_LIST_META_CONTEXT,
            &client::meta_context_data("vol", &[]),
        ));
        let (_, out) = run(&b);
        let mut out = BytesMut::from(&out[..]);
        let mut types = vec![];
        while let Some(r) = client::decode_option_reply(&mut out).unwrap() {
            types.push(r.reply_type);
        }
        assert_eq!(
            types,
            vec![
                REP_SERVER,
                REP_ACK,
                REP_ACK,
                REP_META_CONTEXT,
                REP_META_CONTEXT,
                REP_ACK
            ]
        );
    }

    #[test]
    fn truncated_input_needs_more_at_every_split() {
        let mut b = flags();
        b.extend(client::encode_option(OPT_STRUCTURED_REPLY, &[]));
        b.extend(client::encode_option(
            OPT_GO,
            &client::go_data("vol", &[INFO_BLOCK_SIZE]),
        ));
        for split in 0..b.len() {
            let mut hs = ServerHandshake::new();
            let mut input = BytesMut::from(&b[..split]);
            let mut out = BytesMut::new();
            let r = hs.feed(&mut input, &cat(), &mut out).unwrap();
            assert_eq!(r, HandshakeProgress::NeedMore, "split {split}");
            input.extend_from_slice(&b[split..]);
            assert!(matches!(
                hs.feed(&mut input, &cat(), &mut out).unwrap(),
                HandshakeProgress::Done(_)
            ));
        }
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let mut b = flags();
            b.extend(data);
            let _ = run(&b);
        }
    }
}
