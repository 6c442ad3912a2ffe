//! The full feature phase of one session (one connection, ErrorRecoveryLevel
//! 0): command numbering and windowing, collection of immediate,
//! unsolicited and solicited (R2T) data, Data-In with phase collapse and
//! residuals, SCSI responses, NOP, text (SendTargets), task management and
//! logout. SCSI commands leave as [`Event::Execute`] and come back through
//! [`Session::complete`].

use crate::login::{SessionParams, SessionType, Targets, COMMAND_WINDOW};
use crate::pdu::{op, Pdu, NO_TAG};
use crate::{sn_lt, text};
use bytes::Bytes;
use std::collections::HashMap;
use thiserror::Error;

/// Largest expected transfer length accepted for one command.
pub const MAX_TRANSFER: u32 = 64 * 1024 * 1024;

/// Errors that end the connection (ERL 0 has no recovery within it).
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SessionError {
    #[error("protocol error: {0}")]
    Protocol(&'static str),
}

/// A SCSI command with all its data-out, ready to execute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScsiTask {
    pub itt: u32,
    pub lun: u64,
    pub cdb: Bytes,
    pub data_out: Bytes,
    /// Expected data transfer length from the command PDU.
    pub edtl: u32,
    pub read: bool,
    pub write: bool,
}

/// Task management functions (RFC 7143 §11.5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TmfFunction {
    AbortTask,
    AbortTaskSet,
    ClearAca,
    ClearTaskSet,
    LunReset,
    TargetWarmReset,
    TargetColdReset,
    TaskReassign,
}

/// What the caller must do after feeding a PDU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Execute(ScsiTask),
    /// A reset of a logical unit (or of the target, `lun` = None) was
    /// performed here; reset the unit state (reservations, unit
    /// attentions). Cold reset also closes the connection.
    Reset {
        function: TmfFunction,
        lun: Option<u64>,
    },
    /// The initiator logged out; close after sending the output.
    Logout,
}

/// The result of a command, from the SCSI layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandResult {
    pub status: u8,
    pub data: Bytes,
    pub sense: Bytes,
    /// SCSI's transfer length (SPDTL) for residual accounting.
    pub transfer_len: u64,
}

#[derive(Debug)]
struct Task {
    lun: u64,
    cdb: Bytes,
    edtl: u32,
    read: bool,
    write: bool,
    buf: Vec<u8>,
    /// All the data arrived as immediate data: kept as received, no copy.
    immediate: Option<Bytes>,
    received: u32,
    /// Unsolicited bytes still expected (before any R2T).
    unsolicited_left: u32,
    /// Next offset to solicit.
    next_r2t_offset: u32,
    /// Outstanding R2Ts: (TTT, offset, length, bytes received).
    r2ts: Vec<(u32, u32, u32, u32)>,
    r2t_sn: u32,
    data_sn: u32,
    /// Handed to the SCSI layer.
    executing: bool,
    aborted: bool,
}

/// One logged-in session.
pub struct Session {
    params: SessionParams,
    exp_cmdsn: u32,
    stat_sn: u32,
    tasks: HashMap<u32, Task>,
    next_ttt: u32,
    logged_out: bool,
    /// A text response longer than one PDU: its target transfer tag and
    /// the bytes not sent yet (sent as the initiator asks for them).
    text_rest: Option<(u32, Vec<u8>)>,
    /// Data-In PDUs and R2Ts sent (ExpDataSN for the response).
    dropped_pdus: u64,
}

fn lun_of(p: &Pdu) -> u64 {
    // Single-level LUN, peripheral or flat addressing: LUN in bytes 0-1.
    let b = &p.bhs[8..10];
    u64::from(u16::from_be_bytes([b[0] & 0x3f, b[1]]))
}

impl Session {
    pub fn new(params: SessionParams) -> Session {
        Session {
            exp_cmdsn: params.exp_cmdsn,
            stat_sn: params.stat_sn,
            params,
            tasks: HashMap::new(),
            next_ttt: 1,
            logged_out: false,
            text_rest: None,
            dropped_pdus: 0,
        }
    }

    pub fn params(&self) -> &SessionParams {
        &self.params
    }

    /// PDUs dropped as out of the command window (for logs and tests).
    pub fn dropped(&self) -> u64 {
        self.dropped_pdus
    }

    pub fn logged_out(&self) -> bool {
        self.logged_out
    }

    fn max_cmdsn(&self) -> u32 {
        let busy = u32::try_from(self.tasks.len()).unwrap_or(u32::MAX);
        self.exp_cmdsn
            .wrapping_add(COMMAND_WINDOW.saturating_sub(busy).max(1) - 1)
    }

    /// Fill StatSN/ExpCmdSN/MaxCmdSN; `advance` consumes a StatSN.
    fn stamp(&mut self, p: &mut Pdu, advance: bool) {
        p.set_u32(24, self.stat_sn);
        if advance {
            self.stat_sn = self.stat_sn.wrapping_add(1);
        }
        self.stamp_window(p);
    }

    /// Fill ExpCmdSN/MaxCmdSN only (Data-In without status).
    fn stamp_window(&self, p: &mut Pdu) {
        p.set_u32(28, self.exp_cmdsn);
        p.set_u32(32, self.max_cmdsn());
    }

    fn reject(&mut self, bad: &Pdu, reason: u8, out: &mut Vec<Pdu>) {
        let mut p = Pdu::new(op::REJECT);
        p.bhs[1] = 0x80;
        p.bhs[2] = reason;
        p.set_u32(16, NO_TAG);
        self.stamp(&mut p, true);
        p.data = Bytes::copy_from_slice(&bad.bhs);
        out.push(p);
    }

    /// Check a non-immediate PDU's CmdSN. Returns false if it must be
    /// ignored (outside the window).
    fn take_cmdsn(&mut self, p: &Pdu) -> bool {
        let cmdsn = p.u32_at(24);
        if p.immediate() {
            return true;
        }
        let max = self.max_cmdsn();
        if sn_lt(cmdsn, self.exp_cmdsn) || sn_lt(max, cmdsn) {
            self.dropped_pdus += 1;
            return false;
        }
        // A single connection delivers in order; a CmdSN ahead of the
        // expected one means the initiator skipped numbers, and waiting for
        // them would stall the session, so the window moves past it.
        self.exp_cmdsn = cmdsn.wrapping_add(1);
        true
    }

    /// Feed one PDU from the initiator.
    pub fn receive(
        &mut self,
        p: Pdu,
        targets: &dyn Targets,
        out: &mut Vec<Pdu>,
        events: &mut Vec<Event>,
    ) -> Result<(), SessionError> {
        if self.logged_out {
            return Err(SessionError::Protocol("PDU after logout"));
        }
        match p.opcode() {
            op::SCSI_COMMAND => self.scsi_command(p, out, events),
            op::DATA_OUT => self.data_out(p, out, events),
            op::NOP_OUT => {
                if p.itt() == NO_TAG {
                    // The answer to our ping (or a one-way ping); no reply.
                    if !p.immediate() && p.u32_at(20) == NO_TAG {
                        self.take_cmdsn(&p);
                    }
                    return Ok(());
                }
                if !self.take_cmdsn(&p) {
                    return Ok(());
                }
                let mut r = Pdu::new(op::NOP_IN);
                r.bhs[1] = 0x80;
                r.bhs[8..16].copy_from_slice(&p.bhs[8..16]);
                r.set_itt(p.itt());
                r.set_u32(20, NO_TAG);
                self.stamp(&mut r, true);
                r.data = p.data.clone();
                out.push(r);
                Ok(())
            }
            op::TEXT => {
                if !self.take_cmdsn(&p) {
                    return Ok(());
                }
                self.text(&p, targets, out);
                Ok(())
            }
            op::TASK_MGMT => {
                if !self.take_cmdsn(&p) {
                    return Ok(());
                }
                self.task_mgmt(&p, out, events);
                Ok(())
            }
            op::LOGOUT => {
                if !self.take_cmdsn(&p) {
                    return Ok(());
                }
                let reason = p.bhs[1] & 0x7f;
                let mut r = Pdu::new(op::LOGOUT_RESPONSE);
                r.bhs[1] = 0x80;
                r.bhs[2] = match reason {
                    0 | 1 => 0,
                    2 => 2, // connection recovery is not supported (ERL 0)
                    _ => 2,
                };
                r.set_itt(p.itt());
                self.stamp(&mut r, true);
                out.push(r);
                if reason != 2 {
                    self.logged_out = true;
                    events.push(Event::Logout);
                }
                Ok(())
            }
            op::LOGIN => {
                // A login request in the full feature phase is a protocol
                // error (RFC 7143 §6.2).
                self.reject(&p, 0x04, out);
                Err(SessionError::Protocol(
                    "login request in full feature phase",
                ))
            }
            op::SNACK => {
                // SNACK needs ErrorRecoveryLevel > 0.
                self.reject(&p, 0x04, out);
                Ok(())
            }
            _ => {
                self.reject(&p, 0x05, out);
                Ok(())
            }
        }
    }

    fn scsi_command(
        &mut self,
        p: Pdu,
        out: &mut Vec<Pdu>,
        events: &mut Vec<Event>,
    ) -> Result<(), SessionError> {
        if self.params.session_type == SessionType::Discovery {
            self.reject(&p, 0x05, out);
            return Ok(());
        }
        if !self.take_cmdsn(&p) {
            return Ok(());
        }
        let itt = p.itt();
        let flags = p.flags();
        let (read, write) = (flags & 0x40 != 0, flags & 0x20 != 0);
        let edtl = p.u32_at(20);
        if itt == NO_TAG || self.tasks.contains_key(&itt) {
            self.reject(&p, 0x09, out);
            return Ok(());
        }
        let mut cdb = p.bhs[32..48].to_vec();
        // An extended-CDB AHS (type 1) carries the CDB bytes beyond 16.
        let mut ahs = &p.ahs[..];
        while ahs.len() >= 4 {
            let len = usize::from(u16::from_be_bytes([ahs[0], ahs[1]]));
            let kind = ahs[2];
            let body_end = (3 + len).min(ahs.len());
            if kind == 1 && len > 1 {
                cdb.extend_from_slice(&ahs[4..body_end]);
            }
            let next = (3 + len).div_ceil(4) * 4;
            if next == 0 || next > ahs.len() {
                break;
            }
            ahs = &ahs[next..];
        }
        // The decoder bounds data segments to 2^24 bytes.
        let immediate = u32::try_from(p.data.len()).unwrap_or(u32::MAX);
        let bad = |why| Err(SessionError::Protocol(why));
        if (read && write) || edtl > MAX_TRANSFER {
            // Bidirectional commands are not supported; oversized
            // transfers are refused before any data is taken.
            let sense = invalid_field_sense();
            self.respond(itt, 0x02, &sense, Residual::under(edtl, 0), out);
            if write && !p.final_bit() {
                // Unsolicited data may follow; remember the tag to skip it.
                self.tasks.insert(
                    itt,
                    Task {
                        lun: lun_of(&p),
                        cdb: Bytes::new(),
                        edtl: 0,
                        read,
                        write,
                        buf: Vec::new(),
                        immediate: None,
                        received: 0,
                        unsolicited_left: u32::MAX,
                        next_r2t_offset: 0,
                        r2ts: Vec::new(),
                        r2t_sn: 0,
                        data_sn: 0,
                        executing: false,
                        aborted: true,
                    },
                );
            }
            return Ok(());
        }
        if immediate > 0 && (!write || !self.params.immediate_data) {
            return bad("immediate data without ImmediateData=Yes or W bit");
        }
        if immediate > edtl || immediate > self.params.first_burst {
            return bad("immediate data beyond the expected length or FirstBurstLength");
        }
        let unsolicited_left = if write && !p.final_bit() {
            if self.params.initial_r2t {
                return bad("F bit clear with InitialR2T=Yes");
            }
            self.params.first_burst.min(edtl).saturating_sub(immediate)
        } else {
            0
        };
        let mut task = Task {
            lun: lun_of(&p),
            cdb: Bytes::from(cdb),
            edtl,
            read,
            write,
            buf: Vec::new(),
            immediate: None,
            received: immediate,
            unsolicited_left,
            next_r2t_offset: 0,
            r2ts: Vec::new(),
            r2t_sn: 0,
            data_sn: 0,
            executing: false,
            aborted: false,
        };
        if write && edtl > 0 {
            if immediate == edtl {
                task.immediate = Some(p.data.clone());
            } else {
                task.buf = vec![0u8; edtl as usize];
                task.buf[..immediate as usize].copy_from_slice(&p.data);
            }
        }
        task.next_r2t_offset = immediate + unsolicited_left;
        self.tasks.insert(itt, task);
        self.progress(itt, out, events);
        Ok(())
    }

    /// Execute the task if all its data is in; otherwise ask for more.
    fn progress(&mut self, itt: u32, out: &mut Vec<Pdu>, events: &mut Vec<Event>) {
        let max_burst = self.params.max_burst;
        let max_r2t = self.params.max_outstanding_r2t as usize;
        let mut new_r2ts = Vec::new();
        let Some(t) = self.tasks.get_mut(&itt) else {
            return;
        };
        if t.aborted || t.executing {
            return;
        }
        if !t.write || t.received >= t.edtl {
            t.executing = true;
            let data = match t.immediate.take() {
                Some(d) => d,
                None => Bytes::from(std::mem::take(&mut t.buf)),
            };
            events.push(Event::Execute(ScsiTask {
                itt,
                lun: t.lun,
                cdb: t.cdb.clone(),
                data_out: data,
                edtl: t.edtl,
                read: t.read,
                write: t.write,
            }));
            return;
        }
        if t.unsolicited_left > 0 {
            return;
        }
        while t.r2ts.len() < max_r2t && t.next_r2t_offset < t.edtl {
            let len = (t.edtl - t.next_r2t_offset).min(max_burst);
            let ttt = self.next_ttt;
            self.next_ttt = self.next_ttt.wrapping_add(1).max(1);
            if self.next_ttt == NO_TAG {
                self.next_ttt = 1;
            }
            t.r2ts.push((ttt, t.next_r2t_offset, len, 0));
            new_r2ts.push((ttt, t.next_r2t_offset, len, t.r2t_sn, t.lun));
            t.r2t_sn += 1;
            t.next_r2t_offset += len;
        }
        for (ttt, offset, len, sn, lun) in new_r2ts {
            let mut r = Pdu::new(op::R2T);
            r.bhs[1] = 0x80;
            r.set_lun(lun << 48);
            r.set_itt(itt);
            r.set_u32(20, ttt);
            self.stamp(&mut r, false);
            r.set_u32(36, sn);
            r.set_u32(40, offset);
            r.set_u32(44, len);
            out.push(r);
        }
    }

    fn data_out(
        &mut self,
        p: Pdu,
        out: &mut Vec<Pdu>,
        events: &mut Vec<Event>,
    ) -> Result<(), SessionError> {
        let itt = p.itt();
        let ttt = p.u32_at(20);
        let offset = p.u32_at(40);
        let data_sn = p.u32_at(36);
        let len = u32::try_from(p.data.len()).unwrap_or(u32::MAX);
        let Some(t) = self.tasks.get_mut(&itt) else {
            // Data for a task that is gone (aborted or never existed): drop.
            return Ok(());
        };
        if t.aborted {
            if p.final_bit() && ttt == NO_TAG {
                t.unsolicited_left = 0;
            }
            if !t.executing && p.final_bit() {
                self.tasks.remove(&itt);
            }
            return Ok(());
        }
        if t.executing {
            return Err(SessionError::Protocol(
                "data-out after the task's data was complete",
            ));
        }
        let end = offset
            .checked_add(len)
            .ok_or(SessionError::Protocol("data-out offset overflow"))?;
        if end > t.edtl {
            return Err(SessionError::Protocol(
                "data-out beyond the expected transfer length",
            ));
        }
        if data_sn != t.data_sn {
            // The command cannot complete as sent: reject the PDU and end
            // the task with a CHECK CONDITION; the connection stays up.
            t.aborted = true;
            let edtl = t.edtl;
            if !t.executing {
                self.tasks.remove(&itt);
            }
            self.reject(&p, 0x04, out);
            let sense = data_phase_error_sense();
            self.respond(itt, 0x02, &sense, Residual::under(edtl, 0), out);
            return Ok(());
        }
        if ttt == NO_TAG {
            if t.unsolicited_left < len {
                return Err(SessionError::Protocol(
                    "unsolicited data beyond FirstBurstLength",
                ));
            }
            t.unsolicited_left -= len;
            if p.final_bit() {
                t.unsolicited_left = 0;
                t.data_sn = 0;
            } else {
                t.data_sn += 1;
            }
        } else {
            let Some(i) = t.r2ts.iter().position(|r| r.0 == ttt) else {
                return Err(SessionError::Protocol(
                    "data-out for an unknown target transfer tag",
                ));
            };
            let r = &mut t.r2ts[i];
            if offset < r.1 || end > r.1 + r.2 {
                return Err(SessionError::Protocol("data-out outside its R2T"));
            }
            r.3 += len;
            if p.final_bit() {
                t.r2ts.remove(i);
                t.data_sn = 0;
            } else {
                t.data_sn += 1;
            }
        }
        t.buf[offset as usize..end as usize].copy_from_slice(&p.data);
        t.received += len;
        self.progress(itt, out, events);
        Ok(())
    }

    /// Has task `itt` been aborted (by task management) before it ran?
    pub fn is_aborted(&self, itt: u32) -> bool {
        self.tasks.get(&itt).is_some_and(|t| t.aborted)
    }

    /// Forget an aborted task that was never executed.
    pub fn discard(&mut self, itt: u32) {
        if self.is_aborted(itt) {
            self.tasks.remove(&itt);
        }
    }

    /// Forget task `itt` without answering it: the connection is about to
    /// close because its unit moved to another site, and the initiator
    /// issues the command again in the session it logs in to next (session
    /// recovery, RFC 7143 section 7.1.4.2), where it runs for the first time.
    pub fn withhold(&mut self, itt: u32) {
        self.tasks.remove(&itt);
    }

    /// The SCSI layer finished task `itt`: build its Data-In and response.
    pub fn complete(&mut self, itt: u32, r: &CommandResult, out: &mut Vec<Pdu>) {
        let Some(t) = self.tasks.remove(&itt) else {
            return;
        };
        if t.aborted {
            return;
        }
        let lun = t.lun << 48;
        let mut data = r.data.clone();
        if !t.read {
            data = Bytes::new();
        }
        if data.len() > t.edtl as usize {
            data.truncate(t.edtl as usize);
        }
        let spdtl = if t.read || t.write { r.transfer_len } else { 0 };
        let edtl = u64::from(t.edtl);
        let (flags, residual) = if spdtl > edtl {
            (0x04, spdtl - edtl)
        } else if spdtl < edtl {
            (0x02, edtl - spdtl)
        } else {
            (0, 0)
        };
        let residual = u32::try_from(residual).unwrap_or(u32::MAX);
        let max_seg = self.params.max_send_data.max(512) as usize;
        let collapse = r.status == 0 && r.sense.is_empty();
        let mut data_sn = 0u32;
        let mut offset = 0usize;
        let burst = self.params.max_burst.max(512) as usize;
        while offset < data.len() {
            let n = (data.len() - offset).min(max_seg);
            let last = offset + n == data.len();
            let mut d = Pdu::new(op::DATA_IN);
            let mut f = 0u8;
            if last || (offset + n).is_multiple_of(burst) {
                f |= 0x80;
            }
            if last && collapse {
                f |= 0x01 | flags;
            }
            d.bhs[1] = f;
            if last && collapse {
                d.bhs[3] = r.status;
            }
            d.set_lun(lun);
            d.set_itt(itt);
            d.set_u32(20, NO_TAG);
            if last && collapse {
                self.stamp(&mut d, true);
                d.set_u32(44, residual);
            } else {
                self.stamp_window(&mut d);
            }
            d.set_u32(36, data_sn);
            // Offsets stay below the expected length, a u32.
            d.set_u32(40, u32::try_from(offset).unwrap_or(u32::MAX));
            d.data = data.slice(offset..offset + n);
            out.push(d);
            data_sn += 1;
            offset += n;
        }
        if collapse && !data.is_empty() {
            return;
        }
        let exp_data_sn = if t.read { data_sn } else { t.r2t_sn };
        let res = Residual {
            flags,
            count: residual,
        };
        self.respond(itt, r.status, &r.sense, res, out);
        if let Some(last) = out.last_mut() {
            last.set_u32(36, exp_data_sn);
        }
    }

    /// A SCSI Response PDU (status, sense data, residual).
    fn respond(&mut self, itt: u32, status: u8, sense: &[u8], res: Residual, out: &mut Vec<Pdu>) {
        let mut p = Pdu::new(op::SCSI_RESPONSE);
        p.bhs[1] = 0x80 | res.flags;
        p.bhs[2] = 0x00; // command completed at target
        p.bhs[3] = status;
        p.set_itt(itt);
        self.stamp(&mut p, true);
        p.set_u32(44, res.count);
        if !sense.is_empty() {
            let mut d = u16::try_from(sense.len())
                .unwrap_or(u16::MAX)
                .to_be_bytes()
                .to_vec();
            d.extend_from_slice(sense);
            p.data = Bytes::from(d);
        }
        out.push(p);
    }

    fn text(&mut self, p: &Pdu, targets: &dyn Targets, out: &mut Vec<Pdu>) {
        let ttt = p.u32_at(20);
        if ttt != NO_TAG {
            // The initiator asks for the next part of a long response.
            match self.text_rest.take() {
                Some((tag, rest)) if tag == ttt && p.data.is_empty() => {
                    self.text_reply(p.itt(), rest, out);
                }
                _ => self.reject(p, 0x09, out),
            }
            return;
        }
        self.text_rest = None;
        let mut answer = Vec::new();
        match text::parse(&p.data) {
            Ok(keys) => {
                for (k, v) in keys {
                    if k == "SendTargets" {
                        let only = match (self.params.session_type, v.as_str()) {
                            (SessionType::Discovery, "All") => None,
                            (SessionType::Discovery, name) => Some(name.to_string()),
                            (SessionType::Normal, "" | "All") => self.params.target_name.clone(),
                            (SessionType::Normal, name) => Some(name.to_string()),
                        };
                        answer.extend(
                            targets.send_targets(&self.params.initiator_name, only.as_deref()),
                        );
                    } else {
                        answer.push((k, "NotUnderstood".into()));
                    }
                }
            }
            Err(_) => {
                self.reject(p, 0x09, out);
                return;
            }
        }
        self.text_reply(p.itt(), text::encode(&answer), out);
    }

    /// Send `data` as a Text Response; what does not fit in the initiator's
    /// MaxRecvDataSegmentLength waits for a continuation request (C bit
    /// set, a target transfer tag to ask with).
    fn text_reply(&mut self, itt: u32, mut data: Vec<u8>, out: &mut Vec<Pdu>) {
        let max = self.params.max_send_data.max(512) as usize;
        let mut r = Pdu::new(op::TEXT_RESPONSE);
        r.set_itt(itt);
        if data.len() > max {
            let rest = data.split_off(max);
            let tag = self.next_ttt;
            self.next_ttt = self.next_ttt.wrapping_add(1).max(1);
            if self.next_ttt == NO_TAG {
                self.next_ttt = 1;
            }
            r.bhs[1] = 0x40; // C: continues; not final
            r.set_u32(20, tag);
            self.text_rest = Some((tag, rest));
        } else {
            r.bhs[1] = 0x80;
            r.set_u32(20, NO_TAG);
        }
        self.stamp(&mut r, true);
        r.data = Bytes::from(data);
        out.push(r);
    }

    fn task_mgmt(&mut self, p: &Pdu, out: &mut Vec<Pdu>, events: &mut Vec<Event>) {
        let function = match p.bhs[1] & 0x7f {
            1 => TmfFunction::AbortTask,
            2 => TmfFunction::AbortTaskSet,
            3 => TmfFunction::ClearAca,
            4 => TmfFunction::ClearTaskSet,
            5 => TmfFunction::LunReset,
            6 => TmfFunction::TargetWarmReset,
            7 => TmfFunction::TargetColdReset,
            8 => TmfFunction::TaskReassign,
            _ => {
                self.reject(p, 0x09, out);
                return;
            }
        };
        let lun = lun_of(p);
        let response = match function {
            TmfFunction::AbortTask => {
                let rtt = p.u32_at(20);
                let ref_cmdsn = p.u32_at(32);
                match self.tasks.get_mut(&rtt) {
                    Some(t) => {
                        t.aborted = true;
                        if !t.executing && t.unsolicited_left == 0 {
                            self.tasks.remove(&rtt);
                        }
                        0
                    }
                    // Already received (one connection delivers in
                    // order), so it has completed: the task does not exist.
                    None if sn_lt(ref_cmdsn, self.exp_cmdsn) => 1,
                    // Never received: it counts as received and aborted.
                    None => 0,
                }
            }
            TmfFunction::AbortTaskSet | TmfFunction::ClearTaskSet => {
                self.abort_all(Some(lun));
                0
            }
            TmfFunction::LunReset => {
                self.abort_all(None);
                events.push(Event::Reset {
                    function,
                    lun: Some(lun),
                });
                0
            }
            TmfFunction::TargetWarmReset | TmfFunction::TargetColdReset => {
                self.abort_all(None);
                events.push(Event::Reset {
                    function,
                    lun: None,
                });
                0
            }
            TmfFunction::ClearAca => 5,
            TmfFunction::TaskReassign => 4,
        };
        let mut r = Pdu::new(op::TASK_MGMT_RESPONSE);
        r.bhs[1] = 0x80;
        r.bhs[2] = response;
        r.set_itt(p.itt());
        self.stamp(&mut r, true);
        out.push(r);
    }

    fn abort_all(&mut self, lun: Option<u64>) {
        self.tasks.retain(|_, t| {
            if lun.is_some_and(|l| l != t.lun) {
                return true;
            }
            t.aborted = true;
            t.executing || t.unsolicited_left > 0
        });
    }

    /// A NOP-In that asks the initiator to answer (keepalive).
    pub fn ping(&mut self, ttt: u32) -> Pdu {
        let mut r = Pdu::new(op::NOP_IN);
        r.bhs[1] = 0x80;
        r.set_itt(NO_TAG);
        r.set_u32(20, ttt);
        self.stamp(&mut r, false);
        r
    }

    /// An asynchronous message asking the initiator to log out within
    /// `seconds` (sent before the daemon stops).
    pub fn request_logout(&mut self, seconds: u16) -> Pdu {
        let mut r = Pdu::new(op::ASYNC);
        r.bhs[1] = 0x80;
        r.set_itt(NO_TAG);
        self.stamp(&mut r, false);
        r.bhs[36] = 1;
        r.bhs[42..44].copy_from_slice(&seconds.to_be_bytes());
        r
    }

    /// Tasks currently known (collecting data or executing).
    pub fn outstanding(&self) -> usize {
        self.tasks.len()
    }
}

/// Residual flags (O 0x04 / U 0x02) and count of a SCSI Response.
#[derive(Debug, Clone, Copy)]
struct Residual {
    flags: u8,
    count: u32,
}

impl Residual {
    /// `moved` of `edtl` expected bytes moved: underflow of the rest.
    fn under(edtl: u32, moved: u32) -> Residual {
        let count = edtl.saturating_sub(moved);
        Residual {
            flags: if count > 0 { 0x02 } else { 0 },
            count,
        }
    }
}

/// ABORTED COMMAND, DATA PHASE ERROR (fixed format).
fn data_phase_error_sense() -> Vec<u8> {
    let mut s = vec![0u8; 18];
    s[0] = 0x70;
    s[2] = 0x0b;
    s[7] = 10;
    s[12] = 0x4b;
    s
}

fn invalid_field_sense() -> Vec<u8> {
    let mut s = vec![0u8; 18];
    s[0] = 0x70;
    s[2] = 0x05;
    s[7] = 10;
    s[12] = 0x24;
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::login::TargetPolicy;

    struct Many;
    impl Targets for Many {
        fn policy(&self, _: &str) -> Option<TargetPolicy> {
            None
        }
        fn discovery_policy(&self) -> TargetPolicy {
            TargetPolicy::default()
        }
        fn send_targets(&self, _: &str, _: Option<&str>) -> Vec<(String, String)> {
            (0..100)
                .flat_map(|i| {
                    [
                        (
                            "TargetName".to_string(),
                            format!("iqn.2026-11.io.ferry:volume-{i:04}"),
                        ),
                        ("TargetAddress".to_string(), "127.0.0.1:3260,1".to_string()),
                    ]
                })
                .collect()
        }
        fn portal_group(&self) -> u16 {
            1
        }
    }

    fn discovery() -> Session {
        Session::new(SessionParams {
            session_type: SessionType::Discovery,
            initiator_name: "iqn.i".into(),
            tsih: 1,
            max_send_data: 1024,
            exp_cmdsn: 1,
            stat_sn: 1,
            ..SessionParams::default()
        })
    }

    fn text_request(itt: u32, cmdsn: u32, ttt: u32, data: &[u8]) -> Pdu {
        let mut p = Pdu::new(op::TEXT);
        p.bhs[1] = 0x80;
        p.set_itt(itt);
        p.set_u32(20, ttt);
        p.set_u32(24, cmdsn);
        p.data = Bytes::copy_from_slice(data);
        p
    }

    #[test]
    fn long_send_targets_answer_continues() {
        let mut s = discovery();
        let (mut out, mut ev) = (Vec::new(), Vec::new());
        s.receive(
            text_request(5, 1, NO_TAG, b"SendTargets=All\0"),
            &Many,
            &mut out,
            &mut ev,
        )
        .unwrap();
        let mut all = Vec::new();
        let mut cmdsn = 2;
        loop {
            let r = out.pop().unwrap();
            assert_eq!(r.opcode(), op::TEXT_RESPONSE);
            assert!(r.data.len() <= 1024);
            all.extend_from_slice(&r.data);
            if r.final_bit() {
                assert_eq!(r.u32_at(20), NO_TAG);
                break;
            }
            assert_eq!(r.bhs[1] & 0x40, 0x40);
            let ttt = r.u32_at(20);
            s.receive(text_request(5, cmdsn, ttt, b""), &Many, &mut out, &mut ev)
                .unwrap();
            cmdsn += 1;
        }
        let pairs: Vec<&[u8]> = all.split(|b| *b == 0).filter(|x| !x.is_empty()).collect();
        assert_eq!(pairs.len(), 200, "every pair arrives whole once joined");
        assert!(pairs.iter().all(|p| p.starts_with(b"Target")));
        // A continuation with a stale tag is rejected.
        s.receive(text_request(6, cmdsn, 77, b""), &Many, &mut out, &mut ev)
            .unwrap();
        assert_eq!(out.pop().unwrap().opcode(), op::REJECT);
    }
}
