//! `classify(&Snapshot, &Policy) -> Report`: attribute every byte of every GPU.
//!
//! The rules, in order of precedence for one process on one GPU:
//! 1. `system`   — a known system service by identity: its `comm` is listed, it runs as a
//!    system account and its executable is the root-owned program of that name (never
//!    killed; a reset blocker). A process that only took the name is an ordinary holder.
//! 2. `zombie`   — its main thread is a zombie while other threads live, or it is exiting
//!    (`PF_EXITING`). Memory is freed in `do_exit` when the last thread closes the device.
//!    Only a whole process on its way out (every live thread in `do_exit` or with SIGKILL
//!    pending) is killed without its work weighed: a main thread that exited alone
//!    (`pthread_exit`) leaves a live process, and the job of its children lives with it.
//! 3. `foreign`  — the driver lists a pid that does not exist here (or exists but is plainly a
//!    different process, such as a kernel thread) and no process maps to it through `NSpid`.
//! 4. `hidden`   — it holds `/dev/nvidiaN` but the driver lists it on no GPU.
//! 5. `detached` — its job is gone (see [`crate::job`]) but the job showed work in the
//!    sampling window: GPU utilization, CPU above the policy's threshold, threads running.
//! 6. `orphan`   — its job is gone and nothing of the job worked through the window.
//! 7. `idle`     — no utilization sample for at least the policy's idle time.
//! 8. `active`   — everything else.
//!
//! A job is gone only on positive evidence: a cgroup job (pod, container, Slurm step, unit)
//! whose keeper is gone, or — for a process whose cgroup names no job — a process tree whose
//! top (the ancestor re-parented to init or a subreaper) belongs to a process group whose
//! leader is gone. A process whose parent lives belongs to its parent's job. A process in a
//! `vramguard run` cgroup whose supervisor lives, or whose tree top was re-parented to a live
//! job supervisor (`vramguard run`, tini, dumb-init, docker-init), belongs to that
//! supervisor's live job (see [`crate::job::job_supervisor`]); once the supervisor is gone,
//! the rules above decide.
//!
//! Hidden holders also carry their job state, so that reclaim can pick the ones whose job is
//! gone. vramguard's own pid is never a holder: loading NVML opens the device files.

use crate::job::{CgroupJob, JobKind, RunCgroup, cgroup_job, job_supervisor, run_cgroups};
use crate::policy::Policy;
use crate::report::{
    Action, Class, DeadJob, GpuReport, Holder, JobInfo, MigDeviceReport, Report, ResetBlocker,
    Unaccounted, UnaccountedCause, Work,
};
use crate::sanitize::{escape, shown};
use crate::snapshot::{
    DepartedProcess, DeviceFile, DriverLibrary, FdScan, GpuProcess, GpuSample, PF_EXITING,
    ProcessFacts, ProcessListState, Snapshot,
};

/// How long after its exit a listed pid may still be a context the driver tears down. Drivers
/// take milliseconds to a few seconds (`vramguard probe release` measures it); two minutes
/// after the exit, its memory is residue.
pub const STALE_TEARDOWN_MS: u64 = 120_000;
use crate::units::{format_bytes, format_duration};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

/// `snapshot` with its processes sorted by pid (lookups binary-search them), copied only when
/// it is not sorted already.
fn normalized(snapshot: &Snapshot) -> std::borrow::Cow<'_, Snapshot> {
    if snapshot.processes.is_sorted_by_key(|p| p.pid) {
        std::borrow::Cow::Borrowed(snapshot)
    } else {
        let mut sorted = snapshot.clone();
        sorted.normalize();
        std::borrow::Cow::Owned(sorted)
    }
}

/// Classifies every holder of every GPU in `snapshot`.
pub fn classify(snapshot: &Snapshot, policy: &Policy) -> Report {
    let snapshot = normalized(snapshot);
    let snapshot = snapshot.as_ref();
    let ctx = Context::new(snapshot, policy);
    let gpus = snapshot.gpus.iter().map(|g| ctx.gpu_report(g)).collect();
    let mut report = Report {
        schema_version: crate::SCHEMA_VERSION,
        taken_at_ms: snapshot.taken_at_ms,
        hostname: snapshot.host.hostname.clone(),
        pid_namespace_is_host: snapshot.host.pid_namespace_is_host,
        euid: snapshot.host.euid,
        cap_effective: snapshot.host.cap_effective,
        driver: snapshot.driver.clone(),
        gpus,
        limitations: snapshot.scan.limitations.clone(),
        full_fd_scan: snapshot.scan.full_fd_scan,
        host: None,
    };
    report.host = crate::host::assess(snapshot, &report, &policy.shm, &BTreeSet::new());
    if let Some(pods) = &snapshot.kubelet_pods {
        name_pods(&mut report, pods);
    }
    report
}

/// Names the pods of holders in pod cgroups from the kubelet's device allocations: a GPU
/// allocated to exactly one container of a listed pod, held only by processes of one pod
/// UID, is that pod's. Anything less certain (a GPU shared by time-slicing between pods,
/// holders of two pod UIDs on one GPU — the old pod's orphan and the GPU's new pod) stays
/// by UID.
fn name_pods(report: &mut Report, pods: &[crate::snapshot::KubePod]) {
    for g in &mut report.gpus {
        let Some(uuid) = g.uuid.clone() else { continue };
        let mut owners: Vec<crate::report::PodName> = Vec::new();
        for p in pods {
            for c in &p.containers {
                let allocated = c
                    .devices
                    .iter()
                    .any(|d| d.split("::").next() == Some(uuid.as_str()));
                let name = crate::report::PodName {
                    namespace: p.namespace.clone(),
                    name: p.name.clone(),
                    container: c.name.clone(),
                };
                if allocated && !owners.contains(&name) {
                    owners.push(name);
                }
            }
        }
        let uids: BTreeSet<&str> = g
            .holders
            .iter()
            .filter_map(|h| h.pod_uid.as_deref())
            .collect();
        if owners.len() != 1 || uids.len() != 1 {
            continue;
        }
        for h in g.holders.iter_mut().filter(|h| h.pod_uid.is_some()) {
            h.pod = Some(owners[0].clone());
        }
    }
}

/// What a caller needs work watched for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchFor {
    /// The classes only (`status`, `diagnose`, `metrics`): an idle holder's class rests on
    /// GPU utilization alone, so only the holders whose job is gone, keepers and zombies.
    Classes,
    /// A reclaim too (`reclaim`, `top`'s `r`, the agent, a saved snapshot): `--include idle`
    /// targets an idle holder only when it was seen doing no work either.
    Reclaim,
}

/// The processes whose work decides a class (or, `for` a reclaim, a target) in `report`: for
/// every holder whose job is gone, every process of that job and the holder's descendants;
/// for a keeper of an exited pid's context, a zombie holder (and, for a reclaim, an idle one),
/// itself and its descendants. What a watcher must observe over a window before work can be
/// told (the agent between samples, `status` and `reclaim` for their sampling window); empty
/// when no verdict depends on work, so a node where every holder's job is alive costs no wait.
pub fn work_watch_list(
    snapshot: &Snapshot,
    policy: &Policy,
    report: &Report,
    watch: WatchFor,
) -> Vec<u32> {
    let decided_by_work = |h: &Holder| decided_by_work(h, watch);
    if !report.holders().any(|(_, h)| decided_by_work(h)) {
        return Vec::new();
    }
    let snapshot = normalized(snapshot);
    let snapshot = snapshot.as_ref();
    let ctx = Context::new(snapshot, policy);
    let mut pids = BTreeSet::new();
    for (_, h) in report.holders().filter(|(_, h)| decided_by_work(h)) {
        pids.insert(h.pid);
        if h.dead_job.is_some() {
            let tree = ctx.tree();
            if let Some(top) = tree.tops.get(&h.pid) {
                pids.extend(tree.members.get(top).into_iter().flatten().copied());
                pids.extend(ctx.dead_group_members(*top).iter().copied());
            }
        }
        pids.extend(ctx.descendants(h.pid));
    }
    pids.retain(|p| *p != snapshot.host.self_pid);
    pids.into_iter().collect()
}

/// Whether `h`'s class (or, for a reclaim, whether it is a target) rests on work.
fn decided_by_work(h: &Holder, watch: WatchFor) -> bool {
    h.dead_job.is_some()
        || h.keeps_alive.is_some()
        || h.class == Class::Zombie
        || (h.class == Class::Idle && watch == WatchFor::Reclaim)
}

/// The processes whose descendants' work decides a class in `report` (see
/// [`work_watch_list`]): each holder whose verdict rests on work and, where its job is gone,
/// the top of that job's tree. A collection reads only GPU holders and their ancestors; a
/// holder's children that hold no device file (a checkpoint upload, a compiler, data
/// workers) are read from these before work is watched, or their work would go unseen. Empty
/// when no verdict rests on work.
pub fn work_roots(
    snapshot: &Snapshot,
    policy: &Policy,
    report: &Report,
    watch: WatchFor,
) -> Vec<u32> {
    if !report.holders().any(|(_, h)| decided_by_work(h, watch)) {
        return Vec::new();
    }
    let snapshot = normalized(snapshot);
    let snapshot = snapshot.as_ref();
    let ctx = Context::new(snapshot, policy);
    let mut roots = BTreeSet::new();
    for (_, h) in report.holders().filter(|(_, h)| decided_by_work(h, watch)) {
        roots.insert(h.pid);
        if h.dead_job.is_some()
            && let Some(top) = ctx.tree().tops.get(&h.pid)
        {
            roots.insert(*top);
            // The rest of its dead process group, each member's descendants read too (the
            // collector also reads the members a collection left out).
            let tops = ctx.tree();
            for &m in ctx.dead_group_members(*top).iter() {
                if tops.members.contains_key(&m) {
                    roots.insert(m);
                }
            }
        }
    }
    roots.retain(|p| *p != snapshot.host.self_pid);
    roots.into_iter().collect()
}

/// Whether the driver is seen reporting the pids of vramguard's own PID namespace: a pid it
/// lists is a process here that holds an NVIDIA device file. Current drivers number the
/// processes they list as the caller's namespace does and leave out those it cannot see (a
/// container without `hostPID` is listed none of the host's); older ones listed host pids.
fn driver_reports_our_pids(snap: &Snapshot) -> bool {
    snap.gpus.iter().flat_map(|g| &g.processes).any(|listed| {
        snap.process(listed.pid)
            .is_some_and(|p| !p.is_kernel_thread() && p.device_files.holds_any() == Some(true))
    })
}

/// How a driver-reported pid maps onto a process of ours.
enum Resolution<'a> {
    /// The pid is this process (possibly via `NSpid`, then `reported` differs).
    Local {
        proc_: &'a ProcessFacts,
        reported: Option<u32>,
    },
    /// No process here is the one the driver means.
    Foreign { why: String },
    /// The process the driver means has exited: vramguard sees the host's PID namespace and
    /// every process in it, and no process maps to the pid. What the reused pid is now, when
    /// the pid exists as another process.
    Exited { reused_by: Option<&'a ProcessFacts> },
}

/// Whether a departed process is the parent a process was seen forked by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ParentMatch {
    /// It started when that parent did.
    Same,
    /// It started at another time: the pid was reused.
    Reused,
    /// Either start time is unknown (not recorded, or an older snapshot).
    Unconfirmed,
}

/// How an unlisted holder of a GPU is tied to an exited pid listed there: what makes it a
/// keeper of that pid's context.
#[derive(Debug, Clone)]
struct KeeperTie {
    /// The exited pid whose context it keeps; `None` when several exited pids are listed on
    /// the GPU and nothing ties it to one of them.
    exited: Option<u32>,
    /// Whether the tie is direct: it (or the ancestor through which it inherited) was seen
    /// forked by the exited pid (the same process: the start times match), or is in the
    /// process group or session the exited pid led. Otherwise it rests on its having been
    /// re-parented while that pid is the only exited one listed on the GPU, or on a parent
    /// pid whose process could not be confirmed.
    strong: bool,
    /// The tie, in words.
    why: String,
}

struct Context<'a> {
    snap: &'a Snapshot,
    policy: &'a Policy,
    /// Resolved local pids the driver lists on at least one GPU.
    listed_anywhere: BTreeSet<u32>,
    /// Every pid the driver lists, on any GPU, as it reports them (before any mapping); made
    /// when first asked (only a pid that maps through `NSpid` asks).
    reported: std::cell::OnceCell<BTreeSet<u32>>,
    /// Recent GPU activity per local pid: (GPU index, peak SM %, milliseconds ago).
    gpu_busy: BTreeMap<u32, Vec<(u32, u32, u64)>>,
    /// Local pids listed on a GPU that reports no per-process utilization, with that GPU.
    gpu_unknown: BTreeMap<u32, u32>,
    /// GPUs whose process lists could not be read, by device minor, with why: who computes
    /// there is unknown, so no holder of their device files is judged idle.
    unreadable: BTreeMap<u32, (u32, String)>,
    /// Such a GPU whose minor is unknown (lost before it was read), with why.
    unreadable_unplaced: Option<(u32, String)>,
    /// The minors of the GPUs read whole.
    readable_minors: BTreeSet<u32>,
    /// Every process's tree top (see [`Context::group_walk`]) and the processes under each
    /// top: built on first use (only a dead job needs them).
    tree: std::cell::OnceCell<Tree>,
    /// [`Context::dead_group_members`] by tree top, worked out once (every holder of the
    /// job asks, for its work and for whether its descendants were read).
    dead_groups: std::cell::RefCell<BTreeMap<u32, std::rc::Rc<Vec<u32>>>>,
    /// Each process's children in the snapshot.
    children: BTreeMap<u32, Vec<u32>>,
    /// Each process's own work, computed once.
    own_work: std::cell::RefCell<BTreeMap<u32, Work>>,
    /// Each process as [`Context::describe`] names it, formatted once: a job's leader is
    /// named in the evidence of each of its holders (hundreds of formats per sample).
    described: std::cell::RefCell<HashMap<u32, String>>,
    /// Whether a pid the driver lists that is not a process here has really exited: vramguard
    /// sees the host's PID namespace and every process in it (root, the capabilities, or a
    /// `/proc` that shows other users' processes: no `hidepid`).
    pids_complete: bool,
    /// Whether every process's open files were read: who keeps an exited pid's context can
    /// be seen.
    files_complete: bool,
}

/// Processes of a job whose work is quoted as evidence for another process of it; the rest
/// are counted.
const WORK_EVIDENCE_QUOTED: usize = 3;

/// Every process's tree top (see `Context::group_walk`), and the processes under each top.
#[derive(Default)]
struct Tree {
    tops: BTreeMap<u32, u32>,
    members: BTreeMap<u32, Vec<u32>>,
}

/// How a walk up the tree proved a job alive.
#[derive(Debug, Clone, Copy)]
enum AliveBy {
    /// The walk reached a process that leads its process group.
    LeadsGroup,
    /// The walk reached a process whose live parent is in another group.
    Parent(u32),
}

/// A holder's job, resolved.
struct JobView {
    info: JobInfo,
    dead: Option<DeadJob>,
    /// The top of its process tree, when the job is a process group (the members of a dead
    /// job are the processes sharing this top).
    tree_top: Option<u32>,
}

/// Processes whose parent is deeper than this are treated as tree tops.
const MAX_TREE_DEPTH: usize = 64;

impl<'a> Context<'a> {
    fn new(snap: &'a Snapshot, policy: &'a Policy) -> Self {
        let mut ctx = Context {
            snap,
            policy,
            listed_anywhere: BTreeSet::new(),
            reported: std::cell::OnceCell::new(),
            gpu_busy: BTreeMap::new(),
            gpu_unknown: BTreeMap::new(),
            unreadable: BTreeMap::new(),
            unreadable_unplaced: None,
            readable_minors: BTreeSet::new(),
            tree: Default::default(),
            dead_groups: Default::default(),
            children: BTreeMap::new(),
            own_work: Default::default(),
            described: Default::default(),
            pids_complete: (snap.host.pid_namespace_is_host == Some(true)
                || (snap.host.pid_namespace_is_host == Some(false)
                    && driver_reports_our_pids(snap)))
                && (snap.host.privileges().sees_every_process()
                    || snap
                        .processes
                        .iter()
                        .any(|p| p.uid.is_some_and(|u| u != snap.host.euid))),
            files_complete: snap.scan.full_fd_scan && snap.host.privileges().sees_every_process(),
        };
        // The whole tree, even through processes whose work is not weighed (vramguard itself,
        // kernel threads): a working grandchild protects its grandparent through them.
        for q in &snap.processes {
            if let Some(pp) = q.ppid.filter(|pp| *pp > 0) {
                ctx.children.entry(pp).or_default().push(q.pid);
            }
        }
        for gpu in &snap.gpus {
            if let Some(why) = unread_process_list(gpu) {
                match gpu.minor_number {
                    Some(minor) => {
                        ctx.unreadable.insert(minor, (gpu.index, why));
                    }
                    // A GPU lost before vramguard learnt its minor: which /dev/nvidiaN is its
                    // is unknown, so every GPU file not proven another readable GPU's counts.
                    None => ctx.unreadable_unplaced = Some((gpu.index, why)),
                }
            }
        }
        ctx.readable_minors = snap
            .gpus
            .iter()
            .filter(|g| unread_process_list(g).is_none())
            .filter_map(|g| g.minor_number)
            .collect();
        let mut listed = BTreeSet::new();
        let recent_ms = policy.gpu_busy_recent_secs.saturating_mul(1000);
        for gpu in &snap.gpus {
            for p in &gpu.processes {
                if let Resolution::Local { proc_, .. } = ctx.resolve(gpu, p.pid) {
                    listed.insert(proc_.pid);
                    let Some(window) = &gpu.utilization else {
                        ctx.gpu_unknown.insert(proc_.pid, gpu.index);
                        continue;
                    };
                    // A 1 % sample is an idle context, not work (`gpu_work_min_percent`).
                    for s in window
                        .samples
                        .iter()
                        .filter(|s| s.pid == p.pid && policy.is_gpu_work(s))
                    {
                        // Snapshots from before `last_busy_ms` existed: the newest sample.
                        // The reader stamps `last_busy_ms` at the default threshold; a policy
                        // that counts less as work takes the newest sample, which is never
                        // older (it can only say work is more recent).
                        let busy_at = if policy.gpu_work_min_percent
                            < crate::policy::DEFAULT_GPU_WORK_MIN_PERCENT
                        {
                            Some(s.last_seen_ms)
                        } else {
                            s.last_busy_ms.or(Some(s.last_seen_ms))
                        };
                        if let Some(at) = busy_at {
                            let ago = snap.taken_at_ms.saturating_sub(at);
                            if ago <= recent_ms {
                                ctx.gpu_busy.entry(proc_.pid).or_default().push((
                                    gpu.index,
                                    s.sm_percent.max(s.mem_percent),
                                    ago,
                                ));
                            }
                        }
                    }
                }
            }
        }
        ctx.listed_anywhere = listed;
        ctx
    }

    fn minor_of(&self, gpu: &GpuSample) -> u32 {
        // Without a minor number, /dev/nvidiaN numbering follows the NVML index on every
        // single-driver system we know of.
        gpu.minor_number.unwrap_or(gpu.index)
    }

    /// Whether the driver lists `pid` itself, as it reports it, on any GPU.
    fn driver_lists(&self, pid: u32) -> bool {
        self.reported
            .get_or_init(|| {
                self.snap
                    .gpus
                    .iter()
                    .flat_map(|g| g.processes.iter().map(|p| p.pid))
                    .collect()
            })
            .contains(&pid)
    }

    fn holds_gpu_file(&self, p: &ProcessFacts, gpu: &GpuSample) -> bool {
        let minor = self.minor_of(gpu);
        p.device_files.gpu_minors().any(|m| m == minor)
    }

    /// Maps a driver-reported pid to a process of ours.
    ///
    /// A process with that pid that provably holds an NVIDIA device file is the holder. Else a
    /// single process whose innermost `NSpid` is that pid and which holds this GPU's device
    /// file is (the driver reported the pid a containerised process has inside its
    /// namespace). Else a same-numbered process we cannot disprove (its files unreadable) is
    /// taken; else the pid is foreign.
    fn resolve(&self, gpu: &GpuSample, reported: u32) -> Resolution<'a> {
        let here = self.snap.process(reported);
        // An NVML client on the listed pid (mapping libnvidia-ml, not libcuda) is not the
        // process whose context the driver lists: that one exited and the pid was reused.
        // Only where the pid can have been reused: Linux gives no new process a pid that
        // another process still has as its group or session id, so a process group or session
        // the listed pid leads, with other members, is the listed process's own.
        let leads_others = || {
            self.snap
                .processes
                .iter()
                .any(|q| q.pid != reported && (q.pgid == Some(reported) || q.sid == Some(reported)))
        };
        let nvml_client = |p: &ProcessFacts| {
            p.driver_library == Some(DriverLibrary::NvmlOnly)
                && p.device_files.holds_uvm()
                && !leads_others()
        };
        if let Some(p) = here
            && !p.is_kernel_thread()
            && p.device_files.holds_any() == Some(true)
            && !nvml_client(p)
        {
            return Resolution::Local {
                proc_: p,
                reported: None,
            };
        }
        let candidates: Vec<&ProcessFacts> = self
            .snap
            .processes
            .iter()
            .filter(|p| p.pid != reported && p.nspid.len() > 1 && p.nspid.last() == Some(&reported))
            .filter(|p| self.holds_gpu_file(p, gpu))
            // A process the driver lists by its own pid here is not the one it means by this
            // pid: that driver numbers pids as vramguard's namespace does, and this one (a host
            // pid that a container's process happens to have inside) has exited.
            .filter(|p| !self.driver_lists(p.pid))
            .collect();
        if let [only] = candidates.as_slice() {
            return Resolution::Local {
                proc_: only,
                reported: Some(reported),
            };
        }
        if let Some(p) = here
            && !p.is_kernel_thread()
            && p.device_files.holds_any().is_none()
        {
            return Resolution::Local {
                proc_: p,
                reported: None,
            };
        }
        // In the host's PID namespace the driver lists host pids (from inside another
        // namespace it leaves out the pids that namespace cannot see): a pid that is no
        // process here, and that no nested namespace uses either, has exited. The real driver
        // keeps listing it while processes it forked hold its device files.
        let nested = self.snap.processes.iter().any(|p| {
            p.pid != reported
                && p.nspid.len() > 1
                && p.nspid.last() == Some(&reported)
                && !self.driver_lists(p.pid)
        });
        if self.pids_complete && !nested {
            match here {
                None => return Resolution::Exited { reused_by: None },
                Some(p)
                    if self.files_complete
                        && (p.is_kernel_thread()
                            || p.device_files.holds_any() == Some(false)
                            || nvml_client(p)) =>
                {
                    return Resolution::Exited { reused_by: Some(p) };
                }
                Some(_) => {}
            }
        }
        let why = match here {
            Some(p) if nvml_client(p) => format!(
                "pid {reported} here is {} (an NVML client, no CUDA context): the driver \
                 reports a pid from another PID namespace, or one that exited",
                escape(p.comm.as_deref().unwrap_or("?"))
            ),
            Some(p) => format!(
                "pid {reported} here is {} ({}), which holds no NVIDIA device file: the driver \
                 reports a pid from another PID namespace",
                escape(p.comm.as_deref().unwrap_or("?")),
                if p.is_kernel_thread() {
                    "a kernel thread"
                } else {
                    "another process"
                }
            ),
            None if self.snap.host.pid_namespace_is_host == Some(false)
                && self.departed_listed(reported).is_none() =>
            {
                format!(
                    "pid {reported} does not exist in this PID namespace: vramguard runs in a \
                     container and the driver reports host pids"
                )
            }
            None => match self.departed_listed(reported) {
                Some(d) if self.stale_teardown(reported) => format!(
                    "pid {reported} ({}) exited {} ago and the driver still lists it: longer \
                     than the {} a teardown takes, so its context was never torn down and its \
                     memory counts as residue (a GPU reset frees it)",
                    escape(d.comm.as_deref().unwrap_or("?")),
                    format_duration(Duration::from_millis(
                        self.snap.taken_at_ms.saturating_sub(d.gone_at_ms)
                    )),
                    format_duration(Duration::from_millis(STALE_TEARDOWN_MS))
                ),
                Some(d) => format!(
                    "pid {reported} ({}) exited {} ago and the driver still lists it: it is \
                     tearing the context down, and the memory comes back on its own (`vramguard \
                     probe release` measures how long this driver takes)",
                    escape(d.comm.as_deref().unwrap_or("?")),
                    format_duration(Duration::from_millis(
                        self.snap.taken_at_ms.saturating_sub(d.gone_at_ms)
                    ))
                ),
                None if self.snap.host.pid_namespace_is_host == Some(true) => format!(
                    "pid {reported} is no process vramguard can see: /proc hides other users' \
                     processes here (hidepid), so whether it lives cannot be told; run vramguard \
                     as root"
                ),
                None => format!(
                    "pid {reported} does not exist here: the process has exited, or the driver \
                     reports a pid from another PID namespace"
                ),
            },
        };
        let why = if candidates.len() > 1 {
            format!(
                "{why}; {} processes have pid {reported} inside their namespace, so it cannot be \
                 mapped",
                candidates.len()
            )
        } else {
            why
        };
        Resolution::Foreign { why }
    }

    fn gpu_report(&self, gpu: &GpuSample) -> GpuReport {
        let mut holders: Vec<Holder> = Vec::new();
        let mut seen: BTreeSet<u32> = BTreeSet::new();
        let mut exited: Vec<(&GpuProcess, Option<&ProcessFacts>)> = Vec::new();
        for listed in &gpu.processes {
            match self.resolve(gpu, listed.pid) {
                Resolution::Local { proc_, reported } => {
                    if proc_.pid == self.snap.host.self_pid || !seen.insert(proc_.pid) {
                        continue;
                    }
                    holders.push(self.local_holder(gpu, proc_, Some(listed), reported, None));
                }
                Resolution::Foreign { why } => {
                    if seen.insert(listed.pid) {
                        holders.push(self.foreign_holder(listed, why));
                    }
                }
                Resolution::Exited { reused_by } => {
                    if seen.insert(listed.pid) {
                        exited.push((listed, reused_by));
                    }
                }
            }
        }
        let exited_pids: Vec<u32> = exited.iter().map(|(l, _)| l.pid).collect();
        // Taken for exited only because an NVML client holds the pid now: its map, which a
        // process chooses, is all that says so. Only a strong tie (forked by it, its group or
        // session) makes a keeper of such a pid.
        let reused_by_nvml_client: Vec<u32> = exited
            .iter()
            .filter(|(_, r)| r.is_some_and(|p| p.driver_library == Some(DriverLibrary::NvmlOnly)))
            .map(|(l, _)| l.pid)
            .collect();
        let ties = self.keeper_ties(gpu, &exited_pids, &reused_by_nvml_client);
        for p in &self.snap.processes {
            if p.pid == self.snap.host.self_pid
                || seen.contains(&p.pid)
                || !self.holds_gpu_file(p, gpu)
            {
                continue;
            }
            // A process with a context on another GPU opens every visible /dev/nvidiaN at
            // cuInit; holding this GPU's file without being listed here is not a hidden
            // context. It still blocks a reset (see reset_blockers).
            let is_system = self.is_system(p);
            if !is_system && self.listed_anywhere.contains(&p.pid) {
                continue;
            }
            seen.insert(p.pid);
            holders.push(self.local_holder(gpu, p, None, None, ties.get(&p.pid)));
        }
        for (listed, reused_by) in exited {
            let keepers: Vec<&Holder> = holders
                .iter()
                .filter(|h| h.keeps_alive == Some(listed.pid))
                .collect();
            let holder = self.exited_holder(gpu, listed, reused_by, &keepers, &ties);
            holders.push(holder);
        }
        holders.sort_by(|a, b| {
            b.used_bytes
                .unwrap_or(0)
                .cmp(&a.used_bytes.unwrap_or(0))
                .then(a.pid.cmp(&b.pid))
        });

        // Saturating throughout: a replayed snapshot may carry any number. A pid the driver
        // still lists long after it exited, that no process keeps, holds nothing a process
        // will give back: residue.
        let residue_pids: BTreeSet<u32> = holders
            .iter()
            .filter(|h| {
                h.class == Class::Foreign || (h.class == Class::Exited && h.keepers.is_empty())
            })
            .filter(|h| self.stale_teardown(h.pid))
            .map(|h| h.pid)
            .collect();
        let accounted_bytes: u64 = gpu
            .processes
            .iter()
            .filter(|p| !residue_pids.contains(&p.pid))
            .filter_map(|p| p.used_bytes)
            .fold(0, u64::saturating_add);
        let mut bytes_by_class: BTreeMap<Class, u64> = BTreeMap::new();
        for h in &holders {
            let b = bytes_by_class.entry(h.class).or_default();
            *b = b.saturating_add(h.used_bytes.unwrap_or(0));
        }
        let reset_blockers = self.reset_blockers(gpu, &holders);
        let unaccounted = gpu.memory.map(|m| {
            self.unaccounted(
                gpu,
                (m.used, m.total),
                accounted_bytes,
                &holders,
                &reset_blockers,
                &residue_pids,
            )
        });
        let ghost_bytes = holders
            .iter()
            .filter(|h| h.is_ghost() && !residue_pids.contains(&h.pid))
            .filter_map(|h| h.used_bytes)
            .fold(0, u64::saturating_add)
            .saturating_add(
                unaccounted
                    .as_ref()
                    .filter(|u| u.counts_as_ghost())
                    .map_or(0, |u| u.bytes),
            );

        let mig_devices = self.mig_reports(gpu, &holders);
        let reclaimable_bytes = reclaimable_bytes(&holders, unaccounted.as_ref(), &residue_pids);
        GpuReport {
            index: gpu.index,
            uuid: gpu.uuid.clone(),
            name: gpu.name.clone(),
            pci_bus_id: gpu.pci_bus_id.clone(),
            minor_number: gpu.minor_number,
            memory: gpu.memory,
            persistence_mode: gpu.persistence_mode,
            failure: gpu.failure.clone(),
            warnings: gpu.warnings.clone(),
            health: gpu.health.clone(),
            process_list: gpu.process_list.clone(),
            holders,
            accounted_bytes,
            unaccounted,
            reset_blockers,
            bytes_by_class,
            ghost_bytes,
            reclaimable_bytes,
            mig_devices,
            telemetry: gpu.telemetry.clone(),
        }
    }

    /// Each MIG device of `gpu`: its holders (by the pid the driver reports, mapped to the
    /// local one), their ghost memory there, and the memory none of them accounts for.
    fn mig_reports(&self, gpu: &GpuSample, holders: &[Holder]) -> Vec<MigDeviceReport> {
        gpu.mig_devices
            .iter()
            .map(|d| {
                let on_it: Vec<(&Holder, u64)> = d
                    .processes
                    .iter()
                    .filter_map(|p| {
                        let h = holders
                            .iter()
                            .find(|h| h.reported_pid.unwrap_or(h.pid) == p.pid)?;
                        Some((h, p.used_bytes.unwrap_or(0)))
                    })
                    .collect();
                let accounted: u64 = on_it.iter().map(|(_, b)| b).sum();
                let unaccounted = d.memory.map_or(0, |m| {
                    let bytes = m.used.saturating_sub(accounted);
                    if bytes > self.policy.tolerance_for(m.total) {
                        bytes
                    } else {
                        0
                    }
                });
                let ghost: u64 = on_it
                    .iter()
                    .filter(|(h, _)| h.is_ghost())
                    .map(|(_, b)| b)
                    .sum();
                MigDeviceReport {
                    gpu_instance: d.gpu_instance,
                    compute_instance: d.compute_instance,
                    uuid: d.uuid.clone(),
                    name: d.name.clone(),
                    memory: d.memory,
                    holders: on_it.iter().map(|(h, _)| h.pid).collect(),
                    unaccounted_bytes: unaccounted,
                    ghost_bytes: ghost.saturating_add(unaccounted),
                }
            })
            .collect()
    }

    /// The exit vramguard saw of the process the driver lists as `pid`, when that is what
    /// the listing means: the pid is gone from `/proc`, and either this is the host's PID
    /// namespace or the driver is seen reporting this namespace's pids (another pid it lists
    /// is a process here holding an NVIDIA device file). In a container whose driver reports
    /// host pids, a local process that exited with the same number says nothing about the
    /// listed one.
    fn departed_listed(&self, pid: u32) -> Option<&'a DepartedProcess> {
        if self.snap.process(pid).is_some() {
            return None;
        }
        let departed = self.snap.departed.iter().rev().find(|d| d.pid == pid)?;
        let pids_are_ours = self.snap.host.pid_namespace_is_host != Some(false)
            || self
                .snap
                .gpus
                .iter()
                .flat_map(|g| &g.processes)
                .any(|listed| {
                    listed.pid != pid
                        && self.snap.process(listed.pid).is_some_and(|p| {
                            !p.is_kernel_thread() && p.device_files.holds_any() == Some(true)
                        })
                });
        pids_are_ours.then_some(departed)
    }

    /// Whether the driver lists `pid` more than [`STALE_TEARDOWN_MS`] after vramguard saw it
    /// exit (see [`Self::departed_listed`]): not a teardown in progress any more.
    fn stale_teardown(&self, pid: u32) -> bool {
        self.departed_listed(pid)
            .is_some_and(|d| self.snap.taken_at_ms.saturating_sub(d.gone_at_ms) > STALE_TEARDOWN_MS)
    }

    /// CPU `p` used over the sampling window, thousandths of one core; absent when it was
    /// not observed twice.
    fn cpu_millicores(&self, p: &ProcessFacts) -> Option<u64> {
        let hz = self.snap.host.clock_ticks_per_sec.max(1);
        self.snap
            .work_of(p.pid, p.start_ticks)
            .map(|s| s.cpu_ticks.saturating_mul(1_000_000) / hz / s.observed_ms.max(1))
    }

    /// How long ago `p` started: the snapshot's time minus boot time plus its start.
    fn age_secs(&self, p: &ProcessFacts) -> Option<u64> {
        let boot = self.snap.host.boot_time_ms?;
        let hz = self.snap.host.clock_ticks_per_sec.max(1);
        let started_ms = boot.saturating_add(p.start_ticks?.saturating_mul(1000) / hz);
        Some(self.snap.taken_at_ms.saturating_sub(started_ms) / 1000)
    }

    fn is_system(&self, p: &ProcessFacts) -> bool {
        matches!(
            self.policy
                .system_identity(p, self.snap.host.privileges().sees_every_process()),
            Some(Ok(()))
        )
    }

    fn describe(&self, pid: u32) -> String {
        self.described
            .borrow_mut()
            .entry(pid)
            .or_insert_with(|| match self.snap.process(pid) {
                Some(p) => format!("{pid} ({})", escape(p.comm.as_deref().unwrap_or("?"))),
                None => pid.to_string(),
            })
            .clone()
    }

    fn foreign_holder(&self, listed: &GpuProcess, why: String) -> Holder {
        let in_container = self.snap.host.pid_namespace_is_host == Some(false);
        Holder {
            evidence: vec![why],
            action: Action {
                summary: if self.stale_teardown(listed.pid) {
                    "its memory counts as residue: reset the GPU when nothing else holds it".into()
                } else if self.departed_listed(listed.pid).is_some() {
                    "none: the driver frees it once the teardown ends; re-run in a few seconds"
                        .into()
                } else if in_container {
                    "inspect it from the host: run vramguard on the host, or in a pod with \
                     hostPID: true"
                        .into()
                } else {
                    "run vramguard as root to see every process and the files they hold".into()
                },
                command: Some("vramguard diagnose".into()),
                reclaimable: false,
            },
            ..not_a_process_here(
                listed,
                Class::Foreign,
                "not a process of this PID namespace",
            )
        }
    }

    /// A holder the driver does not list: hidden, reclaimable once its job is gone, or when it
    /// keeps an exited pid's context alive inside a live process-group job (see
    /// [`Context::inheritor_may_go`]); in both cases only when it does no work.
    fn hidden_verdict(
        &self,
        gpu: &GpuSample,
        p: &ProcessFacts,
        job: &JobView,
        work: &Work,
        tie: Option<&KeeperTie>,
        evidence: &mut Vec<String>,
    ) -> (Class, Action) {
        let job_gone = job.dead.is_some();
        // Where this verdict's own evidence starts (an impostor's name may come before it).
        let own = evidence.len();
        if let Some(dead) = &job.dead {
            evidence.push(self.dead_job_evidence(p, dead));
        } else {
            evidence.push(job.info.evidence.clone());
        }
        let minor = self.minor_of(gpu);
        let files = match &p.device_files {
            FdScan::Scanned(files) => Some(files.as_slice()),
            _ => None,
        };
        let never = never_a_target(files, p.driver_library);
        // An NVML client is told as one first: what it is matters more than its job.
        if let Some(why @ (NO_CONTEXT | NVML_CLIENT)) = never {
            evidence.insert(own, why.into());
        }
        let kept = tie.filter(|t| self.tie_is_sound(p, t));
        match (tie, kept.and_then(|t| t.exited)) {
            (Some(t), Some(exited)) => evidence.push(format!(
                "{} the context of exited pid {exited}: it holds /dev/nvidia{minor} it \
                 inherited, and {}; CUDA does not support fork(), so no process can use that \
                 context",
                if t.strong {
                    "keeps alive"
                } else {
                    "may keep alive (a tie not confirmed)"
                },
                t.why
            )),
            (Some(t), None) => evidence.push(format!(
                "may keep alive the context of an exited pid listed on GPU {}: it holds \
                 /dev/nvidia{minor} unlisted and {}",
                gpu.index, t.why
            )),
            (None, _) if matches!(never, Some(NO_CONTEXT | NVML_CLIENT)) => evidence.push(format!(
                "holds /dev/nvidia{minor}, and the driver lists it on no GPU"
            )),
            (None, _) => evidence.push(format!(
                "holds /dev/nvidia{minor} but the driver lists it on no GPU (a context it \
                 inherited, or a container the driver hides)"
            )),
        }
        let keeps = kept.and_then(|t| t.exited);
        if keeps.is_some() {
            // What matters most about a keeper comes first: whose context it keeps.
            evidence.rotate_right(1);
        }
        // Reclaimed by default inside a live job only on a direct tie: a tie by elimination
        // (the only exited pid listed) or through a parent pid that may have been reused can
        // name an idle process of another live job, even another user's.
        let inheritor =
            keeps.is_some() && kept.is_some_and(|t| t.strong) && self.inheritor_may_go(p, job);
        if job_gone || keeps.is_some() {
            evidence.push(work_evidence(work));
        }
        if never == Some(DRIVER_LIBRARY_UNKNOWN) {
            evidence.push(DRIVER_LIBRARY_UNKNOWN.into());
        }
        let action = match keeps {
            Some(exited) if !job_gone && never.is_none() => {
                let confirmed = kept.is_some_and(|t| t.strong);
                keeper_action(
                    gpu.index, p.pid, exited, &job.info, inheritor, confirmed, work,
                )
            }
            _ => hidden_action(gpu.index, job_gone, never, work),
        };
        (Class::Hidden, action)
    }

    /// Whether an idle keeper of an exited pid may be reclaimed by default although its job
    /// lives: only in a plain process-group job (a script without job control still running
    /// after its trainer died). In a job something else owns (a systemd unit, a Slurm step, a
    /// pod or container, `vramguard run`), only when the job is named with `--job`.
    fn inheritor_may_go(&self, p: &ProcessFacts, job: &JobView) -> bool {
        // One that leads its own process group or session made itself a job of its own
        // (`setsid`, a daemon forked by the trainer), and that job lives.
        let leads = p.pgid == Some(p.pid) || p.sid == Some(p.pid);
        job.tree_top.is_some()
            && job.info.kind == JobKind::ProcessGroup
            && !leads
            && crate::job::live_supervisor_above(self.snap, p).is_none()
    }

    /// Whether `tie` is good enough to act on: a direct tie, or a re-parented holder that
    /// neither leads its own process group or session (a daemon that double-forked from a
    /// live trainer would) nor shares one with a live process listed on the GPU (whose
    /// context it may have inherited instead).
    fn tie_is_sound(&self, p: &ProcessFacts, tie: &KeeperTie) -> bool {
        if tie.exited.is_none() {
            return false;
        }
        if tie.strong {
            return true;
        }
        let leads = p.pgid == Some(p.pid) || p.sid == Some(p.pid);
        // Listed on any GPU: a worker double-forked from a live trainer on another GPU holds
        // every GPU's device file too.
        let kin_listed = self
            .snap
            .gpus
            .iter()
            .flat_map(|g| &g.processes)
            .any(|listed| {
                self.snap.process(listed.pid).is_some_and(|q| {
                    q.pid != p.pid
                        && !q.is_finished()
                        && ((q.pgid.is_some() && q.pgid == p.pgid)
                            || (q.sid.is_some() && q.sid == p.sid))
                })
            });
        !leads && !kin_listed
    }

    /// The unlisted holders of `gpu` that keep the contexts of the `exited` pids listed on
    /// it, with their ties. A keeper holds this GPU's device file and `/dev/nvidia-uvm`, has
    /// no context of its own on any GPU, and inherited its files through an ancestor (itself,
    /// or a chain of such holders above it) that was re-parented: the process that forked it
    /// is gone. Empty unless every process's open files were read.
    /// `strong_only`: exited pids that take strong ties only.
    fn keeper_ties(
        &self,
        gpu: &GpuSample,
        exited: &[u32],
        strong_only: &[u32],
    ) -> BTreeMap<u32, KeeperTie> {
        let mut ties = BTreeMap::new();
        if exited.is_empty() || !self.files_complete {
            return ties;
        }
        let unlisted: BTreeMap<u32, &ProcessFacts> = self
            .unlisted_context_holders(gpu)
            .map(|p| (p.pid, p))
            .collect();
        for (&pid, &p) in &unlisted {
            let mut root = p;
            for _ in 0..MAX_TREE_DEPTH {
                match root.ppid.and_then(|pp| unlisted.get(&pp)) {
                    Some(parent) if parent.pid != root.pid => root = parent,
                    _ => break,
                }
            }
            if self.live_parent(root).is_some() {
                continue;
            }
            let via = if root.pid == pid {
                String::new()
            } else {
                format!(" (through its ancestor {})", self.describe(root.pid))
            };
            // Forked by `e`, as an earlier collection saw: the same process only if the
            // departed process with that pid started when that parent did (pids are reused).
            let forked_by = |e: u32| -> Option<ParentMatch> {
                let q = [root, p].into_iter().find(|q| q.earlier_ppid == Some(e))?;
                Some(self.earlier_parent_match(q, e))
            };
            let direct: Vec<(u32, &str)> = exited
                .iter()
                .filter_map(|&e| {
                    if forked_by(e) == Some(ParentMatch::Same) {
                        Some((e, "was forked by it (an earlier collection saw the parent)"))
                    } else if root.pgid == Some(e) {
                        Some((e, "is in the process group it led"))
                    } else if root.sid == Some(e) {
                        Some((e, "is in the session it led"))
                    } else {
                        None
                    }
                })
                .collect();
            // Another user's exited pid: a child inherits its parent's uid.
            let other_users = |e: u32| {
                self.departed_listed(e)
                    .and_then(|d| d.uid)
                    .zip(p.uid)
                    .is_some_and(|(a, b)| a != b)
            };
            let unconfirmed_parent: Vec<u32> = exited
                .iter()
                .copied()
                .filter(|&e| forked_by(e) == Some(ParentMatch::Unconfirmed))
                .filter(|e| !other_users(*e) && !strong_only.contains(e))
                .collect();
            // Seen forked by an earlier process with that pid: not by the exited one, whose
            // context it then cannot have inherited.
            let forked_by_another = |e: u32| forked_by(e) == Some(ParentMatch::Reused);
            let tie = match (direct.as_slice(), exited) {
                ([(e, how)], _) => KeeperTie {
                    exited: Some(*e),
                    strong: true,
                    why: format!("it {how}{via}"),
                },
                ([], _) if let [e] = unconfirmed_parent.as_slice() => KeeperTie {
                    exited: Some(*e),
                    strong: false,
                    why: format!(
                        "it was forked by a process with pid {e}{via} (an earlier collection saw \
                         the parent), but whether the exited pid {e} is that same process could \
                         not be confirmed"
                    ),
                },
                (_, [e]) if forked_by_another(*e) => KeeperTie {
                    exited: None,
                    strong: false,
                    why: format!(
                        "it was re-parented after its parent died{via}; its parent had pid {e}, \
                         but the exited pid {e} is a later process that took that pid: no tie"
                    ),
                },
                (_, [e]) if other_users(*e) => KeeperTie {
                    exited: None,
                    strong: false,
                    why: format!(
                        "it was re-parented after its parent died{via}; {e}, the only exited pid \
                         listed on GPU {}, was another user's process: no tie is taken from it",
                        gpu.index
                    ),
                },
                (_, [e]) if strong_only.contains(e) => KeeperTie {
                    exited: None,
                    strong: false,
                    why: format!(
                        "it was re-parented after its parent died{via}; {e}, the only exited \
                         pid listed on GPU {}, is now an NVML client's pid, and nothing but \
                         that client's map says it exited: no tie is taken from it",
                        gpu.index
                    ),
                },
                (_, [e]) => KeeperTie {
                    exited: Some(*e),
                    strong: false,
                    why: format!(
                        "it was re-parented after its parent died{via}, and {e} is the only \
                         exited pid listed on GPU {}",
                        gpu.index
                    ),
                },
                _ => KeeperTie {
                    exited: None,
                    strong: false,
                    why: format!(
                        "it was re-parented after its parent died{via}; {} exited pids are \
                         listed on GPU {} ({}) and nothing ties it to one of them",
                        exited.len(),
                        gpu.index,
                        exited
                            .iter()
                            .map(u32::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                },
            };
            ties.insert(pid, tie);
        }
        // An exited pid that a keeper is tied to directly takes no tie by elimination: the
        // process directly tied is the one known to keep it.
        let tied_directly: BTreeSet<u32> = ties
            .values()
            .filter(|t| t.strong)
            .filter_map(|t| t.exited)
            .collect();
        for tie in ties.values_mut() {
            if let Some(e) = tie
                .exited
                .filter(|e| !tie.strong && tied_directly.contains(e))
            {
                tie.exited = None;
                tie.why = format!(
                    "{}; another process is tied to {e} directly, so no tie is taken from it",
                    tie.why
                );
            }
        }
        ties
    }

    /// Whether the departed process with pid `parent` is the one `q` was forked by: its
    /// start time against the one read while it was `q`'s parent.
    fn earlier_parent_match(&self, q: &ProcessFacts, parent: u32) -> ParentMatch {
        let departed = self.snap.departed.iter().rev().find(|d| d.pid == parent);
        match (
            departed.and_then(|d| d.start_ticks),
            q.earlier_parent_start_ticks,
        ) {
            (Some(a), Some(b)) if a == b => ParentMatch::Same,
            (Some(_), Some(_)) => ParentMatch::Reused,
            _ => ParentMatch::Unconfirmed,
        }
    }

    /// The processes that hold `gpu`'s device file and may hold a CUDA context (of their own
    /// or inherited: `/dev/nvidia-uvm`, and not known to be an NVML client) while
    /// the driver lists them on no GPU: who can keep an exited pid's context.
    fn unlisted_context_holders(
        &self,
        gpu: &'a GpuSample,
    ) -> impl Iterator<Item = &'a ProcessFacts> {
        self.snap.processes.iter().filter(move |p| {
            p.pid != self.snap.host.self_pid
                && !p.is_kernel_thread()
                && !self.listed_anywhere.contains(&p.pid)
                && self.holds_gpu_file(p, gpu)
                && p.may_hold_context() == Some(true)
                && !self.is_system(p)
        })
    }

    /// A listed pid that has exited, with the keepers of its context (see [`Class::Exited`]).
    fn exited_holder(
        &self,
        gpu: &GpuSample,
        listed: &GpuProcess,
        reused_by: Option<&ProcessFacts>,
        keepers: &[&Holder],
        ties: &BTreeMap<u32, KeeperTie>,
    ) -> Holder {
        let pid = listed.pid;
        let departed = self.departed_listed(pid);
        let name = departed
            .and_then(|d| d.comm.as_deref())
            .map(|c| format!(" ({})", escape(c)))
            .unwrap_or_default();
        let held = listed
            .used_bytes
            .map(|b| format!(" with {}", format_bytes(b)))
            .unwrap_or_default();
        let when = departed
            .map(|d| {
                format!(
                    " {} ago",
                    format_duration(Duration::from_millis(
                        self.snap.taken_at_ms.saturating_sub(d.gone_at_ms)
                    ))
                )
            })
            .unwrap_or_default();
        let mut evidence = vec![match reused_by {
            None => format!(
                "pid {pid}{name} exited{when}, but the driver still lists it{held}: its context \
                 outlives it"
            ),
            Some(q) if q.state == Some('Z') && !q.is_kernel_thread() => format!(
                "pid {pid} ({}) exited and is an unreaped zombie that holds no device file, but \
                 the driver still lists it{held}: its context outlives it",
                escape(q.comm.as_deref().unwrap_or("?"))
            ),
            Some(q) if q.driver_library == Some(DriverLibrary::NvmlOnly) => format!(
                "pid {pid} is now {} (an NVML client: libnvidia-ml without libcuda, no CUDA \
                 context): the process the driver lists{held} exited{when} and its pid was \
                 reused",
                escape(q.comm.as_deref().unwrap_or("?"))
            ),
            Some(q) => format!(
                "pid {pid} is now {} ({}), which holds no NVIDIA device file: the process the \
                 driver lists{held} exited{when} and its pid was reused",
                escape(q.comm.as_deref().unwrap_or("?")),
                if q.is_kernel_thread() {
                    "a kernel thread"
                } else {
                    "another process"
                }
            ),
        }];
        let g = gpu.index;
        let keeper_pids: Vec<u32> = keepers.iter().map(|h| h.pid).collect();
        let described = keeper_pids
            .iter()
            .map(|k| self.describe(*k))
            .collect::<Vec<_>>()
            .join(", ");
        // Possible keepers: holders tied to no exited pid in particular, or not soundly, and
        // unlisted holders of a context here that nothing ties to a dead parent (device files
        // received over a socket, say).
        let mut maybe: Vec<u32> = ties
            .iter()
            .filter(|(k, t)| {
                t.exited.is_none() || (t.exited == Some(pid) && !keeper_pids.contains(k))
            })
            .map(|(k, _)| *k)
            .collect();
        if keeper_pids.is_empty() {
            maybe.extend(
                self.unlisted_context_holders(gpu)
                    .map(|p| p.pid)
                    .filter(|p| !ties.contains_key(p)),
            );
            maybe.sort_unstable();
            maybe.dedup();
        }
        let stale = self.stale_teardown(pid);
        let all_go = !keepers.is_empty() && keepers.iter().all(|h| h.action.reclaimable);
        let (summary, command) = if !keepers.is_empty() {
            evidence.push(format!(
                "kept alive by {described}: processes it forked hold its device files; the \
                 memory comes back when the last of them exits"
            ));
            if all_go {
                (
                    format!("ghost memory: reclaiming its keepers ({described}) frees it"),
                    Some(format!("vramguard reclaim --gpu {g}")),
                )
            } else {
                let first = keepers
                    .iter()
                    .find(|h| !h.action.reclaimable)
                    .unwrap_or(&keepers[0]);
                (
                    format!(
                        "ghost memory: it comes back when its keepers ({described}) exit; {}",
                        first.action.summary
                    ),
                    first.action.command.clone(),
                )
            }
        } else if !maybe.is_empty() {
            evidence.push(format!(
                "possibly kept alive by {}: they hold /dev/nvidia{} and /dev/nvidia-uvm unlisted, \
                 but nothing ties them to it alone (several exited pids listed, files received \
                 from another process, or a live relative listed on GPU {g})",
                maybe
                    .iter()
                    .map(|k| self.describe(*k))
                    .collect::<Vec<_>>()
                    .join(", "),
                self.minor_of(gpu)
            ));
            (
                "ghost memory: it comes back when the processes that may keep it exit; ask \
                 their owners"
                    .to_string(),
                Some("vramguard diagnose".to_string()),
            )
        } else if !self.files_complete {
            evidence.push(format!(
                "vramguard (uid {}) cannot read other users' open files, so it cannot see which \
                 processes keep it",
                self.snap.host.euid
            ));
            (
                "the processes that keep it are not visible to this user: run vramguard as root \
                 to see them"
                    .to_string(),
                Some("sudo vramguard diagnose".to_string()),
            )
        } else if stale {
            evidence.push(format!(
                "no process holds /dev/nvidia{} for it, and it exited longer ago than the {} a \
                 teardown takes: its context was never torn down (residue)",
                self.minor_of(gpu),
                format_duration(Duration::from_millis(STALE_TEARDOWN_MS))
            ));
            (
                "its memory counts as residue: reset the GPU when nothing else holds it"
                    .to_string(),
                Some(format!("vramguard reclaim --gpu {g} --reset=auto")),
            )
        } else {
            evidence.push(format!(
                "no process holds /dev/nvidia{} for it: the driver is tearing its context down, \
                 or never will (residue)",
                self.minor_of(gpu)
            ));
            (
                "none yet: re-run in a few seconds; if it is still listed, it is residue that a \
                 GPU reset frees"
                    .to_string(),
                Some(format!(
                    "vramguard reclaim --gpu {g} --reset=auto --dry-run"
                )),
            )
        };
        // Its job is its keepers' job, when they share one.
        let jobs: BTreeSet<&str> = keepers
            .iter()
            .filter_map(|h| h.job.as_ref().map(|j| j.label.as_str()))
            .collect();
        let (job, dead_job) = match (jobs.len(), keepers.first()) {
            (1, Some(k)) => (k.job.clone(), k.dead_job.clone()),
            _ => (None, None),
        };
        Holder {
            comm: departed.and_then(|d| d.comm.clone()),
            command: departed.and_then(|d| d.cmdline.as_ref().map(|a| a.join(" "))),
            dead_job,
            job,
            keepers: if keeper_pids.is_empty() {
                maybe
            } else {
                keeper_pids
            },
            kept_by_unseen: !self.files_complete,
            evidence,
            action: Action {
                summary,
                command,
                reclaimable: false,
            },
            ..not_a_process_here(listed, Class::Exited, "it has exited")
        }
    }

    fn local_holder(
        &self,
        gpu: &GpuSample,
        p: &'a ProcessFacts,
        listed: Option<&GpuProcess>,
        reported_pid: Option<u32>,
        tie: Option<&KeeperTie>,
    ) -> Holder {
        let mut evidence = Vec::new();
        if let Some(reported) = reported_pid {
            evidence.push(format!(
                "the driver reports pid {reported}, the pid inside its PID namespace; it is pid \
                 {} here (NSpid {})",
                p.pid,
                p.nspid
                    .iter()
                    .map(|n| n.to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            ));
        }
        let job = self.job(p);
        let dead_job = job.dead.clone();
        let idle_secs = self.idle_secs(gpu, p, reported_pid.unwrap_or(p.pid));
        let work = self.job_work(p, dead_job.as_ref().and(job.tree_top));
        let system = self
            .policy
            .system_identity(p, self.snap.host.privileges().sees_every_process());
        if let Some(Err(why)) = &system {
            evidence.push(why.clone());
        }
        let (class, action) = if matches!(system, Some(Ok(()))) {
            system_verdict(p, &job, &mut evidence)
        } else if let Some(action) =
            self.zombie(gpu.index, p, &work, dead_job.is_none(), &mut evidence)
        {
            (Class::Zombie, action)
        } else if listed.is_none() {
            self.hidden_verdict(gpu, p, &job, &work, tie, &mut evidence)
        } else if let Some(dead) = &dead_job {
            evidence.push(self.dead_job_evidence(p, dead));
            evidence.push(work_evidence(&work));
            dead_job_verdict(gpu.index, p, &work)
        } else if let Some(idle) = idle_secs.filter(|s| *s >= self.policy.idle_after_secs) {
            evidence.push(format!(
                "no GPU utilization for {} (idle threshold {})",
                format_duration(Duration::from_secs(idle)),
                format_duration(Duration::from_secs(self.policy.idle_after_secs))
            ));
            evidence.push(job.info.evidence.clone());
            (
                Class::Idle,
                idle_action(gpu.index, p, self.policy.idle_after_secs),
            )
        } else {
            evidence.push(job.info.evidence.clone());
            (
                Class::Active,
                Action {
                    summary: "none: its job is running".into(),
                    command: None,
                    reclaimable: false,
                },
            )
        };
        // Below a live job supervisor the job views can be wrong (a group whose leader is
        // outside this PID namespace, a Slurm step around `vramguard run`); the planner refuses
        // such a holder, so the report offers no command for it either.
        // (The walk is asked for only where the class could be acted on: it is most holders'
        // ancestry, on every sample of the agent.)
        let supervisor = matches!(class, Class::Orphan | Class::Hidden | Class::Detached)
            .then(|| crate::job::live_supervisor_above(self.snap, p))
            .flatten();
        let action = match supervisor {
            Some(sup) => {
                let why = crate::job::supervised_by(sup);
                evidence.push(why.clone());
                Action {
                    summary: why,
                    command: None,
                    reclaimable: false,
                }
            }
            _ => action,
        };
        if class != Class::System
            && p.ppid == Some(1)
            && dead_job.is_none()
            && job.info.kind == JobKind::ProcessGroup
        {
            evidence.push("parent is pid 1, but its process group is intact (a daemon)".into());
        }
        Holder {
            pid: p.pid,
            reported_pid,
            class,
            listed: listed.is_some(),
            kinds: listed.map(|l| l.kinds.clone()).unwrap_or_default(),
            used_bytes: listed.and_then(|l| l.used_bytes),
            comm: p.comm.clone(),
            command: Some(p.display_command()),
            uid: p.uid,
            user: p.user.clone(),
            state: p.state,
            start_ticks: p.start_ticks,
            age_secs: self.age_secs(p),
            rss_bytes: p.rss_bytes,
            host_memory: p.host_memory,
            pod: None,
            cpu_millicores: self.cpu_millicores(p),
            ppid: p.ppid,
            pgid: p.pgid,
            nspid: p.nspid.clone(),
            container: p.container.clone(),
            pod_uid: p.pod_uid.clone(),
            device_files: match &p.device_files {
                FdScan::Scanned(files) => Some(files.clone()),
                _ => None,
            },
            driver_library: p.driver_library,
            dead_job,
            job: Some(self.with_system_service(p, job.info)),
            work,
            idle_secs,
            keepers: Vec::new(),
            kept_by_unseen: false,
            keeps_alive: tie
                .filter(|t| class == Class::Hidden && self.tie_is_sound(p, t))
                .and_then(|t| t.exited),
            keeps_alive_unconfirmed: tie.is_some_and(|t| {
                class == Class::Hidden && t.exited.is_some() && !t.strong && self.tie_is_sound(p, t)
            }),
            evidence,
            action,
        }
    }

    /// The zombie/exiting rule. Returns the action when it applies, pushing the evidence.
    /// `job_alive`: its job is not known to be gone. A main thread that called `pthread_exit`
    /// shows `Z` (and `PF_EXITING`) while the other threads live on: in a live job that is a
    /// live process (a server whose worker thread waits for requests), not one to finish,
    /// and the job rules decide it like any other.
    fn zombie(
        &self,
        gpu: u32,
        p: &ProcessFacts,
        work: &Work,
        job_alive: bool,
        evidence: &mut Vec<String>,
    ) -> Option<Action> {
        let leader_zombie = p.state == Some('Z');
        // The whole process, not its main thread alone: a main thread that called
        // `pthread_exit` is in `do_exit` too, while the others work on.
        let exiting = p.is_exiting();
        let leader_exiting = p.flags.is_some_and(|f| f & PF_EXITING != 0);
        if !leader_zombie && !leader_exiting {
            return None;
        }
        let threads = p.threads.as_deref().unwrap_or(&[]);
        let live: Vec<_> = threads
            .iter()
            .filter(|t| t.tid != p.pid && !matches!(t.state, 'Z' | 'X'))
            .collect();
        let stuck: Vec<_> = threads.iter().filter(|t| t.state == 'D').collect();
        if !exiting && p.threads.is_none() && job_alive {
            evidence.push(format!(
                "its main thread has exited or is exiting ({}{}), but its other threads could \
                 not be read: taken as a live process",
                p.state.unwrap_or('?'),
                if leader_exiting { ", PF_EXITING" } else { "" }
            ));
            return None;
        }
        if !exiting && !live.is_empty() && stuck.is_empty() && job_alive {
            evidence.push(format!(
                "its main thread has exited ({}) while {} other thread(s) live on, not leaving: \
                 a live process",
                p.state.unwrap_or('?'),
                live.len()
            ));
            return None;
        }
        let parent = p
            .ppid
            .map(|pp| self.describe(pp))
            .unwrap_or_else(|| "?".into());
        if leader_zombie && !live.is_empty() {
            evidence.push(format!(
                "main thread is a zombie (Z): it has exited while {} other thread(s) live on",
                live.len()
            ));
        } else if leader_zombie {
            evidence.push(format!(
                "main thread is a zombie (Z); parent {parent} has not reaped it"
            ));
        } else {
            evidence.push(format!(
                "is exiting (PF_EXITING) in state {}",
                p.state.unwrap_or('?')
            ));
        }
        if !live.is_empty() {
            evidence.push(format!(
                "threads still holding the device: {}",
                live.iter()
                    .map(|t| format!(
                        "{} ({}{})",
                        t.tid,
                        t.state,
                        t.wchan
                            .as_deref()
                            .filter(|w| !w.is_empty() && *w != "0")
                            .map(|w| format!(", in {w}"))
                            .unwrap_or_default()
                    ))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let action = if !stuck.is_empty() {
            Action {
                summary: format!(
                    "{} thread(s) are in uninterruptible sleep (D): no signal frees them; the \
                     memory returns when the blocked I/O completes (abort the hung FUSE/NFS \
                     mount or fix the device it waits on) or after a reboot",
                    stuck.len()
                ),
                command: Some(format!(
                    "cat /proc/{}/task/*/stack  # see where the threads block",
                    p.pid
                )),
                reclaimable: false,
            }
        } else if !exiting && !work.is_idle() {
            // A main thread that called pthread_exit leaves a working process behind: only a
            // whole process on its way out (every live thread leaving) needs no work check.
            evidence.push(work_evidence(work));
            Action {
                summary: if work.is_working() {
                    "its other threads are still working: leave it (ask its owner)".into()
                } else {
                    "whether its threads still work is unknown: `vramguard reclaim` samples \
                     it before deciding"
                        .into()
                },
                command: None,
                reclaimable: false,
            }
        } else if never_a_target(
            match &p.device_files {
                FdScan::Scanned(files) => Some(files.as_slice()),
                _ => None,
            },
            p.driver_library,
        ) == Some(NVML_CLIENT)
        {
            // An NVML client on its way out (a monitor, the agent, stopping): no context, no
            // memory; its exit closes its files without help.
            evidence.push(NVML_CLIENT.into());
            Action {
                summary: "an NVML client on its way out (no CUDA context, no GPU memory): its \
                          exit closes its files; signalling it frees nothing"
                    .into(),
                command: None,
                reclaimable: false,
            }
        } else if leader_zombie && live.is_empty() {
            Action {
                summary: format!(
                    "a pure zombie has already closed its files; its parent {parent} must reap \
                     it (or be stopped so that init reaps it)"
                ),
                command: p.ppid.map(|pp| format!("kill -CHLD {pp}")),
                reclaimable: false,
            }
        } else {
            // Through the planner, which checks the pid is still this process: a bare
            // `kill` pasted later could hit a reused pid.
            Action {
                summary: "SIGKILL finishes the exit of the threads still running".into(),
                command: Some(format!("vramguard reclaim --gpu {gpu} --include zombie")),
                reclaimable: true,
            }
        };
        Some(action)
    }

    /// The parent of `q` when it is a live process that did not merely adopt `q`.
    fn live_parent(&self, q: &ProcessFacts) -> Option<&'a ProcessFacts> {
        let pp = q.ppid.filter(|pp| *pp > 1)?;
        let parent = self.snap.process(pp)?;
        let adopter = self.is_adopter(parent);
        (!parent.is_finished() && !adopter && !parent.is_kernel_thread()).then_some(parent)
    }

    /// Whether `q` adopts orphans on purpose (see [`crate::policy::DEFAULT_SUBREAPER_COMMS`]).
    /// A job supervisor (`vramguard run`, tini, dumb-init, docker-init) by its name: believing
    /// it only keeps the jobs it adopted alive. An adopter that outlives what it adopts
    /// (`systemd`, `init`, `containerd-shim`, `conmon`) ends the walk up a job's tree, which can
    /// make a job gone, so its name must be its program's: where the executable can be read,
    /// its file name begins with it. A process that only took such a name
    /// (`prctl(PR_SET_NAME)`, red team) is the ordinary parent it is, and its children's job
    /// is its job. `vramguard` adopts only as `vramguard run`: the holders of a `vramguard
    /// probe` are that probe's job.
    fn is_adopter(&self, q: &ProcessFacts) -> bool {
        let Some(name) = q
            .comm
            .as_deref()
            .and_then(|c| self.policy.subreaper_name(c))
        else {
            return false;
        };
        if crate::job::job_supervisor(q).is_some() {
            return true;
        }
        if name == "vramguard" {
            return false;
        }
        q.exe.as_ref().is_none_or(|exe| {
            exe.path
                .rsplit('/')
                .next()
                .is_some_and(|file| file.starts_with(name))
        })
    }

    /// Walks up `p`'s tree inside its process group. Stops at a process that leads its group
    /// (the job is alive: its leader is right there), at a live parent in another group (the
    /// job belongs to that parent: a shell that runs a pipeline, a launcher), or at the top:
    /// the first process of the group whose parent is init, an adopter, outside this PID
    /// namespace or gone. Returns the process reached and, when the walk proved the job
    /// alive, how.
    fn group_walk(&self, p: &'a ProcessFacts) -> (&'a ProcessFacts, Option<AliveBy>) {
        let mut cur = p;
        for _ in 0..MAX_TREE_DEPTH {
            if cur.pgid.is_some() && cur.pgid == Some(cur.pid) {
                return (cur, Some(AliveBy::LeadsGroup));
            }
            let Some(parent) = self.live_parent(cur) else {
                break;
            };
            if parent.pgid != cur.pgid {
                return (cur, Some(AliveBy::Parent(parent.pid)));
            }
            cur = parent;
        }
        (cur, None)
    }

    /// Why a walk found `p`'s job alive, in words.
    fn alive_evidence(&self, p: &ProcessFacts, top: &ProcessFacts, by: AliveBy) -> String {
        match by {
            AliveBy::LeadsGroup if top.pid == p.pid => "leads its own process group".to_string(),
            AliveBy::LeadsGroup => format!(
                "its ancestor {} leads its process group",
                self.describe(top.pid)
            ),
            AliveBy::Parent(parent) => format!(
                "its {} {} lives",
                if top.pid == p.pid {
                    "parent"
                } else {
                    "job's parent"
                },
                self.describe(parent)
            ),
        }
    }

    /// `p`'s job and whether it lives (see the module documentation): its cgroup's job when
    /// it is in one vramguard recognises, else its process group's.
    fn job(&self, p: &'a ProcessFacts) -> JobView {
        if let Some(view) = self.run_cgroup_view(p) {
            return view;
        }
        match cgroup_job(p) {
            // A directory that took a Slurm job's name without being Slurm's: the ordinary
            // rules decide, and the evidence says why the name was not believed.
            Some(cg) if let Some(owner) = self.not_made_by_slurm(&cg, p) => {
                let mut view = self.group_job_view(p);
                view.info.evidence = format!(
                    "{}; its cgroup {} is named like a Slurm job's but belongs to uid {owner}, \
                     and Slurm makes a job's cgroup as root",
                    view.info.evidence,
                    shown(&cg.root)
                );
                view
            }
            // A Slurm step whose daemon is gone, holding a tree that a live supervisor adopted
            // (`srun vramguard run --isolation group …`): the supervisor's job lives.
            Some(cg) => match self.cgroup_job_view(p, cg) {
                view if view.dead.is_some() => {
                    let (top, alive) = self.group_walk(p);
                    alive
                        .is_none()
                        .then(|| self.adopted_by_supervisor(top, ""))
                        .flatten()
                        .unwrap_or(view)
                }
                view => view,
            },
            None => self.group_job_view(p),
        }
    }

    /// The owner of a Slurm-named job cgroup that a user made (in a subtree delegated to
    /// them: its owner is `p`'s own uid, or the path runs through that user's
    /// `user@UID.service`) and put their processes in: it is not Slurm's, and its missing
    /// `slurmstepd` proves no job gone. Slurm makes a job's directory as root, or as the
    /// root a user namespace maps (Slurm in a container), which is neither. `None` for every
    /// other cgroup, and for a snapshot that did not record the owner.
    fn not_made_by_slurm(&self, cg: &CgroupJob, p: &ProcessFacts) -> Option<u32> {
        if cg.kind != JobKind::Slurm {
            return None;
        }
        let owner = self
            .snap
            .job_cgroup(&cg.root)?
            .owner_uid
            .filter(|uid| *uid != 0)?;
        let delegated = format!("user@{owner}.service");
        (p.uid == Some(owner) || cg.root.split('/').any(|s| s == delegated)).then_some(owner)
    }

    /// The job of a process in a `vramguard run` cgroup whose supervisor lives (see
    /// [`Context::run_supervisor`]); `None` leaves it to the ordinary rules.
    fn run_cgroup_view(&self, p: &ProcessFacts) -> Option<JobView> {
        run_cgroups(p).iter().find_map(|run| {
            let sup = self.run_supervisor(p, run)?;
            Some(supervised_view(
                format!("run:{}", sup.pid),
                format!(
                    "in vramguard run {}'s cgroup {}, whose supervisor lives: its job lives \
                     while the supervisor does",
                    sup.pid,
                    shown(&run.root)
                ),
                None,
            ))
        })
    }

    /// The live supervisor of the `vramguard run` cgroup `run` that `p` is in, on the kernel's
    /// word first: the process with the pid the cgroup is named after (or, for a `run` in a
    /// PID namespace of its own, the one whose innermost NSpid it is), not a zombie, a kernel
    /// thread nor vramguard itself, living in the cgroup the leaf was made in (or whose cgroup
    /// is unreadable; for a leaf at the root of the hierarchy, any: a process at the cgroup v2
    /// root is recorded by its v1 path on a hybrid host, and only root can make a cgroup
    /// there), and either started no later than `p` (a pid reused after the supervisor died
    /// started after its job's processes) or, for a process older than it (moved into its
    /// cgroup), calling itself `vramguard run` (when unsure, alive).
    ///
    /// Only root or the owner of a delegated subtree can name a cgroup, and such an owner can
    /// already make a unit cgroup, which is always alive: this rule gives nobody a protection
    /// they lacked, and it never makes a job dead.
    fn run_supervisor(&self, p: &ProcessFacts, run: &RunCgroup) -> Option<&'a ProcessFacts> {
        let by_nspid = self.snap.processes.iter().filter(|q| {
            q.pid != run.supervisor && q.nspid.len() > 1 && q.nspid.last() == Some(&run.supervisor)
        });
        self.snap
            .process(run.supervisor)
            .into_iter()
            .chain(by_nspid)
            .find(|s| {
                !s.is_finished()
                    && !s.is_kernel_thread()
                    && s.pid != self.snap.host.self_pid
                    && (run.parent == "/" || s.cgroup.as_deref().is_none_or(|c| c == run.parent))
                    && match (s.start_ticks, p.start_ticks) {
                        (Some(sup), Some(member)) => {
                            sup <= member || job_supervisor(s) == Some("run")
                        }
                        _ => true,
                    }
            })
    }

    /// The job of a tree whose top was re-parented to a live job supervisor: `vramguard run`
    /// as the subreaper of its job, or a container init (see [`job_supervisor`]). Its job
    /// lives while the supervisor does.
    fn adopted_by_supervisor(&self, top: &ProcessFacts, via: &str) -> Option<JobView> {
        let pp = top.ppid.filter(|pp| *pp > 0)?;
        let sup = self.snap.process(pp)?;
        // vramguard asking about its own job (`run`'s summary, after the job ended) is no
        // keeper of it.
        if sup.is_finished() || sup.is_kernel_thread() || pp == self.snap.host.self_pid {
            return None;
        }
        let kind = job_supervisor(sup)?;
        let evidence = if kind == "run" {
            format!(
                "re-parented to the vramguard run supervisor {}, which lives{via}: its job \
                 lives while the supervisor does",
                self.describe(pp)
            )
        } else {
            format!(
                "re-parented to the container init {}, which lives{via}: its job lives while \
                 the init does",
                self.describe(pp)
            )
        };
        Some(supervised_view(
            format!("{kind}:{pp}"),
            evidence,
            Some(top.pid),
        ))
    }

    /// `info` with the system service `p` lies in, and how many processes that service runs
    /// when its cgroup was read whole (`systemctl stop` ends them all).
    fn with_system_service(&self, p: &ProcessFacts, info: JobInfo) -> JobInfo {
        let system_service = crate::job::system_service(p);
        let service_processes = system_service
            .as_deref()
            .and_then(|unit| self.snap.job_cgroup(&crate::job::system_service_root(unit)))
            .filter(|f| f.readable && f.complete)
            .map(|f| f.members);
        JobInfo {
            system_service,
            service_processes,
            ..info
        }
    }

    /// The job of a container, a pod, a Slurm step or a systemd unit, and whether it lives.
    fn cgroup_job_view(&self, p: &ProcessFacts, cg: CgroupJob) -> JobView {
        let facts = self.snap.job_cgroup(&cg.root);
        let in_own_pidns = p.nspid.len() > 1;
        let (alive, evidence, dead) = match cg.kind {
            JobKind::Pod | JobKind::Container => match facts {
                _ if in_own_pidns => (
                    Some(true),
                    format!(
                        "in {} with its own PID namespace, which cannot outlive its init",
                        shown(&cg.label)
                    ),
                    None,
                ),
                Some(f) if !f.namespace_inits.is_empty() => (
                    Some(true),
                    format!(
                        "in {}, whose init {} lives",
                        shown(&cg.label),
                        f.namespace_inits[0]
                    ),
                    None,
                ),
                _ => (
                    None,
                    format!(
                        "in {}, which shares the host PID namespace: its init cannot be \
                         told apart, so the container is taken as alive",
                        shown(&cg.label)
                    ),
                    None,
                ),
            },
            JobKind::Slurm => match facts {
                Some(f) if !f.step_daemons.is_empty() => (
                    Some(true),
                    format!(
                        "in {}, whose slurmstepd {} lives",
                        cg.label, f.step_daemons[0]
                    ),
                    None,
                ),
                Some(f) if f.readable && !f.complete => (
                    None,
                    format!(
                        "in {}, whose cgroup holds more than vramguard looks at ({} members) and \
                         no slurmstepd among those it did: the job is taken as alive",
                        shown(&cg.label),
                        f.members
                    ),
                    None,
                ),
                Some(f) if f.readable => (
                    Some(false),
                    format!("in {}, whose slurmstepd is gone", shown(&cg.label)),
                    Some(DeadJob {
                        leader_pid: p.pgid.unwrap_or(0),
                        leader_command: None,
                        leader_is_zombie: false,
                        label: Some(cg.label.clone()),
                    }),
                ),
                _ => (
                    None,
                    format!(
                        "in {}; its cgroup could not be read, so the job is taken as alive",
                        shown(&cg.label)
                    ),
                    None,
                ),
            },
            // Never named by a cgroup alone (see `run_cgroup_view`).
            JobKind::Supervised => (Some(true), format!("in {}", shown(&cg.label)), None),
            JobKind::Unit | JobKind::ProcessGroup => (
                Some(true),
                format!(
                    "in systemd {}, which owns its lifetime (`systemctl stop {}` ends it)",
                    shown(&cg.label),
                    shown(cg.label.trim_start_matches("unit:"))
                ),
                None,
            ),
        };
        JobView {
            info: JobInfo {
                label: cg.label,
                kind: cg.kind,
                alive,
                evidence,
                system_service: None,
                service_processes: None,
            },
            // A dead Slurm job's members are the processes of its cgroup; work of any
            // of them is judged per process.
            tree_top: None,
            dead,
        }
    }

    /// The job of a process group (the top of `p`'s tree that leads one), and whether it
    /// lives.
    fn group_job_view(&self, p: &'a ProcessFacts) -> JobView {
        let (top, alive_why) = self.group_walk(p);
        let via = if top.pid == p.pid {
            String::new()
        } else {
            format!(" (through its ancestor {})", self.describe(top.pid))
        };
        let alive = |evidence: String| JobView {
            info: JobInfo {
                label: top
                    .pgid
                    .filter(|g| *g > 0)
                    .map_or_else(|| format!("pid:{}", top.pid), |g| format!("pgid:{g}")),
                kind: JobKind::ProcessGroup,
                alive: Some(true),
                evidence,
                system_service: None,
                service_processes: None,
            },
            dead: None,
            tree_top: Some(top.pid),
        };
        if let Some(by) = alive_why {
            return alive(self.alive_evidence(p, top, by));
        }
        let Some(pgid) = top.pgid else {
            return alive(format!(
                "its process group is unreadable{via}; taken as alive"
            ));
        };
        if pgid == 0 {
            return alive(format!(
                "its process-group leader is outside this PID namespace{via}"
            ));
        }
        let leader = self.snap.process(pgid);
        let leader_is_zombie = match leader {
            // A process with that pid that is not in the group is a reused pid: the leader
            // is gone just the same.
            Some(l) if l.pgid == Some(pgid) && !l.is_finished() => {
                return alive(format!(
                    "its job leader {} is alive{via}",
                    self.describe(pgid)
                ));
            }
            Some(l) => l.pgid == Some(pgid) && l.is_finished(),
            None => false,
        };
        if let Some(view) = self.adopted_by_supervisor(top, &via) {
            return view;
        }
        let leader_command = self
            .snap
            .departed
            .iter()
            .rev()
            .find(|d| d.pid == pgid)
            .map(|d| match &d.cmdline {
                Some(args) if !args.is_empty() => args.join(" "),
                _ => d.comm.clone().unwrap_or_default(),
            })
            .filter(|c| !c.is_empty());
        let mut view = alive(String::new());
        view.info.alive = Some(false);
        view.info.evidence = format!("its job leader {pgid} is gone{via}");
        view.dead = Some(DeadJob {
            leader_pid: pgid,
            leader_command,
            leader_is_zombie,
            label: None,
        });
        view
    }

    /// What `p` itself showed of work in the window.
    fn process_work(&self, p: &ProcessFacts) -> Work {
        let mut evidence = Vec::new();
        for (gpu, pct, ago) in self.gpu_busy.get(&p.pid).into_iter().flatten() {
            evidence.push(format!(
                "{pct} % utilization on GPU {gpu} {} ago",
                format_duration(Duration::from_millis(*ago))
            ));
        }
        let sample = self.snap.work_of(p.pid, p.start_ticks);
        let millicores = self.cpu_millicores(p);
        if let (Some(s), Some(mc)) = (sample, millicores) {
            if mc as f64 >= self.policy.work_cpu_percent * 10.0 && s.cpu_ticks > 0 {
                evidence.push(format!(
                    "{} % of a CPU core over {}",
                    mc / 10,
                    format_duration(Duration::from_millis(s.observed_ms))
                ));
            }
            if s.observations >= 3
                && u64::from(s.running_observations) * 2 > u64::from(s.observations)
            {
                evidence.push(format!(
                    "threads running in {} of {} observations",
                    s.running_observations, s.observations
                ));
            }
        }
        if !evidence.is_empty() {
            return Work::Working { evidence };
        }
        // A GPU whose process lists failed shows neither who computes on it nor how much: a
        // holder of its device file may be working there unseen (long kernels, little CPU).
        let unplaced = self.unreadable_unplaced.as_ref().filter(|_| {
            p.device_files
                .gpu_minors()
                .any(|m| !self.readable_minors.contains(&m))
        });
        if let Some((gpu, why)) = p
            .device_files
            .gpu_minors()
            .find_map(|m| self.unreadable.get(&m))
            .or(unplaced)
        {
            return Work::Unknown {
                why: format!("GPU {gpu} could not be read ({why}), so its work there is unknown"),
            };
        }
        // Threads mostly in uninterruptible sleep: I/O in progress (a checkpoint written to a
        // slow filesystem) or stuck in the driver. Not idle, not known to work: counted as
        // memory of a job that is gone, and left alone.
        if let Some(s) = sample
            && u64::from(s.waiting_observations) * 2 > u64::from(s.observations)
        {
            return Work::Unknown {
                why: format!(
                    "a thread was in uninterruptible sleep (D) in {} of {} observations: I/O in \
                     progress, or stuck in the driver",
                    s.waiting_observations, s.observations
                ),
            };
        }
        let Some(s) = sample else {
            return Work::Unknown {
                why: if self.snap.work.is_none() {
                    "its CPU use was not sampled (sampling window 0)".into()
                } else {
                    "it was not observed in the sampling window".into()
                },
            };
        };
        if s.observed_ms < self.policy.work_min_window_ms {
            return Work::Unknown {
                why: format!(
                    "observed for only {} ms (at least {} ms are needed)",
                    s.observed_ms, self.policy.work_min_window_ms
                ),
            };
        }
        if let Some(gpu) = self.gpu_unknown.get(&p.pid) {
            return Work::Unknown {
                why: format!("GPU {gpu} reports no per-process utilization"),
            };
        }
        Work::Idle {
            window_ms: s.observed_ms,
            cpu_millicores: millicores.unwrap_or(0),
        }
    }

    /// The rest of `top`'s dead process group whose work counts for `top`'s tree: the trees of
    /// other members of that group that hold no GPU file and whose own walk proved nothing
    /// alive, with their descendants that hold none either. A killed script's data server and
    /// trainer, each re-parented on its own, are one job, and the server's work counts for the
    /// trainer (red team: the idle trainer was an orphan while the data server it waited on
    /// worked). Another GPU holder's tree counts for itself alone (its upload included): a
    /// rank idle beside working ranks of a dead torchrun agent is still an orphan.
    fn dead_group_members(&self, top: u32) -> std::rc::Rc<Vec<u32>> {
        if let Some(known) = self.dead_groups.borrow().get(&top) {
            return known.clone();
        }
        let members = std::rc::Rc::new(self.find_dead_group_members(top));
        self.dead_groups.borrow_mut().insert(top, members.clone());
        members
    }

    fn find_dead_group_members(&self, top: u32) -> Vec<u32> {
        let Some(group) = self
            .snap
            .process(top)
            .and_then(|t| t.pgid)
            .filter(|g| *g > 0)
        else {
            return Vec::new();
        };
        let tree = self.tree();
        let mut tops = BTreeSet::new();
        for q in &self.snap.processes {
            if q.pgid != Some(group) || q.pid == self.snap.host.self_pid || q.is_kernel_thread() {
                continue;
            }
            let (its_top, alive) = self.group_walk(q);
            if alive.is_none()
                && its_top.pid != top
                && its_top.pgid == Some(group)
                && its_top.device_files.gpu_minors().next().is_none()
            {
                tops.insert(its_top.pid);
            }
        }
        let mut out = Vec::new();
        for t in tops {
            for m in tree.members.get(&t).into_iter().flatten() {
                out.push(*m);
                out.extend(self.descendants(*m));
            }
        }
        out.sort_unstable();
        out.dedup();
        out.retain(|q| {
            *q != self.snap.host.self_pid
                && self.snap.process(*q).is_some_and(|q| {
                    !q.is_kernel_thread() && q.device_files.gpu_minors().next().is_none()
                })
        });
        out
    }

    /// Every process's tree top, and the processes under each top.
    fn tree(&self) -> &Tree {
        self.tree.get_or_init(|| {
            let mut tree = Tree::default();
            for q in &self.snap.processes {
                if q.pid == self.snap.host.self_pid || q.is_kernel_thread() {
                    continue;
                }
                let top = self.group_walk(q).0.pid;
                tree.tops.insert(q.pid, top);
                tree.members.entry(top).or_default().push(q.pid);
            }
            tree
        })
    }

    /// `p`'s descendants in the snapshot, breadth first, at most a few thousand.
    fn descendants(&self, p: u32) -> Vec<u32> {
        if !self.children.contains_key(&p) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let mut queue = std::collections::VecDeque::from([p]);
        while let Some(cur) = queue.pop_front() {
            for &c in self.children.get(&cur).into_iter().flatten() {
                if c != p && out.len() < 4096 && !out.contains(&c) {
                    out.push(c);
                    queue.push_back(c);
                }
            }
        }
        out
    }

    /// [`Context::process_work`], once per process.
    fn cached_work(&self, pid: u32) -> Work {
        if let Some(w) = self.own_work.borrow().get(&pid) {
            return w.clone();
        }
        let w = match self.snap.process(pid) {
            Some(q) => self.process_work(q),
            None => Work::Unknown {
                why: "not in the snapshot".into(),
            },
        };
        self.own_work.borrow_mut().insert(pid, w.clone());
        w
    }

    /// The work that protects `p`: its own, its descendants' (the parent of working holders
    /// is working), and — for a dead job whose tree top is `top` — every process under the
    /// same top (a trainer whose workers compute is working, and so are they).
    fn job_work(&self, p: &'a ProcessFacts, top: Option<u32>) -> Work {
        let seen = self.job_work_seen(p, top);
        // Descendants the collection could not all read: any of them may be working.
        let unread = self
            .snap
            .scan
            .descendants_unread
            .iter()
            .any(|r| *r == p.pid || Some(*r) == top)
            || top.is_some_and(|t| {
                self.dead_group_members(t)
                    .iter()
                    .any(|m| self.snap.scan.descendants_unread.contains(m))
            });
        if unread && !matches!(seen, Work::Working { .. }) {
            return Work::Unknown {
                why: "its descendants could not all be read (too many processes or threads), \
                      so whether they work is unknown"
                    .into(),
            };
        }
        seen
    }

    /// [`Context::job_work`] from the processes in the snapshot.
    fn job_work_seen(&self, p: &'a ProcessFacts, top: Option<u32>) -> Work {
        let mut others: Vec<u32> = top
            .and_then(|t| self.tree().members.get(&t))
            .into_iter()
            .flatten()
            .copied()
            .filter(|q| *q != p.pid)
            .collect();
        if let Some(t) = top {
            for &q in self.dead_group_members(t).iter() {
                if q != p.pid && !others.contains(&q) {
                    others.push(q);
                }
            }
        }
        for d in self.descendants(p.pid) {
            let weighed = self
                .snap
                .process(d)
                .is_some_and(|q| q.pid != self.snap.host.self_pid && !q.is_kernel_thread());
            if weighed && !others.contains(&d) {
                others.push(d);
            }
        }
        if others.is_empty() {
            return self.process_work(p);
        }
        let own = self.cached_work(p.pid);
        let mut evidence = match &own {
            Work::Working { evidence } => evidence.clone(),
            _ => Vec::new(),
        };
        let (mut quoted, mut more) = (0, 0);
        let mut unknown = match &own {
            Work::Unknown { why } => Some(why.clone()),
            _ => None,
        };
        for q in others {
            match self.cached_work(q) {
                Work::Working { evidence: e } if quoted < WORK_EVIDENCE_QUOTED => {
                    quoted += 1;
                    for line in e {
                        evidence.push(format!("{} of its job: {line}", self.describe(q)));
                    }
                }
                Work::Working { .. } => more += 1,
                Work::Unknown { why } if unknown.is_none() => {
                    unknown = Some(format!("{} of its job: {why}", self.describe(q)));
                }
                _ => {}
            }
        }
        if more > 0 {
            evidence.push(format!("and {more} more working process(es) of its job"));
        }
        if !evidence.is_empty() {
            Work::Working { evidence }
        } else if let Some(why) = unknown {
            Work::Unknown { why }
        } else {
            own
        }
    }

    fn dead_job_evidence(&self, p: &ProcessFacts, job: &DeadJob) -> String {
        let leader = match &job.leader_command {
            Some(cmd) => format!("{} ({})", job.leader_pid, shown(cmd)),
            None => job.leader_pid.to_string(),
        };
        let state = if job.leader_is_zombie {
            "has exited (an unreaped zombie)"
        } else {
            "is gone"
        };
        let parent = match p.ppid {
            Some(1) => "it was re-parented to init (pid 1)".to_string(),
            Some(pp) => {
                let adopted = self.snap.process(pp).is_some_and(|q| self.is_adopter(q));
                if adopted {
                    format!("it was re-parented to the subreaper {}", self.describe(pp))
                } else {
                    format!("its parent is now {}", self.describe(pp))
                }
            }
            None => "its parent is unknown".to_string(),
        };
        let forked_by = match p.earlier_ppid {
            Some(pp) if pp != job.leader_pid => {
                let cmd = self
                    .snap
                    .departed
                    .iter()
                    .rev()
                    .find(|d| d.pid == pp)
                    .and_then(|d| d.comm.clone());
                match cmd {
                    Some(c) => format!("; forked by {pp} ({}), which died", escape(&c)),
                    None => format!("; forked by {pp}, which died"),
                }
            }
            _ => String::new(),
        };
        match &job.label {
            Some(label) => format!("its job {} is gone; {parent}{forked_by}", shown(label)),
            None => format!("its job leader {leader} {state}; {parent}{forked_by}"),
        }
    }

    fn idle_secs(&self, gpu: &GpuSample, p: &ProcessFacts, reported: u32) -> Option<u64> {
        let window = gpu.utilization.as_ref()?;
        let now = self.snap.taken_at_ms;
        let last_active = window
            .samples
            .iter()
            .filter(|s| s.pid == reported && self.policy.is_gpu_work(s))
            .map(|s| s.last_seen_ms)
            .max();
        let quiet_since = match last_active {
            Some(t) => t,
            None => {
                // Idle since the window began, or since the process started if later.
                let started = self.start_time_ms(p).unwrap_or(window.since_ms);
                window.since_ms.max(started)
            }
        };
        Some(now.saturating_sub(quiet_since) / 1000)
    }

    fn start_time_ms(&self, p: &ProcessFacts) -> Option<u64> {
        let boot = self.snap.host.boot_time_ms?;
        let hz = self.snap.host.clock_ticks_per_sec.max(1);
        Some(boot.saturating_add(p.start_ticks?.saturating_mul(1000) / hz))
    }

    fn reset_blockers(&self, gpu: &GpuSample, holders: &[Holder]) -> Vec<ResetBlocker> {
        let mut blockers = Vec::new();
        let mut seen = BTreeSet::new();
        for h in holders {
            if h.class == Class::Exited {
                continue;
            }
            // A pid the driver lists from a namespace vramguard cannot see is a context all the
            // same: a reset would end it.
            let reason = if h.class == Class::Foreign {
                "is listed by the driver with a context on this GPU, from a PID namespace \
                 vramguard cannot see (foreign)"
                    .to_string()
            } else if h.listed {
                format!("has a context on this GPU ({})", h.class)
            } else {
                format!("holds the device file ({})", h.class)
            };
            seen.insert(h.pid);
            blockers.push(ResetBlocker {
                pid: h.pid,
                comm: h.comm.clone(),
                reason,
            });
        }
        for p in &self.snap.processes {
            if p.pid == self.snap.host.self_pid || seen.contains(&p.pid) {
                continue;
            }
            if self.holds_gpu_file(p, gpu) {
                blockers.push(ResetBlocker {
                    pid: p.pid,
                    comm: p.comm.clone(),
                    reason: "holds the device file (a context on another GPU)".into(),
                });
            }
        }
        blockers
    }

    /// `(used, total)`: the GPU's memory.
    fn unaccounted(
        &self,
        gpu: &GpuSample,
        (used, total): (u64, u64),
        accounted: u64,
        holders: &[Holder],
        blockers: &[ResetBlocker],
        residue_pids: &BTreeSet<u32>,
    ) -> Unaccounted {
        let baseline = self.policy.baseline_for(gpu.index, gpu.uuid.as_deref());
        let tolerance = self.policy.tolerance_for(total);
        let bytes = used.saturating_sub(accounted.saturating_add(baseline));
        let significant = bytes > tolerance;
        let mut explanation = Vec::new();
        let mut cause = None;
        if significant {
            explanation.push(format!(
                "{} used, {} charged to listed processes, baseline {}: {} unaccounted \
                 (tolerance {})",
                format_bytes(used),
                format_bytes(accounted),
                format_bytes(baseline),
                format_bytes(bytes),
                format_bytes(tolerance)
            ));
            let unlisted: Vec<&Holder> = holders
                .iter()
                .filter(|h| h.class == Class::Hidden || (!h.listed && h.class == Class::Zombie))
                .collect();
            // A CUDA context needs /dev/nvidia-uvm; a process without it, or one mapping NVML
            // and not the CUDA driver library, is an NVML client (a monitor, a daemon) and
            // holds no memory.
            let (hidden, contextless): (Vec<&Holder>, Vec<&Holder>) = unlisted
                .into_iter()
                .partition(|h| h.may_hold_context() != Some(false));
            let (why, lines) = self.unaccounted_cause(gpu, &hidden, blockers, residue_pids);
            cause = Some(why);
            explanation.extend(lines);
            for p in gpu
                .processes
                .iter()
                .filter(|p| residue_pids.contains(&p.pid))
            {
                explanation.push(format!(
                    "{} of it is listed for pid {}, which exited long ago: a context the driver \
                     never tore down",
                    format_bytes(p.used_bytes.unwrap_or(0)),
                    p.pid
                ));
            }
            if !contextless.is_empty() && hidden.is_empty() {
                let without_uvm = contextless.iter().all(|h| {
                    h.device_files
                        .as_ref()
                        .is_some_and(|f| !f.contains(&DeviceFile::Uvm))
                });
                let why = if without_uvm {
                    "without /dev/nvidia-uvm (no CUDA context)"
                } else {
                    // Driver 580's NVML holds uvm too: the library mapped tells.
                    "as NVML clients (no /dev/nvidia-uvm, or libnvidia-ml mapped without \
                     libcuda: no CUDA context)"
                };
                explanation.push(format!(
                    "at least {} is not explained by any holder: {} hold /dev/nvidia{} {why}, \
                     so they hold none of it",
                    format_bytes(bytes),
                    contextless
                        .iter()
                        .map(|h| self.describe(h.pid))
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.minor_of(gpu)
                ));
            }
            if matches!(gpu.process_list, ProcessListState::Unreliable { .. }) {
                explanation.push(
                    "the driver's process list is unreliable on this GPU, so the split between \
                     listed and unaccounted memory may be wrong"
                        .into(),
                );
            }
        }
        Unaccounted {
            bytes,
            tolerance_bytes: tolerance,
            baseline_bytes: baseline,
            significant,
            cause,
            explanation,
        }
    }

    /// Why memory no listed process accounts for is used on `gpu`, and the explanation's
    /// lines after the first: per-process memory not reported (MIG, vGPU), holders the driver
    /// does not list, another PID namespace, driver residue, or unknown (a partial scan).
    fn unaccounted_cause(
        &self,
        gpu: &GpuSample,
        hidden: &[&Holder],
        blockers: &[ResetBlocker],
        residue_pids: &BTreeSet<u32>,
    ) -> (UnaccountedCause, Vec<String>) {
        let mut explanation = Vec::new();
        let cause;
        let unavailable = gpu.processes.iter().any(|p| p.used_bytes.is_none());
        if unavailable {
            cause = UnaccountedCause::PerProcessMemoryUnavailable;
            explanation.push(
                "the driver does not report per-process memory here (MIG or vGPU), so the \
                 listed processes may account for it"
                    .into(),
            );
        } else if !hidden.is_empty() {
            cause = UnaccountedCause::HiddenHolders;
            explanation.push(format!(
                "held by processes the driver does not list: {}",
                hidden
                    .iter()
                    .map(|h| self.describe(h.pid))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            explanation.push(format!(
                "their share is unknown: whatever remains after they exit is driver residue \
                 (`vramguard reclaim --gpu {} --include hidden --reset=auto`)",
                gpu.index
            ));
        } else if !residue_pids.is_empty()
            || (self.snap.host.pid_namespace_is_host != Some(false)
                && self.snap.scan.full_fd_scan
                && self.snap.host.privileges().sees_every_process())
        {
            cause = UnaccountedCause::DriverResidue;
            let live: Vec<&ResetBlocker> = blockers.iter().collect();
            explanation.push(format!(
                "{}: memory the driver did not free (residue); only a GPU reset (or \
                 reboot) clears it",
                if live.is_empty() {
                    format!(
                        "no process has a context on it or holds /dev/nvidia{}",
                        self.minor_of(gpu)
                    )
                } else {
                    "no unlisted process has a CUDA context here".into()
                }
            ));
            if !live.is_empty() {
                explanation.push(format!(
                    "a reset would be refused while these hold the device: {}",
                    live.iter()
                        .map(|b| self.describe(b.pid))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        } else if self.snap.host.pid_namespace_is_host == Some(false) {
            cause = UnaccountedCause::OtherNamespace;
            explanation.push(
                "vramguard runs in a container: holders in other PID namespaces are \
                 invisible here; run it on the host or with hostPID: true"
                    .into(),
            );
        } else {
            cause = UnaccountedCause::Unknown;
            explanation.push(if !self.snap.scan.full_fd_scan {
                "open files were not scanned for every process; run `vramguard diagnose` \
                 for a full scan"
                    .into()
            } else {
                "some processes' open files were unreadable; run as root to tell hidden \
                 holders from driver residue"
                    .into()
            });
        }
        (cause, explanation)
    }
}

/// A live job under a supervisor that ends with it (see [`JobKind::Supervised`]).
fn supervised_view(label: String, evidence: String, tree_top: Option<u32>) -> JobView {
    JobView {
        info: JobInfo {
            label,
            kind: JobKind::Supervised,
            alive: Some(true),
            evidence,
            system_service: None,
            service_processes: None,
        },
        dead: None,
        tree_top,
    }
}

/// A listed pid that is no process vramguard can describe (foreign, exited): the driver's
/// facts, and nothing of a process; the caller sets the evidence and action.
fn not_a_process_here(listed: &GpuProcess, class: Class, why_no_work: &str) -> Holder {
    Holder {
        pid: listed.pid,
        reported_pid: None,
        class,
        listed: true,
        kinds: listed.kinds.clone(),
        used_bytes: listed.used_bytes,
        comm: None,
        command: None,
        uid: None,
        user: None,
        state: None,
        start_ticks: None,
        age_secs: None,
        rss_bytes: None,
        host_memory: None,
        pod: None,
        cpu_millicores: None,
        ppid: None,
        pgid: None,
        nspid: Vec::new(),
        container: None,
        pod_uid: None,
        device_files: None,
        driver_library: None,
        dead_job: None,
        job: None,
        work: Work::Unknown {
            why: why_no_work.into(),
        },
        idle_secs: None,
        keepers: Vec::new(),
        keeps_alive: None,
        keeps_alive_unconfirmed: false,
        kept_by_unseen: false,
        evidence: Vec::new(),
        action: Action {
            summary: String::new(),
            command: None,
            reclaimable: false,
        },
    }
}

/// A system service (the persistence daemon, a monitoring agent): never signalled, but it
/// blocks a GPU reset.
fn system_verdict(p: &ProcessFacts, job: &JobView, evidence: &mut Vec<String>) -> (Class, Action) {
    let unit = if job.info.kind == JobKind::Unit {
        format!(", {}", shown(&job.info.label))
    } else {
        String::new()
    };
    evidence.push(format!(
        "{} is a system service{}{unit}; it is never signalled, but blocks a GPU reset",
        escape(p.comm.as_deref().unwrap_or("?")),
        p.exe
            .as_ref()
            .map(|e| format!(" ({})", shown(&e.path)))
            .unwrap_or_default()
    ));
    (
        Class::System,
        Action {
            summary: "leave it running; stop the service only to reset the GPU".into(),
            command: None,
            reclaimable: false,
        },
    )
}

/// Why an unlisted holder without `/dev/nvidia-uvm` is never a target (the report's evidence
/// and the planner's refusal say the same).
pub const NO_CONTEXT: &str = "holds no /dev/nvidia-uvm: no CUDA context, so no GPU memory \
                              (an NVML client: a monitor, an exporter); signalling it would free \
                              nothing";

/// Why an unlisted holder of `/dev/nvidia-uvm` that maps the NVML library and not the CUDA
/// driver library is never a target: on driver 580 every NVML client holds uvm too.
pub const NVML_CLIENT: &str = "maps libnvidia-ml and no CUDA driver library (libcuda.so): an \
                               NVML client (a monitor, an exporter; on driver 580 these hold \
                               /dev/nvidia-uvm too), with no CUDA context and no GPU memory; \
                               signalling it would free nothing";

/// Why an unlisted holder whose memory map could not be read whole is never a target.
pub const DRIVER_LIBRARY_UNKNOWN: &str = "its memory map could not be read whole, so whether \
                                          it holds a CUDA context or is an NVML client (which \
                                          on driver 580 holds /dev/nvidia-uvm too) is unknown: \
                                          not signalled";

/// Why an unlisted holder of these files is never a reclaim target, whatever its job: it
/// holds no CUDA context (an NVML client), or nothing shows whether it does. `None`: it may
/// be one. `files`: `None` when not scanned; `library`: `None` when not looked at (a snapshot
/// from before the libraries were read, judged by uvm alone as then).
pub fn never_a_target(
    files: Option<&[DeviceFile]>,
    library: Option<DriverLibrary>,
) -> Option<&'static str> {
    if !files?.contains(&DeviceFile::Uvm) {
        return Some(NO_CONTEXT);
    }
    match library? {
        DriverLibrary::NvmlOnly => Some(NVML_CLIENT),
        DriverLibrary::Unknown => Some(DRIVER_LIBRARY_UNKNOWN),
        DriverLibrary::Cuda | DriverLibrary::Neither => None,
    }
}

/// What to do about a holder the driver does not list (a hidden one): terminate it only when
/// its job is gone and it does no work, never when it cannot hold a context or nothing shows
/// whether it does (`never`, the reason).
fn hidden_action(gpu: u32, job_gone: bool, never: Option<&str>, work: &Work) -> Action {
    // Without /dev/nvidia-uvm no CUDA context can exist, and a process mapping NVML but not
    // the CUDA driver library is an NVML client (a monitor, an exporter): it holds no GPU
    // memory, and signalling it would free nothing.
    match never {
        Some(why @ (NO_CONTEXT | NVML_CLIENT)) => {
            let because = if why == NO_CONTEXT {
                "no /dev/nvidia-uvm"
            } else {
                "libnvidia-ml without libcuda"
            };
            return Action {
                summary: format!(
                    "an NVML client ({because}: no CUDA context, no GPU memory): signalling it \
                     frees nothing; it blocks a GPU reset while it runs, so a reset waits for \
                     its owner to stop it"
                ),
                command: None,
                reclaimable: false,
            };
        }
        Some(_) => {
            return Action {
                summary: "whether it holds a CUDA context is unknown (its memory map could not \
                          be read): leave it; ask its owner"
                    .into(),
                command: None,
                reclaimable: false,
            };
        }
        None => {}
    }
    let reclaimable = job_gone && work.is_idle();
    Action {
        summary: if reclaimable {
            "its job is gone and it does no work: terminate it (SIGTERM, then SIGKILL)".into()
        } else if job_gone && work.is_working() {
            "its job's leader is gone, but it is working: ask its owner before stopping it".into()
        } else if job_gone {
            "its job is gone; whether it still works is unknown: `vramguard reclaim` samples \
             it before deciding"
                .into()
        } else {
            "its job is alive: ask its owner before stopping it".into()
        },
        command: Some(format!("vramguard reclaim --gpu {gpu} --include hidden")),
        reclaimable,
    }
}

/// What to do about a keeper of an exited pid's context whose job lives: terminate it by
/// default when it does no work and its job is a plain process group (`inheritor`); ask the
/// job's owner, or name the job with `--job`, when something else owns the job.
fn keeper_action(
    gpu: u32,
    pid: u32,
    exited: u32,
    job: &JobInfo,
    inheritor: bool,
    confirmed: bool,
    work: &Work,
) -> Action {
    let reclaimable = inheritor && work.is_idle();
    let summary = if reclaimable {
        format!(
            "it keeps exited pid {exited}'s context, which no process can use, and does no \
             work: terminate it (SIGTERM, then SIGKILL)"
        )
    } else if work.is_working() {
        format!("it keeps exited pid {exited}'s context but is working: ask its owner")
    } else if inheritor {
        format!(
            "it keeps exited pid {exited}'s context; whether it still works is unknown: \
             `vramguard reclaim` samples it before deciding"
        )
    } else if !confirmed {
        format!(
            "it may keep exited pid {exited}'s context (nothing confirms it is that pid's \
             worker: it was only re-parented on this GPU), and its job {} is alive: ask its \
             owner; once sure, reclaim that job's keepers by name",
            shown(&job.label)
        )
    } else {
        format!(
            "it keeps exited pid {exited}'s context, but its job {} is alive: ask its owner, \
             or reclaim that job's keepers by name",
            shown(&job.label)
        )
    };
    let command = if job.kind == JobKind::Supervised && !inheritor {
        // vramguard never acts inside a job a live supervisor runs: it ends with that job.
        return Action {
            summary: format!(
                "it keeps exited pid {exited}'s context inside {}, which a live supervisor \
                 runs: it ends with that job (ask its owner to stop it)",
                shown(&job.label)
            ),
            command: None,
            reclaimable: false,
        };
    } else if work.is_working() {
        // Nothing to run: the planner would refuse a working keeper.
        return Action {
            summary,
            command: None,
            reclaimable: false,
        };
    } else if inheritor {
        format!("vramguard reclaim --gpu {gpu}")
    } else {
        // Always through the planner (a bare `kill` skips its work and pid-reuse checks):
        // a plain label as it is, any other printable one in single quotes (a systemd
        // unit's `\x2d` escapes, a hostile cgroup name), none with control characters.
        let plain = job
            .label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"@._:-/".contains(&b));
        let printable = job.label.bytes().all(|b| (0x20..0x7f).contains(&b));
        if plain {
            format!(
                "vramguard reclaim --gpu {gpu} --job {} --include keepers",
                job.label
            )
        } else if printable {
            format!(
                "vramguard reclaim --gpu {gpu} --job '{}' --include keepers",
                job.label.replace('\'', r"'\''")
            )
        } else {
            return Action {
                summary: format!(
                    "{summary} (its job's label has control characters: run `vramguard reclaim \
                     --gpu {gpu} --job LABEL --include keepers` with the label `status --json` \
                     shows for pid {pid})"
                ),
                command: None,
                reclaimable,
            };
        }
    };
    Action {
        summary,
        command: Some(command),
        reclaimable,
    }
}

/// What a default reclaim gives back on one GPU: its reclaimable holders' listed memory, an
/// exited pid's memory when every keeper of it is reclaimable, and the unaccounted memory
/// when every hidden holder is.
fn reclaimable_bytes(
    holders: &[Holder],
    unaccounted: Option<&Unaccounted>,
    residue: &BTreeSet<u32>,
) -> u64 {
    let goes = |pid: u32| holders.iter().any(|h| h.pid == pid && h.action.reclaimable);
    let mut bytes = holders
        .iter()
        .filter(|h| h.action.reclaimable)
        .filter_map(|h| h.used_bytes)
        .fold(0, u64::saturating_add);
    for h in holders.iter().filter(|h| h.class == Class::Exited) {
        if !h.keepers.is_empty() && !residue.contains(&h.pid) && h.keepers.iter().all(|k| goes(*k))
        {
            bytes = bytes.saturating_add(h.used_bytes.unwrap_or(0));
        }
    }
    let hidden: Vec<&Holder> = holders
        .iter()
        .filter(|h| h.class == Class::Hidden)
        .collect();
    if let Some(u) = unaccounted.filter(|u| u.significant)
        && u.cause == Some(UnaccountedCause::HiddenHolders)
        && !hidden.is_empty()
        && hidden.iter().all(|h| h.action.reclaimable)
    {
        bytes = bytes.saturating_add(u.bytes);
    }
    bytes
}

/// A listed holder whose job is gone: detached while it works (never a target by default),
/// an orphan otherwise, reclaimable only when it was seen doing no work.
fn dead_job_verdict(gpu: u32, p: &ProcessFacts, work: &Work) -> (Class, Action) {
    if work.is_working() {
        return (
            Class::Detached,
            Action {
                summary: format!(
                    "its launcher is gone but it is working: leave it (ask {} before stopping it)",
                    shown(p.user.as_deref().unwrap_or("its owner"))
                ),
                command: Some(format!(
                    "vramguard reclaim --gpu {gpu} --include detached --dry-run"
                )),
                reclaimable: false,
            },
        );
    }
    let reclaimable = work.is_idle();
    (
        Class::Orphan,
        Action {
            summary: if reclaimable {
                "its job is gone and it does no work: terminate it (SIGTERM, then SIGKILL)".into()
            } else {
                "its job is gone; whether it still works is unknown: `vramguard reclaim` \
                 samples it before deciding"
                    .into()
            },
            command: Some(format!("vramguard reclaim --gpu {gpu}")),
            reclaimable,
        },
    )
}

/// What to do about an idle holder of a live job: ask its owner.
/// Why `gpu`'s processes are not all known, if they are not: the GPU failed, its compute list
/// could not be read, or another of its lists (graphics, MPS) failed.
fn unread_process_list(gpu: &GpuSample) -> Option<String> {
    if let Some(f) = &gpu.failure {
        return Some(format!("{} failed", f.call));
    }
    if let ProcessListState::Unavailable { error } = &gpu.process_list {
        return Some(format!("{} failed", error.call));
    }
    // Implausible records were dropped (the 535.43–535.98 record mismatch): a process that
    // computes there may be among them, unlisted, its utilization unseen.
    if let ProcessListState::Unreliable { reason } = &gpu.process_list {
        return Some(format!("its process list is unreliable: {}", shown(reason)));
    }
    gpu.warnings
        .iter()
        .find(|w| w.code.is_some() && w.call.contains("RunningProcesses"))
        .map(|w| format!("{} failed", w.call))
}

fn idle_action(gpu: u32, p: &ProcessFacts, idle_after_secs: u64) -> Action {
    Action {
        summary: format!(
            "ask {} whether it is still needed (an idle kernel keeps its context)",
            shown(p.user.as_deref().unwrap_or("its owner"))
        ),
        command: Some(format!(
            "vramguard reclaim --gpu {gpu} --include idle --idle-for {}",
            format_duration(Duration::from_secs(idle_after_secs))
        )),
        reclaimable: false,
    }
}

/// One line saying what the work verdict rests on.
fn work_evidence(work: &Work) -> String {
    match work {
        Work::Working { evidence } => format!("working: {}", evidence.join("; ")),
        Work::Idle {
            window_ms,
            cpu_millicores,
        } => format!(
            "no sign of work over {}: no recent GPU utilization, {}.{} % of a CPU core",
            format_duration(Duration::from_millis(*window_ms)),
            cpu_millicores / 10,
            cpu_millicores % 10
        ),
        Work::Unknown { why } => format!("work unknown: {why}"),
    }
}
