//! The GPU side of `pick` and `run`: choosing the GPUs with the most free memory, and
//! following a job's GPU memory until the driver has it back.

use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use vramguard_core::Policy;
use vramguard_core::release::ReleaseWatch;
use vramguard_node::{Node, NodeError};

/// What `pick` (and `run --gpus auto:N`) asks for.
#[derive(Debug, Clone)]
pub struct PickOptions {
    /// How many GPUs.
    pub count: usize,
    /// Only GPUs with at least this much free memory.
    pub min_free: u64,
    /// How long to wait for enough GPUs to become free.
    pub wait: Duration,
    /// Name them by UUID instead of index.
    pub by_uuid: bool,
}

/// What `pick` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Picked {
    /// The GPUs, in index order, as indices or UUIDs.
    Chosen(Vec<String>),
    /// Not enough GPUs had the memory free when the wait ended.
    NotEnough {
        /// How many did.
        free: usize,
        /// How many GPUs the node has.
        gpus: usize,
    },
    /// The node has fewer GPUs than asked for: no wait can help (a usage error).
    TooFew {
        /// How many GPUs the node has.
        gpus: usize,
    },
}

/// How often `pick` looks again while it waits.
const PICK_POLL: Duration = Duration::from_millis(500);

/// The `count` GPUs with the most free memory (at least `min_free`), waiting up to `wait`
/// (on the node's clock) for enough of them.
pub fn pick(node: &mut dyn Node, opts: &PickOptions) -> Result<Picked, NodeError> {
    let deadline = node.clock().now() + opts.wait;
    loop {
        let gpus = node.gpus()?;
        if gpus.len() < opts.count {
            return Ok(Picked::TooFew { gpus: gpus.len() });
        }
        let mut free: Vec<(u64, u32, Option<String>)> = gpus
            .iter()
            .filter(|g| g.failure.is_none())
            .filter_map(|g| g.memory.map(|m| (m.free, g.index, g.uuid.clone())))
            .filter(|(f, _, _)| *f >= opts.min_free)
            .collect();
        if free.len() >= opts.count {
            free.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut chosen: Vec<(u32, Option<String>)> = free
                .into_iter()
                .take(opts.count)
                .map(|(_, i, u)| (i, u))
                .collect();
            chosen.sort_by_key(|c| c.0);
            let names = chosen
                .into_iter()
                .map(|(i, u)| match u {
                    Some(uuid) if opts.by_uuid => uuid,
                    _ => i.to_string(),
                })
                .collect();
            return Ok(Picked::Chosen(names));
        }
        let now = node.clock().now();
        if now >= deadline {
            return Ok(Picked::NotEnough {
                free: free.len(),
                gpus: gpus.len(),
            });
        }
        node.clock()
            .sleep(PICK_POLL.min(deadline.saturating_duration_since(now)));
    }
}

/// One GPU a job used, as `run` reports it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuUse {
    /// Index.
    pub index: u32,
    /// UUID.
    pub uuid: Option<String>,
    /// Installed memory.
    pub total: u64,
    /// The most the job's processes held at once.
    pub peak_job_bytes: u64,
    #[serde(skip)]
    last_used: u64,
    #[serde(skip)]
    last_job: u64,
    /// Whether the driver had the memory back after the job (`None`: not checked).
    pub released: Option<bool>,
    /// How long after the job ended it was back.
    pub release_ms: Option<u64>,
    /// What still held it, when it was not back.
    pub still_held: Vec<String>,
}

/// Follows a job's GPU memory while it runs, then waits for the driver to release it.
#[derive(Debug, Default)]
pub struct JobGpus {
    policy: Policy,
    /// Every GPU the job used.
    pub gpus: BTreeMap<u32, GpuUse>,
}

impl JobGpus {
    /// Follows a job under `policy` (its tolerance says when memory is back).
    pub fn new(policy: Policy) -> JobGpus {
        JobGpus {
            policy,
            gpus: BTreeMap::new(),
        }
    }

    /// Looks at the GPUs once; `pids` are the job's processes now.
    pub fn tick(&mut self, node: &mut dyn Node, pids: &[u32]) {
        let Ok(gpus) = node.gpus() else {
            return;
        };
        let job: BTreeSet<u32> = pids.iter().copied().collect();
        for g in &gpus {
            let Some(mem) = g.memory else { continue };
            let job_bytes: u64 = g
                .processes
                .iter()
                .filter(|p| job.contains(&p.pid))
                .filter_map(|p| p.used_bytes)
                .sum();
            if job_bytes == 0 && !self.gpus.contains_key(&g.index) {
                continue;
            }
            let u = self.gpus.entry(g.index).or_insert_with(|| GpuUse {
                index: g.index,
                uuid: g.uuid.clone(),
                total: mem.total,
                ..GpuUse::default()
            });
            u.peak_job_bytes = u.peak_job_bytes.max(job_bytes);
            u.last_used = mem.used;
            u.last_job = job_bytes;
        }
    }

    /// Waits up to `timeout` until the memory the job held last is free on every GPU it used;
    /// release times count from `job_gone`. Returns the GPUs whose memory did not come back.
    pub fn wait_release(
        &mut self,
        node: &mut dyn Node,
        timeout: Duration,
        job_gone: Instant,
    ) -> Vec<u32> {
        let deadline = node.clock().now() + timeout;
        let mut pending: BTreeMap<u32, ReleaseWatch> = self
            .gpus
            .iter()
            .filter(|(_, u)| u.last_job > 0)
            .map(|(i, u)| {
                let w = ReleaseWatch::new(*i, u.total, u.last_used, u.last_job, &self.policy);
                (*i, w)
            })
            .collect();
        for u in self.gpus.values_mut().filter(|u| u.last_job == 0) {
            u.released = Some(true);
        }
        while !pending.is_empty() {
            let now = node.clock().now();
            let after_ms = now.saturating_duration_since(job_gone).as_millis() as u64;
            for (gpu, w) in &mut pending {
                let Ok(used) = node.memory_used(*gpu) else {
                    continue;
                };
                if w.observe(used, after_ms)
                    && let Some(u) = self.gpus.get_mut(gpu)
                {
                    u.released = Some(true);
                    u.release_ms = w.released_after_ms();
                }
            }
            pending.retain(|_, w| !w.released());
            if pending.is_empty() || now >= deadline {
                break;
            }
            node.clock().sleep(Duration::from_millis(20));
        }
        for i in pending.keys() {
            if let Some(u) = self.gpus.get_mut(i) {
                u.released = Some(false);
            }
        }
        pending.into_keys().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vramguard_node::Clock;
    use vramguard_node::fake::FakeNode;

    const GIB: u64 = 1 << 30;

    /// The demo incident's GPUs: GPU 0 80 GiB with 18 GiB of orphans and 2 GiB of hidden
    /// memory on it plus a live job, GPU 1 with a live job and 6 GiB of residue.
    fn demo() -> FakeNode {
        FakeNode::incident("demo")
    }

    fn free_of(node: &mut FakeNode) -> Vec<(u32, u64)> {
        node.gpus()
            .unwrap()
            .iter()
            .map(|g| (g.index, g.memory.unwrap().free))
            .collect()
    }

    #[test]
    fn pick_names_the_gpus_with_most_free_memory_in_index_order() {
        let mut node = demo();
        let free = free_of(&mut node);
        let most = free.iter().max_by_key(|f| f.1).unwrap().0;
        let opts = PickOptions {
            count: 1,
            min_free: 0,
            wait: Duration::ZERO,
            by_uuid: false,
        };
        assert_eq!(
            pick(&mut node, &opts).unwrap(),
            Picked::Chosen(vec![most.to_string()])
        );
        let both = PickOptions { count: 2, ..opts };
        assert_eq!(
            pick(&mut node, &both).unwrap(),
            Picked::Chosen(vec!["0".into(), "1".into()])
        );
        // More GPUs than the node has: said at once, whatever the wait.
        let three = PickOptions {
            count: 3,
            wait: Duration::from_secs(600),
            ..opts
        };
        let t0 = node.manual_clock().elapsed();
        assert_eq!(pick(&mut node, &three).unwrap(), Picked::TooFew { gpus: 2 });
        assert_eq!(
            node.manual_clock().elapsed(),
            t0,
            "no wait for the impossible"
        );
    }

    #[test]
    fn pick_waits_on_the_clock_for_memory_to_come_free_and_gives_up_at_the_deadline() {
        let mut node = demo();
        let gpu0_free = free_of(&mut node)[0].1;
        // Two GPUs with 4 GiB more than GPU 0 has free: only GPU 1 has that.
        let opts = PickOptions {
            count: 2,
            min_free: gpu0_free + 4 * GIB,
            wait: Duration::from_secs(60),
            by_uuid: false,
        };
        let t0 = node.manual_clock().elapsed();
        assert_eq!(
            pick(&mut node, &opts).unwrap(),
            Picked::NotEnough { free: 1, gpus: 2 }
        );
        assert_eq!(node.manual_clock().elapsed() - t0, Duration::from_secs(60));
        // An orphan of 8 GiB on GPU 0 exits 10 s from now; the driver lets go 200 ms later.
        node.exit_after(16521, Duration::from_secs(10));
        let t0 = node.manual_clock().elapsed();
        assert_eq!(
            pick(&mut node, &opts).unwrap(),
            Picked::Chosen(vec!["0".into(), "1".into()])
        );
        let waited = node.manual_clock().elapsed() - t0;
        assert!(
            waited >= Duration::from_millis(10_200) && waited <= Duration::from_millis(10_700),
            "{waited:?}"
        );
    }

    #[test]
    fn a_jobs_memory_is_followed_and_its_release_timed_from_the_end_of_the_job() {
        let mut node = demo();
        node.release_lag(Duration::from_millis(1500));
        // As if 16521 and 16522 (8 GiB each on GPU 0) were the job.
        let job = [16521, 16522];
        let mut gpus = JobGpus::new(Policy::default());
        gpus.tick(&mut node, &job);
        assert_eq!(gpus.gpus[&0].peak_job_bytes, 16 * GIB);
        assert!(!gpus.gpus.contains_key(&1), "the job used no memory there");
        node.exit(16521).exit(16522);
        let gone = node.manual_clock().now();
        let stuck = gpus.wait_release(&mut node, Duration::from_secs(10), gone);
        assert!(stuck.is_empty());
        let u = &gpus.gpus[&0];
        assert_eq!(u.released, Some(true));
        let ms = u.release_ms.unwrap();
        assert!((1500..=1520).contains(&ms), "{ms}");
    }

    #[test]
    fn memory_that_does_not_come_back_is_reported_after_the_timeout() {
        let mut node = demo();
        let mut gpus = JobGpus::new(Policy::default());
        gpus.tick(&mut node, &[16521]);
        // The job's process is gone from the job's view but still holds its memory.
        let gone = node.manual_clock().now();
        let stuck = gpus.wait_release(&mut node, Duration::from_secs(5), gone);
        assert_eq!(stuck, [0]);
        assert_eq!(gpus.gpus[&0].released, Some(false));
        assert_eq!(node.manual_clock().now() - gone, Duration::from_secs(5));
    }
}
