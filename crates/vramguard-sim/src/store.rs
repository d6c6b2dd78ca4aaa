//! Changing the state file safely while other processes read it: every writer holds
//! `<state>.lock` (flock) for its read-modify-write and replaces the file by rename, so a
//! reader never sees half a document.

use crate::model::SimError;
use crate::state::{SimAllocation, SimState, StateError};
use rustix::fs::{FlockOperation, Mode, OFlags};
use std::path::{Path, PathBuf};

/// Holds the state's lock until dropped.
pub struct StateLock(#[allow(dead_code)] rustix::fd::OwnedFd);

fn lock_path(state: &Path) -> PathBuf {
    let mut p = state.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

/// Takes the exclusive lock of the state at `state` (blocking).
pub fn lock(state: &Path) -> Result<StateLock, SimError> {
    let path = lock_path(state);
    let err = |e: rustix::io::Errno| SimError::Runtime {
        path: path.clone(),
        reason: std::io::Error::from(e).to_string(),
    };
    // flock works on a read-only fd too: a user who may not create the lock file can still
    // take it once it exists.
    let fd = rustix::fs::open(
        &path,
        OFlags::RDWR | OFlags::CREATE | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o644),
    )
    .or_else(|e| match e {
        rustix::io::Errno::ACCESS => {
            rustix::fs::open(&path, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
        }
        other => Err(other),
    })
    .map_err(err)?;
    rustix::fs::flock(&fd, FlockOperation::LockExclusive).map_err(err)?;
    Ok(StateLock(fd))
}

/// Writes `bytes` to a temporary file beside `path`, then renames it over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Writes a whole state (validated first).
pub fn write_state(path: &Path, state: &SimState) -> Result<(), SimError> {
    state.validate(path)?;
    let text = serde_json::to_string_pretty(state).expect("state serialises");
    let _lock = lock(path)?;
    write_atomic(path, text.as_bytes()).map_err(|source| {
        SimError::State(StateError::Write {
            path: path.to_path_buf(),
            cause: source,
        })
    })
}

/// Applies `change` to the state file under its lock, validating the result.
pub fn update_state(path: &Path, change: impl FnOnce(&mut SimState)) -> Result<SimState, SimError> {
    let _lock = lock(path)?;
    let mut state = SimState::load(path)?;
    change(&mut state);
    state.validate(path)?;
    let text = serde_json::to_string_pretty(&state).expect("state serialises");
    write_atomic(path, text.as_bytes()).map_err(|source| {
        SimError::State(StateError::Write {
            path: path.to_path_buf(),
            cause: source,
        })
    })?;
    Ok(state)
}

/// Registers an allocation (a simulated `cuMemAlloc` by a real process).
pub fn add_allocation(path: &Path, allocation: SimAllocation) -> Result<(), SimError> {
    update_state(path, |s| s.allocations.push(allocation)).map(|_| ())
}

/// Creates the stand-in device files for `gpus` GPUs in `dev_dir`.
pub fn create_dev_dir(dev_dir: &Path, gpus: usize) -> std::io::Result<()> {
    std::fs::create_dir_all(dev_dir)?;
    let mut names: Vec<String> = (0..gpus).map(|i| format!("nvidia{i}")).collect();
    names.push("nvidiactl".into());
    names.push("nvidia-uvm".into());
    for name in names {
        let p = dev_dir.join(name);
        if !p.exists() {
            std::fs::write(&p, b"")?;
        }
    }
    Ok(())
}
