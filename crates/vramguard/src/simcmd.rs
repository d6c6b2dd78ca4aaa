//! `vramguard sim ...`: drive the simulated driver by hand.

use crate::cli::{Global, HoldArgs, SimCommand};
use anyhow::{Context, Result, anyhow, bail};
use std::path::{Path, PathBuf};
use vramguard_core::units::{format_bytes, parse_duration};
use vramguard_sim::holder::{self, Hold, HolderSpec, Worker};
use vramguard_sim::state::{AfterExit, SimRemappedRows, SimState};
use vramguard_sim::{Sim, store};

fn state_path(global: &Global) -> Result<&Path> {
    global.sim.as_deref().ok_or_else(|| {
        anyhow!(
            "no simulator state: pass --sim STATE or set VRAMGUARD_SIM (create one with \
             `vramguard sim init`)"
        )
    })
}

/// Writes a fresh state with `gpus` H200s and its device files into `dir`.
pub fn init_world(dir: &Path, gpus: u32) -> Result<PathBuf> {
    let dev = dir.join("dev");
    store::create_dev_dir(&dev, gpus as usize)
        .with_context(|| format!("creating {}", dev.display()))?;
    let dir = std::fs::canonicalize(dir)?;
    let state = SimState::with_h200s(dir.join("dev"), gpus);
    let path = dir.join("state.json");
    store::write_state(&path, &state)?;
    let _ = std::fs::remove_file(vramguard_sim::model::runtime_path(&path));
    Ok(path)
}

/// Parses `release`, `leak` or `lag:1500ms`.
pub fn parse_after_exit(s: &str) -> Result<AfterExit> {
    match s {
        "release" => Ok(AfterExit::Release),
        "leak" => Ok(AfterExit::Leak),
        _ => match s.strip_prefix("lag:") {
            Some(d) => Ok(AfterExit::ReleaseAfterMs(
                parse_duration(d)?.as_millis() as u64
            )),
            None => bail!(
                "--after-exit {s:?}: expected release, leak or lag:DURATION (e.g. lag:1500ms)"
            ),
        },
    }
}

fn hold(global: &Global, args: &HoldArgs) -> Result<i32> {
    let state = state_path(global)?.to_path_buf();
    let (lifetime, bytes, worker_bytes) = (args.lifetime, args.bytes, args.worker_bytes);
    let me: Vec<String> = std::env::args().collect();
    let lifetime_ms = lifetime.as_millis() as u64;
    let workers = (0..args.workers)
        .map(|_| Worker {
            argv: me.clone(),
            spec: HolderSpec {
                comm: args.comm.clone(),
                holds: vec![Hold::on(args.gpu, worker_bytes)],
                ..HolderSpec::new(state.clone(), lifetime_ms)
            },
        })
        .collect();
    eprintln!(
        "vramguard sim hold: pid {} holds {} on simulated GPU {}{}{}; stop it with Ctrl-C or kill {}",
        std::process::id(),
        format_bytes(bytes),
        args.gpu,
        if args.workers > 0 {
            format!(
                " with {} spawned worker(s) of {} each",
                args.workers,
                format_bytes(worker_bytes)
            )
        } else {
            String::new()
        },
        if args.forked_workers > 0 {
            format!(
                " and {} forked worker(s) sharing its context",
                args.forked_workers
            )
        } else {
            String::new()
        },
        std::process::id()
    );
    holder::run(HolderSpec {
        comm: args.comm.clone(),
        holds: vec![Hold {
            after_exit: Some(parse_after_exit(&args.after_exit)?),
            listed: !args.unlisted,
            sm_util: args.sm_util,
            ..Hold::on(args.gpu, bytes)
        }],
        group_leader: true,
        workers,
        forked_workers: args.forked_workers,
        ..HolderSpec::new(state, lifetime_ms)
    })?;
    Ok(0)
}

/// Fails unless the state has GPU `gpu`.
fn check_gpu(path: &Path, gpu: u32) -> Result<()> {
    let count = SimState::load(path)?.gpus.len();
    if gpu as usize >= count {
        bail!(
            "--gpu {gpu}: the simulated node has {count} GPU(s) (0 to {})",
            count - 1
        );
    }
    Ok(())
}

/// Runs a `sim` subcommand.
pub fn run(global: &Global, cmd: SimCommand) -> Result<i32> {
    match cmd {
        SimCommand::Init { dir, gpus } => {
            if gpus == 0 || gpus > 64 {
                bail!("--gpus {gpus}: between 1 and 64");
            }
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let path = init_world(&dir, gpus)?;
            println!(
                "created a simulated node with {gpus} GPU(s): {}",
                path.display()
            );
            println!("use it with:  export VRAMGUARD_SIM={}", path.display());
            Ok(0)
        }
        SimCommand::Hold(args) => hold(global, &args),
        SimCommand::Reset { gpu } => {
            let mut sim = Sim::open(state_path(global)?)?;
            let out = sim.reset(gpu)?;
            println!(
                "simulated GPU {gpu} reset: {} of residue cleared",
                format_bytes(out.cleared_bytes)
            );
            Ok(0)
        }
        SimCommand::Xid { gpu, xid } => {
            let path = state_path(global)?;
            check_gpu(path, gpu)?;
            store::update_state(path, |s| s.gpus[gpu as usize].health.xid_events.push(xid))?;
            println!("simulated GPU {gpu}: Xid {xid} raised");
            Ok(0)
        }
        SimCommand::Remap {
            gpu,
            correctable,
            uncorrectable,
            pending,
            failure,
        } => {
            let path = state_path(global)?;
            check_gpu(path, gpu)?;
            store::update_state(path, |s| {
                s.gpus[gpu as usize].health.remapped_rows = Some(SimRemappedRows {
                    correctable,
                    uncorrectable,
                    pending,
                    failure,
                });
            })?;
            println!(
                "simulated GPU {gpu}: {correctable} correctable, {uncorrectable} uncorrectable \
                 row(s) remapped{}{}",
                if pending { ", remap pending" } else { "" },
                if failure { ", remap failed" } else { "" }
            );
            Ok(0)
        }
        SimCommand::Attach {
            gpu,
            bytes,
            fd,
            sm_util,
        } => {
            use vramguard_sim::client::{AttachError, attach};
            match attach(state_path(global)?, gpu, bytes, sm_util, fd) {
                Ok(done) => {
                    println!(
                        "pid {}: {} on simulated GPU {gpu}",
                        done.pid,
                        format_bytes(done.bytes)
                    );
                    Ok(0)
                }
                Err(e @ AttachError::OutOfMemory { .. }) => {
                    eprintln!("vramguard: {e}");
                    Ok(3)
                }
                Err(e) => Err(e.into()),
            }
        }
        SimCommand::Show => {
            let mut sim = Sim::open(state_path(global)?)?;
            let obs = sim.observe()?;
            println!("{}", serde_json::to_string_pretty(&obs)?);
            Ok(0)
        }
    }
}
