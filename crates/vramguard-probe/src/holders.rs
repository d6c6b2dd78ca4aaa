//! Processes that hold GPU memory for an experiment.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vramguard_ops::identity::{Identity, start_ticks, verify};
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
    /// Its pid.
    pub pid: u32,
    /// Children that inherited its context, with their start times.
    pub children: Vec<Identity>,
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

fn identities(pids: impl IntoIterator<Item = u32>) -> Vec<Identity> {
    pids.into_iter()
        .filter_map(|pid| {
            start_ticks(Path::new(vramguard_proc::OWN_PROC), pid)
                .map(|start_ticks| Identity { pid, start_ticks })
        })
        .collect()
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
                let kids = identities(words.filter_map(|w| w.parse().ok()));
                Ok(Holding {
                    pid,
                    child,
                    children: kids,
                    exited: None,
                })
            }
            HolderKind::Spawner(spawn) => {
                let started = spawn(&HoldRequest {
                    gpu,
                    bytes,
                    children,
                    lifetime,
                    scratch,
                })?;
                Ok(Holding {
                    pid: started.pid,
                    child: started.child,
                    children: identities(started.children),
                    exited: None,
                })
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
                Ok(Holding {
                    pid: child.id(),
                    child,
                    children: vec![],
                    exited: None,
                })
            }
        }
    }
}

impl Holding {
    /// Sends `sig` to the holder (our own child).
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own unreaped child.
        unsafe { libc::kill(self.pid as i32, sig) };
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

    /// Whether any child that inherited the context still lives.
    pub fn children_alive(&self) -> bool {
        self.children
            .iter()
            .any(|c| start_ticks(Path::new(vramguard_proc::OWN_PROC), c.pid) == Some(c.start_ticks))
    }

    /// SIGKILLs the children (verified by pid and start time).
    pub fn kill_children(&self) {
        for c in &self.children {
            if let Ok(v) = verify(Path::new(vramguard_proc::OWN_PROC), *c) {
                let _ = v.signal(rustix::process::Signal::KILL);
            }
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
