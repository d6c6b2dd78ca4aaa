//! A simulated CUDA context's life, as the kernel keeps it: tied to the **open file
//! description** of the device file that created it.
//!
//! A real driver keeps a context while the file description it was created on is open in any
//! process: children forked after `cuInit` inherit the creator's descriptors (the same open
//! file descriptions), so when the creator is SIGKILLed the context, its memory, and its
//! listing under the dead creator's pid stay until the last of them exits (measured on an
//! H200, driver 580.159.04: memory back 0 ms after the last exit). The simulator models that
//! with an **OFD lock** (`fcntl(F_OFD_SETLK)`): the creating holder takes a read lock on one
//! byte of its `dev_dir/nvidiaN` stand-in, at an offset that encodes its identity. OFD locks
//! belong to the open file description, so they survive the creator while a forked child (or
//! a process that received the descriptor over `SCM_RIGHTS`) keeps it, and vanish when its
//! last descriptor closes; the simulator asks with `F_OFD_GETLK`. No `/proc` scan and no
//! bookkeeping of who forked whom are needed, and a child that closes its descriptors (an
//! `exec` with close-on-exec) lets go, as it would of a real context.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Pids are below 2^22 (`PID_MAX_LIMIT`), so the pid takes the low 22 bits of the offset and
/// the start time the bits above it.
const PID_BITS: u32 = 22;

/// The lock offset of the context created by the process `pid` (in the state's `proc_root`)
/// that started at `start_ticks`: unique per process, so that a reused pid never finds an
/// older process's lock. Below 2^62, so that the locked byte is a valid `off_t` range.
pub fn lock_offset(pid: u32, start_ticks: u64) -> u64 {
    let pid = u64::from(pid) & ((1 << PID_BITS) - 1);
    let start = start_ticks & ((1 << (62 - PID_BITS)) - 1);
    pid | (start << PID_BITS)
}

fn flock_at(kind: libc::c_int, offset: u64) -> libc::flock {
    // SAFETY: `flock` is a plain C struct; all-zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind as libc::c_short;
    l.l_whence = libc::SEEK_SET as libc::c_short;
    l.l_start = offset as libc::off_t;
    l.l_len = 1;
    l
}

/// Takes the context's lock on `file`, the creator's own descriptor of its GPU's device file
/// (a read lock: the stand-in is opened read-only, as a holder opens it).
pub fn take(file: &File, offset: u64) -> std::io::Result<()> {
    let l = flock_at(libc::F_RDLCK, offset);
    // SAFETY: F_OFD_SETLK reads the flock struct, which lives across the call.
    let r = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &l) };
    if r == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether an open file description other than `probe`'s holds the lock at `offset`. `probe`
/// is the asker's own descriptor of the same device file.
pub fn held(probe: &File, offset: u64) -> std::io::Result<bool> {
    // A write lock conflicts with any read lock another description holds.
    let mut l = flock_at(libc::F_WRLCK, offset);
    // SAFETY: F_OFD_GETLK writes into the flock struct, which lives across the call.
    let r = unsafe { libc::fcntl(probe.as_raw_fd(), libc::F_OFD_GETLK, &mut l) };
    if r == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(l.l_type != libc::F_UNLCK as libc::c_short)
}
