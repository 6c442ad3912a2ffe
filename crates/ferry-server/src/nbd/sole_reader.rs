//! Whether one NBD connection alone has been sending the daemon large READs
//! lately: what `nbd.sendfile_reads = "sole-reader"` asks before a READ
//! goes by `sendfile`.
//!
//! Sendfile saves the server both copies of a READ but leaves the client
//! to copy from page-cache pages; on a host whose clients share the
//! server's cores that pays with one reading connection and costs with
//! several (docs/benchmarks.md). The signal is the last connection to send
//! a large READ and when that last changed: lock-free, one swap per READ,
//! and nothing to undo when a connection closes. Two connections racing
//! may send one READ the other way; both ways give the same bytes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long one connection must have been the only one sending large
/// READs before its READs go by sendfile.
pub const SOLE_FOR: Duration = Duration::from_millis(100);

/// The daemon's record of who sends it large READs.
#[derive(Debug)]
pub struct SoleReader {
    origin: Instant,
    next_id: AtomicU64,
    /// The connection that sent the last large READ (0: none yet).
    last: AtomicU64,
    /// When `last` last changed, in milliseconds since `origin`.
    changed_ms: AtomicU64,
    sole_for_ms: u64,
}

impl Default for SoleReader {
    fn default() -> Self {
        SoleReader::new(SOLE_FOR)
    }
}

impl SoleReader {
    pub fn new(sole_for: Duration) -> Self {
        SoleReader {
            origin: Instant::now(),
            next_id: AtomicU64::new(1),
            last: AtomicU64::new(0),
            changed_ms: AtomicU64::new(0),
            sole_for_ms: millis(sole_for),
        }
    }

    /// A new connection's place in this record.
    pub fn reader(self: &Arc<Self>) -> Reader {
        Reader {
            id: self.connection_id(),
            record: self.clone(),
        }
    }

    /// A number for a new connection, never 0 and never given twice.
    fn connection_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Connection `id` sends a large READ: whether it has been the only one
    /// doing so for [`SOLE_FOR`] (or the window this was made with).
    fn note_read(&self, id: u64) -> bool {
        self.note_read_at(id, self.origin.elapsed())
    }

    /// [`Self::note_read`] at `at` after this record was made.
    fn note_read_at(&self, id: u64, at: Duration) -> bool {
        let now = millis(at);
        if self.last.swap(id, Ordering::Relaxed) != id {
            self.changed_ms.store(now, Ordering::Relaxed);
            return false;
        }
        now.saturating_sub(self.changed_ms.load(Ordering::Relaxed)) >= self.sole_for_ms
    }
}

/// One connection's place in the daemon's [`SoleReader`].
#[derive(Debug)]
pub struct Reader {
    id: u64,
    record: Arc<SoleReader>,
}

impl Reader {
    /// This connection sends a large READ: whether it has been the only
    /// one doing so for the record's window.
    pub fn note_read(&self) -> bool {
        self.record.note_read(self.id)
    }
}

/// Whole milliseconds, saturating (u64 of them is 584 million years).
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_connection_reading_alone_is_sole_once_the_window_has_passed() {
        let s = SoleReader::new(ms(100));
        let a = s.connection_id();
        assert!(
            !s.note_read_at(a, ms(1000)),
            "the first read starts the window"
        );
        assert!(!s.note_read_at(a, ms(1099)), "still inside the window");
        assert!(s.note_read_at(a, ms(1100)));
        assert!(s.note_read_at(a, ms(5000)));
    }

    #[test]
    fn another_connection_reading_restarts_the_window_for_both() {
        let s = SoleReader::new(ms(100));
        let (a, b) = (s.connection_id(), s.connection_id());
        assert_ne!(a, b);
        s.note_read_at(a, ms(0));
        assert!(s.note_read_at(a, ms(200)));
        assert!(!s.note_read_at(b, ms(210)), "b's read ends a's turn alone");
        assert!(
            !s.note_read_at(a, ms(220)),
            "and a's next read is not alone either"
        );
        assert!(
            !s.note_read_at(a, ms(300)),
            "the window starts from a's return"
        );
        assert!(
            s.note_read_at(a, ms(320)),
            "b stopped reading: a is alone again"
        );
    }

    #[test]
    fn the_clock_as_it_runs_starts_a_window_at_the_first_read() {
        let s = SoleReader::new(Duration::ZERO);
        let a = s.connection_id();
        assert!(!s.note_read(a));
        assert!(s.note_read(a));
        let s = Arc::new(SoleReader::default());
        let (r, q) = (s.reader(), s.reader());
        assert_ne!(r.id, q.id);
        assert!(!r.note_read(), "a fresh record: no one has read alone yet");
    }
}
