//! Host memory: `meminfo`, memory pressure, pinned and locked memory per process, and the
//! shared-memory segments in `/dev/shm` (or other tmpfs directories) with the processes that
//! map them or hold them open.
//!
//! Segments are matched to their users by device and inode, never by path: a process in a
//! container sees its own `/dev/shm` under the same name.

use crate::parse::StatusMemory;
use crate::procfs::{Found, ProcError, ProcFs};
use rustix::fd::{AsFd, OwnedFd};
use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use vramguard_core::host::{MemoryPressure, ProcessHostMemory, ShmDirFacts, ShmSegmentFacts};

/// Entries read from one shared-memory directory at most; the rest are counted as not seen.
pub const MAX_SEGMENTS: usize = 20_000;

/// `MemTotal` and `MemAvailable` from `meminfo`, bytes.
pub fn meminfo(fs: &ProcFs) -> (Option<u64>, Option<u64>) {
    let mut buf = Vec::new();
    if !matches!(fs.read_into("meminfo", &mut buf), Ok(Found::Yes(()))) {
        return (None, None);
    }
    crate::parse::parse_meminfo(&buf)
}

/// `pressure/memory`, where the kernel has PSI.
pub fn pressure(fs: &ProcFs) -> Option<MemoryPressure> {
    let mut buf = Vec::new();
    if !matches!(
        fs.read_into("pressure/memory", &mut buf),
        Ok(Found::Yes(()))
    ) {
        return None;
    }
    crate::parse::parse_pressure(&buf)
}

/// Opens a directory without following a link at its last component.
pub fn open_dir_no_follow(path: &Path) -> rustix::io::Result<OwnedFd> {
    rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// The regular files directly in `path` (a tmpfs), without their users.
pub fn scan_dir(path: &Path) -> ShmDirFacts {
    let mut facts = ShmDirFacts {
        path: path.display().to_string(),
        ..ShmDirFacts::default()
    };
    let fd = match open_dir_no_follow(path) {
        Ok(fd) => fd,
        Err(e) => {
            facts.error = Some(format!(
                "{}: {} (a shared-memory directory must be a directory, not a link)",
                path.display(),
                std::io::Error::from(e)
            ));
            return facts;
        }
    };
    if let Ok(st) = rustix::fs::fstat(&fd) {
        facts.dev = st.st_dev;
    }
    if let Ok(vfs) = rustix::fs::fstatvfs(&fd) {
        let frsize = vfs.f_frsize.max(1);
        facts.size_bytes = Some(vfs.f_blocks.saturating_mul(frsize));
        facts.used_bytes = Some(
            vfs.f_blocks
                .saturating_sub(vfs.f_bfree)
                .saturating_mul(frsize),
        );
    }
    let Ok(mut dir) = rustix::fs::Dir::read_from(&fd) else {
        facts.error = Some(format!("{}: cannot list it", path.display()));
        return facts;
    };
    while let Some(entry) = dir.read() {
        let Ok(entry) = entry else { break };
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        if facts.segments.len() + facts.other_entries as usize >= MAX_SEGMENTS {
            facts.truncated = true;
            break;
        }
        // Cached attributes: an entry that is a user's FUSE mount point must not make the
        // scan wait on a daemon that never answers.
        let Ok(st) = rustix::fs::statx(
            &fd,
            entry.file_name(),
            AtFlags::SYMLINK_NOFOLLOW | AtFlags::STATX_DONT_SYNC,
            rustix::fs::StatxFlags::BASIC_STATS,
        ) else {
            continue;
        };
        if FileType::from_raw_mode(u32::from(st.stx_mode)) != FileType::RegularFile {
            facts.other_entries += 1;
            continue;
        }
        let ms = |t: rustix::fs::StatxTimestamp| {
            (t.tv_sec.max(0) as u64) * 1000 + u64::from(t.tv_nsec) / 1_000_000
        };
        let text = std::str::from_utf8(name);
        facts.segments.push(ShmSegmentFacts {
            name: String::from_utf8_lossy(name).into_owned(),
            exact_name: text.is_ok(),
            inode: st.stx_ino,
            bytes: st.stx_blocks.saturating_mul(512),
            size: st.stx_size,
            uid: st.stx_uid,
            modified_ms: ms(st.stx_mtime),
            changed_ms: ms(st.stx_ctime),
            users: Vec::new(),
        });
    }
    facts.segments.sort_by(|a, b| a.name.cmp(&b.name));
    facts
}

/// A statx's device as `st_dev` gives it.
fn dev_of(st: &rustix::fs::Statx) -> u64 {
    rustix::fs::makedev(st.stx_dev_major, st.stx_dev_minor)
}

/// What one pass over the processes found on the shared-memory filesystems.
#[derive(Debug, Default)]
pub struct ShmUse {
    /// Per (device, inode): the pids that map the file or hold it open.
    pub users: HashMap<(u64, u64), BTreeSet<u32>>,
    /// Processes whose maps or fds could not be read (not root, or a read failed).
    pub unreadable: Vec<u32>,
    /// Processes whose maps were read.
    pub read: usize,
}

/// What one process maps or holds open on the shared-memory filesystems.
#[derive(Debug)]
pub enum ShmUseOf {
    /// Its maps and fds were read: the (device, inode) of each such file.
    Read(Vec<(u64, u64)>),
    /// It exited meanwhile.
    Gone,
    /// Its maps or fds could not be read (not root, a read failed, maps cut at the cap).
    Unreadable,
}

/// Which files on one of `devs` (the shared-memory filesystems) `pid` maps or holds open.
/// Mappings are matched by device and inode whatever their path; open files are stat'ed
/// only when their path lies under one of `dirs` (a stat of any other open file could hang
/// on a network filesystem). The maps are read under the process's mmap lock: the collector
/// calls this on its address-space workers, with a deadline.
pub fn shm_use_of(fs: &ProcFs, pid: u32, devs: &BTreeSet<u64>, dirs: &[PathBuf]) -> ShmUseOf {
    let mut buf = Vec::new();
    let mut files = Vec::new();
    match fs.read_into(&format!("{pid}/maps"), &mut buf) {
        // A maps file cut at the read cap may hide a mapping: that process is unchecked.
        Ok(Found::Yes(())) if buf.len() >= crate::procfs::MAX_PROC_FILE => {
            return ShmUseOf::Unreadable;
        }
        Ok(Found::Yes(())) => {
            for (dev, inode, _) in crate::parse::parse_maps_files(&buf) {
                if devs.contains(&dev) {
                    files.push((dev, inode));
                }
            }
        }
        Ok(Found::Gone) => return ShmUseOf::Gone,
        _ => return ShmUseOf::Unreadable,
    }
    match open_fds(fs, pid, devs, dirs) {
        Found::Yes(open) => files.extend(open),
        Found::Gone => {}
        Found::Denied => return ShmUseOf::Unreadable,
    }
    ShmUseOf::Read(files)
}

impl ShmUse {
    /// The users of each file, from each pid's [`shm_use_of`] (`None`: a read given up at its
    /// deadline, so that process is unchecked).
    pub fn merge(pids: &[u32], read: Vec<Option<ShmUseOf>>) -> ShmUse {
        let mut found = ShmUse::default();
        for (&pid, use_of) in pids.iter().zip(read) {
            match use_of {
                Some(ShmUseOf::Read(files)) => {
                    found.read += 1;
                    for key in files {
                        found.users.entry(key).or_default().insert(pid);
                    }
                }
                Some(ShmUseOf::Gone) => {}
                Some(ShmUseOf::Unreadable) | None => found.unreadable.push(pid),
            }
        }
        found
    }
}

/// The (device, inode) of each of `pid`'s open files that lies on one of `devs`.
fn open_fds(
    fs: &ProcFs,
    pid: u32,
    devs: &BTreeSet<u64>,
    dirs: &[PathBuf],
) -> Found<Vec<(u64, u64)>> {
    let path = fs.root().join(format!("{pid}/fd"));
    let fd = match rustix::fs::open(
        &path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT | rustix::io::Errno::SRCH) => return Found::Gone,
        Err(_) => return Found::Denied,
    };
    let Ok(mut dir) = rustix::fs::Dir::read_from(&fd) else {
        return Found::Denied;
    };
    let mut files = Vec::new();
    let mut link = Vec::with_capacity(256);
    while let Some(entry) = dir.read() {
        let Ok(entry) = entry else {
            return Found::Gone;
        };
        if entry.file_name().to_bytes().first() == Some(&b'.') {
            continue;
        }
        // Only files under a shared-memory directory are stat'ed: sockets, pipes, anonymous
        // inodes and every other file are skipped without touching them.
        link.clear();
        match rustix::fs::readlinkat(fd.as_fd(), entry.file_name(), std::mem::take(&mut link)) {
            Ok(target) => {
                let bytes = target.into_bytes();
                let under = dirs
                    .iter()
                    .any(|d| Path::new(std::ffi::OsStr::from_bytes(&bytes)).starts_with(d));
                link = bytes;
                if !under {
                    continue;
                }
            }
            // Closed meanwhile: nothing to check. Anything else leaves the process unchecked.
            Err(rustix::io::Errno::NOENT) => continue,
            Err(_) => return Found::Denied,
        }
        match rustix::fs::statx(
            &fd,
            entry.file_name(),
            AtFlags::STATX_DONT_SYNC,
            rustix::fs::StatxFlags::INO,
        ) {
            Ok(st) if devs.contains(&dev_of(&st)) => files.push((dev_of(&st), st.stx_ino)),
            Ok(_) | Err(rustix::io::Errno::NOENT) => {}
            // A file vramguard cannot stat might be a segment: the process stays unchecked.
            Err(_) => return Found::Denied,
        }
    }
    Found::Yes(files)
}

/// Pinned, locked and shared memory of one process: `status` (`VmPin`, `VmLck`, `RssShmem`)
/// and `maps` (each shared-memory file once, at its largest mapping). `Gone` when it exited
/// before a file of it was read (with `status` figures reused and the maps not read, none
/// is: the figures are then this collection's).
/// `status_memory`: the `status` figures when this collection has already read them.
///
/// The maps (tens of µs each, most of a host-memory pass over hundreds of holders) are read
/// only where they can name a segment: some shared-memory directory is watched, and the
/// process has shared memory in its page tables (`RssShmem` above 0, or a kernel without
/// it). A process with none resident at all (its segments never touched, or swapped out)
/// is counted as mapping none; one with any, at each segment's largest mapping. The
/// segments' users, found apart, name it either way.
pub fn process_memory(
    fs: &ProcFs,
    pid: u32,
    devs: &BTreeSet<u64>,
    status_memory: Option<StatusMemory>,
) -> Result<Found<ProcessHostMemory>, ProcError> {
    let mut buf = Vec::new();
    let mut memory = ProcessHostMemory::default();
    let status = match status_memory {
        Some(read) => read,
        None => match fs.read_into(&format!("{pid}/status"), &mut buf)? {
            Found::Yes(()) => crate::parse::parse_status_memory(&buf),
            Found::Gone => return Ok(Found::Gone),
            Found::Denied => StatusMemory::default(),
        },
    };
    memory.pinned_bytes = status.pinned;
    memory.locked_bytes = status.locked;
    if devs.is_empty() || status.shmem_resident == Some(0) {
        memory.shm_bytes = Some(0);
        return Ok(Found::Yes(memory));
    }
    let maps = fs.read_into(&format!("{pid}/maps"), &mut buf)?;
    if maps == Found::Gone {
        // Gone since its status was read (or, with figures reused, since the collection
        // began): no figures rather than empty ones.
        return Ok(Found::Gone);
    }
    if let Found::Yes(()) = maps {
        let mut largest: BTreeMap<(u64, u64), u64> = BTreeMap::new();
        for (dev, inode, len) in crate::parse::parse_maps_files(&buf) {
            if devs.contains(&dev) {
                let e = largest.entry((dev, inode)).or_default();
                *e = (*e).max(len);
            }
        }
        memory.shm_bytes = Some(largest.values().sum());
    }
    Ok(Found::Yes(memory))
}

/// Removes `name` from `dir` if it still is the regular file (`dev`, `inode`) that was
/// judged: the directory is opened without following links, the name is looked at without
/// following one, and `unlinkat` works relative to that directory, so a link planted
/// anywhere on the path is never followed.
pub fn remove_segment(
    dir: &Path,
    name: &str,
    dev: u64,
    inode: u64,
) -> Result<(), SegmentRemovalError> {
    let fail = |why: String| SegmentRemovalError {
        path: dir.join(name),
        why,
    };
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(fail("not a plain file name".into()));
    }
    let fd = open_dir_no_follow(dir).map_err(|e| {
        fail(format!(
            "the directory cannot be opened without following a link: {}",
            std::io::Error::from(e)
        ))
    })?;
    // In a directory everyone may write that is not sticky, anyone may rename another user's
    // file under the judged name between this look and the unlink.
    let dir_st =
        rustix::fs::fstat(&fd).map_err(|e| fail(format!("{}", std::io::Error::from(e))))?;
    if dir_st.st_mode & 0o002 != 0 && dir_st.st_mode & 0o1000 == 0 {
        return Err(fail(
            "its directory is writable by every user and not sticky: a name there proves \
             nothing (chmod +t it)"
                .into(),
        ));
    }
    let st = rustix::fs::statat(&fd, name, AtFlags::SYMLINK_NOFOLLOW)
        .map_err(|e| fail(format!("{}", std::io::Error::from(e))))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(fail("no longer a regular file".into()));
    }
    if st.st_dev != dev || st.st_ino != inode {
        return Err(fail(format!(
            "the name now belongs to another file (inode {} instead of {inode})",
            st.st_ino
        )));
    }
    if st.st_nlink != 1 {
        // Removing one name frees nothing, and the file may be someone's under another name.
        return Err(fail(format!(
            "the file has {} names (hard links): removing this one would free nothing",
            st.st_nlink
        )));
    }
    rustix::fs::unlinkat(&fd, name, AtFlags::empty())
        .map_err(|e| fail(format!("{}", std::io::Error::from(e))))
}

/// Why a segment was not removed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {why}", path.display())]
pub struct SegmentRemovalError {
    /// The segment.
    pub path: PathBuf,
    /// What stopped it.
    pub why: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::{parse_maps_files, parse_meminfo, parse_pressure, parse_status_memory};
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn maps_lines_give_device_inode_and_length() {
        let maps = b"7f0000000000-7f0000800000 rw-s 00000000 00:1a 4242   /dev/shm/torch_1\n\
            7f0000800000-7f0000801000 rw-p 00000000 00:00 0 \n\
            7f1000000000-7f1000002000 r--s 00000000 fd:01 99  /usr/lib/x (deleted)\n\
            garbage line\n\
            ffff-0000 rw-s 0 00:1a 5 /dev/shm/backwards\n";
        let got: Vec<(u64, u64, u64)> = parse_maps_files(maps).collect();
        assert_eq!(
            got,
            [
                (rustix::fs::makedev(0, 0x1a), 4242, 8 << 20),
                (rustix::fs::makedev(0xfd, 1), 99, 8192)
            ]
        );
    }

    #[test]
    fn meminfo_pressure_and_locked_memory_parse_and_refuse_nonsense() {
        assert_eq!(
            parse_meminfo(b"MemTotal:       65536 kB\nMemFree: 1 kB\nMemAvailable:   1024 kB\n"),
            (Some(64 << 20), Some(1 << 20))
        );
        assert_eq!(parse_meminfo(b"MemTotal: lots\n"), (None, None));
        let p = parse_pressure(
            b"some avg10=1.50 avg60=0.25 avg300=0.00 total=1\nfull avg10=0.50 avg60=0.00 avg300=0.00 total=1\n",
        )
        .unwrap();
        assert_eq!((p.some_avg10, p.some_avg60, p.full_avg10), (1.5, 0.25, 0.5));
        assert!(parse_pressure(b"some avg10=NaN avg60=1\n").is_none());
        assert_eq!(
            parse_status_memory(
                b"Name:\tpython\nVmLck:\t    4096 kB\nVmPin:\t       0 kB\nRssShmem:\t  8 kB\n"
            ),
            StatusMemory {
                pinned: Some(0),
                locked: Some(4 << 20),
                shmem_resident: Some(8 << 10),
            }
        );
    }

    /// A process whose `maps` is gone after its `status` was read left meanwhile: it has no
    /// figures, not "no shared memory".
    #[test]
    fn a_process_gone_before_its_maps_were_read_has_no_figures() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("42")).unwrap();
        std::fs::write(dir.path().join("42/status"), "VmPin:\t8 kB\nVmLck:\t4 kB\n").unwrap();
        let fs = ProcFs::open(dir.path()).unwrap();
        let devs = BTreeSet::from([1u64]);
        assert_eq!(
            process_memory(&fs, 42, &devs, None).unwrap(),
            Found::Gone,
            "maps gone"
        );
        assert_eq!(
            process_memory(
                &fs,
                42,
                &devs,
                Some(StatusMemory {
                    pinned: Some(1),
                    locked: Some(2),
                    shmem_resident: None
                })
            )
            .unwrap(),
            Found::Gone,
            "status figures reused, maps gone"
        );
        // With its maps there, it has figures.
        std::fs::write(dir.path().join("42/maps"), "").unwrap();
        let Found::Yes(m) = process_memory(&fs, 42, &devs, None).unwrap() else {
            panic!("maps read");
        };
        assert_eq!((m.pinned_bytes, m.locked_bytes), (Some(8192), Some(4096)));
        assert_eq!(m.shm_bytes, Some(0));
    }

    /// The maps are read only where they can name a segment: with no shared-memory
    /// directory watched, or no shared memory in the process's page tables, its shared
    /// memory is none, unread.
    #[test]
    fn maps_are_read_only_where_shared_memory_is_resident_and_watched() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("42")).unwrap();
        let maps = "7f0000000000-7f0000800000 rw-s 00000000 00:1a 4242 /dev/shm/torch_1\n";
        std::fs::write(dir.path().join("42/maps"), maps).unwrap();
        let fs = ProcFs::open(dir.path()).unwrap();
        let shm_dev = BTreeSet::from([rustix::fs::makedev(0, 0x1a)]);
        let shm = |status: &str, devs: &BTreeSet<u64>| {
            std::fs::write(dir.path().join("42/status"), status).unwrap();
            match process_memory(&fs, 42, devs, None).unwrap() {
                Found::Yes(m) => m.shm_bytes,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(
            shm("VmPin:\t0 kB\nRssShmem:\t4 kB\n", &shm_dev),
            Some(8 << 20)
        );
        assert_eq!(
            shm("VmPin:\t0 kB\n", &shm_dev),
            Some(8 << 20),
            "an old kernel"
        );
        assert_eq!(shm("VmPin:\t0 kB\nRssShmem:\t0 kB\n", &shm_dev), Some(0));
        // Unread: without the maps file, a read of it would say the process is gone.
        std::fs::remove_file(dir.path().join("42/maps")).unwrap();
        assert_eq!(shm("RssShmem:\t0 kB\n", &shm_dev), Some(0));
        assert_eq!(shm("RssShmem:\t4 kB\n", &BTreeSet::new()), Some(0));
    }

    #[test]
    fn a_segment_is_removed_only_while_it_is_the_file_judged() {
        let dir = tempfile::tempdir().unwrap();
        let seg = dir.path().join("torch_1");
        std::fs::write(&seg, b"x").unwrap();
        let m = std::fs::metadata(&seg).unwrap();
        // Replaced by another file under the same name (made while the first still exists,
        // so its inode differs, then renamed over it): kept.
        std::fs::write(dir.path().join("other"), b"y").unwrap();
        std::fs::rename(dir.path().join("other"), &seg).unwrap();
        assert_ne!(std::fs::metadata(&seg).unwrap().ino(), m.ino());
        let e = remove_segment(dir.path(), "torch_1", m.dev(), m.ino()).unwrap_err();
        assert!(e.why.contains("another file"), "{e}");
        assert!(seg.exists());
        let now = std::fs::metadata(&seg).unwrap();
        // A link, a FIFO, a name with a slash: refused.
        std::os::unix::fs::symlink(&seg, dir.path().join("torch_link")).unwrap();
        let e = remove_segment(dir.path(), "torch_link", now.dev(), now.ino()).unwrap_err();
        assert!(e.why.contains("regular file"), "{e}");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            dir.path().join("torch_fifo"),
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert!(remove_segment(dir.path(), "torch_fifo", now.dev(), now.ino()).is_err());
        assert!(remove_segment(dir.path(), "../torch_1", now.dev(), now.ino()).is_err());
        // A directory reached through a link is not followed.
        let via = dir.path().join("via");
        std::os::unix::fs::symlink(dir.path(), &via).unwrap();
        let e = remove_segment(&via, "torch_1", now.dev(), now.ino()).unwrap_err();
        assert!(e.why.contains("without following a link"), "{e}");
        assert!(seg.exists());
        // In a directory everyone may write that is not sticky: kept (red-team finding).
        let perms = |mode| {
            std::fs::set_permissions(
                dir.path(),
                std::os::unix::fs::PermissionsExt::from_mode(mode),
            )
            .unwrap()
        };
        perms(0o777);
        let e = remove_segment(dir.path(), "torch_1", now.dev(), now.ino()).unwrap_err();
        assert!(e.why.contains("not sticky"), "{e}");
        perms(0o1777);
        // A file with another name (a hard link): kept (red-team finding).
        std::fs::hard_link(&seg, dir.path().join("kept_elsewhere")).unwrap();
        let e = remove_segment(dir.path(), "torch_1", now.dev(), now.ino()).unwrap_err();
        assert!(e.why.contains("hard links"), "{e}");
        std::fs::remove_file(dir.path().join("kept_elsewhere")).unwrap();
        // The file judged: removed.
        remove_segment(dir.path(), "torch_1", now.dev(), now.ino()).unwrap();
        assert!(!seg.exists());
        assert!(dir.path().join("torch_link").symlink_metadata().is_ok());
    }

    #[test]
    fn a_directory_scan_lists_regular_files_and_counts_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("torch_1"), vec![0u8; 10_000]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("torch_link")).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        let facts = scan_dir(dir.path());
        assert_eq!(facts.error, None);
        let names: Vec<&str> = facts.segments.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["torch_1"]);
        assert_eq!(facts.other_entries, 2);
        assert!(facts.segments[0].bytes >= 8192 && facts.segments[0].size == 10_000);
        let link = dir.path().join("dir_link");
        std::os::unix::fs::symlink(dir.path(), &link).unwrap();
        assert!(scan_dir(&link).error.unwrap().contains("not a link"));
    }
}
