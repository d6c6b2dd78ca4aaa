//! The knobs of classification. Defaults suit a shared training/inference node; the config file
//! (`[policy]` in `/etc/vramguard/config.toml`) overrides them.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Processes that hold the GPU on purpose and must never be killed: the persistence daemon,
/// the fabric manager, DCGM, display servers, the MPS server, monitoring tools. They are
/// reported as reset blockers instead. Matched against `comm` (15 bytes, so prefixes), and
/// only believed when the identity matches too (see [`Policy::system_identity`]): any user can
/// name a process `nvidia-persiste`.
pub const DEFAULT_SYSTEM_COMMS: &[&str] = &[
    "nvidia-persiste", // nvidia-persistenced, truncated by the kernel to 15 bytes
    "nv-fabricmanage",
    "nv-hostengine",
    "dcgm-exporter",
    "dcgmi",
    "Xorg",
    "Xwayland",
    "X",
    "gnome-shell",
    "nvidia-cuda-mps",
    "nvidia-smi",
    "nvtop",
    "nvitop",
    "gpustat",
];

/// The default of [`Policy::gpu_work_min_percent`]: a per-process utilization sample is GPU
/// work only at or above 2 %. A real H200 (driver 580.159.04) reports `smUtil = 1` for contexts
/// that do nothing (workers that only filled their memory at start, a dead creator's context
/// kept by its forked children); a matmul loop reads 37-95 %. The GPU reader records a
/// sample's `last_busy_ms` at this threshold.
pub const DEFAULT_GPU_WORK_MIN_PERCENT: u32 = 2;

/// Parents that adopt orphans on purpose (init systems, container inits and shims, `vramguard
/// run`). A process whose parent is one of these was (most likely) re-parented to it, so the
/// parent's life alone does not keep its job alive: the job model stops its walk up the tree
/// there and asks the process group instead.
///
/// This is deliberate for the adopters that outlive the jobs they adopt from: `systemd` (pid
/// 1, and `systemd --user`, a subreaper for a whole login), `init`, `containerd-shim` (one
/// shim may serve a pod's containers) and `conmon`. Were they job keepers, every orphan of
/// every finished job on the node (or in the user's login) would be kept forever. The
/// supervisors among them that run exactly one job and end with it — a `vramguard run`
/// supervisor, tini, dumb-init, docker-init — are job keepers while they live: see
/// [`crate::job::job_supervisor`].
pub const DEFAULT_SUBREAPER_COMMS: &[&str] = &[
    "systemd",
    "init",
    "tini",
    "dumb-init",
    "docker-init",
    "containerd-shim",
    "conmon",
    "vramguard",
];

/// Classification policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Policy {
    /// Unaccounted memory at or below this is noise (driver bookkeeping). The effective
    /// tolerance per GPU is `max(this, tolerance_ratio × total)`. Default 256 MiB.
    pub tolerance_bytes: u64,
    /// Ratio of total memory tolerated as unaccounted. Default 0.005 (0.5%).
    pub tolerance_ratio: f64,
    /// A live holder with no GPU utilization for this long is `idle`. Default 10 minutes.
    pub idle_after_secs: u64,
    /// Memory an empty GPU shows as used, per GPU index or UUID (`"0"`, `"GPU-…"`); default 0.
    pub baseline_bytes: BTreeMap<String, u64>,
    /// Command names (`comm`) of processes never to be killed (see [`DEFAULT_SYSTEM_COMMS`]).
    pub system_comms: Vec<String>,
    /// Command names of parents that adopt orphans (see [`DEFAULT_SUBREAPER_COMMS`]).
    pub subreaper_comms: Vec<String>,
    /// A process (or job) that used at least this much CPU over the sampling window, in
    /// percent of one core (user + system time of every thread), is working. Default 5: a
    /// blocked worker's housekeeping threads stay far below it, a data-loading or compiling
    /// job far above.
    pub work_cpu_percent: f64,
    /// A per-process GPU utilization sample that counts as work (see `gpu_work_min_percent`)
    /// this recent (seconds before the snapshot) is evidence of work. Default 10: the driver's sampling period is a few seconds at most.
    pub gpu_busy_recent_secs: u64,
    /// A per-process GPU utilization sample counts as work only when its SM or memory
    /// percentage is at least this. Default [`DEFAULT_GPU_WORK_MIN_PERCENT`] (2): the driver
    /// reports 1 % for an idle context, which is no evidence of work.
    pub gpu_work_min_percent: u32,
    /// A CPU observation shorter than this (milliseconds) cannot show a process idle.
    /// Default 200.
    pub work_min_window_ms: u64,
    /// The highest uid a system service may run as (system accounts are below 1000 on every
    /// common distribution). Default 999.
    pub system_max_uid: u32,
    /// Which shared-memory segments are orphaned (`[shm]` in the config file).
    pub shm: crate::host::ShmPolicy,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            tolerance_bytes: 256 << 20,
            tolerance_ratio: 0.005,
            idle_after_secs: 600,
            baseline_bytes: BTreeMap::new(),
            system_comms: DEFAULT_SYSTEM_COMMS.iter().map(|s| s.to_string()).collect(),
            subreaper_comms: DEFAULT_SUBREAPER_COMMS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            work_cpu_percent: 5.0,
            gpu_busy_recent_secs: 10,
            gpu_work_min_percent: DEFAULT_GPU_WORK_MIN_PERCENT,
            work_min_window_ms: 200,
            system_max_uid: 999,
            shm: crate::host::ShmPolicy::default(),
        }
    }
}

impl Policy {
    /// Whether a per-process utilization sample's peak shows GPU work (see
    /// [`Policy::gpu_work_min_percent`]).
    pub fn is_gpu_work(&self, sample: &crate::snapshot::UtilizationSample) -> bool {
        sample.sm_percent.max(sample.mem_percent) >= self.gpu_work_min_percent.max(1)
    }

    /// The unaccounted-memory tolerance for a GPU of `total` bytes.
    pub fn tolerance_for(&self, total: u64) -> u64 {
        let ratio = (total as f64 * self.tolerance_ratio.clamp(0.0, 1.0)) as u64;
        self.tolerance_bytes.max(ratio)
    }

    /// The baseline of a GPU, looked up by UUID first, then by index.
    pub fn baseline_for(&self, index: u32, uuid: Option<&str>) -> u64 {
        uuid.and_then(|u| self.baseline_bytes.get(u))
            .or_else(|| self.baseline_bytes.get(&index.to_string()))
            .copied()
            .unwrap_or(0)
    }

    /// Whether a command name belongs to a system process.
    pub fn is_system_comm(&self, comm: &str) -> bool {
        self.system_comms.iter().any(|s| s == comm)
    }

    /// Whether `p` is a system service by identity, not only by name: its `comm` is listed,
    /// it runs as root or a system account (uid ≤ [`Policy::system_max_uid`]), and its
    /// executable is a root-owned file that only root may write whose name is the command's
    /// (`/usr/bin/nvidia-persistenced` for `nvidia-persiste`). Returns `Err` with the reason
    /// when the name matches but the identity does not.
    ///
    /// Where the executable is unreadable (`exe_readable == false`: vramguard is not root),
    /// the name and uid are all there is; such a run may not signal the process anyway.
    pub fn system_identity(
        &self,
        p: &crate::snapshot::ProcessFacts,
        exe_readable: bool,
    ) -> Option<Result<(), String>> {
        let comm = p.comm.as_deref()?;
        if !self.is_system_comm(comm) {
            return None;
        }
        let uid_ok = p.uid.is_some_and(|u| u <= self.system_max_uid);
        if !uid_ok {
            return Some(Err(format!(
                "named like the system service {comm:?}, but runs as uid {}, not a system \
                 account",
                p.uid.map_or("unknown".into(), |u| u.to_string())
            )));
        }
        let Some(exe) = &p.exe else {
            return Some(if exe_readable {
                Err(format!(
                    "named like the system service {comm:?}, but its executable is unreadable"
                ))
            } else {
                Ok(())
            });
        };
        let file = exe.path.rsplit('/').next().unwrap_or("");
        let name_ok = !file.is_empty() && (file.starts_with(comm) || comm.starts_with(file));
        let owner_ok = exe.owner_uid == 0 && exe.mode & 0o022 == 0;
        if !name_ok || !owner_ok {
            return Some(Err(format!(
                "named like the system service {comm:?}, but its executable is {} ({}): an \
                 ordinary process",
                crate::sanitize::shown(&exe.path),
                if !name_ok {
                    "another program"
                } else {
                    "not a root-owned file only root may write"
                }
            )));
        }
        Some(Ok(()))
    }

    /// Whether a command name is a known orphan-adopting parent.
    pub fn is_subreaper_comm(&self, comm: &str) -> bool {
        self.subreaper_name(comm).is_some()
    }

    /// The orphan-adopting parent a command name names (`containerd-shim` for
    /// `containerd-shim`, `tini` for `tini-static`), if any.
    pub fn subreaper_name(&self, comm: &str) -> Option<&str> {
        self.subreaper_comms
            .iter()
            .find(|s| {
                comm.strip_prefix(s.as_str())
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
            })
            .map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tolerance_is_the_larger_of_floor_and_ratio() {
        let p = Policy::default();
        assert_eq!(p.tolerance_for(16 << 30), 256 << 20);
        let h200 = 150_754_820_096u64;
        assert_eq!(p.tolerance_for(h200), (h200 as f64 * 0.005) as u64);
    }

    #[test]
    fn baseline_by_uuid_then_index() {
        let mut p = Policy::default();
        p.baseline_bytes.insert("1".into(), 10);
        p.baseline_bytes.insert("GPU-x".into(), 20);
        assert_eq!(p.baseline_for(1, Some("GPU-x")), 20);
        assert_eq!(p.baseline_for(1, Some("GPU-y")), 10);
        assert_eq!(p.baseline_for(0, None), 0);
    }

    #[test]
    fn persistenced_truncated_comm_is_system() {
        assert!(Policy::default().is_system_comm("nvidia-persiste"));
        assert!(!Policy::default().is_system_comm("python"));
    }
}
