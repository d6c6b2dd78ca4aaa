//! Human output. Colour only on a terminal, and never when `NO_COLOR` is set.

use std::fmt::Write as _;
use std::io::IsTerminal;
use vramguard_core::diagnose::{CheckStatus, Diagnosis};
use vramguard_core::health::Severity;
use vramguard_core::host::{HostReport, SegmentReport, SegmentVerdict};
use vramguard_core::report::{Class, GpuReport, Holder, Report, Tone};
use vramguard_core::sanitize::shown;
use vramguard_core::snapshot::{DriverSource, GpuTelemetry, ProcessListState};
use vramguard_core::units::format_bytes;

/// Whether to colour stdout.
pub fn use_colour() -> bool {
    std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()) && std::io::stdout().is_terminal()
}

/// The width of piped output: stable, documented, wide enough for a command and its evidence.
pub const PIPED_WIDTH: usize = 160;

/// The width to render for: `$COLUMNS` when set, else the terminal's, else [`PIPED_WIDTH`].
pub fn output_width() -> usize {
    if let Some(c) = std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.trim().parse::<usize>().ok())
        .filter(|c| *c >= 40)
    {
        return c.min(1000);
    }
    let stdout = std::io::stdout();
    if stdout.is_terminal()
        && let Ok(ws) = rustix::termios::tcgetwinsize(&stdout)
        && ws.ws_col >= 40
    {
        return usize::from(ws.ws_col);
    }
    PIPED_WIDTH
}

/// Every line of `text` cut to `width` visible characters (colour sequences do not count; a
/// cut line is reset to plain).
pub fn fit_lines(text: &str, width: usize) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let (body, nl) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        let mut visible = 0;
        let mut in_escape = false;
        let mut cut_at = None;
        for (i, c) in body.char_indices() {
            if in_escape {
                in_escape = c != 'm';
                continue;
            }
            if c == '\x1b' {
                in_escape = true;
                continue;
            }
            visible += 1;
            if visible == width && body[i + c.len_utf8()..].chars().any(|_| true) {
                cut_at = Some(i);
                break;
            }
        }
        match cut_at {
            Some(i) => {
                out.push_str(&body[..i]);
                out.push('…');
                if body.contains('\x1b') {
                    out.push_str("\x1b[0m");
                }
            }
            None => out.push_str(body),
        }
        out.push_str(nl);
    }
    out
}

/// Characters a terminal shows for `s` (colour sequences do not count).
fn visible_len(s: &str) -> usize {
    let mut n = 0;
    let mut in_escape = false;
    for c in s.chars() {
        if in_escape {
            in_escape = c != 'm';
        } else if c == '\x1b' {
            in_escape = true;
        } else {
            n += 1;
        }
    }
    n
}

/// Every line of `text` wrapped at spaces to `width` visible characters, continuation lines
/// indented under the line's own indent: for prose (checks, reasons), where a cut would lose
/// the point. A single word longer than the width is cut.
pub fn wrap_lines(text: &str, width: usize) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let (body, nl) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        if visible_len(body) <= width {
            out.push_str(body);
            out.push_str(nl);
            continue;
        }
        let indent = body.len() - body.trim_start_matches(' ').len();
        let cont = " ".repeat((indent + 4).min(width / 2));
        let mut current = String::from(&body[..indent]);
        let mut current_len = indent;
        let mut first_word = true;
        for word in body[indent..].split(' ') {
            let wl = visible_len(word);
            if !first_word && current_len + 1 + wl > width {
                out.push_str(&fit_lines(&current, width));
                out.push('\n');
                current = cont.clone();
                current_len = cont.len();
            } else if !first_word {
                current.push(' ');
                current_len += 1;
            }
            current.push_str(word);
            current_len += wl;
            first_word = false;
        }
        out.push_str(&fit_lines(&current, width));
        out.push_str(nl);
    }
    out
}

/// ANSI styling, or none, for a width.
#[derive(Debug, Clone, Copy)]
pub struct Style {
    on: bool,
    /// Columns to fit.
    pub width: usize,
}

impl Style {
    /// Styling on or off, for the output's width.
    pub fn new(on: bool) -> Style {
        Style {
            on,
            width: output_width(),
        }
    }
    fn paint(&self, code: &str, s: &str) -> String {
        if self.on {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
    fn bold(&self, s: &str) -> String {
        self.paint("1", s)
    }
    fn dim(&self, s: &str) -> String {
        self.paint("2", s)
    }
    fn red(&self, s: &str) -> String {
        self.paint("31;1", s)
    }
    fn green(&self, s: &str) -> String {
        self.paint("32", s)
    }
    fn yellow(&self, s: &str) -> String {
        self.paint("33", s)
    }
    fn class(&self, c: Class) -> String {
        let padded = format!("{:<8}", c.as_str());
        match c.info().tone {
            Tone::Working => self.green(&padded),
            Tone::Unused => self.paint("36", &padded),
            Tone::Ghost => self.red(&padded),
            Tone::Unexplained => self.yellow(&padded),
            Tone::Service => self.dim(&padded),
        }
    }
}

fn bar(used: u64, total: u64, width: usize) -> String {
    let filled = if total == 0 {
        0
    } else {
        ((used as f64 / total as f64) * width as f64).round() as usize
    }
    .min(width);
    format!("[{}{}]", "█".repeat(filled), "░".repeat(width - filled))
}

/// Process-supplied (or process-derived) text for a column: control characters shown as
/// escapes, cut to `max` terminal columns.
fn truncate(s: &str, max: usize) -> String {
    vramguard_core::sanitize::fit_columns(s, max)
}

/// [`truncate`], padded to exactly `width` columns.
fn cell(s: &str, width: usize) -> String {
    vramguard_core::sanitize::cell(s, width)
}

fn driver_line(r: &Report) -> String {
    let what = match r.driver.source {
        DriverSource::Nvml => "driver",
        DriverSource::Simulated => "simulated driver",
    };
    format!(
        "{} {}",
        what,
        r.driver.driver_version.as_deref().unwrap_or("unknown")
    )
}

fn gpu_title(st: &Style, g: &GpuReport) -> String {
    let mut line = format!(
        "GPU {}  {}  {}",
        g.index,
        g.name.as_deref().unwrap_or("unknown GPU"),
        g.pci_bus_id.as_deref().unwrap_or("")
    );
    if let Some(m) = g.memory {
        let _ = write!(
            line,
            "  {} {} / {} used",
            bar(m.used, m.total, if st.width < 100 { 10 } else { 20 }),
            format_bytes(m.used),
            format_bytes(m.total)
        );
    }
    st.bold(&line)
}

/// What `nvidia-smi` shows beside memory, `n/a` where the GPU did not say.
fn telemetry_line(t: &GpuTelemetry) -> String {
    let na = || "n/a".to_string();
    let pct = |v: Option<u32>| v.map_or_else(na, |v| format!("{v}%"));
    let watts = |v: Option<u32>| v.map_or_else(na, |mw| (mw / 1000).to_string());
    let ecc = match (
        t.ecc_enabled,
        t.ecc_corrected_volatile,
        t.ecc_uncorrected_volatile,
    ) {
        (Some(false), _, _) => "ECC off".to_string(),
        (Some(true), Some(c), Some(u)) => format!("ECC on, {c} corr / {u} uncorr"),
        (Some(true), _, _) => "ECC on".to_string(),
        (None, _, _) => "ECC n/a".to_string(),
    };
    let modes = [
        t.fan_percent.map(|f| format!("fan {f}%")),
        t.compute_mode.as_ref().map(|m| format!("compute {m}")),
        t.mig_enabled
            .map(|m| format!("MIG {}", if m { "on" } else { "off" })),
    ]
    .into_iter()
    .flatten()
    .map(|m| format!("  {m}"))
    .collect::<String>();
    format!(
        "util {}  mem {}  {}  {} / {} W  {}  {ecc}{modes}",
        pct(t.gpu_util_percent),
        pct(t.memory_util_percent),
        t.temperature_c
            .map_or_else(|| "n/a°C".into(), |c| format!("{c}°C")),
        watts(t.power_mw),
        watts(t.power_limit_mw),
        t.performance_state
            .map_or_else(|| "P?".into(), |p| format!("P{p}")),
    )
}

/// A process's age in its largest unit: `45s`, `12m`, `5h`, `3d`.
fn compact_age(secs: u64) -> String {
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m", secs / 60),
        3600..86400 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86400),
    }
}

/// Whether `status` has room for the host columns (CPU, RSS, age).
/// From 240 columns, each holder's pinned (or locked) and mapped shared host memory too.
fn widest(st: &Style) -> bool {
    st.width >= 240
}

/// The host-memory columns of the widest layout, or nothing.
fn host_memory_columns(st: &Style, h: Option<&Holder>) -> String {
    if !widest(st) {
        return String::new();
    }
    let Some(h) = h else {
        return format!("{:>9} {:>9}  ", "PINNED", "SHM");
    };
    let m = h.host_memory.unwrap_or_default();
    let pinned = match (m.pinned_bytes, m.locked_bytes) {
        (None, None) => None,
        (p, l) => Some(p.unwrap_or(0).max(l.unwrap_or(0))),
    };
    format!(
        "{:>9} {:>9}  ",
        pinned.map_or("n/a".into(), format_bytes),
        m.shm_bytes.map_or("n/a".into(), format_bytes)
    )
}

fn wide(st: &Style) -> bool {
    st.width >= 120
}

fn holder_line(st: &Style, h: &Holder) -> String {
    let memory = match (h.listed, h.used_bytes) {
        (_, Some(b)) => format_bytes(b),
        (true, None) => "n/a".into(),
        (false, None) => "unlisted".into(),
    };
    let pid = match h.reported_pid {
        Some(r) => format!("{}←{r}", h.pid),
        None => h.pid.to_string(),
    };
    // The fixed columns take 60 (82 with the host columns); the command and the evidence
    // share the rest, and the evidence goes to a line of its own when too little is left.
    let host = if wide(st) {
        format!(
            "{:>5} {:>9} {}{:>5}  ",
            h.cpu_millicores
                .map_or("n/a".into(), |mc| format!("{}%", mc / 10)),
            h.rss_bytes.map_or("n/a".into(), format_bytes),
            host_memory_columns(st, Some(h)),
            h.age_secs.map_or("n/a".into(), compact_age)
        )
    } else {
        String::new()
    };
    let rest = st.width.saturating_sub(60 + host.len());
    let command_width = if rest >= 100 {
        (rest / 2).clamp(40, 100)
    } else if rest >= 60 {
        rest / 2
    } else {
        rest.max(12)
    };
    let evidence_width = rest.saturating_sub(command_width + 2);
    let evidence = match h.class {
        // What keeps it from being an orphan: the work seen.
        Class::Detached => h
            .evidence
            .iter()
            .find(|e| e.starts_with("working:"))
            .or(h.evidence.first()),
        // A live job's holder and a service need no evidence; every other class shows why.
        Class::Active | Class::System => None,
        _ => h.evidence.first(),
    };
    let command = h.shown_command();
    let (command, why) = match evidence {
        Some(e) if evidence_width >= 24 => (
            cell(command, command_width),
            format!("  {}", st.dim(&truncate(e, evidence_width))),
        ),
        Some(e) => (
            truncate(command, command_width),
            format!(
                "\n{:12}{}",
                "",
                st.dim(&truncate(e, st.width.saturating_sub(12)))
            ),
        ),
        None => (truncate(command, command_width), String::new()),
    };
    // A pod by its names when the kubelet gave them, else the job's label (pod:<uid>, …).
    let pod = h
        .pod
        .as_ref()
        .map(|p| format!("{}/{}", p.namespace, p.name));
    let job = pod
        .as_deref()
        .unwrap_or_else(|| h.job.as_ref().map_or("-", |j| j.label.as_str()));
    format!(
        "  {:<9} {} {} {} {:>10}  {host}{}{}",
        pid,
        cell(h.user.as_deref().unwrap_or("-"), 9),
        st.class(h.class),
        cell(job, 16),
        memory,
        command,
        why
    )
}

/// One MIG device under its GPU: instance, UUID, memory, holders, and its ghost memory.
fn mig_line(st: &Style, d: &vramguard_core::report::MigDeviceReport) -> String {
    let profile = d
        .name
        .as_deref()
        .and_then(|n| n.rsplit_once(" MIG "))
        .map_or("?", |(_, p)| p);
    let memory = d.memory.map_or("memory unknown".into(), |m| {
        format!("{} / {}", format_bytes(m.used), format_bytes(m.total))
    });
    let holders = if d.holders.is_empty() {
        "no holders".to_string()
    } else {
        let pids: Vec<String> = d.holders.iter().map(u32::to_string).collect();
        format!("pid {}", pids.join(","))
    };
    let ghost = if d.ghost_bytes > 0 {
        format!(
            "  {}",
            st.red(&format!("ghost {}", format_bytes(d.ghost_bytes)))
        )
    } else {
        String::new()
    };
    format!(
        "  MIG {} GI {}  {}  {memory}  {holders}{ghost}",
        vramguard_core::sanitize::escape(profile),
        d.gpu_instance.map_or("?".into(), |i| i.to_string()),
        vramguard_core::sanitize::escape(d.uuid.as_deref().unwrap_or("?")),
    )
}

/// One GPU of `status`: its title, health, process-list state, holders and ghost line.
fn gpu_block(out: &mut String, st: &Style, g: &vramguard_core::GpuReport) {
    let _ = writeln!(out, "{}", gpu_title(st, g));
    if let Some(t) = &g.telemetry {
        let _ = writeln!(out, "  {}", st.dim(&telemetry_line(t)));
    }
    if let Some(f) = &g.failure {
        let _ = writeln!(out, "  {} {f}", st.red("error:"));
        return;
    }
    for f in vramguard_core::health::findings(g.index, &g.health) {
        let label = match f.severity {
            Severity::Warn => st.yellow("health:"),
            Severity::Fail => st.red("health:"),
        };
        let _ = writeln!(out, "  {label} {} (`{}`)", f.message, f.command);
    }
    if let ProcessListState::Unreliable { reason } = &g.process_list {
        let _ = writeln!(
            out,
            "  {} process list unreliable: {reason}",
            st.yellow("warning:")
        );
    }
    if let ProcessListState::Unavailable { error } = &g.process_list {
        let _ = writeln!(
            out,
            "  {} process list unavailable: {error}",
            st.red("error:")
        );
    }
    if g.holders.is_empty() {
        let unseen = g.unaccounted.as_ref().is_some_and(|u| u.is_unexplained());
        let _ = writeln!(
            out,
            "  {}",
            st.dim(if unseen {
                "no process vramguard can see holds this GPU"
            } else {
                "no processes hold this GPU"
            })
        );
    } else {
        let _ = writeln!(
            out,
            "  {}",
            st.dim(&format!(
                "{:<9} {:<9} {:<8} {:<16} {:>10}  {}COMMAND",
                "PID",
                "USER",
                "CLASS",
                "JOB",
                "MEMORY",
                if wide(st) {
                    format!(
                        "{:>5} {:>9} {}{:>5}  ",
                        "CPU",
                        "RSS",
                        host_memory_columns(st, None),
                        "AGE"
                    )
                } else {
                    String::new()
                }
            ))
        );
        for h in &g.holders {
            let _ = writeln!(out, "{}", holder_line(st, h));
        }
    }
    for d in &g.mig_devices {
        let _ = writeln!(out, "{}", mig_line(st, d));
    }
    if let Some(u) = &g.unaccounted
        && u.significant
    {
        // Under the command column: past the host columns when they are shown.
        let host_columns = if wide(st) {
            " ".repeat(22 + host_memory_columns(st, None).len())
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "  {:<9} {:<9} {} {:<16} {:>10}  {host_columns}{}",
            "-",
            "-",
            if u.counts_as_ghost() {
                st.red(&format!("{:<8}", "ghost"))
            } else if u.is_unexplained() {
                // Held by something vramguard cannot see from here.
                st.yellow(&format!("{:<8}", "unseen"))
            } else {
                // Not split per process by the driver: the listed processes may hold it.
                st.yellow(&format!("{:<8}", "unsplit"))
            },
            "-",
            format_bytes(u.bytes),
            u.explanation
                .get(1)
                .map(|e| if st.width >= 100 {
                    truncate(e, st.width - 62 - host_columns.len())
                } else {
                    format!("\n{:12}{}", "", truncate(e, st.width.saturating_sub(12)))
                })
                .unwrap_or_default()
        );
    }
}

/// `vramguard status`.
pub fn status(r: &Report, st: &Style) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} · {} · {} · {} GPU(s)",
        st.bold("vramguard status"),
        r.hostname.as_deref().unwrap_or("?"),
        driver_line(r),
        r.gpus.len()
    );
    for g in &r.gpus {
        let _ = writeln!(out);
        gpu_block(&mut out, st, g);
    }
    let ghost = r.ghost_bytes();
    let _ = writeln!(out);
    if ghost > 0 {
        let gpus: Vec<String> = r
            .gpus
            .iter()
            .filter(|g| g.ghost_bytes > 0)
            .map(|g| g.index.to_string())
            .collect();
        let _ = writeln!(
            out,
            "{} {} held by no live job on GPU {}; run `vramguard diagnose` for what to do",
            st.red("ghost memory:"),
            format_bytes(ghost),
            gpus.join(",")
        );
    }
    let unexplained = r.unexplained_bytes();
    if let Some(line) = r.unexplained_summary() {
        let _ = writeln!(out, "{} {line}", st.yellow("unexplained:"));
    }
    let unkept: u64 = r
        .gpus
        .iter()
        .map(|g| g.unkept_exited_bytes())
        .fold(0, u64::saturating_add);
    if unkept > 0 {
        let gpus: Vec<String> = r
            .gpus
            .iter()
            .filter(|g| g.unkept_exited_bytes() > 0)
            .map(|g| g.index.to_string())
            .collect();
        let _ = writeln!(
            out,
            "{} {} on GPU {} is listed for exited pids that no process keeps: the driver is \
             tearing their contexts down; if it stays, it is residue that a GPU reset frees",
            st.yellow("exited:"),
            format_bytes(unkept),
            gpus.join(",")
        );
    }
    let unreadable: Vec<String> = r
        .gpus
        .iter()
        .filter(|g| g.is_unreadable())
        .map(|g| g.index.to_string())
        .collect();
    if !unreadable.is_empty() {
        // A GPU that could not be read is never "accounted for".
        let _ = writeln!(
            out,
            "{} GPU {} could not be read (the error is above): whose memory it holds cannot \
             be told",
            st.yellow("unread:"),
            unreadable.join(",")
        );
    } else if ghost == 0 && unexplained == 0 && unkept == 0 {
        let unsplit: Vec<String> = r
            .gpus
            .iter()
            .filter(|g| {
                g.unaccounted
                    .as_ref()
                    .is_some_and(|u| u.significant && !u.counts_as_ghost())
            })
            .map(|g| g.index.to_string())
            .collect();
        let _ = writeln!(
            out,
            "{}",
            if unsplit.is_empty() {
                let mut line = st.green("every byte is accounted for by a live job");
                if !r.full_fd_scan {
                    // `status` read the listed processes only: say what it did not look at.
                    line.push_str(&st.dim(
                        " (by the processes the driver lists; `--full-scan` also shows those \
                         holding the device files without memory)",
                    ));
                }
                line
            } else {
                st.green(&format!(
                    "no ghost memory counted: the driver does not split GPU {}'s memory per \
                     process (MIG or vGPU); its holders' classes say whose it is",
                    unsplit.join(",")
                ))
            }
        );
    }
    if let Some(h) = &r.host {
        host_block(&mut out, st, h);
    }
    for l in &r.limitations {
        let _ = writeln!(out, "{} {l}", st.yellow("note:"));
    }
    fit_lines(&out, st.width)
}

/// The host side: available RAM and pressure, the shared-memory directories, segments dead
/// jobs left, and the host memory of each dead job.
fn host_block(out: &mut String, st: &Style, h: &HostReport) {
    let mut parts = Vec::new();
    if let (Some(avail), Some(total)) = (h.mem_available_bytes, h.mem_total_bytes) {
        parts.push(format!(
            "{} of {} available",
            format_bytes(avail),
            format_bytes(total)
        ));
    }
    if let Some(p) = h.pressure {
        parts.push(format!("memory pressure {:.1}% (10 s)", p.some_avg10));
    }
    for d in &h.shm_dirs {
        match (&d.error, d.used_bytes, d.size_bytes) {
            (Some(e), _, _) => parts.push(shown(e)),
            (None, Some(used), Some(size)) => parts.push(format!(
                "{} {} of {} used",
                d.path,
                format_bytes(used),
                format_bytes(size)
            )),
            _ => {}
        }
    }
    if parts.is_empty() && h.segments.is_empty() && h.dead_jobs.is_empty() {
        return;
    }
    let _ = writeln!(out, "{} {}", st.bold("host:"), parts.join(" · "));
    let orphans: Vec<&SegmentReport> = h
        .segments
        .iter()
        .filter(|s| s.verdict == SegmentVerdict::Reclaimable)
        .collect();
    if !orphans.is_empty() {
        let _ = writeln!(
            out,
            "  {} {} in {} segment(s) no process uses: `vramguard reclaim --include shm` removes them",
            st.red("orphaned shared memory:"),
            format_bytes(h.orphan_shm_bytes),
            orphans.len()
        );
        for s in orphans.iter().take(5) {
            let _ = writeln!(
                out,
                "    {} {:>10}  uid {:<6} unchanged {}  {}",
                cell(&format!("{}/{}", s.dir, s.name), 40),
                format_bytes(s.bytes),
                s.uid,
                compact_age(s.age_secs),
                shown(s.producer.as_deref().unwrap_or("?"))
            );
        }
        if orphans.len() > 5 {
            let _ = writeln!(
                out,
                "    … and {} more (--json lists all)",
                orphans.len() - 5
            );
        }
    }
    for j in &h.dead_jobs {
        let mut host = format!("{} host RAM", format_bytes(j.rss_bytes));
        if j.shm_bytes > 0 {
            host.push_str(&format!(
                " ({} of it in shared memory)",
                format_bytes(j.shm_bytes)
            ));
        }
        if j.pinned_bytes > 0 {
            host.push_str(&format!(", {} pinned", format_bytes(j.pinned_bytes)));
        }
        let _ = writeln!(
            out,
            "  job of leader {} (gone): {} GPU, {host}, in {} process(es)",
            j.leader_pid,
            format_bytes(j.gpu_bytes),
            j.pids.len()
        );
    }
}

/// `vramguard diagnose`.
pub fn diagnose(d: &Diagnosis, st: &Style) -> String {
    let mut out = String::new();
    let r = &d.report;
    let _ = writeln!(
        out,
        "{} · {} · {}",
        st.bold("vramguard diagnose"),
        r.hostname.as_deref().unwrap_or("?"),
        driver_line(r)
    );
    let mut current_gpu = None;
    for c in &d.checks {
        if c.gpu != current_gpu {
            current_gpu = c.gpu;
            if let Some(i) = c.gpu
                && let Some(g) = r.gpus.iter().find(|g| g.index == i)
            {
                let _ = writeln!(out);
                let _ = writeln!(out, "{}", gpu_title(st, g));
            }
        }
        let mark = match c.status {
            CheckStatus::Pass => st.green("✓"),
            CheckStatus::Warn => st.yellow("!"),
            CheckStatus::Fail => st.red("✗"),
        };
        let _ = writeln!(out, "  {mark} {:<18} {}", c.name, c.evidence);
    }
    let _ = writeln!(out);
    let v = &d.verdict;
    let verdict = if v.clean {
        st.green(&format!("verdict: {}", v.summary))
    } else {
        st.red(&format!("verdict: {}", v.summary))
    };
    let _ = writeln!(out, "{verdict}");
    if !v.next_steps.is_empty() {
        let _ = writeln!(out, "next:");
        for (i, s) in v.next_steps.iter().enumerate() {
            let _ = writeln!(out, "  {}. {}", i + 1, s.why);
            if let Some(cmd) = &s.command {
                let _ = writeln!(out, "     {}", st.bold(&format!("$ {cmd}")));
            }
        }
    }
    wrap_lines(&out, st.width)
}
