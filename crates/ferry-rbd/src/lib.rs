//! ferry-rbd: RBD images in a Ceph cluster, as ferry's storage engine needs
//! them — connect with cephx, open a pool, create, list, remove and open
//! images, positional I/O, zeroing, discard, flush, the allocation map
//! (`rbd_diff_iterate2`), resize, the exclusive lock and image metadata.
//!
//! A thin, safe layer over librados and librbd's C API (opened at run time,
//! see [`ffi`]); every call blocks its thread until the cluster answers, so
//! async callers run them on worker threads. Handles are shared between
//! threads: librbd serialises what it must inside one image handle.

mod aio;
mod ffi;
pub mod testing;

pub use aio::AioWrite;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// What went wrong, with the cluster, pool and image it concerns.
#[derive(Debug, thiserror::Error)]
pub enum RbdError {
    #[error("Ceph support needs librados and librbd (apt-get install librbd1): {0}")]
    Library(String),
    #[error("cannot connect to the Ceph cluster of {conf} as client.{client}: {source}")]
    Connect {
        conf: String,
        client: String,
        source: std::io::Error,
    },
    #[error(
        "Ceph pool {0:?} does not exist (create it: ceph osd pool create {0}; rbd pool init {0})"
    )]
    NoPool(String),
    #[error("RBD image {pool}/{image} does not exist")]
    NoImage { pool: String, image: String },
    #[error("RBD image {pool}/{image} already exists")]
    Exists { pool: String, image: String },
    #[error(
        "RBD image {pool}/{image} is locked by another client ({owners}); one writer at a time"
    )]
    Locked {
        pool: String,
        image: String,
        owners: String,
    },
    #[error("invalid name {0:?} for Ceph (empty or holding a NUL byte)")]
    BadName(String),
    #[error("{op} of RBD image {target}: {source}")]
    Io {
        op: &'static str,
        target: String,
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, RbdError>;

fn errno(r: impl TryInto<i32>) -> std::io::Error {
    let r: i32 = r.try_into().unwrap_or(-libc::EIO);
    std::io::Error::from_raw_os_error(-r)
}

fn cstr(s: &str) -> Result<CString> {
    if s.is_empty() {
        return Err(RbdError::BadName(s.into()));
    }
    CString::new(s).map_err(|_| RbdError::BadName(s.into()))
}

fn api() -> Result<&'static ffi::Api> {
    ffi::api().map_err(RbdError::Library)
}

/// How to reach a cluster: its configuration file (monitors), the keyring
/// holding the client's cephx key, and the client's name without `client.`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    pub conf: PathBuf,
    pub keyring: Option<PathBuf>,
    pub client: String,
}

/// A connection to one Ceph cluster.
pub struct Cluster {
    handle: ffi::RadosT,
    conf: ClusterConfig,
    /// Set once any call through this client was refused because the
    /// cluster blocklisted it ([`Cluster::fenced`]).
    fenced: AtomicBool,
    /// Clients this one is fencing or fenced lately ([`Cluster::blocklist`]).
    fences: Fences,
}

/// A client this one fenced less than this long ago is not fenced again:
/// each blocklist entry is a monitor proposal, and proposals are spaced by
/// `paxos_propose_interval` (1 s), which a second one in a row would wait
/// out. Well inside the entry's hour.
const REFENCE_AFTER: Duration = Duration::from_secs(60);

/// One client's address however the cluster wrote it: lease lockers are
/// listed as `v1:IP:PORT/NONCE`, lock owners without the protocol.
fn client_key(address: &str) -> &str {
    ["v1:", "v2:", "any:"]
        .iter()
        .find_map(|p| address.strip_prefix(p))
        .unwrap_or(address)
}

/// The clients one client is fencing (`None`: the monitors have not
/// answered yet) or fenced, and when; callers wait on `changed` for a
/// fence under way.
#[derive(Default)]
struct Fences {
    by_address: Mutex<std::collections::HashMap<String, Option<Instant>>>,
    changed: std::sync::Condvar,
}

// SAFETY: a rados_t is documented thread-safe once connected (librados
// serialises its own state); ferry only creates I/O contexts from it.
unsafe impl Send for Cluster {}
// SAFETY: as above: every call made through a shared handle is thread-safe.
unsafe impl Sync for Cluster {}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("conf", &self.conf).finish()
    }
}

impl Cluster {
    /// Connect (cephx), giving up after `timeout_secs` if the monitors do
    /// not answer.
    pub fn connect(conf: &ClusterConfig, timeout_secs: u32) -> Result<Arc<Cluster>> {
        let api = api()?;
        let connect_err = |source| RbdError::Connect {
            conf: conf.conf.display().to_string(),
            client: conf.client.clone(),
            source,
        };
        let name = cstr(&format!("client.{}", conf.client))?;
        let cluster = cstr("ceph")?;
        let mut handle: ffi::RadosT = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the strings live for the call.
        let r = unsafe { (api.rados_create2)(&mut handle, cluster.as_ptr(), name.as_ptr(), 0) };
        if r < 0 {
            return Err(connect_err(errno(r)));
        }
        // From here the handle is shut down by Drop whatever happens.
        let c = Cluster {
            handle,
            conf: conf.clone(),
            fenced: AtomicBool::new(false),
            fences: Fences::default(),
        };
        let path = cstr(&conf.conf.display().to_string())?;
        // SAFETY: a created handle and a NUL-terminated path.
        let r = unsafe { (api.rados_conf_read_file)(c.handle, path.as_ptr()) };
        if r < 0 {
            return Err(connect_err(errno(r)));
        }
        let timeout = timeout_secs.max(1).to_string();
        let mut settings = vec![
            ("client_mount_timeout", timeout.clone()),
            ("rados_mon_op_timeout", timeout),
            // A write is acknowledged once the OSDs have it, not when it is
            // in this process's memory: a gateway that dies loses nothing
            // it acknowledged, whatever the guest's cache mode.
            ("rbd_cache", "false".into()),
            // Several gateways (and test processes) on one host: no admin
            // socket of ours to collide on.
            ("admin_socket", String::new()),
            // A lock is broken only after its owner was fenced, by
            // `Image::break_lock` itself (which knows whom this client
            // fenced lately): librbd would fence it again.
            ("rbd_blocklist_on_break_lock", "false".into()),
        ];
        if let Some(k) = &conf.keyring {
            settings.push(("keyring", k.display().to_string()));
        }
        for (k, v) in settings {
            let k = cstr(k)?;
            let v = CString::new(v.as_str()).map_err(|_| RbdError::BadName(v.clone()))?;
            // SAFETY: a created, not yet connected handle; NUL-terminated strings.
            let r = unsafe { (api.rados_conf_set)(c.handle, k.as_ptr(), v.as_ptr()) };
            if r < 0 {
                return Err(connect_err(errno(r)));
            }
        }
        // SAFETY: a configured handle.
        let r = unsafe { (api.rados_connect)(c.handle) };
        if r < 0 {
            return Err(connect_err(errno(r)));
        }
        Ok(Arc::new(c))
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.conf
    }

    /// Whether the cluster has fenced this client: some call through it
    /// was refused because the client is blocklisted (`EBLOCKLISTED`,
    /// which is `ESHUTDOWN`). Every later call fails the same way: the
    /// process must connect as a new client to do anything again.
    pub fn fenced(&self) -> bool {
        self.fenced.load(Ordering::Relaxed)
    }

    /// The error for librados/librbd return value `r` of a call through
    /// this client, noting a refusal that says it is fenced.
    pub(crate) fn call_error(&self, r: impl TryInto<i32>) -> std::io::Error {
        let e = errno(r);
        if e.raw_os_error() == Some(libc::ESHUTDOWN) {
            self.fenced.store(true, Ordering::Relaxed);
        }
        e
    }

    /// This client's address as the cluster sees it (what `rbd status`
    /// and lock owners name).
    pub fn address(&self) -> String {
        let Ok(api) = api() else {
            return String::new();
        };
        let mut p: *mut c_char = std::ptr::null_mut();
        // SAFETY: a connected handle; librados returns a string it owns
        // until the next call or shutdown, copied out at once.
        let r = unsafe { (api.rados_getaddrs)(self.handle, &mut p) };
        if r < 0 || p.is_null() {
            return String::new();
        }
        // SAFETY: non-null, NUL-terminated, owned by librados for now.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Bytes the cluster's OSDs have free (raw: before replication).
    pub fn free_bytes(&self) -> Result<u64> {
        let api = api()?;
        let mut st = ffi::ClusterStat::default();
        // SAFETY: a connected handle and an out-pointer to a local of the
        // C struct's layout.
        let r = unsafe { (api.rados_cluster_stat)(self.handle, &mut st) };
        if r < 0 {
            return Err(RbdError::Io {
                op: "cluster stat",
                target: self.conf.conf.display().to_string(),
                source: self.call_error(r),
            });
        }
        Ok(st.kb_avail.saturating_mul(1024))
    }

    /// Fence the client at `address` (as the cluster lists it): the
    /// cluster refuses every operation of it for an hour. Once per client:
    /// a call while this client is fencing the same one waits for that
    /// fence, and one within a minute of it returns at once.
    pub fn blocklist(&self, address: &str) -> Result<()> {
        let api = api()?;
        let a = cstr(address)?;
        let f = &self.fences;
        let address = client_key(address);
        {
            let mut by = f.by_address.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                match by.get(address) {
                    Some(None) => {
                        by = f.changed.wait(by).unwrap_or_else(PoisonError::into_inner);
                    }
                    Some(Some(at)) if at.elapsed() < REFENCE_AFTER => return Ok(()),
                    _ => break,
                }
            }
            by.retain(|_, at| at.is_none_or(|t| t.elapsed() < REFENCE_AFTER));
            by.insert(address.to_string(), None);
        }
        // SAFETY: a connected handle and a NUL-terminated address the call
        // only reads (declared mutable in librados.h).
        let r = unsafe { (api.rados_blocklist_add)(self.handle, a.as_ptr().cast_mut(), 3600) };
        let mut by = f.by_address.lock().unwrap_or_else(PoisonError::into_inner);
        if r < 0 {
            by.remove(address);
        } else {
            by.insert(address.to_string(), Some(Instant::now()));
        }
        f.changed.notify_all();
        if r < 0 {
            return Err(RbdError::Io {
                op: "blocklist",
                target: address.into(),
                source: self.call_error(r),
            });
        }
        Ok(())
    }

    /// Open a pool by name.
    pub fn pool(self: &Arc<Self>, name: &str) -> Result<Arc<Pool>> {
        let api = api()?;
        let n = cstr(name)?;
        let mut io: ffi::IoctxT = std::ptr::null_mut();
        // SAFETY: a connected handle, a NUL-terminated name, an out-pointer.
        let r = unsafe { (api.rados_ioctx_create)(self.handle, n.as_ptr(), &mut io) };
        if r == -libc::ENOENT {
            return Err(RbdError::NoPool(name.into()));
        }
        if r < 0 {
            return Err(RbdError::Io {
                op: "open pool",
                target: name.into(),
                source: self.call_error(r),
            });
        }
        Ok(Arc::new(Pool {
            cluster: self.clone(),
            ioctx: io,
            name: name.into(),
        }))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: the handle is ours, every pool (holding an Arc of
            // this cluster) is gone, so nothing uses it any more.
            unsafe { (api.rados_shutdown)(self.handle) }
        }
    }
}

/// The holder of a lease on an object: its client (`client.N`), the
/// cookie it took the lease with, and its address in the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseHolder {
    pub client: String,
    pub cookie: String,
    pub address: String,
}

/// One pool of a cluster, where images live.
pub struct Pool {
    cluster: Arc<Cluster>,
    ioctx: ffi::IoctxT,
    name: String,
}

// SAFETY: an I/O context may be used from several threads at once
// (librados documents it thread-safe); it is destroyed only in Drop.
unsafe impl Send for Pool {}
// SAFETY: as above.
unsafe impl Sync for Pool {}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("name", &self.name).finish()
    }
}

impl Pool {
    /// The client this pool is open through.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes the cluster has free (see [`Cluster::free_bytes`]).
    pub fn free_bytes(&self) -> Result<u64> {
        self.cluster.free_bytes()
    }

    fn target(&self, image: &str) -> String {
        format!("{}/{image}", self.name)
    }

    fn err(&self, op: &'static str, image: &str, r: impl TryInto<i32>) -> RbdError {
        let e = self.cluster.call_error(r);
        match e.raw_os_error() {
            Some(libc::ENOENT) => RbdError::NoImage {
                pool: self.name.clone(),
                image: image.into(),
            },
            Some(libc::EEXIST) => RbdError::Exists {
                pool: self.name.clone(),
                image: image.into(),
            },
            _ => RbdError::Io {
                op,
                target: self.target(image),
                source: e,
            },
        }
    }

    /// A failed call on object `object` of the pool (not an image: no
    /// `NoImage`/`Exists` reading of its errno).
    fn object_err(&self, op: &'static str, object: &str, r: impl TryInto<i32>) -> RbdError {
        RbdError::Io {
            op,
            target: self.target(object),
            source: self.cluster.call_error(r),
        }
    }

    /// Take or renew, for `secs` seconds, the lease `name` on object
    /// `object` of the pool (an exclusive RADOS lock with a duration; the
    /// object is made if missing) as holder `cookie`. `Ok(false)`: another
    /// holder's lease has not run out. A holder that dies lets it run out;
    /// one that cannot renew must assume it lost it when it would have.
    pub fn lease(&self, object: &str, name: &str, cookie: &str, secs: u32) -> Result<bool> {
        let api = api()?;
        let (o, n, c) = (cstr(object)?, cstr(name)?, cstr(cookie)?);
        let desc = cstr("ferry")?;
        let mut duration = libc::timeval {
            tv_sec: libc::time_t::from(secs),
            tv_usec: 0,
        };
        // SAFETY: a live ioctx, NUL-terminated strings, a timeval the call
        // only reads.
        let r = unsafe {
            (api.rados_lock_exclusive)(
                self.ioctx,
                o.as_ptr(),
                n.as_ptr(),
                c.as_ptr(),
                desc.as_ptr(),
                &mut duration,
                ffi::LOCK_FLAG_RENEW,
            )
        };
        match r {
            0 => Ok(true),
            r if r == -libc::EBUSY || r == -libc::EEXIST => Ok(false),
            r => Err(self.object_err("take a lease", object, r)),
        }
    }

    /// Give up the lease `name` on `object` that `cookie` holds (nothing if
    /// it does not).
    pub fn release_lease(&self, object: &str, name: &str, cookie: &str) -> Result<()> {
        let api = api()?;
        let (o, n, c) = (cstr(object)?, cstr(name)?, cstr(cookie)?);
        // SAFETY: a live ioctx and NUL-terminated strings.
        let r = unsafe { (api.rados_unlock)(self.ioctx, o.as_ptr(), n.as_ptr(), c.as_ptr()) };
        if r < 0 && r != -libc::ENOENT {
            return Err(self.object_err("release a lease", object, r));
        }
        Ok(())
    }

    /// Who holds the lease `name` on `object` (none, or one: it is
    /// exclusive).
    pub fn lease_holders(&self, object: &str, name: &str) -> Result<Vec<LeaseHolder>> {
        let api = api()?;
        let (o, n) = (cstr(object)?, cstr(name)?);
        let mut lens = [256usize; 4];
        loop {
            let [mut tag, mut clients, mut cookies, mut addrs] = lens.map(|l| vec![0u8; l]);
            let mut exclusive: c_int = 0;
            let [tag_len, clients_len, cookies_len, addrs_len] = &mut lens;
            // SAFETY: a live ioctx, NUL-terminated strings, and four
            // buffers whose lengths are passed beside them (the call writes
            // at most that much, and says how much it needs on -ERANGE).
            let r = unsafe {
                (api.rados_list_lockers)(
                    self.ioctx,
                    o.as_ptr(),
                    n.as_ptr(),
                    &mut exclusive,
                    tag.as_mut_ptr().cast(),
                    tag_len,
                    clients.as_mut_ptr().cast(),
                    clients_len,
                    cookies.as_mut_ptr().cast(),
                    cookies_len,
                    addrs.as_mut_ptr().cast(),
                    addrs_len,
                )
            };
            if r == -(libc::ERANGE as isize) {
                lens = lens.map(|l| l.max(256) * 2);
                if lens[0] > 1 << 20 {
                    return Err(self.object_err("list a lease's holders", object, r));
                }
                continue;
            }
            if r == -(libc::ENOENT as isize) {
                return Ok(Vec::new());
            }
            if r < 0 {
                return Err(self.object_err("list a lease's holders", object, r));
            }
            let split = |b: &[u8], len: usize| -> Vec<String> {
                b[..len.min(b.len())]
                    .split(|&c| c == 0)
                    .filter(|s| !s.is_empty())
                    .map(|s| String::from_utf8_lossy(s).into_owned())
                    .collect()
            };
            let clients = split(&clients, lens[1]);
            let cookies = split(&cookies, lens[2]);
            let addrs = split(&addrs, lens[3]);
            return Ok(clients
                .into_iter()
                .zip(cookies)
                .zip(addrs)
                .map(|((client, cookie), address)| LeaseHolder {
                    client,
                    cookie,
                    address,
                })
                .collect());
        }
    }

    /// Take the lease `name` on `object` from `holder`, a holder known to
    /// be dead: its lock is broken. It is not fenced here: a holder that
    /// was only cut off learns at its next renewal that it lost the lease,
    /// and callers that need it unable to write fence it
    /// ([`Cluster::blocklist`]).
    pub fn break_lease(&self, object: &str, name: &str, holder: &LeaseHolder) -> Result<()> {
        let api = api()?;
        let (o, n) = (cstr(object)?, cstr(name)?);
        let (client, cookie) = (cstr(&holder.client)?, cstr(&holder.cookie)?);
        // SAFETY: a live ioctx and NUL-terminated strings.
        let r = unsafe {
            (api.rados_break_lock)(
                self.ioctx,
                o.as_ptr(),
                n.as_ptr(),
                client.as_ptr(),
                cookie.as_ptr(),
            )
        };
        if r < 0 && r != -libc::ENOENT {
            return Err(self.object_err("break a lease", object, r));
        }
        Ok(())
    }

    /// Create an image of `size` bytes (thin: nothing is allocated).
    pub fn create(&self, image: &str, size: u64) -> Result<()> {
        let api = api()?;
        let n = cstr(image)?;
        // 4 MiB objects, rbd's default.
        let mut order: c_int = 22;
        // SAFETY: a live ioctx, NUL-terminated name, out-pointer to a local.
        let r =
            unsafe { (api.rbd_create2)(self.ioctx, n.as_ptr(), size, ffi::FEATURES, &mut order) };
        if r < 0 {
            return Err(self.err("create", image, r));
        }
        Ok(())
    }

    /// Remove an image and its data.
    pub fn remove(&self, image: &str) -> Result<()> {
        let api = api()?;
        let n = cstr(image)?;
        // SAFETY: a live ioctx and a NUL-terminated name.
        let r = unsafe { (api.rbd_remove)(self.ioctx, n.as_ptr()) };
        if r < 0 {
            return Err(self.err("remove", image, r));
        }
        Ok(())
    }

    /// Rename image `from` to `to` in one step of the pool's directory;
    /// refused (`Exists`) when `to` is taken.
    pub fn rename(&self, from: &str, to: &str) -> Result<()> {
        let api = api()?;
        let (f, t) = (cstr(from)?, cstr(to)?);
        // SAFETY: a live ioctx and two NUL-terminated names.
        let r = unsafe { (api.rbd_rename)(self.ioctx, f.as_ptr(), t.as_ptr()) };
        if r < 0 {
            let gone = -r == libc::ENOENT;
            return Err(self.err("rename", if gone { from } else { to }, r));
        }
        Ok(())
    }

    /// Names of the pool's images.
    pub fn list(&self) -> Result<Vec<String>> {
        let api = api()?;
        let mut len: usize = 4096;
        loop {
            let mut buf = vec![0u8; len];
            // SAFETY: `buf` holds `len` writable bytes; librbd writes at
            // most that many and sets `len` to what it needed.
            let r = unsafe { (api.rbd_list)(self.ioctx, buf.as_mut_ptr().cast(), &mut len) };
            if r == -libc::ERANGE && len > buf.len() {
                continue;
            }
            if r < 0 {
                return Err(RbdError::Io {
                    op: "list images",
                    target: self.name.clone(),
                    source: self.cluster.call_error(r),
                });
            }
            let used = usize::try_from(r).unwrap_or(0).min(buf.len());
            return Ok(buf[..used]
                .split(|&b| b == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect());
        }
    }

    /// Open an image. A writer takes the image's exclusive lock and keeps
    /// it until closed: another writer (a second gateway, QEMU's own rbd
    /// driver, `rbd-nbd`) gets [`RbdError::Locked`] instead of writing
    /// behind this one's dirty bitmaps.
    pub fn open(self: &Arc<Self>, image: &str, read_only: bool) -> Result<Image> {
        self.open_breaking(image, read_only, &[])
    }

    /// [`Pool::open`], but a lock held by a client at one of `dead`
    /// addresses (an earlier run of this gateway, known to have died) is
    /// broken first: that client is blocklisted, so that it can never
    /// write again, and the lock taken. Without this the lock would pass
    /// only when the cluster times out the dead client's watch (30 s).
    pub fn open_breaking(
        self: &Arc<Self>,
        image: &str,
        read_only: bool,
        dead: &[String],
    ) -> Result<Image> {
        let img = self.open_handle(image, read_only)?;
        if !read_only {
            // Break a dead predecessor's lock before asking for it: asked
            // first, librbd would wait on the dead owner until the cluster
            // times out its watch.
            if !dead.is_empty() {
                let owners = img.lock_owners().unwrap_or_default();
                for o in owners
                    .iter()
                    .filter(|o| dead.iter().any(|d| !d.is_empty() && o.contains(d.as_str())))
                {
                    img.break_lock(o)?;
                }
            }
            img.acquire_lock()?;
        }
        Ok(img)
    }

    /// Open an image for writing without taking its lock: to read who
    /// holds it and its metadata, then [`Image::break_lock`] a dead
    /// holder's and [`Image::acquire_lock`]. Nothing may be written
    /// through it before the lock is taken.
    pub fn open_unlocked(self: &Arc<Self>, image: &str) -> Result<Image> {
        self.open_handle(image, false)
    }

    fn open_handle(self: &Arc<Self>, image: &str, read_only: bool) -> Result<Image> {
        let api = api()?;
        let n = cstr(image)?;
        let mut h: ffi::ImageT = std::ptr::null_mut();
        // SAFETY: a live ioctx, NUL-terminated name, out-pointer, no snapshot.
        let r = unsafe {
            if read_only {
                (api.rbd_open_read_only)(self.ioctx, n.as_ptr(), &mut h, std::ptr::null())
            } else {
                (api.rbd_open)(self.ioctx, n.as_ptr(), &mut h, std::ptr::null())
            }
        };
        if r < 0 {
            return Err(self.err("open", image, r));
        }
        Ok(Image {
            pool: self.clone(),
            handle: h,
            name: image.into(),
            spec: self.target(image).into(),
            read_only,
        })
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: the ioctx is ours; every image (holding an Arc of
            // this pool) is closed, so nothing uses it any more.
            unsafe { (api.rados_ioctx_destroy)(self.ioctx) }
        }
    }
}

/// An allocated or unallocated run of an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageExtent {
    pub offset: u64,
    pub length: u64,
    /// Holds data (else reads as zeroes).
    pub allocated: bool,
}

/// An open image.
pub struct Image {
    pool: Arc<Pool>,
    handle: ffi::ImageT,
    name: String,
    /// `pool/image`, made once (errors of the I/O path name it).
    spec: Arc<str>,
    read_only: bool,
}

// SAFETY: librbd's image handle is safe to use from several threads at
// once (QEMU's rbd driver and rbd-nbd issue I/O on one handle from many);
// it is closed only in Drop, when no reference is left.
unsafe impl Send for Image {}
// SAFETY: as above.
unsafe impl Sync for Image {}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("pool", &self.pool.name)
            .field("name", &self.name)
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl Image {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn pool(&self) -> &str {
        &self.pool.name
    }
    /// `pool/image`, as `rbd` spells it.
    pub fn spec(&self) -> String {
        self.spec.to_string()
    }

    /// The client this image is open through.
    pub(crate) fn cluster(&self) -> &Arc<Cluster> {
        &self.pool.cluster
    }

    /// [`Image::spec`], shared.
    pub(crate) fn spec_shared(&self) -> Arc<str> {
        self.spec.clone()
    }

    fn io(&self, op: &'static str, r: impl TryInto<i32>) -> RbdError {
        RbdError::Io {
            op,
            target: self.spec(),
            source: self.pool.cluster.call_error(r),
        }
    }

    pub fn size(&self) -> Result<u64> {
        let api = api()?;
        let mut s = 0u64;
        // SAFETY: an open handle and an out-pointer to a local.
        let r = unsafe { (api.rbd_get_size)(self.handle, &mut s) };
        if r < 0 {
            return Err(self.io("stat", r));
        }
        Ok(s)
    }

    /// Read `buf.len()` bytes at `offset` (unallocated ranges read as zeroes).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let api = api()?;
        let mut done = 0usize;
        while done < buf.len() {
            let rest = &mut buf[done..];
            // SAFETY: `rest` is writable for its length for the whole call.
            let r = unsafe {
                (api.rbd_read2)(
                    self.handle,
                    offset + done as u64,
                    rest.len(),
                    rest.as_mut_ptr().cast(),
                    0,
                )
            };
            match usize::try_from(r) {
                Ok(0) => {
                    return Err(RbdError::Io {
                        op: "read",
                        target: self.spec(),
                        source: std::io::ErrorKind::UnexpectedEof.into(),
                    })
                }
                Ok(n) => done += n,
                Err(_) => return Err(self.io("read", r)),
            }
        }
        Ok(())
    }

    /// Write `data` at `offset` (acknowledged by the OSDs' journals: durable
    /// once [`Image::flush`] returns, or at once without librbd's cache).
    pub fn write_at(&self, data: &[u8], offset: u64) -> Result<()> {
        let api = api()?;
        let mut done = 0usize;
        while done < data.len() {
            let rest = &data[done..];
            // SAFETY: `rest` is readable for its length for the whole call.
            let r = unsafe {
                (api.rbd_write2)(
                    self.handle,
                    offset + done as u64,
                    rest.len(),
                    rest.as_ptr().cast(),
                    0,
                )
            };
            match usize::try_from(r) {
                Ok(0) => return Err(self.io("write", -libc::EIO)),
                Ok(n) => done += n,
                Err(_) => return Err(self.io("write", r)),
            }
        }
        Ok(())
    }

    /// Make `[offset, offset+len)` read as zeroes, deallocating whole
    /// objects where it can.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        let api = api()?;
        const STEP: u64 = 1 << 30;
        let mut pos = offset;
        while pos < offset + len {
            let n = STEP.min(offset + len - pos);
            // SAFETY: an open handle; no memory is passed.
            let r = unsafe {
                (api.rbd_write_zeroes)(self.handle, pos, usize::try_from(n).unwrap_or(0), 0, 0)
            };
            if r < 0 {
                return Err(self.io("write zeroes", r));
            }
            pos += n;
        }
        Ok(())
    }

    /// Discard `[offset, offset+len)`: advisory (librbd may keep partial
    /// objects' data), as a disk's UNMAP is.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let api = api()?;
        // SAFETY: an open handle; no memory is passed.
        let r = unsafe { (api.rbd_discard)(self.handle, offset, len) };
        if r < 0 {
            return Err(self.io("discard", r));
        }
        Ok(())
    }

    /// Every completed write durable.
    pub fn flush(&self) -> Result<()> {
        let api = api()?;
        // SAFETY: an open handle.
        let r = unsafe { (api.rbd_flush)(self.handle) };
        if r < 0 {
            return Err(self.io("flush", r));
        }
        Ok(())
    }

    /// Change the image's size (shrinking discards its tail and needs
    /// `allow_shrink`).
    pub fn resize(&self, size: u64, allow_shrink: bool) -> Result<()> {
        let api = api()?;
        // librbd calls the progress callback unconditionally: one that does nothing.
        unsafe extern "C" fn quiet(_: u64, _: u64, _: *mut c_void) -> c_int {
            0
        }
        // SAFETY: an open handle; the callback ignores its argument.
        let r = unsafe {
            (api.rbd_resize2)(
                self.handle,
                size,
                allow_shrink,
                Some(quiet),
                std::ptr::null_mut(),
            )
        };
        if r < 0 {
            return Err(self.io("resize", r));
        }
        Ok(())
    }

    /// Allocated and unallocated runs covering `[offset, offset+len)`, in
    /// order, adjacent runs of one kind merged, at most `max` of them (the
    /// last may end early).
    pub fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<ImageExtent>> {
        let api = api()?;
        let mut data: Vec<(u64, u64)> = Vec::new();
        unsafe extern "C" fn collect(
            off: u64,
            len: usize,
            exists: c_int,
            arg: *mut c_void,
        ) -> c_int {
            // SAFETY: `arg` is the `&mut Vec` passed below, alive and not
            // otherwise borrowed for the whole rbd_diff_iterate2 call.
            let v = unsafe { &mut *arg.cast::<Vec<(u64, u64)>>() };
            if exists != 0 {
                v.push((off, len as u64));
            }
            0
        }
        // SAFETY: an open handle; `collect` only touches `data` through
        // `arg`, which outlives the synchronous call.
        let r = unsafe {
            (api.rbd_diff_iterate2)(
                self.handle,
                std::ptr::null(),
                offset,
                len,
                1,
                0,
                collect,
                (&mut data as *mut Vec<(u64, u64)>).cast(),
            )
        };
        if r < 0 {
            return Err(self.io("allocation map", r));
        }
        data.sort_unstable();
        let mut out: Vec<ImageExtent> = Vec::new();
        let push = |out: &mut Vec<ImageExtent>, e: ImageExtent| {
            if e.length == 0 {
                return;
            }
            match out.last_mut() {
                Some(l) if l.allocated == e.allocated && l.offset + l.length == e.offset => {
                    l.length += e.length
                }
                _ => out.push(e),
            }
        };
        let end = offset + len;
        let mut pos = offset;
        for (o, l) in data {
            let (o, e) = (o.max(pos), (o + l).min(end));
            if e <= o {
                continue;
            }
            push(
                &mut out,
                ImageExtent {
                    offset: pos,
                    length: o - pos,
                    allocated: false,
                },
            );
            push(
                &mut out,
                ImageExtent {
                    offset: o,
                    length: e - o,
                    allocated: true,
                },
            );
            pos = e;
        }
        push(
            &mut out,
            ImageExtent {
                offset: pos,
                length: end - pos,
                allocated: false,
            },
        );
        out.truncate(max.max(1));
        Ok(out)
    }

    /// Bytes the image holds (allocated extents, at object-extent precision).
    pub fn allocated_bytes(&self) -> Result<u64> {
        let size = self.size()?;
        Ok(self
            .extents(0, size, usize::MAX)?
            .iter()
            .filter(|e| e.allocated)
            .map(|e| e.length)
            .sum())
    }

    /// Whether this handle holds the image's exclusive lock.
    pub fn is_lock_owner(&self) -> Result<bool> {
        let api = api()?;
        let mut owner: c_int = 0;
        // SAFETY: an open handle and an out-pointer to a local.
        let r = unsafe { (api.rbd_is_exclusive_lock_owner)(self.handle, &mut owner) };
        if r < 0 {
            return Err(self.io("lock status", r));
        }
        Ok(owner != 0)
    }

    /// The clients holding the image's exclusive lock (`client.N` names
    /// with their addresses), empty when it is free.
    pub fn lock_owners(&self) -> Result<Vec<String>> {
        let api = api()?;
        let mut mode: c_int = 0;
        let mut owners: [*mut c_char; 8] = [std::ptr::null_mut(); 8];
        let mut n: usize = owners.len();
        // SAFETY: an open handle; `owners` has room for `n` pointers, which
        // librbd fills and rbd_lock_get_owners_cleanup frees below.
        let r = unsafe {
            (api.rbd_lock_get_owners)(self.handle, &mut mode, owners.as_mut_ptr(), &mut n)
        };
        if r == -libc::ENOENT {
            return Ok(Vec::new());
        }
        if r < 0 {
            return Err(self.io("lock owners", r));
        }
        let n = n.min(owners.len());
        let names = owners[..n]
            .iter()
            .filter(|p| !p.is_null())
            // SAFETY: non-null NUL-terminated strings librbd allocated.
            .map(|&p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .collect();
        // SAFETY: exactly the `n` strings librbd returned.
        unsafe { (api.rbd_lock_get_owners_cleanup)(owners.as_mut_ptr(), n) };
        Ok(names)
    }

    /// Break the exclusive lock `owner` (as [`Image::lock_owners`] names
    /// it) holds: the owner is blocklisted by the cluster, so it can never
    /// write to the pool again (fenced). For owners known to be dead.
    pub fn break_lock(&self, owner: &str) -> Result<()> {
        let api = api()?;
        let c = cstr(owner)?;
        // Fenced first (at once if this client fenced it lately, or when
        // the fence it started is answered).
        self.pool.cluster.blocklist(owner)?;
        // SAFETY: an open handle and a NUL-terminated owner name.
        let b =
            unsafe { (api.rbd_lock_break)(self.handle, ffi::RBD_LOCK_MODE_EXCLUSIVE, c.as_ptr()) };
        if b < 0 && b != -libc::ENOENT {
            return Err(self.pool.err("break lock", &self.name, b));
        }
        Ok(())
    }

    /// Take the image's exclusive lock, kept until the image is closed;
    /// [`RbdError::Locked`] naming the owner if another client holds it.
    pub fn acquire_lock(&self) -> Result<()> {
        let api = api()?;
        // SAFETY: an open image handle.
        let r = unsafe { (api.rbd_lock_acquire)(self.handle, ffi::RBD_LOCK_MODE_EXCLUSIVE) };
        if r < 0 {
            let owners = self.lock_owners().unwrap_or_default().join(", ");
            return Err(match -r {
                libc::EROFS | libc::EBUSY | libc::EAGAIN => RbdError::Locked {
                    pool: self.pool.name.clone(),
                    image: self.name.clone(),
                    owners: if owners.is_empty() {
                        "unknown".into()
                    } else {
                        owners
                    },
                },
                _ => self.pool.err("lock", &self.name, r),
            });
        }
        Ok(())
    }

    /// An image metadata value (`rbd image-meta get`), `None` if unset.
    pub fn metadata_get(&self, key: &str) -> Result<Option<String>> {
        let api = api()?;
        let k = cstr(key)?;
        let mut len: usize = 4096;
        loop {
            let mut buf = vec![0u8; len];
            // SAFETY: `buf` holds `len` writable bytes; librbd sets `len`
            // to the size needed when it is short.
            let r = unsafe {
                (api.rbd_metadata_get)(self.handle, k.as_ptr(), buf.as_mut_ptr().cast(), &mut len)
            };
            if r == -libc::ERANGE && len > buf.len() {
                continue;
            }
            if r == -libc::ENOENT {
                return Ok(None);
            }
            if r < 0 {
                return Err(self.io("read metadata", r));
            }
            let end = buf
                .iter()
                .position(|&b| b == 0)
                .unwrap_or(buf.len().min(len));
            return Ok(Some(String::from_utf8_lossy(&buf[..end]).into_owned()));
        }
    }

    /// Set an image metadata value (kept in the cluster with the image).
    pub fn metadata_set(&self, key: &str, value: &str) -> Result<()> {
        let api = api()?;
        let (k, v) = (
            cstr(key)?,
            CString::new(value).map_err(|_| RbdError::BadName(value.into()))?,
        );
        // SAFETY: an open handle and NUL-terminated strings.
        let r = unsafe { (api.rbd_metadata_set)(self.handle, k.as_ptr(), v.as_ptr()) };
        if r < 0 {
            return Err(self.io("write metadata", r));
        }
        Ok(())
    }

    /// Remove a metadata key (absent keys are fine).
    pub fn metadata_remove(&self, key: &str) -> Result<()> {
        let api = api()?;
        let k = cstr(key)?;
        // SAFETY: an open handle and a NUL-terminated key.
        let r = unsafe { (api.rbd_metadata_remove)(self.handle, k.as_ptr()) };
        if r < 0 && r != -libc::ENOENT {
            return Err(self.io("remove metadata", r));
        }
        Ok(())
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        if let Ok(api) = api() {
            // SAFETY: the handle is ours and no reference to self is left.
            // Closing flushes and releases the exclusive lock.
            unsafe {
                if !self.read_only {
                    (api.rbd_lock_release)(self.handle);
                }
                (api.rbd_close)(self.handle);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::client_key;

    #[test]
    fn a_client_is_one_client_with_or_without_its_protocol() {
        assert_eq!(
            client_key("v1:127.0.0.1:0/2746049628"),
            "127.0.0.1:0/2746049628"
        );
        assert_eq!(client_key("v2:10.0.0.1:3300/7"), "10.0.0.1:3300/7");
        assert_eq!(
            client_key("127.0.0.1:0/2746049628"),
            "127.0.0.1:0/2746049628"
        );
    }
}
