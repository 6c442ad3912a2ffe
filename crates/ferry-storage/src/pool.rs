//! The pool: a directory of volumes, `volumes/<name>/{meta.json,data.raw,bitmaps/}`,
//! the data of some of them in RBD images of one Ceph pool instead of `data.raw`.
//!
//! A volume is created in a hidden temporary directory and renamed into place,
//! so a crash never leaves a half-made volume under its name. The pool lock
//! guards only the name map; I/O goes through `Arc<Volume>` handles.

use crate::meta::{Backing, VolumeMeta};
use crate::volume::Volume;
use crate::{Result, StorageError};
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Pool-wide settings.
#[derive(Debug, Clone, Default)]
pub struct PoolOptions {
    /// Open backing files with O_DIRECT (bypass the page cache).
    pub direct_io: bool,
    /// The Ceph pool whose RBD images may hold volumes' data.
    pub ceph: Option<CephStore>,
}

/// A Ceph pool volumes' data can live in.
#[derive(Debug, Clone)]
pub struct CephStore {
    pub pool: Arc<ferry_rbd::Pool>,
    /// New volumes go to Ceph unless created with `on_ceph: Some(false)`.
    pub default: bool,
    /// Cluster addresses of this gateway's earlier runs, dead now: locks
    /// they left on images are broken (and they fenced) at open.
    pub dead_owners: Vec<String>,
    /// Held for the pool's life: the lock that makes this the only daemon
    /// on the pool directory (so the predecessor whose locks it breaks is
    /// surely dead).
    pub dir_lock: Option<Arc<fs::File>>,
    /// Set when this daemon is one of several gateways in front of the
    /// cluster: its RBD volumes keep their state in the cluster and are
    /// claimed and released ([`crate::shared`]).
    pub shared: Option<crate::SharedGateway>,
}

/// How to create a volume.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    pub size: u64,
    pub block_size: u32,
    /// Physical block size to report, a power-of-two multiple of
    /// `block_size` up to 64 KiB (None: the same as `block_size`).
    pub physical_block_size: Option<u32>,
    pub preallocate: bool,
    /// Use an existing file or block device instead of a pool file.
    pub external: Option<PathBuf>,
    pub read_only: bool,
    /// Keep this UUID and WWN (a migrated copy presents the source's identity).
    pub identity: Option<(uuid::Uuid, String)>,
    /// Create the volume as the incomplete copy of an incoming migration.
    pub incoming: Option<crate::meta::IncomingMigration>,
    /// Put the data in an RBD image of the pool's Ceph pool (true) or in a
    /// file (false); None: as the pool's settings say.
    pub on_ceph: Option<bool>,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            size: 0,
            block_size: 512,
            physical_block_size: None,
            preallocate: false,
            external: None,
            read_only: false,
            identity: None,
            incoming: None,
            on_ceph: None,
        }
    }
}

/// A pool of volumes under one directory.
#[derive(Debug)]
pub struct Pool {
    root: PathBuf,
    opts: PoolOptions,
    volumes: RwLock<BTreeMap<String, Arc<Volume>>>,
    /// One claim of a shared volume at a time.
    claiming: parking_lot::Mutex<()>,
    /// Read-only handles on shared volumes this gateway does not hold
    /// ([`Pool::reader`]), kept open between reads.
    readers: RwLock<BTreeMap<String, Arc<Volume>>>,
    /// Shared volumes found idle by the last [`Pool::release_idle`].
    idle: parking_lot::Mutex<std::collections::BTreeSet<String>>,
    /// The file system under `volumes/` shares extents between files
    /// (probed at open): see [`Pool::shares_extents`].
    files_share_extents: bool,
}

/// Volume and bitmap names: what is safe as a file name and an NBD export name.
pub(crate) fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(StorageError::InvalidName(name.into()))
    }
}

impl Pool {
    /// Open (creating if needed) the pool at `root` and every volume in it.
    pub fn open(root: &Path, opts: PoolOptions) -> Result<Pool> {
        let vdir = root.join("volumes");
        fs::create_dir_all(&vdir).map_err(|e| StorageError::io("mkdir", &vdir, e))?;
        let mut volumes = BTreeMap::new();
        let entries = fs::read_dir(&vdir).map_err(|e| StorageError::io("readdir", &vdir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| StorageError::io("readdir", &vdir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                // A creation or deletion that did not finish; it never
                // became visible, or is gone already.
                remove_leftover(&entry.path(), opts.ceph.as_ref());
                continue;
            }
            match Volume::open(&entry.path(), opts.direct_io, opts.ceph.as_ref()) {
                Ok(v) => {
                    volumes.insert(name, Arc::new(v));
                }
                Err(e) => {
                    tracing::error!(volume = %name, error = %e, "cannot open volume; skipping it")
                }
            }
        }
        let files_share_extents =
            probe_extent_sharing(&vdir.join(format!(".extent-probe-{}", std::process::id())));
        Ok(Pool {
            root: root.to_path_buf(),
            opts,
            volumes: RwLock::new(volumes),
            claiming: Default::default(),
            readers: Default::default(),
            idle: Default::default(),
            files_share_extents,
        })
    }

    /// Whether a volume created here shares the extents of blocks it is
    /// given from another volume of the pool instead of writing them
    /// ([`Volume::share_from`]): its data goes to a file, and the pool's
    /// file system shares extents (XFS with reflink, btrfs; not ext4, not
    /// RBD). A migration's destination then rebuilds the blocks it holds
    /// at the speed of reading them once, not of copying them.
    pub fn shares_extents(&self) -> bool {
        self.files_share_extents && !self.opts.ceph.as_ref().is_some_and(|c| c.default)
    }

    /// This daemon's address as a shared gateway, if it is one.
    pub fn gateway_address(&self) -> Option<&str> {
        Some(self.shared_store()?.1.address.as_str())
    }

    /// The Ceph pool and this gateway, when this daemon is a shared gateway.
    fn shared_store(&self) -> Option<(&CephStore, &crate::SharedGateway)> {
        let c = self.opts.ceph.as_ref()?;
        Some((c, c.shared.as_ref()?))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Bytes an unprivileged writer may still allocate in the pool's file
    /// system (`statvfs`: available blocks times the fragment size).
    pub fn free_bytes(&self) -> Result<u64> {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(self.root.as_os_str().as_bytes())
            .map_err(|e| StorageError::Invalid(e.to_string()))?;
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: `path` is a NUL-terminated string and `st` points to
        // writable memory of the size statvfs fills.
        let r = unsafe { libc::statvfs(path.as_ptr(), st.as_mut_ptr()) };
        if r != 0 {
            return Err(StorageError::io(
                "statvfs",
                &self.root,
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: statvfs returned 0, so it initialised `st`.
        let st = unsafe { st.assume_init() };
        Ok(st.f_bavail.saturating_mul(st.f_frsize))
    }

    /// Bytes a new volume's data may still take: the Ceph cluster's free
    /// space when new volumes go to Ceph, else the pool file system's.
    pub fn free_bytes_for_new(&self) -> Result<u64> {
        self.free_bytes_where(self.opts.ceph.as_ref().is_some_and(|c| c.default))
    }

    /// Bytes volume `v` may still grow by, where its data lives.
    pub fn free_bytes_for(&self, v: &Volume) -> Result<u64> {
        self.free_bytes_where(v.on_ceph())
    }

    /// The cluster's free bytes (`on_ceph`, if one is configured) or the
    /// pool file system's.
    fn free_bytes_where(&self, on_ceph: bool) -> Result<u64> {
        match &self.opts.ceph {
            Some(c) if on_ceph => c
                .pool
                .free_bytes()
                .map_err(|e| StorageError::rbd("cluster stat", e)),
            _ => self.free_bytes(),
        }
    }

    /// An external backing file must be a regular file or a block device,
    /// outside the pool, and not another volume's data.
    fn check_external(&self, path: &Path) -> Result<()> {
        use std::os::unix::fs::FileTypeExt;
        let real = fs::canonicalize(path).map_err(|e| StorageError::io("resolve", path, e))?;
        let ft = fs::metadata(&real)
            .map_err(|e| StorageError::io("stat", &real, e))?
            .file_type();
        if !(ft.is_file() || ft.is_block_device()) {
            return Err(StorageError::Invalid(format!(
                "{} is not a regular file or a block device",
                path.display()
            )));
        }
        let root = fs::canonicalize(&self.root).unwrap_or_else(|_| self.root.clone());
        if real.starts_with(&root) {
            return Err(StorageError::Invalid(format!(
                "{} is inside the pool; a volume's path must be outside it",
                path.display()
            )));
        }
        for v in self.list() {
            if fs::canonicalize(v.data_path()).is_ok_and(|p| p == real) {
                return Err(StorageError::Invalid(format!(
                    "{} is already the data of volume {}",
                    path.display(),
                    v.name()
                )));
            }
        }
        Ok(())
    }

    /// Create a volume.
    pub fn create(&self, name: &str, o: &CreateOptions) -> Result<Arc<Volume>> {
        check_name(name)?;
        if o.block_size != 512 && o.block_size != 4096 {
            return Err(StorageError::Invalid(format!(
                "block size {} must be 512 or 4096",
                o.block_size
            )));
        }
        if let Some(p) = o.physical_block_size {
            if !p.is_power_of_two() || p < o.block_size || p > 65536 {
                return Err(StorageError::Invalid(format!(
                    "physical block size {p} must be a power of two from the block size {} to 65536",
                    o.block_size
                )));
            }
        }
        if self.volumes.read().contains_key(name) {
            return Err(StorageError::Exists(name.into()));
        }
        let ceph = match (o.on_ceph, &self.opts.ceph) {
            (Some(true), None) => {
                return Err(StorageError::Invalid(
                    "no Ceph pool is configured for this daemon ([storage.ceph])".into(),
                ))
            }
            (Some(true), Some(c)) => Some(c),
            (None, Some(c)) if c.default && o.external.is_none() => Some(c),
            _ => None,
        };
        let backing = match (&o.external, o.preallocate, ceph) {
            (Some(_), _, Some(_)) => {
                return Err(StorageError::Invalid(
                    "a volume is either on an external file or on Ceph, not both".into(),
                ))
            }
            (None, true, Some(_)) => {
                return Err(StorageError::Invalid(
                    "RBD images are thin: preallocation does not apply to a volume on Ceph".into(),
                ))
            }
            (None, false, Some(c)) => Backing::Rbd {
                pool: c.pool.name().to_string(),
                image: name.to_string(),
            },
            (Some(p), _, None) => Backing::External { path: p.clone() },
            (None, true, None) => Backing::Preallocated,
            (None, false, None) => Backing::Sparse,
        };
        let mut size = o.size;
        if let Backing::External { path } = &backing {
            self.check_external(path)?;
            let f = fs::File::open(path).map_err(|e| StorageError::io("open", path, e))?;
            use std::io::Seek;
            let mut f = f;
            let len = f
                .seek(std::io::SeekFrom::End(0))
                .map_err(|e| StorageError::io("seek", path, e))?;
            if size == 0 {
                size = len;
            } else if size > len {
                return Err(StorageError::Invalid(format!(
                    "{} holds only {len} bytes",
                    path.display()
                )));
            }
        }
        if size == 0 || !size.is_multiple_of(u64::from(o.block_size)) {
            return Err(StorageError::Invalid(format!(
                "size {size} must be a non-zero multiple of the block size {}",
                o.block_size
            )));
        }
        let new_meta = || {
            let mut meta = VolumeMeta::new(name, size, o.block_size, backing.clone(), o.read_only);
            if let Some((uuid, wwn)) = &o.identity {
                meta.uuid = *uuid;
                meta.wwn = wwn.clone();
            }
            meta.incoming = o.incoming.clone();
            meta.physical_block_size = o.physical_block_size.filter(|p| *p > o.block_size);
            meta
        };
        if let Some((c, gw)) = ceph.and_then(|c| Some((c, c.shared.as_ref()?))) {
            let _one = self.claiming.lock();
            if self.volumes.read().contains_key(name) {
                return Err(StorageError::Exists(name.into()));
            }
            let meta = new_meta();
            let image = crate::shared::create(c, gw, &meta)?;
            let v = self.open_shared(
                name,
                crate::shared::Claimed {
                    image,
                    meta,
                    unclean: false,
                },
            )?;
            self.volumes.write().insert(name.into(), v.clone());
            return Ok(v);
        }
        let vdir = self.root.join("volumes");
        let tmp = vdir.join(format!(".new-{name}-{}", uuid::Uuid::new_v4()));
        fs::create_dir(&tmp).map_err(|e| StorageError::io("mkdir", &tmp, e))?;
        let made = (|| {
            let meta = new_meta();
            // Written before an RBD image is made: a crash from here on
            // leaves a hidden directory that names the image to remove.
            meta.store(&tmp.join("meta.json"))?;
            if let (Backing::Rbd { image, .. }, Some(c)) = (&backing, ceph) {
                c.pool
                    .create(image, size)
                    .map_err(|e| StorageError::rbd("create", e))?;
            } else if !matches!(backing, Backing::External { .. }) {
                let data = tmp.join("data.raw");
                let f =
                    fs::File::create(&data).map_err(|e| StorageError::io("create", &data, e))?;
                if o.preallocate {
                    preallocate(&f, size).map_err(|e| StorageError::io("fallocate", &data, e))?;
                } else {
                    f.set_len(size)
                        .map_err(|e| StorageError::io("truncate", &data, e))?;
                }
                f.sync_all()
                    .map_err(|e| StorageError::io("fsync", &data, e))?;
            }
            Ok(())
        })();
        if let Err(e) = made {
            // An image that existed before is not ours to remove.
            if !matches!(e, StorageError::Ceph(ferry_rbd::RbdError::Exists { .. })) {
                remove_leftover(&tmp, self.opts.ceph.as_ref());
            }
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        let mut map = self.volumes.write();
        if map.contains_key(name) {
            remove_leftover(&tmp, self.opts.ceph.as_ref());
            return Err(StorageError::Exists(name.into()));
        }
        let dest = vdir.join(name);
        fs::rename(&tmp, &dest).map_err(|e| StorageError::io("rename", &dest, e))?;
        crate::meta::sync_dir(&vdir)?;
        let v = Arc::new(Volume::open(
            &dest,
            self.opts.direct_io,
            self.opts.ceph.as_ref(),
        )?);
        map.insert(name.into(), v.clone());
        Ok(v)
    }

    /// The volume `name`. A shared volume not held here is claimed
    /// ([`crate::shared`]): [`StorageError::HeldElsewhere`] if a live
    /// gateway holds it.
    pub fn get(&self, name: &str) -> Result<Arc<Volume>> {
        if let Some(v) = self.volumes.read().get(name) {
            return Ok(v.clone());
        }
        match self.shared_store() {
            Some((c, gw)) => self.claim(name, c, gw),
            None => Err(StorageError::NotFound(name.into())),
        }
    }

    /// Volume `name` to read blocks from (a migration taking blocks the
    /// site already holds, an index scan): the volume if this daemon
    /// holds it; else, a shared volume, a read-only handle on its image
    /// that leaves it where it is (another gateway may be writing it:
    /// whatever is read must be checked, as fingerprinted blocks are).
    pub fn reader(&self, name: &str) -> Result<Arc<Volume>> {
        if let Some(v) = self.volumes.read().get(name) {
            return Ok(v.clone());
        }
        let Some((c, _)) = self.shared_store() else {
            return Err(StorageError::NotFound(name.into()));
        };
        if let Some(v) = self.readers.read().get(name) {
            return Ok(v.clone());
        }
        check_name(name)?;
        let image = crate::shared::open(c, name, true)?;
        let mut meta = crate::shared::read_meta(&image, name)?;
        meta.read_only = true;
        let v = self.open_shared(
            name,
            crate::shared::Claimed {
                image,
                meta,
                unclean: false,
            },
        )?;
        self.readers.write().insert(name.into(), v.clone());
        Ok(v)
    }

    /// On a shared gateway, remove the images crashed makers of shared
    /// volumes left under their temporary names (see
    /// `shared::remove_half_made`); their names.
    pub fn remove_half_made(&self) -> Result<Vec<String>> {
        match self.shared_store() {
            Some((c, _)) => crate::shared::remove_half_made(c),
            None => Ok(Vec::new()),
        }
    }

    /// The shared volumes of the cluster, held here or not, as readers
    /// (see [`Pool::reader`]); empty unless this is a shared gateway.
    pub fn shared_readers(&self) -> Result<Vec<Arc<Volume>>> {
        self.each_shared(|_, name| self.reader(name).map(|v| v.shared().then_some(v)))
    }

    /// `read` applied to every image of the cluster's pool (none unless
    /// this is a shared gateway): what it gives, its images that are not
    /// volumes (not found) and those it cannot read (logged) left out.
    fn each_shared<T>(
        &self,
        read: impl Fn(&CephStore, &str) -> Result<Option<T>>,
    ) -> Result<Vec<T>> {
        let Some((c, _)) = self.shared_store() else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        for name in crate::shared::image_names(c)? {
            match read(c, &name) {
                Ok(v) => out.extend(v),
                Err(StorageError::NotFound(_)) => {}
                Err(e) => tracing::debug!(volume = %name, error = %e, "shared volume unreadable"),
            }
        }
        Ok(out)
    }

    /// A shared volume over a claimed (or read-only) image.
    fn open_shared(&self, name: &str, claimed: crate::shared::Claimed) -> Result<Arc<Volume>> {
        Ok(Arc::new(Volume::open_shared(
            &self.root.join("volumes").join(name),
            claimed,
        )?))
    }

    fn claim(&self, name: &str, c: &CephStore, gw: &crate::SharedGateway) -> Result<Arc<Volume>> {
        check_name(name)?;
        let _one = self.claiming.lock();
        // A read-only handle is not needed once it is held here.
        if let Some(r) = self.readers.write().remove(name) {
            r.close_backing();
        }
        if let Some(v) = self.volumes.read().get(name) {
            return Ok(v.clone());
        }
        let claimed = crate::shared::claim(c, gw, name)?;
        if claimed.unclean {
            tracing::warn!(volume = name, "claimed a volume its last gateway did not release; its persistent bitmaps are all dirty");
        }
        let v = self.open_shared(name, claimed)?;
        tracing::info!(volume = name, "claimed");
        self.volumes.write().insert(name.into(), v.clone());
        Ok(v)
    }

    /// The shared volumes of the cluster this gateway does not hold, as
    /// the cluster records them. Empty unless this daemon is a shared
    /// gateway.
    pub fn shared_elsewhere(&self) -> Result<Vec<crate::shared::SharedVolume>> {
        self.each_shared(|c, name| {
            if self.volumes.read().contains_key(name) {
                return Ok(None);
            }
            crate::shared::peek(c, name).map(Some)
        })
    }

    /// Release the shared volumes no client, migration or other handle
    /// has held since the last call (call it every few seconds): state
    /// saved to the cluster, lock let go, so another gateway can claim
    /// them without breaking anything. Returns their names.
    pub fn release_idle(&self) -> Vec<String> {
        if self.shared_store().is_none() {
            return Vec::new();
        }
        let idle_now = |v: &Arc<Volume>| {
            v.shared()
                && Arc::strong_count(v) == 1
                && v.held_by().is_empty()
                && v.incoming().is_none()
                && v.outgoing().is_none()
        };
        let mut seen = self.idle.lock();
        let mut next = std::collections::BTreeSet::new();
        let mut gone = Vec::new();
        {
            let mut vols = self.volumes.write();
            let names: Vec<String> = vols
                .iter()
                .filter(|(_, v)| idle_now(v))
                .map(|(n, _)| n.clone())
                .collect();
            for n in names {
                if seen.contains(&n) {
                    if let Some(v) = vols.remove(&n) {
                        gone.push(v);
                    }
                } else {
                    next.insert(n);
                }
            }
        }
        *seen = next;
        drop(seen);
        gone.into_iter()
            .map(|v| {
                if let Err(e) = v.close() {
                    tracing::error!(volume = %v.name(), error = %e, "saving a released volume's state failed; the next claim marks its bitmaps dirty");
                }
                v.close_backing();
                tracing::info!(volume = %v.name(), "released");
                v.name()
            })
            .collect()
    }

    pub fn list(&self) -> Vec<Arc<Volume>> {
        self.volumes.read().values().cloned().collect()
    }

    /// Delete a volume and its pool files (an external backing file stays).
    /// Delete a volume and its files. Refused while a migration holds it
    /// (always) or a client does (unless `force`: the clients then get
    /// errors).
    pub fn delete(&self, name: &str, force: bool) -> Result<()> {
        let v = {
            let mut vols = self.volumes.write();
            let v = vols
                .get(name)
                .ok_or_else(|| StorageError::NotFound(name.into()))?;
            let held_by = v.held_by();
            if held_by.has_migration() || (!held_by.is_empty() && !force) {
                return Err(StorageError::InUse {
                    name: name.into(),
                    hint: if held_by.has_migration() {
                        " (wait for the migration to end, or cancel it)"
                    } else {
                        " (force deletes it anyway; its clients get errors)"
                    },
                    held_by,
                });
            }
            vols.remove(name)
                .ok_or_else(|| StorageError::NotFound(name.into()))?
        };
        v.mark_deleted();
        self.remove_files(&v)
    }

    /// Remove a volume's directory (already out of the map): renamed
    /// aside first, so a crash half-way leaves no half volume to open.
    fn remove_files(&self, v: &Volume) -> Result<()> {
        if v.shared() {
            // Nothing of it is in the pool directory.
            if let Some(r) = self.readers.write().remove(&v.name()) {
                r.close_backing();
            }
            v.close_backing();
            if let (Backing::Rbd { image, .. }, Some(c)) = (&v.meta().backing, &self.opts.ceph) {
                remove_image(c, image).map_err(|e| StorageError::rbd("remove", e))?;
            }
            return Ok(());
        }
        let dir = v.dir().to_path_buf();
        let gone =
            self.root
                .join("volumes")
                .join(format!(".del-{}-{}", v.name(), uuid::Uuid::new_v4()));
        fs::rename(&dir, &gone).map_err(|e| StorageError::io("rename", &dir, e))?;
        // Renamed aside first: a crash before the image is gone leaves a
        // hidden directory that names it, removed at the next start.
        v.close_backing();
        if let (Backing::Rbd { image, .. }, Some(c)) = (&v.meta().backing, &self.opts.ceph) {
            remove_image(c, image).map_err(|e| StorageError::rbd("remove", e))?;
        }
        fs::remove_dir_all(&gone).map_err(|e| StorageError::io("remove", &gone, e))
    }

    /// Delete the incomplete copies of incoming migrations that no
    /// migration holds and none has touched for `idle_secs`; returns what
    /// was deleted, with the migration and source each copy was for. The
    /// check and the removal happen under the pool's lock, so a migration
    /// that takes a copy up meanwhile keeps it.
    pub fn delete_stale_incoming(&self, idle_secs: u64) -> Vec<(String, crate::IncomingMigration)> {
        let now = crate::meta::unix_now();
        let mut gone = Vec::new();
        let stale: Vec<(String, crate::IncomingMigration)> = {
            let mut vols = self.volumes.write();
            let names: Vec<String> = vols
                .iter()
                .filter(|(_, v)| {
                    v.incoming()
                        .is_some_and(|inc| now.saturating_sub(inc.touched_unix) >= idle_secs)
                        && v.held_by().is_empty()
                })
                .map(|(n, _)| n.clone())
                .collect();
            names
                .into_iter()
                .filter_map(|n| {
                    let v = vols.remove(&n)?;
                    v.mark_deleted();
                    gone.push(v.clone());
                    Some((n, v.incoming()?))
                })
                .collect()
        };
        for v in gone {
            if let Err(e) = self.remove_files(&v) {
                tracing::warn!(volume = %v.name(), error = %e, "removing a stale incomplete copy failed");
            }
        }
        stale
    }

    /// Close every volume cleanly (flush, save bitmaps), and close RBD
    /// images (releasing their locks) at once, not whenever the last
    /// handle of a volume goes: a thread still holding one (a background
    /// scan) must not keep the cluster connection past the daemon's end.
    pub fn close(&self) -> Result<()> {
        for r in std::mem::take(&mut *self.readers.write()).into_values() {
            r.close_backing();
        }
        let mut first = Ok(());
        for v in self.list() {
            if let Err(e) = v.close() {
                tracing::error!(volume = %v.name(), error = %e, "close failed");
                if first.is_ok() {
                    first = Err(e);
                }
            }
            v.close_backing();
        }
        first
    }
}

/// Remove a volume's RBD image; one already gone is fine.
fn remove_image(c: &CephStore, image: &str) -> ferry_rbd::Result<()> {
    match c.pool.remove(image) {
        Ok(()) | Err(ferry_rbd::RbdError::NoImage { .. }) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Remove a hidden volume directory (a creation or deletion cut short) and
/// the RBD image it names, if any.
fn remove_leftover(dir: &Path, ceph: Option<&CephStore>) {
    if let (Ok(m), Some(c)) = (VolumeMeta::load(&dir.join("meta.json")), ceph) {
        if let Backing::Rbd { pool, image } = &m.backing {
            if pool == c.pool.name() {
                if let Err(e) = remove_image(c, image) {
                    // Kept, so that the next start tries again.
                    tracing::warn!(image = %image, error = %e, "removing the RBD image of an unfinished volume failed");
                    return;
                }
            }
        }
    }
    let _ = fs::remove_dir_all(dir);
}

/// Whether the file system at `dir` (made for the probe, then removed;
/// a leftover is a hidden entry that the next open removes, as it did
/// before this probe) shares a file's extents with another (FICLONE of
/// a 4 KiB file).
fn probe_extent_sharing(dir: &Path) -> bool {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let shared = fs::create_dir(dir).is_ok()
        && (|| -> std::io::Result<bool> {
            // FICLONE reads the source: open it for reading too.
            let mut from = fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(dir.join("from"))?;
            from.write_all(&[0x5a; 4096])?;
            let to = fs::File::create(dir.join("to"))?;
            // SAFETY: FICLONE between two descriptors owned by `from` and
            // `to`, open for the call's duration; no memory is passed.
            let r = unsafe { libc::ioctl(to.as_raw_fd(), libc::FICLONE, from.as_raw_fd()) };
            Ok(r == 0)
        })()
        .unwrap_or(false);
    let _ = fs::remove_dir_all(dir);
    shared
}

fn preallocate(f: &fs::File, size: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len =
        libc::off_t::try_from(size).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: posix_fallocate on a valid descriptor owned by `f`; no memory is passed.
    let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(r))
    }
}
