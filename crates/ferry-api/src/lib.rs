//! The admin API of a ferry daemon, as types: every request body and every
//! answer of `docs/admin-api.md`, and a blocking [`client::AdminClient`]
//! that speaks them. The daemon serves these types, the CLI and the layers
//! above the storage server (VM host, controller) call through the client;
//! nobody builds or reads the API's JSON by hand.
//!
//! Compatibility: fields are only ever added, with `#[serde(default)]`, so
//! an older client reads a newer daemon's answers and the other way round.
//! Enumerations (`MigrationPhase`, `MigrationResult`, `BackingKind`) are
//! closed: a client meeting a value it does not know reports a decode error
//! rather than guessing.

pub mod client;
pub mod host;
pub mod index;
pub mod metrics;
pub mod migration;
pub mod server;
pub mod vm;
pub mod volume;

pub use client::{AdminClient, ClientError, Daemon};
pub use host::{AttachRequest, AttachedVolume};
pub use index::{
    IndexStatus, LookupAnswer, LookupRequest, RebuildReport, RebuildRequest, SampleRequest,
    VolumeIdentity, VolumeIndexStatus, VolumeSample, WrittenSinceArrival,
};
pub use migration::{
    DestinationCopy, MigrateRequest, MigrationId, MigrationPhase, MigrationResult, MigrationStatus,
    Report, ReportBytes, ReportChunks, ReportDigest, ReportThrottle, ReportTime,
};
pub use server::ServerView;
pub use vm::{
    Accel, BandwidthProbe, Boot, CloudInit, CreateVm, DirtyRateView, DiskIo, DiskMigrationRef,
    LinkProbe, MoveBytes, MoveKind, MovePause, NicAddress, NicView, PhaseTime, ProbeRequest,
    UpdateVm, VmDisk, VmMigrateRequest, VmMovePhase, VmMoveReport, VmMoveStatus, VmNic, VmSpec,
    VmState, VmView,
};
pub use volume::{
    ArrivalView, Backing, BitmapRequest, BitmapView, CreateVolume, ImportReport, IncomingMigration,
    OutgoingMigration, ResizeVolume, SanitizeView, Size, VolumeView,
};

use serde::{Deserialize, Serialize};

/// The body of every error answer: `{"error": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}
