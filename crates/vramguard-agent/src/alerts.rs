//! Alert rules, evaluated per GPU on every sample. Each incident (a rule on a GPU) goes
//! inactive → pending (the condition holds) → firing (it held for `for`): one "firing"
//! notification, then one "resolved" when the condition stops holding. Nothing in between.

use crate::config::{AlertsConfig, Condition, Rule};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use vramguard_core::health::{FindingKind, findings};
use vramguard_core::report::{GpuReport, Report};
use vramguard_core::trend::Trend;
use vramguard_core::units::format_bytes;

/// A state change worth telling someone about.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Notification {
    /// `firing` or `resolved`.
    pub status: &'static str,
    /// The rule's name.
    pub rule: String,
    /// The GPU; none for a node's incident (a Slurm heal that failed).
    pub gpu: Option<u32>,
    /// Its UUID.
    pub uuid: Option<String>,
    /// The host.
    pub host: Option<String>,
    /// The measured value when it changed state.
    pub value: f64,
    /// One sentence.
    pub summary: String,
    /// When the condition started holding, ms since the epoch.
    pub started_at_ms: u64,
    /// When this notification was made, ms since the epoch.
    pub at_ms: u64,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Pending { since_ms: u64 },
    Firing { since_ms: u64 },
}

/// The rules and the state of every incident.
#[derive(Debug, Default)]
pub struct AlertEngine {
    rules: Vec<Rule>,
    states: HashMap<(String, u32), State>,
}

/// Whether a rule's condition holds on a GPU, the value, and the sentence.
fn check(rule: &Rule, g: &GpuReport, trend: Option<&Trend>) -> (bool, f64, String) {
    let used = g.memory.map(|m| m.used).unwrap_or(0);
    match &rule.condition {
        Condition::GhostBytes(limit) => (
            g.ghost_bytes > *limit,
            g.ghost_bytes as f64,
            format!(
                "GPU {}: {} of ghost memory (held by no live job)",
                g.index,
                format_bytes(g.ghost_bytes)
            ),
        ),
        Condition::UsedBytes(limit) => (
            used > *limit,
            used as f64,
            format!("GPU {}: {} used", g.index, format_bytes(used)),
        ),
        Condition::UsedRatio(limit) => {
            let ratio = g
                .memory
                .map_or(0.0, |m| m.used as f64 / m.total.max(1) as f64);
            (
                ratio > *limit,
                ratio,
                format!("GPU {}: {:.0}% of memory used", g.index, ratio * 100.0),
            )
        }
        Condition::LeakSlope(per_hour) => {
            let low = trend.map_or(0.0, |t| t.ci_low * 3600.0);
            let slope = trend.map_or(0.0, |t| t.slope * 3600.0);
            (
                low > *per_hour,
                slope,
                format!(
                    "GPU {}: used memory grows steadily, {}/h",
                    g.index,
                    format_bytes(slope.max(0.0) as u64)
                ),
            )
        }
        Condition::Holders(class) => {
            let n = g.holders.iter().filter(|h| h.class == *class).count();
            (
                n > 0,
                n as f64,
                format!("GPU {}: {n} {class} holder(s)", g.index),
            )
        }
        Condition::MemoryHealth => {
            let h = &g.health;
            let bad = h.reset_pending() || h.remapped_rows.is_some_and(|r| r.failure);
            let what = findings(g.index, h)
                .into_iter()
                .filter(|f| f.kind != FindingKind::Xid)
                .map(|f| f.message)
                .collect::<Vec<_>>()
                .join("; ");
            (
                bad,
                f64::from(u8::from(bad)),
                if bad {
                    format!("GPU {}: {what}", g.index)
                } else {
                    format!("GPU {}: memory health is back to normal", g.index)
                },
            )
        }
        Condition::GpuLost => (
            g.failure.is_some(),
            f64::from(u8::from(g.failure.is_some())),
            match &g.failure {
                Some(f) => format!("GPU {} cannot be read: {f}", g.index),
                None => format!("GPU {} answers again", g.index),
            },
        ),
    }
}

impl AlertEngine {
    /// An engine with `config`'s rules.
    pub fn new(config: &AlertsConfig) -> AlertEngine {
        AlertEngine {
            rules: config.rules.clone(),
            states: HashMap::new(),
        }
    }

    /// Replaces the rules (config reload); incidents of rules that still exist keep their
    /// state, so a reload neither re-fires nor silently drops them.
    pub fn set_rules(&mut self, config: &AlertsConfig) {
        let names: Vec<String> = config.rules.iter().map(|r| r.name.clone()).collect();
        self.states.retain(|(rule, _), _| names.contains(rule));
        self.rules = config.rules.clone();
    }

    /// Evaluates every rule on every GPU of `report`.
    pub fn evaluate(
        &mut self,
        report: &Report,
        trends: &BTreeMap<u32, Trend>,
        now_ms: u64,
    ) -> Vec<Notification> {
        let mut out = Vec::new();
        for rule in &self.rules {
            for g in &report.gpus {
                let (holds, value, summary) = check(rule, g, trends.get(&g.index));
                let key = (rule.name.clone(), g.index);
                let note = |status, started_at_ms| Notification {
                    status,
                    rule: rule.name.clone(),
                    gpu: Some(g.index),
                    uuid: g.uuid.clone(),
                    host: report.hostname.clone(),
                    value,
                    summary: summary.clone(),
                    started_at_ms,
                    at_ms: now_ms,
                };
                match (self.states.get(&key).copied(), holds) {
                    (None, true) => {
                        if rule.for_.is_zero() {
                            self.states.insert(key, State::Firing { since_ms: now_ms });
                            out.push(note("firing", now_ms));
                        } else {
                            self.states.insert(key, State::Pending { since_ms: now_ms });
                        }
                    }
                    (Some(State::Pending { since_ms }), true) => {
                        if now_ms.saturating_sub(since_ms) >= rule.for_.as_millis() as u64 {
                            self.states.insert(key, State::Firing { since_ms });
                            out.push(note("firing", since_ms));
                        }
                    }
                    (Some(State::Pending { .. }), false) => {
                        self.states.remove(&key);
                    }
                    (Some(State::Firing { since_ms }), false) => {
                        self.states.remove(&key);
                        out.push(note("resolved", since_ms));
                    }
                    (Some(State::Firing { .. }), true) | (None, false) => {}
                }
            }
        }
        out
    }

    /// No incident pending or firing: nothing whose state the next sample must re-check.
    pub fn is_calm(&self) -> bool {
        self.states.is_empty()
    }

    /// Incidents firing now: (rule, gpu).
    pub fn firing(&self) -> Vec<(String, u32)> {
        let mut v: Vec<(String, u32)> = self
            .states
            .iter()
            .filter(|(_, s)| matches!(s, State::Firing { .. }))
            .map(|(k, _)| k.clone())
            .collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::path::Path;

    fn report(ghost: u64) -> Report {
        let json = serde_json::json!({
            "schema_version": 1, "taken_at_ms": 0, "hostname": "n1", "pid_namespace_is_host": true, "euid": 0,
            "driver": {"source": "simulated", "library": null, "driver_version": "1", "nvml_version": "1"},
            "limitations": [], "full_fd_scan": true,
            "gpus": [{
                "index": 0, "uuid": "GPU-0", "name": "H200", "pci_bus_id": null, "minor_number": 0,
                "memory": {"total": 100, "reserved": 0, "used": 50, "free": 50},
                "persistence_mode": true, "failure": null, "warnings": [],
                "process_list": {"state": "complete"}, "holders": [], "accounted_bytes": 0,
                "unaccounted": null, "reset_blockers": [], "bytes_by_class": {}, "ghost_bytes": ghost
            }]
        });
        serde_json::from_value(json).unwrap()
    }

    fn engine(for_: &str) -> AlertEngine {
        let c = Config::parse(
            Path::new("t.toml"),
            &format!("[[alerts.rule]]\nname = \"ghost\"\nwhen = \"ghost_bytes\"\nabove = 10\nfor = \"{for_}\"\n"),
        )
        .unwrap();
        AlertEngine::new(&c.alerts)
    }

    #[test]
    fn one_firing_and_one_resolved_per_incident() {
        let mut e = engine("2s");
        let none = BTreeMap::new();
        assert!(e.evaluate(&report(0), &none, 0).is_empty());
        assert!(e.evaluate(&report(20), &none, 1000).is_empty(), "pending");
        assert!(
            e.evaluate(&report(20), &none, 2000).is_empty(),
            "still pending"
        );
        let fired = e.evaluate(&report(20), &none, 3000);
        assert_eq!(fired.len(), 1);
        assert_eq!(fired[0].status, "firing");
        assert_eq!(fired[0].started_at_ms, 1000);
        assert_eq!(e.firing(), vec![("ghost".to_string(), 0)]);
        for t in 4..10 {
            assert!(
                e.evaluate(&report(30), &none, t * 1000).is_empty(),
                "fires once"
            );
        }
        let resolved = e.evaluate(&report(0), &none, 11_000);
        assert_eq!(resolved.len(), 1);
        assert_eq!(resolved[0].status, "resolved");
        assert!(e.evaluate(&report(0), &none, 12_000).is_empty());
        assert!(e.firing().is_empty());
    }

    #[test]
    fn a_blip_shorter_than_for_never_fires() {
        let mut e = engine("5s");
        let none = BTreeMap::new();
        assert!(e.evaluate(&report(20), &none, 0).is_empty());
        assert!(e.evaluate(&report(0), &none, 1000).is_empty());
        assert!(e.evaluate(&report(20), &none, 2000).is_empty());
        assert!(
            e.evaluate(&report(20), &none, 6000).is_empty(),
            "the clock restarted at 2000"
        );
        assert_eq!(e.evaluate(&report(20), &none, 7000).len(), 1);
    }

    #[test]
    fn a_reload_keeps_firing_incidents() {
        let mut e = engine("0s");
        let none = BTreeMap::new();
        assert_eq!(e.evaluate(&report(20), &none, 0).len(), 1);
        let c = Config::parse(
            Path::new("t.toml"),
            "[[alerts.rule]]\nname = \"ghost\"\nwhen = \"ghost_bytes\"\nabove = 10\n",
        )
        .unwrap();
        e.set_rules(&c.alerts);
        assert!(
            e.evaluate(&report(20), &none, 1000).is_empty(),
            "not fired again"
        );
        e.set_rules(&Config::default().alerts);
        assert!(
            e.firing().is_empty(),
            "a removed rule's incidents go with it"
        );
    }
}
