//! Signalling exactly the process that was planned, never a reused pid.
//!
//! A pid read some time ago may belong to another process by now. So, right after planning:
//! open a pidfd (which pins whatever process has the pid at that instant), *then* re-read that
//! pid's start time; if it is still the planned one, the pidfd refers to the planned process.
//! From then on every signal goes through the pidfd: if the process exits, the pidfd reports
//! ESRCH, and a newcomer with the same pid is out of its reach.
//!
//! The start time only has clock-tick resolution (10 ms), so it guards the milliseconds
//! between reading `/proc` and opening the pidfd, when a pid cannot wrap around; the pidfd
//! guards everything after, however long a confirmation prompt waits. Pin early.

use rustix::fd::{AsFd, OwnedFd};
use rustix::io::Errno;
use rustix::process::{Pid, PidfdFlags, Signal};
use std::path::Path;
use std::time::{Duration, Instant};

/// A process as the plan saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Identity {
    /// Pid.
    pub pid: u32,
    /// Start time, clock ticks after boot (`/proc/PID/stat` field 22).
    pub start_ticks: u64,
}

/// Why a process was not (or could not be) signalled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// It no longer exists.
    #[error("already gone")]
    Gone,
    /// The pid now belongs to another process.
    #[error("the pid was reused (start time {planned} at plan time, {now:?} now): not signalled")]
    Reused {
        /// Start time at plan time.
        planned: u64,
        /// Start time now, if readable.
        now: Option<u64>,
    },
    /// The kernel refused (another user's process, and we are not root).
    #[error("permission denied: it belongs to another user; run as root")]
    NoPermission,
    /// Anything else.
    #[error("{0}")]
    Failed(String),
}

/// Reads a pid's start time from `proc_root/PID/stat`.
pub fn start_ticks(proc_root: &Path, pid: u32) -> Option<u64> {
    vramguard_proc::ProcFs::open(proc_root)
        .ok()?
        .stat(pid)
        .ok()?
        .ok()?
        .start_ticks
}

/// A pidfd to a process whose identity was checked after the pidfd was opened.
#[derive(Debug)]
pub struct Verified {
    /// The identity checked.
    pub identity: Identity,
    pidfd: OwnedFd,
}

/// Opens and checks the process `id`.
pub fn verify(proc_root: &Path, id: Identity) -> Result<Verified, Refusal> {
    let pid = i32::try_from(id.pid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or(Refusal::Gone)?;
    let pidfd = match rustix::process::pidfd_open(pid, PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(Errno::SRCH) => return Err(Refusal::Gone),
        Err(e) => return Err(Refusal::Failed(format!("pidfd_open({}): {e}", id.pid))),
    };
    match start_ticks(proc_root, id.pid) {
        Some(now) if now == id.start_ticks => Ok(Verified {
            identity: id,
            pidfd,
        }),
        None => Err(Refusal::Gone),
        now => Err(Refusal::Reused {
            planned: id.start_ticks,
            now,
        }),
    }
}

impl AsFd for Verified {
    fn as_fd(&self) -> rustix::fd::BorrowedFd<'_> {
        self.pidfd.as_fd()
    }
}

impl Verified {
    /// Sends `sig` through the pidfd.
    pub fn signal(&self, sig: Signal) -> Result<(), Refusal> {
        match rustix::process::pidfd_send_signal(&self.pidfd, sig) {
            Ok(()) => Ok(()),
            Err(Errno::SRCH) => Err(Refusal::Gone),
            Err(Errno::PERM) => Err(Refusal::NoPermission),
            Err(e) => Err(Refusal::Failed(format!(
                "pidfd_send_signal({}): {e}",
                self.identity.pid
            ))),
        }
    }

    /// Whether the process has exited (its pidfd is readable).
    pub fn has_exited(&self) -> bool {
        wait_any(&[self], Duration::ZERO)
            .first()
            .copied()
            .unwrap_or(false)
    }
}

/// A planned process, pinned right after planning (or why it could not be).
#[derive(Debug)]
pub struct Pinned {
    /// The identity from the plan.
    pub identity: Identity,
    /// The pidfd, or why there is none.
    pub handle: Result<Verified, Refusal>,
}

/// Pins every identity: call it as soon as the plan exists.
pub fn pin(proc_root: &Path, ids: impl IntoIterator<Item = Identity>) -> Vec<Pinned> {
    ids.into_iter()
        .map(|identity| Pinned {
            identity,
            handle: verify(proc_root, identity),
        })
        .collect()
}

/// Waits up to `timeout` until at least one of `procs` exits; returns which have exited.
pub fn wait_any(procs: &[&Verified], timeout: Duration) -> Vec<bool> {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut fds: Vec<PollFd<'_>> = procs
        .iter()
        .map(|p| PollFd::new(&p.pidfd, PollFlags::IN))
        .collect();
    let ts = rustix::time::Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: timeout.subsec_nanos() as i64,
    };
    // EINTR: report nothing new; the caller loops.
    let _ = poll(&mut fds, Some(&ts));
    fds.iter()
        .map(|f| {
            f.revents()
                .intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR)
        })
        .collect()
}

/// Waits until every process in `procs` has exited or `deadline` passes. Returns, per
/// process, when it was seen exited (`None`: still alive at the deadline).
pub fn wait_all(procs: &[&Verified], deadline: Instant) -> Vec<Option<Instant>> {
    let mut exited: Vec<Option<Instant>> = vec![None; procs.len()];
    loop {
        let alive: Vec<usize> = (0..procs.len()).filter(|i| exited[*i].is_none()).collect();
        if alive.is_empty() {
            return exited;
        }
        let now = Instant::now();
        if now >= deadline {
            return exited;
        }
        let subset: Vec<&Verified> = alive.iter().map(|i| procs[*i]).collect();
        let ready = wait_any(&subset, (deadline - now).min(Duration::from_millis(50)));
        let seen = Instant::now();
        for (k, r) in ready.into_iter().enumerate() {
            if r {
                exited[alive[k]] = Some(seen);
            }
        }
    }
}
