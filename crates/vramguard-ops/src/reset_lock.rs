//! The reset pause: how a vramguard process that resets a GPU asks the node's other vramguard
//! processes (the agent) to let go of the driver meanwhile.
//!
//! The driver refuses a reset while any process other than the resetting one holds the GPU,
//! NVML clients included ("In use by another client"). The agent holds NVML for as long as it
//! runs, so a `reclaim --reset`, a Slurm heal or the agent's own automatic reclaim would
//! always be refused on a node that runs it. Before a reset, the resetter writes a lock file
//! of its own beside the configured path (`[reclaim] reset_lock`, `/run/vramguard/reset.lock`:
//! `reset.lock.<pid>`), with its pid, start time and the GPU. While any such file names a live
//! process (the same pid and start time) and is younger than [`MAX_PAUSE`], the agent makes no
//! driver call and holds no NVML handle; the resetter waits for the holders it can see to let
//! go ([`RESET_WAIT`]), resets, and removes its file. One file per resetter: two resets at once
//! (a CLI's and the agent's own) each keep the agent paused until both are done.
//!
//! The file is trusted only when root wrote it: read by root, it must be root's and writable
//! by no one else, and never larger than [`MAX_LOCK_BYTES`]; anything else is ignored (a user
//! cannot pause the agent). Its directory, and every one above it, must be root's alone
//! ([`check_directory`]): a user who could swap the directory could unpause the agent during a
//! reset, or have root write its lock where they choose. Locks in any other directory are
//! neither written nor believed.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;
use vramguard_proc::{Found, ProcFs};

/// The default lock file.
pub const DEFAULT_RESET_LOCK: &str = "/run/vramguard/reset.lock";

/// The longest the agent stays paused for one lock, whatever it says: a resetter that hangs
/// cannot blind the agent for longer.
pub const MAX_PAUSE: Duration = Duration::from_secs(120);

/// How long a resetter waits, with the lock written, for the holders of the GPU to let go.
/// The agent looks at the lock before each of its steps (at most its interval apart, 1 s by
/// default).
pub const RESET_WAIT: Duration = Duration::from_secs(10);

/// The most read of a lock file.
const MAX_LOCK_BYTES: u64 = 4096;

/// The most entries of the lock's directory looked at for locks.
const MAX_DIR_ENTRIES: usize = 256;

/// The lock file of the resetter `pid` for the configured path: `<path>.<pid>`.
pub fn own_path(path: &Path, pid: u32) -> PathBuf {
    let mut own = path.as_os_str().to_owned();
    own.push(format!(".{pid}"));
    PathBuf::from(own)
}

/// What the lock file says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LockInfo {
    /// The resetting process.
    pub pid: u32,
    /// Its start time (`/proc/PID/stat` field 22): a reused pid is not it.
    pub start_ticks: u64,
    /// The GPU being reset.
    pub gpu: u32,
    /// When it was written (ms since the epoch).
    pub since_ms: u64,
}

/// A lock this process wrote; removed when dropped (if it is still ours).
#[derive(Debug)]
pub struct ResetLock {
    path: PathBuf,
    info: LockInfo,
}

/// Why the lock could not be written.
#[derive(Debug, thiserror::Error)]
#[error(
    "writing the reset lock {path}: {why}; the node's agent is not asked to let go of the GPU \
     for this reset (see [reclaim] reset_lock: a file in a directory only root may write)"
)]
pub struct LockError {
    /// The file.
    pub path: PathBuf,
    /// What failed.
    pub why: String,
}

impl ResetLock {
    /// Writes the lock for a reset of `gpu` by this process, creating its directory (root's,
    /// mode 0755) if missing.
    pub fn acquire(path: &Path, gpu: u32, now_ms: u64) -> Result<Self, LockError> {
        let pid = std::process::id();
        let own = own_path(path, pid);
        let fail = |why: String| LockError {
            path: own.clone(),
            why,
        };
        // Pids and start times as this process's own PID namespace gives them: the agent
        // reading the lock runs beside it.
        let proc = ProcFs::own().map_err(|e| fail(e.to_string()))?;
        let start_ticks = match proc.stat(pid) {
            Ok(Found::Yes(s)) => s.start_ticks,
            _ => None,
        }
        .ok_or_else(|| fail("this process's start time is unreadable".into()))?;
        let dir = lock_directory(path);
        if !dir.exists() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(dir)
                .map_err(|e| fail(format!("creating {}: {e}", dir.display())))?;
        }
        check_directory(path).map_err(|e| fail(e.to_string()))?;
        let info = LockInfo {
            pid,
            start_ticks,
            gpu,
            since_ms: now_ms,
        };
        let path = own.as_path();
        let text = serde_json::to_string(&info).expect("serialises");
        // Readable by all: an agent that does not run as root reads it too (only root may
        // write where it lies, and only root's file is trusted by root).
        vramguard_fs::write_file_mode(path, text.as_bytes(), 0o644)
            .map_err(|e| fail(e.reason()))?;
        Ok(ResetLock {
            path: path.to_path_buf(),
            info,
        })
    }
}

impl Drop for ResetLock {
    fn drop(&mut self) {
        // Only our own: another resetter may have taken the file over meanwhile.
        if read_lock(&self.path).is_some_and(|l| l == self.info) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// The directory of the lock files for the configured `path`.
fn lock_directory(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Whether the lock's directory may hold locks: it and every directory above it are root's
/// (or this user's) and writable by no one else. The agent says so at its start when not:
/// locks there are ignored, so a reset beside it is refused while it holds the GPU.
pub fn check_directory(path: &Path) -> Result<(), vramguard_fs::FileError> {
    vramguard_fs::check_private_directory_tree(lock_directory(path))
}

/// The lock at `path`, if there is one root may trust (see the module documentation).
fn read_lock(path: &Path) -> Option<LockInfo> {
    let text = vramguard_fs::read_root_config_to_string(path, MAX_LOCK_BYTES).ok()?;
    serde_json::from_str(&text).ok()
}

/// A reset a vramguard process is doing now, if a lock for the configured `path` names one
/// (`path` itself, or a resetter's own `path.<pid>`), in a directory only root can change: a
/// trusted file, younger than [`MAX_PAUSE`] (and not from the future), whose process lives
/// with the start time it wrote (`proc`: this process's own `/proc`). Costs a listing of the lock's directory (at most
/// [`MAX_DIR_ENTRIES`] entries).
pub fn active(path: &Path, proc: &ProcFs, now_ms: u64) -> Option<LockInfo> {
    let name = path.file_name()?.to_str()?;
    let dir = lock_directory(path);
    check_directory(path).ok()?;
    let prefix = format!("{name}.");
    // The bound counts lock files only: other files there (or stale locks of resetters that
    // were killed) must not hide a live one.
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| {
            e.file_name().to_str().is_some_and(|n| {
                n == name
                    || n.strip_prefix(&prefix).is_some_and(|pid| {
                        !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit())
                    })
            })
        })
        .take(MAX_DIR_ENTRIES)
        .find_map(|e| live_lock(&e.path(), proc, now_ms))
}

/// The lock at `path` if it is trusted, fresh and its process lives.
fn live_lock(path: &Path, proc: &ProcFs, now_ms: u64) -> Option<LockInfo> {
    let lock = read_lock(path)?;
    let age = now_ms.checked_sub(lock.since_ms)?;
    if age > MAX_PAUSE.as_millis() as u64 {
        return None;
    }
    match proc.stat(lock.pid) {
        Ok(Found::Yes(s)) if s.start_ticks == Some(lock.start_ticks) && s.state != Some('Z') => {
            Some(lock)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }

    /// Written, it is active while this process lives and the file is ours; dropped, gone.
    /// A lock naming a dead pid or a reused one, an old one or one from the future, a file
    /// every user may write or another user's, or text that is no lock, is not active.
    /// Review finding: the bound on entries looked at came before the filter on lock names,
    /// so other files in the directory could hide a live lock (the listing order is the
    /// filesystem's: with 2,000 others, the lock is among the first 256 about one time in
    /// eight).
    #[test]
    fn other_files_in_the_directory_never_hide_a_live_lock() {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..2000 {
            std::fs::write(dir.path().join(format!("other-{i}")), b"").unwrap();
        }
        let path = dir.path().join("reset.lock");
        let now = now_ms();
        let _lock = ResetLock::acquire(&path, 0, now).unwrap();
        assert!(active(&path, &ProcFs::own().unwrap(), now).is_some());
    }

    /// A lock directory another user owns, or one its group may write, holds no lock root
    /// writes or believes: the user could swap it (and unpause the agent mid-reset, or have
    /// root write its lock where they choose). The error says which directory and why.
    #[test]
    fn no_lock_is_written_or_believed_in_a_directory_another_user_can_change() {
        use std::os::unix::fs::PermissionsExt;
        assert!(
            rustix::process::geteuid().is_root(),
            "needs root (chown): scripts/test.sh runs the suite as root"
        );
        let dir = tempfile::tempdir().unwrap();
        let theirs = dir.path().join("theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
        let path = theirs.join("reset.lock");
        let proc = ProcFs::own().unwrap();
        let now = now_ms();
        // While the directory is root's, the lock is written and believed.
        let lock = ResetLock::acquire(&path, 0, now).unwrap();
        assert!(active(&path, &proc, now).is_some());
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        assert!(active(&path, &proc, now).is_none(), "believed in theirs");
        let e = ResetLock::acquire(&path, 0, now).unwrap_err().to_string();
        assert!(
            e.contains("owned by uid 65534") && e.contains(&theirs.display().to_string()),
            "{e}"
        );
        assert!(check_directory(&path).is_err());
        std::os::unix::fs::chown(&theirs, Some(0), Some(0)).unwrap();
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o775)).unwrap();
        assert!(
            active(&path, &proc, now).is_none(),
            "believed where a group writes"
        );
        let e = ResetLock::acquire(&path, 0, now).unwrap_err().to_string();
        assert!(e.contains("its group"), "{e}");
        std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(active(&path, &proc, now).is_some());
        drop(lock);
    }

    #[test]
    fn a_lock_is_active_only_while_it_is_trusted_fresh_and_its_process_lives() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/reset.lock");
        let proc = ProcFs::own().unwrap();
        let now = now_ms();
        let lock = ResetLock::acquire(&path, 1, now).unwrap();
        let got = active(&path, &proc, now).expect("active");
        assert_eq!((got.pid, got.gpu), (std::process::id(), 1));
        assert!(
            own_path(&path, std::process::id()).is_file(),
            "its own file"
        );
        assert!(active(&path, &proc, now + MAX_PAUSE.as_millis() as u64 + 1).is_none());
        assert!(active(&path, &proc, now - 1).is_none(), "from the future");
        // Another resetter at the same time (a live process of its own): when this one is
        // done, the other still holds the pause.
        let mut other = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let other_start = (0..500)
            .find_map(|_| match proc.stat(other.id()) {
                Ok(Found::Yes(st)) => st.start_ticks,
                _ => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    None
                }
            })
            .expect("the other resetter's start time");
        let other_lock = LockInfo {
            pid: other.id(),
            start_ticks: other_start,
            gpu: 0,
            since_ms: now,
        };
        std::fs::write(
            own_path(&path, other.id()),
            serde_json::to_string(&other_lock).unwrap(),
        )
        .unwrap();
        drop(lock);
        assert!(!own_path(&path, std::process::id()).exists());
        assert_eq!(
            active(&path, &proc, now),
            Some(other_lock),
            "the other reset's"
        );
        other.kill().unwrap();
        other.wait().unwrap();
        assert!(active(&path, &proc, now).is_none(), "its process is gone");
        std::fs::remove_file(own_path(&path, other.id())).unwrap();

        let write = |info: &LockInfo| {
            std::fs::write(&path, serde_json::to_string(info).unwrap()).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        };
        let mine = LockInfo {
            pid: std::process::id(),
            start_ticks: got.start_ticks,
            gpu: 0,
            since_ms: now,
        };
        write(&mine);
        assert!(active(&path, &proc, now).is_some());
        write(&LockInfo {
            start_ticks: got.start_ticks + 1,
            ..mine.clone()
        });
        assert!(active(&path, &proc, now).is_none(), "a reused pid");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        write(&LockInfo {
            pid: dead,
            ..mine.clone()
        });
        assert!(active(&path, &proc, now).is_none(), "a dead pid");
        write(&mine);
        if rustix::process::geteuid().is_root() {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
            assert!(
                active(&path, &proc, now).is_none(),
                "writable by every user"
            );
            std::os::unix::fs::chown(&path, Some(65534), None).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            assert!(active(&path, &proc, now).is_none(), "another user's file");
        }
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, "{\"pid\": 1, \"junk\": true}").unwrap();
        assert!(active(&path, &proc, now).is_none(), "not a lock");
    }
}
