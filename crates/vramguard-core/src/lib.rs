//! The pure core of vramguard.
//!
//! Everything here is a function of its inputs: a [`Snapshot`] (what the driver said about each
//! GPU plus what `/proc` said about the processes that matter) goes in, a [`Report`] (every byte
//! of GPU memory attributed to a holder with a class, evidence and an action) comes out. No file,
//! no syscall, no clock: the shells around this crate (the `/proc` reader, the NVML reader, the
//! command line) gather the facts and act on the verdicts. That is what makes every incident a
//! user reports replayable: a snapshot serialises to JSON, and `classify` on that JSON gives the
//! same report in a unit test.
#![deny(missing_docs)]

pub mod classify;
pub mod diagnose;
pub mod health;
pub mod host;
pub mod job;
pub mod plan;
pub mod policy;
pub mod quirks;
pub mod release;
pub mod report;
pub mod sanitize;
pub mod scan_need;
pub mod slurm;
pub mod snapshot;
pub mod trend;
pub mod units;

pub use classify::{WatchFor, classify, work_watch_list};
pub use policy::Policy;
pub use report::{Class, GpuReport, Holder, Report};
pub use scan_need::{ScanNeed, full_scan_needed};
pub use snapshot::{GpuSample, ProcessFacts, Snapshot};

/// Version of the JSON documents vramguard writes (`status --json`, `diagnose --json`,
/// snapshots). Bumped on any incompatible change; additions of fields do not bump it.
pub const SCHEMA_VERSION: u32 = 2;
