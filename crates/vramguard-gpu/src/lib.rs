//! The GPU half of a vramguard snapshot.
//!
//! Two sources implement [`GpuSource`]: [`NvmlSource`] here (NVML through `nvml-wrapper`: the
//! real driver, or the simulator's `libnvidia-ml.so.1`) and `vramguard_sim::SimSource` (the
//! simulation model in-process, which lives with the simulator so that nothing here depends
//! on it). Both answer the same small set of per-device calls ([`read::DeviceCalls`]);
//! one routine ([`read::read_gpu`]) turns those answers into a [`GpuSample`], validating every
//! process record, falling back to the `_v2` calls when `_v3` records are implausible,
//! de-duplicating pids across the three process lists and dropping junk utilization samples.
//! Sharing that routine is what makes the two sources give identical snapshots.
//!
//! One GPU failing never hides the others: its sample carries the failed call.
#![deny(missing_docs)]

pub mod codes;
mod deadline;
mod nvml;
pub mod read;
mod reopen;
pub mod timing;

pub use deadline::DeadlineSource;
pub use nvml::{NvmlSource, now_ms, unreachable_gpu};
pub use reopen::{OpenSource, Reopening};

use std::time::Duration;
use vramguard_core::snapshot::{CallError, DriverFacts, GpuSample};

/// The default NVML library name: the versioned soname every driver install provides (the
/// unversioned `libnvidia-ml.so` only comes with development packages).
pub const DEFAULT_NVML_LIB: &str = "libnvidia-ml.so.1";

/// What one reading of every GPU produced.
#[derive(Debug, Clone, PartialEq)]
pub struct DriverSample {
    /// The driver's identity.
    pub driver: DriverFacts,
    /// One sample per GPU.
    pub gpus: Vec<GpuSample>,
}

/// Why no GPU could be read at all.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The NVML library could not be loaded.
    #[error("no NVIDIA driver: {lib} could not be loaded ({reason}); try `vramguard demo`")]
    NoDriver {
        /// The library path or name.
        lib: String,
        /// The loader's message.
        reason: String,
    },
    /// The library loaded but NVML refused to start.
    #[error("NVIDIA driver unusable: {error}; {advice}")]
    Init {
        /// The failed call.
        error: CallError,
        /// What to check.
        advice: &'static str,
    },
    /// A machine-wide call failed (e.g. the device count).
    #[error("NVIDIA driver: {0}")]
    Call(CallError),
    /// Another source's own failure (the simulator's state file).
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync>),
}

/// Something that can read every GPU.
pub trait GpuSource: Send {
    /// Reads every GPU. `utilization_window` is how far back to ask for per-process
    /// utilization samples.
    fn sample(&mut self, utilization_window: Duration) -> Result<DriverSample, SourceError>;

    /// Used memory of one GPU, and nothing else: the call a high-rate sampler makes.
    fn memory_used(&mut self, gpu: u32) -> Result<u64, CallError>;

    /// Reads only what a settled GPU is compared on ([`read::read_gpu_settled`]: UUID, memory,
    /// process lists, and the Xid events since the last reading), of the GPUs the last
    /// [`GpuSource::sample`] counted. A source that cannot read less reads everything.
    fn settled(&mut self) -> Result<DriverSample, SourceError> {
        self.sample(Duration::ZERO)
    }

    /// Lets go of the driver: closes what this process holds of it (NVML's handles, and with
    /// them its device files) before a GPU reset, which is refused while any process other
    /// than the resetting one holds the GPU. A source that can open it again does so at its
    /// next call ([`Reopening`]); one that holds nothing, or cannot, does nothing.
    fn release(&mut self) {}
}

/// What a sample starts with: the driver-wide calls.
#[derive(Debug, Clone, PartialEq)]
pub struct DriverHead {
    /// The driver's identity.
    pub driver: DriverFacts,
    /// How many GPUs the driver counts.
    pub count: u32,
}

/// A source whose GPUs can be read one at a time, from several threads at once, so that one
/// GPU stuck in the driver holds up neither the others nor the caller ([`DeadlineSource`]).
/// NVML itself is thread-safe; the simulator's model sits behind a lock that it releases
/// while a call stalls.
pub trait GpuReader: Send + Sync + 'static {
    /// The driver-wide calls: versions and the device count.
    fn head(&self) -> Result<DriverHead, SourceError>;

    /// Reads GPU `index`, its Xid events included. Never fails: what could not be read is
    /// in the sample. `now_ms`/`since_ms` bound the utilization samples asked for.
    fn read_gpu(&self, index: u32, head: &DriverHead, now_ms: u64, since_ms: u64) -> GpuSample;

    /// Used memory of one GPU, and nothing else.
    fn memory_used(&self, gpu: u32) -> Result<u64, CallError>;

    /// Reads what [`read::read_gpu_settled`] reads of GPU `index`, and its Xid events. A
    /// reader that cannot read less reads everything.
    fn read_gpu_settled(&self, index: u32, head: &DriverHead) -> GpuSample {
        let now = nvml::now_ms();
        self.read_gpu(index, head, now, now)
    }

    /// Called before the GPUs of one sample are read (the simulator takes one observation
    /// for the whole sample, as one instant of a real driver).
    fn begin_sample(&self) {}

    /// Called when the sample is complete (or given up on).
    fn end_sample(&self) {}

    /// Hands GPU `index`'s calls to `use_device` (`vramguard probe calls` times them one by
    /// one). A reader without per-call access answers `NOT_SUPPORTED`.
    fn with_device(
        &self,
        index: u32,
        use_device: &mut dyn FnMut(&mut dyn read::DeviceCalls),
    ) -> Result<(), CallError> {
        let _ = (index, use_device);
        Err(read::not_supported("per-call access"))
    }
}

/// Reads every GPU of `reader` in turn, on the calling thread, without deadlines: what a
/// source's own [`GpuSource::sample`] does (the parity tests compare sources this way).
pub fn read_in_turn(
    reader: &dyn GpuReader,
    utilization_window: Duration,
) -> Result<DriverSample, SourceError> {
    reader.begin_sample();
    let result = reader.head().map(|head| {
        let now = now_ms();
        let since = now.saturating_sub(utilization_window.as_millis() as u64);
        let gpus = (0..head.count)
            .map(|index| reader.read_gpu(index, &head, now, since))
            .collect();
        DriverSample {
            driver: head.driver,
            gpus,
        }
    });
    reader.end_sample();
    result
}

/// [`read_in_turn`]'s settled reading ([`GpuReader::read_gpu_settled`] of every GPU): what a
/// source's own [`GpuSource::settled`] does.
pub fn read_settled_in_turn(reader: &dyn GpuReader) -> Result<DriverSample, SourceError> {
    reader.begin_sample();
    let result = reader.head().map(|head| DriverSample {
        gpus: (0..head.count)
            .map(|index| reader.read_gpu_settled(index, &head))
            .collect(),
        driver: head.driver,
    });
    reader.end_sample();
    result
}

/// What to check when NVML refuses to start with `code`.
pub fn init_advice(code: Option<u32>) -> &'static str {
    match code {
        Some(9) => "is the kernel module loaded? (`lsmod | grep nvidia`, `dmesg | grep -i nvrm`)",
        Some(4) => "run as root or as a user allowed to open /dev/nvidia*",
        Some(18) => {
            "the driver and its user-space library differ in version: reboot after a driver upgrade"
        }
        _ => "check `nvidia-smi` and `dmesg | grep -i nvrm`",
    }
}
