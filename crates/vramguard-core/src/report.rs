//! What classification concludes: for every GPU, every holder with a class, the evidence in
//! words and the action that would free its memory, plus the bytes nobody accounts for.
//! Serialised as-is by `status --json` (see `docs/json-schema.md`).

use crate::job::JobKind;
use crate::snapshot::{
    CallError, ContainerRef, DeviceFile, DriverFacts, GpuHealth, GpuMemory, GpuTelemetry,
    ProcessKind, ProcessListState,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Why a process holds GPU memory, from the reclaimer's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// Live, and its job is alive.
    Active,
    /// Live, but no GPU utilization for the policy's idle time (a forgotten Jupyter kernel).
    Idle,
    /// Live, its job is gone (the cgroup's job ended, or its launcher and process-group
    /// leader exited), and it showed no sign of work through the sampling window.
    Orphan,
    /// Live, its launcher or job leader gone, but working (GPU or CPU activity in the window,
    /// or the parent of working holders): a job started with `nohup … &` from a script that
    /// exited. Not ghost memory; never a default reclaim target.
    Detached,
    /// Its main thread is a zombie, or it is exiting, while threads still hold the device.
    Zombie,
    /// The driver reports a pid that belongs to a PID namespace vramguard cannot see (it runs
    /// in a container, or the pid cannot be mapped).
    Foreign,
    /// The driver lists a pid that has exited (vramguard sees the host's PID namespace and
    /// every process): its context outlives it because processes it forked after `cuInit`
    /// still hold its device files (the keepers). CUDA does not support `fork()`, so no
    /// process can use that context any more: its memory is ghost memory, freed the moment the
    /// last keeper exits. Never signalled itself (there is no process); its keepers are.
    Exited,
    /// Holds the GPU's device file, but the driver does not list it.
    Hidden,
    /// A system service (persistence daemon, DCGM, X, MPS server): never killed, blocks resets.
    System,
}

/// How a view paints a class: each view maps a tone to its own colours, so a new class
/// needs no change in any view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tone {
    /// A job that works or lives (green).
    Working,
    /// Alive but unused (cyan).
    Unused,
    /// Ghost memory: no live job's (red, bold where a view can).
    Ghost,
    /// Not explained by what vramguard can see (yellow).
    Unexplained,
    /// A system service (dim).
    Service,
}

/// Whether and how `reclaim` may target a class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ReclaimRule {
    /// Never: a live job's, a system service's, another namespace's, or no process at all.
    Never,
    /// Only when named with `reclaim --include` by hand (working processes), never by the
    /// agent's automatic reclaim.
    ByHandOnly,
    /// A target when included, by hand or in `[reclaim] include`; the planner's own checks
    /// (job gone, no work, idle long enough) still apply to each holder.
    WhenIncluded,
}

/// Everything about a class that is not the classification itself: its name, what it
/// means, how views show and sort it, and whether reclaim may target it. The renderers,
/// `top`, the agent's page, the config's validation and the planner read this table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassInfo {
    /// The class.
    pub class: Class,
    /// The lowercase name used in output, JSON, metrics and `--include`.
    pub name: &'static str,
    /// What it means, in one line.
    pub meaning: &'static str,
    /// How views paint it.
    pub tone: Tone,
    /// Attention order: reclaimable first (0), services last.
    pub rank: u8,
    /// Its memory belongs to no live job ("ghost" memory).
    pub ghost: bool,
    /// In `reclaim`'s (and `[reclaim] include`'s) default list.
    pub default_target: bool,
    /// Whether reclaim may target it.
    pub reclaim: ReclaimRule,
}

/// The class table, in display order.
pub const CLASSES: [ClassInfo; 9] = [
    ClassInfo {
        class: Class::Active,
        name: "active",
        meaning: "live, its job is alive",
        tone: Tone::Working,
        rank: 7,
        ghost: false,
        default_target: false,
        reclaim: ReclaimRule::Never,
    },
    ClassInfo {
        class: Class::Idle,
        name: "idle",
        meaning: "live, its job is alive, no GPU utilization for the idle time",
        tone: Tone::Unused,
        rank: 4,
        ghost: false,
        default_target: false,
        reclaim: ReclaimRule::WhenIncluded,
    },
    ClassInfo {
        class: Class::Orphan,
        name: "orphan",
        meaning: "live, its job is gone, and it did no work through the sampling window",
        tone: Tone::Ghost,
        rank: 0,
        ghost: true,
        default_target: true,
        reclaim: ReclaimRule::WhenIncluded,
    },
    ClassInfo {
        class: Class::Detached,
        name: "detached",
        meaning: "live, its launcher or leader gone, but working",
        tone: Tone::Working,
        rank: 6,
        ghost: false,
        default_target: false,
        reclaim: ReclaimRule::ByHandOnly,
    },
    ClassInfo {
        class: Class::Zombie,
        name: "zombie",
        meaning: "its main thread is a zombie or exiting while threads hold the device",
        tone: Tone::Ghost,
        rank: 1,
        ghost: true,
        default_target: false,
        reclaim: ReclaimRule::WhenIncluded,
    },
    ClassInfo {
        class: Class::Exited,
        name: "exited",
        meaning: "the driver lists a pid that has exited; processes it forked keep its context",
        tone: Tone::Ghost,
        rank: 2,
        ghost: true,
        default_target: false,
        reclaim: ReclaimRule::Never,
    },
    ClassInfo {
        class: Class::Foreign,
        name: "foreign",
        meaning: "the driver reports a pid this PID namespace does not have",
        tone: Tone::Unexplained,
        rank: 5,
        ghost: false,
        default_target: false,
        reclaim: ReclaimRule::Never,
    },
    ClassInfo {
        class: Class::Hidden,
        name: "hidden",
        meaning: "holds the GPU's device file, but the driver does not list it",
        tone: Tone::Unexplained,
        rank: 3,
        ghost: false,
        default_target: true,
        reclaim: ReclaimRule::WhenIncluded,
    },
    ClassInfo {
        class: Class::System,
        name: "system",
        meaning: "a system service (persistence daemon, DCGM, X, MPS): never killed",
        tone: Tone::Service,
        rank: 8,
        ghost: false,
        default_target: false,
        reclaim: ReclaimRule::Never,
    },
];

/// A class that `reclaim` (or the agent's automatic reclaim) may not target.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotATarget {
    /// A class reclaim never targets.
    #[error(
        "{0} holders are never reclaimed (their job is alive, they are system services, or they are not processes of this namespace; an exited pid is freed by reclaiming its keepers)"
    )]
    Never(Class),
    /// A working class named for automatic reclaim.
    #[error(
        "{0} holders are working: they are never reclaimed automatically (use `vramguard reclaim --include {0}` by hand)"
    )]
    ByHandOnly(Class),
}

impl Class {
    /// Every class, in display order.
    pub const ALL: [Class; 9] = {
        let mut all = [Class::Active; 9];
        let mut i = 0;
        while i < CLASSES.len() {
            all[i] = CLASSES[i].class;
            i += 1;
        }
        all
    };

    /// This class's row of [`CLASSES`].
    pub fn info(self) -> &'static ClassInfo {
        CLASSES
            .iter()
            .find(|i| i.class == self)
            .expect("every class has a row")
    }

    /// The lowercase name used in output, JSON and metrics.
    pub fn as_str(self) -> &'static str {
        self.info().name
    }

    /// Whether memory of this class belongs to no live job (it is "ghost" memory).
    pub fn is_ghost(self) -> bool {
        self.info().ghost
    }

    /// Whether reclaim may target this class: by hand (`automatic` false) or by the agent.
    pub fn check_target(self, automatic: bool) -> Result<(), NotATarget> {
        match self.info().reclaim {
            ReclaimRule::Never => Err(NotATarget::Never(self)),
            ReclaimRule::ByHandOnly if automatic => Err(NotATarget::ByHandOnly(self)),
            _ => Ok(()),
        }
    }

    /// The names of the classes reclaim may be asked to target (`automatic`: by the agent,
    /// which never takes a working class): the one list every `--include` and
    /// `[reclaim] include` error gives.
    pub fn target_names(automatic: bool) -> Vec<&'static str> {
        CLASSES
            .iter()
            .filter(|i| i.class.check_target(automatic).is_ok())
            .map(|i| i.name)
            .collect()
    }

    /// The classes reclaim targets when none are named.
    pub fn default_targets() -> impl Iterator<Item = Class> {
        CLASSES.iter().filter(|i| i.default_target).map(|i| i.class)
    }

    /// Every class, most urgent first (the attention order of `top` and the page).
    pub fn by_rank() -> [Class; 9] {
        let mut all = Class::ALL;
        all.sort_by_key(|c| c.info().rank);
        all
    }
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A class name that is not one of [`Class::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown class {0:?} (expected one of: {names})", names = class_names())]
pub struct UnknownClass(pub String);

/// The names of every class, comma-separated.
fn class_names() -> String {
    CLASSES
        .iter()
        .map(|i| i.name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl std::str::FromStr for Class {
    type Err = UnknownClass;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Class::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownClass(s.to_string()))
    }
}

/// What would free a holder's memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Action {
    /// The advice in words.
    pub summary: String,
    /// The exact command, when there is one.
    pub command: Option<String>,
    /// Whether `vramguard reclaim` would target this holder by default.
    pub reclaimable: bool,
}

/// The job a holder belonged to, when its leader is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadJob {
    /// The process-group id, i.e. the dead leader's pid.
    pub leader_pid: u32,
    /// The leader's command, when an earlier collection saw it.
    pub leader_command: Option<String>,
    /// Whether the leader still exists as an unreaped zombie (as opposed to being gone).
    pub leader_is_zombie: bool,
    /// The job's name when a cgroup named it (`slurm:42.0`); `None` for a process group.
    #[serde(default)]
    pub label: Option<String>,
}

/// The job a holder belongs to (see [`crate::job`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobInfo {
    /// `pod:<uid>`, `docker:<id12>`, `slurm:1234.0`, `unit:train.service`, `pgid:4121`.
    pub label: String,
    /// What named it.
    pub kind: JobKind,
    /// Whether the job is alive; `None` when it cannot be told (treated as alive).
    pub alive: Option<bool>,
    /// The evidence, in words.
    pub evidence: String,
    /// The systemd system service the job lies in (its cgroup is `/system.slice/NAME.service`
    /// or below it: the service's own sub-units and containers count): a unit root started,
    /// which a command for root may name. `None` for anything else, a user manager's units
    /// included (their names are the user's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_service: Option<String>,
    /// How many processes that system service runs (its cgroup's whole subtree), when its
    /// cgroup was read whole: `systemctl stop` ends every one of them, GPU holders or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_processes: Option<u32>,
}

/// Whether a holder (or its job) showed signs of work over the sampling window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Work {
    /// Some evidence of work was seen.
    Working {
        /// What was seen, one fact per line.
        evidence: Vec<String>,
    },
    /// Observed long enough, and nothing was seen.
    Idle {
        /// How long the CPU was observed, milliseconds.
        window_ms: u64,
        /// CPU used over it, thousandths of one core.
        cpu_millicores: u64,
    },
    /// Not enough was observed to tell (no sampling window, a GPU without utilization
    /// samples): treated as possibly working.
    Unknown {
        /// What is missing.
        why: String,
    },
}

impl Work {
    /// Whether work was seen.
    pub fn is_working(&self) -> bool {
        matches!(self, Work::Working { .. })
    }
    /// Whether the holder was observed and found idle.
    pub fn is_idle(&self) -> bool {
        matches!(self, Work::Idle { .. })
    }
}

/// One process holding memory (or device files) of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    /// The pid in vramguard's PID namespace (for a foreign holder: the pid the driver reported).
    pub pid: u32,
    /// The pid the driver reported, when it differs from [`Holder::pid`] (mapped via `NSpid`).
    pub reported_pid: Option<u32>,
    /// The class.
    pub class: Class,
    /// Whether the driver lists it on this GPU.
    pub listed: bool,
    /// The driver's process lists it appears in.
    pub kinds: Vec<ProcessKind>,
    /// Memory the driver charges to it; `None` when not listed or "not available".
    pub used_bytes: Option<u64>,
    /// Command name.
    pub comm: Option<String>,
    /// Command line for display.
    pub command: Option<String>,
    /// Owner uid.
    pub uid: Option<u32>,
    /// Owner name.
    pub user: Option<String>,
    /// Main-thread state letter.
    pub state: Option<char>,
    /// Start time in clock ticks after boot: with the pid, the identity a reclaim re-checks.
    pub start_ticks: Option<u64>,
    /// Seconds since the process started (from its start time and the boot time).
    #[serde(default)]
    pub age_secs: Option<u64>,
    /// Resident host memory, bytes.
    #[serde(default)]
    pub rss_bytes: Option<u64>,
    /// The Kubernetes pod (namespace, name, container) the kubelet allocated this GPU to,
    /// when the holder lives in a pod cgroup and the GPU's pod is unambiguous.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodName>,
    /// Pinned, locked and shared host memory, when read (full scans).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory: Option<crate::host::ProcessHostMemory>,
    /// CPU used over the sampling window, thousandths of one core (1000: one full core).
    #[serde(default)]
    pub cpu_millicores: Option<u64>,
    /// Parent pid.
    pub ppid: Option<u32>,
    /// Process group.
    pub pgid: Option<u32>,
    /// Pids in nested namespaces, outermost first.
    pub nspid: Vec<u32>,
    /// Container, from its cgroup.
    pub container: Option<ContainerRef>,
    /// Kubernetes pod UID.
    pub pod_uid: Option<String>,
    /// Device files it holds, if scanned.
    pub device_files: Option<Vec<DeviceFile>>,
    /// Which NVIDIA driver libraries are mapped in it (read for holders of
    /// `/dev/nvidia-uvm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_library: Option<crate::snapshot::DriverLibrary>,
    /// Its job, when the job's leader is gone.
    pub dead_job: Option<DeadJob>,
    /// The job it belongs to, with its liveness; `None` for foreign holders.
    #[serde(default)]
    pub job: Option<JobInfo>,
    /// Whether its job showed work in the sampling window (for a process of a dead job, the
    /// work of every process of that job counts).
    #[serde(default = "unknown_work")]
    pub work: Work,
    /// Seconds without GPU utilization, when known.
    pub idle_secs: Option<u64>,
    /// For an `exited` holder: the processes that keep its context alive (unlisted holders of
    /// this GPU's device file it forked), when vramguard could see them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keepers: Vec<u32>,
    /// For a hidden holder: the exited pid whose context it keeps alive on this GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keeps_alive: Option<u32>,
    /// Whether that tie is unconfirmed: it rests on the exited pid being the only one listed
    /// on the GPU, or on a parent pid that may have been reused. Such a keeper in a live job
    /// is reclaimed only when asked for (`--include keepers`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keeps_alive_unconfirmed: bool,
    /// For an `exited` holder without known keepers: vramguard could not read other users'
    /// open files, so processes it cannot see may keep it (its memory is unexplained, not
    /// ghost, and not a live job's).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kept_by_unseen: bool,
    /// Why it has this class, one fact per line.
    pub evidence: Vec<String>,
    /// What would free its memory.
    pub action: Action,
}

impl Holder {
    /// Whether it may hold a CUDA context (see [`crate::snapshot::may_hold_context`]);
    /// `None` when its fds were not scanned.
    pub fn may_hold_context(&self) -> Option<bool> {
        crate::snapshot::may_hold_context(self.device_files.as_deref(), self.driver_library)
    }

    /// Its command line for display, else its command name; `[exited]` for an exited pid
    /// whose command nobody saw, `?` for what cannot be read. Raw: escape it before printing.
    pub fn shown_command(&self) -> &str {
        self.command
            .as_deref()
            .or(self.comm.as_deref())
            .unwrap_or(if self.class == Class::Exited {
                "[exited]"
            } else {
                "?"
            })
    }

    /// Whether this holder's memory is ghost memory: its class is a ghost class and, for an
    /// exited pid, processes were seen keeping its context (one that no process keeps is a
    /// context the driver is tearing down, or residue counted as unaccounted memory).
    pub fn is_ghost(&self) -> bool {
        self.class.is_ghost() && (self.class != Class::Exited || !self.keepers.is_empty())
    }
}

fn unknown_work() -> Work {
    Work::Unknown {
        why: "not recorded".into(),
    }
}

/// Most likely reason memory is unaccounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnaccountedCause {
    /// Processes hold the device file but the driver does not list them.
    HiddenHolders,
    /// vramguard runs in a container and cannot see holders in other PID namespaces.
    OtherNamespace,
    /// No process holds the device: memory the driver did not free (needs a reset).
    DriverResidue,
    /// The driver does not report per-process memory (MIG, vGPU), so nothing can be summed.
    PerProcessMemoryUnavailable,
    /// Not enough facts (no full fd scan, or unreadable processes).
    Unknown,
}

/// Memory the driver calls used that no listed process accounts for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unaccounted {
    /// `used − Σ listed process memory − baseline`, floored at 0.
    pub bytes: u64,
    /// The GPU's tolerance (policy); at or below it, the bytes are noise.
    pub tolerance_bytes: u64,
    /// The baseline subtracted.
    pub baseline_bytes: u64,
    /// Whether `bytes` exceeds the tolerance.
    pub significant: bool,
    /// The most likely cause, when significant.
    pub cause: Option<UnaccountedCause>,
    /// The reasoning behind the cause, one fact per line.
    pub explanation: Vec<String>,
}

impl Unaccounted {
    /// Whether these bytes are ghost memory (held by no live job). Memory a MIG or vGPU
    /// driver does not split per process is not: the listed processes may hold all of it.
    pub fn counts_as_ghost(&self) -> bool {
        self.significant
            && matches!(
                self.cause,
                Some(UnaccountedCause::HiddenHolders | UnaccountedCause::DriverResidue)
            )
    }

    /// Whether these bytes are held by something vramguard cannot see from where it runs
    /// (another PID namespace, other users' unreadable files): neither ghost nor accounted.
    pub fn is_unexplained(&self) -> bool {
        self.significant
            && matches!(
                self.cause,
                Some(UnaccountedCause::OtherNamespace | UnaccountedCause::Unknown)
            )
    }
}

/// A process that would make `nvidia-smi --gpu-reset` fail ("In use by another client").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetBlocker {
    /// Its pid.
    pub pid: u32,
    /// Its command name.
    pub comm: Option<String>,
    /// Why it blocks (listed by the driver, holds the device file, system service).
    pub reason: String,
}

impl std::fmt::Display for ResetBlocker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.pid,
            crate::sanitize::escape(self.comm.as_deref().unwrap_or("?")),
            self.reason
        )
    }
}

/// Everything concluded about one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuReport {
    /// NVML index.
    pub index: u32,
    /// UUID.
    pub uuid: Option<String>,
    /// Name.
    pub name: Option<String>,
    /// PCI bus id.
    pub pci_bus_id: Option<String>,
    /// Device-file minor number.
    pub minor_number: Option<u32>,
    /// Memory, if read.
    pub memory: Option<GpuMemory>,
    /// Persistence mode.
    pub persistence_mode: Option<bool>,
    /// The GPU could not be read.
    pub failure: Option<CallError>,
    /// Non-fatal call failures.
    pub warnings: Vec<CallError>,
    /// Memory health (row remapping, page retirement, Xid events).
    #[serde(default)]
    pub health: GpuHealth,
    /// Whether the process list can be believed.
    pub process_list: ProcessListState,
    /// Holders, largest memory first.
    pub holders: Vec<Holder>,
    /// Memory charged to listed processes.
    pub accounted_bytes: u64,
    /// Unaccounted memory; `None` when memory is unknown.
    pub unaccounted: Option<Unaccounted>,
    /// Processes that would make a reset fail.
    pub reset_blockers: Vec<ResetBlocker>,
    /// Bytes per holder class (listed memory only).
    pub bytes_by_class: BTreeMap<Class, u64>,
    /// Ghost bytes: orphan, zombie and exited holders plus significant unaccounted memory.
    pub ghost_bytes: u64,
    /// What `vramguard reclaim` with its defaults should give back on this GPU: the listed
    /// memory of its reclaimable holders, an exited pid's memory when every keeper is
    /// reclaimable, and the unaccounted memory when every hidden holder is.
    #[serde(default)]
    pub reclaimable_bytes: u64,
    /// In MIG mode, each MIG device with its holders and its own ghost memory.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mig_devices: Vec<MigDeviceReport>,
    /// Utilization, temperature, power, P-state and ECC as the driver gave them; `null` when
    /// not read (replayed snapshots from before vramguard read them).
    #[serde(default)]
    pub telemetry: Option<GpuTelemetry>,
}

impl GpuReport {
    /// Whether this GPU could not be read well enough to tell whose its memory is: the GPU
    /// failed (lost, timing out), or its process list could not be read.
    pub fn is_unreadable(&self) -> bool {
        self.failure.is_some()
            || matches!(
                self.process_list,
                crate::snapshot::ProcessListState::Unavailable { .. }
            )
    }

    /// Bytes listed for exited pids that no process keeps (vramguard saw every open file):
    /// contexts the driver is tearing down, or residue once that takes too long. Not a live
    /// job's memory.
    pub fn unkept_exited_bytes(&self) -> u64 {
        self.holders
            .iter()
            .filter(|h| h.class == Class::Exited && h.keepers.is_empty() && !h.kept_by_unseen)
            .filter_map(|h| h.used_bytes)
            .fold(0, u64::saturating_add)
    }

    /// Bytes on this GPU whose holder vramguard cannot see (see [`Report::unexplained_bytes`]).
    pub fn unexplained_bytes(&self) -> u64 {
        let foreign = self
            .holders
            .iter()
            .filter(|h| {
                h.class == Class::Foreign
                    || (h.class == Class::Exited && h.keepers.is_empty() && h.kept_by_unseen)
            })
            .filter_map(|h| h.used_bytes)
            .fold(0, u64::saturating_add);
        let unaccounted = self
            .unaccounted
            .as_ref()
            .filter(|u| u.is_unexplained())
            .map_or(0, |u| u.bytes);
        foreign.saturating_add(unaccounted)
    }
}

/// One MIG device of a GPU: whose memory is on it, and how much of it is ghost.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigDeviceReport {
    /// GPU instance id.
    pub gpu_instance: Option<u32>,
    /// Compute instance id.
    pub compute_instance: Option<u32>,
    /// `MIG-…` UUID (what `reclaim --gpu` and `CUDA_VISIBLE_DEVICES` take).
    pub uuid: Option<String>,
    /// Name, e.g. `NVIDIA H200 MIG 3g.71gb`.
    pub name: Option<String>,
    /// Its memory.
    pub memory: Option<GpuMemory>,
    /// The pids of its holders (their details are in the GPU's holders).
    pub holders: Vec<u32>,
    /// Used memory none of its listed processes accounts for, beyond the tolerance: residue
    /// on this MIG device (0 when within the tolerance).
    pub unaccounted_bytes: u64,
    /// Ghost memory on it: its orphan and zombie holders' memory here, and its unaccounted
    /// memory.
    pub ghost_bytes: u64,
}

/// A pod by its names, from the kubelet's pod-resources API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodName {
    /// Namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Container name.
    pub container: String,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// When the snapshot was taken, milliseconds since the Unix epoch.
    pub taken_at_ms: u64,
    /// Host name.
    pub hostname: Option<String>,
    /// Whether vramguard sees the host's PID namespace.
    pub pid_namespace_is_host: Option<bool>,
    /// vramguard's effective uid.
    pub euid: u32,
    /// vramguard's effective capabilities, when read (see [`crate::snapshot::Privileges`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cap_effective: Option<u64>,
    /// The driver.
    pub driver: DriverFacts,
    /// One entry per GPU.
    pub gpus: Vec<GpuReport>,
    /// What could not be seen, and why.
    pub limitations: Vec<String>,
    /// Whether every process's fds were scanned.
    pub full_fd_scan: bool,
    /// Host memory: RAM, pressure, shared-memory segments and what dead jobs hold; `None`
    /// when the snapshot has no host facts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<crate::host::HostReport>,
}

impl Report {
    /// What the vramguard that made this report could see and do.
    pub fn privileges(&self) -> crate::snapshot::Privileges {
        crate::snapshot::Privileges {
            euid: self.euid,
            cap_effective: self.cap_effective,
        }
    }
}

impl Report {
    /// Ghost bytes over all GPUs.
    pub fn ghost_bytes(&self) -> u64 {
        self.gpus
            .iter()
            .map(|g| g.ghost_bytes)
            .fold(0, u64::saturating_add)
    }

    /// Bytes whose holder vramguard cannot see from here, over all GPUs: listed pids of a PID
    /// namespace it cannot see, and unaccounted memory it cannot attribute (see
    /// [`Unaccounted::is_unexplained`]). Never counted as "accounted for by a live job".
    pub fn unexplained_bytes(&self) -> u64 {
        self.gpus
            .iter()
            .map(GpuReport::unexplained_bytes)
            .fold(0, u64::saturating_add)
    }

    /// One sentence on the memory vramguard cannot attribute from where it runs (see
    /// [`Report::unexplained_bytes`]): how much, on which GPUs, why, and what shows it;
    /// `None` when there is none.
    pub fn unexplained_summary(&self) -> Option<String> {
        let bytes = self.unexplained_bytes();
        if bytes == 0 {
            return None;
        }
        let gpus: Vec<String> = self
            .gpus
            .iter()
            .filter(|g| g.unexplained_bytes() > 0)
            .map(|g| g.index.to_string())
            .collect();
        let holders = || self.gpus.iter().flat_map(|g| &g.holders);
        let causes = || self.gpus.iter().filter_map(|g| g.unaccounted.as_ref());
        let mut why = Vec::new();
        if holders().any(|h| h.class == Class::Exited && h.kept_by_unseen) {
            why.push("exited pids whose keepers are other users' processes");
        }
        if holders().any(|h| h.class == Class::Foreign)
            || causes()
                .any(|u| u.is_unexplained() && u.cause == Some(UnaccountedCause::OtherNamespace))
        {
            why.push("processes of another PID namespace");
        }
        if causes().any(|u| u.is_unexplained() && u.cause == Some(UnaccountedCause::Unknown)) {
            why.push("holders whose open files could not be read");
        }
        let advice = if self.pid_namespace_is_host == Some(false) {
            "run vramguard on the host (or in a pod with hostPID: true)"
        } else {
            "run vramguard as root to see them"
        };
        Some(format!(
            "{} on GPU {} is held by what vramguard cannot see from here ({}): not known to be a \
             live job's; {advice}",
            crate::units::format_bytes(bytes),
            gpus.join(","),
            why.join("; ")
        ))
    }

    /// Every holder of every GPU, with its GPU index.
    pub fn holders(&self) -> impl Iterator<Item = (u32, &Holder)> {
        self.gpus
            .iter()
            .flat_map(|g| g.holders.iter().map(move |h| (g.index, h)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The class table has one row per class, in the order of [`Class::ALL`], with unique
    /// names and ranks. The match below fails to compile when a class is added: give it a
    /// row in [`CLASSES`] (and a rule in the planner).
    #[test]
    fn the_class_table_has_one_row_per_class() {
        fn every_class_listed_here(c: Class) -> usize {
            match c {
                Class::Active
                | Class::Idle
                | Class::Orphan
                | Class::Detached
                | Class::Zombie
                | Class::Exited
                | Class::Foreign
                | Class::Hidden
                | Class::System => 9,
            }
        }
        assert_eq!(CLASSES.len(), every_class_listed_here(Class::Active));
        let mut names: Vec<&str> = CLASSES.iter().map(|i| i.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), CLASSES.len());
        let mut ranks: Vec<u8> = CLASSES.iter().map(|i| i.rank).collect();
        ranks.sort();
        assert_eq!(ranks, (0..CLASSES.len() as u8).collect::<Vec<_>>());
        for (i, c) in Class::ALL.iter().enumerate() {
            assert_eq!(CLASSES[i].class, *c);
            assert_eq!(c.as_str().parse::<Class>(), Ok(*c));
        }
        // Ghost memory is never a live job's, and what is never reclaimed is no default.
        for info in CLASSES {
            assert!(!(info.ghost && info.tone == Tone::Working), "{}", info.name);
            assert!(
                !(info.default_target && info.reclaim != ReclaimRule::WhenIncluded),
                "{}",
                info.name
            );
        }
        assert_eq!(
            Class::default_targets().collect::<Vec<_>>(),
            vec![Class::Orphan, Class::Hidden]
        );
        assert!(Class::Detached.check_target(false).is_ok());
        assert!(Class::Detached.check_target(true).is_err());
        assert!(Class::Exited.check_target(false).is_err());
    }
}
