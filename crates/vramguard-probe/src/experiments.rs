//! The experiments: release, concurrent, soak.

use crate::ProbeError;
use crate::holders::{HolderKind, Holding};
use crate::sampler::{Sample, Sampler};
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use vramguard_core::trend::{Trend, theil_sen};

/// What every experiment needs.
pub struct Probe {
    /// The running sampler (kept for the whole experiment; its readings go in the report).
    pub sampler: Sampler,
    /// How holders are made.
    pub holders: HolderKind,
    /// The GPU.
    pub gpu: u32,
    /// Where holders may put scratch files.
    pub scratch: PathBuf,
    /// The epoch of the sampler's timestamps.
    pub epoch: Instant,
    /// How long to wait for memory to appear and to be released.
    pub timeout: Duration,
}

fn tolerance(bytes: u64) -> u64 {
    (64 << 20).max(bytes / 20)
}

impl Probe {
    fn ms(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.epoch).as_secs_f64() * 1000.0
    }

    /// The first reading at or after `from_ms` satisfying `cond`, waiting up to `timeout`.
    fn first_since(
        &self,
        from_ms: f64,
        timeout: Duration,
        cond: impl Fn(u64) -> bool,
    ) -> Option<Sample> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self
                .sampler
                .since(from_ms)
                .into_iter()
                .find(|s| s.used.is_some_and(&cond))
            {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn start_visible(
        &self,
        bytes: u64,
        count: u32,
        children: u32,
        baseline: u64,
    ) -> Result<Vec<Holding>, ProbeError> {
        let lifetime = self.timeout * 4 + Duration::from_secs(60);
        let holders: Vec<Holding> = (0..count)
            .map(|_| {
                self.holders
                    .start(self.gpu, bytes, children, lifetime, &self.scratch)
            })
            .collect::<Result<_, _>>()?;
        let want = baseline + (bytes * count as u64) * 9 / 10;
        if self.sampler.wait_for(self.timeout, |u| u >= want).is_none() {
            return Err(ProbeError::NeverAppeared {
                gpu: self.gpu,
                timeout: self.timeout,
                used: self.sampler.latest().and_then(|s| s.used),
                expected: want,
            });
        }
        Ok(holders)
    }

    fn baseline(&self) -> Result<u64, ProbeError> {
        self.sampler
            .median_over(Duration::from_millis(100))
            .ok_or(ProbeError::Unreadable(self.gpu))
    }
}

/// One release measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Trial {
    /// Signal name (`TERM`).
    pub signal: String,
    /// Repeat number, from 1.
    pub repeat: u32,
    /// When the holder was started, ms since the epoch.
    pub t_start_ms: f64,
    /// When the trial ended (memory back, or the wait gave up), ms since the epoch.
    pub t_end_ms: f64,
    /// When the signal was sent, ms since the epoch.
    pub t_signal_ms: f64,
    /// Signal → process exit, ms.
    pub exit_ms: Option<f64>,
    /// Signal → first drop of used memory, ms.
    pub first_drop_ms: Option<f64>,
    /// Signal → memory back to the baseline, ms.
    pub release_ms: Option<f64>,
    /// Process exit → memory back: the driver's teardown lag, ms.
    pub driver_lag_ms: Option<f64>,
    /// The largest gap between two readings around the release, ms (the measurement's
    /// resolution).
    pub resolution_ms: f64,
    /// Memory came back within the timeout.
    pub released: bool,
    /// Bytes above the baseline when the wait ended.
    pub leftover_bytes: u64,
    /// Children that inherited the context kept the memory after the parent died.
    pub orphans_kept_memory: bool,
    /// Killing those children → memory back, ms.
    pub release_after_children_ms: Option<f64>,
    /// Used memory before the holder started.
    pub baseline: u64,
}

fn max_gap(samples: &[Sample], around_ms: f64) -> f64 {
    let near: Vec<f64> = samples
        .iter()
        .map(|s| s.t_ms)
        .filter(|t| (t - around_ms).abs() < 200.0)
        .collect();
    near.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max)
}

/// Kill a holder with each signal, `repeat` times, and time the release.
pub fn release(
    probe: &Probe,
    bytes: u64,
    signals: &[(String, i32)],
    repeat: u32,
    children: u32,
    on_trial: &mut dyn FnMut(&Trial, usize, usize),
) -> Result<Vec<Trial>, ProbeError> {
    let tol = tolerance(bytes);
    let mut trials = Vec::new();
    let total = signals.len() * repeat as usize;
    for (name, sig) in signals {
        for r in 1..=repeat {
            let baseline = probe.baseline()?;
            let t_start_ms = probe.sampler.now_ms();
            let mut holders = probe.start_visible(bytes, 1, children, baseline)?;
            let h = &mut holders[0];
            let pre = probe
                .sampler
                .latest()
                .and_then(|s| s.used)
                .unwrap_or(baseline + bytes);
            let t_signal_ms = probe.sampler.now_ms();
            h.signal(*sig);
            let exit = h.wait_exit(probe.timeout).map(|t| probe.ms(t));
            let released = probe.first_since(t_signal_ms, probe.timeout, |u| u <= baseline + tol);
            let first_drop = probe.first_since(t_signal_ms, Duration::ZERO, |u| u + tol < pre);
            let mut trial = Trial {
                signal: name.clone(),
                repeat: r,
                t_start_ms,
                t_end_ms: 0.0,
                t_signal_ms,
                exit_ms: exit.map(|e| e - t_signal_ms),
                first_drop_ms: first_drop.map(|s| s.t_ms - t_signal_ms),
                release_ms: released.map(|s| s.t_ms - t_signal_ms),
                driver_lag_ms: match (released, exit) {
                    (Some(s), Some(e)) => Some((s.t_ms - e).max(0.0)),
                    _ => None,
                },
                resolution_ms: 0.0,
                released: released.is_some(),
                leftover_bytes: 0,
                orphans_kept_memory: false,
                release_after_children_ms: None,
                baseline,
            };
            if released.is_none() {
                trial.leftover_bytes = probe
                    .sampler
                    .latest()
                    .and_then(|s| s.used)
                    .unwrap_or(0)
                    .saturating_sub(baseline);
                if h.children_alive() {
                    trial.orphans_kept_memory = true;
                    let t = probe.sampler.now_ms();
                    h.kill_children();
                    trial.release_after_children_ms = probe
                        .first_since(t, probe.timeout, |u| u <= baseline + tol)
                        .map(|s| s.t_ms - t);
                }
            }
            let samples = probe.sampler.since(t_signal_ms - 200.0);
            trial.resolution_ms = max_gap(&samples, released.map_or(t_signal_ms, |s| s.t_ms));
            trial.t_end_ms = probe.sampler.now_ms();
            on_trial(&trial, trials.len() + 1, total);
            trials.push(trial);
            drop(holders);
            // Let a lagging release of this trial finish before the next baseline.
            let _ = probe.first_since(probe.sampler.now_ms(), probe.timeout, |u| {
                u <= baseline + tol
            });
        }
    }
    Ok(trials)
}

/// One kill of the concurrent experiment.
#[derive(Debug, Clone, Serialize)]
pub struct Kill {
    /// Order of the kill, from 1.
    pub order: u32,
    /// The holder's pid.
    pub pid: u32,
    /// When, ms since the epoch.
    pub t_signal_ms: f64,
    /// Signal → this holder's memory back, ms.
    pub release_ms: Option<f64>,
}

/// The concurrent experiment's result.
#[derive(Debug, Clone, Serialize)]
pub struct Concurrent {
    /// The random seed of the kill order.
    pub seed: u64,
    /// Kills, in order.
    pub kills: Vec<Kill>,
    /// First kill → everything back, ms.
    pub total_ms: Option<f64>,
    /// Bytes above the baseline at the end (memory left without a process).
    pub leftover_bytes: u64,
    /// Baseline.
    pub baseline: u64,
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Start `workers` holders at once and kill them one by one.
pub fn concurrent(
    probe: &Probe,
    bytes: u64,
    workers: u32,
    random: bool,
    seed: u64,
    sig: i32,
    on_kill: &mut dyn FnMut(&Kill, usize, usize),
) -> Result<Concurrent, ProbeError> {
    let tol = tolerance(bytes);
    let baseline = probe.baseline()?;
    let mut holders = probe.start_visible(bytes, workers, 0, baseline)?;
    let mut order: Vec<usize> = (0..holders.len()).collect();
    let mut state = seed.max(1);
    if random {
        for i in (1..order.len()).rev() {
            let j = (xorshift(&mut state) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
    }
    let mut kills = Vec::new();
    let first = probe.sampler.now_ms();
    for (k, &i) in order.iter().enumerate() {
        let pre = probe.sampler.latest().and_then(|s| s.used).unwrap_or(0);
        let t = probe.sampler.now_ms();
        holders[i].signal(sig);
        holders[i].wait_exit(probe.timeout);
        let back = probe.first_since(t, probe.timeout, |u| u + bytes <= pre + tol);
        let kill = Kill {
            order: k as u32 + 1,
            pid: holders[i].pid,
            t_signal_ms: t,
            release_ms: back.map(|s| s.t_ms - t),
        };
        on_kill(&kill, k + 1, order.len());
        kills.push(kill);
    }
    let done = probe.first_since(first, probe.timeout, |u| u <= baseline + tol);
    let leftover = probe
        .sampler
        .latest()
        .and_then(|s| s.used)
        .unwrap_or(0)
        .saturating_sub(baseline);
    drop(holders);
    Ok(Concurrent {
        seed,
        kills,
        total_ms: done.map(|s| s.t_ms - first),
        leftover_bytes: if done.is_some() { 0 } else { leftover },
        baseline,
    })
}

/// One soak cycle.
#[derive(Debug, Clone, Serialize)]
pub struct Cycle {
    /// When it began, ms since the epoch.
    pub t_ms: f64,
    /// The signal used.
    pub signal: String,
    /// Used memory once the holder was gone (the baseline the trend is fitted on).
    pub baseline_after: u64,
    /// Signal → memory back to the previous baseline, ms.
    pub release_ms: Option<f64>,
}

/// The soak's result.
#[derive(Debug, Clone, Serialize)]
pub struct Soak {
    /// Cycles.
    pub cycles: Vec<Cycle>,
    /// Trend of the baseline, bytes per hour, with its 95% interval.
    pub trend_bytes_per_hour: Option<Trend>,
    /// Baseline at the start.
    pub baseline_start: u64,
    /// Baseline at the end.
    pub baseline_end: u64,
}

/// Allocate and free for `duration`, every `cycle`, and fit the trend of the baseline.
/// `on_cycle` is told each cycle as it ends, with the time since the soak began (a soak runs
/// for half an hour by default: the command line shows progress from it).
pub fn soak(
    probe: &Probe,
    bytes: u64,
    duration: Duration,
    cycle: Duration,
    signals: &[(String, i32)],
    on_cycle: &mut dyn FnMut(&Cycle, Duration),
) -> Result<Soak, ProbeError> {
    let tol = tolerance(bytes);
    let start = Instant::now();
    let baseline_start = probe.baseline()?;
    let mut baseline = baseline_start;
    let mut cycles = Vec::new();
    let mut k = 0usize;
    while start.elapsed() < duration {
        let began = Instant::now();
        let (name, sig) = &signals[k % signals.len()];
        k += 1;
        let mut holders = probe.start_visible(bytes, 1, 0, baseline)?;
        let t = probe.sampler.now_ms();
        holders[0].signal(*sig);
        holders[0].wait_exit(probe.timeout);
        let settle = cycle.max(Duration::from_millis(200)).min(probe.timeout);
        let back = probe.first_since(t, settle, |u| u <= baseline + tol);
        drop(holders);
        baseline = probe
            .sampler
            .median_over(Duration::from_millis(30))
            .unwrap_or(baseline);
        cycles.push(Cycle {
            t_ms: probe.ms(began),
            signal: name.clone(),
            baseline_after: baseline,
            release_ms: back.map(|s| s.t_ms - t),
        });
        if let Some(done) = cycles.last() {
            on_cycle(done, start.elapsed());
        }
        if let Some(rest) = cycle.checked_sub(began.elapsed()) {
            std::thread::sleep(rest);
        }
    }
    let points: Vec<(f64, f64)> = cycles
        .iter()
        .map(|c| (c.t_ms / 3_600_000.0, c.baseline_after as f64))
        .collect();
    Ok(Soak {
        trend_bytes_per_hour: theil_sen(&points),
        baseline_start,
        baseline_end: baseline,
        cycles,
    })
}
