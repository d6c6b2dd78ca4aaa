//! The built-in CUDA holder: allocates device memory through the driver API, loaded with
//! `dlopen` (no CUDA toolkit needed at build time), touches it, optionally forks children that
//! inherit the context (the DataLoader case), reports ready, and waits to be killed.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuDevicePtr = u64;

/// Why the built-in CUDA holder failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// `libcuda.so.1` is not there.
    #[error(
        "libcuda.so.1 could not be loaded ({0}): the built-in holder needs the NVIDIA driver; \
         use --holder-cmd with your own framework, or the simulated driver (--sim)"
    )]
    NotLoaded(libloading::Error),
    /// A driver API function is missing from the library.
    #[error("libcuda.so.1 has no {name}: {cause}")]
    Missing {
        /// The function.
        name: &'static str,
        /// The loader's message.
        cause: libloading::Error,
    },
    /// A driver API call failed.
    #[error("{call} failed: {text} (CUresult {code})")]
    Call {
        /// The function.
        call: &'static str,
        /// `cuGetErrorString`'s text.
        text: String,
        /// The `CUresult`.
        code: c_int,
    },
    /// The PCI bus id has a NUL byte.
    #[error("PCI bus id {0:?} is not a C string")]
    BadBusId(String),
    /// Forking a child or reporting ready failed.
    #[error("{what}: {cause}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// Why.
        cause: std::io::Error,
    },
}

/// Loads `libcuda.so.1`, or says why not.
pub fn load_cuda() -> Result<libloading::Library, CudaError> {
    // SAFETY: loading the CUDA driver library runs its initialisers, which is what it is for.
    unsafe { libloading::Library::new("libcuda.so.1") }.map_err(CudaError::NotLoaded)
}

fn check(lib: &libloading::Library, call: &'static str, r: CuResult) -> Result<(), CudaError> {
    if r == 0 {
        return Ok(());
    }
    let mut msg: *const c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string.
    let text = unsafe {
        match lib.get::<unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult>(
            b"cuGetErrorString\0",
        ) {
            Ok(f) if f(r, &mut msg) == 0 && !msg.is_null() => {
                CStr::from_ptr(msg).to_string_lossy().into_owned()
            }
            _ => "unknown error".into(),
        }
    };
    Err(CudaError::Call {
        call,
        text,
        code: r,
    })
}

/// Allocates `bytes` on the GPU at `pci_bus_id`, forks `children` that inherit the context,
/// prints `ready PID CHILD…` on stdout, then sleeps until killed (or `lifetime_secs`).
pub fn hold(
    pci_bus_id: &str,
    bytes: u64,
    children: u32,
    lifetime_secs: u32,
) -> Result<(), CudaError> {
    let lib = load_cuda()?;
    let missing = |name: &'static str| move |cause| CudaError::Missing { name, cause };
    // SAFETY: the signatures are those of cuda.h (driver API, 64-bit device pointers).
    unsafe {
        let cu_init: libloading::Symbol<unsafe extern "C" fn(c_uint) -> CuResult> =
            lib.get(b"cuInit\0").map_err(missing("cuInit"))?;
        let get_by_bus: libloading::Symbol<
            unsafe extern "C" fn(*mut CuDevice, *const c_char) -> CuResult,
        > = lib
            .get(b"cuDeviceGetByPCIBusId\0")
            .map_err(missing("cuDeviceGetByPCIBusId"))?;
        let retain: libloading::Symbol<unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult> =
            lib.get(b"cuDevicePrimaryCtxRetain\0")
                .map_err(missing("cuDevicePrimaryCtxRetain"))?;
        let set_current: libloading::Symbol<unsafe extern "C" fn(CuContext) -> CuResult> = lib
            .get(b"cuCtxSetCurrent\0")
            .map_err(missing("cuCtxSetCurrent"))?;
        let alloc: libloading::Symbol<unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult> =
            lib.get(b"cuMemAlloc_v2\0")
                .map_err(missing("cuMemAlloc_v2"))?;
        let memset: libloading::Symbol<unsafe extern "C" fn(CuDevicePtr, u8, usize) -> CuResult> =
            lib.get(b"cuMemsetD8_v2\0")
                .map_err(missing("cuMemsetD8_v2"))?;
        let sync: libloading::Symbol<unsafe extern "C" fn() -> CuResult> = lib
            .get(b"cuCtxSynchronize\0")
            .map_err(missing("cuCtxSynchronize"))?;

        check(&lib, "cuInit", cu_init(0))?;
        let bus =
            CString::new(pci_bus_id).map_err(|_| CudaError::BadBusId(pci_bus_id.to_string()))?;
        let mut dev: CuDevice = 0;
        check(
            &lib,
            "cuDeviceGetByPCIBusId",
            get_by_bus(&mut dev, bus.as_ptr()),
        )?;
        let mut ctx: CuContext = std::ptr::null_mut();
        check(&lib, "cuDevicePrimaryCtxRetain", retain(&mut ctx, dev))?;
        check(&lib, "cuCtxSetCurrent", set_current(ctx))?;
        let mut ptr: CuDevicePtr = 0;
        check(&lib, "cuMemAlloc_v2", alloc(&mut ptr, bytes as usize))?;
        // Touch every byte: lazily backed memory would not show in NVML.
        check(&lib, "cuMemsetD8_v2", memset(ptr, 0xA5, bytes as usize))?;
        check(&lib, "cuCtxSynchronize", sync())?;
    }
    let mut pids = Vec::new();
    for _ in 0..children {
        // SAFETY: the child only makes async-signal-safe calls (the parent has driver threads).
        match unsafe { libc::fork() } {
            0 => unsafe {
                libc::alarm(lifetime_secs.max(1));
                loop {
                    libc::pause();
                }
            },
            -1 => {
                return Err(CudaError::Os {
                    what: "fork",
                    cause: std::io::Error::last_os_error(),
                });
            }
            pid => pids.push(pid.to_string()),
        }
    }
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let reporting = |cause| CudaError::Os {
        what: "reporting ready on stdout",
        cause,
    };
    writeln!(out, "ready {} {}", std::process::id(), pids.join(" ")).map_err(reporting)?;
    out.flush().map_err(reporting)?;
    drop(out);
    // SAFETY: alarm and pause.
    unsafe {
        libc::alarm(lifetime_secs.max(1));
        loop {
            libc::pause();
        }
    }
}
