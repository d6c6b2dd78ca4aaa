//! A source that can let go of the driver and open it again: what a GPU reset needs.
//!
//! A reset (`nvidia-smi --gpu-reset`) is refused while any process other than the one doing
//! it holds the GPU ("In use by another client": the persistence daemon, a monitor, another
//! `nvidia-smi`). vramguard runs the reset command as a child, so its own NVML handles, and
//! the device files they keep open, are such a holder: it lets go of them first.

use crate::{DriverSample, GpuSource, SourceError};
use std::sync::Arc;
use std::time::Duration;
use vramguard_core::snapshot::CallError;

/// Opens a source (`nvmlInit_v2` and what comes with it).
pub type OpenSource = Arc<dyn Fn() -> Result<Box<dyn GpuSource>, SourceError> + Send + Sync>;

/// A source opened by `open`, closed by [`GpuSource::release`] and opened again by the next
/// call.
pub struct Reopening {
    open: OpenSource,
    inner: Option<Box<dyn GpuSource>>,
}

impl std::fmt::Debug for Reopening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reopening")
            .field("open", &self.inner.is_some())
            .finish()
    }
}

impl Reopening {
    /// Opens the source now: a driver that cannot be opened is an error at once.
    pub fn open(open: OpenSource) -> Result<Reopening, SourceError> {
        let inner = open()?;
        Ok(Reopening {
            open,
            inner: Some(inner),
        })
    }

    /// Whether the driver is open (not released since the last call).
    pub fn is_open(&self) -> bool {
        self.inner.is_some()
    }

    fn inner(&mut self) -> Result<&mut Box<dyn GpuSource>, SourceError> {
        if self.inner.is_none() {
            self.inner = Some((self.open)()?);
        }
        Ok(self.inner.as_mut().expect("opened above"))
    }
}

/// The call that failed when the driver could not be opened again, for calls that answer
/// with a [`CallError`].
fn reopen_error(e: SourceError) -> CallError {
    match e {
        SourceError::Init { error, .. } | SourceError::Call(error) => error,
        other => CallError {
            call: "nvmlInit_v2".into(),
            code: None,
            message: other.to_string(),
        },
    }
}

impl GpuSource for Reopening {
    fn sample(&mut self, utilization_window: Duration) -> Result<DriverSample, SourceError> {
        self.inner()?.sample(utilization_window)
    }

    fn memory_used(&mut self, gpu: u32) -> Result<u64, CallError> {
        self.inner().map_err(reopen_error)?.memory_used(gpu)
    }

    fn settled(&mut self) -> Result<DriverSample, SourceError> {
        self.inner()?.settled()
    }

    fn release(&mut self) {
        if let Some(mut inner) = self.inner.take() {
            inner.release();
        }
    }
}
