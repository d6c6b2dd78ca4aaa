//! Processes that hold GPU memory for an experiment.

use std::io::BufRead;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vramguard_ops::identity::{Identity, Verified, start_ticks, verify};
use vramguard_ops::spawn::with_default_signals;

/// What a holder must do: hold `bytes` on `gpu`, with `children` children inheriting its
/// context, for at most `lifetime`; `scratch` is a directory for its files.
#[derive(Debug, Clone)]
pub struct HoldRequest<'a> {
    /// The GPU index.
    pub gpu: u32,
    /// How much to hold.
    pub bytes: u64,
    /// Children that inherit the context.
    pub children: u32,
    /// How long it may live.
    pub lifetime: Duration,
    /// A directory for its files.
    pub scratch: &'a Path,
}

/// A started holder: the child process, the pid that holds the memory, and its children.
pub struct Started {
    /// The process started (killed and reaped with the holding).
    pub child: Child,
    /// The pid that holds the memory.
    pub pid: u32,
    /// Its children that inherited the context.
    pub children: Vec<u32>,
}

/// Starts a holder for a request.
pub type HolderSpawner = dyn Fn(&HoldRequest<'_>) -> Result<Started, HolderError> + Send + Sync;

/// How holders are made.
#[derive(Clone)]
pub enum HolderKind {
    /// The built-in CUDA holder: `EXE __cuda-hold`.
    Cuda {
        /// The vramguard executable.
        exe: PathBuf,
        /// The GPU's PCI bus id (CUDA and NVML number GPUs differently; the bus id is common).
        pci_bus_id: String,
    },
    /// Holders started by a function (the simulator's, which registers allocations with
    /// its model).
    Spawner(Arc<HolderSpawner>),
    /// The user's own command, run with `sh -c`; it gets `VRAMGUARD_PROBE_BYTES` and
    /// `CUDA_VISIBLE_DEVICES` (the GPU's UUID).
    Command {
        /// The command line.
        cmd: String,
        /// The GPU's UUID (or index).
        device: String,
    },
}

/// A holder process (and the children it forked).
pub struct Holding {
    child: Child,
    /// The child's pidfd, opened while it was surely ours (unreaped): every signal to the
    /// holder goes through it, never by a pid it reported.
    pidfd: OwnedFd,
    /// The pid that holds the memory, as the driver lists it.
    pub pid: u32,
    /// Children that inherited its context: each pinned, and the holder's child when pinned.
    children: Vec<Verified>,
    exited: Option<Instant>,
}

/// Why a holder could not be started.
/// Why a holder could not be started.
#[derive(Debug, thiserror::Error)]
pub enum HolderError {
    /// The holder process could not be started.
    #[error("starting {what}: {cause}")]
    NotStarted {
        /// The CUDA holder, or the command.
        what: String,
        /// Why.
        cause: std::io::Error,
    },
    /// The CUDA holder exited before it was ready.
    #[error("the CUDA holder failed ({0}); see its message above")]
    CudaHolderFailed(String),
    /// The spawner (the simulator's holders) refused.
    #[error("{0}")]
    Spawner(String),
}

/// The holder's children among the pids it reported, each pinned (pidfd first) and a child of
/// `holder` (our own child) once pinned: a reported pid that names anything else here (a pid
/// of another PID namespace, a process that took a dead child's pid) is not the holder's.
fn pinned_children(holder: u32, reported: impl IntoIterator<Item = u32>) -> Vec<Verified> {
    let fs = Path::new(vramguard_proc::OWN_PROC);
    reported
        .into_iter()
        .filter_map(|pid| {
            let start_ticks = start_ticks(fs, pid)?;
            let pinned = verify(fs, Identity { pid, start_ticks }).ok()?;
            let parent = vramguard_proc::ProcFs::open(fs)
                .ok()?
                .stat(pid)
                .ok()?
                .ok()?
                .ppid;
            (parent == Some(holder)).then_some(pinned)
        })
        .collect()
}

/// A holding of `child`, the holder, its pidfd opened while the child is unreaped. Without a
/// pidfd it could not be signalled: the child is killed and the holding refused, not left to
/// measure nothing.
fn holding(
    mut child: Child,
    pid: u32,
    reported_children: Vec<u32>,
) -> Result<Holding, HolderError> {
    let pidfd = rustix::process::Pid::from_raw(child.id() as i32)
        .ok_or(rustix::io::Errno::INVAL)
        .and_then(|p| rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()));
    let pidfd = match pidfd {
        Ok(fd) => fd,
        Err(e) => {
            let id = child.id();
            let _ = child.kill();
            let _ = child.wait();
            return Err(HolderError::Spawner(format!(
                "no pidfd of the holder (pid {id}: {e}): it could not be signalled safely \
                 (Linux 5.3 or later, and a free file descriptor, are needed)"
            )));
        }
    };
    let children = pinned_children(child.id(), reported_children);
    Ok(Holding {
        child,
        pidfd,
        pid,
        children,
        exited: None,
    })
}

impl HolderKind {
    /// Starts a holder of `bytes` on `gpu` with `children` inheriting children.
    pub fn start(
        &self,
        gpu: u32,
        bytes: u64,
        children: u32,
        lifetime: Duration,
        scratch: &Path,
    ) -> Result<Holding, HolderError> {
        match self {
            HolderKind::Cuda { exe, pci_bus_id } => {
                let mut child = with_default_signals(&mut Command::new(exe))
                    .args(["__cuda-hold", "--pci", pci_bus_id])
                    .args([
                        "--bytes",
                        &bytes.to_string(),
                        "--children",
                        &children.to_string(),
                    ])
                    .args(["--lifetime", &lifetime.as_secs().to_string()])
                    .stdin(Stdio::null())
                    .stdout(Stdio::piped())
                    .spawn()
                    .map_err(|cause| HolderError::NotStarted {
                        what: "the CUDA holder".into(),
                        cause,
                    })?;
                let stdout = child.stdout.take().expect("piped");
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    let mut line = String::new();
                    let _ = std::io::BufReader::new(stdout).read_line(&mut line);
                    let _ = tx.send(line);
                });
                let line = rx
                    .recv_timeout(Duration::from_secs(120))
                    .unwrap_or_default();
                let mut words = line.split_whitespace();
                if words.next() != Some("ready") {
                    let _ = child.kill();
                    let status = child.wait().ok();
                    return Err(HolderError::CudaHolderFailed(match status {
                        Some(s) => s.to_string(),
                        None => "its exit status is unknown".into(),
                    }));
                }
                let pid = words
                    .next()
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(child.id());
                let kids = words.filter_map(|w| w.parse().ok()).collect();
                holding(child, pid, kids)
            }
            HolderKind::Spawner(spawn) => {
                let started = spawn(&HoldRequest {
                    gpu,
                    bytes,
                    children,
                    lifetime,
                    scratch,
                })?;
                holding(started.child, started.pid, started.children)
            }
            HolderKind::Command { cmd, device } => {
                let child = with_default_signals(&mut Command::new("sh"))
                    .args(["-c", cmd])
                    .env("VRAMGUARD_PROBE_BYTES", bytes.to_string())
                    .env("CUDA_VISIBLE_DEVICES", device)
                    .stdin(Stdio::null())
                    .spawn()
                    .map_err(|cause| HolderError::NotStarted {
                        what: format!("`{cmd}`"),
                        cause,
                    })?;
                let pid = child.id();
                holding(child, pid, Vec::new())
            }
        }
    }
}

impl Holding {
    /// Sends `sig` to the holder, our own child, through its pidfd (never by the pid it
    /// reported, nor by `child.id()`, which may be reaped and reused by then).
    pub fn signal(&self, sig: i32) {
        if let Some(sig) = rustix::process::Signal::from_named_raw(sig) {
            let _ = rustix::process::pidfd_send_signal(&self.pidfd, sig);
        }
    }

    /// Polls for the holder's exit; returns when it happened, once seen.
    pub fn poll_exit(&mut self) -> Option<Instant> {
        if self.exited.is_none() && matches!(self.child.try_wait(), Ok(Some(_))) {
            self.exited = Some(Instant::now());
        }
        self.exited
    }

    /// Waits up to `timeout` for the holder to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<Instant> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(t) = self.poll_exit() {
                return Some(t);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// How many children that inherited the context were pinned.
    pub fn children_count(&self) -> usize {
        self.children.len()
    }

    /// Whether any child that inherited the context still lives.
    pub fn children_alive(&self) -> bool {
        self.children.iter().any(|c| !c.has_exited())
    }

    /// SIGKILLs the children, through the pidfds pinned when the holder was ready.
    pub fn kill_children(&self) {
        for c in &self.children {
            let _ = c.signal(rustix::process::Signal::KILL);
        }
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.kill_children();
    }
}

#[cfg(test)]
mod tests {
    use super::pinned_children;
    use std::time::{Duration, Instant};

    /// A child killed by pid and reaped however the test ends.
    struct Reaped(std::process::Child);

    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// A pid a holder reports is taken for its child only when it is one here: a pid of
    /// another namespace, or any other process that has that number here, is not pinned (red
    /// team: the probe SIGKILLed such a process at its end).
    #[test]
    fn only_the_holders_own_children_are_pinned_as_its_children() {
        let holder = Reaped(
            std::process::Command::new("sh")
                .args(["-c", "sleep 60 & wait"])
                .spawn()
                .unwrap(),
        );
        let outsider = Reaped(
            std::process::Command::new("sleep")
                .arg("60")
                .spawn()
                .unwrap(),
        );
        let h = holder.0.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        let child = loop {
            let listed = vramguard_proc::ProcFs::own()
                .unwrap()
                .children(h)
                .unwrap()
                .unwrap_or_default();
            if let Some(&c) = listed.first() {
                break c;
            }
            assert!(
                Instant::now() < deadline,
                "the holder's child never started"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        let pinned = pinned_children(h, [child, outsider.0.id(), 0, u32::MAX]);
        let pids: Vec<u32> = pinned.iter().map(|v| v.identity.pid).collect();
        assert_eq!(pids, vec![child]);
        // Its end: the holder's child, killed through the pidfd pinned.
        let _ = pinned[0].signal(rustix::process::Signal::KILL);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pinned[0].has_exited() {
            assert!(Instant::now() < deadline, "the child was not killed");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
