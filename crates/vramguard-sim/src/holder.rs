//! A simulated CUDA process: registers allocations with the simulator under its own pid,
//! keeps the stand-in device files open, optionally starts workers, and takes one of the
//! process shapes that leave GPU memory behind on real machines.
//!
//! `vramguard sim hold` runs one in the foreground. The demo and the tests start them with a
//! JSON spec in `VRAMGUARD_HOLDER` and a cosmetic argv (`python3 train.py`), so that `/proc`
//! shows what a real incident shows.

use crate::state::{AfterExit, AllocationKind, SimAllocation};
use crate::{SimState, store};
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vramguard_proc::{ProcDir, ProcFs};

/// A holder that could not be started or could not register.
#[derive(Debug, thiserror::Error)]
#[error("simulated holder: {0}")]
pub struct HolderError(pub String);

type Result<T> = std::result::Result<T, HolderError>;

trait Context<T> {
    fn context(self, what: &str) -> Result<T>;
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: std::fmt::Display> Context<T> for std::result::Result<T, E> {
    fn context(self, what: &str) -> Result<T> {
        self.map_err(|e| HolderError(format!("{what}: {e}")))
    }
    fn with_context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| HolderError(format!("{}: {e}", what())))
    }
}

/// The environment variable carrying a [`HolderSpec`] to a re-executed vramguard.
pub const HOLDER_ENV: &str = "VRAMGUARD_HOLDER";

/// One allocation the holder makes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hold {
    /// GPU index.
    pub gpu: u32,
    /// Bytes.
    pub bytes: u64,
    /// What happens after exit; default: the GPU's own (`after_exit` of the simulated GPU).
    #[serde(default)]
    pub after_exit: Option<AfterExit>,
    /// Listed by the driver.
    #[serde(default = "yes")]
    pub listed: bool,
    /// Pid the driver reports instead.
    #[serde(default)]
    pub reported_pid: Option<u32>,
    /// SM utilization.
    #[serde(default)]
    pub sm_util: u32,
    /// Process list.
    #[serde(default)]
    pub kind: AllocationKind,
    /// The driver reports the pid this process has inside its own PID namespace (a driver
    /// translating pids inconsistently, as HAMi-core #112 saw).
    #[serde(default)]
    pub report_namespace_pid: bool,
    /// On a GPU in MIG mode, the MIG device it is on.
    #[serde(default)]
    pub mig_device: Option<u32>,
}

fn yes() -> bool {
    true
}

/// A process shape that outlives its job in a particular way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Shape {
    /// The main thread exits (`exit`, not `exit_group`) while another thread keeps running:
    /// the leader shows Z, the process still holds its files.
    ZombieLeader,
    /// Like `ZombieLeader`, but the surviving thread waits in `vfork` for a child that never
    /// execs: it sleeps in D state (killable, like an NFS or FUSE wait).
    ZombieLeaderStuckInD,
}

/// What a holder does.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HolderSpec {
    /// The simulator state to register in.
    pub state: PathBuf,
    /// `comm` to take (15 bytes at most).
    #[serde(default)]
    pub comm: Option<String>,
    /// `comm` as raw bytes, in place of `comm` (hostile-input tests: not UTF-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_bytes: Option<Vec<u8>>,
    /// For a worker: its argv as raw bytes, in place of the worker's `argv` (hostile-input
    /// tests: not UTF-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv_bytes: Option<Vec<Vec<u8>>>,
    /// Allocations to make.
    #[serde(default)]
    pub holds: Vec<Hold>,
    /// GPUs whose device files to open without allocating. With `holds`, the other GPUs a
    /// CUDA process opens at `cuInit`; alone, an NVML client (a monitor, the persistence
    /// daemon): it maps the NVML library's stand-in and has no context, and it opens
    /// `/dev/nvidia-uvm` only where the state models driver 580's NVML
    /// ([`crate::SimState::nvml_client_files`]).
    #[serde(default)]
    pub open_gpus: Vec<u32>,
    /// Become a process-group leader (a job started by a shell with job control).
    #[serde(default)]
    pub group_leader: bool,
    /// Start a new session (a daemon, a Jupyter kernel).
    #[serde(default)]
    pub new_session: bool,
    /// Ignore SIGTERM.
    #[serde(default)]
    pub ignore_term: bool,
    /// Workers to start, each with its argv and spec; they inherit the process group.
    #[serde(default)]
    pub workers: Vec<Worker>,
    /// Exit by itself after this many milliseconds: nothing a test or the demo starts may
    /// outlive it for long, even if they are killed.
    pub lifetime_ms: u64,
    /// Written (JSON: pid and worker pids) once everything is in place.
    #[serde(default)]
    pub ready_file: Option<PathBuf>,
    /// A process shape to take once ready.
    #[serde(default)]
    pub shape: Option<Shape>,
    /// Workers forked without exec, as a DataLoader forks its workers: each inherits this
    /// holder's open device files and contexts (its memory stays while any of them lives) and
    /// shows its command line; the driver does not list them.
    #[serde(default)]
    pub forked_workers: u32,
    /// Hand its device files (and with them its memory) to the first process that connects
    /// to a Unix socket at this path (`SCM_RIGHTS`, as CUDA IPC does).
    #[serde(default)]
    pub share_fds_on: Option<PathBuf>,
    /// Receive device files over the Unix socket at this path, and with them the sender's
    /// memory: it stays while this process lives.
    #[serde(default)]
    pub receive_fds_from: Option<PathBuf>,
    /// Keep one thread busy this share of the time (percent of one core, 0–100): a job that
    /// feeds its GPU or loads data burns CPU; an orphaned worker blocked on a dead parent
    /// does not.
    #[serde(default)]
    pub cpu_percent: u32,
}

/// A worker: its cosmetic argv and its own spec.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Worker {
    /// argv, argv[0] first.
    pub argv: Vec<String>,
    /// What it does.
    pub spec: HolderSpec,
}

impl Hold {
    /// `bytes` on `gpu`: listed, compute, the GPU's own `after_exit`, idle.
    pub fn on(gpu: u32, bytes: u64) -> Hold {
        Hold {
            gpu,
            bytes,
            after_exit: None,
            listed: true,
            reported_pid: None,
            sm_util: 0,
            kind: AllocationKind::Compute,
            report_namespace_pid: false,
            mig_device: None,
        }
    }
}

impl HolderSpec {
    /// A holder registering in `state`, living at most `lifetime_ms`, doing nothing else yet.
    pub fn new(state: PathBuf, lifetime_ms: u64) -> HolderSpec {
        HolderSpec {
            state,
            comm: None,
            comm_bytes: None,
            argv_bytes: None,
            holds: vec![],
            open_gpus: vec![],
            group_leader: false,
            new_session: false,
            ignore_term: false,
            workers: vec![],
            lifetime_ms,
            ready_file: None,
            shape: None,
            forked_workers: 0,
            share_fds_on: None,
            receive_fds_from: None,
            cpu_percent: 0,
        }
    }
}

/// Written to the ready file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Ready {
    /// The holder's pid.
    pub pid: u32,
    /// Its workers' pids, in spec order.
    pub workers: Vec<u32>,
}

pub use vramguard_proc::spawn::with_default_signals;

/// Starts a holder as a child process with a cosmetic argv: `exe` (the vramguard binary,
/// whose `main` runs [`run`] when it finds [`HOLDER_ENV`]) under the name `argv[0]`.
pub fn spawn_with<A: AsRef<std::ffi::OsStr>>(
    exe: &Path,
    argv: &[A],
    spec: &HolderSpec,
) -> Result<std::process::Child> {
    let mut cmd = std::process::Command::new(exe);
    if let Some((first, rest)) = argv.split_first() {
        cmd.arg0(first).args(rest);
    }
    with_default_signals(&mut cmd)
        .env(
            HOLDER_ENV,
            serde_json::to_string(spec).context("encoding the holder spec")?,
        )
        .stdin(std::process::Stdio::null())
        .spawn()
        .context("starting a simulated holder process")
}

/// [`spawn_with`] the current executable.
pub fn spawn<A: AsRef<std::ffi::OsStr>>(
    argv: &[A],
    spec: &HolderSpec,
) -> Result<std::process::Child> {
    let exe = std::env::current_exe().context("locating the vramguard executable")?;
    spawn_with(&exe, argv, spec)
}

/// Waits for a ready file and reads it.
pub fn wait_ready(path: &Path, timeout: Duration) -> Result<Ready> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && let Ok(ready) = serde_json::from_str::<Ready>(&text)
        {
            return Ok(ready);
        }
        if Instant::now() > deadline {
            return Err(HolderError(format!(
                "did not become ready within {timeout:?} ({})",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn set_comm(name: &[u8]) {
    let mut buf = [0u8; 16];
    for (d, s) in buf.iter_mut().zip(name.iter().copied().take(15)) {
        *d = s;
    }
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, buf.as_ptr() as libc::c_ulong, 0, 0, 0) };
}

/// Runs the holder in this process. Returns when its lifetime is over.
pub fn run(spec: HolderSpec) -> Result<()> {
    // SAFETY: single-threaded here; the spec was read already.
    unsafe { std::env::remove_var(HOLDER_ENV) };
    take_identity(&spec)?;
    let state = SimState::load(&spec.state).context("loading the state")?;
    // The driver sees processes through the state's proc root (the host's /proc); inside a
    // PID namespace, getpid() is not that pid, but `self` in the host's procfs is.
    let own_pid = std::process::id();
    let proc = ProcFs::open(&state.proc_root).ok();
    let pid = proc.as_ref().and_then(ProcFs::self_pid).unwrap_or(own_pid);
    let start_ticks = proc
        .as_ref()
        .and_then(|p| p.stat_of(ProcDir::Reader).ok()?.ok()?.start_ticks)
        .unwrap_or(0);
    let lock = crate::context::lock_offset(pid, start_ticks);
    let mut files = open_device_files(&spec, &state, lock)?;
    if !spec.holds.is_empty() {
        register_allocations(&spec, proc.as_ref(), pid, own_pid, lock)?;
    }
    if let Some(path) = &spec.share_fds_on {
        let dups = files
            .iter()
            .map(File::try_clone)
            .collect::<std::io::Result<Vec<_>>>()
            .context("duplicating the device files")?;
        crate::fdpass::serve_once(path, dups, pid)
            .with_context(|| format!("serving the device files on {}", path.display()))?;
    }
    if let Some(path) = &spec.receive_fds_from {
        files.extend(receive_device_files(path)?);
    }
    let (mut worker_pids, children) = start_workers(&spec, own_pid)?;
    // Forked children share the device files' open file descriptions, and with them the
    // context locks: nothing to register.
    // Reported as `proc_root` numbers them, as the holder's own pid is: in a PID namespace,
    // fork() gives the number there.
    let forked = fork_workers(spec.forked_workers, spec.lifetime_ms)?;
    worker_pids.extend(
        forked
            .into_iter()
            .map(|inner| pid_in_proc_root(proc.as_ref(), pid, inner)),
    );
    let deadline = Instant::now() + Duration::from_millis(spec.lifetime_ms);
    if let Some(ready) = &spec.ready_file {
        let text = serde_json::to_string(&Ready {
            pid,
            workers: worker_pids,
        })
        .context("encoding readiness")?;
        store::write_atomic(ready, text.as_bytes())
            .with_context(|| format!("writing {}", ready.display()))?;
    }
    // Children are not waited for: when this process dies they are re-parented, which is
    // the point. They end by their own lifetime.
    std::mem::forget(children);
    if spec.cpu_percent > 0 {
        let busy = Duration::from_millis(u64::from(spec.cpu_percent.min(100)));
        std::thread::spawn(move || burn_cpu(busy, deadline));
    }
    match spec.shape {
        None => {}
        Some(Shape::ZombieLeader) => zombie_leader(deadline, false),
        Some(Shape::ZombieLeaderStuckInD) => zombie_leader(deadline, true),
    }
    sleep_until(deadline);
    drop(files);
    Ok(())
}

/// Takes the command name, session or process group and signal dispositions the spec asks
/// for.
fn take_identity(spec: &HolderSpec) -> Result<()> {
    // A real `python3 train.py` has the command name python3: take it from argv[0] unless
    // the spec names one (the kernel would show `vramguard`, the executable's name).
    let argv0 = std::env::args_os()
        .next()
        .map(|a| {
            a.to_string_lossy()
                .rsplit('/')
                .next()
                .unwrap_or("")
                .to_string()
        })
        .filter(|a| !a.is_empty());
    if let Some(comm) = spec.comm_bytes.as_deref() {
        set_comm(comm);
    } else if let Some(comm) = spec.comm.as_ref().or(argv0.as_ref()) {
        set_comm(comm.as_bytes());
    }
    if spec.new_session {
        rustix::process::setsid().context("setsid")?;
    } else if spec.group_leader {
        // A session leader (`setsid vramguard sim hold`) leads its process group already and
        // may not move it: setpgid would fail with EPERM.
        // getsid through libc: when the session leader lives outside this PID namespace
        // (a CI runner's container), the kernel answers 0, which rustix's `Pid` refuses with
        // a panic.
        // SAFETY: getsid(0) and getpid() read this process's own ids.
        let (session, me) = unsafe { (libc::getsid(0), libc::getpid()) };
        if session != me {
            rustix::process::setpgid(None, None).context("setpgid")?;
        }
    }
    if spec.ignore_term {
        // SAFETY: installing SIG_IGN has no handler code to run.
        unsafe { libc::signal(libc::SIGTERM, libc::SIG_IGN) };
    }
    Ok(())
}

/// Opens the device files a process with these holdings has open: the control device for
/// every client, unified memory for a CUDA context, and each GPU's file; creates the context
/// on each GPU it allocates on by taking the lock at `lock` on that GPU's file (see
/// [`crate::context`]), before the allocation is registered.
fn open_device_files(spec: &HolderSpec, state: &SimState, lock: u64) -> Result<Vec<File>> {
    let mut files: Vec<File> = Vec::new();
    let open = |name: String| -> Result<File> {
        let path = state.dev_dir.join(&name);
        File::open(&path).with_context(|| format!("opening {}", path.display()))
    };
    // Every client opens the control device; only a CUDA context opens unified memory. A
    // holder that only opens GPUs is an NVML client (a monitor, the persistence daemon).
    if !spec.holds.is_empty() || !spec.open_gpus.is_empty() {
        files.push(open("nvidiactl".into())?);
    }
    // Driver 580's NVML opens unified memory too (`nvml_client_files` models that driver).
    let nvml_client = spec.holds.is_empty() && !spec.open_gpus.is_empty();
    if !spec.holds.is_empty() || (nvml_client && state.nvml_client_files) {
        files.push(open("nvidia-uvm".into())?);
    }
    // A CUDA process maps the CUDA driver library (its forked children inherit the mapping);
    // an NVML client maps the NVML library only. Kept for the process's life, as a loaded
    // library is.
    let library = if !spec.holds.is_empty() {
        Some(crate::library::Library::Cuda)
    } else if !spec.open_gpus.is_empty() {
        Some(crate::library::Library::Nvml)
    } else {
        None
    };
    if let Some(library) = library {
        crate::library::map(&state.dev_dir, library)
            .with_context(|| format!("mapping the stand-in for {library:?}"))?
            .keep();
    }
    let mut gpus: Vec<u32> = spec
        .holds
        .iter()
        .map(|h| h.gpu)
        .chain(spec.open_gpus.iter().copied())
        .collect();
    gpus.sort_unstable();
    gpus.dedup();
    for g in gpus {
        let name = format!("nvidia{g}");
        let file = open(name.clone())?;
        if spec.holds.iter().any(|h| h.gpu == g) {
            crate::context::take(&file, lock).with_context(|| {
                format!(
                    "creating the context on GPU {g}: OFD lock at {lock} on {}",
                    state.dev_dir.join(&name).display()
                )
            })?;
        }
        files.push(file);
    }
    Ok(files)
}

/// Registers the spec's allocations with the model, as `pid`, each with its context's lock.
fn register_allocations(
    spec: &HolderSpec,
    proc: Option<&ProcFs>,
    pid: u32,
    own_pid: u32,
    lock: u64,
) -> Result<()> {
    let namespace = proc.and_then(own_namespace);
    store::update_state(&spec.state, |s| {
        for h in &spec.holds {
            let gpu_default = s
                .gpus
                .get(h.gpu as usize)
                .map(|g| g.after_exit)
                .unwrap_or_default();
            s.allocations.push(SimAllocation {
                gpu: h.gpu,
                pid,
                bytes: h.bytes,
                kind: h.kind,
                after_exit: h.after_exit.unwrap_or(gpu_default),
                listed: h.listed,
                reported_pid: if h.report_namespace_pid {
                    Some(own_pid)
                } else {
                    h.reported_pid
                },
                sm_util: h.sm_util,
                mem_util: 0,
                held_by: vec![],
                mig_device: h.mig_device,
                context_lock: Some(lock),
                namespace: namespace.clone(),
            });
        }
    })
    .context("registering allocations")?;
    Ok(())
}

/// Starts the spec's workers, each ready before the next; returns their pids and handles.
fn start_workers(spec: &HolderSpec, own_pid: u32) -> Result<(Vec<u32>, Vec<std::process::Child>)> {
    let mut worker_pids = Vec::new();
    let mut children = Vec::new();
    for (i, w) in spec.workers.iter().enumerate() {
        let mut ws = w.spec.clone();
        let ready = spec
            .ready_file
            .as_ref()
            .map(|r| PathBuf::from(format!("{}.w{i}", r.display())))
            .unwrap_or_else(|| {
                std::env::temp_dir().join(format!("vramguard-holder-{own_pid}.w{i}"))
            });
        ws.ready_file = Some(ready.clone());
        let child = match &w.spec.argv_bytes {
            Some(raw) => {
                use std::os::unix::ffi::OsStrExt;
                let argv: Vec<&std::ffi::OsStr> =
                    raw.iter().map(|a| std::ffi::OsStr::from_bytes(a)).collect();
                spawn(&argv, &ws)?
            }
            None => spawn(&w.argv, &ws)?,
        };
        worker_pids.push(wait_ready(&ready, Duration::from_secs(20))?.pid);
        children.push(child);
    }
    Ok((worker_pids, children))
}

/// Receives a sender's device files over the socket at `path` (waiting up to 20 s for it to
/// appear): their open file descriptions, and with them the sender's contexts, which live
/// while this process keeps them.
fn receive_device_files(path: &Path) -> Result<Vec<File>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let (_sender, files) = loop {
        match crate::fdpass::receive(path) {
            Ok(got) => break got,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("receiving device files from {}", path.display()));
            }
        }
    };
    Ok(files)
}

/// Forks `count` children that never exec: they keep every file and context this process has
/// and sleep until the lifetime is over (or they are killed). Returns their pids.
fn fork_workers(count: u32, lifetime_ms: u64) -> Result<Vec<u32>> {
    let mut pids = Vec::new();
    for _ in 0..count {
        // SAFETY: the child makes only async-signal-safe calls (alarm, pause) until it dies.
        match unsafe { libc::fork() } {
            0 => unsafe {
                libc::alarm(lifetime_ms.div_ceil(1000).max(1) as u32);
                loop {
                    libc::pause();
                }
            },
            -1 => return Err(std::io::Error::last_os_error()).context("fork"),
            child => pids.push(child as u32),
        }
    }
    Ok(pids)
}

/// This process's place in the PID namespaces, from `proc_root/self`; `None` when unreadable.
fn own_namespace(proc: &ProcFs) -> Option<crate::state::HolderNamespace> {
    let nspid = proc.namespace_pids(ProcDir::Reader)?;
    let pid_ns = proc.pid_namespace(ProcDir::Reader)?.ino;
    Some(crate::state::HolderNamespace { nspid, pid_ns })
}

/// The pid in `proc_root`'s namespace of this process's child `inner` (its pid in our
/// namespace), found among our children as `proc_root` lists them; `inner` itself when not
/// found (in `proc_root`'s namespace the two are the same).
fn pid_in_proc_root(proc: Option<&ProcFs>, own: u32, inner: u32) -> u32 {
    proc.and_then(|proc| {
        proc.children(own).ok().flatten()?.into_iter().find(|&c| {
            proc.namespace_pids(ProcDir::Pid(c))
                .is_some_and(|n| n.last() == Some(&inner))
        })
    })
    .unwrap_or(inner)
}

/// Spins for `busy` out of every 100 ms until the deadline.
fn burn_cpu(busy: Duration, deadline: Instant) {
    let period = Duration::from_millis(100);
    while Instant::now() < deadline {
        let start = Instant::now();
        let mut x = 0u64;
        while start.elapsed() < busy {
            x = std::hint::black_box(x.wrapping_add(1));
        }
        if let Some(rest) = period.checked_sub(start.elapsed()) {
            std::thread::sleep(rest);
        }
    }
}

fn sleep_until(deadline: Instant) {
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        std::thread::sleep(left.min(Duration::from_secs(1)));
    }
}

/// Leaves a thread running (or stuck in D) and ends the main thread alone.
fn zombie_leader(deadline: Instant, stuck: bool) -> ! {
    std::thread::spawn(move || {
        if stuck {
            vfork_wait(deadline);
        }
        sleep_until(deadline);
        std::process::exit(0);
    });
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: SYS_exit ends only the calling thread; the process lives on in the other one.
    unsafe { libc::syscall(libc::SYS_exit, 0) };
    unreachable!("SYS_exit returned")
}

/// Blocks this thread in `vfork` completion (state D) until the child exits. The child shares
/// our memory, so it only makes raw system calls: it closes every inherited fd (it must not
/// hold the device), dies with the waiting thread, and gives up by itself at the deadline.
fn vfork_wait(deadline: Instant) {
    extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
        let secs = arg as libc::c_uint;
        // SAFETY: raw system calls only; no allocation, no locks.
        unsafe {
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            );
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
            libc::alarm(secs.max(1));
            loop {
                libc::pause();
            }
        }
    }
    const STACK: usize = 64 * 1024;
    let mut stack = vec![0u8; STACK];
    let secs = deadline.saturating_duration_since(Instant::now()).as_secs() as usize;
    // SAFETY: the stack outlives the child (this thread waits for it); the flags make the
    // kernel suspend this thread until the child exits.
    unsafe {
        let top = stack.as_mut_ptr().add(STACK) as *mut libc::c_void;
        libc::clone(
            child,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            secs as *mut libc::c_void,
        );
    }
    drop(stack);
}
