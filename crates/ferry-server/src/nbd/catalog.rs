//! The pool seen as NBD exports: one export per volume, named after it.

use ferry_nbd::{ExportCatalog, ExportInfo, MAX_REQUEST_LEN};
use ferry_storage::{Pool, Volume};

/// Adapter from [`Pool`] to the handshake's [`ExportCatalog`].
pub struct PoolCatalog<'a>(pub &'a Pool);

/// The export description of one volume.
pub fn export_info(v: &Volume) -> ExportInfo {
    let m = v.meta();
    let direct = v.direct_io();
    ExportInfo {
        name: m.name.clone(),
        description: format!("ferry volume {} ({})", m.uuid, m.wwn),
        size: v.size(),
        read_only: m.read_only,
        min_block: if direct { m.block_size } else { 1 },
        preferred_block: m.block_size.max(4096),
        max_block: MAX_REQUEST_LEN,
        block_size_required: direct,
        dirty_bitmaps: v.bitmap_names(),
        // NBD_CMD_RESIZE: volumes whose file ferry owns (an external
        // file's size is its owner's).
        resizable: !matches!(m.backing, ferry_storage::Backing::External { .. }),
    }
}

/// A volume is exported unless it has moved away, is the unfinished copy
/// of an incoming migration, or holds a half-done import.
fn exported(v: &Volume) -> bool {
    v.is_serving()
}

impl ExportCatalog for PoolCatalog<'_> {
    fn export(&self, name: &str) -> Option<ExportInfo> {
        self.0
            .get(name)
            .ok()
            .filter(|v| exported(v))
            .map(|v| export_info(&v))
    }

    fn exports(&self) -> Vec<ExportInfo> {
        self.0
            .list()
            .iter()
            .filter(|v| exported(v))
            .map(|v| export_info(v))
            .collect()
    }

    /// Where the volume is served now: the daemon it migrated to, or the
    /// gateway that holds it (a shared volume, see `ferry_storage::shared`).
    fn moved(&self, name: &str) -> Option<String> {
        match self.0.get(name) {
            Ok(v) => v.moved_to(),
            Err(ferry_storage::StorageError::HeldElsewhere { holder, .. }) => Some(holder),
            Err(_) => None,
        }
    }
}
