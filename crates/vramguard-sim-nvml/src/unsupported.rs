//! Queries an H100/H200 on a bare-metal 580 driver answers with `NOT_SUPPORTED`: vGPU on a
//! physical GPU, fans on an SXM module, clock tuning, features of other products and later
//! platforms, accounting while its mode is off, confidential-computing data while it is off.
//! Each answers as NVML does after checking its handle (`INVALID_ARGUMENT` for a bad one,
//! injected faults first).

use crate::{NOT_SUPPORTED, with_gpu};
use nvml_wrapper_sys::bindings::*;
use std::ffi::{c_char, c_int, c_uint, c_ulong, c_ulonglong};

/// Exports each named function with its `nvml.h` signature; the string is the reason, shared
/// by the group.
macro_rules! not_supported {
    ($why:literal, $($name:ident($($arg:ident: $ty:ty),*);)+) => {
        $(
            #[doc = $why]
            ///
            /// # Safety
            /// Nothing is written; `device` may be any value.
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name(device: nvmlDevice_t, $($arg: $ty),*) -> c_uint {
                $(let _ = $arg;)*
                with_gpu(stringify!($name), device, |_, _| NOT_SUPPORTED)
            }
        )+
    };
}

not_supported!(
    "vGPU: this is the bare-metal driver, not NVIDIA's vGPU host driver, and NVML answers \
     `NOT_SUPPORTED` to every vGPU query of a physical GPU.",
    nvmlDeviceGetActiveVgpus(vgpu_count: *mut c_uint, vgpu_instances: *mut nvmlVgpuInstance_t);
    nvmlDeviceGetCreatableVgpus(vgpu_count: *mut c_uint, vgpu_type_ids: *mut nvmlVgpuTypeId_t);
    nvmlDeviceGetSupportedVgpus(vgpu_count: *mut c_uint, vgpu_type_ids: *mut nvmlVgpuTypeId_t);
    nvmlDeviceGetVgpuCapabilities(capability: nvmlDeviceVgpuCapability_t, cap_result: *mut c_uint);
    nvmlDeviceGetVgpuHeterogeneousMode(p_heterogeneous_mode: *mut nvmlVgpuHeterogeneousMode_t);
    nvmlDeviceGetVgpuInstancesUtilizationInfo(vgpu_util_info: *mut nvmlVgpuInstancesUtilizationInfo_t);
    nvmlDeviceGetVgpuMetadata(pgpu_metadata: *mut nvmlVgpuPgpuMetadata_t, buffer_size: *mut c_uint);
    nvmlDeviceGetVgpuProcessUtilization(last_seen_time_stamp: c_ulonglong, vgpu_process_samples_count: *mut c_uint, utilization_samples: *mut nvmlVgpuProcessUtilizationSample_t);
    nvmlDeviceGetVgpuProcessesUtilizationInfo(vgpu_proc_util_info: *mut nvmlVgpuProcessesUtilizationInfo_t);
    nvmlDeviceGetVgpuSchedulerCapabilities(p_capabilities: *mut nvmlVgpuSchedulerCapabilities_t);
    nvmlDeviceGetVgpuSchedulerLog(p_scheduler_log: *mut nvmlVgpuSchedulerLog_t);
    nvmlDeviceGetVgpuSchedulerState(p_scheduler_state: *mut nvmlVgpuSchedulerGetState_t);
    nvmlDeviceGetVgpuTypeCreatablePlacements(vgpu_type_id: nvmlVgpuTypeId_t, p_placement_list: *mut nvmlVgpuPlacementList_t);
    nvmlDeviceGetVgpuTypeSupportedPlacements(vgpu_type_id: nvmlVgpuTypeId_t, p_placement_list: *mut nvmlVgpuPlacementList_t);
    nvmlDeviceGetVgpuUtilization(last_seen_time_stamp: c_ulonglong, sample_val_type: *mut nvmlValueType_t, vgpu_instance_samples_count: *mut c_uint, utilization_samples: *mut nvmlVgpuInstanceUtilizationSample_t);
    nvmlDeviceGetPgpuMetadataString(pgpu_metadata: *mut c_char, buffer_size: *mut c_uint);
    nvmlDeviceGetHostVgpuMode(p_host_vgpu_mode: *mut nvmlHostVgpuMode_t);
    nvmlVgpuTypeGetMaxInstances(vgpu_type_id: nvmlVgpuTypeId_t, vgpu_instance_count: *mut c_uint);
    nvmlDeviceGetGridLicensableFeatures_v4(p_grid_licensable_features: *mut nvmlGridLicensableFeatures_t);
);
not_supported!(
    "Fans: an H100/H200 SXM module has no fan of its own (`nvmlDeviceGetNumFans` answers 0; \
     the chassis cools it), so fan queries answer `NOT_SUPPORTED` (the speed of a fan, \
     `nvmlDeviceGetFanSpeed` and `_v2`, answers `INVALID_ARGUMENT` on an H200: see \
     `device_info.rs`).",
    nvmlDeviceGetFanSpeedRPM(fan_speed: *mut nvmlFanSpeedInfo_t);
    nvmlDeviceGetTargetFanSpeed(fan: c_uint, target_speed: *mut c_uint);
    nvmlDeviceGetMinMaxFanSpeed(min_speed: *mut c_uint, max_speed: *mut c_uint);
    nvmlDeviceGetFanControlPolicy_v2(fan: c_uint, policy: *mut nvmlFanControlPolicy_t);
    nvmlDeviceGetCoolerInfo(cooler_info: *mut nvmlCoolerInfo_t);
);
not_supported!(
    "Clock tuning a data-centre GPU does not offer: auto boost (`nvidia-smi -q` shows N/A), \
     PowerMizer, and GPC/memory clock offsets: `NOT_SUPPORTED`.",
    nvmlDeviceGetAutoBoostedClocksEnabled(is_enabled: *mut nvmlEnableState_t, default_is_enabled: *mut nvmlEnableState_t);
    nvmlDeviceGetPowerMizerMode_v1(power_mizer_mode: *mut nvmlDevicePowerMizerModes_v1_t);
    nvmlDeviceGetGpcClkVfOffset(offset: *mut c_int);
    nvmlDeviceGetMemClkVfOffset(offset: *mut c_int);
    nvmlDeviceGetGpcClkMinMaxVfOffset(min_offset: *mut c_int, max_offset: *mut c_int);
    nvmlDeviceGetMemClkMinMaxVfOffset(min_offset: *mut c_int, max_offset: *mut c_int);
    nvmlDeviceGetClockOffsets(info: *mut nvmlClockOffset_t);
);
not_supported!(
    "Features of other products: GPU operation modes (Kepler Tesla and GeForce), the power \
     source (laptops), a bridge chip (multi-GPU boards), the video encoder's capacity (Hopper \
     data-centre GPUs have no NVENC): `NOT_SUPPORTED`.",
    nvmlDeviceGetGpuOperationMode(current: *mut nvmlGpuOperationMode_t, pending: *mut nvmlGpuOperationMode_t);
    nvmlDeviceGetPowerSource(power_source: *mut nvmlPowerSource_t);
    nvmlDeviceGetBridgeChipInfo(bridge_hierarchy: *mut nvmlBridgeChipHierarchy_t);
    nvmlDeviceGetEncoderCapacity(encoder_query_type: nvmlEncoderType_t, encoder_capacity: *mut c_uint);
);
not_supported!(
    "Features of later or other platforms: C2C links (Grace Hopper, Grace Blackwell), DRAM \
     encryption, platform info, SRAM ECC error status and counts, NVLink bandwidth modes and \
     repair status (Blackwell): `NOT_SUPPORTED` on an x86 H100/H200.",
    nvmlDeviceGetC2cModeInfoV(c2c_mode_info: *mut nvmlC2cModeInfo_v1_t);
    nvmlDeviceGetDramEncryptionMode(current: *mut nvmlDramEncryptionInfo_t, pending: *mut nvmlDramEncryptionInfo_t);
    nvmlDeviceGetPlatformInfo(platform_info: *mut nvmlPlatformInfo_t);
    nvmlDeviceGetSramEccErrorStatus(status: *mut nvmlEccSramErrorStatus_t);
    nvmlDeviceGetSramUniqueUncorrectedEccErrorCounts(error_counts: *mut nvmlEccSramUniqueUncorrectedErrorCounts_t);
    nvmlDeviceGetNvlinkBwMode(get_bw_mode: *mut nvmlNvlinkGetBwMode_t);
    nvmlDeviceGetNvlinkSupportedBwModes(supported_bw_mode: *mut nvmlNvlinkSupportedBwModes_t);
    nvmlDeviceGetRepairStatus(repair_status: *mut nvmlRepairStatus_t);
    nvmlDeviceGetPdi(pdi: *mut nvmlPdi_t);
);
not_supported!(
    "Accounting: the state's GPUs run with accounting mode off (`nvmlDeviceGetAccountingMode` \
     answers 0), and NVML answers `NOT_SUPPORTED` for accounting data then.",
    nvmlDeviceGetAccountingPids(count: *mut c_uint, pids: *mut c_uint);
    nvmlDeviceGetAccountingStats(pid: c_uint, stats: *mut nvmlAccountingStats_t);
);
not_supported!(
    "Confidential computing is off on the simulated node (`nvmlSystemGetConfComputeState`): \
     attestation data and protected memory answer `NOT_SUPPORTED`.",
    nvmlDeviceGetConfComputeGpuCertificate(gpu_cert: *mut nvmlConfComputeGpuCertificate_t);
    nvmlDeviceGetConfComputeProtectedMemoryUsage(memory: *mut nvmlMemory_t);
    nvmlDeviceGetConfComputeGpuAttestationReport(gpu_atst_report: *mut nvmlConfComputeGpuAttestationReport_t);
);
not_supported!(
    "Deprecated NVLink counters: NVLink throughput comes through field values since Ampere, \
     and these answer `NOT_SUPPORTED`.",
    nvmlDeviceGetNvLinkUtilizationCounter(link: c_uint, counter: c_uint, rxcounter: *mut c_ulonglong, txcounter: *mut c_ulonglong);
    nvmlDeviceGetNvLinkUtilizationControl(link: c_uint, counter: c_uint, control: *mut nvmlNvLinkUtilizationControl_t);
);
not_supported!(
    "The BBX flush time: `nvidia-smi -q` shows N/A for it on H100 nodes.",
    nvmlDeviceGetLastBBXFlushTime(timestamp: *mut c_ulonglong, duration_us: *mut c_ulong);
);
