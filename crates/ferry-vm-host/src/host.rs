//! The guests of one host: create, start, stop, delete, show; their
//! specs under `<state>/vms/NAME/`, their disks attached to the host's
//! forwarder while a guest needs them.

use crate::guest::{cpu_seconds, memory_resident_bytes, Guest};
use crate::moves::MoveRun;
use crate::qemu::{host_memory_mib, qemu_available, resolve_accel, validate};
use crate::VmError;
use ferry_api::{MigrationId, VmSpec, VmState, VmView};
use ferry_forwarder::{Agent, HostError};
use ferry_trust::store::CertStore;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a host's guests may use: where their kernels come from, the
/// storage and peer hosts it knows beyond its own machine, and the user
/// and socket directory their QEMU is confined to (docs/security.md).
#[derive(Debug, Clone, Default)]
pub struct GuestBounds {
    pub image_dirs: Vec<PathBuf>,
    pub known_storage: Vec<String>,
    /// Shared gateways standing in for each other (`--gateways`).
    pub gateways: Arc<crate::gateways::GatewayGroups>,
    pub known_peers: Vec<String>,
    pub confinement: Option<(PathBuf, crate::confine::QemuUser)>,
    /// The networks guests' NICs may plug into (`--network`).
    pub networks: crate::network::Networks,
}

pub struct VmHost {
    pub root: PathBuf,
    pub agent: Arc<Agent>,
    /// The forwarder's unix socket, where QEMU opens its disks.
    pub nbd_socket: PathBuf,
    pub certs: CertStore,
    /// Where kernels and initrds may come from (`--image-dir`).
    pub image_dirs: Vec<PathBuf>,
    /// Storage daemons (NBD `HOST:PORT`) guests' disks may be served by,
    /// besides those on this machine (`--storage`).
    pub known_storage: Vec<String>,
    /// Shared gateways standing in for each other (`--gateways`): where a
    /// move of a disk starts when the gateway its spec names is gone.
    pub gateways: Arc<crate::gateways::GatewayGroups>,
    /// Other hosts' move addresses this host may probe, besides those on
    /// this machine (`--peer`).
    pub known_peers: Vec<String>,
    /// The user QEMU runs as and the socket directory it reaches, when
    /// guests are confined (`crate::confine`).
    pub confinement: Option<(PathBuf, crate::confine::QemuUser)>,
    /// This host's move listener as peers reach it (for reports).
    pub name: String,
    pub guests: parking_lot::RwLock<BTreeMap<String, Arc<Guest>>>,
    pub moves: parking_lot::Mutex<BTreeMap<MigrationId, Arc<MoveRun>>>,
    /// Moves an earlier daemon on this state directory ran, as it last
    /// recorded them (`<state>/moves/<id>.json`); one it left unfinished
    /// reads as failed, with the reason.
    pub past_moves: parking_lot::Mutex<BTreeMap<MigrationId, ferry_api::VmMoveStatus>>,
    /// This host's control API (`--control`), told to a source whose guest
    /// arrived here: where `ferry vm` reaches the guest now.
    pub control: parking_lot::Mutex<Option<String>>,
    /// The networks guests' NICs plug into (`--network`).
    pub networks: crate::network::Networks,
    /// Raw bytes per second this host's recent outgoing memory streams
    /// ran at where the machine bound them (QEMU's walk, compression,
    /// encryption, the far side keeping pace), not the link: told with
    /// every guest's view, so the model prices a move from here at this
    /// machine's speed (`<state>/memory-stream-rate.json`).
    pub stream_rate: ferry_state_file::rate_log::RateLog,
    /// The fixed time of this host's recent outgoing memory moves (the
    /// destination QEMU's start, QEMU's set-up, the last load and answer:
    /// `crate::moves::setup_measure`), told with every guest's view
    /// (`<state>/memory-move-setup.json`).
    pub setup_cost: ferry_state_file::rate_log::SecondsLog,
    /// How busy this host's recent outgoing memory streams kept a link
    /// that held them back (`crate::moves::efficiency_measure`), told
    /// with every guest's view (`<state>/memory-stream-efficiency.json`).
    pub stream_efficiency: ferry_state_file::rate_log::ShareLog,
    /// The pauses of this host's recent outgoing VM-only moves and
    /// teleports, with their links' round trips and the guests' memory
    /// (`crate::moves::measure_pause`), told with every guest's view so
    /// that the model prices a pause from here at this machine's own
    /// (`<state>/vm-move-pauses.json`, `<state>/teleport-pauses.json`).
    pub vm_move_pauses: ferry_state_file::rate_log::PauseLog,
    pub teleport_pauses: ferry_state_file::rate_log::PauseLog,
    /// The host's own part of its recent completed disk-only moves (each
    /// move's time less its slowest disk's migration:
    /// `crate::moves::measure_disk_move_host`), told with every guest's
    /// view (`<state>/disk-move-host.json`).
    pub disk_move_host: ferry_state_file::rate_log::SecondsLog,
    /// The links' rates this host's memory streams found, by peer: the
    /// next stream to a peer starts from it (`crate::tunnel::LinkRates`;
    /// `<state>/memory-link-rates.json`).
    pub link_rates: Arc<crate::tunnel::LinkRates>,
}

fn disk_error(volume: &str, e: &HostError) -> VmError {
    // The server answers, but has no such export: say what to do.
    if let HostError::Connect {
        server,
        source:
            ferry_client::ClientError::Protocol(ferry_nbd::NbdError::OptionRefused { reply, .. }),
        ..
    } = e
    {
        if *reply == ferry_nbd::consts::REP_ERR_UNKNOWN {
            return VmError::Disk {
                volume: volume.into(),
                detail: format!(
                    "the storage daemon at {server} has no volume {volume}: create it there first \
                     (`ferry volume create {volume} --size SIZE --admin ITS_ADMIN_ADDRESS`), or name \
                     the daemon that holds it"
                ),
            };
        }
    }
    VmError::Disk {
        volume: volume.into(),
        detail: e.to_string(),
    }
}

impl VmHost {
    /// Open the state directory and find the guests a previous daemon left
    /// (running ones keep running; their disks are attached again).
    pub async fn open(
        root: &Path,
        agent: Arc<Agent>,
        nbd_socket: &Path,
        name: &str,
        bounds: GuestBounds,
    ) -> Result<Arc<VmHost>, VmError> {
        let GuestBounds {
            image_dirs,
            known_storage,
            gateways,
            known_peers,
            confinement,
            networks,
        } = bounds;
        let vms = root.join("vms");
        std::fs::create_dir_all(&vms).map_err(|e| VmError::file(&vms, e))?;
        let certs = CertStore::at(&root.join("tls"), ferry_trust::Role::Host);
        certs
            .ensure_identity()
            .map_err(|e| VmError::Config(format!("this host's TLS identity: {e}")))?;
        // Calls to storage daemons' admin APIs beyond loopback go with
        // this host's certificate.
        ferry_api::client::set_process_identity(certs.clone());
        let host = Arc::new(VmHost {
            root: root.to_path_buf(),
            agent,
            nbd_socket: nbd_socket.to_path_buf(),
            certs,
            image_dirs: if image_dirs.is_empty() {
                vec![root.join("images")]
            } else {
                image_dirs
            },
            known_storage,
            gateways,
            known_peers,
            confinement,
            name: name.into(),
            guests: Default::default(),
            moves: Default::default(),
            past_moves: parking_lot::Mutex::new(crate::moves::past_moves(root)),
            control: parking_lot::Mutex::new(None),
            networks,
            stream_rate: ferry_state_file::rate_log::RateLog::open(
                root.join(crate::guest::files::STREAM_RATE_FILE),
                crate::guest::files::STREAM_RATE,
                "this host's memory stream rate",
            ),
            setup_cost: ferry_state_file::rate_log::SecondsLog::open(
                root.join(crate::guest::files::SETUP_COST_FILE),
                crate::guest::files::SETUP_COST,
                "this host's memory move set-up",
            ),
            stream_efficiency: ferry_state_file::rate_log::ShareLog::open(
                root.join(crate::guest::files::STREAM_EFFICIENCY_FILE),
                crate::guest::files::STREAM_EFFICIENCY,
                "this host's memory stream's use of its link",
            ),
            vm_move_pauses: ferry_state_file::rate_log::PauseLog::open(
                root.join(crate::guest::files::VM_MOVE_PAUSES_FILE),
                crate::guest::files::PAUSES,
                "this host's VM-only moves' pauses",
            ),
            teleport_pauses: ferry_state_file::rate_log::PauseLog::open(
                root.join(crate::guest::files::TELEPORT_PAUSES_FILE),
                crate::guest::files::PAUSES,
                "this host's teleports' pauses",
            ),
            disk_move_host: ferry_state_file::rate_log::SecondsLog::open(
                root.join(crate::guest::files::DISK_MOVE_HOST_FILE),
                crate::guest::files::DISK_MOVE_HOST,
                "this host's part of its disk moves",
            ),
            link_rates: Arc::new(crate::tunnel::LinkRates::open(
                root.join(crate::guest::files::LINK_RATES_FILE),
            )),
        });
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&vms)
            .map_err(|e| VmError::file(&vms, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for dir in entries {
            let spec: VmSpec = match crate::guest::read_json(
                &dir.join("spec.json"),
                crate::guest::files::SPEC,
            ) {
                Ok(Some(s)) => s,
                Ok(None) => continue,
                Err(e) => {
                    tracing::error!(dir = %dir.display(), error = %e, "unreadable guest spec; skipped");
                    continue;
                }
            };
            let g = Arc::new(Guest::new(spec.clone(), &dir, host.confined(&spec.name)));
            let incoming: Option<MigrationId> = crate::guest::read_json(
                &dir.join(crate::incoming::INCOMING_MARK),
                crate::guest::files::INCOMING,
            )
            .ok()
            .flatten();
            if let Some(id) = &incoming {
                if !matches!(g.adopt().await, Ok(true)) {
                    tracing::info!(guest = %spec.name, move_id = %id, "a guest that never arrived; removing it");
                    let _ = std::fs::remove_dir_all(&dir);
                    continue;
                }
                *g.incoming.lock() = Some(id.clone());
                host.guests.write().insert(spec.name.clone(), g);
                continue;
            }
            // Disks first: a QEMU whose disk requests wait on this
            // forwarder (its NBD client reconnects for 30 s) may not answer
            // its monitor until they are served again, as when the daemon
            // died during a move and QEMU's clean-up waits on its disks.
            let attached = g.recorded_qemu_alive()
                && {
                    match host.attach_disks(&spec).await {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::error!(guest = %spec.name, error = %e, "disks of a running guest unreachable");
                            false
                        }
                    }
                };
            match g.adopt().await {
                Ok(true) if !attached => {
                    if let Err(e) = host.attach_disks(&spec).await {
                        tracing::error!(guest = %spec.name, error = %e, "disks of a running guest unreachable");
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(guest = %spec.name, error = %e, "QEMU found but not reachable")
                }
            }
            host.guests.write().insert(spec.name.clone(), g);
        }
        Ok(host)
    }

    pub fn guest(&self, name: &str) -> Result<Arc<Guest>, VmError> {
        self.guests
            .read()
            .get(name)
            .cloned()
            .ok_or_else(|| VmError::NotFound(name.into()))
    }

    pub(crate) async fn attach_disks(&self, spec: &VmSpec) -> Result<(), VmError> {
        for d in &spec.disks {
            if self.agent.get(&d.volume).is_some() {
                continue;
            }
            match self.agent.attach(&d.server, &d.volume).await {
                Ok(_) | Err(HostError::Attached(_)) => {}
                Err(e) => return Err(disk_error(&d.volume, &e)),
            }
        }
        Ok(())
    }

    /// Detach the volumes of `spec` no other guest here uses.
    pub(crate) fn detach_disks(&self, spec: &VmSpec) {
        let guests = self.guests.read();
        for d in &spec.disks {
            let used = guests.values().any(|g| {
                let s = g.spec.lock();
                s.name != spec.name
                    && s.disks.iter().any(|x| x.volume == d.volume)
                    && g.runtime().is_some()
            });
            if !used {
                self.agent.detach(&d.volume);
            }
        }
    }

    /// Where guest `name`'s move sockets live and the user its QEMU runs
    /// as, when guests are confined.
    pub fn confined(&self, name: &str) -> Option<(PathBuf, crate::confine::QemuUser)> {
        self.confinement
            .as_ref()
            .map(|(dir, u)| (crate::confine::guest_socket_dir(dir, name), u.clone()))
    }

    /// Every disk of `spec` is served by a storage daemon this host knows:
    /// one on this machine (loopback, a unix socket) or one given with
    /// `--storage`. A caller cannot point a guest at an NBD server of its
    /// own choosing beyond them.
    pub fn check_disk_servers(&self, spec: &VmSpec) -> Result<(), VmError> {
        for d in &spec.disks {
            if !known_address(&d.server, &self.known_storage) {
                return Err(VmError::BadSpec(format!(
                    "disk {}: {} is not a storage daemon this host knows; start `ferry host` with --storage {}",
                    d.volume, d.server, d.server
                )));
            }
        }
        Ok(())
    }

    /// Whether this host may probe `to` (another host's move address).
    pub fn peer_known(&self, to: &str) -> bool {
        known_address(to, &self.known_peers)
    }

    /// The first disk of `spec` that another guest of this host has, and
    /// that guest.
    pub fn disk_in_use(&self, spec: &VmSpec) -> Option<(String, String)> {
        disk_of_another(&self.guests.read(), spec)
    }

    /// Every card of `spec` on a network this host has, with a MAC no
    /// other guest here uses (its own MAC when given, lower-cased; a new
    /// one when not). A guest arriving by a move keeps the MACs it has.
    pub fn check_nics(&self, spec: &mut VmSpec) -> Result<(), VmError> {
        use crate::network::{check_mac, new_mac};
        let bad = |e: crate::network::NetError| VmError::BadSpec(e.to_string());
        for n in &spec.nics {
            self.networks.get(&n.network).map_err(bad)?;
        }
        let guests = self.guests.read();
        let taken = |mac: &str| mac_of_another(&guests, &spec.name, mac);
        for i in 0..spec.nics.len() {
            let mac = if spec.nics[i].mac.is_empty() {
                let mut m = new_mac();
                while taken(&m).is_some() || spec.nics.iter().any(|n| n.mac == m) {
                    m = new_mac();
                }
                m
            } else {
                check_mac(&spec.nics[i].mac).map_err(bad)?
            };
            spec.nics[i].mac = mac;
        }
        mac_clash(&guests, spec)
    }

    fn accel_for(spec: &VmSpec) -> Result<&'static str, VmError> {
        resolve_accel(spec.accel).map_err(VmError::BadSpec)
    }

    /// Shut every guest down (the daemon stops with `--on-stop stop`): the
    /// ACPI power button, then QEMU quits once `timeout` passed; a guest in
    /// a move is left to the move's recovery. All at once.
    pub async fn stop_all(&self, timeout: std::time::Duration) {
        let guests: Vec<Arc<Guest>> = self.guests.read().values().cloned().collect();
        let mut stops = tokio::task::JoinSet::new();
        for g in guests {
            if g.runtime().is_none() {
                continue;
            }
            if let Some(id) = g.moving.lock().clone() {
                tracing::warn!(guest = %g.name(), move_id = %id, "not stopped: a move runs (the next daemon finishes or ends it)");
                continue;
            }
            stops.spawn(async move {
                let _op = g.op.lock().await;
                let how = g.power_off(timeout).await;
                let spec = g.spec.lock().clone();
                (g.name().to_string(), how, spec)
            });
        }
        while let Some(r) = stops.join_next().await {
            if let Ok((name, how, spec)) = r {
                tracing::info!(guest = %name, how, "guest stopped with the daemon");
                self.detach_disks(&spec);
            }
        }
    }

    /// Where `ferry vm` reaches this host's guests: its control API, else
    /// its move listener's name.
    pub fn reached_at(&self) -> String {
        self.control
            .lock()
            .clone()
            .unwrap_or_else(|| self.name.clone())
    }

    /// Define a guest (and start it). Everything is checked first: a bad
    /// spec, a taken name, an unreachable disk or a missing QEMU leave
    /// nothing behind.
    pub async fn create(&self, mut spec: VmSpec, start: bool) -> Result<VmView, VmError> {
        self.check_nics(&mut spec)?;
        validate(&spec, host_memory_mib()).map_err(VmError::BadSpec)?;
        crate::qemu::boot_files_allowed(&spec, &self.image_dirs).map_err(VmError::BadSpec)?;
        self.check_disk_servers(&spec)?;
        if !qemu_available() {
            return Err(VmError::BadSpec(format!(
                "QEMU ({}) is not installed on this host",
                crate::qemu::qemu_binary()
            )));
        }
        let accel = Self::accel_for(&spec)?;
        let dir = self.root.join("vms").join(&spec.name);
        let g = {
            let mut guests = self.guests.write();
            if guests.contains_key(&spec.name) || dir.exists() {
                return Err(VmError::Exists(spec.name.clone()));
            }
            if let Some((volume, other)) = disk_of_another(&guests, &spec) {
                return Err(VmError::BadSpec(format!(
                    "volume {volume} is a disk of guest {other}: a volume serves one guest"
                )));
            }
            // Checked again where the guest is added: another create
            // may have taken the MAC meanwhile.
            mac_clash(&guests, &spec)?;
            let g = Arc::new(Guest::new(spec.clone(), &dir, self.confined(&spec.name)));
            guests.insert(spec.name.clone(), g.clone());
            g
        };
        let undo = |e: VmError| {
            self.guests.write().remove(&spec.name);
            let _ = std::fs::remove_dir_all(&dir);
            e
        };
        // Every disk must answer before anything is written: attached now
        // when the guest starts, only reached otherwise.
        if start {
            self.attach_disks(&spec).await.map_err(undo)?;
        } else {
            for d in &spec.disks {
                if self.agent.get(&d.volume).is_none() {
                    let opts = ferry_client::ConnectOptions {
                        tls: self.agent.tls().cloned(),
                        ..Default::default()
                    };
                    ferry_client::NbdClient::connect(&d.server, &d.volume, &opts)
                        .await
                        .map_err(|e| {
                            undo(disk_error(
                                &d.volume,
                                &HostError::Connect {
                                    volume: d.volume.clone(),
                                    server: d.server.clone(),
                                    source: e,
                                },
                            ))
                        })?;
                }
            }
        }
        let undo_all = |e: VmError| {
            if start {
                self.detach_disks(&spec);
            }
            undo(e)
        };
        std::fs::create_dir_all(&dir).map_err(|e| undo_all(VmError::file(&dir, e)))?;
        g.save_spec().map_err(undo_all)?;
        if start {
            let _op = g.op.lock().await;
            if let Err(e) = g
                .start_qemu(
                    accel,
                    &self.nbd_socket,
                    crate::qemu::Start::Boot,
                    &self.networks,
                )
                .await
            {
                return Err(undo_all(e));
            }
        }
        Ok(self.view(&g).await)
    }

    pub async fn start(&self, name: &str) -> Result<VmView, VmError> {
        let g = self.guest(name)?;
        let _op = g.op.lock().await;
        let (st, _) = g.state().await;
        match st {
            VmState::Running | VmState::Paused | VmState::Incoming => {
                return Err(VmError::Busy {
                    name: name.into(),
                    state: st.as_str().into(),
                    what: "already has a QEMU process".into(),
                })
            }
            VmState::Moved => {
                return Err(VmError::Busy {
                    name: name.into(),
                    state: st.as_str().into(),
                    what: "it runs on another host now".into(),
                })
            }
            VmState::Stopped | VmState::Crashed => {}
        }
        let spec = g.spec.lock().clone();
        let accel = Self::accel_for(&spec)?;
        self.check_disk_servers(&spec)?;
        self.attach_disks(&spec).await?;
        g.start_qemu(
            accel,
            &self.nbd_socket,
            crate::qemu::Start::Boot,
            &self.networks,
        )
        .await?;
        Ok(self.view(&g).await)
    }

    /// Change a defined guest where it is safe: a disk's admin address at
    /// any time but during a move (checked: that daemon must hold the
    /// volume, not have seen it leave), memory and CPUs only while stopped.
    pub async fn update(&self, name: &str, u: ferry_api::UpdateVm) -> Result<VmView, VmError> {
        let g = self.guest(name)?;
        if let Some(id) = g.moving.lock().clone() {
            return Err(VmError::Busy {
                name: name.into(),
                state: "moving".into(),
                what: format!("move {id} runs; change it once the move ended"),
            });
        }
        let _op = g.op.lock().await;
        let (st, _) = g.state().await;
        if matches!(st, VmState::Incoming | VmState::Moved) {
            return Err(VmError::Busy {
                name: name.into(),
                state: st.as_str().into(),
                what: "change it on the host it runs at".into(),
            });
        }
        let mut spec = g.spec.lock().clone();
        if u.memory_mib.is_some() || u.vcpus.is_some() {
            if !matches!(st, VmState::Stopped | VmState::Crashed) {
                return Err(VmError::Busy {
                    name: name.into(),
                    state: st.as_str().into(),
                    what: "memory and CPUs change only while it is stopped (`ferry vm stop` first)"
                        .into(),
                });
            }
            spec.memory_mib = u.memory_mib.unwrap_or(spec.memory_mib);
            spec.vcpus = u.vcpus.unwrap_or(spec.vcpus);
            validate(&spec, host_memory_mib()).map_err(VmError::BadSpec)?;
        }
        for (volume, admin) in &u.disk_admin {
            let Some(d) = spec.disks.iter_mut().find(|d| &d.volume == volume) else {
                return Err(VmError::BadSpec(format!(
                    "guest {name} has no disk {volume} (its disks: {})",
                    spec.disks
                        .iter()
                        .map(|d| d.volume.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            };
            if admin.is_empty() {
                d.admin = None;
                continue;
            }
            holds_volume(admin, volume).await?;
            d.admin = Some(admin.clone());
        }
        *g.spec.lock() = spec;
        g.save_spec()?;
        Ok(self.view(&g).await)
    }

    pub async fn stop(&self, name: &str) -> Result<VmView, VmError> {
        let g = self.guest(name)?;
        if let Some(id) = g.moving.lock().clone() {
            return Err(VmError::Busy {
                name: name.into(),
                state: "moving".into(),
                what: format!("move {id} runs; cancel it first"),
            });
        }
        let _op = g.op.lock().await;
        g.stop_qemu().await;
        let spec = g.spec.lock().clone();
        self.detach_disks(&spec);
        Ok(self.view(&g).await)
    }

    pub async fn delete(&self, name: &str) -> Result<(), VmError> {
        self.stop(name).await?;
        let g = self.guest(name)?;
        let _op = g.op.lock().await;
        self.guests.write().remove(name);
        let _ = std::fs::remove_dir_all(&g.paths.dir);
        Ok(())
    }

    pub async fn view(&self, g: &Guest) -> VmView {
        let spec = g.spec.lock().clone();
        let (state, qemu_status) = g.state().await;
        let rt = g.runtime();
        let memory = *g.memory.lock();
        let disks = spec
            .disks
            .iter()
            .map(|d| match self.agent.get(&d.volume) {
                Some(u) => u.io.snapshot(&d.volume, &u.server(), u.stats().0),
                None => ferry_api::DiskIo {
                    volume: d.volume.clone(),
                    server: d.server.clone(),
                    ..Default::default()
                },
            })
            .collect();
        VmView {
            state,
            accel: rt.as_ref().map(|r| r.accel.clone()),
            pid: rt.as_ref().map(|r| r.pid),
            qemu_status,
            cpu_time_s: rt.as_ref().map_or(0.0, |r| cpu_seconds(r.pid)),
            memory_resident_bytes: rt
                .as_ref()
                .and_then(|r| memory_resident_bytes(r.pid, spec.memory_mib << 20)),
            memory_dirty: rt.as_ref().and(memory.dirty),
            memory_link_share: rt.as_ref().and(memory.link_share),
            memory_stream_bps: self.stream_rate.bytes_per_second(),
            memory_move_setup_s: self.setup_cost.median(),
            memory_link_efficiency: self.stream_efficiency.median(),
            vm_move_pauses: self
                .vm_move_pauses
                .recent()
                .iter()
                .map(move_pause)
                .collect(),
            teleport_pauses: self
                .teleport_pauses
                .recent()
                .iter()
                .map(move_pause)
                .collect(),
            disk_move_host_s: self.disk_move_host.values(),
            disks,
            nics: self.nic_views(&g.paths.dir, &spec, rt.is_some()),
            serial_log: g.paths.serial.clone(),
            moving: g.moving.lock().clone(),
            spec,
        }
    }

    /// Each NIC of `spec` (the guest in `dir`) as plugged here, with its
    /// tap's counters while QEMU runs.
    fn nic_views(
        &self,
        dir: &std::path::Path,
        spec: &VmSpec,
        running: bool,
    ) -> Vec<ferry_api::NicView> {
        spec.nics
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let tap = crate::network::tap_name(dir, i);
                let net = self.networks.get(&n.network).ok();
                let count = running
                    .then(|| crate::network::tap_counters(&tap))
                    .flatten();
                ferry_api::NicView {
                    network: n.network.clone(),
                    mac: n.mac.clone(),
                    bridge: net.map(|x| x.bridge.clone()).unwrap_or_default(),
                    overlay: net
                        .and_then(|x| x.overlay.as_ref())
                        .map(ToString::to_string),
                    to_guest_bytes: count.map(|c| c.to_guest_bytes),
                    from_guest_bytes: count.map(|c| c.from_guest_bytes),
                    to_guest_packets: count.map(|c| c.to_guest_packets),
                    from_guest_packets: count.map(|c| c.from_guest_packets),
                    tap,
                }
            })
            .collect()
    }

    pub async fn list(&self) -> Vec<VmView> {
        let gs: Vec<Arc<Guest>> = self.guests.read().values().cloned().collect();
        let mut out = Vec::with_capacity(gs.len());
        for g in gs {
            out.push(self.view(&g).await);
        }
        out
    }
}

/// A kept pause as the API tells it.
fn move_pause(p: &ferry_state_file::rate_log::Pause) -> ferry_api::MovePause {
    ferry_api::MovePause {
        pause_s: p.pause_s,
        rtt_s: p.rtt_s,
        memory_bytes: p.memory_bytes,
    }
}

fn disk_of_another(
    guests: &BTreeMap<String, Arc<Guest>>,
    spec: &VmSpec,
) -> Option<(String, String)> {
    guests
        .iter()
        .filter(|(name, _)| **name != spec.name)
        .find_map(|(name, g)| {
            let theirs = g.spec.lock();
            spec.disks
                .iter()
                .find(|d| theirs.disks.iter().any(|t| t.volume == d.volume))
                .map(|d| (d.volume.clone(), name.clone()))
        })
}

/// Refuse `spec` when one of its cards has the MAC of another guest here.
fn mac_clash(guests: &BTreeMap<String, Arc<Guest>>, spec: &VmSpec) -> Result<(), VmError> {
    match spec
        .nics
        .iter()
        .find_map(|n| mac_of_another(guests, &spec.name, &n.mac).map(|o| (&n.mac, o)))
    {
        Some((mac, other)) => Err(VmError::BadSpec(format!(
            "MAC {mac} is a card of guest {other} here: two cards of one MAC on a network \
             lose each other's traffic"
        ))),
        None => Ok(()),
    }
}

/// The guest (other than `name`) one of whose cards has `mac`.
fn mac_of_another(guests: &BTreeMap<String, Arc<Guest>>, name: &str, mac: &str) -> Option<String> {
    guests
        .iter()
        .filter(|(n, _)| n.as_str() != name)
        .find(|(_, g)| g.spec.lock().nics.iter().any(|x| x.mac == mac))
        .map(|(n, _)| n.clone())
}

/// An address on this machine (a loopback one, a unix socket) or one of
/// `declared`.
fn known_address(addr: &str, declared: &[String]) -> bool {
    if addr.starts_with("unix:") || declared.iter().any(|d| d == addr) {
        return true;
    }
    ferry_trust::is_loopback_name(ferry_trust::host_of(addr))
}

/// Whether the storage daemon whose admin API is `admin` holds `volume`
/// here (not moved away): the check before a guest's spec names it.
async fn holds_volume(admin: &str, volume: &str) -> Result<(), VmError> {
    let (c, v) = (ferry_api::AdminClient::new(admin), volume.to_string());
    let view = tokio::task::spawn_blocking(move || c.volume(&v)).await?;
    let bad = |detail: String| VmError::Disk {
        volume: volume.into(),
        detail,
    };
    match view {
        Ok(Some(v)) => match v.moved_to {
            None => Ok(()),
            Some(to) => Err(bad(format!(
                "the storage daemon at {admin} saw it move to {to}{}",
                v.moved_admin
                    .map(|a| format!("; its admin address there is {a}"))
                    .unwrap_or_default()
            ))),
        },
        Ok(None) => Err(bad(format!(
            "the storage daemon at {admin} has no such volume"
        ))),
        Err(e) => Err(bad(format!("the admin API at {admin} did not answer: {e}"))),
    }
}

#[cfg(test)]
mod known_tests {
    use super::known_address;

    #[test]
    fn loopback_and_declared_addresses_are_known() {
        let declared = vec!["st-b.example:10809".to_string()];
        for a in [
            "127.0.0.1:10809",
            "localhost:1",
            "[::1]:10809",
            "unix:/run/x.sock",
            "st-b.example:10809",
        ] {
            assert!(known_address(a, &declared), "{a}");
        }
        for a in [
            "192.0.2.1:10809",
            "st-b.example:10810",
            "evil.example:10809",
            "[2001:db8::1]:1",
        ] {
            assert!(!known_address(a, &declared), "{a}");
        }
    }
}
