//! Processes that hold GPU memory for an experiment.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vramguard_ops::identity::{Identity, start_ticks, verify};
use vramguard_sim::holder::with_default_signals;
use vramguard_sim::holder::{HolderSpec, Worker};

/// How holders are made.
#[derive(Debug, Clone)]
pub enum HolderKind {
    /// The built-in CUDA holder: `EXE __cuda-hold`.
    Cuda {
        /// The vramguard executable.
        exe: PathBuf,
        /// The GPU's PCI bus id (CUDA and NVML number GPUs differently; the bus id is common).
        pci_bus_id: String,
    },
    /// Simulated holders registering allocations with the simulator.
    Sim {
        /// The vramguard executable.
        exe: PathBuf,
        /// The state file.
        state: PathBuf,
    },
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
pub type HolderError = String;

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
                    .map_err(|e| format!("starting the CUDA holder: {e}"))?;
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
                    return Err(format!(
                        "the CUDA holder failed ({status:?}); see its message above"
                    ));
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
            HolderKind::Sim { exe, state } => {
                static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let ready = scratch.join(format!(
                    "probe-holder-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                ));
                let lifetime_ms = lifetime.as_millis() as u64;
                let worker = Worker {
                    argv: vec!["probe-child".into()],
                    spec: HolderSpec {
                        comm: Some("probe-child".into()),
                        open_gpus: vec![gpu],
                        ..HolderSpec::new(state.clone(), lifetime_ms)
                    },
                };
                let spec = HolderSpec {
                    comm: Some("probe-holder".into()),
                    holds: vec![vramguard_sim::holder::Hold::on(gpu, bytes)],
                    group_leader: true,
                    workers: vec![worker; children as usize],
                    ready_file: Some(ready.clone()),
                    share_with_workers: true,
                    ..HolderSpec::new(state.clone(), lifetime_ms)
                };
                let child = vramguard_sim::holder::spawn_with(exe, &["probe-holder".into()], &spec)
                    .map_err(|e| e.to_string())?;
                let r = vramguard_sim::holder::wait_ready(&ready, Duration::from_secs(20))
                    .map_err(|e| e.to_string())?;
                let _ = std::fs::remove_file(&ready);
                Ok(Holding {
                    pid: r.pid,
                    child,
                    children: identities(r.workers),
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
                    .map_err(|e| format!("starting `{cmd}`: {e}"))?;
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
