//! `ferry host`: the agent on a VM host. It gives the hypervisor one stable
//! NBD endpoint per volume (a unix socket and/or a loopback TCP port) and
//! forwards every request to whichever ferry server holds the volume now.
//!
//! The switch needs no command: when the volume migrates, the old server
//! answers held and new requests with `ESHUTDOWN` and refuses the export
//! with "moved to HOST:PORT" ([`ferry_nbd::MOVED_PREFIX`]). The agent then
//! holds new requests, reconnects to the new location, and re-issues every
//! request that had not completed. NBD requests are idempotent (a write
//! writes the same bytes at the same offset again), and a request is only
//! answered once it succeeded somewhere, so the client never sees an error
//! from a migration.
//!
//! One agent serves every volume of its host's guests ([`Agent`]): each is
//! an export under its own name on the agent's listeners, attached and
//! detached through the control API ([`control`], `ferry_api::host`).

pub mod control;
mod downstream;
pub mod stats;

use ferry_client::{ClientError, ClientTls, ConnectOptions, ExportDetails, NbdClient};
use ferry_nbd::{ErrorCode, NbdError, MOVED_PREFIX};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;

pub use downstream::{serve, Forwarder, Listener};

#[derive(Debug, Error)]
pub enum HostError {
    #[error("cannot reach volume {volume} at {server}: {source}")]
    Connect {
        volume: String,
        server: String,
        #[source]
        source: ClientError,
    },
    #[error("listening on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("volume {0} is already attached")]
    Attached(String),
    #[error("volume {volume}: no server answered for {waited:?} (last tried {server})")]
    Unreachable {
        volume: String,
        server: String,
        waited: Duration,
    },
}

/// How long requests are held while the agent looks for the volume before
/// they fail with an I/O error.
pub const DEFAULT_HOLD: Duration = Duration::from_secs(120);

/// Groups of servers that stand in for each other: the gateways of one
/// site in front of one Ceph cluster, any of which serves any of its
/// volumes (`ferry serve --ceph-shared`). A volume whose server cannot be
/// reached is looked for at the next gateway of its server's group.
pub type Gateways = Arc<Vec<Vec<String>>>;

/// The gateway after `server` in its group, if it has a group of two or more.
fn next_gateway(gateways: &[Vec<String>], server: &str) -> Option<String> {
    let g = gateways.iter().find(|g| g.iter().any(|s| s == server))?;
    let i = g.iter().position(|s| s == server)?;
    (g.len() > 1).then(|| g[(i + 1) % g.len()].clone())
}

/// The size of `server`'s gateway group (1 without one).
fn group_len(gateways: &[Vec<String>], server: &str) -> usize {
    gateways
        .iter()
        .find(|g| g.iter().any(|s| s == server))
        .map_or(1, Vec::len)
}

/// The connection to the server that holds the volume now.
pub struct Upstream {
    volume: String,
    server: parking_lot::Mutex<String>,
    /// The connection and its generation; `None` while pending (see
    /// [`Upstream::pending`]) until the first request or [`Upstream::connect_now`].
    current: parking_lot::Mutex<(u64, Option<Arc<NbdClient>>)>,
    reconnecting: tokio::sync::Mutex<()>,
    details: ExportDetails,
    hold: Duration,
    /// TLS for every connection to the servers, if the agent has it.
    tls: Option<ClientTls>,
    /// Servers that stand in for each other (see [`Gateways`]).
    gateways: Gateways,
    switches: AtomicU64,
    /// Times a server did not answer and the next gateway was tried.
    failovers: AtomicU64,
    reconnects: AtomicU64,
    retried: AtomicU64,
    /// The guest's requests, as answered.
    pub io: stats::IoStats,
}

fn options(tls: Option<&ClientTls>) -> ConnectOptions {
    ConnectOptions {
        structured_replies: true,
        meta_contexts: vec![ferry_nbd::BASE_ALLOCATION.to_string()],
        tls: tls.cloned(),
    }
}

/// Where a refused export says it went, if it moved.
fn moved_to(e: &ClientError) -> Option<String> {
    match e {
        ClientError::Protocol(NbdError::OptionRefused { message, .. }) => message
            .strip_prefix(MOVED_PREFIX)
            .map(|s| s.trim().to_string()),
        _ => None,
    }
}

/// Errors after which the request is re-issued on a new connection.
fn retry_elsewhere(e: &ClientError) -> bool {
    match e {
        ClientError::Request { code, .. } => *code == ErrorCode::Shutdown,
        ClientError::Io(_) | ClientError::Disconnected => true,
        ClientError::Protocol(_) => true,
        // Credentials or a server that offers no TLS: retrying elsewhere
        // is for servers the volume moved to, which may be set up better.
        ClientError::Tls(_) => true,
    }
}

impl Upstream {
    /// Connect to `server`, following "moved" answers.
    pub async fn connect(
        server: &str,
        volume: &str,
        hold: Duration,
    ) -> Result<Upstream, HostError> {
        Self::connect_with(server, volume, hold, None).await
    }

    /// The same, over TLS with `tls` if given.
    pub async fn connect_with(
        server: &str,
        volume: &str,
        hold: Duration,
        tls: Option<ClientTls>,
    ) -> Result<Upstream, HostError> {
        Self::connect_any(server, volume, hold, tls, Gateways::default()).await
    }

    /// The same, trying the other gateways of `server`'s group (once
    /// each) when it does not answer.
    pub async fn connect_any(
        server: &str,
        volume: &str,
        hold: Duration,
        tls: Option<ClientTls>,
        gateways: Gateways,
    ) -> Result<Upstream, HostError> {
        let mut server = server.to_string();
        let mut hops = 0;
        let mut tried = 1;
        let client = loop {
            match NbdClient::connect(&server, volume, &options(tls.as_ref())).await {
                Ok(c) => break c,
                Err(e) => match (
                    moved_to(&e),
                    next_gateway(&gateways, &server)
                        .filter(|_| tried < group_len(&gateways, &server)),
                ) {
                    (Some(next), _) if hops < 8 => {
                        tracing::info!(volume, from = %server, to = %next, "volume has moved; following");
                        server = next;
                        hops += 1;
                    }
                    (None, Some(next)) => {
                        tracing::warn!(volume, from = %server, to = %next, error = %e, "gateway does not answer; trying the next of its site");
                        server = next;
                        tried += 1;
                    }
                    _ => {
                        return Err(HostError::Connect {
                            volume: volume.into(),
                            server,
                            source: e,
                        })
                    }
                },
            }
        };
        Ok(Upstream {
            volume: volume.into(),
            server: parking_lot::Mutex::new(server),
            details: client.export().clone(),
            current: parking_lot::Mutex::new((0, Some(Arc::new(client)))),
            reconnecting: tokio::sync::Mutex::new(()),
            hold,
            tls,
            gateways,
            switches: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            io: stats::IoStats::default(),
        })
    }

    /// A volume offered before it can be reached: the export is described
    /// by `details` (taken where it can be reached now) and the first
    /// request, or [`Upstream::connect_now`], connects to `server`. A guest
    /// arriving by live migration opens its disks before it runs; its disk
    /// may still be on its way to `server`.
    pub fn pending(
        server: &str,
        volume: &str,
        details: ExportDetails,
        hold: Duration,
        tls: Option<ClientTls>,
        gateways: Gateways,
    ) -> Upstream {
        Upstream {
            volume: volume.into(),
            server: parking_lot::Mutex::new(server.into()),
            details,
            current: parking_lot::Mutex::new((0, None)),
            reconnecting: tokio::sync::Mutex::new(()),
            hold,
            tls,
            gateways,
            switches: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            io: stats::IoStats::default(),
        }
    }

    /// Whether a connection is open (false while pending).
    pub fn connected(&self) -> bool {
        self.current.lock().1.is_some()
    }

    /// Point the volume at `server` and connect now: a pending volume, or
    /// one whose connection still goes to the volume's old place (a guest
    /// arriving by teleport whose QEMU touched its disk before the switch),
    /// so that the guest's first request after it resumes does not go
    /// there first and learn of the move.
    pub async fn connect_now(&self, server: &str) -> Result<(), HostError> {
        let generation = {
            let cur = self.current.lock();
            if cur.1.is_some() && *self.server.lock() == server {
                return Ok(());
            }
            cur.0
        };
        *self.server.lock() = server.to_string();
        self.reconnect(generation, Instant::now()).await
    }

    pub fn details(&self) -> &ExportDetails {
        &self.details
    }

    pub fn volume(&self) -> &str {
        &self.volume
    }

    /// The server that holds the volume now.
    pub fn server(&self) -> String {
        self.server.lock().clone()
    }

    /// Times a server did not answer and another gateway of its site was
    /// tried.
    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// `(switches to a new server, reconnects, requests re-issued)`.
    pub fn stats(&self) -> (u64, u64, u64) {
        (
            self.switches.load(Ordering::Relaxed),
            self.reconnects.load(Ordering::Relaxed),
            self.retried.load(Ordering::Relaxed),
        )
    }

    fn current(&self) -> (u64, Option<Arc<NbdClient>>) {
        let c = self.current.lock();
        (c.0, c.1.clone())
    }

    /// Run `op` against the current server; on a switch or a lost
    /// connection, reconnect and run it again. Other errors are the
    /// client's answer.
    pub async fn call<T, F, Fut>(&self, op: F) -> Result<T, ClientError>
    where
        F: Fn(Arc<NbdClient>) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let start = Instant::now();
        loop {
            let (generation, client) = self.current();
            let Some(client) = client else {
                if let Err(he) = self.reconnect(generation, start).await {
                    tracing::error!(error = %he, "giving up on a request");
                    return Err(ClientError::Disconnected);
                }
                continue;
            };
            match op(client).await {
                Ok(v) => return Ok(v),
                Err(e) if retry_elsewhere(&e) && start.elapsed() < self.hold => {
                    self.retried.fetch_add(1, Ordering::Relaxed);
                    if let Err(he) = self.reconnect(generation, start).await {
                        tracing::error!(error = %he, "giving up on a request");
                        return Err(e);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Replace connection `failed` (unless another task already did).
    async fn reconnect(&self, failed: u64, since: Instant) -> Result<(), HostError> {
        let _one = self.reconnecting.lock().await;
        tracing::debug!(volume = %self.volume, server = %self.server(), failed, "reconnecting");
        if self.current().0 != failed {
            return Ok(());
        }
        let mut backoff = Duration::from_millis(20);
        // Gateways tried since the last pause: a whole group without an
        // answer waits `backoff` before the next round.
        let mut round = 0;
        loop {
            let server = self.server();
            match NbdClient::connect(&server, &self.volume, &options(self.tls.as_ref())).await {
                Ok(c) => {
                    if c.size() != self.details.size {
                        tracing::warn!(
                            volume = %self.volume, old = self.details.size, new = c.size(),
                            "volume size differs at the new server"
                        );
                    }
                    let mut cur = self.current.lock();
                    *cur = (failed + 1, Some(Arc::new(c)));
                    self.reconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(volume = %self.volume, %server, "connected");
                    return Ok(());
                }
                Err(e) => {
                    if let Some(next) = moved_to(&e) {
                        tracing::info!(volume = %self.volume, from = %server, to = %next, "volume moved; switching");
                        *self.server.lock() = next;
                        self.switches.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    if let Some(next) = next_gateway(&self.gateways, &server) {
                        round += 1;
                        tracing::warn!(volume = %self.volume, from = %server, to = %next, error = %e, "gateway does not answer; trying the next of its site");
                        *self.server.lock() = next;
                        self.failovers.fetch_add(1, Ordering::Relaxed);
                        if round < group_len(&self.gateways, &server) {
                            continue;
                        }
                        round = 0;
                    }
                    if since.elapsed() > self.hold {
                        return Err(HostError::Unreachable {
                            volume: self.volume.clone(),
                            server,
                            waited: since.elapsed(),
                        });
                    }
                    tracing::debug!(error = %e, ?backoff, "reconnect failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

/// The volumes one agent forwards, by name.
pub struct Agent {
    volumes: parking_lot::RwLock<std::collections::BTreeMap<String, Arc<Upstream>>>,
    hold: Duration,
    tls: Option<ClientTls>,
    gateways: Gateways,
    /// Bytes of requests and replies all its clients' connections together
    /// may hold (each connection also has its own budget).
    budget_total: Arc<tokio::sync::Semaphore>,
}

/// What all of an agent's client connections together may hold in
/// requests and replies.
pub const AGENT_BUDGET_TOTAL: usize = 1 << 30;

impl Agent {
    /// An agent with no volumes; requests wait up to `hold` for a server.
    pub fn new(hold: Duration) -> Arc<Agent> {
        Self::with_tls(hold, None)
    }

    /// The same, connecting to every server over TLS with `tls` if given.
    pub fn with_tls(hold: Duration, tls: Option<ClientTls>) -> Arc<Agent> {
        Self::with_gateways(hold, tls, Gateways::default())
    }

    /// The same, volumes on one of `gateways` going to the next of its
    /// group when their server does not answer (see [`Gateways`]).
    pub fn with_gateways(hold: Duration, tls: Option<ClientTls>, gateways: Gateways) -> Arc<Agent> {
        Arc::new(Agent {
            volumes: Default::default(),
            hold,
            tls,
            gateways,
            budget_total: Arc::new(tokio::sync::Semaphore::new(AGENT_BUDGET_TOTAL)),
        })
    }

    /// The TLS credentials its connections to servers use, if any.
    pub fn tls(&self) -> Option<&ClientTls> {
        self.tls.as_ref()
    }

    /// An agent forwarding one volume already connected.
    pub fn single(up: Arc<Upstream>) -> Arc<Agent> {
        let a = Agent::with_gateways(up.hold, up.tls.clone(), up.gateways.clone());
        a.volumes.write().insert(up.volume().to_string(), up);
        a
    }

    /// Connect to `volume` at `server` (following moves) and offer it.
    pub async fn attach(&self, server: &str, volume: &str) -> Result<Arc<Upstream>, HostError> {
        if self.get(volume).is_some() {
            return Err(HostError::Attached(volume.into()));
        }
        let up = Arc::new(
            Upstream::connect_any(
                server,
                volume,
                self.hold,
                self.tls.clone(),
                self.gateways.clone(),
            )
            .await?,
        );
        let mut v = self.volumes.write();
        if v.contains_key(volume) {
            return Err(HostError::Attached(volume.into()));
        }
        v.insert(volume.to_string(), up.clone());
        tracing::info!(volume, server = %up.server(), "attached");
        Ok(up)
    }

    /// Offer `volume` before it can be reached (see [`Upstream::pending`]).
    pub fn attach_pending(
        &self,
        server: &str,
        volume: &str,
        details: ExportDetails,
    ) -> Result<Arc<Upstream>, HostError> {
        let mut v = self.volumes.write();
        if v.contains_key(volume) {
            return Err(HostError::Attached(volume.into()));
        }
        let up = Arc::new(Upstream::pending(
            server,
            volume,
            details,
            self.hold,
            self.tls.clone(),
            self.gateways.clone(),
        ));
        v.insert(volume.to_string(), up.clone());
        tracing::info!(volume, server, "attached, pending");
        Ok(up)
    }

    /// Stop offering `volume` to new connections (open ones keep it).
    pub fn detach(&self, volume: &str) -> Option<Arc<Upstream>> {
        self.volumes.write().remove(volume)
    }

    pub fn get(&self, volume: &str) -> Option<Arc<Upstream>> {
        self.volumes.read().get(volume).cloned()
    }

    pub fn list(&self) -> Vec<Arc<Upstream>> {
        self.volumes.read().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{group_len, next_gateway};

    #[test]
    fn a_gateway_that_does_not_answer_is_followed_by_the_next_of_its_site() {
        let g = vec![
            vec!["a:1".to_string(), "b:1".to_string(), "c:1".to_string()],
            vec!["x:1".to_string()],
        ];
        assert_eq!(next_gateway(&g, "a:1").as_deref(), Some("b:1"));
        assert_eq!(next_gateway(&g, "c:1").as_deref(), Some("a:1"));
        // Alone in its group, or in none: nowhere else to go.
        assert_eq!(next_gateway(&g, "x:1"), None);
        assert_eq!(next_gateway(&g, "elsewhere:1"), None);
        assert_eq!(group_len(&g, "b:1"), 3);
        assert_eq!(group_len(&g, "elsewhere:1"), 1);
    }
}
