//! `vramguard slurm heal`: the heal loop ([`vramguard_ops::slurm::heal`]) with Slurm reached
//! through its own commands (`scontrol`, `squeue`, found on `PATH`; `SLURM_CONF` says which
//! cluster, as for every Slurm command).

use crate::cli::HealArgs;
use crate::settings::Settings;
use anyhow::{Context, Result};
use std::process::{Command, Stdio};
use std::time::Duration;
use vramguard_core::sanitize::{fit, shown};
use vramguard_core::slurm::{SlurmNode, parse_job_ids, parse_node};
use vramguard_ops::slurm::{HealOptions, HealResult, Scheduler, SlurmError, heal as heal_loop};
use vramguard_ops::{AuditLog, ExecuteOptions, ResetMode};

/// Most of a Slurm command's output read: a node's line is a few hundred bytes.
const MAX_OUTPUT: u64 = 256 * 1024;
/// How long one Slurm command may take (slurmctld answers in milliseconds, or not at all).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Slurm through `scontrol` and `squeue`.
pub struct SlurmCommands;

impl SlurmCommands {
    /// Runs `program args`, bounded in time and output; its stdout on success.
    fn run(program: &str, args: &[&str], node: &str) -> Result<String, SlurmError> {
        let command = format!("{program} {}", args.join(" "));
        let fail = |what: String| SlurmError {
            command: shown(&command),
            node: shown(node),
            what,
        };
        let done = vramguard_proc::spawn::run_bounded(
            Command::new(program).args(args),
            COMMAND_TIMEOUT,
            MAX_OUTPUT,
        )
        .map_err(|e| fail(e.to_string()))?;
        let (status, out, err) = (done.status, done.stdout, done.stderr);
        if !status.success() {
            let first = String::from_utf8_lossy(&err);
            let first = first.lines().next().unwrap_or("").trim();
            return Err(fail(format!("{status}: {}", fit(first, 200))));
        }
        Ok(String::from_utf8_lossy(&out).into_owned())
    }
}

impl Scheduler for SlurmCommands {
    fn node(&mut self, name: &str) -> Result<SlurmNode, SlurmError> {
        let text = Self::run("scontrol", &["show", "node", name, "--oneliner"], name)?;
        let node = parse_node(&text).map_err(|e| SlurmError {
            command: format!("scontrol show node {}", shown(name)),
            node: shown(name),
            what: e.to_string(),
        })?;
        if node.name != name {
            return Err(SlurmError {
                command: format!("scontrol show node {}", shown(name)),
                node: shown(name),
                what: format!("it described node {} instead", node.name),
            });
        }
        Ok(node)
    }

    fn jobs_on(&mut self, name: &str) -> Result<Vec<String>, SlurmError> {
        let text = Self::run(
            "squeue",
            &[
                "-h",
                "-w",
                name,
                "-t",
                "RUNNING,COMPLETING,SUSPENDED",
                "-o",
                "%i",
            ],
            name,
        )?;
        Ok(parse_job_ids(&text))
    }

    fn resume(&mut self, name: &str) -> Result<(), SlurmError> {
        let node = format!("NodeName={name}");
        Self::run("scontrol", &["update", &node, "State=RESUME"], name).map(drop)
    }

    fn set_reason(&mut self, name: &str, reason: &str) -> Result<(), SlurmError> {
        let node = format!("NodeName={name}");
        // The state is said again: Slurm only takes a reason with a DRAIN (or DOWN) state.
        let reason = format!("Reason={reason}");
        Self::run("scontrol", &["update", &node, "State=DRAIN", &reason], name).map(drop)
    }
}

/// This machine's short host name, as Slurm's `NodeName` usually is.
fn short_hostname() -> Option<String> {
    let host = vramguard_proc::ProcFs::own().ok()?.hostname()?;
    host.split('.').next().map(str::to_string)
}

/// `--detach`: the same command line without it, in a new session. `spawn` returns once the
/// child has exec'd (Rust waits for the exec through a close-on-exec pipe), so the child has
/// called setsid() by then: when the caller (the epilog) exits and slurmd kills its process
/// group, the heal is no longer in it. A shell's `setsid cmd &` leaves a window in which the
/// forked child is still in the group, and slurmd's SIGKILL of the group did hit it there.
fn detach() -> Result<i32> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().context("finding this executable to start the heal")?;
    let args: Vec<std::ffi::OsString> = std::env::args_os()
        .skip(1)
        .filter(|a| a != "--detach")
        .collect();
    let mut cmd = Command::new(exe);
    cmd.args(args).stdin(Stdio::null());
    // SAFETY: setsid() is async-signal-safe and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::setsid()?;
            Ok(())
        });
    }
    let child = cmd.spawn().context("starting the heal in the background")?;
    crate::print(&format!(
        "vramguard slurm heal started in the background (pid {})\n",
        child.id()
    ))?;
    // Not waited for: it outlives this process, and init reaps it.
    std::mem::forget(child);
    Ok(0)
}

/// Runs `vramguard slurm heal`.
pub fn heal(settings: &Settings, args: &HealArgs) -> Result<i32> {
    if args.detach {
        return detach();
    }
    crate::reclaim::check_own_proc(&settings.proc_root)?;
    let name = match &args.node {
        Some(n) => n.clone(),
        // slurmd names this node in its prolog's and epilog's environment; its NodeName can
        // differ from the host name (and a host name can be another node's NodeName).
        None => match std::env::var("SLURMD_NODENAME") {
            Ok(n) if !n.is_empty() => n,
            _ => short_hostname()
                .context("no --node given, no SLURMD_NODENAME, and no host name to use instead")?,
        },
    };
    if name.is_empty()
        || name.len() > 256
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        anyhow::bail!(
            "node name {:?}: a Slurm node name is letters, digits, '-', '_' and '.'",
            vramguard_core::sanitize::shown(&name)
        );
    }
    let mut node = settings.node(&settings.config.policy, args.reset_command.as_deref())?;
    let host = short_hostname().unwrap_or_default();
    let mut audit = AuditLog::open(&args.audit_log, &host).with_context(
        || "no action is taken without an audit trail (choose another file with --audit-log)",
    )?;
    // One heal at a time: two drains in a row (two jobs' epilogs) start two heals, and one
    // reset of the node is enough. The lock lives next to the audit log, which is the node's.
    let mut lock_path = args.audit_log.clone().into_os_string();
    lock_path.push(".heal-lock");
    let lock_path = std::path::PathBuf::from(lock_path);
    // As the audit log itself: never through a link, never a FIFO, created 0600 (a planted
    // link would have root create or truncate the file it names).
    let lock = vramguard_fs::open_append(&lock_path).map_err(|e| {
        anyhow::anyhow!(
            "opening the heal lock {}: {}",
            shown(&lock_path.display().to_string()),
            e.reason()
        )
    })?;
    match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            crate::print(&format!(
                "another vramguard slurm heal holds {}: it does this node's work; nothing done\n",
                lock_path.display()
            ))?;
            return Ok(0);
        }
        Err(e) => {
            return Err(anyhow::anyhow!("locking {}: {e}", lock_path.display()));
        }
    }
    let opts = HealOptions {
        node: name.clone(),
        wait: args.wait,
        poll: args.poll,
        sample: args.sample,
        execute: ExecuteOptions::new(args.grace, args.release_timeout, ResetMode::Auto)
            .with_reset_lock(&settings.config.reclaim.reset_lock),
    };
    let outcome = heal_loop(
        &mut node,
        &mut SlurmCommands,
        &mut audit,
        &settings.config.policy,
        &opts,
    )
    .with_context(|| format!("healing Slurm node {}", shown(&name)))?;
    if args.json {
        crate::print_json(&outcome)?;
    } else {
        let name = shown(&name);
        let line = match &outcome.result {
            HealResult::NotDrained => format!("node {name} is not drained: nothing to do"),
            HealResult::NotOurs {
                reason: Some(reason),
            } => format!("node {name} is drained by someone else ({reason}): left alone"),
            HealResult::NotOurs { reason: None } => format!(
                "node {name} is not drained by vramguard any more (someone else resumed or \
                 drained it): left as it is"
            ),
            HealResult::Unhealthy { state } => {
                format!("node {name} is {state}: left alone, nothing reset")
            }
            HealResult::TimedOut { why } => format!(
                "node {name} still busy after {}s ({why}): left drained, nothing reset",
                args.wait.as_secs()
            ),
            HealResult::Resumed => format!("node {name}: GPUs clean, resumed"),
            HealResult::KeptDrained { reason } => {
                format!("node {name} kept drained: {reason}")
            }
        };
        let mut text = String::new();
        if let Some(o) = &outcome.reclaim {
            text.push_str(&crate::reclaim::render_outcome(o, audit.path()));
        }
        text.push_str(&line);
        text.push('\n');
        crate::print(&text)?;
    }
    drop(lock);
    Ok(outcome.exit_code())
}
