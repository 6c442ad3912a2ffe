//! Typed QMP commands and answers for everything ferry sends QEMU, named
//! as QEMU's schema names them (qapi/migration.json, qapi/run-state.json,
//! qapi/misc.json): arguments are structs serialized by serde, answers are
//! structs read back, so no caller builds JSON by hand or indexes a
//! `Value` by string. Unknown answer fields are ignored and unknown enum
//! values read as `Unknown`, so a newer QEMU does not break a move.

use crate::client::{QmpClient, QmpError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// `MigrationStatus`: where QEMU's migration stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum MigrationStatus {
    /// No migration ran since QEMU started (also the answer's absent field).
    #[default]
    None,
    Setup,
    Cancelling,
    Cancelled,
    Active,
    PostcopyActive,
    PostcopyPaused,
    PostcopyRecoverSetup,
    PostcopyRecover,
    Completed,
    Failed,
    Colo,
    /// Paused before the switchover (capability `pause-before-switchover`):
    /// QEMU waits for `migrate-continue`.
    PreSwitchover,
    /// Sending the devices' state, the guest stopped.
    Device,
    WaitUnplug,
    /// A status this build does not know.
    #[serde(other)]
    Unknown,
}

impl MigrationStatus {
    /// The name QEMU gives it.
    pub fn as_str(self) -> &'static str {
        match self {
            MigrationStatus::None => "none",
            MigrationStatus::Setup => "setup",
            MigrationStatus::Cancelling => "cancelling",
            MigrationStatus::Cancelled => "cancelled",
            MigrationStatus::Active => "active",
            MigrationStatus::PostcopyActive => "postcopy-active",
            MigrationStatus::PostcopyPaused => "postcopy-paused",
            MigrationStatus::PostcopyRecoverSetup => "postcopy-recover-setup",
            MigrationStatus::PostcopyRecover => "postcopy-recover",
            MigrationStatus::Completed => "completed",
            MigrationStatus::Failed => "failed",
            MigrationStatus::Colo => "colo",
            MigrationStatus::PreSwitchover => "pre-switchover",
            MigrationStatus::Device => "device",
            MigrationStatus::WaitUnplug => "wait-unplug",
            MigrationStatus::Unknown => "unknown",
        }
    }

    /// Pre-copy under way (memory still being sent while the guest runs,
    /// or its last part with the guest stopped).
    pub fn precopy(self) -> bool {
        matches!(
            self,
            MigrationStatus::Setup
                | MigrationStatus::Active
                | MigrationStatus::Device
                | MigrationStatus::WaitUnplug
        )
    }

    pub fn postcopy(self) -> bool {
        matches!(
            self,
            MigrationStatus::PostcopyActive
                | MigrationStatus::PostcopyPaused
                | MigrationStatus::PostcopyRecoverSetup
                | MigrationStatus::PostcopyRecover
        )
    }

    /// Ended one way or the other (QEMU resumes the guest itself after a
    /// failure or a cancel).
    pub fn ended(self) -> bool {
        matches!(
            self,
            MigrationStatus::Completed | MigrationStatus::Failed | MigrationStatus::Cancelled
        )
    }
}

/// `MigrationStats` (the `ram` member of `query-migrate`'s answer).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", default)]
pub struct RamStats {
    pub transferred: u64,
    pub remaining: u64,
    pub total: u64,
    pub duplicate: u64,
    pub normal: u64,
    /// Rounds of the dirty bitmap's synchronization so far.
    pub dirty_sync_count: u64,
    pub dirty_pages_rate: u64,
}

/// `MigrationInfo`: `query-migrate`'s answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", default)]
pub struct MigrationInfo {
    pub status: MigrationStatus,
    pub ram: Option<RamStats>,
    /// The guest's stop time at the switchover (ms), once completed.
    pub downtime: Option<u64>,
    pub total_time: Option<u64>,
    /// auto-converge's current CPU throttle (%).
    pub cpu_throttle_percentage: Option<u64>,
    /// Why it failed.
    pub error_desc: Option<String>,
}

impl MigrationInfo {
    pub fn ram(&self) -> RamStats {
        self.ram.clone().unwrap_or_default()
    }
}

/// `MigrationCapability` names ferry sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Capability {
    AutoConverge,
    PauseBeforeSwitchover,
    Events,
    PostcopyRam,
    Multifd,
    Xbzrle,
}

/// `MigrateSetParameters`: only the members given are sent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub struct MigrateParameters {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub downtime_limit: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bandwidth: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub xbzrle_cache_size: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multifd_channels: Option<u8>,
}

/// `StatusInfo`: `query-status`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct StatusInfo {
    pub running: bool,
    /// `RunState`: `running`, `paused`, `inmigrate`, `postmigrate`, ...
    pub status: String,
}

/// `DirtyRateInfo`: `query-dirty-rate`'s answer.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case", default)]
pub struct DirtyRateInfo {
    /// MiB per second, once measured.
    pub dirty_rate: Option<i64>,
    /// `unstarted`, `measuring` or `measured`.
    pub status: String,
    pub calc_time: u64,
}

impl QmpClient {
    async fn unit(&self, command: &str, arguments: Option<Value>) -> Result<(), QmpError> {
        self.execute_value(command, arguments).await.map(drop)
    }

    /// `query-migrate`.
    pub async fn query_migrate(&self) -> Result<MigrationInfo, QmpError> {
        self.execute("query-migrate", None).await
    }

    /// `migrate` to `uri` (e.g. `unix:/path`).
    pub async fn migrate(&self, uri: &str) -> Result<(), QmpError> {
        self.unit("migrate", Some(json!({ "uri": uri }))).await
    }

    /// `migrate-incoming` from `uri` (QEMU started with `-incoming defer`).
    pub async fn migrate_incoming(&self, uri: &str) -> Result<(), QmpError> {
        self.unit("migrate-incoming", Some(json!({ "uri": uri })))
            .await
    }

    /// `migrate-set-capabilities`.
    pub async fn migrate_set_capabilities(
        &self,
        caps: &[(Capability, bool)],
    ) -> Result<(), QmpError> {
        let caps: Vec<Value> = caps
            .iter()
            .map(|(c, on)| json!({"capability": c, "state": on}))
            .collect();
        self.unit(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": caps })),
        )
        .await
    }

    /// `migrate-set-parameters`.
    pub async fn migrate_set_parameters(&self, p: &MigrateParameters) -> Result<(), QmpError> {
        let args = serde_json::to_value(p).map_err(|e| QmpError::Decode {
            command: "migrate-set-parameters".into(),
            detail: e.to_string(),
        })?;
        self.unit("migrate-set-parameters", Some(args)).await
    }

    /// `migrate-continue` from `pre-switchover`.
    pub async fn migrate_continue(&self) -> Result<(), QmpError> {
        self.unit("migrate-continue", Some(json!({"state": "pre-switchover"})))
            .await
    }

    /// `migrate-start-postcopy`.
    pub async fn migrate_start_postcopy(&self) -> Result<(), QmpError> {
        self.unit("migrate-start-postcopy", None).await
    }

    /// `migrate_cancel`.
    pub async fn migrate_cancel(&self) -> Result<(), QmpError> {
        self.unit("migrate_cancel", None).await
    }

    /// `cont`: run the guest.
    pub async fn cont(&self) -> Result<(), QmpError> {
        self.unit("cont", None).await
    }

    /// `query-status`.
    pub async fn query_status(&self) -> Result<StatusInfo, QmpError> {
        self.execute("query-status", None).await
    }

    /// `system_powerdown`: ask the guest to shut down (ACPI).
    pub async fn system_powerdown(&self) -> Result<(), QmpError> {
        self.unit("system_powerdown", None).await
    }

    /// `quit`: end QEMU.
    pub async fn quit(&self) -> Result<(), QmpError> {
        self.unit("quit", None).await
    }

    /// `calc-dirty-rate` over `calc_time_s`, sampling `sample_pages` per
    /// GiB when given (QEMU 6.1 and later).
    pub async fn calc_dirty_rate(
        &self,
        calc_time_s: u64,
        sample_pages: Option<u64>,
    ) -> Result<(), QmpError> {
        let mut args = json!({ "calc-time": calc_time_s });
        if let Some(n) = sample_pages {
            args["sample-pages"] = json!(n);
        }
        self.unit("calc-dirty-rate", Some(args)).await
    }

    /// `query-dirty-rate`.
    pub async fn query_dirty_rate(&self) -> Result<DirtyRateInfo, QmpError> {
        self.execute("query-dirty-rate", None).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_read_as_qemu_writes_them_and_unknown_values_do_not_break() {
        let v = json!({"status": "pre-switchover", "ram": {"remaining": 4096,
            "dirty-sync-count": 3, "transferred": 10, "mbps": 1.5},
            "cpu-throttle-percentage": 20, "expected-downtime": 300});
        let m: MigrationInfo = serde_json::from_value(v).unwrap();
        assert_eq!(m.status, MigrationStatus::PreSwitchover);
        assert_eq!((m.ram().remaining, m.ram().dirty_sync_count), (4096, 3));
        assert_eq!(m.cpu_throttle_percentage, Some(20));
        let m: MigrationInfo = serde_json::from_value(json!({})).unwrap();
        assert_eq!(m.status, MigrationStatus::None);
        let m: MigrationInfo = serde_json::from_value(json!({"status": "colo-x"})).unwrap();
        assert_eq!(m.status, MigrationStatus::Unknown);
        let failed: MigrationInfo =
            serde_json::from_value(json!({"status": "failed", "error-desc": "boom"})).unwrap();
        assert!(failed.status.ended() && failed.error_desc.as_deref() == Some("boom"));
        assert!(MigrationStatus::Device.precopy() && MigrationStatus::PostcopyPaused.postcopy());
    }

    #[test]
    fn arguments_are_written_as_qemu_names_them() {
        let p = MigrateParameters {
            downtime_limit: Some(300),
            multifd_channels: Some(4),
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            json!({"downtime-limit": 300, "multifd-channels": 4})
        );
        assert_eq!(
            serde_json::to_value(Capability::PauseBeforeSwitchover).unwrap(),
            json!("pause-before-switchover")
        );
    }
}
