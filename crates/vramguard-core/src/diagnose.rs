//! `diagnose`: the report turned into a check-list, a verdict and the exact next command.

use crate::health::Severity;
use crate::quirks::known_quirks;
use crate::report::{Class, GpuReport, Holder, Report, UnaccountedCause};
use crate::sanitize::{escape, shown};
use crate::snapshot::{DriverSource, ProcessListState};
use crate::units::format_bytes;
use serde::{Deserialize, Serialize};

/// Outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckStatus {
    /// Nothing wrong.
    Pass,
    /// Worth knowing; does not make the machine unclean.
    Warn,
    /// Ghost memory, a lost GPU, or another problem.
    Fail,
}

/// One line of the check-list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// The GPU it is about, or `None` for machine-wide checks.
    pub gpu: Option<u32>,
    /// Short name (`orphans`, `memory accounted`...).
    pub name: String,
    /// Outcome.
    pub status: CheckStatus,
    /// One line of evidence.
    pub evidence: String,
}

/// A suggested next step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NextStep {
    /// Why.
    pub why: String,
    /// The command to run, when there is one.
    pub command: Option<String>,
}

/// The conclusion.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    /// No check failed.
    pub clean: bool,
    /// One sentence.
    pub summary: String,
    /// Memory held by no live job (orphan and zombie holders plus significant unaccounted).
    pub ghost_bytes: u64,
    /// Ghost memory that `vramguard reclaim` could free (by signals, or by a reset where no
    /// process blocks it).
    pub reclaimable_bytes: u64,
    /// What to do, most useful first.
    pub next_steps: Vec<NextStep>,
}

/// The full diagnosis, as `diagnose --json` prints it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Diagnosis {
    /// [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The check-list, machine-wide checks first.
    pub checks: Vec<Check>,
    /// The verdict.
    pub verdict: Verdict,
    /// The report the checks were derived from.
    pub report: Report,
}

impl Diagnosis {
    /// `diagnose`'s exit code: 0 when clean, 1 when something needs attention.
    pub fn exit_code(&self) -> i32 {
        if self.verdict.clean { 0 } else { 1 }
    }
}

fn check(gpu: Option<u32>, name: &str, status: CheckStatus, evidence: String) -> Check {
    Check {
        gpu,
        name: name.to_string(),
        status,
        evidence,
    }
}

fn list_pids(holders: &[&Holder]) -> String {
    let shown: Vec<String> = holders
        .iter()
        .take(6)
        .map(|h| format!("{} ({})", h.pid, escape(h.comm.as_deref().unwrap_or("?"))))
        .collect();
    let more = holders.len().saturating_sub(shown.len());
    if more > 0 {
        format!("{} and {more} more", shown.join(", "))
    } else {
        shown.join(", ")
    }
}

fn sum_bytes(holders: &[&Holder]) -> u64 {
    holders
        .iter()
        .filter_map(|h| h.used_bytes)
        .fold(0, u64::saturating_add)
}

/// Builds the check-list and verdict.
pub fn diagnose(report: Report) -> Diagnosis {
    let mut checks = node_checks(&report);
    // Machine-wide checks come before the GPUs'.
    if let Some(host) = &report.host {
        checks.extend(host_checks(host));
    }
    let mut steps: Vec<NextStep> = Vec::new();
    let mut reclaim_gpus = Vec::new();
    let mut reclaim_hidden = false;
    let mut reset_gpus = Vec::new();
    let mut reclaimable_bytes = 0u64;
    for gpu in &report.gpus {
        gpu_checks(
            gpu,
            &report.gpus,
            &mut checks,
            &mut steps,
            &mut GpuPlan {
                reclaim_gpus: &mut reclaim_gpus,
                reclaim_hidden: &mut reclaim_hidden,
                reset_gpus: &mut reset_gpus,
                reclaimable_bytes: &mut reclaimable_bytes,
            },
        );
    }
    let mut next_steps = leading_steps(&report, &reclaim_gpus, reclaim_hidden, &reset_gpus);
    // Keepers of an exited pid's context in a live job are reclaimed by the same command; say
    // so, as "whose job is gone" does not describe them.
    let keepers = report
        .holders()
        .any(|(_, h)| h.keeps_alive.is_some() && h.dead_job.is_none() && h.action.reclaimable);
    if keepers && let Some(first) = next_steps.first_mut() {
        first.why = "terminate the holders whose job is gone, and the idle processes that keep an \
                     exited process's context (SIGTERM, grace, SIGKILL; verified by pid and start \
                     time)"
            .into();
    }
    next_steps.append(&mut steps);
    if let Some(host) = &report.host
        && host.orphan_shm_bytes > 0
    {
        next_steps.push(NextStep {
            why: format!(
                "{} of RAM is held by shared-memory segments no process uses (dead jobs' \
                     leftovers); removing them gives it back",
                format_bytes(host.orphan_shm_bytes)
            ),
            command: Some("vramguard reclaim --include shm".into()),
        });
    }
    let clean = checks.iter().all(|c| c.status != CheckStatus::Fail);
    let ghost_bytes = report.ghost_bytes();
    Diagnosis {
        schema_version: crate::SCHEMA_VERSION,
        checks,
        verdict: Verdict {
            clean,
            summary: summary(&report, clean, reclaimable_bytes),
            ghost_bytes,
            reclaimable_bytes: reclaimable_bytes.min(ghost_bytes),
            next_steps,
        },
        report,
    }
}

/// GPU indices as `0,3`.
fn join(v: &[u32]) -> String {
    v.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The checks of the node as a whole: the driver, its version, what vramguard could see.
fn node_checks(report: &Report) -> Vec<Check> {
    let mut checks = Vec::new();
    let version = report.driver.driver_version.as_deref().unwrap_or("unknown");
    let what = match report.driver.source {
        DriverSource::Nvml => "NVIDIA driver",
        DriverSource::Simulated => "simulated NVIDIA driver",
    };
    checks.push(check(
        None,
        "driver",
        CheckStatus::Pass,
        format!(
            "{what} {version} loaded (NVML {}), {} GPU(s)",
            report.driver.nvml_version.as_deref().unwrap_or("unknown"),
            report.gpus.len()
        ),
    ));
    let quirks = known_quirks(version);
    checks.push(match quirks.first() {
        None => check(
            None,
            "driver version",
            CheckStatus::Pass,
            format!("{version} is not on the known-bad list"),
        ),
        Some(q) => check(
            None,
            "driver version",
            CheckStatus::Warn,
            format!("{version}: {} ({}); {}", q.problem, q.reference, q.advice),
        ),
    });
    checks.push(
        if report.privileges().sees_every_process() && report.limitations.is_empty() {
            check(
                None,
                "visibility",
                CheckStatus::Pass,
                if report.euid == 0 {
                    "running as root: every process's open files were readable".into()
                } else {
                    format!(
                        "running as uid {} with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH: every \
                     process's open files were readable",
                        report.euid
                    )
                },
            )
        } else if report.limitations.is_empty() {
            check(
                None,
                "visibility",
                CheckStatus::Warn,
                "not running as root: other users' open files may be unreadable".into(),
            )
        } else {
            check(
                None,
                "visibility",
                CheckStatus::Warn,
                report.limitations.join("; "),
            )
        },
    );
    if report.pid_namespace_is_host == Some(false) {
        checks.push(check(
            None,
            "pid namespace",
            CheckStatus::Warn,
            "vramguard runs in a container: processes of other containers are invisible; run \
             it on the host or with hostPID: true"
                .into(),
        ));
    }

    checks
}

/// The host side: available RAM and pressure, shared memory, and what dead jobs hold.
fn host_checks(host: &crate::host::HostReport) -> Vec<Check> {
    let mut checks = Vec::new();
    if let (Some(avail), Some(total)) = (host.mem_available_bytes, host.mem_total_bytes) {
        let pressure = host.pressure.map(|p| p.some_avg10);
        let low = total > 0 && avail.saturating_mul(10) < total;
        let stalled = pressure.is_some_and(|p| p >= 10.0);
        checks.push(check(
            None,
            "host memory",
            if low || stalled {
                CheckStatus::Warn
            } else {
                CheckStatus::Pass
            },
            format!(
                "{} of {} available{}{}",
                format_bytes(avail),
                format_bytes(total),
                pressure.map_or(String::new(), |p| format!(
                    "; tasks stalled on memory {p:.1}% of the last 10 s"
                )),
                if low {
                    " (under 10%: the next job's DataLoader may die with a bus error or the OOM \
                     killer may pick a live job)"
                } else {
                    ""
                }
            ),
        ));
    }
    for d in &host.shm_dirs {
        let segments = host.segments.iter().filter(|s| s.dir == d.path);
        let orphans = segments
            .clone()
            .filter(|s| s.verdict == crate::host::SegmentVerdict::Reclaimable)
            .count();
        let used = match (d.used_bytes, d.size_bytes) {
            (Some(u), Some(s)) => format!("{} of {} used", format_bytes(u), format_bytes(s)),
            _ => "usage unknown".into(),
        };
        checks.push(match &d.error {
            Some(e) => check(
                None,
                "shared memory",
                CheckStatus::Warn,
                crate::sanitize::shown(e),
            ),
            None if orphans > 0 => check(
                None,
                "shared memory",
                CheckStatus::Fail,
                format!(
                    "{}: {used}; {} in {orphans} orphaned segment(s) (no process maps or holds \
                     them, their owners run no GPU job)",
                    d.path,
                    format_bytes(d.orphan_bytes)
                ),
            ),
            None => check(
                None,
                "shared memory",
                CheckStatus::Pass,
                format!(
                    "{}: {used}; {} segment(s), none orphaned",
                    d.path,
                    segments.count()
                ),
            ),
        });
    }
    for j in host.dead_jobs.iter().filter(|j| j.rss_bytes > 0) {
        checks.push(check(
            None,
            "dead job host RAM",
            CheckStatus::Warn,
            format!(
                "job of leader {} (gone): {} of host RAM in {} process(es){}{}; freed with \
                 its processes",
                j.leader_pid,
                format_bytes(j.rss_bytes),
                j.pids.len(),
                if j.shm_bytes > 0 {
                    format!(", {} of it shared memory", format_bytes(j.shm_bytes))
                } else {
                    String::new()
                },
                if j.pinned_bytes > 0 {
                    format!(", {} pinned", format_bytes(j.pinned_bytes))
                } else {
                    String::new()
                }
            ),
        ));
    }
    checks
}

/// The commands that free the most: reclaim the holders whose job is gone, then reset the
/// GPUs with residue.
fn leading_steps(
    report: &Report,
    reclaim_gpus: &[u32],
    reclaim_hidden: bool,
    reset_gpus: &[u32],
) -> Vec<NextStep> {
    let sudo = if report.privileges().may_signal_every_process() {
        ""
    } else {
        "sudo "
    };
    let mut leading = Vec::new();
    if !reclaim_gpus.is_empty() {
        leading.push(NextStep {
            why: "terminate the holders whose job is gone (SIGTERM, grace, SIGKILL; verified \
                  by pid and start time)"
                .into(),
            command: Some(format!(
                "{sudo}vramguard reclaim --gpu {}{}",
                join(reclaim_gpus),
                if reclaim_hidden {
                    " --include orphan,zombie,hidden"
                } else {
                    ""
                }
            )),
        });
    }
    if !reset_gpus.is_empty() {
        leading.push(NextStep {
            why: "reset the GPUs whose memory no process holds (driver residue)".into(),
            command: Some(format!(
                "{sudo}vramguard reclaim --gpu {} --reset=auto",
                join(reset_gpus)
            )),
        });
    }
    leading
}

/// The verdict in one sentence.
fn summary(report: &Report, clean: bool, reclaimable_bytes: u64) -> String {
    let ghost_bytes = report.ghost_bytes();
    let failed_gpus: Vec<u32> = report
        .gpus
        .iter()
        .filter(|g| g.failure.is_some())
        .map(|g| g.index)
        .collect();
    if clean {
        format!(
            "clean: every byte of {} GPU(s) is accounted for by a live job",
            report.gpus.len()
        )
    } else if ghost_bytes > 0 {
        let ghost_gpus: Vec<u32> = report
            .gpus
            .iter()
            .filter(|g| g.ghost_bytes > 0)
            .map(|g| g.index)
            .collect();
        format!(
            "ghost memory: {} on GPU {} is held by no live job; {} of it can be reclaimed{}",
            format_bytes(ghost_bytes),
            join(&ghost_gpus),
            format_bytes(reclaimable_bytes.min(ghost_bytes)),
            if failed_gpus.is_empty() {
                String::new()
            } else {
                format!("; GPU {} could not be read", join(&failed_gpus))
            }
        )
    } else if !failed_gpus.is_empty() {
        format!("GPU {} could not be read", join(&failed_gpus))
    } else if let Some(unexplained) = report.unexplained_summary() {
        unexplained
    } else if let Some(orphaned) = report
        .host
        .as_ref()
        .map(|h| h.orphan_shm_bytes)
        .filter(|b| *b > 0)
    {
        format!(
            "GPU memory is clean, but {} of host RAM is held by orphaned shared-memory segments",
            format_bytes(orphaned)
        )
    } else {
        "needs attention: see the failed checks".into()
    }
}

struct GpuPlan<'a> {
    reclaim_gpus: &'a mut Vec<u32>,
    reclaim_hidden: &'a mut bool,
    reset_gpus: &'a mut Vec<u32>,
    reclaimable_bytes: &'a mut u64,
}

/// The step that clears one reset blocker, by what it is.
fn blocker_step(gpu: &GpuReport, b: &crate::report::ResetBlocker) -> NextStep {
    let g = gpu.index;
    let who = format!(
        "pid {} ({})",
        b.pid,
        escape(b.comm.as_deref().unwrap_or("?"))
    );
    let Some(h) = gpu.holders.iter().find(|h| h.pid == b.pid) else {
        return NextStep {
            why: format!(
                "GPU {g}: {who} holds the device for its context on another GPU; the reset waits \
                 until it ends"
            ),
            command: None,
        };
    };
    let owner = shown(h.user.as_deref().unwrap_or("its owner"));
    match h.class {
        Class::System
            if h.comm
                .as_deref()
                .is_some_and(|c| c.starts_with("nvidia-persiste")) =>
        {
            NextStep {
                why: format!(
                    "GPU {g}: nvidia-persistenced ({who}) holds the device: stop it for the \
                     reset and start it again after"
                ),
                command: Some(format!(
                    "systemctl stop nvidia-persistenced && vramguard reclaim --gpu {g} \
                     --reset=auto --yes; systemctl start nvidia-persistenced"
                )),
            }
        }
        Class::System => NextStep {
            why: format!(
                "GPU {g}: the system service {who} holds the device: stop it for the reset"
            ),
            command: plain_unit(h).map(|unit| format!("systemctl stop {unit}")),
        },
        // An NVML client (a monitor, an exporter: on driver 580 they hold /dev/nvidia-uvm too)
        // holds no memory, but a reset is refused while it runs. One in a system service that
        // may be stopped is in the combined step (see `stoppable_nvml_service`).
        Class::Hidden if h.may_hold_context() == Some(false) => NextStep {
            why: format!(
                "GPU {g}: the NVML client {who} holds the device (no GPU memory): ask {owner} to \
                 stop it for the reset"
            ),
            command: None,
        },
        Class::Idle => NextStep {
            why: format!("GPU {g}: {who} is idle and holds the device; if {owner} agrees, stop it"),
            command: h.action.command.clone(),
        },
        Class::Active | Class::Detached => NextStep {
            why: format!("GPU {g}: {who} is working and holds the device: ask {owner} to end it"),
            command: None,
        },
        _ => NextStep {
            why: format!(
                "GPU {g}: {who} ({}) holds the device: {}",
                h.class, h.action.summary
            ),
            command: h.action.command.clone(),
        },
    }
}

/// The systemd unit a holder runs in, when its name is one plain word (a command root may
/// paste).
fn plain_unit(h: &Holder) -> Option<&str> {
    h.job
        .as_ref()
        .and_then(|j| j.label.strip_prefix("unit:"))
        .filter(|unit| is_plain_unit_name(unit))
}

/// A unit name made of the characters systemd allows, not starting with `-` (an option).
fn is_plain_unit_name(unit: &str) -> bool {
    !unit.is_empty()
        && !unit.starts_with('-')
        && unit
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"@._:-".contains(&b))
}

/// What stopping the system service of an NVML client that blocks a reset would end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ServiceStop<'a> {
    /// Nothing else on a GPU; `alone`: its cgroup shows that it runs nothing but the GPU
    /// holders seen (else what else it runs is unknown, and the step says to look first).
    Stoppable { unit: &'a str, alone: bool },
    /// `others` processes that hold no GPU: `systemctl stop` would end them too.
    RunsOthers { unit: &'a str, others: u32 },
}

/// The system service to stop for a reset that NVML client `h` blocks, when stopping it ends
/// nothing else on a GPU: `h` is root's, its job is exactly a system service
/// (`/system.slice/NAME.service`: never a user's unit, whose name its user chose), and no
/// other holder of that service on any GPU may hold a context (stopping a unit whose stats
/// sidecar blocks one GPU would end the training it runs on another). Where the service's
/// cgroup was read, whether it runs anything besides its GPU holders.
fn stoppable_nvml_service<'a>(h: &'a Holder, all: &[GpuReport]) -> Option<ServiceStop<'a>> {
    if h.class != Class::Hidden || h.may_hold_context() != Some(false) || h.uid != Some(0) {
        return None;
    }
    let job = h.job.as_ref()?;
    // The client's own job is the service itself (not a sub-unit of it).
    let unit = job
        .system_service
        .as_deref()
        .filter(|u| is_plain_unit_name(u) && job.label.strip_prefix("unit:") == Some(*u))?;
    // Anything of the service's, its sub-units and containers included, that may use a GPU.
    let other_gpu_user = all.iter().flat_map(|g| &g.holders).any(|o| {
        o.pid != h.pid
            && o.job
                .as_ref()
                .is_some_and(|j| j.system_service.as_deref() == Some(unit))
            && (o.listed || o.may_hold_context() != Some(false))
    });
    if other_gpu_user {
        return None;
    }
    let Some(members) = job.service_processes else {
        return Some(ServiceStop::Stoppable { unit, alone: false });
    };
    let holders: std::collections::BTreeSet<u32> = all
        .iter()
        .flat_map(|g| &g.holders)
        .filter(|o| {
            o.job
                .as_ref()
                .is_some_and(|j| j.system_service.as_deref() == Some(unit))
        })
        .map(|o| o.pid)
        .collect();
    let others = members.saturating_sub(holders.len() as u32);
    Some(if others == 0 {
        ServiceStop::Stoppable { unit, alone: true }
    } else {
        ServiceStop::RunsOthers { unit, others }
    })
}

/// What the checks of one GPU read and write.
struct GpuChecks<'a, 'p> {
    gpu: &'a GpuReport,
    /// Every GPU of the report (what else a holder's job holds).
    all: &'a [GpuReport],
    checks: &'a mut Vec<Check>,
    steps: &'a mut Vec<NextStep>,
    plan: &'a mut GpuPlan<'p>,
}

/// The checks of one GPU, in the order they are shown (after `readable`, which ends the list
/// for a GPU whose memory could not be read).
const GPU_CHECKS: &[fn(&mut GpuChecks<'_, '_>)] = &[
    memory_health,
    process_list,
    memory_accounted,
    orphans,
    zombies,
    exited_pids,
    foreign_pids,
    hidden_holders,
    idle_holders,
    detached_holders,
    reclaimable,
    reset_blockers,
];

fn gpu_checks(
    gpu: &GpuReport,
    all: &[GpuReport],
    checks: &mut Vec<Check>,
    steps: &mut Vec<NextStep>,
    plan: &mut GpuPlan<'_>,
) {
    let mut d = GpuChecks {
        gpu,
        all,
        checks,
        steps,
        plan,
    };
    if !readable(&mut d) {
        return;
    }
    for check in GPU_CHECKS {
        check(&mut d);
    }
}

/// Whether the driver answered for this GPU; false when its memory is unknown (no other
/// check can say anything then).
fn readable(d: &mut GpuChecks<'_, '_>) -> bool {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let (checks, steps) = (&mut *d.checks, &mut *d.steps);
    if let Some(failure) = &gpu.failure {
        checks.push(check(
            g,
            "readable",
            CheckStatus::Fail,
            format!("the driver failed on this GPU: {failure}"),
        ));
        steps.push(NextStep {
            why: format!(
                "GPU {} did not answer; look for Xid errors (Xid 79: fallen off the bus, needs a \
                 reboot)",
                gpu.index
            ),
            command: Some("dmesg | grep -i xid".into()),
        });
        if gpu.memory.is_none() {
            return false;
        }
    }
    true
}

/// Row remaps, retired pages and Xids, each with the command that checks or fixes it.
fn memory_health(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let (checks, steps) = (&mut *d.checks, &mut *d.steps);
    for finding in crate::health::findings(gpu.index, &gpu.health) {
        checks.push(check(
            g,
            "memory health",
            match finding.severity {
                Severity::Warn => CheckStatus::Warn,
                Severity::Fail => CheckStatus::Fail,
            },
            finding.message.clone(),
        ));
        if !steps
            .iter()
            .any(|s| s.command.as_deref() == Some(finding.command.as_str()))
        {
            steps.push(NextStep {
                why: format!("GPU {}: {}", gpu.index, finding.message),
                command: Some(finding.command),
            });
        }
    }
}

/// Whether the driver's process list could be read and trusted.
fn process_list(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let checks = &mut *d.checks;
    match &gpu.process_list {
        ProcessListState::Complete => checks.push(check(
            g,
            "process list",
            CheckStatus::Pass,
            format!(
                "{} process(es) listed by the driver",
                gpu.holders.iter().filter(|h| h.listed).count()
            ),
        )),
        ProcessListState::Unreliable { reason } => checks.push(check(
            g,
            "process list",
            CheckStatus::Warn,
            format!("unreliable: {reason}"),
        )),
        ProcessListState::Unavailable { error } => checks.push(check(
            g,
            "process list",
            CheckStatus::Fail,
            format!("could not be read: {error}"),
        )),
    }
}

/// Whether the listed processes account for the used memory.
fn memory_accounted(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let checks = &mut *d.checks;
    if let (Some(mem), Some(un)) = (gpu.memory, &gpu.unaccounted) {
        let listed = gpu.holders.iter().filter(|h| h.listed).count();
        if !un.significant {
            checks.push(check(
                g,
                "memory accounted",
                CheckStatus::Pass,
                format!(
                    "{} used, {} by {listed} listed process(es)",
                    format_bytes(mem.used),
                    format_bytes(gpu.accounted_bytes)
                ),
            ));
        } else {
            let cause_text = un.explanation.get(1).cloned().unwrap_or_default();
            let status = if un.cause == Some(UnaccountedCause::PerProcessMemoryUnavailable) {
                CheckStatus::Warn
            } else {
                CheckStatus::Fail
            };
            checks.push(check(
                g,
                "memory accounted",
                status,
                format!(
                    "{} unaccounted ({} used, {} by {listed} listed process(es)): {cause_text}",
                    format_bytes(un.bytes),
                    format_bytes(mem.used),
                    format_bytes(gpu.accounted_bytes)
                ),
            ));
        }
    }
}

/// Holders whose job is gone and that do no work.
fn orphans(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let checks = &mut *d.checks;
    let of = |class: Class| -> Vec<&Holder> {
        gpu.holders.iter().filter(|h| h.class == class).collect()
    };
    let orphans = of(Class::Orphan);
    if orphans.is_empty() {
        checks.push(check(g, "orphans", CheckStatus::Pass, "none".into()));
    } else {
        let leaders: std::collections::BTreeSet<String> = orphans
            .iter()
            .filter_map(|h| h.dead_job.as_ref())
            .map(|j| match &j.leader_command {
                Some(c) => format!("{} ({})", j.leader_pid, shown(c)),
                None => j.leader_pid.to_string(),
            })
            .collect();
        checks.push(check(
            g,
            "orphans",
            CheckStatus::Fail,
            format!(
                "{} process(es) hold {}: {}; their job leader {} is gone",
                orphans.len(),
                format_bytes(sum_bytes(&orphans)),
                list_pids(&orphans),
                leaders.into_iter().collect::<Vec<_>>().join(", ")
            ),
        ));
    }
}

/// Zombies and processes stuck in D state.
fn zombies(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let (checks, steps) = (&mut *d.checks, &mut *d.steps);
    let of = |class: Class| -> Vec<&Holder> {
        gpu.holders.iter().filter(|h| h.class == class).collect()
    };
    let zombies = of(Class::Zombie);
    if zombies.is_empty() {
        checks.push(check(
            g,
            "zombies / D state",
            CheckStatus::Pass,
            "none".into(),
        ));
    } else {
        checks.push(check(
            g,
            "zombies / D state",
            CheckStatus::Fail,
            format!(
                "{}: {}",
                list_pids(&zombies),
                zombies
                    .iter()
                    .flat_map(|h| h.evidence.iter().cloned())
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        ));
        for z in zombies.iter().filter(|z| !z.action.reclaimable) {
            steps.push(NextStep {
                why: format!("pid {}: {}", z.pid, z.action.summary),
                command: z.action.command.clone(),
            });
        }
    }
}

/// Listed pids that have exited while processes they forked keep their context.
fn exited_pids(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let (checks, steps) = (&mut *d.checks, &mut *d.steps);
    let exited: Vec<&Holder> = gpu
        .holders
        .iter()
        .filter(|h| h.class == Class::Exited)
        .collect();
    if exited.is_empty() {
        checks.push(check(g, "exited pids", CheckStatus::Pass, "none".into()));
        return;
    }
    checks.push(check(
        g,
        "exited pids",
        CheckStatus::Fail,
        format!(
            "{} listed pid(s) have exited and still hold {}: {}",
            exited.len(),
            format_bytes(sum_bytes(&exited)),
            exited
                .iter()
                .map(|h| h.evidence.join("; "))
                .collect::<Vec<_>>()
                .join(" | ")
        ),
    ));
    // Keepers a default reclaim takes are covered by its leading step.
    for h in exited {
        let all_go = !h.keepers.is_empty()
            && h.keepers.iter().all(|k| {
                gpu.holders
                    .iter()
                    .any(|x| x.pid == *k && x.action.reclaimable)
            });
        if !all_go {
            steps.push(NextStep {
                why: format!("GPU {}: pid {}: {}", gpu.index, h.pid, h.action.summary),
                command: h.action.command.clone(),
            });
        }
    }
}

/// Listed pids that are not processes of this namespace.
fn foreign_pids(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let (checks, steps) = (&mut *d.checks, &mut *d.steps);
    let of = |class: Class| -> Vec<&Holder> {
        gpu.holders.iter().filter(|h| h.class == class).collect()
    };
    let foreign = of(Class::Foreign);
    if foreign.is_empty() {
        checks.push(check(g, "foreign pids", CheckStatus::Pass, "none".into()));
    } else {
        checks.push(check(
            g,
            "foreign pids",
            CheckStatus::Fail,
            format!(
                "{} listed pid(s) hold {} but are not processes here: {}",
                foreign.len(),
                format_bytes(sum_bytes(&foreign)),
                foreign[0].evidence.join("; ")
            ),
        ));
        steps.push(NextStep {
            why: format!("GPU {}: {}", gpu.index, foreign[0].action.summary),
            command: None,
        });
    }
}

/// Holders of the device file the driver does not list. NVML clients (no CUDA context: a
/// monitor, an exporter; on driver 580 they hold `/dev/nvidia-uvm` too) are named apart:
/// they hold no memory, and only block a reset.
fn hidden_holders(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let checks = &mut *d.checks;
    let (clients, hidden): (Vec<&Holder>, Vec<&Holder>) = gpu
        .holders
        .iter()
        .filter(|h| h.class == Class::Hidden)
        .partition(|h| h.may_hold_context() == Some(false));
    let minor = gpu.minor_number.unwrap_or(gpu.index);
    let nvml_clients = (!clients.is_empty()).then(|| {
        format!(
            "{} NVML client(s) hold /dev/nvidia{minor} too: {} (no CUDA context, no GPU memory; \
             they block a reset while they run)",
            clients.len(),
            list_pids(&clients),
        )
    });
    if hidden.is_empty() {
        let (status, text) = match nvml_clients {
            None => (CheckStatus::Pass, "none".to_string()),
            Some(c) => (CheckStatus::Warn, format!("none with a CUDA context; {c}")),
        };
        checks.push(check(g, "hidden holders", status, text));
    } else {
        let gone = hidden.iter().filter(|h| h.dead_job.is_some()).count();
        checks.push(check(
            g,
            "hidden holders",
            CheckStatus::Fail,
            format!(
                "{} process(es) hold /dev/nvidia{minor} unlisted by the driver: {}{}{}",
                hidden.len(),
                list_pids(&hidden),
                if gone > 0 {
                    format!("; {gone} of them belong to a job that is gone")
                } else {
                    String::new()
                },
                nvml_clients.map(|c| format!("; {c}")).unwrap_or_default(),
            ),
        ));
    }
}

/// Holders without GPU utilization.
fn idle_holders(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let checks = &mut *d.checks;
    let of = |class: Class| -> Vec<&Holder> {
        gpu.holders.iter().filter(|h| h.class == class).collect()
    };
    let idle = of(Class::Idle);
    if !idle.is_empty() {
        checks.push(check(
            g,
            "idle holders",
            CheckStatus::Warn,
            format!(
                "{} process(es) hold {} without GPU utilization: {}",
                idle.len(),
                format_bytes(sum_bytes(&idle)),
                list_pids(&idle)
            ),
        ));
    }
}

/// Working holders whose launcher is gone.
fn detached_holders(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let checks = &mut *d.checks;
    let of = |class: Class| -> Vec<&Holder> {
        gpu.holders.iter().filter(|h| h.class == class).collect()
    };
    let detached = of(Class::Detached);
    if !detached.is_empty() {
        checks.push(check(
            g,
            "detached holders",
            CheckStatus::Warn,
            format!(
                "{} process(es) hold {} and keep working although their launcher is gone \
                 (not ghost memory, never reclaimed by default): {}",
                detached.len(),
                format_bytes(sum_bytes(&detached)),
                list_pids(&detached)
            ),
        ));
    }
}

/// What a reclaim would free here.
fn reclaimable(d: &mut GpuChecks<'_, '_>) {
    let gpu = d.gpu;
    let reclaimable: Vec<&Holder> = gpu
        .holders
        .iter()
        .filter(|h| h.action.reclaimable)
        .collect();
    if !reclaimable.is_empty() {
        d.plan.reclaim_gpus.push(gpu.index);
        *d.plan.reclaim_hidden |= reclaimable.iter().any(|h| h.class == Class::Hidden);
        *d.plan.reclaimable_bytes = d
            .plan
            .reclaimable_bytes
            .saturating_add(gpu.reclaimable_bytes);
    }
}

/// Driver residue: whether a reset could clear it, and what blocks it.
fn reset_blockers(d: &mut GpuChecks<'_, '_>) {
    let (gpu, g) = (d.gpu, Some(d.gpu.index));
    let (checks, steps) = (&mut *d.checks, &mut *d.steps);
    if let Some(un) = gpu.unaccounted.as_ref().filter(|u| u.significant)
        && un.cause == Some(UnaccountedCause::DriverResidue)
    {
        let blockers: Vec<String> = gpu.reset_blockers.iter().map(|b| b.to_string()).collect();
        if blockers.is_empty() {
            checks.push(check(
                g,
                "reset blockers",
                CheckStatus::Pass,
                "none: a reset can clear the residue".into(),
            ));
            d.plan.reset_gpus.push(gpu.index);
            *d.plan.reclaimable_bytes = d.plan.reclaimable_bytes.saturating_add(un.bytes);
        } else {
            checks.push(check(
                g,
                "reset blockers",
                CheckStatus::Warn,
                format!("a reset would be refused: {}", blockers.join("; ")),
            ));
            // NVML clients in system services that may be stopped: one step that stops them
            // all for the reset (one step each would start one before the next is stopped).
            let mut services: Vec<&str> = Vec::new();
            // Services whose cgroup was not read whole: what else they run is unknown.
            let mut unread: Vec<&str> = Vec::new();
            for b in &gpu.reset_blockers {
                let service = gpu
                    .holders
                    .iter()
                    .find(|h| h.pid == b.pid)
                    .and_then(|h| stoppable_nvml_service(h, d.all));
                match service {
                    Some(ServiceStop::Stoppable { unit, alone }) => {
                        if !services.contains(&unit) {
                            services.push(unit);
                            if !alone {
                                unread.push(unit);
                            }
                        }
                    }
                    Some(ServiceStop::RunsOthers { unit, others }) => steps.push(NextStep {
                        why: format!(
                            "GPU {}: the NVML client pid {} ({}) holds the device (no GPU \
                             memory); its service {unit} also runs {others} other \
                             process(es), which `systemctl stop` would end too: stop the client \
                             alone for the reset, or the service once those may end",
                            gpu.index,
                            b.pid,
                            escape(b.comm.as_deref().unwrap_or("?"))
                        ),
                        command: None,
                    }),
                    None => steps.push(blocker_step(gpu, b)),
                }
            }
            if !services.is_empty() {
                let units = services.join(" ");
                // vramguard sees the services' GPU holders; where a service's cgroup was not
                // read whole, not every process it runs: `systemctl stop` ends them all, so
                // the step then says to look first.
                let look_first = if unread.is_empty() {
                    " (they run nothing else)".to_string()
                } else {
                    format!(
                        ". `systemctl stop` ends everything a unit runs: if `systemctl status -- \
                         {}` shows more than the monitor, stop the monitor instead",
                        unread.join(" ")
                    )
                };
                steps.push(NextStep {
                    why: format!(
                        "GPU {}: NVML clients in {} hold the device (no GPU memory): stop them \
                         for the reset and start them again after{look_first}",
                        gpu.index,
                        services.join(", ")
                    ),
                    command: Some(format!(
                        "systemctl stop -- {units} && vramguard reclaim --gpu {} --reset=auto \
                         --yes; systemctl start -- {units}",
                        gpu.index
                    )),
                });
            }
            steps.push(NextStep {
                why: format!(
                    "GPU {} holds driver residue: once nothing holds the device, reset it",
                    gpu.index
                ),
                command: Some(format!(
                    "vramguard reclaim --gpu {} --reset=auto",
                    gpu.index
                )),
            });
        }
    }
}
