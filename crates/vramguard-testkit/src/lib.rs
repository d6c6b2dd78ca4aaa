//! Shared test harness.
//!
//! - [`World`]: a temp directory with a simulator state file and stand-in device files.
//! - [`sim_nvml_lib`]: the simulator's `libnvidia-ml.so.1`, built on first use.
//! - [`Reaped`] / [`Spawned`]: processes a test started, killed by pid (never by name) and
//!   reaped when the guard drops, pass or fail.
//! - [`lockout`]: honest scrapers and a hostile local user against the agent's HTTP side.

#![deny(missing_docs)]

pub mod bench;
pub mod load;
pub mod lockout;
pub mod pty;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use vramguard_sim::state::{AfterExit, SimAllocation, SimState};
use vramguard_sim::store;

/// One GiB.
pub const GIB: u64 = 1 << 30;

/// A child process, killed and reaped on drop.
#[derive(Debug)]
pub struct Reaped(pub Child);

impl Reaped {
    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Many children (a benchmark's process table), all killed first and then all reaped on drop,
/// so tearing down thousands does not wait for each in turn.
#[derive(Debug, Default)]
pub struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

/// A benchmark knob: the environment variable `name` parsed, or `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Pids a test caused to exist but did not spawn directly (grandchildren re-parented to
/// init): SIGKILLed on drop, each after checking it is still the process recorded (same
/// start time), so a reused pid is never hit.
#[derive(Debug, Default)]
pub struct Spawned(Vec<(u32, Option<u64>)>);

impl Spawned {
    /// Records `pid` with its current start time.
    pub fn track(&mut self, pid: u32) {
        self.0.push((pid, start_ticks(pid)));
    }
    /// Kills every tracked process that still is who it was.
    pub fn kill_all(&mut self) {
        for (pid, start) in self.0.drain(..) {
            // Pinned by a pidfd first, then checked: the process is then the one recorded
            // until the signal, which goes through the pidfd.
            if start.is_some()
                && let Some(p) = rustix::process::Pid::from_raw(pid as i32)
                && let Ok(fd) = rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty())
                && start_ticks(pid) == start
            {
                let _ = rustix::process::pidfd_send_signal(&fd, rustix::process::Signal::KILL);
            }
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// Start time (clock ticks after boot) of a live pid.
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("{}/{pid}/stat", vramguard_proc::OWN_PROC)).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// State letter of a live pid.
pub fn state_of(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("{}/{pid}/stat", vramguard_proc::OWN_PROC)).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().next()?.chars().next()
}

/// Whether a pid exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    matches!(state_of(pid), Some(s) if s != 'Z' && s != 'X')
}

/// The pid a process wrote into `path`, once it has (at most `secs`; `what` names it in the
/// failure).
pub fn wait_for_pid_file(path: &Path, secs: u64, what: &str) -> u32 {
    let mut pid = 0;
    wait_until(secs, what, || {
        pid = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        pid != 0
    });
    pid
}

/// Polls `cond` every 10 ms for up to `secs` seconds; panics naming `what` on timeout.
pub fn wait_until(secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {secs}s waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A simulated machine in a temp directory.
#[derive(Debug)]
pub struct World {
    /// The directory (removed on drop).
    pub dir: tempfile::TempDir,
}

/// An allocation that follows the process (listed, released at exit).
pub fn allocation(gpu: u32, pid: u32, bytes: u64) -> SimAllocation {
    SimAllocation {
        namespace: None,
        gpu,
        pid,
        bytes,
        kind: Default::default(),
        after_exit: AfterExit::Release,
        listed: true,
        reported_pid: None,
        sm_util: 0,
        mem_util: 0,
        held_by: vec![],
        mig_device: None,
        context_lock: None,
    }
}

impl World {
    /// Puts GPU `gpu` in MIG mode with one 3g.71gb MIG device (66 GiB) per GPU instance id in
    /// `instances`.
    pub fn enable_mig(&self, gpu: usize, instances: &[u32]) {
        let instances = instances.to_vec();
        self.update(move |s| {
            s.gpus[gpu].mig = true;
            for gpu_instance in instances {
                s.gpus[gpu]
                    .mig_devices
                    .push(vramguard_sim::state::SimMigDevice {
                        gpu_instance,
                        compute_instance: 0,
                        memory_bytes: 66 * GIB,
                        profile: "3g.71gb".into(),
                    });
            }
        });
    }

    /// A world with `gpus` H200s and no allocations.
    pub fn new(gpus: u32) -> World {
        let dir = tempfile::tempdir().expect("temp dir");
        let dev = dir.path().join("dev");
        store::create_dev_dir(&dev, gpus as usize).expect("dev dir");
        let state = SimState::with_h200s(dev, gpus);
        store::write_state(&dir.path().join("state.json"), &state).expect("state");
        World { dir }
    }
    /// The state file.
    pub fn state_path(&self) -> PathBuf {
        self.dir.path().join("state.json")
    }
    /// The stand-in device directory.
    pub fn dev_dir(&self) -> PathBuf {
        self.dir.path().join("dev")
    }
    /// A stand-in device file.
    pub fn dev(&self, name: &str) -> PathBuf {
        self.dev_dir().join(name)
    }
    /// Changes the state file.
    pub fn update(&self, change: impl FnOnce(&mut SimState)) {
        store::update_state(&self.state_path(), change).expect("update state");
    }
    /// Adds an allocation.
    pub fn allocate(&self, a: SimAllocation) {
        self.update(|s| s.allocations.push(a));
    }
    /// Lets an unprivileged user use this world (directory and every file in it world-writable),
    /// for tests that run vramguard without root.
    pub fn open_to_everyone(&self) {
        use std::os::unix::fs::PermissionsExt;
        let all = || std::fs::Permissions::from_mode(0o777);
        for entry in std::fs::read_dir(self.dir.path())
            .expect("world dir")
            .flatten()
        {
            let _ = std::fs::set_permissions(entry.path(), all());
        }
        std::fs::set_permissions(self.dir.path(), all()).expect("chmod world dir");
    }

    /// A process holding the given device files open (fd 3, 4...), sleeping `secs`.
    pub fn holder(&self, files: &[&str], secs: u32) -> Reaped {
        let mut script = String::new();
        for (i, f) in files.iter().enumerate() {
            script.push_str(&format!("exec {}<{} ; ", i + 3, self.dev(f).display()));
        }
        script.push_str(&format!("exec sleep {secs}"));
        // Its own process group: a job of its own, whatever started the test suite.
        let child = Command::new("sh")
            .arg("-c")
            .arg(&script)
            .process_group(0)
            .spawn()
            .expect("spawn sh");
        let pid = child.id();
        let dev = self.dev_dir();
        wait_until(10, "the holder to open its device files", || {
            files.is_empty() || open_files(pid, &dev) >= files.len()
        });
        Reaped(child)
    }
}

/// How many fds of `pid` point into `dir`.
pub fn open_files(pid: u32, dir: &Path) -> usize {
    std::fs::read_dir(format!("{}/{pid}/fd", vramguard_proc::OWN_PROC))
        .map(|d| {
            d.flatten()
                .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l.starts_with(dir)))
                .count()
        })
        .unwrap_or(0)
}

/// The simulator's NVML library, built on first use (a nested `cargo build` of
/// `vramguard-sim-nvml`), exposed as `libnvidia-ml.so.1` in a stable directory.
pub fn sim_nvml_lib() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .args([
                "build",
                "-p",
                "vramguard-sim-nvml",
                "--message-format=json-render-diagnostics",
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .expect("run cargo build -p vramguard-sim-nvml");
        assert!(
            out.status.success(),
            "building the sim NVML library failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let so = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|m| {
                m["reason"] == "compiler-artifact" && m["target"]["name"] == "vramguard_sim_nvml"
            })
            .flat_map(|m| {
                m["filenames"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .filter_map(|f| f.as_str().map(PathBuf::from))
            })
            .find(|f| f.extension().is_some_and(|e| e == "so"))
            .expect("cargo reported no .so for vramguard-sim-nvml");
        let dir = so.parent().expect("artifact dir").join("sim-nvml");
        std::fs::create_dir_all(&dir).expect("lib dir");
        let link = dir.join("libnvidia-ml.so.1");
        let tmp = dir.join(format!(".link{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&so, &tmp).expect("symlink");
        std::fs::rename(&tmp, &link).expect("rename symlink");
        link
    })
    .clone()
}

/// The simulator's NVML library as a 535.43–535.98 driver exports it:
/// `nvmlDeviceGetConfComputeMemSizeInfo` but no `nvmlDeviceGetRunningProcessDetailList`, the
/// pair nvitop (and vramguard) recognise those drivers by. A copy of [`sim_nvml_lib`] whose
/// dynamic symbol name is overwritten (same length, so nothing moves), so that `dlsym` of it
/// fails; named `libnvidia-ml.so.1` in a directory of its own, for `LD_LIBRARY_PATH` too.
pub fn sim_nvml_lib_535() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let original = std::fs::read(sim_nvml_lib()).expect("read the sim NVML library");
        let (from, to) = (
            b"nvmlDeviceGetRunningProcessDetailList".as_slice(),
            b"xvmlDeviceGetRunningProcessDetailList".as_slice(),
        );
        let mut patched = original.clone();
        let mut found = 0;
        let mut i = 0;
        while let Some(at) = patched[i..].windows(from.len()).position(|w| w == from) {
            patched[i + at..i + at + to.len()].copy_from_slice(to);
            i += at + to.len();
            found += 1;
        }
        assert!(
            found > 0,
            "the sim NVML library exports no DetailList symbol"
        );
        let dir = sim_nvml_lib().parent().expect("lib dir").join("driver-535");
        std::fs::create_dir_all(&dir).expect("lib dir");
        let lib = dir.join("libnvidia-ml.so.1");
        // Written aside and renamed: test binaries running at once never see half a file.
        let tmp = dir.join(format!(".lib{}", std::process::id()));
        std::fs::write(&tmp, patched).expect("write the 535 library");
        std::fs::rename(&tmp, &lib).expect("rename the 535 library");
        lib
    })
    .clone()
}

/// The test a test binary defines (`#[test] fn holder_process() { run_if_holder() }`) so that
/// [`start_holder`] can re-execute the binary as a simulated holder: the sim's own tests have
/// no vramguard binary to start one with.
pub const HOLDER_TEST: &str = "holder_process";

/// Runs this process as a simulated holder, and exits, when [`start_holder`] re-executed it as
/// one; returns at once otherwise (the test run proper).
pub fn run_if_holder() {
    if let Ok(text) = std::env::var(vramguard_sim::holder::HOLDER_ENV) {
        let spec: vramguard_sim::holder::HolderSpec =
            serde_json::from_str(&text).expect("holder spec");
        vramguard_sim::holder::run(spec).expect("simulated holder");
        std::process::exit(0);
    }
}

/// A simulated holder started by [`start_holder`], and the children it forked or spawned:
/// every one of them is SIGKILLed by pid (if it is still the process started) when dropped.
pub struct SimHolder {
    /// The holder process.
    pub child: Child,
    /// Its pid and its workers' pids, as it reported them.
    pub ready: vramguard_sim::holder::Ready,
    cleanup: Spawned,
}

impl SimHolder {
    /// SIGKILLs the holder itself and reaps it; its workers live on.
    pub fn crash(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for SimHolder {
    fn drop(&mut self) {
        self.cleanup.kill_all();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts this test binary again as the simulated holder `spec` describes (see
/// [`run_if_holder`]), with a ready file in the world's directory, and waits until it is ready.
pub fn start_holder(world: &World, mut spec: vramguard_sim::holder::HolderSpec) -> SimHolder {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ready_file = world.dir.path().join(format!(
        "holder-ready-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    spec.ready_file = Some(ready_file.clone());
    let exe = std::env::current_exe().expect("the test binary");
    let argv: Vec<String> = ["python3", HOLDER_TEST, "--exact", "--nocapture"]
        .map(String::from)
        .to_vec();
    let child = vramguard_sim::holder::spawn_with(&exe, &argv, &spec).expect("start a holder");
    let ready = vramguard_sim::holder::wait_ready(&ready_file, Duration::from_secs(20))
        .expect("the holder to be ready");
    let mut cleanup = Spawned::default();
    for &w in &ready.workers {
        cleanup.track(w);
    }
    SimHolder {
        child,
        ready,
        cleanup,
    }
}

/// A Python process that holds `file` open only in a thread's own fd table
/// (`unshare(CLONE_FILES)`): its `/proc/PID/fd` does not show it. Returns once it holds it.
pub fn thread_table_holder(file: &std::path::Path) -> Reaped {
    use std::io::BufRead;
    let mut h = Reaped(
        std::process::Command::new("python3")
            .args(["-c", include_str!("../scripts/thread_table_holder.py")])
            .arg(file)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python3"),
    );
    let mut line = String::new();
    std::io::BufReader::new(h.0.stdout.take().expect("piped"))
        .read_line(&mut line)
        .expect("the holder's first line");
    assert_eq!(
        line.trim(),
        "ready",
        "the thread-table holder did not start"
    );
    h
}
