//! The in-process model and the NVML path (nvml-wrapper → the simulator's
//! `libnvidia-ml.so.1`) must give identical GPU samples for the same state.

use std::sync::Mutex;
use std::time::{Duration, Instant};
use vramguard_core::snapshot::{GpuSample, ProcessKind, ProcessListState};
use vramguard_gpu::{GpuSource, NvmlSource, SourceError};
use vramguard_sim::SimSource;
use vramguard_sim::state::{AfterExit, AllocationKind, Fault, Quirk};
use vramguard_testkit::{GIB, Reaped, World, allocation, sim_nvml_lib, sim_nvml_lib_535};

/// The NVML library is a process-wide singleton configured through the environment: tests
/// that load it take turns.
static NVML: Mutex<()> = Mutex::new(());

fn nvml_sample(world: &World) -> Result<vramguard_gpu::DriverSample, SourceError> {
    // SAFETY: every test that touches the environment holds NVML.
    unsafe { std::env::set_var("VRAMGUARD_SIM", world.state_path()) };
    let mut source = NvmlSource::open(Some(&sim_nvml_lib()))?;
    source.sample(Duration::from_secs(600))
}

/// Timestamps differ between two readings; everything else must not.
fn normalized(mut gpus: Vec<GpuSample>) -> Vec<GpuSample> {
    for g in &mut gpus {
        if let Some(u) = g.utilization.as_mut() {
            u.since_ms = 0;
            for s in &mut u.samples {
                s.last_seen_ms = 0;
                s.last_busy_ms = s.last_busy_ms.map(|_| 0);
            }
        }
    }
    gpus
}

/// Four GPUs, each showing one thing: compute and graphics holders with utilization (0), MIG
/// (1), a driver whose `_v3` records are 32 bytes, with leaked residue (2), a lost GPU (3).
/// The holders live as long as what is returned.
fn four_gpu_world() -> (World, Vec<Reaped>) {
    let world = World::new(4);
    let trainer = world.holder(&["nvidiactl", "nvidia0"], 60);
    let viewer = world.holder(&["nvidiactl", "nvidia0"], 60);
    let mig_user = world.holder(&["nvidiactl", "nvidia1"], 60);
    let old_driver_user = world.holder(&["nvidiactl", "nvidia2"], 60);
    let old_driver_user_2 = world.holder(&["nvidiactl", "nvidia2"], 60);
    let mut busy = allocation(0, trainer.pid(), 16 * GIB);
    busy.sm_util = 87;
    busy.mem_util = 40;
    world.allocate(busy);
    let mut gfx = allocation(0, viewer.pid(), GIB);
    gfx.kind = AllocationKind::Graphics;
    world.allocate(gfx);
    let mut both = allocation(0, viewer.pid(), GIB);
    both.kind = AllocationKind::Compute;
    world.allocate(both);
    world.allocate(allocation(1, mig_user.pid(), 10 * GIB));
    world.allocate(allocation(2, old_driver_user.pid(), 7 * GIB));
    world.allocate(allocation(2, old_driver_user_2.pid(), GIB));
    let mut leak = allocation(2, 999_999, 3 * GIB);
    leak.after_exit = AfterExit::Leak;
    world.allocate(leak);
    world.update(|s| {
        s.gpus[1].mig = true;
        s.gpus[2].quirks.push(Quirk::V3Records32Bytes);
        s.gpus[3].faults.push(Fault {
            call: "nvmlDeviceGetMemoryInfo_v2".into(),
            code: 15,
            after_calls: 0,
            times: None,
            delay_ms: None,
        });
    });
    (
        world,
        vec![
            trainer,
            viewer,
            mig_user,
            old_driver_user,
            old_driver_user_2,
        ],
    )
}

#[test]
fn in_process_and_nvml_paths_agree() {
    let _guard = NVML.lock().unwrap_or_else(|p| p.into_inner());
    let (world, holders) = four_gpu_world();
    let [_, viewer, _, old_driver_user, old_driver_user_2] = &holders[..] else {
        unreachable!()
    };
    let via_nvml = nvml_sample(&world).unwrap();
    let in_process = SimSource::open(&world.state_path())
        .unwrap()
        .sample(Duration::from_secs(600))
        .unwrap();
    assert_eq!(
        via_nvml.driver.driver_version.as_deref(),
        Some("580.159.03")
    );
    assert_eq!(
        via_nvml.driver.driver_version,
        in_process.driver.driver_version
    );
    assert_eq!(via_nvml.driver.nvml_version, in_process.driver.nvml_version);
    let (a, b) = (normalized(via_nvml.gpus), normalized(in_process.gpus));
    assert_eq!(a, b);

    // And the content is what the state says.
    let g0 = &a[0];
    assert_eq!(g0.memory.unwrap().used, 18 * GIB);
    assert_eq!(g0.processes.len(), 2);
    let v = g0.processes.iter().find(|p| p.pid == viewer.pid()).unwrap();
    assert_eq!(v.kinds, vec![ProcessKind::Compute, ProcessKind::Graphics]);
    assert_eq!(g0.utilization.as_ref().unwrap().samples[0].sm_percent, 87);
    assert_eq!(g0.pci_bus_id.as_deref(), Some("00000000:19:00.0"));
    assert_eq!(g0.minor_number, Some(0));
    assert_eq!(
        a[1].processes[0].used_bytes, None,
        "MIG: not available, never a number"
    );
    // The second 24-byte record read out of the 32-byte ones is misaligned (pid 0): the
    // implausible list is replaced by the `_v2` one.
    assert_eq!(
        a[2].processes.len(),
        2,
        "misaligned _v3 records replaced by _v2"
    );
    assert_eq!(
        a[2].processes[0].pid,
        old_driver_user.pid().min(old_driver_user_2.pid())
    );
    assert_eq!(a[2].process_list, ProcessListState::Complete);
    assert!(a[2].warnings.iter().any(|w| w.message.contains("_v2")));
    assert_eq!(
        a[2].memory.unwrap().used,
        11 * GIB,
        "residue counts as used"
    );
    let lost = a[3].failure.as_ref().unwrap();
    assert_eq!(lost.code, Some(15));
    assert_eq!(lost.message, "GPU is lost");
}

/// The settled reading of the agent's quiet samples (UUID, memory, process lists, Xid
/// events) is the same on both paths, and is the full reading's settled part: on a GPU in MIG
/// mode, on the `_v2` fallback with its warning, and on a lost GPU.
#[test]
fn both_paths_settled_readings_agree_and_are_the_full_readings_settled_part() {
    let _guard = NVML.lock().unwrap_or_else(|p| p.into_inner());
    let (world, _holders) = four_gpu_world();
    // SAFETY: every test that touches the environment holds NVML.
    unsafe { std::env::set_var("VRAMGUARD_SIM", world.state_path()) };
    let mut via_nvml = NvmlSource::open(Some(&sim_nvml_lib())).unwrap();
    let mut in_process = SimSource::open(&world.state_path()).unwrap();
    let full = via_nvml.sample(Duration::from_secs(600)).unwrap().gpus;
    let settled = via_nvml.settled().unwrap().gpus;
    assert_eq!(settled, in_process.settled().unwrap().gpus);
    assert_eq!(
        settled,
        full.iter().map(GpuSample::settled_part).collect::<Vec<_>>()
    );
    assert!(
        settled[0].name.is_none() && settled[0].telemetry.is_none(),
        "{settled:#?}"
    );
    assert_eq!(settled[0].processes.len(), 2);
    assert_eq!(
        settled[1].processes[0].used_bytes, None,
        "MIG: not available"
    );
    assert!(
        settled[2]
            .warnings
            .iter()
            .any(|w| w.message.contains("_v2"))
    );
    assert_eq!(settled[3].failure.as_ref().and_then(|f| f.code), Some(15));
    for (s, f) in settled.iter().zip(&full) {
        assert!(s.settled_alike(f), "GPU {}", s.index);
    }
}

/// Not a test: the body of a holder process when this binary is re-executed as one.
#[test]
fn holder_process() {
    vramguard_testkit::run_if_holder();
}

/// Issue 25: a creator SIGKILLed while a child it forked after creating its context lives.
/// Both paths list the dead pid with the context's memory and an idle (1 %) sample, as a real
/// H200 does; once the child exits both show the memory back and nobody listed.
#[test]
fn a_dead_creator_kept_by_its_forked_child_is_the_same_on_both_paths() {
    use vramguard_sim::holder::{Hold, HolderSpec};
    let _guard = NVML.lock().unwrap_or_else(|p| p.into_inner());
    let world = World::new(1);
    let mut h = vramguard_testkit::start_holder(
        &world,
        HolderSpec {
            holds: vec![Hold::on(0, 5 * GIB)],
            group_leader: true,
            forked_workers: 1,
            ..HolderSpec::new(world.state_path(), 60_000)
        },
    );
    let dead = h.ready.pid;
    h.crash();
    let both = || {
        let via_nvml = nvml_sample(&world).unwrap();
        let in_process = SimSource::open(&world.state_path())
            .unwrap()
            .sample(Duration::from_secs(600))
            .unwrap();
        let (a, b) = (normalized(via_nvml.gpus), normalized(in_process.gpus));
        assert_eq!(a, b);
        a.into_iter().next().unwrap()
    };
    let g = both();
    assert_eq!(g.memory.unwrap().used, 5 * GIB);
    let listed: Vec<_> = g.processes.iter().map(|p| (p.pid, p.used_bytes)).collect();
    assert_eq!(listed, vec![(dead, Some(5 * GIB))]);
    let samples: Vec<_> = g
        .utilization
        .as_ref()
        .unwrap()
        .samples
        .iter()
        .map(|s| (s.pid, s.sm_percent, s.last_busy_ms))
        .collect();
    assert_eq!(
        samples,
        vec![(dead, 1, None)],
        "idle: seen at 1 %, never busy"
    );
    let child = h.ready.workers[0];
    // SAFETY: kill(2) on the child this test's holder forked.
    unsafe { libc::kill(child as i32, libc::SIGKILL) };
    let t = std::time::Instant::now();
    while std::path::Path::new(&format!("/proc/{child}")).exists() {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(2));
    }
    let g = both();
    assert_eq!(g.memory.unwrap().used, 0);
    assert!(g.processes.is_empty(), "{:?}", g.processes);
}

#[test]
fn no_library_is_a_clear_no_driver_error() {
    let err =
        NvmlSource::open(Some(std::path::Path::new("/nonexistent/libnvidia-ml.so.1"))).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("no NVIDIA driver: /nonexistent/libnvidia-ml.so.1 could not be loaded"),
        "{msg}"
    );
    assert!(msg.contains("try `vramguard demo`"), "{msg}");
}

#[test]
fn an_injected_init_failure_is_reported_with_advice() {
    let _guard = NVML.lock().unwrap_or_else(|p| p.into_inner());
    let world = World::new(1);
    world.update(|s| {
        s.faults.push(Fault {
            call: "nvmlInit_v2".into(),
            code: 9,
            after_calls: 0,
            times: None,
            delay_ms: None,
        })
    });
    let msg = nvml_sample(&world).unwrap_err().to_string();
    assert!(
        msg.contains("nvmlInit_v2: Driver Not Loaded (code 9)"),
        "{msg}"
    );
    assert!(msg.contains("lsmod"), "{msg}");
    let msg = SimSource::open(&world.state_path())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("nvmlInit_v2: Driver Not Loaded (code 9)"),
        "{msg}"
    );
}

#[test]
fn a_timeout_after_some_calls_fails_only_that_gpu() {
    let _guard = NVML.lock().unwrap_or_else(|p| p.into_inner());
    let world = World::new(2);
    let h = world.holder(&["nvidia0"], 60);
    world.allocate(allocation(0, h.pid(), GIB));
    world.update(|s| {
        s.gpus[1].faults.push(Fault {
            call: "nvmlDeviceGetComputeRunningProcesses_v3".into(),
            code: 10,
            after_calls: 1,
            times: None,
            delay_ms: None,
        })
    });
    let mut src = {
        unsafe { std::env::set_var("VRAMGUARD_SIM", world.state_path()) };
        NvmlSource::open(Some(&sim_nvml_lib())).unwrap()
    };
    let first = src.sample(Duration::from_secs(60)).unwrap();
    assert_eq!(first.gpus[1].process_list, ProcessListState::Complete);
    let second = src.sample(Duration::from_secs(60)).unwrap();
    match &second.gpus[1].process_list {
        ProcessListState::Unavailable { error } => {
            assert_eq!(error.code, Some(10));
            assert_eq!(error.message, "Timeout");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(second.gpus[0].processes.len(), 1, "GPU 0 unaffected");
}

#[test]
fn health_and_xid_events_agree_and_count_only_what_came_after_open() {
    use vramguard_sim::state::{SimRemappedRows, SimRetiredPages};
    let _guard = NVML.lock().unwrap_or_else(|p| p.into_inner());
    let world = World::new(3);
    world.update(|s| {
        s.gpus[0].health.remapped_rows = Some(SimRemappedRows {
            correctable: 3,
            pending: true,
            ..Default::default()
        });
        // An older GPU: page retirement instead of row remapping.
        s.gpus[1].health.remapped_rows = None;
        s.gpus[1].health.retired_pages = Some(SimRetiredPages {
            single_bit_ecc: vec![0x1000, 0x2000],
            double_bit_ecc: vec![0x3000],
            pending: true,
        });
        // Raised before anyone listened: never counted.
        s.gpus[0].health.xid_events = vec![48];
    });
    let mut via_nvml = {
        unsafe { std::env::set_var("VRAMGUARD_SIM", world.state_path()) };
        NvmlSource::open(Some(&sim_nvml_lib())).unwrap()
    };
    let mut in_process = SimSource::open(&world.state_path()).unwrap();
    world.update(|s| {
        s.gpus[0].health.xid_events.push(79);
        s.gpus[2].health.xid_events.extend([94, 94]);
    });
    // The library answers from one observation per millisecond (one instant of the driver):
    // after a change, time must pass beyond that millisecond (on the clock) for the next
    // answer to come from an observation made after it.
    let settle = || {
        let changed = Instant::now();
        while changed.elapsed() <= Duration::from_millis(2) {
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    settle();
    let window = Duration::from_secs(60);
    let (a, b) = (
        via_nvml.sample(window).unwrap().gpus,
        in_process.sample(window).unwrap().gpus,
    );
    assert_eq!(normalized(a.clone()), normalized(b));
    let rows = a[0].health.remapped_rows.unwrap();
    assert_eq!((rows.correctable, rows.pending), (3, true));
    assert!(a[0].health.reset_pending());
    assert_eq!(
        a[0].health.retired_pages, None,
        "Hopper does not retire pages"
    );
    let pages = a[1].health.retired_pages.unwrap();
    assert_eq!(
        (pages.single_bit_ecc, pages.double_bit_ecc, pages.pending),
        (2, 1, true)
    );
    assert_eq!(a[1].health.remapped_rows, None);
    let xids = |g: &GpuSample| -> Vec<(u64, u64)> {
        g.health
            .xid_events
            .iter()
            .map(|x| (x.xid, x.count))
            .collect()
    };
    assert_eq!(
        xids(&a[0]),
        vec![(79, 1)],
        "the Xid 48 from before open is not counted"
    );
    assert_eq!(xids(&a[2]), vec![(94, 2)]);
    assert!(a.iter().all(|g| g.warnings.is_empty()), "{a:?}");

    // Counts are cumulative: nothing new, nothing added; a new event adds one.
    world.update(|s| s.gpus[2].health.xid_events.push(94));
    settle();
    let (a, b) = (
        via_nvml.sample(window).unwrap().gpus,
        in_process.sample(window).unwrap().gpus,
    );
    assert_eq!(normalized(a.clone()), normalized(b));
    assert_eq!(xids(&a[0]), vec![(79, 1)]);
    assert_eq!(xids(&a[2]), vec![(94, 3)]);

    // A reset applies the pending remap; the counts stay.
    let mut sim = vramguard_sim::Sim::open(world.state_path()).unwrap();
    sim.reset(0).unwrap();
    settle();
    let a = via_nvml.sample(window).unwrap().gpus;
    let rows = a[0].health.remapped_rows.unwrap();
    assert_eq!((rows.correctable, rows.pending), (3, false));
}

/// Both sources on `world`, with a fault that always returns `code` from `call` on `gpu`.
/// The caller holds `NVML`.
fn both_with_fault(world: &World, gpu: usize, call: &str, code: u32) -> (NvmlSource, SimSource) {
    world.update(|s| {
        s.gpus[gpu].faults.push(Fault {
            call: call.into(),
            code,
            after_calls: 0,
            times: None,
            delay_ms: None,
        })
    });
    // SAFETY: every test that touches the environment holds NVML.
    unsafe { std::env::set_var("VRAMGUARD_SIM", world.state_path()) };
    (
        NvmlSource::open(Some(&sim_nvml_lib())).unwrap(),
        SimSource::open(&world.state_path()).unwrap(),
    )
}

#[test]
fn a_failing_event_wait_is_a_warning_not_a_failure() {
    let _guard = NVML.lock().unwrap_or_else(|p| p.into_inner());
    let world = World::new(1);
    let (mut via_nvml, mut in_process) = both_with_fault(&world, 0, "nvmlEventSetWait_v2", 999);
    for gpus in [
        via_nvml.sample(Duration::from_secs(60)).unwrap().gpus,
        in_process.sample(Duration::from_secs(60)).unwrap().gpus,
    ] {
        assert_eq!(gpus[0].failure, None);
        assert!(gpus[0].memory.is_some());
        let w: Vec<&str> = gpus[0].warnings.iter().map(|w| w.call.as_str()).collect();
        assert_eq!(w, vec!["nvmlEventSetWait_v2"]);
    }
}

#[test]
fn an_event_registration_refused_is_reported_once() {
    let _guard = NVML.lock().unwrap_or_else(|p| p.into_inner());
    let world = World::new(2);
    let (mut via_nvml, mut in_process) = both_with_fault(&world, 1, "nvmlDeviceRegisterEvents", 4);
    let window = Duration::from_secs(60);
    let warned = |gpus: &[GpuSample]| -> Vec<(u32, String)> {
        gpus.iter()
            .flat_map(|g| g.warnings.iter().map(|w| (g.index, w.to_string())))
            .collect()
    };
    for source in [&mut via_nvml as &mut dyn GpuSource, &mut in_process] {
        let first = source.sample(window).unwrap().gpus;
        assert_eq!(
            warned(&first),
            vec![(
                1,
                "nvmlDeviceRegisterEvents: Insufficient Permissions (code 4)".to_string()
            )]
        );
        assert!(first.iter().all(|g| g.failure.is_none()));
        let second = source.sample(window).unwrap().gpus;
        assert_eq!(
            warned(&second),
            vec![],
            "reported once, not at every sample"
        );
    }
}

/// The simulator's library loaded through NVIDIA's ABI and initialised on `world` (the caller
/// holds NVML).
///
/// # Safety
/// Loads a shared library.
unsafe fn sim_library(world: &World) -> nvml_wrapper_sys::bindings::NvmlLib {
    // SAFETY: every test that touches the environment holds NVML.
    unsafe { std::env::set_var("VRAMGUARD_SIM", world.state_path()) };
    let lib = unsafe { nvml_wrapper_sys::bindings::NvmlLib::new(sim_nvml_lib()) }.unwrap();
    assert_eq!(unsafe { lib.nvmlInit_v2() }, 0);
    lib
}

/// A zeroed 24-byte process record.
const EMPTY_RECORD: nvml_wrapper_sys::bindings::nvmlProcessInfo_t =
    nvml_wrapper_sys::bindings::nvmlProcessInfo_t {
        pid: 0,
        usedGpuMemory: 0,
        gpuInstanceId: 0,
        computeInstanceId: 0,
    };

/// The handle of GPU `index`.
fn device(
    lib: &nvml_wrapper_sys::bindings::NvmlLib,
    index: u32,
) -> nvml_wrapper_sys::bindings::nvmlDevice_t {
    let mut dev = std::ptr::null_mut();
    // SAFETY: a valid out pointer.
    assert_eq!(
        unsafe { lib.nvmlDeviceGetHandleByIndex_v2(index, &mut dev) },
        0
    );
    dev
}

#[test]
fn the_legacy_unversioned_process_list_gives_16_byte_records() {
    // nvidia-ml-py3 and other old bindings call the unversioned symbol, which a real 580
    // driver still exports, with `{pid, usedGpuMemory}` records.
    use nvml_wrapper_sys::bindings::nvmlProcessInfo_v1_t;
    let _guard = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let world = World::new(1);
    let holder = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    world.allocate(allocation(0, holder.pid(), 3 * GIB));
    assert_eq!(std::mem::size_of::<nvmlProcessInfo_v1_t>(), 16);
    // SAFETY: the simulator's library, loaded for its C ABI; every pointer is valid.
    unsafe {
        let lib = sim_library(&world);
        let dev = device(&lib, 0);
        let list = lib.nvmlDeviceGetComputeRunningProcesses.as_ref().unwrap();
        let mut count = 0;
        assert_eq!(
            list(dev, &mut count, std::ptr::null_mut()),
            7,
            "INSUFFICIENT_SIZE"
        );
        assert_eq!(count, 1);
        let mut infos = [nvmlProcessInfo_v1_t {
            pid: 0,
            usedGpuMemory: 0,
        }; 2];
        count = 2;
        assert_eq!(list(dev, &mut count, infos.as_mut_ptr()), 0);
        assert_eq!(count, 1);
        assert_eq!(infos[0].pid, holder.pid());
        assert_eq!(infos[0].usedGpuMemory, 3 * GIB);
        assert_eq!(infos[1].pid, 0, "nothing written past the records");
        let graphics = lib.nvmlDeviceGetGraphicsRunningProcesses.as_ref().unwrap();
        count = 0;
        assert_eq!(graphics(dev, &mut count, std::ptr::null_mut()), 0);
        assert_eq!(count, 0);
        lib.nvmlShutdown();
    }
}

#[test]
fn utilization_temperature_and_power_follow_the_busy_processes() {
    // What nvitop, gpustat and nvidia-smi show first, asked the way they ask.
    use nvml_wrapper_sys::bindings::{nvmlDevice_t, nvmlUtilization_t};
    let _guard = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let world = World::new(2);
    let busy = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    let mut a = allocation(0, busy.pid(), 3 * GIB);
    a.sm_util = 60;
    a.mem_util = 25;
    world.allocate(a);
    // SAFETY: the simulator's library, loaded for its C ABI; every pointer is valid.
    unsafe {
        let lib = sim_library(&world);
        let handle = |i| device(&lib, i);
        let (g0, g1) = (handle(0), handle(1));
        let rates = |dev| {
            let mut u = nvmlUtilization_t { gpu: 0, memory: 0 };
            assert_eq!(lib.nvmlDeviceGetUtilizationRates(dev, &mut u), 0);
            (u.gpu, u.memory)
        };
        assert_eq!(rates(g0), (60, 25));
        assert_eq!(rates(g1), (0, 0));
        let temp = |dev, sensor| {
            let mut t = 0;
            (lib.nvmlDeviceGetTemperature(dev, sensor, &mut t), t)
        };
        assert_eq!(temp(g0, 0), (0, 57));
        assert_eq!(temp(g1, 0), (0, 30));
        assert_eq!(
            temp(g0, 7).0,
            2,
            "INVALID_ARGUMENT for a sensor NVML does not define"
        );
        let mw = |f: &dyn Fn(nvmlDevice_t, *mut u32) -> u32, dev| {
            let mut v = 0;
            assert_eq!(f(dev, &mut v), 0);
            v
        };
        let usage = |d, p| lib.nvmlDeviceGetPowerUsage(d, p);
        let limit = |d, p| lib.nvmlDeviceGetEnforcedPowerLimit(d, p);
        assert_eq!(mw(&usage, g0), 75_000 + 6_250 * 60);
        assert_eq!(mw(&usage, g1), 75_000);
        assert_eq!(mw(&limit, g0), 700_000);
        lib.nvmlShutdown();
    }
}

#[test]
fn the_properties_monitoring_tools_read_first_are_answered() {
    let _guard = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let world = World::new(2);
    world.update(|s| {
        s.gpus[1].name = "NVIDIA A100-SXM4-80GB".into();
        s.gpus[1].mig = true;
    });
    // SAFETY: the simulator's library, loaded for its C ABI; every pointer is valid.
    unsafe {
        let lib = sim_library(&world);
        let handle = |i| device(&lib, i);
        let (h200, a100) = (handle(0), handle(1));
        let cc = |dev| {
            let (mut major, mut minor) = (0, 0);
            assert_eq!(
                lib.nvmlDeviceGetCudaComputeCapability(dev, &mut major, &mut minor),
                0
            );
            (major, minor)
        };
        assert_eq!(cc(h200), (9, 0));
        assert_eq!(cc(a100), (8, 0));
        let mig = |dev| {
            let (mut cur, mut pending) = (9, 9);
            assert_eq!(lib.nvmlDeviceGetMigMode(dev, &mut cur, &mut pending), 0);
            (cur, pending)
        };
        assert_eq!(mig(h200), (0, 0));
        assert_eq!(mig(a100), (1, 1));
        let mut arch = 0;
        assert_eq!(lib.nvmlDeviceGetArchitecture(h200, &mut arch), 0);
        assert_eq!(arch, 9, "Hopper");
        let clock = |dev, kind, max: bool| {
            let mut mhz = 0;
            let r = if max {
                lib.nvmlDeviceGetMaxClockInfo(dev, kind, &mut mhz)
            } else {
                lib.nvmlDeviceGetClockInfo(dev, kind, &mut mhz)
            };
            (r, mhz)
        };
        assert_eq!(clock(h200, 1, true), (0, 1980));
        assert_eq!(clock(h200, 1, false), (0, 345), "idle SM clock");
        assert_eq!(
            clock(h200, 9, false).0,
            2,
            "INVALID_ARGUMENT for an unknown clock"
        );
        // No fan on an SXM board: a real H200 (driver 580.159.04) answers INVALID_ARGUMENT;
        // the other models keep NOT_SUPPORTED.
        let mut fan = 0;
        assert_eq!(lib.nvmlDeviceGetFanSpeed(h200, &mut fan), 2, "H200: no fan");
        assert_eq!(
            lib.nvmlDeviceGetFanSpeed_v2(h200, 0, &mut fan),
            2,
            "H200: no fan 0"
        );
        assert_eq!(lib.nvmlDeviceGetFanSpeed(a100, &mut fan), 3, "A100: no fan");
        let mut serial = [0 as std::ffi::c_char; 32];
        assert_eq!(lib.nvmlDeviceGetSerial(a100, serial.as_mut_ptr(), 32), 0);
        let serial = std::ffi::CStr::from_ptr(serial.as_ptr())
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(serial, "1654923000001");
        let mut small = [0 as std::ffi::c_char; 4];
        assert_eq!(
            lib.nvmlDeviceGetSerial(a100, small.as_mut_ptr(), 4),
            7,
            "INSUFFICIENT_SIZE for a short buffer"
        );
        let energy = |dev| {
            let mut mj = 0;
            assert_eq!(lib.nvmlDeviceGetTotalEnergyConsumption(dev, &mut mj), 0);
            mj
        };
        // Energy accrues with time: at least 75 W (idle) over 3/4 of the time measured between
        // the two reads (the library answers from observations up to a millisecond old; time
        // must pass for it: 200 ms on the clock).
        let e0 = energy(h200);
        let between = Instant::now();
        while between.elapsed() < Duration::from_millis(200) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let ms = between.elapsed().as_millis() as u64;
        let e1 = energy(h200);
        assert!(
            e1 >= e0 + 75_000 * ms * 3 / 4 / 1000,
            "75 W idle over {ms} ms: {e0} → {e1}"
        );
        let (mut width, mut cores, mut min, mut max) = (0, 0, 0, 0);
        assert_eq!(lib.nvmlDeviceGetMemoryBusWidth(h200, &mut width), 0);
        assert_eq!(lib.nvmlDeviceGetNumGpuCores(h200, &mut cores), 0);
        assert_eq!((width, cores), (6144, 16896), "an H200's");
        assert_eq!(
            lib.nvmlDeviceGetPowerManagementLimitConstraints(h200, &mut min, &mut max),
            0
        );
        assert_eq!((min, max), (200_000, 700_000));
        let mut part = [0 as std::ffi::c_char; 32];
        assert_eq!(
            lib.nvmlDeviceGetBoardPartNumber(h200, part.as_mut_ptr(), 32),
            0
        );
        let mut brand = 0;
        assert_eq!(lib.nvmlDeviceGetBrand(h200, &mut brand), 0);
        assert_eq!(brand, 14, "NVML_BRAND_NVIDIA");
        let mut bar1 = std::mem::zeroed::<nvml_wrapper_sys::bindings::nvmlBAR1Memory_t>();
        assert_eq!(lib.nvmlDeviceGetBAR1MemoryInfo(h200, &mut bar1), 0);
        assert_eq!(bar1.bar1Total, 256 * GIB, "the H200's aperture");
        assert_eq!(bar1.bar1Used + bar1.bar1Free, bar1.bar1Total);
        let mut tx = 0;
        assert_eq!(lib.nvmlDeviceGetPcieThroughput(h200, 0, &mut tx), 0);
        assert!(tx > 0);
        assert_eq!(
            lib.nvmlDeviceGetPcieThroughput(h200, 7, &mut tx),
            2,
            "INVALID_ARGUMENT"
        );
        lib.nvmlShutdown();
    }
}

#[test]
fn the_driver_names_a_process_by_its_argv0() {
    let _guard = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let world = World::new(1);
    let holder = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    // SAFETY: the simulator's library, loaded for its C ABI; every pointer is valid.
    unsafe {
        let lib = sim_library(&world);
        let mut name = [0 as std::ffi::c_char; 64];
        assert_eq!(
            lib.nvmlSystemGetProcessName(holder.pid(), name.as_mut_ptr(), 64),
            0
        );
        let name = std::ffi::CStr::from_ptr(name.as_ptr())
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(name, "sleep");
        let mut none = [0 as std::ffi::c_char; 64];
        assert_eq!(
            lib.nvmlSystemGetProcessName(4_194_304, none.as_mut_ptr(), 64),
            6,
            "NOT_FOUND for a pid that does not exist"
        );
        lib.nvmlShutdown();
    }
}

/// A 535.43-535.98 driver: GPU 0's `_v3` lists write 32-byte records. 20 processes: more than
/// the 15 a caller's 24-byte buffer (count + 5 records) holds of them.
fn driver_535_world(driver_version: &str) -> (World, Vec<vramguard_testkit::Reaped>) {
    let world = World::new(1);
    let holders: Vec<_> = (0..20)
        .map(|_| world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60))
        .collect();
    for (i, h) in holders.iter().enumerate() {
        world.allocate(allocation(0, h.pid(), (i as u64 + 1) * GIB));
    }
    let version = driver_version.to_string();
    world.update(move |s| {
        s.gpus[0].quirks.push(Quirk::V3Records32Bytes);
        s.driver_version = version;
    });
    (world, holders)
}

#[test]
fn a_535_driver_is_known_by_its_symbols_and_its_v3_lists_are_never_read() {
    let _guard = NVML.lock().unwrap_or_else(|e| e.into_inner());
    // A version outside the range: only the exported symbols tell.
    let (world, holders) = driver_535_world("535.154.05");
    unsafe { std::env::set_var("VRAMGUARD_SIM", world.state_path()) };
    let mut source = NvmlSource::open(Some(&sim_nvml_lib_535())).unwrap();
    let g = &source.sample(Duration::from_secs(600)).unwrap().gpus[0];
    let mut pids: Vec<u32> = g.processes.iter().map(|p| p.pid).collect();
    pids.sort_unstable();
    let mut want: Vec<u32> = holders.iter().map(|h| h.pid()).collect();
    want.sort_unstable();
    assert_eq!(pids, want);
    assert_eq!(g.process_list, ProcessListState::Complete);
    let total: u64 = g.processes.iter().filter_map(|p| p.used_bytes).sum();
    assert_eq!(total, 210 * GIB);
    assert!(
        g.warnings
            .iter()
            .any(|w| w.message.contains("32-byte `_v3` process records")),
        "{:?}",
        g.warnings
    );
    // The normal library (a fixed driver's symbols) reads `_v3`, finds the misaligned records
    // implausible and falls back: the same list, another warning.
    let mut fixed = NvmlSource::open(Some(&sim_nvml_lib())).unwrap();
    let g = &fixed.sample(Duration::from_secs(600)).unwrap().gpus[0];
    assert_eq!(g.processes.len(), 20);
    assert!(
        g.warnings
            .iter()
            .any(|w| w.message.contains("implausible record")),
        "{:?}",
        g.warnings
    );
}

#[test]
fn a_535_driver_version_is_enough_and_both_paths_agree() {
    let _guard = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let (world, _holders) = driver_535_world("535.54.03");
    let via_nvml = nvml_sample(&world).unwrap();
    let in_process = SimSource::open(&world.state_path())
        .unwrap()
        .sample(Duration::from_secs(600))
        .unwrap();
    let (a, b) = (normalized(via_nvml.gpus), normalized(in_process.gpus));
    assert_eq!(a, b);
    assert_eq!(a[0].processes.len(), 20);
    assert!(
        a[0].warnings
            .iter()
            .any(|w| w.message.contains("535.54.03"))
    );
}

#[test]
fn the_535_v3_records_are_32_bytes_and_the_detail_list_gives_them_whole() {
    use nvml_wrapper_sys::bindings::{nvmlProcessDetail_v1_t, nvmlProcessDetailList_v1_t};
    let _guard = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let (world, holders) = driver_535_world("535.54.03");
    // SAFETY: the simulator's library, loaded for its C ABI; every pointer is valid.
    unsafe {
        let lib = sim_library(&world);
        let dev = device(&lib, 0);
        // A caller of the 24-byte struct with room for 21 records: 15 whole 32-byte records
        // fit; the first reads right, the second is misaligned.
        let v3 = lib
            .nvmlDeviceGetComputeRunningProcesses_v3
            .as_ref()
            .unwrap();
        let mut infos = [EMPTY_RECORD; 21];
        let mut count = 21;
        assert_eq!(v3(dev, &mut count, infos.as_mut_ptr()), 0);
        assert_eq!(count, 20);
        assert_eq!(
            (infos[0].pid, infos[0].usedGpuMemory),
            (holders[0].pid(), GIB)
        );
        assert_eq!(infos[1].pid, 0, "record 1 starts inside record 0");
        assert_eq!(infos[1].usedGpuMemory, u64::from(holders[1].pid()));
        assert_eq!(infos[20].pid, 0, "nothing past what fits 21 x 24 bytes");
        // The detail list of a fixed driver: 32-byte records, every one right.
        let detail = lib.nvmlDeviceGetRunningProcessDetailList.as_ref().unwrap();
        let mut list = nvmlProcessDetailList_v1_t {
            version: (std::mem::size_of::<nvmlProcessDetailList_v1_t>() as u32) | (1 << 24),
            mode: 0,
            numProcArrayEntries: 0,
            procArray: std::ptr::null_mut(),
        };
        assert_eq!(detail(dev, &mut list), 7, "INSUFFICIENT_SIZE");
        assert_eq!(list.numProcArrayEntries, 20);
        let mut records = [nvmlProcessDetail_v1_t {
            pid: 0,
            usedGpuMemory: 0,
            gpuInstanceId: 0,
            computeInstanceId: 0,
            usedGpuCcProtectedMemory: 0,
        }; 20];
        list.procArray = records.as_mut_ptr();
        assert_eq!(detail(dev, &mut list), 0);
        for (r, h) in records.iter().zip(&holders) {
            assert_eq!(r.pid, h.pid());
        }
        assert_eq!(records[19].usedGpuMemory, 20 * GIB);
        list.version = 1;
        assert_eq!(detail(dev, &mut list), 25, "ARGUMENT_VERSION_MISMATCH");
        let mut info = std::mem::zeroed();
        assert_eq!(
            lib.nvmlDeviceGetConfComputeMemSizeInfo.as_ref().unwrap()(dev, &mut info),
            3,
            "NOT_SUPPORTED: confidential computing is off"
        );
        lib.nvmlShutdown();
    }
}

/// GPU 0 in MIG mode with two 3g.71gb devices: 10 GiB of one holder on the first, 4 GiB of
/// another on the second, and 3 GiB of residue left there by a process that is gone.
fn mig_world() -> (World, Reaped, Reaped) {
    let world = World::new(1);
    let a = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    let b = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    let on = |gpu_mig: u32, mut alloc: vramguard_sim::SimAllocation| {
        alloc.mig_device = Some(gpu_mig);
        alloc
    };
    let mut residue = allocation(0, 999_999, 3 * GIB);
    residue.after_exit = AfterExit::Leak;
    world.enable_mig(0, &[1, 2]);
    world.allocate(on(0, allocation(0, a.pid(), 10 * GIB)));
    world.allocate(on(1, allocation(0, b.pid(), 4 * GIB)));
    world.allocate(on(1, residue));
    (world, a, b)
}

#[test]
fn mig_devices_give_each_process_its_memory_on_both_paths() {
    let _guard = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let (world, a, b) = mig_world();
    let via_nvml = nvml_sample(&world).unwrap();
    let in_process = SimSource::open(&world.state_path())
        .unwrap()
        .sample(Duration::from_secs(600))
        .unwrap();
    let (x, y) = (normalized(via_nvml.gpus), normalized(in_process.gpus));
    assert_eq!(x, y);
    let g = &x[0];
    assert_eq!(g.memory.unwrap().used, 17 * GIB);
    let bytes = |pid| {
        g.processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap()
            .used_bytes
    };
    assert_eq!(bytes(a.pid()), Some(10 * GIB));
    assert_eq!(bytes(b.pid()), Some(4 * GIB));
    assert!(g.warnings.is_empty(), "{:?}", g.warnings);
}

#[test]
fn mig_device_handles_answer_as_nvml_does() {
    use nvml_wrapper_sys::bindings::nvmlMemory_t;
    let _guard = NVML.lock().unwrap_or_else(|e| e.into_inner());
    let (world, a, _b) = mig_world();
    // SAFETY: the simulator's library, loaded for its C ABI; every pointer is valid.
    unsafe {
        let lib = sim_library(&world);
        let gpu = device(&lib, 0);
        let mut max = 0;
        assert_eq!(lib.nvmlDeviceGetMaxMigDeviceCount(gpu, &mut max), 0);
        assert_eq!(max, 7);
        let mut mig = std::ptr::null_mut();
        assert_eq!(
            lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 2, &mut mig),
            6,
            "NOT_FOUND"
        );
        assert_eq!(lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0, &mut mig), 0);
        let mut is_mig = 0;
        assert_eq!(lib.nvmlDeviceIsMigDeviceHandle(mig, &mut is_mig), 0);
        assert_eq!(is_mig, 1);
        let mut parent = std::ptr::null_mut();
        assert_eq!(
            lib.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig, &mut parent),
            0
        );
        assert_eq!(parent, gpu);
        let (mut gi, mut ci) = (0, 0);
        assert_eq!(lib.nvmlDeviceGetGpuInstanceId(mig, &mut gi), 0);
        assert_eq!(lib.nvmlDeviceGetComputeInstanceId(mig, &mut ci), 0);
        assert_eq!((gi, ci), (1, 0));
        assert_eq!(
            lib.nvmlDeviceGetGpuInstanceId(gpu, &mut gi),
            3,
            "NOT_SUPPORTED"
        );
        let mut mem = std::mem::zeroed::<nvmlMemory_t>();
        assert_eq!(lib.nvmlDeviceGetMemoryInfo(mig, &mut mem), 0);
        assert_eq!((mem.total, mem.used), (66 * GIB, 10 * GIB));
        let list = lib
            .nvmlDeviceGetComputeRunningProcesses_v3
            .as_ref()
            .unwrap();
        let mut infos = [EMPTY_RECORD; 4];
        let mut count = 4;
        assert_eq!(list(mig, &mut count, infos.as_mut_ptr()), 0);
        assert_eq!(count, 1);
        assert_eq!((infos[0].pid, infos[0].usedGpuMemory), (a.pid(), 10 * GIB));
        assert_eq!((infos[0].gpuInstanceId, infos[0].computeInstanceId), (1, 0));
        // The whole GPU lists both, without their memory, with their instances.
        count = 4;
        assert_eq!(list(gpu, &mut count, infos.as_mut_ptr()), 0);
        assert_eq!(count, 2);
        assert_eq!(infos[0].usedGpuMemory, u64::MAX, "NVML_VALUE_NOT_AVAILABLE");
        assert_ne!(infos[0].gpuInstanceId, u32::MAX);
        lib.nvmlShutdown();
    }
}

/// Not a test: the body of [`a_caller_in_a_pid_namespace_gets_its_own_pids_on_both_paths`]'s
/// caller, this binary re-executed inside a PID namespace, when `PARITY_PROBE_OUT` names where
/// to write what both paths answered there.
#[test]
fn namespaced_caller_probe() {
    let Some(out) = std::env::var_os("PARITY_PROBE_OUT") else {
        return;
    };
    let state = std::path::PathBuf::from(std::env::var_os("VRAMGUARD_SIM").unwrap());
    let mut source = NvmlSource::open(Some(&sim_nvml_lib())).unwrap();
    let via_nvml = source.sample(Duration::from_secs(600)).unwrap();
    let in_process = SimSource::open(&state)
        .unwrap()
        .sample(Duration::from_secs(600))
        .unwrap();
    // The names the driver gives the pids the caller asks about: pid 1 of the namespace,
    // and the host holder's pid, which means nothing here.
    let host: u32 = std::env::var("PARITY_PROBE_HOST_PID")
        .unwrap()
        .parse()
        .unwrap();
    // SAFETY: the simulator's library, loaded for its C ABI; every pointer is valid.
    let names: Vec<(u32, String)> = unsafe {
        let lib = nvml_wrapper_sys::bindings::NvmlLib::new(sim_nvml_lib()).unwrap();
        assert_eq!(lib.nvmlInit_v2(), 0);
        let names = [1, host]
            .into_iter()
            .map(|pid| {
                let mut buf = [0 as std::ffi::c_char; 64];
                let r = lib.nvmlSystemGetProcessName(pid, buf.as_mut_ptr(), 64);
                let name = std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy();
                (r, name.into_owned())
            })
            .collect();
        lib.nvmlShutdown();
        names
    };
    let both = (
        normalized(via_nvml.gpus),
        normalized(in_process.gpus),
        names,
    );
    std::fs::write(out, serde_json::to_vec(&both).unwrap()).unwrap();
}

#[test]
fn a_caller_in_a_pid_namespace_gets_its_own_pids_on_both_paths() {
    let _guard = NVML.lock().unwrap_or_else(|p| p.into_inner());
    let world = World::new(2);
    world.enable_mig(1, &[1, 2]);
    // A host process, and a "pod": a PID namespace whose init (pid 1 there) holds the GPU,
    // and each one a MIG device of GPU 1.
    let host = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    let script = format!(
        "exec 3<{} 4<{} 5<{}; exec sleep 60",
        world.dev("nvidiactl").display(),
        world.dev("nvidia-uvm").display(),
        world.dev("nvidia0").display()
    );
    let pod = Reaped(
        std::process::Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "sh", "-c", &script])
            .spawn()
            .unwrap(),
    );
    let children = format!("/proc/{0}/task/{0}/children", pod.pid());
    let mut inner = None;
    for _ in 0..200 {
        inner = std::fs::read_to_string(&children)
            .ok()
            .and_then(|c| c.split_whitespace().next()?.parse::<u32>().ok())
            .filter(|p| {
                std::fs::read_link(format!("/proc/{p}/exe"))
                    .is_ok_and(|e| e.to_string_lossy().contains("sleep"))
            });
        if inner.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let inner = inner.expect("the pod's init started");
    let mut busy = allocation(0, host.pid(), 8 * GIB);
    busy.sm_util = 70;
    world.allocate(busy);
    let mut served = allocation(0, inner, 3 * GIB);
    served.sm_util = 40;
    world.allocate(served);
    for (pid, mig_device, gib) in [(host.pid(), 0, 4), (inner, 1, 2)] {
        let mut a = allocation(1, pid, gib * GIB);
        a.mig_device = Some(mig_device);
        world.allocate(a);
    }

    let out = world.dir.path().join("namespaced-probe.json");
    let probe = std::process::Command::new("nsenter")
        .args(["--target", &inner.to_string(), "--pid"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "namespaced_caller_probe", "--test-threads", "1"])
        .env("PARITY_PROBE_OUT", &out)
        .env("PARITY_PROBE_HOST_PID", host.pid().to_string())
        .env("VRAMGUARD_SIM", world.state_path())
        .output()
        .unwrap();
    assert!(
        probe.status.success(),
        "{}{}",
        String::from_utf8_lossy(&probe.stdout),
        String::from_utf8_lossy(&probe.stderr)
    );
    let (a, b, names): (Vec<GpuSample>, Vec<GpuSample>, Vec<(u32, String)>) =
        serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(
        names,
        vec![(0, "sleep".to_string()), (6, String::new())],
        "pid 1 there is the pod's sleep; the host's pid is NOT_FOUND there"
    );
    assert_eq!(a, b, "both paths, seen from the namespace");
    let g0 = &a[0];
    assert_eq!(g0.memory.unwrap().used, 11 * GIB, "used is the GPU's");
    let pids: Vec<u32> = g0.processes.iter().map(|p| p.pid).collect();
    assert_eq!(
        pids,
        vec![1],
        "the pod's init by its pid there; the host's is not seen"
    );
    assert_eq!(g0.processes[0].used_bytes, Some(3 * GIB));
    let sampled: Vec<u32> = g0
        .utilization
        .as_ref()
        .unwrap()
        .samples
        .iter()
        .map(|s| s.pid)
        .collect();
    assert_eq!(sampled, vec![1], "utilization samples follow the same rule");
    let g1 = &a[1];
    assert_eq!(g1.memory.unwrap().used, 6 * GIB);
    let pids: Vec<u32> = g1.processes.iter().map(|p| p.pid).collect();
    assert_eq!(pids, vec![1], "MIG mode: the whole GPU's list too");
    let [host_mig, pod_mig] = &g1.mig_devices[..] else {
        panic!("two MIG devices: {:?}", g1.mig_devices)
    };
    assert_eq!(
        host_mig.memory.unwrap().used,
        4 * GIB,
        "its memory is its own"
    );
    assert!(host_mig.processes.is_empty(), "{:?}", host_mig.processes);
    let listed: Vec<(u32, Option<u64>)> = pod_mig
        .processes
        .iter()
        .map(|p| (p.pid, p.used_bytes))
        .collect();
    assert_eq!(listed, vec![(1, Some(2 * GIB))]);

    // From the host, the same two by their host pids.
    let mut on_host: Vec<u32> = nvml_sample(&world).unwrap().gpus[0]
        .processes
        .iter()
        .map(|p| p.pid)
        .collect();
    on_host.sort_unstable();
    let mut expected = vec![host.pid(), inner];
    expected.sort_unstable();
    assert_eq!(on_host, expected);
    drop(pod);
}
