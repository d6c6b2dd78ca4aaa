//! Event-driven discovery of device-file holders: fanotify open events on the `nvidia*` files.
//!
//! A process that opens a GPU device file is a holder from then on. The driver lists it only
//! once it creates a context, and a `/proc` listing finds it only if it is a new process, so
//! without events an old process that opens the device is found by the next full fd scan.
//! With this watch it is named within milliseconds, and the full scan can be rare.
//!
//! The group reports file identifiers (`FAN_REPORT_FID`), never file descriptors: a
//! descriptor-reporting group would open each device file in vramguard's name, and an open
//! `/dev/nvidia0` is a client of the GPU (it would block a reset and be listed as a holder).
//! Only the opener's pid is used; the fd scan of that pid then says what it holds.
//!
//! What it does not see: a container's own device nodes (other inodes, made with `mknod`),
//! and files inherited across `fork` (no open happens). The listing of new processes and the
//! periodic full scan cover those.

use rustix::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use rustix::io::Errno;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Bytes read per `read` of the group.
const READ_BYTES: usize = 16 * 1024;
/// Reads per [`DeviceOpens::drain`]: a flood of opens is left to the next drain (or to the
/// queue's overflow, which asks for a full scan) instead of holding up the caller.
const MAX_READS: usize = 16;
/// Distinct openers kept between two drains; beyond this the drain says it overflowed.
const MAX_OPENERS: usize = 4096;
/// `fanotify_event_metadata`: the fixed part of each event.
const METADATA_LEN: usize = 24;
/// The metadata layout this parser knows (`FANOTIFY_METADATA_VERSION`).
const METADATA_VERSION: u8 = 3;

/// Why the device files cannot be watched for opens.
#[derive(Debug, thiserror::Error)]
pub enum OpenWatchError {
    /// `fanotify_init` failed: no CAP_SYS_ADMIN, a kernel without fanotify or without
    /// `FAN_REPORT_FID` (Linux < 5.1), or a seccomp filter.
    #[error(
        "cannot watch device opens (fanotify_init: {0}): needs root (CAP_SYS_ADMIN) and Linux 5.1 or later; new holders are found by /proc scans instead"
    )]
    Init(Errno),
    /// This node has no device files (a node built from a snapshot).
    #[error("this node has no device files to watch")]
    Unsupported,
    /// The `/proc` vramguard reads is not its own PID namespace's: fanotify names openers by
    /// their pid in vramguard's namespace, which that tree does not show.
    #[error(
        "cannot watch device opens: the /proc read is another PID namespace's, and fanotify names openers by their pid in vramguard's own; new holders are found by /proc scans instead"
    )]
    OtherNamespace,
    /// No `nvidia*` file of the device directory could be marked.
    #[error("cannot watch device opens: no nvidia* file in {} could be watched{}{}; new holders are found by /proc scans instead", shown_path(dir), .last.as_ref().map(|(f, e)| format!(" (fanotify_mark {}: {e})", shown_path(f))).unwrap_or_default(), no_fid_hint(.last.as_ref().map(|l| l.1)))]
    NothingMarked {
        /// The device directory.
        dir: PathBuf,
        /// The last file whose mark failed, and why, if any file was tried.
        last: Option<(PathBuf, Errno)>,
    },
}

/// Why a mark may fail on a kernel too old for this: fanotify_mark(2) answers ENODEV (no
/// fsid) or EOPNOTSUPP (no file handles) where the filesystem cannot identify files by handle,
/// which devtmpfs, being tmpfs, could not before Linux 6.6 or so.
fn no_fid_hint(errno: Option<Errno>) -> &'static str {
    match errno {
        Some(Errno::NODEV | Errno::OPNOTSUPP) => {
            ": the device directory's filesystem gives no file identifiers on this kernel"
        }
        _ => "",
    }
}

/// A path for a message: a container's root may name files in its `/dev` as it likes.
fn shown_path(p: &std::path::Path) -> String {
    vramguard_core::sanitize::shown(&p.display().to_string())
}

/// What one drain found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Openers {
    /// Processes that opened a watched file (vramguard's own opens left out).
    pub pids: BTreeSet<u32>,
    /// Events were lost (the kernel's queue overflowed, or more openers than kept): only a
    /// full fd scan can tell who holds the files now.
    pub overflowed: bool,
    /// Reading the group failed and the watch was stopped (the scans go on alone).
    pub stopped: Option<Errno>,
    /// A device file that could not be watched when the files were marked again, and why:
    /// its opens are found by the scans only.
    pub unmarked: Option<(PathBuf, Errno)>,
}

/// A fanotify group watching the `nvidia*` files of one device directory for opens.
#[derive(Debug)]
pub struct DeviceOpens {
    group: OwnedFd,
    dev_dirs: Vec<PathBuf>,
    own_pid: u32,
    marked: usize,
}

impl DeviceOpens {
    /// Starts watching every `nvidia*` file of `dev_dir` (links are not followed).
    pub fn new(dev_dir: &Path) -> Result<DeviceOpens, OpenWatchError> {
        DeviceOpens::of_dirs(&[dev_dir.to_path_buf()])
    }

    /// Starts watching every `nvidia*` file of each of `dev_dirs`: the device directory
    /// vramguard reads, and the host's own `/dev` seen through `/proc/1/root` when vramguard
    /// runs in a container whose runtime made its own device nodes (other inodes, whose marks
    /// would never see the workloads' opens). Marking one file twice is harmless.
    pub fn of_dirs(dev_dirs: &[PathBuf]) -> Result<DeviceOpens, OpenWatchError> {
        let dev_dir = dev_dirs
            .first()
            .map(PathBuf::as_path)
            .unwrap_or(Path::new("/dev"));
        // SAFETY: plain syscall; the result is checked before use.
        let raw = unsafe {
            libc::fanotify_init(
                libc::FAN_CLASS_NOTIF
                    | libc::FAN_REPORT_FID
                    | libc::FAN_CLOEXEC
                    | libc::FAN_NONBLOCK,
                (libc::O_RDONLY | libc::O_CLOEXEC) as libc::c_uint,
            )
        };
        if raw < 0 {
            return Err(OpenWatchError::Init(Errno::from_raw_os_error(
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            )));
        }
        // SAFETY: a new descriptor that nothing else owns.
        let group = unsafe { OwnedFd::from_raw_fd(raw) };
        let mut watch = DeviceOpens {
            group,
            dev_dirs: dev_dirs.to_vec(),
            own_pid: std::process::id(),
            marked: 0,
        };
        let last = watch.mark_all();
        if watch.marked == 0 {
            return Err(OpenWatchError::NothingMarked {
                dir: dev_dir.to_path_buf(),
                last,
            });
        }
        Ok(watch)
    }

    /// Marks the directory's `nvidia*` files again: a file created since (a GPU that
    /// appeared, a driver reload that made new nodes) is watched from now on; marking a
    /// watched file again changes nothing. Directories (`nvidia-caps`) and links (opening a
    /// link opens its target, which is marked if it is a device file here) are left out.
    /// Returns the last file whose mark failed, with why.
    pub fn mark_all(&mut self) -> Option<(PathBuf, Errno)> {
        let (mut marked, mut last) = (BTreeSet::new(), None);
        let entries = self
            .dev_dirs
            .iter()
            .filter_map(|d| std::fs::read_dir(d).ok())
            .flat_map(|entries| entries.flatten());
        for e in entries {
            let name = e.file_name();
            if !name.as_encoded_bytes().starts_with(b"nvidia") {
                continue;
            }
            // The same file reached through both directories is marked, and counted, once.
            let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if meta.is_dir() || meta.file_type().is_symlink() {
                continue;
            }
            let id = {
                use std::os::unix::fs::MetadataExt;
                (meta.dev(), meta.ino())
            };
            if marked.contains(&id) {
                continue;
            }
            let Ok(path) = std::ffi::CString::new(e.path().into_os_string().into_encoded_bytes())
            else {
                continue;
            };
            // SAFETY: a valid group descriptor and a NUL-terminated path.
            let r = unsafe {
                libc::fanotify_mark(
                    self.group.as_raw_fd(),
                    libc::FAN_MARK_ADD | libc::FAN_MARK_DONT_FOLLOW,
                    libc::FAN_OPEN,
                    libc::AT_FDCWD,
                    path.as_ptr(),
                )
            };
            if r == 0 {
                marked.insert(id);
            } else {
                let errno = Errno::from_raw_os_error(
                    std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
                );
                last = Some((e.path(), errno));
            }
        }
        self.marked = marked.len();
        last
    }

    /// How many files are watched.
    pub fn watched_files(&self) -> usize {
        self.marked
    }

    /// The group's descriptor: readable when an open was seen.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.group.as_fd()
    }

    /// Everything seen since the last drain, without blocking. An error other than "nothing
    /// to read" is returned: a group that cannot be read stays readable, and polling it again
    /// would spin, so the caller stops watching.
    pub fn drain(&mut self) -> Result<Openers, Errno> {
        let mut found = Openers::default();
        let mut buf = vec![0u8; READ_BYTES];
        for _ in 0..MAX_READS {
            match rustix::io::read(&self.group, &mut buf) {
                Ok(0) | Err(Errno::AGAIN) => break,
                Ok(n) => read_events(&buf[..n], self.own_pid, &mut found, |fd| {
                    // Not asked for (a FID group reports none), but never leaked if one came.
                    // SAFETY: the kernel installed this descriptor for us; nothing else owns it.
                    drop(unsafe { OwnedFd::from_raw_fd(fd) });
                }),
                Err(Errno::INTR) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(found)
    }
}

/// Adds the openers of the events in `bytes` (a read of the group) to `found`. A malformed
/// or unknown record ends the parse: the rest of that read is dropped, and the drain is
/// marked overflowed so that a full scan makes up for it.
pub fn parse_events(bytes: &[u8], own_pid: u32, found: &mut Openers) {
    read_events(bytes, own_pid, found, |_| {});
}

/// [`parse_events`], handing each event's descriptor (`fd >= 0`) to `close`: only bytes the
/// kernel wrote carry descriptors that are ours to close.
fn read_events(bytes: &[u8], own_pid: u32, found: &mut Openers, mut close: impl FnMut(i32)) {
    let mut at = 0usize;
    while bytes.len().saturating_sub(at) >= METADATA_LEN {
        let field = |off: usize, len: usize| &bytes[at + off..at + off + len];
        let event_len = u32::from_ne_bytes(field(0, 4).try_into().expect("4 bytes")) as usize;
        let version = field(4, 1)[0];
        let metadata_len = u16::from_ne_bytes(field(6, 2).try_into().expect("2 bytes")) as usize;
        let mask = u64::from_ne_bytes(field(8, 8).try_into().expect("8 bytes"));
        let fd = i32::from_ne_bytes(field(16, 4).try_into().expect("4 bytes"));
        let pid = i32::from_ne_bytes(field(20, 4).try_into().expect("4 bytes"));
        if version != METADATA_VERSION
            || metadata_len < METADATA_LEN
            || event_len < metadata_len
            || event_len > bytes.len() - at
        {
            found.overflowed = true;
            return;
        }
        if fd >= 0 {
            close(fd);
        }
        if mask & libc::FAN_Q_OVERFLOW != 0 {
            found.overflowed = true;
        } else if mask & libc::FAN_OPEN != 0
            && let Ok(pid) = u32::try_from(pid)
            && pid > 0
            && pid != own_pid
        {
            if found.pids.len() < MAX_OPENERS {
                found.pids.insert(pid);
            } else if !found.pids.contains(&pid) {
                found.overflowed = true;
            }
        }
        at += event_len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(mask: u64, pid: i32, extra: usize) -> Vec<u8> {
        let len = (METADATA_LEN + extra) as u32;
        let mut b = Vec::new();
        b.extend_from_slice(&len.to_ne_bytes());
        b.push(METADATA_VERSION);
        b.push(0);
        b.extend_from_slice(&(METADATA_LEN as u16).to_ne_bytes());
        b.extend_from_slice(&mask.to_ne_bytes());
        b.extend_from_slice(&(-1i32).to_ne_bytes());
        b.extend_from_slice(&pid.to_ne_bytes());
        b.extend(std::iter::repeat_n(0xAB, extra));
        b
    }

    #[test]
    fn openers_are_read_past_info_records_and_our_own_opens_are_left_out() {
        let mut bytes = event(libc::FAN_OPEN, 41, 28);
        bytes.extend(event(libc::FAN_OPEN, 7, 0));
        bytes.extend(event(libc::FAN_OPEN, 41, 40));
        bytes.extend(event(libc::FAN_OPEN, 0, 0));
        let mut found = Openers::default();
        parse_events(&bytes, 7, &mut found);
        assert_eq!(found.pids.into_iter().collect::<Vec<_>>(), vec![41]);
        assert!(!found.overflowed);
    }

    #[test]
    fn a_lost_event_or_a_torn_record_asks_for_a_full_scan() {
        let mut found = Openers::default();
        parse_events(&event(libc::FAN_Q_OVERFLOW, -1, 0), 1, &mut found);
        assert!(found.overflowed && found.pids.is_empty());

        let mut torn = event(libc::FAN_OPEN, 5, 0);
        torn.extend(&event(libc::FAN_OPEN, 6, 16)[..30]);
        let mut found = Openers::default();
        parse_events(&torn, 1, &mut found);
        assert_eq!(found.pids.iter().copied().collect::<Vec<_>>(), vec![5]);
        // A length past the end of the read.
        let mut bad = event(libc::FAN_OPEN, 5, 0);
        bad[0..4].copy_from_slice(&1000u32.to_ne_bytes());
        let mut found = Openers::default();
        parse_events(&bad, 1, &mut found);
        assert!(found.overflowed && found.pids.is_empty());
    }

    #[test]
    fn hostile_bytes_never_panic() {
        use proptest::prelude::*;
        proptest!(|(bytes in proptest::collection::vec(any::<u8>(), 0..400))| {
            let mut found = Openers::default();
            parse_events(&bytes, 1, &mut found);
        });
    }

    /// Random bytes almost never make a valid header: here every record but the last is
    /// well-formed (random masks, pids and info lengths), and the last is cut anywhere.
    #[test]
    fn well_formed_records_are_all_read_and_a_cut_last_one_never_panics() {
        use proptest::prelude::*;
        let records = proptest::collection::vec(
            (
                prop_oneof![
                    Just(libc::FAN_OPEN),
                    Just(libc::FAN_Q_OVERFLOW),
                    Just(libc::FAN_OPEN | libc::FAN_ONDIR),
                    any::<u64>()
                ],
                -3i32..100_000,
                0usize..64,
            ),
            0..40,
        );
        proptest!(|(records in records, cut in 0usize..200)| {
            let mut bytes = Vec::new();
            let mut openers = std::collections::BTreeSet::new();
            let mut overflow = false;
            for (mask, pid, extra) in &records {
                bytes.extend(event(*mask, *pid, *extra));
                if mask & libc::FAN_Q_OVERFLOW != 0 {
                    overflow = true;
                } else if mask & libc::FAN_OPEN != 0 && *pid > 0 && *pid != 1 {
                    openers.insert(*pid as u32);
                }
            }
            let whole = bytes.len();
            let mut found = Openers::default();
            parse_events(&bytes, 1, &mut found);
            prop_assert_eq!(&found.pids, &openers);
            prop_assert_eq!(found.overflowed, overflow);
            // The same with a torn record after them: the whole ones still count.
            bytes.extend(event(libc::FAN_OPEN, 99_999, 16));
            bytes.truncate(whole + cut.min(METADATA_LEN + 15));
            let mut found = Openers::default();
            parse_events(&bytes, 1, &mut found);
            prop_assert!(openers.is_subset(&found.pids));
        });
    }

    #[test]
    fn an_open_by_another_process_is_reported_once_drained() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["nvidia0", "nvidiactl", "other"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        // A directory (`nvidia-caps`) and a link are not device files to mark.
        std::fs::create_dir(dir.path().join("nvidia-caps")).unwrap();
        std::os::unix::fs::symlink("nvidia0", dir.path().join("nvidia-link")).unwrap();
        let mut watch = DeviceOpens::new(dir.path()).expect("root can watch opens");
        assert_eq!(watch.watched_files(), 2);
        let twice = DeviceOpens::of_dirs(&[dir.path().to_path_buf(), dir.path().join(".")])
            .expect("root can watch opens");
        assert_eq!(
            twice.watched_files(),
            2,
            "one file reached twice is one file"
        );
        // Our own open is left out.
        drop(std::fs::File::open(dir.path().join("nvidia0")).unwrap());
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "exec 3<{} 4<{}",
                dir.path().join("other").display(),
                dir.path().join("nvidiactl").display()
            ))
            .status()
            .unwrap();
        assert!(child.success());
        let mut found = watch.drain().unwrap();
        // The shell's pid is gone by now; what matters is that exactly one opener was seen.
        assert_eq!(found.pids.len(), 1, "{found:?}");
        assert!(!found.overflowed);
        assert!(!found.pids.contains(&std::process::id()));
        found = watch.drain().unwrap();
        assert!(found.pids.is_empty(), "a drain reports each open once");
    }
}
