//! The shared per-GPU reading routine.

use std::collections::BTreeMap;
use vramguard_core::snapshot::{
    CallError, GpuMemory, GpuProcess, GpuSample, GpuTelemetry, MigDeviceSample, ProcessKind,
    ProcessListState, RemappedRows, RetiredPages, UtilizationSample, UtilizationWindow, XidCount,
};

/// Linux's `PID_MAX_LIMIT` on 64-bit: no real pid is larger.
pub const PID_MAX_LIMIT: u32 = 4_194_304;

/// One record of a process list, as the driver returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawProcess {
    /// Pid.
    pub pid: u32,
    /// Memory; `None` for `NVML_VALUE_NOT_AVAILABLE`.
    pub used_bytes: Option<u64>,
}

/// One utilization sample, as the driver returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawUtilization {
    /// Pid.
    pub pid: u32,
    /// CPU timestamp, microseconds since the Unix epoch.
    pub timestamp_us: u64,
    /// SM percent (junk values above 100 happen).
    pub sm: u32,
    /// Memory percent.
    pub mem: u32,
}

/// NVML's `NOT_SUPPORTED`.
pub const NOT_SUPPORTED: u32 = 3;
/// NVML's `NOT_FOUND`.
pub const NOT_FOUND: u32 = 6;
/// NVML's `INSUFFICIENT_SIZE`.
pub const INSUFFICIENT_SIZE: u32 = 7;

/// The per-device calls a source answers. Errors carry the NVML call and code.
pub trait DeviceCalls {
    /// `nvmlDeviceGetUUID`.
    fn uuid(&mut self) -> Result<String, CallError>;
    /// `nvmlDeviceGetName`.
    fn name(&mut self) -> Result<String, CallError>;
    /// `nvmlDeviceGetPciInfo_v3`, the bus id.
    fn pci_bus_id(&mut self) -> Result<String, CallError>;
    /// `nvmlDeviceGetMinorNumber`.
    fn minor_number(&mut self) -> Result<u32, CallError>;
    /// `nvmlDeviceGetMemoryInfo_v2`.
    fn memory(&mut self) -> Result<GpuMemory, CallError>;
    /// `nvmlDeviceGetPersistenceMode`.
    fn persistence_mode(&mut self) -> Result<bool, CallError>;
    /// One process list (`_v3`, or `_v2` when `legacy`). May fail with `INSUFFICIENT_SIZE`
    /// when the list grew between the count and the fill; the caller retries.
    fn processes(&mut self, kind: ProcessKind, legacy: bool) -> Result<Vec<RawProcess>, CallError>;
    /// `nvmlDeviceGetProcessUtilization` since `since_us`.
    fn utilization(&mut self, since_us: u64) -> Result<Vec<RawUtilization>, CallError>;
    /// `nvmlDeviceGetRemappedRows`.
    fn remapped_rows(&mut self) -> Result<RemappedRows, CallError>;
    /// `nvmlDeviceGetRetiredPages` for both causes and `nvmlDeviceGetRetiredPagesPendingStatus`.
    fn retired_pages(&mut self) -> Result<RetiredPages, CallError>;
    /// Whether this driver's `_v3` process calls write 32-byte records (the 535.43–535.98
    /// bug): then they are never called with a buffer of 24-byte records, which they would
    /// overrun with more than 15 processes.
    fn v3_writes_32_byte_records(&self) -> bool {
        false
    }
    /// In MIG mode, every MIG device of this GPU with its memory and its compute processes,
    /// each with the memory it holds there (the whole GPU's lists report it as not
    /// available). `NOT_SUPPORTED` where the GPU has no MIG devices to ask.
    fn mig_devices(&mut self) -> Result<Vec<MigDeviceSample>, CallError> {
        Err(not_supported("nvmlDeviceGetMigDeviceHandleByIndex"))
    }
    /// `nvmlDeviceGetUtilizationRates`: (GPU %, memory %).
    fn utilization_rates(&mut self) -> Result<(u32, u32), CallError> {
        Err(not_supported("nvmlDeviceGetUtilizationRates"))
    }
    /// `nvmlDeviceGetTemperature` of the GPU sensor, °C.
    fn temperature(&mut self) -> Result<u32, CallError> {
        Err(not_supported("nvmlDeviceGetTemperature"))
    }
    /// `nvmlDeviceGetPowerUsage`, milliwatts.
    fn power_usage(&mut self) -> Result<u32, CallError> {
        Err(not_supported("nvmlDeviceGetPowerUsage"))
    }
    /// `nvmlDeviceGetEnforcedPowerLimit`, milliwatts.
    fn power_limit(&mut self) -> Result<u32, CallError> {
        Err(not_supported("nvmlDeviceGetEnforcedPowerLimit"))
    }
    /// `nvmlDeviceGetPerformanceState`: 0 for P0.
    fn performance_state(&mut self) -> Result<u32, CallError> {
        Err(not_supported("nvmlDeviceGetPerformanceState"))
    }
    /// `nvmlDeviceGetEccMode`, the current mode.
    fn ecc_enabled(&mut self) -> Result<bool, CallError> {
        Err(not_supported("nvmlDeviceGetEccMode"))
    }
    /// `nvmlDeviceGetTotalEccErrors`, volatile: (corrected, uncorrected).
    fn ecc_volatile(&mut self) -> Result<(u64, u64), CallError> {
        Err(not_supported("nvmlDeviceGetTotalEccErrors"))
    }
    /// `nvmlDeviceGetFanSpeed` of the first fan, percent.
    fn fan_percent(&mut self) -> Result<u32, CallError> {
        Err(not_supported("nvmlDeviceGetFanSpeed"))
    }
    /// `nvmlDeviceGetComputeMode`, named as nvidia-smi names it.
    fn compute_mode(&mut self) -> Result<String, CallError> {
        Err(not_supported("nvmlDeviceGetComputeMode"))
    }
    /// `nvmlDeviceGetMigMode`, the current mode.
    fn mig_enabled(&mut self) -> Result<bool, CallError> {
        Err(not_supported("nvmlDeviceGetMigMode"))
    }
    /// `nvmlDeviceGetDisplayActive`.
    fn display_active(&mut self) -> Result<bool, CallError> {
        Err(not_supported("nvmlDeviceGetDisplayActive"))
    }
}

/// The error a source gives for a call its GPU does not support.
pub fn not_supported(call: &str) -> CallError {
    CallError {
        call: call.into(),
        code: Some(NOT_SUPPORTED),
        message: "Not Supported".into(),
    }
}

/// Utilization, temperature, power, P-state and ECC: each absent where unsupported, other
/// failures kept as warnings (never a failed GPU).
fn read_telemetry(dev: &mut dyn DeviceCalls, warnings: &mut Vec<CallError>) -> GpuTelemetry {
    let rates = optional(dev.utilization_rates(), warnings);
    let ecc = optional(dev.ecc_volatile(), warnings);
    GpuTelemetry {
        gpu_util_percent: rates.map(|r| r.0),
        memory_util_percent: rates.map(|r| r.1),
        temperature_c: optional(dev.temperature(), warnings),
        power_mw: optional(dev.power_usage(), warnings),
        power_limit_mw: optional(dev.power_limit(), warnings),
        performance_state: optional(dev.performance_state(), warnings),
        ecc_enabled: optional(dev.ecc_enabled(), warnings),
        ecc_corrected_volatile: ecc.map(|e| e.0),
        ecc_uncorrected_volatile: ecc.map(|e| e.1),
        fan_percent: optional(fan_reading(dev.fan_percent()), warnings),
        compute_mode: optional(dev.compute_mode(), warnings),
        mig_enabled: optional(dev.mig_enabled(), warnings),
        display_active: optional(dev.display_active(), warnings),
    }
}

/// Whether driver `version` is one of those whose `_v3` process calls write 32-byte records
/// into buffers their callers size for 24 (535.43 to 535.98; nvitop #75, gpustat #157).
pub fn driver_has_32_byte_v3_records(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    matches!(
        (parts.next(), parts.next()),
        (Some(Some(535)), Some(Some(minor))) if (43..=98).contains(&minor)
    )
}

/// Critical Xid events counted per GPU since a source started listening.
#[derive(Debug, Default, Clone)]
pub struct XidTally {
    counts: BTreeMap<(u32, u64), u64>,
}

impl XidTally {
    /// Counts one event.
    pub fn record(&mut self, gpu: u32, xid: u64) {
        *self.counts.entry((gpu, xid)).or_default() += 1;
    }

    /// The counts of one GPU, by Xid.
    pub fn counts(&self, gpu: u32) -> Vec<XidCount> {
        self.counts
            .range((gpu, 0)..=(gpu, u64::MAX))
            .map(|(&(_, xid), &count)| XidCount { xid, count })
            .collect()
    }
}

/// The fan speed, with a fanless board's answer read as a missing reading: driver 580.159.04
/// answers `INVALID_ARGUMENT` on an SXM H200 (it has no fan 0), not `NOT_SUPPORTED`. Counted
/// as a warning it made the agent report 52 collection errors in 24 s of a healthy GPU.
fn fan_reading(r: Result<u32, CallError>) -> Result<u32, CallError> {
    r.map_err(|e| {
        if e.code == Some(crate::codes::INVALID_ARGUMENT) {
            not_supported(&e.call)
        } else {
            e
        }
    })
}

/// An optional answer: absent where the GPU does not support the call; other errors are
/// kept as warnings.
fn optional<T>(r: Result<T, CallError>, warnings: &mut Vec<CallError>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            if e.code != Some(NOT_SUPPORTED) {
                warnings.push(e);
            }
            None
        }
    }
}

fn plausible(p: &RawProcess, total: Option<u64>) -> bool {
    p.pid > 0
        && p.pid <= PID_MAX_LIMIT
        && match (p.used_bytes, total) {
            (Some(b), Some(t)) => b <= t,
            _ => true,
        }
}

/// The NVML function that reads one process list.
pub fn list_call(kind: ProcessKind, legacy: bool) -> &'static str {
    match (kind, legacy) {
        (ProcessKind::Compute, false) => "nvmlDeviceGetComputeRunningProcesses_v3",
        (ProcessKind::Graphics, false) => "nvmlDeviceGetGraphicsRunningProcesses_v3",
        (ProcessKind::Mps, false) => "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        (ProcessKind::Compute, true) => "nvmlDeviceGetComputeRunningProcesses_v2",
        (ProcessKind::Graphics, true) => "nvmlDeviceGetGraphicsRunningProcesses_v2",
        (ProcessKind::Mps, true) => "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    }
}

/// Reads a list, retrying when it grew between the count and the fill.
fn list_with_retry(
    dev: &mut dyn DeviceCalls,
    kind: ProcessKind,
    legacy: bool,
) -> Result<Vec<RawProcess>, CallError> {
    let mut last = None;
    for _ in 0..3 {
        match dev.processes(kind, legacy) {
            Err(e) if e.code == Some(INSUFFICIENT_SIZE) => last = Some(e),
            other => return other,
        }
    }
    Err(last.expect("three attempts"))
}

/// Reads only what a settled GPU is compared on between two full readings (the agent's quiet
/// samples): its UUID, memory and process lists (with its MIG devices' where the lists
/// leave the memory out). Name, bus id, persistence, telemetry, health and utilization are
/// not asked for (a sixth of a full reading's calls), so they are `None`, empty or default.
/// Never fails: what could not be read is recorded in the sample.
pub fn read_gpu_settled(
    index: u32,
    dev: &mut dyn DeviceCalls,
    driver_version: Option<&str>,
) -> GpuSample {
    let mut warnings = Vec::new();
    let uuid = optional(dev.uuid(), &mut warnings);
    let mut sample = GpuSample {
        uuid,
        ..unread(index)
    };
    read_memory_and_processes(
        &mut sample,
        dev,
        driver_version,
        &mut warnings,
        |_, _, _| {},
    );
    sample.warnings = warnings;
    sample
}

/// GPU `index` before anything was read from it.
pub(crate) fn unread(index: u32) -> GpuSample {
    GpuSample {
        index,
        uuid: None,
        name: None,
        pci_bus_id: None,
        minor_number: None,
        memory: None,
        persistence_mode: None,
        processes: Vec::new(),
        process_list: ProcessListState::Complete,
        utilization: None,
        failure: None,
        warnings: Vec::new(),
        health: Default::default(),
        mig_devices: Vec::new(),
        telemetry: None,
    }
}

/// Reads the memory, then (between the two, through `between`) whatever else the caller
/// reads, then the process lists. False when the memory could not be read: the GPU has
/// failed, and nothing more was asked.
fn read_memory_and_processes(
    sample: &mut GpuSample,
    dev: &mut dyn DeviceCalls,
    driver_version: Option<&str>,
    warnings: &mut Vec<CallError>,
    between: impl FnOnce(&mut GpuSample, &mut dyn DeviceCalls, &mut Vec<CallError>),
) -> bool {
    match dev.memory() {
        Ok(m) => sample.memory = Some(m),
        Err(e) => {
            // Memory is what vramguard is about: without it the GPU counts as failed.
            sample.process_list = ProcessListState::Unavailable { error: e.clone() };
            sample.failure = Some(e);
            return false;
        }
    }
    between(sample, dev, warnings);
    let total = sample.memory.map(|m| m.total);
    let (processes, list_state, mig_devices) = read_processes(dev, total, driver_version, warnings);
    sample.processes = processes;
    sample.process_list = list_state;
    sample.mig_devices = mig_devices;
    true
}

/// Reads one GPU. Never fails: what could not be read is recorded in the sample.
pub fn read_gpu(
    index: u32,
    dev: &mut dyn DeviceCalls,
    driver_version: Option<&str>,
    now_ms: u64,
    utilization_since_ms: u64,
) -> GpuSample {
    let mut warnings = Vec::new();
    let uuid = optional(dev.uuid(), &mut warnings);
    let name = optional(dev.name(), &mut warnings);
    let pci_bus_id = optional(dev.pci_bus_id(), &mut warnings);
    let minor_number = optional(dev.minor_number(), &mut warnings);
    let mut sample = GpuSample {
        uuid,
        name,
        pci_bus_id,
        minor_number,
        ..unread(index)
    };
    let read = read_memory_and_processes(
        &mut sample,
        dev,
        driver_version,
        &mut warnings,
        |sample, dev, warnings| {
            sample.persistence_mode = optional(dev.persistence_mode(), warnings);
            sample.telemetry = Some(read_telemetry(dev, warnings));
            sample.health.remapped_rows = optional(dev.remapped_rows(), warnings);
            sample.health.retired_pages = optional(dev.retired_pages(), warnings);
        },
    );
    if !read {
        sample.warnings = warnings;
        return sample;
    }
    sample.utilization = read_utilization(
        dev,
        &sample.processes,
        now_ms,
        utilization_since_ms,
        &mut warnings,
    );
    sample.warnings = warnings;
    sample
}

/// Every process the driver lists on the GPU (compute, graphics and MPS lists merged, each
/// context charged once), and whether the list is complete.
fn read_processes(
    dev: &mut dyn DeviceCalls,
    total: Option<u64>,
    driver_version: Option<&str>,
    warnings: &mut Vec<CallError>,
) -> (Vec<GpuProcess>, ProcessListState, Vec<MigDeviceSample>) {
    let mut merged: BTreeMap<u32, GpuProcess> = BTreeMap::new();
    let mut list_state = ProcessListState::Complete;
    // On a driver whose `_v3` records do not fit the buffer, read the `_v2` lists instead.
    let skip_v3 = dev.v3_writes_32_byte_records();
    if skip_v3 {
        warnings.push(CallError {
            call: list_call(ProcessKind::Compute, false).into(),
            code: None,
            message: format!(
                "driver {} writes 32-byte `_v3` process records into buffers sized for 24 (the \
                 535.43-535.98 bug): the `_v2` calls were used instead; upgrade the driver to \
                 535.104 or later",
                driver_version.unwrap_or("unknown")
            ),
        });
    }
    let mut unreliable: Vec<String> = Vec::new();
    for kind in [
        ProcessKind::Compute,
        ProcessKind::Graphics,
        ProcessKind::Mps,
    ] {
        let records = match list_with_retry(dev, kind, skip_v3) {
            Ok(r) => r,
            Err(e) if e.code == Some(NOT_SUPPORTED) => continue,
            Err(e) => {
                if kind == ProcessKind::Compute {
                    // Without the compute list nothing can be attributed.
                    list_state = ProcessListState::Unavailable { error: e };
                    break;
                }
                warnings.push(e);
                continue;
            }
        };
        let records = plausible_records(
            dev,
            kind,
            records,
            total,
            driver_version,
            warnings,
            &mut unreliable,
        );
        for r in records {
            let entry = merged.entry(r.pid).or_insert(GpuProcess {
                pid: r.pid,
                kinds: Vec::new(),
                used_bytes: r.used_bytes,
            });
            if !entry.kinds.contains(&kind) {
                entry.kinds.push(kind);
            }
            // The same context in two lists is charged once: keep the larger figure.
            entry.used_bytes = match (entry.used_bytes, r.used_bytes) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
        }
    }
    let mut mig_devices = Vec::new();
    if merged.values().any(|p| p.used_bytes.is_none()) {
        mig_devices = fill_from_mig_devices(dev, &mut merged, warnings);
    }
    if !unreliable.is_empty() && matches!(list_state, ProcessListState::Complete) {
        list_state = ProcessListState::Unreliable {
            reason: unreliable.join("; "),
        };
    }
    (merged.into_values().collect(), list_state, mig_devices)
}

/// A GPU in MIG mode lists its processes without their memory; its MIG devices list them with
/// it. Fills in what they say (a process on two MIG devices holds the sum).
fn fill_from_mig_devices(
    dev: &mut dyn DeviceCalls,
    merged: &mut BTreeMap<u32, GpuProcess>,
    warnings: &mut Vec<CallError>,
) -> Vec<MigDeviceSample> {
    let devices = match dev.mig_devices() {
        Ok(list) => list,
        Err(e) if e.code == Some(NOT_SUPPORTED) => return Vec::new(),
        Err(e) => {
            warnings.push(e);
            return Vec::new();
        }
    };
    let mut held: BTreeMap<u32, u64> = BTreeMap::new();
    for p in devices.iter().flat_map(|d| &d.processes) {
        if let Some(b) = p.used_bytes {
            *held.entry(p.pid).or_default() += b;
        }
    }
    for p in merged.values_mut().filter(|p| p.used_bytes.is_none()) {
        p.used_bytes = held.get(&p.pid).copied();
    }
    devices
}

/// `records` when every one is plausible; else the legacy call's records when those are (the
/// 535 drivers' misaligned `_v3` records), else the plausible ones, with the reason recorded.
fn plausible_records(
    dev: &mut dyn DeviceCalls,
    kind: ProcessKind,
    records: Vec<RawProcess>,
    total: Option<u64>,
    driver_version: Option<&str>,
    warnings: &mut Vec<CallError>,
    unreliable: &mut Vec<String>,
) -> Vec<RawProcess> {
    if records.iter().all(|r| plausible(r, total)) {
        records
    } else {
        let bad = records.iter().filter(|r| !plausible(r, total)).count();
        let fallback = list_with_retry(dev, kind, true).ok();
        match fallback {
            Some(legacy) if legacy.iter().all(|r| plausible(r, total)) => {
                warnings.push(CallError {
                    call: list_call(kind, false).into(),
                    code: None,
                    message: format!(
                        "{bad} implausible record(s) (pid 0 or above {PID_MAX_LIMIT}, or \
                         memory above total; driver {}); used {} instead",
                        driver_version.unwrap_or("unknown"),
                        list_call(kind, true)
                    ),
                });
                legacy
            }
            _ => {
                unreliable.push(format!(
                    "{} returned {bad} implausible record(s) and no fallback gave valid \
                     ones (driver {}); implausible records were dropped",
                    list_call(kind, false),
                    driver_version.unwrap_or("unknown")
                ));
                records
                    .into_iter()
                    .filter(|r| plausible(r, total))
                    .collect()
            }
        }
    }
}

/// Per-process utilization. A MIG GPU does not support it; junk samples (pid 0, values in the
/// tens of thousands, stale timestamps) appear when dead contexts linger.
fn read_utilization(
    dev: &mut dyn DeviceCalls,
    processes: &[GpuProcess],
    now_ms: u64,
    since_ms: u64,
    warnings: &mut Vec<CallError>,
) -> Option<UtilizationWindow> {
    let mig_like = processes.iter().any(|p| p.used_bytes.is_none());
    if mig_like {
        return None;
    }
    match dev.utilization(since_ms * 1000) {
        Ok(raw) => Some(aggregate_utilization(&raw, processes, since_ms, now_ms)),
        Err(e) if e.code == Some(NOT_FOUND) => Some(UtilizationWindow {
            since_ms,
            samples: Vec::new(),
        }),
        Err(e) if e.code == Some(NOT_SUPPORTED) => None,
        Err(e) => {
            warnings.push(e);
            None
        }
    }
}

fn aggregate_utilization(
    raw: &[RawUtilization],
    listed: &[GpuProcess],
    since_ms: u64,
    now_ms: u64,
) -> UtilizationWindow {
    let mut by_pid: BTreeMap<u32, UtilizationSample> = BTreeMap::new();
    for s in raw {
        let at_ms = s.timestamp_us / 1000;
        let sane = s.pid > 0
            && s.sm <= 100
            && s.mem <= 100
            && at_ms >= since_ms
            && at_ms <= now_ms + 60_000
            && listed.iter().any(|p| p.pid == s.pid);
        if !sane {
            continue;
        }
        let e = by_pid.entry(s.pid).or_insert(UtilizationSample {
            pid: s.pid,
            sm_percent: 0,
            mem_percent: 0,
            last_seen_ms: 0,
            last_busy_ms: None,
        });
        e.sm_percent = e.sm_percent.max(s.sm);
        e.mem_percent = e.mem_percent.max(s.mem);
        // Timestamps are the driver's; cap them at our clock so that equal inputs compare equal.
        e.last_seen_ms = e.last_seen_ms.max(at_ms.min(now_ms));
        // An idle context reads 1 %: only a sample that counts as work is "busy".
        if s.sm.max(s.mem) >= vramguard_core::policy::DEFAULT_GPU_WORK_MIN_PERCENT {
            e.last_busy_ms = Some(e.last_busy_ms.unwrap_or(0).max(at_ms.min(now_ms)));
        }
    }
    UtilizationWindow {
        since_ms,
        samples: by_pid.into_values().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted device: answers from fields, records the calls it saw.
    #[derive(Default)]
    struct Scripted {
        v3: Vec<RawProcess>,
        v2: Option<Vec<RawProcess>>,
        grow_failures: u32,
        util: Vec<RawUtilization>,
        memory_error: Option<u32>,
        /// What the fan speed call answers: an error code, or a speed when `None`.
        fan_error: Option<u32>,
        calls: Vec<String>,
    }

    fn err(call: &str, code: u32) -> CallError {
        CallError {
            call: call.into(),
            code: Some(code),
            message: crate::codes::message(code).into(),
        }
    }

    impl DeviceCalls for Scripted {
        fn uuid(&mut self) -> Result<String, CallError> {
            Ok("GPU-1".into())
        }
        fn name(&mut self) -> Result<String, CallError> {
            Err(err("nvmlDeviceGetName", 999))
        }
        fn pci_bus_id(&mut self) -> Result<String, CallError> {
            Ok("00000000:19:00.0".into())
        }
        fn minor_number(&mut self) -> Result<u32, CallError> {
            Err(err("nvmlDeviceGetMinorNumber", NOT_SUPPORTED))
        }
        fn memory(&mut self) -> Result<GpuMemory, CallError> {
            match self.memory_error {
                Some(c) => Err(err("nvmlDeviceGetMemoryInfo_v2", c)),
                None => Ok(GpuMemory {
                    total: 100 << 30,
                    reserved: 0,
                    used: 10 << 30,
                    free: 90 << 30,
                }),
            }
        }
        fn persistence_mode(&mut self) -> Result<bool, CallError> {
            Ok(true)
        }
        fn processes(
            &mut self,
            kind: ProcessKind,
            legacy: bool,
        ) -> Result<Vec<RawProcess>, CallError> {
            self.calls.push(list_call(kind, legacy).into());
            if kind != ProcessKind::Compute {
                return Ok(vec![]);
            }
            if self.grow_failures > 0 {
                self.grow_failures -= 1;
                return Err(err(list_call(kind, legacy), INSUFFICIENT_SIZE));
            }
            Ok(if legacy {
                self.v2.clone().unwrap_or_default()
            } else {
                self.v3.clone()
            })
        }
        fn utilization(&mut self, _since_us: u64) -> Result<Vec<RawUtilization>, CallError> {
            Ok(self.util.clone())
        }
        fn remapped_rows(&mut self) -> Result<RemappedRows, CallError> {
            Ok(RemappedRows {
                correctable: 2,
                pending: true,
                ..RemappedRows::default()
            })
        }
        fn retired_pages(&mut self) -> Result<RetiredPages, CallError> {
            Err(err("nvmlDeviceGetRetiredPages", NOT_SUPPORTED))
        }
        fn fan_percent(&mut self) -> Result<u32, CallError> {
            match self.fan_error {
                Some(c) => Err(err("nvmlDeviceGetFanSpeed", c)),
                None => Ok(40),
            }
        }
    }

    fn p(pid: u32, gib: u64) -> RawProcess {
        RawProcess {
            pid,
            used_bytes: Some(gib << 30),
        }
    }

    /// The calls `read` makes on `d`, by name, and what it read.
    fn calls_of(
        d: &mut Scripted,
        read: impl FnOnce(&mut dyn DeviceCalls) -> GpuSample,
    ) -> (Vec<&'static str>, GpuSample) {
        let mut times = crate::timing::CallTimes::default();
        let sample = read(&mut crate::timing::Timed {
            inner: d,
            times: &mut times,
        });
        (times.counts().map(|(c, _)| c).collect(), sample)
    }

    /// A quiet sample of the agent reads only the UUID, the memory and the process lists, and
    /// reads them as a full reading does: what it holds is the full reading's settled part,
    /// with the lists' retries, `_v2` fallbacks and their warnings, and a failed memory read.
    #[test]
    fn a_settled_reading_is_the_settled_part_of_a_full_one_from_a_quarter_of_its_calls() {
        let devices = || {
            [
                Scripted {
                    v3: vec![p(10, 4), p(11, 6)],
                    ..Default::default()
                },
                Scripted {
                    v3: vec![p(10, 4)],
                    grow_failures: 1,
                    ..Default::default()
                },
                // Implausible `_v3` records, plausible `_v2` ones: the fallback and its warning.
                Scripted {
                    v3: vec![p(0, 4), p(PID_MAX_LIMIT + 1, 4)],
                    v2: Some(vec![p(10, 4)]),
                    ..Default::default()
                },
                Scripted {
                    memory_error: Some(crate::codes::GPU_IS_LOST),
                    ..Default::default()
                },
            ]
        };
        for (mut full, mut settled) in devices().into_iter().zip(devices()) {
            let (full_calls, full) =
                calls_of(&mut full, |d| read_gpu(2, d, Some("580.1"), 10_000, 0));
            let (settled_calls, settled) =
                calls_of(&mut settled, |d| read_gpu_settled(2, d, Some("580.1")));
            assert_eq!(settled, full.settled_part(), "{full:#?}");
            assert!(settled.settled_alike(&full));
            for call in &settled_calls {
                assert!(
                    ["nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo_v2"].contains(call)
                        || call.contains("RunningProcesses"),
                    "a settled reading called {call}"
                );
            }
            assert!(
                full.failure.is_some() || settled_calls.len() * 4 <= full_calls.len(),
                "{settled_calls:?} of {full_calls:?}"
            );
        }
    }

    #[test]
    fn the_535_drivers_with_32_byte_v3_records_are_known_by_version() {
        for v in ["535.43.02", "535.54.03", "535.86.10", "535.98"] {
            assert!(driver_has_32_byte_v3_records(v), "{v}");
        }
        for v in [
            "535.42.01",
            "535.104.05",
            "535.154.05",
            "530.30.02",
            "550.54.15",
            "",
            "x",
        ] {
            assert!(!driver_has_32_byte_v3_records(v), "{v}");
        }
    }

    #[test]
    fn plausible_records_pass_and_optional_failures_are_warnings() {
        let mut d = Scripted {
            v3: vec![p(10, 4), p(11, 6)],
            ..Default::default()
        };
        let s = read_gpu(0, &mut d, Some("580.1"), 10_000, 0);
        assert_eq!(s.processes.len(), 2);
        assert_eq!(s.process_list, ProcessListState::Complete);
        assert_eq!(s.name, None);
        assert_eq!(
            s.warnings.len(),
            1,
            "name failed; minor not supported is silent"
        );
        assert!(!d.calls.iter().any(|c| c.ends_with("_v2")));
        assert_eq!(
            s.health.remapped_rows.map(|r| (r.correctable, r.pending)),
            Some((2, true))
        );
        assert_eq!(s.health.retired_pages, None, "not supported is silent");
        assert!(s.health.reset_pending());
    }

    /// A real SXM H200 (driver 580.159.04) answers the fan speed with `INVALID_ARGUMENT`: a
    /// missing reading like `NOT_SUPPORTED`, not a warning (the agent counts warnings as
    /// collection errors). Any other failure of the call is still one.
    #[test]
    fn a_fanless_boards_fan_speed_is_absent_not_a_warning() {
        for (code, warned) in [
            (crate::codes::INVALID_ARGUMENT, false),
            (NOT_SUPPORTED, false),
            (crate::codes::GPU_IS_LOST, true),
        ] {
            let mut d = Scripted {
                fan_error: Some(code),
                ..Default::default()
            };
            let s = read_gpu(0, &mut d, Some("580.159.04"), 10_000, 0);
            assert_eq!(s.telemetry.as_ref().and_then(|t| t.fan_percent), None);
            let fan_warnings = s
                .warnings
                .iter()
                .filter(|w| w.call == "nvmlDeviceGetFanSpeed")
                .count();
            assert_eq!(
                fan_warnings,
                usize::from(warned),
                "code {code}: {:?}",
                s.warnings
            );
        }
        let mut d = Scripted::default();
        let s = read_gpu(0, &mut d, None, 10_000, 0);
        assert_eq!(s.telemetry.and_then(|t| t.fan_percent), Some(40));
    }

    #[test]
    fn swapped_v3_records_fall_back_to_v2() {
        // pid and memory swapped: the pid field holds the low bits of 6 GiB + 1 GiB.
        let swapped = RawProcess {
            pid: (7u64 << 30) as u32,
            used_bytes: Some(10),
        };
        let mut d = Scripted {
            v3: vec![swapped],
            v2: Some(vec![p(10, 7)]),
            ..Default::default()
        };
        let s = read_gpu(0, &mut d, Some("535.54.03"), 10_000, 0);
        assert_eq!(
            s.processes,
            vec![GpuProcess {
                pid: 10,
                kinds: vec![ProcessKind::Compute],
                used_bytes: Some(7 << 30)
            }]
        );
        assert_eq!(s.process_list, ProcessListState::Complete);
        assert!(
            s.warnings
                .iter()
                .any(|w| w.message.contains("535.54.03") && w.message.contains("_v2"))
        );
    }

    #[test]
    fn implausible_records_without_a_valid_fallback_mark_the_list_unreliable() {
        let mut d = Scripted {
            v3: vec![p(0, 1), p(12, 4000)],
            v2: Some(vec![p(0, 1)]),
            ..Default::default()
        };
        let s = read_gpu(0, &mut d, Some("535.54.03"), 10_000, 0);
        assert!(s.processes.is_empty());
        match &s.process_list {
            ProcessListState::Unreliable { reason } => {
                assert!(reason.contains("535.54.03"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_list_that_grows_between_count_and_fill_is_retried() {
        let mut d = Scripted {
            v3: vec![p(10, 1)],
            grow_failures: 2,
            ..Default::default()
        };
        let s = read_gpu(0, &mut d, None, 10_000, 0);
        assert_eq!(s.processes.len(), 1);
        let mut d = Scripted {
            v3: vec![p(10, 1)],
            grow_failures: 5,
            ..Default::default()
        };
        let s = read_gpu(0, &mut d, None, 10_000, 0);
        assert!(matches!(
            s.process_list,
            ProcessListState::Unavailable { .. }
        ));
    }

    #[test]
    fn a_failed_memory_call_marks_the_gpu_failed() {
        let mut d = Scripted {
            memory_error: Some(15),
            ..Default::default()
        };
        let s = read_gpu(3, &mut d, None, 10_000, 0);
        let f = s.failure.unwrap();
        assert_eq!(f.code, Some(15));
        assert_eq!(f.message, "GPU is lost");
        assert_eq!(
            s.uuid.as_deref(),
            Some("GPU-1"),
            "what was read before the failure is kept"
        );
    }

    #[test]
    fn junk_utilization_samples_are_dropped() {
        let util = vec![
            RawUtilization {
                pid: 0,
                timestamp_us: 9_000_000,
                sm: 50,
                mem: 1,
            },
            RawUtilization {
                pid: 10,
                timestamp_us: 9_000_000,
                sm: 31_000,
                mem: 1,
            },
            RawUtilization {
                pid: 10,
                timestamp_us: 9_500_000,
                sm: 40,
                mem: 5,
            },
            RawUtilization {
                pid: 10,
                timestamp_us: 1_000,
                sm: 90,
                mem: 5,
            },
            RawUtilization {
                pid: 99,
                timestamp_us: 9_500_000,
                sm: 40,
                mem: 5,
            },
        ];
        let mut d = Scripted {
            v3: vec![p(10, 1)],
            util,
            ..Default::default()
        };
        let s = read_gpu(0, &mut d, None, 10_000, 5_000);
        let w = s.utilization.unwrap();
        assert_eq!(
            w.samples,
            vec![UtilizationSample {
                pid: 10,
                sm_percent: 40,
                mem_percent: 5,
                last_seen_ms: 9_500,
                last_busy_ms: Some(9_500),
            }]
        );
    }

    /// An idle context reads 1 % on a real H200: seen, but not busy; the last sample at or
    /// above the work threshold is.
    #[test]
    fn a_one_percent_sample_is_seen_but_not_busy() {
        let sample = |timestamp_us, sm| RawUtilization {
            pid: 10,
            timestamp_us,
            sm,
            mem: 0,
        };
        let mut d = Scripted {
            v3: vec![p(10, 1)],
            util: vec![sample(8_000_000, 37), sample(9_000_000, 1)],
            ..Default::default()
        };
        let w = read_gpu(0, &mut d, None, 10_000, 5_000)
            .utilization
            .unwrap();
        assert_eq!(
            (w.samples[0].last_seen_ms, w.samples[0].last_busy_ms),
            (9_000, Some(8_000))
        );
        d.util = vec![sample(9_000_000, 1)];
        let w = read_gpu(0, &mut d, None, 10_000, 5_000)
            .utilization
            .unwrap();
        assert_eq!(w.samples[0].last_busy_ms, None);
    }

    #[test]
    fn the_same_pid_in_two_lists_is_one_holder() {
        struct Both;
        impl DeviceCalls for Both {
            fn uuid(&mut self) -> Result<String, CallError> {
                Ok("GPU-1".into())
            }
            fn name(&mut self) -> Result<String, CallError> {
                Ok("x".into())
            }
            fn pci_bus_id(&mut self) -> Result<String, CallError> {
                Ok("00000000:19:00.0".into())
            }
            fn minor_number(&mut self) -> Result<u32, CallError> {
                Ok(0)
            }
            fn memory(&mut self) -> Result<GpuMemory, CallError> {
                Ok(GpuMemory {
                    total: 100 << 30,
                    reserved: 0,
                    used: 4 << 30,
                    free: 96 << 30,
                })
            }
            fn persistence_mode(&mut self) -> Result<bool, CallError> {
                Ok(false)
            }
            fn processes(
                &mut self,
                kind: ProcessKind,
                _legacy: bool,
            ) -> Result<Vec<RawProcess>, CallError> {
                Ok(match kind {
                    ProcessKind::Mps => vec![],
                    _ => vec![RawProcess {
                        pid: 10,
                        used_bytes: Some(4 << 30),
                    }],
                })
            }
            fn utilization(&mut self, _since_us: u64) -> Result<Vec<RawUtilization>, CallError> {
                Err(err("nvmlDeviceGetProcessUtilization", NOT_FOUND))
            }
            fn remapped_rows(&mut self) -> Result<RemappedRows, CallError> {
                Err(err("nvmlDeviceGetRemappedRows", NOT_SUPPORTED))
            }
            fn retired_pages(&mut self) -> Result<RetiredPages, CallError> {
                Ok(RetiredPages {
                    double_bit_ecc: 1,
                    ..RetiredPages::default()
                })
            }
        }
        let s = read_gpu(0, &mut Both, None, 10_000, 0);
        assert_eq!(s.processes.len(), 1);
        assert_eq!(
            s.processes[0].kinds,
            vec![ProcessKind::Compute, ProcessKind::Graphics]
        );
        assert_eq!(s.processes[0].used_bytes, Some(4 << 30));
        assert_eq!(s.health.remapped_rows, None);
        assert_eq!(s.health.retired_pages.map(|p| p.double_bit_ecc), Some(1));
        assert!(!s.health.reset_pending());
        assert_eq!(
            s.utilization.unwrap().samples,
            vec![],
            "NOT_FOUND means no busy process"
        );
    }
}
