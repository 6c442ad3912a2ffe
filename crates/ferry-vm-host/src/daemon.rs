//! `ferry host` as a whole: the forwarder's NBD listeners, its control
//! API, and (with a state directory) the guests, their API and metrics,
//! and the TLS move listener peers send guests to.

use crate::{api, incoming, VmError, VmHost};
use ferry_forwarder::{Agent, Listener, DEFAULT_HOLD};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What `ferry host` does with its guests when it is stopped on purpose
/// (SIGTERM, SIGINT).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnStop {
    /// Guests run on. Their disk requests wait for the next daemon on the
    /// same state directory (QEMU reconnects to the forwarder for 30 s;
    /// a daemon back within that loses nothing, a later one leaves the
    /// guest with I/O errors).
    #[default]
    Keep,
    /// Guests are shut down (ACPI power button, then QEMU quits after
    /// `--stop-timeout`) while the forwarder still serves their disks; they
    /// stay stopped (`ferry vm start`).
    Stop,
}

impl std::str::FromStr for OnStop {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "keep" => Ok(OnStop::Keep),
            "stop" => Ok(OnStop::Stop),
            _ => Err(format!(
                "{s:?}: keep (guests run on) or stop (they are shut down)"
            )),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct HostOptions {
    /// What happens to the guests when the daemon is stopped on purpose.
    pub on_stop: OnStop,
    /// With [`OnStop::Stop`]: how long a guest may take to power off.
    pub stop_timeout: Duration,
    /// `(server, volume)` pairs forwarded from the start.
    pub volumes: Vec<(String, String)>,
    /// NBD listeners for hypervisors: `HOST:PORT` or `unix:PATH`.
    pub listen: Vec<String>,
    /// The control API (HTTP), e.g. `127.0.0.1:10890`.
    pub control: Option<String>,
    /// Run guests, keeping their state here.
    pub state_dir: Option<PathBuf>,
    /// Where peer hosts send guests (TLS), `HOST:PORT`.
    pub move_listen: Option<String>,
    /// NBD TLS credentials (client layout) for every storage daemon.
    pub nbd_tls_dir: Option<PathBuf>,
    /// Measure each running guest's memory (dirty rate, link share) this
    /// often (None: never).
    pub memory_sample_every: Option<Duration>,
    /// Serve the control API in plaintext, unauthenticated, beyond
    /// loopback (`--insecure-plaintext-api`).
    pub insecure_plaintext_api: bool,
    /// Where guests' kernels and initrds may come from (none given:
    /// `<state>/images`).
    pub image_dirs: Vec<PathBuf>,
    /// Storage daemons beyond this machine guests' disks may use.
    pub storage: Vec<String>,
    /// Groups of gateways in front of one Ceph cluster (each a site's),
    /// standing in for each other: a disk whose gateway does not answer
    /// goes to the next of its group, and a move of it starts at the admin
    /// API of one that answers. Their members count as known storage
    /// daemons.
    pub gateways: crate::gateways::GatewayGroups,
    /// Other hosts beyond this machine this host may probe.
    pub peers: Vec<String>,
    /// The user guests' QEMU runs as (when this daemon is root and the
    /// user exists; "" for none).
    pub qemu_user: String,
    /// The networks guests' NICs plug into; their bridges and overlays
    /// are made at start where missing.
    pub networks: Vec<crate::network::Network>,
}

/// Who besides an operator may call each route of the host's API: anyone
/// pinned reads; a controller starts and cancels moves and probes links.
pub fn access(m: &axum::http::Method, path: &str) -> &'static [ferry_trust::Role] {
    use ferry_trust::api::{changes_state, segments, ANYONE, OPERATOR};
    use ferry_trust::Role::Controller;
    if !changes_state(m) {
        return ANYONE;
    }
    match (m.as_str(), segments(path).as_slice()) {
        ("POST", ["v1", "vms", _, "migrate"])
        | ("POST", ["v1", "vm-moves", _, "cancel"])
        | ("POST", ["v1", "probe"]) => &[Controller],
        _ => OPERATOR,
    }
}

fn listen_err(addr: &str, e: impl std::fmt::Display) -> VmError {
    VmError::Listen {
        addr: addr.to_string(),
        detail: e.to_string(),
    }
}

/// Whether guests' QEMU runs as an unprivileged user (this daemon is root
/// and the user exists), and the socket directory it then reaches
/// (`crate::confine`); the forwarder's NBD socket for those guests is
/// `nbd.sock` in it (the one in the state directory stays, for guests
/// started before).
fn confinement(opts: &HostOptions) -> Result<Option<(PathBuf, crate::confine::QemuUser)>, VmError> {
    let Some(dir) = &opts.state_dir else {
        return Ok(None);
    };
    let Some(user) = crate::confine::qemu_user(&opts.qemu_user) else {
        // SAFETY: geteuid has no arguments and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            tracing::warn!(
                user = %opts.qemu_user,
                "guests' QEMU runs as root: no such user (create it, as scripts/install-deps.sh does, or give --qemu-user)"
            );
        }
        return Ok(None);
    };
    let pruned = crate::confine::prune_orphans(std::path::Path::new(crate::confine::SOCKET_ROOT));
    if pruned > 0 {
        tracing::info!(
            pruned,
            "removed the socket directories of hosts whose state is gone"
        );
    }
    let sockets = crate::confine::socket_dir(dir);
    crate::confine::make_socket_dir(&sockets, dir).map_err(|e| VmError::file(&sockets, e))?;
    tracing::info!(user = %user.name, sockets = %sockets.display(), "guests' QEMU runs as an unprivileged user");
    Ok(Some((sockets, user)))
}

/// The control API (the forwarder's volumes, and the guests' routes with a
/// state directory) on `addr`, checked: a daemon that would serve it in
/// plaintext beyond loopback does not start.
async fn control_api(
    addr: &str,
    opts: &HostOptions,
    agent: &Arc<Agent>,
    host: Option<&Arc<VmHost>>,
) -> Result<(ferry_trust::api::ApiListener, axum::Router), VmError> {
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| listen_err(addr, e))?;
    let mut router = ferry_forwarder::control::router(agent.clone());
    if let Some(h) = host {
        router = router.merge(api::router(h.clone()));
    }
    let sec = ferry_trust::api::ApiSecurity {
        name: "host control API",
        store: host.map(|h| h.certs.clone()),
        insecure_plaintext: opts.insecure_plaintext_api,
        access,
        limits: ferry_trust::api::API_LIMITS,
    };
    let api = ferry_trust::api::ApiListener::new(l, sec).map_err(|e| listen_err(addr, e))?;
    Ok((api, router))
}

/// Run until `shutdown`. Guests keep running when the daemon stops; the
/// next daemon on the same state directory finds them.
/// The host's guest networks, checked, their bridges and overlays made.
async fn ready_networks(opts: &HostOptions) -> Result<crate::network::Networks, VmError> {
    let networks = crate::network::Networks::new(opts.networks.clone())
        .map_err(|e| VmError::Config(e.to_string()))?;
    if !networks.all().is_empty() {
        let nets = networks.clone();
        tokio::task::spawn_blocking(move || nets.ensure())
            .await?
            .map_err(|e| VmError::Config(format!("setting up the guests' networks: {e}")))?;
        for n in networks.all() {
            tracing::info!(network = %n.name, bridge = %n.bridge, overlay = ?n.overlay, "guest network ready");
        }
    }
    Ok(networks)
}

pub async fn run(opts: HostOptions, signal: CancellationToken) -> Result<(), VmError> {
    // Everything below ends on `shutdown`, which follows `signal` once the
    // guests were dealt with as `opts.on_stop` says (the forwarder serves
    // their disks until then).
    let shutdown = CancellationToken::new();
    let tls = match &opts.nbd_tls_dir {
        Some(dir) => Some(ferry_client::ClientTls::from_dir(dir).map_err(|e| {
            VmError::Config(format!("NBD TLS credentials in {}: {e}", dir.display()))
        })?),
        None => None,
    };
    let agent = Agent::with_gateways(DEFAULT_HOLD, tls, Arc::new(opts.gateways.nbd_groups()));
    for (server, volume) in &opts.volumes {
        agent
            .attach(server, volume)
            .await
            .map_err(|e| VmError::Disk {
                volume: volume.clone(),
                detail: e.to_string(),
            })?;
    }
    let mut listen = opts.listen.clone();
    let mut nbd_socket = opts.state_dir.as_ref().map(|d| d.join("nbd.sock"));
    if let Some(s) = &nbd_socket {
        std::fs::create_dir_all(s.parent().unwrap_or(s)).map_err(|e| VmError::file(s, e))?;
        listen.push(format!("unix:{}", s.display()));
    }
    let confinement = confinement(&opts)?;
    if let Some((sockets, _)) = &confinement {
        let s = sockets.join("nbd.sock");
        listen.push(format!("unix:{}", s.display()));
        nbd_socket = Some(s);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for l in &listen {
        let listener = Listener::bind(l).await.map_err(|e| listen_err(l, e))?;
        let mode = if l.starts_with("unix:") {
            "a unix socket: this machine's hypervisors"
        } else {
            "no TLS, no authentication: this machine's hypervisors, or a network you trust"
        };
        tracing::info!(listen = %l, mode, "serving NBD (the guests' disks)");
        tasks.spawn(ferry_forwarder::serve(
            listener,
            agent.clone(),
            shutdown.clone(),
        ));
    }
    if let (Some((_, user)), Some(s)) = (&confinement, &nbd_socket) {
        crate::confine::give_socket(s, user).map_err(|e| VmError::file(s, e))?;
    }
    let networks = ready_networks(&opts).await?;
    let host = match (&opts.state_dir, &nbd_socket) {
        (Some(dir), Some(sock)) => {
            Some(open_guests(&opts, dir, sock, &agent, confinement, networks).await?)
        }
        _ => None,
    };
    if let (Some(h), Some(addr)) = (&host, &opts.control) {
        *h.control.lock() = Some(addr.clone());
    }
    if let Some(addr) = &opts.control {
        let (api, router) = control_api(addr, &opts, &agent, host.as_ref()).await?;
        tasks.spawn(ferry_trust::api::serve(api, router, shutdown.clone()));
    }
    if let (Some(h), Some(addr)) = (&host, &opts.move_listen) {
        let l = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| listen_err(addr, e))?;
        tracing::info!(listen = %addr, mode = "TLS 1.3, both ends present certificates pinned in <state-dir>/tls/trusted", "move listener");
        tasks.spawn(incoming::serve(h.clone(), l, shutdown.clone()));
    }
    if let Some(h) = &host {
        spawn_guest_rounds(&mut tasks, h, opts.memory_sample_every, &shutdown);
    }
    {
        let (host, shutdown, on_stop, timeout) = (
            host.clone(),
            shutdown.clone(),
            opts.on_stop,
            opts.stop_timeout,
        );
        tasks.spawn(async move {
            signal.cancelled().await;
            if let (Some(h), OnStop::Stop) = (&host, on_stop) {
                h.stop_all(timeout).await;
            }
            shutdown.cancel();
        });
    }
    while tasks.join_next().await.is_some() {}
    if let Some(h) = &host {
        leave_socket_dir(h);
    }
    Ok(())
}

/// The guests' side of the host (`--state-dir`): their state opened, the
/// guests a previous daemon left found again.
async fn open_guests(
    opts: &HostOptions,
    dir: &std::path::Path,
    sock: &std::path::Path,
    agent: &Arc<Agent>,
    confinement: Option<(std::path::PathBuf, crate::confine::QemuUser)>,
    networks: crate::network::Networks,
) -> Result<Arc<VmHost>, VmError> {
    // The KVM probe runs a QEMU for up to 1.5 s: once, here, off the
    // runtime's threads, rather than inside the first request.
    tokio::task::spawn_blocking(crate::qemu::kvm_usable);
    let name = opts
        .move_listen
        .clone()
        .unwrap_or_else(|| "this host".into());
    VmHost::open(
        dir,
        agent.clone(),
        sock,
        &name,
        crate::host::GuestBounds {
            image_dirs: opts.image_dirs.clone(),
            known_storage: opts
                .storage
                .iter()
                .cloned()
                .chain(opts.gateways.nbd_addresses().map(String::from))
                .collect(),
            gateways: Arc::new(opts.gateways.clone()),
            known_peers: opts.peers.clone(),
            confinement,
            networks,
        },
    )
    .await
}

/// The host's rounds over its guests until `shutdown`: the moves the last
/// daemon left unfinished ended, failed arrivals reaped every 2 s, and
/// (with `memory_sample_every`) each running guest's memory measured.
fn spawn_guest_rounds(
    tasks: &mut tokio::task::JoinSet<()>,
    h: &Arc<VmHost>,
    memory_sample_every: Option<Duration>,
    shutdown: &CancellationToken,
) {
    // Moves the last daemon left unfinished: asked about and ended.
    crate::recover::resume_unfinished(h);
    let (host, sd) = (h.clone(), shutdown.clone());
    tasks.spawn(async move {
        loop {
            tokio::select! {
                () = sd.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
            incoming::reap_failed_incoming(&host).await;
        }
    });
    let Some(every) = memory_sample_every else {
        return;
    };
    let (host, sd) = (h.clone(), shutdown.clone());
    tasks.spawn(async move {
        // A guest just started or arrived is measured within a tick;
        // after that, every `every`.
        let tick = every.min(Duration::from_secs(2));
        loop {
            tokio::select! {
                () = sd.cancelled() => return,
                () = tokio::time::sleep(tick) => {}
            }
            let guests = host.guests.read().values().cloned().collect();
            tokio::select! {
                () = sd.cancelled() => return,
                () = crate::dirty_rate::sample(guests, every) => {}
            }
        }
    });
}

/// A host that leaves no guest running leaves no socket directory.
fn leave_socket_dir(h: &VmHost) {
    if let Some((dir, _)) = &h.confinement {
        if h.guests.read().values().all(|g| g.runtime().is_none()) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[cfg(test)]
mod access_tests {
    use super::access;
    use axum::http::Method;
    use ferry_trust::Role::{self, Controller, Operator};

    fn admits(m: Method, path: &str) -> Vec<Role> {
        let mut r: Vec<Role> = access(&m, path).to_vec();
        r.retain(|x| *x != Operator);
        r
    }

    /// Every state-changing route of the host's API: a controller starts
    /// and cancels moves and probes; everything else is the operator's.
    #[test]
    fn each_state_changing_route_admits_only_its_roles() {
        for (m, p) in [
            (Method::POST, "/v1/vms"),
            (Method::DELETE, "/v1/vms/g"),
            (Method::POST, "/v1/vms/g/start"),
            (Method::POST, "/v1/vms/g/stop"),
            (Method::POST, "/v1/volumes"),
            (Method::DELETE, "/v1/volumes/v"),
        ] {
            assert!(admits(m.clone(), p).is_empty(), "{m} {p}");
        }
        for (m, p) in [
            (Method::POST, "/v1/vms/g/migrate"),
            (Method::POST, "/v1/vm-moves/i/cancel"),
            (Method::POST, "/v1/probe"),
        ] {
            assert_eq!(admits(m.clone(), p), [Controller], "{m} {p}");
        }
        assert_eq!(admits(Method::GET, "/v1/vms").len(), 4);
    }
}
