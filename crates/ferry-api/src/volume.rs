//! Volumes and their dirty bitmaps as the admin API shows them, and the
//! bodies that create, resize and fill them.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// A size given as a number of bytes or a string such as `"10G"`; the
/// daemon parses the string (binary units: K, M, G, T).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Size {
    Bytes(u64),
    Text(String),
}

impl From<u64> for Size {
    fn from(b: u64) -> Self {
        Size::Bytes(b)
    }
}

impl From<&str> for Size {
    fn from(s: &str) -> Self {
        Size::Text(s.to_string())
    }
}

/// `POST /v1/volumes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CreateVolume {
    pub name: String,
    /// Required unless `path` names an existing file (its size is used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<Size>,
    /// 512 (default) or 4096.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// Physical block size to report when larger than the logical one
    /// (512e: `block_size` 512 with 4096 here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub physical_block_size: Option<u32>,
    #[serde(default)]
    pub preallocate: bool,
    /// An existing file or device outside the pool to serve (never deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    #[serde(default)]
    pub read_only: bool,
    /// Data in an RBD image of the daemon's Ceph pool (true) or in a file
    /// (false); absent: the daemon's default (`storage.ceph.default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceph: Option<bool>,
}

/// `POST /v1/volumes/{name}/resize`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ResizeVolume {
    pub size: Size,
    #[serde(default)]
    pub allow_shrink: bool,
}

/// `POST /v1/volumes/{name}/bitmaps`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BitmapRequest {
    pub name: String,
    #[serde(default = "default_granularity")]
    pub granularity: u32,
    #[serde(default)]
    pub persistent: bool,
}

fn default_granularity() -> u32 {
    65536
}

/// Where a volume's bytes live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Backing {
    /// A sparse raw file in the pool.
    Sparse,
    /// A raw file in the pool with every block allocated.
    Preallocated,
    /// A file or device outside the pool.
    External { path: PathBuf },
    /// An RBD image in a Ceph pool.
    Rbd { pool: String, image: String },
}

/// An unfinished (`incoming`) or finished (`arrived`) incoming migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncomingMigration {
    pub id: String,
    /// The source's address.
    pub source: String,
    /// When the copy was begun (Unix seconds; 0 if not known).
    #[serde(default)]
    pub started_unix: u64,
    /// When a migration last began or stopped filling it (Unix seconds).
    #[serde(default)]
    pub touched_unix: u64,
}

/// `GET /v1/volumes/{name}/arrival?migration=ID&wait_ms=N`: whether
/// migration `ID` has committed its copy of the volume at this daemon
/// (the daemon waits up to `N` ms for it), and where the volume's clients
/// go now. A teleport's destination host asks it of its own site's daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrivalView {
    pub volume: String,
    pub migration: String,
    pub arrived: bool,
    /// NBD `HOST:PORT`, as the commit told the source (after a restart
    /// since, as the daemon advertises it). `None` before the commit, or
    /// when the address would have come from the migration's connection.
    #[serde(default)]
    pub location: Option<String>,
    /// The admin API the volume's next move starts at (`None`: not
    /// advertised, or not known as for `location`).
    #[serde(default)]
    pub admin: Option<String>,
}

/// The journal of an outgoing migration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutgoingMigration {
    pub id: String,
    /// The destination's migration listener.
    pub to: String,
}

/// A dirty bitmap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BitmapView {
    pub name: String,
    pub granularity: u32,
    pub persistent: bool,
    pub dirty_bytes: u64,
    pub dirty_chunks: u64,
}

/// A volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeView {
    pub name: String,
    pub size: u64,
    /// Logical block size presented to clients.
    pub block_size: u32,
    /// Physical block size reported to clients (equal to `block_size`
    /// unless the volume is 512e).
    #[serde(default)]
    pub physical_block_size: u32,
    pub uuid: String,
    /// NAA identifier (`naa.3…`) that a migrated copy keeps.
    pub wwn: String,
    pub created_unix: u64,
    pub backing: Backing,
    #[serde(default)]
    pub read_only: bool,
    pub allocated_bytes: u64,
    pub data_path: PathBuf,
    #[serde(default)]
    pub direct_io: bool,
    #[serde(default)]
    pub dirty_bitmaps: Vec<BitmapView>,
    /// Set after the volume migrated away: the NBD `HOST:PORT` it lives at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_to: Option<String>,
    /// With `moved_to`: the admin API `HOST:PORT` of the daemon it went to,
    /// if that daemon advertised one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_admin: Option<String>,
    /// An image import began and has not finished: the content is partial
    /// and the volume is not exported until an import completes.
    #[serde(default)]
    pub importing: bool,
    /// A migration of this volume away began and has not switched; the
    /// same migration started again resumes under this id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outgoing: Option<OutgoingMigration>,
    /// Set while this is the unfinished copy of an incoming migration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incoming: Option<IncomingMigration>,
    /// The migration that brought it here, once complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrived: Option<IncomingMigration>,
    /// A sanitize running or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sanitize: Option<SanitizeView>,
    /// A shared volume: its state lives in its Ceph cluster and any of
    /// the gateways in front of the cluster serves it, one at a time
    /// (`[storage.ceph] shared`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
    /// A shared volume's gateway now (NBD `HOST:PORT`), this one or
    /// another; `None` when no gateway holds it (the first asked claims it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// A shared volume held by the daemon that answered.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub held_here: bool,
}

/// A sanitize of a volume, running or failed (the volume refuses reads
/// and writes meanwhile).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum SanitizeView {
    Running {
        /// `overwrite` or `block_erase`.
        op: String,
        done_bytes: u64,
        total_bytes: u64,
    },
    Failed {
        op: String,
        error: String,
    },
}

/// The answer to `PUT /v1/volumes/{name}/data`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportReport {
    pub bytes: u64,
    pub written: u64,
    pub zeroed: u64,
}
