//! The node's clock: the real one, or a manual one that tests move forward.
//!
//! Everything that waits (the executor's grace period, its driver polls, the agent's dwell
//! times) asks the node's clock, so a test on a `FakeNode` (feature `test-support`) runs a 30 s grace
//! period in no time and knows exactly when each step happened.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Monotonic time, wall time and sleeping.
pub trait Clock: Send + Sync {
    /// Monotonic now.
    fn now(&self) -> Instant;
    /// Milliseconds since the Unix epoch (for records and snapshots).
    fn wall_ms(&self) -> u64;
    /// Waits `d` (a manual clock moves forward by `d` instead).
    fn sleep(&self, d: Duration);
}

/// The machine's clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn wall_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }
    fn sleep(&self, d: Duration) {
        std::thread::sleep(d)
    }
}

/// A clock that stands still until slept on or [`ManualClock::advance`]d. Clones share the
/// same time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    base: Instant,
    base_wall_ms: u64,
    elapsed: Arc<Mutex<Duration>>,
}

impl ManualClock {
    /// A clock whose wall time starts at `wall_ms`.
    pub fn starting_at(wall_ms: u64) -> ManualClock {
        ManualClock {
            base: Instant::now(),
            base_wall_ms: wall_ms,
            elapsed: Arc::new(Mutex::new(Duration::ZERO)),
        }
    }

    /// Moves time forward by `d`.
    pub fn advance(&self, d: Duration) {
        *self.elapsed.lock().expect("manual clock") += d;
    }

    /// Time since the clock was made.
    pub fn elapsed(&self) -> Duration {
        *self.elapsed.lock().expect("manual clock")
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.base + self.elapsed()
    }
    fn wall_ms(&self) -> u64 {
        self.base_wall_ms + self.elapsed().as_millis() as u64
    }
    fn sleep(&self, d: Duration) {
        self.advance(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_slept_on_and_clones_share_it() {
        let c = ManualClock::starting_at(1_000);
        let t0 = c.now();
        let other = c.clone();
        assert_eq!(c.now(), t0);
        other.sleep(Duration::from_secs(30));
        assert_eq!(c.now() - t0, Duration::from_secs(30));
        assert_eq!(c.wall_ms(), 31_000);
    }
}
