//! The status page at `/`: one self-contained HTML document (inline CSS and SVG, no script,
//! no external asset), refreshed by the browser every few seconds.

use crate::history::{Timeline, Timelines};
use std::fmt::Write as _;
use vramguard_core::report::{Class, GpuReport, Report, Tone};
use vramguard_core::units::format_bytes;

/// Makes text another user may control safe for the page: the shared sanitiser first (the
/// page is fetched with `curl` to terminals too: an OSC 52 in a command name must arrive as
/// `\e]52…`, not as an escape sequence), then HTML escaping.
pub fn escape(s: &str) -> String {
    html(&vramguard_core::sanitize::escape(s))
}

/// [`escape`], cut to the sanitiser's `MAX_SHOWN` characters: a 1 MB command line is not sent
/// on every refresh.
fn escape_cut(s: &str) -> String {
    html(&vramguard_core::sanitize::shown(s))
}

/// Escapes text for HTML.
fn html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn class_color(c: Class) -> &'static str {
    match c.info().tone {
        Tone::Working => "#2e7d32",
        Tone::Unused => "#00838f",
        Tone::Ghost => "#c62828",
        Tone::Unexplained => "#ef6c00",
        Tone::Service => "#616161",
    }
}

/// An inline SVG of used (line) and ghost (area) memory over the timeline.
fn timeline(points: &Timeline, total: u64) -> String {
    const W: f64 = 600.0;
    const H: f64 = 80.0;
    let (Some(first), Some(last)) = (points.front(), points.back()) else {
        return String::new();
    };
    let span = (last.0 - first.0).max(1.0);
    let total = total.max(1) as f64;
    let xy = |t: f64, v: u64| (((t - first.0) / span) * W, H - (v as f64 / total) * H);
    let used: Vec<String> = points
        .iter()
        .map(|(t, u, _)| {
            let (x, y) = xy(*t, *u);
            format!("{x:.1},{y:.1}")
        })
        .collect();
    let mut ghost: Vec<String> = vec![format!("0,{H}")];
    ghost.extend(points.iter().map(|(t, _, g)| {
        let (x, y) = xy(*t, *g);
        format!("{x:.1},{y:.1}")
    }));
    ghost.push(format!("{W},{H}"));
    format!(
        r##"<svg class="timeline" viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" aria-label="memory over the last {:.0} s"><rect width="{W}" height="{H}" fill="#fafafa"/><polygon points="{}" fill="#c62828" fill-opacity="0.35"/><polyline points="{}" fill="none" stroke="#1565c0" stroke-width="1.5"/></svg>"##,
        span,
        ghost.join(" "),
        used.join(" ")
    )
}

fn gpu_card(out: &mut String, g: &GpuReport, tl: Option<&Timeline>) {
    let _ = write!(
        out,
        r#"<section class="gpu" id="gpu-{i}"><h2>GPU {i} · {name} <small>{uuid}</small></h2>"#,
        i = g.index,
        name = escape(g.name.as_deref().unwrap_or("unknown")),
        uuid = escape(g.uuid.as_deref().unwrap_or(""))
    );
    if let Some(f) = &g.failure {
        let _ = write!(
            out,
            r#"<p class="error">cannot be read: {}</p></section>"#,
            escape(&f.to_string())
        );
        return;
    }
    if let Some(m) = g.memory {
        let pct = m.used as f64 * 100.0 / m.total.max(1) as f64;
        let ghost_pct = g.ghost_bytes as f64 * 100.0 / m.total.max(1) as f64;
        let _ = write!(
            out,
            r#"<div class="bar"><div class="used" style="width:{pct:.1}%"></div><div class="ghostbar" style="width:{ghost_pct:.1}%"></div></div><p class="mem">{} used of {} · <span class="ghost">{} ghost</span></p>"#,
            format_bytes(m.used),
            format_bytes(m.total),
            format_bytes(g.ghost_bytes)
        );
        if let Some(tl) = tl {
            out.push_str(&timeline(tl, m.total));
        }
    }
    if g.holders.is_empty() {
        out.push_str(r#"<p class="none">no process holds this GPU</p>"#);
    } else {
        out.push_str("<table><thead><tr><th>pid</th><th>user</th><th>class</th><th>memory</th><th>command</th><th>why</th></tr></thead><tbody>");
        for h in g.holders.iter().take(PAGE_ROWS) {
            let _ = write!(
                out,
                r#"<tr class="holder {cls}"><td>{pid}</td><td>{user}</td><td><span class="class" style="background:{color}">{cls}</span></td><td>{mem}</td><td><code>{cmd}</code></td><td>{why}</td></tr>"#,
                cls = h.class.as_str(),
                pid = h.pid,
                user = escape(h.user.as_deref().unwrap_or("-")),
                color = class_color(h.class),
                mem = h.used_bytes.map_or_else(
                    || if h.listed {
                        "n/a".to_string()
                    } else {
                        "unlisted".to_string()
                    },
                    format_bytes
                ),
                cmd = escape_cut(h.shown_command()),
                why = escape_cut(h.evidence.first().map(String::as_str).unwrap_or(""))
            );
        }
        if g.holders.len() > PAGE_ROWS {
            let _ = write!(
                out,
                r#"<tr><td colspan="6" class="none">… and {} more holders (<a href="/api/status">JSON</a> lists every one)</td></tr>"#,
                g.holders.len() - PAGE_ROWS
            );
        }
        out.push_str("</tbody></table>");
    }
    if let Some(u) = g.unaccounted.as_ref().filter(|u| u.significant) {
        let _ = write!(
            out,
            r#"<p class="unaccounted">{} unaccounted: {}</p>"#,
            format_bytes(u.bytes),
            escape(u.explanation.get(1).map(String::as_str).unwrap_or(""))
        );
    }
    out.push_str("</section>");
}

/// Holders shown per GPU, largest first: any user who may open a GPU's device file can make
/// thousands of holders, and the page is rendered at every sample.
pub const PAGE_ROWS: usize = 200;

/// Renders the page.
pub fn render(
    report: &Report,
    timelines: &Timelines,
    firing: &[(String, u32)],
    refresh_secs: u64,
) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let host = escape(report.hostname.as_deref().unwrap_or("?"));
    let _ = write!(
        out,
        r#"<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{refresh_secs}"><meta name="viewport" content="width=device-width, initial-scale=1"><title>vramguard · {host}</title><style>
body{{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#212121;max-width:1100px}}
h1{{font-size:1.3em}} h2{{font-size:1.1em;margin:.2em 0}} small{{color:#757575;font-weight:normal}}
section.gpu{{border:1px solid #e0e0e0;border-radius:6px;padding:.8em 1em;margin:1em 0}}
.bar{{position:relative;height:12px;background:#eeeeee;border-radius:3px;overflow:hidden}}
.bar .used{{position:absolute;height:100%;background:#1565c0}} .bar .ghostbar{{position:absolute;right:0;height:100%;background:#c62828;opacity:.7}}
.ghost{{color:#c62828}} .error{{color:#c62828;font-weight:bold}} .none{{color:#757575}}
table{{border-collapse:collapse;width:100%;margin-top:.5em}} th,td{{text-align:left;padding:.2em .5em;border-bottom:1px solid #f0f0f0;vertical-align:top}}
.class{{color:white;border-radius:3px;padding:0 .4em;font-size:.9em}} code{{font-size:.9em}}
.alerts{{background:#ffebee;border:1px solid #c62828;padding:.5em 1em;border-radius:6px}}
svg.timeline{{display:block;margin:.5em 0;max-width:100%;height:auto}}
</style></head><body><h1>vramguard · {host}</h1><p>driver {driver} · {n} GPU(s) · updated {updated} · <a href="/metrics">metrics</a> · <a href="/api/status">JSON</a></p>"#,
        driver = escape(report.driver.driver_version.as_deref().unwrap_or("?")),
        n = report.gpus.len(),
        updated = vramguard_ops::audit::rfc3339(report.taken_at_ms),
    );
    if !firing.is_empty() {
        out.push_str(r#"<div class="alerts"><strong>alerts firing:</strong> "#);
        let names: Vec<String> = firing
            .iter()
            .map(|(r, g)| format!("{} (GPU {g})", escape(r)))
            .collect();
        out.push_str(&names.join(", "));
        out.push_str("</div>");
    }
    for g in &report.gpus {
        gpu_card(&mut out, g, timelines.get(&g.index));
    }
    out.push_str("</body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping() {
        assert_eq!(
            escape(r#"<script>"x"&'y'"#),
            "&lt;script&gt;&quot;x&quot;&amp;&#39;y&#39;"
        );
    }

    /// Red-team finding: the page listed every holder, which any user who may open a GPU's
    /// device file can multiply by thousands.
    #[test]
    fn the_page_shows_at_most_page_rows_holders_per_gpu() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/incidents/demo/status.json"
        );
        let mut report: Report =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let one = report.gpus[0].holders[0].clone();
        report.gpus[0].holders = (0..PAGE_ROWS as u32 + 50)
            .map(|i| {
                let mut h = one.clone();
                h.pid = 100_000 + i;
                h
            })
            .collect();
        let page = render(&report, &Timelines::default(), &[], 5);
        assert!(page.contains("<td>100199</td>"), "the 200th is shown");
        assert!(!page.contains("<td>100200</td>"), "the 201st is not");
        assert!(
            page.contains("… and 50 more holders"),
            "the rest is counted"
        );
    }

    #[test]
    fn a_timeline_scales_to_the_box() {
        let pts: Timeline = [(0.0, 0, 0), (10.0, 50, 25), (20.0, 100, 0)]
            .into_iter()
            .collect();
        let svg = timeline(&pts, 100);
        assert!(svg.contains("0.0,80.0 300.0,40.0 600.0,0.0"), "{svg}");
        assert!(timeline(&Timeline::new(), 100).is_empty());
    }
}
