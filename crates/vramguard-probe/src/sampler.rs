//! A thread that reads one GPU's used memory at a fixed rate and timestamps every reading.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use vramguard_gpu::GpuSource;

/// One reading.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Sample {
    /// Milliseconds since the experiment's epoch.
    pub t_ms: f64,
    /// Used bytes; `None` when the call failed.
    pub used: Option<u64>,
}

/// A running sampler.
pub struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    handle: Option<JoinHandle<Box<dyn GpuSource>>>,
    epoch: Instant,
}

impl Sampler {
    /// Starts reading `gpu` every `period`, timestamps relative to `epoch`.
    pub fn start(
        mut source: Box<dyn GpuSource>,
        gpu: u32,
        period: Duration,
        epoch: Instant,
    ) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::with_capacity(1 << 16)));
        let (s2, b2) = (stop.clone(), samples.clone());
        let handle = std::thread::spawn(move || {
            let mut next = Instant::now();
            while !s2.load(Ordering::Relaxed) {
                let used = source.memory_used(gpu).ok();
                let t_ms = epoch.elapsed().as_secs_f64() * 1000.0;
                b2.lock()
                    .expect("sampler buffer")
                    .push(Sample { t_ms, used });
                next += period;
                let now = Instant::now();
                if next > now {
                    std::thread::sleep(next - now);
                } else {
                    // Behind schedule (a slow driver call): do not try to catch up in a burst.
                    next = now;
                }
            }
            source
        });
        Sampler {
            stop,
            samples,
            handle: Some(handle),
            epoch,
        }
    }

    /// Milliseconds since the epoch, now.
    pub fn now_ms(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1000.0
    }

    /// The latest successful reading.
    pub fn latest(&self) -> Option<Sample> {
        let s = self.samples.lock().expect("sampler buffer");
        s.iter().rev().find(|s| s.used.is_some()).copied()
    }

    /// Readings taken at or after `t_ms`.
    pub fn since(&self, t_ms: f64) -> Vec<Sample> {
        let s = self.samples.lock().expect("sampler buffer");
        let start = s.partition_point(|x| x.t_ms < t_ms);
        s[start..].to_vec()
    }

    /// Waits until a reading taken after now satisfies `cond`, or `timeout`; returns it.
    pub fn wait_for(&self, timeout: Duration, cond: impl Fn(u64) -> bool) -> Option<Sample> {
        let from = self.now_ms();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(hit) = self
                .since(from)
                .into_iter()
                .find(|s| s.used.is_some_and(&cond))
            {
                return Some(hit);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The median used memory over the next `span`.
    pub fn median_over(&self, span: Duration) -> Option<u64> {
        let from = self.now_ms();
        std::thread::sleep(span);
        let mut v: Vec<u64> = self
            .since(from)
            .into_iter()
            .filter_map(|s| s.used)
            .collect();
        if v.is_empty() {
            return self.latest().and_then(|s| s.used);
        }
        v.sort_unstable();
        Some(v[v.len() / 2])
    }

    /// Stops, returning the source and every reading.
    pub fn stop(mut self) -> (Box<dyn GpuSource>, Vec<Sample>) {
        self.stop.store(true, Ordering::Relaxed);
        let source = self
            .handle
            .take()
            .expect("started")
            .join()
            .expect("sampler thread panicked");
        let samples = std::mem::take(&mut *self.samples.lock().expect("sampler buffer"));
        (source, samples)
    }
}
