//! The state file: which GPUs exist and which processes hold which allocations.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use vramguard_proc::{ProcDir, ProcFs};

/// The whole simulated machine, as written in the state file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimState {
    /// What `nvmlSystemGetDriverVersion` answers.
    #[serde(default = "default_driver_version")]
    pub driver_version: String,
    /// What `nvmlSystemGetNVMLVersion` answers; default `13.<driver_version>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml_version: Option<String>,
    /// Directory holding the stand-in device files `nvidia0..N`, `nvidiactl`, `nvidia-uvm`.
    pub dev_dir: PathBuf,
    /// The `/proc` the driver sees processes through (the host's, also when vramguard itself
    /// runs in a container with another `/proc`).
    #[serde(default = "default_proc_root")]
    pub proc_root: PathBuf,
    /// The GPUs, in NVML index order.
    pub gpus: Vec<SimGpu>,
    /// Device memory held by processes (or left behind by them).
    #[serde(default)]
    pub allocations: Vec<SimAllocation>,
    /// Errors injected into calls that concern no particular GPU (`nvmlInit_v2`,
    /// `nvmlDeviceGetCount_v2`, `nvmlSystemGetDriverVersion`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<Fault>,
    /// NVML clients (the in-process simulator, the simulated `libnvidia-ml.so.1`) keep the
    /// control, unified-memory and GPU device files open from init to shutdown, as driver
    /// 580's NVML does (an H200 snapshot shows `vramguard snapshot` holding all three). Off
    /// by default: on, every running agent is a holder that blocks GPU resets, as it would be
    /// on a real node, which vramguard's resets do not yet account for (see
    /// docs/gpu-results.md).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nvml_client_files: bool,
}

fn default_driver_version() -> String {
    "580.159.03".into()
}

fn default_proc_root() -> PathBuf {
    PathBuf::from(vramguard_proc::OWN_PROC)
}

fn default_true() -> bool {
    true
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimGpu {
    /// `GPU-…` UUID, unique.
    pub uuid: String,
    /// Marketing name.
    #[serde(default = "default_name")]
    pub name: String,
    /// Installed memory.
    pub total_bytes: u64,
    /// Reserved by driver and firmware (neither used nor free).
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Memory an empty GPU reports as used.
    #[serde(default)]
    pub baseline_used_bytes: u64,
    /// `DDDDDDDD:BB:DD.F`.
    pub pci_bus_id: String,
    /// Persistence mode.
    #[serde(default = "default_true")]
    pub persistence_mode: bool,
    /// MIG mode: per-process memory is reported as "not available" and utilization samples
    /// are not supported, as on real drivers.
    #[serde(default)]
    pub mig: bool,
    /// Its MIG devices (MIG mode only): each lists its own processes with their memory, as
    /// NVML's MIG device handles do.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<SimMigDevice>,
    /// Errors injected into calls on this GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults: Vec<Fault>,
    /// Driver bugs to reproduce on this GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub quirks: Vec<Quirk>,
    /// How this GPU's driver tears contexts down: the `after_exit` of allocations registered
    /// by holders that do not choose one (the probe's holders).
    #[serde(default)]
    pub after_exit: AfterExit,
    /// Memory health the driver reports; absent parts answer `NOT_SUPPORTED`.
    #[serde(default)]
    pub health: SimHealth,
}

/// A MIG device: a GPU instance with one compute instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimMigDevice {
    /// The GPU instance id.
    pub gpu_instance: u32,
    /// The compute instance id within it.
    #[serde(default)]
    pub compute_instance: u32,
    /// Its memory.
    pub memory_bytes: u64,
    /// Its profile, e.g. `3g.71gb` (part of its name).
    pub profile: String,
}

/// A GPU's memory health, as NVML reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimHealth {
    /// Row remapping (Ampere and later); `None`: `NOT_SUPPORTED`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remapped_rows: Option<SimRemappedRows>,
    /// Page retirement (before Ampere); `None`: `NOT_SUPPORTED`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retired_pages: Option<SimRetiredPages>,
    /// Critical Xid errors raised on this GPU, oldest first. An event set receives the ones
    /// raised after it registered, as NVML's do.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub xid_events: Vec<u64>,
}

/// `nvmlDeviceGetRemappedRows`' answer. A GPU reset applies a pending remap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimRemappedRows {
    /// Rows remapped after correctable errors.
    #[serde(default)]
    pub correctable: u32,
    /// Rows remapped after uncorrectable errors.
    #[serde(default)]
    pub uncorrectable: u32,
    /// A remap waits for the next reset.
    #[serde(default)]
    pub pending: bool,
    /// A remap failed.
    #[serde(default)]
    pub failure: bool,
}

/// Retired pages, by cause. A GPU reset retires pending pages.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimRetiredPages {
    /// Addresses retired after multiple single-bit ECC errors.
    #[serde(default)]
    pub single_bit_ecc: Vec<u64>,
    /// Addresses retired after a double-bit ECC error.
    #[serde(default)]
    pub double_bit_ecc: Vec<u64>,
    /// Pages wait for a reset.
    #[serde(default)]
    pub pending: bool,
}

fn default_name() -> String {
    "NVIDIA H200".into()
}

impl SimGpu {
    /// A row remap or page retirement waits for a reset.
    pub fn health_pending(&self) -> bool {
        self.health.remapped_rows.is_some_and(|r| r.pending)
            || self
                .health
                .retired_pages
                .as_ref()
                .is_some_and(|p| p.pending)
    }

    /// An NVIDIA H200 (141 GB, 544 MiB reserved) numbered `index`: UUID and PCI bus id are
    /// derived from the index, so every world built from it looks the same.
    pub fn h200(index: u32) -> SimGpu {
        SimGpu {
            uuid: format!(
                "GPU-{:08x}-7d3e-4f1a-9b2c-5e6f7a8b9c0d",
                0x3b1c_0000 + index
            ),
            name: default_name(),
            total_bytes: 150_754_820_096,
            reserved_bytes: 570_425_344,
            baseline_used_bytes: 0,
            pci_bus_id: format!("00000000:{:02X}:00.0", 0x19 + index * 0x10),
            persistence_mode: true,
            mig: false,
            mig_devices: vec![],
            faults: vec![],
            quirks: vec![],
            after_exit: AfterExit::Release,
            // Hopper remaps rows and does not retire pages.
            health: SimHealth {
                remapped_rows: Some(SimRemappedRows::default()),
                ..SimHealth::default()
            },
        }
    }
}

/// Checks the faults of the state (or of one GPU, `prefix` naming it): known calls, real
/// error codes, bounded stalls.
fn check_faults(path: &Path, prefix: &str, faults: &[Fault]) -> Result<(), StateError> {
    let invalid = |field: String, problem: String| StateError::Invalid {
        path: path.to_path_buf(),
        field,
        problem,
    };
    for (i, f) in faults.iter().enumerate() {
        if !FAULTABLE_CALLS.contains(&f.call.as_str()) {
            return Err(invalid(
                format!("{prefix}faults[{i}].call"),
                format!(
                    "unknown NVML call {:?} (known: {})",
                    f.call,
                    FAULTABLE_CALLS.join(", ")
                ),
            ));
        }
        if f.code == 0 && f.delay_ms.is_none() {
            return Err(invalid(
                format!("{prefix}faults[{i}].code"),
                "0 is NVML_SUCCESS, not an error (add delay_ms for a call that only stalls)".into(),
            ));
        }
        if f.delay_ms.is_some_and(|d| d > 600_000) {
            return Err(invalid(
                format!("{prefix}faults[{i}].delay_ms"),
                "at most 600000 (10 minutes)".into(),
            ));
        }
    }
    Ok(())
}

impl SimState {
    /// A state with `gpus` H200s, no allocations, device files in `dev_dir`.
    pub fn with_h200s(dev_dir: PathBuf, gpus: u32) -> SimState {
        SimState {
            driver_version: default_driver_version(),
            nvml_version: None,
            dev_dir,
            proc_root: default_proc_root(),
            gpus: (0..gpus).map(SimGpu::h200).collect(),
            allocations: vec![],
            faults: vec![],
            nvml_client_files: false,
        }
    }
}

/// A driver bug the simulator can reproduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Quirk {
    /// The 535.43–535.98 struct mismatch: the `_v3` process calls write 32-byte records (with
    /// `usedGpuCcProtectedMemory`) into a buffer callers built for the 24-byte struct: the
    /// first record reads right, later ones are misaligned. The `_v2` calls stay correct.
    /// Where the real driver would write past a buffer sized for 24-byte records, the
    /// simulator writes only the whole 32-byte records that fit.
    #[serde(alias = "swapped_v3_process_records")]
    V3Records32Bytes,
}

/// What an allocation does once its process has finished exiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AfterExit {
    /// Freed at once.
    #[default]
    Release,
    /// Freed this many milliseconds after the simulator first saw the process gone: the
    /// driver's teardown lag.
    ReleaseAfterMs(u64),
    /// Never freed until the GPU is reset, and never listed: driver residue.
    Leak,
}

/// Which NVML process list an allocation appears in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AllocationKind {
    /// A compute (CUDA) context.
    #[default]
    Compute,
    /// A graphics context.
    Graphics,
    /// A client of the MPS server.
    Mps,
}

/// A holder's place in the PID namespaces (see [`SimAllocation::namespace`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HolderNamespace {
    /// Its pid in each PID namespace from `proc_root`'s inward (`NSpid`, proc(5)).
    pub nspid: Vec<u32>,
    /// The inode of its own PID namespace (`/proc/PID/ns/pid` reads `pid:[inode]`).
    pub pid_ns: u64,
}

/// Memory one process holds on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimAllocation {
    /// GPU index.
    pub gpu: u32,
    /// The holding process, in `proc_root`'s namespace.
    pub pid: u32,
    /// Size.
    pub bytes: u64,
    /// Which process list it appears in.
    #[serde(default)]
    pub kind: AllocationKind,
    /// What happens after the process exits.
    #[serde(default)]
    pub after_exit: AfterExit,
    /// `false`: the driver does not list it (a context inherited by a forked child, or a
    /// container the driver hides on newer drivers).
    #[serde(default = "default_true")]
    pub listed: bool,
    /// The pid the driver reports instead of `pid` (a pid from another namespace).
    #[serde(default)]
    pub reported_pid: Option<u32>,
    /// SM utilization percent while alive; 0 = idle.
    #[serde(default)]
    pub sm_util: u32,
    /// Memory-controller utilization percent while alive.
    #[serde(default)]
    pub mem_util: u32,
    /// Other processes holding the context's file descriptors (children forked after it was
    /// created, like DataLoader workers), for states written by hand (simulated holders use
    /// `context_lock`): the memory stays while any of them lives, listed under `pid` only,
    /// even after `pid` has exited.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub held_by: Vec<u32>,
    /// On a GPU in MIG mode: the index of the MIG device (in the GPU's `mig_devices`) it is
    /// on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_device: Option<u32>,
    /// The offset of the OFD lock its creator took on `dev_dir/nvidia<gpu>` when it created the
    /// context (see [`crate::context`]); simulated holders set it. With one, the context lives
    /// while that open file description is open in any process (the creator, children it
    /// forked, a process it passed the descriptor to), and is listed under `pid` meanwhile,
    /// even after `pid` has exited, as a real driver does; without one (a state written by
    /// hand), `pid` and `held_by` decide.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_lock: Option<u64>,
    /// Set by simulated holders: where the holder sits in the PID namespaces, as it was when
    /// it registered. A real driver keeps a creator's `struct pid`, so it still names a dead
    /// creator (kept by its forked children) in a caller's namespace; the simulator can read
    /// `/proc` only while the process lives, and uses this afterwards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<HolderNamespace>,
}

/// An error or a stall injected into one NVML call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    /// The NVML function, e.g. `nvmlDeviceGetMemoryInfo_v2`.
    pub call: String,
    /// The `nvmlReturn_t` to return, e.g. 15 (`GPU_IS_LOST`); 0 (success) with `delay_ms`
    /// for a call that only stalls.
    pub code: u32,
    /// Block this long before answering, as a real driver does on a GPU in a bad state
    /// (calls that hang for seconds before `GPU_IS_LOST` or `TIMEOUT`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    /// Succeed this many calls first (counted per process, per GPU).
    #[serde(default)]
    pub after_calls: u64,
    /// Fail this many calls, then succeed again; forever when absent.
    #[serde(default)]
    pub times: Option<u64>,
}

/// The NVML calls a fault may name.
pub const FAULTABLE_CALLS: &[&str] = &[
    "nvmlInit_v2",
    "nvmlSystemGetDriverVersion",
    "nvmlSystemGetNVMLVersion",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetGraphicsRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetProcessUtilization",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceRegisterEvents",
    "nvmlEventSetWait_v2",
];

/// A state file that cannot be used, with the file and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The file could not be read.
    #[error("reading simulator state {path}: {cause}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// The JSON is malformed or has a wrong field (serde names the field, line and column).
    #[error("simulator state {path}: {cause}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The cause, with line and column.
        cause: serde_json::Error,
    },
    /// The JSON is well-formed but inconsistent.
    #[error("simulator state {path}: {field}: {problem}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The offending field, e.g. `allocations[2].gpu`.
        field: String,
        /// What is wrong.
        problem: String,
    },
    /// The file could not be written.
    #[error("writing simulator state {path}: {cause}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
}

impl SimState {
    /// Parses and validates a state document. `path` only names the file in errors.
    pub fn from_json(path: &Path, text: &str) -> Result<SimState, StateError> {
        let state: SimState = serde_json::from_str(text).map_err(|source| StateError::Parse {
            path: path.to_path_buf(),
            cause: source,
        })?;
        state.validate(path)?;
        Ok(state)
    }

    /// Reads and validates a state file.
    pub fn load(path: &Path) -> Result<SimState, StateError> {
        let text = vramguard_fs::read_regular_to_string(path, vramguard_fs::MAX_INPUT_BYTES)
            .map_err(|e| StateError::Read {
                path: path.to_path_buf(),
                cause: e.into_io(),
            })?;
        SimState::from_json(path, &text)
    }

    /// Checks the cross-field rules serde cannot.
    pub fn validate(&self, path: &Path) -> Result<(), StateError> {
        let invalid = |field: String, problem: String| StateError::Invalid {
            path: path.to_path_buf(),
            field,
            problem,
        };
        if self.gpus.is_empty() {
            return Err(invalid("gpus".into(), "at least one GPU is needed".into()));
        }
        check_faults(path, "", &self.faults)?;
        // What the simulated driver answers is printed as a real driver's is: no terminal
        // controls or invisible characters (a real driver's strings have none).
        let printable = |field: String, text: &str| {
            if matches!(
                vramguard_core::sanitize::escape(text),
                std::borrow::Cow::Owned(_)
            ) {
                Err(invalid(
                    field,
                    format!(
                        "{} holds control or invisible characters",
                        vramguard_core::sanitize::shown(text)
                    ),
                ))
            } else {
                Ok(())
            }
        };
        printable("driver_version".into(), &self.driver_version)?;
        for (i, g) in self.gpus.iter().enumerate() {
            printable(format!("gpus[{i}].name"), &g.name)?;
            printable(format!("gpus[{i}].uuid"), &g.uuid)?;
        }
        self.validate_gpus(path)?;
        self.validate_allocations(path)
    }

    /// Each GPU: UUID, bus id, sizes, faults and MIG devices.
    fn validate_gpus(&self, path: &Path) -> Result<(), StateError> {
        let invalid = |field: String, problem: String| StateError::Invalid {
            path: path.to_path_buf(),
            field,
            problem,
        };
        for (i, g) in self.gpus.iter().enumerate() {
            if !g.uuid.starts_with("GPU-") {
                return Err(invalid(
                    format!("gpus[{i}].uuid"),
                    format!("{:?} does not start with \"GPU-\"", g.uuid),
                ));
            }
            if self.gpus[..i].iter().any(|o| o.uuid == g.uuid) {
                return Err(invalid(
                    format!("gpus[{i}].uuid"),
                    format!("{} appears twice", g.uuid),
                ));
            }
            if g.uuid.len() >= 80 || g.name.len() >= 96 {
                return Err(invalid(
                    format!("gpus[{i}]"),
                    "uuid or name too long for NVML's buffers".into(),
                ));
            }
            if !valid_bus_id(&g.pci_bus_id) {
                return Err(invalid(
                    format!("gpus[{i}].pci_bus_id"),
                    format!("{:?} is not of the form 00000000:19:00.0", g.pci_bus_id),
                ));
            }
            if g.total_bytes == 0
                || g.reserved_bytes.saturating_add(g.baseline_used_bytes) > g.total_bytes
            {
                return Err(invalid(
                    format!("gpus[{i}].total_bytes"),
                    "must be positive and at least reserved_bytes + baseline_used_bytes".into(),
                ));
            }
            check_faults(path, &format!("gpus[{i}]."), &g.faults)?;
            let mig_memory: u64 = g.mig_devices.iter().map(|m| m.memory_bytes).sum();
            if mig_memory > g.total_bytes || (!g.mig && !g.mig_devices.is_empty()) {
                return Err(invalid(
                    format!("gpus[{i}].mig_devices"),
                    "MIG devices need `mig: true` and fit in total_bytes".into(),
                ));
            }
        }
        Ok(())
    }

    /// Each allocation: its GPU, pid, size, lock offset, utilization, reported pid and MIG
    /// device.
    fn validate_allocations(&self, path: &Path) -> Result<(), StateError> {
        let invalid = |field: String, problem: String| StateError::Invalid {
            path: path.to_path_buf(),
            field,
            problem,
        };
        // Opened only when a reported pid needs checking against its NSpid.
        let proc = self
            .allocations
            .iter()
            .any(|a| a.reported_pid.is_some())
            .then(|| ProcFs::open(&self.proc_root).ok())
            .flatten();
        for (i, a) in self.allocations.iter().enumerate() {
            let Some(gpu) = self.gpus.get(a.gpu as usize) else {
                return Err(invalid(
                    format!("allocations[{i}].gpu"),
                    format!(
                        "GPU {} does not exist ({} GPU(s) defined)",
                        a.gpu,
                        self.gpus.len()
                    ),
                ));
            };
            if a.pid == 0 {
                return Err(invalid(
                    format!("allocations[{i}].pid"),
                    "must be positive".into(),
                ));
            }
            if a.bytes > gpu.total_bytes {
                return Err(invalid(
                    format!("allocations[{i}].bytes"),
                    format!(
                        "{} exceeds GPU {}'s total_bytes {}",
                        a.bytes, a.gpu, gpu.total_bytes
                    ),
                ));
            }
            if a.context_lock.is_some_and(|l| l >= i64::MAX as u64) {
                return Err(invalid(
                    format!("allocations[{i}].context_lock"),
                    "a lock offset must fit in a file offset (below 2^63 - 1)".into(),
                ));
            }
            if a.sm_util > 100 || a.mem_util > 100 {
                return Err(invalid(
                    format!("allocations[{i}].sm_util"),
                    "utilization is a percentage (0-100)".into(),
                ));
            }
            if let Some(reported) = a.reported_pid
                && let Some(nspid) = proc
                    .as_ref()
                    .and_then(|p| p.namespace_pids(ProcDir::Pid(a.pid)))
                && !nspid.contains(&reported)
            {
                return Err(invalid(
                    format!("allocations[{i}].reported_pid"),
                    format!(
                        "{reported} is not a pid of process {} in any of its PID namespaces \
                         (NSpid {nspid:?}): a driver reports a pid the process has somewhere; run \
                         the holder in a PID namespace and set report_namespace_pid",
                        a.pid
                    ),
                ));
            }
            if let Some(m) = a.mig_device
                && !(gpu.mig && (m as usize) < gpu.mig_devices.len())
            {
                return Err(invalid(
                    format!("allocations[{i}].mig_device"),
                    format!(
                        "GPU {} has no MIG device {m} (MIG {}, {} device(s))",
                        a.gpu,
                        if gpu.mig { "on" } else { "off" },
                        gpu.mig_devices.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The NVML version string.
    pub fn nvml_version(&self) -> String {
        self.nvml_version
            .clone()
            .unwrap_or_else(|| format!("13.{}", self.driver_version))
    }
}

fn valid_bus_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 16
        && b[8] == b':'
        && b[11] == b':'
        && b[14] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 8 | 11 | 14) || c.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{ "driver_version": "580.159.03", "dev_dir": "/tmp/t/dev",
      "gpus": [ { "uuid": "GPU-0a1b", "name": "NVIDIA H200", "total_bytes": 150754820096,
                  "reserved_bytes": 570425344, "baseline_used_bytes": 0,
                  "pci_bus_id": "00000000:19:00.0", "persistence_mode": true,
                  "faults": [ { "call": "nvmlDeviceGetMemoryInfo_v2", "code": 15 } ] } ],
      "allocations": [ { "gpu": 0, "pid": 4121, "bytes": 8589934592, "kind": "compute",
                         "after_exit": "release", "listed": true, "reported_pid": null, "sm_util": 37 },
                       { "gpu": 0, "pid": 4122, "bytes": 1, "after_exit": { "release_after_ms": 1500 } },
                       { "gpu": 0, "pid": 4123, "bytes": 1, "after_exit": "leak" } ] }"#;

    fn p() -> &'static Path {
        Path::new("state.json")
    }

    #[test]
    fn the_documented_example_loads() {
        let s = SimState::from_json(p(), GOOD).unwrap();
        assert_eq!(s.allocations[1].after_exit, AfterExit::ReleaseAfterMs(1500));
        assert_eq!(s.allocations[2].after_exit, AfterExit::Leak);
        assert!(s.allocations[1].listed);
        assert_eq!(s.proc_root, PathBuf::from(vramguard_proc::OWN_PROC));
        assert_eq!(s.nvml_version(), "13.580.159.03");
    }

    #[test]
    fn a_typo_names_the_field_and_line() {
        let bad = GOOD.replace("\"listed\"", "\"lsited\"");
        let e = SimState::from_json(p(), &bad).unwrap_err().to_string();
        assert!(e.contains("state.json"), "{e}");
        assert!(e.contains("unknown field `lsited`"), "{e}");
        assert!(e.contains("line 7"), "{e}");
    }

    #[test]
    fn cross_field_errors_name_the_field() {
        let e = SimState::from_json(
            p(),
            &GOOD.replace("\"gpu\": 0, \"pid\": 4121", "\"gpu\": 3, \"pid\": 4121"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("allocations[0].gpu: GPU 3 does not exist"),
            "{e}"
        );
        let e = SimState::from_json(
            p(),
            &GOOD.replace("nvmlDeviceGetMemoryInfo_v2", "nvmlGetMemory"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("gpus[0].faults[0].call"), "{e}");
        let e = SimState::from_json(p(), &GOOD.replace("00000000:19:00.0", "19:00.0"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpus[0].pci_bus_id"), "{e}");
        let e = SimState::from_json(
            p(),
            &GOOD.replace("\"bytes\": 8589934592", "\"bytes\": 999999999999999"),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("allocations[0].bytes"), "{e}");
    }

    #[test]
    fn truncated_input_is_an_error_not_a_panic() {
        for cut in 0..GOOD.len() {
            if let Some(prefix) = GOOD.get(..cut) {
                assert!(SimState::from_json(p(), prefix).is_err());
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_input_never_panics(s in ".{0,200}") {
            let _ = SimState::from_json(p(), &s);
        }

        #[test]
        fn mutated_input_never_panics(pos in 0usize..900, byte in proptest::num::u8::ANY) {
            let mut bytes = GOOD.as_bytes().to_vec();
            let pos = pos % bytes.len();
            bytes[pos] = byte;
            let text = String::from_utf8_lossy(&bytes);
            let _ = SimState::from_json(p(), &text);
        }
    }
}
