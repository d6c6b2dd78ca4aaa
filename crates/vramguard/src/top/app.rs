//! What `top` shows and where the cursor is: the last report, the sort, the filters, the
//! selection, and the dialog open. Keys change it; nothing here draws or reads the node.

use std::collections::BTreeMap;
use vramguard_core::report::{Class, GpuReport, Holder, Report};
use vramguard_core::snapshot::Snapshot;

/// Orders of the holders table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortKey {
    /// What needs attention first (orphan, zombie, hidden, idle, foreign), then memory.
    Attention,
    /// GPU memory, largest first.
    Memory,
    /// SM utilization, busiest first.
    Sm,
    /// Host CPU, busiest first.
    Cpu,
    /// Age, oldest first.
    Age,
    /// Pid.
    Pid,
}

impl SortKey {
    /// The next key of the `s` cycle.
    pub fn next(self) -> SortKey {
        match self {
            SortKey::Attention => SortKey::Memory,
            SortKey::Memory => SortKey::Sm,
            SortKey::Sm => SortKey::Cpu,
            SortKey::Cpu => SortKey::Age,
            SortKey::Age => SortKey::Pid,
            SortKey::Pid => SortKey::Attention,
        }
    }
    /// Its name in the title line.
    pub fn name(self) -> &'static str {
        match self {
            SortKey::Attention => "attention",
            SortKey::Memory => "memory",
            SortKey::Sm => "%SM",
            SortKey::Cpu => "CPU",
            SortKey::Age => "age",
            SortKey::Pid => "pid",
        }
    }
}

/// How urgent a class is, for [`SortKey::Attention`]: reclaimable ones first (the class
/// table's rank).
fn attention(c: Class) -> u8 {
    c.info().rank
}

/// One row of the holders table: a holder on one GPU, or in the tree view the heading of
/// a job (then `holder` is its first member, which `r` and Enter act on).
#[derive(Debug, Clone)]
pub struct Row {
    /// The GPU it holds.
    pub gpu: u32,
    /// The holder.
    pub holder: Holder,
    /// Its peak SM utilization over the window, when the driver sampled it.
    pub sm_percent: Option<u32>,
    /// In the tree view: this row heads its job's members.
    pub job: Option<JobHeading>,
}

/// A job's line in the tree view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobHeading {
    /// `pgid:4121`, `docker:…`, `slurm:…`, or `-` for holders without a job.
    pub label: String,
    /// Whether the job lives (`None`: cannot be told).
    pub alive: Option<bool>,
    /// Its holder rows.
    pub members: usize,
    /// The GPU memory they hold.
    pub bytes: u64,
}

/// What is open over the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dialog {
    /// Nothing: the table has the keys.
    None,
    /// The selected holder's evidence.
    Detail,
    /// Help for the keys.
    Help,
    /// A plan is being made for this pid.
    Planning(u32),
    /// The plan for the job of `pid`, waiting for `y`.
    Confirm {
        /// The holder it was made for.
        pid: u32,
        /// The plan as `vramguard reclaim` prints it.
        text: String,
        /// Whether it has anything to signal.
        actionable: bool,
    },
    /// The plan is being carried out.
    Running,
    /// What reclaim did (or why it did not).
    Outcome(String),
}

/// What a key asks the loop to do beyond changing the state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Nothing.
    None,
    /// Leave, restoring the terminal.
    Quit,
    /// Make the reclaim plan for the job of this pid.
    Plan(u32),
    /// Carry out the plan shown, made for this pid.
    Execute(u32),
    /// Drop the plan shown.
    Cancel,
}

/// A key, as far as `top` cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Key {
    Char(char),
    Up,
    Down,
    PageUp,
    PageDown,
    Home,
    End,
    Enter,
    Esc,
    CtrlC,
}

/// The state of the screen.
#[derive(Debug)]
pub struct App {
    /// The last report, if one came.
    pub report: Option<Report>,
    /// The rows of the table, sorted and filtered.
    pub rows: Vec<Row>,
    /// Index into [`App::rows`].
    pub selected: usize,
    /// The order.
    pub sort: SortKey,
    /// Only holders of this class.
    pub class_filter: Option<Class>,
    /// Only these GPUs (empty: all).
    pub gpu_filter: Vec<crate::gpusel::GpuSelector>,
    /// The GPUs `gpu_filter` names on the node, resolved at each update.
    gpu_selected: std::collections::BTreeSet<u32>,
    /// Only this user's holders.
    pub user_filter: Option<String>,
    /// What is open.
    pub dialog: Dialog,
    /// The refresh interval, for the title.
    pub delay: std::time::Duration,
    /// The last error or notice, shown in the status line.
    pub message: Option<String>,
    /// Whether colours are off.
    pub monochrome: bool,
    /// Whether reclaiming is possible here (root, own PID namespace); why not otherwise.
    pub reclaim_unavailable: Option<String>,
    /// Whether keys are read (false for `--once`: no key hints then).
    pub interactive: bool,
    /// Whether holders are grouped under their job (`t`).
    pub tree: bool,
    /// The first line of the open dialog's body shown (↑/↓, PgUp/PgDn scroll a body taller
    /// than the screen; its prompt stays in view). The loop keeps it within the body.
    pub dialog_scroll: u16,
}

/// `rows` (already sorted) under a heading per job, jobs in the order of their first row.
fn grouped(rows: Vec<Row>) -> Vec<Row> {
    let label = |r: &Row| {
        r.holder
            .job
            .as_ref()
            .map_or_else(|| "-".to_string(), |j| j.label.clone())
    };
    let mut order: Vec<String> = Vec::new();
    let mut members: BTreeMap<String, Vec<Row>> = BTreeMap::new();
    for r in rows {
        let l = label(&r);
        if !members.contains_key(&l) {
            order.push(l.clone());
        }
        members.entry(l).or_default().push(r);
    }
    let mut out = Vec::new();
    for l in order {
        let group = members.remove(&l).unwrap_or_default();
        let Some(first) = group.first() else { continue };
        let mut heading = first.clone();
        heading.job = Some(JobHeading {
            alive: first.holder.job.as_ref().and_then(|j| j.alive),
            label: l,
            members: group.len(),
            bytes: group.iter().filter_map(|r| r.holder.used_bytes).sum(),
        });
        out.push(heading);
        out.extend(group);
    }
    out
}

/// Classes `c` cycles through: all, then each class that can need attention, most urgent
/// first (services are never the question).
fn class_cycle() -> Vec<Option<Class>> {
    std::iter::once(None)
        .chain(
            Class::by_rank()
                .into_iter()
                .filter(|c| c.info().tone != vramguard_core::report::Tone::Service)
                .map(Some),
        )
        .collect()
}

impl App {
    /// An empty screen, waiting for the first report.
    pub fn new(
        delay: std::time::Duration,
        gpu_filter: Vec<crate::gpusel::GpuSelector>,
        monochrome: bool,
    ) -> App {
        App {
            report: None,
            rows: Vec::new(),
            selected: 0,
            sort: SortKey::Attention,
            class_filter: None,
            gpu_filter,
            gpu_selected: Default::default(),
            user_filter: None,
            dialog: Dialog::None,
            delay,
            message: None,
            monochrome,
            reclaim_unavailable: None,
            interactive: true,
            tree: false,
            dialog_scroll: 0,
        }
    }

    /// Opens `dialog` at the top of its body.
    pub fn open(&mut self, dialog: Dialog) {
        self.dialog = dialog;
        self.dialog_scroll = 0;
    }

    /// Scrolls the open dialog's body for a scrolling key; whether `key` was one.
    fn scroll(&mut self, key: Key) -> bool {
        let page = 10;
        self.dialog_scroll = match key {
            Key::Up => self.dialog_scroll.saturating_sub(1),
            Key::Down => self.dialog_scroll.saturating_add(1),
            Key::PageUp => self.dialog_scroll.saturating_sub(page),
            Key::PageDown => self.dialog_scroll.saturating_add(page),
            Key::Home => 0,
            Key::End => u16::MAX,
            _ => return false,
        };
        true
    }

    /// Takes a new report (and the snapshot it came from, for per-process utilization),
    /// keeping the selection on the same pid when it is still there.
    pub fn update(&mut self, snapshot: &Snapshot, report: Report) {
        let keep = self.selected_row().map(|r| (r.gpu, r.holder.pid));
        let mut sm: BTreeMap<(u32, u32), u32> = BTreeMap::new();
        for g in &snapshot.gpus {
            for s in g.utilization.iter().flat_map(|u| &u.samples) {
                sm.insert((g.index, s.pid), s.sm_percent);
            }
        }
        match crate::gpusel::resolve_in_report(&self.gpu_filter, &report) {
            Ok(selection) => self.gpu_selected = selection.gpus,
            Err(e) => {
                self.gpu_selected.clear();
                self.message = Some(e.to_string());
            }
        }
        self.report = Some(report);
        self.rebuild(&sm);
        if let Some((gpu, pid)) = keep
            && let Some(i) = self
                .rows
                .iter()
                .position(|r| r.gpu == gpu && r.holder.pid == pid)
        {
            self.selected = i;
        }
        self.clamp();
    }

    /// The GPUs shown.
    pub fn gpus(&self) -> Vec<&GpuReport> {
        self.report
            .iter()
            .flat_map(|r| &r.gpus)
            .filter(|g| self.gpu_filter.is_empty() || self.gpu_selected.contains(&g.index))
            .collect()
    }

    fn rebuild(&mut self, sm: &BTreeMap<(u32, u32), u32>) {
        let mut rows: Vec<Row> = Vec::new();
        for g in self.gpus() {
            for h in &g.holders {
                if self.class_filter.is_some_and(|c| c != h.class) {
                    continue;
                }
                if let Some(u) = &self.user_filter
                    && h.user.as_deref() != Some(u.as_str())
                {
                    continue;
                }
                let reported = h.reported_pid.unwrap_or(h.pid);
                rows.push(Row {
                    gpu: g.index,
                    holder: h.clone(),
                    sm_percent: sm.get(&(g.index, reported)).copied(),
                    job: None,
                });
            }
        }
        let key = self.sort;
        rows.sort_by(|a, b| {
            let (x, y) = (&a.holder, &b.holder);
            let memory = y.used_bytes.cmp(&x.used_bytes);
            match key {
                SortKey::Attention => attention(x.class).cmp(&attention(y.class)).then(memory),
                SortKey::Memory => memory,
                SortKey::Sm => b.sm_percent.cmp(&a.sm_percent).then(memory),
                SortKey::Cpu => y.cpu_millicores.cmp(&x.cpu_millicores).then(memory),
                SortKey::Age => y.age_secs.cmp(&x.age_secs).then(memory),
                SortKey::Pid => x.pid.cmp(&y.pid),
            }
            .then(a.gpu.cmp(&b.gpu))
            .then(x.pid.cmp(&y.pid))
        });
        self.rows = if self.tree { grouped(rows) } else { rows };
    }

    /// Re-sorts and re-filters the report held.
    fn refresh_rows(&mut self) {
        let sm: BTreeMap<(u32, u32), u32> = self
            .rows
            .iter()
            .filter(|r| r.job.is_none())
            .filter_map(|r| {
                r.sm_percent
                    .map(|s| ((r.gpu, r.holder.reported_pid.unwrap_or(r.holder.pid)), s))
            })
            .collect();
        self.rebuild(&sm);
        self.clamp();
    }

    fn clamp(&mut self) {
        self.selected = self.selected.min(self.rows.len().saturating_sub(1));
    }

    /// The selected row.
    pub fn selected_row(&self) -> Option<&Row> {
        self.rows.get(self.selected)
    }

    /// Applies a key; returns what the loop must do.
    pub fn key(&mut self, key: Key) -> Request {
        if key == Key::CtrlC {
            return Request::Quit;
        }
        match &self.dialog {
            Dialog::Confirm {
                pid, actionable, ..
            } => {
                let (pid, actionable) = (*pid, *actionable);
                // The plan may be taller than the screen: read to its end before y.
                if self.scroll(key) {
                    return Request::None;
                }
                let go = actionable && matches!(key, Key::Char('y') | Key::Char('Y'));
                self.open(if go { Dialog::Running } else { Dialog::None });
                return if go {
                    Request::Execute(pid)
                } else {
                    self.message = Some("reclaim cancelled: nothing was signalled".into());
                    Request::Cancel
                };
            }
            Dialog::Planning(_) | Dialog::Running => {
                // Busy: only Ctrl-C (above) leaves.
                return Request::None;
            }
            Dialog::Detail | Dialog::Help | Dialog::Outcome(_) => {
                if matches!(key, Key::Char('q')) {
                    return Request::Quit;
                }
                if matches!(key, Key::Esc | Key::Enter | Key::Char(_)) {
                    self.open(Dialog::None);
                    return Request::None;
                }
                // In the details, ↑/↓ still move to the next holder's (from its top).
                let moves = self.dialog == Dialog::Detail && matches!(key, Key::Up | Key::Down);
                if moves {
                    self.dialog_scroll = 0;
                } else if self.scroll(key) {
                    return Request::None;
                }
            }
            Dialog::None => {}
        }
        let page = 10;
        match key {
            Key::Char('q') => return Request::Quit,
            Key::Up | Key::Char('k') => self.selected = self.selected.saturating_sub(1),
            Key::Down | Key::Char('j') => self.selected += 1,
            Key::PageUp => self.selected = self.selected.saturating_sub(page),
            Key::PageDown => self.selected += page,
            Key::Home | Key::Char('g') => self.selected = 0,
            Key::End | Key::Char('G') => self.selected = usize::MAX,
            Key::Char('s') => {
                self.sort = self.sort.next();
                self.refresh_rows();
            }
            Key::Char('c') => {
                let cycle = class_cycle();
                let i = cycle
                    .iter()
                    .position(|c| *c == self.class_filter)
                    .unwrap_or(0);
                self.class_filter = cycle[(i + 1) % cycle.len()];
                self.refresh_rows();
            }
            Key::Char('u') => {
                // Only the selected holder's user; again: everyone.
                self.user_filter = match (&self.user_filter, self.selected_row()) {
                    (None, Some(r)) => r.holder.user.clone(),
                    _ => None,
                };
                self.refresh_rows();
            }
            Key::Enter if self.selected_row().is_some() => self.open(Dialog::Detail),
            Key::Char('?') | Key::Char('h') => self.open(Dialog::Help),
            Key::Char('t') => {
                self.tree = !self.tree;
                self.refresh_rows();
            }
            Key::Char('r') => {
                if let Some(why) = &self.reclaim_unavailable {
                    self.message = Some(format!("reclaim unavailable: {why}"));
                } else if let Some(row) = self.selected_row() {
                    let pid = row.holder.pid;
                    self.open(Dialog::Planning(pid));
                    return Request::Plan(pid);
                }
            }
            _ => {}
        }
        self.clamp();
        Request::None
    }
}
