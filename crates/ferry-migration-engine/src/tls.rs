//! The pinned TLS between storage daemons lives in `ferry-trust`, which
//! the VM and controller layers share; re-exported here for the engine's
//! callers.

pub use ferry_trust::store::*;
