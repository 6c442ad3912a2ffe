//! The destination side: accepts migrations, rebuilds every chunk it can
//! from its own volumes (re-hashed before use), asks for the rest, writes
//! what arrives, and takes the volume over on `Switch` if the digests match.
//!
//! The copy is created with `incoming` set and is not exported until the
//! switch. A new connection with the same migration id resumes into it:
//! chunks whose bytes already match the source's fingerprint are kept.

use super::tls::CertStore;
use super::transport::{send, Counted, FrameReader, WireCounters};
use super::{
    blocking, bulk, coalesce, hex, idx, short, unexpected, ChunkTable, MigrationError,
    StorageDaemon,
};
use ferry_api::MigrationId;
use ferry_index::Fingerprint;
use ferry_migration::{
    CopyBasis, DestinationOrder, Encoding, Message, PrintEntry, VolumeDescriptor, VERSION,
};
use ferry_storage::{CreateOptions, IncomingMigration, StorageError, Volume, ZeroMode};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A source that sends nothing for this long is given up on (it resumes
/// with a new connection).
const IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Candidates tried per fingerprint.
const MAX_CANDIDATES: usize = 4;

/// Accept migrations until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    state: Arc<dyn StorageDaemon>,
    shutdown: CancellationToken,
) {
    let local = listener.local_addr().ok();
    let plaintext = state.plaintext();
    if plaintext && !local.is_some_and(|a| a.ip().is_loopback()) {
        tracing::error!("migration.plaintext is only allowed on a loopback listener; refusing to accept migrations");
        return;
    }
    if plaintext {
        tracing::warn!(addr = ?local, "PLAINTEXT migration listener (no TLS): loopback only, never across sites");
    }
    let tls = if plaintext {
        None
    } else {
        match CertStore::new(state.pool().root()).server_config() {
            Ok(c) => Some(tokio_rustls::TlsAcceptor::from(c)),
            Err(e) => {
                tracing::error!(error = %e, "migration TLS unavailable; not accepting migrations");
                return;
            }
        }
    };
    // Caps overall and per peer address, and a deadline on the TLS
    // handshake: connections that never authenticate cannot hold the
    // listener (a source uses a few connections per migration).
    ferry_trust::listen::accept_loop(
        listener,
        MIGRATION_LIMITS,
        Arc::new(()),
        shutdown.clone(),
        Some(Duration::from_secs(5)),
        move |tcp, peer| {
            let _ = tcp.set_nodelay(true);
            let (st, tls, sd) = (state.clone(), tls.clone(), shutdown.clone());
            async move {
                let mut tcp = tcp;
                if tls.is_none() && answered_tls_client(&mut tcp, peer).await {
                    return;
                }
                let local = tcp.local_addr().ok();
                let counted = Counted::new(tcp, Arc::new(WireCounters::default()));
                let r = match tls {
                    None => receive(&st, counted, peer, local, &sd).await,
                    Some(acc) => {
                        match tokio::time::timeout(HANDSHAKE_DEADLINE, acc.accept(counted)).await {
                            Ok(Ok(s)) => receive(&st, s, peer, local, &sd).await,
                            Ok(Err(e)) => {
                                tracing::warn!(%peer, error = %e, "migration TLS handshake refused");
                                return;
                            }
                            Err(_) => {
                                tracing::warn!(%peer, "migration TLS handshake not finished in time; closed");
                                return;
                            }
                        }
                    }
                };
                match r {
                    Ok(name) if name.is_empty() => {}
                    Ok(name) => tracing::info!(%peer, volume = %name, "incoming migration complete"),
                    Err(e) => tracing::warn!(%peer, error = %e, "incoming migration stopped; the copy stays incomplete"),
                }
            }
        },
        |_tcp, _peer, _why| async {},
    )
    .await;
}

/// Connections the migration listener holds at once, overall and per peer
/// address.
pub const MIGRATION_LIMITS: ferry_trust::listen::ConnLimits = ferry_trust::listen::ConnLimits {
    max: 256,
    per_peer: 32,
};

/// Longest a connection may take to finish its TLS handshake.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// A TLS client at a plaintext listener (the two daemons disagree on
/// plaintext): answered with a TLS `protocol_version` alert, which its TLS
/// stack reports at once, instead of a close it would retry. `true` when
/// the connection was such a client (or sent nothing for a long time).
async fn answered_tls_client(tcp: &mut tokio::net::TcpStream, peer: SocketAddr) -> bool {
    let mut first = [0u8; 3];
    let n = match tokio::time::timeout(HELLO_WAIT, tcp.peek(&mut first)).await {
        Ok(Ok(n)) => n,
        Ok(Err(_)) => return false,
        Err(_) => return true,
    };
    if !crate::transport::tls_record(&first[..n]) {
        return false;
    }
    tracing::warn!(%peer, "a TLS client reached this plaintext migration listener; answered with a protocol_version alert");
    // Alert record: type 21, TLS 1.2 framing, 2 bytes: fatal (2), protocol_version (70).
    let alert = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46];
    let _ = tokio::io::AsyncWriteExt::write_all(tcp, &alert).await;
    true
}

/// How long a new connection may take to send its first bytes.
const HELLO_WAIT: Duration = Duration::from_secs(30);

/// What a Hello finds here.
enum Prepared {
    /// The copy to fill, and what it is.
    Copy(Arc<Volume>, CopyBasis),
    /// This migration already switched here (the source lost our `Done`).
    AlreadySwitched(Arc<Volume>),
}

/// Why this daemon will not take a migration; the source is told, and
/// does not retry.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("the copy here has a different size or block size")]
    SizeDiffers,
    #[error(
        "volume {name} here is the incomplete copy of a migration of another volume with that name ({other}, from {from}); if it is not wanted, delete it on this storage daemon: ferry volume delete {name}"
    )]
    OtherVolume {
        name: String,
        other: String,
        from: String,
    },
    #[error(
        "volume {name} here is being filled by another migration of it right now ({other}, from {from}); cancel that one or try again when it ends"
    )]
    BeingFilled {
        name: String,
        other: String,
        from: String,
    },
    #[error("volume {0} already exists here")]
    Exists(String),
    #[error("not enough space here: the copy needs {need} bytes, the pool has {free} free (and keeps migration.reserve_bytes)")]
    NoSpace { need: u64, free: u64 },
    #[error("chunk size {0} is not a power of two from 512 B to 64 KiB")]
    ChunkSize(u32),
    #[error("{0}")]
    Engine(#[from] MigrationError),
    #[error("{0}")]
    Storage(#[from] StorageError),
}

/// Refuse a copy that would not fit in the pool's file system, asked at
/// the `Hello` for the source's allocated bytes (less what a copy here
/// already holds). Where the pool shares extents, what the copy finds
/// here costs it next to nothing, and how much that is is known only once
/// the prints are answered: then only the reserve is checked now, and
/// what must cross the link with each `Want` ([`check_wanted_space`]).
fn check_space_at_hello(state: &dyn StorageDaemon, need: u64) -> Result<(), Refusal> {
    let shares = state.pool().shares_extents();
    check_space(state, if shares { 0 } else { need })
}

/// Before each `Want` on a pool that shares extents: refuse the copy if
/// what the link must still bring (the chunks asked for so far, less the
/// data already arrived, which the free space counts) does not fit.
fn check_wanted_space(
    state: &dyn StorageDaemon,
    stats: &FillStats,
    chunk: u64,
) -> Result<(), Refusal> {
    if !state.pool().shares_extents() {
        return Ok(());
    }
    check_space(
        state,
        stats
            .wanted
            .saturating_mul(chunk)
            .saturating_sub(stats.arrived),
    )
}

/// Refuse `need` more bytes that would not fit in the pool's file system
/// (with the reserve kept).
fn check_space(state: &dyn StorageDaemon, need: u64) -> Result<(), Refusal> {
    let free = state
        .pool()
        .free_bytes_for_new()
        .map_err(Refusal::Storage)?;
    if need.saturating_add(state.reserve_bytes()) > free {
        return Err(Refusal::NoSpace { need, free });
    }
    Ok(())
}

/// Open or create the copy for this migration. An incomplete copy of the
/// same volume (same identity) that another migration left, a move that
/// failed and is tried again under a new id, is resumed (every chunk is
/// checked against the source's prints before it is kept), or replaced if
/// the volume's geometry changed since; one of another volume is refused.
/// The copy the volume left here by the migration it arrived at the
/// source by (`arrived_under`) is a tracked return's basis.
fn prepare(
    state: &dyn StorageDaemon,
    id: &str,
    d: &VolumeDescriptor,
    peer: SocketAddr,
    arrived_under: &str,
) -> Result<Prepared, Refusal> {
    let source = peer.ip().to_string();
    match state.pool().get(&d.name) {
        Ok(v) if v.arrived_by(id) => Ok(Prepared::AlreadySwitched(v)),
        // The volume comes back to a daemon that still holds the copy it
        // left: that copy is the basis, only what changed since crosses.
        Ok(v) if v.is_moved_away_copy_of(&d.uuid) => {
            if v.size() != d.size || v.meta().block_size != d.block_size {
                return Err(Refusal::SizeDiffers);
            }
            check_space_at_hello(state, d.allocated.saturating_sub(v.allocated_bytes()))?;
            // Untouched since it left by the migration the volume arrived
            // at the source by: the source knows what changed since.
            let tracked =
                !arrived_under.is_empty() && v.left_under().as_deref() == Some(arrived_under);
            let mut inc = IncomingMigration::begun(id, &source);
            inc.tracked_since = tracked.then(|| arrived_under.to_string());
            v.reclaim_for_incoming(inc)?;
            tracing::info!(volume = %d.name, migration = %id, tracked, "the volume comes back: its moved-away copy is the basis");
            Ok(Prepared::Copy(
                v,
                if tracked {
                    CopyBasis::ReturnedTracked
                } else {
                    CopyBasis::Returned
                },
            ))
        }
        Ok(v) => match v.incoming() {
            Some(inc) if inc.id == id => {
                if v.size() != d.size {
                    return Err(Refusal::SizeDiffers);
                }
                check_space_at_hello(state, d.allocated.saturating_sub(v.allocated_bytes()))?;
                // Another attempt of a tracked return: what it left
                // untouched is still the copy the volume left here.
                let tracked = !arrived_under.is_empty()
                    && inc.tracked_since.as_deref() == Some(arrived_under);
                v.adopt_incoming(id, &source)?;
                Ok(Prepared::Copy(
                    v,
                    if tracked {
                        CopyBasis::ReturnedTracked
                    } else {
                        CopyBasis::Resumed
                    },
                ))
            }
            Some(inc) if v.meta().uuid.as_bytes() == &d.uuid => {
                if !v.held_by().is_empty() {
                    return Err(Refusal::BeingFilled {
                        name: d.name.clone(),
                        other: inc.id,
                        from: inc.source,
                    });
                }
                let m = v.meta();
                let same_shape = v.size() == d.size
                    && m.block_size == d.block_size
                    && m.physical_block_size.unwrap_or(m.block_size)
                        == d.physical_block_size.max(d.block_size);
                if !same_shape {
                    tracing::info!(volume = %d.name, migration = %id, left_by = %inc.id, "replacing the incomplete copy a failed migration left: the volume's size or block size changed");
                    state.pool().delete(&d.name, false)?;
                    return create_copy(state, id, d, &source, CopyBasis::LeftoverReplaced);
                }
                check_space_at_hello(state, d.allocated.saturating_sub(v.allocated_bytes()))?;
                v.adopt_incoming(id, &source)?;
                tracing::info!(volume = %d.name, migration = %id, left_by = %inc.id, "resuming into the incomplete copy a failed migration of this volume left");
                Ok(Prepared::Copy(v, CopyBasis::LeftoverResumed))
            }
            Some(inc) => Err(Refusal::OtherVolume {
                name: d.name.clone(),
                other: inc.id,
                from: inc.source,
            }),
            None => Err(Refusal::Exists(d.name.clone())),
        },
        Err(StorageError::NotFound(_)) => create_copy(state, id, d, &source, CopyBasis::New),
        Err(e) => Err(e.into()),
    }
}

/// Create the incomplete copy migration `id` fills, with the source
/// volume's identity.
fn create_copy(
    state: &dyn StorageDaemon,
    id: &str,
    d: &VolumeDescriptor,
    source: &str,
    basis: CopyBasis,
) -> Result<Prepared, Refusal> {
    check_space_at_hello(state, d.allocated)?;
    let uuid = uuid::Uuid::from_bytes(d.uuid);
    let opts = CreateOptions {
        size: d.size,
        block_size: d.block_size,
        physical_block_size: Some(d.physical_block_size),
        identity: Some((uuid, d.wwn.clone())),
        incoming: Some(IncomingMigration::begun(id, source)),
        ..CreateOptions::default()
    };
    Ok(state
        .pool()
        .create(&d.name, &opts)
        .map(|v| Prepared::Copy(v, basis))?)
}

/// Chunks still missing, with the source's key of each.
type Missing = Vec<(u64, u64)>;

/// The full fingerprint of `block` if its key is `key`: a block found
/// here is used for a chunk only then (and the digest checks the rest).
fn keyed(block: &[u8], key: u64) -> Option<Fingerprint> {
    let fp = Fingerprint::of(block);
    (fp.key() == key).then_some(fp)
}

/// The first 16 bytes of a chunk's BLAKE3: what the chunk tables keep.
type Print = [u8; 16];

/// What the prints phase found.
#[derive(Debug, Default)]
struct FillStats {
    local: u64,
    buddy: u64,
    resumed: u64,
    /// Chunks asked of the source (its `Want`s): what the link brings.
    wanted: u64,
    /// Data bytes (as written) arrived from the source so far.
    arrived: u64,
    /// Chunks of a tracked return recorded from this copy's index, unread.
    own_unread: u64,
    /// Time spent finding and placing the `local` chunks (lookups that
    /// found nothing included).
    local_s: f64,
}

/// The least a copy must rebuild from blocks held here for its time to be
/// told to the daemon ([`StorageDaemon::local_rebuild_measured`]): less is
/// mostly the page cache's speed and the write-behind's first steps.
pub const MIN_MEASURED_REBUILD: u64 = 16 << 20;

/// Per-connection state.
struct Receiver {
    state: Arc<dyn StorageDaemon>,
    vol: Arc<Volume>,
    table: Arc<ChunkTable>,
    chunk: u64,
    resumed: bool,
    /// The source sends `Same` runs: chunks this copy holds as they are.
    tracked: bool,
    use_index: bool,
    /// The connection's zstd stream, once the first piece arrives.
    stream: parking_lot::Mutex<Option<super::stream::StreamDecoder>>,
    /// Bytes written since the last [`Volume::write_behind`].
    unsynced: std::sync::atomic::AtomicU64,
    /// The source's iSCSI port, kept with the volume once it arrives.
    source_port: Option<ferry_storage::PeerPort>,
}

/// How much a destination writes between two write-behind steps: its
/// dirty page cache stays near twice this, so a round's flush (and the
/// writeback burst that delays the guest's own flushes on a shared disk)
/// stays small.
const WRITE_BEHIND_STEP: u64 = 8 << 20;

/// Threads filling chunks from local blocks at once where each read and
/// write waits for the network (an RBD image: about 1 ms each).
const FILL_THREADS: usize = 16;

/// Most consecutive chunks read and written together when filling from
/// local blocks in order.
const FILL_RUN: usize = 256;

impl Receiver {
    /// Write a block that arrived or was found, and keep the volume's
    /// unwritten data bounded.
    fn put(&self, offset: u64, data: &[u8]) -> Result<(), MigrationError> {
        self.vol.write_at(offset, data, false)?;
        self.written(data.len() as u64);
        Ok(())
    }

    /// Count `len` bytes just written to the page cache, and start their
    /// writeback every [`WRITE_BEHIND_STEP`] (else a copy of many GB
    /// waits for all of it at its commit).
    fn written(&self, len: u64) {
        use std::sync::atomic::Ordering;
        let n = self.unsynced.fetch_add(len, Ordering::Relaxed) + len;
        if n >= WRITE_BEHIND_STEP {
            self.unsynced.store(0, Ordering::Relaxed);
            // Advisory: a file system without sync_file_range still gets
            // every round's flush.
            if let Err(e) = self.vol.write_behind() {
                tracing::debug!(error = %e, "write-behind refused");
            }
        }
    }

    /// Handle one `Prints` frame (blocking): fill what can be filled here,
    /// return the chunks (with their prints) still missing.
    fn prints(
        &self,
        first: u64,
        entries: &[PrintEntry],
        stats: &mut FillStats,
    ) -> Result<Missing, MigrationError> {
        let total = self.table.chunks();
        let mut want = Vec::new();
        // Chunks to be found locally are gathered and filled after the
        // frame is read, runs of consecutive chunks together (one read,
        // one write or one shared range); where each I/O waits for a
        // network round trip (an RBD image), by several threads at once.
        let mut deferred: Vec<(u64, u64)> = Vec::new();
        let mut i = first;
        let mut buf = vec![0u8; usize::try_from(self.chunk).unwrap_or(usize::MAX)];
        for e in entries {
            if i >= total {
                return Err(MigrationError::BadData(format!(
                    "fingerprint for chunk {i} past the end ({total} chunks)"
                )));
            }
            match *e {
                PrintEntry::Zero(n) => {
                    let n = u64::from(n).min(total - i);
                    if self.resumed {
                        let off = i * self.chunk;
                        let len = (n * self.chunk).min(self.vol.size() - off);
                        self.vol.write_zeroes(
                            off,
                            len,
                            ZeroMode {
                                may_punch: true,
                                fast_only: false,
                            },
                            false,
                        )?;
                    }
                    self.table.set_zero(i, n);
                    i += n;
                }
                PrintEntry::Same(n) => {
                    if !self.tracked {
                        return Err(MigrationError::BadData(
                            "unchanged chunks claimed, but this copy is not a tracked return's"
                                .into(),
                        ));
                    }
                    let n = u64::from(n).min(total - i);
                    stats.own_unread += self.record_own(i, n)?;
                    i += n;
                }
                PrintEntry::Key(key) => {
                    let len = self.table.len_of(i);
                    let b = &mut buf[..len];
                    if self.resumed {
                        self.vol.read_at(i * self.chunk, b)?;
                        if let Some(fp) = keyed(b, key) {
                            self.table.set(i, fp.0);
                            stats.resumed += 1;
                            i += 1;
                            continue;
                        }
                    }
                    if self.use_index && len as u64 == self.chunk {
                        deferred.push((i, key));
                    } else {
                        want.push((i, key));
                    }
                    i += 1;
                }
            }
        }
        let t = std::time::Instant::now();
        let filled = self.fill_local_runs(deferred)?;
        stats.local_s += t.elapsed().as_secs_f64();
        for (chunk, key, found) in filled {
            match found {
                Some(p) => {
                    self.table.set_short(chunk, p);
                    stats.local += 1;
                }
                None => want.push((chunk, key)),
            }
        }
        want.sort_unstable();
        Ok(want)
    }

    /// Record chunks `first..first + n` as this copy holds them (the
    /// source says they are unchanged since the volume left here; the
    /// digest checks its claim against this copy's prints): from this
    /// volume's index where its prints are current, unread, as the source
    /// prints them from its own (a return then costs what changed, not
    /// the disk's size), else read and hashed. A block changed behind the
    /// daemon's back is not marked, so its stale print passes here as it
    /// does at the source, until the index hashes the copy again. Returns
    /// how many came from the index.
    fn record_own(&self, first: u64, n: u64) -> Result<u64, MigrationError> {
        const PIECE: u64 = 8 << 20;
        let known = self.own_prints(first, n);
        let unread = known.iter().flatten().count() as u64;
        let size = self.vol.size();
        let mut buf = Vec::new();
        let mut unknown = Vec::new();
        for c in first..first + n {
            match known.get(idx(c - first)).copied().flatten() {
                Some(p) if p == ferry_index::prints::ZERO_ENTRY => self.table.set_zero(c, 1),
                Some(p) => self.table.set_short(c, p),
                None => unknown.push(c),
            }
        }
        for (start, count) in coalesce(unknown) {
            let mut off = start * self.chunk;
            let end = ((start + u64::from(count)) * self.chunk).min(size);
            while off < end {
                let len = (end - off).min(PIECE);
                buf.resize(usize::try_from(len).unwrap_or(usize::MAX), 0);
                self.vol.read_sparse_at(off, &mut buf)?;
                self.table.record(off / self.chunk, &buf);
                off += len;
            }
        }
        Ok(unread)
    }

    /// The prints this volume's own index keeps of its whole chunks
    /// `first..first + n`, each `None` where it has none or the chunk was
    /// written since it was printed (the index's bitmap marks it, looked
    /// at under the prints' lock). Empty without a current index. Only
    /// this migration writes the copy, and none of its writes is under way
    /// while a `Prints` frame is answered.
    fn own_prints(&self, first: u64, n: u64) -> Vec<Option<Print>> {
        // A shared image's other gateways write it without these marks.
        if !self.use_index || self.vol.shared() || self.vol.write_mark().is_none() {
            return Vec::new();
        }
        let whole = (self.vol.size() / self.chunk).saturating_sub(first).min(n);
        let Some(k) =
            super::known_prints(self.state.index(), &self.vol, self.chunk, first, idx(whole))
        else {
            return Vec::new();
        };
        k.entries
            .into_iter()
            .zip(k.written)
            .map(|(p, written)| (!written).then_some(p))
            .collect()
    }

    /// [`Receiver::fill_local`] for each `(chunk, key)`, runs of
    /// consecutive chunks read and written whole where the blocks lie in
    /// the same order here (a disk made from a template this site holds);
    /// on up to [`FILL_THREADS`] threads where each I/O waits for the
    /// network, on this one on a page-cached file. The first error ends it.
    fn fill_local_runs(
        &self,
        todo: Vec<(u64, u64)>,
    ) -> Result<Vec<(u64, u64, Option<Print>)>, MigrationError> {
        if todo.is_empty() {
            return Ok(Vec::new());
        }
        let mut runs: Vec<&[(u64, u64)]> = Vec::new();
        let mut start = 0;
        for i in 1..=todo.len() {
            if i == todo.len() || todo[i].0 != todo[i - 1].0 + 1 || i - start == FILL_RUN {
                runs.push(&todo[start..i]);
                start = i;
            }
        }
        if self.vol.page_cached() {
            let mut out = Vec::with_capacity(todo.len());
            for run in runs {
                out.extend(self.fill_run(run)?);
            }
            return Ok(out);
        }
        let threads = FILL_THREADS.min(runs.len());
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..threads)
                .map(|t| {
                    let mine: Vec<&[(u64, u64)]> =
                        runs.iter().skip(t).step_by(threads).copied().collect();
                    s.spawn(move || {
                        let mut out = Vec::new();
                        for run in mine {
                            out.extend(self.fill_run(run)?);
                        }
                        Ok::<_, MigrationError>(out)
                    })
                })
                .collect();
            let mut out = Vec::with_capacity(todo.len());
            for w in workers {
                out.extend(w.join().map_err(|_| {
                    MigrationError::BadData("a local fill thread panicked".into())
                })??);
            }
            Ok(out)
        })
    }

    /// Fill a run of consecutive chunks: the leading chunks the index's
    /// current prints vouch for are placed unread
    /// ([`Receiver::place_unread`]); of the rest, where the first chunk's
    /// block is found here, the blocks after it are read with it in one
    /// read, and every span of them that matches its print is written in
    /// one write, or shares the found volume's extents where the file
    /// system can (the found volume unwritten from before the read to
    /// after the sharing, or the span is written after all); the others
    /// are looked up alone.
    fn fill_run(
        &self,
        run: &[(u64, u64)],
    ) -> Result<Vec<(u64, u64, Option<Print>)>, MigrationError> {
        let mut out = Vec::with_capacity(run.len());
        let placed = self.place_unread(run, &mut out)?;
        if placed < run.len() {
            out.extend(self.fill_run_read(&run[placed..])?);
        }
        Ok(out)
    }

    /// Place, without reading or hashing them here, the leading chunks of
    /// `run` that one volume here holds in a row as its index's prints
    /// say: shared extents where the pool shares them, else a copy the
    /// kernel makes (`copy_file_range`). The prints are current (the
    /// volume's [`ferry_index::INDEX_BITMAP`] does not mark them, looked
    /// at under their lock, after a write mark taken with no writer
    /// inside) and no write entered the volume until the placing ended.
    /// The digest cannot catch a stale print here: both ends agree on it.
    /// Pushes their prints to `out`; returns how many (0: read and check
    /// them).
    fn place_unread(
        &self,
        run: &[(u64, u64)],
        out: &mut Vec<(u64, u64, Option<Print>)>,
    ) -> Result<usize, MigrationError> {
        let index = self.state.index();
        // Placed only by sharing extents, or by the kernel's copy into a
        // volume that goes through the page cache (an RBD image does not).
        let shares = self.state.pool().shares_extents();
        let copies = self.vol.page_cached();
        if !(shares || copies) || u64::from(index.block_size()) != self.chunk {
            return Ok(0);
        }
        let cands = index
            .lookup_key(run[0].1, MAX_CANDIDATES)
            .unwrap_or_default();
        for (name, block) in cands {
            let Ok(v) = self.state.pool().reader(&name) else {
                continue;
            };
            // A volume another gateway writes: its marks are not ours.
            if v.shared() && v.read_only() || Arc::ptr_eq(&v, &self.vol) {
                continue;
            }
            let off = block * self.chunk;
            if off >= v.size() {
                continue;
            }
            let Some(mark) = v.write_mark() else {
                continue;
            };
            let n = run.len().min(idx((v.size() - off) / self.chunk));
            let kept: Vec<Print> = super::known_prints(index, &v, self.chunk, block, n)
                .map(|k| {
                    k.entries
                        .into_iter()
                        .zip(k.written)
                        .zip(run)
                        .take_while(|&((p, written), &(_, key))| {
                            p != ferry_index::prints::ZERO_ENTRY
                                && ferry_index::prints::key_of(&p) == key
                                && !written
                        })
                        .map(|((p, _), _)| p)
                        .collect()
                })
                .unwrap_or_default();
            if kept.is_empty() {
                continue;
            }
            let (at, len) = (run[0].0 * self.chunk, kept.len() as u64 * self.chunk);
            let shared = shares && self.vol.share_from(&v, off, at, len)?;
            // Not copied by the kernel into a volume that bypasses the page
            // cache: it would move 64 KiB at a time, each write waited for,
            // where the read path overlaps its reads and writes.
            let placed =
                shared || (copies && v.page_cached() && self.vol.copy_from(&v, off, at, len)?);
            if placed && !shared {
                self.written(len);
            }
            if placed && !v.written_since(mark) {
                let n = kept.len();
                for (&(c, k), p) in run.iter().zip(kept) {
                    out.push((c, k, Some(p)));
                }
                return Ok(n);
            }
            // Not placed, or written meanwhile: the read path writes what
            // it checks over whatever was placed.
            return Ok(0);
        }
        Ok(0)
    }

    /// [`Receiver::fill_run`] by reading and hashing what it finds.
    fn fill_run_read(
        &self,
        run: &[(u64, u64)],
    ) -> Result<Vec<(u64, u64, Option<Print>)>, MigrationError> {
        let chunk = usize::try_from(self.chunk).unwrap_or(usize::MAX);
        let mut out = Vec::with_capacity(run.len());
        let mut one = vec![0u8; chunk];
        let key0 = run[0].1;
        let cands = self
            .state
            .index()
            .lookup_key(key0, MAX_CANDIDATES)
            .unwrap_or_default();
        let mut buf = Vec::new();
        let placed = cands.into_iter().find_map(|(name, block)| {
            let v = self.state.pool().reader(&name).ok()?;
            let off = block * self.chunk;
            let len = run.len() * chunk;
            if off + len as u64 > v.size() {
                return None;
            }
            let mark = v.write_mark();
            buf.resize(len, 0);
            v.read_at(off, &mut buf).ok()?;
            keyed(&buf[..chunk], key0).map(|_| (v, off, mark))
        });
        let Some((found, found_off, mark)) = placed else {
            for &(c, k) in run {
                out.push((c, k, self.fill_local(c, k, &mut one)?.map(|f| short(&f.0))));
            }
            return Ok(out);
        };
        let mut i = 0;
        while i < run.len() {
            let start = i;
            let mut prints = Vec::new();
            while i < run.len() {
                match keyed(&buf[i * chunk..(i + 1) * chunk], run[i].1) {
                    Some(fp) => prints.push(short(&fp.0)),
                    None => break,
                }
                i += 1;
            }
            if !prints.is_empty() {
                let at = run[start].0 * self.chunk;
                let from = found_off + (start * chunk) as u64;
                let shared = match mark {
                    Some(m) => {
                        self.vol
                            .share_from(&found, from, at, ((i - start) * chunk) as u64)?
                            && !found.written_since(m)
                    }
                    None => false,
                };
                if !shared {
                    self.put(at, &buf[start * chunk..i * chunk])?;
                }
                for (j, fp) in prints.into_iter().enumerate() {
                    out.push((run[start + j].0, run[start + j].1, Some(fp)));
                }
            }
            if i < run.len() {
                let (c, k) = run[i];
                out.push((c, k, self.fill_local(c, k, &mut one)?.map(|f| short(&f.0))));
                i += 1;
            }
        }
        Ok(out)
    }

    /// Write the blocks buddies sent that match their prints (blocking);
    /// returns what is still missing and how many were filled.
    fn fill_from_buddies(
        &self,
        missing: Missing,
        found: Vec<Option<bytes::Bytes>>,
    ) -> Result<(Missing, u64), MigrationError> {
        let mut still = Vec::new();
        let mut filled = 0;
        for ((chunk, key), block) in missing.into_iter().zip(found) {
            match block
                .filter(|b| b.len() == self.table.len_of(chunk))
                .and_then(|b| keyed(&b, key).map(|fp| (b, fp)))
            {
                Some((b, fp)) => {
                    self.put(chunk * self.chunk, &b)?;
                    self.table.set(chunk, fp.0);
                    filled += 1;
                }
                None => still.push((chunk, key)),
            }
        }
        Ok((still, filled))
    }

    /// Look the key up in the local index, hash each candidate, and write
    /// the first whose fingerprint has the key; its fingerprint is returned.
    fn fill_local(
        &self,
        chunk: u64,
        key: u64,
        buf: &mut [u8],
    ) -> Result<Option<Fingerprint>, MigrationError> {
        let cands = match self.state.index().lookup_key(key, MAX_CANDIDATES) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "index lookup failed; asking the source");
                return Ok(None);
            }
        };
        for (name, block) in cands {
            let Ok(v) = self.state.pool().reader(&name) else {
                continue;
            };
            let off = block * self.chunk;
            if off + self.chunk > v.size() || v.read_at(off, buf).is_err() {
                continue;
            }
            if let Some(fp) = keyed(buf, key) {
                self.put(chunk * self.chunk, buf)?;
                return Ok(Some(fp));
            }
        }
        Ok(None)
    }

    /// Write one `Data` frame (blocking).
    fn data(
        &self,
        offset: u64,
        encoding: Encoding,
        raw_len: u32,
        bytes: &[u8],
    ) -> Result<(), MigrationError> {
        if !offset.is_multiple_of(self.chunk) {
            return Err(MigrationError::BadData(format!(
                "data at {offset} is not chunk aligned"
            )));
        }
        let raw = match encoding {
            Encoding::Raw => std::borrow::Cow::Borrowed(bytes),
            Encoding::Zstd => std::borrow::Cow::Owned(
                zstd::bulk::decompress(bytes, raw_len as usize)
                    .map_err(|e| MigrationError::BadData(format!("bad zstd data: {e}")))?,
            ),
            Encoding::ZstdStream => {
                let mut st = self.stream.lock();
                let dec = match st.as_mut() {
                    Some(d) => d,
                    None => st.insert(super::stream::StreamDecoder::new()?),
                };
                std::borrow::Cow::Owned(
                    dec.piece(bytes, raw_len as usize)
                        .map_err(|e| MigrationError::BadData(format!("bad zstd stream: {e}")))?,
                )
            }
        };
        if raw.len() != raw_len as usize {
            return Err(MigrationError::BadData(format!(
                "data frame says {raw_len} bytes, holds {}",
                raw.len()
            )));
        }
        self.put(offset, &raw)?;
        self.table.record(offset / self.chunk, &raw);
        Ok(())
    }
}

/// Tell the source why not, and end.
async fn refuse<W: AsyncWrite + Unpin, T>(wr: &mut W, reason: String) -> Result<T, MigrationError> {
    send(
        wr,
        &Message::Refuse {
            reason: reason.clone(),
        },
    )
    .await?;
    Err(MigrationError::Refused(reason))
}

/// Answer one `Prints` frame: rebuild what the volume's index (or a resumed
/// copy) holds, ask the site's buddies for the rest, and send the `Want`
/// of what must still cross, empty when nothing does (protocol version 4:
/// the source judges from them whether its prints pay).
async fn answer_prints<W: AsyncWrite + Unpin + Send>(
    state: &Arc<dyn StorageDaemon>,
    rx: &Arc<Receiver>,
    wr: &mut W,
    (stats, buddies): (&mut FillStats, &mut Option<super::buddy::Buddies>),
    (first_chunk, entries, chunk): (u64, Vec<PrintEntry>, u32),
) -> Result<(), MigrationError> {
    let r = rx.clone();
    let mut s = std::mem::take(stats);
    let (mut missing, s) = bulk("prints", move || {
        let w = r.prints(first_chunk, &entries, &mut s)?;
        Ok((w, s))
    })
    .await?;
    *stats = s;
    if !missing.is_empty() && rx.use_index && !state.buddies().is_empty() {
        if buddies.is_none() {
            *buddies = Some(super::buddy::Buddies::connect(state.as_ref()).await);
        }
        if let Some(b) = buddies.as_mut().filter(|b| !b.is_empty()) {
            let keys: Vec<u64> = missing.iter().map(|m| m.1).collect();
            let found = b.fetch(chunk, &keys).await;
            let r = rx.clone();
            let (still, n) = bulk("buddies", move || r.fill_from_buddies(missing, found)).await?;
            stats.buddy += n;
            missing = still;
        }
    }
    // Every Prints frame gets its Want, empty when nothing of
    // it is needed: the source judges from them whether its
    // prints pay (protocol version 4).
    stats.wanted += missing.len() as u64;
    if let Err(no) = check_wanted_space(state.as_ref(), stats, rx.chunk) {
        let reason = no.to_string();
        tracing::warn!(%reason, "refusing the copy while its prints are answered");
        let _ = send(
            wr,
            &Message::Abort {
                reason: reason.clone(),
            },
        )
        .await;
        return Err(MigrationError::Refused(reason));
    }
    let ranges = coalesce(missing.iter().map(|m| m.0));
    send(wr, &Message::Want { ranges }).await?;
    Ok(())
}

/// Compare the source's digest with this copy's (flushed first) and answer
/// `DigestResult`; whether they match.
async fn check_digest<W: AsyncWrite + Unpin + Send>(
    rx: &Arc<Receiver>,
    wr: &mut W,
    name: &str,
    digest: [u8; 32],
) -> Result<bool, MigrationError> {
    let r = rx.clone();
    let mine = blocking(move || {
        r.vol.flush()?;
        Ok(r.table.digest())
    })
    .await?;
    let matches = mine == digest;
    if !matches {
        tracing::error!(volume = %name, source = %hex(&digest), destination = %hex(&mine), "migration digest mismatch");
        if rx.tracked {
            // A claim of unchanged chunks was wrong: no attempt trusts
            // this copy again.
            let v = rx.vol.clone();
            blocking(move || Ok(v.untrack_incoming()?)).await?;
        }
    }
    send(
        wr,
        &Message::DigestResult {
            matches,
            digest: mine,
        },
    )
    .await?;
    Ok(matches)
}

/// Take the volume: flush it, mark the copy complete (with the source's
/// iSCSI port) and answer `Done` with where its clients go now.
async fn commit<W: AsyncWrite + Unpin + Send>(
    state: &Arc<dyn StorageDaemon>,
    rx: &Arc<Receiver>,
    wr: &mut W,
    local: Option<SocketAddr>,
) -> Result<(), MigrationError> {
    let v = rx.vol.clone();
    let source = rx.source_port.clone();
    let chunk = u32::try_from(rx.chunk).unwrap_or(u32::MAX);
    blocking(move || {
        let t = std::time::Instant::now();
        v.flush()?;
        let flushed = t.elapsed();
        // Before anything can write the volume here: a return knows what
        // changed since (created when the copy was opened: cleared, no
        // metadata written in the pause).
        super::track_arrival(&v, chunk)?;
        let tracked = t.elapsed();
        v.complete_incoming(source)?;
        tracing::debug!(?flushed, ?tracked, completed = ?t.elapsed(), "commit: flushed, arrival tracked, copy complete");
        Ok(())
    })
    .await?;
    send(wr, &committed(state, &rx.vol, local)).await?;
    Ok(())
}

/// Serve one migration after the greeting: prints, data, rounds, the
/// digest and the switch, each message checked against the protocol's
/// order first. Returns the volume's name once it switched here.
#[allow(clippy::too_many_arguments)]
async fn transfer<R, W>(
    state: &Arc<dyn StorageDaemon>,
    rx: &Arc<Receiver>,
    reader: &mut FrameReader<R>,
    wr: &mut W,
    order: &mut DestinationOrder,
    shutdown: &CancellationToken,
    local: Option<SocketAddr>,
    desc: &VolumeDescriptor,
) -> Result<String, MigrationError>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    let vol = &rx.vol;
    let mut stats = FillStats::default();
    let mut paused = false;
    let mut digest_ok: Option<bool> = None;
    let mut buddies: Option<super::buddy::Buddies> = None;
    loop {
        let m = tokio::select! {
            m = reader.expect(IDLE_TIMEOUT) => m?,
            // Close without Abort: the source resumes once this daemon is back.
            () = shutdown.cancelled() => return Err(MigrationError::Cancelled),
        };
        if let Err(v) = order.receive(&m) {
            let reason = v.to_string();
            let _ = send(wr, &Message::Abort { reason }).await;
            return Err(v.into());
        }
        match m {
            Message::Prints {
                first_chunk,
                entries,
            } => {
                answer_prints(
                    state,
                    rx,
                    wr,
                    (&mut stats, &mut buddies),
                    (first_chunk, entries, desc.chunk_size),
                )
                .await?
            }
            Message::PrintsDone => {
                if stats.resumed > 0 {
                    tracing::info!(volume = %desc.name, chunks = stats.resumed, "resume: chunks already in place");
                }
                if stats.own_unread > 0 {
                    tracing::debug!(volume = %desc.name, chunks = stats.own_unread, "return: unchanged chunks recorded from this copy's index, unread");
                }
                send(
                    wr,
                    &Message::WantDone {
                        local_chunks: stats.local,
                        buddy_chunks: stats.buddy,
                        resumed_chunks: stats.resumed,
                    },
                )
                .await?;
            }
            Message::Data {
                offset,
                encoding,
                raw_len,
                bytes,
            } => {
                stats.arrived = stats.arrived.saturating_add(u64::from(raw_len));
                let r = rx.clone();
                let write = move || r.data(offset, encoding, raw_len, &bytes);
                if paused {
                    // The source holds its guest's writes: no background pace.
                    blocking(write).await?;
                } else {
                    bulk("data", write).await?;
                }
            }
            Message::RoundEnd { round, .. } => {
                // Flush, and hash the digest groups so the pause only
                // re-hashes what the last chunks change.
                let r = rx.clone();
                let t = std::time::Instant::now();
                blocking(move || {
                    r.vol.flush()?;
                    r.table.digest();
                    Ok(())
                })
                .await?;
                tracing::debug!(
                    round,
                    ms = t.elapsed().as_millis(),
                    "round flushed and hashed"
                );
                send(wr, &Message::Synced { round }).await?;
            }
            Message::Pause => paused = true,
            Message::Ping { nonce } => {
                send(wr, &Message::Pong { nonce }).await?;
            }
            Message::Digest { digest } => {
                digest_ok = Some(check_digest(rx, wr, &desc.name, digest).await?);
            }
            Message::Switch => {
                if digest_ok != Some(true) {
                    let reason = "switch refused: no matching digest".to_string();
                    send(
                        wr,
                        &Message::Abort {
                            reason: reason.clone(),
                        },
                    )
                    .await?;
                    return Err(MigrationError::Refused(reason));
                }
                // Told before the commit's `Done`, so that whoever learns
                // of the move from its source finds the rate here.
                let rebuilt = stats.local.saturating_mul(rx.chunk);
                if rebuilt >= MIN_MEASURED_REBUILD && stats.local_s > 0.0 {
                    state.local_rebuild_measured(rebuilt, stats.local_s);
                }
                commit(state, rx, wr, local).await?;
                // Index the new volume so it can be a base for later migrations.
                state.volume_arrived(vol);
                return Ok(desc.name.clone());
            }
            Message::Abort { reason } => return Err(MigrationError::PeerAborted(reason)),
            m => return Err(unexpected(&m, "receiving a migration")),
        }
    }
}

/// The destination's last word: where the volume's clients go now, told
/// to the daemon (a host here may be waiting for it) before the source.
fn committed(
    state: &Arc<dyn StorageDaemon>,
    vol: &Arc<Volume>,
    local: Option<SocketAddr>,
) -> Message {
    let (location, admin) = (state.advertised_nbd(local), state.advertised_admin(local));
    state.copy_committed(vol, &location, &admin);
    Message::Done {
        location,
        admin,
        iscsi: state.iscsi_port(local),
    }
}

/// Serve one incoming migration connection; returns the volume name once
/// it has switched.
async fn receive<S: AsyncRead + AsyncWrite + Unpin + Send>(
    state: &Arc<dyn StorageDaemon>,
    stream: S,
    peer: SocketAddr,
    local: Option<SocketAddr>,
    shutdown: &CancellationToken,
) -> Result<String, MigrationError> {
    let (rd, mut wr) = tokio::io::split(stream);
    let mut reader = FrameReader::new(rd);
    let mut order = DestinationOrder::new();
    let first = reader.expect(Duration::from_secs(30)).await?;
    order.receive(&first)?;
    let (id, desc, source_port, arrived_under) = match first {
        Message::Hello {
            min_version,
            max_version,
            migration_id,
            volume,
            iscsi,
            arrived_under,
        } => {
            if !(min_version..=max_version).contains(&VERSION) {
                let reason = format!(
                    "this daemon speaks migration version {VERSION}, the source {min_version}..{max_version}"
                );
                return refuse(&mut wr, reason).await;
            }
            (
                MigrationId::from_bytes(migration_id).to_string(),
                volume,
                iscsi,
                arrived_under,
            )
        }
        m @ Message::Lookup { .. } => {
            let n = super::buddy::serve(state, &mut reader, &mut wr, Some(m)).await?;
            tracing::info!(%peer, blocks = n, "served blocks as a buddy");
            return Ok(String::new());
        }
        m => return Err(unexpected(&m, "waiting for Hello")),
    };
    let chunk = desc.chunk_size;
    let bad_chunk = !chunk.is_power_of_two() || !(512..=64 << 10).contains(&chunk);
    let st = state.clone();
    let (id2, d2) = (id.clone(), desc.clone());
    let prepared = if bad_chunk {
        Err(Refusal::ChunkSize(chunk))
    } else if let Err(e) = super::check_chunks(desc.size, chunk) {
        Err(e.into())
    } else {
        tokio::task::spawn_blocking(move || prepare(st.as_ref(), &id2, &d2, peer, &arrived_under))
            .await
            .map_err(|e| MigrationError::Worker(e.to_string()))?
    };
    let (vol, basis) = match prepared {
        Ok(Prepared::Copy(v, b)) => (v, b),
        Ok(Prepared::AlreadySwitched(v)) => {
            tracing::info!(%peer, volume = %desc.name, migration = %id, "source asks again after the switch: it is done");
            send(&mut wr, &committed(state, &v, local)).await?;
            return Ok(desc.name);
        }
        Err(reason) => {
            return refuse(&mut wr, reason.to_string()).await;
        }
    };
    let _hold = vol.hold(ferry_storage::Holder::IncomingMigration);
    // The arrival bitmap exists from here (its metadata written now, not
    // in the pause); the commit clears it.
    let v = vol.clone();
    if let Err(e) = blocking(move || super::track_arrival(&v, chunk)).await {
        return refuse(&mut wr, format!("destination: {e}")).await;
    }
    super::check_port_groups(state.as_ref(), &source_port, &desc.name);
    tracing::info!(%peer, volume = %desc.name, migration = %id, ?basis, "incoming migration");
    send(
        &mut wr,
        &Message::Welcome {
            version: VERSION,
            basis,
            iscsi: state.iscsi_port(local),
        },
    )
    .await?;
    let rx = Arc::new(Receiver {
        state: state.clone(),
        vol: vol.clone(),
        table: Arc::new(ChunkTable::zeroed(desc.size, chunk)),
        chunk: u64::from(chunk),
        resumed: basis.resumes(),
        tracked: basis == CopyBasis::ReturnedTracked,
        use_index: chunk == state.index().block_size(),
        stream: parking_lot::Mutex::new(None),
        unsynced: std::sync::atomic::AtomicU64::new(0),
        source_port: super::peer_port(&source_port),
    });
    let outcome = transfer(
        state,
        &rx,
        &mut reader,
        &mut wr,
        &mut order,
        shutdown,
        local,
        &desc,
    )
    .await;
    // The copy's idle time (after which the daemon deletes it) counts from
    // the last migration that touched it.
    if outcome.is_err() {
        let v = vol.clone();
        if let Err(e) = blocking(move || Ok(v.touch_incoming()?)).await {
            tracing::warn!(volume = %desc.name, error = %e, "recording the incomplete copy's last use failed");
        }
    }
    // Tell the source why, when another attempt could not do better (a
    // full disk, bad data, a message out of order); a lost link or a
    // shutdown ends silently and the source resumes.
    if let Err(e) = &outcome {
        if !matches!(
            e,
            MigrationError::Link(_)
                | MigrationError::Wire(_)
                | MigrationError::Cancelled
                | MigrationError::PeerAborted(_)
                | MigrationError::Refused(_)
                | MigrationError::Order(_)
        ) {
            let reason = format!("destination: {e}");
            let _ = send(&mut wr, &Message::Abort { reason }).await;
        }
    }
    outcome
}
