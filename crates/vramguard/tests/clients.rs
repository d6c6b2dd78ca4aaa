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
