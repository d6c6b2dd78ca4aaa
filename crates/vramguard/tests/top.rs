//! `vramguard top` in a real pseudo-terminal on the simulated driver: it shows the GPU and
//! the orphan of a crashed job, reclaims it with `r` and `y` (the memory comes back), quits
//! with `q`, and leaves the terminal as it found it.

mod common;
use common::*;
use std::io::Write;
use std::time::{Duration, Instant};
use vramguard_testkit::pty;

/// Everything the program wrote to the terminal so far, escape sequences included.
struct Screen(pty::Collected);

impl Screen {
    fn text(&self) -> String {
        self.0.text()
    }
    /// How much has been written so far.
    fn len(&self) -> usize {
        self.0.len()
    }
    /// Waits until `what` has been written after the first `from` bytes. Text is compared without escape sequences and blanks:
    /// the terminal moves the cursor over blanks rather than writing them. A `what` that
    /// starts with ESC is looked for as written.
    fn wait_for(&self, from: usize, what: &str, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let raw = what.starts_with('\x1b');
        let needle = squash(what);
        loop {
            let text = self.text();
            let tail = text.get(from..).unwrap_or("");
            let found = if raw {
                tail.contains(what)
            } else {
                squash(&strip(tail)).contains(&needle)
            };
            if found {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what:?}; the terminal got:\n{}",
                strip(tail)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// `s` without blanks.
fn squash(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

/// `s` without escape sequences, for failure messages.
fn strip(s: &str) -> String {
    let mut out = String::new();
    let mut esc = false;
    for c in s.chars() {
        if esc {
            esc = !c.is_ascii_alphabetic();
        } else if c == '\x1b' {
            esc = true;
        } else {
            out.push(c);
        }
    }
    out
}

#[test]
fn top_shows_the_orphan_reclaims_it_on_confirmation_and_restores_the_terminal() {
    let world = World::new(1);
    let trainer = crashed_trainer(&world);
    let orphan = trainer.workers[0];
    let audit = world.state_path().with_file_name("audit.jsonl");
    // The audit log and the grace come from the config's [reclaim] (issue 29: top ignored it).
    let cfg = config(
        &world,
        &format!(
            "[reclaim]\ngrace = \"2s\"\naudit_log = \"{}\"\n",
            audit.display()
        ),
    );
    let (master, slave) = pty::pair(40, 160).unwrap();
    let terminal = slave.try_clone().unwrap();
    let modes_before = rustix::termios::tcgetattr(&terminal).unwrap().local_modes;
    let mut cmd = vg_command();
    cmd.env_remove("VRAMGUARD_SIM")
        .env_remove("VRAMGUARD_NVML_LIB")
        .env_remove("COLUMNS")
        .env("TERM", "xterm-256color")
        .arg("--sim")
        .arg(world.state_path())
        .arg("--config")
        .arg(&cfg)
        .args(["top", "--delay", "0.3s", "--sample", "0.3s"]);
    let mut child = Reaped(pty::spawn_on(&mut cmd, &slave).unwrap());
    drop(slave);
    let screen = Screen(pty::Collected::start(&master).unwrap());
    let mut keys = std::fs::File::from(master);
    screen.wait_for(0, "\x1b[?1049h", 10);
    screen.wait_for(0, "GPU 0", 15);
    screen.wait_for(0, "orphan", 15);
    // The orphan sorts first (attention order): ask for the plan of its job, and decline.
    let before = screen.len();
    keys.write_all(b"r").unwrap();
    screen.wait_for(before, "reclaim plan", 15);
    let before = screen.len();
    keys.write_all(b"n").unwrap();
    screen.wait_for(before, "reclaim cancelled: nothing was signalled", 5);
    assert!(
        std::path::Path::new(&format!("/proc/{orphan}")).exists(),
        "declined, the orphan lives"
    );
    // Again, and confirm.
    let before = screen.len();
    keys.write_all(b"r").unwrap();
    screen.wait_for(before, "reclaim plan", 15);
    screen.wait_for(before, &format!("pid {orphan}"), 5);
    let before = screen.len();
    keys.write_all(b"y").unwrap();
    screen.wait_for(before, "reclaim done", 30);
    screen.wait_for(before, "freed", 5);
    // The orphan is gone and its memory is back.
    let report = Vg::new(&world, Path_::InProcess)
        .args(["status", "--json", "--sample", "0"])
        .json(0);
    let holders = report["gpus"][0]["holders"].as_array().unwrap().clone();
    assert!(!holders.iter().any(|h| h["pid"] == orphan), "{report:#}");
    let audit_text = std::fs::read_to_string(&audit).unwrap();
    assert!(
        audit_text.contains(&format!("\"pid\":{orphan}")),
        "{audit_text}"
    );
    // Close the result, quit, and find the terminal restored.
    let before = screen.len();
    // Keys are read in order: the space closes the result before the q quits.
    keys.write_all(b" ").unwrap();
    keys.write_all(b"q").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "top did not quit on q");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0));
    screen.wait_for(before, "\x1b[?1049l", 5);
    // Raw mode is undone: the line discipline echoes and edits lines again.
    assert_eq!(
        rustix::termios::tcgetattr(&terminal).unwrap().local_modes,
        modes_before
    );
    drop(trainer);
}

#[test]
fn top_r_on_a_holder_of_a_live_vramguard_run_signals_nothing() {
    // Issue 26: a job under `vramguard run` whose helper called setsid, started an idle
    // holder and exited; the holder was re-parented to the live supervisor.
    let world = World::new(1);
    let job = SupervisedJob::start(&world, "group");
    let (sup, holder) = (job.run.pid(), job.holder);
    let audit = world.state_path().with_file_name("audit.jsonl");
    let (master, slave) = pty::pair(40, 200).unwrap();
    let mut cmd = vg_command();
    cmd.env_remove("VRAMGUARD_SIM")
        .env_remove("VRAMGUARD_NVML_LIB")
        .env_remove("COLUMNS")
        .env("TERM", "xterm-256color")
        .arg("--sim")
        .arg(world.state_path())
        .args([
            "top", "--delay", "0.3s", "--sample", "0.3s", "--grace", "2s",
        ])
        .arg("--audit-log")
        .arg(&audit);
    let mut child = Reaped(pty::spawn_on(&mut cmd, &slave).unwrap());
    drop(slave);
    let screen = Screen(pty::Collected::start(&master).unwrap());
    let mut keys = std::fs::File::from(master);
    screen.wait_for(0, &format!("{holder}"), 15);
    screen.wait_for(0, &format!("run:{sup}"), 5);
    // Its only holder is selected: ask for the plan of its job, and say yes to it.
    let before = screen.len();
    keys.write_all(b"r").unwrap();
    screen.wait_for(before, "reclaim plan", 15);
    screen.wait_for(before, "no process to signal", 5);
    // The reason wraps in the popup (where depends on the pids' widths): its two ends.
    screen.wait_for(
        before,
        "its job is alive: re-parented to the vramguard run",
        5,
    );
    screen.wait_for(before, "(vramguard), which lives", 5);
    keys.write_all(b"y").unwrap();
    keys.write_all(b"q").unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "top did not quit on q");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(alive(holder), "top's r killed the supervised holder");
    let audit_text = std::fs::read_to_string(&audit).unwrap_or_default();
    assert!(
        !audit_text
            .lines()
            .any(|l| l.contains("\"event\":\"signal\"")),
        "{audit_text}"
    );
    drop(job);
}

/// An orphan of a crashed job that ignores SIGTERM; `top` on a pty with `[reclaim] grace`
/// from a config, its `r` plan for that orphan confirmed with `y`, and Ctrl-C pressed while
/// the reclaim runs. Returns the orphan's holding, top, its screen and its keyboard.
fn top_reclaiming_a_stubborn_orphan(
    world: &World,
    grace: &str,
    audit: &std::path::Path,
) -> (Holding, Reaped, Screen, std::fs::File) {
    let mut trainer = spec(world, serde_json::json!([hold(0, 2)]));
    trainer["group_leader"] = serde_json::json!(true);
    trainer["workers"] = serde_json::json!([{ "argv": ["python3", "w.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000, "ignore_term": true,
        "holds": [hold(0, 1)] } }]);
    let mut job = start(world, &["python3", "train.py"], trainer);
    job.crash();
    let orphan = job.workers[0];
    let cfg = config(
        world,
        &format!(
            "[reclaim]\ngrace = \"{grace}\"\naudit_log = \"{}\"\n",
            audit.display()
        ),
    );
    let (master, slave) = pty::pair(40, 160).unwrap();
    let mut cmd = vg_command();
    cmd.env_remove("VRAMGUARD_SIM")
        .env_remove("VRAMGUARD_NVML_LIB")
        .env_remove("COLUMNS")
        .env("TERM", "xterm-256color")
        .arg("--sim")
        .arg(world.state_path())
        .arg("--config")
        .arg(&cfg)
        .args(["top", "--delay", "0.3s", "--sample", "0.3s"]);
    let child = Reaped(pty::spawn_on(&mut cmd, &slave).unwrap());
    drop(slave);
    let screen = Screen(pty::Collected::start(&master).unwrap());
    let mut keys = std::fs::File::from(master);
    screen.wait_for(0, "orphan", 15);
    let before = screen.len();
    keys.write_all(b"r").unwrap();
    screen.wait_for(before, "reclaim plan", 15);
    screen.wait_for(before, &format!("pid {orphan}"), 5);
    let before = screen.len();
    keys.write_all(b"y").unwrap();
    screen.wait_for(before, "signalling and waiting", 15);
    // Once its SIGTERM is sent (a Ctrl-C before it would leave the orphan unsignalled).
    wait_until(15, "the SIGTERM's record", || {
        std::fs::read_to_string(audit).is_ok_and(|t| t.contains("\"signal\":\"TERM\""))
    });
    // Raw mode: Ctrl-C is a key, and quits.
    keys.write_all(b"\x03").unwrap();
    screen.wait_for(before, "finishing the reclaim in progress", 10);
    (job, child, screen, keys)
}

fn exit_code(child: &mut Reaped, secs: u64, screen: &Screen) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(s) = child.0.try_wait().unwrap() {
            return s.code().expect("exited, not killed by a signal");
        }
        assert!(
            Instant::now() < deadline,
            "top still running after {secs}s:\n{}",
            strip(&screen.text())
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn audit_records(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Issue 30: Ctrl-C in `top` while its reclaim ran quit the screen and the reclaim went on
/// unseen; a second Ctrl-C at the shell killed it half-done. Now Ctrl-C finishes the decision
/// (the orphan that ignores SIGTERM gets SIGKILL at the end of the grace period), prints what
/// was done once the screen is gone, logs the result, and exits 130.
#[test]
fn ctrl_c_in_top_during_a_reclaim_finishes_it_and_prints_what_was_done() {
    let world = World::new(1);
    let audit = world.state_path().with_file_name("audit.jsonl");
    let (job, mut child, screen, _keys) = top_reclaiming_a_stubborn_orphan(&world, "3s", &audit);
    let orphan = job.workers[0];
    assert_eq!(exit_code(&mut child, 60, &screen), 130);
    screen.wait_for(0, "interrupted: what was started was finished", 5);
    wait_until(10, "the SIGKILLed orphan to be gone", || !alive(orphan));
    let records = audit_records(&audit);
    let last = records.last().unwrap();
    assert_eq!(last["event"], "result", "{records:#?}");
    assert_eq!(last["interrupted"], serde_json::json!(true));
    let exit = records
        .iter()
        .find(|r| r["event"] == "exited" && r["pid"] == orphan)
        .unwrap();
    assert_eq!(exit["signal"], "KILL");
    assert!(exit["after_ms"].as_u64().unwrap() >= 3000, "{exit}");
}

/// A second Ctrl-C (a SIGINT, the terminal being restored) stops at once: the pid left alive
/// and how to finish are printed, and the audit log ends with an `interrupted` record.
#[test]
fn a_second_ctrl_c_after_top_quit_stops_the_reclaim_and_names_the_pid() {
    let world = World::new(1);
    let audit = world.state_path().with_file_name("audit.jsonl");
    let (job, mut child, screen, mut keys) =
        top_reclaiming_a_stubborn_orphan(&world, "120s", &audit);
    let orphan = job.workers[0];
    keys.write_all(b"\x03").unwrap();
    assert_eq!(exit_code(&mut child, 30, &screen), 130);
    screen.wait_for(0, &format!("`kill -KILL {orphan}`"), 5);
    assert!(alive(orphan), "a second Ctrl-C sends nothing more");
    let records = audit_records(&audit);
    let last = records.last().unwrap();
    assert_eq!(last["event"], "interrupted", "{records:#?}");
    assert_eq!(last["alive"][0]["pid"], orphan);
    drop(job);
}
