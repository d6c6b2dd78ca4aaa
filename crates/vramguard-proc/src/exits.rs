//! Which of many watched processes exited, asked of one epoll set of their pidfds.
//!
//! The agent watches hundreds of holders. Polling each pidfd at every wake-up and every
//! collection cost a tenth of its CPU per sample; an epoll set is one descriptor to wait on
//! and answers with the ready ones only. Entries are level-triggered: a pidfd stays ready
//! until it is removed (or closed), so an exit is reported until its watcher takes it.

use rustix::event::epoll;
use rustix::fd::{AsFd, OwnedFd};

/// Most exits one [`ExitSet::ready`] call returns; the rest stay ready for the next call.
pub const MAX_READY: usize = 1024;

/// An epoll set of pidfds, each tagged with its pid.
#[derive(Debug)]
pub struct ExitSet {
    epoll: OwnedFd,
}

impl ExitSet {
    /// A new, empty set; `None` where the kernel gives none (the caller polls each pidfd).
    pub fn new() -> Option<ExitSet> {
        epoll::create(epoll::CreateFlags::CLOEXEC)
            .ok()
            .map(|epoll| ExitSet { epoll })
    }

    /// Watches `pidfd`, reported as `pid` once its process exits. An error (a limit, out of
    /// memory) means the set no longer covers every watched process: the caller then polls
    /// each pidfd itself.
    pub fn add(&self, pidfd: impl AsFd, pid: u32) -> rustix::io::Result<()> {
        epoll::add(
            &self.epoll,
            pidfd,
            epoll::EventData::new_u64(u64::from(pid)),
            epoll::EventFlags::IN,
        )
    }

    /// Stops watching `pidfd` (closing it does too, when it is its file's only descriptor).
    pub fn remove(&self, pidfd: impl AsFd) {
        let _ = epoll::delete(&self.epoll, pidfd);
    }

    /// The pids whose pidfd is ready now, at most [`MAX_READY`] and at most `expected` (at
    /// least one), without waiting, each once, sorted (a pid watched by two pidfds, a reused
    /// pid beside the process that left it, is named once: the caller checks each pidfd).
    pub fn ready(&self, expected: usize) -> rustix::io::Result<Vec<u32>> {
        let want = expected.clamp(1, MAX_READY);
        let now = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // On the stack, a batch at a time: a heap buffer sized for every watched process,
        // allocated at every wake-up, went through glibc's slow path (over 1 KiB) and was a
        // tenth of the agent's CPU per sample. Usually nothing is ready.
        let mut pids = Vec::new();
        loop {
            let mut batch = [std::mem::MaybeUninit::<epoll::Event>::uninit(); BATCH];
            let room = (want - pids.len()).min(BATCH);
            let (got, _) = epoll::wait(&self.epoll, &mut batch[..room], Some(&now))?;
            // Only pids were ever stored.
            pids.extend(got.iter().map(|e| e.data.u64() as u32));
            if got.len() < room || pids.len() >= want {
                // Level-triggered: a later batch may name again one that an earlier batch
                // named (it stays ready), so each pid is said once.
                pids.sort_unstable();
                pids.dedup();
                return Ok(pids);
            }
        }
    }
}

/// Events asked of the kernel per `epoll_wait` in [`ExitSet::ready`].
const BATCH: usize = 64;

impl AsFd for ExitSet {
    /// Readable while any watched process has exited: what a wait polls.
    fn as_fd(&self) -> rustix::fd::BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::process::{Pid, PidfdFlags, pidfd_open};
    use std::process::Command;

    #[test]
    fn an_exit_is_ready_under_its_pid_until_removed_and_a_live_process_never_is() {
        let set = ExitSet::new().expect("epoll");
        assert_eq!(set.ready(0).unwrap(), Vec::<u32>::new(), "empty set");
        let mut live = Command::new("sleep").arg("60").spawn().unwrap();
        let mut dying = Command::new("true").spawn().unwrap();
        let fd_of = |c: &std::process::Child| {
            pidfd_open(Pid::from_raw(c.id() as i32).unwrap(), PidfdFlags::empty()).unwrap()
        };
        let (live_fd, dying_fd) = (fd_of(&live), fd_of(&dying));
        set.add(&live_fd, live.id()).unwrap();
        set.add(&dying_fd, dying.id()).unwrap();
        dying.wait().unwrap();
        assert_eq!(set.ready(8).unwrap(), vec![dying.id()]);
        assert_eq!(
            set.ready(8).unwrap(),
            vec![dying.id()],
            "ready until removed"
        );
        set.remove(&dying_fd);
        assert_eq!(set.ready(8).unwrap(), Vec::<u32>::new());
        let _ = live.kill();
        let _ = live.wait();
        assert_eq!(set.ready(8).unwrap(), vec![live.id()]);
    }

    #[test]
    fn more_exits_than_one_batch_are_each_named_once() {
        let set = ExitSet::new().expect("epoll");
        let n = BATCH + 10;
        let mut children: Vec<std::process::Child> = (0..n)
            .map(|_| Command::new("true").spawn().unwrap())
            .collect();
        let fds: Vec<_> = children
            .iter()
            .map(|c| {
                let fd =
                    pidfd_open(Pid::from_raw(c.id() as i32).unwrap(), PidfdFlags::empty()).unwrap();
                set.add(&fd, c.id()).unwrap();
                fd
            })
            .collect();
        for c in &mut children {
            c.wait().unwrap();
        }
        let mut expected: Vec<u32> = children.iter().map(|c| c.id()).collect();
        expected.sort_unstable();
        // Asked for more than are ready: a second batch finds the first one's again.
        assert_eq!(set.ready(n * 2).unwrap(), expected);
        assert_eq!(
            set.ready(5).unwrap().len(),
            5,
            "at most as many as expected"
        );
        drop(fds);
    }
}
