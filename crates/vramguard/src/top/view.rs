//! Draws `top`'s screen from an [`App`]: pure, so that tests draw it on ratatui's
//! `TestBackend` from replayed snapshots.

use super::app::{App, Dialog, Row as AppRow};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Clear, Paragraph, Row, Table, TableState, Wrap};
use vramguard_core::report::{Class, GpuReport, Tone};
use vramguard_core::sanitize::{escape, fit};
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

/// Draws the whole screen.
pub fn draw(frame: &mut Frame, app: &App) {
    let paint = Paint {
        on: !app.monochrome,
    };
    let gpus = app.gpus();
    let area = frame.area();
    let header_height = (gpus.len() as u16 * 2).min(area.height.saturating_sub(5));
    let [title, header, table, footer, status] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(header_height),
        Constraint::Min(3),
        Constraint::Length(footer_height(app, &gpus)),
        Constraint::Length(1),
    ])
    .areas(area);
    frame.render_widget(Paragraph::new(title_line(app)), title);
    let lines: Vec<Line> = gpus
        .iter()
        .flat_map(|g| gpu_lines(&paint, g, header.width))
        .collect();
    frame.render_widget(Paragraph::new(lines), header);
    holders_table(frame, app, &paint, table);
    frame.render_widget(
        Paragraph::new(footer_lines(&paint, &gpus)).wrap(Wrap { trim: true }),
        footer,
    );
    frame.render_widget(Paragraph::new(status_line(app)), status);
    dialog(frame, app, &paint);
}

fn title_line(app: &App) -> Line<'static> {
    let (host, driver) = app.report.as_ref().map_or(("?".into(), "…".into()), |r| {
        (
            r.hostname.clone().unwrap_or_else(|| "?".into()),
            r.driver
                .driver_version
                .clone()
                .unwrap_or_else(|| "unknown".into()),
        )
    });
    let filter = match (&app.class_filter, &app.user_filter) {
        (None, None) => String::new(),
        (c, u) => format!(
            " · only {}{}",
            c.map_or(String::new(), |c| c.as_str().to_string()),
            u.as_ref()
                .map_or(String::new(), |u| format!(" user {}", fit(u, 16)))
        ),
    };
    let refresh = if app.interactive {
        format!(" · every {:.1}s", app.delay.as_secs_f64())
    } else {
        String::new()
    };
    Line::from(format!(
        "vramguard top · {} · driver {}{refresh} · sort {}{filter}{}",
        fit(&host, 32),
        fit(&driver, 24),
        app.sort.name(),
        if app.interactive {
            "  (? help, q quit)"
        } else {
            ""
        }
    ))
}

/// A GPU's two header lines: name and memory bar (ghost in its own colour), then what
/// nvidia-smi shows beside it.
fn gpu_lines(paint: &Paint, g: &GpuReport, width: u16) -> Vec<Line<'static>> {
    let name = format!(
        "GPU {} {:<14} ",
        g.index,
        fit(g.name.as_deref().unwrap_or("unknown GPU"), 14)
    );
    let mut first = vec![Span::raw(name)];
    match g.memory {
        Some(m) => {
            let bar_width = usize::from(width).saturating_sub(60).clamp(10, 60);
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
            first.push(Span::raw(format!(
                "] {} / {}",
                format_bytes(m.used),
                format_bytes(m.total)
            )));
            if g.ghost_bytes > 0 {
                first.push(Span::styled(
                    format!("  ghost {}", format_bytes(g.ghost_bytes)),
                    paint.fg(Color::Red).add_modifier(Modifier::BOLD),
                ));
            }
        }
        None => first.push(Span::styled(
            g.failure
                .as_ref()
                .map_or("memory unknown".to_string(), |f| f.to_string()),
            paint.fg(Color::Red),
        )),
    }
    vec![Line::from(first), telemetry_line(paint, g)]
}

/// The second header line: what nvidia-smi shows beside the memory, and health flags.
fn telemetry_line(paint: &Paint, g: &GpuReport) -> Line<'static> {
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
    Line::from(vec![
        Span::raw(format!(
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
            t.compute_mode
                .as_deref()
                .map_or_else(|| "compute n/a".into(), |m| format!("compute {m}")),
            t.mig_enabled
                .map_or_else(na, |m| if m { "on".into() } else { "off".into() }),
            g.persistence_mode
                .map_or_else(na, |p| if p { "on".into() } else { "off".into() }),
            g.pci_bus_id.as_deref().map_or_else(na, |b| fit(b, 16)),
        )),
        Span::styled(
            if flags.is_empty() {
                String::new()
            } else {
                format!("  ⚠ {}", flags.join(", "))
            },
            paint.fg(Color::Red),
        ),
    ])
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

fn table_row(paint: &Paint, r: &AppRow, tree: bool, host_columns: bool) -> Row<'static> {
    if let Some(j) = &r.job {
        let state = match j.alive {
            Some(true) => "alive",
            Some(false) => "gone",
            None => "unknown",
        };
        let style = if j.alive == Some(false) {
            paint.fg(Color::Red).add_modifier(Modifier::BOLD)
        } else {
            Style::default().add_modifier(Modifier::BOLD)
        };
        let blank = || Cell::from("");
        let mut cells = vec![
            Cell::from("job").style(style),
            blank(),
            blank(),
            Cell::from(state).style(style),
            Cell::from(fit(&j.label, 18)).style(style),
            Cell::from(format_bytes(j.bytes)),
            blank(),
            blank(),
            blank(),
        ];
        if host_columns {
            cells.extend([blank(), blank()]);
        }
        cells.extend([blank(), Cell::from(format!("{} holder row(s)", j.members))]);
        return Row::new(cells);
    }
    let h = &r.holder;
    let memory = match (h.listed, h.used_bytes) {
        (_, Some(b)) => format_bytes(b),
        (true, None) => "n/a".into(),
        (false, None) => "unlisted".into(),
    };
    // A pod by its names (from the kubelet) first, then a container by its runtime's name.
    let job = h
        .pod
        .as_ref()
        .map(|p| format!("{}/{}", p.namespace, p.name))
        .or_else(|| {
            h.container.as_ref().map(|c| {
                format!(
                    "{}:{}",
                    c.runtime,
                    c.name
                        .as_deref()
                        .map_or_else(|| fit(&c.id, 12), |n| fit(n, 32))
                )
            })
        })
        .or_else(|| h.job.as_ref().map(|j| j.label.clone()))
        .unwrap_or_else(|| "-".into());
    let mut cells = vec![
        Cell::from(h.pid.to_string()),
        Cell::from(fit(h.user.as_deref().unwrap_or("-"), 10)),
        Cell::from(r.gpu.to_string()),
        Cell::from(h.class.as_str()).style(paint.class(h.class)),
        Cell::from(fit(&job, 18)),
        Cell::from(memory),
        Cell::from(r.sm_percent.map_or("n/a".into(), |s| format!("{s}%"))),
        Cell::from(
            h.cpu_millicores
                .map_or("n/a".into(), |mc| format!("{:.1}", mc as f64 / 10.0)),
        ),
        Cell::from(h.rss_bytes.map_or("n/a".into(), format_bytes)),
    ];
    if host_columns {
        let m = h.host_memory.unwrap_or_default();
        let pinned = match (m.pinned_bytes, m.locked_bytes) {
            (None, None) => None,
            (p, l) => Some(p.unwrap_or(0).max(l.unwrap_or(0))),
        };
        cells.push(Cell::from(pinned.map_or("n/a".into(), format_bytes)));
        cells.push(Cell::from(m.shm_bytes.map_or("n/a".into(), format_bytes)));
    }
    cells.extend([
        Cell::from(age(h.age_secs)),
        Cell::from(format!(
            "{}{}",
            if tree { "└ " } else { "" },
            fit(h.shown_command(), 200)
        )),
    ]);
    Row::new(cells)
}

fn holders_table(frame: &mut Frame, app: &App, paint: &Paint, area: Rect) {
    let host_columns = area.width >= HOST_COLUMNS_FROM;
    let mut titles = vec![
        "PID", "USER", "GPU", "CLASS", "JOB", "GPU MEM", "%SM", "CPU%", "RSS",
    ];
    let mut widths = vec![
        Constraint::Length(8),
        Constraint::Length(10),
        Constraint::Length(3),
        Constraint::Length(8),
        Constraint::Length(18),
        Constraint::Length(10),
        Constraint::Length(4),
        Constraint::Length(5),
        Constraint::Length(10),
    ];
    if host_columns {
        titles.extend(["PINNED", "SHM"]);
        widths.extend([Constraint::Length(10), Constraint::Length(10)]);
    }
    titles.extend(["AGE", "COMMAND"]);
    widths.extend([Constraint::Length(4), Constraint::Min(10)]);
    let header =
        Row::new(titles).style(Style::default().add_modifier(Modifier::BOLD | Modifier::REVERSED));
    let rows: Vec<Row> = app
        .rows
        .iter()
        .map(|r| table_row(paint, r, app.tree, host_columns))
        .collect();
    let empty = rows.is_empty();
    let table = Table::new(rows, widths)
        .header(header)
        .row_highlight_style(Style::default().add_modifier(Modifier::REVERSED))
        .highlight_symbol("▶");
    let mut state = TableState::default();
    if !empty && app.interactive {
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

/// The unaccounted memory of each GPU that has some, with its explanation.
fn footer_lines(paint: &Paint, gpus: &[&GpuReport]) -> Vec<Line<'static>> {
    gpus.iter()
        .filter_map(|g| {
            let u = g.unaccounted.as_ref().filter(|u| u.significant)?;
            Some(Line::from(vec![
                Span::styled(
                    format!(
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
                    ),
                    paint.fg(Color::Red),
                ),
                Span::raw(escape(u.explanation.get(1).map_or("", String::as_str)).into_owned()),
            ]))
        })
        .collect()
}

fn footer_height(app: &App, gpus: &[&GpuReport]) -> u16 {
    let _ = app;
    gpus.iter()
        .filter(|g| g.unaccounted.as_ref().is_some_and(|u| u.significant))
        .count()
        .min(4) as u16
}

fn status_line(app: &App) -> Line<'static> {
    let text = match (&app.message, &app.report) {
        (Some(m), _) => m.clone(),
        (None, None) => "reading the node…".into(),
        (None, Some(r)) => format!(
            "{} holder(s) · ghost {}{}",
            app.rows.iter().filter(|r| r.job.is_none()).count(),
            format_bytes(r.ghost_bytes()),
            if app.interactive {
                " · ↑↓ select · Enter details · r reclaim · s sort · t tree · c class · u user"
            } else {
                ""
            }
        ),
    };
    Line::from(text)
}

/// A box over the middle of the screen, cleared.
fn popup(frame: &mut Frame, title: &str, lines: Vec<Line<'static>>) {
    let area = frame.area();
    let width = area.width.saturating_sub(4).min(110);
    let height = (lines.len() as u16 + 2).min(area.height.saturating_sub(2));
    let rect = Rect {
        x: area.x + (area.width - width) / 2,
        y: area.y + (area.height.saturating_sub(height)) / 2,
        width,
        height,
    };
    frame.render_widget(Clear, rect);
    frame.render_widget(
        Paragraph::new(lines).wrap(Wrap { trim: false }).block(
            Block::default()
                .borders(Borders::ALL)
                .title(title.to_string()),
        ),
        rect,
    );
}

/// Lines of a text block, each through the sanitiser: what reaches the terminal from a
/// plan or an outcome carries process-supplied names.
fn text_lines(text: &str) -> Vec<Line<'static>> {
    text.lines()
        .map(|l| Line::from(escape(l).into_owned()))
        .collect()
}

fn dialog(frame: &mut Frame, app: &App, paint: &Paint) {
    match &app.dialog {
        Dialog::None => {}
        Dialog::Help => popup(
            frame,
            " keys ",
            text_lines(
                "↑/↓ j/k  select          PgUp/PgDn  page          Home/End g/G  first/last\n\
                 Enter    details of the selected holder (its evidence)\n\
                 r        reclaim the selected holder's job: the plan `vramguard reclaim` makes, \
                 acted on only after y\n\
                 s        sort: attention, memory, %SM, CPU, age, pid\n\
                 t        tree: holders under their job\n\
                 c        only one class (cycles)      u  only the selected holder's user\n\
                 q, Ctrl-C  quit",
            ),
        ),
        Dialog::Detail => {
            if let Some(r) = app.selected_row() {
                let h = &r.holder;
                let mut lines = vec![
                    Line::from(format!(
                        "pid {}  {}  GPU {}  class {}",
                        h.pid,
                        fit(h.user.as_deref().unwrap_or("-"), 16),
                        r.gpu,
                        h.class.as_str()
                    )),
                    Line::from(fit(h.shown_command(), 500)),
                    Line::from(host_memory_line(h)),
                    Line::from(""),
                ];
                lines.extend(
                    h.evidence
                        .iter()
                        .map(|e| Line::from(format!("• {}", escape(e)))),
                );
                lines.push(Line::from(""));
                lines.push(Line::from(vec![
                    Span::styled("what frees it: ", paint.fg(Color::Yellow)),
                    Span::raw(escape(&h.action.summary).into_owned()),
                ]));
                popup(frame, " holder ", lines);
            }
        }
        Dialog::Planning(pid) => popup(
            frame,
            " reclaim ",
            vec![Line::from(format!(
                "sampling the node and planning the reclaim of pid {pid}'s job…"
            ))],
        ),
        Dialog::Confirm { text, actionable } => {
            let mut lines = text_lines(text);
            lines.push(Line::from(""));
            lines.push(Line::from(Span::styled(
                if *actionable {
                    "y: signal them (SIGTERM, grace, SIGKILL; audited)   any other key: cancel"
                } else {
                    "nothing to signal: any key closes"
                },
                paint.fg(Color::Yellow).add_modifier(Modifier::BOLD),
            )));
            popup(frame, " reclaim plan ", lines);
        }
        Dialog::Running => popup(
            frame,
            " reclaim ",
            vec![Line::from(
                "signalling and waiting for the memory to come back…",
            )],
        ),
        Dialog::Outcome(text) => {
            let mut lines = text_lines(text);
            lines.push(Line::from(""));
            lines.push(Line::from("any key closes"));
            popup(frame, " reclaim done ", lines);
        }
    }
}

/// One screen as plain text, `width` columns, as tall as its content: `top --once`.
pub fn as_text(app: &App, width: u16) -> String {
    let gpus = app.gpus();
    // Title, two lines per GPU, the table's header and rows (room for its empty line), the
    // footer and the status line.
    let height = 1
        + 2 * gpus.len() as u16
        + 1
        + app.rows.len().max(2) as u16
        + footer_height(app, &gpus)
        + 1;
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
        app.dialog = Dialog::Confirm {
            text: crate::reclaim::render_plan(&plan, &report, false),
            actionable: !plan.is_empty(),
        };
        golden("top-plan", &screen(&app, 120, 30));
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
            text: String::new(),
            actionable: true,
        };
        assert_eq!(app.key(Key::Enter), Request::Cancel);
        app.dialog = Dialog::Confirm {
            text: String::new(),
            actionable: false,
        };
        assert_eq!(
            app.key(Key::Char('y')),
            Request::Cancel,
            "nothing to signal"
        );
        app.dialog = Dialog::Confirm {
            text: String::new(),
            actionable: true,
        };
        assert_eq!(app.key(Key::Char('y')), Request::Execute);
        // Where reclaiming cannot work, r says why and asks nothing.
        app.dialog = Dialog::None;
        app.reclaim_unavailable = Some("not root".into());
        assert_eq!(app.key(Key::Char('r')), Request::None);
        assert!(app.message.as_deref().unwrap().contains("not root"));
        assert_eq!(app.key(Key::CtrlC), Request::Quit);
        // A GPU the node does not have: said, not silently an empty screen.
        let (snap, demo_app) = demo();
        let mut app = App::new(std::time::Duration::from_secs(1), vec![7], true);
        app.update(&snap, demo_app.report.unwrap());
        assert_eq!(
            app.message.as_deref(),
            Some("--gpu 7: this node has 2 GPU(s)")
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
