//! Every function the simulator's library exports has exactly the signature NVIDIA's header
//! gives it (as `nvml-wrapper-sys`'s bindings, generated from `nvml.h`, declare it): the
//! check is the type checker's, so an ABI slip fails the build. A test makes sure no exported
//! function escapes the list.

use nvml_wrapper_sys::bindings::NvmlLib;
use vramguard_sim_nvml::*;

/// Compiles only when `ours` coerces to the pointer type the bindings hold for that symbol.
fn same<T>(_: &Result<T, libloading::Error>, _ours: T) {}

macro_rules! checked {
    ($($name:ident),* $(,)?) => {
        /// Never called: compiling it is the check.
        #[allow(dead_code)]
        fn signatures_are_those_of_nvml_h(lib: &NvmlLib) {
            $( same(&lib.$name, $name); )*
        }
        const CHECKED: &[&str] = &[$(stringify!($name)),*];
    };
}

checked!(
    nvmlDeviceGetAccountingBufferSize,
    nvmlDeviceGetAccountingMode,
    nvmlDeviceGetArchitecture,
    nvmlDeviceGetBAR1MemoryInfo,
    nvmlDeviceGetBoardId,
    nvmlDeviceGetBoardPartNumber,
    nvmlDeviceGetBrand,
    nvmlDeviceGetBusType,
    nvmlDeviceGetClockInfo,
    nvmlDeviceGetComputeInstanceId,
    nvmlDeviceGetComputeMode,
    nvmlDeviceGetComputeRunningProcesses,
    nvmlDeviceGetComputeRunningProcesses_v2,
    nvmlDeviceGetComputeRunningProcesses_v3,
    nvmlDeviceGetConfComputeMemSizeInfo,
    nvmlDeviceGetCount_v2,
    nvmlDeviceGetCudaComputeCapability,
    nvmlDeviceGetCurrPcieLinkGeneration,
    nvmlDeviceGetCurrPcieLinkWidth,
    nvmlDeviceGetCurrentClocksEventReasons,
    nvmlDeviceGetCurrentClocksThrottleReasons,
    nvmlDeviceGetDecoderUtilization,
    nvmlDeviceGetDefaultEccMode,
    nvmlDeviceGetDeviceHandleFromMigDeviceHandle,
    nvmlDeviceGetDisplayActive,
    nvmlDeviceGetDisplayMode,
    nvmlDeviceGetDriverModel,
    nvmlDeviceGetDriverModel_v2,
    nvmlDeviceGetEccMode,
    nvmlDeviceGetEncoderUtilization,
    nvmlDeviceGetEnforcedPowerLimit,
    nvmlDeviceGetFanSpeed,
    nvmlDeviceGetGpuInstanceId,
    nvmlDeviceGetGraphicsRunningProcesses,
    nvmlDeviceGetGraphicsRunningProcesses_v2,
    nvmlDeviceGetGraphicsRunningProcesses_v3,
    nvmlDeviceGetHandleByIndex_v2,
    nvmlDeviceGetHandleByUUID,
    nvmlDeviceGetIndex,
    nvmlDeviceGetInforomImageVersion,
    nvmlDeviceGetIrqNum,
    nvmlDeviceGetJpgUtilization,
    nvmlDeviceGetMPSComputeRunningProcesses_v2,
    nvmlDeviceGetMPSComputeRunningProcesses_v3,
    nvmlDeviceGetMaxClockInfo,
    nvmlDeviceGetMaxMigDeviceCount,
    nvmlDeviceGetMaxPcieLinkGeneration,
    nvmlDeviceGetMaxPcieLinkWidth,
    nvmlDeviceGetMemoryBusWidth,
    nvmlDeviceGetMemoryInfo,
    nvmlDeviceGetMemoryInfo_v2,
    nvmlDeviceGetMigDeviceHandleByIndex,
    nvmlDeviceGetMigMode,
    nvmlDeviceGetMinorNumber,
    nvmlDeviceGetMultiGpuBoard,
    nvmlDeviceGetName,
    nvmlDeviceGetNumFans,
    nvmlDeviceGetNumGpuCores,
    nvmlDeviceGetNumaNodeId,
    nvmlDeviceGetOfaUtilization,
    nvmlDeviceGetPciInfo_v3,
    nvmlDeviceGetPcieReplayCounter,
    nvmlDeviceGetPcieSpeed,
    nvmlDeviceGetPcieThroughput,
    nvmlDeviceGetPerformanceState,
    nvmlDeviceGetPersistenceMode,
    nvmlDeviceGetPowerManagementDefaultLimit,
    nvmlDeviceGetPowerManagementLimit,
    nvmlDeviceGetPowerManagementLimitConstraints,
    nvmlDeviceGetPowerState,
    nvmlDeviceGetPowerUsage,
    nvmlDeviceGetProcessUtilization,
    nvmlDeviceGetRemappedRows,
    nvmlDeviceGetRetiredPages,
    nvmlDeviceGetRetiredPagesPendingStatus,
    nvmlDeviceGetRetiredPages_v2,
    nvmlDeviceGetRunningProcessDetailList,
    nvmlDeviceGetSerial,
    nvmlDeviceGetSupportedClocksEventReasons,
    nvmlDeviceGetSupportedClocksThrottleReasons,
    nvmlDeviceGetSupportedEventTypes,
    nvmlDeviceGetTemperature,
    nvmlDeviceGetTemperatureV,
    nvmlDeviceGetTotalEccErrors,
    nvmlDeviceGetTotalEnergyConsumption,
    nvmlDeviceGetUUID,
    nvmlDeviceGetUtilizationRates,
    nvmlDeviceGetVbiosVersion,
    nvmlDeviceGetVirtualizationMode,
    nvmlDeviceIsMigDeviceHandle,
    nvmlDeviceRegisterEvents,
    nvmlErrorString,
    nvmlEventSetCreate,
    nvmlEventSetFree,
    nvmlEventSetWait_v2,
    nvmlInit,
    nvmlInitWithFlags,
    nvmlInit_v2,
    nvmlShutdown,
    nvmlSystemGetCudaDriverVersion,
    nvmlSystemGetCudaDriverVersion_v2,
    nvmlSystemGetDriverVersion,
    nvmlSystemGetNVMLVersion,
    nvmlSystemGetProcessName,
);

#[test]
fn every_exported_function_has_its_signature_checked() {
    let lib = vramguard_testkit::sim_nvml_lib();
    let out = std::process::Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("run nm (binutils)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exported: std::collections::BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("nvml"))
        .map(str::to_string)
        .collect();
    let checked: std::collections::BTreeSet<String> =
        CHECKED.iter().map(|s| s.to_string()).collect();
    let unchecked: Vec<_> = exported.difference(&checked).collect();
    assert!(
        unchecked.is_empty(),
        "exported without a signature check (add them to checked!): {unchecked:?}"
    );
    assert!(exported.len() >= 104, "{exported:?}");
}
