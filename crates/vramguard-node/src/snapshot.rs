//! Taking a snapshot: the driver first (it names the holders), then `/proc`.

use crate::clock::Clock;
use std::time::Duration;
use vramguard_core::Policy;
use vramguard_core::snapshot::Snapshot;
use vramguard_gpu::{GpuSource, SourceError};
use vramguard_proc::{ProcCollector, ProcError, ScanDepth, WorkSampler};

/// Why no snapshot could be taken.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The GPU source failed as a whole.
    #[error(transparent)]
    Gpu(#[from] SourceError),
    /// `/proc` could not be read.
    #[error(transparent)]
    Proc(#[from] ProcError),
}

/// One collection.
pub fn take_snapshot(
    source: &mut dyn GpuSource,
    collector: &mut ProcCollector,
    policy: &Policy,
    depth: ScanDepth,
    clock: &dyn Clock,
) -> Result<Snapshot, SnapshotError> {
    let driver = source.sample(Duration::from_secs(policy.idle_after_secs.max(1)))?;
    let listed: Vec<u32> = driver
        .gpus
        .iter()
        .flat_map(|g| g.processes.iter().map(|p| p.pid))
        .collect();
    let now = clock.wall_ms();
    let procs = collector.collect(&listed, depth, now)?;
    let mut snap = Snapshot {
        taken_at_ms: now,
        host: procs.host,
        driver: driver.driver,
        gpus: driver.gpus,
        processes: procs.processes,
        departed: procs.departed,
        scan: procs.scan,
        work: None,
        job_cgroups: procs.job_cgroups,
        host_memory: Some(procs.host_memory),
        kubelet_pods: None,
    };
    snap.normalize();
    Ok(snap)
}

/// Adds to `snap` the descendants of `roots` it lacks (see
/// [`ProcCollector::add_descendants`]), noting the roots whose descendants could not all be
/// read; the snapshot stays sorted by pid whatever happens.
pub fn add_descendants(
    collector: &mut ProcCollector,
    snap: &mut Snapshot,
    roots: &[u32],
) -> Result<(), ProcError> {
    let before = snap.processes.len();
    let read = collector.add_descendants(&mut snap.processes, roots);
    if snap.processes.len() != before {
        snap.normalize();
    }
    let read = read?;
    for root in read.unread_roots {
        snap.scan.limitations.push(format!(
            "the descendants of pid {root} could not all be read (more than {} of them, or a \
             process with more than {} threads): whether they work is unknown, so its job is \
             left alone",
            vramguard_proc::collector::MAX_DESCENDANTS_READ,
            vramguard_proc::procfs::MAX_THREADS_LOOKED_AT
        ));
        if !snap.scan.descendants_unread.contains(&root) {
            snap.scan.descendants_unread.push(root);
        }
    }
    Ok(())
}

/// How often the sampler looks at the processes during a window.
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(100);

/// One collection, then `window` of watching its processes work (CPU time, running
/// threads), attached as [`Snapshot::work`]. A zero window takes no sample: holders whose job
/// is gone then have unknown work and are never reclaim targets.
pub fn take_sampled_snapshot(
    source: &mut dyn GpuSource,
    collector: &mut ProcCollector,
    policy: &Policy,
    depth: ScanDepth,
    window: Duration,
    watch: vramguard_core::WatchFor,
    clock: &dyn Clock,
) -> Result<Snapshot, SnapshotError> {
    let mut snap = take_snapshot(source, collector, policy, depth, clock)?;
    if window.is_zero() {
        return Ok(snap);
    }
    // Only the processes whose class depends on work are watched; with none, there is
    // nothing to wait for. Their descendants are read first: a collection holds GPU holders
    // and their ancestors only.
    let mut report = vramguard_core::classify(&snap, policy);
    let roots = vramguard_core::classify::work_roots(&snap, policy, &report, watch);
    if !roots.is_empty() {
        add_descendants(collector, &mut snap, &roots)?;
        report = vramguard_core::classify(&snap, policy);
    }
    let pids = vramguard_core::classify::work_watch_list(&snap, policy, &report, watch);
    if pids.is_empty() {
        return Ok(snap);
    }
    let mut work = WorkSampler::sample_window(
        collector.procfs(),
        &pids,
        window,
        SAMPLE_PERIOD.min(window / 5).max(Duration::from_millis(10)),
        || clock.wall_ms(),
    )?;
    // Children started during the window were not watched (a trainer that starts its
    // checkpoint upload meanwhile): read again. A process started since is counted whole,
    // its CPU time all spent within the window.
    let watched: std::collections::HashSet<u32> = snap.processes.iter().map(|p| p.pid).collect();
    add_descendants(collector, &mut snap, &roots)?;
    let span = work.until_ms.saturating_sub(work.since_ms).max(1);
    for p in snap.processes.iter().filter(|p| !watched.contains(&p.pid)) {
        if let Ok(vramguard_proc::Found::Yes(probe)) = collector.procfs().work_probe(p.pid)
            && Some(probe.start_ticks) == p.start_ticks
        {
            work.processes.push(vramguard_core::snapshot::WorkSample {
                pid: p.pid,
                start_ticks: probe.start_ticks,
                cpu_ticks: probe.cpu_ticks,
                observed_ms: span,
                observations: 1,
                running_observations: u32::from(probe.running),
                waiting_observations: u32::from(probe.waiting),
            });
        }
    }
    work.processes.sort_by_key(|w| w.pid);
    snap.work = Some(work);
    snap.normalize();
    Ok(snap)
}
