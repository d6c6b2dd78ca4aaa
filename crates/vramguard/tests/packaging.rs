//! The release artifacts, installed as an admin would: the tarball's binary from an unrelated
//! folder, the .deb with dpkg (and removed again), the .rpm into a scratch root, the wheel in
//! a fresh virtualenv (with its OOM hook), the OCI image's entrypoint.
//!
//! They test what `scripts/package.sh` put in `$VRAMGUARD_DIST`, so they are `#[ignore]`d:
//! `cargo test` alone does not package, and a test that cannot run says "ignored", never "ok".
//! `scripts/test.sh` builds the packages first (`VRAMGUARD_PACKAGING=quick`, the default, or
//! `full`) and runs these with `--ignored` and `VRAMGUARD_DIST` set; run with `--ignored`
//! and without it, each fails and says how to run it.

mod common;
use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The artifacts folder. Only a run with `--ignored` gets here: without the folder that is a
/// mistake of the caller, not a reason to pass.
fn dist() -> PathBuf {
    match std::env::var_os("VRAMGUARD_DIST") {
        Some(d) => PathBuf::from(d),
        None => panic!(
            "VRAMGUARD_DIST is not set: scripts/test.sh runs scripts/package.sh and these tests \
             with it (or set it to a folder scripts/package.sh --out made)"
        ),
    }
}

/// The one artifact in `dir` whose name starts with `prefix` and ends with `suffix`.
fn artifact(dir: &Path, prefix: &str, suffix: &str) -> PathBuf {
    let found: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with(prefix) && n.ends_with(suffix)
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{prefix}*{suffix} in {}: {found:?}",
        dir.display()
    );
    found.into_iter().next().unwrap()
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Unpacks a tar archive (compressed or not) into `into`.
fn untar(archive: &Path, into: &Path) {
    run(Command::new("tar")
        .arg("-xf")
        .arg(archive)
        .arg("-C")
        .arg(into));
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A file's permission bits.
fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Every user reads the config, the man pages and the LICENSE (a 0640 config broke `status`
/// for every user but root, issue #30); `files` are under `root`.
fn assert_every_user_reads(root: &Path, files: &[&str]) {
    for f in files {
        assert_eq!(mode(&root.join(f)), 0o644, "{f}: {:o}", mode(&root.join(f)));
    }
}

/// The LICENSE at `path` is the project's.
fn assert_is_the_license(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        text.contains("Apache License"),
        "{}: {text}",
        path.display()
    );
}

/// The highest `GLIBC_x.y` symbol version an ELF file needs.
fn highest_glibc(binary: &Path) -> (u32, u32) {
    let out = run(Command::new("objdump").arg("-T").arg(binary));
    text(&out)
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut parts = v.split('.');
            Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
        })
        .max()
        .expect("no GLIBC_ symbol versions")
}

/// `binary --version` names this version.
fn assert_is_this_version(binary: &Path) {
    let out = run(Command::new(binary).arg("--version"));
    assert!(
        text(&out).starts_with(&format!("vramguard {VERSION}\n")),
        "{}",
        text(&out)
    );
}

/// The demo ran to its end: it found the incident and cleaned up.
fn assert_demo_ran(out: &Output) {
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{all}");
    assert!(all.contains("of ghost memory found"), "{all}");
}

#[test]
#[ignore = "needs the packages: scripts/test.sh builds them and runs it with VRAMGUARD_DIST"]
fn the_tarballs_binary_runs_on_glibc_2_17_and_runs_the_demo_from_an_unrelated_folder() {
    let dist = dist();
    let tarball = artifact(
        &dist,
        &format!("vramguard-{VERSION}-x86_64-linux-gnu"),
        ".tar.gz",
    );
    let unpacked = tempfile::tempdir().unwrap();
    untar(&tarball, unpacked.path());
    let root = unpacked
        .path()
        .join(format!("vramguard-{VERSION}-x86_64-linux-gnu"));
    for file in [
        "vramguard",
        "README.md",
        "LICENSE",
        "json-schema.md",
        "config.toml.example",
        "man/vramguard.1",
        "man/vramguard-reclaim.1",
        "completions/vramguard.bash",
        "completions/_vramguard",
        "completions/vramguard.fish",
        "systemd/vramguard-agent.service",
    ] {
        assert!(
            root.join(file).is_file(),
            "{file} is not in {}",
            tarball.display()
        );
    }
    assert_every_user_reads(
        &root,
        &[
            "LICENSE",
            "README.md",
            "config.toml.example",
            "man/vramguard.1",
            "man/vramguard-reclaim.1",
        ],
    );
    assert_is_the_license(&root.join("LICENSE"));
    let binary = root.join("vramguard");
    assert!(
        highest_glibc(&binary) <= (2, 17),
        "{:?}",
        highest_glibc(&binary)
    );
    // Stripped: no symbol table left.
    let syms = Command::new("objdump")
        .arg("-t")
        .arg(&binary)
        .output()
        .unwrap();
    assert!(text(&syms).contains("no symbols"), "{}", text(&syms));
    let elsewhere = tempfile::tempdir().unwrap();
    let out = Command::new(&binary)
        .arg("demo")
        .current_dir(elsewhere.path())
        .env_remove("VRAMGUARD_SIM")
        .env_remove("VRAMGUARD_NVML_LIB")
        .env_remove("VRAMGUARD_CONFIG")
        .output()
        .unwrap();
    assert_demo_ran(&out);
    assert_is_this_version(&binary);
}

/// Whether dpkg knows a package named vramguard (installed or with config files left).
fn dpkg_knows_vramguard() -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", "vramguard"])
        .output()
        .is_ok_and(|o| o.status.success() && !text(&o).contains("not-installed"))
}

#[test]
#[ignore = "needs the packages: scripts/test.sh builds them and runs it with VRAMGUARD_DIST"]
fn the_deb_installs_runs_verifies_and_is_removed_cleanly() {
    let dist = dist();
    // scripts/test.sh leaves this test out (and says so) on a machine with vramguard
    // installed: run here, it would replace and then purge the admin's package.
    assert!(
        !dpkg_knows_vramguard() && !Path::new("/usr/bin/vramguard").exists(),
        "a vramguard package or /usr/bin/vramguard is already on this machine: this test \
         installs and purges its own and would replace it; run it on a machine without one"
    );
    let deb = artifact(&dist, &format!("vramguard_{VERSION}-"), "_amd64.deb");
    let fields = text(&run(Command::new("dpkg-deb")
        .args(["-f"])
        .arg(&deb)
        .args(["Depends", "Version"])));
    assert!(fields.contains("libc6 (>= 2.17)"), "{fields}");

    // The package keeps the audit log directory on purge; the test removes it again if it
    // made it (and it is still empty).
    let log_dir_was_there = Path::new("/var/log/vramguard").exists();
    run(Command::new("dpkg").arg("-i").arg(&deb));
    // Removed whatever happens below.
    struct Purge {
        remove_log_dir: bool,
    }
    impl Drop for Purge {
        fn drop(&mut self) {
            let _ = Command::new("dpkg").args(["-P", "vramguard"]).output();
            if self.remove_log_dir {
                let _ = std::fs::remove_dir("/var/log/vramguard");
            }
        }
    }
    let _purge = Purge {
        remove_log_dir: !log_dir_was_there,
    };

    let unit = Path::new("/usr/lib/systemd/system/vramguard-agent.service");
    let unit_text = std::fs::read_to_string(unit).unwrap();
    assert!(
        unit_text.contains("ExecStart=/usr/bin/vramguard agent"),
        "{unit_text}"
    );
    run(Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(unit));
    // Installed, not enabled.
    assert!(
        !Path::new("/etc/systemd/system/multi-user.target.wants/vramguard-agent.service").exists()
    );
    let conffiles = text(&run(Command::new("dpkg-query").args([
        "-W",
        "-f=${Conffiles}",
        "vramguard",
    ])));
    assert!(
        conffiles.contains("/etc/vramguard/config.toml"),
        "{conffiles}"
    );
    assert_eq!(mode(Path::new("/var/log/vramguard")), 0o750);
    assert_every_user_reads(
        Path::new("/"),
        &[
            "etc/vramguard/config.toml",
            "usr/share/man/man1/vramguard.1.gz",
            "usr/share/man/man1/vramguard-reclaim.1.gz",
            "usr/share/doc/vramguard/copyright",
        ],
    );
    // Debian's place for the licence: the copyright file, which holds its text.
    assert_is_the_license(Path::new("/usr/share/doc/vramguard/copyright"));
    for f in [
        "/usr/share/man/man1/vramguard.1.gz",
        "/usr/share/man/man1/vramguard-reclaim.1.gz",
        "/usr/share/bash-completion/completions/vramguard",
        "/usr/share/zsh/vendor-completions/_vramguard",
        "/usr/share/fish/vendor_completions.d/vramguard.fish",
    ] {
        assert!(Path::new(f).is_file(), "{f}");
    }
    assert!(Path::new("/usr/share/doc/vramguard/json-schema.md").is_file());
    // Every user reads the installed config: as uid 65534 the settings come from it, and
    // `status` fails only for want of a driver here, never on the config.
    let as_nobody = |args: &[&str]| {
        Command::new("setpriv")
            .args([
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                "--",
            ])
            .arg("/usr/bin/vramguard")
            .args(args)
            .current_dir("/")
            .env_remove("VRAMGUARD_SIM")
            .env_remove("VRAMGUARD_NVML_LIB")
            .env_remove("VRAMGUARD_CONFIG")
            .output()
            .unwrap()
    };
    let shown = as_nobody(&["config", "show"]);
    assert!(
        shown.status.success() && text(&shown).contains("/etc/vramguard/config.toml"),
        "{}",
        text(&shown)
    );
    let status = as_nobody(&["status"]);
    let said = format!(
        "{}{}",
        text(&status),
        String::from_utf8_lossy(&status.stderr)
    );
    assert!(
        !said.contains("cannot be read") && !said.contains("Permission denied"),
        "{said}"
    );
    let elsewhere = tempfile::tempdir().unwrap();
    let out = Command::new("/usr/bin/vramguard")
        .arg("demo")
        .current_dir(elsewhere.path())
        .env_remove("VRAMGUARD_SIM")
        .env_remove("VRAMGUARD_NVML_LIB")
        .env_remove("VRAMGUARD_CONFIG")
        .output()
        .unwrap();
    assert_demo_ran(&out);

    run(Command::new("dpkg").args(["-r", "vramguard"]));
    for gone in ["/usr/bin/vramguard", unit.to_str().unwrap()] {
        assert!(!Path::new(gone).exists(), "{gone} is left after dpkg -r");
    }
    // The edited config stays until purge, as for every conffile; the audit log stays.
    assert!(Path::new("/etc/vramguard/config.toml").exists());
    run(Command::new("dpkg").args(["-P", "vramguard"]));
    assert!(!Path::new("/etc/vramguard/config.toml").exists());
    assert!(!dpkg_knows_vramguard());
}

#[test]
#[ignore = "needs the packages: scripts/test.sh builds them and runs it with VRAMGUARD_DIST"]
fn the_rpm_installs_into_a_root_with_every_file_and_needs_glibc_2_17_at_most() {
    let dist = dist();
    let rpm = artifact(&dist, &format!("vramguard-{VERSION}-"), ".x86_64.rpm");
    let requires = text(&run(Command::new("rpm")
        .args(["-qp", "--requires"])
        .arg(&rpm)));
    let highest = requires
        .lines()
        .filter_map(|l| l.split("(GLIBC_").nth(1))
        .filter_map(|v| {
            let v = v.split(')').next()?;
            let mut p = v.split('.');
            Some((
                p.next()?.parse::<u32>().ok()?,
                p.next()?.parse::<u32>().ok()?,
            ))
        })
        .max()
        .expect("the rpm names its glibc symbol versions");
    assert!(highest <= (2, 17), "{highest:?}\n{requires}");
    // rpm reads a zstd payload from 4.14 on; RHEL/CentOS 7 has 4.11 (gzip, xz).
    assert!(!requires.contains("PayloadIsZstd"), "{requires}");
    let compressor = text(&run(Command::new("rpm")
        .args(["-qp", "--qf", "%{PAYLOADCOMPRESSOR}"])
        .arg(&rpm)));
    assert_eq!(compressor, "xz");
    let config = text(&run(Command::new("rpm")
        .args(["-qp", "--configfiles"])
        .arg(&rpm)));
    assert_eq!(config.trim(), "/etc/vramguard/config.toml");
    let root = tempfile::tempdir().unwrap();
    let dbpath = root.path().join("rpmdb");
    // Into a scratch root, without the scriptlets (the root has no shell); nothing of this
    // machine's own package database is touched.
    run(Command::new("rpm")
        .arg("--root")
        .arg(root.path())
        .arg("--dbpath")
        .arg(&dbpath)
        .args(["-i", "--nodeps", "--noscripts"])
        .arg(&rpm));
    for f in [
        "usr/bin/vramguard",
        "usr/lib/systemd/system/vramguard-agent.service",
        "usr/lib/tmpfiles.d/vramguard.conf",
        "etc/vramguard/config.toml",
        "usr/share/man/man1/vramguard.1",
        "usr/share/bash-completion/completions/vramguard",
    ] {
        assert!(root.path().join(f).is_file(), "{f}");
    }
    assert_every_user_reads(
        root.path(),
        &[
            "etc/vramguard/config.toml",
            "usr/share/man/man1/vramguard.1",
            "usr/share/licenses/vramguard/LICENSE",
        ],
    );
    assert_is_the_license(&root.path().join("usr/share/licenses/vramguard/LICENSE"));
    let tmpfiles =
        std::fs::read_to_string(root.path().join("usr/lib/tmpfiles.d/vramguard.conf")).unwrap();
    assert!(
        tmpfiles.contains("d /var/log/vramguard 0750 root root"),
        "{tmpfiles}"
    );
    assert_is_this_version(&root.path().join("usr/bin/vramguard"));
}

#[test]
#[ignore = "needs the packages: scripts/test.sh builds them and runs it with VRAMGUARD_DIST"]
fn the_wheel_puts_the_binary_on_path_and_explains_a_cuda_oom() {
    let dist = dist();
    let wheel = artifact(
        &dist,
        &format!("vramguard-{VERSION}-py3-none-manylinux"),
        ".whl",
    );
    // The LICENSE in its dist-info (`licenses/LICENSE` or `LICENSE`, as the maturin
    // version writes it).
    let listing = text(&run(Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile; print('\\n'.join(zipfile.ZipFile(sys.argv[1]).namelist()))",
        ])
        .arg(&wheel)));
    let dist_info = format!("vramguard-{VERSION}.dist-info/");
    assert!(
        listing
            .lines()
            .any(|l| l.starts_with(&dist_info) && l.ends_with("LICENSE")),
        "no LICENSE in {}:\n{listing}",
        wheel.display()
    );
    // The module's guard() lives in a file of its own.
    assert!(
        listing.lines().any(|l| l == "vramguard/_guard.py"),
        "no vramguard/_guard.py in {}:\n{listing}",
        wheel.display()
    );
    let venv = tempfile::tempdir().unwrap();
    run(Command::new("python3")
        .arg("-m")
        .arg("venv")
        .arg(venv.path()));
    let bin = venv.path().join("bin");
    run(Command::new(bin.join("pip"))
        .args(["install", "-q", "--no-index", "--no-deps"])
        .arg(&wheel));
    assert_is_this_version(&bin.join("vramguard"));

    // Every user may use the installed module: as uid 65534 it imports and asks the binary,
    // which fails here only for want of a driver (never on a file it may not read).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(venv.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let as_nobody = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups", "--"])
        .arg(bin.join("python"))
        .args([
            "-c",
            "import vramguard\ntry:\n    vramguard.status()\nexcept Exception as e:\n    print(type(e).__name__, e)",
        ])
        .current_dir("/")
        .env_remove("VRAMGUARD_SIM")
        .env_remove("VRAMGUARD_NVML_LIB")
        .env_remove("VRAMGUARD_CONFIG")
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        text(&as_nobody),
        String::from_utf8_lossy(&as_nobody.stderr)
    );
    assert!(as_nobody.status.success(), "{said}");
    assert!(
        said.contains("NVIDIA driver")
            && !said.contains("Permission denied")
            && !said.contains("cannot be read"),
        "{said}"
    );

    // A crashed trainer's worker holds 1 GiB on GPU 0; a training script then runs out of
    // memory on that GPU. torch is a stand-in module with the real exception's name.
    let world = World::new(2);
    let trainer = crashed_trainer(&world);
    let worker = trainer.workers[0];
    // Another user's server on GPU 1 whose command name is a terminal escape (OSC 52 writes
    // the clipboard): the explanation names it, escaped.
    let mut server = spec(
        &world,
        json!([{ "gpu": 1, "bytes": 2 * GIB, "sm_util": 50 }]),
    );
    server["new_session"] = json!(true);
    server["comm"] = json!("\u{1b}]52;c;QQ==\u{7}");
    let server = start(&world, &["python3", "serve.py"], server);
    let fake = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(fake.path().join("torch/cuda")).unwrap();
    std::fs::write(
        fake.path().join("torch/__init__.py"),
        "from . import cuda\n",
    )
    .unwrap();
    std::fs::write(
        fake.path().join("torch/cuda/__init__.py"),
        "class OutOfMemoryError(RuntimeError):\n    pass\n",
    )
    .unwrap();
    let script = fake.path().join("train.py");
    std::fs::write(
        &script,
        r#"import json, sys, torch, vramguard
report = vramguard.status(sample=0)
assert [g["index"] for g in report["gpus"]] == [0, 1], report["gpus"]
print("status:", json.dumps(sorted(h["pid"] for h in report["gpus"][0]["holders"])))
checks = vramguard.diagnose(gpus=0, sample=0)
assert checks["verdict"]["clean"] is False and checks["report"]["gpus"][0]["index"] == 0, checks
assert callable(vramguard.guard) and callable(vramguard.Guard), "no guard() in the wheel"
vramguard.explain_oom()
vramguard.explain_oom()  # a second call changes nothing
raise torch.cuda.OutOfMemoryError(
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
    "140.40 GiB of which 1.00 GiB is free.")
"#,
    )
    .unwrap();
    let out = Command::new(bin.join("python"))
        .arg(&script)
        .env("PYTHONPATH", fake.path())
        .env("VRAMGUARD_SIM", world.state_path())
        .env_remove("VRAMGUARD_NVML_LIB")
        .env_remove("VRAMGUARD_CONFIG")
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("VRAMGUARD_BINARY")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        text(&out),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains(&worker.to_string()), "{stdout}");
    // The traceback first, then one explanation (the hook is installed once).
    let traceback = stderr.find("torch.cuda.OutOfMemoryError").expect(&stderr);
    let explained = stderr
        .find(&format!(
            "vramguard: 1.0 GiB on GPU 0 is held by 1 orphan of job pgid:{}",
            trainer.pid
        ))
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(traceback < explained, "{stderr}");
    assert_eq!(stderr.matches("vramguard: ").count(), 1, "{stderr}");
    assert!(stderr.contains(": vramguard reclaim --gpu 0"), "{stderr}");

    // CUDA_VISIBLE_DEVICES names GPU 1 (by index, or by UUID as `nvidia-smi -L` prints it):
    // the process's "GPU 0" is GPU 1, which holds nothing dead.
    let uuid = Vg::new(&world, Path_::InProcess)
        .args(["status", "--json"])
        .json(0)["gpus"][1]["uuid"]
        .as_str()
        .unwrap()
        .to_string();
    for visible in ["1", uuid.as_str()] {
        let out = Command::new(bin.join("python"))
            .arg(&script)
            .env("PYTHONPATH", fake.path())
            .env("VRAMGUARD_SIM", world.state_path())
            .env("CUDA_VISIBLE_DEVICES", visible)
            .env_remove("VRAMGUARD_NVML_LIB")
            .env_remove("VRAMGUARD_CONFIG")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("vramguard: GPU 1 has ")
                && stderr.contains("nothing of it can be reclaimed"),
            "CUDA_VISIBLE_DEVICES={visible}: {stderr}"
        );
        assert!(
            stderr.contains(&format!(
                "by pid {} (\\e]52;c;QQ==\\x07, active)",
                server.pid
            )),
            "{stderr}"
        );
        assert!(
            !stderr.contains('\u{1b}') && !stderr.contains('\u{7}'),
            "{stderr:?}"
        );
    }
}

#[test]
#[ignore = "needs the packages: scripts/test.sh builds them and runs it with VRAMGUARD_DIST"]
fn the_image_is_tagged_as_the_daemonset_says_and_its_entrypoint_runs_the_demo() {
    let dist = dist();
    let image = dist.join(format!("vramguard-{VERSION}-oci.tar"));
    let layout = tempfile::tempdir().unwrap();
    untar(&image, layout.path());
    let json = |p: PathBuf| -> serde_json::Value {
        serde_json::from_slice(
            &std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        )
        .unwrap()
    };
    let blob = |digest: &str| {
        layout
            .path()
            .join("blobs/sha256")
            .join(digest.strip_prefix("sha256:").unwrap())
    };
    let index = json(layout.path().join("index.json"));
    let entry = &index["manifests"][0];
    let tag = entry["annotations"]["org.opencontainers.image.ref.name"]
        .as_str()
        .unwrap();
    assert_eq!(tag, format!("vramguard:{VERSION}"));
    let daemonset = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes/daemonset.yaml"),
    )
    .unwrap();
    assert!(
        daemonset.contains(&format!("image: {tag}\n")),
        "the DaemonSet does not name the image scripts/package.sh builds ({tag})"
    );
    let manifest = json(blob(entry["digest"].as_str().unwrap()));
    let config = json(blob(manifest["config"]["digest"].as_str().unwrap()));
    let entrypoint: Vec<String> =
        serde_json::from_value(config["config"]["Entrypoint"].clone()).unwrap();
    assert_eq!(entrypoint, ["/usr/bin/vramguard"]);

    // Unpack the layers into a root and run the entrypoint there, in a PID and mount
    // namespace of its own with a fresh /proc, as a container runtime would.
    let root = tempfile::tempdir().unwrap();
    for layer in manifest["layers"].as_array().unwrap() {
        untar(&blob(layer["digest"].as_str().unwrap()), root.path());
    }
    assert_every_user_reads(
        root.path(),
        &[
            "etc/vramguard/config.toml",
            "usr/share/doc/vramguard/LICENSE",
        ],
    );
    assert_is_the_license(&root.path().join("usr/share/doc/vramguard/LICENSE"));
    // Namespaces of its own, a fresh /proc and a /dev with the usual nodes, as a container
    // runtime gives.
    let dev = root.path().join("dev");
    let script = format!(
        "set -e; mount -t tmpfs -o mode=755 dev {dev}; \
         for n in null:3 zero:5 urandom:9; do mknod -m 666 {dev}/${{n%:*}} c 1 ${{n#*:}}; done; \
         mkdir {dev}/shm; mount -t tmpfs -o mode=1777 shm {dev}/shm; \
         exec chroot {root} /usr/bin/vramguard demo",
        dev = dev.display(),
        root = root.path().display()
    );
    assert_eq!(entrypoint[0], "/usr/bin/vramguard");
    let out = Command::new("unshare")
        .args(["--mount", "--pid", "--fork"])
        .arg(format!(
            "--mount-proc={}",
            root.path().join("proc").display()
        ))
        .args(["sh", "-c", &script])
        .env_clear()
        .env("PATH", "/usr/bin:/sbin:/bin:/usr/sbin")
        .output()
        .unwrap();
    assert_demo_ran(&out);
    // The NVIDIA container toolkit mounts the driver's libnvidia-ml.so.1 into the image and
    // runs the image's ldconfig, so that the binary's dlopen finds it by name.
    let libdir = root.path().join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&libdir).unwrap();
    std::fs::copy(sim_nvml_lib(), libdir.join("libnvidia-ml.so.1")).unwrap();
    let chroot = |args: &[&str]| {
        run(Command::new("chroot")
            .arg(root.path())
            .args(args)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"))
    };
    chroot(&["/sbin/ldconfig"]);
    let cache = text(&chroot(&["/sbin/ldconfig", "-p"]));
    assert!(
        cache.contains(
            "libnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
        ),
        "{cache}"
    );
}
