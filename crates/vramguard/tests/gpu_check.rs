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
    let stubborn = "import signal, time\n\
        signal.signal(signal.SIGHUP, signal.SIG_IGN)\n\
        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n\
        while True:\n    try: print('x', flush=True)\n    except OSError: pass\n    time.sleep(0.2)\n";
    let out = Command::new("python3")
        .arg(scripts().join("gpu-check/ptycost.py"))
        .args(["3.5", "stubborn", "--", "python3", "-c", stubborn])
        .output()
        .unwrap();
    let line = stdout(&out);
    assert!(out.status.success(), "{line}{}", stderr(&out));
    let pid = ptycost_value(&line, "pid") as u32;
    let left_running = alive(pid);
    if left_running {
        // Started by this test (through the helper): ended here so that it does not linger.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
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
