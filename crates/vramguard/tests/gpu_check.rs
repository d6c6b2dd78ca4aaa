//! `scripts/gpu-check.sh` runs only where a GPU is lent, minutes at a time: what of it can run
//! here is checked here, so that a device session is not spent on a broken helper.

mod common;
use common::*;
use std::path::PathBuf;
use std::process::Command;

fn scripts() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts")
}

/// The dry run parses every helper and plans every step, the new ones included.
#[test]
fn the_gpu_checks_dry_run_plans_every_step_and_parses_every_helper() {
    let out = Command::new("bash")
        .arg(scripts().join("gpu-check.sh"))
        .arg("--dry-run")
        .arg(BIN)
        .output()
        .unwrap();
    let text = stdout(&out);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    for helper in [
        "train.py",
        "spawn_workers.py",
        "busy.py",
        "guard.py",
        "ptycost.py",
        "nvml_files.py",
    ] {
        assert!(
            text.contains(&format!("helper ok: scripts/gpu-check/{helper}")),
            "{helper}: {text}"
        );
    }
    for step in ["timing", "nvml-calls", "agent-cost", "top-cost"] {
        assert!(text.contains(&format!("  {step} ")), "{step}: {text}");
    }
    assert!(text.contains("binary: vramguard"), "{text}");
}

/// The `top-cost` step's helper measures `vramguard top` in a pseudo-terminal: one line with
/// its CPU and RSS; a program that exits at once is a failure, not a figure.
#[test]
fn ptycost_measures_top_in_a_terminal() {
    let world = World::new(1);
    let holder = world.holder(&["nvidiactl", "nvidia0"], 60);
    world.allocate(allocation(0, holder.pid(), 2 * GIB));
    let out = Command::new("python3")
        .arg(scripts().join("gpu-check/ptycost.py"))
        .args(["4", "vramguard-top", "--", BIN, "--sim"])
        .arg(world.state_path())
        .arg("top")
        .env_remove("VRAMGUARD_SIM")
        .env("VRAMGUARD_CONFIG", "none")
        .output()
        .expect("python3 runs (scripts/test.sh installs it)");
    let line = stdout(&out);
    assert!(out.status.success(), "{line}{}", stderr(&out));
    assert_eq!(ptycost_field(&line, 0), "vramguard-top", "{line}");
    let value = |key: &str| -> f64 { ptycost_value(&line, key) };
    assert!(value("cpu_ms_per_s") > 0.0, "top drew nothing: {line}");
    assert!(value("rss_kib") > 1000.0, "{line}");
    assert!(value("window_s") >= 1.5, "{line}");

    let out = Command::new("python3")
        .arg(scripts().join("gpu-check/ptycost.py"))
        .args(["4", "nothing", "--", "false"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).starts_with("nothing failed: false exited"),
        "{}",
        stdout(&out)
    );
}

/// A measured program that shrugs off the terminal's hang-up and SIGTERM is still ended (by
/// SIGKILL) and reaped: a GPU session must not leave a `top` or `nvitop` running behind it.
#[test]
fn ptycost_ends_a_program_that_ignores_hangup_and_term() {
    // The marker names this run's program in its command line: only it is ever signalled.
    let marker = format!("ptycost-stubborn-{}", std::process::id());
    let stubborn = format!(
        "# {marker}\n{}",
        "import signal, time\n\
        signal.signal(signal.SIGHUP, signal.SIG_IGN)\n\
        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n\
        while True:\n    try: print('x', flush=True)\n    except OSError: pass\n    time.sleep(0.2)\n"
    );
    let out = Command::new("python3")
        .arg(scripts().join("gpu-check/ptycost.py"))
        .args(["3.5", "stubborn", "--", "python3", "-c", &stubborn])
        .output()
        .unwrap();
    let line = stdout(&out);
    assert!(out.status.success(), "{line}{}", stderr(&out));
    let pid = ptycost_value(&line, "pid") as u32;
    let left_running = alive(pid) && kill_if_ours(pid, &marker);
    assert!(!left_running, "pid {pid} was left running: {line}");
}

fn ptycost_field(line: &str, i: usize) -> &str {
    line.split_whitespace().nth(i).unwrap_or("")
}

/// The number after `key` in ptycost.py's line.
fn ptycost_value(line: &str, key: &str) -> f64 {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let i = fields
        .iter()
        .position(|f| *f == key)
        .unwrap_or_else(|| panic!("{key} missing: {line}"));
    fields[i + 1].parse().unwrap()
}

/// Two free loopback ports in a row (gpu-check's agents take PORT and PORT + 1).
fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no two free loopback ports in a row");
}

/// A report's holders by class, vramguard's own processes left out (the one taking the
/// snapshot, and on the rehearsal the agent it runs: NVML clients, not part of the incident).
fn classes(report: &serde_json::Value) -> Vec<String> {
    let comm_of = |pid: &serde_json::Value| -> Option<String> {
        report["processes"]
            .as_array()?
            .iter()
            .find(|p| &p["pid"] == pid)
            .and_then(|p| p["comm"].as_str().map(str::to_string))
    };
    let mut out: Vec<String> = report["gpus"][0]["holders"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| {
            comm_of(&h["pid"]).as_deref() != Some("vramguard")
                && h["command"]
                    .as_str()
                    .is_none_or(|c| !c.contains("vramguard"))
        })
        .map(|h| h["class"].as_str().unwrap().to_string())
        .collect();
    out.sort();
    out
}

fn replay_status(snapshot: &std::path::Path) -> serde_json::Value {
    let out = vg_command()
        .arg("--replay")
        .arg(snapshot)
        .args(["status", "--json"])
        .env_remove("VRAMGUARD_SIM")
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{}: {e}: {}", snapshot.display(), stderr(&out)))
}

/// The whole of `scripts/gpu-check.sh`, rehearsed on the simulated driver with its stand-in
/// PyTorch and nvidia-smi: every step runs within its budget, tells the truth the H200
/// incidents' README asks for, and leaves nothing running; and each snapshot it takes
/// replays to the same classes, and the same share of ghost memory, as the snapshot of the
/// same name taken on the real H200.
#[test]
fn gpu_check_rehearsed_on_the_simulator_tells_the_h200_truths() {
    // Multiprocessing's semaphores: other programs' /dev/shm files come and go meanwhile.
    let shm = || -> std::collections::BTreeSet<std::ffi::OsString> {
        std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(|e| Some(e.ok()?.file_name()))
                    .filter(|n| n.to_string_lossy().starts_with("sem.mp-"))
                    .collect()
            })
            .unwrap_or_default()
    };
    let shm_before = shm();
    let out_dir = tempfile::tempdir().unwrap();
    let out = Command::new("bash")
        .arg(scripts().join("gpu-check-rehearsal.sh"))
        .arg(BIN)
        .arg(out_dir.path())
        .env("GPU_CHECK_PORT", free_port_pair().to_string())
        .env_remove("VRAMGUARD_SIM")
        // Through NVML, as on silicon: the simulator's libnvidia-ml.so.1 under nvml-wrapper.
        .env("VRAMGUARD_NVML_LIB", sim_nvml_lib())
        .output()
        .unwrap();
    let results = out_dir.path().join("results");
    let log = std::fs::read_to_string(results.join("check.log")).unwrap_or_default();
    let file = |name: &str| std::fs::read_to_string(results.join(name)).unwrap_or_default();
    let context = format!("{}\n{}\n{log}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{context}");
    assert!(out_dir.path().join("results.tar.gz").is_file(), "{context}");
    // (Over budget is not judged here: a loaded machine may be slow; skipped steps are.)
    for bad in ["SKIP", "interrupted", "terminated", "left behind"] {
        assert!(!log.contains(bad), "{bad}: {log}");
    }
    assert!(
        log.contains("[cleanup] no process of the check is left"),
        "{log}"
    );
    // The killed launchers' semaphores stayed in the rehearsal's own /dev/shm.
    let left: Vec<_> = shm().difference(&shm_before).cloned().collect();
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
    let line = |needle: &str| -> &str {
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?}: {log}"))
    };
    // Case 1: the dead trainer's memory is ghost memory, everywhere.
    assert!(
        line("c1 status headline").contains("ghost memory: 20.5 GiB"),
        "{log}"
    );
    assert!(!file("c1-status.txt").contains("accounted for by a live job"));
    assert!(
        line("c1 metrics").contains("class=\"exited\"} 22011707392"),
        "{log}"
    );
    assert!(
        line("  alert sink: ").contains("firing rule=ghost-memory"),
        "{log}"
    );
    assert!(
        line("alert sink after").contains("resolved rule=ghost-memory"),
        "{log}"
    );
    assert!(
        line("oom hook").contains("keeping the context of exited pid"),
        "{log}"
    );
    assert!(
        line("c1-reclaim says").contains("expected back on GPU 0: 20.5 GiB"),
        "{log}"
    );
    assert!(line("c1-reclaim memory").contains("back after"), "{log}");
    assert!(line("workers after reclaim").contains(":gone"), "{log}");
    // Case 7: unprivileged, and from another PID namespace.
    let unprivileged = file("c1-status-unprivileged.txt");
    assert!(unprivileged.contains("exited pids whose keepers are other users' processes"));
    assert!(!unprivileged.contains("accounted for by a live job"));
    assert!(file("c1-status-pidns.txt").contains("no process vramguard can see holds this GPU"));
    // Cases 2 to 4.
    assert!(
        file("c2-status.txt").contains("ghost memory: 3.0 GiB"),
        "{log}"
    );
    // Tied by elimination only: nothing by default, freed by the command the report offers.
    assert!(line("c2 default plan").contains(": 0 target(s)"), "{log}");
    assert!(
        line("c2 default plan").contains("--include keepers"),
        "{log}"
    );
    assert!(line("c2-reclaim says").contains("3.0 GiB freed"), "{log}");
    assert!(
        line("c3-reclaim says").contains("nothing to reclaim"),
        "{log}"
    );
    assert!(line("survived reclaim --yes").ends_with("yes"), "{log}");
    // The figures the silicon run is for are there, each with its unit.
    assert!(line("  status: ").ends_with(" ms"), "{log}");
    assert!(line("  nvidia-smi: ").ends_with(" ms"), "{log}");
    // The agent's CPU per collection is a figure, from the process CPU clock (not "n/a").
    let per_collection: f64 = line("agent cost")
        .split("cpu_us_per_collection ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no CPU per collection: {log}"));
    assert!(per_collection > 0.0, "{log}");
    assert!(line("  agent after (").contains("(resolved, "), "{log}");
    assert!(line("top cost").contains("cpu_ms_per_s "), "{log}");
    assert!(
        file("nvml-calls.txt")
            .lines()
            .any(|l| l.contains("nvmlDeviceGetFanSpeed") && l.contains("Invalid Argument")),
        "{}",
        file("nvml-calls.txt")
    );
    let guard = line("  guard: ");
    assert_eq!(guard.matches(" yes").count(), 2, "{log}");
    // What an NVML client holds (on 580: uvm too), the library it maps, and that
    // nvmlShutdown lets go of the files (what a reset relies on).
    let nvml: serde_json::Value = serde_json::from_str(&file("nvml-files.json"))
        .unwrap_or_else(|e| panic!("nvml-files.json: {e}: {log}"));
    assert_eq!(
        nvml["after_init"]["files"],
        serde_json::json!(["nvidia-uvm", "nvidia0", "nvidiactl"]),
        "{nvml}"
    );
    assert_eq!(
        nvml["after_init"]["libraries"],
        serde_json::json!(["libnvidia-ml.so"]),
        "{nvml}"
    );
    assert_eq!(
        nvml["after_shutdown"]["files"],
        serde_json::json!([]),
        "{nvml}"
    );
    // In the dead trainer's snapshot, the forked workers map the CUDA driver library; every
    // vramguard process holding the GPU (the snapshot itself, the alert agent) is an NVML
    // client.
    let snap: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(results.join("snapshots/dead-trainer-inherited-fds.json"))
            .unwrap(),
    )
    .unwrap();
    let procs = snap["processes"].as_array().unwrap();
    let holding_uvm = |p: &&serde_json::Value| p["device_files"].to_string().contains("uvm");
    let workers: Vec<_> = procs
        .iter()
        .filter(holding_uvm)
        .filter(|p| p["cmdline"].to_string().contains("train.py"))
        .collect();
    assert!(workers.len() >= 2, "{snap}");
    assert!(
        workers.iter().all(|p| p["driver_library"] == "cuda"),
        "{snap}"
    );
    let ours: Vec<_> = procs
        .iter()
        .filter(holding_uvm)
        .filter(|p| p["comm"] == "vramguard")
        .collect();
    assert!(!ours.is_empty(), "the alert agent holds the GPU: {snap}");
    assert!(
        ours.iter().all(|p| p["driver_library"] == "nvml_only"),
        "{snap}"
    );

    // Each snapshot replays as the real one of the same name does.
    // The corpus keeps them as h200_<name with underscores>.json.
    let corpus = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/incidents");
    let mut compared = 0;
    for entry in std::fs::read_dir(results.join("snapshots")).unwrap() {
        let ours = entry.unwrap().path();
        let stem = ours
            .file_name()
            .unwrap()
            .to_string_lossy()
            .replace('-', "_");
        let theirs = corpus.join(format!("h200_{stem}"));
        if !theirs.is_file() {
            continue;
        }
        let (a, b) = (replay_status(&ours), replay_status(&theirs));
        let name = ours.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(classes(&a), classes(&b), "{name}");
        let share = |r: &serde_json::Value| {
            r["gpus"][0]["ghost_bytes"].as_f64().unwrap_or(0.0)
                / r["gpus"][0]["memory"]["used"].as_f64().unwrap().max(1.0)
        };
        assert!((share(&a) - share(&b)).abs() < 0.02, "{name}: {a} {b}");
        compared += 1;
    }
    assert_eq!(compared, 5, "every H200 snapshot has its rehearsal: {log}");
}

/// `vramguard sim attach`, the rehearsal's CUDA: the caller's context grows with each call,
/// takes an SM utilization, refuses more than is free (exit 3, as cudaMalloc refuses it) and a
/// descriptor that is not the GPU's device file; and it lives on the caller's open file
/// description, so a child forked after it keeps it, listed under the dead caller's pid, until
/// that child exits.
#[test]
fn sim_attach_gives_the_caller_a_context_that_its_forked_child_keeps() {
    let world = World::new(1);
    let script = r#"
# sim-attach-forked-child
import os, subprocess, sys, time
binary, dev = sys.argv[1], sys.argv[2]
fd = os.open(dev + "/nvidia0", os.O_RDONLY)
def attach(size, *extra, fd=fd):
    r = subprocess.run([binary, "sim", "attach", "--gpu", "0", "--bytes", size, "--fd", str(fd),
                        *extra], pass_fds=(fd,), capture_output=True, text=True)
    print("attach %s: %d %s" % (size, r.returncode, (r.stdout + r.stderr).strip()), flush=True)
attach("2GiB")
attach("1GiB", "--sm-util", "80")
attach("100000GiB")
other = os.open(dev + "/nvidiactl", os.O_RDONLY)
attach("1GiB", fd=other)
child = os.fork()
if child == 0:
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 1)  # the test reads the caller's output to its end
    os.dup2(null, 2)
    time.sleep(30)
    os._exit(0)
print("caller %d child %d" % (os.getpid(), child), flush=True)
os._exit(0)
"#;
    let out = Command::new("python3")
        .args(["-c", script, BIN])
        .arg(world.dir.path().join("dev"))
        .env("VRAMGUARD_SIM", world.state_path())
        .env("VRAMGUARD_CONFIG", "none")
        .output()
        .unwrap();
    let text = stdout(&out);
    let mut last = text.lines().last().unwrap_or("").split_whitespace();
    let caller: u32 = last.nth(1).unwrap().parse().unwrap();
    let child: u32 = last.nth(1).unwrap().parse().unwrap();
    // The child runs this test's script: its command line holds the marker in the script.
    let marker = "sim-attach-forked-child";
    let _reaped = KillOnDrop(child, marker);
    assert!(
        text.contains(&format!(
            "attach 2GiB: 0 pid {caller}: 2.0 GiB on simulated GPU 0"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("attach 1GiB: 0 pid {caller}: 3.0 GiB")),
        "{text}"
    );
    assert!(
        text.contains("attach 100000GiB: 3 vramguard: out of memory on GPU 0"),
        "{text}"
    );
    assert!(
        text.contains("attach 1GiB: 2 vramguard: error: fd "),
        "{text}"
    );
    assert!(text.contains("another file"), "{text}");
    // Bad arguments, and a descriptor this test's command does not have (77): an error that
    // leads with what is wrong, exit 2, no panic.
    for bad in [
        &["--fd=-1"][..],
        &["--fd", "3", "--sm-util", "500"],
        &["--fd", "77"],
    ] {
        let out = vg_command()
            .args(["sim", "attach", "--gpu", "0", "--bytes", "1GiB"])
            .args(bad)
            .env("VRAMGUARD_SIM", world.state_path())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {}", stderr(&out));
        let err = stderr(&out);
        assert!(!err.contains("panicked"), "{err}");
        assert!(
            err.lines().next().is_some_and(|l| l.contains("error")),
            "{err}"
        );
    }

    let show = || -> serde_json::Value {
        let out = vg_command()
            .args(["sim", "show"])
            .env("VRAMGUARD_SIM", world.state_path())
            .output()
            .unwrap();
        serde_json::from_slice(&out.stdout).unwrap()
    };
    // The caller is gone; its forked child keeps its context, listed under the caller's pid.
    let gpu = &show()["gpus"][0];
    assert_eq!(gpu["used"], 3 * GIB, "{gpu}");
    assert_eq!(gpu["processes"][0]["pid"], caller, "{gpu}");
    assert_eq!(gpu["processes"][0]["used_bytes"], 3 * GIB, "{gpu}");
    assert!(
        kill_if_ours(child, marker),
        "the forked child {child} is gone too early"
    );
    wait_until(10, "the child's exit to free the context", || {
        show()["gpus"][0]["used"] == 0
    });
}

/// SIGKILLs `pid` only while its command line holds `marker` (a process this test started
/// through a helper, never a process that reused its pid); whether it did.
fn kill_if_ours(pid: u32, marker: &str) -> bool {
    let ours = std::fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker));
    if ours {
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    ours
}

/// [`kill_if_ours`] when the test ends, however it ends.
struct KillOnDrop(u32, &'static str);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        kill_if_ours(self.0, self.1);
    }
}
