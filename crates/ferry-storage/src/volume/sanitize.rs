//! SANITIZE of a whole volume (SBC-4 4.11): overwrite every block with a
//! pattern, or erase (deallocate) every block. The request is journaled in
//! the volume's metadata before any block changes, so a daemon killed
//! half-way resumes it when it opens the volume again (a sanitize survives
//! power loss on a real drive too). While one runs, every read and write of
//! the volume fails with [`StorageError::Sanitizing`]; one that could not
//! finish leaves the volume in the failure mode ([`StorageError::SanitizeFailed`])
//! until a sanitize succeeds or, when the request allowed it, the failure
//! mode is exited.

use super::{AlignedBuf, Volume};
use crate::{Result, StorageError};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

/// What a sanitize does to every block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SanitizeOp {
    /// Write `pattern` over every block, repeated to fill the block,
    /// `passes` times; with `invert`, every second pass writes the
    /// pattern's complement (the last pass writes the pattern itself).
    Overwrite {
        pattern: Vec<u8>,
        invert: bool,
        passes: u8,
    },
    /// Deallocate every block (sparse volumes; others are zeroed in
    /// place): each reads back as zeroes.
    BlockErase,
}

/// A sanitize request, as journaled in the metadata.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SanitizeJob {
    pub op: SanitizeOp,
    /// The initiator allowed leaving the failure mode without a
    /// successful sanitize (SCSI AUSE).
    #[serde(default)]
    pub ause: bool,
    /// Set when the sanitize failed: why. The volume stays in the failure
    /// mode (I/O refused) until a sanitize succeeds or it is exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

/// Where a volume's sanitize stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SanitizeStatus {
    Idle,
    Running { done: u64, total: u64 },
    Failed { ause: bool, reason: String },
}

const IDLE: u8 = 0;
const RUNNING: u8 = 1;
const FAILED: u8 = 2;
/// Bytes written (or erased) per step; progress and the rate limit are
/// accounted per step.
const STEP: usize = 1 << 20;

/// The per-volume state the data path checks: one atomic load per I/O.
#[derive(Debug, Default)]
pub(crate) struct SanitizeCell {
    state: AtomicU8,
    done: AtomicU64,
    total: AtomicU64,
    /// Set when the volume closes: a runner stops between steps, leaving
    /// the journal for the next open to resume.
    stop: AtomicBool,
    /// Why the last sanitize failed (read from the journal at open), also
    /// when journaling it failed too (a full disk): the journal then still
    /// says "running", and the next open resumes the sanitize, which fails
    /// again or finishes.
    reason: parking_lot::Mutex<Option<String>>,
}

impl SanitizeCell {
    /// The state a volume opens in: a journaled request that had not
    /// failed is still running (its runner resumes it).
    pub(crate) fn from_journal(job: Option<&SanitizeJob>) -> SanitizeCell {
        let c = SanitizeCell::default();
        match job {
            Some(j) if j.failed.is_some() => {
                c.state.store(FAILED, Ordering::SeqCst);
                c.reason.lock().clone_from(&j.failed);
            }
            Some(_) => c.state.store(RUNNING, Ordering::SeqCst),
            None => {}
        }
        c
    }

    /// The volume is closing: a running sanitize stops at its next step.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Refuse I/O while a sanitize runs or after one failed.
    pub(crate) fn check(&self, name: &str) -> Result<()> {
        match self.state.load(Ordering::SeqCst) {
            IDLE => Ok(()),
            RUNNING => Err(StorageError::Sanitizing(name.to_string())),
            _ => Err(StorageError::SanitizeFailed(name.to_string())),
        }
    }
}

impl Volume {
    /// Where this volume's sanitize stands.
    pub fn sanitize_status(&self) -> SanitizeStatus {
        match self.sanitize.state.load(Ordering::SeqCst) {
            IDLE => SanitizeStatus::Idle,
            RUNNING => SanitizeStatus::Running {
                done: self.sanitize.done.load(Ordering::Relaxed),
                total: self.sanitize.total.load(Ordering::Relaxed),
            },
            _ => SanitizeStatus::Failed {
                ause: self.meta.lock().sanitize.as_ref().is_some_and(|j| j.ause),
                reason: self.sanitize.reason.lock().clone().unwrap_or_default(),
            },
        }
    }

    /// A sanitize was journaled and has not finished: the caller should
    /// run it ([`Volume::run_sanitize`]), e.g. after a restart.
    pub fn sanitize_pending(&self) -> bool {
        self.sanitize.state.load(Ordering::SeqCst) == RUNNING
    }

    /// Start a sanitize: wait for writes in flight to finish, journal the
    /// request durably, and refuse every read and write from here on. The
    /// blocks change only in [`Volume::run_sanitize`], which the caller
    /// runs next (on a thread of its own: it takes as long as writing the
    /// whole volume). A volume in the failure mode may be sanitized again.
    pub fn begin_sanitize(&self, op: SanitizeOp, ause: bool) -> Result<()> {
        if self.read_only {
            return Err(StorageError::ReadOnly(self.name.clone()));
        }
        if let SanitizeOp::Overwrite {
            pattern, passes, ..
        } = &op
        {
            if pattern.is_empty() || pattern.len() > self.block_size as usize || *passes == 0 {
                return Err(StorageError::Invalid(format!(
                    "an overwrite needs a pattern of 1 to {} bytes and at least one pass",
                    self.block_size
                )));
            }
        }
        let held = self.held_by();
        if held.has_migration() {
            return Err(StorageError::InUse {
                name: self.name.clone(),
                held_by: held,
                hint: "",
            });
        }
        self.check_here()?;
        let (incoming, importing) = {
            let m = self.meta.lock();
            (m.incoming.is_some(), m.importing)
        };
        if incoming || importing {
            return Err(StorageError::Invalid(format!(
                "volume {} holds an unfinished copy; it cannot be sanitized",
                self.name
            )));
        }
        let from = self.sanitize.state.load(Ordering::SeqCst);
        if from == RUNNING
            || self
                .sanitize
                .state
                .compare_exchange(from, RUNNING, Ordering::SeqCst, Ordering::SeqCst)
                .is_err()
        {
            return Err(StorageError::Sanitizing(self.name.clone()));
        }
        // From here every new write fails; wait for those already inside.
        if !self.gate.pause(Duration::from_secs(30)) {
            self.sanitize.state.store(from, Ordering::SeqCst);
            return Err(StorageError::Invalid(
                "writes in flight did not finish within 30 s; sanitize not started".into(),
            ));
        }
        self.gate.resume();
        let job = SanitizeJob {
            op,
            ause,
            failed: None,
        };
        if let Err(e) = self.update_meta(|m| {
            m.sanitize = Some(job);
            Ok(())
        }) {
            self.sanitize.state.store(from, Ordering::SeqCst);
            return Err(e);
        }
        self.sanitize.done.store(0, Ordering::Relaxed);
        self.sanitize.total.store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Carry out the journaled sanitize, at most `bytes_per_sec` (0: no
    /// limit) so that it does not starve the other volumes of the disk.
    /// On success the journal is cleared and I/O is allowed again; on
    /// failure the volume enters the failure mode (journaled, so it
    /// survives a restart) and the error is returned. When the volume
    /// closes under it, it stops with [`StorageError::Sanitizing`]: the
    /// journal stays and the next open resumes it.
    pub fn run_sanitize(&self, bytes_per_sec: u64) -> Result<()> {
        let Some(job) = self.meta.lock().sanitize.clone() else {
            return Ok(());
        };
        if job.failed.is_some() || !self.sanitize_pending() {
            return Ok(());
        }
        tracing::info!(volume = %self.name, op = ?job.op, "sanitize started");
        let result = self.sanitize_blocks(&job.op, bytes_per_sec);
        if self.sanitize.stop.load(Ordering::SeqCst) {
            // The volume closed under it: the journal stays, and the next
            // open resumes from the start.
            self.mark(0, self.size());
            tracing::info!(volume = %self.name, "sanitize interrupted by close; it resumes when the volume opens again");
            // Not done: whoever waits for it must not report success.
            return Err(StorageError::Sanitizing(self.name.clone()));
        }
        // Every block changed: every dirty bitmap says so, also on failure.
        self.mark(0, self.size());
        match result.and_then(|()| self.flush()) {
            Ok(()) => {
                self.update_meta(|m| {
                    m.sanitize = None;
                    Ok(())
                })?;
                self.sanitize.state.store(IDLE, Ordering::SeqCst);
                tracing::info!(volume = %self.name, "sanitize finished");
                Ok(())
            }
            Err(e) => {
                tracing::error!(volume = %self.name, error = %e, "sanitize failed; the volume is in the sanitize failure mode");
                let reason = e.to_string();
                *self.sanitize.reason.lock() = Some(reason.clone());
                let journaled = self.update_meta(|m| {
                    if let Some(j) = m.sanitize.as_mut() {
                        j.failed = Some(reason);
                    }
                    Ok(())
                });
                self.sanitize.state.store(FAILED, Ordering::SeqCst);
                if let Err(j) = journaled {
                    tracing::error!(volume = %self.name, error = %j, "the sanitize's failure could not be journaled; it is retried when the volume opens again");
                }
                Err(e)
            }
        }
    }

    /// Leave the failure mode of a sanitize that failed (SCSI EXIT FAILURE
    /// MODE); refused unless that sanitize allowed it (AUSE).
    pub fn exit_sanitize_failure(&self) -> Result<()> {
        if self.sanitize.state.load(Ordering::SeqCst) != FAILED {
            return Ok(());
        }
        let ause = self.meta.lock().sanitize.as_ref().is_some_and(|j| j.ause);
        if !ause {
            return Err(StorageError::Invalid(
                "the failed sanitize did not allow exiting its failure mode; sanitize again".into(),
            ));
        }
        self.update_meta(|m| {
            m.sanitize = None;
            Ok(())
        })?;
        self.sanitize.state.store(IDLE, Ordering::SeqCst);
        Ok(())
    }

    fn sanitize_blocks(&self, op: &SanitizeOp, bytes_per_sec: u64) -> Result<()> {
        let size = self.size();
        let (passes, invert, pattern) = match op {
            SanitizeOp::Overwrite {
                pattern,
                invert,
                passes,
            } => (u64::from(*passes), *invert, pattern.as_slice()),
            SanitizeOp::BlockErase => (1, false, &[][..]),
        };
        self.sanitize.total.store(size * passes, Ordering::Relaxed);
        let started = Instant::now();
        let mut done_total = 0u64;
        let mut buf = AlignedBuf::zeroed(STEP);
        for pass in 0..passes {
            if !pattern.is_empty() {
                // The last pass writes the pattern; earlier ones alternate.
                let flip = invert && (passes - 1 - pass) % 2 == 1;
                let bs = self.block_size as usize;
                let b = buf.as_mut_slice(STEP);
                for block in b.chunks_mut(bs) {
                    for (i, byte) in block.iter_mut().enumerate() {
                        let p = pattern[i % pattern.len()];
                        *byte = if flip { !p } else { p };
                    }
                }
            }
            let mut pos = 0u64;
            while pos < size {
                if self.sanitize.stop.load(Ordering::SeqCst) {
                    return Ok(());
                }
                let n = (STEP as u64).min(size - pos);
                if pattern.is_empty() {
                    // Block erase: deallocated on sparse volumes, zeroed in
                    // place on preallocated ones.
                    let erase = super::ZeroMode {
                        may_punch: true,
                        fast_only: false,
                    };
                    self.zero_range(pos, n, erase)?;
                } else {
                    let len = usize::try_from(n).unwrap_or(STEP);
                    self.write_backing(pos, buf.as_mut_slice(len))?;
                }
                pos += n;
                done_total += n;
                self.sanitize.done.store(done_total, Ordering::Relaxed);
                if bytes_per_sec > 0 {
                    let due = Duration::from_secs_f64(done_total as f64 / bytes_per_sec as f64);
                    if let Some(wait) = due.checked_sub(started.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
            }
            if passes > 1 {
                self.flush()?;
            }
        }
        Ok(())
    }
}
