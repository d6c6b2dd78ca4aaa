//! Recognising NVIDIA device files behind open fds.
//!
//! The identity of a file is compared, not its path: a character device by its device number
//! (so that a container's own `/dev/nvidia0` node, wherever it lives, is still GPU 0), any
//! other file by device and inode (the simulator's stand-in files). One `statx` per fd, a
//! little cheaper than `readlink` and free of path parsing. When `statx` cannot follow the
//! link (a dangling link in a fixture tree), the link's text is parsed instead.

use crate::parse;
use rustix::fd::BorrowedFd;
use rustix::fs::{AtFlags, FileType, StatxFlags};
use std::collections::HashMap;
use std::ffi::CStr;
use std::path::Path;
use vramguard_core::snapshot::DeviceFile;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    CharDevice { major: u32, minor: u32 },
    Inode { major: u32, minor: u32, ino: u64 },
}

fn key_of(stx: &rustix::fs::Statx) -> Key {
    if FileType::from_raw_mode(stx.stx_mode as u32) == FileType::CharacterDevice {
        Key::CharDevice {
            major: stx.stx_rdev_major,
            minor: stx.stx_rdev_minor,
        }
    } else {
        Key::Inode {
            major: stx.stx_dev_major,
            minor: stx.stx_dev_minor,
            ino: stx.stx_ino,
        }
    }
}

/// The NVIDIA device files of one device directory, by identity.
#[derive(Debug, Clone, Default)]
pub struct DeviceTable {
    by_key: HashMap<Key, DeviceFile>,
    dev_dir: Vec<u8>,
}

impl DeviceTable {
    /// Reads the `nvidia*` entries of `dev_dir`. Missing entries are simply absent (the
    /// table is rebuilt on every full scan).
    pub fn load(dev_dir: &Path) -> DeviceTable {
        let mut by_key = HashMap::new();
        if let Ok(entries) = std::fs::read_dir(dev_dir) {
            for e in entries.flatten() {
                let path = e.path();
                let full = path.as_os_str().as_encoded_bytes();
                let Some(file) = parse::device_file(full, dev_dir.as_os_str().as_encoded_bytes())
                else {
                    continue;
                };
                if let Ok(stx) = rustix::fs::statx(
                    rustix::fs::CWD,
                    &path,
                    AtFlags::STATX_DONT_SYNC,
                    StatxFlags::TYPE | StatxFlags::INO,
                ) {
                    by_key.insert(key_of(&stx), file);
                }
            }
        }
        DeviceTable {
            by_key,
            dev_dir: dev_dir.as_os_str().as_encoded_bytes().to_vec(),
        }
    }

    /// The device file an fd entry (`name` in the `fd/` directory `dir`) refers to, if any.
    /// `Err` carries the errno of the failed lookup.
    pub fn identify(
        &self,
        dir: BorrowedFd<'_>,
        name: &CStr,
        scratch: &mut Vec<u8>,
    ) -> Result<Option<DeviceFile>, rustix::io::Errno> {
        match rustix::fs::statx(
            dir,
            name,
            AtFlags::STATX_DONT_SYNC,
            StatxFlags::TYPE | StatxFlags::INO,
        ) {
            Ok(stx) => Ok(self.by_key.get(&key_of(&stx)).copied()),
            // Not a followable link (fixture trees): read its text.
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::LOOP) => {
                let link = rustix::fs::readlinkat(dir, name, std::mem::take(scratch))?;
                let bytes = link.into_bytes();
                let found = parse::device_file(&bytes, &self.dev_dir);
                *scratch = bytes;
                Ok(found)
            }
            Err(e) => Err(e),
        }
    }
}
