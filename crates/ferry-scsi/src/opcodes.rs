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

pub const COMMANDS: &[OpInfo] = &[
    op(0x00, 6),     // TEST UNIT READY
    op(0x03, 6),     // REQUEST SENSE
    op(0x08, 6),     // READ(6)
    op(0x0a, 6),     // WRITE(6)
    op(0x12, 6),     // INQUIRY
    op(0x15, 6),     // MODE SELECT(6)
    op(0x16, 6),     // RESERVE(6)
    op(0x17, 6),     // RELEASE(6)
    op(0x1a, 6),     // MODE SENSE(6)
    op(0x1b, 6),     // START STOP UNIT
    op(0x1e, 6),     // PREVENT ALLOW MEDIUM REMOVAL
    op(0x25, 10),    // READ CAPACITY(10)
    op(0x28, 10),    // READ(10)
    op(0x2a, 10),    // WRITE(10)
    op(0x2e, 10),    // WRITE AND VERIFY(10)
    op(0x2f, 10),    // VERIFY(10)
    op(0x34, 10),    // PRE-FETCH(10)
    op(0x35, 10),    // SYNCHRONIZE CACHE(10)
    op(0x37, 10),    // READ DEFECT DATA(10)
    op(0x41, 10),    // WRITE SAME(10)
    op(0x42, 10),    // UNMAP
    op(0x55, 10),    // MODE SELECT(10)
    op(0x56, 10),    // RESERVE(10)
    op(0x57, 10),    // RELEASE(10)
    op(0x5a, 10),    // MODE SENSE(10)
    sa(0x5e, 0, 10), // PERSISTENT RESERVE IN
    sa(0x5e, 1, 10),
    sa(0x5e, 2, 10),
    sa(0x5e, 3, 10),
    sa(0x5f, 0, 10), // PERSISTENT RESERVE OUT
    sa(0x5f, 1, 10),
    sa(0x5f, 2, 10),
    sa(0x5f, 3, 10),
    sa(0x5f, 4, 10),
    sa(0x5f, 5, 10),
    sa(0x5f, 6, 10),
    op(0x88, 16),       // READ(16)
    op(0x89, 16),       // COMPARE AND WRITE
    op(0x8a, 16),       // WRITE(16)
    op(0x8b, 16),       // ORWRITE(16)
    op(0x8e, 16),       // WRITE AND VERIFY(16)
    op(0x8f, 16),       // VERIFY(16)
    op(0x90, 16),       // PRE-FETCH(16)
    op(0x91, 16),       // SYNCHRONIZE CACHE(16)
    op(0x93, 16),       // WRITE SAME(16)
    op(0x9c, 16),       // WRITE ATOMIC(16)
    sa(0x9e, 0x10, 16), // READ CAPACITY(16)
    sa(0x9e, 0x12, 16), // GET LBA STATUS
    op(0xa0, 12),       // REPORT LUNS
    sa(0xa3, 0x0a, 12), // REPORT TARGET PORT GROUPS
    sa(0xa3, 0x0c, 12), // REPORT SUPPORTED OPERATION CODES
    op(0xa8, 12),       // READ(12)
    op(0xaa, 12),       // WRITE(12)
    op(0xae, 12),       // WRITE AND VERIFY(12)
    op(0xaf, 12),       // VERIFY(12)
    op(0xb7, 12),       // READ DEFECT DATA(12)
];

/// Opcodes whose service action field selects the command.
pub fn has_service_actions(opcode: u8) -> bool {
    COMMANDS
        .iter()
        .any(|c| c.opcode == opcode && c.service_action.is_some())
}

fn usage(c: &OpInfo) -> Vec<u8> {
    let mut u = vec![0xffu8; usize::from(c.cdb_len)];
    u[0] = c.opcode;
    if let Some(s) = c.service_action {
        u[1] = (s as u8 & 0x1f) | 0xe0;
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

/// REPORT SUPPORTED OPERATION CODES (MAINTENANCE IN, service action 0x0c).
pub fn report(cdb: &[u8]) -> Result<Vec<u8>, Sense> {
    let rctd = byte(cdb, 2) & 0x80 != 0;
    let options = byte(cdb, 2) & 0x07;
    let req_op = byte(cdb, 3);
    let req_sa = be16(cdb, 4);
    let _alloc = be32(cdb, 6);
    let bad = |b: u16| Sense::INVALID_FIELD_IN_CDB.field(true, b, None);
    match options {
        0 => {
            let mut body = Vec::new();
            for c in COMMANDS {
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
            let with_sa = has_service_actions(req_op);
            let found = match options {
                1 if with_sa => return Err(bad(2)),
                1 => COMMANDS.iter().find(|c| c.opcode == req_op),
                2 if !with_sa && COMMANDS.iter().any(|c| c.opcode == req_op) => return Err(bad(2)),
                2 => COMMANDS
                    .iter()
                    .find(|c| c.opcode == req_op && c.service_action == Some(req_sa)),
                _ => COMMANDS
                    .iter()
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
