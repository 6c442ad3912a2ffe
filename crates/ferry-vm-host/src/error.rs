//! What can go wrong on a VM host, typed by where it went wrong: the
//! request, the guest's QEMU, a local file, the other host of a move, the
//! storage daemon, or the move itself. The API maps each to its status.

use std::path::PathBuf;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum VmError {
    /// The request or spec is not one this host can run.
    #[error("{0}")]
    BadSpec(String),
    #[error("guest {0} exists already")]
    Exists(String),
    #[error("no guest named {0}")]
    NotFound(String),
    #[error("guest {name} is {state}: {what}")]
    Busy {
        name: String,
        state: String,
        what: String,
    },
    #[error("no move {0}")]
    NoMove(String),
    /// A disk of the guest: refused by its storage daemon, or failed to
    /// migrate.
    #[error("disk {volume}: {detail}")]
    Disk { volume: String, detail: String },
    /// The guest's QEMU process: it did not start, or is not there.
    #[error("QEMU {0}")]
    Qemu(#[from] QemuFault),
    /// A command to the guest's QEMU failed, or its QMP socket did.
    #[error(transparent)]
    Qmp(#[from] ferry_qmp::QmpError),
    /// A file or directory of this host's state directory.
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A persisted record (spec, runtime, move record).
    #[error(transparent)]
    StateFile(#[from] ferry_state_file::StateFileError),
    /// A listener this host could not open.
    #[error("listening on {addr}: {detail}")]
    Listen { addr: String, detail: String },
    /// The daemon's own set-up (credentials it was given).
    #[error("{0}")]
    Config(String),
    /// The other host of a move or a probe.
    #[error("host {peer}: {fault}")]
    Peer { peer: String, fault: PeerFault },
    /// A memory stream between the hosts (at the destination).
    #[error("the memory stream: {0}")]
    Stream(#[from] crate::tunnel::PipeError),
    /// A storage daemon's admin API.
    #[error("storage daemon: {0}")]
    Storage(#[source] ferry_api::ClientError),
    /// A move's memory copy stopped (did not converge, QEMU failed it, the
    /// destination went away); the guest runs at the source.
    #[error("{0}")]
    MemoryCopy(String),
    /// A move ran past its deadline; what it was waiting for.
    #[error("the deadline passed while {0}")]
    Deadline(String),
    /// The caller cancelled the move.
    #[error("cancelled by the caller")]
    Cancelled,
    /// A blocking task of this daemon panicked or was dropped.
    #[error("internal: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// The guest's QEMU process, as opposed to a command it refused.
#[derive(Debug, Error)]
pub enum QemuFault {
    #[error("cannot be run ({binary}): {source}")]
    Spawn {
        binary: String,
        #[source]
        source: std::io::Error,
    },
    /// It exited, or its monitor did not answer, while starting; what it
    /// logged.
    #[error("did not start: {0}")]
    Start(String),
    /// The guest has no QEMU process on this host.
    #[error("is not running here")]
    NotRunning,
    /// QEMU answered a command with something ferry cannot use.
    #[error("answered {command} with {detail}")]
    Answer {
        command: &'static str,
        detail: String,
    },
}

/// What went wrong with the other host.
#[derive(Debug, Error)]
pub enum PeerFault {
    /// Connecting, reading or writing failed.
    #[error("{what}: {source}")]
    Link {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// TLS set-up or the certificates.
    #[error("TLS: {0}")]
    Tls(String),
    /// It sent something out of protocol, or closed mid-exchange.
    #[error("{0}")]
    Protocol(String),
    /// It answered, refusing.
    #[error("refused: {0}")]
    Refused(String),
    /// It did not answer in time.
    #[error("no answer to {0} in time")]
    Timeout(&'static str),
    /// It closed the connection before sending anything: a link opened
    /// ahead and not needed (a move's spare link), not a failure.
    #[error("closed the connection before any message")]
    ClosedIdle,
}

impl VmError {
    pub fn peer(peer: impl Into<String>, fault: PeerFault) -> Self {
        VmError::Peer {
            peer: peer.into(),
            fault,
        }
    }

    pub fn file(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        VmError::File {
            path: path.into(),
            source,
        }
    }
}

impl PeerFault {
    pub fn link(what: &'static str) -> impl Fn(std::io::Error) -> PeerFault {
        move |source| PeerFault::Link { what, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_says_where_it_went_wrong() {
        let peer = VmError::peer(
            "10.0.0.2:10891",
            PeerFault::link("read")(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
        );
        assert!(peer.to_string().starts_with("host 10.0.0.2:10891: read: "));
        let refused = VmError::peer("b:1", PeerFault::Refused("no room".into()));
        assert_eq!(refused.to_string(), "host b:1: refused: no room");
        let gone: VmError = QemuFault::NotRunning.into();
        assert_eq!(gone.to_string(), "QEMU is not running here");
        let file = VmError::file(
            "/s/vms/web",
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        );
        assert!(file.to_string().starts_with("/s/vms/web: "));
        let late = VmError::Deadline("the disks were at web copying".into());
        assert_eq!(
            late.to_string(),
            "the deadline passed while the disks were at web copying"
        );
    }
}
