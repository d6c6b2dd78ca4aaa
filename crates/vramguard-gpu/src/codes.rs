//! NVML return codes and their messages, shared by the cdylib and the in-process source so
//! that both say exactly the same thing.

/// `NVML_SUCCESS`.
pub const SUCCESS: u32 = 0;
/// `NVML_ERROR_UNINITIALIZED`.
pub const UNINITIALIZED: u32 = 1;
/// `NVML_ERROR_INVALID_ARGUMENT`.
pub const INVALID_ARGUMENT: u32 = 2;
/// `NVML_ERROR_NOT_SUPPORTED`.
pub const NOT_SUPPORTED: u32 = 3;
/// `NVML_ERROR_NO_PERMISSION`.
pub const NO_PERMISSION: u32 = 4;
/// `NVML_ERROR_NOT_FOUND`.
pub const NOT_FOUND: u32 = 6;
/// `NVML_ERROR_INSUFFICIENT_SIZE`.
pub const INSUFFICIENT_SIZE: u32 = 7;
/// `NVML_ERROR_DRIVER_NOT_LOADED`.
pub const DRIVER_NOT_LOADED: u32 = 9;
/// `NVML_ERROR_TIMEOUT`.
pub const TIMEOUT: u32 = 10;
/// `NVML_ERROR_GPU_IS_LOST`.
pub const GPU_IS_LOST: u32 = 15;
/// `NVML_ERROR_IN_USE`.
pub const IN_USE: u32 = 19;
/// `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`.
pub const ARGUMENT_VERSION_MISMATCH: u32 = 25;
/// `NVML_ERROR_UNKNOWN`.
pub const UNKNOWN: u32 = 999;
/// `NVML_VALUE_NOT_AVAILABLE` for 64-bit values.
pub const VALUE_NOT_AVAILABLE_U64: u64 = u64::MAX;
/// `0xFFFFFFFF`: the GPU/compute instance id when MIG is off.
pub const NO_INSTANCE: u32 = u32::MAX;

/// `nvmlErrorString`'s text for a code, NUL-terminated for the C ABI.
pub fn error_string(code: u32) -> &'static str {
    match code {
        0 => "Success\0",
        1 => "Uninitialized\0",
        2 => "Invalid Argument\0",
        3 => "Not Supported\0",
        4 => "Insufficient Permissions\0",
        5 => "Already Initialized\0",
        6 => "Not Found\0",
        7 => "Insufficient Size\0",
        8 => "Insufficient External Power\0",
        9 => "Driver Not Loaded\0",
        10 => "Timeout\0",
        11 => "Interrupt request issue\0",
        12 => "NVML Shared Library Not Found\0",
        13 => "Function Not Found\0",
        14 => "Corrupted infoROM\0",
        15 => "GPU is lost\0",
        16 => "GPU requires restart\0",
        17 => "The operating system has blocked the request.\0",
        18 => "RM has detected an NVML/RM version mismatch.\0",
        19 => "In use by another client\0",
        20 => "Insufficient Memory\0",
        21 => "No data\0",
        22 => {
            "The requested vgpu operation is not available on target device, becasue ECC is enabled\0"
        }
        23 => "Insufficient Resources\0",
        24 => "Frequency not supported\0",
        25 => "Argument version mismatch\0",
        26 => "Deprecated\0",
        27 => "Not Ready\0",
        28 => "GPU not found\0",
        29 => "Invalid state\0",
        _ => "Unknown Error\0",
    }
}

/// The message without the trailing NUL.
pub fn message(code: u32) -> &'static str {
    error_string(code).trim_end_matches('\0')
}
