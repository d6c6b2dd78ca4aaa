//! The catalogue of launch patterns (README: "How jobs are told apart"): each pattern started
//! for real — shells, `nohup`, `setsid`, job control, cgroups named like units, containers and
//! Slurm steps, PID namespaces — on the simulated driver, with the class vramguard gives each
//! process and whether a plain `vramguard reclaim` would act on it. Two mixed incidents then
//! run `reclaim --yes` and the agent's automatic reclaim for real: only the idle orphans of
//! dead jobs may die.

mod common;
use common::*;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A holder's spec: `gib` on GPU 0, optionally busy on the GPU (`sm`) and the CPU (`cpu`).
fn holder_spec(world: &World, gib: u64, sm: u32, cpu: u32) -> Value {
    json!({
        "state": world.state_path(),
        "lifetime_ms": 120_000,
        "holds": [{ "gpu": 0, "bytes": gib * GIB, "sm_util": sm }],
        "cpu_percent": cpu,
    })
}

/// What a launch script started.
struct Launched {
    /// The script's shell (its own process group, as an interactive shell's job control
    /// gives a script it runs).
    script: Reaped,
    /// Each holder's pid and its workers' pids, in the order of the specs.
    holders: Vec<(u32, Vec<u32>)>,
    _cleanup: Spawned,
}

impl Launched {
    fn pid(&self, i: usize) -> u32 {
        self.holders[i].0
    }
    /// Waits for the script to exit and reaps it: its process group has no leader from then on.
    fn script_exits(&mut self) {
        let status = self.script.0.wait().unwrap();
        assert!(status.success(), "launch script failed: {status:?}");
    }
}

/// Runs `script` with bash in its own process group. It sees `$VG` (the vramguard binary) and
/// `$H0`, `$H1`… (the holder specs, JSON): `VRAMGUARD_HOLDER="$H0" exec -a python3 "$VG"`
/// starts holder 0 under the name `python3`.
fn launch(world: &World, script: &str, specs: Vec<Value>) -> Launched {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = world.dir.path().join(format!("launch-{n}.sh"));
    std::fs::write(&path, script).unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg(&path)
        .env("VG", BIN)
        .env_remove("VRAMGUARD_HOLDER")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .process_group(0);
    let mut ready_files = Vec::new();
    for (i, mut spec) in specs.into_iter().enumerate() {
        let ready = world.dir.path().join(format!("ready-{n}-{i}"));
        spec["ready_file"] = json!(ready);
        cmd.env(format!("H{i}"), spec.to_string());
        ready_files.push(ready);
    }
    let script = Reaped(cmd.spawn().expect("bash"));
    let mut cleanup = Spawned::default();
    let mut holders = Vec::new();
    for ready in ready_files {
        let (pid, workers) = wait_ready(&ready, script.pid());
        cleanup.track(pid);
        for w in &workers {
            cleanup.track(*w);
        }
        holders.push((pid, workers));
    }
    Launched {
        script,
        holders,
        _cleanup: cleanup,
    }
}

/// `status --json` and the default plan (`reclaim --dry-run --json`, no `--include`).
fn look(world: &World) -> (Value, BTreeSet<u32>) {
    capture_incident(world, Path_::Nvml);
    let status = Vg::new(world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let plan = Vg::new(world, Path_::Nvml)
        .args(["reclaim", "--dry-run", "--json"])
        .json(0);
    let targets = plan["plan"]["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|j| j["targets"].as_array().unwrap().iter())
        .map(|t| t["pid"].as_u64().unwrap() as u32)
        .collect();
    (status, targets)
}

fn class_of(status: &Value, pid: u32) -> String {
    holder(status, 0, pid)["class"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Runs a script that joins the cgroup of `procs`, starts one idle holder of `gib` with
/// `nohup … &` and exits: a holder whose job leader is gone, inside that cgroup.
fn nohup_in_cgroup(world: &World, procs: &Path, gib: u64) -> Launched {
    let script = format!(
        "echo $$ > {}\n{}exit 0\n",
        procs.display(),
        nohup(0, "train.py")
    );
    let mut l = launch(world, &script, vec![holder_spec(world, gib, 0, 0)]);
    l.script_exits();
    l
}

/// The command that starts holder `i` in the background, `nohup`ed.
fn nohup(i: usize, name: &str) -> String {
    format!(
        "VRAMGUARD_HOLDER=\"$H{i}\" nohup bash -c 'exec -a python3 \"$VG\" {name}' >/dev/null 2>&1 &\n"
    )
}

#[test]
fn nohup_from_a_script_busy_is_detached_and_idle_is_orphan() {
    let world = World::new(1);
    // run.sh, started from an interactive shell: nohup python train.py &; exit 0.
    let script = format!("{}{}exit 0\n", nohup(0, "train.py"), nohup(1, "train.py"));
    let mut l = launch(
        &world,
        &script,
        vec![holder_spec(&world, 8, 87, 0), holder_spec(&world, 4, 0, 0)],
    );
    l.script_exits();
    let (busy, idle) = (l.pid(0), l.pid(1));
    let (status, targets) = look(&world);
    let h = holder(&status, 0, busy);
    assert_eq!(h["class"], "detached", "{h:#}");
    assert_eq!(h["job"]["label"], format!("pgid:{}", l.script.pid()));
    assert_eq!(h["job"]["alive"], json!(false));
    assert_eq!(h["work"]["state"], "working");
    assert!(
        h["evidence"]
            .to_string()
            .contains("87 % utilization on GPU 0"),
        "{h:#}"
    );
    assert_eq!(class_of(&status, idle), "orphan");
    assert_eq!(holder(&status, 0, idle)["work"]["state"], "idle");
    assert_eq!(status["gpus"][0]["ghost_bytes"], json!(4 * GIB));
    assert_eq!(targets, BTreeSet::from([idle]));

    // Asked for by name, the detached one is planned, under a warning.
    let out = Vg::new(&world, Path_::Nvml)
        .args(["reclaim", "--dry-run", "--include", "orphan,detached"])
        .code(0);
    let text = stdout(&out);
    assert!(
        text.contains(&format!(
            "WARNING: pid {busy} (python3) is detached, not dead"
        )),
        "{text}"
    );
    assert!(text.contains("87 % utilization on GPU 0"), "{text}");
    // Without a sampling window, nothing whose job is gone is a target: work is unknown.
    let blind = Vg::new(&world, Path_::Nvml)
        .args(["reclaim", "--dry-run", "--json", "--sample", "0"])
        .json(0);
    assert!(
        blind["plan"]["jobs"].as_array().unwrap().is_empty(),
        "{blind:#}"
    );
    assert!(
        blind["plan"]["left_alone"]
            .to_string()
            .contains("whether it still works is unknown"),
        "{blind:#}"
    );
    let bad = Vg::new(&world, Path_::Nvml)
        .args(["status", "--sample", "2h"])
        .code(2);
    assert!(stderr(&bad).contains("10m"), "{}", stderr(&bad));
}

/// Red team: a parent that only took an adopter's name (`printf systemd > /proc/self/comm`,
/// its executable bash) is no adopter. Its holder child's job is gone (the script that led
/// the group exited), but the parent, busy, is of that job's tree: the child is `detached`
/// and no target. Taken for an adopter, the walk stopped at the child, and the child, idle
/// itself, was an orphan and a target.
#[test]
fn a_parent_that_took_an_adopters_name_keeps_its_childs_job_whole() {
    let world = World::new(1);
    let script = "bash -c 'printf systemd > /proc/$$/comm\n\
                  VRAMGUARD_HOLDER=\"$H0\" bash -c '\\''exec -a python3 \"$VG\" train.py'\\'' &\n\
                  while :; do :; done' &\nexit 0\n";
    let mut l = launch(&world, script, vec![holder_spec(&world, 4, 0, 0)]);
    l.script_exits();
    let child = l.pid(0);
    let parent = ppid_of(child).expect("the holder's parent");
    let mut cleanup = Spawned::default();
    cleanup.track(parent);
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{parent}/comm"))
            .unwrap()
            .trim(),
        "systemd"
    );
    let (status, targets) = look(&world);
    let h = holder(&status, 0, child);
    assert_eq!(h["class"], "detached", "{h:#}");
    assert_eq!(h["work"]["state"], "working", "{h:#}");
    assert!(targets.is_empty(), "{targets:?}");
}

/// Red team: a script started a data server and a trainer in the background and was killed;
/// each was re-parented to init on its own. They are one job (the script's process group):
/// the trainer, idle while the busy server works, is `detached`, no target. Counted by its
/// own tree alone, it was an orphan and a target.
#[test]
fn a_dead_groups_working_member_elsewhere_keeps_its_idle_holder_out_of_the_plan() {
    let world = World::new(1);
    let server_pid = world.dir.path().join("server.pid");
    let script = format!(
        "bash -c 'while :; do :; done' &\necho $! > {}\n{}exit 0\n",
        server_pid.display(),
        nohup(0, "train.py")
    );
    let mut l = launch(&world, &script, vec![holder_spec(&world, 4, 0, 0)]);
    l.script_exits();
    let server: u32 = std::fs::read_to_string(&server_pid)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut cleanup = Spawned::default();
    cleanup.track(server);
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["class"], "detached", "{h:#}");
    assert!(
        h["evidence"]
            .to_string()
            .contains(&format!("{server} (bash) of its job")),
        "{h:#}"
    );
    assert!(targets.is_empty(), "{targets:?}");
}

#[test]
fn a_server_started_with_ampersand_in_start_sh_that_uses_cpu_is_detached() {
    let world = World::new(1);
    let script = "VRAMGUARD_HOLDER=\"$H0\" bash -c 'exec -a python3 \"$VG\" serve.py' &\nexit 0\n";
    let mut l = launch(&world, script, vec![holder_spec(&world, 6, 0, 30)]);
    l.script_exits();
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["class"], "detached", "{h:#}");
    assert!(h["evidence"].to_string().contains("of a CPU core"), "{h:#}");
    assert!(targets.is_empty(), "{targets:?}");
}

#[test]
fn disown_from_a_closed_shell_with_job_control_leads_its_own_group() {
    let world = World::new(1);
    // `set -m`: job control, as in an interactive shell; the job gets its own process group.
    let script = "set -m\nVRAMGUARD_HOLDER=\"$H0\" bash -c 'exec -a python3 \"$VG\" train.py' &\ndisown\nexit 0\n";
    let mut l = launch(&world, script, vec![holder_spec(&world, 4, 0, 0)]);
    l.script_exits();
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["class"], "active", "{h:#}");
    assert_eq!(h["evidence"][0], "leads its own process group");
    assert!(targets.is_empty());
}

#[test]
fn setsid_and_setsid_fork_start_their_own_job() {
    let world = World::new(1);
    let script = "VRAMGUARD_HOLDER=\"$H0\" setsid -f bash -c 'exec -a python3 \"$VG\" a.py'\n\
                  VRAMGUARD_HOLDER=\"$H1\" setsid bash -c 'exec -a python3 \"$VG\" b.py' &\nexit 0\n";
    let mut l = launch(
        &world,
        script,
        vec![holder_spec(&world, 2, 0, 0), holder_spec(&world, 2, 0, 0)],
    );
    l.script_exits();
    let (status, targets) = look(&world);
    for i in 0..2 {
        assert_eq!(class_of(&status, l.pid(i)), "active", "{status:#}");
    }
    assert!(targets.is_empty());
}

#[test]
fn a_screen_like_session_whose_window_shell_exited_keeps_its_job() {
    let world = World::new(1);
    // A session leader (the multiplexer's server) whose window shell ran the job with job
    // control and exited; the server lives on.
    let window = world.dir.path().join("window.sh");
    std::fs::write(
        &window,
        "set -m\nVRAMGUARD_HOLDER=\"$H0\" bash -c 'exec -a python3 \"$VG\" train.py' &\ndisown\nexit 0\n",
    )
    .unwrap();
    let server_file = world.dir.path().join("server.pid");
    let script = format!(
        "setsid bash -c 'bash {w}; exec sleep 60' &\necho $! > {s}\nexit 0\n",
        w = window.display(),
        s = server_file.display()
    );
    let mut l = launch(&world, &script, vec![holder_spec(&world, 3, 0, 0)]);
    l.script_exits();
    let mut server = Spawned::default();
    let pid: u32 = std::fs::read_to_string(&server_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    server.track(pid);
    assert!(alive(pid), "the server lives");
    let (status, targets) = look(&world);
    assert_eq!(class_of(&status, l.pid(0)), "active", "{status:#}");
    assert!(targets.is_empty());
}

#[test]
fn a_process_in_a_systemd_unit_belongs_to_the_unit() {
    let world = World::new(1);
    let mut cg = TestCgroup::new();
    let procs = cg.leaf("system.slice/train-job.service");
    // Orphan-shaped (its script exited) and idle: only the unit keeps it from being an orphan.
    let l = nohup_in_cgroup(&world, &procs, 4);
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["class"], "active", "{h:#}");
    assert_eq!(h["job"]["label"], "unit:train-job.service");
    assert_eq!(h["job"]["kind"], "unit");
    assert!(targets.is_empty());
}

#[test]
fn a_container_with_its_own_pid_namespace_lives_until_its_init_dies() {
    let world = World::new(1);
    let mut cg = TestCgroup::new();
    let id = "c0de".repeat(16);
    let procs = cg.leaf(&format!("system.slice/docker-{id}.scope"));
    // The container: an init in a new PID namespace that starts the job from a script that
    // exits (so the job's group leader is gone inside the container too).
    let job = world.dir.path().join("job.sh");
    std::fs::write(&job, format!("{}exit 0\n", nohup(0, "train.py"))).unwrap();
    let script = format!(
        "echo $$ > {p}\nexec unshare --pid --fork --kill-child bash -c 'bash {j}; exec sleep 120'\n",
        p = procs.display(),
        j = job.display()
    );
    let l = launch(&world, &script, vec![holder_spec(&world, 5, 0, 0)]);
    let pid = l.pid(0);
    let (status, targets) = look(&world);
    let h = holder(&status, 0, pid);
    assert_eq!(h["class"], "active", "{h:#}");
    assert_eq!(h["job"]["kind"], "container");
    assert_eq!(h["job"]["label"], format!("docker:{}", &id[..12]));
    assert_eq!(h["nspid"].as_array().unwrap().len(), 2, "{h:#}");
    assert!(targets.is_empty());

    // The container's init dies: the kernel ends its namespace, and the memory comes back.
    let init: Vec<u32> = std::fs::read_to_string(&procs)
        .unwrap()
        .lines()
        .filter_map(|l| l.parse().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/status")).is_ok_and(|s| {
                s.lines()
                    .any(|l| l.starts_with("NSpid:") && l.ends_with("\t1"))
            })
        })
        .collect();
    assert_eq!(init.len(), 1, "one namespace init");
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(init[0] as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_until(10, "the container's processes to end", || !alive(pid));
    let after = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(after["gpus"][0]["ghost_bytes"], json!(0), "{after:#}");
    drop(l);
}

#[test]
fn a_container_sharing_the_host_pid_namespace_is_taken_as_alive() {
    let world = World::new(1);
    let mut cg = TestCgroup::new();
    let id = "feed".repeat(16);
    let procs = cg.leaf(&format!("system.slice/docker-{id}.scope"));
    let script = format!(
        "echo $$ > {}\n{}exit 0\n",
        procs.display(),
        nohup(0, "train.py")
    );
    let mut l = launch(&world, &script, vec![holder_spec(&world, 2, 0, 0)]);
    l.script_exits();
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["class"], "active", "{h:#}");
    assert_eq!(h["job"]["alive"], Value::Null);
    assert!(
        h["evidence"][0]
            .as_str()
            .unwrap()
            .contains("taken as alive"),
        "{h:#}"
    );
    assert!(targets.is_empty());
}

#[test]
fn a_slurm_step_lives_while_its_step_daemon_does() {
    let world = World::new(1);
    let mut cg = TestCgroup::new();
    let job = "system.slice/slurmstepd.scope/job_4242";
    // The step daemon: a process named slurmstepd in the step's `slurm` cgroup.
    let mut stepd_spec = spec(&world, json!([]));
    stepd_spec["comm"] = json!("slurmstepd");
    stepd_spec["new_session"] = json!(true);
    let stepd = start(&world, &["slurmstepd"], stepd_spec);
    cg.enter(&format!("{job}/step_0/slurm"), stepd.pid);
    let procs = cg.leaf(&format!("{job}/step_0/user/task_0"));
    let l = nohup_in_cgroup(&world, &procs, 7);
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["class"], "active", "{h:#}");
    assert_eq!(h["job"]["label"], "slurm:4242.0");
    assert!(h["evidence"].to_string().contains("slurmstepd"), "{h:#}");
    assert!(targets.is_empty());
    assert!(cg.path(job).ends_with("job_4242"));

    // The step daemon dies: the job is over, and its idle leftover is an orphan.
    drop(stepd);
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["class"], "orphan", "{h:#}");
    assert!(
        h["evidence"]
            .to_string()
            .contains("its job slurm:4242.0 is gone"),
        "{h:#}"
    );
    assert_eq!(targets, BTreeSet::from([l.pid(0)]));
}

/// A cgroup named like a Slurm step that a user made (a subtree delegated to them: Slurm makes
/// a job's directory as root) holding no slurmstepd: the name proves no job gone. Its idle
/// holder leads its own process group, which lives, so it is no target; the same directory
/// made by root is a Slurm job whose daemon is gone, and its holder an orphan.
#[test]
fn a_slurm_named_cgroup_a_user_made_proves_no_job_gone() {
    use std::os::unix::fs::chown;
    let world = World::new(1);
    let mut cg = TestCgroup::new();
    let job = "user.slice/user-1000.slice/user@1000.service/slurm/uid_0/job_4244";
    let job_dir = cg.leaf(job).parent().unwrap().to_path_buf();
    let procs = cg.leaf(&format!("{job}/step_0"));
    chown(&job_dir, Some(1000), Some(1000)).unwrap();
    let script = format!(
        "echo $$ > {}\nVRAMGUARD_HOLDER=\"$H0\" exec -a python3 \"$VG\" train.py\n",
        procs.display()
    );
    let l = launch(&world, &script, vec![holder_spec(&world, 7, 0, 0)]);
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["class"], "active", "{h:#}");
    assert_eq!(h["job"]["label"], format!("pgid:{}", l.pid(0)), "{h:#}");
    assert!(
        h["job"]["evidence"]
            .to_string()
            .contains("named like a Slurm job's but belongs to uid 1000"),
        "{h:#}"
    );
    assert!(targets.is_empty(), "{targets:?}");

    chown(&job_dir, Some(0), Some(0)).unwrap();
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["job"]["label"], "slurm:4244.0", "{h:#}");
    assert_eq!(h["class"], "orphan", "{h:#}");
    assert_eq!(targets, BTreeSet::from([l.pid(0)]));
}

/// Slurm's cgroup/v1 plugin on a hybrid host (#31): a job's processes in
/// `freezer:/slurm_<node>/uid_0/job_N/step_batch`, its step daemon in the job's directory, and
/// the sandbox that started everything keeping a longer path in another v1 hierarchy. The
/// holders are `slurm:N.batch` (not `pgid:…`), alive while slurmstepd lives, orphans after.
#[test]
fn a_slurm_v1_job_on_a_hybrid_host_is_named_by_its_freezer_cgroup() {
    let Some(mut cg) = TestCgroup::new_v1("freezer") else {
        eprintln!("SKIPPED: no cgroup v1 freezer hierarchy here (a pure cgroup v2 host)");
        return;
    };
    let world = World::new(1);
    let job = "slurm_gpu07/uid_0/job_4243";
    let mut stepd_spec = spec(&world, json!([]));
    stepd_spec["comm"] = json!("slurmstepd");
    stepd_spec["new_session"] = json!(true);
    let stepd = start(&world, &["slurmstepd"], stepd_spec);
    cg.enter(job, stepd.pid);
    // The unified hierarchy names slurmd's unit, as on a systemd host: the v1 plugin never
    // moves anything there.
    let mut v2 = TestCgroup::new();
    v2.enter("system.slice/slurmd.service", stepd.pid);
    let procs = cg.leaf(&format!("{job}/step_batch"));
    let unit = v2.leaf("system.slice/slurmd.service");
    // task/cgroup's memory constraint: the same job directory in the memory hierarchy (mounted
    // before the freezer), with the tasks but not the step daemon.
    let mut memory = cg.same_in_v1("memory");
    let task = memory
        .as_mut()
        .map(|m| m.leaf(&format!("{job}/step_batch/task_0")));
    // The leader of the holder's process group (the script) is gone: by its process group
    // alone the holder would be an orphan of a dead job.
    let script = format!(
        "echo $$ > {}\necho $$ > {}\n{}{}exit 0\n",
        procs.display(),
        unit.display(),
        task.map(|t| format!("echo $$ > {}\n", t.display()))
            .unwrap_or_default(),
        nohup(0, "train.py")
    );
    let mut l = launch(&world, &script, vec![holder_spec(&world, 7, 0, 0)]);
    l.script_exits();
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["job"]["label"], "slurm:4243.batch", "{h:#}");
    assert_eq!(h["class"], "active", "{h:#}");
    assert!(h["evidence"].to_string().contains("slurmstepd"), "{h:#}");
    assert!(
        targets.is_empty(),
        "a live Slurm job's process is no target"
    );

    drop(stepd);
    let (status, targets) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["class"], "orphan", "{h:#}");
    assert!(
        h["evidence"]
            .to_string()
            .contains("its job slurm:4243.batch is gone"),
        "{h:#}"
    );
    assert_eq!(targets, BTreeSet::from([l.pid(0)]));
}

/// A torchrun-like agent (group leader) with two ranks: rank 0 computes, rank 1 idles.
fn torchrun(world: &World) -> Holding {
    let mut agent = spec(world, json!([]));
    agent["group_leader"] = json!(true);
    let rank = |sm: u32, cpu: u32| {
        json!({ "argv": ["python3", "-m", "torch.distributed.run"], "spec": {
            "state": world.state_path(), "lifetime_ms": 120_000, "cpu_percent": cpu,
            "holds": [{ "gpu": 0, "bytes": 10 * GIB, "sm_util": sm }] } })
    };
    agent["workers"] = json!([rank(80, 30), rank(0, 0)]);
    start(
        world,
        &["torchrun", "--nproc-per-node=2", "train.py"],
        agent,
    )
}

#[test]
fn torchrun_ranks_of_a_killed_agent_busy_detached_idle_orphan() {
    let world = World::new(1);
    let mut t = torchrun(&world);
    t.crash();
    let (status, targets) = look(&world);
    assert_eq!(class_of(&status, t.workers[0]), "detached", "{status:#}");
    assert_eq!(class_of(&status, t.workers[1]), "orphan", "{status:#}");
    assert_eq!(targets, BTreeSet::from([t.workers[1]]));
    let d = Vg::new(&world, Path_::Nvml)
        .args(["diagnose", "--json"])
        .json(1);
    let check = d["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "detached holders")
        .unwrap_or_else(|| panic!("no detached check: {d:#}"));
    assert_eq!(check["status"], "warn");
    assert!(
        check["evidence"]
            .to_string()
            .contains(&t.workers[0].to_string())
    );
}

/// A trainer (group leader) with two idle DataLoader-like workers forked from it.
fn trainer(world: &World) -> Holding {
    let mut s = spec(world, json!([hold(0, 12)]));
    s["group_leader"] = json!(true);
    let worker = json!({ "argv": ["python3", "train.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000, "comm": "pt_data_worker",
        "holds": [hold(0, 3)] } });
    s["workers"] = json!([worker.clone(), worker]);
    start(world, &["python3", "train.py"], s)
}

#[test]
fn dataloader_workers_of_a_killed_trainer_are_orphans() {
    let world = World::new(1);
    let mut t = trainer(&world);
    t.crash();
    let (status, targets) = look(&world);
    for w in &t.workers {
        assert_eq!(class_of(&status, *w), "orphan", "{status:#}");
    }
    assert_eq!(targets, t.workers.iter().copied().collect());
}

/// SIGKILLs `pid` (a trainer this test started) and waits until it is gone.
fn crash_by_pid(pid: u32) {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_until(10, "the trainer to die", || !alive(pid));
}

/// The exited trainer `trainer` as status shows it: class, keepers, bytes, and its keepers
/// as `hidden` holders that keep its context.
fn assert_exited_and_kept(status: &Value, trainer: u32, workers: &[u32], gib: u64) {
    let exited = holder(status, 0, trainer);
    assert_eq!(exited["class"], "exited", "{exited:#}");
    assert_eq!(exited["used_bytes"], json!(gib * GIB), "{exited:#}");
    let mut keepers: Vec<u32> = exited["keepers"]
        .as_array()
        .unwrap_or_else(|| panic!("no keepers: {exited:#}"))
        .iter()
        .map(|k| k.as_u64().unwrap() as u32)
        .collect();
    keepers.sort_unstable();
    let mut want = workers.to_vec();
    want.sort_unstable();
    assert_eq!(keepers, want, "{exited:#}");
    for w in workers {
        let h = holder(status, 0, *w);
        assert_eq!(h["class"], "hidden", "{h:#}");
        assert_eq!(h["keeps_alive"], json!(trainer), "{h:#}");
        // Its verdict rests on work: it was watched over the sampling window.
        assert!(h["cpu_millicores"].as_u64().is_some(), "{h:#}");
        assert_eq!(h["work"]["state"], "idle", "{h:#}");
    }
    assert_eq!(
        status["gpus"][0]["ghost_bytes"],
        json!(gib * GIB),
        "{status:#}"
    );
}

#[test]
fn forked_workers_keep_a_sigkilled_trainers_context_until_reclaimed() {
    // The real H200's seed case: `setsid python3 train.py`, 12 GiB, two workers fork()ed
    // after cuInit, the trainer SIGKILLed. The driver keeps listing the dead trainer.
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 12)]));
    s["group_leader"] = json!(true);
    s["forked_workers"] = json!(2);
    let mut t = start(&world, &["python3", "train.py"], s);
    let workers = t.workers.clone();
    assert_eq!(workers.len(), 2);
    t.crash();
    let (status, targets) = look(&world);
    assert_exited_and_kept(&status, t.pid, &workers, 12);
    assert_eq!(targets, workers.iter().copied().collect());
    let (signalled, out) = reclaim_yes(&world);
    assert_eq!(signalled, workers.iter().copied().collect(), "{out:#}");
    for w in &workers {
        assert!(!alive(*w), "keeper {w} survived: {out:#}");
    }
    // The last keeper's exit gives the memory back: no holder, nothing used.
    let status = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(status["gpus"][0]["holders"], json!([]), "{status:#}");
    assert_eq!(status["gpus"][0]["memory"]["used"], json!(0), "{status:#}");
}

#[test]
fn forked_workers_of_a_trainer_killed_under_a_live_script_are_reclaimed_when_asked() {
    // A batch script without job control starts the trainer (same process group), which
    // forks two workers; the trainer is SIGKILLed and the script goes on. Looked at only
    // afterwards, nothing but their re-parenting ties the workers to the dead trainer (the
    // only exited pid listed), which would fit an idle process of any live job there, even
    // another user's: the memory is ghost and the workers are named, but they are reclaimed
    // only by the command the report gives, which names the job and asks for keepers.
    let world = World::new(1);
    let mut trainer = holder_spec(&world, 6, 0, 0);
    trainer["forked_workers"] = json!(2);
    let script = format!("{}while :; do sleep 0.2; done\n", nohup(0, "train.py"));
    let l = launch(&world, &script, vec![trainer]);
    let (pid, workers) = l.holders[0].clone();
    crash_by_pid(pid);
    let (status, targets) = look(&world);
    assert_exited_and_kept(&status, pid, &workers, 6);
    let exited = holder(&status, 0, pid);
    let job = format!("pgid:{}", l.script.pid());
    assert_eq!(
        exited["job"]["label"],
        json!(job),
        "the script's job lives: {exited:#}"
    );
    assert!(exited["dead_job"].is_null(), "{exited:#}");
    assert!(targets.is_empty(), "not by default: {targets:?}");
    let command = format!("vramguard reclaim --gpu 0 --job {job} --include keepers");
    for w in &workers {
        let k = holder(&status, 0, *w);
        assert_eq!(k["keeps_alive_unconfirmed"], json!(true), "{k:#}");
        assert_eq!(k["action"]["command"], json!(command), "{k:#}");
    }
    let audit = world.dir.path().join("audit.jsonl");
    let out = Vg::new(&world, Path_::Nvml)
        .args(command.split(' ').skip(1))
        .args(["--yes", "--json", "--grace", "2s"])
        .arg_path("--audit-log", &audit)
        .json(0);
    let signalled: BTreeSet<u32> = out["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["pid"].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(signalled, workers.iter().copied().collect(), "{out:#}");
    for w in &workers {
        assert!(!alive(*w), "keeper {w} survived");
    }
    assert!(alive(l.script.pid()), "the script was touched");
    let status = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(status["gpus"][0]["memory"]["used"], json!(0), "{status:#}");
}

/// The same incident watched by the agent from before the kill: it saw the workers forked by
/// the trainer, and the trainer leave with the start time it had then. That ties them to the
/// exited pid directly, so they are its keepers to reclaim by default (`status`'s view, the
/// planner's too) while the script runs on.
#[test]
fn forked_workers_seen_forked_before_the_kill_are_keepers_to_reclaim_by_default() {
    let world = World::new(1);
    // Keepers are told from every process's open files: a full scan each second.
    let agent = Agent::start(
        &world,
        Path_::Nvml,
        "[agent]\ninterval = \"200ms\"\nfull_scan_every = \"1s\"\n",
    );
    let mut trainer = holder_spec(&world, 6, 0, 0);
    trainer["forked_workers"] = json!(2);
    let script = format!("{}while :; do sleep 0.2; done\n", nohup(0, "train.py"));
    let l = launch(&world, &script, vec![trainer]);
    let (pid, workers) = l.holders[0].clone();
    // The agent has read the workers (a full scan found their files) while their parent lived.
    wait_until(20, "the agent to see the workers", || {
        let status: Value = serde_json::from_str(&agent.get("/api/status").1).unwrap();
        workers.iter().all(|w| {
            status["gpus"][0]["holders"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|h| h["pid"] == *w && h["ppid"] == json!(pid))
        })
    });
    crash_by_pid(pid);
    let mut last;
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let status: Value = serde_json::from_str(&agent.get("/api/status").1).unwrap();
        let tied = workers.iter().all(|w| {
            status["gpus"][0]["holders"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|h| h["pid"] == *w)
                .is_some_and(|h| {
                    h["keeps_alive"] == json!(pid)
                        && h["keeps_alive_unconfirmed"].is_null()
                        && h["evidence"][0]
                            .as_str()
                            .is_some_and(|e| e.contains("was forked by it"))
                        && h["action"]["reclaimable"] == json!(true)
                })
        });
        last = status;
        if tied {
            break;
        }
        assert!(
            Instant::now() < until,
            "the workers {workers:?} were never named the keepers of {pid}: {:#}",
            last["gpus"][0]["holders"]
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(alive(l.script.pid()), "{last:#}");
    drop(agent);
}

#[test]
fn keepers_inside_a_live_unit_are_reclaimed_only_with_include_keepers() {
    // A unit's script (alive) ran a trainer that forked a worker and was SIGKILLed: the
    // worker keeps the trainer's context inside a job systemd owns.
    let world = World::new(1);
    let mut cg = TestCgroup::new();
    let procs = cg.leaf("system.slice/train-keep.service");
    let mut trainer = holder_spec(&world, 3, 0, 0);
    trainer["forked_workers"] = json!(1);
    let script = format!(
        "echo $$ > {}\n{}while :; do sleep 0.2; done\n",
        procs.display(),
        nohup(0, "train.py")
    );
    let l = launch(&world, &script, vec![trainer]);
    let (pid, workers) = l.holders[0].clone();
    crash_by_pid(pid);
    let (status, targets) = look(&world);
    assert_exited_and_kept(&status, pid, &workers, 3);
    let k = holder(&status, 0, workers[0]);
    assert_eq!(k["job"]["label"], "unit:train-keep.service", "{k:#}");
    assert_eq!(
        k["action"]["command"],
        "vramguard reclaim --gpu 0 --job unit:train-keep.service --include keepers",
        "{k:#}"
    );
    assert!(targets.is_empty(), "not by default: {targets:?}");
    // Naming the job alone only narrows: still nothing.
    let plan = Vg::new(&world, Path_::Nvml)
        .args([
            "reclaim",
            "--dry-run",
            "--json",
            "--job",
            "unit:train-keep.service",
        ])
        .json(0);
    assert_eq!(plan["plan"]["jobs"], json!([]), "{plan:#}");
    // Asked for by name: the keeper goes, the unit's script stays, the memory comes back.
    let audit = world.dir.path().join("audit.jsonl");
    let out = Vg::new(&world, Path_::Nvml)
        .args(["reclaim", "--yes", "--json", "--grace", "2s"])
        .args(["--job", "unit:train-keep.service", "--include", "keepers"])
        .arg_path("--audit-log", &audit)
        .json(0);
    assert!(!alive(workers[0]), "the keeper survived: {out:#}");
    assert!(alive(l.script.pid()), "the unit's script was touched");
    let status = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    assert_eq!(status["gpus"][0]["memory"]["used"], json!(0), "{status:#}");
}

#[test]
fn a_spawn_worker_of_a_busy_trainer_whose_launcher_exited_is_protected_by_the_job() {
    let world = World::new(1);
    // launch.sh starts the trainer in the background and exits; the trainer (busy) started a
    // multiprocessing "spawn" worker (a fresh interpreter, its own context) that idles.
    let mut trainer = holder_spec(&world, 10, 75, 0);
    trainer["workers"] = json!([{ "argv": ["python3", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"],
        "spec": { "state": world.state_path(), "lifetime_ms": 120_000, "holds": [hold(0, 2)] } }]);
    let mut l = launch(
        &world,
        &format!("{}exit 0\n", nohup(0, "train.py")),
        vec![trainer],
    );
    l.script_exits();
    let worker = l.holders[0].1[0];
    let (status, targets) = look(&world);
    assert_eq!(class_of(&status, l.pid(0)), "detached", "{status:#}");
    let w = holder(&status, 0, worker);
    assert_eq!(w["class"], "detached", "{w:#}");
    assert!(w["evidence"].to_string().contains("of its job"), "{w:#}");
    assert!(targets.is_empty(), "{targets:?}");
}

/// Red-team finding: a collection reads GPU holders and their ancestors, so a holder's child
/// that holds no device file (a checkpoint upload, `tar`, a compiler) was never in the
/// snapshot, its work never seen: a trainer whose launcher exited, waiting on a busy child,
/// read as an idle orphan and was SIGTERMed by `reclaim --yes` (and by the agent's automatic
/// reclaim). The descendants of every holder whose verdict rests on work are now read before
/// work is watched: the child's CPU keeps its parent `detached`, in `status`, in the plan and
/// in the agent.
#[test]
fn a_holder_whose_child_holds_no_gpu_file_but_works_is_not_an_orphan() {
    let world = World::new(1);
    let mut trainer = holder_spec(&world, 8, 0, 0);
    trainer["workers"] = json!([{ "argv": ["tar", "czf", "checkpoint.tgz", "ckpt/"],
        "spec": { "state": world.state_path(), "lifetime_ms": 120_000, "cpu_percent": 90 } }]);
    let mut l = launch(
        &world,
        &format!(
            "{}exit 0
",
            nohup(0, "train.py")
        ),
        vec![trainer],
    );
    l.script_exits();
    let (trainer, upload) = (l.pid(0), l.holders[0].1[0]);
    let (status, targets) = look(&world);
    let h = holder(&status, 0, trainer);
    assert_eq!(h["class"], "detached", "{h:#}");
    assert_eq!(h["work"]["state"], "working", "{h:#}");
    assert!(
        h["work"].to_string().contains(&upload.to_string()),
        "the child's work is named: {h:#}"
    );
    assert!(targets.is_empty(), "{targets:?}");
    let (killed, _) = reclaim_yes(&world);
    assert!(killed.is_empty(), "{killed:?}");
    assert!(alive(trainer) && alive(upload));
}

/// A holder whose job is gone, idle itself, that starts a busy child (holding no GPU file)
/// while `reclaim` watches it: the child was not there when the window began, and without a
/// second look its work went unseen (the parent idle, a target). Read again at the end of the
/// window, the child's CPU (all spent within it) keeps its parent out of the plan.
#[test]
fn a_busy_child_started_during_the_window_keeps_its_parent_out_of_the_plan() {
    let world = World::new(1);
    let dir = world.dir.path();
    let fifo = dir.join("go");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let pidfile = dir.join("holder.pid");
    let holder = dir.join("holder.sh");
    std::fs::write(
        &holder,
        format!(
            "exec 3<{} 4<{} 5<{}\necho $$ > {}\nread x < {}\nsh -c 'while :; do :; done' 3<&- 4<&- 5<&- &\nwait\n",
            world.dev("nvidia0").display(),
            world.dev("nvidia-uvm").display(),
            world.dev("nvidiactl").display(),
            pidfile.display(),
            fifo.display()
        ),
    )
    .unwrap();
    // launch.sh starts it in the background and exits: its job's leader is gone.
    let mut l = launch(
        &world,
        &format!("bash {} >/dev/null 2>&1 &\nexit 0\n", holder.display()),
        vec![],
    );
    l.script_exits();
    let mut cleanup = Spawned::default();
    let pid = wait_for_pid_file(&pidfile, 10, "the holder to start");
    cleanup.track(pid);
    world.allocate(allocation(0, pid, 2 * GIB));
    let targets = |plan: &Value| -> Vec<u64> {
        plan["plan"]["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|j| j["targets"].as_array().unwrap())
            .map(|t| t["pid"].as_u64().unwrap())
            .collect()
    };
    // Idle: an orphan, and a target.
    let idle = Vg::new(&world, Path_::Nvml)
        .args(["reclaim", "--dry-run", "--json", "--sample", "1s"])
        .json(0);
    assert_eq!(targets(&idle), vec![u64::from(pid)], "{idle:#}");
    // Watched for 3 s; 1 s in, it starts its busy child.
    let vg =
        Vg::new(&world, Path_::Nvml).args(["reclaim", "--dry-run", "--json", "--sample", "3s"]);
    let planning = std::thread::spawn(move || vg.json(0));
    std::thread::sleep(Duration::from_millis(1000));
    std::fs::write(&fifo, "go\n").unwrap();
    let plan = planning.join().unwrap();
    let busy = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse::<u32>().ok())
        .collect::<Vec<_>>();
    for c in &busy {
        cleanup.track(*c);
    }
    assert_eq!(busy.len(), 1, "the busy child never started");
    assert!(targets(&plan).is_empty(), "{plan:#}");
    assert!(
        plan["plan"]["left_alone"]
            .to_string()
            .contains(&pid.to_string()),
        "{plan:#}"
    );
}

#[test]
fn a_jupyter_kernel_whose_server_died_is_not_an_orphan() {
    let world = World::new(1);
    // The server starts kernels in a session of their own, as jupyter_client does.
    let mut server = spec(&world, json!([]));
    server["new_session"] = json!(true);
    server["workers"] = json!([{ "argv": ["python3", "-m", "ipykernel_launcher", "-f", "kernel.json"],
        "spec": { "state": world.state_path(), "lifetime_ms": 120_000, "new_session": true,
                  "holds": [hold(0, 9)] } }]);
    let mut s = start(&world, &["jupyter-lab"], server);
    s.crash();
    let (status, targets) = look(&world);
    let k = holder(&status, 0, s.workers[0]);
    assert_eq!(k["class"], "active", "{k:#}");
    assert!(targets.is_empty());
    // Long idle, it is `idle`: reclaimed only when asked for by name.
    let cfg = config(&world, "[policy]\nidle_after = \"1s\"\n");
    let status = status_once_idle(&world, &cfg, 0, s.workers[0], 1);
    assert_eq!(class_of(&status, s.workers[0]), "idle", "{status:#}");
}

/// Every shape in one incident, for the acting tests: returns the world's holders by role.
struct Incident {
    world: World,
    _other_ns: Reaped,
    _launched: Vec<Launched>,
    _holdings: Vec<Holding>,
    /// What must die.
    idle_orphans: BTreeSet<u32>,
    /// What must live, by role.
    survivors: Vec<(&'static str, u32)>,
}

fn mixed_incident() -> Incident {
    let world = World::new(1);
    let mut survivors = Vec::new();
    let mut idle_orphans = BTreeSet::new();

    // nohup'ed from a script: one busy (detached), one idle (orphan), and one idle itself
    // whose child, holding no GPU file, works (a checkpoint upload: detached).
    let mut uploading = holder_spec(&world, 2, 0, 0);
    uploading["workers"] = json!([{ "argv": ["tar", "czf", "checkpoint.tgz", "ckpt/"],
        "spec": { "state": world.state_path(), "lifetime_ms": 120_000, "cpu_percent": 90 } }]);
    let mut l = launch(
        &world,
        &format!(
            "{}{}{}exit 0\n",
            nohup(0, "train.py"),
            nohup(1, "eval.py"),
            nohup(2, "finetune.py")
        ),
        vec![
            holder_spec(&world, 8, 85, 0),
            holder_spec(&world, 4, 0, 0),
            uploading,
        ],
    );
    l.script_exits();
    survivors.push(("detached nohup trainer", l.pid(0)));
    idle_orphans.insert(l.pid(1));
    survivors.push(("trainer waiting on its busy upload", l.pid(2)));
    survivors.push(("busy upload holding no GPU file", l.holders[2].1[0]));
    // DataLoader workers of a killed trainer: orphans.
    let mut t = trainer(&world);
    t.crash();
    idle_orphans.extend(t.workers.iter().copied());
    // torchrun: busy rank detached, idle rank orphan.
    let mut tr = torchrun(&world);
    tr.crash();
    survivors.push(("busy torchrun rank", tr.workers[0]));
    idle_orphans.insert(tr.workers[1]);
    // An active server.
    let mut srv = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 20 * GIB, "sm_util": 60 }]),
    );
    srv["new_session"] = json!(true);
    let server = start(&world, &["python3", "serve.py"], srv);
    survivors.push(("active server", server.pid));
    // An idle notebook kernel (idle after 1 s with the test's policy).
    let mut kernel = spec(&world, json!([hold(0, 6)]));
    kernel["new_session"] = json!(true);
    let kernel = start(&world, &["python3", "-m", "ipykernel_launcher"], kernel);
    survivors.push(("idle kernel", kernel.pid));
    // The persistence daemon, by identity.
    let exe = installed_copy(&world.dir.path().join("sbin"), "nvidia-persistenced");
    let mut daemon = spec(&world, json!([]));
    daemon["open_gpus"] = json!([0]);
    daemon["new_session"] = json!(true);
    let daemon = start_exe(&world, &exe, &[], &["nvidia-persistenced"], daemon);
    survivors.push(("system daemon", daemon.pid));
    // A pid the driver lists as seen from another PID namespace: a process of a PID
    // namespace of its own, reported as its pid there (3999999), which is no process here.
    let other_ns = Reaped(
        Command::new("unshare")
            .args([
                "--pid",
                "--fork",
                "--mount-proc",
                "--kill-child",
                "sh",
                "-c",
            ])
            .arg("echo 3999998 > /proc/sys/kernel/ns_last_pid; sleep 120 & wait")
            .spawn()
            .unwrap(),
    );
    let in_ns = child_of(child_of(other_ns.pid()));
    let mut a = allocation(0, in_ns, GIB);
    a.reported_pid = Some(3_999_999);
    world.allocate(a);
    survivors.push(("foreign pid's process", in_ns));
    Incident {
        world,
        _other_ns: other_ns,
        _launched: vec![l],
        _holdings: vec![t, tr, server, kernel, daemon],
        idle_orphans,
        survivors,
    }
}

impl Incident {
    /// The pid of the survivor with `role`.
    fn role(&self, role: &str) -> u32 {
        self.survivors
            .iter()
            .find(|(r, _)| *r == role)
            .map(|(_, p)| *p)
            .unwrap_or_else(|| panic!("no {role} in the incident"))
    }
}

fn assert_only_idle_orphans_died(inc: &Incident) {
    for (role, pid) in &inc.survivors {
        assert!(alive(*pid), "the {role} ({pid}) was killed");
    }
    for pid in &inc.idle_orphans {
        assert!(!alive(*pid), "idle orphan {pid} survived");
    }
}

#[test]
fn reclaim_yes_kills_exactly_the_idle_orphans_of_dead_jobs() {
    let inc = mixed_incident();
    let cfg = config(&inc.world, "[policy]\nidle_after = \"1s\"\n");
    let status = status_once_idle(&inc.world, &cfg, 0, inc.role("idle kernel"), 1);
    let classes: BTreeSet<String> = status["gpus"][0]["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["class"].as_str().unwrap().to_string())
        .collect();
    for c in ["active", "idle", "orphan", "detached", "system", "foreign"] {
        assert!(
            classes.contains(c),
            "no {c} holder in the incident: {status:#}"
        );
    }
    let audit = inc.world.dir.path().join("audit.jsonl");
    let out = Vg::new(&inc.world, Path_::Nvml)
        .args([
            "--config".as_ref(),
            cfg.as_os_str(),
            "reclaim".as_ref(),
            "--yes".as_ref(),
            "--json".as_ref(),
            "--grace".as_ref(),
            "2s".as_ref(),
            "--audit-log".as_ref(),
            audit.as_os_str(),
        ])
        // Exit 1: memory of a dead job remains, the trainer waiting on its busy upload's,
        // left alone because the plan saw it working; the run says so (and a Slurm heal
        // keeps such a node drained).
        .json(1);
    let waiting = inc.role("trainer waiting on its busy upload");
    assert!(
        out["remaining"].to_string().contains(&format!(
            "pid {waiting} (detached): its job is gone and the plan's sample saw it working"
        )),
        "{out:#}"
    );
    let signalled: BTreeSet<u32> = out["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["pid"].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(signalled, inc.idle_orphans, "{out:#}");
    assert_only_idle_orphans_died(&inc);
}

#[test]
fn the_agents_automatic_reclaim_kills_exactly_the_idle_orphans() {
    let inc = mixed_incident();
    let audit = inc.world.dir.path().join("agent-audit.jsonl");
    let config = format!(
        "[policy]\nidle_after = \"1s\"\n[agent]\ninterval = \"250ms\"\n\
         [reclaim]\nauto = true\nmin_age = \"2s\"\nsample = \"1s\"\ngrace = \"2s\"\naudit_log = \"{}\"\n",
        audit.display()
    );
    let agent = Agent::start(&inc.world, Path_::InProcess, &config);
    let t = Instant::now();
    wait_until(30, "the idle orphans to be reclaimed", || {
        inc.idle_orphans.iter().all(|p| !alive(*p))
    });
    assert!(
        t.elapsed() >= Duration::from_secs(2),
        "min_age: {:?}",
        t.elapsed()
    );
    // Anything else it (wrongly) wanted would be planned by the same rules within the next
    // rounds: let it collect 12 more times (3 s at 250 ms; counted in its own collections, so
    // a loaded machine stretches the window instead of shortening it), then read what it did
    // in the audit log, where each signal is recorded before it is sent, so a survivor still
    // in its grace period shows there too.
    agent.wait_collections(12);
    assert_only_idle_orphans_died(&inc);
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&audit)
        .unwrap_or_else(|e| panic!("the agent's audit log {}: {e}", audit.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let signalled: BTreeSet<u32> = records
        .iter()
        .filter(|r| r["event"] == "signal")
        .map(|r| r["pid"].as_u64().unwrap() as u32)
        .collect();
    assert_eq!(signalled, inc.idle_orphans, "{records:#?}");
    let m = agent.metrics();
    assert!(m.contains("class=\"detached\""), "{m}");
    // The agent's own view reads the children of holders whose job is gone too: the trainer
    // waiting on its busy upload is detached there, not an orphan.
    let waiting = format!("pid=\"{}\"", inc.role("trainer waiting on its busy upload"));
    let series: Vec<&str> = m.lines().filter(|l| l.contains(&waiting)).collect();
    assert!(!series.is_empty(), "{m}");
    assert!(
        series.iter().all(|l| l.contains("class=\"detached\"")),
        "{series:#?}"
    );
}

/// The first child of `pid`, once it has one.
fn child_of(pid: u32) -> u32 {
    let mut found = None;
    wait_until(10, "the namespace's first process", || {
        found = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .ok()
            .and_then(|c| c.split_whitespace().next().and_then(|p| p.parse().ok()));
        found.is_some()
    });
    found.unwrap()
}

#[test]
fn a_docker_container_is_shown_by_the_name_docker_gave_it() {
    let world = World::new(1);
    let mut cg = TestCgroup::new();
    let id = "beef".repeat(16);
    let procs = cg.leaf(&format!("system.slice/docker-{id}.scope"));
    // Docker's state for it, in a data root of the test's own.
    let docker = world.dir.path().join("docker");
    let state = docker.join("containers").join(&id);
    std::fs::create_dir_all(&state).unwrap();
    std::fs::write(
        state.join("config.v2.json"),
        r#"{"ID":"x","Name":"/llama-train-7","State":{"Running":true}}"#,
    )
    .unwrap();
    let script = format!(
        "echo $$ > {}\n{}exit 0\n",
        procs.display(),
        nohup(0, "train.py")
    );
    let mut l = launch(&world, &script, vec![holder_spec(&world, 2, 0, 0)]);
    l.script_exits();
    let cfg = config(
        &world,
        &format!(
            "[containers]\ndocker_root = {:?}\n",
            docker.display().to_string()
        ),
    );
    let status = status_with_config(&world, &cfg);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["container"]["name"], "llama-train-7", "{h:#}");
    assert_eq!(h["job"]["label"], "docker:llama-train-7", "{h:#}");
    // Without the runtime's state, the id.
    let (status, _) = look(&world);
    let h = holder(&status, 0, l.pid(0));
    assert_eq!(h["job"]["label"], format!("docker:{}", &id[..12]), "{h:#}");
    assert!(h["container"].get("name").is_none(), "{h:#}");
}

// ---- jobs under a live `vramguard run` (issue 26) ----

/// `reclaim --yes --json` with a short grace and the world's own audit log: the pids it
/// signalled and its whole output.
fn reclaim_yes(world: &World) -> (BTreeSet<u32>, Value) {
    let audit = world.dir.path().join("audit.jsonl");
    let out = Vg::new(world, Path_::Nvml)
        .args(["reclaim", "--yes", "--json", "--grace", "2s"])
        .arg_path("--audit-log", &audit)
        .json(0);
    let signalled = out["targets"]
        .as_array()
        .map(|t| {
            t.iter()
                .map(|t| t["pid"].as_u64().unwrap() as u32)
                .collect()
        })
        .unwrap_or_default();
    (signalled, out)
}

#[test]
fn a_setsid_holder_of_a_live_vramguard_run_is_its_job_until_the_supervisor_dies() {
    for isolation in ["cgroup", "group"] {
        let world = World::new(1);
        let mut job = SupervisedJob::start(&world, isolation);
        let (sup, holder) = (job.run.pid(), job.holder);
        let (status, targets) = look(&world);
        let h = holder_of_status(&status, holder);
        assert_eq!(h["class"], "active", "{isolation}: {h:#}");
        assert_eq!(
            h["job"]["label"],
            format!("run:{sup}"),
            "{isolation}: {h:#}"
        );
        assert_eq!(h["job"]["kind"], "supervised");
        assert_eq!(h["job"]["alive"], json!(true));
        let why = if isolation == "cgroup" {
            format!("in vramguard run {sup}'s cgroup")
        } else {
            format!("re-parented to the vramguard run supervisor {sup} (vramguard), which lives")
        };
        assert!(
            h["evidence"].to_string().contains(&why),
            "{isolation}: {h:#}"
        );
        assert!(targets.is_empty(), "{isolation}: {targets:?}");

        // `reclaim --yes` signals nothing, and says why the holder stays.
        let (signalled, out) = reclaim_yes(&world);
        assert!(signalled.is_empty(), "{isolation}: {out:#}");
        let text = stdout(
            &Vg::new(&world, Path_::Nvml)
                .args(["reclaim", "--yes", "--grace", "2s"])
                .arg_path("--audit-log", &world.dir.path().join("audit.jsonl"))
                .code(0),
        );
        assert!(
            text.contains(&format!("pid {holder}")) && text.contains(&why),
            "{isolation}: {text}"
        );
        assert!(
            alive(holder),
            "{isolation}: the supervised holder was killed"
        );

        // The supervisor is gone and the holder escaped it: an idle orphan, reclaimed as
        // before.
        job.supervisor_dies();
        let (status, targets) = look(&world);
        let h = holder_of_status(&status, holder);
        assert_eq!(h["class"], "orphan", "{isolation}: {h:#}");
        assert_eq!(targets, BTreeSet::from([holder]), "{isolation}");
        let (signalled, out) = reclaim_yes(&world);
        assert_eq!(signalled, BTreeSet::from([holder]), "{isolation}: {out:#}");
        wait_until(10, "the escaped holder to be reclaimed", || !alive(holder));
    }
}

#[test]
fn the_agents_automatic_reclaim_spares_the_holders_of_a_live_vramguard_run() {
    let world = World::new(1);
    let jobs: Vec<SupervisedJob> = ["cgroup", "group"]
        .into_iter()
        .map(|i| SupervisedJob::start(&world, i))
        .collect();
    // A control, started last: an idle orphan of a script that exited, which must die.
    let mut control = launch(
        &world,
        &format!("{}exit 0\n", nohup(0, "eval.py")),
        vec![holder_spec(&world, 2, 0, 0)],
    );
    control.script_exits();
    let orphan = control.pid(0);
    let audit = world.dir.path().join("agent-audit.jsonl");
    let config = format!(
        "[agent]\ninterval = \"250ms\"\n\
         [reclaim]\nauto = true\nmin_age = \"1s\"\nsample = \"1s\"\ngrace = \"2s\"\naudit_log = \"{}\"\n",
        audit.display()
    );
    let agent = Agent::start(&world, Path_::InProcess, &config);
    wait_until(30, "the control orphan to be reclaimed", || !alive(orphan));
    // The supervised holders were older, so as old as min_age before the control was; give
    // the agent a dozen more collections to act on anything else it (wrongly) wanted.
    let collections = |m: &str| -> f64 {
        m.lines()
            .filter(|l| l.starts_with("vramguard_collections_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let before = collections(&agent.metrics());
    wait_until(30, "a dozen more collections", || {
        collections(&agent.metrics()) >= before + 12.0
    });
    for job in &jobs {
        assert!(alive(job.holder), "the agent killed {}", job.holder);
    }
    // The audit log names the control as a target, and the supervised holders only as left
    // alone, with the supervisor that keeps each.
    let log = std::fs::read_to_string(&audit).unwrap_or_default();
    let records: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let about = |pid: u32| records.iter().filter(move |r| r["pid"] == json!(pid));
    assert!(about(orphan).any(|r| r["event"] == "target"), "{log}");
    for job in &jobs {
        for r in about(job.holder) {
            assert_eq!(r["event"], "left_alone", "{log}");
            let reason = r["reason"].as_str().unwrap();
            assert!(
                reason.contains("vramguard run") && reason.contains(&format!(" {}", job.run.pid())),
                "{reason}"
            );
        }
    }
}

/// The holder `pid` on GPU 0 of a `status --json`.
fn holder_of_status(status: &Value, pid: u32) -> &Value {
    holder(status, 0, pid)
}

#[test]
fn a_process_moved_into_a_live_vramguard_runs_cgroup_belongs_to_the_run() {
    let world = World::new(1);
    // A run whose job only sleeps; an idle orphan of a script that exited is then moved into
    // the run's cgroup: the supervisor is no ancestor of it, only the cgroup names it.
    let mark = world.dir.path().join("run-started");
    let mut run = Reaped(
        vg_command()
            .args(["run", "--isolation", "cgroup", "--grace", "1s", "--"])
            .args(["bash", "-c", "touch \"$1\"; exec sleep 300", "job"])
            .arg(&mark)
            .env_remove("VRAMGUARD_SIM")
            .env_remove("VRAMGUARD_NVML_LIB")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("vramguard run"),
    );
    wait_until(10, "the run's job to start", || mark.exists());
    let sup = run.pid();
    let dir = vramguard_ops::cgroup::cgroup2_mount()
        .expect("a cgroup2 mount")
        .join(own_cgroup().trim_start_matches('/'))
        .join(format!("vramguard-run-{sup}"));
    let l = nohup_in_cgroup(&world, &dir.join("cgroup.procs"), 3);
    let holder = l.pid(0);
    assert_ne!(ppid_of(holder), Some(sup));
    let (status, targets) = look(&world);
    let h = holder_of_status(&status, holder);
    assert_eq!(h["class"], "active", "{h:#}");
    assert_eq!(h["job"]["label"], format!("run:{sup}"), "{h:#}");
    assert!(
        h["evidence"]
            .to_string()
            .contains(&format!("in vramguard run {sup}'s cgroup")),
        "{h:#}"
    );
    assert!(targets.is_empty(), "{targets:?}");
    // The run ends normally: it kills its whole cgroup, the moved-in holder too.
    send_term(sup);
    run.0.wait().unwrap();
    wait_until(10, "the run to end its cgroup", || !alive(holder));
    drop(l);
}

#[test]
fn a_holder_re_parented_to_a_live_container_init_belongs_to_its_job() {
    let world = World::new(1);
    // A subreaper named `tini` (`tini -s` as a container's init, here the vramguard binary
    // installed as tini running `run`): its job's setsid holder is re-parented to it.
    let tini = installed_copy(&world.dir.path().join("bin"), "tini");
    let mut job = SupervisedJob::start_as(&world, &tini, "group");
    let (init, holder) = (job.run.pid(), job.holder);
    let (status, targets) = look(&world);
    let h = holder_of_status(&status, holder);
    assert_eq!(h["class"], "active", "{h:#}");
    assert_eq!(h["job"]["label"], format!("tini:{init}"), "{h:#}");
    assert!(
        h["evidence"].to_string().contains(&format!(
            "re-parented to the container init {init} (tini), which lives"
        )),
        "{h:#}"
    );
    assert!(targets.is_empty(), "{targets:?}");
    // The init is gone: the escaped idle holder is an orphan again.
    job.supervisor_dies();
    let (status, targets) = look(&world);
    assert_eq!(
        holder_of_status(&status, holder)["class"],
        "orphan",
        "{status:#}"
    );
    assert_eq!(targets, BTreeSet::from([holder]));
}

/// SIGTERM to `pid`, a process the test started.
fn send_term(pid: u32) {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::TERM,
    )
    .unwrap();
}

/// The harness's own guard against a race of its parallel tests: a copy of the binary that
/// some process still holds open for writing cannot be executed (ETXTBSY) until it is closed.
#[test]
fn a_fresh_copy_still_open_for_writing_is_started_once_it_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let path = installed_copy(dir.path(), "busy-copy");
    let writer = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let e = Command::new(&path).arg("--version").spawn().unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ExecutableFileBusy, "{e}");
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        drop(writer);
    });
    let status = spawn_fresh_copy(Command::new(&path).arg("--version").stdout(Stdio::null()))
        .expect("started once closed")
        .wait()
        .unwrap();
    assert!(status.success());
    closer.join().unwrap();
}
