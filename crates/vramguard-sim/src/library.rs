//! Stand-ins for the NVIDIA driver's user-space libraries, mapped by the simulated clients.
//!
//! vramguard tells a CUDA context from an NVML client by the libraries a process maps
//! (`/proc/PID/maps`): a CUDA process maps `libcuda.so.1`, and a child it forks inherits the
//! mapping; an NVML client maps `libnvidia-ml.so.1` only (on driver 580 both hold
//! `/dev/nvidia-uvm`). The simulated holders and NVML clients map a small file of the same
//! name from `dev_dir/.driver/`, so that a scan of `/proc` sees them as it would see the real
//! ones. The files hold text, not code: they are mapped read-only and never executed.

use std::path::{Path, PathBuf};

/// A driver library the simulator stands in for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Library {
    /// `libcuda.so.1`, mapped by every simulated CUDA process.
    Cuda,
    /// `libnvidia-ml.so.1`, mapped by a simulated NVML client.
    Nvml,
}

impl Library {
    fn file_name(self) -> &'static str {
        match self {
            Library::Cuda => "libcuda.so.1",
            Library::Nvml => "libnvidia-ml.so.1",
        }
    }
}

/// The stand-in's path for the simulated node whose device directory is `dev_dir`. Hidden
/// (a dot directory), so nothing takes it for a device file.
pub fn stand_in_path(dev_dir: &Path, library: Library) -> PathBuf {
    dev_dir.join(".driver").join(library.file_name())
}

/// A stand-in library mapped into this process (read-only, private), unmapped on drop. A
/// child forked meanwhile keeps its copy of the mapping, as it keeps a real library's.
#[derive(Debug)]
pub struct Mapped {
    addr: *mut std::ffi::c_void,
    len: usize,
}

// SAFETY: the mapping is read-only and only ever unmapped, once, by its owner.
unsafe impl Send for Mapped {}
// SAFETY: as above; nothing reads through the pointer.
unsafe impl Sync for Mapped {}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: `addr`/`len` are exactly what mmap returned; nothing else refers to them.
        unsafe {
            libc::munmap(self.addr, self.len);
        }
    }
}

impl Mapped {
    /// Keeps the mapping for the rest of the process's life, as a loaded library is kept.
    pub fn keep(self) {
        std::mem::forget(self);
    }
}

/// Maps `library`'s stand-in for the node at `dev_dir`, creating it if it is missing.
pub fn map(dev_dir: &Path, library: Library) -> std::io::Result<Mapped> {
    let path = ensure(dev_dir, library)?;
    let file = std::fs::File::open(&path)?;
    let len = usize::try_from(file.metadata()?.len())
        .unwrap_or(usize::MAX)
        .max(1);
    // SAFETY: a fresh read-only private mapping of a file this process opened; nothing
    // dereferences it.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Mapped { addr, len })
}

/// The stand-in's path, created if it is missing.
pub fn ensure(dev_dir: &Path, library: Library) -> std::io::Result<PathBuf> {
    let path = stand_in_path(dev_dir, library);
    if !path.exists() {
        create(&path, library)?;
    }
    Ok(path)
}

/// Writes the stand-in (atomically: a concurrent holder never maps a half-written file).
fn create(path: &Path, library: Library) -> std::io::Result<()> {
    let dir = path.parent().expect("a stand-in path has a parent");
    std::fs::create_dir_all(dir)?;
    let text = format!(
        "vramguard's simulated NVIDIA driver: a stand-in for {}, mapped by simulated clients \
         so that /proc/PID/maps shows it; not a library\n",
        library.file_name()
    );
    crate::store::write_atomic(path, text.as_bytes())
}
