//! Build facts for `vramguard --version`: the commit (from git when building from a checkout,
//! `VRAMGUARD_COMMIT` when a packager sets it, else "unknown"), the target and the profile.

fn main() {
    let commit = std::env::var("VRAMGUARD_COMMIT").ok().or_else(|| {
        let out = std::process::Command::new("git")
            .args(["rev-parse", "--short=12", "HEAD"])
            .output()
            .ok()?;
        let hash = String::from_utf8(out.stdout).ok()?.trim().to_string();
        (out.status.success() && !hash.is_empty()).then_some(hash)
    });
    println!(
        "cargo:rustc-env=VRAMGUARD_COMMIT={}",
        commit.unwrap_or_else(|| "unknown".into())
    );
    for var in ["TARGET", "PROFILE"] {
        println!(
            "cargo:rustc-env=VRAMGUARD_{var}={}",
            std::env::var(var).unwrap_or_default()
        );
    }
    println!("cargo:rerun-if-env-changed=VRAMGUARD_COMMIT");
    // A new commit changes the hash: watch HEAD and the ref it points to.
    let git = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.git");
    println!("cargo:rerun-if-changed={}", git.join("HEAD").display());
    if let Ok(head) = std::fs::read_to_string(git.join("HEAD"))
        && let Some(r) = head.trim().strip_prefix("ref: ")
    {
        println!("cargo:rerun-if-changed={}", git.join(r).display());
    }
}
