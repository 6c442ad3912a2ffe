//! INQUIRY: standard data and the vital product data pages ferry reports.

use crate::lu::LuConfig;
use crate::Identity;

pub const VENDOR: &[u8; 8] = b"FERRY   ";
const PRODUCT: &[u8; 16] = b"ferry volume    ";
const REVISION: &[u8; 4] = b"0001";

/// VPD pages in ascending order (page 0x00 lists them).
pub const VPD_PAGES: [u8; 8] = [0x00, 0x80, 0x83, 0x86, 0x8f, 0xb0, 0xb1, 0xb2];

/// Most blocks one READ/WRITE may move (reported in VPD 0xB0).
pub const MAX_TRANSFER_BLOCKS: u32 = 65536;
/// Most blocks one COMPARE AND WRITE may cover.
pub const MAX_COMPARE_WRITE_BLOCKS: u8 = 255;
/// Most descriptors and blocks in one UNMAP / WRITE SAME.
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;
pub const MAX_UNMAP_BLOCKS: u32 = 0x0010_0000;
pub const MAX_WRITE_SAME_BLOCKS: u64 = 0x0040_0000;
/// Most blocks one WRITE ATOMIC(16) may write.
pub const MAX_ATOMIC_BLOCKS: u32 = 2048;

/// Standard INQUIRY data for a LUN the target does not have (peripheral
/// qualifier 3: "not capable of supporting a device here"), as SPC-4
/// requires instead of an error; `None` when the CDB asks for a VPD page
/// (EVPD set), which such a LUN answers with LUN NOT SUPPORTED.
pub fn absent_lun(cdb: &[u8]) -> Option<Vec<u8>> {
    if cdb.len() < 6 || cdb[1] & 1 != 0 {
        return None;
    }
    let mut d = vec![0u8; 36];
    d[0] = 0x7f; // qualifier 3, device type 0x1f (unknown)
    d[2] = 0x06; // SPC-4
    d[3] = 0x12; // HISUP, response data format 2
    d[4] = 31; // additional length
    d.truncate(usize::from(u16::from_be_bytes([cdb[3], cdb[4]])));
    Some(d)
}

pub fn standard(id: &Identity) -> Vec<u8> {
    let mut d = vec![0u8; 74];
    d[0] = 0x00; // peripheral qualifier 0, direct access block device
    d[1] = 0x00; // not removable
    d[2] = 0x06; // SPC-4
    d[3] = 0x12; // HISUP, response data format 2
    d[4] = (d.len() - 5) as u8;
    d[5] = 0x10 | 0x08; // TPGS = implicit ALUA; 3PC: EXTENDED COPY
    d[7] = 0x02; // CMDQUE
    d[8..16].copy_from_slice(VENDOR);
    let mut product = *PRODUCT;
    let name = id.name.as_bytes();
    let n = name.len().min(16);
    product[..n].copy_from_slice(&name[..n]);
    for b in product[n..].iter_mut() {
        *b = b' ';
    }
    d[16..32].copy_from_slice(&product);
    d[32..36].copy_from_slice(REVISION);
    // Version descriptors: SAM-5, iSCSI, SPC-4, SBC-3.
    for (i, v) in [0x00a0u16, 0x0960, 0x0460, 0x04c0].iter().enumerate() {
        d[58 + i * 2..60 + i * 2].copy_from_slice(&v.to_be_bytes());
    }
    d
}

fn page(code: u8, body: Vec<u8>) -> Vec<u8> {
    let mut d = vec![0x00, code];
    d.extend_from_slice(&(body.len() as u16).to_be_bytes());
    d.extend_from_slice(&body);
    d
}

fn designator(out: &mut Vec<u8>, code_set: u8, piv_assoc_type: u8, value: &[u8]) {
    out.push(0x50 | code_set); // protocol identifier 5 (iSCSI)
    out.push(piv_assoc_type);
    out.push(0);
    out.push(value.len() as u8);
    out.extend_from_slice(value);
}

/// The bytes of VPD page `code`, or None when ferry has no such page.
pub fn vpd(
    code: u8,
    id: &Identity,
    cfg: &LuConfig,
    blocks: u64,
    sanitize: crate::SanitizeSupport,
) -> Option<Vec<u8>> {
    Some(match code {
        0x00 => page(0x00, VPD_PAGES.to_vec()),
        0x80 => page(0x80, id.serial.as_bytes().to_vec()),
        0x83 => {
            let mut b = Vec::new();
            // NAA (binary, LU association): the volume's WWN.
            designator(&mut b, 0x01, 0x03, &id.naa);
            // T10 vendor id (ASCII, LU association).
            let mut t10 = VENDOR.to_vec();
            t10.extend_from_slice(id.serial.as_bytes());
            designator(&mut b, 0x02, 0x01, &t10);
            // Relative target port (binary, target port association, PIV).
            let mut rp = vec![0, 0];
            rp.extend_from_slice(&id.relative_port.to_be_bytes());
            designator(&mut b, 0x01, 0x80 | 0x10 | 0x04, &rp);
            // Target port group (binary, target port association, PIV).
            let mut tpg = vec![0, 0];
            tpg.extend_from_slice(&id.port_group.to_be_bytes());
            designator(&mut b, 0x01, 0x80 | 0x10 | 0x05, &tpg);
            // SCSI name string of the target device (UTF-8, PIV).
            let mut name = id.target_name.as_bytes().to_vec();
            name.push(0);
            while !name.len().is_multiple_of(4) {
                name.push(0);
            }
            designator(&mut b, 0x03, 0x80 | 0x20 | 0x08, &name);
            page(0x83, b)
        }
        0x8f => crate::xcopy::vpd_page(),
        0x86 => {
            // Extended INQUIRY data: HEADSUP/ORDSUP/SIMPSUP, V_SUP off.
            let mut b = vec![0u8; 60];
            b[1] = 0x07;
            page(0x86, b)
        }
        0xb0 => {
            let mut b = vec![0u8; 0x3c];
            b[0] = 0x00; // WSNZ 0: WRITE SAME of zero blocks runs to the end
            b[1] = MAX_COMPARE_WRITE_BLOCKS;
            let phys = (cfg.physical_block / cfg.block_size.max(1)) as u16;
            b[2..4].copy_from_slice(&phys.max(1).to_be_bytes());
            b[4..8].copy_from_slice(&MAX_TRANSFER_BLOCKS.to_be_bytes());
            b[8..12].copy_from_slice(&(MAX_TRANSFER_BLOCKS / 32).max(1).to_be_bytes());
            b[12..16].copy_from_slice(&MAX_TRANSFER_BLOCKS.to_be_bytes());
            if cfg.thin {
                b[16..20].copy_from_slice(&MAX_UNMAP_BLOCKS.to_be_bytes());
                b[20..24].copy_from_slice(&MAX_UNMAP_DESCRIPTORS.to_be_bytes());
                let granule = cfg.physical_block.max(4096) / cfg.block_size.max(1);
                b[24..28].copy_from_slice(&granule.max(1).to_be_bytes());
                b[28..32].copy_from_slice(&0x8000_0000u32.to_be_bytes()); // UGAVALID, alignment 0
            }
            b[32..40].copy_from_slice(&MAX_WRITE_SAME_BLOCKS.to_be_bytes());
            // WRITE ATOMIC(16): length limit, alignment 1, granularity 1,
            // no atomic boundaries.
            b[40..44].copy_from_slice(&MAX_ATOMIC_BLOCKS.to_be_bytes());
            b[44..48].copy_from_slice(&1u32.to_be_bytes());
            b[48..52].copy_from_slice(&1u32.to_be_bytes());
            page(0xb0, b)
        }
        0xb1 => {
            let mut b = vec![0u8; 0x3c];
            b[0..2].copy_from_slice(&1u16.to_be_bytes()); // non-rotating medium
            if sanitize.block_erase {
                // WABEREQ 01b: a block read after BLOCK ERASE succeeds
                // (it reads as zeroes). WACEREQ 00b: no crypto erase.
                b[3] = 0x40;
            }
            page(0xb1, b)
        }
        0xb2 => {
            let mut b = vec![0u8; 4];
            b[0] = 0; // threshold exponent
            if cfg.thin {
                // LBPU, LBPWS, LBPWS10, LBPRZ; provisioning type thin.
                b[1] = 0x80 | 0x40 | 0x20 | 0x04;
                b[2] = 0x02;
            }
            let _ = blocks;
            page(0xb2, b)
        }
        _ => return None,
    })
}

#[cfg(test)]
mod absent_lun_tests {
    use super::*;

    #[test]
    fn absent_lun_inquiry_has_qualifier_3_and_honours_the_allocation_length() {
        let d = absent_lun(&[0x12, 0, 0, 0, 96, 0]).unwrap();
        assert_eq!((d.len(), d[0], d[4]), (36, 0x7f, 31));
        assert_eq!(absent_lun(&[0x12, 0, 0, 0, 5, 0]).unwrap().len(), 5);
        assert!(absent_lun(&[0x12, 1, 0x80, 0, 96, 0]).is_none(), "EVPD");
        assert!(absent_lun(&[0x12, 0]).is_none(), "short CDB");
    }
}
