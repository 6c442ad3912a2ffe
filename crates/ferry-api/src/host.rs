//! The control API of `ferry host`, the agent on a VM host: which volumes
//! it forwards, from which server, and how often it had to follow them.

use serde::{Deserialize, Serialize};

/// `POST /v1/volumes` on the agent: forward this volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttachRequest {
    pub volume: String,
    /// NBD `HOST:PORT` of the server that holds it now (moves are followed).
    pub server: String,
}

/// A volume the agent forwards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachedVolume {
    pub volume: String,
    /// The server it is forwarded to now.
    pub server: String,
    pub size: u64,
    /// Moves followed to a new server.
    pub switches: u64,
    /// Connections to a server made again (after a move or a lost link).
    pub reconnects: u64,
    /// Requests issued again after a switch or a lost link.
    pub retried: u64,
}
