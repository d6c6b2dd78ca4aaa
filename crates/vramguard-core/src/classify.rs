//! `classify(&Snapshot, &Policy) -> Report`: attribute every byte of every GPU.
//!
//! The rules, in order of precedence for one process on one GPU:
//! 1. `system`  — its `comm` is a known system service (never killed; a reset blocker).
//! 2. `zombie`  — its main thread is a zombie while other threads live, or it is exiting
//!    (`PF_EXITING`). Memory is freed in `do_exit` when the last thread closes the device.
//! 3. `foreign` — the driver lists a pid that does not exist here (or exists but is plainly a
//!    different process, such as a kernel thread) and no process maps to it through `NSpid`.
//! 4. `hidden`  — it holds `/dev/nvidiaN` but the driver lists it on no GPU.
//! 5. `orphan`  — its process-group leader is gone (the DataLoader-worker case).
//! 6. `idle`    — no utilization sample for at least the policy's idle time.
//! 7. `active`  — everything else.
//!
//! Hidden holders also carry their job state, so that reclaim can pick the ones whose job is
//! gone. vramguard's own pid is never a holder: loading NVML opens the device files.

use crate::policy::Policy;
use crate::report::{
    Action, Class, DeadJob, GpuReport, Holder, Report, ResetBlocker, Unaccounted, UnaccountedCause,
};
use crate::snapshot::{
    FdScan, GpuProcess, GpuSample, PF_EXITING, ProcessFacts, ProcessListState, Snapshot,
};
use crate::units::{format_bytes, format_duration};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// Classifies every holder of every GPU in `snapshot`.
pub fn classify(snapshot: &Snapshot, policy: &Policy) -> Report {
    let mut sorted;
    let snapshot = if snapshot.processes.is_sorted_by_key(|p| p.pid) {
        snapshot
    } else {
        sorted = snapshot.clone();
        sorted.normalize();
        &sorted
    };
    let ctx = Context::new(snapshot, policy);
    let gpus = snapshot.gpus.iter().map(|g| ctx.gpu_report(g)).collect();
    Report {
        schema_version: crate::SCHEMA_VERSION,
        taken_at_ms: snapshot.taken_at_ms,
        hostname: snapshot.host.hostname.clone(),
        pid_namespace_is_host: snapshot.host.pid_namespace_is_host,
        euid: snapshot.host.euid,
        driver: snapshot.driver.clone(),
        gpus,
        limitations: snapshot.scan.limitations.clone(),
        full_fd_scan: snapshot.scan.full_fd_scan,
    }
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
}

struct Context<'a> {
    snap: &'a Snapshot,
    policy: &'a Policy,
    /// Resolved local pids the driver lists on at least one GPU.
    listed_anywhere: BTreeSet<u32>,
}

impl<'a> Context<'a> {
    fn new(snap: &'a Snapshot, policy: &'a Policy) -> Self {
        let mut ctx = Context {
            snap,
            policy,
            listed_anywhere: BTreeSet::new(),
        };
        let mut listed = BTreeSet::new();
        for gpu in &snap.gpus {
            for p in &gpu.processes {
                if let Resolution::Local { proc_, .. } = ctx.resolve(gpu, p.pid) {
                    listed.insert(proc_.pid);
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
        if let Some(p) = here
            && !p.is_kernel_thread()
            && p.device_files.holds_any() == Some(true)
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
        let why = match here {
            Some(p) => format!(
                "pid {reported} here is {} ({}), which holds no NVIDIA device file: the driver \
                 reports a pid from another PID namespace",
                p.comm.as_deref().unwrap_or("?"),
                if p.is_kernel_thread() {
                    "a kernel thread"
                } else {
                    "another process"
                }
            ),
            None if self.snap.host.pid_namespace_is_host == Some(false) => format!(
                "pid {reported} does not exist in this PID namespace: vramguard runs in a \
                 container and the driver reports host pids"
            ),
            None => format!(
                "pid {reported} does not exist: the process has exited while the driver still \
                 tears its context down, or the driver reports a pid from another namespace"
            ),
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
        for listed in &gpu.processes {
            match self.resolve(gpu, listed.pid) {
                Resolution::Local { proc_, reported } => {
                    if proc_.pid == self.snap.host.self_pid || !seen.insert(proc_.pid) {
                        continue;
                    }
                    holders.push(self.local_holder(gpu, proc_, Some(listed), reported));
                }
                Resolution::Foreign { why } => {
                    if seen.insert(listed.pid) {
                        holders.push(self.foreign_holder(listed, why));
                    }
                }
            }
        }
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
            holders.push(self.local_holder(gpu, p, None, None));
        }
        holders.sort_by(|a, b| {
            b.used_bytes
                .unwrap_or(0)
                .cmp(&a.used_bytes.unwrap_or(0))
                .then(a.pid.cmp(&b.pid))
        });

        let accounted_bytes: u64 = gpu.processes.iter().filter_map(|p| p.used_bytes).sum();
        let mut bytes_by_class: BTreeMap<Class, u64> = BTreeMap::new();
        for h in &holders {
            *bytes_by_class.entry(h.class).or_default() += h.used_bytes.unwrap_or(0);
        }
        let reset_blockers = self.reset_blockers(gpu, &holders);
        let unaccounted = gpu.memory.map(|m| {
            self.unaccounted(
                gpu,
                m.used,
                m.total,
                accounted_bytes,
                &holders,
                &reset_blockers,
            )
        });
        let ghost_bytes = holders
            .iter()
            .filter(|h| h.class.is_ghost())
            .filter_map(|h| h.used_bytes)
            .sum::<u64>()
            + unaccounted
                .as_ref()
                .filter(|u| u.significant)
                .map_or(0, |u| u.bytes);

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
        }
    }

    fn is_system(&self, p: &ProcessFacts) -> bool {
        p.comm
            .as_deref()
            .is_some_and(|c| self.policy.is_system_comm(c))
    }

    fn describe(&self, pid: u32) -> String {
        match self.snap.process(pid) {
            Some(p) => format!("{pid} ({})", p.comm.as_deref().unwrap_or("?")),
            None => pid.to_string(),
        }
    }

    fn foreign_holder(&self, listed: &GpuProcess, why: String) -> Holder {
        let in_container = self.snap.host.pid_namespace_is_host == Some(false);
        Holder {
            pid: listed.pid,
            reported_pid: None,
            class: Class::Foreign,
            listed: true,
            kinds: listed.kinds.clone(),
            used_bytes: listed.used_bytes,
            comm: None,
            command: None,
            uid: None,
            user: None,
            state: None,
            start_ticks: None,
            ppid: None,
            pgid: None,
            nspid: Vec::new(),
            container: None,
            pod_uid: None,
            device_files: None,
            dead_job: None,
            idle_secs: None,
            evidence: vec![why],
            action: Action {
                summary: if in_container {
                    "inspect it from the host: run vramguard on the host, or in a pod with \
                     hostPID: true"
                        .into()
                } else {
                    "re-run in a few seconds; if it persists, find the holder from the host's \
                     PID namespace"
                        .into()
                },
                command: Some("vramguard diagnose".into()),
                reclaimable: false,
            },
        }
    }

    fn local_holder(
        &self,
        gpu: &GpuSample,
        p: &'a ProcessFacts,
        listed: Option<&GpuProcess>,
        reported_pid: Option<u32>,
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
        let dead_job = self.dead_job(p);
        let idle_secs = self.idle_secs(gpu, p, reported_pid.unwrap_or(p.pid));
        let (class, action) = if self.is_system(p) {
            evidence.push(format!(
                "{} is a system service; it is never signalled, but blocks a GPU reset",
                p.comm.as_deref().unwrap_or("?")
            ));
            (
                Class::System,
                Action {
                    summary: "leave it running; stop the service only to reset the GPU".into(),
                    command: None,
                    reclaimable: false,
                },
            )
        } else if let Some(action) = self.zombie(p, &mut evidence) {
            (Class::Zombie, action)
        } else if listed.is_none() {
            let job_gone = dead_job.is_some();
            if let Some(job) = &dead_job {
                evidence.push(self.dead_job_evidence(p, job));
            }
            evidence.push(format!(
                "holds /dev/nvidia{} but the driver lists it on no GPU (a context it inherited, \
                 or a container the driver hides)",
                self.minor_of(gpu)
            ));
            (
                Class::Hidden,
                Action {
                    summary: if job_gone {
                        "its job is gone: terminate it (SIGTERM, then SIGKILL)".into()
                    } else {
                        "its job is alive: ask its owner before stopping it".into()
                    },
                    command: Some(format!(
                        "vramguard reclaim --gpu {} --include hidden",
                        gpu.index
                    )),
                    reclaimable: job_gone,
                },
            )
        } else if let Some(job) = &dead_job {
            evidence.push(self.dead_job_evidence(p, job));
            (
                Class::Orphan,
                Action {
                    summary: "its job is gone: terminate it (SIGTERM, then SIGKILL)".into(),
                    command: Some(format!("vramguard reclaim --gpu {}", gpu.index)),
                    reclaimable: true,
                },
            )
        } else if let Some(idle) = idle_secs.filter(|s| *s >= self.policy.idle_after_secs) {
            evidence.push(format!(
                "no GPU utilization for {} (idle threshold {})",
                format_duration(Duration::from_secs(idle)),
                format_duration(Duration::from_secs(self.policy.idle_after_secs))
            ));
            (
                Class::Idle,
                Action {
                    summary: format!(
                        "ask {} whether it is still needed (an idle kernel keeps its context)",
                        p.user.clone().unwrap_or_else(|| "its owner".into())
                    ),
                    command: Some(format!(
                        "vramguard reclaim --gpu {} --include idle --idle-for {}",
                        gpu.index,
                        format_duration(Duration::from_secs(self.policy.idle_after_secs))
                    )),
                    reclaimable: false,
                },
            )
        } else {
            if let Some(pgid) = p.pgid.filter(|g| *g != 0) {
                evidence.push(if pgid == p.pid {
                    "leads its own process group".to_string()
                } else {
                    format!("its job leader {} is alive", self.describe(pgid))
                });
            }
            (
                Class::Active,
                Action {
                    summary: "none: its job is running".into(),
                    command: None,
                    reclaimable: false,
                },
            )
        };
        if class != Class::System && p.ppid == Some(1) && dead_job.is_none() {
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
            ppid: p.ppid,
            pgid: p.pgid,
            nspid: p.nspid.clone(),
            container: p.container.clone(),
            pod_uid: p.pod_uid.clone(),
            device_files: match &p.device_files {
                FdScan::Scanned(files) => Some(files.clone()),
                _ => None,
            },
            dead_job,
            idle_secs,
            evidence,
            action,
        }
    }

    /// The zombie/exiting rule. Returns the action when it applies, pushing the evidence.
    fn zombie(&self, p: &ProcessFacts, evidence: &mut Vec<String>) -> Option<Action> {
        let leader_zombie = p.state == Some('Z');
        let exiting = p.flags.is_some_and(|f| f & PF_EXITING != 0);
        if !leader_zombie && !exiting {
            return None;
        }
        let threads = p.threads.as_deref().unwrap_or(&[]);
        let live: Vec<_> = threads
            .iter()
            .filter(|t| t.tid != p.pid && !matches!(t.state, 'Z' | 'X'))
            .collect();
        let stuck: Vec<_> = threads.iter().filter(|t| t.state == 'D').collect();
        let parent = p
            .ppid
            .map(|pp| self.describe(pp))
            .unwrap_or_else(|| "?".into());
        if leader_zombie {
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
            Action {
                summary: "SIGKILL finishes the exit of the threads still running".into(),
                command: Some(format!("kill -KILL {}", p.pid)),
                reclaimable: true,
            }
        };
        Some(action)
    }

    /// The job's leader, when it is gone (the orphan rule).
    fn dead_job(&self, p: &ProcessFacts) -> Option<DeadJob> {
        let pgid = p.pgid?;
        // pgid 0: the leader is in an ancestor namespace; pgid == pid: it leads its own job.
        if pgid == 0 || pgid == p.pid {
            return None;
        }
        let leader = self.snap.process(pgid);
        let leader_is_zombie = match leader {
            // A process with that pid that is not in the group is a reused pid: the leader
            // is gone just the same.
            Some(l) if l.pgid == Some(pgid) && l.state != Some('Z') => return None,
            Some(l) => l.pgid == Some(pgid) && l.state == Some('Z'),
            None => false,
        };
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
        Some(DeadJob {
            leader_pid: pgid,
            leader_command,
            leader_is_zombie,
        })
    }

    fn dead_job_evidence(&self, p: &ProcessFacts, job: &DeadJob) -> String {
        let leader = match &job.leader_command {
            Some(cmd) => format!("{} ({cmd})", job.leader_pid),
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
                let adopted = self
                    .snap
                    .process(pp)
                    .and_then(|pp| pp.comm.as_deref())
                    .is_some_and(|c| self.policy.is_subreaper_comm(c));
                if adopted {
                    format!("it was re-parented to the subreaper {}", self.describe(pp))
                } else {
                    format!("its parent is now {}", self.describe(pp))
                }
            }
            None => "its parent is unknown".to_string(),
        };
        format!("its job leader {leader} {state}; {parent}")
    }

    fn idle_secs(&self, gpu: &GpuSample, p: &ProcessFacts, reported: u32) -> Option<u64> {
        let window = gpu.utilization.as_ref()?;
        let now = self.snap.taken_at_ms;
        let last_active = window
            .samples
            .iter()
            .filter(|s| s.pid == reported && (s.sm_percent > 0 || s.mem_percent > 0))
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
        Some(boot + p.start_ticks? * 1000 / hz)
    }

    fn reset_blockers(&self, gpu: &GpuSample, holders: &[Holder]) -> Vec<ResetBlocker> {
        let mut blockers = Vec::new();
        let mut seen = BTreeSet::new();
        for h in holders {
            if h.class == Class::Foreign {
                continue;
            }
            let reason = if h.listed {
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

    fn unaccounted(
        &self,
        gpu: &GpuSample,
        used: u64,
        total: u64,
        accounted: u64,
        holders: &[Holder],
        blockers: &[ResetBlocker],
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
            let hidden: Vec<&Holder> = holders
                .iter()
                .filter(|h| h.class == Class::Hidden || (!h.listed && h.class == Class::Zombie))
                .collect();
            let unavailable = gpu.processes.iter().any(|p| p.used_bytes.is_none());
            if unavailable {
                cause = Some(UnaccountedCause::PerProcessMemoryUnavailable);
                explanation.push(
                    "the driver does not report per-process memory here (MIG or vGPU), so the \
                     listed processes may account for it"
                        .into(),
                );
            } else if !hidden.is_empty() {
                cause = Some(UnaccountedCause::HiddenHolders);
                explanation.push(format!(
                    "held by processes the driver does not list: {}",
                    hidden
                        .iter()
                        .map(|h| self.describe(h.pid))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            } else if self.snap.host.pid_namespace_is_host == Some(false) {
                cause = Some(UnaccountedCause::OtherNamespace);
                explanation.push(
                    "vramguard runs in a container: holders in other PID namespaces are \
                     invisible here; run it on the host or with hostPID: true"
                        .into(),
                );
            } else if self.snap.scan.full_fd_scan && self.snap.host.euid == 0 {
                cause = Some(UnaccountedCause::DriverResidue);
                let live: Vec<&ResetBlocker> = blockers.iter().collect();
                explanation.push(format!(
                    "no process has a context on it or holds /dev/nvidia{}: memory the driver \
                     did not free (residue); only a GPU reset (or reboot) clears it",
                    self.minor_of(gpu)
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
            } else {
                cause = Some(UnaccountedCause::Unknown);
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
}
