//! The README's guarantee tables (every table whose last column names tests) name only tests
//! that exist, and every row names at least one.

mod common;
use common::rust_files;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every `.rs` file of the workspace's crates, concatenated.
fn sources() -> String {
    rust_files(&root().join("crates"))
        .into_iter()
        .map(|(_, text)| text)
        .collect()
}

/// The README's tables whose header's last cell mentions tests: (header, rows).
fn guarantee_tables(readme: &str) -> Vec<(String, Vec<String>)> {
    let mut tables = Vec::new();
    let mut lines = readme.lines().peekable();
    while let Some(line) = lines.next() {
        if !line.starts_with('|') {
            continue;
        }
        let header = line.to_string();
        let mut rows = Vec::new();
        while let Some(l) = lines.next_if(|l| l.starts_with('|')) {
            rows.push(l.to_string());
        }
        let last = last_cell(&header).to_lowercase();
        if last.contains("test") || last.contains("checked by") {
            // The first row is the |---| separator.
            tables.push((header, rows.into_iter().skip(1).collect()));
        }
    }
    tables
}

fn last_cell(row: &str) -> &str {
    row.trim_end()
        .trim_end_matches('|')
        .rsplit('|')
        .next()
        .unwrap_or("")
}

/// The names in backticks in a cell.
fn named(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

#[test]
fn the_readmes_guarantee_tables_name_only_tests_that_exist() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let tables = guarantee_tables(&readme);
    let headers: Vec<&str> = tables.iter().map(|(h, _)| h.as_str()).collect();
    for expected in ["| guarantee |", "| case |", "| how it was started |"] {
        assert!(
            headers.iter().any(|h| h.starts_with(expected)),
            "no table starting {expected:?} among {headers:#?}"
        );
    }
    let sources = sources();
    let mut checked = 0;
    for (header, rows) in &tables {
        for row in rows {
            let names = named(last_cell(row));
            assert!(
                !names.is_empty(),
                "a row without a test under {header}: {row}"
            );
            for name in names {
                assert!(
                    name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                    "not a test name: `{name}` in {row}"
                );
                assert!(
                    sources.contains(&format!("fn {name}(")),
                    "README names `{name}`, which is no test: {row}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 40, "{checked} test names checked");
}

#[test]
fn a_renamed_test_is_caught() {
    // The checker itself: a table naming a test that does not exist fails it.
    let readme = "x\n| what | test |\n|---|---|\n| a | `no_such_test_anywhere` |\n";
    let tables = guarantee_tables(readme);
    assert_eq!(tables.len(), 1);
    let names = named(last_cell(&tables[0].1[0]));
    assert_eq!(names, ["no_such_test_anywhere"]);
    let needle = ["fn ", names[0], "("].concat();
    assert!(!sources().contains(&needle));
}

/// A figure's target in `docs/bench-targets.tsv`: (name, unit, comparison, target, quote).
type Target = (String, String, String, String, String);

/// The rows of a targets file (comments and blank lines skipped).
fn bench_targets(text: &str) -> Vec<Target> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            assert_eq!(f.len(), 5, "not five tab-separated columns: {l}");
            (
                f[0].to_string(),
                f[1].to_string(),
                f[2].to_string(),
                f[3].to_string(),
                f[4].to_string(),
            )
        })
        .collect()
}

/// Text as compared: whitespace runs as one space, no thousands separators (`30,500`).
fn normalized(text: &str) -> String {
    let spaced = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let c: Vec<char> = spaced.chars().collect();
    c.iter()
        .enumerate()
        .filter(|&(i, &ch)| {
            !(ch == ','
                && i > 0
                && c[i - 1].is_ascii_digit()
                && c.get(i + 1).is_some_and(|n| n.is_ascii_digit()))
        })
        .map(|(_, &ch)| ch)
        .collect()
}

/// Whether `number` occurs in `text` as a whole number (not inside a longer one).
fn holds_number(text: &str, number: &str) -> bool {
    text.match_indices(number).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let rest = &text[i + number.len()..];
        let digit = |c: Option<char>| c.is_some_and(|c| c.is_ascii_digit() || c == '.');
        // A full stop after the number ends a sentence, not the number.
        let ends = !digit(rest.chars().next()) || rest.starts_with(". ");
        !digit(before) && ends
    })
}

/// What is wrong with the targets against the README and the benchmarks' sources.
fn bench_target_problems(targets: &[Target], readme: &str, benches: &str) -> Vec<String> {
    let readme = normalized(readme);
    let mut problems = Vec::new();
    for (name, unit, cmp, target, quote) in targets {
        let quote = normalized(quote);
        if !readme.contains(&quote) {
            problems.push(format!("{name}: the README does not say {quote:?}"));
        }
        if !holds_number(&quote, target) {
            problems.push(format!("{name}: the target {target} is not in {quote:?}"));
        }
        if target.parse::<f64>().is_err() {
            problems.push(format!("{name}: the target {target} is not a number"));
        }
        if !["<", "<=", ">", ">=", "=", "ref"].contains(&cmp.as_str()) {
            problems.push(format!("{name}: unknown comparison {cmp}"));
        }
        if !benches.contains(&format!("\"{name}\"")) {
            problems.push(format!("{name}: no benchmark prints it"));
        }
        if unit.is_empty() {
            problems.push(format!("{name}: no unit"));
        }
    }
    problems
}

/// The benchmarks' sources, concatenated.
fn bench_sources() -> String {
    let crates = root().join("crates");
    rust_files(&crates)
        .into_iter()
        .filter(|(path, _)| path.components().any(|c| c.as_os_str() == "benches"))
        .map(|(_, text)| text)
        .collect()
}

#[test]
fn every_benchmark_target_is_quoted_in_the_readme_as_written() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let tsv = std::fs::read_to_string(root().join("docs/bench-targets.tsv")).unwrap();
    let targets = bench_targets(&tsv);
    assert!(targets.len() >= 20, "{} targets", targets.len());
    let problems = bench_target_problems(&targets, &readme, &bench_sources());
    assert!(
        problems.is_empty(),
        "docs/bench-targets.tsv and the README disagree:\n{}",
        problems.join("\n")
    );
    assert!(
        readme.contains("scripts/bench.sh") && readme.contains("docs/bench-targets.tsv"),
        "the README's Benchmarks paragraph names the script and the targets file"
    );
}

#[test]
fn a_changed_readme_figure_is_caught() {
    // The checker itself: a README that now says 150 ms where the targets file quotes 140 ms
    // fails it, and so does a target that is not the number quoted.
    let targets = bench_targets(
        "# c\nscan.full_scan\tms\t<=\t140\t| full fd scan | 140 ms |\n\
         agent.cpu_tuned\tms\t<\t2\t2.00 ms (target < 2 ms)\n",
    );
    let benches = "figure(\"scan.full_scan\"); figure(\"agent.cpu_tuned\");";
    assert!(
        bench_target_problems(
            &targets,
            "| full fd scan | 140 ms |\n2.00 ms (target < 2 ms)",
            benches
        )
        .is_empty()
    );
    let stale = bench_target_problems(
        &targets,
        "| full fd scan | 150 ms |\n2.00 ms (target\n< 2 ms)",
        benches,
    );
    assert_eq!(stale.len(), 1, "{stale:?}");
    assert!(stale[0].starts_with("scan.full_scan: the README does not say"));
    let wrong = bench_targets("x\tms\t<=\t14\tat 140 ms\n");
    let p = bench_target_problems(&wrong, "at 140 ms", "\"x\"");
    assert_eq!(p, ["x: the target 14 is not in \"at 140 ms\""]);
    assert_eq!(normalized("30,500 scrapes/s, p50"), "30500 scrapes/s, p50");
}
