//! The one interface between vramguard's use cases and a node.
//!
//! A [`Node`] is everything a use case may ask of a machine: a snapshot (the driver, then
//! `/proc`), one GPU's used memory (the fast poll), a GPU reset, signals to processes pinned
//! by identity, the `/proc` it reads, and the clock. The reclaim executor, the agent's loop and
//! the commands ask a `Node` and nothing else, so:
//!
//! - [`MachineNode`] is the real node: a [`vramguard_gpu::GpuSource`] (NVML, or the simulated
//!   driver's source, which the simulator crate plugs in), a `/proc` collector, a
//!   [`ResetBackend`], pidfd-pinned signals and the system clock;
//! - `fake::FakeNode` (feature `test-support`) is a scripted node over a saved snapshot with a [`ManualClock`]: the
//!   executor's and the agent's unit tests run on it with no process and no sleep.
#![deny(missing_docs)]

pub mod clock;
#[cfg(any(test, feature = "test-support"))]
pub mod fake;
pub mod identity;
mod machine;
pub mod reset;
pub mod snapshot;

pub use clock::{Clock, ManualClock, SystemClock};
pub use identity::{Identity, Refusal};
pub use machine::MachineNode;
pub use reset::{ResetBackend, ResetError, ResetFn, ResetTarget};
pub use rustix::process::Signal;
pub use snapshot::SnapshotError;

use std::time::{Duration, Instant};
use vramguard_core::snapshot::{CallError, GpuSample, Snapshot};
use vramguard_proc::{ProcFs, ScanDepth, WorkSampler};

/// Why a node could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A snapshot (GPUs and `/proc`) failed.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The GPUs could not be read.
    #[error(transparent)]
    Gpu(#[from] vramguard_gpu::SourceError),
    /// One GPU's memory could not be read.
    #[error("GPU {gpu}: {cause}")]
    Memory {
        /// The GPU index.
        gpu: u32,
        /// The failed call.
        cause: CallError,
    },
    /// `/proc` could not be opened.
    #[error(transparent)]
    Proc(#[from] vramguard_proc::ProcError),
}

/// Everything a use case may ask of a machine.
pub trait Node: Send {
    /// One collection: the driver, then `/proc` at `depth`.
    fn snapshot(&mut self, depth: ScanDepth) -> Result<Snapshot, NodeError>;

    /// One collection, then `window` of watching its processes work (CPU time, running
    /// threads). A zero window takes no sample: holders whose job is gone then have unknown
    /// work and are never reclaim targets.
    fn sampled_snapshot(
        &mut self,
        depth: ScanDepth,
        window: Duration,
    ) -> Result<Snapshot, NodeError> {
        self.sampled_snapshot_for(depth, window, vramguard_core::WatchFor::Reclaim)
    }

    /// [`Node::sampled_snapshot`] watching only the processes whose work `watch` needs: for
    /// the classes alone (`status`), a node where every holder's job is alive waits for
    /// nothing.
    fn sampled_snapshot_for(
        &mut self,
        depth: ScanDepth,
        window: Duration,
        watch: vramguard_core::WatchFor,
    ) -> Result<Snapshot, NodeError>;

    /// Every GPU as the driver sees it (memory, listed processes), without reading `/proc`.
    fn gpus(&mut self) -> Result<Vec<GpuSample>, NodeError>;

    /// Only what a settled GPU is compared on between two full readings: UUID, memory,
    /// process lists, Xid events ([`vramguard_gpu::read::read_gpu_settled`]); the rest of
    /// each sample is left unread. A node that cannot read less reads everything.
    fn settled_gpus(&mut self) -> Result<Vec<GpuSample>, NodeError> {
        self.gpus()
    }

    /// Used memory of one GPU, straight from the driver (the call a fast poll makes).
    fn memory_used(&mut self, gpu: u32) -> Result<u64, NodeError>;

    /// Resets one GPU: what the reset said, or why it failed.
    fn reset(&mut self, gpu: &ResetTarget) -> Result<String, ResetError>;

    /// Lets go of the driver (this process's NVML handles and the device files they hold)
    /// until the next call that needs it: while another vramguard process resets a GPU,
    /// which the driver refuses while any other process holds it.
    fn release_driver(&mut self) {}

    /// The `/proc` the node's snapshots read; `None` for a node without one (the fake).
    fn proc(&self) -> Option<&ProcFs>;

    /// Observes how `pids` work right now (CPU time, running threads) into `sampler`, at the
    /// clock's wall time. Processes that are gone are skipped.
    fn observe_work(&mut self, sampler: &mut WorkSampler, pids: &[u32]) -> Result<(), NodeError>;

    /// Adds to `snap` the descendants of `roots` it lacks (see
    /// [`vramguard_core::classify::work_roots`]): a collection reads holders and their
    /// ancestors, and the work of a holder's children protects it. The fake node's
    /// snapshots hold every process already.
    fn add_descendants(&mut self, snap: &mut Snapshot, roots: &[u32]) -> Result<(), NodeError> {
        let _ = (snap, roots);
        Ok(())
    }

    /// The node's clock: every wait and every timestamp of a use case comes from it.
    fn clock(&self) -> &dyn Clock;

    /// Pins the processes about to be signalled (pidfd, then start time): from here on a
    /// reused pid is out of reach. Replaces whatever was pinned before. Returns, per identity,
    /// whether it could be pinned and why not.
    fn pin(&mut self, ids: &[Identity]) -> Vec<Result<(), Refusal>>;

    /// Sends `sig` to a pinned process; a process not pinned is refused.
    fn signal(&mut self, id: Identity, sig: Signal) -> Result<(), Refusal>;

    /// Waits until every one of `ids` (pinned) has exited, or `deadline`. Returns, per
    /// identity, when it was seen gone (`None`: alive at the deadline).
    fn wait_exits(&mut self, ids: &[Identity], deadline: Instant) -> Vec<Option<Instant>>;

    /// Watches `ids` for their exits from now on, in place of whatever was watched before
    /// (the agent's holders; a pidfd each on a real node, kept across calls). An identity
    /// that is no longer its process (it exited since the sample that saw it) is reported
    /// gone by the next [`Node::wait_watched`], which does not wait then. Returns how many
    /// are watched.
    fn watch_exits(&mut self, ids: &[Identity]) -> usize;

    /// Sleeps until `deadline` on the node's clock, the exit of a process watched by
    /// [`Node::watch_exits`], an open of a device file (once [`Node::watch_opens`] started,
    /// and when `opens` is true: a caller that already has a sample due for opens lets
    /// further opens queue instead of waking it for each one), or `wake` becoming readable. Returns the watched processes seen
    /// gone and when, on the node's clock; they are watched no more.
    fn wait_watched(
        &mut self,
        deadline: Instant,
        wake: Option<std::os::fd::BorrowedFd<'_>>,
        opens: bool,
    ) -> Vec<(Identity, Instant)>;

    /// Starts watching the device files for opens (fanotify): a process that opens one is
    /// fd-scanned by the next snapshot, whatever its depth, and [`Node::wait_watched`] wakes
    /// for it. Returns how many files are watched; an error says why not (no privilege, an
    /// old kernel, a node without device files), and new holders are then found by scans.
    fn watch_opens(&mut self) -> Result<usize, vramguard_proc::opens::OpenWatchError> {
        Err(vramguard_proc::opens::OpenWatchError::Unsupported)
    }

    /// Whether no process the collection follows (holders, their parents, job leaders) has
    /// exited since the last snapshot; false where it cannot tell cheaply. A caller that saw
    /// nothing undecided in that snapshot may then trust it a while longer.
    fn nothing_exited(&mut self) -> bool {
        false
    }

    /// Why no process can be signalled through this node, when none can (it reads a `/proc`
    /// that is not vramguard's own PID namespace's): pins then fail with this reason. Callers
    /// that would signal on their own (the agent's automatic reclaim) refuse to start.
    fn signals_refused(&self) -> Option<String> {
        None
    }

    /// Stops watching the device files for opens (a reloaded config turned it off).
    fn unwatch_opens(&mut self) {}

    /// Whether snapshots carry processes' command lines (default yes); a node that cannot
    /// leave them out ignores it (the caller strips them itself).
    fn set_command_lines(&mut self, _read: bool) {}

    /// The processes seen opening a device file since the last call (read by
    /// [`Node::wait_watched`]); already queued for the next snapshot's scan.
    fn take_opens(&mut self) -> vramguard_proc::opens::Openers {
        Default::default()
    }

    /// What keeps a process alive that survived SIGKILL (its threads and wait channels).
    fn why_alive(&self, pid: u32) -> String;

    /// Removes a shared-memory segment, if its directory (opened without following links)
    /// still holds, under that name, the regular file of the segment's device and inode.
    fn remove_segment(
        &mut self,
        segment: &vramguard_core::host::SegmentReport,
    ) -> Result<(), vramguard_proc::host::SegmentRemovalError>;
}

/// Opens nodes that classify with a policy (its idle threshold sets how far back the driver
/// is asked for utilisation): the agent opens one to watch with and one per automatic reclaim.
pub type NodeFactory = std::sync::Arc<
    dyn Fn(&vramguard_core::Policy) -> Result<Box<dyn Node>, NodeError> + Send + Sync,
>;
