//! The part of librados' and librbd's C API ferry calls, opened once at run
//! time (`librados.so.2`, `librbd.so.1`), so that ferry builds and runs
//! where Ceph is not installed and says so only when an RBD volume is used.

use libloading::Library;
use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

pub(crate) type RadosT = *mut c_void;
pub(crate) type IoctxT = *mut c_void;
pub(crate) type ImageT = *mut c_void;
pub(crate) type CompletionT = *mut c_void;
/// `LIBRADOS_LOCK_FLAG_RENEW`: take the lock, or renew it if this cookie
/// holds it.
pub(crate) const LOCK_FLAG_RENEW: u8 = 1;
/// `rbd_callback_t`: called once by librbd, on one of its threads, when
/// an asynchronous request ends.
pub(crate) type AioCallback = unsafe extern "C" fn(CompletionT, *mut c_void);
pub(crate) type DiffCallback = unsafe extern "C" fn(u64, usize, c_int, *mut c_void) -> c_int;
pub(crate) type ProgressCallback = Option<unsafe extern "C" fn(u64, u64, *mut c_void) -> c_int>;

/// `struct rados_cluster_stat_t`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ClusterStat {
    pub kb: u64,
    pub kb_used: u64,
    pub kb_avail: u64,
    pub num_objects: u64,
}

/// `rbd_lock_mode_t`.
pub(crate) const RBD_LOCK_MODE_EXCLUSIVE: c_int = 0;

/// RBD features of a new image: the defaults of `rbd create` (layering,
/// exclusive-lock, object-map, fast-diff, deep-flatten). The object map
/// makes the allocation map of an image one read instead of one per object.
pub(crate) const FEATURES: u64 = 1 | (1 << 2) | (1 << 3) | (1 << 4) | (1 << 5);

macro_rules! api {
    ($($lib:literal $name:ident: fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// Function pointers into the two libraries, valid while `libs` lives
        /// (it lives in a static: for the process).
        pub(crate) struct Api {
            _libs: [Library; 2],
            $(pub(crate) $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        impl Api {
            /// # Safety
            ///
            /// `libs` must be librados and librbd of one Ceph release, whose
            /// symbols have the C signatures declared here.
            unsafe fn load(libs: [Library; 2]) -> Result<Api, libloading::Error> {
                Ok(Api {
                    $($name: {
                        // SAFETY: the caller vouches for the libraries; the
                        // signature is the one librbd.h / librados.h declare.
                        let sym = unsafe {
                            libs[$lib].get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )?
                        };
                        *sym
                    },)*
                    _libs: libs,
                })
            }
        }
    };
}

api! {
    0 rados_create2: fn(*mut RadosT, *const c_char, *const c_char, u64) -> c_int;
    0 rados_conf_read_file: fn(RadosT, *const c_char) -> c_int;
    0 rados_conf_set: fn(RadosT, *const c_char, *const c_char) -> c_int;
    0 rados_connect: fn(RadosT) -> c_int;
    0 rados_shutdown: fn(RadosT) -> ();
    0 rados_ioctx_create: fn(RadosT, *const c_char, *mut IoctxT) -> c_int;
    0 rados_ioctx_destroy: fn(IoctxT) -> ();
    0 rados_getaddrs: fn(RadosT, *mut *mut c_char) -> c_int;
    0 rados_cluster_stat: fn(RadosT, *mut ClusterStat) -> c_int;
    0 rados_lock_exclusive: fn(IoctxT, *const c_char, *const c_char, *const c_char, *const c_char, *mut libc::timeval, u8) -> c_int;
    0 rados_unlock: fn(IoctxT, *const c_char, *const c_char, *const c_char) -> c_int;
    0 rados_list_lockers: fn(IoctxT, *const c_char, *const c_char, *mut c_int, *mut c_char, *mut usize, *mut c_char, *mut usize, *mut c_char, *mut usize, *mut c_char, *mut usize) -> isize;
    0 rados_break_lock: fn(IoctxT, *const c_char, *const c_char, *const c_char, *const c_char) -> c_int;
    0 rados_blocklist_add: fn(RadosT, *mut c_char, u32) -> c_int;
    1 rbd_create2: fn(IoctxT, *const c_char, u64, u64, *mut c_int) -> c_int;
    1 rbd_remove: fn(IoctxT, *const c_char) -> c_int;
    1 rbd_rename: fn(IoctxT, *const c_char, *const c_char) -> c_int;
    1 rbd_list: fn(IoctxT, *mut c_char, *mut usize) -> c_int;
    1 rbd_open: fn(IoctxT, *const c_char, *mut ImageT, *const c_char) -> c_int;
    1 rbd_open_read_only: fn(IoctxT, *const c_char, *mut ImageT, *const c_char) -> c_int;
    1 rbd_close: fn(ImageT) -> c_int;
    1 rbd_get_size: fn(ImageT, *mut u64) -> c_int;
    1 rbd_read2: fn(ImageT, u64, usize, *mut c_char, c_int) -> isize;
    1 rbd_write2: fn(ImageT, u64, usize, *const c_char, c_int) -> isize;
    1 rbd_aio_create_completion: fn(*mut c_void, AioCallback, *mut CompletionT) -> c_int;
    1 rbd_aio_write2: fn(ImageT, u64, usize, *const c_char, CompletionT, c_int) -> c_int;
    1 rbd_aio_get_return_value: fn(CompletionT) -> isize;
    1 rbd_aio_release: fn(CompletionT) -> ();
    1 rbd_discard: fn(ImageT, u64, u64) -> c_int;
    1 rbd_write_zeroes: fn(ImageT, u64, usize, c_int, c_int) -> isize;
    1 rbd_flush: fn(ImageT) -> c_int;
    1 rbd_resize2: fn(ImageT, u64, bool, ProgressCallback, *mut c_void) -> c_int;
    1 rbd_diff_iterate2: fn(ImageT, *const c_char, u64, u64, u8, u8, DiffCallback, *mut c_void) -> c_int;
    1 rbd_lock_acquire: fn(ImageT, c_int) -> c_int;
    1 rbd_lock_release: fn(ImageT) -> c_int;
    1 rbd_is_exclusive_lock_owner: fn(ImageT, *mut c_int) -> c_int;
    1 rbd_lock_get_owners: fn(ImageT, *mut c_int, *mut *mut c_char, *mut usize) -> c_int;
    1 rbd_lock_get_owners_cleanup: fn(*mut *mut c_char, usize) -> ();
    1 rbd_lock_break: fn(ImageT, c_int, *const c_char) -> c_int;
    1 rbd_metadata_get: fn(ImageT, *const c_char, *mut c_char, *mut usize) -> c_int;
    1 rbd_metadata_set: fn(ImageT, *const c_char, *const c_char) -> c_int;
    1 rbd_metadata_remove: fn(ImageT, *const c_char) -> c_int;
}

static API: OnceLock<Result<Api, String>> = OnceLock::new();

/// The loaded API, or why it could not be loaded (kept: the libraries do
/// not appear while the process runs).
pub(crate) fn api() -> Result<&'static Api, String> {
    API.get_or_init(|| {
        // SAFETY: loading Ceph's libraries runs their initialisers, which
        // only set up their own state; the names are Ceph's stable sonames.
        let open = |name: &str| unsafe { Library::new(name) }.map_err(|e| e.to_string());
        let libs = [open("librados.so.2")?, open("librbd.so.1")?];
        // SAFETY: the two libraries just opened are librados and librbd;
        // both come from the same Ceph packages on any sane system, and
        // the declared signatures are the C API's since Nautilus.
        unsafe { Api::load(libs) }.map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(Clone::clone)
}
