//! The raw facts one collection gathered: what the driver said about each GPU and what `/proc`
//! said about the processes that matter. Nothing here is derived; [`crate::classify`] derives.
//!
//! Every fact the kernel or the driver may refuse is an `Option` (or an explicit "unknown"
//! variant), because "the driver failed" and "0 bytes" must never look alike.

use serde::{Deserialize, Serialize};

/// One collection: the driver's view of every GPU and the process facts needed to explain it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Wall-clock time of the collection, milliseconds since the Unix epoch.
    pub taken_at_ms: u64,
    /// Facts about the machine and about vramguard itself.
    pub host: HostFacts,
    /// Which driver (or simulator) answered, and its versions.
    pub driver: DriverFacts,
    /// One entry per GPU the driver enumerated, in NVML index order.
    pub gpus: Vec<GpuSample>,
    /// Processes relevant to the GPUs: every holder, their parents, their process-group
    /// leaders and the supervisors their `vramguard run` cgroups name, when those still exist. A pid referenced by a holder (its pgid, its parent) that
    /// is absent from this list did not exist at collection time.
    pub processes: Vec<ProcessFacts>,
    /// Processes that held a GPU (or led a holder's job) in an earlier collection and have
    /// since exited; lets evidence name a dead job leader's command. Empty for one-shot runs.
    #[serde(default)]
    pub departed: Vec<DepartedProcess>,
    /// How the process facts were gathered, and what could not be seen.
    pub scan: ScanFacts,
    /// CPU and scheduler observations of the holders over a sampling window: the evidence of
    /// whether a holder is still working. `None` when no window was sampled (`--sample 0`).
    #[serde(default)]
    pub work: Option<WorkWindow>,
    /// What the cgroup filesystem says about the job cgroups (containers, pods, Slurm jobs)
    /// the holders live in: whether their init or step daemon still lives.
    #[serde(default)]
    pub job_cgroups: Vec<JobCgroupFacts>,
    /// The pods the kubelet's pod-resources API lists, with the NVIDIA devices of each
    /// container; `None` when no kubelet was asked (no process in a pod cgroup, or no socket).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubelet_pods: Option<Vec<KubePod>>,
    /// Host memory and shared-memory segments; `None` in snapshots taken without them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<crate::host::HostMemoryFacts>,
}

/// Observations of processes over a window of time, taken by the sampler.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkWindow {
    /// Start of the window, milliseconds since the Unix epoch.
    pub since_ms: u64,
    /// End of the window.
    pub until_ms: u64,
    /// One entry per process observed at least twice in the window.
    pub processes: Vec<WorkSample>,
}

impl WorkWindow {
    /// A window of `observed_ms` from the snapshot's time in which every process of `snap`
    /// was seen doing nothing: for snapshots built by hand (tests, examples).
    pub fn all_idle(snap: &Snapshot, observed_ms: u64) -> WorkWindow {
        WorkWindow {
            since_ms: snap.taken_at_ms,
            until_ms: snap.taken_at_ms + observed_ms,
            processes: snap
                .processes
                .iter()
                .filter_map(|p| {
                    Some(WorkSample {
                        pid: p.pid,
                        start_ticks: p.start_ticks?,
                        cpu_ticks: 0,
                        observed_ms,
                        observations: 5,
                        running_observations: 0,
                        waiting_observations: 0,
                    })
                })
                .collect(),
        }
    }
}

/// What the sampler saw of one process over a [`WorkWindow`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkSample {
    /// Pid.
    pub pid: u32,
    /// Start time in clock ticks: the observations belong to this exact process.
    pub start_ticks: u64,
    /// CPU time (user + system, every thread: proc(5) `stat` fields 14 and 15) used between
    /// the first and the last observation, in clock ticks.
    pub cpu_ticks: u64,
    /// Milliseconds between the first and the last observation.
    pub observed_ms: u64,
    /// How many times it was observed.
    pub observations: u32,
    /// In how many observations at least one of its threads was running (state R).
    pub running_observations: u32,
    /// In how many observations at least one of its threads was in uninterruptible sleep
    /// (state D): I/O in progress (a checkpoint written to a slow filesystem) or a thread
    /// stuck in the driver. Mostly so, its work is unknown: never idle, never working.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub waiting_observations: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A job cgroup (container, pod, Slurm job) and the processes in it that keep the job alive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobCgroupFacts {
    /// The job's root cgroup path (as in `/proc/PID/cgroup`), e.g.
    /// `/system.slice/slurmstepd.scope/job_42`.
    pub root: String,
    /// Whether the cgroup directory could be read; `false` leaves the job's liveness unknown.
    pub readable: bool,
    /// Processes found in the subtree (bounded).
    pub members: u32,
    /// Live members that are the init (pid 1) of a nested PID namespace: a container's init.
    #[serde(default)]
    pub namespace_inits: Vec<u32>,
    /// Live members whose command is `slurmstepd`: a Slurm step daemon.
    #[serde(default)]
    pub step_daemons: Vec<u32>,
    /// Whether some member lives in a nested PID namespace (a container with its own PID
    /// namespace), as opposed to sharing the host's.
    #[serde(default)]
    pub nested_pid_namespace: bool,
    /// Whether every member was looked at: a subtree larger than the collector's bounds
    /// (directories, pids, members inspected) or a member unreadable leaves it `false`, and
    /// no daemon found then proves nothing. Snapshots taken before vramguard recorded it
    /// read as complete.
    #[serde(default = "read_whole")]
    pub complete: bool,
    /// The owner of the job's cgroup directory (the highest uid where hierarchies disagree).
    /// Slurm makes a job's directory as root; one that another user made (in a subtree
    /// delegated to them) only took a Slurm job's name. Snapshots taken before vramguard
    /// recorded it have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_uid: Option<u32>,
}

fn read_whole() -> bool {
    true
}

/// The executable of a process (`/proc/PID/exe`), for telling a system service from a
/// process that merely took its name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExeFacts {
    /// The link target, without the kernel's ` (deleted)` suffix.
    pub path: String,
    /// Whether the kernel marked it ` (deleted)` (replaced since the process started, as after
    /// a driver upgrade).
    #[serde(default)]
    pub deleted: bool,
    /// Owner of the executable file.
    pub owner_uid: u32,
    /// Mode bits of the executable file (`st_mode & 0o7777`).
    pub mode: u32,
}

/// Facts about the machine and about vramguard's own process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct HostFacts {
    /// Kernel host name, if readable.
    pub hostname: Option<String>,
    /// `sysconf(_SC_CLK_TCK)`: the unit of [`ProcessFacts::start_ticks`].
    pub clock_ticks_per_sec: u64,
    /// Boot time, milliseconds since the Unix epoch (`btime` in `/proc/stat`), if known.
    pub boot_time_ms: Option<u64>,
    /// vramguard's own pid, as seen in the scanned `/proc`.
    pub self_pid: u32,
    /// vramguard's ancestors (parent first), never to be signalled.
    #[serde(default)]
    pub self_ancestors: Vec<u32>,
    /// Whether the scanned `/proc` belongs to the initial PID namespace (the host). `false`
    /// means vramguard runs in a container: driver-reported PIDs may not exist here.
    pub pid_namespace_is_host: Option<bool>,
    /// Effective uid of vramguard; 0 sees every process's open files.
    pub euid: u32,
    /// vramguard's effective capabilities (`capget(2)`, bit n for capability n), when read.
    /// Without root they give what root has: see [`Privileges`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap_effective: Option<u64>,
}

/// What vramguard may see and do, from its uid and capabilities: root, or a service user
/// given the capabilities instead (`AmbientCapabilities=` in a unit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Privileges {
    /// Effective uid.
    pub euid: u32,
    /// Effective capability set, when known.
    pub cap_effective: Option<u64>,
}

impl Privileges {
    /// `CAP_DAC_READ_SEARCH`: read any file (other users' `/proc/PID/fd` listings).
    pub const CAP_DAC_READ_SEARCH: u32 = 2;
    /// `CAP_KILL`: signal any process.
    pub const CAP_KILL: u32 = 5;
    /// `CAP_SYS_PTRACE`: read any process's fd links, maps and `exe`.
    pub const CAP_SYS_PTRACE: u32 = 19;

    fn has(&self, cap: u32) -> bool {
        self.cap_effective.is_some_and(|set| set >> cap & 1 == 1)
    }

    /// Every process's open files, maps and executable are readable: root, or both
    /// `CAP_SYS_PTRACE` and `CAP_DAC_READ_SEARCH`.
    pub fn sees_every_process(&self) -> bool {
        self.euid == 0 || (self.has(Self::CAP_SYS_PTRACE) && self.has(Self::CAP_DAC_READ_SEARCH))
    }

    /// Any process may be signalled: root, or `CAP_KILL`.
    pub fn may_signal_every_process(&self) -> bool {
        self.euid == 0 || self.has(Self::CAP_KILL)
    }
}

impl HostFacts {
    /// What vramguard may see and do on this host.
    pub fn privileges(&self) -> Privileges {
        Privileges {
            euid: self.euid,
            cap_effective: self.cap_effective,
        }
    }
}

/// Where the GPU facts came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriverSource {
    /// NVML, loaded from a shared library (a real driver, or the simulator's cdylib).
    Nvml,
    /// The simulation model, in-process (`--sim STATE`).
    Simulated,
}

/// The driver's identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverFacts {
    /// How the GPU facts were read.
    pub source: DriverSource,
    /// The NVML library path, for [`DriverSource::Nvml`].
    pub library: Option<String>,
    /// `nvmlSystemGetDriverVersion`, e.g. `580.159.03`.
    pub driver_version: Option<String>,
    /// `nvmlSystemGetNVMLVersion`, e.g. `13.580.159.03`.
    pub nvml_version: Option<String>,
}

/// A failed NVML call: which call, its return code, and the library's message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallError {
    /// The NVML function, e.g. `nvmlDeviceGetMemoryInfo_v2`.
    pub call: String,
    /// The `nvmlReturn_t`, when the call returned one.
    pub code: Option<u32>,
    /// What failed, in words (`GPU is lost`).
    pub message: String,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.code {
            Some(code) => write!(f, "{}: {} (code {code})", self.call, self.message),
            None => write!(f, "{}: {}", self.call, self.message),
        }
    }
}

/// Memory of one GPU in bytes, from `nvmlDeviceGetMemoryInfo_v2`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuMemory {
    /// Installed memory.
    pub total: u64,
    /// Reserved by the driver and firmware; neither used nor free.
    pub reserved: u64,
    /// Allocated by contexts (and by residue the driver never freed).
    pub used: u64,
    /// Available for allocation.
    pub free: u64,
}

/// Whether the driver's per-GPU process list can be believed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ProcessListState {
    /// The list was read and every record was plausible.
    Complete,
    /// Records were implausible (e.g. the 535.43–535.98 `_v3` struct mismatch); the list shown
    /// may be wrong or partial.
    Unreliable {
        /// What was wrong and what was done about it.
        reason: String,
    },
    /// The list could not be read.
    Unavailable {
        /// The failed call.
        error: CallError,
    },
}

/// The NVML process lists a pid appeared in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessKind {
    /// `nvmlDeviceGetComputeRunningProcesses`: a CUDA (or other compute) context.
    Compute,
    /// `nvmlDeviceGetGraphicsRunningProcesses`: an OpenGL/Vulkan context.
    Graphics,
    /// `nvmlDeviceGetMPSComputeRunningProcesses`: a client of the MPS server.
    Mps,
}

/// One process the driver lists on a GPU, after de-duplication across the three lists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    /// The pid as the driver reported it (which may belong to another PID namespace).
    pub pid: u32,
    /// Every list it appeared in.
    pub kinds: Vec<ProcessKind>,
    /// Memory the driver charges to it; `None` when the driver says "not available"
    /// (MIG, WDDM), which must never be shown as a number.
    pub used_bytes: Option<u64>,
}

/// Per-process utilization samples the driver buffered (`nvmlDeviceGetProcessUtilization`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UtilizationWindow {
    /// Start of the window the samples cover, milliseconds since the Unix epoch.
    pub since_ms: u64,
    /// The driver only returns processes that were busy at some point in the window; a holder
    /// absent here was idle during it. Junk samples (pid 0, values above 100) are already
    /// dropped by the reader.
    pub samples: Vec<UtilizationSample>,
}

/// One process's utilization, aggregated over the window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UtilizationSample {
    /// The pid as the driver reported it.
    pub pid: u32,
    /// Peak SM utilization in the window, percent (0–100).
    pub sm_percent: u32,
    /// Peak memory-controller utilization in the window, percent (0–100).
    pub mem_percent: u32,
    /// Time of the newest sample, milliseconds since the Unix epoch.
    pub last_seen_ms: u64,
    /// Time of the newest sample with SM or memory-controller activity of at least
    /// [`crate::policy::DEFAULT_GPU_WORK_MIN_PERCENT`] (an idle context reads 1 %), if any;
    /// snapshots taken before that threshold recorded any activity above 0.
    #[serde(default)]
    pub last_busy_ms: Option<u64>,
}

/// What `nvidia-smi` shows for a GPU beyond memory: utilization, temperature, power,
/// performance state, ECC. Each value is absent where the GPU does not support it (fans,
/// ECC on consumer boards) or the call failed (kept among the GPU's warnings).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuTelemetry {
    /// Percent of the last sample period in which a kernel ran.
    #[serde(default)]
    pub gpu_util_percent: Option<u32>,
    /// Percent of the period in which device memory was read or written.
    #[serde(default)]
    pub memory_util_percent: Option<u32>,
    /// GPU core temperature, °C.
    #[serde(default)]
    pub temperature_c: Option<u32>,
    /// Power draw, milliwatts.
    #[serde(default)]
    pub power_mw: Option<u32>,
    /// The enforced power limit, milliwatts.
    #[serde(default)]
    pub power_limit_mw: Option<u32>,
    /// Performance state: 0 (P0, maximum) to 15 (P15, minimum).
    #[serde(default)]
    pub performance_state: Option<u32>,
    /// Whether ECC is on (current mode).
    #[serde(default)]
    pub ecc_enabled: Option<bool>,
    /// Volatile (since the driver loaded) corrected ECC errors.
    #[serde(default)]
    pub ecc_corrected_volatile: Option<u64>,
    /// Volatile uncorrected ECC errors.
    #[serde(default)]
    pub ecc_uncorrected_volatile: Option<u64>,
    /// Fan speed, percent of its maximum (none on boards cooled by the chassis: SXM).
    #[serde(default)]
    pub fan_percent: Option<u32>,
    /// Compute mode: `Default`, `Exclusive_Process`, `Prohibited` (`Exclusive_Thread` on
    /// old drivers).
    #[serde(default)]
    pub compute_mode: Option<String>,
    /// Whether MIG mode is on (current mode).
    #[serde(default)]
    pub mig_enabled: Option<bool>,
    /// Whether a display is active on the GPU.
    #[serde(default)]
    pub display_active: Option<bool>,
}

/// Everything the driver said about one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSample {
    /// NVML index.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: Option<String>,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub name: Option<String>,
    /// PCI bus id, e.g. `00000000:19:00.0`.
    pub pci_bus_id: Option<String>,
    /// Minor number: the `N` of `/dev/nvidiaN`.
    pub minor_number: Option<u32>,
    /// Memory, if the driver answered.
    pub memory: Option<GpuMemory>,
    /// Persistence mode; a reset blocker when the persistence daemon holds the device.
    pub persistence_mode: Option<bool>,
    /// Processes the driver lists, de-duplicated.
    pub processes: Vec<GpuProcess>,
    /// Whether [`GpuSample::processes`] can be believed.
    pub process_list: ProcessListState,
    /// Utilization samples, when the driver supports them.
    pub utilization: Option<UtilizationWindow>,
    /// The GPU could not be read (lost, timed out); the other fields hold whatever was read
    /// before the failure.
    pub failure: Option<CallError>,
    /// Non-fatal failures of optional calls (name, PCI info, utilization...).
    #[serde(default)]
    pub warnings: Vec<CallError>,
    /// Memory health: row remapping, page retirement, Xid events.
    #[serde(default)]
    pub health: GpuHealth,
    /// In MIG mode, its MIG devices as their own handles report them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<MigDeviceSample>,
    /// Utilization, temperature, power, P-state and ECC, when read (absent in snapshots
    /// taken before vramguard read them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub telemetry: Option<GpuTelemetry>,
}

impl GpuSample {
    /// What a settled reading of this GPU holds (a reading of its UUID, memory, process
    /// lists and Xid events only): the fields it leaves unread are empty, and the warnings
    /// of calls it does not make are gone.
    pub fn settled_part(&self) -> GpuSample {
        GpuSample {
            index: self.index,
            uuid: self.uuid.clone(),
            name: None,
            pci_bus_id: None,
            minor_number: None,
            memory: self.memory,
            persistence_mode: None,
            processes: self.processes.clone(),
            process_list: self.process_list.clone(),
            utilization: None,
            failure: self.failure.clone(),
            warnings: self
                .warnings
                .iter()
                .filter(|w| SETTLED_CALLS.iter().any(|c| w.call.starts_with(c)))
                .cloned()
                .collect(),
            health: GpuHealth {
                xid_events: self.health.xid_events.clone(),
                ..GpuHealth::default()
            },
            mig_devices: self.mig_devices.clone(),
            telemetry: None,
        }
    }

    /// Whether this GPU reads the same as `then` in every field a settled reading holds:
    /// memory, the process lists and their bytes, MIG devices, Xid counts, any failure. Name,
    /// bus id, persistence, utilization, telemetry, retired pages and remapped rows are not
    /// read by it (they move while nothing else does, or decide nothing about a holder; a
    /// full sample reads them within the agent's re-read period), and warnings are left
    /// aside: a reading with warnings is never taken as settled. (Every field is named: a
    /// new one must be placed on one side or the other.)
    pub fn settled_alike(&self, then: &GpuSample) -> bool {
        let GpuSample {
            index,
            uuid,
            name: _,
            pci_bus_id: _,
            minor_number: _,
            memory,
            persistence_mode: _,
            processes,
            process_list,
            utilization: _,
            failure,
            warnings: _,
            health:
                GpuHealth {
                    remapped_rows: _,
                    retired_pages: _,
                    xid_events,
                },
            mig_devices,
            telemetry: _,
        } = self;
        *index == then.index
            && *uuid == then.uuid
            && *memory == then.memory
            && *processes == then.processes
            && *process_list == then.process_list
            && *failure == then.failure
            && *mig_devices == then.mig_devices
            && *xid_events == then.health.xid_events
    }
}

/// The NVML calls (by prefix) a settled reading makes.
const SETTLED_CALLS: &[&str] = &[
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses",
    "nvmlDeviceGetMigDeviceHandleByIndex",
    "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlEventSet",
    "nvmlDeviceRegisterEvents",
];

/// One MIG device (a GPU instance with a compute instance) of a GPU in MIG mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDeviceSample {
    /// GPU instance id.
    pub gpu_instance: Option<u32>,
    /// Compute instance id.
    pub compute_instance: Option<u32>,
    /// `MIG-…` UUID.
    pub uuid: Option<String>,
    /// Name, e.g. `NVIDIA H200 MIG 3g.71gb`.
    pub name: Option<String>,
    /// Its memory.
    pub memory: Option<GpuMemory>,
    /// Its processes, with the memory each holds on it.
    pub processes: Vec<GpuProcess>,
}

/// What the driver says about the health of a GPU's memory. Each part is `None` where the
/// GPU does not support it (row remapping came with Ampere; page retirement is pre-Ampere).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHealth {
    /// `nvmlDeviceGetRemappedRows`.
    pub remapped_rows: Option<RemappedRows>,
    /// `nvmlDeviceGetRetiredPages` and `nvmlDeviceGetRetiredPagesPendingStatus`.
    pub retired_pages: Option<RetiredPages>,
    /// Critical Xid events received since the reader started (an NVML event set only sees
    /// events after it registers: a one-shot `status` sees none; the agent counts them).
    #[serde(default)]
    pub xid_events: Vec<XidCount>,
}

/// Row remapping (Ampere and later): bad memory rows replaced by spare ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemappedRows {
    /// Rows remapped after correctable errors.
    pub correctable: u32,
    /// Rows remapped after uncorrectable errors.
    pub uncorrectable: u32,
    /// A remap waits for the next GPU reset; until then the bad row is only fenced off.
    pub pending: bool,
    /// A remap failed: the GPU needs service.
    pub failure: bool,
}

/// Page retirement (before Ampere).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetiredPages {
    /// Pages retired after multiple single-bit ECC errors.
    pub single_bit_ecc: u32,
    /// Pages retired after a double-bit ECC error.
    pub double_bit_ecc: u32,
    /// Pages wait for a reset (or reboot) to be retired.
    pub pending: bool,
}

/// How many times one Xid was reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct XidCount {
    /// The Xid (e.g. 48: double-bit ECC error, 79: fallen off the bus, 94/95: contained /
    /// uncontained ECC error).
    pub xid: u64,
    /// Events received.
    pub count: u64,
}

impl GpuHealth {
    /// A reset is needed to finish what the driver started (a pending remap or retirement).
    pub fn reset_pending(&self) -> bool {
        self.remapped_rows.is_some_and(|r| r.pending)
            || self.retired_pages.is_some_and(|r| r.pending)
    }
}

/// A `/dev/nvidia*` file a process holds open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "device", content = "minor", rename_all = "snake_case")]
pub enum DeviceFile {
    /// `/dev/nvidiaN`: one GPU, by minor number.
    Gpu(u32),
    /// `/dev/nvidiactl`: the control device every CUDA process opens.
    Ctl,
    /// `/dev/nvidia-uvm`: unified memory.
    Uvm,
}

/// What the fd scan learned about one process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(tag = "state", content = "files", rename_all = "snake_case")]
pub enum FdScan {
    /// The process's fds were not scanned in this collection.
    #[default]
    NotScanned,
    /// `/proc/PID/fd` was not readable (another user's process and we are not root).
    Denied,
    /// The device files it holds (possibly none), sorted and de-duplicated.
    Scanned(Vec<DeviceFile>),
}

impl FdScan {
    /// The GPU minor numbers held, if scanned.
    pub fn gpu_minors(&self) -> impl Iterator<Item = u32> + '_ {
        let files: &[DeviceFile] = match self {
            FdScan::Scanned(files) => files,
            _ => &[],
        };
        files.iter().filter_map(|f| match f {
            DeviceFile::Gpu(minor) => Some(*minor),
            _ => None,
        })
    }

    /// Whether `/dev/nvidia-uvm` is held (read: scanned and found), the file every CUDA
    /// context and, on driver 580, every NVML client holds.
    pub fn holds_uvm(&self) -> bool {
        matches!(self, FdScan::Scanned(files) if files.contains(&DeviceFile::Uvm))
    }

    /// Whether any NVIDIA device file (GPU, control or UVM) is held, if scanned.
    pub fn holds_any(&self) -> Option<bool> {
        match self {
            FdScan::Scanned(files) => Some(!files.is_empty()),
            _ => None,
        }
    }
}

/// One thread of a process, read when the process is a zombie or exiting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadFacts {
    /// Thread id.
    pub tid: u32,
    /// Scheduler state letter (proc(5) `stat` field 3): R, S, D, Z, T, t, X, I...
    pub state: char,
    /// Kernel function the thread sleeps in (`/proc/PID/task/TID/wchan`), when readable.
    pub wchan: Option<String>,
    /// On its way out: in `do_exit` (`PF_EXITING`) or with SIGKILL pending, which a group
    /// exit (`exit_group`, a fatal signal) sets on every thread. `Some(false)`: a thread that
    /// runs on after its main thread exited (`pthread_exit`), the process alive. `None`:
    /// not read (snapshots taken before vramguard read it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leaving: Option<bool>,
}

/// A container a process belongs to, from its cgroup path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRef {
    /// `docker`, `containerd`, `cri-o`, `podman` or `libpod`.
    pub runtime: String,
    /// The container id (64 hex digits for the common runtimes).
    pub id: String,
    /// The name its runtime gave it (Docker, Podman), when their state could be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A pod as the kubelet's pod-resources API lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KubePod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Its containers.
    pub containers: Vec<KubeContainer>,
}

/// A container of a [`KubePod`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KubeContainer {
    /// Name.
    pub name: String,
    /// NVIDIA device ids allocated to it (`GPU-…`, `MIG-…`, `GPU-…::N` with time-slicing).
    pub devices: Vec<String>,
}

/// What `/proc` says about one process. Every field the kernel may refuse is optional.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ProcessFacts {
    /// Pid in the scanned `/proc`'s namespace.
    pub pid: u32,
    /// Parent pid (proc(5) `stat` field 4); 0 when the parent is outside this namespace.
    pub ppid: Option<u32>,
    /// Process group id (`stat` field 5); 0 when the leader is outside this namespace.
    pub pgid: Option<u32>,
    /// Session id (`stat` field 6).
    pub sid: Option<u32>,
    /// State of the main thread (`stat` field 3).
    pub state: Option<char>,
    /// Kernel flags (`stat` field 9); `PF_EXITING` = 0x4, `PF_KTHREAD` = 0x200000.
    pub flags: Option<u32>,
    /// Start time after boot, in clock ticks (`stat` field 22): with the pid, the identity of a
    /// process that a reused pid cannot fake.
    pub start_ticks: Option<u64>,
    /// Resident host memory, bytes (`stat` field 24 × the page size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rss_bytes: Option<u64>,
    /// Real uid (`status` `Uid:` first field).
    pub uid: Option<u32>,
    /// User name of [`ProcessFacts::uid`], when the passwd database names it.
    pub user: Option<String>,
    /// Command name (`comm`, at most 15 bytes).
    pub comm: Option<String>,
    /// Command line; `None` when unreadable, empty for kernel threads and zombies.
    pub cmdline: Option<Vec<String>>,
    /// Pid in each nested PID namespace, outermost first (`status` `NSpid:`).
    #[serde(default)]
    pub nspid: Vec<u32>,
    /// The cgroup v2 path (or the most specific v1 path).
    pub cgroup: Option<String>,
    /// Container, from the cgroup path.
    pub container: Option<ContainerRef>,
    /// Kubernetes pod UID, from the cgroup path (dashes restored).
    pub pod_uid: Option<String>,
    /// Threads, read only when the main thread is a zombie or the process is exiting.
    pub threads: Option<Vec<ThreadFacts>>,
    /// CPU time used so far, user + system, clock ticks (`stat` fields 14 and 15).
    #[serde(default)]
    pub cpu_ticks: Option<u64>,
    /// The executable, when readable (root, or the process's owner).
    #[serde(default)]
    pub exe: Option<ExeFacts>,
    /// The parent an earlier collection saw, when it differs from [`ProcessFacts::ppid`]
    /// (the process was re-parented since: its parent died).
    #[serde(default)]
    pub earlier_ppid: Option<u32>,
    /// The start time of that earlier parent (clock ticks after boot), when it was read: a
    /// departed process with that pid is the same parent only if it started then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub earlier_parent_start_ticks: Option<u64>,
    /// NVIDIA device files held open.
    #[serde(default)]
    pub device_files: FdScan,
    /// Pinned, locked and shared host memory, read at full depth for the processes that
    /// matter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<crate::host::ProcessHostMemory>,
    /// Which NVIDIA driver libraries are mapped in it, read for holders of
    /// `/dev/nvidia-uvm`; `None`: not looked at (a snapshot from before this was read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_library: Option<DriverLibrary>,
}

/// Which NVIDIA driver library a process maps (`/proc/PID/maps`): what tells a CUDA context
/// from an NVML client once both hold `/dev/nvidia-uvm`.
///
/// Every process that created a CUDA context maps the CUDA driver library (`libcuda.so*`),
/// and a child `fork()`ed after `cuInit` inherits the mapping with the context's device
/// files. An NVML client (a monitor, an exporter, the vramguard agent) maps `libnvidia-ml`
/// only: on driver 580 it holds `/dev/nvidia-uvm` too (seen on an H200 with 580.159.04), so
/// holding uvm alone no longer tells a CUDA context from a monitor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DriverLibrary {
    /// `libcuda.so*` is mapped: a CUDA process, or a child forked from one.
    Cuda,
    /// `libnvidia-ml.so*` is mapped and `libcuda.so*` is not: an NVML client, no context.
    NvmlOnly,
    /// Neither is mapped, though it holds the device files: inherited across `exec`,
    /// received from another process, or a runtime that talks to the driver directly. It
    /// may keep a context alive.
    Neither,
    /// The map could not be read whole (denied, too large, empty for every thread): no
    /// evidence either way.
    Unknown,
}

/// Whether a holder of these device files may hold (or keep alive) a CUDA context: it holds
/// `/dev/nvidia-uvm` and is not known to be an NVML client. `Some(false)` is proof it holds
/// none: never a target and never a keeper. `files`: `None` when its fds were not scanned.
pub fn may_hold_context(
    files: Option<&[DeviceFile]>,
    library: Option<DriverLibrary>,
) -> Option<bool> {
    let files = files?;
    Some(files.contains(&DeviceFile::Uvm) && library != Some(DriverLibrary::NvmlOnly))
}

/// `PF_EXITING` from the kernel's `include/linux/sched.h`: the process is in `do_exit`.
pub const PF_EXITING: u32 = 0x0000_0004;
/// `PF_KTHREAD`: a kernel thread; never a GPU holder, never to be signalled.
pub const PF_KTHREAD: u32 = 0x0020_0000;

impl ProcessFacts {
    /// Whether another thread of it runs on while its main thread is a zombie or exiting:
    /// a live thread not on its way out, or one not known to be (see
    /// [`ThreadFacts::leaving`]). Only read threads count: a process whose threads were
    /// not read has none here.
    pub fn thread_runs_on(&self) -> bool {
        self.threads.as_deref().is_some_and(|threads| {
            threads.iter().any(|t| {
                t.tid != self.pid && !matches!(t.state, 'Z' | 'X') && t.leaving != Some(true)
            })
        })
    }

    /// Whether the process has finished: its main thread is a zombie and no other thread of
    /// it runs on. A process whose main thread called `pthread_exit` shows `Z` in `stat`
    /// while its other threads work: it has not finished, and its job lives with it. One
    /// whose threads could not be read is not known to have finished (red team: a live
    /// trainer read so made its child rank an orphan of a "gone" leader).
    pub fn is_finished(&self) -> bool {
        self.state == Some('Z') && self.threads.is_some() && !self.thread_runs_on()
    }

    /// Whether the whole process is exiting: its main thread is in `do_exit` and every other
    /// live thread is on its way out too. A main thread alone in `do_exit` (`pthread_exit`)
    /// leaves a live process, whose other threads may be working; one whose threads could not
    /// be read is not known to be exiting.
    pub fn is_exiting(&self) -> bool {
        self.flags.is_some_and(|f| f & PF_EXITING != 0)
            && self.threads.as_deref().is_some_and(|threads| {
                threads.iter().all(|t| {
                    t.tid == self.pid || matches!(t.state, 'Z' | 'X') || t.leaving == Some(true)
                })
            })
    }

    /// Whether it may hold a CUDA context (see [`may_hold_context`]); `None` when its fds
    /// were not scanned.
    pub fn may_hold_context(&self) -> Option<bool> {
        let files = match &self.device_files {
            FdScan::Scanned(files) => Some(files.as_slice()),
            _ => None,
        };
        may_hold_context(files, self.driver_library)
    }

    /// Whether this is a kernel thread.
    pub fn is_kernel_thread(&self) -> bool {
        self.flags.is_some_and(|f| f & PF_KTHREAD != 0)
    }

    /// The command line joined for display, falling back to `[comm]`.
    pub fn display_command(&self) -> String {
        match &self.cmdline {
            Some(args) if !args.is_empty() => args.join(" "),
            _ => format!("[{}]", self.comm.as_deref().unwrap_or("?")),
        }
    }
}

/// A process seen in an earlier collection that has since exited.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DepartedProcess {
    /// Its pid.
    pub pid: u32,
    /// Its command name.
    pub comm: Option<String>,
    /// Its command line.
    pub cmdline: Option<Vec<String>>,
    /// When it was first seen gone, milliseconds since the Unix epoch.
    pub gone_at_ms: u64,
    /// Its start time (`stat` field 22, clock ticks after boot): which process had the pid.
    /// Snapshots taken before vramguard recorded it have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_ticks: Option<u64>,
    /// Its real user id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
}

/// How the process facts were gathered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ScanFacts {
    /// The `/proc` that was read.
    pub proc_root: String,
    /// The directory holding the `nvidia*` device files (`/dev`, or the simulator's `dev_dir`).
    pub dev_dir: String,
    /// Whether every process's fds were scanned (needed to find hidden holders).
    pub full_fd_scan: bool,
    /// Facts that could not be gathered and why (e.g. "run as root to see other users' open
    /// files"), each once.
    #[serde(default)]
    pub limitations: Vec<String>,
    /// Processes whose descendants were read for their work and could not all be (more than
    /// a walk reads from one process, or a process with more threads than are looked at):
    /// the work of the holders they stand for is unknown, never idle.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub descendants_unread: Vec<u32>,
}

impl Snapshot {
    /// The facts of one pid, if it existed at collection time.
    pub fn process(&self, pid: u32) -> Option<&ProcessFacts> {
        self.processes
            .binary_search_by_key(&pid, |p| p.pid)
            .ok()
            .map(|i| &self.processes[i])
    }

    /// What the sampler saw of `pid`, when it is the process of `start_ticks`.
    pub fn work_of(&self, pid: u32, start_ticks: Option<u64>) -> Option<&WorkSample> {
        let w = self.work.as_ref()?;
        let i = w.processes.binary_search_by_key(&pid, |p| p.pid).ok()?;
        let s = &w.processes[i];
        (Some(s.start_ticks) == start_ticks).then_some(s)
    }

    /// The facts of the job cgroup rooted at `root`, if collected.
    pub fn job_cgroup(&self, root: &str) -> Option<&JobCgroupFacts> {
        self.job_cgroups.iter().find(|c| c.root == root)
    }

    /// Sorts the process list by pid so that [`Snapshot::process`] can binary-search it.
    pub fn normalize(&mut self) {
        self.processes.sort_by_key(|p| p.pid);
        self.processes.dedup_by_key(|p| p.pid);
        if let Some(w) = self.work.as_mut() {
            w.processes.sort_by_key(|p| p.pid);
            w.processes.dedup_by_key(|p| p.pid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu() -> GpuSample {
        GpuSample {
            index: 0,
            uuid: Some("GPU-1".into()),
            name: Some("NVIDIA H200".into()),
            pci_bus_id: Some("00000000:19:00.0".into()),
            minor_number: Some(0),
            memory: Some(GpuMemory {
                total: 100,
                reserved: 1,
                used: 40,
                free: 59,
            }),
            persistence_mode: Some(true),
            processes: vec![GpuProcess {
                pid: 10,
                kinds: vec![ProcessKind::Compute],
                used_bytes: Some(40),
            }],
            process_list: ProcessListState::Complete,
            utilization: None,
            failure: None,
            warnings: Vec::new(),
            health: GpuHealth::default(),
            mig_devices: Vec::new(),
            telemetry: Some(GpuTelemetry::default()),
        }
    }

    fn call_error(call: &str) -> CallError {
        CallError {
            call: call.into(),
            code: Some(999),
            message: "Unknown Error".into(),
        }
    }

    /// A quiet sample stays quiet only while everything a settled reading holds is what the
    /// full sample read: each such field, changed alone, ends it; each field it does not read,
    /// changed alone, does not.
    #[test]
    fn settled_alike_compares_exactly_what_a_settled_reading_holds() {
        let then = gpu();
        assert!(then.settled_part().settled_alike(&then));
        let compared: Vec<(&str, fn(&mut GpuSample))> = vec![
            ("index", |g| g.index = 1),
            ("uuid", |g| g.uuid = Some("GPU-2".into())),
            ("memory", |g| g.memory.as_mut().unwrap().used += 1),
            ("process bytes", |g| g.processes[0].used_bytes = Some(41)),
            ("process kinds", |g| {
                g.processes[0].kinds.push(ProcessKind::Graphics)
            }),
            ("a new process", |g| {
                g.processes.push(GpuProcess {
                    pid: 11,
                    kinds: vec![ProcessKind::Compute],
                    used_bytes: None,
                })
            }),
            ("list state", |g| {
                g.process_list = ProcessListState::Unreliable { reason: "x".into() }
            }),
            ("failure", |g| {
                g.failure = Some(call_error("nvmlDeviceGetMemoryInfo_v2"))
            }),
            ("MIG devices", |g| {
                g.mig_devices.push(MigDeviceSample {
                    gpu_instance: Some(1),
                    compute_instance: Some(0),
                    uuid: None,
                    name: None,
                    memory: None,
                    processes: Vec::new(),
                })
            }),
            ("Xid counts", |g| {
                g.health.xid_events.push(XidCount { xid: 79, count: 1 })
            }),
        ];
        for (what, change) in compared {
            let mut now = then.settled_part();
            change(&mut now);
            assert!(!now.settled_alike(&then), "{what} changed, still alike");
        }
        let unread: Vec<(&str, fn(&mut GpuSample))> = vec![
            ("name", |g| g.name = None),
            ("bus id", |g| g.pci_bus_id = None),
            ("minor number", |g| g.minor_number = Some(3)),
            ("persistence", |g| g.persistence_mode = Some(false)),
            ("telemetry", |g| g.telemetry = None),
            ("remapped rows", |g| {
                g.health.remapped_rows = Some(RemappedRows {
                    pending: true,
                    ..RemappedRows::default()
                })
            }),
            ("retired pages", |g| {
                g.health.retired_pages = Some(RetiredPages::default())
            }),
            ("warnings", |g| {
                g.warnings.push(call_error("nvmlDeviceGetFanSpeed"))
            }),
        ];
        for (what, change) in unread {
            let mut now = then.settled_part();
            change(&mut now);
            assert!(now.settled_alike(&then), "{what} is not read, yet compared");
        }
    }

    /// What a settled reading holds of a full one: the fields it reads, and the warnings of
    /// the calls it makes.
    #[test]
    fn the_settled_part_keeps_the_settled_calls_warnings_only() {
        let mut full = gpu();
        full.health.xid_events.push(XidCount { xid: 48, count: 2 });
        full.health.remapped_rows = Some(RemappedRows::default());
        full.warnings = vec![
            call_error("nvmlDeviceGetFanSpeed"),
            call_error("nvmlDeviceGetComputeRunningProcesses_v3"),
            call_error("nvmlEventSetWait_v2"),
            call_error("nvmlDeviceGetName"),
        ];
        let part = full.settled_part();
        assert_eq!(
            part.warnings
                .iter()
                .map(|w| w.call.as_str())
                .collect::<Vec<_>>(),
            [
                "nvmlDeviceGetComputeRunningProcesses_v3",
                "nvmlEventSetWait_v2"
            ]
        );
        assert_eq!(part.health.xid_events, full.health.xid_events);
        assert_eq!(part.health.remapped_rows, None);
        assert_eq!((part.name, part.telemetry), (None, None));
        assert_eq!(part.processes, full.processes);
    }
}
