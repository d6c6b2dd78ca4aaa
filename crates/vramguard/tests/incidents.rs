//! The incident corpus: every snapshot in `tests/incidents/*.json` is replayed through
//! `status`, `diagnose`, `reclaim --dry-run` (text and JSON) and `metrics`, and each output
//! must equal its golden file in `tests/incidents/<name>/`. A change in wording or in
//! classification shows here as a diff. `scripts/update-golden.sh` rewrites the golden files
//! after an intended change; a bug report's snapshot becomes a test by dropping it into the
//! folder and running that script.

mod common;
use common::*;
use std::path::{Path, PathBuf};

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/incidents")
}

/// (file name, arguments after `--replay SNAPSHOT`).
const VIEWS: &[(&str, &[&str])] = &[
    ("status.txt", &["status"]),
    ("status.json", &["status", "--json"]),
    ("diagnose.txt", &["diagnose"]),
    ("diagnose.json", &["diagnose", "--json"]),
    ("reclaim-dry-run.txt", &["reclaim", "--dry-run"]),
    ("reclaim-dry-run.json", &["reclaim", "--dry-run", "--json"]),
    ("metrics.txt", &["metrics"]),
];

/// One view of a snapshot: exit code and stdout, at a fixed width, without colour, with an
/// empty config (the defaults).
fn view(snapshot: &Path, config: &Path, args: &[&str]) -> (i32, String) {
    let (out, shown) = Vg::bare()
        .env("COLUMNS", "160")
        .without_env("VRAMGUARD_CONFIG")
        .args(["--config".as_ref(), config.as_os_str()])
        .args(["--replay".as_ref(), snapshot.as_os_str()])
        .args(args)
        .output();
    let code = out.status.code().unwrap_or(-1);
    // 2 is an error; it is golden only with the report printed (a GPU that could not be
    // read), never as a failure to replay.
    assert!(
        code == 0 || code == 1 || (code == 2 && !out.stdout.is_empty()),
        "$ {shown}: exit {code}\n{}",
        stderr(&out)
    );
    (code, stdout(&out))
}

/// The exposition with each family's samples sorted: a family's label sets come out in hash
/// order, which differs from run to run.
fn samples_in_order(text: &str) -> String {
    let mut out = Vec::new();
    let mut samples: Vec<&str> = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            samples.sort_unstable();
            out.append(&mut samples);
            out.push(line);
        } else {
            samples.push(line);
        }
    }
    samples.sort_unstable();
    out.append(&mut samples);
    out.join("\n") + "\n"
}

/// The first line where two texts differ, for the failure message.
fn first_difference(want: &str, got: &str) -> String {
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    for i in 0..w.len().max(g.len()) {
        if w.get(i) != g.get(i) {
            return format!(
                "line {}:\n  golden: {}\n  now:    {}",
                i + 1,
                w.get(i).unwrap_or(&"(end)"),
                g.get(i).unwrap_or(&"(end)")
            );
        }
    }
    "(same lines; whitespace at the end differs)".into()
}

/// `vramguard.explain(gpu=0)` of the Python module in `packaging/python/src` (what the OOM
/// hook prints), with the module's binary a wrapper that replays `snapshot`.
fn python_explain(scratch: &Path, snapshot: &Path, config: &Path) -> String {
    let wrapper = scratch.join("vramguard-replay");
    let script = format!(
        "#!/bin/sh\nexec '{}' --config '{}' --replay \"$VG_REPLAY\" \"$@\"\n",
        BIN,
        config.display()
    );
    if !wrapper.exists() {
        std::fs::write(&wrapper, script).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let module = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/python/src");
    let out = std::process::Command::new("python3")
        .args(["-c", "import vramguard; print(vramguard.explain(gpu=0))"])
        .env("PYTHONPATH", &module)
        .env("VRAMGUARD_BINARY", &wrapper)
        .env("VG_REPLAY", snapshot)
        .env("VRAMGUARD_CONFIG", "none")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("python3 runs (scripts/test.sh installs it)");
    assert!(
        out.status.success(),
        "explain() of {}: {}\n{}",
        snapshot.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn every_incident_replays_to_its_golden_outputs() {
    let update = std::env::var_os("VRAMGUARD_UPDATE_GOLDEN").is_some();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("empty.toml");
    std::fs::write(&config, "").unwrap();
    let mut snapshots: Vec<PathBuf> = std::fs::read_dir(corpus())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    snapshots.sort();
    assert!(
        snapshots.len() >= 20,
        "the corpus has {} incidents",
        snapshots.len()
    );
    let mut failures = Vec::new();
    for snap in &snapshots {
        let name = snap.file_stem().unwrap().to_string_lossy().to_string();
        let golden_dir = corpus().join(&name);
        let mut codes = String::new();
        for (file, args) in VIEWS {
            let (code, text) = view(snap, &config, args);
            let text = if args[0] == "metrics" {
                samples_in_order(&text)
            } else {
                text
            };
            codes.push_str(&format!("{}: {code}\n", args.join(" ")));
            let golden = golden_dir.join(file);
            if update {
                std::fs::create_dir_all(&golden_dir).unwrap();
                std::fs::write(&golden, &text).unwrap();
                continue;
            }
            match std::fs::read_to_string(&golden) {
                Ok(want) if want == text => {}
                Ok(want) => {
                    failures.push(format!("{name}/{file}: {}", first_difference(&want, &text)))
                }
                Err(_) => failures.push(format!("{name}/{file}: no golden file")),
            }
        }
        // What the Python module's OOM explanation says of GPU 0 (`explain.txt`).
        let text = python_explain(dir.path(), snap, &config);
        let golden = golden_dir.join("explain.txt");
        if update {
            std::fs::write(&golden, &text).unwrap();
        } else {
            match std::fs::read_to_string(&golden) {
                Ok(want) if want == text => {}
                Ok(want) => failures.push(format!(
                    "{name}/explain.txt: {}",
                    first_difference(&want, &text)
                )),
                Err(_) => failures.push(format!("{name}/explain.txt: no golden file")),
            }
        }
        let golden = golden_dir.join("exit-codes.txt");
        if update {
            std::fs::write(&golden, &codes).unwrap();
        } else if std::fs::read_to_string(&golden).ok().as_deref() != Some(codes.as_str()) {
            failures.push(format!("{name}/exit-codes.txt: now\n{codes}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} golden output(s) differ (after an intended change: scripts/update-golden.sh, and \
         say why in the commit):\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn a_changed_output_fails_the_comparison() {
    // The comparison itself: a golden file that differs by one word is reported with its line.
    let d = first_difference("a\nGPU 0: 3 orphans\n", "a\nGPU 0: 2 orphans\n");
    assert!(d.starts_with("line 2:"), "{d}");
    assert!(d.contains("3 orphans") && d.contains("2 orphans"), "{d}");
}

/// Incidents no other test stages, for the corpus only: run by scripts/capture-incidents.sh
/// (with VRAMGUARD_CAPTURE_INCIDENTS set).
#[test]
#[ignore = "stages incidents for the corpus; scripts/capture-incidents.sh runs it"]
fn stage_incidents_for_the_corpus() {
    // Only a run with --ignored gets here: without a folder to stage into, nothing can be
    // checked, and that is the caller's mistake, not a pass.
    let out = std::env::var_os("VRAMGUARD_CAPTURE_INCIDENTS").expect(
        "VRAMGUARD_CAPTURE_INCIDENTS is not set: scripts/capture-incidents.sh sets it and runs this",
    );
    let out = PathBuf::from(out);
    std::fs::create_dir_all(&out).unwrap();

    // The demo's incident.
    Vg::bare()
        .args([
            "demo".as_ref(),
            "--save-snapshot".as_ref(),
            out.join("demo.json").as_os_str(),
        ])
        .code(0);

    // A 535.43–535.98 driver: its _v3 process records are unreliable.
    {
        let world = World::new(1);
        world.update(|s| {
            s.driver_version = "535.54.03".into();
            s.gpus[0]
                .quirks
                .push(vramguard_sim::state::Quirk::V3Records32Bytes);
        });
        let h = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 120);
        world.allocate(allocation(0, h.pid(), 3 * GIB));
        capture_incident_as(&world, Path_::Nvml, "driver_535_swapped_v3_records");
    }

    // A MIG GPU: per-process memory is not available, the used memory is the whole GPU's.
    {
        let world = World::new(2);
        world.update(|s| s.gpus[1].mig = true);
        let h = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia1"], 120);
        world.allocate(allocation(1, h.pid(), 5 * GIB));
        capture_incident_as(&world, Path_::Nvml, "mig_gpu_with_one_holder");
    }

    // A busy node: 2,000 processes, 200 of them holding GPU memory, on 8 GPUs, and one
    // crashed trainer's orphaned worker.
    {
        let world = World::new(8);
        let mut kids = Children::default();
        for i in 0..2000u32 {
            let gpu = i % 8;
            let files = if i < 200 {
                vec![
                    "nvidiactl".to_string(),
                    "nvidia-uvm".into(),
                    format!("nvidia{gpu}"),
                ]
            } else {
                vec![]
            };
            let mut script = String::new();
            for (n, f) in files.iter().enumerate() {
                script.push_str(&format!("exec {}<{} ; ", n + 3, world.dev(f).display()));
            }
            script.push_str("exec sleep 600");
            use std::os::unix::process::CommandExt;
            kids.0.push(
                std::process::Command::new("sh")
                    .arg("-c")
                    .arg(&script)
                    .process_group(0)
                    .spawn()
                    .unwrap(),
            );
        }
        world.update(|s| {
            for (i, c) in kids.0.iter().take(200).enumerate() {
                s.allocations.push(allocation(
                    i as u32 % 8,
                    c.id(),
                    GIB / 4 + (i as u64) * (1 << 20),
                ));
            }
        });
        wait_until(60, "the holders to open their files", || {
            kids.0
                .iter()
                .take(200)
                .all(|c| open_files(c.id(), &world.dev_dir()) >= 3)
        });
        let trainer = crashed_trainer(&world);
        capture_incident_as(&world, Path_::Nvml, "busy_node_2000_processes_8_gpus");
        drop(trainer);
    }
}

#[test]
fn a_replay_plans_but_never_acts_and_metrics_work_live() {
    let snap = corpus().join("demo.json");
    let (out, _) = Vg::bare()
        .args([
            "--replay".as_ref(),
            snap.as_os_str(),
            "reclaim".as_ref(),
            "--yes".as_ref(),
        ])
        .output();
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("with --replay only --dry-run works") && err.lines().count() == 1,
        "{err}"
    );
    let world = World::new(1);
    let h = world.holder(&["nvidiactl", "nvidia-uvm", "nvidia0"], 60);
    world.allocate(allocation(0, h.pid(), GIB));
    let m = stdout(&Vg::new(&world, Path_::Nvml).args(["metrics"]).code(0));
    assert_eq!(sample(&m, "vramguard_up", &["gpu=\"0\""]), Some(1.0), "{m}");
    assert_eq!(
        sample(
            &m,
            "vramguard_holder_memory_bytes",
            &[&format!("pid=\"{}\"", h.pid())]
        ),
        Some(GIB as f64),
        "{m}"
    );
}
