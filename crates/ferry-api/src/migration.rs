//! Migrations as the source daemon's admin API shows them: the request
//! that starts one, the live status, and the final report.
//!
//! A caller may name the migration ([`MigrateRequest::id`]): posting the
//! same id again for the same volume and destination answers the migration
//! already running (or finished) instead of starting another, so a caller
//! that lost the answer can simply retry. The same id for a different
//! volume or destination is a conflict (409).
//!
//! With [`MigrateRequest::hold_switch`] the migration converges, then waits
//! in [`MigrationPhase::ReadyToSwitch`] (still sending what the guest
//! dirties) until `POST /v1/migrations/{id}/switch` tells it to pause the
//! guest's writes and switch. A VM move lines the disk's switch up with the
//! hypervisor's stop-and-copy this way.

use crate::volume::Size;
use serde::{Deserialize, Serialize};
use std::fmt;

/// A migration's id: 32 lowercase hex digits (a UUID in its simple form).
/// Parsing accepts any UUID spelling and normalises it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MigrationId(String);

/// A string that is not a UUID in any spelling.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("migration id {0:?} is not a UUID (32 hex digits, with or without dashes)")]
pub struct BadMigrationId(pub String);

impl MigrationId {
    /// A fresh random id.
    pub fn random() -> Self {
        MigrationId(uuid::Uuid::new_v4().simple().to_string())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The 16 bytes the migration protocol carries.
    pub fn bytes(&self) -> [u8; 16] {
        uuid::Uuid::parse_str(&self.0).map_or([0; 16], |u| *u.as_bytes())
    }

    /// The id carried by 16 protocol bytes.
    pub fn from_bytes(b: [u8; 16]) -> Self {
        MigrationId(uuid::Uuid::from_bytes(b).simple().to_string())
    }
}

impl TryFrom<String> for MigrationId {
    type Error = BadMigrationId;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        match uuid::Uuid::parse_str(&s) {
            Ok(u) if !u.is_nil() => Ok(MigrationId(u.simple().to_string())),
            _ => Err(BadMigrationId(s)),
        }
    }
}

impl std::str::FromStr for MigrationId {
    type Err = BadMigrationId;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        MigrationId::try_from(s.to_string())
    }
}

impl From<MigrationId> for String {
    fn from(id: MigrationId) -> String {
        id.0
    }
}

impl fmt::Display for MigrationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `POST /v1/volumes/{name}/migrate`: what to migrate where, and how.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrateRequest {
    /// `HOST:PORT` of the destination's migration listener.
    pub to: String,
    /// The caller's name for this migration (idempotent retries).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<MigrationId>,
    /// No TLS: only allowed when both ends are on loopback.
    #[serde(default)]
    pub plaintext: bool,
    /// Target for the final pause, in milliseconds (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_downtime_ms: Option<u64>,
    /// Link cap, bytes per second or a size per second ("12M").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bwlimit: Option<Size>,
    /// Dirty rounds before pausing anyway (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rounds: Option<u32>,
    /// false: send every non-zero chunk (the full-copy baseline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dedup: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<bool>,
    /// Keep resuming after link failures this long (default 60 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_for_s: Option<u64>,
    /// Converge, then wait in `ready_to_switch` for
    /// `POST /v1/migrations/{id}/switch` before pausing the guest.
    #[serde(default)]
    pub hold_switch: bool,
}

/// Where a migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationPhase {
    Connecting,
    Fingerprints,
    Rounds,
    /// Converged and holding before the switch (only with `hold_switch`).
    ReadyToSwitch,
    Paused,
    Switched,
    Failed,
}

impl MigrationPhase {
    /// It has ended, one way or the other.
    pub fn is_terminal(self) -> bool {
        matches!(self, MigrationPhase::Switched | MigrationPhase::Failed)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            MigrationPhase::Connecting => "connecting",
            MigrationPhase::Fingerprints => "fingerprints",
            MigrationPhase::Rounds => "rounds",
            MigrationPhase::ReadyToSwitch => "ready_to_switch",
            MigrationPhase::Paused => "paused",
            MigrationPhase::Switched => "switched",
            MigrationPhase::Failed => "failed",
        }
    }
}

impl fmt::Display for MigrationPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a migration ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MigrationResult {
    Switched,
    Failed,
}

/// `GET /v1/migrations/{id}`, and each line of `/events`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigrationStatus {
    pub id: MigrationId,
    pub volume: String,
    pub to: String,
    pub phase: MigrationPhase,
    pub elapsed_s: f64,
    pub chunks_total: u64,
    pub chunks_printed: u64,
    pub chunks_sent: u64,
    pub chunks_wanted: u64,
    /// Share of the chunks the destination rebuilt without the link.
    pub rebuilt_share: f64,
    pub round: u64,
    pub dirty_bytes: u64,
    pub wire_tx_bytes: u64,
    pub wire_rx_bytes: u64,
    pub throttle_us: u64,
    pub attempts: u64,
    /// Started with `hold_switch`.
    #[serde(default)]
    pub hold_switch: bool,
    /// The switch was released (`POST .../switch`), or never held.
    #[serde(default)]
    pub switch_released: bool,
    pub error: Option<String>,
    pub report: Option<Report>,
}

/// The final account of a migration (`ferry migrate --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub id: MigrationId,
    pub volume: String,
    pub to: String,
    pub result: MigrationResult,
    pub error: Option<String>,
    pub new_location: Option<String>,
    /// The destination's admin API, if it advertised one: where the
    /// volume's next migration starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_admin: Option<String>,
    pub size: u64,
    pub chunk_size: u32,
    pub dedup: bool,
    pub compress: bool,
    pub tls: bool,
    pub bytes: ReportBytes,
    pub chunks: ReportChunks,
    pub time: ReportTime,
    pub rounds: u64,
    pub converged: bool,
    pub auto_converge: ReportThrottle,
    pub attempts: u64,
    pub digest: ReportDigest,
    /// What the destination filled (its answer to the last attempt).
    #[serde(default)]
    pub destination_copy: DestinationCopy,
}

/// What a destination filled: a copy of its own making, or an incomplete
/// one it already held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DestinationCopy {
    /// A copy created for this migration (or no answer yet).
    #[default]
    New,
    /// The incomplete copy an earlier attempt of this migration left.
    Resumed,
    /// The incomplete copy a failed migration of the same volume left:
    /// resumed, the chunks that still matched kept.
    LeftoverResumed,
    /// Such a leftover, replaced because the volume's size or block size
    /// had changed since.
    LeftoverReplaced,
    /// The copy the destination kept when the volume left it (the volume
    /// comes back): only what changed since crossed.
    Returned,
    /// That copy, with the source having tracked every chunk written since
    /// the volume arrived there: only those chunks' prints crossed.
    ReturnedTracked,
}

impl DestinationCopy {
    pub fn describe(self) -> &'static str {
        match self {
            DestinationCopy::New => "a new copy",
            DestinationCopy::Resumed => "its copy from an earlier attempt, resumed",
            DestinationCopy::Returned => {
                "the copy it kept when the volume left it, updated with what changed since"
            }
            DestinationCopy::ReturnedTracked => {
                "the copy it kept when the volume left it, sent only what was written since"
            }
            DestinationCopy::LeftoverResumed => {
                "the incomplete copy a failed migration of this volume left, resumed"
            }
            DestinationCopy::LeftoverReplaced => {
                "the incomplete copy a failed migration of this volume left, replaced (the size had changed)"
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportBytes {
    /// Frame bytes of `Prints` (fingerprints and zero runs).
    pub fingerprints: u64,
    /// Frame bytes of `Data` (after compression).
    pub data: u64,
    /// Raw bytes those `Data` frames carried.
    pub data_raw: u64,
    /// Every other frame, both directions.
    pub protocol: u64,
    /// Bytes that crossed the socket, TLS included: sent / received.
    pub wire_tx: u64,
    pub wire_rx: u64,
    /// Frame bytes sent by attempts that failed before a resume.
    pub resent_after_failures: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportChunks {
    pub total: u64,
    pub zero: u64,
    pub local: u64,
    pub buddy: u64,
    /// Already in place at the destination from an earlier attempt.
    pub resumed: u64,
    /// Sent because the destination could not rebuild them.
    pub sent: u64,
    /// Sent again because the guest wrote them during the migration.
    pub dirty_resent: u64,
    /// Sent as data without a print, once the destination was found to
    /// hold almost none of the volume's blocks (counted in `sent` too).
    #[serde(default)]
    pub unprinted: u64,
    /// Not written since the volume arrived at the source, and so still
    /// in the copy the destination kept when it left there: neither
    /// printed nor sent (`destination_copy: returned_tracked`).
    #[serde(default)]
    pub unchanged: u64,
    /// Printed from the source's index (its prints of blocks not written
    /// since they were hashed) without being read there.
    #[serde(default)]
    pub unread: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportTime {
    pub total_s: f64,
    pub fingerprints_s: f64,
    pub rounds_s: f64,
    /// Time held in `ready_to_switch` waiting for the caller (hold_switch).
    #[serde(default)]
    pub held_s: f64,
    pub pause_ms: f64,
    /// The slowest write, zeroing, trim or flush the volume's clients made
    /// at the source during the migration (its time in the storage engine:
    /// the pause's hold, auto-converge delays, a flush slowed by writeback
    /// included; not the network to the client). 0 from daemons before it.
    #[serde(default)]
    pub slowest_write_ms: f64,
    /// The link's round trip as the source timed it (the fastest answer
    /// to its `Ping`s, protocol version 9); absent when none came back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_rtt_ms: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportThrottle {
    /// The longest auto-converge delay a write at the source slept during
    /// the migration (not the largest set: a throttle raised just before
    /// the pause may delay no write).
    pub max_delay_us: u64,
    /// Writes that slept for it.
    pub writes_delayed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportDigest {
    pub source: String,
    pub destination: String,
    pub matches: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_normalise_and_refuse() {
        let a: MigrationId = "6F9619FF-8B86-D011-B42D-00C04FC964FF".parse().unwrap();
        assert_eq!(a.as_str(), "6f9619ff8b86d011b42d00c04fc964ff");
        assert_eq!(MigrationId::from_bytes(a.bytes()), a);
        assert!("not-an-id".parse::<MigrationId>().is_err());
        assert!("00000000000000000000000000000000"
            .parse::<MigrationId>()
            .is_err());
        let j = serde_json::to_string(&a).unwrap();
        assert_eq!(j, "\"6f9619ff8b86d011b42d00c04fc964ff\"");
        assert!(serde_json::from_str::<MigrationId>("\"xyz\"").is_err());
    }

    #[test]
    fn request_refuses_unknown_fields_and_phases_round_trip() {
        let r: MigrateRequest =
            serde_json::from_str(r#"{"to":"h:1","bwlimit":"12M","hold_switch":true}"#).unwrap();
        assert_eq!(r.bwlimit, Some(Size::Text("12M".into())));
        assert!(r.hold_switch);
        assert!(serde_json::from_str::<MigrateRequest>(r#"{"to":"h:1","tо":1}"#).is_err());
        for p in [
            MigrationPhase::Connecting,
            MigrationPhase::Fingerprints,
            MigrationPhase::Rounds,
            MigrationPhase::ReadyToSwitch,
            MigrationPhase::Paused,
            MigrationPhase::Switched,
            MigrationPhase::Failed,
        ] {
            let j = serde_json::to_string(&p).unwrap();
            assert_eq!(j, format!("\"{}\"", p.as_str()));
            assert_eq!(serde_json::from_str::<MigrationPhase>(&j).unwrap(), p);
        }
        assert!(serde_json::from_str::<MigrationPhase>("\"teleported\"").is_err());
    }
}
