//! The host's guest API (`ferry_api::vm` types; paths listed there) and
//! its `/metrics`: per guest the state, CPU time, and the disk I/O its
//! QEMU issued as the forwarder answered it.

use crate::{moves, VmError, VmHost};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferry_api::{
    CreateVm, DiskIo, ErrorBody, LinkProbe, MigrationId, ProbeRequest, VmMigrateRequest,
    VmMoveStatus, VmView,
};
use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

pub struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

impl From<VmError> for ApiError {
    fn from(e: VmError) -> Self {
        let code = match &e {
            VmError::BadSpec(_) => StatusCode::BAD_REQUEST,
            VmError::Exists(_) | VmError::Busy { .. } => StatusCode::CONFLICT,
            VmError::NotFound(_) | VmError::NoMove(_) => StatusCode::NOT_FOUND,
            VmError::Disk { .. }
            | VmError::Peer { .. }
            | VmError::Storage(_)
            | VmError::Stream(_)
            | VmError::MemoryCopy(_) => StatusCode::BAD_GATEWAY,
            VmError::Deadline(_) => StatusCode::GATEWAY_TIMEOUT,
            VmError::Cancelled => StatusCode::CONFLICT,
            VmError::Qemu(_)
            | VmError::Qmp(_)
            | VmError::File { .. }
            | VmError::StateFile(_)
            | VmError::Listen { .. }
            | VmError::Config(_)
            | VmError::Task(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(code, e.to_string())
    }
}

type St = State<Arc<VmHost>>;
type Body<T> = Result<Json<T>, axum::extract::rejection::JsonRejection>;

fn body<T>(b: Body<T>) -> Result<T, ApiError> {
    b.map(|Json(x)| x)
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, e.body_text()))
}

pub fn router(host: Arc<VmHost>) -> Router {
    let r = Router::new();
    // Test builds: tests hold a move at a named point (`crate::fault`).
    #[cfg(feature = "failpoints")]
    let r = r.route("/v1/failpoints/:name", axum::routing::put(set_failpoint));
    r.route("/v1/vms", get(list).post(create))
        .route("/v1/vms/:name", get(show).delete(remove))
        .route("/v1/vms/:name/start", post(start))
        .route("/v1/vms/:name/stop", post(stop))
        .route("/v1/vms/:name/set", post(set))
        .route("/v1/vms/:name/migrate", post(migrate))
        .route("/v1/vm-moves", get(moves_list))
        .route("/v1/vm-moves/:id", get(move_show))
        .route("/v1/vm-moves/:id/cancel", post(move_cancel))
        .route("/v1/probe", post(probe))
        .route("/metrics", get(metrics))
        .with_state(host)
}

#[cfg(feature = "failpoints")]
#[derive(serde::Deserialize)]
struct FailpointBody {
    actions: String,
}

#[cfg(feature = "failpoints")]
async fn set_failpoint(
    Path(name): Path<String>,
    b: Body<FailpointBody>,
) -> Result<StatusCode, ApiError> {
    let f = body(b)?;
    crate::fault::set(&name, &f.actions).map_err(|e| ApiError::from(VmError::BadSpec(e)))?;
    Ok(StatusCode::NO_CONTENT)
}

async fn list(State(h): St) -> Json<Vec<VmView>> {
    Json(h.list().await)
}

async fn create(State(h): St, b: Body<CreateVm>) -> Result<(StatusCode, Json<VmView>), ApiError> {
    let c = body(b)?;
    Ok((StatusCode::CREATED, Json(h.create(c.spec, c.start).await?)))
}

async fn show(State(h): St, Path(name): Path<String>) -> Result<Json<VmView>, ApiError> {
    let g = h.guest(&name)?;
    Ok(Json(h.view(&g).await))
}

async fn start(State(h): St, Path(name): Path<String>) -> Result<Json<VmView>, ApiError> {
    Ok(Json(h.start(&name).await?))
}

async fn set(
    State(h): St,
    Path(name): Path<String>,
    b: Body<ferry_api::UpdateVm>,
) -> Result<Json<VmView>, ApiError> {
    let u = body(b)?;
    Ok(Json(h.update(&name, u).await?))
}

async fn stop(State(h): St, Path(name): Path<String>) -> Result<Json<VmView>, ApiError> {
    Ok(Json(h.stop(&name).await?))
}

async fn remove(State(h): St, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    h.delete(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn migrate(
    State(h): St,
    Path(name): Path<String>,
    b: Body<VmMigrateRequest>,
) -> Result<(StatusCode, Json<VmMoveStatus>), ApiError> {
    let r = body(b)?;
    Ok((StatusCode::ACCEPTED, Json(moves::start(h, &name, r).await?)))
}

/// Round trips to another host: each on a fresh link whose TCP and TLS
/// set-up is not timed, only one `Ping` and its answer.
async fn probe(State(h): St, b: Body<ProbeRequest>) -> Result<Json<LinkProbe>, ApiError> {
    let req = body(b)?;
    if !h.peer_known(&req.to) {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!(
                "{} is not a declared peer of this host (start `ferry host` with --peer {})",
                req.to, req.to
            ),
        ));
    }
    if !(1..=10).contains(&req.count) {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("count must be 1 to 10, not {}", req.count),
        ));
    }
    if req.bandwidth_bytes > crate::peer::SINK_MAX || !(0.1..=10.0).contains(&req.bandwidth_secs) {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!(
                "bandwidth_bytes must be at most {} and bandwidth_secs 0.1 to 10",
                crate::peer::SINK_MAX
            ),
        ));
    }
    let mut out = LinkProbe {
        to: req.to.clone(),
        rtt_ms: Vec::new(),
        min_ms: None,
        errors: Vec::new(),
        bandwidth: None,
    };
    for _ in 0..req.count {
        let link = match crate::tunnel::connect(&h.certs, &req.to).await {
            Ok(l) => l,
            Err(e) => {
                // The caller learns only that no trusted ferry host
                // answered: whether a port is open, closed or another
                // program's is not told (the probe is no port scanner).
                tracing::info!(to = %req.to, error = %e, "link probe found no trusted host");
                out.errors.push(format!(
                    "no trusted ferry host answered at {} (this host's log has the detail)",
                    req.to
                ));
                continue;
            }
        };
        let t = std::time::Instant::now();
        match crate::tunnel::call_on(
            link,
            &req.to,
            &crate::peer::PeerRequest::Ping,
            std::time::Duration::from_secs(5),
        )
        .await
        {
            Ok(_) => out.rtt_ms.push(t.elapsed().as_secs_f64() * 1000.0),
            Err(e) => out.errors.push(e.to_string()),
        }
    }
    out.min_ms = out.rtt_ms.iter().copied().reduce(f64::min);
    if req.bandwidth_bytes > 0 {
        let limit = std::time::Duration::from_secs_f64(req.bandwidth_secs);
        // A link that stops carrying cannot hold the probe (nor this
        // request) longer than its limit plus what is in flight draining.
        let whole = limit + std::time::Duration::from_secs(20);
        match tokio::time::timeout(
            whole,
            bandwidth_probe(&h, &req.to, req.bandwidth_bytes, limit, out.min_ms),
        )
        .await
        {
            Ok(Ok(b)) => out.bandwidth = Some(b),
            Ok(Err(e)) => out.errors.push(format!("bandwidth: {e}")),
            Err(_) => out
                .errors
                .push(format!("bandwidth: no answer within {} s", whole.as_secs())),
        }
    }
    Ok(Json(out))
}

/// Send up to `max` bytes to another host for at most `limit` (then the
/// rest of what is in flight drains), and time it until the other host
/// answers that it read them all. Set-up is not timed; the link's round
/// trip `rtt_ms`, when known, is taken out of the rate ([`steady_rate`]).
async fn bandwidth_probe(
    h: &VmHost,
    to: &str,
    max: u64,
    limit: std::time::Duration,
    rtt_ms: Option<f64>,
) -> Result<ferry_api::BandwidthProbe, crate::VmError> {
    use crate::peer::{encode_line, PeerAnswer, PeerRequest, SINK_FRAME_MAX};
    use tokio::io::AsyncWriteExt;
    let mut link = crate::tunnel::connect(&h.certs, to).await?;
    use crate::{PeerFault, VmError};
    let err = |e| VmError::peer(to, PeerFault::link("bandwidth probe")(e));
    link.write_all(&encode_line(&PeerRequest::Sink))
        .await
        .map_err(err)?;
    // Random bytes: a link that compresses must not look faster.
    let mut frame = vec![0u8; 4 + SINK_FRAME_MAX as usize];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut frame[4..]);
    let t = std::time::Instant::now();
    let mut sent = 0u64;
    while sent < max && t.elapsed() < limit {
        let n =
            u32::try_from((max - sent).min(u64::from(SINK_FRAME_MAX))).unwrap_or(SINK_FRAME_MAX);
        frame[..4].copy_from_slice(&n.to_be_bytes());
        link.write_all(&frame[..4 + n as usize])
            .await
            .map_err(err)?;
        sent += u64::from(n);
    }
    crate::tunnel::send_flushed(&mut link, &0u32.to_be_bytes())
        .await
        .map_err(err)?;
    let (a, _) = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        crate::tunnel::read_message::<PeerAnswer, _>(&mut link),
    )
    .await
    .map_err(|_| VmError::peer(to, PeerFault::Timeout("the bandwidth probe")))?
    .map_err(|f| VmError::peer(to, f))?;
    let seconds = t.elapsed().as_secs_f64().max(1e-6);
    if !a.ok {
        return Err(VmError::peer(
            to,
            PeerFault::Refused(a.error.unwrap_or_else(|| "refused".into())),
        ));
    }
    let bytes = a.received.unwrap_or(0);
    if bytes != sent {
        return Err(VmError::peer(
            to,
            PeerFault::Protocol(format!("sent {sent} bytes, it read {bytes}")),
        ));
    }
    Ok(ferry_api::BandwidthProbe {
        bytes,
        seconds,
        bytes_per_sec: steady_rate(bytes, seconds, rtt_ms.unwrap_or(0.0) / 1000.0),
    })
}

/// The rate a long transfer gets from a probe that sent `bytes` in
/// `seconds`, from its first byte to the answer that they all came. That
/// time holds one round trip `rtt_s` besides the bytes (the last byte's
/// way there, the answer's way back), which a move of hundreds of
/// megabytes pays once, not in proportion: on a 200 ms link a 16 MiB
/// probe at 50 MB/s takes 0.54 s and would say 31 MB/s. At most three
/// quarters of the time are taken out, so that a probe that is mostly
/// round trip (a link much faster than the probe is long) cannot claim
/// more than four times what it saw.
fn steady_rate(bytes: u64, seconds: f64, rtt_s: f64) -> f64 {
    let carrying = (seconds - rtt_s.max(0.0)).max(0.25 * seconds).max(1e-6);
    bytes as f64 / carrying
}

/// This daemon's moves, then those an earlier daemon on this state
/// directory recorded.
async fn moves_list(State(h): St) -> Json<Vec<VmMoveStatus>> {
    let mut out: Vec<VmMoveStatus> = h.moves.lock().values().map(|r| r.status()).collect();
    let past = h.past_moves.lock();
    out.extend(
        past.values()
            .filter(|p| !out.iter().any(|x| x.id == p.id))
            .cloned()
            .collect::<Vec<_>>(),
    );
    // Newest first.
    out.sort_by(|a, b| b.started_unix.total_cmp(&a.started_unix));
    Json(out)
}

fn parse_id(id: &str) -> Result<MigrationId, ApiError> {
    id.parse()
        .map_err(|e| ApiError(StatusCode::BAD_REQUEST, format!("move id {id:?}: {e}")))
}

async fn move_show(State(h): St, Path(id): Path<String>) -> Result<Json<VmMoveStatus>, ApiError> {
    let id = parse_id(&id)?;
    let r = h.moves.lock().get(&id).cloned();
    match r {
        Some(r) => Ok(Json(r.status())),
        None => h
            .past_moves
            .lock()
            .get(&id)
            .cloned()
            .map(Json)
            .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, format!("no move {id}"))),
    }
}

async fn move_cancel(State(h): St, Path(id): Path<String>) -> Result<Json<VmMoveStatus>, ApiError> {
    let id = parse_id(&id)?;
    Ok(Json(moves::cancel(&h, &id)?))
}

/// Labels of a guest's series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GuestLabels {
    vm: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    vm: String,
    state: String,
    accel: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DiskLabels {
    vm: String,
    volume: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DiskOpLabels {
    vm: String,
    volume: String,
    op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DiskDirLabels {
    vm: String,
    volume: String,
    dir: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NicLabels {
    vm: String,
    network: String,
    mac: String,
    dir: String,
}

/// A histogram read off the forwarder's counters at scrape time.
#[derive(Clone, Debug, Default)]
struct ReadHistogram(Arc<parking_lot::Mutex<HistogramFigures>>);

#[derive(Clone, Debug, Default)]
struct HistogramFigures {
    sum: f64,
    count: u64,
    /// `(upper bound, requests in this bucket alone)`; `f64::MAX` is +Inf.
    buckets: Vec<(f64, u64)>,
}

impl ReadHistogram {
    fn set(&self, f: HistogramFigures) {
        *self.0.lock() = f;
    }
}

impl HistogramFigures {
    /// From the API's cumulative `(µs bound, requests at or below)`.
    #[allow(clippy::cast_precision_loss)]
    fn of(d: &DiskIo) -> HistogramFigures {
        let mut before = 0;
        let buckets = d
            .latency_us
            .iter()
            .map(|(le, n)| {
                let bound = if *le == u64::MAX {
                    f64::MAX
                } else {
                    *le as f64 / 1e6
                };
                let here = n.saturating_sub(before);
                before = *n;
                (bound, here)
            })
            .collect();
        HistogramFigures {
            sum: d.latency_sum_us as f64 / 1e6,
            count: before,
            buckets,
        }
    }
}

impl TypedMetric for ReadHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for ReadHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let f = self.0.lock();
        encoder.encode_histogram::<()>(f.sum, f.count, &f.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A counter's name as registered: its series name without `_total`.
fn counter_name(series: &str) -> &str {
    series.strip_suffix("_total").unwrap_or(series)
}

/// Every guest's figures as Prometheus metrics (OpenMetrics text), read
/// at scrape time into a registry of their own (names from
/// [`ferry_api::metrics`]).
pub fn render_metrics(views: &[VmView]) -> String {
    use ferry_api::metrics as names;
    let state: Family<StateLabels, Gauge> = Family::default();
    let cpu: Family<GuestLabels, Counter<f64, AtomicU64>> = Family::default();
    let resident: Family<GuestLabels, Gauge> = Family::default();
    let dirty: Family<GuestLabels, Gauge> = Family::default();
    let link_share: Family<GuestLabels, Gauge<f64, AtomicU64>> = Family::default();
    let requests: Family<DiskOpLabels, Counter> = Family::default();
    let bytes: Family<DiskDirLabels, Counter> = Family::default();
    let errors: Family<DiskLabels, Counter> = Family::default();
    let latency: Family<DiskLabels, ReadHistogram> = Family::default();
    let network: Family<NicLabels, Counter> = Family::default();
    let packets: Family<NicLabels, Counter> = Family::default();
    let gauge = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    for v in views {
        let vm = GuestLabels {
            vm: v.spec.name.clone(),
        };
        state
            .get_or_create(&StateLabels {
                vm: v.spec.name.clone(),
                state: v.state.as_str().into(),
                accel: v.accel.clone().unwrap_or_default(),
            })
            .set(1);
        cpu.get_or_create(&vm).inc_by(v.cpu_time_s);
        if let Some(b) = v.memory_resident_bytes {
            resident.get_or_create(&vm).set(gauge(b));
        }
        if let Some(d) = v.memory_dirty {
            dirty.get_or_create(&vm).set(gauge(d.bytes_per_s));
        }
        if let Some(s) = v.memory_link_share {
            link_share.get_or_create(&vm).set(s);
        }
        for d in &v.disks {
            let (vmn, volume) = (v.spec.name.clone(), d.volume.clone());
            for (op, n) in [
                ("read", d.reads),
                ("write", d.writes),
                ("flush", d.flushes),
                ("other", d.other),
            ] {
                let l = DiskOpLabels {
                    vm: vmn.clone(),
                    volume: volume.clone(),
                    op: op.into(),
                };
                requests.get_or_create(&l).inc_by(n);
            }
            for (dir, n) in [("read", d.read_bytes), ("write", d.write_bytes)] {
                let l = DiskDirLabels {
                    vm: vmn.clone(),
                    volume: volume.clone(),
                    dir: dir.into(),
                };
                bytes.get_or_create(&l).inc_by(n);
            }
            let l = DiskLabels { vm: vmn, volume };
            errors.get_or_create(&l).inc_by(d.errors);
            latency.get_or_create(&l).set(HistogramFigures::of(d));
        }
        for n in &v.nics {
            for (dir, b, p) in [
                ("to_guest", n.to_guest_bytes, n.to_guest_packets),
                ("from_guest", n.from_guest_bytes, n.from_guest_packets),
            ] {
                let l = NicLabels {
                    vm: v.spec.name.clone(),
                    network: n.network.clone(),
                    mac: n.mac.clone(),
                    dir: dir.into(),
                };
                if let Some(b) = b {
                    network.get_or_create(&l).inc_by(b);
                }
                if let Some(p) = p {
                    packets.get_or_create(&l).inc_by(p);
                }
            }
        }
    }
    let mut r = Registry::default();
    r.register(
        names::VM_STATE,
        "Guest state (1 for the current state)",
        state,
    );
    r.register(
        counter_name(names::VM_CPU_SECONDS_TOTAL),
        "CPU time of the guest's QEMU process",
        cpu,
    );
    r.register(
        names::VM_MEMORY_RESIDENT_BYTES,
        "Guest RAM resident in its QEMU process (pages the guest touched)",
        resident,
    );
    r.register(
        names::VM_MEMORY_DIRTY_BYTES_PER_SECOND,
        "Guest RAM dirtied per second, QEMU's latest estimate (calc-dirty-rate)",
        dirty,
    );
    r.register(
        names::VM_MEMORY_LINK_SHARE,
        "Link bytes a memory move would send per resident byte, from a sample of the guest's pages",
        link_share,
    );
    r.register(
        counter_name(names::VM_DISK_REQUESTS_TOTAL),
        "Disk requests of the guest, as the forwarder answered them",
        requests,
    );
    r.register(
        counter_name(names::VM_DISK_BYTES_TOTAL),
        "Disk bytes of the guest",
        bytes,
    );
    r.register(
        counter_name(names::VM_DISK_ERRORS_TOTAL),
        "Disk requests answered with an error",
        errors,
    );
    r.register(
        counter_name(names::VM_NETWORK_BYTES_TOTAL),
        "Bytes through the guest's network card (its tap on the host)",
        network,
    );
    r.register(
        counter_name(names::VM_NETWORK_PACKETS_TOTAL),
        "Packets through the guest's network card (its tap on the host)",
        packets,
    );
    r.register(
        names::VM_DISK_LATENCY_SECONDS,
        "Time from a request's arrival at the forwarder to its answer",
        latency,
    );
    let mut o = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut o, &r) {
        tracing::warn!("cannot encode the metrics: {e}");
    }
    o
}

async fn metrics(State(h): St) -> impl IntoResponse {
    let views = h.list().await;
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        render_metrics(&views),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_api::{Accel, Boot, VmDisk, VmSpec, VmState};

    #[test]
    fn errors_answer_with_the_status_of_where_they_went_wrong() {
        use crate::{PeerFault, QemuFault};
        let code = |e: VmError| ApiError::from(e).0;
        assert_eq!(code(VmError::BadSpec("x".into())), StatusCode::BAD_REQUEST);
        assert_eq!(code(VmError::NotFound("g".into())), StatusCode::NOT_FOUND);
        assert_eq!(
            code(VmError::peer("b:1", PeerFault::Refused("full".into()))),
            StatusCode::BAD_GATEWAY
        );
        assert_eq!(
            code(VmError::Deadline("x".into())),
            StatusCode::GATEWAY_TIMEOUT
        );
        assert_eq!(code(VmError::Cancelled), StatusCode::CONFLICT);
        assert_eq!(
            code(QemuFault::NotRunning.into()),
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }

    #[test]
    fn a_bandwidth_probe_does_not_charge_its_round_trip_to_the_bytes() {
        let mb = 16u64 << 20;
        // 16 MiB at 50 MB/s over a 200 ms round trip: 0.336 s + 0.2 s.
        let r = steady_rate(mb, 0.536, 0.2);
        assert!((r / 50e6 - 1.0).abs() < 0.01, "{r}");
        // On a near link the round trip changes nothing that matters.
        let r = steady_rate(mb, 0.3362, 0.0002);
        assert!((r / 50e6 - 1.0).abs() < 0.01, "{r}");
        // No round trip known: the plain rate.
        assert_eq!(steady_rate(1000, 2.0, 0.0), 500.0);
        // A probe that is mostly round trip claims at most four times
        // what it saw.
        assert_eq!(steady_rate(1000, 1.0, 0.9), 4000.0);
        assert_eq!(steady_rate(1000, 1.0, -1.0), 1000.0);
    }

    #[test]
    fn metrics_name_every_guest_disk_and_series() {
        let v = VmView {
            spec: VmSpec {
                name: "g".into(),
                memory_mib: 64,
                vcpus: 1,
                disks: vec![VmDisk {
                    volume: "v".into(),
                    server: "h:1".into(),
                    admin: None,
                }],
                boot: Boot::Disk,
                accel: Accel::Tcg,
                nics: Vec::new(),
                cloud_init: None,
            },
            state: VmState::Running,
            accel: Some("tcg".into()),
            pid: Some(1),
            qemu_status: Some("running".into()),
            cpu_time_s: 1.5,
            memory_resident_bytes: Some(40 << 20),
            memory_dirty: Some(ferry_api::DirtyRateView {
                bytes_per_s: 2 << 20,
                measured_unix_ms: 1,
            }),
            memory_link_share: Some(0.25),
            memory_stream_bps: None,
            memory_move_setup_s: None,
            memory_link_efficiency: None,
            vm_move_pauses: Vec::new(),
            disk_move_host_s: Vec::new(),
            teleport_pauses: Vec::new(),
            disks: vec![DiskIo {
                volume: "v".into(),
                reads: 3,
                write_bytes: 4096,
                errors: 2,
                latency_us: vec![(50, 1), (u64::MAX, 3)],
                latency_sum_us: 900,
                ..Default::default()
            }],
            nics: vec![ferry_api::NicView {
                network: "lan".into(),
                mac: "52:54:00:00:00:01".into(),
                tap: "ft0".into(),
                bridge: "br".into(),
                overlay: None,
                to_guest_bytes: Some(7),
                from_guest_bytes: Some(9),
                to_guest_packets: Some(2),
                from_guest_packets: Some(3),
            }],
            serial_log: "/s".into(),
            moving: None,
        };
        let m = render_metrics(&[v]);
        for line in [
            "ferry_vm_state{vm=\"g\",state=\"running\",accel=\"tcg\"} 1",
            "ferry_vm_cpu_seconds_total{vm=\"g\"} 1.5",
            "ferry_vm_memory_resident_bytes{vm=\"g\"} 41943040",
            "ferry_vm_memory_dirty_bytes_per_second{vm=\"g\"} 2097152",
            "ferry_vm_memory_link_share{vm=\"g\"} 0.25",
            "# TYPE ferry_vm_disk_requests counter",
            "ferry_vm_disk_requests_total{vm=\"g\",volume=\"v\",op=\"read\"} 3",
            "ferry_vm_disk_requests_total{vm=\"g\",volume=\"v\",op=\"other\"} 0",
            "ferry_vm_disk_bytes_total{vm=\"g\",volume=\"v\",dir=\"write\"} 4096",
            "ferry_vm_network_bytes_total{vm=\"g\",network=\"lan\",mac=\"52:54:00:00:00:01\",dir=\"from_guest\"} 9",
            "ferry_vm_network_packets_total{vm=\"g\",network=\"lan\",mac=\"52:54:00:00:00:01\",dir=\"to_guest\"} 2",
            "ferry_vm_disk_errors_total{vm=\"g\",volume=\"v\"} 2",
            "ferry_vm_disk_latency_seconds_bucket{le=\"0.00005\",vm=\"g\",volume=\"v\"} 1",
            "ferry_vm_disk_latency_seconds_bucket{le=\"+Inf\",vm=\"g\",volume=\"v\"} 3",
            "ferry_vm_disk_latency_seconds_count{vm=\"g\",volume=\"v\"} 3",
            "ferry_vm_disk_latency_seconds_sum{vm=\"g\",volume=\"v\"} 0.0009",
            "# EOF",
        ] {
            assert!(m.lines().any(|l| l == line), "{line} missing from\n{m}");
        }
    }
}
