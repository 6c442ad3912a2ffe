//! Errors: protocol violations that end a connection (`NbdError`) and the errno
//! values that travel in replies (`ErrorCode`).

use thiserror::Error;

/// A violation of the protocol by the peer. The connection cannot continue
/// safely after one: the caller logs it and closes that one connection.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum NbdError {
    #[error("bad magic {found:#x} in {what}")]
    BadMagic { what: &'static str, found: u64 },
    #[error("client does not speak fixed newstyle (client flags {0:#x})")]
    NotFixedNewstyle(u32),
    #[error("unknown client flags {0:#x}")]
    UnknownClientFlags(u32),
    #[error("option {option} data of {len} bytes exceeds the {max} byte limit")]
    OptionTooLong { option: u32, len: u32, max: u32 },
    #[error("too many options negotiated ({0}); giving up on this client")]
    TooManyOptions(usize),
    #[error("unknown export {0:?} requested with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    #[error("server sent an unexpected reply: {0}")]
    UnexpectedReply(String),
    #[error("server refused option {option}: reply type {reply:#x}: {message}")]
    OptionRefused {
        option: u32,
        reply: u32,
        message: String,
    },
    #[error("malformed {what}: {detail}")]
    Malformed { what: &'static str, detail: String },
    /// NBD_OPT_EXPORT_NAME (which cannot be refused) before TLS on a
    /// server that requires it: the connection is closed.
    #[error("the client chose an export without TLS, which this server requires")]
    TlsRequired,
}

/// An errno value sent to the client in a reply (proto.md "Error values").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    Overflow = 75,
    NotSup = 95,
    Shutdown = 108,
}

impl ErrorCode {
    /// The value on the wire.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Decode a wire value; unknown non-zero values read as `EINVAL`, as the
    /// protocol tells clients to do.
    pub fn from_wire(v: u32) -> Option<ErrorCode> {
        Some(match v {
            0 => return None,
            1 => ErrorCode::Perm,
            5 => ErrorCode::Io,
            12 => ErrorCode::NoMem,
            28 => ErrorCode::NoSpc,
            75 => ErrorCode::Overflow,
            95 => ErrorCode::NotSup,
            108 => ErrorCode::Shutdown,
            _ => ErrorCode::Inval,
        })
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            ErrorCode::Perm => "EPERM",
            ErrorCode::Io => "EIO",
            ErrorCode::NoMem => "ENOMEM",
            ErrorCode::Inval => "EINVAL",
            ErrorCode::NoSpc => "ENOSPC",
            ErrorCode::Overflow => "EOVERFLOW",
            ErrorCode::NotSup => "ENOTSUP",
            ErrorCode::Shutdown => "ESHUTDOWN",
        };
        f.write_str(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_values_round_trip() {
        for c in [
            ErrorCode::Perm,
            ErrorCode::Io,
            ErrorCode::NoMem,
            ErrorCode::Inval,
            ErrorCode::NoSpc,
            ErrorCode::Overflow,
            ErrorCode::NotSup,
            ErrorCode::Shutdown,
        ] {
            assert_eq!(ErrorCode::from_wire(c.code()), Some(c));
        }
        assert_eq!(ErrorCode::from_wire(0), None);
        assert_eq!(ErrorCode::from_wire(9999), Some(ErrorCode::Inval));
    }
}
