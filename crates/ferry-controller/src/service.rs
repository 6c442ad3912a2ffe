//! `ferry control run`: one thread runs the cycles (measure, plan,
//! journal, act); an HTTP server answers the API, `/metrics` and the live
//! page at `/`.

use crate::act::{follow, start, MoveOutcome};
use crate::etcd::EtcdClient;
use crate::journal::{Entry, Event, Journal};
use crate::leader::Leadership;
use crate::measure::{measure, Measured};
use crate::settings::Settings;
use crate::store::Store;
use crate::ControllerError;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use ferry_api::{AdminClient, MigrationId};
use ferry_placement::cycle::{drive, ControllerCore, Ended, JournalSink, World};
use ferry_placement::inventory::SiteInventory;
use ferry_placement::model::MoveCost;
use ferry_placement::policy::{Decision, Plan, Policy};
use ferry_placement::{Cluster, Placement};
use parking_lot::{Condvar, Mutex};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Options {
    pub listen: String,
    /// The state's home when alone (no `etcd`).
    pub state_dir: PathBuf,
    /// With endpoints, the state lives in etcd and the controllers that
    /// share it elect one leader.
    pub etcd: Option<EtcdOptions>,
    /// Between the starts of two cycles.
    pub interval: Duration,
    /// Between the two readings of a measurement.
    pub sample: Duration,
    /// Where the guests' loads come from (the hosts, or Prometheus).
    pub loads: crate::measure::LoadSource,
    /// Replaces the saved settings when given.
    pub initial: Option<Settings>,
    /// This controller's TLS identity: its API beyond loopback, and its
    /// calls to hosts and storage daemons beyond loopback.
    pub identity: Option<ferry_trust::CertStore>,
    /// Serve the API in plaintext, unauthenticated, beyond loopback.
    pub insecure_plaintext_api: bool,
}

/// Who besides an operator may call each route of the controller's API:
/// anyone pinned reads (status, journal, settings, the page, metrics);
/// only an operator changes anything.
pub const ACCESS: ferry_trust::api::Access = ferry_trust::api::operator_writes;

pub struct EtcdOptions {
    pub endpoints: Vec<String>,
    /// Keys start with this (ends in `/`).
    pub prefix: String,
    /// This controller's name among those sharing the state.
    pub name: String,
    /// The leader's lease.
    pub lease: Duration,
    /// TLS for `https://` endpoints (CA roots and this controller's
    /// client certificate).
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl EtcdOptions {
    /// A client of these endpoints.
    pub fn client(&self) -> Result<EtcdClient, ControllerError> {
        EtcdClient::with_tls(&self.endpoints, Duration::from_secs(5), self.tls.clone())
            .map_err(|x| ControllerError::BadInput(x.to_string()))
    }
}

/// What the last cycle saw and decided.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Status {
    /// `alone` (state in a directory), `leader` or `follower` (etcd).
    pub role: String,
    /// This controller's name, and the leader's (etcd).
    pub name: Option<String>,
    pub leader: Option<String>,
    pub cycle: u64,
    pub paused: bool,
    pub last_cycle_unix: Option<f64>,
    pub last_cycle_s: f64,
    pub cluster: Option<Cluster>,
    pub plan: Option<Plan>,
    pub problems: Vec<String>,
    pub in_flight: Vec<MoveOutcome>,
    /// Each declared link's RTT, declared and probed.
    pub links: Vec<crate::measure::LinkMeasure>,
    /// Where the last cycle's guest loads came from (`hosts`, or
    /// `prometheus URL (window W)`).
    pub loads_from: Option<String>,
    /// Moves held back because they failed twice or more in a row
    /// (`backoff`).
    pub held_back: Vec<ferry_placement::backoff::HeldMove>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabel {
    action: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MoveLabel {
    action: String,
    result: String,
}

struct Metrics {
    registry: Registry,
    cycles: Counter,
    decisions: Family<ActionLabel, Counter>,
    moves: Family<MoveLabel, Counter>,
    paused: Gauge,
    problems: Gauge,
    vms: Gauge,
    cycle_seconds: Gauge<f64, AtomicU64>,
}

impl Metrics {
    fn new() -> Metrics {
        let mut registry = Registry::with_prefix("ferry_controller");
        let m = Metrics {
            cycles: Counter::default(),
            decisions: Family::default(),
            moves: Family::default(),
            paused: Gauge::default(),
            problems: Gauge::default(),
            vms: Gauge::default(),
            cycle_seconds: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register("cycles", "Decision cycles run", m.cycles.clone());
        registry.register(
            "decisions",
            "Moves decided by the policies, by action",
            m.decisions.clone(),
        );
        registry.register(
            "moves",
            "Moves carried out, by action and result",
            m.moves.clone(),
        );
        registry.register("paused", "1 when automation is paused", m.paused.clone());
        registry.register(
            "problems",
            "Things the last cycle could not measure or do",
            m.problems.clone(),
        );
        registry.register(
            "vms",
            "Running guests measured by the last cycle",
            m.vms.clone(),
        );
        registry.register(
            "last_cycle_seconds",
            "How long the last cycle took (measuring included)",
            m.cycle_seconds.clone(),
        );
        Metrics { registry, ..m }
    }
}

struct Shared {
    settings: Mutex<Settings>,
    store: Arc<Store>,
    journal: Journal,
    status: Mutex<Status>,
    metrics: Metrics,
    wake: (Mutex<bool>, Condvar),
    /// The controller's clock for its core: seconds since it started.
    born: Instant,
    /// Moves ended since the cycles last asked.
    ended: Mutex<Vec<Ended>>,
    /// Moves being followed: guest -> (move id, its host's control API).
    running: Mutex<BTreeMap<String, (MigrationId, String)>>,
    /// Cycles asked to act once (`plan --apply`) and those run since.
    applies: (Mutex<Applies>, Condvar),
}

#[derive(Default)]
struct Applies {
    asked: u64,
    done: u64,
    last: Option<Applied>,
}

/// What a cycle run at the operator's request (`POST /v1/apply`) did:
/// its number (its decisions and moves are journaled under it), its plan
/// and what it could not measure.
#[derive(Debug, Clone, Serialize)]
pub struct Applied {
    pub cycle: u64,
    pub plan: Option<Plan>,
    pub problems: Vec<String>,
}

/// How long `POST /v1/apply` waits for the cycle it asked for.
const APPLY_WAIT: Duration = Duration::from_secs(300);

impl Shared {
    /// Journal `event`; false when it could not be made durable (then
    /// nothing that depends on it may be done).
    fn record(&self, event: Event) -> bool {
        let cycle = self.status.lock().cycle;
        match self.journal.record(cycle, event) {
            Ok(_) => true,
            Err(e) => {
                tracing::error!("journal: {e}");
                false
            }
        }
    }

    /// Settings read back from the shared store, shown and used as they are.
    fn use_settings(&self, s: Settings) {
        self.metrics.paused.set(i64::from(s.policy.paused));
        self.status.lock().paused = s.policy.paused;
        *self.settings.lock() = s;
    }

    fn wake(&self) {
        let (m, cv) = &self.wake;
        *m.lock() = true;
        cv.notify_all();
    }

    /// Change the settings all-or-nothing: validated, saved, then used.
    fn change(
        &self,
        what: String,
        f: impl FnOnce(&mut Settings) -> Result<(), ControllerError>,
    ) -> Result<Settings, ControllerError> {
        let mut s = self.settings.lock();
        let mut next = s.clone();
        f(&mut next)?;
        next.validate()?;
        self.store.save_settings(&next)?;
        *s = next.clone();
        drop(s);
        if !next.inventory.sites.is_empty() {
            // Said by the last cycle; the next one (woken below) measures.
            self.status
                .lock()
                .problems
                .retain(|p| !p.starts_with(NO_SITES));
        }
        self.record(Event::Settings { what });
        self.metrics.paused.set(i64::from(next.policy.paused));
        self.wake();
        Ok(next)
    }
}

const NO_SITES: &str = "no sites yet";

fn now_unix() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// A move ended: report it to the cycles, count it and journal it.
fn finish(sh: &Shared, id: &str, outcome: MoveOutcome) {
    sh.ended.lock().push(Ended {
        vm: outcome.vm.clone(),
        completed: outcome.completed(),
        reason: outcome.reason.clone(),
        at_s: sh.born.elapsed().as_secs_f64(),
    });
    journal_end(sh, id, outcome);
}

/// Count a move's end (or its failure to start), log it and journal it.
fn journal_end(sh: &Shared, id: &str, outcome: MoveOutcome) {
    sh.metrics
        .moves
        .get_or_create(&MoveLabel {
            action: format!("{:?}", outcome.action),
            result: outcome.result.clone(),
        })
        .inc();
    tracing::info!("{}", outcome.line());
    sh.record(Event::Finished {
        id: id.into(),
        outcome,
    });
}

/// Follow move `id` of a guest run by the host at `control` on a thread
/// of its own, shown in flight meanwhile; its end is journaled and
/// reported to the cycles, which are woken to plan the next moves.
fn follow_on_its_own(sh: &Arc<Shared>, id: MigrationId, control: String, expect: MoveOutcome) {
    let vm = expect.vm.clone();
    sh.status.lock().in_flight.push(expect.clone());
    sh.running
        .lock()
        .insert(vm.clone(), (id.clone(), control.clone()));
    let worker = sh.clone();
    let spawned = std::thread::Builder::new()
        .name(format!("move-{vm}"))
        .spawn(move || {
            let out = follow(&control, &id, expect);
            worker.running.lock().remove(&vm);
            worker.status.lock().in_flight.retain(|x| x.vm != vm);
            finish(&worker, id.as_str(), out);
            worker.wake();
        });
    if let Err(e) = spawned {
        tracing::error!("cannot follow a move: {e}");
    }
}

/// The decision a journaled move stood for, for a controller that adopts
/// it after a restart or a change of leader.
fn decision_of(o: &MoveOutcome) -> Decision {
    let at = |h: &str, d: &str| Placement {
        host_site: h.into(),
        disk_site: d.into(),
    };
    Decision {
        vm: o.vm.clone(),
        action: o.action,
        from: at(&o.from_host_site, &o.from_disk_site),
        to: at(&o.to_host_site, &o.to_disk_site),
        to_host: o.to_host.clone(),
        lost_here_s: 0.0,
        lost_there_s: 0.0,
        cost: MoveCost {
            seconds: o.predicted_seconds,
            bytes: o.predicted_bytes,
            pause_s: 0.0,
            lost_s: 0.0,
            converges: true,
        },
        reason: "started before this controller took over".into(),
        forced: false,
        burst_from: o.burst_from.clone(),
    }
}

/// Moves a previous run (or leader) started and never saw end: each
/// followed on its own and counted by the core as in flight.
fn follow_unfinished(sh: &Arc<Shared>, core: &mut ControllerCore) {
    for (id, control, expect) in sh.journal.unfinished() {
        tracing::info!(
            "following move {id} of {} started before this controller took over",
            expect.vm
        );
        match id.parse::<MigrationId>() {
            Ok(mid) => {
                core.adopt(decision_of(&expect), sh.born.elapsed().as_secs_f64());
                // A controller that leads again while its own thread still
                // follows the move does not follow it twice.
                let followed = sh
                    .running
                    .lock()
                    .get(&expect.vm)
                    .is_some_and(|(i, _)| *i == mid);
                if !followed {
                    follow_on_its_own(sh, mid, control, expect);
                }
            }
            Err(e) => {
                let out = MoveOutcome {
                    result: "failed".into(),
                    reason: Some(format!("the journal names move {id:?}: {e}")),
                    ..expect
                };
                finish(sh, &id, out);
            }
        }
    }
}

/// What the cycles remember from one to the next besides the core.
#[derive(Default)]
struct Memory {
    core: ControllerCore,
    /// What each site holds of each disk, sampled every few minutes.
    holdings: crate::measure::HoldingsCache,
    /// Each link's probed bandwidth, probed every few minutes.
    bandwidth: crate::measure::BandwidthCache,
}

/// The real sites as the core's world: guests measured through their
/// hosts, moves asked of the guest's host and followed each on a thread of
/// its own.
struct Hosts<'a> {
    sh: &'a Arc<Shared>,
    settings: &'a Settings,
    cadence: &'a Cadence,
    holdings: &'a mut crate::measure::HoldingsCache,
    bandwidth: &'a mut crate::measure::BandwidthCache,
    /// The last measurement, kept for the status.
    measured: Option<Measured>,
}

impl World for Hosts<'_> {
    fn measure(&mut self, _now: f64) -> Result<Cluster, String> {
        let mut m = measure(
            &self.settings.inventory,
            self.cadence.sample,
            &self.cadence.loads,
            &BTreeMap::new(),
            self.holdings,
            self.bandwidth,
        );
        learn_from_moves(self.sh, &mut m);
        let c = m.cluster.clone();
        self.measured = Some(m);
        Ok(c)
    }

    fn start(&mut self, d: &Decision, _now: f64) -> Result<(), String> {
        let m = self.measured.as_ref().ok_or("not measured")?;
        let Some(control) = m.running_on.get(&d.vm).cloned() else {
            return Err(format!("{} runs on no host the controller reads", d.vm));
        };
        let storage = m.storage_for(&self.settings.inventory, &d.vm, &d.to.disk_site);
        match start(&self.settings.inventory, &control, d, storage.as_deref()) {
            Ok((id, expect)) => {
                self.sh.record(Event::Started {
                    vm: d.vm.clone(),
                    id: id.to_string(),
                    control: control.clone(),
                    expect: expect.clone(),
                });
                follow_on_its_own(self.sh, id, control, expect);
                Ok(())
            }
            Err(out) => {
                // The core learns of it from this answer, not from the
                // cycles' list of ended moves.
                let why = out.reason.clone().unwrap_or_default();
                journal_end(self.sh, "", *out);
                Err(why)
            }
        }
    }

    fn cancel(&mut self, vm: &str, why: &str) {
        let Some((id, control)) = self.sh.running.lock().get(vm).cloned() else {
            return;
        };
        let what = match AdminClient::for_host(&control)
            .limited(crate::measure::HOST_CALL_LIMIT)
            .cancel_vm_move(&id)
        {
            Ok(_) => format!("cancelled move {id} of {vm}: {why}"),
            Err(e) => format!("cannot cancel move {id} of {vm} ({why}): {e}"),
        };
        tracing::warn!("{what}");
        self.sh.record(Event::Problem { what });
    }

    fn ended(&mut self, _now: f64) -> Vec<Ended> {
        std::mem::take(&mut *self.sh.ended.lock())
    }
}

/// The service's journal as the core's: a decision counted and journaled;
/// one to act on only while this controller may act (its lease holds).
struct Decisions<'a>(&'a Shared);

impl JournalSink for Decisions<'_> {
    fn decided(&mut self, d: &Decision, acted: bool) -> bool {
        let sh = self.0;
        sh.metrics
            .decisions
            .get_or_create(&ActionLabel {
                action: format!("{:?}", d.action),
            })
            .inc();
        let journaled = sh.record(crate::journal::decided(d, acted));
        journaled && (!acted || sh.store.may_act())
    }
}

/// One cycle: the core driven over the real sites (measure, plan around
/// the moves in flight, journal, start moves without waiting for them),
/// then the status and metrics of what it saw.
fn cycle(sh: &Arc<Shared>, cadence: &Cadence, mem: &mut Memory, once: bool) {
    let t = Instant::now();
    let mut settings = sh.settings.lock().clone();
    {
        let mut st = sh.status.lock();
        st.cycle += 1;
        st.paused = settings.policy.paused;
    }
    sh.metrics.cycles.inc();
    if settings.inventory.sites.is_empty() {
        let mut st = sh.status.lock();
        st.problems = vec![format!("{NO_SITES}: add one (ferry site add)")];
        st.last_cycle_unix = Some(now_unix());
        return;
    }
    let now = sh.born.elapsed().as_secs_f64();
    let may_act = sh.store.may_act();
    if once && settings.policy.paused {
        // Asked to act once: this cycle acts; automation stays paused.
        settings.policy.paused = false;
        sh.record(Event::Settings {
            what: "this cycle acts once at the operator's request (plan --apply); automation stays paused".into(),
        });
    }
    let mut world = Hosts {
        sh,
        settings: &settings,
        cadence,
        holdings: &mut mem.holdings,
        bandwidth: &mut mem.bandwidth,
        measured: None,
    };
    let planned = drive(
        &mut mem.core,
        &mut world,
        &mut Decisions(sh),
        &settings.policy,
        now,
        may_act,
    );
    let Some(m) = world.measured.take() else {
        return;
    };
    let previous = sh.status.lock().problems.clone();
    for p in m.problems.iter().filter(|p| !previous.contains(p)) {
        sh.record(Event::Problem { what: p.clone() });
    }
    let mut problems = m.problems.clone();
    let pl = match planned {
        Ok(pl) => Some(pl),
        Err(e) => {
            let what = e.to_string();
            if !previous.contains(&what) {
                sh.record(Event::Problem { what: what.clone() });
            }
            problems.push(what);
            None
        }
    };
    sh.metrics
        .problems
        .set(i64::try_from(problems.len()).unwrap_or(i64::MAX));
    sh.metrics
        .vms
        .set(i64::try_from(m.cluster.vms.len()).unwrap_or(i64::MAX));
    let mut st = sh.status.lock();
    st.cluster = Some(m.cluster);
    st.links = m.links;
    st.loads_from = Some(m.loads_from);
    st.plan = pl;
    st.problems = problems;
    st.held_back = mem.core.holding(sh.born.elapsed().as_secs_f64());
    st.last_cycle_unix = Some(now_unix());
    st.last_cycle_s = t.elapsed().as_secs_f64();
    sh.metrics.cycle_seconds.set(st.last_cycle_s);
}

/// What the journal's finished moves teach the measurement: each link's
/// bandwidth is what completed moves achieved, where there were any (else
/// the probe's, else the declared figure), and each burst guest's home.
fn learn_from_moves(sh: &Shared, m: &mut crate::measure::Measured) {
    let outcomes: Vec<MoveOutcome> = sh
        .journal
        .tail(usize::MAX)
        .into_iter()
        .filter_map(|e| match e.event {
            Event::Finished { outcome, .. } => Some(outcome),
            _ => None,
        })
        .collect();
    let achieved = crate::measure::bandwidth_from_moves(outcomes.iter());
    let homes = crate::measure::burst_homes(outcomes.iter());
    for v in &mut m.cluster.vms {
        v.home_site = homes.get(&v.name).cloned();
    }
    for l in &mut m.cluster.links {
        let key = if l.a < l.b {
            (l.a.clone(), l.b.clone())
        } else {
            (l.b.clone(), l.a.clone())
        };
        if let Some((bw, n)) = achieved.get(&key) {
            l.bandwidth = *bw;
            if let Some(lm) = m.links.iter_mut().find(|x| x.a == l.a && x.b == l.b) {
                lm.moves_bandwidth = Some(*bw);
                lm.moves_counted = *n;
            }
        }
    }
}

/// A controller that just became leader: the settings and journal as the
/// one before it left them, then the moves it left unfinished, adopted.
fn take_over(sh: &Arc<Shared>, mem: &mut Memory) -> Result<(), ControllerError> {
    if let Some(s) = sh.store.load_settings()? {
        sh.use_settings(s);
    }
    sh.journal.reload()?;
    sh.status.lock().cycle = sh.journal.last_cycle();
    // A former leader's view of the moves is not this one's.
    mem.core = ControllerCore::default();
    follow_unfinished(sh, &mut mem.core);
    Ok(())
}

/// With etcd: stand for leader; a follower refreshes its view of the
/// shared state. True when this controller leads (always when alone).
fn lead(sh: &Arc<Shared>, leading: &mut bool, mem: &mut Memory) -> bool {
    let Some(l) = sh.store.leadership() else {
        return true;
    };
    let now = match l.campaign() {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!("cannot reach etcd: {e}");
            sh.status.lock().problems = vec![format!("etcd: {e}")];
            false
        }
    };
    if now && !*leading {
        if let Err(e) = take_over(sh, mem) {
            tracing::error!("cannot take over the shared state: {e}");
            l.resign();
            return false;
        }
    }
    *leading = now && l.is_leader();
    let leader = l.leader().ok().flatten();
    {
        let mut st = sh.status.lock();
        st.role = if *leading { "leader" } else { "follower" }.into();
        st.leader = leader;
    }
    if !*leading {
        if let Ok(Some(s)) = sh.store.load_settings() {
            sh.use_settings(s);
        }
        let _ = sh.journal.catch_up();
    }
    *leading
}

/// How often the cycles run and how each measures.
struct Cadence {
    interval: Duration,
    sample: Duration,
    loads: crate::measure::LoadSource,
}

fn cycles(sh: &Arc<Shared>, cadence: &Cadence) {
    let interval = cadence.interval;
    let mut mem = Memory::default();
    if sh.store.leadership().is_none() {
        follow_unfinished(sh, &mut mem.core);
    }
    let mut leading = false;
    loop {
        let t = Instant::now();
        if !lead(sh, &mut leading, &mut mem) {
            // A follower looks again soon: it takes over within a lease.
            let wait = sh
                .store
                .leadership()
                .map_or(interval, |l| l.renew_every().min(interval));
            std::thread::sleep(wait);
            continue;
        }
        let (asked, once) = {
            let a = sh.applies.0.lock();
            (a.asked, a.asked > a.done)
        };
        cycle(sh, cadence, &mut mem, once);
        if once {
            let st = sh.status.lock();
            let mut a = sh.applies.0.lock();
            a.done = asked;
            a.last = Some(Applied {
                cycle: st.cycle,
                plan: st.plan.clone(),
                problems: st.problems.clone(),
            });
            sh.applies.1.notify_all();
        }
        let (m, cv) = &sh.wake;
        let mut woken = m.lock();
        if !*woken {
            let left = interval.saturating_sub(t.elapsed());
            cv.wait_for(&mut woken, left);
        }
        *woken = false;
    }
}

type ApiResult<T> = Result<T, ApiError>;

struct ApiError(ControllerError);

impl From<ControllerError> for ApiError {
    fn from(e: ControllerError) -> Self {
        ApiError(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = match &self.0 {
            ControllerError::BadInput(_) => StatusCode::BAD_REQUEST,
            ControllerError::Conflict(_) => StatusCode::CONFLICT,
            ControllerError::NotFound(_) => StatusCode::NOT_FOUND,
            ControllerError::State(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        (code, Json(serde_json::json!({"error": self.0.to_string()}))).into_response()
    }
}

/// A JSON body that answers 400 `{"error"}` when it does not decode.
fn body<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(b).map_err(|e| ApiError(ControllerError::BadInput(e.to_string())))
}

async fn status(State(sh): State<Arc<Shared>>) -> Json<Status> {
    Json(sh.status.lock().clone())
}

#[derive(Deserialize)]
struct TailQuery {
    limit: Option<usize>,
}

async fn journal(State(sh): State<Arc<Shared>>, Query(q): Query<TailQuery>) -> Json<Vec<Entry>> {
    Json(sh.journal.tail(q.limit.unwrap_or(100)))
}

async fn get_settings(State(sh): State<Arc<Shared>>) -> Json<Settings> {
    Json(sh.settings.lock().clone())
}

async fn put_settings(
    State(sh): State<Arc<Shared>>,
    b: axum::body::Bytes,
) -> ApiResult<Json<Settings>> {
    let new: Settings = body(&b)?;
    let s = tokio::task::block_in_place(|| {
        sh.change("settings replaced".into(), |s| {
            *s = new;
            Ok(())
        })
    })?;
    Ok(Json(s))
}

async fn put_policy(
    State(sh): State<Arc<Shared>>,
    b: axum::body::Bytes,
) -> ApiResult<Json<Settings>> {
    let p: Policy = body(&b)?;
    let s = tokio::task::block_in_place(|| {
        sh.change("policy replaced".into(), |s| {
            s.policy = p;
            Ok(())
        })
    })?;
    Ok(Json(s))
}

async fn add_site(
    State(sh): State<Arc<Shared>>,
    b: axum::body::Bytes,
) -> ApiResult<(StatusCode, Json<Settings>)> {
    let site: SiteInventory = body(&b)?;
    let name = site.name.clone();
    let s = tokio::task::block_in_place(|| {
        sh.change(format!("site {name} added"), |s| s.add_site(site))
    })?;
    Ok((StatusCode::CREATED, Json(s)))
}

async fn replace_site(
    State(sh): State<Arc<Shared>>,
    UrlPath(name): UrlPath<String>,
    b: axum::body::Bytes,
) -> ApiResult<Json<Settings>> {
    let site: SiteInventory = body(&b)?;
    if site.name != name {
        return Err(ControllerError::BadInput(format!(
            "the body describes site {}, the path names {name}",
            site.name
        ))
        .into());
    }
    let s = tokio::task::block_in_place(|| {
        sh.change(format!("site {name} replaced"), |s| s.replace_site(site))
    })?;
    Ok(Json(s))
}

async fn remove_site(
    State(sh): State<Arc<Shared>>,
    UrlPath(name): UrlPath<String>,
) -> ApiResult<StatusCode> {
    tokio::task::block_in_place(|| {
        sh.change(format!("site {name} removed"), |s| s.remove_site(&name))
    })?;
    Ok(StatusCode::NO_CONTENT)
}

async fn put_links(
    State(sh): State<Arc<Shared>>,
    b: axum::body::Bytes,
) -> ApiResult<Json<Settings>> {
    let links: Vec<ferry_placement::Link> = body(&b)?;
    let s = tokio::task::block_in_place(|| {
        sh.change("links replaced".into(), |s| {
            s.inventory.links = links;
            Ok(())
        })
    })?;
    Ok(Json(s))
}

async fn set_paused(sh: Arc<Shared>, paused: bool) -> ApiResult<Json<Settings>> {
    let what = if paused {
        "automation paused"
    } else {
        "automation resumed"
    };
    let s = tokio::task::block_in_place(|| {
        sh.change(what.into(), |s| {
            s.policy.paused = paused;
            Ok(())
        })
    })?;
    Ok(Json(s))
}

async fn pause(State(sh): State<Arc<Shared>>) -> ApiResult<Json<Settings>> {
    set_paused(sh, true).await
}

async fn resume(State(sh): State<Arc<Shared>>) -> ApiResult<Json<Settings>> {
    set_paused(sh, false).await
}

/// Run one cycle now that acts even while automation is paused
/// (`ferry control plan --apply`): journaled and fenced like every cycle,
/// so only the leader answers. The answer comes once the cycle has run;
/// the moves it started are followed in the journal.
async fn apply_once(State(sh): State<Arc<Shared>>) -> ApiResult<Json<Applied>> {
    tokio::task::block_in_place(|| sh.store.must_lead())?;
    let want = {
        let mut a = sh.applies.0.lock();
        a.asked += 1;
        a.asked
    };
    sh.wake();
    let waiter = sh.clone();
    let got = tokio::task::spawn_blocking(move || {
        let (m, cv) = &waiter.applies;
        let until = Instant::now() + APPLY_WAIT;
        let mut a = m.lock();
        while a.done < want {
            if cv.wait_until(&mut a, until).timed_out() {
                return None;
            }
        }
        a.last.clone()
    })
    .await
    .map_err(|e| ApiError(ControllerError::State(e.to_string())))?;
    got.map(Json).ok_or_else(|| {
        ApiError(ControllerError::State(format!(
            "no cycle ran within {} s (did this controller lose its lease?)",
            APPLY_WAIT.as_secs()
        )))
    })
}

async fn cycle_now(State(sh): State<Arc<Shared>>) -> StatusCode {
    sh.wake();
    StatusCode::ACCEPTED
}

async fn metrics(State(sh): State<Arc<Shared>>) -> Response {
    let mut text = String::new();
    if prometheus_client::encoding::text::encode(&mut text, &sh.metrics.registry).is_err() {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn page() -> Html<&'static str> {
    Html(include_str!("page.html"))
}

fn router(sh: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/v1/status", get(status))
        .route("/v1/journal", get(journal))
        .route("/v1/settings", get(get_settings).put(put_settings))
        .route("/v1/policy", axum::routing::put(put_policy))
        .route("/v1/sites", post(add_site))
        .route("/v1/sites/:name", delete(remove_site).put(replace_site))
        .route("/v1/links", axum::routing::put(put_links))
        .route("/v1/pause", post(pause))
        .route("/v1/resume", post(resume))
        .route("/v1/cycle", post(cycle_now))
        .route("/v1/apply", post(apply_once))
        .route("/metrics", get(metrics))
        .with_state(sh)
}

/// Run the controller until the process ends.
pub async fn run(opts: Options) -> Result<(), ControllerError> {
    let (store, name) = match &opts.etcd {
        None => (Arc::new(Store::dir(&opts.state_dir)?), None),
        Some(e) => {
            let client = e.client()?;
            let leader = Arc::new(Leadership::new(client.clone(), &e.prefix, &e.name, e.lease));
            (
                Arc::new(Store::etcd(
                    client,
                    &e.prefix,
                    leader,
                    crate::store::JOURNAL_KEEP,
                )),
                Some(e.name.clone()),
            )
        }
    };
    // Settings given at start are written by the leader only: wait to
    // lead for one lease at most. If another leads, the given settings
    // stand only if they are what it holds already (several controllers
    // started from one unit file with the same settings all come up);
    // different ones are refused.
    let mut initial = opts.initial;
    if let (Some(l), Some(given)) = (store.leadership(), &initial) {
        let until = Instant::now() + l.renew_every() * 6;
        while !l
            .campaign()
            .map_err(|e| ControllerError::State(e.to_string()))?
        {
            if Instant::now() > until {
                if store.load_settings()?.as_ref() == Some(given) {
                    tracing::info!("the leader holds the settings given; following it");
                    initial = None;
                    break;
                }
                return Err(ControllerError::Conflict(format!(
                    "settings were given that differ from those of the controller that leads ({}); give them to it",
                    l.leader().ok().flatten().unwrap_or_default()
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let journal = Journal::open(store.clone())?;
    let settings = match (initial, store.load_settings()?) {
        (Some(s), _) => {
            s.validate()?;
            store.save_settings(&s)?;
            journal.record(
                journal.last_cycle(),
                Event::Settings {
                    what: "settings given at start".into(),
                },
            )?;
            s
        }
        (None, Some(s)) => s,
        (None, None) => Settings::default(),
    };
    let metrics = Metrics::new();
    metrics.paused.set(i64::from(settings.policy.paused));
    let sh = Arc::new(Shared {
        status: Mutex::new(Status {
            role: if name.is_some() { "follower" } else { "alone" }.into(),
            name,
            cycle: journal.last_cycle(),
            paused: settings.policy.paused,
            ..Status::default()
        }),
        settings: Mutex::new(settings),
        store: store.clone(),
        journal,
        metrics,
        wake: (Mutex::new(false), Condvar::new()),
        born: Instant::now(),
        ended: Mutex::new(Vec::new()),
        running: Mutex::new(BTreeMap::new()),
        applies: (Mutex::new(Applies::default()), Condvar::new()),
    });
    let listener = tokio::net::TcpListener::bind(&opts.listen)
        .await
        .map_err(|e| ControllerError::BadInput(format!("cannot listen on {}: {e}", opts.listen)))?;
    let sec = ferry_trust::api::ApiSecurity {
        name: "controller API",
        store: opts.identity.clone(),
        insecure_plaintext: opts.insecure_plaintext_api,
        access: ACCESS,
        limits: ferry_trust::api::API_LIMITS,
    };
    // Refuse to start rather than serve plaintext beyond loopback.
    let api = ferry_trust::api::ApiListener::new(listener, sec)
        .map_err(|e| ControllerError::BadInput(e.to_string()))?;
    let worker = sh.clone();
    let cadence = Cadence {
        interval: opts.interval,
        sample: opts.sample,
        loads: opts.loads.clone(),
    };
    std::thread::Builder::new()
        .name("control-cycles".into())
        .spawn(move || cycles(&worker, &cadence))
        .map_err(|e| ControllerError::State(e.to_string()))?;
    if let Some(l) = store.leadership().cloned() {
        // Renewals go on whatever the cycle thread is busy with.
        std::thread::Builder::new()
            .name("control-lease".into())
            .spawn(move || loop {
                std::thread::sleep(l.renew_every());
                if let Err(e) = l.renew() {
                    tracing::warn!("cannot renew the leader's lease: {e}");
                }
            })
            .map_err(|e| ControllerError::State(e.to_string()))?;
    }
    tracing::info!("controller listening on {}", opts.listen);
    ferry_trust::api::serve(api, router(sh), tokio_util::sync::CancellationToken::new()).await;
    Ok(())
}

#[cfg(test)]
mod access_tests {
    use super::ACCESS;
    use axum::http::Method;
    use ferry_trust::Role;

    /// Only an operator changes the controller's settings or state; every
    /// pinned role reads.
    #[test]
    fn only_the_operator_changes_anything() {
        for (m, p) in [
            (Method::PUT, "/v1/settings"),
            (Method::PUT, "/v1/policy"),
            (Method::POST, "/v1/sites"),
            (Method::DELETE, "/v1/sites/a"),
            (Method::PUT, "/v1/links"),
            (Method::POST, "/v1/pause"),
            (Method::POST, "/v1/resume"),
            (Method::POST, "/v1/cycle"),
        ] {
            assert_eq!(ACCESS(&m, p), [Role::Operator], "{m} {p}");
        }
        assert_eq!(ACCESS(&Method::GET, "/v1/status").len(), 5);
    }
}
