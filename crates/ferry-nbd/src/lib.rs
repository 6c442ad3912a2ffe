//! The NBD wire protocol (NetworkBlockDevice `doc/proto.md`), without I/O.
//!
//! Bytes go in, events and encoded bytes come out, so every parser here can be
//! unit-tested and fuzzed alone. The daemon owns the sockets; this crate owns the
//! meaning of the bytes.
//!
//! ```text
//!  client                                server
//!    |  <------ NBDMAGIC IHAVEOPT flags ----|   ServerHandshake::new().greeting()
//!    |  ------- client flags ------------->|
//!    |  ------- IHAVEOPT opt len data ---->|   ServerHandshake::feed() -> replies
//!    |  <------ option replies ------------|   ... until OPT_GO / OPT_EXPORT_NAME
//!    |========== transmission =============|
//!    |  ------- request (+payload) ------->|   RequestDecoder::decode(), validate()
//!    |  <------ simple/structured/extended -|   ReplyTo encoders (any order)
//! ```
//!
//! Versions: fixed newstyle only (oldstyle is obsolete). Extended headers
//! (32-byte requests and replies, 64-bit effect lengths) are acked when the
//! server offers them ([`ServerHandshake::offer_extended_headers`]), else
//! answered `NBD_REP_ERR_UNSUP`; STARTTLS is acked when the caller offers
//! TLS ([`TlsMode`]), and the caller runs TLS on its socket. `NBD_CMD_RESIZE`
//! (the `extension-resize` branch: the new size in the offset field) is
//! advertised for exports marked [`ExportInfo::resizable`].

pub mod client;
pub mod consts;
pub mod error;
pub mod handshake;
pub mod reply;
pub mod request;

pub use error::{ErrorCode, NbdError};
pub use handshake::{
    ExportCatalog, ExportInfo, HandshakeProgress, Negotiated, ServerHandshake, TlsMode,
    MOVED_PREFIX,
};
pub use reply::{ReplyStyle, ReplyTo};
pub use request::{validate, Command, Request, RequestDecoder, TransmissionLimits};

/// The largest request payload (and read length) ferry accepts: 32 MiB, the
/// common limit of qemu-nbd and nbdkit.
pub const MAX_REQUEST_LEN: u32 = 32 * 1024 * 1024;

/// The id of the `base:allocation` meta context on every export.
pub const BASE_ALLOCATION_ID: u32 = 1;
/// Ids of `ferry:dirty-bitmap:<name>` contexts start here, in the order of
/// [`ExportInfo::dirty_bitmaps`].
pub const DIRTY_BITMAP_ID_BASE: u32 = 16;
/// Prefix of the dirty-bitmap meta contexts (modelled on `qemu:dirty-bitmap:`).
pub const DIRTY_BITMAP_PREFIX: &str = "ferry:dirty-bitmap:";
/// The base allocation context.
pub const BASE_ALLOCATION: &str = "base:allocation";
