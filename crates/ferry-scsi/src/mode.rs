//! Mode pages (read-write error recovery, caching, control, informational
//! exceptions): MODE SENSE builds them, MODE SELECT changes the few bits
//! ferry lets an initiator change.

use crate::sense::Sense;

/// The changeable mode state of a logical unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModeState {
    /// Control page D_SENSE: report sense in descriptor format.
    pub d_sense: bool,
    /// Control page SWP: software write protect.
    pub swp: bool,
    /// Caching page WCE: write cache enabled (writes need SYNC CACHE or
    /// FUA to be durable, which is true of ferry's page-cache backed files).
    pub wce: bool,
}

impl Default for ModeState {
    fn default() -> Self {
        ModeState {
            d_sense: false,
            swp: false,
            wce: true,
        }
    }
}

/// Which values MODE SENSE reports (page control field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageControl {
    Current,
    Changeable,
    Default,
}

const PAGES: [u8; 4] = [0x01, 0x08, 0x0a, 0x1c];

fn page_bytes(code: u8, st: &ModeState, pc: PageControl) -> Option<Vec<u8>> {
    let st = match pc {
        PageControl::Default => ModeState::default(),
        _ => *st,
    };
    let changeable = pc == PageControl::Changeable;
    Some(match code {
        0x01 => {
            let mut p = vec![0u8; 12];
            p[0] = 0x01;
            p[1] = 0x0a;
            if !changeable {
                p[2] = 0x80; // AWRE
            }
            p
        }
        0x08 => {
            let mut p = vec![0u8; 20];
            p[0] = 0x08;
            p[1] = 0x12;
            if changeable || st.wce {
                p[2] = 0x04;
            }
            p
        }
        0x0a => {
            let mut p = vec![0u8; 12];
            p[0] = 0x0a;
            p[1] = 0x0a;
            if changeable {
                p[2] = 0x04;
                p[4] = 0x08;
            } else {
                p[2] = if st.d_sense { 0x04 } else { 0 };
                p[3] = 0x10; // unrestricted reordering allowed
                p[4] = if st.swp { 0x08 } else { 0 };
                p[8..10].copy_from_slice(&0xffffu16.to_be_bytes()); // busy timeout: unlimited
            }
            p
        }
        0x1c => {
            let mut p = vec![0u8; 12];
            p[0] = 0x1c;
            p[1] = 0x0a;
            p
        }
        _ => return None,
    })
}

/// The mode pages asked for (`0x3f` = all), or the sense to answer with.
pub fn pages(code: u8, subpage: u8, st: &ModeState, pc: PageControl) -> Result<Vec<u8>, Sense> {
    let bad_sub = Sense::INVALID_FIELD_IN_CDB.field(true, 3, None);
    if code == 0x3f {
        if subpage != 0 && subpage != 0xff {
            return Err(bad_sub);
        }
        let mut out = Vec::new();
        for p in PAGES {
            out.extend(page_bytes(p, st, pc).unwrap_or_default());
        }
        return Ok(out);
    }
    if subpage != 0 {
        return Err(bad_sub);
    }
    page_bytes(code, st, pc).ok_or(Sense::INVALID_FIELD_IN_CDB.field(true, 2, Some(5)))
}

/// Apply the pages of a MODE SELECT parameter list (after its header and
/// block descriptors). Every byte must equal the current value except the
/// changeable bits; any other difference is refused.
pub fn select(mut list: &[u8], st: &mut ModeState) -> Result<(), Sense> {
    let bad = Sense::INVALID_FIELD_IN_PARAM_LIST;
    let mut next = *st;
    while !list.is_empty() {
        if list.len() < 2 {
            return Err(Sense::PARAM_LIST_LENGTH_ERROR);
        }
        let code = list[0] & 0x3f;
        if list[0] & 0x40 != 0 {
            return Err(bad); // no subpages are changeable
        }
        let len = usize::from(list[1]) + 2;
        if list.len() < len {
            return Err(Sense::PARAM_LIST_LENGTH_ERROR);
        }
        let given = &list[..len];
        let current = page_bytes(code, &next, PageControl::Current).ok_or(bad)?;
        let mask = page_bytes(code, &next, PageControl::Changeable).ok_or(bad)?;
        if current.len() != len {
            return Err(bad);
        }
        for i in 2..len {
            if (given[i] ^ current[i]) & !mask[i] != 0 {
                return Err(bad);
            }
        }
        match code {
            0x08 => next.wce = given[2] & 0x04 != 0,
            0x0a => {
                next.d_sense = given[2] & 0x04 != 0;
                next.swp = given[4] & 0x08 != 0;
            }
            _ => {}
        }
        list = &list[len..];
    }
    *st = next;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_changes_only_changeable_bits() {
        let mut st = ModeState::default();
        let mut ctl = page_bytes(0x0a, &st, PageControl::Current).unwrap();
        ctl[2] |= 0x04;
        select(&ctl, &mut st).unwrap();
        assert!(st.d_sense);
        ctl[3] = 0x00; // queue algorithm is not changeable
        assert_eq!(
            select(&ctl, &mut st),
            Err(Sense::INVALID_FIELD_IN_PARAM_LIST)
        );
        assert!(select(&[0x0a], &mut st).is_err());
        assert!(select(&[0x33, 0], &mut st).is_err());
    }

    #[test]
    fn all_pages_and_unknown_pages() {
        let st = ModeState::default();
        let all = pages(0x3f, 0, &st, PageControl::Current).unwrap();
        assert_eq!(all.len(), 12 + 20 + 12 + 12);
        assert!(pages(0x22, 0, &st, PageControl::Current).is_err());
        assert!(pages(0x0a, 1, &st, PageControl::Current).is_err());
    }
}
