//! `vramguard agent`.

use crate::cli::AgentArgs;
use crate::context::Ctx;
use anyhow::{Result, anyhow};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use vramguard_agent::{AgentSetup, SourceFactory};
use vramguard_gpu::{GpuSource, NvmlSource};
use vramguard_sim::SimSource;

/// Runs the agent until SIGTERM/SIGINT.
pub fn run(ctx: Ctx, args: &AgentArgs) -> Result<i32> {
    let level = if args.verbose {
        tracing::Level::DEBUG
    } else {
        tracing::Level::INFO
    };
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .with_max_level(level)
        .with_target(false)
        .init();
    let mut config = ctx.config.clone();
    if let Some(listen) = &args.listen {
        if listen.parse::<std::net::SocketAddr>().is_err() {
            return Err(anyhow!(
                "--listen {listen:?}: expected ADDRESS:PORT, e.g. 127.0.0.1:9835"
            ));
        }
        config.agent.listen = listen.clone();
    }
    if let Some(i) = args.interval {
        if i < std::time::Duration::from_millis(50) {
            return Err(anyhow!("--interval {i:?}: at least 50ms"));
        }
        config.agent.interval = i;
    }
    // Fail now, with the driver's own message, rather than in the loop.
    drop(ctx.gpu_source()?);
    let (sim, lib) = (ctx.global.sim.clone(), ctx.global.nvml_lib.clone());
    let make_source: SourceFactory = Arc::new(move || -> Result<Box<dyn GpuSource>, String> {
        match (&lib, &sim) {
            (None, Some(state)) => Ok(Box::new(SimSource::open(state).map_err(|e| e.to_string())?)),
            (lib, _) => Ok(Box::new(
                NvmlSource::open(lib.as_deref()).map_err(|e| e.to_string())?,
            )),
        }
    });
    let setup = AgentSetup {
        config,
        config_path: ctx.global.config.clone(),
        proc_root: ctx.global.proc_root.clone(),
        dev_dir: ctx.dev_dir()?,
        make_source,
        reset: ctx.reset_backend(None)?,
        shutdown: Arc::new(AtomicBool::new(false)),
    };
    vramguard_agent::run(setup, None).map_err(anyhow::Error::msg)?;
    Ok(0)
}
