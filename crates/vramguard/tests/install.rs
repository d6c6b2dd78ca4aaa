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
fn man_pages_are_written_for_the_program_and_each_command_readable_by_every_user() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    Vg::bare().arg_path("man", dir.path()).code(2);
    let out = Vg::bare().args(["man", "--dir"]).args([dir.path()]).code(0);
    assert_eq!(
        stdout(&out),
        format!(
            "wrote 17 man pages to {} (man vramguard)\n",
            dir.path().display()
        )
    );
    for page in [
        "vramguard.1",
        "vramguard-reclaim.1",
        "vramguard-agent.1",
        "vramguard-status.1",
        "vramguard-config.1",
    ] {
        let text = std::fs::read_to_string(dir.path().join(page)).unwrap();
        assert!(text.contains(".TH"), "{page}");
        let mode = std::fs::metadata(dir.path().join(page))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o644, "{page}: {mode:o}");
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

const GLOBAL_OPTIONS: [&str; 6] = [
    "--sim",
    "--nvml-lib",
    "--proc-root",
    "--dev-dir",
    "--config",
    "--replay",
];

/// Lines of `text` that define `option`, not prose that names it.
fn defines(text: &str, option: &str) -> bool {
    text.lines()
        .any(|l| l.trim_start().starts_with(&format!("{option} ")))
}

#[test]
fn global_options_are_explained_once_in_the_programs_help() {
    let help = stdout(&Vg::bare().args(["--help"]).code(0));
    let (own, global) = help
        .split_once("\nGlobal options (before or after any command):\n")
        .unwrap_or_else(|| panic!("no Global options section\n{help}"));
    for option in GLOBAL_OPTIONS {
        assert!(!defines(own, option), "{option} among the program's own");
        assert!(defines(global, option), "{option} missing:\n{global}");
    }
    // Every command names them in one line instead of repeating their definitions; they
    // are still accepted after the command.
    for command in ["status", "reclaim", "top", "agent", "demo", "probe"] {
        let help = stdout(&Vg::bare().args([command, "--help"]).code(0));
        for option in GLOBAL_OPTIONS {
            assert!(!defines(&help, option), "{command}: {option} defined again");
        }
        let line = help
            .lines()
            .find(|l| l.starts_with("Global options: "))
            .unwrap_or_else(|| panic!("{command}: no Global options line\n{help}"));
        assert!(line.contains("--sim, --nvml-lib"), "{command}: {line}");
    }
    Vg::bare()
        .args([
            "status",
            "--config",
            "none",
            "--sim",
            "/nonexistent/state.json",
        ])
        .code(2);
}

#[test]
fn commands_are_listed_by_use_with_the_demo_first() {
    let help = stdout(&Vg::bare().args(["--help"]).code(0));
    let commands: Vec<&str> = help
        .split_once("Commands:\n")
        .unwrap()
        .1
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        commands[..7],
        [
            "demo", "status", "top", "diagnose", "reclaim", "run", "agent"
        ],
        "{help}"
    );
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

/// `vramguard man` without `--dir` writes where `man` finds pages installed by hand, and says
/// so; nothing lands in the folder it was run from. Run in a mount namespace of its own
/// with a scratch /usr/local, so that this machine's is not touched.
#[test]
fn man_without_dir_writes_to_usr_local_share_man_and_says_so() {
    let cwd = tempfile::tempdir().unwrap();
    let out = vg_wrapped("unshare")
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(
            "mount -t tmpfs vramguard-test-usr-local /usr/local && umask 077 && \"$0\" man && \
             stat -c '%a %n' /usr/local/share/man/man1/vramguard.1",
        )
        .arg(BIN)
        .current_dir(cwd.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert_eq!(
        text,
        "wrote 17 man pages to /usr/local/share/man/man1 (man vramguard)\n\
         644 /usr/local/share/man/man1/vramguard.1\n"
    );
    assert_eq!(std::fs::read_dir(cwd.path()).unwrap().count(), 0);
}

/// The packages' /etc/vramguard/config.toml that a user may not read (mode 0640, as the
/// packages once shipped it) does not stop `status`: the defaults, and one note naming the
/// file. A file named with `--config` that cannot be read still fails (exit 2). As uid
/// 65534, in a mount namespace whose /etc is a scratch tmpfs holding the planted file.
#[test]
fn a_default_config_the_user_may_not_read_gives_the_defaults_and_a_note_but_a_named_one_fails() {
    let snapshot = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(
        "../../tests/incidents/a_container_sharing_the_host_pid_namespace_is_taken_as_alive.json",
    );
    // Where uid 65534 can read it.
    let shared = tempfile::tempdir().unwrap();
    world_readable(shared.path(), 0o755);
    let snap = shared.path().join("snapshot.json");
    std::fs::copy(&snapshot, &snap).unwrap();
    world_readable(&snap, 0o644);
    let script = "snapshot=$1 && shift && mount -t tmpfs vramguard-test-etc /etc && mkdir -m 755 /etc/vramguard \
                  && printf 'garbage = [' > /etc/vramguard/config.toml \
                  && chmod 640 /etc/vramguard/config.toml \
                  && exec setpriv --reuid=65534 --regid=65534 --clear-groups \
                     env -u VRAMGUARD_CONFIG \"$0\" --replay \"$snapshot\" \"$@\"";
    let run = |args: &[&str]| {
        vg_wrapped("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                script,
            ])
            .arg(BIN)
            .arg(&snap)
            .args(args)
            .env("NO_COLOR", "1")
            .output()
            .unwrap()
    };
    // The default: read by nobody but root and its group, and broken besides (read, it
    // would fail): the defaults, and the note says why.
    let out = run(&["status"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(
        err,
        "vramguard: note: config /etc/vramguard/config.toml: cannot be read: Permission denied \
         (os error 13); running on the defaults (--config FILE names another file)\n"
    );
    assert!(stdout(&out).contains("GPU 0"), "{}", stdout(&out));
    // The same file named: an error.
    let out = run(&["--config", "/etc/vramguard/config.toml", "status"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("config /etc/vramguard/config.toml: cannot be read: Permission denied"),
        "{err}"
    );
}

fn world_readable(path: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// What the packages' scripts ask systemctl on `event` (a `sh` command line given the
/// script's arguments), run in a mount namespace of their own: /run and /var/log are scratch
/// tmpfs (so the script sees systemd and this machine's are untouched) and `systemctl` is a
/// stand-in that writes down its arguments.
fn systemctl_calls(script: &str, args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let log = dir.path().join("systemctl.log");
    let fake = bin.join("systemctl");
    std::fs::write(
        &fake,
        format!("#!/bin/sh\necho \"$*\" >> {}\n", log.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs vramguard-test-run /run && mkdir -p /run/systemd/system && \
             mount -t tmpfs vramguard-test-varlog /var/log && \
             PATH={}:$PATH sh -c \"$0\" \"$@\"",
            bin.display()
        ))
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "{script}: {}", stderr(&out));
    std::fs::read_to_string(&log).unwrap_or_default()
}

/// An upgrade restarts an agent that was running (`try-restart`: a stopped one stays
/// stopped); a first install only tells systemd about the unit.
#[test]
fn upgrading_the_packages_restarts_a_running_agent_and_installing_does_not() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let postinst = std::fs::read_to_string(root.join("packaging/debian/postinst")).unwrap();
    let upgrade = systemctl_calls(&postinst, &["postinst", "configure", "0.1.0-1"]);
    assert!(
        upgrade.contains("try-restart vramguard-agent.service"),
        "{upgrade}"
    );
    let install = systemctl_calls(&postinst, &["postinst", "configure", ""]);
    assert!(install.contains("daemon-reload"), "{install}");
    assert!(!install.contains("restart"), "{install}");
    // The .rpm: the old package's %postun, $1 = 1 on an upgrade and 0 on an erase.
    let manifest = std::fs::read_to_string(root.join("crates/vramguard/Cargo.toml")).unwrap();
    let line = manifest
        .lines()
        .find(|l| l.starts_with("post_uninstall_script = "))
        .expect("the rpm's %postun");
    let postun: String = toml::from_str::<toml::Table>(line).unwrap()["post_uninstall_script"]
        .as_str()
        .unwrap()
        .to_string();
    let upgrade = systemctl_calls(&postun, &["postun", "1"]);
    assert!(
        upgrade.contains("try-restart vramguard-agent.service"),
        "{upgrade}"
    );
    let erase = systemctl_calls(&postun, &["postun", "0"]);
    assert!(!erase.contains("restart"), "{erase}");
}
