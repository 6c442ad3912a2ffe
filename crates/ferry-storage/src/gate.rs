//! The write gate of a volume: lets a migration pause every writer (holding,
//! not failing, new writes until it resumes), wait for writes already inside
//! to finish, and slow writers down (auto-converge).
//!
//! The fast path is two atomic operations: a writer increments `inside`, then
//! checks `paused`; a pauser sets `paused`, then waits for `inside` to reach
//! zero. Both use `SeqCst`, so either the writer sees the pause and backs out,
//! or the pauser sees the writer and waits for it.

use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Pauses and throttles the writers of one volume.
#[derive(Debug, Default)]
pub struct WriteGate {
    inside: AtomicU64,
    /// Writers let in since the volume was opened: counted after `inside`,
    /// so [`WriteGate::quiet_mark`] and [`WriteGate::entered_since`] can
    /// tell that no write landed in a window.
    entered: AtomicU64,
    paused: AtomicBool,
    /// Writers held at the paused gate, waiting to go in.
    waiting: AtomicU64,
    /// Delay added to every write, in microseconds (0: none).
    throttle_us: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
    /// Writes that were delayed by throttling, the total delay and the
    /// longest one, since [`WriteGate::take_throttled`].
    throttled_writes: AtomicU64,
    throttled_us_total: AtomicU64,
    throttled_us_longest: AtomicU64,
}

/// What throttling cost a volume's writers since the last
/// [`WriteGate::take_throttled`]: delays writes actually slept, not
/// throttles set (a throttle raised just before a pause may delay none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ThrottleTally {
    /// Writes that slept before going in.
    pub writes: u64,
    /// Their sleeps added up.
    pub total: Duration,
    /// The longest one.
    pub longest: Duration,
}

/// Held by a writer while it is inside the gate.
#[must_use]
pub struct WriteTicket<'a> {
    gate: &'a WriteGate,
}

impl Drop for WriteTicket<'_> {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

/// A [`WriteTicket`] that owns its gate: for a write that ends on another
/// thread than the one that started it (librbd's asynchronous writes).
#[must_use]
pub struct OwnedWriteTicket {
    gate: Arc<WriteGate>,
}

impl Drop for OwnedWriteTicket {
    fn drop(&mut self) {
        self.gate.leave();
    }
}

impl WriteGate {
    /// Enter to write; blocks while the gate is paused and sleeps for the
    /// throttle delay first.
    pub fn enter(&self) -> WriteTicket<'_> {
        let delay = self.throttle_us.load(Ordering::Relaxed);
        if delay > 0 {
            std::thread::sleep(Duration::from_micros(delay));
            self.throttled_writes.fetch_add(1, Ordering::Relaxed);
            self.throttled_us_total.fetch_add(delay, Ordering::Relaxed);
            self.throttled_us_longest
                .fetch_max(delay, Ordering::Relaxed);
        }
        loop {
            self.inside.fetch_add(1, Ordering::SeqCst);
            if !self.paused.load(Ordering::SeqCst) {
                self.entered.fetch_add(1, Ordering::SeqCst);
                return WriteTicket { gate: self };
            }
            self.back_out();
            let mut g = self.lock.lock();
            self.waiting.fetch_add(1, Ordering::SeqCst);
            while self.paused.load(Ordering::SeqCst) {
                self.cv.wait(&mut g);
            }
            self.waiting.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Enter without waiting: `None` while paused or throttled (the caller
    /// retries on a thread that may block).
    pub fn try_enter(&self) -> Option<WriteTicket<'_>> {
        if self.throttle_us.load(Ordering::Relaxed) > 0 || self.paused.load(Ordering::Relaxed) {
            return None;
        }
        self.inside.fetch_add(1, Ordering::SeqCst);
        if self.paused.load(Ordering::SeqCst) {
            self.back_out();
            return None;
        }
        self.entered.fetch_add(1, Ordering::SeqCst);
        Some(WriteTicket { gate: self })
    }

    /// [`WriteGate::try_enter`], the ticket owning the gate.
    pub fn try_enter_owned(self: &Arc<Self>) -> Option<OwnedWriteTicket> {
        let t = self.try_enter()?;
        std::mem::forget(t);
        Some(OwnedWriteTicket { gate: self.clone() })
    }

    /// A writer leaves (a ticket's drop).
    fn leave(&self) {
        if self.inside.fetch_sub(1, Ordering::SeqCst) == 1 && self.paused.load(Ordering::SeqCst) {
            let _g = self.lock.lock();
            self.cv.notify_all();
        }
    }

    fn back_out(&self) {
        if self.inside.fetch_sub(1, Ordering::SeqCst) == 1 {
            let _g = self.lock.lock();
            self.cv.notify_all();
        }
    }

    /// Stop new writes and wait up to `timeout` for those inside to finish.
    /// Returns false (and resumes) if they did not finish in time.
    pub fn pause(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        self.paused.store(true, Ordering::SeqCst);
        let mut g = self.lock.lock();
        while self.inside.load(Ordering::SeqCst) > 0 {
            if self.cv.wait_until(&mut g, deadline).timed_out()
                && self.inside.load(Ordering::SeqCst) > 0
            {
                drop(g);
                self.resume();
                return false;
            }
        }
        true
    }

    /// A mark for [`WriteGate::entered_since`], or `None` while a writer is
    /// inside (its write may land at any time). A write that lands after
    /// the mark was entered after it: read `entered`, then `inside`; a
    /// writer raises `inside` before it counts itself in `entered`, so a
    /// writer counted before the mark is seen inside unless it has left.
    pub fn quiet_mark(&self) -> Option<u64> {
        let entered = self.entered.load(Ordering::SeqCst);
        (self.inside.load(Ordering::SeqCst) == 0).then_some(entered)
    }

    /// Whether a writer has been let in since `mark` (of
    /// [`WriteGate::quiet_mark`]): if not, nothing was written in between.
    pub fn entered_since(&self, mark: u64) -> bool {
        self.entered.load(Ordering::SeqCst) != mark
    }

    /// Let writers in again.
    pub fn resume(&self) {
        let _g = self.lock.lock();
        self.paused.store(false, Ordering::SeqCst);
        self.cv.notify_all();
    }

    /// How many writers are held at the paused gate right now.
    pub fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::SeqCst)
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    /// Delay every write by `delay` (zero turns throttling off).
    pub fn set_throttle(&self, delay: Duration) {
        let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.throttle_us.store(us, Ordering::Relaxed);
    }

    pub fn throttle(&self) -> Duration {
        Duration::from_micros(self.throttle_us.load(Ordering::Relaxed))
    }

    /// What throttling cost writers since the last call (or the volume's
    /// opening), and start again.
    pub fn take_throttled(&self) -> ThrottleTally {
        ThrottleTally {
            writes: self.throttled_writes.swap(0, Ordering::Relaxed),
            total: Duration::from_micros(self.throttled_us_total.swap(0, Ordering::Relaxed)),
            longest: Duration::from_micros(self.throttled_us_longest.swap(0, Ordering::Relaxed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    #[test]
    fn pause_waits_for_writers_inside_and_holds_new_ones() {
        let gate = Arc::new(WriteGate::default());
        let done = Arc::new(AtomicU64::new(0));
        let t = gate.enter();
        let g2 = gate.clone();
        let pauser = std::thread::spawn(move || g2.pause(Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !pauser.is_finished(),
            "pause must wait for the writer inside"
        );
        drop(t);
        assert!(pauser.join().unwrap());
        assert!(gate.try_enter().is_none());
        let (g3, d3) = (gate.clone(), done.clone());
        let writer = std::thread::spawn(move || {
            let _t = g3.enter();
            d3.fetch_add(1, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(done.load(Ordering::SeqCst), 0, "writer must be held");
        gate.resume();
        writer.join().unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_quiet_mark_sees_every_writer_inside_or_let_in_after_it() {
        let g = WriteGate::default();
        let mark = g.quiet_mark().expect("no writer inside");
        assert!(!g.entered_since(mark));
        let t = g.enter();
        assert!(g.quiet_mark().is_none(), "a writer is inside");
        assert!(g.entered_since(mark));
        drop(t);
        let mark = g.quiet_mark().expect("the writer left");
        drop(g.try_enter());
        assert!(g.entered_since(mark));
        // A paused gate lets no one in, so a mark taken then stands.
        let mark = g.quiet_mark().unwrap();
        assert!(g.pause(Duration::from_millis(10)));
        assert!(g.try_enter().is_none());
        g.resume();
        assert!(!g.entered_since(mark));
    }

    #[test]
    fn pause_times_out_and_resumes() {
        let gate = WriteGate::default();
        let _t = gate.enter();
        assert!(!gate.pause(Duration::from_millis(20)));
        assert!(!gate.is_paused());
    }

    #[test]
    fn many_writers_never_inside_while_paused() {
        let gate = Arc::new(WriteGate::default());
        let inside_while_paused = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let quiet = Arc::new(AtomicBool::new(false));
        let mut hs = Vec::new();
        for _ in 0..4 {
            let (g, bad, stop, quiet) = (
                gate.clone(),
                inside_while_paused.clone(),
                stop.clone(),
                quiet.clone(),
            );
            hs.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let _t = g.enter();
                    if quiet.load(Ordering::SeqCst) {
                        bad.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }));
        }
        for _ in 0..200 {
            assert!(gate.pause(Duration::from_secs(5)));
            quiet.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_micros(200));
            quiet.store(false, Ordering::SeqCst);
            gate.resume();
        }
        stop.store(true, Ordering::Relaxed);
        for h in hs {
            h.join().unwrap();
        }
        assert_eq!(inside_while_paused.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_tally_counts_delays_slept_not_throttles_set() {
        let gate = WriteGate::default();
        gate.set_throttle(Duration::from_millis(2));
        drop(gate.enter());
        drop(gate.enter());
        // Raised with no write after it: no write slept 50 ms.
        gate.set_throttle(Duration::from_millis(50));
        let t = gate.take_throttled();
        assert_eq!(t.writes, 2);
        assert_eq!(t.total, Duration::from_millis(4));
        assert_eq!(t.longest, Duration::from_millis(2));
        assert_eq!(gate.take_throttled(), ThrottleTally::default());
        gate.set_throttle(Duration::ZERO);
        drop(gate.enter());
        assert_eq!(gate.take_throttled(), ThrottleTally::default());
    }
}
