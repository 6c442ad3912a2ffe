//! Prometheus metrics of the daemon (OpenMetrics text at `/metrics`): per
//! volume and operation counts, bytes, errors, latency and request-size
//! histograms, in-flight depth (the figures seed 004 reads off iostat), and
//! volume gauges refreshed at scrape time.

use ferry_storage::Pool;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A histogram whose `observe` takes no lock (atomic bucket counters), for
/// the per-request path. prometheus-client's own takes a write lock per
/// observation, which showed up as futex and sched_yield time under load.
#[derive(Clone, Debug)]
pub struct Histogram {
    inner: Arc<HistInner>,
}

#[derive(Debug)]
struct HistInner {
    bounds: Vec<f64>,
    /// One counter per bound, then +Inf.
    counts: Vec<AtomicU64>,
    sum_bits: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: impl Iterator<Item = f64>) -> Self {
        let bounds: Vec<f64> = bounds.collect();
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Histogram {
            inner: Arc::new(HistInner {
                bounds,
                counts,
                sum_bits: AtomicU64::new(0f64.to_bits()),
                count: AtomicU64::new(0),
            }),
        }
    }

    pub fn observe(&self, v: f64) {
        let i = self.inner.bounds.partition_point(|b| *b < v);
        self.inner.counts[i].fetch_add(1, Ordering::Relaxed);
        self.inner.count.fetch_add(1, Ordering::Relaxed);
        // Add to the f64 sum kept as bits (a compare-and-swap loop; the
        // std helper for it is renamed between toolchains).
        let sum = &self.inner.sum_bits;
        let mut b = sum.load(Ordering::Relaxed);
        while let Err(now) = sum.compare_exchange_weak(
            b,
            (f64::from_bits(b) + v).to_bits(),
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            b = now;
        }
    }

    pub fn count(&self) -> u64 {
        self.inner.count.load(Ordering::Relaxed)
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let h = &self.inner;
        let buckets: Vec<(f64, u64)> = h
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::MAX))
            .zip(h.counts.iter().map(|c| c.load(Ordering::Relaxed)))
            .collect();
        let count = buckets.iter().map(|b| b.1).sum();
        encoder.encode_histogram::<()>(
            f64::from_bits(h.sum_bits.load(Ordering::Relaxed)),
            count,
            &buckets,
            None,
        )
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub volume: String,
    pub op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VolumeLabels {
    pub volume: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BitmapLabels {
    pub volume: String,
    pub bitmap: String,
}

type HistFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_hist() -> Histogram {
    // 10 us .. ~5 s
    Histogram::new(exponential_buckets(1e-5, 2.0, 20))
}

fn size_hist() -> Histogram {
    // 512 B .. 32 MiB
    Histogram::new(exponential_buckets(512.0, 2.0, 17))
}

/// All metrics of one daemon.
pub struct Metrics {
    registry: Registry,
    pub ops: Family<OpLabels, Counter>,
    pub errors: Family<OpLabels, Counter>,
    pub bytes: Family<OpLabels, Counter>,
    pub latency: HistFamily<OpLabels>,
    pub request_size: HistFamily<OpLabels>,
    pub in_flight: Family<VolumeLabels, Gauge>,
    /// READs whose data the kernel sent from the volume's file.
    pub reads_from_file: Family<VolumeLabels, Counter>,
    pub connections: Gauge,
    /// Connections refused over a connection limit.
    pub connections_refused: Counter,
    volume_size: Family<VolumeLabels, Gauge>,
    volume_allocated: Family<VolumeLabels, Gauge>,
    bitmap_dirty: Family<BitmapLabels, Gauge>,
    index_entries: Gauge,
    index_memory: Gauge,
    index_lookups: Gauge,
    index_hits: Gauge,
    migrations: Family<ResultLabels, Counter>,
    migration_bytes: Family<KindLabels, Counter>,
    migration_chunks: Family<KindLabels, Counter>,
    migration_pause: Histogram,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("ferry");
        let ops = Family::<OpLabels, Counter>::default();
        let errors = Family::<OpLabels, Counter>::default();
        let bytes = Family::<OpLabels, Counter>::default();
        let latency: HistFamily<OpLabels> = Family::new_with_constructor(latency_hist);
        let request_size: HistFamily<OpLabels> = Family::new_with_constructor(size_hist);
        let in_flight = Family::<VolumeLabels, Gauge>::default();
        let reads_from_file = Family::<VolumeLabels, Counter>::default();
        let connections = Gauge::default();
        let connections_refused = Counter::default();
        let volume_size = Family::<VolumeLabels, Gauge>::default();
        let volume_allocated = Family::<VolumeLabels, Gauge>::default();
        let bitmap_dirty = Family::<BitmapLabels, Gauge>::default();
        let (index_entries, index_memory, index_lookups, index_hits) = (
            Gauge::default(),
            Gauge::default(),
            Gauge::default(),
            Gauge::default(),
        );
        registry.register(
            "requests",
            "Requests completed, by volume and operation",
            ops.clone(),
        );
        registry.register(
            "request_errors",
            "Requests answered with an error",
            errors.clone(),
        );
        registry.register("bytes", "Bytes read or written by clients", bytes.clone());
        registry.register(
            "request_latency_seconds",
            "Time from request decoded to reply queued",
            latency.clone(),
        );
        registry.register("request_size_bytes", "Request length", request_size.clone());
        registry.register(
            "in_flight_requests",
            "Requests being served (queue depth seen by the server)",
            in_flight.clone(),
        );
        registry.register(
            "nbd_reads_sent_from_file",
            "NBD READs whose data went from the volume's file, all its pages cached: sent by the kernel (sendfile), or over TLS encrypted from the mapped pages",
            reads_from_file.clone(),
        );
        registry.register(
            "nbd_connections",
            "Open NBD connections",
            connections.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections refused over a connection limit (NBD and iSCSI)",
            connections_refused.clone(),
        );
        registry.register("volume_size_bytes", "Volume size", volume_size.clone());
        registry.register(
            "volume_allocated_bytes",
            "Bytes allocated in the backing file",
            volume_allocated.clone(),
        );
        registry.register(
            "dirty_bitmap_bytes",
            "Bytes marked dirty in a bitmap",
            bitmap_dirty.clone(),
        );
        registry.register(
            "index_entries",
            "Blocks in the fingerprint index",
            index_entries.clone(),
        );
        registry.register(
            "index_memory_bytes",
            "RAM held by the fingerprint index",
            index_memory.clone(),
        );
        registry.register(
            "index_lookups",
            "Fingerprint lookups since start",
            index_lookups.clone(),
        );
        registry.register(
            "index_hits",
            "Fingerprint lookups that found a candidate",
            index_hits.clone(),
        );
        let migrations = Family::<ResultLabels, Counter>::default();
        let migration_bytes = Family::<KindLabels, Counter>::default();
        let migration_chunks = Family::<KindLabels, Counter>::default();
        let migration_pause = latency_hist();
        registry.register(
            "migrations",
            "Outgoing migrations finished, by result",
            migrations.clone(),
        );
        registry.register(
            "migration_bytes",
            "Bytes sent by finished outgoing migrations, by kind",
            migration_bytes.clone(),
        );
        registry.register(
            "migration_chunks",
            "Chunks of finished outgoing migrations, by where the destination got them",
            migration_chunks.clone(),
        );
        registry.register(
            "migration_pause_seconds",
            "Time guest writes were paused at the switch",
            migration_pause.clone(),
        );
        Metrics {
            migrations,
            migration_bytes,
            migration_chunks,
            migration_pause,
            registry,
            ops,
            errors,
            bytes,
            latency,
            request_size,
            in_flight,
            reads_from_file,
            connections,
            connections_refused,
            volume_size,
            volume_allocated,
            bitmap_dirty,
            index_entries,
            index_memory,
            index_lookups,
            index_hits,
        }
    }

    /// Handles for one (volume, op) pair, fetched once per connection so the
    /// data path does not take the family locks.
    pub fn op(&self, volume: &str, op: &str) -> OpMetrics {
        let l = OpLabels {
            volume: volume.into(),
            op: op.into(),
        };
        OpMetrics {
            ops: self.ops.get_or_create(&l).clone(),
            errors: self.errors.get_or_create(&l).clone(),
            bytes: self.bytes.get_or_create(&l).clone(),
            latency: self.latency.get_or_create(&l).clone(),
            size: self.request_size.get_or_create(&l).clone(),
        }
    }

    pub fn reads_from_file(&self, volume: &str) -> Counter {
        self.reads_from_file
            .get_or_create(&VolumeLabels {
                volume: volume.into(),
            })
            .clone()
    }

    pub fn in_flight(&self, volume: &str) -> Gauge {
        self.in_flight
            .get_or_create(&VolumeLabels {
                volume: volume.into(),
            })
            .clone()
    }

    /// Account for a finished outgoing migration.
    pub fn migration_finished(&self, r: &ferry_api::Report) {
        let ok = r.result == ferry_api::MigrationResult::Switched;
        let result = if ok { "switched" } else { "failed" };
        self.migrations
            .get_or_create(&ResultLabels {
                result: result.into(),
            })
            .inc();
        let b = &r.bytes;
        for (kind, n) in [
            ("fingerprints", b.fingerprints),
            ("data", b.data),
            ("protocol", b.protocol),
            ("wire_tx", b.wire_tx),
            ("wire_rx", b.wire_rx),
        ] {
            self.migration_bytes
                .get_or_create(&KindLabels { kind: kind.into() })
                .inc_by(n);
        }
        let c = &r.chunks;
        for (kind, n) in [
            ("zero", c.zero),
            ("local", c.local),
            ("buddy", c.buddy),
            ("resumed", c.resumed),
            ("sent", c.sent),
            ("dirty_resent", c.dirty_resent),
        ] {
            self.migration_chunks
                .get_or_create(&KindLabels { kind: kind.into() })
                .inc_by(n);
        }
        if ok {
            self.migration_pause.observe(r.time.pause_ms / 1e3);
        }
    }

    /// Refresh volume gauges and encode everything as OpenMetrics text.
    pub fn render(&self, pool: &Pool, index: &ferry_index::PoolIndex) -> String {
        let st = index.status();
        let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.index_entries.set(g(st.entries));
        self.index_memory.set(g(st.memory_bytes));
        self.index_lookups.set(g(st.lookups));
        self.index_hits.set(g(st.hits));
        self.volume_size.clear();
        self.volume_allocated.clear();
        self.bitmap_dirty.clear();
        for v in pool.list() {
            let l = VolumeLabels { volume: v.name() };
            self.volume_size
                .get_or_create(&l)
                .set(i64::try_from(v.size()).unwrap_or(i64::MAX));
            self.volume_allocated
                .get_or_create(&l)
                .set(i64::try_from(v.allocated_bytes()).unwrap_or(i64::MAX));
            for b in v.bitmaps() {
                self.bitmap_dirty
                    .get_or_create(&BitmapLabels {
                        volume: v.name(),
                        bitmap: b.name,
                    })
                    .set(i64::try_from(b.dirty_bytes).unwrap_or(i64::MAX));
            }
        }
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "encoding metrics failed");
        }
        out
    }
}

/// Cached handles for one operation on one volume.
#[derive(Clone, Debug)]
pub struct OpMetrics {
    pub ops: Counter,
    pub errors: Counter,
    pub bytes: Counter,
    pub latency: Histogram,
    pub size: Histogram,
}
