//! "Is the memory back?": one GPU watched after processes holding memory on it exited (killed
//! by `reclaim`, a job ending under `run`, an exit the agent saw). Pure: the caller samples the
//! GPU's used memory and says how long after the exit each sample was taken.

use crate::Policy;

/// Watches one GPU until its used memory falls to what it was without the exited memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseWatch {
    /// The GPU index.
    pub gpu: u32,
    /// Used bytes before the exit.
    pub used_before: u64,
    /// Bytes the exited processes held.
    pub expected_bytes: u64,
    /// Released once used memory is at or below this: before − expected + tolerance.
    threshold: u64,
    /// A drop larger than this counts as the driver starting to free.
    drop_tolerance: u64,
    first_drop_ms: Option<u64>,
    released_ms: Option<u64>,
    last_used: Option<u64>,
}

impl ReleaseWatch {
    /// Starts watching `gpu` (of `total` bytes) that had `used_before` used, of which the
    /// exited processes held `expected_bytes`; the policy's tolerance absorbs other jobs'
    /// allocator noise meanwhile.
    pub fn new(
        gpu: u32,
        total: u64,
        used_before: u64,
        expected_bytes: u64,
        policy: &Policy,
    ) -> Self {
        ReleaseWatch {
            gpu,
            used_before,
            expected_bytes,
            threshold: used_before
                .saturating_sub(expected_bytes)
                .saturating_add(policy.tolerance_for(total)),
            drop_tolerance: policy.tolerance_bytes.min(used_before),
            first_drop_ms: None,
            released_ms: None,
            last_used: None,
        }
    }

    /// The used memory at or below which the memory is back.
    pub fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Records a sample of `used` bytes taken `after_ms` after the exit; true once released.
    pub fn observe(&mut self, used: u64, after_ms: u64) -> bool {
        self.last_used = Some(used);
        if used.saturating_add(self.drop_tolerance) < self.used_before {
            self.first_drop_ms.get_or_insert(after_ms);
        }
        if used <= self.threshold {
            self.released_ms.get_or_insert(after_ms);
        }
        self.released()
    }

    /// Whether the memory came back.
    pub fn released(&self) -> bool {
        self.released_ms.is_some()
    }

    /// How long after the exit it came back.
    pub fn released_after_ms(&self) -> Option<u64> {
        self.released_ms
    }

    /// How long after the exit the used memory first dropped.
    pub fn first_drop_after_ms(&self) -> Option<u64> {
        self.first_drop_ms
    }

    /// The last sample.
    pub fn last_used(&self) -> Option<u64> {
        self.last_used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn policy() -> Policy {
        Policy {
            tolerance_bytes: 256 << 20,
            tolerance_ratio: 0.0,
            ..Policy::default()
        }
    }

    #[test]
    fn released_when_the_exited_memory_is_back_within_tolerance() {
        let mut w = ReleaseWatch::new(0, 80 * GIB, 30 * GIB, 8 * GIB, &policy());
        assert_eq!(w.threshold(), 22 * GIB + (256 << 20));
        assert!(!w.observe(30 * GIB, 100), "nothing freed yet");
        assert!(!w.observe(26 * GIB, 400), "half freed");
        assert_eq!(w.first_drop_after_ms(), Some(400));
        // Another job allocated 200 MiB meanwhile: still within the tolerance.
        assert!(w.observe(22 * GIB + (200 << 20), 900));
        assert_eq!(w.released_after_ms(), Some(900));
        assert!(w.observe(30 * GIB, 1000), "released stays released");
        assert_eq!(w.released_after_ms(), Some(900));
        assert_eq!(w.last_used(), Some(30 * GIB));
    }

    #[test]
    fn a_drop_within_noise_is_not_a_first_drop() {
        let mut w = ReleaseWatch::new(1, 80 * GIB, 10 * GIB, 4 * GIB, &policy());
        w.observe(10 * GIB - (100 << 20), 50);
        assert_eq!(w.first_drop_after_ms(), None);
        assert!(!w.released());
    }

    #[test]
    fn the_tolerance_scales_with_the_gpu() {
        let p = Policy {
            tolerance_bytes: 256 << 20,
            tolerance_ratio: 0.01,
            ..Policy::default()
        };
        let w = ReleaseWatch::new(0, 100 * GIB, 50 * GIB, 10 * GIB, &p);
        assert_eq!(w.threshold(), 40 * GIB + GIB);
    }
}
