//! `vramguard top`: the live view. A worker thread owns the node (snapshots, the reclaim
//! plan, its execution: the same `prepare`/`run` path and audit log as `vramguard reclaim`);
//! the terminal thread draws and reads keys, so sampling never freezes the screen.

mod app;
mod view;

use crate::cli::TopArgs;
use crate::settings::Settings;
use anyhow::{Result, bail};
use app::{App, Dialog, Key, Request};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use std::collections::BTreeSet;
use std::io::IsTerminal;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};
use vramguard_core::plan::{ReclaimOptions, plan_reclaim};
use vramguard_core::report::{Class, Report};
use vramguard_core::snapshot::Snapshot;
use vramguard_core::{Policy, classify};
use vramguard_node::Node;
use vramguard_ops::{AuditLog, ExecuteOptions, Prepared, ResetMode, StopRequests};
use vramguard_proc::ScanDepth;

/// What the terminal thread asks of the worker.
enum ToWorker {
    Plan(u32),
    /// Carry out the pending plan, if it was made for this pid.
    Execute(u32),
    Cancel,
}

/// What the worker hands back.
enum FromWorker {
    Report(Box<(Snapshot, Report)>),
    Error(String),
    /// A plan, with the pid it was asked for: shown only while that request is the one open
    /// (a late reply to an earlier request is no plan for the holder selected since).
    Plan {
        pid: u32,
        text: String,
        actionable: bool,
    },
    Outcome(String),
}

/// Runs `vramguard top` until `q` or Ctrl-C. Exit 0, or 130 when Ctrl-C left it while a
/// reclaim ran (that reclaim is finished first, or stopped by a second Ctrl-C, and what it did
/// is printed once the screen is gone).
pub fn run(settings: &Settings, args: &TopArgs) -> Result<i32> {
    let monochrome = args.monochrome || std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let mut app = App::new(args.delay, args.gpu.clone(), monochrome);
    app.class_filter = args.class;
    app.user_filter = args.user.clone();
    if args.once {
        app.interactive = false;
        let (snap, mut report) = settings.report(args.sample)?;
        crate::watch::select_gpus(&mut report, &args.gpu)?;
        app.update(&snap, report);
        crate::print(&view::as_text(&app, crate::render::output_width() as u16))?;
        return Ok(0);
    }
    if settings.replay.is_some() {
        bail!(
            "top watches a live node; a saved snapshot shows with `vramguard --replay FILE top --once`"
        );
    }
    crate::heap::limit_malloc_arenas();
    if !std::io::stdout().is_terminal() || !std::io::stdin().is_terminal() {
        bail!(
            "top needs a terminal; piped, use `vramguard top --once` (one screen) or \
             `vramguard status --watch` (one block per refresh)"
        );
    }
    app.reclaim_unavailable = crate::reclaim::check_own_proc(&settings.proc_root)
        .err()
        .map(|e| e.to_string());
    let (to_worker, from_terminal) = mpsc::channel();
    let (to_terminal, from_worker) = mpsc::channel();
    let stop = StopRequests::new();
    let interrupted = std::thread::scope(|scope| {
        let worker = scope.spawn(|| worker(settings, args, from_terminal, to_terminal, &stop));
        // Raw mode and the alternate screen, restored on every way out (a panic included:
        // ratatui's init installs the hook).
        let mut terminal = ratatui::init();
        let result = ui_loop(&mut terminal, &mut app, &to_worker, &from_worker);
        ratatui::restore();
        drop(to_worker);
        let interrupted = matches!(app.dialog, Dialog::Running);
        let mut handlers = Vec::new();
        if interrupted {
            // Only Ctrl-C leaves while a reclaim runs: it is a first stop request (the
            // decision taken is finished, nothing new is started), and now that the terminal
            // is back in cooked mode, a Ctrl-C is a SIGINT: the second request, which stops
            // at once and names what is left.
            stop.request();
            handlers = crate::reclaim::stop_on_signals(&stop).unwrap_or_default();
            eprintln!(
                "vramguard top: Ctrl-C: finishing the reclaim in progress (targets sent SIGTERM \
                 get SIGKILL at the end of the grace period; nothing new is started); Ctrl-C \
                 again to stop at once"
            );
        }
        let _ = worker.join();
        for id in handlers {
            signal_hook::low_level::unregister(id);
        }
        // What the reclaim did, now that the screen is gone.
        while let Ok(m) = from_worker.try_recv() {
            match m {
                FromWorker::Outcome(text) if interrupted => {
                    let _ = crate::print(&crate::render::wrap_lines(
                        &text,
                        crate::render::output_width(),
                    ));
                }
                FromWorker::Error(e) if interrupted => eprintln!("vramguard top: {e}"),
                _ => {}
            }
        }
        result.map(|()| interrupted)
    })?;
    Ok(if interrupted {
        vramguard_ops::reclaim::INTERRUPTED_EXIT_CODE
    } else {
        0
    })
}

fn ui_loop(
    terminal: &mut ratatui::DefaultTerminal,
    app: &mut App,
    to_worker: &Sender<ToWorker>,
    from_worker: &Receiver<FromWorker>,
) -> Result<()> {
    // Drawn when something changed (a report, a key, a resize), not on every wake-up: an
    // idle screen costs no CPU between refreshes.
    let mut dirty = true;
    loop {
        if dirty {
            terminal.draw(|f| view::draw(f, app))?;
            dirty = false;
        }
        if !event::poll(Duration::from_millis(50))? {
            dirty |= receive(app, from_worker);
            continue;
        }
        let event = event::read()?;
        dirty = true;
        if let Event::Key(k) = event
            && k.kind == KeyEventKind::Press
            && let Some(key) = key_of(k.code, k.modifiers)
        {
            let request = app.key(key);
            // A dialog scrolls no further than its last line at this size.
            let size = terminal.size()?;
            app.dialog_scroll =
                app.dialog_scroll
                    .min(view::dialog_scroll_max(app, size.width, size.height));
            let sent = match request {
                Request::None => Ok(()),
                Request::Quit => return Ok(()),
                Request::Plan(pid) => to_worker.send(ToWorker::Plan(pid)),
                Request::Execute(pid) => to_worker.send(ToWorker::Execute(pid)),
                Request::Cancel => to_worker.send(ToWorker::Cancel),
            };
            if sent.is_err() {
                bail!("the node reader stopped");
            }
        }
        receive(app, from_worker);
    }
}

/// Takes what the worker sent; whether anything came.
fn receive(app: &mut App, from_worker: &Receiver<FromWorker>) -> bool {
    let mut any = false;
    while let Ok(m) = from_worker.try_recv() {
        any = true;
        {
            match m {
                FromWorker::Report(b) => {
                    let (snap, report) = *b;
                    app.update(&snap, report);
                    if app
                        .message
                        .as_deref()
                        .is_some_and(|m| m.starts_with("error"))
                    {
                        app.message = None;
                    }
                }
                FromWorker::Error(e) => {
                    app.message = Some(format!("error: {e}"));
                    if matches!(app.dialog, Dialog::Planning(_) | Dialog::Running) {
                        app.dialog = Dialog::None;
                    }
                }
                FromWorker::Plan {
                    pid,
                    text,
                    actionable,
                } => {
                    if app.dialog == Dialog::Planning(pid) {
                        app.open(Dialog::Confirm {
                            pid,
                            text,
                            actionable,
                        })
                    }
                }
                FromWorker::Outcome(text) => app.open(Dialog::Outcome(text)),
            }
        }
    }
    any
}

fn key_of(code: KeyCode, modifiers: KeyModifiers) -> Option<Key> {
    Some(match code {
        KeyCode::Char('c') if modifiers.contains(KeyModifiers::CONTROL) => Key::CtrlC,
        KeyCode::Char(c) => Key::Char(c),
        KeyCode::Up => Key::Up,
        KeyCode::Down => Key::Down,
        KeyCode::PageUp => Key::PageUp,
        KeyCode::PageDown => Key::PageDown,
        KeyCode::Home => Key::Home,
        KeyCode::End => Key::End,
        KeyCode::Enter => Key::Enter,
        KeyCode::Esc => Key::Esc,
        _ => return None,
    })
}

/// The reader: a snapshot every `delay`, and in between the terminal's requests.
fn worker(
    settings: &Settings,
    args: &TopArgs,
    requests: Receiver<ToWorker>,
    out: Sender<FromWorker>,
    stop: &StopRequests,
) {
    let policy = settings.policy();
    let mut node = match settings.node(policy, None) {
        Ok(n) => n,
        Err(e) => {
            let _ = out.send(FromWorker::Error(format!("{e:#}")));
            return;
        }
    };
    let mut depth = ScanDepth::Full;
    // The plan shown, with the pid it was asked for (made again if confirmed late).
    let mut pending: Option<(u32, Prepared)> = None;
    loop {
        let started = Instant::now();
        let sent = match node.sampled_snapshot(depth, args.sample) {
            Ok(snap) => {
                if depth == ScanDepth::Full {
                    crate::heap::return_free_pages();
                }
                depth = ScanDepth::NewProcesses;
                let report = classify(&snap, policy);
                out.send(FromWorker::Report(Box::new((snap, report))))
            }
            Err(e) => out.send(FromWorker::Error(e.to_string())),
        };
        if sent.is_err() {
            return;
        }
        loop {
            let left = args.delay.saturating_sub(started.elapsed());
            let reply = match requests.recv_timeout(left) {
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return,
                Ok(ToWorker::Cancel) => {
                    pending = None;
                    continue;
                }
                Ok(ToWorker::Plan(pid)) => match plan_for(&mut node, policy, args.sample, pid) {
                    Ok(prepared) => {
                        let text =
                            crate::reclaim::plan_text(&prepared.plan, &prepared.report, false);
                        let actionable = !prepared.plan.is_empty();
                        pending = Some((pid, prepared));
                        FromWorker::Plan {
                            pid,
                            text,
                            actionable,
                        }
                    }
                    Err(e) => FromWorker::Error(format!("planning: {e}")),
                },
                Ok(ToWorker::Execute(asked)) => match plan_asked_for(&mut pending, asked) {
                    Some((pid, prepared)) => {
                        // The node changed: the next refresh scans everything again.
                        depth = ScanDepth::Full;
                        // A dialog left open confirms a plan whose targets may work by now:
                        // made again, only what both plans target is signalled.
                        match prepared.refreshed(&mut node, |snap, report| {
                            plan_reclaim(snap, report, &plan_options(report, pid))
                        }) {
                            Ok((prepared, dropped)) => {
                                execute(&mut node, args, prepared, &dropped, stop)
                            }
                            Err(e) => FromWorker::Error(format!("planning again: {e}")),
                        }
                    }
                    _ => FromWorker::Error(
                        "no plan to carry out for that holder: nothing was signalled".into(),
                    ),
                },
            };
            if out.send(reply).is_err() {
                return;
            }
        }
    }
}

/// The plan shown for `asked`, taken out of `pending`; `None` when the plan pending was made
/// for another holder (a confirmation that crossed a new request) or none is: nothing is
/// carried out then, and the plan of another holder is dropped, never run.
fn plan_asked_for<P>(pending: &mut Option<(u32, P)>, asked: u32) -> Option<(u32, P)> {
    pending.take().filter(|(pid, _)| *pid == asked)
}

/// The plan `vramguard reclaim` makes, for the job of `pid` only (see [`plan_options`]).
fn plan_for(
    node: &mut dyn Node,
    policy: &Policy,
    sample: Duration,
    pid: u32,
) -> Result<Prepared, vramguard_node::NodeError> {
    vramguard_ops::prepare(node, policy, sample, |snap, report| {
        plan_reclaim(snap, report, &plan_options(report, pid))
    })
}

/// What `r` on `pid` asks the planner for: the members of its dead job (orphans, zombies,
/// hidden holders) on the GPUs they hold, or the holder alone when it is idle. Active,
/// detached, system and foreign holders are never targets, whatever is selected.
pub(crate) fn plan_options(report: &Report, pid: u32) -> ReclaimOptions {
    let selected = report
        .gpus
        .iter()
        .flat_map(|g| &g.holders)
        .find(|h| h.pid == pid);
    let leader = selected.and_then(|h| h.dead_job.as_ref().map(|j| j.leader_pid));
    let in_job = |h: &vramguard_core::report::Holder| {
        h.pid == pid
            || leader.is_some_and(|l| h.dead_job.as_ref().is_some_and(|j| j.leader_pid == l))
    };
    let gpus: BTreeSet<u32> = report
        .gpus
        .iter()
        .filter(|g| g.holders.iter().any(in_job))
        .map(|g| g.index)
        .collect();
    let mut include: BTreeSet<Class> = [Class::Orphan, Class::Hidden, Class::Zombie].into();
    if selected.is_some_and(|h| h.class == Class::Idle) {
        include.insert(Class::Idle);
    }
    ReclaimOptions {
        // A pid gone since the screen was drawn: plan for nothing rather than everything.
        gpus: Some(gpus),
        include,
        idle_for_secs: 0,
        mig_devices: None,
        job_of: Some(pid),
        job_label: None,
        include_shm: None,
        include_keepers: false,
    }
}

/// Carries out the plan confirmed, with the audit log `reclaim` keeps.
fn execute(
    node: &mut dyn Node,
    args: &TopArgs,
    prepared: Prepared,
    dropped: &[(u32, String)],
    stop: &StopRequests,
) -> FromWorker {
    let host = prepared.report.hostname.clone().unwrap_or_default();
    let mut audit = match AuditLog::open(&args.audit_log, &host) {
        Ok(a) => a,
        Err(e) => {
            return FromWorker::Error(format!(
                "nothing was signalled: the audit log cannot be written ({e}); choose another \
                 file with --audit-log"
            ));
        }
    };
    let opts = ExecuteOptions::new(args.grace, args.release_timeout, ResetMode::Never);
    match prepared.run_observed(node, &mut audit, &opts, &mut (), stop) {
        Ok(outcome) => {
            let mut text = String::new();
            for (pid, why) in dropped {
                text.push_str(&format!(
                    "pid {pid} left alone: {}\n",
                    vramguard_core::sanitize::shown(why)
                ));
            }
            text.push_str(&crate::reclaim::outcome_text(&outcome, audit.path()));
            FromWorker::Outcome(text)
        }
        Err(e) => FromWorker::Error(format!("reclaim: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::app::{Dialog, Key, Request};
    use super::*;
    use std::sync::mpsc::channel;

    /// The worker's side of the check below: a confirmation carries out only the plan made
    /// for the pid confirmed, and a plan that crossed another request is dropped.
    #[test]
    fn the_worker_carries_out_only_the_plan_made_for_the_pid_confirmed() {
        let mut pending = Some((41, "plan of 41"));
        assert_eq!(plan_asked_for(&mut pending, 42), None, "41's plan for 42");
        assert_eq!(
            pending, None,
            "a plan that crossed another request is dropped"
        );
        let mut pending = Some((41, "plan of 41"));
        assert_eq!(plan_asked_for(&mut pending, 41), Some((41, "plan of 41")));
        assert_eq!(pending, None, "carried out once");
        assert_eq!(plan_asked_for::<&str>(&mut None, 41), None);
    }

    /// Red team: a plan reply carried no pid, and any reply opened the confirmation. `r` on
    /// A, a failed sample closing the Planning dialog, `r` on B, then A's plan arriving: A's
    /// plan was shown for B's request, and `y` carried out whatever the worker held, B's plan.
    /// A late reply is now ignored, and `y` names the pid its plan was made for.
    #[test]
    fn a_late_plan_reply_is_never_confirmed_for_another_request() {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let snap: Snapshot = serde_json::from_str(
            &std::fs::read_to_string(root.join("tests/incidents/demo.json")).unwrap(),
        )
        .unwrap();
        let report = classify(&snap, &Policy::default());
        let mut app = App::new(Duration::from_secs(1), Vec::new(), true);
        app.update(&snap, report);
        let (tx, rx) = channel::<FromWorker>();
        let a = app.selected_row().unwrap().holder.pid;
        assert_eq!(app.key(Key::Char('r')), Request::Plan(a));
        // The periodic sample fails: the Planning dialog closes.
        tx.send(FromWorker::Error("collection failed".into()))
            .unwrap();
        receive(&mut app, &rx);
        assert_eq!(app.dialog, Dialog::None);
        app.key(Key::Down);
        let b = app.selected_row().unwrap().holder.pid;
        assert_ne!(a, b);
        assert_eq!(app.key(Key::Char('r')), Request::Plan(b));
        // A's plan arrives while B's is awaited: not shown.
        tx.send(FromWorker::Plan {
            pid: a,
            text: format!("plan for {a}"),
            actionable: true,
        })
        .unwrap();
        receive(&mut app, &rx);
        assert_eq!(app.dialog, Dialog::Planning(b));
        assert_eq!(app.key(Key::Char('y')), Request::None, "nothing to confirm");
        // B's plan: shown, and `y` asks for B's plan by its pid.
        tx.send(FromWorker::Plan {
            pid: b,
            text: format!("plan for {b}"),
            actionable: true,
        })
        .unwrap();
        receive(&mut app, &rx);
        assert!(
            matches!(&app.dialog, Dialog::Confirm { pid, .. } if *pid == b),
            "{:?}",
            app.dialog
        );
        assert_eq!(app.key(Key::Char('y')), Request::Execute(b));
    }
}
