//! Reservations: SPC-4 persistent reservations (PERSISTENT RESERVE IN/OUT)
//! and SPC-2 RESERVE/RELEASE, and the access check every command passes.

use crate::cdb::{be16, be32, be64, byte};
use crate::sense::Sense;
use crate::Status;
use std::collections::BTreeMap;

pub const WRITE_EXCLUSIVE: u8 = 1;
pub const EXCLUSIVE_ACCESS: u8 = 3;
pub const WRITE_EXCLUSIVE_RO: u8 = 5;
pub const EXCLUSIVE_ACCESS_RO: u8 = 6;
pub const WRITE_EXCLUSIVE_AR: u8 = 7;
pub const EXCLUSIVE_ACCESS_AR: u8 = 8;

fn valid_type(t: u8) -> bool {
    matches!(t, 1 | 3 | 5 | 6 | 7 | 8)
}
fn all_registrants(t: u8) -> bool {
    matches!(t, WRITE_EXCLUSIVE_AR | EXCLUSIVE_ACCESS_AR)
}
fn registrants_only(t: u8) -> bool {
    matches!(t, WRITE_EXCLUSIVE_RO | EXCLUSIVE_ACCESS_RO)
}

/// How a command touches the medium, for the reservation check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Never conflicts (INQUIRY, REPORT LUNS, REQUEST SENSE, PR IN/OUT...).
    Always,
    /// Reports unit state: allowed under a persistent reservation, not
    /// under another nexus's SPC-2 reservation (TEST UNIT READY, READ
    /// CAPACITY, PREVENT ALLOW).
    Meta,
    /// Reads the medium or its state.
    Read,
    /// Changes the medium.
    Write,
    /// SPC-2 RESERVE/RELEASE: conflict with any persistent reservation.
    Spc2,
}

#[derive(Debug, Default)]
pub struct Reservations {
    generation: u32,
    /// Registered I_T nexuses and their keys.
    keys: BTreeMap<String, u64>,
    /// The persistent reservation: holder (ignored for all-registrants
    /// types) and type.
    held: Option<(String, u8)>,
    /// SPC-2 reservation holder.
    spc2: Option<String>,
    /// Activate Persist Through Power Loss: the state is saved after every
    /// change and loaded when the unit is made.
    aptpl: bool,
}

/// Unit attentions to queue for other nexuses.
pub type Notices = Vec<(String, Sense)>;

fn conflict() -> Result<(Vec<u8>, Notices), (Status, Option<Sense>)> {
    Err((Status::ReservationConflict, None))
}

impl Reservations {
    fn is_holder(&self, nexus: &str) -> bool {
        match &self.held {
            Some((_, t)) if all_registrants(*t) => self.keys.contains_key(nexus),
            Some((h, _)) => h == nexus,
            None => false,
        }
    }

    /// May `nexus` run a command with this access?
    pub fn check(&self, nexus: &str, access: Access) -> bool {
        if access == Access::Always {
            return true;
        }
        if let Some(h) = &self.spc2 {
            if h != nexus {
                return false;
            }
        }
        if access == Access::Spc2 {
            return self.held.is_none();
        }
        if access == Access::Meta {
            return true;
        }
        let Some((_, t)) = &self.held else {
            return true;
        };
        if self.is_holder(nexus) {
            return true;
        }
        let registered = self.keys.contains_key(nexus);
        match *t {
            WRITE_EXCLUSIVE => access == Access::Read,
            EXCLUSIVE_ACCESS => false,
            WRITE_EXCLUSIVE_RO | WRITE_EXCLUSIVE_AR => registered || access == Access::Read,
            EXCLUSIVE_ACCESS_RO | EXCLUSIVE_ACCESS_AR => registered,
            _ => true,
        }
    }

    pub fn spc2_reserve(&mut self, nexus: &str) -> bool {
        if self.held.is_some() {
            return false;
        }
        match &self.spc2 {
            Some(h) if h != nexus => false,
            _ => {
                self.spc2 = Some(nexus.to_string());
                true
            }
        }
    }

    pub fn spc2_release(&mut self, nexus: &str) {
        if self.spc2.as_deref() == Some(nexus) {
            self.spc2 = None;
        }
    }

    /// A LUN or target reset: SPC-2 reservations go, persistent ones stay.
    pub fn reset(&mut self) {
        self.spc2 = None;
    }

    /// The nexus is gone (logout, connection loss).
    pub fn nexus_lost(&mut self, nexus: &str) {
        self.spc2_release(nexus);
    }

    /// PERSISTENT RESERVE IN.
    pub fn pr_in(&self, cdb: &[u8]) -> Result<Vec<u8>, Sense> {
        let sa = byte(cdb, 1) & 0x1f;
        let mut d = self.generation.to_be_bytes().to_vec();
        match sa {
            0 => {
                let keys: Vec<u8> = self.keys.values().flat_map(|k| k.to_be_bytes()).collect();
                d.extend_from_slice(&(keys.len() as u32).to_be_bytes());
                d.extend_from_slice(&keys);
            }
            1 => match &self.held {
                Some((h, t)) => {
                    d.extend_from_slice(&16u32.to_be_bytes());
                    let key = if all_registrants(*t) {
                        0
                    } else {
                        self.keys.get(h).copied().unwrap_or(0)
                    };
                    d.extend_from_slice(&key.to_be_bytes());
                    d.extend_from_slice(&[0, 0, 0, 0, 0, *t & 0x0f, 0, 0]);
                }
                None => d.extend_from_slice(&0u32.to_be_bytes()),
            },
            2 => {
                // PTPL_C: persistence through power loss is supported;
                // PTPL_A: it is active.
                d = vec![0, 8, 0x01, 0x80 | u8::from(self.aptpl), 0, 0, 0, 0];
                // Types supported: WR_EX_AR, EX_AC_RO, WR_EX_RO, EX_AC, WR_EX / EX_AC_AR.
                d[4] = 0x80 | 0x40 | 0x20 | 0x08 | 0x02;
                d[5] = 0x01;
            }
            3 => {
                let mut body = Vec::new();
                for (nexus, key) in &self.keys {
                    let holder = self.is_holder(nexus);
                    let mut desc = key.to_be_bytes().to_vec();
                    desc.extend_from_slice(&[0, 0, 0, 0]);
                    desc.push(if holder { 0x01 } else { 0 });
                    desc.push(if holder {
                        self.held.as_ref().map(|h| h.1).unwrap_or(0)
                    } else {
                        0
                    });
                    desc.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
                    // iSCSI TransportID, format 01: name,i,0xISID.
                    let mut tid = vec![0x45, 0];
                    let mut name = nexus.as_bytes().to_vec();
                    name.push(0);
                    while !name.len().is_multiple_of(4) {
                        name.push(0);
                    }
                    tid.extend_from_slice(&(name.len() as u16).to_be_bytes());
                    tid.extend_from_slice(&name);
                    desc.extend_from_slice(&(tid.len() as u32).to_be_bytes());
                    desc.extend_from_slice(&tid);
                    body.extend_from_slice(&desc);
                }
                d.extend_from_slice(&(body.len() as u32).to_be_bytes());
                d.extend_from_slice(&body);
            }
            _ => return Err(Sense::INVALID_FIELD_IN_CDB.field(true, 1, Some(4))),
        }
        Ok(d)
    }

    /// PERSISTENT RESERVE OUT from `nexus` with parameter list `p`.
    pub fn pr_out(
        &mut self,
        nexus: &str,
        cdb: &[u8],
        p: &[u8],
    ) -> Result<(Vec<u8>, Notices), (Status, Option<Sense>)> {
        let sa = byte(cdb, 1) & 0x1f;
        let scope = byte(cdb, 2) >> 4;
        let rtype = byte(cdb, 2) & 0x0f;
        let len = be32(cdb, 5) as usize;
        let bad_cdb = |b| {
            Err((
                Status::CheckCondition,
                Some(Sense::INVALID_FIELD_IN_CDB.field(true, b, None)),
            ))
        };
        if sa > 7 {
            return bad_cdb(1);
        }
        if len != 24 || p.len() < 24 {
            return Err((Status::CheckCondition, Some(Sense::PARAM_LIST_LENGTH_ERROR)));
        }
        let key = be64(p, 0);
        let sa_key = be64(p, 8);
        let flags = byte(p, 20);
        if flags & 0x0c != 0 {
            // SPEC_I_PT and ALL_TG_PT are not supported.
            return Err((
                Status::CheckCondition,
                Some(Sense::INVALID_FIELD_IN_PARAM_LIST.field(false, 20, None)),
            ));
        }
        let mine = self.keys.get(nexus).copied();
        let mut notices = Notices::new();
        match sa {
            0 | 6 => {
                // REGISTER / REGISTER AND IGNORE EXISTING KEY
                if sa == 0 {
                    match mine {
                        None if key != 0 => return conflict(),
                        Some(k) if k != key => return conflict(),
                        _ => {}
                    }
                }
                if sa_key == 0 {
                    if mine.is_some() {
                        self.unregister(nexus, &mut notices);
                    }
                } else {
                    self.keys.insert(nexus.to_string(), sa_key);
                }
                // APTPL is taken from REGISTER and applies to all state.
                self.aptpl = flags & 0x01 != 0;
                self.generation = self.generation.wrapping_add(1);
            }
            1 => {
                if mine != Some(key) {
                    return conflict();
                }
                if scope != 0 {
                    return bad_cdb(2);
                }
                if !valid_type(rtype) {
                    return bad_cdb(2);
                }
                match &self.held {
                    None => self.held = Some((nexus.to_string(), rtype)),
                    Some((_, t)) if *t == rtype && self.is_holder(nexus) => {}
                    Some(_) => return conflict(),
                }
            }
            2 => {
                if mine != Some(key) {
                    return conflict();
                }
                if let Some((_, t)) = self.held.clone() {
                    if self.is_holder(nexus) {
                        if t != rtype || scope != 0 {
                            return Err((
                                Status::CheckCondition,
                                Some(Sense::INVALID_RELEASE_OF_PR),
                            ));
                        }
                        self.held = None;
                        if t != WRITE_EXCLUSIVE && t != EXCLUSIVE_ACCESS {
                            for n in self.keys.keys().filter(|n| *n != nexus) {
                                notices.push((n.clone(), Sense::RESERVATIONS_RELEASED));
                            }
                        }
                    }
                }
            }
            3 => {
                if mine != Some(key) {
                    return conflict();
                }
                for n in self.keys.keys().filter(|n| *n != nexus) {
                    notices.push((n.clone(), Sense::RESERVATIONS_PREEMPTED));
                }
                self.keys.clear();
                self.held = None;
                self.generation = self.generation.wrapping_add(1);
            }
            4 | 5 => {
                if mine != Some(key) {
                    return conflict();
                }
                let holder_key = match &self.held {
                    Some((h, t)) if !all_registrants(*t) => self.keys.get(h).copied(),
                    _ => None,
                };
                let ar = matches!(&self.held, Some((_, t)) if all_registrants(*t));
                if sa_key == 0 && !ar {
                    return Err((
                        Status::CheckCondition,
                        Some(Sense::INVALID_FIELD_IN_PARAM_LIST.field(false, 8, None)),
                    ));
                }
                if !valid_type(rtype) && self.held.is_some() {
                    return bad_cdb(2);
                }
                let victims: Vec<String> = self
                    .keys
                    .iter()
                    .filter(|(n, k)| *n != nexus && (sa_key == 0 || **k == sa_key))
                    .map(|(n, _)| n.clone())
                    .collect();
                let takes =
                    holder_key == Some(sa_key) || (ar && (sa_key == 0 || self.held.is_some()));
                if victims.is_empty() && !takes {
                    return conflict();
                }
                for v in &victims {
                    self.keys.remove(v);
                    notices.push((v.clone(), Sense::REGISTRATIONS_PREEMPTED));
                }
                if takes {
                    self.held = Some((nexus.to_string(), rtype));
                }
                self.generation = self.generation.wrapping_add(1);
            }
            _ => return bad_cdb(1),
        }
        Ok((Vec::new(), notices))
    }

    /// Whether the state must be saved (APTPL was set by the last REGISTER).
    pub fn persistent(&self) -> bool {
        self.aptpl
    }

    /// The persistent-reservation state as text, one record a line:
    ///
    /// ```text
    /// ferry-pr <TAB> 2                  format and version
    /// generation <TAB> N
    /// key <TAB> PORT <TAB> HEX          one per registered I_T nexus
    /// held <TAB> PORT <TAB> TYPE        the reservation, if any
    /// sum <TAB> HEX                     BLAKE3 (16 bytes) of every line above
    /// ```
    ///
    /// Tab separated (initiator port names contain no tabs or newlines);
    /// at most [`MAX_SAVED`] bytes are ever read back.
    pub fn save(&self) -> String {
        let mut s = format!("ferry-pr\t2\ngeneration\t{}\n", self.generation);
        for (port, key) in &self.keys {
            s.push_str(&format!("key\t{port}\t{key:016x}\n"));
        }
        if let Some((port, t)) = &self.held {
            s.push_str(&format!("held\t{port}\t{t}\n"));
        }
        let sum = checksum(&s);
        s.push_str(&format!("sum\t{sum}\n"));
        s
    }

    /// Load what [`Reservations::save`] wrote; None if it is not that (too
    /// large, wrong format, a bad record or a checksum that does not match).
    /// Version 1 files (written before the checksum) are still read.
    pub fn load(text: &str) -> Option<Reservations> {
        if text.len() > MAX_SAVED {
            return None;
        }
        let body = match text.strip_prefix("ferry-pr\t2\n") {
            Some(_) => {
                let cut = text.trim_end_matches('\n').rfind('\n')? + 1;
                let (body, last) = text.split_at(cut);
                if last.trim_end_matches('\n') != format!("sum\t{}", checksum(body)) {
                    return None;
                }
                body
            }
            None if text.starts_with("ferry-pr\t1\n") => text,
            None => return None,
        };
        let mut lines = body.lines();
        lines.next()?;
        let mut r = Reservations {
            aptpl: true,
            ..Reservations::default()
        };
        for line in lines {
            let f: Vec<&str> = line.split('\t').collect();
            match f.as_slice() {
                ["generation", g] => r.generation = g.parse().ok()?,
                ["key", port, key] => {
                    r.keys
                        .insert((*port).to_string(), u64::from_str_radix(key, 16).ok()?);
                }
                ["held", port, t] => {
                    let t: u8 = t.parse().ok()?;
                    if !valid_type(t) {
                        return None;
                    }
                    r.held = Some(((*port).to_string(), t));
                }
                _ => return None,
            }
        }
        Some(r)
    }

    fn unregister(&mut self, nexus: &str, notices: &mut Notices) {
        self.keys.remove(nexus);
        match &self.held {
            Some((h, t)) if !all_registrants(*t) && h == nexus => {
                let t = *t;
                self.held = None;
                if registrants_only(t) {
                    for n in self.keys.keys() {
                        notices.push((n.clone(), Sense::RESERVATIONS_RELEASED));
                    }
                }
            }
            Some((_, t)) if all_registrants(*t) && self.keys.is_empty() => self.held = None,
            _ => {}
        }
    }
}

/// Largest saved reservation state read back (1 MiB: far more than any
/// initiator count a target serves).
pub const MAX_SAVED: usize = 1 << 20;

/// First 16 bytes of the BLAKE3 of `text`, as hex.
fn checksum(text: &str) -> String {
    blake3::hash(text.as_bytes()).as_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The service action field's allowed range for PR IN (checked by tests).
pub fn pr_in_alloc(cdb: &[u8]) -> usize {
    usize::from(be16(cdb, 7))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn out(
        r: &mut Reservations,
        n: &str,
        sa: u8,
        t: u8,
        key: u64,
        sa_key: u64,
    ) -> Result<(), Status> {
        let mut cdb = [0u8; 10];
        cdb[0] = 0x5f;
        cdb[1] = sa;
        cdb[2] = t;
        cdb[8] = 24;
        let mut p = [0u8; 24];
        p[0..8].copy_from_slice(&key.to_be_bytes());
        p[8..16].copy_from_slice(&sa_key.to_be_bytes());
        r.pr_out(n, &cdb, &p).map(|_| ()).map_err(|e| e.0)
    }

    #[test]
    fn write_exclusive_lets_others_read_only() {
        let mut r = Reservations::default();
        out(&mut r, "a", 0, 0, 0, 1).unwrap();
        out(&mut r, "b", 0, 0, 0, 2).unwrap();
        assert_eq!(
            out(&mut r, "a", 1, WRITE_EXCLUSIVE, 2, 0),
            Err(Status::ReservationConflict)
        );
        out(&mut r, "a", 1, WRITE_EXCLUSIVE, 1, 0).unwrap();
        assert!(r.check("a", Access::Write));
        assert!(r.check("b", Access::Read));
        assert!(!r.check("b", Access::Write));
        assert!(!r.check("c", Access::Write));
        // Preempt: b takes over.
        out(&mut r, "b", 4, EXCLUSIVE_ACCESS, 2, 1).unwrap();
        assert!(!r.check("a", Access::Read));
        assert!(r.check("b", Access::Write));
    }

    #[test]
    fn registrants_only_and_unregister_releases() {
        let mut r = Reservations::default();
        out(&mut r, "a", 0, 0, 0, 1).unwrap();
        out(&mut r, "b", 0, 0, 0, 2).unwrap();
        out(&mut r, "a", 1, EXCLUSIVE_ACCESS_RO, 1, 0).unwrap();
        assert!(r.check("b", Access::Write));
        assert!(!r.check("c", Access::Read));
        out(&mut r, "a", 0, 0, 1, 0).unwrap(); // unregister
        assert!(r.check("c", Access::Write));
    }

    #[test]
    fn aptpl_state_round_trips() {
        let mut r = Reservations::default();
        let mut cdb = [0u8; 10];
        cdb[0] = 0x5f;
        cdb[8] = 24;
        let mut p = [0u8; 24];
        p[8..16].copy_from_slice(&7u64.to_be_bytes());
        p[20] = 0x01; // APTPL
        r.pr_out("a,i,0x01", &cdb, &p).unwrap();
        out(&mut r, "a,i,0x01", 1, WRITE_EXCLUSIVE_RO, 7, 0).unwrap();
        assert!(r.persistent());
        let back = Reservations::load(&r.save()).unwrap();
        assert_eq!(back.keys, r.keys);
        assert_eq!(back.held, r.held);
        assert_eq!(back.generation, r.generation);
        assert!(Reservations::load("garbage").is_none());
        assert!(Reservations::load("ferry-pr\t1\nheld\tx\t99\n").is_none());
        // Version 2 carries a checksum: any change to a record is refused.
        let mut r = Reservations::default();
        r.keys.insert("iqn.a,i,0x1".into(), 0xabc);
        r.held = Some(("iqn.a,i,0x1".into(), 1));
        r.generation = 7;
        let saved = r.save();
        let back = Reservations::load(&saved).unwrap();
        assert_eq!((back.generation, back.held.clone()), (7, r.held.clone()));
        assert!(
            Reservations::load(&saved.replace("0000000000000abc", "0000000000000abd")).is_none()
        );
        assert!(Reservations::load(&saved.replace("generation\t7", "generation\t8")).is_none());
        assert!(Reservations::load(&saved[..saved.len() - 5]).is_none());
        let huge = format!("ferry-pr\t1\n{}", "generation\t1\n".repeat(MAX_SAVED / 10));
        assert!(Reservations::load(&huge).is_none());
    }

    #[test]
    fn spc2_blocks_others() {
        let mut r = Reservations::default();
        assert!(r.spc2_reserve("a"));
        assert!(!r.spc2_reserve("b"));
        assert!(!r.check("b", Access::Read));
        assert!(r.check("b", Access::Always));
        r.nexus_lost("a");
        assert!(r.check("b", Access::Write));
    }
}
