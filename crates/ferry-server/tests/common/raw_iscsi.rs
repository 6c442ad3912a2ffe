//! A raw iSCSI initiator on a plain socket for tests that send what no
//! real initiator would: login, one command at a time, and READ(16) /
//! WRITE(16) CDBs.
#![allow(dead_code)]

use bytes::{Bytes, BytesMut};
use ferry_iscsi::pdu::{op, Pdu, PduDecoder};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub const IQN: &str = "iqn.2026-11.io.ferry";

pub fn login_pdu(keys: &str, csg: u8, nsg: u8) -> Pdu {
    let mut p = Pdu::new(op::LOGIN);
    p.bhs[0] |= 0x40;
    p.bhs[1] = 0x80 | (csg << 2) | nsg;
    let isid = NEXT_ISID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    p.bhs[8..14].copy_from_slice(&[0x80, 0, 0, 0x12, 0x34, isid]);
    let mut d = keys.replace('\n', "\0").into_bytes();
    if !d.ends_with(&[0]) {
        d.push(0);
    }
    p.data = Bytes::from(d);
    p
}

pub struct Raw {
    pub s: TcpStream,
    pub buf: BytesMut,
    pub dec: PduDecoder,
    pub cmdsn: u32,
    pub itt: u32,
}

/// Each raw session gets its own ISID (the same ISID would reinstate, and
/// so close, the previous session).
pub static NEXT_ISID: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(1);

impl Raw {
    pub fn connect(addr: SocketAddr) -> Raw {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Raw {
            s,
            buf: BytesMut::new(),
            dec: PduDecoder::new(1 << 20),
            cmdsn: 0,
            itt: 1,
        }
    }

    pub fn send(&mut self, p: &Pdu) {
        let hd = self.dec.header_digest;
        self.s.write_all(&p.to_bytes(hd, false)).unwrap();
    }

    /// The next PDU, or None when the target closed the connection.
    pub fn recv(&mut self) -> Option<Pdu> {
        loop {
            if let Ok(Some(p)) = self.dec.decode(&mut self.buf) {
                return Some(p);
            }
            let mut tmp = [0u8; 65536];
            match self.s.read(&mut tmp) {
                Ok(0) | Err(_) => return None,
                Ok(n) => self.buf.extend_from_slice(&tmp[..n]),
            }
        }
    }

    pub fn login(addr: SocketAddr, volume: &str, digest: bool) -> Raw {
        let mut r = Raw::connect(addr);
        let hd = if digest { "CRC32C" } else { "None" };
        r.send(&login_pdu(
            &format!("InitiatorName=iqn.2026-11.test:raw\nTargetName={IQN}:{volume}\nSessionType=Normal\nAuthMethod=None\nHeaderDigest={hd}\nDataDigest=None\nMaxRecvDataSegmentLength=65536\n"),
            1,
            3,
        ));
        let resp = r.recv().expect("login response");
        assert_eq!(resp.opcode(), op::LOGIN_RESPONSE);
        assert_eq!(resp.bhs[36], 0, "login refused: {:?}", &resp.bhs[36..38]);
        r.cmdsn = resp.u32_at(28);
        r.dec.header_digest = digest;
        r
    }

    pub fn command(&mut self, cdb: &[u8], read_len: u32) -> Pdu {
        let mut p = Pdu::new(op::SCSI_COMMAND);
        p.bhs[1] = 0x80 | if read_len > 0 { 0x40 } else { 0 } | 0x01;
        p.set_itt(self.itt);
        self.itt += 1;
        p.set_u32(20, read_len);
        p.set_u32(24, self.cmdsn);
        self.cmdsn += 1;
        p.bhs[32..32 + cdb.len()].copy_from_slice(cdb);
        p
    }
}

impl Raw {
    /// A command whose data-out goes as immediate data.
    pub fn command_out(&mut self, cdb: &[u8], data: &[u8]) -> Pdu {
        let mut p = self.command(cdb, 0);
        p.bhs[1] = 0x80 | 0x20 | 0x01;
        p.set_u32(20, data.len() as u32);
        p.data = Bytes::copy_from_slice(data);
        p
    }

    /// Send and wait for the status (and any data-in).
    pub fn run(&mut self, p: &Pdu) -> (u8, Vec<u8>) {
        self.send(p);
        let mut data = Vec::new();
        loop {
            let x = self.recv().expect("answer");
            match x.opcode() {
                op::DATA_IN => {
                    data.extend_from_slice(&x.data);
                    if x.bhs[1] & 0x01 != 0 {
                        return (x.bhs[3], data);
                    }
                }
                op::SCSI_RESPONSE => return (x.bhs[3], data),
                _ => {}
            }
        }
    }
}

pub fn write16(lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = read16(lba, blocks);
    c[0] = 0x8a;
    c
}

pub fn read16(lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = 0x88;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}
