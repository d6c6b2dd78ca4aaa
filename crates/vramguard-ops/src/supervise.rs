//! `vramguard run`: a supervisor that guarantees the job's whole process tree is gone when the
//! job ends, in the manner of tini.
//!
//! - No asynchronous signal handlers: the forwarded signals and SIGCHLD are blocked, then
//!   consumed with `sigtimedwait` in the main loop; children are reaped with
//!   `waitpid(-1, WNOHANG)` in a loop. The job starts with an empty signal mask.
//! - The job runs in its own process group, and in its own cgroup v2 leaf when the cgroup
//!   tree is writable; vramguard is a child subreaper either way, so a descendant that escapes
//!   with `setsid`, `setpgrp` or a double fork is re-parented to it and still found.
//! - When the main process exits, or at the first SIGTERM/SIGINT: SIGTERM to every remaining
//!   descendant, `grace`, then SIGKILL (`cgroup.kill` in a cgroup: race-free, it catches
//!   processes forked during the kill; else repeated passes until none is left).
//! - If vramguard itself is SIGKILLed: the direct child gets SIGKILL (`PR_SET_PDEATHSIG`, set
//!   in the child and checked against `getppid` right after), and a watchdog process holding
//!   a pidfd of vramguard kills the job's cgroup (or, without one, the job's process group).

use crate::cgroup::{CgroupError, JobCgroup};
use crate::identity::{Identity, verify};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::{CString, OsString};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How the job is contained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Isolation {
    /// A cgroup when the tree is writable, else a process group.
    Auto,
    /// A cgroup v2 leaf (an error if impossible).
    Cgroup,
    /// Its own process group, with vramguard as child subreaper.
    ProcessGroup,
}

/// An isolation mode that is not auto, cgroup or group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?}: expected auto, cgroup or group")]
pub struct UnknownIsolation(pub String);

impl std::str::FromStr for Isolation {
    type Err = UnknownIsolation;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Isolation::Auto),
            "cgroup" => Ok(Isolation::Cgroup),
            "group" | "process-group" => Ok(Isolation::ProcessGroup),
            other => Err(UnknownIsolation(other.to_string())),
        }
    }
}

/// What to run and how.
#[derive(Debug, Clone)]
pub struct SuperviseOptions {
    /// The command, argv[0] first.
    pub argv: Vec<OsString>,
    /// Extra environment (e.g. `CUDA_VISIBLE_DEVICES`).
    pub env: Vec<(OsString, OsString)>,
    /// SIGTERM → SIGKILL.
    pub grace: Duration,
    /// Forward signals to the whole group (or cgroup), not just the main process.
    pub signal_group: bool,
    /// Containment.
    pub isolation: Isolation,
    /// The executable to run as `EXE __watchdog …`; `None`: no watchdog.
    pub watchdog: Option<PathBuf>,
    /// How often `on_tick` is called while the job runs.
    pub tick: Duration,
}

/// How the main process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobEnd {
    /// Exited with this code.
    Exited(i32),
    /// Killed by this signal.
    Signaled(i32),
}

impl JobEnd {
    /// The exit code a shell would report: the code, or 128 + the signal.
    pub fn exit_code(self) -> i32 {
        match self {
            JobEnd::Exited(c) => c,
            JobEnd::Signaled(s) => 128 + s,
        }
    }
}

/// What happened.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Supervised {
    /// The main process's pid.
    pub main_pid: u32,
    /// How it ended.
    pub end: JobEnd,
    /// The containment used.
    pub isolation: Isolation,
    /// Why a cgroup was not used, under `Auto`.
    pub isolation_note: Option<String>,
    /// Signals forwarded to the job, by name, in order.
    pub forwarded: Vec<String>,
    /// Descendants still alive when the shutdown began.
    pub leftovers: usize,
    /// Whether SIGKILL was needed after the grace period.
    pub killed_after_grace: bool,
    /// Processes that survived SIGKILL (threads in D state), described.
    pub stuck: Vec<String>,
    /// Milliseconds from start until the last process of the job was gone.
    pub runtime_ms: u64,
}

/// The job could not be run.
#[derive(Debug, thiserror::Error)]
pub enum SuperviseError {
    /// The command could not be executed; `code` is 127 (not found) or 126 (not executable).
    #[error("cannot execute {program}: {cause}")]
    Spawn {
        /// argv[0].
        program: String,
        /// The cause.
        cause: std::io::Error,
        /// The exit code to use.
        code: i32,
    },
    /// A cgroup was required but could not be created.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// Our own `/proc` could not be opened: the job's tree could not be followed.
    #[error("{0}; vramguard run needs the /proc of its own PID namespace")]
    Proc(#[from] vramguard_proc::ProcError),
    /// Anything else.
    #[error("{0}")]
    Setup(String),
}

const FORWARDED: [libc::c_int; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
];

/// Linux's standard signals by number, without the `SIG` prefix (signal(7), x86-64 and
/// arm64 numbering; 32 and 33 are taken by glibc's threading, real-time signals follow).
const SIGNAL_NAMES: [(libc::c_int, &str); 31] = [
    (libc::SIGHUP, "HUP"),
    (libc::SIGINT, "INT"),
    (libc::SIGQUIT, "QUIT"),
    (libc::SIGILL, "ILL"),
    (libc::SIGTRAP, "TRAP"),
    (libc::SIGABRT, "ABRT"),
    (libc::SIGBUS, "BUS"),
    (libc::SIGFPE, "FPE"),
    (libc::SIGKILL, "KILL"),
    (libc::SIGUSR1, "USR1"),
    (libc::SIGSEGV, "SEGV"),
    (libc::SIGUSR2, "USR2"),
    (libc::SIGPIPE, "PIPE"),
    (libc::SIGALRM, "ALRM"),
    (libc::SIGTERM, "TERM"),
    (libc::SIGSTKFLT, "STKFLT"),
    (libc::SIGCHLD, "CHLD"),
    (libc::SIGCONT, "CONT"),
    (libc::SIGSTOP, "STOP"),
    (libc::SIGTSTP, "TSTP"),
    (libc::SIGTTIN, "TTIN"),
    (libc::SIGTTOU, "TTOU"),
    (libc::SIGURG, "URG"),
    (libc::SIGXCPU, "XCPU"),
    (libc::SIGXFSZ, "XFSZ"),
    (libc::SIGVTALRM, "VTALRM"),
    (libc::SIGPROF, "PROF"),
    (libc::SIGWINCH, "WINCH"),
    (libc::SIGIO, "IO"),
    (libc::SIGPWR, "PWR"),
    (libc::SIGSYS, "SYS"),
];

/// The name of a signal without the `SIG` prefix (`TERM`, `ALRM`, `RTMIN+3`), or `signal N`
/// for a number Linux does not define. The `forwarded` list of a job's ending uses it.
pub fn signal_name(sig: i32) -> String {
    if let Some((_, name)) = SIGNAL_NAMES.iter().find(|(n, _)| *n == sig) {
        return (*name).into();
    }
    let (rtmin, rtmax) = (libc::SIGRTMIN(), libc::SIGRTMAX());
    if sig == rtmax {
        "RTMAX".into()
    } else if sig == rtmin {
        "RTMIN".into()
    } else if sig > rtmin && sig < rtmax {
        format!("RTMIN+{}", sig - rtmin)
    } else {
        format!("signal {sig}")
    }
}

/// A signal as a sentence names it: `SIGALRM`, `SIGRTMIN+3`, or `signal 99` for a number
/// Linux does not define (never `SIGsignal 99`: a real run printed that for SIGALRM).
pub fn describe_signal(sig: i32) -> String {
    let name = signal_name(sig);
    if name.starts_with("signal ") {
        name
    } else {
        format!("SIG{name}")
    }
}

/// The forwarded signals and SIGCHLD, blocked in this thread (and every thread it starts)
/// until dropped. Block them before starting any thread, so that no thread with default
/// dispositions can receive them.
pub struct BlockedSignals {
    set: libc::sigset_t,
    old: libc::sigset_t,
}

impl BlockedSignals {
    /// Blocks them.
    pub fn block() -> BlockedSignals {
        // SAFETY: plain sigset manipulation on locals.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGCHLD);
            for s in FORWARDED {
                libc::sigaddset(&mut set, s);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            BlockedSignals { set, old }
        }
    }

    /// The next pending signal, waiting up to `timeout`.
    fn wait(&self, timeout: Duration) -> Option<i32> {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: the set is initialised; a null siginfo is allowed.
        let sig = unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &ts) };
        (sig > 0).then_some(sig)
    }
}

impl Drop for BlockedSignals {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `block`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut()) };
    }
}

/// Reaps every exited child; returns the main process's end if it was among them.
fn reap(main: u32) -> Option<JobEnd> {
    let mut end = None;
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return end;
        }
        if pid as u32 == main {
            end = Some(if libc::WIFSIGNALED(status) {
                JobEnd::Signaled(libc::WTERMSIG(status))
            } else {
                JobEnd::Exited(libc::WEXITSTATUS(status))
            });
        }
    }
}

/// Every live descendant of `root` through the kernel's children lists, with start times;
/// `None` where those lists do not exist. `root` is the subreaper: a process that exits while
/// the tree is read hands its children to it after its list may have been read, so the walk
/// is made again (a few times at most) while its list names a live child the walk missed.
fn tree_under(
    fs: &vramguard_proc::ProcFs,
    root: u32,
    exclude: &BTreeSet<u32>,
) -> Option<BTreeMap<u32, u64>> {
    let mut tree = tree_pass(fs, root, exclude)?;
    for _ in 0..3 {
        let missed = fs.children(root).ok()??.into_iter().any(|c| {
            !tree.contains_key(&c) && !exclude.contains(&c) && live_start(fs, c).is_some()
        });
        if !missed {
            break;
        }
        tree = tree_pass(fs, root, exclude)?;
    }
    Some(tree)
}

/// The start time of `pid` while it lives: not a zombie, unless its main thread alone exited
/// (`pthread_exit`: the leader shows `Z` while other threads run on, and the process, with
/// its children, is the job's still).
fn live_start(fs: &vramguard_proc::ProcFs, pid: u32) -> Option<u64> {
    let Ok(vramguard_proc::Found::Yes(stat)) = fs.stat(pid) else {
        return None;
    };
    if stat.state == Some('Z') && !threads_run_on(fs, pid) {
        return None;
    }
    stat.start_ticks
}

/// Whether a thread other than the main one of `pid` is alive.
fn threads_run_on(fs: &vramguard_proc::ProcFs, pid: u32) -> bool {
    matches!(fs.threads(pid), Ok(vramguard_proc::Found::Yes(threads))
        if threads.iter().any(|t| t.tid != pid && !matches!(t.state, 'Z' | 'X')))
}

/// One walk of the children lists below `root`.
fn tree_pass(
    fs: &vramguard_proc::ProcFs,
    root: u32,
    exclude: &BTreeSet<u32>,
) -> Option<BTreeMap<u32, u64>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        for c in fs.children(p).ok()?? {
            if exclude.contains(&c) || out.contains_key(&c) || out.len() > 100_000 {
                continue;
            }
            let Ok(vramguard_proc::Found::Yes(stat)) = fs.stat(c) else {
                continue;
            };
            // The pid read from `p`'s children list names `p`'s child only while its parent
            // is `p`: it may have exited since and its pid gone to another process (one
            // re-parented meanwhile turns up under its new parent on the next look).
            if stat.ppid != Some(p) {
                continue;
            }
            // A zombie has handed its children on already; its parent reaps it. Not so a
            // process whose main thread alone exited: it lives, and so may its children.
            if stat.state == Some('Z') && !threads_run_on(fs, c) {
                continue;
            }
            if let Some(start) = stat.start_ticks {
                out.insert(c, start);
                stack.push(c);
            }
        }
    }
    Some(out)
}

/// Every descendant of `root` (through the parent links of every process in `fs`), with
/// start times: for kernels without the children lists.
pub fn descendants(
    fs: &vramguard_proc::ProcFs,
    root: u32,
    exclude: &BTreeSet<u32>,
) -> BTreeMap<u32, u64> {
    let mut children: BTreeMap<u32, Vec<(u32, u64)>> = BTreeMap::new();
    let pids = fs
        .pid_lister()
        .and_then(|mut l| l.list())
        .unwrap_or_default();
    for pid in pids {
        let Ok(vramguard_proc::Found::Yes(stat)) = fs.stat(pid) else {
            continue;
        };
        if stat.state == Some('Z') && !threads_run_on(fs, pid) {
            continue;
        }
        if let (Some(ppid), Some(start)) = (stat.ppid, stat.start_ticks) {
            children.entry(ppid).or_default().push((pid, start));
        }
    }
    let mut out = BTreeMap::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        for &(c, start) in children.get(&p).map(Vec::as_slice).unwrap_or(&[]) {
            if !exclude.contains(&c) && out.insert(c, start).is_none() {
                stack.push(c);
            }
        }
    }
    out
}

struct Job {
    main: u32,
    cgroup: Option<JobCgroup>,
    me: u32,
    exclude: BTreeSet<u32>,
    /// The `/proc` the job's tree is read through (the supervisor's own namespace).
    proc: vramguard_proc::ProcFs,
}

impl Job {
    /// The job's live processes: the cgroup's and every descendant of vramguard. vramguard is
    /// the job's child subreaper, so every process the job ever started is its descendant until
    /// it exits: when this is empty (through the kernel's exact children lists), nothing of the
    /// job is left anywhere.
    fn remaining(&self) -> BTreeMap<u32, u64> {
        let mut all = tree_under(&self.proc, self.me, &self.exclude)
            .unwrap_or_else(|| descendants(&self.proc, self.me, &self.exclude));
        if let Some(cg) = &self.cgroup {
            for pid in cg.pids() {
                if let Some(start) = crate::identity::start_ticks(self.proc.root(), pid) {
                    all.entry(pid).or_insert(start);
                }
            }
        }
        all
    }

    fn pids_now(&self) -> Vec<u32> {
        match &self.cgroup {
            Some(cg) => cg.pids(),
            None => self.remaining().into_keys().collect(),
        }
    }

    /// Signals each remaining process, each verified by pid and start time and pinned, and
    /// still the job's once pinned: a member that exited between the listing and its start
    /// time's read may have left its pid to a process outside the job (red team). A pinned
    /// process keeps its pid while it lives, so a pid the job still lists is that process.
    /// In batches: a pidfd per process of a job of thousands would run into the fd limit.
    fn signal_each(&self, sig: rustix::process::Signal) -> usize {
        self.signal_each_after(sig, || {})
    }

    /// [`Job::signal_each`], running `between` after the first batch is pinned and before the
    /// job is listed again (the window a test needs to reach).
    fn signal_each_after(&self, sig: rustix::process::Signal, between: impl FnOnce()) -> usize {
        let mut between = Some(between);
        let listed: Vec<(u32, u64)> = self.remaining().into_iter().collect();
        let mut signalled = 0;
        for batch in listed.chunks(crate::cgroup::SIGNAL_BATCH) {
            let pinned: Vec<_> = batch
                .iter()
                .filter_map(|&(pid, start_ticks)| {
                    verify(self.proc.root(), Identity { pid, start_ticks })
                        .ok()
                        .map(|v| (pid, v))
                })
                .collect();
            if let Some(f) = between.take() {
                f();
            }
            let still = self.remaining();
            signalled += pinned
                .iter()
                .filter(|(pid, _)| still.contains_key(pid))
                .filter(|(_, v)| v.signal(sig).is_ok())
                .count();
        }
        signalled
    }

    /// Passes `sig` on: to the main process, or its group (its cgroup). Once the main
    /// process is reaped its pid, and with it its group's id, may be another process's:
    /// then only the job's remaining processes get it, each verified by pid and start time,
    /// and nothing when only the main process was to get it.
    fn forward(&self, sig: i32, group: bool, main_reaped: bool) {
        if main_reaped {
            if group && let Some(sig) = rustix::process::Signal::from_named_raw(sig) {
                self.signal_each(sig);
            }
            return;
        }
        if !group {
            // SAFETY: kill(2) on the main pid, our child, not reaped yet (a zombie at most).
            unsafe { libc::kill(self.main as i32, sig) };
            return;
        }
        match &self.cgroup {
            Some(cg) => {
                // Each member pinned and checked still in the cgroup: a pid read from
                // cgroup.procs may be another process's by the time it is signalled.
                if let Some(sig) = rustix::process::Signal::from_named_raw(sig) {
                    cg.signal_members(sig);
                }
            }
            None => {
                // SAFETY: the job's process group; its id is the main pid, not reaped yet, so
                // no other process can have taken it.
                unsafe { libc::kill(-(self.main as i32), sig) };
            }
        }
    }

    /// SIGKILLs the whole job; returns the main process's end when it was reaped meanwhile
    /// (lost, the run waited 5 s more for an end it had already taken and reported SIGKILL
    /// whatever ended the main process).
    fn kill_all(&self) -> Option<JobEnd> {
        if let Some(cg) = &self.cgroup {
            cg.kill();
        }
        // Whatever left the cgroup, or everything without one: passes until none is left, so
        // a process that forks in a loop is caught by the next pass.
        let mut end = None;
        for _ in 0..50 {
            if self.signal_each(rustix::process::Signal::KILL) == 0 {
                break;
            }
            if let Some(e) = reap(self.main) {
                end.get_or_insert(e);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        end
    }
}

fn stuck_report(fs: &vramguard_proc::ProcFs, pids: impl Iterator<Item = u32>) -> Vec<String> {
    pids.map(|pid| {
        let comm = fs.text(pid, "comm").unwrap_or_default();
        let wchan = fs.text(pid, "wchan").unwrap_or_default();
        format!("{pid} ({comm}) in {wchan}")
    })
    .collect()
}

/// The job's containment: a cgroup v2 leaf below ours when one can be made (required with
/// `Isolation::Cgroup`), else a process group; with the reason when `auto` fell back.
fn containment(
    wanted: Isolation,
    me: u32,
) -> Result<(Option<JobCgroup>, Isolation, Option<String>), SuperviseError> {
    Ok(match wanted {
        Isolation::ProcessGroup => (None, Isolation::ProcessGroup, None),
        wanted => match JobCgroup::create(&format!("vramguard-run-{me}")) {
            Ok(cg) => (Some(cg), Isolation::Cgroup, None),
            Err(e) if wanted == Isolation::Cgroup => return Err(e.into()),
            Err(e) => (
                None,
                Isolation::ProcessGroup,
                Some(format!("{e}; using a process group")),
            ),
        },
    })
}

/// Starts the job's main process in its own process group (and in `cgroup`, before it runs
/// anything), with an empty signal mask, SIGINT/SIGQUIT at their defaults, and a death signal
/// tied to vramguard; returns its pid. It is reaped by [`reap`], like every child.
fn spawn_job(
    opts: &SuperviseOptions,
    cgroup: Option<&JobCgroup>,
    me: u32,
) -> Result<u32, SuperviseError> {
    let procs_file = cgroup.map(|cg| {
        CString::new(cg.procs_file().into_os_string().into_encoded_bytes()).expect("no NUL in path")
    });
    let Some((program, args)) = opts.argv.split_first() else {
        return Err(SuperviseError::Setup("no command given".into()));
    };
    let mut cmd = Command::new(program);
    cmd.args(args)
        .envs(opts.env.iter().cloned())
        .process_group(0);
    let parent = me as libc::pid_t;
    // SAFETY: the closure runs between fork and exec and makes only async-signal-safe calls.
    unsafe {
        cmd.pre_exec(move || {
            // The job must not inherit the mask that lets vramguard consume signals with
            // sigtimedwait: blocked signals survive exec, and SIGTERM would stay pending.
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            // A shell without job control starts background jobs with SIGINT and SIGQUIT
            // ignored, and that would survive exec: the Ctrl-C vramguard forwards must reach
            // the job. (SIGHUP is left as it is: `nohup vramguard run` keeps meaning nohup.)
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            if let Some(path) = &procs_file {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
            }
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            );
            // The parent may have died before prctl: then nobody would ever kill us.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            // The terminal goes to the job only when vramguard has it (run in the foreground):
            // taken from a shell that ran `vramguard run … &`, the shell's next read fails and
            // it exits, and the session's end hangs the job up (red team).
            if libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgid(parent) {
                libc::signal(libc::SIGTTOU, libc::SIG_IGN);
                libc::tcsetpgrp(0, libc::getpid());
                libc::signal(libc::SIGTTOU, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    match cmd.spawn() {
        Ok(child) => {
            let main = child.id();
            // The Child handle is not waited on: reaping happens in `reap`, for every child alike.
            std::mem::forget(child);
            Ok(main)
        }
        Err(cause) => Err(SuperviseError::Spawn {
            program: program.to_string_lossy().into_owned(),
            code: if cause.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            },
            cause,
        }),
    }
}

/// The watchdog: a process of its own that kills the job (its cgroup, or its group) if
/// vramguard dies without doing so.
fn start_watchdog(
    opts: &SuperviseOptions,
    me: u32,
    main: u32,
    proc_root: &Path,
    cgroup: Option<&JobCgroup>,
) -> Option<Child> {
    // Read while `main` is our unreaped child, so surely the job's main process: the
    // watchdog kills its group only while the pid is not another process's.
    let main_start = crate::identity::start_ticks(proc_root, main);
    opts.watchdog.as_ref().and_then(|exe| {
        let mut w = Command::new(exe);
        // SAFETY: only sigprocmask between fork and exec.
        unsafe {
            w.pre_exec(|| {
                let mut empty: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut empty);
                libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
                Ok(())
            });
        }
        w.arg("__watchdog")
            .arg("--parent")
            .arg(me.to_string())
            .arg("--pgid")
            .arg(main.to_string())
            .stdin(Stdio::null())
            .process_group(0);
        if let Some(start) = main_start {
            w.arg("--pgid-start").arg(start.to_string());
        }
        if let Some(cg) = cgroup {
            w.arg("--cgroup").arg(cg.dir());
        }
        w.spawn().ok()
    })
}

/// Runs and supervises the job. `on_tick` sees the job's pids periodically while it runs.
pub fn supervise(
    opts: &SuperviseOptions,
    on_tick: &mut dyn FnMut(&[u32]),
) -> Result<Supervised, SuperviseError> {
    let started = Instant::now();
    let me = std::process::id();
    // The job's tree is read through our own namespace's /proc, opened before anything starts.
    let own_proc = vramguard_proc::ProcFs::own()?;
    let signals = BlockedSignals::block();
    // Descendants that escape (setsid, double fork) are re-parented to us, not to init.
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .map_err(|e| SuperviseError::Setup(format!("PR_SET_CHILD_SUBREAPER: {e}")))?;

    let (cgroup, isolation, isolation_note) = containment(opts.isolation, me)?;
    let main = match spawn_job(opts, cgroup.as_ref(), me) {
        Ok(main) => main,
        Err(e) => {
            if let Some(cg) = &cgroup {
                cg.remove();
            }
            return Err(e);
        }
    };
    let mut watchdog = start_watchdog(opts, me, main, own_proc.root(), cgroup.as_ref());
    // Pinned while it is our unreaped child: `reap` collects any child of ours (waitpid -1),
    // the watchdog too if it ever ends early, and a kill(2) of its pid after that could
    // reach another process.
    let watchdog_pidfd = watchdog.as_ref().and_then(|w| {
        rustix::process::pidfd_open(
            rustix::process::Pid::from_raw(w.id() as i32)?,
            rustix::process::PidfdFlags::empty(),
        )
        .ok()
    });
    let mut exclude = BTreeSet::new();
    if let Some(w) = &watchdog {
        exclude.insert(w.id());
    }
    let mut job = Job {
        main,
        cgroup,
        me,
        exclude,
        proc: own_proc,
    };

    let mut phase = Phase::Running;
    let mut ending = Ending::default();
    let mut last_tick = Instant::now();
    loop {
        let timeout = match phase {
            Phase::Running => opts.tick,
            _ => Duration::from_millis(20),
        };
        match signals.wait(timeout) {
            Some(libc::SIGCHLD) => {}
            Some(sig) => {
                job.forward(sig, opts.signal_group, ending.end.is_some());
                ending.forwarded.push(signal_name(sig));
                if matches!(sig, libc::SIGTERM | libc::SIGINT) && matches!(phase, Phase::Running) {
                    phase = Phase::Terminating(Instant::now() + opts.grace);
                }
            }
            None => {}
        }
        // Once reaped, the main pid may be another process's, and that one may end up our
        // child too (re-parented to the subreaper): its end is not the job's.
        ending.record(reap(main));
        // A watchdog that ended early is reaped with the job's children (waitpid -1): its pid
        // is then free for a process of the job, which the walk must not skip (red team).
        if let Some(fd) = &watchdog_pidfd
            && !job.exclude.is_empty()
            && has_exited(fd)
        {
            job.exclude.clear();
        }
        if matches!(phase, Phase::Running) && last_tick.elapsed() >= opts.tick {
            on_tick(&job.pids_now());
            last_tick = Instant::now();
        }
        if advance(&mut phase, &job, &mut ending, opts.grace) {
            break;
        }
    }
    if let Some(cg) = &job.cgroup
        && cg.wait_empty(Duration::from_secs(2))
    {
        cg.remove();
    }
    if let Some(w) = watchdog.as_mut() {
        match &watchdog_pidfd {
            Some(fd) => {
                let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL);
                // Its end, then a reap that never blocks: if `reap` took it already, its pid
                // may be another child of ours by now.
                let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
                let second = rustix::event::Timespec {
                    tv_sec: 1,
                    tv_nsec: 0,
                };
                let _ = rustix::event::poll(&mut fds, Some(&second));
                let _ = w.try_wait();
            }
            None => {
                // Without a pidfd, by pid only while that pid is an unreaped child of ours:
                // `reap` may have taken the watchdog, and its pid be an outsider's by now.
                if matches!(w.try_wait(), Ok(None)) {
                    let _ = w.kill();
                    let _ = w.wait();
                }
            }
        }
    }
    drop(signals);
    Ok(Supervised {
        main_pid: main,
        end: ending
            .end
            .expect("the loop ends only once the main process has ended"),
        isolation,
        isolation_note,
        forwarded: ending.forwarded,
        leftovers: ending.leftovers,
        killed_after_grace: ending.killed_after_grace,
        stuck: ending.stuck,
        runtime_ms: started.elapsed().as_millis() as u64,
    })
}

/// Whether the process behind `pidfd` has exited (its pidfd is readable).
fn has_exited(pidfd: &std::os::fd::OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let now = rustix::event::Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    poll(&mut fds, Some(&now)).is_ok() && fds[0].revents().contains(PollFlags::IN)
}

/// Where the job is in its end.
enum Phase {
    /// The main process runs (or just ended).
    Running,
    /// What is left got SIGTERM; SIGKILL at the deadline.
    Terminating(Instant),
    /// What is left got SIGKILL, at that time.
    Killing(Instant),
}

/// What the supervision learnt about the job's end.
#[derive(Default)]
struct Ending {
    end: Option<JobEnd>,
    forwarded: Vec<String>,
    leftovers: usize,
    killed_after_grace: bool,
    stuck: Vec<String>,
}

impl Ending {
    /// Keeps the first end reaped: until then the main pid is our unreaped child, so a pid
    /// reaped under it is the main process; after, it may be another's (re-parented to us).
    fn record(&mut self, end: Option<JobEnd>) {
        if self.end.is_none() {
            self.end = end;
        }
    }
}

/// One step of the job's end: SIGTERM to what outlives the main process, SIGKILL after
/// `grace`, and after 5 s of SIGKILL the report of what survived it. True when done.
fn advance(phase: &mut Phase, job: &Job, ending: &mut Ending, grace: Duration) -> bool {
    match *phase {
        Phase::Running if ending.end.is_some() => {
            let rest = job.remaining();
            if rest.is_empty() {
                return true;
            }
            ending.leftovers = rest.len();
            job.signal_each(rustix::process::Signal::TERM);
            *phase = Phase::Terminating(Instant::now() + grace);
        }
        Phase::Running => {}
        Phase::Terminating(deadline) => {
            let rest = job.remaining();
            if ending.end.is_some() && rest.is_empty() {
                return true;
            }
            if ending.leftovers == 0 {
                ending.leftovers = rest.len().saturating_sub(usize::from(ending.end.is_none()));
            }
            if Instant::now() >= deadline {
                ending.killed_after_grace = !rest.is_empty();
                ending.record(job.kill_all());
                *phase = Phase::Killing(Instant::now());
            }
        }
        Phase::Killing(since) => {
            let rest = job.remaining();
            if ending.end.is_some() && rest.is_empty() {
                return true;
            }
            if since.elapsed() > Duration::from_secs(5) {
                ending.stuck = stuck_report(&job.proc, rest.into_keys());
                if ending.end.is_none() {
                    ending.end = Some(JobEnd::Signaled(libc::SIGKILL));
                }
                return true;
            }
            ending.record(job.kill_all());
        }
    }
    false
}

/// The watchdog: waits for `parent` to die (pidfd), then kills the job's cgroup, and the
/// job's process group (a member that moved itself out of the cgroup is in it still). Runs as
/// its own process, so that it survives a SIGKILL of vramguard; vramguard kills it when the
/// job ends normally.
///
/// `pgid_start` is the start time of the group's leader (the job's main process). A process
/// that now has the group's pid but another start time took a pid the kernel freed, which it
/// does only once no process is left in the group: the job's group is gone, and that process
/// and its group (if it made one) are someone else's, so nothing is signalled. The group is
/// never signalled by its id (`kill(-pgid)`): between the check and the kill its last member
/// could exit and another process take the id (red team); each member is pinned first.
pub fn watchdog(parent: u32, pgid: u32, pgid_start: Option<u64>, cgroup: Option<&Path>) -> ! {
    // A pgid of 0 or 1 (`kill(0)`, init's group) or past a pid's range is no job's: refused
    // before anything (the command is internal, but typed by hand it must not kill).
    if !may_be_a_jobs_group(pgid) {
        eprintln!("vramguard watchdog: {pgid} is no job's process group: nothing watched");
        std::process::exit(2);
    }
    // A parent that is no pid could not be watched, and a failure to watch is never taken
    // for its death.
    if parent == 0 || parent > i32::MAX as u32 {
        eprintln!("vramguard watchdog: {parent} is no process to watch: nothing watched");
        std::process::exit(2);
    }
    // SAFETY: ignoring signals installs no handler code. A Ctrl-C meant for vramguard must not
    // take the watchdog down with it.
    unsafe {
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT] {
            libc::signal(s, libc::SIG_IGN);
        }
    }
    wait_for_death_of(parent);
    if let Some(dir) = cgroup {
        let cg = JobCgroup::at(dir.to_path_buf());
        cg.kill();
        if cg.wait_empty(Duration::from_secs(5)) {
            cg.remove();
        }
    }
    match vramguard_proc::ProcFs::own() {
        Ok(fs) => {
            // SAFETY: getsid(0) reads this process's session id. The job's group was made in
            // vramguard's session, which the watchdog shares (it only has a group of its own).
            let session = unsafe { libc::getsid(0) } as u32;
            match kill_group_members(&fs, pgid, pgid_start, session, || {}) {
                GroupKill::Refused => eprintln!(
                    "vramguard watchdog: pid {pgid} is now another process (the job's process \
                     group is gone): nothing signalled"
                ),
                GroupKill::Killed(_) => {}
            }
        }
        Err(e) => eprintln!(
            "vramguard watchdog: cannot read /proc ({e}): the job's process \
                             group was not signalled"
        ),
    }
    std::process::exit(0)
}

/// Whether `pgid` can be a job's process group: not 0 (`kill(0)` is the caller's own group),
/// not 1 (init's), and a pid (`kill(-pgid)` of a larger number is `kill(-1)`'s kin).
fn may_be_a_jobs_group(pgid: u32) -> bool {
    pgid > 1 && pgid <= i32::MAX as u32
}

/// Returns once `parent` has died: its pidfd turns readable; without a pidfd (a kernel before
/// 5.3, or no descriptor left), once this process's parent is no longer `parent`. A failure
/// to watch is never taken for a death: that would kill a job whose supervisor runs.
fn wait_for_death_of(parent: u32) {
    use rustix::event::{PollFd, PollFlags, poll};
    let Some(p) = rustix::process::Pid::from_raw(parent as i32) else {
        return;
    };
    match rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => loop {
            let mut fds = [PollFd::new(&fd, PollFlags::IN)];
            if poll(&mut fds, None).is_ok() && fds[0].revents().contains(PollFlags::IN) {
                return;
            }
        },
        Err(rustix::io::Errno::SRCH) => {}
        Err(_) => {
            while rustix::process::getppid() == Some(p) {
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// What [`kill_group_members`] did.
#[derive(Debug, PartialEq, Eq)]
enum GroupKill {
    /// The group's id is another process's now: nothing was signalled.
    Refused,
    /// This many members got SIGKILL.
    Killed(usize),
}

/// SIGKILLs every live member of process group `pgid` in `session`, without ever naming the
/// group to the kernel: each member found in `/proc` is pinned (pidfd, start time checked),
/// then the group's leader pid is checked to be the job's main process or no process (a
/// group's id is not freed while a member is in it, so a member pinned while that holds is
/// the job's), and only then are the pinned members signalled. Made again while members are
/// found (one may have forked meanwhile), a few times at most. `between` runs after the first
/// pinning, before the leader's check (the window a test needs to reach).
fn kill_group_members(
    fs: &vramguard_proc::ProcFs,
    pgid: u32,
    pgid_start: Option<u64>,
    session: u32,
    between: impl FnOnce(),
) -> GroupKill {
    let mut between = Some(between);
    let mut killed = 0;
    for _ in 0..10 {
        let members: Vec<(u32, u64)> = fs
            .pid_lister()
            .and_then(|mut l| l.list())
            .unwrap_or_default()
            .into_iter()
            .filter_map(|pid| {
                let Ok(vramguard_proc::Found::Yes(st)) = fs.stat(pid) else {
                    return None;
                };
                if st.pgid != Some(pgid) || st.sid != Some(session) {
                    return None;
                }
                // The start time from the same read as the group: read again, it could be
                // another process's that took the pid meanwhile (which `verify` would pin).
                if st.state == Some('Z') && !threads_run_on(fs, pid) {
                    return None;
                }
                Some((pid, st.start_ticks?))
            })
            .collect();
        if members.is_empty() {
            break;
        }
        let mut pass = 0;
        for batch in members.chunks(crate::cgroup::SIGNAL_BATCH) {
            let pinned: Vec<_> = batch
                .iter()
                .filter_map(|&(pid, start_ticks)| {
                    verify(fs.root(), Identity { pid, start_ticks }).ok()
                })
                .collect();
            if let Some(f) = between.take() {
                f();
            }
            let leader_now = crate::identity::start_ticks(fs.root(), pgid);
            if !group_is_the_jobs(pgid_start, leader_now) {
                return if killed == 0 {
                    GroupKill::Refused
                } else {
                    GroupKill::Killed(killed)
                };
            }
            pass += pinned
                .iter()
                .filter(|v| v.signal(rustix::process::Signal::KILL).is_ok())
                .count();
        }
        killed += pass;
        if pass == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    GroupKill::Killed(killed)
}

/// Whether the process group `pgid` may still be the job's: its leader is the job's main
/// process (same start time), or no process has that pid (the leader is gone; the pid stays
/// reserved while any member is left). Without the main process's start time, as before.
fn group_is_the_jobs(main_start: Option<u64>, leader_now: Option<u64>) -> bool {
    match (main_start, leader_now) {
        (Some(then), Some(now)) => then == now,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::{
        GroupKill, describe_signal, group_is_the_jobs, kill_group_members, may_be_a_jobs_group,
        signal_name, tree_under,
    };
    use std::os::unix::process::CommandExt;

    /// A `sleep 60` killed by pid and reaped however the test ends.
    struct Sleeper(std::process::Child);

    impl Drop for Sleeper {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn sleeper(group: Option<u32>, new_session: bool) -> Sleeper {
        let mut c = std::process::Command::new("sleep");
        c.arg("60");
        if let Some(g) = group {
            c.process_group(g as i32);
        }
        if new_session {
            // SAFETY: setsid between fork and exec.
            unsafe {
                c.pre_exec(|| {
                    libc::setsid();
                    Ok(())
                });
            }
        }
        Sleeper(c.spawn().unwrap())
    }

    fn own_session() -> u32 {
        // SAFETY: getsid(0) reads this process's session id.
        unsafe { libc::getsid(0) as u32 }
    }

    fn start_of(pid: u32) -> Option<u64> {
        crate::identity::start_ticks(std::path::Path::new(vramguard_proc::OWN_PROC), pid)
    }

    /// The watchdog's kill of a group whose leader is gone: the member left is pinned and
    /// killed (the group's id is reserved while it lives).
    #[test]
    fn the_watchdog_kills_the_members_of_a_job_group_whose_leader_is_gone() {
        let fs = vramguard_proc::ProcFs::own().unwrap();
        let mut leader = sleeper(Some(0), false);
        let pgid = leader.0.id();
        let leader_start = start_of(pgid);
        let mut member = sleeper(Some(pgid), false);
        leader.0.kill().unwrap();
        leader.0.wait().unwrap();
        let done = kill_group_members(&fs, pgid, leader_start, own_session(), || {});
        // At least once (a member slow to die under load is signalled again the next round).
        assert!(matches!(done, GroupKill::Killed(n) if n >= 1), "{done:?}");
        let status = member.0.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }

    /// The group's leader pid is another process now (start time differs): nothing is
    /// signalled, checked after the members were pinned.
    #[test]
    fn the_watchdog_spares_a_group_led_by_another_process_now() {
        let fs = vramguard_proc::ProcFs::own().unwrap();
        let mut other = sleeper(Some(0), false);
        let pgid = other.0.id();
        let mut member = sleeper(Some(pgid), false);
        let wrong = start_of(pgid).unwrap() + 1;
        let mut checked = false;
        let done = kill_group_members(&fs, pgid, Some(wrong), own_session(), || checked = true);
        assert_eq!(done, GroupKill::Refused);
        assert!(checked, "the leader is checked after the pinning");
        assert!(other.0.try_wait().unwrap().is_none(), "the leader lives");
        assert!(member.0.try_wait().unwrap().is_none(), "its member lives");
    }

    /// A group of another session is no job's group (the job's was made in vramguard's):
    /// even without the leader's start time to compare, its processes get nothing. Signalled
    /// by its id, as before, it was killed.
    #[test]
    fn the_watchdog_spares_a_group_of_another_session() {
        let fs = vramguard_proc::ProcFs::own().unwrap();
        let mut other = sleeper(None, true);
        let pgid = other.0.id();
        assert!(start_of(pgid).is_some());
        let done = kill_group_members(&fs, pgid, None, own_session(), || {});
        assert_eq!(done, GroupKill::Killed(0));
        assert!(
            other.0.try_wait().unwrap().is_none(),
            "another session's leader lives"
        );
    }

    #[test]
    fn the_watchdog_refuses_a_group_id_no_job_can_have() {
        for pgid in [0, 1, i32::MAX as u32 + 1, u32::MAX] {
            assert!(!may_be_a_jobs_group(pgid), "{pgid}");
        }
        assert!(may_be_a_jobs_group(2));
        assert!(may_be_a_jobs_group(i32::MAX as u32));
    }

    /// Red team: a pid the job's cgroup listed whose process exited, the pid then taken by a
    /// process outside the job before its start time was read, is not signalled: the job is
    /// listed again once each process is pinned, and only pids still listed get the signal.
    /// Without that second look, the outsider got the job's SIGTERM.
    #[test]
    fn a_pid_that_left_the_cgroup_once_pinned_is_not_signalled() {
        use std::os::unix::process::ExitStatusExt;
        let mut outsider = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let me = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let procs = dir.path().join("cgroup.procs");
        std::fs::write(&procs, format!("{}\n", outsider.id())).unwrap();
        let job = super::Job {
            main: me.id(),
            cgroup: Some(crate::cgroup::JobCgroup::at(dir.path().to_path_buf())),
            me: me.id(),
            exclude: std::collections::BTreeSet::new(),
            proc: vramguard_proc::ProcFs::own().unwrap(),
        };
        // The listing named it; by the second look the cgroup no longer does.
        let sent = job.signal_each_after(rustix::process::Signal::TERM, || {
            std::fs::write(&procs, "").unwrap();
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        let status = outsider.try_wait().unwrap();
        let mut me = me;
        let _ = me.kill();
        let _ = me.wait();
        let _ = outsider.kill();
        let _ = outsider.wait();
        assert_eq!(sent, 0);
        assert!(
            status.is_none_or(|s| s.signal() != Some(libc::SIGTERM)),
            "{status:?}"
        );
    }

    /// A fixture process: `(pid, ppid, state, children, other threads (tid, state))`.
    type FixtureProcess<'a> = (u32, u32, char, &'a [u32], &'a [(u32, char)]);

    /// A `/proc` with `(pid, ppid, children)` entries: `stat` and the leader's `children`.
    fn fixture_proc(entries: &[(u32, u32, &[u32])]) -> tempfile::TempDir {
        let with_states: Vec<FixtureProcess<'_>> = entries
            .iter()
            .map(|(pid, ppid, children)| (*pid, *ppid, 'S', *children, &[][..]))
            .collect();
        fixture_proc_with_threads(&with_states)
    }

    /// `stat` text of a process or thread: fields 3.. are state, ppid, then zeros up to
    /// starttime (the 22nd field), then zeros.
    fn stat_text(pid: u32, ppid: u32, state: char) -> String {
        let mut fields = vec![state.to_string(), ppid.to_string()];
        fields.extend((5..=21).map(|_| "0".to_string()));
        fields.push((1000 + pid).to_string());
        fields.extend((23..=52).map(|_| "0".to_string()));
        format!("{pid} (sh) {}\n", fields.join(" "))
    }

    /// Entries `(pid, ppid, state, children, other threads (tid, state))`.
    fn fixture_proc_with_threads(entries: &[FixtureProcess<'_>]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (pid, ppid, state, children, threads) in entries {
            let task = dir.path().join(format!("{pid}/task/{pid}"));
            std::fs::create_dir_all(&task).unwrap();
            let kids: Vec<String> = children.iter().map(|c| c.to_string()).collect();
            std::fs::write(task.join("children"), kids.join(" ")).unwrap();
            std::fs::write(task.join("stat"), stat_text(*pid, *ppid, *state)).unwrap();
            for (tid, tstate) in *threads {
                let t = dir.path().join(format!("{pid}/task/{tid}"));
                std::fs::create_dir_all(&t).unwrap();
                std::fs::write(t.join("children"), "").unwrap();
                std::fs::write(t.join("stat"), stat_text(*tid, *ppid, *tstate)).unwrap();
            }
            std::fs::write(
                dir.path().join(format!("{pid}/stat")),
                stat_text(*pid, *ppid, *state),
            )
            .unwrap();
        }
        dir
    }

    /// A process whose main thread alone exited (`pthread_exit`: its leader `Z`, a thread
    /// running on) is the job's, and so are its children; a true zombie is not (its parent
    /// reaps it).
    #[test]
    fn a_process_whose_main_thread_exited_is_in_the_tree_with_its_children() {
        let dir = fixture_proc_with_threads(&[
            (100, 1, 'S', &[101, 102], &[]),
            (101, 100, 'Z', &[103], &[(111, 'S')]),
            (102, 100, 'Z', &[], &[(112, 'Z')]),
            (103, 101, 'S', &[], &[]),
        ]);
        let fs = vramguard_proc::ProcFs::open(dir.path()).unwrap();
        let tree = tree_under(&fs, 100, &Default::default()).unwrap();
        let pids: Vec<u32> = tree.keys().copied().collect();
        assert_eq!(pids, vec![101, 103]);
    }

    /// A pid in a children list whose process names another parent is not the child (it
    /// exited and its pid went to another process): neither it nor its children are the job.
    #[test]
    fn a_listed_child_whose_parent_is_another_is_not_in_the_tree() {
        let dir = fixture_proc(&[
            (100, 1, &[101, 102]),
            (101, 100, &[103]),
            (102, 55, &[104]),
            (103, 101, &[]),
            (104, 102, &[]),
        ]);
        let fs = vramguard_proc::ProcFs::open(dir.path()).unwrap();
        let tree = tree_under(&fs, 100, &Default::default()).unwrap();
        let pids: Vec<u32> = tree.keys().copied().collect();
        assert_eq!(pids, vec![101, 103]);
        assert_eq!(tree[&101], 1101);
    }

    #[test]
    fn the_watchdog_spares_a_group_whose_pid_another_process_took() {
        assert!(
            group_is_the_jobs(Some(100), Some(100)),
            "the job's main process"
        );
        assert!(
            group_is_the_jobs(Some(100), None),
            "leader gone, members may remain"
        );
        assert!(
            !group_is_the_jobs(Some(100), Some(250)),
            "the pid is another's"
        );
        assert!(group_is_the_jobs(None, Some(250)), "nothing to compare");
    }

    /// A real `vramguard run` printed "was killed by SIGsignal 14" for SIGALRM.
    #[test]
    fn signals_are_named_as_linux_names_them_and_unknown_numbers_by_number() {
        for (sig, name) in [
            (libc::SIGALRM, "SIGALRM"),
            (libc::SIGKILL, "SIGKILL"),
            (libc::SIGTERM, "SIGTERM"),
            (libc::SIGSEGV, "SIGSEGV"),
            (libc::SIGABRT, "SIGABRT"),
            (libc::SIGPIPE, "SIGPIPE"),
            (libc::SIGSYS, "SIGSYS"),
            (libc::SIGRTMIN(), "SIGRTMIN"),
            (libc::SIGRTMIN() + 3, "SIGRTMIN+3"),
            (libc::SIGRTMAX(), "SIGRTMAX"),
            (0, "signal 0"),
            (99, "signal 99"),
            (-5, "signal -5"),
        ] {
            assert_eq!(describe_signal(sig), name, "signal {sig}");
            assert!(!describe_signal(sig).contains("SIGsignal"));
        }
        // The bare names a job's `forwarded` list keeps.
        assert_eq!(signal_name(libc::SIGTERM), "TERM");
        assert_eq!(signal_name(libc::SIGALRM), "ALRM");
    }
}
