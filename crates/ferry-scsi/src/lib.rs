//! SCSI for ferry: a direct-access logical unit (SPC-4 / SBC-3) that decodes
//! CDBs, keeps the unit's shared state (reservations, unit attentions, mode
//! pages) and executes each command against a [`BlockDevice`]. The transport
//! (iSCSI) hands it a CDB and the data-out bytes and gets back a status,
//! data-in bytes and sense data; nothing here touches a socket.
// Casts in the SCSI unit build fixed-layout CDB answers: lengths of pages
// this crate assembles (a few hundred bytes, written into the u8/u16
// fields the standard gives them) and block counts already checked against
// the medium. They are bounded by construction but not yet each proven by
// the type system; until they are, the truncation lints are allowed here
// alone, and the fuzz target `iscsi_session` runs every command on them.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod cdb;
mod inquiry;
mod lu;
pub mod memory;
mod mode;
mod opcodes;
pub mod pr;
pub mod sense;
pub mod xcopy;

pub use inquiry::absent_lun;
pub use lu::{report_luns, LogicalUnit, LuConfig};
pub use opcodes::op;
pub use sense::Sense;
pub use xcopy::CopyTargets;

use thiserror::Error;

/// SCSI status codes (SAM-5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Good = 0x00,
    CheckCondition = 0x02,
    ConditionMet = 0x04,
    Busy = 0x08,
    ReservationConflict = 0x18,
    TaskSetFull = 0x28,
    TaskAborted = 0x40,
}

/// What a device operation can fail with; each maps to one sense triple.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DeviceError {
    #[error("range outside the device")]
    OutOfRange,
    #[error("device is read-only")]
    ReadOnly,
    #[error("device is gone: {0}")]
    Gone(String),
    #[error("no space left to allocate blocks")]
    NoSpace,
    #[error("I/O error: {0}")]
    Io(String),
    #[error("a sanitize is in progress")]
    Sanitizing,
    #[error("the last sanitize failed")]
    SanitizeFailed,
    /// The device's access state is changing (a migration's switch whose
    /// outcome is not known yet): try again later, or on another path.
    #[error("access state in transition: {0}")]
    Transitioning(String),
}

/// What SANITIZE does to every block (SBC-4 4.11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SanitizeAction {
    /// Write `pattern`, repeated to fill each block, `passes` times;
    /// with `invert`, passes alternate with its complement, the last
    /// writing the pattern.
    Overwrite {
        pattern: Vec<u8>,
        invert: bool,
        passes: u8,
    },
    /// Deallocate every block; each reads back as zeroes.
    BlockErase,
}

/// Where a device's sanitize stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SanitizeState {
    Idle,
    /// Under way; `progress` done out of 65,536.
    Running {
        progress: u16,
    },
    /// Failed: medium access fails until a sanitize succeeds or the
    /// failure mode is exited.
    Failed,
}

/// Which sanitize actions a device carries out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SanitizeSupport {
    pub overwrite: bool,
    pub block_erase: bool,
}

/// The storage behind a logical unit. Offsets and lengths are in bytes and
/// always whole logical blocks.
pub trait BlockDevice: Send + Sync {
    fn size(&self) -> u64;
    fn read_only(&self) -> bool;
    /// Sparse: unmapped blocks are deallocated and read back as zeroes.
    fn thin(&self) -> bool;
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError>;
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError>;
    /// Make the range read as zeroes; `unmap` allows deallocating it.
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
        fua: bool,
    ) -> Result<(), DeviceError>;
    /// Deallocate the range (advisory on thick devices).
    fn unmap(&self, offset: u64, len: u64) -> Result<(), DeviceError>;
    fn flush(&self) -> Result<(), DeviceError>;
    fn prefetch(&self, offset: u64, len: u64) -> Result<(), DeviceError>;
    /// Allocation map of `[offset, offset+len)`: `(offset, length, mapped)`
    /// runs in order, covering at least `offset`.
    fn mapping(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, DeviceError>;
    /// Would a write now wait on something other than the page cache (a
    /// migration pausing or throttling writes)? Callers that run small
    /// writes on an event loop send them to a worker thread instead.
    fn writes_may_wait(&self) -> bool {
        false
    }
    /// Read without blocking (e.g. from the page cache), or `Ok(None)` when
    /// that would block: the caller then reads on a worker thread.
    fn try_read_nowait(&self, _offset: u64, _len: usize) -> Result<Option<Vec<u8>>, DeviceError> {
        Ok(None)
    }
    /// The sanitize actions this device carries out (none by default).
    fn sanitize_support(&self) -> SanitizeSupport {
        SanitizeSupport::default()
    }
    /// Start a sanitize and return once it is under way (`wait` false) or
    /// has finished. From the start until it ends, medium access fails
    /// with [`DeviceError::Sanitizing`], whoever asks and whatever resets
    /// happen meanwhile.
    fn sanitize(
        &self,
        _action: SanitizeAction,
        _ause: bool,
        _wait: bool,
    ) -> Result<(), DeviceError> {
        Err(DeviceError::Io("sanitize is not supported".into()))
    }
    fn sanitize_state(&self) -> SanitizeState {
        SanitizeState::Idle
    }
    /// Leave the failure mode of a failed sanitize (EXIT FAILURE MODE);
    /// an error when that sanitize did not allow it (AUSE).
    fn exit_sanitize_failure(&self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// The ALUA states of the unit's target port groups now: this site's,
    /// and the other site's while or after the device migrates.
    fn port_groups(&self) -> PortGroups {
        PortGroups::default()
    }
}

/// An asymmetric access state of a target port group (SPC-4 5.15.2.4),
/// as REPORT TARGET PORT GROUPS encodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[repr(u8)]
pub enum AccessState {
    #[default]
    ActiveOptimized = 0x0,
    Standby = 0x2,
    Unavailable = 0x3,
    Transitioning = 0xf,
}

/// The states of a unit's target port groups: the local one (every portal
/// of this target) and, while or after the device migrates between sites,
/// the other site's group (its number and state).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PortGroups {
    pub local: AccessState,
    pub peer: Option<(u16, AccessState)>,
}

/// The relative target port identifier of portal `index` (from 0) of
/// target port group `group`: unique across every site that exports the
/// same device, as long as their groups differ and each has at most 15
/// portals (`group` keeps its low 12 bits; the portal the low 4).
pub fn relative_port(group: u16, index: usize) -> u16 {
    let portal = u16::try_from(index % 15).unwrap_or(0) + 1;
    ((group & 0x0fff) << 4) | portal
}

/// Where a unit keeps its persistent reservations when an initiator asks
/// for them to survive power loss (APTPL).
pub trait ReservationStore: Send + Sync {
    fn load(&self) -> Option<String>;
    /// Save durably before returning; `None` removes what was saved.
    fn save(&self, state: Option<&str>) -> Result<(), String>;
}

/// The identity a logical unit reports (INQUIRY, VPD 0x80/0x83).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The volume's name (product identification and T10 vendor id).
    pub name: String,
    /// 8-byte NAA designator (the volume's WWN, kept across migration).
    pub naa: [u8; 8],
    /// Unit serial number (VPD 0x80).
    pub serial: String,
    /// The iSCSI target name this unit is reached through.
    pub target_name: String,
    /// The target port group of this site's portals (ALUA), and the
    /// relative port of the portal in use (see [`relative_port`]).
    pub port_group: u16,
    pub relative_port: u16,
    /// How many portals (ports of the group) lead to this unit.
    pub port_count: u16,
}

/// One I_T nexus: an initiator port seen through this target.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Nexus {
    /// `<initiator name>,i,0x<ISID>` (the iSCSI initiator port name).
    pub initiator_port: String,
    /// Relative target port the nexus came in on.
    pub relative_port: u16,
}

/// The outcome of one command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScsiResponse {
    pub status: Status,
    /// Data-in bytes (already cut to the allocation length).
    pub data: Vec<u8>,
    /// Encoded sense data when `status` is CHECK CONDITION.
    pub sense: Vec<u8>,
    /// Bytes the command asked to move (SPDTL): data-in for reads, the
    /// data-out size it needs for writes. The transport compares it with
    /// the expected transfer length to set residuals.
    pub transfer_len: u64,
}

impl ScsiResponse {
    pub fn good(data: Vec<u8>) -> Self {
        let transfer_len = data.len() as u64;
        ScsiResponse {
            status: Status::Good,
            data,
            sense: Vec::new(),
            transfer_len,
        }
    }
    pub fn status(status: Status) -> Self {
        ScsiResponse {
            status,
            data: Vec::new(),
            sense: Vec::new(),
            transfer_len: 0,
        }
    }
}

/// Parse a volume WWN string like `naa.3xxxxxxxxxxxxxxx` into 8 bytes.
pub fn naa_bytes(wwn: &str) -> Option<[u8; 8]> {
    let hex = wwn.strip_prefix("naa.")?;
    if hex.len() != 16 {
        return None;
    }
    let mut out = [0u8; 8];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(i * 2..i * 2 + 2)?, 16).ok()?;
    }
    Some(out)
}
