//! A small DSL for driving the real binary against a simulated world (after ripgrep's test
//! harness): each test gets a fresh [`World`], builds a command, and on failure sees stdout
//! and stderr in separate blocks.
#![allow(dead_code)]

mod agent;
#[allow(unused_imports)]
pub use agent::*;

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;
pub use vramguard_testkit::*;

pub const BIN: &str = env!("CARGO_BIN_EXE_vramguard");

/// The binary with no config file (`VRAMGUARD_CONFIG=none`): a test never reads the host's
/// /etc/vramguard/config.toml (a node with the package installed runs the suite as any other
/// does); a test that wants a config passes `--config`, which wins over the variable.
pub fn vg_command() -> Command {
    let mut cmd = Command::new(BIN);
    cmd.env("VRAMGUARD_CONFIG", "none");
    cmd
}

/// A wrapper (`setpriv`, `unshare`, `setsid`) that runs the binary: [`vg_command`]'s
/// environment, so that the binary it starts reads no host config either.
pub fn vg_wrapped(wrapper: &str) -> Command {
    let mut cmd = Command::new(wrapper);
    cmd.env("VRAMGUARD_CONFIG", "none");
    cmd
}

/// How the binary reads the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path_ {
    /// nvml-wrapper → the simulator's libnvidia-ml.so.1.
    Nvml,
    /// The model in-process.
    InProcess,
}

pub struct Vg {
    cmd: Command,
    shown: String,
}

impl Vg {
    pub fn new(world: &World, path: Path_) -> Vg {
        let mut cmd = vg_command();
        cmd.env_remove("VRAMGUARD_SIM")
            .env_remove("VRAMGUARD_NVML_LIB")
            // Wide enough that no line wraps: tests of the width set their own.
            .env("COLUMNS", "1000")
            .env("NO_COLOR", "1")
            .arg("--sim")
            .arg(world.state_path());
        if path == Path_::Nvml {
            cmd.arg("--nvml-lib").arg(sim_nvml_lib());
        }
        Vg {
            cmd,
            shown: String::from("vramguard"),
        }
    }

    pub fn bare() -> Vg {
        let mut cmd = vg_command();
        cmd.env_remove("VRAMGUARD_SIM")
            .env_remove("VRAMGUARD_NVML_LIB")
            .env("COLUMNS", "1000")
            .env("NO_COLOR", "1");
        Vg {
            cmd,
            shown: String::from("vramguard"),
        }
    }

    pub fn args<I, S>(mut self, args: I) -> Vg
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        for a in args {
            self.shown.push(' ');
            self.shown.push_str(&a.as_ref().to_string_lossy());
            self.cmd.arg(a);
        }
        self
    }

    /// An option whose value is a path.
    pub fn arg_path(self, option: &str, path: &std::path::Path) -> Vg {
        self.args([std::ffi::OsStr::new(option), path.as_os_str()])
    }

    pub fn without_env(mut self, key: &str) -> Vg {
        self.cmd.env_remove(key);
        self
    }

    pub fn env(mut self, key: &str, value: impl AsRef<std::ffi::OsStr>) -> Vg {
        self.cmd.env(key, value);
        self
    }

    /// The command, to spawn and drive (a `--watch` that runs until stopped).
    pub fn command(self) -> Command {
        self.cmd
    }

    pub fn output(mut self) -> (Output, String) {
        let out = self.cmd.output().expect("run vramguard");
        (out, self.shown)
    }

    /// Runs and asserts the exit code.
    pub fn code(self, expected: i32) -> Output {
        let (out, shown) = self.output();
        if out.status.code() != Some(expected) {
            panic!(
                "\n$ {shown}\nexpected exit {expected}, got {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}\n",
                out.status.code(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        out
    }

    /// Runs, expects `expected`, parses stdout as JSON.
    pub fn json(self, expected: i32) -> Value {
        let out = self.code(expected);
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}):\n{}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The holder with `pid` on GPU `gpu` in a status/diagnose JSON report.
pub fn holder(report: &Value, gpu: usize, pid: u32) -> &Value {
    let report = if report.get("report").is_some() {
        &report["report"]
    } else {
        report
    };
    report["gpus"][gpu]["holders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["pid"] == json!(pid))
        .unwrap_or_else(|| panic!("no holder {pid} on GPU {gpu} in\n{report:#}"))
}

/// A simulated holder process with a cosmetic argv, started through the binary.
pub struct Holding {
    pub child: Reaped,
    pub pid: u32,
    pub workers: Vec<u32>,
    pub cleanup: Spawned,
}

impl Holding {
    /// Kills the holder itself (SIGKILL) and reaps it; its workers live on.
    pub fn crash(&mut self) {
        self.child.0.kill().unwrap();
        self.child.0.wait().unwrap();
    }
}

/// A trainer (group leader, 2 GiB on GPU 0) with one 1 GiB worker, SIGKILLed: the worker is
/// an orphan of a dead job.
pub fn crashed_trainer(world: &World) -> Holding {
    let mut trainer = spec(world, json!([hold(0, 2)]));
    trainer["group_leader"] = json!(true);
    trainer["workers"] = json!([{ "argv": ["python3", "w.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000, "holds": [hold(0, 1)] } }]);
    let mut t = start(world, &["python3", "train.py"], trainer);
    t.crash();
    t
}

/// Default spec fields.
pub fn spec(world: &World, holds: Value) -> Value {
    json!({
        "state": world.state_path(),
        "holds": holds,
        "lifetime_ms": 120_000,
    })
}

pub fn hold(gpu: u32, gib: u64) -> Value {
    json!({ "gpu": gpu, "bytes": gib * GIB })
}

/// Starts a holder from a JSON spec.
/// A one-GPU world whose GPU 0 holds 6 GiB of driver residue (a crashed benchmark's leak),
/// its NVML clients holding the device files as driver 580's do (`nvml_client_files`).
pub fn residue_world_580() -> World {
    let world = World::new(1);
    world.update(|s| s.nvml_client_files = true);
    let mut bench = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 6 * GIB, "after_exit": "leak" }]),
    );
    bench["new_session"] = json!(true);
    start(&world, &["python3", "bench.py"], bench).crash();
    world
}

pub fn start(world: &World, argv: &[&str], spec: serde_json::Value) -> Holding {
    start_wrapped(world, &[], argv, spec)
}

/// Starts a holder under a wrapper command (e.g. `unshare --pid --fork`); the cosmetic argv[0]
/// is lost then, the rest is kept.
pub fn start_wrapped(world: &World, wrapper: &[&str], argv: &[&str], spec: Value) -> Holding {
    start_exe(world, Path::new(BIN), wrapper, argv, spec)
}

/// A copy of the vramguard binary at `dir/name`, root-owned, mode 0755: an executable that
/// looks like an installed program of that name (for the system-service identity rule).
pub fn installed_copy(dir: &Path, name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(name);
    std::fs::copy(BIN, &path).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Spawns `cmd`, whose program may be a copy just written ([`installed_copy`]): while
/// another test's child is between its fork and its exec it holds a copy of the writing fd
/// (close-on-exec closes it only at that exec), and executing the file fails with ETXTBSY
/// for that moment. Tried again for up to 5 s.
pub fn spawn_fresh_copy(cmd: &mut Command) -> std::io::Result<std::process::Child> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match cmd.spawn() {
            Err(e)
                if e.kind() == std::io::ErrorKind::ExecutableFileBusy
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Starts a holder from the executable `exe` (a copy of the vramguard binary).
pub fn start_exe(
    world: &World,
    exe: &Path,
    wrapper: &[&str],
    argv: &[&str],
    mut spec: Value,
) -> Holding {
    let ready = world.dir.path().join(format!("ready-{}", unique()));
    spec["ready_file"] = json!(ready);
    use std::os::unix::process::CommandExt;
    let mut cmd = match wrapper.split_first() {
        Some((w, rest)) => {
            let mut c = Command::new(w);
            c.args(rest).arg(exe).args(argv.iter().skip(1));
            c
        }
        None => {
            let mut c = Command::new(exe);
            if let Some((first, rest)) = argv.split_first() {
                c.arg0(first).args(rest);
            }
            c
        }
    };
    // Its own process group, as a shell with job control gives each job: the holder's job is
    // then the test's doing, not whatever started the test suite (a background job whose
    // shell is gone would make every holder's job look dead). A holder that starts a session
    // must not lead a group already (setsid(2)).
    if spec["new_session"] != json!(true) {
        cmd.process_group(0);
    }
    cmd.env("VRAMGUARD_HOLDER", spec.to_string());
    let child = Reaped(spawn_fresh_copy(&mut cmd).expect("start holder"));
    let (pid, workers) = wait_ready(&ready, child.pid());
    let mut cleanup = Spawned::default();
    for w in &workers {
        cleanup.track(*w);
    }
    if pid != child.pid() {
        cleanup.track(pid);
    }
    Holding {
        pid,
        child,
        workers,
        cleanup,
    }
}

/// Waits for a holder's ready file (written once it holds its memory and started its
/// workers); returns its pid and its workers' pids. `pid` names the process waited for.
pub fn wait_ready(ready: &Path, pid: u32) -> (u32, Vec<u32>) {
    let r: Value = serde_json::from_str(&wait_for_file(ready, pid)).unwrap();
    let workers = r["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_u64().unwrap() as u32)
        .collect();
    (r["pid"].as_u64().unwrap() as u32, workers)
}

fn wait_for_file(path: &Path, pid: u32) -> String {
    let mut text = String::new();
    wait_until(20, &format!("holder {pid} to become ready"), || {
        text = std::fs::read_to_string(path).unwrap_or_default();
        !text.is_empty()
    });
    text
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// A fault of the simulated driver: `call` returns `code` (0: succeeds) after `delay_ms`,
/// from its first call on, forever.
pub fn fault(call: &str, code: u32, delay_ms: Option<u64>) -> vramguard_sim::state::Fault {
    vramguard_sim::state::Fault {
        call: call.into(),
        code,
        after_calls: 0,
        times: None,
        delay_ms,
    }
}

/// A config file with the given TOML.
pub fn config(world: &World, toml: &str) -> PathBuf {
    let p = world.dir.path().join(format!("config-{}.toml", unique()));
    std::fs::write(&p, toml).unwrap();
    p
}

/// `status --json` under the config file `cfg`.
pub fn status_with_config(world: &World, cfg: &Path) -> Value {
    Vg::new(world, Path_::Nvml)
        .args([
            "--config".as_ref(),
            cfg.as_os_str(),
            "status".as_ref(),
            "--json".as_ref(),
        ])
        .json(0)
}

/// `status --json` under `cfg`, taken again until the holder `pid` on GPU `gpu` has had no GPU
/// work for `idle_secs` (its `idle_secs`, as the classifier measured it in that very report):
/// a test of the idle threshold waits for the report that has passed it, never for a fixed
/// time that a loaded machine may not have let pass yet. 30 s at most.
pub fn status_once_idle(world: &World, cfg: &Path, gpu: usize, pid: u32, idle_secs: u64) -> Value {
    let mut report = Value::Null;
    wait_until(
        30,
        &format!("holder {pid} to be idle for {idle_secs}s"),
        || {
            report = status_with_config(world, cfg);
            holder(&report, gpu, pid)["idle_secs"]
                .as_u64()
                .is_some_and(|s| s >= idle_secs)
        },
    );
    report
}

/// With `VRAMGUARD_CAPTURE_INCIDENTS=DIR` (scripts/capture-incidents.sh), saves a snapshot of
/// `world` as `DIR/<test name>[-N].json`: the incident corpus (`tests/incidents`) is made of
/// these. Does nothing otherwise.
pub fn capture_incident(world: &World, path: Path_) {
    let test = std::thread::current()
        .name()
        .unwrap_or("incident")
        .rsplit("::")
        .next()
        .unwrap()
        .to_string();
    capture_incident_as(world, path, &test);
}

/// [`capture_incident`] under the name `name`.
pub fn capture_incident_as(world: &World, path: Path_, name: &str) {
    let Some(dir) = std::env::var_os("VRAMGUARD_CAPTURE_INCIDENTS") else {
        return;
    };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap();
    let file = (1..)
        .map(|n| match n {
            1 => dir.join(format!("{name}.json")),
            n => dir.join(format!("{name}-{n}.json")),
        })
        .find(|f| !f.exists())
        .unwrap();
    let out = Vg::new(world, path).args(["snapshot"]).code(0);
    std::fs::write(&file, &out.stdout).unwrap();
}

/// Every `.rs` file under `dir`, with its text (for tests that read the sources themselves).
pub fn rust_files(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                out.push((p, text));
            }
        }
    }
    out
}

/// A cgroup v2 subtree of the test's own, `rel` below a uniquely named top directory:
/// created on demand, its processes SIGKILLed and its directories removed on drop.
pub struct TestCgroup {
    top: PathBuf,
    /// The path as `/proc/PID/cgroup` shows it.
    top_rel: String,
    made: Vec<PathBuf>,
}

/// Where the cgroup v1 hierarchy with `controller` is mounted (`freezer` → usually
/// `/sys/fs/cgroup/freezer`), from `/proc/self/mountinfo`; `None` on a pure v2 host.
pub fn cgroup_v1_mount(controller: &str) -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    text.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut r = right.split_whitespace();
        let (fstype, _source, options) = (r.next()?, r.next()?, r.next()?);
        if fstype != "cgroup" || !options.split(',').any(|o| o == controller) {
            return None;
        }
        left.split_whitespace().nth(4).map(PathBuf::from)
    })
}

impl TestCgroup {
    /// A subtree of the cgroup v1 hierarchy `controller` (e.g. `freezer`, where Slurm's
    /// cgroup/v1 plugin tracks jobs) below a uniquely named top directory; `None` where the
    /// host has no such hierarchy (a pure v2 host).
    pub fn new_v1(controller: &str) -> Option<TestCgroup> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mount = cgroup_v1_mount(controller)?;
        let name = format!("vramguard-test-v1-{}-{n}", std::process::id());
        let top = mount.join(&name);
        std::fs::create_dir(&top).unwrap();
        Some(TestCgroup {
            made: vec![top.clone()],
            top,
            top_rel: format!("/{name}"),
        })
    }

    /// The same top directory in the v1 hierarchy `controller` (Slurm's v1 plugin makes a
    /// job's directory in every controller it constrains, under the same path).
    pub fn same_in_v1(&self, controller: &str) -> Option<TestCgroup> {
        let mount = cgroup_v1_mount(controller)?;
        let top = mount.join(self.top_rel.trim_start_matches('/'));
        std::fs::create_dir(&top).unwrap();
        Some(TestCgroup {
            made: vec![top.clone()],
            top,
            top_rel: self.top_rel.clone(),
        })
    }

    pub fn new() -> TestCgroup {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mount = vramguard_ops::cgroup::cgroup2_mount().expect("a cgroup2 mount");
        let name = format!("vramguard-test-{}-{n}", std::process::id());
        let top = mount.join(&name);
        std::fs::create_dir(&top).unwrap();
        TestCgroup {
            made: vec![top.clone()],
            top,
            top_rel: format!("/{name}"),
        }
    }
    /// Creates `rel` (and its parents) below the top; returns its `cgroup.procs`.
    pub fn leaf(&mut self, rel: &str) -> PathBuf {
        let mut dir = self.top.clone();
        for part in rel.split('/') {
            dir = dir.join(part);
            if !dir.exists() {
                std::fs::create_dir(&dir).unwrap();
                self.made.push(dir.clone());
            }
        }
        dir.join("cgroup.procs")
    }
    /// The path of `rel` as `/proc/PID/cgroup` shows it.
    pub fn path(&self, rel: &str) -> String {
        format!("{}/{rel}", self.top_rel)
    }
    /// Moves `pid` into `rel`.
    pub fn enter(&mut self, rel: &str, pid: u32) {
        let procs = self.leaf(rel);
        std::fs::write(procs, pid.to_string()).unwrap();
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        for dir in self.made.iter().rev() {
            let cg = vramguard_ops::cgroup::JobCgroup::at(dir.clone());
            cg.kill();
            cg.wait_empty(Duration::from_secs(5));
            cg.remove();
        }
    }
}

/// The red team's case: `vramguard run --isolation ISOLATION` runs a job whose main process
/// lives on (`sleep`) after a helper that called `setsid` started an idle holder and exited:
/// the holder (its process group's leader gone) is re-parented to the supervisor.
pub struct SupervisedJob {
    /// `vramguard run`.
    pub run: Reaped,
    pub holder: u32,
    /// The job's cgroup (cgroup isolation): removed on drop if the run left it behind.
    cgroup: Option<std::path::PathBuf>,
    _cleanup: Spawned,
}

impl SupervisedJob {
    pub fn start(world: &World, isolation: &str) -> SupervisedJob {
        Self::start_as(world, Path::new(BIN), isolation)
    }

    /// [`SupervisedJob::start`], with `vramguard run` run from the executable `program`.
    pub fn start_as(world: &World, program: &Path, isolation: &str) -> SupervisedJob {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ready = world.dir.path().join(format!("ready-run-{isolation}-{n}"));
        let spec = json!({
            "state": world.state_path(),
            "lifetime_ms": 120_000,
            "holds": [{ "gpu": 0, "bytes": 4u64 << 30, "sm_util": 0 }],
            "ready_file": ready,
        });
        let helper = world.dir.path().join(format!("helper-{isolation}-{n}.sh"));
        std::fs::write(
            &helper,
            "VRAMGUARD_HOLDER=\"$H0\" nohup bash -c 'exec -a python3 \"$VG\" train.py' \
             >/dev/null 2>&1 &\nexit 0\n",
        )
        .unwrap();
        let run = Reaped(
            spawn_fresh_copy(
                std::process::Command::new(program)
                    .args(["run", "--isolation", isolation, "--grace", "1s", "--"])
                    .args(["bash", "-c", "setsid -f bash \"$1\"; exec sleep 300", "job"])
                    .arg(&helper)
                    .env("VG", BIN)
                    .env("H0", spec.to_string())
                    .env("VRAMGUARD_CONFIG", "none")
                    .env_remove("VRAMGUARD_SIM")
                    .env_remove("VRAMGUARD_NVML_LIB")
                    .env_remove("VRAMGUARD_HOLDER")
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null()),
            )
            .expect("vramguard run"),
        );
        let mut cleanup = Spawned::default();
        let (holder, _) = wait_ready(&ready, run.pid());
        cleanup.track(holder);
        let sup = run.pid();
        wait_until(10, "the holder to be re-parented to vramguard run", || {
            ppid_of(holder) == Some(sup)
        });
        let cgroup = (isolation == "cgroup").then(|| {
            vramguard_ops::cgroup::cgroup2_mount()
                .expect("a cgroup2 mount")
                .join(own_cgroup().trim_start_matches('/'))
                .join(format!("vramguard-run-{sup}"))
        });
        if let Some(dir) = &cgroup {
            let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
            assert!(
                procs.lines().any(|l| l == holder.to_string()),
                "the holder is in {}",
                dir.display()
            );
        }
        SupervisedJob {
            run,
            holder,
            cgroup,
            _cleanup: cleanup,
        }
    }

    /// SIGKILLs `vramguard run` and, first, its watchdog (which would kill the cgroup or the
    /// job's process group): the holder in a session of its own escapes, as after an OOM kill
    /// of both.
    pub fn supervisor_dies(&mut self) {
        let sup = self.run.pid();
        let mut watchdog = Spawned::default();
        for pid in children(sup) {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if cmdline.split(|b| *b == 0).any(|a| a == b"__watchdog") {
                watchdog.track(pid);
            }
        }
        watchdog.kill_all();
        self.run.0.kill().unwrap();
        self.run.0.wait().unwrap();
        let holder = self.holder;
        wait_until(10, "the holder to outlive its supervisor", || {
            alive(holder) && ppid_of(holder) != Some(sup)
        });
    }
}

impl Drop for SupervisedJob {
    fn drop(&mut self) {
        let _ = self.run.0.kill();
        let _ = self.run.0.wait();
        if let Some(dir) = &self.cgroup
            && dir.exists()
        {
            let cg = vramguard_ops::cgroup::JobCgroup::at(dir.clone());
            cg.kill();
            cg.wait_empty(Duration::from_secs(5));
            cg.remove();
        }
    }
}

/// The parent of `pid` (`stat` field 4).
pub fn ppid_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The children of `pid`, from every thread's children list.
pub fn children(pid: u32) -> Vec<u32> {
    let mut kids = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let text = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        kids.extend(
            text.split_whitespace()
                .filter_map(|p| p.parse::<u32>().ok()),
        );
    }
    kids
}

/// The test's own cgroup v2 path, which `vramguard run` makes its leaf in.
pub fn own_cgroup() -> String {
    std::fs::read_to_string("/proc/self/cgroup")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("0::").map(str::to_string))
        .expect("a cgroup v2 line")
}
