//! NVML through `nvml-wrapper`.

use crate::read::{DeviceCalls, RawProcess, RawUtilization, XidTally, read_gpu, read_gpu_settled};
use crate::{
    DEFAULT_NVML_LIB, DriverHead, DriverSample, GpuReader, GpuSource, SourceError, init_advice,
    read_in_turn,
};
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::RetirementCause;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, EventSet, Nvml};
use std::ffi::OsStr;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;
use vramguard_core::snapshot::{
    CallError, DriverFacts, DriverSource, GpuHealth, GpuMemory, GpuProcess, GpuSample,
    MigDeviceSample, ProcessKind, ProcessListState, RemappedRows, RetiredPages,
};

/// The NVML return code of an error, when it came from the library.
#[allow(deprecated)]
fn nvml_code(e: &NvmlError) -> Option<u32> {
    use NvmlError::*;
    Some(match e {
        Uninitialized => 1,
        InvalidArg => 2,
        NotSupported => 3,
        NoPermission => 4,
        AlreadyInitialized => 5,
        NotFound => 6,
        InsufficientSize(_) => 7,
        InsufficientPower => 8,
        DriverNotLoaded => 9,
        Timeout => 10,
        IrqIssue => 11,
        LibraryNotFound => 12,
        FunctionNotFound => 13,
        CorruptedInfoROM => 14,
        GpuLost => 15,
        ResetRequired => 16,
        OperatingSystem => 17,
        LibRmVersionMismatch => 18,
        InUse => 19,
        InsufficientMemory => 20,
        NoData => 21,
        VgpuEccNotSupported => 22,
        Unknown => 999,
        UnexpectedVariant(code) => *code,
        _ => return None,
    })
}

fn call_error(call: &str, e: &NvmlError) -> CallError {
    let code = nvml_code(e);
    CallError {
        call: call.to_string(),
        code,
        message: match code {
            // NVML's own words, as nvmlErrorString gives them.
            Some(c) => crate::codes::message(c).to_string(),
            None => e.to_string(),
        },
    }
}

/// One Xid event set per GPU, registered at open; where registration failed, the error,
/// until the first sample reports it (once: a GPU whose events cannot be had is not a fresh
/// error at every sample). One set per GPU, because nvml-wrapper frees a set whose
/// registration fails, and one unsupported GPU must not cost the others their events; each
/// behind its own lock, as each GPU is read on its own thread.
type XidSets<'nvml> = Vec<Mutex<Result<EventSet<'nvml>, Option<CallError>>>>;

self_cell::self_cell!(
    /// The library and the event sets that borrow it.
    struct Library {
        owner: Nvml,
        #[not_covariant]
        dependent: XidSets,
    }
);

/// Reads GPUs through an NVML library.
pub struct NvmlSource {
    library: Library,
    lib: String,
    xids: Mutex<XidTally>,
    /// The driver writes 32-byte `_v3` process records (see [`v3_writes_32_byte_records`]).
    v3_32: bool,
}

impl std::fmt::Debug for NvmlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSource")
            .field("lib", &self.lib)
            .finish()
    }
}

/// Registers an event set for critical Xid errors on every GPU.
fn register_xid_sets(nvml: &Nvml) -> XidSets<'_> {
    let count = nvml.device_count().unwrap_or(0);
    (0..count)
        .map(|index| {
            let device = nvml
                .device_by_index(index)
                .map_err(|e| call_error("nvmlDeviceGetHandleByIndex_v2", &e))?;
            let set = nvml
                .create_event_set()
                .map_err(|e| call_error("nvmlEventSetCreate", &e))?;
            device
                .register_events(EventTypes::CRITICAL_XID_ERROR, set)
                .map_err(|e| call_error("nvmlDeviceRegisterEvents", &e.error))
        })
        .map(|r| Mutex::new(r.map_err(Some)))
        .collect()
}

/// The most events taken from one set per sample: a storm of Xids must not stall sampling.
const MAX_EVENTS_PER_SAMPLE: usize = 1024;

impl NvmlSource {
    /// Loads and initialises NVML from `lib` (default `libnvidia-ml.so.1`).
    pub fn open(lib: Option<&Path>) -> Result<Self, SourceError> {
        let lib_name = lib
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| DEFAULT_NVML_LIB.to_string());
        let os: &OsStr = lib
            .map(Path::as_os_str)
            .unwrap_or(OsStr::new(DEFAULT_NVML_LIB));
        let nvml = Nvml::builder().lib_path(os).init().map_err(|e| match e {
            NvmlError::LibloadingError(err) => SourceError::NoDriver {
                lib: lib_name.clone(),
                reason: err.to_string(),
            },
            NvmlError::FailedToLoadSymbol(sym) => SourceError::NoDriver {
                lib: lib_name.clone(),
                reason: format!("it lacks {sym}: not an NVML library"),
            },
            other => {
                let error = call_error("nvmlInit_v2", &other);
                SourceError::Init {
                    advice: init_advice(error.code),
                    error,
                }
            }
        })?;
        let version = nvml.sys_driver_version().unwrap_or_default();
        let v3_32 = v3_writes_32_byte_records(os, &version);
        Ok(NvmlSource {
            library: Library::new(nvml, register_xid_sets),
            lib: lib_name,
            xids: Mutex::new(XidTally::default()),
            v3_32,
        })
    }

    fn nvml(&self) -> &Nvml {
        self.library.borrow_owner()
    }

    /// Takes the Xid events waiting in `gpu`'s set (zero timeout).
    fn receive_xids(&self, gpu: u32, health: &mut GpuHealth, warnings: &mut Vec<CallError>) {
        let mut xids = self.xids.lock().unwrap_or_else(|e| e.into_inner());
        self.library.with_dependent(|_, sets| {
            let Some(slot) = sets.get(gpu as usize) else {
                return;
            };
            let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
            match &mut *slot {
                Ok(set) => {
                    for _ in 0..MAX_EVENTS_PER_SAMPLE {
                        match set.wait(0) {
                            Ok(event) => xids.record(
                                gpu,
                                match event.event_data {
                                    Some(XidError::Value(v)) => v,
                                    Some(XidError::Unknown) | None => 999,
                                },
                            ),
                            Err(NvmlError::Timeout) => break,
                            Err(e) => {
                                warnings.push(call_error("nvmlEventSetWait_v2", &e));
                                break;
                            }
                        }
                    }
                }
                Err(unreported) => {
                    if let Some(e) = unreported.take()
                        && e.code != Some(crate::read::NOT_SUPPORTED)
                    {
                        warnings.push(e);
                    }
                }
            }
        });
        health.xid_events = xids.counts(gpu);
    }
}

/// Whether the library at `lib` (already loaded), of driver `version`, writes 32-byte `_v3`
/// process records: the version is one of the 535.43-535.98 drivers, or the library exports
/// `nvmlDeviceGetConfComputeMemSizeInfo` (added with that struct) but not
/// `nvmlDeviceGetRunningProcessDetailList` (added with the fix), the test nvitop uses.
fn v3_writes_32_byte_records(lib: &OsStr, version: &str) -> bool {
    if crate::read::driver_has_32_byte_v3_records(version) {
        return true;
    }
    // SAFETY: the library is loaded already (NVML initialised from it); opening it again
    // only takes a reference, and only the presence of two symbols is checked.
    let Ok(loaded) = (unsafe { libloading::Library::new(lib) }) else {
        return false;
    };
    // SAFETY: looking a symbol up does not call it.
    let has = |name: &[u8]| unsafe { loaded.get::<*const ()>(name).is_ok() };
    has(b"nvmlDeviceGetConfComputeMemSizeInfo\0")
        && !has(b"nvmlDeviceGetRunningProcessDetailList\0")
}

/// `nvmlDeviceGetMPSComputeRunningProcesses_v2`, which nvml-wrapper loads but does not wrap:
/// the MPS clients of a driver whose `_v3` records are 32 bytes (535.43–535.98) read right,
/// as its compute and graphics lists are (`running_compute_processes_v2`, done the same way).
fn mps_processes_v2(
    device: &Device,
) -> Result<Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>, NvmlError> {
    use nvml_wrapper::error::{nvml_sym, nvml_try, nvml_try_count};
    use nvml_wrapper::struct_wrappers::device::ProcessInfo;
    use nvml_wrapper_sys::bindings::nvmlProcessInfo_v2_t;
    let sym = nvml_sym(
        device
            .nvml()
            .lib()
            .nvmlDeviceGetMPSComputeRunningProcesses_v2
            .as_ref(),
    )?;
    // SAFETY: the handle is the device's own, valid while `device` is; the first call passes
    // no buffer (it only counts), the second a buffer of `count` zeroed records, which the
    // driver fills up to `count` and then sets `count` to what it wrote.
    unsafe {
        let handle = device.handle();
        let mut count: std::ffi::c_uint = 0;
        nvml_try_count(sym(handle, &mut count, std::ptr::null_mut()))?;
        if count == 0 {
            return Ok(Vec::new());
        }
        // Headroom for clients that connect between the two calls (as nvml-wrapper does).
        count += 5;
        let mut records: Vec<nvmlProcessInfo_v2_t> = vec![std::mem::zeroed(); count as usize];
        nvml_try(sym(handle, &mut count, records.as_mut_ptr()))?;
        records.truncate(count as usize);
        Ok(records.into_iter().map(ProcessInfo::from).collect())
    }
}

struct NvmlDevice<'a> {
    device: Device<'a>,
    v3_32: bool,
}

fn to_raw(list: Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>) -> Vec<RawProcess> {
    list.into_iter()
        .map(|p| RawProcess {
            pid: p.pid,
            used_bytes: match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some(b),
                UsedGpuMemory::Unavailable => None,
            },
        })
        .collect()
}

impl DeviceCalls for NvmlDevice<'_> {
    fn v3_writes_32_byte_records(&self) -> bool {
        self.v3_32
    }
    fn mig_devices(&mut self) -> Result<Vec<MigDeviceSample>, CallError> {
        let count = self
            .device
            .mig_device_count()
            .map_err(|e| call_error("nvmlDeviceGetMaxMigDeviceCount", &e))?;
        let mut all = Vec::new();
        for index in 0..count {
            let mig = match self.device.mig_device_by_index(index) {
                Ok(d) => d,
                // Slots without a MIG device.
                Err(NvmlError::NotFound) => continue,
                Err(e) => return Err(call_error("nvmlDeviceGetMigDeviceHandleByIndex", &e)),
            };
            // MIG devices run no graphics; their compute list, the way the driver allows.
            let list = if self.v3_32 {
                mig.running_compute_processes_v2()
                    .map_err(|e| call_error("nvmlDeviceGetComputeRunningProcesses_v2", &e))?
            } else {
                mig.running_compute_processes()
                    .map_err(|e| call_error("nvmlDeviceGetComputeRunningProcesses_v3", &e))?
            };
            let lib = mig.nvml().lib();
            let instance_id = |f: Option<&unsafe extern "C" fn(_, *mut u32) -> u32>| {
                let mut id = 0;
                // SAFETY: the MIG device's own handle, and a valid out pointer.
                f.filter(|f| unsafe { f(mig.handle(), &mut id) } == 0)
                    .map(|_| id)
            };
            all.push(MigDeviceSample {
                gpu_instance: instance_id(lib.nvmlDeviceGetGpuInstanceId.as_ref().ok()),
                compute_instance: instance_id(lib.nvmlDeviceGetComputeInstanceId.as_ref().ok()),
                uuid: mig.uuid().ok(),
                name: mig.name().ok(),
                memory: NvmlDevice {
                    device: mig,
                    v3_32: self.v3_32,
                }
                .memory()
                .ok(),
                processes: to_raw(list)
                    .into_iter()
                    .map(|p| GpuProcess {
                        pid: p.pid,
                        kinds: vec![ProcessKind::Compute],
                        used_bytes: p.used_bytes,
                    })
                    .collect(),
            });
        }
        Ok(all)
    }
    fn uuid(&mut self) -> Result<String, CallError> {
        self.device
            .uuid()
            .map_err(|e| call_error("nvmlDeviceGetUUID", &e))
    }
    fn name(&mut self) -> Result<String, CallError> {
        self.device
            .name()
            .map_err(|e| call_error("nvmlDeviceGetName", &e))
    }
    fn pci_bus_id(&mut self) -> Result<String, CallError> {
        self.device
            .pci_info()
            .map(|p| p.bus_id)
            .map_err(|e| call_error("nvmlDeviceGetPciInfo_v3", &e))
    }
    fn minor_number(&mut self) -> Result<u32, CallError> {
        self.device
            .minor_number()
            .map_err(|e| call_error("nvmlDeviceGetMinorNumber", &e))
    }
    fn memory(&mut self) -> Result<GpuMemory, CallError> {
        self.device
            .memory_info()
            .map(|m| GpuMemory {
                total: m.total,
                reserved: m.reserved,
                used: m.used,
                free: m.free,
            })
            .map_err(|e| call_error("nvmlDeviceGetMemoryInfo_v2", &e))
    }
    fn persistence_mode(&mut self) -> Result<bool, CallError> {
        self.device
            .is_in_persistent_mode()
            .map_err(|e| call_error("nvmlDeviceGetPersistenceMode", &e))
    }
    fn utilization_rates(&mut self) -> Result<(u32, u32), CallError> {
        self.device
            .utilization_rates()
            .map(|u| (u.gpu, u.memory))
            .map_err(|e| call_error("nvmlDeviceGetUtilizationRates", &e))
    }
    fn temperature(&mut self) -> Result<u32, CallError> {
        use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
        self.device
            .temperature(TemperatureSensor::Gpu)
            .map_err(|e| call_error("nvmlDeviceGetTemperature", &e))
    }
    fn power_usage(&mut self) -> Result<u32, CallError> {
        self.device
            .power_usage()
            .map_err(|e| call_error("nvmlDeviceGetPowerUsage", &e))
    }
    fn power_limit(&mut self) -> Result<u32, CallError> {
        self.device
            .enforced_power_limit()
            .map_err(|e| call_error("nvmlDeviceGetEnforcedPowerLimit", &e))
    }
    fn performance_state(&mut self) -> Result<u32, CallError> {
        self.device
            .performance_state()
            .map(|p| p.as_c())
            .map_err(|e| call_error("nvmlDeviceGetPerformanceState", &e))
    }
    fn ecc_enabled(&mut self) -> Result<bool, CallError> {
        self.device
            .is_ecc_enabled()
            .map(|m| m.currently_enabled)
            .map_err(|e| call_error("nvmlDeviceGetEccMode", &e))
    }
    fn fan_percent(&mut self) -> Result<u32, CallError> {
        self.device
            .fan_speed(0)
            .map_err(|e| call_error("nvmlDeviceGetFanSpeed", &e))
    }
    fn compute_mode(&mut self) -> Result<String, CallError> {
        use nvml_wrapper::enum_wrappers::device::ComputeMode;
        self.device
            .compute_mode()
            .map(|m| {
                match m {
                    ComputeMode::Default => "Default",
                    ComputeMode::ExclusiveThread => "Exclusive_Thread",
                    ComputeMode::Prohibited => "Prohibited",
                    ComputeMode::ExclusiveProcess => "Exclusive_Process",
                }
                .to_string()
            })
            .map_err(|e| call_error("nvmlDeviceGetComputeMode", &e))
    }
    fn mig_enabled(&mut self) -> Result<bool, CallError> {
        self.device
            .mig_mode()
            .map(|m| m.current == 1)
            .map_err(|e| call_error("nvmlDeviceGetMigMode", &e))
    }
    fn display_active(&mut self) -> Result<bool, CallError> {
        self.device
            .is_display_active()
            .map_err(|e| call_error("nvmlDeviceGetDisplayActive", &e))
    }
    fn ecc_volatile(&mut self) -> Result<(u64, u64), CallError> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
        let count = |kind| {
            self.device
                .total_ecc_errors(kind, EccCounter::Volatile)
                .map_err(|e| call_error("nvmlDeviceGetTotalEccErrors", &e))
        };
        Ok((
            count(MemoryError::Corrected)?,
            count(MemoryError::Uncorrected)?,
        ))
    }
    fn processes(&mut self, kind: ProcessKind, legacy: bool) -> Result<Vec<RawProcess>, CallError> {
        let (call, result) = match (kind, legacy) {
            (ProcessKind::Compute, false) => (
                "nvmlDeviceGetComputeRunningProcesses_v3",
                self.device.running_compute_processes(),
            ),
            (ProcessKind::Graphics, false) => (
                "nvmlDeviceGetGraphicsRunningProcesses_v3",
                self.device.running_graphics_processes(),
            ),
            (ProcessKind::Mps, false) => (
                "nvmlDeviceGetMPSComputeRunningProcesses_v3",
                self.device.mps_running_compute_processes(),
            ),
            (ProcessKind::Compute, true) => (
                "nvmlDeviceGetComputeRunningProcesses_v2",
                self.device.running_compute_processes_v2(),
            ),
            (ProcessKind::Graphics, true) => (
                "nvmlDeviceGetGraphicsRunningProcesses_v2",
                self.device.running_graphics_processes_v2(),
            ),
            (ProcessKind::Mps, true) => (
                "nvmlDeviceGetMPSComputeRunningProcesses_v2",
                mps_processes_v2(&self.device),
            ),
        };
        result.map(to_raw).map_err(|e| call_error(call, &e))
    }
    fn utilization(&mut self, since_us: u64) -> Result<Vec<RawUtilization>, CallError> {
        self.device
            .process_utilization_stats(since_us)
            .map(|samples| {
                samples
                    .into_iter()
                    .map(|s| RawUtilization {
                        pid: s.pid,
                        timestamp_us: s.timestamp,
                        sm: s.sm_util,
                        mem: s.mem_util,
                    })
                    .collect()
            })
            .map_err(|e| call_error("nvmlDeviceGetProcessUtilization", &e))
    }
    fn remapped_rows(&mut self) -> Result<RemappedRows, CallError> {
        // nvml-wrapper has no wrapper for this call: use the symbol it loaded.
        const CALL: &str = "nvmlDeviceGetRemappedRows";
        let fail = |code: u32| CallError {
            call: CALL.into(),
            code: Some(code),
            message: crate::codes::message(code).into(),
        };
        let sym = match self.device.nvml().lib().nvmlDeviceGetRemappedRows.as_ref() {
            Ok(sym) => sym,
            // An old driver without the call: the feature is not there.
            Err(_) => return Err(fail(crate::read::NOT_SUPPORTED)),
        };
        let (mut correctable, mut uncorrectable, mut pending, mut failure) = (0, 0, 0, 0);
        // SAFETY: the handle is valid while `self.device` lives; the four outputs are
        // plain integers owned by this frame.
        let code = unsafe {
            sym(
                self.device.handle(),
                &mut correctable,
                &mut uncorrectable,
                &mut pending,
                &mut failure,
            )
        };
        if code != 0 {
            return Err(fail(code));
        }
        Ok(RemappedRows {
            correctable,
            uncorrectable,
            pending: pending != 0,
            failure: failure != 0,
        })
    }
    fn retired_pages(&mut self) -> Result<RetiredPages, CallError> {
        let count = |cause| {
            self.device
                .retired_pages(cause)
                .map(|pages| pages.len() as u32)
                .map_err(|e| call_error("nvmlDeviceGetRetiredPages", &e))
        };
        let single_bit_ecc = count(RetirementCause::MultipleSingleBitEccErrors)?;
        let double_bit_ecc = count(RetirementCause::DoubleBitEccError)?;
        let pending = self
            .device
            .are_pages_pending_retired()
            .map_err(|e| call_error("nvmlDeviceGetRetiredPagesPendingStatus", &e))?;
        Ok(RetiredPages {
            single_bit_ecc,
            double_bit_ecc,
            pending,
        })
    }
}

/// A sample for a GPU whose handle could not even be obtained.
pub fn unreachable_gpu(index: u32, error: CallError) -> GpuSample {
    GpuSample {
        process_list: ProcessListState::Unavailable {
            error: error.clone(),
        },
        failure: Some(error),
        ..crate::read::unread(index)
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl NvmlSource {
    /// GPU `index` read by `read` through its handle, with the Xid events since the last
    /// reading.
    fn read_device(
        &self,
        index: u32,
        read: impl FnOnce(&mut dyn DeviceCalls) -> GpuSample,
    ) -> GpuSample {
        let mut sample = match self.nvml().device_by_index(index) {
            Ok(device) => read(&mut NvmlDevice {
                device,
                v3_32: self.v3_32,
            }),
            Err(e) => {
                return unreachable_gpu(index, call_error("nvmlDeviceGetHandleByIndex_v2", &e));
            }
        };
        self.receive_xids(index, &mut sample.health, &mut sample.warnings);
        sample
    }
}

impl GpuReader for NvmlSource {
    fn head(&self) -> Result<DriverHead, SourceError> {
        let driver_version = self.nvml().sys_driver_version().ok();
        let nvml_version = self.nvml().sys_nvml_version().ok();
        let count = self
            .nvml()
            .device_count()
            .map_err(|e| SourceError::Call(call_error("nvmlDeviceGetCount_v2", &e)))?;
        Ok(DriverHead {
            driver: DriverFacts {
                source: DriverSource::Nvml,
                library: Some(self.lib.clone()),
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

    fn with_device(
        &self,
        index: u32,
        use_device: &mut dyn FnMut(&mut dyn DeviceCalls),
    ) -> Result<(), CallError> {
        let device = self
            .nvml()
            .device_by_index(index)
            .map_err(|e| call_error("nvmlDeviceGetHandleByIndex_v2", &e))?;
        use_device(&mut NvmlDevice {
            device,
            v3_32: self.v3_32,
        });
        Ok(())
    }

    fn memory_used(&self, gpu: u32) -> Result<u64, CallError> {
        let device = self
            .nvml()
            .device_by_index(gpu)
            .map_err(|e| call_error("nvmlDeviceGetHandleByIndex_v2", &e))?;
        NvmlDevice {
            device,
            v3_32: self.v3_32,
        }
        .memory()
        .map(|m| m.used)
    }
}

impl GpuSource for NvmlSource {
    fn memory_used(&mut self, gpu: u32) -> Result<u64, CallError> {
        GpuReader::memory_used(self, gpu)
    }

    fn sample(&mut self, utilization_window: Duration) -> Result<DriverSample, SourceError> {
        read_in_turn(self, utilization_window)
    }

    fn settled(&mut self) -> Result<DriverSample, SourceError> {
        crate::read_settled_in_turn(self)
    }
}
