//! `vramguard`: explain, reclaim and prevent GPU memory held by processes whose job is gone.
//!
//! The binary is a thin shell: it reads the driver and `/proc` through the library crates,
//! hands the facts to the pure core and prints or acts on what comes back. Errors are printed
//! once, as one line with their causes, and exit with 2.

mod agent;
mod cli;
mod context;
mod demo;
mod probe;
mod reclaim;
mod render;
mod run;
mod simcmd;

use anyhow::Result;
use clap::Parser;
use std::io::Write;

fn main() {
    // A simulated holder re-executes vramguard with its spec in the environment.
    if let Ok(spec) = std::env::var(vramguard_sim::holder::HOLDER_ENV) {
        let code = match serde_json::from_str(&spec)
            .map_err(anyhow::Error::from)
            .and_then(|spec| vramguard_sim::holder::run(spec).map_err(anyhow::Error::from))
        {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("vramguard holder: {e:#}");
                2
            }
        };
        std::process::exit(code);
    }
    let cli = cli::Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) => {
            // A closed pipe (`vramguard status | head`) is not a failure.
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) {
                0
            } else {
                eprintln!("vramguard: error: {e:#}");
                2
            }
        }
    };
    std::process::exit(code);
}

fn print(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

fn print_json<T: serde::Serialize>(value: &T) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    print(&text)
}

fn run(cli: cli::Cli) -> Result<i32> {
    use cli::Command;
    match cli.command {
        Command::Status(args) => {
            let ctx = context::Ctx::new(cli.global)?;
            let (_, report) = ctx.report(args.sample)?;
            if args.json {
                print_json(&report)?;
            } else {
                print(&render::status(
                    &report,
                    &render::Style::new(render::use_colour()),
                ))?;
            }
            Ok(0)
        }
        Command::Diagnose(args) => {
            let ctx = context::Ctx::new(cli.global)?;
            let (_, mut report) = ctx.report(args.sample)?;
            if let Some(missing) = args
                .gpu
                .iter()
                .find(|i| !report.gpus.iter().any(|g| g.index == **i))
            {
                anyhow::bail!(
                    "--gpu {missing}: this node has {} GPU(s)",
                    report.gpus.len()
                );
            }
            if !args.gpu.is_empty() {
                report.gpus.retain(|g| args.gpu.contains(&g.index));
            }
            let diagnosis = vramguard_core::diagnose::diagnose(report);
            if args.json {
                print_json(&diagnosis)?;
            } else {
                print(&render::diagnose(
                    &diagnosis,
                    &render::Style::new(render::use_colour()),
                ))?;
            }
            Ok(diagnosis.exit_code())
        }
        Command::Snapshot(args) => {
            let ctx = context::Ctx::new(cli.global)?;
            print_json(&ctx.snapshot(args.sample)?)?;
            Ok(0)
        }
        Command::Metrics(args) => {
            let ctx = context::Ctx::new(cli.global)?;
            let t0 = std::time::Instant::now();
            let (snap, report) = ctx.report(args.sample)?;
            let replayed = ctx.global.replay.is_some();
            print(&vramguard_agent::metrics::one_collection(
                &report,
                ctx.config.agent.top_holders,
                // A replay is the saved collection: nothing of this run's clock in it.
                if replayed {
                    0.0
                } else {
                    t0.elapsed().as_secs_f64()
                },
                snap.taken_at_ms as f64 / 1000.0,
            ))?;
            Ok(0)
        }
        Command::Reclaim(args) => {
            let ctx = context::Ctx::new(cli.global)?;
            reclaim::run(&ctx, &args)
        }
        Command::Run(args) => {
            let ctx = context::Ctx::new(cli.global)?;
            run::run(&ctx, &args)
        }
        Command::Pick(args) => {
            let ctx = context::Ctx::new(cli.global)?;
            run::pick(&ctx, &args)
        }
        Command::Agent(args) => {
            let ctx = context::Ctx::new(cli.global)?;
            agent::run(ctx, &args)
        }
        Command::Probe(cmd) => {
            let ctx = context::Ctx::new(cli.global)?;
            probe::run(&ctx, &cmd)
        }
        Command::CudaHold {
            pci,
            bytes,
            children,
            lifetime,
        } => match vramguard_probe::cuda::hold(&pci, bytes, children, lifetime) {
            Ok(()) => Ok(0),
            Err(e) => {
                eprintln!("vramguard cuda holder: {e}");
                Ok(2)
            }
        },
        Command::Watchdog {
            parent,
            pgid,
            cgroup,
        } => vramguard_ops::supervise::watchdog(parent, pgid, cgroup.as_deref()),
        Command::Demo(args) => demo::run(&cli.global, &args),
        Command::Sim(cmd) => simcmd::run(&cli.global, cmd),
    }
}
