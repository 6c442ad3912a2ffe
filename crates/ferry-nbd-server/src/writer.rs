//! The writer task of a connection: sends queued buffers with vectored
//! writes, and file ranges with `sendfile` (NBD replies here; the daemon's
//! iSCSI connections use it too), and releases what each reply held of its
//! connection's byte budget only once its bytes are written.

use crate::file_reply::{FileRange, SendFile};
use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// Bytes of the reply budgets (per connection and overall) a queued reply
/// holds until it is written.
#[derive(Debug, Default)]
pub struct Held {
    _conn: Option<OwnedSemaphorePermit>,
    _total: Option<OwnedSemaphorePermit>,
}

impl Held {
    pub fn new(conn: OwnedSemaphorePermit, total: Option<OwnedSemaphorePermit>) -> Held {
        Held {
            _conn: Some(conn),
            _total: total,
        }
    }
}

/// What one pass of the writer sends, in order: buffers, and file ranges
/// each sent after the buffers queued before it.
#[derive(Default)]
pub struct Outgoing {
    bytes: Vec<Bytes>,
    /// A range and how many of `bytes` go before it.
    files: Vec<(usize, FileRange)>,
}

impl Outgoing {
    pub fn push(&mut self, b: Bytes) {
        self.bytes.push(b);
    }

    pub fn push_file(&mut self, range: FileRange) {
        self.files.push((self.bytes.len(), range));
    }

    fn len(&self) -> usize {
        self.bytes.len() + self.files.len()
    }

    /// Write everything, then leave `self` empty.
    async fn write_to<W: SendFile>(&mut self, wr: &mut W) -> std::io::Result<()> {
        if self.files.is_empty() {
            return ferry_client::write_all_vectored(wr, &mut self.bytes).await;
        }
        let mut rest = std::mem::take(&mut self.bytes).into_iter();
        let mut done = 0;
        let mut head = Vec::new();
        for (before, range) in std::mem::take(&mut self.files) {
            head.extend(rest.by_ref().take(before - done));
            done = before;
            wr.send_file(&mut head, &range).await?;
        }
        head.extend(rest);
        ferry_client::write_all_vectored(wr, &mut head).await
    }
}

/// Something the writer task sends: one buffer or several.
pub trait Frames: Send + 'static {
    /// Append the buffers to `out`; what must live until they are
    /// written goes to `hold`.
    fn append_to(self, out: &mut Outgoing, hold: &mut Vec<Held>);
}

impl Frames for Bytes {
    fn append_to(self, out: &mut Outgoing, _: &mut Vec<Held>) {
        out.push(self);
    }
}

impl Frames for Vec<Bytes> {
    fn append_to(self, out: &mut Outgoing, _: &mut Vec<Held>) {
        out.bytes.extend(self);
    }
}

/// Several buffers and the budgets their replies hold (an iSCSI batch).
#[derive(Default)]
pub struct HeldFrames {
    pub frames: Vec<Bytes>,
    pub held: Vec<Held>,
}

impl Frames for HeldFrames {
    fn append_to(self, out: &mut Outgoing, hold: &mut Vec<Held>) {
        self.frames.append_to(out, hold);
        hold.extend(self.held);
    }
}

/// A reply, the file range its data is sent from if any (after `bytes`),
/// and the budget it holds.
pub struct Reply {
    pub bytes: Bytes,
    pub file: Option<FileRange>,
    pub held: Held,
}

impl Reply {
    /// A reply all in memory.
    pub fn new(bytes: Bytes, held: Held) -> Reply {
        Reply {
            bytes,
            file: None,
            held,
        }
    }
}

impl Frames for Reply {
    fn append_to(self, out: &mut Outgoing, hold: &mut Vec<Held>) {
        out.push(self.bytes);
        if let Some(range) = self.file {
            out.push_file(range);
        }
        hold.push(self.held);
    }
}

/// Send everything queued on `rx`, batching whatever is ready into one
/// vectored write. After a write error the rest is drained and dropped so
/// senders never block on a dead socket; at the end the socket is shut
/// down for writing.
pub async fn write_loop<W: SendFile, T: Frames>(mut wr: W, mut rx: mpsc::Receiver<T>) {
    const MOST: usize = 256;
    let mut batch = Outgoing {
        bytes: Vec::with_capacity(MOST),
        files: Vec::new(),
    };
    let mut hold: Vec<Held> = Vec::with_capacity(MOST);
    while let Some(first) = rx.recv().await {
        first.append_to(&mut batch, &mut hold);
        while batch.len() < MOST {
            match rx.try_recv() {
                Ok(b) => b.append_to(&mut batch, &mut hold),
                Err(_) => break,
            }
        }
        let r = batch.write_to(&mut wr).await;
        hold.clear();
        if let Err(e) = r {
            tracing::debug!(error = %e, "write failed; dropping what is still queued");
            while rx.recv().await.is_some() {}
            return;
        }
    }
    let _ = wr.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::file_reply::FileRange;
    use std::io::Write;
    use std::sync::Arc;
    use tokio::io::{AsyncRead, AsyncReadExt};

    /// The byte at `i` of a pattern file.
    fn at(i: usize) -> u8 {
        u8::try_from(i % 251).unwrap()
    }

    /// A file of `len` bytes, each its offset mod 251.
    fn pattern_file(len: usize) -> (tempfile::NamedTempFile, Arc<std::fs::File>) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..len).map(at).collect();
        f.write_all(&data).unwrap();
        let file = Arc::new(std::fs::File::open(f.path()).unwrap());
        (f, file)
    }

    /// Queue buffers and file ranges (replies, in order), close the queue,
    /// and read what the writer sent until it shut the stream.
    async fn sent<W, R>(wr: W, mut rd: R, file: &Arc<std::fs::File>) -> Vec<u8>
    where
        W: SendFile + 'static,
        R: AsyncRead + Unpin,
    {
        let (tx, rx) = mpsc::channel::<Reply>(16);
        let writer = tokio::spawn(write_loop(wr, rx));
        let range = |offset: u64, len: usize| FileRange {
            file: file.clone(),
            offset,
            len,
        };
        let replies = [
            (&b"head-1"[..], Some(range(0, 300_000))),
            (&b"plain"[..], None),
            (&b"head-2"[..], Some(range(4093, 3))),
            (&b"tail"[..], None),
        ];
        for (bytes, file) in replies {
            let r = Reply {
                bytes: bytes::Bytes::from_static(bytes),
                file,
                held: Held::default(),
            };
            tx.send(r).await.unwrap();
        }
        drop(tx);
        let mut got = Vec::new();
        rd.read_to_end(&mut got).await.unwrap();
        writer.await.unwrap();
        got
    }

    /// The reading half of a loopback connection's client end, and the
    /// writing half of its server end.
    async fn tcp_pair() -> (
        tokio::net::tcp::OwnedReadHalf,
        tokio::net::tcp::OwnedWriteHalf,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let (rd, _) = client.unwrap().into_split();
        let (_, wr) = accepted.unwrap().0.into_split();
        (rd, wr)
    }

    fn expected() -> Vec<u8> {
        let mut want = b"head-1".to_vec();
        want.extend((0..300_000).map(at));
        want.extend(b"plain");
        want.extend(b"head-2");
        want.extend((4093..4096).map(at));
        want.extend(b"tail");
        want
    }

    #[tokio::test]
    async fn file_ranges_go_out_by_sendfile_between_the_buffers_queued_around_them() {
        let (_keep, file) = pattern_file(400_000);
        let (rd, wr) = tcp_pair().await;
        assert_eq!(sent(wr, rd, &file).await, expected());
    }

    #[tokio::test]
    async fn a_half_that_cannot_sendfile_reads_the_range_and_writes_it() {
        let (_keep, file) = pattern_file(400_000);
        let (a, b) = tokio::io::duplex(1 << 16);
        let (_, wr) = crate::locked::split(a);
        assert_eq!(sent(wr, b, &file).await, expected());
    }

    /// A TLS connection over loopback: the client's stream, and the
    /// server's halves as the server splits them.
    async fn tls_pair() -> (
        tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
        crate::locked::LockedWrite<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
    ) {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let der = cert.cert.der().clone();
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(
            rustls_pki_types::PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der()),
        );
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (c, s) = tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        let (c, s) = tokio::join!(
            connector.connect(name, c.unwrap()),
            acceptor.accept(s.unwrap().0)
        );
        let (_, wr) = crate::locked::split(s.unwrap());
        (c.unwrap(), wr)
    }

    #[tokio::test]
    async fn file_ranges_go_out_encrypted_from_the_mapped_file_between_the_buffers_around_them() {
        let (_keep, file) = pattern_file(400_000);
        let (rd, wr) = tls_pair().await;
        assert_eq!(sent(wr, rd, &file).await, expected());
    }

    #[tokio::test]
    async fn a_file_cut_short_under_a_tls_reply_sends_none_of_the_missing_bytes() {
        // The file is cut to one page after its range was chosen: the
        // mapped pages past it are gone when the writer reads them.
        let (keep, file) = pattern_file(400_000);
        std::fs::OpenOptions::new()
            .write(true)
            .open(keep.path())
            .unwrap()
            .set_len(4096)
            .unwrap();
        let (mut rd, wr) = tls_pair().await;
        let (tx, rx) = mpsc::channel::<Reply>(4);
        let writer = tokio::spawn(write_loop(wr, rx));
        let reply = Reply {
            bytes: bytes::Bytes::from_static(b"hdr"),
            file: Some(FileRange {
                file: file.clone(),
                offset: 0,
                len: 300_000,
            }),
            held: Held::default(),
        };
        tx.send(reply).await.unwrap();
        let _ = tx
            .send(Reply::new(
                bytes::Bytes::from_static(b"never"),
                Held::default(),
            ))
            .await;
        drop(tx);
        let mut got = Vec::new();
        // The stream ends (cut, or reset) short of the whole reply.
        let _ = rd.read_to_end(&mut got).await;
        writer.await.unwrap();
        assert!(got.len() < 3 + 4096 + 1, "{} bytes went out", got.len());
        // What went out is the header and the file's own bytes, no zeroes
        // standing in for the pages that were cut off.
        let mut want = b"hdr".to_vec();
        want.extend((0..4096).map(at));
        assert!(want.starts_with(&got), "bytes not the file's went out");
    }

    #[tokio::test]
    async fn a_range_past_the_end_of_its_file_cuts_the_connection() {
        let (_keep, file) = pattern_file(1000);
        let (mut rd, wr) = tcp_pair().await;
        let (tx, rx) = mpsc::channel::<Reply>(4);
        let writer = tokio::spawn(write_loop(wr, rx));
        let range = FileRange {
            file: file.clone(),
            offset: 500,
            len: 4096,
        };
        let first = Reply {
            bytes: bytes::Bytes::from_static(b"hdr"),
            file: Some(range),
            held: Held::default(),
        };
        tx.send(first).await.unwrap();
        let after = Reply::new(bytes::Bytes::from_static(b"never"), Held::default());
        // The writer may already have stopped taking replies.
        let _ = tx.send(after).await;
        drop(tx);
        let mut got = Vec::new();
        // The stream ends (closed, or reset) short of the whole reply.
        let _ = rd.read_to_end(&mut got).await;
        writer.await.unwrap();
        assert!(got.len() < 3 + 4096, "{} bytes", got.len());
        assert!(!got.ends_with(b"never"));
    }
}
