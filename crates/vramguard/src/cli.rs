//! Command-line definitions. Only this crate knows about the command line.

use crate::gpusel::{GpuSelector, gpu_selector};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;
use vramguard_config::{Config, ConfigError, Loaded, defaults};
use vramguard_core::units::UnitError;

/// Explain, reclaim and prevent GPU memory held by processes whose job is gone.
#[derive(Debug, Parser)]
#[command(
    name = "vramguard",
    version,
    long_version = LONG_VERSION,
    about,
    max_term_width = HELP_WIDTH
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// `vramguard --version`: the version, the commit it was built from, and for what.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    "\ncommit: ",
    env!("VRAMGUARD_COMMIT"),
    "\nbuilt: ",
    env!("VRAMGUARD_BUILD_DATE"),
    "\ntarget: ",
    env!("VRAMGUARD_TARGET"),
    "\nprofile: ",
    env!("VRAMGUARD_PROFILE"),
    "\nNVML: loaded at run time (libnvidia-ml.so.1 of the installed driver)"
);

/// Where facts come from. Accepted before or after the command; every help lists them apart
/// from the command's own options, under "Global options".
#[derive(Debug, Args, Clone)]
#[command(next_help_heading = "Global options")]
pub struct Global {
    /// Use the simulated driver with this state file (in-process unless --nvml-lib is given,
    /// in which case the simulator's NVML library reads it)
    #[arg(long, global = true, env = "VRAMGUARD_SIM", value_name = "STATE")]
    pub sim: Option<PathBuf>,

    /// NVML library to load [default: libnvidia-ml.so.1]
    #[arg(long, global = true, env = "VRAMGUARD_NVML_LIB", value_name = "PATH")]
    pub nvml_lib: Option<PathBuf>,

    /// The /proc tree to read (a fixture tree in tests, or a container's view)
    #[arg(long, global = true, default_value = vramguard_proc::OWN_PROC, value_name = "DIR")]
    pub proc_root: PathBuf,

    /// Directory of the nvidia* device files [default: /dev, or the simulator's dev_dir]
    #[arg(long, global = true, value_name = "DIR")]
    pub dev_dir: Option<PathBuf>,

    /// Config file [default: /etc/vramguard/config.toml when it exists; `none`: no file, the
    /// defaults]
    #[arg(long, global = true, env = "VRAMGUARD_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Classify a saved snapshot (from `vramguard snapshot`) instead of this machine
    #[arg(long, global = true, value_name = "FILE")]
    pub replay: Option<PathBuf>,
}

/// Where `vramguard man` writes without `--dir`: where `man` finds pages installed by hand
/// (the packages put theirs in /usr/share/man/man1).
pub const MAN_DIR: &str = "/usr/local/share/man/man1";

#[derive(Debug, Subcommand)]
pub enum Command {
    /// One screen: every GPU, every holder, every unexplained byte
    #[command(
        after_help = "Examples:\n  vramguard status\n  vramguard status --gpu 0,3 --watch 2s\n  vramguard status --json | jq '.gpus[].ghost_bytes'\n  vramguard --replay incident.json status"
    )]
    Status(StatusArgs),
    /// The live view: GPUs (memory with the ghost part, utilization, temperature, power) and
    /// every holder with its class, sortable and filterable; `r` reclaims the selected
    /// holder's dead job after confirmation
    #[command(
        after_help = "Examples:\n  vramguard top\n  vramguard top --gpu 0 --class orphan\n  vramguard top --once > screen.txt"
    )]
    Top(TopArgs),
    /// The full check-list with a verdict and the exact next command (exit 0 clean, 1 found
    /// ghost memory or orphaned holders, 2 error)
    #[command(
        after_help = "Examples:\n  vramguard diagnose\n  vramguard diagnose --gpu 2 && echo clean\n  vramguard diagnose --json | jq .verdict"
    )]
    Diagnose(DiagnoseArgs),
    /// Print the raw facts (driver + /proc) as JSON, to replay with --replay or attach to a
    /// bug report
    #[command(
        after_help = "Examples:\n  vramguard snapshot > incident.json\n  vramguard --replay incident.json diagnose"
    )]
    Snapshot(SnapshotArgs),
    /// Print the metrics of one collection, as the agent serves them on /metrics (for a
    /// textfile collector, a cron job, or a saved snapshot with --replay)
    #[command(
        after_help = "Examples:\n  vramguard metrics > /var/lib/node_exporter/textfile/vramguard.prom\n  vramguard metrics | promtool check metrics"
    )]
    Metrics(MetricsArgs),
    /// Free ghost GPU memory safely: plan, SIGTERM, grace, SIGKILL, verify the driver released
    /// it, optionally reset; every action in the audit log (exit 0 all freed, 1 some remains,
    /// 2 error or refused)
    #[command(
        after_help = "Examples:\n  vramguard reclaim                      # plan, then ask\n  vramguard reclaim --dry-run --json\n  vramguard reclaim --yes --gpu 0 --reset=auto\n  vramguard reclaim --yes --include orphan,hidden,shm\n  vramguard reclaim --yes --job slurm:4242"
    )]
    Reclaim(ReclaimArgs),
    /// Run a job so that its whole process tree, and its GPU memory, is gone when it ends
    /// (also as a container ENTRYPOINT); exits with the job's code, 128+signal if killed
    #[command(
        after_help = "Examples:\n  vramguard run -- torchrun --nproc-per-node=8 train.py\n  vramguard run --gpus auto:2 -- python3 infer.py\n  ENTRYPOINT [\"vramguard\", \"run\", \"--\"] in a Dockerfile"
    )]
    Run(RunArgs),
    /// Print the N GPUs with the most free memory (for CUDA_VISIBLE_DEVICES)
    #[command(
        after_help = "Examples:\n  export CUDA_VISIBLE_DEVICES=$(vramguard pick 2 --min-free 40GiB)\n  vramguard pick 1 --wait 10m --by-uuid"
    )]
    Pick(PickArgs),
    /// Watch this node: Prometheus metrics, leak trends, alerts, a status page, optional
    /// automatic reclaim (loopback by default; see [agent] in the config)
    #[command(
        after_help = "Examples:\n  vramguard agent --listen 127.0.0.1:9835\n  vramguard --config /etc/vramguard/config.toml agent --interval 2s"
    )]
    Agent(AgentArgs),
    /// Measure how the driver releases GPU memory: release latency per signal, concurrent
    /// kills, and a soak that fits the trend of the baseline (Markdown, JSON and SVG reports)
    #[command(
        subcommand,
        after_help = "Examples:\n  vramguard probe release --gpu 0 --size 8GiB --signals TERM,INT,KILL --repeat 5 --report out/\n  vramguard probe concurrent --gpu 0 --workers 8 --size 2GiB --kill random\n  vramguard probe soak --gpu 0 --duration 30m --cycle 5s\n  vramguard probe calls --gpu 0 --samples 200"
    )]
    Probe(ProbeCommand),
    /// Slurm: bring back a node vramguard drained once a GPU reset has freed its memory
    #[command(
        subcommand,
        after_help = "Examples:\n  vramguard slurm heal --node gpu07\n  vramguard slurm heal --node $(hostname -s) --wait 2h --json"
    )]
    Slurm(SlurmCommand),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell), e.g.
    /// `vramguard completions bash > /etc/bash_completion.d/vramguard`
    #[command(
        after_help = "Examples:\n  vramguard completions bash > /etc/bash_completion.d/vramguard\n  vramguard completions zsh > /usr/local/share/zsh/site-functions/_vramguard\n  vramguard completions fish > ~/.config/fish/completions/vramguard.fish"
    )]
    Completions {
        /// The shell
        shell: clap_complete::Shell,
    },
    /// Write the man pages (vramguard.1 and one per command, mode 0644) into DIR, and say where
    #[command(
        after_help = "Examples:\n  sudo vramguard man && man vramguard-reclaim\n  vramguard man --dir ~/.local/share/man/man1"
    )]
    Man {
        /// Directory to write them to (created if missing); the default is where `man` looks
        /// for pages installed by hand
        #[arg(long, value_name = "DIR", default_value = MAN_DIR)]
        dir: PathBuf,
    },
    /// (internal) the built-in CUDA holder of the probe
    #[command(name = "__cuda-hold", hide = true)]
    CudaHold {
        #[arg(long)]
        pci: String,
        #[arg(long)]
        bytes: u64,
        #[arg(long, default_value_t = 0)]
        children: u32,
        #[arg(long, default_value_t = 3600)]
        lifetime: u32,
    },
    /// (internal) kill a job if its supervisor dies
    #[command(name = "__watchdog", hide = true)]
    Watchdog {
        #[arg(long)]
        parent: u32,
        #[arg(long)]
        pgid: u32,
        /// The start time (clock ticks after boot) of the group's leader when the job began
        #[arg(long)]
        pgid_start: Option<u64>,
        #[arg(long)]
        cgroup: Option<PathBuf>,
    },
    /// Build a realistic incident on the simulated GPU with real processes, diagnose it, clean
    /// up (needs no NVIDIA driver)
    #[command(
        after_help = "Examples:\n  vramguard demo\n  vramguard demo --reclaim\n  vramguard demo --save-snapshot incident.json --json"
    )]
    Demo(DemoArgs),
    /// The simulated driver: create a state, hold memory, reset a GPU
    #[command(
        subcommand,
        after_help = "Examples:\n  vramguard sim init --dir ./sim --gpus 2\n  vramguard --sim ./sim/state.json sim hold --gpu 0 --bytes 8GiB --workers 2 &\n  vramguard --sim ./sim/state.json status\n  vramguard --sim ./sim/state.json sim reset --gpu 1"
    )]
    Sim(SimCommand),
    /// The settings in effect: every config key, its value and where it came from
    #[command(
        subcommand,
        after_help = "Examples:\n  vramguard config show\n  vramguard --config ./node.toml config show --json"
    )]
    Config(ConfigCommand),
}

/// `vramguard config`.
#[derive(Debug, Subcommand, Clone)]
pub enum ConfigCommand {
    /// Every setting: the config file merged with the defaults, each with its source
    Show {
        /// Print JSON: a list of {key, value, source}
        #[arg(long)]
        json: bool,
    },
}

/// The flags whose default is a config key: (command, flag's argument id, section, key).
/// Where the config file sets the key, the flag's default is the file's value, and `--help`
/// says so; an explicit flag still wins.
const FLAGS_FROM_CONFIG: &[(&str, &str, &str, &str)] = &[
    ("reclaim", "grace", "reclaim", "grace"),
    ("reclaim", "release_timeout", "reclaim", "release_timeout"),
    ("reclaim", "reset", "reclaim", "reset"),
    ("reclaim", "sample", "reclaim", "sample"),
    ("reclaim", "include", "reclaim", "include"),
    ("reclaim", "audit_log", "reclaim", "audit_log"),
    ("top", "grace", "reclaim", "grace"),
    ("top", "release_timeout", "reclaim", "release_timeout"),
    ("top", "audit_log", "reclaim", "audit_log"),
    ("run", "grace", "reclaim", "grace"),
    ("run", "release_timeout", "reclaim", "release_timeout"),
];

/// A config value as a flag would spell it: strings as they are, lists joined with commas.
fn flag_text(value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Array(items) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .map(|v| v.join(",")),
        _ => None,
    }
}

/// `cmd` with the defaults of [`FLAGS_FROM_CONFIG`] taken from `config` where it sets them,
/// and `reclaim --include`'s from the class table.
pub fn with_config_defaults(mut cmd: clap::Command, config: &Config) -> clap::Command {
    let targets: Vec<&str> = vramguard_core::Class::default_targets()
        .map(|c| c.as_str())
        .collect();
    let targets: &'static str = Box::leak(targets.join(",").into_boxed_str());
    cmd = cmd.mut_subcommand("reclaim", |c| {
        c.mut_arg("include", |a| a.default_value(targets))
    });
    for &(sub, arg, section, key) in FLAGS_FROM_CONFIG {
        let (Some(value), Some(path)) = (config.set_in_file(section, key), &config.path) else {
            continue;
        };
        let Some(text) = flag_text(value) else {
            continue;
        };
        let note = format!(
            "[default: {text}, from [{section}] {key} in {}]",
            path.display()
        );
        // clap keeps defaults as &'static str; a handful, once per run.
        let text: &'static str = Box::leak(text.into_boxed_str());
        cmd = cmd.mut_subcommand(sub, |c| {
            c.mut_arg(arg, |a| {
                let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
                a.default_value(text)
                    .hide_default_value(true)
                    .help(format!("{help} {note}"))
            })
        });
    }
    commands_by_use(global_options_once(cmd))
}

/// The width help is wrapped to (the `max_term_width` of [`Cli`]).
const HELP_WIDTH: usize = 100;

/// The order `vramguard --help` lists the commands in: a first try, then by how often an
/// admin reaches for each; the rest keep their place after these.
const COMMANDS_BY_USE: &[&str] = &[
    "demo", "status", "top", "diagnose", "reclaim", "run", "agent", "pick", "metrics", "snapshot",
    "probe", "config",
];

fn commands_by_use(mut cmd: clap::Command) -> clap::Command {
    for (order, name) in COMMANDS_BY_USE.iter().enumerate() {
        cmd = cmd.mut_subcommand(name, |c| c.display_order(order));
    }
    cmd
}

/// The global options ([`Global`]) explained once, in `vramguard --help`; every command's help
/// names them in one line instead of repeating their 14 lines (and `--replay` under `sim
/// hold`, where it means nothing). They are accepted before or after any command all the same.
fn global_options_once(mut cmd: clap::Command) -> clap::Command {
    let globals: Vec<clap::Arg> = cmd
        .get_arguments()
        .filter(|a| a.is_global_set())
        .cloned()
        .collect();
    let rows: Vec<(String, String)> = globals
        .iter()
        .filter_map(|a| {
            let long = a.get_long()?;
            let value = a
                .get_value_names()
                .and_then(|v| v.first())
                .map(|v| format!(" <{v}>"))
                .unwrap_or_default();
            let mut help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            if let Some(env) = a.get_env() {
                help.push_str(&format!(" [env: {}]", env.to_string_lossy()));
            }
            Some((format!("--{long}{value}"), help))
        })
        .collect();
    let width = rows.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
    let mut section = String::from("Global options (before or after any command):\n");
    // Wrapped here, with the help column kept: clap wraps after_help without indentation.
    let column = width + 4;
    for (name, help) in &rows {
        let mut line = format!("  {name:width$}  ");
        for word in help.split_whitespace() {
            if line.len() > column && line.len() + 1 + word.len() > HELP_WIDTH {
                section.push_str(line.trim_end());
                section.push('\n');
                line = " ".repeat(column);
            } else if line.len() > column {
                line.push(' ');
            }
            line.push_str(word);
        }
        section.push_str(line.trim_end());
        section.push('\n');
    }
    let names: Vec<String> = rows
        .iter()
        .map(|(n, _)| n.split(' ').next().unwrap_or(n).to_string())
        .collect();
    let line = format!(
        "Global options: {} (`vramguard --help` explains them)",
        names.join(", ")
    );
    for a in &globals {
        cmd = cmd.mut_arg(a.get_id().clone(), |a| a.hide(true));
    }
    let subcommands: Vec<String> = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set())
        .map(|s| s.get_name().to_string())
        .collect();
    for name in subcommands {
        cmd = cmd.mut_subcommand(name, |s| {
            let after = match s.get_after_help() {
                Some(h) => format!("{h}\n\n{line}"),
                None => line.clone(),
            };
            s.after_help(after)
        });
    }
    cmd.after_help(section.trim_end().to_string())
}

/// The command line's definition at the built-in defaults (man pages, completions).
pub fn command() -> clap::Command {
    with_config_defaults(Cli::command(), &Config::default())
}

/// The config file the command line names (`--config`, else `VRAMGUARD_CONFIG`), read
/// before the command line is parsed in full, so that the flags' defaults can be its values.
fn config_path(argv: &[OsString]) -> Option<PathBuf> {
    if let Ok(m) = Cli::command()
        .ignore_errors(true)
        .try_get_matches_from(argv)
    {
        return m.get_one::<PathBuf>("config").cloned();
    }
    // `--help` and `--version` end the first pass: then only the help's defaults depend on
    // this, and the plain spellings before `--` are looked for.
    let mut words = argv.iter().skip(1).take_while(|w| *w != "--");
    while let Some(w) = words.next() {
        let w = w.to_string_lossy();
        if w == "--config" {
            return words.next().map(PathBuf::from);
        }
        if let Some(path) = w.strip_prefix("--config=") {
            return Some(PathBuf::from(path));
        }
    }
    std::env::var_os("VRAMGUARD_CONFIG").map(PathBuf::from)
}

/// Parses `argv` with the config file's values as the defaults of the flags that share a key
/// with it ([`FLAGS_FROM_CONFIG`]); the config is read once, here, and returned (an error is
/// reported by the commands that need the config, not by `demo` or `completions`).
pub fn parse_with_config(argv: Vec<OsString>) -> (Cli, Result<Loaded, ConfigError>) {
    let config = Config::load(config_path(&argv).as_deref());
    let cmd = with_config_defaults(
        Cli::command(),
        config
            .as_ref()
            .map(|loaded| &loaded.config)
            .unwrap_or(&Config::default()),
    );
    let matches = cmd.get_matches_from(argv);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    (cli, config)
}

/// Parses a duration argument (`500ms`, `10s`, `2h`).
pub fn duration(s: &str) -> Result<Duration, UnitError> {
    vramguard_core::units::parse_duration(s)
}

/// Parses a size argument (`8GiB`, `512MiB`).
pub fn bytes(s: &str) -> Result<u64, UnitError> {
    vramguard_core::units::parse_bytes(s)
}

/// Parses a reset mode: never, auto or force.
pub fn reset_mode(s: &str) -> Result<vramguard_ops::ResetMode, vramguard_ops::UnknownResetMode> {
    s.parse()
}

/// Parses `run --isolation`: auto, cgroup or group.
pub fn isolation(
    s: &str,
) -> Result<vramguard_ops::supervise::Isolation, vramguard_ops::supervise::UnknownIsolation> {
    s.parse()
}

/// Parses a class name.
pub fn class(s: &str) -> Result<vramguard_core::Class, vramguard_core::report::UnknownClass> {
    s.trim().parse()
}

/// What `reclaim --include` may name: a class of holders, or `shm` (orphaned shared-memory
/// segments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Included {
    /// Holders of this class.
    Class(vramguard_core::Class),
    /// Orphaned shared-memory segments.
    Shm,
    /// Idle keepers of exited pids inside live jobs a unit, Slurm or a container owns.
    Keepers,
}

/// An `--include` value reclaim does not take: an unknown word, or a class it never targets.
#[derive(Debug, thiserror::Error)]
#[error("{reason} (--include takes: {})", allowed_includes())]
pub struct BadInclude {
    reason: String,
}

/// What `--include` takes: the classes reclaim may target, `shm` and `keepers`.
fn allowed_includes() -> String {
    let mut names = vramguard_core::Class::target_names(false);
    names.extend(["shm", "keepers"]);
    names.join(", ")
}

/// Parses one `--include` value; a class reclaim never targets is refused here, with the
/// same list of what it takes as an unknown word.
pub fn included(s: &str) -> Result<Included, BadInclude> {
    match s.trim() {
        "shm" => Ok(Included::Shm),
        "keepers" => Ok(Included::Keepers),
        other => {
            let class: vramguard_core::Class = other.parse().map_err(|_| BadInclude {
                reason: format!(
                    "unknown value {:?}",
                    vramguard_core::sanitize::escape(other)
                ),
            })?;
            class.check_target(false).map_err(|e| BadInclude {
                reason: e.to_string(),
            })?;
            Ok(Included::Class(class))
        }
    }
}

/// The longest sampling window accepted: a longer one is a typo, not a wish.
const MAX_SAMPLE: std::time::Duration = std::time::Duration::from_secs(600);

/// A `--sample` that is not a duration up to ten minutes.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    /// Not a duration.
    #[error(transparent)]
    Unit(#[from] UnitError),
    /// Longer than [`MAX_SAMPLE`].
    #[error("{0:?} is longer than the 10m a sampling window may last")]
    TooLong(String),
}

/// Parses `--sample`: a duration from 0 (no window) to ten minutes.
pub fn parse_sample(s: &str) -> Result<std::time::Duration, SampleError> {
    let d = duration(s)?;
    if d > MAX_SAMPLE {
        return Err(SampleError::TooLong(s.to_string()));
    }
    Ok(d)
}

/// The shortest refresh interval of `--watch` and `top`: a full scan costs tens of
/// milliseconds on a busy node.
const MIN_REFRESH: std::time::Duration = std::time::Duration::from_millis(100);

/// A refresh interval out of range.
#[derive(Debug, thiserror::Error)]
pub enum RefreshError {
    /// Not a duration.
    #[error(transparent)]
    Unit(#[from] UnitError),
    /// Shorter than [`MIN_REFRESH`] or longer than an hour.
    #[error("{0:?}: the refresh interval must be from 100ms to 1h")]
    OutOfRange(String),
}

/// Parses a refresh interval: 100 ms to an hour.
pub fn parse_refresh(s: &str) -> Result<std::time::Duration, RefreshError> {
    let d = duration(s)?;
    if d < MIN_REFRESH || d > std::time::Duration::from_secs(3600) {
        return Err(RefreshError::OutOfRange(s.to_string()));
    }
    Ok(d)
}

#[derive(Debug, Args, Clone)]
pub struct StatusArgs {
    /// Print JSON (stable schema: json-schema.md, in /usr/share/doc/vramguard with the
    /// packages); with --watch, one document per line per refresh
    #[arg(long)]
    pub json: bool,
    /// Only these GPUs: indices, GPU-… or MIG-… UUIDs, e.g. 0,3 [default: all]
    #[arg(long, value_delimiter = ',', value_name = "GPU", value_parser = gpu_selector)]
    pub gpu: Vec<GpuSelector>,
    /// Refresh every INTERVAL until interrupted: redrawn in place on a terminal, one block
    /// per refresh when piped [default interval: 2s]
    #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "2s",
          value_parser = parse_refresh)]
    pub watch: Option<std::time::Duration>,
    /// Watch CPU use and running threads this long before classifying, to tell a job that
    /// still works (detached) from one that does not (orphan); 0 skips it and leaves work
    /// unknown
    #[arg(long, default_value = "0.5s", value_name = "DURATION", value_parser = parse_sample)]
    pub sample: std::time::Duration,
    /// Read every process's open files even when the driver's listed processes explain
    /// every byte (also shows processes that hold the device files without memory, as
    /// `diagnose` does)
    #[arg(long)]
    pub full_scan: bool,
}

#[derive(Debug, Args, Clone)]
pub struct TopArgs {
    /// Refresh interval, 100ms to 1h
    #[arg(short = 'd', long, default_value = "1s", value_name = "INTERVAL", value_parser = parse_refresh)]
    pub delay: std::time::Duration,
    /// Only these GPUs: indices, GPU-… or MIG-… UUIDs, e.g. 0,3 [default: all]
    #[arg(long, value_delimiter = ',', value_name = "GPU", value_parser = gpu_selector)]
    pub gpu: Vec<GpuSelector>,
    /// Start with only this class shown (`c` cycles through the classes)
    #[arg(long, value_name = "CLASS", value_parser = class)]
    pub class: Option<vramguard_core::Class>,
    /// Start with only this user's holders shown
    #[arg(long, value_name = "USER")]
    pub user: Option<String>,
    /// No colours (also when NO_COLOR is set)
    #[arg(long)]
    pub monochrome: bool,
    /// Print one screen as text and exit (no terminal needed: for logs, tickets, cron)
    #[arg(short = '1', long)]
    pub once: bool,
    /// CPU and thread watching per refresh, to tell a working job from a dead one
    #[arg(long, default_value = "0.5s", value_name = "DURATION", value_parser = parse_sample)]
    pub sample: std::time::Duration,
    /// Reclaim: time between SIGTERM and SIGKILL
    #[arg(long, default_value = defaults::GRACE, value_name = "DURATION", value_parser = duration)]
    pub grace: std::time::Duration,
    /// Reclaim: how long to wait for the driver to release the memory
    #[arg(long, default_value = defaults::RELEASE_TIMEOUT, value_name = "DURATION", value_parser = duration)]
    pub release_timeout: std::time::Duration,
    /// Reclaim: the audit log every action is written to first
    #[arg(
        long,
        default_value = defaults::AUDIT_LOG,
        value_name = "FILE"
    )]
    pub audit_log: std::path::PathBuf,
}

#[derive(Debug, Args, Clone)]
pub struct MetricsArgs {
    /// Watch the processes this long before classifying
    #[arg(long, default_value = "0.5s", value_name = "DURATION", value_parser = parse_sample)]
    pub sample: std::time::Duration,
    /// OpenMetrics text (what the agent sends Prometheus) instead of Prometheus' text format
    /// 0.0.4 (what node_exporter's textfile collector reads)
    #[arg(long)]
    pub openmetrics: bool,
}

#[derive(Debug, Args, Clone)]
pub struct SnapshotArgs {
    /// Watch the processes this long, and save what was seen with the snapshot
    #[arg(long, default_value = "0.5s", value_name = "DURATION", value_parser = parse_sample)]
    pub sample: std::time::Duration,
}

#[derive(Debug, Args, Clone)]
pub struct DiagnoseArgs {
    /// Print JSON (stable schema: json-schema.md, in /usr/share/doc/vramguard with the packages)
    #[arg(long)]
    pub json: bool,
    /// Only these GPUs, e.g. a finished job's (0,3): indices, GPU-… or MIG-… UUIDs [default: all]
    #[arg(long, value_delimiter = ',', value_name = "GPU", value_parser = gpu_selector)]
    pub gpu: Vec<GpuSelector>,
    /// Refresh every INTERVAL until interrupted, like `status --watch` [default interval: 2s]
    #[arg(long, value_name = "INTERVAL", num_args = 0..=1, default_missing_value = "2s",
          value_parser = parse_refresh)]
    pub watch: Option<std::time::Duration>,
    /// Watch CPU use and running threads this long before classifying (0: skip; work is
    /// then unknown)
    #[arg(long, default_value = "0.5s", value_name = "DURATION", value_parser = parse_sample)]
    pub sample: std::time::Duration,
}

#[derive(Debug, Args, Clone)]
pub struct ReclaimArgs {
    /// GPUs to act on: indices, GPU-… or MIG-… UUIDs (a MIG device: only its holders), e.g.
    /// 0,3 [default: all]
    #[arg(long, value_delimiter = ',', value_name = "GPU", value_parser = gpu_selector)]
    pub gpu: Vec<GpuSelector>,
    /// Classes to target: orphan, hidden (only when its job is gone, or it keeps an exited
    /// pid's context in a plain process group), zombie, idle, detached (working processes
    /// whose launcher is gone: only when named, with a warning); shm adds orphaned
    /// shared-memory segments ([shm] in the config says which); keepers adds idle keepers of
    /// exited pids inside live jobs a unit, Slurm or a container owns (never a live vramguard run)
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "CLASS",
        value_parser = included
    )]
    pub include: Vec<Included>,
    /// Only the holders of this job, by the label status shows (slurm:4242 also matches its
    /// steps; pod:<uid>, docker:<name>, pgid:<n>); other holders are not considered
    #[arg(long, value_name = "JOB")]
    pub job: Option<String>,
    /// With --include idle: only holders idle at least this long
    #[arg(long, default_value = "2h", value_name = "DURATION", value_parser = duration)]
    pub idle_for: Duration,
    /// Time between SIGTERM and SIGKILL
    #[arg(long, default_value = defaults::GRACE, value_name = "DURATION", value_parser = duration)]
    pub grace: Duration,
    /// Time to wait for the driver to release the memory
    #[arg(long, default_value = defaults::RELEASE_TIMEOUT, value_name = "DURATION", value_parser = duration)]
    pub release_timeout: Duration,
    /// Reset GPUs where memory no process holds remains: never, auto (only proven residue,
    /// nothing holding the device), force (any unaccounted memory, nothing holding the device)
    #[arg(long, default_value = defaults::RESET, value_name = "WHEN", value_parser = reset_mode)]
    pub reset: vramguard_ops::ResetMode,
    /// Reset command, run without a shell; {index}, {uuid} and {pci_bus_id} are replaced
    /// [default: nvidia-smi --gpu-reset -i {index}; the simulator's reset with --sim]
    #[arg(long, value_name = "COMMAND")]
    pub reset_command: Option<String>,
    /// Audit log (JSON lines, fsynced per record)
    #[arg(
        long,
        default_value = defaults::AUDIT_LOG,
        value_name = "FILE"
    )]
    pub audit_log: std::path::PathBuf,
    /// Act without asking
    #[arg(long, short = 'y')]
    pub yes: bool,
    /// Print the plan only (the default when stdin is not a terminal and --yes is absent)
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON
    #[arg(long)]
    pub json: bool,
    /// Watch every candidate's CPU use and running threads this long before deciding: a
    /// process that shows any work is left alone
    #[arg(long, default_value = defaults::RECLAIM_SAMPLE, value_name = "DURATION", value_parser = parse_sample)]
    pub sample: std::time::Duration,
}

#[derive(Debug, Args, Clone)]
pub struct RunArgs {
    /// Time between SIGTERM and SIGKILL for what remains when the job ends or is stopped
    #[arg(long, default_value = defaults::GRACE, value_name = "DURATION", value_parser = duration)]
    pub grace: Duration,
    /// Time to wait for the driver to release the job's GPU memory after it ended
    #[arg(long, default_value = defaults::RELEASE_TIMEOUT, value_name = "DURATION", value_parser = duration)]
    pub release_timeout: Duration,
    /// Forward signals to the main process only (default: to its whole group or cgroup)
    #[arg(long)]
    pub no_signal_group: bool,
    /// Containment: auto (cgroup v2 when writable, else process group), cgroup, group
    #[arg(long, default_value = "auto", value_name = "HOW", value_parser = isolation)]
    pub isolation: vramguard_ops::supervise::Isolation,
    /// Pick GPUs and set CUDA_VISIBLE_DEVICES: auto:N (the N with the most free memory)
    #[arg(long, value_name = "auto:N")]
    pub gpus: Option<String>,
    #[command(flatten)]
    pub choice: GpuChoice,
    /// Exit with 125 when the job's GPU memory is not released within --release-timeout
    #[arg(long)]
    pub strict: bool,
    /// Also write the summary as JSON to this file
    #[arg(long, value_name = "FILE")]
    pub summary_json: Option<PathBuf>,
    /// The command and its arguments
    #[arg(trailing_var_arg = true, required = true, value_name = "CMD")]
    pub command: Vec<std::ffi::OsString>,
}

#[derive(Debug, Args, Clone)]
pub struct AgentArgs {
    /// Address to serve /metrics, / and /api/status on [default: [agent] listen, or
    /// 127.0.0.1:9835]
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<String>,
    /// Sampling interval [default: [agent] interval, or 1s]
    #[arg(long, value_name = "DURATION", value_parser = duration)]
    pub interval: Option<Duration>,
    /// TLS and basic authentication for the HTTP side, in the web config format Prometheus
    /// exporters share (node_exporter's flag) [default: [agent] web_config, or none]
    #[arg(long = "web.config.file", value_name = "FILE")]
    pub web_config_file: Option<PathBuf>,
    /// Log debug messages too
    #[arg(long, short = 'v')]
    pub verbose: bool,
}

#[derive(Debug, Subcommand)]
pub enum SlurmCommand {
    /// For a node vramguard drained (its reason starts with "vramguard:"): wait until no job
    /// runs on it, reset every GPU whose residue is proven and that nothing holds
    /// (--reset=auto), check all of them are clean, resume it. A node drained by anyone
    /// else, or for another reason, is left alone. Exit 0 resumed or nothing to do, 1 the node
    /// stays drained (reset failed, memory held, still busy), 2 error
    #[command(
        after_help = "Examples:\n  vramguard slurm heal --node gpu07\n  vramguard slurm heal --node $(hostname -s) --wait 2h --json"
    )]
    Heal(HealArgs),
}

#[derive(Debug, Args, Clone)]
pub struct HealArgs {
    /// The Slurm node name of this machine [default: $SLURMD_NODENAME, else the short host
    /// name]
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
    /// How long to wait for the node to have no running or completing job
    #[arg(long, default_value = "1h", value_name = "DURATION", value_parser = duration)]
    pub wait: Duration,
    /// How often to ask Slurm while waiting
    #[arg(long, default_value = "5s", value_name = "DURATION", value_parser = duration)]
    pub poll: Duration,
    /// Time between SIGTERM and SIGKILL for leftovers the plan targets
    #[arg(long, default_value = defaults::GRACE, value_name = "DURATION", value_parser = duration)]
    pub grace: Duration,
    /// Time to wait for the driver to release the memory
    #[arg(long, default_value = defaults::RELEASE_TIMEOUT, value_name = "DURATION", value_parser = duration)]
    pub release_timeout: Duration,
    /// Reset command, run without a shell; {index}, {uuid} and {pci_bus_id} are replaced
    /// [default: nvidia-smi --gpu-reset -i {index}; the simulator's reset with --sim]
    #[arg(long, value_name = "COMMAND")]
    pub reset_command: Option<String>,
    /// Audit log (JSON lines, fsynced per record)
    #[arg(long, default_value = defaults::AUDIT_LOG, value_name = "FILE")]
    pub audit_log: std::path::PathBuf,
    /// Watch CPU use and running threads this long before deciding
    #[arg(long, default_value = defaults::RECLAIM_SAMPLE, value_name = "DURATION", value_parser = parse_sample)]
    pub sample: std::time::Duration,
    /// Print JSON
    #[arg(long)]
    pub json: bool,
    /// Start the heal in a session of its own and return at once, printing its pid (what the
    /// epilog does: the heal is out of the epilog's process group before the epilog ends, so
    /// slurmd's clean-up of that group cannot reach it)
    #[arg(long)]
    pub detach: bool,
}

#[derive(Debug, Subcommand)]
pub enum ProbeCommand {
    /// Kill a holder with each signal, REPEAT times; time the release
    Release {
        #[command(flatten)]
        common: ProbeCommon,
        /// Signals to send
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "TERM,INT,KILL",
            value_name = "SIG"
        )]
        signals: Vec<String>,
        /// Trials per signal
        #[arg(long, default_value_t = 3)]
        repeat: u32,
        /// Children that inherit the holder's context (DataLoader-style); they keep the memory
        /// after the holder dies, which the report flags
        #[arg(long, default_value_t = 0)]
        children: u32,
    },
    /// Start WORKERS holders at once, kill them one by one
    Concurrent {
        #[command(flatten)]
        common: ProbeCommon,
        /// Holders
        #[arg(long, default_value_t = 4)]
        workers: u32,
        /// Kill order: random or sequential
        #[arg(long, default_value = "random")]
        kill: String,
        /// Signal
        #[arg(long, default_value = "KILL")]
        signal: String,
        /// Seed of the random kill order [default: from the clock, printed in the report]
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Time each NVML call of one sample of a GPU, as the agent and status make them
    /// (allocates nothing, signals nothing)
    Calls {
        /// The GPU: an index or a GPU-… UUID
        #[arg(long, default_value = "0", value_name = "GPU", value_parser = gpu_selector)]
        gpu: GpuSelector,
        /// Samples to time (1 to 100000)
        #[arg(long, default_value_t = 100)]
        samples: u32,
        /// Give up when the samples take longer than this (a call stuck in the driver)
        #[arg(long, default_value = "60s", value_name = "DURATION", value_parser = duration)]
        timeout: Duration,
        /// Print the figures as JSON
        #[arg(long)]
        json: bool,
    },
    /// Allocate and free every CYCLE for DURATION; fit the trend of the baseline
    Soak {
        #[command(flatten)]
        common: ProbeCommon,
        /// How long
        #[arg(long, default_value = "30m", value_name = "DURATION", value_parser = duration)]
        duration: Duration,
        /// One allocate/free cycle every
        #[arg(long, default_value = "5s", value_name = "DURATION", value_parser = duration)]
        cycle: Duration,
        /// Kill the holder with TERM, KILL and INT in turn (default: TERM only)
        #[arg(long)]
        kill_cycles: bool,
    },
}

#[derive(Debug, Args, Clone)]
pub struct ProbeCommon {
    /// The GPU to probe: an index or a GPU-… UUID
    #[arg(long, default_value = "0", value_name = "GPU", value_parser = gpu_selector)]
    pub gpu: GpuSelector,
    /// Memory per holder
    #[arg(long, default_value = "1GiB", value_name = "SIZE", value_parser = bytes)]
    pub size: u64,
    /// Your own holder, run with `sh -c`: it gets VRAMGUARD_PROBE_BYTES and
    /// CUDA_VISIBLE_DEVICES (e.g. a PyTorch one-liner, to measure your framework's context)
    #[arg(long, value_name = "COMMAND")]
    pub holder_cmd: Option<String>,
    /// How long to wait for memory to appear, and to be released
    #[arg(long, default_value = "60s", value_name = "DURATION", value_parser = duration)]
    pub timeout: Duration,
    /// Readings per second
    #[arg(long, default_value_t = 200)]
    pub rate: u32,
    /// Write report.md, report.json and SVG plots into this directory
    #[arg(long, value_name = "DIR")]
    pub report: Option<PathBuf>,
    /// Print the report as JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args, Clone)]
pub struct PickArgs {
    /// How many GPUs
    pub count: usize,
    #[command(flatten)]
    pub choice: GpuChoice,
}

/// How `run --gpus auto:N` and `pick N` choose GPUs.
#[derive(Debug, Args, Clone)]
pub struct GpuChoice {
    /// Only GPUs with at least this much free memory
    #[arg(long, value_name = "SIZE", value_parser = bytes)]
    pub min_free: Option<u64>,
    /// Wait this long for enough GPUs to be free
    #[arg(long, default_value = "0s", value_name = "DURATION", value_parser = duration)]
    pub wait: Duration,
    /// Name GPUs by UUID (stable across reboots) instead of index
    #[arg(long)]
    pub by_uuid: bool,
}

#[derive(Debug, Args, Clone)]
pub struct DemoArgs {
    /// Print JSON instead of the human report
    #[arg(long)]
    pub json: bool,
    /// Then reclaim: terminate the orphans, verify the release, try to reset the GPU with
    /// residue (audit log in the demo's temporary directory)
    #[arg(long)]
    pub reclaim: bool,
    /// Also save the incident's snapshot here (to replay with --replay)
    #[arg(long, value_name = "FILE")]
    pub save_snapshot: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum SimCommand {
    /// Create a state file and stand-in device files
    Init {
        /// Directory to create them in
        #[arg(long, default_value = "./vramguard-sim")]
        dir: PathBuf,
        /// Number of simulated GPUs
        #[arg(long, default_value_t = 2)]
        gpus: u32,
    },
    /// Run a process that holds simulated GPU memory until it is killed
    Hold(HoldArgs),
    /// Reset a simulated GPU (the stand-in for `nvidia-smi --gpu-reset -i N`)
    Reset {
        /// GPU index
        #[arg(long)]
        gpu: u32,
    },
    /// Print what the simulated driver reports now, as JSON
    Show,
    /// Create or grow the calling program's context on a GPU, for a stand-in CUDA client
    /// that opens the GPU's device file itself (the gpu-check rehearsal's PyTorch): the
    /// caller is this command's parent, and its context lives on the caller's descriptor
    /// --fd, as a real context lives on the device file it was created on. Exit 3: out of
    /// memory
    #[command(hide = true)]
    Attach {
        /// GPU index
        #[arg(long)]
        gpu: u32,
        /// Memory to add, e.g. 2GiB (0 to change only --sm-util)
        #[arg(long, value_parser = bytes)]
        bytes: u64,
        /// The caller's open descriptor of the GPU's stand-in device file, inherited
        #[arg(long, value_parser = clap::value_parser!(i32).range(0..))]
        fd: i32,
        /// SM utilization percent of the context from now on (a kernel loop), 0 to 100
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=100))]
        sm_util: Option<u32>,
    },
    /// Raise a critical Xid error on a simulated GPU (seen by NVML event sets, e.g. the agent's)
    Xid {
        /// GPU index
        #[arg(long)]
        gpu: u32,
        /// The Xid, e.g. 79 (fallen off the bus) or 94 (contained ECC error)
        xid: u64,
    },
    /// Set a simulated GPU's row-remapper counters (a reset applies a pending remap)
    Remap {
        /// GPU index
        #[arg(long)]
        gpu: u32,
        /// Rows remapped after correctable errors
        #[arg(long, default_value_t = 0)]
        correctable: u32,
        /// Rows remapped after uncorrectable errors
        #[arg(long, default_value_t = 0)]
        uncorrectable: u32,
        /// A remap waits for the next reset
        #[arg(long)]
        pending: bool,
        /// A remap failed
        #[arg(long)]
        failure: bool,
    },
}

#[derive(Debug, Args, Clone)]
pub struct HoldArgs {
    /// GPU index
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// Memory to hold, e.g. 8GiB
    #[arg(long, default_value = "1GiB", value_parser = bytes)]
    pub bytes: u64,
    /// What happens after exit: release, leak, or lag:DURATION (e.g. lag:1500ms)
    #[arg(long, default_value = "release")]
    pub after_exit: String,
    /// Not listed by the driver (a hidden holder)
    #[arg(long)]
    pub unlisted: bool,
    /// SM utilization percent while alive
    #[arg(long, default_value_t = 0)]
    pub sm_util: u32,
    /// Spawned workers (torch.multiprocessing spawn): each its own process with its own
    /// listed context of --worker-bytes on the same GPU
    #[arg(long, default_value_t = 0)]
    pub workers: u32,
    /// Workers forked after the context was created (DataLoader workers): they share its
    /// device files and keep its context; the driver lists none of them
    #[arg(long, default_value_t = 0)]
    pub forked_workers: u32,
    /// Memory per worker
    #[arg(long, default_value = "1GiB", value_parser = bytes)]
    pub worker_bytes: u64,
    /// Exit by itself after this long (a safety net)
    #[arg(long, default_value = "1h", value_parser = duration)]
    pub lifetime: Duration,
    /// Process name (comm) to take
    #[arg(long)]
    pub comm: Option<String>,
}
