//! The global options and the config file, read once into one typed value that every command
//! receives, and the node they select.

use crate::cli::Global;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;
use vramguard_config::Config;
use vramguard_core::snapshot::Snapshot;
use vramguard_core::{Policy, Report, WatchFor, classify};
use vramguard_gpu::{DeadlineSource, GpuSource, NvmlSource};
use vramguard_node::{MachineNode, Node, NodeFactory, ResetBackend};
use vramguard_proc::{ProcCollector, ScanDepth};
use vramguard_sim::SimSource;

/// Where the GPU facts come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Driver {
    /// NVML: the system's `libnvidia-ml.so.1`, or the library given.
    Nvml {
        /// `--nvml-lib`.
        lib: Option<PathBuf>,
    },
    /// The simulated driver, in-process.
    Sim {
        /// Its state file.
        state: PathBuf,
    },
    /// The simulated driver through its NVML library (the real NVML code path).
    SimThroughNvml {
        /// Its state file.
        state: PathBuf,
        /// The simulator's `libnvidia-ml.so.1`.
        lib: PathBuf,
    },
}

impl Driver {
    /// The simulator's state file, when the driver is simulated.
    pub fn sim_state(&self) -> Option<&Path> {
        match self {
            Driver::Nvml { .. } => None,
            Driver::Sim { state } | Driver::SimThroughNvml { state, .. } => Some(state),
        }
    }
}

/// Everything a command needs besides its own arguments: where facts come from, and the
/// checked config.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The GPU facts.
    pub driver: Driver,
    /// The `/proc` to read (`--proc-root`).
    pub proc_root: PathBuf,
    /// `--dev-dir`, when given.
    pub dev_dir: Option<PathBuf>,
    /// `--replay`: classify this saved snapshot instead of the machine.
    pub replay: Option<PathBuf>,
    /// The config file named (re-read by the agent on SIGHUP).
    pub config_path: Option<PathBuf>,
    /// The whole, checked config.
    pub config: Config,
}

impl Settings {
    /// The global options and the config read with them, with the environment prepared for
    /// the NVML library.
    pub fn new(global: Global, config: Config) -> Result<Settings> {
        let driver = match (global.sim, global.nvml_lib) {
            (Some(state), Some(lib)) => {
                // The simulator's NVML library reads its state from the environment.
                // SAFETY: called from main before any thread is started.
                unsafe { std::env::set_var("VRAMGUARD_SIM", &state) };
                Driver::SimThroughNvml { state, lib }
            }
            (Some(state), None) => Driver::Sim { state },
            (None, lib) => Driver::Nvml { lib },
        };
        let mut config = config;
        if let Some(state) = driver.sim_state()
            && config.reclaim.reset_lock.as_os_str()
                == vramguard_ops::reset_lock::DEFAULT_RESET_LOCK
        {
            // A simulated node's reset lock is its own, beside its state (as its /run would
            // be): resets of one simulated node never pause the agent of another, nor touch
            // the host's /run. A config file that names a lock keeps it.
            let mut lock = state.as_os_str().to_owned();
            lock.push(".reset.lock");
            config.reclaim.reset_lock = PathBuf::from(lock);
        }
        Ok(Settings {
            driver,
            proc_root: global.proc_root,
            dev_dir: global.dev_dir,
            replay: global.replay,
            config_path: global.config,
            config,
        })
    }

    /// The settings of `vramguard --sim STATE` with no config file: the demo's node is built
    /// by the same constructor as every other command's.
    pub fn simulated(state: &Path) -> Result<Settings> {
        Settings::new(
            Global {
                sim: Some(state.to_path_buf()),
                nvml_lib: None,
                proc_root: PathBuf::from(vramguard_proc::OWN_PROC),
                dev_dir: None,
                config: None,
                replay: None,
            },
            Config::default(),
        )
    }

    /// The classification policy.
    pub fn policy(&self) -> &Policy {
        &self.config.policy
    }

    /// The directory of the device files.
    pub fn dev_dir(&self) -> Result<PathBuf> {
        if let Some(d) = &self.dev_dir {
            return Ok(d.clone());
        }
        if let Some(sim) = self.driver.sim_state() {
            return Ok(vramguard_sim::SimState::load(sim)?.dev_dir);
        }
        Ok(PathBuf::from("/dev"))
    }

    /// The GPU source the driver setting selects.
    pub fn gpu_source(&self) -> Result<Box<dyn GpuSource>> {
        Ok(open_source(&self.driver, self.config.driver.call_timeout)?)
    }

    /// The driver the setting selects, read call by call on the calling thread (no
    /// deadlines: `probe calls` bounds the whole measurement instead).
    pub fn gpu_reader(&self) -> Result<Box<dyn vramguard_gpu::GpuReader>> {
        Ok(match &self.driver {
            Driver::Sim { state } => Box::new(SimSource::open(state)?),
            Driver::Nvml { lib } => Box::new(NvmlSource::open(lib.as_deref())?),
            Driver::SimThroughNvml { lib, .. } => Box::new(NvmlSource::open(Some(lib))?),
        })
    }

    /// How GPUs are reset: `command` (a `--reset-command`, split on whitespace, with
    /// `{index}`, `{uuid}`, `{pci_bus_id}`), else the simulator's reset with `--sim`, else
    /// `nvidia-smi --gpu-reset -i {index}`. The one place the choice is made.
    pub fn reset_backend(&self, command: Option<&str>) -> Result<ResetBackend> {
        if let Some(cmd) = command {
            let argv: Vec<String> = cmd.split_whitespace().map(str::to_string).collect();
            anyhow::ensure!(!argv.is_empty(), "--reset-command is empty");
            return Ok(ResetBackend::Command(argv));
        }
        Ok(match self.driver.sim_state() {
            Some(state) => simulated_reset(state.to_path_buf()),
            None => ResetBackend::nvidia_smi(),
        })
    }

    /// The node the settings select, reading `--proc-root` and classifying with `policy`;
    /// resets go through [`Settings::reset_backend`]`(reset_command)`.
    pub fn node(&self, policy: &Policy, reset_command: Option<&str>) -> Result<MachineNode> {
        let k = &self.config.kubernetes;
        Ok(MachineNode::new(
            self.gpu_source()?,
            self.collector()?,
            policy.clone(),
            self.reset_backend(reset_command)?,
            &self.proc_root,
        )
        .with_kubelet(&k.pod_resources_socket, k.timeout))
    }

    /// Opens nodes like [`Settings::node`] for as long as the caller runs (the agent).
    pub fn node_factory(&self) -> Result<NodeFactory> {
        let driver = self.driver.clone();
        let proc_root = self.proc_root.clone();
        let dev_dir = self.dev_dir()?;
        let reset = self.reset_backend(None)?;
        let containers = self.container_state();
        let shm_dirs = self.config.shm.dirs.clone();
        let kubelet = self.config.kubernetes.clone();
        let call_timeout = self.config.driver.call_timeout;
        Ok(std::sync::Arc::new(move |policy: &Policy| {
            let node: Box<dyn Node> = Box::new(
                MachineNode::new(
                    open_source(&driver, call_timeout)?,
                    ProcCollector::new(&proc_root, &dev_dir)?
                        .with_container_state(containers.clone())
                        .with_shm_dirs(shm_dirs.clone()),
                    policy.clone(),
                    reset.clone(),
                    &proc_root,
                )
                .with_kubelet(&kubelet.pod_resources_socket, kubelet.timeout),
            );
            Ok(node)
        }))
    }

    /// A `/proc` collector.
    pub fn collector(&self) -> Result<ProcCollector> {
        let dev = self.dev_dir()?;
        Ok(ProcCollector::new(&self.proc_root, dev)?
            .with_container_state(self.container_state())
            .with_shm_dirs(self.config.shm.dirs.clone()))
    }

    /// Where container names are read from (`[containers]`).
    fn container_state(&self) -> vramguard_proc::containers::ContainerState {
        vramguard_proc::containers::ContainerState {
            docker: self.config.containers.docker_root.clone(),
            podman: self.config.containers.podman_root.clone(),
        }
    }

    /// A snapshot of this machine, with `sample` of watching its processes work (those a
    /// reclaim would need: `vramguard snapshot` saves what `--replay … reclaim` plans from),
    /// or the one given with `--replay` (which keeps the window it was saved with).
    pub fn snapshot(&self, sample: Duration) -> Result<Snapshot> {
        self.snapshot_for(sample, WatchFor::Reclaim)
    }

    fn snapshot_for(&self, sample: Duration, watch: WatchFor) -> Result<Snapshot> {
        if let Some(path) = &self.replay {
            return load_snapshot(path);
        }
        Ok(self
            .node(self.policy(), None)?
            .sampled_snapshot_for(ScanDepth::Full, sample, watch)?)
    }

    /// `status`'s snapshot and classification: from the driver's listed processes alone
    /// (their facts, relatives and jobs; no pass over every process's open files) when they
    /// explain every byte, else as [`Settings::report`] makes them. A replay is the saved
    /// collection, whatever its depth.
    pub fn report_listed_first(&self, sample: Duration) -> Result<(Snapshot, Report)> {
        if self.replay.is_some() {
            return self.report(sample);
        }
        let mut node = self.node(self.policy(), None)?;
        let view =
            vramguard_ops::view::status_view(&mut node, self.policy(), sample, ScanDepth::Full)?;
        if let Some(why) = &view.deeper {
            tracing::debug!(%why, "read every process's open files");
        }
        Ok((view.snapshot, view.report))
    }

    /// Snapshot and classification, with work watched only where a class depends on it
    /// (`status`, `diagnose`, `metrics`, `top --once`): nothing to decide, no wait.
    pub fn report(&self, sample: Duration) -> Result<(Snapshot, Report)> {
        let snap = self.snapshot_for(sample, WatchFor::Classes)?;
        let report = classify(&snap, self.policy());
        Ok((snap, report))
    }
}

/// Opens the GPU source of `driver`, every call of which waits at most `call_timeout`.
/// The simulator's reset of the GPUs of `state` (its stand-in for `nvidia-smi --gpu-reset`).
fn simulated_reset(state: PathBuf) -> ResetBackend {
    use vramguard_node::ResetError;
    ResetBackend::Function(std::sync::Arc::new(move |gpu| {
        let refused = |e: vramguard_sim::SimError| ResetError::Refused(e.to_string());
        let outcome = vramguard_sim::Sim::open(&state)
            .map_err(refused)?
            .reset(gpu)
            .map_err(refused)?;
        Ok(format!(
            "simulated reset cleared {}",
            vramguard_core::units::format_bytes(outcome.cleared_bytes)
        ))
    }))
}

/// The driver's source, which lets go of the driver before a reset and opens it again after
/// ([`vramguard_gpu::Reopening`]).
fn open_source(
    driver: &Driver,
    call_timeout: Duration,
) -> Result<Box<dyn GpuSource>, vramguard_gpu::SourceError> {
    let driver = driver.clone();
    let open: vramguard_gpu::OpenSource =
        std::sync::Arc::new(move || open_source_once(&driver, call_timeout));
    Ok(Box::new(vramguard_gpu::Reopening::open(open)?))
}

fn open_source_once(
    driver: &Driver,
    call_timeout: Duration,
) -> Result<Box<dyn GpuSource>, vramguard_gpu::SourceError> {
    Ok(match driver {
        Driver::Sim { state } => {
            let state = state.clone();
            Box::new(DeadlineSource::open(call_timeout, move || {
                SimSource::open(&state)
            })?)
        }
        Driver::Nvml { lib } => {
            let lib = lib.clone();
            Box::new(DeadlineSource::open(call_timeout, move || {
                NvmlSource::open(lib.as_deref())
            })?)
        }
        Driver::SimThroughNvml { lib, .. } => {
            let lib = lib.clone();
            Box::new(DeadlineSource::open(call_timeout, move || {
                NvmlSource::open(Some(&lib))
            })?)
        }
    })
}

/// Reads a snapshot saved by `vramguard snapshot`.
pub fn load_snapshot(path: &Path) -> Result<Snapshot> {
    let text = vramguard_fs::read_regular_to_string(path, vramguard_fs::MAX_INPUT_BYTES)
        .map_err(|e| anyhow::anyhow!("reading snapshot {}: {}", path.display(), e.reason()))?;
    let mut doc: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("snapshot {} is not JSON", path.display()))?;
    drop(text);
    // A snapshot may come from anyone (a bug report, another node): every string in it, the
    // driver's and the host's included, is escaped as vramguard escapes what processes
    // choose. Escaping is idempotent, so what is escaped again when shown stays as it is.
    escape_strings(&mut doc);
    let mut snap: Snapshot = serde_json::from_value(doc)
        .with_context(|| format!("snapshot {} is not a vramguard snapshot", path.display()))?;
    snap.normalize();
    Ok(snap)
}

/// Every string of `doc` (keys included) escaped in place.
fn escape_strings(doc: &mut serde_json::Value) {
    use serde_json::Value;
    let mut stack = vec![doc];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) => {
                if let std::borrow::Cow::Owned(e) = vramguard_core::sanitize::escape(s) {
                    *s = e;
                }
            }
            Value::Array(items) => stack.extend(items.iter_mut()),
            Value::Object(map) => {
                let unsafe_keys: Vec<String> = map
                    .keys()
                    .filter(|k| {
                        matches!(
                            vramguard_core::sanitize::escape(k),
                            std::borrow::Cow::Owned(_)
                        )
                    })
                    .cloned()
                    .collect();
                for k in unsafe_keys {
                    if let Some(value) = map.remove(&k) {
                        map.insert(vramguard_core::sanitize::escape(&k).into_owned(), value);
                    }
                }
                stack.extend(map.values_mut());
            }
            _ => {}
        }
    }
}
