//! The Python module's own tests (`packaging/python/tests`, stdlib `unittest`), one Rust test
//! per Python test so that `cargo test` runs them, names them and fails with their output:
//! `vramguard.guard()` on real processes holding the simulated GPU, and `explain_oom()` with
//! a stand-in binary and a stand-in `torch` module (`packaging/python/tests/fake_torch`).
//! No real PyTorch is used here.

mod common;
use common::*;
use std::path::{Path, PathBuf};

fn tests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/python/tests")
}

/// Runs one Python test (`module.Class.test_name`) and fails with its output unless it
/// passed: a skipped test is a failure here, never a pass.
fn python_test(name: &str) {
    use std::os::unix::process::CommandExt;
    let mut python = std::process::Command::new("python3");
    // A suite started by a shell without job control (`scripts/test.sh &`, nohup) runs with
    // SIGINT and SIGQUIT ignored, which every process below inherits; Python then installs
    // no KeyboardInterrupt handler and the guard, rightly, leaves an ignored SIGINT ignored,
    // so the SIGINT test would wait out its timeout. The tests are about a process whose
    // SIGINT is at its default, so that is what they get, however the suite was started.
    // SAFETY: signal(2) is async-signal-safe and touches nothing of the parent's memory.
    unsafe {
        python.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            Ok(())
        });
    }
    let out = python
        .args(["-m", "unittest", "-v", name])
        .current_dir(tests_dir())
        .env("VRAMGUARD_TEST_BINARY", BIN)
        .env("VRAMGUARD_CONFIG", "none")
        .env_remove("VRAMGUARD_SIM")
        .env_remove("VRAMGUARD_NVML_LIB")
        .env_remove("VRAMGUARD_BINARY")
        .env_remove("PYTHONPATH")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("python3 runs (scripts/test.sh installs it)");
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && report.contains("\nOK") && !report.contains("skipped"),
        "python3 -m unittest {name}: {}\n--- stdout ---\n{}\n--- stderr ---\n{report}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn test_exit_ends_a_gpu_holding_child() {
    python_test("test_guard.GuardTest.test_exit_ends_a_gpu_holding_child");
}

#[test]
fn test_an_exception_ends_the_child_and_still_propagates() {
    python_test("test_guard.GuardTest.test_an_exception_ends_the_child_and_still_propagates");
}

#[test]
fn test_sigterm_to_the_guarded_process_ends_the_child_and_exits_143() {
    python_test(
        "test_guard.GuardTest.test_sigterm_to_the_guarded_process_ends_the_child_and_exits_143",
    );
}

#[test]
fn test_sigint_cleans_then_raises_keyboard_interrupt_and_restores_the_handler() {
    python_test(
        "test_guard.GuardTest.test_sigint_cleans_then_raises_keyboard_interrupt_and_restores_the_handler",
    );
}

#[test]
fn test_an_ignored_sigint_stays_ignored_and_the_children_are_ended_on_exit() {
    python_test(
        "test_guard.GuardTest.test_an_ignored_sigint_stays_ignored_and_the_children_are_ended_on_exit",
    );
}

#[test]
fn test_a_child_that_ignores_sigterm_gets_sigkill_after_the_grace() {
    python_test(
        "test_guard.GuardTest.test_a_child_that_ignores_sigterm_gets_sigkill_after_the_grace",
    );
}

#[test]
fn test_it_never_signals_a_non_descendant_a_child_without_gpu_another_user_or_itself() {
    python_test(
        "test_guard.GuardTest.test_it_never_signals_a_non_descendant_a_child_without_gpu_another_user_or_itself",
    );
}

#[test]
fn test_a_grandchild_recorded_while_it_ran_is_ended_after_its_parent_exited() {
    python_test(
        "test_guard.GuardTest.test_a_grandchild_recorded_while_it_ran_is_ended_after_its_parent_exited",
    );
}

#[test]
fn test_the_decorator_cleans_and_a_guard_in_a_thread_installs_no_handler() {
    python_test(
        "test_guard.GuardTest.test_the_decorator_cleans_and_a_guard_in_a_thread_installs_no_handler",
    );
}

#[test]
fn test_as_pid_1_of_a_pid_namespace_it_signals_nothing() {
    python_test("test_guard.GuardTest.test_as_pid_1_of_a_pid_namespace_it_signals_nothing");
}

#[test]
fn test_a_signal_while_cleaning_lets_the_cleanup_finish_then_exits_143() {
    python_test(
        "test_guard.GuardTest.test_a_signal_while_cleaning_lets_the_cleanup_finish_then_exits_143",
    );
}

#[test]
fn test_a_previous_python_handler_is_chained_and_put_back() {
    python_test("test_guard.GuardTest.test_a_previous_python_handler_is_chained_and_put_back");
}

#[test]
fn test_a_forked_copy_neither_cleans_nor_keeps_the_handler() {
    python_test("test_guard.GuardTest.test_a_forked_copy_neither_cleans_nor_keeps_the_handler");
}

#[test]
fn test_a_recorded_pid_that_is_now_another_process_is_not_signalled() {
    python_test(
        "test_guard.GuardTest.test_a_recorded_pid_that_is_now_another_process_is_not_signalled",
    );
}

#[test]
fn test_children_alive_before_the_block_are_left_alone() {
    python_test("test_guard.GuardTest.test_children_alive_before_the_block_are_left_alone");
}

#[test]
fn test_names_are_escaped_as_vramguard_escapes_them() {
    python_test("test_explain.VisibleTextTest.test_names_are_escaped_as_vramguard_escapes_them");
}

#[test]
fn test_a_relative_binary_or_one_in_the_current_directory_is_not_run() {
    python_test(
        "test_explain.BinaryTest.test_a_relative_binary_or_one_in_the_current_directory_is_not_run",
    );
}

#[test]
fn test_two_orphans_of_one_job_are_one_job() {
    python_test("test_explain.ExplainTest.test_two_orphans_of_one_job_are_one_job");
}

#[test]
fn test_an_oom_in_a_thread_is_explained_after_its_traceback() {
    python_test(
        "test_explain.ExplainTest.test_an_oom_in_a_thread_is_explained_after_its_traceback",
    );
}

#[test]
fn test_the_ranks_of_one_job_ask_the_binary_once_per_node() {
    python_test("test_explain.ExplainTest.test_the_ranks_of_one_job_ask_the_binary_once_per_node");
}

#[test]
fn test_a_real_orphan_is_named_within_the_budget() {
    python_test(
        "test_explain.ExplainOnTheSimulatorTest.test_a_real_orphan_is_named_within_the_budget",
    );
}

#[test]
fn test_status_answers_from_the_listed_processes_unless_asked_for_a_full_scan() {
    python_test(
        "test_explain.ExplainOnTheSimulatorTest.test_status_answers_from_the_listed_processes_unless_asked_for_a_full_scan",
    );
}

#[test]
fn test_a_planted_answer_or_symlink_is_never_trusted() {
    python_test("test_explain.ExplainTest.test_a_planted_answer_or_symlink_is_never_trusted");
}

#[test]
fn test_the_hook_takes_at_most_one_second() {
    python_test("test_explain.ExplainTest.test_the_hook_takes_at_most_one_second");
}

#[test]
fn every_python_test_is_run_by_cargo() {
    // A test added to a Python file but not listed above would never run in the suite.
    let mut found = Vec::new();
    for entry in std::fs::read_dir(tests_dir()).unwrap().flatten() {
        let path = entry.path();
        let file = path.file_name().unwrap().to_string_lossy().to_string();
        let Some(module) = file
            .strip_prefix("test_")
            .and_then(|m| m.strip_suffix(".py"))
        else {
            continue;
        };
        let text = std::fs::read_to_string(&path).unwrap();
        let mut class = String::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("class ") {
                class = rest.split(['(', ':']).next().unwrap().to_string();
            } else if let Some(rest) = line.trim_start().strip_prefix("def test_") {
                let name = rest.split('(').next().unwrap();
                found.push(format!("test_{module}.{class}.test_{name}"));
            }
        }
    }
    found.sort();
    // The tests listed above, from this file's own text.
    let own =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python.rs"))
            .unwrap();
    let mut listed: Vec<String> = own
        .split("python_test(")
        .skip(1)
        .filter_map(|rest| rest.trim_start().strip_prefix('"'))
        .map(|rest| rest.split('"').next().unwrap().to_string())
        .filter(|name| name.starts_with("test_"))
        .collect();
    listed.sort();
    assert_eq!(
        found, listed,
        "packaging/python/tests and the list in crates/vramguard/tests/python.rs differ"
    );
}
