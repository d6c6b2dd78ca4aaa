//! The heal loop for a Slurm node that vramguard drained because a GPU holds memory that only
//! a reset frees: wait until no job runs on the node, reset under the `--reset=auto` rules
//! through the one reclaim pipeline ([`crate::prepare`] → [`crate::Prepared::run`]), check
//! the memory is back, resume the node. A node drained by anyone else, or for any other
//! reason, is left alone ([`vramguard_core::slurm::heal_gate`]).
//!
//! Slurm is reached through [`Scheduler`], which the binary implements with `scontrol` and
//! `squeue` and unit tests fake; every wait is on the node's clock.

use crate::audit::{AuditError, AuditLog};
use crate::reclaim::{ExecuteError, ExecuteOptions, ReclaimOutcome, ResetMode};
use serde::Serialize;
use serde_json::json;
use std::time::Duration;
use vramguard_core::plan::{ReclaimOptions, plan_reclaim};
use vramguard_core::policy::Policy;
use vramguard_core::sanitize::fit;
use vramguard_core::slurm::{HealGate, SlurmNode, drain_reason, heal_gate};
use vramguard_node::{Node, NodeError};

/// A Slurm command that failed: which, on which node, and what it said.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{command} for node {node}: {what} (is slurmctld up? try: scontrol ping)")]
pub struct SlurmError {
    /// The command, as run (`scontrol show node gpu07`).
    pub command: String,
    /// The node asked about.
    pub node: String,
    /// What went wrong (exit status and the first line of its error output, escaped).
    pub what: String,
}

/// What the heal loop asks of Slurm.
pub trait Scheduler {
    /// `scontrol show node NAME --oneliner`, parsed.
    fn node(&mut self, name: &str) -> Result<SlurmNode, SlurmError>;
    /// The jobs running or completing on the node (`squeue -w NAME -t R,CG`).
    fn jobs_on(&mut self, name: &str) -> Result<Vec<String>, SlurmError>;
    /// `scontrol update NodeName=NAME State=RESUME`.
    fn resume(&mut self, name: &str) -> Result<(), SlurmError>;
    /// `scontrol update NodeName=NAME Reason=…` (the node stays drained).
    fn set_reason(&mut self, name: &str, reason: &str) -> Result<(), SlurmError>;
}

/// What to heal and how long to wait for it to be idle.
#[derive(Debug, Clone)]
pub struct HealOptions {
    /// The Slurm node name (this machine's).
    pub node: String,
    /// How long to wait for the node to have no job.
    pub wait: Duration,
    /// How often to ask Slurm meanwhile.
    pub poll: Duration,
    /// The sampling window of the snapshot the plan is made from.
    pub sample: Duration,
    /// Grace and release timeout of the executor; its reset mode is always
    /// [`ResetMode::Auto`].
    pub execute: ExecuteOptions,
}

/// How a heal ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum HealResult {
    /// The node is not drained: nothing to do.
    NotDrained,
    /// Drained by someone else or for another reason: left alone.
    NotOurs {
        /// Slurm's reason, escaped.
        reason: Option<String>,
    },
    /// Down or not responding: left alone.
    Unhealthy {
        /// Slurm's state.
        state: String,
    },
    /// A job still ran on it when the wait ended: left drained, nothing reset.
    TimedOut {
        /// What kept it busy.
        why: String,
    },
    /// The GPUs are clean and the node was resumed.
    Resumed,
    /// The reset failed or memory stayed held: the node stays drained, its reason updated.
    KeptDrained {
        /// The reason written.
        reason: String,
    },
}

/// A heal's whole story.
#[derive(Debug, Clone, Serialize)]
pub struct HealOutcome {
    /// The node.
    pub node: String,
    /// How it ended.
    #[serde(flatten)]
    pub result: HealResult,
    /// The reclaim run (plan, signals, resets), when the node was ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reclaim: Option<ReclaimOutcome>,
}

impl HealOutcome {
    /// 0 resumed or nothing to do (not drained, not ours), 1 the node stays drained (reset
    /// failed, memory still held, still busy at the end of the wait, down).
    pub fn exit_code(&self) -> i32 {
        match self.result {
            HealResult::NotDrained | HealResult::NotOurs { .. } | HealResult::Resumed => 0,
            _ => 1,
        }
    }
}

/// A heal that could not finish: nothing after the failed step was done.
#[derive(Debug, thiserror::Error)]
pub enum HealError {
    /// Slurm did not answer.
    #[error(transparent)]
    Slurm(#[from] SlurmError),
    /// The node could not be read.
    #[error("reading this node's GPUs and processes: {0}")]
    Node(#[from] NodeError),
    /// The reclaim run stopped.
    #[error("resetting: {0}")]
    Execute(#[from] ExecuteError),
    /// The audit log could not be written: nothing is done without it.
    #[error("{0}; nothing more was done")]
    Audit(#[from] AuditError),
}

/// Runs the loop once for `opts.node`: see the module's documentation.
pub fn heal(
    node: &mut dyn Node,
    slurm: &mut dyn Scheduler,
    audit: &mut AuditLog,
    policy: &Policy,
    opts: &HealOptions,
) -> Result<HealOutcome, HealError> {
    let name = opts.node.as_str();
    let done = |result: HealResult| HealOutcome {
        node: name.to_string(),
        result,
        reclaim: None,
    };
    let started = node.clock().now();
    let mut waiting_logged = false;
    loop {
        let n = slurm.node(name)?;
        let jobs = slurm.jobs_on(name)?;
        let ms = node.clock().wall_ms();
        match heal_gate(&n, &jobs) {
            HealGate::NotDrained => {
                audit.record_at(
                    ms,
                    "heal_skipped",
                    json!({"node": name, "why": "not drained"}),
                )?;
                return Ok(done(HealResult::NotDrained));
            }
            HealGate::NotOurs { reason } => {
                audit.record_at(
                    ms,
                    "heal_skipped",
                    json!({"node": name, "why": "drained by someone else", "reason": reason}),
                )?;
                return Ok(done(HealResult::NotOurs { reason }));
            }
            HealGate::Unhealthy { state } => {
                audit.record_at(
                    ms,
                    "heal_skipped",
                    json!({"node": name, "why": "node is not up", "state": state}),
                )?;
                return Ok(done(HealResult::Unhealthy { state }));
            }
            HealGate::Busy { why } => {
                if node.clock().now().saturating_duration_since(started) >= opts.wait {
                    audit.record_at(
                        ms,
                        "heal_timed_out",
                        json!({"node": name, "why": why, "waited_ms": opts.wait.as_millis() as u64}),
                    )?;
                    return Ok(done(HealResult::TimedOut { why }));
                }
                if !waiting_logged {
                    audit.record_at(ms, "heal_waiting", json!({"node": name, "why": why}))?;
                    waiting_logged = true;
                }
                node.clock().sleep(opts.poll);
            }
            HealGate::Ready => break,
        }
    }

    // Every GPU of the node, not only the drained job's: the node is idle, a later job's
    // epilog may have drained it again for another GPU (Slurm keeps one reason), and the node
    // is resumed only when all of them are clean.
    audit.record_at(
        node.clock().wall_ms(),
        "heal_reset",
        json!({"node": name, "gpus": "all"}),
    )?;
    let reclaim_opts = ReclaimOptions::default();
    let prepared = crate::prepare(node, policy, opts.sample, |snap, report| {
        plan_reclaim(snap, report, &reclaim_opts)
    })?;
    let execute = ExecuteOptions {
        reset: ResetMode::Auto,
        ..opts.execute.clone()
    };
    // A process of a job that is gone and still works holds its GPU memory after the reclaim
    // (it is left alone, and is no ghost memory): the node is not clean for the next job.
    let still_working: Vec<String> = prepared
        .report
        .holders()
        .filter(|(_, h)| h.class == vramguard_core::Class::Detached)
        .map(|(gpu, h)| {
            format!(
                "GPU {gpu}: pid {} ({}) of a job that is gone still works there",
                h.pid,
                vramguard_core::sanitize::escape(h.comm.as_deref().unwrap_or("?"))
            )
        })
        .collect();
    let outcome = prepared.run(node, audit, &execute)?;

    let ms = node.clock().wall_ms();
    let result = if outcome.exit_code == 0 && still_working.is_empty() {
        // The node may have changed hands while the GPUs were reset: resume only our drain.
        let now = slurm.node(name)?;
        if !now.drained_by_vramguard() {
            audit.record_at(
                ms,
                "heal_skipped",
                json!({"node": name, "why": "the drain changed hands during the reset",
                       "reason": now.reason}),
            )?;
            HealResult::NotOurs { reason: now.reason }
        } else {
            match slurm.resume(name) {
                Ok(()) => {
                    audit.record_at(ms, "heal_resumed", json!({"node": name}))?;
                    HealResult::Resumed
                }
                Err(e) => {
                    // Slurm refuses to resume a node that is not drained: someone resumed it
                    // in the round trip since the look above. Theirs, and up; anything else
                    // is the error it is.
                    let after = slurm.node(name)?;
                    if after.drained() {
                        return Err(e.into());
                    }
                    audit.record_at(
                        ms,
                        "heal_skipped",
                        json!({"node": name, "why": "the node was resumed by someone else \
                               meanwhile", "reason": after.reason}),
                    )?;
                    HealResult::NotOurs {
                        reason: after.reason,
                    }
                }
            }
        }
    } else {
        let reason = if outcome.exit_code == 0 {
            drain_reason(&fit(
                &format!(
                    "{}; node kept drained (stop it, then resume the node)",
                    still_working.join("; ")
                ),
                200,
            ))
        } else {
            drain_reason(&format!(
                "GPU reset did not free the memory: {}; node kept drained",
                failure_text(&outcome)
            ))
        };
        // Setting the reason drains the node: only while the drain is still ours (an admin
        // who resumed the node, or drained it for maintenance, meanwhile keeps it so).
        let now = slurm.node(name)?;
        if now.drained_by_vramguard() {
            slurm.set_reason(name, &reason)?;
            audit.record_at(ms, "heal_failed", json!({"node": name, "reason": reason}))?;
            HealResult::KeptDrained { reason }
        } else {
            audit.record_at(
                ms,
                "heal_skipped",
                json!({"node": name, "why": "the drain changed hands during the reset",
                       "reason": now.reason, "memory": reason}),
            )?;
            HealResult::NotOurs { reason: now.reason }
        }
    };
    Ok(HealOutcome {
        node: name.to_string(),
        result,
        reclaim: Some(outcome),
    })
}

/// One line on why memory stayed held: each reset's result, else what remains.
fn failure_text(o: &ReclaimOutcome) -> String {
    let resets: Vec<String> = o
        .resets
        .iter()
        .filter(|r| !r.result.starts_with("reset done"))
        .map(|r| format!("GPU {}: {}", r.gpu, r.result))
        .collect();
    let text = if !resets.is_empty() {
        resets.join("; ")
    } else {
        o.remaining
            .iter()
            .map(|r| format!("GPU {}: {}", r.gpu, r.why.join(", ")))
            .collect::<Vec<_>>()
            .join("; ")
    };
    fit(&text, 200)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vramguard_node::Clock;
    use vramguard_node::fake::FakeNode;

    /// A scripted Slurm: the node's states in turn (the last repeats), the jobs on it in turn,
    /// and every update it was asked for.
    #[derive(Default)]
    struct FakeSlurm {
        states: Vec<SlurmNode>,
        jobs: Vec<Vec<String>>,
        asked: usize,
        updates: Vec<String>,
        /// `scontrol update … State=RESUME` fails (the node is not drained any more).
        resume_refused: bool,
    }

    impl FakeSlurm {
        fn drained(reason: &str) -> FakeSlurm {
            FakeSlurm {
                states: vec![slurm_node("IDLE+DRAIN", reason)],
                ..Default::default()
            }
        }
    }

    fn slurm_node(state: &str, reason: &str) -> SlurmNode {
        SlurmNode {
            name: "gpu07".into(),
            state: state.into(),
            reason: Some(reason.into()),
        }
    }

    impl Scheduler for FakeSlurm {
        fn node(&mut self, _: &str) -> Result<SlurmNode, SlurmError> {
            let i = self.asked.min(self.states.len() - 1);
            self.asked += 1;
            Ok(self.states[i].clone())
        }
        fn jobs_on(&mut self, _: &str) -> Result<Vec<String>, SlurmError> {
            Ok(if self.jobs.is_empty() {
                Vec::new()
            } else {
                self.jobs.remove(0)
            })
        }
        fn resume(&mut self, name: &str) -> Result<(), SlurmError> {
            if self.resume_refused {
                return Err(SlurmError {
                    command: "scontrol update".into(),
                    node: name.into(),
                    what: "slurm_update error: Invalid node state specified".into(),
                });
            }
            self.updates.push(format!("resume {name}"));
            Ok(())
        }
        fn set_reason(&mut self, name: &str, reason: &str) -> Result<(), SlurmError> {
            self.updates.push(format!("reason {name} {reason}"));
            Ok(())
        }
    }

    const OURS: &str = "vramguard: ghost memory: 6.0 GiB on GPU 1";

    fn opts() -> HealOptions {
        HealOptions {
            node: "gpu07".into(),
            wait: Duration::from_secs(60),
            poll: Duration::from_secs(5),
            sample: Duration::from_secs(1),
            execute: ExecuteOptions::new(
                Duration::from_secs(1),
                Duration::from_secs(2),
                ResetMode::Never,
            ),
        }
    }

    fn run(node: &FakeNode, slurm: &mut FakeSlurm) -> (HealOutcome, Vec<String>) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut audit = AuditLog::open(&path, "gpu07").unwrap();
        let mut n = node.clone();
        let out = heal(&mut n, slurm, &mut audit, &Policy::default(), &opts()).unwrap();
        let events = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["event"].to_string())
            .collect();
        (out, events)
    }

    #[test]
    fn our_drain_of_an_idle_node_is_reset_and_resumed() {
        let node = FakeNode::incident("residue_with_no_holder_points_at_a_reset");
        let mut slurm = FakeSlurm::drained(OURS);
        let (out, events) = run(&node, &mut slurm);
        assert_eq!(out.result, HealResult::Resumed, "{out:?}");
        assert_eq!(node.resets(), vec![1]);
        assert_eq!(slurm.updates, ["resume gpu07"]);
        for e in ["heal_reset", "reset_done", "heal_resumed"] {
            assert!(events.iter().any(|x| x.contains(e)), "{e}: {events:?}");
        }
    }

    #[test]
    fn it_waits_for_the_jobs_to_leave_on_the_nodes_clock() {
        let node = FakeNode::incident("residue_with_no_holder_points_at_a_reset");
        let mut slurm = FakeSlurm {
            states: vec![
                node_state("MIXED+DRAIN"),
                node_state("IDLE+COMPLETING+DRAIN"),
                node_state("IDLE+DRAIN"),
            ],
            jobs: vec![vec!["4300".into()], vec![], vec![]],
            ..Default::default()
        };
        let t0 = node.manual_clock().now();
        let (out, events) = run(&node, &mut slurm);
        assert_eq!(out.result, HealResult::Resumed);
        assert!(node.manual_clock().now() - t0 >= Duration::from_secs(10));
        assert_eq!(
            events.iter().filter(|e| e.contains("heal_waiting")).count(),
            1
        );
        assert_eq!(node.resets(), vec![1], "reset only once idle");
    }

    fn node_state(state: &str) -> SlurmNode {
        slurm_node(state, OURS)
    }

    #[test]
    fn a_busy_node_times_out_untouched() {
        let node = FakeNode::incident("residue_with_no_holder_points_at_a_reset");
        let mut slurm = FakeSlurm {
            states: vec![node_state("MIXED+DRAIN")],
            jobs: vec![vec!["4300".into()]; 100],
            ..Default::default()
        };
        let (out, _) = run(&node, &mut slurm);
        assert!(matches!(out.result, HealResult::TimedOut { .. }), "{out:?}");
        assert!(node.resets().is_empty());
        assert!(slurm.updates.is_empty());
    }

    /// An admin resumed the node between the heal's last look and its resume, which Slurm then
    /// refused: the heal said "is slurmctld up? try: scontrol ping" and exited 2. The node is
    /// up and theirs: the heal ends as for a drain that changed hands. Still drained, the
    /// refusal is the error it is.
    #[test]
    fn a_node_resumed_by_someone_else_meanwhile_is_theirs() {
        let node = FakeNode::incident("residue_with_no_holder_points_at_a_reset");
        let mut slurm = FakeSlurm {
            states: vec![node_state("IDLE+DRAIN"), node_state("IDLE+DRAIN"), {
                let mut up = slurm_node("IDLE", "");
                up.reason = None;
                up
            }],
            resume_refused: true,
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut audit = AuditLog::open(&path, "gpu07").unwrap();
        let mut n = node.clone();
        let out = heal(&mut n, &mut slurm, &mut audit, &Policy::default(), &opts()).unwrap();
        assert_eq!(out.result, HealResult::NotOurs { reason: None }, "{out:?}");
        assert_eq!(
            node.resets(),
            vec![1],
            "the reset ran, then the resume was refused"
        );
        let log = std::fs::read_to_string(&path).unwrap();
        assert!(
            log.lines().any(|l| l.contains("\"heal_skipped\"")
                && l.contains("the node was resumed by someone else meanwhile")),
            "{log}"
        );
        let node = FakeNode::incident("residue_with_no_holder_points_at_a_reset");
        let mut slurm = FakeSlurm {
            states: vec![node_state("IDLE+DRAIN")],
            resume_refused: true,
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let mut audit = AuditLog::open(&dir.path().join("audit.jsonl"), "gpu07").unwrap();
        let mut n = node.clone();
        let err = heal(&mut n, &mut slurm, &mut audit, &Policy::default(), &opts()).unwrap_err();
        assert!(err.to_string().contains("Invalid node state"), "{err}");
    }

    #[test]
    fn someone_elses_drain_is_left_alone() {
        for reason in ["maintenance", "vramguard? no: admin", "Kill task failed"] {
            let node = FakeNode::incident("residue_with_no_holder_points_at_a_reset");
            let mut slurm = FakeSlurm::drained(reason);
            let (out, events) = run(&node, &mut slurm);
            assert!(matches!(out.result, HealResult::NotOurs { .. }), "{out:?}");
            assert!(node.resets().is_empty(), "{reason}");
            assert!(node.signals().is_empty(), "{reason}");
            assert!(slurm.updates.is_empty(), "{reason}");
            assert!(
                events.iter().all(|e| e.contains("heal_skipped")),
                "{events:?}"
            );
        }
        // Taken over by an admin while the reset ran: not resumed.
        let node = FakeNode::incident("residue_with_no_holder_points_at_a_reset");
        let mut slurm = FakeSlurm {
            states: vec![
                node_state("IDLE+DRAIN"),
                slurm_node("IDLE+DRAIN", "maintenance"),
            ],
            ..Default::default()
        };
        let (out, _) = run(&node, &mut slurm);
        assert!(matches!(out.result, HealResult::NotOurs { .. }), "{out:?}");
        assert!(slurm.updates.is_empty());
    }

    /// Review finding: a process of a dead job that the plan saw working (on CPU alone, so the
    /// after-check, which samples nothing, reads its work as unknown) was dropped from what
    /// remained, and the heal resumed a node whose GPU it still held. Its memory remains:
    /// the node stays drained, and the reason says why.
    #[test]
    fn a_dead_jobs_process_left_alone_because_it_works_keeps_the_node_drained() {
        let node = FakeNode::incident("nohup_from_a_script_busy_is_detached_and_idle_is_orphan");
        node.edit_snapshot(|s| {
            for g in &mut s.gpus {
                g.utilization = None;
            }
            if let Some(w) = s.work.as_mut() {
                for p in &mut w.processes {
                    if p.pid == 15780 {
                        p.cpu_ticks = 150;
                        p.running_observations = p.observations;
                    }
                }
            }
        });
        let mut slurm = FakeSlurm::drained(OURS);
        let (out, _) = run(&node, &mut slurm);
        let HealResult::KeptDrained { reason } = &out.result else {
            panic!("{out:?}");
        };
        assert!(reason.contains("pid 15780 (detached)"), "{reason}");
        assert!(slurm.updates.iter().all(|u| !u.starts_with("resume")));
        assert!(node.signals().iter().all(|s| s.pid != 15780));
    }

    /// A process of a job that is gone that still computes on its GPU (left alone: it works,
    /// and is no ghost memory) keeps the node drained: the next job would find the GPU in use.
    #[test]
    fn a_dead_jobs_process_still_computing_keeps_the_node_drained() {
        let node = FakeNode::incident("nohup_from_a_script_busy_is_detached_and_idle_is_orphan");
        let mut slurm = FakeSlurm::drained(OURS);
        let (out, _) = run(&node, &mut slurm);
        let HealResult::KeptDrained { reason } = &out.result else {
            panic!("{out:?}");
        };
        assert!(
            reason.contains("pid 15780 (python3) of a job that is gone still works"),
            "{reason}"
        );
        assert!(slurm.updates.iter().all(|u| !u.starts_with("resume")));
        assert!(node.signals().iter().all(|s| s.pid != 15780));
        assert!(
            node.has_exited(15781),
            "the idle orphan was still reclaimed"
        );
    }

    #[test]
    fn a_failed_reset_keeps_the_node_drained_with_the_reason() {
        let node = FakeNode::incident("residue_with_no_holder_points_at_a_reset");
        node.refuse_resets("GPU 1 is in use by the X server");
        let mut slurm = FakeSlurm::drained(OURS);
        let (out, events) = run(&node, &mut slurm);
        let HealResult::KeptDrained { reason } = &out.result else {
            panic!("{out:?}");
        };
        assert!(
            reason.starts_with("vramguard: GPU reset did not free"),
            "{reason}"
        );
        assert!(reason.contains("in use by the X server"), "{reason}");
        assert_eq!(slurm.updates, [format!("reason gpu07 {reason}")]);
        assert_eq!(out.exit_code(), 1);
        assert!(
            events.iter().any(|e| e.contains("heal_failed")),
            "{events:?}"
        );
        // Resumed by an admin while the reset failed: setting the reason would drain the node
        // again, so it is left as the admin left it (red-team finding).
        let node = FakeNode::incident("residue_with_no_holder_points_at_a_reset");
        node.refuse_resets("GPU 1 is in use by the X server");
        let mut slurm = FakeSlurm {
            states: vec![node_state("IDLE+DRAIN"), slurm_node("IDLE", "")],
            ..Default::default()
        };
        let (out, events) = run(&node, &mut slurm);
        assert!(matches!(out.result, HealResult::NotOurs { .. }), "{out:?}");
        assert!(slurm.updates.is_empty(), "{:?}", slurm.updates);
        assert!(
            events.iter().any(|e| e.contains("heal_skipped")),
            "{events:?}"
        );
    }
}
