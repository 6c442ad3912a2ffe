//! Allocation map of a backing file: which ranges hold data and which are
//! holes, read with `lseek(SEEK_DATA/SEEK_HOLE)`.

use std::fs::File;
use std::os::fd::AsRawFd;

/// A run of the volume with one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub length: u64,
    /// A hole: unallocated, reads as zeroes.
    pub hole: bool,
}

fn seek(file: &File, offset: u64, whence: libc::c_int) -> Option<u64> {
    let off = libc::off_t::try_from(offset).ok()?;
    // SAFETY: lseek on a valid open descriptor owned by `file`; no memory is passed.
    let r = unsafe { libc::lseek(file.as_raw_fd(), off, whence) };
    u64::try_from(r).ok()
}

/// Extents covering `[offset, offset+len)`, at most `max_extents` of them
/// (the last one may end before `offset+len`). Where the file system cannot
/// tell, everything reads as data.
pub(crate) fn extents(file: &File, offset: u64, len: u64, max_extents: usize) -> Vec<Extent> {
    let end = offset.saturating_add(len);
    let mut out = Vec::new();
    let mut pos = offset;
    while pos < end && out.len() < max_extents {
        let data = match seek(file, pos, libc::SEEK_DATA) {
            Some(d) => d,
            // ENXIO: no data at or after pos (or lseek unsupported: treat as data below).
            None => {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                    end
                } else {
                    out.push(Extent {
                        offset: pos,
                        length: end - pos,
                        hole: false,
                    });
                    break;
                }
            }
        };
        if data > pos {
            let stop = data.min(end);
            out.push(Extent {
                offset: pos,
                length: stop - pos,
                hole: true,
            });
            pos = stop;
            continue;
        }
        let hole = seek(file, pos, libc::SEEK_HOLE).unwrap_or(end).min(end);
        let stop = if hole > pos { hole } else { end };
        out.push(Extent {
            offset: pos,
            length: stop - pos,
            hole: false,
        });
        pos = stop;
    }
    out
}
