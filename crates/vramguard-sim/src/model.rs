//! The simulation: evaluates the state file against the live process table.

use crate::namespace::{CallerNamespace, CallerPids};
use crate::state::{AfterExit, AllocationKind, Quirk, SimHealth, SimState, StateError};
use rustix::fd::OwnedFd;
use rustix::process::{Pid, PidfdFlags};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use vramguard_proc::parse::Stat;
use vramguard_proc::{Found, ProcFs};

/// Why the simulator could not answer.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The state file is unusable.
    #[error(transparent)]
    State(#[from] StateError),
    /// The runtime file (the simulator's memory) could not be read or written.
    #[error("simulator runtime file {path}: {reason}")]
    Runtime {
        /// The file.
        path: PathBuf,
        /// What failed.
        reason: String,
    },
    /// A reset was refused because processes still use the GPU.
    #[error("GPU {gpu} is in use by {}: a reset needs every client gone", describe_pids(.pids))]
    InUse {
        /// The GPU.
        gpu: u32,
        /// The processes using it.
        pids: Vec<u32>,
    },
    /// No such GPU.
    #[error("GPU {gpu} does not exist (the simulator has {count})")]
    NoSuchGpu {
        /// The index asked for.
        gpu: u32,
        /// How many exist.
        count: usize,
    },
}

fn describe_pids(pids: &[u32]) -> String {
    let list: Vec<String> = pids.iter().map(|p| format!("pid {p}")).collect();
    list.join(", ")
}

/// One process as the driver lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedProcess {
    /// The pid the driver reports (`reported_pid` if set).
    pub pid: u32,
    /// Which list.
    pub kind: AllocationKind,
    /// Memory; `None` in the whole GPU's lists in MIG mode (NVML_VALUE_NOT_AVAILABLE).
    pub used_bytes: Option<u64>,
    /// GPU and compute instance ids, on a MIG device (`0xFFFFFFFF` otherwise).
    pub mig_ids: Option<(u32, u32)>,
}

/// One MIG device of a GPU in MIG mode, as its own handle reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedMigDevice {
    /// GPU instance id.
    pub gpu_instance: u32,
    /// Compute instance id.
    pub compute_instance: u32,
    /// `MIG-…`, derived from the GPU's UUID.
    pub uuid: String,
    /// Profile, e.g. `3g.71gb`.
    pub profile: String,
    /// Its memory.
    pub total: u64,
    /// Used by the allocations on it.
    pub used: u64,
    /// Its processes, with their memory.
    pub processes: Vec<ObservedProcess>,
}

impl ObservedGpu {
    /// Utilization of the whole GPU from its busy processes: (SM %, memory %), each capped
    /// at 100.
    pub fn gpu_utilization(&self) -> (u32, u32) {
        let sum = |f: fn(&ObservedUtilization) -> u32| {
            self.utilization.iter().map(f).sum::<u32>().min(100)
        };
        // An idle context's 1 % sample is no load: the real H200 read 0 % for the whole GPU.
        (
            sum(|u| {
                if u.sm_util > IDLE_CONTEXT_SM_PERCENT {
                    u.sm_util
                } else {
                    0
                }
            }),
            sum(|u| u.mem_util),
        )
    }

    /// Temperature, °C: 30 idle, rising with the SM utilization to 75.
    pub fn temperature_c(&self) -> u32 {
        30 + self.gpu_utilization().0 * 45 / 100
    }

    /// The board power limit in milliwatts, by model (what `nvidia-smi -q -d POWER` shows).
    pub fn power_limit_mw(&self) -> u32 {
        if self.name.contains("V100") {
            300_000
        } else if self.name.contains("A100") {
            400_000
        } else {
            700_000
        }
    }

    /// What `nvmlDeviceGetFanSpeed` answers: no board modelled here has a fan of its own.
    /// Driver 580.159.04 on a real SXM H200 answers `INVALID_ARGUMENT` (its fan 0 does not
    /// exist), not `NOT_SUPPORTED`; the other models keep `NOT_SUPPORTED`, unmeasured.
    pub fn fan_speed_error(&self) -> u32 {
        if self.name.contains("H200") {
            crate::codes::INVALID_ARGUMENT
        } else {
            crate::codes::NOT_SUPPORTED
        }
    }

    /// Power draw in milliwatts: 75 W idle, rising with the SM utilization to the limit.
    pub fn power_draw_mw(&self) -> u32 {
        let idle = 75_000;
        idle + (self.power_limit_mw() - idle) / 100 * self.gpu_utilization().0
    }
}

/// One utilization sample.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedUtilization {
    /// Reported pid.
    pub pid: u32,
    /// Microseconds since the Unix epoch (NVML's unit).
    pub timestamp_us: u64,
    /// SM percent.
    pub sm_util: u32,
    /// Memory percent.
    pub mem_util: u32,
}

/// The SM utilization the driver reports for a context that does no work: a real H200 (driver
/// 580.159.04) gave `smUtil = 1` for idle contexts (two spawned workers that had only filled
/// 1 GiB at start, and a dead creator whose forked children kept its context), where a matmul
/// loop reads 37-95 %. The whole GPU's utilization stays 0 with such contexts.
pub const IDLE_CONTEXT_SM_PERCENT: u32 = 1;

/// How often the driver samples per-process utilization (about six times a second): a
/// sample's timestamp is the start of its period, so calls within one period see the same
/// sample, and a caller passing it back as `lastSeenTimeStamp` gets `NOT_FOUND` until the
/// next one, as from a real driver.
pub const UTILIZATION_SAMPLE_PERIOD_US: u64 = 166_667;

/// The timestamp of the latest utilization sample at `now_ms`.
pub fn last_utilization_sample_us(now_ms: u64) -> u64 {
    now_ms * 1000 / UTILIZATION_SAMPLE_PERIOD_US * UTILIZATION_SAMPLE_PERIOD_US
}

/// One GPU, as the driver would report it now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObservedGpu {
    /// Index.
    pub index: u32,
    /// UUID.
    pub uuid: String,
    /// Name.
    pub name: String,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// Total memory.
    pub total: u64,
    /// Reserved memory.
    pub reserved: u64,
    /// Used memory: baseline plus every allocation still held.
    pub used: u64,
    /// Free memory.
    pub free: u64,
    /// Persistence mode.
    pub persistence_mode: bool,
    /// MIG mode.
    pub mig: bool,
    /// The MIG devices, in MIG mode.
    pub mig_devices: Vec<ObservedMigDevice>,
    /// Listed processes, aggregated per (pid, kind).
    pub processes: Vec<ObservedProcess>,
    /// Utilization of busy listed processes.
    pub utilization: Vec<ObservedUtilization>,
    /// Quirks in effect.
    pub quirks: Vec<Quirk>,
    /// Memory health.
    pub health: SimHealth,
}

/// What the driver would answer at one instant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observation {
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Driver version.
    pub driver_version: String,
    /// NVML version.
    pub nvml_version: String,
    /// GPUs.
    pub gpus: Vec<ObservedGpu>,
}

/// The simulator's memory between processes: when it first saw each pid alive and gone, and
/// when each GPU was reset. Kept beside the state file as `<state>.runtime.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Runtime {
    /// Per pid.
    #[serde(default)]
    pub processes: BTreeMap<u32, PidRecord>,
    /// Resets, oldest first.
    #[serde(default)]
    pub resets: Vec<ResetRecord>,
    /// Contexts whose lock was first seen gone, and when (sticky: a closed open file
    /// description never reopens).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub closed_contexts: Vec<ClosedContext>,
}

/// A context whose open file description was closed everywhere (its lock gone).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClosedContext {
    /// GPU index.
    pub gpu: u32,
    /// The lock offset ([`crate::context::lock_offset`]).
    pub lock: u64,
    /// When the simulator first saw the lock gone, milliseconds since the Unix epoch.
    pub since_ms: u64,
}

/// What the simulator knows about one pid.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PidRecord {
    /// Start time (clock ticks) when first seen alive: a later process with the same pid but
    /// another start time is not the holder.
    pub start_ticks: Option<u64>,
    /// When first seen gone (sticky).
    pub gone_since_ms: Option<u64>,
}

/// A reset of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResetRecord {
    /// GPU index.
    pub gpu: u32,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
}

/// What a successful reset cleared.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetOutcome {
    /// The GPU.
    pub gpu: u32,
    /// Bytes of residue and lagging releases cleared.
    pub cleared_bytes: u64,
}

/// Identity of a file version, to reload only on change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Stamp {
        modified: m.modified().ok(),
        len: m.len(),
        inode: m.ino(),
    })
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Whether a process still holds its device files, per the simulator's rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Life {
    Alive { start_ticks: Option<u64> },
    Gone,
}

/// Whether `proc_root/PID` exists and is not a zombie whose threads have all exited. A zombie
/// leader whose other threads still run (or sleep in D) still holds the device, as on real
/// drivers: files are closed when the last thread leaves `do_exit`.
///
/// `held` is a `stat` file kept open for this pid: re-read with one `pread`, and tied to the
/// process it was opened for, so a reused pid reads as gone.
fn life_of(proc: Option<&ProcFs>, pid: u32, held: &mut Option<OwnedFd>) -> Life {
    let Some(proc) = proc else {
        return Life::Gone;
    };
    let read = match held {
        Some(fd) => proc.reread_stat(pid, fd),
        None => match proc.open_stat(pid) {
            Ok(Found::Yes(fd)) => {
                let read = proc.reread_stat(pid, &fd);
                *held = Some(fd);
                read
            }
            _ => Ok(Found::Gone),
        },
    };
    let Ok(Found::Yes(Stat {
        state: Some(state),
        start_ticks,
        ..
    })) = read
    else {
        *held = None;
        return Life::Gone;
    };
    if matches!(state, 'Z' | 'X') {
        let others_alive = match proc.threads(pid) {
            Ok(Found::Yes(threads)) => threads
                .iter()
                .any(|t| t.tid != pid && !matches!(t.state, 'Z' | 'X' | '?')),
            _ => false,
        };
        if !others_alive {
            return Life::Gone;
        }
    }
    Life::Alive { start_ticks }
}

/// A fault a call met: the code to return, after stalling this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultHit {
    /// The `nvmlReturn_t` to return; `None`: the call succeeds (after its stall).
    pub code: Option<u32>,
    /// How long the call blocks first.
    pub stall: Option<Duration>,
}

/// The simulated driver.
#[derive(Debug)]
pub struct Sim {
    path: PathBuf,
    state: SimState,
    state_stamp: Option<Stamp>,
    runtime: Runtime,
    runtime_stamp: Option<Stamp>,
    calls: HashMap<String, HashMap<Option<u32>, u64>>,
    cache: Option<(Instant, std::sync::Arc<Observation>)>,
    cache_ttl: Duration,
    /// The lifetime to restore when a held instant ends ([`Sim::hold_instant`]).
    held_ttl: Option<Duration>,
    /// How each allocation pid seen alive is followed between observations.
    tracked: HashMap<u32, Tracked>,
    /// Every tracked pidfd in one epoll set, asked for the exited ones: polling each of 200
    /// pidfds at every observation was half the simulated driver's cost per sample, which no
    /// real driver pays. `None` where epoll failed: each pidfd is then polled.
    exit_set: Option<vramguard_proc::exits::ExitSet>,
    /// The state's `proc_root`, open (`None` when it cannot be opened: every process there
    /// reads as gone).
    proc: Option<ProcFs>,
    /// `proc_root` shows this process's PID namespace, so a pidfd names the same process as
    /// `proc_root/PID`.
    pidfds_usable: bool,
    /// The calling process's PID namespace, below `proc_root`'s: the driver reports pids as
    /// the caller's namespace numbers them, and leaves out those it cannot see.
    caller: CallerNamespace,
    /// Holders' pids in the caller's namespace, remembered while they lived.
    caller_pids: CallerPids,
}

/// Whether a context's open file description is still open somewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ContextState {
    /// Its lock is held.
    Open,
    /// Its lock is gone, first seen at this time (ms since the epoch).
    Closed(u64),
    /// The lock could not be asked about (the device file is missing): its pid decides.
    Unknown,
}

/// Each locked context's state, by (GPU, lock offset).
type Contexts = HashMap<(u32, u64), ContextState>;

/// A pid the simulator saw alive, and how it learns that the process finished exiting.
#[derive(Debug)]
enum Tracked {
    /// A pidfd: readable once the whole thread group has exited (files closed), which is
    /// exactly when a real driver releases; one `poll` answers for every tracked pid.
    Pidfd {
        fd: rustix::fd::OwnedFd,
        start_ticks: Option<u64>,
    },
    /// Its `stat` file, re-read with one `pread` (a `proc_root` of another PID namespace).
    Stat(OwnedFd),
}

/// Whether `proc_root` is this process's PID namespace: its `self` names our pid.
fn proc_root_is_ours(proc: Option<&ProcFs>) -> bool {
    proc.and_then(ProcFs::self_pid) == Some(std::process::id())
}

impl Sim {
    /// Opens the state file at `path`.
    pub fn open(path: impl Into<PathBuf>) -> Result<Sim, SimError> {
        let path = path.into();
        let state = SimState::load(&path)?;
        let mut sim = Sim {
            state_stamp: stamp(&path),
            path,
            state,
            runtime: Runtime::default(),
            runtime_stamp: None,
            calls: HashMap::new(),
            cache: None,
            cache_ttl: Duration::from_millis(1),
            held_ttl: None,
            tracked: HashMap::new(),
            exit_set: vramguard_proc::exits::ExitSet::new(),
            proc: None,
            pidfds_usable: false,
            caller: CallerNamespace::default(),
            caller_pids: CallerPids::default(),
        };
        sim.open_proc_root();
        sim.reload_runtime()?;
        Ok(sim)
    }

    /// The pid in `proc_root`'s namespace of the process the caller knows as `pid` (the same
    /// number for a caller in that namespace), `None` when the caller has no such process: a
    /// driver looks up the pids its callers pass in their own namespace.
    pub fn proc_root_pid(&self, pid: u32) -> Option<u32> {
        match &self.proc {
            Some(proc) => self.caller.root_pid_of(proc, pid),
            None => self.caller.is_root().then_some(pid),
        }
    }

    /// The state's `proc_root`, through which every process is looked at.
    pub fn proc(&self) -> Option<&ProcFs> {
        self.proc.as_ref()
    }

    /// (Re)opens the state's `proc_root` and learns where the caller sits in it.
    fn open_proc_root(&mut self) {
        self.proc = ProcFs::open(&self.state.proc_root).ok();
        self.pidfds_usable = proc_root_is_ours(self.proc.as_ref());
        self.caller = self
            .proc
            .as_ref()
            .map(CallerNamespace::of_self)
            .unwrap_or_default();
    }

    /// The state file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current state (reloaded on change by [`Sim::observe`]).
    pub fn state(&self) -> &SimState {
        &self.state
    }

    /// Sets how long an observation is reused (default 1 ms), so that the calls of one
    /// collection see one instant, as the count and fill calls of a real driver usually do.
    pub fn set_cache_ttl(&mut self, ttl: Duration) {
        self.cache_ttl = ttl;
    }

    /// Forgets the cached observation: the next [`Sim::observe`] reads the processes again.
    pub fn invalidate(&mut self) {
        self.cache = None;
    }

    /// Takes a fresh observation at the next call and keeps it until [`Sim::release_instant`]:
    /// every call of one sample sees one instant, as a real driver's usually do.
    pub fn hold_instant(&mut self) {
        self.invalidate();
        self.held_ttl.get_or_insert(self.cache_ttl);
        self.cache_ttl = Duration::from_secs(3600);
    }

    /// Ends [`Sim::hold_instant`]: the next call observes afresh.
    pub fn release_instant(&mut self) {
        if let Some(ttl) = self.held_ttl.take() {
            self.cache_ttl = ttl;
        }
        self.invalidate();
    }

    /// The observation cache's lifetime.
    pub fn cache_ttl(&self) -> Duration {
        self.cache_ttl
    }

    fn reload_state(&mut self) -> Result<(), SimError> {
        let now = stamp(&self.path);
        if now != self.state_stamp || now.is_none() {
            let state = SimState::load(&self.path)?;
            let moved = state.proc_root != self.state.proc_root;
            self.state = state;
            self.state_stamp = now;
            if moved {
                self.untrack_where(|_| true);
                self.open_proc_root();
                self.caller_pids = CallerPids::default();
            }
        }
        Ok(())
    }

    fn reload_runtime(&mut self) -> Result<(), SimError> {
        let path = runtime_path(&self.path);
        let now = stamp(&path);
        if now == self.runtime_stamp && now.is_some() {
            return Ok(());
        }
        self.runtime = read_runtime(&path)?;
        self.runtime_stamp = now;
        Ok(())
    }

    /// Counts a call of `call` (on `gpu`) and returns the error code to inject, if any, after
    /// the fault's stall, if it has one.
    pub fn fault(&mut self, call: &str, gpu: Option<u32>) -> Option<u32> {
        let hit = self.fault_hit(call, gpu)?;
        if let Some(stall) = hit.stall {
            std::thread::sleep(stall);
        }
        hit.code
    }

    /// Counts a call of `call` (on `gpu`) and says which fault it meets, if any, without
    /// stalling: a caller that holds the model behind a lock sleeps after releasing it, so
    /// that one stalled GPU does not hold up calls to the others. The state file is read
    /// again first (when it changed), so that a fault removed from it stops at once, as a
    /// driver that recovers does.
    pub fn fault_hit(&mut self, call: &str, gpu: Option<u32>) -> Option<FaultHit> {
        // A state file that cannot be read now keeps the faults last read.
        let _ = self.reload_state();
        // The call's name is allocated once, at its first call.
        let per_gpu = match self.calls.get_mut(call) {
            Some(m) => m,
            None => self.calls.entry(call.to_string()).or_default(),
        };
        let count = per_gpu.entry(gpu).or_insert(0);
        let n = *count;
        *count += 1;
        let faults = match gpu {
            None => &self.state.faults,
            Some(g) => match self.state.gpus.get(g as usize) {
                Some(gpu) => &gpu.faults,
                None => return None,
            },
        };
        let fault = faults.iter().find(|f| {
            f.call == call
                && n >= f.after_calls
                && f.times.is_none_or(|t| n < f.after_calls.saturating_add(t))
        })?;
        Some(FaultHit {
            code: (fault.code != 0).then_some(fault.code),
            stall: fault.delay_ms.map(Duration::from_millis),
        })
    }

    /// What the driver would report now.
    pub fn observe(&mut self) -> Result<Observation, SimError> {
        Ok(std::sync::Arc::unwrap_or_clone(self.observed()?))
    }

    /// [`Sim::observe`], shared: every call of one sample reads the same observation, and a
    /// copy of every GPU's processes for each of them was most of the simulated driver's cost.
    pub fn observed(&mut self) -> Result<std::sync::Arc<Observation>, SimError> {
        if let Some((at, obs)) = &self.cache
            && at.elapsed() < self.cache_ttl
        {
            return Ok(obs.clone());
        }
        self.reload_state()?;
        self.reload_runtime()?;
        let now = now_ms();
        // Locks before pids: a context read open whose creator is then found gone is listed as
        // a dead creator's for that instant, which is what the driver shows then too.
        let contexts = self.update_contexts(now)?;
        let lives = self.update_lives(now)?;
        let shown = self.caller_pids(&lives);
        let obs = std::sync::Arc::new(self.evaluate(now, &lives, &contexts, &shown));
        self.cache = Some((Instant::now(), obs.clone()));
        Ok(obs)
    }

    /// The pid each allocation's process has in the caller's PID namespace (`None`: the caller
    /// cannot see it, and the driver lists it nowhere). A caller in `proc_root`'s namespace
    /// sees every pid as the state names it, or its `reported_pid` (a driver that reports a
    /// pid from the holder's own namespace); a caller in a namespace below sees a holder only
    /// in its namespace or one nested in it, by its pid there, whatever `reported_pid` says.
    fn caller_pids(&mut self, lives: &HashMap<u32, Life>) -> Vec<Option<u32>> {
        let mut shown = Vec::with_capacity(self.state.allocations.len());
        for a in &self.state.allocations {
            let pid = if self.caller.is_root() {
                Some(a.reported_pid.unwrap_or(a.pid))
            } else {
                match lives.get(&a.pid) {
                    Some(Life::Alive { start_ticks }) => match &self.proc {
                        Some(proc) => {
                            self.caller_pids
                                .alive(&self.caller, proc, a.pid, *start_ticks)
                        }
                        None => None,
                    },
                    _ => self.caller_pids.gone(a.pid).or_else(|| {
                        a.namespace
                            .as_ref()
                            .and_then(|n| self.caller.recorded_pid(n))
                    }),
                }
            };
            shown.push(pid);
        }
        if !self.caller.is_root() {
            let state = &self.state;
            self.caller_pids
                .retain(|p| state.allocations.iter().any(|a| a.pid == p));
        }
        shown
    }

    /// The tracked pids whose pidfd says the process finished exiting.
    fn poll_pidfds(&mut self) -> std::collections::HashSet<u32> {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        if let Some(set) = &self.exit_set {
            // A pidfd leaves the set when it is no longer tracked (`untrack_where`).
            match set.ready(self.tracked.len()) {
                Ok(ready) => return ready.into_iter().collect(),
                Err(_) => self.exit_set = None,
            }
        }
        let (pids, mut fds): (Vec<u32>, Vec<PollFd<'_>>) = self
            .tracked
            .iter()
            .filter_map(|(pid, t)| match t {
                Tracked::Pidfd { fd, .. } => Some((*pid, PollFd::new(fd, PollFlags::IN))),
                Tracked::Stat(_) => None,
            })
            .unzip();
        if fds.is_empty() {
            return Default::default();
        }
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        if poll(&mut fds, Some(&now)).is_err() {
            return Default::default();
        }
        pids.into_iter()
            .zip(fds)
            .filter(|(_, fd)| !fd.revents().is_empty())
            .map(|(pid, _)| pid)
            .collect()
    }

    /// Stops following the pids `gone` names. Their pidfds leave the exit set before they
    /// are closed: closing alone would leave them in it while a child forked meanwhile (an
    /// alert command of the agent this runs in) still holds a copy, reporting an exit for
    /// a pid no longer followed.
    fn untrack_where(&mut self, gone: impl Fn(u32) -> bool) {
        let set = &self.exit_set;
        self.tracked.retain(|pid, t| {
            let keep = !gone(*pid);
            if !keep && let (Some(set), Tracked::Pidfd { fd, .. }) = (set, &*t) {
                set.remove(fd);
            }
            keep
        });
    }

    /// Whether `pid` is alive (not finished exiting), from its pidfd when tracked by one
    /// (checked by [`Sim::poll_pidfds`] already), else from `/proc`; starts tracking it.
    fn life_of(&mut self, pid: u32) -> Life {
        let proc = self.proc.as_ref();
        let mut held = match self.tracked.remove(&pid) {
            Some(Tracked::Pidfd { fd, start_ticks }) => {
                self.tracked.insert(pid, Tracked::Pidfd { fd, start_ticks });
                return Life::Alive { start_ticks };
            }
            Some(Tracked::Stat(f)) => Some(f),
            None => None,
        };
        let life = life_of(proc, pid, &mut held);
        let Life::Alive { start_ticks } = life else {
            return life;
        };
        let pidfd = self
            .pidfds_usable
            .then(|| Pid::from_raw(pid as i32))
            .flatten()
            .and_then(|p| rustix::process::pidfd_open(p, PidfdFlags::empty()).ok());
        match pidfd {
            // The held stat file belongs to the process first read: if it still reads alive,
            // the pid was not reused before the pidfd was opened.
            Some(fd) if matches!(life_of(proc, pid, &mut held), Life::Alive { .. }) => {
                if let Some(set) = &self.exit_set
                    && set.add(&fd, pid).is_err()
                {
                    // From now on every pidfd is polled.
                    self.exit_set = None;
                }
                self.tracked.insert(pid, Tracked::Pidfd { fd, start_ticks });
            }
            _ => {
                if let Some(f) = held {
                    self.tracked.insert(pid, Tracked::Stat(f));
                }
            }
        }
        life
    }

    /// Checks every allocation's process and records first sightings in the runtime file.
    fn update_lives(&mut self, now: u64) -> Result<HashMap<u32, Life>, SimError> {
        let mut changes: Vec<(u32, PidRecord)> = Vec::new();
        // Both sized once: grown step by step (a flattened iterator has no size hint), they
        // went through glibc's slow path several times per observation.
        let count = self
            .state
            .allocations
            .iter()
            .map(|a| 1 + a.held_by.len())
            .sum();
        let mut pids: Vec<u32> = Vec::with_capacity(count);
        for a in &self.state.allocations {
            pids.push(a.pid);
            pids.extend_from_slice(&a.held_by);
        }
        let mut lives = HashMap::with_capacity(pids.len());
        let exited = self.poll_pidfds();
        for pid in pids {
            if lives.contains_key(&pid) {
                continue;
            }
            let record = self
                .runtime
                .processes
                .get(&pid)
                .cloned()
                .unwrap_or_default();
            let mut life = if record.gone_since_ms.is_some() || exited.contains(&pid) {
                self.untrack_where(|p| p == pid);
                Life::Gone
            } else {
                self.life_of(pid)
            };
            if let Life::Alive { start_ticks } = life
                && record.start_ticks.is_some()
                && start_ticks != record.start_ticks
            {
                // The pid was reused: the holder is gone.
                life = Life::Gone;
            }
            let wanted = match life {
                Life::Alive { start_ticks } if record.start_ticks.is_none() => Some(PidRecord {
                    start_ticks,
                    gone_since_ms: None,
                }),
                Life::Gone if record.gone_since_ms.is_none() => Some(PidRecord {
                    start_ticks: record.start_ticks,
                    gone_since_ms: Some(now),
                }),
                _ => None,
            };
            if let Some(w) = wanted {
                changes.push((pid, w));
            }
            lives.insert(pid, life);
        }
        // Processes no allocation names any more need no following.
        self.untrack_where(|pid| !lives.contains_key(&pid));
        if !changes.is_empty() {
            self.update_runtime(|rt| {
                // A pid no allocation names is history, dead or alive (an allocation removed
                // before its process was seen to exit): drop it, so that neither the file
                // nor a long-running reader grows with every holder that came and went.
                rt.processes.retain(|pid, _| lives.contains_key(pid));
                for (pid, rec) in changes {
                    let entry = rt.processes.entry(pid).or_default();
                    // First writer wins: another process may have recorded it first.
                    if entry.start_ticks.is_none() {
                        entry.start_ticks = rec.start_ticks;
                    }
                    if entry.gone_since_ms.is_none() {
                        entry.gone_since_ms = rec.gone_since_ms;
                    }
                }
            })?;
            // Gone times are sticky and shared; use what the file says.
            for (pid, life) in lives.iter_mut() {
                if self
                    .runtime
                    .processes
                    .get(pid)
                    .is_some_and(|r| r.gone_since_ms.is_some())
                {
                    *life = Life::Gone;
                }
            }
        }
        Ok(lives)
    }

    /// Asks whether each allocation's context lock is still held, and records in the runtime
    /// file when one is first seen gone. The device file is opened for each question and
    /// closed at once: a descriptor kept open would make every process that observes the
    /// simulator look like a holder of the GPU (and refuse its reset).
    fn update_contexts(&mut self, now: u64) -> Result<Contexts, SimError> {
        let mut states: Contexts = HashMap::new();
        let mut closed: Vec<(u32, u64)> = Vec::new();
        let keys: Vec<(u32, u64)> = self
            .state
            .allocations
            .iter()
            .filter_map(|a| a.context_lock.map(|l| (a.gpu, l)))
            .collect();
        let closed_since = |rt: &Runtime, (gpu, lock): (u32, u64)| {
            rt.closed_contexts
                .iter()
                .find(|c| c.gpu == gpu && c.lock == lock)
                .map(|c| c.since_ms)
        };
        for key in keys {
            if states.contains_key(&key) {
                continue;
            }
            if let Some(t) = closed_since(&self.runtime, key) {
                states.insert(key, ContextState::Closed(t));
                continue;
            }
            let file = self.state.dev_dir.join(format!("nvidia{}", key.0));
            let state = match open_device_file(&file).map(|f| crate::context::held(&f, key.1)) {
                Ok(Ok(true)) => ContextState::Open,
                Ok(Ok(false)) => {
                    closed.push(key);
                    ContextState::Closed(now)
                }
                Ok(Err(_)) | Err(_) => ContextState::Unknown,
            };
            states.insert(key, state);
        }
        if !closed.is_empty() {
            self.update_runtime(|rt| {
                // A context no allocation names is history: dropped, as pids are.
                rt.closed_contexts
                    .retain(|c| states.contains_key(&(c.gpu, c.lock)));
                for (gpu, lock) in closed {
                    // First writer wins: another process may have seen it gone earlier.
                    if closed_since(rt, (gpu, lock)).is_none() {
                        rt.closed_contexts.push(ClosedContext {
                            gpu,
                            lock,
                            since_ms: now,
                        });
                    }
                }
            })?;
            for (key, state) in states.iter_mut() {
                if let Some(t) = closed_since(&self.runtime, *key) {
                    *state = ContextState::Closed(t);
                }
            }
        }
        Ok(states)
    }

    /// When every keeper of `a` is gone, the latest first sighting: its context's lock (or its
    /// pid, without a lock that could be asked about) and its `held_by`.
    fn all_gone_since(
        &self,
        a: &crate::state::SimAllocation,
        context: Option<ContextState>,
        now: u64,
    ) -> u64 {
        let pid_gone = |p: u32| {
            self.runtime
                .processes
                .get(&p)
                .and_then(|r| r.gone_since_ms)
                .unwrap_or(now)
        };
        let own = match context {
            Some(ContextState::Closed(t)) => t,
            _ => pid_gone(a.pid),
        };
        a.held_by.iter().map(|p| pid_gone(*p)).fold(own, u64::max)
    }

    fn last_reset(&self, gpu: u32) -> Option<u64> {
        self.runtime
            .resets
            .iter()
            .filter(|r| r.gpu == gpu)
            .map(|r| r.at_ms)
            .max()
    }

    /// Every GPU as configured, before any allocation is counted: baseline use, MIG devices
    /// empty, no process listed.
    fn idle_gpus(&self) -> Vec<ObservedGpu> {
        self.state
            .gpus
            .iter()
            .enumerate()
            .map(|(i, g)| ObservedGpu {
                index: i as u32,
                uuid: g.uuid.clone(),
                name: g.name.clone(),
                pci_bus_id: g.pci_bus_id.clone(),
                total: g.total_bytes,
                reserved: g.reserved_bytes,
                used: g.baseline_used_bytes,
                free: 0,
                persistence_mode: g.persistence_mode,
                mig: g.mig,
                mig_devices: g
                    .mig_devices
                    .iter()
                    .enumerate()
                    .map(|(m, d)| ObservedMigDevice {
                        gpu_instance: d.gpu_instance,
                        compute_instance: d.compute_instance,
                        uuid: format!("MIG-{}-{m:04x}", &g.uuid[4.min(g.uuid.len())..]),
                        profile: d.profile.clone(),
                        total: d.memory_bytes,
                        used: 0,
                        processes: Vec::new(),
                    })
                    .collect(),
                processes: Vec::new(),
                utilization: Vec::new(),
                quirks: g.quirks.clone(),
                health: g.health.clone(),
            })
            .collect()
    }

    fn evaluate(
        &self,
        now: u64,
        lives: &HashMap<u32, Life>,
        contexts: &Contexts,
        shown: &[Option<u32>],
    ) -> Observation {
        let mut gpus = self.idle_gpus();
        for (i, a) in self.state.allocations.iter().enumerate() {
            let gpu = &mut gpus[a.gpu as usize];
            let alive = matches!(lives.get(&a.pid), Some(Life::Alive { .. }));
            let context = a
                .context_lock
                .and_then(|l| contexts.get(&(a.gpu, l)).copied());
            // The context lives while its open file description is open anywhere (the creator
            // or processes that share it); without a lock to ask about, while its pid lives.
            let open = match context {
                Some(ContextState::Open) => true,
                Some(ContextState::Closed(_)) => false,
                Some(ContextState::Unknown) | None => alive,
            };
            let kept = open
                || a.held_by
                    .iter()
                    .any(|p| matches!(lives.get(p), Some(Life::Alive { .. })));
            // Once its keepers are gone: held through the teardown lag (and listed, as a real
            // driver lists a pid whose context it is still tearing down), or for good (residue,
            // never listed), or not at all.
            let (held, tearing_down) = if kept {
                (true, false)
            } else {
                let gone_since = self.all_gone_since(a, context, now);
                let reset_since = self.last_reset(a.gpu).is_some_and(|r| r >= gone_since);
                match a.after_exit {
                    AfterExit::Release => (false, false),
                    AfterExit::ReleaseAfterMs(lag) => {
                        let lagging = now < gone_since.saturating_add(lag) && !reset_since;
                        (lagging, lagging)
                    }
                    AfterExit::Leak => (!reset_since, false),
                }
            };
            if !held {
                continue;
            }
            gpu.used = gpu.used.saturating_add(a.bytes);
            let mut instance = a
                .mig_device
                .and_then(|m| gpu.mig_devices.get_mut(m as usize));
            if let Some(d) = instance.as_mut() {
                d.used = d.used.saturating_add(a.bytes);
            }
            // A context kept by others after its creator died stays listed under the dead
            // creator's pid, as a real driver lists it (nvidia-smi: "[Not Found]").
            if !(a.listed && (kept || tearing_down)) {
                continue;
            }
            // Memory is the GPU's; the pid is the caller's to see (or not).
            let Some(pid) = shown.get(i).copied().flatten() else {
                continue;
            };
            let mig = gpu.mig;
            let mig_ids = instance
                .as_ref()
                .map(|d| (d.gpu_instance, d.compute_instance));
            if let Some(d) = instance {
                list_process(&mut d.processes, pid, a.kind, Some(a.bytes), mig_ids);
            }
            list_process(
                &mut gpu.processes,
                pid,
                a.kind,
                (!mig).then_some(a.bytes),
                mig_ids,
            );
            // Every live context is sampled, an idle one at 1 % SM as on a real H200; a dead
            // creator's context does no work (its forked children cannot use it: CUDA does not
            // support fork), and one being torn down has no samples.
            if !mig && kept {
                let (sm_util, mem_util) = if alive {
                    (a.sm_util.max(IDLE_CONTEXT_SM_PERCENT), a.mem_util)
                } else {
                    (IDLE_CONTEXT_SM_PERCENT, 0)
                };
                gpu.utilization.push(ObservedUtilization {
                    pid,
                    timestamp_us: last_utilization_sample_us(now),
                    sm_util,
                    mem_util,
                });
            }
        }
        for g in &mut gpus {
            g.free = g.total.saturating_sub(g.reserved).saturating_sub(g.used);
        }
        Observation {
            at_ms: now,
            driver_version: self.state.driver_version.clone(),
            nvml_version: self.state.nvml_version(),
            gpus,
        }
    }

    /// The simulator's `nvidia-smi --gpu-reset -i N`: refused while any live process holds
    /// the GPU (an allocation, or its device file open); otherwise clears its residue.
    pub fn reset(&mut self, gpu: u32) -> Result<ResetOutcome, SimError> {
        let before = self.observed()?;
        let count = before.gpus.len();
        let Some(g) = before.gpus.get(gpu as usize) else {
            return Err(SimError::NoSuchGpu { gpu, count });
        };
        let mut pids: Vec<u32> = self
            .state
            .allocations
            .iter()
            .filter(|a| a.gpu == gpu)
            .filter(|a| {
                matches!(
                    life_of(self.proc.as_ref(), a.pid, &mut None),
                    Life::Alive { .. }
                )
            })
            .filter(|a| {
                self.runtime
                    .processes
                    .get(&a.pid)
                    .is_none_or(|r| r.gone_since_ms.is_none())
            })
            .map(|a| a.pid)
            .collect();
        if let Some(proc) = &self.proc {
            pids.extend(device_file_holders(proc, &self.state.dev_dir, gpu));
        }
        pids.sort_unstable();
        pids.dedup();
        if !pids.is_empty() {
            return Err(SimError::InUse { gpu, pids });
        }
        let baseline = self.state.gpus[gpu as usize].baseline_used_bytes;
        let cleared = g.used.saturating_sub(baseline);
        let at_ms = now_ms();
        self.update_runtime(|rt| rt.resets.push(ResetRecord { gpu, at_ms }))?;
        if self.state.gpus[gpu as usize].health_pending() {
            // A reset applies pending row remaps and page retirements.
            self.state = crate::store::update_state(&self.path, |s| {
                let h = &mut s.gpus[gpu as usize].health;
                if let Some(r) = h.remapped_rows.as_mut() {
                    r.pending = false;
                }
                if let Some(p) = h.retired_pages.as_mut() {
                    p.pending = false;
                }
            })?;
            self.state_stamp = stamp(&self.path);
        }
        self.cache = None;
        Ok(ResetOutcome {
            gpu,
            cleared_bytes: cleared,
        })
    }

    /// Read-modify-write of the runtime file under the state's lock.
    fn update_runtime(&mut self, change: impl FnOnce(&mut Runtime)) -> Result<(), SimError> {
        let path = runtime_path(&self.path);
        let _lock = crate::store::lock(&self.path)?;
        let mut rt = read_runtime(&path)?;
        change(&mut rt);
        let text = serde_json::to_string_pretty(&rt).map_err(|e| SimError::Runtime {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        crate::store::write_atomic(&path, text.as_bytes()).map_err(|e| SimError::Runtime {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        self.runtime = rt;
        self.runtime_stamp = stamp(&path);
        Ok(())
    }
}

/// `<state>.runtime.json`.
pub fn runtime_path(state: &Path) -> PathBuf {
    let mut p = state.as_os_str().to_owned();
    p.push(".runtime.json");
    PathBuf::from(p)
}

fn read_runtime(path: &Path) -> Result<Runtime, SimError> {
    // A regular file, bounded: a link to /dev/zero or a FIFO planted there is refused, not
    // read without end (red-team finding).
    match vramguard_fs::read_regular_to_string(path, vramguard_fs::MAX_INPUT_BYTES) {
        Ok(text) => serde_json::from_str(&text).map_err(|e| SimError::Runtime {
            path: path.to_path_buf(),
            reason: format!("{e} (delete the file to forget the simulator's history)"),
        }),
        Err(e) if e.is_not_found() => Ok(Runtime::default()),
        Err(e) => Err(SimError::Runtime {
            path: path.to_path_buf(),
            reason: e.reason(),
        }),
    }
}

/// Opens a stand-in device file without blocking: a FIFO planted there would stall a plain
/// open until a writer came.
pub(crate) fn open_device_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

/// Pids holding `dev_dir/nvidia<gpu>` open, in any of their fd tables under `proc_root` (a
/// thread's own included: a driver sees every open of its device). The calling process is
/// one of them when it holds the file: the reset it stands in for (`nvidia-smi
/// --gpu-reset`) runs as a process of its own, which a real driver refuses while the
/// process that started it holds the GPU (NVML's handles included).
pub fn device_file_holders(proc: &ProcFs, dev_dir: &Path, gpu: u32) -> Vec<u32> {
    let target = dev_dir.join(format!("nvidia{gpu}"));
    let Ok(pids) = proc.pid_lister().and_then(|mut l| l.list()) else {
        return Vec::new();
    };
    pids.into_iter()
        .filter(|&pid| {
            matches!(
                proc.holds_open_in_any_table(pid, &target),
                Ok(Found::Yes(true))
            )
        })
        .collect()
}

/// Lists `pid` in `list`, adding `bytes` to its entry of that kind when it has one.
fn list_process(
    list: &mut Vec<ObservedProcess>,
    pid: u32,
    kind: AllocationKind,
    bytes: Option<u64>,
    mig_ids: Option<(u32, u32)>,
) {
    match list.iter_mut().find(|p| p.pid == pid && p.kind == kind) {
        Some(p) => p.used_bytes = p.used_bytes.zip(bytes).map(|(a, b)| a.saturating_add(b)),
        None => list.push(ObservedProcess {
            pid,
            kind,
            used_bytes: bytes,
            mig_ids,
        }),
    }
}
