//! A snapshot is input (`--replay`, a bug report, a file someone left in /tmp): whatever a
//! structurally valid one says (extreme numbers, indices that point nowhere, missing
//! processes, duplicated pids), classifying, planning and diagnosing it never panics, and the
//! planner never targets a pid the snapshot does not hold.

use proptest::prelude::*;
use serde_json::Value;
use vramguard_core::plan::{ReclaimOptions, plan_reclaim};
use vramguard_core::{Policy, Snapshot, classify};

const INCIDENTS: &[&str] = &[
    include_str!("../../../tests/incidents/demo.json"),
    include_str!(
        "../../../tests/incidents/a_container_with_its_own_pid_namespace_lives_until_its_init_dies.json"
    ),
    include_str!("../../../tests/incidents/orphaned_shared_memory_and_a_dead_jobs_host_ram.json"),
];

/// Where a mutation lands: the n-th node of a depth-first walk.
fn nodes(v: &mut Value) -> Vec<*mut Value> {
    let mut out = vec![v as *mut Value];
    match v {
        Value::Object(m) => m.values_mut().for_each(|c| out.extend(nodes(c))),
        Value::Array(a) => a.iter_mut().for_each(|c| out.extend(nodes(c))),
        _ => {}
    }
    out
}

#[derive(Debug, Clone)]
enum Mutation {
    Number(u64),
    Negative,
    Empty,
    DropFirst,
    Duplicate,
    Text(String),
}

fn mutate(v: &mut Value, at: usize, m: &Mutation) {
    let all = nodes(v);
    let target = all[at % all.len()];
    // SAFETY: the pointers come from one walk of `v`, which is not otherwise touched until
    // this one write; only one of them is dereferenced.
    let node = unsafe { &mut *target };
    match (m, &mut *node) {
        (Mutation::Number(n), Value::Number(_)) => *node = Value::from(*n),
        (Mutation::Negative, Value::Number(_)) => *node = Value::from(-1i64),
        (Mutation::Empty, Value::Array(a)) => a.clear(),
        (Mutation::DropFirst, Value::Array(a)) if !a.is_empty() => {
            a.remove(0);
        }
        (Mutation::Duplicate, Value::Array(a)) if !a.is_empty() => {
            let first = a[0].clone();
            a.push(first);
        }
        (Mutation::Text(t), Value::String(_)) => *node = Value::from(t.clone()),
        _ => {}
    }
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        prop::sample::select(vec![0u64, 1, 2, 7, 255, u32::MAX as u64, u64::MAX])
            .prop_map(Mutation::Number),
        Just(Mutation::Negative),
        Just(Mutation::Empty),
        Just(Mutation::DropFirst),
        Just(Mutation::Duplicate),
        "[\\x00-\\x7f]{0,12}|\\PC{0,4}".prop_map(Mutation::Text),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]
    #[test]
    fn any_mutated_snapshot_is_classified_planned_and_diagnosed_without_panic(
        which in 0usize..INCIDENTS.len(),
        mutations in prop::collection::vec((any::<usize>(), arb_mutation()), 1..6),
    ) {
        let mut v: Value = serde_json::from_str(INCIDENTS[which]).unwrap();
        for (at, m) in &mutations {
            mutate(&mut v, *at, m);
        }
        let Ok(mut snap) = serde_json::from_value::<Snapshot>(v) else {
            return Ok(());
        };
        snap.normalize();
        let policy = Policy::default();
        let report = classify(&snap, &policy);
        let opts = ReclaimOptions {
            include_shm: Some(policy.shm.clone()),
            ..ReclaimOptions::default()
        };
        let plan = plan_reclaim(&snap, &report, &opts);
        for t in plan.targets() {
            prop_assert!(snap.process(t.pid).is_some(), "target {} is not in the snapshot", t.pid);
            prop_assert!(t.pid > 1);
        }
        let _ = vramguard_core::diagnose::diagnose(report);
    }
}
