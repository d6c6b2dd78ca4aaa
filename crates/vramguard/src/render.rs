//! Human output. Colour only on a terminal, and never when `NO_COLOR` is set.

use std::fmt::Write as _;
use std::io::IsTerminal;
use vramguard_core::diagnose::{CheckStatus, Diagnosis};
use vramguard_core::health::Severity;
use vramguard_core::report::{Class, GpuReport, Holder, Report};
use vramguard_core::snapshot::{DriverSource, ProcessListState};
use vramguard_core::units::format_bytes;

/// Whether to colour stdout.
pub fn use_colour() -> bool {
    std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty()) && std::io::stdout().is_terminal()
}

/// ANSI styling, or none.
#[derive(Debug, Clone, Copy)]
pub struct Style {
    on: bool,
}

impl Style {
    /// Styling on or off.
    pub fn new(on: bool) -> Style {
        Style { on }
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
        match c {
            Class::Active | Class::Detached => self.green(&padded),
            Class::Idle => self.paint("36", &padded),
            Class::Orphan | Class::Zombie => self.red(&padded),
            Class::Foreign | Class::Hidden => self.yellow(&padded),
            Class::System => self.dim(&padded),
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
/// escapes, cut to `max` characters.
fn truncate(s: &str, max: usize) -> String {
    vramguard_core::sanitize::fit(s, max)
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
            bar(m.used, m.total, 20),
            format_bytes(m.used),
            format_bytes(m.total)
        );
    }
    st.bold(&line)
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
    let why = match h.class {
        // What keeps it from being an orphan: the work seen.
        Class::Detached => h
            .evidence
            .iter()
            .find(|e| e.starts_with("working:"))
            .or(h.evidence.first())
            .map(|e| format!("  {}", st.dim(&truncate(e, 70))))
            .unwrap_or_default(),
        Class::Orphan | Class::Hidden | Class::Zombie | Class::Foreign | Class::Idle => h
            .evidence
            .first()
            .map(|e| format!("  {}", st.dim(&truncate(e, 70))))
            .unwrap_or_default(),
        _ => String::new(),
    };
    let job = h.job.as_ref().map_or("-", |j| j.label.as_str());
    format!(
        "  {:<9} {:<9} {} {:<16} {:>10}  {}{}",
        pid,
        truncate(h.user.as_deref().unwrap_or("-"), 9),
        st.class(h.class),
        truncate(job, 16),
        memory,
        truncate(
            h.command.as_deref().or(h.comm.as_deref()).unwrap_or("?"),
            40
        ),
        why
    )
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
        let _ = writeln!(out, "{}", gpu_title(st, g));
        if let Some(f) = &g.failure {
            let _ = writeln!(out, "  {} {f}", st.red("error:"));
            continue;
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
            let _ = writeln!(out, "  {}", st.dim("no processes hold this GPU"));
        } else {
            let _ = writeln!(
                out,
                "  {}",
                st.dim(&format!(
                    "{:<9} {:<9} {:<8} {:<16} {:>10}  {}",
                    "PID", "USER", "CLASS", "JOB", "MEMORY", "COMMAND"
                ))
            );
            for h in &g.holders {
                let _ = writeln!(out, "{}", holder_line(st, h));
            }
        }
        if let Some(u) = &g.unaccounted
            && u.significant
        {
            let _ = writeln!(
                out,
                "  {:<9} {:<9} {} {:<16} {:>10}  {}",
                "-",
                "-",
                st.red(&format!("{:<8}", "ghost")),
                "-",
                format_bytes(u.bytes),
                u.explanation
                    .get(1)
                    .map(|e| truncate(e, 90))
                    .unwrap_or_default()
            );
        }
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
    } else {
        let _ = writeln!(
            out,
            "{}",
            st.green("every byte is accounted for by a live job")
        );
    }
    for l in &r.limitations {
        let _ = writeln!(out, "{} {l}", st.yellow("note:"));
    }
    out
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
    out
}
