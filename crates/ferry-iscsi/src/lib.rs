//! The iSCSI target protocol (RFC 7143) for ferry, without I/O: bytes in,
//! events out. [`pdu`] frames PDUs (with optional CRC32C digests),
//! [`login`] runs the login phase (security negotiation with CHAP,
//! operational negotiation of every key), and [`session`] sequences the full
//! feature phase: command numbering, immediate/unsolicited data, R2T,
//! Data-In with phase collapse and residuals, NOP, text, task management and
//! logout. The SCSI commands themselves are executed by the caller.

pub mod chap;
pub mod login;
pub mod pdu;
pub mod session;
pub mod text;

pub use login::{Login, LoginStep, SessionParams, SessionType, TargetPolicy, Targets};
pub use pdu::{Pdu, PduDecoder, PduError};
pub use session::{CommandResult, Event, ScsiTask, Session, SessionError, TmfFunction};

/// Serial number arithmetic (RFC 1982, 32 bits): is `a` before `b`?
pub fn sn_lt(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}
