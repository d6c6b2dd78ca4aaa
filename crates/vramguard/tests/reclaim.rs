//! `vramguard reclaim` end to end: real processes, the NVML path of the simulated driver, the
//! audit log on disk.

mod common;
use common::*;
use serde_json::{Value, json};
use std::path::Path;

/// A job whose leader crashed: `workers` listed workers (4 GiB each) and one unlisted
/// DataLoader worker (2 GiB), all with `after_exit`; returns the holding (leader already dead).
fn crashed_job(world: &World, after_exit: Value, ignore_term: bool) -> Holding {
    let mut leader = spec(world, json!([hold(0, 1)]));
    leader["group_leader"] = json!(true);
    let worker = |listed: bool, gib: u64| {
        json!({ "argv": ["python3", "train.py"], "spec": {
            "state": world.state_path(), "lifetime_ms": 120_000, "ignore_term": ignore_term,
            "holds": [{ "gpu": 0, "bytes": gib * GIB, "listed": listed, "after_exit": after_exit }] } })
    };
    leader["workers"] = json!([worker(true, 4), worker(true, 4), worker(false, 2)]);
    let mut h = start(world, &["python3", "train.py"], leader);
    h.crash();
    h
}

/// [`crashed_job`], seen once by root (the simulator records its first sightings), then
/// the world opened to an unprivileged user.
fn crashed_job_open_to_everyone(world: &World) -> Holding {
    let job = crashed_job(world, json!("release"), false);
    Vg::new(world, Path_::InProcess).args(["status"]).code(0);
    world.open_to_everyone();
    job
}

fn live_job(world: &World, gib: u64) -> Holding {
    let mut s = spec(
        world,
        json!([{ "gpu": 0, "bytes": gib * GIB, "sm_util": 70 }]),
    );
    s["new_session"] = json!(true);
    start(world, &["python3", "serve.py"], s)
}

/// `text` with every run of whitespace made one space (help text wraps where it likes).
fn squash(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn audit_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("torn audit record {l:?}: {e}")))
        .collect()
}

#[test]
fn reclaim_kills_exactly_the_orphans_and_measures_the_release_lag() {
    let world = World::new(1);
    let server = live_job(&world, 10);
    let job = crashed_job(&world, json!({ "release_after_ms": 1500 }), false);
    let audit = world.dir.path().join("audit.jsonl");
    let out = Vg::new(&world, Path_::Nvml)
        .args([
            "reclaim".as_ref(),
            "--yes".as_ref(),
            "--gpu".as_ref(),
            "0".as_ref(),
            "--json".as_ref(),
            "--audit-log".as_ref(),
            audit.as_os_str(),
        ])
        .json(0);

    let signalled: Vec<u64> = out["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["pid"].as_u64().unwrap())
        .collect();
    let mut expected: Vec<u64> = job.workers.iter().map(|w| *w as u64).collect();
    expected.sort();
    assert_eq!(signalled, expected, "exactly the three orphaned workers");
    for t in out["targets"].as_array().unwrap() {
        assert_eq!(t["result"], "exited", "{t:#}");
        assert_eq!(t["signals"], json!(["TERM"]));
    }
    for w in &job.workers {
        assert!(!alive(*w));
    }
    assert!(alive(server.pid), "the live job on the same GPU survives");

    let rel = &out["releases"][0];
    assert_eq!(rel["released"], json!(true), "{rel:#}");
    assert_eq!(
        rel["freed_bytes"],
        json!(10 * GIB),
        "8 GiB listed + 2 GiB hidden"
    );
    let lag = rel["release_ms"].as_u64().unwrap();
    assert!(
        (1400..=2500).contains(&lag),
        "teardown lag measured as {lag} ms, configured 1500 ms"
    );
    assert_eq!(out["remaining"], json!([]));

    let lines = audit_lines(&audit);
    let events: Vec<&str> = lines.iter().map(|l| l["event"].as_str().unwrap()).collect();
    assert_eq!(events.first(), Some(&"start"));
    assert_eq!(events.last(), Some(&"result"));
    assert_eq!(events.iter().filter(|e| **e == "target").count(), 3);
    assert_eq!(events.iter().filter(|e| **e == "signal").count(), 3);
    assert_eq!(events.iter().filter(|e| **e == "exited").count(), 3);
    assert!(events.contains(&"released"));
    let left: Vec<&Value> = lines
        .iter()
        .filter(|l| l["event"] == "left_alone")
        .collect();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["pid"], json!(server.pid));
    assert_eq!(left[0]["reason"], "its job is alive");
    let sig = lines.iter().find(|l| l["event"] == "signal").unwrap();
    assert!(sig["start_ticks"].as_u64().is_some() && sig["ts"].as_str().unwrap().ends_with('Z'));
}

#[test]
fn residue_is_freed_only_by_a_reset_which_is_refused_while_the_gpu_is_held() {
    let world = World::new(1);
    let mut bench = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 6 * GIB, "after_exit": "leak" }]),
    );
    bench["new_session"] = json!(true);
    let mut b = start(&world, &["python3", "bench.py"], bench);
    b.crash();
    let mut user = live_job(&world, 1);
    let audit = world.dir.path().join("audit.jsonl");
    let reclaim = |extra: &[&str]| {
        let mut args: Vec<std::ffi::OsString> = vec![
            "reclaim".into(),
            "--yes".into(),
            "--audit-log".into(),
            audit.clone().into_os_string(),
        ];
        args.extend(extra.iter().map(|a| a.into()));
        Vec::from_iter(args)
    };

    // Without --reset, nothing can free it, and it says how.
    let out = Vg::new(&world, Path_::Nvml).args(reclaim(&[])).code(1);
    assert!(stdout(&out).contains("6.0 GiB"), "{}", stdout(&out));

    // --reset=auto, but a process holds the GPU: refused, the blocker named.
    let out = Vg::new(&world, Path_::Nvml)
        .args(reclaim(&["--reset=auto", "--json"]))
        .json(1);
    let r = &out["resets"][0];
    assert_eq!(r["attempted"], json!(false));
    assert!(
        r["blockers"][0]
            .as_str()
            .unwrap()
            .starts_with(&format!("{} (", user.pid)),
        "{r:#}"
    );
    assert!(alive(user.pid), "a reset blocker is never signalled");

    // Once the GPU is free of processes, the reset runs and the memory comes back.
    user.child.0.kill().unwrap();
    user.child.0.wait().unwrap();
    let out = Vg::new(&world, Path_::Nvml)
        .args(reclaim(&["--reset=auto", "--json"]))
        .json(0);
    let r = &out["resets"][0];
    assert_eq!(r["attempted"], json!(true), "{r:#}");
    assert!(
        r["result"].as_str().unwrap().contains("back to baseline"),
        "{r:#}"
    );
    assert_eq!(r["used_after"], json!(0));
    let events: Vec<String> = audit_lines(&audit)
        .iter()
        .map(|l| l["event"].as_str().unwrap().to_string())
        .collect();
    assert!(
        events.contains(&"reset_refused".to_string()) && events.contains(&"reset_done".to_string()),
        "{events:?}"
    );
}

/// A process whose GPU device file is held only by a thread with an fd table of its own
/// (`unshare(CLONE_FILES)`) blocks a reset like any holder: the look a reset is decided on
/// reads such tables (red team: it did not, and a reset command that does not refuse an
/// in-use GPU as the driver's does would have been run under it).
#[test]
fn a_device_file_held_in_a_threads_own_fd_table_blocks_a_reset() {
    let world = World::new(1);
    let mut bench = spec(
        &world,
        json!([{ "gpu": 0, "bytes": 6 * GIB, "after_exit": "leak" }]),
    );
    bench["new_session"] = json!(true);
    let mut b = start(&world, &["python3", "bench.py"], bench);
    b.crash();
    let hidden = vramguard_testkit::thread_table_holder(&world.dev("nvidia0"));
    let ran = world.dir.path().join("reset-ran");
    let out = Vg::new(&world, Path_::Nvml)
        .args([
            "reclaim",
            "--yes",
            "--reset=auto",
            "--json",
            "--reset-command",
        ])
        .args([format!("touch {}", ran.display())])
        .arg_path("--audit-log", &world.dir.path().join("audit.jsonl"))
        .json(1);
    let r = &out["resets"][0];
    assert_eq!(r["attempted"], json!(false), "{r:#}");
    assert!(
        r["blockers"]
            .to_string()
            .contains(&format!("{} (", hidden.0.id())),
        "{r:#}"
    );
    assert!(!ran.exists(), "the reset command ran under the holder");
    // The simulated driver refuses it too, as a real one does (it sees every open file).
    let out = Vg::new(&world, Path_::Nvml)
        .args(["sim", "reset", "--gpu", "0"])
        .output()
        .0;
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("in use by pid {}", hidden.0.id())),
        "{}",
        stderr(&out)
    );
}

/// A reset runs as a process of its own (`nvidia-smi --gpu-reset`), which a real driver
/// refuses while any other process holds the GPU: vramguard's own NVML handles included
/// (driver 580's NVML holds the control, unified-memory and GPU files, modelled by
/// `nvml_client_files`). vramguard lets go of the driver before the reset, and reads the
/// memory after it through a handle opened again, through NVML and in-process alike.
#[test]
fn a_reset_lets_go_of_vramguards_own_nvml_handles_first() {
    for path in [Path_::Nvml, Path_::InProcess] {
        let world = residue_world_580();
        let out = Vg::new(&world, path)
            .args(["reclaim", "--yes", "--reset=auto", "--json"])
            .json(0);
        let r = &out["resets"][0];
        assert_eq!(r["attempted"], json!(true), "{path:?}: {r:#}");
        assert!(
            r["result"].as_str().unwrap().contains("back to baseline"),
            "{path:?}: {r:#}"
        );
        assert_eq!(r["used_after"], json!(0), "{path:?}: {r:#}");
    }
}

#[test]
fn a_process_ignoring_sigterm_is_killed_after_the_grace_period() {
    let world = World::new(1);
    let job = crashed_job(&world, json!("release"), true);
    let audit = world.dir.path().join("audit.jsonl");
    let out = Vg::new(&world, Path_::InProcess)
        .args([
            "reclaim".as_ref(),
            "--yes".as_ref(),
            "--grace".as_ref(),
            "500ms".as_ref(),
            "--json".as_ref(),
            "--audit-log".as_ref(),
            audit.as_os_str(),
        ])
        .json(0);
    for t in out["targets"].as_array().unwrap() {
        assert_eq!(t["signals"], json!(["TERM", "KILL"]), "{t:#}");
        assert_eq!(t["result"], "exited_after_kill");
        assert!(t["exited_after_ms"].as_u64().unwrap() >= 500);
    }
    for w in &job.workers {
        assert!(!alive(*w));
    }
}

/// Issue 29: `reclaim` never read `[reclaim]`: an admin's `grace = "30s"` or `audit_log =
/// ...` in the config gave 10 s and /var/log/vramguard/audit.jsonl. The config's values are
/// now the flags' defaults (and `--help` says so); a flag given still wins.
#[test]
fn the_config_files_reclaim_section_sets_what_reclaim_does() {
    let world = World::new(1);
    let job = crashed_job(&world, json!("release"), true);
    let audit = world.dir.path().join("from-config.jsonl");
    let cfg = config(
        &world,
        &format!(
            "[reclaim]\ngrace = \"1500ms\"\naudit_log = \"{}\"\n",
            audit.display()
        ),
    );
    let help = stdout(
        &Vg::new(&world, Path_::InProcess)
            .arg_path("--config", &cfg)
            .args(["reclaim", "--help"])
            .code(0),
    );
    assert!(
        squash(&help).contains("[default: 1500ms, from [reclaim] grace in"),
        "{help}"
    );
    let out = Vg::new(&world, Path_::InProcess)
        .arg_path("--config", &cfg)
        .args(["reclaim", "--yes", "--json"])
        .json(0);
    let targets = out["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 3, "{out:#}");
    for t in targets {
        assert_eq!(t["signals"], json!(["TERM", "KILL"]), "{t:#}");
        let after = t["exited_after_ms"].as_u64().unwrap();
        assert!(
            after >= 1500,
            "SIGKILL after the config's grace: {after} ms"
        );
    }
    for w in &job.workers {
        assert!(!alive(*w));
    }
    let events: Vec<Value> = audit_lines(&audit);
    assert!(
        events.iter().any(|l| l["event"] == "signal"),
        "the config's audit log was written: {events:?}"
    );
    // A flag given wins over the config.
    let job = crashed_job(&world, json!("release"), true);
    let flagged = world.dir.path().join("from-flag.jsonl");
    let out = Vg::new(&world, Path_::InProcess)
        .arg_path("--config", &cfg)
        .args(["reclaim", "--yes", "--json", "--grace", "200ms"])
        .arg_path("--audit-log", &flagged)
        .json(0);
    for t in out["targets"].as_array().unwrap() {
        let after = t["exited_after_ms"].as_u64().unwrap();
        assert!(after < 1500, "the flag's grace: {after} ms");
    }
    assert!(!audit_lines(&flagged).is_empty());
    drop(job);
}

/// `vramguard config show`: each setting once, its effective value and where it came from.
#[test]
fn config_show_names_the_source_of_every_value() {
    let world = World::new(1);
    let cfg = config(&world, "[reclaim]\ngrace = \"30s\"\n");
    let text = stdout(
        &Vg::new(&world, Path_::InProcess)
            .arg_path("--config", &cfg)
            .args(["config", "show"])
            .code(0),
    );
    let line = |key: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("{key} = ")))
            .unwrap_or_else(|| panic!("{key} missing:\n{text}"))
            .to_string()
    };
    assert!(
        line("grace").contains("\"30s\"") && line("grace").contains(&cfg.display().to_string())
    );
    assert!(line("release_timeout").ends_with("# default"), "{text}");
    let json = Vg::new(&world, Path_::InProcess)
        .arg_path("--config", &cfg)
        .args(["config", "show", "--json"])
        .json(0);
    let grace = json
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["key"] == "reclaim.grace")
        .unwrap()
        .clone();
    assert_eq!(grace["source"]["kind"], "file", "{grace:#}");
    // No file: every value is the default.
    let text = stdout(
        &Vg::new(&world, Path_::InProcess)
            .args(["config", "show"])
            .code(0),
    );
    assert!(text.starts_with("# no config file"), "{text}");
    assert!(!text.contains(".toml\n"), "{text}");
}

/// The write-ahead log, observed in the real binary's system calls (`strace`): before every
/// SIGTERM and SIGKILL it sends, its record was written to the audit log and `fdatasync`ed,
/// and nothing was written to the log after that sync.
#[test]
fn every_signal_follows_its_record_written_and_fsynced() {
    let world = World::new(1);
    let job = crashed_job(&world, json!("release"), true);
    let audit = world.dir.path().join("audit.jsonl");
    let trace = world.dir.path().join("strace.out");
    let vg = Vg::new(&world, Path_::InProcess)
        .args([
            "reclaim".as_ref(),
            "--yes".as_ref(),
            "--grace".as_ref(),
            "300ms".as_ref(),
            "--json".as_ref(),
            "--audit-log".as_ref(),
            audit.as_os_str(),
        ])
        .command();
    let mut cmd = std::process::Command::new("strace");
    cmd.args(["-f", "-qq", "-y", "-o"])
        .arg(&trace)
        .args([
            "-e",
            "trace=write,writev,pwrite64,pwritev,fsync,fdatasync,sync_file_range,\
             pidfd_send_signal,kill,tgkill",
            "--",
        ])
        .arg(vg.get_program())
        .args(vg.get_args());
    for (k, v) in vg.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let out = cmd.output().unwrap_or_else(|e| {
        panic!(
            "strace could not be run ({e}); scripts/test.sh installs it (apt-get install strace)"
        )
    });
    let trace = std::fs::read_to_string(&trace).unwrap_or_default();
    assert_eq!(
        out.status.code(),
        Some(0),
        "vramguard under strace: {}\n--- stdout\n{}\n--- stderr\n{}\n--- trace\n{trace}",
        out.status,
        stdout(&out),
        stderr(&out)
    );
    let log = format!("<{}>", audit.display());
    // Per signal: the audit log's calls since the previous signal, in order.
    let (mut since, mut signals) = (Vec::<&str>::new(), Vec::<&str>::new());
    for line in trace.lines() {
        let call = line
            .split_once(' ')
            .map_or(line, |(_, rest)| rest.trim_start());
        let name = call.split('(').next().unwrap_or("");
        if matches!(name, "pidfd_send_signal" | "kill" | "tgkill")
            && (call.contains("SIGTERM") || call.contains("SIGKILL"))
        {
            let sig = if call.contains("SIGTERM") {
                "TERM"
            } else {
                "KILL"
            };
            assert!(
                since.iter().any(|c| c.starts_with("write")),
                "SIG{sig} sent with no record written to the audit log before it: {call}\n--- trace\n{trace}"
            );
            assert!(
                since
                    .last()
                    .is_some_and(|c| *c == "fdatasync" || *c == "fsync"),
                "SIG{sig} sent after its record was written but before it was synced \
                 (audit log calls since the previous signal: {since:?}): {call}\n--- trace\n{trace}"
            );
            signals.push(sig);
            since.clear();
        } else if call.contains(&log) {
            since.push(name);
        }
    }
    assert_eq!(
        signals.iter().filter(|s| **s == "TERM").count(),
        job.workers.len(),
        "one SIGTERM per worker, seen by strace: {signals:?}\n--- trace\n{trace}"
    );
    assert_eq!(
        signals.iter().filter(|s| **s == "KILL").count(),
        job.workers.len(),
        "the workers ignore SIGTERM: one SIGKILL each, seen by strace: {signals:?}"
    );
    for w in &job.workers {
        assert!(!alive(*w));
    }
}

#[test]
fn sigkill_in_the_middle_of_a_reclaim_leaves_a_whole_audit_log() {
    let world = World::new(1);
    let job = crashed_job(&world, json!("release"), true);
    let audit = world.dir.path().join("audit.jsonl");
    let mut reclaim = Reaped(
        vg_command()
            .env_remove("VRAMGUARD_SIM")
            .args(["--sim".as_ref(), world.state_path().as_os_str()])
            .args([
                "reclaim".as_ref(),
                "--yes".as_ref(),
                "--grace".as_ref(),
                "30s".as_ref(),
                "--audit-log".as_ref(),
                audit.as_os_str(),
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Killed while it waits out the grace period.
    wait_until(20, "the SIGTERMs to be recorded", || {
        std::fs::read_to_string(&audit)
            .is_ok_and(|t| t.matches("\"event\":\"signal\"").count() == 3)
    });
    reclaim.0.kill().unwrap();
    reclaim.0.wait().unwrap();
    let lines = audit_lines(&audit);
    assert!(lines.iter().all(|l| l["run_id"] == lines[0]["run_id"]));
    assert_eq!(lines.last().unwrap()["event"], "signal");
    assert!(
        job.workers.iter().all(|w| alive(*w)),
        "they ignore SIGTERM, and the KILL never came"
    );
    drop(job);
}

#[test]
fn without_a_terminal_and_without_yes_it_only_plans() {
    let world = World::new(1);
    let job = crashed_job(&world, json!("release"), false);
    let audit = world.dir.path().join("audit.jsonl");
    let out = Vg::new(&world, Path_::Nvml)
        .args([
            "reclaim".as_ref(),
            "--audit-log".as_ref(),
            audit.as_os_str(),
        ])
        .code(0);
    let text = stdout(&out);
    assert!(text.contains("dry run: nothing was signalled"), "{text}");
    for w in &job.workers {
        assert!(text.contains(&format!("pid {w}")), "{text}");
        assert!(alive(*w));
    }
    assert!(!audit.exists(), "a dry run writes no audit record");
    let plan = Vg::new(&world, Path_::Nvml)
        .args(["reclaim", "--dry-run", "--json"])
        .json(0);
    assert_eq!(plan["dry_run"], json!(true));
    assert_eq!(
        plan["plan"]["jobs"][0]["targets"].as_array().unwrap().len(),
        3
    );
}

#[test]
fn without_root_other_users_orphans_are_left_alone_and_it_says_why() {
    let world = World::new(1);
    let job = crashed_job_open_to_everyone(&world);
    let audit = world.dir.path().join("audit.jsonl");
    let out = vg_wrapped("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            BIN,
            "--sim",
        ])
        .arg(world.state_path())
        .args([
            "reclaim".as_ref(),
            "--yes".as_ref(),
            "--json".as_ref(),
            "--audit-log".as_ref(),
            audit.as_os_str(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let o: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        o["plan"]["left_alone"].to_string().contains("only root"),
        "{o:#}"
    );
    for w in &job.workers {
        assert!(alive(*w));
    }
}

/// `vramguard ARGS` as uid 65534 with these capabilities (ambient, so they survive the exec;
/// e.g. "+sys_ptrace,+dac_read_search").
fn as_nobody_with_caps(
    world: &World,
    caps: &str,
    args: &[&std::ffi::OsStr],
) -> std::process::Output {
    vg_wrapped("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(format!("--inh-caps={caps}"))
        .arg(format!("--ambient-caps={caps}"))
        .args([BIN, "--sim"])
        .arg(world.state_path())
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

#[test]
fn a_user_with_the_reading_capabilities_sees_what_root_sees_but_signals_nothing_of_others() {
    let world = World::new(1);
    let job = crashed_job_open_to_everyone(&world);
    let caps = "+sys_ptrace,+dac_read_search";
    let out = as_nobody_with_caps(&world, caps, &["diagnose".as_ref(), "--json".as_ref()]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let d: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(d["report"]["limitations"], json!([]), "{d:#}");
    let visibility = d["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "visibility")
        .unwrap();
    assert_eq!(visibility["status"], "pass", "{visibility:#}");
    // The hidden worker is found through root's open files, as root finds it.
    assert_eq!(holder(&d, 0, job.workers[2])["class"], "hidden");
    let out = as_nobody_with_caps(
        &world,
        caps,
        &["reclaim".as_ref(), "--dry-run".as_ref(), "--json".as_ref()],
    );
    let plan: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        plan["plan"]["left_alone"]
            .to_string()
            .contains("only root (or CAP_KILL)"),
        "{plan:#}"
    );
    assert!(
        plan["plan"]["jobs"].as_array().is_none_or(|j| j.is_empty()),
        "{plan:#}"
    );
}

#[test]
fn a_user_with_cap_sys_admin_alone_sees_and_may_do_what_a_plain_user_does() {
    let world = World::new(1);
    let job = crashed_job_open_to_everyone(&world);
    let out = as_nobody_with_caps(
        &world,
        "+sys_admin",
        &["reclaim".as_ref(), "--dry-run".as_ref(), "--json".as_ref()],
    );
    let plan: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(&out)));
    assert!(
        plan["plan"]["left_alone"].to_string().contains("only root"),
        "{plan:#}"
    );
    let out = as_nobody_with_caps(
        &world,
        "+sys_admin",
        &["status".as_ref(), "--json".as_ref()],
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        report["limitations"].to_string().contains("CAP_SYS_PTRACE"),
        "{report:#}"
    );
    // The unlisted worker is found only through root's open files.
    let holders = report["gpus"][0]["holders"].to_string();
    assert!(
        !holders.contains(&format!("\"pid\":{}", job.workers[2])),
        "{holders}"
    );
}

#[test]
fn a_user_with_cap_kill_and_the_reading_capabilities_reclaims_as_root_does() {
    let world = World::new(1);
    let job = crashed_job_open_to_everyone(&world);
    // The audit log in a folder of its own that only uid 65534 may write.
    let logs = world.dir.path().join("nobody-logs");
    std::fs::create_dir(&logs).unwrap();
    std::os::unix::fs::chown(&logs, Some(65534), Some(65534)).unwrap();
    let audit = logs.join("audit.jsonl");
    let out = as_nobody_with_caps(
        &world,
        "+kill,+sys_ptrace,+dac_read_search",
        &[
            "reclaim".as_ref(),
            "--yes".as_ref(),
            "--json".as_ref(),
            "--grace".as_ref(),
            "2s".as_ref(),
            "--audit-log".as_ref(),
            audit.as_os_str(),
        ],
    );
    let o: Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", stderr(&out)));
    assert_eq!(out.status.code(), Some(0), "{o:#}\n{}", stderr(&out));
    for w in &job.workers {
        wait_until(10, &format!("worker {w} to be gone"), || !alive(*w));
    }
    assert!(audit_lines(&audit).iter().any(|r| r["event"] == "signal"));
}

#[test]
fn never_reclaimable_classes_are_refused_up_front() {
    let world = World::new(1);
    let err = stderr(
        &Vg::new(&world, Path_::InProcess)
            .args(["reclaim", "--include", "orphan,active", "--dry-run"])
            .code(2),
    );
    assert!(
        err.contains("'active'")
            && err.contains("never reclaimed")
            && err.contains(
                "(--include takes: idle, orphan, detached, zombie, hidden, shm, keepers)"
            ),
        "{err}"
    );
    // An unknown word gets the same list of what is taken.
    let err = stderr(
        &Vg::new(&world, Path_::InProcess)
            .args(["reclaim", "--include", "orphans", "--dry-run"])
            .code(2),
    );
    assert!(
        err.contains("unknown value \"orphans\"")
            && err.contains(
                "(--include takes: idle, orphan, detached, zombie, hidden, shm, keepers)"
            ),
        "{err}"
    );
    let err = stderr(
        &Vg::new(&world, Path_::InProcess)
            .args(["reclaim", "--gpu", "7", "--dry-run"])
            .code(2),
    );
    assert!(err.contains("--gpu 7: no such GPU or MIG device"), "{err}");
    let job = crashed_job(&world, json!("release"), false);
    let err = stderr(
        &Vg::new(&world, Path_::InProcess)
            .args(["reclaim", "--yes", "--audit-log", "/proc/nope/audit.jsonl"])
            .code(2),
    );
    assert!(
        err.contains("audit log /proc/nope/audit.jsonl") && err.contains("without an audit trail"),
        "{err}"
    );
    assert!(
        job.workers.iter().all(|w| alive(*w)),
        "nothing is signalled without an audit trail"
    );
}

// ---- issue 30: live feedback and a safe Ctrl-C ----

/// Issue 30: after `y`, the grace period passed in silence and everything came at once. Piped,
/// each target's state is one plain line as it changes (SIGTERM sent, still alive at the end
/// of the grace period, SIGKILL sent, exited), in that order, and no countdown is redrawn.
#[test]
fn a_piped_reclaim_says_each_targets_state_as_it_changes() {
    let world = World::new(1);
    let job = crashed_job(&world, json!("release"), true);
    let audit = world.dir.path().join("audit.jsonl");
    let out = Vg::new(&world, Path_::InProcess)
        .args(["reclaim", "--yes", "--grace", "2s"])
        .arg_path("--audit-log", &audit)
        .code(0);
    let text = stdout(&out);
    assert!(
        !text.contains('\r') && !text.contains('\x1b'),
        "no redraws when piped:\n{text:?}"
    );
    assert!(!text.contains("Ctrl-C: finish"), "no countdown:\n{text}");
    for w in &job.workers {
        let who = format!("pid {w} (");
        let at = |what: &str| {
            let lines: Vec<usize> = text
                .lines()
                .enumerate()
                .filter(|(_, l)| l.contains(&who) && l.contains(what))
                .map(|(i, _)| i)
                .collect();
            assert_eq!(lines.len(), 1, "one {what:?} line for {w}:\n{text}");
            lines[0]
        };
        let term = at("SIGTERM sent to");
        let still = at("still alive after the 2.0s grace period: sending SIGKILL");
        let kill = at("SIGKILL sent to");
        let exited = at("after SIGTERM (after SIGKILL)");
        assert!(
            term < still && still < kill && kill < exited,
            "order for {w}: {term} {still} {kill} {exited}\n{text}"
        );
        assert!(!alive(*w));
    }
}

/// `vramguard reclaim --yes ARGS` on a real terminal (its own session, the pty as controlling
/// terminal: Ctrl-C written to the master is a SIGINT to it, as from a keyboard).
fn reclaim_on_a_terminal(
    world: &World,
    audit: &Path,
    args: &[&str],
) -> (Reaped, std::fs::File, pty::Collected) {
    let (master, slave) = pty::pair(40, 160).unwrap();
    let mut cmd = Vg::new(world, Path_::InProcess)
        .args(["reclaim", "--yes"])
        .args(args)
        .arg_path("--audit-log", audit)
        .command();
    let child = Reaped(pty::spawn_on(&mut cmd, &slave).unwrap());
    drop(slave);
    let screen = pty::Collected::start(&master).unwrap();
    (child, std::fs::File::from(master), screen)
}

/// The terminal's text without escape sequences.
fn plain(screen: &pty::Collected) -> String {
    let mut out = String::new();
    let mut esc = false;
    for c in screen.text().chars() {
        if esc {
            esc = !c.is_ascii_alphabetic();
        } else if c == '\x1b' {
            esc = true;
        } else if c != '\r' {
            out.push(c);
        }
    }
    out
}

fn wait_for_text(screen: &pty::Collected, what: &str, secs: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !plain(screen).contains(what) {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what:?}; the terminal got:\n{}",
            plain(screen)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn exit_code_within(child: &mut Reaped, secs: u64, screen: &pty::Collected) -> i32 {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            return status.code().expect("exited, not killed by a signal");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "vramguard still running after {secs}s; the terminal got:\n{}",
            plain(screen)
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Waits until every target has been sent SIGTERM and the countdown is on the terminal.
fn wait_for_the_grace_period(screen: &pty::Collected, job: &Holding) {
    for w in &job.workers {
        wait_for_text(screen, &format!("SIGTERM sent to pid {w} ("), 60);
    }
    wait_for_text(screen, "Ctrl-C: finish and stop", 30);
}

/// Issue 30: Ctrl-C during the grace period killed vramguard at once, left the targets that
/// ignore SIGTERM alive and the audit log ending at a `signal TERM` record. Now the first
/// Ctrl-C finishes the decision: it says so, the targets get SIGKILL when the grace period
/// ends (not before), the log ends with a `result` record, and the exit code is 130.
#[test]
fn the_first_ctrl_c_during_grace_finishes_the_decision_and_logs_the_result() {
    let world = World::new(1);
    let job = crashed_job(&world, json!("release"), true);
    let audit = world.dir.path().join("audit.jsonl");
    let (mut child, mut master, screen) = reclaim_on_a_terminal(&world, &audit, &["--grace", "5s"]);
    wait_for_the_grace_period(&screen, &job);
    std::io::Write::write_all(&mut master, b"\x03").unwrap();
    wait_for_text(&screen, "interrupted: finishing what was started", 10);
    assert_eq!(exit_code_within(&mut child, 60, &screen), 130);
    let text = plain(&screen);
    assert!(text.contains("will get SIGKILL in"), "{text}");
    for w in &job.workers {
        wait_until(10, "the SIGKILLed targets to be gone", || !alive(*w));
    }
    let lines = audit_lines(&audit);
    let last = lines.last().unwrap();
    assert_eq!(last["event"], "result", "{lines:#?}");
    assert_eq!(last["interrupted"], json!(true));
    assert!(lines.iter().any(|l| l["event"] == "interrupt"));
    for w in &job.workers {
        let exit = lines
            .iter()
            .find(|l| l["event"] == "exited" && l["pid"] == json!(w))
            .unwrap_or_else(|| panic!("no exit recorded for {w}: {lines:#?}"));
        assert_eq!(exit["signal"], "KILL", "{exit}");
        let after = exit["after_ms"].as_u64().unwrap();
        assert!(
            after >= 5000,
            "SIGKILL at the end of grace, not before: {after} ms"
        );
    }
}

/// Issue 30: a second Ctrl-C stops at once: the audit log's last record is `interrupted` and
/// names the targets still alive, and the message says exactly which and how to finish.
#[test]
fn a_second_ctrl_c_stops_at_once_and_names_the_pids_left_alive() {
    let world = World::new(1);
    let job = crashed_job(&world, json!("release"), true);
    let audit = world.dir.path().join("audit.jsonl");
    let (mut child, mut master, screen) =
        reclaim_on_a_terminal(&world, &audit, &["--grace", "120s"]);
    wait_for_the_grace_period(&screen, &job);
    std::io::Write::write_all(&mut master, b"\x03").unwrap();
    wait_for_text(&screen, "Ctrl-C again to stop at once", 10);
    std::io::Write::write_all(&mut master, b"\x03").unwrap();
    assert_eq!(exit_code_within(&mut child, 30, &screen), 130);
    let text = plain(&screen);
    let mut pids = job.workers.clone();
    pids.sort();
    let kill: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
    assert!(
        text.contains(&format!("`kill -KILL {}`", kill.join(" "))),
        "{text}"
    );
    assert!(text.contains("still alive: "), "{text}");
    for w in &job.workers {
        assert!(alive(*w), "a second Ctrl-C sends nothing more");
    }
    let lines = audit_lines(&audit);
    let last = lines.last().unwrap();
    assert_eq!(last["event"], "interrupted", "{lines:#?}");
    let mut named: Vec<u32> = last["alive"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["pid"].as_u64().unwrap() as u32)
        .collect();
    named.sort();
    assert_eq!(named, pids);
    assert!(
        !lines
            .iter()
            .any(|l| l["event"] == "signal" && l["signal"] == "KILL")
    );
}

/// A confirmation that came late confirmed a plan whose targets may work by now: the plan is
/// made again from a new look at the node, and a target that began to work is left alone,
/// named with its reason, while the others are reclaimed. (The prompt on a real terminal,
/// answered after the 10 s a plan stays fresh.)
#[test]
fn a_plan_confirmed_late_is_made_again_and_spares_a_target_that_began_to_work() {
    let world = World::new(1);
    let job = crashed_job(&world, json!("release"), false);
    let audit = world.dir.path().join("audit.jsonl");
    let (master, slave) = pty::pair(40, 160).unwrap();
    let mut cmd = Vg::new(&world, Path_::InProcess)
        .args(["reclaim", "--grace", "2s"])
        .arg_path("--audit-log", &audit)
        .command();
    let mut child = Reaped(pty::spawn_on(&mut cmd, &slave).unwrap());
    drop(slave);
    let screen = pty::Collected::start(&master).unwrap();
    let mut master = std::fs::File::from(master);
    wait_for_text(&screen, "[y/N]", 60);
    let plan = plain(&screen);
    for w in &job.workers {
        assert!(
            plan.contains(&format!("{w}")),
            "every worker planned:\n{plan}"
        );
    }
    // While the question waits, one worker starts computing on the GPU.
    let working = job.workers[0];
    world.update(|s| {
        for a in s.allocations.iter_mut().filter(|a| a.pid == working) {
            a.sm_util = 80;
        }
    });
    std::thread::sleep(
        vramguard_ops::reclaim::PLAN_FRESH_FOR + std::time::Duration::from_millis(500),
    );
    std::io::Write::write_all(&mut master, b"y\n").unwrap();
    assert_eq!(exit_code_within(&mut child, 60, &screen), 0);
    let text = plain(&screen);
    assert!(
        text.contains(&format!("pid {working} left alone:")),
        "the working target is named:\n{text}"
    );
    assert!(alive(working), "a target that works was signalled:\n{text}");
    for w in &job.workers[1..] {
        wait_until(10, "the idle targets to be reclaimed", || !alive(*w));
    }
    let lines = audit_lines(&audit);
    assert!(
        !lines
            .iter()
            .any(|l| l["event"] == "signal" && l["pid"] == json!(working)),
        "{lines:#?}"
    );
}

#[test]
fn an_orphan_on_a_gpu_whose_process_list_fails_is_left_alone_and_it_says_why() {
    // A dead job's worker on GPU 1. While GPU 1's compute list reads, the worker is an idle
    // orphan and a target; when the list fails, nobody can see whether it computes there.
    let world = World::new(2);
    let mut trainer = spec(&world, json!([hold(1, 2)]));
    trainer["group_leader"] = json!(true);
    trainer["workers"] = json!([{ "argv": ["python3", "w.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000, "holds": [hold(1, 1)] } }]);
    let mut t = start(&world, &["python3", "train.py"], trainer);
    t.crash();
    let worker = t.workers[0];
    let targets = |plan: &Value| -> Vec<u64> {
        plan["plan"]["jobs"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|j| j["targets"].as_array().cloned().unwrap_or_default())
            .filter_map(|t| t["pid"].as_u64())
            .collect()
    };
    let plan = Vg::new(&world, Path_::Nvml)
        .args(["reclaim", "--dry-run", "--json"])
        .json(0);
    assert_eq!(targets(&plan), vec![u64::from(worker)], "{plan:#}");
    world.update(|s| {
        s.gpus[1]
            .faults
            .push(fault("nvmlDeviceGetComputeRunningProcesses_v3", 999, None))
    });
    for path in [Path_::Nvml, Path_::InProcess] {
        let (out, shown) = Vg::new(&world, path)
            .args(["reclaim", "--yes", "--json"])
            .output();
        let o: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("$ {shown}: {e}\n{}", stderr(&out)));
        assert!(targets(&o).is_empty(), "{o:#}");
        let left = o["plan"]["left_alone"].to_string();
        assert!(
            left.contains(&format!("\"pid\":{worker}")) && left.contains("could not be read"),
            "{o:#}"
        );
        assert!(alive(worker), "the worker was signalled");
    }
}

/// An NVML client (a monitor, an exporter) left behind by a dead job holds no GPU memory:
/// `reclaim --yes` never signals it, not even with the classes diagnose names, while the dead
/// job's idle CUDA worker beside it goes. Before driver 580 the client holds the GPU's device
/// file without `/dev/nvidia-uvm`.
#[test]
fn an_nvml_client_of_a_dead_job_is_never_signalled() {
    nvml_client_of_a_dead_job_is_left_alone(false, "no /dev/nvidia-uvm");
}

/// The same on driver 580, whose NVML clients hold `/dev/nvidia-uvm` too (as an H200 showed):
/// the client maps libnvidia-ml and no libcuda, the worker maps libcuda.
#[test]
fn an_nvml_client_holding_uvm_as_on_driver_580_is_never_signalled() {
    nvml_client_of_a_dead_job_is_left_alone(true, "maps libnvidia-ml and no CUDA driver library");
}

fn nvml_client_of_a_dead_job_is_left_alone(driver_580: bool, why: &str) {
    let world = World::new(1);
    world.update(|s| s.nvml_client_files = driver_580);
    let mut trainer = spec(&world, json!([hold(0, 2)]));
    trainer["group_leader"] = json!(true);
    trainer["workers"] = json!([
        { "argv": ["python3", "gpu_exporter.py"], "spec": {
            "state": world.state_path(), "lifetime_ms": 120_000, "open_gpus": [0] } },
        { "argv": ["python3", "w.py"], "spec": {
            "state": world.state_path(), "lifetime_ms": 120_000, "holds": [hold(0, 1)] } },
    ]);
    let mut t = start(&world, &["python3", "train.py"], trainer);
    t.crash();
    let (monitor, worker) = (t.workers[0], t.workers[1]);
    let (out, shown) = Vg::new(&world, Path_::Nvml)
        .args([
            "reclaim",
            "--yes",
            "--json",
            "--include",
            "orphan,zombie,hidden",
        ])
        .output();
    let o: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("$ {shown}: {e}\n{}", stderr(&out)));
    let left = o["plan"]["left_alone"].to_string();
    assert!(
        left.contains(&format!("\"pid\":{monitor}")) && left.contains(why),
        "{o:#}"
    );
    let uvm = std::fs::read_dir(format!("/proc/{monitor}/fd"))
        .unwrap()
        .flatten()
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == world.dev("nvidia-uvm")));
    assert_eq!(
        uvm, driver_580,
        "the client holds /dev/nvidia-uvm only as on driver 580"
    );
    assert!(alive(monitor), "the NVML client was signalled: {o:#}");
    wait_until(10, "the dead job's CUDA worker to be reclaimed", || {
        !alive(worker)
    });
}
