//! The parts of vramguard that act on the machine.
//!
//! Everything that sends a signal or writes a record lives here, apart from the pure core:
//! [`identity`] signals only a process whose pid *and* start time match the plan, through a
//! pidfd; [`audit`] appends fsynced JSON lines; [`reclaim`] runs a plan with them;
//! [`snapshot`] takes the snapshots the executor re-reads.
#![deny(missing_docs)]

pub mod audit;
pub mod cgroup;
pub mod identity;
pub mod reclaim;
pub mod snapshot;
pub mod spawn;
pub mod supervise;

pub use audit::{AuditLog, DEFAULT_AUDIT_LOG};
pub use reclaim::{
    ExecuteOptions, ReclaimEnv, ReclaimOutcome, ResetMode, UnknownResetMode, execute,
};
pub use snapshot::{take_sampled_snapshot, take_snapshot};
