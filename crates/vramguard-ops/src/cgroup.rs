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
/// whose creator `<pid>` is no process any more: what a killed (SIGKILL, a crash) run of the
/// same program left behind. A populated one is left alone (what runs in it is not ours to
/// judge); a pid that was reused only delays the clean-up. Returns how many were removed.
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
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        // kill(pid, 0): sends nothing, answers ESRCH for no such process.
        let gone = rustix::process::Pid::from_raw(pid as i32)
            .is_some_and(|p| rustix::process::test_kill_process(p) == Err(rustix::io::Errno::SRCH));
        if pid == std::process::id() || !gone {
            continue;
        }
        if std::fs::remove_dir(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// A cgroup created for one job, removed by [`JobCgroup::remove`].
#[derive(Debug, Clone)]
pub struct JobCgroup {
    dir: PathBuf,
}

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

    /// The pids in it now.
    pub fn pids(&self) -> Vec<u32> {
        std::fs::read_to_string(self.procs_file())
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default()
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
            let pids = self.pids();
            if pids.is_empty() {
                return;
            }
            for pid in pids {
                if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                    let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
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

    /// Removes the directory (it must be empty).
    pub fn remove(&self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn only_empty_cgroups_of_dead_creators_are_removed() {
        let prefix = format!("vramguard-stale-test-{}x", std::process::id());
        let mut made = Made::default();
        // A creator that is gone: a child run to its end and reaped.
        let dead = std::process::Command::new("true")
            .spawn()
            .and_then(|mut c| c.wait().map(|_| c.id()))
            .unwrap();
        // The suite runs as root with a cgroup v2 mount (scripts/test.sh): without one this
        // test fails rather than passing on nothing.
        let stale = JobCgroup::create(&format!("{prefix}{dead}-0"))
            .expect("a writable cgroup v2 (the suite runs as root)");
        made.cgroups.push(stale.clone());
        // pid 1 lives: its cgroup stays.
        let live = JobCgroup::create(&format!("{prefix}1-0")).unwrap();
        made.cgroups.push(live.clone());
        // A dead creator's cgroup with a process in it (a sleep of ours): left alone.
        let busy = JobCgroup::create(&format!("{prefix}{dead}-1")).unwrap();
        made.cgroups.push(busy.clone());
        let sleeper = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = sleeper.id();
        made.sleeper = Some(sleeper);
        std::fs::write(busy.procs_file(), pid.to_string()).unwrap();
        assert_eq!(busy.pids(), [pid]);
        assert_eq!(remove_stale(&prefix), 1);
        assert!(!stale.dir().exists());
        assert!(live.dir().exists());
        assert!(busy.dir().exists());
    }
}
