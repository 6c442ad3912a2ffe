//! One guest on this host: its spec and files, and the QEMU process that
//! runs it (started detached, so it outlives the host daemon, and found
//! again through its pid file and QMP socket when the daemon restarts).

use crate::qemu::{command_line, qemu_binary, GuestPaths};
use crate::{QemuFault, VmError};
use ferry_api::{MigrationId, VmSpec, VmState};
use ferry_qmp::QmpClient;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A QEMU process of ours.
pub struct Runtime {
    pub pid: u32,
    pub accel: String,
    pub qmp: Arc<QmpClient>,
}

/// What survives a daemon restart besides the spec.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RuntimeFile {
    pid: u32,
    accel: String,
    incoming: bool,
}

pub struct Guest {
    pub spec: parking_lot::Mutex<VmSpec>,
    pub paths: GuestPaths,
    pub runtime: parking_lot::Mutex<Option<Arc<Runtime>>>,
    /// Set while QEMU waits for an incoming move.
    pub incoming: parking_lot::Mutex<Option<MigrationId>>,
    /// The order that move's requests must keep (set when it is prepared
    /// here; absent for one found again after a restart).
    pub arrival: parking_lot::Mutex<Option<crate::peer::ArrivalOrder>>,
    /// A move out of here that has not ended.
    pub moving: parking_lot::Mutex<Option<MigrationId>>,
    /// Moved away: the local QEMU is finished.
    pub moved: std::sync::atomic::AtomicBool,
    /// Serialises start, stop, delete and moves.
    pub op: tokio::sync::Mutex<()>,
    /// What the host last measured of its memory, since QEMU started here.
    pub memory: parking_lot::Mutex<crate::dirty_rate::MemoryFigures>,
}

pub fn pid_alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(p, 0) };
    if r != 0 {
        return false;
    }
    // A zombie (exited, not yet reaped) is not alive.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|st| st != "Z"))
                .unwrap_or(true)
        })
        .unwrap_or(false)
}

/// Bytes of a guest's RAM its QEMU process (`pid`) holds resident: the
/// pages the guest has touched, which is what a pre-copy of its memory
/// sends in full (untouched pages go as zero-page markers). None when
/// `/proc` does not say.
pub fn memory_resident_bytes(pid: u32, memory_bytes: u64) -> Option<u64> {
    guest_ram(pid, memory_bytes).map(|r| r.resident)
}

/// Where a guest's RAM lies in its QEMU process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuestRam {
    /// The mapping's first and past-the-end addresses.
    pub start: u64,
    pub end: u64,
    /// Bytes of it resident.
    pub resident: u64,
}

/// The guest's RAM in QEMU `pid`: the mapping of `memory_bytes` to
/// `memory_bytes` + 16 MiB (QEMU aligns it and adds guard pages) with the
/// most resident pages.
pub fn guest_ram(pid: u32, memory_bytes: u64) -> Option<GuestRam> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    guest_ram_in(&smaps, memory_bytes)
}

/// [`guest_ram`] over the text of an smaps file.
fn guest_ram_in(smaps: &str, memory_bytes: u64) -> Option<GuestRam> {
    let mut best: Option<GuestRam> = None;
    let mut candidate: Option<(u64, u64)> = None;
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let Some(first) = f.next() else { continue };
        if let Some((lo, hi)) = first.split_once('-') {
            if let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) {
                let size = hi.saturating_sub(lo);
                candidate =
                    (size >= memory_bytes && size <= memory_bytes + (16 << 20)).then_some((lo, hi));
                continue;
            }
        }
        if let (Some((start, end)), "Rss:") = (candidate, first) {
            let kib: u64 = f.next().and_then(|v| v.parse().ok())?;
            let resident = kib << 10;
            if best.is_none_or(|b| resident > b.resident) {
                best = Some(GuestRam {
                    start,
                    end,
                    resident,
                });
            }
        }
    }
    best
}

/// User + system CPU seconds of a process.
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let Some((_, rest)) = s.rsplit_once(')') else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of stat; `rest` starts at field 3.
    let ticks: u64 = [11usize, 12]
        .iter()
        .filter_map(|i| f.get(*i).and_then(|v| v.parse::<u64>().ok()))
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    #[allow(clippy::cast_precision_loss)]
    let r = ticks as f64 / (hz.max(1) as f64);
    r
}

impl Guest {
    pub fn new(
        spec: VmSpec,
        dir: &Path,
        confined: Option<(std::path::PathBuf, crate::confine::QemuUser)>,
    ) -> Guest {
        Guest {
            spec: parking_lot::Mutex::new(spec),
            paths: GuestPaths::new(dir, confined),
            runtime: parking_lot::Mutex::new(None),
            incoming: parking_lot::Mutex::new(None),
            arrival: parking_lot::Mutex::new(None),
            moving: parking_lot::Mutex::new(None),
            moved: std::sync::atomic::AtomicBool::new(false),
            op: tokio::sync::Mutex::new(()),
            memory: parking_lot::Mutex::default(),
        }
    }

    pub fn name(&self) -> String {
        self.spec.lock().name.clone()
    }

    pub fn runtime(&self) -> Option<Arc<Runtime>> {
        self.runtime.lock().clone()
    }

    /// Write the spec (atomically: temporary file, then rename).
    pub fn save_spec(&self) -> Result<(), VmError> {
        let spec = self.spec.lock().clone();
        write_json(&self.paths.dir.join("spec.json"), files::SPEC, &spec)
    }

    /// Start QEMU (detached), then connect to its QMP socket.
    pub async fn start_qemu(
        &self,
        accel: &str,
        nbd: &Path,
        start: crate::qemu::Start,
        nets: &crate::network::Networks,
    ) -> Result<(), VmError> {
        let incoming = start != crate::qemu::Start::Boot;
        let spec = self.spec.lock().clone();
        let _ = std::fs::remove_file(&self.paths.qmp);
        let _ = std::fs::remove_file(&self.paths.pidfile);
        if let Some(u) = &self.paths.qemu_user {
            // The confined QEMU creates its incoming socket here.
            crate::confine::give_dir(&self.paths.sockets, u)
                .map_err(|e| VmError::file(&self.paths.sockets, e))?;
        }
        self.write_seed(&spec)?;
        self.plug_nics(&spec, nets).await?;
        let args = command_line(&spec, accel, &self.paths, nbd, start);
        tracing::info!(guest = %spec.name, accel, incoming, "starting QEMU");
        let (pid, qmp) = match self.spawn_detached(&args).await {
            Ok(x) => x,
            Err(e) => {
                unplug_nics(&self.paths.dir, spec.nics.len()).await;
                return Err(e);
            }
        };
        write_json(
            &self.paths.dir.join("runtime.json"),
            files::RUNTIME,
            &RuntimeFile {
                pid,
                accel: accel.into(),
                incoming,
            },
        )?;
        *self.runtime.lock() = Some(Arc::new(Runtime {
            pid,
            accel: accel.into(),
            qmp: Arc::new(qmp),
        }));
        Ok(())
    }

    /// The cloud-init seed disk QEMU is about to open, written afresh
    /// from the spec (the same bytes on every host, so an incoming guest's
    /// disk is the one it left).
    fn write_seed(&self, spec: &VmSpec) -> Result<(), VmError> {
        let Some(ci) = &spec.cloud_init else {
            return Ok(());
        };
        let macs: Vec<String> = spec.nics.iter().map(|n| n.mac.clone()).collect();
        let bytes = crate::seed::image(&spec.name, ci, &macs)
            .map_err(|e| VmError::BadSpec(e.to_string()))?;
        let tmp = self.paths.seed.with_extension("img.tmp");
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &self.paths.seed))
            .map_err(|e| VmError::file(&self.paths.seed, e))
    }

    /// A tap per card, plugged into its network's bridge (owned by the
    /// user a confined QEMU runs as, who opens it).
    async fn plug_nics(
        &self,
        spec: &VmSpec,
        nets: &crate::network::Networks,
    ) -> Result<(), VmError> {
        let mut plan = Vec::new();
        for (i, n) in spec.nics.iter().enumerate() {
            let net = nets
                .get(&n.network)
                .map_err(|e| VmError::BadSpec(e.to_string()))?;
            plan.push((
                crate::network::tap_name(&self.paths.dir, i),
                net.bridge.clone(),
                n.mac.clone(),
            ));
        }
        if plan.is_empty() {
            return Ok(());
        }
        let user = self.paths.qemu_user.as_ref().map(|u| u.name.clone());
        let s = spec.clone();
        tokio::task::spawn_blocking(move || {
            for (k, (tap, bridge, mac)) in plan.iter().enumerate() {
                if let Err(e) = crate::network::plug(tap, bridge, mac, user.as_deref()) {
                    for (t, _, _) in &plan[..k] {
                        crate::network::unplug(t);
                    }
                    return Err(VmError::Config(format!(
                        "network card {k} of {}: {e}",
                        s.name
                    )));
                }
            }
            Ok(())
        })
        .await?
    }

    /// Run QEMU detached from this daemon (its own session, its output to
    /// `qemu.log` beside the guest; a dropped child is reaped by tokio),
    /// so that it outlives the daemon, as `-daemonize` would make it but
    /// without QEMU forking itself after its system-call filter is on
    /// (which lets the filter deny `spawn`). Ready when its monitor
    /// answers; an exit before that is an error with QEMU's own words.
    async fn spawn_detached(&self, args: &[String]) -> Result<(u32, QmpClient), VmError> {
        let log_path = self.paths.dir.join("qemu.log");
        let log = std::fs::File::create(&log_path).map_err(|e| VmError::file(&log_path, e))?;
        let err_log = log.try_clone().map_err(|e| VmError::file(&log_path, e))?;
        let mut cmd = tokio::process::Command::new(qemu_binary());
        cmd.args(args)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(err_log);
        // SAFETY: between fork and exec only setsid runs, which is
        // async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| QemuFault::Spawn {
            binary: qemu_binary(),
            source,
        })?;
        let pid = child
            .id()
            .ok_or_else(|| QemuFault::Start("it exited at once".into()))?;
        let said = |log: &Path| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        let t = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(QemuFault::Start(format!("{status}: {}", said(&log_path))).into());
            }
            if let Ok(c) = QmpClient::connect(&self.paths.qmp).await {
                return Ok((pid, c));
            }
            if t.elapsed() > Duration::from_secs(30) {
                let _ = child.start_kill();
                return Err(QemuFault::Start(format!(
                    "its monitor did not answer within 30 s: {}",
                    said(&log_path)
                ))
                .into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The last words QEMU wrote to its log (`qemu.log`), at most three
    /// lines: why a QEMU that ended did, for an error or a log line.
    pub fn qemu_last_words(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.paths.dir.join("qemu.log")).ok()?;
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = lines[lines.len().saturating_sub(3)..].join(" / ");
        let tail: String = tail.chars().take(400).collect();
        (!tail.is_empty()).then_some(tail)
    }

    /// Find the QEMU a previous daemon started, if it still runs.
    /// Whether the QEMU an earlier daemon recorded (`runtime.json`) still
    /// runs, before anything is asked of it.
    pub fn recorded_qemu_alive(&self) -> bool {
        read_json::<RuntimeFile>(&self.paths.dir.join("runtime.json"), files::RUNTIME)
            .ok()
            .flatten()
            .is_some_and(|rf| pid_alive(rf.pid))
    }

    pub async fn adopt(&self) -> Result<bool, VmError> {
        let Some(rf) =
            read_json::<RuntimeFile>(&self.paths.dir.join("runtime.json"), files::RUNTIME)?
        else {
            return Ok(false);
        };
        if !pid_alive(rf.pid) {
            return Ok(false);
        }
        let qmp = connect_qmp(&self.paths.qmp).await?;
        tracing::info!(guest = %self.name(), pid = rf.pid, "found running QEMU again");
        *self.runtime.lock() = Some(Arc::new(Runtime {
            pid: rf.pid,
            accel: rf.accel,
            qmp: Arc::new(qmp),
        }));
        Ok(true)
    }

    /// QEMU's run state, or None without a process.
    pub async fn qemu_status(&self) -> Option<String> {
        let rt = self.runtime()?;
        if !pid_alive(rt.pid) {
            return None;
        }
        rt.qmp.query_status().await.ok().map(|s| s.status)
    }

    /// The state the API shows.
    pub async fn state(&self) -> (VmState, Option<String>) {
        if self.moved.load(std::sync::atomic::Ordering::SeqCst) {
            return (VmState::Moved, None);
        }
        let Some(rt) = self.runtime() else {
            return (VmState::Stopped, None);
        };
        if !pid_alive(rt.pid) {
            return (VmState::Crashed, None);
        }
        let st = self.qemu_status().await;
        let s = match st.as_deref() {
            Some("running") => VmState::Running,
            Some("inmigrate") => VmState::Incoming,
            _ if self.incoming.lock().is_some() => VmState::Incoming,
            Some(_) => VmState::Paused,
            None => VmState::Crashed,
        };
        (s, st)
    }

    /// Stop QEMU: `quit`, then SIGKILL if it lingers.
    /// Press the guest's power button and wait up to `timeout` for QEMU to
    /// end; then end it as [`Self::stop_qemu`] does. Says which it was.
    pub async fn power_off(&self, timeout: Duration) -> &'static str {
        let pid = self.runtime.lock().as_ref().map(|r| (r.pid, r.qmp.clone()));
        let Some((pid, qmp)) = pid else {
            return "not running";
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), qmp.system_powerdown()).await;
        let t = Instant::now();
        while pid_alive(pid) && t.elapsed() < timeout {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let powered_off = !pid_alive(pid);
        self.stop_qemu().await;
        if powered_off {
            "powered off"
        } else {
            "quit (it did not power off in time)"
        }
    }

    pub async fn stop_qemu(&self) {
        *self.memory.lock() = Default::default();
        let rt = self.runtime.lock().take();
        if let Some(rt) = rt {
            let _ = tokio::time::timeout(Duration::from_secs(5), rt.qmp.quit()).await;
            let t = Instant::now();
            while pid_alive(rt.pid) && t.elapsed() < Duration::from_secs(10) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if pid_alive(rt.pid) {
                if let Ok(p) = libc::pid_t::try_from(rt.pid) {
                    // SAFETY: sending a signal to a process we started.
                    unsafe { libc::kill(p, libc::SIGKILL) };
                }
            }
            let _ = std::fs::remove_file(self.paths.dir.join("runtime.json"));
        }
        // Its taps go with it (so do those of a QEMU that died while no
        // daemon watched it).
        let cards = self.spec.lock().nics.len();
        unplug_nics(&self.paths.dir, cards).await;
    }
}

/// Remove the taps of the `cards` cards of the guest in `dir` (QEMU is
/// gone).
pub async fn unplug_nics(dir: &Path, cards: usize) {
    let taps: Vec<String> = (0..cards)
        .map(|i| crate::network::tap_name(dir, i))
        .collect();
    if taps.is_empty() {
        return;
    }
    let _ = tokio::task::spawn_blocking(move || {
        for t in &taps {
            crate::network::unplug(t);
        }
    })
    .await;
}

async fn connect_qmp(path: &Path) -> Result<QmpClient, VmError> {
    let t = Instant::now();
    loop {
        match QmpClient::connect(path).await {
            Ok(c) => return Ok(c),
            Err(e) if t.elapsed() > Duration::from_secs(10) => return Err(e.into()),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// The files a host keeps of its guests and moves (`ferry-state-file`:
/// named and versioned, written durably, read with a size limit).
pub mod files {
    use ferry_state_file::Kind;

    /// `<state>/vms/NAME/spec.json`: the guest's definition.
    pub const SPEC: Kind = Kind {
        format: "ferry-vm-spec",
        version: 1,
        max_bytes: 1 << 20,
    };
    /// `<state>/vms/NAME/runtime.json`: the QEMU running it.
    pub const RUNTIME: Kind = Kind {
        format: "ferry-vm-runtime",
        version: 1,
        max_bytes: 64 << 10,
    };
    /// `<state>/vms/NAME/incoming.json`: the move it is arriving by.
    pub const INCOMING: Kind = Kind {
        format: "ferry-vm-incoming",
        version: 1,
        max_bytes: 64 << 10,
    };
    /// `<state>/vms/NAME/arrived.json`: the move it arrived by, so that a
    /// source that lost the answer and asks again hears it runs here.
    pub const ARRIVED: Kind = Kind {
        format: "ferry-vm-arrived",
        version: 1,
        max_bytes: 64 << 10,
    };
    /// `<state>/moves/ID.json`: a move this host started.
    pub const MOVE: Kind = Kind {
        format: "ferry-vm-move",
        version: 1,
        max_bytes: 8 << 20,
    };
    /// `<state>/memory-stream-rate.json`: how fast this host's recent
    /// outgoing memory moves streamed where the machine, not the link,
    /// bound them (`crate::moves::MIN_MEASURED_STREAM`).
    pub const STREAM_RATE: Kind = Kind {
        format: "ferry-memory-stream-rate",
        version: 1,
        max_bytes: 1 << 14,
    };
    pub const STREAM_RATE_FILE: &str = "memory-stream-rate.json";
    /// `<state>/memory-move-setup.json`: the fixed time of this host's
    /// recent outgoing memory moves (`crate::moves::setup_measure`).
    pub const SETUP_COST: Kind = Kind {
        format: "ferry-memory-move-setup",
        version: 1,
        max_bytes: 1 << 14,
    };
    pub const SETUP_COST_FILE: &str = "memory-move-setup.json";
    /// `<state>/vm-move-pauses.json` and `<state>/teleport-pauses.json`:
    /// the pauses of this host's recent outgoing VM-only moves and
    /// teleports, each with its link's round trip and the guest's memory
    /// (`crate::moves::measure_pause`).
    pub const PAUSES: Kind = Kind {
        format: "ferry-memory-move-pauses",
        version: 1,
        max_bytes: 1 << 14,
    };
    pub const VM_MOVE_PAUSES_FILE: &str = "vm-move-pauses.json";
    pub const TELEPORT_PAUSES_FILE: &str = "teleport-pauses.json";
    /// `<state>/disk-move-host.json`: the host's own part of its recent
    /// completed disk-only moves (`crate::moves::measure_disk_move_host`).
    pub const DISK_MOVE_HOST: Kind = Kind {
        format: "ferry-disk-move-host",
        version: 1,
        max_bytes: 1 << 14,
    };
    pub const DISK_MOVE_HOST_FILE: &str = "disk-move-host.json";
    /// `<state>/memory-stream-efficiency.json`: how busy this host's
    /// recent outgoing memory streams kept a link that held them back
    /// (`crate::moves::efficiency_measure`).
    pub const STREAM_EFFICIENCY: Kind = Kind {
        format: "ferry-memory-stream-efficiency",
        version: 1,
        max_bytes: 1 << 14,
    };
    pub const STREAM_EFFICIENCY_FILE: &str = "memory-stream-efficiency.json";
    /// `<state>/memory-link-rates.json`: the links' rates this host's
    /// memory streams found, by peer (`crate::tunnel::LinkRates`).
    pub const LINK_RATES: Kind = Kind {
        format: "ferry-memory-link-rates",
        version: 1,
        max_bytes: 1 << 20,
    };
    pub const LINK_RATES_FILE: &str = "memory-link-rates.json";
    /// Move records kept: the newest this many, none older than this.
    pub const MOVES_KEPT: usize = 1000;
    pub const MOVES_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(90 * 86_400);
}

/// Save `v` durably as a file of `kind`.
pub fn write_json<T: Serialize>(
    path: &Path,
    kind: ferry_state_file::Kind,
    v: &T,
) -> Result<(), VmError> {
    Ok(ferry_state_file::save(path, kind, v)?)
}

/// Read a file of `kind`; `None` when there is none.
pub fn read_json<T: serde::de::DeserializeOwned>(
    path: &Path,
    kind: ferry_state_file::Kind,
) -> Result<Option<T>, VmError> {
    Ok(ferry_state_file::load(path, kind)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guest_ram_is_the_mapping_of_its_size_with_most_resident() {
        let smaps = "\
55d0c0000000-55d0c0100000 r-xp 00000000 08:01 1234 /usr/bin/qemu-system-x86_64
Size:               1024 kB
Rss:                 900 kB
7f0000000000-7f0010200000 rw-p 00000000 00:00 0
Size:             264192 kB
Rss:               40960 kB
7f1000000000-7f1010000000 rw-p 00000000 00:00 0
Size:             262144 kB
Rss:                1024 kB
7f2000000000-7f2040000000 rw-p 00000000 00:00 0
Size:            1048576 kB
Rss:              500000 kB
";
        // 256 MiB guest: the 258 MiB mapping (41 MiB resident) wins over the
        // 256 MiB one with less; the 1 GiB TCG buffer is not its size.
        let ram = guest_ram_in(smaps, 256 << 20).unwrap();
        assert_eq!(ram.resident, 40960 << 10);
        assert_eq!(ram.end - ram.start, (256 << 20) + (2 << 20));
        assert_eq!(guest_ram_in(smaps, 512 << 20), None);
        assert_eq!(guest_ram_in("", 256 << 20), None);
    }
}
