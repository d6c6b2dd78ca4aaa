//! The collector against the fixture tree in `tests/fixtures/proc` (checked in, like
//! node_exporter's `collector/fixtures/proc`).

use std::path::PathBuf;
use vramguard_core::snapshot::{DeviceFile, FdScan};
use vramguard_proc::{ProcCollector, ProcError, ScanDepth};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn collector() -> ProcCollector {
    ProcCollector::new(fixtures().join("proc"), "/dev")
        .unwrap()
        .with_passwd(fixtures().join("passwd"))
}

#[test]
fn full_scan_finds_every_device_holder_and_their_relatives() {
    let c = collector().collect(&[], ScanDepth::Full, 1_000).unwrap();
    let pids: Vec<u32> = c.processes.iter().map(|p| p.pid).collect();
    // Holders 77, 300, 500, 510, 4121, 4122, 4242 (self) and relative 1 (parent of most).
    // 2 holds nothing, 9999 vanished, 4100 (the dead leader) does not exist.
    assert_eq!(pids, vec![1, 77, 300, 500, 510, 4121, 4122, 4242]);
    assert!(c.scan.full_fd_scan);
    assert_eq!(c.host.self_pid, 4242);
    assert_eq!(c.host.hostname.as_deref(), Some("gpu-node-7"));
    assert_eq!(c.host.boot_time_ms, Some(1_764_680_000_000));
}

#[test]
fn worker_facts_come_from_every_file() {
    let c = collector().collect(&[], ScanDepth::Full, 1_000).unwrap();
    let w = c.processes.iter().find(|p| p.pid == 4121).unwrap();
    assert_eq!(w.comm.as_deref(), Some("pt_data_worker"));
    assert_eq!(w.ppid, Some(1));
    assert_eq!(w.pgid, Some(4100));
    assert_eq!(w.uid, Some(1000));
    assert_eq!(w.user.as_deref(), Some("alice"));
    assert_eq!(w.nspid, vec![4121, 7]);
    assert_eq!(
        w.cmdline.as_ref().unwrap().join(" "),
        "python train.py --epochs 10"
    );
    assert_eq!(w.container.as_ref().unwrap().runtime, "docker");
    assert_eq!(w.container.as_ref().unwrap().id, "4f2a".repeat(16));
    // nvidia0 twice, a socket and /dev/null: de-duplicated, non-devices dropped.
    assert_eq!(
        w.device_files,
        FdScan::Scanned(vec![DeviceFile::Gpu(0), DeviceFile::Ctl, DeviceFile::Uvm])
    );
}

#[test]
fn awkward_command_names_survive() {
    let c = collector().collect(&[], ScanDepth::Full, 1_000).unwrap();
    let p = c.processes.iter().find(|p| p.pid == 77).unwrap();
    assert_eq!(p.comm.as_deref(), Some("((bash process)"));
    assert_eq!(p.state, Some('R'));
    assert_eq!(p.cmdline.as_deref(), Some(&[][..]));
    assert_eq!(p.display_command(), "[((bash process)]");
}

#[test]
fn zombie_threads_and_wait_channels_are_read() {
    let c = collector().collect(&[], ScanDepth::Full, 1_000).unwrap();
    let z = c.processes.iter().find(|p| p.pid == 500).unwrap();
    assert_eq!(z.state, Some('Z'));
    let threads = z.threads.as_ref().unwrap();
    assert_eq!(threads.len(), 2);
    assert_eq!(threads[1].state, 'D');
    assert_eq!(threads[1].wchan.as_deref(), Some("fuse_wait_answer"));
    // "0" means not sleeping in a kernel function.
    assert_eq!(threads[0].wchan, None);
}

#[test]
fn a_listed_pid_that_is_a_kernel_thread_is_scanned_and_holds_nothing() {
    let c = collector()
        .collect(&[2], ScanDepth::Holders, 1_000)
        .unwrap();
    let k = c.processes.iter().find(|p| p.pid == 2).unwrap();
    assert!(k.is_kernel_thread());
    assert_eq!(k.device_files, FdScan::Scanned(vec![]));
}

#[test]
fn listed_pids_that_do_not_exist_are_simply_absent() {
    let c = collector()
        .collect(&[4100, 9999, 123456], ScanDepth::NewProcesses, 1_000)
        .unwrap();
    assert!(
        c.processes
            .iter()
            .all(|p| ![4100, 9999, 123456].contains(&p.pid))
    );
}

#[test]
fn a_malformed_file_is_an_error_naming_the_file() {
    let err = ProcCollector::new(fixtures().join("proc-malformed"), "/dev")
        .unwrap()
        .collect(&[123], ScanDepth::Full, 0)
        .unwrap_err();
    assert!(matches!(err, ProcError::Malformed { .. }));
    let msg = err.to_string();
    assert!(msg.contains("proc-malformed/123/stat"), "{msg}");
    assert!(msg.contains("no '('"), "{msg}");
}

#[test]
fn a_missing_tree_is_an_error_naming_the_directory() {
    let err = ProcCollector::new(fixtures().join("no-such-proc"), "/dev").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("no-such-proc"), "{msg}");
    assert!(msg.contains("No such file"), "{msg}");
}

#[test]
fn a_zombie_leaders_files_are_read_from_a_live_thread() {
    // Once the main thread has exited, /proc/510/fd is empty; thread 511 still holds nvidia1.
    let c = collector().collect(&[], ScanDepth::Full, 1_000).unwrap();
    let z = c.processes.iter().find(|p| p.pid == 510).unwrap();
    assert_eq!(z.state, Some('Z'));
    assert_eq!(z.device_files, FdScan::Scanned(vec![DeviceFile::Gpu(1)]));
    assert_eq!(z.threads.as_ref().unwrap()[1].state, 'S');
}

#[test]
fn a_fifo_or_a_link_to_dev_zero_in_a_fixture_tree_neither_hangs_nor_exhausts_memory() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let pid = dir.path().join("77");
    std::fs::create_dir(&pid).unwrap();
    // A FIFO nobody writes to, where `stat` should be.
    rustix::fs::mknodat(
        rustix::fs::CWD,
        pid.join("stat"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    // `/dev/zero` where `cmdline` should be: endless.
    std::os::unix::fs::symlink("/dev/zero", pid.join("cmdline")).unwrap();
    let fs = vramguard_proc::ProcFs::open(dir.path()).unwrap();
    let t = Instant::now();
    assert!(!matches!(fs.stat(77), Ok(vramguard_proc::Found::Yes(_))));
    let cmdline = fs.cmdline(77).unwrap().ok().unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let bytes: usize = cmdline.iter().map(|a| a.len() + 1).sum();
    assert!(
        bytes <= vramguard_proc::procfs::MAX_PROC_FILE + 1,
        "{bytes}"
    );
}

/// A collection for new processes lists `/proc` only when the fork counter (`stat`'s
/// `processes`) moved since the last listing: a process that appears without it is not looked
/// for (none can, on a real kernel), one that appears with it is found and fd-scanned.
#[test]
fn new_processes_are_looked_for_only_when_the_fork_counter_moved() {
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("proc");
    let ok = std::process::Command::new("cp")
        .args(["-a"])
        .arg(fixtures().join("proc"))
        .arg(&tree)
        .status()
        .unwrap();
    assert!(ok.success());
    let mut c = ProcCollector::new(&tree, "/dev")
        .unwrap()
        .with_passwd(fixtures().join("passwd"));
    let holds = |c: &vramguard_proc::Collected, pid: u32| c.processes.iter().any(|p| p.pid == pid);
    let first = c.collect(&[], ScanDepth::NewProcesses, 1_000).unwrap();
    assert!(holds(&first, 4121), "the first collection lists");
    assert!(!holds(&first, 4999));
    // A copy of holder 4121 appears as pid 4999, the counter unchanged: not listed.
    let ok = std::process::Command::new("cp")
        .args(["-a"])
        .arg(tree.join("4121"))
        .arg(tree.join("4999"))
        .status()
        .unwrap();
    assert!(ok.success());
    let same = c.collect(&[], ScanDepth::NewProcesses, 2_000).unwrap();
    assert!(!holds(&same, 4999), "listed although nothing forked");
    // The counter moves: listed, scanned, a holder.
    let stat = std::fs::read_to_string(tree.join("stat")).unwrap();
    std::fs::write(
        tree.join("stat"),
        stat.replace("processes 9000", "processes 9001"),
    )
    .unwrap();
    let moved = c.collect(&[], ScanDepth::NewProcesses, 3_000).unwrap();
    assert!(holds(&moved, 4999), "not listed after a fork");
    // A full collection always lists.
    std::fs::remove_dir_all(tree.join("4999")).unwrap();
    let full = c.collect(&[], ScanDepth::Full, 4_000).unwrap();
    assert!(!holds(&full, 4999));
}

#[test]
fn a_tree_that_is_not_our_namespace_says_so_and_the_live_one_does() {
    // Device opens are named by their pid in vramguard's namespace: the open watch is only
    // started over a tree that shows that namespace.
    assert!(!collector().sees_own_namespace());
    assert!(
        ProcCollector::new("/proc", "/dev")
            .unwrap()
            .sees_own_namespace()
    );
}

/// (#28) Over another namespace's `/proc` no pidfd is opened (it would name another
/// process), so the collector never says that nothing exited: the agent's quiet samples then
/// never stand in for a collection.
#[test]
fn over_another_namespace_nothing_exited_is_never_claimed() {
    let mut c = collector();
    for (depth, at) in [
        (ScanDepth::Full, 1_000),
        (ScanDepth::Holders, 2_000),
        (ScanDepth::Cached, 3_000),
    ] {
        c.collect(&[], depth, at).unwrap();
        assert!(!c.nothing_exited(), "after a {depth:?} collection");
    }
}

/// A process seen opening a device file (the open watch) is scanned at the next collection;
/// when that collection fails, it is not forgotten but scanned at the one after, whatever
/// its depth: else a new holder would wait for the next full scan, ten minutes away.
#[test]
fn an_opener_is_still_scanned_after_a_collection_that_failed() {
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("proc");
    let copy = |from: &std::path::Path, to: &std::path::Path| {
        let ok = std::process::Command::new("cp")
            .arg("-a")
            .arg(from)
            .arg(to)
            .status()
            .unwrap();
        assert!(ok.success());
    };
    copy(&fixtures().join("proc"), &tree);
    let mut c = ProcCollector::new(&tree, "/dev")
        .unwrap()
        .with_passwd(fixtures().join("passwd"));
    c.collect(&[], ScanDepth::Full, 1_000).unwrap();
    // A holder appears, its `fd` unreadable for now (a file, not a directory).
    copy(&tree.join("4121"), &tree.join("4999"));
    std::fs::remove_dir_all(tree.join("4999/fd")).unwrap();
    std::fs::write(tree.join("4999/fd"), b"").unwrap();
    c.opened_by([4999]);
    let err = c.collect(&[], ScanDepth::Cached, 2_000).unwrap_err();
    assert!(err.to_string().contains("4999/fd"), "{err}");
    // Readable again: the next collection, cached, scans it all the same.
    std::fs::remove_file(tree.join("4999/fd")).unwrap();
    copy(&tree.join("4121/fd"), &tree.join("4999/fd"));
    let got = c.collect(&[], ScanDepth::Cached, 3_000).unwrap();
    let p = got
        .processes
        .iter()
        .find(|p| p.pid == 4999)
        .expect("the opener was forgotten with the failed collection");
    assert_eq!(p.device_files.holds_any(), Some(true));
}

/// A Slurm job of more members than the collector looks at (512), its `slurmstepd` at a
/// higher pid than every task (pids wrapped): the daemon's own directory is read first, so it
/// is found; without it, the job's facts say they are incomplete, which the classifier never
/// takes for a dead job.
#[test]
fn a_slurm_job_larger_than_the_bounds_still_finds_its_step_daemon_or_says_it_did_not_look() {
    let dir = tempfile::tempdir().unwrap();
    let tree = dir.path().join("proc");
    let ok = std::process::Command::new("cp")
        .arg("-a")
        .arg(fixtures().join("proc"))
        .arg(&tree)
        .status()
        .unwrap();
    assert!(ok.success());
    let cg = dir.path().join("cg");
    let job = cg.join("system.slice/slurmstepd.scope/job_42");
    let tasks = job.join("step_0/user/task_0");
    let daemon = job.join("step_0/slurm");
    std::fs::create_dir_all(&tasks).unwrap();
    std::fs::create_dir_all(&daemon).unwrap();
    // Every cgroup directory has its `cgroup.procs`, empty where only subgroups have members.
    for d in [job.clone(), job.join("step_0"), job.join("step_0/user")] {
        std::fs::write(d.join("cgroup.procs"), "").unwrap();
    }
    let mut members: String = (300..900).map(|p| format!("{p}\n")).collect();
    members.push_str("4999\n");
    std::fs::write(tasks.join("cgroup.procs"), members).unwrap();
    std::fs::write(daemon.join("cgroup.procs"), "32010\n").unwrap();
    std::fs::create_dir(tree.join("32010")).unwrap();
    std::fs::write(
        tree.join("32010/stat"),
        "32010 (slurmstepd) S 1 32010 32010 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n",
    )
    .unwrap();
    // A holder in the job's task cgroup.
    let ok = std::process::Command::new("cp")
        .arg("-a")
        .arg(tree.join("4121"))
        .arg(tree.join("4999"))
        .status()
        .unwrap();
    assert!(ok.success());
    std::fs::write(
        tree.join("4999/cgroup"),
        "0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_0\n",
    )
    .unwrap();
    std::fs::write(
        tree.join("4242/mountinfo"),
        format!(
            "30 25 0:26 / {} rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw\n",
            cg.display()
        ),
    )
    .unwrap();
    let facts = |c: &mut ProcCollector| {
        let got = c.collect(&[], ScanDepth::Full, 1_000).unwrap();
        got.job_cgroups
            .into_iter()
            .find(|f| f.root.ends_with("/job_42"))
            .expect("the holder's Slurm job is read")
    };
    let mut c = ProcCollector::new(&tree, "/dev")
        .unwrap()
        .with_passwd(fixtures().join("passwd"));
    let f = facts(&mut c);
    assert!(f.readable);
    assert_eq!(f.members, 602);
    assert_eq!(f.step_daemons, vec![32010], "{f:?}");
    assert!(!f.complete, "602 members, 512 looked at");
    // Who made the job's directory: a Slurm job's is root's, a user's only took its name.
    let mine = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&job).unwrap());
    assert_eq!(f.owner_uid, Some(mine), "{f:?}");
    // The daemon gone: none found among those looked at, which is not all of them.
    std::fs::remove_dir_all(&daemon).unwrap();
    let mut c = ProcCollector::new(&tree, "/dev")
        .unwrap()
        .with_passwd(fixtures().join("passwd"));
    let f = facts(&mut c);
    assert!(f.step_daemons.is_empty());
    assert!(!f.complete, "{f:?}");
    // A small job read whole is complete: a missing daemon there is news.
    std::fs::write(tasks.join("cgroup.procs"), "4999\n").unwrap();
    let mut c = ProcCollector::new(&tree, "/dev")
        .unwrap()
        .with_passwd(fixtures().join("passwd"));
    let f = facts(&mut c);
    assert!(f.step_daemons.is_empty() && f.complete, "{f:?}");
}

/// A tree whose `self` is this process's number but whose pid 1 lives in another PID
/// namespace is not vramguard's own /proc (red-team finding: the number alone was compared,
/// and it can coincide in a parent namespace's /proc).
#[test]
fn the_same_number_in_another_namespaces_proc_is_not_ours() {
    let dir = tempfile::tempdir().unwrap();
    let me = std::process::id().to_string();
    let tree = |name: &str, init_ns: &str| {
        let root = dir.path().join(name);
        std::fs::create_dir_all(root.join(&me).join("ns")).unwrap();
        std::fs::create_dir_all(root.join("1").join("ns")).unwrap();
        std::os::unix::fs::symlink(&me, root.join("self")).unwrap();
        std::os::unix::fs::symlink("pid:[4026531836]", root.join(&me).join("ns/pid")).unwrap();
        std::os::unix::fs::symlink(init_ns, root.join("1/ns/pid")).unwrap();
        vramguard_proc::ProcFs::open(root).unwrap()
    };
    assert!(tree("ours", "pid:[4026531836]").is_own_namespace());
    assert!(!tree("a-parents", "pid:[4026532999]").is_own_namespace());
}

/// `/proc/PID/maps` tells a CUDA process from an NVML client (on driver 580 both hold
/// `/dev/nvidia-uvm`): the CUDA driver library found past the read buffer's first fill and
/// across its edges, NVML alone, neither, an empty map (a zombie leader) read through a live
/// thread, an empty map with no live thread, a FIFO and `/dev/zero` where the map should be.
#[test]
fn the_driver_library_a_process_maps_is_read_in_bounded_pieces() {
    use vramguard_core::snapshot::DriverLibrary;
    use vramguard_proc::Found;
    let dir = tempfile::tempdir().unwrap();
    let line = |i: usize, path: &str| {
        format!("7f{i:010x}000-7f{i:010x}fff r--p 00000000 08:01 {i:<8} {path}\n")
    };
    let filler: String = (0..2000)
        .map(|i| line(i, "/usr/lib/x86_64-linux-gnu/libc.so.6"))
        .collect();
    assert!(filler.len() > 64 * 1024, "past one buffer");
    let cuda = line(
        9,
        "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04 (deleted)",
    );
    let nvml = line(8, "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.159.04");
    let maps: &[(u32, String)] = &[
        (10, format!("{filler}{nvml}{filler}{cuda}{filler}")),
        // The library on the very last line, with no newline after it.
        (11, format!("{filler}{}", cuda.trim_end())),
        (12, format!("{nvml}{filler}")),
        (13, filler.clone()),
        (14, line(1, "/opt/app/libcudart.so.12 [heap] /x/libcuda")),
        (15, String::new()),
        (16, String::new()),
    ];
    // 20: a path longer than the read buffer, its file name past the cut (a deep tree):
    // unknown, not "NVML only". 21: the CUDA library mapped, but a thread is in D state (its
    // map may hang a reader): unknown, its map unread.
    let deep = format!("/{}", "d/".repeat(40_000));
    let maps: &[(u32, String)] = &[
        maps,
        &[
            (
                20,
                format!("{}{}", line(3, &format!("{deep}libnvidia-ml.so.1")), filler),
            ),
            (21, cuda.clone()),
        ],
    ]
    .concat();
    for (pid, text) in maps {
        let d = dir.path().join(pid.to_string());
        std::fs::create_dir_all(d.join("task")).unwrap();
        std::fs::write(d.join("maps"), text).unwrap();
    }
    let stat = |pid: u32, tid: u32, state: char| {
        let t = dir.path().join(format!("{pid}/task/{tid}"));
        std::fs::create_dir_all(&t).unwrap();
        std::fs::write(
            t.join("stat"),
            format!("{tid} (python3) {state} 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 2 0 100 0 0\n"),
        )
        .unwrap();
    };
    stat(21, 21, 'S');
    stat(21, 22, 'D');
    stat(10, 10, 'S');
    // 15 is a zombie leader whose thread 151 lives on with the CUDA process's map.
    let t = dir.path().join("15/task/151");
    std::fs::create_dir_all(&t).unwrap();
    std::fs::write(t.join("maps"), &cuda).unwrap();
    // 17: a FIFO; 18: /dev/zero (no newline, endless).
    let d = dir.path().join("17");
    std::fs::create_dir_all(d.join("task")).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        d.join("maps"),
        rustix::fs::FileType::Fifo,
        rustix::fs::Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    std::fs::create_dir_all(dir.path().join("18/task")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("18/maps")).unwrap();
    let fs = vramguard_proc::ProcFs::open(dir.path()).unwrap();
    let read = |pid| match fs.driver_library(pid).unwrap() {
        Found::Yes(l) => Some(l),
        _ => None,
    };
    assert_eq!(read(10), Some(DriverLibrary::Cuda));
    assert_eq!(read(11), Some(DriverLibrary::Cuda));
    assert_eq!(read(12), Some(DriverLibrary::NvmlOnly));
    assert_eq!(read(13), Some(DriverLibrary::Neither));
    assert_eq!(
        read(14),
        Some(DriverLibrary::Neither),
        "libcudart is not the driver"
    );
    assert_eq!(
        read(15),
        Some(DriverLibrary::Cuda),
        "through the live thread"
    );
    assert_eq!(
        read(16),
        Some(DriverLibrary::Unknown),
        "empty: no proof of absence"
    );
    assert_eq!(read(17), Some(DriverLibrary::Unknown));
    let t = std::time::Instant::now();
    assert_eq!(
        read(18),
        Some(DriverLibrary::Unknown),
        "endless: cut at the bound"
    );
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(read(19), None, "gone");
    assert_eq!(
        read(20),
        Some(DriverLibrary::Unknown),
        "a name cut by the buffer"
    );
    assert_eq!(
        read(21),
        Some(DriverLibrary::Unknown),
        "a thread in D: the map unread"
    );
}

/// The kernel's children lists of one process: every thread's, up to the thread bound; past
/// it, or with a thread's list unreadable, the answer says it is not whole (a child forked by
/// a thread left out would be missed, and the holder's work is then unknown). A process that
/// is gone has none; a kernel without the lists says so.
#[test]
fn children_lists_are_read_up_to_the_thread_bound_and_say_when_cut() {
    use vramguard_proc::procfs::{MAX_THREADS_LOOKED_AT, ProcFs};
    let dir = tempfile::tempdir().unwrap();
    let task = dir.path().join("700/task");
    let threads = |n: usize| {
        for tid in 700..700 + n {
            let t = task.join(tid.to_string());
            std::fs::create_dir_all(&t).unwrap();
            // The last thread's child is the one a cut would miss.
            let children = if tid == 700 { "701 702 " } else { "" };
            std::fs::write(t.join("children"), children).unwrap();
        }
    };
    threads(3);
    std::fs::write(task.join("702/children"), "9000\n").unwrap();
    let fs = ProcFs::open(dir.path()).unwrap();
    let (mut got, whole) = fs
        .children_within(700, MAX_THREADS_LOOKED_AT)
        .unwrap()
        .unwrap();
    got.sort_unstable();
    assert_eq!((got, whole), (vec![701, 702, 9000], true));
    // One thread more than the bound: cut, and said to be.
    threads(MAX_THREADS_LOOKED_AT + 1);
    let (_, whole) = fs
        .children_within(700, MAX_THREADS_LOOKED_AT)
        .unwrap()
        .unwrap();
    assert!(
        !whole,
        "{} threads looked at as if whole",
        MAX_THREADS_LOOKED_AT + 1
    );
    let (_, whole) = fs
        .children_within(700, MAX_THREADS_LOOKED_AT + 1)
        .unwrap()
        .unwrap();
    assert!(whole);
    // Gone: no children, nothing missed.
    assert_eq!(fs.children_within(999, 10).unwrap(), Some((vec![], true)));
    // A thread directory without a `children` file: the kernel keeps no lists.
    std::fs::remove_file(task.join("701/children")).unwrap();
    assert_eq!(
        fs.children_within(700, MAX_THREADS_LOOKED_AT + 1).unwrap(),
        None
    );
}
