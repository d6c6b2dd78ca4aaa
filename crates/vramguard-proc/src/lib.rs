//! The `/proc` half of a vramguard snapshot.
//!
//! [`ProcFs`] reads one tree (the live `/proc` or a fixture directory: every read is relative
//! to a root passed in, never a global), [`parse`] holds the pure parsers, and
//! [`ProcCollector`] decides what to read so that a steady-state collection costs O(holders),
//! not O(processes × open files).
//!
//! Files the kernel serves under a process's mmap lock (`cmdline`, `maps`) are read through
//! [`address_space::AddressSpaceReads`], on worker threads with a deadline: a process with a
//! thread stuck in the driver holding that lock hangs every reader, and must not hang the
//! collection.
//!
//! Processes vanish mid-scan all the time; that is never an error here. One helper
//! ([`procfs::Found`]) decides what an errno means: ENOENT/ESRCH = gone, EACCES/EPERM =
//! unknown (and said so), anything else = an error naming the path.
#![deny(missing_docs)]

pub mod address_space;
pub mod collector;
pub mod containers;
pub mod devices;
pub mod exits;
pub mod host;
pub mod opens;
pub mod parse;
pub mod procfs;
pub mod spawn;
pub mod work;

pub use collector::{Collected, ProcCollector, ScanDepth};
pub use procfs::{Found, NamespaceId, OWN_PROC, ProcDir, ProcError, ProcFs};
pub use work::WorkSampler;
