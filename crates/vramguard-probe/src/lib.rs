//! `vramguard probe`: measures how the driver releases GPU memory on the user's own hardware.
//!
//! A holder process allocates memory ([`holders`]: the built-in CUDA holder loads
//! `libcuda.so.1` with `dlopen`; `--holder-cmd` runs the user's framework; on the simulated
//! driver, holders register simulated allocations), a [`sampler`] thread reads the GPU's used
//! memory at a fixed high rate with timestamps, the [`experiments`] signal holders and read the
//! release off the samples, and [`report`] writes Markdown, JSON and SVG.
//!
//! On the simulated driver the whole probe runs in CI: the measured latency must match the
//! simulator's configured teardown lag within the sampling period.
#![deny(missing_docs)]

pub mod cuda;
pub mod experiments;
pub mod holders;
pub mod report;
pub mod sampler;
