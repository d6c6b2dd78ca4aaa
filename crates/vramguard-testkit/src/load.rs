//! A busy node for benchmarks: thousands of real processes, each with its fds, some holding
//! simulated GPU memory; and what a benchmark reads of a process (CPU, RSS).

use crate::{Children, GIB, World, allocation};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vramguard_proc::OWN_PROC;

/// A `sleep 3600` with `files` as its fds 100 and up; it dies with the benchmark.
pub fn spawn_sleeper(files: &[std::fs::File]) -> Child {
    use std::os::unix::process::CommandExt;
    let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
    let mut cmd = Command::new("sleep");
    cmd.arg("3600").stdin(Stdio::null());
    // SAFETY: dup2 and prctl only, between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for (n, fd) in fds.iter().enumerate() {
                libc::dup2(*fd, 100 + n as i32);
            }
            // A benchmark stopped by a signal runs no destructors: its processes die with it.
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
    cmd.spawn().expect("spawn sleep")
}

/// The processes of a busy node and the files a holder has open.
pub struct BusyNode {
    /// Every process started (killed and reaped on drop).
    pub processes: Children,
    /// The fds of a holder: the three device files, then filler.
    pub holder_files: Vec<std::fs::File>,
}

/// Starts `procs` processes with `fds_each` fds each on `world`; the first `holders` hold
/// 256 MiB of GPU 0 each and have the device files open. Waits until every one holds its
/// files (at most two minutes, else panics).
pub fn busy_node(world: &World, procs: usize, holders: usize, fds_each: usize) -> BusyNode {
    let filler = world.dir.path().join("filler");
    std::fs::write(&filler, b"").expect("filler file");
    let open = |p: &std::path::Path| std::fs::File::open(p).expect("open");
    let mut holder_files: Vec<std::fs::File> = ["nvidiactl", "nvidia-uvm", "nvidia0"]
        .iter()
        .map(|f| open(&world.dev(f)))
        .collect();
    holder_files.extend((3..fds_each).map(|_| open(&filler)));
    let idle: Vec<std::fs::File> = (0..fds_each).map(|_| open(&filler)).collect();
    let mut processes = Children(Vec::new());
    for i in 0..procs {
        processes.0.push(spawn_sleeper(if i < holders {
            &holder_files
        } else {
            &idle
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let ready = processes
            .0
            .iter()
            .filter(|c| {
                std::fs::read_dir(format!("{OWN_PROC}/{}/fd", c.id()))
                    .is_ok_and(|d| d.count() >= fds_each)
            })
            .count();
        if ready == processes.0.len() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "setup: after 120 s only {ready} of {procs} processes hold their files"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    world.update(|s| {
        for c in processes.0.iter().take(holders) {
            s.allocations.push(allocation(0, c.id(), GIB / 4));
        }
    });
    BusyNode {
        processes,
        holder_files,
    }
}

/// CPU time of every thread of `pid`, in nanoseconds (the first field of each task's
/// `schedstat`): precise enough for a per-sample figure in hundredths of a millisecond.
pub fn cpu_ns(pid: u32) -> u64 {
    std::fs::read_dir(format!("{OWN_PROC}/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
                .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0)
}

/// CPU time of the threads of `pid` whose name starts with `prefix`, nanoseconds (from each
/// thread's `schedstat`): the agent's `nvml-*` threads make only the driver's calls.
pub fn cpu_ns_of_threads(pid: u32, prefix: &str) -> u64 {
    std::fs::read_dir(format!("{OWN_PROC}/{pid}/task"))
        .map(|d| {
            d.flatten()
                .filter(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .is_ok_and(|c| c.trim_end().starts_with(prefix))
                })
                .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
                .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0)
}

/// Resident memory of `pid`, KiB.
pub fn rss_kib(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:")
}

/// A process's resident memory in two parts, in KiB: anonymous (heap, stacks) and
/// file-backed (the binary's and libraries' pages, faulted in as code paths first run).
pub fn rss_parts_kib(pid: u32) -> (u64, u64) {
    (status_kib(pid, "RssAnon:"), status_kib(pid, "RssFile:"))
}

fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("{OWN_PROC}/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A vramguard agent on `world` with the config file `config`, listening on a free loopback
/// port and dying with the benchmark; `wrapper` (e.g. a profiler's argv) runs it. Returns it
/// with its address, read from its start-up log line.
pub fn spawn_agent(
    bin: &str,
    wrapper: &[&str],
    world: &World,
    config: &std::path::Path,
) -> (Child, std::net::SocketAddr) {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(wrapper.first().copied().unwrap_or(bin));
    if !wrapper.is_empty() {
        cmd.args(&wrapper[1..]).arg(bin);
    }
    // SAFETY: prctl only, between fork and exec: the agent dies with the benchmark.
    unsafe {
        cmd.pre_exec(|| {
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
    let mut child = cmd
        .env_remove("VRAMGUARD_SIM")
        .arg("--sim")
        .arg(world.state_path())
        .arg("--config")
        .arg(config)
        .args(["agent", "--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the agent");
    let mut lines = std::io::BufReader::new(child.stderr.take().expect("piped")).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("the agent exited before it listened")
            .expect("agent output");
        let plain: String = line.chars().filter(|c| !c.is_control()).collect();
        if let Some(a) = plain
            .split("listen=")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|a| {
                a.trim_end_matches(|c: char| !c.is_ascii_digit())
                    .parse()
                    .ok()
            })
        {
            break a;
        }
    };
    // Keep reading its log, so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    (child, addr)
}
