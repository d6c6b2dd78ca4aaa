//! Signals reach exactly the planned process, or nothing.

use rustix::process::Signal;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vramguard_ops::identity::{Identity, Refusal, start_ticks, verify, wait_all};
use vramguard_testkit::{Reaped, alive, wait_until};

fn sleeper() -> Reaped {
    Reaped(
        Command::new("sleep")
            .arg("60")
            .stdin(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn identity_of(pid: u32) -> Identity {
    Identity {
        pid,
        start_ticks: start_ticks(Path::new("/proc"), pid).unwrap(),
    }
}

#[test]
fn a_verified_process_receives_the_signal() {
    let mut p = sleeper();
    let v = verify(Path::new("/proc"), identity_of(p.pid())).unwrap();
    v.signal(Signal::TERM).unwrap();
    let status = p.0.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc_sigterm()));
}

fn libc_sigterm() -> i32 {
    15
}

#[test]
fn a_changed_start_time_is_refused_and_nothing_is_sent() {
    let p = sleeper();
    let mut id = identity_of(p.pid());
    id.start_ticks += 1;
    match verify(Path::new("/proc"), id) {
        Err(Refusal::Reused { .. }) => {}
        other => panic!("expected a refusal, got {other:?}"),
    }
    std::thread::sleep(Duration::from_millis(50));
    assert!(alive(p.pid()));
}

#[test]
fn a_gone_process_is_gone() {
    let mut p = sleeper();
    let id = identity_of(p.pid());
    p.0.kill().unwrap();
    p.0.wait().unwrap();
    assert_eq!(verify(Path::new("/proc"), id).unwrap_err(), Refusal::Gone);
}

/// The real thing: the planned process dies and a new process gets its pid. The kernel's
/// next pid is steered with /proc/sys/kernel/ns_last_pid (root only); other forks on the host
/// may win the race, so it is retried. The newcomer may even start in the same clock tick (the
/// start time cannot tell them apart then): the pidfd pinned at plan time still can.
#[test]
fn a_pid_reused_by_a_new_process_is_never_signalled() {
    let last_pid = Path::new("/proc/sys/kernel/ns_last_pid");
    for _attempt in 0..50 {
        let mut victim = sleeper();
        let planned = identity_of(victim.pid());
        let pinned = vramguard_ops::identity::pin(Path::new("/proc"), [planned]);
        victim.0.kill().unwrap();
        victim.0.wait().unwrap();
        std::fs::write(last_pid, format!("{}", planned.pid - 1)).unwrap();
        let newcomer = sleeper();
        if newcomer.pid() != planned.pid {
            continue;
        }
        let handle = pinned[0].handle.as_ref().expect("pinned while alive");
        assert_eq!(handle.signal(Signal::KILL), Err(Refusal::Gone));
        assert!(handle.has_exited());
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            alive(newcomer.pid()),
            "the newcomer must not have been signalled"
        );
        // Verifying afresh by pid and start time refuses too, unless the newcomer started in
        // the very same clock tick, which is why pinning happens at plan time.
        if start_ticks(Path::new("/proc"), newcomer.pid()) != Some(planned.start_ticks) {
            assert!(matches!(
                verify(Path::new("/proc"), planned),
                Err(Refusal::Reused { .. })
            ));
        }
        return;
    }
    panic!("could not get the kernel to reuse a pid in 50 attempts");
}

#[test]
fn a_process_ignoring_sigterm_is_still_alive_at_the_deadline() {
    let ignorer = Reaped(
        Command::new("sh")
            .arg("-c")
            .arg("trap '' TERM; while :; do sleep 0.05; done")
            .spawn()
            .unwrap(),
    );
    let quitter = sleeper();
    // SigIgn is a hex mask; bit 14 (0x4000) is SIGTERM (15).
    wait_until(5, "the TERM trap to be installed", || {
        std::fs::read_to_string(format!("/proc/{}/status", ignorer.pid())).is_ok_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("SigIgn:"))
                .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
                .is_some_and(|m| m & 0x4000 != 0)
        })
    });
    let a = verify(Path::new("/proc"), identity_of(ignorer.pid())).unwrap();
    let b = verify(Path::new("/proc"), identity_of(quitter.pid())).unwrap();
    a.signal(Signal::TERM).unwrap();
    b.signal(Signal::TERM).unwrap();
    let t = Instant::now();
    let exits = wait_all(&[&a, &b], Instant::now() + Duration::from_millis(400));
    assert!(exits[0].is_none(), "the ignorer survives TERM");
    assert!(exits[1].is_some(), "the sleeper exits at once");
    assert!(t.elapsed() >= Duration::from_millis(390));
    a.signal(Signal::KILL).unwrap();
    let exits = wait_all(&[&a], Instant::now() + Duration::from_secs(5));
    assert!(exits[0].is_some());
    drop(quitter);
}
