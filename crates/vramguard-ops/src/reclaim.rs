//! Executing a reclaim plan: the safe version of the admin's escalation ladder.
//!
//! 1. verify each target (pidfd, then start time) and send SIGTERM through the pidfd;
//! 2. wait `grace` for them to exit, then SIGKILL the survivors; a process that survives
//!    SIGKILL has threads in D state: its wait channels are reported, and nothing loops;
//! 3. poll the driver until the memory the plan expected back is free, and measure how long
//!    the driver took after the last target exited (its teardown lag);
//! 4. only when asked (`--reset=auto|force`): reset GPUs where memory remains and nothing
//!    holds the device, then check the memory came back;
//! 5. take a fresh snapshot and say what, if anything, remains and why.
//!
//! Every decision and action is appended to the audit log before the next one.

use crate::audit::{AuditError, AuditLog};
use crate::identity::{Identity, Pinned, Refusal, Verified, wait_all};
use crate::snapshot::{take_sampled_snapshot, take_snapshot};
use rustix::process::Signal;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vramguard_core::plan::{Plan, Target};
use vramguard_core::release::ReleaseWatch;
use vramguard_core::report::{Report, UnaccountedCause};
use vramguard_core::snapshot::Snapshot;
use vramguard_core::{Policy, classify};
use vramguard_gpu::GpuSource;
use vramguard_proc::{ProcCollector, ScanDepth};

/// When to reset a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResetMode {
    /// Never (the default).
    Never,
    /// When memory no process holds remains (driver residue) and nothing blocks the reset.
    Auto,
    /// When any unaccounted memory remains on a selected GPU, even if vramguard cannot prove
    /// it is residue; still never while a process holds the device.
    Force,
}

/// A reset mode that is not `never`, `auto` or `force`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected never, auto or force")]
pub struct UnknownResetMode(pub String);

impl std::str::FromStr for ResetMode {
    type Err = UnknownResetMode;

    fn from_str(s: &str) -> Result<ResetMode, UnknownResetMode> {
        match s {
            "never" | "no" => Ok(ResetMode::Never),
            "auto" => Ok(ResetMode::Auto),
            "force" => Ok(ResetMode::Force),
            other => Err(UnknownResetMode(other.to_string())),
        }
    }
}

/// How the executor behaves.
#[derive(Debug, Clone)]
pub struct ExecuteOptions {
    /// Time between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Time to wait for SIGKILLed processes to exit.
    pub kill_wait: Duration,
    /// Time to wait for the driver to release memory (after the exits, and after a reset).
    pub release_timeout: Duration,
    /// How often to poll the driver while waiting for memory.
    pub poll: Duration,
    /// Resets.
    pub reset: ResetMode,
    /// The `/proc` of vramguard's own PID namespace (identities are checked there).
    pub proc_root: PathBuf,
}

impl ExecuteOptions {
    /// The usual options: 5 s for SIGKILLed processes to exit, the driver polled every 20 ms.
    pub fn new(
        grace: Duration,
        release_timeout: Duration,
        reset: ResetMode,
        proc_root: PathBuf,
    ) -> ExecuteOptions {
        ExecuteOptions {
            grace,
            kill_wait: Duration::from_secs(5),
            release_timeout,
            poll: Duration::from_millis(20),
            reset,
            proc_root,
        }
    }
}

/// What the executor needs from the machine.
pub trait ReclaimEnv {
    /// A fresh snapshot with a full scan, and its report.
    fn snapshot(&mut self) -> Result<(Snapshot, Report), EnvError>;
    /// Used memory per GPU index, straight from the driver (polled often).
    fn used_memory(&mut self) -> Result<BTreeMap<u32, u64>, EnvError>;
    /// Resets one GPU; `Ok` with what the reset said, `Err` with why it failed.
    fn reset(&mut self, gpu: u32) -> Result<String, String>;
    /// The classification policy (tolerances).
    fn policy(&self) -> &Policy;
}

/// What happened to one target.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetOutcome {
    /// Pid.
    pub pid: u32,
    /// Command name.
    pub comm: Option<String>,
    /// Signals sent, in order.
    pub signals: Vec<String>,
    /// Milliseconds from SIGTERM to exit, when it exited.
    pub exited_after_ms: Option<u64>,
    /// What became of it.
    pub result: TargetResult,
    /// Why it was not signalled, or what keeps it alive.
    pub detail: Option<String>,
}

/// What became of one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetResult {
    /// SIGTERM sent; the run stopped before its end was known.
    Signalled,
    /// It exited after SIGTERM.
    Exited,
    /// It ignored SIGTERM and exited after SIGKILL.
    ExitedAfterKill,
    /// It was gone before the first signal.
    GoneBefore,
    /// It was not signalled (its identity no longer matched, or the pidfd failed).
    NotSignalled,
    /// It survived SIGKILL (stuck in the kernel, D state).
    SurvivedKill,
}

impl std::fmt::Display for TargetResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TargetResult::Signalled => "signalled",
            TargetResult::Exited => "exited",
            TargetResult::ExitedAfterKill => "exited_after_kill",
            TargetResult::GoneBefore => "gone_before",
            TargetResult::NotSignalled => "not_signalled",
            TargetResult::SurvivedKill => "survived_kill",
        })
    }
}

/// Memory released on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRelease {
    /// GPU index.
    pub gpu: u32,
    /// Used memory before.
    pub used_before: u64,
    /// What the plan expected back.
    pub expected_bytes: u64,
    /// Used memory when the wait ended.
    pub used_after: Option<u64>,
    /// `used_before − used_after`.
    pub freed_bytes: u64,
    /// Whether the expected memory came back within the timeout.
    pub released: bool,
    /// Milliseconds from the last target's exit to the memory being back: the driver's lag.
    pub release_ms: Option<u64>,
    /// Milliseconds from the last exit to the first drop of used memory.
    pub first_drop_ms: Option<u64>,
}

/// One reset decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetOutcome {
    /// GPU index.
    pub gpu: u32,
    /// Unaccounted bytes that motivated it.
    pub unaccounted_bytes: u64,
    /// Whether the reset was run.
    pub attempted: bool,
    /// Processes that hold the device (a refused reset names them).
    pub blockers: Vec<String>,
    /// What happened.
    pub result: String,
    /// Used memory after the reset.
    pub used_after: Option<u64>,
}

/// Memory still held on a GPU at the end, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remaining {
    /// GPU index.
    pub gpu: u32,
    /// Ghost bytes left.
    pub ghost_bytes: u64,
    /// Why.
    pub why: Vec<String>,
}

/// The whole run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReclaimOutcome {
    /// [`vramguard_core::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The audit log's run id.
    pub run_id: String,
    /// The plan that was executed.
    pub plan: Plan,
    /// Per target.
    pub targets: Vec<TargetOutcome>,
    /// Per GPU with expected releases.
    pub releases: Vec<GpuRelease>,
    /// Reset decisions.
    pub resets: Vec<ResetOutcome>,
    /// What remains.
    pub remaining: Vec<Remaining>,
    /// 0 all ghost memory freed, 1 some remains.
    pub exit_code: i32,
}

/// The run could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum ExecuteError {
    /// Writing the audit log failed before any signal: nothing was done.
    #[error("{0}; nothing was signalled")]
    Audit(#[from] AuditError),
    /// Writing the audit log failed after signals were sent: nothing more was sent (every
    /// signal's record is written before the signal), and these processes got SIGTERM without
    /// the SIGKILL that would have followed.
    #[error("{cause}; nothing more was sent{}", unfinished_text(.unfinished))]
    Stopped {
        /// The failed write.
        cause: AuditError,
        /// Processes sent SIGTERM that had not exited: pid and command name.
        unfinished: Vec<(u32, Option<String>)>,
    },
    /// The machine could not be read.
    #[error(transparent)]
    Env(#[from] EnvError),
}

/// Why the machine could not be read while reclaiming.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    /// A snapshot (GPUs and `/proc`) failed.
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    /// The GPUs could not be read.
    #[error(transparent)]
    Gpu(#[from] vramguard_gpu::SourceError),
}

fn unfinished_text(unfinished: &[(u32, Option<String>)]) -> String {
    if unfinished.is_empty() {
        return String::new();
    }
    let who: Vec<String> = unfinished
        .iter()
        .map(|(pid, comm)| {
            format!(
                "{pid} ({})",
                vramguard_core::sanitize::escape(comm.as_deref().unwrap_or("?"))
            )
        })
        .collect();
    let pids: Vec<String> = unfinished.iter().map(|(p, _)| p.to_string()).collect();
    format!(
        ": {} got SIGTERM and no SIGKILL will follow; if they remain, `kill -KILL {}` \
         (check each is still the process named)",
        who.join(", "),
        pids.join(" ")
    )
}

/// Targets that got SIGTERM and have neither exited nor been sent SIGKILL.
fn unfinished(outcomes: &BTreeMap<u32, TargetOutcome>) -> Vec<(u32, Option<String>)> {
    outcomes
        .values()
        .filter(|o| o.signals.iter().any(|s| s == "TERM") && !o.signals.iter().any(|s| s == "KILL"))
        .filter(|o| o.exited_after_ms.is_none())
        .map(|o| (o.pid, o.comm.clone()))
        .collect()
}

fn signal_name(sig: Signal) -> &'static str {
    if sig == Signal::TERM { "TERM" } else { "KILL" }
}

/// Threads of `pid` and where they sleep, for a process that survived SIGKILL.
fn stuck_threads(proc_root: &Path, pid: u32) -> String {
    let Ok(dir) = std::fs::read_dir(proc_root.join(format!("{pid}/task"))) else {
        return "its threads are unreadable".into();
    };
    let mut parts = Vec::new();
    for t in dir.flatten() {
        let tid = t.file_name().to_string_lossy().to_string();
        let state = std::fs::read(t.path().join("stat"))
            .ok()
            .and_then(|s| vramguard_proc::parse::parse_stat(&s).ok())
            .and_then(|s| s.state)
            .unwrap_or('?');
        let wchan = std::fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
        parts.push(format!("{tid} {state} {}", wchan.trim()));
    }
    format!(
        "survived SIGKILL: threads {}; a thread in D state waits for I/O that no signal can \
         interrupt (abort the hung mount or device, or reboot)",
        parts.join(", ")
    )
}

struct Running<'a> {
    target: &'a Target,
    verified: Verified,
    term_at: Instant,
}

/// The identities of a plan's targets, to pin with [`crate::identity::pin`] as soon as the
/// plan exists.
pub fn identities(plan: &Plan) -> Vec<Identity> {
    plan.targets()
        .map(|t| Identity {
            pid: t.pid,
            start_ticks: t.start_ticks,
        })
        .collect()
}

/// Executes `plan`, whose targets were pinned (in plan order) by [`crate::identity::pin`],
/// recording everything in `audit`: the plan, SIGTERM, the grace period and SIGKILL, the wait
/// for the driver, resets if asked, and what remains.
pub fn execute(
    plan: &Plan,
    pinned: Vec<Pinned>,
    report: &Report,
    env: &mut dyn ReclaimEnv,
    audit: &mut AuditLog,
    opts: &ExecuteOptions,
) -> Result<ReclaimOutcome, ExecuteError> {
    record_plan(plan, opts, audit)?;
    let mut run = Run {
        plan,
        opts,
        audit,
        outcomes: BTreeMap::new(),
        exit_times: BTreeMap::new(),
    };
    let running = run.terminate(pinned)?;
    run.kill_survivors(&running)?;
    let releases = run.wait_for_release(report, env)?;
    let resets = if opts.reset == ResetMode::Never {
        Vec::new()
    } else {
        run.reset_gpus(env)?
    };
    let remaining = run.what_remains(env)?;
    let exit_code = if remaining.is_empty() { 0 } else { 1 };
    run.log(
        "result",
        json!({ "exit_code": exit_code, "remaining": remaining,
            "freed_bytes": releases.iter().map(|r| r.freed_bytes).sum::<u64>() }),
    )?;
    Ok(ReclaimOutcome {
        schema_version: vramguard_core::SCHEMA_VERSION,
        run_id: run.audit.run_id().to_string(),
        plan: plan.clone(),
        targets: run.outcomes.into_values().collect(),
        releases,
        resets,
        remaining,
        exit_code,
    })
}

/// The plan, before anything is signalled: a failure here stops the run with nothing done.
fn record_plan(
    plan: &Plan,
    opts: &ExecuteOptions,
    audit: &mut AuditLog,
) -> Result<(), ExecuteError> {
    audit.record(
        "start",
        json!({
            "gpus": plan.gpus,
            "targets": plan.targets().map(|t| t.pid).collect::<Vec<_>>(),
            "expected_free": plan.expected_free,
            "grace_ms": opts.grace.as_millis() as u64,
            "reset": opts.reset,
        }),
    )?;
    for job in &plan.jobs {
        for t in &job.targets {
            audit.record(
                "target",
                json!({
                    "pid": t.pid, "start_ticks": t.start_ticks, "comm": t.comm,
                    "command": t.command, "uid": t.uid, "class": t.class,
                    "gpus": t.gpus, "job_leader": job.leader_pid, "evidence": t.evidence,
                }),
            )?;
        }
    }
    for l in &plan.left_alone {
        audit.record(
            "left_alone",
            json!({ "pid": l.pid, "comm": l.comm, "class": l.class, "gpus": l.gpus, "reason": l.reason }),
        )?;
    }
    Ok(())
}

/// A run in progress: what each target did so far, and when each exited.
struct Run<'a> {
    plan: &'a Plan,
    opts: &'a ExecuteOptions,
    audit: &'a mut AuditLog,
    outcomes: BTreeMap<u32, TargetOutcome>,
    exit_times: BTreeMap<u32, Instant>,
}

impl<'a> Run<'a> {
    /// Records an action. From the first signal on, a failed record stops the run and names
    /// what was left half-done (the outcomes say which targets got SIGTERM and no SIGKILL).
    fn log(&mut self, event: &str, value: serde_json::Value) -> Result<(), ExecuteError> {
        self.audit
            .record(event, value)
            .map_err(|cause| ExecuteError::Stopped {
                cause,
                unfinished: unfinished(&self.outcomes),
            })
    }

    fn outcome(&mut self, pid: u32) -> &mut TargetOutcome {
        self.outcomes
            .get_mut(&pid)
            .expect("every target has an outcome")
    }

    /// Phase 1: SIGTERM through the pinned pidfds; returns the targets now running down.
    fn terminate(&mut self, pinned: Vec<Pinned>) -> Result<Vec<Running<'a>>, ExecuteError> {
        let mut running = Vec::new();
        let mut pinned: BTreeMap<u32, Pinned> =
            pinned.into_iter().map(|p| (p.identity.pid, p)).collect();
        let plan = self.plan;
        for t in plan.targets() {
            self.outcomes.insert(
                t.pid,
                TargetOutcome {
                    pid: t.pid,
                    comm: t.comm.clone(),
                    signals: Vec::new(),
                    exited_after_ms: None,
                    result: TargetResult::Signalled,
                    detail: None,
                },
            );
            let handle = match pinned.remove(&t.pid) {
                Some(p) if p.identity.start_ticks == t.start_ticks => p.handle,
                _ => Err(Refusal::Failed("not pinned at plan time".into())),
            };
            // Write-ahead: a signal's record is on disk before the signal is sent.
            let sent = match handle {
                Ok(v) => {
                    self.log(
                        "signal",
                        json!({ "pid": t.pid, "start_ticks": t.start_ticks, "signal": "TERM" }),
                    )?;
                    v.signal(Signal::TERM).map(|()| v)
                }
                Err(refusal) => Err(refusal),
            };
            match sent {
                Ok(v) => {
                    self.outcome(t.pid).signals.push("TERM".into());
                    running.push(Running {
                        target: t,
                        verified: v,
                        term_at: Instant::now(),
                    });
                }
                Err(refusal) => {
                    let o = self.outcome(t.pid);
                    o.result = if refusal == Refusal::Gone {
                        TargetResult::GoneBefore
                    } else {
                        TargetResult::NotSignalled
                    };
                    o.detail = Some(refusal.to_string());
                    self.log(
                        "skipped",
                        json!({ "pid": t.pid, "start_ticks": t.start_ticks, "reason": refusal.to_string() }),
                    )?;
                }
            }
        }
        Ok(running)
    }

    /// Records an exit `at`, `ms` after SIGTERM.
    fn exited(
        &mut self,
        r: &Running<'_>,
        at: Instant,
        result: TargetResult,
        signal: &str,
    ) -> Result<(), ExecuteError> {
        let ms = at.duration_since(r.term_at).as_millis() as u64;
        self.exit_times.insert(r.target.pid, at);
        let o = self.outcome(r.target.pid);
        o.exited_after_ms = Some(ms);
        o.result = result;
        self.log(
            "exited",
            json!({ "pid": r.target.pid, "after_ms": ms, "signal": signal }),
        )
    }

    /// Phase 2: The grace period, then SIGKILL for whoever is left.
    fn kill_survivors(&mut self, running: &[Running<'a>]) -> Result<(), ExecuteError> {
        let procs: Vec<&Verified> = running.iter().map(|r| &r.verified).collect();
        let exits = wait_all(&procs, Instant::now() + self.opts.grace);
        let mut survivors = Vec::new();
        for (r, exit) in running.iter().zip(exits) {
            match exit {
                Some(at) => self.exited(r, at, TargetResult::Exited, "TERM")?,
                None => survivors.push(r),
            }
        }
        for r in &survivors {
            self.log(
                "signal",
                json!({ "pid": r.target.pid, "start_ticks": r.target.start_ticks, "signal": "KILL",
                    "after_grace_ms": self.opts.grace.as_millis() as u64 }),
            )?;
            if let Err(e) = r.verified.signal(Signal::KILL) {
                self.log(
                    "signal_failed",
                    json!({ "pid": r.target.pid, "signal": "KILL", "error": e.to_string() }),
                )?;
            }
            self.outcome(r.target.pid)
                .signals
                .push(signal_name(Signal::KILL).into());
        }
        let kprocs: Vec<&Verified> = survivors.iter().map(|r| &r.verified).collect();
        let kexits = wait_all(&kprocs, Instant::now() + self.opts.kill_wait);
        for (r, exit) in survivors.iter().zip(kexits) {
            match exit {
                Some(at) => self.exited(r, at, TargetResult::ExitedAfterKill, "KILL")?,
                None => {
                    let detail = stuck_threads(&self.opts.proc_root, r.target.pid);
                    let o = self.outcome(r.target.pid);
                    o.result = TargetResult::SurvivedKill;
                    o.detail = Some(detail.clone());
                    self.log("stuck", json!({ "pid": r.target.pid, "detail": detail }))?;
                }
            }
        }
        Ok(())
    }

    /// Phase 3: Waits for the driver to give the memory back, on every GPU where a target was
    /// signalled (or was gone already).
    fn wait_for_release(
        &mut self,
        report: &Report,
        env: &mut dyn ReclaimEnv,
    ) -> Result<Vec<GpuRelease>, ExecuteError> {
        let policy = env.policy().clone();
        // Per GPU: the watch, and the last exit its times count from.
        let mut watch: Vec<(ReleaseWatch, Instant)> = Vec::new();
        for (&gpu, &expected) in &self.plan.expected_free {
            let Some(mem) = report
                .gpus
                .iter()
                .find(|g| g.index == gpu)
                .and_then(|g| g.memory)
            else {
                continue;
            };
            let holders: Vec<u32> = self
                .plan
                .targets()
                .filter(|t| t.gpus.iter().any(|tg| tg.gpu == gpu))
                .map(|t| t.pid)
                .collect();
            let signalled = holders.iter().any(|p| {
                self.outcomes
                    .get(p)
                    .is_some_and(|o| !o.signals.is_empty() || o.result == TargetResult::GoneBefore)
            });
            if !signalled {
                continue;
            }
            let last_exit = holders
                .iter()
                .filter_map(|p| self.exit_times.get(p).copied())
                .max()
                .unwrap_or_else(Instant::now);
            watch.push((
                ReleaseWatch::new(gpu, mem.total, mem.used, expected, &policy),
                last_exit,
            ));
        }
        let deadline = Instant::now() + self.opts.release_timeout;
        while !watch.iter().all(|(w, _)| w.released()) {
            let used = env.used_memory()?;
            let now = Instant::now();
            for (w, last_exit) in &mut watch {
                if let Some(u) = used.get(&w.gpu).copied() {
                    w.observe(
                        u,
                        now.saturating_duration_since(*last_exit).as_millis() as u64,
                    );
                }
            }
            if now >= deadline {
                break;
            }
            std::thread::sleep(self.opts.poll);
        }
        let mut releases = Vec::new();
        for (w, _) in watch {
            let after = w.last_used();
            let rel = GpuRelease {
                gpu: w.gpu,
                used_before: w.used_before,
                expected_bytes: w.expected_bytes,
                used_after: after,
                freed_bytes: after.map_or(0, |a| w.used_before.saturating_sub(a)),
                released: w.released(),
                release_ms: w.released_after_ms(),
                first_drop_ms: w.first_drop_after_ms(),
            };
            self.log(
                if rel.released {
                    "released"
                } else {
                    "not_released"
                },
                serde_json::to_value(&rel).expect("serialises"),
            )?;
            releases.push(rel);
        }
        Ok(releases)
    }

    /// Phase 4: Resets the plan's GPUs whose remaining unaccounted memory the reset mode allows,
    /// never while a process holds the device.
    fn reset_gpus(&mut self, env: &mut dyn ReclaimEnv) -> Result<Vec<ResetOutcome>, ExecuteError> {
        let mut resets = Vec::new();
        let (_, now_report) = env.snapshot()?;
        for g in now_report
            .gpus
            .iter()
            .filter(|g| self.plan.gpus.contains(&g.index))
        {
            let Some(un) = g.unaccounted.as_ref().filter(|u| u.significant) else {
                continue;
            };
            let residue = un.cause == Some(UnaccountedCause::DriverResidue);
            if !(residue || self.opts.reset == ResetMode::Force) {
                self.log(
                    "reset_skipped",
                    json!({ "gpu": g.index, "unaccounted_bytes": un.bytes,
                            "reason": format!("not proven residue ({:?}); use --reset=force", un.cause) }),
                )?;
                resets.push(ResetOutcome {
                    gpu: g.index,
                    unaccounted_bytes: un.bytes,
                    attempted: false,
                    blockers: Vec::new(),
                    result: format!(
                        "skipped: the unaccounted memory is not proven residue ({}); --reset=force resets anyway",
                        un.explanation.get(1).cloned().unwrap_or_default()
                    ),
                    used_after: g.memory.map(|m| m.used),
                });
                continue;
            }
            let blockers: Vec<String> = g.reset_blockers.iter().map(|b| b.to_string()).collect();
            if !blockers.is_empty() {
                self.log(
                    "reset_refused",
                    json!({ "gpu": g.index, "unaccounted_bytes": un.bytes, "blockers": blockers }),
                )?;
                resets.push(ResetOutcome {
                    gpu: g.index,
                    unaccounted_bytes: un.bytes,
                    attempted: false,
                    blockers,
                    result: "refused: processes still hold the device; stop them first".into(),
                    used_after: g.memory.map(|m| m.used),
                });
                continue;
            }
            resets.push(self.reset_one(env, g, un.bytes)?);
        }
        Ok(resets)
    }

    /// Resets one GPU and waits for its memory to return to the baseline.
    fn reset_one(
        &mut self,
        env: &mut dyn ReclaimEnv,
        g: &vramguard_core::GpuReport,
        unaccounted_bytes: u64,
    ) -> Result<ResetOutcome, ExecuteError> {
        self.log(
            "reset",
            json!({ "gpu": g.index, "unaccounted_bytes": unaccounted_bytes }),
        )?;
        let result = env.reset(g.index);
        let policy = env.policy().clone();
        let baseline = policy.baseline_for(g.index, g.uuid.as_deref());
        let tolerance = g.memory.map_or(0, |m| policy.tolerance_for(m.total));
        let mut used_after = None;
        if result.is_ok() {
            let deadline = Instant::now() + self.opts.release_timeout;
            loop {
                let used = env.used_memory()?;
                used_after = used.get(&g.index).copied();
                if used_after.is_some_and(|u| u <= baseline + tolerance)
                    || Instant::now() >= deadline
                {
                    break;
                }
                std::thread::sleep(self.opts.poll);
            }
        }
        let text = match &result {
            Ok(msg) if used_after.is_some_and(|u| u <= baseline + tolerance) => {
                format!("reset done, memory back to baseline: {msg}")
            }
            Ok(msg) => format!("reset done but memory did not return to baseline: {msg}"),
            Err(e) => format!("reset failed: {e}"),
        };
        self.log(
            if result.is_ok() {
                "reset_done"
            } else {
                "reset_failed"
            },
            json!({ "gpu": g.index, "result": text, "used_after": used_after }),
        )?;
        Ok(ResetOutcome {
            gpu: g.index,
            unaccounted_bytes,
            attempted: true,
            blockers: Vec::new(),
            result: text,
            used_after,
        })
    }

    /// Phase 5: What ghost memory remains on the plan's GPUs, and why.
    fn what_remains(&mut self, env: &mut dyn ReclaimEnv) -> Result<Vec<Remaining>, ExecuteError> {
        let (_, last) = env.snapshot()?;
        let mut remaining = Vec::new();
        for g in last
            .gpus
            .iter()
            .filter(|g| self.plan.gpus.contains(&g.index) && g.ghost_bytes > 0)
        {
            let mut why: Vec<String> = g
                .holders
                .iter()
                .filter(|h| h.class.is_ghost())
                .map(|h| format!("pid {} ({}): {}", h.pid, h.class, h.action.summary))
                .collect();
            if let Some(u) = g.unaccounted.as_ref().filter(|u| u.significant) {
                why.extend(u.explanation.iter().skip(1).cloned());
                if self.opts.reset == ResetMode::Never
                    && u.cause == Some(UnaccountedCause::DriverResidue)
                {
                    why.push(format!(
                        "driver residue stays until a reset: vramguard reclaim --gpu {} --reset=auto",
                        g.index
                    ));
                }
            }
            remaining.push(Remaining {
                gpu: g.index,
                ghost_bytes: g.ghost_bytes,
                why,
            });
        }
        Ok(remaining)
    }
}

/// How a GPU is reset.
#[derive(Clone)]
pub enum ResetBackend {
    /// A command, run without a shell; `{index}`, `{uuid}`, `{pci_bus_id}` are replaced.
    Command(Vec<String>),
    /// A function of the GPU index (the simulator's reset): what it did, or why it failed.
    Function(Arc<ResetFn>),
}

/// A reset done in-process.
pub type ResetFn = dyn Fn(u32) -> Result<String, String> + Send + Sync;

impl std::fmt::Debug for ResetBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResetBackend::Command(argv) => f.debug_tuple("Command").field(argv).finish(),
            ResetBackend::Function(_) => f.write_str("Function"),
        }
    }
}

impl ResetBackend {
    /// `nvidia-smi --gpu-reset -i {index}`.
    pub fn nvidia_smi() -> ResetBackend {
        ResetBackend::Command(
            ["nvidia-smi", "--gpu-reset", "-i", "{index}"]
                .map(String::from)
                .to_vec(),
        )
    }
}

/// The real machine (or the simulated one) as the executor sees it: a GPU source for the
/// driver polls, a collector for the snapshots, and a way to reset a GPU.
pub struct MachineEnv {
    /// The GPUs.
    pub source: Box<dyn GpuSource>,
    /// The processes.
    pub collector: ProcCollector,
    /// Classification.
    pub policy: Policy,
    /// How to reset a GPU.
    pub reset: ResetBackend,
    /// The last report taken (names GPUs for the reset command).
    pub last_report: Option<Report>,
    /// How long [`ReclaimEnv::snapshot`] watches the processes work before it classifies.
    pub sample: Duration,
}

/// A reclaim ready to run: the plan made from a fresh sampled snapshot, its targets pinned
/// (from here on a reused pid is out of reach). The one pipeline `reclaim`, the demo and the
/// agent's automatic reclaim share: [`MachineEnv::prepare`], then [`Prepared::run`].
pub struct Prepared {
    /// The snapshot the plan was made from.
    pub snapshot: Snapshot,
    /// Its classification.
    pub report: Report,
    /// The plan.
    pub plan: Plan,
    pinned: Vec<Pinned>,
}

impl Prepared {
    /// Executes the plan (every action in `audit`).
    pub fn run(
        self,
        env: &mut MachineEnv,
        audit: &mut AuditLog,
        opts: &ExecuteOptions,
    ) -> Result<ReclaimOutcome, ExecuteError> {
        execute(&self.plan, self.pinned, &self.report, env, audit, opts)
    }
}

impl MachineEnv {
    /// An environment on this machine; plans are made after watching the processes work for
    /// `sample`.
    pub fn new(
        source: Box<dyn GpuSource>,
        collector: ProcCollector,
        policy: Policy,
        reset: ResetBackend,
        sample: Duration,
    ) -> MachineEnv {
        MachineEnv {
            source,
            collector,
            policy,
            reset,
            last_report: None,
            sample,
        }
    }

    /// Plans a reclaim from a fresh [`MachineEnv::planning_snapshot`]: `plan` makes the plan
    /// (`plan_reclaim` with the caller's options, narrowed as it needs), then its targets are
    /// pinned through `proc_root`.
    pub fn prepare(
        &mut self,
        proc_root: &Path,
        plan: impl FnOnce(&Snapshot, &Report) -> Plan,
    ) -> Result<Prepared, EnvError> {
        let (snapshot, report) = self.planning_snapshot()?;
        let plan = plan(&snapshot, &report);
        let pinned = crate::identity::pin(proc_root, identities(&plan));
        Ok(Prepared {
            snapshot,
            report,
            plan,
            pinned,
        })
    }

    /// The snapshot a plan is made from: a full collection, then [`MachineEnv::sample`] of
    /// watching the processes work, classified. The executor's own re-reads
    /// ([`ReclaimEnv::snapshot`]) take no window: they only follow what the plan did.
    pub fn planning_snapshot(&mut self) -> Result<(Snapshot, Report), EnvError> {
        let snap = take_sampled_snapshot(
            self.source.as_mut(),
            &mut self.collector,
            &self.policy,
            ScanDepth::Full,
            self.sample,
        )?;
        let report = classify(&snap, &self.policy);
        self.last_report = Some(report.clone());
        Ok((snap, report))
    }
}

impl ReclaimEnv for MachineEnv {
    fn snapshot(&mut self) -> Result<(Snapshot, Report), EnvError> {
        let snap = take_snapshot(
            self.source.as_mut(),
            &mut self.collector,
            &self.policy,
            ScanDepth::Full,
        )?;
        let report = classify(&snap, &self.policy);
        self.last_report = Some(report.clone());
        Ok((snap, report))
    }

    fn used_memory(&mut self) -> Result<BTreeMap<u32, u64>, EnvError> {
        let sample = self.source.sample(Duration::from_secs(1))?;
        Ok(sample
            .gpus
            .iter()
            .filter_map(|g| g.memory.map(|m| (g.index, m.used)))
            .collect())
    }

    fn reset(&mut self, gpu: u32) -> Result<String, String> {
        match &self.reset {
            ResetBackend::Function(reset) => reset(gpu),
            ResetBackend::Command(template) => {
                let g = self
                    .last_report
                    .as_ref()
                    .and_then(|r| r.gpus.iter().find(|g| g.index == gpu));
                let fill = |arg: &String| {
                    arg.replace("{index}", &gpu.to_string())
                        .replace("{uuid}", g.and_then(|g| g.uuid.as_deref()).unwrap_or(""))
                        .replace(
                            "{pci_bus_id}",
                            g.and_then(|g| g.pci_bus_id.as_deref()).unwrap_or(""),
                        )
                };
                let argv: Vec<String> = template.iter().map(fill).collect();
                let out = std::process::Command::new(&argv[0])
                    .args(&argv[1..])
                    .output()
                    .map_err(|e| format!("running {}: {e}", argv.join(" ")))?;
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout).trim(),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                if out.status.success() {
                    Ok(format!("{}: {text}", argv.join(" ")))
                } else {
                    Err(format!(
                        "{} exited with {}: {text}",
                        argv.join(" "),
                        out.status
                    ))
                }
            }
        }
    }

    fn policy(&self) -> &Policy {
        &self.policy
    }
}

#[cfg(test)]
mod write_ahead_tests {
    use super::*;
    use vramguard_core::plan::{PlannedJob, Target, TargetGpu};
    use vramguard_core::snapshot::{DriverFacts, DriverSource};

    /// The executor's view of the machine is not needed before the audit failure.
    struct Unused(Policy);

    impl ReclaimEnv for Unused {
        fn snapshot(&mut self) -> Result<(Snapshot, Report), EnvError> {
            Err(EnvError::Gpu(vramguard_gpu::SourceError::Backend(
                "not used".into(),
            )))
        }
        fn used_memory(&mut self) -> Result<BTreeMap<u32, u64>, EnvError> {
            Ok(BTreeMap::new())
        }
        fn reset(&mut self, _gpu: u32) -> Result<String, String> {
            Err("not used".into())
        }
        fn policy(&self) -> &Policy {
            &self.0
        }
    }

    struct Children(Vec<std::process::Child>);
    impl Drop for Children {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    fn start_ticks(pid: u32) -> u64 {
        let stat =
            std::fs::read_to_string(format!("{}/{pid}/stat", vramguard_proc::OWN_PROC)).unwrap();
        stat[stat.rfind(')').unwrap() + 1..]
            .split_ascii_whitespace()
            .nth(19)
            .unwrap()
            .parse()
            .unwrap()
    }

    fn alive(pid: u32) -> bool {
        std::fs::read_to_string(format!("{}/{pid}/stat", vramguard_proc::OWN_PROC))
            .is_ok_and(|s| !matches!(s[s.rfind(')').unwrap() + 2..].chars().next(), Some('Z')))
    }

    /// Runs the executor on `script`ed processes with room for `records` audit records.
    fn run(script: &str, records: usize) -> (Children, Result<ReclaimOutcome, ExecuteError>) {
        let kids = Children(
            (0..2)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", script])
                        .spawn()
                        .unwrap()
                })
                .collect(),
        );
        std::thread::sleep(Duration::from_millis(100));
        let targets = kids
            .0
            .iter()
            .map(|c| Target {
                pid: c.id(),
                start_ticks: start_ticks(c.id()),
                class: vramguard_core::Class::Orphan,
                comm: Some("sh".into()),
                command: None,
                uid: Some(0),
                gpus: vec![TargetGpu {
                    gpu: 0,
                    bytes: None,
                }],
                evidence: vec![],
            })
            .collect();
        let plan = Plan {
            gpus: vec![0],
            jobs: vec![PlannedJob {
                leader_pid: None,
                leader_command: None,
                targets,
            }],
            left_alone: vec![],
            expected_free: BTreeMap::new(),
            warnings: vec![],
        };
        let report = Report {
            schema_version: vramguard_core::SCHEMA_VERSION,
            taken_at_ms: 0,
            hostname: None,
            pid_namespace_is_host: Some(true),
            euid: 0,
            driver: DriverFacts {
                source: DriverSource::Simulated,
                library: None,
                driver_version: None,
                nvml_version: None,
            },
            gpus: vec![],
            limitations: vec![],
            full_fd_scan: true,
        };
        let dir = tempfile::tempdir().unwrap();
        let mut audit = AuditLog::open(&dir.path().join("audit.jsonl"), "t").unwrap();
        audit.budget = Some(records);
        let pinned = crate::identity::pin(Path::new(vramguard_proc::OWN_PROC), identities(&plan));
        let result = execute(
            &plan,
            pinned,
            &report,
            &mut Unused(Policy::default()),
            &mut audit,
            &ExecuteOptions::new(
                Duration::from_millis(300),
                Duration::from_secs(1),
                ResetMode::Never,
                PathBuf::from(vramguard_proc::OWN_PROC),
            ),
        );
        (kids, result)
    }

    #[test]
    fn no_signal_is_sent_whose_record_could_not_be_written() {
        // Room for start and the two targets: the first SIGTERM's record fails.
        let (kids, result) = run("exec sleep 30", 3);
        match result {
            Err(ExecuteError::Stopped { unfinished, .. }) => assert!(unfinished.is_empty()),
            other => panic!("{other:?}"),
        }
        for c in &kids.0 {
            assert!(alive(c.id()), "{} got a signal without a record", c.id());
        }
    }

    #[test]
    fn a_failed_record_after_sigterm_stops_and_names_what_got_no_sigkill() {
        // Room for start, two targets and both SIGTERMs; they ignore SIGTERM, and the first
        // SIGKILL's record fails: no SIGKILL is sent, and the error says so.
        let (kids, result) = run("trap '' TERM; while :; do sleep 1; done", 5);
        let e = match result {
            Err(e @ ExecuteError::Stopped { .. }) => e,
            other => panic!("{other:?}"),
        };
        let ExecuteError::Stopped { unfinished, .. } = &e else {
            unreachable!()
        };
        let pids: Vec<u32> = unfinished.iter().map(|(p, _)| *p).collect();
        assert_eq!(pids, kids.0.iter().map(|c| c.id()).collect::<Vec<_>>());
        let text = e.to_string();
        assert!(text.contains("No space left on device"), "{text}");
        assert!(text.contains("nothing more was sent"), "{text}");
        assert!(
            text.contains("got SIGTERM and no SIGKILL will follow"),
            "{text}"
        );
        for c in &kids.0 {
            assert!(alive(c.id()), "{} got SIGKILL without a record", c.id());
        }
    }
}
