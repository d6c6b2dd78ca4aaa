//! `vramguard demo`: a realistic incident on a simulated 2×H200 node, made of real processes.
//!
//! A training job (a process-group leader with two rank workers and a DataLoader worker) is
//! SIGKILLed and leaves its workers behind, re-parented to init; a benchmark dies and the
//! driver leaks its memory; an inference server and an idle Jupyter kernel keep running.
//! Then `diagnose` runs on it, and every process the demo started is killed, by pid and start
//! time, before it exits. Each holder also exits by itself after a few minutes, so even a
//! demo killed with SIGKILL leaves nothing behind for long.

use crate::cli::{DemoArgs, Global};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use vramguard_core::Policy;
use vramguard_core::report::Class;
use vramguard_core::units::format_bytes;
use vramguard_node::Node;
use vramguard_proc::ScanDepth;
use vramguard_sim::holder::{Hold, HolderSpec, Ready, Worker};
use vramguard_sim::state::AfterExit;

const GIB: u64 = 1 << 30;
const LIFETIME_MS: u64 = 5 * 60 * 1000;

/// Processes the demo started; all killed on drop.
#[derive(Default)]
struct Started {
    children: Vec<Child>,
    /// Grandchildren, by pid and start time: a pid reused meanwhile is left alone.
    others: Vec<(u32, Option<u64>)>,
}

/// The start time of a live (not zombie) process of the demo, read through our own `/proc`.
fn start_ticks(pid: u32) -> Option<u64> {
    let fs = vramguard_proc::ProcFs::own().ok()?;
    match fs.stat(pid) {
        Ok(vramguard_proc::Found::Yes(stat)) if stat.state != Some('Z') => stat.start_ticks,
        _ => None,
    }
}

impl Started {
    fn track(&mut self, pid: u32) {
        self.others.push((pid, start_ticks(pid)));
    }
    fn cleanup(&mut self) -> usize {
        let mut killed = 0;
        for c in &mut self.children {
            if matches!(c.try_wait(), Ok(None)) && c.kill().is_ok() {
                killed += 1;
            }
            let _ = c.wait();
        }
        self.children.clear();
        for (pid, start) in self.others.drain(..) {
            // Pinned first, then checked: a start time read before the kill(2) of a pid would
            // leave a window for the pid to go to another process (red team).
            if let Some(start) = start
                && let Ok(pinned) = vramguard_ops::identity::verify(
                    std::path::Path::new(vramguard_proc::OWN_PROC),
                    vramguard_ops::identity::Identity {
                        pid,
                        start_ticks: start,
                    },
                )
                && pinned.signal(rustix::process::Signal::KILL).is_ok()
            {
                killed += 1;
            }
        }
        killed
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        self.cleanup();
    }
}

fn argv(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| w.to_string()).collect()
}

fn spec(state: &Path, comm: &str, holds: Vec<Hold>) -> HolderSpec {
    HolderSpec {
        comm: Some(comm.into()),
        holds,
        ..HolderSpec::new(state.to_path_buf(), LIFETIME_MS)
    }
}

fn hold(gpu: u32, gib: u64, sm_util: u32) -> Hold {
    Hold {
        sm_util,
        ..Hold::on(gpu, gib * GIB)
    }
}

struct Demo {
    dir: PathBuf,
    started: Started,
    interrupted: Arc<AtomicBool>,
    next_ready: u32,
}

impl Demo {
    fn start(&mut self, argv: &[String], mut spec: HolderSpec) -> Result<Ready> {
        if self.interrupted.load(Ordering::Relaxed) {
            bail!("interrupted");
        }
        let ready = self.dir.join(format!("ready{}", self.next_ready));
        self.next_ready += 1;
        spec.ready_file = Some(ready.clone());
        let child = vramguard_sim::holder::spawn(argv, &spec)?;
        self.started.children.push(child);
        let r = vramguard_sim::holder::wait_ready(&ready, Duration::from_secs(20))?;
        for w in &r.workers {
            self.started.track(*w);
        }
        Ok(r)
    }

    fn kill(&mut self, pid: u32) -> Result<()> {
        let child = self
            .started
            .children
            .iter_mut()
            .find(|c| c.id() == pid)
            .context("demo process to kill")?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }
}

/// Runs the demo. Returns 0 when the scenario ran (whatever the diagnosis says about it).
pub fn run(_global: &Global, args: &DemoArgs) -> Result<i32> {
    let interrupted = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, interrupted.clone())?;
    }
    let tmp = tempfile::Builder::new()
        .prefix("vramguard-demo-")
        .tempdir()
        .context("creating the demo's temporary directory")?;
    let state = crate::simcmd::init_world(tmp.path(), 2)?;
    let mut demo = Demo {
        dir: tmp.path().to_path_buf(),
        started: Started::default(),
        interrupted: interrupted.clone(),
        next_ready: 0,
    };
    let say = |s: String| {
        if !args.json {
            println!("{s}");
        }
    };
    say(format!(
        "vramguard demo: a simulated node with 2×NVIDIA H200 and real processes (state: {})",
        state.display()
    ));

    let Incident {
        server_pid,
        kernel_pid,
        trainer_ready,
        bench_pid,
    } = start_incident(&mut demo, &state)?;

    say(format!(
        "  started  pid {server_pid}  vLLM server, 40 GiB on GPU 0\n  started  pid {}  python3 train.py (16 GiB on GPU 0), rank workers {} and {} (8 GiB each), DataLoader worker {}\n  started  pid {kernel_pid}  Jupyter kernel, 1 GiB on GPU 1, idle\n  started  pid {bench_pid}  all-reduce benchmark, 6 GiB on GPU 1",
        trainer_ready.pid,
        trainer_ready.workers[0],
        trainer_ready.workers[1],
        trainer_ready.workers[2]
    ));
    demo.kill(trainer_ready.pid)?;
    demo.kill(bench_pid)?;
    say(format!(
        "  SIGKILL  pid {} (the trainer crashed: its workers live on) and pid {bench_pid} (the driver leaks its 6 GiB)\n",
        trainer_ready.pid
    ));
    // Let the idle kernel pass the demo's 1-second idle threshold.
    std::thread::sleep(Duration::from_millis(1500));
    if interrupted.load(Ordering::Relaxed) {
        bail!("interrupted");
    }

    let policy = Policy {
        idle_after_secs: 1,
        ..Policy::default()
    };
    let diagnosis = look(&state, &policy, args)?;
    if args.reclaim && !args.json {
        reclaim_incident(&state, &policy, &demo.dir)?;
    }
    let killed = demo.started.cleanup();
    say(format!(
        "\ndemo: {} of ghost memory found; stopped the {killed} demo processes still running (the demo's own policy calls a holder idle after 1s; the default is 10m)",
        format_bytes(diagnosis.verdict.ghost_bytes)
    ));
    Ok(0)
}

/// The processes of the incident the demo stages.
struct Incident {
    server_pid: u32,
    kernel_pid: u32,
    trainer_ready: Ready,
    bench_pid: u32,
}

/// Starts the incident's processes on the simulated driver of `state`: an inference server,
/// an idle Jupyter kernel, a trainer with rank workers and a DataLoader worker, a benchmark.
fn start_incident(demo: &mut Demo, state: &Path) -> Result<Incident> {
    let mut server = spec(state, "python3", vec![hold(0, 40, 65)]);
    server.new_session = true;
    let server_argv = argv(&[
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "llama-3-70b",
    ]);
    let server_pid = demo.start(&server_argv, server)?.pid;

    let mut kernel = spec(state, "python3", vec![hold(1, 1, 0)]);
    kernel.new_session = true;
    let kernel_argv = argv(&[
        "python3",
        "-m",
        "ipykernel_launcher",
        "-f",
        "/run/user/1000/jupyter/kernel-7f3a.json",
    ]);
    let kernel_pid = demo.start(&kernel_argv, kernel)?.pid;

    let train_argv = argv(&["python3", "train.py", "--epochs", "10"]);
    // Contexts take 800 ms to tear down once their last holder exits, as big contexts do.
    let lagging = |gib| Hold {
        after_exit: Some(AfterExit::ReleaseAfterMs(800)),
        ..hold(0, gib, 0)
    };
    let mut trainer = spec(
        state,
        "python3",
        vec![Hold {
            sm_util: 90,
            ..lagging(16)
        }],
    );
    trainer.group_leader = true;
    let worker = |comm: &str, h: Hold| Worker {
        argv: train_argv.clone(),
        spec: spec(state, comm, vec![h]),
    };
    // Two rank workers with contexts of their own, and a DataLoader worker fork()ed after
    // cuInit: it inherits the trainer's context, which outlives the trainer while it lives
    // (the real driver then still lists the dead trainer with its 16 GiB).
    trainer.workers = vec![worker("python3", lagging(8)), worker("python3", lagging(8))];
    trainer.forked_workers = 1;
    let trainer_ready = demo.start(&train_argv, trainer)?;

    let mut bench = spec(
        state,
        "python3",
        vec![Hold {
            after_exit: Some(AfterExit::Leak),
            ..hold(1, 6, 0)
        }],
    );
    bench.new_session = true;
    let bench_pid = demo
        .start(&argv(&["python3", "bench_allreduce.py"]), bench)?
        .pid;

    Ok(Incident {
        server_pid,
        kernel_pid,
        trainer_ready,
        bench_pid,
    })
}

/// The node on the demo's simulated driver, at the default settings.
fn demo_node(state: &Path, policy: &Policy) -> Result<vramguard_node::MachineNode> {
    crate::settings::Settings::simulated(state)?.node(policy, None)
}

/// `status` and `diagnose` of the incident, as the commands print them (or the diagnosis as
/// JSON with `--json`).
fn look(
    state: &Path,
    policy: &Policy,
    args: &DemoArgs,
) -> Result<vramguard_core::diagnose::Diagnosis> {
    let mut node = demo_node(state, policy)?;
    // As `vramguard status` does: watch the processes work for half a second.
    let snap = node.sampled_snapshot(ScanDepth::Full, Duration::from_millis(500))?;
    let report = vramguard_core::classify(&snap, policy);
    if let Some(path) = &args.save_snapshot {
        let text = serde_json::to_vec_pretty(&snap)?;
        vramguard_fs::write_file(path, &text).map_err(|e| {
            anyhow::anyhow!("saving the snapshot to {}: {}", path.display(), e.reason())
        })?;
    }
    let style = crate::render::Style::new(crate::render::use_colour());
    if !args.json {
        println!(
            "$ vramguard status\n{}",
            crate::render::status(&report, &style)
        );
    }
    let diagnosis = vramguard_core::diagnose::diagnose(report);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&diagnosis)?);
    } else {
        print!(
            "$ vramguard diagnose\n{}",
            crate::render::diagnose(&diagnosis, &style)
        );
    }
    Ok(diagnosis)
}

/// The default reclaim (the dead job's holders; the reset of GPU 1 is refused while the idle
/// kernel holds it), then what diagnose says next for that blocker: the idle kernel, asked for
/// by name, and the reset goes through.
fn reclaim_incident(state: &Path, policy: &Policy, dir: &Path) -> Result<()> {
    reclaim_demo(
        state,
        policy,
        dir,
        "vramguard reclaim --yes --reset=auto",
        &Default::default(),
    )?;
    let idle = vramguard_core::plan::ReclaimOptions {
        gpus: Some([1].into_iter().collect()),
        include: [Class::Idle].into_iter().collect(),
        idle_for_secs: policy.idle_after_secs,
        mig_devices: None,
        job_of: None,
        job_label: None,
        include_shm: None,
        include_keepers: false,
    };
    let shown = format!(
        "vramguard reclaim --yes --gpu 1 --include idle --idle-for {} --reset=auto",
        vramguard_core::units::format_duration(Duration::from_secs(policy.idle_after_secs))
    );
    reclaim_demo(state, policy, dir, &shown, &idle)?;
    Ok(())
}

/// One reclaim of the incident, through the same planner and executor as `vramguard reclaim`:
/// plan (after a second of watching the processes work), execute with `--reset=auto`, print.
fn reclaim_demo(
    state: &Path,
    policy: &Policy,
    dir: &Path,
    shown: &str,
    opts: &vramguard_core::plan::ReclaimOptions,
) -> Result<()> {
    use crate::reclaim::{render_outcome, render_plan};
    use vramguard_ops::{AuditLog, ExecuteOptions, ResetMode};
    let mut node = demo_node(state, policy)?;
    let prepared =
        vramguard_ops::prepare(&mut node, policy, Duration::from_secs(1), |snap, report| {
            vramguard_core::plan::plan_reclaim(snap, report, opts)
        })?;
    let audit_path = dir.join("audit.jsonl");
    let host = prepared.report.hostname.clone().unwrap_or_default();
    let mut audit = AuditLog::open(&audit_path, &host)?;
    println!(
        "\n$ {shown}\n{}",
        render_plan(&prepared.plan, &prepared.report, false)
    );
    // The same live lines as `reclaim` prints.
    let mut feedback =
        crate::progress::ReclaimFeedback::new(crate::progress::Feedback::for_output(false));
    let outcome = prepared.run_observed(
        &mut node,
        &mut audit,
        &ExecuteOptions::new(
            Duration::from_secs(10),
            Duration::from_secs(20),
            ResetMode::Auto,
        ),
        &mut feedback,
        &vramguard_ops::StopRequests::new(),
    )?;
    drop(feedback);
    print!("{}", render_outcome(&outcome, &audit_path));
    Ok(())
}
