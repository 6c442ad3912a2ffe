//! The fingerprint index: its status and rebuilds.

use serde::{Deserialize, Serialize};

/// One volume's share of the index.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VolumeIndexStatus {
    pub volume: String,
    pub entries: u64,
    pub memory_bytes: u64,
    pub volume_size: u64,
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
