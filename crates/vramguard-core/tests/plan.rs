//! The reclaim planner: one test per safety rule, and a property test that no random process
//! table ever yields a forbidden target.

mod support;

use proptest::prelude::*;
use std::collections::BTreeSet;
use vramguard_core::plan::{ReclaimOptions, plan_reclaim};
use vramguard_core::policy::DEFAULT_GPU_WORK_MIN_PERCENT;
use vramguard_core::report::Class;
use vramguard_core::snapshot::*;
use vramguard_core::{Policy, Snapshot, classify};

const GIB: u64 = 1 << 30;

fn gpu(index: u32, used: u64, procs: &[(u32, u64)]) -> GpuSample {
    GpuSample {
        index,
        uuid: Some(format!("GPU-{index}")),
        name: Some("NVIDIA H200".into()),
        pci_bus_id: None,
        minor_number: Some(index),
        memory: Some(GpuMemory {
            total: 140 * GIB,
            reserved: 0,
            used,
            free: 140 * GIB - used,
        }),
        persistence_mode: Some(true),
        processes: procs
            .iter()
            .map(|(pid, b)| GpuProcess {
                pid: *pid,
                kinds: vec![ProcessKind::Compute],
                used_bytes: Some(*b),
            })
            .collect(),
        process_list: ProcessListState::Complete,
        // A window that just began and saw no busy process.
        utilization: Some(UtilizationWindow {
            since_ms: 1_000_000 - 1000,
            samples: vec![],
        }),
        failure: None,
        warnings: vec![],
        health: Default::default(),
        mig_devices: Vec::new(),
        telemetry: None,
    }
}

/// `p` with `/dev/nvidia-uvm` open too: a CUDA process (its own context or an inherited one).
fn cuda(mut p: ProcessFacts) -> ProcessFacts {
    if let FdScan::Scanned(files) = &mut p.device_files {
        files.push(DeviceFile::Uvm);
        files.sort();
    }
    p
}

fn p(pid: u32, ppid: u32, pgid: u32, comm: &str, gpus: &[u32]) -> ProcessFacts {
    let mut files = vec![DeviceFile::Ctl];
    files.extend(gpus.iter().map(|g| DeviceFile::Gpu(*g)));
    ProcessFacts {
        pid,
        ppid: Some(ppid),
        pgid: Some(pgid),
        sid: Some(pgid),
        state: Some('S'),
        flags: Some(0),
        start_ticks: Some(100 + pid as u64),
        uid: Some(1000),
        comm: Some(comm.into()),
        cmdline: Some(vec![comm.into()]),
        nspid: vec![pid],
        device_files: FdScan::Scanned(if gpus.is_empty() { vec![] } else { files }),
        ..Default::default()
    }
}

fn snap(gpus: Vec<GpuSample>, processes: Vec<ProcessFacts>) -> Snapshot {
    let mut s = Snapshot {
        taken_at_ms: 1_000_000,
        host: HostFacts {
            hostname: None,
            clock_ticks_per_sec: 100,
            boot_time_ms: Some(0),
            self_pid: 9000,
            self_ancestors: vec![8999, 1],
            pid_namespace_is_host: Some(true),
            euid: 0,
            cap_effective: None,
        },
        driver: DriverFacts {
            source: DriverSource::Simulated,
            library: None,
            driver_version: None,
            nvml_version: None,
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

fn plan_of(s: &Snapshot, opts: &ReclaimOptions) -> vramguard_core::plan::Plan {
    plan_reclaim(s, &classify(s, &Policy::default()), opts)
}

fn init() -> ProcessFacts {
    p(1, 0, 1, "systemd", &[])
}

#[test]
fn orphans_are_grouped_under_their_dead_leader_and_live_jobs_left_alone() {
    let s = snap(
        vec![gpu(
            0,
            20 * GIB,
            &[(201, 4 * GIB), (202, 4 * GIB), (300, 12 * GIB)],
        )],
        vec![
            init(),
            p(201, 1, 200, "python", &[0]),
            p(202, 1, 200, "python", &[0]),
            p(300, 1, 300, "vllm", &[0]),
        ],
    );
    let plan = plan_of(&s, &ReclaimOptions::default());
    assert_eq!(plan.jobs.len(), 1);
    assert_eq!(plan.jobs[0].leader_pid, Some(200));
    let pids: Vec<u32> = plan.targets().map(|t| t.pid).collect();
    assert_eq!(pids, vec![201, 202]);
    assert_eq!(plan.targets().next().unwrap().start_ticks, 301);
    assert_eq!(plan.expected_free.get(&0), Some(&(8 * GIB)));
    let alone = &plan.left_alone[0];
    assert_eq!((alone.pid, alone.class), (300, Class::Active));
    assert_eq!(alone.reason, "its job is alive");
}

#[test]
fn gpu_selection_limits_the_plan() {
    let s = snap(
        vec![
            gpu(0, 4 * GIB, &[(201, 4 * GIB)]),
            gpu(1, 4 * GIB, &[(211, 4 * GIB)]),
        ],
        vec![
            init(),
            p(201, 1, 200, "python", &[0]),
            p(211, 1, 210, "python", &[1]),
        ],
    );
    let opts = ReclaimOptions {
        gpus: Some([1].into_iter().collect()),
        ..Default::default()
    };
    let plan = plan_of(&s, &opts);
    assert_eq!(plan.targets().map(|t| t.pid).collect::<Vec<_>>(), vec![211]);
    assert_eq!(plan.gpus, vec![1]);
}

#[test]
fn job_of_keeps_one_dead_job_and_nothing_else() {
    let s = snap(
        vec![gpu(
            0,
            12 * GIB,
            &[(201, 4 * GIB), (202, 4 * GIB), (211, 4 * GIB)],
        )],
        vec![
            init(),
            p(201, 1, 200, "python", &[0]),
            p(202, 1, 200, "python", &[0]),
            p(211, 1, 210, "python", &[0]),
        ],
    );
    let opts = |pid| ReclaimOptions {
        job_of: Some(pid),
        ..Default::default()
    };
    let pids =
        |plan: &vramguard_core::plan::Plan| plan.targets().map(|t| t.pid).collect::<Vec<_>>();
    // The selected orphan's whole dead job, and only its memory expected back.
    let plan = plan_of(&s, &opts(202));
    assert_eq!(pids(&plan), vec![201, 202]);
    assert_eq!(plan.expected_free.get(&0), Some(&(8 * GIB)));
    assert!(
        plan.left_alone.is_empty(),
        "other jobs are not listed: {plan:?}"
    );
    assert_eq!(pids(&plan_of(&s, &opts(211))), vec![211]);
    // A pid that holds nothing: nothing.
    assert!(plan_of(&s, &opts(999)).is_empty());
}

/// `--job LABEL` keeps the holders of that job and nothing else: a label that is a prefix of
/// another job's (`slurm:42` of `slurm:421`, `slurm:42.1` of `slurm:42.10`, a pod UID or a
/// container name of a longer one) never reaches the longer one.
#[test]
fn a_job_label_never_matches_another_job_that_shares_its_prefix() {
    let slurm = |pid: u32, cgroup: &str| {
        let mut q = p(pid, 1, pid, "python", &[0]);
        q.cgroup = Some(cgroup.into());
        q
    };
    let pod = |pid: u32, uid: &str| {
        let mut q = p(pid, 1, pid, "python", &[0]);
        q.cgroup = Some(format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{}.slice/cri-containerd-{pid:064}.scope",
            uid.replace('-', "_")
        ));
        q.pod_uid = Some(uid.into());
        q
    };
    let docker = |pid: u32, name: &str| {
        let id = format!("{pid:064}");
        let mut q = p(pid, 1, pid, "python", &[0]);
        q.cgroup = Some(format!("/system.slice/docker-{id}.scope"));
        q.container = Some(ContainerRef {
            runtime: "docker".into(),
            id,
            name: Some(name.into()),
        });
        q
    };
    let v2 = "/system.slice/slurmstepd.scope";
    let holders = vec![
        (201, slurm(201, &format!("{v2}/job_42/step_0/user/task_0"))),
        (202, slurm(202, &format!("{v2}/job_42/step_1/user/task_0"))),
        (203, slurm(203, &format!("{v2}/job_42/step_10/user/task_0"))),
        (204, slurm(204, &format!("{v2}/job_421/step_0/user/task_0"))),
        (205, slurm(205, &format!("{v2}/job_421"))),
        (206, slurm(206, &format!("{v2}/job_4/step_1/user/task_0"))),
        (207, slurm(207, "/slurm/uid_1000/job_4210/step_1/task_0")),
        (301, pod(301, "0b7c9a52-1d7e-4a34-9d6c-4f0a8c2b1e10")),
        (302, pod(302, "0b7c9a52-1d7e-4a34-9d6c-4f0a8c2b1e101")),
        (401, docker(401, "train")),
        (402, docker(402, "train-2")),
        (403, docker(403, "train2")),
    ];
    let listed: Vec<(u32, u64)> = holders.iter().map(|(pid, _)| (*pid, GIB)).collect();
    let mut procs = vec![init()];
    procs.extend(holders.into_iter().map(|(_, q)| q));
    let s = snap(vec![gpu(0, 12 * GIB, &listed)], procs);
    let report = classify(&s, &Policy::default());
    let label_of = |pid: u32| {
        report
            .gpus
            .iter()
            .flat_map(|g| &g.holders)
            .find(|h| h.pid == pid)
            .and_then(|h| h.job.as_ref().map(|j| j.label.clone()))
    };
    // The labels are what `status` shows; the cases below rely on them.
    assert_eq!(label_of(203).as_deref(), Some("slurm:42.10"));
    assert_eq!(label_of(205).as_deref(), Some("slurm:421"));
    assert_eq!(label_of(402).as_deref(), Some("docker:train-2"));
    assert_eq!(
        label_of(302).as_deref(),
        Some("pod:0b7c9a52-1d7e-4a34-9d6c-4f0a8c2b1e101")
    );
    let considered = |label: &str| {
        let plan = plan_reclaim(
            &s,
            &report,
            &ReclaimOptions {
                job_label: Some(label.into()),
                include: Class::ALL.iter().copied().collect(),
                ..Default::default()
            },
        );
        let mut pids: Vec<u32> = plan
            .targets()
            .map(|t| t.pid)
            .chain(plan.left_alone.iter().map(|l| l.pid))
            .collect();
        pids.sort();
        pids.dedup();
        pids
    };
    for (label, pids) in [
        ("slurm:42", vec![201, 202, 203]),
        ("slurm:42.1", vec![202]),
        ("slurm:42.10", vec![203]),
        ("slurm:421", vec![204, 205]),
        ("slurm:421.0", vec![204]),
        ("slurm:4", vec![206]),
        ("slurm:4210", vec![207]),
        ("pod:0b7c9a52-1d7e-4a34-9d6c-4f0a8c2b1e10", vec![301]),
        ("pod:0b7c9a52-1d7e-4a34-9d6c-4f0a8c2b1e101", vec![302]),
        ("docker:train", vec![401]),
        ("docker:train-2", vec![402]),
        ("docker:train2", vec![403]),
    ] {
        assert_eq!(
            considered(label),
            pids,
            "--job {label} considered holders of other jobs (or missed its own); labels: {:?}",
            considered(label)
                .iter()
                .map(|p| (*p, label_of(*p)))
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn hidden_holders_only_when_their_job_is_gone_and_their_memory_is_expected_back() {
    let s = snap(
        vec![gpu(0, 6 * GIB, &[])],
        vec![
            init(),
            cuda(p(601, 1, 600, "pt_data_worker", &[0])),
            cuda(p(700, 1, 700, "python", &[0])),
        ],
    );
    let plan = plan_of(&s, &ReclaimOptions::default());
    assert_eq!(plan.targets().map(|t| t.pid).collect::<Vec<_>>(), vec![601]);
    assert!(
        plan.left_alone
            .iter()
            .any(|l| l.pid == 700 && l.reason.contains("job is alive"))
    );
    // Not every hidden holder is a target: the unaccounted memory is not promised back.
    assert_eq!(plan.expected_free.get(&0), Some(&0));
    let s = snap(
        vec![gpu(0, 6 * GIB, &[])],
        vec![init(), cuda(p(601, 1, 600, "pt_data_worker", &[0]))],
    );
    assert_eq!(
        plan_of(&s, &ReclaimOptions::default())
            .expected_free
            .get(&0),
        Some(&(6 * GIB))
    );
}

/// Reclaim options that ask for everything of the job `label`: the unlisted classes, its
/// keepers, and the job by name.
fn every_class_of_job(label: &str) -> ReclaimOptions {
    let mut opts = ReclaimOptions::default();
    opts.include
        .extend([Class::Hidden, Class::Orphan, Class::Zombie]);
    opts.include_keepers = true;
    opts.job_label = Some(label.into());
    opts
}

/// An unlisted holder without `/dev/nvidia-uvm` has no CUDA context (an NVML client: a
/// monitor, an exporter started with nohup from a shell that has gone): its job gone and
/// idle, it is still never a target, by default, by class, or by its job's name; the same
/// process with `/dev/nvidia-uvm` (an inherited context) is.
#[test]
fn an_nvml_client_whose_launcher_is_gone_is_never_signalled() {
    let monitor = p(601, 1, 600, "gpu_exporter", &[0]);
    let s = snap(vec![gpu(0, 6 * GIB, &[])], vec![init(), monitor.clone()]);
    let by_name = every_class_of_job("pgid:600");
    for opts in [ReclaimOptions::default(), by_name] {
        let plan = plan_of(&s, &opts);
        assert_eq!(plan.targets().count(), 0, "{opts:?}");
        assert!(
            plan.left_alone
                .iter()
                .any(|l| l.pid == 601 && l.reason.contains("no /dev/nvidia-uvm")),
            "{:?}",
            plan.left_alone
        );
    }
    let report = classify(&s, &Policy::default());
    let h = &report.gpus[0].holders[0];
    assert!(!h.action.reclaimable && h.action.command.is_none(), "{h:?}");
    let s = snap(vec![gpu(0, 6 * GIB, &[])], vec![init(), cuda(monitor)]);
    assert_eq!(
        plan_of(&s, &ReclaimOptions::default())
            .targets()
            .map(|t| t.pid)
            .collect::<Vec<_>>(),
        vec![601]
    );
}

/// On driver 580 an NVML client holds `/dev/nvidia-uvm` too (an H200 snapshot shows
/// `vramguard snapshot` holding all three files): what tells it from a CUDA context is the
/// library it maps. An exporter mapping only libnvidia-ml, whose launcher is gone and which
/// does no work, is never a target; neither is a holder whose map could not be read. The same
/// process with the CUDA driver library mapped (a forked worker of a dead trainer), or with
/// neither library (device files inherited across exec), is a target as before.
#[test]
fn an_nvml_client_holding_uvm_on_driver_580_is_never_signalled() {
    let with = |library: Option<DriverLibrary>| {
        let mut monitor = cuda(p(601, 1, 600, "gpu_exporter", &[0]));
        monitor.driver_library = library;
        snap(vec![gpu(0, 6 * GIB, &[])], vec![init(), monitor])
    };
    let by_name = every_class_of_job("pgid:600");
    for (library, why) in [
        (DriverLibrary::NvmlOnly, "an NVML client"),
        (DriverLibrary::Unknown, "could not be read whole"),
    ] {
        let s = with(Some(library));
        for opts in [&ReclaimOptions::default(), &by_name] {
            let plan = plan_of(&s, opts);
            assert_eq!(plan.targets().count(), 0, "{library:?} {opts:?}");
            assert!(
                plan.left_alone
                    .iter()
                    .any(|l| l.pid == 601 && l.reason.contains(why)),
                "{library:?}: {:?}",
                plan.left_alone
            );
        }
        let report = classify(&s, &Policy::default());
        let h = &report.gpus[0].holders[0];
        assert!(!h.action.reclaimable && h.action.command.is_none(), "{h:?}");
        assert!(h.evidence.iter().any(|e| e.contains(why)), "{h:?}");
    }
    // An NVML client holds no memory: the GPU's unexplained memory is not put on it.
    let report = classify(&with(Some(DriverLibrary::NvmlOnly)), &Policy::default());
    let unaccounted = report.gpus[0]
        .unaccounted
        .as_ref()
        .expect("6 GiB unexplained");
    assert!(
        unaccounted
            .explanation
            .iter()
            .any(|l| l.contains("as NVML clients")),
        "{unaccounted:?}"
    );
    for library in [
        None,
        Some(DriverLibrary::Cuda),
        Some(DriverLibrary::Neither),
    ] {
        assert_eq!(
            plan_of(&with(library), &ReclaimOptions::default())
                .targets()
                .map(|t| t.pid)
                .collect::<Vec<_>>(),
            vec![601],
            "{library:?}"
        );
    }
}

/// A listed pid that is now an NVML client (a monitor that took the pid of a trainer whose
/// context its forked worker keeps) is not the holder: the listed process exited and its pid
/// was reused. The monitor is never a target; the worker keeping the context is.
#[test]
fn a_listed_pid_reused_by_an_nvml_client_is_an_exited_pid() {
    let mut monitor = cuda(p(446, 1, 900, "gpu_exporter", &[0]));
    monitor.driver_library = Some(DriverLibrary::NvmlOnly);
    // The trainer was in its launcher's group (440, the launcher gone too): had it led its
    // own group with the worker in it, pid 446 could not have been reused.
    let mut worker = cuda(p(576, 1, 440, "python3", &[0]));
    worker.driver_library = Some(DriverLibrary::Cuda);
    let s = snap(
        vec![gpu(0, 20 * GIB, &[(446, 20 * GIB)])],
        vec![init(), monitor.clone(), worker.clone()],
    );
    let report = classify(&s, &Policy::default());
    let listed = report.gpus[0]
        .holders
        .iter()
        .find(|h| h.pid == 446)
        .unwrap();
    assert_eq!(listed.class, Class::Exited, "{listed:#?}");
    assert!(
        listed.evidence[0].contains("is now gpu_exporter (an NVML client"),
        "{listed:#?}"
    );
    let mut all = every_class_of_job("pgid:446");
    all.include.insert(Class::Idle);
    for opts in [ReclaimOptions::default(), all] {
        let targets: Vec<u32> = plan_of(&s, &opts).targets().map(|t| t.pid).collect();
        assert!(!targets.contains(&446), "{opts:?}: {targets:?}");
    }
    // Review finding: with its group's leader alive (a launcher script, 440), the worker
    // re-parented to init is tied to 446 by nothing but "the only exited pid listed here",
    // and 446 is taken for exited only because of the client's map (which a process
    // chooses): it keeps nothing, and inside its live job it is no default target.
    let launcher = p(440, 1, 440, "bash", &[]);
    let live = snap(
        vec![gpu(0, 20 * GIB, &[(446, 20 * GIB)])],
        vec![init(), launcher, monitor.clone(), worker.clone()],
    );
    let w = classify(&live, &Policy::default()).gpus[0]
        .holders
        .iter()
        .find(|h| h.pid == 576)
        .cloned()
        .unwrap();
    assert_eq!(w.keeps_alive, None, "{w:#?}");
    let targets: Vec<u32> = plan_of(&live, &ReclaimOptions::default())
        .targets()
        .map(|t| t.pid)
        .collect();
    assert!(!targets.contains(&576), "{targets:?} {w:#?}");
    // A worker in the process group 446 leads: pid 446 is still the group's leader, not a
    // reused pid, whatever its map says (a process can map what it likes): it is taken as
    // the listed process, and its worker is no keeper of an "exited" pid.
    worker.pgid = Some(446);
    worker.sid = Some(446);
    let s = snap(
        vec![gpu(0, 20 * GIB, &[(446, 20 * GIB)])],
        vec![init(), monitor, worker],
    );
    let report = classify(&s, &Policy::default());
    let listed = report.gpus[0]
        .holders
        .iter()
        .find(|h| h.pid == 446)
        .unwrap();
    assert_ne!(listed.class, Class::Exited, "{listed:#?}");
    let w = report.gpus[0]
        .holders
        .iter()
        .find(|h| h.pid == 576)
        .unwrap();
    assert_eq!(w.keeps_alive, None, "{w:#?}");
}

#[test]
fn idle_holders_need_an_explicit_include_and_duration() {
    let mut g = gpu(0, GIB, &[(100, GIB)]);
    g.utilization = Some(UtilizationWindow {
        since_ms: 0,
        samples: vec![],
    });
    let s = snap(vec![g], vec![init(), p(100, 50, 100, "python", &[0])]);
    let report = classify(
        &s,
        &Policy {
            idle_after_secs: 60,
            ..Policy::default()
        },
    );
    assert_eq!(report.gpus[0].holders[0].class, Class::Idle);
    let plan = plan_reclaim(&s, &report, &ReclaimOptions::default());
    assert!(plan.is_empty());
    assert!(plan.left_alone[0].reason.contains("--include idle"));
    let mut opts = ReclaimOptions::default();
    opts.include.insert(Class::Idle);
    opts.idle_for_secs = 7200;
    assert!(
        plan_reclaim(&s, &report, &opts).is_empty(),
        "idle 1000s < 2h"
    );
    opts.idle_for_secs = 600;
    assert_eq!(plan_reclaim(&s, &report, &opts).targets().count(), 1);
}

#[test]
fn forbidden_processes_are_left_alone_with_a_reason() {
    let mut kthread = p(2, 0, 0, "kworker", &[0]);
    kthread.flags = Some(PF_KTHREAD);
    let mut container_init = p(500, 1, 499, "python", &[0]);
    container_init.nspid = vec![500, 1];
    let mut no_start = p(510, 1, 509, "python", &[0]);
    no_start.start_ticks = None;
    let me = p(9000, 8999, 498, "vramguard", &[0]);
    let shell = p(8999, 1, 497, "bash", &[0]);
    let mut daemon = p(600, 1, 600, "nvidia-persiste", &[0]);
    daemon.uid = Some(0);
    daemon.exe = Some(ExeFacts {
        path: "/usr/bin/nvidia-persistenced".into(),
        deleted: false,
        owner_uid: 0,
        mode: 0o755,
    });
    let s = snap(
        vec![gpu(
            0,
            10 * GIB,
            &[
                (1, GIB),
                (2, GIB),
                (500, GIB),
                (510, GIB),
                (8999, GIB),
                (600, GIB),
            ],
        )],
        vec![
            p(1, 0, 0, "systemd", &[0]),
            kthread,
            container_init,
            no_start,
            me,
            shell,
            daemon,
        ],
    );
    let opts = ReclaimOptions {
        include: Class::ALL.into_iter().collect(),
        ..Default::default()
    };
    let plan = plan_of(&s, &opts);
    assert!(plan.is_empty(), "{:#?}", plan.jobs);
    let reason = |pid| {
        plan.left_alone
            .iter()
            .find(|l| l.pid == pid)
            .map(|l| l.reason.clone())
            .unwrap_or_default()
    };
    assert!(reason(1).contains("pid 1"), "{}", reason(1));
    assert!(
        reason(2).contains("kernel thread")
            || reason(2).contains("foreign")
            || reason(2).contains("namespace"),
        "{}",
        reason(2)
    );
    assert!(reason(500).contains("PID namespace"), "{}", reason(500));
    assert!(reason(510).contains("start time"), "{}", reason(510));
    assert!(reason(8999).contains("ancestor"), "{}", reason(8999));
    assert!(reason(600).contains("system service"), "{}", reason(600));
}

#[test]
fn an_orphan_inside_a_container_that_is_not_its_init_is_still_a_target() {
    // Only the init of a PID namespace (innermost pid 1) ends the container; a dead job's
    // worker at innermost pid 7 is an orphan like any other.
    let mut worker = p(501, 1, 499, "python", &[0]);
    worker.nspid = vec![501, 7];
    let mut container_init = p(500, 1, 499, "python", &[0]);
    container_init.nspid = vec![500, 1];
    let s = snap(
        vec![gpu(0, 2 * GIB, &[(500, GIB), (501, GIB)])],
        vec![init(), container_init, worker],
    );
    let plan = plan_of(&s, &ReclaimOptions::default());
    let pids: Vec<u32> = plan.targets().map(|t| t.pid).collect();
    assert_eq!(pids, vec![501], "left alone: {:#?}", plan.left_alone);
    let alone = plan.left_alone.iter().find(|l| l.pid == 500).unwrap();
    assert!(alone.reason.contains("PID namespace"), "{}", alone.reason);
}

#[test]
fn a_plan_with_targets_is_not_empty_and_retain_targets_drops_emptied_jobs() {
    // Two dead jobs (leaders 200 and 400), one orphan each.
    let s = snap(
        vec![gpu(0, 8 * GIB, &[(201, 4 * GIB), (401, 4 * GIB)])],
        vec![
            init(),
            p(201, 1, 200, "python", &[0]),
            p(401, 1, 400, "python", &[0]),
        ],
    );
    let report = classify(&s, &Policy::default());
    let mut plan = plan_reclaim(&s, &report, &ReclaimOptions::default());
    assert!(plan.segments.is_empty());
    assert!(!plan.is_empty(), "two targets: {:#?}", plan.jobs);
    let leaders: Vec<Option<u32>> = plan.jobs.iter().map(|j| j.leader_pid).collect();
    assert_eq!(leaders, vec![Some(200), Some(400)]);
    assert_eq!(plan.expected_free.get(&0), Some(&(8 * GIB)));

    // The agent keeps only the targets that stayed eligible: the other job goes with its
    // last target, and the plan is still not empty.
    plan.retain_targets(&report, |t| t.pid == 401);
    let leaders: Vec<Option<u32>> = plan.jobs.iter().map(|j| j.leader_pid).collect();
    assert_eq!(leaders, vec![Some(400)]);
    assert!(!plan.is_empty());
    // What comes back is what the remaining target holds (red-team finding: the dropped
    // target's bytes were still expected, so the release wait ran its whole timeout).
    assert_eq!(plan.expected_free.get(&0), Some(&(4 * GIB)));

    plan.retain_targets(&report, |_| false);
    assert!(plan.jobs.is_empty(), "{:#?}", plan.jobs);
    assert!(plan.is_empty());
}

/// Orphans of uid 1000 (pid 201) and uid 1001 (pid 202) on GPU 0, seen by uid 1000.
fn orphans_of_two_users_seen_by_uid_1000() -> Snapshot {
    let mut mine = p(201, 1, 200, "python", &[0]);
    mine.uid = Some(1000);
    let mut theirs = p(202, 1, 200, "python", &[0]);
    theirs.uid = Some(1001);
    let mut s = snap(
        vec![gpu(0, 8 * GIB, &[(201, 4 * GIB), (202, 4 * GIB)])],
        vec![init(), mine, theirs],
    );
    s.host.euid = 1000;
    s
}

#[test]
fn without_root_other_users_processes_are_left_alone() {
    let mut s = orphans_of_two_users_seen_by_uid_1000();
    let plan = plan_of(&s, &ReclaimOptions::default());
    assert_eq!(plan.targets().map(|t| t.pid).collect::<Vec<_>>(), vec![201]);
    assert!(plan.left_alone[0].reason.contains("only root"));
    // The reading capabilities do not give the right to signal.
    s.host.cap_effective =
        Some(1 << Privileges::CAP_SYS_PTRACE | 1 << Privileges::CAP_DAC_READ_SEARCH);
    let plan = plan_of(&s, &ReclaimOptions::default());
    assert_eq!(plan.targets().map(|t| t.pid).collect::<Vec<_>>(), vec![201]);
}

#[test]
fn a_user_with_cap_kill_may_reclaim_other_users_orphans() {
    let mut s = orphans_of_two_users_seen_by_uid_1000();
    s.host.cap_effective = Some(1 << Privileges::CAP_KILL);
    let plan = plan_of(&s, &ReclaimOptions::default());
    assert_eq!(
        plan.targets().map(|t| t.pid).collect::<Vec<_>>(),
        vec![201, 202]
    );
}

/// A holder whose threads were mostly in uninterruptible sleep (D) through the window may be
/// writing a checkpoint to a slow filesystem, or be stuck in the driver: its work is unknown.
/// No target, and its memory still counts as a dead job's (not a working job's).
#[test]
fn a_holder_mostly_in_d_state_is_no_target_and_its_memory_still_counts() {
    let mut s = snap(
        vec![gpu(0, 2 * GIB, &[(500, 2 * GIB)])],
        vec![init(), p(500, 1, 499, "python", &[0])],
    );
    assert_eq!(plan_of(&s, &ReclaimOptions::default()).targets().count(), 1);
    for w in &mut s.work.as_mut().unwrap().processes {
        if w.pid == 500 {
            w.waiting_observations = w.observations;
        }
    }
    assert_eq!(plan_of(&s, &ReclaimOptions::default()).targets().count(), 0);
    let report = classify(&s, &Policy::default());
    let h = holder_on_gpu0(&report, 500);
    assert!(
        matches!(&h.work, vramguard_core::report::Work::Unknown { why } if why.contains("uninterruptible sleep (D)")),
        "{h:#?}"
    );
    assert!(h.is_ghost(), "{h:#?}");
    assert_eq!(report.gpus[0].ghost_bytes, 2 * GIB);
}

/// A holder whose descendants the collection could not all read (too many, or a process with
/// too many threads) is not known to be idle: any of them may be working. Its work is
/// unknown, and it is no target (review finding: the walk's budget was shared by all roots and
/// a cut walk left no sign).
#[test]
fn a_holder_whose_descendants_were_not_all_read_is_no_target() {
    let mut s = snap(
        vec![gpu(0, 2 * GIB, &[(500, 2 * GIB)])],
        vec![init(), p(500, 1, 499, "python", &[0])],
    );
    let targets = |s: &Snapshot| {
        plan_of(s, &ReclaimOptions::default())
            .targets()
            .map(|t| t.pid)
            .collect::<Vec<_>>()
    };
    assert_eq!(targets(&s), vec![500], "an idle orphan of a dead job");
    s.scan.descendants_unread = vec![500];
    assert!(targets(&s).is_empty());
    let report = classify(&s, &Policy::default());
    let h = holder_on_gpu0(&report, 500);
    assert!(
        matches!(&h.work, vramguard_core::report::Work::Unknown { why } if why.contains("descendants could not all be read")),
        "{h:#?}"
    );
}

#[test]
fn zombies_with_running_threads_are_targets_only_when_included_and_stuck_ones_never() {
    // Left behind by a job that is gone (its group's leader, 399, exited).
    let mut running = p(400, 1, 399, "python", &[0]);
    running.state = Some('Z');
    running.threads = Some(vec![ThreadFacts {
        tid: 401,
        state: 'S',
        wchan: None,
        leaving: None,
    }]);
    let mut stuck = p(410, 1, 410, "python", &[0]);
    stuck.state = Some('Z');
    stuck.threads = Some(vec![ThreadFacts {
        tid: 411,
        state: 'D',
        wchan: Some("fuse_wait_answer".into()),
        leaving: None,
    }]);
    let s = snap(
        vec![gpu(0, 2 * GIB, &[(400, GIB), (410, GIB)])],
        vec![init(), running, stuck],
    );
    assert!(plan_of(&s, &ReclaimOptions::default()).is_empty());
    let mut opts = ReclaimOptions::default();
    opts.include.insert(Class::Zombie);
    let plan = plan_of(&s, &opts);
    assert_eq!(plan.targets().map(|t| t.pid).collect::<Vec<_>>(), vec![400]);
    assert!(
        plan.left_alone
            .iter()
            .any(|l| l.pid == 410 && l.reason.contains("uninterruptible"))
    );
}

/// A server (200, its own group, started by bash 100) whose main thread called
/// `pthread_exit` while thread 201 works on: the kernel shows its leader `Z` with
/// `PF_EXITING` (`stat` flags 0x40800c), the working thread without either.
fn main_thread_exited(working: bool, leaving: bool) -> Snapshot {
    let mut server = p(200, 100, 200, "server", &[0]);
    server.state = Some('Z');
    server.flags = Some(0x0040_800c);
    server.threads = Some(vec![
        ThreadFacts {
            tid: 200,
            state: 'Z',
            wchan: None,
            leaving: Some(true),
        },
        ThreadFacts {
            tid: 201,
            state: 'R',
            wchan: None,
            leaving: Some(leaving),
        },
    ]);
    let mut s = snap(
        vec![gpu(0, 9 * GIB, &[(200, 8 * GIB), (300, GIB)])],
        vec![
            init(),
            p(100, 1, 100, "bash", &[]),
            server,
            // Its worker, idle: its parent shows `Z`, but the process lives.
            p(300, 200, 200, "worker", &[0]),
        ],
    );
    if working {
        for w in &mut s.work.as_mut().unwrap().processes {
            if w.pid == 200 {
                w.cpu_ticks = 150;
            }
        }
    }
    s
}

fn holder_on_gpu0(report: &vramguard_core::Report, pid: u32) -> &vramguard_core::report::Holder {
    report.gpus[0]
        .holders
        .iter()
        .find(|h| h.pid == pid)
        .unwrap()
}

#[test]
fn a_process_whose_main_thread_exited_while_another_works_is_never_a_target() {
    let s = main_thread_exited(true, false);
    let report = classify(&s, &Policy::default());
    let server = holder_on_gpu0(&report, 200);
    // Its job lives (bash 100 started it): a live process, whatever its main thread did.
    assert_ne!(server.class, Class::Zombie, "{server:#?}");
    assert!(!server.action.reclaimable, "{server:#?}");
    assert!(
        server
            .action
            .command
            .as_deref()
            .is_none_or(|c| !c.contains("kill")),
        "{server:#?}"
    );
    let mut opts = ReclaimOptions::default();
    opts.include.insert(Class::Zombie);
    assert!(
        plan_of(&s, &opts).targets().all(|t| t.pid != 200),
        "a working process was planned"
    );
    // A group exit sets SIGKILL on every thread: then the whole process is on its way out,
    // and SIGKILL finishes it whatever its threads were doing.
    let s = main_thread_exited(true, true);
    let plan = plan_of(&s, &opts);
    assert!(plan.targets().any(|t| t.pid == 200));
}

#[test]
fn the_children_of_a_process_whose_main_thread_exited_are_in_its_live_job() {
    let s = main_thread_exited(false, false);
    let report = classify(&s, &Policy::default());
    let worker = holder_on_gpu0(&report, 300);
    assert!(worker.dead_job.is_none(), "{worker:#?}");
    assert!(
        !matches!(worker.class, Class::Orphan | Class::Detached),
        "{worker:#?}"
    );
    assert!(plan_of(&s, &ReclaimOptions::default()).is_empty());
    // Once every thread of the server has finished, the worker is an orphan of a dead job.
    let mut s = s;
    for q in &mut s.processes {
        if q.pid == 200 {
            q.threads = Some(vec![]);
        }
    }
    let report = classify(&s, &Policy::default());
    let worker = holder_on_gpu0(&report, 300);
    assert_eq!(worker.class, Class::Orphan, "{worker:#?}");
}

// ---- jobs under a live supervisor (issue 26) ----

/// `vramguard run` (44, in `/s`) runs `bash job.sh` (45); its helper (group 46, gone) started
/// an idle holder (47) that was re-parented to the supervisor. `cgroup`: the job's processes
/// are in `/s/vramguard-run-44`.
fn supervised(cgroup: bool, supervisor_lives: bool) -> Snapshot {
    let job_cg = if cgroup { "/s/vramguard-run-44" } else { "/s" };
    let mut sup = p(44, 30, 44, "vramguard", &[]);
    sup.cmdline = Some(
        ["vramguard", "run", "--", "bash", "job.sh"]
            .map(String::from)
            .to_vec(),
    );
    sup.cgroup = Some("/s".into());
    let mut main = p(45, 44, 45, "bash", &[]);
    main.cgroup = Some(job_cg.into());
    let mut holder = p(47, 44, 46, "python3", &[0]);
    holder.cgroup = Some(job_cg.into());
    let mut procs = vec![init(), p(30, 1, 30, "bash", &[]), holder];
    if supervisor_lives {
        procs.extend([sup, main]);
    } else {
        procs[2].ppid = Some(1);
    }
    snap(vec![gpu(0, 6 * GIB, &[(47, 6 * GIB)])], procs)
}

#[test]
fn a_holder_of_a_live_supervised_job_is_never_planned() {
    for cgroup in [false, true] {
        let s = supervised(cgroup, true);
        for opts in [
            ReclaimOptions::default(),
            // `top`'s `r` on the holder: its one job.
            ReclaimOptions {
                job_of: Some(47),
                ..ReclaimOptions::default()
            },
            ReclaimOptions {
                include: [Class::Orphan, Class::Hidden, Class::Detached, Class::Zombie]
                    .into_iter()
                    .collect(),
                ..ReclaimOptions::default()
            },
        ] {
            let plan = plan_of(&s, &opts);
            assert_eq!(plan.targets().count(), 0, "cgroup {cgroup}: {plan:#?}");
        }
        let plan = plan_of(&s, &ReclaimOptions::default());
        let alone = plan.left_alone.iter().find(|l| l.pid == 47).unwrap();
        assert_eq!(alone.class, Class::Active);
        assert!(
            alone.reason.starts_with("its job is alive: ") && alone.reason.contains(" 44"),
            "{}",
            alone.reason
        );

        // The supervisor gone (SIGKILLed, its watchdog too): the escaped idle holder is an
        // orphan again, and planned.
        let plan = plan_of(&supervised(cgroup, false), &ReclaimOptions::default());
        let pids: Vec<u32> = plan.targets().map(|t| t.pid).collect();
        assert_eq!(pids, vec![47], "cgroup {cgroup}: {plan:#?}");
    }
}

/// `srun vramguard run --isolation group -- python train.py` in a live Slurm step: the
/// trainer (pid 60) was SIGKILLed and is still listed by the driver, its forked worker keeps
/// its context. The job view is the Slurm step, but the live supervisor above the worker runs
/// its job: not a target, not even asked for by name with `--include keepers --job`.
#[test]
fn a_keeper_under_a_live_vramguard_run_inside_a_slurm_step_is_never_planned() {
    let step = "/system.slice/slurmstepd.scope/job_42/step_0/user/task_0";
    let in_step = |mut q: ProcessFacts| {
        q.cgroup = Some(step.into());
        q
    };
    let mut sup = in_step(p(50, 1, 50, "vramguard", &[]));
    sup.cmdline = Some(
        [
            "vramguard",
            "run",
            "--isolation",
            "group",
            "--",
            "python",
            "train.py",
        ]
        .map(String::from)
        .to_vec(),
    );
    // A CUDA context's files: the GPU's and nvidia-uvm.
    let context = |mut q: ProcessFacts| {
        q.device_files =
            FdScan::Scanned(vec![DeviceFile::Ctl, DeviceFile::Uvm, DeviceFile::Gpu(0)]);
        q
    };
    let worker = context(in_step(p(61, 50, 60, "pt_data_worker", &[0])));
    let s = snap(
        vec![gpu(0, 20 * GIB, &[(60, 20 * GIB)])],
        vec![init(), sup, worker],
    );
    let report = classify(&s, &Policy::default());
    let h = report.gpus[0].holders.iter().find(|h| h.pid == 61).unwrap();
    assert_eq!(
        (h.class, h.keeps_alive),
        (Class::Hidden, Some(60)),
        "{h:#?}"
    );
    // The report offers no command the planner would refuse (it offered `--job slurm:42.0
    // --include keepers`), and no bytes back.
    assert_eq!(
        (h.action.command.as_deref(), h.action.reclaimable),
        (None, false),
        "{h:#?}"
    );
    assert!(
        h.action
            .summary
            .contains("50 (vramguard) is a live job supervisor"),
        "{}",
        h.action.summary
    );
    assert_eq!(report.gpus[0].reclaimable_bytes, 0, "{:#?}", report.gpus[0]);
    for opts in [
        ReclaimOptions {
            include_keepers: true,
            ..ReclaimOptions::default()
        },
        ReclaimOptions {
            include_keepers: true,
            job_label: Some("slurm:42.0".into()),
            ..ReclaimOptions::default()
        },
    ] {
        let plan = plan_reclaim(&s, &report, &opts);
        assert_eq!(plan.targets().count(), 0, "{plan:#?}");
        let alone = plan.left_alone.iter().find(|l| l.pid == 61).unwrap();
        assert!(
            alone
                .reason
                .contains("50 (vramguard) is a live job supervisor"),
            "{}",
            alone.reason
        );
    }
    // The supervisor gone: the same keeper is planned when asked for by name.
    let s = snap(
        vec![gpu(0, 20 * GIB, &[(60, 20 * GIB)])],
        vec![
            init(),
            context(in_step(p(61, 1, 60, "pt_data_worker", &[0]))),
        ],
    );
    let plan = plan_of(
        &s,
        &ReclaimOptions {
            include_keepers: true,
            ..ReclaimOptions::default()
        },
    );
    assert_eq!(
        plan.targets().map(|t| t.pid).collect::<Vec<_>>(),
        [61],
        "{plan:#?}"
    );
}

// ---- property test ----

const COMMS: &[&str] = &[
    "python",
    "pt_data_worker",
    "nvidia-persiste",
    "Xorg",
    "bash",
    "vllm",
    "kworker",
];

/// Slurm cgroups whose labels share prefixes (`slurm:42` and `slurm:421`, `slurm:42.1` and
/// `slurm:42.10`), for the `--job` property.
const SLURM_CGROUPS: &[&str] = &[
    "/system.slice/slurmstepd.scope/job_42/step_0/user/task_0",
    "/system.slice/slurmstepd.scope/job_42/step_1/user/task_0",
    "/system.slice/slurmstepd.scope/job_42/step_10/user/task_0",
    "/slurm/uid_1000/job_42/step_batch/task_0",
    "/system.slice/slurmstepd.scope/job_421/step_0/user/task_0",
    "/system.slice/slurmstepd.scope/job_421",
    "/system.slice/slurmstepd.scope/job_4/step_1/user/task_0",
    // Named like a Slurm step, in a subtree delegated to a user: Slurm's only if root made it.
    "/user.slice/user-1000.slice/user@1000.service/slurm/uid_0/job_42/step_0",
];

/// [`arb_plain_process`], sometimes a job supervisor or another adopter (by name and command
/// line), in a cgroup of a few shapes, `vramguard run` leaves naming random pids among them.
fn arb_process() -> impl Strategy<Value = ProcessFacts> {
    (
        arb_plain_process(),
        prop::option::weighted(
            0.3,
            prop::sample::select(vec![
                "vramguard",
                "tini",
                "dumb-init",
                "docker-init",
                "systemd",
            ]),
        ),
        prop::sample::select(vec![0u8, 1, 2]),
        prop::sample::select(vec![0u8, 1, 2, 3, 4, 5, 6]),
        1u32..40,
    )
        .prop_map(|(mut p, comm, cmdline, cgroup, run_pid)| {
            if let Some(c) = comm {
                p.comm = Some(c.into());
            }
            let comm = p.comm.clone().unwrap_or_default();
            p.cmdline = match cmdline {
                0 => None,
                1 => Some(vec![comm, "run".into(), "--".into(), "python3".into()]),
                _ => Some(vec![comm, "agent".into()]),
            };
            p.cgroup = match cgroup {
                0 => None,
                1 => Some("/s".into()),
                2 => Some(format!("/s/vramguard-run-{run_pid}")),
                3 => Some(format!("/s/vramguard-run-{run_pid}/w")),
                4 => Some(format!("/vramguard-run-{run_pid}")),
                5 => Some("/t".into()),
                _ => Some(SLURM_CGROUPS[run_pid as usize % SLURM_CGROUPS.len()].into()),
            };
            p
        })
}

/// Whether `p` belongs to a job under a live supervisor, by the rule as the README states it
/// (written apart from classify): in a `vramguard run` cgroup whose supervisor — that pid (or
/// innermost NSpid), alive, not vramguard itself, in the cgroup the leaf was made in (or
/// unreadable, or any for a leaf at the root), started no later than `p` or calling itself
/// `vramguard run` — lives; or in a tree, followed up through live parents that are no
/// adopters, that reaches a live `vramguard run`, tini, dumb-init or docker-init.
fn under_live_supervisor(s: &Snapshot, policy: &Policy, p: &ProcessFacts) -> bool {
    let live = |q: &ProcessFacts| q.state != Some('Z') && !q.is_kernel_thread();
    let calls_itself_run = |q: &ProcessFacts| {
        q.comm.as_deref() == Some("vramguard")
            && q.cmdline.as_ref().is_none_or(|a| {
                a.is_empty() || a[1..].iter().take_while(|x| *x != "--").any(|x| x == "run")
            })
    };
    if let Some(cg) = &p.cgroup {
        let segs: Vec<&str> = cg.split('/').filter(|x| !x.is_empty()).collect();
        for (i, seg) in segs.iter().enumerate() {
            let Some(n) = seg
                .strip_prefix("vramguard-run-")
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let parent = format!("/{}", segs[..i].join("/"));
            let supervises = |q: &ProcessFacts| {
                (q.pid == n || (q.nspid.len() > 1 && q.nspid.last() == Some(&n)))
                    && live(q)
                    && q.pid != s.host.self_pid
                    && (parent == "/" || q.cgroup.as_deref().is_none_or(|c| c == parent))
                    && (q.start_ticks.zip(p.start_ticks).is_none_or(|(a, b)| a <= b)
                        || calls_itself_run(q))
            };
            if s.processes.iter().any(supervises) {
                return true;
            }
        }
    }
    // vramguard itself (`run` asking about its own, ended job) keeps nothing.
    let supervisor = |q: &ProcessFacts| {
        let comm = q.comm.as_deref().unwrap_or("");
        if q.pid == s.host.self_pid {
            return false;
        }
        ["tini", "dumb-init", "docker-init"]
            .iter()
            .any(|n| comm == *n || comm.starts_with(&format!("{n}-")))
            || calls_itself_run(q)
    };
    let mut q = p;
    for _ in 0..64 {
        let Some(parent) = q.ppid.filter(|pp| *pp > 0).and_then(|pp| s.process(pp)) else {
            return false;
        };
        if !live(parent) {
            return false;
        }
        if supervisor(parent) {
            return true;
        }
        if parent.pid == 1 || policy.is_subreaper_comm(parent.comm.as_deref().unwrap_or("")) {
            return false;
        }
        q = parent;
    }
    false
}

fn arb_plain_process() -> impl Strategy<Value = ProcessFacts> {
    (
        1u32..40,
        0u32..40,
        0u32..40,
        prop::sample::select(vec!['S', 'R', 'D', 'Z']),
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec![0u32, 1000, 1001]),
        prop::sample::select(COMMS.to_vec()),
        prop::collection::vec(0u32..3, 0..3),
        prop::option::of(1u64..1_000_000),
        prop::sample::select(vec![0u32, 1, 2, 7]),
        prop::option::of(prop::collection::vec(
            (
                prop::sample::select(vec!['S', 'D', 'Z']),
                // On its way out (PF_EXITING or SIGKILL pending), running on, or unread.
                prop::option::of(any::<bool>()),
            ),
            0..3,
        )),
    )
        .prop_map(
            |(pid, ppid, pgid, state, kthread, exiting, uid, comm, gpus, start, inner, threads)| {
                let mut files: Vec<DeviceFile> = gpus.into_iter().map(DeviceFile::Gpu).collect();
                files.push(DeviceFile::Ctl);
                // A CUDA context (inherited or its own) comes with /dev/nvidia-uvm: a keeper
                // of an exited pid's context needs it.
                if start.is_some_and(|s| s % 3 != 0) {
                    files.push(DeviceFile::Uvm);
                }
                files.sort();
                files.dedup();
                let mut flags = 0;
                if kthread {
                    flags |= PF_KTHREAD;
                }
                if exiting {
                    flags |= PF_EXITING;
                }
                ProcessFacts {
                    pid,
                    ppid: Some(ppid),
                    pgid: Some(pgid),
                    // Mostly the group's session; sometimes one the process leads.
                    sid: Some(if ppid % 5 == 0 { pid } else { pgid }),
                    state: Some(state),
                    flags: Some(flags),
                    start_ticks: start,
                    uid: Some(uid),
                    comm: Some(comm.into()),
                    nspid: if inner == 0 {
                        vec![pid]
                    } else {
                        vec![pid, inner]
                    },
                    threads: threads.map(|ts| {
                        ts.into_iter()
                            .enumerate()
                            .map(|(i, (st, leaving))| ThreadFacts {
                                tid: pid * 100 + i as u32,
                                state: st,
                                wchan: None,
                                leaving,
                            })
                            .collect()
                    }),
                    device_files: FdScan::Scanned(files),
                    // The library its map shows (independent of uvm, decided by `start % 3`):
                    // not read, the CUDA driver library, NVML only (a driver-580 monitor),
                    // neither, or an unreadable map.
                    driver_library: start.and_then(|s| match s / 3 % 5 {
                        0 => None,
                        1 => Some(DriverLibrary::Cuda),
                        2 => Some(DriverLibrary::NvmlOnly),
                        3 => Some(DriverLibrary::Neither),
                        _ => Some(DriverLibrary::Unknown),
                    }),
                    ..Default::default()
                }
            },
        )
}

fn arb_snapshot() -> impl Strategy<Value = (Snapshot, ReclaimOptions)> {
    (
        prop::collection::vec(arb_process(), 0..30),
        prop::collection::vec((0u32..3, 0u32..45, 0u64..8), 0..20),
        prop::collection::vec(0u64..100, 3),
        1u32..40,
        prop::collection::vec(1u32..40, 0..3),
        // (euid, effective capabilities): root, a user, a user with CAP_KILL, with the
        // reading capabilities, with all three.
        (
            prop::sample::select(vec![0u32, 1000]),
            prop::sample::select(vec![
                None,
                Some(0u64),
                Some(1 << Privileges::CAP_KILL),
                Some(1 << Privileges::CAP_SYS_PTRACE | 1 << Privileges::CAP_DAC_READ_SEARCH),
                Some(
                    1 << Privileges::CAP_KILL
                        | 1 << Privileges::CAP_SYS_PTRACE
                        | 1 << Privileges::CAP_DAC_READ_SEARCH,
                ),
            ]),
        ),
        any::<Option<bool>>(),
        prop::collection::btree_set(prop::sample::select(Class::ALL.to_vec()), 0..7),
        prop::option::of(prop::collection::btree_set(0u32..3, 0..3)),
        0u64..3000,
        // CPU history per pid: ticks used over the 2 s window and run-state observations.
        prop::collection::vec((1u32..40, 0u64..30, 0u32..=5), 0..20),
        (
            // GPU utilization samples: GPU, pid, SM %, how long ago (ms).
            prop::collection::vec((0u32..3, 1u32..45, 0u32..100, 0u64..30_000), 0..15),
            // Per Slurm job cgroup: whether a slurmstepd lives in it, and who owns it
            // (root, a user, not recorded).
            prop::collection::vec(
                (
                    any::<bool>(),
                    prop::sample::select(vec![Some(0u32), Some(1000), None]),
                ),
                SLURM_CGROUPS.len(),
            ),
        ),
    )
        .prop_map(
            |(
                procs,
                listed,
                used,
                self_pid,
                ancestors,
                euid,
                host_ns,
                include,
                gpus,
                idle_for,
                cpu,
                (util, slurm_facts),
            )| {
                let mut s = snap(vec![], procs);
                // The Slurm jobs' cgroups as the collector reads them: readable and whole,
                // with or without a step daemon, owned by root or not.
                let mut roots: Vec<String> = s
                    .processes
                    .iter()
                    .filter_map(vramguard_core::job::cgroup_job)
                    .filter(|j| j.kind == vramguard_core::job::JobKind::Slurm)
                    .map(|j| j.root)
                    .collect();
                roots.sort();
                roots.dedup();
                s.job_cgroups = roots
                    .into_iter()
                    .zip(slurm_facts)
                    .map(|(root, (stepd, owner_uid))| JobCgroupFacts {
                        root,
                        readable: true,
                        members: 2,
                        namespace_inits: vec![],
                        step_daemons: if stepd { vec![1] } else { vec![] },
                        nested_pid_namespace: false,
                        complete: true,
                        owner_uid,
                    })
                    .collect();
                if let Some(w) = s.work.as_mut() {
                    for (pid, ticks, running) in cpu {
                        if let Some(sample) = w.processes.iter_mut().find(|p| p.pid == pid) {
                            sample.cpu_ticks = ticks;
                            sample.running_observations = running;
                            // Some in uninterruptible sleep through the window.
                            sample.waiting_observations = if ticks % 5 == 0 { 5 } else { 0 };
                        }
                    }
                }
                s.gpus = (0..3u32)
                    .map(|i| {
                        let l: Vec<(u32, u64)> = listed
                            .iter()
                            .filter(|(g, _, _)| *g == i)
                            .map(|(_, pid, b)| (*pid, *b * GIB))
                            .collect();
                        let mut g = gpu(i, used[i as usize] * GIB, &l);
                        g.utilization = Some(UtilizationWindow {
                            since_ms: 0,
                            samples: util
                                .iter()
                                .filter(|(gpu, ..)| *gpu == i)
                                .map(|(_, pid, sm, ago)| UtilizationSample {
                                    pid: *pid,
                                    sm_percent: *sm,
                                    mem_percent: 0,
                                    last_seen_ms: 1_000_000 - ago,
                                    // As the GPU reader records it: at the policy's
                                    // threshold, not for the 1 % of an idle context.
                                    last_busy_ms: (*sm >= DEFAULT_GPU_WORK_MIN_PERCENT)
                                        .then_some(1_000_000 - ago),
                                })
                                .collect(),
                        });
                        // About one GPU in ten whose compute list failed: who computes there,
                        // and how much, is unknown.
                        // And one in ten whose list was unreliable (records dropped): a
                        // process computing there may be unlisted.
                        if used[i as usize] % 10 == 8 {
                            g.process_list = ProcessListState::Unreliable {
                                reason: "implausible records dropped".into(),
                            };
                        }
                        if used[i as usize] % 10 == 9 {
                            g.processes.clear();
                            g.utilization = None;
                            g.process_list = ProcessListState::Unavailable {
                                error: CallError {
                                    call: "nvmlDeviceGetComputeRunningProcesses_v3".into(),
                                    code: Some(999),
                                    message: "Unknown Error".into(),
                                },
                            };
                        }
                        g
                    })
                    .collect();
                s.host.self_pid = self_pid;
                // Some processes whose descendants the collection could not all read.
                s.scan.descendants_unread = ancestors
                    .iter()
                    .map(|a| a + 1)
                    .filter(|p| p % 3 == 0)
                    .collect();
                s.host.self_ancestors = ancestors;
                (s.host.euid, s.host.cap_effective) = euid;
                s.host.pid_namespace_is_host = host_ns;
                (
                    s,
                    ReclaimOptions {
                        gpus,
                        include,
                        idle_for_secs: idle_for,
                        mig_devices: None,
                        job_of: None,
                        job_label: None,
                        include_shm: None,
                        include_keepers: idle_for % 2 == 0,
                    },
                )
            },
        )
}

/// Whether `label` is of the job `want` names, by its parts: the same kind and id, and the
/// same Slurm step when `want` names one (`slurm:42` is every step of job 42).
fn same_job(want: &str, label: &str) -> bool {
    match (want.strip_prefix("slurm:"), label.strip_prefix("slurm:")) {
        (Some(w), Some(l)) => {
            let (l_job, l_step) = l.split_once('.').map_or((l, None), |(j, s)| (j, Some(s)));
            match w.split_once('.') {
                Some((w_job, w_step)) => w_job == l_job && Some(w_step) == l_step,
                None => w == l_job,
            }
        }
        _ => want == label,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]
    #[test]
    fn narrowing_to_one_job_only_removes_targets((s, opts) in arb_snapshot(), pick in 0usize..64) {
        let policy = Policy { idle_after_secs: 60, ..Policy::default() };
        let report = classify(&s, &policy);
        let all: BTreeSet<u32> = plan_reclaim(&s, &report, &opts).targets().map(|t| t.pid).collect();
        let holders: Vec<&vramguard_core::report::Holder> =
            report.gpus.iter().flat_map(|g| &g.holders).collect();
        if let Some(chosen) = holders.get(pick % holders.len().max(1)) {
            // A pid's dead job is the one any of its entries (one per GPU) names: a pid can
            // be foreign on one GPU and hidden on another.
            let leader = holders
                .iter()
                .filter(|h| h.pid == chosen.pid)
                .find_map(|h| h.dead_job.as_ref().map(|j| j.leader_pid));
            let narrowed = plan_reclaim(
                &s,
                &report,
                &ReclaimOptions { job_of: Some(chosen.pid), ..opts.clone() },
            );
            for t in narrowed.targets() {
                prop_assert!(all.contains(&t.pid), "narrowing added {}", t.pid);
                let same_job = holders.iter().any(|h| {
                    h.pid == t.pid
                        && leader.is_some()
                        && h.dead_job.as_ref().map(|j| j.leader_pid) == leader
                });
                prop_assert!(t.pid == chosen.pid || same_job, "{} is not in {}'s job", t.pid, chosen.pid);
            }
        }
    }

    #[test]
    fn narrowing_to_a_job_label_only_removes_targets_and_never_reaches_another_job(
        (s, opts) in arb_snapshot(),
        pick in 0usize..64,
        whole_job in any::<bool>(),
    ) {
        let policy = Policy { idle_after_secs: 60, ..Policy::default() };
        let report = classify(&s, &policy);
        let all: BTreeSet<u32> = plan_reclaim(&s, &report, &opts).targets().map(|t| t.pid).collect();
        let labels: Vec<String> = report
            .gpus
            .iter()
            .flat_map(|g| &g.holders)
            .filter_map(|h| h.job.as_ref().map(|j| j.label.clone()))
            .collect();
        // A holder's label, and (for a Slurm step) its whole job's: `slurm:42.1` and `slurm:42`.
        let picked = labels.get(pick % labels.len().max(1)).map(|label| {
            match label.split_once('.').filter(|_| whole_job && label.starts_with("slurm:")) {
                Some((job, _)) => job.to_string(),
                None => label.clone(),
            }
        });
        if let Some(label) = picked.as_ref() {
            let narrowed = plan_reclaim(
                &s,
                &report,
                &ReclaimOptions { job_label: Some(label.clone()), ..opts.clone() },
            );
            let of_the_job = |pid: u32| {
                report.gpus.iter().flat_map(|g| &g.holders).any(|h| {
                    h.pid == pid && h.job.as_ref().is_some_and(|j| same_job(label, &j.label))
                })
            };
            for t in narrowed.targets() {
                prop_assert!(all.contains(&t.pid), "narrowing added {}", t.pid);
                let h = report.gpus.iter().flat_map(|g| &g.holders).find(|h| h.pid == t.pid).unwrap();
                prop_assert!(
                    of_the_job(t.pid),
                    "--job {} targeted {} of job {:?}", label, t.pid, h.job.as_ref().map(|j| &j.label)
                );
            }
            for l in &narrowed.left_alone {
                prop_assert!(of_the_job(l.pid), "{} is not of {}", l.pid, label);
            }
        }
    }

    #[test]
    fn the_planner_never_selects_a_forbidden_process((s, opts) in arb_snapshot()) {
        let policy = Policy { idle_after_secs: 60, ..Policy::default() };
        let report = classify(&s, &policy);
        let plan = plan_reclaim(&s, &report, &opts);
        let forbidden: BTreeSet<Class> =
            [Class::Active, Class::System, Class::Foreign, Class::Exited].into_iter().collect();
        for t in plan.targets() {
            prop_assert!(t.pid > 1, "pid {}", t.pid);
            prop_assert!(t.pid != s.host.self_pid);
            prop_assert!(!s.host.self_ancestors.contains(&t.pid));
            let proc_ = s.process(t.pid);
            prop_assert!(proc_.is_some(), "target {} is not a process here", t.pid);
            let proc_ = proc_.unwrap();
            prop_assert!(!proc_.is_kernel_thread());
            prop_assert!(!(proc_.nspid.len() > 1 && proc_.nspid.last() == Some(&1)));
            prop_assert!(!matches!(
                policy.system_identity(proc_, s.host.privileges().sees_every_process()),
                Some(Ok(()))
            ));
            // No process with work evidence in the window, nor the parent of one, is a target
            // unless `detached` was asked for by name (or the whole process is already exiting:
            // its main thread in do_exit and every other live thread on its way out; a main
            // thread alone in do_exit, after pthread_exit, leaves a process that may work).
            let exiting = proc_.flags.is_some_and(|f| f & PF_EXITING != 0)
                && proc_.threads.iter().flatten().all(|t| {
                    t.tid == proc_.pid || matches!(t.state, 'Z' | 'X') || t.leaving == Some(true)
                });
            if t.class != Class::Detached && !exiting {
                let cpu_busy = |pid: u32| {
                    s.work_of(pid, s.process(pid).and_then(|p| p.start_ticks))
                        .is_some_and(|w| w.cpu_ticks >= 10 || w.running_observations >= 3)
                };
                let gpu_busy = |pid: u32| {
                    report.gpus.iter().any(|g| {
                        g.holders.iter().any(|h| h.pid == pid && h.listed && h.reported_pid.is_none())
                            && s.gpus[g.index as usize].utilization.as_ref().is_some_and(|u| {
                                u.samples.iter().any(|x| {
                                    // Work as the policy counts it: the real driver
                                    // reports 1 % for an idle context.
                                    x.pid == pid
                                        && Policy::default().is_gpu_work(x)
                                        && 1_000_000 - x.last_seen_ms <= 10_000
                                })
                            })
                    })
                };
                prop_assert!(!cpu_busy(t.pid), "target {} used CPU in the window", t.pid);
                prop_assert!(
                    s.work_of(t.pid, proc_.start_ticks)
                        .is_none_or(|w| w.waiting_observations * 2 <= w.observations),
                    "target {} was mostly in uninterruptible sleep", t.pid
                );
                prop_assert!(
                    !s.scan.descendants_unread.contains(&t.pid),
                    "target {} has descendants that were not all read", t.pid
                );
                prop_assert!(!gpu_busy(t.pid), "target {} used its GPU in the window", t.pid);
                // Nor one of a dead process group with a member re-parented to init that
                // works and holds no GPU file (a data server): that member is of the same
                // dead job. (Another holder's work counts for itself: the torchrun rule.)
                let h = report.gpus.iter().flat_map(|g| &g.holders).find(|h| h.pid == t.pid).unwrap();
                if h.dead_job.is_some()
                    && h.job.as_ref().is_some_and(|j| j.label.starts_with("pgid:"))
                {
                    for q in s.processes.iter().filter(|q| {
                        q.pgid == proc_.pgid
                            && q.ppid == Some(1)
                            && q.device_files.gpu_minors().next().is_none()
                            && q.pid != t.pid
                            && q.pid != s.host.self_pid
                            && !q.is_kernel_thread()
                    }) {
                        prop_assert!(
                            !cpu_busy(q.pid),
                            "target {} is of a dead group whose member {} works", t.pid, q.pid
                        );
                    }
                }
                for q in s.processes.iter().filter(|q| !q.is_kernel_thread() && q.pid != s.host.self_pid) {
                    let mut cur = q.ppid;
                    for _ in 0..64 {
                        let Some(pp) = cur.filter(|pp| *pp > 1) else { break };
                        if pp == t.pid {
                            prop_assert!(
                                !cpu_busy(q.pid) && !gpu_busy(q.pid),
                                "target {} is an ancestor of {}, which works", t.pid, q.pid
                            );
                            break;
                        }
                        cur = s.process(pp).and_then(|p| p.ppid);
                    }
                }
            }
            // Nobody holding the device file of a GPU whose process list failed or was
            // unreliable: whether it computes there is unknown (its own exit or a detached holder asked for by name
            // aside, as for every work rule).
            if !matches!(t.class, Class::Zombie | Class::Detached) {
                let unread: Vec<u32> = s
                    .gpus
                    .iter()
                    .filter(|g| {
                        matches!(
                            g.process_list,
                            ProcessListState::Unavailable { .. } | ProcessListState::Unreliable { .. }
                        )
                    })
                    .map(|g| g.minor_number.unwrap_or(g.index))
                    .collect();
                prop_assert!(
                    !proc_.device_files.gpu_minors().any(|m| unread.contains(&m)),
                    "target {} holds a GPU whose process list failed", t.pid
                );
            }
            prop_assert!(!forbidden.contains(&t.class));
            // An unlisted holder without /dev/nvidia-uvm has no context: nothing to free. Nor
            // has one that maps NVML and not the CUDA driver library (a monitor on driver
            // 580), and one whose map could not be read is not known to have one.
            if t.class == Class::Hidden {
                prop_assert!(
                    !matches!(&proc_.device_files, FdScan::Scanned(f) if !f.contains(&DeviceFile::Uvm)),
                    "target {} holds no /dev/nvidia-uvm", t.pid
                );
                prop_assert!(
                    !matches!(
                        proc_.driver_library,
                        Some(DriverLibrary::NvmlOnly | DriverLibrary::Unknown)
                    ),
                    "target {} maps {:?}", t.pid, proc_.driver_library
                );
            }
            // A zombie target is finished, not killed while it lives: the whole process is on
            // its way out, or its job is gone (a main thread that called pthread_exit in a
            // live job leaves a live process).
            if t.class == Class::Zombie {
                let h = report.gpus.iter().flat_map(|g| &g.holders).find(|h| h.pid == t.pid).unwrap();
                let threads_live_on = proc_.threads.iter().flatten().any(|t| {
                    t.tid != proc_.pid && !matches!(t.state, 'Z' | 'X')
                });
                prop_assert!(
                    exiting || h.dead_job.is_some() || !threads_live_on,
                    "zombie target {} lives on in a live job", t.pid
                );
                // Nor is one whose threads were not read, in a live job: whether they work on
                // is unknown.
                prop_assert!(
                    proc_.threads.is_some() || h.dead_job.is_some(),
                    "zombie target {} of a live job had its threads unread", t.pid
                );
            }
            // Nor is an NVML client on its way out (its exit closes its files).
            if t.class == Class::Zombie {
                let uvm = matches!(&proc_.device_files, FdScan::Scanned(f) if f.contains(&DeviceFile::Uvm));
                prop_assert!(
                    !(uvm && proc_.driver_library == Some(DriverLibrary::NvmlOnly)),
                    "zombie target {} is an NVML client", t.pid
                );
            }
            // A Slurm job is gone by its cgroup only where Slurm made that cgroup: a directory
            // the process's own user made (their uid, or in their `user@UID.service`) proves
            // nothing.
            if let Some(job) = report.gpus.iter().flat_map(|g| &g.holders).find(|h| h.pid == t.pid).and_then(|h| h.job.as_ref())
                && job.kind == vramguard_core::job::JobKind::Slurm
                && job.alive == Some(false)
            {
                let root = vramguard_core::job::cgroup_job(proc_).map(|j| j.root);
                let owner = root
                    .as_ref()
                    .and_then(|r| s.job_cgroup(r))
                    .and_then(|f| f.owner_uid)
                    .filter(|u| *u != 0);
                let users_own = owner.is_some_and(|u| {
                    Some(u) == proc_.uid
                        || root.as_deref().is_some_and(|r| r.contains(&format!("/user@{u}.service/")))
                });
                prop_assert!(
                    !users_own,
                    "target {} is in a dead Slurm job whose cgroup uid {:?} made", t.pid, owner
                );
            }
            // Nothing of a job whose supervisor lives is planned as if its job were gone.
            if matches!(t.class, Class::Orphan | Class::Hidden | Class::Detached) {
                prop_assert!(
                    !under_live_supervisor(&s, &policy, proc_),
                    "target {} ({:?}) is in a job whose supervisor lives", t.pid, t.class
                );
            }
            prop_assert!(opts.include.contains(&t.class));
            prop_assert_eq!(Some(t.start_ticks), proc_.start_ticks);
            // Another user's process only with root or CAP_KILL.
            if s.host.euid != 0 && s.host.cap_effective.is_none_or(|c| c & 1 << Privileges::CAP_KILL == 0) {
                prop_assert_eq!(proc_.uid, Some(s.host.euid));
            }
            prop_assert!(!t.gpus.is_empty());
            for tg in &t.gpus {
                prop_assert!(opts.gpus.as_ref().is_none_or(|g| g.contains(&tg.gpu)));
                let holder = report.gpus[tg.gpu as usize].holders.iter().find(|h| h.pid == t.pid);
                prop_assert!(holder.is_some(), "target {} does not hold GPU {}", t.pid, tg.gpu);
                let h = holder.unwrap();
                if h.class == Class::Hidden && h.dead_job.is_none() {
                    keeper_rules(&s, h, proc_, tg.gpu, opts.include_keepers)?;
                }
                if h.class == Class::Idle {
                    prop_assert!(h.idle_secs.unwrap_or(0) >= opts.idle_for_secs);
                }
            }
        }
        // Nothing is both a target and left alone.
        for l in &plan.left_alone {
            prop_assert!(plan.targets().all(|t| t.pid != l.pid));
        }
        // The report offers nothing the planner refuses below a live supervisor: no bytes
        // expected back, no command that names its job or its keepers.
        for h in report.gpus.iter().flat_map(|g| &g.holders) {
            let Some(proc_) = s.process(h.pid) else { continue };
            if matches!(h.class, Class::Orphan | Class::Hidden | Class::Detached)
                && under_live_supervisor(&s, &policy, proc_)
            {
                let names_it = h.action.command.as_deref().is_some_and(|c| {
                    c.contains("--include keepers") || c.contains("--job")
                });
                prop_assert!(
                    !h.action.reclaimable && !names_it,
                    "holder {} ({:?}) below a live supervisor is offered {:?}", h.pid, h.class, h.action
                );
            }
        }
    }
}

// ---- shared-memory segments ----

use vramguard_core::host::{
    HostMemoryFacts, OwnerRule, SegmentVerdict, ShmDirFacts, ShmPolicy, ShmSegmentFacts,
};

const SEGMENT_NAMES: &[&str] = &[
    "torch_4121_0",
    "nccl-ab12",
    "psm_9f",
    "sem.mp-1",
    "PostgreSQL.42",
    "torch",
    "",
    "a/b",
];

fn arb_segments() -> impl Strategy<Value = Vec<ShmSegmentFacts>> {
    prop::collection::vec(
        (
            prop::sample::select(SEGMENT_NAMES.to_vec()),
            any::<bool>(),
            prop::sample::select(vec![0u32, 1000, 1001, 4242]),
            prop::collection::vec(1u32..45, 0..3),
            0u64..2_000_000,
            0u64..2_000_000,
            1u64..(64 << 20),
        ),
        0..8,
    )
    .prop_map(|segs| {
        segs.into_iter()
            .enumerate()
            .map(
                |(i, (name, exact, uid, users, modified, changed, bytes))| ShmSegmentFacts {
                    name: format!("{name}{}", if i % 2 == 0 { "" } else { "x" }),
                    exact_name: exact,
                    inode: 100 + i as u64,
                    bytes,
                    size: bytes,
                    uid,
                    modified_ms: modified,
                    changed_ms: changed,
                    users,
                },
            )
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]
    /// A planned segment is never in use, is a known producer's, exactly named, older than
    /// min_age by both its times, fully checked, and its owner's live GPU holders (under the
    /// default rule) are all targets of the same plan.
    #[test]
    fn a_planned_segment_is_orphaned_by_every_rule(
        (s, opts) in arb_snapshot(),
        segments in arb_segments(),
        checked in any::<bool>(),
        min_age in 1u64..3000,
        ignore_owner in any::<bool>(),
    ) {
        let mut s = s;
        s.host_memory = Some(HostMemoryFacts {
            shm: vec![ShmDirFacts {
                path: "/dev/shm".into(),
                dev: 27,
                segments,
                users_checked: checked,
                ..Default::default()
            }],
            ..Default::default()
        });
        let shm = ShmPolicy {
            min_age_secs: min_age,
            owner_rule: if ignore_owner { OwnerRule::Ignore } else { OwnerRule::NoLiveHolder },
            ..ShmPolicy::default()
        };
        let policy = Policy { idle_after_secs: 60, shm: shm.clone(), ..Policy::default() };
        let report = classify(&s, &policy);
        let opts = ReclaimOptions { include_shm: Some(shm.clone()), ..opts };
        let plan = plan_reclaim(&s, &report, &opts);
        let targets: BTreeSet<u32> = plan.targets().map(|t| t.pid).collect();
        let facts = &s.host_memory.as_ref().unwrap().shm[0];
        for planned in &plan.segments {
            let f = facts.segments.iter().find(|f| f.inode == planned.inode).unwrap();
            prop_assert_eq!(&planned.verdict, &SegmentVerdict::Reclaimable);
            prop_assert!(checked);
            for u in &f.users {
                prop_assert!(targets.contains(u), "{} is used by {} (not a target)", f.name, u);
            }
            prop_assert!(f.exact_name && !f.name.is_empty() && !f.name.contains('/'));
            prop_assert!(shm.producers.iter().any(|p| f.name.starts_with(p.as_str())));
            let last = f.modified_ms.max(f.changed_ms);
            prop_assert!(last <= s.taken_at_ms && s.taken_at_ms - last >= min_age * 1000);
            if !ignore_owner {
                for (_, h) in report.holders() {
                    let live = s.process(h.pid).is_some() && h.class != Class::Foreign;
                    if live && h.uid == Some(f.uid) {
                        prop_assert!(
                            targets.contains(&h.pid),
                            "owner {} still has live holder {} not in the plan", f.uid, h.pid
                        );
                    }
                }
            }
        }
        // Without --include shm, or narrowed to one job, no segment is ever planned.
        let without = plan_reclaim(&s, &report, &ReclaimOptions { include_shm: None, ..opts.clone() });
        prop_assert!(without.segments.is_empty());
        let narrowed = plan_reclaim(&s, &report, &ReclaimOptions { job_of: Some(1), ..opts });
        prop_assert!(narrowed.segments.is_empty());
    }
}

/// What a hidden target of a live job must be: the keeper of an exited pid listed on its GPU
/// (no process here, or a reused pid holding no device file), with no context of its own,
/// holding /dev/nvidia-uvm, inside a plain process-group job (any job with `--include
/// keepers`), and sharing no process group or
/// session with a live process listed there unless that group or session is the exited pid's.
fn keeper_rules(
    s: &Snapshot,
    h: &vramguard_core::report::Holder,
    proc_: &ProcessFacts,
    gpu: u32,
    include_keepers: bool,
) -> Result<(), TestCaseError> {
    let exited = h.keeps_alive;
    prop_assert!(
        exited.is_some(),
        "hidden target {} of a live job keeps nothing",
        h.pid
    );
    let exited = exited.unwrap();
    let g = &s.gpus[gpu as usize];
    prop_assert!(g.processes.iter().any(|l| l.pid == exited));
    let gone = s
        .process(exited)
        .is_none_or(|e| e.is_kernel_thread() || e.device_files.holds_any() == Some(false));
    prop_assert!(gone, "{} kept by {} is a process here", exited, h.pid);
    prop_assert!(
        s.gpus
            .iter()
            .all(|g| g.processes.iter().all(|l| l.pid != h.pid))
    );
    let uvm = matches!(&proc_.device_files, FdScan::Scanned(f) if f.contains(&DeviceFile::Uvm));
    prop_assert!(uvm);
    // Outside a plain process group only when keepers were asked for by name.
    let label = &h.job.as_ref().unwrap().label;
    prop_assert!(
        include_keepers || label.starts_with("pgid:") || label.starts_with("pid:"),
        "{}",
        label
    );
    // The tie is direct when it, or an ancestor it inherited through (a chain of unlisted
    // holders of this GPU above it), was forked by the exited pid or is in its group or
    // session.
    // Forked by it only when the last process with that pid to leave started when the parent
    // seen did (pids are reused).
    let last_departed = s.departed.iter().rev().find(|d| d.pid == exited);
    let mut direct = false;
    let mut cur = Some(proc_);
    for _ in 0..64 {
        let Some(q) = cur else { break };
        let forked_by_it = q.earlier_ppid == Some(exited)
            && last_departed
                .and_then(|d| d.start_ticks)
                .zip(q.earlier_parent_start_ticks)
                .is_some_and(|(a, b)| a == b);
        direct |= q.pgid == Some(exited) || q.sid == Some(exited) || forked_by_it;
        let holds = |x: &ProcessFacts| {
            x.device_files.gpu_minors().any(|m| m == gpu)
                && g.processes.iter().all(|l| l.pid != x.pid)
        };
        cur = q
            .ppid
            .and_then(|pp| s.process(pp))
            .filter(|x| x.pid != q.pid && holds(x));
    }
    // In a live job, by default, only on a direct tie, and never one that leads its own group
    // or session (a job of its own, which lives).
    if !include_keepers {
        prop_assert!(
            direct,
            "keeper {} of a live job is tied to {} indirectly",
            h.pid,
            exited
        );
        prop_assert!(proc_.pgid != Some(proc_.pid) && proc_.sid != Some(proc_.pid));
    }
    if !direct {
        // Another user's exited pid is nobody's parent here.
        prop_assert!(
            last_departed
                .and_then(|d| d.uid)
                .is_none_or(|u| Some(u) == proc_.uid),
            "keeper {} is tied to another user's {}",
            h.pid,
            exited
        );
        prop_assert!(proc_.pgid != Some(proc_.pid) && proc_.sid != Some(proc_.pid));
        for l in s.gpus.iter().flat_map(|g| &g.processes) {
            if let Some(q) = s
                .process(l.pid)
                .filter(|q| q.pid != h.pid && q.state != Some('Z'))
            {
                prop_assert!(
                    q.pgid != proc_.pgid && q.sid != proc_.sid,
                    "keeper {} shares a group or session with live listed {}",
                    h.pid,
                    q.pid
                );
            }
        }
    }
    Ok(())
}

/// The real driver's seed case with its variations: an exited trainer (446) still listed
/// on GPU 0, a script (436) that may still run, up to four unlisted holders with random
/// parents, groups, sessions, earlier parents, device files, CPU use and cgroups, and maybe a
/// live process of one of the groups listed on the GPU.
fn arb_inheritors() -> impl Strategy<Value = (Snapshot, ReclaimOptions)> {
    let holder = (
        prop::sample::select(vec![1u32, 436, 501, 502]),
        prop::sample::select(vec![436u32, 446, 0]),
        prop::sample::select(vec![436u32, 446, 0]),
        any::<bool>(),
        prop::option::of(prop::sample::select(vec![446u32, 436])),
        prop::sample::select(vec![0u64, 0, 50]),
        prop::sample::select(vec![None, Some("/system.slice/train.service")]),
        // The earlier parent's start time: the departed 446's, another's, not read.
        prop::sample::select(vec![Some(4460u64), Some(1), None]),
    );
    (
        prop::collection::vec(holder, 1..5),
        any::<bool>(),
        prop::option::of(prop::sample::select(vec![436u32, 446])),
        0u8..4,
        // 446's departure as a collection saw it: not at all, this user's, another user's.
        prop::sample::select(vec![None, Some(1000u32), Some(1001)]),
    )
        .prop_map(
            |(holders, script_alive, kin_group, job_label, departed_uid)| {
                let mut procs = vec![init()];
                if script_alive {
                    procs.push(p(436, 1, 436, "bash", &[]));
                }
                let mut listed = vec![(446, 20)];
                if let Some(group) = kin_group {
                    let mut kin = p(600, 1, group, "python3", &[0]);
                    kin.sid = Some(group);
                    procs.push(kin);
                    listed.push((600, 4));
                }
                let mut cpu = Vec::new();
                for (i, (ppid, pgid, sid, uvm, earlier, ticks, cgroup, earlier_start)) in
                    holders.into_iter().enumerate()
                {
                    let pid = 501 + i as u32;
                    let mut q = p(
                        pid,
                        ppid,
                        if pgid == 0 { pid } else { pgid },
                        "python3",
                        &[0],
                    );
                    q.sid = Some(if sid == 0 { pid } else { sid });
                    if uvm {
                        q.device_files = FdScan::Scanned(vec![
                            DeviceFile::Ctl,
                            DeviceFile::Uvm,
                            DeviceFile::Gpu(0),
                        ]);
                    }
                    q.earlier_ppid = earlier;
                    q.earlier_parent_start_ticks = earlier.and(earlier_start);
                    q.cgroup = cgroup.map(str::to_string);
                    cpu.push((pid, ticks));
                    procs.push(q);
                }
                let l: Vec<(u32, u64)> = listed.iter().map(|(p, g)| (*p, g * GIB)).collect();
                let mut s = snap(vec![gpu(0, 24 * GIB, &l)], procs);
                if let Some(uid) = departed_uid {
                    s.departed.push(DepartedProcess {
                        pid: 446,
                        comm: Some("python3".into()),
                        cmdline: None,
                        gone_at_ms: 1_000,
                        start_ticks: Some(4460),
                        uid: Some(uid),
                    });
                }
                if let Some(w) = s.work.as_mut() {
                    for (pid, ticks) in cpu {
                        if let Some(sample) = w.processes.iter_mut().find(|x| x.pid == pid) {
                            sample.cpu_ticks = ticks;
                        }
                    }
                }
                let opts = ReclaimOptions {
                    job_label: (job_label % 2 == 1).then(|| "unit:train.service".to_string()),
                    include_keepers: job_label >= 2,
                    ..ReclaimOptions::default()
                };
                (s, opts)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]
    #[test]
    fn an_inheritor_of_an_exited_pid_is_a_target_only_by_the_keeper_rules((s, opts) in arb_inheritors()) {
        let report = classify(&s, &Policy::default());
        let plan = plan_reclaim(&s, &report, &opts);
        // The listed kin (600) is judged by the rules of listed holders (the test above).
        for t in plan.targets().filter(|t| t.pid != 600) {
            let proc_ = s.process(t.pid).unwrap();
            let h = report.gpus[0].holders.iter().find(|h| h.pid == t.pid).unwrap();
            prop_assert_eq!(t.class, Class::Hidden);
            prop_assert!(s.work_of(t.pid, proc_.start_ticks).is_some_and(|w| w.cpu_ticks == 0));
            if h.dead_job.is_some() {
                continue;
            }
            if h.job.as_ref().is_some_and(|j| j.label == "unit:train.service") {
                // Inside a job something else owns: only when keepers were asked for.
                prop_assert!(opts.include_keepers);
                prop_assert!(h.keeps_alive.is_some());
            } else {
                keeper_rules(&s, h, proc_, 0, opts.include_keepers)?;
            }
        }
        // The exited pid is never a target, and what comes back includes it only when all
        // of its keepers go.
        let exited = report.gpus[0].holders.iter().find(|h| h.pid == 446).unwrap();
        prop_assert_eq!(exited.class, Class::Exited);
        let targets: BTreeSet<u32> = plan.targets().map(|t| t.pid).collect();
        let all_go = !exited.keepers.is_empty() && exited.keepers.iter().all(|k| targets.contains(k));
        let expected = plan.expected_free.get(&0).copied().unwrap_or(0);
        prop_assert_eq!(expected >= 20 * GIB, all_go);
    }
}

/// The segments `--include shm` plans for a whole node: those judged reclaimable (no user left
/// once the plan's targets are gone, old enough), and only they: not the one a live process
/// maps (`nccl-…`), not root's PostgreSQL segment, not the dead job's own `torch_13630_77_0`
/// (written 40 s before the snapshot, younger than the 600 s minimum age). None when the plan
/// is narrowed to one job (the segments are the node's, not the job's), none without
/// `--include shm`.
#[test]
fn include_shm_plans_the_segments_orphaned_once_the_targets_go_and_only_for_the_whole_node() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/incidents/orphaned_shared_memory_and_a_dead_jobs_host_ram.json"
    );
    let mut s: Snapshot = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    s.normalize();
    let shm = ReclaimOptions {
        include_shm: Some(Policy::default().shm),
        ..ReclaimOptions::default()
    };
    let plan = plan_of(&s, &shm);
    let names: Vec<&str> = plan.segments.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "torch_13622_2941826409_0",
            "torch_13622_2941826409_1",
            "psm_5f1e2a"
        ]
    );
    assert!(
        plan.segments
            .iter()
            .all(|g| g.verdict == vramguard_core::host::SegmentVerdict::Reclaimable)
    );
    assert!(plan_of(&s, &ReclaimOptions::default()).segments.is_empty());
    let one_job = ReclaimOptions {
        job_label: Some("slurm:42".into()),
        ..shm.clone()
    };
    assert!(plan_of(&s, &one_job).segments.is_empty());
}

/// `--include detached` makes a working holder of a gone job a target, and the plan says so
/// in a warning naming it (escaped) and the work it was seen doing.
#[test]
fn a_detached_target_is_planned_only_when_asked_and_with_a_warning_naming_its_work() {
    let mut s = snap(
        vec![gpu(0, 4 * GIB, &[(201, 4 * GIB)])],
        vec![init(), p(201, 1, 200, "py\u{1b}[2J", &[0])],
    );
    // 1.5 s of CPU in the 2 s window: it works.
    if let Some(w) = s.work.as_mut() {
        for p in &mut w.processes {
            p.cpu_ticks = 150;
        }
    }
    let by_default = plan_of(&s, &ReclaimOptions::default());
    assert_eq!(by_default.targets().count(), 0, "{by_default:#?}");
    assert!(by_default.warnings.is_empty(), "{:?}", by_default.warnings);
    let asked = plan_of(
        &s,
        &ReclaimOptions {
            include: [Class::Detached].into_iter().collect(),
            ..ReclaimOptions::default()
        },
    );
    let pids: Vec<u32> = asked.targets().map(|t| t.pid).collect();
    assert_eq!(pids, vec![201], "{asked:#?}");
    assert_eq!(asked.warnings.len(), 1, "{:?}", asked.warnings);
    let w = &asked.warnings[0];
    assert!(
        w == "pid 201 (py\\e[2J) is detached, not dead: 75 % of a CPU core over 2.0s; it will be \
              stopped because --include detached was given",
        "{w}"
    );
}

/// Classes reclaim never targets are refused by the planner itself, even when a caller (a
/// library user, a future flag) puts them in `include`: the command line's check is not the
/// only guard. An exited pid (on the host) and a pid of another namespace (in a container)
/// are no process to signal; a live job's holder is working.
#[test]
fn classes_reclaim_never_targets_are_refused_even_when_a_caller_includes_them() {
    let everything = ReclaimOptions {
        include: Class::ALL.into_iter().collect(),
        ..ReclaimOptions::default()
    };
    let on_host = snap(
        vec![gpu(0, 8 * GIB, &[(500, 4 * GIB), (300, 4 * GIB)])],
        vec![init(), p(300, 1, 300, "vllm", &[0])],
    );
    // In a container where no listed pid is a process here, the driver numbers pids as
    // another namespace does.
    let mut in_container = snap(vec![gpu(0, 4 * GIB, &[(500, 4 * GIB)])], vec![init()]);
    in_container.host.pid_namespace_is_host = Some(false);
    for (s, pid, class, reason) in [
        (
            &on_host,
            500,
            Class::Exited,
            "it has exited: there is no process to signal",
        ),
        (
            &in_container,
            500,
            Class::Foreign,
            "not a process of this PID namespace",
        ),
        (&on_host, 300, Class::Active, "its job is alive"),
    ] {
        let plan = plan_of(s, &everything);
        assert!(plan.targets().all(|t| t.pid != pid), "{class}: {plan:#?}");
        let alone = plan
            .left_alone
            .iter()
            .find(|l| l.pid == pid)
            .unwrap_or_else(|| panic!("{pid} is not left alone: {plan:#?}"));
        assert_eq!(alone.class, class);
        assert!(alone.reason.starts_with(reason), "{}", alone.reason);
    }
}

/// Nodes that are mostly healthy, where `status` may answer from the listed processes: jobs
/// (a group and session led by a leader that may be gone) whose members hold a GPU with a
/// context (listed or not), hold its files without one (a monitor, a forked worker), or hold
/// none; a listed pid that is another process now; memory beyond what is listed.
fn arb_mostly_healthy() -> impl Strategy<Value = (Snapshot, ReclaimOptions)> {
    // Per member: GPU, files (0 none, 1 context files, 2 GPU file without uvm), listed,
    // GiB, parent (0 leader, 1 init, 2 the previous member).
    let member = (
        0u32..2,
        prop::sample::select(vec![1u8, 1, 1, 0, 2]),
        prop::bool::weighted(0.8),
        1u64..8,
        0u8..3,
    );
    let job = (
        prop::bool::weighted(0.85),
        prop::collection::vec(member, 1..4),
    );
    (
        prop::collection::vec(job, 1..4),
        prop::collection::vec(prop::sample::select(vec![0u64, 0, 0, 0, 1, 2]), 2),
        prop::option::weighted(0.15, (0u32..2, 1u64..4)),
    )
        .prop_map(|(jobs, extra, exited)| {
            let mut procs = vec![init()];
            let mut listed: Vec<(u32, u32, u64)> = Vec::new();
            for (j, (leader_alive, members)) in jobs.into_iter().enumerate() {
                let leader = 100 * (j as u32 + 1);
                if leader_alive {
                    procs.push(p(leader, 1, leader, "bash", &[]));
                }
                for (k, (g, files, is_listed, gib, parent)) in members.into_iter().enumerate() {
                    let pid = leader + 1 + k as u32;
                    let ppid = match parent {
                        0 if leader_alive => leader,
                        2 if k > 0 => pid - 1,
                        _ => 1,
                    };
                    let mut q = p(pid, ppid, leader, "python3", &[]);
                    q.device_files = FdScan::Scanned(match files {
                        0 => vec![],
                        1 => vec![DeviceFile::Ctl, DeviceFile::Uvm, DeviceFile::Gpu(g)],
                        _ => vec![DeviceFile::Ctl, DeviceFile::Gpu(g)],
                    });
                    if is_listed && files != 0 {
                        listed.push((g, pid, gib));
                    }
                    procs.push(q);
                }
            }
            // A listed pid with no process: a dead creator the driver keeps listing.
            if let Some((g, gib)) = exited {
                listed.push((g, 999, gib));
            }
            let gpus = (0..2u32)
                .map(|i| {
                    let l: Vec<(u32, u64)> = listed
                        .iter()
                        .filter(|(g, ..)| *g == i)
                        .map(|(_, pid, gib)| (*pid, gib * GIB))
                        .collect();
                    let used = l.iter().map(|(_, b)| b).sum::<u64>() + extra[i as usize] * GIB;
                    gpu(i, used, &l)
                })
                .collect();
            (snap(gpus, procs), ReclaimOptions::default())
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]
    /// When `status` answers from the listed processes (nothing asks for a full scan), the
    /// full scan would not have said otherwise: no ghost, unexplained or reclaimable byte,
    /// nothing to reclaim by default, and every listed holder with the same class, bytes and
    /// job verdict.
    #[test]
    fn an_answer_from_the_listed_processes_is_what_the_full_scan_says(
        (s, _opts) in prop_oneof![arb_mostly_healthy(), arb_snapshot(), arb_inheritors()],
    ) {
        let mut full = s;
        full.departed.clear();
        full.work = None;
        let shallow = support::listed_only_view(&full);
        if let Err(e) = support::listed_answer_agrees(&full, &shallow) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// A dead process group (its leader, 200, gone) whose members were re-parented each on their
/// own or stayed under another member: GPU holders and helpers (no GPU file), busy or idle.
fn arb_dead_group() -> impl Strategy<Value = Snapshot> {
    let member = (
        any::<bool>(),                           // holds GPU 0
        prop::sample::select(vec![0u32, 1, 2]),  // parent: init, or an earlier member
        prop::sample::select(vec![0u64, 0, 50]), // CPU ticks over the window
    );
    prop::collection::vec(member, 1..6).prop_map(|members| {
        let mut procs = vec![init()];
        let mut listed = Vec::new();
        let mut cpu = Vec::new();
        for (i, (holds, parent, ticks)) in members.into_iter().enumerate() {
            let pid = 301 + i as u32;
            let ppid = match parent {
                0 => 1,
                n => 301 + (i as u32).saturating_sub(n).min(i as u32),
            };
            let ppid = if ppid == pid { 1 } else { ppid };
            let q = p(pid, ppid, 200, "python3", if holds { &[0] } else { &[] });
            if holds {
                listed.push((pid, GIB));
            }
            cpu.push((pid, ticks));
            procs.push(q);
        }
        let mut s = snap(vec![gpu(0, 8 * GIB, &listed)], procs);
        if let Some(w) = s.work.as_mut() {
            for (pid, ticks) in cpu {
                if let Some(sample) = w.processes.iter_mut().find(|x| x.pid == pid) {
                    sample.cpu_ticks = ticks;
                }
            }
        }
        s
    })
}

proptest! {
    /// No holder of a dead process group is a target while a member of that group that holds
    /// no GPU file, re-parented to init, works: it is the same job (a data server feeding the
    /// trainer). A working GPU holder elsewhere in the group protects only its own tree (the
    /// torchrun rule), so it is not asserted here.
    #[test]
    fn a_working_helper_of_a_dead_group_protects_its_holders(s in arb_dead_group()) {
        let report = classify(&s, &Policy::default());
        let plan = plan_reclaim(&s, &report, &ReclaimOptions::default());
        let helper_works = s.processes.iter().any(|q| {
            q.pgid == Some(200)
                && q.ppid == Some(1)
                && q.device_files.gpu_minors().next().is_none()
                && s.work_of(q.pid, q.start_ticks).is_some_and(|w| w.cpu_ticks >= 10)
        });
        if helper_works {
            let targets: Vec<u32> = plan.targets().map(|t| t.pid).collect();
            prop_assert!(targets.is_empty(), "targets {:?} beside a working helper", targets);
        }
    }
}
