//! The simulated NVIDIA driver: a model of GPUs whose memory is held by **real processes**.
//!
//! CI has no GPU, so vramguard ships a driver it can drive with real processes, real signals,
//! real PID namespaces and real cgroups. This crate is the model; `vramguard-sim-nvml` exports
//! it through the NVML C ABI (a `libnvidia-ml.so.1` stand-in) so that the real `nvml-wrapper`
//! code path runs against it, and `vramguard --sim STATE` uses it in-process.
//!
//! # State file
//! JSON (path from `--sim` or `VRAMGUARD_SIM`); see [`state::SimState`]. Unknown fields are
//! errors, so typos fail loudly with the line and column.
//!
//! # Semantics
//! - An allocation counts toward `used` while its process **has not finished exiting**:
//!   `proc_root/PID` exists and is not a zombie whose threads have all exited. A zombie leader
//!   whose other threads are alive or stuck in D state still holds the device, as on real
//!   drivers (files are closed in `do_exit`).
//! - Once the process is gone, `after_exit` decides: `"release"` frees it at once;
//!   `{"release_after_ms": N}` frees it N ms after the simulator **first saw** the process
//!   gone (the driver's teardown lag, during which a listed process stays listed although
//!   `/proc` has lost it); `"leak"` never frees it until a reset of its GPU, and it is never
//!   listed (driver residue).
//! - Listed processes are those alive (or in their teardown lag) with `listed: true`;
//!   pids are reported as the **calling** process's PID namespace numbers them, and holders
//!   it cannot see are listed nowhere (see [`namespace`]); for a caller in `proc_root`'s
//!   namespace `reported_pid` replaces the pid in every list (a driver reporting a pid from
//!   another namespace). A context inherited by a
//!   forked child is modelled as the child's own allocation with `listed: false`: memory held,
//!   no process listed, exactly how it looks on a real driver.
//! - Liveness is keyed by pid **and** start time: a reused pid is not the holder. "Gone" is
//!   sticky and shared between processes through `<state>.runtime.json` (first sightings and
//!   resets), so a lag measured by one process is the lag every process sees.
//! - `dev_dir` holds plain files `nvidia0..N`, `nvidiactl`, `nvidia-uvm` standing in for
//!   `/dev`; simulated holders keep them open, and vramguard's `/proc` scanner treats
//!   `dev_dir` as the device directory. Simulated CUDA processes map a stand-in
//!   `libcuda.so.1`, and NVML clients a stand-in `libnvidia-ml.so.1` (see [`library`]), as
//!   the real ones map the driver's libraries.
//! - A reset of GPU N ([`Sim::reset`], the stand-in for `nvidia-smi --gpu-reset -i N`) clears
//!   its residue and lagging releases, and fails with "in use" while a live process holds an
//!   allocation on it or has its device file open.
//! - Faults inject an NVML return code into a named call, optionally after `after_calls`
//!   successful calls and for `times` calls, counted per process and per GPU.
//! - MIG mode reports per-process memory as `NVML_VALUE_NOT_AVAILABLE` and no utilization.
#![deny(missing_docs)]

/// NVML's return codes (they belong to the GPU crate, which speaks NVML).
pub use vramguard_gpu::codes;
pub mod client;
pub mod context;
mod fdpass;
pub mod holder;
pub mod library;
pub mod model;
pub mod namespace;
pub mod quirks;
pub mod source;
pub mod state;
pub mod store;

pub use model::{FaultHit, Observation, ObservedGpu, ObservedProcess, Sim, SimError};
pub use source::SimSource;
pub use state::{AfterExit, AllocationKind, SimAllocation, SimGpu, SimState};
