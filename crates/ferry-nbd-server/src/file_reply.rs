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
/// range are written as any, then `sendfile` runs until the range is out,
/// waiting for room in the socket's buffer. A peer gone raises `SIGPIPE`
/// on `sendfile` (it takes no `MSG_NOSIGNAL`): Rust programs ignore it
/// from the start, and the call fails with `EPIPE` instead.
macro_rules! sends_files {
    ($half:ty) => {
        impl SendFile for $half {
            async fn send_file(
                &mut self,
                head: &mut Vec<Bytes>,
                range: &FileRange,
            ) -> io::Result<()> {
                ferry_client::write_all_vectored(self, head).await?;
                let sock = self.as_ref();
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
