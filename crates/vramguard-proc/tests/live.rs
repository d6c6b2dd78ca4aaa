//! The collector against the live `/proc`, with real processes holding stand-in device files.

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use vramguard_core::snapshot::{DeviceFile, FdScan};
use vramguard_proc::{ProcCollector, ScanDepth};

/// Kills and reaps the child on drop, so a failing test leaves nothing behind.
struct Reaped(Child);
impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A process this test started but did not fork itself (a grandchild), held by a pidfd and
/// SIGKILLed through it on drop: a pid reused meanwhile is never hit.
struct KilledOnDrop(Option<std::os::fd::OwnedFd>);
impl KilledOnDrop {
    fn pin(pid: u32) -> KilledOnDrop {
        let pidfd = rustix::process::Pid::from_raw(pid as i32).and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
        });
        KilledOnDrop(pidfd)
    }
}
impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        if let Some(fd) = &self.0 {
            let _ = rustix::process::pidfd_send_signal(fd, rustix::process::Signal::KILL);
        }
    }
}

fn dev_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for name in ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"] {
        std::fs::write(dir.path().join(name), b"").unwrap();
    }
    dir
}

/// `sh` opens the files on fds 3.. and execs `sleep`, which keeps them open.
fn holder(dev: &Path, files: &[&str]) -> Reaped {
    let mut script = String::new();
    for (i, f) in files.iter().enumerate() {
        script.push_str(&format!("exec {}<{} ; ", i + 3, dev.join(f).display()));
    }
    script.push_str("exec sleep 60");
    let h = Reaped(Command::new("sh").arg("-c").arg(script).spawn().unwrap());
    // Every file is open once it has exec'd `sleep`: no scan catches it half-way.
    let pid = h.0.id();
    wait_until("the holder to open its files", || {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
    });
    h
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn holds(c: &mut ProcCollector, pid: u32, depth: ScanDepth) -> Option<FdScan> {
    let got = c.collect(&[], depth, 0).unwrap();
    got.processes
        .into_iter()
        .find(|p| p.pid == pid)
        .map(|p| p.device_files)
}

#[test]
fn a_live_holder_is_found_and_its_departure_remembered() {
    let dev = dev_dir();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    let mut h = holder(dev.path(), &["nvidiactl", "nvidia1"]);
    let pid = h.0.id();
    wait_until("the holder to open its files", || {
        holds(&mut c, pid, ScanDepth::Full).is_some_and(|d| d.holds_any() == Some(true))
    });
    // The steady state re-reads the known holder without listing /proc.
    let got = c.collect(&[], ScanDepth::Holders, 5).unwrap();
    let p = got.processes.iter().find(|p| p.pid == pid).unwrap();
    assert_eq!(
        p.device_files,
        FdScan::Scanned(vec![DeviceFile::Gpu(1), DeviceFile::Ctl])
    );
    assert_eq!(p.comm.as_deref(), Some("sleep"));
    assert_eq!(p.ppid, Some(std::process::id()));
    assert!(p.start_ticks.is_some());
    // Its parent (this test) is collected as a relative.
    assert!(got.processes.iter().any(|p| p.pid == std::process::id()));

    h.0.kill().unwrap();
    h.0.wait().unwrap();
    // Its held stat fd now reads ESRCH: the departure is noticed without a listing.
    let got = c.collect(&[], ScanDepth::Holders, 42).unwrap();
    assert!(got.processes.iter().all(|p| p.pid != pid));
    let d = got
        .departed
        .iter()
        .find(|d| d.pid == pid)
        .expect("departure recorded");
    assert_eq!(d.comm.as_deref(), Some("sleep"));
    assert_eq!(d.gone_at_ms, 42);
    // Forgotten with its departure: later collections neither collect it nor find the
    // collector's index of holders out of date (debug builds check it against a fresh pass).
    for depth in [ScanDepth::Cached, ScanDepth::Holders] {
        let got = c.collect(&[], depth, 43).unwrap();
        assert!(got.processes.iter().all(|p| p.pid != pid));
    }
}

/// (#28) The agent's quiet samples rest on this: the holders' pidfds say, without being
/// read, whether one exited since the last collection; a collection clears it again.
#[test]
fn nothing_exited_holds_until_a_followed_process_exits() {
    let dev = dev_dir();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    assert!(!c.nothing_exited(), "no collection yet: it cannot tell");
    let mut h = holder(dev.path(), &["nvidia0"]);
    let pid = h.0.id();
    // The first collection opens no pidfd (a one-shot command needs none): it cannot tell.
    let mut first = ProcCollector::new("/proc", dev.path()).unwrap();
    first.collect(&[pid], ScanDepth::Full, 0).unwrap();
    assert!(!first.nothing_exited(), "no pidfd yet");
    wait_until("the holder to open its files", || {
        holds(&mut c, pid, ScanDepth::Full).is_some_and(|d| d.holds_any() == Some(true))
    });
    // Its pidfd is taken by a collection after the one that found it.
    c.collect(&[], ScanDepth::Holders, 1).unwrap();
    assert!(c.nothing_exited());
    // Asking does not consume: still true, and a cached collection reuses its facts.
    assert!(c.nothing_exited());
    h.0.kill().unwrap();
    h.0.wait().unwrap();
    wait_until("the exit to show", || !c.nothing_exited());
    assert!(!c.nothing_exited(), "asking does not consume the exit");
    let got = c.collect(&[], ScanDepth::Cached, 2).unwrap();
    assert!(got.processes.iter().all(|p| p.pid != pid));
    assert!(c.nothing_exited(), "the collection took the exit");
}

#[test]
fn an_incremental_collection_scans_new_processes() {
    let dev = dev_dir();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    c.collect(&[], ScanDepth::Full, 0).unwrap();
    let h = holder(dev.path(), &["nvidia0"]);
    let pid = h.0.id();
    // The shell may not have opened the file at the first look (it is cached as holding
    // nothing); once the driver lists the pid, it is scanned again.
    wait_until("the new holder", || {
        let got = c.collect(&[pid], ScanDepth::NewProcesses, 0).unwrap();
        got.processes
            .iter()
            .any(|p| p.pid == pid && p.device_files.holds_any() == Some(true))
    });
}

#[test]
fn processes_vanishing_mid_scan_are_never_errors() {
    let dev = dev_dir();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let mut kids: Vec<Child> = (0..20)
                    .map(|_| Command::new("true").spawn().unwrap())
                    .collect();
                for k in &mut kids {
                    k.wait().unwrap();
                }
            }
        })
    };
    for i in 0..40 {
        let depth = if i % 2 == 0 {
            ScanDepth::Full
        } else {
            ScanDepth::NewProcesses
        };
        c.collect(&[], depth, i).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    churn.join().unwrap();
}

#[test]
fn a_process_in_a_new_pid_namespace_shows_both_pids() {
    let dev = dev_dir();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    let script = format!(
        "exec 3<{} ; exec sleep 60",
        dev.path().join("nvidia0").display()
    );
    let unshare = Reaped(
        Command::new("unshare")
            .args(["--pid", "--fork", "sh", "-c", &script])
            .spawn()
            .unwrap(),
    );
    let mut inner_pid = None;
    wait_until("the namespaced holder", || {
        let got = c.collect(&[], ScanDepth::Full, 0).unwrap();
        inner_pid = got
            .processes
            .iter()
            .find(|p| p.ppid == Some(unshare.0.id()) && p.device_files.holds_any() == Some(true))
            .map(|p| (p.pid, p.nspid.clone()));
        inner_pid.is_some()
    });
    let (pid, nspid) = inner_pid.unwrap();
    assert_eq!(
        nspid,
        vec![pid, 1],
        "host pid, then pid 1 inside the namespace"
    );
    // We started it (it is our grandchild): kill it by pid.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
}

#[test]
fn host_facts_describe_this_process() {
    let dev = dev_dir();
    let got = ProcCollector::new("/proc", dev.path())
        .unwrap()
        .collect(&[], ScanDepth::NewProcesses, 0)
        .unwrap();
    assert_eq!(got.host.self_pid, std::process::id());
    assert!(got.host.self_ancestors.contains(&1) || got.host.self_ancestors.is_empty());
    assert!(got.host.boot_time_ms.is_some());
    assert!(got.host.clock_ticks_per_sec > 0);
}

#[test]
fn a_process_that_opens_the_device_after_it_was_first_seen_is_found_once_listed() {
    let dev = dev_dir();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    // Seen first while it holds nothing: it opens the device only when told to (a line on its
    // stdin), then execs, which the collector notices.
    let script = format!(
        "read go; exec 3<{} ; exec sleep 60",
        dev.path().join("nvidia0").display()
    );
    let mut h = Reaped(
        Command::new("sh")
            .arg("-c")
            .arg(script)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = h.0.id();
    let first = c.collect(&[], ScanDepth::NewProcesses, 0).unwrap();
    assert!(
        first.processes.iter().all(|p| p.pid != pid),
        "holds nothing yet"
    );
    {
        use std::io::Write;
        let mut stdin = h.0.stdin.take().unwrap();
        stdin.write_all(b"go\n").unwrap();
    }
    // Once it has exec'd `sleep`, the device is open.
    wait_until("the exec after opening the device", || {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
    });
    // Not listed: a new-process scan does not look again (a full scan would).
    let unlisted = c.collect(&[], ScanDepth::NewProcesses, 0).unwrap();
    assert!(unlisted.processes.iter().all(|p| p.pid != pid));
    // Listed by the driver: looked at again.
    let listed = c.collect(&[pid], ScanDepth::NewProcesses, 0).unwrap();
    let p = listed.processes.iter().find(|p| p.pid == pid).unwrap();
    assert_eq!(p.device_files, FdScan::Scanned(vec![DeviceFile::Gpu(0)]));
    drop(h);
}

#[test]
fn the_steady_state_finds_a_listed_pid_it_never_saw() {
    let dev = dev_dir();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    c.collect(&[], ScanDepth::Full, 0).unwrap();
    let h = holder(dev.path(), &["nvidia0"]);
    let pid = h.0.id();
    wait_until("the listed holder", || {
        c.collect(&[pid], ScanDepth::Holders, 0)
            .unwrap()
            .processes
            .iter()
            .any(|p| p.pid == pid && p.device_files.holds_any() == Some(true))
    });
    // Unlisted new processes are not the steady state's business.
    // `holder` returns once its files are open: a scan now would see them.
    let other = holder(dev.path(), &["nvidia1"]);
    let got = c.collect(&[pid], ScanDepth::Holders, 0).unwrap();
    assert!(got.processes.iter().all(|p| p.pid != other.0.id()));
    let got = c.collect(&[pid], ScanDepth::NewProcesses, 0).unwrap();
    assert!(got.processes.iter().any(|p| p.pid == other.0.id()));
}

#[test]
fn a_cached_collection_reuses_facts_until_a_watched_process_exits() {
    let dev = dev_dir();
    let c = ProcCollector::new("/proc", dev.path()).unwrap();
    cached_collections_reuse_facts_until_a_watched_process_exits(c, dev.path());
}

#[test]
fn without_an_epoll_set_each_pidfd_is_polled_and_an_exit_is_news_once() {
    let dev = dev_dir();
    let c = ProcCollector::new("/proc", dev.path())
        .unwrap()
        .with_exits_polled();
    cached_collections_reuse_facts_until_a_watched_process_exits(c, dev.path());
}

fn cached_collections_reuse_facts_until_a_watched_process_exits(mut c: ProcCollector, dev: &Path) {
    use rustix::process::{Pid, PidfdFlags, Signal, pidfd_open, pidfd_send_signal};
    // A job: a shell whose child holds the device.
    let script = format!(
        "sh -c 'exec 3<{}; exec sleep 60' & wait",
        dev.join("nvidia0").display()
    );
    let mut job = Reaped(Command::new("sh").arg("-c").arg(script).spawn().unwrap());
    let leader = job.0.id();
    let mut worker = 0;
    wait_until("the worker to hold the device", || {
        let got = c.collect(&[], ScanDepth::Full, 0).unwrap();
        worker = got
            .processes
            .iter()
            .find(|p| p.ppid == Some(leader) && p.device_files.holds_any() == Some(true))
            .map_or(0, |p| p.pid);
        worker != 0
    });
    // Pinned while its parent is the job, so the cleanup never signals a reused pid.
    let pidfd = pidfd_open(Pid::from_raw(worker as i32).unwrap(), PidfdFlags::empty()).unwrap();
    struct Kill(rustix::fd::OwnedFd);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = pidfd_send_signal(&self.0, Signal::KILL);
        }
    }
    let worker_fd = Kill(pidfd);
    let state_of = |c: &mut ProcCollector, depth| {
        let got = c.collect(&[], depth, 0).unwrap();
        let p = got.processes.into_iter().find(|p| p.pid == worker).unwrap();
        (p.state, p.ppid)
    };
    // Sleeping, or running for a moment on a loaded machine: not stopped.
    let (before, ppid) = state_of(&mut c, ScanDepth::Cached);
    assert_eq!(ppid, Some(leader));
    assert!(matches!(before, Some('S' | 'R')), "{before:?}");

    // Stopping it announces nothing: a cached collection does not see it, a re-read does.
    pidfd_send_signal(&worker_fd.0, Signal::STOP).unwrap();
    wait_until("the worker to stop", || {
        std::fs::read_to_string(format!("/proc/{worker}/stat"))
            .is_ok_and(|s| s.rsplit(')').next().unwrap().trim_start().starts_with('T'))
    });
    assert_eq!(state_of(&mut c, ScanDepth::Cached).0, before);
    assert_eq!(state_of(&mut c, ScanDepth::Holders).0, Some('T'));
    assert_eq!(state_of(&mut c, ScanDepth::Cached).0, Some('T'));
    pidfd_send_signal(&worker_fd.0, Signal::CONT).unwrap();
    wait_until("the worker to run again", || {
        std::fs::read_to_string(format!("/proc/{worker}/stat"))
            .is_ok_and(|s| !s.rsplit(')').next().unwrap().trim_start().starts_with('T'))
    });

    // The job's leader exits: its pidfd announces it, and the cached collection re-reads
    // everything, seeing the worker re-parented.
    job.0.kill().unwrap();
    job.0.wait().unwrap();
    let (_, ppid) = state_of(&mut c, ScanDepth::Cached);
    assert_ne!(
        ppid,
        Some(leader),
        "the orphaned worker's new parent is seen at once"
    );
    // An exit is news once: the next cached collection reuses facts again (a pidfd left
    // readable would make every collection a full re-read).
    pidfd_send_signal(&worker_fd.0, Signal::STOP).unwrap();
    wait_until("the worker to stop again", || {
        std::fs::read_to_string(format!("/proc/{worker}/stat"))
            .is_ok_and(|s| s.rsplit(')').next().unwrap().trim_start().starts_with('T'))
    });
    assert_ne!(
        state_of(&mut c, ScanDepth::Cached).0,
        Some('T'),
        "the leader's exit was announced again"
    );
    pidfd_send_signal(&worker_fd.0, Signal::CONT).unwrap();
    drop(worker_fd);
}

#[test]
fn a_holder_whose_parent_dies_keeps_its_earlier_parent_and_ancestors_are_collected() {
    let dev = dev_dir();
    // A parent shell that starts a holder in the background, then waits to be told to exit.
    let gate = dev.path().join("gate");
    let pidfile = dev.path().join("pid");
    let script = format!(
        "exec 3<{nv}; sleep 60 <&3 & echo $! > {pf}; while [ ! -e {g} ]; do sleep 0.05; done",
        nv = dev.path().join("nvidia0").display(),
        pf = pidfile.display(),
        g = gate.display()
    );
    let parent = Reaped(Command::new("sh").arg("-c").arg(&script).spawn().unwrap());
    let deadline = Instant::now() + Duration::from_secs(10);
    let holder: u32 = loop {
        if let Some(pid) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse().ok())
        {
            break pid;
        }
        assert!(Instant::now() < deadline, "the holder never started");
        std::thread::sleep(Duration::from_millis(10));
    };
    // Killed however the test ends, if it is still the process started here.
    let _cleanup = KilledOnDrop::pin(holder);
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    let first = c.collect(&[holder], ScanDepth::NewProcesses, 1).unwrap();
    let h = first.processes.iter().find(|p| p.pid == holder).unwrap();
    assert_eq!(h.ppid, Some(parent.0.id()));
    assert_eq!(h.earlier_ppid, None);
    // Its ancestors are collected up the tree: the parent, and the parent's parent (us).
    let pids: Vec<u32> = first.processes.iter().map(|p| p.pid).collect();
    assert!(
        pids.contains(&parent.0.id()) && pids.contains(&std::process::id()),
        "{pids:?}"
    );

    std::fs::write(&gate, b"").unwrap();
    let mut parent = parent;
    parent.0.wait().unwrap();
    let second = c.collect(&[holder], ScanDepth::NewProcesses, 2).unwrap();
    let h = second.processes.iter().find(|p| p.pid == holder).unwrap();
    assert_ne!(h.ppid, Some(parent.0.id()), "re-parented");
    assert_eq!(h.earlier_ppid, Some(parent.0.id()));
}

/// The facts the simulator asks of `ProcFs` about a process's PID namespace and open files,
/// against the live tree: `self` and a pid name the same process, the namespace is the one
/// `ns/pid` links to, and an open file is found by the path it links to.
#[test]
fn namespace_and_open_file_facts_name_the_process_asked_about() {
    use vramguard_proc::{NamespaceId, ProcDir, ProcFs};
    let proc = ProcFs::own().unwrap();
    let me = std::process::id();
    assert_eq!(proc.self_pid(), Some(me));
    let nspid = proc.namespace_pids(ProcDir::Reader).unwrap();
    assert_eq!(nspid, proc.namespace_pids(ProcDir::Pid(me)).unwrap());
    assert_eq!(nspid.first(), Some(&me), "{nspid:?}");
    let ns = proc.pid_namespace(ProcDir::Reader).unwrap();
    let link = std::fs::read_link("/proc/self/ns/pid").unwrap();
    assert_eq!(
        link.to_str().unwrap(),
        format!("pid:[{}]", ns.ino),
        "the inode is the link's number"
    );
    let opened = proc.open_pid_namespace(ProcDir::Pid(me)).unwrap();
    assert_eq!(NamespaceId::of_fd(&opened), Some(ns));
    assert_eq!(proc.stat_of(ProcDir::Reader).unwrap().ok().unwrap().pid, me);

    let dev = dev_dir();
    let h = holder(dev.path(), &["nvidia0"]);
    let pid = h.0.id();
    let target = dev.path().join("nvidia0");
    wait_until("the holder opens its file", || {
        matches!(
            proc.holds_open(pid, &target),
            Ok(vramguard_proc::Found::Yes(true))
        )
    });
    assert!(matches!(
        proc.holds_open(pid, &dev.path().join("nvidia1")),
        Ok(vramguard_proc::Found::Yes(false))
    ));
    drop(h);
    assert!(matches!(
        proc.holds_open(pid, &target),
        Ok(vramguard_proc::Found::Gone)
    ));
    assert_eq!(proc.namespace_pids(ProcDir::Pid(pid)), None, "gone");
}

#[test]
fn a_one_shot_collection_watches_no_exit_and_a_second_one_does() {
    let dev = dev_dir();
    let h = holder(dev.path(), &["nvidia0"]);
    let pid = h.0.id();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    assert!(holds(&mut c, pid, ScanDepth::Full).is_some_and(|d| d.holds_any() == Some(true)));
    assert_eq!(
        c.exit_watches(),
        0,
        "a command that collects once (status, diagnose) opens no pidfd"
    );
    holds(&mut c, pid, ScanDepth::Holders).unwrap();
    assert!(
        c.exit_watches() >= 1,
        "a collector that collects again watches its holders' exits"
    );
}

#[test]
fn many_holders_found_by_one_scan_each_get_their_own_identity() {
    // Enough new holders for their first reads to be made on every core at once: each must
    // come back under its own pid (its own command line, its own stat), none under another's.
    let dev = dev_dir();
    // Threads even on a one-core runner: the parallel path is the one under test.
    let mut c = ProcCollector::new("/proc", dev.path())
        .unwrap()
        .with_read_threads(4);
    let holders: Vec<(Reaped, String)> = (0..80)
        .map(|i| {
            let arg = format!("600.{i}");
            let script = format!(
                "exec 3<{} ; exec sleep {arg}",
                dev.path().join("nvidia0").display()
            );
            let h = Reaped(Command::new("sh").arg("-c").arg(script).spawn().unwrap());
            (h, arg)
        })
        .collect();
    for (h, _) in &holders {
        let pid = h.0.id();
        wait_until("a holder to open its file", || {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
        });
    }
    let got = c.collect(&[], ScanDepth::Full, 0).unwrap();
    for (h, arg) in &holders {
        let pid = h.0.id();
        let p = got
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap_or_else(|| panic!("holder {pid} not collected"));
        assert_eq!(p.device_files.holds_any(), Some(true), "holder {pid}");
        assert_eq!(
            p.cmdline.as_deref(),
            Some(&["sleep".to_string(), arg.clone()][..]),
            "holder {pid}'s command line"
        );
        assert_eq!(p.ppid, Some(std::process::id()), "holder {pid}'s parent");
        assert_eq!(p.uid, Some(rustix::process::getuid().as_raw()));
        assert!(p.exe.as_ref().is_some_and(|e| e.path.ends_with("sleep")));
        assert!(p.host_memory.is_some(), "holder {pid}'s host memory");
    }
}

#[test]
fn shared_memory_is_read_again_within_its_own_period_at_any_depth() {
    // The agent's full fd scans can be ten minutes apart: a leaked segment must show within
    // HOST_MEMORY_EVERY_MS all the same, even in collections that re-read nothing.
    let dev = dev_dir();
    let shm = tempfile::tempdir().unwrap();
    let mut c = ProcCollector::new("/proc", dev.path())
        .unwrap()
        .with_shm_dirs(vec![shm.path().to_path_buf()]);
    let segments = |c: &mut ProcCollector, now_ms| {
        c.collect(&[], ScanDepth::Cached, now_ms)
            .unwrap()
            .host_memory
            .shm[0]
            .segments
            .iter()
            .map(|s| s.name.clone())
            .collect::<Vec<_>>()
    };
    c.collect(&[], ScanDepth::Full, 0).unwrap();
    std::fs::write(shm.path().join("leaked"), vec![1u8; 8192]).unwrap();
    let every = vramguard_proc::collector::HOST_MEMORY_EVERY_MS;
    assert!(
        segments(&mut c, every / 2).is_empty(),
        "read again too soon"
    );
    assert_eq!(segments(&mut c, every), ["leaked"]);
}

#[test]
fn command_lines_are_left_out_when_turned_off_and_read_again_when_turned_on() {
    let dev = dev_dir();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    c.set_command_lines(false);
    let h = holder(dev.path(), &["nvidia0"]);
    let pid = h.0.id();
    let command_of = |c: &mut ProcCollector, depth| {
        let got = c.collect(&[], depth, 0).unwrap();
        let p = got.processes.into_iter().find(|p| p.pid == pid).unwrap();
        (p.cmdline, p.comm)
    };
    let (cmdline, comm) = command_of(&mut c, ScanDepth::Full);
    assert_eq!(cmdline, None);
    assert_eq!(comm.as_deref(), Some("sleep"), "the rest is read");
    for depth in [ScanDepth::Holders, ScanDepth::Cached] {
        assert_eq!(command_of(&mut c, depth).0, None, "{depth:?}");
    }
    // Turned on: the very next collection, even a cached one, has it.
    c.set_command_lines(true);
    let (cmdline, _) = command_of(&mut c, ScanDepth::Cached);
    assert_eq!(
        cmdline,
        Some(vec!["sleep".to_string(), "60".to_string()]),
        "read again once turned on"
    );
}

/// A process whose main thread exited (`SYS_exit`, as `pthread_exit` does) while another
/// thread runs on: its threads are read, the running one not on its way out, so the process
/// reads as alive; once SIGKILLed, it is gone.
#[test]
fn a_thread_that_runs_on_after_its_main_thread_exited_is_read_as_not_leaving() {
    let dev = dev_dir();
    let script = format!(
        "import ctypes, os, threading, time\n\
         f = open({:?})\n\
         threading.Thread(target=lambda: time.sleep(60)).start()\n\
         time.sleep(0.05)\n\
         ctypes.CDLL(None).syscall(60, 0)\n",
        dev.path().join("nvidia0").display().to_string()
    );
    let h = Reaped(
        Command::new("python3")
            .arg("-c")
            .arg(script)
            .spawn()
            .unwrap(),
    );
    let pid = h.0.id();
    wait_until("the main thread to exit", || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit(')').next().unwrap().trim_start().starts_with('Z'))
    });
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    let got = c.collect(&[pid], ScanDepth::Full, 0).unwrap();
    let p = got.processes.iter().find(|p| p.pid == pid).unwrap();
    assert_eq!(p.state, Some('Z'));
    let threads = p
        .threads
        .as_deref()
        .expect("a zombie leader's threads are read");
    let runner = threads
        .iter()
        .find(|t| t.tid != pid)
        .expect("the running thread");
    assert_eq!(runner.leaving, Some(false), "{threads:?}");
    assert!(
        p.thread_runs_on() && !p.is_finished() && !p.is_exiting(),
        "{p:#?}"
    );
    drop(h);
}

/// A process in uninterruptible sleep (a thread in D: a checkpoint written to a slow
/// filesystem, or stuck in the driver) is seen so by the work sampler, apart from running:
/// a trainer blocked writing to NFS, its launcher gone, must not read as an idle orphan, nor
/// memory stuck in the driver as a working job's. Here the wait is a `vfork` whose child
/// never execs (state D, as the simulator's stuck holder does).
#[test]
fn a_process_waiting_in_d_state_is_observed_waiting() {
    // SAFETY: the child calls only async-signal-safe functions (vfork, alarm, pause, _exit)
    // before it dies.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork");
    if child == 0 {
        unsafe {
            if libc::vfork() == 0 {
                libc::alarm(30);
                libc::pause();
                libc::_exit(0);
            }
            libc::_exit(0);
        }
    }
    let pid = child as u32;
    let fs = vramguard_proc::ProcFs::open("/proc").unwrap();
    wait_until("the child to wait in D", || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") D "))
    });
    let grandchild = fs.children(pid).unwrap().unwrap_or_default();
    let observed = fs.work_probe(pid).unwrap();
    for g in &grandchild {
        // SAFETY: kill(2) on the vfork child this test's child made.
        unsafe { libc::kill(*g as i32, libc::SIGKILL) };
    }
    // SAFETY: kill(2) and waitpid(2) on the child this test forked.
    unsafe {
        libc::kill(child, libc::SIGKILL);
        libc::waitpid(child, std::ptr::null_mut(), 0);
    }
    assert_eq!(grandchild.len(), 1);
    match observed {
        vramguard_proc::Found::Yes(p) => {
            assert!(p.waiting, "a thread in D was not seen");
            assert!(!p.running, "a thread in D is not running");
        }
        other => panic!("{other:?}"),
    }
}

/// A process that runs one short busy child after another (a compile, `tar` per shard) works
/// through them, though it uses no CPU itself and each child is gone before the next
/// observation: the time of the children it waited for counts as its own.
#[test]
fn the_cpu_of_children_waited_for_counts_as_the_parents_work() {
    let parent = Reaped(
        Command::new("sh")
            .arg("-c")
            .arg("while :; do timeout 0.1 sh -c 'while :; do :; done'; done")
            .spawn()
            .unwrap(),
    );
    let pid = parent.0.id();
    let fs = vramguard_proc::ProcFs::open("/proc").unwrap();
    let probe = || match fs.work_probe(pid).unwrap() {
        vramguard_proc::Found::Yes(p) => p.cpu_ticks,
        other => panic!("{other:?}"),
    };
    let before = probe();
    std::thread::sleep(Duration::from_millis(1500));
    let after = probe();
    let own = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = own.rsplit_once(") ").unwrap().1.split(' ').collect();
    let own_ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // About 100 ticks a second of its children's; its own is a few.
    assert!(
        after - before >= 50,
        "{before} -> {after} (its own: {own_ticks})"
    );
    assert!(own_ticks < 50, "the parent itself was busy: {own_ticks}");
}

/// A thread that took an fd table of its own (`unshare(CLONE_FILES)`) and opened the device
/// there: the process's `fd/` does not show it, so a full scan misses the holder; the
/// thorough scan a reset is decided on reads such a thread's table and finds it (red team:
/// a GPU reset ran under such a holder, refused only by the driver).
#[test]
fn a_device_file_held_in_a_threads_own_fd_table_is_found_by_the_thorough_scan() {
    let dev = dev_dir();
    let h = python_ready(
        include_str!("../../vramguard-testkit/scripts/thread_table_holder.py"),
        &[dev.path().join("nvidia0").as_os_str()],
    );
    let pid = h.0.id();
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    // Not a holder at all to a full scan (so not collected).
    let full = holds(&mut c, pid, ScanDepth::Full);
    assert!(
        full.as_ref().is_none_or(|d| d.holds_any() != Some(true)),
        "the process's fd/ shows it: {full:?}"
    );
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    let thorough = holds(&mut c, pid, ScanDepth::Thorough).unwrap();
    assert_eq!(thorough, FdScan::Scanned(vec![DeviceFile::Gpu(0)]));
    // A pid the driver lists is read through every table at any depth (a live process with
    // a context must not read as an exited one).
    let mut c = ProcCollector::new("/proc", dev.path()).unwrap();
    for depth in [ScanDepth::Full, ScanDepth::NewProcesses, ScanDepth::Holders] {
        let got = c.collect(&[pid], depth, 0).unwrap();
        let listed = got.processes.iter().find(|p| p.pid == pid);
        assert_eq!(
            listed.map(|p| &p.device_files),
            Some(&FdScan::Scanned(vec![DeviceFile::Gpu(0)])),
            "{depth:?}"
        );
    }
}

/// More threads than are looked at: their fd tables are not all read, so the process's files
/// are not all known, and the thorough scan says so (unread, not "holds nothing").
#[test]
fn a_process_of_more_threads_than_are_looked_at_is_unread_by_the_thorough_scan() {
    let dev = dev_dir();
    let script = format!(
        r#"
import threading, time
threading.stack_size(65536)
for _ in range({}):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"#,
        vramguard_proc::procfs::MAX_THREADS_LOOKED_AT + 1
    );
    let h = python_ready(&script, &[]);
    let c = vramguard_proc::ProcFs::own().unwrap();
    let devices = vramguard_proc::devices::DeviceTable::load(dev.path());
    let scan = c
        .device_files_of_every_table(h.0.id(), &devices, true)
        .unwrap();
    assert!(
        matches!(scan, vramguard_proc::Found::Yes(FdScan::Denied)),
        "{scan:?}"
    );
}

/// A `python3 -c script args…` that prints `ready` once set up; returns then.
fn python_ready(script: &str, args: &[&std::ffi::OsStr]) -> Reaped {
    use std::io::BufRead;
    let mut h = Reaped(
        Command::new("python3")
            .args(["-c", script])
            .args(args)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufReader::new(h.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "ready");
    h
}
