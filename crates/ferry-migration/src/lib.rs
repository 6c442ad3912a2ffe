//! The migration protocol between two `ferry serve` daemons (seed 002,
//! Fig. 3), as bytes in and messages out: no sockets, no TLS, no disks.
//!
//! ```text
//!  source                                   destination
//!    | Hello{versions, id, volume, iscsi, arrived_under} ->|
//!    |<---- Welcome{version, basis, iscsi} / Refuse
//!    | Ping{nonce} ----------------------------->|  the source times the link's round trip
//!    |<------------------------------ Pong{nonce}|  (any time in phases 1-3)
//!    | Prints{first, [zero run | key | same run]} ->|  phase 1: 8-byte keys, zero runs as intervals
//!    | PrintsDone ------------------------------>|
//!    |<------------------------- Want{ranges} ...|  phase 2: one per Prints, what it cannot rebuild,
//!    |<--------------------- WantDone{local, buddy}  streamed as it is found (coalesced ranges)
//!    | Data{offset, raw|zstd, bytes} ... ------->|  phase 3: wanted chunks, then dirty rounds
//!    | RoundEnd{round, dirty_bytes} ------------>|
//!    |<------------------------- Synced{round}   |  written and flushed
//!    | Pause ----------------------------------->|  phase 4: writes paused at the source
//!    | Data ... , Digest{blake3} --------------->|
//!    |<-------------------- DigestResult{matches}|
//!    | Switch ---------------------------------->|  destination owns the volume
//!    |<----------- Done{nbd, admin, iscsi ports} |  source marks it moved there
//!  either side: Abort{reason} ends the migration; the source volume is untouched.
//!
//!  destination                              buddy server (same LAN)
//!    | Lookup{block_size, [key]} --------------->|  instead of Hello
//!    |<------------------ Found{[block | none]}  |  repeated, then close
//! ```
//!
//! Destination states: `Greeting -> Prints -> Transfer (rounds) -> Paused
//! -> Verifying -> Switched`, enforced message by message by
//! [`order::DestinationOrder`]; the source's side by [`order::SourceOrder`].
//!
//! Frames: `u32 magic "FRYM", u16 type, u16 flags (0), u32 payload length`,
//! then the payload, big endian. Type 0 is `Invalid` and never sent; an
//! unknown type, nonzero flags, or a payload over [`MAX_PAYLOAD`] is an
//! error, never guessed at.
//!
//! Versions: `Hello` carries the range the source speaks; `Welcome` names
//! the one chosen, and a destination refuses a source whose range does not
//! include its own. Version 9 is this document: `Ping` and `Pong` (types
//! 19 and 20), a round trip the destination answers at once while prints
//! or rounds go out, by which the source tells the link's share of its
//! switch's hold from the work at the two ends. Version 8: `Hello` ends with the
//! migration the volume arrived at the source by (`arrived_under`, when the
//! source tracked every chunk written since), a destination still holding
//! the copy the volume left by it answers [`CopyBasis::ReturnedTracked`],
//! and the source then prints only the chunks written since, the rest as
//! [`PrintEntry::Same`] runs (entry tag 4): a return trip's prints in
//! proportion to what changed, not to the volume. Version 7: `Hello`, `Welcome` and
//! `Done` end with the sender's iSCSI port for the volume (portal and
//! target port group, [`IscsiPort`]), so both sites report both groups'
//! ALUA states and the source redirects logins after the switch; version 6
//! added `Done`'s admin address. Version 5: `Welcome`'s last byte
//! says what the destination fills ([`CopyBasis`]: a new copy, its own
//! earlier attempt, or the incomplete copy another migration of the same
//! volume left, resumed or replaced), where version 4 had a resumed flag.
//! In version 4 the destination began to answer every `Prints` with one
//! `Want`, empty when it needs nothing of that frame, so the source knows
//! how many of its prints were answered and how many found a block; when
//! almost none do (a volume the destination has nothing like), it sends
//! the rest of the volume as data without prints, which then cost no more
//! than a migration without them; and the volume descriptor of `Hello`
//! began to end with the physical block size, which the copy keeps (512e
//! volumes). Version 3 made prints 8-byte keys
//! (entry tag 3) instead of whole BLAKE3 hashes (tag 2, gone), and so are
//! buddy lookups. Version 2 removed two fields version 1 always sent empty
//! (`Switch.location`, the resume point of `Welcome`, now one `resumed`
//! flag). A later version may add message types; changing the layout of
//! one needs a new version number, as here.
//!
//! Short prints: a chunk's print on the wire is the first 8 bytes of its
//! BLAKE3 (9 bytes with the entry tag, against 33 before: about 10% of
//! everything a same-release migration sent). The destination uses a
//! local (or buddy) block for a chunk only if that block's own BLAKE3
//! starts with the key, and records that full hash, not the source's, in
//! its chunk table; data blocks it records as they arrive. Before it takes
//! the volume, the digest over every chunk's full BLAKE3 (`Digest`) must
//! equal the source's, or it refuses the switch and the source keeps the
//! volume. So a wrong block is never served; what the short key costs is
//! the chance that a migration fails at the digest: a stale or colliding
//! candidate passes the key check with probability about (distinct blocks
//! indexed) / 2^64 per chunk reused, about 5e-8 for a million chunks
//! against a million indexed blocks.

mod message;
pub mod order;

pub use message::{
    CopyBasis, Encoding, FrameDecoder, IscsiPort, Message, MessageType, PrintEntry,
    VolumeDescriptor, WireError,
};
pub use order::{DestinationOrder, ProtocolViolation, SourceOrder};

/// Protocol version spoken by this build.
pub const VERSION: u16 = 9;
/// Largest payload of one frame.
pub const MAX_PAYLOAD: u32 = 64 << 20;
/// Frame header length.
pub const HEADER_LEN: usize = 12;
/// Largest zstd window (log2 bytes) of an `Encoding::ZstdStream`: a
/// decoder needs this much memory, and refuses streams that ask for more.
pub const STREAM_WINDOW_LOG: u32 = 27;
/// Frame magic, "FRYM".
pub const MAGIC: u32 = 0x4652_594d;
