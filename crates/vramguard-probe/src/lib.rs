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

use std::path::PathBuf;
use std::time::Duration;

/// Why a probe stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// A holder could not be started.
    #[error(transparent)]
    Holder(#[from] holders::HolderError),
    /// The holders' memory never showed in NVML.
    #[error(
        "the holders' memory never appeared in NVML on GPU {gpu} within {timeout:?} (used {used:?}, expected at least {expected})"
    )]
    NeverAppeared {
        /// The GPU.
        gpu: u32,
        /// How long it waited.
        timeout: Duration,
        /// The last used memory read.
        used: Option<u64>,
        /// What it waited for.
        expected: u64,
    },
    /// The GPU's memory could not be read.
    #[error("GPU {0}: its memory could not be read")]
    Unreadable(u32),
    /// A report file could not be written.
    #[error("{action} {}: {cause}", path.display())]
    Write {
        /// `creating` or `writing`.
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why.
        cause: std::io::Error,
    },
    /// A plot could not be drawn.
    #[error("plotting {}: {cause}", path.display())]
    Plot {
        /// The SVG file.
        path: PathBuf,
        /// The plotting library's message.
        cause: String,
    },
}
