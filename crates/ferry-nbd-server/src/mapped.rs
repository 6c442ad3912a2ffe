//! A file range mapped into memory for one reply, read under a guard that
//! turns a page lost under the mapping into an error instead of a crash.
//!
//! Over TLS a large cached READ is encrypted straight from the file's
//! pages in the page cache (mapped read-only, `MAP_POPULATE`) instead of
//! being copied into a buffer first: one copy of every byte fewer, about a
//! fifth of the server's CPU per byte read (docs/benchmarks.md).
//!
//! A mapped page whose file was cut short under it (a volume shrunk, an
//! external file truncated by someone else), or whose read from the disk
//! failed, raises `SIGBUS` at the instruction that touches it. While a
//! thread reads through [`MappedRange::read`], a handler installed once
//! per process puts a zero page over the faulting page, notes the fault
//! for that thread and lets the read go on; `read` then says the bytes it
//! gave were not the file's ([`PageLost`]), and the caller must not let
//! them reach anyone. A `SIGBUS` anywhere else goes to the disposition the
//! process had before (by default: the process dies, as without us).

use std::cell::Cell;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{compiler_fence, AtomicBool, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};
use thiserror::Error;

/// A mapped page could not be read: the file no longer reaches it, or the
/// disk failed to give it.
#[derive(Debug, Error)]
#[error(
    "a page of the file went away while it was read (the file was cut short, or the disk failed)"
)]
pub struct PageLost;

impl From<PageLost> for io::Error {
    fn from(e: PageLost) -> io::Error {
        io::Error::new(io::ErrorKind::UnexpectedEof, e)
    }
}

/// `len` bytes of a file at `offset`, mapped read-only until dropped.
pub struct MappedRange {
    base: *mut libc::c_void,
    map_len: usize,
    /// Where the range starts in the mapping (the offset's distance from
    /// the page boundary below it).
    skip: usize,
    len: usize,
    /// A read faulted: pages of the mapping may now be zeroes in place of
    /// the file's, so every later read fails too.
    lost: AtomicBool,
}

// SAFETY: the mapping is read-only and owned by this value alone; any
// thread may read it (through `read`) and unmap it (on drop).
unsafe impl Send for MappedRange {}
// SAFETY: as above; `read` takes `&self` and only reads.
unsafe impl Sync for MappedRange {}

impl MappedRange {
    /// Map `len` bytes of `file` at `offset`. Pages already cached are
    /// mapped at once; others are read on first touch. `len` must not be 0.
    pub fn map(file: &File, offset: u64, len: usize) -> io::Result<MappedRange> {
        if len == 0 {
            return Err(invalid());
        }
        install_handler();
        let page = page_size() as u64;
        let start = offset - offset % page;
        let skip = usize::try_from(offset - start).map_err(|_| invalid())?;
        let map_len = skip.checked_add(len).ok_or_else(invalid)?;
        let at = libc::off_t::try_from(start).map_err(|_| invalid())?;
        // SAFETY: a new read-only shared mapping of an open descriptor at
        // an address the kernel picks; it aliases nothing of ours.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                file.as_raw_fd(),
                at,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(MappedRange {
            base,
            map_len,
            skip,
            len,
            lost: AtomicBool::new(false),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Run `f` on the range's bytes from `from` on (on this thread, at
    /// once). `Err(PageLost)`: a page `f` touched was gone, and what `f`
    /// saw of it were zeroes, not the file's bytes.
    pub fn read<R>(&self, from: usize, f: impl FnOnce(&[u8]) -> R) -> Result<R, PageLost> {
        if self.lost.load(Ordering::Relaxed) {
            return Err(PageLost);
        }
        let from = from.min(self.len);
        let lo = self.base as usize;
        GUARD.with(|g| g.set((lo, lo + self.map_len)));
        FAULTED.with(|x| x.set(false));
        // The reads `f` makes must stay between the guard's set and clear.
        compiler_fence(Ordering::SeqCst);
        // SAFETY: the mapping is `map_len` bytes from `base`, readable for
        // as long as `self` lives; `skip + len == map_len`. A page cut off
        // under it reads as zeroes (the handler maps one), never faults out.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                self.base.cast::<u8>().cast_const().add(self.skip + from),
                self.len - from,
            )
        };
        let r = f(bytes);
        compiler_fence(Ordering::SeqCst);
        GUARD.with(|g| g.set((0, 0)));
        if FAULTED.with(Cell::get) {
            self.lost.store(true, Ordering::Relaxed);
            return Err(PageLost);
        }
        Ok(r)
    }
}

impl Drop for MappedRange {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map` (with any zero pages the
        // handler put inside it), unmapped once.
        unsafe { libc::munmap(self.base, self.map_len) };
    }
}

fn invalid() -> io::Error {
    io::Error::from(io::ErrorKind::InvalidInput)
}

thread_local! {
    /// The mapping this thread is reading under guard: `[lo, hi)`.
    static GUARD: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// A page of it faulted since the guard was set.
    static FAULTED: Cell<bool> = const { Cell::new(false) };
}

static PAGE: AtomicUsize = AtomicUsize::new(0);
static INSTALL: Once = Once::new();
/// The `SIGBUS` disposition before ours, for faults that are not ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

fn page_size() -> usize {
    match PAGE.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: sysconf has no preconditions.
            let p = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
            PAGE.store(p, Ordering::Relaxed);
            p
        }
        p => p,
    }
}

fn install_handler() {
    INSTALL.call_once(|| {
        page_size();
        // SAFETY: plain sigaction calls with zeroed, then filled, structs;
        // the handler only touches const-initialised thread-locals,
        // atomics and async-signal-safe system calls.
        unsafe {
            let mut new: libc::sigaction = std::mem::zeroed();
            new.sa_sigaction = on_sigbus as *const () as usize;
            new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
            libc::sigemptyset(&mut new.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &new, &mut old) == 0 {
                let _ = PREVIOUS.set(old);
            }
        }
    });
}

/// `SIGBUS`: inside the range this thread guards, a zero page over the
/// faulting one and a note of it; elsewhere, the previous disposition.
extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let (lo, hi) = GUARD.try_with(Cell::get).unwrap_or((0, 0));
    if addr >= lo && addr < hi {
        let page = PAGE.load(Ordering::Relaxed).max(1);
        let at = addr - addr % page;
        // SAFETY: replaces one page of our own guarded mapping (inside
        // `[lo, hi)`) with an anonymous zero page; mmap is a plain system
        // call, safe in a signal handler.
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                page,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p != libc::MAP_FAILED {
            let _ = FAULTED.try_with(|f| f.set(true));
            return;
        }
    }
    // Not ours (or the page could not be replaced): as before us.
    match PREVIOUS.get() {
        Some(old) if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN => {
            if old.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous handler was installed as an
                // SA_SIGINFO handler of this signature.
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig, info, ctx);
            } else {
                // SAFETY: the previous handler was installed as a plain one.
                let f: extern "C" fn(libc::c_int) =
                    unsafe { std::mem::transmute(old.sa_sigaction) };
                f(sig);
            }
        }
        _ => {
            // The default action: returning re-runs the faulting
            // instruction, which now ends the process as it would have.
            // SAFETY: sigaction and a zeroed struct (SIG_DFL).
            unsafe {
                let mut dfl: libc::sigaction = std::mem::zeroed();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn pattern_file(len: usize) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..len).map(|i| u8::try_from(i % 251).unwrap()).collect();
        f.write_all(&data).unwrap();
        f
    }

    #[test]
    fn a_range_reads_as_the_file_from_any_offset() {
        let f = pattern_file(3 * 4096 + 100);
        let file = File::open(f.path()).unwrap();
        let m = MappedRange::map(&file, 4093, 5000).unwrap();
        assert_eq!(m.len(), 5000);
        let got = m.read(0, <[u8]>::to_vec).unwrap();
        let want: Vec<u8> = (4093..9093)
            .map(|i| u8::try_from(i % 251).unwrap())
            .collect();
        assert_eq!(got, want);
        let tail = m.read(4990, <[u8]>::to_vec).unwrap();
        assert_eq!(tail, want[4990..]);
        assert!(MappedRange::map(&file, 0, 0).is_err());
    }

    #[test]
    fn a_file_cut_short_under_the_mapping_is_an_error_not_a_crash() {
        let f = pattern_file(64 << 10);
        let file = File::open(f.path()).unwrap();
        let m = MappedRange::map(&file, 0, 64 << 10).unwrap();
        // Someone else cuts the file to one page while the range is mapped.
        std::fs::OpenOptions::new()
            .write(true)
            .open(f.path())
            .unwrap()
            .set_len(4096)
            .unwrap();
        let r = m.read(0, |b| b.iter().map(|&x| u64::from(x)).sum::<u64>());
        assert!(r.is_err(), "bytes past the end were read as the file's");
        // Once a page was lost the range stays lost (its zero pages would
        // read without a fault).
        assert!(m.read(0, |b| b[..4096].to_vec()).is_err());
        let fresh = MappedRange::map(&file, 0, 4096).unwrap();
        let first = fresh.read(0, |b| b.to_vec()).unwrap();
        assert_eq!(first[4095], u8::try_from(4095 % 251).unwrap());
        // Another thread's mapping is guarded the same way.
        let m2 = MappedRange::map(&file, 0, 64 << 10).unwrap();
        let r2 = std::thread::spawn(move || m2.read(8192, |b| b[0]).is_err())
            .join()
            .unwrap();
        assert!(r2);
    }
}
