//! Pure parsers for the `/proc` files vramguard reads. Each takes bytes and never panics:
//! malformed or truncated input yields `None` fields or a [`ParseError`], fuzzed by proptest.
//!
//! Hand-written rather than taken from `procfs-core` because that crate's `Stat` parser
//! slices by index arithmetic that panics on malformed lines and its `Status` parser fails the
//! whole record when one field is missing; here every field is independent.

use vramguard_core::snapshot::{ContainerRef, DeviceFile};

/// A file whose content is not what proc(5) describes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

/// The fields of `/proc/PID/stat` (and `/proc/PID/task/TID/stat`) vramguard uses.
/// Field numbers are proc(5)'s, counting from 1.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stat {
    /// (1) pid.
    pub pid: u32,
    /// (2) comm, without the parentheses; may itself contain spaces and parentheses.
    pub comm: String,
    /// (3) state letter.
    pub state: Option<char>,
    /// (4) parent pid.
    pub ppid: Option<u32>,
    /// (5) process group.
    pub pgid: Option<u32>,
    /// (6) session.
    pub sid: Option<u32>,
    /// (9) kernel flags (`PF_*`).
    pub flags: Option<u32>,
    /// (14) user time, clock ticks (for a process: every thread, living and dead).
    pub utime: Option<u64>,
    /// (15) system time, clock ticks.
    pub stime: Option<u64>,
    /// (16) user time of its children that it waited for, clock ticks.
    pub cutime: Option<u64>,
    /// (17) system time of its children that it waited for, clock ticks.
    pub cstime: Option<u64>,
    /// (20) number of threads.
    pub num_threads: Option<u32>,
    /// (22) start time after boot, clock ticks.
    pub start_ticks: Option<u64>,
    /// Field 24: resident set size, in pages.
    pub rss_pages: Option<u64>,
    /// (31) signals pending for this task (a thread's own, in `task/TID/stat`), the first
    /// 31 as a bit mask (bit n-1 for signal n): a group exit sets SIGKILL on every thread.
    pub pending_signals: Option<u64>,
}

/// Parses one `stat` line. The comm (field 2) is delimited by the first `(` and the *last*
/// `)`, because a process can name itself `((bash process)`.
pub fn parse_stat(bytes: &[u8]) -> Result<Stat, ParseError> {
    let text = String::from_utf8_lossy(bytes);
    let line = text.trim_end_matches(['\n', '\0']);
    let open = line
        .find('(')
        .ok_or_else(|| ParseError("no '(' opening the command name".into()))?;
    let close = line
        .rfind(')')
        .filter(|c| *c > open)
        .ok_or_else(|| ParseError("no ')' closing the command name".into()))?;
    let pid: u32 = line[..open]
        .trim()
        .parse()
        .map_err(|_| ParseError(format!("malformed pid {:?}", line[..open].trim())))?;
    let comm = line[open + 1..close].to_string();
    // Fields from 3 on, space-separated; index 0 here is field 3.
    let rest: Vec<&str> = line[close + 1..].split_ascii_whitespace().collect();
    let field = |n: usize| rest.get(n - 3).copied();
    let num = |n: usize| field(n).and_then(|f| f.parse::<u64>().ok());
    let num32 = |n: usize| num(n).and_then(|v| u32::try_from(v).ok());
    Ok(Stat {
        pid,
        comm,
        state: field(3).and_then(|s| {
            let mut chars = s.chars();
            let c = chars.next()?;
            chars.next().is_none().then_some(c)
        }),
        ppid: num32(4),
        pgid: num32(5),
        sid: num32(6),
        flags: num32(9),
        utime: num(14),
        stime: num(15),
        cutime: num(16),
        cstime: num(17),
        num_threads: num32(20),
        start_ticks: num(22),
        rss_pages: num(24),
        pending_signals: num(31),
    })
}

/// The fields of `/proc/PID/status` vramguard uses, each absent if missing or malformed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Status {
    /// `Uid:` real uid (first of four).
    pub uid: Option<u32>,
    /// `NSpid:` pid in each namespace, outermost first (Linux ≥ 4.1).
    pub nspid: Vec<u32>,
    /// `SigIgn:` bit mask of ignored signals (bit n-1 for signal n).
    pub sig_ignored: Option<u64>,
    /// `VmPin:`, `VmLck:` and `RssShmem:` in bytes: read with the rest, so that a collection
    /// that reads a process's identity does not read its `status` a second time for its host
    /// memory.
    pub memory: StatusMemory,
}

/// Parses `status`, line by line; unknown and malformed lines are skipped.
pub fn parse_status(bytes: &[u8]) -> Status {
    let mut status = Status::default();
    for line in bytes.split(|b| *b == b'\n') {
        let Ok(line) = std::str::from_utf8(line) else {
            continue;
        };
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key {
            "Uid" => {
                status.uid = value
                    .split_ascii_whitespace()
                    .next()
                    .and_then(|v| v.parse().ok())
            }
            "NSpid" => {
                let parsed: Option<Vec<u32>> = value
                    .split_ascii_whitespace()
                    .map(|v| v.parse().ok())
                    .collect();
                status.nspid = parsed.unwrap_or_default();
            }
            "SigIgn" => status.sig_ignored = u64::from_str_radix(value, 16).ok(),
            "VmPin" => status.memory.pinned = kib_value(value),
            "VmLck" => status.memory.locked = kib_value(value),
            "RssShmem" => status.memory.shmem_resident = kib_value(value),
            _ => {}
        }
    }
    status
}

/// The memory figures of a process's `status`, bytes (the kernel writes them in kB).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatusMemory {
    /// `VmPin`: pages pinned (RDMA, `cudaHostAlloc`'s pinned buffers on some drivers).
    pub pinned: Option<u64>,
    /// `VmLck`: pages locked with `mlock`.
    pub locked: Option<u64>,
    /// `RssShmem` (Linux 4.5 and later): shared memory in the process's page tables (tmpfs
    /// files such as `/dev/shm`'s, System V segments, shared anonymous mappings).
    pub shmem_resident: Option<u64>,
}

/// `VmPin`, `VmLck` and `RssShmem` of `status`.
pub fn parse_status_memory(bytes: &[u8]) -> StatusMemory {
    let mut memory = StatusMemory::default();
    for line in bytes.split(|b| *b == b'\n') {
        let Ok(line) = std::str::from_utf8(line) else {
            continue;
        };
        match line.split_once(':') {
            Some(("VmPin", v)) => memory.pinned = kib_value(v),
            Some(("VmLck", v)) => memory.locked = kib_value(v),
            Some(("RssShmem", v)) => memory.shmem_resident = kib_value(v),
            _ => {}
        }
    }
    memory
}

/// `MemTotal` and `MemAvailable` of `meminfo`, bytes.
pub fn parse_meminfo(bytes: &[u8]) -> (Option<u64>, Option<u64>) {
    let (mut total, mut available) = (None, None);
    for line in bytes.split(|b| *b == b'\n') {
        let Ok(line) = std::str::from_utf8(line) else {
            continue;
        };
        match line.split_once(':') {
            Some(("MemTotal", v)) => total = kib_value(v),
            Some(("MemAvailable", v)) => available = kib_value(v),
            _ => {}
        }
    }
    (total, available)
}

/// `   123 kB` → bytes.
fn kib_value(v: &str) -> Option<u64> {
    let v = v.trim();
    let number = v.strip_suffix("kB").unwrap_or(v).trim();
    number.parse::<u64>().ok()?.checked_mul(1024)
}

/// `pressure/memory`: the `some` line's avg10 and avg60, the `full` line's avg10.
pub fn parse_pressure(bytes: &[u8]) -> Option<vramguard_core::host::MemoryPressure> {
    let text = std::str::from_utf8(bytes).ok()?;
    let field = |line: &str, key: &str| -> Option<f64> {
        line.split_ascii_whitespace()
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse::<f64>().ok())
            .filter(|v| v.is_finite() && (0.0..=100.0).contains(v))
    };
    let some = text.lines().find(|l| l.starts_with("some "))?;
    let full = text.lines().find(|l| l.starts_with("full "));
    Some(vramguard_core::host::MemoryPressure {
        some_avg10: field(some, "avg10")?,
        some_avg60: field(some, "avg60")?,
        full_avg10: full.and_then(|l| field(l, "avg10")).unwrap_or(0.0),
    })
}

/// The file-backed mappings of `maps`: (device as `st_dev` encodes it, inode, length).
/// Anonymous mappings (inode 0) and malformed lines are skipped.
pub fn parse_maps_files(bytes: &[u8]) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
    bytes.split(|b| *b == b'\n').filter_map(|line| {
        let line = std::str::from_utf8(line).ok()?;
        let mut fields = line.split_ascii_whitespace();
        let (range, _perms, _offset, dev, inode) = (
            fields.next()?,
            fields.next()?,
            fields.next()?,
            fields.next()?,
            fields.next()?,
        );
        let inode: u64 = inode.parse().ok()?;
        if inode == 0 {
            return None;
        }
        let (start, end) = range.split_once('-')?;
        let len = u64::from_str_radix(end, 16)
            .ok()?
            .checked_sub(u64::from_str_radix(start, 16).ok()?)?;
        let (major, minor) = dev.split_once(':')?;
        let dev = rustix::fs::makedev(
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        );
        Some((dev, inode, len))
    })
}

/// Splits `cmdline` at NULs. An empty file (kernel thread, zombie) gives an empty list.
pub fn parse_cmdline(bytes: &[u8]) -> Vec<String> {
    let trimmed = bytes.strip_suffix(b"\0").unwrap_or(bytes);
    if trimmed.is_empty() {
        return Vec::new();
    }
    // Kept with every holder, every departed process and in audit records: a user's
    // megabytes-long command lines must not cost root's tools (or the agent) megabytes each.
    let kept = &trimmed[..trimmed.len().min(MAX_CMDLINE_BYTES)];
    let mut args: Vec<String> = kept
        .split(|b| *b == 0)
        .map(|arg| String::from_utf8_lossy(arg).into_owned())
        .collect();
    if kept.len() < trimmed.len()
        && let Some(last) = args.last_mut()
    {
        last.push('\u{2026}');
    }
    args
}

/// The most of a command line kept, bytes: the start of it (the program and its first
/// arguments), which is what tells processes apart; the rest ends in `…`.
pub const MAX_CMDLINE_BYTES: usize = 16 * 1024;

/// The most useful cgroup path from `/proc/PID/cgroup`: a path that names a Slurm job, in
/// any hierarchy (the freezer's first: Slurm's v1 `proctrack/cgroup` tracks a job there);
/// else the v2 path (`0::/...`) when it is not the root; else the longest v1 path (hybrid
/// hosts keep container paths in v1 hierarchies).
///
/// Slurm first because on a hybrid host its cgroup/v1 plugin moves a job's processes into
/// `/slurm_<node>/uid_N/job_N/step_X` of the v1 controllers only: the unified line still names
/// slurmd's unit (or the root), and another v1 controller may keep a longer path of whatever
/// started slurmd; either would hide the job (`pgid:4924` instead of `slurm:3`, #31).
pub fn parse_cgroup(bytes: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(bytes);
    let mut v2 = None;
    let mut best_v1: Option<&str> = None;
    let mut slurm: Option<(bool, &str)> = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if vramguard_core::job::names_slurm_job(path) {
            let freezer = controllers.split(',').any(|c| c == "freezer");
            if slurm.is_none_or(|(f, _)| freezer && !f) {
                slurm = Some((freezer, path));
            }
        }
        if id == "0" {
            v2 = Some(path);
        } else if best_v1.is_none_or(|b| path.len() > b.len()) {
            best_v1 = Some(path);
        }
    }
    if let Some((_, p)) = slurm {
        return Some(p.to_string());
    }
    match (v2, best_v1) {
        (Some(p), _) if p != "/" => Some(p.to_string()),
        (_, Some(p)) if p != "/" => Some(p.to_string()),
        (Some(p), _) => Some(p.to_string()),
        (None, p) => p.map(str::to_string),
    }
}

fn is_hex_id(s: &str) -> bool {
    s.len() >= 12 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Finds the container and Kubernetes pod a cgroup path belongs to.
///
/// Recognised: Docker (`/docker/<id>`, `docker-<id>.scope`), containerd
/// (`cri-containerd-<id>.scope`, `/kubepods/.../<id>`), CRI-O (`crio-<id>.scope`), Podman
/// (`libpod-<id>.scope`); pod UIDs from `pod<uid>` segments, where systemd slice names spell
/// the UID's dashes as underscores.
pub fn container_from_cgroup(path: &str) -> (Option<ContainerRef>, Option<String>) {
    let mut container = None;
    let mut pod_uid = None;
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    for (i, seg) in segments.iter().enumerate() {
        let base = seg.strip_suffix(".scope").unwrap_or(seg);
        let prefixed = [
            ("docker-", "docker"),
            ("cri-containerd-", "containerd"),
            ("crio-conmon-", ""),
            ("crio-", "cri-o"),
            ("libpod-conmon-", ""),
            ("libpod-", "podman"),
        ];
        for (prefix, runtime) in prefixed {
            if let Some(id) = base.strip_prefix(prefix) {
                if !runtime.is_empty() && is_hex_id(id) {
                    container = Some(ContainerRef {
                        runtime: runtime.into(),
                        id: id.into(),
                        name: None,
                    });
                }
                break;
            }
        }
        if container.is_none() && i > 0 && is_hex_id(seg) && seg.len() == 64 {
            let parent = segments[i - 1];
            let runtime = if parent == "docker" {
                "docker"
            } else if parent.starts_with("pod") || parent.starts_with("kubepods") {
                "containerd"
            } else {
                continue;
            };
            container = Some(ContainerRef {
                runtime: runtime.into(),
                id: (*seg).into(),
                name: None,
            });
        }
        if let Some(pos) = seg.rfind("pod") {
            let rest = &seg[pos + 3..];
            let rest = rest.strip_suffix(".slice").unwrap_or(rest);
            let uid = rest.replace('_', "-");
            let looks_like_uid = uid.len() == 36
                && uid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
                && uid.matches('-').count() == 4;
            if looks_like_uid {
                pod_uid = Some(uid);
            }
        }
    }
    (container, pod_uid)
}

/// Maps a `/proc/PID/fd/N` link target to an NVIDIA device file under `dev_dir`.
pub fn device_file(target: &[u8], dev_dir: &[u8]) -> Option<DeviceFile> {
    let rest = target.strip_prefix(dev_dir)?;
    let rest = rest.strip_prefix(b"/").unwrap_or(rest);
    let name = rest.strip_prefix(b"nvidia")?;
    match name {
        b"ctl" => Some(DeviceFile::Ctl),
        b"-uvm" => Some(DeviceFile::Uvm),
        digits
            if !digits.is_empty() && digits.len() <= 4 && digits.iter().all(u8::is_ascii_digit) =>
        {
            std::str::from_utf8(digits)
                .ok()?
                .parse()
                .ok()
                .map(DeviceFile::Gpu)
        }
        _ => None,
    }
}

/// `btime` from `/proc/stat`: boot time in seconds since the Unix epoch.
pub fn parse_boot_time(bytes: &[u8]) -> Option<u64> {
    String::from_utf8_lossy(bytes)
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

/// Tasks created since boot (`processes` of `/proc/stat`: every fork and clone, threads
/// included, in any PID namespace).
pub fn parse_forks(bytes: &[u8]) -> Option<u64> {
    String::from_utf8_lossy(bytes)
        .lines()
        .find_map(|l| l.strip_prefix("processes "))
        .and_then(|v| v.trim().parse().ok())
}

/// The cgroup v2 mount point from `/proc/self/mountinfo` (field 5 of the `cgroup2` line).
/// Hosts mount it at `/sys/fs/cgroup` (unified) or `/sys/fs/cgroup/unified` (hybrid).
pub fn parse_cgroup2_mount(bytes: &[u8]) -> Option<String> {
    String::from_utf8_lossy(bytes).lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_ascii_whitespace().next()?;
        (fstype == "cgroup2").then(|| left.split_ascii_whitespace().nth(4).map(unescape_octal))?
    })
}

/// Every cgroup mount point (v1 hierarchies and v2) from `/proc/self/mountinfo`, in file order.
pub fn parse_cgroup_mounts(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split_ascii_whitespace().next()?;
            matches!(fstype, "cgroup" | "cgroup2")
                .then(|| left.split_ascii_whitespace().nth(4).map(unescape_octal))?
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_octal(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `/etc/passwd` lines into `(uid, name)` pairs; malformed lines are skipped.
pub fn parse_passwd(bytes: &[u8]) -> Vec<(u32, String)> {
    String::from_utf8_lossy(bytes)
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let _password = f.next()?;
            let uid = f.next()?.parse().ok()?;
            (!name.is_empty() && !name.starts_with('#')).then(|| (uid, name.to_string()))
        })
        .collect()
}

#[cfg(test)]
mod tests {

    #[test]
    fn status_carries_pinned_and_locked_memory() {
        let st = parse_status(b"Name:\tx\nUid:\t7 7 7 7\nVmLck:\t    8 kB\nVmPin:\t  16 kB\n");
        assert_eq!(
            (st.memory.pinned, st.memory.locked),
            (Some(16 * 1024), Some(8 * 1024))
        );
        assert_eq!(
            parse_status(b"Uid:\t0 0 0 0\n").memory,
            StatusMemory::default()
        );
    }

    use super::*;

    const STAT: &[u8] = b"4121 (python) S 4100 4100 4100 0 -1 4194560 29 0 0 0 120 30 0 0 20 0 9 0 512345 100000 200 18446744073709551615 1 1 0 0 0 0 0 16781312 17610 0 0 0 17 1 0 0 0 0 0\n";

    #[test]
    fn stat_fields() {
        let s = parse_stat(STAT).unwrap();
        assert_eq!(s.pid, 4121);
        assert_eq!(s.comm, "python");
        assert_eq!(s.state, Some('S'));
        assert_eq!(s.ppid, Some(4100));
        assert_eq!(s.pgid, Some(4100));
        assert_eq!(s.sid, Some(4100));
        assert_eq!(s.flags, Some(4194560));
        assert_eq!(s.num_threads, Some(9));
        assert_eq!(s.start_ticks, Some(512345));
        assert_eq!(s.pending_signals, Some(0));
        // A thread a group exit zapped: SIGKILL (9) pending, bit 8 of field 31.
        let zapped =
            String::from_utf8_lossy(STAT).replace(" 0 0 0 0 16781312", " 0 0 256 0 16781312");
        assert_eq!(
            parse_stat(zapped.as_bytes()).unwrap().pending_signals,
            Some(256)
        );
    }

    #[test]
    fn stat_comm_with_spaces_and_parentheses() {
        let s =
            parse_stat(b"77 (((bash process)) R 1 77 77 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0")
                .unwrap();
        assert_eq!(s.comm, "((bash process)");
        assert_eq!(s.state, Some('R'));
        assert_eq!(s.start_ticks, Some(99));
        let s = parse_stat(b"78 (a) b) Z 1 2 3").unwrap();
        assert_eq!(s.comm, "a) b");
        assert_eq!(s.state, Some('Z'));
        assert_eq!(s.sid, Some(3));
        assert_eq!(s.start_ticks, None);
    }

    #[test]
    fn stat_truncated_keeps_what_is_there() {
        let s = parse_stat(b"12 (x) S 1 ").unwrap();
        assert_eq!(s.ppid, Some(1));
        assert_eq!(s.pgid, None);
        assert!(parse_stat(b"12 (x").is_err());
        assert!(parse_stat(b"").is_err());
        assert!(parse_stat(b")( 1 2").is_err());
        assert!(parse_stat(b"abc (x) S").is_err());
    }

    #[test]
    fn status_fields_and_tolerance() {
        let s = parse_status(b"Name:\tpython\nUid:\t1000\t1000\t1000\t1000\nNSpid:\t4121\t7\nSigIgn:\t0000000000000001\n");
        assert_eq!(s.uid, Some(1000));
        assert_eq!(s.nspid, vec![4121, 7]);
        assert_eq!(s.sig_ignored, Some(1));
        let s = parse_status(b"Uid:\tgarbage\nNSpid:\t1 x\n\xff\xfe\nno colon here");
        assert_eq!(s, Status::default());
    }

    #[test]
    fn cmdline() {
        assert_eq!(
            parse_cmdline(b"python\0train.py\0--lr\x000.1\0"),
            vec!["python", "train.py", "--lr", "0.1"]
        );
        assert!(parse_cmdline(b"").is_empty());
        assert_eq!(parse_cmdline(b"a b c"), vec!["a b c"]);
        // A 6 MiB command line keeps its start, marked as cut (red-team finding: kept whole
        // with every holder, departed process and audit record).
        let mut huge = b"python\0train.py\0".to_vec();
        huge.extend(std::iter::repeat_n(b'x', 6 << 20));
        let args = parse_cmdline(&huge);
        assert_eq!(&args[..2], ["python", "train.py"]);
        assert!(args.iter().map(String::len).sum::<usize>() <= MAX_CMDLINE_BYTES + 3);
        assert!(args[2].ends_with('\u{2026}'));
    }

    #[test]
    fn cgroup_v2_and_hybrid() {
        assert_eq!(
            parse_cgroup(b"0::/system.slice/docker-abc.scope\n").as_deref(),
            Some("/system.slice/docker-abc.scope")
        );
        let hybrid = b"12:memory:/docker/0123456789ab0123456789ab0123456789ab0123456789ab0123456789ab0123\n1:name=systemd:/\n0::/\n";
        assert!(parse_cgroup(hybrid).unwrap().starts_with("/docker/"));
        assert_eq!(parse_cgroup(b"0::/\n").as_deref(), Some("/"));
        // Slurm's cgroup/v1 plugin on a hybrid host (#31): the job is in the v1 controllers,
        // a longer path of the sandbox that started slurmd in another, the unified line names
        // slurmd's unit. The freezer (proctrack/cgroup) wins over another controller's path.
        let slurm_v1 = b"9:name=systemd:/system.slice/slurmd.service\n\
            6:freezer:/slurm_gpu07/uid_0/job_3/step_batch\n\
            5:devices:/slurm_gpu07/uid_0/job_3/step_batch/task_0\n\
            4:memory:/process_api/7f949ce43bd1007dbdfb115eee0d4ad7\n\
            0::/system.slice/slurmd.service\n";
        assert_eq!(
            parse_cgroup(slurm_v1).as_deref(),
            Some("/slurm_gpu07/uid_0/job_3/step_batch")
        );
        let devices_only = b"5:devices:/slurm/uid_0/job_9/step_0/task_0\n4:memory:/process_api/7f949ce43bd1007dbdfb115eee0d4ad7000000\n0::/\n";
        assert_eq!(
            parse_cgroup(devices_only).as_deref(),
            Some("/slurm/uid_0/job_9/step_0/task_0")
        );
        assert_eq!(parse_cgroup(b"garbage"), None);
    }

    #[test]
    fn containers_and_pods() {
        let id = "4f2a".repeat(16);
        let (c, p) = container_from_cgroup(&format!("/system.slice/docker-{id}.scope"));
        assert_eq!(
            c,
            Some(ContainerRef {
                runtime: "docker".into(),
                id: id.clone(),
                name: None,
            })
        );
        assert_eq!(p, None);
        let (c, _) = container_from_cgroup(&format!("/docker/{id}"));
        assert_eq!(c.unwrap().runtime, "docker");
        let k8s = format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1b2c3d4e_0000_4000_8000_123456789abc.slice/cri-containerd-{id}.scope"
        );
        let (c, p) = container_from_cgroup(&k8s);
        assert_eq!(c.unwrap().runtime, "containerd");
        assert_eq!(p.as_deref(), Some("1b2c3d4e-0000-4000-8000-123456789abc"));
        let (c, p) = container_from_cgroup(&format!(
            "/kubepods/besteffort/pod1b2c3d4e-0000-4000-8000-123456789abc/{id}"
        ));
        assert_eq!(c.unwrap().runtime, "containerd");
        assert!(p.is_some());
        let (c, _) = container_from_cgroup(&format!("/machine.slice/crio-{id}.scope"));
        assert_eq!(c.unwrap().runtime, "cri-o");
        let (c, _) = container_from_cgroup(&format!("/machine.slice/libpod-{id}.scope"));
        assert_eq!(c.unwrap().runtime, "podman");
        assert_eq!(
            container_from_cgroup("/user.slice/user-1000.slice/session-3.scope"),
            (None, None)
        );
    }

    #[test]
    fn device_files() {
        assert_eq!(
            device_file(b"/dev/nvidia3", b"/dev"),
            Some(DeviceFile::Gpu(3))
        );
        assert_eq!(
            device_file(b"/dev/nvidiactl", b"/dev"),
            Some(DeviceFile::Ctl)
        );
        assert_eq!(
            device_file(b"/dev/nvidia-uvm", b"/dev"),
            Some(DeviceFile::Uvm)
        );
        assert_eq!(device_file(b"/dev/nvidia-uvm-tools", b"/dev"), None);
        assert_eq!(device_file(b"/dev/nvidia-caps/nvidia-cap1", b"/dev"), None);
        assert_eq!(device_file(b"/dev/null", b"/dev"), None);
        assert_eq!(
            device_file(b"/tmp/t/dev/nvidia0", b"/tmp/t/dev"),
            Some(DeviceFile::Gpu(0))
        );
        assert_eq!(
            device_file(b"/tmp/t/dev/nvidia0 (deleted)", b"/tmp/t/dev"),
            None
        );
        assert_eq!(device_file(b"socket:[123]", b"/dev"), None);
    }

    #[test]
    fn cpu_times() {
        let s = parse_stat(STAT).unwrap();
        assert_eq!((s.utime, s.stime), (Some(120), Some(30)));
        let line = "7 (x) R 1 7 7 0 -1 4194304 0 0 0 0 1234 56 0 0 20 0 1 0 99 0 0";
        let s = parse_stat(line.as_bytes()).unwrap();
        assert_eq!((s.utime, s.stime), (Some(1234), Some(56)));
    }

    #[test]
    fn mountinfo_every_cgroup_hierarchy() {
        let text = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n\
                    42 31 0:39 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
                    43 31 0:40 / /proc rw - proc proc rw\n";
        assert_eq!(
            parse_cgroup_mounts(text.as_bytes()),
            vec!["/sys/fs/cgroup/unified", "/sys/fs/cgroup/memory"]
        );
    }

    #[test]
    fn mountinfo_cgroup2() {
        let hybrid = b"31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(
            parse_cgroup2_mount(hybrid).as_deref(),
            Some("/sys/fs/cgroup/unified")
        );
        let unified =
            b"35 24 0:30 / /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(
            parse_cgroup2_mount(unified).as_deref(),
            Some("/sys/fs/cgroup")
        );
        assert_eq!(
            parse_cgroup2_mount(b"1 2 0:1 / /a\\040b rw - cgroup2 x rw\n").as_deref(),
            Some("/a b")
        );
        assert_eq!(parse_cgroup2_mount(b"nothing"), None);
    }

    #[test]
    fn a_maps_line_names_the_driver_library_by_file_name() {
        let l = |path: &str| {
            maps_line_library(format!("7f00-7f10 r-xp 00000000 08:01 42  {path}").as_bytes())
        };
        assert_eq!(l("/usr/lib/libcuda.so.1"), Some(MappedLibrary::Cuda));
        assert_eq!(
            l("/usr/lib/libcuda.so.580.159.04 (deleted)"),
            Some(MappedLibrary::Cuda)
        );
        assert_eq!(
            l("/usr/local/cuda/compat/libcuda.so"),
            Some(MappedLibrary::Cuda)
        );
        assert_eq!(l("/usr/lib/libnvidia-ml.so.1"), Some(MappedLibrary::Nvml));
        assert_eq!(l("/usr/lib/libcudart.so.12"), None);
        assert_eq!(l("/opt/libcuda.so.dir/libc.so.6"), None);
        assert_eq!(l("[heap]"), None);
        assert_eq!(l("[anon:x/libcuda.so.1]"), None, "a name its process chose");
        assert_eq!(
            l("/memfd:libcuda.so.1 (deleted)"),
            None,
            "a memfd's chosen name"
        );
        assert_eq!(maps_line_library(b""), None);
        assert_eq!(maps_line_library(b"/"), None);
        assert_eq!(
            maps_line_library(b"/usr/lib/libcuda.so.1"),
            None,
            "no fields"
        );
    }

    #[test]
    fn boot_time_and_passwd() {
        assert_eq!(
            parse_boot_time(b"cpu 1 2 3\nbtime 1764680000\nprocesses 5\n"),
            Some(1764680000)
        );
        assert_eq!(parse_boot_time(b"cpu 1"), None);
        let p = parse_passwd(
            b"root:x:0:0:root:/root:/bin/bash\nalice:x:1000:1000::/home/alice:/bin/sh\nbroken\n",
        );
        assert_eq!(
            p,
            vec![(0, "root".to_string()), (1000, "alice".to_string())]
        );
    }

    proptest::proptest! {
        #[test]
        fn parsers_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            let _ = parse_stat(&bytes);
            let _ = parse_status(&bytes);
            let _ = parse_cmdline(&bytes);
            let _ = parse_cgroup(&bytes);
            let _ = parse_boot_time(&bytes);
            let _ = parse_cgroup2_mount(&bytes);
            let _ = parse_passwd(&bytes);
            let _ = device_file(&bytes, b"/dev");
            let _ = parse_status_memory(&bytes);
            let _ = parse_meminfo(&bytes);
            let _ = parse_pressure(&bytes);
            let _ = parse_maps_files(&bytes).count();
            let _ = maps_line_library(&bytes);
            let text = String::from_utf8_lossy(&bytes);
            let _ = container_from_cgroup(&text);
        }

        #[test]
        fn maps_lines_with_any_numbers_never_panic(
            start in proptest::num::u64::ANY, end in proptest::num::u64::ANY,
            major in "[0-9a-fA-F]{0,10}", minor in "[0-9a-fA-F]{0,10}", inode in "[0-9]{0,22}",
        ) {
            let line = format!("{start:x}-{end:x} rw-s 00000000 {major}:{minor} {inode} /dev/shm/x\n");
            for (_, _, len) in parse_maps_files(line.as_bytes()) {
                proptest::prop_assert!(end >= start && len == end - start);
            }
        }

        #[test]
        fn truncated_stat_never_panics(cut in 0usize..STAT.len()) {
            let _ = parse_stat(&STAT[..cut]);
        }

        #[test]
        fn stat_with_any_comm_round_trips(comm in "[ -~]{0,15}", pid in 1u32..4_000_000) {
            let line = format!("{pid} ({comm}) S 1 2 3 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 42 0 0");
            let s = parse_stat(line.as_bytes()).unwrap();
            proptest::prop_assert_eq!(s.pid, pid);
            proptest::prop_assert_eq!(s.comm, comm);
            proptest::prop_assert_eq!(s.start_ticks, Some(42));
        }
    }
}

/// An NVIDIA driver library one line of `/proc/PID/maps` maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MappedLibrary {
    /// The CUDA driver library, `libcuda.so*` (`libcuda.so.1`, `libcuda.so.580.159.04`, with
    /// ` (deleted)` after a driver upgrade). Not `libcudart.so`, the runtime, which loads the
    /// driver library only when CUDA is first used.
    Cuda,
    /// The NVML library, `libnvidia-ml.so*`.
    Nvml,
}

/// Which driver library one line of `/proc/PID/maps` maps, if any: by its path's file name.
/// Only a file's path counts (the sixth field, starting with `/`): not an anonymous mapping's
/// name (`[anon:…]`, which its process chooses) nor a memfd (`/memfd:…`). Never panics;
/// anything else reads as none.
pub fn maps_line_library(line: &[u8]) -> Option<MappedLibrary> {
    // Five fields (address, perms, offset, device, inode), then spaces, then the path. The
    // kernel escapes a newline in a path, so a line is one mapping.
    let mut rest = line;
    for _ in 0..5 {
        let start = rest.iter().position(|b| *b != b' ')?;
        rest = &rest[start..];
        let end = rest.iter().position(|b| *b == b' ')?;
        rest = &rest[end..];
    }
    let path = &rest[rest.iter().position(|b| *b != b' ')?..];
    if !path.starts_with(b"/") || path.starts_with(b"/memfd:") {
        return None;
    }
    let slash = path.iter().rposition(|&b| b == b'/')?;
    let name = &path[slash + 1..];
    if name.starts_with(b"libcuda.so") {
        Some(MappedLibrary::Cuda)
    } else if name.starts_with(b"libnvidia-ml.so") {
        Some(MappedLibrary::Nvml)
    } else {
        None
    }
}
