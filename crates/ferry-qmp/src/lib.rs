//! QEMU's machine protocol (QMP), for driving the guests ferry runs and
//! moves. Two layers, after QEMU's own `python/qemu/qmp`:
//!
//! - [`wire`]: bytes in, messages out, no I/O. QEMU sends one JSON object
//!   per line (`\r\n`); the decoder splits and classifies them (greeting,
//!   a command's return or error matched by `id`, an asynchronous event)
//!   and bounds the line length.
//! - [`client`]: a connection over a unix socket: greeting, capability
//!   negotiation, commands with ids whose replies are matched whatever the
//!   order, and events as a stream one waits on with a timeout (never a
//!   sleep).
//! - [`commands`]: typed commands and answers for everything ferry sends
//!   (`query-migrate` as a [`MigrationInfo`], `migrate-set-parameters`
//!   from a [`MigrateParameters`], ...).
//!
//! ```text
//!  ferry                                  QEMU
//!    |<------------ {"QMP": {version, capabilities}}   greeting
//!    | {"execute": "qmp_capabilities"} ----->|
//!    |<--------------------------- {"return": {}}
//!    | {"execute": C, "arguments": A, "id": N} ->|
//!    |<------ {"event": E, "data": D, "timestamp": T}  any time
//!    |<------ {"return": R, "id": N} | {"error": {class, desc}, "id": N}
//! ```

pub mod client;
pub mod commands;
pub mod wire;

pub use client::{QmpClient, QmpError};
pub use commands::{
    Capability, DirtyRateInfo, MigrateParameters, MigrationInfo, MigrationStatus, RamStats,
    StatusInfo,
};
pub use wire::{Event, Greeting, ServerMessage, WireError};
