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
