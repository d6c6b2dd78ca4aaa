//! The process half of a snapshot, gathered incrementally.
//!
//! A full fd scan reads a symlink per open file on the host: tens of milliseconds with 50,000
//! fds. The driver already names most holders, so a steady-state collection only
//! - lists the pids (one `getdents` pass),
//! - scans the fds of processes it has not seen before and of pids the driver lists,
//! - refreshes `stat` of the known holders and of their parents and job leaders.
//!
//! A process seen before that opens a device file later without the driver listing it (a
//! hidden holder) is found by the next full scan, which callers request for `diagnose`, when
//! a GPU shows unaccounted memory, and periodically.

use crate::procfs::{Found, ProcError, ProcFs};
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use vramguard_core::snapshot::{
    DepartedProcess, FdScan, HostFacts, PF_EXITING, ProcessFacts, ScanFacts,
};

/// How deep a collection looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanDepth {
    /// Scan the fds of every process.
    Full,
    /// Scan only new processes and listed pids; reuse earlier results for the rest.
    Incremental,
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
}

#[derive(Debug, Default)]
struct Known {
    start_ticks: Option<u64>,
    devices: FdScan,
    /// Identity facts that do not change while the process lives (cmdline, uid, namespace,
    /// cgroup), read once.
    facts: Option<ProcessFacts>,
    /// Held a device or led a holder's job: remembered in `departed` when it exits.
    interesting: bool,
}

const DEPARTED_KEEP: usize = 256;
const DEPARTED_MAX_AGE_MS: u64 = 3_600_000;

/// Gathers process facts, remembering what it saw between collections.
#[derive(Debug)]
pub struct ProcCollector {
    fs: ProcFs,
    dev_dir: PathBuf,
    passwd: PathBuf,
    known: HashMap<u32, Known>,
    departed: VecDeque<DepartedProcess>,
    users: Option<HashMap<u32, String>>,
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
        Ok(ProcCollector {
            fs: ProcFs::open(proc_root)?,
            dev_dir,
            passwd: PathBuf::from("/etc/passwd"),
            known: HashMap::new(),
            departed: VecDeque::new(),
            users: None,
        })
    }

    /// Reads user names from another passwd file (fixture trees).
    pub fn with_passwd(mut self, path: impl Into<PathBuf>) -> Self {
        self.passwd = path.into();
        self.users = None;
        self
    }

    /// The `/proc` tree.
    pub fn procfs(&self) -> &ProcFs {
        &self.fs
    }

    /// The device directory.
    pub fn dev_dir(&self) -> &Path {
        &self.dev_dir
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

    /// One collection. `listed` are the pids the driver reports (they are always fd-scanned
    /// once, so that a pid from another namespace can be told apart); `now_ms` stamps
    /// departures.
    pub fn collect(
        &mut self,
        listed: &[u32],
        depth: ScanDepth,
        now_ms: u64,
    ) -> Result<Collected, ProcError> {
        let dev_dir = self.dev_dir.as_os_str().as_encoded_bytes().to_vec();
        let pids = self.fs.pids()?;
        let present: HashSet<u32> = pids.iter().copied().collect();

        // Departures.
        let gone: Vec<u32> = self
            .known
            .keys()
            .filter(|p| !present.contains(p))
            .copied()
            .collect();
        for pid in gone {
            if let Some(k) = self.known.remove(&pid)
                && k.interesting
                && let Some(f) = k.facts
            {
                self.departed.push_back(DepartedProcess {
                    pid,
                    comm: f.comm,
                    cmdline: f.cmdline,
                    gone_at_ms: now_ms,
                });
            }
        }
        while self.departed.len() > DEPARTED_KEEP
            || self
                .departed
                .front()
                .is_some_and(|d| now_ms.saturating_sub(d.gone_at_ms) > DEPARTED_MAX_AGE_MS)
        {
            self.departed.pop_front();
        }

        // Fd scans: everything (full) or what is new (incremental), plus listed pids.
        let mut denied = 0usize;
        let mut vanished = Vec::new();
        for &pid in &pids {
            let known = self.known.entry(pid).or_default();
            let scan = depth == ScanDepth::Full || matches!(known.devices, FdScan::NotScanned);
            if scan {
                match self.fs.device_files(pid, &dev_dir)? {
                    Found::Yes(devices) => known.devices = devices,
                    Found::Denied => known.devices = FdScan::Denied,
                    Found::Gone => vanished.push(pid),
                }
            }
        }
        for pid in vanished {
            self.known.remove(&pid);
        }
        // A listed pid whose cached scan shows no device file has opened one since (it
        // initialised CUDA after we first saw it), or is a pid from another namespace: look
        // again. Only listed pids pay for this.
        for &pid in listed {
            if let Some(k) = self.known.get_mut(&pid)
                && depth == ScanDepth::Incremental
                && matches!(k.devices, FdScan::NotScanned | FdScan::Scanned(_))
                && k.devices.holds_any() != Some(true)
                && let Found::Yes(devices) = self.fs.device_files(pid, &dev_dir)?
            {
                k.devices = devices;
            }
        }
        for k in self.known.values() {
            if matches!(k.devices, FdScan::Denied) {
                denied += 1;
            }
        }

        // The processes that matter: listed pids and device holders, then their relatives.
        let mut wanted: Vec<u32> = self
            .known
            .iter()
            .filter(|(_, k)| k.devices.holds_any() == Some(true))
            .map(|(p, _)| *p)
            .chain(listed.iter().copied().filter(|p| present.contains(p)))
            .collect();
        wanted.sort_unstable();
        wanted.dedup();

        let mut out: HashMap<u32, ProcessFacts> = HashMap::new();
        let mut relatives = Vec::new();
        for pid in wanted {
            if let Some(facts) = self.refresh(pid, &dev_dir)? {
                for rel in [facts.ppid, facts.pgid].into_iter().flatten() {
                    if rel > 0 && rel != pid && present.contains(&rel) {
                        relatives.push(rel);
                    }
                }
                out.insert(pid, facts);
            }
        }
        for pid in relatives {
            if out.contains_key(&pid) {
                continue;
            }
            if let Some(facts) = self.refresh(pid, &dev_dir)? {
                out.insert(pid, facts);
            }
        }
        let mut processes: Vec<ProcessFacts> = out.into_values().collect();
        processes.sort_by_key(|p| p.pid);

        let euid = rustix::process::geteuid().as_raw();
        let mut limitations = Vec::new();
        if denied > 0 && euid != 0 {
            limitations.push(format!(
                "open files of {denied} process(es) were unreadable (other users' processes): \
                 run as root to see every holder"
            ));
        }
        let self_pid = self.fs.self_pid().unwrap_or(0);
        let host = HostFacts {
            hostname: self.fs.hostname(),
            clock_ticks_per_sec: rustix::param::clock_ticks_per_second(),
            boot_time_ms: self.fs.boot_time_ms(),
            self_pid,
            self_ancestors: self.ancestors(self_pid),
            pid_namespace_is_host: self.fs.pid_namespace_is_host(),
            euid,
        };
        Ok(Collected {
            processes,
            departed: self.departed.iter().cloned().collect(),
            scan: ScanFacts {
                proc_root: self.fs.root().display().to_string(),
                dev_dir: self.dev_dir.display().to_string(),
                full_fd_scan: depth == ScanDepth::Full,
                limitations,
            },
            host,
        })
    }

    /// Fresh `stat` plus cached identity facts for one pid; `None` if it is gone.
    fn refresh(&mut self, pid: u32, dev_dir: &[u8]) -> Result<Option<ProcessFacts>, ProcError> {
        let stat = match self.fs.stat(pid)? {
            Found::Yes(s) => s,
            Found::Gone | Found::Denied => return Ok(None),
        };
        let reused = self
            .known
            .get(&pid)
            .is_some_and(|k| k.start_ticks.is_some() && k.start_ticks != stat.start_ticks);
        if reused {
            // Same pid, different process: forget everything about the old one.
            let devices = match self.fs.device_files(pid, dev_dir)? {
                Found::Yes(d) => d,
                _ => FdScan::Denied,
            };
            self.known.insert(
                pid,
                Known {
                    devices,
                    ..Known::default()
                },
            );
        }
        let needs_identity = self.known.get(&pid).is_none_or(|k| k.facts.is_none());
        let identity = if needs_identity {
            let status = self.fs.status(pid)?.ok().unwrap_or_default();
            let cmdline = self.fs.cmdline(pid)?.ok();
            let cgroup = self.fs.cgroup(pid)?.ok().flatten();
            let (container, pod_uid) = cgroup
                .as_deref()
                .map(crate::parse::container_from_cgroup)
                .unwrap_or((None, None));
            let user = status.uid.and_then(|u| self.user_name(u));
            Some(ProcessFacts {
                pid,
                uid: status.uid,
                user,
                cmdline,
                nspid: status.nspid,
                cgroup,
                container,
                pod_uid,
                ..ProcessFacts::default()
            })
        } else {
            None
        };
        let known = self.known.entry(pid).or_default();
        known.start_ticks = stat.start_ticks;
        known.interesting = true;
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
        facts.device_files = known.devices.clone();
        if let Some(f) = known.facts.as_mut() {
            f.comm = Some(stat.comm);
        }
        let exiting = stat.flags.is_some_and(|f| f & PF_EXITING != 0);
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
