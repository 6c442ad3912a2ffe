//! A pool volume seen as a SCSI block device, and the per-volume logical
//! units shared by every session and portal.

use ferry_scsi::{
    BlockDevice, CopyTargets, DeviceError, Identity, LogicalUnit, LuConfig, ReservationStore,
};
use ferry_storage::{Pool, StorageError, Volume, ZeroMode};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// Adapter from [`Volume`] to [`BlockDevice`]: every write goes through
/// the volume's write path, so it passes the migration write gate and marks
/// every dirty bitmap exactly as an NBD write does.
pub struct VolumeDevice(pub Arc<Volume>);

fn dev_err(e: StorageError) -> DeviceError {
    match e {
        StorageError::OutOfRange { .. } => DeviceError::OutOfRange,
        StorageError::ReadOnly(_) => DeviceError::ReadOnly,
        StorageError::NotFound(n) => DeviceError::Gone(format!("volume {n} was deleted")),
        StorageError::Moved { to, .. } => DeviceError::Gone(format!("moved to {to}")),
        StorageError::InDoubt { to, .. } => {
            DeviceError::Gone(format!("held until its migration to {to} is resolved"))
        }
        e => match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => DeviceError::NoSpace,
            _ => DeviceError::Io(e.to_string()),
        },
    }
}

impl BlockDevice for VolumeDevice {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_only(&self) -> bool {
        self.0.read_only()
    }
    fn thin(&self) -> bool {
        self.0.is_sparse()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        self.0.read_at(offset, buf).map_err(dev_err)
    }
    fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), DeviceError> {
        self.0.write_at(offset, data, fua).map_err(dev_err)
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
        self.0.write_zeroes(offset, len, mode, fua).map_err(dev_err)
    }
    fn unmap(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.0.trim(offset, len, false).map_err(dev_err)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        self.0.flush().map_err(dev_err)
    }
    fn prefetch(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.0.cache(offset, len).map_err(dev_err)
    }
    fn try_read_nowait(&self, offset: u64, len: usize) -> Result<Option<Vec<u8>>, DeviceError> {
        let mut buf = bytes::BytesMut::new();
        match self.0.read_append(offset, len, &mut buf, true) {
            Ok(true) => Ok(Some(buf.into())),
            Ok(false) => Ok(None),
            Err(e) => Err(dev_err(e)),
        }
    }
    fn writes_may_wait(&self) -> bool {
        let g = self.0.gate();
        g.is_paused() || !g.throttle().is_zero()
    }
    fn mapping(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, DeviceError> {
        let ext = self.0.extents(offset, len, 1024).map_err(dev_err)?;
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
            .map(|v| Arc::new(VolumeDevice(v)) as Arc<dyn BlockDevice>)
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
        portals: u16,
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
            Arc::new(VolumeDevice(volume.clone())),
            Identity {
                name: name.clone(),
                naa,
                serial: m.uuid.simple().to_string(),
                target_name: target_name.to_string(),
                port_group: 1,
                relative_port: 1,
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
