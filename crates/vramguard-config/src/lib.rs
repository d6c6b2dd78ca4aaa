//! The config file (`/etc/vramguard/config.toml`), shared by every command: `[policy]` for
//! classification, and for the agent `[agent]`, `[alerts]` and `[reclaim]`. Sizes and durations
//! are written the way admins write them (`"256MiB"`, `"10m"`); unknown keys are errors with
//! their line, and every value is checked when the file is read, so a reload with a bad file
//! keeps the running config.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use vramguard_core::Policy;
use vramguard_core::report::Class;
use vramguard_core::units::{parse_bytes, parse_duration};

/// The default config path, read when it exists.
pub const DEFAULT_CONFIG: &str = "/etc/vramguard/config.toml";

/// The config path that means "no file: the defaults", even where [`DEFAULT_CONFIG`] exists
/// (`--config none`, `VRAMGUARD_CONFIG=none`): what the test suite runs with, so that a node
/// with vramguard installed runs it as any other does. A file of that name is `./none`.
pub const NO_CONFIG: &str = "none";

/// Defaults that a command-line flag shares with a config key: written once, here, and used
/// by the config ([`Config::default`]) and by the flags (`--grace`, `--release-timeout`, …),
/// whose default at run time is the config file's value where it sets one.
pub mod defaults {
    /// `[reclaim] grace`, `--grace`: SIGTERM, then this long, then SIGKILL.
    pub const GRACE: &str = "10s";
    /// `[reclaim] release_timeout`, `--release-timeout`.
    pub const RELEASE_TIMEOUT: &str = "1m";
    /// `[reclaim] reset`, `reclaim --reset`.
    pub const RESET: &str = "never";
    /// `[reclaim] sample`, `reclaim --sample`.
    pub const RECLAIM_SAMPLE: &str = "2s";
    /// `[reclaim] audit_log`, `--audit-log`.
    pub const AUDIT_LOG: &str = vramguard_ops::DEFAULT_AUDIT_LOG;
    /// `[driver] call_timeout`.
    pub const CALL_TIMEOUT: &str = "5s";
}

/// The shipped example config, `deploy/config.toml`: every key at its default (a test holds
/// it to [`Config::default`]); `vramguard config show` lists its keys.
pub const DEFAULTS_DOCUMENT: &str = include_str!("../../../deploy/config.toml");

/// A config that cannot be used: the file, and what is wrong where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("config {path}: {message}")]
pub struct ConfigError {
    /// The file.
    pub path: String,
    /// What is wrong (with the key and line).
    pub message: String,
}

/// The file as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    policy: RawPolicy,
    #[serde(default)]
    agent: RawAgent,
    #[serde(default)]
    alerts: RawAlerts,
    #[serde(default)]
    reclaim: RawReclaim,
    #[serde(default)]
    containers: RawContainers,
    #[serde(default)]
    shm: RawShm,
    #[serde(default)]
    kubernetes: RawKubernetes,
    #[serde(default)]
    driver: RawDriver,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDriver {
    call_timeout: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKubernetes {
    pod_resources_socket: Option<PathBuf>,
    timeout: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShm {
    dirs: Option<Vec<PathBuf>>,
    producers: Option<Vec<String>>,
    min_age: Option<String>,
    owner_rule: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawContainers {
    docker_root: Option<PathBuf>,
    podman_root: Option<PathBuf>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPolicy {
    tolerance: Option<String>,
    tolerance_ratio: Option<f64>,
    idle_after: Option<String>,
    #[serde(default)]
    baseline: BTreeMap<String, String>,
    #[serde(default)]
    system_comms: Vec<String>,
    work_cpu_percent: Option<f64>,
    gpu_busy_recent: Option<String>,
    gpu_work_min_percent: Option<u32>,
    system_max_uid: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAgent {
    listen: Option<String>,
    interval: Option<String>,
    discover_every: Option<String>,
    recheck_every: Option<String>,
    full_scan_every: Option<String>,
    watch_opens: Option<bool>,
    top_holders: Option<usize>,
    trend_window: Option<String>,
    timeline: Option<String>,
    show_cmdline: Option<bool>,
    dcgm_labels: Option<bool>,
    web_config: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAlerts {
    #[serde(default = "yes")]
    log: bool,
    #[serde(default)]
    rule: Vec<RawRule>,
    #[serde(default)]
    webhook: Vec<RawWebhook>,
    #[serde(default)]
    exec: Vec<RawExec>,
}

fn yes() -> bool {
    true
}

impl Default for RawAlerts {
    fn default() -> Self {
        RawAlerts {
            log: true,
            rule: Vec::new(),
            webhook: Vec::new(),
            exec: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    when: String,
    above: Option<toml::Value>,
    #[serde(rename = "for")]
    for_: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWebhook {
    url: String,
    timeout: Option<String>,
    retries: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExec {
    argv: Vec<String>,
    timeout: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReclaim {
    #[serde(default)]
    auto: bool,
    min_age: Option<String>,
    include: Option<Vec<String>>,
    grace: Option<String>,
    release_timeout: Option<String>,
    reset: Option<String>,
    audit_log: Option<String>,
    sample: Option<String>,
    reset_lock: Option<String>,
}

/// The line (1-based) of `key` in a config text: `agent.top_holders` is the `top_holders`
/// line of the `[agent]` table, `alerts.webhook[1].url` the `url` line of the second
/// `[[alerts.webhook]]`. `None` when it cannot be found (a key written inline, say).
fn line_of(text: &str, key: &str) -> Option<usize> {
    let (table, field) = key.rsplit_once('.')?;
    let field = field.split_whitespace().next()?;
    let (table, nth) = match table.split_once('[') {
        Some((t, rest)) => (t, rest.trim_end_matches(']').parse::<usize>().ok()?),
        None => (table, 0),
    };
    let header = |l: &str| {
        let l = l.trim();
        l == format!("[{table}]") || l == format!("[[{table}]]")
    };
    let mut seen = 0;
    let mut inside = false;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if trimmed.starts_with('[') {
            inside = header(trimmed) && {
                seen += 1;
                seen == nth + 1
            };
            continue;
        }
        if inside
            && trimmed
                .strip_prefix(field)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        {
            return Some(i + 1);
        }
    }
    None
}

/// The agent's full fd scan period when device opens are not watched: the scan is then the
/// only way an old process that opens a device file without making a context is found.
pub const FULL_SCAN_EVERY: Duration = Duration::from_secs(60);

/// The agent's default `/proc` listing period ([`AgentConfig::discover_every`]).
pub const DISCOVER_EVERY: Duration = Duration::from_secs(5);

/// The agent's default re-read period of the holders ([`AgentConfig::recheck_every`]).
pub const RECHECK_EVERY: Duration = Duration::from_secs(5);

/// The agent's listing and re-read period, unless configured, while its last sample left
/// nothing undecided (every holder in a live job or the system's, no ghost or unexplained
/// memory, no alert pending, automatic reclaim off): an exit of any process it follows, a
/// device open and a change of used memory still bring a full sample at once.
pub const CALM_PERIOD: Duration = Duration::from_secs(30);
/// The full fd scan period while device opens are watched: opens name new holders at once,
/// new processes are found by the listing, and the scan remains a safety net (inherited
/// files of a process it missed, a container's own device nodes).
pub const FULL_SCAN_EVERY_WATCHED: Duration = Duration::from_secs(600);

/// `[agent]`.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// Where to serve metrics and the status page. Default `127.0.0.1:9835`: loopback;
    /// binding elsewhere is an explicit choice.
    pub listen: String,
    /// Steady-state sampling interval. Default 1 s.
    pub interval: Duration,
    /// How often to look for new processes (a `/proc` listing). `None` (the default):
    /// [`DISCOVER_EVERY`], or [`CALM_PERIOD`] while the agent's last sample left nothing
    /// undecided and device opens are watched (a new holder is then seen by its open).
    pub discover_every: Option<Duration>,
    /// How often to re-read every holder's `/proc` state even though no watched process
    /// exited (exits are seen at once through pidfds). Bounds how late a leader thread that
    /// exits while another thread hangs in D state is seen. `None` (the default):
    /// [`RECHECK_EVERY`], or [`CALM_PERIOD`] while the agent's last sample left nothing
    /// undecided.
    pub recheck_every: Option<Duration>,
    /// How often to scan every process's open files (hidden holders), besides whenever a GPU
    /// shows unaccounted memory (at most every 10 s). `None` (the default):
    /// [`FULL_SCAN_EVERY_WATCHED`] while device opens are watched, else [`FULL_SCAN_EVERY`].
    pub full_scan_every: Option<Duration>,
    /// Watch the device files for opens (fanotify, as root): a process that opens one is seen
    /// at once instead of at the next full scan. Default true; where the kernel or privileges
    /// do not allow it, the agent says so once and relies on scans.
    pub watch_opens: bool,
    /// Holders exported per GPU; the rest are rolled up as `pid="other"`. Default 10.
    pub top_holders: usize,
    /// Show command lines on `/` and `/api/status`. Default false: any local user can reach
    /// them, and a command line can carry secrets that `hidepid` would hide; the command
    /// name is shown instead.
    pub show_cmdline: bool,
    /// Per-GPU series also carry dcgm-exporter's label names (`UUID`, `modelName`,
    /// `Hostname`), so that PromQL can join them with DCGM's series.
    pub dcgm_labels: bool,
    /// TLS and basic authentication for the HTTP side, in the web config format Prometheus
    /// exporters share (see `vramguard_agent::web`). Default: none (plain HTTP, loopback).
    pub web_config: Option<PathBuf>,
    /// Window of the leak trend. Default 30 min.
    pub trend_window: Duration,
    /// Length of the status page's memory timeline. Default 10 min.
    pub timeline: Duration,
}

/// What an alert rule watches, per GPU.
#[derive(Debug, Clone, PartialEq)]
pub enum Condition {
    /// Ghost memory (orphan, zombie, significant unaccounted) above a size.
    GhostBytes(u64),
    /// Used memory above a size.
    UsedBytes(u64),
    /// Used memory above a share of total (0–1).
    UsedRatio(f64),
    /// The used-memory trend's lower 95% bound above this many bytes per hour.
    LeakSlope(f64),
    /// Holders of a class (`orphan`, `zombie`...) present.
    Holders(Class),
    /// The GPU cannot be read.
    GpuLost,
    /// A row remap or page retirement waits for a reset, or a remap failed.
    MemoryHealth,
}

/// One alert rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Its name (in notifications and metrics).
    pub name: String,
    /// The condition.
    pub condition: Condition,
    /// How long the condition must hold before it fires.
    pub for_: Duration,
}

/// A webhook sink: POST of a JSON body, retried with backoff.
#[derive(Debug, Clone, PartialEq)]
pub struct Webhook {
    /// URL (`http://` or `https://`).
    pub url: String,
    /// Per attempt.
    pub timeout: Duration,
    /// Attempts after the first.
    pub retries: u32,
}

/// An exec sink: run argv (no shell) with the alert in `VRAMGUARD_ALERT_*` variables.
#[derive(Debug, Clone, PartialEq)]
pub struct Exec {
    /// The command and its arguments.
    pub argv: Vec<String>,
    /// Kill it after this long.
    pub timeout: Duration,
}

/// `[alerts]`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AlertsConfig {
    /// Log every firing and resolution.
    pub log: bool,
    /// Rules.
    pub rules: Vec<Rule>,
    /// Webhooks.
    pub webhooks: Vec<Webhook>,
    /// Commands.
    pub execs: Vec<Exec>,
}

/// `[reclaim]`: automatic reclaim by the agent (off by default).
#[derive(Debug, Clone, PartialEq)]
pub struct ReclaimConfig {
    /// Reclaim on its own.
    pub auto: bool,
    /// A target must have been reclaimable this long.
    pub min_age: Duration,
    /// Classes to target.
    pub include: Vec<Class>,
    /// SIGTERM → SIGKILL.
    pub grace: Duration,
    /// Wait for the driver.
    pub release_timeout: Duration,
    /// When to reset a GPU after reclaiming.
    pub reset: vramguard_ops::ResetMode,
    /// How long an automatic reclaim watches its targets work before it acts (the agent's
    /// own history must also show no work for `min_age`).
    pub sample: Duration,
    /// The audit log.
    pub audit_log: PathBuf,
    /// The reset lock: written before a reset, it pauses the agent's driver calls (see
    /// [`vramguard_ops::reset_lock`]).
    pub reset_lock: PathBuf,
}

/// The whole, checked config.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Where it was read from.
    pub path: Option<PathBuf>,
    /// Classification.
    pub policy: Policy,
    /// The agent.
    pub agent: AgentConfig,
    /// Alerts.
    pub alerts: AlertsConfig,
    /// Auto-reclaim.
    pub reclaim: ReclaimConfig,
    /// Where container runtimes keep their state (for container names).
    pub containers: ContainersConfig,
    /// Shared-memory directories.
    pub shm: ShmConfig,
    /// The kubelet's pod-resources API.
    pub kubernetes: KubernetesConfig,
    /// The GPU driver.
    pub driver: DriverConfig,
    /// The file as written (absent with no file): which values it sets, for `vramguard
    /// config show` and `--help`'s defaults.
    pub document: Option<toml::Table>,
}

/// Where a setting's value came from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "path")]
pub enum Source {
    /// The built-in default.
    Default,
    /// The config file.
    File(PathBuf),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Default => f.write_str("default"),
            Source::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// One effective setting, for `vramguard config show`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Setting {
    /// `section.key`.
    pub key: String,
    /// Its value, as TOML writes it.
    pub value: String,
    /// Where it came from.
    pub source: Source,
}

/// `[driver]`: how vramguard talks to the GPU driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverConfig {
    /// How long one NVML call may block before its GPU is reported as not answering (the
    /// other GPUs are still shown, and `status` exits 2). Default 5 s: a healthy driver
    /// answers in milliseconds; a GPU in a bad state blocks for tens of seconds.
    pub call_timeout: Duration,
}

/// `[kubernetes]`: where the kubelet serves pod-resources, and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesConfig {
    /// The kubelet's socket (absent on nodes that are not Kubernetes nodes: no error).
    pub pod_resources_socket: PathBuf,
    /// Wait at most this long for an answer (default 500 ms, below the agent's interval).
    pub timeout: Duration,
}

/// `[containers]`: where Docker and Podman keep the state container names are read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainersConfig {
    /// Docker's data root.
    pub docker_root: PathBuf,
    /// Podman's (rootful) storage root.
    pub podman_root: PathBuf,
}

/// `[shm]`: the shared-memory directories scanned for segments dead jobs left (the rest of
/// the table, which segments count as orphaned, is [`Policy::shm`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmConfig {
    /// tmpfs directories to scan (default `/dev/shm`; empty: no scan).
    pub dirs: Vec<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config::from_raw(None, RawConfig::default()).expect("the defaults are valid")
    }
}

/// What [`Config::load`] found: the config, and a note for the user when the default file
/// was set aside.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The config to run on.
    pub config: Config,
    /// Why the default file was not read (this user may not read it), said once on stderr;
    /// `None` when nothing was set aside.
    pub note: Option<String>,
}

impl Config {
    /// Reads `path`, or the default path when it exists, or nothing; [`NO_CONFIG`] is
    /// nothing, whatever exists. The default file that this user may not read (an admin made
    /// it 0640) gives the defaults and a note: `status` and `top` are for every user, and
    /// that file holds nothing they need. A file named on the command line or in
    /// `VRAMGUARD_CONFIG` that cannot be read is an error.
    pub fn load(path: Option<&Path>) -> Result<Loaded, ConfigError> {
        Config::load_with_default(path, Path::new(DEFAULT_CONFIG))
    }

    /// [`Config::load`] with `default` in place of [`DEFAULT_CONFIG`].
    fn load_with_default(path: Option<&Path>, default: &Path) -> Result<Loaded, ConfigError> {
        let defaults = |note| Loaded {
            config: Config::default(),
            note,
        };
        let (path, named) = match path {
            Some(p) if p.as_os_str() == NO_CONFIG => return Ok(defaults(None)),
            Some(p) => (p.to_path_buf(), true),
            None => (default.to_path_buf(), false),
        };
        let cannot_read = |e: &vramguard_fs::FileError| ConfigError {
            path: path.display().to_string(),
            message: format!("cannot be read: {}", e.reason()),
        };
        let text =
            match vramguard_fs::read_root_config_to_string(&path, vramguard_fs::MAX_INPUT_BYTES) {
                Ok(text) => text,
                Err(e) if !named && e.is_not_found() => return Ok(defaults(None)),
                Err(e) if !named && e.is_permission_denied() => {
                    return Ok(defaults(Some(format!(
                        "{}; running on the defaults (--config FILE names another file)",
                        cannot_read(&e)
                    ))));
                }
                Err(e) => return Err(cannot_read(&e)),
            };
        Ok(Loaded {
            config: Config::parse(&path, &text)?,
            note: None,
        })
    }

    /// The file's value of `section.key`, when the file sets it.
    pub fn set_in_file(&self, section: &str, key: &str) -> Option<&toml::Value> {
        self.document.as_ref()?.get(section)?.as_table()?.get(key)
    }

    /// Where `section.key`'s value comes from.
    pub fn source_of(&self, section: &str, key: &str) -> Source {
        match (self.set_in_file(section, key), &self.path) {
            (Some(_), Some(path)) => Source::File(path.clone()),
            _ => Source::Default,
        }
    }

    /// Every setting with its effective value and where it came from: each key of the
    /// shipped defaults ([`DEFAULTS_DOCUMENT`]), then what the file sets beyond them
    /// (baselines, alert rules).
    pub fn settings(&self) -> Vec<Setting> {
        let defaults: toml::Table =
            toml::from_str(DEFAULTS_DOCUMENT).expect("the shipped defaults parse");
        let empty = toml::Table::new();
        let document = self.document.as_ref().unwrap_or(&empty);
        let mut sections: Vec<&String> = defaults.keys().collect();
        sections.extend(document.keys().filter(|k| !defaults.contains_key(*k)));
        let mut out = Vec::new();
        for section in sections {
            let shipped = defaults.get(section).and_then(|t| t.as_table());
            let written = document.get(section).and_then(|t| t.as_table());
            let mut keys: Vec<&String> = shipped.map(|t| t.keys().collect()).unwrap_or_default();
            if let Some(w) = written {
                keys.extend(
                    w.keys()
                        .filter(|k| !shipped.is_some_and(|t| t.contains_key(*k))),
                );
            }
            for key in keys {
                let value = written
                    .and_then(|t| t.get(key))
                    .or_else(|| shipped.and_then(|t| t.get(key)));
                if let Some(value) = value {
                    out.push(Setting {
                        key: format!("{section}.{key}"),
                        value: value.to_string(),
                        source: self.source_of(section, key),
                    });
                }
            }
        }
        out
    }

    /// Parses a config document; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError {
            path: path.display().to_string(),
            message: e.to_string().trim_end().replace('\n', " "),
        })?;
        let mut config = Config::from_raw(Some(path), raw).map_err(|mut e| {
            // Name the line of the offending key, where it can be found.
            if let Some(key) = e.message.split(": ").next()
                && let Some(line) = line_of(text, key)
            {
                e.message = format!("line {line}: {}", e.message);
            }
            e
        })?;
        config.document = toml::from_str(text).ok();
        Ok(config)
    }

    fn from_raw(path: Option<&Path>, raw: RawConfig) -> Result<Config, ConfigError> {
        let c = Checker {
            name: path.map_or("(defaults)".to_string(), |p| p.display().to_string()),
        };
        let mut policy = policy(&c, &raw.policy)?;
        policy.shm = shm_policy(&c, &raw.shm)?;
        let config = Config {
            path: path.map(Path::to_path_buf),
            policy,
            kubernetes: KubernetesConfig {
                pod_resources_socket: raw.kubernetes.pod_resources_socket.clone().unwrap_or_else(
                    || PathBuf::from("/var/lib/kubelet/pod-resources/kubelet.sock"),
                ),
                timeout: c.dur(
                    "kubernetes.timeout",
                    &raw.kubernetes.timeout,
                    Duration::from_millis(500),
                )?,
            },
            document: None,
            driver: DriverConfig {
                call_timeout: c.dur_or(
                    "driver.call_timeout",
                    &raw.driver.call_timeout,
                    defaults::CALL_TIMEOUT,
                )?,
            },
            shm: ShmConfig {
                dirs: raw
                    .shm
                    .dirs
                    .clone()
                    .unwrap_or_else(|| vec![PathBuf::from("/dev/shm")]),
            },
            agent: agent(&c, &raw.agent)?,
            alerts: alerts(&c, &raw.alerts)?,
            reclaim: reclaim(&c, &raw.reclaim)?,
            containers: ContainersConfig {
                docker_root: raw
                    .containers
                    .docker_root
                    .clone()
                    .unwrap_or_else(|| PathBuf::from("/var/lib/docker")),
                podman_root: raw
                    .containers
                    .podman_root
                    .clone()
                    .unwrap_or_else(|| PathBuf::from("/var/lib/containers/storage")),
            },
        };
        if let Some((key, why)) = config.auto_reclaim_sampling(config.agent.interval) {
            return Err(c.err(key, why));
        }
        Ok(config)
    }
}

impl Config {
    /// Why automatic reclaim cannot rest on samples `interval` apart, if it is on and cannot:
    /// the key at fault and what is wrong. Checked at load (and so at every reload) and for
    /// the agent's `--interval`.
    /// - GPU work counts when it was seen in the last `gpu_busy_recent`: samples further
    ///   apart leave moments nobody looked at, and a job computing only then would be
    ///   reclaimed.
    /// - `min_age` must span at least three samples: a holder is taken only when several
    ///   samples agree it is orphaned, never on one reading (a `min_age` of a millisecond
    ///   would signal on the first sample that saw it).
    pub fn auto_reclaim_sampling(&self, interval: Duration) -> Option<(&'static str, String)> {
        if !self.reclaim.auto {
            return None;
        }
        let fmt = vramguard_core::units::format_duration;
        let recent = Duration::from_secs(self.policy.gpu_busy_recent_secs);
        if interval > recent {
            return Some((
                "agent.interval",
                format!(
                    "{} is longer than policy.gpu_busy_recent ({}) while [reclaim] auto is on: \
                     GPU work between two samples would go unseen; sample at least that often",
                    fmt(interval),
                    fmt(recent)
                ),
            ));
        }
        let floor = interval
            .checked_mul(MIN_AGE_SAMPLES)
            .unwrap_or(Duration::MAX);
        if self.reclaim.min_age < floor {
            return Some((
                "reclaim.min_age",
                format!(
                    "{} is shorter than {MIN_AGE_SAMPLES} samples ({} at agent.interval {}) while \
                     [reclaim] auto is on: a holder is reclaimed only when several samples agree; \
                     raise min_age or sample more often",
                    fmt(self.reclaim.min_age),
                    fmt(floor),
                    fmt(interval)
                ),
            ));
        }
        None
    }
}

/// The fewest samples `[reclaim] min_age` must span while automatic reclaim is on.
pub const MIN_AGE_SAMPLES: u32 = 3;

/// Checks values of one file, naming the file and the key in every error.
struct Checker {
    name: String,
}

impl Checker {
    fn err(&self, key: &str, msg: String) -> ConfigError {
        ConfigError {
            path: self.name.clone(),
            message: format!("{key}: {msg}"),
        }
    }

    /// A duration, `default` when absent. No duration here means anything at zero: an
    /// interval, a window, a wait.
    fn dur(
        &self,
        key: &str,
        v: &Option<String>,
        default: Duration,
    ) -> Result<Duration, ConfigError> {
        match v {
            None => Ok(default),
            Some(s) => match parse_duration(s) {
                Ok(d) if d.is_zero() => Err(self.err(key, format!("{s:?} must be longer than 0"))),
                Ok(d) => Ok(d),
                Err(e) => Err(self.err(key, e.to_string())),
            },
        }
    }

    /// Like [`Checker::dur`], with the default written as the file would write it.
    fn dur_or(
        &self,
        key: &str,
        v: &Option<String>,
        default: &str,
    ) -> Result<Duration, ConfigError> {
        self.dur(
            key,
            &Some(v.clone().unwrap_or_else(|| default.to_string())),
            Duration::ZERO,
        )
    }

    fn size(&self, key: &str, s: &str) -> Result<u64, ConfigError> {
        parse_bytes(s).map_err(|e| self.err(key, e.to_string()))
    }
}

/// `[shm]`, the part that judges segments.
fn shm_policy(c: &Checker, s: &RawShm) -> Result<vramguard_core::host::ShmPolicy, ConfigError> {
    let mut policy = vramguard_core::host::ShmPolicy::default();
    if let Some(dirs) = &s.dirs {
        for d in dirs {
            if !d.is_absolute() || d.as_os_str().is_empty() {
                return Err(c.err(
                    "shm.dirs",
                    format!("{:?} is not an absolute path", d.display().to_string()),
                ));
            }
        }
    }
    if let Some(p) = &s.producers {
        if let Some(bad) = p.iter().find(|p| p.len() < 3 || p.contains('/')) {
            return Err(c.err(
                "shm.producers",
                format!("{bad:?}: a producer prefix has at least 3 characters and no '/'"),
            ));
        }
        policy.producers = p.clone();
    }
    policy.min_age_secs = c
        .dur(
            "shm.min_age",
            &s.min_age,
            Duration::from_secs(policy.min_age_secs),
        )?
        .as_secs();
    if let Some(rule) = &s.owner_rule {
        policy.owner_rule = rule
            .parse()
            .map_err(|e| c.err("shm.owner_rule", format!("{e}")))?;
    }
    Ok(policy)
}

/// `[policy]`.
fn policy(c: &Checker, p: &RawPolicy) -> Result<Policy, ConfigError> {
    let mut policy = Policy::default();
    if let Some(t) = &p.tolerance {
        policy.tolerance_bytes = c.size("policy.tolerance", t)?;
    }
    if let Some(r) = p.tolerance_ratio {
        if !(0.0..=1.0).contains(&r) {
            return Err(c.err(
                "policy.tolerance_ratio",
                format!("{r} is not between 0 and 1"),
            ));
        }
        policy.tolerance_ratio = r;
    }
    policy.idle_after_secs = c
        .dur(
            "policy.idle_after",
            &p.idle_after,
            Duration::from_secs(policy.idle_after_secs),
        )?
        .as_secs();
    for (gpu, s) in &p.baseline {
        policy
            .baseline_bytes
            .insert(gpu.clone(), c.size(&format!("policy.baseline.{gpu}"), s)?);
    }
    policy.system_comms.extend(p.system_comms.iter().cloned());
    if let Some(pct) = p.work_cpu_percent {
        if !(pct > 0.0 && pct <= 100.0) {
            return Err(c.err(
                "policy.work_cpu_percent",
                format!("{pct}: expected a percentage of one core above 0, at most 100"),
            ));
        }
        policy.work_cpu_percent = pct;
    }
    policy.gpu_busy_recent_secs = c
        .dur(
            "policy.gpu_busy_recent",
            &p.gpu_busy_recent,
            Duration::from_secs(policy.gpu_busy_recent_secs),
        )?
        .as_secs()
        .max(1);
    if let Some(pct) = p.gpu_work_min_percent {
        if !(1..=100).contains(&pct) {
            return Err(c.err(
                "policy.gpu_work_min_percent",
                format!("{pct}: expected a percentage from 1 to 100"),
            ));
        }
        policy.gpu_work_min_percent = pct;
    }
    if let Some(uid) = p.system_max_uid {
        policy.system_max_uid = uid;
    }

    Ok(policy)
}

/// `[agent]`.
fn agent(c: &Checker, a: &RawAgent) -> Result<AgentConfig, ConfigError> {
    let agent = AgentConfig {
        listen: a.listen.clone().unwrap_or_else(|| "127.0.0.1:9835".into()),
        interval: c.dur("agent.interval", &a.interval, Duration::from_secs(1))?,
        discover_every: match a.discover_every {
            None => None,
            Some(_) => Some(c.dur("agent.discover_every", &a.discover_every, DISCOVER_EVERY)?),
        },
        recheck_every: match a.recheck_every {
            None => None,
            Some(_) => Some(c.dur("agent.recheck_every", &a.recheck_every, RECHECK_EVERY)?),
        },
        full_scan_every: match a.full_scan_every {
            None => None,
            Some(_) => Some(c.dur("agent.full_scan_every", &a.full_scan_every, FULL_SCAN_EVERY)?),
        },
        watch_opens: a.watch_opens.unwrap_or(true),
        top_holders: a.top_holders.unwrap_or(10),
        show_cmdline: a.show_cmdline.unwrap_or(false),
        dcgm_labels: a.dcgm_labels.unwrap_or(false),
        web_config: a.web_config.as_deref().map(PathBuf::from),
        trend_window: c.dur(
            "agent.trend_window",
            &a.trend_window,
            Duration::from_secs(1800),
        )?,
        timeline: c.dur("agent.timeline", &a.timeline, Duration::from_secs(600))?,
    };
    if agent.interval < Duration::from_millis(50) {
        return Err(c.err("agent.interval", "at least 50ms".into()));
    }
    if agent.top_holders == 0 {
        return Err(c.err(
            "agent.top_holders",
            "0: at least 1 holder per GPU is exported".into(),
        ));
    }
    if agent.listen.parse::<std::net::SocketAddr>().is_err() {
        return Err(c.err(
            "agent.listen",
            format!("{:?} is not an address:port", agent.listen),
        ));
    }

    Ok(agent)
}

/// `[[alerts.rule]]` number `i`.
fn rule(c: &Checker, i: usize, r: &RawRule) -> Result<Rule, ConfigError> {
    let key = format!("alerts.rule[{i}] ({})", r.name);
    let above_str = |what: &str| -> Result<String, ConfigError> {
        match &r.above {
            Some(toml::Value::String(s)) => Ok(s.clone()),
            Some(toml::Value::Integer(n)) => Ok(n.to_string()),
            Some(toml::Value::Float(f)) => Ok(f.to_string()),
            _ => Err(c.err(&key, format!("`above` ({what}) is required"))),
        }
    };
    let condition = match r.when.as_str() {
        "ghost_bytes" => Condition::GhostBytes(c.size(&key, &above_str("a size")?)?),
        "used_bytes" => Condition::UsedBytes(c.size(&key, &above_str("a size")?)?),
        "used_ratio" => {
            let v: f64 = above_str("a ratio")?
                .parse()
                .map_err(|_| c.err(&key, "above: a ratio between 0 and 1".into()))?;
            if !(0.0..=1.0).contains(&v) {
                return Err(c.err(&key, "above: a ratio between 0 and 1".into()));
            }
            Condition::UsedRatio(v)
        }
        "leak_slope" => {
            let s = above_str("a size per hour, e.g. \"1GiB\"")?;
            Condition::LeakSlope(c.size(&key, s.trim_end_matches("/h"))? as f64)
        }
        "gpu_lost" => Condition::GpuLost,
        "memory_health" => Condition::MemoryHealth,
        other => match other.strip_suffix("_holders").map(str::parse::<Class>) {
            Some(Ok(class)) => Condition::Holders(class),
            _ => {
                return Err(c.err(
                    &key,
                    format!(
                        "when = {other:?}: expected ghost_bytes, used_bytes, used_ratio, leak_slope, gpu_lost, memory_health or <class>_holders (orphan_holders, zombie_holders...)"
                    ),
                ));
            }
        },
    };
    Ok(Rule {
        name: r.name.clone(),
        condition,
        // Zero is meaningful here: fire at the first sample that matches.
        for_: match &r.for_ {
            None => Duration::ZERO,
            Some(s) => {
                parse_duration(s).map_err(|e| c.err(&format!("{key}.for"), e.to_string()))?
            }
        },
    })
}

/// `[[alerts.webhook]]` number `i`: an http(s) URL that names a host.
fn webhook(c: &Checker, i: usize, w: &RawWebhook) -> Result<Webhook, ConfigError> {
    let host = w
        .url
        .strip_prefix("http://")
        .or_else(|| w.url.strip_prefix("https://"))
        .map(|rest| rest.split(['/', '?', '#']).next().unwrap_or(""));
    match host {
        None => {
            return Err(c.err(
                &format!("alerts.webhook[{i}].url"),
                format!("{:?} is not an http(s) URL", w.url),
            ));
        }
        Some(h) if h.is_empty() || h.starts_with(':') => {
            return Err(c.err(
                &format!("alerts.webhook[{i}].url"),
                format!("{:?} names no host", w.url),
            ));
        }
        Some(_) => {}
    }
    Ok(Webhook {
        url: w.url.clone(),
        timeout: c.dur(
            &format!("alerts.webhook[{i}].timeout"),
            &w.timeout,
            Duration::from_secs(5),
        )?,
        retries: w.retries.unwrap_or(3),
    })
}

/// `[alerts]`.
fn alerts(c: &Checker, raw: &RawAlerts) -> Result<AlertsConfig, ConfigError> {
    let rules = raw
        .rule
        .iter()
        .enumerate()
        .map(|(i, r)| rule(c, i, r))
        .collect::<Result<Vec<_>, _>>()?;
    let webhooks = raw
        .webhook
        .iter()
        .enumerate()
        .map(|(i, w)| webhook(c, i, w))
        .collect::<Result<Vec<_>, _>>()?;
    let mut execs = Vec::new();
    for (i, x) in raw.exec.iter().enumerate() {
        if x.argv.first().is_none_or(|p| p.trim().is_empty()) {
            return Err(c.err(
                &format!("alerts.exec[{i}].argv"),
                "empty: name the program to run first".into(),
            ));
        }
        execs.push(Exec {
            argv: x.argv.clone(),
            timeout: c.dur(
                &format!("alerts.exec[{i}].timeout"),
                &x.timeout,
                Duration::from_secs(30),
            )?,
        });
    }

    Ok(AlertsConfig {
        log: raw.log,
        rules,
        webhooks,
        execs,
    })
}

/// `[reclaim]`.
fn reclaim(c: &Checker, rc: &RawReclaim) -> Result<ReclaimConfig, ConfigError> {
    let default_include: Vec<String> = Class::default_targets()
        .map(|c| c.as_str().to_string())
        .collect();
    let include = rc
        .include
        .as_ref()
        .unwrap_or(&default_include)
        .iter()
        .map(|name| {
            // One list of what may be named, in every error: the classes the agent may
            // reclaim on its own.
            let refused = |reason: String| {
                c.err(
                    "reclaim.include",
                    format!(
                        "{reason} (reclaim.include takes: {})",
                        Class::target_names(true).join(", ")
                    ),
                )
            };
            let class: Class = name.parse().map_err(|_| {
                refused(format!(
                    "unknown value {:?}",
                    vramguard_core::sanitize::escape(name)
                ))
            })?;
            class
                .check_target(true)
                .map_err(|e| refused(e.to_string()))?;
            Ok(class)
        })
        .collect::<Result<_, _>>()?;
    let reset = rc
        .reset
        .as_deref()
        .unwrap_or(defaults::RESET)
        .parse::<vramguard_ops::ResetMode>()
        .map_err(|e| c.err("reclaim.reset", e.to_string()))?;
    let reclaim = ReclaimConfig {
        auto: rc.auto,
        min_age: c.dur("reclaim.min_age", &rc.min_age, Duration::from_secs(300))?,
        include,
        grace: c.dur_or("reclaim.grace", &rc.grace, defaults::GRACE)?,
        release_timeout: c.dur_or(
            "reclaim.release_timeout",
            &rc.release_timeout,
            defaults::RELEASE_TIMEOUT,
        )?,
        reset,
        sample: c.dur_or("reclaim.sample", &rc.sample, defaults::RECLAIM_SAMPLE)?,
        audit_log: match rc.audit_log.as_deref() {
            Some("") => return Err(c.err("reclaim.audit_log", "empty: name a file".into())),
            _ => rc
                .audit_log
                .as_deref()
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(defaults::AUDIT_LOG)),
        },
        reset_lock: match rc.reset_lock.as_deref() {
            Some("") => return Err(c.err("reclaim.reset_lock", "empty: name a file".into())),
            Some(path) => PathBuf::from(path),
            None => PathBuf::from(vramguard_ops::reset_lock::DEFAULT_RESET_LOCK),
        },
    };
    Ok(reclaim)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Automatic reclaim rests on GPU work seen within gpu_busy_recent: samples further
    /// apart than that are refused while it is on, and allowed while it is off.
    #[test]
    fn automatic_reclaim_refuses_samples_further_apart_than_gpu_work_is_remembered() {
        let load = |toml: &str| Config::from_raw(None, toml::from_str(toml).unwrap());
        let e = load("[agent]\ninterval = \"30s\"\n[reclaim]\nauto = true\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("agent.interval: 30.0s is longer than policy.gpu_busy_recent (10.0s)"),
            "{e}"
        );
        assert!(load("[agent]\ninterval = \"30s\"\n").is_ok());
        assert!(
            load("[policy]\ngpu_busy_recent = \"60s\"\n[agent]\ninterval = \"30s\"\n[reclaim]\nauto = true\n")
                .is_ok()
        );
        assert!(load("[agent]\ninterval = \"10s\"\n[reclaim]\nauto = true\n").is_ok());
    }

    /// Red-team finding: `min_age` had no floor, so `min_age = "1ms"` with automatic reclaim
    /// signalled a holder on the first sample that judged it orphaned. It must span three
    /// samples while automatic reclaim is on.
    #[test]
    fn automatic_reclaim_needs_a_min_age_of_three_samples() {
        let load = |toml: &str| Config::from_raw(None, toml::from_str(toml).unwrap());
        let e = load("[agent]\ninterval = \"1s\"\n[reclaim]\nauto = true\nmin_age = \"2s\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(
                "reclaim.min_age: 2.0s is shorter than 3 samples (3.0s at agent.interval 1.0s)"
            ),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
        assert!(
            load("[agent]\ninterval = \"1s\"\n[reclaim]\nauto = true\nmin_age = \"3s\"\n").is_ok()
        );
        assert!(load("[agent]\ninterval = \"1s\"\n[reclaim]\nmin_age = \"2s\"\n").is_ok());
        // The agent's --interval is checked by the same rule.
        let c = load("[reclaim]\nauto = true\nmin_age = \"2s\"\n[agent]\ninterval = \"500ms\"\n")
            .unwrap();
        assert_eq!(c.auto_reclaim_sampling(Duration::from_millis(500)), None);
        assert_eq!(
            c.auto_reclaim_sampling(Duration::from_secs(1))
                .map(|(key, _)| key),
            Some("reclaim.min_age")
        );
    }

    /// Red-team finding: root ran `[[alerts.exec]]` commands and removed files as any config
    /// it was given said, whoever could write it. Read by root, a config another user owns or
    /// may write is refused, links followed.
    #[test]
    fn root_refuses_a_config_someone_else_can_write() {
        use std::os::unix::fs::PermissionsExt;
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, "[agent]\ninterval = \"1s\"\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(Config::load(Some(&path)).is_ok());
        let link = dir.path().join("link.toml");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        for (mode, owner, says) in [
            (0o664, 0, "can be written by its group"),
            (0o646, 0, "can be written by every user"),
            (0o644, 1000, "is owned by uid 1000"),
        ] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            rustix::fs::chown(&path, Some(rustix::process::Uid::from_raw(owner)), None).unwrap();
            for p in [&path, &link] {
                let e = Config::load(Some(p)).unwrap_err().to_string();
                assert!(e.contains(says), "{mode:o} {owner}: {e}");
            }
        }
    }

    /// `none` is the defaults and reads no file, not even /etc/vramguard/config.toml.
    #[test]
    fn none_is_the_defaults_whatever_is_installed() {
        let c = Config::load(Some(Path::new(NO_CONFIG))).unwrap().config;
        assert_eq!(c, Config::default());
        assert_eq!(c.path, None);
    }

    /// The default file, missing: the defaults, silently; broken: an error, whoever reads
    /// it; a named file that is missing: an error. (Present but not this user's to read: the
    /// defaults and a note; tests run as root, who reads every file, so that case is tested
    /// on the binary as uid 65534, in tests/install.rs.)
    #[test]
    fn a_missing_default_config_is_the_defaults_and_a_broken_one_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let default = dir.path().join("config.toml");
        let loaded = Config::load_with_default(None, &default).unwrap();
        assert_eq!(loaded.config, Config::default());
        assert_eq!(loaded.note, None);
        std::fs::write(&default, "garbage = [").unwrap();
        let e = Config::load_with_default(None, &default).unwrap_err();
        assert_eq!(e.path, default.display().to_string());
        std::fs::write(&default, "[policy]\ntolerance = \"1GiB\"\n").unwrap();
        let loaded = Config::load_with_default(None, &default).unwrap();
        assert_eq!(loaded.config.path.as_deref(), Some(default.as_path()));
        assert_eq!(loaded.note, None);
        // A file named that does not exist is an error, unlike the default.
        let missing = dir.path().join("missing.toml");
        let e = Config::load_with_default(Some(&missing), &default).unwrap_err();
        assert!(e.message.starts_with("cannot be read"), "{e}");
    }

    /// The example packages install as /etc/vramguard/config.toml lists the defaults: a
    /// default changed in code and not in the file (or a typo in the file) fails here.
    #[test]
    fn the_shipped_example_config_is_the_defaults() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/config.toml"
        ));
        let text = std::fs::read_to_string(path).unwrap();
        let mut shipped = Config::parse(path, &text).unwrap();
        shipped.path = None;
        shipped.document = None;
        let defaults = Config::parse(Path::new("empty.toml"), "").unwrap();
        let mut defaults = defaults;
        defaults.path = None;
        defaults.document = None;
        assert_eq!(shipped, defaults);
        assert_eq!(DEFAULTS_DOCUMENT, text, "the embedded copy is the file");
        // Every section is there, so an admin edits a value rather than guessing a name.
        for table in [
            "[policy]",
            "[agent]",
            "[alerts]",
            "[reclaim]",
            "[containers]",
            "[shm]",
            "[kubernetes]",
            "[driver]",
        ] {
            assert!(text.lines().any(|l| l == table), "{table}");
        }
    }

    /// `config show`: every shipped key once, each with its source; what the file adds goes
    /// in its own section (a second `[policy]` header would not be TOML).
    #[test]
    fn the_effective_settings_name_their_source() {
        let path = Path::new("/etc/x.toml");
        let c = Config::parse(
            path,
            "[reclaim]\ngrace = \"30s\"\n[policy]\nbaseline = { \"0\" = \"300MiB\" }\n",
        )
        .unwrap();
        let all = c.settings();
        let find = |k: &str| all.iter().find(|s| s.key == k).unwrap();
        assert_eq!(find("reclaim.grace").value, "\"30s\"");
        assert_eq!(find("reclaim.grace").source, Source::File(path.into()));
        assert_eq!(find("reclaim.release_timeout").source, Source::Default);
        assert_eq!(find("policy.baseline").source, Source::File(path.into()));
        let keys: Vec<&str> = all.iter().map(|s| s.key.as_str()).collect();
        let mut unique = keys.clone();
        unique.dedup();
        assert_eq!(keys, unique, "each key once");
        let sections: Vec<&str> = keys.iter().map(|k| k.split('.').next().unwrap()).collect();
        let mut runs = sections.clone();
        runs.dedup();
        let mut distinct = runs.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(
            runs.len(),
            distinct.len(),
            "each section in one run: {runs:?}"
        );
        // The defaults alone: every source is the default.
        assert!(
            Config::default()
                .settings()
                .iter()
                .all(|s| s.source == Source::Default)
        );
    }

    #[test]
    fn a_full_file() {
        let c = Config::parse(
            Path::new("c.toml"),
            r#"
[policy]
tolerance = "512MiB"
idle_after = "2h"
baseline = { "0" = "300MiB" }
system_comms = ["my-exporter"]
gpu_work_min_percent = 5

[agent]
listen = "0.0.0.0:9835"
interval = "500ms"
top_holders = 5

[[alerts.rule]]
name = "ghost-memory"
when = "ghost_bytes"
above = "1GiB"
for = "30s"

[[alerts.rule]]
name = "orphans"
when = "orphan_holders"

[[alerts.rule]]
name = "leak"
when = "leak_slope"
above = "2GiB/h"

[[alerts.rule]]
name = "full"
when = "used_ratio"
above = 0.95

[[alerts.webhook]]
url = "http://127.0.0.1:9000/hook"
retries = 5

[[alerts.exec]]
argv = ["/usr/local/bin/page", "--team", "gpu"]

[reclaim]
auto = true
min_age = "2m"
include = ["orphan"]
"#,
        )
        .unwrap();
        assert_eq!(c.policy.tolerance_bytes, 512 << 20);
        assert_eq!(c.policy.idle_after_secs, 7200);
        assert_eq!(c.policy.gpu_work_min_percent, 5);
        assert!(c.policy.is_system_comm("my-exporter"));
        assert_eq!(c.agent.interval, Duration::from_millis(500));
        assert_eq!(c.agent.top_holders, 5);
        assert_eq!(c.alerts.rules[0].condition, Condition::GhostBytes(1 << 30));
        assert_eq!(c.alerts.rules[0].for_, Duration::from_secs(30));
        assert_eq!(
            c.alerts.rules[1].condition,
            Condition::Holders(Class::Orphan)
        );
        assert_eq!(
            c.alerts.rules[2].condition,
            Condition::LeakSlope((2u64 << 30) as f64)
        );
        assert_eq!(c.alerts.rules[3].condition, Condition::UsedRatio(0.95));
        assert_eq!(c.alerts.webhooks[0].retries, 5);
        assert_eq!(c.alerts.execs[0].argv[0], "/usr/local/bin/page");
        assert!(c.reclaim.auto);
        assert_eq!(c.reclaim.include, vec![Class::Orphan]);
    }

    #[test]
    fn defaults() {
        let c = Config::default();
        assert_eq!(c.agent.listen, "127.0.0.1:9835");
        assert_eq!(c.agent.interval, Duration::from_secs(1));
        assert!(!c.reclaim.auto);
        assert!(c.alerts.log);
        assert_eq!(
            c.reclaim.audit_log,
            PathBuf::from("/var/log/vramguard/audit.jsonl")
        );
    }

    #[test]
    fn shm_settings_are_read_and_nonsense_is_refused_by_key() {
        let c = Config::parse(
            Path::new("v.toml"),
            "[shm]\ndirs = [\"/run/shm\"]\nproducers = [\"vllm_\"]\nmin_age = \"1h\"\nowner_rule = \"ignore\"\n",
        )
        .unwrap();
        assert_eq!(c.shm.dirs, [PathBuf::from("/run/shm")]);
        assert_eq!(c.policy.shm.producers, ["vllm_"]);
        assert_eq!(c.policy.shm.min_age_secs, 3600);
        assert_eq!(
            c.policy.shm.owner_rule,
            vramguard_core::host::OwnerRule::Ignore
        );
        assert_eq!(Config::default().shm.dirs, [PathBuf::from("/dev/shm")]);
        for (bad, key) in [
            ("dirs = [\"shm\"]", "shm.dirs"),
            ("producers = [\"t\"]", "shm.producers"),
            ("producers = [\"a/b_\"]", "shm.producers"),
            ("min_age = \"0s\"", "shm.min_age"),
            ("owner_rule = \"whoever\"", "shm.owner_rule"),
        ] {
            let e = Config::parse(Path::new("v.toml"), &format!("[shm]\n{bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key) && e.contains("v.toml"), "{bad}: {e}");
        }
    }

    #[test]
    fn errors_name_the_file_the_key_and_the_line() {
        let e = Config::parse(Path::new("/etc/v.toml"), "[policy]\ntolerence = \"1GiB\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/etc/v.toml") && e.contains("tolerence") && e.contains("line 2"),
            "{e}"
        );
        let e = Config::parse(
            Path::new("v.toml"),
            "[policy]\nidle_after = \"ten minutes\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("policy.idle_after") && e.contains("ten minutes"),
            "{e}"
        );
        let e = Config::parse(Path::new("v.toml"), "[policy]\ngpu_work_min_percent = 0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("policy.gpu_work_min_percent"), "{e}");
        let e = Config::parse(
            Path::new("v.toml"),
            "[[alerts.rule]]\nname = \"x\"\nwhen = \"sunspots\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("alerts.rule[0] (x)") && e.contains("sunspots"),
            "{e}"
        );
        let e = Config::parse(Path::new("v.toml"), "[reclaim]\ninclude = [\"active\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("never reclaimed"), "{e}");
        for (toml, expected) in [
            (
                "[[alerts.exec]]\nargv = [\"\"]\n",
                "v.toml: line 2: alerts.exec[0].argv: empty",
            ),
            (
                "[[alerts.webhook]]\nurl = \"http://a/h\"\n[[alerts.webhook]]\n\nurl = \"http://\"\n",
                "v.toml: line 5: alerts.webhook[1].url: \"http://\" names no host",
            ),
            (
                "[agent]\nlisten = \"127.0.0.1:99999\"\n",
                "line 2: agent.listen",
            ),
            (
                "[reclaim]\naudit_log = \"\"\n",
                "line 2: reclaim.audit_log: empty",
            ),
            (
                "[agent]\n# x\ntrend_window = \"0s\"\n",
                "line 3: agent.trend_window: \"0s\" must be longer than 0",
            ),
            (
                "[agent]\ntimeline = \"0ms\"\n",
                "agent.timeline: \"0ms\" must be longer than 0",
            ),
            ("[agent]\ntop_holders = 0\n", "line 2: agent.top_holders: 0"),
            ("[reclaim]\nmin_age = \"0s\"\n", "reclaim.min_age"),
        ] {
            let e = Config::parse(Path::new("v.toml"), toml)
                .unwrap_err()
                .to_string();
            assert!(e.contains(expected), "{toml:?}: {e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
        let e = Config::parse(Path::new("v.toml"), "[reclaim]\ninclude = [\"detached\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("never reclaimed automatically"), "{e}");
        let e = Config::parse(Path::new("v.toml"), "[agent]\nlisten = \"everywhere\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("agent.listen"), "{e}");
        let e = Config::parse(
            Path::new("v.toml"),
            "[[alerts.webhook]]\nurl = \"ftp://x\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("alerts.webhook[0].url"), "{e}");
        let e = Config::parse(Path::new("v.toml"), "[policy\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("v.toml"), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_text_never_panics(s in "(\\[(policy|agent|alerts|reclaim)\\]\n)?[a-z_ =\"0-9.\n\\[\\]{}]{0,160}") {
            let _ = Config::parse(Path::new("fuzz.toml"), &s);
        }
    }
}
