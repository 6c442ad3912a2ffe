//! The command table: every operation code (and service action) ferry
//! implements, as REPORT SUPPORTED OPERATION CODES reports it.

use crate::cdb::{be16, be32, byte};
use crate::sense::Sense;

/// One supported command.
#[derive(Debug, Clone, Copy)]
pub struct OpInfo {
    pub opcode: u8,
    pub service_action: Option<u16>,
    pub cdb_len: u8,
}

const fn op(opcode: u8, cdb_len: u8) -> OpInfo {
    OpInfo {
        opcode,
        service_action: None,
        cdb_len,
    }
}
const fn sa(opcode: u8, service_action: u16, cdb_len: u8) -> OpInfo {
    OpInfo {
        opcode,
        service_action: Some(service_action),
        cdb_len,
    }
}

/// Operation codes by name (SPC-4 / SBC-3), so code says which command it
/// means; [`COMMANDS`] and every dispatch use these.
pub mod op {
    pub const TEST_UNIT_READY: u8 = 0x00;
    pub const REQUEST_SENSE: u8 = 0x03;
    pub const READ_6: u8 = 0x08;
    pub const WRITE_6: u8 = 0x0a;
    pub const INQUIRY: u8 = 0x12;
    pub const MODE_SELECT_6: u8 = 0x15;
    pub const RESERVE_6: u8 = 0x16;
    pub const RELEASE_6: u8 = 0x17;
    pub const MODE_SENSE_6: u8 = 0x1a;
    pub const START_STOP_UNIT: u8 = 0x1b;
    pub const PREVENT_ALLOW_MEDIUM_REMOVAL: u8 = 0x1e;
    pub const READ_CAPACITY_10: u8 = 0x25;
    pub const READ_10: u8 = 0x28;
    pub const WRITE_10: u8 = 0x2a;
    pub const WRITE_AND_VERIFY_10: u8 = 0x2e;
    pub const VERIFY_10: u8 = 0x2f;
    pub const PRE_FETCH_10: u8 = 0x34;
    pub const SYNCHRONIZE_CACHE_10: u8 = 0x35;
    pub const READ_DEFECT_DATA_10: u8 = 0x37;
    pub const WRITE_SAME_10: u8 = 0x41;
    pub const UNMAP: u8 = 0x42;
    pub const SANITIZE: u8 = 0x48;
    pub const MODE_SELECT_10: u8 = 0x55;
    pub const RESERVE_10: u8 = 0x56;
    pub const RELEASE_10: u8 = 0x57;
    pub const MODE_SENSE_10: u8 = 0x5a;
    pub const PERSISTENT_RESERVE_IN: u8 = 0x5e;
    pub const PERSISTENT_RESERVE_OUT: u8 = 0x5f;
    pub const EXTENDED_COPY: u8 = 0x83;
    pub const RECEIVE_COPY_RESULTS: u8 = 0x84;
    pub const READ_16: u8 = 0x88;
    pub const COMPARE_AND_WRITE: u8 = 0x89;
    pub const WRITE_16: u8 = 0x8a;
    pub const ORWRITE_16: u8 = 0x8b;
    pub const WRITE_AND_VERIFY_16: u8 = 0x8e;
    pub const VERIFY_16: u8 = 0x8f;
    pub const PRE_FETCH_16: u8 = 0x90;
    pub const SYNCHRONIZE_CACHE_16: u8 = 0x91;
    pub const WRITE_SAME_16: u8 = 0x93;
    pub const WRITE_ATOMIC_16: u8 = 0x9c;
    pub const SERVICE_ACTION_IN_16: u8 = 0x9e;
    pub const REPORT_LUNS: u8 = 0xa0;
    pub const MAINTENANCE_IN: u8 = 0xa3;
    pub const READ_12: u8 = 0xa8;
    pub const WRITE_12: u8 = 0xaa;
    pub const WRITE_AND_VERIFY_12: u8 = 0xae;
    pub const VERIFY_12: u8 = 0xaf;
    pub const READ_DEFECT_DATA_12: u8 = 0xb7;
}

pub const COMMANDS: &[OpInfo] = &[
    op(op::TEST_UNIT_READY, 6),              // TEST UNIT READY
    op(op::REQUEST_SENSE, 6),                // REQUEST SENSE
    op(op::READ_6, 6),                       // READ(6)
    op(op::WRITE_6, 6),                      // WRITE(6)
    op(op::INQUIRY, 6),                      // INQUIRY
    op(op::MODE_SELECT_6, 6),                // MODE SELECT(6)
    op(op::RESERVE_6, 6),                    // RESERVE(6)
    op(op::RELEASE_6, 6),                    // RELEASE(6)
    op(op::MODE_SENSE_6, 6),                 // MODE SENSE(6)
    op(op::START_STOP_UNIT, 6),              // START STOP UNIT
    op(op::PREVENT_ALLOW_MEDIUM_REMOVAL, 6), // PREVENT ALLOW MEDIUM REMOVAL
    op(op::READ_CAPACITY_10, 10),            // READ CAPACITY(10)
    op(op::READ_10, 10),                     // READ(10)
    op(op::WRITE_10, 10),                    // WRITE(10)
    op(op::WRITE_AND_VERIFY_10, 10),         // WRITE AND VERIFY(10)
    op(op::VERIFY_10, 10),                   // VERIFY(10)
    op(op::PRE_FETCH_10, 10),                // PRE-FETCH(10)
    op(op::SYNCHRONIZE_CACHE_10, 10),        // SYNCHRONIZE CACHE(10)
    op(op::READ_DEFECT_DATA_10, 10),         // READ DEFECT DATA(10)
    op(op::WRITE_SAME_10, 10),               // WRITE SAME(10)
    op(op::UNMAP, 10),                       // UNMAP
    sa(op::SANITIZE, 0x01, 10),              // SANITIZE: OVERWRITE
    sa(op::SANITIZE, 0x02, 10),              // SANITIZE: BLOCK ERASE
    sa(op::SANITIZE, 0x1f, 10),              // SANITIZE: EXIT FAILURE MODE
    op(op::MODE_SELECT_10, 10),              // MODE SELECT(10)
    op(op::RESERVE_10, 10),                  // RESERVE(10)
    op(op::RELEASE_10, 10),                  // RELEASE(10)
    op(op::MODE_SENSE_10, 10),               // MODE SENSE(10)
    sa(op::PERSISTENT_RESERVE_IN, 0, 10),    // PERSISTENT RESERVE IN
    sa(op::PERSISTENT_RESERVE_IN, 1, 10),
    sa(op::PERSISTENT_RESERVE_IN, 2, 10),
    sa(op::PERSISTENT_RESERVE_IN, 3, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 0, 10), // PERSISTENT RESERVE OUT
    sa(op::PERSISTENT_RESERVE_OUT, 1, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 2, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 3, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 4, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 5, 10),
    sa(op::PERSISTENT_RESERVE_OUT, 6, 10),
    op(op::READ_16, 16),                    // READ(16)
    op(op::COMPARE_AND_WRITE, 16),          // COMPARE AND WRITE
    op(op::WRITE_16, 16),                   // WRITE(16)
    op(op::ORWRITE_16, 16),                 // ORWRITE(16)
    op(op::WRITE_AND_VERIFY_16, 16),        // WRITE AND VERIFY(16)
    op(op::VERIFY_16, 16),                  // VERIFY(16)
    op(op::PRE_FETCH_16, 16),               // PRE-FETCH(16)
    op(op::SYNCHRONIZE_CACHE_16, 16),       // SYNCHRONIZE CACHE(16)
    op(op::WRITE_SAME_16, 16),              // WRITE SAME(16)
    op(op::WRITE_ATOMIC_16, 16),            // WRITE ATOMIC(16)
    sa(op::SERVICE_ACTION_IN_16, 0x10, 16), // READ CAPACITY(16)
    sa(op::SERVICE_ACTION_IN_16, 0x12, 16), // GET LBA STATUS
    op(op::REPORT_LUNS, 12),                // REPORT LUNS
    sa(op::MAINTENANCE_IN, 0x0a, 12),       // REPORT TARGET PORT GROUPS
    sa(op::MAINTENANCE_IN, 0x0c, 12),       // REPORT SUPPORTED OPERATION CODES
    op(op::READ_12, 12),                    // READ(12)
    op(op::WRITE_12, 12),                   // WRITE(12)
    op(op::WRITE_AND_VERIFY_12, 12),        // WRITE AND VERIFY(12)
    op(op::VERIFY_12, 12),                  // VERIFY(12)
    op(op::READ_DEFECT_DATA_12, 12),        // READ DEFECT DATA(12)
];

fn usage(c: &OpInfo) -> Vec<u8> {
    let mut u = vec![0xffu8; usize::from(c.cdb_len)];
    u[0] = c.opcode;
    if let Some(s) = c.service_action {
        u[1] = (s as u8 & 0x1f) | 0xe0;
    }
    if c.opcode == op::SANITIZE {
        // IMMED, AUSE and the service action; bytes 2-6 are reserved.
        u[1] = 0xa0 | (u[1] & 0x1f);
        u[2..7].fill(0);
    }
    let last = u.len() - 1;
    u[last] = 0x07; // control byte: NACA and link are not supported
    u
}

fn timeouts() -> [u8; 12] {
    let mut t = [0u8; 12];
    t[1] = 0x0a;
    t[4..8].copy_from_slice(&30u32.to_be_bytes());
    t[8..12].copy_from_slice(&60u32.to_be_bytes());
    t
}

/// REPORT SUPPORTED OPERATION CODES (MAINTENANCE IN, service action 0x0c)
/// for a unit that implements the commands `supported` accepts out of
/// [`COMMANDS`].
pub fn report(cdb: &[u8], supported: impl Fn(&OpInfo) -> bool) -> Result<Vec<u8>, Sense> {
    let commands: Vec<&OpInfo> = COMMANDS.iter().filter(|c| supported(c)).collect();
    let rctd = byte(cdb, 2) & 0x80 != 0;
    let options = byte(cdb, 2) & 0x07;
    let req_op = byte(cdb, 3);
    let req_sa = be16(cdb, 4);
    let _alloc = be32(cdb, 6);
    let bad = |b: u16| Sense::INVALID_FIELD_IN_CDB.field(true, b, None);
    match options {
        0 => {
            let mut body = Vec::new();
            for c in &commands {
                body.push(c.opcode);
                body.push(0);
                body.extend_from_slice(&c.service_action.unwrap_or(0).to_be_bytes());
                body.push(0);
                let mut flags = 0;
                if c.service_action.is_some() {
                    flags |= 0x01;
                }
                if rctd {
                    flags |= 0x02;
                }
                body.push(flags);
                body.extend_from_slice(&u16::from(c.cdb_len).to_be_bytes());
                if rctd {
                    body.extend_from_slice(&timeouts());
                }
            }
            let mut d = (body.len() as u32).to_be_bytes().to_vec();
            d.extend_from_slice(&body);
            Ok(d)
        }
        1..=3 => {
            let with_sa = commands
                .iter()
                .any(|c| c.opcode == req_op && c.service_action.is_some());
            let found = match options {
                1 if with_sa => return Err(bad(2)),
                1 => commands.iter().copied().find(|c| c.opcode == req_op),
                2 if !with_sa && commands.iter().any(|c| c.opcode == req_op) => return Err(bad(2)),
                2 => commands
                    .iter()
                    .copied()
                    .find(|c| c.opcode == req_op && c.service_action == Some(req_sa)),
                _ => commands
                    .iter()
                    .copied()
                    .find(|c| c.opcode == req_op && c.service_action.is_none_or(|s| s == req_sa)),
            };
            let mut d = vec![0u8; 4];
            if rctd {
                d[1] |= 0x80;
            }
            match found {
                Some(c) => {
                    d[1] |= 0x03; // supported, per standard
                    let u = usage(c);
                    d[2..4].copy_from_slice(&(u.len() as u16).to_be_bytes());
                    d.extend_from_slice(&u);
                    if rctd {
                        d.extend_from_slice(&timeouts());
                    }
                }
                None => d[1] |= 0x01, // not supported
            }
            Ok(d)
        }
        _ => Err(bad(2)),
    }
}
