//! Measuring the sites: every host's guests read twice, an interval
//! apart, through the hosts' API (`/v1/vms`: the forwarder's counters and
//! QEMU's CPU time), turned into a [`Cluster`] snapshot. A host that does
//! not answer is reported and left out; the others are still measured.
//! Between the two readings, each declared link's round trip is probed
//! from a host of one site to a host of the other (`/v1/probe`); the plan
//! uses the measured RTT, the declared one when no probe answered. A
//! link's bandwidth is probed too (a transfer of at most
//! [`BANDWIDTH_PROBE_BYTES`] for at most a second), once per
//! [`BANDWIDTH_MAX_AGE`]: the plan uses what the controller's own moves
//! achieved on the link, else the probe, else the declared figure.
//!
//! With a [`LoadSource::Prometheus`], the hosts are read once (which guests
//! run where) and the guests' loads are Prometheus' rates over its window
//! (`crate::prometheus`); if it does not answer, the cycle says so and
//! reads the hosts twice as without it.
//!
//! A guest's network cards count its traffic; on a network whose clients
//! the inventory places at a site (`ferry site add --clients NETWORK`),
//! that traffic becomes the guest's [`ClientTraffic`] with that site.

use ferry_api::{AdminClient, DiskIo, VmState as GuestState, VmView};
use ferry_placement::cluster::is_share;
use ferry_placement::inventory::{Inventory, StorageRef};
use ferry_placement::model::{DISK_MOVE_SETUP_S, TELEPORT_CHECK_S, VM_MOVE_SETUP_S};
use ferry_placement::policy::Action;
use ferry_placement::{ClientTraffic, Cluster, Placement, VmLoad, VmState};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// How long one call to a host may take.
pub const HOST_CALL_LIMIT: Duration = Duration::from_secs(10);

/// Round trips to time per link and cycle.
const PROBES: u32 = 3;

/// Blocks of a guest's disk sampled to estimate what each other site
/// already holds (the most a storage daemon samples at once): one block
/// in 8 of a 128 MiB disk, so a site that lacks a few blocks (a disk's
/// return trip) is told apart from one that lacks none.
const SAMPLE_BLOCKS: u64 = 4096;

/// How long a disk's sample stays good: what the sites hold of it changes
/// slowly (with their indexes), and each sample costs 4,096 block reads at
/// the disk's site and an index lookup at every other.
pub const HOLDINGS_MAX_AGE: Duration = Duration::from_secs(300);

/// Most bytes one bandwidth probe sends.
pub const BANDWIDTH_PROBE_BYTES: u64 = 16 << 20;
/// Longest one bandwidth probe sends for.
const BANDWIDTH_PROBE_SECS: f64 = 1.0;
/// How long a link's probed bandwidth stays good before it is probed again.
pub const BANDWIDTH_MAX_AGE: Duration = Duration::from_secs(600);

/// The last bandwidth probe of each link (sites as declared).
#[derive(Debug, Default)]
pub struct BandwidthCache {
    entries: BTreeMap<(String, String), (Instant, f64)>,
}

impl BandwidthCache {
    fn fresh(&self, key: &(String, String)) -> Option<f64> {
        self.entries
            .get(key)
            .filter(|(at, _)| at.elapsed() < BANDWIDTH_MAX_AGE)
            .map(|(_, bw)| *bw)
    }
}

/// The last sample of each disk (storage address, volume): per site, the
/// share of the disk a move there would send.
#[derive(Debug, Default)]
pub struct HoldingsCache {
    entries: BTreeMap<(String, String), (Instant, Holdings)>,
}

/// What a sample of a volume said: its non-zero share, how well its data
/// compresses on the link, and per site the share a disk move there would
/// send.
#[derive(Debug, Clone, Default)]
struct Holdings {
    nonzero: Option<f64>,
    link_share: Option<f64>,
    /// The disk's daemon's own switch hold besides the link
    /// (`VolumeSample::switch_hold_s`), where it has measured one.
    switch_hold_s: Option<f64>,
    /// The disk's daemon's recent switch holds besides the link
    /// (`VolumeSample::switch_holds_s`), the usable ones.
    switch_holds_s: Vec<f64>,
    /// The disk's daemon's own small moves' fixed work
    /// (`VolumeSample::move_setups_s`), the usable ones.
    move_setups_s: Vec<f64>,
    missing: BTreeMap<String, f64>,
    /// Per site, the link bytes of what it lacks, as a share of the
    /// volume's bytes: the missing sampled blocks, each at its stream
    /// cost (from daemons that say which fingerprints they lack).
    missing_link: BTreeMap<String, f64>,
    /// Per site with several storage daemons: the one (NBD address) whose
    /// index holds most of the sample.
    best: BTreeMap<String, String>,
    /// Sites holding the copy the volume left when it moved away (a move
    /// there returns: that copy is its basis).
    copy_at: BTreeSet<String>,
    /// Per site holding the copy the volume left by the migration it
    /// arrived where it is by (its daemon here tracked what was written
    /// since): the bytes a return there prints, as a share of the volume.
    printed: BTreeMap<String, f64>,
    /// Sites where the daemon a move goes to shares the extents of the
    /// blocks it holds instead of writing them.
    shares_extents_at: BTreeSet<String>,
    /// Per site, the rate the daemon a move goes to measured for rebuilding
    /// held blocks (its recent incoming migrations), where it has one.
    rebuild_bps_at: BTreeMap<String, f64>,
}

impl Holdings {
    /// Per site, the bytes a disk move of `disk_bytes` there would send.
    fn missing_at(&self, disk_bytes: f64) -> BTreeMap<String, f64> {
        scaled(&self.missing, disk_bytes)
    }

    /// Per site, the link bytes a disk move of `disk_bytes` there would
    /// send for the data it lacks.
    fn missing_link_at(&self, disk_bytes: f64) -> BTreeMap<String, f64> {
        scaled(&self.missing_link, disk_bytes)
    }

    /// Per site a tracked return goes to, the bytes it prints.
    fn printed_at(&self, disk_bytes: f64) -> BTreeMap<String, f64> {
        scaled(&self.printed, disk_bytes)
    }
}

fn scaled(shares: &BTreeMap<String, f64>, bytes: f64) -> BTreeMap<String, f64> {
    shares
        .iter()
        .map(|(site, share)| (site.clone(), share * bytes))
        .collect()
}

impl HoldingsCache {
    fn fresh(&self, key: &(String, String)) -> Option<&Holdings> {
        self.entries
            .get(key)
            .filter(|(at, _)| at.elapsed() < HOLDINGS_MAX_AGE)
            .map(|(_, m)| m)
    }

    /// Forget samples too old to use.
    fn prune(&mut self) {
        self.entries
            .retain(|_, (at, _)| at.elapsed() < HOLDINGS_MAX_AGE);
    }
}

/// What a sample of `volume` (at storage `server`) says: per site, the
/// share of it a disk move there would send: its non-zero share (a sample
/// of its blocks, read where it lives) times the share of those blocks the
/// site's index does not hold. 0 at its own site; sites without storage,
/// or that do not answer, are left out (the model then counts the whole
/// disk). Also the volume's non-zero share and how its data compresses,
/// when a sample was read. A sample is reused for [`HOLDINGS_MAX_AGE`];
/// one that met a problem is not kept.
fn volume_holdings(
    inv: &Inventory,
    server: &str,
    volume: &str,
    problems: &mut Vec<String>,
    cache: &mut HoldingsCache,
) -> Holdings {
    let key = (server.to_string(), volume.to_string());
    if let Some(h) = cache.fresh(&key) {
        return h.clone();
    }
    let before = problems.len();
    let h = missing_shares(inv, server, volume, problems);
    if problems.len() == before {
        cache.entries.insert(key, (Instant::now(), h.clone()));
    }
    h
}

/// Per site, the share of `volume` a disk move there would send (see
/// [`volume_holdings`]).
fn missing_shares(
    inv: &Inventory,
    server: &str,
    volume: &str,
    problems: &mut Vec<String>,
) -> Holdings {
    let mut out = Holdings::default();
    let Some((home, st)) = inv.storage_at(server) else {
        return out;
    };
    out.missing.insert(home.name.clone(), 0.0);
    let sample = match AdminClient::with_timeout(&st.admin, HOST_CALL_LIMIT)
        .sample_volume(volume, SAMPLE_BLOCKS)
    {
        Ok(s) => {
            out.switch_hold_s = s.switch_hold_s.filter(|h| h.is_finite() && *h >= 0.0);
            out.switch_holds_s = usable_seconds(&s.switch_holds_s);
            out.move_setups_s = usable_seconds(&s.move_setups_s);
            if s.sampled == 0 {
                return out;
            }
            s
        }
        Err(e) => {
            problems.push(format!("sampling {volume} at {}: {e}", st.admin));
            return out;
        }
    };
    #[allow(clippy::cast_precision_loss)]
    let nonzero = (sample.sampled - sample.zero) as f64 / sample.sampled as f64;
    out.nonzero = Some(nonzero);
    let nonzero_bytes = (sample.sampled - sample.zero) * u64::from(sample.block_size);
    if nonzero_bytes > 0 && sample.nonzero_compressed > 0 {
        #[allow(clippy::cast_precision_loss)]
        let share = sample.nonzero_compressed as f64 / nonzero_bytes as f64;
        out.link_share = Some(share);
    }
    let since = sample.since_arrival.as_deref();
    let identity = sample.uuid.as_ref().map(|uuid| ferry_api::VolumeIdentity {
        name: volume.to_string(),
        uuid: uuid.clone(),
        arrived_under: since.map(|s| s.arrived_under.clone()),
    });
    for s in inv.sites.iter().filter(|s| s.name != home.name) {
        // Every daemon of the site is asked; the move goes to the one that
        // holds most, so the site lacks what that one lacks.
        let mut best: Option<DaemonHolds> = None;
        // The daemon keeping the copy the volume left by the migration
        // it arrived where it is by: a move there is a tracked return.
        let mut tracked: Option<(TrackedReturn, &StorageRef)> = None;
        for there in &s.storage {
            let answer = if sample.fingerprints.is_empty() && identity.is_none() {
                DaemonHolds::nothing(there)
            } else {
                let client = AdminClient::with_timeout(&there.admin, HOST_CALL_LIMIT);
                match client.index_lookup(&sample.fingerprints, identity.as_ref()) {
                    #[allow(clippy::cast_precision_loss)]
                    Ok(a) => {
                        if a.holds_copy {
                            out.copy_at.insert(s.name.clone());
                        }
                        if let Some(since) = since.filter(|_| a.copy_tracked) {
                            match tracked_return(&sample, since, &client) {
                                Ok(t) => tracked = Some((t, there)),
                                Err(e) => problems.push(format!(
                                    "asking {} of {} about what was written to {volume}: {e}",
                                    there.admin, s.name
                                )),
                            }
                        }
                        DaemonHolds {
                            there,
                            held: a.found as f64 / a.asked.max(1) as f64,
                            lacks: a.missing,
                            shares: a.shares_extents,
                            rate: a.rebuild_bps,
                        }
                    }
                    Err(e) => {
                        problems.push(format!(
                            "asking {} of {} about {volume}: {e}",
                            there.admin, s.name
                        ));
                        continue;
                    }
                }
            };
            if best.as_ref().is_none_or(|b| answer.held > b.held) {
                best = Some(answer);
            }
        }
        if let Some((t, there)) = tracked {
            out.missing.insert(s.name.clone(), t.missing);
            out.missing_link.insert(s.name.clone(), t.missing_link);
            out.printed.insert(s.name.clone(), t.printed);
            if s.storage.len() > 1 {
                out.best.insert(s.name.clone(), there.nbd.clone());
            }
            continue;
        }
        let Some(DaemonHolds {
            there,
            held,
            lacks,
            shares,
            rate,
        }) = best
        else {
            continue;
        };
        out.missing.insert(s.name.clone(), nonzero * (1.0 - held));
        if shares {
            out.shares_extents_at.insert(s.name.clone());
        }
        if let Some(r) = rate.filter(|r| r.is_finite() && *r > 0.0) {
            out.rebuild_bps_at.insert(s.name.clone(), r);
        }
        if let Some(share) = lacks.as_ref().and_then(|l| missing_link_share(&sample, l)) {
            tracing::debug!(
                %volume,
                site = %s.name,
                sampled = sample.sampled,
                lacks = lacks.as_ref().map_or(0, Vec::len),
                sizes = ?lacks.iter().flatten().filter_map(|&i| sample.compressed.get(i as usize)).collect::<Vec<_>>(),
                share,
                "what a site lacks of a sampled disk"
            );
            out.missing_link.insert(s.name.clone(), share);
        }
        if s.storage.len() > 1 && held > 0.0 {
            out.best.insert(s.name.clone(), there.nbd.clone());
        }
    }
    out
}

/// What one storage daemon of a site answered about a disk's sample.
struct DaemonHolds<'a> {
    there: &'a StorageRef,
    /// The share of the sample's blocks it holds.
    held: f64,
    /// The positions in the sample of those it lacks (if it said).
    lacks: Option<Vec<u32>>,
    /// Its pool shares extents (`LookupAnswer::shares_extents`).
    shares: bool,
    /// Its own measured rebuild rate (`LookupAnswer::rebuild_bps`).
    rate: Option<f64>,
}

impl<'a> DaemonHolds<'a> {
    /// A daemon asked nothing: the sample is empty.
    fn nothing(there: &'a StorageRef) -> Self {
        DaemonHolds {
            there,
            held: 0.0,
            lacks: Some(Vec::new()),
            shares: false,
            rate: None,
        }
    }
}

/// A tracked return's cost, each as a share of the volume's bytes: what
/// the destination lacks of the blocks written since the volume arrived
/// where it is (raw, and on the link), and those blocks' non-zero bytes,
/// which it prints.
#[derive(Debug, Clone, Copy, PartialEq)]
struct TrackedReturn {
    missing: f64,
    missing_link: f64,
    printed: f64,
}

/// Price a tracked return from the sample of what was written since the
/// volume arrived (`since`), asking the destination (`client`) which of
/// those blocks its index holds.
fn tracked_return(
    sample: &ferry_api::VolumeSample,
    since: &ferry_api::WrittenSinceArrival,
    client: &AdminClient,
) -> Result<TrackedReturn, ferry_api::ClientError> {
    let w = &since.sample;
    let answer = if w.fingerprints.is_empty() {
        None
    } else {
        Some(client.index_lookup(&w.fingerprints, None)?)
    };
    Ok(tracked_cost(sample, since, answer.as_ref()))
}

/// [`tracked_return`] from the destination's answer about the written
/// blocks' fingerprints (`None`: none was asked, every written block is
/// zero).
fn tracked_cost(
    sample: &ferry_api::VolumeSample,
    since: &ferry_api::WrittenSinceArrival,
    answer: Option<&ferry_api::LookupAnswer>,
) -> TrackedReturn {
    let w = &since.sample;
    if w.sampled == 0 || sample.volume_size == 0 {
        return TrackedReturn {
            missing: 0.0,
            missing_link: 0.0,
            printed: 0.0,
        };
    }
    #[allow(clippy::cast_precision_loss)]
    let (written, size, nonzero) = (
        (since.blocks * u64::from(sample.block_size)).min(sample.volume_size) as f64,
        sample.volume_size as f64,
        (w.sampled - w.zero) as f64 / w.sampled as f64,
    );
    #[allow(clippy::cast_precision_loss)]
    let held = answer.map_or(1.0, |a| a.found as f64 / a.asked.max(1) as f64);
    let missing = written * nonzero * (1.0 - held) / size;
    let link = answer
        .and_then(|a| a.missing.as_deref())
        .and_then(|lacks| missing_link_share(w, lacks));
    TrackedReturn {
        missing,
        // An older daemon that does not say which it lacks: at the
        // written blocks' own compression.
        missing_link: link.map_or_else(
            || {
                #[allow(clippy::cast_precision_loss)]
                let bytes = ((w.sampled - w.zero) * u64::from(w.block_size)).max(1) as f64;
                #[allow(clippy::cast_precision_loss)]
                let share = w.nonzero_compressed as f64 / bytes;
                missing * share
            },
            |s| s * written / size,
        ),
        printed: written * nonzero / size,
    }
}

/// What the sampled blocks at positions `lacks` (of the sample's
/// fingerprints) cost on the link, each as it adds to the sample's
/// stream, as a share of the sampled bytes; `None` without per-block sizes (an older daemon).
fn missing_link_share(sample: &ferry_api::VolumeSample, lacks: &[u32]) -> Option<f64> {
    if sample.compressed.len() != sample.fingerprints.len() || sample.sampled == 0 {
        return None;
    }
    let bytes: u64 = lacks
        .iter()
        .filter_map(|&i| sample.compressed.get(i as usize))
        .map(|&c| u64::from(c))
        .sum();
    #[allow(clippy::cast_precision_loss)]
    Some(bytes as f64 / (sample.sampled * u64::from(sample.block_size)) as f64)
}

/// One link's RTT, as declared and as probed this cycle.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinkMeasure {
    pub a: String,
    pub b: String,
    pub declared_rtt_ms: f64,
    /// The smallest of this cycle's probe round trips.
    pub measured_rtt_ms: Option<f64>,
    /// The host probed from and the move address probed.
    pub from: Option<String>,
    pub to: Option<String>,
    pub error: Option<String>,
    pub declared_bandwidth: f64,
    /// Bytes per second of the last bandwidth probe (a capped transfer
    /// between the two sites' first hosts), if one answered.
    #[serde(default)]
    pub probed_bandwidth: Option<f64>,
    /// Bytes per second the controller's own completed moves achieved on
    /// this link (smoothed), from the journal.
    #[serde(default)]
    pub moves_bandwidth: Option<f64>,
    #[serde(default)]
    pub moves_counted: usize,
}

impl LinkMeasure {
    /// The RTT the model uses (ms), and where it came from.
    pub fn rtt_used(&self) -> (f64, String) {
        match (self.measured_rtt_ms, &self.error) {
            (Some(m), _) => (
                m,
                format!(
                    "probed{}; declared {:.1} ms",
                    self.from
                        .as_deref()
                        .map(|f| format!(" from {f}"))
                        .unwrap_or_default(),
                    self.declared_rtt_ms
                ),
            ),
            (None, Some(e)) => (
                self.declared_rtt_ms,
                format!("declared; the probe failed: {e}"),
            ),
            (None, None) => (self.declared_rtt_ms, "declared".into()),
        }
    }

    /// The bandwidth the model uses (bytes/s), and where it came from:
    /// what the controller's moves achieved, else the probe, else the
    /// declared figure.
    pub fn bandwidth_used(&self) -> (f64, String) {
        let declared = format!("declared {:.1} MB/s", self.declared_bandwidth / 1e6);
        match (self.moves_bandwidth, self.probed_bandwidth) {
            (Some(b), _) => (
                b,
                format!(
                    "achieved by {} completed move(s); {declared}",
                    self.moves_counted
                ),
            ),
            (None, Some(b)) => (b, format!("probed; {declared}")),
            (None, None) => (self.declared_bandwidth, "declared".into()),
        }
    }
}

/// Per link (sites in name order): the smoothed bytes per second of the
/// completed moves among `outcomes` (oldest first) that carried at least
/// 1 MB, and how many there were. The fixed set-up of each kind of move
/// is taken out of its time first (the model adds it back to every
/// prediction): the memory's as its host measured it for that move where
/// the report says, else the model's constant; never more than four
/// fifths of the time. Where the host measured how busy the memory
/// stream kept the link (the model prices a stream from that host at
/// that share of the link's rate), its bytes count as that much more of
/// the link's. What is left
/// includes convergence, so this is what the next move can expect, not
/// the raw line rate.
pub fn bandwidth_from_moves<'a>(
    outcomes: impl Iterator<Item = &'a crate::act::MoveOutcome>,
) -> BTreeMap<(String, String), (f64, usize)> {
    let mut out: BTreeMap<(String, String), (f64, usize)> = BTreeMap::new();
    for o in outcomes {
        if !o.completed() || o.bytes < 1e6 || o.seconds <= 0.0 {
            continue;
        }
        let Some(link) = o.link() else { continue };
        let memory = o.memory_setup_s.unwrap_or(VM_MOVE_SETUP_S);
        let setup = match o.action {
            Action::MoveVm => memory,
            Action::MoveDisk => DISK_MOVE_SETUP_S,
            Action::Teleport => TELEPORT_CHECK_S + memory + DISK_MOVE_SETUP_S,
        };
        let memory = o.memory_bytes.unwrap_or(0.0).clamp(0.0, o.bytes);
        let efficiency = o
            .memory_link_efficiency
            .filter(|e| is_share(*e))
            .unwrap_or(1.0);
        let link_bytes = o.bytes - memory + memory / efficiency;
        let rate = link_bytes / (o.seconds - setup).max(0.2 * o.seconds);
        let e = out.entry(link).or_insert((rate, 0));
        e.0 = if e.1 == 0 {
            rate
        } else {
            0.5 * e.0 + 0.5 * rate
        };
        e.1 += 1;
    }
    out
}

/// Probe every declared link once (a few round trips) from the first host
/// of one site to the first host of the other, and its bandwidth when the
/// last probe of it is older than [`BANDWIDTH_MAX_AGE`].
pub fn probe_links(inv: &Inventory, bandwidth: &mut BandwidthCache) -> Vec<LinkMeasure> {
    inv.links
        .iter()
        .map(|l| {
            let mut m = LinkMeasure {
                a: l.a.clone(),
                b: l.b.clone(),
                declared_rtt_ms: l.rtt_ms,
                measured_rtt_ms: None,
                from: None,
                to: None,
                error: None,
                declared_bandwidth: l.bandwidth,
                probed_bandwidth: None,
                moves_bandwidth: None,
                moves_counted: 0,
            };
            let key = (l.a.clone(), l.b.clone());
            m.probed_bandwidth = bandwidth.fresh(&key);
            let first_host = |site: &str| inv.site(site).and_then(|s| s.hosts.first().cloned());
            let (Some(from), Some(to)) = (first_host(&l.a), first_host(&l.b)) else {
                m.error = Some(format!(
                    "no host at {} or {} to probe between; the declared RTT stands",
                    l.a, l.b
                ));
                return m;
            };
            m.from = Some(from.control.clone());
            m.to = Some(to.moves.clone());
            let bytes = if m.probed_bandwidth.is_some() {
                0
            } else {
                BANDWIDTH_PROBE_BYTES
            };
            // A bandwidth probe may take its second plus what is in flight
            // draining over a slow link; round trips alone are quick.
            let limit = if bytes > 0 {
                HOST_CALL_LIMIT + Duration::from_secs(20)
            } else {
                HOST_CALL_LIMIT
            };
            match AdminClient::for_host(&from.control)
                .limited(limit)
                .probe_with_bandwidth(&to.moves, PROBES, bytes, BANDWIDTH_PROBE_SECS)
            {
                Ok(p) => {
                    m.measured_rtt_ms = p.min_ms;
                    if let Some(b) = &p.bandwidth {
                        m.probed_bandwidth = Some(b.bytes_per_sec);
                        bandwidth
                            .entries
                            .insert(key, (Instant::now(), b.bytes_per_sec));
                    }
                    if p.min_ms.is_none() || (bytes > 0 && p.bandwidth.is_none()) {
                        m.error = Some(p.errors.first().cloned().unwrap_or_default());
                    }
                }
                Err(e) => m.error = Some(e.to_string()),
            }
            m
        })
        .collect()
}

/// Where each guest that burst away belongs (the site it burst from),
/// from the journal's completed moves in order: a burst sets it, a move
/// back to it clears it, other moves keep it.
pub fn burst_homes<'a>(
    outcomes: impl Iterator<Item = &'a crate::act::MoveOutcome>,
) -> BTreeMap<String, String> {
    let mut homes = BTreeMap::new();
    for o in outcomes.filter(|o| o.completed()) {
        let home = ferry_placement::cluster::home_after_move(
            homes.remove(&o.vm),
            o.burst_from.as_deref(),
            &o.to_host_site,
        );
        if let Some(h) = home {
            homes.insert(o.vm.clone(), h);
        }
    }
    homes
}

/// Where the guests' loads come from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LoadSource {
    /// The hosts' counters, read twice a sample interval apart.
    #[default]
    Hosts,
    /// Rates from a Prometheus server that scrapes the hosts.
    Prometheus(crate::prometheus::PrometheusSource),
}

/// One measurement of the sites.
#[derive(Debug, Clone)]
pub struct Measured {
    /// Where this measurement's loads came from: `hosts`, or
    /// `prometheus URL (window W)`.
    pub loads_from: String,
    pub cluster: Cluster,
    /// Which host (control address) runs each VM.
    pub running_on: BTreeMap<String, String>,
    /// (guest, site) -> the NBD address of the site's storage daemon whose
    /// index holds most of the guest's disk.
    pub storage_for: BTreeMap<(String, String), String>,
    /// Each guest's disk server (NBD address).
    pub disk_server: BTreeMap<String, String>,
    /// What could not be measured, one line each.
    pub problems: Vec<String>,
    /// Each declared link's RTT as probed.
    pub links: Vec<LinkMeasure>,
}

struct Sampled {
    site: String,
    control: String,
    vm: VmView,
}

fn sample(inv: &Inventory, problems: &mut Vec<String>, quiet: bool) -> Vec<Sampled> {
    let mut out = Vec::new();
    for s in &inv.sites {
        for h in &s.hosts {
            match AdminClient::for_host(&h.control)
                .limited(HOST_CALL_LIMIT)
                .vms()
            {
                Ok(vms) => out.extend(vms.into_iter().map(|vm| Sampled {
                    site: s.name.clone(),
                    control: h.control.clone(),
                    vm,
                })),
                Err(e) if !quiet => {
                    problems.push(format!("host {} of site {}: {e}", h.control, s.name));
                }
                Err(_) => {}
            }
        }
    }
    out
}

fn requests(x: &DiskIo) -> u64 {
    x.reads + x.writes + x.flushes + x.other
}

/// A guest's load from two readings of its host `dt` seconds apart
/// (`earlier` is `None` for a guest the first reading did not see).
#[allow(clippy::cast_precision_loss)]
fn load_between(earlier: Option<&VmView>, now: &VmView, d: &DiskIo, dt: f64) -> VmLoad {
    let before = earlier
        .and_then(|x| x.disks.first().cloned())
        .unwrap_or_default();
    let n = requests(d).saturating_sub(requests(&before));
    let nf = n as f64;
    let bytes = (d.read_bytes + d.write_bytes)
        .saturating_sub(before.read_bytes + before.write_bytes) as f64;
    let lat_us = d.latency_sum_us.saturating_sub(before.latency_sum_us) as f64;
    let writes = d.write_bytes.saturating_sub(before.write_bytes) as f64;
    let cpu_before = earlier.map_or(now.cpu_time_s, |x| x.cpu_time_s);
    VmLoad {
        iops: nf / dt,
        io_bytes: if n > 0 { bytes / nf } else { 4096.0 },
        latency_ms: if n > 0 { lat_us / nf / 1000.0 } else { 0.0 },
        cpu: (now.cpu_time_s - cpu_before).max(0.0) / dt,
        dirty_rate: dirty_rate(now, writes / dt),
        write_rate: writes / dt,
    }
}

/// A guest's traffic on one of its networks, per second.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NicRates {
    pub to_guest_packets: f64,
    pub from_guest_packets: f64,
    /// Both directions.
    pub bytes: f64,
}

/// A guest's traffic per network from two readings of its host `dt`
/// seconds apart (a card the first reading lacks, or whose counters went
/// back, as after a restart of its QEMU, counts from zero).
#[allow(clippy::cast_precision_loss)]
fn nic_rates_between(
    earlier: Option<&VmView>,
    now: &VmView,
    dt: f64,
) -> BTreeMap<String, NicRates> {
    let mut out: BTreeMap<String, NicRates> = BTreeMap::new();
    for n in &now.nics {
        let before = earlier.and_then(|e| e.nics.iter().find(|x| x.mac == n.mac));
        let delta = |now: Option<u64>, then: Option<u64>| -> f64 {
            let (now, then) = (now.unwrap_or(0), then.unwrap_or(0));
            (if now >= then { now - then } else { now }) as f64 / dt
        };
        let r = out.entry(n.network.clone()).or_default();
        r.to_guest_packets += delta(n.to_guest_packets, before.and_then(|b| b.to_guest_packets));
        r.from_guest_packets += delta(
            n.from_guest_packets,
            before.and_then(|b| b.from_guest_packets),
        );
        r.bytes += delta(n.to_guest_bytes, before.and_then(|b| b.to_guest_bytes))
            + delta(n.from_guest_bytes, before.and_then(|b| b.from_guest_bytes));
    }
    out
}

/// A guest's traffic with clients per site they are at: its networks'
/// rates, on the networks whose clients the inventory places somewhere.
/// An exchange needs a packet each way, so the smaller of the packets in
/// and out per second counts the exchanges (a bulk transfer, one way in
/// many packets and acknowledged by fewer, counts its acknowledgements:
/// more exchanges than the client waits on).
pub fn client_traffic(
    inv: &Inventory,
    networks: &BTreeMap<String, NicRates>,
) -> Vec<ClientTraffic> {
    let mut by_site: BTreeMap<&str, ClientTraffic> = BTreeMap::new();
    for (net, r) in networks {
        let Some(site) = inv.clients_of(net) else {
            continue;
        };
        let t = by_site.entry(site).or_insert_with(|| ClientTraffic {
            site: site.to_string(),
            exchanges_per_s: 0.0,
            bytes_per_s: 0.0,
        });
        t.exchanges_per_s += r.to_guest_packets.min(r.from_guest_packets);
        t.bytes_per_s += r.bytes;
    }
    by_site
        .into_values()
        .filter(|t| t.exchanges_per_s > 0.0 || t.bytes_per_s > 0.0)
        .collect()
}

/// A guest's memory dirty rate: QEMU's estimate as its host last measured
/// it; before the first measurement (or with the host's sampling off) the
/// rate it writes its disk stands in (what it writes passes through its
/// page cache).
#[allow(clippy::cast_precision_loss)]
fn dirty_rate(v: &VmView, disk_writes_per_s: f64) -> f64 {
    v.memory_dirty
        .map_or(disk_writes_per_s, |d| d.bytes_per_s as f64)
}

/// A guest's load from Prometheus' rates.
fn load_from_rates(g: &crate::prometheus::GuestRates) -> VmLoad {
    VmLoad {
        iops: g.iops,
        io_bytes: if g.iops > 0.0 {
            g.bytes_per_sec / g.iops
        } else {
            4096.0
        },
        latency_ms: g.latency_ms,
        cpu: g.cpu,
        // As from the hosts: the disk write rate stands in until the
        // host has measured the memory's.
        dirty_rate: g.memory_dirty.unwrap_or(g.write_bytes_per_sec),
        write_rate: g.write_bytes_per_sec,
    }
}

/// A host's kept pauses as the model reads them: those a move could
/// have made (a positive, finite pause and memory, a finite round trip of
/// zero or more); a host that says otherwise is not believed.
#[allow(clippy::cast_precision_loss)]
/// The told durations that could be real ones (finite, zero or more).
fn usable_seconds(told: &[f64]) -> Vec<f64> {
    told.iter()
        .copied()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .collect()
}

fn usable_pauses(pauses: &[ferry_api::MovePause]) -> Vec<ferry_placement::cluster::MovePause> {
    pauses
        .iter()
        .filter(|p| {
            p.pause_s.is_finite()
                && p.pause_s > 0.0
                && p.rtt_s.is_finite()
                && p.rtt_s >= 0.0
                && p.memory_bytes > 0
        })
        .map(|p| ferry_placement::cluster::MovePause {
            pause_s: p.pause_s,
            rtt_s: p.rtt_s,
            memory_bytes: p.memory_bytes as f64,
        })
        .collect()
}

/// What a memory move of `v` sends in full: the RAM the guest touched
/// (resident in QEMU), else all of it.
#[allow(clippy::cast_precision_loss)]
fn memory_to_send(v: &VmView) -> f64 {
    v.memory_resident_bytes
        .filter(|b| *b > 0)
        .unwrap_or(v.spec.memory_mib << 20) as f64
}

/// The size of `volume` as the host at `control` reaches it (1 GiB when
/// it does not say).
#[allow(clippy::cast_precision_loss)]
fn volume_size(control: &str, volume: &str) -> f64 {
    AdminClient::for_host(control)
        .limited(HOST_CALL_LIMIT)
        .host_volumes()
        .ok()
        .and_then(|vs| vs.into_iter().find(|x| x.volume == volume).map(|x| x.size))
        .unwrap_or(1 << 30) as f64
}

/// The guests' rates from Prometheus, when that is the load source and it
/// answers (else the hosts are read, and the problem said).
fn prometheus_rates<'a>(
    source: &'a LoadSource,
    problems: &mut Vec<String>,
) -> Option<(
    BTreeMap<String, crate::prometheus::GuestRates>,
    &'a crate::prometheus::PrometheusSource,
)> {
    match source {
        LoadSource::Hosts => None,
        LoadSource::Prometheus(p) => match p.guest_rates() {
            Ok(r) => Some((r, p)),
            Err(e) => {
                problems.push(format!("{e}; the hosts were read instead"));
                None
            }
        },
    }
}

/// Guest `name`'s load and network rates from Prometheus's `rates`; a
/// guest it has no rates for yet counts as idle (and the problem said).
fn load_from_prometheus(
    rates: &BTreeMap<String, crate::prometheus::GuestRates>,
    name: &str,
    problems: &mut Vec<String>,
) -> (VmLoad, BTreeMap<String, NicRates>) {
    rates.get(name).map_or_else(
        || {
            problems.push(format!(
                "{name}: no rates in prometheus yet; counted as idle"
            ));
            (load_from_rates(&Default::default()), BTreeMap::new())
        },
        |g| (load_from_rates(g), g.networks.clone()),
    )
}

/// The inventory's links with this cycle's probed RTT and bandwidth where
/// a probe answered, the declared ones elsewhere.
fn links_as_probed(inv: &Inventory, links: &[LinkMeasure]) -> Vec<ferry_placement::Link> {
    inv.links
        .iter()
        .map(|l| {
            let probe = links.iter().find(|m| m.a == l.a && m.b == l.b);
            ferry_placement::Link {
                rtt_ms: probe.and_then(|m| m.measured_rtt_ms).unwrap_or(l.rtt_ms),
                bandwidth: probe
                    .and_then(|m| m.probed_bandwidth)
                    .unwrap_or(l.bandwidth),
                ..l.clone()
            }
        })
        .collect()
}

/// Measure every running guest: its load from Prometheus (`source`), or
/// from its host read twice, `interval` apart. `since_move_s` gives, per
/// VM, the seconds since the controller last moved it.
pub fn measure(
    inv: &Inventory,
    interval: Duration,
    source: &LoadSource,
    since_move_s: &BTreeMap<String, f64>,
    holdings: &mut HoldingsCache,
    bandwidth: &mut BandwidthCache,
) -> Measured {
    holdings.prune();
    let mut problems = Vec::new();
    let t0 = Instant::now();
    let quiet = matches!(source, LoadSource::Hosts);
    let first = sample(inv, &mut problems, quiet);
    let links = probe_links(inv, bandwidth);
    for l in &links {
        if let Some(e) = &l.error {
            problems.push(format!("link {}-{}: {e}", l.a, l.b));
        }
    }
    let rates = prometheus_rates(source, &mut problems);
    // With rates from Prometheus the one reading of the hosts places the
    // guests; without, a second reading gives the rates.
    let (first, second, loads_from) = match &rates {
        Some((_, p)) => (
            Vec::new(),
            first,
            format!("prometheus {} (window {}s)", p.url, p.window.as_secs()),
        ),
        None => {
            std::thread::sleep(interval.saturating_sub(t0.elapsed()));
            let second = sample(inv, &mut problems, false);
            (first, second, "hosts".to_string())
        }
    };
    let dt = t0.elapsed().as_secs_f64().max(1e-3);
    let mut vms = Vec::new();
    let mut running_on = BTreeMap::new();
    let mut storage_for = BTreeMap::new();
    let mut disk_server = BTreeMap::new();
    for Sampled {
        site,
        control,
        vm: v,
    } in &second
    {
        // A guest seen on two hosts is at the end of a move: counted once,
        // where it was seen first (the core knows its move is in flight).
        if v.state != GuestState::Running || running_on.contains_key(&v.spec.name) {
            continue;
        }
        let Some(d) = v.disks.first() else { continue };
        let Some(disk_site) = inv.site_of_storage(&d.server) else {
            problems.push(format!(
                "{}: its disk is at {}, which no site of the inventory holds; left out",
                v.spec.name, d.server
            ));
            continue;
        };
        let (load, networks) = match &rates {
            Some((r, _)) => load_from_prometheus(r, &v.spec.name, &mut problems),
            None => {
                let earlier = first
                    .iter()
                    .find(|x| &x.control == control && x.vm.spec.name == v.spec.name)
                    .map(|x| &x.vm);
                (
                    load_between(earlier, v, d, dt),
                    nic_rates_between(earlier, v, dt),
                )
            }
        };
        let (memory_bytes, disk_bytes) = (memory_to_send(v), volume_size(control, &d.volume));
        running_on.insert(v.spec.name.clone(), control.clone());
        let disk = volume_holdings(inv, &d.server, &d.volume, &mut problems, holdings);
        for (s, nbd) in &disk.best {
            storage_for.insert((v.spec.name.clone(), s.clone()), nbd.clone());
        }
        disk_server.insert(v.spec.name.clone(), d.server.clone());
        vms.push(VmState {
            name: v.spec.name.clone(),
            placement: Placement {
                host_site: site.clone(),
                disk_site: disk_site.name.clone(),
            },
            memory_bytes,
            disk_bytes,
            missing_at: disk.missing_at(disk_bytes),
            missing_link_at: disk.missing_link_at(disk_bytes),
            copy_at: disk.copy_at.clone(),
            shares_extents_at: disk.shares_extents_at.clone(),
            rebuild_bps_at: disk.rebuild_bps_at.clone(),
            printed_at: disk.printed_at(disk_bytes),
            nonzero_share: disk.nonzero,
            disk_link_share: disk.link_share,
            memory_link_share: v.memory_link_share,
            memory_stream_bps: v.memory_stream_bps.filter(|b| b.is_finite() && *b > 0.0),
            memory_move_setup_s: v.memory_move_setup_s.filter(|s| s.is_finite() && *s >= 0.0),
            memory_link_efficiency: v.memory_link_efficiency.filter(|e| is_share(*e)),
            vm_move_pauses: usable_pauses(&v.vm_move_pauses),
            teleport_pauses: usable_pauses(&v.teleport_pauses),
            disk_switch_hold_s: disk.switch_hold_s,
            disk_switch_holds_s: disk.switch_holds_s.clone(),
            disk_move_setups_s: disk.move_setups_s.clone(),
            disk_move_host_s: usable_seconds(&v.disk_move_host_s),
            accel: v.accel.clone(),
            home_site: None,
            load,
            clients: client_traffic(inv, &networks),
            host: Some(control.clone()),
            since_move_s: since_move_s
                .get(&v.spec.name)
                .copied()
                .unwrap_or(f64::INFINITY),
        });
    }
    Measured {
        loads_from,
        cluster: Cluster {
            sites: inv.sites(),
            links: links_as_probed(inv, &links),
            vms,
            local_rtt_ms: 0.1,
            hosts: inv.hosts(),
            link_index: std::sync::OnceLock::default(),
        },
        running_on,
        storage_for,
        disk_server,
        problems,
        links,
    }
}

impl Measured {
    /// The storage daemon (its NBD address) of `site` a disk move of `vm`
    /// goes to: the one whose index holds most of the disk, as sampled;
    /// else the one serving the fewest of the measured guests' disks, so
    /// disks spread over every daemon the site lists.
    pub fn storage_for(&self, inv: &Inventory, vm: &str, site: &str) -> Option<String> {
        if let Some(nbd) = self.storage_for.get(&(vm.to_string(), site.to_string())) {
            return Some(nbd.clone());
        }
        let s = inv.site(site)?;
        s.storage
            .iter()
            .min_by_key(|st| self.disk_server.values().filter(|a| st.serves(a)).count())
            .map(|st| st.nbd.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::act::MoveOutcome;
    use ferry_placement::policy::Action;

    fn outcome(action: Action, from: &str, to: &str, bytes: f64, seconds: f64) -> MoveOutcome {
        MoveOutcome {
            vm: "g".into(),
            action,
            to_host_site: to.into(),
            to_disk_site: to.into(),
            to_host: None,
            from_host_site: from.into(),
            from_disk_site: from.into(),
            result: "completed".into(),
            seconds,
            predicted_seconds: 1.0,
            bytes,
            predicted_bytes: 1.0,
            guest_pause_ms: None,
            memory_setup_s: None,
            memory_bytes: None,
            memory_link_efficiency: None,
            reason: None,
            burst_from: None,
        }
    }

    /// 8 blocks sampled, 2 zero; of the 6 others, one of text (400 bytes
    /// compressed), the rest noise (4096).
    fn eight_blocks(volume_size: u64) -> ferry_api::VolumeSample {
        ferry_api::VolumeSample {
            block_size: 4096,
            volume_size,
            sampled: 8,
            zero: 2,
            fingerprints: vec!["00".repeat(32); 6],
            nonzero_compressed: 6 * 4096,
            compressed: vec![4096, 400, 4096, 4096, 4096, 4096],
            uuid: None,
            since_arrival: None,
            switch_hold_s: None,
            switch_holds_s: Vec::new(),
            move_setups_s: Vec::new(),
        }
    }

    #[test]
    fn what_a_site_lacks_costs_its_blocks_as_the_stream_compresses_them() {
        // The site lacks two: the text block and one of noise.
        let sample = eight_blocks(8 * 4096);
        let share = missing_link_share(&sample, &[1, 2]).unwrap();
        assert!((share - 4496.0 / (8.0 * 4096.0)).abs() < 1e-12, "{share}");
        assert_eq!(missing_link_share(&sample, &[]), Some(0.0));
        // Positions past the sample count nothing.
        assert_eq!(missing_link_share(&sample, &[99]), Some(0.0));
        // Without per-block sizes (an older daemon): unknown.
        let old = ferry_api::VolumeSample {
            compressed: Vec::new(),
            ..sample
        };
        assert_eq!(missing_link_share(&old, &[1]), None);
    }

    #[test]
    fn a_tracked_return_is_priced_from_the_blocks_written_since() {
        // A 64-block volume of which 8 blocks were written since it
        // arrived, all sampled: 2 zero, 6 printed; the destination lacks
        // two of them, costing 4096 and 400 bytes on the link.
        let written = eight_blocks(0);
        let since = ferry_api::WrittenSinceArrival {
            arrived_under: "1".repeat(32),
            blocks: 8,
            sample: written,
        };
        let volume = ferry_api::VolumeSample {
            volume_size: 64 * 4096,
            since_arrival: Some(Box::new(since.clone())),
            ..since.sample.clone()
        };
        let answer = ferry_api::LookupAnswer {
            asked: 6,
            found: 4,
            missing: Some(vec![0, 1]),
            holds_copy: false,
            copy_tracked: false,
            shares_extents: false,
            rebuild_bps: None,
        };
        let t = tracked_cost(&volume, &since, Some(&answer));
        let size = 64.0 * 4096.0;
        assert!((t.printed - 6.0 * 4096.0 / size).abs() < 1e-12, "{t:?}");
        assert!((t.missing - 2.0 * 4096.0 / size).abs() < 1e-12, "{t:?}");
        assert!((t.missing_link - 4496.0 / size).abs() < 1e-12, "{t:?}");
        // Nothing written since: nothing to print or send.
        let none = ferry_api::WrittenSinceArrival {
            blocks: 0,
            sample: ferry_api::VolumeSample {
                sampled: 0,
                zero: 0,
                fingerprints: Vec::new(),
                compressed: Vec::new(),
                ..since.sample.clone()
            },
            ..since.clone()
        };
        let t = tracked_cost(&volume, &none, None);
        assert!(t.printed == 0.0 && t.missing == 0.0 && t.missing_link == 0.0);
    }

    /// A running guest as its host shows it, with `writes` disk bytes
    /// written so far and QEMU's dirty rate `dirty` if measured.
    fn view(writes: u64, dirty: Option<u64>) -> (VmView, DiskIo) {
        let v: VmView = serde_json::from_value(serde_json::json!({
            "spec": {"name": "g", "memory_mib": 256, "vcpus": 1, "disks": [],
                     "boot": {"kind": "disk"}},
            "state": "running", "accel": "tcg", "pid": 1, "qemu_status": "running",
            "cpu_time_s": 1.0, "disks": [], "serial_log": "/s", "moving": null,
            "memory_dirty": dirty.map(|b| serde_json::json!({
                "bytes_per_s": b, "measured_unix_ms": 1})),
        }))
        .unwrap();
        let d = DiskIo {
            writes: writes / 4096,
            write_bytes: writes,
            ..Default::default()
        };
        (v, d)
    }

    #[test]
    fn a_disk_goes_to_the_daemon_holding_most_of_it_else_to_the_least_used() {
        use ferry_placement::inventory::{SiteInventory, StorageRef};
        let storage = |n: &str| StorageRef {
            nbd: format!("{n}:10809"),
            nbd_local: None,
            migrate: format!("{n}:7000"),
            admin: format!("{n}:8000"),
            cluster: None,
        };
        let inv = Inventory {
            sites: vec![SiteInventory {
                name: "b".into(),
                cpu_capacity: 8.0,
                hosts: vec![],
                storage: vec![storage("s1"), storage("s2")],
                clients: Vec::new(),
            }],
            links: vec![],
        };
        let mut m = Measured {
            loads_from: "hosts".into(),
            cluster: crate::measure::tests::empty_cluster(),
            running_on: BTreeMap::new(),
            storage_for: BTreeMap::new(),
            disk_server: BTreeMap::new(),
            problems: vec![],
            links: vec![],
        };
        // s1 serves two disks, s2 none: a new disk goes to s2.
        m.disk_server.insert("x".into(), "s1:10809".into());
        m.disk_server.insert("y".into(), "s1:10809".into());
        assert_eq!(m.storage_for(&inv, "web", "b").as_deref(), Some("s2:10809"));
        // The daemon whose index holds most of the disk wins.
        m.storage_for
            .insert(("web".into(), "b".into()), "s1:10809".into());
        assert_eq!(m.storage_for(&inv, "web", "b").as_deref(), Some("s1:10809"));
        assert_eq!(m.storage_for(&inv, "web", "nowhere"), None);
    }

    #[test]
    fn a_guests_traffic_counts_with_the_site_of_its_networks_clients() {
        use ferry_placement::inventory::SiteInventory;
        let site = |n: &str, clients: &[&str]| SiteInventory {
            name: n.into(),
            cpu_capacity: 8.0,
            hosts: vec![],
            storage: vec![],
            clients: clients.iter().map(ToString::to_string).collect(),
        };
        let inv = Inventory {
            sites: vec![site("home", &["lan"]), site("cloud", &[])],
            links: vec![],
        };
        let nic = |net: &str, mac: &str, to: u64, from: u64, bytes: u64| {
            serde_json::json!({"network": net, "mac": mac, "tap": "t", "bridge": "br",
                "to_guest_packets": to, "from_guest_packets": from,
                "to_guest_bytes": bytes, "from_guest_bytes": bytes})
        };
        let reading = |nics: serde_json::Value| -> VmView {
            let (mut v, _) = view(0, None);
            v.nics = serde_json::from_value(nics).unwrap();
            v
        };
        let before = reading(serde_json::json!([
            nic("lan", "52:54:00:00:00:01", 1000, 900, 10_000),
            nic("backup", "52:54:00:00:00:02", 0, 0, 0),
        ]));
        // 2 s later: 400 packets in and 300 out on lan (150 exchanges a
        // second), and a bulk copy on a network with no clients placed.
        let after = reading(serde_json::json!([
            nic("lan", "52:54:00:00:00:01", 1400, 1200, 30_000),
            nic("backup", "52:54:00:00:00:02", 90_000, 9_000, 100_000_000),
        ]));
        let rates = nic_rates_between(Some(&before), &after, 2.0);
        assert_eq!(rates["lan"].to_guest_packets, 200.0);
        let t = client_traffic(&inv, &rates);
        assert_eq!(t.len(), 1, "{t:?}");
        assert_eq!(t[0].site, "home");
        assert_eq!(t[0].exchanges_per_s, 150.0);
        assert_eq!(t[0].bytes_per_s, 20_000.0);
        // A card whose counters went back (QEMU restarted) counts from 0;
        // one the first reading lacked likewise.
        let restarted = reading(serde_json::json!([nic(
            "lan",
            "52:54:00:00:00:01",
            10,
            8,
            100
        )]));
        let r = nic_rates_between(Some(&before), &restarted, 2.0);
        assert_eq!(
            (r["lan"].to_guest_packets, r["lan"].from_guest_packets),
            (5.0, 4.0)
        );
        assert_eq!(nic_rates_between(None, &restarted, 2.0), r);
        // Quiet cards are no clients.
        assert!(client_traffic(&inv, &nic_rates_between(Some(&before), &before, 2.0)).is_empty());
    }

    pub(super) fn empty_cluster() -> Cluster {
        Cluster {
            sites: vec![],
            links: vec![],
            vms: vec![],
            hosts: vec![],
            local_rtt_ms: 0.1,
            link_index: Default::default(),
        }
    }

    #[test]
    fn the_dirty_rate_is_qemus_once_measured_else_the_disk_write_rate() {
        let (before, _) = view(0, None);
        // 8 MB written in 2 s, no QEMU figure yet: the write rate stands in.
        let (now, d) = view(8_000_000, None);
        let l = load_between(Some(&before), &now, &d, 2.0);
        assert!((l.dirty_rate - 4e6).abs() < 1.0, "{l:?}");
        assert!((l.write_rate - 4e6).abs() < 1.0, "{l:?}");
        // QEMU says 3 MiB/s: that, whatever the disk does.
        let (now, d) = view(8_000_000, Some(3 << 20));
        let l = load_between(Some(&before), &now, &d, 2.0);
        assert!((l.dirty_rate - 3_145_728.0).abs() < 1.0, "{l:?}");
        assert!((l.write_rate - 4e6).abs() < 1.0, "{l:?}");
        // QEMU measured nothing dirtied: zero, not the write rate.
        let (now, d) = view(8_000_000, Some(0));
        assert!(load_between(Some(&before), &now, &d, 2.0).dirty_rate.abs() < 1e-9);
    }

    #[test]
    fn a_burst_guest_belongs_home_until_it_is_back() {
        let mut burst = outcome(Action::MoveVm, "home", "cloud", 1e6, 1.0);
        burst.burst_from = Some("home".into());
        let mut failed_back = outcome(Action::MoveVm, "cloud", "home", 1e6, 1.0);
        failed_back.result = "failed".into();
        let on = outcome(Action::MoveVm, "cloud", "cloud2", 1e6, 1.0);
        let h = burst_homes([&burst, &failed_back, &on].into_iter());
        assert_eq!(h.get("g").map(String::as_str), Some("home"));
        let back = outcome(Action::MoveVm, "cloud2", "home", 1e6, 1.0);
        assert!(burst_homes([&burst, &on, &back].into_iter()).is_empty());
    }

    #[test]
    fn completed_moves_give_each_link_its_achieved_bandwidth() {
        let mut failed = outcome(Action::MoveVm, "a", "b", 50e6, 1.0);
        failed.result = "failed".into();
        let moves = [
            outcome(Action::MoveVm, "a", "b", 40e6, 4.0),
            // The other way counts for the same link; smoothed 50/50.
            outcome(Action::Teleport, "b", "a", 60e6, 3.0),
            // Too small to say anything, a failure, and one within a site.
            outcome(Action::MoveDisk, "a", "c", 0.5e6, 0.1),
            failed,
            outcome(Action::MoveVm, "c", "c", 50e6, 1.0),
        ];
        let bw = bandwidth_from_moves(moves.iter());
        assert_eq!(bw.len(), 1, "{bw:?}");
        let (rate, n) = bw[&("a".to_string(), "b".to_string())];
        assert_eq!(n, 2);
        // 40 MB in 4 s less the VM move's set-up; 60 MB in 3 s less both
        // set-ups and the destination's check (a teleport); smoothed 50/50.
        let vm = 40e6 / (4.0 - VM_MOVE_SETUP_S);
        let teleport = 60e6 / (3.0 - TELEPORT_CHECK_S - VM_MOVE_SETUP_S - DISK_MOVE_SETUP_S);
        assert!((rate - (vm + teleport) / 2.0).abs() < 1.0, "{rate}");
        // A move whose host measured its own set-up has that taken out,
        // not the constant.
        let mut measured = outcome(Action::MoveVm, "a", "b", 40e6, 4.0);
        measured.memory_setup_s = Some(1.0);
        let bw = bandwidth_from_moves([&measured].into_iter());
        let (rate, _) = bw[&("a".to_string(), "b".to_string())];
        assert!((rate - 40e6 / 3.0).abs() < 1.0, "{rate}");
        // One whose memory stream kept the link 80% busy: the link carried
        // its memory bytes at 1/0.8 of the rate the move achieved (the
        // model applies the 80% again), its disk's at the move's.
        measured.action = Action::Teleport;
        measured.bytes = 50e6;
        measured.memory_bytes = Some(40e6);
        measured.memory_link_efficiency = Some(0.8);
        let bw = bandwidth_from_moves([&measured].into_iter());
        let (rate, _) = bw[&("a".to_string(), "b".to_string())];
        let want = (10e6 + 40e6 / 0.8) / (4.0 - TELEPORT_CHECK_S - 1.0 - DISK_MOVE_SETUP_S);
        assert!((rate - want).abs() < 1.0, "{rate} {want}");
    }
}
