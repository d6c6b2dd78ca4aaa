//! Whether a report made from the driver's listed processes alone is the whole truth.
//!
//! Finding a holder the driver does not list means reading every open file of every process:
//! on a node of 2,000 processes, most of `status`'s time. That search has something to find
//! only when the listed processes leave something unexplained: memory they do not account
//! for, a listed pid that is not a live process here, a holder whose job is gone (its kin may
//! hold the device files too), or shared-memory segments, whose users only a pass over every
//! process tells. When none of that holds, every byte belongs to a listed process of a live
//! job, and an unlisted holder of the device files holds none of it; `status` then answers
//! from the listed processes and says so ([`crate::Report::full_fd_scan`] is false).

use crate::report::{Class, Report};
use crate::snapshot::{DeviceFile, ProcessKind, Snapshot};

/// Why every process's open files must be read before the report can be trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanNeed {
    /// vramguard is not root (or lacks the capabilities to read every process) in the host's
    /// PID namespace: it cannot tell that the listed pids are the whole story.
    PartialView,
    /// A GPU failed, or its process list could not be read.
    GpuUnreadable {
        /// The GPU's index.
        gpu: u32,
    },
    /// Memory on a GPU that the listed live processes do not account for: unaccounted,
    /// ghost or reclaimable bytes, on the GPU or one of its MIG devices, or memory the
    /// driver reports as not available.
    Unexplained {
        /// The GPU's index.
        gpu: u32,
    },
    /// A holder whose class rests on more than its own facts: its job is gone, it is not a
    /// live process here (exited, foreign), it keeps another's context, or it is a zombie.
    Undecided {
        /// The holder.
        pid: u32,
        /// Its class from the listed processes alone.
        class: Class,
    },
    /// A holder not seen holding the GPU's device file (and, for a compute context,
    /// `/dev/nvidia-uvm`): its files were unreadable, or the listed pid may name another
    /// process (one inside a container by its pid there, or one that reused a dead pid).
    Unproven {
        /// The holder.
        pid: u32,
    },
    /// Holders run in Kubernetes pods, which are named only when every holder of a GPU is
    /// known to be of one pod.
    PodNames,
    /// Shared-memory segments exist: who maps or holds them takes a pass over every process.
    SharedMemory {
        /// How many.
        segments: usize,
    },
}

impl std::fmt::Display for ScanNeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ScanNeed::PartialView => {
                f.write_str("not root in the host's PID namespace: the listed pids may not be all")
            }
            ScanNeed::GpuUnreadable { gpu } => write!(f, "GPU {gpu} could not be read"),
            ScanNeed::Unexplained { gpu } => {
                write!(
                    f,
                    "GPU {gpu} has memory its listed live processes do not explain"
                )
            }
            ScanNeed::Undecided { pid, class } => {
                write!(
                    f,
                    "holder {pid} is {class}: its class rests on every process"
                )
            }
            ScanNeed::Unproven { pid } => {
                write!(f, "holder {pid} was not seen holding the GPU's device file")
            }
            ScanNeed::PodNames => f.write_str("holders run in Kubernetes pods, named by GPU"),
            ScanNeed::SharedMemory { segments } => {
                write!(f, "{segments} shared-memory segment(s) to attribute")
            }
        }
    }
}

/// The first reason a report made from `snapshot` (not a full scan) may not be the whole
/// truth, or `None` when every byte belongs to a listed, live process of a live job and no
/// shared-memory segment waits to be attributed.
pub fn full_scan_needed(snapshot: &Snapshot, report: &Report) -> Option<ScanNeed> {
    if snapshot.scan.full_fd_scan {
        return None;
    }
    if snapshot.host.pid_namespace_is_host != Some(true)
        || !snapshot.host.privileges().sees_every_process()
    {
        return Some(ScanNeed::PartialView);
    }
    for gpu in &report.gpus {
        if gpu.is_unreadable() {
            return Some(ScanNeed::GpuUnreadable { gpu: gpu.index });
        }
        let minor = gpu.minor_number.unwrap_or(gpu.index);
        for h in &gpu.holders {
            // A holder the driver does not list (a worker forked with the device files, a
            // monitor) is settled too while its job lives and the GPU's bytes are explained:
            // it holds none of them, and neither does any other such holder a scan would find.
            let settled = matches!(
                h.class,
                Class::Active | Class::Idle | Class::System | Class::Hidden
            ) && h.dead_job.is_none()
                && h.keeps_alive.is_none()
                && h.keepers.is_empty()
                && !h.kept_by_unseen;
            if !settled {
                return Some(ScanNeed::Undecided {
                    pid: h.pid,
                    class: h.class,
                });
            }
            // Seen holding this GPU's device file: a listed pid that is some other process
            // here (a pid the driver reports from inside a container, which a full scan maps
            // through `NSpid`) or whose files could not be read is not proven the holder.
            // A compute context needs /dev/nvidia-uvm too: a listed pid holding only the GPU's
            // file and nvidiactl is an NVML client (`nvidia-smi` on a reused pid, say), not
            // the process whose context the driver lists, which may be dead and kept by others.
            // On driver 580 an NVML client holds uvm too: one mapping NVML and not the CUDA
            // driver library is not the holder either.
            let needs_uvm = h.listed && h.kinds.contains(&ProcessKind::Compute);
            let holds_the_gpu = h.device_files.as_ref().is_some_and(|files| {
                files.contains(&DeviceFile::Gpu(minor))
                    && (!needs_uvm || h.may_hold_context() == Some(true))
            });
            if !holds_the_gpu {
                return Some(ScanNeed::Unproven { pid: h.pid });
            }
        }
        let mig_unexplained = gpu
            .mig_devices
            .iter()
            .any(|m| m.unaccounted_bytes > 0 || m.ghost_bytes > 0);
        // Memory the driver reports as not available: nothing says it is all explained.
        if gpu.memory.is_none()
            || gpu.unaccounted.as_ref().is_some_and(|u| u.significant)
            || gpu.ghost_bytes > 0
            || gpu.reclaimable_bytes > 0
            || gpu.unexplained_bytes() > 0
            || mig_unexplained
        {
            return Some(ScanNeed::Unexplained { gpu: gpu.index });
        }
    }
    // Pod names come from the kubelet's GPU allocations, trusted only when every holder of
    // the GPU is of one pod: an unlisted holder of another pod (the GPU's new pod, its
    // process starting) is what a full scan would add.
    if snapshot.kubelet_pods.is_some()
        && report
            .gpus
            .iter()
            .flat_map(|g| &g.holders)
            .any(|h| h.pod_uid.is_some())
    {
        return Some(ScanNeed::PodNames);
    }
    let segments: usize = snapshot
        .host_memory
        .iter()
        .flat_map(|m| &m.shm)
        .map(|d| d.segments.len())
        .sum();
    if segments > 0 {
        return Some(ScanNeed::SharedMemory { segments });
    }
    None
}
