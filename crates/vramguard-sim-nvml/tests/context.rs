//! A context's life with real processes: a simulated holder (this test binary re-executed as
//! one) creates its context by taking an OFD lock on its GPU's device file, forks children
//! that inherit the descriptor, and is SIGKILLed. As on a real H200 (driver 580.159.04), the
//! dead creator stays listed with the context's memory until the last child exits.

use std::path::Path;
use std::time::{Duration, Instant};
use vramguard_sim::holder::{Hold, HolderSpec};
use vramguard_sim::model::IDLE_CONTEXT_SM_PERCENT;
use vramguard_sim::state::AfterExit;
use vramguard_sim::{ObservedGpu, Sim};
use vramguard_testkit::{SimHolder, World, start_holder};

const GIB: u64 = 1 << 30;

/// Not a test: the body of a holder process when this binary is re-executed as one.
#[test]
fn holder_process() {
    vramguard_testkit::run_if_holder();
}

fn kill(pid: u32) {
    // SAFETY: kill(2) on a pid this test started (the holder's forked children).
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

/// Waits until `/proc/PID` is gone (a killed child re-parented to init is reaped by it).
fn wait_gone(pid: u32) {
    let t = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "pid {pid} still there"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A holder of `gib` GiB on GPU 0 with `forked` children forked after its context exists.
fn start(world: &World, gib: u64, after_exit: AfterExit, forked: u32) -> SimHolder {
    let h = start_holder(
        world,
        HolderSpec {
            holds: vec![Hold {
                after_exit: Some(after_exit),
                ..Hold::on(0, gib * GIB)
            }],
            // Its own process group: nothing here signals the test's group.
            group_leader: true,
            forked_workers: forked,
            ..HolderSpec::new(world.state_path(), 60_000)
        },
    );
    assert_eq!(h.ready.workers.len(), forked as usize);
    h
}

fn listed(g: &ObservedGpu) -> Vec<(u32, Option<u64>)> {
    g.processes.iter().map(|p| (p.pid, p.used_bytes)).collect()
}

fn gpu0(sim: &mut Sim) -> ObservedGpu {
    sim.invalidate();
    sim.observe().unwrap().gpus.remove(0)
}

/// Kills the creator and reaps it; checks that its forked children keep it listed.
fn kill_creator_and_check_it_stays(sim: &mut Sim, h: &mut SimHolder, bytes: u64) {
    let creator = h.ready.pid;
    h.crash();
    let g = gpu0(sim);
    assert_eq!(g.used, bytes, "the forked children keep the context");
    assert_eq!(
        listed(&g),
        vec![(creator, Some(bytes))],
        "the dead creator is listed with the whole context; its children are not"
    );
    assert_eq!(
        g.utilization
            .iter()
            .map(|u| (u.pid, u.sm_util))
            .collect::<Vec<_>>(),
        vec![(creator, IDLE_CONTEXT_SM_PERCENT)],
        "a dead creator's context is idle: 1 % SM, as on the real H200"
    );
}

#[test]
fn a_dead_creator_stays_listed_until_the_last_forked_child_exits() {
    let world = World::new(1);
    let mut h = start(&world, 4, AfterExit::Release, 2);
    let mut sim = Sim::open(world.state_path()).unwrap();
    let g = gpu0(&mut sim);
    assert_eq!(listed(&g), vec![(h.ready.pid, Some(4 * GIB))]);
    assert_eq!(g.used, 4 * GIB);
    kill_creator_and_check_it_stays(&mut sim, &mut h, 4 * GIB);
    let (first, last) = (h.ready.workers[0], h.ready.workers[1]);
    kill(first);
    wait_gone(first);
    assert_eq!(gpu0(&mut sim).used, 4 * GIB, "one child still keeps it");
    kill(last);
    wait_gone(last);
    // Released at once once the last descriptor closed (the real driver: 0 ms).
    let g = gpu0(&mut sim);
    assert_eq!(g.used, 0, "{g:?}");
    assert!(g.processes.is_empty(), "{g:?}");
    assert!(g.utilization.is_empty(), "{g:?}");
}

#[test]
fn with_a_teardown_lag_the_lag_starts_at_the_last_childs_exit() {
    let world = World::new(1);
    let mut h = start(&world, 2, AfterExit::ReleaseAfterMs(400), 1);
    let mut sim = Sim::open(world.state_path()).unwrap();
    kill_creator_and_check_it_stays(&mut sim, &mut h, 2 * GIB);
    // Time must pass beyond the lag (400 ms) since the creator's death: looked at all along
    // until the clock says 600 ms, so a release at any moment of it is seen.
    let died = Instant::now();
    while died.elapsed() < Duration::from_millis(600) {
        assert_eq!(
            gpu0(&mut sim).used,
            2 * GIB,
            "held past the lag after the creator's death ({:?}): the child keeps it",
            died.elapsed()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let child = h.ready.workers[0];
    kill(child);
    wait_gone(child);
    let t = Instant::now();
    let g = gpu0(&mut sim);
    assert_eq!(g.used, 2 * GIB, "tearing down");
    assert_eq!(
        listed(&g),
        vec![(h.ready.pid, Some(2 * GIB))],
        "listed meanwhile"
    );
    while gpu0(&mut sim).used != 0 {
        assert!(t.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        t.elapsed() >= Duration::from_millis(350),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn without_forked_children_the_context_goes_with_its_creator() {
    let world = World::new(1);
    let mut h = start(&world, 1, AfterExit::Release, 0);
    let mut sim = Sim::open(world.state_path()).unwrap();
    assert_eq!(gpu0(&mut sim).used, GIB);
    h.crash();
    let g = gpu0(&mut sim);
    assert_eq!((g.used, g.processes.len()), (0, 0), "{g:?}");
}

#[test]
fn a_lock_offset_is_unique_per_process_and_fits_a_file_offset() {
    use vramguard_sim::context::lock_offset;
    assert_ne!(
        lock_offset(4121, 100),
        lock_offset(4121, 101),
        "a reused pid"
    );
    assert_ne!(lock_offset(4121, 100), lock_offset(4122, 100));
    assert!(lock_offset(4_194_303, u64::MAX) < i64::MAX as u64);
}
