//! Recent history: the series the leak trends are fitted on and the status page's timeline.

use std::collections::{BTreeMap, HashMap, VecDeque};
use vramguard_core::trend::{Trend, theil_sen};

/// Points kept per window: a 30-minute window sampled every second would be 1,800 points per
/// series; kept as 240 buckets (one per 7.5 s, holding the bucket's latest value) the memory
/// of a series is bounded whatever the interval, and a leak shows just the same.
const BUCKETS: f64 = 240.0;

/// Points fitted at most: evenly thinned to this many, a fit costs ~1,800 pairwise slopes.
const FIT_POINTS: usize = 60;

/// A time series over a sliding window. Time in seconds since the agent started.
#[derive(Debug, Clone, Default)]
pub struct Series {
    /// (start of the bucket, latest value in it), oldest first.
    points: VecDeque<(f64, f64)>,
}

impl Series {
    /// Records a value at `t` (into the current bucket, or a new one) and forgets buckets
    /// older than `window_secs`.
    pub fn push(&mut self, t: f64, v: f64, window_secs: f64) {
        let width = window_secs / BUCKETS;
        match self.points.back_mut() {
            Some(back) if t - back.0 < width => back.1 = v,
            _ => self.points.push_back((t, v)),
        }
        while self
            .points
            .front()
            .is_some_and(|(t0, _)| t - t0 > window_secs)
        {
            self.points.pop_front();
        }
    }

    /// The points, oldest first.
    pub fn points(&self) -> impl Iterator<Item = &(f64, f64)> {
        self.points.iter()
    }

    /// Theil–Sen slope (per second) over the window; `None` until it covers `min_span` seconds.
    pub fn trend(&self, min_span: f64) -> Option<Trend> {
        let (first, last) = (self.points.front()?, self.points.back()?);
        if last.0 - first.0 < min_span {
            return None;
        }
        let n = self.points.len();
        let step = n.div_ceil(FIT_POINTS).max(1);
        let pts: Vec<(f64, f64)> = self.points.iter().step_by(step).copied().collect();
        theil_sen(&pts)
    }
}

/// A holder's identity across samples.
pub type HolderKey = (u32, u32, u64);

/// (time in seconds, used bytes, ghost bytes) samples of one GPU, oldest first.
pub type Timeline = VecDeque<(f64, u64, u64)>;

/// Timelines by GPU index.
pub type Timelines = BTreeMap<u32, Timeline>;

/// Everything the agent remembers between samples.
#[derive(Debug, Default)]
pub struct History {
    /// Used bytes per GPU (trend window).
    pub gpu_used: BTreeMap<u32, Series>,
    /// Used memory of each holder, by (gpu, pid, start ticks) (trend window).
    pub holder_used: HashMap<HolderKey, Series>,
    /// (used, ghost) bytes per GPU (timeline window).
    pub timeline: Timelines,
}

impl History {
    /// Records one sample of a GPU.
    pub fn record_gpu(
        &mut self,
        gpu: u32,
        t: f64,
        used: u64,
        ghost: u64,
        trend_window: f64,
        timeline_window: f64,
    ) {
        self.gpu_used
            .entry(gpu)
            .or_default()
            .push(t, used as f64, trend_window);
        let tl = self.timeline.entry(gpu).or_default();
        tl.push_back((t, used, ghost));
        while tl
            .front()
            .is_some_and(|(t0, _, _)| t - t0 > timeline_window)
        {
            tl.pop_front();
        }
    }

    /// Records a holder's memory.
    pub fn record_holder(&mut self, key: HolderKey, t: f64, used: u64, window: f64) {
        self.holder_used
            .entry(key)
            .or_default()
            .push(t, used as f64, window);
    }

    /// Forgets holders that are not `present` any more, and any series not fed for a whole
    /// window.
    pub fn prune(&mut self, t: f64, window: f64, present: &std::collections::HashSet<HolderKey>) {
        self.holder_used.retain(|k, s| {
            present.contains(k) && s.points.back().is_some_and(|(last, _)| t - last <= window)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_that_is_gone_is_forgotten_at_once() {
        let mut h = History::default();
        h.record_holder((0, 10, 1), 0.0, 100, 1800.0);
        h.record_holder((0, 11, 1), 0.0, 100, 1800.0);
        let present: std::collections::HashSet<HolderKey> = [(0, 10, 1)].into_iter().collect();
        h.prune(1.0, 1800.0, &present);
        assert_eq!(
            h.holder_used.keys().copied().collect::<Vec<_>>(),
            vec![(0, 10, 1)]
        );
        // Present but not fed for a whole window: forgotten too.
        h.prune(2000.0, 1800.0, &present);
        assert!(h.holder_used.is_empty());
    }

    #[test]
    fn the_window_slides_and_the_trend_sees_a_leak() {
        let mut s = Series::default();
        for i in 0..3600 {
            s.push(
                i as f64,
                1000.0 + 2.0 * i as f64 + ((i * 37) % 11) as f64,
                1800.0,
            );
        }
        assert!(s.points().count() <= 241, "bounded: {}", s.points().count());
        let t = s.trend(60.0).unwrap();
        assert!((t.slope - 2.0).abs() < 0.05, "{t:?}");
        assert!(t.rising());
        assert!(Series::default().trend(0.0).is_none());
        let mut short = Series::default();
        for i in 0..10 {
            short.push(i as f64, i as f64, 100.0);
        }
        assert!(short.trend(60.0).is_none(), "needs a minimum span");
    }
}
