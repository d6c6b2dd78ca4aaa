//! `libnvidia-ml.so.1` for the simulated driver: the NVML C ABI over [`vramguard_sim`].
//!
//! Load it in place of the real library (`vramguard --nvml-lib path/to/libnvidia-ml.so.1`,
//! with `VRAMGUARD_SIM` naming the state file) and every NVML call vramguard makes runs the
//! real `nvml-wrapper` code path: its count-then-fill protocol, its struct versions, its error
//! mapping. The library behaves like NVIDIA's where vramguard depends on it:
//! - calls before `nvmlInit_v2` (or after the last `nvmlShutdown`) return `UNINITIALIZED`;
//! - process-list calls with a null buffer (or too small a count) return `INSUFFICIENT_SIZE`
//!   with the needed count, `SUCCESS` with count 0 when there are no processes;
//! - `nvmlDeviceGetMemoryInfo_v2` checks the struct version (`ARGUMENT_VERSION_MISMATCH`);
//! - MIG ids are `0xFFFFFFFF` off MIG devices; in MIG mode the whole GPU's lists give
//!   per-process memory as `NVML_VALUE_NOT_AVAILABLE` with the instance ids, and each MIG
//!   device's handle answers with its own memory and processes; strings too long for the
//!   caller's buffer give `INSUFFICIENT_SIZE`;
//! - `nvmlDeviceGetProcessUtilization` returns `NOT_FOUND` when there are no samples;
//! - `nvmlErrorString` gives NVML's messages; injected faults return their codes;
//! - row remapping and page retirement answer `NOT_SUPPORTED` where the state has none; an
//!   event set receives the Xid events raised after it registered (`nvmlEventSetWait_v2`).
//!
//! Without `VRAMGUARD_SIM`, `nvmlInit_v2` returns `DRIVER_NOT_LOADED`, as NVML does on a
//! machine without the kernel module.
//!
//! Beyond what vramguard calls, it answers every device and system query of nvidia-ml-py
//! that the checked `nvml.h` declares, as an H100/H200 on a 580 driver does (values, or
//! `NOT_SUPPORTED` where such a GPU has no such feature): `docs/simulator.md` lists each
//! answer, and a test holds the list to the library.

use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlPciInfo_t,
    nvmlProcessInfo_t, nvmlProcessInfo_v1_t, nvmlProcessUtilizationSample_t, nvmlUtilization_t,
};
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_ulonglong};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use vramguard_sim::codes::*;
use vramguard_sim::state::Quirk;
use vramguard_sim::{AllocationKind, ObservedGpu, Sim};

mod device_info;
pub use device_info::*;
mod device_queries;
pub use device_queries::*;
mod mig_instances;
pub use mig_instances::*;
mod system_info;
pub use system_info::*;
mod unsupported;
pub use unsupported::*;

struct Loaded {
    sim: Sim,
    refcount: u32,
    /// Kept open from init to the last shutdown, as a real NVML client keeps the control,
    /// unified-memory and GPU device files ([`vramguard_sim::source::open_client_device_files`]).
    _device_files: vramguard_sim::source::ClientFiles,
}

static STATE: Mutex<Option<Loaded>> = Mutex::new(None);

/// `NVML_STRUCT_VERSION(Memory, 2)`.
const MEMORY_V2_VERSION: u32 = (std::mem::size_of::<nvmlMemory_v2_t>() as u32) | (2 << 24);

thread_local! {
    /// The stall of the fault the current call met, taken after the model's lock is
    /// released: one GPU's stalled call must not hold up calls to the others from other
    /// threads.
    static STALL: std::cell::Cell<Option<Duration>> = const { std::cell::Cell::new(None) };
}

/// Counts a call of `call` (on `gpu`) for fault injection: the code to return, if any. A
/// stall is served when the call leaves [`with_sim`].
fn fault(sim: &mut Sim, call: &str, gpu: Option<u32>) -> Option<u32> {
    let hit = sim.fault_hit(call, gpu)?;
    if let Some(stall) = hit.stall {
        STALL.with(|s| s.set(Some(s.get().unwrap_or_default() + stall)));
    }
    hit.code
}

/// Runs `f` on the loaded simulator, or returns `UNINITIALIZED`. Never unwinds into C.
fn with_sim(f: impl FnOnce(&mut Sim) -> u32) -> u32 {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_mut() {
            Some(loaded) => f(&mut loaded.sim),
            None => UNINITIALIZED,
        }
    }));
    if let Some(stall) = STALL.with(|s| s.take()) {
        std::thread::sleep(stall);
    }
    result.unwrap_or(UNKNOWN)
}

/// Runs `f` with the GPU a handle names, after counting the call for fault injection.
fn with_gpu(
    call: &str,
    device: nvmlDevice_t,
    f: impl FnOnce(&mut Sim, &ObservedGpu) -> u32,
) -> u32 {
    with_gpu_counted(Some(call), device, f)
}

/// Like [`with_gpu`]; `call: None` does not count the call. The fill half of a count-then-fill
/// pair is not counted, so that `after_calls` counts logical queries, as the in-process source
/// does.
fn with_gpu_counted(
    call: Option<&str>,
    device: nvmlDevice_t,
    f: impl FnOnce(&mut Sim, &ObservedGpu) -> u32,
) -> u32 {
    with_sim(|sim| {
        let (index, mig) = decode_handle(device);
        let count = sim.state().gpus.len();
        if device.is_null() || index >= count {
            return INVALID_ARGUMENT;
        }
        if let Some(call) = call
            && let Some(code) = fault(sim, call, Some(index as u32))
        {
            return code;
        }
        match sim.observed() {
            Ok(obs) => match (obs.gpus.get(index), mig) {
                (Some(gpu), None) => f(sim, gpu),
                (Some(gpu), Some(m)) => match mig_view(gpu, m) {
                    Some(view) => f(sim, &view),
                    None => INVALID_ARGUMENT,
                },
                (None, _) => GPU_IS_LOST,
            },
            Err(_) => UNKNOWN,
        }
    })
}

fn handle_of(index: usize) -> nvmlDevice_t {
    (index + 1) as nvmlDevice_t
}

/// The handle of MIG device `mig` of GPU `index`: the GPU's handle with the MIG device's
/// number above it.
fn mig_handle_of(index: usize, mig: usize) -> nvmlDevice_t {
    (((mig + 1) << 16) | (index + 1)) as nvmlDevice_t
}

/// (GPU index, MIG device index) of a handle.
fn decode_handle(device: nvmlDevice_t) -> (usize, Option<usize>) {
    let raw = device as usize;
    let index = (raw & 0xffff).wrapping_sub(1);
    ((index), (raw >> 16).checked_sub(1))
}

/// A MIG device as its own handle shows it: its memory, its processes with their memory, its
/// UUID and name; the rest is its GPU's.
fn mig_view(gpu: &ObservedGpu, mig: usize) -> Option<ObservedGpu> {
    let d = gpu.mig_devices.get(mig)?;
    Some(ObservedGpu {
        uuid: d.uuid.clone(),
        name: format!("{} MIG {}", gpu.name, d.profile),
        total: d.total,
        reserved: 0,
        used: d.used,
        free: d.total.saturating_sub(d.used),
        processes: d.processes.clone(),
        utilization: Vec::new(),
        mig: false,
        mig_devices: Vec::new(),
        quirks: gpu.quirks.clone(),
        ..gpu.clone()
    })
}

/// Copies `s` and a NUL into a caller buffer of `length` bytes.
unsafe fn write_c_string(s: &str, out: *mut c_char, length: c_uint) -> u32 {
    if out.is_null() {
        return INVALID_ARGUMENT;
    }
    if s.len() + 1 > length as usize {
        return INSUFFICIENT_SIZE;
    }
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), out, s.len());
        *out.add(s.len()) = 0;
    }
    SUCCESS
}

fn init() -> u32 {
    let result = std::panic::catch_unwind(|| {
        let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(loaded) = guard.as_mut() {
            loaded.refcount += 1;
            return SUCCESS;
        }
        let Some(path) = std::env::var_os("VRAMGUARD_SIM") else {
            return DRIVER_NOT_LOADED;
        };
        let mut sim = match Sim::open(path) {
            Ok(sim) => sim,
            Err(_) => return DRIVER_NOT_LOADED,
        };
        if let Some(code) = fault(&mut sim, "nvmlInit_v2", None) {
            return code;
        }
        let device_files = vramguard_sim::source::open_client_device_files(sim.state());
        *guard = Some(Loaded {
            sim,
            refcount: 1,
            _device_files: device_files,
        });
        SUCCESS
    });
    if let Some(stall) = STALL.with(|s| s.take()) {
        std::thread::sleep(stall);
    }
    result.unwrap_or(UNKNOWN)
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> c_uint {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> c_uint {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> c_uint {
    init()
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> c_uint {
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    match guard.as_mut() {
        None => UNINITIALIZED,
        Some(loaded) => {
            loaded.refcount -= 1;
            if loaded.refcount == 0 {
                *guard = None;
            }
            SUCCESS
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: c_uint) -> *const c_char {
    error_string(result).as_ptr().cast()
}

/// # Safety
/// `version` must point to `length` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> c_uint {
    with_sim(|sim| {
        if let Some(code) = fault(sim, "nvmlSystemGetDriverVersion", None) {
            return code;
        }
        let v = sim.state().driver_version.clone();
        unsafe { write_c_string(&v, version, length) }
    })
}

/// # Safety
/// `version` must point to `length` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) -> c_uint {
    with_sim(|sim| {
        if let Some(code) = fault(sim, "nvmlSystemGetNVMLVersion", None) {
            return code;
        }
        let v = sim.state().nvml_version();
        unsafe { write_c_string(&v, version, length) }
    })
}

/// # Safety
/// `version` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(version: *mut c_int) -> c_uint {
    with_sim(|_| {
        if version.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *version = 13000 };
        SUCCESS
    })
}

/// # Safety
/// `version` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> c_uint {
    unsafe { nvmlSystemGetCudaDriverVersion(version) }
}

/// # Safety
/// `count` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> c_uint {
    with_sim(|sim| {
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        if let Some(code) = fault(sim, "nvmlDeviceGetCount_v2", None) {
            return code;
        }
        unsafe { *count = sim.state().gpus.len() as c_uint };
        SUCCESS
    })
}

/// # Safety
/// `device` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> c_uint {
    with_sim(|sim| {
        if device.is_null() || index as usize >= sim.state().gpus.len() {
            return INVALID_ARGUMENT;
        }
        if let Some(code) = fault(sim, "nvmlDeviceGetHandleByIndex_v2", Some(index)) {
            return code;
        }
        unsafe { *device = handle_of(index as usize) };
        SUCCESS
    })
}

/// # Safety
/// `uuid` must be a NUL-terminated string, `device` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> c_uint {
    with_sim(|sim| {
        if uuid.is_null() || device.is_null() {
            return INVALID_ARGUMENT;
        }
        let wanted = unsafe { std::ffi::CStr::from_ptr(uuid) }.to_string_lossy();
        match sim.state().gpus.iter().position(|g| g.uuid == wanted) {
            Some(i) => {
                unsafe { *device = handle_of(i) };
                SUCCESS
            }
            None => NOT_FOUND,
        }
    })
}

/// Looks a GPU up by the text `key` gives, as the `nvmlDeviceGetHandleBy*` functions do.
unsafe fn handle_by(
    key: *const c_char,
    device: *mut nvmlDevice_t,
    matches: impl Fn(usize, &vramguard_sim::state::SimGpu, &str) -> bool,
) -> c_uint {
    with_sim(|sim| {
        if key.is_null() || device.is_null() {
            return INVALID_ARGUMENT;
        }
        let wanted = unsafe { std::ffi::CStr::from_ptr(key) }.to_string_lossy();
        match sim
            .state()
            .gpus
            .iter()
            .enumerate()
            .position(|(i, g)| matches(i, g, &wanted))
        {
            Some(i) => {
                unsafe { *device = handle_of(i) };
                SUCCESS
            }
            None => NOT_FOUND,
        }
    })
}

/// By PCI bus id, in either the full (`00000000:19:00.0`) or the legacy short form
/// (`0000:19:00.0`), in any case, as NVML accepts them.
///
/// # Safety
/// `bus_id` must be a NUL-terminated string, `device` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    bus_id: *const c_char,
    device: *mut nvmlDevice_t,
) -> c_uint {
    let normal = |id: &str| {
        let id = id.to_ascii_lowercase();
        match id.split_once(':') {
            Some((domain, rest)) => format!(
                "{:08x}:{rest}",
                u32::from_str_radix(domain, 16).unwrap_or(u32::MAX)
            ),
            None => id,
        }
    };
    unsafe {
        handle_by(bus_id, device, |_, g, wanted| {
            normal(&g.pci_bus_id) == normal(wanted)
        })
    }
}

/// By UUID in its versioned form: the text (`NVML_UUID_TYPE_ASCII`) or the 16 bytes
/// (`NVML_UUID_TYPE_BINARY`) of `GPU-…`.
///
/// # Safety
/// `uuid` must be readable, `device` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUIDV(
    uuid: *const nvml_wrapper_sys::bindings::nvmlUUID_t,
    device: *mut nvmlDevice_t,
) -> c_uint {
    /// `GPU-3b1c0000-7d3e-…` as its 16 bytes.
    fn binary(uuid: &str) -> Option<[u8; 16]> {
        let hex: String = uuid
            .strip_prefix("GPU-")?
            .chars()
            .filter(|c| *c != '-')
            .collect();
        let mut out = [0u8; 16];
        if hex.len() != 32 {
            return None;
        }
        for (i, byte) in out.iter_mut().enumerate() {
            *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(out)
    }
    with_sim(|sim| {
        if uuid.is_null() || device.is_null() {
            return INVALID_ARGUMENT;
        }
        let u = unsafe { &*uuid };
        if u.version
            != (std::mem::size_of::<nvml_wrapper_sys::bindings::nvmlUUID_t>() as u32 | (1 << 24))
        {
            return ARGUMENT_VERSION_MISMATCH;
        }
        let found = sim.state().gpus.iter().position(|g| match u.type_ {
            1 => {
                let text = unsafe { u.value.str_ };
                let end = text.iter().position(|c| *c == 0).unwrap_or(text.len());
                let bytes: Vec<u8> = text[..end].iter().map(|c| *c as u8).collect();
                bytes == g.uuid.as_bytes()
            }
            2 => binary(&g.uuid) == Some(unsafe { u.value.bytes }),
            _ => false,
        });
        match (u.type_, found) {
            (1 | 2, Some(i)) => {
                unsafe { *device = handle_of(i) };
                SUCCESS
            }
            (1 | 2, None) => NOT_FOUND,
            _ => INVALID_ARGUMENT,
        }
    })
}

/// By board serial.
///
/// # Safety
/// `serial` must be a NUL-terminated string, `device` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleBySerial(
    serial: *const c_char,
    device: *mut nvmlDevice_t,
) -> c_uint {
    unsafe {
        handle_by(serial, device, |i, _, wanted| {
            device_info::serial_of(i as u32) == wanted
        })
    }
}

/// # Safety
/// `index` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> c_uint {
    with_gpu("nvmlDeviceGetIndex", device, |_, gpu| {
        if index.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *index = gpu.index };
        SUCCESS
    })
}

/// # Safety
/// `uuid` must point to `length` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetUUID", device, |_, gpu| unsafe {
        write_c_string(&gpu.uuid, uuid, length)
    })
}

/// # Safety
/// `name` must point to `length` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetName", device, |_, gpu| unsafe {
        write_c_string(&gpu.name, name, length)
    })
}

/// # Safety
/// `minor` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetMinorNumber", device, |_, gpu| {
        if minor.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *minor = gpu.index };
        SUCCESS
    })
}

fn copy_into<const N: usize>(dst: &mut [c_char; N], s: &str) {
    for (d, b) in dst.iter_mut().zip(s.bytes().take(N - 1)) {
        *d = b as c_char;
    }
}

/// # Safety
/// `pci` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: nvmlDevice_t,
    pci: *mut nvmlPciInfo_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetPciInfo_v3", device, |_, gpu| {
        if pci.is_null() {
            return INVALID_ARGUMENT;
        }
        let id = &gpu.pci_bus_id;
        let hex = |range: std::ops::Range<usize>| u32::from_str_radix(&id[range], 16).unwrap_or(0);
        // SAFETY: plain C struct of integers and char arrays; all-zero is valid.
        let mut info: nvmlPciInfo_t = unsafe { std::mem::zeroed() };
        info.domain = hex(0..8);
        info.bus = hex(9..11);
        info.device = hex(12..14);
        info.pciDeviceId = 0x2335_10DE;
        info.pciSubSystemId = 0x18BE_10DE;
        copy_into(&mut info.busId, id);
        copy_into(&mut info.busIdLegacy, &id[4..]);
        unsafe { *pci = info };
        SUCCESS
    })
}

/// # Safety
/// `memory` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetMemoryInfo", device, |_, gpu| {
        if memory.is_null() {
            return INVALID_ARGUMENT;
        }
        // v1 has no "reserved": it is counted as used, as on real drivers.
        unsafe {
            (*memory).total = gpu.total;
            (*memory).free = gpu.free;
            (*memory).used = gpu.used + gpu.reserved;
        }
        SUCCESS
    })
}

/// # Safety
/// `memory` must be writable, with its `version` set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetMemoryInfo_v2", device, |_, gpu| {
        if memory.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe {
            if (*memory).version != MEMORY_V2_VERSION {
                return ARGUMENT_VERSION_MISMATCH;
            }
            (*memory).total = gpu.total;
            (*memory).reserved = gpu.reserved;
            (*memory).free = gpu.free;
            (*memory).used = gpu.used;
        }
        SUCCESS
    })
}

/// Utilization of the whole GPU: (SM %, memory %), the model's.
fn gpu_utilization(gpu: &ObservedGpu) -> (u32, u32) {
    gpu.gpu_utilization()
}

/// The board power limit in milliwatts, the model's.
pub(crate) fn power_limit_mw(gpu: &ObservedGpu) -> u32 {
    gpu.power_limit_mw()
}

/// Power draw in milliwatts, the model's.
fn power_draw_mw(gpu: &ObservedGpu) -> u32 {
    gpu.power_draw_mw()
}

/// # Safety
/// `utilization` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: nvmlDevice_t,
    utilization: *mut nvmlUtilization_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetUtilizationRates", device, |_, gpu| {
        if utilization.is_null() {
            return INVALID_ARGUMENT;
        }
        let (sm, memory) = gpu_utilization(gpu);
        unsafe { *utilization = nvmlUtilization_t { gpu: sm, memory } };
        SUCCESS
    })
}

/// The GPU core temperature (sensor 0, the only one NVML defines): 30 °C idle, 75 °C at full
/// load. In MIG mode per-process utilization is not reported, so it stays at idle.
///
/// # Safety
/// `temp` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: nvmlDevice_t,
    sensor: c_uint,
    temp: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetTemperature", device, |_, gpu| {
        if temp.is_null() || sensor != 0 {
            return INVALID_ARGUMENT;
        }
        unsafe { *temp = device_info::temperature(gpu) };
        SUCCESS
    })
}

/// `NVML_STRUCT_VERSION(Temperature, 1)`.
const TEMPERATURE_V1: u32 =
    (std::mem::size_of::<nvml_wrapper_sys::bindings::nvmlTemperature_v1_t>() as u32) | (1 << 24);

/// The versioned temperature query newer clients (nvitop) try first: the same reading as
/// [`nvmlDeviceGetTemperature`], the struct version checked.
///
/// # Safety
/// `temperature` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperatureV(
    device: nvmlDevice_t,
    temperature: *mut nvml_wrapper_sys::bindings::nvmlTemperature_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetTemperatureV", device, |_, gpu| {
        if temperature.is_null() {
            return INVALID_ARGUMENT;
        }
        let t = unsafe { &mut *temperature };
        if t.version != TEMPERATURE_V1 {
            return ARGUMENT_VERSION_MISMATCH;
        }
        if t.sensorType != 0 {
            return INVALID_ARGUMENT;
        }
        t.temperature = (30 + gpu_utilization(gpu).0 * 45 / 100) as c_int;
        SUCCESS
    })
}

/// # Safety
/// `power` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: nvmlDevice_t,
    power: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetPowerUsage", device, |_, gpu| {
        if power.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *power = power_draw_mw(gpu) };
        SUCCESS
    })
}

macro_rules! power_limit_fn {
    ($name:ident) => {
        /// # Safety
        /// `limit` must be writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(device: nvmlDevice_t, limit: *mut c_uint) -> c_uint {
            with_gpu(stringify!($name), device, |_, gpu| {
                if limit.is_null() {
                    return INVALID_ARGUMENT;
                }
                unsafe { *limit = power_limit_mw(gpu) };
                SUCCESS
            })
        }
    };
}

power_limit_fn!(nvmlDeviceGetEnforcedPowerLimit);
power_limit_fn!(nvmlDeviceGetPowerManagementLimit);

/// # Safety
/// `mode` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPersistenceMode(
    device: nvmlDevice_t,
    mode: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetPersistenceMode", device, |_, gpu| {
        if mode.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *mode = gpu.persistence_mode as c_uint };
        SUCCESS
    })
}

/// The count-then-fill protocol shared by every process-list call: `write(i, pid, bytes)`
/// fills the caller's `i`-th record in the layout its version uses. `v3_buffer` is the
/// caller's buffer of a `_v3` call, where the GPU's quirks apply.
unsafe fn process_list(
    call: &str,
    device: nvmlDevice_t,
    kind: AllocationKind,
    v3_buffer: Option<*mut u8>,
    count: *mut c_uint,
    filling: bool,
    mut write: impl FnMut(usize, c_uint, c_ulonglong, (c_uint, c_uint)),
) -> c_uint {
    let counted = (!filling).then_some(call);
    with_gpu_counted(counted, device, |_, gpu| {
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        let procs: Vec<_> = gpu.processes.iter().filter(|p| p.kind == kind).collect();
        let capacity = unsafe { *count } as usize;
        unsafe { *count = procs.len() as c_uint };
        if procs.is_empty() {
            return SUCCESS;
        }
        if !filling || capacity < procs.len() {
            return INSUFFICIENT_SIZE;
        }
        let records: Vec<(u32, u64)> = procs
            .iter()
            .map(|p| (p.pid, p.used_bytes.unwrap_or(VALUE_NOT_AVAILABLE_U64)))
            .collect();
        if let Some(raw) = v3_buffer
            && gpu.quirks.contains(&Quirk::V3Records32Bytes)
        {
            // The caller's buffer holds `capacity` 24-byte records; the driver writes 32-byte
            // ones. The real driver writes them all; the simulator stops at what fits.
            use vramguard_sim::quirks::{V3_RECORD_24, V3_RECORD_32};
            let bytes = vramguard_sim::quirks::v3_records_32_bytes(&records);
            let fits = capacity * V3_RECORD_24 / V3_RECORD_32 * V3_RECORD_32;
            let n = bytes.len().min(fits);
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), raw, n) };
            return SUCCESS;
        }
        for (i, (&(pid, bytes), p)) in records.iter().zip(&procs).enumerate() {
            write(
                i,
                pid,
                bytes,
                p.mig_ids.unwrap_or((NO_INSTANCE, NO_INSTANCE)),
            );
        }
        SUCCESS
    })
}

/// The `_v2`/`_v3` record (24 bytes).
unsafe fn process_list_v2(
    call: &str,
    device: nvmlDevice_t,
    kind: AllocationKind,
    apply_quirks: bool,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> c_uint {
    unsafe {
        process_list(
            call,
            device,
            kind,
            apply_quirks.then_some(infos.cast::<u8>()),
            count,
            !infos.is_null(),
            |i, pid, bytes, (gi, ci)| {
                *infos.add(i) = nvmlProcessInfo_t {
                    pid,
                    usedGpuMemory: bytes,
                    gpuInstanceId: gi,
                    computeInstanceId: ci,
                }
            },
        )
    }
}

macro_rules! process_list_fn {
    ($name:ident, $kind:expr, $quirks:expr) => {
        /// # Safety
        /// `count` must be writable; `infos` must hold `*count` records or be null.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            count: *mut c_uint,
            infos: *mut nvmlProcessInfo_t,
        ) -> c_uint {
            unsafe { process_list_v2(stringify!($name), device, $kind, $quirks, count, infos) }
        }
    };
}

process_list_fn!(
    nvmlDeviceGetComputeRunningProcesses_v3,
    AllocationKind::Compute,
    true
);
process_list_fn!(
    nvmlDeviceGetGraphicsRunningProcesses_v3,
    AllocationKind::Graphics,
    true
);
process_list_fn!(
    nvmlDeviceGetMPSComputeRunningProcesses_v3,
    AllocationKind::Mps,
    true
);
process_list_fn!(
    nvmlDeviceGetComputeRunningProcesses_v2,
    AllocationKind::Compute,
    false
);
process_list_fn!(
    nvmlDeviceGetGraphicsRunningProcesses_v2,
    AllocationKind::Graphics,
    false
);
process_list_fn!(
    nvmlDeviceGetMPSComputeRunningProcesses_v2,
    AllocationKind::Mps,
    false
);

macro_rules! process_list_v1_fn {
    ($name:ident, $kind:expr) => {
        /// The unversioned call a real driver still exports (NVML before 11.0, and bindings
        /// such as nvidia-ml-py3 that never moved on): 16-byte `{pid, usedGpuMemory}` records.
        ///
        /// # Safety
        /// `count` must be writable; `infos` must hold `*count` records or be null.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            device: nvmlDevice_t,
            count: *mut c_uint,
            infos: *mut nvmlProcessInfo_v1_t,
        ) -> c_uint {
            unsafe {
                process_list(
                    stringify!($name),
                    device,
                    $kind,
                    None,
                    count,
                    !infos.is_null(),
                    |i, pid, bytes, _| {
                        *infos.add(i) = nvmlProcessInfo_v1_t {
                            pid,
                            usedGpuMemory: bytes,
                        }
                    },
                )
            }
        }
    };
}

process_list_v1_fn!(
    nvmlDeviceGetComputeRunningProcesses,
    AllocationKind::Compute
);
process_list_v1_fn!(
    nvmlDeviceGetGraphicsRunningProcesses,
    AllocationKind::Graphics
);

/// # Safety
/// `count` must be writable; `samples` must hold `*count` records or be null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetProcessUtilization(
    device: nvmlDevice_t,
    samples: *mut nvmlProcessUtilizationSample_t,
    count: *mut c_uint,
    last_seen_us: c_ulonglong,
) -> c_uint {
    let counted = samples
        .is_null()
        .then_some("nvmlDeviceGetProcessUtilization");
    with_gpu_counted(counted, device, |_, gpu| {
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        if gpu.mig {
            return NOT_SUPPORTED;
        }
        let fresh: Vec<_> = gpu
            .utilization
            .iter()
            .filter(|u| u.timestamp_us > last_seen_us)
            .collect();
        if fresh.is_empty() {
            return NOT_FOUND;
        }
        let capacity = unsafe { *count } as usize;
        unsafe { *count = fresh.len() as c_uint };
        if samples.is_null() || capacity < fresh.len() {
            return INSUFFICIENT_SIZE;
        }
        for (i, u) in fresh.iter().enumerate() {
            let s = nvmlProcessUtilizationSample_t {
                pid: u.pid,
                timeStamp: u.timestamp_us,
                smUtil: u.sm_util,
                memUtil: u.mem_util,
                encUtil: 0,
                decUtil: 0,
            };
            unsafe { *samples.add(i) = s };
        }
        SUCCESS
    })
}

/// # Safety
/// The four outputs must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRemappedRows(
    device: nvmlDevice_t,
    corr_rows: *mut c_uint,
    unc_rows: *mut c_uint,
    is_pending: *mut c_uint,
    failure_occurred: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetRemappedRows", device, |_, gpu| {
        if corr_rows.is_null()
            || unc_rows.is_null()
            || is_pending.is_null()
            || failure_occurred.is_null()
        {
            return INVALID_ARGUMENT;
        }
        let Some(rows) = gpu.health.remapped_rows else {
            return NOT_SUPPORTED;
        };
        unsafe {
            *corr_rows = rows.correctable;
            *unc_rows = rows.uncorrectable;
            *is_pending = rows.pending as c_uint;
            *failure_occurred = rows.failure as c_uint;
        }
        SUCCESS
    })
}

/// `NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS` (0) or `..._DOUBLE_BIT_ECC_ERROR`
/// (1): the addresses retired for that cause, with the count-then-fill protocol. `call: None`
/// does not count the call (the fill half).
unsafe fn retired_pages(
    call: Option<&str>,
    device: nvmlDevice_t,
    cause: c_uint,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> c_uint {
    with_gpu_counted(call, device, |_, gpu| {
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        // A GPU that remaps rows (Ampere and later) retires no pages: NOT_SUPPORTED before
        // anything else. A null buffer is the count query (count 0), as clients send it.
        let Some(pages) = gpu.health.retired_pages.as_ref() else {
            return NOT_SUPPORTED;
        };
        if addresses.is_null() && unsafe { *count } != 0 {
            return INVALID_ARGUMENT;
        }
        let list = match cause {
            0 => &pages.single_bit_ecc,
            1 => &pages.double_bit_ecc,
            _ => return INVALID_ARGUMENT,
        };
        let capacity = unsafe { *count } as usize;
        unsafe { *count = list.len() as c_uint };
        if capacity < list.len() {
            return INSUFFICIENT_SIZE;
        }
        for (i, a) in list.iter().enumerate() {
            unsafe {
                *addresses.add(i) = *a;
                if !timestamps.is_null() {
                    *timestamps.add(i) = 0;
                }
            }
        }
        SUCCESS
    })
}

/// # Safety
/// `count` must be writable; `addresses` must hold `*count` values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages(
    device: nvmlDevice_t,
    cause: c_uint,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
) -> c_uint {
    unsafe {
        retired_pages(
            Some("nvmlDeviceGetRetiredPages"),
            device,
            cause,
            count,
            addresses,
            std::ptr::null_mut(),
        )
    }
}

/// The fill call nvml-wrapper makes after counting with [`nvmlDeviceGetRetiredPages`].
///
/// # Safety
/// `count` must be writable; `addresses` and `timestamps` must hold `*count` values.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages_v2(
    device: nvmlDevice_t,
    cause: c_uint,
    count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> c_uint {
    unsafe { retired_pages(None, device, cause, count, addresses, timestamps) }
}

/// # Safety
/// `pending` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    device: nvmlDevice_t,
    pending: *mut c_uint,
) -> c_uint {
    with_gpu(
        "nvmlDeviceGetRetiredPagesPendingStatus",
        device,
        |_, gpu| {
            if pending.is_null() {
                return INVALID_ARGUMENT;
            }
            let Some(pages) = gpu.health.retired_pages.as_ref() else {
                return NOT_SUPPORTED;
            };
            unsafe { *pending = pages.pending as c_uint };
            SUCCESS
        },
    )
}

/// `nvmlEventTypeXidCriticalError`: the only event type the simulator raises.
const EVENT_TYPE_XID: u64 = 0x8;

/// An event set: per registered GPU, how many of its Xid events were already delivered.
#[derive(Default)]
struct EventSet {
    cursors: BTreeMap<u32, usize>,
}

/// Event sets by handle, and the next handle.
static EVENT_SETS: Mutex<(usize, BTreeMap<usize, EventSet>)> = Mutex::new((1, BTreeMap::new()));

fn with_event_sets<T>(f: impl FnOnce(&mut usize, &mut BTreeMap<usize, EventSet>) -> T) -> T {
    let mut guard = EVENT_SETS.lock().unwrap_or_else(|p| p.into_inner());
    let (next, sets) = &mut *guard;
    f(next, sets)
}

/// # Safety
/// `set` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut nvmlEventSet_t) -> c_uint {
    with_sim(|_| {
        if set.is_null() {
            return INVALID_ARGUMENT;
        }
        let id = with_event_sets(|next, sets| {
            let id = *next;
            *next += 1;
            sets.insert(id, EventSet::default());
            id
        });
        unsafe { *set = id as nvmlEventSet_t };
        SUCCESS
    })
}

/// # Safety
/// `types` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: nvmlDevice_t,
    types: *mut c_ulonglong,
) -> c_uint {
    with_gpu("nvmlDeviceGetSupportedEventTypes", device, |_, _| {
        if types.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *types = EVENT_TYPE_XID };
        SUCCESS
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: nvmlDevice_t,
    types: c_ulonglong,
    set: nvmlEventSet_t,
) -> c_uint {
    with_gpu("nvmlDeviceRegisterEvents", device, |_, gpu| {
        if types & !EVENT_TYPE_XID != 0 {
            return NOT_SUPPORTED;
        }
        let seen = gpu.health.xid_events.len();
        with_event_sets(|_, sets| match sets.get_mut(&(set as usize)) {
            Some(s) => {
                // Only events raised from now on are delivered.
                s.cursors.insert(gpu.index, seen);
                SUCCESS
            }
            None => INVALID_ARGUMENT,
        })
    })
}

/// One undelivered event of the set, if any: `Ok(None)` when there is none.
fn next_event(set: usize) -> Result<Option<nvmlEventData_t>, u32> {
    let registered: Vec<(u32, usize)> = with_event_sets(|_, sets| match sets.get(&set) {
        Some(s) => Ok(s.cursors.iter().map(|(g, c)| (*g, *c)).collect()),
        None => Err(INVALID_ARGUMENT),
    })?;
    for (gpu, cursor) in registered {
        let mut found = None;
        let code = with_gpu("nvmlEventSetWait_v2", handle_of(gpu as usize), |_, g| {
            found = g.health.xid_events.get(cursor).copied();
            SUCCESS
        });
        if code != SUCCESS {
            return Err(code);
        }
        if let Some(xid) = found {
            with_event_sets(|_, sets| {
                if let Some(s) = sets.get_mut(&set) {
                    s.cursors.insert(gpu, cursor + 1);
                }
            });
            return Ok(Some(nvmlEventData_t {
                device: handle_of(gpu as usize),
                eventType: EVENT_TYPE_XID,
                eventData: xid,
                gpuInstanceId: NO_INSTANCE,
                computeInstanceId: NO_INSTANCE,
            }));
        }
    }
    Ok(None)
}

/// # Safety
/// `data` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: nvmlEventSet_t,
    data: *mut nvmlEventData_t,
    timeout_ms: c_uint,
) -> c_uint {
    if data.is_null() {
        return INVALID_ARGUMENT;
    }
    let deadline = Instant::now() + Duration::from_millis(timeout_ms.into());
    loop {
        match next_event(set as usize) {
            Err(code) => return code,
            Ok(Some(event)) => {
                unsafe { *data = event };
                return SUCCESS;
            }
            Ok(None) if Instant::now() >= deadline => return TIMEOUT,
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: nvmlEventSet_t) -> c_uint {
    with_event_sets(|_, sets| match sets.remove(&(set as usize)) {
        Some(_) => SUCCESS,
        None => INVALID_ARGUMENT,
    })
}

/// `NVML_STRUCT_VERSION(ProcessDetailList, 1)`.
const PROCESS_DETAIL_LIST_V1: u32 =
    (std::mem::size_of::<nvml_wrapper_sys::bindings::nvmlProcessDetailList_v1_t>() as u32)
        | (1 << 24);

/// The process list of drivers from 535.104 on (its presence tells clients such as nvitop
/// that `_v3` writes 24-byte records): 32-byte `nvmlProcessDetail_v1_t` records of the kind
/// `mode` names (0 compute, 1 graphics, 2 MPS).
///
/// # Safety
/// `plist` must be writable; its `procArray` must hold `numProcArrayEntries` records or be
/// null.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRunningProcessDetailList(
    device: nvmlDevice_t,
    plist: *mut nvml_wrapper_sys::bindings::nvmlProcessDetailList_v1_t,
) -> c_uint {
    if plist.is_null() {
        return INVALID_ARGUMENT;
    }
    let list = unsafe { &mut *plist };
    if list.version != PROCESS_DETAIL_LIST_V1 {
        return ARGUMENT_VERSION_MISMATCH;
    }
    let kind = match list.mode {
        0 => AllocationKind::Compute,
        1 => AllocationKind::Graphics,
        2 => AllocationKind::Mps,
        _ => return INVALID_ARGUMENT,
    };
    let array = list.procArray;
    unsafe {
        process_list(
            "nvmlDeviceGetRunningProcessDetailList",
            device,
            kind,
            None,
            &mut list.numProcArrayEntries,
            !array.is_null(),
            |i, pid, bytes, (gi, ci)| {
                *array.add(i) = nvml_wrapper_sys::bindings::nvmlProcessDetail_v1_t {
                    pid,
                    usedGpuMemory: bytes,
                    gpuInstanceId: gi,
                    computeInstanceId: ci,
                    usedGpuCcProtectedMemory: 0,
                }
            },
        )
    }
}

/// Confidential computing is off on the simulated GPUs: `NOT_SUPPORTED`. Exported because the
/// 535 drivers export it (clients look for the symbol to recognise them).
///
/// # Safety
/// `info` is not written.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetConfComputeMemSizeInfo(
    device: nvmlDevice_t,
    info: *mut nvml_wrapper_sys::bindings::nvmlConfComputeMemSizeInfo_t,
) -> c_uint {
    with_gpu("nvmlDeviceGetConfComputeMemSizeInfo", device, |_, _| {
        if info.is_null() {
            return INVALID_ARGUMENT;
        }
        NOT_SUPPORTED
    })
}

/// The most MIG devices the GPU can have: 7 in MIG mode (the H100/H200 and A100 limit), 0
/// otherwise.
///
/// # Safety
/// `count` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxMigDeviceCount(
    device: nvmlDevice_t,
    count: *mut c_uint,
) -> c_uint {
    with_gpu("nvmlDeviceGetMaxMigDeviceCount", device, |_, gpu| {
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *count = if gpu.mig { 7 } else { 0 } };
        SUCCESS
    })
}

/// The handle of MIG device `index`; `NOT_FOUND` for a slot without one, `INVALID_ARGUMENT`
/// on a GPU not in MIG mode (or on a MIG device's own handle).
///
/// # Safety
/// `mig` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigDeviceHandleByIndex(
    device: nvmlDevice_t,
    index: c_uint,
    mig: *mut nvmlDevice_t,
) -> c_uint {
    let (gpu_index, own) = decode_handle(device);
    with_gpu("nvmlDeviceGetMigDeviceHandleByIndex", device, |_, gpu| {
        if mig.is_null() || own.is_some() || !gpu.mig || index >= 7 {
            return INVALID_ARGUMENT;
        }
        if index as usize >= gpu.mig_devices.len() {
            return NOT_FOUND;
        }
        unsafe { *mig = mig_handle_of(gpu_index, index as usize) };
        SUCCESS
    })
}

/// The GPU a MIG device belongs to.
///
/// # Safety
/// `parent` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    mig: nvmlDevice_t,
    parent: *mut nvmlDevice_t,
) -> c_uint {
    let (gpu_index, own) = decode_handle(mig);
    with_gpu(
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
        mig,
        |_, _| {
            if parent.is_null() || own.is_none() {
                return INVALID_ARGUMENT;
            }
            unsafe { *parent = handle_of(gpu_index) };
            SUCCESS
        },
    )
}

/// Whether a handle is a MIG device's.
///
/// # Safety
/// `is_mig` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    device: nvmlDevice_t,
    is_mig: *mut c_uint,
) -> c_uint {
    let own = decode_handle(device).1;
    with_gpu("nvmlDeviceIsMigDeviceHandle", device, |_, _| {
        if is_mig.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *is_mig = c_uint::from(own.is_some()) };
        SUCCESS
    })
}

macro_rules! mig_id_fn {
    ($name:ident, $field:ident) => {
        /// An id of a MIG device; `NOT_SUPPORTED` on a whole GPU's handle.
        ///
        /// # Safety
        /// `id` must be writable.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(device: nvmlDevice_t, id: *mut c_uint) -> c_uint {
            let (_, own) = decode_handle(device);
            let parent = handle_of(decode_handle(device).0);
            with_gpu(stringify!($name), parent, |_, gpu| {
                if id.is_null() {
                    return INVALID_ARGUMENT;
                }
                match own.and_then(|m| gpu.mig_devices.get(m)) {
                    Some(d) => {
                        unsafe { *id = d.$field };
                        SUCCESS
                    }
                    None => NOT_SUPPORTED,
                }
            })
        }
    };
}

mig_id_fn!(nvmlDeviceGetGpuInstanceId, gpu_instance);
mig_id_fn!(nvmlDeviceGetComputeInstanceId, compute_instance);
