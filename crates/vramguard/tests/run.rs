//! `vramguard run`: the supervisor's guarantees, each checked with real processes, in both
//! containment modes (a cgroup v2 leaf, and a process group with vramguard as subreaper).
//!
//! "Nothing left behind" is checked by a marker in the job's environment: after `run`
//! returns, no process on the host may carry it (a fork loop cannot be listed by pid).

mod common;
use common::*;
use serde_json::Value;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn marker() -> String {
    format!(
        "VG_TEST_MARK={}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

/// Pids of processes whose environment carries `mark`.
fn marked(mark: &str) -> Vec<u32> {
    let needle = mark.as_bytes();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let env = std::fs::read(e.path().join("environ")).ok()?;
            env.split(|b| *b == 0).any(|v| v == needle).then_some(pid)
        })
        .filter(|p| alive(*p))
        .collect()
}

/// Kills whatever still carries the mark (a failed test must not leave processes behind).
struct Sweep(String);
impl Drop for Sweep {
    fn drop(&mut self) {
        for _ in 0..20 {
            let left = marked(&self.0);
            if left.is_empty() {
                return;
            }
            for p in left {
                let _ = Command::new("kill")
                    .args(["-KILL", &p.to_string()])
                    .status();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn run_job(isolation: &str, script: &str, mark: &str) -> Output {
    run_job_with_grace(isolation, script, mark, "500ms")
}

fn run_job_with_grace(isolation: &str, script: &str, mark: &str, grace: &str) -> Output {
    let (k, v) = mark.split_once('=').unwrap();
    vg_command()
        .args([
            "run",
            "--grace",
            grace,
            "--isolation",
            isolation,
            "--",
            "sh",
            "-c",
            script,
        ])
        .env(k, v)
        .env("NO_COLOR", "1")
        .env_remove("VRAMGUARD_SIM")
        .output()
        .unwrap()
}

/// Job shapes that leave processes behind: (what, script, escapers at least). Each escaper
/// runs `$ESCAPE`, which ignores SIGTERM, then records its pid in `$ESCAPED` and sleeps, so the
/// test knows the shape really made it (a failing `setsid` would otherwise pass unseen) and
/// vramguard has to wait out the grace period and SIGKILL it. The job exits once its escapers
/// are recorded (`$AWAIT n`), not after a fixed time a loaded machine may not give them.
const SHAPES: &[(&str, &str, usize)] = &[
    (
        "children that ignore SIGTERM",
        "sh -c \"$ESCAPE\" & sh -c \"$ESCAPE\" & sh -c \"$AWAIT\" await 2; exit 0",
        2,
    ),
    (
        "a double-forked daemonized grandchild",
        "( sh -c \"$ESCAPE\" & ) ; sh -c \"$AWAIT\" await 1; exit 0",
        1,
    ),
    (
        "a child that calls setsid",
        "setsid sh -c \"$ESCAPE\" & sh -c \"$AWAIT\" await 1; exit 0",
        1,
    ),
    (
        "a child stuck forking in a loop",
        "(trap '' TERM; while :; do ( sh -c \"$ESCAPE\" & ) ; sleep 0.01; done) & sh -c \"$AWAIT\" await 2; exit 0",
        2,
    ),
    (
        "a child that calls setpgrp (new group via setsid -f)",
        "setsid -f sh -c \"$ESCAPE\"; sh -c \"$AWAIT\" await 1; exit 0",
        1,
    ),
];

/// The trap is set before the pid is recorded: a recorded escaper ignores SIGTERM.
const ESCAPE: &str = "trap '' TERM; echo $$ >> \"$ESCAPED\"; exec sleep 60";

/// Waits until `$ESCAPED` lists `$1` escapers (10 s at most: a shape that made fewer is then
/// reported by the test, which counts them).
const AWAIT: &str = "i=0; while [ \"$(cat \"$ESCAPED\" 2>/dev/null | wc -l)\" -lt \"$1\" ] \
     && [ $i -lt 1000 ]; do sleep 0.01; i=$((i + 1)); done";

fn nothing_left_behind(isolation: &str) {
    let grace = Duration::from_millis(1500);
    for (what, script, at_least) in SHAPES {
        let dir = tempfile::tempdir().unwrap();
        let escaped = dir.path().join("escaped");
        let mark = marker();
        let _sweep = Sweep(mark.clone());
        let (k, v) = mark.split_once('=').unwrap();
        let t = Instant::now();
        let out = vg_command()
            .args(["run", "--grace", "1500ms", "--isolation", isolation])
            .args(["--", "sh", "-c", script])
            .env(k, v)
            .env("ESCAPE", ESCAPE)
            .env("AWAIT", AWAIT)
            .env("ESCAPED", &escaped)
            .env("NO_COLOR", "1")
            .env_remove("VRAMGUARD_SIM")
            .output()
            .unwrap();
        let took = t.elapsed();
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(0), "{what}: {err}");
        let pids: Vec<u32> = std::fs::read_to_string(&escaped)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        assert!(
            pids.len() >= *at_least,
            "{what} ({isolation}): the shape made {} escaper(s), meant {at_least}: {err}",
            pids.len()
        );
        let left = marked(&mark);
        assert!(
            left.is_empty(),
            "{what} ({isolation}): left {left:?} behind\n{err}"
        );
        assert!(
            pids.iter().all(|p| !alive(*p)),
            "{what} ({isolation}): an escaper is alive: {pids:?}"
        );
        // The escapers ignore SIGTERM: vramguard waits the whole grace period, then kills.
        assert!(
            took >= grace && took < grace + Duration::from_secs(4),
            "{what} ({isolation}): --grace 1.5s honoured? took {took:?}\n{err}"
        );
        assert!(
            err.contains("(SIGKILL after the grace period)"),
            "{what}: {err}"
        );
        let expected = if isolation == "cgroup" {
            "(cgroup)"
        } else {
            "(process group)"
        };
        assert!(err.contains(expected), "{what}: {err}");
    }
}

#[test]
fn a_double_forked_daemon_never_escapes_group_mode_in_50_runs() {
    // The classic daemon: the job's shell exits at once, its subshell forks the daemon and
    // exits too. A check that lists /proc once can miss the daemon while it is being handed
    // from the exiting subshell to vramguard; the kernel's children lists cannot.
    for run in 0..50 {
        let mark = marker();
        let _sweep = Sweep(mark.clone());
        let out = run_job_with_grace(
            "group",
            "( ( trap '' TERM; exec sleep 60 ) & ) ; exit 0",
            &mark,
            "100ms",
        );
        assert_eq!(out.status.code(), Some(0), "run {run}: {}", stderr(&out));
        let left = marked(&mark);
        assert!(
            left.is_empty(),
            "run {run}: left {left:?} behind\n{}",
            stderr(&out)
        );
    }
}

#[test]
fn nothing_is_left_behind_in_cgroup_mode() {
    nothing_left_behind("cgroup");
}

#[test]
fn nothing_is_left_behind_in_process_group_mode() {
    nothing_left_behind("group");
}

#[test]
fn exit_codes_pass_through() {
    for (script, code) in [
        ("exit 0", 0),
        ("exit 3", 3),
        ("kill -KILL $$", 137),
        ("kill -TERM $$", 143),
    ] {
        let mark = marker();
        let _sweep = Sweep(mark.clone());
        assert_eq!(
            run_job("auto", script, &mark).status.code(),
            Some(code),
            "{script}"
        );
    }
    let out = vg_command()
        .args(["run", "--", "/nonexistent/program"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
    assert!(
        stderr(&out).contains("cannot execute /nonexistent/program"),
        "{}",
        stderr(&out)
    );
    let dir = tempfile::tempdir().unwrap();
    let not_executable = dir.path().join("data.txt");
    std::fs::write(&not_executable, "not a program").unwrap();
    let out = vg_command()
        .arg("run")
        .arg("--")
        .arg(&not_executable)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(126), "{}", stderr(&out));
}

/// Starts `vramguard run` on a script that records the signals it receives.
fn recorder(world: &World, isolation: &str, mark: &str) -> (Reaped, std::path::PathBuf) {
    let log = world.dir.path().join(format!("signals-{isolation}"));
    let script = format!(
        "for s in HUP USR1 USR2 QUIT; do trap \"echo $s >> {log}\" $s; done; \
         trap \"echo TERM >> {log}; exit 0\" TERM; echo ready >> {log}; \
         while :; do sleep 0.05; done",
        log = log.display()
    );
    let (k, v) = mark.split_once('=').unwrap();
    let child = vg_command()
        .args([
            "run",
            "--grace",
            "2s",
            "--isolation",
            isolation,
            "--",
            "sh",
            "-c",
            &script,
        ])
        .env(k, v)
        .env_remove("VRAMGUARD_SIM")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let log2 = log.clone();
    wait_until(10, "the job to start", || {
        std::fs::read_to_string(&log2).is_ok_and(|t| t.contains("ready"))
    });
    (Reaped(child), log)
}

fn send(pid: u32, sig: &str) {
    assert!(
        Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status()
            .unwrap()
            .success()
    );
}

#[test]
fn signals_are_forwarded_to_the_job() {
    let world = World::new(1);
    for isolation in ["cgroup", "group"] {
        let mark = marker();
        let _sweep = Sweep(mark.clone());
        let (mut vg, log) = recorder(&world, isolation, &mark);
        for sig in ["HUP", "USR1", "USR2", "QUIT"] {
            send(vg.pid(), sig);
            wait_until(10, &format!("{sig} to reach the job"), || {
                std::fs::read_to_string(&log).is_ok_and(|t| t.contains(sig))
            });
        }
        send(vg.pid(), "TERM");
        let status = vg.0.wait().unwrap();
        assert_eq!(status.code(), Some(0), "the job handled TERM and exited 0");
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            text.lines().collect::<Vec<_>>(),
            vec!["ready", "HUP", "USR1", "USR2", "QUIT", "TERM"],
            "{isolation}"
        );
        assert!(marked(&mark).is_empty());
    }
}

#[test]
fn sigint_to_vramguard_ends_the_job_with_130() {
    let mark = marker();
    let _sweep = Sweep(mark.clone());
    let (k, v) = mark.split_once('=').unwrap();
    let mut vg = Reaped(
        vg_command()
            .args(["run", "--", "sleep", "60"])
            .env(k, v)
            .env_remove("VRAMGUARD_SIM")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // vramguard and its watchdog carry the mark too: wait for the job itself.
    wait_until(10, "the job to start", || marked(&mark).len() >= 3);
    send(vg.pid(), "INT");
    assert_eq!(vg.0.wait().unwrap().code(), Some(130));
    assert!(marked(&mark).is_empty());
}

#[test]
fn sigkill_of_vramguard_does_not_leave_the_job_running() {
    for isolation in ["cgroup", "group"] {
        let mark = marker();
        let _sweep = Sweep(mark.clone());
        let (k, v) = mark.split_once('=').unwrap();
        let mut vg = Reaped(
            vg_command()
                .args([
                    "run",
                    "--isolation",
                    isolation,
                    "--",
                    "sh",
                    "-c",
                    "sleep 60 & exec sleep 60",
                ])
                .env(k, v)
                .env_remove("VRAMGUARD_SIM")
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        // vramguard, its watchdog, the job and the job's child.
        wait_until(10, "the job and its child", || marked(&mark).len() >= 4);
        vg.0.kill().unwrap();
        vg.0.wait().unwrap();
        // The direct child dies by PR_SET_PDEATHSIG; the watchdog kills the rest.
        wait_until(
            10,
            &format!("the job to die with vramguard ({isolation})"),
            || marked(&mark).is_empty(),
        );
    }
}

/// The children of `pid` (from every thread's children list), with their run state.
fn children_of(pid: u32) -> Vec<(u32, char)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut kids: Vec<u32> = tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect();
    kids.sort_unstable();
    kids.dedup();
    kids.into_iter()
        .filter_map(|k| Some((k, state_of(k)?)))
        .collect()
}

/// vramguard as PID 1 of a new PID namespace (as in a container without an init): it must
/// reap the orphans that exit while the job runs, and clean up before it exits itself. When
/// PID 1 exits the kernel SIGKILLs whatever is left in the namespace, so "nothing left
/// afterwards" proves nothing: the leftover here records the SIGTERM only vramguard sends.
///
/// The job runs until the test has looked (it waits for `go`), not for a fixed time: a job
/// that slept 2 s could end, and vramguard with it, before a loaded machine let the test see
/// vramguard at all ("timed out waiting for vramguard to start as PID 1").
fn as_pid_1(isolation: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (made, cleaned, go) = (
        dir.path().join("made"),
        dir.path().join("cleaned"),
        dir.path().join("go"),
    );
    let mark = marker();
    let _sweep = Sweep(mark.clone());
    let (k, v) = mark.split_once('=').unwrap();
    // Ten orphans that exit at once (each re-parented to PID 1, a zombie until reaped), a
    // daemon that answers SIGTERM by writing a file, then the job runs on until told.
    let script = format!(
        "for i in 1 2 3 4 5 6 7 8 9 10; do ( /bin/true & ) ; done; \
         ( ( trap 'echo TERM > {cleaned}; exit 0' TERM; while :; do sleep 0.05; done ) & ) ; \
         touch {made}; while [ ! -e {go} ]; do sleep 0.02; done; exit 5",
        cleaned = cleaned.display(),
        made = made.display(),
        go = go.display(),
    );
    // Its stderr read as it comes (vramguard as PID 1 outlives a killed unshare, and keeps
    // the pipe open), so that a failure can show it without waiting for an end that may not
    // come.
    let (mut unshare, err, reader) = spawn_reading_stderr(
        vg_wrapped("unshare")
            .args([
                "--pid",
                "--fork",
                "--mount-proc",
                BIN,
                "run",
                "--grace",
                "3s",
            ])
            .args(["--isolation", isolation, "--", "sh", "-c", &script])
            .env(k, v),
    );
    let (mut vg, outer) = (0, unshare.pid());
    wait_or_show(
        &mut unshare,
        &err,
        60,
        "vramguard to start as PID 1",
        || {
            vg = children_of(outer).first().map_or(0, |c| c.0);
            vg != 0
        },
    );
    wait_or_show(
        &mut unshare,
        &err,
        60,
        "the job to make its orphans",
        || made.exists(),
    );
    // The orphans have exited: none of vramguard's children may stay a zombie.
    let mut zombies = Vec::new();
    wait_or_show(
        &mut unshare,
        &err,
        10,
        "vramguard to reap the orphans",
        || {
            zombies = children_of(vg)
                .into_iter()
                .filter(|(_, s)| *s == 'Z')
                .collect();
            zombies.is_empty()
        },
    );
    let kids = children_of(vg);
    std::fs::write(&go, "").unwrap();
    let status = unshare.0.wait().unwrap();
    // The pipe ends when PID 1 has exited and the kernel has killed the namespace.
    reader.join().unwrap();
    let err = String::from_utf8_lossy(&err.lock().unwrap()).to_string();
    assert!(
        kids.len() >= 2,
        "the job and the daemon run under vramguard: {kids:?}\n{err}"
    );
    assert_eq!(status.code(), Some(5), "{status}\n{err}");
    assert_eq!(
        std::fs::read_to_string(&cleaned).unwrap_or_default().trim(),
        "TERM",
        "the daemon got SIGTERM from vramguard before it exited ({isolation}): {err}"
    );
    assert!(marked(&mark).is_empty());
}

/// Starts `cmd` (off the simulator, stdout to nowhere) with its stderr read into a buffer as
/// it comes by a thread, joined once the child ends.
fn spawn_reading_stderr(
    cmd: &mut Command,
) -> (Reaped, Arc<Mutex<Vec<u8>>>, std::thread::JoinHandle<()>) {
    let mut child = Reaped(
        cmd.env_remove("VRAMGUARD_SIM")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let err = Arc::new(Mutex::new(Vec::new()));
    let (mut pipe, buf_err) = (child.0.stderr.take().unwrap(), err.clone());
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = std::io::Read::read(&mut pipe, &mut buf) {
            buf_err.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    (child, err, reader)
}

/// [`wait_until`] on a condition about `child`, whose stderr is read into `err`: when the
/// time is up, or the child has exited first, it fails with the child's exit status and what
/// it wrote to stderr so far (the test's sweep then ends what is left).
fn wait_or_show(
    child: &mut Reaped,
    err: &Mutex<Vec<u8>>,
    secs: u64,
    what: &str,
    mut cond: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if cond() {
            return;
        }
        let exited = child.0.try_wait().unwrap();
        if exited.is_some() || Instant::now() >= deadline {
            let why = match exited {
                Some(s) => format!("it exited first: {s}"),
                None => {
                    let _ = child.0.kill();
                    let _ = child.0.wait();
                    format!("timed out after {secs}s while it still ran (killed now)")
                }
            };
            panic!(
                "waiting for {what}: {why}\nits stderr so far:\n{}",
                String::from_utf8_lossy(&err.lock().unwrap())
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn as_pid_1_of_a_container_it_reaps_and_cleans_up() {
    as_pid_1("group");
    as_pid_1("cgroup");
}

#[test]
fn sigint_reaches_the_job_when_started_as_a_background_job() {
    // A shell without job control starts `vramguard run … &` with SIGINT and SIGQUIT
    // ignored; the job must get them back at their default, or the Ctrl-C (or the SIGINT a
    // scheduler sends) vramguard forwards would be lost, and the job would run on for the
    // whole grace period.
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let ignored = dir.path().join("sigign");
    let mark = marker();
    let _sweep = Sweep(mark.clone());
    let (k, v) = mark.split_once('=').unwrap();
    let script = format!(
        "grep ^SigIgn: /proc/self/status > {f}.tmp; mv {f}.tmp {f}; exec sleep 60",
        f = ignored.display()
    );
    let mut cmd = vg_command();
    cmd.args(["run", "--grace", "30s", "--", "sh", "-c", &script])
        .env(k, v)
        .env_remove("VRAMGUARD_SIM")
        .stderr(Stdio::null());
    // SAFETY: signal() only, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_IGN);
            libc::signal(libc::SIGQUIT, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut vg = Reaped(cmd.spawn().unwrap());
    wait_until(10, "the job to start", || ignored.exists());
    let mask = std::fs::read_to_string(&ignored).unwrap();
    let mask = u64::from_str_radix(mask.trim_start_matches("SigIgn:").trim(), 16).unwrap();
    assert_eq!(
        mask & ((1 << (libc::SIGINT - 1)) | (1 << (libc::SIGQUIT - 1))),
        0,
        "the job inherited SIGINT/SIGQUIT ignored: SigIgn {mask:x}"
    );
    wait_until(10, "the job to exec sleep", || marked(&mark).len() >= 3);
    let t = Instant::now();
    send(vg.pid(), "INT");
    assert_eq!(vg.0.wait().unwrap().code(), Some(130));
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the job ended by the forwarded SIGINT, not after the 30 s grace: {:?}",
        t.elapsed()
    );
    assert!(marked(&mark).is_empty());
}

#[test]
fn the_summary_reports_the_drivers_release_lag() {
    let world = World::new(2);
    let summary = world.dir.path().join("summary.json");
    let spec = serde_json::json!({
        "state": world.state_path(), "lifetime_ms": 1200,
        "holds": [{ "gpu": 1, "bytes": 4 * GIB, "after_exit": { "release_after_ms": 1000 } }],
    });
    let holder_env = format!("VRAMGUARD_HOLDER={spec}");
    let out = vg_command()
        .args([
            "--sim".as_ref(),
            world.state_path().as_os_str(),
            "--nvml-lib".as_ref(),
            sim_nvml_lib().as_os_str(),
        ])
        .args([
            "run".as_ref(),
            "--summary-json".as_ref(),
            summary.as_os_str(),
            "--".as_ref(),
            "env".as_ref(),
            holder_env.as_ref(),
            BIN.as_ref(),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let s: Value = serde_json::from_slice(&std::fs::read(&summary).unwrap()).unwrap();
    let g = &s["gpus"][0];
    assert_eq!(g["index"], 1);
    assert_eq!(g["peak_job_bytes"], serde_json::json!(4 * GIB));
    assert_eq!(g["released"], serde_json::json!(true));
    let ms = g["release_ms"].as_u64().unwrap();
    assert!(
        (900..=1800).contains(&ms),
        "release lag measured as {ms} ms, simulated 1000 ms"
    );
    let line = stderr(&out);
    // The lag is counted from when vramguard saw the job end, a few ms after the driver did:
    // "999ms" and "1.0s" are both right.
    assert!(
        line.contains("GPU 1: peak 4.0 GiB, released ") && line.contains(" after the job ended"),
        "{line}"
    );
}

#[test]
fn strict_mode_fails_when_the_memory_is_not_released() {
    let world = World::new(1);
    let spec = serde_json::json!({
        "state": world.state_path(), "lifetime_ms": 600,
        "holds": [{ "gpu": 0, "bytes": 4 * GIB, "after_exit": "leak" }],
    });
    let holder_env = format!("VRAMGUARD_HOLDER={spec}");
    let out = vg_command()
        .args(["--sim".as_ref(), world.state_path().as_os_str()])
        .args([
            "run",
            "--strict",
            "--release-timeout",
            "500ms",
            "--",
            "env",
            &holder_env,
            BIN,
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(125), "{}", stderr(&out));
    let line = stderr(&out);
    assert!(
        line.contains("NOT released") && line.contains("residue"),
        "{line}"
    );
}

/// Asking for more GPUs than the node has is a usage error: exit 2 at once with what to ask
/// for, not exit 1 after waiting (pick) or a job that never starts (run).
#[test]
fn asking_for_more_gpus_than_the_node_has_is_a_usage_error() {
    let world = World::new(2);
    let t = std::time::Instant::now();
    let out = Vg::new(&world, Path_::Nvml)
        .args(["pick", "3", "--wait", "30s"])
        .code(2);
    assert!(t.elapsed() < std::time::Duration::from_secs(10));
    assert!(
        stderr(&out).contains("asked for 3 GPU(s), but this node has 2"),
        "{}",
        stderr(&out)
    );
    let marker = world.dir.path().join("ran");
    let out = Vg::new(&world, Path_::Nvml)
        .args(["run", "--gpus", "auto:3", "--", "touch"])
        .args([&marker])
        .code(2);
    assert!(stderr(&out).contains("this node has 2"), "{}", stderr(&out));
    assert!(!marker.exists(), "the job never starts");
}

#[test]
fn gpus_auto_picks_the_freest_and_waits_when_none_is_free() {
    let world = World::new(4);
    let a = world.holder(&["nvidia1"], 60);
    let b = world.holder(&["nvidia2"], 60);
    world.allocate(allocation(1, a.pid(), 100 * GIB));
    world.allocate(allocation(2, b.pid(), 50 * GIB));
    let out = Vg::new(&world, Path_::Nvml).args(["pick", "2"]).code(0);
    assert_eq!(stdout(&out).trim(), "0,3");
    let out = Vg::new(&world, Path_::InProcess)
        .args(["pick", "1", "--by-uuid"])
        .code(0);
    assert!(stdout(&out).trim().starts_with("GPU-"), "{}", stdout(&out));

    let seen = world.dir.path().join("visible");
    let out = Vg::new(&world, Path_::Nvml)
        .args([
            "run".to_string(),
            "--gpus".into(),
            "auto:2".into(),
            "--".into(),
            "sh".into(),
            "-c".into(),
            format!("echo $CUDA_VISIBLE_DEVICES > {}", seen.display()),
        ])
        .code(0);
    assert_eq!(
        std::fs::read_to_string(&seen).unwrap().trim(),
        "0,3",
        "{}",
        stderr(&out)
    );

    // Every GPU busy: wait, then give up with 124 (run) or 1 (pick).
    let c = world.holder(&["nvidia0"], 60);
    let d = world.holder(&["nvidia3"], 60);
    world.allocate(allocation(0, c.pid(), 100 * GIB));
    world.allocate(allocation(3, d.pid(), 100 * GIB));
    let t = Instant::now();
    let out = Vg::new(&world, Path_::InProcess)
        .args(["pick", "1", "--min-free", "100GiB", "--wait", "1s"])
        .code(1);
    assert!(t.elapsed() >= Duration::from_millis(900));
    assert!(
        stderr(&out).contains("only 0 of 4 GPU(s) have at least 100.0 GiB free"),
        "{}",
        stderr(&out)
    );
    Vg::new(&world, Path_::InProcess)
        .args([
            "run",
            "--gpus",
            "auto:1",
            "--min-free",
            "100GiB",
            "--",
            "true",
        ])
        .code(124);

    // A GPU frees up while it waits: freed once `pick` is seen waiting (asleep between two
    // looks at the GPUs), so the waiting path is the one taken, however slow the machine.
    let mut pick = Reaped(
        Vg::new(&world, Path_::InProcess)
            .args(["pick", "1", "--min-free", "100GiB", "--wait", "60s"])
            .command()
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut answered = None;
    wait_until(30, "pick to wait for a GPU", || {
        answered = pick.0.try_wait().unwrap();
        answered.is_some() || asleep_in_nanosleep(pick.pid())
    });
    if let Some(status) = answered {
        let out = output_of(&mut pick);
        panic!(
            "pick answered ({status}) while every GPU was busy: {}{}",
            stdout(&out),
            stderr(&out)
        );
    }
    drop(d);
    let out = output_of(&mut pick);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), "3");
    drop((a, b, c));
}

/// Whether the main thread of `pid` sleeps in `nanosleep`/`clock_nanosleep` (its kernel wait
/// channel, or its current system call where the kernel hides the wait channel): `pick`'s
/// main thread sleeps there only between two looks at the GPUs.
fn asleep_in_nanosleep(pid: u32) -> bool {
    let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
    let syscall = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
    let nr: Option<libc::c_long> = syscall
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok());
    wchan.contains("nanosleep") || nr == Some(libc::SYS_clock_nanosleep)
}

/// Waits for a child started with piped stdout and stderr, and returns what it wrote.
fn output_of(child: &mut Reaped) -> Output {
    use std::io::Read;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    if let Some(mut o) = child.0.stdout.take() {
        o.read_to_end(&mut out).unwrap();
    }
    if let Some(mut e) = child.0.stderr.take() {
        e.read_to_end(&mut err).unwrap();
    }
    Output {
        status: child.0.wait().unwrap(),
        stdout: out,
        stderr: err,
    }
}

/// A signal that arrives after the main process was reaped (during the grace period) is not
/// sent to its pid, which may be another process's by then. Here the kernel gives the main
/// process's pid to a newcomer at once (`ns_last_pid` in a PID namespace of the test's own,
/// whose init is a shell, so that vramguard is an ordinary process that hears SIGUSR1; as a
/// namespace's init it would not): with `--no-signal-group`, a SIGUSR1 to vramguard once the
/// job's main process is gone reaches nobody, and the newcomer never hears it. Nor is the
/// newcomer's end taken for the main process's: `run` exits with the main process's status.
#[test]
fn a_signal_after_the_main_process_was_reaped_never_reaches_a_process_that_took_its_pid() {
    let dir = tempfile::tempdir().unwrap();
    let [ready, got, main, status] = ["ready", "got", "main", "status"].map(|f| dir.path().join(f));
    let mark = marker();
    let _sweep = Sweep(mark.clone());
    // The job's main process records its pid and exits at once (status 3). Its helper, in a
    // session of its own (a process-group member would keep the pid in use) and deaf to the
    // SIGTERM that ends the job's leftovers (so that the grace period runs), waits until
    // vramguard has reaped it, has the next pid be the main process's again, and starts a
    // newcomer that records SIGUSR1 (again until one gets that pid: vramguard's threads may
    // take pids meanwhile; one that did not get it leaves at once).
    let newcomer = format!(
        "[ $$ = $0 ] || exit 0; trap 'echo USR1 > {got}' USR1; echo $$ > {ready}.tmp; \
         mv {ready}.tmp {ready}; while :; do sleep 0.05; done",
        got = got.display(),
        ready = ready.display(),
    );
    let helper = "M=$1; while [ -e /proc/$M ]; do sleep 0.01; done; for i in $(seq 50); do \
                  echo $((M - 1)) > /proc/sys/kernel/ns_last_pid; sh -c \"$VG_TEST_NEWCOMER\" $M & \
                  [ $! = $M ] && break; done; wait";
    let script = format!(
        "trap '' TERM; echo $$ > {main}; setsid -f sh -c \"$VG_TEST_HELPER\" helper $$; exit 3",
        main = main.display(),
    );
    let (mut unshare, err, reader) = spawn_reading_stderr(
        vg_wrapped("unshare")
            .args(["--pid", "--fork", "--mount-proc", "sh", "-c"])
            .arg(
                "\"$0\" run --grace 3s --isolation group --no-signal-group -- sh -c \"$1\"; \
                 echo $? > \"$2\"",
            )
            .args([BIN, script.as_str()])
            .arg(&status)
            .env(
                mark.split_once('=').unwrap().0,
                mark.split_once('=').unwrap().1,
            )
            .env("VG_TEST_HELPER", helper)
            .env("VG_TEST_NEWCOMER", newcomer),
    );
    let (mut vg, outer) = (0, unshare.pid());
    wait_or_show(&mut unshare, &err, 60, "vramguard to start", || {
        let init = children_of(outer).first().map_or(0, |c| c.0);
        vg = children_of(init).first().map_or(0, |c| c.0);
        vg != 0
    });
    wait_or_show(&mut unshare, &err, 30, "the newcomer", || ready.exists());
    assert_eq!(
        std::fs::read_to_string(&ready).unwrap().trim(),
        std::fs::read_to_string(&main).unwrap().trim(),
        "the kernel did not give the main process's pid again"
    );
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(vg as i32).unwrap(),
        rustix::process::Signal::USR1,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        !got.exists(),
        "the process that took the reaped main process's pid got the forwarded signal"
    );
    // The grace period ends; vramguard kills the newcomer, exits with the main process's
    // status, and the namespace ends.
    let _ = unshare.0.wait();
    let _ = reader.join();
    let status = std::fs::read_to_string(&status).unwrap_or_default();
    assert_eq!(
        status.trim(),
        "3",
        "run's exit status is not its main process's:\n{}",
        String::from_utf8_lossy(&err.lock().unwrap())
    );
}

/// The watchdog (what kills the job when vramguard itself is SIGKILLed) signals the job's
/// process group only while its pid is not another process's: a pid the kernel freed once the
/// group emptied may lead someone else's group by then.
#[test]
fn the_watchdog_spares_a_group_whose_leaders_pid_another_process_took() {
    use std::os::unix::process::CommandExt;
    let group_leader = || {
        Reaped(
            Command::new("sleep")
                .arg("60")
                .process_group(0)
                .spawn()
                .unwrap(),
        )
    };
    // Runs the watchdog for `pgid`, whose leader began at `start`, and ends its parent.
    let watchdog_fires = |pgid: u32, start: u64| {
        let mut parent = Reaped(Command::new("sleep").arg("60").spawn().unwrap());
        let mut watchdog = Reaped(
            vg_command()
                .args(["__watchdog", "--parent", &parent.pid().to_string()])
                .args([
                    "--pgid",
                    &pgid.to_string(),
                    "--pgid-start",
                    &start.to_string(),
                ])
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        parent.0.kill().unwrap();
        parent.0.wait().unwrap();
        wait_until(10, "the watchdog to act and exit", || {
            watchdog.0.try_wait().unwrap().is_some()
        });
    };
    // Someone else's group: the same pid, another start time. Left alone.
    let mut other = group_leader();
    let start = start_ticks(other.pid()).unwrap();
    watchdog_fires(other.pid(), start + 1);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        other.0.try_wait().unwrap().is_none(),
        "another's group was signalled"
    );
    // The job's group (its leader's start time): killed.
    let mut job = group_leader();
    let start = start_ticks(job.pid()).unwrap();
    watchdog_fires(job.pid(), start);
    wait_until(5, "the job's group to be killed", || {
        job.0.try_wait().unwrap().is_some()
    });
    drop(other);
}

/// A main process that ignores SIGTERM is SIGKILLed when the grace period ends, while another
/// process of the job cannot die yet (frozen: a task in the driver's teardown looks the
/// same). The main process's end was reaped inside the kill and then lost: the run waited
/// until its 5 s limit and reported a SIGKILL it presumed. Now the run ends as soon as the
/// last process is gone.
#[test]
fn the_main_process_reaped_while_killing_the_job_is_the_jobs_end() {
    let Some(mut freezer) = TestCgroup::new_v1("freezer") else {
        eprintln!("skipped: no cgroup v1 freezer on this host");
        return;
    };
    let mark = marker();
    let _sweep = Sweep(mark.clone());
    let (k, v) = mark.split_once('=').unwrap();
    let dir = tempfile::tempdir().unwrap();
    let child_pid = dir.path().join("child");
    let script = format!(
        "trap '' TERM; sh -c 'echo $$ > {}; exec sleep 60' & while :; do sleep 0.05; done",
        child_pid.display()
    );
    let mut run = Reaped(
        vg_command()
            .args(["run", "--grace", "500ms", "--isolation", "group"])
            .args(["--", "sh", "-c", &script])
            .env(k, v)
            .env_remove("VRAMGUARD_SIM")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let child = wait_for_pid_file(&child_pid, 10, "the job's child to start");
    freezer.enter("frozen", child);
    let state = freezer.leaf("frozen").with_file_name("freezer.state");
    /// Thaws the freezer however the test ends: a frozen process cannot die.
    struct Thaw(std::path::PathBuf);
    impl Drop for Thaw {
        fn drop(&mut self) {
            let _ = std::fs::write(&self.0, "THAWED");
        }
    }
    let _thaw = Thaw(state.clone());
    std::fs::write(&state, "FROZEN").unwrap();
    wait_until(10, "the child to freeze", || {
        std::fs::read_to_string(&state).is_ok_and(|s| s.trim() == "FROZEN")
    });
    send(run.pid(), "TERM");
    let asked = Instant::now();
    // The grace period (0.5 s) ends, everything is SIGKILLed; the frozen child dies on thaw.
    std::thread::sleep(Duration::from_millis(1500));
    std::fs::write(&state, "THAWED").unwrap();
    let thawed = Instant::now();
    wait_until(20, "vramguard run to end", || {
        run.0.try_wait().unwrap().is_some()
    });
    let took = thawed.elapsed();
    assert_eq!(run.0.wait().unwrap().code(), Some(137));
    // The end lost, the run ended when its 5 s of SIGKILL ran out: 4 s after the thaw.
    assert!(
        took < Duration::from_secs(3),
        "ended {took:?} after the last process could die ({:?} after SIGTERM)",
        asked.elapsed()
    );
    assert!(marked(&mark).is_empty(), "nothing left");
}

/// Red team: `vramguard run … &` typed into an interactive shell took the terminal for its job
/// (it handed the terminal over whenever stdin was one): the shell's next read failed, the
/// shell exited, and the session's end hung the job up. Only a `run` in the foreground hands
/// the terminal to its job; in the background the shell keeps it and runs the next command.
#[test]
fn run_in_the_background_of_an_interactive_shell_leaves_it_the_terminal() {
    if !std::path::Path::new("/bin/bash").exists() {
        panic!("this test needs /bin/bash");
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/run/background_in_a_shell.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(BIN)
        .env("VRAMGUARD_CONFIG", "none")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    let v: Value = serde_json::from_str(line)
        .unwrap_or_else(|e| panic!("{e}: {text} {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(v["started"], 1, "{v}");
    assert_eq!(v["keeps_terminal"], true, "{v}");
    assert_eq!(v["ran_command"], true, "{v}");
    assert_eq!(v["bash_alive"], true, "{v}");
    assert_eq!(v["foreground_job_has_terminal"], true, "{v}");
    assert_eq!(v["terminal_back_after_foreground"], true, "{v}");
}

/// The supervisor skips its watchdog's pid when it walks the job's tree. A job that killed
/// the watchdog and then got its pid (handed out here through `ns_last_pid`, in a PID
/// namespace of its own; a job can also cycle through pids) hid a process from every walk:
/// the job ended with it running (red team). Once the watchdog has exited, its pid is the
/// job's like any other.
#[test]
fn a_job_process_on_the_pid_of_its_dead_watchdog_is_still_the_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let job = dir.path().join("job.sh");
    std::fs::write(
        &job,
        format!(
            r#"W=""
n=0
# The watchdog starts right after the job: wait for it.
while [ -z "$W" ] && [ $n -lt 500 ]; do
  for c in $(cat /proc/$PPID/task/*/children); do
    [ "$c" != "$$" ] && grep -q __watchdog /proc/$c/cmdline 2>/dev/null && W=$c
  done
  [ -z "$W" ] && sleep 0.01
  n=$((n + 1))
done
[ -n "$W" ] || {{ echo "no watchdog beside the job" >&2; exit 90; }}
kill -9 $W
while [ -e /proc/$W ]; do sleep 0.01; done
for i in $(seq 300); do
  echo $((W - 1)) > /proc/sys/kernel/ns_last_pid
  sh -c 'trap "echo TERM > {d}/hidden-term; exit 0" TERM; touch {d}/ready-$$; while :; do sleep 0.05; done' &
  if [ $! = $W ]; then echo $! > {d}/hidden; break; fi
  kill -KILL $!
done
n=0
while [ ! -e {d}/ready-$W ] && [ $n -lt 500 ]; do sleep 0.01; n=$((n + 1)); done
exit 0
"#
        ),
    )
    .unwrap();
    let mark = marker();
    let _sweep = Sweep(mark.clone());
    let (k, v) = mark.split_once('=').unwrap();
    // vramguard is PID 1 there: the namespace, and whatever the job left in it, ends with it.
    let out = vg_wrapped("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount-proc",
            BIN,
            "run",
            "--grace",
            "3s",
        ])
        .args(["--isolation", "group", "--", "sh"])
        .arg(&job)
        .env(k, v)
        .env_remove("VRAMGUARD_SIM")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        dir.path().join("hidden").exists(),
        "the job did not get its watchdog's pid: {err}"
    );
    assert!(
        dir.path().join("hidden-term").exists(),
        "the job's process on the watchdog's old pid got no SIGTERM from the job's end \
         (only the namespace's SIGKILL): {err}"
    );
}
