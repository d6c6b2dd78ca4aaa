//! The incident corpus (`tests/incidents/*.json`) at the core's level: every snapshot
//! classifies, diagnoses and plans (default options) to the JSON of its golden
//! `status.json`, `diagnose.json` and `reclaim-dry-run.json`. The binary's test
//! (`crates/vramguard/tests/incidents.rs`) holds the texts and exit codes; this one holds the
//! decisions, in milliseconds, so that a change of the core (or a mutant of it, see
//! docs/testing.md) meets every real incident and not only the hand-made snapshots.

mod support;

use serde_json::Value;
use std::path::{Path, PathBuf};
use vramguard_core::classify::classify;
use vramguard_core::diagnose::diagnose;
use vramguard_core::plan::plan_reclaim;
use vramguard_core::policy::Policy;
use vramguard_core::snapshot::Snapshot;

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/incidents")
}

/// The first place two JSON values differ, as a path and both sides.
fn first_difference(path: &str, want: &Value, got: &Value) -> Option<String> {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            let mut keys: Vec<&String> = w.keys().chain(g.keys()).collect();
            keys.sort();
            keys.dedup();
            keys.into_iter().find_map(|k| {
                first_difference(
                    &format!("{path}.{k}"),
                    w.get(k).unwrap_or(&Value::Null),
                    g.get(k).unwrap_or(&Value::Null),
                )
            })
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => w
            .iter()
            .zip(g)
            .enumerate()
            .find_map(|(i, (w, g))| first_difference(&format!("{path}[{i}]"), w, g)),
        _ if want == got => None,
        _ => Some(format!("{path}: golden {want}, now {got}")),
    }
}

fn golden(dir: &Path, file: &str) -> Value {
    let text = std::fs::read_to_string(dir.join(file))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join(file).display()));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn every_incident_classifies_diagnoses_and_plans_to_its_golden_json() {
    let mut snapshots: Vec<PathBuf> = std::fs::read_dir(corpus())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    snapshots.sort();
    assert!(snapshots.len() >= 30, "{} incidents", snapshots.len());
    let mut failures = Vec::new();
    for path in &snapshots {
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let dir = corpus().join(&name);
        let mut snap: Snapshot =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        snap.normalize();
        let report = classify(&snap, &Policy::default());
        let plan = plan_reclaim(&snap, &report, &Default::default());
        let views = [
            ("status.json", serde_json::to_value(&report).unwrap()),
            (
                "diagnose.json",
                serde_json::to_value(diagnose(report)).unwrap(),
            ),
            (
                "reclaim-dry-run.json",
                serde_json::json!({
                    "schema_version": vramguard_core::SCHEMA_VERSION,
                    "dry_run": true,
                    "plan": plan,
                }),
            ),
        ];
        for (file, got) in views {
            if let Some(d) = first_difference("", &golden(&dir, file), &got) {
                failures.push(format!("{name}/{file}{d}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} incidents' decisions differ from their golden JSON \
         (scripts/update-golden.sh after an intended change):\n{}",
        failures.len(),
        snapshots.len(),
        failures.join("\n")
    );
}

/// Every incident of the corpus, the real H200 snapshots among them, read as `status` first
/// reads a node (the listed processes): where that answer would stand, the full scan saved in
/// the incident agrees with it (no ghost, unexplained or reclaimable byte, no default target,
/// the same class, bytes and job verdict for every listed holder). The healthy incidents
/// must reach that answer, and every incident with ghost memory must not.
#[test]
fn the_answer_from_the_listed_processes_agrees_with_every_incidents_full_scan() {
    let mut answered = Vec::new();
    let mut failures = Vec::new();
    for path in std::fs::read_dir(corpus())
        .unwrap()
        .flatten()
        .map(|e| e.path())
    {
        if path.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let full: Snapshot = serde_json::from_str(&text).unwrap();
        if !full.scan.full_fd_scan {
            continue;
        }
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        let shallow = support::listed_only_view(&full);
        match support::listed_answer_agrees(&full, &shallow) {
            Ok(true) => answered.push(name),
            Ok(false) => {}
            Err(e) => failures.push(format!("{name}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    answered.sort();
    for healthy in [
        "a_process_in_a_systemd_unit_belongs_to_the_unit",
        "a_container_sharing_the_host_pid_namespace_is_taken_as_alive",
    ] {
        assert!(
            answered.iter().any(|a| a == healthy),
            "{healthy} is not answered from its listed processes; answered: {answered:?}"
        );
    }
    for ghost in answered
        .iter()
        .filter(|a| a.starts_with("h200_dead_trainer"))
    {
        panic!("{ghost}: a ghost incident answered from the listed processes");
    }
}
