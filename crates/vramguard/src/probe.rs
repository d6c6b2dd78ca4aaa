//! `vramguard probe ...`.

use crate::cli::{ProbeCommand, ProbeCommon};
use crate::settings::Settings;
use anyhow::{Context, Result, anyhow, bail};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use vramguard_core::snapshot::{GpuMemory, GpuSample};
use vramguard_core::units::format_bytes;
use vramguard_probe::experiments::{self, Probe};
use vramguard_probe::holders::{HoldRequest, HolderError, HolderKind, Started};
use vramguard_probe::report::{self, GpuInfo, ProbeReport, Results};
use vramguard_probe::sampler::Sampler;

fn signal(name: &str) -> Result<(String, i32)> {
    let n = name.trim().trim_start_matches("SIG").to_ascii_uppercase();
    let num = match n.as_str() {
        "TERM" => libc::SIGTERM,
        "INT" => libc::SIGINT,
        "KILL" => libc::SIGKILL,
        "HUP" => libc::SIGHUP,
        "QUIT" => libc::SIGQUIT,
        "USR1" => libc::SIGUSR1,
        "USR2" => libc::SIGUSR2,
        _ => bail!("unknown signal {name:?} (use TERM, INT, KILL, HUP, QUIT, USR1, USR2)"),
    };
    Ok((n, num))
}

/// Runs a probe. Exit 0: every holder's memory came back (and no rising trend); 1: something
/// was left behind; 2: error.
pub fn run(settings: &Settings, cmd: &ProbeCommand) -> Result<i32> {
    let common: &ProbeCommon = match cmd {
        ProbeCommand::Release { common, .. }
        | ProbeCommand::Concurrent { common, .. }
        | ProbeCommand::Soak { common, .. } => common,
        ProbeCommand::Calls {
            gpu,
            samples,
            timeout,
            json,
        } => return calls(settings, gpu, *samples, *timeout, *json),
    };
    let (bytes, timeout) = (common.size, common.timeout);
    if common.rate == 0 || common.rate > 10_000 {
        bail!(
            "--rate {}: between 1 and 10000 readings per second",
            common.rate
        );
    }
    let period = Duration::from_secs_f64(1.0 / common.rate as f64);
    let count = match cmd {
        ProbeCommand::Concurrent { workers, .. } => *workers as u64,
        _ => 1,
    };
    let mut source = settings.gpu_source()?;
    let sample = source.sample(Duration::from_secs(1))?;
    let (g, mem) = probed_gpu(&sample.gpus, &common.gpu, bytes, count)?;
    let gpu = g.index;
    let (holders, holder_name) = holder_kind(settings, common, g)?;
    let gpu_info = GpuInfo {
        index: g.index,
        name: g.name.clone(),
        uuid: g.uuid.clone(),
        pci_bus_id: g.pci_bus_id.clone(),
        total: Some(mem.total),
    };
    let driver_version = sample
        .driver
        .driver_version
        .clone()
        .map(|v| match sample.driver.source {
            vramguard_core::snapshot::DriverSource::Simulated => format!("{v} (simulated)"),
            _ => v,
        });
    let scratch = tempfile::Builder::new()
        .prefix("vramguard-probe-")
        .tempdir()?;
    let epoch = Instant::now();
    let probe = Probe {
        sampler: Sampler::start(source, gpu, period, epoch),
        holders,
        gpu,
        scratch: scratch.path().to_path_buf(),
        epoch,
        timeout,
    };
    let results = experiment(&probe, cmd, bytes, common.json)?;
    let (_, samples) = probe.sampler.stop();
    let left_behind = match &results {
        Results::Release { trials } => trials.iter().any(|t| !t.released),
        Results::Concurrent(c) => c.leftover_bytes > 0,
        Results::Soak(s) => s.trend_bytes_per_hour.is_some_and(|t| t.rising()),
    };
    let rep = ProbeReport {
        schema_version: vramguard_core::SCHEMA_VERSION,
        // args_os: an argument that is not UTF-8 (a --report directory) is shown, not a panic.
        command: std::env::args_os()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" "),
        hostname: vramguard_proc::ProcFs::own()
            .ok()
            .and_then(|fs| fs.hostname()),
        driver_version,
        gpu: gpu_info,
        holder: holder_name,
        bytes,
        period_ms: period.as_secs_f64() * 1000.0,
        achieved_hz: report::achieved_hz(&samples),
        results,
        samples: samples.iter().map(|s| (s.t_ms, s.used)).collect(),
    };
    publish(common, &rep)?;
    Ok(if left_behind { 1 } else { 0 })
}

/// The probed GPU and its memory, checked: it exists, can be read, and `count` holders of
/// `bytes` fit in its free memory.
fn probed_gpu<'a>(
    gpus: &'a [GpuSample],
    selector: &crate::gpusel::GpuSelector,
    bytes: u64,
    count: u64,
) -> Result<(&'a GpuSample, GpuMemory)> {
    let named: Vec<crate::gpusel::NamedGpu<'_>> = gpus
        .iter()
        .map(|g| crate::gpusel::NamedGpu {
            index: g.index,
            uuid: g.uuid.as_deref(),
            mig_uuids: &[],
        })
        .collect();
    let selection = crate::gpusel::resolve(std::slice::from_ref(selector), &named)?;
    let g = gpus
        .iter()
        .find(|g| selection.gpus.contains(&g.index))
        .expect("a resolved GPU is one of the list");
    if let Some(f) = &g.failure {
        bail!("GPU {} cannot be read: {f}", g.index);
    }
    let mem = g
        .memory
        .ok_or_else(|| anyhow!("GPU {}: memory unknown", g.index))?;
    if bytes.saturating_mul(count) > mem.free {
        bail!(
            "GPU {} has {} free; {} × {} does not fit (choose a smaller --size)",
            g.index,
            format_bytes(mem.free),
            count,
            format_bytes(bytes)
        );
    }
    Ok((g, mem))
}

/// The holders: the simulator's with `--sim`, the user's command with `--holder-cmd`, else
/// the built-in CUDA holder (which needs `libcuda.so.1`); and how the report names them.
fn holder_kind(
    settings: &Settings,
    common: &ProbeCommon,
    g: &GpuSample,
) -> Result<(HolderKind, String)> {
    let exe = std::env::current_exe().context("locating the vramguard executable")?;
    if let Some(state) = settings.driver.sim_state() {
        // The simulator's holders report their pids as its `proc_root` numbers them, and
        // the probe signals them: another namespace's numbers would name other processes here.
        let proc_root = vramguard_sim::state::SimState::load(state)
            .with_context(|| format!("reading {}", state.display()))?
            .proc_root;
        let own = vramguard_proc::ProcFs::open(&proc_root).is_ok_and(|fs| fs.is_own_namespace());
        if !own {
            bail!(
                "probe starts and signals holders, so the simulated driver's proc_root must be \
                 this PID namespace's /proc; {} is not (run the probe in the namespace whose \
                 /proc the state names)",
                vramguard_core::sanitize::shown(&proc_root.display().to_string())
            );
        }
    }
    Ok(match (settings.driver.sim_state(), &common.holder_cmd) {
        (Some(state), _) => (
            HolderKind::Spawner(Arc::new(sim_holders(exe, state.to_path_buf()))),
            "simulated".to_string(),
        ),
        (None, Some(cmd)) => (
            HolderKind::Command {
                cmd: format!("exec {cmd}"),
                device: g.uuid.clone().unwrap_or_else(|| g.index.to_string()),
            },
            format!("command: {cmd}"),
        ),
        (None, None) => {
            vramguard_probe::cuda::load_cuda()?;
            let bus = g
                .pci_bus_id
                .clone()
                .ok_or_else(|| anyhow!("GPU {}: PCI bus id unknown", g.index))?;
            (
                HolderKind::Cuda {
                    exe,
                    pci_bus_id: bus,
                },
                "cuda (built-in)".to_string(),
            )
        }
    })
}

/// Where an experiment's progress goes: stderr; with `--json`, only when stderr is a terminal.
fn feedback(json: bool) -> crate::progress::Feedback {
    if json {
        crate::progress::Feedback::for_output(true)
    } else {
        crate::progress::Feedback::on_stderr()
    }
}

/// Runs the experiment `cmd` names, showing its progress on stderr (with `--json`, only when
/// stderr is a terminal).
fn experiment(probe: &Probe, cmd: &ProbeCommand, bytes: u64, json: bool) -> Result<Results> {
    Ok(match cmd {
        ProbeCommand::Release {
            signals,
            repeat,
            children,
            ..
        } => {
            let sigs: Vec<(String, i32)> =
                signals.iter().map(|s| signal(s)).collect::<Result<_>>()?;
            let mut progress = crate::progress::StepFeedback::start(
                feedback(json),
                "release",
                &format!(
                    "{} trial(s): {} × {repeat}",
                    sigs.len() * *repeat as usize,
                    sigs.iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            );
            Results::Release {
                trials: experiments::release(
                    probe,
                    bytes,
                    &sigs,
                    *repeat,
                    *children,
                    &mut |t, done, total| {
                        let back = t
                            .release_ms
                            .map(|ms| format!("memory back {ms:.0} ms after SIG{}", t.signal))
                            .unwrap_or_else(|| format!("memory NOT back after SIG{}", t.signal));
                        progress.step(done, total, &back);
                    },
                )?,
            }
        }
        ProbeCommand::Concurrent {
            workers,
            kill,
            signal: sig,
            seed,
            ..
        } => {
            let random = match kill.as_str() {
                "random" => true,
                "sequential" => false,
                other => bail!("--kill {other:?}: random or sequential"),
            };
            let seed = seed.unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
            let mut progress = crate::progress::StepFeedback::start(
                feedback(json),
                "concurrent",
                &format!("{workers} holders, killed one by one ({kill})"),
            );
            Results::Concurrent(experiments::concurrent(
                probe,
                bytes,
                *workers,
                random,
                seed,
                signal(sig)?.1,
                &mut |k, done, total| {
                    let back = k
                        .release_ms
                        .map(|ms| format!("pid {}: memory back {ms:.0} ms after the signal", k.pid))
                        .unwrap_or_else(|| format!("pid {}: memory NOT back", k.pid));
                    progress.step(done, total, &back);
                },
            )?)
        }
        ProbeCommand::Calls { .. } => bail!("probe calls holds no memory: it is no experiment"),
        ProbeCommand::Soak {
            duration,
            cycle,
            kill_cycles,
            ..
        } => {
            let sigs = if *kill_cycles {
                vec![signal("TERM")?, signal("KILL")?, signal("INT")?]
            } else {
                vec![signal("TERM")?]
            };
            let mut progress =
                crate::progress::SoakFeedback::start(feedback(json), *duration, *cycle);
            Results::Soak(experiments::soak(
                probe,
                bytes,
                *duration,
                *cycle,
                &sigs,
                &mut |c, elapsed| progress.cycle(c, elapsed),
            )?)
        }
    })
}

/// Prints the report (Markdown, or JSON with `--json`) and writes its files with `--report`.
fn publish(common: &ProbeCommon, rep: &ProbeReport) -> Result<()> {
    if common.json {
        crate::print_json(rep)?;
    } else {
        crate::print(&report::markdown(rep))?;
    }
    if let Some(dir) = &common.report {
        let files = report::write(dir, rep)?;
        if !common.json {
            let names: Vec<String> = files
                .iter()
                .map(|f| vramguard_core::sanitize::shown(&f.display().to_string()))
                .collect();
            crate::print(&format!("\nreport: {}\n", names.join(", ")))?;
        }
    }
    Ok(())
}

/// Simulated holders: this executable as a holder process (the simulator's holder protocol),
/// registering its allocation and its children with the model in `state`.
fn sim_holders(
    exe: PathBuf,
    state: PathBuf,
) -> impl Fn(&HoldRequest<'_>) -> Result<Started, HolderError> + Send + Sync {
    use std::sync::atomic::{AtomicU64, Ordering};
    use vramguard_sim::holder::{Hold, HolderSpec, spawn_with, wait_ready};
    let next = AtomicU64::new(0);
    move |req| {
        let ready = req.scratch.join(format!(
            "probe-holder-{}-{}",
            std::process::id(),
            next.fetch_add(1, Ordering::Relaxed)
        ));
        let lifetime_ms = req.lifetime.as_millis() as u64;
        // Children forked after the context was created, as the CUDA holder forks them: they
        // share its device files' open file descriptions, and so keep its context.
        let spec = HolderSpec {
            comm: Some("probe-holder".into()),
            holds: vec![Hold::on(req.gpu, req.bytes)],
            group_leader: true,
            forked_workers: req.children,
            ready_file: Some(ready.clone()),
            ..HolderSpec::new(state.clone(), lifetime_ms)
        };
        let child = spawn_with(&exe, &["probe-holder"], &spec)
            .map_err(|e| HolderError::Spawner(e.to_string()))?;
        let r = wait_ready(&ready, Duration::from_secs(20))
            .map_err(|e| HolderError::Spawner(e.to_string()))?;
        let _ = std::fs::remove_file(&ready);
        Ok(Started {
            child,
            pid: r.pid,
            children: r.workers,
        })
    }
}

/// `probe calls`: what each NVML call of one sample costs on this driver. Exit 0, or 2 when
/// the GPU cannot be read or the samples outlast `timeout`.
fn calls(
    settings: &Settings,
    selector: &crate::gpusel::GpuSelector,
    samples: u32,
    timeout: Duration,
    json: bool,
) -> Result<i32> {
    if !(1..=100_000).contains(&samples) {
        bail!("--samples {samples}: between 1 and 100000");
    }
    let window = Duration::from_secs(settings.config.policy.idle_after_secs.max(1));
    let reader = settings.gpu_reader()?;
    let chosen = selector.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    // On its own thread: a call stuck in the driver ends the measurement at `timeout`, not
    // never (the thread is left behind, and the process exits).
    std::thread::Builder::new()
        .name("probe-calls".into())
        .spawn(move || {
            let _ = tx.send(time_selected(reader.as_ref(), &chosen, samples, window));
        })?;
    let (cost, driver) = match rx.recv_timeout(timeout) {
        Ok(result) => result?,
        Err(_) => bail!(
            "GPU {selector}: {samples} samples took longer than {}: a call is stuck in the \
             driver (check `nvidia-smi` and `dmesg | grep -i -e xid -e nvrm`), or ask for \
             fewer --samples",
            vramguard_core::units::format_duration(timeout)
        ),
    };
    let version = driver
        .driver_version
        .as_deref()
        .map(vramguard_core::sanitize::shown);
    if json {
        let out = serde_json::json!({
            "schema_version": vramguard_core::SCHEMA_VERSION,
            "driver_version": version,
            "simulated": driver.source == vramguard_core::snapshot::DriverSource::Simulated,
            "cost": cost,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", render_calls(&cost, version.as_deref()));
    }
    Ok(0)
}

/// Resolves `--gpu` against the driver's GPUs (their UUIDs asked one by one) and times its
/// calls: all of it inside `probe calls`' time limit.
fn time_selected(
    reader: &dyn vramguard_gpu::GpuReader,
    selector: &crate::gpusel::GpuSelector,
    samples: u32,
    window: Duration,
) -> Result<(
    vramguard_gpu::timing::SampleCost,
    vramguard_core::snapshot::DriverFacts,
)> {
    let head = reader.head()?;
    let uuids: Vec<Option<String>> = (0..head.count)
        .map(|index| {
            let mut uuid = None;
            let _ = reader.with_device(index, &mut |dev| uuid = dev.uuid().ok());
            uuid
        })
        .collect();
    let named: Vec<crate::gpusel::NamedGpu<'_>> = uuids
        .iter()
        .zip(0..)
        .map(|(uuid, index)| crate::gpusel::NamedGpu {
            index,
            uuid: uuid.as_deref(),
            mig_uuids: &[],
        })
        .collect();
    let selection = crate::gpusel::resolve(std::slice::from_ref(selector), &named)?;
    let gpu = *selection
        .gpus
        .iter()
        .next()
        .ok_or_else(|| anyhow!("--gpu {selector}: no such GPU"))?;
    let cost = vramguard_gpu::timing::time_calls(reader, gpu, samples, window)?;
    Ok((cost, head.driver))
}

/// The call table of `probe calls`, most expensive per sample first.
fn render_calls(cost: &vramguard_gpu::timing::SampleCost, driver: Option<&str>) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "NVML calls of one sample of GPU {} (driver {}), {} sample(s), µs:\n",
        cost.gpu,
        driver.unwrap_or("unknown"),
        cost.samples
    );
    let width = cost
        .calls
        .iter()
        .map(|c| c.call.chars().count())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(
        out,
        "{:<width$}  {:>7}  {:>9}  {:>9}  {:>9}  {:>10}  answers",
        "call", "calls", "median", "p90", "max", "per sample"
    );
    for c in &cost.calls {
        let mut answers = Vec::new();
        if c.not_supported > 0 {
            answers.push(format!("{} not supported", c.not_supported));
        }
        if c.not_found > 0 {
            answers.push(format!("{} no sample in the window", c.not_found));
        }
        for (what, n) in &c.failed {
            answers.push(format!(
                "{n} failed: {}",
                vramguard_core::sanitize::shown(what)
            ));
        }
        let answers = if answers.is_empty() {
            "ok".to_string()
        } else {
            answers.join(", ")
        };
        let _ = writeln!(
            out,
            "{:<width$}  {:>7}  {:>9.1}  {:>9.1}  {:>9.1}  {:>10.1}  {answers}",
            c.call, c.calls, c.median_us, c.p90_us, c.max_us, c.per_sample_us
        );
    }
    let _ = writeln!(
        out,
        "every call of one sample: {:.1} µs (median); the driver-wide calls: {:.1} µs; the GPU \
         read as each sample of vramguard reads it, Xid events included: {:.1} µs; as the \
         agent's quiet samples read it (UUID, memory, process lists, Xid events): {:.1} µs",
        cost.calls_median_us, cost.head_median_us, cost.read_median_us, cost.settled_read_median_us
    );
    out
}
