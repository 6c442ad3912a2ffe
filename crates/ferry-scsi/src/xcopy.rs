//! Third-party copy (SPC-4 EXTENDED COPY LID1 and RECEIVE COPY RESULTS):
//! block-to-block segments between this unit and any unit the host can
//! resolve by its NAA designator, done inside the target without the data
//! crossing the network.

use crate::cdb::{be16, be32, be64, byte};
use crate::sense::{Sense, ILLEGAL_REQUEST};
use crate::BlockDevice;
use std::sync::Arc;

/// Most CSCD (target) descriptors in one EXTENDED COPY.
pub const MAX_TARGET_DESCRIPTORS: u16 = 8;
/// Most segment descriptors in one EXTENDED COPY.
pub const MAX_SEGMENT_DESCRIPTORS: u16 = 8;
/// Longest target + segment descriptor list accepted, in bytes.
pub const MAX_DESCRIPTOR_LIST: u32 = 8 * 32 + 8 * 28;
/// Longest segment, in bytes (the segment's block count is 16 bits).
pub const MAX_SEGMENT_BYTES: u32 = 64 * 1024 * 1024;

const COPY_ABORTED: u8 = 0x0a;
pub const TOO_MANY_TARGETS: Sense = Sense::new(ILLEGAL_REQUEST, 0x26, 0x06);
pub const TOO_MANY_SEGMENTS: Sense = Sense::new(ILLEGAL_REQUEST, 0x26, 0x08);
pub const UNSUPPORTED_TARGET_TYPE: Sense = Sense::new(ILLEGAL_REQUEST, 0x26, 0x07);
pub const UNSUPPORTED_SEGMENT_TYPE: Sense = Sense::new(ILLEGAL_REQUEST, 0x26, 0x09);
pub const TARGET_NOT_REACHABLE: Sense = Sense::new(COPY_ABORTED, 0x0d, 0x02);
/// A segment past the end of a device: COPY ABORTED with no further code
/// (what initiators test for; the sense key says the copy stopped).
pub const COPY_LBA_OUT_OF_RANGE: Sense = Sense::new(COPY_ABORTED, 0x00, 0x00);
pub const COPY_READ_ERROR: Sense = Sense::new(COPY_ABORTED, 0x0d, 0x03);
pub const COPY_WRITE_ERROR: Sense = Sense::new(COPY_ABORTED, 0x0d, 0x04);

/// Finds other logical units by NAA designator (the pool's volumes).
pub trait CopyTargets: Send + Sync {
    fn device_by_naa(&self, naa: &[u8]) -> Option<Arc<dyn BlockDevice>>;
}

/// One parsed block-to-block segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub source: usize,
    pub destination: usize,
    pub blocks: u64,
    pub source_lba: u64,
    pub destination_lba: u64,
}

/// One parsed identification CSCD descriptor: its designator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub designator_type: u8,
    pub designator: Vec<u8>,
}

/// A parsed EXTENDED COPY parameter list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyList {
    pub list_id: u8,
    /// LIST ID USAGE 00b/01b: keep the status for RECEIVE COPY RESULTS.
    pub hold_status: bool,
    pub targets: Vec<Target>,
    pub segments: Vec<Segment>,
}

/// Parse and check an EXTENDED COPY (LID1) parameter list.
pub fn parse(p: &[u8]) -> Result<Option<CopyList>, Sense> {
    if p.is_empty() {
        return Ok(None);
    }
    if p.len() < 16 {
        return Err(Sense::PARAM_LIST_LENGTH_ERROR);
    }
    let tgt_len = usize::from(be16(p, 2));
    let seg_len = be32(p, 8) as usize;
    let inline = be32(p, 12);
    if tgt_len as u64 + seg_len as u64 > u64::from(MAX_DESCRIPTOR_LIST) {
        return Err(Sense::PARAM_LIST_LENGTH_ERROR);
    }
    if 16 + tgt_len + seg_len > p.len() {
        return Err(Sense::PARAM_LIST_LENGTH_ERROR);
    }
    if inline != 0 {
        return Err(Sense::INVALID_FIELD_IN_PARAM_LIST.field(false, 12, None));
    }
    if !tgt_len.is_multiple_of(32) {
        return Err(Sense::PARAM_LIST_LENGTH_ERROR);
    }
    if tgt_len / 32 > usize::from(MAX_TARGET_DESCRIPTORS) {
        return Err(TOO_MANY_TARGETS);
    }
    let mut targets = Vec::new();
    for (i, d) in p[16..16 + tgt_len].chunks(32).enumerate() {
        let at = (16 + i * 32) as u16;
        if d[0] != 0xe4 {
            return Err(UNSUPPORTED_TARGET_TYPE.field(false, at, None));
        }
        if d[1] & 0x1f != 0 {
            // Only direct-access devices. The LU ID TYPE field is not
            // checked: the designator alone names the unit (libiscsi 1.19
            // expects a reserved LU ID TYPE to be accepted, later releases
            // expect it refused).
            return Err(Sense::INVALID_FIELD_IN_PARAM_LIST.field(false, at + 1, None));
        }
        if d[1] & 0x20 != 0 {
            // NUL: a device that is not there.
            return Err(TARGET_NOT_REACHABLE);
        }
        let len = usize::from(d[7]).min(20);
        targets.push(Target {
            designator_type: d[5] & 0x0f,
            designator: d[8..8 + len].to_vec(),
        });
    }
    let mut segments = Vec::new();
    let mut rest = &p[16 + tgt_len..16 + tgt_len + seg_len];
    while !rest.is_empty() {
        if rest.len() < 4 {
            return Err(Sense::PARAM_LIST_LENGTH_ERROR);
        }
        let len = usize::from(be16(rest, 2)) + 4;
        if rest[0] != 0x02 {
            return Err(UNSUPPORTED_SEGMENT_TYPE);
        }
        if len != 28 || rest.len() < len {
            return Err(Sense::PARAM_LIST_LENGTH_ERROR);
        }
        if segments.len() == usize::from(MAX_SEGMENT_DESCRIPTORS) {
            return Err(TOO_MANY_SEGMENTS);
        }
        segments.push(Segment {
            source: usize::from(be16(rest, 4)),
            destination: usize::from(be16(rest, 6)),
            blocks: u64::from(be16(rest, 10)),
            source_lba: be64(rest, 12),
            destination_lba: be64(rest, 20),
        });
        rest = &rest[len..];
    }
    Ok(Some(CopyList {
        list_id: byte(p, 0),
        hold_status: (byte(p, 1) >> 3) & 0x03 < 2,
        targets,
        segments,
    }))
}

/// The OPERATING PARAMETERS of RECEIVE COPY RESULTS.
pub fn operating_parameters() -> Vec<u8> {
    let mut d = vec![0u8; 46];
    let avail = (d.len() - 4) as u32;
    d[0..4].copy_from_slice(&avail.to_be_bytes());
    d[8..10].copy_from_slice(&MAX_TARGET_DESCRIPTORS.to_be_bytes());
    d[10..12].copy_from_slice(&MAX_SEGMENT_DESCRIPTORS.to_be_bytes());
    d[12..16].copy_from_slice(&MAX_DESCRIPTOR_LIST.to_be_bytes());
    d[16..20].copy_from_slice(&MAX_SEGMENT_BYTES.to_be_bytes());
    // No inline or held data; one copy at a time per command.
    d[34..36].copy_from_slice(&1u16.to_be_bytes());
    d[36] = 1;
    d[37] = 9; // data segment granularity: 512 bytes
    d[43] = 2; // implemented descriptor type codes follow
    d[44] = 0x02; // block to block
    d[45] = 0xe4; // identification CSCD descriptor
    d
}

/// VPD page 0x8F: the Supported Commands third-party copy descriptor.
pub fn vpd_page() -> Vec<u8> {
    let cmds: [(u8, &[u8]); 2] = [(0x83, &[0x00]), (0x84, &[0x00, 0x03])];
    let mut list = Vec::new();
    for (op, sas) in cmds {
        list.push(op);
        list.push(sas.len() as u8);
        list.extend_from_slice(sas);
    }
    let mut desc = vec![0u8; 4];
    desc.push(list.len() as u8);
    desc.extend_from_slice(&list);
    while !desc.len().is_multiple_of(4) {
        desc.push(0);
    }
    let dl = (desc.len() - 4) as u16;
    desc[0..2].copy_from_slice(&1u16.to_be_bytes());
    desc[2..4].copy_from_slice(&dl.to_be_bytes());
    let mut page = vec![0x00, 0x8f];
    page.extend_from_slice(&(desc.len() as u16).to_be_bytes());
    page.extend_from_slice(&desc);
    page
}

/// Status kept for RECEIVE COPY RESULTS / COPY STATUS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyStatus {
    pub segments: u16,
    pub bytes: u64,
    pub failed: bool,
}

pub fn copy_status(s: &CopyStatus) -> Vec<u8> {
    let mut d = vec![0u8; 12];
    d[0..4].copy_from_slice(&8u32.to_be_bytes());
    d[4] = if s.failed { 0x01 } else { 0x00 };
    d[5..7].copy_from_slice(&s.segments.to_be_bytes());
    d[7] = 0x01; // transfer count in KiB
    d[8..12].copy_from_slice(&((s.bytes / 1024).min(u64::from(u32::MAX)) as u32).to_be_bytes());
    d
}

/// Copy `bytes` from `src` at `from` to `dst` at `to`, 1 MiB at a time.
pub fn copy_range(
    src: &dyn BlockDevice,
    dst: &dyn BlockDevice,
    from: u64,
    to: u64,
    bytes: u64,
) -> Result<(), Sense> {
    let mut buf = vec![0u8; (1usize << 20).min(bytes as usize)];
    let mut done = 0u64;
    while done < bytes {
        let n = (bytes - done).min(buf.len() as u64) as usize;
        src.read_at(from + done, &mut buf[..n])
            .map_err(|_| COPY_READ_ERROR)?;
        dst.write_at(to + done, &buf[..n], false)
            .map_err(|_| COPY_WRITE_ERROR)?;
        done += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(targets: usize, seg_type: u8) -> Vec<u8> {
        let mut p = vec![0u8; 16];
        p[0] = 1;
        p[2..4].copy_from_slice(&((targets * 32) as u16).to_be_bytes());
        p[8..12].copy_from_slice(&28u32.to_be_bytes());
        for _ in 0..targets {
            let mut t = vec![0u8; 32];
            t[0] = 0xe4;
            t[4] = 1;
            t[5] = 3;
            t[7] = 8;
            p.extend_from_slice(&t);
        }
        let mut s = vec![0u8; 28];
        s[0] = seg_type;
        s[3] = 24;
        s[11] = 8;
        p.extend_from_slice(&s);
        p
    }

    #[test]
    fn parse_limits_and_types() {
        let l = parse(&list(1, 2)).unwrap().unwrap();
        assert_eq!(l.segments[0].blocks, 8);
        assert_eq!(parse(&list(9, 2)), Err(TOO_MANY_TARGETS));
        assert_eq!(parse(&list(1, 9)), Err(UNSUPPORTED_SEGMENT_TYPE));
        let mut l = list(1, 2);
        l[16] = 0xe0;
        assert!(matches!(parse(&l), Err(s) if s.asc == 0x26 && s.ascq == 0x07));
        let l = list(1, 2);
        assert_eq!(
            parse(&l[..l.len() - 1]),
            Err(Sense::PARAM_LIST_LENGTH_ERROR)
        );
        assert_eq!(parse(&[]), Ok(None));
    }
}
