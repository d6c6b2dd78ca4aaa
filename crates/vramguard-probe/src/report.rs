//! The probe's report: `report.md` (the summary), `report.json` (everything, raw samples
//! included) and SVG plots of memory against time around each kill.

use crate::ProbeError;
use crate::experiments::{Concurrent, Soak, Trial};
use crate::sampler::Sample;
use plotters::prelude::*;
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use vramguard_core::sanitize::shown;
use vramguard_core::units::format_bytes;

/// The GPU measured.
#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    /// Index.
    pub index: u32,
    /// Name.
    pub name: Option<String>,
    /// UUID.
    pub uuid: Option<String>,
    /// PCI bus id.
    pub pci_bus_id: Option<String>,
    /// Total memory.
    pub total: Option<u64>,
}

/// What was measured.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Results {
    /// `probe release`.
    Release {
        /// Trials.
        trials: Vec<Trial>,
    },
    /// `probe concurrent`.
    Concurrent(Concurrent),
    /// `probe soak`.
    Soak(Soak),
}

/// Everything about one probe run.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeReport {
    /// [`vramguard_core::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The command line.
    pub command: String,
    /// Host name.
    pub hostname: Option<String>,
    /// Driver version (`simulated` appended for the simulated driver).
    pub driver_version: Option<String>,
    /// The GPU.
    pub gpu: GpuInfo,
    /// `cuda`, `simulated` or the user's command.
    pub holder: String,
    /// Bytes per holder.
    pub bytes: u64,
    /// Nominal sampling period, ms.
    pub period_ms: f64,
    /// Achieved sampling rate, readings per second.
    pub achieved_hz: f64,
    /// The results.
    pub results: Results,
    /// Every reading: (ms since the epoch, used bytes).
    pub samples: Vec<(f64, Option<u64>)>,
}

/// Nearest-rank percentile of unsorted values.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    Some(v[rank.min(v.len()) - 1])
}

fn ms(v: Option<f64>) -> String {
    v.map_or("—".into(), |v| format!("{v:.0}"))
}

/// The achieved sampling rate.
pub fn achieved_hz(samples: &[Sample]) -> f64 {
    match (samples.first(), samples.last()) {
        (Some(a), Some(b)) if b.t_ms > a.t_ms => {
            samples.len() as f64 / ((b.t_ms - a.t_ms) / 1000.0)
        }
        _ => 0.0,
    }
}

/// The Markdown summary (also printed on the terminal).
pub fn markdown(r: &ProbeReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# vramguard probe: {}",
        match &r.results {
            Results::Release { .. } => "release",
            Results::Concurrent(_) => "concurrent",
            Results::Soak(_) => "soak",
        }
    );
    let _ = writeln!(out);
    // Text from the command line and the driver, escaped: the summary is printed on a
    // terminal (JSON keeps it exact).
    let _ = writeln!(out, "- command: `{}`", shown(&r.command));
    let _ = writeln!(
        out,
        "- GPU {}: {} ({}), driver {}",
        r.gpu.index,
        shown(r.gpu.name.as_deref().unwrap_or("?")),
        shown(r.gpu.uuid.as_deref().unwrap_or("?")),
        shown(r.driver_version.as_deref().unwrap_or("?"))
    );
    let _ = writeln!(
        out,
        "- holder: {}, {} each",
        shown(&r.holder),
        format_bytes(r.bytes)
    );
    let _ = writeln!(
        out,
        "- sampling: every {:.1} ms (achieved {:.0} Hz)",
        r.period_ms, r.achieved_hz
    );
    let _ = writeln!(out);
    match &r.results {
        Results::Release { trials } => release_table(&mut out, trials),
        Results::Concurrent(c) => concurrent_table(&mut out, c),
        Results::Soak(s) => soak_table(&mut out, s),
    }
    out
}

/// The release experiment: one row per signal.
fn release_table(out: &mut String, trials: &[Trial]) {
    let _ = writeln!(
        out,
        "| signal | n | released | release ms (min / median / p95 / max) | driver lag ms (median) | exit ms (median) | leftover | orphans kept memory |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    let mut names: Vec<&str> = Vec::new();
    for t in trials {
        if !names.contains(&t.signal.as_str()) {
            names.push(&t.signal);
        }
    }
    for name in names {
        let ts: Vec<&Trial> = trials.iter().filter(|t| t.signal == name).collect();
        let rel: Vec<f64> = ts.iter().filter_map(|t| t.release_ms).collect();
        let lag: Vec<f64> = ts.iter().filter_map(|t| t.driver_lag_ms).collect();
        let exit: Vec<f64> = ts.iter().filter_map(|t| t.exit_ms).collect();
        let leftover: u64 = ts.iter().map(|t| t.leftover_bytes).max().unwrap_or(0);
        let _ = writeln!(
            out,
            "| SIG{name} | {} | {}/{} | {} / {} / {} / {} | {} | {} | {} | {} |",
            ts.len(),
            ts.iter().filter(|t| t.released).count(),
            ts.len(),
            ms(percentile(&rel, 0.0)),
            ms(percentile(&rel, 50.0)),
            ms(percentile(&rel, 95.0)),
            ms(percentile(&rel, 100.0)),
            ms(percentile(&lag, 50.0)),
            ms(percentile(&exit, 50.0)),
            format_bytes(leftover),
            if ts.iter().any(|t| t.orphans_kept_memory) {
                "yes"
            } else {
                "no"
            }
        );
    }
}

/// The concurrent experiment: per-kill release times and what remained.
fn concurrent_table(out: &mut String, c: &Concurrent) {
    let rel: Vec<f64> = c.kills.iter().filter_map(|k| k.release_ms).collect();
    let _ = writeln!(
        out,
        "| kills | per-kill release ms (min / median / p95 / max) | total ms | leftover |"
    );
    let _ = writeln!(out, "|---|---|---|---|");
    let _ = writeln!(
        out,
        "| {} | {} / {} / {} / {} | {} | {} |",
        c.kills.len(),
        ms(percentile(&rel, 0.0)),
        ms(percentile(&rel, 50.0)),
        ms(percentile(&rel, 95.0)),
        ms(percentile(&rel, 100.0)),
        ms(c.total_ms),
        format_bytes(c.leftover_bytes)
    );
    if c.leftover_bytes > 0 {
        let _ = writeln!(
            out,
            "\n**{} remained with no process after every holder was gone.**",
            format_bytes(c.leftover_bytes)
        );
    }
    let _ = writeln!(out, "\nkill order seed: {}", c.seed);
}

/// The soak: the baseline's trend over the cycles.
fn soak_table(out: &mut String, s: &Soak) {
    let _ = writeln!(
        out,
        "| cycles | baseline start | baseline end | trend (per hour, 95% CI) |"
    );
    let _ = writeln!(out, "|---|---|---|---|");
    let trend = match &s.trend_bytes_per_hour {
        Some(t) => format!(
            "{:+.1} MiB/h [{:+.1}, {:+.1}]{}",
            t.slope / 1048576.0,
            t.ci_low / 1048576.0,
            t.ci_high / 1048576.0,
            if t.rising() { ": **growing**" } else { "" }
        ),
        None => "— (fewer than 3 cycles)".into(),
    };
    let _ = writeln!(
        out,
        "| {} | {} | {} | {trend} |",
        s.cycles.len(),
        format_bytes(s.baseline_start),
        format_bytes(s.baseline_end)
    );
}

fn plot(
    path: &Path,
    title: &str,
    series: &[(String, Vec<(f64, f64)>)],
    markers: &[f64],
    x_desc: &str,
    line: Option<(f64, f64, f64, f64)>,
) -> Result<(), ProbeError> {
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0.0f64);
    for (_, pts) in series {
        for (x, y) in pts {
            x0 = x0.min(*x);
            x1 = x1.max(*x);
            y1 = y1.max(*y);
        }
    }
    if x0 >= x1 {
        x0 = 0.0;
        x1 = 1.0;
    }
    let y1 = (y1 * 1.1).max(1.0);
    let root = SVGBackend::new(path, (900, 450)).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| ProbeError::Plot {
        path: path.to_path_buf(),
        cause: e.to_string(),
    };
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, 0f64..y1)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("used GiB")
        .draw()
        .map_err(|e| err(&e))?;
    let palette = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = palette[i % palette.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color))
            .map_err(|e| err(&e))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
    }
    for m in markers {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(*m, 0.0), (*m, y1)],
                RED.mix(0.5),
            )))
            .map_err(|e| err(&e))?;
    }
    if let Some((ax, ay, bx, by)) = line {
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(ax, ay), (bx, by)],
                BLACK.mix(0.6),
            )))
            .map_err(|e| err(&e))?
            .label("trend")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// The samples from `from` to `to` (ms), as (ms since `origin`, GiB used).
fn samples_between(r: &ProbeReport, from: f64, to: f64, origin: f64) -> Vec<(f64, f64)> {
    r.samples
        .iter()
        .filter(|(t, u)| *t >= from && *t <= to && u.is_some())
        .map(|(t, u)| (t - origin, gib(u.unwrap_or(0))))
        .collect()
}

/// One plot per signal of the release experiment, each trial a series around its signal.
fn release_plots(
    dir: &Path,
    r: &ProbeReport,
    trials: &[Trial],
) -> Result<Vec<PathBuf>, ProbeError> {
    let mut files = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for t in trials {
        if !names.contains(&t.signal) {
            names.push(t.signal.clone());
        }
    }
    for name in names {
        let series: Vec<(String, Vec<(f64, f64)>)> = trials
            .iter()
            .filter(|t| t.signal == name)
            .map(|t| {
                // This trial only: from just before its holder started to a little
                // after its memory came back.
                let next_start = trials
                    .iter()
                    .map(|o| o.t_start_ms)
                    .filter(|s| *s > t.t_start_ms)
                    .fold(f64::INFINITY, f64::min);
                let from = (t.t_signal_ms - 300.0).max(t.t_start_ms - 20.0);
                let to =
                    (t.t_signal_ms + t.release_ms.unwrap_or(5_000.0) + 200.0).min(next_start - 1.0);
                (
                    format!("SIG{} #{}", t.signal, t.repeat),
                    samples_between(r, from, to, t.t_signal_ms),
                )
            })
            .collect();
        let path = dir.join(format!("release-{}.svg", name.to_lowercase()));
        plot(
            &path,
            &format!(
                "GPU {}: used memory around SIG{name} (line: the signal)",
                r.gpu.index
            ),
            &series,
            &[0.0],
            "ms since the signal",
            None,
        )?;
        files.push(path);
    }
    Ok(files)
}

/// Writes `report.md`, `report.json` and the SVG plots into `dir`; returns the files.
pub fn write(dir: &Path, r: &ProbeReport) -> Result<Vec<PathBuf>, ProbeError> {
    let failed = |action: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |cause| ProbeError::Write {
            action,
            path,
            cause,
        }
    };
    std::fs::create_dir_all(dir).map_err(failed("creating", dir))?;
    let mut files = Vec::new();
    let md = dir.join("report.md");
    std::fs::write(&md, markdown(r)).map_err(failed("writing", &md))?;
    files.push(md);
    let json = dir.join("report.json");
    std::fs::write(
        &json,
        serde_json::to_vec_pretty(r).expect("report serialises"),
    )
    .map_err(failed("writing", &json))?;
    files.push(json);
    let points = |from: f64, to: f64, origin: f64| samples_between(r, from, to, origin);
    match &r.results {
        Results::Release { trials } => files.extend(release_plots(dir, r, trials)?),
        Results::Concurrent(c) => {
            let from = c.kills.first().map_or(0.0, |k| k.t_signal_ms) - 500.0;
            let to = r.samples.last().map_or(0.0, |s| s.0);
            let path = dir.join("concurrent.svg");
            let marks: Vec<f64> = c.kills.iter().map(|k| k.t_signal_ms - from).collect();
            plot(
                &path,
                &format!(
                    "GPU {}: used memory, {} holders killed (lines: kills)",
                    r.gpu.index,
                    c.kills.len()
                ),
                &[("used".into(), points(from, to, from))],
                &marks,
                "ms",
                None,
            )?;
            files.push(path);
        }
        Results::Soak(s) => {
            let pts: Vec<(f64, f64)> = s
                .cycles
                .iter()
                .map(|c| (c.t_ms / 1000.0, gib(c.baseline_after)))
                .collect();
            let line = s.trend_bytes_per_hour.and_then(|t| {
                let (a, b) = (pts.first()?.0, pts.last()?.0);
                let y = |x: f64| (t.intercept + t.slope * x / 3600.0) / (1u64 << 30) as f64;
                Some((a, y(a), b, y(b)))
            });
            let path = dir.join("soak.svg");
            plot(
                &path,
                &format!(
                    "GPU {}: baseline used memory per cycle, with its Theil–Sen trend",
                    r.gpu.index
                ),
                &[("baseline".into(), pts)],
                &[],
                "s",
                line,
            )?;
            files.push(path);
        }
    }
    Ok(files)
}
