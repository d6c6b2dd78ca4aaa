//! `status` and `diagnose`, once or refreshed (`--watch`): one node kept open between
//! refreshes, so that later ones scan only processes not seen before.

use crate::gpusel::GpuSelector;
use crate::settings::Settings;
use anyhow::{Result, bail};
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};
use vramguard_core::{Report, classify};
use vramguard_node::Node;
use vramguard_proc::ScanDepth;

/// Keeps only the GPUs `wanted` names (all when empty); an index the node does not have is
/// an error that says how many it has.
pub fn select_gpus(report: &mut Report, wanted: &[GpuSelector]) -> Result<()> {
    let selection = crate::gpusel::resolve_in_report(wanted, report)?;
    if !wanted.is_empty() {
        report.gpus.retain(|g| selection.gpus.contains(&g.index));
    }
    Ok(())
}

/// How much of the node a one-shot report reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// Every process's open files (`diagnose`, `status --full-scan`).
    Full,
    /// The driver's listed processes, and every process only when they leave something
    /// unexplained (`status`; see [`vramguard_core::scan_need`]).
    ListedFirst,
}

/// Prints `render(report)` once, or every `interval` until interrupted: on a terminal the
/// screen is redrawn in place, piped each refresh is its own block.
pub fn each_report(
    settings: &Settings,
    sample: Duration,
    interval: Option<Duration>,
    gpus: &[GpuSelector],
    scan: Scan,
    mut render: impl FnMut(Report) -> Result<String>,
) -> Result<()> {
    let Some(interval) = interval else {
        let (_, mut report) = match scan {
            Scan::Full => settings.report(sample)?,
            Scan::ListedFirst => settings.report_listed_first(sample)?,
        };
        select_gpus(&mut report, gpus)?;
        return write_out(&render(report)?);
    };
    if settings.replay.is_some() {
        bail!("--watch refreshes a live node; a replayed snapshot never changes (drop --watch)");
    }
    let mut node = settings.node(settings.policy(), None)?;
    let terminal = std::io::stdout().is_terminal();
    let mut depth = ScanDepth::Full;
    loop {
        let started = Instant::now();
        let mut report = match scan {
            Scan::Full => {
                let snap = node.sampled_snapshot(depth, sample)?;
                depth = ScanDepth::NewProcesses;
                classify(&snap, settings.policy())
            }
            // Each refresh from the listed processes while they explain every byte; the
            // first that needs more scans every process, later ones the new processes.
            Scan::ListedFirst => {
                let view =
                    vramguard_ops::view::status_view(&mut node, settings.policy(), sample, depth)?;
                if view.deeper.is_some() {
                    depth = ScanDepth::NewProcesses;
                }
                view.report
            }
        };
        select_gpus(&mut report, gpus)?;
        let text = render(report)?;
        if terminal {
            // Home, clear, then the block: no scrolling history of stale screens.
            write_out(&format!("\x1b[H\x1b[2J{text}"))?;
        } else {
            write_out(&format!("{text}\n"))?;
        }
        std::thread::sleep(interval.saturating_sub(started.elapsed()));
    }
}

/// Writes to stdout; a closed pipe (`| head`) ends the command quietly.
fn write_out(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        other => Ok(other?),
    }
}
