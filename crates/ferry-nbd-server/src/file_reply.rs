//! Replies whose data goes from a file's cached pages without a copy into
//! a buffer of ours: on a plain socket (TCP or unix) the kernel sends it
//! (`sendfile(2)`); over TLS it is encrypted straight from the pages,
//! mapped for the reply ([`MappedRange`]). A write half that can do
//! neither reads the range and writes it ([`SendFile`]'s default).

use crate::locked::LockedWrite;
use crate::mapped::MappedRange;
use bytes::Bytes;
use std::fs::File;
use std::future::Future;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, Interest};
use tokio_rustls::server::TlsStream;

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
            copy_range(self, range).await
        }
    }
}

/// Read `range` into a buffer and write it: for a half that can neither
/// `sendfile` nor encrypt from a mapping.
async fn copy_range<W: AsyncWrite + Unpin>(wr: &mut W, range: &FileRange) -> io::Result<()> {
    let mut buf = vec![0u8; range.len];
    range.file.read_exact_at(&mut buf, range.offset)?;
    wr.write_all(&buf).await
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

/// `SendFile` over TLS: the range is mapped and encrypted from the mapping
/// into the TLS session a record at a time, each record's worth copied
/// under [`MappedRange::read`]'s guard and checked before any of it goes
/// to the socket. A page lost under the mapping (the file cut short) shuts
/// the socket down at once, so records made of zeroes in its place never
/// leave, and ends the connection, as `sendfile` does on a short file.
impl<S> SendFile for LockedWrite<TlsStream<S>>
where
    S: AsyncRead + AsyncWrite + AsRawFd + Unpin + Send,
{
    async fn send_file(&mut self, head: &mut Vec<Bytes>, range: &FileRange) -> io::Result<()> {
        ferry_client::write_all_vectored(self, head).await?;
        if range.len == 0 {
            return Ok(());
        }
        let map = match MappedRange::map(&range.file, range.offset, range.len) {
            Ok(map) => map,
            Err(e) => {
                // No mapping to be had (out of address space or map
                // count): the range is read into a buffer instead.
                tracing::debug!(error = %e, "mapping a reply's range failed; copying it");
                return copy_range(self, range).await;
            }
        };
        let mut pos = 0;
        std::future::poll_fn(|cx| self.with(|tls| send_mapped(tls, cx, &map, &mut pos))).await
    }
}

/// Push out what the session holds, then encrypt the next part of `map`
/// from `pos`, until all of it has gone to the socket.
fn send_mapped<S>(
    tls: &mut TlsStream<S>,
    cx: &mut Context<'_>,
    map: &MappedRange,
    pos: &mut usize,
) -> Poll<io::Result<()>>
where
    S: AsyncRead + AsyncWrite + AsRawFd + Unpin,
{
    let (io, conn) = tls.get_mut();
    loop {
        while conn.wants_write() {
            match conn.write_tls(&mut PollWriter { io: &mut *io, cx }) {
                Ok(0) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Poll::Pending,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        if *pos >= map.len() {
            return Poll::Ready(Ok(()));
        }
        // The session takes what its send buffer allows (64 KiB by
        // default), all of it encrypted before the guard is looked at.
        match map.read(*pos, |b| io::Write::write(&mut conn.writer(), b)) {
            Ok(Ok(0)) => {
                return Poll::Ready(Err(io::Error::other(
                    "the TLS session took none of the reply",
                )))
            }
            Ok(Ok(n)) => *pos += n,
            Ok(Err(e)) => return Poll::Ready(Err(e)),
            Err(lost) => {
                // SAFETY: shutdown(2) on the socket `io` owns and keeps open.
                unsafe { libc::shutdown(io.as_raw_fd(), libc::SHUT_RDWR) };
                return Poll::Ready(Err(lost.into()));
            }
        }
    }
}

/// A blocking-style writer over an async one for one poll: `WouldBlock`
/// where the socket is not ready (and `cx` will be woken).
struct PollWriter<'a, 'b, S> {
    io: &'a mut S,
    cx: &'a mut Context<'b>,
}

impl<S: AsyncWrite + Unpin> io::Write for PollWriter<'_, '_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match Pin::new(&mut *self.io).poll_write(self.cx, buf) {
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match Pin::new(&mut *self.io).poll_write_vectored(self.cx, bufs) {
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match Pin::new(&mut *self.io).poll_flush(self.cx) {
            Poll::Ready(r) => r,
            Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

/// A stream that is neither a socket nor TLS (tests): the default copy.
#[cfg(test)]
impl SendFile for LockedWrite<tokio::io::DuplexStream> {}
