//! A fleet on one machine, not in CI: `cargo bench -p vramguard --bench fleet`.
//!
//! Starts NODES agents (default 50), each on its own simulated 8-GPU node with HOLDERS
//! processes holding GPU memory (default 16, two per GPU), all scraped by one real Prometheus
//! every SCRAPE_SECS (default 5),
//! for MEASURE_SECS (default 60). Prints per node the scrape size and the series count, and
//! Prometheus' head series and samples ingested per second, then extrapolates to 10,000 nodes.
//!
//! `VRAMGUARD_BENCH_SIZE=tiny` (the suite) runs 2 agents scraped every second for 1 s (and
//! until Prometheus has scraped them twice); each node is the same as at full size, so its
//! scrape size and series are too. Each figure the README quotes is also printed as a `BENCH`
//! line (`scripts/bench.sh`).
//!
//! Every process it starts is killed by pid when it ends.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use vramguard_testkit::bench::{figure, param};
use vramguard_testkit::load::{spawn_agent, spawn_sleeper};
use vramguard_testkit::{Children, GIB, World, allocation};

const BIN: &str = env!("CARGO_BIN_EXE_vramguard");

fn get(addr: SocketAddr, path: &str) -> String {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return String::new();
    };
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n"
    );
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default()
}

fn prom_value(prom: SocketAddr, q: &str) -> Option<f64> {
    let enc: String = q
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    let body = get(prom, &format!("/api/v1/query?query={enc}"));
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["data"]["result"][0]["value"][1].as_str()?.parse().ok()
}

/// One agent on `world`, dying with the bench; its address once it serves.
fn start_agent(world: &World) -> (Child, SocketAddr) {
    let cfg = world.dir.path().join("fleet.toml");
    std::fs::write(&cfg, "[agent]\ninterval = \"1s\"\n").unwrap();
    spawn_agent(BIN, &[], world, &cfg)
}

fn main() {
    let nodes = param("NODES", 50usize, 2);
    let holders = param("HOLDERS", 16usize, 16);
    let scrape = param("SCRAPE_SECS", 5u64, 1);
    let measure = param("MEASURE_SECS", 60u64, 1);
    let mut worlds = Vec::new();
    let mut processes = Children(Vec::new());
    let mut agents: Vec<(Child, SocketAddr)> = Vec::new();
    for _ in 0..nodes {
        let world = World::new(8);
        let open = |p: std::path::PathBuf| std::fs::File::open(p).expect("open");
        for h in 0..holders {
            let gpu = (h % 8) as u32;
            let files = vec![
                open(world.dev("nvidiactl")),
                open(world.dev(&format!("nvidia{gpu}"))),
            ];
            let p = spawn_sleeper(&files);
            world.allocate(allocation(gpu, p.id(), 4 * GIB));
            processes.0.push(p);
        }
        agents.push(start_agent(&world));
        worlds.push(world);
    }
    let dir = tempfile::tempdir().unwrap();
    let targets: Vec<String> = agents.iter().map(|(_, a)| format!("'{a}'")).collect();
    std::fs::write(
        dir.path().join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: {scrape}s\nscrape_configs:\n  - job_name: vramguard\n    static_configs:\n      - targets: [{}]\n  - job_name: prometheus\n    static_configs:\n      - targets: ['PROM']\n",
            targets.join(", ")
        ),
    )
    .unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let prom: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let config = std::fs::read_to_string(dir.path().join("prometheus.yml"))
        .unwrap()
        .replace("PROM", &prom.to_string());
    std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
    let _prometheus = Children(vec![
        Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={prom}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus (Debian package prometheus)"),
    ]);
    let t = Instant::now();
    while get(prom, "/-/ready").is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "Prometheus never became ready"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    println!(
        "fleet: {nodes} agents (8 simulated GPUs and {holders} holders each), one Prometheus scraping every {scrape}s, measured over {measure}s"
    );
    std::thread::sleep(Duration::from_secs(measure));
    // Prometheus applies new targets a few seconds after it is ready, and a rate needs two
    // scrapes: a short run waits for both (a full one has them long before).
    let t = Instant::now();
    while prom_value(prom, "count({job=\"vramguard\"})").is_none()
        || prom_value(
            prom,
            "rate(prometheus_tsdb_head_samples_appended_total[30s])",
        )
        .is_none()
    {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "Prometheus scraped nothing in {measure} s and 60 s more"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // Per node: what one scrape carries.
    let sizes: Vec<usize> = agents
        .iter()
        .map(|(_, a)| get(*a, "/metrics").len())
        .collect();
    let series: Vec<usize> = agents
        .iter()
        .map(|(_, a)| {
            get(*a, "/metrics")
                .lines()
                .filter(|l| !l.starts_with('#') && !l.is_empty())
                .count()
        })
        .collect();
    let mean = |v: &[usize]| v.iter().sum::<usize>() as f64 / v.len().max(1) as f64;
    let (bytes, per_node) = (mean(&sizes), mean(&series));
    let head = prom_value(prom, "prometheus_tsdb_head_series").unwrap_or(f64::NAN);
    let ingest = prom_value(
        prom,
        "rate(prometheus_tsdb_head_samples_appended_total[30s])",
    )
    .unwrap_or(f64::NAN);
    let vram_series = prom_value(prom, "count({job=\"vramguard\"})").unwrap_or(f64::NAN);
    println!("per node: {bytes:.0} bytes per scrape (text format), {per_node:.0} samples");
    println!(
        "Prometheus: {vram_series:.0} vramguard series in the head ({head:.0} with its own), {ingest:.0} samples/s ingested"
    );
    let fleet = 10_000.0;
    println!(
        "10,000 nodes, extrapolated: {:.1} M series, {:.0} k samples/s and {:.1} MB/s of scrapes at a {scrape}s interval; {:.0} k samples/s at 15s, {:.0} k at 30s",
        per_node * fleet / 1e6,
        per_node * fleet / scrape as f64 / 1e3,
        bytes * fleet / scrape as f64 / 1e6,
        per_node * fleet / 15.0 / 1e3,
        per_node * fleet / 30.0 / 1e3,
    );
    figure("fleet.scrape_bytes", bytes / 1e3, "KB");
    figure("fleet.samples_per_node", per_node, "samples");
    figure(
        "fleet.series_per_node",
        vram_series / nodes as f64,
        "series",
    );
    figure("fleet.ingest", ingest, "samples/s");
    figure("fleet.series_10k", per_node * fleet / 1e6, "M");
    for (mut c, _) in agents {
        let _ = c.kill();
        let _ = c.wait();
    }
    drop(worlds);
}
