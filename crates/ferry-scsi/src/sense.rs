//! Sense data: the key/ASC/ASCQ triples ferry reports and their fixed
//! (0x70) and descriptor (0x72) encodings.

/// One SCSI error condition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    pub key: u8,
    pub asc: u8,
    pub ascq: u8,
    /// The INFORMATION field (e.g. the first miscompared byte offset).
    pub info: Option<u64>,
    /// Sense-key specific bytes (field pointer), already encoded.
    pub sks: Option<[u8; 3]>,
}

pub const NO_SENSE: u8 = 0x0;
pub const NOT_READY: u8 = 0x2;
pub const MEDIUM_ERROR: u8 = 0x3;
pub const ILLEGAL_REQUEST: u8 = 0x5;
pub const UNIT_ATTENTION: u8 = 0x6;
pub const DATA_PROTECT: u8 = 0x7;
pub const ABORTED_COMMAND: u8 = 0xb;
pub const MISCOMPARE: u8 = 0xe;

impl Sense {
    pub const fn new(key: u8, asc: u8, ascq: u8) -> Sense {
        Sense {
            key,
            asc,
            ascq,
            info: None,
            sks: None,
        }
    }
    pub const INVALID_OPCODE: Sense = Sense::new(ILLEGAL_REQUEST, 0x20, 0x00);
    pub const LBA_OUT_OF_RANGE: Sense = Sense::new(ILLEGAL_REQUEST, 0x21, 0x00);
    pub const INVALID_FIELD_IN_CDB: Sense = Sense::new(ILLEGAL_REQUEST, 0x24, 0x00);
    pub const LUN_NOT_SUPPORTED: Sense = Sense::new(ILLEGAL_REQUEST, 0x25, 0x00);
    pub const INVALID_FIELD_IN_PARAM_LIST: Sense = Sense::new(ILLEGAL_REQUEST, 0x26, 0x00);
    pub const PARAM_LIST_LENGTH_ERROR: Sense = Sense::new(ILLEGAL_REQUEST, 0x1a, 0x00);
    pub const SAVING_PARAMS_UNSUPPORTED: Sense = Sense::new(ILLEGAL_REQUEST, 0x39, 0x00);
    pub const INVALID_RELEASE_OF_PR: Sense = Sense::new(ILLEGAL_REQUEST, 0x26, 0x04);
    pub const WRITE_PROTECTED: Sense = Sense::new(DATA_PROTECT, 0x27, 0x00);
    pub const SPACE_ALLOCATION_FAILED: Sense = Sense::new(DATA_PROTECT, 0x27, 0x07);
    pub const MISCOMPARE_DURING_VERIFY: Sense = Sense::new(MISCOMPARE, 0x1d, 0x00);
    pub const UNRECOVERED_READ_ERROR: Sense = Sense::new(MEDIUM_ERROR, 0x11, 0x00);
    pub const WRITE_ERROR: Sense = Sense::new(MEDIUM_ERROR, 0x0c, 0x00);
    /// The volume moved to another site or was deleted.
    pub const LU_NOT_ACCESSIBLE: Sense = Sense::new(NOT_READY, 0x04, 0x0c);
    /// LOGICAL UNIT NOT ACCESSIBLE, ASYMMETRIC ACCESS STATE TRANSITION.
    pub const ALUA_TRANSITION: Sense = Sense::new(NOT_READY, 0x04, 0x0a);
    pub const POWER_ON_RESET: Sense = Sense::new(UNIT_ATTENTION, 0x29, 0x00);
    pub const BUS_DEVICE_RESET: Sense = Sense::new(UNIT_ATTENTION, 0x29, 0x03);
    pub const CAPACITY_CHANGED: Sense = Sense::new(UNIT_ATTENTION, 0x2a, 0x09);
    pub const RESERVATIONS_PREEMPTED: Sense = Sense::new(UNIT_ATTENTION, 0x2a, 0x03);
    pub const RESERVATIONS_RELEASED: Sense = Sense::new(UNIT_ATTENTION, 0x2a, 0x04);
    pub const REGISTRATIONS_PREEMPTED: Sense = Sense::new(UNIT_ATTENTION, 0x2a, 0x05);
    pub const MEDIUM_REMOVAL_PREVENTED: Sense = Sense::new(ILLEGAL_REQUEST, 0x53, 0x02);
    pub const COMMANDS_CLEARED: Sense = Sense::new(UNIT_ATTENTION, 0x2f, 0x00);
    pub const INTERNAL_TARGET_FAILURE: Sense = Sense::new(ABORTED_COMMAND, 0x44, 0x00);
    pub const SANITIZE_IN_PROGRESS: Sense = Sense::new(NOT_READY, 0x04, 0x1b);
    pub const SANITIZE_FAILED: Sense = Sense::new(MEDIUM_ERROR, 0x31, 0x03);

    pub const fn with_info(mut self, info: u64) -> Sense {
        self.info = Some(info);
        self
    }

    /// Point at the offending CDB byte (`cd` = true) or parameter byte.
    pub const fn field(mut self, cd: bool, byte: u16, bit: Option<u8>) -> Sense {
        let mut b0 = 0x80;
        if cd {
            b0 |= 0x40;
        }
        if let Some(bit) = bit {
            b0 |= 0x08 | (bit & 7);
        }
        let be = byte.to_be_bytes();
        self.sks = Some([b0, be[0], be[1]]);
        self
    }

    /// Progress indication (sense-key specific, SKSV set): `done` out of
    /// 65,536.
    pub const fn progress(mut self, done: u16) -> Sense {
        let be = done.to_be_bytes();
        self.sks = Some([0x80, be[0], be[1]]);
        self
    }

    /// Encode as fixed format (18 bytes) or descriptor format.
    pub fn encode(&self, descriptor: bool) -> Vec<u8> {
        if descriptor {
            let mut v = vec![0x72, self.key & 0xf, self.asc, self.ascq, 0, 0, 0, 0];
            if let Some(info) = self.info {
                v.extend_from_slice(&[0x00, 0x0a, 0x80, 0]);
                v.extend_from_slice(&info.to_be_bytes());
            }
            if let Some(sks) = self.sks {
                v.extend_from_slice(&[0x02, 0x06, 0, 0, sks[0], sks[1], sks[2], 0]);
            }
            v[7] = (v.len() - 8) as u8;
            return v;
        }
        let mut v = vec![0u8; 18];
        v[0] = 0x70;
        v[2] = self.key & 0xf;
        if let Some(info) = self.info {
            v[0] |= 0x80;
            v[3..7].copy_from_slice(&(info.min(u64::from(u32::MAX)) as u32).to_be_bytes());
        }
        v[7] = 10;
        v[12] = self.asc;
        v[13] = self.ascq;
        if let Some(sks) = self.sks {
            v[15..18].copy_from_slice(&sks);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_and_descriptor_formats() {
        let s = Sense::MISCOMPARE_DURING_VERIFY.with_info(513);
        let f = s.encode(false);
        assert_eq!(f.len(), 18);
        assert_eq!(f[0], 0xf0);
        assert_eq!(f[2], MISCOMPARE);
        assert_eq!(u32::from_be_bytes([f[3], f[4], f[5], f[6]]), 513);
        assert_eq!((f[12], f[13]), (0x1d, 0));
        let d = s.encode(true);
        assert_eq!(d[0], 0x72);
        assert_eq!((d[1], d[2], d[3]), (MISCOMPARE, 0x1d, 0));
        assert_eq!(usize::from(d[7]) + 8, d.len());
        assert_eq!(&d[12..20], &513u64.to_be_bytes());
    }

    #[test]
    fn field_pointer() {
        let f = Sense::INVALID_FIELD_IN_CDB
            .field(true, 1, Some(4))
            .encode(false);
        assert_eq!(&f[15..18], &[0xcc, 0, 1]);
    }
}
