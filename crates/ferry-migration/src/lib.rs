//! The migration protocol between two `ferry serve` daemons (seed 002,
//! Fig. 3), as bytes in and messages out: no sockets, no TLS, no disks.
//!
//! ```text
//!  source                                   destination
//!    | Hello{versions, id, volume} ------------>|
//!    |<---------- Welcome{version, resumed} / Refuse
//!    | Prints{first, [zero run | BLAKE3]} ...  ->|  phase 1: fingerprints, zero runs as intervals
//!    | PrintsDone ------------------------------>|
//!    |<------------------------- Want{ranges} ...|  phase 2: what it cannot rebuild locally,
//!    |<--------------------- WantDone{local, buddy}  streamed as it is found (coalesced ranges)
//!    | Data{offset, raw|zstd, bytes} ... ------->|  phase 3: wanted chunks, then dirty rounds
//!    | RoundEnd{round, dirty_bytes} ------------>|
//!    |<------------------------- Synced{round}   |  written and flushed
//!    | Pause ----------------------------------->|  phase 4: writes paused at the source
//!    | Data ... , Digest{blake3} --------------->|
//!    |<-------------------- DigestResult{matches}|
//!    | Switch ---------------------------------->|  destination owns the volume
//!    |<------------------------- Done{nbd location}|  source marks it moved there
//!  either side: Abort{reason} ends the migration; the source volume is untouched.
//!
//!  destination                              buddy server (same LAN)
//!    | Lookup{block_size, [BLAKE3]} ------------>|  instead of Hello
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
//! include its own. Version 2 is this document; it removed two fields
//! version 1 always sent empty (`Switch.location`, the resume point of
//! `Welcome`, now one `resumed` flag). A later version may add message
//! types; changing the layout of one needs a new version number, as here.

mod message;
pub mod order;

pub use message::{
    Encoding, FrameDecoder, Message, MessageType, PrintEntry, VolumeDescriptor, WireError,
};
pub use order::{DestinationOrder, ProtocolViolation, SourceOrder};

/// Protocol version spoken by this build.
pub const VERSION: u16 = 2;
/// Largest payload of one frame.
pub const MAX_PAYLOAD: u32 = 64 << 20;
/// Frame header length.
pub const HEADER_LEN: usize = 12;
/// Largest zstd window (log2 bytes) of an `Encoding::ZstdStream`: a
/// decoder needs this much memory, and refuses streams that ask for more.
pub const STREAM_WINDOW_LOG: u32 = 27;
/// Frame magic, "FRYM".
pub const MAGIC: u32 = 0x4652_594d;
