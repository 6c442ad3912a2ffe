//! An asynchronous NBD client. Many tasks may issue requests on one
//! [`NbdClient`] at once; a writer task batches them onto the socket and a
//! reader task matches replies (in any order) to their cookies. With
//! [`ConnectOptions::tls`] the connection is upgraded with
//! `NBD_OPT_STARTTLS` before any other option, and a server that refuses
//! is not talked to in clear.

mod tls;

pub use tls::ClientTls;

use bytes::{Buf, Bytes, BytesMut};
use ferry_nbd::client::{self as codec, Reply};
use ferry_nbd::consts::*;
use ferry_nbd::{Command, ErrorCode, NbdError};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

#[derive(Debug, Error, Clone)]
pub enum ClientError {
    #[error("connection: {0}")]
    Io(String),
    #[error("protocol: {0}")]
    Protocol(#[from] NbdError),
    #[error("server answered {code}: {message}")]
    Request { code: ErrorCode, message: String },
    #[error("connection closed with the request in flight")]
    Disconnected,
    #[error("TLS: {0}")]
    Tls(String),
}

impl From<std::io::Error> for ClientError {
    fn from(e: std::io::Error) -> Self {
        ClientError::Io(e.to_string())
    }
}

/// What to negotiate.
#[derive(Debug, Clone, Default)]
pub struct ConnectOptions {
    pub structured_replies: bool,
    /// Meta contexts to select, e.g. `base:allocation`.
    pub meta_contexts: Vec<String>,
    /// Upgrade to TLS first, with these credentials.
    pub tls: Option<ClientTls>,
}

/// What the server said about the export.
#[derive(Debug, Clone, Default)]
pub struct ExportDetails {
    pub size: u64,
    pub flags: u16,
    pub min_block: u32,
    pub preferred_block: u32,
    pub max_block: u32,
    /// Selected contexts: (id, name).
    pub contexts: Vec<(u32, String)>,
    pub structured_replies: bool,
}

/// A finished request.
#[derive(Debug, Default)]
struct Completion {
    data: Option<Bytes>,
    extents: Vec<(u32, Vec<(u32, u32)>)>,
}

struct Pending {
    offset: u64,
    read_len: u32,
    buf: Option<BytesMut>,
    whole: Option<Bytes>,
    extents: Vec<(u32, Vec<(u32, u32)>)>,
    error: Option<ClientError>,
    done: oneshot::Sender<Result<Completion, ClientError>>,
}

type PendingMap = Arc<Mutex<HashMap<u64, Pending>>>;

/// How long a connection's whole negotiation (TCP, TLS, options) may take.
pub const HANDSHAKE_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);
/// Idle time before a connection's peer is probed (then every half of it,
/// four times): a vanished server is noticed within three times this.
pub const KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(2);
/// How long sent data may stay unacknowledged before the connection fails.
pub const USER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// One NBD connection.
pub struct NbdClient {
    tx: mpsc::Sender<(Bytes, Option<Bytes>)>,
    pending: PendingMap,
    /// Set (under the `pending` lock) once the reply reader has ended: a
    /// request submitted after it would never be answered, so it fails at
    /// once instead of waiting for ever.
    closed: Arc<AtomicBool>,
    next_cookie: AtomicU64,
    export: ExportDetails,
}

impl NbdClient {
    /// Connect and negotiate with `OPT_GO`.
    ///
    /// The whole negotiation must end within [`HANDSHAKE_LIMIT`], and the
    /// connection finds out about a server that vanished without closing
    /// it (its machine died, a connection the kernel lost) within seconds:
    /// TCP keepalive probes it when idle ([`KEEPALIVE`]) and unacknowledged
    /// data gives up after [`USER_TIMEOUT`]. A client that follows a
    /// volume elsewhere ([`ClientError::Io`] then) needs both.
    pub async fn connect(
        addr: &str,
        export: &str,
        opts: &ConnectOptions,
    ) -> Result<NbdClient, ClientError> {
        match tokio::time::timeout(HANDSHAKE_LIMIT, Self::negotiate(addr, export, opts)).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Io(format!(
                "{addr} did not finish the NBD handshake in {HANDSHAKE_LIMIT:?}"
            ))),
        }
    }

    async fn negotiate(
        addr: &str,
        export: &str,
        opts: &ConnectOptions,
    ) -> Result<NbdClient, ClientError> {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let sock = socket2::SockRef::from(&s);
        sock.set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE)
                .with_interval(KEEPALIVE / 2)
                .with_retries(4),
        )?;
        sock.set_tcp_user_timeout(Some(USER_TIMEOUT))?;
        let mut buf = greet(&mut s).await?;
        let Some(tls) = &opts.tls else {
            let details = handshake(&mut s, &mut buf, export, opts).await?;
            let (rd, wr) = s.into_split();
            return Ok(Self::start(rd, wr, details));
        };
        s.write_all(&codec::encode_option(OPT_STARTTLS, &[]))
            .await?;
        let r = next_option_reply(&mut s, &mut buf).await?;
        if r.reply_type != REP_ACK {
            return Err(ClientError::Tls(format!(
                "the server at {addr} does not offer TLS: {}",
                refused(&r)
            )));
        }
        if !buf.is_empty() {
            return Err(NbdError::UnexpectedReply("clear text after STARTTLS".into()).into());
        }
        let name = tls::server_name(addr).map_err(ClientError::Tls)?;
        let mut s = tls
            .connector()
            .connect(name, s)
            .await
            .map_err(|e| ClientError::Tls(format!("handshake with {addr}: {e}")))?;
        let details = handshake(&mut s, &mut buf, export, opts).await?;
        let (rd, wr) = tokio::io::split(s);
        Ok(Self::start(rd, wr, details))
    }

    fn start<R, W>(rd: R, wr: W, details: ExportDetails) -> NbdClient
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(1024);
        let pending: PendingMap = Arc::new(Mutex::new(HashMap::new()));
        let closed = Arc::new(AtomicBool::new(false));
        tokio::spawn(write_loop(wr, rx));
        tokio::spawn(read_loop(rd, pending.clone(), closed.clone()));
        NbdClient {
            tx,
            pending,
            closed,
            next_cookie: AtomicU64::new(1),
            export: details,
        }
    }

    pub fn export(&self) -> &ExportDetails {
        &self.export
    }

    pub fn size(&self) -> u64 {
        self.export.size
    }

    async fn submit(
        &self,
        cmd: Command,
        flags: u16,
        offset: u64,
        length: u32,
        payload: Option<Bytes>,
    ) -> Result<Completion, ClientError> {
        let cookie = self.next_cookie.fetch_add(1, Ordering::Relaxed);
        let (done, rx) = oneshot::channel();
        let read_len = if cmd == Command::Read { length } else { 0 };
        {
            let mut pending = self.pending.lock();
            if self.closed.load(Ordering::Acquire) {
                return Err(ClientError::Disconnected);
            }
            pending.insert(
                cookie,
                Pending {
                    offset,
                    read_len,
                    buf: None,
                    whole: None,
                    extents: Vec::new(),
                    error: None,
                    done,
                },
            );
        }
        let mut h = BytesMut::with_capacity(REQUEST_HEADER_LEN);
        codec::encode_request(&mut h, flags, cmd, cookie, offset, length);
        if self.tx.send((h.freeze(), payload)).await.is_err() {
            self.pending.lock().remove(&cookie);
            return Err(ClientError::Disconnected);
        }
        rx.await.map_err(|_| ClientError::Disconnected)?
    }

    pub async fn read(&self, offset: u64, len: u32) -> Result<Bytes, ClientError> {
        let c = self.submit(Command::Read, 0, offset, len, None).await?;
        Ok(c.data.unwrap_or_default())
    }

    pub async fn write(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), ClientError> {
        let len =
            u32::try_from(data.len()).map_err(|_| ClientError::Io("write too large".into()))?;
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        self.submit(Command::Write, flags, offset, len, Some(data))
            .await
            .map(drop)
    }

    pub async fn flush(&self) -> Result<(), ClientError> {
        self.submit(Command::Flush, 0, 0, 0, None).await.map(drop)
    }

    pub async fn trim(&self, offset: u64, len: u32) -> Result<(), ClientError> {
        self.submit(Command::Trim, 0, offset, len, None)
            .await
            .map(drop)
    }

    pub async fn write_zeroes(&self, offset: u64, len: u32, flags: u16) -> Result<(), ClientError> {
        self.submit(Command::WriteZeroes, flags, offset, len, None)
            .await
            .map(drop)
    }

    pub async fn cache(&self, offset: u64, len: u32) -> Result<(), ClientError> {
        self.submit(Command::Cache, 0, offset, len, None)
            .await
            .map(drop)
    }

    /// Extents per selected context: `(context id, [(length, flags)])`.
    pub async fn block_status(
        &self,
        offset: u64,
        len: u32,
        req_one: bool,
    ) -> Result<Vec<(u32, Vec<(u32, u32)>)>, ClientError> {
        let flags = if req_one { CMD_FLAG_REQ_ONE } else { 0 };
        Ok(self
            .submit(Command::BlockStatus, flags, offset, len, None)
            .await?
            .extents)
    }

    /// Send a raw request (for tests of server behaviour on odd requests).
    pub async fn raw(
        &self,
        cmd: Command,
        flags: u16,
        offset: u64,
        len: u32,
        payload: Option<Bytes>,
    ) -> Result<(), ClientError> {
        self.submit(cmd, flags, offset, len, payload)
            .await
            .map(drop)
    }

    /// Send NBD_CMD_DISC; the server finishes in-flight requests and closes.
    pub async fn disconnect(self) {
        let mut h = BytesMut::new();
        codec::encode_request(&mut h, 0, Command::Disc, 0, 0, 0);
        let _ = self.tx.send((h.freeze(), None)).await;
    }
}

async fn read_exact_buf<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
) -> Result<(), ClientError> {
    if s.read_buf(buf).await? == 0 {
        return Err(ClientError::Disconnected);
    }
    Ok(())
}

async fn next_option_reply<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
) -> Result<codec::OptionReply, ClientError> {
    loop {
        if let Some(r) = codec::decode_option_reply(buf)? {
            return Ok(r);
        }
        read_exact_buf(s, buf).await?;
    }
}

fn refused(r: &codec::OptionReply) -> ClientError {
    ClientError::Protocol(NbdError::OptionRefused {
        option: r.option,
        reply: r.reply_type,
        message: String::from_utf8_lossy(&r.data).into_owned(),
    })
}

/// Read the greeting and answer it; what was read beyond it stays in the
/// returned buffer.
async fn greet(s: &mut TcpStream) -> Result<BytesMut, ClientError> {
    let mut buf = BytesMut::with_capacity(4096);
    while buf.len() < 18 {
        read_exact_buf(s, &mut buf).await?;
    }
    let magic = buf.get_u64();
    let opt = buf.get_u64();
    let hflags = buf.get_u16();
    if magic != NBDMAGIC || opt != IHAVEOPT || hflags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(NbdError::BadMagic {
            what: "greeting",
            found: magic,
        }
        .into());
    }
    let mut cflags = FLAG_C_FIXED_NEWSTYLE;
    if hflags & FLAG_NO_ZEROES != 0 {
        cflags |= FLAG_C_NO_ZEROES;
    }
    s.write_all(&cflags.to_be_bytes()).await?;
    Ok(buf)
}

/// Options after the greeting (and after TLS, if any), ending with GO.
async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    buf: &mut BytesMut,
    export: &str,
    opts: &ConnectOptions,
) -> Result<ExportDetails, ClientError> {
    let mut d = ExportDetails::default();
    if opts.structured_replies {
        s.write_all(&codec::encode_option(OPT_STRUCTURED_REPLY, &[]))
            .await?;
        let r = next_option_reply(s, buf).await?;
        if r.reply_type != REP_ACK {
            return Err(refused(&r));
        }
        d.structured_replies = true;
        if !opts.meta_contexts.is_empty() {
            let q: Vec<&str> = opts.meta_contexts.iter().map(String::as_str).collect();
            s.write_all(&codec::encode_option(
                OPT_SET_META_CONTEXT,
                &codec::meta_context_data(export, &q),
            ))
            .await?;
            loop {
                let r = next_option_reply(s, buf).await?;
                match r.reply_type {
                    REP_ACK => break,
                    REP_META_CONTEXT if r.data.len() >= 4 => {
                        let id = u32::from_be_bytes(r.data[..4].try_into().expect("4"));
                        d.contexts
                            .push((id, String::from_utf8_lossy(&r.data[4..]).into_owned()));
                    }
                    _ => return Err(refused(&r)),
                }
            }
        }
    }
    s.write_all(&codec::encode_option(
        OPT_GO,
        &codec::go_data(export, &[INFO_BLOCK_SIZE]),
    ))
    .await?;
    loop {
        let r = next_option_reply(s, buf).await?;
        match r.reply_type {
            REP_ACK => break,
            REP_INFO if r.data.len() >= 2 => {
                let mut p = r.data.clone();
                match p.get_u16() {
                    INFO_EXPORT if p.len() >= 10 => {
                        d.size = p.get_u64();
                        d.flags = p.get_u16();
                    }
                    INFO_BLOCK_SIZE if p.len() >= 12 => {
                        d.min_block = p.get_u32();
                        d.preferred_block = p.get_u32();
                        d.max_block = p.get_u32();
                    }
                    _ => {}
                }
            }
            REP_INFO => {}
            _ => return Err(refused(&r)),
        }
    }
    if !buf.is_empty() {
        return Err(NbdError::UnexpectedReply("bytes after NBD_OPT_GO".into()).into());
    }
    Ok(d)
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut rx: mpsc::Receiver<(Bytes, Option<Bytes>)>,
) {
    let mut batch: Vec<Bytes> = Vec::with_capacity(128);
    while let Some((h, p)) = rx.recv().await {
        batch.push(h);
        batch.extend(p);
        while batch.len() < 128 {
            match rx.try_recv() {
                Ok((h, p)) => {
                    batch.push(h);
                    batch.extend(p);
                }
                Err(_) => break,
            }
        }
        if write_all_vectored(&mut wr, &mut batch).await.is_err() {
            return;
        }
    }
    let _ = wr.shutdown().await;
}

/// Write every buffer of `batch` with as few vectored writes as the socket
/// allows, flush, then empty `batch`. Shared by this client and the NBD
/// server. The flush matters over TLS: tokio-rustls accepts a write into
/// its session and returns once the socket would block, keeping records
/// it has not sent; the writer tasks then wait for their next message, not
/// for the socket, so without the flush a last reply (or request) could
/// sit in the session until the peer gave up (found 2026-11-28: nbdcopy
/// waited 10 minutes on a block-status reply over TLS). On TCP it does
/// nothing.
pub async fn write_all_vectored<W: AsyncWrite + Unpin>(
    wr: &mut W,
    batch: &mut Vec<Bytes>,
) -> std::io::Result<()> {
    let mut i = 0;
    while i < batch.len() {
        let slices: Vec<IoSlice<'_>> = batch[i..]
            .iter()
            .take(64)
            .map(|b| IoSlice::new(b))
            .collect();
        let mut n = wr.write_vectored(&slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 && i < batch.len() {
            let len = batch[i].len();
            if n >= len {
                n -= len;
                i += 1;
            } else {
                batch[i].advance(n);
                n = 0;
            }
        }
    }
    wr.flush().await?;
    batch.clear();
    Ok(())
}

fn finish(pending: &PendingMap, cookie: u64) {
    if let Some(p) = pending.lock().remove(&cookie) {
        let r = match p.error {
            Some(e) => Err(e),
            None => Ok(Completion {
                data: p.whole.or_else(|| p.buf.map(BytesMut::freeze)),
                extents: p.extents,
            }),
        };
        let _ = p.done.send(r);
    }
}

fn on_chunk(
    pending: &PendingMap,
    cookie: u64,
    ty: u16,
    mut payload: Bytes,
) -> Result<(), NbdError> {
    let mut map = pending.lock();
    let Some(p) = map.get_mut(&cookie) else {
        return Err(NbdError::UnexpectedReply(format!(
            "reply for unknown cookie {cookie}"
        )));
    };
    let bad = |d: &str| NbdError::Malformed {
        what: "structured chunk",
        detail: d.into(),
    };
    match ty {
        REPLY_TYPE_NONE => {}
        REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
            if payload.len() < 8 {
                return Err(bad("short offset chunk"));
            }
            let off = payload.get_u64();
            let len = if ty == REPLY_TYPE_OFFSET_DATA {
                payload.len() as u64
            } else if payload.len() >= 4 {
                u64::from(payload.get_u32())
            } else {
                return Err(bad("short hole chunk"));
            };
            let rel = off
                .checked_sub(p.offset)
                .ok_or_else(|| bad("chunk before the request"))?;
            if rel + len > u64::from(p.read_len) {
                return Err(bad("chunk past the request"));
            }
            if ty == REPLY_TYPE_OFFSET_DATA
                && rel == 0
                && len == u64::from(p.read_len)
                && p.buf.is_none()
            {
                p.whole = Some(payload);
            } else {
                let buf = p.buf.get_or_insert_with(|| {
                    let mut b = BytesMut::new();
                    b.resize(p.read_len as usize, 0);
                    b
                });
                if let Some(w) = p.whole.take() {
                    buf[..w.len()].copy_from_slice(&w);
                }
                if ty == REPLY_TYPE_OFFSET_DATA {
                    // The chunk was checked to lie inside the read (u32 lengths).
                    let (from, to) = (usize::try_from(rel), usize::try_from(rel + len));
                    if let (Ok(from), Ok(to)) = (from, to) {
                        buf[from..to].copy_from_slice(&payload);
                    }
                }
            }
        }
        REPLY_TYPE_BLOCK_STATUS => {
            if payload.len() < 4 || !(payload.len() - 4).is_multiple_of(8) {
                return Err(bad("block status length"));
            }
            let ctx = payload.get_u32();
            let mut ext = Vec::new();
            while payload.remaining() >= 8 {
                ext.push((payload.get_u32(), payload.get_u32()));
            }
            p.extents.push((ctx, ext));
        }
        t if t & 0x8000 != 0 => {
            let code = if payload.len() >= 4 {
                payload.get_u32()
            } else {
                5
            };
            let mlen = if payload.len() >= 2 {
                payload.get_u16() as usize
            } else {
                0
            };
            let msg = String::from_utf8_lossy(&payload[..mlen.min(payload.len())]).into_owned();
            p.error = Some(ClientError::Request {
                code: ErrorCode::from_wire(code).unwrap_or(ErrorCode::Io),
                message: msg,
            });
        }
        _ => {}
    }
    Ok(())
}

async fn read_loop<R: AsyncRead + Unpin>(mut rd: R, pending: PendingMap, closed: Arc<AtomicBool>) {
    let mut buf = BytesMut::with_capacity(1 << 20);
    let outcome: Result<(), ClientError> = async {
        loop {
            loop {
                let r = codec::decode_reply(&mut buf, |c| {
                    pending.lock().get(&c).map_or(0, |p| p.read_len)
                })?;
                let Some(r) = r else { break };
                match r {
                    Reply::Simple {
                        cookie,
                        error,
                        data,
                    } => {
                        if let Some(p) = pending.lock().get_mut(&cookie) {
                            match error {
                                Some(code) => {
                                    p.error = Some(ClientError::Request {
                                        code,
                                        message: String::new(),
                                    })
                                }
                                None if p.read_len > 0 => p.whole = Some(data),
                                None => {}
                            }
                        }
                        finish(&pending, cookie);
                    }
                    Reply::Chunk {
                        cookie,
                        flags,
                        ty,
                        payload,
                    } => {
                        on_chunk(&pending, cookie, ty, payload)?;
                        if flags & REPLY_FLAG_DONE != 0 {
                            finish(&pending, cookie);
                        }
                    }
                }
            }
            let want = codec::reply_len(&buf, |c| pending.lock().get(&c).map_or(0, |p| p.read_len))
                .map_or(0, |n| n.saturating_sub(buf.len()));
            buf.reserve(want.max(256 * 1024));
            if rd.read_buf(&mut buf).await? == 0 {
                return Err(ClientError::Disconnected);
            }
        }
    }
    .await;
    let err = outcome.err().unwrap_or(ClientError::Disconnected);
    // Under the lock that submissions take: every request is either
    // failed here or refused by `submit`, none left waiting.
    let mut pending = pending.lock();
    closed.store(true, Ordering::Release);
    for (_, p) in pending.drain() {
        let _ = p.done.send(Err(err.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that stops answering (it closed its side, or was killed
    /// while the kernel still takes our bytes): a request made after the
    /// reader saw the end fails at once. It used to wait for ever, and a
    /// guest behind `ferry host` hung on a storage daemon's restart.
    #[tokio::test]
    async fn a_request_after_the_server_went_away_fails_instead_of_waiting() {
        let (client, mut server) = tokio::io::duplex(1 << 16);
        let (rd, wr) = tokio::io::split(client);
        let c = NbdClient::start(
            rd,
            wr,
            ExportDetails {
                size: 1 << 20,
                ..Default::default()
            },
        );
        // The server's side stops sending; it still takes what we write.
        server.shutdown().await.unwrap();
        while !c.closed.load(Ordering::Acquire) {
            tokio::task::yield_now().await;
        }
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), c.read(0, 512)).await;
        assert!(matches!(r, Ok(Err(ClientError::Disconnected))), "{r:?}");
        drop(server);
    }

    /// A stream that takes writes into its own buffer and sends them only
    /// when flushed, as a TLS session does once its socket would block.
    struct HoldsUntilFlushed {
        held: Vec<u8>,
        sent: Vec<u8>,
    }

    impl AsyncWrite for HoldsUntilFlushed {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.held.extend_from_slice(buf);
            std::task::Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            let held = std::mem::take(&mut self.held);
            self.sent.extend(held);
            std::task::Poll::Ready(Ok(()))
        }

        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            self.poll_flush(cx)
        }
    }

    /// Every byte of a batch has left the stream when the write returns:
    /// the writer tasks wait for their next message afterwards, so bytes a
    /// TLS session kept would wait with them (a reply nobody sends).
    #[tokio::test]
    async fn a_written_batch_is_flushed_out_of_the_stream() {
        let mut w = HoldsUntilFlushed {
            held: Vec::new(),
            sent: Vec::new(),
        };
        let mut batch = vec![Bytes::from_static(b"reply one"), Bytes::from_static(b"two")];
        write_all_vectored(&mut w, &mut batch).await.unwrap();
        assert!(batch.is_empty() && w.held.is_empty(), "{:?}", w.held);
        assert_eq!(w.sent, b"reply onetwo");
    }
}
