//! Reads one `/proc` tree (the live one, or a fixture tree) relative to a root directory.

use crate::devices::DeviceTable;
use crate::parse::{self, ParseError, Stat, Status};
use rustix::fd::{AsRawFd, BorrowedFd, OwnedFd};
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use std::path::{Path, PathBuf};
use vramguard_core::snapshot::{
    DeviceFile, DriverLibrary, ExeFacts, FdScan, PF_EXITING, ThreadFacts,
};

/// Inode number of the initial PID namespace (`PROC_PID_INIT_INO` in the kernel).
const INIT_PID_NS_INODE: &str = "pid:[4026531836]";

/// A `/proc` read that failed for a reason other than the process being gone.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// An I/O error other than "gone" or "denied".
    #[error("reading {path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
    /// The file exists but is not in the format proc(5) describes.
    #[error("{path}: {cause}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        cause: ParseError,
    },
}

/// The outcome of reading something that belongs to one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found<T> {
    /// Read.
    Yes(T),
    /// The process (or thread, or fd) no longer exists: normal, not an error.
    Gone,
    /// Not readable with our privileges: unknown, and said so.
    Denied,
}

impl<T> Found<T> {
    /// The value, if read.
    pub fn ok(self) -> Option<T> {
        match self {
            Found::Yes(v) => Some(v),
            _ => None,
        }
    }
}

/// What an errno means for a `/proc` read. The one place that decides it.
fn triage<T>(
    result: Result<T, Errno>,
    path: impl FnOnce() -> PathBuf,
) -> Result<Found<T>, ProcError> {
    match result {
        Ok(v) => Ok(Found::Yes(v)),
        Err(Errno::NOENT | Errno::SRCH) => Ok(Found::Gone),
        Err(Errno::ACCESS | Errno::PERM) => Ok(Found::Denied),
        Err(e) => Err(ProcError::Io {
            path: path(),
            cause: e.into(),
        }),
    }
}

/// The `/proc` of this process's own PID namespace: the only one through which the pids it
/// signals, supervises or pins mean what they say. Everything else reads a configurable root.
pub const OWN_PROC: &str = "/proc";

/// A process's directory in a `/proc` tree: a pid, or `self`, the reading process by the
/// number the tree's PID namespace gives it (which is not `getpid()` when the tree is another
/// namespace's, or when the reader is not visible in it at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcDir {
    /// `/proc/PID`.
    Pid(u32),
    /// `/proc/self`.
    Reader,
}

impl ProcDir {
    fn rel(self, file: &str) -> String {
        match self {
            ProcDir::Pid(pid) => format!("{pid}/{file}"),
            ProcDir::Reader => format!("self/{file}"),
        }
    }
}

/// A PID namespace, as its nsfs file identifies it (device and inode of `/proc/PID/ns/pid`;
/// the inode is the number in the link's `pid:[N]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NamespaceId {
    /// The nsfs device.
    pub dev: u64,
    /// The namespace's inode.
    pub ino: u64,
}

impl NamespaceId {
    /// The namespace an open nsfs file (from [`ProcFs::open_pid_namespace`], or an
    /// `NS_GET_PARENT` on one) names.
    pub fn of_fd(fd: &OwnedFd) -> Option<NamespaceId> {
        let st = rustix::fs::fstat(fd).ok()?;
        Some(NamespaceId {
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

/// A `/proc` tree.
#[derive(Debug)]
pub struct ProcFs {
    root: PathBuf,
    root_fd: OwnedFd,
}

impl ProcFs {
    /// Opens the tree at `root` (`/proc`, or a fixture directory).
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, ProcError> {
        let root = root.into();
        let root_fd = rustix::fs::open(
            &root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| ProcError::Io {
            path: root.clone(),
            cause: e.into(),
        })?;
        Ok(ProcFs { root, root_fd })
    }

    /// [`OWN_PROC`]: for whatever signals or waits for processes.
    pub fn own() -> Result<Self, ProcError> {
        ProcFs::open(OWN_PROC)
    }

    /// A small text file of a process (`comm`, `wchan`), trimmed; `None` when it is gone or
    /// unreadable.
    pub fn text(&self, pid: u32, file: &str) -> Option<String> {
        self.text_of(&format!("{pid}/{file}"))
            .map(|t| t.trim().to_string())
    }

    /// The cgroup v2 mount point seen by the reading process (`self/mountinfo`):
    /// `/sys/fs/cgroup` on unified hosts, `/sys/fs/cgroup/unified` on hybrid ones.
    pub fn cgroup2_mount(&self) -> Option<PathBuf> {
        let mut buf = Vec::new();
        match self.read_into("self/mountinfo", &mut buf) {
            Ok(Found::Yes(())) => crate::parse::parse_cgroup2_mount(&buf).map(PathBuf::from),
            _ => None,
        }
    }

    /// The reading process's cgroup v2 path (the `0::` line of `self/cgroup`).
    pub fn own_cgroup(&self) -> Option<String> {
        let text = self.text_of("self/cgroup")?;
        text.lines()
            .find_map(|l| l.strip_prefix("0::"))
            .map(|p| p.trim().to_string())
    }

    fn text_of(&self, rel: &str) -> Option<String> {
        let mut buf = Vec::new();
        match self.read_into(rel, &mut buf) {
            Ok(Found::Yes(())) => Some(String::from_utf8_lossy(&buf).into_owned()),
            _ => None,
        }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.root.join(rel)
    }

    fn open_rel(&self, rel: &str, flags: OFlags) -> Result<OwnedFd, Errno> {
        rustix::fs::openat(&self.root_fd, rel, flags | OFlags::CLOEXEC, Mode::empty())
    }

    /// Opens a directory below the root for listing.
    fn open_dir(&self, rel: &str) -> Result<Found<rustix::fs::Dir>, ProcError> {
        let fd = match triage(
            self.open_rel(rel, OFlags::RDONLY | OFlags::DIRECTORY),
            || self.path(rel),
        )? {
            Found::Yes(fd) => fd,
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
        };
        triage(rustix::fs::Dir::new(fd), || self.path(rel))
    }

    /// Reads a whole file below the root into `buf` (cleared first), at most
    /// [`MAX_PROC_FILE`] bytes. Opened non-blocking: in a fixture tree a FIFO reads as empty
    /// instead of stalling, and a link to `/dev/zero` stops at the cap.
    pub fn read_into(&self, rel: &str, buf: &mut Vec<u8>) -> Result<Found<()>, ProcError> {
        self.read_at_most(rel, buf, MAX_PROC_FILE)
    }

    /// [`ProcFs::read_into`], at most `max` bytes.
    fn read_at_most(
        &self,
        rel: &str,
        buf: &mut Vec<u8>,
        max: usize,
    ) -> Result<Found<()>, ProcError> {
        buf.clear();
        let result = self
            .open_rel(rel, OFlags::RDONLY | OFlags::NONBLOCK)
            .and_then(|fd| {
                loop {
                    if buf.len() >= max {
                        buf.truncate(max);
                        return Ok(());
                    }
                    if buf.capacity() - buf.len() < 512 {
                        buf.reserve(4096);
                    }
                    let (filled, _) = rustix::io::read(&fd, buf.spare_capacity_mut())?;
                    if filled.is_empty() {
                        return Ok(());
                    }
                    let n = filled.len();
                    // SAFETY: `read` initialised the first `n` spare bytes.
                    unsafe { buf.set_len(buf.len() + n) };
                }
            });
        triage(result, || self.path(rel))
    }

    fn read(&self, rel: &str) -> Result<Found<Vec<u8>>, ProcError> {
        let mut buf = Vec::new();
        Ok(match self.read_into(rel, &mut buf)? {
            Found::Yes(()) => Found::Yes(buf),
            Found::Gone => Found::Gone,
            Found::Denied => Found::Denied,
        })
    }

    /// `/proc/PID/stat`. An empty file means the process went away while it was read.
    pub fn stat(&self, pid: u32) -> Result<Found<Stat>, ProcError> {
        self.stat_at(&format!("{pid}/stat"))
    }

    /// `stat` of a process directory (`self` included).
    pub fn stat_of(&self, dir: ProcDir) -> Result<Found<Stat>, ProcError> {
        self.stat_at(&dir.rel("stat"))
    }

    /// The process's pid in each PID namespace from this tree's inward (`NSpid` of its
    /// `status`, proc(5)); `None` when it cannot be read (gone, denied, or a kernel without
    /// the line).
    pub fn namespace_pids(&self, dir: ProcDir) -> Option<Vec<u32>> {
        let nspid = self.status_of(dir).ok()?.ok()?.nspid;
        (!nspid.is_empty()).then_some(nspid)
    }

    /// The PID namespace the process lives in (`ns/pid`, followed); `None` when unreadable.
    pub fn pid_namespace(&self, dir: ProcDir) -> Option<NamespaceId> {
        let st = rustix::fs::statat(
            &self.root_fd,
            dir.rel("ns/pid").as_str(),
            rustix::fs::AtFlags::empty(),
        )
        .ok()?;
        Some(NamespaceId {
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }

    /// Opens the process's `ns/pid`, for `ioctl_ns(2)` questions (`NS_GET_PARENT`); `None`
    /// when it is gone or unreadable.
    pub fn open_pid_namespace(&self, dir: ProcDir) -> Option<OwnedFd> {
        self.open_rel(&dir.rel("ns/pid"), OFlags::RDONLY).ok()
    }

    /// The (device, inode) of the file `pid`'s descriptor `fd` is open on (`/proc/PID/fd/FD`
    /// followed); `None` when the process, the descriptor or the right to look is missing.
    pub fn fd_file_id(&self, pid: u32, fd: i32) -> Option<(u64, u64)> {
        let st = rustix::fs::statat(
            &self.root_fd,
            format!("{pid}/fd/{fd}").as_str(),
            rustix::fs::AtFlags::empty(),
        )
        .ok()?;
        Some((st.st_dev, st.st_ino))
    }

    /// Whether any of `pid`'s open fds links to `target` (`/proc/PID/fd/*`, one `readlinkat`
    /// per fd): for a device file that is no character device (the simulator's).
    pub fn holds_open(&self, pid: u32, target: &Path) -> Result<Found<bool>, ProcError> {
        self.holds_open_at(&format!("{pid}/fd"), target)
    }

    /// [`ProcFs::holds_open`] through every fd table of `pid`: its own and those of threads
    /// that have one of their own (`unshare(CLONE_FILES)`), as a driver sees every open file
    /// whatever table holds it (the simulated driver's reset refuses on this).
    pub fn holds_open_in_any_table(
        &self,
        pid: u32,
        target: &Path,
    ) -> Result<Found<bool>, ProcError> {
        match self.holds_open(pid, target)? {
            Found::Yes(false) => {}
            other => return Ok(other),
        }
        for tid in self.other_threads(pid) {
            if let Ok(Found::Yes(true)) =
                self.holds_open_at(&format!("{pid}/task/{tid}/fd"), target)
            {
                return Ok(Found::Yes(true));
            }
        }
        Ok(Found::Yes(false))
    }

    fn holds_open_at(&self, rel: &str, target: &Path) -> Result<Found<bool>, ProcError> {
        let dir = match self.open_dir(rel)? {
            Found::Yes(d) => d,
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
        };
        let want = target.as_os_str().as_encoded_bytes();
        let mut names = Vec::new();
        for entry in dir.flatten() {
            let name = entry.file_name().to_bytes();
            if !name.is_empty() && name.len() <= 10 && name.iter().all(u8::is_ascii_digit) {
                names.push(format!("{rel}/{}", String::from_utf8_lossy(name)));
            }
        }
        for name in names {
            if let Ok(link) = rustix::fs::readlinkat(&self.root_fd, name.as_str(), Vec::new())
                && link.as_bytes() == want
            {
                return Ok(Found::Yes(true));
            }
        }
        Ok(Found::Yes(false))
    }

    /// Opens `/proc/PID/stat` to be re-read with [`ProcFs::reread_stat`]. The fd stays tied
    /// to this process: once it is reaped, reads fail with ESRCH, even if the pid is reused.
    pub fn open_stat(&self, pid: u32) -> Result<Found<OwnedFd>, ProcError> {
        let rel = format!("{pid}/stat");
        triage(self.open_rel(&rel, OFlags::RDONLY), || self.path(&rel))
    }

    /// Re-reads a `stat` opened by [`ProcFs::open_stat`]: one `pread` at offset 0, which makes
    /// procfs generate the line afresh.
    pub fn reread_stat(&self, pid: u32, fd: &OwnedFd) -> Result<Found<Stat>, ProcError> {
        let mut buf = [0u8; 1024];
        let n = match triage(rustix::io::pread(fd, &mut buf, 0), || {
            self.path(&format!("{pid}/stat"))
        })? {
            Found::Yes(0) | Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
            Found::Yes(n) if n == buf.len() => return self.stat(pid),
            Found::Yes(n) => n,
        };
        parse::parse_stat(&buf[..n])
            .map(Found::Yes)
            .map_err(|cause| ProcError::Malformed {
                path: self.path(&format!("{pid}/stat")),
                cause,
            })
    }

    /// A reusable lister of the root's pids.
    pub fn pid_lister(&self) -> Result<PidLister, ProcError> {
        let fd = self
            .open_rel(".", OFlags::RDONLY | OFlags::DIRECTORY)
            .and_then(rustix::fs::Dir::new)
            .map_err(|e| ProcError::Io {
                path: self.root.clone(),
                cause: e.into(),
            })?;
        Ok(PidLister {
            dir: fd,
            root: self.root.clone(),
        })
    }

    fn stat_at(&self, rel: &str) -> Result<Found<Stat>, ProcError> {
        let mut buf = Vec::with_capacity(512);
        match self.read_into(rel, &mut buf)? {
            Found::Yes(()) if buf.is_empty() => Ok(Found::Gone),
            Found::Yes(()) => {
                parse::parse_stat(&buf)
                    .map(Found::Yes)
                    .map_err(|source| ProcError::Malformed {
                        path: self.path(rel),
                        cause: source,
                    })
            }
            Found::Gone => Ok(Found::Gone),
            Found::Denied => Ok(Found::Denied),
        }
    }

    /// `/proc/PID/status`.
    pub fn status(&self, pid: u32) -> Result<Found<Status>, ProcError> {
        self.status_of(ProcDir::Pid(pid))
    }

    /// `status` of a process directory (`self` included).
    pub fn status_of(&self, dir: ProcDir) -> Result<Found<Status>, ProcError> {
        Ok(match self.read(&dir.rel("status"))? {
            Found::Yes(b) => Found::Yes(parse::parse_status(&b)),
            Found::Gone => Found::Gone,
            Found::Denied => Found::Denied,
        })
    }

    /// `/proc/PID/cmdline`.
    pub fn cmdline(&self, pid: u32) -> Result<Found<Vec<String>>, ProcError> {
        // No more than is kept (one byte more, so that the cut shows).
        let mut buf = Vec::new();
        Ok(
            match self.read_at_most(
                &format!("{pid}/cmdline"),
                &mut buf,
                parse::MAX_CMDLINE_BYTES + 1,
            )? {
                Found::Yes(()) => Found::Yes(parse::parse_cmdline(&buf)),
                Found::Gone => Found::Gone,
                Found::Denied => Found::Denied,
            },
        )
    }

    /// `/proc/PID/cgroup`, reduced to the most useful path.
    pub fn cgroup(&self, pid: u32) -> Result<Found<Option<String>>, ProcError> {
        Ok(match self.read(&format!("{pid}/cgroup"))? {
            Found::Yes(b) => Found::Yes(parse::parse_cgroup(&b)),
            Found::Gone => Found::Gone,
            Found::Denied => Found::Denied,
        })
    }

    /// Every thread's state and wait channel (`/proc/PID/task/*/{stat,wchan}`).
    pub fn threads(&self, pid: u32) -> Result<Found<Vec<ThreadFacts>>, ProcError> {
        let rel = format!("{pid}/task");
        let mut tids = Vec::new();
        let dir = match self.open_dir(&rel)? {
            Found::Yes(d) => d,
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
        };
        for entry in dir.flatten() {
            if let Some(tid) = parse_pid(entry.file_name().to_bytes()) {
                tids.push(tid);
            }
        }
        tids.sort_unstable();
        let mut threads = Vec::with_capacity(tids.len());
        for tid in tids {
            let Found::Yes(stat) = self.stat_at(&format!("{pid}/task/{tid}/stat"))? else {
                continue;
            };
            let wchan = self
                .read(&format!("{pid}/task/{tid}/wchan"))?
                .ok()
                .map(|w| String::from_utf8_lossy(&w).trim().to_string())
                .filter(|w| !w.is_empty() && w != "0");
            // SIGKILL is signal 9: bit 8 of the pending mask.
            let leaving = stat
                .flags
                .zip(stat.pending_signals)
                .map(|(flags, pending)| flags & PF_EXITING != 0 || pending & (1 << 8) != 0);
            threads.push(ThreadFacts {
                tid,
                state: stat.state.unwrap_or('?'),
                wchan,
                leaving,
            });
        }
        Ok(Found::Yes(threads))
    }

    /// `/proc/PID/exe`: the executable's path, and the owner and mode of the file it names
    /// (a `stat` through the link, which works for a deleted file too).
    pub fn exe(&self, pid: u32) -> Result<Found<ExeFacts>, ProcError> {
        let rel = format!("{pid}/exe");
        let link = match triage(
            rustix::fs::readlinkat(&self.root_fd, rel.as_str(), Vec::new()),
            || self.path(&rel),
        )? {
            Found::Yes(l) => l,
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
        };
        // Cached attributes (no round trip to a FUSE daemon that may never answer), and any
        // other failure (a FUSE file gone bad, a stale NFS handle: the user's own doing) makes
        // this one process's binary unknown, never the whole collection's failure.
        let st = match rustix::fs::statx(
            &self.root_fd,
            rel.as_str(),
            rustix::fs::AtFlags::STATX_DONT_SYNC,
            rustix::fs::StatxFlags::UID | rustix::fs::StatxFlags::MODE,
        ) {
            Ok(st) => st,
            Err(Errno::NOENT | Errno::SRCH) => return Ok(Found::Gone),
            Err(_) => return Ok(Found::Denied),
        };
        let text = String::from_utf8_lossy(link.as_bytes()).into_owned();
        let (path, deleted) = match text.strip_suffix(" (deleted)") {
            Some(p) => (p.to_string(), true),
            None => (text, false),
        };
        Ok(Found::Yes(ExeFacts {
            path,
            deleted,
            owner_uid: st.stx_uid,
            mode: u32::from(st.stx_mode) & 0o7777,
        }))
    }

    /// Direct children of `pid`, from `PID/task/*/children`: lists the kernel keeps exact, so
    /// that a walk through them never misses a process the way one pass over the tree can (a
    /// daemon's intermediate process exiting between two reads). `None` where the kernel has
    /// no such files (built without `CONFIG_PROC_CHILDREN`); a process that is gone has none.
    pub fn children(&self, pid: u32) -> Result<Option<Vec<u32>>, ProcError> {
        Ok(self
            .children_within(pid, usize::MAX)?
            .map(|(children, _)| children))
    }

    /// [`ProcFs::children`], looking at no more than `max_threads` threads: with whether
    /// every thread was looked at and read (a child forked by a thread left out, or by one
    /// whose list could not be read, is missed). A process that is gone has no children.
    pub fn children_within(
        &self,
        pid: u32,
        max_threads: usize,
    ) -> Result<Option<(Vec<u32>, bool)>, ProcError> {
        let dir = match self.open_dir(&format!("{pid}/task")) {
            Ok(Found::Yes(dir)) => dir,
            Ok(Found::Gone) => return Ok(Some((Vec::new(), true))),
            // Denied, or an error of its own: its children are unknown (its holders' work
            // then too), and the rest of the collection goes on.
            Ok(Found::Denied) | Err(_) => return Ok(Some((Vec::new(), false))),
        };
        let mut out = Vec::new();
        let mut buf = Vec::new();
        let mut threads = 0usize;
        let mut whole = true;
        for entry in dir {
            let Ok(entry) = entry else {
                whole = false;
                break;
            };
            let Some(tid) = parse_pid(entry.file_name().to_bytes()) else {
                continue;
            };
            threads += 1;
            if threads > max_threads {
                return Ok(Some((out, false)));
            }
            let file = format!("{pid}/task/{tid}/children");
            match self.read_into(&file, &mut buf)? {
                Found::Yes(()) => out.extend(
                    String::from_utf8_lossy(&buf)
                        .split_ascii_whitespace()
                        .filter_map(|s| s.parse::<u32>().ok()),
                ),
                // The thread has a directory but no `children` file: the kernel lacks them.
                Found::Gone
                    if self
                        .open_rel(
                            &format!("{pid}/task/{tid}"),
                            OFlags::RDONLY | OFlags::DIRECTORY,
                        )
                        .is_ok() =>
                {
                    return Ok(None);
                }
                // The thread exited since the listing (its children go to a sibling thread,
                // missed only if that one was read already, within these microseconds).
                Found::Gone => {}
                Found::Denied => whole = false,
            }
        }
        Ok(Some((out, whole)))
    }

    /// One observation for the work sampler: start time, CPU time used so far, and whether
    /// any thread is running (R), and whether one is in D. The thread states are read only when the main thread is
    /// not running itself, at most [`MAX_THREADS_OBSERVED`] of them.
    pub fn work_probe(&self, pid: u32) -> Result<Found<WorkProbe>, ProcError> {
        let stat = match self.stat(pid)? {
            Found::Yes(s) => s,
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
        };
        let (Some(start_ticks), Some(utime), Some(stime)) =
            (stat.start_ticks, stat.utime, stat.stime)
        else {
            return Ok(Found::Denied);
        };
        let mut running = stat.state == Some('R');
        // A thread in D waits on I/O (a checkpoint written to NFS) or is stuck in the driver:
        // which, is not known; the classifier takes it as work unknown, never idle.
        let mut waiting = stat.state == Some('D');
        if !running && stat.num_threads.unwrap_or(1) > 1 {
            let rel = format!("{pid}/task");
            if let Ok(dir) = self
                .open_rel(&rel, OFlags::RDONLY | OFlags::DIRECTORY)
                .and_then(rustix::fs::Dir::new)
            {
                for entry in dir.flatten().take(MAX_THREADS_OBSERVED) {
                    let Some(tid) = parse_pid(entry.file_name().to_bytes()) else {
                        continue;
                    };
                    if let Ok(Found::Yes(t)) = self.stat_at(&format!("{pid}/task/{tid}/stat")) {
                        waiting |= t.state == Some('D');
                        if t.state == Some('R') {
                            running = true;
                            break;
                        }
                    }
                }
            }
        }
        // With the time of the children it waited for: a job that runs one short process
        // after another (a compile, `tar` per shard) works through them, and each is gone
        // before the next observation could read it.
        let children = stat.cutime.unwrap_or(0) + stat.cstime.unwrap_or(0);
        Ok(Found::Yes(WorkProbe {
            start_ticks,
            cpu_ticks: utime + stime + children,
            running,
            waiting,
        }))
    }

    /// The NVIDIA device files under `dev_dir` that `pid` holds open.
    ///
    /// Costs one `readlinkat` per open fd: the expensive part of a full scan, which is why the
    /// collector avoids repeating it for processes it has already seen. When the process's
    /// own `fd/` is empty, the fd table of its first other thread is read instead: once a
    /// leader's main thread has exited (a zombie leader), its `fd/` is empty while the
    /// surviving threads still hold the files.
    pub fn device_files(
        &self,
        pid: u32,
        devices: &DeviceTable,
    ) -> Result<Found<FdScan>, ProcError> {
        let (scan, entries) = match self.scan_fd_dir(&format!("{pid}/fd"), devices)? {
            Found::Yes(v) => v,
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Yes(FdScan::Denied)),
        };
        if entries > 0 {
            return Ok(Found::Yes(scan));
        }
        for tid in self.other_threads(pid) {
            if let Found::Yes((thread_scan, n)) =
                self.scan_fd_dir(&format!("{pid}/task/{tid}/fd"), devices)?
                && n > 0
            {
                return Ok(Found::Yes(thread_scan));
            }
        }
        Ok(Found::Yes(scan))
    }

    /// [`ProcFs::device_files`], and the fd tables of `pid`'s threads that have one of their
    /// own (`unshare(CLONE_FILES)`): such a thread can hold a device file the process's `fd/`
    /// does not show (red team: a GPU reset ran under one; only the driver refused it). Where
    /// `pids_are_ours` (this tree is vramguard's own namespace), one `kcmp(KCMP_FILES)` per
    /// thread tells a shared table from its own, and only its own is read; otherwise, or where
    /// `kcmp` cannot tell, every thread's table is read. A process of more than
    /// [`MAX_THREADS_LOOKED_AT`] threads, or whose task list cannot be read, reads as
    /// [`FdScan::Denied`]: its files are not all known (a reset refuses on it).
    pub fn device_files_of_every_table(
        &self,
        pid: u32,
        devices: &DeviceTable,
        pids_are_ours: bool,
    ) -> Result<Found<FdScan>, ProcError> {
        let mut files = match self.device_files(pid, devices)? {
            Found::Yes(FdScan::Scanned(files)) => files,
            other => return Ok(other),
        };
        let tasks = match self.open_dir(&format!("{pid}/task"))? {
            Found::Yes(d) => d,
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Yes(FdScan::Denied)),
        };
        let mut tids = Vec::new();
        for entry in tasks {
            let Ok(entry) = entry else {
                return Ok(Found::Yes(FdScan::Denied));
            };
            if let Some(tid) = parse_pid(entry.file_name().to_bytes())
                && tid != pid
            {
                if tids.len() == MAX_THREADS_LOOKED_AT {
                    return Ok(Found::Yes(FdScan::Denied));
                }
                tids.push(tid);
            }
        }
        for tid in tids {
            if pids_are_ours && Self::same_fd_table(pid, tid) == Some(true) {
                continue;
            }
            match self.scan_fd_dir(&format!("{pid}/task/{tid}/fd"), devices)? {
                Found::Yes((FdScan::Scanned(more), _)) => files.extend(more),
                // Exited meanwhile: its files are closed.
                Found::Yes(_) | Found::Gone => {}
                Found::Denied => return Ok(Found::Yes(FdScan::Denied)),
            }
        }
        files.sort_unstable();
        files.dedup();
        Ok(Found::Yes(FdScan::Scanned(files)))
    }

    /// Which NVIDIA driver libraries the process maps (`/proc/PID/maps`, read in pieces up to
    /// [`MAX_MAPS_BYTES`], stopping at the first `libcuda.so*`). A zombie leader's own map is
    /// empty while its other threads live on: the first other thread's is read. A map that is
    /// empty for every thread, or larger than the bound, is [`DriverLibrary::Unknown`].
    pub fn driver_library(&self, pid: u32) -> Result<Found<DriverLibrary>, ProcError> {
        // Reading a map takes the process's mmap lock: a thread stuck in D state (in the
        // driver) may hold it, or have a writer queued behind it, and the read would hang
        // the collection. Such a process reads as unknown, its map unread.
        match self.any_thread_in_d(pid)? {
            Found::Yes(false) => {}
            Found::Yes(true) => return Ok(Found::Yes(DriverLibrary::Unknown)),
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
        }
        match self.driver_library_in(&format!("{pid}/maps"))? {
            Found::Yes(Some(found)) => return Ok(Found::Yes(found)),
            Found::Yes(None) => {}
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
        }
        for tid in self.other_threads(pid) {
            if let Found::Yes(Some(found)) =
                self.driver_library_in(&format!("{pid}/task/{tid}/maps"))?
            {
                return Ok(Found::Yes(found));
            }
        }
        Ok(Found::Yes(DriverLibrary::Unknown))
    }

    /// The threads of `pid` other than its main thread, at most [`MAX_THREADS_LOOKED_AT`]
    /// (none when its `task/` cannot be read): where a leader's main thread has exited, its
    /// own `fd/` and `maps` are empty while these still show what the process holds.
    fn other_threads(&self, pid: u32) -> impl Iterator<Item = u32> {
        std::fs::read_dir(self.path(&format!("{pid}/task")))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|task| parse_pid(task.file_name().as_encoded_bytes()))
            .filter(move |&tid| tid != pid)
            .take(MAX_THREADS_LOOKED_AT)
    }

    /// Whether any thread of `pid` is in D state (`task/*/stat`, at most
    /// [`MAX_THREADS_LOOKED_AT`] of them; more reads as yes: not known to be safe).
    fn any_thread_in_d(&self, pid: u32) -> Result<Found<bool>, ProcError> {
        let dir = match self.open_dir(&format!("{pid}/task"))? {
            Found::Yes(d) => d,
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
        };
        let mut seen = 0;
        for entry in dir.flatten() {
            let Some(tid) = parse_pid(entry.file_name().to_bytes()) else {
                continue;
            };
            seen += 1;
            if seen > MAX_THREADS_LOOKED_AT {
                return Ok(Found::Yes(true));
            }
            if let Found::Yes(st) = self.stat_at(&format!("{pid}/task/{tid}/stat"))?
                && st.state == Some('D')
            {
                return Ok(Found::Yes(true));
            }
        }
        Ok(Found::Yes(false))
    }

    /// One `maps` file: `Some` verdict, or `None` when it is empty (no address space).
    fn driver_library_in(&self, rel: &str) -> Result<Found<Option<DriverLibrary>>, ProcError> {
        use crate::parse::{MappedLibrary, maps_line_library};
        let result = self
            .open_rel(rel, OFlags::RDONLY | OFlags::NONBLOCK)
            .and_then(|fd| {
                let mut buf = vec![0u8; 64 * 1024];
                // Bytes of a line not yet ended, at the front of `buf`.
                let mut pending = 0;
                let mut total = 0usize;
                let mut nvml = false;
                // A line longer than the buffer was read in pieces: a name cut there may
                // have been missed, so no verdict of absence is given.
                let mut overlong = false;
                let mut note = |line: &[u8]| match maps_line_library(line) {
                    Some(MappedLibrary::Cuda) => true,
                    Some(MappedLibrary::Nvml) => {
                        nvml = true;
                        false
                    }
                    None => false,
                };
                loop {
                    if pending == buf.len() {
                        // A line longer than the buffer (a path deeper than PATH_MAX, which
                        // the kernel prints whole): its rest is read as a line of its own.
                        pending = 0;
                        overlong = true;
                    }
                    let n = rustix::io::read(&fd, &mut buf[pending..])?;
                    if n == 0 {
                        if note(&buf[..pending]) {
                            return Ok(Some(DriverLibrary::Cuda));
                        }
                        return Ok(match (total, overlong, nvml) {
                            (0, _, _) => None,
                            (_, true, _) => Some(DriverLibrary::Unknown),
                            (_, false, true) => Some(DriverLibrary::NvmlOnly),
                            (_, false, false) => Some(DriverLibrary::Neither),
                        });
                    }
                    total += n;
                    let filled = pending + n;
                    let mut start = 0;
                    while let Some(end) = buf[start..filled].iter().position(|&b| b == b'\n') {
                        if note(&buf[start..start + end]) {
                            return Ok(Some(DriverLibrary::Cuda));
                        }
                        start += end + 1;
                    }
                    if total >= MAX_MAPS_BYTES {
                        return Ok(Some(DriverLibrary::Unknown));
                    }
                    buf.copy_within(start..filled, 0);
                    pending = filled - start;
                }
            });
        triage(result, || self.path(rel))
    }

    /// Scans one `fd/` directory; returns the device files and the number of entries.
    fn scan_fd_dir(
        &self,
        rel: &str,
        devices: &DeviceTable,
    ) -> Result<Found<(FdScan, usize)>, ProcError> {
        let mut dir = match self.open_dir(rel)? {
            Found::Yes(d) => d,
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => return Ok(Found::Denied),
        };
        // The directory's own fd serves the readlinkat calls: no dup per process.
        let raw = match dir.fd() {
            Ok(fd) => fd.as_raw_fd(),
            Err(e) => {
                return Err(ProcError::Io {
                    path: self.path(rel),
                    cause: e.into(),
                });
            }
        };
        let mut files: Vec<DeviceFile> = Vec::new();
        let mut entries = 0usize;
        let mut target = Vec::with_capacity(256);
        while let Some(entry) = dir.read() {
            let entry = match entry {
                Ok(e) => e,
                // The process exited while we listed its fds.
                Err(Errno::NOENT | Errno::SRCH) => return Ok(Found::Gone),
                Err(Errno::ACCESS | Errno::PERM) => return Ok(Found::Denied),
                Err(e) => {
                    return Err(ProcError::Io {
                        path: self.path(rel),
                        cause: e.into(),
                    });
                }
            };
            let name = entry.file_name();
            if name.to_bytes().first() == Some(&b'.') {
                continue;
            }
            entries += 1;
            // SAFETY: `raw` belongs to `dir`, which lives until the end of this function.
            let dir_fd = unsafe { BorrowedFd::borrow_raw(raw) };
            match devices.identify(dir_fd, name, &mut target) {
                Ok(Some(file)) => files.push(file),
                Ok(None) => {}
                // That fd was closed between the listing and the lookup.
                Err(Errno::NOENT) => continue,
                Err(Errno::SRCH) => return Ok(Found::Gone),
                Err(Errno::ACCESS | Errno::PERM) => return Ok(Found::Denied),
                // A file whose attributes cannot be had (a FUSE file gone bad, a stale NFS
                // handle, a FUSE daemon gone) is on no devtmpfs: no GPU device file. It must
                // not fail the whole collection, which any user could then do on every node.
                Err(Errno::IO | Errno::STALE | Errno::NOTCONN | Errno::OVERFLOW) => continue,
                // Anything else: this process's files are not all known (it counts as
                // unreadable, and nothing is concluded from its absence).
                Err(_) => return Ok(Found::Denied),
            }
        }
        files.sort_unstable();
        files.dedup();
        Ok(Found::Yes((FdScan::Scanned(files), entries)))
    }

    /// Whether threads `a` and `b` (pids of vramguard's own namespace) share one fd table:
    /// `kcmp(2)` with `KCMP_FILES`; `None` where it cannot tell (no `kcmp` in this kernel, a
    /// thread gone, no permission).
    fn same_fd_table(a: u32, b: u32) -> Option<bool> {
        const KCMP_FILES: libc::c_long = 2;
        // SAFETY: kcmp takes two pids, a type and two unused integers; it reads no memory of ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_kcmp,
                libc::c_long::from(a as i32),
                libc::c_long::from(b as i32),
                KCMP_FILES,
                0 as libc::c_long,
                0 as libc::c_long,
            )
        };
        match r {
            0 => Some(true),
            1 | 2 => Some(false),
            _ => None,
        }
    }

    /// The pid `self` resolves to: vramguard's pid in this tree's namespace.
    pub fn self_pid(&self) -> Option<u32> {
        let link = rustix::fs::readlinkat(&self.root_fd, "self", Vec::new()).ok()?;
        parse_pid(link.as_bytes())
    }

    /// Whether this tree is the `/proc` of vramguard's own PID namespace (its `self` is this
    /// process): only there does a pid read name the process a pidfd or a signal reaches.
    pub fn is_own_namespace(&self) -> bool {
        if self.self_pid() != Some(std::process::id()) {
            return false;
        }
        // The same number can be ours in another namespace's /proc too (a parent namespace's
        // mounted where ours is expected): that tree's pid 1 is then another namespace's init.
        // Unreadable (not root: pid 1's ns link needs ptrace access), the number is all there
        // is to go by.
        let ns = |at: &str| rustix::fs::readlinkat(&self.root_fd, at, Vec::new()).ok();
        match (ns("1/ns/pid"), ns("self/ns/pid")) {
            (Some(init), Some(own)) => init == own,
            _ => true,
        }
    }

    /// Whether this tree's `self` lives in the initial PID namespace.
    pub fn pid_namespace_is_host(&self) -> Option<bool> {
        let link = rustix::fs::readlinkat(&self.root_fd, "self/ns/pid", Vec::new()).ok()?;
        Some(link.as_bytes() == INIT_PID_NS_INODE.as_bytes())
    }

    /// Boot time from `stat`'s `btime`, milliseconds since the Unix epoch.
    pub fn boot_time_ms(&self) -> Option<u64> {
        let bytes = self.read("stat").ok()?.ok()?;
        parse::parse_boot_time(&bytes).map(|s| s * 1000)
    }

    /// Tasks created since boot (`stat`'s `processes`): while it stays the same, no process
    /// can have appeared.
    pub fn forks_since_boot(&self) -> Option<u64> {
        let bytes = self.read("stat").ok()?.ok()?;
        parse::parse_forks(&bytes)
    }

    /// `sys/kernel/hostname`.
    pub fn hostname(&self) -> Option<String> {
        let bytes = self.read("sys/kernel/hostname").ok()?.ok()?;
        let name = String::from_utf8_lossy(&bytes).trim().to_string();
        (!name.is_empty()).then_some(name)
    }
}

/// Whether this process holds an NVIDIA device file of `dev_dir` open (a name starting with
/// `nvidia` there), read from its own `/proc/self/fd`. What a reset waits on: the driver
/// refuses it while this process holds the GPU.
pub fn own_process_holds_device_files(dev_dir: &Path) -> bool {
    std::fs::read_dir(Path::new(OWN_PROC).join("self/fd")).is_ok_and(|fds| {
        fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|target| {
                target.parent() == Some(dev_dir)
                    && target
                        .file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("nvidia"))
            })
        })
    })
}

/// The most read from one `/proc` file: above the longest command line Linux accepts
/// (`ARG_MAX` is a quarter of the stack limit, 2 MiB by default).
pub const MAX_PROC_FILE: usize = 8 << 20;

/// The most threads of one process whose states are read before its map is (more: the map is
/// not read), and the most looked at for a zombie leader's files and map.
pub const MAX_THREADS_LOOKED_AT: usize = 4096;

/// The most read of one process's `maps` looking for the driver libraries: about 200,000
/// mappings, three times the default `vm.max_map_count` (65,530).
pub const MAX_MAPS_BYTES: usize = 32 << 20;

/// Threads looked at per observation; a process with more is judged by the first ones.
pub const MAX_THREADS_OBSERVED: usize = 256;

/// One observation of a process by the work sampler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkProbe {
    /// Start time, clock ticks after boot.
    pub start_ticks: u64,
    /// User + system CPU time so far, its own and that of the children it waited for,
    /// clock ticks.
    pub cpu_ticks: u64,
    /// Whether a thread was running (R).
    pub running: bool,
    /// Whether a thread was in uninterruptible sleep (D): I/O in progress, or stuck in the
    /// driver.
    pub waiting: bool,
}

/// Lists the pids of a `/proc` tree again and again with one open directory.
#[derive(Debug)]
pub struct PidLister {
    dir: rustix::fs::Dir,
    root: PathBuf,
}

impl PidLister {
    /// The pids present now, sorted.
    pub fn list(&mut self) -> Result<Vec<u32>, ProcError> {
        self.dir.rewind();
        let mut pids = Vec::with_capacity(1024);
        while let Some(entry) = self.dir.read() {
            let entry = entry.map_err(|e| ProcError::Io {
                path: self.root.clone(),
                cause: e.into(),
            })?;
            if let Some(pid) = parse_pid(entry.file_name().to_bytes()) {
                pids.push(pid);
            }
        }
        pids.sort_unstable();
        Ok(pids)
    }
}

fn parse_pid(name: &[u8]) -> Option<u32> {
    if name.is_empty() || name.len() > 10 || !name.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(name)
        .ok()?
        .parse()
        .ok()
        .filter(|p| *p > 0)
}
