//! The process half of a snapshot, gathered incrementally.
//!
//! A full fd scan looks at every open file on the host: over 100 ms with 50,000 fds. The
//! driver already names most holders, so collections come in three depths:
//! - [`ScanDepth::Holders`] (the steady state): re-reads `stat` of the known holders, the pids
//!   the driver lists and their parents and job leaders, through fds kept open (one `pread`
//!   each; an fd never shows a reused pid, and a departed process reads as ESRCH). Listed pids
//!   not seen before are fd-scanned. Cost: O(holders), whatever the host runs.
//! - [`ScanDepth::NewProcesses`]: also lists `/proc` and fd-scans the processes not seen
//!   before.
//! - [`ScanDepth::Full`]: fd-scans every process, on every core. Needed to find a hidden
//!   holder that was already running before it opened the device; callers request it for
//!   `diagnose`, when a GPU shows unaccounted memory, and periodically.

use crate::address_space::AddressSpaceReads;
use crate::devices::DeviceTable;
use crate::parse::{Stat, Status, StatusMemory};
use crate::procfs::{Found, MAX_THREADS_LOOKED_AT, PidLister, ProcError, ProcFs};
use rustix::fd::OwnedFd;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vramguard_core::host::{HostMemoryFacts, ProcessHostMemory, ShmDirFacts};
use vramguard_core::job::{JobKind, cgroup_job};
use vramguard_core::snapshot::{
    DepartedProcess, DriverLibrary, ExeFacts, FdScan, HostFacts, JobCgroupFacts, PF_EXITING,
    ProcessFacts, ScanFacts,
};

/// How deep a collection looks (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanDepth {
    /// Scan the fds of every process.
    Full,
    /// [`ScanDepth::Full`], and the fd tables of threads that have one of their own
    /// (`unshare(CLONE_FILES)`), which the process's `fd/` does not show: for the look right
    /// before a GPU reset, which must see every holder of the device (a task list and a
    /// `kcmp` per thread on top of a full scan).
    Thorough,
    /// List `/proc`; scan the fds of processes not seen before and of listed pids.
    NewProcesses,
    /// Known holders, listed pids and their relatives only; no listing of `/proc`.
    Holders,
    /// Like [`ScanDepth::Holders`], but re-reads nothing unless something exited: facts read
    /// by the last collection are reused while no watched process's pidfd says it exited (an
    /// exit changes states and re-parents children, so any exit means a full re-read). What
    /// no pidfd announces (a leader thread exiting while other threads live on, a change of
    /// process group) waits for the next [`ScanDepth::Holders`] collection.
    Cached,
}

impl ScanDepth {
    /// Whether every process's fds are scanned ([`ScanDepth::Full`] or deeper).
    pub fn scans_every_process(self) -> bool {
        matches!(self, ScanDepth::Full | ScanDepth::Thorough)
    }
}

/// The process half of a snapshot.
#[derive(Debug, Clone)]
pub struct Collected {
    /// Holders, their parents and job leaders, sorted by pid.
    pub processes: Vec<ProcessFacts>,
    /// Recently departed holders and leaders.
    pub departed: Vec<DepartedProcess>,
    /// How the facts were gathered.
    pub scan: ScanFacts,
    /// Facts about the host and vramguard.
    pub host: HostFacts,
    /// Liveness facts of the job cgroups (containers, pods, Slurm jobs) holders live in.
    pub job_cgroups: Vec<JobCgroupFacts>,
    /// Host memory; the shared-memory segments are those of the last full scan.
    pub host_memory: HostMemoryFacts,
}

#[derive(Debug, Default)]
struct Known {
    start_ticks: Option<u64>,
    /// Pinned, locked and shared memory, read at the last full scan.
    host_memory: Option<ProcessHostMemory>,
    devices: FdScan,
    /// Which driver libraries are mapped, read whenever a scan finds `/dev/nvidia-uvm` held.
    driver_library: Option<DriverLibrary>,
    /// Identity facts that do not change while the process lives (cmdline, uid, namespace,
    /// cgroup), read once.
    facts: Option<ProcessFacts>,
    /// Held a device or led a holder's job: remembered in `departed` when it exits.
    interesting: bool,
    /// `stat`, kept open for cheap re-reads.
    stat_fd: Option<OwnedFd>,
    /// A pidfd, readable once the process exited: what [`ScanDepth::Cached`] polls.
    pidfd: Option<OwnedFd>,
    /// The facts the last re-read produced, for [`ScanDepth::Cached`].
    last: Option<ProcessFacts>,
    /// The parent seen when the process was first read.
    first_ppid: Option<u32>,
    /// That parent's start time, read once while it was still the parent.
    first_parent_start: Option<u64>,
    /// Its pid in its innermost PID namespace when that is not this one (`Some(None)`: not
    /// nested), read once: a process never changes PID namespace.
    inner_pid: Option<Option<u32>>,
    /// The memory figures of the `status` its identity was read from, with the number of
    /// the collection that read it: host memory reuses them within that collection.
    status_memory: Option<(u64, StatusMemory)>,
}

/// The known processes holding a device file (sorted) and the number whose files were
/// unreadable.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DeviceIndex {
    holding: Vec<u32>,
    denied: usize,
}

const DEPARTED_KEEP: usize = 256;
/// Ancestors followed above a holder (its parent, the parent's parent...).
const MAX_ANCESTRY: usize = 64;
/// Bounds on reading one job cgroup's subtree: directories, member pids, members inspected.
const CGROUP_MAX_DIRS: usize = 256;
const CGROUP_MAX_PIDS: usize = 4096;
const CGROUP_MAX_INSPECTED: usize = 512;
/// Largest `cgroup.procs` read (a pid per line).
const CGROUP_PROCS_MAX_BYTES: u64 = 64 * 1024;
const DEPARTED_MAX_AGE_MS: u64 = 3_600_000;
/// The longest host memory (shared-memory segments and their users, each process's pinned,
/// locked and mapped memory) goes without a full read, whatever the depth.
pub const HOST_MEMORY_EVERY_MS: u64 = 60_000;
/// Below this many processes to fd-scan, threads cost more than they save.
const PARALLEL_SCAN_MIN: usize = 64;
/// Pids a scan thread takes at a time.
const SCAN_BATCH: usize = 16;

/// Gathers process facts, remembering what it saw between collections.
#[derive(Debug)]
pub struct ProcCollector {
    fs: Arc<ProcFs>,
    lister: PidLister,
    dev_dir: PathBuf,
    devices: DeviceTable,
    passwd: PathBuf,
    known: HashMap<u32, Known>,
    /// The device holders among `known` (by pid) and how many of them could not be scanned,
    /// kept between collections: each pass over thousands of large `Known` entries cost a
    /// cached sample more than everything else it reads. `None` once a scan result changed
    /// or a process was forgotten; see [`ProcCollector::device_index`].
    device_index: Option<DeviceIndex>,
    departed: VecDeque<DepartedProcess>,
    users: Option<HashMap<u32, String>>,
    host: HostFacts,
    open_stat_fds: usize,
    max_stat_fds: usize,
    /// Whether command lines are read (see [`ProcCollector::set_command_lines`]).
    command_lines: bool,
    /// The tree shows this process's PID namespace, so a pidfd names the process its pid
    /// names there.
    pidfds_usable: bool,
    /// This collection reads threads' own fd tables too ([`ScanDepth::Thorough`]).
    thorough: bool,
    /// Every process of the last collection has a pidfd and is not dying: a cached
    /// collection would re-read none of them ([`ProcCollector::nothing_exited`]).
    last_all_reusable: bool,
    /// Cgroup mount points (v2 and v1 hierarchies), from the tree's `self/mountinfo`.
    cgroup_mounts: Vec<PathBuf>,
    /// Job cgroup facts of the last collection, reused by [`ScanDepth::Cached`].
    last_job_cgroups: Vec<JobCgroupFacts>,
    /// Container names from the runtimes' state.
    containers: crate::containers::ContainerNames,
    /// Shared-memory directories to scan at full depth (`/dev/shm` by default).
    shm_dirs: Vec<PathBuf>,
    /// What the last full scan found in them.
    last_shm: Vec<ShmDirFacts>,
    /// When host memory (segments, each process's figures) was last read in full, on the
    /// `now_ms` clock of `collect`.
    host_memory_at_ms: Option<u64>,
    /// The tree's fork counter when `/proc` was last listed: a [`ScanDepth::NewProcesses`]
    /// collection that finds it unchanged skips the listing, since no process can be new.
    forks_at_listing: Option<u64>,
    /// Collections made so far, this one included.
    collections: u64,
    /// Processes seen opening a device file since the last collection: scanned by the next
    /// one, whatever its depth.
    opened: BTreeSet<u32>,
    /// Threads for reading many processes at once (the cores this process may use, at most
    /// 8), asked once: the answer reads cgroup files, too dear for every collection.
    threads: std::sync::OnceLock<usize>,
    /// Files of processes first seen in this collection, read on every core before the
    /// serial walk over holders and relatives takes them; empty between collections.
    first_reads: HashMap<u32, FirstRead>,
    /// Every pidfd in one epoll set: a collection asks it which exited instead of polling
    /// each (hundreds of holders, every sample). `None` where epoll could not be had or
    /// refused one: each pidfd is then polled.
    exit_set: Option<crate::exits::ExitSet>,
    /// Reads of address spaces (`cmdline`, `maps`), each with a deadline; started at the
    /// first such read.
    address_space: Option<AddressSpaceReads>,
    /// How long one of them may take.
    address_space_deadline: Duration,
    /// The most descendants one root's walk reads ([`MAX_DESCENDANTS_READ`]; tests lower it).
    descendants_budget: usize,
    /// Processes whose address space went unread (a read given up, or not tried while an
    /// earlier one is blocked): read again once nothing of theirs is blocked.
    address_space_unread: BTreeSet<u32>,
    /// The members of dead process groups, by group, from a pass over every process, with
    /// when it was made: reused for [`GROUP_MEMBERS_REUSE`] (the agent asks at every sample
    /// while a dead job's verdict rests on work).
    group_members: HashMap<u32, (Instant, Vec<u32>)>,
}

/// How long one pass over every process for a dead group's members is reused. A member forked
/// since by another is found among that one's descendants.
pub const GROUP_MEMBERS_REUSE: Duration = Duration::from_secs(30);

/// What the first read of a process takes from `/proc`: its `stat` (kept open for later
/// re-reads) and the files its identity comes from. After a full scan that finds hundreds of
/// holders, reading these one process after another was a fifth of `status`'s time; they
/// are read for all of them at once, on every core.
#[derive(Debug, Default)]
struct FirstRead {
    stat: Option<(OwnedFd, Stat)>,
    identity: Option<Result<IdentityFiles, ProcError>>,
}

/// The files [`ProcCollector::identity`] reads.
#[derive(Debug)]
struct IdentityFiles {
    status: Found<Status>,
    cmdline: Found<Vec<String>>,
    cgroup: Found<Option<String>>,
    exe: Found<ExeFacts>,
}

impl IdentityFiles {
    /// All but the command line, left unknown (as if denied): it is read under the
    /// process's mmap lock, so apart, with a deadline ([`ProcCollector::command_lines_of`]).
    fn read(fs: &ProcFs, pid: u32) -> Result<IdentityFiles, ProcError> {
        Ok(IdentityFiles {
            status: fs.status(pid)?,
            cmdline: Found::Denied,
            cgroup: fs.cgroup(pid)?,
            exe: fs.exe(pid)?,
        })
    }
}

impl FirstRead {
    /// Reads `stat` (kept open) and the identity files; `None` when the process is gone or
    /// unreadable (the serial walk then looks for itself).
    fn read(fs: &ProcFs, pid: u32) -> Option<FirstRead> {
        let Ok(Found::Yes(fd)) = fs.open_stat(pid) else {
            return None;
        };
        let Ok(Found::Yes(stat)) = fs.reread_stat(pid, &fd) else {
            return None;
        };
        // Whether they are this process's, not a reused pid's, is checked when they are
        // taken (`refresh`), as for files read then.
        Some(FirstRead {
            stat: Some((fd, stat)),
            identity: Some(IdentityFiles::read(fs, pid)),
        })
    }
}

/// `f` of each pid, on up to `threads` threads (the calling one included), handed out
/// [`SCAN_BATCH`] pids at a time from one counter: processes differ widely in cost (fd
/// tables of 3 and of 3,000), and fixed shares left one thread idle while another worked.
/// Only for reads that take no process's mmap lock: those go to [`AddressSpaceReads`],
/// whose reads can be given up.
fn on_every_core<T: Send>(
    pids: &[u32],
    threads: usize,
    f: impl Fn(u32) -> T + Sync,
) -> Vec<(u32, T)> {
    let run = |chunk: &[u32]| chunk.iter().map(|&pid| (pid, f(pid))).collect::<Vec<_>>();
    if pids.len() < PARALLEL_SCAN_MIN || threads < 2 {
        return run(pids);
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let take = || {
        let at = next.fetch_add(SCAN_BATCH, std::sync::atomic::Ordering::Relaxed);
        pids.get(at..(at + SCAN_BATCH).min(pids.len()))
    };
    std::thread::scope(|scope| {
        let work = || {
            let mut done = Vec::new();
            while let Some(batch) = take() {
                done.extend(run(batch));
            }
            done
        };
        let helpers: Vec<_> = (1..threads).map(|_| scope.spawn(work)).collect();
        let mut all = work();
        for h in helpers {
            all.extend(h.join().expect("a /proc reading thread panicked"));
        }
        all
    })
}

impl ProcCollector {
    /// A collector over the tree at `proc_root`, looking for device files in `dev_dir`.
    pub fn new(
        proc_root: impl Into<PathBuf>,
        dev_dir: impl Into<PathBuf>,
    ) -> Result<Self, ProcError> {
        let dev_dir = dev_dir.into();
        // Link targets are absolute and normalised; compare without a trailing slash.
        let dev_dir = PathBuf::from(dev_dir.to_string_lossy().trim_end_matches('/'));
        let fs = Arc::new(ProcFs::open(proc_root)?);
        let lister = fs.pid_lister()?;
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(1024);
        let mut c = ProcCollector {
            fs,
            lister,
            devices: DeviceTable::load(&dev_dir),
            dev_dir,
            passwd: PathBuf::from("/etc/passwd"),
            known: HashMap::new(),
            device_index: None,
            departed: VecDeque::new(),
            users: None,
            host: HostFacts::default(),
            open_stat_fds: 0,
            // Leave most of the fd budget to everything else.
            max_stat_fds: (nofile / 2).saturating_sub(64) as usize,
            command_lines: true,
            pidfds_usable: false,
            thorough: false,
            last_all_reusable: false,
            cgroup_mounts: Vec::new(),
            last_job_cgroups: Vec::new(),
            containers: Default::default(),
            shm_dirs: vec![PathBuf::from("/dev/shm")],
            last_shm: Vec::new(),
            host_memory_at_ms: None,
            forks_at_listing: None,
            collections: 0,
            opened: BTreeSet::new(),
            threads: std::sync::OnceLock::new(),
            first_reads: HashMap::new(),
            exit_set: crate::exits::ExitSet::new(),
            address_space: None,
            address_space_deadline: crate::address_space::READ_DEADLINE,
            descendants_budget: MAX_DESCENDANTS_READ,
            address_space_unread: BTreeSet::new(),
            group_members: HashMap::new(),
        };
        c.pidfds_usable = c.fs.is_own_namespace();
        c.refresh_host();
        Ok(c)
    }

    /// Reads container names from the runtimes' state under `state` (by default Docker's
    /// `/var/lib/docker` and Podman's `/var/lib/containers/storage`).
    pub fn with_container_state(mut self, state: crate::containers::ContainerState) -> Self {
        self.containers = crate::containers::ContainerNames::new(state);
        self
    }

    /// Scans these shared-memory directories at full depth instead of `/dev/shm` (none: no
    /// segment scan).
    pub fn with_shm_dirs(mut self, dirs: Vec<PathBuf>) -> Self {
        self.shm_dirs = dirs;
        self
    }

    /// Reads many processes at once on `threads` threads (the calling one included) instead
    /// of one per core the process may use (at most 8).
    pub fn with_read_threads(self, threads: usize) -> Self {
        let _ = self.threads.set(threads.max(1));
        self
    }

    /// Gives up a read of a process's address space (`cmdline`, `maps`) after `deadline`
    /// instead of [`crate::address_space::READ_DEADLINE`].
    pub fn with_address_space_deadline(mut self, deadline: Duration) -> Self {
        self.address_space_deadline = deadline;
        self.address_space = None;
        self
    }

    /// Whether processes' command lines are read (default yes). The agent, which shows no
    /// command line unless its config says so, turns them off: read once per process but
    /// copied into every collection, a job's long argument lists were a quarter of the
    /// allocations of its steady-state sample. Turned back on, every known process's
    /// identity is read again at its next read, command line included.
    pub fn set_command_lines(&mut self, read: bool) {
        if read && !self.command_lines {
            for k in self.known.values_mut() {
                k.facts = None;
                k.last = None;
            }
        }
        self.command_lines = read;
    }
    /// Polls each watched process's pidfd instead of asking one epoll set, as where the
    /// kernel gives no epoll set or the set refused a pidfd (a limit): the tests of that path.
    pub fn with_exits_polled(mut self) -> Self {
        self.exit_set = None;
        self
    }

    /// Reads user names from another passwd file (fixture trees).
    pub fn with_passwd(mut self, path: impl Into<PathBuf>) -> Self {
        self.passwd = path.into();
        self.users = None;
        self
    }

    /// Whether the tree is the one of vramguard's own PID namespace (a pid it names is the
    /// pid the kernel gives vramguard for that process, as in pidfds and fanotify events).
    pub fn sees_own_namespace(&self) -> bool {
        self.pidfds_usable
    }

    /// Processes seen opening a device file (fanotify): the next collection scans their open
    /// files, at any depth, so that an old process that opens the device is a holder at once.
    pub fn opened_by(&mut self, pids: impl IntoIterator<Item = u32>) {
        self.opened.extend(pids);
    }

    /// Processes whose exit this collector watches (a pidfd each). None after the first
    /// collection: only a collector that collects again opens them.
    pub fn exit_watches(&self) -> usize {
        self.known.values().filter(|k| k.pidfd.is_some()).count()
    }

    /// The `/proc` tree.
    pub fn procfs(&self) -> &ProcFs {
        &self.fs
    }

    /// The device directory.
    pub fn dev_dir(&self) -> &Path {
        &self.dev_dir
    }

    /// Host facts that do not change between collections, read at start and on full scans.
    fn refresh_host(&mut self) {
        let self_pid = self.fs.self_pid().unwrap_or(0);
        self.host = HostFacts {
            hostname: self.fs.hostname(),
            clock_ticks_per_sec: rustix::param::clock_ticks_per_second(),
            boot_time_ms: self.fs.boot_time_ms(),
            self_pid,
            self_ancestors: self.ancestors(self_pid),
            pid_namespace_is_host: self.fs.pid_namespace_is_host(),
            euid: rustix::process::geteuid().as_raw(),
            // From the kernel (capget), not from the /proc tree read: a fixture or a
            // container's tree must not be able to claim capabilities vramguard lacks.
            cap_effective: rustix::thread::capabilities(None)
                .ok()
                .map(|c| c.effective.bits()),
        };
        let mut mountinfo = Vec::new();
        self.cgroup_mounts = match self.fs.read_into("self/mountinfo", &mut mountinfo) {
            Ok(Found::Yes(())) => crate::parse::parse_cgroup_mounts(&mountinfo)
                .into_iter()
                .map(PathBuf::from)
                .collect(),
            _ => Vec::new(),
        };
    }

    /// The job cgroups of `processes`, each read once: who in them keeps the job alive. Also
    /// the system services that run a GPU holder: how many processes each runs, for the
    /// step that stops a service for a reset (which ends them all).
    fn job_cgroups(&self, processes: &[ProcessFacts]) -> Vec<JobCgroupFacts> {
        let holders = processes
            .iter()
            .filter(|p| p.device_files.holds_any() == Some(true));
        let mut roots: Vec<String> = holders
            .clone()
            .filter_map(cgroup_job)
            .filter(|j| matches!(j.kind, JobKind::Pod | JobKind::Container | JobKind::Slurm))
            .map(|j| j.root)
            .chain(
                holders
                    .filter_map(vramguard_core::job::system_service)
                    .map(|unit| vramguard_core::job::system_service_root(&unit)),
            )
            .collect();
        roots.sort();
        roots.dedup();
        roots.into_iter().map(|r| self.read_job_cgroup(r)).collect()
    }

    /// Reads the members of one job cgroup's subtree, in every hierarchy that has it.
    fn read_job_cgroup(&self, root: String) -> JobCgroupFacts {
        let mut facts = JobCgroupFacts {
            root,
            readable: false,
            members: 0,
            namespace_inits: Vec::new(),
            step_daemons: Vec::new(),
            nested_pid_namespace: false,
            complete: true,
            owner_uid: None,
        };
        let rel = facts.root.trim_start_matches('/');
        if rel.split('/').any(|s| s == ".." || s == ".") {
            return facts;
        }
        // Every hierarchy that has it: with Slurm's cgroup/v1 plugin the job's directory is in
        // the freezer (where slurmstepd sits, proctrack/cgroup) and, with task/cgroup's
        // constraints, in memory, devices and cpuset too (tasks only). Reading one of those
        // alone would miss the step daemon and take a live job for a dead one.
        let mut dirs: Vec<PathBuf> = self
            .cgroup_mounts
            .iter()
            .map(|m| m.join(rel))
            .filter(|d| d.is_dir())
            .collect();
        if dirs.is_empty() {
            return facts;
        }
        facts.owner_uid = dirs
            .iter()
            .filter_map(|d| std::fs::symlink_metadata(d).ok())
            .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
            .max();
        // The step daemon's own directories first (`…/step_N/slurm` under cgroup v2): in a
        // job of thousands of tasks it is then among the members looked at.
        let mut daemons_first: Vec<u32> = Vec::new();
        let mut pids = Vec::new();
        let mut visited = 0;
        while let Some(d) = dirs.pop() {
            visited += 1;
            if visited > CGROUP_MAX_DIRS || pids.len() >= CGROUP_MAX_PIDS {
                facts.complete = false;
                break;
            }
            let Some(text) = read_small(&d.join("cgroup.procs"), CGROUP_PROCS_MAX_BYTES) else {
                facts.complete = false;
                continue;
            };
            facts.readable = true;
            if text.len() as u64 >= CGROUP_PROCS_MAX_BYTES {
                facts.complete = false;
            }
            let listed = text
                .lines()
                .filter_map(|l| l.trim().parse::<u32>().ok())
                .take(CGROUP_MAX_PIDS);
            if d.file_name().is_some_and(|n| n == "slurm") {
                daemons_first.extend(listed.clone());
            }
            pids.extend(listed);
            match std::fs::read_dir(&d) {
                Ok(entries) => {
                    for e in entries {
                        let Ok(e) = e else {
                            facts.complete = false;
                            continue;
                        };
                        // Never follow a link out of the hierarchy.
                        if e.file_type().is_ok_and(|t| t.is_dir()) {
                            dirs.push(e.path());
                        }
                    }
                }
                Err(_) => facts.complete = false,
            }
        }
        pids.sort_unstable();
        pids.dedup();
        facts.members = pids.len() as u32;
        if pids.len() > CGROUP_MAX_INSPECTED {
            facts.complete = false;
        }
        let inspected: Vec<u32> = daemons_first
            .iter()
            .copied()
            .chain(pids.iter().copied().filter(|p| !daemons_first.contains(p)))
            .take(CGROUP_MAX_INSPECTED)
            .collect();
        for pid in inspected {
            let stat = match self.fs.stat(pid) {
                Ok(Found::Yes(stat)) => stat,
                // Exited since the listing: nothing to look at.
                Ok(Found::Gone) => continue,
                _ => {
                    facts.complete = false;
                    continue;
                }
            };
            if matches!(stat.state, Some('Z' | 'X')) {
                continue;
            }
            let nspid = match self.fs.status(pid) {
                Ok(Found::Yes(st)) => st.nspid,
                _ => Vec::new(),
            };
            if nspid.len() > 1 {
                facts.nested_pid_namespace = true;
                if nspid.last() == Some(&1) {
                    facts.namespace_inits.push(pid);
                }
            }
            if stat.comm == "slurmstepd" {
                facts.step_daemons.push(pid);
            }
        }
        facts
    }

    fn user_name(&mut self, uid: u32) -> Option<String> {
        let passwd = &self.passwd;
        let users = self.users.get_or_insert_with(|| {
            std::fs::read(passwd)
                .map(|b| crate::parse::parse_passwd(&b).into_iter().collect())
                .unwrap_or_default()
        });
        users.get(&uid).cloned()
    }

    fn forget(&mut self, pid: u32) -> Option<Known> {
        let k = self.known.remove(&pid)?;
        self.device_index = None;
        self.open_stat_fds -= usize::from(k.stat_fd.is_some()) + usize::from(k.pidfd.is_some());
        Some(k)
    }

    /// Whether no followed process (holder, parent, job leader) has exited since the last
    /// collection, as far as the pidfds tell without being read: false when one has, or
    /// when it cannot be told cheaply: no epoll set, or a process of the last collection
    /// without a pidfd (none are opened in the first collection, nor over another
    /// namespace's `/proc`, nor past the fd budget) or dying (a cached collection would read
    /// those again).
    pub fn nothing_exited(&self) -> bool {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        let Some(set) = &self.exit_set else {
            return false;
        };
        if !self.last_all_reusable {
            return false;
        }
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let mut fds = [PollFd::new(set, PollFlags::IN)];
        matches!(poll(&mut fds, Some(&zero)), Ok(0))
    }

    /// Processes whose pidfd says they exited since their facts were read; their pidfds are
    /// closed (the exit is news once). `None` when polling failed: treat it as news.
    fn take_exits(&mut self) -> Option<Vec<u32>> {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        if let Some(set) = &self.exit_set {
            let Ok(exited) = set.ready(self.open_stat_fds) else {
                // Asked again it would likely fail again: each pidfd is polled from now on,
                // and this collection re-reads everything.
                self.exit_set = None;
                return None;
            };
            for pid in &exited {
                if let Some(k) = self.known.get_mut(pid)
                    && let Some(fd) = k.pidfd.take()
                {
                    set.remove(&fd);
                    self.open_stat_fds -= 1;
                }
            }
            return Some(exited);
        }
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let (pids, mut fds): (Vec<u32>, Vec<PollFd<'_>>) = self
            .known
            .iter()
            .filter_map(|(pid, k)| Some((*pid, PollFd::new(k.pidfd.as_ref()?, PollFlags::IN))))
            .unzip();
        poll(&mut fds, Some(&now)).ok()?;
        let exited: Vec<u32> = pids
            .into_iter()
            .zip(&fds)
            .filter(|(_, fd)| !fd.revents().is_empty())
            .map(|(pid, _)| pid)
            .collect();
        drop(fds);
        for pid in &exited {
            if let Some(k) = self.known.get_mut(pid)
                && k.pidfd.take().is_some()
            {
                self.open_stat_fds -= 1;
            }
        }
        Some(exited)
    }

    /// The facts of `pid` as the last re-read left them, when they can be reused: it has a
    /// pidfd (which said nothing) and was neither dying nor in D state.
    fn cached(&self, pid: u32) -> Option<ProcessFacts> {
        self.reusable(pid).cloned()
    }

    /// [`ProcCollector::cached`], borrowed.
    fn reusable(&self, pid: u32) -> Option<&ProcessFacts> {
        let k = self.known.get(&pid)?;
        k.pidfd.as_ref()?;
        let f = k.last.as_ref()?;
        let dying = matches!(f.state, Some('Z' | 'D' | 'X'))
            || f.flags.is_some_and(|fl| fl & PF_EXITING != 0);
        (!dying).then_some(f)
    }

    /// The facts of one pid: reused under [`ScanDepth::Cached`] when nothing exited, else
    /// re-read.
    fn facts(&mut self, pid: u32, reuse: bool) -> Result<Option<ProcessFacts>, ProcError> {
        if reuse && let Some(f) = self.cached(pid) {
            return Ok(Some(f));
        }
        let facts = self.refresh(pid)?;
        if let Some(f) = &facts {
            self.follow(pid, f);
        }
        Ok(facts)
    }

    /// Keeps the facts just read, and opens a pidfd for the process if it has none. Not in
    /// the first collection: a pidfd serves only later ones ([`ScanDepth::Cached`]), and a
    /// one-shot command (`status`, `diagnose`) makes no other; a collector that collects
    /// again opens them then.
    fn follow(&mut self, pid: u32, facts: &ProcessFacts) {
        let usable = self.pidfds_usable && self.collections > 1;
        let room = self.open_stat_fds < self.max_stat_fds;
        let Some(k) = self.known.get_mut(&pid) else {
            return;
        };
        k.last = Some(facts.clone());
        // A process already dead has nothing more to announce.
        let dead = matches!(facts.state, Some('Z' | 'X'));
        if k.pidfd.is_some() || dead || !usable || !room {
            return;
        }
        let Some(stat_fd) = k.stat_fd.as_ref() else {
            return;
        };
        let Some(fd) = rustix::process::Pid::from_raw(pid as i32).and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
        }) else {
            return;
        };
        // The held stat file belongs to the process just read: if it still reads, the pid was
        // not reused before the pidfd was opened.
        if matches!(self.fs.reread_stat(pid, stat_fd), Ok(Found::Yes(s)) if s.start_ticks == facts.start_ticks)
        {
            if let Some(set) = &self.exit_set
                && set.add(&fd, pid).is_err()
            {
                // Refused (a limit): every pidfd is polled from now on.
                self.exit_set = None;
            }
            k.pidfd = Some(fd);
            self.open_stat_fds += 1;
        }
    }

    /// Forgets a pid that is gone, remembering it in `departed` if it mattered.
    fn depart(&mut self, pid: u32, now_ms: u64) {
        if let Some(k) = self.forget(pid)
            && k.interesting
            && let Some(f) = k.facts
        {
            self.departed.push_back(DepartedProcess {
                pid,
                comm: f.comm,
                cmdline: f.cmdline,
                gone_at_ms: now_ms,
                start_ticks: k.start_ticks,
                uid: f.uid,
            });
        }
    }

    /// One collection. `listed` are the pids the driver reports (they are always fd-scanned
    /// once, so that a pid from another namespace can be told apart); `now_ms` stamps
    /// departures.
    pub fn collect(
        &mut self,
        listed: &[u32],
        depth: ScanDepth,
        now_ms: u64,
    ) -> Result<Collected, ProcError> {
        self.collections += 1;
        self.thorough = depth == ScanDepth::Thorough;
        self.retry_unread_address_spaces();
        if depth.scans_every_process() {
            self.refresh_host();
            self.devices = DeviceTable::load(&self.dev_dir);
        }
        let listing = self.list_and_depart(depth, now_ms)?;
        let denied = self.scan_what_changed(listed, depth, listing.as_deref(), now_ms)?;
        let reuse = depth == ScanDepth::Cached && self.take_exits().is_some_and(|e| e.is_empty());
        let mut processes = self.holders_and_relatives(listed, reuse, now_ms)?;
        self.last_all_reusable = processes.iter().all(|p| self.reusable(p.pid).is_some());
        let host_memory = self.host_memory(&mut processes, listing.as_deref(), depth, now_ms);
        self.trim_departed(now_ms);
        let mut limitations = Vec::new();
        if denied > 0 && !self.host.privileges().sees_every_process() {
            limitations.push(format!(
                "open files of {denied} process(es) were unreadable (other users' processes): \
                 run as root (or with CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH) to see every holder"
            ));
        }
        if !self.address_space_unread.is_empty() {
            limitations.push(self.unread_address_spaces());
        }
        self.check_fd_accounting();
        let job_cgroups = if reuse {
            self.last_job_cgroups.clone()
        } else {
            let facts = self.job_cgroups(&processes);
            self.last_job_cgroups = facts.clone();
            facts
        };
        Ok(Collected {
            job_cgroups,
            processes,
            departed: self.departed.iter().cloned().collect(),
            scan: ScanFacts {
                proc_root: self.fs.root().display().to_string(),
                dev_dir: self.dev_dir.display().to_string(),
                full_fd_scan: depth.scans_every_process(),
                limitations,
                descendants_unread: Vec::new(),
            },
            host: self.host.clone(),
            host_memory,
        })
    }

    /// What the collection says of address spaces it could not read in time.
    fn unread_address_spaces(&self) -> String {
        let pids: Vec<String> = self
            .address_space_unread
            .iter()
            .take(10)
            .map(u32::to_string)
            .collect();
        let more = self.address_space_unread.len().saturating_sub(pids.len());
        let more = if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        };
        let deadline = self.address_space_deadline;
        format!(
            "the memory map of pid {}{more} could not be read within {deadline:?} (a thread may be \
             stuck in the kernel holding it: see its threads' state and wchan in \
             /proc/PID/task/*/); what it tells (command line, mapped driver libraries, shared \
             memory) is unknown until it can be read",
            pids.join(", ")
        )
    }

    /// Debug builds (every test) check that the count of held `stat` fds and pidfds, which
    /// keeps the collector inside its fd budget, is what it holds: a count that drifts low
    /// lets it run out of fds on a busy node, one that drifts high stops it following exits.
    fn check_fd_accounting(&self) {
        if cfg!(debug_assertions) {
            let held: usize = self
                .known
                .values()
                .map(|k| usize::from(k.stat_fd.is_some()) + usize::from(k.pidfd.is_some()))
                .sum::<usize>()
                + self
                    .first_reads
                    .values()
                    .filter(|r| r.stat.is_some())
                    .count();
            assert_eq!(self.open_stat_fds, held, "the fd budget's count drifted");
        }
    }

    /// `meminfo` and memory pressure every time; at full depth, and at least every
    /// [`HOST_MEMORY_EVERY_MS`] whatever the depth, also the shared-memory segments with their
    /// users (one pass over every process's maps and open files, done only when a segment
    /// exists) and each process's pinned, locked and shared memory, which later collections
    /// reuse (a process first seen in between is read once when first seen). The period is
    /// its own: the agent's full fd scans can be ten minutes apart, and a leaked segment must
    /// not wait that long.
    fn host_memory(
        &mut self,
        processes: &mut [ProcessFacts],
        listing: Option<&[u32]>,
        depth: ScanDepth,
        now_ms: u64,
    ) -> HostMemoryFacts {
        let (mem_total_bytes, mem_available_bytes) = crate::host::meminfo(&self.fs);
        let due = self
            .host_memory_at_ms
            .is_none_or(|at| now_ms.saturating_sub(at) >= HOST_MEMORY_EVERY_MS);
        if depth.scans_every_process() || due {
            self.host_memory_at_ms = Some(now_ms);
            // Without a listing in this collection, the processes the last one found.
            let known: Vec<u32>;
            let listing = match listing {
                Some(l) => Some(l),
                None => {
                    known = self.known.keys().copied().collect();
                    Some(known.as_slice())
                }
            };
            let mut dirs: Vec<ShmDirFacts> = self
                .shm_dirs
                .iter()
                .map(|d| crate::host::scan_dir(d))
                .collect();
            let devs: BTreeSet<u64> = dirs
                .iter()
                .filter(|d| d.error.is_none())
                .map(|d| d.dev)
                .collect();
            // Each process's maps, on every core: hundreds of holders after a full scan.
            let read_now: HashMap<u32, StatusMemory> = processes
                .iter()
                .filter_map(|p| {
                    let (at, m) = self.known.get(&p.pid)?.status_memory?;
                    (at == self.collections).then_some((p.pid, m))
                })
                .collect();
            let pids: Vec<u32> = processes.iter().map(|p| p.pid).collect();
            self.read_host_memory(&pids, &devs, read_now);
            let any_segment = dirs.iter().any(|d| !d.segments.is_empty());
            if let (true, Some(pids)) = (any_segment, listing) {
                let used = if devs.is_empty() {
                    crate::host::ShmUse::default()
                } else {
                    let (devs, shm_dirs) =
                        (Arc::new(devs.clone()), Arc::new(self.shm_dirs.clone()));
                    let read = self.address_space().each(pids, move |fs, pid| {
                        crate::host::shm_use_of(fs, pid, &devs, &shm_dirs)
                    });
                    crate::host::ShmUse::merge(pids, read)
                };
                for d in dirs.iter_mut().filter(|d| d.error.is_none()) {
                    d.users_checked = used.unreadable.is_empty() && used.read > 0;
                    d.unchecked_pids = used.unreadable.iter().take(10).copied().collect();
                    for s in &mut d.segments {
                        s.users = used
                            .users
                            .get(&(d.dev, s.inode))
                            .map(|p| p.iter().copied().collect())
                            .unwrap_or_default();
                    }
                }
            }
            self.last_shm = dirs;
        } else {
            // A process first seen since the last full scan is read once now.
            let devs: BTreeSet<u64> = self
                .last_shm
                .iter()
                .filter(|d| d.error.is_none())
                .map(|d| d.dev)
                .collect();
            let unread: Vec<u32> = processes
                .iter()
                .filter(|p| {
                    self.known
                        .get(&p.pid)
                        .is_some_and(|k| k.host_memory.is_none())
                })
                .map(|p| p.pid)
                .collect();
            self.read_host_memory(&unread, &devs, HashMap::new());
        }
        for p in processes.iter_mut() {
            p.host_memory = self.known.get(&p.pid).and_then(|k| k.host_memory);
        }
        HostMemoryFacts {
            mem_total_bytes,
            mem_available_bytes,
            pressure: crate::host::pressure(&self.fs),
            shm: self.last_shm.clone(),
        }
    }

    /// Each process's pinned, locked and shared memory, on the workers (the maps are read
    /// under the process's mmap lock); `read_now`: `status` figures this collection already
    /// read. A read given up leaves the process without figures, read again next time.
    fn read_host_memory(
        &mut self,
        pids: &[u32],
        devs: &BTreeSet<u64>,
        read_now: HashMap<u32, StatusMemory>,
    ) {
        let devs = Arc::new(devs.clone());
        let read = self.address_space().each(pids, move |fs, pid| {
            crate::host::process_memory(fs, pid, &devs, read_now.get(&pid).copied())
        });
        for (&pid, found) in pids.iter().zip(read) {
            match found {
                Some(Ok(Found::Yes(m))) => {
                    if let Some(k) = self.known.get_mut(&pid) {
                        k.host_memory = Some(m);
                    }
                }
                Some(_) => {}
                None => {
                    self.address_space_unread.insert(pid);
                }
            }
        }
    }

    /// The pids in `/proc` (none at the shallow depths: a pid is then presumed present until
    /// reading it says otherwise); every known process missing from it has departed.
    ///
    /// [`ScanDepth::NewProcesses`] lists only when the fork counter moved since the last
    /// listing (read before listing, so a fork during it brings another): on a quiet node the
    /// listing, most of the agent's periodic cost, is skipped, and nothing new is missed. What
    /// a listing would also find, processes that exited, is left to the shallow depths' own
    /// re-reads (holders and their relatives) and to the next listing.
    fn list_and_depart(
        &mut self,
        depth: ScanDepth,
        now_ms: u64,
    ) -> Result<Option<Vec<u32>>, ProcError> {
        let listing = match depth {
            ScanDepth::Holders | ScanDepth::Cached => None,
            ScanDepth::NewProcesses | ScanDepth::Full | ScanDepth::Thorough => {
                let forks = self.fs.forks_since_boot();
                if depth == ScanDepth::NewProcesses
                    && forks.is_some()
                    && forks == self.forks_at_listing
                {
                    None
                } else {
                    let pids = self.lister.list()?;
                    self.forks_at_listing = forks;
                    Some(pids)
                }
            }
        };
        if let Some(pids) = &listing {
            // The listing is sorted: a search in it, not a set built from it (hashing every
            // pid of a large node was a tenth of the agent's quiet CPU).
            let gone: Vec<u32> = self
                .known
                .keys()
                .filter(|p| pids.binary_search(p).is_err())
                .copied()
                .collect();
            for pid in gone {
                self.depart(pid, now_ms);
            }
        }
        Ok(listing)
    }

    /// Fd scans: everything (full), what is new (new processes), and in every depth the listed
    /// pids not scanned yet or whose cached scan shows no device file (they opened one since,
    /// or are pids from another namespace). Returns how many processes' fds were unreadable.
    fn scan_what_changed(
        &mut self,
        listed: &[u32],
        depth: ScanDepth,
        listing: Option<&[u32]>,
        now_ms: u64,
    ) -> Result<usize, ProcError> {
        let listed_set: HashSet<u32> = listed.iter().copied().collect();
        let needs_scan = |pid: &u32, known: &HashMap<u32, Known>| {
            let k = known.get(pid);
            depth.scans_every_process()
                || (depth == ScanDepth::NewProcesses
                    && k.is_none_or(|k| matches!(k.devices, FdScan::NotScanned)))
                || (listed_set.contains(pid)
                    && k.is_none_or(|k| k.devices.holds_any() != Some(true)))
        };
        let mut to_scan: Vec<u32> = match listing {
            Some(pids) => pids
                .iter()
                .copied()
                .filter(|p| needs_scan(p, &self.known))
                .collect(),
            None => listed
                .iter()
                .copied()
                .filter(|p| needs_scan(p, &self.known))
                .collect(),
        };
        // An opener is scanned again even if an earlier scan found it holding: it may hold
        // another GPU's file now.
        let opened = std::mem::take(&mut self.opened);
        if !opened.is_empty() {
            let queued: HashSet<u32> = to_scan.iter().copied().collect();
            to_scan.extend(opened.iter().copied().filter(|p| !queued.contains(p)));
        }
        let mut scanned = match self.scan_fds(&to_scan) {
            Ok(scanned) => scanned,
            Err(e) => {
                // Not lost with the failed scan: the next collection scans them.
                self.opened.extend(opened);
                return Err(e);
            }
        };
        // A pid the driver lists whose process shows no device file may hold it in a thread's
        // own fd table (`unshare(CLONE_FILES)`): those tables are read too, for these few pids,
        // or a live process with a context would read as an exited one.
        for (pid, found) in scanned.iter_mut() {
            if listed_set.contains(pid)
                && matches!(found, Found::Yes(d) if d.holds_any() == Some(false))
                && let Ok(every) =
                    self.fs
                        .device_files_of_every_table(*pid, &self.devices, self.pidfds_usable)
            {
                *found = every;
            }
        }
        // Room for every new pid at once: growing one step at a time moved the (large) facts
        // of thousands of processes several times over.
        let new = scanned
            .iter()
            .filter(|(pid, _)| !self.known.contains_key(pid))
            .count();
        self.known.reserve(new);
        for (pid, found, library) in self.with_libraries(scanned)? {
            match found {
                Found::Yes(devices) => self.set_devices_read(pid, devices, library),
                Found::Denied => self.set_devices_read(pid, FdScan::Denied, None),
                Found::Gone => self.depart(pid, now_ms),
            }
            // Facts kept for reuse carry the old scan: an opener is read afresh.
            if opened.contains(&pid)
                && let Some(k) = self.known.get_mut(&pid)
            {
                k.last = None;
            }
        }
        Ok(self.device_index().denied)
    }

    /// Records a process's device-file scan, with its driver library when it holds uvm (see
    /// [`ProcCollector::with_libraries`], which may scan it again); the index is rebuilt when
    /// next asked for. Returns the scan recorded.
    fn set_devices(&mut self, pid: u32, devices: FdScan) -> Result<FdScan, ProcError> {
        let [(_, found, library)] = self
            .with_libraries(vec![(pid, Found::Yes(devices.clone()))])?
            .try_into()
            .expect("one answer for one pid");
        // Gone since: the next read finds it so; until then, the first scan stands.
        let devices = match found {
            Found::Yes(d) => d,
            Found::Denied => FdScan::Denied,
            Found::Gone => devices,
        };
        self.set_devices_read(pid, devices.clone(), library);
        Ok(devices)
    }

    /// Fd scans with the driver library of each process that holds uvm, read from its map
    /// after its scan (on the workers, all at once). The two reads are not one: a process
    /// letting go of the driver between them (files closed, then the library unmapped) or
    /// taking it up (library mapped, then files opened) reads as holding uvm and mapping
    /// neither library, which would make an NVML client a hidden holder for a collection. So
    /// a process that reads as `neither` is scanned again, and its map read again while it
    /// still holds uvm: what is `neither` then is (a process that maps no driver library and
    /// holds the driver's files).
    fn with_libraries(
        &mut self,
        scanned: Vec<(u32, Found<FdScan>)>,
    ) -> Result<Vec<ScannedWithLibrary>, ProcError> {
        let holding_uvm = |found: &Found<FdScan>| matches!(found, Found::Yes(d) if d.holds_uvm());
        let uvm: Vec<u32> = scanned
            .iter()
            .filter(|(_, found)| holding_uvm(found))
            .map(|(pid, _)| *pid)
            .collect();
        let mut libraries: HashMap<u32, DriverLibrary> = uvm
            .iter()
            .copied()
            .zip(self.driver_libraries(&uvm))
            .collect();
        let neither: Vec<u32> = uvm
            .iter()
            .copied()
            .filter(|pid| libraries.get(pid) == Some(&DriverLibrary::Neither))
            .collect();
        let mut again: HashMap<u32, Found<FdScan>> = HashMap::new();
        if !neither.is_empty() {
            let rescanned = self.scan_fds(&neither)?;
            let still: Vec<u32> = rescanned
                .iter()
                .filter(|(_, found)| holding_uvm(found))
                .map(|(pid, _)| *pid)
                .collect();
            let read = self.driver_libraries(&still);
            libraries.extend(still.into_iter().zip(read));
            again.extend(rescanned);
        }
        Ok(scanned
            .into_iter()
            .map(|(pid, found)| {
                let found = again.remove(&pid).unwrap_or(found);
                let library = holding_uvm(&found)
                    .then(|| libraries.get(&pid).copied())
                    .flatten();
                (pid, found, library)
            })
            .collect())
    }

    /// [`ProcCollector::set_devices`] with the driver library already read (for a process
    /// holding uvm).
    fn set_devices_read(&mut self, pid: u32, devices: FdScan, library: Option<DriverLibrary>) {
        let known = self.known.entry(pid).or_default();
        known.devices = devices;
        known.driver_library = library;
        self.device_index = None;
    }

    /// Which driver libraries each process maps. On driver 580 an NVML client holds uvm too:
    /// only the map tells it from a CUDA context. Read at every fd scan that finds uvm held
    /// (an exec keeps the pid and start time but not the map); an error, or a read given up
    /// at its deadline, reads as no evidence either way.
    fn driver_libraries(&mut self, pids: &[u32]) -> Vec<DriverLibrary> {
        let read = self
            .address_space()
            .each(pids, |fs, pid| fs.driver_library(pid));
        pids.iter()
            .zip(read)
            .map(|(&pid, found)| match found {
                Some(Ok(Found::Yes(library))) => library,
                Some(_) => DriverLibrary::Unknown,
                None => {
                    self.address_space_unread.insert(pid);
                    DriverLibrary::Unknown
                }
            })
            .collect()
    }

    /// Each process's command line, read with a deadline; one given up reads as unknown
    /// (as if denied) and is read again later.
    fn command_lines_of(&mut self, pids: &[u32]) -> Vec<Result<Found<Vec<String>>, ProcError>> {
        let read = self.address_space().each(pids, |fs, pid| fs.cmdline(pid));
        pids.iter()
            .zip(read)
            .map(|(&pid, line)| {
                line.unwrap_or_else(|| {
                    self.address_space_unread.insert(pid);
                    Ok(Found::Denied)
                })
            })
            .collect()
    }

    /// Makes every read of an address space call `hook` first, on the reading thread: how
    /// the tests make one process's memory map hang as a stuck driver call can.
    #[cfg(test)]
    fn before_address_space_read(&mut self, hook: Arc<dyn Fn(u32) + Send + Sync>) {
        self.address_space().before_read(hook);
    }

    /// The reads of address spaces, started at the first.
    fn address_space(&mut self) -> &AddressSpaceReads {
        if self.address_space.is_none() {
            self.address_space = Some(AddressSpaceReads::new(
                self.fs.clone(),
                self.threads(),
                self.address_space_deadline,
            ));
        }
        self.address_space.as_ref().expect("just started")
    }

    /// Processes whose address space went unread and is no longer blocked: their identity
    /// (command line) is read again at their next read, and a driver library left unknown
    /// is read now.
    fn retry_unread_address_spaces(&mut self) {
        if self.address_space_unread.is_empty() {
            return;
        }
        let blocked: HashSet<u32> = self
            .address_space
            .as_ref()
            .map(|r| r.blocked().into_iter().collect())
            .unwrap_or_default();
        let retry: Vec<u32> = self
            .address_space_unread
            .iter()
            .copied()
            .filter(|pid| !blocked.contains(pid))
            .collect();
        let mut libraries = Vec::new();
        for pid in retry {
            self.address_space_unread.remove(&pid);
            if let Some(k) = self.known.get_mut(&pid) {
                k.facts = None;
                k.last = None;
                if k.driver_library == Some(DriverLibrary::Unknown) {
                    libraries.push(pid);
                }
            }
        }
        if !libraries.is_empty() {
            let read = self.driver_libraries(&libraries);
            for (pid, library) in libraries.into_iter().zip(read) {
                if let Some(k) = self.known.get_mut(&pid) {
                    k.driver_library = Some(library);
                }
            }
        }
    }

    /// The holders and the unreadable count, from the index when nothing changed since it
    /// was built. Debug builds (every test) check it against a fresh pass.
    fn device_index(&mut self) -> &DeviceIndex {
        let fresh = || {
            let mut holding: Vec<u32> = self
                .known
                .iter()
                .filter(|(_, k)| k.devices.holds_any() == Some(true))
                .map(|(p, _)| *p)
                .collect();
            holding.sort_unstable();
            let denied = self
                .known
                .values()
                .filter(|k| matches!(k.devices, FdScan::Denied))
                .count();
            DeviceIndex { holding, denied }
        };
        if let Some(index) = &self.device_index {
            debug_assert_eq!(*index, fresh(), "the device index missed a change");
        } else {
            self.device_index = Some(fresh());
        }
        self.device_index.as_ref().expect("just built")
    }

    /// The processes that matter: listed pids and device holders, then their relatives (every
    /// ancestor, which the job model walks up, every process-group leader, and the supervisor
    /// of each `vramguard run` cgroup they are in), each read once.
    fn holders_and_relatives(
        &mut self,
        listed: &[u32],
        reuse: bool,
        now_ms: u64,
    ) -> Result<Vec<ProcessFacts>, ProcError> {
        let mut wanted: Vec<u32> = self.device_index().holding.clone();
        wanted.extend_from_slice(listed);
        wanted.sort_unstable();
        wanted.dedup();
        self.read_first_on_every_core(&wanted);

        // Sized for the holders and about as many relatives: facts are large, and every
        // growth of the table moved all of them.
        let mut out: HashMap<u32, ProcessFacts> = HashMap::with_capacity(wanted.len() * 2);
        let mut relatives: VecDeque<(u32, usize)> = VecDeque::new();
        let queue_relatives =
            |facts: &ProcessFacts, depth: usize, q: &mut VecDeque<(u32, usize)>| {
                if depth >= MAX_ANCESTRY {
                    return;
                }
                // The supervisor a `vramguard run` cgroup names keeps the job alive: read it
                // even where it is no ancestor (a process moved into the cgroup).
                let supervisors = vramguard_core::job::run_cgroups(facts)
                    .into_iter()
                    .map(|r| r.supervisor);
                for rel in [facts.ppid, facts.pgid]
                    .into_iter()
                    .flatten()
                    .chain(supervisors)
                {
                    if rel > 0 && rel != facts.pid {
                        q.push_back((rel, depth + 1));
                    }
                }
            };
        let mut missing: Vec<u32> = Vec::new();
        for pid in wanted {
            match self.facts(pid, reuse)? {
                Some(facts) => {
                    queue_relatives(&facts, 0, &mut relatives);
                    out.insert(pid, facts);
                }
                None => {
                    if listed.contains(&pid) {
                        missing.push(pid);
                    }
                    self.depart(pid, now_ms)
                }
            }
        }
        // A listed pid that is no process here may be a pid inside a nested PID namespace
        // (some drivers report those): the processes whose innermost NSpid it is come along,
        // so that classification can tell such a pid from one that exited.
        if !missing.is_empty() {
            for pid in self.nested_as(&missing) {
                if let Some(facts) = self.facts(pid, reuse)? {
                    queue_relatives(&facts, 0, &mut relatives);
                    out.insert(pid, facts);
                }
            }
        }
        while let Some((pid, depth)) = relatives.pop_front() {
            if out.contains_key(&pid) {
                continue;
            }
            match self.facts(pid, reuse)? {
                Some(facts) => {
                    queue_relatives(&facts, depth, &mut relatives);
                    out.insert(pid, facts);
                }
                None => self.depart(pid, now_ms),
            }
        }
        // What the walk did not take is not kept: the next collection reads afresh.
        self.drop_first_reads();
        // In pid order, each moved once (sorting the facts themselves moved each many times).
        let mut pids: Vec<u32> = out.keys().copied().collect();
        pids.sort_unstable();
        Ok(pids.iter().filter_map(|pid| out.remove(pid)).collect())
    }

    /// Adds to `processes` every descendant of `roots` it lacks: a collection reads GPU
    /// holders and their ancestors, and the work of a holder's children that hold no device
    /// file (a checkpoint upload, a compiler, spawned data workers) protects it as much as its
    /// own. Read from the kernel's exact `task/*/children` lists; where the kernel has none,
    /// from the parents of every process (a listing and a `stat` each). Each root's walk has
    /// a budget of its own ([`MAX_DESCENDANTS_READ`] descendants; at most
    /// [`crate::procfs::MAX_THREADS_LOOKED_AT`] threads of one process looked at): a root
    /// whose walk was cut short is returned, and its holders' work is then unknown (one
    /// user's large tree must not hide another's working child).
    pub fn add_descendants(
        &mut self,
        processes: &mut Vec<ProcessFacts>,
        roots: &[u32],
    ) -> Result<Descendants, ProcError> {
        let mut have: HashSet<u32> = processes.iter().map(|p| p.pid).collect();
        // Children by parent, built once from a listing where the kernel keeps no lists.
        let mut by_parent: Option<HashMap<u32, Vec<u32>>> = None;
        let mut out = Descendants::default();
        let mut roots: Vec<u32> = roots.to_vec();
        // The rest of each root's process group when its leader is gone: members re-parented
        // each on its own are of the same dead job, and their work (and their descendants')
        // counts for it.
        let mut dead_groups: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for root in &roots {
            if let Some(group) = processes
                .iter()
                .find(|p| p.pid == *root)
                .and_then(|p| p.pgid)
                .filter(|g| *g > 1)
                && !self.leads_its_group(group)?
            {
                dead_groups.entry(group).or_default().push(*root);
            }
        }
        let members = self.dead_groups(&dead_groups)?;
        for (group, group_roots) in dead_groups {
            let Some(members) = members.get(&group) else {
                out.unread_roots.extend(group_roots);
                continue;
            };
            for &pid in members {
                // Still of the group (a listing up to GROUP_MEMBERS_REUSE old may name a pid
                // another process took since): only then a member, and a root.
                let of_group = if have.contains(&pid) {
                    processes
                        .iter()
                        .find(|p| p.pid == pid)
                        .is_some_and(|known| known.pgid == Some(group))
                } else {
                    match self.facts_for_work(pid)? {
                        Some(facts) if facts.pgid == Some(group) => {
                            have.insert(pid);
                            processes.push(facts);
                            out.added += 1;
                            true
                        }
                        _ => false,
                    }
                };
                if of_group {
                    roots.push(pid);
                }
            }
        }
        roots.sort_unstable();
        roots.dedup();
        for root in roots {
            let mut walked: HashSet<u32> = HashSet::new();
            let mut queue: VecDeque<u32> = VecDeque::from([root]);
            let mut seen = 0usize;
            let mut whole = true;
            'walk: while let Some(pid) = queue.pop_front() {
                if !walked.insert(pid) {
                    continue;
                }
                let children = match self.fs.children_within(pid, MAX_THREADS_LOOKED_AT)? {
                    Some((children, complete)) => {
                        whole &= complete;
                        children
                    }
                    None => {
                        if by_parent.is_none() {
                            by_parent = Some(self.children_by_parent()?);
                        }
                        by_parent
                            .as_ref()
                            .and_then(|m| m.get(&pid))
                            .cloned()
                            .unwrap_or_default()
                    }
                };
                for child in children {
                    if walked.contains(&child) {
                        continue;
                    }
                    seen += 1;
                    if seen > self.descendants_budget {
                        whole = false;
                        break 'walk;
                    }
                    if have.insert(child) {
                        let Some(facts) = self.facts_for_work(child)? else {
                            continue;
                        };
                        processes.push(facts);
                        out.added += 1;
                    }
                    queue.push_back(child);
                }
            }
            if !whole {
                out.unread_roots.push(root);
            }
        }
        Ok(out)
    }

    /// The facts of a process read for its work only: its exit is not remembered among the
    /// departed (a job churning short children would push out the holders that matter
    /// there), unless it mattered already or holds a device file.
    fn facts_for_work(&mut self, pid: u32) -> Result<Option<ProcessFacts>, ProcError> {
        let was_interesting = self.known.get(&pid).is_some_and(|k| k.interesting);
        let Some(facts) = self.facts(pid, false)? else {
            return Ok(None);
        };
        if !was_interesting
            && facts.device_files.holds_any() != Some(true)
            && let Some(k) = self.known.get_mut(&pid)
        {
            k.interesting = false;
        }
        Ok(Some(facts))
    }

    /// Whether process group `group` has its leader: a live process with that pid leading it.
    fn leads_its_group(&self, group: u32) -> Result<bool, ProcError> {
        Ok(match self.fs.stat(group)? {
            Found::Yes(stat) => stat.pgid == Some(group) && !matches!(stat.state, Some('Z' | 'X')),
            // Denied: not known to be gone.
            Found::Denied => true,
            Found::Gone => false,
        })
    }

    /// The processes of each leaderless group in `groups` (with the roots that asked for it),
    /// from one pass over every process, reused for [`GROUP_MEMBERS_REUSE`] while it still
    /// names every root that asks (a group whose pgid was taken by a new group since is read
    /// again). A group with more than [`MAX_DESCENDANTS_READ`] members is left out: that job
    /// is not read whole.
    fn dead_groups(
        &mut self,
        groups: &BTreeMap<u32, Vec<u32>>,
    ) -> Result<HashMap<u32, Vec<u32>>, ProcError> {
        self.group_members
            .retain(|_, (at, _)| at.elapsed() < GROUP_MEMBERS_REUSE);
        let stale = groups.iter().any(|(group, roots)| {
            self.group_members
                .get(group)
                .is_none_or(|(_, members)| roots.iter().any(|r| !members.contains(r)))
        });
        if stale {
            let mut found: HashMap<u32, Vec<u32>> = HashMap::new();
            for pid in self.lister.list()? {
                if let Found::Yes(stat) = self.fs.stat(pid)?
                    && let Some(group) = stat.pgid.filter(|g| groups.contains_key(g))
                {
                    found.entry(group).or_default().push(pid);
                }
            }
            let now = Instant::now();
            for group in groups.keys() {
                let members = found.remove(group).unwrap_or_default();
                self.group_members.insert(*group, (now, members));
            }
        }
        Ok(groups
            .keys()
            .filter_map(|g| {
                let (_, members) = self.group_members.get(g)?;
                (members.len() <= MAX_DESCENDANTS_READ).then(|| (*g, members.clone()))
            })
            .collect())
    }

    /// Every process's children, from its parent in `stat`: where the kernel keeps no
    /// `children` lists.
    fn children_by_parent(&mut self) -> Result<HashMap<u32, Vec<u32>>, ProcError> {
        let mut by_parent: HashMap<u32, Vec<u32>> = HashMap::new();
        for pid in self.lister.list()? {
            if let Found::Yes(stat) = self.fs.stat(pid)?
                && let Some(ppid) = stat.ppid
            {
                by_parent.entry(ppid).or_default().push(pid);
            }
        }
        Ok(by_parent)
    }

    /// The known processes in a nested PID namespace whose innermost pid is one of `pids`.
    /// Their identity is read once per process (cached), so this costs a `status` read only
    /// for processes seen for the first time.
    fn nested_as(&mut self, pids: &[u32]) -> Vec<u32> {
        let candidates: Vec<u32> = self.known.keys().copied().collect();
        let mut found = Vec::new();
        for pid in candidates {
            let Some(k) = self.known.get(&pid) else {
                continue;
            };
            // Read once per process (the agent asks every sample while an exited pid stays
            // listed): from its identity facts when read, else its status file.
            let inner = match k.inner_pid {
                Some(inner) => inner,
                None => {
                    let nspid = match k.facts.as_ref() {
                        Some(f) => f.nspid.clone(),
                        None => match self.fs.status(pid) {
                            Ok(Found::Yes(st)) => st.nspid,
                            _ => continue,
                        },
                    };
                    let inner = (nspid.len() > 1).then(|| nspid.last().copied()).flatten();
                    if let Some(k) = self.known.get_mut(&pid) {
                        k.inner_pid = Some(inner);
                    }
                    inner
                }
            };
            if inner.is_some_and(|inner| pids.contains(&inner)) {
                found.push(pid);
            }
        }
        found
    }

    /// Forgets departures beyond the newest [`DEPARTED_KEEP`] and older than
    /// [`DEPARTED_MAX_AGE_MS`].
    fn trim_departed(&mut self, now_ms: u64) {
        while self.departed.len() > DEPARTED_KEEP
            || self
                .departed
                .front()
                .is_some_and(|d| now_ms.saturating_sub(d.gone_at_ms) > DEPARTED_MAX_AGE_MS)
        {
            self.departed.pop_front();
        }
    }

    /// Fd-scans `pids`, on every core when there are many.
    fn scan_fds(&self, pids: &[u32]) -> Result<Vec<(u32, Found<FdScan>)>, ProcError> {
        let (fs, devices) = (&self.fs, &self.devices);
        let (thorough, own) = (self.thorough, self.pidfds_usable);
        on_every_core(pids, self.threads(), |pid| {
            if thorough {
                fs.device_files_of_every_table(pid, devices, own)
            } else {
                fs.device_files(pid, devices)
            }
        })
        .into_iter()
        .map(|(pid, found)| Ok((pid, found?)))
        .collect()
    }

    /// Threads for reading many processes at once (see [`ProcCollector::threads`]'s field).
    fn threads(&self) -> usize {
        *self.threads.get_or_init(|| {
            std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(8)
        })
    }

    /// Reads, on every core, what the serial walk will need of the processes in `pids` it
    /// has never read: their `stat` and identity files. Only where there are many (after a
    /// full scan or a listing); a few are read one by one as they come.
    fn read_first_on_every_core(&mut self, pids: &[u32]) {
        self.drop_first_reads();
        let fresh: Vec<u32> = pids
            .iter()
            .copied()
            .filter(|pid| {
                self.known
                    .get(pid)
                    .is_none_or(|k| k.stat_fd.is_none() && k.facts.is_none())
            })
            .collect();
        // Each read holds a `stat` fd until the walk takes it: no more than the fd budget
        // kept for them has room for (the rest are read one by one, as before).
        let room = self.max_stat_fds.saturating_sub(self.open_stat_fds);
        let mut fresh = fresh;
        fresh.truncate(room);
        if fresh.len() < PARALLEL_SCAN_MIN {
            return;
        }
        let fs = &self.fs;
        self.first_reads = on_every_core(&fresh, self.threads(), |pid| FirstRead::read(fs, pid))
            .into_iter()
            .filter_map(|(pid, read)| Some((pid, read?)))
            .collect();
        if self.command_lines {
            // Apart, with a deadline: a command line is read under the process's mmap lock.
            let pids: Vec<u32> = self
                .first_reads
                .iter()
                .filter(|(_, r)| matches!(r.identity, Some(Ok(_))))
                .map(|(pid, _)| *pid)
                .collect();
            let lines = self.command_lines_of(&pids);
            for (pid, line) in pids.into_iter().zip(lines) {
                let Some(read) = self.first_reads.get_mut(&pid) else {
                    continue;
                };
                match (line, read.identity.as_mut()) {
                    (Ok(line), Some(Ok(files))) => files.cmdline = line,
                    (Err(e), identity) => *identity.expect("read") = Err(e),
                    _ => {}
                }
            }
        }
        // Their `stat` fds count against the budget while they are held.
        self.open_stat_fds += self.first_reads.len();
    }

    /// Forgets what the walk did not take (a process that exited meanwhile), with its fds.
    fn drop_first_reads(&mut self) {
        let held = self
            .first_reads
            .values()
            .filter(|r| r.stat.is_some())
            .count();
        self.open_stat_fds -= held;
        self.first_reads.clear();
    }

    /// What does not change while a process lives (after its exec): executable, owner,
    /// command line, PID namespaces, cgroup and container. Read once per process.
    fn identity(&mut self, pid: u32) -> Result<ProcessFacts, ProcError> {
        let files = match self
            .first_reads
            .get_mut(&pid)
            .and_then(|r| r.identity.take())
        {
            Some(read) => read?,
            None => {
                let mut files = IdentityFiles::read(&self.fs, pid)?;
                if self.command_lines {
                    files.cmdline = self.command_lines_of(&[pid]).pop().expect("one pid")?;
                }
                files
            }
        };
        let status = files.status.ok();
        // Only a status actually read stands in for host memory's own read.
        let read_memory = status.as_ref().map(|s| s.memory);
        let status = status.unwrap_or_default();
        let cmdline = files.cmdline.ok();
        let cgroup = files.cgroup.ok().flatten();
        let (mut container, pod_uid) = cgroup
            .as_deref()
            .map(crate::parse::container_from_cgroup)
            .unwrap_or((None, None));
        if let Some(c) = container.as_mut() {
            c.name = self.containers.name(c);
        }
        let user = status.uid.and_then(|u| self.user_name(u));
        let exe = files.exe.ok();
        let collection = self.collections;
        self.known.entry(pid).or_default().status_memory = read_memory.map(|m| (collection, m));
        Ok(ProcessFacts {
            pid,
            exe,
            uid: status.uid,
            user,
            cmdline,
            nspid: status.nspid,
            cgroup,
            container,
            pod_uid,
            ..ProcessFacts::default()
        })
    }

    /// Fresh `stat` plus cached identity facts for one pid; `None` if it is gone.
    fn refresh(&mut self, pid: u32) -> Result<Option<ProcessFacts>, ProcError> {
        // A `stat` opened here but not kept (the fd budget is spent), for the identity check.
        let mut unheld: Option<OwnedFd> = None;
        let held = self.known.get(&pid).and_then(|k| k.stat_fd.as_ref());
        let stat = match held {
            Some(fd) => match self.fs.reread_stat(pid, fd)? {
                Found::Yes(s) => Some(s),
                // The process we held is gone (the pid may already be someone else's, which
                // the next collection will look at afresh).
                _ => return Ok(None),
            },
            None => None,
        };
        let stat = match stat {
            Some(s) => s,
            None => {
                let read_first = self.first_reads.get_mut(&pid).and_then(|r| r.stat.take());
                let (fd, s) = match read_first {
                    Some(read) => {
                        // In hand now: counted again below if it is kept.
                        self.open_stat_fds -= 1;
                        read
                    }
                    None => {
                        let Found::Yes(fd) = self.fs.open_stat(pid)? else {
                            return Ok(None);
                        };
                        let Found::Yes(s) = self.fs.reread_stat(pid, &fd)? else {
                            return Ok(None);
                        };
                        (fd, s)
                    }
                };
                let reused = self
                    .known
                    .get(&pid)
                    .is_some_and(|k| k.start_ticks.is_some() && k.start_ticks != s.start_ticks);
                if reused {
                    // Same pid, different process: forget everything about the old one.
                    self.forget(pid);
                }
                let known = self.known.entry(pid).or_default();
                if matches!(known.devices, FdScan::NotScanned) {
                    let devices = match self.fs.device_files(pid, &self.devices)? {
                        Found::Yes(d) => d,
                        _ => FdScan::Denied,
                    };
                    self.set_devices(pid, devices)?;
                }
                if self.open_stat_fds < self.max_stat_fds {
                    self.known.get_mut(&pid).expect("just inserted").stat_fd = Some(fd);
                    self.open_stat_fds += 1;
                } else {
                    unheld = Some(fd);
                }
                s
            }
        };
        let needs_identity = self.known.get(&pid).is_none_or(|k| k.facts.is_none());
        let identity = if needs_identity {
            let identity = self.identity(pid)?;
            // The identity files are read by pid: they are this process's only if it still
            // lives after them (a pid is not reused while its process, or its zombie,
            // exists). Else it is gone, and the next collection looks afresh.
            let fd = self
                .known
                .get(&pid)
                .and_then(|k| k.stat_fd.as_ref())
                .or(unheld.as_ref());
            let same = match fd {
                Some(fd) => matches!(
                    self.fs.reread_stat(pid, fd)?,
                    Found::Yes(again) if again.start_ticks == stat.start_ticks
                ),
                None => false,
            };
            if !same {
                return Ok(None);
            }
            Some(identity)
        } else {
            None
        };
        let known = self.known.entry(pid).or_default();
        known.start_ticks = stat.start_ticks;
        known.interesting = true;
        if known.first_ppid.is_none() {
            known.first_ppid = stat.ppid;
        }
        // Which process the first parent was, read once while it still is the parent: a
        // departed process with its pid is that parent only if it started then (pids are
        // reused).
        let parent_start_unread = known.first_parent_start.is_none()
            && known.first_ppid == stat.ppid
            && stat.ppid.is_some_and(|pp| pp > 1);
        if parent_start_unread
            && let Some(pp) = stat.ppid
            && let Ok(Found::Yes(parent)) = self.fs.stat(pp)
        {
            let known = self.known.entry(pid).or_default();
            known.first_parent_start = parent.start_ticks;
        }
        let known = self.known.entry(pid).or_default();
        let earlier_ppid = known.first_ppid.filter(|first| Some(*first) != stat.ppid);
        let earlier_parent_start_ticks = earlier_ppid.and(known.first_parent_start);
        if let Some(identity) = identity {
            known.facts = Some(identity);
        }
        let mut facts = known.facts.clone().unwrap_or_default();
        facts.pid = pid;
        facts.comm = Some(stat.comm.clone());
        facts.ppid = stat.ppid;
        facts.pgid = stat.pgid;
        facts.sid = stat.sid;
        facts.state = stat.state;
        facts.flags = stat.flags;
        facts.start_ticks = stat.start_ticks;
        facts.cpu_ticks = stat.utime.zip(stat.stime).map(|(u, s)| u + s);
        facts.rss_bytes = stat
            .rss_pages
            .map(|pages| pages.saturating_mul(rustix::param::page_size() as u64));
        facts.earlier_ppid = earlier_ppid;
        facts.earlier_parent_start_ticks = earlier_parent_start_ticks;
        facts.device_files = known.devices.clone();
        facts.driver_library = known.driver_library;
        if let Some(f) = known.facts.as_mut() {
            f.comm = Some(stat.comm);
        }
        let exiting = stat.flags.is_some_and(|f| f & PF_EXITING != 0);
        if stat.state == Some('Z') || exiting {
            // Exiting closes files: a cached fd scan of a process that is dying is stale.
            let devices = match self.fs.device_files(pid, &self.devices)? {
                Found::Yes(d) => d,
                Found::Gone => return Ok(None),
                Found::Denied => FdScan::Denied,
            };
            let devices = if self.known.contains_key(&pid) {
                let devices = self.set_devices(pid, devices)?;
                facts.driver_library = self.known.get(&pid).and_then(|k| k.driver_library);
                devices
            } else {
                devices
            };
            facts.device_files = devices;
        }
        if matches!(stat.state, Some('Z' | 'D')) || exiting {
            facts.threads = self.fs.threads(pid)?.ok();
        }
        Ok(Some(facts))
    }

    fn ancestors(&self, pid: u32) -> Vec<u32> {
        let mut chain = Vec::new();
        let mut cur = pid;
        while cur > 1 && chain.len() < 64 {
            match self.fs.stat(cur) {
                Ok(Found::Yes(s)) => match s.ppid {
                    Some(pp) if pp > 0 => {
                        chain.push(pp);
                        cur = pp;
                    }
                    _ => break,
                },
                _ => break,
            }
        }
        chain
    }
}

/// Whether a scan found `/dev/nvidia-uvm` held.
/// The most descendants of one holder whose verdict rests on work (or of its job's tree top)
/// read into one collection.
pub const MAX_DESCENDANTS_READ: usize = 4096;

/// What [`ProcCollector::add_descendants`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descendants {
    /// Processes added.
    pub added: usize,
    /// Roots whose descendants could not all be read.
    pub unread_roots: Vec<u32>,
}

/// One process's fd scan, with the driver library it maps when it holds uvm.
type ScannedWithLibrary = (u32, Found<FdScan>, Option<DriverLibrary>);

/// Reads a small file outside `/proc` (a cgroup file), refusing anything larger than `max`.
fn read_small(path: &Path, max: u64) -> Option<String> {
    use std::io::Read;
    let f = std::fs::File::open(path).ok()?;
    let mut buf = Vec::new();
    f.take(max).read_to_end(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Child, Command};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Instant;
    use vramguard_core::snapshot::DeviceFile;

    /// Killed and reaped on drop.
    struct Reaped(Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A `sleep` holding the stand-ins of `nvidia0` and `nvidia-uvm` in `dev`.
    fn holder(dev: &Path) -> Reaped {
        let script = format!(
            "exec 3<{} 4<{}; exec sleep 60",
            dev.join("nvidia0").display(),
            dev.join("nvidia-uvm").display()
        );
        let h = Reaped(Command::new("sh").arg("-c").arg(script).spawn().unwrap());
        let pid = h.0.id();
        let until = Instant::now() + Duration::from_secs(10);
        while !std::fs::read_to_string(format!("/proc/{pid}/comm"))
            .is_ok_and(|c| c.trim() == "sleep")
        {
            assert!(Instant::now() < until, "the holder never became `sleep`");
            std::thread::sleep(Duration::from_millis(5));
        }
        h
    }

    /// Collects on another thread, failing (not hanging) when it takes more than `limit`.
    fn collect_within(
        c: ProcCollector,
        listed: Vec<u32>,
        depth: ScanDepth,
        limit: Duration,
    ) -> (ProcCollector, Collected, Duration) {
        let (send, receive) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut c = c;
            let began = Instant::now();
            let got = c.collect(&listed, depth, 0).unwrap();
            let _ = send.send((c, got, began.elapsed()));
        });
        receive
            .recv_timeout(limit)
            .expect("the collection hung on a process whose memory map cannot be read")
    }

    /// A process whose memory map cannot be read (a thread stuck in the driver holding its
    /// mmap lock; here the read is made to hang) costs the collection one deadline, not the
    /// collection: the other holder is read whole, the stuck one is there with its command
    /// line and driver library unknown, the collection says so, its map is not read again
    /// while the first read is blocked, and it is read in full once that returns.
    #[test]
    fn a_process_whose_memory_map_hangs_costs_one_deadline_not_the_collection() {
        let dev = tempfile::tempdir().unwrap();
        for name in ["nvidia0", "nvidia-uvm", "nvidiactl"] {
            std::fs::write(dev.path().join(name), b"").unwrap();
        }
        let (stuck, fine) = (holder(dev.path()), holder(dev.path()));
        let (stuck_pid, fine_pid) = (stuck.0.id(), fine.0.id());
        let mut c = ProcCollector::new("/proc", dev.path())
            .unwrap()
            .with_address_space_deadline(Duration::from_millis(300));
        let (release, wait) = std::sync::mpsc::channel::<()>();
        let wait = Mutex::new(wait);
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        c.before_address_space_read(Arc::new(move |pid| {
            if pid == stuck_pid {
                counted.fetch_add(1, Ordering::SeqCst);
                let _ = wait.lock().unwrap().recv();
            }
        }));
        let listed = vec![stuck_pid, fine_pid];
        let limit = Duration::from_secs(20);
        let (c, got, took) = collect_within(c, listed.clone(), ScanDepth::Full, limit);
        assert!(
            took >= Duration::from_millis(300),
            "nothing was given up: {took:?}"
        );
        let facts = |got: &Collected, pid: u32| {
            got.processes
                .iter()
                .find(|p| p.pid == pid)
                .cloned()
                .unwrap_or_else(|| panic!("pid {pid} not collected"))
        };
        let (s, f) = (facts(&got, stuck_pid), facts(&got, fine_pid));
        assert_eq!(s.cmdline, None);
        assert_eq!(s.driver_library, Some(DriverLibrary::Unknown));
        assert!(matches!(&s.device_files, FdScan::Scanned(d) if d.contains(&DeviceFile::Uvm)));
        assert_eq!(f.cmdline.as_deref().map(|c| c[0].as_str()), Some("sleep"));
        assert_eq!(f.driver_library, Some(DriverLibrary::Neither));
        let said = got
            .scan
            .limitations
            .iter()
            .find(|l| l.contains("memory map of pid"))
            .expect("the collection says what it could not read");
        assert!(said.contains(&stuck_pid.to_string()), "{said}");
        assert!(!said.contains(&fine_pid.to_string()), "{said}");
        // Still blocked: not read again (no second thread lost to it), still said.
        let (c, got, _) = collect_within(c, listed.clone(), ScanDepth::Full, limit);
        assert_eq!(
            tries.load(Ordering::SeqCst),
            1,
            "a blocked map was read again"
        );
        assert_eq!(facts(&got, stuck_pid).cmdline, None);
        assert!(
            got.scan
                .limitations
                .iter()
                .any(|l| l.contains("memory map"))
        );
        // The read returns: the next collection reads the process in full.
        drop(release);
        let until = Instant::now() + Duration::from_secs(10);
        while c
            .address_space
            .as_ref()
            .is_some_and(|r| !r.blocked().is_empty())
        {
            assert!(Instant::now() < until, "the released read never returned");
            std::thread::sleep(Duration::from_millis(5));
        }
        let (_, got, _) = collect_within(c, listed, ScanDepth::Holders, limit);
        let s = facts(&got, stuck_pid);
        assert_eq!(s.cmdline.as_deref().map(|c| c[0].as_str()), Some("sleep"));
        assert_eq!(s.driver_library, Some(DriverLibrary::Neither));
        assert!(
            !got.scan
                .limitations
                .iter()
                .any(|l| l.contains("memory map"))
        );
    }

    /// A process that lets go of the driver between its fd scan and the read of its map
    /// (here: its uvm file closed as the map is about to be read, as an NVML client's
    /// shutdown closes its files before the library is unmapped) read as holding uvm and
    /// mapping neither library: a hidden holder. It is scanned again: it holds only what it
    /// still holds, and no library is claimed for it. A process that keeps holding uvm and
    /// maps neither library stays `neither`.
    #[test]
    fn a_process_letting_go_between_its_fd_scan_and_its_map_is_read_as_it_is_now() {
        let dev = tempfile::tempdir().unwrap();
        for name in ["nvidia0", "nvidia-uvm", "nvidiactl"] {
            std::fs::write(dev.path().join(name), b"").unwrap();
        }
        let uvm = dev.path().join("nvidia-uvm");
        // Closes its uvm file on SIGUSR1; its `sleep`s hold nothing.
        let script = format!(
            "exec 3<{} 4<{}; trap 'exec 4<&-' USR1; while :; do sleep 0.02 3<&- 4<&-; done",
            dev.path().join("nvidia0").display(),
            uvm.display()
        );
        let letting_go = Reaped(Command::new("sh").arg("-c").arg(script).spawn().unwrap());
        let pid = letting_go.0.id();
        let holds_uvm_now = move || {
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .into_iter()
                .flatten()
                .flatten()
                .any(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == uvm))
        };
        let until = Instant::now() + Duration::from_secs(10);
        while !holds_uvm_now() {
            assert!(Instant::now() < until, "the holder never opened its files");
            std::thread::sleep(Duration::from_millis(5));
        }
        let keeping = holder(dev.path());
        let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
        let signalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let once = signalled.clone();
        c.before_address_space_read(Arc::new(move |read| {
            if read == pid && !once.swap(true, Ordering::SeqCst) {
                // SAFETY: kill(2) on the child this test started.
                unsafe { libc::kill(pid as i32, libc::SIGUSR1) };
                let until = Instant::now() + Duration::from_secs(10);
                while holds_uvm_now() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }));
        let listed = vec![pid, keeping.0.id()];
        let (_, got, _) = collect_within(c, listed, ScanDepth::Full, Duration::from_secs(20));
        assert!(signalled.load(Ordering::SeqCst), "its map was never read");
        let facts = |pid: u32| {
            got.processes
                .iter()
                .find(|p| p.pid == pid)
                .cloned()
                .unwrap_or_else(|| panic!("pid {pid} not collected"))
        };
        let let_go = facts(pid);
        assert!(
            matches!(&let_go.device_files, FdScan::Scanned(d)
                if d.contains(&DeviceFile::Gpu(0)) && !d.contains(&DeviceFile::Uvm)),
            "{:?}",
            let_go.device_files
        );
        assert_eq!(let_go.driver_library, None);
        let kept = facts(keeping.0.id());
        assert!(matches!(&kept.device_files, FdScan::Scanned(d) if d.contains(&DeviceFile::Uvm)));
        assert_eq!(kept.driver_library, Some(DriverLibrary::Neither));
    }

    /// A system service that runs a GPU holder is read whole: how many processes it runs,
    /// GPU holders or not (`systemctl stop` ends them all), for diagnose's step that stops a
    /// service for a reset. Here a service cgroup of its own (a unique name under
    /// `system.slice` of the cgroup2 mount) with a holder and a process that holds nothing.
    #[test]
    fn a_system_service_that_runs_a_holder_is_counted_whole() {
        let Some(mount) = std::fs::read_to_string("/proc/self/mountinfo")
            .ok()
            .and_then(|t| {
                crate::parse::parse_cgroup_mounts(t.as_bytes())
                    .into_iter()
                    .find(|m| std::path::Path::new(m).join("cgroup.controllers").exists())
            })
            .map(PathBuf::from)
        else {
            panic!("no cgroup2 mount: the suite needs one (as every cgroup test does)");
        };
        /// Removes the service's cgroup (and `system.slice`, if made here and empty) once
        /// its processes are reaped.
        struct Service {
            dir: PathBuf,
            slice: Option<PathBuf>,
            processes: Vec<Reaped>,
        }
        impl Drop for Service {
            fn drop(&mut self) {
                self.processes.clear();
                let until = Instant::now() + Duration::from_secs(5);
                while std::fs::remove_dir(&self.dir).is_err() && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if let Some(slice) = &self.slice {
                    let _ = std::fs::remove_dir(slice);
                }
            }
        }
        let slice = mount.join("system.slice");
        let made = (!slice.exists() && std::fs::create_dir(&slice).is_ok()).then(|| slice.clone());
        let unit = format!("vramguard-test-{}-dashboard.service", std::process::id());
        let dir = slice.join(&unit);
        std::fs::create_dir(&dir).unwrap();
        let mut service = Service {
            dir: dir.clone(),
            slice: made,
            processes: Vec::new(),
        };
        let dev = tempfile::tempdir().unwrap();
        for name in ["nvidia0", "nvidia-uvm", "nvidiactl"] {
            std::fs::write(dev.path().join(name), b"").unwrap();
        }
        let holding = holder(dev.path());
        let holding_pid = holding.0.id();
        let other = Reaped(Command::new("sleep").arg("60").spawn().unwrap());
        for pid in [holding_pid, other.0.id()] {
            std::fs::write(dir.join("cgroup.procs"), pid.to_string()).unwrap();
        }
        service.processes.extend([holding, other]);
        let c = ProcCollector::new("/proc", dev.path()).unwrap();
        let (_, got, _) = collect_within(
            c,
            vec![holding_pid],
            ScanDepth::Full,
            Duration::from_secs(20),
        );
        let h = got.processes.iter().find(|p| p.pid == holding_pid).unwrap();
        let root = format!("/system.slice/{unit}");
        assert_eq!(h.cgroup.as_deref(), Some(root.as_str()));
        let facts = got
            .job_cgroups
            .iter()
            .find(|f| f.root == root)
            .unwrap_or_else(|| panic!("{root} not read: {:#?}", got.job_cgroups));
        assert!(facts.readable && facts.complete, "{facts:#?}");
        assert_eq!(facts.members, 2, "{facts:#?}");
        drop(service);
    }

    /// The descendants of a root, two levels deep, are added once each (from the kernel's
    /// lists); the fallback for a kernel without them (every process's parent) finds the same
    /// children.
    /// The members of a process group whose leader is gone are read with a root of it: each
    /// re-parented on its own, they are the same dead job.
    #[test]
    fn the_members_of_a_roots_leaderless_group_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let pids = dir.path().join("pids");
        let mut leader = Command::new("sh");
        leader.arg("-c").arg(format!(
            "sleep 60 & echo $! > {p}; sleep 60 & echo $! >> {p}; exit 0",
            p = pids.display()
        ));
        std::os::unix::process::CommandExt::process_group(&mut leader, 0);
        let mut leader = Reaped(leader.spawn().unwrap());
        let _ = leader.0.wait();
        let members: Vec<u32> = std::fs::read_to_string(&pids)
            .unwrap()
            .lines()
            .map(|l| l.trim().parse().unwrap())
            .collect();
        assert_eq!(members.len(), 2);
        let kill = || {
            for m in &members {
                // SAFETY: kill(2) on the sleeps this test started.
                unsafe { libc::kill(*m as i32, libc::SIGKILL) };
            }
        };
        let fs = ProcFs::open("/proc").unwrap();
        let mut c = ProcCollector::new("/proc", dir.path()).unwrap();
        let mut processes = Vec::new();
        let Found::Yes(first) = fs.stat(members[0]).unwrap() else {
            kill();
            panic!("no member");
        };
        let mut facts = ProcessFacts {
            pid: members[0],
            pgid: first.pgid,
            ..Default::default()
        };
        facts.ppid = first.ppid;
        processes.push(facts);
        let read = c.add_descendants(&mut processes, &[members[0]]);
        kill();
        let read = read.unwrap();
        assert!(read.unread_roots.is_empty(), "{read:?}");
        assert!(
            processes.iter().any(|p| p.pid == members[1]),
            "the other member: {:?}",
            processes.iter().map(|p| p.pid).collect::<Vec<_>>()
        );
    }

    /// A holder whose parent died is seen re-parented with the parent an earlier collection
    /// saw and that parent's start time, and the parent departs with the same start time and
    /// its uid: what ties the holder to the parent's pid only while that pid is the parent's
    /// (a pid taken by another process since has another start time).
    #[test]
    fn a_re_parented_holder_names_its_earlier_parent_and_when_it_started() {
        let dev = tempfile::tempdir().unwrap();
        for name in ["nvidia0", "nvidia-uvm", "nvidiactl"] {
            std::fs::write(dev.path().join(name), b"").unwrap();
        }
        let pid_file = dev.path().join("child.pid");
        let script = format!(
            "(exec 3<{} 4<{}; exec sleep 60) & echo $! > {}; exec sleep 60",
            dev.path().join("nvidia0").display(),
            dev.path().join("nvidia-uvm").display(),
            pid_file.display()
        );
        let mut parent = Reaped(Command::new("sh").arg("-c").arg(script).spawn().unwrap());
        let parent_pid = parent.0.id();
        let until = Instant::now() + Duration::from_secs(10);
        let child: u32 = loop {
            let read = std::fs::read_to_string(&pid_file).ok();
            if let Some(pid) = read.and_then(|t| t.trim().parse().ok())
                && std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|c| c.trim() == "sleep")
            {
                break pid;
            }
            assert!(Instant::now() < until, "the holder never started");
            std::thread::sleep(Duration::from_millis(5));
        };
        let fs = ProcFs::open("/proc").unwrap();
        let Found::Yes(parent_stat) = fs.stat(parent_pid).unwrap() else {
            panic!("no parent")
        };
        let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
        let got = c.collect(&[], ScanDepth::Full, 1_000).unwrap();
        let facts = got.processes.iter().find(|p| p.pid == child).unwrap();
        assert_eq!(facts.ppid, Some(parent_pid));
        assert_eq!(facts.earlier_ppid, None);
        let _ = parent.0.kill();
        let _ = parent.0.wait();
        let until = Instant::now() + Duration::from_secs(10);
        while matches!(fs.stat(child), Ok(Found::Yes(s)) if s.ppid == Some(parent_pid)) {
            assert!(Instant::now() < until, "never re-parented");
            std::thread::sleep(Duration::from_millis(5));
        }
        let got = c.collect(&[], ScanDepth::Full, 2_000).unwrap();
        let facts = got.processes.iter().find(|p| p.pid == child).cloned();
        // SAFETY: kill(2) on the holder this test started (its parent is gone).
        unsafe { libc::kill(child as i32, libc::SIGKILL) };
        let facts = facts.unwrap();
        assert_eq!(facts.earlier_ppid, Some(parent_pid));
        assert_eq!(facts.earlier_parent_start_ticks, parent_stat.start_ticks);
        let departed = got.departed.iter().find(|d| d.pid == parent_pid).unwrap();
        assert_eq!(departed.start_ticks, parent_stat.start_ticks);
        assert_eq!(departed.uid, Some(rustix::process::getuid().as_raw()));
    }

    #[test]
    fn the_descendants_of_a_root_are_read_whole() {
        let root = Reaped(
            Command::new("sh")
                .arg("-c")
                .arg("sh -c 'sleep 60 & wait' & sleep 60 & wait")
                .spawn()
                .unwrap(),
        );
        let pid = root.0.id();
        let fs = ProcFs::open("/proc").unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        let grandchildren = loop {
            let children = fs.children(pid).unwrap().unwrap_or_default();
            let below: Vec<u32> = children
                .iter()
                .flat_map(|c| fs.children(*c).unwrap().unwrap_or_default())
                .collect();
            if children.len() == 2 && below.len() == 1 {
                break (children, below);
            }
            assert!(Instant::now() < until, "the tree never formed");
            std::thread::sleep(Duration::from_millis(10));
        };
        let dev = tempfile::tempdir().unwrap();
        let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
        let mut processes = Vec::new();
        let added = c.add_descendants(&mut processes, &[pid, pid]).unwrap();
        assert!(added.unread_roots.is_empty(), "{added:?}");
        let added = added.added;
        let mut got: Vec<u32> = processes.iter().map(|p| p.pid).collect();
        got.sort_unstable();
        let mut want: Vec<u32> = grandchildren
            .0
            .iter()
            .chain(&grandchildren.1)
            .copied()
            .collect();
        want.sort_unstable();
        assert_eq!((added, got), (3, want));
        let by_parent = c.children_by_parent().unwrap();
        let mut listed = by_parent.get(&pid).cloned().unwrap_or_default();
        listed.sort_unstable();
        let mut kernel = grandchildren.0.clone();
        kernel.sort_unstable();
        assert_eq!(listed, kernel);
        // Every process of the tree is killed by pid: the root's group is its own shell's.
        for p in grandchildren.0.iter().chain(&grandchildren.1) {
            // SAFETY: kill(2) on a descendant of the child this test started.
            unsafe { libc::kill(*p as i32, libc::SIGKILL) };
        }
        // Read for their work only: their exits are not remembered among the departed.
        let until = Instant::now() + Duration::from_secs(10);
        while grandchildren
            .0
            .iter()
            .chain(&grandchildren.1)
            .any(|p| Path::new(&format!("/proc/{p}")).exists())
        {
            assert!(Instant::now() < until, "the tree was never reaped");
            std::thread::sleep(Duration::from_millis(10));
        }
        let got = c.collect(&[], ScanDepth::Full, 0).unwrap();
        assert!(
            got.departed
                .iter()
                .all(|d| !grandchildren.0.contains(&d.pid) && !grandchildren.1.contains(&d.pid)),
            "{:?}",
            got.departed
        );
    }

    /// Each root's walk has a budget of its own (review finding: one shared budget let one
    /// user's tree of thousands hide another holder's working grandchild, without a sign).
    /// A root whose walk is cut short is named, and the other root is read whole.
    #[test]
    fn one_roots_large_tree_does_not_hide_anothers_descendants() {
        let wide = Reaped(
            Command::new("sh")
                .arg("-c")
                .arg("for i in 1 2 3 4 5; do sleep 60 & done; wait")
                .spawn()
                .unwrap(),
        );
        let deep = Reaped(
            Command::new("sh")
                .arg("-c")
                .arg("sh -c 'sleep 60 & wait' & wait")
                .spawn()
                .unwrap(),
        );
        let fs = ProcFs::open("/proc").unwrap();
        let until = Instant::now() + Duration::from_secs(10);
        let (wide_pid, deep_pid) = (wide.0.id(), deep.0.id());
        let grandchild = loop {
            let wide_children = fs.children(wide_pid).unwrap().unwrap_or_default();
            let below: Vec<u32> = fs
                .children(deep_pid)
                .unwrap()
                .unwrap_or_default()
                .iter()
                .flat_map(|c| fs.children(*c).unwrap().unwrap_or_default())
                .collect();
            if wide_children.len() == 5 && below.len() == 1 {
                break below[0];
            }
            assert!(Instant::now() < until, "the trees never formed");
            std::thread::sleep(Duration::from_millis(10));
        };
        let dev = tempfile::tempdir().unwrap();
        let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
        c.descendants_budget = 3;
        let mut processes = Vec::new();
        let read = c
            .add_descendants(&mut processes, &[wide_pid, deep_pid])
            .unwrap();
        assert_eq!(read.unread_roots, vec![wide_pid], "{read:?}");
        assert!(
            processes.iter().any(|p| p.pid == grandchild),
            "the other root's grandchild was not read"
        );
        for p in fs
            .children(wide_pid)
            .unwrap()
            .unwrap_or_default()
            .into_iter()
            .chain(fs.children(deep_pid).unwrap().unwrap_or_default())
            .chain([grandchild])
        {
            // SAFETY: kill(2) on descendants of the children this test started.
            unsafe { libc::kill(p as i32, libc::SIGKILL) };
        }
    }
}
