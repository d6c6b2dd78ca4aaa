//! What the core's tests share: the view `status` has of a node before it decides whether to
//! read every process, and what must then hold of the full scan.

use std::collections::BTreeSet;
use vramguard_core::plan::{ReclaimOptions, plan_reclaim};
use vramguard_core::{Policy, Snapshot, classify, full_scan_needed};

/// What `status` collects before deciding whether to read every process (a Holders-depth
/// collection of a fresh collector): the listed pids, the processes whose innermost `NSpid`
/// is a listed pid that is no process here, and their parent and group-leader chains, with
/// their own open files; nothing departed, no work window.
pub fn listed_only_view(full: &Snapshot) -> Snapshot {
    let listed: BTreeSet<u32> = full
        .gpus
        .iter()
        .flat_map(|g| g.processes.iter().map(|p| p.pid))
        .collect();
    let mut queue: Vec<u32> = listed
        .iter()
        .copied()
        .filter(|p| full.process(*p).is_some())
        .collect();
    for p in &full.processes {
        if p.nspid.len() > 1
            && p.nspid
                .last()
                .is_some_and(|inner| listed.contains(inner) && full.process(*inner).is_none())
        {
            queue.push(p.pid);
        }
    }
    let mut keep = BTreeSet::new();
    while let Some(pid) = queue.pop() {
        let Some(p) = full.process(pid) else { continue };
        if !keep.insert(pid) {
            continue;
        }
        queue.extend(
            [p.ppid, p.pgid]
                .into_iter()
                .flatten()
                .filter(|r| *r > 0 && *r != pid),
        );
    }
    let mut s = full.clone();
    s.processes.retain(|p| keep.contains(&p.pid));
    s.scan.full_fd_scan = false;
    s.departed.clear();
    s.work = None;
    s
}

/// When `status` would answer from `shallow` (nothing asks for a full scan), what the full
/// scan `full` says must agree: no ghost, unexplained or reclaimable byte, no default reclaim
/// target, and every listed holder with the same class, bytes and job verdict. `Ok(false)`
/// when `status` would read every process anyway.
pub fn listed_answer_agrees(full: &Snapshot, shallow: &Snapshot) -> Result<bool, String> {
    let policy = Policy::default();
    let quick = classify(shallow, &policy);
    if full_scan_needed(shallow, &quick).is_some() {
        return Ok(false);
    }
    let truth = classify(full, &policy);
    for g in &truth.gpus {
        if g.ghost_bytes > 0 || g.reclaimable_bytes > 0 || g.unexplained_bytes() > 0 {
            return Err(format!(
                "GPU {}: the full scan finds ghost {} / reclaimable {} / unexplained {} bytes",
                g.index,
                g.ghost_bytes,
                g.reclaimable_bytes,
                g.unexplained_bytes()
            ));
        }
        if g.unaccounted.as_ref().is_some_and(|u| u.significant) {
            return Err(format!(
                "GPU {}: unaccounted memory in the full scan",
                g.index
            ));
        }
    }
    let plan = plan_reclaim(full, &truth, &ReclaimOptions::default());
    if let Some(t) = plan.targets().next() {
        return Err(format!("the full scan finds a default target: {}", t.pid));
    }
    for (qg, tg) in quick.gpus.iter().zip(&truth.gpus) {
        for h in qg.holders.iter().filter(|h| h.listed) {
            let Some(t) = tg.holders.iter().find(|t| t.pid == h.pid && t.listed) else {
                return Err(format!(
                    "listed holder {} missing from the full scan",
                    h.pid
                ));
            };
            if (t.class, t.used_bytes, t.dead_job.is_some())
                != (h.class, h.used_bytes, h.dead_job.is_some())
            {
                return Err(format!(
                    "holder {}: {:?} {:?} dead job {} from the listed processes, {:?} {:?} {} \
                     from the full scan",
                    h.pid,
                    h.class,
                    h.used_bytes,
                    h.dead_job.is_some(),
                    t.class,
                    t.used_bytes,
                    t.dead_job.is_some()
                ));
            }
        }
    }
    Ok(true)
}
