//! Shared volumes: RBD images whose whole state lives in the cluster with
//! them (image metadata), so that any gateway in front of the cluster can
//! serve any of them, one at a time.
//!
//! A gateway *claims* a shared volume when it first needs it (a client
//! asks for it, a migration arrives): it opens the image, takes its
//! exclusive lock and records itself as the holder (`ferry.holder`, the
//! address clients reach it at). It *releases* it when no client or
//! migration has held it for a while, or when it stops: bitmaps and
//! metadata saved to the image, holder key removed, lock let go. A
//! gateway asked for a volume another gateway holds asks the holder's
//! address: if it answers, the volume is "held elsewhere" (clients are
//! sent there); if it does not, the holder is dead: its lock is broken,
//! which blocklists (fences) it in the cluster, and the volume is
//! claimed with every persistent bitmap marked all dirty (the dead
//! holder's last writes were not recorded in them).

use crate::meta::VolumeMeta;
use crate::{CephStore, Result, StorageError};
use base64::Engine as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Image metadata key: the volume's [`VolumeMeta`] as JSON.
pub const META_KEY: &str = "ferry.meta";
/// Image metadata key: the address of the gateway holding the volume,
/// present from its claim to its clean release (present at a claim: the
/// last holder did not release it cleanly).
pub const HOLDER_KEY: &str = "ferry.holder";
/// Image metadata key: the holder's iSCSI portal (`HOST:PORT`), when it
/// has one: initiators that log in elsewhere are redirected there.
pub const HOLDER_ISCSI_KEY: &str = "ferry.holder.iscsi";
/// Image metadata key prefix: a persistent dirty bitmap, zstd-compressed
/// and base64-encoded.
pub const BITMAP_PREFIX: &str = "ferry.bitmap.";

/// This gateway, as one of several in front of one cluster.
#[derive(Clone)]
pub struct SharedGateway {
    /// Where clients and other gateways reach this one (its NBD
    /// `HOST:PORT`), recorded as the holder of what it claims.
    pub address: String,
    /// Its iSCSI portal as initiators reach it, if it serves iSCSI.
    pub iscsi: Option<String>,
    /// Whether a gateway answers at an address: a holder that does not is
    /// dead, and its lock is broken. Only a gateway's own earlier run and
    /// dead gateways lose their locks; an image locked by something that
    /// is not a ferry gateway (QEMU's rbd driver) is never taken.
    pub alive: Arc<dyn Fn(&str) -> bool + Send + Sync>,
}

impl std::fmt::Debug for SharedGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedGateway")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

/// Where the state of a volume lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Home {
    /// `meta.json`, `bitmaps/` and the in-use marker in the volume's
    /// directory of the pool.
    Dir,
    /// Image metadata of its RBD image; `unclean` when the last holder
    /// did not release it.
    Cluster { unclean: bool },
}

/// How errors name an image's metadata.
fn what(img: &ferry_rbd::Image) -> PathBuf {
    PathBuf::from(format!("rbd:{}", img.spec()))
}

/// The key of persistent bitmap `name`.
pub(crate) fn bitmap_key(name: &str) -> String {
    format!("{BITMAP_PREFIX}{name}")
}

pub(crate) fn meta_to_json(m: &VolumeMeta) -> Result<String> {
    serde_json::to_string(m).map_err(|e| StorageError::Invalid(e.to_string()))
}

/// Open image `name` read-only, or for writing without its lock;
/// [`StorageError::NotFound`] when there is none.
pub(crate) fn open(store: &CephStore, name: &str, read_only: bool) -> Result<ferry_rbd::Image> {
    let opened = if read_only {
        store.pool.open(name, true)
    } else {
        store.pool.open_unlocked(name)
    };
    match opened {
        Ok(i) => Ok(i),
        Err(ferry_rbd::RbdError::NoImage { .. }) => Err(StorageError::NotFound(name.into())),
        Err(e) => Err(StorageError::rbd("open", e)),
    }
}

/// The volume `img` holds (`ferry.meta`), checked as `meta.json` is;
/// [`StorageError::NotFound`] (named `name`) for an image that is not a
/// ferry volume.
pub(crate) fn read_meta(img: &ferry_rbd::Image, name: &str) -> Result<VolumeMeta> {
    let json = img
        .metadata_get(META_KEY)
        .map_err(|e| StorageError::rbd("read metadata", e))?
        .ok_or_else(|| StorageError::NotFound(name.into()))?;
    VolumeMeta::parse(json.as_bytes(), &what(img))
}

/// Persistent bitmap `name` as stored in `img`'s metadata (the bytes
/// [`crate::DirtyBitmap::encode`] made).
pub(crate) fn read_bitmap(img: &ferry_rbd::Image, name: &str) -> Result<Vec<u8>> {
    let text = img
        .metadata_get(&bitmap_key(name))
        .map_err(|e| StorageError::rbd("read metadata", e))?
        .ok_or_else(|| StorageError::Corrupt {
            what: "dirty bitmap",
            path: what(img),
            detail: "missing".into(),
        })?;
    decode_bitmap(&text, &what(img))
}

pub(crate) fn encode_bitmap(bytes: &[u8]) -> Result<String> {
    let z = zstd::bulk::compress(bytes, 3)
        .map_err(|e| StorageError::Invalid(format!("compressing a bitmap: {e}")))?;
    Ok(base64::engine::general_purpose::STANDARD.encode(z))
}

pub(crate) fn decode_bitmap(s: &str, path: &Path) -> Result<Vec<u8>> {
    let corrupt = |detail: String| StorageError::Corrupt {
        what: "dirty bitmap",
        path: path.to_path_buf(),
        detail,
    };
    let z = base64::engine::general_purpose::STANDARD
        .decode(s.trim())
        .map_err(|e| corrupt(e.to_string()))?;
    use std::io::Read;
    let mut out = Vec::new();
    zstd::stream::read::Decoder::new(&z[..])
        .and_then(|d| d.take(crate::bitmap::MAX_FILE + 1).read_to_end(&mut out))
        .map_err(|e| corrupt(e.to_string()))?;
    Ok(out)
}

/// A claimed image: locked by this gateway, recorded as its holder.
pub(crate) struct Claimed {
    pub image: ferry_rbd::Image,
    pub meta: VolumeMeta,
    pub unclean: bool,
}

/// Claim volume `name` (its image of the same name) for this gateway.
pub(crate) fn claim(store: &CephStore, gw: &SharedGateway, name: &str) -> Result<Claimed> {
    let rbd = |op, e| StorageError::rbd(op, e);
    let img = open(store, name, false)?;
    // An image of the pool that is not a ferry volume is not found.
    read_meta(&img, name)?;
    let owners = img.lock_owners().map_err(|e| rbd("lock owners", e))?;
    if !owners.is_empty() {
        let holder = img
            .metadata_get(HOLDER_KEY)
            .map_err(|e| rbd("read metadata", e))?;
        let ours = owners.iter().any(|o| {
            store
                .dead_owners
                .iter()
                .any(|d| !d.is_empty() && o.contains(d.as_str()))
        }) || holder.as_deref() == Some(gw.address.as_str());
        match holder {
            _ if ours => {}
            Some(h) if !(gw.alive)(&h) => {
                tracing::warn!(volume = name, holder = %h, ?owners, "the gateway holding the volume does not answer; breaking its lock (it is fenced)");
            }
            Some(h) => {
                return Err(StorageError::HeldElsewhere {
                    name: name.into(),
                    holder: h,
                    iscsi: img
                        .metadata_get(HOLDER_ISCSI_KEY)
                        .map_err(|e| rbd("read metadata", e))?,
                })
            }
            // Locked by a client that is not a ferry gateway.
            None => {
                return Err(rbd(
                    "lock",
                    ferry_rbd::RbdError::Locked {
                        pool: store.pool.name().into(),
                        image: name.into(),
                        owners: owners.join(", "),
                    },
                ))
            }
        }
        for o in &owners {
            img.break_lock(o).map_err(|e| rbd("break lock", e))?;
        }
    }
    img.acquire_lock().map_err(|e| rbd("lock", e))?;
    // Read again under the lock: the last holder may have changed it
    // between the first look and its release.
    let meta = read_meta(&img, name)?;
    let unclean = img
        .metadata_get(HOLDER_KEY)
        .map_err(|e| rbd("read metadata", e))?
        .is_some();
    record_holder(&img, gw)?;
    Ok(Claimed {
        image: img,
        meta,
        unclean,
    })
}

/// Record this gateway as the holder of `img` (locked by it).
fn record_holder(img: &ferry_rbd::Image, gw: &SharedGateway) -> Result<()> {
    let rbd = |e| StorageError::rbd("write metadata", e);
    img.metadata_set(HOLDER_KEY, &gw.address).map_err(rbd)?;
    match &gw.iscsi {
        Some(p) => img.metadata_set(HOLDER_ISCSI_KEY, p).map_err(rbd),
        None => img.metadata_remove(HOLDER_ISCSI_KEY).map_err(rbd),
    }
}

/// Forget the holder of `img` (a clean release).
pub(crate) fn clear_holder(img: &ferry_rbd::Image) -> ferry_rbd::Result<()> {
    img.metadata_remove(HOLDER_ISCSI_KEY)?;
    img.metadata_remove(HOLDER_KEY)
}

/// Prefix of an image being made (`.new-NAME-UNIXSECS-RANDOM`): not a
/// volume name (those never start with a dot), so nothing lists it, and
/// a crash while making it leaves only this, never a half-made image
/// under the volume's own name.
const MAKING_PREFIX: &str = ".new-";

/// How long a half-made image is left alone before it is taken for the
/// debris of a crash: making one takes milliseconds.
const HALF_MADE_AFTER_SECS: u64 = 600;

/// Make a new shared volume's image: created under a temporary name,
/// locked, this gateway recorded as holder and its metadata written, then
/// renamed to the volume's name in one step of the pool's directory. A
/// name that is taken is refused.
pub(crate) fn create(
    store: &CephStore,
    gw: &SharedGateway,
    meta: &VolumeMeta,
) -> Result<ferry_rbd::Image> {
    let rbd = |op, e| StorageError::rbd(op, e);
    let name = &meta.name;
    let tmp = format!(
        "{MAKING_PREFIX}{name}-{}-{}",
        crate::meta::unix_now(),
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    store
        .pool
        .create(&tmp, meta.size)
        .map_err(|e| rbd("create", e))?;
    let made = (|| {
        let img = store.pool.open_unlocked(&tmp).map_err(|e| rbd("open", e))?;
        img.acquire_lock().map_err(|e| rbd("lock", e))?;
        record_holder(&img, gw)?;
        img.metadata_set(META_KEY, &meta_to_json(meta)?)
            .map_err(|e| rbd("write metadata", e))?;
        // Last: until it has its name, it is not a volume; a name that is
        // taken is refused here.
        store.pool.rename(&tmp, name).map_err(|e| match e {
            ferry_rbd::RbdError::Exists { .. } => StorageError::Exists(name.clone()),
            e => rbd("rename", e),
        })?;
        Ok(img)
    })();
    if made.is_err() {
        if let Err(e) = store.pool.remove(&tmp) {
            tracing::warn!(image = %tmp, error = %e, "removing a half-made image failed");
        }
    }
    made
}

/// Remove what crashed makers left: images still under their temporary
/// name ten minutes after they were begun. Returns their names; one that
/// cannot be removed yet (a dead maker's watch lingers for 30 s) is left
/// for the next sweep.
pub(crate) fn remove_half_made(store: &CephStore) -> Result<Vec<String>> {
    let now = crate::meta::unix_now();
    let mut removed = Vec::new();
    for img in store
        .pool
        .list()
        .map_err(|e| StorageError::rbd("list", e))?
    {
        let Some(rest) = img.strip_prefix(MAKING_PREFIX) else {
            continue;
        };
        // NAME-UNIXSECS-RANDOM: the name may hold dashes, the rest not.
        // An image of another shape is not ferry's to remove.
        let mut parts = rest.rsplit('-');
        let random = parts.next().unwrap_or_default();
        let Some(begun) = parts.next().and_then(|t| t.parse::<u64>().ok()) else {
            continue;
        };
        if random.len() != 8 || !random.bytes().all(|b| b.is_ascii_hexdigit()) {
            continue;
        }
        if now < begun + HALF_MADE_AFTER_SECS {
            continue;
        }
        match store.pool.remove(&img) {
            Ok(()) => {
                tracing::info!(image = %img, "removed an image a crash left half made");
                removed.push(img);
            }
            Err(e) => tracing::debug!(image = %img, error = %e, "a half-made image stays for now"),
        }
    }
    Ok(removed)
}

/// The names of the pool's images (ferry volumes or not: those that are
/// not are [`StorageError::NotFound`] to [`peek`] and [`read_meta`]),
/// images being made left out.
pub(crate) fn image_names(store: &CephStore) -> Result<Vec<String>> {
    let all = store
        .pool
        .list()
        .map_err(|e| StorageError::rbd("list", e))?;
    Ok(all
        .into_iter()
        .filter(|n| !n.starts_with(MAKING_PREFIX))
        .collect())
}

/// A shared volume as the cluster has it now, read without claiming it.
#[derive(Debug, Clone)]
pub struct SharedVolume {
    pub meta: VolumeMeta,
    /// The gateway holding it (`None`: released, any gateway may claim it).
    pub holder: Option<String>,
    pub allocated_bytes: u64,
}

/// Read volume `name` from the cluster without claiming it.
pub(crate) fn peek(store: &CephStore, name: &str) -> Result<SharedVolume> {
    let img = open(store, name, true)?;
    let meta = read_meta(&img, name)?;
    let holder = img
        .metadata_get(HOLDER_KEY)
        .map_err(|e| StorageError::rbd("read metadata", e))?;
    Ok(SharedVolume {
        meta,
        holder,
        allocated_bytes: img.allocated_bytes().unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::Backing;

    #[test]
    fn a_bitmap_survives_its_trip_through_image_metadata() {
        let b = crate::DirtyBitmap::new("b", 65536, 1 << 30, true).unwrap();
        b.mark(3 << 20, 4096);
        b.mark(900 << 20, 1 << 20);
        let enc = b.encode();
        let text = encode_bitmap(&enc).unwrap();
        // A mostly clean bitmap is small in the cluster.
        assert!(
            text.len() < enc.len() / 4,
            "{} of {}",
            text.len(),
            enc.len()
        );
        let p = Path::new("rbd:p/i");
        assert_eq!(decode_bitmap(&text, p).unwrap(), enc);
        assert!(matches!(
            decode_bitmap("not base64!", p),
            Err(StorageError::Corrupt { .. })
        ));
        assert!(matches!(
            decode_bitmap("aGVsbG8=", p),
            Err(StorageError::Corrupt { .. })
        ));
    }

    #[test]
    fn metadata_of_another_format_or_version_is_refused() {
        let m = VolumeMeta::new(
            "v",
            1 << 20,
            512,
            Backing::Rbd {
                pool: "p".into(),
                image: "v".into(),
            },
            false,
        );
        let json = meta_to_json(&m).unwrap();
        let p = Path::new("rbd:p/v");
        assert_eq!(VolumeMeta::parse(json.as_bytes(), p).unwrap(), m);
        let other = json.replace("\"version\":1", "\"version\":9");
        assert!(matches!(
            VolumeMeta::parse(other.as_bytes(), p),
            Err(StorageError::Corrupt { .. })
        ));
        assert!(matches!(
            VolumeMeta::parse(b"{", p),
            Err(StorageError::Corrupt { .. })
        ));
    }
}
