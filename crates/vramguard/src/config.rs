//! The config file (`/etc/vramguard/config.toml`). Sizes and durations are written the way
//! admins write them (`"256MiB"`, `"10m"`); unknown keys are errors with their line.

use anyhow::{Context, Result, anyhow};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use vramguard_core::Policy;
use vramguard_core::units::{parse_bytes, parse_duration};

/// The default config path, read when it exists.
pub const DEFAULT_CONFIG: &str = "/etc/vramguard/config.toml";

/// The whole file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where it was read from (for messages).
    #[serde(skip)]
    pub path: Option<PathBuf>,
    /// Classification.
    #[serde(default)]
    pub policy: PolicySection,
}

/// `[policy]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicySection {
    /// Unaccounted memory below this is noise, e.g. `"256MiB"`.
    pub tolerance: Option<String>,
    /// Ratio of total memory tolerated as unaccounted, e.g. `0.005`.
    pub tolerance_ratio: Option<f64>,
    /// A holder without GPU utilization this long is idle, e.g. `"10m"`.
    pub idle_after: Option<String>,
    /// Memory an empty GPU shows as used, by index or UUID: `{ "0" = "300MiB" }`.
    #[serde(default)]
    pub baseline: BTreeMap<String, String>,
    /// More system process names (comm) never to be killed.
    #[serde(default)]
    pub system_comms: Vec<String>,
}

impl Config {
    /// Reads `path`, or the default path when it exists, or nothing.
    pub fn load(path: Option<&Path>) -> Result<Config> {
        let path = match path {
            Some(p) => p.to_path_buf(),
            None if Path::new(DEFAULT_CONFIG).exists() => PathBuf::from(DEFAULT_CONFIG),
            None => return Ok(Config::default()),
        };
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading config {}", path.display()))?;
        Config::parse(&path, &text)
    }

    /// Parses a config document; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Config> {
        let mut config: Config = toml::from_str(text)
            .map_err(|e| anyhow!("config {}: {}", path.display(), e.to_string().trim_end()))?;
        config.path = Some(path.to_path_buf());
        config.policy()?;
        Ok(config)
    }

    fn name(&self) -> String {
        self.path
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "config".into())
    }

    /// The classification policy.
    pub fn policy(&self) -> Result<Policy> {
        let mut policy = Policy::default();
        let p = &self.policy;
        let field = |key: &str, e: vramguard_core::units::UnitError| {
            anyhow!("config {}: policy.{key}: {e}", self.name())
        };
        if let Some(t) = &p.tolerance {
            policy.tolerance_bytes = parse_bytes(t).map_err(|e| field("tolerance", e))?;
        }
        if let Some(r) = p.tolerance_ratio {
            if !(0.0..=1.0).contains(&r) {
                return Err(anyhow!(
                    "config {}: policy.tolerance_ratio: {r} is not between 0 and 1",
                    self.name()
                ));
            }
            policy.tolerance_ratio = r;
        }
        if let Some(d) = &p.idle_after {
            policy.idle_after_secs = parse_duration(d)
                .map_err(|e| field("idle_after", e))?
                .as_secs();
        }
        for (gpu, size) in &p.baseline {
            let bytes = parse_bytes(size).map_err(|e| field(&format!("baseline.{gpu}"), e))?;
            policy.baseline_bytes.insert(gpu.clone(), bytes);
        }
        policy.system_comms.extend(p.system_comms.iter().cloned());
        Ok(policy)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_policy_section() {
        let c = Config::parse(
            Path::new("c.toml"),
            "[policy]\ntolerance = \"512MiB\"\nidle_after = \"2h\"\nbaseline = { \"0\" = \"300MiB\" }\nsystem_comms = [\"my-exporter\"]\n",
        )
        .unwrap();
        let p = c.policy().unwrap();
        assert_eq!(p.tolerance_bytes, 512 << 20);
        assert_eq!(p.idle_after_secs, 7200);
        assert_eq!(p.baseline_for(0, None), 300 << 20);
        assert!(p.is_system_comm("my-exporter"));
        assert!(p.is_system_comm("nvidia-persiste"));
    }

    #[test]
    fn errors_name_the_file_the_key_and_the_line() {
        let e = Config::parse(Path::new("/etc/v.toml"), "[policy]\ntolerence = \"1GiB\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/etc/v.toml") && e.contains("tolerence") && e.contains("line 2"),
            "{e}"
        );
        let e = Config::parse(
            Path::new("v.toml"),
            "[policy]\nidle_after = \"ten minutes\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("policy.idle_after") && e.contains("ten minutes"),
            "{e}"
        );
        let e = Config::parse(Path::new("v.toml"), "[policy\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("v.toml"), "{e}");
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_config_text_never_panics(s in "(\\[policy\\]\n)?[a-z_ =\"0-9.\n\\[\\]{}]{0,120}") {
            let _ = Config::parse(Path::new("fuzz.toml"), &s);
        }
    }
}
