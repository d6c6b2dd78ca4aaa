//! `vramguard run -- CMD` and `vramguard pick N`.

use crate::cli::{GpuChoice, PickArgs, RunArgs};
use crate::settings::Settings;
use anyhow::{Result, bail};
use serde::Serialize;
use std::time::Duration;
use vramguard_core::units::{format_bytes, format_duration};
use vramguard_node::Node;
use vramguard_ops::gpus::{GpuUse, JobGpus, PickOptions, Picked, pick};
use vramguard_ops::supervise::{
    BlockedSignals, Isolation, SuperviseError, SuperviseOptions, Supervised, supervise,
};

/// Exit code when the GPUs asked for did not become free within `--wait`.
pub const EXIT_NO_GPUS: i32 = 124;
/// Exit code with `--strict` when the job's GPU memory was not released in time.
pub const EXIT_NOT_RELEASED: i32 = 125;

/// The options of `pick` and `run --gpus auto:N`.
fn pick_options(count: usize, choice: &GpuChoice) -> Result<PickOptions> {
    if count == 0 {
        bail!("asked for 0 GPUs");
    }
    Ok(PickOptions {
        count,
        min_free: choice.min_free.unwrap_or(0),
        wait: choice.wait,
        by_uuid: choice.by_uuid,
    })
}

/// Picks GPUs; `None` (with the reason printed) when not enough became free in time.
fn choose_gpus(node: &mut dyn Node, opts: &PickOptions) -> Result<Option<Vec<String>>> {
    match pick(node, opts)? {
        Picked::Chosen(ids) => Ok(Some(ids)),
        Picked::TooFew { gpus } => anyhow::bail!(
            "asked for {} GPU(s), but this node has {gpus}: ask for at most {gpus}",
            opts.count
        ),
        Picked::NotEnough { free, gpus } => {
            eprintln!(
                "vramguard: only {free} of {gpus} GPU(s) have {} free; waited {}",
                if opts.min_free > 0 {
                    format!("at least {}", format_bytes(opts.min_free))
                } else {
                    "memory".into()
                },
                format_duration(opts.wait)
            );
            Ok(None)
        }
    }
}

/// `vramguard pick N`.
pub fn pick_command(settings: &Settings, args: &PickArgs) -> Result<i32> {
    let opts = pick_options(args.count, &args.choice)?;
    let mut node = settings.node(&settings.config.policy, None)?;
    match choose_gpus(&mut node, &opts)? {
        Some(ids) => {
            crate::print(&format!("{}\n", ids.join(",")))?;
            Ok(0)
        }
        None => Ok(1),
    }
}

/// The job's GPUs, followed on the node when there is one.
struct GpuTracker {
    node: Option<Box<dyn Node>>,
    job: JobGpus,
}

impl GpuTracker {
    fn tick(&mut self, pids: &[u32]) {
        if let Some(node) = self.node.as_mut() {
            self.job.tick(node.as_mut(), pids);
        }
    }
}

#[derive(Debug, Serialize)]
struct RunSummary<'a> {
    schema_version: u32,
    command: String,
    exit_code: i32,
    job: &'a Supervised,
    cuda_visible_devices: Option<String>,
    gpus: Vec<GpuUse>,
    gpu_check: Option<String>,
}

/// Says what still holds the memory of the GPUs not released, from a fresh look at the
/// machine.
fn name_what_still_holds(settings: &Settings, tracker: &mut GpuTracker, not_released: &[u32]) {
    if let Ok((_, report)) = settings.report(std::time::Duration::ZERO) {
        for g in report
            .gpus
            .iter()
            .filter(|g| not_released.contains(&g.index))
        {
            let u = tracker.job.gpus.get_mut(&g.index).expect("tracked");
            for h in g
                .holders
                .iter()
                .filter(|h| h.class != vramguard_core::Class::Active)
            {
                u.still_held.push(format!(
                    "pid {} ({}, {})",
                    h.pid,
                    vramguard_core::sanitize::escape(h.comm.as_deref().unwrap_or("?")),
                    h.class
                ));
            }
            if let Some(un) = g.unaccounted.as_ref().filter(|u| u.significant) {
                u.still_held.push(format!(
                    "{} unaccounted: {}",
                    format_bytes(un.bytes),
                    un.explanation.get(1).cloned().unwrap_or_default()
                ));
            }
        }
    }
}

/// The one line `run` prints when the job is over.
fn summary_line(
    command: &str,
    job: &Supervised,
    tracker: &GpuTracker,
    release_timeout: Duration,
    gpu_check: Option<&str>,
) -> String {
    // The job's command line is shown escaped: it may carry what a job's author put there.
    let mut line = format!(
        "vramguard run: `{}` {} after {} ({})",
        vramguard_core::sanitize::shown(command),
        match job.end {
            vramguard_ops::supervise::JobEnd::Exited(c) => format!("exited with {c}"),
            vramguard_ops::supervise::JobEnd::Signaled(s) => format!(
                "was killed by {}",
                vramguard_ops::supervise::describe_signal(s)
            ),
        },
        format_duration(Duration::from_millis(job.runtime_ms)),
        match job.isolation {
            Isolation::Cgroup => "cgroup",
            _ => "process group",
        }
    );
    if job.leftovers > 0 {
        line.push_str(&format!(
            "; {} leftover process(es) stopped{}",
            job.leftovers,
            if job.killed_after_grace {
                " (SIGKILL after the grace period)"
            } else {
                " by SIGTERM"
            }
        ));
    }
    if !job.stuck.is_empty() {
        line.push_str(&format!(
            "; survived SIGKILL (D state): {}",
            job.stuck.join(", ")
        ));
    }
    for u in tracker.job.gpus.values() {
        line.push_str(&format!(
            "; GPU {}: peak {}",
            u.index,
            format_bytes(u.peak_job_bytes)
        ));
        match (u.released, u.release_ms) {
            (Some(true), Some(ms)) => line.push_str(&format!(
                ", released {} after the job ended",
                format_duration(Duration::from_millis(ms))
            )),
            (Some(true), None) => line.push_str(", released"),
            (Some(false), _) => line.push_str(&format!(
                ", NOT released after {}: {}",
                format_duration(release_timeout),
                if u.still_held.is_empty() {
                    "no holder found".into()
                } else {
                    u.still_held.join(", ")
                }
            )),
            (None, _) => {}
        }
    }
    if tracker.node.is_some() && tracker.job.gpus.is_empty() {
        line.push_str("; the job used no GPU");
    }
    if let Some(note) = gpu_check {
        line.push_str(&format!("; {note}"));
    }
    if let Some(note) = &job.isolation_note {
        line.push_str(&format!("; {note}"));
    }
    line
}

/// The tracker of the job's GPU memory, on the node when there is one; without a driver
/// (when no GPU choice needs one), why not, for the summary.
fn job_tracker(settings: &Settings, args: &RunArgs) -> Result<(GpuTracker, Option<String>)> {
    let (node, gpu_check): (Option<Box<dyn Node>>, _) = match settings
        .node(&settings.config.policy, None)
    {
        Ok(n) => (Some(Box::new(n)), None),
        Err(e) if args.gpus.is_none() => {
            let why = match e.downcast_ref::<vramguard_gpu::SourceError>() {
                Some(vramguard_gpu::SourceError::NoDriver { .. }) => "no NVIDIA driver".to_string(),
                _ => format!("{e:#}"),
            };
            (None, Some(format!("GPU memory not checked ({why})")))
        }
        Err(e) => return Err(e),
    };
    let tracker = GpuTracker {
        node,
        job: JobGpus::new(settings.config.policy.clone()),
    };
    Ok((tracker, gpu_check))
}

/// `--gpus auto:N`: the GPUs picked, as `CUDA_VISIBLE_DEVICES`; `None` when not enough
/// became free in time.
fn pick_for_job(node: &mut dyn Node, spec: &str, choice: &GpuChoice) -> Result<Option<String>> {
    let count: usize = spec
        .strip_prefix("auto:")
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("--gpus {spec:?}: expected auto:N, e.g. auto:2"))?;
    let opts = pick_options(count, choice)?;
    Ok(choose_gpus(node, &opts)?.map(|ids| ids.join(",")))
}

/// `vramguard run -- CMD`.
pub fn run(settings: &Settings, args: &RunArgs) -> Result<i32> {
    // Before any thread exists (an NVML library may start some): no thread may receive the
    // signals meant for the job with their default, fatal, dispositions.
    let _blocked = BlockedSignals::block();
    let (grace, release_timeout) = (args.grace, args.release_timeout);
    let isolation = args.isolation;
    let command = args
        .command
        .iter()
        .map(|a| a.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ");

    let (mut tracker, gpu_check) = job_tracker(settings, args)?;
    let mut env = Vec::new();
    let mut visible = None;
    if let Some(spec) = &args.gpus {
        let node = tracker
            .node
            .as_mut()
            .expect("job_tracker fails without one");
        match pick_for_job(node.as_mut(), spec, &args.choice)? {
            Some(value) => {
                eprintln!(
                    "vramguard run: CUDA_VISIBLE_DEVICES={}",
                    vramguard_core::sanitize::escape(&value)
                );
                env.push(("CUDA_VISIBLE_DEVICES".into(), value.clone().into()));
                visible = Some(value);
            }
            None => return Ok(EXIT_NO_GPUS),
        }
    }
    let opts = SuperviseOptions {
        argv: args.command.clone(),
        env,
        grace,
        signal_group: !args.no_signal_group,
        isolation,
        watchdog: std::env::current_exe().ok(),
        tick: Duration::from_millis(250),
    };
    let job = match supervise(&opts, &mut |pids| tracker.tick(pids)) {
        Ok(j) => j,
        Err(SuperviseError::Spawn {
            program,
            cause,
            code,
        }) => {
            eprintln!(
                "vramguard run: cannot execute {}: {cause}",
                vramguard_core::sanitize::shown(&program)
            );
            return Ok(code);
        }
        Err(e) => return Err(e.into()),
    };
    let not_released = match tracker.node.as_mut() {
        Some(node) => {
            let gone = node.clock().now();
            tracker
                .job
                .wait_release(node.as_mut(), release_timeout, gone)
        }
        None => Vec::new(),
    };
    if !not_released.is_empty() {
        name_what_still_holds(settings, &mut tracker, &not_released);
    }

    eprintln!(
        "{}",
        summary_line(
            &command,
            &job,
            &tracker,
            release_timeout,
            gpu_check.as_deref()
        )
    );

    let mut code = job.end.exit_code();
    if args.strict && !not_released.is_empty() {
        code = EXIT_NOT_RELEASED;
    }
    if let Some(path) = &args.summary_json {
        let summary = RunSummary {
            schema_version: vramguard_core::SCHEMA_VERSION,
            command,
            exit_code: code,
            job: &job,
            cuda_visible_devices: visible,
            gpus: tracker.job.gpus.values().cloned().collect(),
            gpu_check,
        };
        vramguard_fs::write_file(path, &serde_json::to_vec_pretty(&summary)?)
            .map_err(|e| anyhow::anyhow!("writing {}: {}", path.display(), e.reason()))?;
    }
    Ok(code)
}
