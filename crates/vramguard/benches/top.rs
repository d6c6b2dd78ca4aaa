//! `vramguard top` next to nvitop on the same simulated node, not in CI:
//! `cargo bench -p vramguard --bench top`.
//!
//! Starts PROCS processes with FDS_EACH fds each (HOLDERS of them holding simulated GPU
//! memory: the agent benchmark's node), then runs each live view in a pseudo-terminal
//! (200×50) at a 1 s refresh through the same simulated `libnvidia-ml.so.1`, and prints the
//! CPU each used over MEASURE_SECS (every thread's `schedstat`), per second and as a share
//! of one core, and its RSS. nvitop is the pinned one `scripts/test.sh` installs in
//! `target/pyenv`; without it, only vramguard's figure is printed.
//!
//! `VRAMGUARD_BENCH_SIZE=tiny` (the suite) runs 50 processes (10 holders) and measures for
//! one second once each view has drawn; each figure the README quotes is also printed as a
//! `BENCH` line (`scripts/bench.sh`).
//!
//! Every process it starts is killed by pid when it ends.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use vramguard_testkit::bench::{figure, param, sized, skipped};
use vramguard_testkit::load::{busy_node, cpu_ns, rss_kib};
use vramguard_testkit::pty;
use vramguard_testkit::{Reaped, World, sim_nvml_lib};

const BIN: &str = env!("CARGO_BIN_EXE_vramguard");

/// CPU (ms per second of wall time) and RSS (KiB) of `cmd` running on a terminal for
/// `secs`, after `warmup` to start and once it has drawn (at most 60 s more).
fn measure(name: &str, mut cmd: Command, warmup: Duration, secs: u64) -> (f64, u64) {
    let (master, slave) = pty::pair(50, 200).expect("a pseudo-terminal");
    cmd.env("TERM", "xterm-256color").env_remove("COLUMNS");
    let child = Reaped(pty::spawn_on(&mut cmd, &slave).expect("start"));
    let screen = pty::Collected::start(&master).expect("read the terminal");
    std::thread::sleep(warmup);
    let drawn = Instant::now() + Duration::from_secs(60);
    while screen.len() <= 1000 && Instant::now() < drawn && child_alive(&child) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        child_alive(&child),
        "{name} exited at start; it wrote:\n{}",
        screen.text()
    );
    let pid = child.pid();
    let (t0, c0) = (Instant::now(), cpu_ns(pid));
    std::thread::sleep(Duration::from_secs(secs));
    let ms_per_sec = (cpu_ns(pid) - c0) as f64 / 1e6 / t0.elapsed().as_secs_f64();
    let rss = rss_kib(pid);
    assert!(child_alive(&child), "{name} exited while measured");
    assert!(screen.len() > 1000, "{name} drew nothing");
    drop(child);
    (ms_per_sec, rss)
}

fn child_alive(c: &Reaped) -> bool {
    vramguard_testkit::alive(c.pid()) && vramguard_testkit::state_of(c.pid()) != Some('Z')
}

fn main() {
    let procs = param("PROCS", 2000, 50);
    let holders = param("HOLDERS", 200, 10);
    let fds_each = param("FDS_EACH", 25usize, 25);
    let secs = param("MEASURE_SECS", 30u64, 1);
    let world = World::new(1);
    let t = Instant::now();
    let _node = busy_node(&world, procs, holders, fds_each);
    println!(
        "setup: {procs} processes x {fds_each} fds, {holders} holding simulated GPU memory ({:.1}s)",
        t.elapsed().as_secs_f64()
    );
    let lib = sim_nvml_lib();
    let mut top = Command::new(BIN);
    top.arg("--sim")
        .arg(world.state_path())
        .arg("--nvml-lib")
        .arg(&lib)
        .args(["top", "--delay", "1s"]);
    let (ms, rss) = measure("vramguard top", top, Duration::from_secs(sized(5, 0)), secs);
    println!(
        "vramguard top, refresh 1 s: {ms:.1} ms CPU per second ({:.2}% of one core) over {secs} s, RSS {rss} KiB",
        ms / 10.0
    );
    figure("top.vramguard_cpu", ms, "ms/s");
    figure("top.vramguard_rss", mb(rss), "MB");
    let nvitop = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/pyenv/bin/nvitop");
    if !nvitop.exists() {
        println!("nvitop: not installed (scripts/test.sh installs it in target/pyenv)");
        for name in ["top.nvitop_cpu", "top.nvitop_rss", "top.nvitop_cpu_ratio"] {
            skipped(
                name,
                "nvitop is not installed (scripts/test.sh installs it in target/pyenv)",
            );
        }
        return;
    }
    let mut cmd = Command::new(&nvitop);
    cmd.args(["--monitor", "full", "--interval", "1"])
        .env("VRAMGUARD_SIM", world.state_path())
        .env(
            "LD_LIBRARY_PATH",
            lib.parent().expect("the library's directory"),
        );
    let (nv_ms, nv_rss) = measure("nvitop", cmd, Duration::from_secs(sized(10, 0)), secs);
    println!(
        "nvitop --monitor, interval 1 s: {nv_ms:.1} ms CPU per second ({:.2}% of one core) over {secs} s, RSS {nv_rss} KiB",
        nv_ms / 10.0
    );
    println!(
        "vramguard top uses {:.1}x less CPU and {:.1}x less memory than nvitop on this node",
        nv_ms / ms.max(0.001),
        nv_rss as f64 / rss.max(1) as f64
    );
    figure("top.nvitop_cpu", nv_ms, "ms/s");
    figure("top.nvitop_rss", mb(nv_rss), "MB");
    figure("top.nvitop_cpu_ratio", nv_ms / ms.max(0.001), "x");
}

/// KiB (as /proc gives RSS) in MB (10^6 bytes), as the README quotes them.
fn mb(kib: u64) -> f64 {
    kib as f64 * 1024.0 / 1e6
}
