//! Container names from the runtimes' own state, for the job column: Docker's
//! `containers/<id>/config.v2.json` and Podman's `overlay-containers/containers.json`. Both
//! are written by root-owned daemons, but the names in them come from whoever started the
//! container: read bounded, regular files only (no symlink, no FIFO), and printed through the
//! sanitiser like every other process-supplied text. Names of Kubernetes containers come
//! from the kubelet, not from here.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use vramguard_core::snapshot::ContainerRef;

/// The most read of one Docker container's config (they are a few KiB).
const DOCKER_CONFIG_MAX: u64 = 4 << 20;
/// The most read of Podman's container list (about 1 KiB per container).
const PODMAN_LIST_MAX: u64 = 32 << 20;
/// Names longer than this are cut (Docker allows 253 characters).
const NAME_MAX: usize = 256;
/// Containers remembered; the cache starts over beyond this.
const CACHE_MAX: usize = 4096;

/// Where the runtimes keep their state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerState {
    /// Docker's data root (`/var/lib/docker`).
    pub docker: PathBuf,
    /// Podman's (rootful) storage root (`/var/lib/containers/storage`).
    pub podman: PathBuf,
}

impl Default for ContainerState {
    fn default() -> Self {
        ContainerState {
            docker: PathBuf::from("/var/lib/docker"),
            podman: PathBuf::from("/var/lib/containers/storage"),
        }
    }
}

/// Looks container names up, once per container.
#[derive(Debug, Default)]
pub struct ContainerNames {
    state: ContainerState,
    cache: HashMap<(String, String), Option<String>>,
}

impl ContainerNames {
    /// Names from the runtimes' state under `state`.
    pub fn new(state: ContainerState) -> Self {
        ContainerNames {
            state,
            cache: HashMap::new(),
        }
    }

    /// The name the runtime gave container `c`, if its state says (a container of another
    /// runtime, or state that cannot be read: none).
    pub fn name(&mut self, c: &ContainerRef) -> Option<String> {
        let key = (c.runtime.clone(), c.id.clone());
        if let Some(known) = self.cache.get(&key) {
            return known.clone();
        }
        let found = if !is_container_id(&c.id) {
            None
        } else {
            match c.runtime.as_str() {
                "docker" => docker_name(&self.state.docker, &c.id),
                "podman" | "libpod" => podman_name(&self.state.podman, &c.id),
                _ => None,
            }
        };
        if self.cache.len() >= CACHE_MAX {
            self.cache.clear();
        }
        self.cache.insert(key, found.clone());
        found
    }
}

/// 64 lowercase hex digits: the only ids used to build a path.
fn is_container_id(id: &str) -> bool {
    id.len() == 64
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// A name as the runtime wrote it, without Docker's leading `/`, cut to [`NAME_MAX`]; only
/// names Docker and Podman themselves accept (`[A-Za-z0-9][A-Za-z0-9_.-]*`): anything else
/// is not theirs, and the id is shown instead. The name also becomes a metric label.
fn clean(name: &str) -> Option<String> {
    let name = name.trim_start_matches('/');
    let valid = name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    valid.then(|| name.chars().take(NAME_MAX).collect())
}

fn docker_name(root: &Path, id: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Config {
        #[serde(rename = "Name")]
        name: Option<String>,
    }
    let path = root.join("containers").join(id).join("config.v2.json");
    let bytes = vramguard_fs::read_regular_no_link(&path, DOCKER_CONFIG_MAX).ok()?;
    let config: Config = serde_json::from_slice(&bytes).ok()?;
    clean(config.name.as_deref()?)
}

fn podman_name(root: &Path, id: &str) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Entry {
        id: String,
        #[serde(default)]
        names: Vec<String>,
    }
    let path = root.join("overlay-containers").join("containers.json");
    let bytes = vramguard_fs::read_regular_no_link(&path, PODMAN_LIST_MAX).ok()?;
    let list: Vec<Entry> = serde_json::from_slice(&bytes).ok()?;
    let entry = list.into_iter().find(|e| e.id == id)?;
    clean(entry.names.first()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn docker(id: &str) -> ContainerRef {
        ContainerRef {
            runtime: "docker".into(),
            id: id.into(),
            name: None,
        }
    }

    #[test]
    fn docker_and_podman_names_are_read_from_their_state() {
        let dir = tempfile::tempdir().unwrap();
        let id = "a".repeat(64);
        let cfg = dir.path().join("docker/containers").join(&id);
        std::fs::create_dir_all(&cfg).unwrap();
        std::fs::write(
            cfg.join("config.v2.json"),
            r#"{"ID":"x","Name":"/llama-train-7","Config":{"Env":["SECRET=1"]}}"#,
        )
        .unwrap();
        let podman = dir.path().join("podman/overlay-containers");
        std::fs::create_dir_all(&podman).unwrap();
        let pid = "b".repeat(64);
        std::fs::write(
            podman.join("containers.json"),
            format!(r#"[{{"id":"{pid}","names":["vllm-server"],"image":"x"}}]"#),
        )
        .unwrap();
        let mut names = ContainerNames::new(ContainerState {
            docker: dir.path().join("docker"),
            podman: dir.path().join("podman"),
        });
        assert_eq!(names.name(&docker(&id)).as_deref(), Some("llama-train-7"));
        let podman_ref = ContainerRef {
            runtime: "libpod".into(),
            id: pid.clone(),
            name: None,
        };
        assert_eq!(names.name(&podman_ref).as_deref(), Some("vllm-server"));
        // Unknown ids, other runtimes: no name, and no error.
        assert_eq!(names.name(&docker(&"c".repeat(64))), None);
        let cri = ContainerRef {
            runtime: "containerd".into(),
            id: id.clone(),
            name: None,
        };
        assert_eq!(names.name(&cri), None);
    }

    #[test]
    fn hostile_state_is_refused_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let id = "d".repeat(64);
        let cfg = dir.path().join("containers").join(&id);
        std::fs::create_dir_all(&cfg).unwrap();
        let mut names = ContainerNames::new(ContainerState {
            docker: dir.path().to_path_buf(),
            podman: dir.path().join("none"),
        });
        // A symlink where the config should be: not followed.
        std::fs::write(dir.path().join("elsewhere.json"), r#"{"Name":"/evil"}"#).unwrap();
        std::os::unix::fs::symlink(
            dir.path().join("elsewhere.json"),
            cfg.join("config.v2.json"),
        )
        .unwrap();
        assert_eq!(names.name(&docker(&id)), None);
        // An id that is not 64 hex digits never becomes a path.
        assert_eq!(names.name(&docker("../../etc")), None);
        // A FIFO: refused at once, no hang.
        let id2 = "e".repeat(64);
        let cfg2 = dir.path().join("containers").join(&id2);
        std::fs::create_dir_all(&cfg2).unwrap();
        rustix::fs::mknodat(
            rustix::fs::CWD,
            cfg2.join("config.v2.json"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o600),
            0,
        )
        .unwrap();
        assert_eq!(names.name(&docker(&id2)), None);
        // A name no runtime would accept (an escape sequence, a newline): no name. A huge
        // one is cut.
        let id4 = "9".repeat(64);
        let cfg4 = dir.path().join("containers").join(&id4);
        std::fs::create_dir_all(&cfg4).unwrap();
        std::fs::write(
            cfg4.join("config.v2.json"),
            r#"{"Name":"/x\u001b]52;c;ZXZpbA==\u0007\ny"}"#,
        )
        .unwrap();
        assert_eq!(names.name(&docker(&id4)), None);
        let id3 = "f".repeat(64);
        let cfg3 = dir.path().join("containers").join(&id3);
        std::fs::create_dir_all(&cfg3).unwrap();
        let long = "x".repeat(10_000);
        std::fs::write(
            cfg3.join("config.v2.json"),
            format!(r#"{{"Name":"/{long}"}}"#),
        )
        .unwrap();
        assert_eq!(names.name(&docker(&id3)).map(|n| n.len()), Some(NAME_MAX));
    }
}
