//! `vramguard`: explain, reclaim and prevent GPU memory held by processes whose job is gone.
//!
//! The binary is a thin shell: it reads the driver and `/proc` through the library crates,
//! hands the facts to the pure core and prints or acts on what comes back. Errors are printed
//! once, as one line with their causes, and exit with 2.

mod agent;
mod cli;
mod demo;
mod gpusel;
mod heap;
mod probe;
mod progress;
mod reclaim;
mod render;
mod run;
mod settings;
mod simcmd;
mod slurm;
mod top;
mod watch;

use anyhow::Result;
use std::io::Write;

/// The most of an error message printed (characters, after escaping).
const MAX_ERROR_CHARS: usize = 900;

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
    let (cli, config) = cli::parse_with_config(std::env::args_os().collect());
    let code = match run(cli, config) {
        Ok(code) => code,
        Err(e) => {
            // A closed pipe (`vramguard status | head`) is not a failure.
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) {
                0
            } else {
                // Parse errors repeat the offending value of a file someone else may have
                // written (a snapshot, a simulator state): shown escaped, and cut.
                eprintln!(
                    "vramguard: error: {}",
                    vramguard_core::sanitize::fit(&format!("{e:#}"), MAX_ERROR_CHARS)
                );
                2
            }
        }
    };
    std::process::exit(code);
}

/// `vramguard man`: vramguard.1 and vramguard-COMMAND.1 for every visible command.
fn man_pages(dir: &std::path::Path) -> Result<i32> {
    use anyhow::Context;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cmd = cli::command();
    let mut pages = vec![("vramguard".to_string(), cmd.clone())];
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name = format!("vramguard-{}", sub.get_name());
        // The page's title is the command's name; clap keeps names as &'static str, and this
        // one-shot command makes a dozen of them.
        let title: &'static str = Box::leak(name.clone().into_boxed_str());
        pages.push((name, sub.clone().name(title)));
    }
    let mut written = 0;
    for (name, page) in pages {
        let mut out = Vec::new();
        clap_mangen::Man::new(page)
            .render(&mut out)
            .with_context(|| format!("rendering {name}.1"))?;
        let path = dir.join(format!("{name}.1"));
        // Read by every user's `man`.
        vramguard_fs::write_file_mode(&path, &out, 0o644)
            .map_err(|e| anyhow::anyhow!("writing {}: {}", path.display(), e.reason()))?;
        written += 1;
    }
    print(&format!(
        "wrote {written} man pages to {} (man vramguard)\n",
        dir.display()
    ))?;
    Ok(0)
}

/// `vramguard config show`: every setting, its value and its source.
fn config_show(config: &vramguard_config::Config, json: bool) -> Result<i32> {
    let settings = config.settings();
    if json {
        print_json(&settings)?;
        return Ok(0);
    }
    let mut out = String::new();
    match &config.path {
        Some(p) => out.push_str(&format!(
            "# {}, merged with the defaults\n",
            vramguard_core::sanitize::escape(&p.display().to_string())
        )),
        None => out.push_str("# no config file: the defaults\n"),
    }
    let mut section = "";
    for s in &settings {
        let (sec, key) = s.key.split_once('.').unwrap_or(("", &s.key));
        if sec != section {
            out.push_str(&format!("\n[{sec}]\n"));
            section = sec;
        }
        let line = format!("{key} = {}", s.value);
        let source = s.source.to_string();
        let source = vramguard_core::sanitize::escape(&source);
        out.push_str(&format!("{line:<46} # {source}\n"));
    }
    print(&out)?;
    Ok(0)
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

fn run(
    cli: cli::Cli,
    loaded: Result<vramguard_config::Loaded, vramguard_config::ConfigError>,
) -> Result<i32> {
    use cli::Command;
    // The config, for the commands that read it; a default file set aside is said once.
    let config = move || -> Result<vramguard_config::Config> {
        let loaded = loaded?;
        if let Some(note) = &loaded.note {
            eprintln!("vramguard: note: {note}");
        }
        Ok(loaded.config)
    };
    match cli.command {
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
            pgid_start,
            cgroup,
        } => vramguard_ops::supervise::watchdog(parent, pgid, pgid_start, cgroup.as_deref()),
        Command::Demo(args) => demo::run(&cli.global, &args),
        Command::Completions { shell } => {
            // Into a buffer first: clap_complete panics on a closed pipe, print() does not.
            let mut cmd = cli::command();
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "vramguard", &mut script);
            print(&String::from_utf8_lossy(&script))?;
            Ok(0)
        }
        Command::Man { dir } => man_pages(&dir),
        Command::Sim(cmd) => simcmd::run(&cli.global, cmd),
        Command::Config(cli::ConfigCommand::Show { json }) => config_show(&config()?, json),
        // Every command that looks at a node: the options and the config, read once.
        command => run_on_node(settings::Settings::new(cli.global, config()?)?, command),
    }
}

/// The commands that look at a node, each with the one [`settings::Settings`].
fn run_on_node(settings: settings::Settings, command: cli::Command) -> Result<i32> {
    use cli::Command;
    // These act on this machine whatever a snapshot says: with --replay, an operator who
    // believes they look at a saved incident would signal, reset or resume live ones.
    let live_only = match &command {
        Command::Run(_) => Some("run"),
        Command::Pick(_) => Some("pick"),
        Command::Agent(_) => Some("agent"),
        Command::Probe(_) => Some("probe"),
        Command::Slurm(_) => Some("slurm heal"),
        _ => None,
    };
    if let (Some(name), Some(path)) = (live_only, &settings.replay) {
        anyhow::bail!(
            "--replay {}: `vramguard {name}` acts on this machine, not on a saved snapshot; \
             run it without --replay",
            vramguard_core::sanitize::shown(&path.display().to_string())
        );
    }
    match command {
        Command::Status(args) => status(&settings, &args),
        Command::Top(args) => top::run(&settings, &args),
        Command::Diagnose(args) => diagnose(&settings, &args),
        Command::Snapshot(args) => {
            print_json(&settings.snapshot(args.sample)?)?;
            Ok(0)
        }
        Command::Metrics(args) => metrics(&settings, &args),
        Command::Reclaim(args) => reclaim::run(&settings, &args),
        Command::Run(args) => run::run(&settings, &args),
        Command::Pick(args) => run::pick_command(&settings, &args),
        Command::Agent(args) => agent::run(settings, &args),
        Command::Probe(cmd) => probe::run(&settings, &cmd),
        Command::Slurm(cli::SlurmCommand::Heal(args)) => slurm::heal(&settings, &args),
        Command::CudaHold { .. }
        | Command::Watchdog { .. }
        | Command::Demo(_)
        | Command::Completions { .. }
        | Command::Man { .. }
        | Command::Config(_)
        | Command::Sim(_) => {
            unreachable!("handled without a node")
        }
    }
}

/// `vramguard status`.
fn status(settings: &settings::Settings, args: &cli::StatusArgs) -> Result<i32> {
    // A GPU that could not be read (lost, timing out, its process list unavailable) makes
    // the run an error (exit 2) once everything that could be read is printed.
    let mut unreadable = false;
    let scan = if args.full_scan {
        watch::Scan::Full
    } else {
        watch::Scan::ListedFirst
    };
    watch::each_report(
        settings,
        args.sample,
        args.watch,
        &args.gpu,
        scan,
        |report| {
            unreadable = report.gpus.iter().any(|g| g.is_unreadable());
            Ok(if args.json {
                json_text(&report, args.watch.is_some())?
            } else {
                render::status(&report, &render::Style::new(render::use_colour()))
            })
        },
    )?;
    Ok(if unreadable { 2 } else { 0 })
}

/// `vramguard diagnose`.
fn diagnose(settings: &settings::Settings, args: &cli::DiagnoseArgs) -> Result<i32> {
    let mut code = 0;
    let scan = watch::Scan::Full;
    watch::each_report(
        settings,
        args.sample,
        args.watch,
        &args.gpu,
        scan,
        |report| {
            let diagnosis = vramguard_core::diagnose::diagnose(report);
            code = diagnosis.exit_code();
            Ok(if args.json {
                json_text(&diagnosis, args.watch.is_some())?
            } else {
                render::diagnose(&diagnosis, &render::Style::new(render::use_colour()))
            })
        },
    )?;
    Ok(code)
}

/// JSON of `value`: pretty, or one line per document when watching (the refresh loop ends
/// each block with a newline).
fn json_text<T: serde::Serialize>(value: &T, one_line: bool) -> Result<String> {
    Ok(if one_line {
        serde_json::to_string(value)?
    } else {
        let mut text = serde_json::to_string_pretty(value)?;
        text.push('\n');
        text
    })
}

/// `vramguard metrics`.
fn metrics(settings: &settings::Settings, args: &cli::MetricsArgs) -> Result<i32> {
    let t0 = std::time::Instant::now();
    let (snap, report) = settings.report(args.sample)?;
    let openmetrics = vramguard_agent::metrics::one_collection(
        &report,
        settings.config.agent.top_holders,
        settings.config.agent.dcgm_labels,
        // A replay is the saved collection: nothing of this run's clock in it.
        if settings.replay.is_some() {
            0.0
        } else {
            t0.elapsed().as_secs_f64()
        },
        snap.taken_at_ms as f64 / 1000.0,
    );
    print(&if args.openmetrics {
        openmetrics
    } else {
        vramguard_agent::metrics::as_prometheus_text(&openmetrics)
    })?;
    Ok(0)
}
