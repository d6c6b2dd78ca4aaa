//! What an installation needs from the binary: a version that says what was built, shell
//! completions that complete, and man pages.

mod common;
use common::*;
use std::process::Command;

#[test]
fn the_long_version_names_the_commit_the_build_date_and_the_target() {
    let out = Vg::bare().args(["--version"]).code(0);
    let text = stdout(&out);
    assert!(
        text.starts_with(&format!("vramguard {}\n", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    let commit = text
        .lines()
        .find_map(|l| l.strip_prefix("commit: "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())),
        "{commit}"
    );
    let built = text
        .lines()
        .find_map(|l| l.strip_prefix("built: "))
        .unwrap_or_else(|| panic!("{text}"));
    let parts: Vec<u32> = built.split('-').filter_map(|p| p.parse().ok()).collect();
    assert!(
        built.len() == 10
            && parts.len() == 3
            && parts[0] >= 2025
            && (1..=12).contains(&parts[1])
            && (1..=31).contains(&parts[2]),
        "{built}"
    );
    assert!(
        text.contains("target: x86_64-") || text.contains("target: aarch64-"),
        "{text}"
    );
    // -V stays one line, for scripts.
    assert_eq!(stdout(&Vg::bare().args(["-V"]).code(0)).lines().count(), 1);
}

#[test]
fn bash_completion_completes_commands_and_options() {
    let script = stdout(&Vg::bare().args(["completions", "bash"]).code(0));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("vramguard.bash");
    std::fs::write(&file, script).unwrap();
    let complete = |words: &str| {
        let cword = words.split(' ').count() - 1;
        let out = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "source {}; COMP_WORDS=({words}); COMP_CWORD={cword}; COMP_LINE='{words}'; COMP_POINT=${{#COMP_LINE}}; _vramguard vramguard \"${{COMP_WORDS[$COMP_CWORD]}}\" \"${{COMP_WORDS[$COMP_CWORD-1]}}\"; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
                file.display()
            ))
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let commands = complete("vramguard rec");
    assert!(commands.lines().any(|l| l == "reclaim"), "{commands}");
    let options = complete("vramguard reclaim --inc");
    assert!(options.lines().any(|l| l == "--include"), "{options}");
    for shell in ["zsh", "fish"] {
        let s = stdout(&Vg::bare().args(["completions", shell]).code(0));
        assert!(s.contains("reclaim"), "{shell}");
    }
    let (out, _) = Vg::bare().args(["completions", "tcsh"]).output();
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );
}

#[test]
fn man_pages_are_written_for_the_program_and_each_command() {
    let dir = tempfile::tempdir().unwrap();
    Vg::bare().arg_path("man", dir.path()).code(2);
    Vg::bare().args(["man", "--dir"]).args([dir.path()]).code(0);
    for page in [
        "vramguard.1",
        "vramguard-reclaim.1",
        "vramguard-agent.1",
        "vramguard-status.1",
    ] {
        let text = std::fs::read_to_string(dir.path().join(page)).unwrap();
        assert!(text.contains(".TH"), "{page}");
    }
    assert!(
        !dir.path().join("vramguard-__cuda-hold.1").exists(),
        "internal commands have no page"
    );
    let reclaim = std::fs::read_to_string(dir.path().join("vramguard-reclaim.1")).unwrap();
    assert!(
        reclaim.contains("include") && reclaim.contains("audit"),
        "{reclaim}"
    );
}

#[test]
fn global_options_are_listed_apart_from_each_commands_own() {
    for command in [
        &["--help"][..],
        &["reclaim", "--help"],
        &["status", "--help"],
    ] {
        let help = stdout(&Vg::bare().args(command).code(0));
        let (own, global) = help
            .split_once("\nGlobal options:\n")
            .unwrap_or_else(|| panic!("{command:?}: no Global options section\n{help}"));
        // Lines that define an option, not prose that names one.
        let defines = |text: &str, option: &str| {
            text.lines()
                .any(|l| l.trim_start().starts_with(&format!("{option} ")))
        };
        for option in ["--sim", "--nvml-lib", "--proc-root", "--config", "--replay"] {
            assert!(
                !defines(own, option),
                "{command:?}: {option} among the command's own"
            );
            assert!(defines(global, option), "{command:?}: {option} missing");
        }
    }
}

#[test]
fn every_commands_help_ends_with_examples() {
    let top = stdout(&Vg::bare().args(["--help"]).code(0));
    let commands: Vec<String> = top
        .split_once("Commands:\n")
        .unwrap()
        .1
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|c| c != "help")
        .collect();
    assert!(commands.len() >= 14, "{commands:?}");
    for command in commands {
        let help = stdout(&Vg::bare().args([command.as_str(), "--help"]).code(0));
        let examples = help
            .split_once("\nExamples:\n")
            .unwrap_or_else(|| panic!("`vramguard {command} --help` has no examples"))
            .1;
        assert!(
            examples.lines().any(|l| l.contains(&format!(" {command}"))),
            "{command}: {examples}"
        );
    }
}
