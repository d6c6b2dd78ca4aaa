//! `vramguard run -- CMD` and `vramguard pick N`.

use crate::cli::{GpuChoice, PickArgs, RunArgs};
use crate::context::Ctx;
use anyhow::{Result, bail};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use vramguard_core::Policy;
use vramguard_core::release::ReleaseWatch;
use vramguard_core::units::{format_bytes, format_duration};
use vramguard_gpu::GpuSource;
use vramguard_ops::supervise::{
    BlockedSignals, Isolation, SuperviseError, SuperviseOptions, Supervised, supervise,
};

/// Exit code when the GPUs asked for did not become free within `--wait`.
pub const EXIT_NO_GPUS: i32 = 124;
/// Exit code with `--strict` when the job's GPU memory was not released in time.
pub const EXIT_NOT_RELEASED: i32 = 125;

/// The `count` GPUs with the most free memory (at least `min_free`), in index order, waiting
/// up to `wait`. `Ok(None)`: not enough GPUs became free in time (the reason is printed).
fn choose_gpus(
    source: &mut dyn GpuSource,
    count: usize,
    choice: &GpuChoice,
) -> Result<Option<Vec<String>>> {
    if count == 0 {
        bail!("asked for 0 GPUs");
    }
    let min_free = choice.min_free.unwrap_or(0);
    let wait = choice.wait;
    let by_uuid = choice.by_uuid;
    let deadline = Instant::now() + wait;
    loop {
        let sample = source.sample(Duration::from_secs(1))?;
        let mut free: Vec<(u64, u32, Option<String>)> = sample
            .gpus
            .iter()
            .filter(|g| g.failure.is_none())
            .filter_map(|g| g.memory.map(|m| (m.free, g.index, g.uuid.clone())))
            .filter(|(f, _, _)| *f >= min_free)
            .collect();
        if free.len() >= count {
            free.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut chosen: Vec<(u32, Option<String>)> = free
                .into_iter()
                .take(count)
                .map(|(_, i, u)| (i, u))
                .collect();
            chosen.sort_by_key(|c| c.0);
            return Ok(Some(
                chosen
                    .into_iter()
                    .map(|(i, u)| {
                        if by_uuid {
                            u.unwrap_or_else(|| i.to_string())
                        } else {
                            i.to_string()
                        }
                    })
                    .collect(),
            ));
        }
        if Instant::now() >= deadline {
            eprintln!(
                "vramguard: only {} of {} GPU(s) have {} free; waited {}",
                free.len(),
                sample.gpus.len(),
                if min_free > 0 {
                    format!("at least {}", format_bytes(min_free))
                } else {
                    "memory".into()
                },
                format_duration(wait)
            );
            return Ok(None);
        }
        std::thread::sleep(
            Duration::from_millis(500).min(deadline.saturating_duration_since(Instant::now())),
        );
    }
}

/// `vramguard pick N`.
pub fn pick(ctx: &Ctx, args: &PickArgs) -> Result<i32> {
    let mut source = ctx.gpu_source()?;
    match choose_gpus(source.as_mut(), args.count, &args.choice)? {
        Some(ids) => {
            crate::print(&format!("{}\n", ids.join(",")))?;
            Ok(0)
        }
        None => Ok(1),
    }
}

#[derive(Debug, Clone, Default, Serialize)]
struct GpuUse {
    index: u32,
    uuid: Option<String>,
    total: u64,
    peak_job_bytes: u64,
    #[serde(skip)]
    last_used: u64,
    #[serde(skip)]
    last_job: u64,
    released: Option<bool>,
    release_ms: Option<u64>,
    still_held: Vec<String>,
}

/// Follows the job's GPU memory while it runs.
struct GpuTracker {
    source: Option<Box<dyn GpuSource>>,
    policy: Policy,
    gpus: BTreeMap<u32, GpuUse>,
}

impl GpuTracker {
    fn tick(&mut self, pids: &[u32]) {
        let Some(source) = self.source.as_mut() else {
            return;
        };
        let Ok(sample) = source.sample(Duration::from_secs(1)) else {
            return;
        };
        let job: BTreeSet<u32> = pids.iter().copied().collect();
        for g in &sample.gpus {
            let Some(mem) = g.memory else { continue };
            let job_bytes: u64 = g
                .processes
                .iter()
                .filter(|p| job.contains(&p.pid))
                .filter_map(|p| p.used_bytes)
                .sum();
            if job_bytes == 0 && !self.gpus.contains_key(&g.index) {
                continue;
            }
            let u = self.gpus.entry(g.index).or_insert_with(|| GpuUse {
                index: g.index,
                uuid: g.uuid.clone(),
                total: mem.total,
                ..GpuUse::default()
            });
            u.peak_job_bytes = u.peak_job_bytes.max(job_bytes);
            u.last_used = mem.used;
            u.last_job = job_bytes;
        }
    }

    /// Waits until the memory the job held last is free on every GPU it used.
    fn wait_release(&mut self, timeout: Duration, job_gone: Instant) {
        let Some(source) = self.source.as_mut() else {
            return;
        };
        let deadline = Instant::now() + timeout;
        let mut pending: BTreeMap<u32, ReleaseWatch> = self
            .gpus
            .iter()
            .filter(|(_, u)| u.last_job > 0)
            .map(|(i, u)| {
                let w = ReleaseWatch::new(*i, u.total, u.last_used, u.last_job, &self.policy);
                (*i, w)
            })
            .collect();
        for u in self.gpus.values_mut().filter(|u| u.last_job == 0) {
            u.released = Some(true);
        }
        while !pending.is_empty() {
            if let Ok(sample) = source.sample(Duration::from_secs(1)) {
                let after_ms = job_gone.elapsed().as_millis() as u64;
                for g in &sample.gpus {
                    let (Some(mem), Some(w)) = (g.memory, pending.get_mut(&g.index)) else {
                        continue;
                    };
                    if w.observe(mem.used, after_ms)
                        && let Some(u) = self.gpus.get_mut(&g.index)
                    {
                        u.released = Some(true);
                        u.release_ms = w.released_after_ms();
                        pending.remove(&g.index);
                    }
                }
            }
            if pending.is_empty() || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if pending.is_empty() {
            return;
        }
        for i in pending.keys() {
            if let Some(u) = self.gpus.get_mut(i) {
                u.released = Some(false);
            }
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
fn name_what_still_holds(ctx: &Ctx, tracker: &mut GpuTracker, not_released: &[u32]) {
    if let Ok((_, report)) = ctx.report(std::time::Duration::ZERO) {
        for g in report
            .gpus
            .iter()
            .filter(|g| not_released.contains(&g.index))
        {
            let u = tracker.gpus.get_mut(&g.index).expect("tracked");
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
    let mut line = format!(
        "vramguard run: `{command}` {} after {} ({})",
        match job.end {
            vramguard_ops::supervise::JobEnd::Exited(c) => format!("exited with {c}"),
            vramguard_ops::supervise::JobEnd::Signaled(s) => format!(
                "was killed by SIG{}",
                vramguard_ops::supervise::signal_name(s)
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
    for u in tracker.gpus.values() {
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
    if tracker.source.is_some() && tracker.gpus.is_empty() {
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

/// `vramguard run -- CMD`.
pub fn run(ctx: &Ctx, args: &RunArgs) -> Result<i32> {
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

    let (source, gpu_check) = match ctx.gpu_source() {
        Ok(s) => (Some(s), None),
        Err(e) if args.gpus.is_none() => {
            let why = match e.downcast_ref::<vramguard_gpu::SourceError>() {
                Some(vramguard_gpu::SourceError::NoDriver { .. }) => "no NVIDIA driver".to_string(),
                _ => format!("{e:#}"),
            };
            (None, Some(format!("GPU memory not checked ({why})")))
        }
        Err(e) => return Err(e),
    };
    let mut tracker = GpuTracker {
        source,
        policy: ctx.policy.clone(),
        gpus: BTreeMap::new(),
    };
    let mut env = Vec::new();
    let mut visible = None;
    if let Some(spec) = &args.gpus {
        let count: usize = spec
            .strip_prefix("auto:")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("--gpus {spec:?}: expected auto:N, e.g. auto:2"))?;
        let source = tracker.source.as_mut().expect("checked above");
        match choose_gpus(source.as_mut(), count, &args.choice)? {
            Some(ids) => {
                let value = ids.join(",");
                eprintln!("vramguard run: CUDA_VISIBLE_DEVICES={value}");
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
            eprintln!("vramguard run: cannot execute {program}: {cause}");
            return Ok(code);
        }
        Err(e) => return Err(e.into()),
    };
    let gone = Instant::now();
    tracker.wait_release(release_timeout, gone);

    let not_released: Vec<u32> = tracker
        .gpus
        .values()
        .filter(|u| u.released == Some(false))
        .map(|u| u.index)
        .collect();
    if !not_released.is_empty() {
        name_what_still_holds(ctx, &mut tracker, &not_released);
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
            gpus: tracker.gpus.values().cloned().collect(),
            gpu_check,
        };
        vramguard_fs::write_file(path, &serde_json::to_vec_pretty(&summary)?)
            .map_err(|e| anyhow::anyhow!("writing {}: {}", path.display(), e.reason()))?;
    }
    Ok(code)
}
