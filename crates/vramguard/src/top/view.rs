//! Draws `top`'s screen from an [`App`]: pure, so that tests draw it on ratatui's
//! `TestBackend` from replayed snapshots.

use super::app::{App, Dialog, Row as AppRow};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Clear, Paragraph, Row, Table, TableState};
use std::collections::BTreeMap;
use vramguard_core::report::{Class, GpuReport, Tone};
use vramguard_core::sanitize::{cell, escape, fit};
use vramguard_core::units::format_bytes;

/// Colours, or none (`NO_COLOR`, `--monochrome`).
struct Paint {
    on: bool,
}

impl Paint {
    fn fg(&self, c: Color) -> Style {
        if self.on {
            Style::default().fg(c)
        } else {
            Style::default()
        }
    }
    fn class(&self, c: Class) -> Style {
        match c.info().tone {
            Tone::Ghost => self.fg(Color::Red).add_modifier(Modifier::BOLD),
            Tone::Unexplained => self.fg(Color::Yellow),
            Tone::Unused => self.fg(Color::Cyan),
            Tone::Working => self.fg(Color::Green),
            Tone::Service => self.fg(Color::DarkGray),
        }
    }
}

/// The text blocks around the table, each wrapped to the screen's width: their heights are
/// those of the wrapped text, so nothing that explains or asks is cut.
struct Blocks {
    title: Line<'static>,
    header: Vec<Line<'static>>,
    footer: Vec<Line<'static>>,
    status: Vec<Line<'static>>,
}

impl Blocks {
    fn new(app: &App, paint: &Paint, gpus: &[&GpuReport], width: u16) -> Blocks {
        Blocks {
            title: title_line(app, width),
            header: gpus
                .iter()
                .flat_map(|g| gpu_lines(paint, g, width))
                .collect(),
            footer: footer_lines(paint, gpus, width),
            status: status_lines(app, width),
        }
    }
}

/// Draws the whole screen.
pub fn draw(frame: &mut Frame, app: &App) {
    let paint = Paint {
        on: !app.monochrome,
    };
    let gpus = app.gpus();
    let area = frame.area();
    let blocks = Blocks::new(app, &paint, &gpus, area.width);
    // The table keeps three lines (its header and two rows); the status line its first; the
    // GPU header, then the footer, give way on a screen too small for all.
    let status_height = (blocks.status.len() as u16).clamp(1, 3);
    let room = area.height.saturating_sub(1 + 3 + status_height);
    let header_height = (blocks.header.len() as u16).min(room);
    let footer_height = (blocks.footer.len() as u16).min(room - header_height);
    let [title, header, table, footer, status] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(header_height),
        Constraint::Min(3),
        Constraint::Length(footer_height),
        Constraint::Length(status_height),
    ])
    .areas(area);
    frame.render_widget(Paragraph::new(blocks.title), title);
    frame.render_widget(Paragraph::new(blocks.header), header);
    holders_table(frame, app, &paint, table);
    frame.render_widget(Paragraph::new(blocks.footer), footer);
    frame.render_widget(Paragraph::new(blocks.status), status);
    dialog(frame, app, &paint);
}

/// `text` wrapped to `width` columns as `render::wrap_lines` wraps prose (continuation lines
/// indented; a word wider than the line cut with `…`), one [`Line`] per row; the first `head`
/// characters of the first row in `head_style` (a label: "what frees it: ").
fn wrapped(text: &str, width: u16, head: usize, head_style: Style) -> Vec<Line<'static>> {
    crate::render::wrap_lines(text, usize::from(width.max(1)))
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let split = if i == 0 {
                l.char_indices().nth(head).map_or(l.len(), |(b, _)| b)
            } else {
                0
            };
            Line::from(vec![
                Span::styled(l[..split].to_string(), head_style),
                Span::raw(l[split..].to_string()),
            ])
        })
        .collect()
}

/// As many of `parts` as fit in `width`, whole, joined with ` · `; the first alone, cut with
/// `…`, when even it does not fit.
fn whole_parts(parts: &[String], width: u16) -> String {
    let width = usize::from(width);
    let mut out = String::new();
    for p in parts {
        let next = if out.is_empty() {
            p.clone()
        } else {
            format!("{out} · {p}")
        };
        if next.chars().count() > width {
            break;
        }
        out = next;
    }
    if out.is_empty() {
        return parts.first().map_or(String::new(), |p| fit(p, width));
    }
    out
}

fn title_line(app: &App, width: u16) -> Line<'static> {
    let (host, driver) = app.report.as_ref().map_or(("?".into(), "…".into()), |r| {
        (
            r.hostname.clone().unwrap_or_else(|| "?".into()),
            r.driver
                .driver_version
                .clone()
                .unwrap_or_else(|| "unknown".into()),
        )
    });
    let mut parts = vec![
        format!("vramguard top · {}", fit(&host, 32)),
        format!("driver {}", fit(&driver, 24)),
    ];
    if app.interactive {
        parts.push(format!("every {:.1}s", app.delay.as_secs_f64()));
    }
    parts.push(format!("sort {}", app.sort.name()));
    match (&app.class_filter, &app.user_filter) {
        (None, None) => {}
        (c, u) => parts.push(format!(
            "only {}{}",
            c.map_or(String::new(), |c| c.as_str().to_string()),
            u.as_ref()
                .map_or(String::new(), |u| format!(" user {}", fit(u, 16)))
        )),
    }
    let mut title = whole_parts(&parts, width);
    let hint = "  (? help, q quit)";
    if app.interactive && title.chars().count() + hint.chars().count() <= usize::from(width) {
        title.push_str(hint);
    }
    Line::from(title)
}

/// A GPU's header lines: name and memory bar (ghost in its own colour), then what
/// nvidia-smi shows beside it, wrapped to `width`.
fn gpu_lines(paint: &Paint, g: &GpuReport, width: u16) -> Vec<Line<'static>> {
    let name = format!(
        "GPU {} {} ",
        g.index,
        cell(g.name.as_deref().unwrap_or("unknown GPU"), 14)
    );
    let mut first = vec![Span::raw(name.clone())];
    match g.memory {
        Some(m) => {
            let sizes = format!("] {} / {}", format_bytes(m.used), format_bytes(m.total));
            let ghost_text = if g.ghost_bytes > 0 {
                format!("  ghost {}", format_bytes(g.ghost_bytes))
            } else {
                String::new()
            };
            // The bar takes what the name and the sizes leave (the sizes never give way).
            let rest =
                name.chars().count() + 1 + sizes.chars().count() + ghost_text.chars().count();
            let bar_width = usize::from(width)
                .saturating_sub(60)
                .clamp(10, 60)
                .min(usize::from(width).saturating_sub(rest))
                .max(5);
            let cells = |bytes: u64| {
                if m.total == 0 {
                    0
                } else {
                    ((bytes as f64 / m.total as f64) * bar_width as f64).round() as usize
                }
            };
            let ghost = cells(g.ghost_bytes.min(m.used)).min(bar_width);
            let used = cells(m.used).clamp(ghost, bar_width);
            first.push(Span::raw("["));
            first.push(Span::styled(
                "█".repeat(used - ghost),
                paint.fg(Color::Green),
            ));
            first.push(Span::styled("▓".repeat(ghost), paint.fg(Color::Red)));
            first.push(Span::styled(
                "░".repeat(bar_width - used),
                paint.fg(Color::DarkGray),
            ));
            first.push(Span::raw(sizes));
            if g.ghost_bytes > 0 {
                first.push(Span::styled(
                    ghost_text,
                    paint.fg(Color::Red).add_modifier(Modifier::BOLD),
                ));
            }
        }
        None => first.push(Span::styled(
            g.failure
                .as_ref()
                .map_or("memory unknown".to_string(), |f| {
                    escape(&f.to_string()).into_owned()
                }),
            paint.fg(Color::Red),
        )),
    }
    let mut lines = vec![Line::from(first)];
    lines.extend(telemetry_lines(paint, g, width));
    lines
}

/// What nvidia-smi shows beside the memory, then health flags, wrapped to `width`.
fn telemetry_lines(paint: &Paint, g: &GpuReport, width: u16) -> Vec<Line<'static>> {
    let t = g.telemetry.clone().unwrap_or_default();
    let na = || "n/a".to_string();
    let mut flags = Vec::new();
    if t.ecc_uncorrected_volatile.is_some_and(|n| n > 0) {
        flags.push("ECC errors".to_string());
    }
    if !g.health.xid_events.is_empty() {
        flags.push("Xid".to_string());
    }
    if g.health
        .remapped_rows
        .as_ref()
        .is_some_and(|r| r.pending || r.failure)
    {
        flags.push("row remap".to_string());
    }
    let text = format!(
        "      util {:>4}  mem {:>4}  {:>5}  {:>4} / {} W  {}  ECC {}  fan {}  {}  MIG {}  persist {}  {}",
        t.gpu_util_percent.map_or_else(na, |v| format!("{v}%")),
        t.memory_util_percent.map_or_else(na, |v| format!("{v}%")),
        t.temperature_c.map_or_else(na, |v| format!("{v}°C")),
        t.power_mw.map_or_else(na, |v| (v / 1000).to_string()),
        t.power_limit_mw.map_or_else(na, |v| (v / 1000).to_string()),
        t.performance_state
            .map_or_else(|| "P?".into(), |p| format!("P{p}")),
        match (
            t.ecc_enabled,
            t.ecc_corrected_volatile,
            t.ecc_uncorrected_volatile
        ) {
            (Some(true), Some(c), Some(u)) => format!("{c}/{u}"),
            (Some(true), _, _) => "on".into(),
            (Some(false), _, _) => "off".into(),
            (None, _, _) => na(),
        },
        t.fan_percent.map_or_else(na, |f| format!("{f}%")),
        t.compute_mode.as_deref().map_or_else(
            || "compute n/a".into(),
            |m| format!("compute {}", fit(m, 24))
        ),
        t.mig_enabled
            .map_or_else(na, |m| if m { "on".into() } else { "off".into() }),
        g.persistence_mode
            .map_or_else(na, |p| if p { "on".into() } else { "off".into() }),
        g.pci_bus_id.as_deref().map_or_else(na, |b| fit(b, 16)),
    );
    let mut lines = wrapped(&text, width, 0, Style::default());
    if !flags.is_empty() {
        let flags = format!("      ⚠ {}", flags.join(", "));
        let all = flags.chars().count();
        lines.extend(wrapped(&flags, width, all, paint.fg(Color::Red)));
    }
    lines
}

fn age(secs: Option<u64>) -> String {
    match secs {
        None => "n/a".into(),
        Some(s @ 0..60) => format!("{s}s"),
        Some(s @ 60..3600) => format!("{}m", s / 60),
        Some(s @ 3600..86400) => format!("{}h", s / 3600),
        Some(s) => format!("{}d", s / 86400),
    }
}

/// A holder's host memory, for its detail pane.
fn host_memory_line(h: &vramguard_core::Holder) -> String {
    let bytes = |b: Option<u64>| b.map_or_else(|| "n/a".to_string(), format_bytes);
    let m = h.host_memory.unwrap_or_default();
    format!(
        "host memory: RSS {}, locked {}, pinned {}, shared memory mapped {}",
        bytes(h.rss_bytes),
        bytes(m.locked_bytes),
        bytes(m.pinned_bytes),
        bytes(m.shm_bytes)
    )
}

/// The widest screens also show each holder's pinned (or locked) and shared host memory.
const HOST_COLUMNS_FROM: u16 = 150;

/// The table's columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Col {
    Pid,
    User,
    Gpu,
    Class,
    Job,
    GpuMem,
    Sm,
    Cpu,
    Rss,
    Pinned,
    Shm,
    Age,
    Command,
}

impl Col {
    fn title(self) -> &'static str {
        match self {
            Col::Pid => "PID",
            Col::User => "USER",
            Col::Gpu => "GPU",
            Col::Class => "CLASS",
            Col::Job => "JOB",
            Col::GpuMem => "GPU MEM",
            Col::Sm => "%SM",
            Col::Cpu => "CPU%",
            Col::Rss => "RSS",
            Col::Pinned => "PINNED",
            Col::Shm => "SHM",
            Col::Age => "AGE",
            Col::Command => "COMMAND",
        }
    }
}

/// The narrowest COMMAND column: enough to recognise the program.
const COMMAND_MIN: u16 = 12;
/// A size as `format_bytes` writes it, unit included: `1023.9 MiB`.
const SIZE_WIDTH: u16 = 10;
/// A pid (up to 4194304) or `pgid:` and one.
const PID_WIDTH: u16 = 7;

/// The table at one width: the columns shown, each one's width, and each row's JOB cell.
struct TableLayout {
    cols: Vec<(Col, u16)>,
    jobs: Vec<String>,
}

/// The columns shown at `width` and each one's width. Every cell fits its column whole
/// (a size with its unit, a pid) or is cut with `…` (a user, a command, a job); columns that
/// do not fit are left out whole, RSS first, then AGE (the details show both). The JOB
/// column widens (and CPU% then %SM make room) until no two different jobs look the same.
fn table_layout(app: &App, width: u16) -> TableLayout {
    let labels: Vec<String> = app.rows.iter().map(job_text).collect();
    let mut job: u16 = if width >= 100 { 18 } else { 12 };
    let mut cols = vec![
        (Col::Pid, PID_WIDTH),
        (Col::User, if width >= 100 { 10 } else { 8 }),
        (Col::Gpu, 3),
        (Col::Class, 8),
        (Col::Job, 0),
        (Col::GpuMem, SIZE_WIDTH),
        (Col::Sm, 4),
        (Col::Cpu, 6),
        (Col::Rss, SIZE_WIDTH),
    ];
    if width >= HOST_COLUMNS_FROM {
        cols.extend([(Col::Pinned, SIZE_WIDTH), (Col::Shm, SIZE_WIDTH)]);
    }
    cols.push((Col::Age, 4));
    // The selection mark (when a row is selected), then one blank between columns.
    let mark = u16::from(selects(app));
    let used = |cols: &[(Col, u16)], job: u16| -> u16 {
        mark + cols.iter().map(|(_, w)| w + 1).sum::<u16>() + job
    };
    let mut droppable = [Col::Rss, Col::Age, Col::Cpu, Col::Sm].into_iter();
    loop {
        let fits = |job| used(&cols, job) + COMMAND_MIN <= width;
        let clash = !distinct_when_cut(&labels, usize::from(job));
        if fits(job) && !clash {
            break;
        }
        if clash && fits(job + 1) {
            job += 1;
            continue;
        }
        match droppable.next() {
            Some(drop) => cols.retain(|(c, _)| *c != drop),
            None => break,
        }
    }
    let command = width.saturating_sub(used(&cols, job)).max(COMMAND_MIN);
    for (c, w) in cols.iter_mut() {
        if *c == Col::Job {
            *w = job;
        }
    }
    cols.push((Col::Command, command));
    TableLayout {
        cols,
        jobs: unique_cuts(&labels, usize::from(job)),
    }
}

/// `text` cut to `width` in its middle, `…` in place of what is left out: job labels and pod
/// names differ at their ends (`pgid:20513`, `…-7d9f8-abcde`).
fn fit_middle(text: &str, width: usize) -> String {
    let chars: Vec<char> = text.chars().collect();
    if chars.len() <= width {
        return text.to_string();
    }
    let tail = width.saturating_sub(1) / 2;
    let head = width.saturating_sub(1) - tail;
    let mut out: String = chars[..head].iter().collect();
    out.push('…');
    out.extend(&chars[chars.len() - tail..]);
    out
}

/// Whether `labels` that differ still differ when each is cut to `width`.
fn distinct_when_cut(labels: &[String], width: usize) -> bool {
    let mut seen: BTreeMap<String, &str> = BTreeMap::new();
    labels.iter().all(|l| {
        let cut = fit_middle(l, width);
        *seen.entry(cut).or_insert(l) == l.as_str()
    })
}

/// Each label cut to `width`; where different labels would still look the same (the screen
/// had no room to widen the column), each of them ends in `~1`, `~2`… in its order.
fn unique_cuts(labels: &[String], width: usize) -> Vec<String> {
    let mut by_cut: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for l in labels {
        let group = by_cut.entry(fit_middle(l, width)).or_default();
        if !group.contains(&l.as_str()) {
            group.push(l);
        }
    }
    labels
        .iter()
        .map(|l| {
            let cut = fit_middle(l, width);
            let group = &by_cut[&cut];
            match group.iter().position(|g| g == l) {
                Some(i) if group.len() > 1 => {
                    let n = format!("~{}", i + 1);
                    format!("{}{n}", fit_middle(l, width.saturating_sub(n.len())))
                }
                _ => cut,
            }
        })
        .collect()
}

/// A row's JOB cell before it is cut: the pod by its names (from the kubelet), else the
/// container by its runtime's name, else the job.
fn job_text(r: &AppRow) -> String {
    if let Some(j) = &r.job {
        return escape(&j.label).into_owned();
    }
    let h = &r.holder;
    let text = h
        .pod
        .as_ref()
        .map(|p| format!("{}/{}", p.namespace, p.name))
        .or_else(|| {
            h.container.as_ref().map(|c| {
                format!(
                    "{}:{}",
                    c.runtime,
                    c.name.as_deref().unwrap_or(c.id.as_str())
                )
            })
        })
        .or_else(|| h.job.as_ref().map(|j| j.label.clone()))
        .unwrap_or_else(|| "-".into());
    escape(&text).into_owned()
}

fn table_row(
    paint: &Paint,
    r: &AppRow,
    job: &str,
    tree: bool,
    cols: &[(Col, u16)],
) -> Row<'static> {
    let h = &r.holder;
    let cell = |col: Col, width: u16| -> Cell<'static> {
        let w = usize::from(width);
        if let Some(j) = &r.job {
            let style = if j.alive == Some(false) {
                paint.fg(Color::Red).add_modifier(Modifier::BOLD)
            } else {
                Style::default().add_modifier(Modifier::BOLD)
            };
            let state = match j.alive {
                Some(true) => "alive",
                Some(false) => "gone",
                None => "unknown",
            };
            return match col {
                Col::Pid => Cell::from("job").style(style),
                Col::Class => Cell::from(state).style(style),
                Col::Job => Cell::from(job.to_string()).style(style),
                Col::GpuMem => Cell::from(format_bytes(j.bytes)),
                Col::Command => Cell::from(fit(&format!("{} holder row(s)", j.members), w)),
                _ => Cell::from(""),
            };
        }
        match col {
            Col::Pid => Cell::from(h.pid.to_string()),
            Col::User => Cell::from(fit(h.user.as_deref().unwrap_or("-"), w)),
            Col::Gpu => Cell::from(r.gpu.to_string()),
            Col::Class => Cell::from(h.class.as_str()).style(paint.class(h.class)),
            Col::Job => Cell::from(job.to_string()),
            Col::GpuMem => Cell::from(match (h.listed, h.used_bytes) {
                (_, Some(b)) => format_bytes(b),
                (true, None) => "n/a".into(),
                (false, None) => "unlisted".into(),
            }),
            Col::Sm => Cell::from(r.sm_percent.map_or("n/a".into(), |s| format!("{s}%"))),
            Col::Cpu => Cell::from(h.cpu_millicores.map_or("n/a".into(), |mc| {
                let percent = mc as f64 / 10.0;
                if percent >= 1000.0 {
                    format!("{percent:.0}")
                } else {
                    format!("{percent:.1}")
                }
            })),
            Col::Rss => Cell::from(h.rss_bytes.map_or("n/a".into(), format_bytes)),
            Col::Pinned => {
                let m = h.host_memory.unwrap_or_default();
                let pinned = match (m.pinned_bytes, m.locked_bytes) {
                    (None, None) => None,
                    (p, l) => Some(p.unwrap_or(0).max(l.unwrap_or(0))),
                };
                Cell::from(pinned.map_or("n/a".into(), format_bytes))
            }
            Col::Shm => Cell::from(
                h.host_memory
                    .unwrap_or_default()
                    .shm_bytes
                    .map_or("n/a".into(), format_bytes),
            ),
            Col::Age => Cell::from(age(h.age_secs)),
            Col::Command => {
                let mark = if tree { "└ " } else { "" };
                Cell::from(format!(
                    "{mark}{}",
                    fit(h.shown_command(), w.saturating_sub(mark.chars().count()))
                ))
            }
        }
    };
    Row::new(cols.iter().map(|(c, w)| cell(*c, *w)).collect::<Vec<_>>())
}

/// Whether a row is selected, and so the table has the selection mark's column.
fn selects(app: &App) -> bool {
    !app.rows.is_empty() && app.interactive
}

fn holders_table(frame: &mut Frame, app: &App, paint: &Paint, area: Rect) {
    let TableLayout { cols, jobs } = table_layout(app, area.width);
    let header = Row::new(cols.iter().map(|(c, _)| c.title()).collect::<Vec<_>>())
        .style(Style::default().add_modifier(Modifier::BOLD | Modifier::REVERSED));
    let rows: Vec<Row> = app
        .rows
        .iter()
        .zip(&jobs)
        .map(|(r, job)| table_row(paint, r, job, app.tree, &cols))
        .collect();
    let empty = rows.is_empty();
    let table = Table::new(rows, cols.iter().map(|(_, w)| Constraint::Length(*w)))
        .header(header)
        .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED))
        .highlight_symbol("▶");
    let mut state = TableState::default();
    if selects(app) {
        state.select(Some(app.selected));
    }
    frame.render_stateful_widget(table, area, &mut state);
    if empty && app.report.is_some() {
        let inner = Rect {
            y: area.y + 1,
            height: area.height.saturating_sub(1),
            ..area
        };
        frame.render_widget(
            Paragraph::new("  no process holds these GPUs").style(paint.fg(Color::DarkGray)),
            inner,
        );
    }
}

/// The unaccounted memory of each GPU that has some, with its explanation, wrapped: the
/// explanation ends with what to do about it.
fn footer_lines(paint: &Paint, gpus: &[&GpuReport], width: u16) -> Vec<Line<'static>> {
    gpus.iter()
        .filter_map(|g| {
            g.unaccounted
                .as_ref()
                .filter(|u| u.significant)
                .map(|u| (g, u))
        })
        .flat_map(|(g, u)| {
            let head = format!(
                "GPU {}: {} {} ",
                g.index,
                format_bytes(u.bytes),
                if u.counts_as_ghost() {
                    "ghost"
                } else if u.is_unexplained() {
                    "unseen"
                } else {
                    "unsplit"
                }
            );
            let text = format!(
                "{head}{}",
                escape(u.explanation.get(1).map_or("", String::as_str))
            );
            wrapped(&text, width, head.chars().count(), paint.fg(Color::Red))
        })
        .collect()
}

/// The status line: a message (wrapped), or the counts and as many whole key hints as fit.
fn status_lines(app: &App, width: u16) -> Vec<Line<'static>> {
    match (&app.message, &app.report) {
        (Some(m), _) => wrapped(&escape(m), width, 0, Style::default()),
        (None, None) => vec![Line::from("reading the node…")],
        (None, Some(r)) => {
            let mut parts = vec![
                format!(
                    "{} holder(s)",
                    app.rows.iter().filter(|r| r.job.is_none()).count()
                ),
                format!("ghost {}", format_bytes(r.ghost_bytes())),
            ];
            if app.interactive {
                parts.extend(
                    [
                        "? help",
                        "↑↓ select",
                        "Enter details",
                        "r reclaim",
                        "s sort",
                        "t tree",
                        "c class",
                        "u user",
                    ]
                    .map(String::from),
                );
            }
            vec![Line::from(whole_parts(&parts, width))]
        }
    }
}

/// A dialog as drawn: where, its title, its body (wrapped to its width; scrolled when
/// taller than the box) and its prompt (wrapped, always in view under the body).
struct Popup {
    rect: Rect,
    title: String,
    body: Vec<Line<'static>>,
    prompt: Vec<Line<'static>>,
}

impl Popup {
    /// Centred on `area`, as tall as its wrapped text or the screen allows. The prompt is
    /// `(text, head, style)`: its first `head` characters in `style`.
    fn new(area: Rect, title: &str, body: &str, prompt: &[(&str, usize, Style)]) -> Popup {
        let width = area.width.saturating_sub(4).min(110);
        let inner = width.saturating_sub(2);
        let body = wrapped(body, inner, 0, Style::default());
        let prompt: Vec<Line<'static>> = prompt
            .iter()
            .flat_map(|(text, head, style)| wrapped(text, inner, *head, *style))
            .collect();
        let want = body.len() + prompt.len() + 2;
        let height = (want as u16).min(area.height.saturating_sub(2));
        Popup {
            rect: Rect {
                x: area.x + (area.width - width) / 2,
                y: area.y + (area.height.saturating_sub(height)) / 2,
                width,
                height,
            },
            title: title.to_string(),
            body,
            prompt,
        }
    }

    /// The rows the body gets: the box less its borders and the prompt.
    fn body_height(&self) -> u16 {
        self.rect
            .height
            .saturating_sub(2)
            .saturating_sub(self.prompt.len() as u16)
    }

    /// How far the body scrolls: the lines it has beyond its rows.
    fn scroll_max(&self) -> u16 {
        (self.body.len() as u16).saturating_sub(self.body_height())
    }

    fn draw(self, frame: &mut Frame, scroll: u16) {
        let scroll = scroll.min(self.scroll_max());
        let body_height = self.body_height();
        let mut block = Block::default()
            .borders(Borders::ALL)
            .title(self.title.clone());
        if self.scroll_max() > 0 {
            let last = (scroll + body_height).min(self.body.len() as u16);
            block = block.title_bottom(format!(
                " lines {}-{last} of {} · ↑↓ PgUp PgDn scroll ",
                scroll + 1,
                self.body.len()
            ));
        }
        let inner = block.inner(self.rect);
        frame.render_widget(Clear, self.rect);
        frame.render_widget(block, self.rect);
        let [body, prompt] = Layout::vertical([
            Constraint::Length(body_height),
            Constraint::Length(self.prompt.len() as u16),
        ])
        .areas(inner);
        frame.render_widget(Paragraph::new(self.body).scroll((scroll, 0)), body);
        frame.render_widget(Paragraph::new(self.prompt), prompt);
    }
}

/// Every line of `text` through the sanitiser: a plan or an outcome carries
/// process-supplied names.
fn escape_lines(text: &str) -> String {
    text.lines().map(escape).collect::<Vec<_>>().join("\n")
}

/// The open dialog, laid out on `area`; `None` when none is open.
fn popup_of(app: &App, paint: &Paint, area: Rect) -> Option<Popup> {
    let bold_yellow = paint.fg(Color::Yellow).add_modifier(Modifier::BOLD);
    let closes = [("any other key closes", 0, Style::default())];
    Some(match &app.dialog {
        Dialog::None => return None,
        Dialog::Help => Popup::new(
            area,
            " keys ",
            "↑/↓ j/k  select          PgUp/PgDn  page          Home/End g/G  first/last\n\
             Enter    details of the selected holder (its evidence)\n\
             r        reclaim the selected holder's job: the plan `vramguard reclaim` makes, \
             acted on only after y\n\
             s        sort: attention, memory, %SM, CPU, age, pid\n\
             t        tree: holders under their job\n\
             c        only one class (cycles)      u  only the selected holder's user\n\
             q, Ctrl-C  quit",
            &closes,
        ),
        Dialog::Detail => {
            let r = app.selected_row()?;
            let h = &r.holder;
            let mut body = format!(
                "pid {}  {}  GPU {}  class {}  age {}\n{}\n{}\n\n",
                h.pid,
                fit(h.user.as_deref().unwrap_or("-"), 16),
                r.gpu,
                h.class.as_str(),
                age(h.age_secs),
                fit(h.shown_command(), 500),
                host_memory_line(h),
            );
            for e in &h.evidence {
                body.push_str(&format!("• {}\n", escape(e)));
            }
            body.push('\n');
            // What frees it is the point of the dialog: it stays in view under the body.
            let label = "what frees it: ";
            let frees = format!("{label}{}", escape(&h.action.summary));
            Popup::new(
                area,
                " holder ",
                &body,
                &[(&frees, label.chars().count(), paint.fg(Color::Yellow))],
            )
        }
        Dialog::Planning(pid) => Popup::new(
            area,
            " reclaim ",
            &format!("sampling the node and planning the reclaim of pid {pid}'s job…"),
            &[],
        ),
        Dialog::Confirm {
            text, actionable, ..
        } => {
            let prompt = if *actionable {
                "y: signal them (SIGTERM, grace, SIGKILL; audited)   any other key: cancel"
            } else {
                "nothing to signal: any key closes"
            };
            Popup::new(
                area,
                " reclaim plan ",
                &format!("{}\n\n", escape_lines(text)),
                &[(prompt, prompt.chars().count(), bold_yellow)],
            )
        }
        Dialog::Running => Popup::new(
            area,
            " reclaim ",
            "signalling and waiting for the memory to come back…",
            &[],
        ),
        Dialog::Outcome(text) => Popup::new(
            area,
            " reclaim done ",
            &format!("{}\n\n", escape_lines(text)),
            &closes,
        ),
    })
}

fn dialog(frame: &mut Frame, app: &App, paint: &Paint) {
    if let Some(p) = popup_of(app, paint, frame.area()) {
        p.draw(frame, app.dialog_scroll);
    }
}

/// How far the open dialog's body can scroll on a `width` × `height` screen.
pub fn dialog_scroll_max(app: &App, width: u16, height: u16) -> u16 {
    let paint = Paint { on: false };
    popup_of(app, &paint, Rect::new(0, 0, width, height)).map_or(0, |p| p.scroll_max())
}

/// One screen as plain text, `width` columns, as tall as its content: `top --once`.
pub fn as_text(app: &App, width: u16) -> String {
    let gpus = app.gpus();
    let blocks = Blocks::new(app, &Paint { on: false }, &gpus, width);
    // Title, the GPU header, the table's header and rows (room for its empty line), the
    // footer and the status line.
    let height = 1
        + blocks.header.len() as u16
        + 1
        + app.rows.len().max(2) as u16
        + blocks.footer.len() as u16
        + (blocks.status.len() as u16).clamp(1, 3);
    text_of(app, width, height)
}

/// The screen drawn on a `width` × `height` off-screen buffer, one line per row, trailing
/// blanks cut.
fn text_of(app: &App, width: u16, height: u16) -> String {
    let mut terminal = ratatui::Terminal::new(ratatui::backend::TestBackend::new(width, height))
        .expect("an off-screen buffer never fails");
    let _ = terminal.draw(|f| draw(f, app));
    let buffer = terminal.backend().buffer();
    (0..height)
        .map(|y| {
            let line: String = (0..width)
                .map(|x| buffer[(x, y)].symbol().to_string())
                .collect();
            format!("{}\n", line.trim_end())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    //! The main screens drawn on ratatui's `TestBackend` from a replayed incident (the demo's:
    //! an orphaned job, a hidden DataLoader worker, an idle kernel, driver residue), compared
    //! with golden text in `tests/screens/` (`scripts/update-golden.sh` rewrites them).
    use super::super::app::{App, Dialog, Key};
    use std::path::PathBuf;
    use vramguard_core::plan::plan_reclaim;
    use vramguard_core::snapshot::Snapshot;
    use vramguard_core::{Policy, classify};

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
    }

    fn demo() -> (Snapshot, App) {
        let path = root().join("tests/incidents/demo.json");
        let snap: Snapshot = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let report = classify(&snap, &Policy::default());
        let mut app = App::new(std::time::Duration::from_secs(1), Vec::new(), true);
        app.update(&snap, report);
        (snap, app)
    }

    fn screen(app: &App, width: u16, height: u16) -> String {
        super::text_of(app, width, height)
    }

    /// Compares with `tests/screens/NAME.txt`, or writes it when updating the goldens.
    fn golden(name: &str, text: &str) {
        let path = root().join("tests/screens").join(format!("{name}.txt"));
        if std::env::var_os("VRAMGUARD_UPDATE_GOLDEN").is_some() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, text).unwrap();
            return;
        }
        let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (scripts/update-golden.sh writes it)",
                path.display()
            )
        });
        assert_eq!(text, want, "{name} differs from {}", path.display());
    }

    #[test]
    fn the_main_screen_at_80_120_and_200_columns() {
        let (_, app) = demo();
        for width in [80, 120, 200] {
            let text = screen(&app, width, 30);
            assert!(
                text.lines()
                    .all(|l| l.chars().count() <= usize::from(width)),
                "{text}"
            );
            golden(&format!("top-main-{width}"), &text);
        }
        let text = screen(&app, 120, 30);
        // The orphans of the killed trainer sort first, with their GPU memory; the ghost
        // memory is in the GPU header and the footer explains the unaccounted part.
        let first_row = text.lines().find(|l| l.starts_with('▶')).unwrap();
        assert!(first_row.contains("orphan"), "{text}");
        assert!(text.contains("ghost 18.0 GiB"), "{text}");
        assert!(text.contains("GPU 1: 6.0 GiB ghost"), "{text}");
    }

    #[test]
    fn the_detail_help_and_plan_dialogs() {
        let (snap, mut app) = demo();
        app.key(Key::Enter);
        assert_eq!(app.dialog, Dialog::Detail);
        golden("top-detail", &screen(&app, 120, 30));
        app.key(Key::Esc);
        app.key(Key::Char('?'));
        golden("top-help", &screen(&app, 120, 30));
        app.key(Key::Esc);
        // The plan `r` shows: the selected orphan's job only, as `reclaim` prints it.
        let pid = app.selected_row().unwrap().holder.pid;
        let report = app.report.clone().unwrap();
        let plan = plan_reclaim(&snap, &report, &super::super::plan_options(&report, pid));
        assert_eq!(plan.gpus, [0], "only the GPU the job holds");
        assert!(plan.targets().any(|t| t.pid == pid), "{plan:?}");
        assert!(
            plan.targets()
                .all(|t| t.class != vramguard_core::Class::Idle),
            "another job's idle kernel is not in it: {plan:?}"
        );
        app.open(Dialog::Confirm {
            pid: 0,
            text: crate::reclaim::plan_text(&plan, &report, false),
            actionable: !plan.is_empty(),
        });
        golden("top-plan", &screen(&app, 120, 30));
    }

    /// The sizes the issue reported (#30): a small terminal, the default one, a wide one.
    const SIZES: [(u16, u16); 3] = [(80, 24), (120, 40), (200, 50)];

    /// `s` without blanks: wrapped text compared with what it wraps.
    fn squash(s: &str) -> String {
        s.chars()
            .filter(|c| !c.is_whitespace() && *c != '│')
            .collect()
    }

    /// The demo's plan for the selected orphan, as `r` opens it.
    fn plan_dialog(snap: &Snapshot, app: &mut App) {
        let pid = app.selected_row().unwrap().holder.pid;
        let report = app.report.clone().unwrap();
        let plan = plan_reclaim(snap, &report, &super::super::plan_options(&report, pid));
        app.open(Dialog::Confirm {
            pid: 0,
            text: crate::reclaim::plan_text(&plan, &report, false),
            actionable: !plan.is_empty(),
        });
    }

    #[test]
    fn dialog_heights_come_from_the_wrapped_text_and_the_prompt_is_always_shown() {
        for (width, height) in SIZES {
            let (snap, mut app) = demo();
            app.key(Key::Enter);
            let text = screen(&app, width, height);
            let detail = squash(&text);
            assert!(
                detail.contains(&squash(
                    "what frees it: its job is gone and it does no work: terminate it (SIGTERM, \
                     then SIGKILL)"
                )),
                "{width}x{height}:\n{text}"
            );
            app.key(Key::Esc);
            plan_dialog(&snap, &mut app);
            let text = screen(&app, width, height);
            let plan = squash(&text);
            for shown in [
                "expected back on GPU 0: 18.0 GiB",
                "y: signal them (SIGTERM, grace, SIGKILL; audited)   any other key: cancel",
            ] {
                assert!(
                    plan.contains(&squash(shown)),
                    "{width}x{height}: {shown}\n{text}"
                );
            }
            // The box is as tall as the wrapped plan and its prompt: nothing to scroll.
            assert!(
                !text.contains("PgUp PgDn scroll"),
                "{width}x{height}:\n{text}"
            );
            // Wrapped once, by the dialog: a plan line that fits the box is one screen line.
            if width >= 120 {
                assert!(
                    text.contains("│    TERM→KILL  pid 16521    orphan     8.0 GiB  python3 train.py --epochs 10"),
                    "{width}x{height}:\n{text}"
                );
            }
        }
    }

    #[test]
    fn a_dialog_taller_than_the_screen_scrolls_its_body_under_a_prompt_that_stays() {
        let (_, mut app) = demo();
        let text: String = (1..=60).map(|i| format!("  plan line {i}\n")).collect();
        app.open(Dialog::Confirm {
            pid: 0,
            text,
            actionable: true,
        });
        for (width, height) in SIZES {
            app.dialog_scroll = 0;
            let top = screen(&app, width, height);
            assert!(
                top.contains("plan line 1\n") || top.contains("plan line 1 "),
                "{top}"
            );
            assert!(top.contains("y: signal them"), "{width}x{height}:\n{top}");
            assert!(top.contains("↑↓ PgUp PgDn scroll"), "{top}");
            assert!(!top.contains("plan line 60"), "{top}");
            // Scrolled to its end (the loop keeps the scroll within the body).
            app.key(Key::End);
            assert!(
                matches!(app.dialog, Dialog::Confirm { .. }),
                "scrolling is not cancelling"
            );
            app.dialog_scroll = app
                .dialog_scroll
                .min(super::dialog_scroll_max(&app, width, height));
            let end = screen(&app, width, height);
            assert!(end.contains("plan line 60"), "{width}x{height}:\n{end}");
            assert!(end.contains("y: signal them"), "{width}x{height}:\n{end}");
        }
        assert_eq!(app.key(Key::Up), super::super::app::Request::None);
        assert_eq!(
            app.key(Key::Char('y')),
            super::super::app::Request::Execute(0)
        );
    }

    /// The text of `column` in each row under the table's header line.
    fn column(text: &str, title: &str, next: &str) -> Vec<String> {
        let lines: Vec<Vec<char>> = text.lines().map(|l| l.chars().collect()).collect();
        let header = lines
            .iter()
            .position(|l| l.iter().collect::<String>().contains(" PID "))
            .unwrap();
        let h: String = lines[header].iter().collect();
        let find = |t: &str| h.find(t).map(|b| h[..b].chars().count());
        // `next` empty: to the end of the line.
        let to = if next.is_empty() {
            usize::MAX
        } else {
            find(next).unwrap()
        };
        let from = find(title).unwrap();
        lines[header + 1..]
            .iter()
            .take_while(|l| !l.is_empty())
            .map(|l| {
                l[from.min(l.len())..to.min(l.len())]
                    .iter()
                    .collect::<String>()
                    .trim()
                    .to_string()
            })
            .collect()
    }

    #[test]
    fn at_80_columns_identity_is_never_cut_silently_and_every_size_has_its_unit() {
        let (_, mut app) = demo();
        let pod = |name: &str| vramguard_core::report::PodName {
            namespace: "ml-research".into(),
            name: name.into(),
            container: "trainer".into(),
        };
        // Two jobs whose labels share their first characters, two pods whose names do.
        app.rows[0].holder.job.as_mut().unwrap().label = "pgid:20513".into();
        app.rows[1].holder.job.as_mut().unwrap().label = "pgid:20559".into();
        app.rows[2].holder.pod = Some(pod("llama-finetune-7d9f8-abcde"));
        app.rows[3].holder.pod = Some(pod("llama-finetune-7d9f8-fghij"));
        app.rows[4].holder.rss_bytes = Some(4_831_838_208); // 4.5 GiB
        for (width, height) in SIZES {
            let text = screen(&app, width, height);
            assert!(
                text.lines()
                    .all(|l| l.chars().count() <= usize::from(width)),
                "{text}"
            );
            let jobs = column(&text, "JOB", "GPU MEM");
            assert_eq!(jobs.len(), 5, "{text}");
            let distinct: std::collections::BTreeSet<&String> = jobs.iter().collect();
            assert_eq!(
                distinct.len(),
                5,
                "two jobs look the same at {width}:\n{text}"
            );
            assert!(
                jobs[0] == "pgid:20513" && jobs[1] == "pgid:20559",
                "{jobs:?}\n{text}"
            );
            // Cut in the middle, with `…`, keeping the end that tells them apart.
            for (j, end) in jobs[2..4].iter().zip(["abcde", "fghij"]) {
                assert!(
                    j.starts_with("ml-res")
                        && j.ends_with(end)
                        && (j.contains('…') || j.len() == 38),
                    "{j}\n{text}"
                );
            }
            let unit = |cell: &str| {
                cell == "n/a"
                    || cell == "unlisted"
                    || ["B", "KiB", "MiB", "GiB", "TiB"]
                        .iter()
                        .any(|u| cell.ends_with(&format!(" {u}")))
            };
            for cell in column(&text, "GPU MEM", "%SM") {
                assert!(unit(&cell), "{cell:?} at {width}:\n{text}");
            }
            // RSS is shown with its unit, or not at all.
            if text.contains(" RSS ") {
                let next = if text.contains(" PINNED ") {
                    "PINNED"
                } else {
                    "AGE"
                };
                let rss = column(&text, "RSS", next);
                assert!(rss.iter().all(|c| unit(c)), "{rss:?}\n{text}");
                assert!(rss.contains(&"4.5 GiB".to_string()), "{rss:?}\n{text}");
            } else {
                assert!(!text.contains("4.5"), "{text}");
            }
            // A command cut ends with `…`.
            for cmd in column(&text, "COMMAND", "") {
                assert!(
                    cmd.ends_with('…') || app.rows.iter().any(|r| r.holder.shown_command() == cmd),
                    "{cmd:?} at {width}:\n{text}"
                );
            }
        }
    }

    #[test]
    fn calls_to_action_wrap_instead_of_being_cut() {
        let (_, mut app) = demo();
        let explanation = app.gpus()[1].unaccounted.as_ref().unwrap().explanation[1].clone();
        for (width, height) in SIZES {
            let text = screen(&app, width, height);
            assert!(
                squash(&text).contains(&squash(&explanation)),
                "{width}:\n{text}"
            );
            // The hints in the status line are whole.
            let status = text.lines().last().unwrap();
            assert!(
                [
                    "help", "select", "details", "reclaim", "sort", "tree", "class", "user"
                ]
                .iter()
                .any(|h| status.ends_with(h)),
                "{status}"
            );
        }
        app.message = Some(
            "reclaim unavailable: vramguard runs in a PID namespace of its own; run it on the \
             host (or with --proc-root naming the host's /proc) to reclaim"
                .into(),
        );
        let text = screen(&app, 80, 24);
        assert!(text.contains("to reclaim"), "{text}");
    }

    #[test]
    fn text_from_processes_reaches_the_screen_escaped() {
        let (_, mut app) = demo();
        let row = &mut app.rows[0];
        row.holder
            .evidence
            .push("\x1b]52;c;ZXZpbA==\x07 and \r\x1b[2K forged".into());
        row.holder.command = Some("python3 \x1b[31mred\x1b[0m".into());
        app.key(Key::Enter);
        let text = screen(&app, 120, 30);
        assert!(
            !text.contains('\x1b') && !text.contains('\x07') && !text.contains('\r'),
            "{text:?}"
        );
        assert!(text.contains("\\e]52"), "{text}");
    }

    #[test]
    fn keys_sort_filter_and_never_reclaim_without_y() {
        use super::super::app::{Request, SortKey};
        let (_, mut app) = demo();
        assert_eq!(app.sort, SortKey::Attention);
        app.key(Key::Char('s'));
        assert_eq!(app.sort, SortKey::Memory);
        let memory: Vec<u64> = app
            .rows
            .iter()
            .map(|r| r.holder.used_bytes.unwrap_or(0))
            .collect();
        assert!(memory.windows(2).all(|w| w[0] >= w[1]), "{memory:?}");
        app.key(Key::Char('c'));
        assert!(
            app.rows
                .iter()
                .all(|r| r.holder.class == vramguard_core::Class::Orphan)
        );
        // r asks for a plan; anything but y cancels; y asks to execute.
        let pid = app.selected_row().unwrap().holder.pid;
        assert_eq!(app.key(Key::Char('r')), Request::Plan(pid));
        app.dialog = Dialog::Confirm {
            pid: 0,
            text: String::new(),
            actionable: true,
        };
        assert_eq!(app.key(Key::Enter), Request::Cancel);
        app.dialog = Dialog::Confirm {
            pid: 0,
            text: String::new(),
            actionable: false,
        };
        assert_eq!(
            app.key(Key::Char('y')),
            Request::Cancel,
            "nothing to signal"
        );
        app.dialog = Dialog::Confirm {
            pid: 0,
            text: String::new(),
            actionable: true,
        };
        assert_eq!(app.key(Key::Char('y')), Request::Execute(0));
        // Where reclaiming cannot work, r says why and asks nothing.
        app.dialog = Dialog::None;
        app.reclaim_unavailable = Some("not root".into());
        assert_eq!(app.key(Key::Char('r')), Request::None);
        assert!(app.message.as_deref().unwrap().contains("not root"));
        assert_eq!(app.key(Key::CtrlC), Request::Quit);
        // A GPU the node does not have: said, not silently an empty screen.
        let (snap, demo_app) = demo();
        let mut app = App::new(
            std::time::Duration::from_secs(1),
            vec![crate::gpusel::GpuSelector::Index(7)],
            true,
        );
        app.update(&snap, demo_app.report.unwrap());
        assert_eq!(
            app.message.as_deref(),
            Some(
                "--gpu 7: no such GPU or MIG device on this node (GPUs 0 to 1; `vramguard status` \
                 lists them with their UUIDs)"
            )
        );
    }
    #[test]
    fn the_tree_view_puts_holders_under_their_job() {
        let (_, mut app) = demo();
        app.key(Key::Char('t'));
        assert!(app.tree);
        let heading = app.rows[0].job.clone().expect("a job heading first");
        assert_eq!(heading.alive, Some(false), "{heading:?}");
        // The dead trainer's three holder rows follow its heading, with their memory summed.
        assert_eq!(heading.members, 3);
        assert_eq!(heading.bytes, 16 << 30);
        assert!(app.rows[1..4].iter().all(|r| r.job.is_none()));
        golden("top-tree", &screen(&app, 120, 30));
        // `r` on a heading plans for its job: the first member's.
        let pid = app.rows[1].holder.pid;
        assert_eq!(
            app.key(Key::Char('r')),
            super::super::app::Request::Plan(pid)
        );
    }
}
