//! The disk I/O a host's guests issue, as the forwarder sees it: requests
//! by kind, bytes, errors and a latency histogram per volume, counted when
//! each request is answered. The controller decides from these numbers.

use ferry_api::DiskIo;
use ferry_nbd::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Upper bounds of the latency buckets, microseconds.
pub const LATENCY_BOUNDS_US: [u64; 16] = [
    50,
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    5_000_000,
    u64::MAX,
];

/// Counters of one volume's requests.
#[derive(Debug)]
pub struct IoStats {
    reads: AtomicU64,
    writes: AtomicU64,
    flushes: AtomicU64,
    other: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    errors: AtomicU64,
    buckets: [AtomicU64; LATENCY_BOUNDS_US.len()],
    sum_us: AtomicU64,
    first_ms: AtomicU64,
    last_ms: AtomicU64,
    /// See [`IoStats::arm`]: 0 armed, `u64::MAX` not armed, else the time.
    first_after_arm: AtomicU64,
    /// The longest request answered since [`IoStats::take_longest`], µs.
    longest_us: AtomicU64,
}

impl Default for IoStats {
    fn default() -> Self {
        IoStats {
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
            other: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            write_bytes: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            buckets: Default::default(),
            sum_us: AtomicU64::new(0),
            first_ms: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
            first_after_arm: AtomicU64::new(u64::MAX),
            longest_us: AtomicU64::new(0),
        }
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl IoStats {
    /// Count one answered request.
    pub fn record(&self, cmd: Command, len: u64, took: Duration, ok: bool) {
        let r = Ordering::Relaxed;
        match cmd {
            Command::Read => {
                self.reads.fetch_add(1, r);
                self.read_bytes.fetch_add(len, r);
            }
            Command::Write => {
                self.writes.fetch_add(1, r);
                self.write_bytes.fetch_add(len, r);
            }
            Command::Flush => {
                self.flushes.fetch_add(1, r);
            }
            _ => {
                self.other.fetch_add(1, r);
            }
        }
        if !ok {
            self.errors.fetch_add(1, r);
        }
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.sum_us.fetch_add(us, r);
        self.longest_us.fetch_max(us, r);
        let i = LATENCY_BOUNDS_US
            .iter()
            .position(|b| us <= *b)
            .unwrap_or(LATENCY_BOUNDS_US.len() - 1);
        self.buckets[i].fetch_add(1, r);
        let now = unix_ms();
        let _ = self.first_ms.compare_exchange(0, now, r, r);
        let _ = self.first_after_arm.compare_exchange(0, now, r, r);
        self.last_ms.store(now, r);
    }

    /// The longest request (arrival at the forwarder to its answer)
    /// answered since the last call, in µs, and start again: over a move,
    /// the longest the guest's own disk I/O stalled (write holds, the
    /// forwarder's reconnect, a flush burst), whatever caused it.
    pub fn take_longest(&self) -> u64 {
        self.longest_us.swap(0, Ordering::Relaxed)
    }

    /// Note the time of the next request answered from now on (a guest
    /// that arrived by a move: its first request after it resumed).
    pub fn arm(&self) {
        self.first_after_arm.store(0, Ordering::Relaxed);
    }

    /// When the first request after [`IoStats::arm`] was answered (unix ms).
    pub fn first_after_arm(&self) -> Option<u64> {
        match self.first_after_arm.load(Ordering::Relaxed) {
            0 | u64::MAX => None,
            t => Some(t),
        }
    }

    /// The counters as the API shows them (cumulative histogram).
    pub fn snapshot(&self, volume: &str, server: &str, switches: u64) -> DiskIo {
        let r = Ordering::Relaxed;
        let mut acc = 0;
        let latency_us = LATENCY_BOUNDS_US
            .iter()
            .zip(&self.buckets)
            .map(|(b, n)| {
                acc += n.load(r);
                (*b, acc)
            })
            .collect();
        DiskIo {
            volume: volume.into(),
            server: server.into(),
            reads: self.reads.load(r),
            writes: self.writes.load(r),
            flushes: self.flushes.load(r),
            other: self.other.load(r),
            read_bytes: self.read_bytes.load(r),
            write_bytes: self.write_bytes.load(r),
            errors: self.errors.load(r),
            latency_us,
            latency_sum_us: self.sum_us.load(r),
            last_io_unix_ms: self.last_ms.load(r),
            first_io_unix_ms: self.first_ms.load(r),
            switches,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_by_kind_and_buckets_cumulatively() {
        let s = IoStats::default();
        s.record(Command::Read, 4096, Duration::from_micros(40), true);
        s.record(Command::Write, 512, Duration::from_micros(700), true);
        s.record(Command::Flush, 0, Duration::from_millis(3), false);
        let d = s.snapshot("v", "h:1", 2);
        assert_eq!((d.reads, d.writes, d.flushes, d.errors), (1, 1, 1, 1));
        assert_eq!((d.read_bytes, d.write_bytes), (4096, 512));
        assert_eq!(d.latency_us[0], (50, 1));
        assert_eq!(d.latency_us[3], (500, 1));
        assert_eq!(d.latency_us[4], (1000, 2));
        assert_eq!(d.latency_us.last(), Some(&(u64::MAX, 3)));
        assert_eq!(d.latency_sum_us, 3740);
        assert!(d.first_io_unix_ms > 0 && d.last_io_unix_ms >= d.first_io_unix_ms);
        assert_eq!(s.take_longest(), 3000);
        assert_eq!(s.take_longest(), 0, "taken: starts again");
        s.record(Command::Read, 512, Duration::from_micros(80), true);
        assert_eq!(s.take_longest(), 80);
    }
}
