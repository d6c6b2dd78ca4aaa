//! `vramguard probe` on the simulated driver: the measured numbers must be the simulator's
//! configured teardown lags and leaks.

mod common;
use common::*;
use serde_json::{Value, json};
use vramguard_sim::state::AfterExit;

fn probe(world: &World, args: &[&str]) -> (i32, Value) {
    let (out, shown) = Vg::new(world, Path_::InProcess)
        .args(["probe"].iter().chain(args).chain(&["--json"]))
        .output();
    let code = out.status.code().unwrap_or(-1);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "$ {shown}\nnot JSON ({e}): {}\n{}",
            stdout(&out),
            stderr(&out)
        )
    });
    (code, v)
}

fn lagging(world: &World, after_exit: AfterExit) {
    world.update(|s| s.gpus[0].after_exit = after_exit);
}

#[test]
fn release_recovers_the_configured_lag_for_every_signal() {
    let world = World::new(1);
    lagging(&world, AfterExit::ReleaseAfterMs(400));
    let report_dir = world.dir.path().join("report");
    let (code, r) = probe(
        &world,
        &[
            "release",
            "--size",
            "2GiB",
            "--signals",
            "TERM,INT,KILL",
            "--repeat",
            "2",
            "--report",
            report_dir.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 0, "{r:#}");
    let trials = r["results"]["trials"].as_array().unwrap();
    assert_eq!(trials.len(), 6);
    for t in trials {
        assert_eq!(t["released"], true);
        let lag = t["driver_lag_ms"].as_f64().unwrap();
        let res = t["resolution_ms"].as_f64().unwrap();
        // The simulator starts the lag when it first sees the exit, at a reading; the release is
        // seen at the next reading after the lag: within two sampling gaps (and some scheduling).
        assert!(
            lag >= 400.0 - 1.0 && lag <= 400.0 + 2.0 * res + 15.0,
            "{} lag {lag} ms (resolution {res} ms)",
            t["signal"]
        );
        assert!(t["exit_ms"].as_f64().unwrap() < 100.0);
    }
    assert!(
        r["achieved_hz"].as_f64().unwrap() > 150.0,
        "{}",
        r["achieved_hz"]
    );
    for f in [
        "report.md",
        "report.json",
        "release-term.svg",
        "release-int.svg",
        "release-kill.svg",
    ] {
        assert!(report_dir.join(f).exists(), "{f}");
    }
    for svg in ["release-term.svg", "release-kill.svg"] {
        let text = std::fs::read_to_string(report_dir.join(svg)).unwrap();
        let doc = roxmltree::Document::parse(&text)
            .unwrap_or_else(|e| panic!("{svg} does not parse: {e}"));
        assert_eq!(doc.root_element().tag_name().name(), "svg");
        assert!(
            doc.descendants()
                .any(|n| n.tag_name().name() == "polyline" || n.tag_name().name() == "path")
        );
    }
    let md = std::fs::read_to_string(report_dir.join("report.md")).unwrap();
    assert!(md.contains("| SIGKILL | 2 | 2/2 |"), "{md}");
    assert!(
        md.contains("580.159.03 (simulated)") && md.contains("NVIDIA H200"),
        "{md}"
    );
}

#[test]
fn children_that_inherit_the_context_keep_the_memory_and_are_flagged() {
    let world = World::new(1);
    lagging(&world, AfterExit::ReleaseAfterMs(200));
    let (code, r) = probe(
        &world,
        &[
            "release",
            "--size",
            "2GiB",
            "--signals",
            "KILL",
            "--repeat",
            "1",
            "--children",
            "2",
            "--timeout",
            "1s",
        ],
    );
    assert_eq!(code, 1, "memory was left behind: {r:#}");
    let t = &r["results"]["trials"][0];
    assert_eq!(t["released"], false);
    assert_eq!(t["orphans_kept_memory"], true);
    assert_eq!(t["leftover_bytes"], json!(2 * GIB));
    let after = t["release_after_children_ms"]
        .as_f64()
        .expect("released once the children were killed");
    assert!((190.0..400.0).contains(&after), "{after}");
}

#[test]
fn concurrent_kills_release_one_by_one_and_leaks_are_flagged() {
    let world = World::new(1);
    lagging(&world, AfterExit::ReleaseAfterMs(150));
    let (code, r) = probe(
        &world,
        &[
            "concurrent",
            "--size",
            "1GiB",
            "--workers",
            "4",
            "--seed",
            "42",
        ],
    );
    assert_eq!(code, 0, "{r:#}");
    let c = &r["results"];
    assert_eq!(c["seed"], 42);
    let kills = c["kills"].as_array().unwrap();
    assert_eq!(kills.len(), 4);
    for k in kills {
        let ms = k["release_ms"].as_f64().unwrap();
        assert!((145.0..260.0).contains(&ms), "{ms}");
    }
    assert_eq!(c["leftover_bytes"], 0);

    lagging(&world, AfterExit::Leak);
    let (code, r) = probe(
        &world,
        &[
            "concurrent",
            "--size",
            "1GiB",
            "--workers",
            "2",
            "--timeout",
            "600ms",
        ],
    );
    assert_eq!(code, 1, "{r:#}");
    assert_eq!(r["results"]["leftover_bytes"], json!(2 * GIB));
}

#[test]
fn soak_fits_the_leak_rate_and_a_clean_driver_is_flat() {
    let world = World::new(1);
    lagging(&world, AfterExit::Leak);
    let report_dir = world.dir.path().join("soak");
    let (code, r) = probe(
        &world,
        &[
            "soak",
            "--size",
            "1GiB",
            "--duration",
            "3s",
            "--cycle",
            "250ms",
            "--report",
            report_dir.to_str().unwrap(),
        ],
    );
    assert_eq!(code, 1, "a rising baseline is a finding: {r:#}");
    let s = &r["results"];
    let cycles = s["cycles"].as_array().unwrap();
    assert!(cycles.len() >= 5, "{}", cycles.len());
    let (t0, t1) = (
        cycles[0]["t_ms"].as_f64().unwrap(),
        cycles.last().unwrap()["t_ms"].as_f64().unwrap(),
    );
    let expected = (cycles.len() - 1) as f64 * GIB as f64 / ((t1 - t0) / 3_600_000.0);
    let slope = s["trend_bytes_per_hour"]["slope"].as_f64().unwrap();
    assert!(
        (slope - expected).abs() / expected < 0.25,
        "slope {slope:e} B/h, expected {expected:e}"
    );
    assert!(s["trend_bytes_per_hour"]["ci_low"].as_f64().unwrap() > 0.0);
    let text = std::fs::read_to_string(report_dir.join("soak.svg")).unwrap();
    roxmltree::Document::parse(&text).expect("soak.svg parses");

    let clean = World::new(1);
    lagging(&clean, AfterExit::ReleaseAfterMs(20));
    let (code, r) = probe(
        &clean,
        &[
            "soak",
            "--size",
            "1GiB",
            "--duration",
            "2s",
            "--cycle",
            "200ms",
            "--kill-cycles",
        ],
    );
    assert_eq!(code, 0, "{r:#}");
    let t = &r["results"]["trend_bytes_per_hour"];
    assert!(
        t["ci_low"].as_f64().unwrap() <= 0.0 && t["ci_high"].as_f64().unwrap() >= 0.0,
        "{t:#}"
    );
    let signals: Vec<&str> = r["results"]["cycles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["signal"].as_str().unwrap())
        .collect();
    assert_eq!(&signals[..3], &["TERM", "KILL", "INT"]);
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let world = World::new(1);
    let err = stderr(
        &Vg::new(&world, Path_::InProcess)
            .args(["probe", "release", "--size", "500GiB"])
            .code(2),
    );
    assert!(err.contains("does not fit"), "{err}");
    let err = stderr(
        &Vg::new(&world, Path_::InProcess)
            .args(["probe", "release", "--gpu", "3"])
            .code(2),
    );
    assert!(err.contains("--gpu 3: no such GPU or MIG device"), "{err}");
    let err = stderr(
        &Vg::new(&world, Path_::InProcess)
            .args(["probe", "release", "--signals", "TERM,FOO"])
            .code(2),
    );
    assert!(err.contains("unknown signal \"FOO\""), "{err}");
    // A simulated driver that numbers processes through another /proc: its holders' pids are
    // not this namespace's, and the probe would signal other processes (red team).
    let elsewhere = world.dir.path().join("another-proc");
    std::fs::create_dir_all(&elsewhere).unwrap();
    world.update(|s| s.proc_root = elsewhere.clone());
    let err = stderr(
        &Vg::new(&world, Path_::InProcess)
            .args(["probe", "release", "--size", "1GiB"])
            .code(2),
    );
    assert!(
        err.contains("the simulated driver's proc_root must be this PID namespace's /proc"),
        "{err}"
    );
    // The built-in CUDA holder without a driver.
    let out = Vg::bare()
        .args(["__cuda-hold", "--pci", "00000000:19:00.0", "--bytes", "1"])
        .code(2);
    assert!(
        stderr(&out).contains("libcuda.so.1 could not be loaded"),
        "{}",
        stderr(&out)
    );
}

/// Issue 30: `probe soak` printed nothing for its whole duration (30 min by default). It says
/// at once what it does and for how long, then how far it is and how long is left, on stderr
/// (stdout is the report): piped, one plain line per tenth of the run, no redraw; with
/// `--json` and no terminal, nothing extra.
#[test]
fn soak_shows_its_progress_and_the_time_left() {
    let world = World::new(1);
    lagging(&world, AfterExit::ReleaseAfterMs(20));
    let out = Vg::new(&world, Path_::InProcess)
        .args([
            "probe",
            "soak",
            "--size",
            "1GiB",
            "--duration",
            "2s",
            "--cycle",
            "200ms",
        ])
        .code(0);
    let err = stderr(&out);
    assert!(
        err.starts_with("soak: allocating and freeing every 200ms for 2.0s"),
        "{err}"
    );
    assert!(!err.contains('\r') && !err.contains('\x1b'), "{err:?}");
    let percents: Vec<u64> = err
        .lines()
        .filter(|l| l.contains(" left; baseline "))
        .map(|l| {
            let open = l.find('(').unwrap();
            let close = l.find("%)").unwrap();
            l[open + 1..close].parse().unwrap()
        })
        .collect();
    assert!(percents.len() >= 3, "progress lines:\n{err}");
    assert!(
        percents.windows(2).all(|w| w[0] / 10 < w[1] / 10),
        "{percents:?}"
    );
    assert!(!stdout(&out).contains("left; baseline"));

    let json = Vg::new(&world, Path_::InProcess)
        .args([
            "probe",
            "soak",
            "--size",
            "1GiB",
            "--duration",
            "1s",
            "--cycle",
            "200ms",
            "--json",
        ])
        .code(0);
    assert_eq!(stderr(&json), "", "--json piped: nothing but the document");
}

/// `probe release` and `probe concurrent` say each trial's or kill's outcome as it ends, with
/// the time left; piped, one plain line each on stderr, and the report alone on stdout.
#[test]
fn release_and_concurrent_show_each_step_as_it_ends() {
    let world = World::new(1);
    lagging(&world, AfterExit::ReleaseAfterMs(20));
    let out = Vg::new(&world, Path_::InProcess)
        .args([
            "probe",
            "release",
            "--size",
            "1GiB",
            "--signals",
            "TERM,KILL",
            "--repeat",
            "2",
        ])
        .code(0);
    let err = stderr(&out);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(
        lines.first().copied(),
        Some("release: 4 trial(s): TERM, KILL × 2; progress below, the report at the end"),
        "{err}"
    );
    let steps: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("release: ") && l.contains(" of 4: "))
        .copied()
        .collect();
    assert_eq!(steps.len(), 4, "{err}");
    for (i, l) in steps.iter().enumerate() {
        assert!(
            l.starts_with(&format!("release: {} of 4: memory back ", i + 1)),
            "{l}"
        );
    }
    assert!(
        steps[0].contains("after SIGTERM") && steps[0].ends_with(" left"),
        "{}",
        steps[0]
    );
    assert!(
        steps[3].contains("after SIGKILL") && steps[3].ends_with("; done"),
        "{}",
        steps[3]
    );
    assert!(!err.contains('\r') && !err.contains('\x1b'), "{err:?}");
    assert!(!stdout(&out).contains(" of 4: "));

    let out = Vg::new(&world, Path_::InProcess)
        .args([
            "probe",
            "concurrent",
            "--size",
            "1GiB",
            "--workers",
            "3",
            "--kill",
            "sequential",
        ])
        .code(0);
    let err = stderr(&out);
    let steps: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("concurrent: ") && l.contains(" of 3: pid "))
        .collect();
    assert_eq!(steps.len(), 3, "{err}");
    assert!(steps[2].ends_with("; done"), "{err}");
}

#[test]
fn probe_calls_times_each_call_of_a_sample_through_nvml_and_in_process() {
    // A remapped-rows read that takes 30 ms and a persistence-mode read that fails: the slow call
    // heads the table, the failure is counted with what the driver said, and every call of
    // the agent's sample is there once per sample. Nothing is allocated or signalled.
    let world = World::new(2);
    let _holder = start(
        &world,
        &["python3", "serve.py"],
        spec(&world, json!([hold(1, 2)])),
    );
    world.update(|s| {
        s.gpus[1]
            .faults
            .push(fault("nvmlDeviceGetRemappedRows", 0, Some(30)));
        s.gpus[1]
            .faults
            .push(fault("nvmlDeviceGetPersistenceMode", 999, None));
    });
    for path in [Path_::Nvml, Path_::InProcess] {
        let r = Vg::new(&world, path)
            .args(["probe", "calls", "--gpu", "1", "--samples", "4", "--json"])
            .json(0);
        let cost = &r["cost"];
        assert_eq!(cost["gpu"], 1, "{r:#}");
        assert_eq!(cost["samples"], 4, "{r:#}");
        let calls = cost["calls"].as_array().unwrap();
        let call = |name: &str| {
            calls
                .iter()
                .find(|c| c["call"] == name)
                .unwrap_or_else(|| panic!("{name} missing: {r:#}"))
        };
        assert_eq!(calls[0]["call"], "nvmlDeviceGetRemappedRows", "{r:#}");
        assert!(calls[0]["median_us"].as_f64().unwrap() >= 30_000.0, "{r:#}");
        let power = call("nvmlDeviceGetPersistenceMode");
        assert_eq!(power["failed"].as_object().unwrap().len(), 1, "{r:#}");
        assert_eq!(
            power["failed"].as_object().unwrap().values().next(),
            Some(&json!(4)),
            "{r:#}"
        );
        for name in [
            "nvmlDeviceGetMemoryInfo_v2",
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetProcessUtilization",
            "nvmlDeviceGetUUID",
        ] {
            assert_eq!(call(name)["calls"], 4, "{name}: {r:#}");
        }
        // The whole read, as a sample reads it, pays the slow sensor too.
        assert!(
            cost["read_median_us"].as_f64().unwrap() >= 30_000.0,
            "{r:#}"
        );
        assert!(
            cost["calls_median_us"].as_f64().unwrap() >= 30_000.0,
            "{r:#}"
        );
        // A quiet sample's reading does not ask for the remapped rows: the slow sensor
        // costs it nothing.
        assert!(
            cost["settled_read_median_us"].as_f64().unwrap() < 30_000.0,
            "{r:#}"
        );
    }
    // The text table names the slow call first, and GPU 0 (no fault) is fast.
    let out = Vg::new(&world, Path_::InProcess)
        .args(["probe", "calls", "--gpu", "1", "--samples", "2"])
        .code(0);
    let text = stdout(&out);
    let first_row = text.lines().nth(2).unwrap_or_default();
    assert!(
        first_row.starts_with("nvmlDeviceGetRemappedRows "),
        "{text}"
    );
    assert!(text.contains("2 failed: "), "{text}");
    let r = Vg::new(&world, Path_::InProcess)
        .args(["probe", "calls", "--gpu", "0", "--samples", "2", "--json"])
        .json(0);
    assert!(
        r["cost"]["calls_median_us"].as_f64().unwrap() < 30_000.0,
        "{r:#}"
    );
    // A stuck call ends the measurement at --timeout with an error, not a hang.
    world.update(|s| {
        s.gpus[1].faults[0].delay_ms = Some(5_000);
    });
    let t = std::time::Instant::now();
    let out = Vg::new(&world, Path_::InProcess)
        .args([
            "probe",
            "calls",
            "--gpu",
            "1",
            "--samples",
            "3",
            "--timeout",
            "1s",
        ])
        .code(2);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(4),
        "{:?}",
        t.elapsed()
    );
    assert!(
        stderr(&out).contains("a call is stuck in the driver"),
        "{}",
        stderr(&out)
    );
}
