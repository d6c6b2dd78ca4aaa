//! Feedback while a command waits: one plain line per change of state, and on a terminal a
//! status line (countdown, progress, ETA) redrawn in place.
//!
//! Piped output gets the plain lines only, so a log or a test sees each state change once and
//! no carriage returns; `--json` keeps stdout for the final document (the lines then go to
//! stderr, and only when stderr is a terminal).

use std::io::{IsTerminal, Write};
use std::time::Duration;
use vramguard_core::sanitize::escape;
use vramguard_core::units::{format_bytes, format_duration};
use vramguard_ops::{Phase, Progress, ReclaimObserver};

/// Where feedback goes, and whether it may redraw.
pub struct Feedback {
    out: Option<Box<dyn Write + Send>>,
    tty: bool,
    /// The status line now on screen (drawn without a newline).
    status: Option<String>,
}

impl Feedback {
    /// For a command whose human output is on stdout, or (`json`) whose stdout is a JSON
    /// document: then feedback goes to stderr when it is a terminal, else nowhere.
    pub fn for_output(json: bool) -> Feedback {
        if json {
            let tty = std::io::stderr().is_terminal();
            Feedback {
                out: tty.then(|| Box::new(std::io::stderr()) as Box<dyn Write + Send>),
                tty,
                status: None,
            }
        } else {
            Feedback {
                out: Some(Box::new(std::io::stdout())),
                tty: std::io::stdout().is_terminal(),
                status: None,
            }
        }
    }

    /// On stderr, redrawn when it is a terminal (for commands whose stdout is their result).
    pub fn on_stderr() -> Feedback {
        Feedback {
            out: Some(Box::new(std::io::stderr())),
            tty: std::io::stderr().is_terminal(),
            status: None,
        }
    }

    /// A line that stays: the status line, if any, is cleared first and drawn again after.
    pub fn line(&mut self, text: &str) {
        let Some(out) = self.out.as_mut() else {
            return;
        };
        let _ = if self.tty && self.status.is_some() {
            write!(out, "\r\x1b[K{text}\n")
        } else {
            writeln!(out, "{text}")
        };
        if let (true, Some(status)) = (self.tty, &self.status) {
            let _ = write!(out, "{status}");
        }
        let _ = out.flush();
    }

    /// The status line, redrawn in place on a terminal (only when it changed); nothing when
    /// piped.
    pub fn status(&mut self, text: String) {
        if !self.tty || self.status.as_deref() == Some(text.as_str()) {
            return;
        }
        let Some(out) = self.out.as_mut() else {
            return;
        };
        let _ = write!(out, "\r\x1b[K{text}");
        let _ = out.flush();
        self.status = Some(text);
    }

    /// Clears the status line.
    pub fn clear(&mut self) {
        if self.status.take().is_some()
            && let Some(out) = self.out.as_mut()
        {
            let _ = write!(out, "\r\x1b[K");
            let _ = out.flush();
        }
    }
}

impl Drop for Feedback {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Whole seconds left, rounded up: a countdown that reads 0 s only at the end.
fn secs_left(d: Duration) -> u64 {
    d.as_millis().div_ceil(1000) as u64
}

fn who(pid: u32, comm: &Option<String>) -> String {
    format!("pid {pid} ({})", escape(comm.as_deref().unwrap_or("?")))
}

/// `reclaim`'s live view: each signal, exit and survivor as it happens, the grace period's
/// countdown and the driver's progress on a terminal, and what a Ctrl-C does.
pub struct ReclaimFeedback {
    feedback: Feedback,
    /// A first Ctrl-C was seen: the countdown says what a second one does.
    interrupted: bool,
}

impl ReclaimFeedback {
    /// A live view on `feedback`.
    pub fn new(feedback: Feedback) -> ReclaimFeedback {
        ReclaimFeedback {
            feedback,
            interrupted: false,
        }
    }
}

impl ReclaimObserver for ReclaimFeedback {
    fn observe(&mut self, event: &Progress) {
        let ctrl_c = if self.interrupted {
            "Ctrl-C again: stop at once"
        } else {
            "Ctrl-C: finish and stop"
        };
        let f = &mut self.feedback;
        // The countdown stays under an exit seen during its wait; anything else ends that wait.
        if !matches!(
            event,
            Progress::Exited { .. } | Progress::Waiting { .. } | Progress::WaitingForRelease { .. }
        ) {
            f.clear();
        }
        match event {
            Progress::Signalled { pid, comm, signal } => {
                f.line(&format!("  SIG{signal} sent to {}", who(*pid, comm)));
            }
            Progress::Skipped { pid, comm, reason } => {
                f.line(&format!(
                    "  {} not signalled: {}",
                    who(*pid, comm),
                    escape(reason)
                ));
            }
            Progress::Exited {
                pid,
                comm,
                after,
                signal,
            } => {
                let how = if *signal == "KILL" {
                    " (after SIGKILL)"
                } else {
                    ""
                };
                f.line(&format!(
                    "  {} exited {} after SIGTERM{how}",
                    who(*pid, comm),
                    format_duration(*after)
                ));
            }
            Progress::StillAlive { pid, comm, grace } => {
                f.line(&format!(
                    "  {} still alive after the {} grace period: sending SIGKILL",
                    who(*pid, comm),
                    format_duration(*grace)
                ));
            }
            Progress::Stuck { pid, comm } => {
                f.line(&format!("  {} survived SIGKILL", who(*pid, comm)));
            }
            Progress::Waiting {
                phase,
                remaining,
                alive,
            } => {
                let what = match phase {
                    Phase::Grace => "SIGKILL for those left in",
                    _ => "waiting for the SIGKILLed to exit:",
                };
                f.status(format!(
                    "  {} alive, {what} {}s · {ctrl_c}",
                    alive.len(),
                    secs_left(*remaining)
                ));
            }
            Progress::WaitingForRelease { remaining, gpus } => {
                let each: Vec<String> = gpus
                    .iter()
                    .map(|(gpu, freed, expected)| {
                        format!(
                            "GPU {gpu} {} of {}",
                            format_bytes(*freed),
                            format_bytes(*expected)
                        )
                    })
                    .collect();
                f.status(format!(
                    "  waiting for the driver: {} back, {}s left · {ctrl_c}",
                    each.join(", "),
                    secs_left(*remaining)
                ));
            }
            Progress::Released { gpu, freed, after } => {
                f.line(&format!(
                    "  GPU {gpu}: {} back {} after the last exit",
                    format_bytes(*freed),
                    format_duration(*after)
                ));
            }
            Progress::Interrupted { finishing, kill_in } => {
                self.interrupted = true;
                let text = match (finishing.is_empty(), kill_in) {
                    (true, _) => "interrupted: finishing what was started (no new signal, no \
                                  reset, no removal); Ctrl-C again to stop at once"
                        .to_string(),
                    (false, kill_in) => {
                        let pids: Vec<String> = finishing.iter().map(|(p, c)| who(*p, c)).collect();
                        format!(
                            "interrupted: finishing what was started: {} got SIGTERM and will get \
                             SIGKILL {}; nothing new is started. Ctrl-C again to stop at once and \
                             leave them as they are",
                            pids.join(", "),
                            match kill_in {
                                Some(d) =>
                                    format!("in {}s, at the end of the grace period", secs_left(*d)),
                                None => "now".to_string(),
                            }
                        )
                    }
                };
                f.line(&text);
            }
        }
    }
}

/// `probe soak`'s progress: on a terminal a status line redrawn each cycle (cycle, time done,
/// percentage, time left, baseline, last release); piped, one plain line each tenth of the run.
pub struct SoakFeedback {
    feedback: Feedback,
    duration: Duration,
    cycles: usize,
    /// The last tenth a plain line was printed for.
    tenth: u64,
}

impl SoakFeedback {
    /// Says the soak began and when it ends.
    pub fn start(mut feedback: Feedback, duration: Duration, cycle: Duration) -> SoakFeedback {
        feedback.line(&format!(
            "soak: allocating and freeing every {} for {}; progress below, the report at the end",
            format_duration(cycle),
            format_duration(duration)
        ));
        SoakFeedback {
            feedback,
            duration,
            cycles: 0,
            tenth: 0,
        }
    }

    /// One cycle ended, `elapsed` after the start.
    pub fn cycle(&mut self, c: &vramguard_probe::experiments::Cycle, elapsed: Duration) {
        self.cycles += 1;
        let percent = (elapsed.as_secs_f64() / self.duration.as_secs_f64().max(1e-9) * 100.0)
            .min(100.0) as u64;
        let release = c
            .release_ms
            .map(|ms| format_duration(Duration::from_secs_f64(ms / 1000.0)))
            .unwrap_or_else(|| "not back".into());
        let text = format!(
            "soak: cycle {}, {} of {} ({percent}%), about {} left; baseline {}, last release {release}",
            self.cycles,
            format_duration(elapsed),
            format_duration(self.duration),
            format_duration(self.duration.saturating_sub(elapsed)),
            format_bytes(c.baseline_after),
        );
        if self.feedback.tty {
            self.feedback.status(text);
        } else if percent / 10 > self.tenth {
            self.tenth = percent / 10;
            self.feedback.line(&text);
        }
    }
}

/// Progress of an experiment made of steps (`probe release`'s trials, `probe concurrent`'s
/// kills): each step's outcome and the time left, judged from the steps so far.
pub struct StepFeedback {
    feedback: Feedback,
    name: &'static str,
    started: std::time::Instant,
}

impl StepFeedback {
    /// Says the experiment began and what it will do.
    pub fn start(mut feedback: Feedback, name: &'static str, plan: &str) -> StepFeedback {
        feedback.line(&format!(
            "{name}: {plan}; progress below, the report at the end"
        ));
        StepFeedback {
            feedback,
            name,
            started: std::time::Instant::now(),
        }
    }

    /// Step `done` of `total` ended with `outcome`.
    pub fn step(&mut self, done: usize, total: usize, outcome: &str) {
        let elapsed = self.started.elapsed();
        let left = elapsed.mul_f64((total.saturating_sub(done)) as f64 / done.max(1) as f64);
        let text = if done < total {
            format!(
                "{}: {done} of {total}: {outcome}; about {} left",
                self.name,
                format_duration(Duration::from_secs(left.as_secs().max(1)))
            )
        } else {
            format!("{}: {done} of {total}: {outcome}; done", self.name)
        };
        if self.feedback.tty {
            self.feedback.status(text);
        } else {
            self.feedback.line(&text);
        }
    }
}
