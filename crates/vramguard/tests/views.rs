//! The human and JSON views as a GPU user reads them: nvidia-smi's columns (utilization,
//! temperature, power, P-state, ECC; per process CPU, host RSS and age), a GPU filter,
//! refreshing with `--watch`, and lines that fit the terminal.

mod common;
use common::*;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::Stdio;

/// Two H200s; GPU 1 has a 3 GiB holder at 40 % SM.
fn busy_gpu_1() -> (World, Reaped) {
    let world = World::new(2);
    let holder = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia1"], 60);
    let mut a = allocation(1, holder.pid(), 3 * GIB);
    a.sm_util = 40;
    world.allocate(a);
    (world, holder)
}

#[test]
fn status_shows_what_nvidia_smi_shows_beside_the_classes() {
    let (world, holder) = busy_gpu_1();
    for path in [Path_::InProcess, Path_::Nvml] {
        let report = Vg::new(&world, path).args(["status", "--json"]).json(0);
        let t = &report["gpus"][1]["telemetry"];
        assert_eq!(t["gpu_util_percent"], 40, "{t}");
        assert_eq!(t["performance_state"], 0, "{t}");
        assert_eq!(t["ecc_enabled"], true, "{t}");
        assert_eq!(t["compute_mode"], "Default", "{t}");
        assert_eq!(t["mig_enabled"], false, "{t}");
        assert_eq!(t["display_active"], false, "{t}");
        // An SXM module has no fan (an H200 answers Invalid Argument, as the real one does):
        // absent (n/a), not an error.
        assert_eq!(t["fan_percent"], Value::Null, "{t}");
        assert!(
            report["gpus"][1]["warnings"].as_array().unwrap().is_empty(),
            "{report:#}"
        );
        // 75 W idle, rising with the load to the 700 W limit; warmer than the idle GPU.
        assert_eq!(t["power_limit_mw"], 700_000, "{t}");
        assert!(t["power_mw"].as_u64().unwrap() > 75_000, "{t}");
        let idle = &report["gpus"][0]["telemetry"];
        assert!(
            t["temperature_c"].as_u64() > idle["temperature_c"].as_u64(),
            "{t} {idle}"
        );
        let h = holder_of(&report, 1, holder.pid());
        // The holder's host facts: its RSS as /proc says, its age. Its job lives, so no
        // verdict depends on its work: it was not watched (no sampling window was paid for),
        // and its CPU is unknown.
        assert!(h["rss_bytes"].as_u64().unwrap() > 1 << 20, "{h}");
        assert!(h["age_secs"].as_u64().unwrap() < 60, "{h}");
        assert!(h["cpu_millicores"].is_null(), "{h}");
    }
    let out = Vg::new(&world, Path_::Nvml)
        .env("COLUMNS", "140")
        .args(["status"])
        .code(0);
    let text = stdout(&out);
    assert!(text.contains("util 40%"), "{text}");
    assert!(
        text.contains("/ 700 W  P0  ECC on, 0 corr / 0 uncorr"),
        "{text}"
    );
    assert!(text.contains("CPU       RSS   AGE  COMMAND"), "{text}");
}

fn holder_of(report: &Value, gpu: usize, pid: u32) -> Value {
    report["gpus"][gpu]["holders"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["pid"] == pid)
        .cloned()
        .unwrap_or_else(|| panic!("no holder {pid} on GPU {gpu}: {report:#}"))
}

#[test]
fn status_gpu_keeps_only_the_named_gpus_and_refuses_one_the_node_lacks() {
    let (world, _holder) = busy_gpu_1();
    let report = Vg::new(&world, Path_::InProcess)
        .args(["status", "--json", "--gpu", "1"])
        .json(0);
    let gpus: Vec<&Value> = report["gpus"].as_array().unwrap().iter().collect();
    assert_eq!(gpus.len(), 1);
    assert_eq!(gpus[0]["index"], 1);
    // A GPU's UUID names it as its index does, in status as in reclaim.
    let uuid = gpus[0]["uuid"].as_str().unwrap().to_string();
    let by_uuid = Vg::new(&world, Path_::InProcess)
        .args(["status", "--json", "--gpu", &uuid])
        .json(0);
    assert_eq!(by_uuid["gpus"].as_array().unwrap().len(), 1);
    assert_eq!(by_uuid["gpus"][0]["index"], 1);
    // One language and one message, whichever command is asked.
    let want = "vramguard: error: --gpu 5: no such GPU or MIG device on this node (GPUs 0 to 1; \
                `vramguard status` lists them with their UUIDs)";
    for args in [
        &["status", "--gpu", "0,5"][..],
        &["diagnose", "--gpu", "5"],
        &["top", "--once", "--gpu", "5"],
        &["reclaim", "--dry-run", "--gpu", "5"],
        &["probe", "release", "--gpu", "5"],
    ] {
        let out = Vg::new(&world, Path_::InProcess).args(args).code(2);
        assert_eq!(stderr(&out).trim_end(), want, "{args:?}");
    }
    for bad in ["GPU-3b1c\u{1b}", "five"] {
        for cmd in ["status", "reclaim", "top", "diagnose"] {
            let out = Vg::new(&world, Path_::InProcess)
                .args([cmd, "--gpu", bad])
                .code(2);
            assert!(
                stderr(&out).contains("expected a GPU index (0), a GPU-… or a MIG-… UUID"),
                "{cmd} --gpu {bad:?}: {}",
                stderr(&out)
            );
        }
    }
}

#[test]
fn status_watch_prints_a_block_per_refresh_and_json_a_document_per_line() {
    let (world, holder) = busy_gpu_1();
    for json in [false, true] {
        let mut args = vec!["status", "--watch", "0.2s", "--sample", "0"];
        if json {
            args.push("--json");
        }
        let mut cmd = Vg::new(&world, Path_::InProcess).args(&args).command();
        let mut child = Reaped(cmd.stdout(Stdio::piped()).spawn().unwrap());
        let mut lines = BufReader::new(child.0.stdout.take().unwrap());
        let mut seen = 0;
        let mut line = String::new();
        while seen < 3 {
            line.clear();
            assert!(
                lines.read_line(&mut line).unwrap() > 0,
                "--watch ended early"
            );
            if json {
                let doc: Value = serde_json::from_str(&line).expect("one JSON document per line");
                assert_eq!(holder_of(&doc, 1, holder.pid())["used_bytes"], 3 * GIB);
                seen += 1;
            } else if line.starts_with("vramguard status") {
                seen += 1;
            }
        }
        drop(child);
    }
    // A replay never changes: watching it is refused.
    let snap = world.state_path().with_file_name("snap.json");
    let out = Vg::new(&world, Path_::InProcess).args(["snapshot"]).code(0);
    std::fs::write(&snap, &out.stdout).unwrap();
    let out = Vg::new(&world, Path_::InProcess)
        .arg_path("--replay", &snap)
        .args(["status", "--watch"])
        .code(2);
    assert!(
        stderr(&out).contains("a replayed snapshot never changes"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn top_once_prints_one_screen_and_top_without_a_terminal_says_what_to_use() {
    let world = World::new(1);
    let trainer = crashed_trainer(&world);
    let out = Vg::new(&world, Path_::Nvml)
        .env("COLUMNS", "120")
        .args(["top", "--once"])
        .code(0);
    let text = stdout(&out);
    assert!(text.starts_with("vramguard top · "), "{text}");
    assert!(text.contains("GPU 0 NVIDIA H200"), "{text}");
    let row = text
        .lines()
        .find(|l| l.starts_with(&trainer.workers[0].to_string()))
        .unwrap_or_else(|| panic!("no row for the orphan:\n{text}"));
    assert!(row.contains("orphan") && row.contains("1.0 GiB"), "{row}");
    assert!(text.lines().all(|l| l.chars().count() <= 120), "{text}");
    assert!(
        !text.contains("q quit"),
        "no key hints on a printed screen:\n{text}"
    );
    // Interactive, piped: refused with the alternatives.
    let out = Vg::new(&world, Path_::InProcess).args(["top"]).code(2);
    let err = stderr(&out);
    assert!(
        err.contains("top needs a terminal") && err.contains("--once"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// `status --watch` refreshes from the driver's listed processes while they explain every
/// byte, as one `status` does, and reads every process once they do not.
#[test]
fn status_watch_refreshes_from_the_listed_processes_until_memory_is_unexplained() {
    let (world, _holder) = busy_gpu_1();
    // No shared-memory directory: a segment another test leaves in /dev/shm would need a
    // pass over every process.
    let cfg = config(&world, "[shm]\ndirs = []\n");
    let mut cmd = Vg::new(&world, Path_::InProcess)
        .arg_path("--config", &cfg)
        .args(["status", "--watch", "0.2s", "--sample", "0", "--json"])
        .command();
    let mut child = Reaped(cmd.stdout(Stdio::piped()).spawn().unwrap());
    let mut lines = BufReader::new(child.0.stdout.take().unwrap());
    let mut next = || -> Value {
        let mut line = String::new();
        assert!(
            lines.read_line(&mut line).unwrap() > 0,
            "--watch ended early"
        );
        serde_json::from_str(&line).expect("one JSON document per line")
    };
    for _ in 0..2 {
        let doc = next();
        assert_eq!(doc["full_fd_scan"], false, "{doc:#}");
    }
    // Residue on GPU 0: memory no listed process explains.
    let mut leak = spec(
        &world,
        serde_json::json!([{ "gpu": 0, "bytes": 2 * GIB, "after_exit": "leak" }]),
    );
    leak["new_session"] = serde_json::json!(true);
    let mut h = start(&world, &["python3", "bench.py"], leak);
    h.crash();
    let mut read_everything = false;
    for _ in 0..50 {
        let doc = next();
        if doc["gpus"][0]["unaccounted"]["significant"] == true {
            read_everything = doc["full_fd_scan"] == true;
            break;
        }
    }
    assert!(
        read_everything,
        "the refresh that met the residue read every process"
    );
    drop(child);
}
