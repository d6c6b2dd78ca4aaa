//! The simulated driver as third-party clients see it: NVIDIA's Python bindings, gpustat and
//! nvitop (the venv `scripts/test.sh` builds in `target/pyenv`, pinned versions), loading the
//! simulator's `libnvidia-ml.so.1` through `LD_LIBRARY_PATH` as they would a real driver's.

mod common;
use common::*;
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output};

fn client(tool: &str) -> PathBuf {
    client_in("pyenv", tool)
}

/// `tool` of the venv `scripts/test.sh` builds at `target/VENV`.
fn client_in(venv: &str, tool: &str) -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target")
        .join(venv)
        .join("bin")
        .join(tool);
    assert!(
        bin.exists(),
        "no {}: scripts/test.sh installs nvidia-ml-py, nvitop and gpustat in target/pyenv",
        bin.display()
    );
    bin
}

fn run_client(world: &World, tool: &str, args: &[&str]) -> Output {
    run_client_on(world, &sim_nvml_lib(), tool, args)
}

/// A client loading `lib` (the simulator's library, or its 535 variant).
fn run_client_on(world: &World, lib: &std::path::Path, tool: &str, args: &[&str]) -> Output {
    Command::new(client(tool))
        .args(args)
        .env("VRAMGUARD_SIM", world.state_path())
        .env("LD_LIBRARY_PATH", lib.parent().unwrap())
        .env("COLUMNS", "160")
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

/// Two H200s; GPU 0 has a 3 GiB holder at 40 % SM.
fn busy_world() -> (World, Reaped) {
    let world = World::new(2);
    let holder = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    let mut a = allocation(0, holder.pid(), 3 * GIB);
    a.sm_util = 40;
    world.allocate(a);
    (world, holder)
}

#[test]
fn gpustat_reads_memory_processes_utilization_and_temperature() {
    let (world, holder) = busy_world();
    let out = run_client(&world, "gpustat", &["--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let g0 = &v["gpus"][0];
    assert_eq!(g0["name"], "NVIDIA H200", "{g0:#}");
    assert_eq!(g0["memory.used"], 3072, "{g0:#}");
    assert_eq!(g0["utilization.gpu"], 40, "{g0:#}");
    assert_eq!(g0["temperature.gpu"], 48, "{g0:#}");
    assert_eq!(g0["power.draw"], 325, "{g0:#}");
    assert_eq!(g0["enforced.power.limit"], 700, "{g0:#}");
    assert_eq!(g0["processes"][0]["pid"], holder.pid(), "{g0:#}");
    assert_eq!(g0["processes"][0]["gpu_memory_usage"], 3072, "{g0:#}");
    let g1 = &v["gpus"][1];
    assert_eq!(g1["utilization.gpu"], 0, "{g1:#}");
    assert_eq!(g1["temperature.gpu"], 30, "{g1:#}");
    assert_eq!(g1["processes"].as_array().map(Vec::len), Some(0), "{g1:#}");
}

#[test]
fn nvitop_draws_its_whole_screen_without_an_error() {
    let (world, holder) = busy_world();
    let out = run_client(&world, "nvitop", &["--once"]);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{text}");
    assert!(
        !text.contains("Traceback") && !text.contains("ERROR"),
        "nvitop met a call the simulator does not answer:\n{text}"
    );
    for expected in [
        "H200",
        "48C",
        "325W / 700W",
        "40%",
        &holder.pid().to_string(),
    ] {
        assert!(text.contains(expected), "no {expected:?} in\n{text}");
    }
}

#[test]
fn nvidias_python_bindings_see_what_vramguard_sees() {
    let (world, holder) = busy_world();
    let script = r#"
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
m = n.nvmlDeviceGetMemoryInfo(h)
print(json.dumps({
    "used": m.used,
    "procs": [[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
    "util": n.nvmlDeviceGetUtilizationRates(h).gpu,
    "cc": list(n.nvmlDeviceGetCudaComputeCapability(h)),
    "mig": list(n.nvmlDeviceGetMigMode(h)),
}))
n.nvmlShutdown()
"#;
    let out = run_client(&world, "python", &["-c", script]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let status = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    // The unversioned call counts the driver's reserved memory as used; `_v2` apart.
    let mem = &status["gpus"][0]["memory"];
    assert_eq!(
        v["used"].as_u64(),
        Some(mem["used"].as_u64().unwrap() + mem["reserved"].as_u64().unwrap()),
        "{v} {mem}"
    );
    assert_eq!(
        v["procs"],
        serde_json::json!([[holder.pid(), 3 * GIB]]),
        "{v}"
    );
    assert_eq!(v["util"], 40);
    assert_eq!(v["cc"], serde_json::json!([9, 0]));
    assert_eq!(v["mig"], serde_json::json!([0, 0]));
}

/// nvidia-ml-py in a container without `hostPID` (`unshare --pid --fork --mount-proc`), as
/// on a real H200 (driver 580.159.04): the memory the host's process uses is there, the
/// process is not, in any list or utilization sample.
#[test]
fn nvidias_bindings_in_a_new_pid_namespace_see_the_memory_and_no_process() {
    let (world, holder) = busy_world();
    // The simulated driver reads the host's /proc, which `--mount-proc` covers: a bind mount
    // of it made first, in a mount namespace of the test's own, stays reachable there, and a
    // copy of the state names it.
    let host_proc = world.dir.path().join("host-proc");
    std::fs::create_dir_all(&host_proc).unwrap();
    let mut state: Value =
        serde_json::from_slice(&std::fs::read(world.state_path()).unwrap()).unwrap();
    state["proc_root"] = serde_json::json!(host_proc);
    let ns_state = world.dir.path().join("state-in-namespace.json");
    std::fs::write(&ns_state, serde_json::to_vec(&state).unwrap()).unwrap();
    let script = r#"
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
try:
    samples = [s.pid for s in n.nvmlDeviceGetProcessUtilization(h, 0)]
except n.NVMLError_NotFound:
    samples = []
print(json.dumps({
    "used": n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).used,
    "compute": [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
    "graphics": [p.pid for p in n.nvmlDeviceGetGraphicsRunningProcesses(h)],
    "samples": samples,
    "self": open("/proc/self/status").read().split("NSpid:")[1].split()[0],
}))
n.nvmlShutdown()
"#;
    let lib = sim_nvml_lib();
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg("mount --bind /proc \"$0\" && exec unshare --pid --fork --mount-proc \"$@\"")
        .arg(&host_proc)
        .arg(client("python"))
        .args(["-c", script])
        .env("VRAMGUARD_SIM", &ns_state)
        .env("LD_LIBRARY_PATH", lib.parent().unwrap())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["self"], "1", "the client is pid 1 of its namespace: {v}");
    assert_eq!(v["used"], 3 * GIB, "the GPU's memory is the GPU's: {v}");
    assert_eq!(v["compute"], serde_json::json!([]), "{v}");
    assert_eq!(v["graphics"], serde_json::json!([]), "{v}");
    assert_eq!(v["samples"], serde_json::json!([]), "{v}");
    // From the host, the same process is listed.
    let host = bindings_view(&world);
    assert_eq!(host["procs"], serde_json::json!([[holder.pid(), 3 * GIB]]));
}

/// What nvidia-ml-py's process list and memory info say about GPU 0.
fn bindings_view(world: &World) -> Value {
    let script = r#"
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({
    "used": n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2).used,
    "procs": [[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
}))
n.nvmlShutdown()
"#;
    let out = run_client(world, "python", &["-c", script]);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Issue 25, as a real H200 (driver 580.159.04) showed it: a trainer that forked a
/// DataLoader-style worker after creating its context is SIGKILLed. The driver keeps listing the
/// dead trainer's pid with the whole context while the worker keeps its descriptors; monitoring
/// tools show a process that no longer exists without failing; once the worker exits, the
/// memory is back and the pid gone from the list.
#[test]
fn a_dead_creator_kept_by_its_forked_worker_is_listed_until_the_worker_exits() {
    let world = World::new(1);
    let mut s = spec(&world, serde_json::json!([hold(0, 3)]));
    s["group_leader"] = serde_json::json!(true);
    s["forked_workers"] = serde_json::json!(1);
    let mut trainer = start(&world, &["python3", "train.py"], s);
    let dead = trainer.pid;
    trainer.crash();
    let v = bindings_view(&world);
    assert_eq!(v["procs"], serde_json::json!([[dead, 3 * GIB]]), "{v}");
    assert_eq!(v["used"], 3 * GIB, "{v}");
    let out = run_client(&world, "nvitop", &["--once"]);
    let screen = stdout(&out);
    assert!(out.status.success(), "{}\n{}", screen, stderr(&out));
    assert!(!stderr(&out).contains("Traceback"), "{}", stderr(&out));
    assert!(
        screen.contains(&dead.to_string()) && screen.contains("No Such Process"),
        "{screen}"
    );
    let out = run_client(&world, "gpustat", &["--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let g: Value = serde_json::from_slice(&out.stdout).unwrap();
    // Like plain nvidia-smi ("No running processes found" under the used memory): the
    // memory is there, the process list has nobody it can name.
    assert_eq!(g["gpus"][0]["memory.used"], 3072, "{g:#}");
    assert_eq!(g["gpus"][0]["processes"], serde_json::json!([]), "{g:#}");
    // The worker exits: the context closes with its last descriptor.
    for &w in &trainer.workers {
        // SAFETY: kill(2) on the worker this test started.
        unsafe { libc::kill(w as i32, libc::SIGKILL) };
    }
    wait_until(10, "the memory to come back", || {
        bindings_view(&world) == serde_json::json!({ "used": 0, "procs": [] })
    });
}

/// GPU 0 of a 535.43-535.98 driver, with three holders of 1, 2 and 3 GiB.
fn driver_535_world() -> (World, Vec<Reaped>) {
    let world = World::new(1);
    let holders: Vec<Reaped> = (0..3)
        .map(|_| world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60))
        .collect();
    for (i, h) in holders.iter().enumerate() {
        world.allocate(allocation(0, h.pid(), (i as u64 + 1) * GIB));
    }
    world.update(|s| {
        s.gpus[0]
            .quirks
            .push(vramguard_sim::state::Quirk::V3Records32Bytes);
        s.driver_version = "535.54.03".into();
    });
    (world, holders)
}

#[test]
fn on_a_535_driver_nvitop_reads_the_32_byte_records_and_the_24_byte_reader_is_misled() {
    let (world, holders) = driver_535_world();
    // nvitop recognises the driver by its symbols and reads 32-byte records: every holder.
    let script = r#"
import json
from nvitop import libnvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(json.dumps(sorted([p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h))))
"#;
    let out = run_client_on(&world, &sim_nvml_lib_535(), "python", &["-c", script]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut want: Vec<(u32, u64)> = holders
        .iter()
        .enumerate()
        .map(|(i, h)| (h.pid(), (i as u64 + 1) * GIB))
        .collect();
    want.sort_unstable();
    assert_eq!(v, serde_json::json!(want), "nvitop on the 535 library");
    // NVIDIA's bindings read 24-byte records out of the same call: the first is right, the
    // second misaligned, as on those drivers (pynvml #50).
    let script = r#"
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(json.dumps([[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)]))
"#;
    let out = run_client_on(&world, &sim_nvml_lib_535(), "python", &["-c", script]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v[0], serde_json::json!([holders[0].pid(), GIB]), "{v}");
    assert_eq!(v[1][0], 0, "misaligned second record: {v}");
    // vramguard, on the same library, reads the `_v2` lists and says why.
    let status = Vg::new(&world, Path_::InProcess)
        .arg_path("--nvml-lib", &sim_nvml_lib_535())
        .args(["status", "--json"])
        .json(0);
    let gpu = &status["gpus"][0];
    let pids: Vec<u64> = gpu["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["pid"].as_u64().unwrap())
        .collect();
    let mut want: Vec<u64> = holders.iter().map(|h| u64::from(h.pid())).collect();
    want.sort_unstable();
    let mut pids = pids;
    pids.sort_unstable();
    assert_eq!(pids, want, "{gpu:#}");
    assert!(
        gpu["warnings"]
            .to_string()
            .contains("32-byte `_v3` process records"),
        "{gpu:#}"
    );
    // MPS clients too, from the `_v2` MPS list (nvml-wrapper does not wrap it): unread, they
    // would be holders that no list names, their work on the GPU unseen.
    let clients: Vec<Reaped> = (0..2)
        .map(|_| world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60))
        .collect();
    world.update(|s| {
        for (i, c) in clients.iter().enumerate() {
            let mut a = allocation(0, c.pid(), (i as u64 + 4) * GIB);
            a.kind = vramguard_sim::state::AllocationKind::Mps;
            s.allocations.push(a);
        }
    });
    let status = Vg::new(&world, Path_::InProcess)
        .arg_path("--nvml-lib", &sim_nvml_lib_535())
        .args(["status", "--json"])
        .json(0);
    for (i, c) in clients.iter().enumerate() {
        let h = holder(&status, 0, c.pid());
        assert_eq!(h["listed"], serde_json::json!(true), "{h:#}");
        assert_eq!(
            h["used_bytes"],
            serde_json::json!((i as u64 + 4) * GIB),
            "{h:#}"
        );
    }
    assert_eq!(
        status["gpus"][0]["process_list"]["state"], "complete",
        "{:#}",
        status["gpus"][0]
    );
}

/// GPU 0 in MIG mode with one 3g.71gb device holding a 5 GiB process.
fn mig_world() -> (World, Reaped) {
    let world = World::new(1);
    world.enable_mig(0, &[2]);
    let holder = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    let mut a = allocation(0, holder.pid(), 5 * GIB);
    a.mig_device = Some(0);
    world.allocate(a);
    (world, holder)
}

#[test]
fn nvidias_bindings_and_nvitop_see_the_mig_device_and_its_process() {
    let (world, holder) = mig_world();
    let script = r#"
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
mem = n.nvmlDeviceGetMemoryInfo(m)
print(json.dumps({
    "mode": list(n.nvmlDeviceGetMigMode(h)),
    "max": n.nvmlDeviceGetMaxMigDeviceCount(h),
    "gi": n.nvmlDeviceGetGpuInstanceId(m),
    "total": mem.total, "used": mem.used,
    "procs": [[p.pid, p.usedGpuMemory, p.gpuInstanceId] for p in n.nvmlDeviceGetComputeRunningProcesses(m)],
    "whole": [[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
}))
"#;
    let out = run_client(&world, "python", &["-c", script]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["mode"], serde_json::json!([1, 1]), "{v}");
    assert_eq!(v["max"], 7);
    assert_eq!(v["gi"], 2);
    assert_eq!(
        (v["total"].as_u64(), v["used"].as_u64()),
        (Some(66 * GIB), Some(5 * GIB))
    );
    assert_eq!(
        v["procs"],
        serde_json::json!([[holder.pid(), 5 * GIB, 2]]),
        "{v}"
    );
    // The whole GPU's list has the process without its memory (None in the bindings).
    assert_eq!(v["whole"], serde_json::json!([[holder.pid(), null]]), "{v}");
    // The GPU instance behind the MIG device, through MIG's instance queries.
    let script = r#"
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
info = n.nvmlDeviceGetGpuInstanceProfileInfo(h, n.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
count = n.c_uint(7)
handles = (n.c_nvmlGpuInstance_t * 7)()
n.nvmlDeviceGetGpuInstances(h, info.id, handles, n.byref(count))
gi = n.nvmlGpuInstanceGetInfo(handles[0])
print(json.dumps({
    "profile": [info.id, info.name.decode() if isinstance(info.name, bytes) else info.name,
                info.sliceCount, info.instanceCount],
    "instances": count.value,
    "gi": [gi.id, gi.profileId, gi.placement.start, gi.placement.size],
    "by_id": n.nvmlGpuInstanceGetInfo(n.nvmlDeviceGetGpuInstanceById(h, 2)).id,
    "room_3g": n.nvmlDeviceGetGpuInstanceRemainingCapacity(h, info.id),
    "room_7g": n.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 0),
}))
"#;
    let out = run_client(&world, "python", &["-c", script]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["profile"], serde_json::json!([9, "3g.71gb", 3, 2]), "{v}");
    assert_eq!(v["instances"], 1, "{v}");
    assert_eq!(v["gi"], serde_json::json!([2, 9, 0, 4]), "{v}");
    assert_eq!(v["by_id"], 2, "{v}");
    // Half the memory slices are taken: one more 3g fits, no 7g.
    assert_eq!(
        (v["room_3g"].as_u64(), v["room_7g"].as_u64()),
        (Some(1), Some(0)),
        "{v}"
    );
    let out = run_client(&world, "nvitop", &["--once"]);
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{text}");
    assert!(
        !text.contains("Traceback") && !text.contains("ERROR"),
        "{text}"
    );
    assert!(text.contains(&holder.pid().to_string()), "{text}");
    assert!(text.contains("MIG"), "nvitop shows the MIG device: {text}");
}

#[test]
fn the_old_nvidia_ml_py3_lists_processes_through_the_unversioned_symbols() {
    // nvidia-ml-py3 (2017) calls nvmlDeviceGetComputeRunningProcesses, the unversioned
    // symbol, with 16-byte {pid, usedGpuMemory} records; a 580 driver still exports it.
    let (world, holder) = busy_world();
    let script = r#"
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({
    "procs": [[p.pid, p.usedGpuMemory] for p in n.nvmlDeviceGetComputeRunningProcesses(h)],
    "name": n.nvmlDeviceGetName(h).decode(),
    "driver": n.nvmlSystemGetDriverVersion().decode(),
}))
"#;
    let out = Command::new(client_in("pyenv-legacy", "python"))
        .args(["-c", script])
        .env("VRAMGUARD_SIM", world.state_path())
        .env("LD_LIBRARY_PATH", sim_nvml_lib().parent().unwrap())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["procs"],
        serde_json::json!([[holder.pid(), 3 * GIB]]),
        "{v}"
    );
    assert_eq!(v["name"], "NVIDIA H200");
    assert_eq!(v["driver"], "580.159.03");
}

/// nvidia-ml-py's queries that the `nvml.h` of `nvml-wrapper-sys` (which checks every
/// exported signature, `crates/vramguard-sim-nvml/tests/abi.rs`) does not declare: later
/// NVML releases added them, and the simulator does not export what it cannot check.
const NEWER_THAN_THE_CHECKED_HEADER: [&str; 13] = [
    "nvmlDeviceGetAccountingStats_v2",
    "nvmlDeviceGetAdaptiveTgpModeInfo_v1",
    "nvmlDeviceGetBBXTimeData_v1",
    "nvmlDeviceGetBankRemapperStatus_v1",
    "nvmlDeviceGetGpuFabricInfo_v4",
    "nvmlDeviceGetHostname_v1",
    "nvmlDeviceGetMemoryLimits_v1",
    "nvmlDeviceGetNvLinkTelemetrySamples_v1",
    "nvmlDeviceGetRemappedRows_v2",
    "nvmlDeviceGetUnrepairableMemoryFlag_v1",
    "nvmlDeviceGetVgpuSchedulerLog_v2",
    "nvmlDeviceGetVgpuSchedulerState_v2",
    "nvmlSystemGetCPER_v1",
];

/// The sweep of every query nvidia-ml-py offers (`tests/clients/nvml_sweep.py`), as a map
/// from function name to its answer on GPU 0 of `world`.
fn sweep(world: &World) -> std::collections::BTreeMap<String, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/nvml_sweep.py");
    let out = run_client(world, "python", &[script]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The table of `docs/simulator.md`'s "Every query of nvidia-ml-py" section: function name
/// to the answer it documents.
fn documented_answers() -> std::collections::BTreeMap<String, String> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/simulator.md"
    ))
    .unwrap();
    let section = doc
        .split("## Every query of nvidia-ml-py")
        .nth(1)
        .expect("docs/simulator.md has the section")
        .split("\n## ")
        .next()
        .unwrap();
    section
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            Some((
                name.to_string(),
                cells.get(2)?.trim_matches('`').to_string(),
            ))
        })
        .collect()
}

/// How the documentation writes an answer of the sweep.
fn documented_form(answer: &str) -> String {
    match answer {
        "NVMLError_FunctionNotFound" => "not simulated".into(),
        a if a.starts_with("NVMLError_") => {
            let name = &a["NVMLError_".len()..];
            // NotSupported -> NOT_SUPPORTED, as nvml.h spells the codes.
            let mut out = String::new();
            for (i, c) in name.chars().enumerate() {
                if c.is_ascii_uppercase() && i > 0 {
                    out.push('_');
                }
                out.push(c.to_ascii_uppercase());
            }
            out
        }
        other => other.to_string(),
    }
}

#[test]
fn every_query_of_nvidias_bindings_is_answered_as_documented() {
    let (world, _holder) = busy_world();
    let answers = sweep(&world);
    assert!(answers.len() > 200, "{answers:?}");
    let seen: std::collections::BTreeMap<String, String> = answers
        .iter()
        .map(|(k, v)| (k.clone(), documented_form(v)))
        .collect();
    // Nothing the bindings' wrappers trip on (a Python error on what the library wrote).
    let broken: Vec<_> = seen
        .iter()
        .filter(|(_, v)| v.starts_with("python"))
        .collect();
    assert!(broken.is_empty(), "{broken:?}");
    let documented = documented_answers();
    let differ: Vec<String> = seen
        .iter()
        .filter(|(k, v)| documented.get(*k) != Some(*v))
        .map(|(k, v)| format!("{k}: sweep {v}, docs {:?}", documented.get(k)))
        .chain(
            documented
                .keys()
                .filter(|k| !seen.contains_key(*k))
                .map(|k| format!("{k}: documented, not in the sweep")),
        )
        .collect();
    assert!(
        differ.is_empty(),
        "docs/simulator.md's table and the sweep differ:\n{}",
        differ.join("\n")
    );
    // What stays unsimulated: functions newer than the nvml.h the simulator's signatures are
    // checked against (nvml-wrapper-sys's bindings), and nothing else.
    let missing: Vec<&str> = seen
        .iter()
        .filter(|(_, v)| *v == "not simulated")
        .map(|(k, _)| k.as_str())
        .collect();
    assert_eq!(missing, NEWER_THAN_THE_CHECKED_HEADER, "{missing:?}");
}

#[test]
fn the_extended_queries_agree_with_each_other_and_with_the_load() {
    let (world, holder) = busy_world();
    let script = r#"
import json, pynvml as n
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
h1 = n.nvmlDeviceGetHandleByIndex(1)
fields = n.nvmlDeviceGetFieldValues(h, [n.NVML_FI_DEV_POWER_INSTANT, n.NVML_FI_DEV_NVLINK_LINK_COUNT, 9999])
margin = n.nvmlDeviceGetMarginTemperature(h)
def code(f):
    try:
        f()
        return 0
    except n.NVMLError as e:
        return e.value
util = n.nvmlDeviceGetProcessesUtilizationInfo(h, 0)
print(json.dumps({
    "power": n.nvmlDeviceGetPowerUsage(h),
    "fields": [[f.nvmlReturn, f.value.uiVal] for f in fields],
    "temp": n.nvmlDeviceGetTemperature(h, 0),
    "slowdown": n.nvmlDeviceGetTemperatureThreshold(h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
    "margin": margin,
    "mem_clocks": n.nvmlDeviceGetSupportedMemoryClocks(h),
    "max_mem_clock": n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_MEM),
    "graphics_clocks": n.nvmlDeviceGetSupportedGraphicsClocks(h, n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_MEM))[:2],
    "app_clock": n.nvmlDeviceGetApplicationsClock(h, n.NVML_CLOCK_GRAPHICS),
    "link17": n.nvmlDeviceGetNvLinkState(h, 17),
    "link18": code(lambda: n.nvmlDeviceGetNvLinkState(h, 18)),
    "topology": n.nvmlDeviceGetTopologyCommonAncestor(h, h1),
    "nearest": len(n.nvmlDeviceGetTopologyNearestGpus(h, n.NVML_TOPOLOGY_NODE)),
    "sm_samples": [s.sampleValue.uiVal for s in n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, 0)[1]],
    "proc_util": [[u.pid, u.smUtil] for u in util],
    "by_serial": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleBySerial(n.nvmlDeviceGetSerial(h1))),
    "by_bus": n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId(n.nvmlDeviceGetPciInfo(h1).busId)),
    "fan_rpm": code(lambda: n.nvmlDeviceGetFanSpeedRPM(h)),
}))
"#;
    let out = run_client(&world, "python", &["-c", script]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    // The power field is the power reading; an unknown field fails alone, the call succeeds.
    assert_eq!(v["fields"][0], serde_json::json!([0, v["power"]]), "{v}");
    assert_eq!(v["fields"][1], serde_json::json!([0, 18]), "{v}");
    assert_eq!(v["fields"][2][0], 2, "INVALID_ARGUMENT for field 9999: {v}");
    assert_eq!(
        v["margin"].as_i64(),
        Some(v["slowdown"].as_i64().unwrap() - v["temp"].as_i64().unwrap()),
        "{v}"
    );
    assert_eq!(
        v["mem_clocks"],
        serde_json::json!([v["max_mem_clock"]]),
        "{v}"
    );
    assert_eq!(v["graphics_clocks"][0], v["app_clock"], "{v}");
    assert_eq!(
        (v["link17"].as_u64(), v["link18"].as_u64()),
        (Some(1), Some(2)),
        "{v}"
    );
    // GPUs 0 and 1 share a NUMA node (NVML_TOPOLOGY_NODE), and GPU 1 is GPU 0's only
    // neighbour at that level on a two-GPU node.
    assert_eq!(
        (v["topology"].as_u64(), v["nearest"].as_u64()),
        (Some(40), Some(1)),
        "{v}"
    );
    // The 40 % SM load of the holder, in both sampling APIs.
    assert_eq!(v["sm_samples"], serde_json::json!([40]), "{v}");
    assert_eq!(
        v["proc_util"],
        serde_json::json!([[holder.pid(), 40]]),
        "{v}"
    );
    assert_eq!(
        (v["by_serial"].as_u64(), v["by_bus"].as_u64()),
        (Some(1), Some(1)),
        "{v}"
    );
    assert_eq!(v["fan_rpm"], 3, "NOT_SUPPORTED: {v}");
}
