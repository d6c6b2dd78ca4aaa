//! Turns the global options into a GPU source, a `/proc` collector and a policy, and takes
//! snapshots with them.

use crate::cli::Global;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;
use vramguard_config::Config;
use vramguard_core::snapshot::Snapshot;
use vramguard_core::{Policy, Report, classify};
use vramguard_gpu::{GpuSource, NvmlSource};
use vramguard_node::{MachineNode, Node, NodeFactory, ResetBackend};
use vramguard_proc::{ProcCollector, ScanDepth};
use vramguard_sim::SimSource;

/// Everything a command needs to look at the machine.
pub struct Ctx {
    /// The global options.
    pub global: Global,
    /// The classification policy (from the config).
    pub policy: Policy,
    /// The whole config.
    pub config: Config,
}

impl Ctx {
    /// Reads the config and prepares the environment for the NVML library.
    pub fn new(global: Global) -> Result<Ctx> {
        let config = Config::load(global.config.as_deref())?;
        let policy = config.policy.clone();
        if global.nvml_lib.is_some()
            && let Some(sim) = &global.sim
        {
            // The simulator's NVML library reads its state from the environment.
            // SAFETY: called from main before any thread is started.
            unsafe { std::env::set_var("VRAMGUARD_SIM", sim) };
        }
        Ok(Ctx {
            global,
            policy,
            config,
        })
    }

    /// The directory of the device files.
    pub fn dev_dir(&self) -> Result<PathBuf> {
        if let Some(d) = &self.global.dev_dir {
            return Ok(d.clone());
        }
        if let Some(sim) = &self.global.sim {
            return Ok(vramguard_sim::SimState::load(sim)?.dev_dir);
        }
        Ok(PathBuf::from("/dev"))
    }

    /// The GPU source the options select.
    pub fn gpu_source(&self) -> Result<Box<dyn GpuSource>> {
        match (&self.global.nvml_lib, &self.global.sim) {
            (None, Some(state)) => Ok(Box::new(SimSource::open(state)?)),
            (lib, _) => Ok(Box::new(NvmlSource::open(lib.as_deref())?)),
        }
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
        Ok(match &self.global.sim {
            Some(state) => vramguard_sim::node::reset_backend(state.clone()),
            None => ResetBackend::nvidia_smi(),
        })
    }

    /// The node the options select (the simulated driver with `--sim`, else NVML), reading
    /// `--proc-root` and classifying with `policy`; resets go through
    /// [`Ctx::reset_backend`]`(reset_command)`.
    pub fn node(&self, policy: &Policy, reset_command: Option<&str>) -> Result<MachineNode> {
        Ok(MachineNode::new(
            self.gpu_source()?,
            self.collector()?,
            policy.clone(),
            self.reset_backend(reset_command)?,
            &self.global.proc_root,
        ))
    }

    /// Opens nodes like [`Ctx::node`] for as long as the caller runs (the agent).
    pub fn node_factory(&self) -> Result<NodeFactory> {
        let (sim, lib) = (self.global.sim.clone(), self.global.nvml_lib.clone());
        let proc_root = self.global.proc_root.clone();
        let dev_dir = self.dev_dir()?;
        let reset = self.reset_backend(None)?;
        Ok(std::sync::Arc::new(move |policy: &Policy| {
            let source: Box<dyn GpuSource> = match (&lib, &sim) {
                (None, Some(state)) => Box::new(SimSource::open(state)?),
                (lib, _) => Box::new(NvmlSource::open(lib.as_deref())?),
            };
            let node: Box<dyn Node> = Box::new(MachineNode::new(
                source,
                ProcCollector::new(&proc_root, &dev_dir)?,
                policy.clone(),
                reset.clone(),
                &proc_root,
            ));
            Ok(node)
        }))
    }

    /// A `/proc` collector.
    pub fn collector(&self) -> Result<ProcCollector> {
        let dev = self.dev_dir()?;
        Ok(ProcCollector::new(&self.global.proc_root, dev)?)
    }

    /// A snapshot of this machine, with `sample` of watching its processes work, or the one
    /// given with `--replay` (which keeps the window it was saved with).
    pub fn snapshot(&self, sample: Duration) -> Result<Snapshot> {
        if let Some(path) = &self.global.replay {
            return load_snapshot(path);
        }
        Ok(self
            .node(&self.policy, None)?
            .sampled_snapshot(ScanDepth::Full, sample)?)
    }

    /// Snapshot and classification.
    pub fn report(&self, sample: Duration) -> Result<(Snapshot, Report)> {
        let snap = self.snapshot(sample)?;
        let report = classify(&snap, &self.policy);
        Ok((snap, report))
    }
}

/// Reads a snapshot saved by `vramguard snapshot`.
pub fn load_snapshot(path: &Path) -> Result<Snapshot> {
    let text = vramguard_fs::read_regular_to_string(path, vramguard_fs::MAX_INPUT_BYTES)
        .map_err(|e| anyhow::anyhow!("reading snapshot {}: {}", path.display(), e.reason()))?;
    let mut snap: Snapshot = serde_json::from_str(&text)
        .with_context(|| format!("snapshot {} is not a vramguard snapshot", path.display()))?;
    snap.normalize();
    Ok(snap)
}
