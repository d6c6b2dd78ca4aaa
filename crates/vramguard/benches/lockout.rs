//! Scrapers against a hostile local user (issue #26), not in CI:
//! `cargo bench -p vramguard --bench lockout`.
//!
//! Runs `vramguard agent` behind a password (a cost-10 bcrypt hash) and prints:
//! - the CPU of one cost-10 bcrypt verification, measured here: what every wrong guess cost
//!   the agent before its failed logins were limited;
//! - the agent's CPU per wrong guess over a burst of GUESSES wrong passwords, one after
//!   another on new connections, its CPU from every thread's `schedstat`;
//! - with a hostile local user holding every connection it can (IDLE idle connections,
//!   SLOW slowloris ones, BUSY keep-alive ones sending wrong passwords back to back), the
//!   scrapes of SCRAPERS honest scrapers (the password, a new connection each, a 10 s
//!   timeout, ROUNDS rounds one second apart, all from loopback like the attacker) that
//!   failed, and how many of them were refused.
//!
//! `VRAMGUARD_BENCH_SIZE=tiny` runs 20 scrapers, 2 rounds, 10 guesses and a smaller attacker.
//! Every process it starts is killed by pid when it ends.

use base64::Engine;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use vramguard_testkit::World;
use vramguard_testkit::bench::{figure, param};
use vramguard_testkit::load::{cpu_ns, spawn_agent};
use vramguard_testkit::lockout::{Hostile, Mix, Scrape, honest, scrape};

const BIN: &str = env!("CARGO_BIN_EXE_vramguard");

fn basic(credentials: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(credentials)
    )
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec for the calling thread's CPU clock.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn main() {
    let scrapers: usize = param("SCRAPERS", 200, 20);
    let rounds: usize = param("ROUNDS", 10, 2);
    let guesses: usize = param("GUESSES", 200, 10);
    let idle: usize = param("IDLE", 200, 40);
    let slow: usize = param("SLOW", 100, 20);
    let busy: usize = param("BUSY", 200, 80);

    let hash = bcrypt::hash("s3cret", 10).unwrap();
    let t = thread_cpu_ns();
    assert!(!bcrypt::verify("wrong", &hash).unwrap());
    let one_verify = (thread_cpu_ns() - t) as f64 / 1e6;
    println!("one cost-10 bcrypt verification: {one_verify:.1} ms of CPU");
    figure("lockout.bcrypt_verify_cpu", one_verify, "ms");

    let world = World::new(1);
    let dir = world.dir.path();
    std::fs::write(
        dir.join("web.yml"),
        format!("basic_auth_users:\n  prometheus: {hash}\n"),
    )
    .unwrap();
    let config = dir.join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "[agent]\ninterval = \"1s\"\nweb_config = \"{}\"\n",
            dir.join("web.yml").display()
        ),
    )
    .unwrap();
    let (mut child, addr) = spawn_agent(BIN, &[], &world, &config);
    let good = basic("prometheus:s3cret");
    let deadline = Instant::now() + Duration::from_secs(30);
    while scrape(addr, "/metrics", Some(&good), Duration::from_secs(10)) != Scrape::Ok {
        assert!(Instant::now() < deadline, "the agent never answered");
        std::thread::sleep(Duration::from_millis(100));
    }

    // A burst of wrong guesses.
    let before = cpu_ns(child.id());
    let mut limited = 0;
    for i in 0..guesses {
        let auth = basic(&format!("prometheus:guess{i}"));
        if scrape(addr, "/metrics", Some(&auth), Duration::from_secs(10)) == Scrape::Status(429) {
            limited += 1;
        }
    }
    let per_guess = (cpu_ns(child.id()) - before) as f64 / 1e6 / guesses as f64;
    println!(
        "{guesses} wrong guesses: {per_guess:.2} ms of agent CPU each ({limited} answered 429 without bcrypt)"
    );
    figure("lockout.guess_cpu", per_guess, "ms");

    // Honest scrapers beside a hostile local user.
    let hostile = Hostile::start(
        addr,
        &Mix {
            idle,
            slowloris: slow,
            busy,
            busy_auth: Some(basic("prometheus:wrong")),
            busy_path: "/metrics".into(),
        },
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while hostile.held.load(Ordering::Relaxed) < 128 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(1));
    let held = hostile.held.load(Ordering::Relaxed);
    let tally = honest(
        addr,
        scrapers,
        rounds,
        Duration::from_secs(1),
        "/metrics",
        Some(&good),
    );
    let opened = hostile.opened.load(Ordering::Relaxed);
    let answers: Vec<u64> = hostile
        .answers
        .iter()
        .map(|a| a.load(Ordering::Relaxed))
        .collect();
    drop(hostile);
    println!(
        "{scrapers} honest scrapers x {rounds} rounds beside a hostile user holding {held} connections \
         ({idle} idle, {slow} slowloris, {busy} busy; {opened} opened): {} of {} scrapes failed, \
         {} refused {:?}; the attacker's requests were answered 401 {}, 429 {}, 503 {}, other {}",
        tally.failed,
        tally.scrapes,
        tally.refused,
        tally.examples,
        answers[0],
        answers[1],
        answers[2],
        answers[3]
    );
    figure("lockout.honest_failed", tally.failed as f64, "scrapes");
    figure("lockout.honest_refused", tally.refused as f64, "scrapes");
    let _ = child.kill();
    let _ = child.wait();
}
