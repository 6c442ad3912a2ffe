//! Guests on a VM host (`ferry host --state-dir`): what a guest is
//! ([`VmSpec`]), what the host shows of it ([`VmView`], with the disk I/O
//! the guest issues as the host's forwarder sees it), and its moves
//! ([`VmMigrateRequest`], [`VmMoveStatus`], [`VmMoveReport`]).
//!
//! | method and path | body | answer |
//! |---|---|---|
//! | `GET /v1/vms` | | `[VmView]` |
//! | `POST /v1/vms` | `CreateVm` | 201 `VmView`; 400 bad spec; 409 name taken; 502 disk unreachable |
//! | `GET /v1/vms/{name}` | | `VmView`; 404 |
//! | `POST /v1/vms/{name}/start` / `stop` | | `VmView` |
//! | `DELETE /v1/vms/{name}` | | 204 (stops it first) |
//! | `POST /v1/vms/{name}/migrate` | `VmMigrateRequest` | 202 `VmMoveStatus` |
//! | `GET /v1/vm-moves[/{id}]` | | `[VmMoveStatus]` / `VmMoveStatus` |
//! | `POST /v1/vm-moves/{id}/cancel` | | `VmMoveStatus` |
//! | `POST /v1/probe` | `ProbeRequest` | `LinkProbe`: round trips to another host, and with `bandwidth_bytes` a capped transfer's rate |

use crate::migration::MigrationId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Measure the round trip to another host's move listener.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    /// The other host's move address (`host:port`).
    pub to: String,
    /// Round trips to time (1 to 10).
    #[serde(default = "default_probes")]
    pub count: u32,
    /// Also measure the bandwidth: send up to this many bytes (at most
    /// 64 MiB) for at most `bandwidth_secs`; 0 for none.
    #[serde(default)]
    pub bandwidth_bytes: u64,
    /// The time limit of the bandwidth probe (0.1 to 10 s).
    #[serde(default = "default_bandwidth_secs")]
    pub bandwidth_secs: f64,
}

fn default_probes() -> u32 {
    3
}

fn default_bandwidth_secs() -> f64 {
    1.0
}

/// Round trips from a host to another: each is one request and its answer
/// on an open, mutually authenticated link (TCP and TLS set up before the
/// clock starts), so it is the network's round trip plus a few
/// microseconds of work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkProbe {
    pub to: String,
    pub rtt_ms: Vec<f64>,
    /// The smallest of `rtt_ms` (queueing only ever adds).
    pub min_ms: Option<f64>,
    /// Why probes failed, one line each.
    #[serde(default)]
    pub errors: Vec<String>,
    /// Bytes the bandwidth probe got across, and in how long (from the
    /// first byte sent to the other host's answer that it read them all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<BandwidthProbe>,
}

/// One capped bulk transfer over the hosts' link: a lower bound of what
/// the link carries (a short transfer spends part of its time in TCP's
/// slow start), and what a move can expect at least.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BandwidthProbe {
    pub bytes: u64,
    /// From the first byte sent to the answer that all came.
    pub seconds: f64,
    /// `bytes` over `seconds` less the link's probed round trip (which a
    /// long transfer pays once, not per byte).
    pub bytes_per_sec: f64,
}

/// One disk of a guest: a ferry volume and where it lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmDisk {
    pub volume: String,
    /// NBD `HOST:PORT` of the storage daemon that holds it (moves are followed).
    pub server: String,
    /// Admin API of that daemon: needed to move the disk with the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<String>,
}

/// One network card of a guest: the network (as its host names it,
/// `ferry host --network`) and the card's MAC, which it keeps wherever it
/// runs (assigned at create when not given).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmNic {
    pub network: String,
    #[serde(default)]
    pub mac: String,
}

/// How the guest boots.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Boot {
    /// Direct kernel boot (files on the host).
    Kernel {
        kernel: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        initrd: Option<PathBuf>,
        #[serde(default)]
        cmdline: String,
    },
    /// Firmware boots the first disk.
    Disk,
}

/// Which accelerator runs the guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Accel {
    /// KVM when `/dev/kvm` works, TCG otherwise.
    #[default]
    Auto,
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Auto => "auto",
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// A guest, as created.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmSpec {
    pub name: String,
    pub memory_mib: u64,
    pub vcpus: u32,
    pub disks: Vec<VmDisk>,
    pub boot: Boot,
    #[serde(default)]
    pub accel: Accel,
    /// Network cards, in the order the guest sees them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<VmNic>,
    /// What the guest configures itself from at first boot (cloud-init).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud_init: Option<CloudInit>,
}

/// A guest's cloud-init configuration, served to it the way clouds serve
/// it without a metadata server: a small read-only disk labelled `CIDATA`
/// holding `meta-data`, `user-data` and `network-config` (cloud-init's
/// NoCloud data source). The host writes that disk from this whenever it
/// starts the guest's QEMU, byte for byte the same on every host, so it
/// needs no copying when the guest moves. The instance id is the guest's
/// name: cloud-init runs its first-boot steps once per guest, not once
/// per host it lands on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudInit {
    /// The guest's host name (`local-hostname`); its name when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// `user-data`: a `#cloud-config` document or a script (`#!`).
    pub user_data: String,
    /// `network-config` (version 1 or 2), verbatim. With neither this nor
    /// `addresses`: cloud-init's default (DHCP on the first card).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_config: Option<String>,
    /// Static addresses of the guest's cards, the first for its first
    /// card and so on: the host writes the `network-config` from them and
    /// the cards' MACs (known only once the host has assigned them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<NicAddress>,
}

/// One card's static address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NicAddress {
    /// `ADDR/PREFIX`, IPv4 or IPv6.
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
}

/// `POST /v1/vms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVm {
    pub spec: VmSpec,
    /// Start it at once (default true).
    #[serde(default = "yes")]
    pub start: bool,
}

/// `POST /v1/vms/NAME/set`: change a defined guest where it is safe. Every
/// field is optional; what is absent stays.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateVm {
    /// Volume -> the admin API (`HOST:PORT`) of the storage daemon that
    /// holds it, where its next move starts ("" forgets it). Allowed in any
    /// state but during a move; the daemon must hold the volume.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub disk_admin: std::collections::BTreeMap<String, String>,
    /// Only while the guest is stopped (QEMU reads it at start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// Only while the guest is stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
}

fn yes() -> bool {
    true
}

/// Where a guest is in its life on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// Defined, no QEMU process.
    Stopped,
    Running,
    /// QEMU runs, the guest's CPUs do not (stopped for a move, or by hand).
    Paused,
    /// Waiting for an incoming move.
    Incoming,
    /// Moved away; the source copy is finished.
    Moved,
    /// The QEMU process ended on its own.
    Crashed,
}

impl VmState {
    pub fn as_str(self) -> &'static str {
        match self {
            VmState::Stopped => "stopped",
            VmState::Running => "running",
            VmState::Paused => "paused",
            VmState::Incoming => "incoming",
            VmState::Moved => "moved",
            VmState::Crashed => "crashed",
        }
    }
}

/// A guest's disk I/O as the host's forwarder sees it (every request the
/// guest's QEMU issued, timed from its arrival to its answer).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DiskIo {
    pub volume: String,
    /// The storage daemon the forwarder sends to now.
    pub server: String,
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub other: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    /// Latency histogram: `(upper bound in µs, requests at or below)`,
    /// cumulative; the last bound is `u64::MAX`.
    pub latency_us: Vec<(u64, u64)>,
    pub latency_sum_us: u64,
    /// Unix time (ms) of the last answered request, 0 before the first.
    pub last_io_unix_ms: u64,
    /// Unix time (ms) of the first answered request, 0 before the first.
    pub first_io_unix_ms: u64,
    pub switches: u64,
}

/// `GET /v1/vms/{name}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmView {
    pub spec: VmSpec,
    pub state: VmState,
    /// The accelerator QEMU runs with ("kvm" or "tcg"), while it runs.
    pub accel: Option<String>,
    pub pid: Option<u32>,
    /// QEMU's own run state (`query-status`), while it runs.
    pub qemu_status: Option<String>,
    /// CPU time of the QEMU process (user + system), seconds.
    pub cpu_time_s: f64,
    /// Bytes of the guest's RAM resident in QEMU (pages it has touched:
    /// what a memory move sends in full), while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_resident_bytes: Option<u64>,
    /// How fast the guest dirties its memory, QEMU's latest estimate
    /// (`calc-dirty-rate`, page sampling), while it runs and once measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_dirty: Option<DirtyRateView>,
    /// Link bytes a memory move would send per resident byte (zero pages
    /// as markers, the rest as the tunnel compresses them), from a sample
    /// of the guest's resident pages; measured with `memory_dirty`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_link_share: Option<f64>,
    /// Raw bytes per second the host's recent outgoing memory moves
    /// streamed where this machine, not the link nor the far end, set
    /// their pace (QEMU's walk of the memory, compression and encryption
    /// on the cores the guests run on); absent until the host has made
    /// such a move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_stream_bps: Option<f64>,
    /// The fixed time of the host's recent outgoing memory moves besides
    /// their stream, pause and round trips (the destination QEMU's start,
    /// QEMU's set-up, the last load and answer), the median of its last
    /// few; absent until the host has made one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_move_setup_s: Option<f64>,
    /// How busy the host's recent outgoing memory moves kept a link that
    /// held them back: link bytes over the stream's span, over the
    /// largest delivery rate it saw (below one where QEMU had nothing to
    /// send for longer than the window in flight covers), the median of
    /// its last few; absent until the host has made such a move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_link_efficiency: Option<f64>,
    /// The pauses of the host's recent outgoing VM-only moves (single
    /// stream, completed), oldest first, each with its link's round trip
    /// and the guest's memory: the placement model takes its own terms
    /// for the link and the memory out of each and prices a VM-only
    /// move's pause from this host at the median of what is left.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vm_move_pauses: Vec<MovePause>,
    /// The same of its recent outgoing teleports (guest and disks: the
    /// disks' switches are in each pause).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub teleport_pauses: Vec<MovePause>,
    /// What the host's own part of its recent completed disk-only moves
    /// took (s, oldest first): each move's time less its slowest disk's
    /// migration as the storage daemon timed it (asking the daemons to
    /// start, following them to the switch, storing the guest's new
    /// disk places). The placement model prices a disk move from this
    /// host at their median.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_move_host_s: Vec<f64>,
    pub disks: Vec<DiskIo>,
    /// Its network cards on this host: where each is plugged, and what
    /// it carried while QEMU runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nics: Vec<NicView>,
    /// The guest's serial console, as a file on the host.
    pub serial_log: PathBuf,
    /// A move of this guest that has not ended.
    pub moving: Option<MigrationId>,
}

/// One completed move's guest pause (QEMU's STOP at the source to its
/// RESUME at the destination), the round trip of the link its memory
/// crossed (the smallest a frame of the stream took to be acknowledged)
/// and the guest's memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MovePause {
    pub pause_s: f64,
    pub rtt_s: f64,
    pub memory_bytes: u64,
}

/// One network card of a guest on its host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NicView {
    pub network: String,
    pub mac: String,
    /// The host's tap device for it.
    pub tap: String,
    /// The bridge the tap is plugged into ("" if this host lacks the network).
    pub bridge: String,
    /// The overlay link joining that bridge to other sites, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlay: Option<String>,
    /// Bytes sent to the guest and received from it through the tap, while
    /// QEMU runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_guest_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_guest_bytes: Option<u64>,
    /// Packets the same ways (the controller counts a guest's exchanges
    /// with its clients from them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_guest_packets: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_guest_packets: Option<u64>,
}

/// A guest's memory dirty rate as its host last measured it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyRateView {
    /// Bytes of guest RAM dirtied per second (QEMU's unit: 1 MiB/s steps).
    pub bytes_per_s: u64,
    /// Unix time (ms) the measurement ended.
    pub measured_unix_ms: u64,
}

/// The three moves of a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveKind {
    /// Memory to another host; the disk stays where it is.
    VmOnly,
    /// The disk to another storage daemon; the guest stays.
    DiskOnly,
    /// Disk pre-copy, then memory, one pause for both.
    Teleport,
}

impl MoveKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MoveKind::VmOnly => "vm_only",
            MoveKind::DiskOnly => "disk_only",
            MoveKind::Teleport => "teleport",
        }
    }
}

/// `POST /v1/vms/{name}/migrate` on the source host.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmMigrateRequest {
    /// Name the move (idempotent); one is made up otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<MigrationId>,
    /// The destination host's move listener (`ferry host --move-listen`),
    /// `HOST:PORT`; absent for a disk-only move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_host: Option<String>,
    /// Move the disks too: the destination storage daemon's migration
    /// listener, `HOST:PORT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_storage: Option<String>,
    /// Admin API of the destination storage daemon, recorded in the spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_storage_admin: Option<String>,
    /// The longest pause allowed (default 300 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_downtime_ms: Option<u64>,
    /// Memory and disk together must finish within this (default 600 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_s: Option<u64>,
    /// May switch to post-copy when pre-copy cannot converge.
    #[serde(default)]
    pub postcopy: bool,
    /// Compress the memory stream on the link (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<bool>,
    /// Send memory over this many parallel channels besides the main one
    /// (QEMU's multifd; 0: off). Each is its own TLS link. Not with
    /// post-copy (QEMU 7.2 does not combine them).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub multifd: u8,
    /// Send pages dirtied again as XOR deltas against what was sent
    /// (QEMU's xbzrle, with a cache of this many MiB at the source; 0: off).
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub xbzrle_cache_mib: u32,
    /// The storage link without TLS (both daemons on loopback only).
    #[serde(default)]
    pub disk_plaintext: bool,
    /// VM-only moves: where the destination host reaches a disk (volume →
    /// NBD `HOST:PORT`) when that is not where this host reaches it, as
    /// when the guest moves to the site that holds its disk. Disks not
    /// named keep their address.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub disk_servers: BTreeMap<String, String>,
}

fn is_zero(n: &u8) -> bool {
    *n == 0
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// Where a move is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VmMovePhase {
    Preparing,
    DiskPrecopy,
    MemoryPrecopy,
    Postcopy,
    Switchover,
    /// The host daemon stopped during the move (or lost the destination
    /// at the end); it is asking the destination how the move ended, and
    /// ends it that way (the guest runs at one site, never two).
    Resolving,
    Completed,
    /// Ended before the point of no return; the guest runs at the source.
    Aborted,
    /// Ended in a state that needs a person (see `error`).
    Failed,
}

impl VmMovePhase {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            VmMovePhase::Completed | VmMovePhase::Aborted | VmMovePhase::Failed
        )
    }
    pub fn as_str(self) -> &'static str {
        match self {
            VmMovePhase::Preparing => "preparing",
            VmMovePhase::DiskPrecopy => "disk_precopy",
            VmMovePhase::MemoryPrecopy => "memory_precopy",
            VmMovePhase::Postcopy => "postcopy",
            VmMovePhase::Switchover => "switchover",
            VmMovePhase::Resolving => "resolving",
            VmMovePhase::Completed => "completed",
            VmMovePhase::Aborted => "aborted",
            VmMovePhase::Failed => "failed",
        }
    }
}

/// Bytes a move put on the links, by kind.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MoveBytes {
    /// QEMU's migration stream as QEMU wrote it.
    pub memory_raw: u64,
    /// The same after ferry's compression, as sent inside TLS.
    pub memory_link: u64,
    /// Disk data frames (after compression) and fingerprint frames.
    pub disk_data: u64,
    pub disk_fingerprints: u64,
    /// Everything the disk migration put on its socket (TLS included).
    pub disk_link: u64,
}

/// One phase and how long it took.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseTime {
    pub phase: VmMovePhase,
    pub seconds: f64,
}

/// The one account of a move (`ferry vm migrate --json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmMoveReport {
    pub id: MigrationId,
    pub vm: String,
    pub kind: MoveKind,
    pub result: VmMovePhase,
    pub reason: Option<String>,
    /// Where the guest runs now: the source or the destination host.
    pub running_at: String,
    pub bytes: MoveBytes,
    pub phases: Vec<PhaseTime>,
    pub total_s: f64,
    /// QEMU's dirty-sync rounds over memory; ferry's rounds over the disk.
    pub memory_rounds: u64,
    pub disk_rounds: u64,
    /// The pause as QEMU reports it (`query-migrate` downtime: the source's
    /// stop to the end of its sending).
    pub downtime_ms_qemu: Option<u64>,
    /// The guest's whole pause by QEMU's own event stamps: STOP at the
    /// source to RESUME at the destination (host clocks).
    #[serde(default)]
    pub guest_pause_ms: Option<f64>,
    /// The pause the disk forwarders saw: the last request answered at
    /// the source host to the first at the destination (host clocks).
    pub disk_gap_ms: Option<f64>,
    /// The disk migration's own pause of guest writes.
    pub disk_pause_ms: Option<f64>,
    /// The longest disk request of the guest answered by this (the
    /// source) host's forwarder during the move: every stall the guest's
    /// own I/O saw here (the disks' write hold, the forwarder following a
    /// switch, a flush burst, throttling), not only the final hold. For a
    /// disk-only move this is the guest-visible pause of its disk; a guest
    /// that moves is stopped during its pause, which `guest_pause_ms` is.
    #[serde(default)]
    pub guest_io_longest_ms: Option<f64>,
    /// What was done to make the move converge, in order.
    pub convergence: Vec<String>,
    pub max_downtime_ms: u64,
    /// Compression of the memory stream on the link.
    pub compress: bool,
    /// The memory stream's raw bytes per second up to the switchover,
    /// where the source set its pace (its sender waited on the link under
    /// half of the time): what this move told the host's
    /// `memory_stream_bps`. Absent where the move did not measure it (the
    /// link or the far end held it back, it was small, multifd,
    /// post-copy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_stream_bps: Option<f64>,
    /// This move's fixed time besides its stream, pause and round trips:
    /// what it told the host's `memory_move_setup_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_setup_s: Option<f64>,
    /// A completed disk-only move's own part on this host besides its
    /// disks' migrations: what it told the host's `disk_move_host_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_move_host_s: Option<f64>,
    /// How busy the memory stream kept its link up to the switchover,
    /// where the link or the far end held it back (its sender waited on
    /// them half the time or more): what this move told the host's
    /// `memory_link_efficiency`. Absent where the move did not measure it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_link_efficiency: Option<f64>,
}

/// `GET /v1/vm-moves/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmMoveStatus {
    pub id: MigrationId,
    pub vm: String,
    pub kind: MoveKind,
    pub phase: VmMovePhase,
    /// Seconds the move ran: until now while it runs, its total once ended.
    pub elapsed_s: f64,
    /// When it started (unix seconds; 0 in records of older versions).
    #[serde(default)]
    pub started_unix: f64,
    /// Memory still to send (QEMU's estimate), bytes.
    pub memory_remaining: u64,
    /// Disk bytes dirty in the last round.
    pub disk_dirty: u64,
    pub convergence: Vec<String>,
    pub error: Option<String>,
    pub report: Option<VmMoveReport>,
    /// The destination host's move listener (none for a disk-only move).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_host: Option<String>,
    /// The disk migrations a teleport or disk-only move started, so that a
    /// restarted daemon can finish or cancel them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disk_migrations: Vec<DiskMigrationRef>,
}

/// One disk migration a move started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskMigrationRef {
    pub volume: String,
    /// The source storage daemon's admin API.
    pub admin: String,
    pub id: MigrationId,
    /// The destination storage daemon's admin API, if the move was told.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_admin: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_round_trips_and_refuses_unknown_fields() {
        let s = VmSpec {
            name: "web".into(),
            memory_mib: 256,
            vcpus: 1,
            disks: vec![VmDisk {
                volume: "root".into(),
                server: "127.0.0.1:10809".into(),
                admin: None,
            }],
            boot: Boot::Kernel {
                kernel: "/k".into(),
                initrd: None,
                cmdline: "console=ttyS0".into(),
            },
            accel: Accel::Auto,
            cloud_init: Some(CloudInit {
                hostname: Some("web".into()),
                user_data: "#cloud-config\n{}\n".into(),
                network_config: None,
                addresses: vec![NicAddress {
                    address: "10.0.0.5/24".into(),
                    gateway: Some("10.0.0.1".into()),
                }],
            }),
            nics: vec![VmNic {
                network: "web".into(),
                mac: "52:54:00:12:34:56".into(),
            }],
        };
        let j = serde_json::to_string(&s).unwrap();
        assert!(j.contains(r#""kind":"kernel""#), "{j}");
        assert_eq!(serde_json::from_str::<VmSpec>(&j).unwrap(), s);
        let bad = j.replace("\"vcpus\"", "\"vcpu\"");
        assert!(serde_json::from_str::<VmSpec>(&bad).is_err());
        let c: CreateVm = serde_json::from_str(&format!(r#"{{"spec":{j}}}"#)).unwrap();
        assert!(c.start);
        let disk: Boot = serde_json::from_str(r#"{"kind":"disk"}"#).unwrap();
        assert_eq!(disk, Boot::Disk);
    }
}
