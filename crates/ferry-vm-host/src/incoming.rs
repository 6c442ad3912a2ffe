//! The destination of a move: the host's TLS move listener and what it
//! does for each request of [`PeerRequest`]. A guest being received is
//! a QEMU waiting with `-incoming defer`, its disks attached (pending when
//! the disk is still on its way); it becomes an ordinary guest of this host
//! once QEMU reports it running (`Finish`), and is removed without a trace
//! on `Abort` or when the source disappears.

use crate::guest::Guest;
use crate::peer::{
    check_version, encode_line, ArrivalOrder, IncomingDisk, PeerAnswer, PeerRequest, SwitchedDisk,
};
use crate::qemu::{host_memory_mib, qemu_available, resolve_accel, validate};
use crate::tunnel::{pipe, read_message, send_flushed, PipeCounters, ServerLink, EXCHANGE_TIMEOUT};
use crate::{PeerFault, QemuFault, VmError, VmHost};
use ferry_api::{MigrationId, VmSpec};
use ferry_client::ExportDetails;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;
use tokio_util::sync::CancellationToken;

/// In a guest's directory while it is being received.
pub const INCOMING_MARK: &str = "incoming.json";
/// The file in a guest's directory naming the move it arrived by.
pub const ARRIVED_MARK: &str = "arrived.json";

/// Accept peer hosts until `shutdown`.
pub async fn serve(
    host: Arc<VmHost>,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) {
    let cfg = match host.certs.server_config() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "move listener: no TLS configuration; not serving");
            return;
        }
    };
    let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
    // Caps overall and per peer address; the TLS handshake has
    // EXCHANGE_TIMEOUT. Moves under way go on after a shutdown (Duration
    // ZERO: not waited for), as guests do.
    ferry_trust::listen::accept_loop(
        listener,
        MOVE_LIMITS,
        Arc::new(()),
        shutdown,
        Some(Duration::ZERO),
        move |tcp, peer| {
            tcp.set_nodelay(true).ok();
            let (h, acc) = (host.clone(), acceptor.clone());
            async move {
                let link = match tokio::time::timeout(EXCHANGE_TIMEOUT, acc.accept(tcp)).await {
                    Ok(Ok(l)) => l,
                    Ok(Err(e)) => {
                        tracing::warn!(%peer, error = %e, "move link refused (TLS)");
                        return;
                    }
                    Err(_) => return,
                };
                if let Err(e) = handle(h, link).await {
                    if matches!(
                        e,
                        VmError::Peer {
                            fault: PeerFault::ClosedIdle,
                            ..
                        }
                    ) {
                        // A spare link the source opened ahead and let go.
                        tracing::debug!(%peer, "move link closed unused");
                        return;
                    }
                    tracing::warn!(%peer, error = %e, "move request failed");
                }
            }
        },
        |_tcp, _peer, _why| async {},
    )
    .await;
}

/// Connections the move listener holds at once, overall and per peer
/// address (a move uses a control link, a memory stream and spares).
pub const MOVE_LIMITS: ferry_trust::listen::ConnLimits = ferry_trust::listen::ConnLimits {
    max: 128,
    per_peer: 32,
};

async fn answer(link: &mut ServerLink, a: &PeerAnswer) -> Result<(), VmError> {
    send_flushed(link, &encode_line(a))
        .await
        .map_err(|e| VmError::peer(source_of(link), PeerFault::link("write")(e)))
}

/// The source host's address, as the link's socket sees it.
fn source_of(link: &ServerLink) -> String {
    link.get_ref()
        .0
        .peer_addr()
        .map_or_else(|_| "(source)".into(), |a| a.to_string())
}

fn reply(r: Result<PeerAnswer, VmError>) -> PeerAnswer {
    r.unwrap_or_else(|e| PeerAnswer::err(e.to_string()))
}

async fn handle(host: Arc<VmHost>, mut link: ServerLink) -> Result<(), VmError> {
    let (req, rest) =
        tokio::time::timeout(EXCHANGE_TIMEOUT, read_message::<PeerRequest, _>(&mut link))
            .await
            .map_err(|_| VmError::peer(source_of(&link), PeerFault::Timeout("a request")))?
            .map_err(|f| VmError::peer(source_of(&link), f))?;
    if let Err(e) = in_order(&host, &req) {
        tracing::warn!(error = %e, "refused a request out of its version or its move's order");
        return answer(&mut link, &PeerAnswer::err(e)).await;
    }
    match req {
        PeerRequest::Prepare {
            id,
            spec,
            disks,
            postcopy,
            multifd,
            ..
        } => {
            let a = reply(prepare(&host, &id, spec, &disks, postcopy, multifd).await);
            answer(&mut link, &a).await
        }
        PeerRequest::Check {
            mut spec, disks, ..
        } => {
            let a = reply(admissible(&host, &mut spec, &disks).map(|()| PeerAnswer::ok()));
            answer(&mut link, &a).await
        }
        PeerRequest::Stream { id, compress } => stream(&host, &id, compress, link, rest).await,
        PeerRequest::Finish { id, disks } => {
            let mut a = reply(finish(&host, &id, &disks).await);
            a.control = host.control.lock().clone();
            answer(&mut link, &a).await
        }
        PeerRequest::Abort { id } => {
            abort(&host, &id).await;
            answer(&mut link, &PeerAnswer::ok()).await
        }
        PeerRequest::Ping => answer(&mut link, &PeerAnswer::ok()).await,
        PeerRequest::Sink => {
            let a = match tokio::time::timeout(SINK_TIMEOUT, sink(&mut link, rest)).await {
                Ok(Ok(n)) => PeerAnswer {
                    received: Some(n),
                    ..PeerAnswer::ok()
                },
                Ok(Err(e)) => PeerAnswer::err(e.to_string()),
                Err(_) => PeerAnswer::err("bandwidth probe took too long"),
            };
            answer(&mut link, &a).await
        }
    }
}

/// Refuse a move's first requests (`Check`, `Prepare`) of another protocol
/// version, and hold every request to the order of the move it names, if
/// that move is arriving here (a move this daemon does not know, after a
/// restart for instance, is answered by the handlers as before).
fn in_order(host: &VmHost, req: &PeerRequest) -> Result<(), String> {
    if let PeerRequest::Check { version, .. } | PeerRequest::Prepare { version, .. } = req {
        check_version(*version)?;
    }
    let id = match req {
        PeerRequest::Stream { id, .. }
        | PeerRequest::Finish { id, .. }
        | PeerRequest::Abort { id }
        | PeerRequest::Prepare { id, .. } => id,
        PeerRequest::Check { .. } | PeerRequest::Ping | PeerRequest::Sink => return Ok(()),
    };
    let Ok(g) = receiving(host, id) else {
        return Ok(());
    };
    let mut order = g.arrival.lock();
    match order.as_mut() {
        Some(o) => o.accept(req).map_err(|e| e.to_string()),
        None => Ok(()),
    }
}

/// The longest a bandwidth probe may keep a connection.
const SINK_TIMEOUT: Duration = Duration::from_secs(60);

/// Read a bandwidth probe's frames up to the empty one; the bytes in them.
async fn sink(link: &mut ServerLink, rest: Vec<u8>) -> Result<u64, VmError> {
    use crate::peer::{SINK_FRAME_MAX, SINK_MAX};
    let who = source_of(link);
    let mut input = std::io::Cursor::new(rest).chain(link);
    let mut total = 0u64;
    let mut buf = vec![0u8; SINK_FRAME_MAX as usize];
    let bad = |e| VmError::peer(who.clone(), PeerFault::link("bandwidth probe")(e));
    loop {
        let mut len = [0u8; 4];
        input.read_exact(&mut len).await.map_err(bad)?;
        let n = u32::from_be_bytes(len);
        if n == 0 {
            return Ok(total);
        }
        if n > SINK_FRAME_MAX || total + u64::from(n) > SINK_MAX {
            return Err(VmError::peer(
                who,
                PeerFault::Protocol(format!(
                    "bandwidth probe frame of {n} bytes after {total}: over the limit"
                )),
            ));
        }
        input
            .read_exact(&mut buf[..n as usize])
            .await
            .map_err(bad)?;
        total += u64::from(n);
    }
}

/// The guest waiting for move `id`.
fn receiving(host: &VmHost, id: &MigrationId) -> Result<Arc<Guest>, VmError> {
    host.guests
        .read()
        .values()
        .find(|g| g.incoming.lock().as_ref() == Some(id))
        .cloned()
        .ok_or_else(|| VmError::NoMove(id.to_string()))
}

/// Whether this host can take the guest `spec` with `disks`, checked
/// without changing anything: its spec, boot files, disks (servers this
/// host knows, volumes no other guest here uses), QEMU, the accelerator,
/// its name, and room for its memory. `spec`'s disks are pointed at the
/// servers the guest will use here.
fn admissible(host: &VmHost, spec: &mut VmSpec, disks: &[IncomingDisk]) -> Result<(), VmError> {
    for d in disks {
        if let Some(s) = spec.disks.iter_mut().find(|s| s.volume == d.volume) {
            s.server.clone_from(&d.server);
        }
    }
    // Its cards' networks must be here, their MACs free, before anything
    // of the move starts.
    if spec.nics.iter().any(|n| n.mac.is_empty()) {
        return Err(VmError::BadSpec(
            "an arriving guest's cards must carry their MACs".into(),
        ));
    }
    host.check_nics(spec)?;
    validate(spec, host_memory_mib()).map_err(VmError::BadSpec)?;
    crate::qemu::boot_files_allowed(spec, &host.image_dirs).map_err(VmError::BadSpec)?;
    // Disks this host connects to now (a VM-only move's disk_servers) must
    // be storage it knows. A teleport's disks are pending: they connect
    // only to where their migration switched them, a storage daemon the
    // source's storage authenticated by its pinned certificate.
    let pending: Vec<&str> = disks
        .iter()
        .filter(|d| d.pending)
        .map(|d| d.volume.as_str())
        .collect();
    host.check_disk_servers(&VmSpec {
        disks: spec
            .disks
            .iter()
            .filter(|d| !pending.contains(&d.volume.as_str()))
            .cloned()
            .collect(),
        ..spec.clone()
    })?;
    if let Some((volume, other)) = host.disk_in_use(spec) {
        return Err(VmError::BadSpec(format!(
            "volume {volume} is a disk of guest {other} here: a volume serves one guest"
        )));
    }
    if !qemu_available() {
        return Err(VmError::BadSpec(
            "QEMU is not installed on the destination host".into(),
        ));
    }
    resolve_accel(spec.accel).map_err(VmError::BadSpec)?;
    let dir = host.root.join("vms").join(&spec.name);
    if host.guests.read().contains_key(&spec.name) || dir.exists() {
        return Err(VmError::Exists(spec.name.clone()));
    }
    let available = crate::qemu::host_available_mib();
    if available > 0 && spec.memory_mib > available {
        return Err(VmError::BadSpec(format!(
            "no room for the guest's memory here: it needs {} MiB, this host has {available} MiB available",
            spec.memory_mib
        )));
    }
    Ok(())
}

async fn prepare(
    host: &Arc<VmHost>,
    id: &MigrationId,
    mut spec: VmSpec,
    disks: &[IncomingDisk],
    postcopy: bool,
    multifd: u8,
) -> Result<PeerAnswer, VmError> {
    if receiving(host, id).is_ok() {
        return Ok(PeerAnswer::ok());
    }
    admissible(host, &mut spec, disks)?;
    let accel = resolve_accel(spec.accel).map_err(VmError::BadSpec)?;
    let dir = host.root.join("vms").join(&spec.name);
    let g = {
        let mut guests = host.guests.write();
        if guests.contains_key(&spec.name) || dir.exists() {
            return Err(VmError::Exists(spec.name.clone()));
        }
        let mut confined = host.confined(&spec.name);
        if postcopy && confined.is_some() && !crate::confine::unprivileged_postcopy() {
            // Post-copy needs userfaultfd, which this system gives only
            // to privileged processes: this guest's QEMU keeps root (it
            // is still under its system-call filter).
            tracing::warn!(
                guest = %spec.name,
                "a move that allows post-copy arrives: its QEMU runs as root (set vm.unprivileged_userfaultfd = 1 to keep it confined)"
            );
            confined = None;
        }
        let g = Arc::new(Guest::new(spec.clone(), &dir, confined));
        *g.incoming.lock() = Some(id.clone());
        *g.arrival.lock() = Some(ArrivalOrder::new(disks));
        guests.insert(spec.name.clone(), g.clone());
        g
    };
    let op = g.op.lock().await;
    let r = async {
        std::fs::create_dir_all(&dir).map_err(|e| VmError::file(&dir, e))?;
        attach_incoming_disks(host, &spec, disks).await?;
        g.save_spec()?;
        // Marks the guest as not ours yet: a restarted daemon that finds
        // this without a live QEMU removes the guest.
        crate::guest::write_json(
            &g.paths.dir.join(INCOMING_MARK),
            crate::guest::files::INCOMING,
            id,
        )?;
        let start = if postcopy {
            crate::qemu::Start::IncomingPostcopy
        } else {
            crate::qemu::Start::Incoming
        };
        g.start_qemu(accel, &host.nbd_socket, start, &host.networks)
            .await?;
        let rt = g.runtime().ok_or(QemuFault::NotRunning)?;
        listen_for_guest(&rt.qmp, &g.paths.incoming, postcopy, multifd).await?;
        // From here on the forwarder's first answered request is the
        // guest's first after it resumed here.
        for d in disks {
            if let Some(u) = host.agent.get(&d.volume) {
                u.io.arm();
            }
        }
        Ok::<(), VmError>(())
    }
    .await;
    drop(op);
    if let Err(e) = r {
        tracing::warn!(guest = %spec.name, error = %e, "cannot receive the guest; cleaning up");
        remove_receiving(host, &g).await;
        return Err(e);
    }
    tracing::info!(guest = %spec.name, move_id = %id, "waiting for the incoming guest");
    Ok(PeerAnswer::ok())
}

/// Attach an arriving guest's disks to the forwarder: a teleport's pending
/// ones (they connect where their migration switches them), the others
/// where this host reaches them, checked to be the same volume by size.
async fn attach_incoming_disks(
    host: &VmHost,
    spec: &VmSpec,
    disks: &[IncomingDisk],
) -> Result<(), VmError> {
    for d in disks {
        if host.agent.get(&d.volume).is_some() {
            continue;
        }
        if d.pending {
            let details = ExportDetails {
                size: d.size,
                flags: d.flags,
                min_block: 0,
                preferred_block: 0,
                max_block: 0,
                contexts: Vec::new(),
                structured_replies: true,
            };
            host.agent
                .attach_pending(&d.server, &d.volume, details)
                .map_err(|e| VmError::Disk {
                    volume: d.volume.clone(),
                    detail: e.to_string(),
                })?;
        } else {
            host.attach_disks(&VmSpec {
                disks: spec
                    .disks
                    .iter()
                    .filter(|x| x.volume == d.volume)
                    .cloned()
                    .collect(),
                ..spec.clone()
            })
            .await?;
            // The same disk, wherever this host reaches it.
            let here = host.agent.get(&d.volume).map(|u| u.details().size);
            if here != Some(d.size) {
                return Err(VmError::Disk {
                    volume: d.volume.clone(),
                    detail: format!(
                        "the disk reached at {} is {} bytes, the guest's is {}: not the same volume",
                        d.server,
                        here.map_or("no".into(), |s| s.to_string()),
                        d.size
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Set the arriving QEMU's capabilities as the source's (post-copy,
/// multifd channels: the destination must expect them before it listens)
/// and have it listen for the stream on `socket`.
async fn listen_for_guest(
    qmp: &ferry_qmp::QmpClient,
    socket: &std::path::Path,
    postcopy: bool,
    multifd: u8,
) -> Result<(), VmError> {
    use ferry_qmp::{Capability, MigrateParameters};
    // Its MIGRATION events wake the wait for the guest's last bytes (the
    // guest is stopped then: a poll's interval would be its pause).
    qmp.migrate_set_capabilities(&[(Capability::Events, true)])
        .await?;
    if postcopy {
        qmp.migrate_set_capabilities(&[(Capability::PostcopyRam, true)])
            .await?;
    }
    if multifd > 0 {
        // The destination must expect the channels before it listens.
        qmp.migrate_set_capabilities(&[(Capability::Multifd, true)])
            .await?;
        qmp.migrate_set_parameters(&MigrateParameters {
            multifd_channels: Some(multifd),
            ..Default::default()
        })
        .await?;
    }
    let _ = std::fs::remove_file(socket);
    qmp.migrate_incoming(&format!("unix:{}", socket.display()))
        .await?;
    Ok(())
}

async fn stream(
    host: &Arc<VmHost>,
    id: &MigrationId,
    compress: bool,
    mut link: ServerLink,
    rest: Vec<u8>,
) -> Result<(), VmError> {
    let g = match receiving(host, id) {
        Ok(g) => g,
        Err(e) => return answer(&mut link, &PeerAnswer::err(e.to_string())).await,
    };
    let t = Instant::now();
    let unix = loop {
        match tokio::net::UnixStream::connect(&g.paths.incoming).await {
            Ok(s) => break s,
            Err(e) if t.elapsed() > Duration::from_secs(10) => {
                let msg = format!("QEMU does not listen for the stream: {e}");
                answer(&mut link, &PeerAnswer::err(msg.clone())).await?;
                return Err(QemuFault::Start(msg).into());
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    answer(&mut link, &PeerAnswer::ok()).await?;
    let counters = PipeCounters::default();
    let r = pipe(unix, link, compress, rest, None, &counters).await;
    let delivered = counters
        .delivered
        .load(std::sync::atomic::Ordering::Relaxed);
    let error = r.as_ref().err().map(ToString::to_string);
    tracing::info!(move_id = %id, delivered, error, "incoming memory stream ended");
    if let Some((came, taken)) = *counters.last_frame.lock() {
        let unix_s = crate::moves::unix_s;
        tracing::debug!(move_id = %id, came_unix_s = unix_s(came), taken_unix_s = unix_s(taken), "the stream's last frame");
    }
    Ok(r?)
}

/// Connect a teleport's disks where their migrations switched them (the
/// pending ones, and ones QEMU here already opened at the old place: they
/// reconnect, so the guest's first request does not go there), and point
/// the guest's spec at them (saved once the guest runs: until then a
/// restart finds the old place, whose daemon answers where it went).
async fn connect_switched(host: &VmHost, g: &Guest, disks: &[SwitchedDisk]) -> Result<(), VmError> {
    for d in disks {
        tracing::debug!(volume = %d.volume, server = %d.server, connected = host.agent.get(&d.volume).is_some_and(|u| u.connected()), "disk switched; connecting its forwarder");
        if let Some(up) = host.agent.get(&d.volume) {
            up.connect_now(&d.server).await.map_err(|e| VmError::Disk {
                volume: d.volume.clone(),
                detail: e.to_string(),
            })?;
        }
        if let Some(s) = g
            .spec
            .lock()
            .disks
            .iter_mut()
            .find(|s| s.volume == d.volume)
        {
            s.server.clone_from(&d.server);
            if let Some(a) = &d.admin {
                s.admin = Some(a.clone());
            }
        }
    }
    Ok(())
}

/// The longest the destination waits for its site's storage to commit a
/// pending disk once `Finish` has come (the source's own wait for a
/// disk's switch is as long).
const ARRIVAL_WAIT: Duration = Duration::from_secs(20);

/// `placed` (where `Finish` says disks switched) and, for each pending
/// disk it leaves out, where its migration committed it here, as this
/// site's storage daemon says once it has (all asked at once).
async fn with_arrived_disks(
    g: &Guest,
    placed: &[SwitchedDisk],
) -> Result<Vec<SwitchedDisk>, VmError> {
    let awaited = g
        .arrival
        .lock()
        .as_ref()
        .map(|o| o.awaited(placed))
        .unwrap_or_default();
    let asks: Vec<_> = awaited
        .into_iter()
        .map(|(volume, a)| {
            tokio::task::spawn_blocking(move || {
                let c = ferry_api::AdminClient::new(&a.admin).limited(ARRIVAL_WAIT * 2);
                let r = c.wait_arrival(&volume, &a.migration, ARRIVAL_WAIT);
                (volume, a, r)
            })
        })
        .collect();
    let mut out = placed.to_vec();
    for ask in asks {
        let (volume, a, r) = ask.await?;
        let said = |detail: String| VmError::Disk {
            volume: volume.clone(),
            detail,
        };
        let view = r.map_err(|e| said(format!("its storage daemon here ({}): {e}", a.admin)))?;
        let server = match (view.arrived, view.location) {
            (true, Some(l)) => l,
            (true, None) => {
                return Err(said(format!(
                    "switched to {}, which does not say where (restarted since, on an unspecified address?)",
                    a.admin
                )))
            }
            (false, _) => {
                return Err(said(format!(
                    "had not switched to {} within {} s",
                    a.admin,
                    ARRIVAL_WAIT.as_secs()
                )))
            }
        };
        tracing::debug!(volume = %volume, server = %server, "pending disk switched here");
        out.push(SwitchedDisk {
            volume,
            server,
            admin: Some(a.admin),
        });
    }
    Ok(out)
}

/// The guest that arrived here by move `id` (its source asks again after
/// losing the answer or restarting).
fn arrived(host: &VmHost, id: &MigrationId) -> Option<Arc<Guest>> {
    host.guests
        .read()
        .values()
        .find(|g| {
            crate::guest::read_json::<MigrationId>(
                &g.paths.dir.join(ARRIVED_MARK),
                crate::guest::files::ARRIVED,
            )
            .ok()
            .flatten()
            .as_ref()
                == Some(id)
        })
        .cloned()
}

/// The source has the guest's state sent and stopped (and a teleport's
/// disks switched to `disks`): connect the disks there, record durably
/// that the guest is this host's, run it (QEMU holds an arrived guest
/// paused, `-S`), and answer once it runs. Asked again for a guest that
/// already arrived, say how it runs, and that it arrived: a source resumes
/// its own copy only for a guest that never ran here.
async fn finish(
    host: &Arc<VmHost>,
    id: &MigrationId,
    disks: &[SwitchedDisk],
) -> Result<PeerAnswer, VmError> {
    let g = match receiving(host, id) {
        Ok(g) => g,
        Err(e) => {
            let Some(g) = arrived(host, id) else {
                return Err(e);
            };
            let st = g.qemu_status().await;
            tracing::info!(guest = %g.name(), move_id = %id, status = ?st, "the source asks again how the move ended");
            let mut a = if st.as_deref() == Some("running") {
                PeerAnswer::ok()
            } else {
                PeerAnswer::err(format!(
                    "the guest arrived here and does not run now (QEMU: {})",
                    st.as_deref().unwrap_or("gone")
                ))
            };
            a.status = st;
            a.arrived = true;
            return Ok(a);
        }
    };
    let asked = Instant::now();
    tracing::debug!(move_id = %id, "Finish came");
    let disks = with_arrived_disks(&g, disks).await?;
    tracing::debug!(
        learnt_ms = asked.elapsed().as_secs_f64() * 1e3,
        "every pending disk placed"
    );
    connect_switched(host, &g, &disks).await?;
    let t = Instant::now();
    let mut marked = false;
    // How long the guest's last bytes kept it from running once asked.
    let mut loaded_after = Duration::ZERO;
    loop {
        // Taken before the query: a MIGRATION event after it (the load's
        // completion) wakes the wait below at once.
        let mark = g.runtime().map(|rt| rt.qmp.mark());
        let st = g.qemu_status().await;
        match st.as_deref() {
            Some("running") if marked => break,
            // Arrived and held (`-S`), or already running (post-copy):
            // ours from here, durably, before it runs.
            Some("paused" | "running") => {
                loaded_after = asked.elapsed();
                crate::guest::write_json(
                    &g.paths.dir.join(ARRIVED_MARK),
                    crate::guest::files::ARRIVED,
                    id,
                )?;
                marked = true;
                let written = asked.elapsed();
                if st.as_deref() == Some("paused") {
                    if let Some(rt) = g.runtime() {
                        rt.qmp.cont().await?;
                    }
                }
                tracing::debug!(
                    loaded_ms = loaded_after.as_secs_f64() * 1e3,
                    marked_ms = written.as_secs_f64() * 1e3,
                    continued_ms = asked.elapsed().as_secs_f64() * 1e3,
                    "the arrived guest marked ours and continued (ms after Finish)"
                );
            }
            Some("inmigrate" | "postmigrate" | "finish-migrate" | "prelaunch")
                if t.elapsed() < Duration::from_secs(60) =>
            {
                match (g.runtime(), mark) {
                    (Some(rt), Some(m)) => {
                        let _ = rt
                            .qmp
                            .wait_named(m, "MIGRATION", Duration::from_millis(5))
                            .await;
                    }
                    _ => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
            other => {
                let said = g
                    .qemu_last_words()
                    .map(|w| format!("; it said: {w}"))
                    .unwrap_or_default();
                let mut a = PeerAnswer::err(format!(
                    "the guest does not run here (QEMU: {}{said})",
                    other.unwrap_or("gone")
                ));
                a.status = other.map(str::to_string);
                a.arrived = marked;
                return Ok(a);
            }
        }
    }
    *g.incoming.lock() = None;
    let _ = std::fs::remove_file(g.paths.dir.join(INCOMING_MARK));
    // The guest's first disk request here (it writes often; wait a little).
    let ups: Vec<_> = g
        .spec
        .lock()
        .disks
        .iter()
        .filter_map(|d| host.agent.get(&d.volume))
        .collect();
    let t = Instant::now();
    let mut first = None;
    while first.is_none() && t.elapsed() < Duration::from_secs(2) && !ups.is_empty() {
        first = ups.iter().filter_map(|u| u.io.first_after_arm()).min();
        if first.is_none() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // The guest runs here now: a spec that cannot be saved is logged, not
    // answered as a failure (the source would resume its own copy).
    if let Err(e) = g.save_spec() {
        tracing::warn!(guest = %g.name(), error = %e, "the arrived guest's spec could not be saved");
    }
    let resumed = match g.runtime() {
        Some(rt) => rt
            .qmp
            .wait_named(rt.qmp.origin(), "RESUME", Duration::from_secs(2))
            .await
            .ok()
            .map(|e| e.timestamp),
        None => None,
    };
    tracing::info!(
        guest = %g.name(),
        move_id = %id,
        loaded_after_finish_ms = loaded_after.as_secs_f64() * 1e3,
        "guest arrived and runs here"
    );
    Ok(PeerAnswer {
        status: Some("running".into()),
        first_io_unix_ms: first,
        resumed_unix_s: resumed,
        ..PeerAnswer::ok()
    })
}

pub(crate) async fn abort(host: &Arc<VmHost>, id: &MigrationId) {
    if let Ok(g) = receiving(host, id) {
        tracing::info!(guest = %g.name(), move_id = %id, "move aborted; removing the waiting guest");
        remove_receiving(host, &g).await;
    }
}

async fn remove_receiving(host: &Arc<VmHost>, g: &Arc<Guest>) {
    g.stop_qemu().await;
    if let Some(said) = g.qemu_last_words() {
        tracing::info!(guest = %g.name(), qemu = %said, "the waiting guest's QEMU, last words");
    }
    let spec = g.spec.lock().clone();
    host.guests.write().remove(&spec.name);
    host.detach_disks(&spec);
    let _ = std::fs::remove_dir_all(&g.paths.dir);
}

/// A waiting guest whose QEMU gave up (the source went away) is removed.
pub async fn reap_failed_incoming(host: &Arc<VmHost>) {
    let waiting: Vec<Arc<Guest>> = host
        .guests
        .read()
        .values()
        .filter(|g| g.incoming.lock().is_some())
        .cloned()
        .collect();
    for g in waiting {
        // Busy guests are being prepared or finished; look next time.
        let Ok(_op) = g.op.try_lock() else { continue };
        let dead = g.runtime().is_some_and(|r| !crate::guest::pid_alive(r.pid));
        if dead {
            drop(_op);
            tracing::info!(guest = %g.name(), "incoming QEMU ended without the guest; removing it");
            remove_receiving(host, &g).await;
        }
    }
}
