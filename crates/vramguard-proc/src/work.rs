//! The work sampler: watches processes over time (CPU time, threads running) so that the
//! classifier can tell a job that still works from one that only holds memory.
//!
//! One type serves both uses: a command samples a short window in one go
//! ([`WorkSampler::sample_window`]), the agent observes at every collection and asks for the
//! window it has ([`WorkSampler::window`]). Observations are keyed by pid *and* start time, so a
//! reused pid starts a fresh history.

use crate::procfs::{Found, ProcError, ProcFs};
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use vramguard_core::snapshot::{WorkSample, WorkWindow};

/// Observations kept per process; older ones are dropped first.
const KEEP_PER_PROCESS: usize = 64;

#[derive(Debug, Clone, Copy)]
struct Observation {
    at_ms: u64,
    cpu_ticks: u64,
    running: bool,
    /// A thread was in D.
    waiting: bool,
}

/// Remembers observations of processes.
#[derive(Debug, Default)]
pub struct WorkSampler {
    history: HashMap<(u32, u64), VecDeque<Observation>>,
}

impl WorkSampler {
    /// An empty sampler.
    pub fn new() -> Self {
        Self::default()
    }

    /// Observes `pids` once, at `now_ms`. Processes that are gone or unreadable are skipped.
    pub fn observe(&mut self, fs: &ProcFs, pids: &[u32], now_ms: u64) -> Result<(), ProcError> {
        for &pid in pids {
            if let Found::Yes(p) = fs.work_probe(pid)? {
                self.record(pid, p.start_ticks, p.cpu_ticks, p.running, now_ms);
                if p.waiting
                    && let Some(o) = self
                        .history
                        .get_mut(&(pid, p.start_ticks))
                        .and_then(|h| h.back_mut())
                        .filter(|o| o.at_ms == now_ms)
                {
                    o.waiting = true;
                }
            }
        }
        Ok(())
    }

    /// Records one observation of the process (`pid`, `start_ticks`) made at `at_ms`: its
    /// cumulative CPU time and whether a thread was running. A node without a `/proc` (the
    /// fake one) observes through this.
    pub fn record(
        &mut self,
        pid: u32,
        start_ticks: u64,
        cpu_ticks: u64,
        running: bool,
        at_ms: u64,
    ) {
        let h = self.history.entry((pid, start_ticks)).or_default();
        if h.back().is_some_and(|o| o.at_ms >= at_ms) {
            return;
        }
        h.push_back(Observation {
            at_ms,
            cpu_ticks,
            running,
            waiting: false,
        });
        while h.len() > KEEP_PER_PROCESS {
            h.pop_front();
        }
    }

    /// Forgets observations older than `before_ms`, and processes with none left.
    pub fn forget_before(&mut self, before_ms: u64) {
        self.history.retain(|_, h| {
            while h.front().is_some_and(|o| o.at_ms < before_ms) {
                h.pop_front();
            }
            !h.is_empty()
        });
    }

    /// What was seen from `since_ms` on: one sample per process observed at least twice.
    pub fn window(&self, since_ms: u64, until_ms: u64) -> WorkWindow {
        let mut processes: Vec<WorkSample> = self
            .history
            .iter()
            .filter_map(|((pid, start), h)| {
                let seen: Vec<&Observation> = h
                    .iter()
                    .filter(|o| o.at_ms >= since_ms && o.at_ms <= until_ms)
                    .collect();
                let (first, last) = (seen.first()?, seen.last()?);
                if seen.len() < 2 {
                    return None;
                }
                Some(WorkSample {
                    pid: *pid,
                    start_ticks: *start,
                    cpu_ticks: last.cpu_ticks.saturating_sub(first.cpu_ticks),
                    observed_ms: last.at_ms - first.at_ms,
                    observations: seen.len() as u32,
                    running_observations: seen.iter().filter(|o| o.running).count() as u32,
                    waiting_observations: seen.iter().filter(|o| o.waiting).count() as u32,
                })
            })
            .collect();
        processes.sort_by_key(|p| p.pid);
        WorkWindow {
            since_ms,
            until_ms,
            processes,
        }
    }

    /// Observes `pids` every `period` for `window` and returns what was seen. `now_ms` gives
    /// the wall clock (milliseconds since the epoch) for the records.
    pub fn sample_window(
        fs: &ProcFs,
        pids: &[u32],
        window: Duration,
        period: Duration,
        now_ms: impl Fn() -> u64,
    ) -> Result<WorkWindow, ProcError> {
        let mut sampler = WorkSampler::new();
        let start = Instant::now();
        let since = now_ms();
        sampler.observe(fs, pids, since)?;
        loop {
            let left = window.saturating_sub(start.elapsed());
            if left.is_zero() {
                break;
            }
            std::thread::sleep(left.min(period));
            sampler.observe(fs, pids, now_ms())?;
        }
        let until = now_ms();
        Ok(sampler.window(since, until))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }

    #[test]
    fn a_spinning_thread_shows_cpu_and_running_and_a_sleeper_does_not() {
        let fs = ProcFs::open("/proc").unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spin = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut x = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    x = x.wrapping_add(1);
                    std::hint::black_box(x);
                }
            })
        };
        let mut sleeper = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let me = std::process::id();
        let w = WorkSampler::sample_window(
            &fs,
            &[me, sleeper.id()],
            Duration::from_millis(600),
            Duration::from_millis(100),
            now_ms,
        )
        .unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        spin.join().unwrap();
        let _ = sleeper.kill();
        let _ = sleeper.wait();
        let mine = w.processes.iter().find(|p| p.pid == me).unwrap();
        let hz = rustix::param::clock_ticks_per_second();
        // At least a quarter of a core over the window, on a loaded machine too.
        assert!(
            mine.cpu_ticks * 1000 / hz >= mine.observed_ms / 4,
            "{mine:?}"
        );
        assert!(
            mine.running_observations * 2 > mine.observations,
            "{mine:?}"
        );
        let slept = w.processes.iter().find(|p| p.pid != me).unwrap();
        assert_eq!(slept.cpu_ticks, 0, "{slept:?}");
        // A process just started may be caught running once, while it execs.
        assert!(slept.running_observations <= 1, "{slept:?}");
        assert!(
            slept.observations >= 5 && slept.observed_ms >= 500,
            "{slept:?}"
        );
    }

    #[test]
    fn history_windows_and_reused_pids() {
        let mut s = WorkSampler::new();
        let obs = |at_ms, cpu_ticks, running| Observation {
            at_ms,
            cpu_ticks,
            running,
            waiting: false,
        };
        s.history.insert(
            (7, 100),
            [obs(1000, 5, false), obs(2000, 9, true), obs(3000, 9, false)].into(),
        );
        s.history.insert((7, 200), [obs(3000, 0, false)].into());
        let w = s.window(1500, 3000);
        assert_eq!(w.processes.len(), 1, "one observation is no window");
        assert_eq!(w.processes[0].start_ticks, 100);
        assert_eq!(w.processes[0].cpu_ticks, 0);
        assert_eq!(w.processes[0].observed_ms, 1000);
        assert_eq!(w.processes[0].running_observations, 1);
        assert_eq!(s.window(0, 3000).processes[0].cpu_ticks, 4);
        s.forget_before(2500);
        assert_eq!(s.history.len(), 2);
        s.forget_before(4000);
        assert!(s.history.is_empty());
    }
}
