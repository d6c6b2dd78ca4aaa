//! Signals reach exactly the planned process, or nothing.

use rustix::process::Signal;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vramguard_ops::identity::{Identity, Refusal, start_ticks, verify, wait_all};
use vramguard_testkit::{Reaped, wait_until};

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

#[test]
fn a_live_process_has_not_exited_and_a_killed_one_has() {
    let mut p = sleeper();
    let v = verify(Path::new("/proc"), identity_of(p.pid())).unwrap();
    assert!(!v.has_exited(), "a sleeping process has not exited");
    v.signal(Signal::KILL).unwrap();
    // Once reaped it has surely exited: no window to wait out.
    p.0.wait().unwrap();
    assert!(v.has_exited(), "a killed and reaped process has exited");
}

fn libc_sigterm() -> i32 {
    15
}

#[test]
fn a_changed_start_time_is_refused_and_nothing_is_sent() {
    let p = deaf_sleeper();
    let mut id = identity_of(p.pid());
    id.start_ticks += 1;
    match verify(Path::new("/proc"), id) {
        Err(Refusal::Reused { .. }) => {}
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A signal sent would be seen at once (pending, or a zombie): no window to wait out.
    assert_untouched(p.pid(), "a changed start time");
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
        let newcomer = deaf_sleeper();
        if newcomer.pid() != planned.pid {
            continue;
        }
        let handle = pinned[0].handle.as_ref().expect("pinned while alive");
        assert_eq!(handle.signal(Signal::KILL), Err(Refusal::Gone));
        assert!(handle.has_exited());
        // Seen at once if it had been signalled (pending, or a zombie): no window to wait out.
        assert_untouched(newcomer.pid(), "the newcomer with the reused pid");
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

// ---- The node's signals, with the kernel made to reuse the planned pid ----
//
// Each test below runs itself again as PID 1 of a fresh PID (and mount) namespace, with its
// own /proc: nothing else forks there, so `ns_last_pid` hands the planned pid to the newcomer
// every time, and the newcomer's start time is steered into the planned one's clock tick or a
// later one. The real [`MachineNode`] pins and signals; the newcomer blocks SIGTERM, so a
// signal that reached it is seen at once (pending, or a zombie for SIGKILL) and no test waits
// for "nothing to happen".
//
// What guards what: a pid reused *after* pinning is out of reach of the pidfd whatever its
// start time (`MachineNode::signal` must go through it, not `kill(pid)`); a pid reused
// *before* pinning, in a later tick, is refused by the start-time check. A pid reused before
// pinning in the same tick cannot be told apart by anything in /proc: that is why pinning
// follows planning at once.

use vramguard_node::{MachineNode, Node, ResetBackend};

/// Runs the calling test (`name`) as PID 1 of a fresh PID namespace; returns whether this
/// process is that one (then the caller goes on with the test's body).
fn in_a_fresh_pid_namespace(name: &str) -> bool {
    if std::process::id() == 1 {
        return true;
    }
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--"])
        .arg(&exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .stdin(Stdio::null())
        .output()
        .expect("unshare (util-linux) runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} in a fresh PID namespace: {}\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

/// A GPU source with no GPU: these tests only pin and signal.
struct NoGpus;

impl vramguard_gpu::GpuSource for NoGpus {
    fn sample(
        &mut self,
        _: Duration,
    ) -> Result<vramguard_gpu::DriverSample, vramguard_gpu::SourceError> {
        Ok(vramguard_gpu::DriverSample {
            driver: vramguard_core::snapshot::DriverFacts {
                source: vramguard_core::snapshot::DriverSource::Simulated,
                library: None,
                driver_version: None,
                nvml_version: None,
            },
            gpus: Vec::new(),
        })
    }
    fn memory_used(&mut self, _: u32) -> Result<u64, vramguard_core::snapshot::CallError> {
        Ok(0)
    }
}

fn machine() -> MachineNode {
    let proc_root = Path::new("/proc");
    MachineNode::new(
        Box::new(NoGpus),
        vramguard_proc::ProcCollector::new(proc_root, "/dev").unwrap(),
        vramguard_core::Policy::default(),
        ResetBackend::Command(vec!["false".into()]),
        proc_root,
    )
}

/// The current clock tick (USER_HZ, as in `stat`'s start time), from /proc/uptime.
fn ticks_now() -> u64 {
    let uptime = std::fs::read_to_string("/proc/uptime").unwrap();
    let secs = uptime.split_whitespace().next().unwrap();
    let (whole, frac) = secs.split_once('.').unwrap();
    let hz = rustix::param::clock_ticks_per_second();
    assert_eq!(hz, 100, "/proc/uptime counts hundredths; USER_HZ is {hz}");
    whole.parse::<u64>().unwrap() * 100 + frac.parse::<u64>().unwrap()
}

/// Waits until the clock tick is past `ticks`.
fn wait_for_a_tick_after(ticks: u64) {
    wait_until(5, "the next clock tick", || ticks_now() > ticks);
}

/// A process that takes `pid` (the kernel's next pid is steered there) and blocks SIGTERM.
fn newcomer_at(pid: u32) -> Reaped {
    std::fs::write("/proc/sys/kernel/ns_last_pid", format!("{}", pid - 1)).unwrap();
    let newcomer = deaf_sleeper();
    assert_eq!(
        newcomer.pid(),
        pid,
        "nothing else forks in this PID namespace: the newcomer takes the planned pid"
    );
    newcomer
}

/// A `sleep` that blocks SIGTERM: a SIGTERM sent to it stays pending, where
/// [`assert_untouched`] sees it at once.
fn deaf_sleeper() -> Reaped {
    let mut cmd = Command::new("sleep");
    cmd.arg("60").stdin(Stdio::null());
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGTERM);
            if libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Reaped(cmd.spawn().unwrap())
}

/// Panics if `pid` (a child not yet reaped) got SIGTERM or SIGKILL: a signal that reached it
/// is pending (it blocks SIGTERM; SIGKILL is pending until it dies) or it is a zombie.
fn assert_untouched(pid: u32, case: &str) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
            .trim()
            .to_string()
    };
    let mask = |name: &str| u64::from_str_radix(&field(name), 16).unwrap();
    let pending = mask("SigPnd:") | mask("ShdPnd:");
    let term_or_kill = (1 << (15 - 1)) | (1 << (9 - 1));
    assert!(
        pending & term_or_kill == 0 && !field("State:").starts_with('Z'),
        "{case}: the newcomer with the reused pid {pid} was signalled (State {}, pending \
         signals {pending:#x})",
        field("State:")
    );
}

/// The planned process: `sleep`, its identity read as a plan reads it.
fn planned() -> (Reaped, Identity) {
    let victim = sleeper();
    let id = identity_of(victim.pid());
    (victim, id)
}

fn end(mut victim: Reaped) {
    victim.0.kill().unwrap();
    victim.0.wait().unwrap();
}

/// Sends SIGTERM and SIGKILL to `id` through `node`: neither may reach `newcomer`, and the
/// node must say it sent nothing.
fn signal_both(node: &mut MachineNode, id: Identity, newcomer: &Reaped, case: &str) {
    for sig in [Signal::TERM, Signal::KILL] {
        let sent = node.signal(id, sig);
        assert_untouched(newcomer.pid(), &format!("{case}, {sig:?} ({sent:?})"));
        assert!(sent.is_err(), "{case}: {sig:?} to {id:?} was sent");
    }
}

#[test]
fn a_pid_reused_after_pinning_in_the_same_tick_is_out_of_the_nodes_reach() {
    if !in_a_fresh_pid_namespace(
        "a_pid_reused_after_pinning_in_the_same_tick_is_out_of_the_nodes_reach",
    ) {
        return;
    }
    let mut node = machine();
    // The whole dance must fit in one 10 ms tick: start right after a tick begins, and try
    // again when it did not fit.
    for _attempt in 0..200 {
        wait_for_a_tick_after(ticks_now());
        let (victim, id) = planned();
        assert_eq!(node.pin(&[id]), vec![Ok(())]);
        end(victim);
        let newcomer = newcomer_at(id.pid);
        if start_ticks(Path::new("/proc"), id.pid) != Some(id.start_ticks) {
            continue;
        }
        let case = "pinned, then reused in the same tick";
        signal_both(&mut node, id, &newcomer, case);
        return;
    }
    panic!("could not start the newcomer in the planned process's clock tick in 200 attempts");
}

#[test]
fn a_pid_reused_after_pinning_in_a_later_tick_is_out_of_the_nodes_reach() {
    if !in_a_fresh_pid_namespace(
        "a_pid_reused_after_pinning_in_a_later_tick_is_out_of_the_nodes_reach",
    ) {
        return;
    }
    let mut node = machine();
    let (victim, id) = planned();
    assert_eq!(node.pin(&[id]), vec![Ok(())]);
    end(victim);
    wait_for_a_tick_after(id.start_ticks);
    let newcomer = newcomer_at(id.pid);
    assert_ne!(
        start_ticks(Path::new("/proc"), id.pid),
        Some(id.start_ticks)
    );
    let case = "pinned, then reused in a later tick";
    signal_both(&mut node, id, &newcomer, case);
}

#[test]
fn a_pid_reused_before_pinning_in_a_later_tick_is_refused_by_its_start_time() {
    if !in_a_fresh_pid_namespace(
        "a_pid_reused_before_pinning_in_a_later_tick_is_refused_by_its_start_time",
    ) {
        return;
    }
    let mut node = machine();
    let (victim, id) = planned();
    end(victim);
    wait_for_a_tick_after(id.start_ticks);
    let newcomer = newcomer_at(id.pid);
    let pinned = node.pin(&[id]);
    let case = "reused in a later tick, then pinned";
    signal_both(&mut node, id, &newcomer, case);
    assert!(
        matches!(pinned[..], [Err(Refusal::Reused { .. })]),
        "pinning a pid reused in a later tick: {pinned:?}"
    );
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

// ---- The node's own guard: a signal goes to the identity pinned, start time and all ----
//
// The PID-namespace tests above always ask the node for exactly the identity they pinned, and
// check only that nothing was sent: so `MachineNode::signal`'s check `v.identity == id` could
// be `true` (the asked identity is the pinned one), `false` or `!=` (nothing is sent either
// way: the pinned process is dead) without any of them failing. These ask for identities that
// differ from the pinned one, and for the pinned one while it lives.

/// Whether `pid` (a child not yet reaped, blocking SIGTERM) has SIGTERM pending.
fn term_pending(pid: u32) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let mask = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|m| u64::from_str_radix(m.trim(), 16).unwrap())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (mask("SigPnd:") | mask("ShdPnd:")) & (1 << (15 - 1)) != 0
}

#[test]
fn the_node_signals_only_the_identity_it_pinned_with_its_start_time() {
    let mut node = machine();
    let mut target = deaf_sleeper();
    let bystander = deaf_sleeper();
    let id = identity_of(target.pid());
    let never_pinned = identity_of(bystander.pid());
    assert_eq!(node.pin(&[id]), vec![Ok(())]);
    let wrong_start = Identity {
        start_ticks: id.start_ticks + 1,
        ..id
    };
    for sig in [Signal::TERM, Signal::KILL] {
        let sent = node.signal(wrong_start, sig);
        assert!(
            matches!(sent, Err(Refusal::Failed(_))),
            "{sig:?} to the pinned pid with another start time: {sent:?}"
        );
        assert_untouched(target.pid(), &format!("another start time, {sig:?}"));
        let sent = node.signal(never_pinned, sig);
        assert!(
            matches!(sent, Err(Refusal::Failed(_))),
            "{sig:?} to an identity never pinned: {sent:?}"
        );
        assert_untouched(bystander.pid(), &format!("never pinned, {sig:?}"));
    }
    // The identity pinned, exactly: sent (SIGTERM is blocked, so it waits, pending).
    assert_eq!(node.signal(id, Signal::TERM), Ok(()));
    assert!(term_pending(target.pid()), "the pinned process got SIGTERM");
    assert_eq!(node.signal(id, Signal::KILL), Ok(()));
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(target.0.wait().unwrap().signal(), Some(9));
    assert_untouched(bystander.pid(), "the bystander, after all");
}

#[test]
fn the_node_waits_for_the_identities_it_pinned_and_counts_others_as_gone() {
    let mut node = machine();
    let mut target = sleeper();
    let bystander = deaf_sleeper();
    let id = identity_of(target.pid());
    let never_pinned = identity_of(bystander.pid());
    let wrong_start = Identity {
        start_ticks: id.start_ticks + 1,
        ..id
    };
    assert_eq!(node.pin(&[id]), vec![Ok(())]);
    let exits = node.wait_exits(
        &[id, never_pinned, wrong_start],
        Instant::now() + Duration::from_millis(100),
    );
    assert_eq!(exits.len(), 3, "one answer per identity: {exits:?}");
    assert!(exits[0].is_none(), "the pinned process lives: {exits:?}");
    assert!(exits[1].is_some(), "never pinned: gone: {exits:?}");
    assert!(exits[2].is_some(), "another start time: gone: {exits:?}");
    node.signal(id, Signal::KILL).unwrap();
    let exits = node.wait_exits(&[id], Instant::now() + Duration::from_secs(10));
    assert!(exits[0].is_some(), "the killed process exited: {exits:?}");
    target.0.wait().unwrap();
    assert_untouched(bystander.pid(), "the bystander");
}
