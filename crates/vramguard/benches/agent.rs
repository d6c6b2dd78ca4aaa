//! The agent under load, not in CI: `cargo bench -p vramguard --bench agent`.
//!
//! Starts PROCS processes with FDS_EACH fds each (HOLDERS of them holding simulated GPU
//! memory), the scan bench's population, runs `vramguard agent` on them, and prints:
//! - CPU per sample at the default configuration over MEASURE_SECS (periodic /proc listings
//!   and full fd scans included), CPU from every thread's `schedstat` in nanoseconds;
//! - the same for a tuned agent (interval 250 ms, no periodic listing or scan), labelled so;
//! - /metrics latency (p50, p99, max) under SCRAPERS concurrent scrapers;
//! - CPU per sample with a /proc listing in every sample;
//! - with SOAK_SECS set (e.g. 3600), RSS every 15 s while holders come and go, and its slope
//!   after the first minute and in steady state.
//!
//! A setup that times out stops the bench with an error.
//!
//! `VRAMGUARD_BENCH_SIZE=tiny` (the suite) runs 50 processes (10 holders), 4 scrapers,
//! one-second measurements and a 3-second soak; each figure the README quotes is also printed
//! as a `BENCH` line (`scripts/bench.sh`).
//!
//! Every process it starts is killed by pid when it ends.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Child;
use std::time::{Duration, Instant};
use vramguard_testkit::bench::{figure, param, sized, skipped};
use vramguard_testkit::load::{
    busy_node, cpu_ns, cpu_ns_of_threads, rss_kib, rss_parts_kib, spawn_agent, spawn_sleeper,
};
use vramguard_testkit::{GIB, World, allocation, env_or};

const BIN: &str = env!("CARGO_BIN_EXE_vramguard");

fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return (0, String::new());
    };
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n"
    );
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    let code = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (
        code,
        buf.split_once("\r\n\r\n")
            .map(|x| x.1.to_string())
            .unwrap_or_default(),
    )
}

/// A keep-alive client, as Prometheus scrapes: one connection, many requests.
struct KeepAlive {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl KeepAlive {
    fn new(addr: SocketAddr) -> KeepAlive {
        let s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        KeepAlive {
            writer: s.try_clone().unwrap(),
            reader: BufReader::new(s),
        }
    }

    fn get(&mut self, path: &str) -> (u16, usize) {
        write!(self.writer, "GET {path} HTTP/1.1\r\nHost: b\r\n\r\n").unwrap();
        let mut status = String::new();
        self.reader.read_line(&mut status).unwrap();
        let mut len = 0;
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; len];
        self.reader.read_exact(&mut body).unwrap();
        (
            status
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .unwrap_or(0),
            len,
        )
    }
}

/// Collections so far, of one kind (`full`, `new_processes`, `holders`, `cached`) or all.
fn collections_of(addr: SocketAddr, kind: Option<&str>) -> f64 {
    get(addr, "/metrics")
        .1
        .lines()
        .filter(|l| l.starts_with("vramguard_collections_total"))
        .filter(|l| kind.is_none_or(|k| l.contains(&format!("kind=\"{k}\""))))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn collections(addr: SocketAddr) -> f64 {
    collections_of(addr, None)
}

struct AgentProc {
    child: Child,
    addr: SocketAddr,
}
impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl AgentProc {
    /// Under AGENT_WRAP, the agent is the wrapper's child: it is killed (SIGKILL, so that what
    /// it still holds is what the profiler reports as not freed) and the wrapper is left to
    /// write its profile and exit before the bench's PID namespace ends, taking it along.
    fn stop_wrapped(&mut self) {
        let wrapper = self.child.id();
        let children: Vec<i32> = std::fs::read_dir(vramguard_proc::OWN_PROC)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read_to_string(format!("{}/{pid}/stat", vramguard_proc::OWN_PROC))
                    .ok()
                    .and_then(|s| {
                        s.rsplit_once(") ")?
                            .1
                            .split(' ')
                            .nth(1)?
                            .parse::<u32>()
                            .ok()
                    })
                    == Some(wrapper)
            })
            .collect();
        for pid in children {
            // SAFETY: kill(2) on a child of the wrapper this bench started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = self.child.wait();
    }
}

fn start_agent(world: &World, config: &str) -> AgentProc {
    let cfg = world.dir.path().join("bench.toml");
    std::fs::write(&cfg, config).unwrap();
    // AGENT_WRAP="heaptrack -o /tmp/agent" runs the agent under a profiler (its RSS figures
    // are then the wrapper's); the soak kills the agent at its end and waits for the profile.
    let wrap = std::env::var("AGENT_WRAP").unwrap_or_default();
    let wrapper: Vec<&str> = wrap.split_whitespace().collect();
    let (child, addr) = spawn_agent(BIN, &wrapper, world, &cfg);
    while get(addr, "/healthz").0 != 200 {
        std::thread::sleep(Duration::from_millis(50));
    }
    AgentProc { child, addr }
}

/// KiB (as /proc gives RSS) in MB (10^6 bytes), as the README quotes them.
fn mb(kib: u64) -> f64 {
    kib as f64 * 1024.0 / 1e6
}

/// CPU milliseconds per collection over `secs`, and how many collections that was.
fn per_sample(agent: &AgentProc, secs: f64) -> (f64, f64) {
    let (ms, samples, _) = per_sample_split(agent, secs);
    (ms, samples)
}

/// [`per_sample`], and of it the milliseconds spent in the threads that make the driver's
/// calls (`nvml-*`: here the simulated driver's model; on a GPU, `libnvidia-ml.so.1`).
fn per_sample_split(agent: &AgentProc, secs: f64) -> (f64, f64, f64) {
    let pid = agent.child.id();
    let (t0, d0, c0) = (
        cpu_ns(pid),
        cpu_ns_of_threads(pid, "nvml-"),
        collections(agent.addr),
    );
    std::thread::sleep(Duration::from_secs_f64(secs));
    let (t1, d1, c1) = (
        cpu_ns(pid),
        cpu_ns_of_threads(pid, "nvml-"),
        collections(agent.addr),
    );
    let samples = (c1 - c0).max(1.0);
    (
        (t1 - t0) as f64 / 1e6 / samples,
        samples,
        d1.saturating_sub(d0) as f64 / 1e6 / samples,
    )
}

fn main() {
    // The benchmark holds the device files itself (a busy node's holders are spawned with its
    // copies): it leads a session of its own, so that its job is alive however it was started.
    // From a shell that has exited, its job's leader would be gone, and the agent would
    // rightly watch it work at every sample (that tripled the figures of a run under nohup).
    let _ = rustix::process::setsid();
    let procs = param("PROCS", 2000, 50);
    let holders = param("HOLDERS", 200, 10);
    let scrapers = param("SCRAPERS", 50, 4);
    let world = World::new(1);
    // The scan bench's population: FDS_EACH fds per process, the holders' first three on the
    // device files.
    let fds_each = param("FDS_EACH", 25usize, 25);
    let t = Instant::now();
    let node = busy_node(&world, procs as usize, holders as usize, fds_each);
    let files = &node.holder_files;
    println!(
        "setup: {procs} processes x {fds_each} fds, {holders} holding simulated GPU memory ({:.1}s)",
        t.elapsed().as_secs_f64()
    );

    // SOAK_ONLY=1 skips straight to the soak.
    if env_or("SOAK_ONLY", 0) == 0 {
        {
            // The defaults: a sample a second, a /proc listing every 5 s, a full fd scan every
            // 10 min while device opens are watched (every 60 s where they cannot be); measured
            // over MEASURE_SECS (120). A full scan that the window does not hold is measured
            // on its own (an agent scanning every 3 s, against this one) and its CPU spread over
            // its period, so that the figure is the mean over a whole period.
            let agent = start_agent(&world, "");
            std::thread::sleep(Duration::from_secs_f64(sized(3.0, 0.5)));
            let secs = param("MEASURE_SECS", 120u64, 1);
            let full0 = collections_of(agent.addr, Some("full"));
            let quiet0 = collections_of(agent.addr, Some("quiet"));
            let (ms_window, n, driver_ms) = per_sample_split(&agent, secs as f64);
            let full = collections_of(agent.addr, Some("full")) - full0;
            let quiet = collections_of(agent.addr, Some("quiet")) - quiet0;
            let rss = rss_kib(agent.child.id());
            let metrics = get(agent.addr, "/metrics").1;
            let watching = metrics
                .lines()
                .any(|l| l.starts_with("vramguard_agent_watching_opens 1"));
            drop(agent);
            let period_secs = if watching { 600.0 } else { 60.0 };
            let ms = if full > 0.0 {
                ms_window
            } else {
                let scanning = start_agent(&world, "[agent]\nfull_scan_every = \"3s\"\n");
                std::thread::sleep(Duration::from_secs_f64(sized(3.0, 0.5)));
                let secs3 = sized(30.0, 2.0);
                let f0 = collections_of(scanning.addr, Some("full"));
                let (ms3, n3) = per_sample(&scanning, secs3);
                let fulls = (collections_of(scanning.addr, Some("full")) - f0).max(1.0);
                let full_scan_ms = ((ms3 - ms_window) * n3 / fulls).max(0.0);
                println!(
                    "one full fd scan: {full_scan_ms:.1} ms CPU ({fulls:.0} scans in {secs3} s at {ms3:.2} ms per sample)"
                );
                figure("agent.full_scan_cpu", full_scan_ms, "ms");
                println!(
                    "  the same with a full fd scan every 60 s (the period without the open watch): {:.2} ms CPU per sample",
                    ms_window + full_scan_ms / 60.0
                );
                ms_window + full_scan_ms / period_secs
            };
            println!(
                "at the defaults: {ms:.2} ms CPU per sample over a whole full-scan period of {period_secs:.0} s (device opens watched: {watching}); {ms_window:.2} ms per sample over {secs} s ({n:.0} samples, {quiet:.0} of them quiet, {full:.0} full fd scans, listings included), {:.2}% of one core, RSS {rss} KiB",
                ms / 10.0,
            );
            println!(
                "  of which in the driver's calls (the nvml-* threads; the simulated driver's model here): {driver_ms:.2} ms per sample; the agent's own work: {:.2} ms",
                ms - driver_ms
            );
            figure("agent.cpu_defaults", ms, "ms");
            figure("agent.cpu_defaults_driver_calls", driver_ms, "ms");
            figure("agent.rss", mb(rss), "MB");
        }
        {
            // The same defaults where something is undecided (here an alert pending for a
            // day): no sample is quiet, and the listing and the re-read come every 5 s.
            let agent = start_agent(
                &world,
                "[[alerts.rule]]\nname = \"pending\"\nwhen = \"used_ratio\"\nabove = 0.0\nfor = \"24h\"\n",
            );
            std::thread::sleep(Duration::from_secs_f64(sized(3.0, 0.5)));
            let quiet0 = collections_of(agent.addr, Some("quiet"));
            let (ms, n) = per_sample(&agent, sized(30.0, 1.0));
            let quiet = collections_of(agent.addr, Some("quiet")) - quiet0;
            println!(
                "at the defaults with something undecided (an alert pending): {ms:.2} ms CPU per sample ({n:.0} samples, {quiet:.0} quiet, listings included, no full fd scan)"
            );
            figure("agent.cpu_undecided", ms, "ms");
        }
        {
            let agent = start_agent(
                &world,
                "[agent]\ninterval = \"250ms\"\ndiscover_every = \"1h\"\nfull_scan_every = \"1h\"\n",
            );
            std::thread::sleep(Duration::from_secs_f64(sized(2.0, 0.5)));
            let (ms, n) = per_sample(&agent, sized(30.0, 1.0));
            println!(
                "tuned (interval 250 ms, no periodic listing or full scan): {ms:.2} ms CPU per steady-state sample ({n:.0} samples), RSS {} KiB",
                rss_kib(agent.child.id())
            );
            figure("agent.cpu_tuned", ms, "ms");
            // Scrapers.
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let threads: Vec<_> = (0..scrapers)
                .map(|_| {
                    let stop = stop.clone();
                    let addr = agent.addr;
                    std::thread::spawn(move || {
                        let mut lat = Vec::new();
                        let mut client = KeepAlive::new(addr);
                        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                            let t = Instant::now();
                            let (code, len) = client.get("/metrics");
                            assert_eq!(code, 200);
                            assert!(len > 1000);
                            lat.push(t.elapsed().as_secs_f64() * 1000.0);
                            // Prometheus scrapes every few seconds; here, as fast as possible
                            // with a short pause, so that 50 scrapers stay 50 concurrent requests.
                            std::thread::sleep(Duration::from_millis(1));
                        }
                        lat
                    })
                })
                .collect();
            let loaded_secs = sized(10.0, 1.0);
            let (ms_loaded, _) = per_sample(&agent, loaded_secs);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            let mut lat: Vec<f64> = threads
                .into_iter()
                .flat_map(|t| t.join().unwrap())
                .collect();
            lat.sort_by(f64::total_cmp);
            let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
            println!(
                "/metrics under {scrapers} concurrent keep-alive scrapers: {} scrapes in {loaded_secs} s, p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; agent CPU per sample meanwhile {ms_loaded:.2} ms, RSS {} KiB",
                lat.len(),
                pct(0.5),
                pct(0.99),
                lat[lat.len() - 1],
                rss_kib(agent.child.id())
            );
            figure(
                "agent.scrapes_per_s",
                lat.len() as f64 / loaded_secs,
                "scrapes/s",
            );
            figure("agent.scrape_p50", pct(0.5), "ms");
            figure("agent.scrape_p99", pct(0.99), "ms");
        }
        {
            let agent = start_agent(
                &world,
                "[agent]\ninterval = \"250ms\"\ndiscover_every = \"1ms\"\nfull_scan_every = \"1h\"\n",
            );
            std::thread::sleep(Duration::from_secs_f64(sized(2.0, 0.5)));
            let (ms, n) = per_sample(&agent, sized(10.0, 1.0));
            println!(
                "with a /proc listing in every sample: {ms:.2} ms CPU per sample ({n:.0} samples)"
            );
            figure("agent.cpu_listing", ms, "ms");
        }
    }
    // At tiny size the soak runs for 3 s, holders replaced every 0.5 s and RSS read each time:
    // too short for a slope, long enough to run every line of it.
    let soak = param("SOAK_SECS", 0, 3);
    let soak_names = [
        "agent.soak_rss_start",
        "agent.soak_rss_end",
        "agent.soak_rss_max",
        "agent.soak_rss_slope_steady_ci_low",
    ];
    if soak == 0 {
        for name in soak_names {
            skipped(name, "the soak is off (SOAK_SECS=3600 runs it)");
        }
    }
    if soak > 0 {
        let cycle = Duration::from_secs_f64(sized(5.0, 0.5));
        let report_every = Duration::from_secs_f64(sized(15.0, 0.5));
        // SOAK_CONFIG adds lines to the soak's [agent] table (e.g. shorter windows).
        let extra = std::env::var("SOAK_CONFIG").unwrap_or_default();
        let agent = start_agent(
            &world,
            &format!(
                "[agent]\ninterval = \"1s\"\n{}\n",
                extra.replace("\\n", "\n")
            ),
        );
        let t = Instant::now();
        let mut churn: Vec<Child> = Vec::new();
        let mut rss = Vec::new();
        // (minutes, KiB), for the slope.
        let mut points: Vec<(f64, f64)> = Vec::new();
        let mut heap_points: Vec<(f64, f64)> = Vec::new();
        // RSS in its anonymous and file-backed parts: the latter grows as code paths first
        // run, and is no leak.
        let mut anon_points: Vec<(f64, f64)> = Vec::new();
        let mut file_points: Vec<(f64, f64)> = Vec::new();
        let mut next_report = Instant::now();
        while t.elapsed() < Duration::from_secs(soak) {
            // Holders come and go: ten every five seconds. The driver forgets the ones that
            // went, as a real one does.
            let gone: Vec<u32> = churn.iter().map(|c| c.id()).collect();
            for mut c in churn.drain(..) {
                let _ = c.kill();
                let _ = c.wait();
            }
            world.update(|s| s.allocations.retain(|a| !gone.contains(&a.pid)));
            let fresh: Vec<Child> = (0..10).map(|_| spawn_sleeper(files)).collect();
            world.update(|s| {
                for c in &fresh {
                    s.allocations.push(allocation(0, c.id(), GIB / 8));
                }
            });
            churn = fresh;
            let (_, metrics) = get(agent.addr, "/metrics");
            if Instant::now() >= next_report {
                let r = rss_kib(agent.child.id());
                let (anon, file) = rss_parts_kib(agent.child.id());
                rss.push(r);
                let minute = t.elapsed().as_secs_f64() / 60.0;
                points.push((minute, r as f64));
                anon_points.push((minute, anon as f64));
                file_points.push((minute, file as f64));
                // The agent's own heap in use: flat while RSS rises is fragmentation, not a leak.
                let heap_kib = metrics
                    .lines()
                    .find_map(|l| l.strip_prefix("vramguard_agent_heap_in_use_bytes "))
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .map(|b| b / 1024.0);
                if let Some(h) = heap_kib {
                    heap_points.push((t.elapsed().as_secs_f64() / 60.0, h));
                }
                println!(
                    "soak {:>4}s: RSS {r} KiB (anon {anon}, file {file}), heap in use {} KiB",
                    t.elapsed().as_secs(),
                    heap_kib.map_or("?".into(), |h| format!("{h:.0}"))
                );
                next_report += report_every;
            }
            std::thread::sleep(cycle);
        }
        for mut c in churn {
            let _ = c.kill();
            let _ = c.wait();
        }
        let mut agent = agent;
        if !std::env::var("AGENT_WRAP").unwrap_or_default().is_empty() {
            agent.stop_wrapped();
        }
        let (min, max) = (rss.iter().min().unwrap(), rss.iter().max().unwrap());
        println!(
            "soak {soak}s: RSS from {} to {} KiB (min {min}, max {max})",
            rss[0],
            rss[rss.len() - 1]
        );
        figure("agent.soak_rss_start", mb(rss[0]), "MB");
        figure("agent.soak_rss_end", mb(rss[rss.len() - 1]), "MB");
        figure("agent.soak_rss_max", mb(*max), "MB");
        // Slopes with their 95% intervals: after the first minute (start-up allocations), and
        // in steady state, once the trend window (30 min by default) and the timeline have
        // filled (SOAK_SETTLE_SECS, by default half the run up to 30 min). A leak is a
        // steady-state slope whose interval stays above zero.
        let settle = env_or("SOAK_SETTLE_SECS", (soak / 2).min(1800)) as f64 / 60.0;
        for (series, what, from) in [
            ("RSS", "after the first minute", 1.0),
            ("RSS", "in steady state", settle),
            ("RSS anon", "in steady state", settle),
            ("RSS file", "in steady state", settle),
            ("heap in use", "after the first minute", 1.0),
            ("heap in use", "in steady state", settle),
        ] {
            let source = match series {
                "RSS" => &points,
                "RSS anon" => &anon_points,
                "RSS file" => &file_points,
                _ => &heap_points,
            };
            let part: Vec<(f64, f64)> =
                source.iter().copied().filter(|(m, _)| *m >= from).collect();
            let steady_rss = series == "RSS" && what == "in steady state";
            match vramguard_core::trend::theil_sen(&part) {
                Some(tr) if steady_rss => {
                    figure("agent.soak_rss_slope_steady_ci_low", tr.ci_low, "KiB/min");
                    print_slope(soak, series, what, from, &tr);
                }
                None if steady_rss => {
                    skipped(
                        "agent.soak_rss_slope_steady_ci_low",
                        "the soak is too short for a steady-state slope",
                    );
                    println!("soak {soak}s: too short for a {series} slope {what}");
                }
                Some(tr) => print_slope(soak, series, what, from, &tr),
                None => println!("soak {soak}s: too short for a {series} slope {what}"),
            }
        }
    }
}

/// One slope of the soak, with its 95% interval.
fn print_slope(soak: u64, series: &str, what: &str, from: f64, tr: &vramguard_core::trend::Trend) {
    println!(
        "soak {soak}s: {series} slope {what} (from minute {from:.0}): {:.1} KiB/min (95% interval {:.1} to {:.1}; {} points){}",
        tr.slope,
        tr.ci_low,
        tr.ci_high,
        tr.n,
        if tr.ci_low > 0.0 {
            ": rising"
        } else {
            ": the interval includes zero"
        }
    );
}
