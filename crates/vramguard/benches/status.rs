//! `vramguard status` as a user runs it, next to the tools they would otherwise run.
//!
//! `cargo bench -p vramguard --bench status` starts, for each size in SIZES (2,000, 6,000 and
//! 10,000 processes), that many processes with FDS_EACH fds each, HOLDERS of them holding
//! simulated GPU memory and the device files in a live job (this benchmark's): nothing to
//! decide. It then times, in one run, the release binary as a user starts it (median of
//! RUNS): `status` at its defaults, `status --sample 0s`, `status --full-scan`, `diagnose`,
//! and `fuser -v` and `lsof` on the same device files. With nothing unexplained, `status`
//! reads the driver's listed processes only, unless `/dev/shm` holds a segment (the default
//! configuration scans it): then it reads every process, as `--full-scan` does, and the
//! benchmark says so. At the smallest size it adds one idle orphan (a holder
//! whose job is gone): then `status` must watch it work before it may call it an orphan, and
//! the figure shows what that window costs.
//!
//! `VRAMGUARD_BENCH_SIZE=tiny` (the suite) runs 50 processes, 10 holders, one run each.
//! Every process it starts dies with it (by pid, or by the parent-death signal).

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vramguard_testkit::bench::{figure, param, sized, skipped};
use vramguard_testkit::load::busy_node;
use vramguard_testkit::{GIB, World, allocation};

const BIN: &str = env!("CARGO_BIN_EXE_vramguard");

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Median wall time of `runs` runs of `program args`; `None` when it is not installed. A run
/// that fails stops the benchmark: a figure from a failed command means nothing.
fn time_runs(program: &str, args: &[String], runs: usize, ok: &[i32]) -> Option<Duration> {
    let mut times = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let out = match Command::new(program)
            .args(args)
            .env("VRAMGUARD_CONFIG", "none")
            .stdin(Stdio::null())
            .output()
        {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => panic!("{program}: {e}"),
        };
        times.push(t.elapsed());
        let code = out.status.code().unwrap_or(-1);
        assert!(
            ok.contains(&code),
            "{program} {} exited {code}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Some(median(times))
}

/// An idle holder whose job is gone: `sh` (a process group of its own) starts `sleep` with
/// the device files open and exits. Returns its pid, and a pidfd to kill it by.
fn orphan(world: &World) -> (u32, std::os::fd::OwnedFd) {
    let script = format!(
        "exec 3<{} 4<{} 5<{}; sleep 600 </dev/null >/dev/null 2>&1 & echo $!",
        world.dev("nvidiactl").display(),
        world.dev("nvidia-uvm").display(),
        world.dev("nvidia0").display()
    );
    let out = Command::new("sh")
        .args(["-c", &script])
        .process_group(0)
        .stdin(Stdio::null())
        .output()
        .expect("sh");
    let pid: u32 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("the orphan's pid");
    let pidfd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(pid as i32).expect("a pid"),
        rustix::process::PidfdFlags::empty(),
    )
    .expect("pidfd of the orphan");
    world.allocate(allocation(0, pid, GIB));
    (pid, pidfd)
}

fn main() {
    // The benchmark holds the device files itself (a busy node's holders are spawned with its
    // copies), so it is a holder that the driver does not list: it leads a session of its
    // own, so that its job is alive however it was started (from a shell that has exited, its
    // job's leader would be gone and `status` would rightly watch it for a window).
    let _ = rustix::process::setsid();
    let sizes: Vec<usize> = param("SIZES", "2000,6000,10000".to_string(), "50".to_string())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let holders = param("HOLDERS", 200, 10);
    let fds_each = param("FDS_EACH", 25usize, 25);
    let runs = param("RUNS", 5usize, 1);
    for (i, &procs) in sizes.iter().enumerate() {
        let world = World::new(1);
        let t = Instant::now();
        let node = busy_node(&world, procs, holders, fds_each);
        println!(
            "setup: {procs} processes x {fds_each} fds, {holders} holding simulated GPU memory in a live job ({:.1}s)",
            t.elapsed().as_secs_f64()
        );
        let vg = |extra: &[&str]| -> Vec<String> {
            let mut a = vec![
                "--sim".to_string(),
                world.state_path().display().to_string(),
            ];
            a.extend(extra.iter().map(|s| s.to_string()));
            a
        };
        let segments = std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                    .count()
            })
            .unwrap_or(0);
        if segments > 0 {
            println!(
                "  note: /dev/shm holds {segments} segment(s): status reads every process to attribute them, as --full-scan does"
            );
        }
        let status = time_runs(BIN, &vg(&["status"]), runs, &[0]).expect("vramguard");
        let nosample =
            time_runs(BIN, &vg(&["status", "--sample", "0s"]), runs, &[0]).expect("vramguard");
        let full_scan =
            time_runs(BIN, &vg(&["status", "--full-scan"]), runs, &[0]).expect("vramguard");
        let diagnose = time_runs(BIN, &vg(&["diagnose"]), runs, &[0, 1]).expect("vramguard");
        let devices: Vec<String> = ["nvidiactl", "nvidia-uvm", "nvidia0"]
            .iter()
            .map(|f| world.dev(f).display().to_string())
            .collect();
        let mut fuser_args = vec!["-v".to_string()];
        fuser_args.extend(devices.iter().cloned());
        let fuser = time_runs("fuser", &fuser_args, runs.min(3), &[0]);
        let lsof = time_runs("lsof", &devices, runs.min(3), &[0]);
        println!(
            "{procs} processes: status {:.1} ms, status --sample 0s {:.1} ms ({:.2}x), status --full-scan {:.1} ms, diagnose {:.1} ms",
            ms(status),
            ms(nosample),
            status.as_secs_f64() / nosample.as_secs_f64(),
            ms(full_scan),
            ms(diagnose)
        );
        // The smallest size's figures are judged against the targets, the largest's are
        // shown beside them; the sizes between are in the human output only.
        let last = i + 1 == sizes.len();
        let judged = i == 0;
        let out = |small: &str, large: &str, value: Option<f64>, why: &str| {
            let mut names = Vec::new();
            if judged {
                names.push(small);
            }
            if last && sizes.len() > 1 {
                names.push(large);
            }
            for n in names {
                match value {
                    Some(v) => figure(n, v, "ms"),
                    None => skipped(n, why),
                }
            }
        };
        out("status.status", "status.status_large", Some(ms(status)), "");
        out(
            "status.nosample",
            "status.nosample_large",
            Some(ms(nosample)),
            "",
        );
        out(
            "status.full_scan",
            "status.full_scan_large",
            Some(ms(full_scan)),
            "",
        );
        out(
            "status.diagnose",
            "status.diagnose_large",
            Some(ms(diagnose)),
            "",
        );
        let fuser_missing = "fuser is not installed (Debian package psmisc)";
        if let Some(f) = fuser {
            println!(
                "  fuser -v {:.1} ms ({:.1}x status)",
                ms(f),
                f.as_secs_f64() / status.as_secs_f64()
            );
        }
        out(
            "status.fuser",
            "status.fuser_large",
            fuser.map(ms),
            fuser_missing,
        );
        if let Some(l) = lsof {
            println!(
                "  lsof {:.1} ms ({:.1}x status)",
                ms(l),
                l.as_secs_f64() / status.as_secs_f64()
            );
        }
        out(
            "status.lsof",
            "status.lsof_large",
            lsof.map(ms),
            "lsof is not installed (Debian package lsof)",
        );
        if judged {
            figure(
                "status.window_ratio",
                status.as_secs_f64() / nosample.as_secs_f64(),
                "x",
            );
            match fuser {
                Some(f) => figure(
                    "status.fuser_ratio",
                    f.as_secs_f64() / status.as_secs_f64(),
                    "x",
                ),
                None => skipped("status.fuser_ratio", fuser_missing),
            }
        }
        if judged {
            // Something to decide: an idle holder whose job is gone is watched before it is
            // called an orphan.
            let (pid, pidfd) = orphan(&world);
            // Killed through its pidfd however this block ends (a panic included).
            struct KillOnDrop(std::os::fd::OwnedFd);
            impl Drop for KillOnDrop {
                fn drop(&mut self) {
                    let _ =
                        rustix::process::pidfd_send_signal(&self.0, rustix::process::Signal::KILL);
                }
            }
            let orphan_guard = KillOnDrop(pidfd);
            let decided = time_runs(BIN, &vg(&["status"]), runs, &[0]).expect("vramguard");
            println!(
                "  with one orphan to decide (pid {pid}): status {:.1} ms",
                ms(decided)
            );
            figure("status.with_candidate", ms(decided), "ms");
            drop(orphan_guard);
        }
        if sizes.len() == 1 {
            for name in [
                "status.status_large",
                "status.nosample_large",
                "status.full_scan_large",
                "status.diagnose_large",
                "status.fuser_large",
                "status.lsof_large",
            ] {
                skipped(name, "one size only in this run (SIZES)");
            }
        }
        drop(node);
        // Let the killed processes go before the next size counts its own.
        std::thread::sleep(sized(Duration::from_millis(500), Duration::ZERO));
    }
}
