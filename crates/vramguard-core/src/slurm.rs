//! Slurm's word on a node, and the heal loop's rules: which drained node vramguard may bring
//! back, and when. No I/O: the text comes from `scontrol show node NAME --oneliner` and
//! `squeue`, run by `vramguard_ops::slurm`.
//!
//! The loop touches only a drain vramguard made itself: the epilog writes its reason with
//! [`DRAIN_MARKER`] in front (`vramguard: ghost memory: 3.0 GiB on GPU 1 …`). An admin who
//! drains the node for maintenance writes another reason (or overwrites ours), and the node
//! is then theirs: never reset, never resumed.

use crate::sanitize::fit;

/// What every drain reason vramguard writes starts with; a reason without it is someone
/// else's drain.
pub const DRAIN_MARKER: &str = "vramguard:";

/// Longest reason kept from Slurm's output (Slurm itself allows more; a reason is a line an
/// admin reads in `sinfo -R`).
pub const MAX_REASON: usize = 300;

/// A node as `scontrol show node NAME --oneliner` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmNode {
    /// `NodeName=`.
    pub name: String,
    /// `State=` as Slurm writes it: a base state and `+`-joined flags (`IDLE+DRAIN`,
    /// `MIXED+DRAIN`, `ALLOCATED+COMPLETING`, `DOWN+NOT_RESPONDING`).
    pub state: String,
    /// `Reason=`, without the `[user@time]` Slurm appends; escaped and bounded.
    pub reason: Option<String>,
}

/// Output of `scontrol show node` that names no node.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("scontrol printed no NodeName= and State= for the node: {0:?}")]
pub struct ParseNodeError(pub String);

/// Parses one node's `--oneliner` description. `Reason=` is the last field and may hold
/// spaces; everything else is `key=value` separated by spaces.
pub fn parse_node(text: &str) -> Result<SlurmNode, ParseNodeError> {
    let line = text.lines().find(|l| l.contains("NodeName=")).unwrap_or("");
    let (fields, reason) = match line.find(" Reason=") {
        Some(i) => (&line[..i], Some(&line[i + " Reason=".len()..])),
        None => (line, None),
    };
    let value = |key: &str| {
        fields
            .split_whitespace()
            .find_map(|f| f.strip_prefix(key))
            .map(str::to_string)
    };
    let (Some(name), Some(state)) = (value("NodeName="), value("State=")) else {
        return Err(ParseNodeError(fit(text.trim(), 120)));
    };
    let reason = reason
        .map(strip_stamp)
        .map(str::trim)
        .filter(|r| !r.is_empty() && *r != "(null)")
        .map(|r| fit(r, MAX_REASON));
    Ok(SlurmNode {
        name: fit(&name, 100),
        state: fit(&state, 100),
        reason,
    })
}

/// `reason [root@2026-12-05T12:08:45]` → `reason`: the last bracket, when it is Slurm's stamp.
fn strip_stamp(reason: &str) -> &str {
    let r = reason.trim_end();
    if r.ends_with(']')
        && let Some(i) = r.rfind(" [")
        && r[i + 2..].contains('@')
        && !r[i + 2..r.len() - 1].contains(' ')
    {
        return &r[..i];
    }
    r
}

impl SlurmNode {
    /// The base state (`IDLE` of `IDLE+DRAIN`), upper case.
    pub fn base_state(&self) -> String {
        self.state
            .split('+')
            .next()
            .unwrap_or("")
            .to_ascii_uppercase()
    }

    fn has_flag(&self, flag: &str) -> bool {
        self.state
            .split('+')
            .skip(1)
            .any(|f| f.eq_ignore_ascii_case(flag))
            // `DRAINED`/`DRAINING` as base states in older `sinfo`-style output.
            || self.base_state().starts_with(flag)
    }

    /// Whether Slurm keeps new jobs off it (`DRAIN`, `DRAINING`, `DRAINED`).
    pub fn drained(&self) -> bool {
        self.has_flag("DRAIN")
    }

    /// Whether the drain is vramguard's own: its reason starts with [`DRAIN_MARKER`].
    pub fn drained_by_vramguard(&self) -> bool {
        self.drained()
            && self
                .reason
                .as_deref()
                .is_some_and(|r| r.starts_with(DRAIN_MARKER))
    }
}

/// What the heal loop may do with a node now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealGate {
    /// Not drained: nothing to heal.
    NotDrained,
    /// Drained by someone else, or for a reason vramguard did not write: left alone.
    NotOurs {
        /// The reason Slurm shows (escaped), if any.
        reason: Option<String>,
    },
    /// Down or otherwise unusable (`DOWN`, `FAIL`, `NOT_RESPONDING`, `POWERED_DOWN`): a reset
    /// would not bring it back, and a resume would hide what is wrong.
    Unhealthy {
        /// Slurm's state.
        state: String,
    },
    /// Ours, but a job still runs (or completes) on it: wait.
    Busy {
        /// Why, in words.
        why: String,
    },
    /// Ours and idle: the GPUs may be reset under the `--reset=auto` rules.
    Ready,
}

/// The rule: only a node drained by vramguard, up, with no job running or completing on it.
/// `jobs` are the jobs `squeue -w NODE` lists as running or completing.
pub fn heal_gate(node: &SlurmNode, jobs: &[String]) -> HealGate {
    if !node.drained() {
        return HealGate::NotDrained;
    }
    if !node.drained_by_vramguard() {
        return HealGate::NotOurs {
            reason: node.reason.clone(),
        };
    }
    let base = node.base_state();
    let unhealthy = ["DOWN", "FAIL", "FUTURE", "UNKNOWN"].contains(&base.as_str())
        || [
            "NOT_RESPONDING",
            "FAIL",
            "POWERED_DOWN",
            "POWERING_DOWN",
            "REBOOT_REQUESTED",
        ]
        .iter()
        .any(|f| node.has_flag(f));
    if unhealthy {
        return HealGate::Unhealthy {
            state: node.state.clone(),
        };
    }
    if !jobs.is_empty() {
        let shown: Vec<String> = jobs.iter().take(5).map(|j| fit(j, 40)).collect();
        return HealGate::Busy {
            why: format!("job(s) {} still on it", shown.join(", ")),
        };
    }
    if ["ALLOCATED", "MIXED", "COMPLETING"].contains(&base.as_str()) || node.has_flag("COMPLETING")
    {
        return HealGate::Busy {
            why: format!("Slurm says {}", node.state),
        };
    }
    HealGate::Ready
}

/// Job ids from `squeue -h -o %i` output, one a line; anything that is not a job id
/// (`123`, `123_4` array task, `123+1` het component) is dropped, and the list is bounded.
pub fn parse_job_ids(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty()
                && l.len() <= 40
                && l.bytes()
                    .all(|b| b.is_ascii_digit() || matches!(b, b'_' | b'+' | b'[' | b']' | b'-'))
        })
        .take(1000)
        .map(str::to_string)
        .collect()
}

/// A drain reason for Slurm: one line, no control characters, [`DRAIN_MARKER`] first,
/// bounded (Slurm keeps reasons whole; `sinfo -R` shows the start).
pub fn drain_reason(what: &str) -> String {
    let one_line: String = what
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    let text = format!("{DRAIN_MARKER} {}", one_line.trim());
    fit(&text, MAX_REASON)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DRAINED: &str = "NodeName=gpu07 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 Gres=gpu:2 \
        State=IDLE+DRAIN ThreadsPerCore=1 Partitions=debug  CfgTRES=cpu=2 AllocTRES= \
        Reason=vramguard: ghost memory: 3.0 GiB on GPU 1 [x] [root@2026-12-05T12:08:45]\n";

    fn node(state: &str, reason: Option<&str>) -> SlurmNode {
        SlurmNode {
            name: "gpu07".into(),
            state: state.into(),
            reason: reason.map(str::to_string),
        }
    }

    #[test]
    fn parses_scontrols_one_line_description() {
        let n = parse_node(DRAINED).unwrap();
        assert_eq!(n.name, "gpu07");
        assert_eq!(n.state, "IDLE+DRAIN");
        // The stamp goes, a bracket of the reason's own stays.
        assert_eq!(
            n.reason.as_deref(),
            Some("vramguard: ghost memory: 3.0 GiB on GPU 1 [x]")
        );
        assert!(n.drained_by_vramguard());
        let idle = parse_node("NodeName=gpu07 State=IDLE Weight=1\n").unwrap();
        assert_eq!((idle.state.as_str(), idle.reason), ("IDLE", None));
        assert!(parse_node("Node gpu07 not found\n").is_err());
        assert!(parse_node("").is_err());
    }

    #[test]
    fn a_hostile_reason_is_escaped_and_bounded() {
        let text = format!(
            "NodeName=gpu07 State=IDLE+DRAIN Reason=vramguard: \u{1b}[31mred{} [a@b]",
            "x".repeat(5000)
        );
        let n = parse_node(&text).unwrap();
        let r = n.reason.unwrap();
        assert!(!r.contains('\u{1b}'), "{r}");
        assert!(r.chars().count() <= MAX_REASON, "{}", r.len());
    }

    #[test]
    fn only_vramguards_own_drain_of_an_idle_node_is_ready() {
        let ours = Some("vramguard: ghost memory: 3.0 GiB on GPU 1");
        assert_eq!(heal_gate(&node("IDLE+DRAIN", ours), &[]), HealGate::Ready);
        assert_eq!(heal_gate(&node("IDLE", ours), &[]), HealGate::NotDrained);
        assert_eq!(heal_gate(&node("IDLE", None), &[]), HealGate::NotDrained);
        // An admin's drain, and an admin who overwrote ours.
        for reason in [
            Some("maintenance"),
            None,
            Some("Vramguard: x"),
            Some(" vramguard: x"),
        ] {
            assert!(
                matches!(
                    heal_gate(&node("IDLE+DRAIN", reason), &[]),
                    HealGate::NotOurs { .. }
                ),
                "{reason:?}"
            );
        }
        // Busy: a job, or Slurm still allocating or completing.
        let job = ["4242".to_string()];
        assert!(matches!(
            heal_gate(&node("IDLE+DRAIN", ours), &job),
            HealGate::Busy { .. }
        ));
        for state in ["MIXED+DRAIN", "ALLOCATED+DRAIN", "IDLE+COMPLETING+DRAIN"] {
            assert!(
                matches!(heal_gate(&node(state, ours), &[]), HealGate::Busy { .. }),
                "{state}"
            );
        }
        for state in [
            "DOWN+DRAIN",
            "IDLE+DRAIN+NOT_RESPONDING",
            "IDLE+DRAIN+POWERED_DOWN",
        ] {
            assert!(
                matches!(
                    heal_gate(&node(state, ours), &[]),
                    HealGate::Unhealthy { .. }
                ),
                "{state}"
            );
        }
    }

    #[test]
    fn job_ids_and_reasons() {
        assert_eq!(
            parse_job_ids("12\n 13_4 \n\nJOBID\n14+1\n$(rm)\n"),
            ["12", "13_4", "14+1"]
        );
        let r = drain_reason("ghost memory:\n3.0 GiB\u{7} on GPU 1");
        assert_eq!(r, "vramguard: ghost memory: 3.0 GiB  on GPU 1");
        assert!(drain_reason(&"y".repeat(1000)).chars().count() <= MAX_REASON);
    }
}
