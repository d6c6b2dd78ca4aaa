//! Taking a snapshot: the driver first (it names the holders), then `/proc`.

use std::time::Duration;
use vramguard_core::Policy;
use vramguard_core::snapshot::Snapshot;
use vramguard_gpu::{GpuSource, SourceError};
use vramguard_proc::{ProcCollector, ProcError, ScanDepth};

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

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One collection.
pub fn take_snapshot(
    source: &mut dyn GpuSource,
    collector: &mut ProcCollector,
    policy: &Policy,
    depth: ScanDepth,
) -> Result<Snapshot, SnapshotError> {
    let driver = source.sample(Duration::from_secs(policy.idle_after_secs.max(1)))?;
    let listed: Vec<u32> = driver
        .gpus
        .iter()
        .flat_map(|g| g.processes.iter().map(|p| p.pid))
        .collect();
    let now = now_ms();
    let procs = collector.collect(&listed, depth, now)?;
    let mut snap = Snapshot {
        taken_at_ms: now,
        host: procs.host,
        driver: driver.driver,
        gpus: driver.gpus,
        processes: procs.processes,
        departed: procs.departed,
        scan: procs.scan,
    };
    snap.normalize();
    Ok(snap)
}
