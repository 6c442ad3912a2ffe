//! Volume metadata and its atomic persistence (write temp, fsync, rename,
//! fsync the directory), so a crash leaves either the old or the new file.
//!
//! The file is JSON with a `format` tag and a `version`, read with a size
//! limit; unknown formats or versions are refused, never guessed at.

use crate::{Result, StorageError};
use serde::{Deserialize, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use uuid::Uuid;

pub const META_FORMAT: &str = "ferry-volume";
pub const META_VERSION: u32 = 1;
const MAX_META_LEN: u64 = 1 << 20;

/// Where a volume's bytes live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Backing {
    /// A sparse raw file in the pool: blocks are allocated on first write.
    Sparse,
    /// A raw file in the pool with every block allocated at creation.
    Preallocated,
    /// An existing file or block device outside the pool (never deleted by ferry).
    External { path: PathBuf },
    /// An RBD image in the Ceph pool the daemon is configured with
    /// (`[storage.ceph]`), thin, deleted with the volume.
    Rbd { pool: String, image: String },
}

/// A persistent dirty bitmap recorded in the metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BitmapSpec {
    pub name: String,
    pub granularity: u32,
}

/// The other site of a volume's current or last migration, as its daemon
/// described the way it exports the volume to SCSI initiators: the portal
/// they are sent to (`HOST:PORT`, "" if none was advertised) and the
/// target port group of its portals. The storage layer only keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerPort {
    pub portal: String,
    pub port_group: u16,
}

/// Everything ferry knows about a volume besides its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMeta {
    pub format: String,
    pub version: u32,
    pub name: String,
    pub size: u64,
    /// Logical block size presented to clients: 512 or 4096.
    pub block_size: u32,
    /// Physical block size reported to clients, when larger than the
    /// logical one (512e: 512-byte blocks on 4 KiB physical blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physical_block_size: Option<u32>,
    pub uuid: Uuid,
    /// NAA identifier (`naa.` + 16 hex digits), kept by migrated copies so
    /// multipath sees one device.
    pub wwn: String,
    pub created_unix: u64,
    pub backing: Backing,
    #[serde(default)]
    pub read_only: bool,
    #[serde(default)]
    pub bitmaps: Vec<BitmapSpec>,
    /// Set on a migration source after the switch: where the volume lives now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_to: Option<String>,
    /// With `moved_to`: the admin API of the daemon the volume went to, if
    /// it advertised one (where the volume's next migration starts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_admin: Option<String>,
    /// With `moved_to`: the migration the volume left by. The copy has not
    /// changed since (nothing writes a moved-away copy), so a return from
    /// the daemon that volume arrived at by this migration, which tracked
    /// what was written there since, need only send that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub left_under: Option<String>,
    /// The other site of the volume's current or last migration (the
    /// destination on a source, the source on a copy that arrived).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_port: Option<PeerPort>,
    /// Set on a migration destination until the copy is complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incoming: Option<IncomingMigration>,
    /// The migration that brought this volume here, once it completed (a
    /// source that lost the link at the switch asks about it again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrived: Option<IncomingMigration>,
    /// An image import began and has not finished: the content is partial,
    /// so the volume is not exported until an import completes.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub importing: bool,
    /// A migration of this volume to another daemon began and has not
    /// switched: its id, so that the same migration started again (after a
    /// crash or restart of this daemon) resumes into the destination's copy
    /// instead of starting over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outgoing: Option<OutgoingMigration>,
    /// A sanitize was requested and has not finished (it resumes when the
    /// volume is opened again), or failed (`failed` set: I/O is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sanitize: Option<crate::SanitizeJob>,
}

/// The journal of an outgoing migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutgoingMigration {
    /// Migration id (32 hex digits).
    pub id: String,
    /// The destination's migration listener.
    pub to: String,
    /// Set just before the guest is paused for the switch: from here the
    /// destination may have committed without this daemon learning it, so
    /// after a crash the volume is held (not served, not writable) until
    /// the destination is asked (the same migration started again).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub switch_sent: bool,
    /// The migration ran without TLS (loopback only), as its resumption
    /// must.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub plaintext: bool,
}

/// An unfinished incoming migration: the copy is incomplete and not exported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingMigration {
    /// Migration id (32 hex digits).
    pub id: String,
    /// Peer address or certificate name of the source, for operators.
    pub source: String,
    /// When the copy was begun (Unix seconds; 0 in metadata written
    /// before it was kept).
    #[serde(default)]
    pub started_unix: u64,
    /// When a migration last connected to fill it or left it (Unix
    /// seconds): a copy nothing has touched for `migration.incomplete_ttl_secs`
    /// is deleted by the daemon.
    #[serde(default)]
    pub touched_unix: u64,
    /// The copy is the basis of a tracked return: the copy the volume
    /// left by this migration (the one it arrived at the source by), and
    /// nothing but the return (`id`) has written it since. Another attempt
    /// of that return resumes it as tracked; another migration, or a
    /// digest that did not match, takes it away.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracked_since: Option<String>,
}

impl IncomingMigration {
    /// A copy begun now by migration `id` from `source`.
    pub fn begun(id: &str, source: &str) -> Self {
        let now = crate::meta::unix_now();
        IncomingMigration {
            id: id.to_string(),
            source: source.to_string(),
            started_unix: now,
            touched_unix: now,
            tracked_since: None,
        }
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl VolumeMeta {
    pub fn new(name: &str, size: u64, block_size: u32, backing: Backing, read_only: bool) -> Self {
        let uuid = Uuid::new_v4();
        VolumeMeta {
            format: META_FORMAT.into(),
            version: META_VERSION,
            name: name.into(),
            size,
            block_size,
            physical_block_size: None,
            uuid,
            wwn: naa_from_uuid(&uuid),
            created_unix: unix_now(),
            backing,
            read_only,
            bitmaps: Vec::new(),
            moved_to: None,
            moved_admin: None,
            left_under: None,
            peer_port: None,
            incoming: None,
            arrived: None,
            importing: false,
            outgoing: None,
            sanitize: None,
        }
    }

    /// Write atomically to `path`.
    pub fn store(&self, path: &Path) -> Result<()> {
        let json =
            serde_json::to_vec_pretty(self).map_err(|e| StorageError::Invalid(e.to_string()))?;
        write_atomic(path, &json)
    }

    /// Read and check `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let f = File::open(path).map_err(|e| StorageError::io("open", path, e))?;
        let mut buf = Vec::new();
        f.take(MAX_META_LEN + 1)
            .read_to_end(&mut buf)
            .map_err(|e| StorageError::io("read", path, e))?;
        let corrupt = |detail: String| StorageError::Corrupt {
            what: "volume metadata",
            path: path.to_path_buf(),
            detail,
        };
        if buf.len() as u64 > MAX_META_LEN {
            return Err(corrupt("file larger than 1 MiB".into()));
        }
        Self::parse(&buf, path)
    }

    /// Parse and check metadata read from `path` (a file, or an image's
    /// metadata: `rbd:POOL/IMAGE`).
    pub(crate) fn parse(bytes: &[u8], path: &Path) -> Result<Self> {
        let corrupt = |detail: String| StorageError::Corrupt {
            what: "volume metadata",
            path: path.to_path_buf(),
            detail,
        };
        let m: VolumeMeta = serde_json::from_slice(bytes).map_err(|e| corrupt(e.to_string()))?;
        if m.format != META_FORMAT || m.version != META_VERSION {
            return Err(corrupt(format!(
                "unsupported format {} version {}",
                m.format, m.version
            )));
        }
        Ok(m)
    }
}

/// NAA type 3 (locally assigned) identifier from 60 bits of the UUID.
pub fn naa_from_uuid(u: &Uuid) -> String {
    let b = u.as_bytes();
    let v = u64::from_be_bytes(b[..8].try_into().expect("8 bytes"));
    format!("naa.{:016x}", (3u64 << 60) | (v & ((1u64 << 60) - 1)))
}

/// Write `data` to `path` so that a crash leaves the old or the new content.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(|e| StorageError::io("create", &tmp, e))?;
        f.write_all(data)
            .map_err(|e| StorageError::io("write", &tmp, e))?;
        f.sync_all()
            .map_err(|e| StorageError::io("fsync", &tmp, e))?;
    }
    fs::rename(&tmp, path).map_err(|e| StorageError::io("rename", path, e))?;
    sync_dir(dir)
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StorageError::io("fsync dir", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("meta.json");
        let m = VolumeMeta::new("v", 1 << 30, 512, Backing::Sparse, false);
        assert!(m.wwn.starts_with("naa.3"));
        assert_eq!(m.wwn.len(), 20);
        m.store(&p).unwrap();
        assert_eq!(VolumeMeta::load(&p).unwrap(), m);
        let mut other = m.clone();
        other.version = 99;
        other.store(&p).unwrap();
        assert!(VolumeMeta::load(&p).is_err());
        std::fs::write(&p, b"{not json").unwrap();
        assert!(VolumeMeta::load(&p).is_err());
    }
}
