//! What of a file the page cache holds now, asked with `cachestat(2)`
//! (Linux 6.5): a range wholly in memory can be sent from the file by the
//! kernel without a read that waits for the disk.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

/// `cachestat`'s number in the generic syscall table (x86_64, aarch64 and
/// the others alike); the `libc` crate does not name it on every target.
const SYS_CACHESTAT: libc::c_long = 451;

/// Page size the counts are in.
const PAGE: u64 = 4096;

/// Cleared once the kernel says it has no `cachestat`.
static SUPPORTED: AtomicBool = AtomicBool::new(true);

#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

#[repr(C)]
#[derive(Default)]
struct Cachestat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// Whether every page of `[offset, offset+len)` of `file` is in the page
/// cache now. False when the kernel cannot tell (no `cachestat`), and for
/// an empty range.
pub(crate) fn holds_all(file: &File, offset: u64, len: u64) -> bool {
    if len == 0 || !SUPPORTED.load(Ordering::Relaxed) {
        return false;
    }
    let first = offset / PAGE;
    let end = offset.saturating_add(len).div_ceil(PAGE);
    let range = CachestatRange {
        off: first * PAGE,
        len: (end - first) * PAGE,
    };
    let mut stat = Cachestat::default();
    // SAFETY: both structs are `repr(C)` as the kernel defines them and
    // live for the call; the descriptor is owned by `file`.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const CachestatRange,
            &mut stat as *mut Cachestat,
            0u32,
        )
    };
    if r != 0 {
        let e = std::io::Error::last_os_error().raw_os_error();
        if matches!(e, Some(libc::ENOSYS) | Some(libc::EPERM)) {
            SUPPORTED.store(false, Ordering::Relaxed);
        }
        return false;
    }
    stat.nr_cache >= end - first
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_file_just_written_is_held_and_a_range_past_its_end_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![7u8; 64 << 10]).unwrap();
        let f = File::open(&path).unwrap();
        if !holds_all(&f, 0, 4096) && !SUPPORTED.load(Ordering::Relaxed) {
            // A kernel without cachestat: nothing more to check here.
            return;
        }
        assert!(holds_all(&f, 0, 64 << 10));
        assert!(holds_all(&f, 100, 5000));
        // Pages past the end of the file are never cached.
        assert!(!holds_all(&f, 60 << 10, 8 << 10));
        assert!(!holds_all(&f, 0, 0));
    }

    #[test]
    fn pages_dropped_from_the_cache_are_not_held() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let f = File::create(&path).unwrap();
        // A sparse file nobody read: none of its pages is cached.
        f.set_len(1 << 20).unwrap();
        assert!(!holds_all(&f, 0, 1 << 20));
    }
}
