//! The parts of vramguard that act on the machine.
//!
//! Everything that sends a signal or writes a record lives here, apart from the pure core:
//! [`audit`] appends fsynced JSON lines; [`reclaim`] runs a plan on a
//! [`vramguard_node::Node`] (which signals only a process whose pid *and* start time match the
//! plan, through a pidfd); [`supervise`] is the `run` supervisor; [`slurm`] brings back a node vramguard drained,
//! once a reset has freed its GPUs.
#![deny(missing_docs)]

pub mod audit;
pub mod cgroup;
pub mod gpus;
pub mod reclaim;
pub mod reset_lock;
pub mod slurm;
/// Process spawning lives with the process facts ([`vramguard_proc::spawn`]).
pub use vramguard_proc::spawn;
pub mod supervise;
pub mod view;

pub use audit::{AuditLog, DEFAULT_AUDIT_LOG};
pub use reclaim::{
    ExecuteOptions, Phase, PrepareError, Prepared, Progress, ReclaimObserver, ReclaimOutcome,
    ResetMode, StopRequests, UnknownResetMode, execute, prepare, try_prepare,
};
pub use vramguard_node::identity;
