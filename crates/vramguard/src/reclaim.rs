//! `vramguard reclaim`: plan, confirm, execute, report.

use crate::cli::{Included, ReclaimArgs};
use crate::gpusel::GpuSelector;
use crate::settings::Settings;
use anyhow::{Context, Result, bail};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;
use vramguard_core::plan::{Plan, ReclaimOptions, plan_reclaim};
use vramguard_core::report::{Class, Report};
use vramguard_core::sanitize::{cell, escape, fit, shown};
use vramguard_core::units::{format_bytes, format_duration};
use vramguard_ops::reclaim::{
    ExecuteError, INTERRUPTED_EXIT_CODE, ReclaimOutcome, SegmentResult, TargetResult,
};
use vramguard_ops::{AuditLog, ExecuteOptions, ResetMode, StopRequests};

fn options(args: &ReclaimArgs, settings: &Settings) -> Result<ReclaimOptions> {
    let mut include = BTreeSet::new();
    let mut include_shm = None;
    let mut include_keepers = false;
    for &item in &args.include {
        let class = match item {
            Included::Class(class) => class,
            Included::Shm => {
                include_shm = Some(settings.policy().shm.clone());
                continue;
            }
            Included::Keepers => {
                // Keepers are hidden holders: asking for them asks for that class too.
                include_keepers = true;
                include.insert(Class::Hidden);
                continue;
            }
        };
        class
            .check_target(false)
            .map_err(|e| anyhow::anyhow!("--include {class}: {e}"))?;
        include.insert(class);
    }
    Ok(ReclaimOptions {
        gpus: None,
        include,
        idle_for_secs: args.idle_for.as_secs(),
        mig_devices: None,
        job_of: None,
        job_label: args.job.clone(),
        include_shm,
        include_keepers,
    })
}

/// `--gpu` resolved against what the node has: indices and GPU UUIDs select GPUs, a MIG UUID
/// selects its MIG device (and its GPU).
fn resolve_gpus(
    selectors: &[GpuSelector],
    report: &Report,
    mut opts: ReclaimOptions,
) -> Result<ReclaimOptions> {
    if selectors.is_empty() {
        return Ok(opts);
    }
    let selection = crate::gpusel::resolve_in_report(selectors, report)?;
    opts.gpus = Some(selection.gpus);
    opts.mig_devices = (!selection.mig_devices.is_empty()).then_some(selection.mig_devices);
    Ok(opts)
}

pub(crate) fn render_plan(plan: &Plan, report: &Report, dry: bool) -> String {
    crate::render::wrap_lines(&plan_text(plan, report, dry), crate::render::output_width())
}

/// The plan as [`render_plan`] prints it, unwrapped: for `top`, whose dialog wraps it to
/// its own width.
pub(crate) fn plan_text(plan: &Plan, report: &Report, dry: bool) -> String {
    let mut out = String::new();
    let gpus: Vec<String> = plan.gpus.iter().map(|g| g.to_string()).collect();
    let _ = writeln!(out, "vramguard reclaim · plan for GPU {}", gpus.join(","));
    if plan.targets().next().is_none() {
        let _ = writeln!(out, "  no process to signal");
    }
    for w in &plan.warnings {
        let _ = writeln!(out, "  WARNING: {w}");
    }
    for job in &plan.jobs {
        let leader = match (job.leader_pid, &job.leader_command) {
            (Some(p), Some(c)) => format!("job of leader {p} ({}), gone", shown(c)),
            (Some(p), None) => format!("job of leader {p}, gone"),
            (None, _) => "no job leader".into(),
        };
        let _ = writeln!(out, "  {leader}");
        for t in &job.targets {
            let bytes: u64 = t.gpus.iter().filter_map(|g| g.bytes).sum();
            let mem = if t.gpus.iter().all(|g| g.bytes.is_none()) {
                "unlisted".to_string()
            } else {
                format_bytes(bytes)
            };
            let _ = writeln!(
                out,
                "    TERM→KILL  pid {:<8} {:<7} {:>10}  {}",
                t.pid,
                t.class.as_str(),
                mem,
                shown(t.command.as_deref().unwrap_or("?"))
            );
            if let Some(e) = t.evidence.first() {
                let _ = writeln!(out, "               {e}");
            }
        }
    }
    if !plan.left_alone.is_empty() {
        let _ = writeln!(out, "  left alone:");
        for l in &plan.left_alone {
            let _ = writeln!(
                out,
                "    pid {:<8} {} {:<7} {}",
                l.pid,
                cell(l.comm.as_deref().unwrap_or("?"), 16),
                l.class.as_str(),
                l.reason
            );
        }
    }
    for (gpu, bytes) in &plan.expected_free {
        let _ = writeln!(
            out,
            "  expected back on GPU {gpu}: {}",
            format_bytes(*bytes)
        );
    }
    render_planned_segments(&mut out, plan);
    for g in report.gpus.iter().filter(|g| plan.gpus.contains(&g.index)) {
        if let Some(u) = g.unaccounted.as_ref().filter(|u| u.significant) {
            let _ = writeln!(
                out,
                "  GPU {}: {} unaccounted: {}",
                g.index,
                format_bytes(u.bytes),
                u.explanation.get(1).cloned().unwrap_or_default()
            );
        }
    }
    if dry {
        let _ = writeln!(
            out,
            "dry run: nothing was signalled (pass --yes to act, or run it on a terminal to be asked)"
        );
    }
    out
}

/// The orphaned shared-memory segments a plan removes (`--include shm`).
fn render_planned_segments(out: &mut String, plan: &Plan) {
    if plan.segments.is_empty() {
        return;
    }
    let total: u64 = plan.segments.iter().map(|s| s.bytes).sum();
    let _ = writeln!(
        out,
        "  orphaned shared memory to remove: {} in {} segment(s)",
        format_bytes(total),
        plan.segments.len()
    );
    for s in &plan.segments {
        let _ = writeln!(
            out,
            "    unlink     {} {:>10}  uid {:<6} {}  {}{}",
            cell(&format!("{}/{}", s.dir, s.name), 40),
            format_bytes(s.bytes),
            s.uid,
            format_duration(Duration::from_secs(s.age_secs)),
            shown(s.producer.as_deref().unwrap_or("?")),
            if s.after_targets.is_empty() {
                String::new()
            } else {
                let pids: Vec<String> = s.after_targets.iter().map(|p| p.to_string()).collect();
                format!("  (once pid {} are gone)", pids.join(", "))
            }
        );
    }
}

/// What happened to the segments, and how much host memory came back.
fn render_segment_outcomes(out: &mut String, o: &ReclaimOutcome) {
    for s in &o.segments {
        let what = match s.result {
            SegmentResult::Removed => format!("removed ({})", format_bytes(s.bytes)),
            SegmentResult::Gone => "already gone".into(),
            SegmentResult::Kept => format!("kept: {}", s.detail.as_deref().unwrap_or("")),
            SegmentResult::Failed => format!("not removed: {}", s.detail.as_deref().unwrap_or("")),
        };
        let _ = writeln!(
            out,
            "  {} {what}",
            fit(&format!("{}/{}", s.dir, s.name), 48)
        );
    }
    if let Some(available) = o.host_available {
        let removed: u64 = o
            .segments
            .iter()
            .filter(|s| s.result == SegmentResult::Removed)
            .map(|s| s.bytes)
            .sum();
        let available = match (available.before, available.after) {
            (Some(b), Some(a)) => {
                format!("; MemAvailable {} → {}", format_bytes(b), format_bytes(a))
            }
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "  shared memory: {} removed{available}",
            format_bytes(removed)
        );
    }
}

pub(crate) fn render_outcome(o: &ReclaimOutcome, audit: &std::path::Path) -> String {
    crate::render::wrap_lines(&outcome_text(o, audit), crate::render::output_width())
}

/// The outcome as [`render_outcome`] prints it, unwrapped (for `top`'s dialog).
pub(crate) fn outcome_text(o: &ReclaimOutcome, audit: &std::path::Path) -> String {
    let mut out = String::new();
    for t in &o.targets {
        let what = match (t.result, t.exited_after_ms) {
            (TargetResult::Exited, Some(ms)) => format!(
                "exited {} after SIGTERM",
                format_duration(Duration::from_millis(ms))
            ),
            (TargetResult::ExitedAfterKill, Some(ms)) => format!(
                "ignored SIGTERM; SIGKILLed, exited {} after SIGTERM",
                format_duration(Duration::from_millis(ms))
            ),
            (r, _) => format!("{r}: {}", escape(t.detail.as_deref().unwrap_or_default())),
        };
        let _ = writeln!(
            out,
            "  pid {:<8} {} {what}",
            t.pid,
            cell(t.comm.as_deref().unwrap_or("?"), 16)
        );
    }
    for r in &o.releases {
        if r.released {
            let _ = writeln!(
                out,
                "  GPU {}: {} freed; the driver released it {} after the last exit",
                r.gpu,
                format_bytes(r.freed_bytes),
                format_duration(Duration::from_millis(r.release_ms.unwrap_or(0)))
            );
        } else {
            let _ = writeln!(
                out,
                "  GPU {}: only {} of the expected {} came back before --release-timeout",
                r.gpu,
                format_bytes(r.freed_bytes),
                format_bytes(r.expected_bytes)
            );
        }
    }
    for r in &o.resets {
        let _ = writeln!(out, "  reset GPU {}: {}", r.gpu, r.result);
        for b in &r.blockers {
            let _ = writeln!(out, "    blocker: {}", escape(b));
        }
    }
    render_segment_outcomes(&mut out, o);
    if o.remaining.is_empty() {
        let _ = writeln!(
            out,
            "result: every byte of ghost memory on the selected GPUs is free"
        );
    } else {
        for r in &o.remaining {
            if r.ghost_bytes > 0 {
                let _ = writeln!(
                    out,
                    "result: GPU {} still holds {} of ghost memory:",
                    r.gpu,
                    format_bytes(r.ghost_bytes)
                );
            } else {
                let _ = writeln!(out, "result: GPU {}'s memory is not proven free:", r.gpu);
            }
            for w in &r.why {
                let _ = writeln!(out, "    {}", escape(w));
            }
        }
    }
    if o.interrupted {
        let _ = writeln!(
            out,
            "interrupted: what was started was finished; nothing new was begun (exit {})",
            INTERRUPTED_EXIT_CODE
        );
    }
    let _ = writeln!(
        out,
        "audit: {} (run {})",
        escape(&audit.display().to_string()),
        o.run_id
    );
    out
}

/// Prints the plan of a dry run.
fn print_dry_run(plan: &Plan, report: &Report, json: bool) -> Result<()> {
    if json {
        crate::print_json(
            &serde_json::json!({ "schema_version": vramguard_core::SCHEMA_VERSION, "dry_run": true, "plan": plan }),
        )
    } else {
        crate::print(&render_plan(plan, report, true))
    }
}

/// Refuses a `--proc-root` other than vramguard's own PID namespace's: pids read there are
/// the pids signalled.
pub(crate) fn check_own_proc(proc_root: &std::path::Path) -> Result<()> {
    let own = vramguard_proc::ProcFs::open(proc_root).is_ok_and(|fs| fs.is_own_namespace());
    if !own {
        bail!(
            "reclaim signals processes, so it needs the /proc of its own PID namespace; {} is not (use the default /proc)",
            proc_root.display()
        );
    }
    Ok(())
}

/// `reclaim --dry-run --replay`: the plan for a saved snapshot (anything else is refused:
/// a replay is not this machine).
fn replayed_dry_run(settings: &Settings, args: &ReclaimArgs, opts: ReclaimOptions) -> Result<i32> {
    if !args.dry_run {
        bail!(
            "reclaim acts on this machine; with --replay only --dry-run works (the plan for the saved snapshot)"
        );
    }
    // The saved snapshot keeps the window of work it was taken with.
    let (snap, report) = settings.report(Duration::ZERO)?;
    let opts = resolve_gpus(&args.gpu, &report, opts)?;
    let plan = plan_reclaim(&snap, &report, &opts);
    print_dry_run(&plan, &report, args.json)?;
    Ok(0)
}

/// Nothing to signal and no reset asked for: says whether ghost memory remains anyway (exit
/// 1) or there is nothing to reclaim (exit 0).
fn nothing_to_signal(plan: &Plan, report: &Report, json: bool) -> Result<i32> {
    let ghost: u64 = report
        .gpus
        .iter()
        .filter(|g| plan.gpus.contains(&g.index))
        .map(|g| g.ghost_bytes)
        .sum();
    if json {
        crate::print_json(
            &serde_json::json!({ "schema_version": vramguard_core::SCHEMA_VERSION, "plan": plan, "ghost_bytes": ghost }),
        )?;
    } else if ghost > 0 {
        crate::print(&format!(
            "nothing to signal, but {} of ghost memory remains: see the reasons above (`vramguard diagnose` for the next step)\n",
            format_bytes(ghost)
        ))?;
    } else {
        crate::print("nothing to reclaim\n")?;
    }
    Ok(if ghost > 0 { 1 } else { 0 })
}

/// Asks on the terminal; only `y`/`yes` confirms.
fn confirmed(plan: &Plan, reset: ResetMode) -> Result<bool> {
    let bytes: u64 = plan.expected_free.values().sum();
    let shm: u64 = plan.segments.iter().map(|s| s.bytes).sum();
    eprint!(
        "Signal {} process(es) to free {}{}{}? [y/N] ",
        plan.targets().count(),
        format_bytes(bytes),
        if reset == ResetMode::Never {
            ""
        } else {
            ", and reset GPUs holding residue"
        },
        if plan.segments.is_empty() {
            String::new()
        } else {
            format!(
                ", and remove {} shared-memory segment(s) ({})",
                plan.segments.len(),
                format_bytes(shm)
            )
        }
    );
    std::io::stderr().flush().ok();
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// Counts SIGINT and SIGTERM into `stop` (instead of ending the process) until the returned
/// handlers are unregistered.
pub(crate) fn stop_on_signals(stop: &StopRequests) -> Result<Vec<signal_hook::SigId>> {
    let mut ids = Vec::new();
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let stop = stop.clone();
        // SAFETY: the handler does one atomic add (`StopRequests::request`): no allocation,
        // no lock, async-signal-safe.
        let id = unsafe { signal_hook::low_level::register(sig, move || stop.request()) }
            .context("installing the Ctrl-C handler")?;
        ids.push(id);
    }
    Ok(ids)
}

/// Runs `vramguard reclaim`.
pub fn run(settings: &Settings, args: &ReclaimArgs) -> Result<i32> {
    let opts = options(args, settings)?;
    if settings.replay.is_some() {
        return replayed_dry_run(settings, args, opts);
    }
    let (reset, grace, release_timeout) = (args.reset, args.grace, args.release_timeout);
    check_own_proc(&settings.proc_root)?;

    let mut node = settings.node(&settings.config.policy, args.reset_command.as_deref())?;
    // `--gpu` is resolved against the snapshot the plan is made from, before planning.
    let planner = |snap: &vramguard_core::Snapshot, report: &Report| {
        Ok::<_, anyhow::Error>(plan_reclaim(
            snap,
            report,
            &resolve_gpus(&args.gpu, report, opts.clone())?,
        ))
    };
    let prepared =
        vramguard_ops::try_prepare(&mut node, &settings.config.policy, args.sample, planner)
            .map_err(|e| match e {
                vramguard_ops::reclaim::PrepareError::Node(e) => anyhow::Error::from(e),
                vramguard_ops::reclaim::PrepareError::Plan(e) => e,
            })?;
    let (plan, report) = (&prepared.plan, &prepared.report);

    let interactive = std::io::stdin().is_terminal();
    let dry = args.dry_run || (!args.yes && !interactive);
    if dry {
        print_dry_run(plan, report, args.json)?;
        return Ok(0);
    }
    if !args.json {
        crate::print(&render_plan(plan, report, false))?;
    }
    if plan.is_empty() && reset == ResetMode::Never {
        return nothing_to_signal(plan, report, args.json);
    }
    // Open the audit log before asking: no confirmation is wasted on a run that cannot log.
    let host = report.hostname.clone().unwrap_or_default();
    let mut audit = AuditLog::open(&args.audit_log, &host).with_context(
        || "no action is taken without an audit trail (choose another file with --audit-log)",
    )?;
    if !args.yes && !confirmed(plan, reset)? {
        eprintln!("nothing done");
        return Ok(2);
    }
    // A confirmation that took a while confirmed a plan whose targets may work by now: it is
    // made again, and only what both plans target is signalled.
    let mut replanning = None;
    let (prepared, dropped) = prepared.refreshed(&mut node, |snap, report| {
        planner(snap, report).unwrap_or_else(|e| {
            replanning = Some(e);
            Plan::default()
        })
    })?;
    if let Some(e) = replanning {
        return Err(e.context("nothing done: the confirmed plan could not be made again"));
    }
    for (pid, why) in &dropped {
        eprintln!("vramguard: pid {pid} left alone: {}", shown(why));
    }
    if prepared.plan.is_empty() && reset == ResetMode::Never {
        eprintln!("nothing done: no target of the confirmed plan is one any more");
        return Ok(2);
    }
    // From here on, Ctrl-C (or SIGTERM) asks the executor to finish what it started; a second
    // one stops it at once. Before, nothing was done and the default action is right.
    let stop = StopRequests::new();
    let handlers = stop_on_signals(&stop)?;
    let mut feedback =
        crate::progress::ReclaimFeedback::new(crate::progress::Feedback::for_output(args.json));
    let ran = prepared.run_observed(
        &mut node,
        &mut audit,
        &ExecuteOptions::new(grace, release_timeout, reset)
            .with_reset_lock(&settings.config.reclaim.reset_lock),
        &mut feedback,
        &stop,
    );
    drop(feedback);
    for id in handlers {
        signal_hook::low_level::unregister(id);
    }
    let outcome = match ran {
        Ok(outcome) => outcome,
        Err(e @ ExecuteError::Interrupted { .. }) => {
            eprintln!("vramguard: {e}");
            return Ok(INTERRUPTED_EXIT_CODE);
        }
        Err(e) => return Err(e.into()),
    };
    if args.json {
        crate::print_json(&outcome)?;
    } else {
        crate::print(&render_outcome(&outcome, audit.path()))?;
    }
    Ok(outcome.exit_code)
}
