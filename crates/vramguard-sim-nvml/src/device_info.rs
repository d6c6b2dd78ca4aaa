//! Device properties and telemetry the monitoring tools read first (nvidia-smi, nvitop,
//! gpustat, NVIDIA's Python bindings): clocks, P-state, ECC and MIG modes, PCIe link,
//! architecture and compute capability, serial and VBIOS, encoder/decoder use, energy.
//! Values are those of the model the GPU is named after (H200, H100, A100, V100); what moves
//! follows the modelled load (busy processes' utilization).

use crate::{INVALID_ARGUMENT, NOT_SUPPORTED, SUCCESS, gpu_utilization, power_draw_mw, with_gpu};
use crate::{ObservedGpu, write_c_string};
use nvml_wrapper_sys::bindings::nvmlDevice_t;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong};

/// Static facts of a GPU model.
pub(crate) struct Model {
    /// `nvmlDeviceArchitecture_t`: 5 Volta, 7 Ampere, 9 Hopper.
    arch: c_uint,
    compute_capability: (c_int, c_int),
    /// Maximum graphics/SM, memory and video clocks, MHz.
    pub(crate) max_clocks: [c_uint; 3],
    /// PCIe generation and width.
    pub(crate) pcie: (c_uint, c_uint),
}

pub(crate) fn model(gpu: &ObservedGpu) -> Model {
    if gpu.name.contains("V100") {
        Model {
            arch: 5,
            compute_capability: (7, 0),
            max_clocks: [1530, 877, 1372],
            pcie: (3, 16),
        }
    } else if gpu.name.contains("A100") {
        Model {
            arch: 7,
            compute_capability: (8, 0),
            max_clocks: [1410, 1593, 1290],
            pcie: (4, 16),
        }
    } else if gpu.name.contains("H100") {
        Model {
            arch: 9,
            compute_capability: (9, 0),
            max_clocks: [1980, 2619, 1755],
            pcie: (5, 16),
        }
    } else {
        Model {
            arch: 9,
            compute_capability: (9, 0),
            max_clocks: [1980, 3201, 1755],
            pcie: (5, 16),
        }
    }
}

/// The clock of `kind` (`nvmlClockType_t`: 0 graphics, 1 SM, 2 memory, 3 video): the maximum
/// for `max`, else the maximum under load and the idle clock otherwise (memory stays fixed).
pub(crate) fn clock(gpu: &ObservedGpu, kind: c_uint, max: bool) -> Option<c_uint> {
    let m = model(gpu).max_clocks;
    let top = match kind {
        0 | 1 => m[0],
        2 => return Some(m[1]),
        3 => m[2],
        _ => return None,
    };
    Some(if max || gpu_utilization(gpu).0 > 0 {
        top
    } else {
        345
    })
}

/// The GPU's temperature, °C: 30 idle, rising with the SM utilization to 75.
pub(crate) fn temperature(gpu: &ObservedGpu) -> c_uint {
    gpu.temperature_c()
}

/// The slowdown threshold of an H100/H200, °C.
pub(crate) fn slowdown_temperature() -> c_uint {
    89
}

/// Writes one value through `out`, or `INVALID_ARGUMENT` for a null pointer.
pub(crate) unsafe fn put<T>(out: *mut T, value: T) -> c_uint {
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    unsafe { *out = value };
    SUCCESS
}

macro_rules! one_value {
    ($(#[$doc:meta])* $name:ident, $ty:ty, |$gpu:ident| $value:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `out` must be writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(device: nvmlDevice_t, out: *mut $ty) -> c_uint {
            with_gpu(stringify!($name), device, |_, $gpu| unsafe { put(out, $value) })
        }
    };
}

one_value!(
    /// P0: a data-centre GPU with persistence mode stays in P0.
    nvmlDeviceGetPerformanceState, c_uint, |_gpu| 0
);
one_value!(
    /// `NVML_COMPUTEMODE_DEFAULT`.
    nvmlDeviceGetComputeMode, c_uint, |_gpu| 0
);
one_value!(
    /// No display is attached to a data-centre GPU.
    nvmlDeviceGetDisplayMode, c_uint, |_gpu| 0
);
one_value!(
    /// No display is active.
    nvmlDeviceGetDisplayActive, c_uint, |_gpu| 0
);
one_value!(
    /// `nvmlDeviceArchitecture_t` of the model.
    nvmlDeviceGetArchitecture, c_uint, |gpu| model(gpu).arch
);
one_value!(
    /// The link generation in use.
    nvmlDeviceGetCurrPcieLinkGeneration, c_uint, |gpu| model(gpu).pcie.0
);
one_value!(
    /// The link width in use.
    nvmlDeviceGetCurrPcieLinkWidth, c_uint, |gpu| model(gpu).pcie.1
);
one_value!(
    /// The highest link generation.
    nvmlDeviceGetMaxPcieLinkGeneration, c_uint, |gpu| model(gpu).pcie.0
);
one_value!(
    /// The widest link.
    nvmlDeviceGetMaxPcieLinkWidth, c_uint, |gpu| model(gpu).pcie.1
);
one_value!(
    /// `nvmlClocksEventReasonGpuIdle` (0x1) while no process is busy, none under load.
    nvmlDeviceGetCurrentClocksEventReasons, c_ulonglong, |gpu| {
        u64::from(gpu_utilization(gpu).0 == 0)
    }
);

/// Fans: the SXM boards modelled here are cooled by the chassis and have none; an H200
/// answers `INVALID_ARGUMENT` as on driver 580.159.04, the others `NOT_SUPPORTED`.
///
/// # Safety
/// `speed` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFanSpeed(device: nvmlDevice_t, speed: *mut c_uint) -> c_uint {
    with_gpu("nvmlDeviceGetFanSpeed", device, |_, gpu| {
        if speed.is_null() {
            INVALID_ARGUMENT
        } else {
            gpu.fan_speed_error()
        }
    })
}

/// The speed of fan `fan`: there is none (`nvmlDeviceGetNumFans` answers 0). vramguard's
/// reader calls this through nvml-wrapper, and a real H200 on driver 580.159.04 answered it
/// with `INVALID_ARGUMENT` (vramguard's snapshots of that machine).
///
/// # Safety
/// `speed` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFanSpeed_v2(
    device: nvmlDevice_t,
    fan: c_uint,
    speed: *mut c_uint,
) -> c_uint {
    let _ = fan;
    with_gpu("nvmlDeviceGetFanSpeed_v2", device, |_, gpu| {
        if speed.is_null() {
            INVALID_ARGUMENT
        } else {
            gpu.fan_speed_error()
        }
    })
}

macro_rules! clock_fn {
    ($name:ident, $max:expr) => {
        /// # Safety
        /// `clock` must be writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            kind: c_uint,
            out: *mut c_uint,
        ) -> c_uint {
            with_gpu(stringify!($name), device, |_, gpu| {
                match clock(gpu, kind, $max) {
                    Some(mhz) => unsafe { put(out, mhz) },
                    None => INVALID_ARGUMENT,
                }
            })
        }
    };
}

clock_fn!(nvmlDeviceGetClockInfo, false);
clock_fn!(nvmlDeviceGetMaxClockInfo, true);

macro_rules! two_values {
    ($(#[$doc:meta])* $name:ident, $ty:ty, |$gpu:ident| $value:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `first` and `second` must be writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            first: *mut $ty,
            second: *mut $ty,
        ) -> c_uint {
            with_gpu(stringify!($name), device, |_, $gpu| {
                if first.is_null() || second.is_null() {
                    return INVALID_ARGUMENT;
                }
                let (a, b) = $value;
                unsafe {
                    *first = a;
                    *second = b;
                }
                SUCCESS
            })
        }
    };
}

two_values!(
    /// ECC on, now and after the next reset.
    nvmlDeviceGetEccMode, c_uint, |_gpu| (1, 1)
);
two_values!(
    /// MIG mode, current and pending.
    nvmlDeviceGetMigMode, c_uint, |gpu| (c_uint::from(gpu.mig), c_uint::from(gpu.mig))
);
two_values!(
    /// The model's CUDA compute capability.
    nvmlDeviceGetCudaComputeCapability, c_int, |gpu| model(gpu).compute_capability
);
two_values!(
    /// NVENC is idle (sampling period 167 ms, as drivers report).
    nvmlDeviceGetEncoderUtilization, c_uint, |_gpu| (0, 167_000)
);
two_values!(
    /// NVDEC is idle.
    nvmlDeviceGetDecoderUtilization, c_uint, |_gpu| (0, 167_000)
);

/// A serial number unique to the GPU's index.
///
/// # Safety
/// `serial` must hold `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: nvmlDevice_t,
    serial: *mut c_char,
    length: c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetSerial", device, |_, gpu| unsafe {
        write_c_string(&serial_of(gpu.index), serial, length)
    })
}

/// The board serial of GPU `index`.
pub(crate) fn serial_of(index: u32) -> String {
    format!("1654923{index:06}")
}

/// # Safety
/// `version` must hold `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetVbiosVersion(
    device: nvmlDevice_t,
    version: *mut c_char,
    length: c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetVbiosVersion", device, |_, _| unsafe {
        write_c_string("96.00.99.00.01", version, length)
    })
}

/// Energy in millijoules since this library was loaded, integrated from the power draw at each
/// call (monotonic, as NVML's counter is).
///
/// # Safety
/// `energy` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEnergyConsumption(
    device: nvmlDevice_t,
    energy: *mut c_ulonglong,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetTotalEnergyConsumption",
        device,
        |_, gpu| unsafe { put(energy, energy_mj(gpu)) },
    )
}

/// Energy used since the library was loaded, in mJ: the modelled draw integrated over the
/// time between queries (any query of it, the call or field 83).
pub(crate) fn energy_mj(gpu: &ObservedGpu) -> u64 {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use std::time::Instant;
    static ENERGY: Mutex<BTreeMap<u32, (Instant, u64)>> = Mutex::new(BTreeMap::new());
    let now = Instant::now();
    let mut all = ENERGY.lock().unwrap_or_else(|e| e.into_inner());
    let (last, mj) = all.entry(gpu.index).or_insert((now, 0));
    let ms = now.duration_since(*last).as_millis() as u64;
    *mj += u64::from(power_draw_mw(gpu)) * ms / 1000;
    *last = now;
    *mj
}

macro_rules! driver_model_fn {
    ($name:ident) => {
        /// The driver model (WDDM/TCC) exists on Windows only: `NOT_SUPPORTED` on Linux.
        ///
        /// # Safety
        /// Nothing is written.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            _current: *mut c_uint,
            _pending: *mut c_uint,
        ) -> c_uint {
            with_gpu(stringify!($name), device, |_, _| NOT_SUPPORTED)
        }
    };
}

driver_model_fn!(nvmlDeviceGetDriverModel);
driver_model_fn!(nvmlDeviceGetDriverModel_v2);

/// ECC error counts: none, corrected (0) or uncorrected (1), volatile (0) or aggregate (1).
///
/// # Safety
/// `count` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: nvmlDevice_t,
    error_type: c_uint,
    counter_type: c_uint,
    count: *mut c_ulonglong,
) -> c_uint {
    with_gpu("nvmlDeviceGetTotalEccErrors", device, |_, _| {
        if error_type > 1 || counter_type > 1 {
            return INVALID_ARGUMENT;
        }
        unsafe { put(count, 0) }
    })
}

/// The name of a process, as the driver knows it: its argv[0] (its `comm` when the command
/// line is empty), or `NOT_FOUND` when no such process exists in the caller's PID namespace
/// (the pid is the caller's, as in the process lists). Monitoring tools ask this when
/// they cannot see the process themselves (another PID namespace, `hidepid`).
///
/// # Safety
/// `name` must hold `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetProcessName(
    pid: c_uint,
    name: *mut c_char,
    length: c_uint,
) -> c_uint {
    crate::with_sim(|sim| {
        // The pid is the caller's: one its PID namespace does not have names nothing.
        let Some(pid) = sim.proc_root_pid(pid) else {
            return crate::NOT_FOUND;
        };
        let Some(proc) = sim.proc() else {
            return crate::NOT_FOUND;
        };
        let argv0 = match proc.cmdline(pid) {
            Ok(vramguard_proc::Found::Yes(args)) => args.into_iter().next().unwrap_or_default(),
            _ => return crate::NOT_FOUND,
        };
        let shown = if argv0.is_empty() {
            proc.text(pid, "comm").unwrap_or_default()
        } else {
            argv0
        };
        unsafe { write_c_string(&shown, name, length) }
    })
}

one_value!(
    /// `NVML_BRAND_NVIDIA` (14): how current drivers brand data-centre GPUs.
    nvmlDeviceGetBrand, c_uint, |_gpu| 14
);

/// The BAR1 aperture: the next power of two at or above the GPU's memory (256 GiB for an
/// H200, 128 GiB for an A100 80 GB, 32 GiB for a V100), 2 MiB used by the driver and 2 MiB
/// more per listed process.
///
/// # Safety
/// `bar1` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBAR1MemoryInfo(
    device: nvmlDevice_t,
    bar1: *mut nvml_wrapper_sys::bindings::nvmlBAR1Memory_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetBAR1MemoryInfo", device, |_, gpu| {
        let total = gpu.total.next_power_of_two();
        let used = (2 + 2 * gpu.processes.len() as u64) << 20;
        unsafe {
            put(
                bar1,
                nvml_wrapper_sys::bindings::nvmlBAR1Memory_t {
                    bar1Total: total,
                    bar1Free: total - used,
                    bar1Used: used,
                },
            )
        }
    })
}

/// PCIe throughput in KB/s over the last 20 ms (`counter` 0: TX, 1: RX): a trickle when
/// idle, rising with the busy processes' share of the GPU.
///
/// # Safety
/// `value` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieThroughput(
    device: nvmlDevice_t,
    counter: c_uint,
    value: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetPcieThroughput", device, |_, gpu| {
        if counter > 1 {
            return INVALID_ARGUMENT;
        }
        let busy = gpu_utilization(gpu).0;
        // TX carries less than RX (results back, inputs in).
        let per_percent = if counter == 0 { 2_000 } else { 5_000 };
        unsafe { put(value, 100 + busy * per_percent) }
    })
}

/// Memory bus width (bits) and CUDA cores of the model.
fn bus_width_and_cores(gpu: &ObservedGpu) -> (c_uint, c_uint) {
    if gpu.name.contains("V100") {
        (4096, 5120)
    } else if gpu.name.contains("A100") {
        (5120, 6912)
    } else if gpu.name.contains("H100") {
        (5120, 16896)
    } else {
        (6144, 16896)
    }
}

/// The clock event reasons NVML can report: idle, applications clocks, power cap, HW
/// slowdown, sync boost, SW thermal, HW thermal, HW power brake, display clocks.
const SUPPORTED_CLOCK_EVENT_REASONS: c_ulonglong = 0x1ff;

one_value!(
    /// The model's memory bus width in bits.
    nvmlDeviceGetMemoryBusWidth, c_uint, |gpu| bus_width_and_cores(gpu).0
);
one_value!(
    /// The model's CUDA cores.
    nvmlDeviceGetNumGpuCores, c_uint, |gpu| bus_width_and_cores(gpu).1
);
one_value!(
    /// PCIe speed per lane in MB/s, from the link generation.
    nvmlDeviceGetPcieSpeed, c_uint, |gpu| match model(gpu).pcie.0 {
        3 => 8000,
        4 => 16000,
        _ => 32000,
    }
);
one_value!(
    /// The default power limit is the enforced one (nobody changed it).
    nvmlDeviceGetPowerManagementDefaultLimit, c_uint, |gpu| crate::power_limit_mw(gpu)
);
one_value!(
    /// P0, as `nvmlDeviceGetPerformanceState`.
    nvmlDeviceGetPowerState, c_uint, |_gpu| 0
);
one_value!(
    /// A board id derived from the index.
    nvmlDeviceGetBoardId, c_uint, |gpu| 0x100 * (gpu.index + 1)
);
one_value!(
    /// One GPU per board.
    nvmlDeviceGetMultiGpuBoard, c_uint, |_gpu| 0
);
one_value!(
    /// `NVML_GPU_VIRTUALIZATION_MODE_NONE`: bare metal.
    nvmlDeviceGetVirtualizationMode, c_uint, |_gpu| 0
);
one_value!(
    /// Accounting is off.
    nvmlDeviceGetAccountingMode, c_uint, |_gpu| 0
);
one_value!(
    /// The driver's accounting buffer holds 4000 processes.
    nvmlDeviceGetAccountingBufferSize, c_uint, |_gpu| 4000
);
one_value!(
    /// No PCIe replays.
    nvmlDeviceGetPcieReplayCounter, c_uint, |_gpu| 0
);
one_value!(
    /// An interrupt line derived from the index.
    nvmlDeviceGetIrqNum, c_uint, |gpu| 100 + gpu.index
);
one_value!(
    /// Half of the GPUs on each of two NUMA nodes.
    nvmlDeviceGetNumaNodeId, c_uint, |gpu| u32::from(gpu.index >= 4)
);
one_value!(
    /// `NVML_BUS_TYPE_PCIE`.
    nvmlDeviceGetBusType, c_uint, |_gpu| 2
);
one_value!(
    /// ECC is on by default.
    nvmlDeviceGetDefaultEccMode, c_uint, |_gpu| 1
);
one_value!(
    /// Chassis-cooled SXM boards have no fans of their own.
    nvmlDeviceGetNumFans, c_uint, |_gpu| 0
);
one_value!(
    /// Every reason this driver reports.
    nvmlDeviceGetSupportedClocksEventReasons, c_ulonglong, |_gpu| SUPPORTED_CLOCK_EVENT_REASONS
);
one_value!(
    /// The old name of [`nvmlDeviceGetSupportedClocksEventReasons`].
    nvmlDeviceGetSupportedClocksThrottleReasons, c_ulonglong, |_gpu| {
        SUPPORTED_CLOCK_EVENT_REASONS
    }
);
one_value!(
    /// The old name of `nvmlDeviceGetCurrentClocksEventReasons`.
    nvmlDeviceGetCurrentClocksThrottleReasons, c_ulonglong, |gpu| {
        u64::from(gpu_utilization(gpu).0 == 0)
    }
);
two_values!(
    /// Power limits the admin may set: 200 W to the board's limit.
    nvmlDeviceGetPowerManagementLimitConstraints, c_uint, |gpu| (200_000, crate::power_limit_mw(gpu))
);
two_values!(
    /// NVJPG is idle (sampling period 167 ms).
    nvmlDeviceGetJpgUtilization, c_uint, |_gpu| (0, 167_000)
);
two_values!(
    /// The optical-flow engine is idle (sampling period 167 ms).
    nvmlDeviceGetOfaUtilization, c_uint, |_gpu| (0, 167_000)
);

macro_rules! string_fn {
    ($(#[$doc:meta])* $name:ident, |$gpu:ident| $value:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `out` must hold `length` bytes.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            out: *mut c_char,
            length: c_uint,
        ) -> c_uint {
            with_gpu(stringify!($name), device, |_, $gpu| unsafe {
                write_c_string(&$value, out, length)
            })
        }
    };
}

string_fn!(
    /// A board part number of the model's form.
    nvmlDeviceGetBoardPartNumber, |gpu| format!("692-2G520-0280-{:03}", gpu.index)
);
string_fn!(
    /// The InfoROM image version.
    nvmlDeviceGetInforomImageVersion, |_gpu| "G520.0280.00.01"
);
