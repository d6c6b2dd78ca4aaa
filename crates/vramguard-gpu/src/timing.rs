//! What each driver call of one sample costs (`vramguard probe calls`).
//!
//! The agent reads every GPU through the same routine ([`crate::read::read_gpu`]) at every
//! sample; on a real driver the calls, not vramguard's own work, can be most of a sample's CPU.
//! [`time_calls`] runs that routine with every device call timed, so that which calls are
//! worth reading less often is a measurement, not a guess.

use crate::read::{
    DeviceCalls, NOT_FOUND, NOT_SUPPORTED, RawProcess, RawUtilization, list_call, read_gpu,
};
use crate::{DriverHead, GpuReader, SourceError, now_ms};
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use vramguard_core::snapshot::{
    CallError, GpuMemory, MigDeviceSample, ProcessKind, RemappedRows, RetiredPages,
};

/// The durations and answers of each call, by NVML function name.
#[derive(Debug, Default)]
pub struct CallTimes {
    calls: BTreeMap<&'static str, Answers>,
}

#[derive(Debug, Default)]
struct Answers {
    took: Vec<Duration>,
    not_supported: u64,
    not_found: u64,
    /// Other failures, by what the driver said.
    failed: BTreeMap<String, u64>,
}

impl CallTimes {
    /// Records one call of `call` that took `took` and answered `result`.
    pub fn record<T>(&mut self, call: &'static str, took: Duration, result: &Result<T, CallError>) {
        let a = self.calls.entry(call).or_default();
        a.took.push(took);
        match result {
            Ok(_) => {}
            Err(e) if e.code == Some(NOT_SUPPORTED) => a.not_supported += 1,
            Err(e) if e.code == Some(NOT_FOUND) => a.not_found += 1,
            Err(e) => {
                let what = match e.code {
                    Some(code) => format!("{} (code {code})", e.message),
                    None => e.message.clone(),
                };
                // Bounded: a driver that words each failure differently adds no entries.
                if a.failed.len() < 8 || a.failed.contains_key(&what) {
                    *a.failed.entry(what).or_default() += 1;
                } else {
                    *a.failed.entry("other failures".into()).or_default() += 1;
                }
            }
        }
    }

    /// The calls recorded, by NVML function name, each with how many times it was made.
    pub fn counts(&self) -> impl Iterator<Item = (&'static str, usize)> + '_ {
        self.calls.iter().map(|(call, a)| (*call, a.took.len()))
    }

    /// Times `f` as one call of `call`.
    fn time<T>(
        &mut self,
        call: &'static str,
        f: impl FnOnce() -> Result<T, CallError>,
    ) -> Result<T, CallError> {
        let t = Instant::now();
        let r = f();
        self.record(call, t.elapsed(), &r);
        r
    }
}

/// A GPU's calls, each timed into a [`CallTimes`].
pub struct Timed<'a> {
    /// The device whose calls are timed.
    pub inner: &'a mut dyn DeviceCalls,
    /// Where the times go.
    pub times: &'a mut CallTimes,
}

impl DeviceCalls for Timed<'_> {
    fn uuid(&mut self) -> Result<String, CallError> {
        self.times.time("nvmlDeviceGetUUID", || self.inner.uuid())
    }
    fn name(&mut self) -> Result<String, CallError> {
        self.times.time("nvmlDeviceGetName", || self.inner.name())
    }
    fn pci_bus_id(&mut self) -> Result<String, CallError> {
        self.times
            .time("nvmlDeviceGetPciInfo_v3", || self.inner.pci_bus_id())
    }
    fn minor_number(&mut self) -> Result<u32, CallError> {
        self.times
            .time("nvmlDeviceGetMinorNumber", || self.inner.minor_number())
    }
    fn memory(&mut self) -> Result<GpuMemory, CallError> {
        self.times
            .time("nvmlDeviceGetMemoryInfo_v2", || self.inner.memory())
    }
    fn persistence_mode(&mut self) -> Result<bool, CallError> {
        self.times.time("nvmlDeviceGetPersistenceMode", || {
            self.inner.persistence_mode()
        })
    }
    fn processes(&mut self, kind: ProcessKind, legacy: bool) -> Result<Vec<RawProcess>, CallError> {
        self.times.time(list_call(kind, legacy), || {
            self.inner.processes(kind, legacy)
        })
    }
    fn utilization(&mut self, since_us: u64) -> Result<Vec<RawUtilization>, CallError> {
        self.times.time("nvmlDeviceGetProcessUtilization", || {
            self.inner.utilization(since_us)
        })
    }
    fn remapped_rows(&mut self) -> Result<RemappedRows, CallError> {
        self.times
            .time("nvmlDeviceGetRemappedRows", || self.inner.remapped_rows())
    }
    fn retired_pages(&mut self) -> Result<RetiredPages, CallError> {
        self.times.time(
            "nvmlDeviceGetRetiredPages (both causes) and …PendingStatus",
            || self.inner.retired_pages(),
        )
    }
    fn v3_writes_32_byte_records(&self) -> bool {
        self.inner.v3_writes_32_byte_records()
    }
    fn mig_devices(&mut self) -> Result<Vec<MigDeviceSample>, CallError> {
        self.times.time(
            "MIG devices (every nvmlDeviceGetMigDeviceHandleByIndex and its lists)",
            || self.inner.mig_devices(),
        )
    }
    fn utilization_rates(&mut self) -> Result<(u32, u32), CallError> {
        self.times.time("nvmlDeviceGetUtilizationRates", || {
            self.inner.utilization_rates()
        })
    }
    fn temperature(&mut self) -> Result<u32, CallError> {
        self.times
            .time("nvmlDeviceGetTemperature", || self.inner.temperature())
    }
    fn power_usage(&mut self) -> Result<u32, CallError> {
        self.times
            .time("nvmlDeviceGetPowerUsage", || self.inner.power_usage())
    }
    fn power_limit(&mut self) -> Result<u32, CallError> {
        self.times.time("nvmlDeviceGetEnforcedPowerLimit", || {
            self.inner.power_limit()
        })
    }
    fn performance_state(&mut self) -> Result<u32, CallError> {
        self.times.time("nvmlDeviceGetPerformanceState", || {
            self.inner.performance_state()
        })
    }
    fn ecc_enabled(&mut self) -> Result<bool, CallError> {
        self.times
            .time("nvmlDeviceGetEccMode", || self.inner.ecc_enabled())
    }
    fn ecc_volatile(&mut self) -> Result<(u64, u64), CallError> {
        self.times
            .time("nvmlDeviceGetTotalEccErrors", || self.inner.ecc_volatile())
    }
    fn fan_percent(&mut self) -> Result<u32, CallError> {
        self.times
            .time("nvmlDeviceGetFanSpeed", || self.inner.fan_percent())
    }
    fn compute_mode(&mut self) -> Result<String, CallError> {
        self.times
            .time("nvmlDeviceGetComputeMode", || self.inner.compute_mode())
    }
    fn mig_enabled(&mut self) -> Result<bool, CallError> {
        self.times
            .time("nvmlDeviceGetMigMode", || self.inner.mig_enabled())
    }
    fn display_active(&mut self) -> Result<bool, CallError> {
        self.times
            .time("nvmlDeviceGetDisplayActive", || self.inner.display_active())
    }
}

/// The cost of one call over the samples taken, in microseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CallCost {
    /// The NVML function.
    pub call: &'static str,
    /// How many times it was called (a process list asked again when it grew counts twice).
    pub calls: u64,
    /// Answers `NOT_SUPPORTED` (a reading this GPU does not have: absent, not an error).
    pub not_supported: u64,
    /// Answers `NOT_FOUND` (per-process utilization: no sample in the window).
    pub not_found: u64,
    /// Other failed answers, by what the driver said.
    pub failed: BTreeMap<String, u64>,
    /// Median, 90th percentile and largest duration of one call.
    pub median_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// Largest.
    pub max_us: f64,
    /// Total time in this call per sample, on average.
    pub per_sample_us: f64,
}

/// What one GPU's sample costs, call by call.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SampleCost {
    /// The GPU read.
    pub gpu: u32,
    /// Samples taken.
    pub samples: u32,
    /// Each call, most expensive per sample first.
    pub calls: Vec<CallCost>,
    /// Every call of one sample together, median over the samples, µs.
    pub calls_median_us: f64,
    /// The driver-wide calls of a sample (versions, device count), median, µs.
    pub head_median_us: f64,
    /// The GPU read as every sample of vramguard reads it (its Xid events included), not
    /// call by call, median, µs: what the agent pays for this GPU per sample.
    pub read_median_us: f64,
    /// The settled reading of the agent's quiet samples (UUID, memory, process lists, Xid
    /// events: [`crate::read::read_gpu_settled`]), median, µs.
    pub settled_read_median_us: f64,
}

/// Why the calls could not be timed.
#[derive(Debug, thiserror::Error)]
pub enum TimingError {
    /// The driver could not be read at all.
    #[error(transparent)]
    Source(#[from] SourceError),
    /// No GPU of that index.
    #[error("GPU {gpu}: the driver counts {count} GPU(s) (indices 0 to {last})", last = count.saturating_sub(1))]
    NoSuchGpu {
        /// Asked for.
        gpu: u32,
        /// Counted.
        count: u32,
    },
    /// The GPU's handle could not be had.
    #[error("GPU {gpu}: {error}")]
    Handle {
        /// Asked for.
        gpu: u32,
        /// The failed call.
        error: CallError,
    },
}

/// Reads GPU `gpu` of `reader` `samples` times as a sample of vramguard does, each call timed,
/// alternating with untimed reads of the whole GPU. `window` is how far back per-process
/// utilization is asked for (the agent asks for its policy's idle window).
pub fn time_calls(
    reader: &dyn GpuReader,
    gpu: u32,
    samples: u32,
    window: Duration,
) -> Result<SampleCost, TimingError> {
    let samples = samples.max(1);
    let mut times = CallTimes::default();
    let (mut heads, mut sums, mut reads, mut settled) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples {
        reader.begin_sample();
        let result = one_sample(reader, gpu, window, &mut times);
        reader.end_sample();
        let (head, sum, read, settled_read) = result?;
        heads.push(head);
        sums.push(sum);
        reads.push(read);
        settled.push(settled_read);
    }
    let mut calls: Vec<CallCost> = times
        .calls
        .into_iter()
        .map(|(call, a)| {
            let total: Duration = a.took.iter().sum();
            let mut took = a.took;
            took.sort_unstable();
            CallCost {
                call,
                calls: took.len() as u64,
                not_supported: a.not_supported,
                not_found: a.not_found,
                failed: a.failed,
                median_us: percentile_us(&took, 50),
                p90_us: percentile_us(&took, 90),
                max_us: took.last().map_or(0.0, |d| micros(*d)),
                per_sample_us: micros(total) / f64::from(samples),
            }
        })
        .collect();
    calls.sort_by(|a, b| b.per_sample_us.total_cmp(&a.per_sample_us));
    let median = |mut v: Vec<Duration>| {
        v.sort_unstable();
        percentile_us(&v, 50)
    };
    Ok(SampleCost {
        gpu,
        samples,
        calls,
        calls_median_us: median(sums),
        head_median_us: median(heads),
        read_median_us: median(reads),
        settled_read_median_us: median(settled),
    })
}

/// One timed reading, one untimed and one settled: (head, every call summed, whole read,
/// settled read).
fn one_sample(
    reader: &dyn GpuReader,
    gpu: u32,
    window: Duration,
    times: &mut CallTimes,
) -> Result<(Duration, Duration, Duration, Duration), TimingError> {
    let t = Instant::now();
    let head: DriverHead = reader.head()?;
    let head_took = t.elapsed();
    if gpu >= head.count {
        return Err(TimingError::NoSuchGpu {
            gpu,
            count: head.count,
        });
    }
    let now = now_ms();
    let since = now.saturating_sub(window.as_millis() as u64);
    let version = head.driver.driver_version.clone();
    let before: Duration = times.calls.values().flat_map(|a| a.took.iter()).sum();
    reader
        .with_device(gpu, &mut |dev| {
            let mut timed = Timed { inner: dev, times };
            read_gpu(gpu, &mut timed, version.as_deref(), now, since);
        })
        .map_err(|error| TimingError::Handle { gpu, error })?;
    let after: Duration = times.calls.values().flat_map(|a| a.took.iter()).sum();
    let t = Instant::now();
    reader.read_gpu(gpu, &head, now, since);
    let read_took = t.elapsed();
    let t = Instant::now();
    reader.read_gpu_settled(gpu, &head);
    Ok((
        head_took,
        after.saturating_sub(before),
        read_took,
        t.elapsed(),
    ))
}

fn micros(d: Duration) -> f64 {
    d.as_nanos() as f64 / 1000.0
}

/// The `pct`th percentile of sorted durations (nearest rank), in µs.
fn percentile_us(sorted: &[Duration], pct: usize) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (sorted.len() * pct).div_ceil(100).clamp(1, sorted.len());
    micros(sorted[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device whose temperature takes 3 ms and whose fan is not there.
    struct SlowSensor;
    impl DeviceCalls for SlowSensor {
        fn uuid(&mut self) -> Result<String, CallError> {
            Ok("GPU-1".into())
        }
        fn name(&mut self) -> Result<String, CallError> {
            Ok("Test".into())
        }
        fn pci_bus_id(&mut self) -> Result<String, CallError> {
            Ok("00000000:01:00.0".into())
        }
        fn minor_number(&mut self) -> Result<u32, CallError> {
            Ok(0)
        }
        fn memory(&mut self) -> Result<GpuMemory, CallError> {
            Ok(GpuMemory {
                total: 1 << 30,
                reserved: 0,
                used: 0,
                free: 1 << 30,
            })
        }
        fn persistence_mode(&mut self) -> Result<bool, CallError> {
            Ok(true)
        }
        fn processes(&mut self, _: ProcessKind, _: bool) -> Result<Vec<RawProcess>, CallError> {
            Ok(Vec::new())
        }
        fn utilization(&mut self, _: u64) -> Result<Vec<RawUtilization>, CallError> {
            Ok(Vec::new())
        }
        fn remapped_rows(&mut self) -> Result<RemappedRows, CallError> {
            Err(crate::read::not_supported("nvmlDeviceGetRemappedRows"))
        }
        fn retired_pages(&mut self) -> Result<RetiredPages, CallError> {
            Err(CallError {
                call: "nvmlDeviceGetRetiredPages".into(),
                code: Some(999),
                message: "Unknown Error".into(),
            })
        }
        fn temperature(&mut self) -> Result<u32, CallError> {
            std::thread::sleep(Duration::from_millis(3));
            Ok(40)
        }
    }

    #[test]
    fn each_call_is_timed_and_its_answers_counted() {
        let mut times = CallTimes::default();
        for _ in 0..3 {
            let mut dev = SlowSensor;
            let mut timed = Timed {
                inner: &mut dev,
                times: &mut times,
            };
            read_gpu(0, &mut timed, Some("580.159.04"), 10_000, 0);
        }
        let temp = &times.calls["nvmlDeviceGetTemperature"];
        assert_eq!(temp.took.len(), 3);
        assert!(temp.took.iter().all(|d| *d >= Duration::from_millis(3)));
        let memory = &times.calls["nvmlDeviceGetMemoryInfo_v2"];
        assert!(memory.took.iter().all(|d| *d < Duration::from_millis(3)));
        // A reading the board does not have is counted apart from a failure.
        assert_eq!(times.calls["nvmlDeviceGetFanSpeed"].not_supported, 3);
        assert_eq!(times.calls["nvmlDeviceGetRemappedRows"].not_supported, 3);
        let retired = times
            .calls
            .iter()
            .find(|(k, _)| k.starts_with("nvmlDeviceGetRetiredPages"))
            .unwrap()
            .1;
        assert_eq!(retired.not_supported, 0);
        assert_eq!(
            retired.failed,
            BTreeMap::from([("Unknown Error (code 999)".to_string(), 3)])
        );
        // Every call read_gpu makes is counted under its NVML name.
        for call in [
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetProcessUtilization",
            "nvmlDeviceGetUtilizationRates",
        ] {
            assert_eq!(times.calls[call].took.len(), 3, "{call}");
        }
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let ms = |n: u64| Duration::from_millis(n);
        let sorted: Vec<Duration> = (1..=10).map(ms).collect();
        assert_eq!(percentile_us(&sorted, 50), 5_000.0);
        assert_eq!(percentile_us(&sorted, 90), 9_000.0);
        assert_eq!(percentile_us(&[ms(7)], 90), 7_000.0);
        assert_eq!(percentile_us(&[], 50), 0.0);
    }
}
