//! A pool volume seen as a SCSI block device, and the per-volume logical
//! units shared by every session and portal.

use ferry_scsi::{
    AccessState, BlockDevice, CopyTargets, DeviceError, Identity, LogicalUnit, LuConfig,
    PortGroups, ReservationStore, SanitizeAction, SanitizeState, SanitizeSupport,
};
use ferry_storage::{Pool, SanitizeOp, SanitizeStatus, StorageError, Volume, ZeroMode};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// Adapter from [`Volume`] to [`BlockDevice`]: every write goes through
/// the volume's write path, so it passes the migration write gate and marks
/// every dirty bitmap exactly as an NBD write does.
pub struct VolumeDevice {
    pub volume: Arc<Volume>,
    /// Most bytes per second a sanitize writes (`storage.sanitize_bytes_per_sec`).
    pub sanitize_rate: u64,
}

/// Carry out `volume`'s journaled sanitize on a thread of its own (it
/// takes as long as writing the whole volume, and outlives the command and
/// the connection that asked for it).
pub fn run_sanitize(
    volume: Arc<Volume>,
    bytes_per_sec: u64,
) -> std::thread::JoinHandle<Result<(), StorageError>> {
    std::thread::Builder::new()
        .name("ferry-sanitize".into())
        .spawn(move || volume.run_sanitize(bytes_per_sec))
        .expect("spawn the sanitize thread")
}

fn dev_err(e: StorageError) -> DeviceError {
    match e {
        StorageError::OutOfRange { .. } => DeviceError::OutOfRange,
        StorageError::ReadOnly(_) => DeviceError::ReadOnly,
        StorageError::NotFound(n) => DeviceError::Gone(format!("volume {n} was deleted")),
        StorageError::Moved { to, .. } => DeviceError::Gone(format!("moved to {to}")),
        // Its group reports "transitioning" meanwhile (see port_groups).
        StorageError::InDoubt { to, .. } => {
            DeviceError::Transitioning(format!("held until its migration to {to} is resolved"))
        }
        StorageError::Sanitizing(_) => DeviceError::Sanitizing,
        StorageError::SanitizeFailed(_) => DeviceError::SanitizeFailed,
        e => match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => DeviceError::NoSpace,
            // The cluster fenced this gateway (EBLOCKLISTED): the
            // initiator retries, and finds the volume where it went.
            Some(libc::ESHUTDOWN) => DeviceError::Transitioning(
                "this gateway was fenced by the cluster; another serves the volume".into(),
            ),
            _ => DeviceError::Io(e.to_string()),
        },
    }
}

impl BlockDevice for VolumeDevice {
    fn size(&self) -> u64 {
        self.volume.size()
    }
    fn read_only(&self) -> bool {
        self.volume.read_only()
    }
    fn thin(&self) -> bool {
        self.volume.is_sparse()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.volume.read_at(offset, buf).map_err(dev_err)
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.volume.write_at(offset, data, fua).map_err(dev_err)
    }
    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        unmap: bool,
        fua: bool,
    ) -> Result<(), DeviceError> {
        let mode = ZeroMode {
            may_punch: unmap,
            fast_only: false,
        };
        self.volume
            .write_zeroes(offset, len, mode, fua)
            .map_err(dev_err)
    }
    fn unmap(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.volume.trim(offset, len, false).map_err(dev_err)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.volume.flush().map_err(dev_err)
    }
    fn prefetch(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.volume.cache(offset, len).map_err(dev_err)
    }
    fn try_read_nowait(&self, offset: u64, len: usize) -> Result<Option<Vec<u8>>, DeviceError> {
        let mut buf = bytes::BytesMut::new();
        match self.volume.read_append(offset, len, &mut buf, true) {
            Ok(true) => Ok(Some(buf.into())),
            Ok(false) => Ok(None),
            Err(e) => Err(dev_err(e)),
        }
    }
    fn writes_may_wait(&self) -> bool {
        let g = self.volume.gate();
        g.is_paused() || !g.throttle().is_zero()
    }
    fn sanitize_support(&self) -> SanitizeSupport {
        SanitizeSupport {
            overwrite: true,
            // BLOCK ERASE deallocates: thin volumes only (LBPME).
            block_erase: self.volume.is_sparse(),
        }
    }
    fn sanitize(&self, action: SanitizeAction, ause: bool, wait: bool) -> Result<(), DeviceError> {
        let op = match action {
            SanitizeAction::Overwrite {
                pattern,
                invert,
                passes,
            } => SanitizeOp::Overwrite {
                pattern,
                invert,
                passes,
            },
            SanitizeAction::BlockErase => SanitizeOp::BlockErase,
        };
        self.volume.begin_sanitize(op, ause).map_err(dev_err)?;
        let runner = run_sanitize(self.volume.clone(), self.sanitize_rate);
        if !wait {
            return Ok(());
        }
        match runner.join() {
            Ok(r) => r.map_err(dev_err),
            Err(_) => Err(DeviceError::SanitizeFailed),
        }
    }
    fn sanitize_state(&self) -> SanitizeState {
        match self.volume.sanitize_status() {
            SanitizeStatus::Idle => SanitizeState::Idle,
            SanitizeStatus::Running { done, total } => {
                let p = (u128::from(done) << 16) / u128::from(total.max(1));
                SanitizeState::Running {
                    progress: u16::try_from(p).unwrap_or(u16::MAX),
                }
            }
            SanitizeStatus::Failed { .. } => SanitizeState::Failed,
        }
    }
    fn exit_sanitize_failure(&self) -> Result<(), DeviceError> {
        self.volume.exit_sanitize_failure().map_err(dev_err)
    }
    /// This site's group and the other site's of the volume's current or
    /// last migration: before the switch this site is active/optimized and
    /// the destination standby; while writes are paused for the switch (or
    /// the switch is in doubt) both are transitioning; once the volume has
    /// moved this site is unavailable and the destination active. A copy
    /// that arrived reports its source unavailable.
    fn port_groups(&self) -> PortGroups {
        use AccessState::{ActiveOptimized, Standby, Transitioning, Unavailable};
        let v = &self.volume;
        let (local, peer) = if v.moved_to().is_some() {
            (Unavailable, ActiveOptimized)
        } else if v.in_doubt() || (v.migrating_out() && v.gate().is_paused()) {
            (Transitioning, Transitioning)
        } else if v.migrating_out() {
            (ActiveOptimized, Standby)
        } else {
            (ActiveOptimized, Unavailable)
        };
        PortGroups {
            local,
            peer: v
                .peer_port()
                .filter(|p| p.port_group != 0)
                .map(|p| (p.port_group, peer)),
        }
    }
    fn mapping(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, DeviceError> {
        let ext = self.volume.extents(offset, len, 1024).map_err(dev_err)?;
        Ok(ext
            .into_iter()
            .map(|e| (e.offset, e.length, !e.hole))
            .collect())
    }
}

/// EXTENDED COPY between volumes of one pool: a CSCD descriptor's NAA is
/// a volume's WWN.
pub struct PoolCopyTargets(pub Arc<Pool>);

impl CopyTargets for PoolCopyTargets {
    fn device_by_naa(&self, naa: &[u8]) -> Option<Arc<dyn BlockDevice>> {
        self.0
            .list()
            .into_iter()
            .filter(|v| v.is_serving())
            .find(|v| ferry_scsi::naa_bytes(&v.meta().wwn).is_some_and(|n| n[..] == *naa))
            .map(|volume| {
                Arc::new(VolumeDevice {
                    volume,
                    sanitize_rate: 0,
                }) as Arc<dyn BlockDevice>
            })
    }
}

/// Persistent reservations with APTPL, in `volumes/<name>/reservations`
/// (written to a temporary file, synced, renamed, directory synced).
pub struct FileReservationStore(pub PathBuf);

impl ReservationStore for FileReservationStore {
    fn load(&self) -> Option<String> {
        use std::io::Read;
        let limit = u64::try_from(ferry_scsi::pr::MAX_SAVED).unwrap_or(u64::MAX) + 1;
        let mut text = String::new();
        std::fs::File::open(&self.0)
            .and_then(|f| f.take(limit).read_to_string(&mut text))
            .ok()?;
        if text.len() > ferry_scsi::pr::MAX_SAVED {
            tracing::error!(path = %self.0.display(), "persistent reservations file over 1 MiB; ignored");
            return None;
        }
        Some(text)
    }

    fn save(&self, state: Option<&str>) -> Result<(), String> {
        let dir = self.0.parent().ok_or("no directory")?;
        let result = match state {
            Some(text) => {
                let tmp = self.0.with_extension("tmp");
                std::fs::File::create(&tmp)
                    .and_then(|mut f| {
                        f.write_all(text.as_bytes())?;
                        f.sync_all()
                    })
                    .and_then(|()| std::fs::rename(&tmp, &self.0))
            }
            None => match std::fs::remove_file(&self.0) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                r => r,
            },
        };
        result
            .and_then(|()| std::fs::File::open(dir)?.sync_all())
            .map_err(|e| {
                tracing::error!(path = %self.0.display(), error = %e, "saving persistent reservations failed");
                e.to_string()
            })
    }
}

/// A volume and the logical unit made for it.
type Unit = (Arc<Volume>, Arc<LogicalUnit>);

/// The logical unit of each exported volume, created on first use.
#[derive(Default)]
pub struct UnitTable {
    units: Mutex<HashMap<String, Unit>>,
}

impl UnitTable {
    pub fn unit(
        &self,
        volume: &Arc<Volume>,
        target_name: &str,
        pool: &Arc<Pool>,
        (port_group, portals): (u16, u16),
        sanitize_rate: u64,
    ) -> Arc<LogicalUnit> {
        let name = volume.name();
        let mut units = self.units.lock();
        if let Some((v, lu)) = units.get(&name) {
            if Arc::ptr_eq(v, volume) {
                return lu.clone();
            }
        }
        let m = volume.meta();
        let naa = ferry_scsi::naa_bytes(&m.wwn).unwrap_or_else(|| {
            let b = m.uuid.as_bytes();
            let mut n = [0u8; 8];
            n.copy_from_slice(&b[..8]);
            n[0] = 0x30 | (n[0] & 0x0f);
            n
        });
        let block_size = if volume.direct_io() {
            volume.block_size()
        } else {
            512
        };
        let lu = Arc::new(LogicalUnit::new(
            Arc::new(VolumeDevice {
                volume: volume.clone(),
                sanitize_rate,
            }),
            Identity {
                name: name.clone(),
                naa,
                serial: m.uuid.simple().to_string(),
                target_name: target_name.to_string(),
                port_group,
                relative_port: ferry_scsi::relative_port(port_group, 0),
                port_count: portals,
            },
            LuConfig {
                block_size,
                // 512e volumes report their physical block (LBPPBE);
                // UNMAP granularity follows it in VPD 0xB0.
                physical_block: m.physical_block_size.unwrap_or(block_size),
                thin: volume.is_sparse(),
            },
        ));
        lu.set_copy_targets(Arc::new(PoolCopyTargets(pool.clone())));
        let pr_file = pool.root().join("volumes").join(&name).join("reservations");
        lu.set_reservation_store(Arc::new(FileReservationStore(pr_file)));
        units.insert(name, (volume.clone(), lu.clone()));
        lu
    }

    /// Every unit (for target resets).
    pub fn all(&self) -> Vec<Arc<LogicalUnit>> {
        self.units
            .lock()
            .values()
            .map(|(_, lu)| lu.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_storage::{CreateOptions, OutgoingMigration, PeerPort, PoolOptions};
    use std::time::Duration;

    #[test]
    fn a_fenced_gateways_failure_is_a_transition_not_a_medium_error() {
        let os = |code| StorageError::Io {
            op: "write",
            path: "rbd:p/v".into(),
            source: std::io::Error::from_raw_os_error(code),
        };
        assert!(matches!(
            dev_err(os(libc::ESHUTDOWN)),
            DeviceError::Transitioning(_)
        ));
        assert!(matches!(dev_err(os(libc::EIO)), DeviceError::Io(_)));
    }

    #[test]
    fn port_groups_follow_the_volumes_migration() {
        use AccessState::{ActiveOptimized, Standby, Transitioning, Unavailable};
        let dir = tempfile::tempdir().unwrap();
        let pool = Pool::open(dir.path(), PoolOptions::default()).unwrap();
        let volume = pool
            .create(
                "v",
                &CreateOptions {
                    size: 1 << 20,
                    ..Default::default()
                },
            )
            .unwrap();
        let dev = VolumeDevice {
            volume: volume.clone(),
            sanitize_rate: 0,
        };
        let groups = |local, peer| PortGroups { local, peer };
        // Never migrated: this site alone.
        assert_eq!(dev.port_groups(), groups(ActiveOptimized, None));
        // Migrating, the destination known: it is standby.
        volume
            .set_outgoing(Some(OutgoingMigration {
                id: "0".repeat(32),
                to: "b:1".into(),
                switch_sent: false,
                plaintext: false,
            }))
            .unwrap();
        let b = PeerPort {
            portal: "10.0.0.2:3260".into(),
            port_group: 7,
        };
        volume.set_peer_port(Some(b.clone())).unwrap();
        assert_eq!(
            dev.port_groups(),
            groups(ActiveOptimized, Some((7, Standby)))
        );
        // The pause before the switch: both transitioning.
        assert!(volume.gate().pause(Duration::from_secs(1)));
        assert_eq!(
            dev.port_groups(),
            groups(Transitioning, Some((7, Transitioning)))
        );
        // Switched: the destination is the active site.
        volume
            .set_moved("10.0.0.2:10809", "", Some(b), "m1")
            .unwrap();
        volume.gate().resume();
        assert_eq!(
            dev.port_groups(),
            groups(Unavailable, Some((7, ActiveOptimized)))
        );
        // A switch whose outcome is unknown: transitioning until settled.
        volume.clear_moved().unwrap();
        volume.set_in_doubt(true);
        assert_eq!(
            dev.port_groups(),
            groups(Transitioning, Some((7, Transitioning)))
        );
        // A copy that arrived: its source is unavailable.
        volume.set_in_doubt(false);
        assert_eq!(
            dev.port_groups(),
            groups(ActiveOptimized, Some((7, Unavailable)))
        );
    }
}
