//! The rest of the device queries NVIDIA's Python bindings offer that an H100/H200 answers on
//! a 580 driver: application and boost clocks, supported clocks and P-states, thermal
//! thresholds and margin, NVLink (18 links to NVSwitches on an HGX board), topology, CPU and
//! memory affinity, P2P, fabric state, samples and field values, encoder/FBC session counts,
//! InfoROM and GSP firmware. Values are the model's (see `device_info.rs`), moving with the
//! modelled load where a real GPU's would.

use crate::device_info::{clock, model, put, slowdown_temperature, temperature};
use crate::{
    ARGUMENT_VERSION_MISMATCH, INSUFFICIENT_SIZE, INVALID_ARGUMENT, NOT_FOUND, NOT_SUPPORTED,
    ObservedGpu, SUCCESS, decode_handle, gpu_utilization, handle_of, power_draw_mw, with_gpu,
    with_gpu_counted, with_sim, write_c_string,
};
use nvml_wrapper_sys::bindings::*;
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_ulonglong};

/// `NVML_STRUCT_VERSION(name, n)`: the struct's size with the version in the top byte.
pub(crate) const fn struct_version<T>(n: u32) -> u32 {
    (std::mem::size_of::<T>() as u32) | (n << 24)
}

/// Checks a versioned struct's `version` field as NVML does before filling it.
unsafe fn version_matches<T>(out: *const T, version_field: *const c_uint, n: u32) -> c_uint {
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    if unsafe { *version_field } != struct_version::<T>(n) {
        return ARGUMENT_VERSION_MISMATCH;
    }
    SUCCESS
}

/// NVLink links of an SXM board (NVLink 4, 18 links to the NVSwitches); none on PCIe or V100
/// cards in this model.
fn nvlinks(gpu: &ObservedGpu) -> c_uint {
    if gpu.name.contains("PCIe") || gpu.name.contains("V100") {
        0
    } else {
        18
    }
}

/// The GPU's NUMA node: GPUs 0–3 on the first socket, 4–7 on the second (an HGX board).
fn numa_node(gpu_index: u32) -> u32 {
    u32::from(gpu_index >= 4)
}

/// Microseconds since the Unix epoch, NVML's timestamp unit.
fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Supported graphics clocks of the model, highest first, in NVML's 15 MHz steps down to
/// 210 MHz (what `nvidia-smi -q -d SUPPORTED_CLOCKS` lists for one memory clock).
fn supported_graphics_clocks(gpu: &ObservedGpu) -> Vec<c_uint> {
    (0..)
        .map(|i| model(gpu).max_clocks[0] - 15 * i)
        .take_while(|&c| c >= 210)
        .collect()
}

/// What a count-then-fill query answers to its first half (no array): NVML differs by
/// function, and clients check for exactly one of the two.
#[derive(Clone, Copy)]
enum CountQuery {
    /// `SUCCESS` with the count (sessions, samples, topology sets).
    Succeeds,
    /// `INSUFFICIENT_SIZE` with the count, when there is anything to fill (supported clocks).
    InsufficientSize,
}

/// Writes `values` into a caller array of `*count` entries, count-then-fill: the needed
/// count always; `INSUFFICIENT_SIZE` when a given array is short.
unsafe fn fill_array<T: Copy>(
    values: &[T],
    count: *mut c_uint,
    out: *mut T,
    no_array: CountQuery,
) -> c_uint {
    if count.is_null() {
        return INVALID_ARGUMENT;
    }
    let capacity = unsafe { *count } as usize;
    unsafe { *count = values.len() as c_uint };
    if values.is_empty() {
        return SUCCESS;
    }
    if out.is_null() {
        return match no_array {
            CountQuery::Succeeds => SUCCESS,
            CountQuery::InsufficientSize => INSUFFICIENT_SIZE,
        };
    }
    if capacity < values.len() {
        return INSUFFICIENT_SIZE;
    }
    for (i, v) in values.iter().enumerate() {
        unsafe { *out.add(i) = *v };
    }
    SUCCESS
}

/// The clock of `kind` a setting names: applications clocks and the customer boost clock
/// are the model's maxima on a data-centre GPU (nothing lowered them).
fn setting_clock(gpu: &ObservedGpu, kind: c_uint) -> Option<c_uint> {
    clock(gpu, kind, true)
}

macro_rules! clock_setting_fn {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `mhz` must be writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            clock_type: nvmlClockType_t,
            mhz: *mut c_uint,
        ) -> c_uint {
            with_gpu(stringify!($name), device, |_, gpu| match setting_clock(gpu, clock_type) {
                Some(v) => unsafe { put(mhz, v) },
                None => INVALID_ARGUMENT,
            })
        }
    };
}

clock_setting_fn!(
    /// The applications clock: the maximum, as nobody lowered it.
    nvmlDeviceGetApplicationsClock
);
clock_setting_fn!(
    /// The default applications clock: the maximum.
    nvmlDeviceGetDefaultApplicationsClock
);
clock_setting_fn!(
    /// The customer boost clock: the maximum.
    nvmlDeviceGetMaxCustomerBoostClock
);

/// A clock by id: `NVML_CLOCK_ID_CURRENT` (0) moves with the load, the application target,
/// default and customer boost (1–3) are the maximum.
///
/// # Safety
/// `mhz` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClock(
    device: nvmlDevice_t,
    clock_type: nvmlClockType_t,
    clock_id: nvmlClockId_t,
    mhz: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetClock", device, |_, gpu| {
        let value = match clock_id {
            0 => clock(gpu, clock_type, false),
            1..=3 => setting_clock(gpu, clock_type),
            _ => None,
        };
        match value {
            Some(v) => unsafe { put(mhz, v) },
            None => INVALID_ARGUMENT,
        }
    })
}

/// The one memory clock an HBM GPU runs at.
///
/// # Safety
/// `count` must be writable; `clocks` holds `*count` entries or is null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedMemoryClocks(
    device: nvmlDevice_t,
    count: *mut c_uint,
    clocks: *mut c_uint,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetSupportedMemoryClocks",
        device,
        |_, gpu| unsafe {
            fill_array(
                &[model(gpu).max_clocks[1]],
                count,
                clocks,
                CountQuery::InsufficientSize,
            )
        },
    )
}

/// The graphics clocks supported at `memory_mhz`; `NOT_FOUND` for a memory clock the GPU
/// does not support, as NVML.
///
/// # Safety
/// `count` must be writable; `clocks` holds `*count` entries or is null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedGraphicsClocks(
    device: nvmlDevice_t,
    memory_mhz: c_uint,
    count: *mut c_uint,
    clocks: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetSupportedGraphicsClocks", device, |_, gpu| {
        if memory_mhz != model(gpu).max_clocks[1] {
            return NOT_FOUND;
        }
        unsafe {
            fill_array(
                &supported_graphics_clocks(gpu),
                count,
                clocks,
                CountQuery::InsufficientSize,
            )
        }
    })
}

/// P0 only; the rest of the array is `NVML_PSTATE_UNKNOWN` (32), as NVML fills it.
///
/// # Safety
/// `pstates` holds `size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedPerformanceStates(
    device: nvmlDevice_t,
    pstates: *mut nvmlPstates_t,
    size: c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetSupportedPerformanceStates", device, |_, _| {
        let entries = size as usize / std::mem::size_of::<nvmlPstates_t>();
        if pstates.is_null() || entries == 0 {
            return INVALID_ARGUMENT;
        }
        for i in 0..entries {
            unsafe { *pstates.add(i) = if i == 0 { 0 } else { 32 } };
        }
        SUCCESS
    })
}

/// The clock range of a P-state: P0 spans the idle to the maximum clock; other P-states are
/// not used by a data-centre GPU (`NOT_SUPPORTED`).
///
/// # Safety
/// `min` and `max` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinMaxClockOfPState(
    device: nvmlDevice_t,
    clock_type: nvmlClockType_t,
    pstate: nvmlPstates_t,
    min: *mut c_uint,
    max: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetMinMaxClockOfPState", device, |_, gpu| {
        if min.is_null() || max.is_null() {
            return INVALID_ARGUMENT;
        }
        if pstate != 0 {
            return NOT_SUPPORTED;
        }
        let Some(top) = clock(gpu, clock_type, true) else {
            return INVALID_ARGUMENT;
        };
        let bottom = if clock_type == 2 { top } else { 345.min(top) };
        unsafe {
            *min = bottom;
            *max = top;
        }
        SUCCESS
    })
}

/// Adaptive clocking is on (`NVML_ADAPTIVE_CLOCKING_INFO_STATUS_ENABLED`).
///
/// # Safety
/// `status` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAdaptiveClockInfoStatus(
    device: nvmlDevice_t,
    status: *mut c_uint,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetAdaptiveClockInfoStatus",
        device,
        |_, _| unsafe { put(status, 1) },
    )
}

/// Setting applications clocks is restricted to root (`NVML_FEATURE_ENABLED`); auto boost,
/// which the GPU lacks, answers `NOT_SUPPORTED`.
///
/// # Safety
/// `restricted` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAPIRestriction(
    device: nvmlDevice_t,
    api: nvmlRestrictedAPI_t,
    restricted: *mut nvmlEnableState_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetAPIRestriction", device, |_, _| match api {
        0 => unsafe { put(restricted, 1) },
        1 => NOT_SUPPORTED,
        _ => INVALID_ARGUMENT,
    })
}

/// Power management is on, as on every data-centre GPU.
///
/// # Safety
/// `mode` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerManagementMode(
    device: nvmlDevice_t,
    mode: *mut nvmlEnableState_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetPowerManagementMode", device, |_, _| unsafe {
        put(mode, 1)
    })
}

/// Thresholds as `nvidia-smi -q -d TEMPERATURE` shows them on an H100/H200: shutdown 92 °C,
/// slowdown 89 °C, memory maximum 95 °C, GPU maximum operating 87 °C; the acoustic and GPS
/// thresholds are for other products (`NOT_SUPPORTED`).
///
/// # Safety
/// `temp` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperatureThreshold(
    device: nvmlDevice_t,
    threshold: nvmlTemperatureThresholds_t,
    temp: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetTemperatureThreshold", device, |_, _| {
        let value = match threshold {
            0 => 92,
            1 => slowdown_temperature(),
            2 => 95,
            3 => 87,
            4..=7 => return NOT_SUPPORTED,
            _ => return INVALID_ARGUMENT,
        };
        unsafe { put(temp, value) }
    })
}

/// Degrees below the slowdown threshold (`nvmlMarginTemperature_v1`).
///
/// # Safety
/// `margin` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMarginTemperature(
    device: nvmlDevice_t,
    margin: *mut nvmlMarginTemperature_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetMarginTemperature", device, |_, gpu| unsafe {
        let checked = version_matches(margin, margin.cast::<c_uint>(), 1);
        if checked != SUCCESS {
            return checked;
        }
        (*margin).marginTemperature = slowdown_temperature() as c_int - temperature(gpu) as c_int;
        SUCCESS
    })
}

/// One sensor, the GPU's own (`NVML_THERMAL_CONTROLLER_GPU_INTERNAL`, target GPU), with its
/// current temperature and the slowdown threshold as the default maximum.
///
/// # Safety
/// `settings` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetThermalSettings(
    device: nvmlDevice_t,
    sensor_index: c_uint,
    settings: *mut nvmlGpuThermalSettings_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetThermalSettings", device, |_, gpu| {
        // NVML_THERMAL_TARGET_ALL (15) or the first sensor.
        if settings.is_null() || (sensor_index != 0 && sensor_index != 15) {
            return INVALID_ARGUMENT;
        }
        let mut value: nvmlGpuThermalSettings_t = unsafe { std::mem::zeroed() };
        value.count = 1;
        value.sensor[0].controller = 1;
        value.sensor[0].defaultMinTemp = 0;
        value.sensor[0].defaultMaxTemp = slowdown_temperature() as c_int;
        value.sensor[0].currentTemp = temperature(gpu) as c_int;
        value.sensor[0].target = 1;
        unsafe { *settings = value };
        SUCCESS
    })
}

/// Time spent throttled by a performance policy: none.
///
/// # Safety
/// `time` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetViolationStatus(
    device: nvmlDevice_t,
    policy: nvmlPerfPolicyType_t,
    time: *mut nvmlViolationTime_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetViolationStatus", device, |_, _| {
        if policy > 11 {
            return INVALID_ARGUMENT;
        }
        unsafe {
            put(
                time,
                nvmlViolationTime_t {
                    referenceTime: now_us(),
                    violationTime: 0,
                },
            )
        }
    })
}

/// Clock monitors report no fault.
///
/// # Safety
/// `status` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetClkMonStatus(
    device: nvmlDevice_t,
    status: *mut nvmlClkMonStatus_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetClkMonStatus", device, |_, _| unsafe {
        put(status, std::mem::zeroed())
    })
}

/// Utilization of the GPU's P-state domains: graphics and frame buffer, from the load.
///
/// # Safety
/// `info` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDynamicPstatesInfo(
    device: nvmlDevice_t,
    info: *mut nvmlGpuDynamicPstatesInfo_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetDynamicPstatesInfo", device, |_, gpu| {
        let mut value: nvmlGpuDynamicPstatesInfo_t = unsafe { std::mem::zeroed() };
        let (sm, memory) = gpu_utilization(gpu);
        for (slot, percent) in value.utilization.iter_mut().zip([sm, memory, 0, 0]) {
            slot.bIsPresent = 1;
            slot.percentage = percent;
            slot.incThreshold = 30;
            slot.decThreshold = 10;
        }
        unsafe { put(info, value) }
    })
}

macro_rules! clock_text_fn {
    ($(#[$doc:meta])* $name:ident, $ty:ty, |$gpu:ident| $text:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// `out` must be writable with its version set.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(device: nvmlDevice_t, out: *mut $ty) -> c_uint {
            with_gpu(stringify!($name), device, |_, $gpu| unsafe {
                let checked = version_matches(out, out.cast::<c_uint>(), 1);
                if checked != SUCCESS {
                    return checked;
                }
                let text: String = $text;
                let dst = &mut (*out).str_;
                let n = text.len().min(dst.len() - 1);
                for (d, s) in dst.iter_mut().zip(text.bytes().take(n)) {
                    *d = s as c_char;
                }
                dst[n] = 0;
                SUCCESS
            })
        }
    };
}

clock_text_fn!(
    /// The clocks in use, in the driver's text form.
    nvmlDeviceGetCurrentClockFreqs, nvmlDeviceCurrentClockFreqs_t, |gpu| format!(
        "FORCE_PSTATE: 0, FIXED: 0, GPCCLK: {}, MEMCLK: {}, VIDCLK: {}",
        clock(gpu, 0, false).unwrap_or(0),
        clock(gpu, 2, false).unwrap_or(0),
        clock(gpu, 3, false).unwrap_or(0)
    )
);
clock_text_fn!(
    /// The performance modes, in the driver's text form.
    nvmlDeviceGetPerformanceModes, nvmlDevicePerfModes_t, |gpu| format!(
        "perf=0, nvclock=345, nvclockmin=345, nvclockmax={}, memclock={m}, memclockmin={m}, \
         memclockmax={m}",
        model(gpu).max_clocks[0],
        m = model(gpu).max_clocks[1]
    )
);

/// The addressing mode: HMM, as on an x86 host with the open kernel modules
/// (`NVML_DEVICE_ADDRESSING_MODE_HMM`).
///
/// # Safety
/// `mode` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAddressingMode(
    device: nvmlDevice_t,
    mode: *mut nvmlDeviceAddressingMode_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetAddressingMode", device, |_, _| unsafe {
        let checked = version_matches(mode, mode.cast::<c_uint>(), 1);
        if checked != SUCCESS {
            return checked;
        }
        (*mode).value = 1;
        SUCCESS
    })
}

/// Device capabilities: none of the listed ones (extended GPU memory is Grace-only).
///
/// # Safety
/// `caps` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCapabilities(
    device: nvmlDevice_t,
    caps: *mut nvmlDeviceCapabilities_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetCapabilities", device, |_, _| unsafe {
        let checked = version_matches(caps, caps.cast::<c_uint>(), 1);
        if checked != SUCCESS {
            return checked;
        }
        (*caps).capMask = 0;
        SUCCESS
    })
}

/// The module id on the HGX board: 1–8.
///
/// # Safety
/// `id` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetModuleId(device: nvmlDevice_t, id: *mut c_uint) -> c_uint {
    with_gpu("nvmlDeviceGetModuleId", device, |_, gpu| unsafe {
        put(id, gpu.index + 1)
    })
}

/// The highest PCIe generation the GPU itself supports.
///
/// # Safety
/// `generation` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuMaxPcieLinkGeneration(
    device: nvmlDevice_t,
    generation: *mut c_uint,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetGpuMaxPcieLinkGeneration",
        device,
        |_, gpu| unsafe { put(generation, model(gpu).pcie.0) },
    )
}

/// `NVML_PCIE_LINK_MAX_SPEED_*` of the link's generation (3 → 8000 MBPS … 5 → 32000 MBPS).
///
/// # Safety
/// `speed` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieLinkMaxSpeed(
    device: nvmlDevice_t,
    speed: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetPcieLinkMaxSpeed", device, |_, gpu| unsafe {
        put(speed, model(gpu).pcie.0)
    })
}

/// The extended PCI information: the bus id of the state, device id 0x2335 (H200) or
/// 0x2330 (H100), class 3D controller (0x03/0x02).
///
/// # Safety
/// `pci` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfoExt(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfoExt_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetPciInfoExt", device, |_, gpu| unsafe {
        let checked = version_matches(pci, pci.cast::<c_uint>(), 1);
        if checked != SUCCESS {
            return checked;
        }
        let Some((domain, bus, dev)) = parse_bus_id(&gpu.pci_bus_id) else {
            return crate::UNKNOWN;
        };
        let p = &mut *pci;
        p.domain = domain;
        p.bus = bus;
        p.device = dev;
        p.pciDeviceId = (if gpu.name.contains("H100") {
            0x2330
        } else {
            0x2335
        } << 16)
            | 0x10de;
        p.pciSubSystemId = 0x16c1_10de;
        p.baseClass = 0x03;
        p.subClass = 0x02;
        crate::copy_into(&mut p.busId, &gpu.pci_bus_id);
        SUCCESS
    })
}

/// (domain, bus, device) of a bus id `DDDDDDDD:BB:DD.F`.
fn parse_bus_id(id: &str) -> Option<(c_uint, c_uint, c_uint)> {
    let mut parts = id.split([':', '.']);
    let domain = u32::from_str_radix(parts.next()?, 16).ok()?;
    let bus = u32::from_str_radix(parts.next()?, 16).ok()?;
    let dev = u32::from_str_radix(parts.next()?, 16).ok()?;
    Some((domain, bus, dev))
}

/// Encoder sessions: none run (the counters exist, as `nvidia-smi -q` shows 0 sessions).
///
/// # Safety
/// The outputs must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEncoderStats(
    device: nvmlDevice_t,
    sessions: *mut c_uint,
    average_fps: *mut c_uint,
    average_latency: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetEncoderStats", device, |_, _| unsafe {
        if sessions.is_null() || average_fps.is_null() || average_latency.is_null() {
            return INVALID_ARGUMENT;
        }
        *sessions = 0;
        *average_fps = 0;
        *average_latency = 0;
        SUCCESS
    })
}

/// No encoder session: count 0.
///
/// # Safety
/// `count` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEncoderSessions(
    device: nvmlDevice_t,
    count: *mut c_uint,
    sessions: *mut nvmlEncoderSessionInfo_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetEncoderSessions", device, |_, _| unsafe {
        fill_array(&[], count, sessions, CountQuery::Succeeds)
    })
}

/// Frame-buffer capture: no session.
///
/// # Safety
/// `stats` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFBCStats(
    device: nvmlDevice_t,
    stats: *mut nvmlFBCStats_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetFBCStats", device, |_, _| unsafe {
        put(
            stats,
            nvmlFBCStats_t {
                sessionsCount: 0,
                averageFPS: 0,
                averageLatency: 0,
            },
        )
    })
}

/// No frame-buffer capture session: count 0.
///
/// # Safety
/// `count` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFBCSessions(
    device: nvmlDevice_t,
    count: *mut c_uint,
    sessions: *mut nvmlFBCSessionInfo_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetFBCSessions", device, |_, _| unsafe {
        fill_array(&[], count, sessions, CountQuery::Succeeds)
    })
}

/// The InfoROM's versions by object: OEM 2.1, ECC 7.16; the power object is absent on
/// H100/H200 (`nvidia-smi -q` shows N/A: `NOT_SUPPORTED`).
///
/// # Safety
/// `version` holds `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetInforomVersion(
    device: nvmlDevice_t,
    object: nvmlInforomObject_t,
    version: *mut c_char,
    length: c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetInforomVersion", device, |_, _| match object {
        0 => unsafe { write_c_string("2.1", version, length) },
        1 => unsafe { write_c_string("7.16", version, length) },
        2 => NOT_SUPPORTED,
        _ => INVALID_ARGUMENT,
    })
}

/// The InfoROM configuration checksum.
///
/// # Safety
/// `checksum` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetInforomConfigurationChecksum(
    device: nvmlDevice_t,
    checksum: *mut c_uint,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetInforomConfigurationChecksum",
        device,
        |_, gpu| unsafe { put(checksum, 0x4b1e_7c00 | gpu.index) },
    )
}

/// The GSP firmware runs the GPU, by default (every 580 driver on Hopper): (1, 1).
///
/// # Safety
/// Both outputs must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGspFirmwareMode(
    device: nvmlDevice_t,
    enabled: *mut c_uint,
    default_mode: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetGspFirmwareMode", device, |_, _| unsafe {
        if enabled.is_null() || default_mode.is_null() {
            return INVALID_ARGUMENT;
        }
        *enabled = 1;
        *default_mode = 1;
        SUCCESS
    })
}

/// The GSP firmware's version: the driver's (`NVML_GSP_FIRMWARE_VERSION_BUF_SIZE`, 64 bytes).
///
/// # Safety
/// `version` holds 64 bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGspFirmwareVersion(
    device: nvmlDevice_t,
    version: *mut c_char,
) -> c_uint {
    with_gpu("nvmlDeviceGetGspFirmwareVersion", device, |sim, _| {
        let driver = sim.state().driver_version.clone();
        unsafe { write_c_string(&driver, version, 64) }
    })
}

/// No memory error of any kind or location (the sim models remapped rows and Xid events).
///
/// # Safety
/// `count` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryErrorCounter(
    device: nvmlDevice_t,
    error_type: nvmlMemoryErrorType_t,
    counter_type: nvmlEccCounterType_t,
    location: nvmlMemoryLocation_t,
    count: *mut c_ulonglong,
) -> c_uint {
    with_gpu("nvmlDeviceGetMemoryErrorCounter", device, |_, _| {
        if error_type > 1 || counter_type > 1 || location > 7 {
            return INVALID_ARGUMENT;
        }
        unsafe { put(count, 0) }
    })
}

/// The deprecated fixed-location ECC counts: zeros.
///
/// # Safety
/// `counts` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDetailedEccErrors(
    device: nvmlDevice_t,
    error_type: nvmlMemoryErrorType_t,
    counter_type: nvmlEccCounterType_t,
    counts: *mut nvmlEccErrorCounts_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetDetailedEccErrors", device, |_, _| {
        if error_type > 1 || counter_type > 1 {
            return INVALID_ARGUMENT;
        }
        unsafe { put(counts, std::mem::zeroed()) }
    })
}

/// Spare rows left for remapping per bank, as `nvidia-smi -q` shows "Remapping availability"
/// of a healthy H100: every bank at the maximum.
///
/// # Safety
/// `values` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRowRemapperHistogram(
    device: nvmlDevice_t,
    values: *mut nvmlRowRemapperHistogramValues_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetRowRemapperHistogram", device, |_, _| unsafe {
        put(
            values,
            nvmlRowRemapperHistogramValues_t {
                max: 2560,
                high: 0,
                partial: 0,
                low: 0,
                none: 0,
            },
        )
    })
}

/// Attributes of a MIG device (its slices, SMs and memory); `NOT_SUPPORTED` on a whole GPU,
/// as NVML.
///
/// # Safety
/// `attributes` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetAttributes_v2(
    device: nvmlDevice_t,
    attributes: *mut nvmlDeviceAttributes_t,
) -> c_uint {
    let is_mig = decode_handle(device).1.is_some();
    with_gpu("nvmlDeviceGetAttributes_v2", device, |_, gpu| {
        if !is_mig {
            return NOT_SUPPORTED;
        }
        // A profile name starts with its slice count: "1g.18gb", "3g.71gb", "7g.141gb".
        let slices: c_uint = gpu
            .name
            .rsplit(' ')
            .next()
            .and_then(|p| p.split('g').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(1);
        unsafe {
            put(
                attributes,
                nvmlDeviceAttributes_t {
                    multiprocessorCount: 16 * slices,
                    sharedCopyEngineCount: slices,
                    sharedDecoderCount: slices,
                    sharedEncoderCount: 0,
                    sharedJpegCount: slices,
                    sharedOfaCount: u32::from(slices == 7),
                    gpuInstanceSliceCount: slices,
                    computeInstanceSliceCount: slices,
                    memorySizeMB: gpu.total >> 20,
                },
            )
        }
    })
}

/// Whether NVLink `link` is active: the 18 links of an SXM board are.
///
/// # Safety
/// `active` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: nvmlDevice_t,
    link: c_uint,
    active: *mut nvmlEnableState_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetNvLinkState", device, |_, gpu| {
        match nvlinks(gpu) {
            0 => NOT_SUPPORTED,
            n if link >= n => INVALID_ARGUMENT,
            _ => unsafe { put(active, 1) },
        }
    })
}

macro_rules! nvlink_fn {
    ($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),*) -> $out:ident: $out_ty:ty = $value:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The output must be writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            link: c_uint,
            $($arg: $ty,)*
            $out: *mut $out_ty,
        ) -> c_uint {
            with_gpu(stringify!($name), device, |_, gpu| match nvlinks(gpu) {
                0 => NOT_SUPPORTED,
                n if link >= n => INVALID_ARGUMENT,
                _ => {
                    $(let _ = $arg;)*
                    unsafe { put($out, $value) }
                }
            })
        }
    };
}

nvlink_fn!(
    /// NVLink 4 (`NVML_NVLINK_VERSION_4_0`).
    nvmlDeviceGetNvLinkVersion() -> version: c_uint = 6
);
nvlink_fn!(
    /// Every capability (P2P, system memory access, atomics, SLI bridge) is present.
    nvmlDeviceGetNvLinkCapability(capability: nvmlNvLinkCapability_t) -> result: c_uint = 1
);
nvlink_fn!(
    /// The far end of each link is an NVSwitch (`NVML_NVLINK_DEVICE_TYPE_SWITCH`).
    nvmlDeviceGetNvLinkRemoteDeviceType() -> kind: nvmlIntNvLinkDeviceType_t = 2
);
nvlink_fn!(
    /// No link errors.
    nvmlDeviceGetNvLinkErrorCounter(counter: nvmlNvLinkErrorCounter_t) -> value: c_ulonglong = 0
);

/// The PCI address of the NVSwitch at the far end of `link` (four switches on an HGX board,
/// 18 links spread over them).
///
/// # Safety
/// `pci` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkRemotePciInfo_v2(
    device: nvmlDevice_t,
    link: c_uint,
    pci: *mut nvmlPciInfo_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetNvLinkRemotePciInfo_v2", device, |_, gpu| {
        match nvlinks(gpu) {
            0 => return NOT_SUPPORTED,
            n if link >= n => return INVALID_ARGUMENT,
            _ => {}
        }
        if pci.is_null() {
            return INVALID_ARGUMENT;
        }
        let switch = link % 4;
        let bus = 0x05 + switch;
        let mut value: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
        let id = format!("00000000:{bus:02X}:00.0");
        crate::copy_into(&mut value.busIdLegacy, &id);
        crate::copy_into(&mut value.busId, &id);
        value.bus = bus;
        value.pciDeviceId = (0x22a3 << 16) | 0x10de;
        value.pciSubSystemId = 0x1796_10de;
        unsafe { *pci = value };
        SUCCESS
    })
}

/// NVLink information: no NVLink encryption (`isNvleEnabled` 0; firmware info empty).
///
/// # Safety
/// `info` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkInfo(
    device: nvmlDevice_t,
    info: *mut nvmlNvLinkInfo_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetNvLinkInfo", device, |_, gpu| unsafe {
        if nvlinks(gpu) == 0 {
            return NOT_SUPPORTED;
        }
        if info.is_null() {
            return INVALID_ARGUMENT;
        }
        let version = *info.cast::<c_uint>();
        // Version 1 and 2 share their first fields; 2 adds the firmware info.
        if version != struct_version::<nvmlNvLinkInfo_v1_t>(1)
            && version != struct_version::<nvmlNvLinkInfo_v2_t>(2)
        {
            return ARGUMENT_VERSION_MISMATCH;
        }
        let v = info.cast::<nvmlNvLinkInfo_v1_t>();
        (*v).isNvleEnabled = 0;
        if version == struct_version::<nvmlNvLinkInfo_v2_t>(2) {
            (*info).firmwareInfo = std::mem::zeroed();
        }
        SUCCESS
    })
}

/// The fabric state of an NVSwitch board: registration completed with success, in clique 0
/// of an unnamed cluster (a single HGX node).
///
/// # Safety
/// `info` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfo(
    device: nvmlDevice_t,
    info: *mut nvmlGpuFabricInfo_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetGpuFabricInfo", device, |_, gpu| {
        if nvlinks(gpu) == 0 {
            return NOT_SUPPORTED;
        }
        unsafe {
            put(
                info,
                nvmlGpuFabricInfo_t {
                    clusterUuid: [0; 16],
                    status: SUCCESS,
                    cliqueId: 0,
                    state: 3,
                },
            )
        }
    })
}

/// [`nvmlDeviceGetGpuFabricInfo`] in its versioned form (v2 adds the health mask: healthy).
///
/// # Safety
/// `info` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfoV(
    device: nvmlDevice_t,
    info: *mut nvmlGpuFabricInfoV_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetGpuFabricInfoV", device, |_, gpu| unsafe {
        if nvlinks(gpu) == 0 {
            return NOT_SUPPORTED;
        }
        if info.is_null() {
            return INVALID_ARGUMENT;
        }
        let version = *info.cast::<c_uint>();
        if version != struct_version::<nvmlGpuFabricInfo_v2_t>(2)
            && version != struct_version::<nvmlGpuFabricInfo_v2_t>(1)
        {
            return ARGUMENT_VERSION_MISMATCH;
        }
        let i = &mut *info;
        i.clusterUuid = [0; 16];
        i.status = SUCCESS;
        i.cliqueId = 0;
        i.state = 3;
        i.healthMask = 0;
        SUCCESS
    })
}

/// The first shared ancestor of two GPUs: the GPU itself, the NUMA node for GPUs on one
/// socket, the system across sockets (`NVML_TOPOLOGY_INTERNAL`/`NODE`/`SYSTEM`).
fn topology_level(a: u32, b: u32) -> nvmlGpuTopologyLevel_t {
    if a == b {
        0
    } else if numa_node(a) == numa_node(b) {
        40
    } else {
        50
    }
}

/// The GPU index a handle names, if it names one of the state's GPUs.
fn gpu_index_of(device: nvmlDevice_t, count: usize) -> Option<u32> {
    let (index, _) = decode_handle(device);
    (!device.is_null() && index < count).then_some(index as u32)
}

/// # Safety
/// `path` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyCommonAncestor(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    path: *mut nvmlGpuTopologyLevel_t,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetTopologyCommonAncestor",
        device1,
        |sim, gpu| match gpu_index_of(device2, sim.state().gpus.len()) {
            Some(other) => unsafe { put(path, topology_level(gpu.index, other)) },
            None => INVALID_ARGUMENT,
        },
    )
}

/// The GPUs whose common ancestor with `device` is at `level` or nearer.
///
/// # Safety
/// `count` must be writable; `devices` holds `*count` handles or is null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTopologyNearestGpus(
    device: nvmlDevice_t,
    level: nvmlGpuTopologyLevel_t,
    count: *mut c_uint,
    devices: *mut nvmlDevice_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetTopologyNearestGpus", device, |sim, gpu| {
        let near: Vec<nvmlDevice_t> = (0..sim.state().gpus.len() as u32)
            .filter(|&i| i != gpu.index && topology_level(gpu.index, i) <= level)
            .map(|i| handle_of(i as usize))
            .collect();
        unsafe { fill_array(&near, count, devices, CountQuery::Succeeds) }
    })
}

/// Peer-to-peer between two GPUs of an NVSwitch board: every capability OK
/// (`NVML_P2P_STATUS_OK`).
///
/// # Safety
/// `status` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetP2PStatus(
    device1: nvmlDevice_t,
    device2: nvmlDevice_t,
    index: nvmlGpuP2PCapsIndex_t,
    status: *mut nvmlGpuP2PStatus_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetP2PStatus", device1, |sim, _| {
        if gpu_index_of(device2, sim.state().gpus.len()).is_none() || index > 6 {
            return INVALID_ARGUMENT;
        }
        unsafe { put(status, 0) }
    })
}

/// The CPUs of the GPU's NUMA node, as a bit mask in `cpu_set_size` words: this host's CPUs
/// split in two sockets.
unsafe fn cpu_mask(gpu: &ObservedGpu, cpu_set_size: c_uint, cpu_set: *mut c_ulong) -> c_uint {
    if cpu_set.is_null() || cpu_set_size == 0 {
        return INVALID_ARGUMENT;
    }
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let per_node = cpus.div_ceil(2).max(1);
    let node = numa_node(gpu.index) as usize;
    let first = (node * per_node).min(cpus.saturating_sub(1));
    let bits = c_ulong::BITS as usize;
    for w in 0..cpu_set_size as usize {
        let mut word: c_ulong = 0;
        for b in 0..bits {
            let cpu = w * bits + b;
            if cpu >= first && cpu < (first + per_node).min(cpus) {
                word |= 1 << b;
            }
        }
        unsafe { *cpu_set.add(w) = word };
    }
    SUCCESS
}

/// # Safety
/// `cpu_set` holds `cpu_set_size` words.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinity(
    device: nvmlDevice_t,
    cpu_set_size: c_uint,
    cpu_set: *mut c_ulong,
) -> c_uint {
    with_gpu("nvmlDeviceGetCpuAffinity", device, |_, gpu| unsafe {
        cpu_mask(gpu, cpu_set_size, cpu_set)
    })
}

/// The same mask for either scope (NUMA node or socket: one node per socket here).
///
/// # Safety
/// `cpu_set` holds `cpu_set_size` words.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCpuAffinityWithinScope(
    device: nvmlDevice_t,
    cpu_set_size: c_uint,
    cpu_set: *mut c_ulong,
    scope: nvmlAffinityScope_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetCpuAffinityWithinScope", device, |_, gpu| {
        if scope > 1 {
            return INVALID_ARGUMENT;
        }
        unsafe { cpu_mask(gpu, cpu_set_size, cpu_set) }
    })
}

/// The GPU's NUMA node as a bit mask.
///
/// # Safety
/// `node_set` holds `node_set_size` words.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryAffinity(
    device: nvmlDevice_t,
    node_set_size: c_uint,
    node_set: *mut c_ulong,
    scope: nvmlAffinityScope_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetMemoryAffinity", device, |_, gpu| {
        if node_set.is_null() || node_set_size == 0 || scope > 1 {
            return INVALID_ARGUMENT;
        }
        unsafe {
            *node_set = 1 << numa_node(gpu.index);
            for w in 1..node_set_size as usize {
                *node_set.add(w) = 0;
            }
        }
        SUCCESS
    })
}

/// The GPUs with affinity to CPU `cpu`: those of its NUMA node.
///
/// # Safety
/// `count` must be writable; `devices` holds `*count` handles or is null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetTopologyGpuSet(
    cpu: c_uint,
    count: *mut c_uint,
    devices: *mut nvmlDevice_t,
) -> c_uint {
    with_sim(|sim| {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get()) as u32;
        if cpu >= cpus {
            return INVALID_ARGUMENT;
        }
        let node = u32::from(cpu >= cpus.div_ceil(2));
        let set: Vec<nvmlDevice_t> = (0..sim.state().gpus.len() as u32)
            .filter(|&i| numa_node(i) == node)
            .map(|i| handle_of(i as usize))
            .collect();
        unsafe { fill_array(&set, count, devices, CountQuery::Succeeds) }
    })
}

/// The current value of sample type `kind` as one sample (`NVML_TOTAL_POWER_SAMPLES` …
/// `NVML_OFA_UTILIZATION_SAMPLES`), newer than `last_seen_us`; `NOT_FOUND` when the caller
/// has seen it.
///
/// # Safety
/// `value_type` and `count` must be writable; `samples` holds `*count` entries or is null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSamples(
    device: nvmlDevice_t,
    kind: nvmlSamplingType_t,
    last_seen_us: c_ulonglong,
    value_type: *mut nvmlValueType_t,
    count: *mut c_uint,
    samples: *mut nvmlSample_t,
) -> c_uint {
    let counted = samples.is_null().then_some("nvmlDeviceGetSamples");
    with_gpu_counted(counted, device, |_, gpu| {
        if value_type.is_null() || count.is_null() {
            return INVALID_ARGUMENT;
        }
        let (sm, memory) = gpu_utilization(gpu);
        let value: c_uint = match kind {
            0 | 7 => power_draw_mw(gpu),
            1 => sm,
            2 => memory,
            3 | 4 | 8 | 9 => 0,
            5 => clock(gpu, 0, false).unwrap_or(0),
            6 => clock(gpu, 2, false).unwrap_or(0),
            _ => return INVALID_ARGUMENT,
        };
        // One sample per sixth of a second, as the driver's sampling period.
        let at = now_us() / 166_667 * 166_667;
        if at <= last_seen_us {
            return NOT_FOUND;
        }
        unsafe { *value_type = 1 };
        let mut sample: nvmlSample_t = unsafe { std::mem::zeroed() };
        sample.timeStamp = at;
        sample.sampleValue.uiVal = value;
        unsafe { fill_array(&[sample], count, samples, CountQuery::Succeeds) }
    })
}

/// Per-process utilization in its versioned form: the same samples as
/// `nvmlDeviceGetProcessUtilization`, with encoder, decoder, JPEG and OFA use at 0.
///
/// # Safety
/// `info` must be writable with its version set; its array holds `processSamplesCount`
/// entries or is null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessesUtilizationInfo(
    device: nvmlDevice_t,
    info: *mut nvmlProcessesUtilizationInfo_t,
) -> c_uint {
    let fill = !info.is_null() && unsafe { !(*info).procUtilArray.is_null() };
    let counted = (!fill).then_some("nvmlDeviceGetProcessesUtilizationInfo");
    with_gpu_counted(counted, device, |_, gpu| unsafe {
        let checked = version_matches(info, info.cast::<c_uint>(), 1);
        if checked != SUCCESS {
            return checked;
        }
        if gpu.mig {
            return NOT_SUPPORTED;
        }
        let i = &mut *info;
        let fresh: Vec<nvmlProcessUtilizationInfo_v1_t> = gpu
            .utilization
            .iter()
            .filter(|u| u.timestamp_us > i.lastSeenTimeStamp)
            .map(|u| nvmlProcessUtilizationInfo_v1_t {
                timeStamp: u.timestamp_us,
                pid: u.pid,
                smUtil: u.sm_util,
                memUtil: u.mem_util,
                encUtil: 0,
                decUtil: 0,
                jpgUtil: 0,
                ofaUtil: 0,
            })
            .collect();
        if fresh.is_empty() {
            i.processSamplesCount = 0;
            return NOT_FOUND;
        }
        fill_array(
            &fresh,
            &mut i.processSamplesCount,
            i.procUtilArray,
            CountQuery::InsufficientSize,
        )
    })
}

/// The value of field `id` on `gpu`, as (`nvmlValueType_t`, raw 64 bits), or the per-field
/// return code NVML puts in the entry: `NOT_SUPPORTED` for fields of other products (page
/// retirement on a GPU that remaps rows) or not modelled.
fn field_value(gpu: &ObservedGpu, id: c_uint) -> Result<(nvmlValueType_t, u64), c_uint> {
    const UINT: nvmlValueType_t = 1;
    const ULL: nvmlValueType_t = 3;
    let rows = gpu.health.remapped_rows;
    let links = u64::from(nvlinks(gpu));
    let nvlink = |v: u64| {
        if links > 0 {
            Ok((ULL, v))
        } else {
            Err(NOT_SUPPORTED)
        }
    };
    match id {
        1 | 2 => Ok((UINT, 1)),
        3..=6 => Ok((ULL, 0)),
        29..=31 if rows.is_some() => Err(NOT_SUPPORTED),
        29..=31 => Ok((ULL, 0)),
        74 | 75 => Ok((ULL, 0)),
        82 => Ok((UINT, u64::from(temperature(gpu)) + 8)),
        83 => Ok((ULL, crate::device_info::energy_mj(gpu))),
        90 | 164 => nvlink(if links > 0 { 26_562 } else { 0 }),
        91 | 147 => nvlink(links),
        94 => Ok((ULL, 0)),
        138 | 139 => nvlink(0),
        142..=145 => match rows {
            Some(r) => Ok((
                UINT,
                u64::from(match id {
                    142 => r.correctable,
                    143 => r.uncorrectable,
                    144 => u32::from(r.pending),
                    _ => u32::from(r.failure),
                }),
            )),
            None => Err(NOT_SUPPORTED),
        },
        185 | 186 => Ok((UINT, u64::from(power_draw_mw(gpu)))),
        190 => Ok((UINT, u64::from(crate::power_limit_mw(gpu)))),
        0 | 230.. => Err(INVALID_ARGUMENT),
        _ => Err(NOT_SUPPORTED),
    }
}

/// Field values: each entry gets its value or its own return code (the call succeeds), with
/// the time it was read, as NVML fills them.
///
/// # Safety
/// `values` holds `count` entries with their `fieldId` set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: nvmlDevice_t,
    count: c_int,
    values: *mut nvmlFieldValue_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetFieldValues", device, |_, gpu| {
        if values.is_null() || count <= 0 {
            return INVALID_ARGUMENT;
        }
        let at = now_us() as i64;
        for i in 0..count as usize {
            let v = unsafe { &mut *values.add(i) };
            v.timestamp = at;
            v.latencyUsec = 0;
            match field_value(gpu, v.fieldId) {
                Ok((kind, raw)) => {
                    v.valueType = kind;
                    v.nvmlReturn = SUCCESS;
                    v.value.ullVal = raw;
                }
                Err(code) => v.nvmlReturn = code,
            }
        }
        SUCCESS
    })
}
