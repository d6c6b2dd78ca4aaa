//! Build facts for `vramguard --version`: the commit (from git when building from a checkout,
//! `VRAMGUARD_COMMIT` when a packager sets it, else "unknown"), the build date
//! (`SOURCE_DATE_EPOCH` when set, for reproducible packages), the target and the profile.

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
    let epoch_secs = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        });
    println!(
        "cargo:rustc-env=VRAMGUARD_BUILD_DATE={}",
        civil_date(epoch_secs / 86_400)
    );
    println!("cargo:rerun-if-env-changed=SOURCE_DATE_EPOCH");
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

/// `YYYY-MM-DD` of a day counted from 1970-01-01, by `date` (GNU or busybox); "unknown"
/// where it cannot say.
fn civil_date(days: u64) -> String {
    std::process::Command::new("date")
        .args(["-u", "-d", &format!("@{}", days * 86_400), "+%Y-%m-%d"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|d| d.trim().to_string())
        .filter(|d| d.len() == 10)
        .unwrap_or_else(|| "unknown".into())
}
