//! When to stop the dirty rounds and pause the guest, and how hard to slow
//! its writes meanwhile: a pure decision from the last round's numbers,
//! so it is tested on numbers alone (and a simulator can call it).
//!
//! The rule: pause once what is dirty can cross the link in
//! [`ConvergePolicy::pause_share`] of the downtime target (the rest of the
//! target covers the drain, the digest and the round trips); give up on
//! converging after `max_rounds`. Auto-converge: when the guest dirtied
//! more than [`ConvergePolicy::dirty_share`] of what the link drained, the
//! pause would never fit, so a per-write delay doubles each such round,
//! from `throttle_min` up to `throttle_max`.

use std::time::Duration;

/// The knobs, with the defaults `ferry migrate` uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvergePolicy {
    /// Target for the final pause.
    pub max_downtime: Duration,
    /// Rounds before pausing anyway.
    pub max_rounds: u32,
    /// Share of `max_downtime` the last data may take on the link.
    pub pause_share: f64,
    /// Dirty rate, as a share of the link rate, above which writes slow.
    pub dirty_share: f64,
    pub throttle_min: Duration,
    pub throttle_max: Duration,
}

impl Default for ConvergePolicy {
    fn default() -> Self {
        ConvergePolicy {
            max_downtime: Duration::from_millis(100),
            max_rounds: 30,
            pause_share: 0.5,
            dirty_share: 0.5,
            throttle_min: Duration::from_millis(1),
            throttle_max: Duration::from_millis(100),
        }
    }
}

/// What the source knows after a round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundStats {
    /// Rounds done so far.
    pub round: u32,
    /// Bytes the guest has dirtied since the last take.
    pub dirty_bytes: u64,
    /// Seconds since the last take.
    pub since_take_s: f64,
    /// Measured link rate, bytes per second.
    pub link_rate: f64,
    /// The per-write delay now in force.
    pub throttle: Duration,
}

/// What to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The rest fits the pause: pause now.
    Pause,
    /// The round limit is reached: pause anyway, longer than the target.
    PauseUnconverged,
    /// Send another round, with this per-write delay (unchanged when equal
    /// to the one in force).
    Round { throttle: Duration },
}

/// Decide the next step.
pub fn decide(s: &RoundStats, p: &ConvergePolicy) -> Step {
    let rate = s.link_rate.max(1.0);
    let budget = p.max_downtime.as_secs_f64() * p.pause_share;
    let dirty = to_f64(s.dirty_bytes);
    if dirty / rate <= budget {
        return Step::Pause;
    }
    if s.round >= p.max_rounds {
        return Step::PauseUnconverged;
    }
    let dirty_rate = dirty / s.since_take_s.max(1e-3);
    let throttle = if dirty_rate > rate * p.dirty_share {
        (s.throttle * 2).clamp(p.throttle_min, p.throttle_max)
    } else {
        s.throttle
    };
    Step::Round { throttle }
}

/// Seconds the last data of `bytes` needs on a link of `rate` bytes/s.
pub fn drain_time(bytes: u64, rate: f64) -> Duration {
    Duration::from_secs_f64(to_f64(bytes) / rate.max(1.0))
}

/// Byte counts as floating point for rates (exact below 2^53 bytes).
#[allow(clippy::cast_precision_loss)]
pub(crate) fn to_f64(n: u64) -> f64 {
    n as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(dirty: u64, round: u32, throttle_ms: u64) -> RoundStats {
        RoundStats {
            round,
            dirty_bytes: dirty,
            since_take_s: 1.0,
            link_rate: 10e6,
            throttle: Duration::from_millis(throttle_ms),
        }
    }

    #[test]
    fn pauses_when_the_rest_fits_half_the_target() {
        let p = ConvergePolicy::default();
        // 10 MB/s, 100 ms target: 500 kB fits, 600 kB does not.
        assert_eq!(decide(&stats(500_000, 3, 0), &p), Step::Pause);
        assert!(matches!(
            decide(&stats(600_000, 3, 0), &p),
            Step::Round { .. }
        ));
    }

    #[test]
    fn round_limit_pauses_unconverged() {
        let p = ConvergePolicy {
            max_rounds: 5,
            ..Default::default()
        };
        assert_eq!(decide(&stats(50_000_000, 5, 0), &p), Step::PauseUnconverged);
    }

    #[test]
    fn throttle_doubles_within_bounds_only_when_the_guest_outruns_the_link() {
        let p = ConvergePolicy::default();
        // 6 MB dirtied in 1 s on a 10 MB/s link: above half, slow down.
        let step = |t| decide(&stats(6_000_000, 1, t), &p);
        assert_eq!(
            step(0),
            Step::Round {
                throttle: Duration::from_millis(1)
            }
        );
        assert_eq!(
            step(8),
            Step::Round {
                throttle: Duration::from_millis(16)
            }
        );
        assert_eq!(
            step(100),
            Step::Round {
                throttle: Duration::from_millis(100)
            }
        );
        // 4 MB in 1 s: below half, the delay stays as it is.
        assert_eq!(
            decide(&stats(4_000_000, 1, 8), &p),
            Step::Round {
                throttle: Duration::from_millis(8)
            }
        );
    }

    #[test]
    fn a_zero_rate_never_divides_by_zero() {
        let mut s = stats(1, 0, 0);
        s.link_rate = 0.0;
        s.since_take_s = 0.0;
        let _ = decide(&s, &ConvergePolicy::default());
        assert!(drain_time(1 << 20, 0.0) > Duration::ZERO);
    }
}
