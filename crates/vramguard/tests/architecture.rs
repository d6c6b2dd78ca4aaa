//! Rules of the crate layout that a change could break silently (docs/architecture.md).

mod common;
use common::rust_files;
use std::path::{Path, PathBuf};

fn crates_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn only_the_proc_crate_names_proc_or_builds_paths_below_it() {
    // Every /proc read goes through vramguard-proc's `ProcFs`, relative to a root
    // (`--proc-root`, the simulator's `proc_root`, or OWN_PROC where pids are signalled): a
    // literal elsewhere bypasses it, and so does a path joined by hand onto a proc root. The
    // simulator too: it looks at processes the way the node does.
    let mut offenders = Vec::new();
    for krate in std::fs::read_dir(crates_dir()).unwrap().flatten() {
        let name = krate.file_name().to_string_lossy().to_string();
        if name == "vramguard-proc" {
            continue;
        }
        for (path, text) in rust_files(&krate.path().join("src")) {
            for (n, line) in text.lines().enumerate() {
                let code = line.trim_start();
                if code.starts_with("//") {
                    continue;
                }
                let joined_by_hand = code.contains("proc_root") && code.contains(".join(");
                if code.contains("\"/proc") || joined_by_hand {
                    offenders.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(offenders.is_empty(), "{}", offenders.join("\n"));
}

/// The names of the crates in a manifest's `[dependencies]` table (not dev- or build-).
fn normal_dependencies(krate: &str) -> Vec<String> {
    let text = std::fs::read_to_string(crates_dir().join(krate).join("Cargo.toml")).unwrap();
    let mut in_deps = false;
    let mut deps = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if in_deps && let Some((name, _)) = line.split_once(['=', '.']) {
            deps.push(name.trim().to_string());
        }
    }
    deps
}

#[test]
fn the_real_node_does_not_depend_on_the_simulator() {
    // The simulator plugs into the GPU crate's `GpuSource` and the executor's reset function;
    // the code that runs on a real node must not need it.
    for krate in [
        "vramguard-core",
        "vramguard-proc",
        "vramguard-gpu",
        "vramguard-node",
        "vramguard-ops",
        "vramguard-probe",
        "vramguard-config",
        "vramguard-agent",
    ] {
        let deps = normal_dependencies(krate);
        assert!(
            !deps.iter().any(|d| d == "vramguard-sim"),
            "{krate} depends on vramguard-sim: {deps:?}"
        );
        assert!(
            !deps.is_empty() || krate == "vramguard-core",
            "{krate}: {deps:?}"
        );
    }
    assert!(normal_dependencies("vramguard-sim").contains(&"vramguard-gpu".to_string()));
}

/// Every workspace crate and the workspace crates it depends on, normal and dev, from
/// `cargo metadata` (what `cargo tree` reads).
fn workspace_graph() -> Vec<(String, Vec<String>, Vec<String>)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(crates_dir())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let deps_of = |p: &serde_json::Value, kind: Option<&str>| -> Vec<String> {
        p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"].as_str() == kind)
            .filter_map(|d| d["name"].as_str())
            .filter(|n| n.starts_with("vramguard"))
            .map(str::to_string)
            .collect()
    };
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_string(),
                deps_of(p, None),
                deps_of(p, Some("dev")),
            )
        })
        .collect()
}

#[test]
fn the_simulator_sits_beneath_the_node_and_no_dependency_forms_a_cycle() {
    let graph = workspace_graph();
    let normal = |name: &str| -> Vec<String> {
        graph
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, d, _)| d.clone())
            .unwrap_or_else(|| panic!("no crate {name}"))
    };
    // The simulator fakes the driver and the machine beneath the layers that use them: it
    // may build on the core, the files, /proc and the GPU interface, never on the node or
    // the executor it is there to test.
    let mut sim = normal("vramguard-sim");
    sim.sort();
    assert_eq!(
        sim,
        [
            "vramguard-core",
            "vramguard-fs",
            "vramguard-gpu",
            "vramguard-proc"
        ],
        "vramguard-sim's dependencies"
    );
    // No cycle through dev-dependencies either (a crate's tests built against a second copy
    // of itself): every edge, normal or dev, goes down.
    let edges = |name: &str| -> Vec<String> {
        graph
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(_, d, dev)| d.iter().chain(dev).cloned().collect())
            .unwrap_or_default()
    };
    for (start, _, _) in &graph {
        // Depth-first from each crate's dependencies: reaching the crate again is a cycle.
        let mut stack: Vec<Vec<String>> = edges(start)
            .into_iter()
            .map(|d| vec![start.clone(), d])
            .collect();
        let mut seen = std::collections::HashSet::new();
        while let Some(path) = stack.pop() {
            let last = path.last().unwrap().clone();
            assert!(&last != start, "dependency cycle: {}", path.join(" -> "));
            if !seen.insert(last.clone()) {
                continue;
            }
            for next in normal(&last) {
                let mut p = path.clone();
                p.push(next);
                stack.push(p);
            }
        }
    }
}

#[test]
fn the_fake_node_is_built_only_for_tests() {
    let lib = std::fs::read_to_string(crates_dir().join("vramguard-node/src/lib.rs")).unwrap();
    assert!(
        lib.contains("#[cfg(any(test, feature = \"test-support\"))]\npub mod fake;"),
        "vramguard-node's fake must be behind the test-support feature"
    );
    for (name, normal, _) in workspace_graph() {
        assert!(
            !normal.contains(&"vramguard-testkit".to_string()),
            "{name} ships the test kit"
        );
    }
}

#[test]
fn the_use_cases_tell_time_by_the_nodes_clock() {
    // The executor, the audit records it writes, a job's GPU memory and the agent's loop
    // (its waits, exit times and release lags) ask `Node::clock()`, so their unit tests run
    // on the fake node's manual clock; the core has no clock at all. Unit tests (after
    // `#[cfg(test)]`) may wait on the real clock for a thread.
    let mut offenders = Vec::new();
    let mut files: Vec<(PathBuf, String)> = rust_files(&crates_dir().join("vramguard-core/src"));
    for f in [
        "vramguard-ops/src/reclaim.rs",
        "vramguard-ops/src/audit.rs",
        "vramguard-ops/src/gpus.rs",
        "vramguard-ops/src/slurm.rs",
        "vramguard-agent/src/agent.rs",
    ] {
        let path = crates_dir().join(f);
        let text = std::fs::read_to_string(&path).unwrap();
        files.push((path, text));
    }
    for (path, text) in files {
        let code = text.split("#[cfg(test)]").next().unwrap_or("");
        for (n, line) in code.lines().enumerate() {
            // `Instant::elapsed` reads the system clock too.
            if (line.contains("Instant::now")
                || line.contains("SystemTime::now")
                || line.contains(".elapsed()"))
                && !line.trim_start().starts_with("//")
            {
                offenders.push(format!("{}:{}: {}", path.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(offenders.is_empty(), "{}", offenders.join("\n"));
}

#[test]
fn the_use_cases_reach_the_machine_only_through_the_node() {
    // The executor and the agent's loop ask a `Node` (so they run on the fake one in unit
    // tests); only the node crate and the binary that builds nodes talk to NVML.
    for krate in ["vramguard-ops", "vramguard-agent"] {
        let deps = normal_dependencies(krate);
        assert!(
            deps.iter().any(|d| d == "vramguard-node"),
            "{krate}: {deps:?}"
        );
        assert!(
            !deps.iter().any(|d| d == "vramguard-gpu"),
            "{krate} reads GPUs behind the node's back: {deps:?}"
        );
    }
}

#[test]
fn tests_run_the_binary_without_the_hosts_config() {
    // A node with the package installed has /etc/vramguard/config.toml: every test runs the
    // binary through `vg_command` (VRAMGUARD_CONFIG=none) or with its own `--config`.
    // Packaging tests run the installed artifacts as an admin would, config included.
    let direct = ["Command::new(", "BIN)"].concat();
    let unset = ["env_remove(\"VRAMGUARD_", "CONFIG\")"].concat();
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut offenders = Vec::new();
    for (path, text) in rust_files(&tests) {
        let name = path
            .strip_prefix(&tests)
            .unwrap()
            .to_string_lossy()
            .to_string();
        for (n, line) in text.lines().enumerate() {
            let spawns_directly = line.contains(&direct) && name != "common/mod.rs";
            // (and this file's test below, which shows what the variable guards against).
            let unsets =
                line.contains(&unset) && name != "packaging.rs" && name != "architecture.rs";
            if spawns_directly || unsets {
                offenders.push(format!("{name}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "run the binary with common::vg_command():\n{}",
        offenders.join("\n")
    );
}

/// What `vg_command` guards against, for real: in a private mount namespace whose /etc holds
/// a broken /etc/vramguard/config.toml, the binary as tests run it replays a snapshot, while
/// the same command without `VRAMGUARD_CONFIG=none` is stopped by that file.
#[test]
fn a_broken_host_config_does_not_reach_the_tests() {
    let snapshot = Path::new(env!("CARGO_MANIFEST_DIR")).join(
        "../../tests/incidents/a_container_sharing_the_host_pid_namespace_is_taken_as_alive.json",
    );
    let script = "mount -t tmpfs vramguard-test-etc /etc && mkdir /etc/vramguard \
                  && printf 'garbage = [' > /etc/vramguard/config.toml \
                  && exec \"$0\" --replay \"$1\" status";
    let run = |hermetic: bool| {
        let mut unshare = std::process::Command::new("unshare");
        unshare
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                script,
            ])
            .arg(common::BIN)
            .arg(&snapshot)
            .env_remove("VRAMGUARD_CONFIG");
        if hermetic {
            // The environment tests run the binary with.
            for (k, v) in common::vg_command().get_envs() {
                match v {
                    Some(v) => unshare.env(k, v),
                    None => unshare.env_remove(k),
                };
            }
        }
        unshare.output().expect("unshare (util-linux) runs")
    };
    let broken = run(false);
    let err = String::from_utf8_lossy(&broken.stderr);
    assert!(
        broken.status.code() == Some(2) && err.contains("/etc/vramguard/config.toml"),
        "without VRAMGUARD_CONFIG=none the broken file is read ({}): {err}",
        broken.status
    );
    let hermetic = run(true);
    assert!(
        hermetic.status.code() == Some(0),
        "as tests run it, the host's config is not read ({}):\n{}\n{}",
        hermetic.status,
        String::from_utf8_lossy(&hermetic.stdout),
        String::from_utf8_lossy(&hermetic.stderr)
    );
}

/// The string literals of `text` that are not raw, with the line each starts on.
fn string_literals(text: &str) -> Vec<(usize, String)> {
    let b = text.as_bytes();
    let (mut out, mut i) = (Vec::new(), 0);
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                i = text[i..].find('\n').map_or(b.len(), |n| i + n);
            }
            // A char literal ('"' included) or a lifetime.
            b'\'' => {
                i += match (b.get(i + 1), b.get(i + 2), b.get(i + 3)) {
                    (Some(b'\\'), _, Some(b'\'')) => 4,
                    (Some(_), Some(b'\''), _) => 3,
                    _ => 1,
                };
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let hashes = text[i + 1..].bytes().take_while(|c| *c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let close = format!("\"{}", "#".repeat(hashes));
                i = text[i + 2 + hashes..]
                    .find(&close)
                    .map_or(b.len(), |n| i + 2 + hashes + n + close.len());
            }
            b'"' => {
                let start = i;
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                let line = text[..start].matches('\n').count() + 1;
                out.push((line, text[start..i.min(b.len())].to_string()));
                i += 1;
            }
            _ => i += 1,
        }
    }
    out
}

/// A message split over lines needs `\` at the end of each: without it the next line's
/// indentation lands in the text as a run of spaces (two user-facing messages had one). A
/// literal with `\n` in it is laid out on purpose (help examples, test input) and is exempt,
/// and so is indentation at its start.
#[test]
fn no_message_has_a_run_of_spaces_from_a_lost_line_continuation() {
    let mut offenders = Vec::new();
    for krate in std::fs::read_dir(crates_dir()).unwrap().flatten() {
        for (path, text) in rust_files(&krate.path().join("src")) {
            for (line, lit) in string_literals(&text) {
                let laid_out = lit.contains("\\n") || lit.contains('\n');
                // Inside the text, after a word: leading indentation is layout.
                let body = lit.trim_start_matches('"').trim_start();
                if !laid_out && body.trim_end_matches('"').trim_end().contains("        ") {
                    offenders.push(format!("{}:{line}: {lit}", path.display()));
                }
            }
        }
    }
    assert!(offenders.is_empty(), "{}", offenders.join("\n"));
}
