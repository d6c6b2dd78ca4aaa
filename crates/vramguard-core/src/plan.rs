//! `plan_reclaim`: which processes `vramguard reclaim` may signal, and why each of the others
//! is left alone. Pure: the executor re-checks every target's identity before it acts.
//!
//! Safety rules (each has a test, and a property test checks them over random tables):
//! never PID 1 or the init of any PID namespace, never vramguard or its ancestors, never a
//! kernel thread, never an `active`, `system` or `foreign` holder, never another user's process
//! unless running as root, never a process whose start time is unknown (its pid could not be
//! told from a reused one), never anything that does not hold a GPU of the selection, and never
//! a process whose job showed work in the sampling window or whose work is unknown — except a
//! `detached` holder named explicitly with `--include detached`, which the plan warns about.

use crate::report::{Class, GpuReport, Holder, Report, Work};
use crate::snapshot::Snapshot;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// What to reclaim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimOptions {
    /// GPU indices to act on; `None` = every GPU.
    pub gpus: Option<BTreeSet<u32>>,
    /// Classes to target. Default: orphan and hidden (hidden only when its job is gone).
    /// `active`, `system` and `foreign` are never targeted, whatever this says; `detached`
    /// only when named here.
    pub include: BTreeSet<Class>,
    /// With `idle` included: only holders idle at least this long.
    pub idle_for_secs: u64,
    /// MIG device UUIDs to act on (their GPUs must be selected too); `None` = every MIG
    /// device. A holder on another MIG device is left alone.
    pub mig_devices: Option<BTreeSet<String>>,
    /// Only the job of this pid: the members of its dead job (same leader), or the pid alone
    /// when it has no dead job. Other holders are neither targets nor listed as left alone.
    #[serde(default)]
    pub job_of: Option<u32>,
    /// Only holders of this job, by its label as views show it (`slurm:4242` also matches
    /// its steps `slurm:4242.0`, `slurm:4242.batch`; `pod:<uid>`, `docker:<name>`,
    /// `pgid:N`). Others are neither targets nor listed as left alone (`--job`).
    #[serde(default)]
    pub job_label: Option<String>,
    /// Also remove orphaned shared-memory segments (`--include shm`), judged by this policy.
    #[serde(default)]
    pub include_shm: Option<crate::host::ShmPolicy>,
    /// Also idle keepers of an exited pid's context inside a live job that something else
    /// owns (a unit, a Slurm step, a pod or container, `vramguard run`): asked for by name
    /// (`--include keepers`), never by default nor by the agent. Keepers in a plain process
    /// group are default targets already.
    #[serde(default)]
    pub include_keepers: bool,
}

impl Default for ReclaimOptions {
    fn default() -> Self {
        ReclaimOptions {
            gpus: None,
            include: Class::default_targets().collect(),
            idle_for_secs: 2 * 3600,
            mig_devices: None,
            job_of: None,
            job_label: None,
            include_shm: None,
            include_keepers: false,
        }
    }
}

/// The memory a target holds on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetGpu {
    /// GPU index.
    pub gpu: u32,
    /// Bytes the driver charges to it; `None` for an unlisted (hidden) holder.
    pub bytes: Option<u64>,
}

/// A process the plan will signal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// Pid.
    pub pid: u32,
    /// Start time in clock ticks: the executor signals only this exact process.
    pub start_ticks: u64,
    /// Class that made it a target.
    pub class: Class,
    /// Command name.
    pub comm: Option<String>,
    /// Command line.
    pub command: Option<String>,
    /// Owner.
    pub uid: Option<u32>,
    /// The GPUs it holds.
    pub gpus: Vec<TargetGpu>,
    /// Why it is a target.
    pub evidence: Vec<String>,
}

/// Targets that belonged to one job (one dead process-group leader).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedJob {
    /// The dead leader's pid, when known.
    pub leader_pid: Option<u32>,
    /// Its command, when an earlier collection saw it.
    pub leader_command: Option<String>,
    /// The processes to signal.
    pub targets: Vec<Target>,
}

/// A holder deliberately not targeted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeftAlone {
    /// Pid.
    pub pid: u32,
    /// Command name.
    pub comm: Option<String>,
    /// Its class.
    pub class: Class,
    /// GPUs it holds.
    pub gpus: Vec<u32>,
    /// Why it is left alone.
    pub reason: String,
}

/// The reclaim plan.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The GPUs acted on.
    pub gpus: Vec<u32>,
    /// Targets grouped per job.
    pub jobs: Vec<PlannedJob>,
    /// Holders of the selected GPUs not targeted, with the reason.
    pub left_alone: Vec<LeftAlone>,
    /// Bytes the plan should free per GPU: listed memory of the targets, plus the unaccounted
    /// memory of a GPU whose hidden holders are all targets.
    pub expected_free: BTreeMap<u32, u64>,
    /// Lines to show above the confirmation: targets that are working (`detached`, included
    /// on request).
    #[serde(default)]
    pub warnings: Vec<String>,
    /// Orphaned shared-memory segments to remove (with `--include shm`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub segments: Vec<crate::host::SegmentReport>,
}

impl Plan {
    /// Every target.
    pub fn targets(&self) -> impl Iterator<Item = &Target> {
        self.jobs.iter().flat_map(|j| j.targets.iter())
    }

    /// Keeps only the targets `keep` accepts (and the jobs that still have one).
    pub fn retain_targets(&mut self, report: &Report, mut keep: impl FnMut(&Target) -> bool) {
        for job in &mut self.jobs {
            job.targets.retain(&mut keep);
        }
        self.jobs.retain(|j| !j.targets.is_empty());
        // What comes back is what the remaining targets hold: the release wait and its
        // verdict are measured against it.
        let targets: BTreeMap<u32, Target> = self.targets().map(|t| (t.pid, t.clone())).collect();
        let gpus = self.gpus.clone();
        self.expected_free = expected_free(report, &targets, &|g| gpus.contains(&g));
    }

    /// Whether there is nothing to signal.
    pub fn is_empty(&self) -> bool {
        self.jobs.iter().all(|j| j.targets.is_empty()) && self.segments.is_empty()
    }
}

/// Why a holder may not be signalled, or `None` when it may.
fn refusal(snap: &Snapshot, h: &Holder, opts: &ReclaimOptions) -> Option<String> {
    let proc_ = snap.process(h.pid);
    if h.pid <= 1 {
        return Some("pid 1 (init) is never signalled".into());
    }
    if h.pid == snap.host.self_pid {
        return Some("vramguard itself".into());
    }
    if snap.host.self_ancestors.contains(&h.pid) {
        return Some("an ancestor of vramguard (its shell, its supervisor)".into());
    }
    if proc_.is_some_and(|p| p.is_kernel_thread()) {
        return Some("a kernel thread".into());
    }
    if h.nspid.len() > 1 && h.nspid.last() == Some(&1) {
        return Some(
            "the init of a PID namespace (a container): signalling it ends the container".into(),
        );
    }
    // Never inside a job a live supervisor runs, whatever the job view says (its group's
    // leader outside this PID namespace, a Slurm step around `vramguard run`): the supervisor
    // ends it with its job. Found by the property test below.
    if matches!(h.class, Class::Orphan | Class::Hidden | Class::Detached)
        && let Some(sup) = proc_.and_then(|p| crate::job::live_supervisor_above(snap, p))
    {
        return Some(crate::job::supervised_by(sup));
    }
    // An unlisted holder without /dev/nvidia-uvm, or mapping NVML and not the CUDA driver
    // library, has no CUDA context (an NVML client): it holds no GPU memory, and signalling
    // it frees nothing, whatever its job's state. One whose memory map could not be read is
    // left alone too.
    if h.class == Class::Hidden
        && let Some(why) =
            crate::classify::never_a_target(h.device_files.as_deref(), h.driver_library)
    {
        return Some(why.into());
    }
    // The same for an NVML client on its way out (a zombie or exiting monitor, the agent
    // stopping): its exit closes its files; nothing to finish.
    if h.class == Class::Zombie
        && crate::classify::never_a_target(h.device_files.as_deref(), h.driver_library)
            == Some(crate::classify::NVML_CLIENT)
    {
        return Some(crate::classify::NVML_CLIENT.into());
    }
    match h.class {
        Class::Active => {
            // A supervised job says which supervisor keeps it (already sanitised).
            return Some(match &h.job {
                Some(j) if j.kind == crate::job::JobKind::Supervised => {
                    format!("its job is alive: {}", j.evidence)
                }
                _ => "its job is alive".into(),
            });
        }
        Class::System => return Some("a system service (a reset blocker, never killed)".into()),
        Class::Foreign => {
            return Some(
                "not a process of this PID namespace: cannot be signalled from here".into(),
            );
        }
        Class::Exited => {
            return Some(
                "it has exited: there is no process to signal; its memory comes back when its \
                 keepers exit"
                    .into(),
            );
        }
        _ => {}
    }
    if !opts.include.contains(&h.class) {
        return Some(format!(
            "class {} is not included (add --include {})",
            h.class, h.class
        ));
    }
    match h.class {
        Class::Hidden if h.dead_job.is_none() && h.keeps_alive.is_none() => {
            return Some("hidden, but its job is alive: ask its owner".into());
        }
        // Never inside a job a live supervisor runs (`vramguard run`, a container init), not
        // even a keeper asked for by name: the supervisor ends it with its job.
        Class::Hidden
            if h.dead_job.is_none()
                && h.job
                    .as_ref()
                    .is_some_and(|j| j.kind == crate::job::JobKind::Supervised) =>
        {
            return Some(format!(
                "it keeps exited pid {}'s context, but its job {} runs under a live supervisor, \
                 which ends it with the job: stop that job to free it",
                h.keeps_alive.unwrap_or_default(),
                h.job
                    .as_ref()
                    .map_or("?".into(), |j| crate::sanitize::shown(&j.label))
            ));
        }
        // A keeper of an exited pid's context in a live job: by default only in a plain
        // process-group job; in a job something else owns (unit, Slurm step, pod, container,
        // `vramguard run`) only with --include keepers: narrowing (--job) only ever removes.
        Class::Hidden
            if h.dead_job.is_none() && !keeper_in_plain_job(h, proc_) && !opts.include_keepers =>
        {
            return Some(format!(
                "it keeps exited pid {}'s context, but its job {} is alive and it is not known \
                 to be that pid's worker in a plain process group (a tie not confirmed, a job \
                 of its own, or one something else owns): add --include keepers (with --job \
                 for that job alone)",
                h.keeps_alive.unwrap_or_default(),
                h.job
                    .as_ref()
                    .map_or("?".into(), |j| crate::sanitize::shown(&j.label))
            ));
        }
        Class::Idle if h.idle_secs.unwrap_or(0) < opts.idle_for_secs => {
            return Some(format!(
                "idle for {}s, less than --idle-for {}s",
                h.idle_secs.unwrap_or(0),
                opts.idle_for_secs
            ));
        }
        Class::Zombie if !h.action.reclaimable => {
            return Some(h.action.summary.clone());
        }
        _ => {}
    }
    if !snap.host.privileges().may_signal_every_process() && h.uid != Some(snap.host.euid) {
        return Some(format!(
            "owned by uid {}; only root (or CAP_KILL) may signal other users' processes",
            h.uid.map_or("unknown".into(), |u| u.to_string())
        ));
    }
    if h.start_ticks.is_none() {
        return Some(
            "its start time is unreadable, so a reused pid could not be told apart".into(),
        );
    }
    // Work evidence: a zombie's own rule already weighed it (an exiting process is no longer
    // working); a detached holder is working by definition and was asked for by name.
    if !matches!(h.class, Class::Zombie | Class::Detached) {
        match &h.work {
            Work::Working { evidence } => {
                return Some(format!("it is working: {}", evidence.join("; ")));
            }
            Work::Unknown { why } => {
                return Some(format!(
                    "whether it still works is unknown ({why}); sample it first (--sample)"
                ));
            }
            Work::Idle { .. } => {}
        }
    }
    None
}

/// Whether `h` keeps an exited pid's context inside a plain process-group job (`pgid:N`,
/// `pid:N`): a script without job control that still runs after its trainer died. Only on
/// a confirmed tie, and not when it leads its own group or session (`setsid`: a job of its
/// own, which lives).
fn keeper_in_plain_job(h: &Holder, proc_: Option<&crate::snapshot::ProcessFacts>) -> bool {
    let leads = proc_.is_none_or(|p| p.pgid == Some(p.pid) || p.sid == Some(p.pid));
    h.keeps_alive.is_some()
        && !h.keeps_alive_unconfirmed
        && !leads
        && h.job.as_ref().is_some_and(|j| {
            j.kind == crate::job::JobKind::ProcessGroup
                && (j.label.starts_with("pgid:") || j.label.starts_with("pid:"))
        })
}

/// Why a holder on a MIG GPU is left alone when `--gpu` named other MIG devices of it.
fn outside_mig_devices(g: &GpuReport, h: &Holder, opts: &ReclaimOptions) -> Option<String> {
    let wanted = opts.mig_devices.as_ref()?;
    if g.mig_devices.is_empty() {
        return None;
    }
    let on_wanted = g
        .mig_devices
        .iter()
        .filter(|d| d.uuid.as_ref().is_some_and(|u| wanted.contains(u)))
        .any(|d| d.holders.contains(&h.pid));
    (!on_wanted).then(|| "on another MIG device than the ones asked for".to_string())
}

/// What each selected GPU should get back: the targets' listed bytes, an exited pid's memory
/// when every keeper of it is a target, plus the unaccounted memory when every hidden holder
/// of that GPU is a target (their share is unknown).
fn expected_free(
    report: &Report,
    targets: &BTreeMap<u32, Target>,
    selected: &dyn Fn(u32) -> bool,
) -> BTreeMap<u32, u64> {
    let mut expected_free: BTreeMap<u32, u64> = BTreeMap::new();
    for t in targets.values() {
        for tg in &t.gpus {
            let e = expected_free.entry(tg.gpu).or_default();
            *e = e.saturating_add(tg.bytes.unwrap_or(0));
        }
    }
    for g in report.gpus.iter().filter(|g| selected(g.index)) {
        for h in g.holders.iter().filter(|h| h.class == Class::Exited) {
            if !h.keepers.is_empty() && h.keepers.iter().all(|k| targets.contains_key(k)) {
                let e = expected_free.entry(g.index).or_default();
                *e = e.saturating_add(h.used_bytes.unwrap_or(0));
            }
        }
        let hidden: Vec<&Holder> = g
            .holders
            .iter()
            .filter(|h| h.class == Class::Hidden)
            .collect();
        if let Some(u) = g.unaccounted.as_ref().filter(|u| u.significant)
            && !hidden.is_empty()
            && hidden.iter().all(|h| targets.contains_key(&h.pid))
        {
            let e = expected_free.entry(g.index).or_default();
            *e = e.saturating_add(u.bytes);
        }
    }
    expected_free
}

/// Plans a reclaim from a classified snapshot.
pub fn plan_reclaim(snap: &Snapshot, report: &Report, opts: &ReclaimOptions) -> Plan {
    let selected = |gpu: u32| opts.gpus.as_ref().is_none_or(|g| g.contains(&gpu));
    let gpus: Vec<u32> = report
        .gpus
        .iter()
        .map(|g| g.index)
        .filter(|g| selected(*g))
        .collect();

    // One decision per pid, over every selected GPU it holds.
    let mut targets: BTreeMap<u32, Target> = BTreeMap::new();
    let mut left: BTreeMap<u32, LeftAlone> = BTreeMap::new();
    let mut leaders: BTreeMap<u32, (Option<u32>, Option<String>)> = BTreeMap::new();
    let mut warnings = Vec::new();
    let narrowing = Narrowing::new(report, opts);
    for g in report.gpus.iter().filter(|g| selected(g.index)) {
        for h in g.holders.iter().filter(|h| narrowing.keeps(h)) {
            match outside_mig_devices(g, h, opts).or_else(|| refusal(snap, h, opts)) {
                None => {
                    if h.class == Class::Detached && !targets.contains_key(&h.pid) {
                        warnings.push(detached_warning(h));
                    }
                    let t = targets.entry(h.pid).or_insert_with(|| Target {
                        pid: h.pid,
                        start_ticks: h.start_ticks.unwrap_or_default(),
                        class: h.class,
                        comm: h.comm.clone(),
                        command: h.command.clone(),
                        uid: h.uid,
                        gpus: Vec::new(),
                        evidence: h.evidence.clone(),
                    });
                    t.gpus.push(TargetGpu {
                        gpu: g.index,
                        bytes: h.used_bytes,
                    });
                    leaders.insert(
                        h.pid,
                        (
                            h.dead_job.as_ref().map(|j| j.leader_pid),
                            h.dead_job.as_ref().and_then(|j| j.leader_command.clone()),
                        ),
                    );
                }
                Some(reason) => {
                    let l = left.entry(h.pid).or_insert_with(|| LeftAlone {
                        pid: h.pid,
                        comm: h.comm.clone(),
                        class: h.class,
                        gpus: Vec::new(),
                        reason,
                    });
                    l.gpus.push(g.index);
                }
            }
        }
    }
    // A pid refused on one GPU is refused everywhere: its identity is one.
    targets.retain(|pid, _| !left.contains_key(pid));

    let expected_free = expected_free(report, &targets, &selected);

    let segments = planned_segments(snap, report, opts, &targets);
    Plan {
        gpus,
        jobs: group_by_job(targets, leaders),
        left_alone: left.into_values().collect(),
        expected_free,
        warnings,
        segments,
    }
}

/// The holders a narrowed plan considers (`job_of`, `job_label`); all without narrowing.
struct Narrowing<'a> {
    /// The pid `job_of` names, and its dead job's leader: a pid's dead job is the one any of
    /// its entries (one per GPU it holds) names.
    chosen: Option<(u32, Option<u32>)>,
    label: Option<&'a str>,
}

impl<'a> Narrowing<'a> {
    fn new(report: &Report, opts: &'a ReclaimOptions) -> Narrowing<'a> {
        let chosen = opts.job_of.map(|pid| {
            let leader = report
                .gpus
                .iter()
                .flat_map(|g| &g.holders)
                .filter(|h| h.pid == pid)
                .find_map(|h| h.dead_job.as_ref().map(|j| j.leader_pid));
            (pid, leader)
        });
        Narrowing {
            chosen,
            label: opts.job_label.as_deref(),
        }
    }

    fn keeps(&self, h: &Holder) -> bool {
        let labelled = match self.label {
            None => true,
            Some(want) => h.job.as_ref().is_some_and(|j| {
                j.label == want
                    || (want.starts_with("slurm:")
                        && j.label.starts_with(want)
                        && j.label[want.len()..].starts_with('.'))
            }),
        };
        labelled
            && match self.chosen {
                None => true,
                Some((pid, None)) => h.pid == pid,
                Some((pid, Some(leader))) => {
                    h.pid == pid || h.dead_job.as_ref().is_some_and(|j| j.leader_pid == leader)
                }
            }
    }
}

/// With `--include shm` on the whole node (not narrowed to a job): the segments orphaned
/// once the plan's targets are gone.
fn planned_segments(
    snap: &Snapshot,
    report: &Report,
    opts: &ReclaimOptions,
    targets: &BTreeMap<u32, Target>,
) -> Vec<crate::host::SegmentReport> {
    let whole_node = opts.job_of.is_none() && opts.job_label.is_none();
    let Some(shm) = opts.include_shm.as_ref().filter(|_| whole_node) else {
        return Vec::new();
    };
    let leaving: BTreeSet<u32> = targets.keys().copied().collect();
    crate::host::assess(snap, report, shm, &leaving)
        .map(|h| {
            h.segments
                .into_iter()
                .filter(|s| s.verdict == crate::host::SegmentVerdict::Reclaimable)
                .collect()
        })
        .unwrap_or_default()
}

/// The warning a detached target gets when `--include detached` makes it one: it may work.
fn detached_warning(h: &Holder) -> String {
    format!(
        "pid {} ({}) is detached, not dead: {}; it will be stopped because --include detached \
         was given",
        h.pid,
        crate::sanitize::escape(h.comm.as_deref().unwrap_or("?")),
        match &h.work {
            Work::Working { evidence } => evidence.join("; "),
            _ => "it may be working".into(),
        }
    )
}

/// Targets grouped under the leader of their dead job (`None`: no job known).
fn group_by_job(
    targets: BTreeMap<u32, Target>,
    mut leaders: BTreeMap<u32, (Option<u32>, Option<String>)>,
) -> Vec<PlannedJob> {
    let mut jobs: BTreeMap<Option<u32>, PlannedJob> = BTreeMap::new();
    for (pid, t) in targets {
        let (leader_pid, leader_command) = leaders.remove(&pid).unwrap_or((None, None));
        let job = jobs.entry(leader_pid).or_insert_with(|| PlannedJob {
            leader_pid,
            leader_command: None,
            targets: Vec::new(),
        });
        if job.leader_command.is_none() {
            job.leader_command = leader_command;
        }
        job.targets.push(t);
    }
    jobs.into_values().collect()
}
