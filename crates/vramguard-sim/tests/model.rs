//! The simulation model: real processes where the kernel can produce the case on demand, a
//! synthetic `proc_root` for the states that are hard to hold still (zombie leaders with live
//! threads, pid reuse).

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use vramguard_sim::state::{AfterExit, Fault, SimAllocation, SimGpu, SimState};
use vramguard_sim::{Sim, SimError, store};

const GIB: u64 = 1 << 30;

struct Reaped(Child);
impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn gpu(i: u32) -> SimGpu {
    SimGpu {
        uuid: format!("GPU-{i:08x}-1111-2222-3333-444444444444"),
        name: "NVIDIA H200".into(),
        total_bytes: 140 * GIB,
        reserved_bytes: GIB / 2,
        baseline_used_bytes: 0,
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x19 + i),
        persistence_mode: true,
        mig: false,
        mig_devices: vec![],
        faults: vec![],
        quirks: vec![],
        after_exit: AfterExit::Release,
        health: Default::default(),
    }
}

fn alloc(gpu: u32, pid: u32, bytes: u64, after_exit: AfterExit) -> SimAllocation {
    SimAllocation {
        namespace: None,
        gpu,
        pid,
        bytes,
        kind: Default::default(),
        after_exit,
        listed: true,
        reported_pid: None,
        sm_util: 0,
        mem_util: 0,
        held_by: vec![],
        mig_device: None,
        context_lock: None,
    }
}

struct World {
    dir: tempfile::TempDir,
}

impl World {
    fn new(proc_root: Option<&Path>, allocations: Vec<SimAllocation>) -> World {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("dev");
        store::create_dev_dir(&dev, 2).unwrap();
        let state = SimState {
            driver_version: "580.159.03".into(),
            nvml_version: None,
            dev_dir: dev,
            proc_root: proc_root
                .map(Path::to_path_buf)
                .unwrap_or_else(|| "/proc".into()),
            gpus: vec![gpu(0), gpu(1)],
            allocations,
            faults: vec![],
            nvml_client_files: false,
        };
        store::write_state(&dir.path().join("state.json"), &state).unwrap();
        World { dir }
    }
    fn path(&self) -> PathBuf {
        self.dir.path().join("state.json")
    }
    fn update(&self, change: impl FnOnce(&mut SimState)) {
        store::update_state(&self.path(), change).unwrap();
    }
    fn sim(&self) -> Sim {
        let mut s = Sim::open(self.path()).unwrap();
        s.set_cache_ttl(Duration::ZERO);
        s
    }
}

fn sleeper() -> Reaped {
    Reaped(Command::new("sleep").arg("60").spawn().unwrap())
}

fn used(sim: &mut Sim, gpu: usize) -> u64 {
    sim.observe().unwrap().gpus[gpu].used
}

#[test]
fn memory_follows_the_process_and_is_released_at_exit() {
    let mut p = sleeper();
    let w = World::new(None, vec![alloc(0, p.0.id(), 8 * GIB, AfterExit::Release)]);
    let mut sim = w.sim();
    let obs = sim.observe().unwrap();
    assert_eq!(obs.gpus[0].used, 8 * GIB);
    assert_eq!(obs.gpus[0].processes.len(), 1);
    assert_eq!(obs.gpus[0].processes[0].pid, p.0.id());
    assert_eq!(obs.gpus[0].free, 140 * GIB - GIB / 2 - 8 * GIB);
    assert_eq!(obs.gpus[1].used, 0);
    p.0.kill().unwrap();
    p.0.wait().unwrap();
    let obs = sim.observe().unwrap();
    assert_eq!(obs.gpus[0].used, 0);
    assert!(obs.gpus[0].processes.is_empty());
}

#[test]
fn holders_that_come_and_go_leave_no_runtime_records_behind() {
    // An agent soak's churn: holders start, their allocations are removed while they still
    // live (the driver forgot them), then they are killed. The simulator's runtime records
    // must not pile up, in its file or in a long-running reader.
    let w = World::new(None, vec![]);
    let mut sim = w.sim();
    for _ in 0..20 {
        let p = sleeper();
        w.update(|s| s.allocations = vec![alloc(0, p.0.id(), GIB, AfterExit::Release)]);
        sim.observe().unwrap();
        w.update(|s| s.allocations.clear());
        drop(p);
        // The next holder's arrival is what rewrites the runtime file.
    }
    let p = sleeper();
    w.update(|s| s.allocations = vec![alloc(0, p.0.id(), GIB, AfterExit::Release)]);
    sim.observe().unwrap();
    let runtime = std::fs::read_to_string(vramguard_sim::model::runtime_path(&w.path())).unwrap();
    let records = runtime.matches("start_ticks").count();
    assert!(records <= 2, "{records} records left: {runtime}");
}

#[test]
fn an_unreaped_zombie_has_released_its_memory() {
    // Killed but not waited for: a pure zombie (all threads exited).
    let mut child = Command::new("sleep").arg("60").spawn().unwrap();
    let w = World::new(None, vec![alloc(0, child.id(), GIB, AfterExit::Release)]);
    let mut sim = w.sim();
    assert_eq!(used(&mut sim, 0), GIB);
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(child.id() as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while used(&mut sim, 0) != 0 {
        assert!(Instant::now() < deadline, "zombie still counted");
        std::thread::sleep(Duration::from_millis(10));
    }
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap();
    assert!(stat.contains(") Z "), "still an unreaped zombie: {stat}");
    child.wait().unwrap();
}

#[test]
fn teardown_lag_is_measured_from_the_first_sighting_of_the_exit() {
    let mut p = sleeper();
    let w = World::new(
        None,
        vec![alloc(0, p.0.id(), 4 * GIB, AfterExit::ReleaseAfterMs(400))],
    );
    let mut sim = w.sim();
    assert_eq!(used(&mut sim, 0), 4 * GIB);
    p.0.kill().unwrap();
    p.0.wait().unwrap();
    let t0 = Instant::now();
    let obs = sim.observe().unwrap();
    assert_eq!(obs.gpus[0].used, 4 * GIB, "held during the lag");
    // As a real driver does, it still lists the pid whose context it tears down, although
    // /proc has lost it, and reports no utilization for it.
    assert_eq!(obs.gpus[0].processes.len(), 1, "listed during teardown");
    assert_eq!(obs.gpus[0].processes[0].pid, p.0.id());
    assert_eq!(obs.gpus[0].processes[0].used_bytes, Some(4 * GIB));
    assert!(obs.gpus[0].utilization.is_empty());
    assert!(!std::path::Path::new(&format!("/proc/{}", p.0.id())).exists());
    // A second simulator instance (another process) sees the same lag, not a new one.
    let mut other = w.sim();
    while used(&mut other, 0) != 0 {
        assert!(t0.elapsed() < Duration::from_secs(3));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        other.observe().unwrap().gpus[0].processes.is_empty(),
        "no longer listed once released"
    );
    let lag = t0.elapsed();
    assert!(
        lag >= Duration::from_millis(350) && lag < Duration::from_millis(700),
        "{lag:?}"
    );
}

#[test]
fn a_leak_stays_until_reset_and_reset_is_refused_while_in_use() {
    let mut p = sleeper();
    let w = World::new(None, vec![alloc(1, p.0.id(), 6 * GIB, AfterExit::Leak)]);
    let mut sim = w.sim();
    match sim.reset(1) {
        Err(SimError::InUse { gpu: 1, pids }) => assert_eq!(pids, vec![p.0.id()]),
        other => panic!("expected in use, got {other:?}"),
    }
    p.0.kill().unwrap();
    p.0.wait().unwrap();
    assert_eq!(used(&mut sim, 1), 6 * GIB);
    assert!(
        sim.observe().unwrap().gpus[1].processes.is_empty(),
        "residue is never listed"
    );

    // A process holding the device file also blocks the reset.
    let dev = w.dir.path().join("dev/nvidia1");
    let holder = Reaped(
        Command::new("sh")
            .arg("-c")
            .arg(format!("exec 3<{} ; exec sleep 60", dev.display()))
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let proc = vramguard_proc::ProcFs::own().unwrap();
    while !vramguard_sim::model::device_file_holders(&proc, &w.dir.path().join("dev"), 1)
        .contains(&holder.0.id())
    {
        assert!(
            Instant::now() < deadline,
            "the holder never opened the device file"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    match sim.reset(1) {
        Err(SimError::InUse { pids, .. }) => assert_eq!(pids, vec![holder.0.id()]),
        other => panic!("expected in use while the device file is open, got {other:?}"),
    }
    drop(holder);
    let out = sim.reset(1).unwrap();
    assert_eq!(out.cleared_bytes, 6 * GIB);
    assert_eq!(used(&mut sim, 1), 0);
    // Another simulator instance knows about the reset too.
    assert_eq!(used(&mut w.sim(), 1), 0);
}

fn write_stat(root: &Path, pid: u32, tid: Option<u32>, state: char, start: u64) {
    let dir = match tid {
        None => root.join(pid.to_string()),
        Some(t) => root.join(format!("{pid}/task/{t}")),
    };
    std::fs::create_dir_all(&dir).unwrap();
    let id = tid.unwrap_or(pid);
    std::fs::write(
        dir.join("stat"),
        format!(
            "{id} (python) {state} 1 {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 2 0 {start} 0 0\n"
        ),
    )
    .unwrap();
}

#[test]
fn a_zombie_leader_with_a_live_thread_still_holds() {
    let root = tempfile::tempdir().unwrap();
    write_stat(root.path(), 700, None, 'Z', 5000);
    write_stat(root.path(), 700, Some(700), 'Z', 5000);
    write_stat(root.path(), 700, Some(701), 'D', 5001);
    let w = World::new(
        Some(root.path()),
        vec![alloc(0, 700, 2 * GIB, AfterExit::Release)],
    );
    let mut sim = w.sim();
    assert_eq!(used(&mut sim, 0), 2 * GIB);
    // The D thread finishes exiting: the zombie no longer holds anything.
    std::fs::remove_dir_all(root.path().join("700/task/701")).unwrap();
    assert_eq!(used(&mut sim, 0), 0);
}

#[test]
fn a_reused_pid_is_not_the_holder() {
    let root = tempfile::tempdir().unwrap();
    write_stat(root.path(), 800, None, 'S', 100);
    let w = World::new(
        Some(root.path()),
        vec![alloc(0, 800, GIB, AfterExit::Release)],
    );
    let mut sim = w.sim();
    assert_eq!(used(&mut sim, 0), GIB);
    write_stat(root.path(), 800, None, 'S', 999);
    assert_eq!(used(&mut sim, 0), 0, "same pid, another start time");
    write_stat(root.path(), 800, None, 'S', 100);
    assert_eq!(used(&mut sim, 0), 0, "gone is sticky");
}

#[test]
fn mig_mode_reports_per_process_memory_as_not_available() {
    let p = sleeper();
    let w = World::new(None, vec![alloc(0, p.0.id(), GIB, AfterExit::Release)]);
    store::update_state(&w.path(), |s| s.gpus[0].mig = true).unwrap();
    let obs = w.sim().observe().unwrap();
    assert_eq!(obs.gpus[0].used, GIB);
    assert_eq!(obs.gpus[0].processes[0].used_bytes, None);
}

#[test]
fn faults_fire_after_n_calls_for_t_calls_per_gpu() {
    let w = World::new(None, vec![]);
    store::update_state(&w.path(), |s| {
        s.gpus[1].faults.push(Fault {
            call: "nvmlDeviceGetMemoryInfo_v2".into(),
            code: 15,
            after_calls: 2,
            times: Some(2),
            delay_ms: None,
        })
    })
    .unwrap();
    let mut sim = w.sim();
    let seen: Vec<Option<u32>> = (0..5)
        .map(|_| sim.fault("nvmlDeviceGetMemoryInfo_v2", Some(1)))
        .collect();
    assert_eq!(seen, vec![None, None, Some(15), Some(15), None]);
    assert_eq!(sim.fault("nvmlDeviceGetMemoryInfo_v2", Some(0)), None);
    assert_eq!(sim.fault("nvmlDeviceGetName", Some(1)), None);
}

#[test]
fn a_stalled_call_blocks_then_answers() {
    let w = World::new(None, vec![]);
    store::update_state(&w.path(), |s| {
        s.gpus[0].faults.push(Fault {
            call: "nvmlDeviceGetMemoryInfo_v2".into(),
            code: 0,
            after_calls: 1,
            times: Some(1),
            delay_ms: Some(300),
        })
    })
    .unwrap();
    let mut sim = w.sim();
    let timed = |sim: &mut Sim| {
        let t = std::time::Instant::now();
        let r = sim.fault("nvmlDeviceGetMemoryInfo_v2", Some(0));
        (r, t.elapsed())
    };
    let (r, fast) = timed(&mut sim);
    assert_eq!(r, None);
    assert!(fast < std::time::Duration::from_millis(100), "{fast:?}");
    let (r, slow) = timed(&mut sim);
    assert_eq!(r, None, "a stall with code 0 then succeeds");
    assert!(slow >= std::time::Duration::from_millis(300), "{slow:?}");
    assert!(timed(&mut sim).1 < std::time::Duration::from_millis(100));
    // A stall alone is valid; code 0 without one is not an error at all.
    let err = store::update_state(&w.path(), |s| {
        s.gpus[0].faults[0].delay_ms = None;
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("faults[0].code") && err.contains("delay_ms"),
        "{err}"
    );
}

#[test]
fn state_changes_are_picked_up_between_calls() {
    let p = sleeper();
    let w = World::new(None, vec![]);
    let mut sim = w.sim();
    assert_eq!(used(&mut sim, 0), 0);
    store::add_allocation(&w.path(), alloc(0, p.0.id(), 3 * GIB, AfterExit::Release)).unwrap();
    assert_eq!(used(&mut sim, 0), 3 * GIB);
}

#[test]
fn a_broken_state_file_is_reported_with_its_path() {
    let w = World::new(None, vec![]);
    std::fs::write(w.path(), "{ \"gpus\": [ }").unwrap();
    let err = Sim::open(w.path()).unwrap_err().to_string();
    assert!(err.contains("state.json"), "{err}");
    assert!(err.contains("line 1"), "{err}");
    let err = Sim::open(w.dir.path().join("missing.json"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("missing.json") && err.contains("No such file"),
        "{err}"
    );
}

/// A state written by hand names the children that keep a context (`held_by`): as on a real
/// driver, the dead creator stays listed with the memory until the last of them exits.
#[test]
fn a_context_held_by_children_stays_listed_under_its_dead_creator() {
    let mut owner = sleeper();
    let mut child = sleeper();
    let owner_pid = owner.0.id();
    let mut a = alloc(0, owner_pid, 5 * GIB, AfterExit::ReleaseAfterMs(300));
    a.held_by = vec![child.0.id()];
    let w = World::new(None, vec![a]);
    let mut sim = w.sim();
    assert_eq!(sim.observe().unwrap().gpus[0].processes.len(), 1);
    owner.0.kill().unwrap();
    owner.0.wait().unwrap();
    let obs = sim.observe().unwrap();
    assert_eq!(obs.gpus[0].used, 5 * GIB, "the child keeps the context");
    assert_eq!(
        listed(&obs.gpus[0]),
        vec![(owner_pid, Some(5 * GIB))],
        "the dead creator is listed (nvidia-smi: \"[Not Found]\"), the child is not"
    );
    // Time must pass beyond the lag (300 ms) since the creator's death: looked at all along
    // until the clock says 400 ms, so a release at any moment of it is seen.
    let died = Instant::now();
    while died.elapsed() < Duration::from_millis(400) {
        assert_eq!(
            used(&mut sim, 0),
            5 * GIB,
            "still held ({:?}): the lag starts when the last keeper goes",
            died.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let t = Instant::now();
    while used(&mut sim, 0) != 0 {
        assert!(t.elapsed() < Duration::from_secs(3));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
}

fn listed(g: &vramguard_sim::ObservedGpu) -> Vec<(u32, Option<u64>)> {
    g.processes.iter().map(|p| (p.pid, p.used_bytes)).collect()
}

#[test]
fn utilization_samples_carry_the_time_of_their_sampling_period() {
    use vramguard_sim::model::{UTILIZATION_SAMPLE_PERIOD_US, last_utilization_sample_us};
    let t = last_utilization_sample_us(1_000_000);
    assert_eq!(t % UTILIZATION_SAMPLE_PERIOD_US, 0);
    assert!(t <= 1_000_000_000 && 1_000_000_000 - t < UTILIZATION_SAMPLE_PERIOD_US);
    // Within one period, the same sample; the next period, a newer one.
    let period_ms = UTILIZATION_SAMPLE_PERIOD_US / 1000;
    let start_ms = t.div_ceil(1000);
    assert_eq!(last_utilization_sample_us(start_ms), t);
    assert_eq!(last_utilization_sample_us(start_ms + period_ms - 1), t);
    assert_eq!(
        last_utilization_sample_us(start_ms + period_ms + 1),
        t + UTILIZATION_SAMPLE_PERIOD_US
    );
}

#[test]
fn a_reported_pid_must_be_one_the_process_has_in_some_namespace() {
    let world = World::new(None, vec![]);
    let p = sleeper();
    let mut a = alloc(0, p.0.id(), GIB, AfterExit::Release);
    a.reported_pid = Some(3_999_999);
    let err = vramguard_sim::store::update_state(&world.path(), |s| s.allocations.push(a))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("allocations[0].reported_pid")
            && err.contains("is not a pid of process")
            && err.contains("report_namespace_pid"),
        "{err}"
    );
    // Its own pid (NSpid of a process in the host namespace) is coherent.
    let mut ok = alloc(0, p.0.id(), GIB, AfterExit::Release);
    ok.reported_pid = Some(p.0.id());
    vramguard_sim::store::update_state(&world.path(), |s| s.allocations.push(ok)).unwrap();
}

/// A real H200 (driver 580.159.04) samples an idle context at 1 % SM (and the whole GPU at
/// 0 %); a busy one reads its own load.
#[test]
fn an_idle_live_context_is_sampled_at_one_percent_sm() {
    use vramguard_sim::model::IDLE_CONTEXT_SM_PERCENT;
    let idle = sleeper();
    let busy = sleeper();
    let mut b = alloc(0, busy.0.id(), GIB, AfterExit::Release);
    b.sm_util = 40;
    let w = World::new(
        None,
        vec![alloc(0, idle.0.id(), GIB, AfterExit::Release), b],
    );
    let mut sim = w.sim();
    let g = sim.observe().unwrap().gpus.remove(0);
    let mut samples: Vec<(u32, u32)> = g.utilization.iter().map(|u| (u.pid, u.sm_util)).collect();
    samples.sort_unstable();
    let mut want = vec![(idle.0.id(), IDLE_CONTEXT_SM_PERCENT), (busy.0.id(), 40)];
    want.sort_unstable();
    assert_eq!(samples, want);
    assert_eq!(g.gpu_utilization().0, 40, "the idle context adds no load");
}

/// The stand-in device files this process has open, by name.
fn own_device_files(dev: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.starts_with(dev))
        .map(|target| target.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// With `nvml_client_files`, the in-process simulator holds what driver 580's NVML holds
/// while initialised (the control, unified-memory and every GPU's file), and lets go when
/// dropped; without it, nothing.
#[test]
fn an_nvml_client_holds_the_device_files_only_where_the_state_says_so() {
    let world = World::new(None, vec![]);
    let dev = world.dir.path().join("dev");
    // A real client maps libnvidia-ml (and no libcuda): what tells it from a CUDA process.
    let maps_nvml = || {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .any(|l| l.ends_with(&format!("{}/.driver/libnvidia-ml.so.1", dev.display())))
    };
    let plain = vramguard_sim::SimSource::open(&world.path()).unwrap();
    assert_eq!(own_device_files(&dev), Vec::<String>::new());
    assert!(!maps_nvml());
    drop(plain);
    world.update(|s| s.nvml_client_files = true);
    let client = vramguard_sim::SimSource::open(&world.path()).unwrap();
    assert_eq!(
        own_device_files(&dev),
        ["nvidia-uvm", "nvidia0", "nvidia1", "nvidiactl"]
    );
    assert!(maps_nvml(), "the NVML stand-in is mapped while initialised");
    drop(client);
    assert_eq!(own_device_files(&dev), Vec::<String>::new());
    assert!(!maps_nvml(), "and unmapped at shutdown");
}
