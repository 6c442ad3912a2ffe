//! Message types, their encoding, and the streaming frame decoder.

use crate::{HEADER_LEN, MAGIC, MAX_PAYLOAD};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use thiserror::Error;

/// Longest string field (volume name, WWN, reasons, locations).
const MAX_STRING: usize = 4096;
/// Most entries in one `Prints`, ranges in one `Want`, prints in one `Lookup`.
const MAX_ITEMS: u32 = 1 << 20;

/// A frame that cannot be accepted; the connection ends with it.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum WireError {
    #[error("bad frame magic {0:#x}")]
    BadMagic(u32),
    #[error("unknown message type {0}")]
    UnknownType(u16),
    #[error("nonzero flags {flags:#x} on message type {ty}")]
    Flags { ty: u16, flags: u16 },
    #[error("payload of {0} bytes exceeds the limit")]
    TooLarge(u32),
    #[error("malformed {what}: {detail}")]
    Malformed { what: &'static str, detail: String },
}

fn malformed(what: &'static str, detail: impl Into<String>) -> WireError {
    WireError::Malformed {
        what,
        detail: detail.into(),
    }
}

/// The volume being migrated, as the source describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeDescriptor {
    pub name: String,
    pub size: u64,
    /// Logical block size presented to clients (512 or 4096).
    pub block_size: u32,
    /// Bytes per fingerprinted chunk.
    pub chunk_size: u32,
    pub uuid: [u8; 16],
    /// NAA identifier the copy keeps.
    pub wwn: String,
    /// Bytes the source holds allocated (what a sparse copy needs on disk).
    pub allocated: u64,
    /// Physical block size clients are told (equal to `block_size` unless
    /// the volume is 512e); the copy keeps it.
    pub physical_block_size: u32,
}

/// A daemon's iSCSI side of a volume that migrates: the portal initiators
/// log in at (`HOST:PORT`, "" when the daemon exports no iSCSI or
/// advertises no portal) and the target port group its portals form, so
/// each site can report the other's group in REPORT TARGET PORT GROUPS
/// and the source can redirect logins to the destination after the switch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IscsiPort {
    pub portal: String,
    /// 0 when there is none.
    pub port_group: u16,
}

impl IscsiPort {
    /// Whether the daemon exports the volume over iSCSI at all.
    pub fn is_some(&self) -> bool {
        self.port_group != 0
    }

    fn put(&self, out: &mut BytesMut) {
        put_str(out, &self.portal);
        out.put_u16(self.port_group);
    }
}

/// One fingerprint-stream entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrintEntry {
    /// A run of this many zero (or unallocated) chunks.
    Zero(u32),
    /// The key of one chunk: the first 8 bytes of its BLAKE3, as the
    /// fingerprint index sorts them (`ferry_index::Fingerprint::key`).
    /// The full hash never crosses: see the crate's "Short prints".
    Key(u64),
    /// A run of this many chunks nothing has written since the volume
    /// arrived at the source: the destination's copy (the one the volume
    /// left, [`CopyBasis::ReturnedTracked`]) holds them as they are. Sent
    /// only after such a `Welcome`; the digest checks the claim.
    Same(u32),
}

/// How `Data` bytes are encoded. 0 is invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    Raw = 1,
    /// One zstd frame of its own.
    Zstd = 2,
    /// The next flushed piece of one zstd stream that runs through the whole
    /// connection (window up to [`crate::STREAM_WINDOW_LOG`], long-distance
    /// matching): decodable only in order, after every earlier piece.
    ZstdStream = 3,
}

/// Every message type of this version, with its wire number. The one
/// table: encoding, decoding and names all go through it. 0 is `Invalid`
/// and never sent; numbers are never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum MessageType {
    Hello = 1,
    Welcome = 2,
    Refuse = 3,
    Prints = 4,
    PrintsDone = 5,
    Want = 6,
    WantDone = 7,
    Data = 8,
    RoundEnd = 9,
    Pause = 10,
    Digest = 11,
    DigestResult = 12,
    Switch = 13,
    Done = 14,
    Abort = 15,
    Synced = 16,
    Lookup = 17,
    Found = 18,
    Ping = 19,
    Pong = 20,
}

impl MessageType {
    /// Every type, in wire order.
    pub const ALL: [MessageType; 20] = [
        MessageType::Hello,
        MessageType::Welcome,
        MessageType::Refuse,
        MessageType::Prints,
        MessageType::PrintsDone,
        MessageType::Want,
        MessageType::WantDone,
        MessageType::Data,
        MessageType::RoundEnd,
        MessageType::Pause,
        MessageType::Digest,
        MessageType::DigestResult,
        MessageType::Switch,
        MessageType::Done,
        MessageType::Abort,
        MessageType::Synced,
        MessageType::Lookup,
        MessageType::Found,
        MessageType::Ping,
        MessageType::Pong,
    ];

    /// The type with this wire number; `None` for 0 and unknown numbers.
    pub fn from_wire(ty: u16) -> Option<MessageType> {
        MessageType::ALL.iter().copied().find(|t| *t as u16 == ty)
    }

    pub fn name(self) -> &'static str {
        match self {
            MessageType::Hello => "Hello",
            MessageType::Welcome => "Welcome",
            MessageType::Refuse => "Refuse",
            MessageType::Prints => "Prints",
            MessageType::PrintsDone => "PrintsDone",
            MessageType::Want => "Want",
            MessageType::WantDone => "WantDone",
            MessageType::Data => "Data",
            MessageType::RoundEnd => "RoundEnd",
            MessageType::Pause => "Pause",
            MessageType::Digest => "Digest",
            MessageType::DigestResult => "DigestResult",
            MessageType::Switch => "Switch",
            MessageType::Done => "Done",
            MessageType::Abort => "Abort",
            MessageType::Synced => "Synced",
            MessageType::Lookup => "Lookup",
            MessageType::Found => "Found",
            MessageType::Ping => "Ping",
            MessageType::Pong => "Pong",
        }
    }
}

/// What a destination fills when it welcomes a migration (`Welcome`'s
/// last byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CopyBasis {
    /// A copy created for this migration.
    New = 0,
    /// The incomplete copy an earlier attempt of this migration left.
    Resumed = 1,
    /// The incomplete copy another migration of the same volume left (a
    /// failed move, tried again under a new id): resumed, its matching
    /// chunks kept.
    LeftoverResumed = 2,
    /// Such a leftover that could not be resumed (the volume's size or
    /// block size changed since): replaced by a new copy.
    LeftoverReplaced = 3,
    /// The copy this daemon kept when the volume moved away from here (the
    /// volume comes back): its chunks that still match are kept, only what
    /// changed since crosses.
    Returned = 4,
    /// That copy, untouched since it left under the migration the source
    /// names in `Hello` (`arrived_under`), which the volume arrived there
    /// by: the source prints only the chunks written since it arrived, and
    /// sends the rest as [`PrintEntry::Same`] runs (protocol version 8).
    ReturnedTracked = 5,
}

impl CopyBasis {
    /// Whether chunks already in the copy may be kept.
    pub fn resumes(self) -> bool {
        matches!(
            self,
            CopyBasis::Resumed
                | CopyBasis::LeftoverResumed
                | CopyBasis::Returned
                | CopyBasis::ReturnedTracked
        )
    }
}

/// A protocol message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Hello {
        min_version: u16,
        max_version: u16,
        migration_id: [u8; 16],
        volume: VolumeDescriptor,
        /// The source's iSCSI port for the volume.
        iscsi: IscsiPort,
        /// The migration the volume arrived at the source by, when the
        /// source has tracked every chunk written since ("" otherwise): a
        /// destination still holding the copy the volume left by that
        /// migration answers [`CopyBasis::ReturnedTracked`].
        arrived_under: String,
    },
    Welcome {
        version: u16,
        /// What the destination fills: a new copy, or an incomplete one it
        /// holds (whose chunks that already match are kept).
        basis: CopyBasis,
        /// The destination's iSCSI port for the volume.
        iscsi: IscsiPort,
    },
    Refuse {
        reason: String,
    },
    Prints {
        first_chunk: u64,
        entries: Vec<PrintEntry>,
    },
    PrintsDone,
    Want {
        ranges: Vec<(u64, u32)>,
    },
    WantDone {
        local_chunks: u64,
        buddy_chunks: u64,
        /// Already in place from an earlier attempt (resume).
        resumed_chunks: u64,
    },
    Data {
        offset: u64,
        encoding: Encoding,
        raw_len: u32,
        bytes: Bytes,
    },
    RoundEnd {
        round: u32,
        dirty_bytes: u64,
    },
    Pause,
    Digest {
        digest: [u8; 32],
    },
    DigestResult {
        matches: bool,
        digest: [u8; 32],
    },
    /// Commit (only after a matching digest); no payload.
    Switch,
    /// The destination owns the volume now; `location` is its NBD
    /// `HOST:PORT`, where clients go next, and `admin` its admin API's
    /// `HOST:PORT` where the volume's next migration starts ("" when the
    /// destination advertises none); `iscsi` its iSCSI port, where the
    /// source redirects initiators.
    Done {
        location: String,
        admin: String,
        iscsi: IscsiPort,
    },
    Abort {
        reason: String,
    },
    /// The destination's answer to `RoundEnd`: everything before it is
    /// written and flushed.
    Synced {
        round: u32,
    },
    /// To a buddy server (instead of `Hello`): which of these blocks of
    /// `block_size` bytes do you hold?
    Lookup {
        block_size: u32,
        keys: Vec<u64>,
    },
    /// A buddy's answer, in the order asked: the block's bytes (verified
    /// against the print by the buddy, and again by the asker) or nothing.
    Found {
        blocks: Vec<Option<Bytes>>,
    },
    /// From the source, while prints or rounds go out: answer at once
    /// with a `Pong` of the same nonce (protocol version 9). The source
    /// times the round trip, so that it can tell the link's share of its
    /// switch's hold from the work at either end.
    Ping {
        nonce: u64,
    },
    /// The destination's answer to `Ping`.
    Pong {
        nonce: u64,
    },
}

impl Message {
    /// The message's type.
    pub fn kind(&self) -> MessageType {
        match self {
            Message::Hello { .. } => MessageType::Hello,
            Message::Welcome { .. } => MessageType::Welcome,
            Message::Refuse { .. } => MessageType::Refuse,
            Message::Prints { .. } => MessageType::Prints,
            Message::PrintsDone => MessageType::PrintsDone,
            Message::Want { .. } => MessageType::Want,
            Message::WantDone { .. } => MessageType::WantDone,
            Message::Data { .. } => MessageType::Data,
            Message::RoundEnd { .. } => MessageType::RoundEnd,
            Message::Pause => MessageType::Pause,
            Message::Digest { .. } => MessageType::Digest,
            Message::DigestResult { .. } => MessageType::DigestResult,
            Message::Switch => MessageType::Switch,
            Message::Done { .. } => MessageType::Done,
            Message::Abort { .. } => MessageType::Abort,
            Message::Synced { .. } => MessageType::Synced,
            Message::Lookup { .. } => MessageType::Lookup,
            Message::Found { .. } => MessageType::Found,
            Message::Ping { .. } => MessageType::Ping,
            Message::Pong { .. } => MessageType::Pong,
        }
    }

    /// The wire type number (never 0).
    pub fn ty(&self) -> u16 {
        self.kind() as u16
    }

    /// The message's name, for errors and logs.
    pub fn name(&self) -> &'static str {
        self.kind().name()
    }

    /// Append the framed message to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        let start = out.len();
        out.put_u32(MAGIC);
        out.put_u16(self.ty());
        out.put_u16(0);
        out.put_u32(0);
        match self {
            Message::Hello {
                min_version,
                max_version,
                migration_id,
                volume,
                iscsi,
                arrived_under,
            } => {
                out.put_u16(*min_version);
                out.put_u16(*max_version);
                out.put_slice(migration_id);
                put_str(out, &volume.name);
                out.put_u64(volume.size);
                out.put_u32(volume.block_size);
                out.put_u32(volume.chunk_size);
                out.put_slice(&volume.uuid);
                put_str(out, &volume.wwn);
                out.put_u64(volume.allocated);
                out.put_u32(volume.physical_block_size);
                iscsi.put(out);
                put_str(out, arrived_under);
            }
            Message::Welcome {
                version,
                basis,
                iscsi,
            } => {
                out.put_u16(*version);
                out.put_u8(*basis as u8);
                iscsi.put(out);
            }
            Message::Refuse { reason } | Message::Abort { reason } => put_str(out, reason),
            Message::Done {
                location,
                admin,
                iscsi,
            } => {
                put_str(out, location);
                put_str(out, admin);
                iscsi.put(out);
            }
            Message::Prints {
                first_chunk,
                entries,
            } => {
                out.put_u64(*first_chunk);
                out.put_u32(count(entries.len()));
                for e in entries {
                    match e {
                        PrintEntry::Zero(n) => {
                            out.put_u8(1);
                            out.put_u32(*n);
                        }
                        PrintEntry::Key(k) => {
                            out.put_u8(3);
                            out.put_u64(*k);
                        }
                        PrintEntry::Same(n) => {
                            out.put_u8(4);
                            out.put_u32(*n);
                        }
                    }
                }
            }
            Message::Want { ranges } => put_ranges(out, ranges),
            Message::WantDone {
                local_chunks,
                buddy_chunks,
                resumed_chunks,
            } => {
                out.put_u64(*local_chunks);
                out.put_u64(*buddy_chunks);
                out.put_u64(*resumed_chunks);
            }
            Message::Data {
                offset,
                encoding,
                raw_len,
                bytes,
            } => {
                out.put_u64(*offset);
                out.put_u8(*encoding as u8);
                out.put_u32(*raw_len);
                out.put_slice(bytes);
            }
            Message::RoundEnd { round, dirty_bytes } => {
                out.put_u32(*round);
                out.put_u64(*dirty_bytes);
            }
            Message::Digest { digest } => out.put_slice(digest),
            Message::DigestResult { matches, digest } => {
                out.put_u8(u8::from(*matches));
                out.put_slice(digest);
            }
            Message::Synced { round } => out.put_u32(*round),
            Message::Ping { nonce } | Message::Pong { nonce } => out.put_u64(*nonce),
            Message::Lookup { block_size, keys } => {
                out.put_u32(*block_size);
                out.put_u32(count(keys.len()));
                for k in keys {
                    out.put_u64(*k);
                }
            }
            Message::Found { blocks } => {
                out.put_u32(count(blocks.len()));
                for b in blocks {
                    match b {
                        None => out.put_u8(0),
                        Some(d) => {
                            out.put_u8(1);
                            out.put_u32(count(d.len()));
                            out.put_slice(d);
                        }
                    }
                }
            }
            Message::PrintsDone | Message::Pause | Message::Switch => {}
        }
        let len = u32::try_from(out.len() - start - HEADER_LEN).unwrap_or(u32::MAX);
        out[start + 8..start + 12].copy_from_slice(&len.to_be_bytes());
    }
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn put_str(out: &mut BytesMut, s: &str) {
    let b = &s.as_bytes()[..s.len().min(MAX_STRING)];
    out.put_u16(u16::try_from(b.len()).unwrap_or(0));
    out.put_slice(b);
}

fn put_ranges(out: &mut BytesMut, r: &[(u64, u32)]) {
    out.put_u32(count(r.len()));
    for (first, n) in r {
        out.put_u64(*first);
        out.put_u32(*n);
    }
}

/// A cursor over one payload that refuses to read past its end.
struct Payload {
    b: Bytes,
    what: &'static str,
}

impl Payload {
    fn need(&self, n: usize) -> Result<(), WireError> {
        if self.b.remaining() < n {
            return Err(malformed(
                self.what,
                format!(
                    "truncated: {n} more bytes needed, {} left",
                    self.b.remaining()
                ),
            ));
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        self.need(1)?;
        Ok(self.b.get_u8())
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        self.need(2)?;
        Ok(self.b.get_u16())
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        self.need(4)?;
        Ok(self.b.get_u32())
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        self.need(8)?;
        Ok(self.b.get_u64())
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        self.need(N)?;
        let mut a = [0u8; N];
        self.b.copy_to_slice(&mut a);
        Ok(a)
    }
    fn string(&mut self) -> Result<String, WireError> {
        let n = self.u16()? as usize;
        if n > MAX_STRING {
            return Err(malformed(self.what, format!("string of {n} bytes")));
        }
        self.need(n)?;
        let s = self.b.split_to(n);
        String::from_utf8(s.to_vec()).map_err(|_| malformed(self.what, "string is not UTF-8"))
    }
    fn iscsi_port(&mut self) -> Result<IscsiPort, WireError> {
        let portal = self.string()?;
        let port_group = self.u16()?;
        if port_group == 0 && !portal.is_empty() {
            return Err(malformed(self.what, "an iSCSI portal without a port group"));
        }
        Ok(IscsiPort { portal, port_group })
    }
    fn items(&mut self) -> Result<u32, WireError> {
        let n = self.u32()?;
        if n > MAX_ITEMS {
            return Err(malformed(self.what, format!("{n} items exceed the limit")));
        }
        Ok(n)
    }
    /// A count, then that many items read by `item`; room is reserved for
    /// no more of them than the bytes left hold at `min_bytes` each, so a
    /// lying count cannot make the reader allocate.
    fn list<T>(
        &mut self,
        min_bytes: usize,
        mut item: impl FnMut(&mut Self) -> Result<T, WireError>,
    ) -> Result<Vec<T>, WireError> {
        let n = self.items()?;
        let mut out = Vec::with_capacity((n as usize).min(self.b.remaining() / min_bytes));
        for _ in 0..n {
            out.push(item(self)?);
        }
        Ok(out)
    }
    fn ranges(&mut self) -> Result<Vec<(u64, u32)>, WireError> {
        let n = self.items()?;
        self.need(n as usize * 12)?;
        (0..n).map(|_| Ok((self.u64()?, self.u32()?))).collect()
    }
    fn end(self) -> Result<(), WireError> {
        if self.b.has_remaining() {
            return Err(malformed(
                self.what,
                format!("{} trailing bytes", self.b.remaining()),
            ));
        }
        Ok(())
    }
}

/// The payload of each message type with more than a line of layout;
/// the others are read in [`parse`] itself.
impl Payload {
    fn hello(&mut self) -> Result<Message, WireError> {
        Ok(Message::Hello {
            min_version: self.u16()?,
            max_version: self.u16()?,
            migration_id: self.array()?,
            volume: VolumeDescriptor {
                name: self.string()?,
                size: self.u64()?,
                block_size: self.u32()?,
                chunk_size: self.u32()?,
                uuid: self.array()?,
                wwn: self.string()?,
                allocated: self.u64()?,
                physical_block_size: self.u32()?,
            },
            iscsi: self.iscsi_port()?,
            // A source of version 7 or earlier ends here: parsed, so that
            // the version check refuses it by name.
            arrived_under: if self.b.has_remaining() {
                self.string()?
            } else {
                String::new()
            },
        })
    }

    fn welcome(&mut self) -> Result<Message, WireError> {
        let version = self.u16()?;
        let basis = match self.u8()? {
            0 => CopyBasis::New,
            1 => CopyBasis::Resumed,
            2 => CopyBasis::LeftoverResumed,
            3 => CopyBasis::LeftoverReplaced,
            4 => CopyBasis::Returned,
            5 => CopyBasis::ReturnedTracked,
            t => return Err(malformed(self.what, format!("copy basis {t}"))),
        };
        Ok(Message::Welcome {
            version,
            basis,
            iscsi: self.iscsi_port()?,
        })
    }

    fn prints(&mut self) -> Result<Message, WireError> {
        let first_chunk = self.u64()?;
        let entries = self.list(5, |p| {
            Ok(match p.u8()? {
                1 => PrintEntry::Zero(p.u32()?),
                3 => PrintEntry::Key(p.u64()?),
                4 => PrintEntry::Same(p.u32()?),
                t => return Err(malformed(p.what, format!("entry tag {t}"))),
            })
        })?;
        Ok(Message::Prints {
            first_chunk,
            entries,
        })
    }

    fn data(&mut self) -> Result<Message, WireError> {
        let offset = self.u64()?;
        let encoding = match self.u8()? {
            1 => Encoding::Raw,
            2 => Encoding::Zstd,
            3 => Encoding::ZstdStream,
            e => return Err(malformed(self.what, format!("encoding {e}"))),
        };
        let raw_len = self.u32()?;
        let bytes = self.b.split_to(self.b.remaining());
        if raw_len > MAX_PAYLOAD || (encoding == Encoding::Raw && raw_len as usize != bytes.len()) {
            return Err(malformed(
                self.what,
                format!("raw length {raw_len} for {} bytes", bytes.len()),
            ));
        }
        Ok(Message::Data {
            offset,
            encoding,
            raw_len,
            bytes,
        })
    }

    fn digest_result(&mut self) -> Result<Message, WireError> {
        let matches = match self.u8()? {
            0 => false,
            1 => true,
            v => return Err(malformed(self.what, format!("boolean {v}"))),
        };
        Ok(Message::DigestResult {
            matches,
            digest: self.array()?,
        })
    }

    fn lookup(&mut self) -> Result<Message, WireError> {
        let block_size = self.u32()?;
        let keys = self.list(8, Self::u64)?;
        Ok(Message::Lookup { block_size, keys })
    }

    fn found(&mut self) -> Result<Message, WireError> {
        let blocks = self.list(1, |p| {
            Ok(match p.u8()? {
                0 => None,
                1 => {
                    let len = p.u32()? as usize;
                    p.need(len)?;
                    Some(p.b.split_to(len))
                }
                t => return Err(malformed(p.what, format!("block tag {t}"))),
            })
        })?;
        Ok(Message::Found { blocks })
    }
}

fn parse(ty: u16, payload: Bytes) -> Result<Message, WireError> {
    use MessageType as T;
    let kind = MessageType::from_wire(ty).ok_or(WireError::UnknownType(ty))?;
    let what = kind.name();
    let mut p = Payload { b: payload, what };
    let m = match kind {
        T::Hello => p.hello()?,
        T::Welcome => p.welcome()?,
        T::Refuse => Message::Refuse {
            reason: p.string()?,
        },
        T::Prints => p.prints()?,
        T::PrintsDone => Message::PrintsDone,
        T::Want => Message::Want {
            ranges: p.ranges()?,
        },
        T::WantDone => Message::WantDone {
            local_chunks: p.u64()?,
            buddy_chunks: p.u64()?,
            resumed_chunks: p.u64()?,
        },
        T::Data => p.data()?,
        T::RoundEnd => Message::RoundEnd {
            round: p.u32()?,
            dirty_bytes: p.u64()?,
        },
        T::Pause => Message::Pause,
        T::Digest => Message::Digest { digest: p.array()? },
        T::DigestResult => p.digest_result()?,
        T::Switch => Message::Switch,
        T::Done => Message::Done {
            location: p.string()?,
            admin: p.string()?,
            iscsi: p.iscsi_port()?,
        },
        T::Abort => Message::Abort {
            reason: p.string()?,
        },
        T::Synced => Message::Synced { round: p.u32()? },
        T::Lookup => p.lookup()?,
        T::Found => p.found()?,
        T::Ping => Message::Ping { nonce: p.u64()? },
        T::Pong => Message::Pong { nonce: p.u64()? },
    };
    p.end()?;
    Ok(m)
}

/// Streaming decoder: `Ok(None)` means "read more".
#[derive(Debug, Default)]
pub struct FrameDecoder;

impl FrameDecoder {
    pub fn new() -> Self {
        FrameDecoder
    }

    /// Bytes still needed for the frame at the head of `buf`, when known.
    pub fn wanted(&self, buf: &[u8]) -> usize {
        if buf.len() < HEADER_LEN {
            return HEADER_LEN - buf.len();
        }
        let len =
            u32::from_be_bytes(buf[8..12].try_into().expect("4 bytes")).min(MAX_PAYLOAD) as usize;
        (HEADER_LEN + len).saturating_sub(buf.len())
    }

    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Message>, WireError> {
        if buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let magic = u32::from_be_bytes(buf[..4].try_into().expect("4 bytes"));
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        let ty = u16::from_be_bytes(buf[4..6].try_into().expect("2 bytes"));
        let flags = u16::from_be_bytes(buf[6..8].try_into().expect("2 bytes"));
        let len = u32::from_be_bytes(buf[8..12].try_into().expect("4 bytes"));
        if MessageType::from_wire(ty).is_none() {
            return Err(WireError::UnknownType(ty));
        }
        if flags != 0 {
            return Err(WireError::Flags { ty, flags });
        }
        if len > MAX_PAYLOAD {
            return Err(WireError::TooLarge(len));
        }
        if buf.len() < HEADER_LEN + len as usize {
            return Ok(None);
        }
        buf.advance(HEADER_LEN);
        let payload = buf.split_to(len as usize).freeze();
        parse(ty, payload).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Message> {
        let vol = VolumeDescriptor {
            name: "vm-disk".into(),
            size: 10 << 30,
            block_size: 512,
            chunk_size: 4096,
            uuid: [7; 16],
            wwn: "naa.3123456789abcdef".into(),
            allocated: 0,
            physical_block_size: 4096,
        };
        vec![
            Message::Hello {
                min_version: 1,
                max_version: 3,
                migration_id: [9; 16],
                volume: vol,
                iscsi: IscsiPort::default(),
                arrived_under: "0123456789abcdef0123456789abcdef".into(),
            },
            Message::Welcome {
                version: 2,
                basis: CopyBasis::New,
                iscsi: IscsiPort::default(),
            },
            Message::Welcome {
                version: 2,
                basis: CopyBasis::Resumed,
                iscsi: IscsiPort::default(),
            },
            Message::Welcome {
                version: 5,
                basis: CopyBasis::LeftoverResumed,
                iscsi: IscsiPort::default(),
            },
            Message::Welcome {
                version: 5,
                basis: CopyBasis::LeftoverReplaced,
                iscsi: IscsiPort::default(),
            },
            Message::Welcome {
                version: 6,
                basis: CopyBasis::Returned,
                iscsi: IscsiPort::default(),
            },
            Message::Welcome {
                version: 8,
                basis: CopyBasis::ReturnedTracked,
                iscsi: IscsiPort::default(),
            },
            Message::Refuse {
                reason: "volume exists".into(),
            },
            Message::Prints {
                first_chunk: 42,
                entries: vec![
                    PrintEntry::Zero(1000),
                    PrintEntry::Key(u64::MAX - 3),
                    PrintEntry::Same(77),
                ],
            },
            Message::PrintsDone,
            Message::Want {
                ranges: vec![(5, 2), (u64::MAX - 1, 1)],
            },
            Message::WantDone {
                local_chunks: 10,
                buddy_chunks: 3,
                resumed_chunks: 2,
            },
            Message::Data {
                offset: 4096,
                encoding: Encoding::Raw,
                raw_len: 3,
                bytes: Bytes::from_static(b"abc"),
            },
            Message::Data {
                offset: 0,
                encoding: Encoding::Zstd,
                raw_len: 4096,
                bytes: Bytes::from_static(b"zz"),
            },
            Message::RoundEnd {
                round: 3,
                dirty_bytes: 1 << 20,
            },
            Message::Pause,
            Message::Digest { digest: [1; 32] },
            Message::DigestResult {
                matches: true,
                digest: [2; 32],
            },
            Message::Switch,
            Message::Done {
                location: "10.0.0.3:10809".into(),
                admin: "10.0.0.3:10880".into(),
                iscsi: IscsiPort {
                    portal: "10.0.0.3:3260".into(),
                    port_group: 0x2b,
                },
            },
            Message::Abort {
                reason: "link lost".into(),
            },
            Message::Synced { round: 3 },
            Message::Ping { nonce: 7 },
            Message::Pong { nonce: u64::MAX },
            Message::Lookup {
                block_size: 4096,
                keys: vec![5, u64::MAX],
            },
            Message::Found {
                blocks: vec![None, Some(Bytes::from_static(b"block"))],
            },
        ]
    }

    #[test]
    fn every_message_round_trips_even_split_at_every_byte() {
        let mut wire = BytesMut::new();
        for m in all() {
            m.encode(&mut wire);
        }
        for split in [0, 1, 5, 11, 12, 13, 40, wire.len() / 2, wire.len()] {
            let mut d = FrameDecoder::new();
            let mut b = BytesMut::from(&wire[..split]);
            let mut got = Vec::new();
            while let Some(m) = d.decode(&mut b).unwrap() {
                got.push(m);
            }
            b.extend_from_slice(&wire[split..]);
            while let Some(m) = d.decode(&mut b).unwrap() {
                got.push(m);
            }
            assert_eq!(got, all(), "split at {split}");
        }
    }

    #[test]
    fn unknown_invalid_flagged_and_oversized_frames_are_rejected() {
        let frame = |ty: u16, flags: u16, len: u32| {
            let mut b = BytesMut::new();
            b.put_u32(MAGIC);
            b.put_u16(ty);
            b.put_u16(flags);
            b.put_u32(len);
            b
        };
        let mut d = FrameDecoder::new();
        assert_eq!(
            d.decode(&mut frame(0, 0, 0)),
            Err(WireError::UnknownType(0))
        );
        assert_eq!(
            d.decode(&mut frame(21, 0, 0)),
            Err(WireError::UnknownType(21))
        );
        assert_eq!(
            d.decode(&mut frame(5, 1, 0)),
            Err(WireError::Flags { ty: 5, flags: 1 })
        );
        assert_eq!(
            d.decode(&mut frame(8, 0, MAX_PAYLOAD + 1)),
            Err(WireError::TooLarge(MAX_PAYLOAD + 1))
        );
        let mut bad = frame(5, 0, 0);
        bad[0] = b'X';
        assert!(matches!(d.decode(&mut bad), Err(WireError::BadMagic(_))));
    }

    #[test]
    fn malformed_payloads_are_rejected() {
        let mut d = FrameDecoder::new();
        // Trailing bytes after a complete PrintsDone.
        let mut b = BytesMut::new();
        Message::PrintsDone.encode(&mut b);
        b[11] = 1;
        b.put_u8(0);
        assert!(matches!(d.decode(&mut b), Err(WireError::Malformed { .. })));
        // Raw data whose length disagrees with raw_len.
        let mut b = BytesMut::new();
        Message::Data {
            offset: 0,
            encoding: Encoding::Raw,
            raw_len: 9,
            bytes: Bytes::from_static(b"abc"),
        }
        .encode(&mut b);
        assert!(matches!(d.decode(&mut b), Err(WireError::Malformed { .. })));
        // Unknown encoding, boolean and entry tag.
        for (m, at) in [
            (
                Message::Data {
                    offset: 0,
                    encoding: Encoding::Raw,
                    raw_len: 1,
                    bytes: Bytes::from_static(b"a"),
                },
                12 + 8,
            ),
            (
                Message::DigestResult {
                    matches: true,
                    digest: [0; 32],
                },
                12,
            ),
            (
                Message::Prints {
                    first_chunk: 0,
                    entries: vec![PrintEntry::Zero(1)],
                },
                12 + 12,
            ),
        ] {
            let mut b = BytesMut::new();
            m.encode(&mut b);
            b[at] = 7;
            assert!(
                matches!(d.decode(&mut b), Err(WireError::Malformed { .. })),
                "{m:?}"
            );
        }
        // An item count far beyond the payload.
        let mut b = BytesMut::new();
        Message::Want {
            ranges: vec![(1, 1)],
        }
        .encode(&mut b);
        b[12..16].copy_from_slice(&1000u32.to_be_bytes());
        assert!(matches!(d.decode(&mut b), Err(WireError::Malformed { .. })));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(proptest::num::u8::ANY, 0..512)) {
            let mut d = FrameDecoder::new();
            let mut b = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = d.decode(&mut b) {}
            let mut b = BytesMut::new();
            b.put_u32(MAGIC);
            b.extend_from_slice(&data);
            while let Ok(Some(_)) = d.decode(&mut b) {}
        }
    }
}
