//! Replies whose data the kernel sends from a file (`sendfile(2)`): a
//! large READ of a volume whose pages are all cached goes to the socket
//! without being copied into a buffer of ours and out of it again.
//!
//! Only a plain socket can take it (TCP or unix); over TLS the handler
//! never asks for it, and a write half that cannot send from a file reads
//! the range and writes it ([`SendFile`]'s default).

use bytes::Bytes;
use std::fs::File;
use std::future::Future;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use tokio::io::{AsyncWrite, AsyncWriteExt, Interest};

/// `len` bytes of `file` at `offset`, sent after the reply header before
/// them. The file stays open until they are sent.
#[derive(Debug, Clone)]
pub struct FileRange {
    pub file: Arc<File>,
    pub offset: u64,
    pub len: usize,
}

/// A write half that can send a [`FileRange`].
pub trait SendFile: AsyncWrite + Unpin + Send + Sized {
    /// Send the buffers of `head` (emptied), then all of `range`. An error
    /// leaves the reply cut short: the connection must end.
    fn send_file<'a>(
        &'a mut self,
        head: &'a mut Vec<Bytes>,
        range: &'a FileRange,
    ) -> impl Future<Output = io::Result<()>> + Send + 'a {
        async move {
            ferry_client::write_all_vectored(self, head).await?;
            let mut buf = vec![0u8; range.len];
            range.file.read_exact_at(&mut buf, range.offset)?;
            self.write_all(&buf).await
        }
    }
}

/// `SendFile` for a plain socket's write half: the buffers before the
/// range go with `MSG_MORE`, so that the kernel holds the reply header
/// back for the data after it instead of pushing it out alone (on
/// loopback a segment that small costs the client a wake-up of its own);
/// then `sendfile` until the range is out, waiting for room in the
/// socket's buffer. A peer gone raises `SIGPIPE` on `sendfile` (it takes
/// no `MSG_NOSIGNAL`): Rust programs ignore it from the start, and the
/// call fails with `EPIPE` instead.
macro_rules! sends_files {
    ($half:ty) => {
        impl SendFile for $half {
            async fn send_file(
                &mut self,
                head: &mut Vec<Bytes>,
                range: &FileRange,
            ) -> io::Result<()> {
                let sock = self.as_ref();
                let mut at = 0;
                while at < head.len() {
                    sock.writable().await?;
                    let sent = sock.try_io(Interest::WRITABLE, || {
                        let iov: Vec<libc::iovec> = head[at..]
                            .iter()
                            .take(64)
                            .map(|b| libc::iovec {
                                iov_base: b.as_ptr() as *mut libc::c_void,
                                iov_len: b.len(),
                            })
                            .collect();
                        // SAFETY: `iov` points into buffers `head` holds
                        // for the call; `msg` lives for it too.
                        let n = unsafe {
                            let mut msg: libc::msghdr = std::mem::zeroed();
                            msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
                            msg.msg_iovlen = iov.len();
                            libc::sendmsg(
                                sock.as_raw_fd(),
                                &msg,
                                libc::MSG_MORE | libc::MSG_NOSIGNAL,
                            )
                        };
                        usize::try_from(n).map_err(|_| io::Error::last_os_error())
                    });
                    match sent {
                        Ok(n) => at = ferry_client::advance_sent(head, at, n),
                        Err(e) if retry(&e) => {}
                        Err(e) => return Err(e),
                    }
                }
                head.clear();
                let mut offset = libc::off_t::try_from(range.offset)
                    .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
                let mut left = range.len;
                while left > 0 {
                    sock.writable().await?;
                    let sent = sock.try_io(Interest::WRITABLE, || {
                        // SAFETY: both descriptors are open for the call
                        // (the socket is borrowed, the file held by
                        // `range`); `offset` is a local the kernel updates.
                        let n = unsafe {
                            libc::sendfile(
                                sock.as_raw_fd(),
                                range.file.as_raw_fd(),
                                &mut offset,
                                left,
                            )
                        };
                        usize::try_from(n).map_err(|_| io::Error::last_os_error())
                    });
                    match sent {
                        Ok(0) => {
                            return Err(io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "the file ended before the reply's data",
                            ))
                        }
                        Ok(n) => left -= n.min(left),
                        Err(e) if retry(&e) => {}
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
        }
    };
}

/// A send to try again: the socket's buffer was full, or a signal came.
fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

sends_files!(tokio::net::tcp::OwnedWriteHalf);
sends_files!(tokio::net::unix::OwnedWriteHalf);

impl<S: AsyncWrite + Unpin + Send> SendFile for crate::locked::LockedWrite<S> {}
