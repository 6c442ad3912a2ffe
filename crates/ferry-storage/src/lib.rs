//! ferry's storage engine: a pool directory of volumes backed by raw files
//! or RBD images,
//! positional I/O without a pool-wide lock, and dirty bitmaps that every write,
//! zero and trim marks before it returns.
//!
//! The engine knows nothing of NBD or iSCSI. Protocol servers call
//! [`Volume`] methods from a worker pool (they block) and map
//! [`StorageError`] to their own error answers.

mod alloc;
pub mod bitmap;
mod error;
pub mod gate;
pub mod holders;
pub mod meta;
mod page_cache;
mod pool;
pub mod shared;
mod volume;

pub use alloc::Extent;
pub use bitmap::{BitmapInfo, DirtyBitmap};
pub use error::StorageError;
pub use gate::{ThrottleTally, WriteGate};
pub use holders::{HeldBy, HoldGuard, Holder};
pub use meta::{unix_now, Backing, IncomingMigration, OutgoingMigration, PeerPort, VolumeMeta};
pub use pool::{CephStore, CreateOptions, Pool, PoolOptions};
pub use shared::{SharedGateway, SharedVolume};
pub use volume::{SanitizeJob, SanitizeOp, SanitizeStatus, Volume, ZeroMode};

/// Result alias for engine calls.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;
