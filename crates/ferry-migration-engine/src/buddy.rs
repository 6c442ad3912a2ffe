//! Buddy servers (seed 002, §4): daemons on the destination's site whose
//! volumes may hold blocks the destination lacks. The destination asks them
//! (`Lookup`) before asking the source across the WAN; a buddy answers with
//! blocks it verified (`Found`), and the destination verifies them again
//! before writing.
//!
//! The buddy side runs on the migration listener (a connection that opens
//! with `Lookup` instead of `Hello`), with the same TLS and trust.

use super::transport::{send, FrameReader};
use super::{MigrationError, StorageDaemon};
use bytes::Bytes;
use ferry_index::Fingerprint;
use ferry_migration::Message;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

/// Most keys in one `Lookup`.
pub const LOOKUP_BATCH: usize = 1024;
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A block of this daemon's volumes whose fingerprint has this key.
fn find_block(state: &dyn StorageDaemon, block_size: u32, key: u64) -> Option<Vec<u8>> {
    if block_size != state.index().block_size() {
        return None;
    }
    let bs = u64::from(block_size);
    let mut buf = vec![0u8; block_size as usize];
    for (name, block) in state.index().lookup_key(key, 4).ok()? {
        let Ok(v) = state.pool().reader(&name) else {
            continue;
        };
        if v.incoming().is_some() || block * bs + bs > v.size() {
            continue;
        }
        if v.read_at(block * bs, &mut buf).is_ok() && Fingerprint::of(&buf).key() == key {
            return Some(buf);
        }
    }
    None
}

/// Answer lookups on one connection until it closes (buddy side).
pub async fn serve<R, W>(
    state: &Arc<dyn StorageDaemon>,
    reader: &mut FrameReader<R>,
    wr: &mut W,
    mut first: Option<Message>,
) -> Result<u64, MigrationError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut served = 0u64;
    loop {
        let m = match first.take() {
            Some(m) => m,
            None => match tokio::time::timeout(Duration::from_secs(300), reader.next()).await {
                Err(_) | Ok(Ok(None)) => {
                    let _ = wr.shutdown().await;
                    return Ok(served);
                }
                Ok(Ok(Some(m))) => m,
                Ok(Err(e)) => return Err(e),
            },
        };
        let Message::Lookup { block_size, keys } = m else {
            return Err(super::unexpected(&m, "serving lookups"));
        };
        if keys.len() > LOOKUP_BATCH {
            return Err(MigrationError::BadData(format!(
                "lookup of {} keys (at most {LOOKUP_BATCH})",
                keys.len()
            )));
        }
        let st = state.clone();
        let blocks = tokio::task::spawn_blocking(move || {
            keys.iter()
                .map(|k| find_block(st.as_ref(), block_size, *k).map(Bytes::from))
                .collect::<Vec<_>>()
        })
        .await
        .map_err(|e| MigrationError::Worker(format!("lookup: {e}")))?;
        served += blocks.iter().filter(|b| b.is_some()).count() as u64;
        send(wr, &Message::Found { blocks }).await?;
    }
}

/// One buddy, as the destination talks to it.
struct Buddy {
    addr: String,
    reader: FrameReader<tokio::io::ReadHalf<super::transport::BoxStream>>,
    writer: tokio::io::WriteHalf<super::transport::BoxStream>,
}

/// The destination's connections to its buddies for one migration; a buddy
/// that fails is dropped for the rest of it.
pub struct Buddies {
    buddies: Vec<Buddy>,
}

impl Buddies {
    /// Connect to every configured buddy that answers.
    pub async fn connect(state: &dyn StorageDaemon) -> Buddies {
        let mut buddies = Vec::new();
        for addr in state.buddies() {
            let plaintext = state.plaintext();
            match super::source::dial(state, addr, plaintext, Default::default()).await {
                Ok(s) => {
                    let (r, w) = tokio::io::split(s);
                    buddies.push(Buddy {
                        addr: addr.clone(),
                        reader: FrameReader::new(r),
                        writer: w,
                    });
                }
                Err(e) => {
                    tracing::warn!(buddy = %addr, error = %e, "buddy unreachable; going without it")
                }
            }
        }
        Buddies { buddies }
    }

    pub fn is_empty(&self) -> bool {
        self.buddies.is_empty()
    }

    /// Ask the buddies, in order, for the blocks still missing; returns one
    /// entry per key (the block's bytes, not yet checked here).
    pub async fn fetch(&mut self, block_size: u32, keys: &[u64]) -> Vec<Option<Bytes>> {
        let mut out: Vec<Option<Bytes>> = vec![None; keys.len()];
        let mut i = 0;
        while i < self.buddies.len() {
            let missing: Vec<usize> = (0..keys.len()).filter(|&k| out[k].is_none()).collect();
            if missing.is_empty() {
                break;
            }
            match Self::ask(&mut self.buddies[i], block_size, keys, &missing).await {
                Ok(found) => {
                    for (k, b) in missing.into_iter().zip(found) {
                        out[k] = b;
                    }
                    i += 1;
                }
                Err(e) => {
                    let b = self.buddies.remove(i);
                    tracing::warn!(buddy = %b.addr, error = %e, "buddy failed; going without it");
                }
            }
        }
        out
    }

    async fn ask(
        b: &mut Buddy,
        block_size: u32,
        keys: &[u64],
        which: &[usize],
    ) -> Result<Vec<Option<Bytes>>, MigrationError> {
        let mut found = Vec::with_capacity(which.len());
        for batch in which.chunks(LOOKUP_BATCH) {
            let m = Message::Lookup {
                block_size,
                keys: batch.iter().map(|&k| keys[k]).collect(),
            };
            send(&mut b.writer, &m).await?;
            match b.reader.expect(ANSWER_TIMEOUT).await? {
                Message::Found { blocks } if blocks.len() == batch.len() => found.extend(blocks),
                m => return Err(super::unexpected(&m, "waiting for Found")),
            }
        }
        Ok(found)
    }
}
