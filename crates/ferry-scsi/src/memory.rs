//! An in-memory [`BlockDevice`] for tests and fuzzing.

use crate::{BlockDevice, DeviceError, PortGroups};
use parking_lot::RwLock;

/// A RAM disk. Unmapped ranges read as zeroes (thin, LBPRZ).
pub struct MemoryDevice {
    data: RwLock<Vec<u8>>,
    read_only: bool,
    groups: RwLock<PortGroups>,
}

impl MemoryDevice {
    pub fn new(size: usize, read_only: bool) -> MemoryDevice {
        MemoryDevice {
            data: RwLock::new(vec![0; size]),
            read_only,
            groups: RwLock::new(PortGroups::default()),
        }
    }

    /// Report these ALUA states from now on (tests of a migrating device).
    pub fn set_port_groups(&self, groups: PortGroups) {
        *self.groups.write() = groups;
    }

    /// Grow or shrink the disk (tests of capacity-change attention).
    pub fn resize(&self, size: usize) {
        self.data.write().resize(size, 0);
    }

    fn span(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, DeviceError> {
        let size = self.data.read().len() as u64;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(offset as usize..end as usize),
            _ => Err(DeviceError::OutOfRange),
        }
    }
}

impl BlockDevice for MemoryDevice {
    fn size(&self) -> u64 {
        self.data.read().len() as u64
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    fn thin(&self) -> bool {
        true
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        let r = self.span(offset, buf.len() as u64)?;
        buf.copy_from_slice(&self.data.read()[r]);
        Ok(())
    }
    fn write_at(&self, offset: u64, data: &[u8], _fua: bool) -> Result<(), DeviceError> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        let r = self.span(offset, data.len() as u64)?;
        self.data.write()[r].copy_from_slice(data);
        Ok(())
    }
    fn write_zeroes(&self, offset: u64, len: u64, _: bool, _: bool) -> Result<(), DeviceError> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        let r = self.span(offset, len)?;
        self.data.write()[r].fill(0);
        Ok(())
    }
    fn unmap(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.write_zeroes(offset, len, true, false)
    }
    fn flush(&self) -> Result<(), DeviceError> {
        Ok(())
    }
    fn prefetch(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.span(offset, len).map(|_| ())
    }
    fn sanitize_support(&self) -> crate::SanitizeSupport {
        crate::SanitizeSupport {
            overwrite: true,
            block_erase: true,
        }
    }
    /// Done at once: the data lives in memory.
    fn sanitize(
        &self,
        action: crate::SanitizeAction,
        _ause: bool,
        _wait: bool,
    ) -> Result<(), DeviceError> {
        if self.read_only {
            return Err(DeviceError::ReadOnly);
        }
        let mut d = self.data.write();
        match action {
            crate::SanitizeAction::Overwrite { pattern, .. } => {
                for (i, b) in d.iter_mut().enumerate() {
                    *b = pattern[i % 512 % pattern.len()];
                }
            }
            crate::SanitizeAction::BlockErase => d.fill(0),
        }
        Ok(())
    }
    fn mapping(&self, offset: u64, len: u64) -> Result<Vec<(u64, u64, bool)>, DeviceError> {
        let r = self.span(offset, len)?;
        let d = self.data.read();
        let mut out: Vec<(u64, u64, bool)> = Vec::new();
        for (i, chunk) in d[r].chunks(4096).enumerate() {
            let mapped = chunk.iter().any(|b| *b != 0);
            let at = offset + (i * 4096) as u64;
            match out.last_mut() {
                Some(last) if last.2 == mapped => last.1 += chunk.len() as u64,
                _ => out.push((at, chunk.len() as u64, mapped)),
            }
        }
        Ok(out)
    }
    fn port_groups(&self) -> PortGroups {
        *self.groups.read()
    }
}
