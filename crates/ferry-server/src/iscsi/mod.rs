//! The iSCSI target: one listener per portal, each volume a target
//! `<base IQN>:<volume>` with the volume at LUN 0. The protocol lives in
//! `ferry-iscsi` (no I/O) and the SCSI commands in `ferry-scsi`; this module
//! wires them to sockets and to the pool.
//!
//! Access: an ACL of initiator names and/or CHAP per target (config). With
//! neither configured, only loopback portals answer (and a warning is
//! logged); any other portal refuses logins.

mod connection;
mod device;

pub use device::{run_sanitize, UnitTable, VolumeDevice};

use crate::config::IscsiAccess;
use crate::ServerState;
use ferry_iscsi::login::ChapSecret;
use ferry_iscsi::{TargetPolicy, Targets};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// State the iSCSI connections share.
pub struct IscsiState {
    pub units: UnitTable,
    /// The ALUA target port group of every portal here.
    pub port_group: u16,
    /// Bumped each time a volume moves away: sessions of a moved volume
    /// are then asked to log out (and are redirected when they log in).
    moves: tokio::sync::watch::Sender<u64>,
    /// Bound portals, in configuration order (portal group = index + 1).
    pub portals: Mutex<Vec<SocketAddr>>,
    next_tsih: AtomicU16,
    session_ids: AtomicU64,
    /// Live sessions by (initiator port, target): a new login with the same
    /// ISID reinstates (closes) the old session.
    #[allow(clippy::type_complexity)]
    sessions: Mutex<HashMap<(String, String), (u64, CancellationToken)>>,
    /// Data-In bytes all connections together may hold unsent.
    budget_total: std::sync::OnceLock<Arc<tokio::sync::Semaphore>>,
}

impl IscsiState {
    pub fn new(port_group: u16) -> IscsiState {
        IscsiState {
            units: UnitTable::default(),
            port_group,
            moves: tokio::sync::watch::Sender::new(0),
            portals: Mutex::default(),
            next_tsih: AtomicU16::new(1),
            session_ids: AtomicU64::new(0),
            sessions: Mutex::default(),
            budget_total: std::sync::OnceLock::new(),
        }
    }

    /// A volume has moved to another site: tell its sessions.
    pub fn volume_moved(&self, volume: &str) {
        tracing::debug!(
            volume,
            "volume moved: its iSCSI sessions are asked to log out"
        );
        self.moves.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Changes when any volume moves away.
    pub(crate) fn watch_moves(&self) -> tokio::sync::watch::Receiver<u64> {
        self.moves.subscribe()
    }

    /// The budget shared by every connection, made on first use.
    pub(crate) fn budget_total(
        &self,
        config: &crate::config::IscsiConfig,
    ) -> Arc<tokio::sync::Semaphore> {
        self.budget_total
            .get_or_init(|| {
                crate::net::shared_budget(config.max_queued_bytes, config.max_queued_bytes_total)
            })
            .clone()
    }
}

impl std::fmt::Debug for IscsiState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IscsiState")
            .field("portals", &self.portals.lock())
            .finish()
    }
}

impl IscsiState {
    fn tsih(&self) -> u16 {
        loop {
            let t = self.next_tsih.fetch_add(1, Ordering::Relaxed);
            if t != 0 {
                return t;
            }
        }
    }
}

/// This daemon's ALUA target port group: `iscsi.port_group`, or one in
/// 1..=4095 derived from the host name and the pool's path (stable across
/// restarts, different between daemons with a high probability; two sites
/// that a volume moves between with the same group get a warning at the
/// migration, and should set it).
pub fn site_port_group(config: &crate::config::Config) -> u16 {
    if config.iscsi.port_group != 0 {
        return config.iscsi.port_group;
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let pool = std::fs::canonicalize(&config.pool).unwrap_or_else(|_| config.pool.clone());
    let mut h = blake3::Hasher::new();
    h.update(host.trim().as_bytes());
    h.update(&[0]);
    h.update(pool.as_os_str().as_encoded_bytes());
    let b = h.finalize();
    let n = u16::from_be_bytes([b.as_bytes()[0], b.as_bytes()[1]]);
    n % 4095 + 1
}

/// The target name of a volume.
pub fn target_name(base: &str, volume: &str) -> String {
    format!("{base}:{volume}")
}

fn policy_of(a: &IscsiAccess, loopback: bool) -> TargetPolicy {
    let chap = (!a.chap_user.is_empty()).then(|| ChapSecret {
        user: a.chap_user.clone(),
        secret: a.chap_secret.as_bytes().to_vec(),
        mutual: (!a.mutual_user.is_empty())
            .then(|| (a.mutual_user.clone(), a.mutual_secret.as_bytes().to_vec())),
    });
    TargetPolicy {
        open: loopback && chap.is_none() && a.acl.is_empty(),
        chap,
        acl: a.acl.clone(),
        moved_to: None,
    }
}

/// The targets seen through one portal.
pub struct PortalTargets<'a> {
    pub state: &'a ServerState,
    pub portal: usize,
    pub local: SocketAddr,
}

impl PortalTargets<'_> {
    /// The target's name after `<base IQN>:` (a volume or a group).
    fn suffix<'t>(&self, target: &'t str) -> Option<&'t str> {
        let base = &self.state.config.iscsi.base_iqn;
        target.strip_prefix(base.as_str())?.strip_prefix(':')
    }

    /// The LUNs behind a target name and their exported volumes: a group's
    /// volumes at their place in the list, or one volume at LUN 0.
    pub fn luns_of(&self, target: &str) -> Option<Vec<(u64, Arc<ferry_storage::Volume>)>> {
        let name = self.suffix(target)?;
        let exported = |n: &str| {
            let v = self.state.pool.get(n).ok()?;
            v.is_serving().then_some(v)
        };
        let luns: Vec<_> = match self.state.config.iscsi.groups.get(name) {
            Some(members) => members
                .iter()
                .take(256)
                .enumerate()
                .filter_map(|(i, m)| exported(m).map(|v| (i as u64, v)))
                .collect(),
            None => exported(name).map(|v| (0, v)).into_iter().collect(),
        };
        (!luns.is_empty()).then_some(luns)
    }

    /// Where a volume's target went, when the volume moved to a daemon
    /// that advertised an iSCSI portal: `TargetAddress` for a redirect.
    /// A shared volume another gateway holds: its portal, if it has one.
    fn moved_to(&self, target: &str) -> Option<String> {
        let v = match self.state.pool.get(self.suffix(target)?) {
            Ok(v) => v,
            Err(ferry_storage::StorageError::HeldElsewhere { iscsi, .. }) => {
                return iscsi.map(|p| format!("{p},1"))
            }
            Err(_) => return None,
        };
        v.moved_to()?;
        let peer = v.peer_port()?;
        (!peer.portal.is_empty()).then(|| format!("{},1", peer.portal))
    }

    fn loopback(&self) -> bool {
        self.local.ip().is_loopback()
    }
}

impl Targets for PortalTargets<'_> {
    fn policy(&self, target: &str) -> Option<TargetPolicy> {
        let moved_to = match self.luns_of(target) {
            Some(_) => None,
            None => Some(self.moved_to(target)?),
        };
        let access = self.state.config.iscsi.access(self.suffix(target));
        Some(TargetPolicy {
            moved_to,
            ..policy_of(&access, self.loopback())
        })
    }

    fn discovery_policy(&self) -> TargetPolicy {
        policy_of(&self.state.config.iscsi.access(None), self.loopback())
    }

    fn send_targets(&self, initiator: &str, only: Option<&str>) -> Vec<(String, String)> {
        let cfg = &self.state.config.iscsi;
        let portals = self.state.iscsi.portals.lock().clone();
        let names = self
            .state
            .pool
            .list()
            .iter()
            .map(|v| v.name())
            .chain(cfg.groups.keys().cloned())
            .collect::<std::collections::BTreeSet<_>>();
        let mut out = Vec::new();
        for n in names {
            let name = target_name(&cfg.base_iqn, &n);
            if only.is_some_and(|o| o != name) {
                continue;
            }
            // A volume that moved away is listed at the portal it went to.
            let moved = match self.luns_of(&name) {
                Some(_) => None,
                None => match self.moved_to(&name) {
                    Some(to) => Some(to),
                    None => continue,
                },
            };
            let acl = cfg.access(Some(&n)).acl;
            if !acl.is_empty() && !acl.iter().any(|a| a == initiator) {
                continue;
            }
            out.push(("TargetName".to_string(), name));
            if let Some(to) = moved {
                out.push(("TargetAddress".to_string(), to));
                continue;
            }
            for (i, p) in portals.iter().enumerate() {
                let ip = if p.ip().is_unspecified() {
                    self.local.ip()
                } else {
                    p.ip()
                };
                let addr = SocketAddr::new(ip, p.port());
                out.push(("TargetAddress".to_string(), format!("{addr},{}", i + 1)));
            }
        }
        out
    }

    fn portal_group(&self) -> u16 {
        u16::try_from(self.portal + 1).unwrap_or(u16::MAX)
    }
}

/// Serve one portal until `shutdown` fires.
pub async fn serve(
    listener: TcpListener,
    portal: usize,
    state: Arc<ServerState>,
    shutdown: CancellationToken,
) {
    let cfg = &state.config.iscsi;
    let local = listener.local_addr().ok();
    let unprotected = cfg.acl.is_empty() && cfg.chap_user.is_empty();
    if unprotected {
        if local.is_some_and(|a| a.ip().is_loopback()) {
            tracing::warn!(portal = ?local, "iSCSI portal has no ACL and no CHAP: answering loopback initiators only");
        } else {
            tracing::warn!(portal = ?local, "iSCSI portal has no ACL and no CHAP and is not loopback: targets without their own ACL or CHAP refuse every login");
        }
    }
    let limits = crate::net::ConnLimits {
        max: state.config.iscsi.max_connections,
        per_peer: state.config.iscsi.max_connections_per_peer,
    };
    let st = state.clone();
    crate::net::accept_loop(
        listener,
        limits,
        state,
        shutdown.clone(),
        move |stream, peer| {
            let state = st.clone();
            let shutdown = shutdown.clone();
            async move {
                let r = connection::run(stream, portal, &state, shutdown).await;
                crate::net::give_back_memory().await;
                match r {
                    Ok(()) => tracing::debug!(%peer, "iSCSI connection finished"),
                    Err(e) => tracing::info!(%peer, error = %e, "iSCSI connection closed"),
                }
            }
        },
        |stream, _peer, _why| connection::refuse_busy(stream),
    )
    .await;
}
