//! The fingerprint index: its status and rebuilds.

use serde::{Deserialize, Serialize};

/// One volume's share of the index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeIndexStatus {
    pub volume: String,
    pub entries: u64,
    pub memory_bytes: u64,
    pub volume_size: u64,
    /// Its prints in block order are complete: a migration from here
    /// prints what was not written since without reading it.
    #[serde(default)]
    pub prints: bool,
}

/// `GET /v1/index`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexStatus {
    pub block_size: u32,
    pub entries: u64,
    /// RAM held by the index (fences and bookkeeping).
    pub memory_bytes: u64,
    pub memory_bytes_per_entry: f64,
    pub disk_bytes: u64,
    pub lookups: u64,
    /// Lookups that returned at least one candidate.
    pub hits: u64,
    pub volumes: Vec<VolumeIndexStatus>,
}

/// `POST /v1/index/rebuild`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RebuildRequest {
    /// One volume; all volumes when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<String>,
}

/// One volume's rebuild result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RebuildReport {
    pub volume: String,
    pub bytes: u64,
    pub read_bytes: u64,
    pub blocks: u64,
    pub zero_blocks: u64,
    pub seconds: f64,
    pub mb_per_s: f64,
}

/// `POST /v1/volumes/{name}/sample`: fingerprints of `blocks` of the
/// volume's index-sized blocks, in runs of 8 neighbouring blocks spread
/// evenly over it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SampleRequest {
    /// 1 to 4096.
    pub blocks: u64,
}

/// A sample of a volume's blocks: how many were all zeroes (never sent by
/// a migration), and the BLAKE3 fingerprint (hex) of each other one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeSample {
    pub block_size: u32,
    pub volume_size: u64,
    pub sampled: u64,
    pub zero: u64,
    pub fingerprints: Vec<String>,
    /// The sampled non-zero blocks compressed together as a migration's
    /// data stream compresses (zstd level 3, long-distance matching, a
    /// piece flushed after each run), in bytes: with the count of non-zero
    /// blocks, how well the disk's data compresses on the link.
    #[serde(default)]
    pub nonzero_compressed: u64,
    /// Each non-zero block's share of what its run adds to that stream
    /// (split as each block adds to a stream flushed after every block),
    /// in bytes (at most the block size), in the order of `fingerprints`:
    /// with a lookup's `missing`, what the blocks a site lacks cost on the
    /// link (the data a volume's return sends compresses unlike the rest).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compressed: Vec<u32>,
    /// The volume's identity (its UUID, 32 hex digits): with a lookup's
    /// `copy_of`, whether a site holds the copy this volume left there;
    /// absent from daemons before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// When the volume arrived here by a migration and this daemon tracked
    /// every block written since: what a return to the copy it left there
    /// would print and send.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_arrival: Option<Box<WrittenSinceArrival>>,
    /// How long this daemon's recent switches as a migration's source held
    /// their volume's writes besides the link's round trip (seconds, the
    /// median of the last eight): a disk move's pause from here is this
    /// and one round trip. Absent before the first such switch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub switch_hold_s: Option<f64>,
    /// Those holds themselves (seconds besides the link's round trip,
    /// oldest first, the last eight), from the first: the placement
    /// model weighs a few of them against its constant. Empty before the
    /// first such switch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub switch_holds_s: Vec<f64>,
    /// What this daemon's recent small moves as a migration's source
    /// (one connection, a first pass of at most 4 MiB straight to the
    /// pause) took besides their round trips and pause (seconds, oldest
    /// first, the last eight): a disk move's fixed work from here.
    /// Empty before the first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub move_setups_s: Vec<f64>,
}

/// The blocks written to a volume since it arrived by a migration: a
/// return to the daemon it came from (which kept the copy it left) prints
/// only these, and sends those of them that daemon lacks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WrittenSinceArrival {
    /// The migration the volume arrived by (32 hex digits): a lookup's
    /// `copy_of.arrived_under`.
    pub arrived_under: String,
    /// Blocks written since (of the sample's block size).
    pub blocks: u64,
    /// Those blocks sampled (all of them when there are no more than the
    /// request's `blocks`, else evenly spaced runs of neighbours) and
    /// priced as the volume's own sample is; its `volume_size` and `uuid`
    /// are left out.
    pub sample: VolumeSample,
}

/// `POST /v1/index/lookup`: which of these fingerprints (hex, at most
/// 4096) the daemon's index holds a block for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupRequest {
    pub fingerprints: Vec<String>,
    /// Also ask whether the daemon holds the copy this volume left when it
    /// moved away (a volume's return uses that copy as its basis and
    /// rebuilds nothing from the index).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_of: Option<VolumeIdentity>,
}

/// A volume as a daemon other than its own knows it: its name and UUID
/// (32 hex digits).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeIdentity {
    pub name: String,
    pub uuid: String,
    /// The migration the volume arrived where it is by
    /// ([`WrittenSinceArrival::arrived_under`]): whether the copy the
    /// daemon holds is the one it left by that migration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrived_under: Option<String>,
}

/// How many were asked and how many the index has a candidate block for
/// (a candidate is verified only when a migration uses it: a rare key
/// collision counts as found here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LookupAnswer {
    pub asked: u64,
    pub found: u64,
    /// The positions (in the request) of the fingerprints not found;
    /// absent from daemons before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub missing: Option<Vec<u32>>,
    /// The daemon holds the copy the volume of the request's `copy_of`
    /// left when it moved away (same name and UUID, not being filled).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub holds_copy: bool,
    /// That copy is the one the volume left by the migration `copy_of`'s
    /// `arrived_under` names, unchanged since: a return there prints only
    /// the blocks written since the volume arrived where it is.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub copy_tracked: bool,
    /// A volume a migration brings here shares the extents of the blocks
    /// the daemon finds in its other volumes instead of writing them (its
    /// pool's file system shares extents): what it holds costs only a
    /// read to rebuild.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shares_extents: bool,
    /// Bytes per second this daemon rebuilt, into the copies its recent
    /// incoming migrations brought, from blocks it already held: what a
    /// move here costs per byte it need not send. Absent before such a
    /// migration (and from daemons before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild_bps: Option<f64>,
}
