//! Files that other users may have planted, opened safely.
//!
//! vramguard runs as root and reads and writes paths an administrator typed, some of them in
//! directories other users can write to. So:
//! - a file it **reads** (config, snapshot, simulator state) must be a regular file: it is
//!   opened non-blocking (a FIFO cannot stall the open), checked with `fstat`, and read up to a
//!   size limit (`/dev/zero` or a 2 GB file is refused, not read);
//! - a file it **writes** (audit log, summaries) is opened with `O_NOFOLLOW` (a symlink planted
//!   where it writes is refused, a dangling one creates nothing), must be a regular file with
//!   one link (a hard link to another file would have root write into that file) owned by the
//!   caller or root (a file another user planted there stays theirs to read and rewrite), is
//!   created mode 0600, and its directory may not be writable by everyone unless sticky. The
//!   audit log's directory must also be the caller's or root's and writable by no one else. A
//!   file replaced whole (a summary) is written to a new file created with `O_EXCL` beside it
//!   and renamed into place, so whatever stood at that name is never written through.
//!
//! Every error names the file and says what was wrong, in one line.
#![deny(missing_docs)]

use rustix::fs::{FileType, Mode, OFlags};
use rustix::io::Errno;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The largest config, snapshot or state file read: far above any real one.
pub const MAX_INPUT_BYTES: u64 = 64 << 20;

/// A file that could not be used, and why.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// It is a FIFO, a device, a directory or a socket where a regular file is meant.
    #[error("{path}: is a {kind}, not a regular file")]
    NotRegular {
        /// The file.
        path: PathBuf,
        /// What it is.
        kind: &'static str,
    },
    /// It is a symbolic link where vramguard writes.
    #[error(
        "{path}: is a symbolic link; vramguard does not write through links (name the file itself)"
    )]
    Symlink {
        /// The link.
        path: PathBuf,
    },
    /// Its directory can be written by every user and is not sticky: anyone could swap it.
    #[error(
        "{path}: its directory {dir} is writable by every user; choose a directory only root can write"
    )]
    UnsafeDirectory {
        /// The file.
        path: PathBuf,
        /// Its directory.
        dir: PathBuf,
    },
    /// It has more than one name: writing it would write the other file too.
    #[error(
        "{path}: has {links} hard links; vramguard does not write a file another name shares (remove the link, or name another file)"
    )]
    HardLinked {
        /// The file.
        path: PathBuf,
        /// Its link count.
        links: u64,
    },
    /// Root was to act on it (commands to run, files to remove), but someone else could
    /// write it.
    #[error(
        "{path}: {why}; root acts on what this file says, so only root may be able to change it (chown root, chmod go-w)"
    )]
    Untrusted {
        /// The file.
        path: PathBuf,
        /// Who else could write it.
        why: String,
    },
    /// It belongs to another user, who could read and rewrite what root writes there.
    #[error(
        "{path}: is owned by uid {owner}, not by root or the caller; remove it or name another file"
    )]
    NotOwned {
        /// The file (or directory).
        path: PathBuf,
        /// Its owner.
        owner: u32,
    },
    /// A directory where root keeps files that vramguard processes act on, or one above it,
    /// can be changed by someone other than root and the caller.
    #[error(
        "{dir}: {why}; vramguard keeps files it acts on only where no other user can swap them (make it and every directory above it root's and writable only by root: chown root, chmod go-w)"
    )]
    UntrustedDirectory {
        /// The directory found wanting.
        dir: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// It is larger than the limit.
    #[error("{path}: larger than {limit} bytes; is it the right file?")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// The limit.
        limit: u64,
    },
    /// Opening or reading it failed.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        cause: std::io::Error,
    },
}

impl FileError {
    /// What was wrong, without the path (for errors that name the file themselves).
    pub fn reason(&self) -> String {
        let full = self.to_string();
        let path = match self {
            FileError::NotRegular { path, .. }
            | FileError::Symlink { path }
            | FileError::UnsafeDirectory { path, .. }
            | FileError::HardLinked { path, .. }
            | FileError::NotOwned { path, .. }
            | FileError::Untrusted { path, .. }
            | FileError::TooLarge { path, .. }
            | FileError::UntrustedDirectory { dir: path, .. }
            | FileError::Io { path, .. } => path.display().to_string(),
        };
        full.strip_prefix(&format!("{path}: "))
            .map(str::to_string)
            .unwrap_or(full)
    }

    /// The error as an `std::io::Error` carrying [`FileError::reason`] (its kind kept for a
    /// missing file).
    pub fn into_io(self) -> std::io::Error {
        match self {
            FileError::Io { cause, .. } => cause,
            e => std::io::Error::other(e.reason()),
        }
    }

    /// Whether this user may not open the file (or a directory on its way).
    pub fn is_permission_denied(&self) -> bool {
        matches!(self, FileError::Io { cause, .. } if cause.kind() == std::io::ErrorKind::PermissionDenied)
    }

    /// Whether the file does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, FileError::Io { cause, .. } if cause.kind() == std::io::ErrorKind::NotFound)
    }
}

fn io(path: &Path) -> impl FnOnce(Errno) -> FileError + '_ {
    move |e| FileError::Io {
        path: path.to_path_buf(),
        cause: e.into(),
    }
}

fn kind_name(t: FileType) -> &'static str {
    match t {
        FileType::Fifo => "FIFO",
        FileType::Directory => "directory",
        FileType::CharacterDevice => "character device",
        FileType::BlockDevice => "block device",
        FileType::Socket => "socket",
        FileType::Symlink => "symbolic link",
        _ => "special file",
    }
}

fn check_regular(path: &Path, fd: &impl rustix::fd::AsFd) -> Result<rustix::fs::Stat, FileError> {
    let st = rustix::fs::fstat(fd).map_err(io(path))?;
    let t = FileType::from_raw_mode(st.st_mode);
    if t != FileType::RegularFile {
        return Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind: kind_name(t),
        });
    }
    Ok(st)
}

/// Reads the regular file at `path` (links followed), at most `max` bytes.
pub fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>, FileError> {
    read_bounded(path, max, OFlags::empty())
}

/// Like [`read_regular`], but a symbolic link at `path` is refused rather than followed:
/// for state another program writes (a container runtime's), where a link is not its own.
pub fn read_regular_no_link(path: &Path, max: u64) -> Result<Vec<u8>, FileError> {
    read_bounded(path, max, OFlags::NOFOLLOW)
}

/// Opens `path` for reading without blocking on a FIFO; with `NOFOLLOW` in `extra`, a link
/// is refused as not a regular file. The file is looked at before it is opened: opening some
/// devices has effects of its own (`/dev/watchdog` arms the watchdog, a tape rewinds), so a
/// path that names anything but a regular file (a planted symlink to a device) is refused
/// unopened. What is then opened must be the very file looked at (same device and inode), or
/// nothing is read from it; a link swapped in the moment between the look and the open is the
/// one case left.
fn open_for_reading(path: &Path, extra: OFlags) -> Result<rustix::fd::OwnedFd, FileError> {
    let fail = |e: Errno| {
        if e == Errno::LOOP && extra.contains(OFlags::NOFOLLOW) {
            FileError::NotRegular {
                path: path.to_path_buf(),
                kind: "symbolic link",
            }
        } else {
            io(path)(e)
        }
    };
    let at = rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC | extra, Mode::empty())
        .map_err(fail)?;
    let looked = check_regular(path, &at)?;
    let fd = rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | extra,
        Mode::empty(),
    )
    .map_err(fail)?;
    let opened = check_regular(path, &fd)?;
    if (opened.st_dev, opened.st_ino) != (looked.st_dev, looked.st_ino) {
        return Err(FileError::Io {
            path: path.to_path_buf(),
            cause: std::io::Error::other(
                "it changed between its check and its open (a link swapped?); look at it and try again",
            ),
        });
    }
    Ok(fd)
}

fn read_bounded(path: &Path, max: u64, extra: OFlags) -> Result<Vec<u8>, FileError> {
    let fd = open_for_reading(path, extra)?;
    let size = check_regular(path, &fd)?.st_size as u64;
    if size > max {
        return Err(FileError::TooLarge {
            path: path.to_path_buf(),
            limit: max,
        });
    }
    read_open(path, fd, size, max)
}

/// The rest of an open regular file of about `size` bytes, at most `max` of them.
fn read_open(
    path: &Path,
    fd: rustix::fd::OwnedFd,
    size: u64,
    max: u64,
) -> Result<Vec<u8>, FileError> {
    let mut buf = Vec::with_capacity(size.min(max) as usize);
    File::from(fd)
        .take(max + 1)
        .read_to_end(&mut buf)
        .map_err(|cause| FileError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
    if buf.len() as u64 > max {
        return Err(FileError::TooLarge {
            path: path.to_path_buf(),
            limit: max,
        });
    }
    Ok(buf)
}

/// A piece of a growing file, and which file it came from: a follower that sees another
/// device and inode, or a size below what it already read, knows the file was rotated or
/// truncated and starts again from its beginning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// The file's device.
    pub dev: u64,
    /// Its inode.
    pub ino: u64,
    /// Its size when it was read.
    pub size: u64,
    /// The bytes from the offset asked for, at most the bound given.
    pub bytes: Vec<u8>,
}

/// Reads at most `max` bytes from `offset` of the regular file at `path`, never through a
/// symbolic link and never from a FIFO (which would block) or a device: for following a log.
pub fn read_regular_from_no_link(path: &Path, offset: u64, max: u64) -> Result<Chunk, FileError> {
    use std::os::unix::fs::FileExt;
    let fd = open_for_reading(path, OFlags::NOFOLLOW)?;
    let st = check_regular(path, &fd)?;
    let size = st.st_size as u64;
    let want = size.saturating_sub(offset).min(max) as usize;
    let mut bytes = vec![0u8; want];
    let file = File::from(fd);
    let mut got = 0;
    while got < want {
        match file.read_at(&mut bytes[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(cause) => {
                return Err(FileError::Io {
                    path: path.to_path_buf(),
                    cause,
                });
            }
        }
    }
    bytes.truncate(got);
    Ok(Chunk {
        dev: st.st_dev,
        ino: st.st_ino,
        size,
        bytes,
    })
}

/// [`read_regular_to_string`] for a file root acts on (its config): read by root, it must be
/// root's and writable by no one else, links followed (a link is only as good as its target).
/// Read by another user, any file that user may read will do.
pub fn read_root_config_to_string(path: &Path, max: u64) -> Result<String, FileError> {
    let fd = open_for_reading(path, OFlags::empty())?;
    let st = check_regular(path, &fd)?;
    if rustix::process::geteuid().is_root() {
        let why = if st.st_uid != 0 {
            Some(format!("is owned by uid {}", st.st_uid))
        } else {
            writable_by_others(st.st_mode)
        };
        if let Some(why) = why {
            return Err(FileError::Untrusted {
                path: path.to_path_buf(),
                why,
            });
        }
    }
    let buf = read_open(path, fd, st.st_size as u64, max)?;
    String::from_utf8(buf).map_err(|_| FileError::Io {
        path: path.to_path_buf(),
        cause: std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"),
    })
}

/// [`read_regular`] as UTF-8 text.
pub fn read_regular_to_string(path: &Path, max: u64) -> Result<String, FileError> {
    String::from_utf8(read_regular(path, max)?).map_err(|_| FileError::Io {
        path: path.to_path_buf(),
        cause: std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"),
    })
}

fn check_directory(path: &Path) -> Result<(), FileError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let st = rustix::fs::stat(&dir).map_err(io(&dir))?;
    let mode = st.st_mode;
    if mode & 0o002 != 0 && mode & 0o1000 == 0 {
        return Err(FileError::UnsafeDirectory {
            path: path.to_path_buf(),
            dir,
        });
    }
    Ok(())
}

/// A file root may write: one link, owned by the caller or root.
fn check_ours(path: &Path, fd: &impl rustix::fd::AsFd) -> Result<(), FileError> {
    let st = rustix::fs::fstat(fd).map_err(io(path))?;
    if st.st_nlink > 1 {
        return Err(FileError::HardLinked {
            path: path.to_path_buf(),
            links: st.st_nlink as u64,
        });
    }
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid != 0 && st.st_uid != me {
        return Err(FileError::NotOwned {
            path: path.to_path_buf(),
            owner: st.st_uid,
        });
    }
    Ok(())
}

/// The audit log's directory: the caller's or root's, writable by no one else (group and
/// others could otherwise swap the log between two records).
fn check_private_directory(path: &Path) -> Result<(), FileError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let st = rustix::fs::stat(&dir).map_err(io(&dir))?;
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid != 0 && st.st_uid != me {
        return Err(FileError::NotOwned {
            path: dir,
            owner: st.st_uid,
        });
    }
    if st.st_mode & 0o022 != 0 {
        return Err(FileError::UnsafeDirectory {
            path: path.to_path_buf(),
            dir,
        });
    }
    Ok(())
}

/// Who besides the owner may write a file of `mode`, in words: `None` when no one.
fn writable_by_others(mode: u32) -> Option<String> {
    (mode & 0o022 != 0).then(|| {
        format!(
            "can be written by {} (mode {:o})",
            if mode & 0o002 != 0 {
                "every user"
            } else {
                "its group"
            },
            mode & 0o7777
        )
    })
}

/// Whether `dir` is a directory that only root (or the caller) can change, for files other
/// vramguard processes act on (the reset lock): it, and every directory above it, both as
/// named (a link on the way is only as safe as the directory holding it) and as resolved
/// (where the links lead), must be a directory owned by root or the caller and writable by
/// no one else. A directory above it may be writable by all if sticky (`/tmp`): no one else
/// can then rename or remove what root made in it.
pub fn check_private_directory_tree(dir: &Path) -> Result<(), FileError> {
    let absolute = if dir.is_absolute() {
        dir.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|cause| FileError::Io {
                path: dir.to_path_buf(),
                cause,
            })?
            .join(dir)
    };
    let resolved = std::fs::canonicalize(&absolute).map_err(|cause| FileError::Io {
        path: dir.to_path_buf(),
        cause,
    })?;
    let me = rustix::process::geteuid().as_raw();
    for named in [&absolute, &resolved] {
        for (i, step) in named.ancestors().enumerate() {
            let st = rustix::fs::stat(step).map_err(io(step))?;
            let wanting = |why: String| FileError::UntrustedDirectory {
                dir: step.to_path_buf(),
                why,
            };
            if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
                return Err(wanting("is not a directory".into()));
            }
            if st.st_uid != 0 && st.st_uid != me {
                return Err(wanting(format!("is owned by uid {}", st.st_uid)));
            }
            let sticky_above = i > 0 && st.st_mode & 0o1000 != 0;
            if let Some(why) = writable_by_others(st.st_mode).filter(|_| !sticky_above) {
                return Err(wanting(why));
            }
        }
    }
    Ok(())
}

fn open_for_writing(path: &Path, flags: OFlags) -> Result<File, FileError> {
    check_directory(path)?;
    // Read-write: the audit log reads its own last byte to repair a torn record.
    let fd = rustix::fs::open(
        path,
        flags
            | OFlags::RDWR
            | OFlags::CREATE
            | OFlags::NOFOLLOW
            | OFlags::NONBLOCK
            | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| match e {
        // O_NOFOLLOW on a link: ELOOP.
        Errno::LOOP => FileError::Symlink {
            path: path.to_path_buf(),
        },
        e => io(path)(e),
    })?;
    check_regular(path, &fd)?;
    check_ours(path, &fd)?;
    Ok(File::from(fd))
}

/// Opens `path` to append to it, creating it (mode 0600) if needed. Its directory must be
/// the caller's or root's and writable by no one else (the audit log's rule).
pub fn open_append(path: &Path) -> Result<File, FileError> {
    check_private_directory(path)?;
    open_for_writing(path, OFlags::APPEND)
}

/// Replaces `path` with a file holding `bytes` (mode 0600). What stands at `path` is checked
/// (a link, a FIFO, a file with another name or another owner is refused and left as it
/// is), then a new file is created beside it with `O_EXCL`, written, synced and renamed over
/// it: nothing is ever written through the old file.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<(), FileError> {
    write_file_mode(path, bytes, 0o600)
}

/// [`write_file`] for a file every user reads (a man page): `mode` exactly, whatever the
/// umask.
pub fn write_file_mode(path: &Path, bytes: &[u8], mode: u32) -> Result<(), FileError> {
    use std::io::Write;
    check_directory(path)?;
    match rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => {
            check_regular(path, &fd)?;
            check_ours(path, &fd)?;
        }
        Err(Errno::NOENT) => {}
        Err(Errno::LOOP) => {
            return Err(FileError::Symlink {
                path: path.to_path_buf(),
            });
        }
        Err(e) => return Err(io(path)(e)),
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(
        ".{}.{}.{}.tmp",
        name.as_deref().unwrap_or("vramguard"),
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    ));
    let fd = rustix::fs::open(
        &tmp,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(io(&tmp))?;
    let mut f = File::from(fd);
    let written = rustix::fs::fchmod(&f, Mode::from_raw_mode(mode))
        .map_err(std::io::Error::from)
        .and_then(|()| f.write_all(bytes))
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(cause) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(FileError::Io {
            path: path.to_path_buf(),
            cause,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, symlink};
    use std::time::{Duration, Instant};

    fn make_fifo(dir: &Path) -> PathBuf {
        let fifo = dir.join("fifo");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            &fifo,
            FileType::Fifo,
            Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        fifo
    }

    #[test]
    fn reads_refuse_fifos_devices_directories_and_oversize_files() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = make_fifo(dir.path());
        let t = Instant::now();
        let e = read_regular(&fifo, 100).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(1), "no hang on a FIFO");
        assert!(
            e.to_string().ends_with("is a FIFO, not a regular file"),
            "{e}"
        );
        let e = read_regular(Path::new("/dev/zero"), 100).unwrap_err();
        assert!(e.to_string().contains("character device"), "{e}");
        assert!(
            read_regular(dir.path(), 100)
                .unwrap_err()
                .to_string()
                .contains("directory")
        );
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'x'; 101]).unwrap();
        assert!(matches!(
            read_regular(&big, 100),
            Err(FileError::TooLarge { .. })
        ));
        assert_eq!(read_regular(&big, 101).unwrap().len(), 101);
        // A link to a regular file is read (config management links files into /etc).
        let link = dir.path().join("link");
        symlink(&big, &link).unwrap();
        assert_eq!(read_regular(&link, 200).unwrap().len(), 101);
        // Where links are not the file's own (another program's state), one is refused.
        assert!(matches!(
            read_regular_no_link(&link, 200),
            Err(FileError::NotRegular {
                kind: "symbolic link",
                ..
            })
        ));
        assert_eq!(read_regular_no_link(&big, 200).unwrap().len(), 101);
        assert!(
            read_regular(&dir.path().join("missing"), 1)
                .unwrap_err()
                .is_not_found()
        );
    }

    #[test]
    fn a_follower_reads_a_bounded_piece_from_an_offset_of_a_regular_file_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("audit.jsonl");
        std::fs::write(&log, b"0123456789").unwrap();
        let c = read_regular_from_no_link(&log, 3, 4).unwrap();
        assert_eq!(c.bytes, b"3456");
        assert_eq!(c.size, 10);
        let whole = read_regular_from_no_link(&log, 0, 100).unwrap();
        assert_eq!(whole.bytes, b"0123456789");
        assert_eq!((whole.dev, whole.ino), (c.dev, c.ino));
        // Past the end (a truncated file): nothing, and the size that says so.
        let past = read_regular_from_no_link(&log, 50, 100).unwrap();
        assert!(past.bytes.is_empty());
        assert_eq!(past.size, 10);
        let link = dir.path().join("link");
        symlink(&log, &link).unwrap();
        assert!(matches!(
            read_regular_from_no_link(&link, 0, 100),
            Err(FileError::NotRegular {
                kind: "symbolic link",
                ..
            })
        ));
        let fifo = make_fifo(dir.path());
        let t = Instant::now();
        assert!(matches!(
            read_regular_from_no_link(&fifo, 0, 100),
            Err(FileError::NotRegular { kind: "FIFO", .. })
        ));
        assert!(t.elapsed() < Duration::from_secs(1), "no hang on a FIFO");
    }

    #[test]
    fn writes_refuse_links_and_fifos_and_create_0600() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = dir.path().join("audit.jsonl");
        symlink(&victim, &link).unwrap();
        assert!(matches!(open_append(&link), Err(FileError::Symlink { .. })));
        assert!(matches!(
            write_file(&link, b"x"),
            Err(FileError::Symlink { .. })
        ));
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        // A dangling link creates nothing.
        let dangling = dir.path().join("dangling");
        symlink(dir.path().join("created-by-root"), &dangling).unwrap();
        assert!(open_append(&dangling).is_err());
        assert!(!dir.path().join("created-by-root").exists());
        // A FIFO is refused without blocking.
        let fifo = make_fifo(dir.path());
        assert!(matches!(
            open_append(&fifo),
            Err(FileError::NotRegular { .. }) | Err(FileError::Io { .. })
        ));
        // New files are private.
        let new = dir.path().join("new.json");
        write_file(&new, b"{}").unwrap();
        assert_eq!(
            std::fs::metadata(&new).unwrap().permissions().mode() & 0o777,
            0o600
        );
        write_file(&new, b"[]").unwrap();
        assert_eq!(std::fs::read(&new).unwrap(), b"[]");
        // A world-writable, non-sticky directory is refused; a sticky one (/tmp) is not.
        let open_dir = dir.path().join("open");
        std::fs::create_dir(&open_dir).unwrap();
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(matches!(
            open_append(&open_dir.join("a")),
            Err(FileError::UnsafeDirectory { .. })
        ));
        // Sticky (/tmp): a summary may go there, the audit log may not (group and others
        // can write the directory).
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(write_file(&open_dir.join("a"), b"{}").is_ok());
        assert!(matches!(
            open_append(&open_dir.join("log")),
            Err(FileError::UnsafeDirectory { .. })
        ));
        std::fs::set_permissions(&open_dir, std::fs::Permissions::from_mode(0o770)).unwrap();
        assert!(matches!(
            open_append(&open_dir.join("log")),
            Err(FileError::UnsafeDirectory { .. })
        ));
    }

    #[test]
    fn writes_refuse_hard_links_and_other_users_files_and_never_write_through_them() {
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = dir.path().join("summary.json");
        std::fs::hard_link(&victim, &link).unwrap();
        let e = open_append(&link).unwrap_err();
        assert!(matches!(e, FileError::HardLinked { links: 2, .. }), "{e}");
        assert!(e.to_string().contains("has 2 hard links"), "{e}");
        let e = write_file(&link, b"{}").unwrap_err();
        assert!(matches!(e, FileError::HardLinked { .. }), "{e}");
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        // A file another user planted where root writes.
        let planted = dir.path().join("audit.jsonl");
        std::fs::write(&planted, b"").unwrap();
        rustix::fs::chown(
            &planted,
            Some(rustix::process::Uid::from_raw(65534)),
            Some(rustix::process::Gid::from_raw(65534)),
        )
        .unwrap();
        let e = open_append(&planted).unwrap_err();
        assert!(matches!(e, FileError::NotOwned { owner: 65534, .. }), "{e}");
        assert!(matches!(
            write_file(&planted, b"{}"),
            Err(FileError::NotOwned { .. })
        ));
        assert_eq!(std::fs::read(&planted).unwrap(), b"");
        // A file replaced whole is a new file: one opened before still reads the old bytes,
        // and no temporary file is left behind.
        let ours = dir.path().join("ours.json");
        write_file(&ours, b"old").unwrap();
        let before = std::fs::File::open(&ours).unwrap();
        write_file(&ours, b"new").unwrap();
        let mut old = String::new();
        std::io::Read::read_to_string(&mut &before, &mut old).unwrap();
        assert_eq!(old, "old");
        assert_eq!(std::fs::read(&ours).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
    }

    /// A private directory passes, under a sticky `/tmp`; one owned by another user, one its
    /// group or everyone may write, one below such a directory, and one reached through a
    /// link that leads into such a directory, do not.
    #[test]
    fn a_private_directory_is_root_s_alone_all_the_way_up() {
        let dir = tempfile::tempdir().unwrap();
        let private = dir.path().join("private");
        std::fs::create_dir(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o755)).unwrap();
        check_private_directory_tree(&private).unwrap();
        let group = dir.path().join("group");
        std::fs::create_dir(&group).unwrap();
        std::fs::set_permissions(&group, std::fs::Permissions::from_mode(0o775)).unwrap();
        let e = check_private_directory_tree(&group).unwrap_err();
        assert!(e.to_string().contains("its group (mode 775)"), "{e}");
        // Sticky and writable by all is fine above, not for the directory itself.
        std::fs::set_permissions(&group, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = check_private_directory_tree(&group).unwrap_err();
        assert!(e.to_string().contains("every user (mode 1777)"), "{e}");
        let below = group.join("below");
        std::fs::create_dir(&below).unwrap();
        std::fs::set_permissions(&below, std::fs::Permissions::from_mode(0o755)).unwrap();
        check_private_directory_tree(&below).unwrap();
        std::fs::set_permissions(&group, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = check_private_directory_tree(&below).unwrap_err();
        assert!(
            matches!(&e, FileError::UntrustedDirectory { dir, .. } if *dir == group),
            "{e}"
        );
        assert!(check_private_directory_tree(&dir.path().join("missing")).is_err());
        if rustix::process::geteuid().is_root() {
            let theirs = dir.path().join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o755)).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
            let e = check_private_directory_tree(&theirs).unwrap_err();
            assert!(e.to_string().contains("owned by uid 65534"), "{e}");
            // A link in a private directory that leads into theirs: they can swap what is
            // behind it.
            let inner = theirs.join("inner");
            std::fs::create_dir(&inner).unwrap();
            std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o755)).unwrap();
            let link = private.join("link");
            symlink(&inner, &link).unwrap();
            let e = check_private_directory_tree(&link).unwrap_err();
            assert!(
                matches!(&e, FileError::UntrustedDirectory { dir, .. } if *dir == theirs),
                "{e}"
            );
        }
    }
}
