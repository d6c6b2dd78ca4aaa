//! `vramguard agent` end to end: the real binary on the simulated driver, real processes,
//! a real Prometheus, a real webhook receiver, headless Chromium.

mod common;
use common::*;
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A training job: a group leader (1 GiB, released after `lag_ms`) with two listed workers.
fn job(world: &World, lag_ms: u64) -> Holding {
    let mut s = spec(
        world,
        json!([{ "gpu": 0, "bytes": GIB, "after_exit": { "release_after_ms": lag_ms } }]),
    );
    s["group_leader"] = json!(true);
    let w = json!({ "argv": ["python3", "train.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000, "holds": [hold(0, 2)] } });
    s["workers"] = json!([w.clone(), w]);
    start(world, &["python3", "train.py"], s)
}

/// Waits until the agent sees the job's three processes on GPU 0, active.
fn wait_for_the_job(agent: &Agent) {
    wait_until(20, "the job to be seen", || {
        sample(
            &agent.metrics(),
            "vramguard_gpu_holders",
            &["gpu=\"0\"", "class=\"active\""],
        ) == Some(3.0)
    });
}

#[test]
fn a_ghost_left_by_a_kill_shows_within_a_second_and_the_release_lag_is_measured() {
    let world = World::new(2);
    // A 5 s interval: only the exit-driven resample can report the ghost within a second.
    let agent = Agent::start(
        &world,
        Path_::Nvml,
        "[agent]\ninterval = \"5s\"\nshow_cmdline = true\n",
    );
    let mut j = job(&world, 600);
    wait_for_the_job(&agent);
    j.crash();
    let t = Instant::now();
    wait_until(5, "ghost memory in the metrics", || {
        sample(
            &agent.metrics(),
            "vramguard_gpu_ghost_bytes",
            &["gpu=\"0\""],
        )
        .unwrap_or(0.0)
            > 0.0
    });
    let seen = t.elapsed();
    assert!(
        seen < Duration::from_secs(1),
        "ghost memory reported {seen:?} after the kill"
    );
    let m = agent.metrics();
    assert_eq!(
        sample(
            &m,
            "vramguard_gpu_holders",
            &["gpu=\"0\"", "class=\"orphan\""]
        ),
        Some(2.0),
        "{m}"
    );
    // The orphans' 4 GiB, plus the leader's 1 GiB while the driver still tears it down.
    let ghost = sample(&m, "vramguard_gpu_ghost_bytes", &["gpu=\"0\""]).unwrap();
    assert!(
        ghost == (4 * GIB) as f64 || ghost == (5 * GIB) as f64,
        "{ghost}"
    );
    // The leader's 1 GiB comes back 600 ms after its exit; the agent watched it.
    wait_until(5, "the release lag to be observed", || {
        sample(
            &agent.metrics(),
            "vramguard_release_lag_seconds_count",
            &["gpu=\"0\""],
        ) == Some(1.0)
    });
    let m = agent.metrics();
    let lag = sample(&m, "vramguard_release_lag_seconds_sum", &["gpu=\"0\""]).unwrap();
    wait_until(5, "the teardown to end", || {
        sample(
            &agent.metrics(),
            "vramguard_gpu_ghost_bytes",
            &["gpu=\"0\""],
        ) == Some((4 * GIB) as f64)
    });
    assert!((0.55..1.2).contains(&lag), "release lag {lag}");
    assert_eq!(
        sample(
            &m,
            "vramguard_release_lag_seconds_bucket",
            &["gpu=\"0\"", "le=\"1.0\""]
        ),
        Some(1.0)
    );
    // Bounded cardinality and the evidence of the page / JSON.
    assert!(m.contains("vramguard_holder_memory_bytes{") && m.contains("class=\"orphan\""));
    let status: Value = serde_json::from_str(&agent.get("/api/status").1).unwrap();
    assert_eq!(status["gpus"][0]["holders"][0]["class"], "orphan");
    let leader_cmd = status["gpus"][0]["holders"][0]["dead_job"]["leader_command"]
        .as_str()
        .unwrap_or("");
    assert!(
        leader_cmd.contains("train.py"),
        "the agent remembers the dead leader's command: {leader_cmd:?}"
    );
    drop(j);
}

#[test]
fn a_pid_the_driver_lists_after_its_exit_is_named_as_a_context_being_torn_down() {
    let world = World::new(1);
    let agent = Agent::start(&world, Path_::Nvml, "[agent]\ninterval = \"200ms\"\n");
    // The leader's 1 GiB takes 30 s to tear down: the driver lists its pid all that time.
    let mut j = job(&world, 30_000);
    let leader = j.pid;
    wait_for_the_job(&agent);
    j.crash();
    let mut last = Value::Null;
    wait_until(10, "the leader shown as a context being torn down", || {
        let status: Value = serde_json::from_str(&agent.get("/api/status").1).unwrap();
        let found = status["gpus"][0]["holders"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|h| h["pid"] == leader)
            .cloned();
        last = status;
        found.is_some_and(|h| {
            h["class"] == "exited"
                && h["evidence"][0].as_str().is_some_and(|e| {
                    e.contains(&format!("pid {leader} (python3) exited"))
                        && e.contains("the driver still lists it")
                })
        })
    });
    // No process keeps it (its workers have contexts of their own): not ghost memory, it
    // comes back on its own.
    let m = agent.metrics();
    let ghost = sample(&m, "vramguard_gpu_ghost_bytes", &["gpu=\"0\""]).unwrap();
    assert_eq!(ghost, (4 * GIB) as f64, "the orphans' only: {last:#}");
    drop(j);
}

#[test]
fn injected_faults_show_as_metrics_and_do_not_stop_the_agent() {
    let world = World::new(2);
    let h = world.holder(&["nvidia0"], 60);
    world.allocate(allocation(0, h.pid(), GIB));
    // First a transient Timeout on GPU 0's process list (two calls), alone: it must count
    // exactly two errors and leave GPU 0 up and read.
    world.update(|s| {
        s.gpus[0].faults.push(vramguard_sim::state::Fault {
            call: "nvmlDeviceGetComputeRunningProcesses_v3".into(),
            code: 10,
            after_calls: 3,
            times: Some(2),
            delay_ms: None,
        });
    });
    let agent = Agent::start(&world, Path_::Nvml, "[agent]\ninterval = \"200ms\"\n");
    let errors = |m: &str| {
        sample(
            m,
            "vramguard_collection_errors_total",
            &["kind=\"gpu_call\""],
        )
        .unwrap_or(0.0)
    };
    wait_until(10, "GPU 0's two timeouts to be counted", || {
        errors(&agent.metrics()) >= 2.0
    });
    let collections = |m: &str| {
        // Quiet samples make every driver call too (no /proc read).
        ["full", "new_processes", "holders", "cached", "quiet"]
            .iter()
            .filter_map(|k| {
                sample(
                    m,
                    "vramguard_collections_total",
                    &[&format!("kind=\"{k}\"")],
                )
            })
            .sum::<f64>()
    };
    let before = collections(&agent.metrics());
    wait_until(10, "more collections after the fault", || {
        collections(&agent.metrics()) >= before + 5.0
    });
    let m = agent.metrics();
    assert_eq!(errors(&m), 2.0, "exactly the two injected timeouts: {m}");
    assert_eq!(sample(&m, "vramguard_up", &["gpu=\"0\""]), Some(1.0));
    assert_eq!(sample(&m, "vramguard_up", &["gpu=\"1\""]), Some(1.0));
    assert_eq!(
        sample(
            &m,
            "vramguard_gpu_holders",
            &["gpu=\"0\"", "class=\"active\""]
        ),
        Some(1.0),
        "GPU 0's holder is listed again after the timeouts: {m}"
    );
    // Then GPU 1 is lost for good: it is reported down, GPU 0 is still read.
    world.update(|s| {
        s.gpus[1]
            .faults
            .push(fault("nvmlDeviceGetMemoryInfo_v2", 15, None));
    });
    wait_until(10, "GPU 1 to be reported down", || {
        sample(&agent.metrics(), "vramguard_up", &["gpu=\"1\""]) == Some(0.0)
    });
    let m = agent.metrics();
    assert_eq!(sample(&m, "vramguard_up", &["gpu=\"0\""]), Some(1.0));
    assert!(errors(&m) > 2.0, "GPU 1's failures are counted: {m}");
    assert_eq!(
        sample(&m, "vramguard_gpu_memory_used_bytes", &["gpu=\"0\""]),
        Some(GIB as f64),
        "GPU 0 still read"
    );
    assert_eq!(agent.get("/healthz").0, 200);
}

/// Issue 26: a whole-driver fault (the device count failing, as when the kernel module is
/// in trouble) must not outlive its cause in a running agent. The simulator used to check
/// the fault before re-reading its state, so a cleared fault never cleared and recovery was
/// never tested. Both library paths: NVML through the simulator's library, and in-process.
/// A driver that stalls instead is covered too: every GPU reported down after the call
/// timeout, then read again once the driver answers.
#[test]
fn the_agent_recovers_after_a_whole_driver_fault() {
    for path in [Path_::Nvml, Path_::InProcess] {
        let world = World::new(1);
        let h = world.holder(&["nvidia0"], 120);
        world.allocate(allocation(0, h.pid(), GIB));
        // A quiet sample of a calm node makes no driver-wide call: a fault of
        // nvmlDeviceGetCount is met by the next full sample, which recheck_every bounds (30 s
        // by default while calm, more than this test waits).
        let agent = Agent::start(
            &world,
            path,
            "[agent]\ninterval = \"100ms\"\nrecheck_every = \"1s\"\n[driver]\ncall_timeout = \"1s\"\n",
        );
        let up = |m: &str| sample(m, "vramguard_up", &["gpu=\"0\""]);
        let source_errors = |m: &str| {
            sample(m, "vramguard_collection_errors_total", &["kind=\"source\""]).unwrap_or(0.0)
        };
        wait_until(20, "GPU 0 up", || up(&agent.metrics()) == Some(1.0));
        for (code, delay_ms) in [(999, None), (0, Some(4_000))] {
            world.update(|s| {
                s.faults
                    .push(fault("nvmlDeviceGetCount_v2", code, delay_ms))
            });
            let before = source_errors(&agent.metrics());
            wait_until(20, "the driver fault to be seen", || {
                let m = agent.metrics();
                up(&m) == Some(0.0) && source_errors(&m) > before
            });
            world.update(|s| s.faults.clear());
            // A holder that starts after the fault cleared: seen only if the agent reads the
            // driver again.
            let late = world.holder(&["nvidia0"], 120);
            world.allocate(allocation(0, late.pid(), GIB));
            wait_until(40, "the agent to read the driver again", || {
                let m = agent.metrics();
                up(&m) == Some(1.0)
                    && sample(&m, "vramguard_gpu_memory_used_bytes", &["gpu=\"0\""])
                        .is_some_and(|b| b >= (2 * GIB) as f64)
            });
            assert_eq!(agent.get("/healthz").0, 200);
            world.update(|s| s.allocations.retain(|a| a.pid != late.pid()));
            drop(late);
        }
    }
}

/// Issue 25: a real SXM H200 answers `nvmlDeviceGetFanSpeed` with Invalid Argument, and the
/// agent counted it as 52 `gpu_call` collection errors in 24 s of a healthy GPU. A missing
/// reading is an absent value: no error counted, no warning in `status --json`.
#[test]
fn a_fanless_h200_costs_no_collection_error_and_no_warning() {
    let world = World::new(1);
    let h = world.holder(&["nvidia0"], 60);
    world.allocate(allocation(0, h.pid(), GIB));
    for path in [Path_::Nvml, Path_::InProcess] {
        let report = Vg::new(&world, path).args(["status", "--json"]).json(0);
        let gpu = &report["gpus"][0];
        assert_eq!(gpu["telemetry"]["fan_percent"], Value::Null, "{gpu:#}");
        assert_eq!(gpu["warnings"], json!([]), "{gpu:#}");
    }
    let agent = Agent::start(&world, Path_::Nvml, "[agent]\ninterval = \"100ms\"\n");
    let collections = |m: &str| {
        // Quiet samples make every driver call too (no /proc read).
        ["full", "new_processes", "holders", "cached", "quiet"]
            .iter()
            .filter_map(|k| {
                sample(
                    m,
                    "vramguard_collections_total",
                    &[&format!("kind=\"{k}\"")],
                )
            })
            .sum::<f64>()
    };
    wait_until(20, "20 collections", || {
        collections(&agent.metrics()) >= 20.0
    });
    let m = agent.metrics();
    assert_eq!(
        sample(
            &m,
            "vramguard_collection_errors_total",
            &["kind=\"gpu_call\""]
        )
        .unwrap_or(0.0),
        0.0,
        "{m}"
    );
    assert_eq!(sample(&m, "vramguard_up", &["gpu=\"0\""]), Some(1.0), "{m}");
}

#[test]
fn memory_health_and_xid_events_become_metrics_and_an_alert() {
    let world = World::new(2);
    let exec_log = world.dir.path().join("health.log");
    let config = format!(
        "[agent]\ninterval = \"200ms\"\n\n[[alerts.rule]]\nname = \"health\"\nwhen = \"memory_health\"\n\n[[alerts.exec]]\nargv = [\"sh\", \"-c\", \"echo $VRAMGUARD_ALERT_STATUS $VRAMGUARD_ALERT_RULE $VRAMGUARD_ALERT_GPU >> {}\"]\n",
        exec_log.display()
    );
    // Through nvml-wrapper's event sets and the simulated library.
    let agent = Agent::start(&world, Path_::Nvml, &config);
    let m = agent.metrics();
    assert_eq!(
        sample(&m, "vramguard_gpu_row_remap_pending", &["gpu=\"0\""]),
        Some(0.0),
        "{m}"
    );
    assert_eq!(sample(&m, "vramguard_gpu_xid_events_total", &[]), None);
    world.update(|s| {
        s.gpus[1].health.xid_events.push(79);
        s.gpus[0].health.remapped_rows = Some(vramguard_sim::state::SimRemappedRows {
            correctable: 4,
            pending: true,
            ..Default::default()
        });
    });
    let xid79 = ["gpu=\"1\"", "xid=\"79\""];
    wait_until(10, "the Xid and the pending remap in the metrics", || {
        let m = agent.metrics();
        sample(&m, "vramguard_gpu_xid_events_total", &xid79) == Some(1.0)
            && sample(&m, "vramguard_gpu_row_remap_pending", &["gpu=\"0\""]) == Some(1.0)
    });
    let m = agent.metrics();
    assert_eq!(
        sample(
            &m,
            "vramguard_gpu_remapped_rows",
            &["gpu=\"0\"", "cause=\"correctable\""]
        ),
        Some(4.0)
    );
    assert_eq!(
        sample(&m, "vramguard_gpu_retired_pages_pending", &[]),
        None,
        "an H200 does not retire pages: no series"
    );
    world.update(|s| s.gpus[1].health.xid_events.push(79));
    wait_until(10, "the second Xid", || {
        sample(&agent.metrics(), "vramguard_gpu_xid_events_total", &xid79) == Some(2.0)
    });
    wait_until(10, "the health alert", || {
        std::fs::read_to_string(&exec_log).is_ok_and(|t| t == "firing health 0\n")
    });
    // A reset applies the remap: the incident resolves, the counters stay.
    vramguard_sim::Sim::open(world.state_path())
        .unwrap()
        .reset(0)
        .unwrap();
    wait_until(10, "the health alert to resolve", || {
        std::fs::read_to_string(&exec_log)
            .is_ok_and(|t| t == "firing health 0\nresolved health 0\n")
    });
    let m = agent.metrics();
    assert_eq!(
        sample(&m, "vramguard_gpu_row_remap_pending", &["gpu=\"0\""]),
        Some(0.0)
    );
    assert_eq!(
        sample(&m, "vramguard_gpu_xid_events_total", &xid79),
        Some(2.0)
    );
    let status = agent.get("/api/status").1;
    assert!(status.contains("\"xid\":79"), "{status}");
}

/// A webhook receiver: records every POST body.
fn receiver() -> (SocketAddr, Arc<Mutex<Vec<Value>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let g2 = got.clone();
    std::thread::spawn(move || {
        for mut s in l.incoming().map_while(Result::ok) {
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut len = 0usize;
            loop {
                let mut line = String::new();
                if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; len];
            let _ = r.read_exact(&mut body);
            if let Ok(v) = serde_json::from_slice(&body) {
                g2.lock().unwrap().push(v);
            }
            let _ =
                s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    (addr, got)
}

#[test]
fn sinks_see_exactly_one_firing_and_one_resolved_per_incident() {
    let world = World::new(1);
    let (addr, got) = receiver();
    let exec_log = world.dir.path().join("exec.log");
    let config = format!(
        "[agent]\ninterval = \"200ms\"\n\n[[alerts.rule]]\nname = \"ghost\"\nwhen = \"ghost_bytes\"\nabove = \"1GiB\"\nfor = \"400ms\"\n\n[[alerts.webhook]]\nurl = \"http://{addr}/hook\"\n\n[[alerts.exec]]\nargv = [\"sh\", \"-c\", \"echo $VRAMGUARD_ALERT_STATUS $VRAMGUARD_ALERT_RULE $VRAMGUARD_ALERT_GPU >> {}\"]\n",
        exec_log.display()
    );
    let agent = Agent::start(&world, Path_::InProcess, &config);
    let mut j = job(&world, 0);
    j.crash();
    wait_until(10, "the firing notification", || {
        !got.lock().unwrap().is_empty()
    });
    let first = got.lock().unwrap()[0].clone();
    assert_eq!(first["status"], "firing");
    assert_eq!(first["rule"], "ghost");
    assert_eq!(first["gpu"], 0);
    assert_eq!(first["value"], json!((4 * GIB) as f64));
    assert!(
        first["summary"]
            .as_str()
            .unwrap()
            .contains("4.0 GiB of ghost memory")
    );
    assert!(
        sample(
            &agent.metrics(),
            "vramguard_alert_firing",
            &["rule=\"ghost\""]
        ) == Some(1.0)
    );
    // While the incident lasts the rule is evaluated again at every collection: 8 more
    // (1.6 s at 200 ms; counted, so a loaded machine stretches the window) send nothing more,
    // to either sink.
    wait_until(5, "the exec sink's firing line", || {
        std::fs::read_to_string(&exec_log).is_ok_and(|t| t.lines().count() == 1)
    });
    agent.wait_collections(8);
    assert_eq!(got.lock().unwrap().len(), 1, "fires once per incident");
    assert_eq!(
        std::fs::read_to_string(&exec_log).unwrap(),
        "firing ghost 0\n",
        "fires once per incident"
    );
    // End the incident: the workers go.
    drop(j);
    wait_until(10, "the resolved notification", || {
        got.lock().unwrap().len() >= 2
    });
    // Resolved once: 5 more collections of a quiet GPU send nothing more.
    agent.wait_collections(5);
    let all = got.lock().unwrap().clone();
    let statuses: Vec<&str> = all.iter().map(|v| v["status"].as_str().unwrap()).collect();
    assert_eq!(statuses, vec!["firing", "resolved"]);
    assert_eq!(all[1]["started_at"], all[0]["started_at"]);
    wait_until(5, "the exec sink", || {
        std::fs::read_to_string(&exec_log).is_ok_and(|t| t.lines().count() == 2)
    });
    assert_eq!(
        std::fs::read_to_string(&exec_log).unwrap(),
        "firing ghost 0\nresolved ghost 0\n"
    );
}

#[test]
fn sighup_reloads_the_config_and_keeps_it_when_the_new_one_is_bad() {
    let world = World::new(1);
    let rule =
        |name: &str| format!("[[alerts.rule]]\nname = \"{name}\"\nwhen = \"orphan_holders\"\n");
    let agent = Agent::start(
        &world,
        Path_::InProcess,
        &format!("[agent]\ninterval = \"200ms\"\n{}", rule("old")),
    );
    let cfg = world
        .dir
        .path()
        .join(format!("agent-{}.toml", std::process::id()));
    let hup = |pid: u32| {
        assert!(
            Command::new("kill")
                .args(["-HUP", &pid.to_string()])
                .status()
                .unwrap()
                .success()
        );
    };
    let firing = |rule: &str| {
        sample(
            &agent.metrics(),
            "vramguard_alert_firing",
            &[&format!("rule=\"{rule}\"")],
        )
    };
    // A config whose rules are fine but whose interval is not: nothing of it may apply.
    std::fs::write(
        &cfg,
        format!("[agent]\ninterval = \"forever\"\n{}", rule("partial")),
    )
    .unwrap();
    hup(agent.child.pid());
    wait_until(5, "the reload failure to be logged", || {
        agent.log_text().contains("config reload failed")
    });
    assert!(
        agent.log_text().contains("agent.interval"),
        "{}",
        agent.log_text()
    );
    assert_eq!(agent.get("/healthz").0, 200);
    // Still the old config: its rule fires on an incident, the new one does not exist.
    let mut j = job(&world, 0);
    j.crash();
    wait_until(5, "the old rule to fire", || firing("old") == Some(1.0));
    assert_eq!(firing("partial"), None, "{}", agent.metrics());
    // A good config replaces the old one whole.
    std::fs::write(
        &cfg,
        format!("[agent]\ninterval = \"200ms\"\n{}", rule("new")),
    )
    .unwrap();
    hup(agent.child.pid());
    wait_until(5, "the reload", || {
        agent.log_text().contains("config reloaded")
    });
    wait_until(5, "the new rule to fire", || firing("new") == Some(1.0));
    assert_eq!(firing("old"), None, "{}", agent.metrics());
    drop(j);
}

#[test]
fn sigterm_stops_it_gracefully() {
    let world = World::new(1);
    let mut agent = Agent::start(&world, Path_::InProcess, "[agent]\ninterval = \"200ms\"\n");
    assert!(
        Command::new("kill")
            .args(["-TERM", &agent.child.pid().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let t = Instant::now();
    let status = agent.child.0.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(agent.log_text().contains("vramguard agent stopping"));
}

#[test]
fn automatic_reclaim_terminates_orphans_after_min_age() {
    let world = World::new(1);
    let audit = world.dir.path().join("audit.jsonl");
    let config = format!(
        "[agent]\ninterval = \"200ms\"\n[reclaim]\nauto = true\nmin_age = \"1s\"\ngrace = \"2s\"\naudit_log = \"{}\"\n",
        audit.display()
    );
    let agent = Agent::start(&world, Path_::InProcess, &config);
    let mut j = job(&world, 0);
    j.crash();
    let t = Instant::now();
    wait_until(15, "the orphans to be reclaimed", || {
        j.workers.iter().all(|w| !alive(*w))
    });
    assert!(
        t.elapsed() >= Duration::from_millis(900),
        "min_age respected: {:?}",
        t.elapsed()
    );
    wait_until(5, "the counters", || {
        sample(
            &agent.metrics(),
            "vramguard_reclaim_actions_total",
            &["action=\"term\""],
        ) == Some(2.0)
    });
    let m = agent.metrics();
    assert_eq!(
        sample(&m, "vramguard_reclaimed_bytes_total", &["gpu=\"0\""]),
        Some((4 * GIB) as f64),
        "{m}"
    );
    let events: Vec<String> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["event"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(events.first().map(String::as_str), Some("start"));
    assert_eq!(events.last().map(String::as_str), Some("result"));
}

/// Red-team finding: the agent's own automatic reclaim resets from a thread of its own while
/// the agent's main loop holds NVML (as driver 580's NVML holds the GPU's files), which the
/// driver refuses. The reset lock pauses the main loop, the reclaim's reset waits for this
/// process to let go of the device files, and the residue left beside the orphans is reset.
#[test]
fn the_agents_own_automatic_reset_is_not_refused_by_the_agent() {
    let world = residue_world_580();
    let audit = world.dir.path().join("audit.jsonl");
    let config = format!(
        "[agent]\ninterval = \"200ms\"\n[reclaim]\nauto = true\nmin_age = \"1s\"\ngrace = \"2s\"\nreset = \"auto\"\naudit_log = \"{}\"\n",
        audit.display()
    );
    let agent = Agent::start(&world, Path_::Nvml, &config);
    let mut j = job(&world, 0);
    j.crash();
    let events = || -> Vec<Value> {
        std::fs::read_to_string(&audit)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["event"].as_str().is_some_and(|e| e.starts_with("reset")))
            .collect()
    };
    wait_until(30, "the automatic reclaim to reset the GPU", || {
        !events().is_empty() && events().iter().any(|e| e["event"] != "reset")
    });
    let done = events();
    assert!(
        done.iter().any(|e| e["event"] == "reset_done"
            && e["result"]
                .as_str()
                .unwrap_or("")
                .contains("back to baseline")),
        "{done:#?}\n{}",
        agent.log_text()
    );
    wait_until(10, "the agent to see the GPU empty", || {
        sample(
            &agent.metrics(),
            "vramguard_gpu_memory_used_bytes",
            &["gpu=\"0\""],
        ) == Some(0.0)
    });
}

/// Red-team finding: a reload kept the time a holder had been counted reclaimable under the
/// old rules, so a holder could be reclaimed moments after a stricter policy took effect.
#[test]
fn a_reload_that_changes_the_rules_counts_min_age_again() {
    let world = World::new(1);
    let audit = world.dir.path().join("audit.jsonl");
    let config = |cpu: &str| {
        format!(
            "[policy]\nwork_cpu_percent = {cpu}\n[agent]\ninterval = \"200ms\"\n[reclaim]\nauto = true\nmin_age = \"8s\"\ngrace = \"2s\"\naudit_log = \"{}\"\n",
            audit.display()
        )
    };
    let agent = Agent::start(&world, Path_::InProcess, &config("5.0"));
    let cfg = world
        .dir
        .path()
        .join(format!("agent-{}.toml", std::process::id()));
    let mut j = job(&world, 0);
    j.crash();
    // Watched as an orphan from about 2 s on: the old count ends near 10 s.
    std::thread::sleep(Duration::from_secs(7));
    assert!(
        j.workers.iter().all(|w| alive(*w)),
        "reclaimed before min_age"
    );
    std::fs::write(&cfg, config("4.0")).unwrap();
    assert!(
        Command::new("kill")
            .args(["-HUP", &agent.child.pid().to_string()])
            .status()
            .unwrap()
            .success()
    );
    wait_until(5, "the reload", || {
        agent.log_text().contains("config reloaded")
    });
    let reloaded = Instant::now();
    assert!(
        agent.log_text().contains("min_age is counted again"),
        "{}",
        agent.log_text()
    );
    wait_until(25, "the orphans to be reclaimed", || {
        j.workers.iter().all(|w| !alive(*w))
    });
    // Counted from the reload: 8 s at least, where the old count would have ended 3 s in.
    assert!(
        reloaded.elapsed() >= Duration::from_secs(8),
        "reclaimed {:?} after the reload",
        reloaded.elapsed()
    );
}

/// Issue 30: SIGTERM to the agent (a `systemctl stop`, an upgrade) during an automatic
/// reclaim's grace period ended the process with the reclaim thread in it: targets that ignore
/// SIGTERM stayed alive and the audit log ended at a `signal` record. The agent now finishes
/// the decision (SIGKILL at the end of the grace period) and logs the result before it exits.
#[test]
fn sigterm_during_an_automatic_reclaim_finishes_it_before_the_agent_exits() {
    let world = World::new(1);
    let audit = world.dir.path().join("audit.jsonl");
    let config = format!(
        "[agent]\ninterval = \"200ms\"\n[reclaim]\nauto = true\nmin_age = \"1s\"\ngrace = \"4s\"\naudit_log = \"{}\"\n",
        audit.display()
    );
    let mut agent = Agent::start(&world, Path_::InProcess, &config);
    let mut s = spec(&world, json!([hold(0, 1)]));
    s["group_leader"] = json!(true);
    s["workers"] = json!([{ "argv": ["python3", "train.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000, "ignore_term": true,
        "holds": [hold(0, 2)] } }]);
    let mut j = start(&world, &["python3", "train.py"], s);
    j.crash();
    let orphan = j.workers[0];
    wait_until(20, "the orphan's SIGTERM", || {
        std::fs::read_to_string(&audit).is_ok_and(|t| t.contains("\"signal\":\"TERM\""))
    });
    assert!(
        Command::new("kill")
            .args(["-TERM", &agent.child.pid().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = agent.child.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "{}", agent.log_text());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
    assert!(
        agent
            .log_text()
            .contains("an automatic reclaim is running: finishing it before stopping"),
        "{}",
        agent.log_text()
    );
    wait_until(10, "the SIGKILLed orphan to be gone", || !alive(orphan));
    let records: Vec<Value> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let last = records.last().unwrap();
    assert_eq!(last["event"], "result", "{records:#?}");
    assert_eq!(last["interrupted"], json!(true));
    let exit = records
        .iter()
        .find(|r| r["event"] == "exited" && r["pid"] == orphan)
        .unwrap();
    assert_eq!(exit["signal"], "KILL");
    assert!(exit["after_ms"].as_u64().unwrap() >= 4000, "{exit}");
}

fn chromium() -> PathBuf {
    for c in [
        "/usr/bin/chromium",
        "/usr/bin/chromium-browser",
        "/usr/bin/google-chrome",
    ] {
        if Path::new(c).exists() {
            return c.into();
        }
    }
    panic!("no Chromium: install it (Debian package chromium; scripts/test.sh does)");
}

#[test]
fn the_status_page_renders_in_headless_chromium() {
    let world = World::new(2);
    let agent = Agent::start(&world, Path_::InProcess, "[agent]\ninterval = \"200ms\"\n");
    let mut j = job(&world, 0);
    j.crash();
    // On GPU 1, an orphan whose command name is markup and a terminal escape.
    let mut leader = spec(&world, json!([hold(1, 1)]));
    leader["group_leader"] = json!(true);
    leader["workers"] = json!([{ "argv": ["python3"], "spec": { "state": world.state_path(),
        "lifetime_ms": 120_000, "comm": "<script>\u{1b}]52", "holds": [hold(1, 1)] } }]);
    let mut hostile = start(&world, &["python3", "x.py"], leader);
    hostile.crash();
    wait_until(5, "the orphans", || {
        sample(
            &agent.metrics(),
            "vramguard_gpu_holders",
            &["class=\"orphan\"", "gpu=\"0\""],
        ) == Some(2.0)
    });
    // The page the browser is about to load shows them (served from the same collection).
    wait_until(10, "the page to show the orphans", || {
        let page = agent.get("/").1;
        page.matches("class=\"holder orphan\"").count() == 3 && page.contains("&lt;script&gt;")
    });
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(format!("http://{}/", agent.addr))
        .output()
        .unwrap();
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        dom.contains("<section class=\"gpu\" id=\"gpu-0\">"),
        "{dom}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(dom.contains("id=\"gpu-1\""));
    assert_eq!(dom.matches("class=\"holder orphan\"").count(), 3, "{dom}");
    // The hostile name is text in the page: no script element, no raw escape.
    assert!(!dom.contains("<script>"), "{dom}");
    assert!(!dom.contains('\u{1b}'), "{dom}");
    assert!(dom.contains("&lt;script&gt;\\e]52"), "{dom}");
    assert!(dom.contains("<svg class=\"timeline\""), "a memory timeline");
    assert!(dom.contains("GiB ghost"));
    assert!(
        !dom.contains("http://") || dom.matches("href=\"http").count() == 0,
        "no external assets"
    );
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn deploy(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(path)
}

#[test]
fn promtool_checks_and_unit_tests_the_rules() {
    let promtool = which("promtool");
    let out = Command::new(&promtool)
        .args(["check", "rules"])
        .arg(deploy("prometheus/vramguard-rules.yml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = Command::new(&promtool)
        .args(["test", "rules", "vramguard-rules.test.yml"])
        .current_dir(deploy("prometheus"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The driver refuses a reset while any other process holds the GPU, and the agent, an NVML
/// client, holds it for as long as it runs (driver 580's NVML: the control, unified-memory
/// and GPU files, modelled by `nvml_client_files`). A `reclaim --reset` writes the reset lock:
/// the agent lets go of the driver, the reset goes through, the lock is removed, and the
/// agent samples (and holds the GPU) again. Without the pause, the reset is refused with the
/// agent named as what holds the GPU.
#[test]
fn a_reset_pauses_the_agent_which_lets_go_of_the_driver_and_samples_again() {
    let world = residue_world_580();
    // A long interval, and no watch of device opens (which wakes the agent too): the lock is
    // seen because a new file in its directory wakes the agent (inotify), not because a
    // sample happens to come within the resetter's 10 s wait.
    let agent = Agent::start(
        &world,
        Path_::Nvml,
        "[agent]\ninterval = \"30s\"\nwatch_opens = false\n",
    );
    let agent_pid = agent.child.0.id();
    let used = |agent: &Agent| {
        sample(
            &agent.metrics(),
            "vramguard_gpu_memory_used_bytes",
            &["gpu=\"0\""],
        )
    };
    wait_until(10, "the agent to see the residue", || {
        used(&agent) == Some((6 * GIB) as f64)
    });
    assert!(
        open_files(agent_pid, &world.dev_dir()) >= 3,
        "the agent holds the device files, as a real NVML client does"
    );
    let out = Vg::new(&world, Path_::Nvml)
        .args(["reclaim", "--yes", "--reset=auto", "--json"])
        .json(0);
    let r = &out["resets"][0];
    assert_eq!(r["attempted"], json!(true), "{r:#}\n{}", agent.log_text());
    assert!(
        r["result"].as_str().unwrap().contains("back to baseline"),
        "{r:#}"
    );
    // The resetter's own lock file (`<state>.reset.lock.<pid>`) is removed after the reset.
    let locks: Vec<_> = std::fs::read_dir(world.dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("state.json.reset.lock"))
        .collect();
    assert!(locks.is_empty(), "left behind: {locks:?}");
    wait_until(10, "the agent to sample again after the reset", || {
        used(&agent) == Some(0.0)
            && sample(&agent.metrics(), "vramguard_agent_paused_for_reset", &[]) == Some(0.0)
    });
    let log = agent.log_text();
    assert!(log.contains("a GPU reset is under way"), "{log}");
    assert!(log.contains("the reset ended"), "{log}");
    wait_until(10, "the agent to hold the driver again", || {
        open_files(agent_pid, &world.dev_dir()) >= 3
    });
}

/// The agent lists the reset lock's directory only when its watch sees a new file there (and
/// while paused), not at every turn of its loop. If the directory is removed, the kernel ends
/// the watch: the agent then looks at the lock by itself every 250 ms, so a lock written in
/// the directory made again still pauses it (before, nothing woke a 30 s loop for it).
#[test]
fn a_reset_lock_directory_removed_and_made_again_is_still_looked_at() {
    let world = World::new(1);
    let locks = world.dir.path().join("locks");
    std::fs::create_dir(&locks).unwrap();
    let lock = locks.join("reset.lock");
    let agent = Agent::start(
        &world,
        Path_::InProcess,
        &format!(
            "[agent]\ninterval = \"30s\"\nwatch_opens = false\n[reclaim]\nreset_lock = \"{}\"\n",
            lock.display()
        ),
    );
    let paused = |agent: &Agent| sample(&agent.metrics(), "vramguard_agent_paused_for_reset", &[]);
    wait_until(10, "the agent's first sample", || {
        paused(&agent) == Some(0.0)
    });
    std::fs::remove_dir(&locks).unwrap();
    wait_until(10, "the agent to see its watch end", || {
        agent
            .log_text()
            .contains("the watch of the reset lock's directory")
    });
    std::fs::create_dir(&locks).unwrap();
    // This test's own lock, as a resetter writes it: its pid and start time, root's, 0644.
    let me = std::process::id();
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let start_ticks: u64 = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .nth(19)
        .unwrap()
        .parse()
        .unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let mine = locks.join(format!("reset.lock.{me}"));
    std::fs::write(
        &mine,
        format!("{{\"pid\":{me},\"start_ticks\":{start_ticks},\"gpu\":0,\"since_ms\":{now_ms}}}"),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o644)).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while paused(&agent) != Some(1.0) {
        assert!(Instant::now() < until, "not paused: {}", agent.log_text());
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::remove_file(&mine).unwrap();
    wait_until(5, "the pause to end", || paused(&agent) == Some(0.0));
}

#[test]
fn metrics_are_openmetrics_for_prometheus_and_plain_text_that_promtool_accepts_otherwise() {
    let world = World::new(1);
    let h = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    world.allocate(allocation(0, h.pid(), GIB));
    // A Slurm heal's steps in the audit log the agent follows: its metrics are checked too.
    let audit = world.dir.path().join("audit.jsonl");
    let heal_record = |event: &str| {
        format!("{{\"ts_ms\":1796219394123,\"event\":\"{event}\",\"node\":\"gpu07\"}}\n")
    };
    std::fs::write(&audit, heal_record("heal_waiting")).unwrap();
    let agent = Agent::start(
        &world,
        Path_::Nvml,
        &format!(
            "[agent]\ninterval = \"200ms\"\n\n[reclaim]\naudit_log = \"{}\"\n",
            audit.display()
        ),
    );
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(&audit)
        .unwrap();
    log.write_all(heal_record("heal_failed").as_bytes())
        .unwrap();
    wait_until(10, "the heal's failure in the metrics", || {
        sample(
            &agent.metrics(),
            "vramguard_slurm_heal_failed",
            &["node=\"gpu07\""],
        ) == Some(1.0)
    });
    // What Prometheus asks for.
    let (code, head, body) = http_get_accepting(
        agent.addr,
        "/metrics",
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    );
    assert_eq!(code, 200);
    assert!(
        head.contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert!(
        body.contains("# TYPE vramguard_collections counter"),
        "{body}"
    );
    // curl, promtool, a textfile collector: Prometheus' text format, which promtool passes
    // without a word.
    let (code, head, body) = http_get_accepting(agent.addr, "/metrics", "*/*");
    assert_eq!(code, 200);
    assert!(
        head.contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(
        body.contains("# TYPE vramguard_collections_total counter"),
        "{body}"
    );
    assert!(!body.contains("# EOF"));
    let mut check = Command::new(which("promtool"))
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success() && said.is_empty(), "promtool: {said}");
    for line in [
        "vramguard_slurm_heal_steps_total{step=\"failed\"} 1",
        "vramguard_slurm_heal_last_step{node=\"gpu07\",step=\"failed\"} 1",
        "vramguard_slurm_heal_last_step{node=\"gpu07\",step=\"waiting\"} 0",
        "vramguard_slurm_heal_last_step_timestamp_seconds{node=\"gpu07\"} 1796219394.123",
    ] {
        assert!(body.contains(line), "{line} in:\n{body}");
    }
    assert!(
        !body.contains("step=\"waiting\"} 1"),
        "a step already in the log at start is the state, not counted again"
    );
    // The agent's own heap, to tell a leak from fragmentation next to its RSS.
    let heap = sample(&body, "vramguard_agent_heap_in_use_bytes", &[]).unwrap();
    assert!(heap > 100_000.0, "{heap}");
}

fn which(tool: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/local/bin", "/bin"] {
        let p = Path::new(dir).join(tool);
        if p.exists() {
            return p;
        }
    }
    panic!("no {tool}: install the Debian package of that name (scripts/test.sh does)");
}

fn prom_query(addr: SocketAddr, q: &str) -> Value {
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
    let (_, body) = http_get(addr, &format!("/api/v1/query?query={enc}"));
    serde_json::from_str(&body).unwrap_or(Value::Null)
}

/// A real Prometheus on `dir/prometheus.yml`, ready; killed on drop.
fn prometheus(dir: &Path) -> (Reaped, SocketAddr) {
    let port = free_port();
    let prom_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let prom = daemon(
        "prometheus",
        &[
            format!("--config.file={}", dir.join("prometheus.yml").display()),
            format!("--storage.tsdb.path={}", dir.join("data").display()),
            format!("--web.listen-address={prom_addr}"),
        ],
        prom_addr,
    );
    (prom, prom_addr)
}

/// A Prometheus-family server (`tool` from Debian's packages) with `args`, once `/-/ready`
/// at `addr` answers; killed on drop.
fn daemon(tool: &str, args: &[String], addr: SocketAddr) -> Reaped {
    let server = Reaped(
        Command::new(which(tool))
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until(30, &format!("{tool} to be ready"), || {
        http_get(addr, "/-/ready").0 == 200
    });
    server
}

/// A real Prometheus in `dir` scraping the agent at `agent` every second, with the shipped
/// rules as [`rules_for_test`] shortens them; returned after its first scrape.
fn scraping_prometheus(dir: &Path, agent: SocketAddr) -> (Reaped, SocketAddr) {
    std::fs::write(dir.join("rules.yml"), rules_for_test()).unwrap();
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [rules.yml]\nscrape_configs:\n  - job_name: vramguard\n    static_configs:\n      - targets: ['{agent}']\n"
        ),
    )
    .unwrap();
    let (prom, addr) = prometheus(dir);
    wait_until(20, "the first scrape", || {
        prom_query(addr, "up{job=\"vramguard\"}")["data"]["result"][0]["value"][1] == "1"
    });
    (prom, addr)
}

#[test]
fn a_real_prometheus_scrapes_the_agent_and_the_shipped_rules_fire() {
    let world = World::new(1);
    let agent = Agent::start(&world, Path_::Nvml, "[agent]\ninterval = \"250ms\"\n");
    let dir = tempfile::tempdir().unwrap();
    let (_prom, prom_addr) = scraping_prometheus(dir.path(), agent.addr);
    let mut j = job(&world, 0);
    j.crash();
    let t = Instant::now();
    wait_until(10, "ghost memory in Prometheus", || {
        prom_query(prom_addr, "vramguard_gpu_ghost_bytes{gpu=\"0\"} > 0")["data"]["result"]
            .as_array()
            .is_some_and(|r| !r.is_empty())
    });
    let seen = t.elapsed();
    assert!(
        seen <= Duration::from_millis(2500),
        "ghost memory reached Prometheus after {seen:?} (scrape interval 1s)"
    );
    for alert in ["VramguardGhostMemory", "VramguardOrphanHolders"] {
        wait_until(15, &format!("{alert} to fire"), || {
            prom_query(
                prom_addr,
                &format!("ALERTS{{alertname=\"{alert}\",alertstate=\"firing\"}}"),
            )["data"]["result"]
                .as_array()
                .is_some_and(|r| !r.is_empty())
        });
    }
    // Every query of the Grafana dashboard is valid PromQL against these metrics.
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(deploy("grafana/vramguard-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut n = 0;
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap().replace("$instance", ".*");
            let r = prom_query(prom_addr, &expr);
            assert_eq!(
                r["status"], "success",
                "panel {:?}: {expr}: {r}",
                p["title"]
            );
            n += 1;
        }
    }
    assert!(n >= 15, "{n} dashboard queries checked");
    drop(j);
}

/// The whole response to a GET, headers included.
fn get_raw(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf
}

#[test]
fn beyond_top_holders_the_rest_is_summed_per_class_under_pid_other() {
    let world = World::new(1);
    // Five live jobs of 5, 4, 3, 2 and 1 GiB, and the orphaned 1 GiB worker of a crashed one.
    let live: Vec<Reaped> = (1..=5)
        .map(|gib| {
            let h = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 600);
            world.allocate(allocation(0, h.pid(), gib * GIB));
            h
        })
        .collect();
    let crashed = crashed_trainer(&world);
    let agent = Agent::start(
        &world,
        Path_::InProcess,
        "[agent]\ninterval = \"200ms\"\ntop_holders = 2\n",
    );
    let series = |m: &str| -> Vec<String> {
        m.lines()
            .filter(|l| l.starts_with("vramguard_holder_memory_bytes{"))
            .map(String::from)
            .collect()
    };
    wait_until(10, "the orphan in the metrics", || {
        sample(
            &agent.metrics(),
            "vramguard_holder_memory_bytes",
            &["pid=\"other\"", "class=\"orphan\""],
        )
        .is_some()
    });
    let m = agent.metrics();
    let lines = series(&m);
    assert_eq!(
        lines.len(),
        4,
        "two holders, then one 'other' per class: {lines:#?}"
    );
    let of = |pid: u32| {
        sample(
            &m,
            "vramguard_holder_memory_bytes",
            &[&format!("pid=\"{pid}\"")],
        )
    };
    assert_eq!(of(live[4].pid()), Some((5 * GIB) as f64));
    assert_eq!(of(live[3].pid()), Some((4 * GIB) as f64));
    assert_eq!(
        of(live[2].pid()),
        None,
        "beyond top_holders: no series of its own"
    );
    assert_eq!(
        sample(
            &m,
            "vramguard_holder_memory_bytes",
            &["pid=\"other\"", "class=\"active\""]
        ),
        Some((6 * GIB) as f64),
        "3 + 2 + 1 GiB of live jobs: {lines:#?}"
    );
    assert_eq!(
        sample(
            &m,
            "vramguard_holder_memory_bytes",
            &["pid=\"other\"", "class=\"orphan\""]
        ),
        Some(GIB as f64),
        "{lines:#?}"
    );
    drop(crashed);
    drop(live);
}

#[test]
fn command_lines_stay_off_the_http_side_and_a_failing_driver_shows_as_down() {
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 2)]));
    s["new_session"] = json!(true);
    let h = start(&world, &["python3", "serve.py", "--token=s3cret"], s);
    let agent = Agent::start(&world, Path_::InProcess, "[agent]\ninterval = \"200ms\"\n");
    wait_until(20, "the holder to be seen", || {
        agent
            .get("/api/status")
            .1
            .contains(&format!("\"pid\": {}", h.pid))
            || agent
                .get("/api/status")
                .1
                .contains(&format!("\"pid\":{}", h.pid))
    });
    // Command names only, by default: a command line can carry secrets.
    for path in ["/", "/api/status", "/metrics"] {
        let body = agent.get(path).1;
        assert!(
            !body.contains("s3cret"),
            "{path} shows a command line:\n{body}"
        );
    }
    let page = get_raw(agent.addr, "/");
    let csp = page
        .lines()
        .find(|l| {
            l.to_ascii_lowercase()
                .starts_with("content-security-policy:")
        })
        .unwrap_or_else(|| panic!("no CSP header:\n{page}"));
    assert!(csp.contains("default-src 'none'"), "{csp}");
    // Every response carrying other users' names is never sniffed as HTML.
    for path in ["/", "/api/status", "/metrics"] {
        let raw = get_raw(agent.addr, path);
        assert!(
            raw.lines()
                .any(|l| l.eq_ignore_ascii_case("x-content-type-options: nosniff")),
            "{path}:\n{}",
            raw.lines().take(12).collect::<Vec<_>>().join("\n")
        );
    }

    // The driver fails (its state is unreadable): every GPU is down, the data marked stale.
    wait_until(10, "the GPU to be up", || {
        sample(&agent.metrics(), "vramguard_up", &["gpu=\"0\""]) == Some(1.0)
    });
    std::fs::write(world.state_path(), "{ not json").unwrap();
    wait_until(10, "the GPU to be reported down", || {
        let m = agent.metrics();
        sample(&m, "vramguard_up", &["gpu=\"0\""]) == Some(0.0)
            && sample(&m, "vramguard_last_sample_age_seconds", &[]).is_some_and(|a| a > 0.0)
    });
}

#[test]
fn at_the_connection_cap_a_scrape_closes_a_silent_connection_and_is_served() {
    let world = World::new(1);
    let agent = Agent::start(&world, Path_::InProcess, "[agent]\ninterval = \"200ms\"\n");
    // A keep-alive client that has sent a request: it is serving, and must not be closed.
    let mut scraper = std::net::TcpStream::connect(agent.addr).unwrap();
    scraper
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let request = |s: &mut std::net::TcpStream| {
        write!(s, "GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n").unwrap();
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).to_string()
    };
    assert!(request(&mut scraper).starts_with("HTTP/1.1 200"));
    // Every other slot taken by connections that say nothing (within the header timeout):
    // 142 of them, with the scraper 143 for 128 slots, so the agent closes the 15 oldest
    // silent ones as it accepts the last ones. Once the 15th is seen closed, all are accepted
    // and the agent is at the cap; the scrape then makes it close a 16th, which it logs
    // (it logs the 1st, 2nd, 4th, 8th, 16th...): the cap path is taken, for sure, by the scrape.
    let silent: Vec<std::net::TcpStream> = (0..142)
        .map(|_| std::net::TcpStream::connect(agent.addr).unwrap())
        .collect();
    wait_until(10, "the agent to accept every connection", || {
        closed_by_peer(&silent[14])
    });
    assert!(
        !closed_by_peer(&silent[15]),
        "the 16th silent connection was closed before the scrape: the oldest were cut by the \
         header timeout, not closed to make room"
    );
    let t = Instant::now();
    let mut s = std::net::TcpStream::connect(agent.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    assert!(
        text.starts_with("HTTP/1.1 200"),
        "a scrape at the cap was refused: {text:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    // The oldest silent connection left was the one closed; the serving one was kept. The
    // evicted connection's task is aborted on another worker thread: its close may reach us
    // just after the scrape's answer, so it is waited for (well inside the header timeout
    // that would otherwise close it).
    wait_until(
        1,
        "the oldest silent connection to be closed to make room",
        || closed_by_peer(&silent[15]),
    );
    assert!(
        request(&mut scraper).starts_with("HTTP/1.1 200"),
        "the scraper kept its slot"
    );
    wait_until(10, "the agent to log the 16th connection it closed", || {
        agent
            .log_text()
            .contains("16 HTTP connection(s) closed to make room")
    });
}

#[test]
fn a_flood_of_idle_connections_starves_neither_collection_nor_scrapes() {
    let world = World::new(1);
    let mut s = spec(&world, json!([hold(0, 2)]));
    s["new_session"] = json!(true);
    let _h = start(&world, &["python3", "serve.py"], s);
    // The default soft limit a unit without LimitNOFILE gets.
    let agent = Agent::start_with_nofile(
        &world,
        Path_::InProcess,
        "[agent]\ninterval = \"200ms\"\n",
        Some(1024),
    );
    // The test itself needs more descriptors than the agent has.
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = lim.rlim_max.min(8192);
        libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
    }
    assert!(
        lim.rlim_cur >= 2048,
        "the test needs 2048 descriptors: {lim:?}"
    );
    let before = collections(&agent.metrics());
    // 1,100 idle connections from another user's point of view: connect, send nothing.
    let idle: Vec<std::net::TcpStream> = (0..1100)
        .filter_map(|_| {
            std::net::TcpStream::connect_timeout(&agent.addr, Duration::from_secs(1)).ok()
        })
        .collect();
    assert!(idle.len() > 1000, "{} connections", idle.len());
    // Meanwhile (slow headers cut after the header timeout, the rest evicted or refused at
    // the cap) the agent keeps collecting: 6 more collections while the flood is on.
    wait_until(30, "collections to go on during the flood", || {
        collections(&agent.metrics()) > before + 5.0
    });
    let t = Instant::now();
    let (code, m) = agent.get("/metrics");
    assert_eq!(code, 200);
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "/metrics took {:?}",
        t.elapsed()
    );
    assert!(
        collections(&m) > before + 5.0,
        "collections went on: {before} → {}",
        collections(&m)
    );
    assert!(
        !agent.log_text().contains("Too many open files")
            || sample(&m, "vramguard_collection_errors_total", &[]).unwrap_or(0.0) == 0.0,
        "{}",
        agent.log_text()
    );
    assert_eq!(sample(&m, "vramguard_up", &["gpu=\"0\""]), Some(1.0));
    drop(idle);
}

/// Issue #26: one local user holding every connection slot (idle sockets, slowloris heads,
/// and more keep-alive connections sending requests back to back than there are slots) made
/// 20 of 20 scrapes by another client fail.
#[test]
fn a_local_user_holding_every_slot_cannot_lock_a_scraper_out() {
    let world = World::new(1);
    let agent = Agent::start(&world, Path_::InProcess, "[agent]\ninterval = \"200ms\"\n");
    let hostile = lockout::Hostile::start(
        agent.addr,
        &lockout::Mix {
            idle: 40,
            slowloris: 20,
            busy: 160,
            busy_auth: None,
            busy_path: "/healthz".into(),
        },
    );
    wait_until(20, "the hostile user to hold every slot", || {
        hostile.held.load(std::sync::atomic::Ordering::Relaxed) >= 128
    });
    std::thread::sleep(Duration::from_secs(1));
    let tally = lockout::honest(
        agent.addr,
        1,
        20,
        Duration::from_millis(100),
        "/metrics",
        None,
    );
    assert_eq!(tally.failed, 0, "{tally:?}");
    // Meanwhile the busy connections were served too: the slots turn over, nothing starves.
    assert!(hostile.answers[3].load(std::sync::atomic::Ordering::Relaxed) > 0);
    drop(hostile);
    // Only busy connections, every one of them admitted: the least recent makes room.
    let hostile = lockout::Hostile::start(
        agent.addr,
        &lockout::Mix {
            idle: 0,
            slowloris: 0,
            busy: 160,
            busy_auth: None,
            busy_path: "/healthz".into(),
        },
    );
    wait_until(20, "the hostile user to hold every slot", || {
        hostile.held.load(std::sync::atomic::Ordering::Relaxed) >= 128
    });
    std::thread::sleep(Duration::from_secs(1));
    let t = Instant::now();
    let tally = lockout::honest(
        agent.addr,
        1,
        20,
        Duration::from_millis(100),
        "/metrics",
        None,
    );
    assert_eq!(tally.failed, 0, "only busy connections: {tally:?}");
    // Served at once, not after waiting for a connection to end (2 s of the 100 ms gaps).
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "20 scrapes took {:?}",
        t.elapsed()
    );
    drop(hostile);
    assert_eq!(agent.get("/healthz").0, 200);
}

fn basic(credentials: &str) -> String {
    use base64::Engine;
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(credentials)
    )
}

/// Issue #26: `--web.config.file` (node_exporter's name) sets the web config; wrong passwords
/// against a cost-10 bcrypt hash cost a few verifications per address, not one each, and
/// neither they nor idle and slowloris connections lock out a scraper that has the password.
#[test]
fn wrong_passwords_cost_bounded_bcrypt_and_lock_no_scraper_out() {
    let world = World::new(1);
    let dir = world.dir.path();
    let t = Instant::now();
    let hash = bcrypt::hash("s3cret", 10).unwrap();
    let one_verify = t.elapsed();
    std::fs::write(
        dir.join("web.yml"),
        format!("basic_auth_users:\n  prometheus: {hash}\n"),
    )
    .unwrap();
    let agent = Agent::start_with_args(
        &world,
        "[agent]\ninterval = \"200ms\"\n",
        &[
            "--web.config.file".as_ref(),
            dir.join("web.yml").as_os_str(),
        ],
    );
    let good = basic("prometheus:s3cret");
    let scrape =
        |auth: Option<&str>| lockout::scrape(agent.addr, "/metrics", auth, Duration::from_secs(10));
    assert_eq!(
        scrape(None),
        lockout::Scrape::Status(401),
        "the flag's config is used"
    );
    wait_until(30, "a scrape with the password", || {
        scrape(Some(&good)) == lockout::Scrape::Ok
    });
    // A burst of 40 wrong guesses, one after another.
    let pid = agent.child.0.id();
    let cpu = vramguard_testkit::load::cpu_ns(pid);
    let answers: Vec<lockout::Scrape> = (0..40)
        .map(|i| scrape(Some(&basic(&format!("prometheus:guess{i}")))))
        .collect();
    let spent = Duration::from_nanos(vramguard_testkit::load::cpu_ns(pid) - cpu);
    let limited = answers
        .iter()
        .filter(|a| **a == lockout::Scrape::Status(429))
        .count();
    assert!(limited >= 30, "{answers:?}");
    assert!(
        spent < one_verify * 12,
        "40 wrong guesses cost {spent:?} of CPU; one verification costs {one_verify:?}"
    );
    // The password still passes, with no verification: it was remembered.
    assert_eq!(scrape(Some(&good)), lockout::Scrape::Ok);
    let hostile = lockout::Hostile::start(
        agent.addr,
        &lockout::Mix {
            idle: 60,
            slowloris: 30,
            busy: 100,
            busy_auth: Some(basic("prometheus:wrong")),
            busy_path: "/metrics".into(),
        },
    );
    wait_until(20, "the hostile user to hold every slot", || {
        hostile.held.load(std::sync::atomic::Ordering::Relaxed) >= 128
    });
    std::thread::sleep(Duration::from_secs(1));
    let tally = lockout::honest(
        agent.addr,
        1,
        20,
        Duration::from_millis(100),
        "/metrics",
        Some(&good),
    );
    assert_eq!(tally.failed, 0, "{tally:?}");
    assert!(
        hostile.answers[1].load(std::sync::atomic::Ordering::Relaxed) > 0,
        "the wrong passwords were answered 429"
    );
}

#[test]
fn behind_tls_and_a_password_a_real_prometheus_still_scrapes() {
    let world = World::new(1);
    let dir = world.dir.path();
    // A self-signed certificate for 127.0.0.1, and a bcrypt-hashed password.
    let ok = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=vramguard",
        ])
        .args(["-addext", "subjectAltName=IP:127.0.0.1"])
        .arg("-keyout")
        .arg(dir.join("key.pem"))
        .arg("-out")
        .arg(dir.join("cert.pem"))
        .stderr(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "openssl made no certificate");
    let hash = bcrypt::hash("s3cret", 4).unwrap();
    std::fs::write(
        dir.join("web.yml"),
        format!("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\nbasic_auth_users:\n  prometheus: {hash}\n"),
    )
    .unwrap();
    let agent = Agent::start(
        &world,
        Path_::InProcess,
        &format!(
            "[agent]\ninterval = \"250ms\"\nweb_config = \"{}\"\n",
            dir.join("web.yml").display()
        ),
    );
    let curl = |args: &[&str]| -> String {
        let out = Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--max-time",
                "5",
            ])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let url = format!("https://{}/metrics", agent.addr);
    let ca = dir.join("cert.pem");
    let ca = ca.to_str().unwrap();
    wait_until(20, "the agent to answer over TLS", || {
        curl(&["--cacert", ca, "-u", "prometheus:s3cret", &url]) == "200"
    });
    assert_eq!(curl(&["--cacert", ca, &url]), "401", "no password");
    assert_eq!(
        curl(&["--cacert", ca, "-u", "prometheus:wrong", &url]),
        "401"
    );
    assert_eq!(agent.get("/metrics").0, 0, "plain HTTP gets no answer");

    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: vramguard\n    scheme: https\n    tls_config:\n      ca_file: {ca}\n    basic_auth:\n      username: prometheus\n      password: s3cret\n    static_configs:\n      - targets: ['{}']\n",
            agent.addr
        ),
    )
    .unwrap();
    let (_prom, prom_addr) = prometheus(dir);
    wait_until(20, "a scrape over TLS with the password", || {
        prom_query(prom_addr, "vramguard_up{gpu=\"0\"}")["data"]["result"][0]["value"][1] == "1"
    });
}

/// The state of `alert` in Prometheus: "pending", "firing", or None when it is not active.
fn alert_state(prom: SocketAddr, alert: &str) -> Option<String> {
    let r = prom_query(prom, &format!("ALERTS{{alertname=\"{alert}\"}}"));
    let states: Vec<String> = r["data"]["result"]
        .as_array()?
        .iter()
        .filter_map(|s| s["metric"]["alertstate"].as_str().map(String::from))
        .collect();
    if states.iter().any(|s| s == "firing") {
        Some("firing".into())
    } else {
        states.into_iter().next()
    }
}

/// A webhook receiver: every POSTed body, parsed.
fn webhook_receiver() -> (SocketAddr, Arc<Mutex<Vec<Value>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let sink = got.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream);
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                if line == "\r\n" {
                    break;
                }
            }
            let mut body = vec![0u8; length.min(1 << 20)];
            if reader.read_exact(&mut body).is_ok()
                && let Ok(v) = serde_json::from_slice::<Value>(&body)
            {
                sink.lock().unwrap().push(v);
            }
            let _ = reader
                .get_mut()
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        }
    });
    (addr, got)
}

/// A real Alertmanager (Debian's prometheus-alertmanager) sending every alert, firing and
/// resolved, to `webhook` within a second or two.
fn alertmanager(dir: &Path, webhook: SocketAddr) -> (Reaped, SocketAddr) {
    let config = dir.join("alertmanager.yml");
    std::fs::write(
        &config,
        format!(
            "route:\n  receiver: test\n  group_by: ['alertname', 'instance', 'gpu', 'slurm_job', 'pod']\n  group_wait: 1s\n  group_interval: 1s\n  repeat_interval: 1h\nreceivers:\n  - name: test\n    webhook_configs:\n      - url: http://{webhook}/hook\n        send_resolved: true\n"
        ),
    )
    .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let am = daemon(
        "prometheus-alertmanager",
        &[
            format!("--config.file={}", config.display()),
            format!("--storage.path={}", dir.join("am-data").display()),
            format!("--web.listen-address={addr}"),
            "--cluster.listen-address=".into(),
        ],
        addr,
    );
    (am, addr)
}

/// Ghost memory charged to its owner reaches a real Alertmanager's receiver through a real
/// Prometheus: an orphan of a Slurm job (a real process in a `job_N/step_M` cgroup whose step
/// daemon is gone) with `slurm_job`, and a zombie in a kubelet-shaped pod cgroup with the
/// `namespace` and `pod` a fake kubelet's pod-resources API names; both with the node, GPU
/// and user. After `vramguard reclaim`, the resolved notifications follow.
#[test]
fn ghost_memory_reaches_alertmanager_with_its_slurm_job_or_pod_and_resolves_after_reclaim() {
    let world = World::new(2);
    let mut cg = TestCgroup::new();
    let orphan = start(
        &world,
        &["python3", "train.py"],
        spec(&world, json!([hold(0, 2)])),
    );
    cg.enter(
        "system.slice/slurmstepd.scope/job_4242/step_0/user/task_0",
        orphan.pid,
    );
    // A process of a pod whose main thread exited while a thread stuck in D (uninterruptible
    // I/O) still holds GPU 1: a zombie no signal frees. It starts inside the pod's container
    // cgroup (a shell joins it, then execs the holder). (A main thread gone while an idle
    // thread lives on is a live process in a live pod, not a zombie.)
    let pod_uid = "6a1b2c3d-0000-4a4a-9b9b-00000000cafe";
    let procs = cg.leaf(&format!(
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{}.scope",
        pod_uid.replace('-', "_"),
        "ef".repeat(32)
    ));
    let mut zspec = spec(&world, json!([hold(1, 3)]));
    zspec["shape"] = json!("zombie_leader_stuck_in_d");
    let joined = format!("echo $$ > {} && exec \"$@\"", procs.display());
    let zombie = start_wrapped(
        &world,
        &["sh", "-c", &joined, "sh"],
        &["python3", "infer.py"],
        zspec,
    );
    wait_until(10, "the pod's leader to become a zombie", || {
        state_of(zombie.pid) == Some('Z')
    });
    let gpu1 = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0)["gpus"][1]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kubelet.sock");
    let _kubelet = vramguard_kubelet::fake::FakeKubelet::start(
        &socket,
        vec![kube_pod("team-a", "trainer-0", "trainer", &gpu1)],
    );
    let agent = Agent::start(
        &world,
        Path_::Nvml,
        &format!(
            "[agent]\ninterval = \"250ms\"\n[kubernetes]\npod_resources_socket = \"{}\"\n",
            socket.display()
        ),
    );
    let (webhook, received) = webhook_receiver();
    let (_am, am) = alertmanager(dir.path(), webhook);
    std::fs::write(dir.path().join("rules.yml"), rules_for_test()).unwrap();
    std::fs::write(
        dir.path().join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [rules.yml]\nalerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['{am}']\nscrape_configs:\n  - job_name: vramguard\n    static_configs:\n      - targets: ['{}']\n",
            agent.addr
        ),
    )
    .unwrap();
    let (_prom, _prom_addr) = prometheus(dir.path());
    let notification = |status: &str, key: &str| {
        received.lock().unwrap().iter().find_map(|n| {
            n["alerts"].as_array()?.iter().find_map(|a| {
                (a["status"] == status
                    && a["labels"]["alertname"] == "VramguardOrphanHolders"
                    && a["labels"].get(key).is_some())
                .then(|| a["labels"].clone())
            })
        })
    };
    wait_until(60, "the firing alerts at the receiver", || {
        notification("firing", "slurm_job").is_some() && notification("firing", "pod").is_some()
    });
    let slurm = notification("firing", "slurm_job").unwrap();
    assert_eq!(slurm["slurm_job"], "4242", "{slurm}");
    assert_eq!(slurm["user"], "root", "{slurm}");
    assert_eq!(slurm["gpu"], "0", "{slurm}");
    assert_eq!(slurm["class"], "orphan", "{slurm}");
    assert_eq!(slurm["instance"], agent.addr.to_string(), "{slurm}");
    let pod = notification("firing", "pod").unwrap();
    assert_eq!(pod["namespace"], "team-a", "{pod}");
    assert_eq!(pod["pod"], "trainer-0", "{pod}");
    assert_eq!(pod["gpu"], "1", "{pod}");
    assert_eq!(pod["class"], "zombie", "{pod}");
    assert_eq!(pod["instance"], agent.addr.to_string(), "{pod}");

    let plan = Vg::new(&world, Path_::Nvml)
        .args([
            "reclaim",
            "--yes",
            "--json",
            "--grace",
            "2s",
            "--include",
            "orphan,hidden,zombie",
        ])
        .arg_path("--audit-log", &dir.path().join("audit.jsonl"))
        // Exit 1: the stuck zombie's memory remains, and the run says so.
        .json(1);
    assert!(
        plan["remaining"].to_string().contains("uninterruptible"),
        "{plan}"
    );
    let targets: std::collections::BTreeSet<u64> = plan["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(targets, [u64::from(orphan.pid)].into(), "{plan}");
    // The stuck zombie is the owner's to end (here, its I/O ends and it exits: the test kills
    // the process it started).
    // SAFETY: kill(2) on the holder this test started.
    unsafe { libc::kill(zombie.pid as i32, libc::SIGKILL) };
    wait_until(60, "the resolved notifications at the receiver", || {
        notification("resolved", "slurm_job").is_some() && notification("resolved", "pod").is_some()
    });
}

/// A pod's GPU allocation as a kubelet lists it.
fn kube_pod(
    namespace: &str,
    name: &str,
    container: &str,
    gpu_uuid: &str,
) -> vramguard_kubelet::PodResources {
    vramguard_kubelet::PodResources {
        name: name.into(),
        namespace: namespace.into(),
        containers: vec![vramguard_kubelet::ContainerResources {
            name: container.into(),
            devices: vec![vramguard_kubelet::ContainerDevices {
                resource_name: "nvidia.com/gpu".into(),
                device_ids: vec![gpu_uuid.into()],
            }],
        }],
    }
}

/// Holders in kubelet-shaped pod cgroups (systemd and cgroupfs drivers) are named by the pod
/// the kubelet's pod-resources API allocated their GPU to: in `status`, and as `namespace` and
/// `pod` on the agent's holder series. A kubelet that does not answer costs at most the
/// configured timeout, leaves one limitation line and the pods by UID.
#[test]
fn pods_are_named_from_a_fake_kubelets_pod_resources_and_a_slow_kubelet_only_costs_its_timeout() {
    let world = World::new(2);
    let uuid = |gpu: usize| {
        let s = Vg::new(&world, Path_::Nvml)
            .args(["status", "--json"])
            .json(0);
        s["gpus"][gpu]["uuid"].as_str().unwrap().to_string()
    };
    let (gpu0, gpu1) = (uuid(0), uuid(1));
    let mut cg = TestCgroup::new();
    let systemd_uid = "5f0c1d2e-0000-4a4a-9b9b-000000000001";
    let cgroupfs_uid = "5f0c1d2e-0000-4a4a-9b9b-000000000002";
    let a = start(
        &world,
        &["python3", "train.py"],
        spec(&world, json!([hold(0, 2)])),
    );
    cg.enter(
        &format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{}.scope",
            systemd_uid.replace('-', "_"),
            "ab".repeat(32)
        ),
        a.pid,
    );
    let b = start(
        &world,
        &["python3", "serve.py"],
        spec(&world, json!([hold(1, 1)])),
    );
    cg.enter(
        &format!("kubepods/besteffort/pod{cgroupfs_uid}/{}", "cd".repeat(32)),
        b.pid,
    );
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kubelet.sock");
    let kubelet = vramguard_kubelet::fake::FakeKubelet::start(
        &socket,
        vec![
            kube_pod("team-a", "trainer-0", "trainer", &gpu0),
            kube_pod("team-b", "vllm-7d9f", "server", &format!("{gpu1}::3")),
        ],
    );
    let cfg = config(
        &world,
        &format!(
            "[kubernetes]\npod_resources_socket = \"{}\"\ntimeout = \"300ms\"\n",
            socket.display()
        ),
    );
    let status = status_with_config(&world, &cfg);
    assert_eq!(
        holder(&status, 0, a.pid)["pod"],
        json!({"namespace": "team-a", "name": "trainer-0", "container": "trainer"})
    );
    assert_eq!(holder(&status, 0, a.pid)["pod_uid"], systemd_uid);
    assert_eq!(holder(&status, 1, b.pid)["pod"]["name"], "vllm-7d9f");
    let text = stdout(
        &Vg::new(&world, Path_::Nvml)
            .arg_path("--config", &cfg)
            .args(["status"])
            .code(0),
    );
    assert!(text.contains("team-a/trainer-0"), "{text}");

    let agent = Agent::start(
        &world,
        Path_::Nvml,
        &format!(
            "[agent]\ninterval = \"250ms\"\n{}",
            std::fs::read_to_string(&cfg).unwrap()
        ),
    );
    wait_until(10, "the pod's names on its holder series", || {
        sample(
            &agent.metrics(),
            "vramguard_holder_memory_bytes",
            &[
                "namespace=\"team-a\"",
                "pod=\"trainer-0\"",
                "container=\"trainer\"",
                &format!("pid=\"{}\"", a.pid),
            ],
        )
        .is_some()
    });

    // A kubelet that hangs: the collection waits at most the timeout, says so once, and
    // shows the pod by its UID.
    kubelet.slow_down(Duration::from_secs(2));
    let t = Instant::now();
    let status = status_with_config(&world, &cfg);
    assert!(
        t.elapsed() < Duration::from_secs(4),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(holder(&status, 0, a.pid)["pod"], Value::Null);
    let limits: Vec<&str> = status["limitations"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l.as_str())
        .filter(|l| l.contains("pod names unavailable"))
        .collect();
    assert_eq!(limits.len(), 1, "{limits:?}");
    assert!(limits[0].contains("no answer within 300ms"), "{limits:?}");
    drop(kubelet);
    // No kubelet at all (not a Kubernetes node): no error, no limitation.
    let status = status_with_config(&world, &cfg);
    assert!(
        !status["limitations"].to_string().contains("pod names"),
        "{}",
        status["limitations"]
    );
}

/// A stand-in for dcgm-exporter: serves `text` on every request.
fn static_exporter(text: String) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 2 {
                line.clear();
            }
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                text.len()
            );
        }
    });
    addr
}

/// With `dcgm_labels`, vramguard's series join dcgm-exporter's on `UUID` and `Hostname` in a
/// real Prometheus, though the two come from different targets (different `instance`).
#[test]
fn with_dcgm_labels_ghost_memory_joins_dcgm_exporters_series() {
    let world = World::new(1);
    let agent = Agent::start(
        &world,
        Path_::Nvml,
        "[agent]\ninterval = \"250ms\"\ndcgm_labels = true\n",
    );
    let m = agent.metrics();
    let line = m
        .lines()
        .find(|l| l.starts_with("vramguard_gpu_ghost_bytes{"))
        .unwrap_or_else(|| panic!("{m}"));
    let uuid = line
        .split("uuid=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap();
    let host = line
        .split("Hostname=\"")
        .nth(1)
        .unwrap_or_else(|| panic!("no Hostname: {line}"))
        .split('"')
        .next()
        .unwrap()
        .to_string();
    assert!(line.contains(&format!("UUID=\"{uuid}\"")), "{line}");
    assert!(line.contains("modelName=\"NVIDIA H200\""), "{line}");
    let dcgm = static_exporter(format!(
        "# TYPE DCGM_FI_DEV_FB_USED gauge\nDCGM_FI_DEV_FB_USED{{gpu=\"0\",UUID=\"{uuid}\",device=\"nvidia0\",modelName=\"NVIDIA H200\",Hostname=\"{host}\"}} 3072\n"
    ));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: vramguard\n    static_configs:\n      - targets: ['{}']\n  - job_name: dcgm\n    static_configs:\n      - targets: ['{dcgm}']\n",
            agent.addr
        ),
    )
    .unwrap();
    let (_prom, prom) = prometheus(dir.path());
    // The README's join: DCGM's framebuffer use next to vramguard's ghost memory, per GPU.
    let q = "DCGM_FI_DEV_FB_USED * 0 + on (UUID, Hostname) group_left vramguard_gpu_ghost_bytes";
    wait_until(30, "the join to return the GPU", || {
        prom_query(prom, q)["data"]["result"]
            .as_array()
            .is_some_and(|r| r.len() == 1 && r[0]["metric"]["UUID"] == uuid)
    });
}

/// Orphaned shared memory reaches a real Prometheus and the shipped rule fires; removing the
/// segment resolves it. The agent runs as PID 1 of its own PID namespace, where every process's
/// maps are readable (a segment is never called orphaned while one process cannot be checked).
#[test]
fn orphaned_shared_memory_fires_its_alert_and_resolves_when_removed() {
    let world = World::new(1);
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let cfg = config(
        &world,
        &format!(
            "[agent]\ninterval = \"250ms\"\nfull_scan_every = \"1s\"\n[shm]\ndirs = [\"{}\"]\nmin_age = \"1s\"\n",
            shm.display()
        ),
    );
    let mut cmd = vg_wrapped("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc", "--kill-child", BIN])
        .arg("--sim")
        .arg(world.state_path())
        .arg("--config")
        .arg(&cfg)
        .args(["agent", "--listen", "127.0.0.1:0"])
        .env_remove("VRAMGUARD_SIM")
        .env("NO_COLOR", "1");
    let agent = Agent::spawn(cmd, true);
    let (_prom, prom) = scraping_prometheus(dir.path(), agent.addr);
    let segment = shm.join("nccl-dead-rank-3");
    std::fs::write(&segment, vec![1u8; 1 << 20]).unwrap();
    let mut tested = Vec::new();
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardOrphanedSharedMemory",
        || {
            wait_until(20, "the orphaned segment in the metrics", || {
                sample(&agent.metrics(), "vramguard_host_shm_orphan_bytes", &[])
                    .is_some_and(|b| b >= (1 << 20) as f64)
            })
        },
        || std::fs::remove_file(&segment).unwrap(),
    );
    let m = agent.metrics();
    assert_eq!(
        sample(&m, "vramguard_host_shm_orphan_segments", &[]),
        Some(0.0),
        "{m}"
    );
    assert!(sample(&m, "vramguard_host_memory_available_bytes", &[]).unwrap() > 0.0);
}

/// Makes `alert` fire with `cause`, then resolve with `cure`; records that it was tested.
fn fires_and_resolves(
    prom: SocketAddr,
    tested: &mut Vec<String>,
    alert: &str,
    cause: impl FnOnce(),
    cure: impl FnOnce(),
) {
    // Quiet before its cause (a step in used memory from an earlier case looks like a leak
    // for a while in a 20-second trend window).
    let quiet = (0..400).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        alert_state(prom, alert).is_none()
    });
    assert!(
        quiet,
        "{alert} is not quiet before its cause: {}\n{}\n{}",
        prom_query(prom, &format!("ALERTS{{alertname=\"{alert}\"}}")),
        prom_query(prom, "vramguard_gpu_leak_slope_lower_bytes_per_second[40s]"),
        prom_query(prom, "vramguard_gpu_memory_used_bytes{gpu=\"0\"}[40s]"),
    );
    cause();
    wait_until(40, &format!("{alert} to fire"), || {
        alert_state(prom, alert).as_deref() == Some("firing")
    });
    cure();
    wait_until(40, &format!("{alert} to resolve"), || {
        alert_state(prom, alert).is_none()
    });
    tested.push(alert.to_string());
}

/// The shipped rules for a test: `for` durations of 1 s, the Xid window 10 s, the stall
/// threshold 3 s; the expressions are otherwise the shipped ones.
fn rules_for_test() -> String {
    std::fs::read_to_string(deploy("prometheus/vramguard-rules.yml"))
        .unwrap()
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("for:") {
                "        for: 1s".to_string()
            } else {
                l.replace("[15m]", "[10s]")
                    .replace(
                        "vramguard_last_collection_timestamp_seconds > 120",
                        "vramguard_last_collection_timestamp_seconds > 3",
                    )
                    .replace(
                        "vramguard_host_shm_orphan_bytes > 1073741824",
                        "vramguard_host_shm_orphan_bytes > 0",
                    )
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn shipped_alert_names() -> Vec<String> {
    let text = std::fs::read_to_string(deploy("prometheus/vramguard-rules.yml")).unwrap();
    let docs = yaml_rust2::YamlLoader::load_from_str(&text).unwrap();
    let mut names: Vec<String> = docs[0]["groups"]
        .as_vec()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_vec().unwrap().iter())
        .filter_map(|r| r["alert"].as_str().map(String::from))
        .collect();
    names.sort();
    names
}

fn set_allocation(world: &World, pid: u32, bytes: u64) {
    world.update(|s| {
        for a in s.allocations.iter_mut().filter(|a| a.pid == pid) {
            a.bytes = bytes;
        }
    });
}

/// Every alert rule in `deploy/prometheus` fires against a real agent on the simulated
/// driver, scraped by a real Prometheus, and resolves when its cause is gone; afterwards every
/// Grafana dashboard query returns data.
#[test]
fn every_shipped_alert_fires_and_resolves_and_every_panel_has_data() {
    let world = World::new(2);
    // GPU 1 is a V100: it retires pages instead of remapping rows.
    world.update(|s| {
        s.gpus[1].name = "Tesla V100-SXM2-32GB".into();
        s.gpus[1].total_bytes = 32 * GIB;
        s.gpus[1].health.remapped_rows = None;
        s.gpus[1].health.retired_pages = Some(Default::default());
    });
    let agent = Agent::start(
        &world,
        Path_::Nvml,
        // A call timeout above the 15 s stall below: that stall must hold the collection
        // up for the stall alert to fire (at the default 5 s, a stalled GPU is reported
        // down after 5 s and collection goes on). The node is calm through much of the
        // test: what quiet samples do not read (retired pages, remapped rows) is read by the
        // holders' re-read, every 5 s here (30 s at the calm default).
        &format!(
            "[agent]\ninterval = \"250ms\"\ntrend_window = \"20s\"\nrecheck_every = \"5s\"\n\
             [driver]\ncall_timeout = \"60s\"\n\
             [reclaim]\naudit_log = \"{}\"\n",
            world.dir.path().join("audit.jsonl").display()
        ),
    );
    let dir = tempfile::tempdir().unwrap();
    let (_prom, prom) = scraping_prometheus(dir.path(), agent.addr);
    let mut tested = Vec::new();
    // A live job that stays throughout: the top-holders panel has it.
    let live = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 600);
    world.allocate(allocation(0, live.pid(), GIB));

    // A crashed job: its workers are orphans holding memory no live job owns.
    let mut j = job(&world, 300);
    j.crash();
    let both = ["VramguardOrphanHolders", "VramguardGhostMemory"];
    for alert in both {
        wait_until(40, &format!("{alert} to fire"), || {
            alert_state(prom, alert).as_deref() == Some("firing")
        });
    }
    for w in &j.workers {
        let _ = Command::new("kill")
            .args(["-KILL", &w.to_string()])
            .status();
    }
    drop(j);
    for alert in both {
        wait_until(40, &format!("{alert} to resolve"), || {
            alert_state(prom, alert).is_none()
        });
        tested.push(alert.to_string());
    }

    // Nearly full.
    let m = agent.metrics();
    let total = sample(&m, "vramguard_gpu_memory_total_bytes", &["gpu=\"0\""]).unwrap() as u64;
    let used = sample(&m, "vramguard_gpu_memory_used_bytes", &["gpu=\"0\""]).unwrap() as u64;
    let big = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 600);
    world.allocate(allocation(0, big.pid(), 0));
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardGpuMemoryFull",
        || set_allocation(&world, big.pid(), total / 100 * 99 - used),
        || set_allocation(&world, big.pid(), 0),
    );

    // A leak: a live holder grows by 256 MiB a second, then stops and frees it.
    use std::sync::atomic::{AtomicBool, Ordering};
    let (go, stop) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let grower = {
        let (go, stop, state, pid) = (go.clone(), stop.clone(), world.state_path(), big.pid());
        std::thread::spawn(move || {
            let mut bytes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if !go.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                bytes += 64 << 20;
                vramguard_sim::store::update_state(&state, |s| {
                    for a in s.allocations.iter_mut().filter(|a| a.pid == pid) {
                        a.bytes = bytes;
                    }
                })
                .unwrap();
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    };
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardGpuMemoryLeak",
        || go.store(true, Ordering::Relaxed),
        || {
            stop.store(true, Ordering::Relaxed);
            set_allocation(&world, big.pid(), 0);
        },
    );
    grower.join().unwrap();

    // GPU 0 stops answering, then comes back.
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardGpuLost",
        || {
            world.update(|s| {
                s.gpus[0]
                    .faults
                    .push(fault("nvmlDeviceGetMemoryInfo_v2", 15, None))
            })
        },
        || world.update(|s| s.gpus[0].faults.clear()),
    );

    // Memory health: a remap waits for a reset; a remap failed; a V100's pages wait.
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardGpuRowRemapPending",
        || {
            world.update(|s| {
                s.gpus[0].health.remapped_rows = Some(vramguard_sim::state::SimRemappedRows {
                    correctable: 1,
                    pending: true,
                    ..Default::default()
                })
            })
        },
        // The GPU is in use, so no reset here: the remap is applied as a reset would.
        || {
            world.update(|s| {
                s.gpus[0].health.remapped_rows = Some(vramguard_sim::state::SimRemappedRows {
                    correctable: 1,
                    ..Default::default()
                })
            })
        },
    );
    // The same rule on a V100, whose retired pages wait for a reset.
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardGpuRowRemapPending",
        || {
            world.update(|s| {
                s.gpus[1].health.retired_pages = Some(vramguard_sim::state::SimRetiredPages {
                    double_bit_ecc: vec![0x1000],
                    pending: true,
                    ..Default::default()
                })
            })
        },
        || {
            let _ = vramguard_sim::Sim::open(world.state_path())
                .unwrap()
                .reset(1)
                .unwrap();
        },
    );
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardGpuRowRemapFailure",
        || {
            world.update(|s| {
                s.gpus[0].health.remapped_rows = Some(vramguard_sim::state::SimRemappedRows {
                    failure: true,
                    ..Default::default()
                })
            })
        },
        || world.update(|s| s.gpus[0].health.remapped_rows = Some(Default::default())),
    );

    // Two Xid 79s a few seconds apart (a counter's first sample is not an increase).
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardGpuCriticalXid",
        || {
            world.update(|s| s.gpus[1].health.xid_events.push(79));
            wait_until(20, "the first Xid in Prometheus", || {
                prom_query(prom, "vramguard_gpu_xid_events_total{xid=\"79\"}")["data"]["result"]
                    .as_array()
                    .is_some_and(|r| !r.is_empty())
            });
            world.update(|s| s.gpus[1].health.xid_events.push(79));
        },
        || {},
    );

    // Every call stalls for 15 s: collection stops, the HTTP side still answers,
    // and /healthz turns 503 while it lasts.
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardCollectionStalled",
        || {
            world.update(|s| {
                s.gpus[0]
                    .faults
                    .push(fault("nvmlDeviceGetMemoryInfo_v2", 0, Some(15_000)))
            });
            wait_until(20, "/healthz to report the stall", || {
                agent.get("/healthz").0 == 503
            });
        },
        || {
            world.update(|s| s.gpus[0].faults.clear());
            wait_until(20, "/healthz to recover", || agent.get("/healthz").0 == 200);
        },
    );

    // The agent stops answering scrapes (stopped, as a hung process would be).
    let pid = agent.child.pid().to_string();
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardAgentDown",
        || {
            Command::new("kill").args(["-STOP", &pid]).status().unwrap();
        },
        || {
            Command::new("kill").args(["-CONT", &pid]).status().unwrap();
        },
    );

    // A Slurm heal whose reset failed, then a later one that resumed the node: the heal
    // writes its steps to the audit log the agent follows.
    let heal_step = |event: &str| {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(world.dir.path().join("audit.jsonl"))
            .unwrap();
        writeln!(
            log,
            "{{\"ts_ms\":1796219394123,\"event\":\"{event}\",\"node\":\"gpu07\",\"reason\":\"vramguard: GPU reset did not free the memory\"}}"
        )
        .unwrap();
    };
    fires_and_resolves(
        prom,
        &mut tested,
        "VramguardSlurmHealFailed",
        || heal_step("heal_failed"),
        || heal_step("heal_resumed"),
    );

    // Tested on its own, with an agent in a PID namespace of its own (below).
    tested.push("VramguardOrphanedSharedMemory".into());
    tested.sort();
    tested.dedup();
    assert_eq!(
        tested,
        shipped_alert_names(),
        "every shipped rule is exercised"
    );

    // One more exit, now that the release-lag histogram exists in Prometheus: a rate needs
    // an increase between two scrapes.
    let count = || {
        prom_query(prom, "sum(vramguard_release_lag_seconds_count)")["data"]["result"][0]["value"]
            [1]
        .as_str()
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
    };
    let before = count();
    let short = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 600);
    world.allocate(allocation(0, short.pid(), GIB));
    // Its memory, not only its pid: a sample between its open and its allocation names it
    // with no bytes (its RSS), and an exit seen so releases nothing to time.
    let short_pid = format!("pid=\"{}\"", short.pid());
    wait_until(20, "the short job's memory in the metrics", || {
        sample(
            &agent.metrics(),
            "vramguard_holder_memory_bytes",
            &["gpu=\"0\"", &short_pid],
        ) == Some(GIB as f64)
    });
    drop(short);
    // Two Prometheus scrapes after the agent timed the release: 20 s was once too short in a
    // whole suite's run (the agent's tests run side by side), never alone.
    wait_until(45, "its release lag in Prometheus", || count() > before);

    // Every query of the Grafana dashboard returns data after these incidents.
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(deploy("grafana/vramguard-dashboard.json")).unwrap(),
    )
    .unwrap();
    let mut n = 0;
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap().replace("$instance", ".*");
            let has_data = |r: &Value| {
                r["status"] == "success"
                    && r["data"]["result"].as_array().is_some_and(|r| {
                        !r.is_empty()
                            && r.iter().all(|s| {
                                s["value"][1]
                                    .as_str()
                                    .and_then(|v| v.parse::<f64>().ok())
                                    .is_some_and(f64::is_finite)
                            })
                    })
            };
            let mut last = Value::Null;
            let ok = (0..100).any(|_| {
                last = prom_query(prom, &expr);
                has_data(&last) || {
                    std::thread::sleep(Duration::from_millis(100));
                    false
                }
            });
            assert!(ok, "no data for panel {:?}: {expr}: {last}", p["title"]);
            n += 1;
        }
    }
    assert!(n >= 15, "{n} dashboard queries checked");
    drop(live);
    drop(big);
}

/// A process that already ran when the agent started, and opens a GPU device file later,
/// without making a context: no driver listing and no listing of new processes names it. The
/// agent sees it through its watch of device opens, long before its next sample or full
/// scan; with the watch off, it does not.
#[test]
fn an_old_process_that_opens_a_device_file_is_seen_at_once_through_the_open_watch() {
    let seen_within = |watch: bool, limit: Duration| -> Option<Duration> {
        let world = World::new(1);
        let go = world.dir.path().join("go");
        // The new processes its loop starts are never listed (no discovery for an hour).
        let script = format!(
            "while [ ! -e {go} ]; do sleep 0.02; done; exec 3<{dev}; exec sleep 60",
            go = go.display(),
            dev = world.dev("nvidia0").display()
        );
        let holder = vramguard_testkit::Reaped(
            Command::new("sh")
                .args(["-c", &script])
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let pid = holder.0.id();
        let agent = Agent::start(
            &world,
            Path_::InProcess,
            &format!(
                "[agent]\ninterval = \"30s\"\ndiscover_every = \"1h\"\nfull_scan_every = \"1h\"\nwatch_opens = {watch}\n"
            ),
        );
        wait_until(20, "the agent's first collection", || {
            collections(&agent.metrics()) >= 1.0
        });
        let mentions = || {
            agent
                .get("/api/status")
                .1
                .contains(&format!("\"pid\":{pid},"))
        };
        assert!(!mentions(), "not a holder before it opens the file");
        assert_eq!(
            sample(&agent.metrics(), "vramguard_agent_watching_opens", &[]),
            Some(if watch { 1.0 } else { 0.0 })
        );
        std::fs::write(&go, b"").unwrap();
        let t = Instant::now();
        while t.elapsed() < limit {
            if mentions() {
                return Some(t.elapsed());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        drop(holder);
        None
    };
    let seen = seen_within(true, Duration::from_secs(5)).expect("seen through the open watch");
    eprintln!("an opener seen {seen:?} after it was told to open");
    assert!(seen < Duration::from_secs(2), "{seen:?}");
    assert_eq!(
        seen_within(false, Duration::from_secs(3)),
        None,
        "without the watch, only the next full scan (an hour away) finds it"
    );
}

/// Another user's loop that opens a device file over and over wakes the agent, but costs at
/// most one sample per quarter second, however fast it opens.
#[test]
fn a_flood_of_device_opens_costs_at_most_four_samples_a_second() {
    let world = World::new(1);
    let agent = Agent::start(
        &world,
        Path_::InProcess,
        "[agent]\ninterval = \"30s\"\ndiscover_every = \"1h\"\nfull_scan_every = \"1h\"\n",
    );
    wait_until(20, "the agent's first collection", || {
        collections(&agent.metrics()) >= 1.0
    });
    let before = collections(&agent.metrics());
    let script = format!(
        "end=$(($(date +%s) + 3)); while [ $(date +%s) -lt $end ]; do : <{dev}; : <{dev}; : <{dev}; done",
        dev = world.dev("nvidia0").display()
    );
    let t = Instant::now();
    let flood = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .status()
        .unwrap();
    assert!(flood.success());
    let secs = t.elapsed().as_secs_f64();
    let metrics = agent.metrics();
    let samples = collections(&metrics) - before;
    let openers = sample(&metrics, "vramguard_agent_device_openers_total", &[]).unwrap_or(0.0);
    eprintln!("{openers} openers over {secs:.1} s: {samples} samples");
    assert!(openers >= 1.0, "the flood was seen");
    assert!(
        samples <= (secs * 4.0).ceil() + 1.0,
        "{samples} samples in {secs:.1} s"
    );
}

/// A reload that turns the open watch off stops it: the gauge says 0, and opens are no longer
/// read (the counter stays), as if the agent had started with it off.
#[test]
fn a_reload_that_turns_the_open_watch_off_stops_reading_opens() {
    let world = World::new(1);
    // Metrics are drawn at each sample: a short interval shows the reload soon.
    let config =
        "[agent]\ninterval = \"200ms\"\ndiscover_every = \"1h\"\nfull_scan_every = \"1h\"\n";
    let agent = Agent::start(&world, Path_::InProcess, config);
    let openers = || {
        sample(
            &agent.metrics(),
            "vramguard_agent_device_openers_total",
            &[],
        )
        .unwrap_or(0.0)
    };
    let open_once = || {
        let ok = Command::new("sh")
            .args(["-c", &format!(": <{}", world.dev("nvidia0").display())])
            .status()
            .unwrap()
            .success();
        assert!(ok);
    };
    open_once();
    wait_until(5, "an open to be counted", || openers() >= 1.0);
    let cfg = world
        .dir
        .path()
        .join(format!("agent-{}.toml", std::process::id()));
    std::fs::write(&cfg, format!("{config}watch_opens = false\n")).unwrap();
    assert!(
        Command::new("kill")
            .args(["-HUP", &agent.child.pid().to_string()])
            .status()
            .unwrap()
            .success()
    );
    wait_until(5, "the reload", || {
        sample(&agent.metrics(), "vramguard_agent_watching_opens", &[]) == Some(0.0)
    });
    let before = openers();
    open_once();
    // Five samples later, a watch that still ran would have counted it.
    agent.wait_collections(5);
    assert_eq!(
        openers(),
        before,
        "opens are still read after the watch was turned off"
    );
}

/// An agent with automatic reclaim on, started with `global` options before `agent` and
/// `extra` after it, that must refuse to start: its stderr. Under `timeout`: an agent that
/// started anyway fails the test instead of hanging it. Nothing may reach the audit log.
fn refused_auto_agent(world: &World, global: &[&std::ffi::OsStr], extra: &[&str]) -> String {
    refused_auto_agent_with(world, "", global, extra)
}

/// [`refused_auto_agent`] with more `[reclaim]` keys.
fn refused_auto_agent_with(
    world: &World,
    reclaim_keys: &str,
    global: &[&std::ffi::OsStr],
    extra: &[&str],
) -> String {
    let audit = world.dir.path().join("audit.jsonl");
    let cfg = config(
        world,
        &format!(
            "[reclaim]\nauto = true\naudit_log = \"{}\"\n{reclaim_keys}",
            audit.display()
        ),
    );
    let out = vg_wrapped("timeout")
        .arg("20")
        .arg(BIN)
        .arg("--sim")
        .arg(world.state_path())
        .arg("--config")
        .arg(&cfg)
        .args(global)
        .args(["agent", "--listen", "127.0.0.1:0"])
        .args(extra)
        .env_remove("VRAMGUARD_SIM")
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        !audit.exists(),
        "nothing may be written, let alone signalled"
    );
    stderr(&out)
}

/// The agent will not start with automatic reclaim on a `/proc` that is not its own PID
/// namespace's (a container's, a fixture tree): a pid there is not the process a signal
/// reaches here. One line saying so, exit 2; without `auto` the same root is fine to watch.
#[test]
fn automatic_reclaim_on_a_proc_of_another_namespace_refuses_to_start() {
    let world = World::new(1);
    let tree =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../vramguard-proc/tests/fixtures/proc");
    let err = refused_auto_agent(&world, &["--proc-root".as_ref(), tree.as_os_str()], &[]);
    assert!(
        err.contains("[reclaim] auto = true cannot run here")
            && err.contains("is not the /proc of vramguard's own PID namespace")
            && err.trim_end().lines().count() == 1,
        "{err}"
    );
}

/// `--interval` obeys the config's rule for automatic reclaim (second read: the flag
/// replaced the checked interval unchecked).
#[test]
fn automatic_reclaim_refuses_an_interval_flag_longer_than_gpu_work_is_remembered() {
    let world = World::new(1);
    let err = refused_auto_agent(&world, &[], &["--interval", "30s"]);
    assert!(
        err.contains("--interval 30.0s: 30.0s is longer than policy.gpu_busy_recent"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    // And its min_age floor, naming the key at fault.
    let err = refused_auto_agent_with(&world, "min_age = \"20s\"\n", &[], &["--interval", "8s"]);
    assert!(
        err.contains("--interval 8.0s: reclaim.min_age: 20.0s is shorter than 3 samples"),
        "{err}"
    );
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}
