//! System queries beyond the driver version: confidential computing (off), the driver
//! branch, HIC (none: no host interface card on an HGX node).

use crate::device_queries::struct_version;
use crate::{ARGUMENT_VERSION_MISMATCH, INVALID_ARGUMENT, NOT_SUPPORTED, SUCCESS, with_sim};
use nvml_wrapper_sys::bindings::*;
use std::ffi::{c_char, c_uint};

/// The CPU has no confidential-computing capability on the simulated node; the GPUs
/// (Hopper) have one (`NVML_CC_SYSTEM_GPUS_CC_CAPABLE`).
///
/// # Safety
/// `caps` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetConfComputeCapabilities(
    caps: *mut nvmlConfComputeSystemCaps_t,
) -> c_uint {
    with_sim(|_| {
        if caps.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe {
            *caps = nvmlConfComputeSystemCaps_t {
                cpuCaps: 0,
                gpusCaps: 1,
            }
        };
        SUCCESS
    })
}

/// Confidential computing is off: no environment, feature off, dev tools off.
///
/// # Safety
/// `state` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetConfComputeState(
    state: *mut nvmlConfComputeSystemState_t,
) -> c_uint {
    with_sim(|_| {
        if state.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *state = std::mem::zeroed() };
        SUCCESS
    })
}

/// The same, in the versioned settings form (multi-GPU protected PCIe off).
///
/// # Safety
/// `settings` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetConfComputeSettings(
    settings: *mut nvmlSystemConfComputeSettings_t,
) -> c_uint {
    with_sim(|_| unsafe {
        if settings.is_null() {
            return INVALID_ARGUMENT;
        }
        if (*settings).version != struct_version::<nvmlSystemConfComputeSettings_v1_t>(1) {
            return ARGUMENT_VERSION_MISMATCH;
        }
        let s = &mut *settings;
        s.environment = 0;
        s.ccFeature = 0;
        s.devToolsMode = 0;
        s.multiGpuMode = 0;
        SUCCESS
    })
}

/// GPUs are not marked ready for confidential work (`NVML_CC_ACCEPTING_CLIENT_REQUESTS_FALSE`).
///
/// # Safety
/// `ready` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetConfComputeGpusReadyState(ready: *mut c_uint) -> c_uint {
    with_sim(|_| {
        if ready.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *ready = 0 };
        SUCCESS
    })
}

/// Key rotation thresholds exist only with confidential computing on: `NOT_SUPPORTED`.
///
/// # Safety
/// Nothing is written.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetConfComputeKeyRotationThresholdInfo(
    _info: *mut nvmlConfComputeGetKeyRotationThresholdInfo_t,
) -> c_uint {
    with_sim(|_| NOT_SUPPORTED)
}

/// The driver branch, from the driver version: 580.x is branch `r580_00`.
///
/// # Safety
/// `info` must be writable with its version set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverBranch(
    info: *mut nvmlSystemDriverBranchInfo_t,
    length: c_uint,
) -> c_uint {
    with_sim(|sim| unsafe {
        if info.is_null() {
            return INVALID_ARGUMENT;
        }
        if (*info).version != struct_version::<nvmlSystemDriverBranchInfo_v1_t>(1) {
            return ARGUMENT_VERSION_MISMATCH;
        }
        let major = sim
            .state()
            .driver_version
            .split('.')
            .next()
            .unwrap_or("0")
            .to_string();
        let branch = format!("r{major}_00");
        let room = (length as usize).min((*info).branch.len());
        crate::write_c_string(
            &branch,
            (*info).branch.as_mut_ptr().cast::<c_char>(),
            room as c_uint,
        )
    })
}

/// No host interface card: count 0.
///
/// # Safety
/// `count` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetHicVersion(
    count: *mut c_uint,
    _info: *mut nvmlHwbcEntry_t,
) -> c_uint {
    with_sim(|_| {
        if count.is_null() {
            return INVALID_ARGUMENT;
        }
        unsafe { *count = 0 };
        SUCCESS
    })
}

/// NVLink bandwidth modes are a Blackwell feature: `NOT_SUPPORTED`.
///
/// # Safety
/// Nothing is written.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNvlinkBwMode(_mode: *mut c_uint) -> c_uint {
    with_sim(|_| NOT_SUPPORTED)
}
