//! Text other users control never reaches root's terminal raw: a process whose command line
//! carries terminal escapes (OSC 52 writes the clipboard; `\r\e[2K\e[1A` rewrites the line
//! above a prompt), whose command name carries a newline, and whose argument is 100 KB long,
//! as an orphan in a reclaim plan.

mod common;
use common::*;
use serde_json::json;

const OSC52: &str = "\x1b]52;c;aGVsbG8=\x07";
const REWRITE: &str = "\r\x1b[2K\x1b[1A";

/// Bytes a terminal would act on: C0 controls other than newline, DEL, and C1 controls
/// (U+0080–U+009F, encoded C2 80–C2 9F).
fn terminal_controls(bytes: &[u8]) -> Vec<(usize, u8)> {
    let mut found = Vec::new();
    for (i, b) in bytes.iter().enumerate() {
        let c1 = *b == 0xc2 && bytes.get(i + 1).is_some_and(|n| (0x80..=0x9f).contains(n));
        if (*b < 0x20 && *b != b'\n') || *b == 0x7f || c1 {
            found.push((i, *b));
        }
    }
    found
}

#[test]
fn escapes_in_command_lines_and_names_are_shown_not_obeyed() {
    let world = World::new(1);
    let mut trainer = spec(&world, json!([hold(0, 2)]));
    trainer["group_leader"] = json!(true);
    let long = "x".repeat(100_000);
    trainer["workers"] = json!([{ "argv": [OSC52, REWRITE, long, "\u{9b}31m", "\u{202e}txt.exe"],
        "spec": { "state": world.state_path(), "lifetime_ms": 120_000, "comm": "ev\nl\x1b[31m",
                  "holds": [hold(0, 3)] } }]);
    let mut t = start(&world, &["python3", "train.py"], trainer);
    t.crash();
    let victim = t.workers[0];

    for args in [
        vec!["status"],
        vec!["diagnose"],
        vec!["reclaim", "--dry-run"],
        vec![
            "reclaim",
            "--dry-run",
            "--include",
            "orphan,hidden,detached",
        ],
    ] {
        let (out, shown) = Vg::new(&world, Path_::Nvml).args(&args).output();
        for (name, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
            let bad = terminal_controls(bytes);
            assert!(
                bad.is_empty(),
                "{shown}: {name} carries terminal controls at {:?}:\n{}",
                &bad[..bad.len().min(5)],
                String::from_utf8_lossy(bytes)
            );
            let longest = String::from_utf8_lossy(bytes)
                .lines()
                .map(|l| l.chars().count())
                .max()
                .unwrap_or(0);
            assert!(
                longest < 1000,
                "{shown}: a {longest}-character line in {name}"
            );
        }
        let text = stdout(&out);
        // diagnose names processes by their command name, the others show command lines.
        let expected = if args[0] == "diagnose" {
            "ev\\nl\\e[31m"
        } else {
            "\\e]52;c;aGVsbG8=\\a"
        };
        assert!(
            text.contains(expected),
            "{shown}: the escape is shown as text: {text}"
        );
    }
    let plan = stdout(
        &Vg::new(&world, Path_::Nvml)
            .args(["reclaim", "--dry-run"])
            .code(0),
    );
    assert!(plan.contains(&format!("pid {victim}")), "{plan}");

    // JSON keeps the exact bytes.
    let report = Vg::new(&world, Path_::Nvml)
        .args(["status", "--json"])
        .json(0);
    let h = holder(&report, 0, victim);
    assert!(h["command"].as_str().unwrap().starts_with(OSC52), "{h:#}");
    assert!(
        h["command"]
            .as_str()
            .unwrap()
            .contains(&"x".repeat(100_000))
    );
    assert_eq!(h["comm"], "ev\nl\x1b[31m");
}
