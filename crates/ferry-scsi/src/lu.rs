//! One logical unit: shared state (mode pages, reservations, unit
//! attentions, medium-removal prevention) and the dispatch of every CDB to
//! its handler.

use crate::cdb::{be16, be24, be32, be64, byte};
use crate::inquiry::{
    self, MAX_COMPARE_WRITE_BLOCKS, MAX_TRANSFER_BLOCKS, MAX_UNMAP_BLOCKS, MAX_UNMAP_DESCRIPTORS,
    MAX_WRITE_SAME_BLOCKS,
};
use crate::mode::{self, ModeState, PageControl};
use crate::opcodes::{self, op};
use crate::pr::{Access, Reservations};
use crate::sense::Sense;
use crate::xcopy::{self, CopyTargets};
use crate::{BlockDevice, DeviceError, Identity, Nexus, ScsiResponse, Status};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// Geometry and provisioning of a logical unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LuConfig {
    /// Logical block size in bytes (512 or 4096).
    pub block_size: u32,
    /// Physical block size reported to initiators.
    pub physical_block: u32,
    /// Thin provisioned: UNMAP deallocates and unmapped blocks read zero.
    pub thin: bool,
}

#[derive(Debug, Default)]
struct LuState {
    mode: ModeState,
    res: Reservations,
    /// Pending unit attentions per initiator port.
    ua: HashMap<String, Vec<Sense>>,
    /// Initiator ports that have sent a command (they get unit attentions).
    seen: HashSet<String>,
    /// Initiator ports that prevent medium removal.
    prevent: HashSet<String>,
    blocks: u64,
    /// EXTENDED COPY results kept for RECEIVE COPY RESULTS, by initiator
    /// port and list identifier.
    copies: HashMap<(String, u8), xcopy::CopyStatus>,
}

/// A logical unit backed by a [`BlockDevice`].
pub struct LogicalUnit {
    dev: Arc<dyn BlockDevice>,
    id: Identity,
    cfg: LuConfig,
    state: Mutex<LuState>,
    /// Plain writes share it; COMPARE AND WRITE and ORWRITE take it alone,
    /// so their read-modify-write is atomic against every other writer of
    /// this unit.
    atomic: RwLock<()>,
    /// Resolves other units for EXTENDED COPY.
    copy_targets: RwLock<Option<Arc<dyn CopyTargets>>>,
    /// Keeps persistent reservations across restarts (APTPL).
    pr_store: RwLock<Option<Arc<dyn crate::ReservationStore>>>,
}

type Outcome = Result<ScsiResponse, Sense>;

fn dev_sense(e: &DeviceError, write: bool) -> Sense {
    match e {
        DeviceError::OutOfRange => Sense::LBA_OUT_OF_RANGE,
        DeviceError::ReadOnly => Sense::WRITE_PROTECTED,
        DeviceError::Gone(_) => Sense::LU_NOT_ACCESSIBLE,
        DeviceError::Transitioning(_) => Sense::ALUA_TRANSITION,
        DeviceError::NoSpace => Sense::SPACE_ALLOCATION_FAILED,
        DeviceError::Io(_) if write => Sense::WRITE_ERROR,
        DeviceError::Io(_) => Sense::UNRECOVERED_READ_ERROR,
        DeviceError::Sanitizing => Sense::SANITIZE_IN_PROGRESS,
        DeviceError::SanitizeFailed => Sense::SANITIZE_FAILED,
    }
}

/// Commands a unit answers while a sanitize runs (SBC-4 4.11.2); every
/// other one ends with NOT READY, SANITIZE IN PROGRESS.
fn allowed_while_sanitizing(opcode: u8) -> bool {
    matches!(
        opcode,
        op::INQUIRY | op::REPORT_LUNS | op::REQUEST_SENSE | op::MAINTENANCE_IN
    )
}

fn access_of(opcode: u8) -> Access {
    match opcode {
        op::INQUIRY
        | op::REPORT_LUNS
        | op::REQUEST_SENSE
        | op::PERSISTENT_RESERVE_IN
        | op::PERSISTENT_RESERVE_OUT
        | op::MAINTENANCE_IN
        | op::RELEASE_6
        | op::RELEASE_10
        | op::RECEIVE_COPY_RESULTS => Access::Always,
        op::TEST_UNIT_READY | op::READ_CAPACITY_10 | op::PREVENT_ALLOW_MEDIUM_REMOVAL => {
            Access::Meta
        }
        op::SERVICE_ACTION_IN_16 => Access::Meta,
        op::RESERVE_6 | op::RESERVE_10 => Access::Spc2,
        0x08
        | 0x28
        | 0xa8
        | 0x88
        | 0x2f
        | 0xaf
        | 0x8f
        | 0x34
        | 0x90
        | 0x1a
        | 0x5a
        | 0x37
        | op::READ_DEFECT_DATA_12 => Access::Read,
        _ => Access::Write,
    }
}

fn cut(mut data: Vec<u8>, alloc: usize) -> ScsiResponse {
    data.truncate(alloc);
    ScsiResponse::good(data)
}

/// REPORT LUNS for a target whose units are `luns` (single-level LUNs:
/// peripheral addressing below 256, flat addressing up to 16383).
pub fn report_luns(cdb: &[u8], luns: &[u64]) -> Result<Vec<u8>, Sense> {
    let alloc = be32(cdb, 6) as usize;
    if alloc < 16 {
        return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 6, None));
    }
    if !matches!(byte(cdb, 2), 0x00 | 0x01 | 0x02 | 0x10 | 0x11 | 0x12) {
        return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 2, None));
    }
    let mut d = ((luns.len() * 8) as u32).to_be_bytes().to_vec();
    d.extend_from_slice(&[0; 4]);
    for &l in luns {
        let mut e = [0u8; 8];
        if l < 256 {
            e[1] = l as u8;
        } else {
            e[0] = 0x40 | ((l >> 8) as u8 & 0x3f);
            e[1] = l as u8;
        }
        d.extend_from_slice(&e);
    }
    d.truncate(alloc);
    Ok(d)
}

/// Where the LBA, length and flags of a medium-access CDB live.
struct Rw {
    lba: u64,
    blocks: u64,
    flags: u8,
}

fn rw_fields(cdb: &[u8]) -> Rw {
    let op = byte(cdb, 0);
    match op {
        op::READ_6 | op::WRITE_6 => {
            let n = u64::from(byte(cdb, 4));
            Rw {
                lba: u64::from(be24(cdb, 1) & 0x1f_ffff),
                blocks: if n == 0 { 256 } else { n },
                flags: 0,
            }
        }
        op::READ_10
        | op::WRITE_10
        | op::WRITE_AND_VERIFY_10
        | op::VERIFY_10
        | op::PRE_FETCH_10
        | op::SYNCHRONIZE_CACHE_10
        | op::WRITE_SAME_10 => Rw {
            lba: u64::from(be32(cdb, 2)),
            blocks: u64::from(be16(cdb, 7)),
            flags: byte(cdb, 1),
        },
        op::READ_12 | op::WRITE_12 | op::WRITE_AND_VERIFY_12 | op::VERIFY_12 => Rw {
            lba: u64::from(be32(cdb, 2)),
            blocks: u64::from(be32(cdb, 6)),
            flags: byte(cdb, 1),
        },
        op::COMPARE_AND_WRITE => Rw {
            lba: be64(cdb, 2),
            blocks: u64::from(byte(cdb, 13)),
            flags: byte(cdb, 1),
        },
        _ => Rw {
            lba: be64(cdb, 2),
            blocks: u64::from(be32(cdb, 10)),
            flags: byte(cdb, 1),
        },
    }
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

impl LogicalUnit {
    pub fn new(dev: Arc<dyn BlockDevice>, id: Identity, cfg: LuConfig) -> LogicalUnit {
        let blocks = dev.size() / u64::from(cfg.block_size);
        LogicalUnit {
            dev,
            id,
            cfg,
            state: Mutex::new(LuState {
                blocks,
                ..LuState::default()
            }),
            atomic: RwLock::new(()),
            copy_targets: RwLock::new(None),
            pr_store: RwLock::new(None),
        }
    }

    /// Keep APTPL reservations in `store`, and take up any saved there.
    pub fn set_reservation_store(&self, store: Arc<dyn crate::ReservationStore>) {
        if let Some(r) = store.load().as_deref().and_then(Reservations::load) {
            self.state.lock().res = r;
        }
        *self.pr_store.write() = Some(store);
    }

    /// Let EXTENDED COPY reach other units (by NAA designator).
    pub fn set_copy_targets(&self, t: Arc<dyn CopyTargets>) {
        *self.copy_targets.write() = Some(t);
    }

    /// See [`BlockDevice::writes_may_wait`]; also true when the write cache
    /// is off (every write then waits for the disk).
    pub fn writes_may_wait(&self) -> bool {
        self.dev.writes_may_wait() || !self.state.lock().mode.wce
    }

    pub fn identity(&self) -> &Identity {
        &self.id
    }
    pub fn block_size(&self) -> u32 {
        self.cfg.block_size
    }
    fn bs(&self) -> u64 {
        u64::from(self.cfg.block_size)
    }
    fn blocks(&self) -> u64 {
        self.dev.size() / self.bs()
    }

    /// READ(10)/READ(16) of at most `max` bytes served without blocking, for
    /// callers on an event loop. `None`: not such a command, something to
    /// report first (unit attention, reservation), or the data is not in
    /// memory; run [`LogicalUnit::execute`] on a worker instead.
    pub fn try_read_nowait(&self, nexus: &Nexus, cdb: &[u8], max: u64) -> Option<ScsiResponse> {
        if !matches!(byte(cdb, 0), 0x28 | 0x88) {
            return None;
        }
        {
            let st = self.state.lock();
            let quiet = st
                .ua
                .get(&nexus.initiator_port)
                .is_none_or(|q| q.is_empty())
                && st.res.check(&nexus.initiator_port, Access::Read)
                && st.blocks == self.blocks();
            if !quiet || !st.seen.contains(&nexus.initiator_port) {
                return None;
            }
        }
        let (_, off, len) = self
            .medium_range(cdb, u64::from(MAX_TRANSFER_BLOCKS))
            .ok()?;
        if len == 0 || len > max {
            return None;
        }
        let data = self.dev.try_read_nowait(off, len as usize).ok()??;
        Some(ScsiResponse::good(data))
    }

    /// Encode sense data in the format the control mode page selects.
    pub fn sense_bytes(&self, s: &Sense) -> Vec<u8> {
        s.encode(self.state.lock().mode.d_sense)
    }

    fn check_condition(&self, s: Sense, transfer_len: u64) -> ScsiResponse {
        ScsiResponse {
            status: Status::CheckCondition,
            data: Vec::new(),
            sense: self.sense_bytes(&s),
            transfer_len,
        }
    }

    /// Queue a unit attention for every initiator port that has been seen.
    fn unit_attention_all(st: &mut LuState, s: Sense) {
        let ports: Vec<String> = st.seen.iter().cloned().collect();
        for p in ports {
            let q = st.ua.entry(p).or_default();
            if !q.contains(&s) {
                q.push(s);
            }
        }
    }

    /// LOGICAL UNIT RESET (and TARGET WARM/COLD RESET, `power_on`):
    /// SPC-2 reservations and removal prevention end; every nexus
    /// gets a unit attention, the issuer included.
    pub fn reset(&self, power_on: bool, issuer: Option<&Nexus>) {
        let mut st = self.state.lock();
        st.res.reset();
        st.prevent.clear();
        st.mode = ModeState::default();
        let s = if power_on {
            Sense::POWER_ON_RESET
        } else {
            Sense::BUS_DEVICE_RESET
        };
        Self::unit_attention_all(&mut st, s);
        if let Some(n) = issuer {
            // The issuer gets one too (SAM-5), even before its first command.
            let q = st.ua.entry(n.initiator_port.clone()).or_default();
            if !q.contains(&s) {
                q.push(s);
            }
        }
    }

    /// The I_T nexus ended (logout, connection loss, or a new session
    /// reinstating it): its SPC-2 reservation, removal prevention and
    /// pending unit attentions go; persistent reservations stay.
    pub fn nexus_lost(&self, nexus: &Nexus) {
        let mut st = self.state.lock();
        st.res.nexus_lost(&nexus.initiator_port);
        st.prevent.remove(&nexus.initiator_port);
        st.seen.remove(&nexus.initiator_port);
        st.ua.remove(&nexus.initiator_port);
    }

    /// Execute one command. `data_out` holds the data-out bytes the
    /// initiator sent (the transport's expected transfer length).
    pub fn execute(&self, nexus: &Nexus, cdb: &[u8], data_out: &[u8]) -> ScsiResponse {
        let opcode = byte(cdb, 0);
        {
            let mut st = self.state.lock();
            let blocks = self.blocks();
            if blocks != st.blocks {
                st.blocks = blocks;
                Self::unit_attention_all(&mut st, Sense::CAPACITY_CHANGED);
            }
            st.seen.insert(nexus.initiator_port.clone());
            if !matches!(opcode, op::INQUIRY | op::REPORT_LUNS | op::REQUEST_SENSE) {
                if let Some(q) = st.ua.get_mut(&nexus.initiator_port) {
                    if !q.is_empty() {
                        let s = q.remove(0);
                        drop(st);
                        return self.check_condition(s, 0);
                    }
                }
            }
            if !st.res.check(&nexus.initiator_port, access_of(opcode)) {
                return ScsiResponse::status(Status::ReservationConflict);
            }
        }
        if let crate::SanitizeState::Running { progress } = self.dev.sanitize_state() {
            if !allowed_while_sanitizing(opcode) {
                return self.check_condition(Sense::SANITIZE_IN_PROGRESS.progress(progress), 0);
            }
        }
        match self.dispatch(nexus, cdb, data_out) {
            Ok(r) => r,
            Err(s) => {
                let transfer_len = self.expected_out(cdb);
                self.check_condition(s, transfer_len)
            }
        }
    }

    /// The data-out length a write-class CDB calls for (0 for others).
    fn expected_out(&self, cdb: &[u8]) -> u64 {
        let rw = rw_fields(cdb);
        match byte(cdb, 0) {
            op::WRITE_6
            | op::WRITE_10
            | op::WRITE_12
            | op::WRITE_16
            | op::WRITE_AND_VERIFY_10
            | op::WRITE_AND_VERIFY_12
            | op::WRITE_AND_VERIFY_16
            | op::ORWRITE_16
            | op::WRITE_ATOMIC_16 => rw.blocks * self.bs(),
            op::COMPARE_AND_WRITE => 2 * rw.blocks * self.bs(),
            _ => 0,
        }
    }

    fn range(&self, lba: u64, blocks: u64) -> Result<(u64, u64), Sense> {
        let total = self.blocks();
        match lba.checked_add(blocks) {
            Some(end) if end <= total && lba <= total => Ok((lba * self.bs(), blocks * self.bs())),
            _ => Err(Sense::LBA_OUT_OF_RANGE.with_info(lba)),
        }
    }

    fn writable(&self) -> Result<(), Sense> {
        if self.dev.read_only() {
            return Err(Sense::WRITE_PROTECTED);
        }
        if self.state.lock().mode.swp {
            return Err(Sense::new(crate::sense::DATA_PROTECT, 0x27, 0x02));
        }
        Ok(())
    }

    fn fua(&self, flags: u8) -> bool {
        flags & 0x08 != 0 || !self.state.lock().mode.wce
    }

    fn dispatch(&self, nexus: &Nexus, cdb: &[u8], out: &[u8]) -> Outcome {
        let op = byte(cdb, 0);
        let port = &nexus.initiator_port;
        match op {
            op::TEST_UNIT_READY => Ok(ScsiResponse::good(Vec::new())),
            op::REQUEST_SENSE => self.request_sense(port, cdb),
            op::INQUIRY => self.inquiry(nexus, cdb),
            op::MODE_SENSE_6 | op::MODE_SENSE_10 => self.mode_sense(cdb),
            op::MODE_SELECT_6 | op::MODE_SELECT_10 => self.mode_select(cdb, out),
            op::RESERVE_6 | op::RESERVE_10 => self.reserve_spc2(op, port, cdb),
            op::RELEASE_6 | op::RELEASE_10 => {
                self.state.lock().res.spc2_release(port);
                Ok(ScsiResponse::good(Vec::new()))
            }
            op::START_STOP_UNIT => self.start_stop_unit(cdb),
            op::PREVENT_ALLOW_MEDIUM_REMOVAL => self.prevent_allow(port, cdb),
            op::READ_CAPACITY_10 => self.read_capacity_10(cdb),
            op::SERVICE_ACTION_IN_16 => self.service_action_in(cdb),
            op::REPORT_LUNS => report_luns(cdb, &[0]).map(ScsiResponse::good),
            op::MAINTENANCE_IN => self.maintenance_in(cdb),
            op::PERSISTENT_RESERVE_IN => {
                let alloc = crate::pr::pr_in_alloc(cdb);
                let d = self.state.lock().res.pr_in(cdb)?;
                Ok(cut(d, alloc))
            }
            op::PERSISTENT_RESERVE_OUT => self.persistent_reserve_out(port, cdb, out),
            op::READ_DEFECT_DATA_10 | op::READ_DEFECT_DATA_12 => self.read_defect_data(op, cdb),
            op::READ_6 | op::READ_10 | op::READ_12 | op::READ_16 => self.read(cdb),
            op::WRITE_6 | op::WRITE_10 | op::WRITE_12 | op::WRITE_16 => self.write(cdb, out, false),
            op::WRITE_AND_VERIFY_10 | op::WRITE_AND_VERIFY_12 | op::WRITE_AND_VERIFY_16 => {
                self.write(cdb, out, true)
            }
            op::VERIFY_10 | op::VERIFY_12 | op::VERIFY_16 => self.verify(cdb, out),
            op::PRE_FETCH_10 | op::PRE_FETCH_16 => self.pre_fetch(cdb),
            op::SYNCHRONIZE_CACHE_10 | op::SYNCHRONIZE_CACHE_16 => self.synchronize_cache(cdb),
            op::WRITE_SAME_10 | op::WRITE_SAME_16 => self.write_same(cdb, out),
            op::UNMAP => self.unmap(cdb, out),
            op::COMPARE_AND_WRITE => self.compare_and_write(cdb, out),
            op::WRITE_ATOMIC_16 => self.write_atomic(cdb, out),
            op::SANITIZE => self.sanitize(cdb, out),
            op::EXTENDED_COPY => self.extended_copy(nexus, cdb, out),
            op::RECEIVE_COPY_RESULTS => self.receive_copy_results(port, cdb),
            op::ORWRITE_16 => self.orwrite(cdb, out),
            _ => Err(Sense::INVALID_OPCODE),
        }
    }

    /// REQUEST SENSE: the nexus's next unit attention, else a sanitize's progress, else no sense.
    fn request_sense(&self, port: &str, cdb: &[u8]) -> Outcome {
        let alloc = usize::from(byte(cdb, 4));
        let desc = byte(cdb, 1) & 0x01 != 0;
        let s = {
            let mut st = self.state.lock();
            match st.ua.get_mut(port) {
                Some(q) if !q.is_empty() => q.remove(0),
                _ => match self.dev.sanitize_state() {
                    // The progress of a sanitize under way.
                    crate::SanitizeState::Running { progress } => {
                        Sense::SANITIZE_IN_PROGRESS.progress(progress)
                    }
                    _ => Sense::new(crate::sense::NO_SENSE, 0, 0),
                },
            }
        };
        Ok(cut(s.encode(desc), alloc))
    }

    /// RESERVE(6)/(10): the SPC-2 reservation of the whole unit.
    fn reserve_spc2(&self, op: u8, port: &str, cdb: &[u8]) -> Outcome {
        if op == 0x16 && byte(cdb, 1) & 0x01 != 0 || op == 0x56 && byte(cdb, 1) & 0x12 != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, None));
        }
        if self.state.lock().res.spc2_reserve(port) {
            Ok(ScsiResponse::good(Vec::new()))
        } else {
            Ok(ScsiResponse::status(Status::ReservationConflict))
        }
    }

    /// START STOP UNIT: an eject is refused while medium removal is prevented.
    fn start_stop_unit(&self, cdb: &[u8]) -> Outcome {
        let loej = byte(cdb, 4) & 0x02 != 0;
        let start = byte(cdb, 4) & 0x01 != 0;
        let power = byte(cdb, 4) >> 4;
        if loej && !start && power == 0 && !self.state.lock().prevent.is_empty() {
            return Err(Sense::MEDIUM_REMOVAL_PREVENTED);
        }
        Ok(ScsiResponse::good(Vec::new()))
    }

    /// PREVENT ALLOW MEDIUM REMOVAL, kept per initiator port.
    fn prevent_allow(&self, port: &str, cdb: &[u8]) -> Outcome {
        let mut st = self.state.lock();
        match byte(cdb, 4) & 0x03 {
            0 => {
                st.prevent.remove(port);
            }
            1 => {
                st.prevent.insert(port.to_owned());
            }
            _ => return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 4, Some(1))),
        }
        Ok(ScsiResponse::good(Vec::new()))
    }

    /// READ CAPACITY(10).
    fn read_capacity_10(&self, cdb: &[u8]) -> Outcome {
        if byte(cdb, 8) & 0x01 == 0 && be32(cdb, 2) != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 2, None));
        }
        let last = self.blocks().saturating_sub(1);
        let mut d = (last.min(u64::from(u32::MAX)) as u32)
            .to_be_bytes()
            .to_vec();
        d.extend_from_slice(&self.cfg.block_size.to_be_bytes());
        Ok(ScsiResponse::good(d))
    }

    /// MAINTENANCE IN: REPORT TARGET PORT GROUPS and REPORT SUPPORTED OPERATION CODES (SANITIZE as the device supports it).
    fn maintenance_in(&self, cdb: &[u8]) -> Outcome {
        let alloc = be32(cdb, 6) as usize;
        match byte(cdb, 1) & 0x1f {
            0x0a => Ok(cut(self.report_target_port_groups(cdb), alloc)),
            0x0c => {
                let support = self.dev.sanitize_support();
                let report = opcodes::report(cdb, |c| {
                    c.opcode != op::SANITIZE
                        || match c.service_action {
                            Some(0x01) => support.overwrite,
                            Some(0x02) => support.block_erase,
                            _ => support.overwrite || support.block_erase,
                        }
                })?;
                Ok(cut(report, alloc))
            }
            _ => Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(4))),
        }
    }

    /// PERSISTENT RESERVE OUT: the change, the unit attentions it causes, and (APTPL) the saved state, saved under the lock.
    fn persistent_reserve_out(&self, port: &str, cdb: &[u8], out: &[u8]) -> Outcome {
        let r = {
            let mut st = self.state.lock();
            let was = st.res.persistent();
            match st.res.pr_out(port, cdb, out) {
                Ok((_, notices)) => {
                    for (p, s) in notices {
                        st.ua.entry(p).or_default().push(s);
                    }
                    // Saved under the lock, so saves keep the
                    // order of the changes.
                    let now = st.res.persistent();
                    if was || now {
                        let text = now.then(|| st.res.save());
                        if let Some(store) = self.pr_store.read().as_ref() {
                            if store.save(text.as_deref()).is_err() {
                                return Err(Sense::INTERNAL_TARGET_FAILURE);
                            }
                        }
                    }
                    Ok(())
                }
                Err(e) => Err(e),
            }
        };
        match r {
            Ok(()) => Ok(ScsiResponse::good(Vec::new())),
            Err((Status::CheckCondition, Some(s))) => Err(s),
            Err((status, _)) => Ok(ScsiResponse::status(status)),
        }
    }

    /// READ DEFECT DATA(10)/(12): an empty list.
    fn read_defect_data(&self, op: u8, cdb: &[u8]) -> Outcome {
        let flags = byte(cdb, if op == 0x37 { 2 } else { 1 }) & 0x1f;
        let (mut d, alloc) = if op == 0x37 {
            (vec![0, flags, 0, 0], usize::from(be16(cdb, 7)))
        } else {
            (vec![0, flags, 0, 0, 0, 0, 0, 0], be32(cdb, 6) as usize)
        };
        d.truncate(alloc);
        Ok(ScsiResponse::good(d))
    }

    /// PRE-FETCH(10)/(16).
    fn pre_fetch(&self, cdb: &[u8]) -> Outcome {
        let rw = rw_fields(cdb);
        let (off, len) = self.range(rw.lba, rw.blocks)?;
        if len > 0 {
            self.dev
                .prefetch(off, len)
                .map_err(|e| dev_sense(&e, false))?;
        }
        Ok(ScsiResponse::good(Vec::new()))
    }

    /// SYNCHRONIZE CACHE(10)/(16): the whole device is flushed.
    fn synchronize_cache(&self, cdb: &[u8]) -> Outcome {
        let rw = rw_fields(cdb);
        self.range(rw.lba, rw.blocks)?;
        self.dev.flush().map_err(|e| dev_sense(&e, true))?;
        Ok(ScsiResponse::good(Vec::new()))
    }

    /// RECEIVE COPY RESULTS: a copy's status, or the operating parameters.
    fn receive_copy_results(&self, port: &str, cdb: &[u8]) -> Outcome {
        let alloc = be32(cdb, 10) as usize;
        match byte(cdb, 1) & 0x1f {
            0x00 => {
                let key = (port.to_owned(), byte(cdb, 2));
                match self.state.lock().copies.get(&key) {
                    Some(s) => Ok(cut(xcopy::copy_status(s), alloc)),
                    None => Err(Sense::INVALID_FIELD_IN_CDB.field(true, 2, None)),
                }
            }
            0x03 => Ok(cut(xcopy::operating_parameters(), alloc)),
            _ => Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(4))),
        }
    }

    /// SERVICE ACTION IN(16): READ CAPACITY(16) and GET LBA STATUS.
    fn service_action_in(&self, cdb: &[u8]) -> Outcome {
        match byte(cdb, 1) & 0x1f {
            0x10 => {
                let alloc = be32(cdb, 10) as usize;
                let mut d = vec![0u8; 32];
                d[0..8].copy_from_slice(&self.blocks().saturating_sub(1).to_be_bytes());
                d[8..12].copy_from_slice(&self.cfg.block_size.to_be_bytes());
                let exp = (self.cfg.physical_block / self.cfg.block_size.max(1)).max(1);
                d[13] = exp.trailing_zeros() as u8 & 0x0f;
                if self.cfg.thin {
                    d[14] = 0x80 | 0x40; // LBPME, LBPRZ
                }
                Ok(cut(d, alloc))
            }
            0x12 => self.get_lba_status(cdb),
            _ => Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(4))),
        }
    }

    /// REPORT TARGET PORT GROUPS: this site's group (every portal one
    /// port) and, while or after the device migrates, the other site's
    /// (its first portal), each in the state the device reports (implicit
    /// ALUA: the target changes them, at the migration's pause and switch).
    fn report_target_port_groups(&self, cdb: &[u8]) -> Vec<u8> {
        let extended = byte(cdb, 1) >> 5 == 1;
        let groups = self.dev.port_groups();
        let local = self.id.port_group;
        let ports: Vec<u16> = (0..usize::from(self.id.port_count.max(1)))
            .map(|i| crate::relative_port(local, i))
            .collect();
        let mut body = Vec::new();
        let mut group = |id: u16, state: crate::AccessState, ports: &[u16]| {
            body.push(state as u8);
            // T_SUP, U_SUP, S_SUP, AO_SUP: the states ferry reports.
            body.push(0x80 | 0x08 | 0x04 | 0x01);
            body.extend_from_slice(&id.to_be_bytes());
            body.extend_from_slice(&[0, 0, 0]); // status, vendor specific
            body.push(u8::try_from(ports.len()).unwrap_or(u8::MAX));
            for p in ports {
                body.extend_from_slice(&[0, 0]);
                body.extend_from_slice(&p.to_be_bytes());
            }
        };
        group(local, groups.local, &ports);
        if let Some((peer, state)) = groups.peer.filter(|(g, _)| *g != local) {
            group(peer, state, &[crate::relative_port(peer, 0)]);
        }
        let mut d = (body.len() as u32 + if extended { 4 } else { 0 })
            .to_be_bytes()
            .to_vec();
        if extended {
            // Implicit transitions take about one migration pause.
            d.extend_from_slice(&[0x10, 0, 0, 0]);
        }
        d.extend_from_slice(&body);
        d
    }

    fn inquiry(&self, nexus: &Nexus, cdb: &[u8]) -> Outcome {
        let alloc = usize::from(be16(cdb, 3));
        let evpd = byte(cdb, 1) & 0x01 != 0;
        if byte(cdb, 1) & 0xfe != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, None));
        }
        if !evpd {
            if byte(cdb, 2) != 0 {
                return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 2, None));
            }
            return Ok(cut(inquiry::standard(&self.id), alloc));
        }
        let mut id = self.id.clone();
        id.relative_port = nexus.relative_port;
        match inquiry::vpd(
            byte(cdb, 2),
            &id,
            &self.cfg,
            self.blocks(),
            self.dev.sanitize_support(),
        ) {
            Some(d) => Ok(cut(d, alloc)),
            None => Err(Sense::INVALID_FIELD_IN_CDB.field(true, 2, None)),
        }
    }

    fn mode_sense(&self, cdb: &[u8]) -> Outcome {
        let ten = byte(cdb, 0) == 0x5a;
        let dbd = byte(cdb, 1) & 0x08 != 0;
        let llbaa = ten && byte(cdb, 1) & 0x10 != 0;
        let pc = match byte(cdb, 2) >> 6 {
            0 => PageControl::Current,
            1 => PageControl::Changeable,
            2 => PageControl::Default,
            _ => return Err(Sense::SAVING_PARAMS_UNSUPPORTED),
        };
        let alloc = if ten {
            usize::from(be16(cdb, 7))
        } else {
            usize::from(byte(cdb, 4))
        };
        let st = self.state.lock().mode;
        let pages = mode::pages(byte(cdb, 2) & 0x3f, byte(cdb, 3), &st, pc)?;
        let mut desc = Vec::new();
        if !dbd {
            let blocks = self.blocks();
            if llbaa {
                desc.extend_from_slice(&blocks.to_be_bytes());
                desc.extend_from_slice(&[0, 0, 0, 0]);
                desc.extend_from_slice(&self.cfg.block_size.to_be_bytes());
            } else {
                desc.extend_from_slice(&(blocks.min(0xffff_ffff) as u32).to_be_bytes());
                desc.push(0);
                desc.extend_from_slice(&self.cfg.block_size.to_be_bytes()[1..]);
            }
        }
        let mut dsp = 0x10; // DPOFUA
        if self.dev.read_only() || st.swp {
            dsp |= 0x80;
        }
        let mut d = if ten {
            let total = 8 + desc.len() + pages.len();
            let mut h = ((total - 2) as u16).to_be_bytes().to_vec();
            h.extend_from_slice(&[0, dsp, if llbaa { 1 } else { 0 }, 0]);
            h.extend_from_slice(&(desc.len() as u16).to_be_bytes());
            h
        } else {
            let total = 4 + desc.len() + pages.len();
            vec![(total - 1).min(255) as u8, 0, dsp, desc.len() as u8]
        };
        d.extend_from_slice(&desc);
        d.extend_from_slice(&pages);
        Ok(cut(d, alloc))
    }

    fn mode_select(&self, cdb: &[u8], out: &[u8]) -> Outcome {
        let ten = byte(cdb, 0) == 0x55;
        if byte(cdb, 1) & 0x01 != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(0)));
        }
        let len = if ten {
            usize::from(be16(cdb, 7))
        } else {
            usize::from(byte(cdb, 4))
        };
        let p = &out[..len.min(out.len())];
        let hdr = if ten { 8 } else { 4 };
        if p.is_empty() {
            return Ok(ScsiResponse::good(Vec::new()));
        }
        if p.len() < hdr {
            return Err(Sense::PARAM_LIST_LENGTH_ERROR);
        }
        let bdl = if ten {
            usize::from(be16(p, 6))
        } else {
            usize::from(p[3])
        };
        let Some(rest) = p.get(hdr + bdl..) else {
            return Err(Sense::PARAM_LIST_LENGTH_ERROR);
        };
        let mut st = self.state.lock();
        let mut m = st.mode;
        mode::select(rest, &mut m)?;
        st.mode = m;
        Ok(ScsiResponse::good(Vec::new()))
    }

    fn read(&self, cdb: &[u8]) -> Outcome {
        let (_, off, len) = self.medium_range(cdb, u64::from(MAX_TRANSFER_BLOCKS))?;
        let mut buf = vec![0u8; len as usize];
        if len > 0 {
            self.dev
                .read_at(off, &mut buf)
                .map_err(|e| dev_sense(&e, false))?;
        }
        Ok(ScsiResponse::good(buf))
    }

    /// The checks every medium-access CDB shares: no protection information
    /// (ferry formats none), at most `max` blocks, inside the medium.
    /// Returns the decoded fields and the byte offset and length.
    fn medium_range(&self, cdb: &[u8], max: u64) -> Result<(Rw, u64, u64), Sense> {
        let rw = rw_fields(cdb);
        if rw.flags >> 5 != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(7)));
        }
        if rw.blocks > max {
            let at = match byte(cdb, 0) {
                op::COMPARE_AND_WRITE => 13,
                op::WRITE_ATOMIC_16 => 12,
                op if op >> 5 == 5 => 6,
                op if op >> 5 == 4 => 10,
                op if op >> 5 == 0 => 4,
                _ => 7,
            };
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, at, None));
        }
        let (off, len) = self.range(rw.lba, rw.blocks)?;
        Ok((rw, off, len))
    }

    /// Data-out must be exactly what the CDB calls for; otherwise nothing
    /// is written and the transport reports the residual.
    /// SANITIZE (SBC-4 5.30): OVERWRITE and BLOCK ERASE of every block,
    /// EXIT FAILURE MODE. The device carries it out and keeps it going
    /// across resets and lost connections; without IMMED the command ends
    /// when the sanitize does.
    fn sanitize(&self, cdb: &[u8], out: &[u8]) -> Outcome {
        let b1 = byte(cdb, 1);
        let immed = b1 & 0x80 != 0;
        let ause = b1 & 0x20 != 0;
        if b1 & 0x40 != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(6)));
        }
        if let Some(i) = (2u16..7).find(|&i| byte(cdb, usize::from(i)) != 0) {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, i, None));
        }
        let plen = usize::from(be16(cdb, 7));
        let support = self.dev.sanitize_support();
        let bs = self.bs() as usize;
        let action = match b1 & 0x1f {
            0x01 if support.overwrite => {
                if plen < 5 || plen > bs + 4 {
                    return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 7, None));
                }
                if out.len() < plen {
                    return Err(Sense::PARAM_LIST_LENGTH_ERROR);
                }
                let p = &out[..plen];
                let passes = p[0] & 0x1f;
                if passes == 0 {
                    return Err(Sense::INVALID_FIELD_IN_PARAM_LIST.field(false, 0, Some(4)));
                }
                // TEST selects vendor-specific test modes: none here.
                if p[0] & 0x60 != 0 {
                    return Err(Sense::INVALID_FIELD_IN_PARAM_LIST.field(false, 0, Some(6)));
                }
                let len = usize::from(be16(p, 2));
                if len == 0 || len > bs || len + 4 > plen {
                    return Err(Sense::INVALID_FIELD_IN_PARAM_LIST.field(false, 2, None));
                }
                crate::SanitizeAction::Overwrite {
                    pattern: p[4..4 + len].to_vec(),
                    invert: p[0] & 0x80 != 0,
                    passes,
                }
            }
            0x02 if support.block_erase => {
                if plen != 0 {
                    return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 7, None));
                }
                crate::SanitizeAction::BlockErase
            }
            0x1f if support.overwrite || support.block_erase => {
                if plen != 0 {
                    return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 7, None));
                }
                self.writable()?;
                // Refused when the failed sanitize did not set AUSE.
                self.dev
                    .exit_sanitize_failure()
                    .map_err(|_| Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(4)))?;
                return Ok(ScsiResponse::good(Vec::new()));
            }
            _ => return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(4))),
        };
        self.writable()?;
        self.dev
            .sanitize(action, ause, !immed)
            .map_err(|e| dev_sense(&e, true))?;
        Ok(ScsiResponse::good(Vec::new()))
    }

    fn need_out(out: &[u8], want: u64) -> Result<(), Sense> {
        if out.len() as u64 != want {
            return Err(Sense::new(crate::sense::ILLEGAL_REQUEST, 0x0e, 0x03));
        }
        Ok(())
    }

    fn write(&self, cdb: &[u8], out: &[u8], verify: bool) -> Outcome {
        let (rw, off, len) = self.medium_range(cdb, u64::from(MAX_TRANSFER_BLOCKS))?;
        self.writable()?;
        // When the transport's expected length differs from the CDB's, only
        // the overlap is written (FCP-4 / SAM-5 residual rule a); the
        // transport reports the residual.
        let n = (out.len() as u64).min(len) as usize;
        if n > 0 {
            let _shared = self.atomic.read();
            self.dev
                .write_at(off, &out[..n], verify || self.fua(rw.flags))
                .map_err(|e| dev_sense(&e, true))?;
        }
        let mut r = ScsiResponse::good(Vec::new());
        r.transfer_len = len;
        Ok(r)
    }

    fn verify(&self, cdb: &[u8], out: &[u8]) -> Outcome {
        let bytchk = (byte(cdb, 1) >> 1) & 0x03;
        if bytchk == 2 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(2)));
        }
        let (_, off, len) = self.medium_range(cdb, u64::from(MAX_TRANSFER_BLOCKS))?;
        let want = match bytchk {
            0 => 0,
            1 => len,
            _ => self.bs().min(len),
        };
        Self::need_out(out, want)?;
        let mut medium = vec![0u8; len as usize];
        if len > 0 {
            self.dev
                .read_at(off, &mut medium)
                .map_err(|e| dev_sense(&e, false))?;
        }
        if bytchk != 0 {
            let bs = self.bs() as usize;
            let mismatch = if bytchk == 1 {
                first_difference(&medium, out)
            } else {
                medium
                    .chunks(bs)
                    .enumerate()
                    .find_map(|(i, blk)| first_difference(blk, out).map(|p| i * bs + p))
            };
            if let Some(at) = mismatch {
                return Err(Sense::MISCOMPARE_DURING_VERIFY.with_info(at as u64));
            }
        }
        let mut r = ScsiResponse::good(Vec::new());
        r.transfer_len = want;
        Ok(r)
    }

    fn write_same(&self, cdb: &[u8], out: &[u8]) -> Outcome {
        let rw = rw_fields(cdb);
        let sixteen = byte(cdb, 0) == 0x93;
        let unmap = rw.flags & 0x08 != 0;
        let anchor = rw.flags & 0x10 != 0;
        let ndob = sixteen && rw.flags & 0x01 != 0;
        if rw.flags >> 5 != 0 || anchor {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, None));
        }
        // Zero blocks means "to the end of the medium" (WSNZ is 0).
        let blocks = if rw.blocks == 0 {
            self.blocks().saturating_sub(rw.lba)
        } else {
            rw.blocks
        };
        if blocks > MAX_WRITE_SAME_BLOCKS {
            let at = if sixteen { 10 } else { 7 };
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, at, None));
        }
        let (off, len) = self.range(rw.lba, blocks)?;
        self.writable()?;
        let bs = self.bs() as usize;
        let zero_block = vec![0u8; bs];
        let block: &[u8] = if ndob {
            Self::need_out(out, 0)?;
            &zero_block
        } else {
            Self::need_out(out, bs as u64)?;
            out
        };
        let fua = self.fua(rw.flags);
        let _shared = self.atomic.read();
        // With UNMAP set on a thin unit the blocks are deallocated (and read
        // back as zeroes, LBPRZ) whatever the data-out block holds.
        let deallocate = unmap && self.cfg.thin;
        if deallocate || block.iter().all(|b| *b == 0) {
            self.dev
                .write_zeroes(off, len, deallocate, fua)
                .map_err(|e| dev_sense(&e, true))?;
        } else {
            let chunk_blocks = ((1usize << 20) / bs).max(1);
            let pattern: Vec<u8> = block.repeat(chunk_blocks);
            let mut pos = 0u64;
            while pos < len {
                let n = (len - pos).min(pattern.len() as u64) as usize;
                self.dev
                    .write_at(off + pos, &pattern[..n], fua)
                    .map_err(|e| dev_sense(&e, true))?;
                pos += n as u64;
            }
        }
        let mut r = ScsiResponse::good(Vec::new());
        r.transfer_len = out.len() as u64;
        Ok(r)
    }

    fn unmap(&self, cdb: &[u8], out: &[u8]) -> Outcome {
        if byte(cdb, 1) & 0x01 != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(0)));
        }
        let len = usize::from(be16(cdb, 7));
        let p = &out[..len.min(out.len())];
        if p.is_empty() {
            return Ok(ScsiResponse::good(Vec::new()));
        }
        if p.len() < 8 {
            return Err(Sense::PARAM_LIST_LENGTH_ERROR);
        }
        self.writable()?;
        let bd_len = usize::from(be16(p, 2)).min(p.len() - 8);
        let descs = &p[8..8 + bd_len - bd_len % 16];
        if (descs.len() / 16) as u32 > MAX_UNMAP_DESCRIPTORS {
            return Err(Sense::INVALID_FIELD_IN_PARAM_LIST.field(false, 2, None));
        }
        let mut ranges = Vec::new();
        for d in descs.chunks(16) {
            let lba = be64(d, 0);
            let n = u64::from(be32(d, 8));
            if n > u64::from(MAX_UNMAP_BLOCKS) {
                return Err(Sense::INVALID_FIELD_IN_PARAM_LIST);
            }
            ranges.push(self.range(lba, n)?);
        }
        let _shared = self.atomic.read();
        for (off, n) in ranges {
            if n > 0 {
                self.dev.unmap(off, n).map_err(|e| dev_sense(&e, true))?;
            }
        }
        Ok(ScsiResponse::good(Vec::new()))
    }

    fn get_lba_status(&self, cdb: &[u8]) -> Outcome {
        let lba = be64(cdb, 2);
        let alloc = be32(cdb, 10) as usize;
        let total = self.blocks();
        if lba >= total {
            return Err(Sense::LBA_OUT_OF_RANGE);
        }
        let bs = self.bs();
        let max_desc = (alloc.saturating_sub(8) / 16).clamp(1, 512);
        let span = ((total - lba) * bs).min(1 << 30);
        let map = self
            .dev
            .mapping(lba * bs, span)
            .map_err(|e| dev_sense(&e, false))?;
        let mut body = Vec::new();
        let mut n = 0;
        for (off, len, mapped) in map {
            let start = (off / bs).max(lba);
            let end = ((off + len).div_ceil(bs)).min(total);
            if end <= start {
                continue;
            }
            body.extend_from_slice(&start.to_be_bytes());
            body.extend_from_slice(&((end - start).min(u64::from(u32::MAX)) as u32).to_be_bytes());
            body.push(if mapped { 0 } else { 1 });
            body.extend_from_slice(&[0, 0, 0]);
            n += 1;
            if n == max_desc {
                break;
            }
        }
        let mut d = ((body.len() + 4) as u32).to_be_bytes().to_vec();
        d.extend_from_slice(&[0, 0, 0, 0]);
        d.extend_from_slice(&body);
        Ok(cut(d, alloc))
    }

    fn compare_and_write(&self, cdb: &[u8], out: &[u8]) -> Outcome {
        if byte(cdb, 13) == 0 && !out.is_empty() {
            // The block count is one byte: 256 blocks wrap to 0.
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 13, None));
        }
        let (rw, off, len) = self.medium_range(cdb, u64::from(MAX_COMPARE_WRITE_BLOCKS))?;
        self.writable()?;
        Self::need_out(out, 2 * len)?;
        if len == 0 {
            return Ok(ScsiResponse::good(Vec::new()));
        }
        let (verify, write) = out.split_at(len as usize);
        let _alone = self.atomic.write();
        let mut medium = vec![0u8; len as usize];
        self.dev
            .read_at(off, &mut medium)
            .map_err(|e| dev_sense(&e, false))?;
        if let Some(at) = first_difference(&medium, verify) {
            return Err(Sense::MISCOMPARE_DURING_VERIFY.with_info(at as u64));
        }
        self.dev
            .write_at(off, write, self.fua(rw.flags))
            .map_err(|e| dev_sense(&e, true))?;
        let mut r = ScsiResponse::good(Vec::new());
        r.transfer_len = 2 * len;
        Ok(r)
    }

    /// The device a CSCD descriptor names: this unit, or another unit the
    /// host resolves by NAA.
    fn copy_device(&self, t: &xcopy::Target) -> Option<Arc<dyn BlockDevice>> {
        let mut t10 = inquiry::VENDOR.to_vec();
        t10.extend_from_slice(self.id.serial.as_bytes());
        match t.designator_type {
            3 if t.designator == self.id.naa => Some(self.dev.clone()),
            1 if t.designator == t10[..t10.len().min(20)] => Some(self.dev.clone()),
            3 => self
                .copy_targets
                .read()
                .as_ref()
                .and_then(|r| r.device_by_naa(&t.designator)),
            _ => None,
        }
    }

    /// EXTENDED COPY (LID1): every segment is checked before any is copied.
    fn extended_copy(&self, nexus: &Nexus, cdb: &[u8], out: &[u8]) -> Outcome {
        if byte(cdb, 1) & 0x1f != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(4)));
        }
        let len = be32(cdb, 10) as usize;
        let Some(list) = xcopy::parse(&out[..len.min(out.len())])? else {
            return Ok(ScsiResponse::good(Vec::new()));
        };
        let mut devices = Vec::new();
        for t in &list.targets {
            devices.push(self.copy_device(t).ok_or(xcopy::TARGET_NOT_REACHABLE)?);
        }
        let bs = self.bs();
        let mut plan = Vec::new();
        for s in &list.segments {
            let (Some(src), Some(dst)) = (devices.get(s.source), devices.get(s.destination)) else {
                return Err(xcopy::TARGET_NOT_REACHABLE);
            };
            let fits = |d: &Arc<dyn BlockDevice>, lba: u64| {
                lba.checked_add(s.blocks)
                    .and_then(|e| e.checked_mul(bs))
                    .is_some_and(|e| e <= d.size())
            };
            if !fits(src, s.source_lba) || !fits(dst, s.destination_lba) {
                return Err(xcopy::COPY_LBA_OUT_OF_RANGE);
            }
            if dst.read_only() || (Arc::ptr_eq(dst, &self.dev) && self.state.lock().mode.swp) {
                return Err(Sense::WRITE_PROTECTED);
            }
            plan.push((src.clone(), dst.clone(), s));
        }
        let mut status = xcopy::CopyStatus {
            segments: 0,
            bytes: 0,
            failed: false,
        };
        let mut result = Ok(());
        {
            let _shared = self.atomic.read();
            for (src, dst, s) in plan {
                let bytes = s.blocks * bs;
                if let Err(e) = xcopy::copy_range(
                    src.as_ref(),
                    dst.as_ref(),
                    s.source_lba * bs,
                    s.destination_lba * bs,
                    bytes,
                ) {
                    status.failed = true;
                    result = Err(e);
                    break;
                }
                status.segments += 1;
                status.bytes += bytes;
            }
        }
        if list.hold_status {
            let mut st = self.state.lock();
            if st.copies.len() >= 256 {
                st.copies.clear();
            }
            st.copies
                .insert((nexus.initiator_port.clone(), list.list_id), status);
        }
        result.map(|()| ScsiResponse::good(Vec::new()))
    }

    /// WRITE ATOMIC(16): the whole range is written or none of it, and no
    /// other write of this unit interleaves with it.
    fn write_atomic(&self, cdb: &[u8], out: &[u8]) -> Outcome {
        if be16(cdb, 10) != 0 {
            return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 10, None));
        }
        let (rw, off, len) = self.medium_range(cdb, u64::from(inquiry::MAX_ATOMIC_BLOCKS))?;
        self.writable()?;
        Self::need_out(out, len)?;
        if len > 0 {
            let _alone = self.atomic.write();
            self.dev
                .write_at(off, out, self.fua(rw.flags))
                .map_err(|e| dev_sense(&e, true))?;
        }
        let mut r = ScsiResponse::good(Vec::new());
        r.transfer_len = len;
        Ok(r)
    }

    fn orwrite(&self, cdb: &[u8], out: &[u8]) -> Outcome {
        let (rw, off, len) = self.medium_range(cdb, u64::from(MAX_TRANSFER_BLOCKS))?;
        self.writable()?;
        Self::need_out(out, len)?;
        if len == 0 {
            return Ok(ScsiResponse::good(Vec::new()));
        }
        let _alone = self.atomic.write();
        let mut medium = vec![0u8; len as usize];
        self.dev
            .read_at(off, &mut medium)
            .map_err(|e| dev_sense(&e, false))?;
        for (m, o) in medium.iter_mut().zip(out) {
            *m |= *o;
        }
        self.dev
            .write_at(off, &medium, self.fua(rw.flags))
            .map_err(|e| dev_sense(&e, true))?;
        let mut r = ScsiResponse::good(Vec::new());
        r.transfer_len = len;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryDevice;

    fn unit() -> LogicalUnit {
        unit_on(Arc::new(MemoryDevice::new(1 << 20, false)))
    }

    fn unit_on(dev: Arc<dyn BlockDevice>) -> LogicalUnit {
        LogicalUnit::new(
            dev,
            Identity {
                name: "v".into(),
                naa: [0x3f, 1, 2, 3, 4, 5, 6, 7],
                serial: "abc".into(),
                target_name: "iqn.x:v".into(),
                port_group: 1,
                relative_port: 1,
                port_count: 2,
            },
            LuConfig {
                block_size: 512,
                physical_block: 512,
                thin: true,
            },
        )
    }

    fn nexus(n: &str) -> Nexus {
        Nexus {
            initiator_port: n.into(),
            relative_port: 1,
        }
    }

    fn cdb16(op: u8, lba: u64, blocks: u32) -> Vec<u8> {
        let mut c = vec![0u8; 16];
        c[0] = op;
        c[2..10].copy_from_slice(&lba.to_be_bytes());
        c[10..14].copy_from_slice(&blocks.to_be_bytes());
        c
    }

    #[test]
    fn write_read_and_out_of_range() {
        let lu = unit();
        let a = nexus("a");
        let r = lu.execute(&a, &cdb16(0x8a, 2, 1), &[7u8; 512]);
        assert_eq!(r.status, Status::Good);
        let r = lu.execute(&a, &cdb16(0x88, 2, 1), &[]);
        assert_eq!(r.data, vec![7u8; 512]);
        let r = lu.execute(&a, &cdb16(0x88, 2047, 2), &[]);
        assert_eq!(r.status, Status::CheckCondition);
        assert_eq!((r.sense[2], r.sense[12]), (0x05, 0x21));
        let r = lu.execute(&a, &[0xff, 0, 0, 0, 0, 0], &[]);
        assert_eq!((r.sense[2], r.sense[12]), (0x05, 0x20));
    }

    #[test]
    fn compare_and_write_miscompare_keeps_data() {
        let lu = unit();
        let a = nexus("a");
        lu.execute(&a, &cdb16(0x8a, 0, 1), &[1u8; 512]);
        let mut caw = cdb16(0x89, 0, 0);
        caw[13] = 1;
        caw[10..13].fill(0);
        let mut out = vec![2u8; 512];
        out.extend_from_slice(&[3u8; 512]);
        let r = lu.execute(&a, &caw, &out);
        assert_eq!((r.sense[2], r.sense[12]), (0x0e, 0x1d));
        assert_eq!(lu.execute(&a, &cdb16(0x88, 0, 1), &[]).data, vec![1u8; 512]);
        out[..512].fill(1);
        assert_eq!(lu.execute(&a, &caw, &out).status, Status::Good);
        assert_eq!(lu.execute(&a, &cdb16(0x88, 0, 1), &[]).data, vec![3u8; 512]);
    }

    #[test]
    fn reset_raises_unit_attention_once() {
        let lu = unit();
        let (a, b) = (nexus("a"), nexus("b"));
        let tur = [0u8; 6];
        lu.execute(&b, &tur, &[]);
        lu.reset(false, Some(&a));
        for n in [&a, &b] {
            let r = lu.execute(n, &tur, &[]);
            assert_eq!((r.sense[2], r.sense[12], r.sense[13]), (0x06, 0x29, 0x03));
            assert_eq!(lu.execute(n, &tur, &[]).status, Status::Good);
        }
    }

    #[test]
    fn capacity_change_raises_unit_attention() {
        let dev = Arc::new(MemoryDevice::new(1 << 20, false));
        let lu = LogicalUnit::new(
            dev.clone(),
            unit().identity().clone(),
            LuConfig {
                block_size: 512,
                physical_block: 512,
                thin: true,
            },
        );
        let a = nexus("a");
        let tur = [0u8; 6];
        assert_eq!(lu.execute(&a, &tur, &[]).status, Status::Good);
        dev.resize(2 << 20);
        // INQUIRY does not consume it; TEST UNIT READY reports it once.
        assert_eq!(
            lu.execute(&a, &[0x12, 0, 0, 0, 36, 0], &[]).status,
            Status::Good
        );
        let r = lu.execute(&a, &tur, &[]);
        assert_eq!((r.sense[2], r.sense[12], r.sense[13]), (0x06, 0x2a, 0x09));
        assert_eq!(lu.execute(&a, &tur, &[]).status, Status::Good);
        let mut rc = [0u8; 10];
        rc[0] = 0x25;
        let r = lu.execute(&a, &rc, &[]);
        assert_eq!(
            u32::from_be_bytes([r.data[0], r.data[1], r.data[2], r.data[3]]),
            4095
        );
    }

    #[test]
    fn persistent_reservation_blocks_other_writers() {
        let lu = unit();
        let (a, b) = (nexus("a"), nexus("b"));
        let prout = |sa: u8, t: u8, key: u64, sa_key: u64| {
            let mut cdb = vec![0x5f, sa, t, 0, 0, 0, 0, 0, 24, 0];
            cdb[1] = sa;
            let mut p = vec![0u8; 24];
            p[0..8].copy_from_slice(&key.to_be_bytes());
            p[8..16].copy_from_slice(&sa_key.to_be_bytes());
            (cdb, p)
        };
        let (c, p) = prout(0, 0, 0, 0xa);
        assert_eq!(lu.execute(&a, &c, &p).status, Status::Good);
        let (c, p) = prout(1, 1, 0xa, 0);
        assert_eq!(lu.execute(&a, &c, &p).status, Status::Good);
        assert_eq!(
            lu.execute(&b, &cdb16(0x8a, 0, 1), &[1u8; 512]).status,
            Status::ReservationConflict
        );
        assert_eq!(lu.execute(&b, &cdb16(0x88, 0, 1), &[]).status, Status::Good);
        assert_eq!(
            lu.execute(&a, &cdb16(0x8a, 0, 1), &[1u8; 512]).status,
            Status::Good
        );
        // READ KEYS shows the one registration.
        let r = lu.execute(&b, &[0x5e, 0, 0, 0, 0, 0, 0, 0, 64, 0], &[]);
        assert_eq!(&r.data[4..8], &8u32.to_be_bytes());
        assert_eq!(&r.data[8..16], &0xau64.to_be_bytes());
    }

    #[test]
    fn target_port_groups_one_per_site() {
        let lu = unit();
        let r = lu.execute(
            &nexus("a"),
            &[0xa3, 0x2a, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
            &[],
        );
        assert_eq!(r.status, Status::Good);
        assert_eq!(r.data[4], 0x10, "extended header");
        // One group of two ports (8 + 2 * 4 bytes) after the 8-byte header.
        assert_eq!(r.data.len(), 8 + 16);
        assert_eq!(&r.data[8 + 2..8 + 4], &1u16.to_be_bytes());
        assert_eq!(r.data[8 + 7], 2, "two ports");
        assert_eq!(&r.data[18..20], &crate::relative_port(1, 0).to_be_bytes());
        assert_eq!(&r.data[22..24], &crate::relative_port(1, 1).to_be_bytes());
        assert_eq!(r.data[8] & 0x0f, 0, "active/optimized");
    }

    #[test]
    fn target_port_groups_follow_a_migration() {
        use crate::{AccessState, PortGroups};
        let dev = Arc::new(MemoryDevice::new(1 << 20, false));
        let lu = unit_on(dev.clone());
        let states = |lu: &LogicalUnit| {
            let r = lu.execute(
                &nexus("a"),
                &[0xa3, 0x0a, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
                &[],
            );
            assert_eq!(r.status, Status::Good);
            let mut out = Vec::new();
            let mut at = 4;
            while at < r.data.len() {
                let group = u16::from_be_bytes([r.data[at + 2], r.data[at + 3]]);
                out.push((group, r.data[at] & 0x0f));
                at += 8 + 4 * usize::from(r.data[at + 7]);
            }
            out
        };
        for (local, peer, want) in [
            (
                AccessState::ActiveOptimized,
                AccessState::Standby,
                [0x0, 0x2],
            ),
            (
                AccessState::Transitioning,
                AccessState::Transitioning,
                [0xf, 0xf],
            ),
            (
                AccessState::Unavailable,
                AccessState::ActiveOptimized,
                [0x3, 0x0],
            ),
        ] {
            dev.set_port_groups(PortGroups {
                local,
                peer: Some((7, peer)),
            });
            assert_eq!(states(&lu), vec![(1, want[0]), (7, want[1])]);
        }
        // A peer that claims this site's own group is not reported twice.
        dev.set_port_groups(PortGroups {
            local: AccessState::ActiveOptimized,
            peer: Some((1, AccessState::Unavailable)),
        });
        assert_eq!(states(&lu), vec![(1, 0)]);
    }

    #[test]
    fn spc2_reservation_conflicts() {
        let lu = unit();
        let (a, b) = (nexus("a"), nexus("b"));
        assert_eq!(
            lu.execute(&a, &[0x16, 0, 0, 0, 0, 0], &[]).status,
            Status::Good
        );
        assert_eq!(
            lu.execute(&b, &cdb16(0x88, 0, 1), &[]).status,
            Status::ReservationConflict
        );
        lu.nexus_lost(&a);
        assert_eq!(lu.execute(&b, &cdb16(0x88, 0, 1), &[]).status, Status::Good);
    }

    fn sanitize_cdb(immed: bool, sa: u8, plen: u16) -> Vec<u8> {
        let mut c = vec![0u8; 10];
        c[0] = op::SANITIZE;
        c[1] = sa | if immed { 0x80 } else { 0 };
        c[7..9].copy_from_slice(&plen.to_be_bytes());
        c
    }

    fn sense_of(r: &ScsiResponse) -> (u8, u8, u8) {
        (r.sense[2] & 0x0f, r.sense[12], r.sense[13])
    }

    #[test]
    fn sanitize_checks_its_parameters_then_overwrites_or_erases() {
        let lu = unit();
        let a = nexus("a");
        let mut w = cdb16(0x8a, 0, 1);
        w[1] = 0;
        assert_eq!(lu.execute(&a, &w, &[7u8; 512]).status, Status::Good);
        let bad = |cdb: Vec<u8>, out: &[u8], asc: u8| {
            let r = lu.execute(&a, &cdb, out);
            assert_eq!(r.status, Status::CheckCondition, "{cdb:02x?}");
            assert_eq!(
                sense_of(&r),
                (crate::sense::ILLEGAL_REQUEST, asc, 0),
                "{cdb:02x?}"
            );
        };
        let mut param = vec![0x01, 0, 0x02, 0x00];
        param.extend_from_slice(&[0xaa; 512]);
        // Parameter list shorter than 5 or longer than a block plus 4.
        bad(sanitize_cdb(false, 1, 4), &param[..4], 0x24);
        bad(sanitize_cdb(false, 1, 517), &[0; 520], 0x24);
        // No pass, an empty pattern, a pattern longer than a block.
        let mut p = param.clone();
        p[0] = 0;
        bad(sanitize_cdb(false, 1, 516), &p, 0x26);
        let mut p = param.clone();
        p[2..4].copy_from_slice(&0u16.to_be_bytes());
        bad(sanitize_cdb(false, 1, 516), &p, 0x26);
        let mut p = param.clone();
        p[2..4].copy_from_slice(&513u16.to_be_bytes());
        bad(sanitize_cdb(false, 1, 516), &p, 0x26);
        // Reserved bits and bytes; parameters for BLOCK ERASE; unknown or
        // unsupported service actions (CRYPTO ERASE).
        let mut c = sanitize_cdb(false, 1, 516);
        c[1] |= 0x40;
        bad(c, &param, 0x24);
        let mut c = sanitize_cdb(false, 1, 516);
        c[4] = 1;
        bad(c, &param, 0x24);
        bad(sanitize_cdb(false, 2, 8), &[0; 8], 0x24);
        bad(sanitize_cdb(false, 3, 0), &[], 0x24);
        bad(sanitize_cdb(false, 0x1e, 0), &[], 0x24);
        // The block written first is still there.
        let r = lu.execute(&a, &cdb16(0x88, 0, 1), &[]);
        assert_eq!(r.data, vec![7u8; 512]);
        // A good OVERWRITE; the transport may pad the list to 4 bytes.
        let mut padded = param.clone();
        padded.extend_from_slice(&[0; 4]);
        let r = lu.execute(&a, &sanitize_cdb(false, 1, 516), &padded);
        assert_eq!(r.status, Status::Good);
        let r = lu.execute(&a, &cdb16(0x88, 2047, 1), &[]);
        assert_eq!(r.data, vec![0xaa; 512]);
        let r = lu.execute(&a, &sanitize_cdb(true, 2, 0), &[]);
        assert_eq!(r.status, Status::Good);
        let r = lu.execute(&a, &cdb16(0x88, 0, 1), &[]);
        assert_eq!(r.data, vec![0; 512]);
        // REPORT SUPPORTED OPERATION CODES lists the three it does.
        let mut rsoc = vec![0u8; 12];
        rsoc[0] = op::MAINTENANCE_IN;
        rsoc[1] = 0x0c;
        rsoc[6..10].copy_from_slice(&4096u32.to_be_bytes());
        let r = lu.execute(&a, &rsoc, &[]);
        let sas: Vec<u16> = r.data[4..]
            .chunks(8)
            .filter(|d| d[0] == op::SANITIZE)
            .map(|d| u16::from_be_bytes([d[2], d[3]]))
            .collect();
        assert_eq!(sas, vec![1, 2, 0x1f]);
    }

    /// A device whose sanitize is under way, a quarter done.
    struct Sanitizing(MemoryDevice);
    impl BlockDevice for Sanitizing {
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn read_only(&self) -> bool {
            false
        }
        fn thin(&self) -> bool {
            true
        }
        fn read_at(&self, _: u64, _: &mut [u8]) -> Result<(), DeviceError> {
            Err(DeviceError::Sanitizing)
        }
        fn write_at(&self, _: u64, _: &[u8], _: bool) -> Result<(), DeviceError> {
            Err(DeviceError::Sanitizing)
        }
        fn write_zeroes(&self, _: u64, _: u64, _: bool, _: bool) -> Result<(), DeviceError> {
            Err(DeviceError::Sanitizing)
        }
        fn unmap(&self, _: u64, _: u64) -> Result<(), DeviceError> {
            Err(DeviceError::Sanitizing)
        }
        fn flush(&self) -> Result<(), DeviceError> {
            Ok(())
        }
        fn prefetch(&self, _: u64, _: u64) -> Result<(), DeviceError> {
            Ok(())
        }
        fn mapping(&self, o: u64, l: u64) -> Result<Vec<(u64, u64, bool)>, DeviceError> {
            self.0.mapping(o, l)
        }
        fn sanitize_support(&self) -> crate::SanitizeSupport {
            self.0.sanitize_support()
        }
        fn sanitize_state(&self) -> crate::SanitizeState {
            crate::SanitizeState::Running { progress: 0x4000 }
        }
    }

    #[test]
    fn while_a_sanitize_runs_only_inquiry_and_friends_answer() {
        let lu = unit_on(Arc::new(Sanitizing(MemoryDevice::new(1 << 20, false))));
        let a = nexus("a");
        for cdb in [vec![0u8; 6], cdb16(0x88, 0, 1), vec![0x1b, 0, 0, 0, 1, 0]] {
            let r = lu.execute(&a, &cdb, &[]);
            assert_eq!(r.status, Status::CheckCondition);
            assert_eq!(sense_of(&r), (crate::sense::NOT_READY, 0x04, 0x1b));
            // Progress indication: SKSV and a quarter done.
            assert_eq!(&r.sense[15..18], &[0x80, 0x40, 0x00]);
        }
        let r = lu.execute(&a, &[0x12, 0, 0, 0, 96, 0], &[]);
        assert_eq!(r.status, Status::Good);
        let r = lu.execute(&a, &[0x03, 0, 0, 0, 18, 0], &[]);
        assert_eq!(r.status, Status::Good);
        assert_eq!((r.data[2], r.data[12], r.data[13]), (2, 0x04, 0x1b));
        // BLOCK ERASE is advertised: WABEREQ 01b in VPD 0xB1.
        let r = lu.execute(&a, &[0x12, 1, 0xb1, 0, 64, 0], &[]);
        assert_eq!(r.data[7] >> 6, 1);
    }
}
