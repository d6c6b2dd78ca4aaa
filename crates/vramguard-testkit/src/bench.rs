//! What every benchmark shares: its size and its machine-readable figures.
//!
//! `VRAMGUARD_BENCH_SIZE=tiny` (set by `scripts/bench.sh --tiny`, which `scripts/test.sh`
//! runs) shrinks each benchmark to a few seconds, so that every one of them still compiles
//! and runs in the suite; `full` (the default, and `scripts/bench.sh`) is the size the
//! README's figures come from. A parameter's own variable (`PROCS=500`) wins over both.
//!
//! Each figure the README quotes is printed once more as `BENCH <name> <value> <unit>`;
//! `scripts/bench.sh` collects these lines and puts each beside its target in
//! `docs/bench-targets.tsv`. A figure a run cannot measure (a tool is missing, the soak is
//! off) is printed as `BENCH-SKIP <name> <why>`.

use std::sync::OnceLock;

/// The size a benchmark runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    /// The README's size: minutes per benchmark.
    Full,
    /// Seconds per benchmark: the suite's check that it still runs.
    Tiny,
}

/// The size from `VRAMGUARD_BENCH_SIZE` (`full` when unset); panics on any other value, so
/// that a typo never runs a full-size benchmark in the suite.
pub fn size() -> Size {
    static SIZE: OnceLock<Size> = OnceLock::new();
    *SIZE.get_or_init(|| match std::env::var("VRAMGUARD_BENCH_SIZE").as_deref() {
        Err(_) | Ok("full") | Ok("") => Size::Full,
        Ok("tiny") => Size::Tiny,
        Ok(other) => panic!("VRAMGUARD_BENCH_SIZE={other}: expected tiny or full"),
    })
}

/// `full` or `tiny` by [`size`].
pub fn sized<T>(full: T, tiny: T) -> T {
    match size() {
        Size::Full => full,
        Size::Tiny => tiny,
    }
}

/// The parameter `name` from the environment, else `full` or `tiny` by [`size`].
pub fn param<T: std::str::FromStr>(name: &str, full: T, tiny: T) -> T {
    crate::env_or(name, sized(full, tiny))
}

/// Prints a figure for `scripts/bench.sh`: `BENCH <name> <value> <unit>`.
pub fn figure(name: &str, value: f64, unit: &str) {
    println!("BENCH {name} {value} {unit}");
}

/// Prints that a figure was not measured in this run, and why.
pub fn skipped(name: &str, why: &str) {
    println!("BENCH-SKIP {name} {why}");
}
