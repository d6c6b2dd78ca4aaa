//! Every class, produced by real processes and read through the NVML path: the binary loads
//! the simulator's libnvidia-ml.so.1 through nvml-wrapper, and scans the live /proc.

mod common;
use common::*;
use serde_json::{Value, json};
use std::process::Output;

#[test]
fn killed_trainer_leaves_orphaned_workers_and_a_hidden_dataloader_worker() {
    let world = World::new(2);
    let mut server_spec = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 20 * GIB, "sm_util": 60 }]),
    );
    server_spec["new_session"] = json!(true);
    let server = start(&world, &["python3", "serve.py"], server_spec);

    let mut trainer_spec = spec(&world, json!([hold(0, 16)]));
    trainer_spec["group_leader"] = json!(true);
    trainer_spec["comm"] = json!("python3");
    let worker = |listed: bool| {
        json!({ "argv": ["python3", "train.py"], "spec": {
            "state": world.state_path(), "lifetime_ms": 120_000, "comm": "pt_data_worker",
            "holds": [{ "gpu": 0, "bytes": 4 * GIB, "listed": listed }] } })
    };
    trainer_spec["workers"] = json!([worker(true), worker(true), worker(false)]);
    let mut trainer = start(&world, &["python3", "train.py"], trainer_spec);
    let leader = trainer.pid;

    // Before the crash, everything is active.
    let before = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(holder(&before, 0, leader)["class"], "active");
    assert_eq!(holder(&before, 0, trainer.workers[0])["class"], "active");

    trainer.crash();
    capture_incident(&world, Path_::Nvml);
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    for &w in &trainer.workers[..2] {
        let h = holder(&report, 0, w);
        assert_eq!(h["class"], "orphan", "{h:#}");
        assert_eq!(h["dead_job"]["leader_pid"], json!(leader));
        assert_eq!(h["used_bytes"], json!(4 * GIB));
        assert_eq!(h["action"]["reclaimable"], json!(true));
        assert_eq!(h["command"], "python3 train.py");
        assert_eq!(h["comm"], "pt_data_worker");
    }
    let hidden = holder(&report, 0, trainer.workers[2]);
    assert_eq!(hidden["class"], "hidden");
    assert_eq!(hidden["listed"], json!(false));
    assert_eq!(
        hidden["action"]["reclaimable"],
        json!(true),
        "its job is gone"
    );
    assert_eq!(holder(&report, 0, server.pid)["class"], "active");
    let g0 = &report["gpus"][0];
    assert_eq!(
        g0["unaccounted"]["bytes"],
        json!(4 * GIB),
        "the hidden worker's memory"
    );
    assert_eq!(g0["unaccounted"]["cause"], "hidden_holders");
    assert_eq!(g0["ghost_bytes"], json!(12 * GIB));

    let d = Vg::new(&world, Path_::Nvml)
        .args(["diagnose", "--json"])
        .json(1);
    assert_eq!(d["verdict"]["clean"], json!(false));
    let next = d["verdict"]["next_steps"][0]["command"].as_str().unwrap();
    assert!(next.contains("vramguard reclaim --gpu 0"), "{next}");
    drop(trainer);
    drop(server);
}

#[test]
fn on_a_mig_gpu_each_holder_has_its_memory_and_only_the_residue_is_unaccounted() {
    use vramguard_sim::state::AfterExit;
    let world = World::new(1);
    world.enable_mig(0, &[1, 2]);
    // A live server on the first MIG device; a crashed trainer's worker and 3 GiB of residue
    // on the second.
    let mut server_spec = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 10 * GIB, "mig_device": 0 }]),
    );
    server_spec["new_session"] = json!(true);
    let server = start(&world, &["python3", "serve.py"], server_spec);
    let mut trainer_spec = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 2 * GIB, "mig_device": 1 }]),
    );
    trainer_spec["group_leader"] = json!(true);
    trainer_spec["workers"] = json!([{ "argv": ["python3", "train.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000,
        "holds": [{ "gpu": 0, "bytes": 4 * GIB, "mig_device": 1 }] } }]);
    let mut trainer = start(&world, &["python3", "train.py"], trainer_spec);
    trainer.crash();
    let mut residue = allocation(0, 999_999, 3 * GIB);
    residue.after_exit = AfterExit::Leak;
    residue.mig_device = Some(1);
    world.allocate(residue);
    for path in [Path_::Nvml, Path_::InProcess] {
        let report = Vg::new(&world, path).args(["status", "--json"]).json(0);
        let server_h = holder(&report, 0, server.pid);
        assert_eq!(server_h["class"], "active");
        assert_eq!(server_h["used_bytes"], json!(10 * GIB), "{server_h:#}");
        let worker = holder(&report, 0, trainer.workers[0]);
        assert_eq!(worker["class"], "orphan", "{worker:#}");
        assert_eq!(worker["used_bytes"], json!(4 * GIB));
        let g0 = &report["gpus"][0];
        assert_eq!(g0["unaccounted"]["bytes"], json!(3 * GIB), "{g0:#}");
        assert_eq!(g0["unaccounted"]["cause"], "driver_residue");
        assert_eq!(
            g0["ghost_bytes"],
            json!(7 * GIB),
            "the orphan's and the residue"
        );
        // Per MIG device: the server's is clean, the other has the orphan and the residue.
        let migs = g0["mig_devices"].as_array().unwrap();
        assert_eq!(migs.len(), 2, "{g0:#}");
        assert_eq!(migs[0]["gpu_instance"], 1);
        assert_eq!(migs[0]["holders"], json!([server.pid]));
        assert_eq!(migs[0]["ghost_bytes"], 0);
        assert_eq!(migs[1]["holders"], json!([trainer.workers[0]]));
        assert_eq!(migs[1]["unaccounted_bytes"], json!(3 * GIB));
        assert_eq!(migs[1]["ghost_bytes"], json!(7 * GIB));
    }
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let mig_uuid = |i: usize| {
        report["gpus"][0]["mig_devices"][i]["uuid"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let text = Vg::new(&world, Path_::Nvml).args(["status"]).code(0);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!("MIG 3g.71gb GI 2  {}", mig_uuid(1)))
            && text.contains("ghost 7.0 GiB"),
        "{text}"
    );
    // `reclaim --gpu MIG-…` plans for that MIG device only. Its orphan is still left alone:
    // a MIG device reports no per-process utilization, so whether it computes on the GPU is
    // unknown, and an unknown is never signalled.
    let left_alone = |uuid: String| {
        let plan = Vg::new(&world, Path_::Nvml)
            .args(["reclaim", "--dry-run", "--json", "--gpu", &uuid])
            .json(0);
        assert_eq!(plan["plan"]["jobs"], json!([]), "{plan:#}");
        plan["plan"]["left_alone"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["pid"] == trainer.workers[0])
            .unwrap()["reason"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let own = left_alone(mig_uuid(1));
    assert!(own.contains("reports no per-process utilization"), "{own}");
    let other = left_alone(mig_uuid(0));
    assert!(other.contains("on another MIG device"), "{other}");
    // The GPU's own UUID selects the whole GPU: every MIG device of it.
    let gpu_uuid = report["gpus"][0]["uuid"].as_str().unwrap().to_string();
    let whole = left_alone(gpu_uuid);
    assert!(
        whole.contains("reports no per-process utilization"),
        "{whole}"
    );
    Vg::new(&world, Path_::Nvml)
        .args(["reclaim", "--dry-run", "--gpu", "MIG-nonexistent"])
        .code(2);
    drop(trainer);
    drop(server);
}

/// A process whose main thread exited while an idle thread lives on holding the device, left
/// behind by a job that is gone (started in the background by a script that exited): a
/// zombie, which SIGKILL finishes (`--include zombie`). The same process in a live job is a
/// live process (a server whose main thread called `pthread_exit` and whose worker thread
/// waits for requests): no zombie, no ghost memory, not planned even with `--include
/// zombie` (red-team finding: it was).
#[test]
fn zombie_leader_with_a_running_thread_is_a_killable_zombie() {
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 3)]));
    s["shape"] = json!("zombie_leader");
    s["comm"] = json!("python3");
    let h = start_wrapped(
        &world,
        &["sh", "-c", "\"$@\" & exit 0", "sh"],
        &["python3", "infer.py"],
        s.clone(),
    );
    wait_until(10, "the leader to become a zombie", || {
        state_of(h.pid) == Some('Z')
    });
    capture_incident(&world, Path_::Nvml);
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let z = holder(&report, 0, h.pid);
    assert_eq!(z["class"], "zombie", "{z:#}");
    assert_eq!(z["job"]["alive"], json!(false), "{z:#}");
    assert_eq!(z["action"]["reclaimable"], json!(true));
    let ev = z["evidence"].to_string();
    assert!(
        ev.contains("main thread is a zombie (Z): it has exited while 1 other thread(s) live on"),
        "{ev}"
    );
    assert!(ev.contains("threads still holding the device"), "{ev}");

    let live = start(&world, &["python3", "serve.py"], s);
    wait_until(10, "the live job's leader to become a zombie", || {
        state_of(live.pid) == Some('Z')
    });
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let l = holder(&report, 0, live.pid);
    assert_ne!(l["class"], "zombie", "{l:#}");
    assert!(
        l["evidence"]
            .to_string()
            .contains("main thread has exited (Z) while 1 other thread(s) live on"),
        "{l:#}"
    );
    let plan = Vg::new(&world, Path_::Nvml)
        .args(["reclaim", "--dry-run", "--json", "--include", "zombie"])
        .json(0);
    let targets: Vec<u64> = plan["plan"]["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|j| j["targets"].as_array().unwrap())
        .map(|t| t["pid"].as_u64().unwrap())
        .collect();
    assert!(targets.contains(&u64::from(h.pid)), "{plan:#}");
    assert!(!targets.contains(&u64::from(live.pid)), "{plan:#}");
}

/// An NVML client on its way out (a monitor whose main thread exited while a thread still
/// holds its files; on driver 580 those include `/dev/nvidia-uvm`) is a zombie holder, but
/// not one to SIGKILL: it holds no context and no memory, and its map (read through its live
/// thread, the leader's being empty) shows libnvidia-ml without libcuda. Left alone even with
/// `--include zombie`. Without the rule, it was planned as a zombie to finish (a vramguard
/// process in exit was, when the simulator first modelled 580's NVML).
#[test]
fn an_nvml_client_on_its_way_out_is_not_a_zombie_to_kill() {
    let world = World::new(1);
    world.update(|s| s.nvml_client_files = true);
    let mut s = spec(&world, json!([]));
    s["open_gpus"] = json!([0]);
    s["shape"] = json!("zombie_leader");
    // Left behind by a job that is gone (started in the background by a script that exited):
    // in a live job, a main thread gone while a thread lives on is a live process.
    let h = start_wrapped(
        &world,
        &["sh", "-c", "\"$@\" & exit 0", "sh"],
        &["gpu-monitor"],
        s,
    );
    wait_until(10, "the leader to become a zombie", || {
        state_of(h.pid) == Some('Z')
    });
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json", "--full-scan"])
        .json(0);
    let z = holder(&report, 0, h.pid);
    assert_eq!(z["class"], "zombie", "{z:#}");
    assert_eq!(z["driver_library"], "nvml_only", "{z:#}");
    assert_eq!(z["action"]["reclaimable"], json!(false), "{z:#}");
    let out = Vg::new(&world, Path_::Nvml)
        .args([
            "reclaim",
            "--yes",
            "--json",
            "--include",
            "zombie,hidden,orphan",
        ])
        .output()
        .0;
    let o: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        o["plan"]["left_alone"]
            .to_string()
            .contains("maps libnvidia-ml and no CUDA driver library"),
        "{o:#}"
    );
    assert_eq!(state_of(h.pid), Some('Z'), "left as it was: {o:#}");
}

/// A server whose main thread exited while another thread works: the kernel shows its
/// leader `Z` and in `do_exit` (`PF_EXITING`), the working thread neither. The process lives,
/// and with it the job of the idle worker it started: neither is reclaimed, by default or
/// with `--include zombie`.
#[test]
fn a_process_whose_main_thread_exited_while_another_works_is_alive_with_its_job() {
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 3)]));
    s["group_leader"] = json!(true);
    s["shape"] = json!("zombie_leader");
    s["cpu_percent"] = json!(60);
    s["workers"] = json!([{ "argv": ["python3", "w.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000,
        "holds": [{ "gpu": 0, "bytes": GIB }] } }]);
    let h = start(&world, &["python3", "serve.py"], s);
    let worker = h.workers[0];
    wait_until(10, "the leader to become a zombie", || {
        state_of(h.pid) == Some('Z')
    });
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let z = holder(&report, 0, h.pid);
    assert_ne!(z["class"], "zombie", "a live process: {z:#}");
    assert_eq!(z["action"]["reclaimable"], json!(false), "{z:#}");
    let w = holder(&report, 0, worker);
    assert!(w["dead_job"].is_null(), "{w:#}");
    assert_ne!(w["class"], "orphan", "{w:#}");
    let audit = world.dir.path().join("audit.jsonl");
    for include in [None, Some("zombie")] {
        let mut vg = Vg::new(&world, Path_::Nvml).args(["reclaim", "--yes", "--grace", "300ms"]);
        if let Some(class) = include {
            vg = vg.args(["--include", class]);
        }
        let _ = vg.arg_path("--audit-log", &audit).output();
        // Its leader shows `Z`: alive means its working thread is still there.
        let runs_on = std::fs::read_dir(format!("/proc/{}/task", h.pid))
            .map(|tasks| {
                tasks.flatten().any(|t| {
                    t.file_name() != h.pid.to_string().as_str()
                        && std::fs::read_to_string(t.path().join("stat"))
                            .is_ok_and(|s| !s.contains(") Z ") && !s.contains(") X "))
                })
            })
            .unwrap_or(false);
        assert!(runs_on, "the working server was reclaimed ({include:?})");
        assert!(alive(worker), "its worker was reclaimed ({include:?})");
    }
}

#[test]
fn a_thread_stuck_in_d_state_is_reported_and_not_killable() {
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 3)]));
    s["shape"] = json!("zombie_leader_stuck_in_d");
    let h = start(&world, &["python3", "infer.py"], s);
    wait_until(10, "a zombie leader with a thread in D state", || {
        state_of(h.pid) == Some('Z')
            && std::fs::read_dir(format!("/proc/{}/task", h.pid))
                .map(|d| {
                    d.flatten().any(|t| {
                        std::fs::read_to_string(t.path().join("stat"))
                            .is_ok_and(|s| s.contains(") D "))
                    })
                })
                .unwrap_or(false)
    });
    capture_incident(&world, Path_::Nvml);
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let z = holder(&report, 0, h.pid);
    assert_eq!(z["class"], "zombie", "{z:#}");
    assert_eq!(z["action"]["reclaimable"], json!(false));
    assert!(
        z["action"]["summary"]
            .as_str()
            .unwrap()
            .contains("uninterruptible sleep (D)")
    );
    let d = Vg::new(&world, Path_::Nvml).args(["diagnose"]).code(1);
    assert!(stdout(&d).contains("uninterruptible"), "{}", stdout(&d));
}

/// Runs vramguard (`args`, through `path`) in a new PID namespace with a /proc of its own at
/// a private mount, as in a container without `hostPID`; the simulated driver keeps reading
/// the host's /proc, as the kernel driver would. With `join`, it enters the PID and mount
/// namespaces of that (host) pid instead, whose /proc of its own is at the same place.
fn vramguard_in_namespace(world: &World, path: Path_, join: Option<u32>, args: &str) -> Output {
    let inner_proc = world.dir.path().join("container-proc");
    std::fs::create_dir_all(&inner_proc).unwrap();
    let lib = match path {
        Path_::Nvml => format!("--nvml-lib {}", sim_nvml_lib().display()),
        Path_::InProcess => String::new(),
    };
    let mount = match join {
        Some(_) => String::new(),
        None => format!("mount -t proc proc {} && ", inner_proc.display()),
    };
    let script = format!(
        "{mount}exec {bin} --proc-root {p} --sim {s} {lib} {args}",
        p = inner_proc.display(),
        bin = BIN,
        s = world.state_path().display(),
    );
    let mut cmd = match join {
        Some(pid) => {
            let mut c = vg_wrapped("nsenter");
            c.args(["--target", &pid.to_string(), "--pid", "--mount"]);
            c
        }
        None => {
            let mut c = vg_wrapped("unshare");
            c.args(["--pid", "--fork", "--mount", "--propagation", "private"]);
            c
        }
    };
    cmd.args(["sh", "-c", &script])
        .env("NO_COLOR", "1")
        .env("COLUMNS", "1000")
        .env_remove("VRAMGUARD_SIM")
        .env_remove("VRAMGUARD_NVML_LIB")
        .output()
        .unwrap()
}

#[test]
fn vramguard_in_a_container_sees_no_host_pid_and_calls_the_memory_unexplained() {
    let world = World::new(1);
    let mut s = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 5 * GIB, "sm_util": 40 }]),
    );
    s["new_session"] = json!(true);
    let h = start(&world, &["python3", "serve.py"], s);
    // Another container's holder: a sibling PID namespace at the caller's depth, whose pid
    // there is a number the caller's namespace may have too; it is not the caller's to see.
    let mut s = spec(&world, json!([hold(0, 2)]));
    s["new_session"] = json!(true);
    let sibling = start_wrapped(
        &world,
        &["unshare", "--pid", "--fork"],
        &["python3", "other.py"],
        s,
    );
    for path in [Path_::Nvml, Path_::InProcess] {
        // As the real driver does (an H200 on 580.159.04 listed no process to a caller in a
        // new PID namespace while the host's used 20 GiB): the host's pid is not reported.
        let out = vramguard_in_namespace(&world, path, None, "status --json");
        assert!(out.status.success(), "{}", stderr(&out));
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["pid_namespace_is_host"], json!(false));
        let g0 = &report["gpus"][0];
        let listed: Vec<&Value> = g0["holders"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|x| x["listed"] == json!(true))
            .collect();
        assert!(listed.is_empty(), "the driver listed {listed:#?}");
        assert!(
            g0["holders"]
                .as_array()
                .unwrap()
                .iter()
                .all(|x| x["pid"] != json!(h.pid)),
            "{g0:#}"
        );
        assert_eq!(
            g0["memory"]["used"],
            json!(7 * GIB),
            "used is the GPU's: {g0:#}"
        );
        assert_eq!(g0["unaccounted"]["bytes"], json!(7 * GIB), "{g0:#}");
        assert_eq!(g0["unaccounted"]["significant"], json!(true));
        assert_eq!(g0["unaccounted"]["cause"], "other_namespace");
        assert_eq!(g0["ghost_bytes"], json!(0));

        let out = vramguard_in_namespace(&world, path, None, "status");
        let text = stdout(&out);
        assert!(text.contains("unexplained:"), "{text}");
        assert!(!text.contains("accounted for by a live job"), "{text}");
    }
    // On the host, the same holders are listed, by their host pids.
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(holder(&report, 0, h.pid)["class"], "active");
    assert_eq!(
        holder(&report, 0, sibling.pid)["used_bytes"],
        json!(2 * GIB)
    );
}

#[test]
fn a_holder_in_the_callers_own_namespace_is_listed_by_its_pid_there() {
    let world = World::new(1);
    let inner_proc = world.dir.path().join("container-proc");
    std::fs::create_dir_all(&inner_proc).unwrap();
    // A "pod": a PID namespace whose init (sh, pid 1) starts the holder and waits; vramguard then joins that namespace, as a monitor in the same pod would.
    let pod_init = format!(
        "mount -t proc proc {} && \"$0\" \"$@\"; :",
        inner_proc.display()
    );
    let mut s = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 3 * GIB, "sm_util": 40 }]),
    );
    s["new_session"] = json!(true);
    let inner = start_wrapped(
        &world,
        &[
            "unshare",
            "--pid",
            "--fork",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &pod_init,
        ],
        &["python3", "serve.py"],
        s,
    );
    let mut s = spec(&world, json!([hold(0, 5)]));
    s["new_session"] = json!(true);
    let host = start(&world, &["python3", "train.py"], s);
    let nspid = std::fs::read_to_string(format!("/proc/{}/status", inner.pid)).unwrap();
    let inner_pid: u32 = nspid
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap();
    assert_ne!(inner_pid, inner.pid, "{nspid}");
    for path in [Path_::Nvml, Path_::InProcess] {
        let out = vramguard_in_namespace(&world, path, Some(inner.pid), "status --json");
        assert!(out.status.success(), "{}", stderr(&out));
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["pid_namespace_is_host"], json!(false));
        let h = holder(&report, 0, inner_pid);
        assert_eq!(h["class"], "active", "{h:#}");
        assert_eq!(h["listed"], json!(true));
        assert_eq!(h["used_bytes"], json!(3 * GIB));
        assert!(
            h["command"].as_str().unwrap().ends_with("serve.py"),
            "{h:#}"
        );
        let g0 = &report["gpus"][0];
        let pids: Vec<&Value> = g0["holders"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| &x["pid"])
            .collect();
        assert!(!pids.contains(&&json!(host.pid)), "{pids:?}");
        assert!(!pids.contains(&&json!(inner.pid)), "a host pid: {pids:?}");
        // The host's train.py is outside: its 5 GiB are unexplained, not ghost.
        assert_eq!(g0["unaccounted"]["bytes"], json!(5 * GIB), "{g0:#}");
        assert_eq!(g0["unaccounted"]["cause"], "other_namespace");
        assert_eq!(g0["ghost_bytes"], json!(0));
    }
    // The host sees both by their host pids.
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(holder(&report, 0, inner.pid)["class"], "active");
    assert_eq!(holder(&report, 0, host.pid)["used_bytes"], json!(5 * GIB));
}

#[test]
fn a_dead_trainer_in_the_callers_namespace_is_listed_by_its_pid_there_with_its_keeper() {
    let world = World::new(1);
    let inner_proc = world.dir.path().join("container-proc");
    std::fs::create_dir_all(&inner_proc).unwrap();
    // A pod whose init outlives the trainer (and dies with the test: --kill-child).
    let pod_init = format!(
        "mount -t proc proc {} && \"$0\" \"$@\"; exec sleep 120",
        inner_proc.display()
    );
    let mut s = spec(&world, json!([hold(0, 4)]));
    s["group_leader"] = json!(true);
    s["forked_workers"] = json!(1);
    let trainer = start_wrapped(
        &world,
        &[
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            &pod_init,
        ],
        &["python3", "train.py"],
        s,
    );
    let inner = |pid: u32| -> u32 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .and_then(|l| l.split_whitespace().last()?.parse().ok())
            .unwrap()
    };
    let (leader, worker) = (trainer.pid, trainer.workers[0]);
    assert_ne!(leader, worker);
    let (inner_leader, inner_worker) = (inner(leader), inner(worker));
    assert_ne!(
        inner_worker, worker,
        "the worker is reported by its host pid"
    );
    // SIGKILL the trainer (a process this test started, by its pid); the pod's init reaps it.
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &leader.to_string()])
        .status();
    wait_until(10, "the trainer to be reaped", || {
        !std::path::Path::new(&format!("/proc/{leader}")).exists()
    });
    for path in [Path_::Nvml, Path_::InProcess] {
        // A fresh vramguard in the pod never saw the trainer alive: the driver still names it.
        let out = vramguard_in_namespace(&world, path, Some(worker), "status --json");
        assert!(out.status.success(), "{}", stderr(&out));
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        let dead = holder(&report, 0, inner_leader);
        assert_eq!(dead["listed"], json!(true), "{dead:#}");
        assert_eq!(dead["used_bytes"], json!(4 * GIB), "{dead:#}");
        // Which class a listed pid missing from a container's /proc gets is the core's
        // call (`foreign` today: vramguard in a container cannot tell it from another
        // namespace's pid); the simulator's part is that it is listed, by its pid here.
        assert_ne!(dead["class"], "active", "{dead:#}");
        let keeper = holder(&report, 0, inner_worker);
        assert_eq!(keeper["listed"], json!(false), "{keeper:#}");
        let g0 = &report["gpus"][0];
        assert_eq!(g0["unaccounted"]["bytes"], json!(0), "{g0:#}");
        // From another namespace, nothing of the pod is listed.
        let out = vramguard_in_namespace(&world, path, None, "status --json");
        let report: Value = serde_json::from_slice(&out.stdout).unwrap();
        let g0 = &report["gpus"][0];
        assert!(
            g0["holders"]
                .as_array()
                .unwrap()
                .iter()
                .all(|h| h["listed"] != json!(true)),
            "{g0:#}"
        );
        assert_eq!(g0["unaccounted"]["cause"], "other_namespace", "{g0:#}");
    }
}

#[test]
fn a_pid_reported_from_inside_a_namespace_maps_back_through_nspid() {
    let world = World::new(1);
    let mut s = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 2 * GIB, "report_namespace_pid": true }]),
    );
    s["new_session"] = json!(true);
    // The holder is pid 1 of a new PID namespace; the driver reports "pid 1".
    let h = start_wrapped(
        &world,
        &["unshare", "--pid", "--fork"],
        &["python3", "serve.py"],
        s,
    );
    capture_incident(&world, Path_::Nvml);
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let mapped = holder(&report, 0, h.pid);
    assert_eq!(mapped["reported_pid"], json!(1));
    assert_eq!(mapped["class"], "active", "{mapped:#}");
    assert_eq!(mapped["nspid"], json!([h.pid, 1]));
    assert!(mapped["evidence"][0].as_str().unwrap().contains("NSpid"));
    let listed: Vec<_> = report["gpus"][0]["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["pid"].clone())
        .collect();
    assert!(
        !listed.contains(&json!(1)),
        "init must not be blamed: {listed:?}"
    );
}

#[test]
fn the_persistence_daemon_is_system_and_blocks_the_reset_of_residue() {
    let world = World::new(2);
    let mut daemon = spec(&world, json!([]));
    daemon["open_gpus"] = json!([0, 1]);
    daemon["comm"] = json!("nvidia-persistenced");
    daemon["new_session"] = json!(true);
    // The service's identity: a root-owned executable of that name, run as root.
    let exe = installed_copy(&world.dir.path().join("sbin"), "nvidia-persistenced");
    // Another process that only took the name: the vramguard binary renamed by prctl.
    let mut impostor = spec(&world, json!([]));
    impostor["open_gpus"] = json!([0]);
    impostor["comm"] = json!("nvidia-persistenced");
    impostor["new_session"] = json!(true);
    let fake = start(&world, &["nvidia-persistenced"], impostor);
    let d = start_exe(
        &world,
        &exe,
        &[],
        &[
            "/usr/bin/nvidia-persistenced",
            "--user",
            "nvidia-persistenced",
        ],
        daemon,
    );
    let mut bench = spec(
        &world,
        json!([{ "gpu": 1, "bytes": 6 * GIB, "after_exit": "leak" }]),
    );
    bench["new_session"] = json!(true);
    let mut b = start(&world, &["python3", "bench.py"], bench);
    b.crash();

    capture_incident(&world, Path_::Nvml);
    let out = Vg::new(&world, Path_::Nvml)
        .args(["diagnose", "--json"])
        .json(1);
    let sys = holder(&out, 1, d.pid);
    assert_eq!(sys["class"], "system", "{sys:#}");
    let impostor = holder(&out, 0, fake.pid);
    assert_ne!(impostor["class"], "system", "{impostor:#}");
    assert!(
        impostor["evidence"]
            .to_string()
            .contains("named like the system service"),
        "{impostor:#}"
    );
    assert_eq!(
        sys["comm"], "nvidia-persiste",
        "the kernel truncates comm to 15 bytes"
    );
    let g1 = &out["report"]["gpus"][1];
    assert_eq!(g1["unaccounted"]["bytes"], json!(6 * GIB));
    assert_eq!(g1["unaccounted"]["cause"], "driver_residue");
    assert_eq!(g1["reset_blockers"][0]["pid"], json!(d.pid));
    let blockers = out["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["gpu"] == json!(1) && c["name"] == "reset blockers")
        .unwrap();
    assert_eq!(blockers["status"], "warn");
    assert!(
        blockers["evidence"]
            .as_str()
            .unwrap()
            .contains("nvidia-persiste")
    );
}

#[test]
fn a_monitor_holding_the_device_does_not_hide_driver_residue() {
    let world = World::new(2);
    let mut s = spec(
        &world,
        json!([{ "gpu": 1, "bytes": 6 * GIB, "after_exit": "leak" }]),
    );
    s["new_session"] = json!(true);
    let mut h = start(&world, &["python3", "bench.py"], s);
    h.crash();
    // An NVML client (opens the GPU, no CUDA context) keeps the device open.
    let mut monitor = spec(&world, json!([]));
    monitor["open_gpus"] = json!([1]);
    monitor["new_session"] = json!(true);
    let m = start(&world, &["gpu-monitor"], monitor);
    capture_incident(&world, Path_::Nvml);
    let d = Vg::new(&world, Path_::Nvml)
        .args(["diagnose", "--json"])
        .json(1);
    let g1 = &d["report"]["gpus"][1];
    assert_eq!(g1["unaccounted"]["cause"], "driver_residue", "{g1:#}");
    assert!(
        g1["unaccounted"]["explanation"]
            .to_string()
            .contains("at least 6.0 GiB is not explained by any holder"),
        "{g1:#}"
    );
    let steps = d["verdict"]["next_steps"].to_string();
    assert!(
        steps.contains(&format!("pid {} (gpu-monitor)", m.pid)),
        "{steps}"
    );
    assert!(
        steps.contains("vramguard reclaim --gpu 1 --reset=auto"),
        "{steps}"
    );
}

#[test]
fn status_answers_from_the_listed_processes_until_they_leave_something_unexplained() {
    let world = World::new(2);
    // No shared-memory directory: a segment another test leaves in /dev/shm would need a
    // pass over every process (the last case below).
    let cfg = config(&world, "[shm]\ndirs = []\n");
    let vg = || Vg::new(&world, Path_::Nvml).arg_path("--config", &cfg);
    let mut s = spec(&world, json!([hold(0, 4)]));
    s["new_session"] = json!(true);
    let trainer = start(&world, &["python3", "train.py"], s);
    // An NVML client (the device open, no context) in a job of its own.
    let mut monitor = spec(&world, json!([]));
    monitor["open_gpus"] = json!([0, 1]);
    monitor["new_session"] = json!(true);
    let m = start(&world, &["gpu-monitor"], monitor);

    // Every byte is the listed trainer's, in its live job: no pass over every process.
    let quick = vg().args(["status", "--json"]).json(0);
    assert_eq!(quick["full_fd_scan"], json!(false), "{quick:#}");
    assert_eq!(holder(&quick, 0, trainer.pid)["class"], "active");
    assert_eq!(quick["gpus"][0]["accounted_bytes"], json!(4 * GIB));
    let text = stdout(&vg().args(["status"]).code(0));
    assert!(
        text.contains("every byte is accounted for by a live job (by the processes the driver lists; `--full-scan`"),
        "{text}"
    );
    let full = vg().args(["status", "--json", "--full-scan"]).json(0);
    assert_eq!(full["full_fd_scan"], json!(true), "{full:#}");
    assert_eq!(holder(&full, 0, trainer.pid)["class"], "active");
    // The monitor (the device open, no memory) is what only the full scan shows.
    let pids = |r: &Value| -> Vec<u64> {
        r["gpus"][0]["holders"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|h| h["pid"].as_u64())
            .collect()
    };
    assert!(pids(&full).contains(&u64::from(m.pid)), "{full:#}");
    assert!(!pids(&quick).contains(&u64::from(m.pid)), "{quick:#}");
    // `diagnose` reads every process, and finds the monitor the driver does not list: an
    // NVML client, named as a warning (it holds no memory; the machine is clean, exit 0).
    let d = vg().args(["diagnose", "--json"]).json(0);
    assert_eq!(d["report"]["full_fd_scan"], json!(true));
    assert!(
        d["checks"]
            .to_string()
            .contains(&format!("{} (gpu-monitor)", m.pid)),
        "{d:#}"
    );

    // Memory nobody listed explains (residue on GPU 1): status reads every process by
    // itself, and names the monitor that would refuse a reset.
    let mut leak = spec(
        &world,
        json!([{ "gpu": 1, "bytes": 6 * GIB, "after_exit": "leak" }]),
    );
    leak["new_session"] = json!(true);
    let mut h = start(&world, &["python3", "bench.py"], leak);
    h.crash();
    let report = vg().args(["status", "--json"]).json(0);
    assert_eq!(report["full_fd_scan"], json!(true), "{report:#}");
    let g1 = &report["gpus"][1];
    assert_eq!(g1["unaccounted"]["cause"], "driver_residue", "{g1:#}");
    assert!(
        g1["reset_blockers"]
            .to_string()
            .contains(&format!("{}", m.pid)),
        "{g1:#}"
    );

    // A shared-memory segment: whose it is takes every process's maps and open files.
    let shm = world.dir.path().join(format!("shm-{}", std::process::id()));
    std::fs::create_dir(&shm).unwrap();
    std::fs::write(shm.join("segment"), vec![0u8; 4096]).unwrap();
    let cfg_shm = config(&world, &format!("[shm]\ndirs = [\"{}\"]\n", shm.display()));
    let world2 = World::new(1);
    let mut s2 = spec(&world2, json!([hold(0, 1)]));
    s2["new_session"] = json!(true);
    let _t2 = start(&world2, &["python3", "train.py"], s2);
    let plain = Vg::new(&world2, Path_::Nvml)
        .arg_path("--config", &cfg)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(plain["full_fd_scan"], json!(false), "{plain:#}");
    let with_segment = Vg::new(&world2, Path_::Nvml)
        .arg_path("--config", &cfg_shm)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(
        with_segment["full_fd_scan"],
        json!(true),
        "{with_segment:#}"
    );
    drop(trainer);
}

#[test]
fn residue_with_no_holder_points_at_a_reset() {
    let world = World::new(2);
    let mut s = spec(
        &world,
        json!([{ "gpu": 1, "bytes": 6 * GIB, "after_exit": "leak" }]),
    );
    s["new_session"] = json!(true);
    let mut h = start(&world, &["python3", "bench.py"], s);
    h.crash();
    capture_incident(&world, Path_::Nvml);
    let out = Vg::new(&world, Path_::Nvml).args(["diagnose"]).code(1);
    let text = stdout(&out);
    assert!(
        text.contains("memory the driver did not free (residue)"),
        "{text}"
    );
    assert!(
        text.contains("$ vramguard reclaim --gpu 1 --reset=auto"),
        "{text}"
    );
    assert!(
        text.contains("verdict: ghost memory: 6.0 GiB on GPU 1"),
        "{text}"
    );
}

#[test]
fn an_idle_holder_past_the_configured_threshold() {
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 1)]));
    s["new_session"] = json!(true);
    let h = start(&world, &["python3", "-m", "ipykernel_launcher"], s);
    let mut busy = spec(&world, json!([{ "gpu": 0, "bytes": GIB, "sm_util": 50 }]));
    busy["new_session"] = json!(true);
    let b = start(&world, &["python3", "train.py"], busy);
    let cfg = config(&world, "[policy]\nidle_after = \"1s\"\n");
    let report = status_once_idle(&world, &cfg, 0, h.pid, 1);
    let idle = holder(&report, 0, h.pid);
    assert_eq!(idle["class"], "idle", "{idle:#}");
    assert!(idle["idle_secs"].as_u64().unwrap() >= 1);
    assert_eq!(holder(&report, 0, b.pid)["class"], "active");
    // Idle is informational: diagnose stays clean.
    capture_incident(&world, Path_::Nvml);
    Vg::new(&world, Path_::Nvml)
        .args(["--config".as_ref(), cfg.as_os_str(), "diagnose".as_ref()])
        .code(0);
}

#[test]
fn a_lost_gpu_is_reported_and_the_others_still_are() {
    let world = World::new(2);
    let mut s = spec(&world, json!([hold(0, 2)]));
    s["new_session"] = json!(true);
    let h = start(&world, &["python3", "serve.py"], s);
    world.update(|st| {
        st.gpus[1]
            .faults
            .push(fault("nvmlDeviceGetMemoryInfo_v2", 15, None))
    });
    capture_incident(&world, Path_::Nvml);
    for path in [Path_::Nvml, Path_::InProcess] {
        // Everything readable is printed; the lost GPU makes the exit code 2.
        let report = Vg::new(&world, path).args(["status", "--json"]).json(2);
        assert_eq!(holder(&report, 0, h.pid)["class"], "active");
        assert_eq!(report["gpus"][1]["failure"]["code"], json!(15));
        let text = stdout(&Vg::new(&world, path).args(["status"]).code(2));
        assert!(
            text.contains("error: nvmlDeviceGetMemoryInfo_v2: GPU is lost (code 15)"),
            "{text}"
        );
        let d = stdout(&Vg::new(&world, path).args(["diagnose"]).code(1));
        assert!(d.contains("dmesg | grep -i xid"), "{d}");
        // Only the GPUs asked about count.
        Vg::new(&world, path).args(["status", "--gpu", "0"]).code(0);
    }
}

#[test]
fn a_gpu_whose_process_list_cannot_be_read_makes_status_exit_2() {
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 2)]));
    s["new_session"] = json!(true);
    let _h = start(&world, &["python3", "serve.py"], s);
    world.update(|st| {
        st.gpus[0]
            .faults
            .push(fault("nvmlDeviceGetComputeRunningProcesses_v3", 15, None))
    });
    for path in [Path_::Nvml, Path_::InProcess] {
        // Whose memory it is cannot be told: printed, and an error (it was exit 0).
        let report = Vg::new(&world, path).args(["status", "--json"]).json(2);
        assert_eq!(
            report["gpus"][0]["process_list"]["state"], "unavailable",
            "{report:#}"
        );
        let text = stdout(&Vg::new(&world, path).args(["status"]).code(2));
        assert!(!text.contains("accounted for by a live job"), "{text}");
    }
}

/// Issue 26: a GPU whose driver calls block (30 s in `nvmlDeviceGetMemoryInfo_v2`) held
/// `status` for 20-30 s with no deadline. Now each call waits at most `[driver]
/// call_timeout`: the stalled GPU is reported as not answering, the other is shown, and
/// `status` and `diagnose` exit non-zero; through the simulator's NVML library (whose stall
/// holds no lock other GPUs' calls need, as a real driver's per-GPU stall) and in-process.
#[test]
fn a_stalled_gpu_is_reported_as_not_answering_and_the_others_still_are() {
    let world = World::new(2);
    let mut s = spec(&world, json!([hold(0, 2)]));
    s["new_session"] = json!(true);
    let h = start(&world, &["python3", "serve.py"], s);
    world.update(|st| {
        st.gpus[1]
            .faults
            .push(fault("nvmlDeviceGetMemoryInfo_v2", 0, Some(30_000)))
    });
    let cfg = config(&world, "[driver]\ncall_timeout = \"1s\"\n");
    let with_config = |path, args: &[&str]| {
        Vg::new(&world, path)
            .arg_path("--config", &cfg)
            .args(args.iter().copied())
    };
    for path in [Path_::Nvml, Path_::InProcess] {
        let started = std::time::Instant::now();
        let report = with_config(path, &["status", "--json", "--sample", "0s"]).json(2);
        let took = started.elapsed();
        assert!(
            took < std::time::Duration::from_secs(15),
            "status waited {took:?} for a stalled GPU"
        );
        assert_eq!(holder(&report, 0, h.pid)["class"], "active", "{report:#}");
        let failure = &report["gpus"][1]["failure"];
        assert!(
            failure["message"]
                .as_str()
                .is_some_and(|m| m.contains("not answering")),
            "{report:#}"
        );
        let text = stdout(&with_config(path, &["status", "--sample", "0s"]).code(2));
        assert!(text.contains("not answering"), "{text}");
        assert!(!text.contains("accounted for by a live job"), "{text}");
        let (d, _) = with_config(path, &["diagnose", "--sample", "0s"]).output();
        assert_ne!(d.status.code(), Some(0), "diagnose of a stalled GPU");
    }
}

/// A driver whose every call blocks (the device count, here) is one clear error and exit
/// 2 after the timeout, not a hang.
#[test]
fn a_driver_that_does_not_answer_is_an_error_after_the_call_timeout() {
    let world = World::new(1);
    world.update(|st| {
        st.faults
            .push(fault("nvmlDeviceGetCount_v2", 0, Some(30_000)))
    });
    let cfg = config(&world, "[driver]\ncall_timeout = \"1s\"\n");
    for path in [Path_::Nvml, Path_::InProcess] {
        let started = std::time::Instant::now();
        let out = Vg::new(&world, path)
            .args(["--config".as_ref(), cfg.as_os_str(), "status".as_ref()])
            .code(2);
        assert!(started.elapsed() < std::time::Duration::from_secs(15));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not answering"), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    }
}

#[test]
fn a_snapshot_replays_to_the_same_report() {
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 2)]));
    s["group_leader"] = json!(true);
    s["workers"] = json!([{ "argv": ["python3", "w.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000, "holds": [hold(0, 1)] } }]);
    let mut h = start(&world, &["python3", "train.py"], s);
    h.crash();
    let snap = Vg::new(&world, Path_::Nvml).args(["snapshot"]).code(0);
    let file = world.dir.path().join("incident.json");
    std::fs::write(&file, &snap.stdout).unwrap();
    let live: serde_json::Value = serde_json::from_slice(
        &Vg::new(&world, Path_::Nvml)
            .args(["status", "--json"])
            .code(0)
            .stdout,
    )
    .unwrap();
    let replayed = Vg::bare()
        .args([
            "--replay".as_ref(),
            file.as_os_str(),
            "status".as_ref(),
            "--json".as_ref(),
        ])
        .json(0);
    assert_eq!(holder(&replayed, 0, h.workers[0])["class"], "orphan");
    // The whole report is the same, but for what the clock decides: when it was taken and
    // how long the two runs watched the processes for signs of work (and so how long idle),
    // and how old the processes were when each run looked.
    fn timeless(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                for k in ["taken_at_ms", "window_ms", "idle_secs", "age_secs"] {
                    if let Some(x) = m.get_mut(k) {
                        *x = json!(0);
                    }
                }
                if let Some(serde_json::Value::Array(ev)) = m.get_mut("evidence") {
                    ev.retain(|e| !e.as_str().is_some_and(|e| e.starts_with("no sign of work")));
                }
                m.values_mut().for_each(timeless);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(timeless),
            _ => {}
        }
    }
    // And for what the rest of the machine does meanwhile: its free RAM, memory pressure and
    // shared memory in use.
    fn without_the_machines_moment(v: &mut serde_json::Value) {
        let host = &mut v["host"];
        host["mem_available_bytes"] = json!(0);
        host["pressure"] = json!(null);
        for d in host["shm_dirs"].as_array_mut().into_iter().flatten() {
            d["used_bytes"] = json!(0);
        }
    }
    let (mut replayed, mut live) = (replayed, live);
    timeless(&mut replayed);
    timeless(&mut live);
    without_the_machines_moment(&mut replayed);
    without_the_machines_moment(&mut live);
    assert!(
        replayed["host"]["dead_jobs"][0]["rss_bytes"]
            .as_u64()
            .unwrap()
            > 0,
        "{replayed}"
    );
    assert_eq!(replayed, live);
}

#[test]
fn bad_inputs_give_one_clear_line_and_exit_2() {
    let world = World::new(1);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "--nvml-lib".into(),
                "/nonexistent/libnvidia-ml.so.1".into(),
                "status".into(),
            ],
            "no NVIDIA driver: /nonexistent/libnvidia-ml.so.1 could not be loaded",
        ),
        (
            vec![
                "--sim".into(),
                "/nonexistent/state.json".into(),
                "status".into(),
            ],
            "reading simulator state /nonexistent/state.json: No such file or directory",
        ),
        (
            vec![
                "--sim".into(),
                world.state_path().display().to_string(),
                "--proc-root".into(),
                "/nonexistent-proc".into(),
                "status".into(),
            ],
            "/nonexistent-proc: No such file or directory",
        ),
        (
            vec![
                "--config".into(),
                "/nonexistent/config.toml".into(),
                "status".into(),
            ],
            "config /nonexistent/config.toml: cannot be read",
        ),
        (
            vec![
                "--replay".into(),
                "/nonexistent/snap.json".into(),
                "status".into(),
            ],
            "reading snapshot /nonexistent/snap.json",
        ),
    ];
    for (args, expected) in cases {
        let out = Vg::bare().args(&args).code(2);
        let err = stderr(&out);
        assert!(err.contains(expected), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let bad_state = world.dir.path().join("bad.json");
    std::fs::write(&bad_state, "{\n  \"dev_dir\": \"/tmp\",\n  \"gpus\": [ { \"uuid\": \"GPU-1\", \"total_bytes\": \"lots\" } ]\n}\n").unwrap();
    let err = stderr(
        &Vg::bare()
            .args(["--sim".as_ref(), bad_state.as_os_str(), "diagnose".as_ref()])
            .code(2),
    );
    assert!(err.contains("bad.json") && err.contains("line 3"), "{err}");
    let bad_cfg = config(&world, "[policy]\ntolerance = \"lots\"\n");
    let err = stderr(
        &Vg::new(&world, Path_::InProcess)
            .args(["--config".as_ref(), bad_cfg.as_os_str(), "status".as_ref()])
            .code(2),
    );
    assert!(
        err.contains("policy.tolerance") && err.contains("lots"),
        "{err}"
    );
}

#[test]
fn the_demo_with_reclaim_frees_the_orphans_then_clears_the_blocker_and_resets() {
    let text = stdout(&Vg::bare().args(["demo", "--reclaim"]).code(0));
    assert!(
        text.contains("GPU 0: 32.0 GiB freed; the driver released it"),
        "{text}"
    );
    // The default reclaim leaves the idle kernel, so the reset is refused; diagnose named
    // the command for that blocker, and the demo runs it: the reset goes through.
    assert!(text.contains("reset GPU 1: refused"), "{text}");
    assert!(
        text.contains("$ vramguard reclaim --gpu 1 --include idle --idle-for 1.0s"),
        "diagnose names the blocker's command: {text}"
    );
    assert!(
        text.contains("reset GPU 1: reset done, memory back to baseline"),
        "{text}"
    );
    assert!(
        text.contains("result: every byte of ghost memory on the selected GPUs is free"),
        "{text}"
    );
    assert!(
        text.contains("stopped the 1 demo processes"),
        "the reclaimed ones were gone already: {text}"
    );
}

#[test]
fn the_demo_runs_and_cleans_up_after_itself() {
    let out = Vg::bare().args(["demo"]).code(0);
    let text = stdout(&out);
    for expected in [
        "orphan",
        "hidden",
        "idle",
        "residue",
        "$ vramguard reclaim --gpu 0",
        "stopped the 5 demo processes still running",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
    // Every pid the demo printed is gone.
    let pids: Vec<u32> = text
        .lines()
        .filter(|l| l.trim_start().starts_with("started"))
        .flat_map(|l| {
            l.split(|c: char| !c.is_ascii_digit())
                .filter_map(|w| w.parse::<u32>().ok())
        })
        .filter(|p| *p > 100)
        .collect();
    assert!(pids.len() >= 7, "{pids:?}");
    for p in pids {
        wait_until(5, &format!("demo process {p} to be gone"), || !alive(p));
    }
}

#[test]
fn without_root_the_missing_facts_are_named() {
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 2)]));
    s["new_session"] = json!(true);
    let h = start(&world, &["python3", "serve.py"], s);
    // Let the simulator record its first sightings while we are root, then open the world
    // to an unprivileged user.
    Vg::new(&world, Path_::InProcess).args(["status"]).code(0);
    world.open_to_everyone();
    let out = vg_wrapped("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            BIN,
            "--sim",
        ])
        .arg(world.state_path())
        .args(["diagnose", "--json"])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    // The one holder serves: the verdict is clean (0); what an unprivileged user cannot see
    // is a warning of the check-list, not something that needs attention.
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let d: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d["verdict"]["clean"], true, "{:#}", d["verdict"]);
    let limits = d["report"]["limitations"].to_string();
    assert!(limits.contains("run as root"), "{limits}");
    let vis = d["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "visibility")
        .unwrap();
    assert_eq!(vis["status"], "warn");
    // The listed holder is still attributed, from the driver's word.
    assert_eq!(holder(&d, 0, h.pid)["class"], "active");
}

#[test]
fn a_double_forked_worker_is_an_orphan_only_once_its_group_leader_dies() {
    use std::os::unix::process::CommandExt;
    let world = World::new(1);
    let ready = world.dir.path().join("ready-double-fork");
    let mut s = spec(&world, json!([hold(0, 3)]));
    s["ready_file"] = json!(ready);
    // sh leads a new process group; `( vramguard & )` double-forks the holder, whose parent
    // (the subshell) exits at once: the holder is re-parented to init, in sh's group.
    let mut leader = Reaped(
        std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("( exec {BIN} & ) ; exec sleep 60"))
            .env("VRAMGUARD_HOLDER", s.to_string())
            .process_group(0)
            .spawn()
            .unwrap(),
    );
    let mut pid = 0;
    wait_until(20, "the double-forked holder", || {
        pid = std::fs::read_to_string(&ready)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["pid"].as_u64())
            .unwrap_or(0) as u32;
        pid != 0
    });
    let mut cleanup = Spawned::default();
    cleanup.track(pid);
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let h = holder(&report, 0, pid);
    // Re-parented by the double fork: to init, or to a subreaper if the test runs under one.
    assert_ne!(h["ppid"], json!(leader.pid()));
    assert_ne!(h["ppid"], json!(std::process::id()));
    assert_eq!(h["pgid"], json!(leader.pid()));
    assert_eq!(h["class"], "active", "its group leader lives: {h:#}");
    assert!(h["evidence"].to_string().contains("is alive"), "{h:#}");

    leader.0.kill().unwrap();
    leader.0.wait().unwrap();
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let h = holder(&report, 0, pid);
    assert_eq!(h["class"], "orphan", "{h:#}");
    assert_eq!(h["dead_job"]["leader_pid"], json!(leader.pid()));
}

#[test]
fn sim_hold_started_as_a_session_leader_holds_its_memory() {
    // `setsid vramguard sim hold …` made it a session leader, which may not change its
    // process group: holding must not depend on that.
    let world = World::new(1);
    let child = Reaped(
        std::process::Command::new("setsid")
            .arg(BIN)
            .arg("--sim")
            .arg(world.state_path())
            .args([
                "sim",
                "hold",
                "--gpu",
                "0",
                "--bytes",
                "2GiB",
                "--lifetime",
                "30s",
            ])
            .stdin(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    // setsid runs it in its own process (not a group leader, it need not fork).
    let pid = child.pid();
    wait_until(10, "the session leader's 2 GiB to be listed", || {
        let report = Vg::new(&world, Path_::InProcess)
            .args(["status", "--json", "--sample", "0"])
            .json(0);
        report["gpus"][0]["holders"].as_array().is_some_and(|h| {
            h.iter()
                .any(|h| h["pid"] == pid && h["used_bytes"] == json!(2 * GIB))
        })
    });
}

/// The children `pid` started or forked (its main thread's `children` list).
fn children_of(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// `sim hold` gives both launch patterns of issue 25: `--forked-workers` (DataLoader workers
/// forked after the context exists: they keep it, and the driver keeps listing the SIGKILLed
/// holder's pid with it) and `--workers` (spawned, as torch.multiprocessing does: each its own
/// listed context; the holder's goes with it).
#[test]
fn sim_hold_forked_workers_keep_its_context_and_spawned_workers_have_their_own() {
    let world = World::new(1);
    let hold = |extra: &[&str]| {
        Reaped(
            vg_command()
                .arg("--sim")
                .arg(world.state_path())
                .args(["sim", "hold", "--gpu", "0", "--bytes", "2GiB"])
                .args(["--worker-bytes", "1GiB", "--lifetime", "30s"])
                .args(extra)
                .stdin(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let used = || {
        Vg::new(&world, Path_::InProcess)
            .args(["status", "--json", "--sample", "0"])
            .json(0)["gpus"][0]["memory"]["used"]
            .clone()
    };
    let mut cleanup = Spawned::default();

    let mut h = hold(&["--forked-workers", "1"]);
    let pid = h.pid();
    wait_until(10, "the forked worker and the 2 GiB", || {
        children_of(pid).len() == 1 && used() == json!(2 * GIB)
    });
    let worker = children_of(pid)[0];
    cleanup.track(worker);
    h.0.kill().unwrap();
    h.0.wait().unwrap();
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(report["gpus"][0]["memory"]["used"], json!(2 * GIB));
    let dead = holder(&report, 0, pid);
    assert_eq!(dead["listed"], json!(true), "{dead:#}");
    assert_eq!(dead["used_bytes"], json!(2 * GIB), "{dead:#}");
    assert_eq!(holder(&report, 0, worker)["listed"], json!(false));
    cleanup.kill_all();
    wait_until(10, "the memory to come back", || used() == json!(0));

    let mut h = hold(&["--workers", "1"]);
    let pid = h.pid();
    wait_until(10, "the spawned worker's own 1 GiB", || {
        used() == json!(3 * GIB)
    });
    let worker = children_of(pid)[0];
    cleanup.track(worker);
    h.0.kill().unwrap();
    h.0.wait().unwrap();
    wait_until(10, "the holder's own 2 GiB to go with it", || {
        used() == json!(GIB)
    });
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let listed: Vec<&Value> = report["gpus"][0]["holders"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h["listed"] == json!(true))
        .map(|h| &h["pid"])
        .collect();
    assert_eq!(listed, vec![&json!(worker)], "{report:#}");
}

#[test]
fn sim_hold_whose_session_leader_is_outside_its_pid_namespace_holds_and_exits_cleanly() {
    // In a new PID namespace the session's leader is invisible and getsid answers 0 (CI
    // runners and containers start processes so): taking the process group must not trip on
    // it.
    let world = World::new(1);
    let out = vg_wrapped("unshare")
        .args(["--pid", "--fork", "--kill-child"])
        .arg(BIN)
        .arg("--sim")
        .arg(world.state_path())
        .args([
            "sim",
            "hold",
            "--gpu",
            "0",
            "--bytes",
            "1GiB",
            "--lifetime",
            "1s",
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("holds 1.0 GiB"), "{stderr}");
}

#[test]
fn dataloader_workers_forked_without_exec_keep_the_dead_trainers_memory_as_hidden_holders() {
    let world = World::new(1);
    let mut trainer_spec = spec(&world, json!([hold(0, 4)]));
    trainer_spec["group_leader"] = json!(true);
    trainer_spec["forked_workers"] = json!(2);
    let mut trainer = start(
        &world,
        &["python3", "train.py", "--workers", "2"],
        trainer_spec,
    );
    assert_eq!(trainer.workers.len(), 2);
    let leader = trainer.pid;
    trainer.crash();
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    for &w in &trainer.workers {
        let h = holder(&report, 0, w);
        assert_eq!(h["class"], "hidden", "{h:#}");
        assert_eq!(h["listed"], json!(false));
        // Forked, never exec'd: the trainer's command line, and its job.
        assert_eq!(h["command"], "python3 train.py --workers 2", "{h:#}");
        assert_eq!(h["dead_job"]["leader_pid"], json!(leader), "{h:#}");
    }
    let g0 = &report["gpus"][0];
    assert_eq!(
        g0["memory"]["used"],
        json!(4 * GIB),
        "the context outlives the trainer"
    );
    // As a real driver does (H200, driver 580.159.04), the dead trainer's pid stays listed
    // with the whole context while its workers keep it: exited, kept by its workers, ghost.
    let dead = holder(&report, 0, leader);
    assert_eq!(dead["listed"], json!(true), "{dead:#}");
    assert_eq!(dead["used_bytes"], json!(4 * GIB), "{dead:#}");
    assert_eq!(dead["class"], "exited", "{dead:#}");
    let mut workers = trainer.workers.clone();
    workers.sort_unstable();
    assert_eq!(dead["keepers"], json!(workers), "{dead:#}");
    assert_eq!(g0["ghost_bytes"], json!(4 * GIB), "{g0:#}");
    for &w in &trainer.workers {
        assert_eq!(holder(&report, 0, w)["keeps_alive"], json!(leader));
        // Forked after the context was made, they inherit the CUDA driver library's mapping.
        assert_eq!(holder(&report, 0, w)["driver_library"], "cuda");
    }
    // Once the workers are gone too, the memory is back.
    for &w in &trainer.workers {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &w.to_string()])
            .status();
    }
    wait_until(10, "the memory to come back", || {
        Vg::new(&world, Path_::InProcess)
            .args(["status", "--json", "--sample", "0"])
            .json(0)["gpus"][0]["memory"]["used"]
            == json!(0)
    });
}

#[test]
fn device_files_received_over_a_unix_socket_keep_the_senders_memory() {
    let world = World::new(1);
    let socket = world.dir.path().join("ipc.sock");
    let mut sender_spec = spec(&world, json!([hold(0, 3)]));
    sender_spec["new_session"] = json!(true);
    sender_spec["share_fds_on"] = json!(socket);
    let mut sender = start(&world, &["python3", "serve.py"], sender_spec);
    // An unrelated process (its own session) that received the files and never opened them.
    let mut receiver_spec = spec(&world, json!([]));
    receiver_spec["new_session"] = json!(true);
    receiver_spec["receive_fds_from"] = json!(socket);
    let receiver = start(&world, &["python3", "consumer.py"], receiver_spec);
    sender.crash();
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let g0 = &report["gpus"][0];
    assert_eq!(
        g0["memory"]["used"],
        json!(3 * GIB),
        "kept by the receiver: {g0:#}"
    );
    let h = holder(&report, 0, receiver.pid);
    assert_eq!(h["class"], "hidden", "{h:#}");
    assert_eq!(h["listed"], json!(false));
    assert!(
        h["device_files"].to_string().contains("uvm"),
        "it holds the CUDA files it received: {h:#}"
    );
    assert_eq!(
        h["driver_library"], "neither",
        "received files come without the library: {h:#}"
    );
    assert_eq!(h["action"]["reclaimable"], json!(false), "its job is alive");
    // The received descriptors carry the sender's context: the dead sender stays listed with
    // it, as a real driver lists a dead creator whose context lives on (issue 25).
    let dead = holder(&report, 0, sender.pid);
    assert_eq!(dead["listed"], json!(true), "{dead:#}");
    assert_eq!(dead["used_bytes"], json!(3 * GIB), "{dead:#}");
    // Nothing ties the receiver to the sender but the files: a possible keeper, named, and
    // never reclaimed by default (its own job lives).
    assert_eq!(dead["class"], "exited", "{dead:#}");
    assert_eq!(dead["keepers"], json!([receiver.pid]), "{dead:#}");
    assert!(
        dead["evidence"]
            .to_string()
            .contains("possibly kept alive by"),
        "{dead:#}"
    );
    drop(receiver);
    wait_until(10, "the memory to come back", || {
        Vg::new(&world, Path_::InProcess)
            .args(["status", "--json", "--sample", "0"])
            .json(0)["gpus"][0]["memory"]["used"]
            == json!(0)
    });
}

/// A GPU whose driver returns implausible process records (`_v3` records of the wrong size on
/// a driver vramguard cannot recognise) and whose `_v2` list, the fallback, fails: the list is
/// unreliable and its implausible records are dropped. A process computing there
/// may be among them, its utilization unseen, so no holder of that GPU is reclaimed on
/// idleness, not even a dead job's orphan. On a sound list, the same orphan is.
#[test]
fn an_orphan_on_a_gpu_whose_process_list_is_unreliable_is_not_planned() {
    for unreliable in [false, true] {
        let world = World::new(1);
        let clients: Vec<_> = (0..2)
            .map(|_| world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 120))
            .collect();
        world.update(|s| {
            for c in &clients {
                let mut a = allocation(0, c.pid(), GIB);
                a.kind = vramguard_sim::state::AllocationKind::Mps;
                s.allocations.push(a);
            }
            if unreliable {
                s.gpus[0]
                    .quirks
                    .push(vramguard_sim::state::Quirk::V3Records32Bytes);
                // NVML_ERROR_UNKNOWN
                s.gpus[0].faults.push(fault(
                    "nvmlDeviceGetMPSComputeRunningProcesses_v2",
                    999,
                    None,
                ));
            }
        });
        let trainer = crashed_trainer(&world);
        let worker = trainer.workers[0];
        let report = Vg::new(&world, Path_::Nvml)
            .args(["status", "--json"])
            .json(0);
        let w = holder(&report, 0, worker);
        let plan = Vg::new(&world, Path_::Nvml)
            .args(["reclaim", "--dry-run", "--json"])
            .json(0);
        let planned = plan["plan"]["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|j| j["targets"].as_array().unwrap().iter())
            .any(|t| t["pid"] == json!(worker));
        if unreliable {
            assert!(
                report.to_string().contains("implausible record"),
                "the list is unreliable: {report:#}"
            );
            assert_eq!(w["action"]["reclaimable"], json!(false), "{w:#}");
            assert!(
                w.to_string().contains("its process list is unreliable"),
                "{w:#}"
            );
            assert!(!planned, "{plan:#}");
        } else {
            assert_eq!(w["class"], "orphan", "{w:#}");
            assert!(planned, "{plan:#}");
        }
        drop(trainer);
    }
}
