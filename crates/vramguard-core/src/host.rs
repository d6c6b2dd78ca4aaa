//! The host side of a dead GPU job: host RAM, pinned memory and shared-memory segments.
//!
//! A killed training job leaves more than GPU memory. Its orphaned workers keep their RSS and
//! pinned buffers, and shared-memory segments outlive every process: PyTorch's `file_system`
//! sharing strategy leaves `/dev/shm/torch_*`, NCCL leaves `/dev/shm/nccl-*` when a rank dies,
//! Python's `multiprocessing.shared_memory` leaves `psm_*`. `/dev/shm` is RAM.
//!
//! [`assess`] decides, from the facts of one snapshot, which segments are orphaned and may be
//! removed. A segment is **reclaimable** only when every one of these holds:
//! - its name starts with a known producer's prefix (an unknown producer may be a database or
//!   a service that maps it on demand);
//! - no process maps it or holds it open (by device and inode, so a container's own `/dev/shm`
//!   is never confused with the host's), and that was fully checked; or the only ones that do
//!   are about to be reclaimed (the dead job's own workers), and it is judged again after they
//!   are gone;
//! - its owner has no live GPU holder, which could still open it by name (unless the owner
//!   rule says otherwise, or those holders are all about to be reclaimed);
//! - it was neither written nor changed for `min_age`;
//! - its name is exact UTF-8 without `/` (what is removed is exactly what was shown).
//!
//! Anything else is shown and never touched.

use crate::report::{Class, Report};
use crate::snapshot::Snapshot;
use crate::units::format_duration;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// What `/proc/meminfo`, `/proc/pressure/memory` and the shared-memory directories said.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct HostMemoryFacts {
    /// `MemTotal`, bytes.
    #[serde(default)]
    pub mem_total_bytes: Option<u64>,
    /// `MemAvailable`, bytes: what the kernel could give a new job without swapping.
    #[serde(default)]
    pub mem_available_bytes: Option<u64>,
    /// Memory pressure (PSI), where the kernel exposes it.
    #[serde(default)]
    pub pressure: Option<MemoryPressure>,
    /// Each configured shared-memory directory (`/dev/shm` by default), scanned at full depth.
    #[serde(default)]
    pub shm: Vec<ShmDirFacts>,
}

/// `/proc/pressure/memory`: the share of time tasks stalled waiting for memory, in percent.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct MemoryPressure {
    /// `some avg10`: at least one task stalled, over the last 10 s.
    pub some_avg10: f64,
    /// `some avg60`.
    pub some_avg60: f64,
    /// `full avg10`: every non-idle task stalled, over the last 10 s.
    pub full_avg10: f64,
}

/// One shared-memory directory (a tmpfs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ShmDirFacts {
    /// The directory, as configured.
    pub path: String,
    /// Its filesystem's device number (`st_dev`): maps and open files match by it.
    pub dev: u64,
    /// The filesystem's size (`statvfs`), bytes.
    #[serde(default)]
    pub size_bytes: Option<u64>,
    /// Bytes in use on it.
    #[serde(default)]
    pub used_bytes: Option<u64>,
    /// The regular files directly in it.
    #[serde(default)]
    pub segments: Vec<ShmSegmentFacts>,
    /// Entries that are not regular files (directories, links, FIFOs, sockets): never touched.
    #[serde(default)]
    pub other_entries: u32,
    /// More entries than are read; the rest were not looked at.
    #[serde(default)]
    pub truncated: bool,
    /// Why the directory could not be read, when it could not.
    #[serde(default)]
    pub error: Option<String>,
    /// Whether every process's open files and maps were checked for these segments (needs
    /// root for other users' processes). Without it no segment is reclaimable.
    #[serde(default)]
    pub users_checked: bool,
    /// Processes whose maps or open files could not be read (at most 10).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unchecked_pids: Vec<u32>,
}

/// One regular file in a shared-memory directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ShmSegmentFacts {
    /// The file name (lossy when not UTF-8; see [`ShmSegmentFacts::exact_name`]).
    pub name: String,
    /// Whether `name` is the file's exact name. A name that is not UTF-8 is shown, never
    /// removed.
    #[serde(default = "yes")]
    pub exact_name: bool,
    /// Inode number.
    pub inode: u64,
    /// Memory it takes (`st_blocks` × 512, so a sparse file counts what it uses).
    pub bytes: u64,
    /// Its apparent size (`st_size`).
    pub size: u64,
    /// Owner uid.
    pub uid: u32,
    /// Last data change (`st_mtime`), ms since the Unix epoch.
    pub modified_ms: u64,
    /// Last inode change (`st_ctime`: creation, rename, chmod), ms since the Unix epoch.
    pub changed_ms: u64,
    /// Processes that map it or hold it open, when checked.
    #[serde(default)]
    pub users: Vec<u32>,
}

fn yes() -> bool {
    true
}

/// Host memory of one process, beyond its RSS (which comes from `stat`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ProcessHostMemory {
    /// `VmPin`: pages pinned by the kernel on the process's behalf (RDMA, `cudaHostRegister`
    /// through some drivers), bytes.
    #[serde(default)]
    pub pinned_bytes: Option<u64>,
    /// `VmLck`: memory locked with `mlock` (pinned host buffers: `cudaHostAlloc`), bytes.
    #[serde(default)]
    pub locked_bytes: Option<u64>,
    /// Memory of shared-memory segments it maps, bytes (each segment once, its largest
    /// mapping), from `/proc/PID/maps`; 0, unread, when `status` shows no shared memory
    /// resident at all (`RssShmem: 0 kB`).
    #[serde(default)]
    pub shm_bytes: Option<u64>,
}

/// Who may still open a segment by name, for [`ShmPolicy::owner_rule`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum OwnerRule {
    /// A segment is kept while its owner has any live GPU holder (the processes that make
    /// these segments are GPU jobs). The default.
    #[default]
    NoLiveHolder,
    /// The owner's processes are not considered: only users and age decide.
    Ignore,
}

/// An owner rule that is neither `no-live-holder` nor `ignore`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown owner rule {0:?} (no-live-holder or ignore)")]
pub struct UnknownOwnerRule(pub String);

impl std::str::FromStr for OwnerRule {
    type Err = UnknownOwnerRule;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "no-live-holder" => Ok(OwnerRule::NoLiveHolder),
            "ignore" => Ok(OwnerRule::Ignore),
            _ => Err(UnknownOwnerRule(s.to_string())),
        }
    }
}

/// The prefixes of the segments GPU jobs leave behind, with the producer each names.
pub const DEFAULT_PRODUCERS: &[(&str, &str)] = &[
    // shm_open("/torch_<pid>_<random>_<n>"): the file_system sharing strategy.
    ("torch_", "PyTorch"),
    // "/dev/shm/nccl-XXXXXX": NCCL's intra-node transport.
    ("nccl-", "NCCL"),
    // multiprocessing.shared_memory.SharedMemory's default names.
    ("psm_", "Python shared_memory"),
    // sem_open("/NAME") creates /dev/shm/sem.NAME (multiprocessing's locks: sem.mp-…).
    ("sem.", "POSIX semaphore"),
];

/// The knobs of [`assess`] (`[shm]` in the config file).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShmPolicy {
    /// Name prefixes that identify a producer (see [`DEFAULT_PRODUCERS`]); only their
    /// segments can be reclaimable.
    pub producers: Vec<String>,
    /// A segment written or changed more recently than this is kept. Default 10 minutes.
    pub min_age_secs: u64,
    /// Whether the owner's live GPU holders keep a segment.
    pub owner_rule: OwnerRule,
}

impl Default for ShmPolicy {
    fn default() -> Self {
        ShmPolicy {
            producers: DEFAULT_PRODUCERS
                .iter()
                .map(|(p, _)| p.to_string())
                .collect(),
            min_age_secs: 600,
            owner_rule: OwnerRule::NoLiveHolder,
        }
    }
}

impl ShmPolicy {
    /// The producer a name's prefix identifies: its description for a known prefix, the
    /// prefix itself for a configured one.
    pub fn producer(&self, name: &str) -> Option<String> {
        let prefix = self
            .producers
            .iter()
            .filter(|p| !p.is_empty() && name.starts_with(p.as_str()))
            .max_by_key(|p| p.len())?;
        Some(
            DEFAULT_PRODUCERS
                .iter()
                .find(|(p, _)| p == prefix)
                .map_or_else(|| format!("{prefix}*"), |(_, d)| d.to_string()),
        )
    }
}

/// Why a segment is kept, or that it may go.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum SegmentVerdict {
    /// Orphaned: nothing uses it and nothing can be expected to.
    Reclaimable,
    /// Mapped or held open by these processes.
    InUse {
        /// Their pids.
        pids: Vec<u32>,
    },
    /// Its owner has live GPU holders that could open it by name.
    OwnerActive {
        /// Those holders.
        pids: Vec<u32>,
    },
    /// Written or changed too recently.
    TooYoung {
        /// Seconds since the last change.
        age_secs: u64,
    },
    /// Its name matches no known producer.
    UnknownProducer,
    /// Not every process could be checked for it (not root, or a process hides its maps).
    UsersUnknown {
        /// Processes that could not be checked (at most 10).
        unchecked: Vec<u32>,
    },
    /// Its name is not exact UTF-8.
    OddName,
}

impl SegmentVerdict {
    /// A line for humans.
    pub fn explain(&self, min_age_secs: u64) -> String {
        let pids = |p: &[u32]| {
            let mut s: Vec<String> = p.iter().take(5).map(|p| p.to_string()).collect();
            if p.len() > 5 {
                s.push(format!("and {} more", p.len() - 5));
            }
            s.join(", ")
        };
        match self {
            SegmentVerdict::Reclaimable => {
                "orphaned: no process maps it or holds it open, its owner has no live GPU \
                 holder, unchanged for longer than min_age"
                    .into()
            }
            SegmentVerdict::InUse { pids: p } => format!("in use by pid {}", pids(p)),
            SegmentVerdict::OwnerActive { pids: p } => format!(
                "its owner still runs GPU holders (pid {}) that could open it by name",
                pids(p)
            ),
            SegmentVerdict::TooYoung { age_secs } => format!(
                "changed {} ago (kept until {} old)",
                format_duration(Duration::from_secs(*age_secs)),
                format_duration(Duration::from_secs(min_age_secs))
            ),
            SegmentVerdict::UnknownProducer => {
                "no known producer's name (add its prefix to [shm] producers to consider it)".into()
            }
            SegmentVerdict::UsersUnknown { unchecked } if unchecked.is_empty() => {
                "its users were not checked (a full scan checks them)".into()
            }
            SegmentVerdict::UsersUnknown { unchecked } => format!(
                "pid {} could not be checked for it (maps or open files unreadable: run as \
                 root; a process even root cannot read keeps every segment)",
                pids(unchecked)
            ),
            SegmentVerdict::OddName => "its name is not UTF-8: shown, never removed".into(),
        }
    }
}

/// One segment with its verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentReport {
    /// Its directory.
    pub dir: String,
    /// The directory's device number.
    pub dev: u64,
    /// The file name.
    pub name: String,
    /// Inode number: what is removed must still be this file.
    pub inode: u64,
    /// Memory it takes, bytes.
    pub bytes: u64,
    /// Owner uid.
    pub uid: u32,
    /// Seconds since it was last written or changed.
    pub age_secs: u64,
    /// The producer its name identifies.
    pub producer: Option<String>,
    /// Processes that map it or hold it open.
    pub users: Vec<u32>,
    /// The verdict.
    #[serde(flatten)]
    pub verdict: SegmentVerdict,
    /// Reclaimable only once these reclaim targets (the owner's last GPU holders) are gone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after_targets: Vec<u32>,
}

/// One shared-memory directory's use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmDirReport {
    /// The directory.
    pub path: String,
    /// Filesystem size, bytes.
    pub size_bytes: Option<u64>,
    /// Bytes in use.
    pub used_bytes: Option<u64>,
    /// Bytes in reclaimable segments.
    pub orphan_bytes: u64,
    /// Why it could not be read.
    pub error: Option<String>,
    /// Whether the scan stopped before the end.
    pub truncated: bool,
}

/// The host memory of one job whose leader is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobHostMemory {
    /// The dead leader's pid.
    pub leader_pid: u32,
    /// GPU memory its processes hold, bytes.
    pub gpu_bytes: u64,
    /// Host RSS of its processes, bytes.
    pub rss_bytes: u64,
    /// Pinned and locked host memory of its processes, bytes.
    pub pinned_bytes: u64,
    /// Shared memory its processes map, bytes (part of `rss_bytes` once touched).
    pub shm_bytes: u64,
    /// Its processes.
    pub pids: Vec<u32>,
}

/// The host side of a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct HostReport {
    /// `MemTotal`, bytes.
    pub mem_total_bytes: Option<u64>,
    /// `MemAvailable`, bytes.
    pub mem_available_bytes: Option<u64>,
    /// Memory pressure.
    pub pressure: Option<MemoryPressure>,
    /// The shared-memory directories.
    pub shm_dirs: Vec<ShmDirReport>,
    /// Every segment, reclaimable first, then by size.
    pub segments: Vec<SegmentReport>,
    /// Bytes in reclaimable segments.
    pub orphan_shm_bytes: u64,
    /// Host memory of jobs whose leader is gone.
    pub dead_jobs: Vec<JobHostMemory>,
}

/// Judges every segment of `snap`, given the classified `report`. `leaving` are pids about to
/// be reclaimed: an owner whose only live GPU holders are among them does not keep a segment
/// (it is planned to go after them, and judged again then).
pub fn assess(
    snap: &Snapshot,
    report: &Report,
    policy: &ShmPolicy,
    leaving: &BTreeSet<u32>,
) -> Option<HostReport> {
    let facts = snap.host_memory.as_ref()?;
    // Live GPU holders per uid: the processes that could open a segment by name.
    let mut holders_of: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    for (_, h) in report.holders() {
        if matches!(h.class, Class::Foreign) || snap.process(h.pid).is_none() {
            continue;
        }
        if let Some(uid) = h.uid {
            holders_of.entry(uid).or_default().insert(h.pid);
        }
    }
    let mut segments = Vec::new();
    let mut shm_dirs = Vec::new();
    for dir in &facts.shm {
        let mut orphan_bytes = 0u64;
        for s in &dir.segments {
            let seg = judge(snap, dir, s, policy, &holders_of, leaving);
            if seg.verdict == SegmentVerdict::Reclaimable {
                orphan_bytes = orphan_bytes.saturating_add(seg.bytes);
            }
            segments.push(seg);
        }
        shm_dirs.push(ShmDirReport {
            path: dir.path.clone(),
            size_bytes: dir.size_bytes,
            used_bytes: dir.used_bytes,
            orphan_bytes,
            error: dir.error.clone(),
            truncated: dir.truncated,
        });
    }
    segments.sort_by(|a, b| {
        (b.verdict == SegmentVerdict::Reclaimable)
            .cmp(&(a.verdict == SegmentVerdict::Reclaimable))
            .then(b.bytes.cmp(&a.bytes))
            .then(a.name.cmp(&b.name))
    });
    let orphan_shm_bytes = shm_dirs.iter().map(|d| d.orphan_bytes).sum();
    Some(HostReport {
        mem_total_bytes: facts.mem_total_bytes,
        mem_available_bytes: facts.mem_available_bytes,
        pressure: facts.pressure,
        shm_dirs,
        segments,
        orphan_shm_bytes,
        dead_jobs: dead_jobs(snap, report),
    })
}

fn judge(
    snap: &Snapshot,
    dir: &ShmDirFacts,
    s: &ShmSegmentFacts,
    policy: &ShmPolicy,
    holders_of: &BTreeMap<u32, BTreeSet<u32>>,
    leaving: &BTreeSet<u32>,
) -> SegmentReport {
    let last_change = s.modified_ms.max(s.changed_ms);
    let age_secs = snap.taken_at_ms.saturating_sub(last_change) / 1000;
    let producer = policy.producer(&s.name);
    let owners: Vec<u32> = holders_of
        .get(&s.uid)
        .map(|p| p.iter().copied().collect())
        .unwrap_or_default();
    let staying: Vec<u32> = owners
        .iter()
        .copied()
        .filter(|p| !leaving.contains(p))
        .collect();
    let users_staying: Vec<u32> = s
        .users
        .iter()
        .copied()
        .filter(|p| !leaving.contains(p))
        .collect();
    let mut after_targets = Vec::new();
    let verdict = if !s.exact_name || s.name.contains('/') || s.name.is_empty() {
        SegmentVerdict::OddName
    } else if producer.is_none() {
        SegmentVerdict::UnknownProducer
    } else if !dir.users_checked {
        SegmentVerdict::UsersUnknown {
            unchecked: dir.unchecked_pids.clone(),
        }
    } else if !users_staying.is_empty() {
        SegmentVerdict::InUse {
            pids: users_staying,
        }
    } else if policy.owner_rule == OwnerRule::NoLiveHolder && !staying.is_empty() {
        SegmentVerdict::OwnerActive { pids: staying }
    } else if age_secs < policy.min_age_secs || last_change > snap.taken_at_ms {
        SegmentVerdict::TooYoung { age_secs }
    } else {
        // Users and owner's holders about to be reclaimed: it goes after them.
        after_targets = s.users.clone();
        if policy.owner_rule == OwnerRule::NoLiveHolder {
            after_targets.extend(owners);
        }
        after_targets.sort_unstable();
        after_targets.dedup();
        SegmentVerdict::Reclaimable
    };
    SegmentReport {
        dir: dir.path.clone(),
        dev: dir.dev,
        name: s.name.clone(),
        inode: s.inode,
        bytes: s.bytes,
        uid: s.uid,
        age_secs,
        producer,
        users: s.users.clone(),
        verdict,
        after_targets,
    }
}

/// Host memory per dead job: every holder whose job leader is gone, grouped by leader.
fn dead_jobs(snap: &Snapshot, report: &Report) -> Vec<JobHostMemory> {
    let mut jobs: BTreeMap<u32, JobHostMemory> = BTreeMap::new();
    let mut counted: BTreeSet<(u32, u32)> = BTreeSet::new();
    for (_, h) in report.holders() {
        let Some(job) = &h.dead_job else { continue };
        let j = jobs.entry(job.leader_pid).or_insert_with(|| JobHostMemory {
            leader_pid: job.leader_pid,
            gpu_bytes: 0,
            rss_bytes: 0,
            pinned_bytes: 0,
            shm_bytes: 0,
            pids: Vec::new(),
        });
        j.gpu_bytes = j.gpu_bytes.saturating_add(h.used_bytes.unwrap_or(0));
        // A process holding several GPUs counts its host memory once.
        if !counted.insert((job.leader_pid, h.pid)) {
            continue;
        }
        // An exited pid brings its GPU memory, not a process.
        let Some(p) = snap.process(h.pid).filter(|_| h.class != Class::Exited) else {
            continue;
        };
        j.pids.push(h.pid);
        j.rss_bytes = j.rss_bytes.saturating_add(p.rss_bytes.unwrap_or(0));
        if let Some(m) = p.host_memory {
            let pinned = m.pinned_bytes.unwrap_or(0).max(m.locked_bytes.unwrap_or(0));
            j.pinned_bytes = j.pinned_bytes.saturating_add(pinned);
            j.shm_bytes = j.shm_bytes.saturating_add(m.shm_bytes.unwrap_or(0));
        }
    }
    jobs.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Policy;

    fn segment(name: &str, uid: u32, users: &[u32], changed_ms: u64) -> ShmSegmentFacts {
        ShmSegmentFacts {
            name: name.into(),
            exact_name: true,
            inode: 7,
            bytes: 1 << 20,
            size: 1 << 20,
            uid,
            modified_ms: changed_ms,
            changed_ms,
            users: users.to_vec(),
        }
    }

    fn judged(seg: ShmSegmentFacts, checked: bool, holders_of: &[(u32, u32)]) -> SegmentVerdict {
        let snap = Snapshot {
            taken_at_ms: 2_000_000,
            ..serde_json::from_str(include_str!("../../../tests/incidents/demo.json")).unwrap()
        };
        let dir = ShmDirFacts {
            path: "/dev/shm".into(),
            users_checked: checked,
            ..Default::default()
        };
        let mut owners: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for (uid, pid) in holders_of {
            owners.entry(*uid).or_default().insert(*pid);
        }
        judge(
            &snap,
            &dir,
            &seg,
            &Policy::default().shm,
            &owners,
            &BTreeSet::new(),
        )
        .verdict
    }

    #[test]
    fn each_rule_keeps_a_segment_for_its_own_reason() {
        let old = 2_000_000 - 601_000;
        assert_eq!(
            judged(segment("torch_1", 1000, &[], old), true, &[]),
            SegmentVerdict::Reclaimable
        );
        assert_eq!(
            judged(segment("torch_1", 1000, &[42], old), true, &[]),
            SegmentVerdict::InUse { pids: vec![42] }
        );
        assert_eq!(
            judged(segment("torch_1", 1000, &[], old), true, &[(1000, 77)]),
            SegmentVerdict::OwnerActive { pids: vec![77] }
        );
        assert_eq!(
            judged(segment("torch_1", 1000, &[], old), true, &[(1001, 77)]),
            SegmentVerdict::Reclaimable,
            "another user's job does not keep it"
        );
        assert_eq!(
            judged(segment("torch_1", 1000, &[], 2_000_000 - 5_000), true, &[]),
            SegmentVerdict::TooYoung { age_secs: 5 }
        );
        assert_eq!(
            judged(segment("PostgreSQL.1", 1000, &[], old), true, &[]),
            SegmentVerdict::UnknownProducer
        );
        assert_eq!(
            judged(segment("torch_1", 1000, &[], old), false, &[]),
            SegmentVerdict::UsersUnknown { unchecked: vec![] }
        );
        let mut odd = segment("torch_\u{fffd}", 1000, &[], old);
        odd.exact_name = false;
        assert_eq!(judged(odd, true, &[]), SegmentVerdict::OddName);
        // A change in the future (a clock step) is not an age.
        assert!(matches!(
            judged(segment("torch_1", 1000, &[], 3_000_000), true, &[]),
            SegmentVerdict::TooYoung { .. }
        ));
    }

    #[test]
    fn the_longest_matching_prefix_names_the_producer() {
        let mut p = ShmPolicy::default();
        assert_eq!(p.producer("nccl-x").as_deref(), Some("NCCL"));
        assert_eq!(p.producer("ncclx"), None);
        p.producers.push("torch_big_".into());
        assert_eq!(p.producer("torch_big_1").as_deref(), Some("torch_big_*"));
        assert_eq!(p.producer("torch_1").as_deref(), Some("PyTorch"));
        assert!("bogus".parse::<OwnerRule>().is_err());
        assert_eq!("ignore".parse::<OwnerRule>(), Ok(OwnerRule::Ignore));
    }
}
