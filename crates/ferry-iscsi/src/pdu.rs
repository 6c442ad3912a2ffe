//! PDU framing: the 48-byte basic header segment, additional header
//! segments, the padded data segment and the optional CRC32C header and
//! data digests.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use thiserror::Error;

pub const BHS_LEN: usize = 48;
/// The reserved "no task" tag.
pub const NO_TAG: u32 = 0xffff_ffff;

/// Initiator opcodes.
pub mod op {
    pub const NOP_OUT: u8 = 0x00;
    pub const SCSI_COMMAND: u8 = 0x01;
    pub const TASK_MGMT: u8 = 0x02;
    pub const LOGIN: u8 = 0x03;
    pub const TEXT: u8 = 0x04;
    pub const DATA_OUT: u8 = 0x05;
    pub const LOGOUT: u8 = 0x06;
    pub const SNACK: u8 = 0x10;
    // Target opcodes.
    pub const NOP_IN: u8 = 0x20;
    pub const SCSI_RESPONSE: u8 = 0x21;
    pub const TASK_MGMT_RESPONSE: u8 = 0x22;
    pub const LOGIN_RESPONSE: u8 = 0x23;
    pub const TEXT_RESPONSE: u8 = 0x24;
    pub const DATA_IN: u8 = 0x25;
    pub const LOGOUT_RESPONSE: u8 = 0x26;
    pub const R2T: u8 = 0x31;
    pub const ASYNC: u8 = 0x32;
    pub const REJECT: u8 = 0x3f;
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PduError {
    #[error("header digest mismatch")]
    HeaderDigest,
    #[error("data digest mismatch (task {itt:#x})")]
    DataDigest { itt: u32, bhs: Box<[u8; BHS_LEN]> },
    #[error("data segment of {len} bytes exceeds the negotiated {max}")]
    TooLong { len: u32, max: u32 },
}

/// One PDU. The data segment is unpadded; lengths in the header are filled
/// in by [`Pdu::encode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pdu {
    pub bhs: [u8; BHS_LEN],
    pub ahs: Bytes,
    pub data: Bytes,
}

impl Pdu {
    pub fn new(opcode: u8) -> Pdu {
        let mut bhs = [0u8; BHS_LEN];
        bhs[0] = opcode & 0x3f;
        Pdu {
            bhs,
            ahs: Bytes::new(),
            data: Bytes::new(),
        }
    }
    pub fn opcode(&self) -> u8 {
        self.bhs[0] & 0x3f
    }
    pub fn immediate(&self) -> bool {
        self.bhs[0] & 0x40 != 0
    }
    pub fn flags(&self) -> u8 {
        self.bhs[1]
    }
    pub fn final_bit(&self) -> bool {
        self.bhs[1] & 0x80 != 0
    }
    pub fn u32_at(&self, at: usize) -> u32 {
        u32::from_be_bytes([
            self.bhs[at],
            self.bhs[at + 1],
            self.bhs[at + 2],
            self.bhs[at + 3],
        ])
    }
    pub fn set_u32(&mut self, at: usize, v: u32) {
        self.bhs[at..at + 4].copy_from_slice(&v.to_be_bytes());
    }
    pub fn lun(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.bhs[8..16]);
        u64::from_be_bytes(b)
    }
    pub fn set_lun(&mut self, lun: u64) {
        self.bhs[8..16].copy_from_slice(&lun.to_be_bytes());
    }
    pub fn itt(&self) -> u32 {
        self.u32_at(16)
    }
    pub fn set_itt(&mut self, itt: u32) {
        self.set_u32(16, itt);
    }
    /// Data segment length as written in the header.
    pub fn header_data_len(&self) -> u32 {
        u32::from_be_bytes([0, self.bhs[5], self.bhs[6], self.bhs[7]])
    }

    /// Append the header (BHS, AHS, header digest) to `out`; the data
    /// segment, its padding and digest follow separately.
    pub fn encode_header(&self, header_digest: bool, out: &mut BytesMut) {
        let mut bhs = self.bhs;
        // Our own PDUs: no AHS over 1 KiB, data segments within the
        // negotiated MaxRecvDataSegmentLength (< 2^24).
        debug_assert!(self.ahs.len() / 4 <= 255 && self.data.len() < 1 << 24);
        bhs[4] = u8::try_from(self.ahs.len() / 4).unwrap_or(u8::MAX);
        let dl = u32::try_from(self.data.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes();
        bhs[5..8].copy_from_slice(&dl[1..]);
        let start = out.len();
        out.put_slice(&bhs);
        out.put_slice(&self.ahs);
        if header_digest {
            let crc = crc32c::crc32c(&out[start..]);
            out.put_u32_le(crc);
        }
    }

    /// Append the wire form to `out`.
    pub fn encode(&self, header_digest: bool, data_digest: bool, out: &mut BytesMut) {
        self.encode_header(header_digest, out);
        if !self.data.is_empty() {
            out.put_slice(&self.data);
            let pad = (4 - self.data.len() % 4) % 4;
            out.put_bytes(0, pad);
            if data_digest {
                let mut crc = crc32c::crc32c(&self.data);
                crc = crc32c::crc32c_append(crc, &[0u8; 3][..pad]);
                out.put_u32_le(crc);
            }
        }
    }

    pub fn to_bytes(&self, header_digest: bool, data_digest: bool) -> Bytes {
        let mut b = BytesMut::with_capacity(BHS_LEN + 8 + self.data.len());
        self.encode(header_digest, data_digest, &mut b);
        b.freeze()
    }
}

/// Splits a byte stream into PDUs.
#[derive(Debug, Clone)]
pub struct PduDecoder {
    pub header_digest: bool,
    pub data_digest: bool,
    /// Largest data segment accepted (our MaxRecvDataSegmentLength).
    pub max_data: u32,
}

impl PduDecoder {
    pub fn new(max_data: u32) -> PduDecoder {
        PduDecoder {
            header_digest: false,
            data_digest: false,
            max_data,
        }
    }

    /// Bytes the next PDU needs in total, once its header is buffered.
    pub fn wanted(&self, buf: &[u8]) -> usize {
        if buf.len() < BHS_LEN {
            return BHS_LEN;
        }
        let ahs = usize::from(buf[4]) * 4;
        let dl = u32::from_be_bytes([0, buf[5], buf[6], buf[7]]) as usize;
        let mut n = BHS_LEN + ahs + dl.div_ceil(4) * 4;
        if self.header_digest {
            n += 4;
        }
        if self.data_digest && dl > 0 {
            n += 4;
        }
        n
    }

    /// Take one whole PDU off the front of `buf`, if it is all there.
    pub fn decode(&self, buf: &mut BytesMut) -> Result<Option<Pdu>, PduError> {
        if buf.len() < BHS_LEN {
            return Ok(None);
        }
        let dl = u32::from_be_bytes([0, buf[5], buf[6], buf[7]]);
        if dl > self.max_data {
            return Err(PduError::TooLong {
                len: dl,
                max: self.max_data,
            });
        }
        let total = self.wanted(buf);
        if buf.len() < total {
            return Ok(None);
        }
        let ahs_len = usize::from(buf[4]) * 4;
        let hdr_end = BHS_LEN + ahs_len;
        if self.header_digest {
            let got = u32::from_le_bytes([
                buf[hdr_end],
                buf[hdr_end + 1],
                buf[hdr_end + 2],
                buf[hdr_end + 3],
            ]);
            if crc32c::crc32c(&buf[..hdr_end]) != got {
                return Err(PduError::HeaderDigest);
            }
        }
        let mut frame = buf.split_to(total).freeze();
        let mut bhs = [0u8; BHS_LEN];
        bhs.copy_from_slice(&frame[..BHS_LEN]);
        frame.advance(BHS_LEN);
        let ahs = frame.split_to(ahs_len);
        if self.header_digest {
            frame.advance(4);
        }
        let dl = dl as usize;
        let padded = dl.div_ceil(4) * 4;
        let data = frame.slice(..dl);
        if self.data_digest && dl > 0 {
            let got = u32::from_le_bytes([
                frame[padded],
                frame[padded + 1],
                frame[padded + 2],
                frame[padded + 3],
            ]);
            if crc32c::crc32c(&frame[..padded]) != got {
                return Err(PduError::DataDigest {
                    itt: u32::from_be_bytes([bhs[16], bhs[17], bhs[18], bhs[19]]),
                    bhs: Box::new(bhs),
                });
            }
        }
        Ok(Some(Pdu { bhs, ahs, data }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_with_digests_and_padding() {
        for (hd, dd) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut p = Pdu::new(op::SCSI_COMMAND);
            p.set_itt(7);
            p.data = Bytes::from_static(b"hello");
            let wire = p.to_bytes(hd, dd);
            let dec = PduDecoder {
                header_digest: hd,
                data_digest: dd,
                max_data: 8192,
            };
            let mut buf = BytesMut::from(&wire[..wire.len() - 1]);
            assert_eq!(dec.decode(&mut buf).unwrap(), None);
            buf.extend_from_slice(&wire[wire.len() - 1..]);
            let got = dec.decode(&mut buf).unwrap().unwrap();
            assert_eq!(got.data, p.data);
            assert_eq!(got.itt(), 7);
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn digest_errors_and_oversize() {
        let mut p = Pdu::new(op::NOP_OUT);
        p.data = Bytes::from_static(b"ping");
        let dec = PduDecoder {
            header_digest: true,
            data_digest: true,
            max_data: 8192,
        };
        let mut wire = BytesMut::from(&p.to_bytes(true, true)[..]);
        wire[20] ^= 1;
        assert_eq!(dec.decode(&mut wire.clone()), Err(PduError::HeaderDigest));
        wire[20] ^= 1;
        let n = wire.len();
        wire[n - 6] ^= 1;
        assert!(matches!(
            dec.decode(&mut wire),
            Err(PduError::DataDigest { .. })
        ));
        let mut big = BytesMut::from(&[0u8; 48][..]);
        big[5] = 0x10;
        assert!(matches!(
            dec.decode(&mut big),
            Err(PduError::TooLong { .. })
        ));
    }

    /// RFC 3720 B.4: CRC32C of 32 bytes of zeros is 0x8a9136aa, sent
    /// least significant byte first (aa 36 91 8a).
    #[test]
    fn crc32c_matches_the_rfc_example() {
        assert_eq!(crc32c::crc32c(&[0u8; 32]), 0x8a91_36aa);
    }
}
