//! `vramguard agent`.

use crate::cli::AgentArgs;
use crate::settings::Settings;
use anyhow::{Result, anyhow};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use vramguard_agent::AgentSetup;

/// Runs the agent until SIGTERM/SIGINT.
pub fn run(settings: Settings, args: &AgentArgs) -> Result<i32> {
    crate::heap::limit_malloc_arenas();
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
    let mut config = settings.config.clone();
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
        // The config's own rules, for the flag too.
        if let Some((key, why)) = config.auto_reclaim_sampling(i) {
            // The flag is agent.interval; any other key at fault is named.
            let other = if key == "agent.interval" {
                String::new()
            } else {
                format!("{key}: ")
            };
            return Err(anyhow!(
                "--interval {}: {other}{why}",
                vramguard_core::units::format_duration(i)
            ));
        }
        config.agent.interval = i;
    }
    if let Some(web) = &args.web_config_file {
        config.agent.web_config = Some(web.clone());
    }
    // Fail now, with the driver's own message, rather than in the loop.
    drop(settings.gpu_source()?);
    let setup = AgentSetup {
        config,
        config_path: settings.config_path.clone(),
        make_node: settings.node_factory()?,
        shutdown: Arc::new(AtomicBool::new(false)),
    };
    vramguard_agent::run(setup, None)?;
    Ok(0)
}
