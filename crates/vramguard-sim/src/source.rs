//! The simulation model, in-process (`vramguard --sim STATE`).

use crate::codes::{self, VALUE_NOT_AVAILABLE_U64};
use crate::state::Quirk;
use crate::{AllocationKind, ObservedGpu, Sim, SimError};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;
use vramguard_core::snapshot::GpuSample;
use vramguard_core::snapshot::{
    CallError, DriverFacts, DriverSource, GpuMemory, GpuProcess, MigDeviceSample, ProcessKind,
    RemappedRows, RetiredPages,
};
use vramguard_gpu::read::{
    DeviceCalls, NOT_FOUND, NOT_SUPPORTED, RawProcess, RawUtilization, XidTally, read_gpu,
    read_gpu_settled,
};
use vramguard_gpu::{
    DriverHead, DriverSample, GpuReader, GpuSource, SourceError, init_advice, read_in_turn,
    unreachable_gpu,
};

fn backend(e: SimError) -> SourceError {
    SourceError::Backend(Box::new(e))
}

/// Reads the simulated GPUs directly from the model, answering exactly what the
/// simulator's NVML library would. The model sits behind a lock, released while a call
/// stalls, so that GPUs read on several threads stall one by one as a real driver's do.
#[derive(Debug)]
pub struct SimSource {
    sim: Mutex<Sim>,
    /// Per GPU, how many of its Xid events were already received (the event set registered
    /// at open, as [`vramguard_gpu::NvmlSource`]'s does), or why registering failed, until reported.
    xid_seen: Mutex<Vec<Result<usize, Option<CallError>>>>,
    xids: Mutex<XidTally>,
    /// The stand-in device files this client keeps open from init to shutdown, as a real
    /// NVML client keeps `/dev/nvidiactl`, `/dev/nvidia-uvm` and each GPU's file (seen on an
    /// H200, driver 580.159.04: an unprivileged vramguard showed as a holder of all three),
    /// so that a scan of `/proc` sees this client where it would see the real one.
    _device_files: ClientFiles,
}

/// Opens what a real NVML client opens, when the state models it
/// ([`crate::SimState::nvml_client_files`]): the control device, unified memory and every
/// GPU's file; a file that cannot be opened is left out (the model answers without it).
pub fn open_client_device_files(state: &crate::SimState) -> ClientFiles {
    if !state.nvml_client_files {
        return ClientFiles::default();
    }
    let names = ["nvidiactl".to_string(), "nvidia-uvm".to_string()]
        .into_iter()
        .chain((0..state.gpus.len()).map(|i| format!("nvidia{i}")));
    ClientFiles {
        _files: names
            .filter_map(|name| crate::model::open_device_file(&state.dev_dir.join(name)).ok())
            .collect(),
        // A real client has `libnvidia-ml.so.1` mapped, which tells it from a CUDA process.
        _library: crate::library::map(&state.dev_dir, crate::library::Library::Nvml).ok(),
    }
}

/// What an NVML client keeps from init to shutdown: the device files it opened and its
/// mapping of the NVML library's stand-in.
#[derive(Debug, Default)]
pub struct ClientFiles {
    _files: Vec<std::fs::File>,
    _library: Option<crate::library::Mapped>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Meets the fault of `call` on the model behind `sim`, stalling with the lock released;
/// the code to return, if any.
fn meet_fault(sim: &Mutex<Sim>, call: &str, gpu: Option<u32>) -> Option<u32> {
    let hit = lock(sim).fault_hit(call, gpu)?;
    if let Some(stall) = hit.stall {
        std::thread::sleep(stall);
    }
    hit.code
}

impl SimSource {
    /// Opens the state file, like `nvmlInit_v2` would.
    pub fn open(state: &Path) -> Result<Self, SourceError> {
        let mut sim = Sim::open(state).map_err(backend)?;
        if let Some(code) = sim.fault("nvmlInit_v2", None) {
            let error = fault_error("nvmlInit_v2", code);
            return Err(SourceError::Init {
                advice: init_advice(Some(code)),
                error,
            });
        }
        // nvml-wrapper's init reads the driver version once; count it the same way.
        let _ = sim.fault("nvmlSystemGetDriverVersion", None);
        let seen: Vec<usize> = sim
            .state()
            .gpus
            .iter()
            .map(|g| g.health.xid_events.len())
            .collect();
        // Registering the event sets makes the calls NvmlSource makes at open, counted the
        // same way for fault injection: the count, then a handle and a registration per GPU.
        let xid_seen = match sim.fault("nvmlDeviceGetCount_v2", None) {
            Some(_) => Vec::new(),
            None => seen
                .into_iter()
                .enumerate()
                .map(|(i, n)| {
                    for call in ["nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceRegisterEvents"] {
                        if let Some(code) = sim.fault(call, Some(i as u32)) {
                            return Err(Some(fault_error(call, code)));
                        }
                    }
                    Ok(n)
                })
                .collect(),
        };
        let device_files = open_client_device_files(sim.state());
        Ok(SimSource {
            _device_files: device_files,
            sim: Mutex::new(sim),
            xid_seen: Mutex::new(xid_seen),
            xids: Mutex::new(XidTally::default()),
        })
    }

    /// The model, for resets and tests.
    pub fn sim_mut(&mut self) -> &mut Sim {
        self.sim.get_mut().unwrap_or_else(|e| e.into_inner())
    }
}

fn fault_error(call: &str, code: u32) -> CallError {
    CallError {
        call: call.into(),
        code: Some(code),
        message: codes::message(code).into(),
    }
}

struct SimDevice<'a> {
    sim: &'a Mutex<Sim>,
    index: u32,
}

impl SimDevice<'_> {
    /// Counts the call and answers from a fresh observation of this GPU.
    fn call<T>(
        &mut self,
        call: &str,
        f: impl FnOnce(&ObservedGpu) -> Result<T, u32>,
    ) -> Result<T, CallError> {
        if let Some(code) = meet_fault(self.sim, call, Some(self.index)) {
            return Err(fault_error(call, code));
        }
        let obs = lock(self.sim)
            .observed()
            .map_err(|_| fault_error(call, codes::UNKNOWN))?;
        let gpu = obs
            .gpus
            .get(self.index as usize)
            .ok_or_else(|| fault_error(call, codes::GPU_IS_LOST))?;
        f(gpu).map_err(|code| fault_error(call, code))
    }
}

impl DeviceCalls for SimDevice<'_> {
    fn mig_devices(&mut self) -> Result<Vec<MigDeviceSample>, CallError> {
        self.call("nvmlDeviceGetMigDeviceHandleByIndex", |g| {
            if !g.mig || g.mig_devices.is_empty() {
                return Err(NOT_SUPPORTED);
            }
            Ok(g.mig_devices
                .iter()
                .map(|d| MigDeviceSample {
                    gpu_instance: Some(d.gpu_instance),
                    compute_instance: Some(d.compute_instance),
                    uuid: Some(d.uuid.clone()),
                    name: Some(format!("{} MIG {}", g.name, d.profile)),
                    memory: Some(GpuMemory {
                        total: d.total,
                        reserved: 0,
                        used: d.used,
                        free: d.total.saturating_sub(d.used),
                    }),
                    processes: d
                        .processes
                        .iter()
                        .filter(|p| p.kind == AllocationKind::Compute)
                        .map(|p| GpuProcess {
                            pid: p.pid,
                            kinds: vec![ProcessKind::Compute],
                            used_bytes: p.used_bytes,
                        })
                        .collect(),
                })
                .collect())
        })
    }
    fn v3_writes_32_byte_records(&self) -> bool {
        // The in-process source knows the driver only by its version, as NVML's callers do.
        vramguard_gpu::read::driver_has_32_byte_v3_records(&lock(self.sim).state().driver_version)
    }
    fn uuid(&mut self) -> Result<String, CallError> {
        self.call("nvmlDeviceGetUUID", |g| Ok(g.uuid.clone()))
    }
    fn name(&mut self) -> Result<String, CallError> {
        self.call("nvmlDeviceGetName", |g| Ok(g.name.clone()))
    }
    fn pci_bus_id(&mut self) -> Result<String, CallError> {
        self.call("nvmlDeviceGetPciInfo_v3", |g| Ok(g.pci_bus_id.clone()))
    }
    fn minor_number(&mut self) -> Result<u32, CallError> {
        self.call("nvmlDeviceGetMinorNumber", |g| Ok(g.index))
    }
    fn memory(&mut self) -> Result<GpuMemory, CallError> {
        self.call("nvmlDeviceGetMemoryInfo_v2", |g| {
            Ok(GpuMemory {
                total: g.total,
                reserved: g.reserved,
                used: g.used,
                free: g.free,
            })
        })
    }
    fn persistence_mode(&mut self) -> Result<bool, CallError> {
        self.call("nvmlDeviceGetPersistenceMode", |g| Ok(g.persistence_mode))
    }
    fn utilization_rates(&mut self) -> Result<(u32, u32), CallError> {
        self.call("nvmlDeviceGetUtilizationRates", |g| Ok(g.gpu_utilization()))
    }
    fn temperature(&mut self) -> Result<u32, CallError> {
        self.call("nvmlDeviceGetTemperature", |g| Ok(g.temperature_c()))
    }
    fn power_usage(&mut self) -> Result<u32, CallError> {
        self.call("nvmlDeviceGetPowerUsage", |g| Ok(g.power_draw_mw()))
    }
    fn power_limit(&mut self) -> Result<u32, CallError> {
        self.call(
            "nvmlDeviceGetEnforcedPowerLimit",
            |g| Ok(g.power_limit_mw()),
        )
    }
    fn performance_state(&mut self) -> Result<u32, CallError> {
        // A data-centre GPU with persistence mode stays in P0.
        self.call("nvmlDeviceGetPerformanceState", |_| Ok(0))
    }
    fn ecc_enabled(&mut self) -> Result<bool, CallError> {
        self.call("nvmlDeviceGetEccMode", |_| Ok(true))
    }
    fn ecc_volatile(&mut self) -> Result<(u64, u64), CallError> {
        self.call("nvmlDeviceGetTotalEccErrors", |_| Ok((0, 0)))
    }
    fn fan_percent(&mut self) -> Result<u32, CallError> {
        // An SXM module has no fan of its own, as the library answers.
        self.call("nvmlDeviceGetFanSpeed", |g| Err(g.fan_speed_error()))
    }
    fn compute_mode(&mut self) -> Result<String, CallError> {
        self.call("nvmlDeviceGetComputeMode", |_| Ok("Default".to_string()))
    }
    fn mig_enabled(&mut self) -> Result<bool, CallError> {
        self.call("nvmlDeviceGetMigMode", |g| Ok(g.mig))
    }
    fn display_active(&mut self) -> Result<bool, CallError> {
        self.call("nvmlDeviceGetDisplayActive", |_| Ok(false))
    }
    fn processes(&mut self, kind: ProcessKind, legacy: bool) -> Result<Vec<RawProcess>, CallError> {
        let (call, sim_kind) = match (kind, legacy) {
            (ProcessKind::Compute, false) => (
                "nvmlDeviceGetComputeRunningProcesses_v3",
                AllocationKind::Compute,
            ),
            (ProcessKind::Graphics, false) => (
                "nvmlDeviceGetGraphicsRunningProcesses_v3",
                AllocationKind::Graphics,
            ),
            (ProcessKind::Mps, false) => (
                "nvmlDeviceGetMPSComputeRunningProcesses_v3",
                AllocationKind::Mps,
            ),
            (ProcessKind::Compute, true) => (
                "nvmlDeviceGetComputeRunningProcesses_v2",
                AllocationKind::Compute,
            ),
            (ProcessKind::Graphics, true) => (
                "nvmlDeviceGetGraphicsRunningProcesses_v2",
                AllocationKind::Graphics,
            ),
            (ProcessKind::Mps, true) => (
                "nvmlDeviceGetMPSComputeRunningProcesses_v2",
                AllocationKind::Mps,
            ),
        };
        self.call(call, |g| {
            let records: Vec<(u32, u64)> = g
                .processes
                .iter()
                .filter(|p| p.kind == sim_kind)
                .map(|p| (p.pid, p.used_bytes.unwrap_or(VALUE_NOT_AVAILABLE_U64)))
                .collect();
            // What vramguard's 24-byte records read from that driver's 32-byte ones.
            let records = if !legacy && g.quirks.contains(&Quirk::V3Records32Bytes) {
                crate::quirks::read_as_24_byte_records(
                    &crate::quirks::v3_records_32_bytes(&records),
                    records.len(),
                )
            } else {
                records
            };
            Ok(records
                .into_iter()
                .map(|(pid, raw)| RawProcess {
                    pid,
                    used_bytes: (raw != VALUE_NOT_AVAILABLE_U64).then_some(raw),
                })
                .collect())
        })
    }
    fn remapped_rows(&mut self) -> Result<RemappedRows, CallError> {
        self.call("nvmlDeviceGetRemappedRows", |g| {
            let r = g.health.remapped_rows.ok_or(NOT_SUPPORTED)?;
            Ok(RemappedRows {
                correctable: r.correctable,
                uncorrectable: r.uncorrectable,
                pending: r.pending,
                failure: r.failure,
            })
        })
    }
    fn retired_pages(&mut self) -> Result<RetiredPages, CallError> {
        // As nvml-wrapper asks: a count per cause, then the pending status.
        let mut counts = [0u32; 2];
        for (cause, count) in counts.iter_mut().enumerate() {
            *count = self.call("nvmlDeviceGetRetiredPages", |g| {
                let p = g.health.retired_pages.as_ref().ok_or(NOT_SUPPORTED)?;
                let list = if cause == 0 {
                    &p.single_bit_ecc
                } else {
                    &p.double_bit_ecc
                };
                Ok(list.len() as u32)
            })?;
        }
        let pending = self.call("nvmlDeviceGetRetiredPagesPendingStatus", |g| {
            Ok(g.health
                .retired_pages
                .as_ref()
                .ok_or(NOT_SUPPORTED)?
                .pending)
        })?;
        Ok(RetiredPages {
            single_bit_ecc: counts[0],
            double_bit_ecc: counts[1],
            pending,
        })
    }
    fn utilization(&mut self, since_us: u64) -> Result<Vec<RawUtilization>, CallError> {
        self.call("nvmlDeviceGetProcessUtilization", |g| {
            if g.mig {
                return Err(NOT_SUPPORTED);
            }
            let fresh: Vec<RawUtilization> = g
                .utilization
                .iter()
                .filter(|u| u.timestamp_us > since_us)
                .map(|u| RawUtilization {
                    pid: u.pid,
                    timestamp_us: u.timestamp_us,
                    sm: u.sm_util,
                    mem: u.mem_util,
                })
                .collect();
            if fresh.is_empty() {
                Err(NOT_FOUND)
            } else {
                Ok(fresh)
            }
        })
    }
}

impl GpuReader for SimSource {
    fn head(&self) -> Result<DriverHead, SourceError> {
        // The two versions only: the whole state (every allocation) was cloned here.
        let (driver, nvml) = {
            let sim = lock(&self.sim);
            let state = sim.state();
            (state.driver_version.clone(), state.nvml_version())
        };
        let driver_version = match meet_fault(&self.sim, "nvmlSystemGetDriverVersion", None) {
            None => Some(driver),
            Some(_) => None,
        };
        let nvml_version = match meet_fault(&self.sim, "nvmlSystemGetNVMLVersion", None) {
            None => Some(nvml),
            Some(_) => None,
        };
        if let Some(code) = meet_fault(&self.sim, "nvmlDeviceGetCount_v2", None) {
            return Err(SourceError::Call(fault_error(
                "nvmlDeviceGetCount_v2",
                code,
            )));
        }
        let count = lock(&self.sim).observed().map_err(backend)?.gpus.len() as u32;
        Ok(DriverHead {
            driver: DriverFacts {
                source: DriverSource::Simulated,
                library: None,
                driver_version,
                nvml_version,
            },
            count,
        })
    }

    fn read_gpu(&self, index: u32, head: &DriverHead, now: u64, since: u64) -> GpuSample {
        let version = head.driver.driver_version.as_deref();
        self.read_device(index, |dev| read_gpu(index, dev, version, now, since))
    }

    fn read_gpu_settled(&self, index: u32, head: &DriverHead) -> GpuSample {
        let version = head.driver.driver_version.as_deref();
        self.read_device(index, |dev| read_gpu_settled(index, dev, version))
    }

    fn memory_used(&self, gpu: u32) -> Result<u64, CallError> {
        SimDevice {
            sim: &self.sim,
            index: gpu,
        }
        .memory()
        .map(|m| m.used)
    }

    fn with_device(
        &self,
        index: u32,
        use_device: &mut dyn FnMut(&mut dyn vramguard_gpu::read::DeviceCalls),
    ) -> Result<(), CallError> {
        if let Some(code) = meet_fault(&self.sim, "nvmlDeviceGetHandleByIndex_v2", Some(index)) {
            return Err(fault_error("nvmlDeviceGetHandleByIndex_v2", code));
        }
        use_device(&mut SimDevice {
            sim: &self.sim,
            index,
        });
        Ok(())
    }

    fn begin_sample(&self) {
        // One observation for the whole reading, as one instant of a real driver: fresh at
        // the start, then reused by every call of this sample.
        lock(&self.sim).hold_instant();
    }

    fn end_sample(&self) {
        lock(&self.sim).release_instant();
    }
}

impl GpuSource for SimSource {
    fn memory_used(&mut self, gpu: u32) -> Result<u64, CallError> {
        GpuReader::memory_used(self, gpu)
    }

    fn sample(&mut self, utilization_window: Duration) -> Result<DriverSample, SourceError> {
        read_in_turn(self, utilization_window)
    }

    fn settled(&mut self) -> Result<DriverSample, SourceError> {
        vramguard_gpu::read_settled_in_turn(self)
    }
}

impl SimSource {
    /// GPU `index` read by `read` through its handle, with the Xid events since the last
    /// reading.
    fn read_device(
        &self,
        index: u32,
        read: impl FnOnce(&mut dyn vramguard_gpu::read::DeviceCalls) -> GpuSample,
    ) -> GpuSample {
        if let Some(code) = meet_fault(&self.sim, "nvmlDeviceGetHandleByIndex_v2", Some(index)) {
            return unreachable_gpu(index, fault_error("nvmlDeviceGetHandleByIndex_v2", code));
        }
        let mut sample = read(&mut SimDevice {
            sim: &self.sim,
            index,
        });
        self.receive_xids(index, &mut sample.warnings);
        sample.health.xid_events = lock(&self.xids).counts(index);
        sample
    }

    /// Takes the Xid events raised on `gpu` since the last sample, as `nvmlEventSetWait_v2`
    /// with a zero timeout would deliver them.
    fn receive_xids(&self, gpu: u32, warnings: &mut Vec<CallError>) {
        const CALL: &str = "nvmlEventSetWait_v2";
        let seen = match lock(&self.xid_seen).get_mut(gpu as usize) {
            Some(Ok(seen)) => *seen,
            Some(Err(unreported)) => {
                if let Some(e) = unreported.take()
                    && e.code != Some(NOT_SUPPORTED)
                {
                    warnings.push(e);
                }
                return;
            }
            None => return,
        };
        if let Some(code) = meet_fault(&self.sim, CALL, Some(gpu)) {
            warnings.push(fault_error(CALL, code));
            return;
        }
        let Ok(obs) = lock(&self.sim).observed() else {
            return;
        };
        let Some(g) = obs.gpus.get(gpu as usize) else {
            return;
        };
        let mut xids = lock(&self.xids);
        for &xid in g.health.xid_events.iter().skip(seen) {
            xids.record(gpu, xid);
        }
        lock(&self.xid_seen)[gpu as usize] = Ok(g.health.xid_events.len().max(seen));
    }
}
