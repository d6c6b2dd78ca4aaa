//! The simulated node: the real [`MachineNode`] with the simulator's GPU source and reset.

use crate::{Sim, SimSource, SimState};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use vramguard_core::Policy;
use vramguard_gpu::DeadlineSource;
use vramguard_node::{MachineNode, NodeError, ResetBackend, ResetError};
use vramguard_proc::ProcCollector;

/// The simulator's reset of the GPUs of `state` (the stand-in for `nvidia-smi --gpu-reset`).
pub fn reset_backend(state: PathBuf) -> ResetBackend {
    ResetBackend::Function(Arc::new(move |gpu| {
        let mut sim = Sim::open(&state).map_err(|e| ResetError::Refused(e.to_string()))?;
        sim.reset(gpu)
            .map(|o| {
                format!(
                    "simulated reset cleared {}",
                    vramguard_core::units::format_bytes(o.cleared_bytes)
                )
            })
            .map_err(|e| ResetError::Refused(e.to_string()))
    }))
}

/// A node on the simulated driver of `state`, reading `proc_root` (which must be vramguard's
/// own `/proc` for signals to be sent) and the simulator's device directory; no driver call
/// holds it longer than `call_timeout`.
pub fn open(
    state: &Path,
    proc_root: &Path,
    policy: &Policy,
    call_timeout: Duration,
) -> Result<MachineNode, NodeError> {
    let dev_dir = SimState::load(state)
        .map_err(|e| NodeError::Gpu(vramguard_gpu::SourceError::Backend(Box::new(e))))?
        .dev_dir;
    Ok(MachineNode::new(
        Box::new({
            let state = state.to_path_buf();
            DeadlineSource::open(call_timeout, move || SimSource::open(&state))?
        }),
        ProcCollector::new(proc_root, dev_dir)?,
        policy.clone(),
        reset_backend(state.to_path_buf()),
        proc_root,
    ))
}
