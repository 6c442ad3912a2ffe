//! The ferry daemon as a library: opens the pool, binds the listeners, and
//! serves NBD, the admin API and metrics until told to stop.
//!
//! Lifecycle (after mini-redis): [`Daemon::bind`] opens everything and learns
//! the real addresses (tests bind port 0), [`Daemon::run`] serves until the
//! cancellation token fires, then drains connections and closes the pool
//! cleanly (data flushed, persistent bitmaps saved).

pub mod admin;
pub mod arrivals;
pub mod config;
pub mod fencing;
pub mod idle_release;
pub mod in_doubt;
pub mod indexer;
pub mod iscsi;
mod keep_measure;
pub mod metrics;
pub mod move_setup;
pub mod nbd;
pub mod net;
pub mod periodic;
pub mod rebuild_rate;
pub mod site_portal;
pub mod stale_copies;
pub mod switch_hold;
pub mod volume_sample;

use config::Config;
use ferry_migration_engine as migration;
use ferry_storage::{Pool, PoolOptions, StorageError};
use metrics::Metrics;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("opening pool {path}: {source}")]
    Pool {
        path: std::path::PathBuf,
        #[source]
        source: StorageError,
    },
    #[error("binding {what} listener on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("admin API: {0}")]
    Admin(std::io::Error),
    #[error("closing pool: {0}")]
    Close(StorageError),
    #[error("migration TLS identity: {0}")]
    Tls(migration::tls::CertError),
    #[error("NBD TLS credentials: {0}")]
    NbdTls(#[from] ferry_nbd_server::TlsSetupError),
    #[error("opening the fingerprint index: {0}")]
    Index(#[from] ferry_index::IndexError),
    #[error("iSCSI: {0}")]
    IscsiConfig(String),
    #[error("storage.ceph: {0}")]
    Ceph(#[from] ferry_rbd::RbdError),
    #[error("the Ceph cluster fenced this gateway (blocklisted its client); it must start again as a new client")]
    Fenced,
}

/// The addresses actually bound.
#[derive(Debug, Clone, Copy, Default)]
pub struct BoundAddrs {
    pub nbd: Option<SocketAddr>,
    pub admin: Option<SocketAddr>,
    pub migration: Option<SocketAddr>,
}

/// What every part of the daemon shares.
#[derive(Debug)]
pub struct ServerState {
    pub config: Config,
    /// NBD's TLS credentials, if `nbd.tls_dir` names them.
    pub nbd_tls: Option<ferry_nbd_server::NbdTls>,
    pub pool: Arc<Pool>,
    pub index: Arc<ferry_index::PoolIndex>,
    pub metrics: Metrics,
    pub addrs: BoundAddrs,
    pub migrations: migration::Registry,
    pub iscsi: iscsi::IscsiState,
    /// Copies incoming migrations committed here, for hosts waiting.
    pub arrivals: arrivals::Arrivals,
    /// Volumes being indexed in the background.
    pub(crate) background_scans: indexer::BackgroundScans,
    /// How fast the pool rebuilt held blocks into incoming copies lately.
    pub rebuild_rate: rebuild_rate::RebuildRate,
    /// How long this daemon's recent switches held writes besides the link.
    pub switch_hold: switch_hold::SwitchHold,
    /// How long this daemon's recent small moves took besides the link.
    pub move_setup: move_setup::MoveSetup,
    /// Which NBD connection sends large READs lately
    /// (`nbd.sendfile_reads = "sole-reader"`).
    pub sole_reader: Arc<nbd::sole_reader::SoleReader>,
}

/// A daemon with its pool open and its listeners bound.
pub struct Daemon {
    state: Arc<ServerState>,
    nbd: Option<TcpListener>,
    admin: Option<ferry_trust::api::ApiListener>,
    migration: Option<TcpListener>,
    iscsi: Vec<TcpListener>,
    /// The site's portal, the pool whose lease decides who serves it and
    /// this gateway as the others know it.
    site_portal: Option<(
        site_portal::SitePortal,
        (Arc<ferry_rbd::Pool>, ferry_storage::SharedGateway),
    )>,
    /// The Ceph client, when volumes live in a cluster: watched for being
    /// fenced ([`fencing`]).
    cluster: Option<Arc<ferry_rbd::Cluster>>,
}

async fn bind(what: &'static str, addr: &str) -> Result<Option<TcpListener>, ServerError> {
    if addr.is_empty() {
        return Ok(None);
    }
    TcpListener::bind(addr)
        .await
        .map(Some)
        .map_err(|source| ServerError::Bind {
            what,
            addr: addr.into(),
            source,
        })
}

/// Connect to the configured Ceph cluster and open its pool. The client
/// address of this run is kept in `<pool>/ceph-client`: the next run of
/// the daemon on this pool knows the locks it finds held by that address
/// are its dead predecessor's.
fn connect_ceph(
    c: &config::CephConfig,
    pool_dir: &std::path::Path,
    gateway: Option<ferry_storage::SharedGateway>,
) -> Result<ferry_storage::CephStore, ServerError> {
    let cluster = ferry_rbd::Cluster::connect(
        &ferry_rbd::ClusterConfig {
            conf: c.conf.clone(),
            keyring: (!c.keyring.as_os_str().is_empty()).then(|| c.keyring.clone()),
            client: c.client.clone(),
        },
        c.connect_timeout_secs,
    )?;
    // Only one daemon on a pool directory: the one that breaks the locks
    // of the address recorded below must be sure its owner is dead.
    std::fs::create_dir_all(pool_dir).map_err(ServerError::Admin)?;
    let lock_path = pool_dir.join("ceph-client.lock");
    let dir_lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(ServerError::Admin)?;
    // SAFETY: flock on a descriptor the File owns; no memory is passed.
    if unsafe { libc::flock(dir_lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(ServerError::Admin(std::io::Error::other(format!(
            "another ferry daemon serves the pool directory {} (lock {})",
            pool_dir.display(),
            lock_path.display()
        ))));
    }
    let pool = cluster.pool(&c.pool)?;
    let address = cluster.address();
    tracing::info!(conf = %c.conf.display(), pool = %c.pool, client = %c.client, %address, "connected to Ceph");
    let record = pool_dir.join("ceph-client");
    let dead_owners: Vec<String> = std::fs::read_to_string(&record)
        .map(|s| {
            s.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    std::fs::write(&record, format!("{address}\n"))
        .and_then(|()| std::fs::File::open(&record)?.sync_all())
        .map_err(ServerError::Admin)?;
    Ok(ferry_storage::CephStore {
        pool,
        default: c.default,
        dead_owners,
        dir_lock: Some(std::sync::Arc::new(dir_lock)),
        shared: gateway,
    })
}

/// This daemon as a shared gateway: the NBD address other gateways and
/// clients reach it at, and how it tells whether another gateway lives
/// (its NBD listener accepts a connection within a second).
fn shared_gateway(
    config: &Config,
    nbd: Option<&TcpListener>,
    iscsi: Option<SocketAddr>,
) -> Result<ferry_storage::SharedGateway, ServerError> {
    let bad = |why: String| ServerError::Admin(std::io::Error::other(why));
    let address = if config.migration.advertise_nbd.is_empty() {
        let a = nbd.and_then(|l| l.local_addr().ok()).ok_or_else(|| {
            bad("a shared gateway ([storage.ceph] shared) needs an NBD listener".into())
        })?;
        if a.ip().is_unspecified() {
            return Err(bad(format!(
                "a shared gateway listening on {a} must say where other gateways reach it: set migration.advertise_nbd (--advertise-nbd)"
            )));
        }
        a.to_string()
    } else {
        config.migration.advertise_nbd.clone()
    };
    // Initiators sent from another gateway must reach this portal: the
    // advertised one, else the first listener if it names an address.
    let iscsi = if config.migration.advertise_iscsi.is_empty() {
        iscsi
            .filter(|a| !a.ip().is_unspecified())
            .map(|a| a.to_string())
    } else {
        Some(config.migration.advertise_iscsi.clone())
    };
    Ok(ferry_storage::SharedGateway {
        address,
        iscsi,
        alive: std::sync::Arc::new(|addr: &str| {
            ferry_api::client::accepts_connections(addr, Duration::from_secs(1))
        }),
    })
}

impl Daemon {
    pub async fn bind(config: Config) -> Result<Daemon, ServerError> {
        let nbd = bind("NBD", &config.nbd.listen).await?;
        if config.iscsi.port_group > 4095 {
            return Err(ServerError::IscsiConfig(format!(
                "port_group {} is out of range (1..4095, or 0 to derive one)",
                config.iscsi.port_group
            )));
        }
        if config.iscsi.listen.len() > 15 {
            return Err(ServerError::IscsiConfig(format!(
                "{} portals: at most 15 (their relative port identifiers are 4 bits)",
                config.iscsi.listen.len()
            )));
        }
        let site =
            site_portal::SitePortal::from_config(&config).map_err(ServerError::IscsiConfig)?;
        let mut iscsi = Vec::new();
        for addr in &config.iscsi.listen {
            if let Some(l) = bind("iSCSI", addr).await? {
                iscsi.push(l);
            }
        }
        let ceph = match config.storage.ceph.clone() {
            Some(c) => Some(
                tokio::task::spawn_blocking({
                    let pool = config.pool.clone();
                    let gateway = if c.shared {
                        Some(shared_gateway(
                            &config,
                            nbd.as_ref(),
                            iscsi.first().and_then(|l| l.local_addr().ok()),
                        )?)
                    } else {
                        None
                    };
                    move || connect_ceph(&c, &pool, gateway)
                })
                .await
                .map_err(|e| ServerError::Admin(std::io::Error::other(e)))??,
            ),
            None => None,
        };
        let site_portal = site.zip(
            ceph.as_ref()
                .and_then(|c| Some((c.pool.clone(), c.shared.clone()?))),
        );
        let cluster = ceph.as_ref().map(|c| c.pool.cluster().clone());
        let pool_opts = PoolOptions {
            direct_io: config.storage.direct_io,
            ceph,
        };
        let path = config.pool.clone();
        let pool = tokio::task::spawn_blocking(move || Pool::open(&path, pool_opts))
            .await
            .map_err(|e| ServerError::Admin(std::io::Error::other(e)))?
            .map_err(|source| ServerError::Pool {
                path: config.pool.clone(),
                source,
            })?;
        let index =
            ferry_index::PoolIndex::open(&config.pool.join("index"), config.index.block_size)?;
        let nbd_tls = if config.nbd.tls_dir.as_os_str().is_empty() {
            None
        } else {
            Some(
                ferry_nbd_server::NbdTls::from_dir(&config.nbd.tls_dir)?
                    .clear_on_loopback(config.nbd.tls_clear_loopback),
            )
        };
        if let (Some(l), None) = (&nbd, &nbd_tls) {
            if l.local_addr().is_ok_and(|a| !a.ip().is_loopback()) {
                tracing::warn!(
                    listen = %config.nbd.listen,
                    "NBD listens beyond loopback without TLS: its data crosses the network in clear (set nbd.tls_dir)"
                );
            }
        }
        // Refuses to start rather than serve plaintext beyond loopback.
        let admin = match bind("admin", &config.admin.listen).await? {
            Some(l) => Some(
                ferry_trust::api::ApiListener::new(l, admin::security(&config))
                    .map_err(|e| ServerError::Admin(std::io::Error::other(e.to_string())))?,
            ),
            None => None,
        };
        let migration = bind("migration", &config.migration.listen).await?;
        let iscsi_state = iscsi::IscsiState::new(iscsi::site_port_group(&config));
        *iscsi_state.portals.lock() = iscsi
            .iter()
            .filter_map(|l| l.local_addr().ok())
            .chain(site_portal.as_ref().map(|(p, _)| SocketAddr::V4(p.addr)))
            .collect();
        if migration.is_some() && !config.migration.plaintext {
            // Make the daemon's certificate now, so it can be shown and
            // trusted before the first migration.
            migration::tls::CertStore::new(&config.pool)
                .ensure_identity()
                .map_err(ServerError::Tls)?;
        }
        let addrs = BoundAddrs {
            nbd: nbd.as_ref().and_then(|l| l.local_addr().ok()),
            admin: admin
                .as_ref()
                .map(ferry_trust::api::ApiListener::local_addr),
            migration: migration.as_ref().and_then(|l| l.local_addr().ok()),
        };
        let rebuild_rate = rebuild_rate::RebuildRate::open(pool.root().join(rebuild_rate::FILE));
        let switch_hold = switch_hold::SwitchHold::open(pool.root().join(switch_hold::FILE));
        let move_setup = move_setup::MoveSetup::open(pool.root().join(move_setup::FILE));
        Ok(Daemon {
            state: Arc::new(ServerState {
                config,
                nbd_tls,
                pool: Arc::new(pool),
                index: Arc::new(index),
                metrics: Metrics::new(),
                addrs,
                migrations: migration::Registry::default(),
                iscsi: iscsi_state,
                arrivals: arrivals::Arrivals::default(),
                background_scans: indexer::BackgroundScans::default(),
                rebuild_rate,
                switch_hold,
                move_setup,
                sole_reader: Arc::default(),
            }),
            nbd,
            admin,
            migration,
            iscsi,
            site_portal,
            cluster,
        })
    }

    pub fn addrs(&self) -> BoundAddrs {
        self.state.addrs
    }

    pub fn state(&self) -> Arc<ServerState> {
        self.state.clone()
    }

    /// Serve until `shutdown` is cancelled; then drain and close the pool.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServerError> {
        let mut tasks = tokio::task::JoinSet::new();
        if let Some(l) = self.nbd {
            let mode = match (
                &self.state.nbd_tls,
                self.state.config.nbd.tls_clear_loopback,
            ) {
                (Some(_), true) => {
                    "TLS with a client certificate of its authority (loopback clients may skip TLS)"
                }
                (Some(_), false) => "TLS with a client certificate of its authority",
                (None, _) => "no TLS, no authentication",
            };
            tracing::info!(addr = %shown(self.state.addrs.nbd), mode, "NBD listening");
            tasks.spawn(nbd::serve(l, self.state.clone(), shutdown.clone()));
        }
        for (i, l) in self.iscsi.into_iter().enumerate() {
            let c = &self.state.config.iscsi;
            let mode = if c.chap_user.is_empty() && c.acl.is_empty() {
                "no CHAP, no ACL: loopback initiators only, unless a target sets its own; no encryption"
            } else {
                "CHAP and/or initiator ACL; no encryption"
            };
            tracing::info!(addr = %shown(l.local_addr().ok()), portal_group = i + 1, mode, "iSCSI portal listening");
            tasks.spawn(iscsi::serve(l, i, self.state.clone(), shutdown.clone()));
        }
        if let Some((portal, (pool, gateway))) = self.site_portal {
            let index = self.state.iscsi.portals.lock().len().saturating_sub(1);
            tracing::info!(addr = %portal.addr, device = %portal.device, portal_group = index + 1, "iSCSI site portal: served by whichever gateway holds its lease");
            tasks.spawn(site_portal::run(
                portal,
                index,
                pool,
                gateway,
                self.state.clone(),
                shutdown.clone(),
            ));
        }
        if let Some(cluster) = &self.cluster {
            tasks.spawn(fencing::watch(cluster.clone(), shutdown.clone()));
        }
        tasks.spawn(indexer::run(self.state.clone(), shutdown.clone()));
        tasks.spawn(indexer::run_shared_scan(
            self.state.clone(),
            shutdown.clone(),
        ));
        tasks.spawn(stale_copies::run(self.state.clone(), shutdown.clone()));
        tasks.spawn(in_doubt::run(self.state.clone(), shutdown.clone()));
        tasks.spawn(idle_release::run(self.state.clone(), shutdown.clone()));
        // Sanitizes a crash interrupted go on (their volumes refuse I/O
        // until they finish).
        for v in self.state.pool.list() {
            if v.sanitize_pending() {
                tracing::info!(volume = %v.name(), "resuming an interrupted sanitize");
                drop(iscsi::run_sanitize(
                    v,
                    self.state.config.storage.sanitize_bytes_per_sec,
                ));
            }
        }
        if let Some(l) = self.migration {
            let mode = if self.state.config.migration.plaintext {
                "PLAINTEXT (loopback only)"
            } else {
                "TLS 1.3, both ends present certificates pinned in <pool>/tls/trusted"
            };
            tracing::info!(addr = %shown(self.state.addrs.migration), mode, "accepting migrations");
            tasks.spawn(migration::destination::serve(
                l,
                self.state.clone() as Arc<dyn migration::StorageDaemon>,
                shutdown.clone(),
            ));
        }
        if let Some(l) = self.admin {
            let app = admin::router(self.state.clone());
            tasks.spawn(ferry_trust::api::serve(l, app, shutdown.clone()));
        }
        while tasks.join_next().await.is_some() {}
        // The index delta lives in memory; fold it into the runs before the
        // indexer bitmaps are saved as clean.
        let index = self.state.index.clone();
        match tokio::task::spawn_blocking(move || index.merge_all()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "merging the index at shutdown failed"),
            Err(e) => tracing::warn!(error = %e, "merging the index at shutdown failed"),
        }
        let pool = self.state.pool.clone();
        let closed = tokio::task::spawn_blocking(move || pool.close())
            .await
            .map_err(|e| ServerError::Admin(std::io::Error::other(e)))?;
        if self.cluster.as_ref().is_some_and(|c| c.fenced()) {
            // Its volumes' state could not be saved (the cluster refuses
            // this client): their next holders take them as after a crash.
            return Err(ServerError::Fenced);
        }
        closed.map_err(ServerError::Close)?;
        tracing::info!("pool closed cleanly");
        Ok(())
    }
}

/// The migration engine runs on the daemon's pool, index and settings.
impl migration::StorageDaemon for ServerState {
    fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    fn index(&self) -> &Arc<ferry_index::PoolIndex> {
        &self.index
    }

    fn registry(&self) -> &migration::Registry {
        &self.migrations
    }

    fn chunk_size(&self) -> u32 {
        self.config.index.block_size
    }

    fn plaintext(&self) -> bool {
        self.config.migration.plaintext
    }

    fn buddies(&self) -> &[String] {
        &self.config.migration.buddies
    }

    fn reserve_bytes(&self) -> u64 {
        self.config.migration.reserve_bytes
    }

    fn copy_committed(&self, vol: &Arc<ferry_storage::Volume>, location: &str, admin: &str) {
        if let Some(a) = vol.arrived() {
            let at = arrivals::Committed {
                location: location.into(),
                admin: admin.into(),
            };
            self.arrivals.record(&vol.name(), &a.id, at);
        }
    }

    /// `migration.advertise_nbd` if set; otherwise the NBD listener, with
    /// an unspecified address replaced by the one the migration came in on.
    fn advertised_nbd(&self, local: Option<SocketAddr>) -> String {
        advertised(
            &self.config.migration.advertise_nbd,
            self.addrs.nbd,
            local,
            false,
        )
    }

    /// `migration.advertise_admin` if set; otherwise the admin listener as
    /// for NBD, and nothing when it listens on loopback while the migration
    /// came from beyond (that address would name the source's machine).
    fn advertised_admin(&self, local: Option<SocketAddr>) -> String {
        advertised(
            &self.config.migration.advertise_admin,
            self.addrs.admin,
            local,
            true,
        )
    }

    /// The first iSCSI portal as advertised (see `migration.advertise_iscsi`)
    /// and this daemon's target port group; nothing without a portal.
    fn iscsi_port(&self, local: Option<SocketAddr>) -> ferry_migration::IscsiPort {
        let first = self.iscsi.portals.lock().first().copied();
        if first.is_none() {
            return ferry_migration::IscsiPort::default();
        }
        ferry_migration::IscsiPort {
            portal: advertised(&self.config.migration.advertise_iscsi, first, local, true),
            port_group: self.iscsi.port_group,
        }
    }

    fn volume_moved(&self, vol: &Arc<ferry_storage::Volume>) {
        self.iscsi.volume_moved(&vol.name());
    }

    fn migration_finished(&self, report: &ferry_api::Report) {
        self.metrics.migration_finished(report);
    }

    fn volume_arrived(&self, vol: &Arc<ferry_storage::Volume>) {
        indexer::index_arrived(self.index.clone(), &self.background_scans, vol);
    }

    fn local_rebuild_measured(&self, bytes: u64, seconds: f64) {
        self.rebuild_rate.record(bytes, seconds);
        tracing::info!(
            bytes,
            seconds,
            rate = self.rebuild_rate.bytes_per_second(),
            "incoming copy rebuilt held blocks"
        );
    }

    fn switch_hold_measured(&self, hold: Duration, rtt: Duration) {
        self.switch_hold.record(hold, rtt);
        tracing::info!(
            hold_ms = hold.as_secs_f64() * 1e3,
            rtt_ms = rtt.as_secs_f64() * 1e3,
            median_ms = self.switch_hold.seconds().map(|s| s * 1e3),
            "switch hold besides the link"
        );
    }

    fn move_setup_measured(&self, fixed: Duration) {
        self.move_setup.record(fixed);
        tracing::info!(
            fixed_ms = fixed.as_secs_f64() * 1e3,
            "a small move's work besides the link"
        );
    }
}

/// The address a migration's source is told to use for one of this
/// daemon's listeners: `configured` if set; else `bound`, an unspecified
/// IP replaced by `local` (the address the migration came in on); with
/// `local_only_on_loopback`, none for a loopback listener reached from
/// beyond loopback.
fn advertised(
    configured: &str,
    bound: Option<SocketAddr>,
    local: Option<SocketAddr>,
    local_only_on_loopback: bool,
) -> String {
    if !configured.is_empty() {
        return configured.to_string();
    }
    match (bound, local) {
        (Some(mut b), Some(l)) if b.ip().is_unspecified() => {
            b.set_ip(l.ip());
            b.to_string()
        }
        (Some(b), Some(l))
            if local_only_on_loopback && b.ip().is_loopback() && !l.ip().is_loopback() =>
        {
            String::new()
        }
        (Some(b), _) => b.to_string(),
        (None, _) => String::new(),
    }
}

/// A bound address for a log line ("-" when there is none).
fn shown(a: Option<SocketAddr>) -> String {
    a.map_or_else(|| "-".into(), |a| a.to_string())
}

#[cfg(test)]
mod advertised_tests {
    use super::advertised;

    #[test]
    fn listeners_are_advertised_as_the_source_can_reach_them() {
        let a = |s: &str| Some(s.parse().unwrap());
        // Configured wins.
        assert_eq!(
            advertised("x:1", a("0.0.0.0:2"), a("10.0.0.1:3"), true),
            "x:1"
        );
        // An unspecified listener: the address the migration came in on.
        assert_eq!(
            advertised("", a("0.0.0.0:2"), a("10.0.0.1:3"), true),
            "10.0.0.1:2"
        );
        // A loopback admin API is no use to a source beyond loopback.
        assert_eq!(advertised("", a("127.0.0.1:2"), a("10.0.0.1:3"), true), "");
        assert_eq!(
            advertised("", a("127.0.0.1:2"), a("127.0.0.1:3"), true),
            "127.0.0.1:2"
        );
        assert_eq!(
            advertised("", a("127.0.0.1:2"), a("10.0.0.1:3"), false),
            "127.0.0.1:2"
        );
        assert_eq!(advertised("", None, a("10.0.0.1:3"), true), "");
    }
}
