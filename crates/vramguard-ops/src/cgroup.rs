//! A cgroup v2 leaf for one job: everything the job forks stays in it (unless it is moved out
//! by someone allowed to), and `cgroup.kill` SIGKILLs the whole subtree race-free, catching
//! processes forked during the kill (Linux ≥ 5.14).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Why no cgroup could be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cgroup v2: {0}")]
pub struct CgroupError(pub String);

/// The cgroup v2 mount point, from `/proc/self/mountinfo` (`/sys/fs/cgroup` on unified hosts,
/// `/sys/fs/cgroup/unified` on hybrid ones).
pub fn cgroup2_mount() -> Option<PathBuf> {
    vramguard_proc::ProcFs::own().ok()?.cgroup2_mount()
}

/// This process's cgroup v2 path (the `0::` line of `/proc/self/cgroup`).
pub fn own_cgroup() -> Option<String> {
    vramguard_proc::ProcFs::own().ok()?.own_cgroup()
}

/// This process's own cgroup v2 directory, where [`JobCgroup::create`] makes its children.
pub fn own_cgroup_dir() -> Option<PathBuf> {
    Some(cgroup2_mount()?.join(own_cgroup()?.trim_start_matches('/')))
}

/// Removes the empty cgroups named `<prefix><pid>-<n>` next to this process's own children
/// whose creator `<pid>` is no process any more, or is this process: what a killed (SIGKILL,
/// a crash) run of the same program left behind. Call it before this process makes any such
/// cgroup of its own (a run with the same pid, as pid 1 of a container is every time, left
/// the ones named after it). A populated one is left alone (what runs in it is not ours to
/// judge; the kernel refuses to remove it anyway); a live pid only delays the clean-up; a name
/// not of exactly that form is never touched. Returns how many were removed.
pub fn remove_stale(prefix: &str) -> usize {
    let Some(dir) = own_cgroup_dir() else {
        return 0;
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(creator_pid)
        else {
            continue;
        };
        // kill(pid, 0): sends nothing, answers ESRCH for no such process. `pid` is positive:
        // never a process group, never "every process".
        let gone = pid == std::process::id()
            || rustix::process::Pid::from_raw(pid as i32).is_some_and(|p| {
                rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH)
            });
        if gone && std::fs::remove_dir(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// The creator's pid of a cgroup name's rest `<pid>-<n>`: both plain decimal numbers (no
/// sign, no leading zero), the pid from 1 to `i32::MAX`, nothing after `n`.
fn creator_pid(rest: &str) -> Option<u32> {
    let (pid, n) = rest.split_once('-')?;
    let decimal = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    if !decimal(pid) || !decimal(n) || pid.starts_with('0') || n.parse::<u64>().is_err() {
        return None;
    }
    pid.parse::<i32>().ok().filter(|p| *p > 0).map(|p| p as u32)
}

/// A cgroup created for one job, removed by [`JobCgroup::remove`].
#[derive(Debug, Clone)]
pub struct JobCgroup {
    dir: PathBuf,
}

/// Members pinned at once by [`JobCgroup::signal_members`].
pub(crate) const SIGNAL_BATCH: usize = 256;

/// The most cgroups of a job read (its own and those it made below it).
pub const MAX_NESTED_CGROUPS: usize = 1024;
/// How deep below the job's cgroup its own are read.
pub const MAX_NESTING: usize = 16;

impl JobCgroup {
    /// Creates `name` below this process's own cgroup.
    pub fn create(name: &str) -> Result<JobCgroup, CgroupError> {
        let mount = cgroup2_mount()
            .ok_or_else(|| CgroupError("no cgroup2 mount in /proc/self/mountinfo".into()))?;
        let own = own_cgroup()
            .ok_or_else(|| CgroupError("no cgroup v2 line in /proc/self/cgroup".into()))?;
        let dir = mount.join(own.trim_start_matches('/')).join(name);
        std::fs::create_dir(&dir)
            .map_err(|e| CgroupError(format!("creating {}: {e}", dir.display())))?;
        let cg = JobCgroup { dir };
        if !cg.dir.join("cgroup.procs").exists() {
            cg.remove();
            return Err(CgroupError(format!(
                "{} has no cgroup.procs",
                cg.dir.display()
            )));
        }
        Ok(cg)
    }

    /// Uses an existing cgroup directory (the watchdog's view).
    pub fn at(dir: PathBuf) -> JobCgroup {
        JobCgroup { dir }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `cgroup.procs`, which a process joins by writing `0` to it.
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// The pids in it now, its child cgroups' included: a job that made cgroups of its own
    /// (a container runtime, a nested `vramguard run`) keeps its processes there, and they
    /// are the job's (red team: a signal forwarded to the job missed them).
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        for dir in self.dirs() {
            if let Ok(t) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                pids.extend(t.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Its directory, then its child cgroups' (parents before children), real directories
    /// only, at most [`MAX_NESTED_CGROUPS`] of them [`MAX_NESTING`] levels deep.
    fn dirs(&self) -> Vec<PathBuf> {
        let mut out = vec![self.dir.clone()];
        let mut level = vec![self.dir.clone()];
        for _ in 0..MAX_NESTING {
            let mut next = Vec::new();
            for d in &level {
                let Ok(entries) = std::fs::read_dir(d) else {
                    continue;
                };
                for e in entries.flatten() {
                    // `file_type` does not follow a symlink: a cgroup directory is a real one.
                    if e.file_type().is_ok_and(|t| t.is_dir())
                        && out.len() + next.len() < MAX_NESTED_CGROUPS
                    {
                        next.push(e.path());
                    }
                }
            }
            if next.is_empty() {
                break;
            }
            out.extend(next.iter().cloned());
            level = next;
        }
        out
    }

    /// Whether any process is in it (`populated 1` in `cgroup.events`).
    pub fn populated(&self) -> bool {
        match std::fs::read_to_string(self.dir.join("cgroup.events")) {
            Ok(t) => t.lines().any(|l| l.trim() == "populated 1"),
            Err(_) => !self.pids().is_empty(),
        }
    }

    /// SIGKILLs every process in it; `cgroup.kill` where the kernel has it, else each pid until
    /// none is left.
    pub fn kill(&self) {
        if std::fs::write(self.dir.join("cgroup.kill"), b"1").is_ok() {
            return;
        }
        for _ in 0..100 {
            if self.pids().is_empty() {
                return;
            }
            self.signal_members(rustix::process::Signal::KILL);
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends `sig` to every process in it; returns how many got it. A pid read from
    /// `cgroup.procs` may be freed and taken by another process before it is signalled: each
    /// is pinned by a pidfd first and signalled only if `cgroup.procs` still lists it after
    /// that (the pidfd's process is then the one listed: a pid is not reused while its
    /// process lives, and one that died since gets nothing).
    pub fn signal_members(&self, sig: rustix::process::Signal) -> usize {
        self.signal_members_after(sig, SIGNAL_BATCH, || {})
    }

    /// [`JobCgroup::signal_members`] in batches of `batch_size`, running `between` after the
    /// first batch's pidfds are opened and before the list is read again (the window a test
    /// needs to reach).
    fn signal_members_after(
        &self,
        sig: rustix::process::Signal,
        batch_size: usize,
        between: impl FnOnce(),
    ) -> usize {
        use rustix::process::{Pid, PidfdFlags, pidfd_open, pidfd_send_signal};
        let mut between = Some(between);
        let mut signalled = 0;
        // In batches: a pidfd per member of a job of thousands would run into the fd limit,
        // and the members whose pidfd failed would get nothing.
        for batch in self.pids().chunks(batch_size.max(1)) {
            let pinned: Vec<(u32, std::os::fd::OwnedFd)> = batch
                .iter()
                .filter_map(|&pid| {
                    let fd = pidfd_open(Pid::from_raw(pid as i32)?, PidfdFlags::empty()).ok()?;
                    Some((pid, fd))
                })
                .collect();
            if let Some(f) = between.take() {
                f();
            }
            let still: std::collections::BTreeSet<u32> = self.pids().into_iter().collect();
            signalled += pinned
                .iter()
                .filter(|(pid, _)| still.contains(pid))
                .filter(|(_, fd)| pidfd_send_signal(fd, sig).is_ok())
                .count();
        }
        signalled
    }

    /// Waits until it is empty or `timeout` passes; returns whether it is empty.
    pub fn wait_empty(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if !self.populated() {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Removes the directory, child cgroups the job left first (each must be empty), within
    /// half a second in all: a job that made more cgroups than are read must not hold the
    /// run's end up by half a second for each (review).
    pub fn remove(&self) {
        let deadline = Instant::now() + Duration::from_millis(500);
        for dir in self.dirs().iter().rev() {
            while std::fs::remove_dir(dir).is_err() && dir.exists() {
                if Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child killed by pid and reaped however the test ends (a cgroup cannot go while it
    /// is in it).
    struct Reaped(std::process::Child);

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// What the test made, undone on drop (a failed assertion included): its sleeper killed by
    /// pid, its cgroups removed.
    #[derive(Default)]
    struct Made {
        sleeper: Option<std::process::Child>,
        cgroups: Vec<JobCgroup>,
    }

    impl Drop for Made {
        fn drop(&mut self) {
            if let Some(c) = &mut self.sleeper {
                let _ = c.kill();
                let _ = c.wait();
            }
            for cg in &self.cgroups {
                cg.wait_empty(Duration::from_secs(5));
                cg.remove();
            }
        }
    }

    /// A process that left the cgroup between the listing and its signal gets none (its pid
    /// could be another process's by then); one still in it does.
    #[test]
    fn a_process_that_left_the_cgroup_before_its_signal_gets_none() {
        use std::os::unix::process::ExitStatusExt;
        let cg = JobCgroup::create(&format!("vramguard-signal-test-{}", std::process::id()))
            .expect("a writable cgroup v2 (the suite runs as root)");
        let sleep = || {
            std::process::Command::new("sleep")
                .arg("60")
                .spawn()
                .unwrap()
        };
        let mut made = Made {
            sleeper: Some(sleep()),
            cgroups: vec![cg.clone()],
        };
        let mut stayer = Reaped(sleep());
        let stayer_pid = stayer.0.id();
        let leaver = made.sleeper.as_ref().unwrap().id();
        for pid in [leaver, stayer_pid] {
            std::fs::write(cg.procs_file(), pid.to_string()).unwrap();
        }
        let parent = cg.dir().parent().unwrap().join("cgroup.procs");
        let signalled = cg.signal_members_after(rustix::process::Signal::TERM, 8, || {
            std::fs::write(&parent, leaver.to_string()).unwrap();
        });
        assert_eq!(signalled, 1);
        assert_eq!(stayer.0.wait().unwrap().signal(), Some(libc::SIGTERM));
        let left = made.sleeper.as_mut().unwrap();
        assert!(
            left.try_wait().unwrap().is_none(),
            "the leaver was signalled"
        );
    }

    /// Members are pinned a batch at a time (a pidfd each would exceed the fd limit of a job
    /// of thousands): every batch is signalled.
    #[test]
    fn every_member_is_signalled_batch_after_batch() {
        use std::os::unix::process::ExitStatusExt;
        let cg = JobCgroup::create(&format!("vramguard-batch-test-{}", std::process::id()))
            .expect("a writable cgroup v2 (the suite runs as root)");
        let _made = Made {
            sleeper: None,
            cgroups: vec![cg.clone()],
        };
        let mut members: Vec<Reaped> = (0..5)
            .map(|_| {
                Reaped(
                    std::process::Command::new("sleep")
                        .arg("60")
                        .spawn()
                        .unwrap(),
                )
            })
            .collect();
        for m in &members {
            std::fs::write(cg.procs_file(), m.0.id().to_string()).unwrap();
        }
        assert_eq!(
            cg.signal_members_after(rustix::process::Signal::TERM, 2, || {}),
            5
        );
        for m in &mut members {
            assert_eq!(m.0.wait().unwrap().signal(), Some(libc::SIGTERM));
        }
    }

    /// A job that made a cgroup of its own below its job's: the processes there are the job's,
    /// listed and signalled with the rest (red team: a forwarded signal missed them), and the
    /// job's cgroup is removed with the ones it made.
    #[test]
    fn the_processes_of_a_cgroup_the_job_made_are_the_jobs() {
        use std::os::unix::process::ExitStatusExt;
        let cg = JobCgroup::create(&format!("vramguard-nested-test-{}", std::process::id()))
            .expect("a writable cgroup v2 (the suite runs as root)");
        let _made = Made {
            sleeper: None,
            cgroups: vec![cg.clone()],
        };
        let inner = cg.dir().join("inner").join("deeper");
        std::fs::create_dir_all(&inner).unwrap();
        let mut member = Reaped(
            std::process::Command::new("sleep")
                .arg("60")
                .spawn()
                .unwrap(),
        );
        std::fs::write(inner.join("cgroup.procs"), member.0.id().to_string()).unwrap();
        assert_eq!(cg.pids(), vec![member.0.id()]);
        assert_eq!(cg.signal_members(rustix::process::Signal::TERM), 1);
        assert_eq!(member.0.wait().unwrap().signal(), Some(libc::SIGTERM));
        assert!(cg.wait_empty(Duration::from_secs(5)));
        cg.remove();
        assert!(!cg.dir().exists(), "removed with the cgroups the job made");
    }

    #[test]
    fn only_empty_cgroups_of_dead_creators_or_of_this_pid_are_removed() {
        let prefix = format!("vramguard-stale-test-{}x", std::process::id());
        let mut made = Made::default();
        let mut make = |name: String| {
            let cg = JobCgroup::create(&format!("{prefix}{name}"))
                .expect("a writable cgroup v2 (the suite runs as root)");
            made.cgroups.push(cg.clone());
            cg
        };
        // A creator that cannot exist: above the largest pid_max Linux allows (2^22).
        let dead = 4_194_305u32;
        // The suite runs as root with a cgroup v2 mount (scripts/test.sh): without one this
        // test fails rather than passing on nothing.
        let stale = make(format!("{dead}-0"));
        // Named after this very process, which has made none yet: an earlier run's.
        let own = make(format!("{}-0", std::process::id()));
        // pid 1 lives: its cgroup stays.
        let live = make("1-0".into());
        // Names not exactly `<pid>-<n>`: never touched (4294967295 was a negative pid, a
        // process group, and a panic in debug builds).
        let odd: Vec<JobCgroup> = [
            "4294967295-0",
            "+5-0",
            &format!("0{dead}-0"),
            &format!("{dead}-0-x"),
            &format!("{dead}-"),
            &format!("{dead}"),
        ]
        .iter()
        .map(|n| make(n.to_string()))
        .collect();
        // A dead creator's cgroup with a process in it (a sleep of ours): left alone.
        let busy = make(format!("{dead}-1"));
        let sleeper = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = sleeper.id();
        made.sleeper = Some(sleeper);
        std::fs::write(busy.procs_file(), pid.to_string()).unwrap();
        assert_eq!(busy.pids(), [pid]);
        assert_eq!(remove_stale(&prefix), 2);
        assert!(!stale.dir().exists());
        assert!(!own.dir().exists());
        assert!(live.dir().exists());
        assert!(busy.dir().exists());
        for cg in &odd {
            assert!(cg.dir().exists(), "{} was removed", cg.dir().display());
        }
    }

    #[test]
    fn a_creator_pid_is_a_plain_positive_decimal() {
        assert_eq!(creator_pid("12-0"), Some(12));
        assert_eq!(creator_pid("2147483647-3"), Some(i32::MAX as u32));
        for bad in [
            "2147483648-0",
            "0-0",
            "012-0",
            "+12-0",
            "-12-0",
            "12",
            "12-",
            "12-0-1",
            "12-x",
            " 12-0",
            "",
        ] {
            assert_eq!(creator_pid(bad), None, "{bad:?}");
        }
    }
}
