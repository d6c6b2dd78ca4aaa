//! What `status` shows of a node: a report made from the driver's listed processes when they
//! explain every byte, and from a deeper collection only when something is left to settle
//! (see [`vramguard_core::scan_need`]).

use std::time::Duration;
use vramguard_core::snapshot::Snapshot;
use vramguard_core::{Policy, Report, ScanNeed, WatchFor, classify, full_scan_needed};
use vramguard_node::{Node, NodeError};
use vramguard_proc::ScanDepth;

/// A report and the snapshot it was made from; `deeper` says why a collection deeper than the
/// listed processes was taken, when one was.
#[derive(Debug)]
pub struct StatusView {
    /// What was collected.
    pub snapshot: Snapshot,
    /// Its classification.
    pub report: Report,
    /// Why the listed processes were not enough, when they were not.
    pub deeper: Option<ScanNeed>,
}

/// Reads the listed processes (their facts, relatives, jobs and open files) and classifies
/// them; when [`full_scan_needed`] names a reason, collects again at `deeper` (a full scan, or
/// the new processes for a refresh after one) with `sample` of work watched where a class
/// rests on it.
pub fn status_view(
    node: &mut dyn Node,
    policy: &Policy,
    sample: Duration,
    deeper: ScanDepth,
) -> Result<StatusView, NodeError> {
    let snapshot = node.snapshot(ScanDepth::Holders)?;
    let report = classify(&snapshot, policy);
    let Some(why) = full_scan_needed(&snapshot, &report) else {
        return Ok(StatusView {
            snapshot,
            report,
            deeper: None,
        });
    };
    let snapshot = node.sampled_snapshot_for(deeper, sample, WatchFor::Classes)?;
    let report = classify(&snapshot, policy);
    Ok(StatusView {
        snapshot,
        report,
        deeper: Some(why),
    })
}
