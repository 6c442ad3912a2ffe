//! What a daemon is and where it listens (`GET /v1/server`).

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerView {
    pub version: String,
    pub pool: PathBuf,
    pub nbd: Option<String>,
    pub admin: Option<String>,
    #[serde(default)]
    pub migration: Option<String>,
    /// iSCSI portals, in portal-group order.
    #[serde(default)]
    pub iscsi: Vec<String>,
    #[serde(default)]
    pub iscsi_base_iqn: String,
    /// SHA-256 of this daemon's migration certificate, once it has one.
    #[serde(default)]
    pub cert_fingerprint: Option<String>,
}
