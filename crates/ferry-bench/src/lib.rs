//! `ferry bench`: a load generator with its own asynchronous NBD client.
//!
//! A run opens `connections` NBD connections and keeps `queue_depth` requests
//! in flight on each until the runtime ends, then reports IOPS, MB/s, latency
//! (mean, p50, p99, max) and the client's own CPU use.

mod profile;

pub use profile::{expand_profiles, Pattern, Profile, PROFILE_NAMES};

use bytes::Bytes;
use ferry_client::{ClientError, ConnectOptions, NbdClient};
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum BenchError {
    #[error("connecting to {addr} export {export:?}: {source}")]
    Connect {
        addr: String,
        export: String,
        #[source]
        source: ClientError,
    },
    #[error("export of {size} bytes is smaller than the largest request ({bs} bytes)")]
    TooSmall { size: u64, bs: u32 },
    #[error("I/O failed during the run: {0}")]
    Io(ClientError),
}

/// One run's shape.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    pub addr: String,
    pub export: String,
    pub profile: Profile,
    pub connections: usize,
    pub queue_depth: usize,
    pub runtime: Duration,
    /// Use only the first `range` bytes of the export (0 = all).
    pub range: u64,
}

/// Results of one run.
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub profile: String,
    pub connections: usize,
    pub queue_depth: usize,
    pub seconds: f64,
    pub ops: u64,
    pub read_ops: u64,
    pub write_ops: u64,
    pub bytes: u64,
    pub iops: f64,
    pub mb_per_s: f64,
    pub lat_mean_us: f64,
    pub lat_p50_us: u64,
    pub lat_p99_us: u64,
    pub lat_max_us: u64,
    /// Client CPU time (user + system) as a percentage of one core.
    pub client_cpu_pct: f64,
}

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we own; RUSAGE_SELF is valid.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

struct WorkerResult {
    hist: Histogram<u64>,
    reads: u64,
    writes: u64,
    bytes: u64,
}

/// Run one benchmark.
pub async fn run(spec: &BenchSpec) -> Result<BenchReport, BenchError> {
    let opts = ConnectOptions::default();
    let mut clients = Vec::new();
    for _ in 0..spec.connections.max(1) {
        let c = NbdClient::connect(&spec.addr, &spec.export, &opts)
            .await
            .map_err(|source| BenchError::Connect {
                addr: spec.addr.clone(),
                export: spec.export.clone(),
                source,
            })?;
        clients.push(Arc::new(c));
    }
    let size = clients[0].size();
    let range = if spec.range == 0 {
        size
    } else {
        spec.range.min(size)
    };
    let max_bs = spec.profile.max_block_size();
    if range < u64::from(max_bs) {
        return Err(BenchError::TooSmall {
            size: range,
            bs: max_bs,
        });
    }
    let mut seed_rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    let data: Bytes = (0..max_bs as usize + 65536)
        .map(|_| seed_rng.gen::<u8>())
        .collect::<Vec<u8>>()
        .into();
    let cursor = Arc::new(AtomicU64::new(0));
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let deadline = start + spec.runtime;
    let mut tasks = tokio::task::JoinSet::new();
    for (ci, client) in clients.iter().enumerate() {
        for qi in 0..spec.queue_depth.max(1) {
            let client = client.clone();
            let profile = spec.profile.clone();
            let data = data.clone();
            let cursor = cursor.clone();
            let seed = (ci * 1000 + qi) as u64;
            tasks.spawn(async move {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let mut res = WorkerResult {
                    hist: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds"),
                    reads: 0,
                    writes: 0,
                    bytes: 0,
                };
                while Instant::now() < deadline {
                    let bs = profile.pick_size(&mut rng);
                    let offset = match profile.pattern {
                        Pattern::Random => {
                            let align = u64::from(bs.min(4096));
                            rng.gen_range(0..=(range - u64::from(bs)) / align) * align
                        }
                        Pattern::Sequential => {
                            let o = cursor.fetch_add(u64::from(bs), Ordering::Relaxed);
                            o % (range - range % u64::from(bs)).max(u64::from(bs))
                        }
                    };
                    let read = rng.gen_range(0..100) < profile.read_pct;
                    let t0 = Instant::now();
                    if read {
                        client.read(offset, bs).await.map_err(BenchError::Io)?;
                        res.reads += 1;
                    } else {
                        let skew = rng.gen_range(0..65536usize);
                        client
                            .write(offset, data.slice(skew..skew + bs as usize), false)
                            .await
                            .map_err(BenchError::Io)?;
                        res.writes += 1;
                    }
                    let us = u64::try_from(t0.elapsed().as_micros())
                        .unwrap_or(u64::MAX)
                        .max(1);
                    let _ = res.hist.record(us.min(60_000_000));
                    res.bytes += u64::from(bs);
                }
                Ok::<WorkerResult, BenchError>(res)
            });
        }
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    let (mut reads, mut writes, mut bytes) = (0, 0, 0);
    let mut first_err = None;
    while let Some(r) = tasks.join_next().await {
        match r {
            Ok(Ok(w)) => {
                let _ = hist.add(&w.hist);
                reads += w.reads;
                writes += w.writes;
                bytes += w.bytes;
            }
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(e) => {
                first_err.get_or_insert(BenchError::Io(ClientError::Io(e.to_string())));
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    if let Some(e) = first_err {
        return Err(e);
    }
    for c in clients {
        if let Ok(c) = Arc::try_unwrap(c) {
            c.disconnect().await;
        }
    }
    let ops = reads + writes;
    Ok(BenchReport {
        profile: spec.profile.name.clone(),
        connections: spec.connections,
        queue_depth: spec.queue_depth,
        seconds: secs,
        ops,
        read_ops: reads,
        write_ops: writes,
        bytes,
        iops: ops as f64 / secs,
        mb_per_s: bytes as f64 / secs / 1e6,
        lat_mean_us: hist.mean(),
        lat_p50_us: hist.value_at_quantile(0.5),
        lat_p99_us: hist.value_at_quantile(0.99),
        lat_max_us: hist.max(),
        client_cpu_pct: cpu / secs * 100.0,
    })
}

/// A fixed-width table of reports.
pub fn table(reports: &[BenchReport]) -> String {
    let mut s = format!(
        "{:<16} {:>5} {:>4} {:>10} {:>9} {:>9} {:>8} {:>8} {:>9} {:>6}\n",
        "profile", "conns", "qd", "IOPS", "MB/s", "mean us", "p50 us", "p99 us", "max us", "cpu%"
    );
    for r in reports {
        s.push_str(&format!(
            "{:<16} {:>5} {:>4} {:>10.0} {:>9.1} {:>9.1} {:>8} {:>8} {:>9} {:>6.0}\n",
            r.profile,
            r.connections,
            r.queue_depth,
            r.iops,
            r.mb_per_s,
            r.lat_mean_us,
            r.lat_p50_us,
            r.lat_p99_us,
            r.lat_max_us,
            r.client_cpu_pct
        ));
    }
    s
}
