//! Contexts of stand-in CUDA clients that are not `vramguard sim hold`: a program that opens
//! a GPU's stand-in device file itself and asks `vramguard sim attach` to create its context
//! there (the gpu-check rehearsal's stand-in PyTorch). The context belongs to the **caller of
//! `sim attach`** (its parent), lives on the caller's open file description of the device file
//! like every simulated context ([`crate::context`]), and so outlives the caller in children
//! it forked, exactly as a `sim hold` context does.

use crate::model::Sim;
use crate::state::{AllocationKind, HolderNamespace, SimAllocation};
use crate::{SimState, store};
use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use vramguard_proc::{ProcDir, ProcFs};

/// Why a context could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The state, its GPUs or the simulator's runtime could not be used.
    #[error(transparent)]
    Sim(#[from] crate::SimError),
    /// The descriptor is not the caller's open GPU device file.
    #[error("fd {fd}: {why} (pass an open descriptor of {expected})")]
    NotTheDeviceFile {
        /// The descriptor given.
        fd: RawFd,
        /// What is wrong with it.
        why: String,
        /// The stand-in device file it must be.
        expected: String,
    },
    /// The caller could not be identified through the state's `proc_root`.
    #[error(
        "the caller (the parent of this process) cannot be read in {proc_root}: {why} (run \
         `sim attach` as a child of the process that holds the GPU file, with that \
         descriptor inherited)"
    )]
    Caller {
        /// The state's proc root.
        proc_root: String,
        /// What failed.
        why: String,
    },
    /// The context's lock could not be taken.
    #[error("creating the context on GPU {gpu}: {source}")]
    Lock {
        /// The GPU.
        gpu: u32,
        /// The fcntl error.
        source: std::io::Error,
    },
    /// The stand-in CUDA driver library the caller maps could not be written.
    #[error("writing the stand-in CUDA driver library under {dev_dir}/.driver: {source}")]
    Library {
        /// The state's device directory.
        dev_dir: String,
        /// Why.
        source: std::io::Error,
    },
    /// More than the GPU has free, as cudaMalloc would refuse it.
    #[error(
        "out of memory on GPU {gpu}: {asked} bytes asked, {free} free (the simulated \
         cudaErrorMemoryAllocation)"
    )]
    OutOfMemory {
        /// The GPU.
        gpu: u32,
        /// Bytes asked for.
        asked: u64,
        /// Bytes free.
        free: u64,
    },
}

/// What [`attach`] registered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attached {
    /// The holder: the caller, as `proc_root` numbers it.
    pub pid: u32,
    /// Its context's bytes on the GPU after this call.
    pub bytes: u64,
}

/// Adds `bytes` to the context of the calling process (this process's parent) on GPU `gpu`,
/// creating it on the caller's descriptor `fd` of that GPU's stand-in device file when it is
/// the first; `sm_util`, when given, becomes the context's SM utilization (a kernel loop
/// reads it as work; 0 to 100). `fd` must be inherited from the caller (the same open file
/// description), so that the context lives with the caller's descriptor and not with this
/// short-lived process.
pub fn attach(
    state_path: &Path,
    gpu: u32,
    bytes: u64,
    sm_util: Option<u32>,
    fd: RawFd,
) -> Result<Attached, AttachError> {
    let state = SimState::load(state_path).map_err(crate::SimError::from)?;
    let count = state.gpus.len();
    if gpu as usize >= count {
        return Err(crate::SimError::NoSuchGpu { gpu, count }.into());
    }
    let device = state.dev_dir.join(format!("nvidia{gpu}"));
    let not_device = |why: String| AttachError::NotTheDeviceFile {
        fd,
        why,
        expected: device.display().to_string(),
    };
    if fd < 0 {
        return Err(not_device("not a descriptor".into()));
    }
    // SAFETY: `fd` is not negative (std's File refuses -1), and the File is never dropped
    // (ManuallyDrop), so the caller's descriptor stays open and owned by no one here; it is
    // only fstat-ed and locked, and both fail cleanly on a descriptor that is not open.
    let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    let got = file
        .metadata()
        .map_err(|e| not_device(format!("not an open file ({e})")))?;
    let want = std::fs::metadata(&device).map_err(|e| not_device(e.to_string()))?;
    if (got.dev(), got.ino()) != (want.dev(), want.ino()) {
        return Err(not_device("another file".into()));
    }
    let caller_error = |why: &str| AttachError::Caller {
        proc_root: state.proc_root.display().to_string(),
        why: why.into(),
    };
    let proc = ProcFs::open(&state.proc_root).map_err(|e| caller_error(&e.to_string()))?;
    let own = proc
        .stat_of(ProcDir::Reader)
        .ok()
        .and_then(|s| s.ok())
        .ok_or_else(|| caller_error("own stat unreadable"))?;
    let pid = own
        .ppid
        .filter(|p| *p > 0)
        .ok_or_else(|| caller_error("no parent in this PID namespace"))?;
    let start_ticks = proc
        .stat_of(ProcDir::Pid(pid))
        .ok()
        .and_then(|s| s.ok())
        .and_then(|s| s.start_ticks)
        .ok_or_else(|| caller_error("its stat is unreadable"))?;
    // The caller must hold this very file: its own descriptor FD is the same file (a parent
    // that died meanwhile, and a re-parented command asking for pid 1, are refused).
    let callers = proc
        .fd_file_id(pid, fd)
        .ok_or_else(|| caller_error(&format!("pid {pid} has no descriptor {fd} to look at")))?;
    if callers != (got.dev(), got.ino()) {
        return Err(caller_error(&format!(
            "pid {pid}'s descriptor {fd} is another file than the one passed"
        )));
    }
    let lock = crate::context::lock_offset(pid, start_ticks);
    let namespace = proc
        .namespace_pids(ProcDir::Pid(pid))
        .zip(proc.pid_namespace(ProcDir::Pid(pid)))
        .map(|(nspid, ns)| HolderNamespace {
            nspid,
            pid_ns: ns.ino,
        });

    // The free memory is read before the state's lock is taken (observing may update the
    // runtime file under that lock): two clients racing for the last bytes could both get
    // them, which no caller of this stand-in does.
    let free = Sim::open(state_path)?
        .observe()?
        .gpus
        .get(gpu as usize)
        .map(|g| g.free)
        .unwrap_or(0);
    if bytes > free {
        return Err(AttachError::OutOfMemory {
            gpu,
            asked: bytes,
            free,
        });
    }
    // Only now the context exists: a refused first allocation leaves no lock behind.
    crate::context::take(&file, lock).map_err(|source| AttachError::Lock { gpu, source })?;
    // A real context comes with the CUDA driver library mapped in its creator: the caller
    // maps the stand-in, which this makes sure exists.
    crate::library::ensure(&state.dev_dir, crate::library::Library::Cuda).map_err(|source| {
        AttachError::Library {
            dev_dir: state.dev_dir.display().to_string(),
            source,
        }
    })?;
    let mut total = bytes;
    store::update_state(state_path, |s| {
        let Some(after_exit) = s.gpus.get(gpu as usize).map(|g| g.after_exit) else {
            return; // the GPU left the state meanwhile: nothing to add it to
        };
        match s
            .allocations
            .iter_mut()
            .find(|a| a.gpu == gpu && a.pid == pid && a.context_lock == Some(lock))
        {
            Some(a) => {
                a.bytes = a.bytes.saturating_add(bytes);
                if let Some(u) = sm_util {
                    a.sm_util = u;
                }
                total = a.bytes;
            }
            None => s.allocations.push(SimAllocation {
                gpu,
                pid,
                bytes,
                kind: AllocationKind::default(),
                after_exit,
                listed: true,
                reported_pid: None,
                sm_util: sm_util.unwrap_or(0),
                mem_util: 0,
                held_by: vec![],
                mig_device: None,
                context_lock: Some(lock),
                namespace,
            }),
        }
    })?;
    Ok(Attached { pid, bytes: total })
}
