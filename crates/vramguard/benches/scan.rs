//! Scan cost with many processes and open files, next to `fuser -v` and `lsof`.
//!
//! `cargo bench -p vramguard --bench scan` spawns PROCS processes holding FDS_EACH fds
//! each (HOLDERS of them hold the stand-in GPU device files), then prints, in one run:
//! - a full fd scan (a fresh collector, every process's fds), median of 5;
//! - `fuser -v` and `lsof` over the same device files, median of 3;
//! - a steady-state collection (the driver lists the holders; no listing of /proc), and one
//!   that also lists /proc for new processes, medians of 50;
//! - a steady-state snapshot with the in-process simulated driver (200 allocations) and
//!   classification, median of 50.
//!
//! `VRAMGUARD_BENCH_SIZE=tiny` (the suite) runs 50 processes, 10 of them holders; each figure
//! the README quotes is also printed as a `BENCH` line (`scripts/bench.sh`).
//!
//! Every process it starts is killed by pid when it ends.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vramguard_core::{Policy, classify};
use vramguard_gpu::GpuSource;
use vramguard_proc::{ProcCollector, ScanDepth};
use vramguard_sim::SimSource;
use vramguard_testkit::bench::{figure, param, skipped};
use vramguard_testkit::{Children, GIB, World, allocation};

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// Median of three runs of a tool, and its output of the last run; `None` when it is not
/// installed. A run that fails stops the bench: a figure from a failed tool means nothing.
fn time_cmd(program: &str, args: &[String]) -> Option<(Duration, String)> {
    let mut runs = Vec::new();
    let mut text = String::new();
    for _ in 0..3 {
        let t = Instant::now();
        let out = match Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
        {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => panic!("{program}: {e}"),
        };
        runs.push(t.elapsed());
        assert!(
            out.status.success(),
            "{program} {} failed: {}\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Some((median(runs), text))
}

/// How many of `pids` a tool's output names (as whole words).
fn named(text: &str, pids: &[u32]) -> usize {
    let words: std::collections::HashSet<&str> = text
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty())
        .collect();
    pids.iter()
        .filter(|p| words.contains(p.to_string().as_str()))
        .count()
}

fn main() {
    let procs = param("PROCS", 2000, 50);
    let fds_each = param("FDS_EACH", 25, 25);
    let holders = param("HOLDERS", 200, 10);
    let world = World::new(1);
    let filler = world.dir.path().join("filler");
    std::fs::write(&filler, b"").unwrap();
    let dev = world.dev_dir();

    let t = Instant::now();
    // Open the files once here; each child gets them as fds 3.. through dup2 before exec.
    let open = |p: &std::path::Path| std::fs::File::open(p).unwrap();
    let plain: Vec<std::fs::File> = (0..fds_each).map(|_| open(&filler)).collect();
    let mut holding: Vec<std::fs::File> = ["nvidiactl", "nvidia-uvm", "nvidia0"]
        .iter()
        .map(|f| open(&dev.join(f)))
        .collect();
    holding.extend((3..fds_each).map(|_| open(&filler)));
    let raw = |files: &[std::fs::File]| -> Vec<i32> {
        use std::os::fd::AsRawFd;
        files.iter().map(|f| f.as_raw_fd()).collect()
    };
    let (plain_fds, holding_fds) = (raw(&plain), raw(&holding));
    let mut kids = Children(Vec::with_capacity(procs));
    for i in 0..procs {
        let fds = if i < holders {
            holding_fds.clone()
        } else {
            plain_fds.clone()
        };
        let mut cmd = Command::new("sleep");
        cmd.arg("600").stdin(Stdio::null());
        use std::os::unix::process::CommandExt;
        // SAFETY: dup2 is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                for (n, fd) in fds.iter().enumerate() {
                    if libc::dup2(*fd, 100 + n as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                // A bench stopped by a signal runs no destructors: its processes die with it.
                libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                );
                Ok(())
            });
        }
        kids.0.push(cmd.spawn().expect("spawn"));
    }
    // The children have their copies: the bench itself holds no device file from here on.
    drop((plain, holding));
    let pids: Vec<u32> = kids.0.iter().map(|c| c.id()).collect();
    // Wait until every process holds its files.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ready = pids
            .iter()
            .filter(|p| {
                std::fs::read_dir(format!("/proc/{p}/fd"))
                    .map(|d| d.count() > fds_each)
                    .unwrap_or(false)
            })
            .count();
        if ready == pids.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "setup: after 120 s only {ready} of {} processes hold their files",
            pids.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let total_fds: usize = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_dir(e.path().join("fd")).ok())
        .map(|d| d.count())
        .sum();
    println!(
        "setup: {procs} processes x {fds_each} fds ({holders} hold the device files), {} processes and {total_fds} fds on the host, spawned in {:.1}s",
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
            .count(),
        t.elapsed().as_secs_f64()
    );

    let holder_pids: Vec<u32> = pids[..holders].to_vec();
    let mut full = Vec::new();
    for _ in 0..5 {
        // No pids from the driver: like fuser, the scan must find the holders by their fds.
        let t = Instant::now();
        let mut c = ProcCollector::new("/proc", &dev).unwrap();
        let got = c.collect(&[], ScanDepth::Full, 0).unwrap();
        full.push(t.elapsed());
        let mut found: Vec<u32> = got
            .processes
            .iter()
            .filter(|p| p.device_files.gpu_minors().next().is_some())
            .map(|p| p.pid)
            .collect();
        found.sort_unstable();
        let mut want = holder_pids.clone();
        want.sort_unstable();
        assert_eq!(found, want, "the full scan finds exactly the holders");
    }
    let full = median(full);

    let dev_files: Vec<String> = ["nvidiactl", "nvidia-uvm", "nvidia0"]
        .iter()
        .map(|f| dev.join(f).display().to_string())
        .collect();
    let mut fuser_args = vec!["-v".to_string()];
    fuser_args.extend(dev_files.iter().cloned());
    let fuser = time_cmd("fuser", &fuser_args);
    let lsof = time_cmd("lsof", &dev_files);

    let mut collector = ProcCollector::new("/proc", &dev).unwrap();
    collector.collect(&holder_pids, ScanDepth::Full, 0).unwrap();
    let mut steady = Vec::new();
    let mut new_procs = Vec::new();
    for i in 0..50 {
        let t = Instant::now();
        collector
            .collect(&holder_pids, ScanDepth::Holders, i)
            .unwrap();
        steady.push(t.elapsed());
        let t = Instant::now();
        collector
            .collect(&holder_pids, ScanDepth::NewProcesses, i)
            .unwrap();
        new_procs.push(t.elapsed());
    }
    let steady = median(steady);
    let new_procs = median(new_procs);

    for &p in &holder_pids {
        world.allocate(allocation(0, p, GIB / 8));
    }
    let mut source = SimSource::open(&world.state_path()).unwrap();
    let policy = Policy::default();
    let mut snap_times = Vec::new();
    let mut gpu_times = Vec::new();
    let mut proc_times = Vec::new();
    let mut classify_times = Vec::new();
    for i in 0..50 {
        let t = Instant::now();
        let drv = source.sample(Duration::from_secs(600)).unwrap();
        gpu_times.push(t.elapsed());
        let listed: Vec<u32> = drv.gpus[0].processes.iter().map(|p| p.pid).collect();
        let tp = Instant::now();
        let procs = collector.collect(&listed, ScanDepth::Holders, i).unwrap();
        proc_times.push(tp.elapsed());
        let mut snap = vramguard_core::Snapshot {
            taken_at_ms: i,
            host: procs.host,
            driver: drv.driver,
            gpus: drv.gpus,
            processes: procs.processes,
            departed: procs.departed,
            scan: procs.scan,
            work: None,
            job_cgroups: procs.job_cgroups,
            host_memory: Some(procs.host_memory),
            kubelet_pods: None,
        };
        snap.normalize();
        let tc = Instant::now();
        let report = classify(&snap, &policy);
        classify_times.push(tc.elapsed());
        snap_times.push(t.elapsed());
        assert_eq!(report.gpus[0].holders.len(), holders);
    }

    println!("full fd scan (vramguard):          {}", ms(full));
    if let Some((_, text)) = &fuser {
        assert_eq!(
            named(text, &holder_pids),
            holders,
            "fuser names every holder"
        );
    }
    if let Some((_, text)) = &lsof {
        assert_eq!(
            named(text, &holder_pids),
            holders,
            "lsof names every holder"
        );
    }
    figure("scan.full_scan", full.as_secs_f64() * 1000.0, "ms");
    match fuser {
        Some((f, _)) => {
            println!(
                "fuser -v on the 3 device files:    {}   ({:.1}x the full scan)",
                ms(f),
                f.as_secs_f64() / full.as_secs_f64()
            );
            figure("scan.fuser", f.as_secs_f64() * 1000.0, "ms");
            figure(
                "scan.fuser_ratio",
                f.as_secs_f64() / full.as_secs_f64(),
                "x",
            );
        }
        None => {
            println!("fuser -v:                          not installed (Debian package psmisc)");
            for name in ["scan.fuser", "scan.fuser_ratio"] {
                skipped(name, "fuser is not installed (Debian package psmisc)");
            }
        }
    }
    match lsof {
        Some((l, _)) => {
            println!(
                "lsof on the 3 device files:        {}   ({:.1}x the full scan)",
                ms(l),
                l.as_secs_f64() / full.as_secs_f64()
            );
            figure("scan.lsof", l.as_secs_f64(), "s");
            figure("scan.lsof_ratio", l.as_secs_f64() / full.as_secs_f64(), "x");
        }
        None => {
            println!("lsof:                              not installed (Debian package lsof)");
            for name in ["scan.lsof", "scan.lsof_ratio"] {
                skipped(name, "lsof is not installed (Debian package lsof)");
            }
        }
    }
    println!(
        "steady-state /proc collection:     {}   ({holders} listed holders, no listing of /proc)",
        ms(steady)
    );
    println!(
        "/proc listing + new processes:     {}   (no new processes)",
        ms(new_procs)
    );
    let snapshot = median(snap_times);
    println!(
        "steady-state snapshot + classify:  {}   (simulated driver {}, /proc {}, classification {})",
        ms(snapshot),
        ms(median(gpu_times)),
        ms(median(proc_times)),
        ms(median(classify_times))
    );
    figure(
        "scan.steady_collection",
        steady.as_secs_f64() * 1000.0,
        "ms",
    );
    figure(
        "scan.steady_snapshot",
        snapshot.as_secs_f64() * 1000.0,
        "ms",
    );
}
