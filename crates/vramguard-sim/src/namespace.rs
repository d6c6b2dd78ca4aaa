//! Which pid a holder has in the **calling** process's PID namespace.
//!
//! A real driver keeps each context's owner as a kernel `struct pid` and reports it with the
//! number it has in the caller's PID namespace; a process that namespace cannot see (the
//! host's, a sibling container's) is left out of every process list. So `nvidia-smi` in a
//! container without `hostPID` prints "No running processes found" above the memory the
//! host's processes use (measured on an H200, driver 580.159.04).
//!
//! The simulator knows holders by their pid in `proc_root`'s namespace (the host's `/proc`,
//! as the kernel driver sees it). `proc_root/PID/status` lists a process's pid in each
//! namespace from `proc_root`'s inward (`NSpid`, proc(5)); the caller's own `NSpid` read
//! through the same `proc_root` (`proc_root/self/status`) gives its depth below it. A holder is
//! visible to the caller when its namespace is the caller's or nested in it (checked with
//! `NS_GET_PARENT`, ioctl_ns(2), which refuses to climb past the caller's namespace), and its
//! pid there is its `NSpid` entry at the caller's depth.

use crate::state::HolderNamespace;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use vramguard_proc::{NamespaceId, ProcDir, ProcFs};

/// `NS_GET_PARENT` from `<linux/nsfs.h>`: `_IO(0xb7, 0x2)`.
const NS_GET_PARENT: libc::c_ulong = 0xb702;

/// The deepest nesting the kernel allows (`MAX_PID_NS_LEVEL`).
const MAX_PID_NS_LEVEL: usize = 32;

/// Where the calling process sits relative to `proc_root`'s PID namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallerNamespace {
    /// Levels below `proc_root`'s namespace (0: the caller is in it, as on the host).
    depth: usize,
    /// The caller's namespace, when `depth > 0`.
    ns: Option<NamespaceId>,
}

impl CallerNamespace {
    /// The calling process, from `proc_root/self/status` and `proc_root/self/ns/pid`.
    ///
    /// A `self` that cannot be read (no `NSpid` line, a `proc_root` the caller is not
    /// visible in, an unreadable file) means the caller is treated as in `proc_root`'s
    /// namespace: every holder is reported by its pid there, as before namespaces were
    /// modelled. That errs towards showing too much, never towards hiding a holder.
    pub fn of_self(proc: &ProcFs) -> CallerNamespace {
        let depth = match proc.namespace_pids(ProcDir::Reader) {
            Some(nspid) if nspid.len() > 1 => nspid.len() - 1,
            _ => return CallerNamespace::default(),
        };
        match proc.pid_namespace(ProcDir::Reader) {
            Some(ns) => CallerNamespace {
                depth,
                ns: Some(ns),
            },
            None => CallerNamespace::default(),
        }
    }

    /// Whether the caller is in `proc_root`'s namespace (pids need no translation).
    pub fn is_root(&self) -> bool {
        self.ns.is_none()
    }

    /// The pid that `pid` (in `proc_root`'s namespace) has in the caller's namespace, `None`
    /// when the caller cannot see it (or it is gone, so that nothing can tell).
    pub fn pid_of(&self, proc: &ProcFs, pid: u32) -> Option<u32> {
        let Some(caller) = self.ns else {
            return Some(pid);
        };
        let nspid = proc.namespace_pids(ProcDir::Pid(pid))?;
        let inner = *nspid.get(self.depth)?;
        // The holder's namespace is `levels_below` levels under the caller's depth: climb
        // that many parents and it must be the caller's. A namespace outside the caller's
        // (a sibling at the same depth) answers EPERM on the way, or differs at the end.
        let levels_below = nspid.len() - 1 - self.depth;
        let mut ns: OwnedFd = proc.open_pid_namespace(ProcDir::Pid(pid))?;
        for _ in 0..levels_below.min(MAX_PID_NS_LEVEL) {
            // SAFETY: NS_GET_PARENT takes no argument and returns a new descriptor or -1.
            let parent = unsafe { libc::ioctl(ns.as_raw_fd(), NS_GET_PARENT) };
            if parent < 0 {
                return None;
            }
            // SAFETY: a descriptor the kernel just opened for us and nobody else owns.
            ns = unsafe { OwnedFd::from_raw_fd(parent) };
        }
        (NamespaceId::of_fd(&ns)? == caller).then_some(inner)
    }

    /// The pid a holder that is gone had in the caller's namespace, from what it recorded
    /// when it registered: only for a holder of the caller's own namespace (its namespace
    /// inode is the caller's), since the ancestry of a namespace nested deeper cannot be
    /// checked once it may be gone.
    pub fn recorded_pid(&self, ns: &HolderNamespace) -> Option<u32> {
        let caller = self.ns?;
        (ns.nspid.len() == self.depth + 1 && ns.pid_ns == caller.ino).then(|| ns.nspid[self.depth])
    }

    /// The reverse of [`CallerNamespace::pid_of`]: the pid in `proc_root`'s namespace of the
    /// process the caller knows as `caller_pid`, `None` when the caller has no such process.
    /// Scans `proc_root` (a name query, rare) for the one whose `NSpid` has `caller_pid` at
    /// the caller's depth in the caller's namespace.
    pub fn root_pid_of(&self, proc: &ProcFs, caller_pid: u32) -> Option<u32> {
        if self.is_root() {
            return Some(caller_pid);
        }
        let pids = proc.pid_lister().ok()?.list().ok()?;
        pids.into_iter().find(|&pid| {
            proc.namespace_pids(ProcDir::Pid(pid))
                .is_some_and(|n| n.get(self.depth) == Some(&caller_pid))
                && self.pid_of(proc, pid) == Some(caller_pid)
        })
    }
}

/// Each holder's pid in the caller's namespace, remembered while it lived: a dead creator
/// whose context its children keep stays listed by the number it had (the driver holds its
/// `struct pid`), which `/proc` can no longer tell.
#[derive(Debug, Default)]
pub struct CallerPids {
    /// By (pid in `proc_root`, start time): `None` when the caller cannot see it.
    seen: HashMap<(u32, Option<u64>), Option<u32>>,
}

impl CallerPids {
    /// The pid of live process `pid` (started at `start_ticks`) in the caller's namespace.
    pub fn alive(
        &mut self,
        caller: &CallerNamespace,
        proc: &ProcFs,
        pid: u32,
        start_ticks: Option<u64>,
    ) -> Option<u32> {
        *self
            .seen
            .entry((pid, start_ticks))
            .or_insert_with(|| caller.pid_of(proc, pid))
    }

    /// The pid a process that is gone had in the caller's namespace, if it was seen alive.
    pub fn gone(&self, pid: u32) -> Option<u32> {
        self.seen
            .iter()
            .find(|((p, _), _)| *p == pid)
            .and_then(|(_, v)| *v)
    }

    /// Forgets pids no allocation names any more.
    pub fn retain(&mut self, keep: impl Fn(u32) -> bool) {
        self.seen.retain(|(p, _), _| keep(*p));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_proc(status: &str) -> (tempfile::TempDir, ProcFs) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("self")).unwrap();
        std::fs::write(dir.path().join("self/status"), status).unwrap();
        let proc = ProcFs::open(dir.path()).unwrap();
        (dir, proc)
    }

    #[test]
    fn an_unreadable_self_is_the_host_namespace() {
        let empty = tempfile::tempdir().unwrap();
        let proc = ProcFs::open(empty.path()).unwrap();
        let c = CallerNamespace::of_self(&proc);
        assert!(c.is_root());
        assert_eq!(c.pid_of(&proc, 4121), Some(4121));
        // No NSpid line (an old kernel), or garbage in it.
        for status in ["Name:\tx\nPid:\t7\n", "NSpid:\t7\tx\n", "NSpid:\n"] {
            let (_dir, p) = fake_proc(status);
            assert!(CallerNamespace::of_self(&p).is_root(), "{status:?}");
        }
    }

    #[test]
    fn a_namespace_that_cannot_be_identified_is_the_host_namespace() {
        // NSpid says "one level down", but its ns/pid cannot be read: nothing to compare
        // holders' namespaces with, so no holder is hidden.
        let (_dir, p) = fake_proc("NSpid:\t4121\t1\n");
        let c = CallerNamespace::of_self(&p);
        assert!(c.is_root());
        assert_eq!(c.pid_of(&p, 77), Some(77));
        assert_eq!(c.root_pid_of(&p, 77), Some(77));
    }

    #[test]
    fn the_real_caller_on_the_host_is_in_the_host_namespace() {
        // The test runs on the host (or wherever /proc is its own): its NSpid has one entry.
        let proc = ProcFs::own().unwrap();
        let c = CallerNamespace::of_self(&proc);
        if proc
            .namespace_pids(ProcDir::Reader)
            .is_some_and(|n| n.len() == 1)
        {
            assert!(c.is_root());
        }
    }

    #[test]
    fn nspid_is_read_whole_or_not_at_all() {
        let (_dir, p) = fake_proc("Name:\tpython3\nNSpid:\t4121\t57\t1\nNSsid:\t1\n");
        assert_eq!(p.namespace_pids(ProcDir::Reader), Some(vec![4121, 57, 1]));
        assert_eq!(p.namespace_pids(ProcDir::Pid(4122)), None);
    }
}
