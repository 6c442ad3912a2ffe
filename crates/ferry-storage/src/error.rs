//! Errors of the storage engine, each with the context needed to act on it.

use std::path::PathBuf;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StorageError {
    #[error("volume {0:?} does not exist")]
    NotFound(String),
    #[error("volume {name:?} is served by the gateway at {holder} now")]
    HeldElsewhere {
        name: String,
        /// The holder's NBD address.
        holder: String,
        /// The holder's iSCSI portal, if it has one.
        iscsi: Option<String>,
    },
    #[error("volume {0:?} already exists")]
    Exists(String),
    #[error("invalid name {0:?}: use 1-128 characters of A-Z a-z 0-9 . _ - not starting with '.'")]
    InvalidName(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("range {offset}+{len} is outside the volume of {size} bytes")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("volume {0:?} is read-only")]
    ReadOnly(String),
    #[error("dirty bitmap {0:?} does not exist")]
    BitmapNotFound(String),
    #[error("dirty bitmap {0:?} already exists")]
    BitmapExists(String),
    #[error("volume {name:?} is held: its migration to {to} may have switched; run the same migration again to ask the destination")]
    InDoubt { name: String, to: String },
    #[error("volume {name:?} has moved to {to}")]
    Moved { name: String, to: String },
    /// Deleting a volume something holds.
    #[error("volume {name:?} is in use by {held_by}{hint}")]
    InUse {
        name: String,
        held_by: crate::HeldBy,
        /// How to override, when that is allowed.
        hint: &'static str,
    },
    #[error(
        "volume {0:?} is being sanitized; its blocks cannot be read or written until that ends"
    )]
    Sanitizing(String),
    #[error("volume {0:?}: its last sanitize failed; sanitize it again (or exit the failure mode if that sanitize allowed it)")]
    SanitizeFailed(String),
    #[error("zeroing cannot be done fast here")]
    NotFast,
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The Ceph cluster refused (a missing pool or image, another writer
    /// holding the image's lock, no connection).
    #[error(transparent)]
    Ceph(ferry_rbd::RbdError),
    #[error("corrupt {what} in {path}: {detail}")]
    Corrupt {
        what: &'static str,
        path: PathBuf,
        detail: String,
    },
}

impl StorageError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StorageError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// An RBD call's failure: its I/O errors as [`StorageError::Io`] (so
    /// clients get the errno), the rest as they are.
    pub(crate) fn rbd(op: &'static str, e: ferry_rbd::RbdError) -> Self {
        match e {
            ferry_rbd::RbdError::Io { target, source, .. } => StorageError::Io {
                op,
                path: PathBuf::from(format!("rbd:{target}")),
                source,
            },
            e => StorageError::Ceph(e),
        }
    }

    /// The OS errno behind an I/O error, if there is one (ENOSPC matters to
    /// clients).
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            StorageError::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}
