//! A real single-node Slurm cluster (Debian's slurm-wlm: munged, slurmctld, slurmd) in a
//! temporary directory, with vramguard's epilog, running real `sbatch` jobs whose processes
//! hold memory on the simulated GPUs (#31). Slurm's own cgroups (v1 on a hybrid host, v2 on a
//! unified one) name the jobs; the epilog reclaims what a job left, drains the node when only
//! a reset can help, and `vramguard slurm heal` brings it back once it is idle.
//!
//! The tests run one at a time (one slurmd per host name). Every daemon is the test's child,
//! stopped by its pid; every job is cancelled through the cluster's own `scancel`; every
//! process a job started is killed by its pid (with its start time) or by the test's own
//! cgroup. `scripts/test.sh` installs slurm-wlm and munge; without them the tests fail,
//! unless `VRAMGUARD_SLURM_TESTS=skip` says to skip them (and each says so).

mod common;
use common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One cluster at a time: slurmd makes its cgroups under the node's name.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

const TOOLS: [&str; 6] = [
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "scontrol",
    "squeue",
];

fn tool(name: &str) -> Option<PathBuf> {
    [
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
        "/usr/local/sbin",
        "/usr/local/bin",
    ]
    .iter()
    .map(|d| Path::new(d).join(name))
    .find(|p| p.is_file())
}

/// Whether Slurm is here; when it is not, fails (or, with `VRAMGUARD_SLURM_TESTS=skip`,
/// says the test is skipped and returns `false`).
fn slurm_installed(test: &str) -> bool {
    let missing: Vec<&str> = TOOLS
        .iter()
        .copied()
        .filter(|t| tool(t).is_none())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let msg = format!(
        "{test}: Slurm is not installed (missing {}): scripts/test.sh installs slurm-wlm and munge",
        missing.join(", ")
    );
    if std::env::var("VRAMGUARD_SLURM_TESTS").as_deref() == Ok("skip") {
        eprintln!("SKIPPED {msg} (VRAMGUARD_SLURM_TESTS=skip)");
        return false;
    }
    panic!("{msg}; set VRAMGUARD_SLURM_TESTS=skip to skip these tests");
}

fn short_hostname() -> String {
    let out = Command::new("hostname").arg("-s").output().unwrap();
    let name = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!name.is_empty(), "hostname -s printed nothing");
    name
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A running single-node cluster.
struct Cluster {
    dir: tempfile::TempDir,
    conf: PathBuf,
    node: String,
    /// munged, slurmctld, slurmd: stopped in reverse order.
    daemons: Vec<Reaped>,
    /// Slurm's freezer directory for this node, when it was not there before (removed once
    /// empty).
    made_cgroup: Option<PathBuf>,
    /// Processes the jobs started (holders, their workers, a scheduled heal): killed by pid.
    pub spawned: Spawned,
    /// Held while the cluster runs: another test binary (a second checkout's suite on the same
    /// machine) starts its cluster only after this one is gone. Dropped last.
    _host_lock: std::fs::File,
}

/// Slurm names its v1 cgroups after the node (`/slurm_<node>/uid_U/job_N`): two clusters on
/// one host would share them. One at a time per host, whatever process runs it.
fn host_lock() -> std::fs::File {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open("/tmp/vramguard-slurm-tests.lock")
        .unwrap();
    rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive).unwrap();
    f
}

impl Cluster {
    /// Starts munged, slurmctld and slurmd with a config of their own; the epilog is
    /// vramguard's, run against `world`'s simulated GPUs (`gpus` of them, Slurm GRES `gpu`).
    fn start(world: &World, gpus: u32) -> Cluster {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let host_lock = host_lock();
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        use std::os::unix::fs::PermissionsExt;
        // munged wants its socket's directory searchable by all.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        let node = short_hostname();
        let cluster = format!("vg{}x{n}", std::process::id());
        let (ctld_port, slurmd_port) = (free_port(), free_port());
        let pure_v2 = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
        let plugin = if pure_v2 { "cgroup/v2" } else { "cgroup/v1" };
        let freezer = (!pure_v2)
            .then(|| cgroup_v1_mount("freezer"))
            .flatten()
            .map(|m| m.join(format!("slurm_{node}")));
        let made_cgroup = freezer.filter(|f| !f.exists());

        // The GPUs as Slurm GRES: character devices (Slurm insists), /dev/null's numbers.
        std::fs::create_dir(d.join("gres")).unwrap();
        for i in 0..gpus {
            let st = Command::new("mknod")
                .arg(d.join(format!("gres/nvidia{i}")))
                .args(["c", "1", "3"])
                .status()
                .unwrap();
            assert!(st.success(), "mknod");
        }
        std::fs::write(
            d.join("gres.conf"),
            format!(
                "Name=gpu File={}/gres/nvidia[0-{}]\n",
                d.display(),
                gpus.saturating_sub(1)
            ),
        )
        .unwrap();
        std::fs::write(
            d.join("cgroup.conf"),
            format!(
                "CgroupPlugin={plugin}\nCgroupAutomount=no\nConstrainCores=no\n\
                 ConstrainRAMSpace=no\nConstrainDevices=no\n"
            ),
        )
        .unwrap();
        // slurmd runs the epilog with an environment of its own (no PATH): this wrapper gives
        // it the test's binary, simulated GPUs, logs and quick retries, and no host config.
        let epilog = d.join("epilog.sh");
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/slurm/epilog.sh");
        std::fs::write(
            &epilog,
            format!(
                "#!/bin/bash\n\
                 export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n\
                 export VRAMGUARD={bin} VRAMGUARD_CONFIG=none VRAMGUARD_SIM={state}\n\
                 export VRAMGUARD_EPILOG_LOG={d}/epilog.log VRAMGUARD_AUDIT_LOG={d}/audit.jsonl\n\
                 export VRAMGUARD_EPILOG_TRIES=2 VRAMGUARD_EPILOG_SLEEP=0.2\n\
                 export VRAMGUARD_HEAL_WAIT=60s VRAMGUARD_HEAL_POLL=0.5s\n\
                 [ -f {d}/heal_wait ] && export VRAMGUARD_HEAL_WAIT=$(cat {d}/heal_wait)\n\
                 exec /bin/bash {deploy}\n",
                bin = BIN,
                state = world.state_path().display(),
                d = d.display(),
                deploy = deploy.display(),
            ),
        )
        .unwrap();
        std::fs::set_permissions(&epilog, std::fs::Permissions::from_mode(0o755)).unwrap();
        let conf = d.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName={cluster}\n\
                 SlurmctldHost={node}(127.0.0.1)\n\
                 SlurmctldPort={ctld_port}\nSlurmdPort={slurmd_port}\n\
                 SlurmUser=root\nSlurmdUser=root\n\
                 AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={d}/munge.sock\n\
                 StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n\
                 SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.pid\n\
                 SlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd.log\n\
                 ProctrackType=proctrack/cgroup\nTaskPlugin=task/cgroup\n\
                 SchedulerType=sched/backfill\nSelectType=select/cons_tres\n\
                 SelectTypeParameters=CR_Core\nReturnToService=2\nMpiDefault=none\n\
                 SwitchType=switch/none\nJobCompType=jobcomp/none\n\
                 AccountingStorageType=accounting_storage/none\n\
                 SlurmctldTimeout=30\nSlurmdTimeout=30\nInactiveLimit=0\nKillWait=2\n\
                 MinJobAge=5\nGresTypes=gpu\nEpilog={epilog}\nFirstJobId={first_job}\n\
                 NodeName={node} NodeAddr=127.0.0.1 Gres=gpu:{gpus} CPUs={cpus} \
                 RealMemory=1000 State=UNKNOWN\n\
                 PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP \
                 OverSubscribe=YES\n",
                d = d.display(),
                epilog = epilog.display(),
                cpus = 2,
                // Job ids of their own (job_N cgroups, labels): never 1, 2, … of another run.
                first_job = 1000 + (std::process::id() % 60_000) * 1000 + n * 100,
            ),
        )
        .unwrap();
        for sub in ["state", "spool"] {
            std::fs::create_dir(d.join(sub)).unwrap();
        }
        let key = d.join("munge.key");
        let mut bytes = vec![0u8; 1024];
        use std::io::Read;
        std::fs::File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut bytes)
            .unwrap();
        std::fs::write(&key, &bytes).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();

        let mut c = Cluster {
            dir,
            conf,
            node,
            daemons: Vec::new(),
            made_cgroup,
            spawned: Spawned::default(),
            _host_lock: host_lock,
        };
        let log = |name: &str| std::fs::File::create(d.join(name)).unwrap();
        let daemon = |program: &str, args: Vec<String>, out: &str| {
            Reaped(
                Command::new(tool(program).unwrap())
                    .args(args)
                    .env("SLURM_CONF", d.join("slurm.conf"))
                    .stdin(Stdio::null())
                    .stdout(log(out))
                    .stderr(log(&format!("{out}.err")))
                    .spawn()
                    .unwrap_or_else(|e| panic!("starting {program}: {e}")),
            )
        };
        c.daemons.push(daemon(
            "munged",
            vec![
                "-F".into(),
                "-f".into(),
                format!("--socket={}/munge.sock", d.display()),
                format!("--key-file={}", key.display()),
                format!("--log-file={}/munged.log", d.display()),
                format!("--pid-file={}/munged.pid", d.display()),
                format!("--seed-file={}/munged.seed", d.display()),
            ],
            "munged.out",
        ));
        let sock = d.join("munge.sock");
        wait_until(10, "munged's socket", || sock.exists());
        c.daemons.push(daemon(
            "slurmctld",
            vec!["-D".into(), "-i".into()],
            "slurmctld.out",
        ));
        c.daemons
            .push(daemon("slurmd", vec!["-D".into()], "slurmd.out"));
        let started = Instant::now();
        let mut state = String::new();
        while Instant::now() - started < Duration::from_secs(30) {
            state = c.node_state();
            if state == "IDLE" {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        assert_eq!(state, "IDLE", "the node never came up:\n{}", c.logs());
        c
    }

    /// A Slurm command against this cluster.
    fn cmd(&self, program: &str) -> Command {
        let mut cmd = Command::new(tool(program).unwrap_or_else(|| PathBuf::from(program)));
        cmd.env("SLURM_CONF", &self.conf);
        cmd
    }

    fn run(&self, program: &str, args: &[&str]) -> String {
        let out = self.cmd(program).args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{program} {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `scontrol show node` as one line.
    fn node_line(&self) -> String {
        let out = self
            .cmd("scontrol")
            .args(["show", "node", &self.node, "--oneliner"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn node_state(&self) -> String {
        self.node_line()
            .split_whitespace()
            .find_map(|f| f.strip_prefix("State="))
            .unwrap_or("")
            .to_string()
    }

    fn node_reason(&self) -> String {
        let line = self.node_line();
        line.split_once(" Reason=")
            .map(|(_, r)| r.trim().to_string())
            .unwrap_or_default()
    }

    /// Submits `script` (bash) as a batch job; returns its id.
    fn sbatch(&self, name: &str, gres: Option<&str>, script: &str, env: &[(&str, String)]) -> u32 {
        let path = self.dir.path().join(format!("{name}.sh"));
        std::fs::write(&path, format!("#!/bin/bash\n{script}")).unwrap();
        let out_file = self.dir.path().join(format!("{name}-%j.out"));
        let mut cmd = self.cmd("sbatch");
        cmd.args(["--parsable", "-J", name, "-o"]).arg(&out_file);
        if let Some(g) = gres {
            cmd.arg(format!("--gres={g}"));
        }
        cmd.arg(&path).env("VG", BIN).env_remove("VRAMGUARD_HOLDER");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "sbatch: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(';')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    }

    /// Submits a job whose trainer (`python3 train.py`: the holder `spec`, possibly with
    /// workers) runs in the background of a script that goes on after it; waits until it holds
    /// its memory. Returns the job id, the trainer's pid and its workers' pids.
    fn trainer_job(
        &mut self,
        name: &str,
        gres: Option<&str>,
        mut spec: Value,
    ) -> (u32, u32, Vec<u32>) {
        let ready = self.dir.path().join(format!("{name}.ready"));
        spec["ready_file"] = json!(ready);
        spec["group_leader"] = json!(true);
        let script = "VRAMGUARD_HOLDER=\"$H0\" bash -c 'exec -a python3 \"$VG\" train.py' &\n\
                      wait\n\
                      # The trainer is gone; the job goes on (its workers linger in it).\n\
                      exec sleep 600\n";
        let id = self.sbatch(name, gres, script, &[("H0", spec.to_string())]);
        let (pid, workers) = wait_ready(&ready, id);
        self.spawned.track(pid);
        for w in &workers {
            self.spawned.track(*w);
        }
        (id, pid, workers)
    }

    fn epilog_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("epilog.log")).unwrap_or_default()
    }

    fn audit(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.path().join("audit.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The pids of the heals the epilog started (`… started in the background (pid N)` in its
    /// log), tracked for cleanup.
    fn track_heals(&mut self) -> Vec<u32> {
        let pids: Vec<u32> = self
            .epilog_log()
            .lines()
            .filter_map(|l| l.split("(pid ").nth(1))
            .filter_map(|p| p.trim_end_matches(')').parse().ok())
            .collect();
        for p in &pids {
            self.spawned.track(*p);
        }
        pids
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for f in [
            "slurmctld.log",
            "slurmd.log",
            "epilog.log",
            "munged.out.err",
        ] {
            let text = std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            out.push_str(&format!("--- {f} (last lines) ---\n"));
            for l in tail.iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Waits for `cond`, up to `secs`; on timeout fails with the cluster's logs.
    fn wait(&self, secs: u64, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
        let t0 = Instant::now();
        while !cond() {
            if Instant::now() - t0 > Duration::from_secs(secs) {
                panic!(
                    "timed out after {secs}s waiting for {what}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Instant::now() - t0
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Every job of this cluster (and only this cluster: its own SLURM_CONF).
        let ids = self
            .cmd("squeue")
            .args(["-h", "-o", "%i"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let ids: Vec<&str> = ids.split_whitespace().collect();
        if !ids.is_empty() {
            let _ = self.cmd("scancel").args(&ids).status();
            let t0 = Instant::now();
            while Instant::now() - t0 < Duration::from_secs(15) {
                let left = self
                    .cmd("squeue")
                    .args(["-h", "-o", "%i"])
                    .output()
                    .map(|o| o.stdout.is_empty())
                    .unwrap_or(true);
                if left {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        self.spawned.kill_all();
        // slurmd, slurmctld, munged: SIGTERM by pid (our children), then SIGKILL on drop.
        for d in self.daemons.iter_mut().rev() {
            if let Some(p) = rustix::process::Pid::from_raw(d.pid() as i32) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::TERM);
            }
            let t0 = Instant::now();
            while Instant::now() - t0 < Duration::from_secs(5) {
                if matches!(d.0.try_wait(), Ok(Some(_))) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        self.daemons.clear();
        if let Some(top) = &self.made_cgroup {
            remove_empty_tree(top);
        }
    }
}

/// Removes `dir` and its subdirectories, deepest first, where they are empty cgroups.
fn remove_empty_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_empty_tree(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

fn status(world: &World) -> Value {
    Vg::new(world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0)
}

fn holder_gpu0(report: &Value, pid: u32) -> Value {
    holder(report, 0, pid).clone()
}

/// A trainer holding `gib` GiB on GPU 0 with one worker holding 1 GiB.
fn trainer_with_worker(world: &World, gib: u64) -> Value {
    let mut s = spec(world, json!([hold(0, gib)]));
    s["workers"] = json!([{ "argv": ["python3", "worker.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000, "holds": [hold(0, 1)] } }]);
    s
}

/// The figures the README quotes, printed for `--nocapture`.
fn figure(what: &str, d: Duration) {
    eprintln!("slurm figure: {what}: {} ms", d.as_millis());
}

/// Two jobs on one node, each with a trainer that dies and a worker that lingers: `status`
/// names every process by its real Slurm cgroup; one job's worker escapes the job's cgroup
/// and outlives the job; that job's epilog reclaims it, and the other job's worker, on the
/// same GPU inside its live job, is never touched. The node stays up.
#[test]
fn a_real_slurm_jobs_leftovers_are_named_by_its_cgroup_and_reclaimed_by_its_epilog() {
    if !slurm_installed("slurm") {
        return;
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let t_test = Instant::now();
    let world = World::new(2);
    let mut c = Cluster::start(&world, 2);
    figure("cluster start", Instant::now() - t_test);
    let (a, a_trainer, a_workers) =
        c.trainer_job("a", Some("gpu:1"), trainer_with_worker(&world, 2));
    let (b, b_trainer, b_workers) = c.trainer_job("b", None, trainer_with_worker(&world, 1));
    // The trainers die (SIGKILL, as an OOM kill would): their workers live on inside the jobs.
    let mut trainers = Spawned::default();
    trainers.track(a_trainer);
    trainers.track(b_trainer);
    trainers.kill_all();
    wait_until(10, "the trainers to die", || {
        !alive(a_trainer) && !alive(b_trainer)
    });

    let report = status(&world);
    for (job, w) in [(a, a_workers[0]), (b, b_workers[0])] {
        let h = holder_gpu0(&report, w);
        assert_eq!(h["job"]["label"], format!("slurm:{job}.batch"), "{h:#}");
        assert_ne!(h["class"], "orphan", "a live job's process: {h:#}");
    }

    // Job a's worker escapes the job's cgroup (a daemonised helper, a root job moving
    // itself): Slurm's cancel cannot reach it.
    let mut escaped = match TestCgroup::new_v1("freezer") {
        Some(cg) => cg,
        None => TestCgroup::new(),
    };
    escaped.enter("escaped", a_workers[0]);
    let t0 = Instant::now();
    c.run("scancel", &[&a.to_string()]);
    let a_worker = a_workers[0];
    let clean = c.wait(60, "job a's epilog to reclaim its escaped worker", || {
        c.epilog_log().contains(&format!("job={a} reclaimed")) && !alive(a_worker)
    });
    figure(
        "scancel -> node clean (escaped worker reclaimed)",
        t0.elapsed_since(),
    );
    let _ = clean;
    let log = c.epilog_log();
    assert!(
        log.contains(&format!(
            "job={a} GPUs 0 not clean after the job; reclaiming"
        )),
        "{log}"
    );
    assert!(
        alive(b_workers[0]),
        "job b's worker is not job a's business"
    );
    let state = c.node_state();
    assert!(!state.contains("DRAIN"), "{state}: {}", c.node_reason());
    // The audit log names the worker it signalled, and only it.
    let signalled: Vec<u64> = c
        .audit()
        .iter()
        .filter(|r| r["event"] == "signal")
        .filter_map(|r| r["pid"].as_u64())
        .collect();
    assert!(
        signalled.iter().all(|p| *p == u64::from(a_worker)),
        "{signalled:?}"
    );
    assert!(!signalled.is_empty());

    // Job b ends: Slurm kills its cgroup, the epilog finds nothing; the node is idle.
    c.run("scancel", &[&b.to_string()]);
    c.wait(30, "job b's worker to be killed by Slurm", || {
        !alive(b_workers[0])
    });
    c.wait(30, "the node to be idle", || c.node_state() == "IDLE");
    figure("test total", Instant::now() - t_test);
}

/// A job whose trainer leaves 3 GiB of driver residue on GPU 0 is cancelled while another job
/// (on no GPU of Slurm's, holding 1 GiB of GPU 1) keeps running; returns once the epilog has
/// drained the node: the running job's id and when the cancel was sent.
fn residue_under_a_running_job(c: &mut Cluster, world: &World) -> (u32, Instant) {
    let leak = spec(
        world,
        json!([{ "gpu": 0, "bytes": 3 * GIB, "after_exit": "leak" }]),
    );
    let (job, trainer, _) = c.trainer_job("leaky", Some("gpu:1"), leak);
    let (running, _, _) = c.trainer_job("running", None, spec(world, json!([hold(1, 1)])));
    let t0 = Instant::now();
    c.run("scancel", &[&job.to_string()]);
    c.wait(30, "the trainer to be killed by Slurm", || !alive(trainer));
    c.wait(60, "the epilog to drain the node", || {
        c.node_state().contains("DRAIN")
    });
    (running, t0)
}

/// Memory no process holds (driver residue) after a job: the epilog drains the node with a
/// readable reason; once the node is idle, the heal it scheduled resets the GPU under the
/// `--reset=auto` rules and resumes the node, on its own.
#[test]
fn residue_drains_the_node_and_the_heal_resets_and_resumes_it_once_idle() {
    if !slurm_installed("slurm") {
        return;
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let t_test = Instant::now();
    let world = World::new(2);
    let mut c = Cluster::start(&world, 2);
    let (other, t0) = residue_under_a_running_job(&mut c, &world);
    figure("scancel -> drain", t0.elapsed_since());
    let reason = c.node_reason();
    assert!(
        reason.starts_with("vramguard: ghost memory: 3.0 GiB on GPU 0"),
        "{reason}"
    );
    c.wait(10, "the epilog to schedule the heal", || {
        c.epilog_log().contains("scheduled vramguard slurm heal")
    });
    let heals = c.track_heals();
    assert_eq!(heals.len(), 1, "{}", c.epilog_log());
    // Still busy: the heal waits, nothing is reset, the node stays drained.
    let t_wait = Instant::now();
    while !c.audit().iter().any(|r| r["event"] == "heal_waiting") {
        if t_wait.elapsed_since() > Duration::from_secs(45) {
            let ps = Command::new("ps")
                .args(["-eo", "pid,ppid,pgid,sid,stat,wchan:24,etime,args"])
                .output()
                .unwrap();
            let ps = String::from_utf8_lossy(&ps.stdout);
            let related: Vec<&str> = ps
                .lines()
                .filter(|l| {
                    heals.iter().any(|h| l.contains(&h.to_string()))
                        || l.contains("scontrol")
                        || l.contains("squeue")
                        || l.contains("slurm")
                })
                .collect();
            panic!(
                "the heal never waited for the other job\n{}\n{}",
                related.join("\n"),
                c.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(c.node_state().contains("DRAIN"), "{}", c.node_state());
    let used = |world: &World| -> u64 {
        status(world)["gpus"][0]["memory"]["used"]
            .as_u64()
            .unwrap_or(0)
    };
    assert!(used(&world) >= 3 * GIB, "the residue is still there");
    assert!(
        !c.audit().iter().any(|r| r["event"] == "heal_reset"),
        "{:?}\n{}",
        c.audit(),
        c.epilog_log()
    );
    // The other job ends: the heal resets GPU 0 and resumes the node on its own.
    let t1 = Instant::now();
    c.run("scancel", &[&other.to_string()]);
    c.wait(60, "the heal to resume the node", || {
        c.node_state() == "IDLE"
    });
    figure(
        "other job's scancel (node idle) -> resumed",
        t1.elapsed_since(),
    );
    figure("scancel -> resumed", t0.elapsed_since());
    assert_eq!(used(&world), 0, "the reset freed the residue");
    let events: Vec<String> = c
        .audit()
        .iter()
        .map(|r| r["event"].as_str().unwrap_or("").to_string())
        .collect();
    for e in ["heal_waiting", "heal_reset", "reset_done", "heal_resumed"] {
        assert!(events.contains(&e.to_string()), "{e}: {events:?}");
    }
    c.wait(60, "the heal to exit", || !heals.iter().any(|p| alive(*p)));
    figure("test total", Instant::now() - t_test);
}

/// An admin drains the node while a job runs (maintenance); the job leaves residue. Its
/// epilog finds the GPU not clean but leaves the admin's drain and reason as they are and
/// schedules no heal: with its own reason written over the admin's, the heal took the drain
/// for vramguard's, reset the GPU and resumed the node (red team).
#[test]
fn the_epilog_leaves_an_admins_drain_as_it_is() {
    if !slurm_installed("slurm") {
        return;
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let world = World::new(1);
    let mut c = Cluster::start(&world, 1);
    let leak = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 3 * GIB, "after_exit": "leak" }]),
    );
    let (job, trainer, _) = c.trainer_job("leaky", Some("gpu:1"), leak);
    c.run(
        "scontrol",
        &[
            "update",
            &format!("NodeName={}", c.node),
            "State=DRAIN",
            "Reason=maintenance: replace PSU, do not resume",
        ],
    );
    c.run("scancel", &[&job.to_string()]);
    c.wait(30, "the trainer to be killed by Slurm", || !alive(trainer));
    c.wait(60, "the epilog to decide about the drain", || {
        let log = c.epilog_log();
        log.contains("is drained by someone else already") || log.contains("draining ")
    });
    let reason = c.node_reason();
    assert!(
        reason.starts_with("maintenance: replace PSU, do not resume"),
        "{reason}\n{}",
        c.epilog_log()
    );
    assert!(c.node_state().contains("DRAIN"), "{}", c.node_state());
    assert!(
        !c.epilog_log().contains("scheduled vramguard slurm heal"),
        "{}",
        c.epilog_log()
    );
    let used = status(&world)["gpus"][0]["memory"]["used"]
        .as_u64()
        .unwrap_or(0);
    assert!(used >= 3 * GIB, "nothing was reset");
}

/// A heal that gave up waiting (a long job still ran when its `--wait` ended) leaves the node
/// drained by vramguard; when that job ends, its epilog starts the heal again, which waits for
/// the job to leave, resets the GPU and resumes the node: no admin needed.
#[test]
fn a_heal_that_gave_up_waiting_is_taken_up_by_the_epilog_of_the_job_it_waited_for() {
    if !slurm_installed("slurm") {
        return;
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let t_test = Instant::now();
    let world = World::new(2);
    let mut c = Cluster::start(&world, 2);
    let heal_wait = c.dir.path().join("heal_wait");
    std::fs::write(&heal_wait, "1s").unwrap();
    let (long, _) = residue_under_a_running_job(&mut c, &world);
    c.wait(60, "the first heal to give up waiting", || {
        c.audit().iter().any(|r| r["event"] == "heal_timed_out")
    });
    let first = c.track_heals();
    assert_eq!(first.len(), 1, "{}", c.epilog_log());
    assert!(c.node_state().contains("DRAIN"), "{}", c.node_state());
    assert!(
        !c.audit().iter().any(|r| r["event"] == "heal_reset"),
        "nothing is reset under a running job: {:?}",
        c.audit()
    );

    // The long job ends: its epilog finds the node still drained by vramguard and starts
    // the heal again.
    std::fs::write(&heal_wait, "60s").unwrap();
    let t1 = Instant::now();
    c.run("scancel", &[&long.to_string()]);
    c.wait(60, "the second heal to resume the node", || {
        c.node_state() == "IDLE"
    });
    figure("long job's scancel -> resumed", t1.elapsed_since());
    let log = c.epilog_log();
    assert!(
        log.contains(&format!(
            "job={long} node {} is still drained by vramguard",
            c.node
        )),
        "{log}"
    );
    let used = status(&world)["gpus"][0]["memory"]["used"]
        .as_u64()
        .unwrap_or(u64::MAX);
    assert_eq!(used, 0, "the reset freed the residue");
    let events: Vec<String> = c
        .audit()
        .iter()
        .map(|r| r["event"].as_str().unwrap_or("").to_string())
        .collect();
    let pos = |e: &str| events.iter().position(|x| x == e);
    assert!(
        pos("heal_timed_out") < pos("heal_resumed") && pos("heal_resumed").is_some(),
        "{events:?}"
    );
    let heals = c.track_heals();
    assert_eq!(heals.len(), 2, "{log}");
    c.wait(60, "the heals to exit", || !heals.iter().any(|p| alive(*p)));
    figure("test total", Instant::now() - t_test);
}

/// An admin's drain is never touched, even with residue on the GPU; and a reset that fails
/// keeps vramguard's drain, its reason saying why.
#[test]
fn an_admins_drain_stays_and_a_failed_reset_keeps_the_node_drained() {
    if !slurm_installed("slurm") {
        return;
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let t_test = Instant::now();
    let world = World::new(1);
    let c = Cluster::start(&world, 1);
    let mut a = allocation(0, 999_999, 3 * GIB);
    a.after_exit = vramguard_sim::state::AfterExit::Leak;
    world.allocate(a);
    let audit = c.dir.path().join("heal-audit.jsonl");
    // The node's agent follows the same audit log: the heal's steps become its metrics, and
    // a failed heal its alert.
    let alerts = c.dir.path().join("alerts.log");
    let agent = Agent::start(
        &world,
        Path_::Nvml,
        &format!(
            "[agent]\ninterval = \"200ms\"\n\n[reclaim]\naudit_log = {audit:?}\n\n\
             [[alerts.exec]]\nargv = [\"sh\", \"-c\", \"echo $VRAMGUARD_ALERT_STATUS \
             $VRAMGUARD_ALERT_RULE gpu=[$VRAMGUARD_ALERT_GPU] $VRAMGUARD_ALERT_SUMMARY >> '{}'\"]\n",
            alerts.display()
        ),
    );
    let alert_lines = || std::fs::read_to_string(&alerts).unwrap_or_default();
    let heal = |extra: &[&str]| {
        Vg::new(&world, Path_::Nvml)
            .env("SLURM_CONF", &c.conf)
            .args(["slurm", "heal", "--node", &c.node, "--wait", "5s"])
            .args(["--poll", "0.2s", "--sample", "0"])
            .arg_path("--audit-log", &audit)
            .args(extra)
    };

    c.run(
        "scontrol",
        &[
            "update",
            &format!("NodeName={}", c.node),
            "State=DRAIN",
            "Reason=maintenance",
        ],
    );
    let out = heal(&[]).code(0);
    assert!(
        stdout(&out).contains("drained by someone else (maintenance): left alone"),
        "{}",
        stdout(&out)
    );
    assert!(c.node_state().contains("DRAIN"));
    assert_eq!(c.node_reason().split(" [").next(), Some("maintenance"));
    let used = status(&world)["gpus"][0]["memory"]["used"]
        .as_u64()
        .unwrap();
    assert!(used >= 3 * GIB, "nothing was reset");

    // vramguard's drain, but the reset fails: kept drained, the reason says why.
    c.run(
        "scontrol",
        &[
            "update",
            &format!("NodeName={}", c.node),
            "State=DRAIN",
            "Reason=vramguard: ghost memory: 3.0 GiB on GPU 0",
        ],
    );
    let out = heal(&["--reset-command", "/bin/false"]).code(1);
    assert!(stdout(&out).contains("kept drained"), "{}", stdout(&out));
    assert!(c.node_state().contains("DRAIN"), "{}", c.node_state());
    let reason = c.node_reason();
    assert!(
        reason.starts_with("vramguard: GPU reset did not free the memory: GPU 0: reset failed"),
        "{reason}"
    );
    let events: Vec<String> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["event"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(events.contains(&"heal_failed".to_string()), "{events:?}");
    assert!(events.contains(&"heal_skipped".to_string()), "{events:?}");
    // The agent alerts once, for the node (no GPU), with the reason, and shows the steps.
    c.wait(20, "the agent's heal alert", || {
        alert_lines().contains("firing slurm_heal_failed")
    });
    let line = alert_lines();
    assert!(
        line.contains(&format!(
            "firing slurm_heal_failed gpu=[] Slurm node {} kept drained: vramguard: GPU reset did not free the memory",
            c.node
        )),
        "{line}"
    );
    let node_label = format!("node=\"{}\"", c.node);
    let m = agent.metrics();
    assert_eq!(
        sample(&m, "vramguard_slurm_heal_failed", &[&node_label]),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "vramguard_slurm_heal_steps_total", &["step=\"failed\""]),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            "vramguard_slurm_heal_last_step",
            &[&node_label, "step=\"failed\""]
        ),
        Some(1.0),
        "{m}"
    );

    // Another heal holds the lock (`flock`, started here, ended by its pid): nothing done.
    let lock = PathBuf::from(format!("{}.heal-lock", audit.display()));
    let mut holder = Reaped(
        Command::new("flock")
            .arg(&lock)
            .args(["sleep", "60"])
            .spawn()
            .unwrap(),
    );
    let held = holder.pid();
    wait_until(10, "flock to hold the lock", || {
        children(held).iter().any(|p| alive(*p))
    });
    let out = heal(&[]).code(0);
    assert!(stdout(&out).contains("nothing done"), "{}", stdout(&out));
    assert!(c.node_state().contains("DRAIN"), "{}", c.node_state());
    let mut sleeper = Spawned::default();
    for p in children(held) {
        sleeper.track(p);
    }
    sleeper.kill_all();
    let _ = holder.0.wait();

    // The same drain with a working reset: resumed.
    let out = heal(&[]).code(0);
    assert!(stdout(&out).contains("resumed"), "{}", stdout(&out));
    // Right after a resume slurmctld shows NOT_RESPONDING until it has pinged slurmd.
    c.wait(30, "the node to be idle", || c.node_state() == "IDLE");
    // The incident is resolved, once.
    c.wait(20, "the agent's resolved heal alert", || {
        alert_lines().contains("resolved slurm_heal_failed")
    });
    agent.wait_collections(3);
    let lines = alert_lines();
    assert_eq!(
        lines.lines().count(),
        2,
        "one firing, one resolved: {lines}"
    );
    assert!(
        lines.contains(&format!("Slurm node {}: GPUs clean, resumed", c.node)),
        "{lines}"
    );
    let m = agent.metrics();
    assert_eq!(
        sample(&m, "vramguard_slurm_heal_failed", &[&node_label]),
        Some(0.0),
        "{m}"
    );
    assert_eq!(
        sample(
            &m,
            "vramguard_slurm_heal_steps_total",
            &["step=\"resumed\""]
        ),
        Some(1.0),
        "{m}"
    );
    figure("test total", Instant::now() - t_test);
}

trait Since {
    fn elapsed_since(&self) -> Duration;
}

impl Since for Instant {
    fn elapsed_since(&self) -> Duration {
        Instant::now() - *self
    }
}
