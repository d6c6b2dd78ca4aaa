//! `--gpu`: one language for every command. A GPU is named by its NVML index (`0`), its UUID
//! (`GPU-…`) or, for a MIG device, the device's UUID (`MIG-…`); a list is comma-separated.
//! Every command resolves it here, against the GPUs the node has, with one error message.

use std::collections::BTreeSet;

/// One `--gpu` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSelector {
    /// An NVML index.
    Index(u32),
    /// A GPU's or a MIG device's UUID.
    Uuid(String),
}

impl std::fmt::Display for GpuSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuSelector::Index(i) => write!(f, "{i}"),
            GpuSelector::Uuid(u) => f.write_str(u),
        }
    }
}

/// A `--gpu` that is neither an index nor a UUID.
#[derive(Debug, thiserror::Error)]
#[error("{0:?}: expected a GPU index (0), a GPU-… or a MIG-… UUID")]
pub struct BadGpu(String);

/// Parses one `--gpu` value (clap's value parser for every command's `--gpu`).
pub fn gpu_selector(s: &str) -> Result<GpuSelector, BadGpu> {
    let s = s.trim();
    if let Ok(i) = s.parse() {
        return Ok(GpuSelector::Index(i));
    }
    if (s.starts_with("GPU-") || s.starts_with("MIG-"))
        && s.len() <= 96
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/')
    {
        return Ok(GpuSelector::Uuid(s.to_string()));
    }
    Err(BadGpu(s.to_string()))
}

/// A GPU as `--gpu` may name it.
#[derive(Debug, Clone, Copy)]
pub struct NamedGpu<'a> {
    /// Its NVML index.
    pub index: u32,
    /// Its UUID, when the driver gave one.
    pub uuid: Option<&'a str>,
    /// Its MIG devices' UUIDs.
    pub mig_uuids: &'a [&'a str],
}

/// What a `--gpu` list selects: GPUs by index, and the MIG devices named by their UUIDs
/// (their GPUs are among `gpus`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// The GPUs selected, by index.
    pub gpus: BTreeSet<u32>,
    /// The MIG devices named, by UUID (empty: whole GPUs).
    pub mig_devices: BTreeSet<String>,
}

/// A `--gpu` that names nothing on this node.
#[derive(Debug, thiserror::Error)]
#[error(
    "--gpu {selector}: no such GPU or MIG device on this node ({present}; `vramguard status` lists them with their UUIDs)"
)]
pub struct NoSuchGpu {
    selector: String,
    present: String,
}

/// Resolves `selectors` against `gpus`; an empty list selects nothing (the caller's "all").
pub fn resolve(selectors: &[GpuSelector], gpus: &[NamedGpu<'_>]) -> Result<Selection, NoSuchGpu> {
    let mut sel = Selection::default();
    for s in selectors {
        let found = match s {
            GpuSelector::Index(i) => gpus.iter().find(|g| g.index == *i).map(|g| (g, false)),
            GpuSelector::Uuid(u) => gpus
                .iter()
                .find(|g| g.uuid == Some(u.as_str()))
                .map(|g| (g, false))
                .or_else(|| {
                    gpus.iter()
                        .find(|g| g.mig_uuids.contains(&u.as_str()))
                        .map(|g| (g, true))
                }),
        };
        let Some((gpu, mig)) = found else {
            return Err(NoSuchGpu {
                selector: s.to_string(),
                present: present(gpus),
            });
        };
        sel.gpus.insert(gpu.index);
        if mig {
            sel.mig_devices.insert(s.to_string());
        }
    }
    Ok(sel)
}

/// "GPUs 0 to 3", "GPU 0" or "no GPU".
fn present(gpus: &[NamedGpu<'_>]) -> String {
    let mut indices: Vec<u32> = gpus.iter().map(|g| g.index).collect();
    indices.sort_unstable();
    match indices.as_slice() {
        [] => "no GPU".into(),
        [one] => format!("GPU {one}"),
        [first, .., last] if (*last - *first) as usize + 1 == indices.len() => {
            format!("GPUs {first} to {last}")
        }
        all => format!(
            "GPUs {}",
            all.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Resolves `selectors` against a report's GPUs.
pub fn resolve_in_report(
    selectors: &[GpuSelector],
    report: &vramguard_core::Report,
) -> Result<Selection, NoSuchGpu> {
    let migs: Vec<Vec<&str>> = report
        .gpus
        .iter()
        .map(|g| {
            g.mig_devices
                .iter()
                .filter_map(|d| d.uuid.as_deref())
                .collect()
        })
        .collect();
    let named: Vec<NamedGpu<'_>> = report
        .gpus
        .iter()
        .zip(&migs)
        .map(|(g, m)| NamedGpu {
            index: g.index,
            uuid: g.uuid.as_deref(),
            mig_uuids: m,
        })
        .collect();
    resolve(selectors, &named)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node() -> Vec<NamedGpu<'static>> {
        vec![
            NamedGpu {
                index: 0,
                uuid: Some("GPU-aaaa"),
                mig_uuids: &[],
            },
            NamedGpu {
                index: 1,
                uuid: Some("GPU-bbbb"),
                mig_uuids: &["MIG-1111", "MIG-2222"],
            },
        ]
    }

    fn sel(v: &[&str]) -> Vec<GpuSelector> {
        v.iter().map(|s| gpu_selector(s).unwrap()).collect()
    }

    #[test]
    fn indices_gpu_uuids_and_mig_uuids_select_the_same_way_everywhere() {
        let s = resolve(&sel(&["0"]), &node()).unwrap();
        assert_eq!(s.gpus, [0].into());
        assert!(s.mig_devices.is_empty());
        let s = resolve(&sel(&["GPU-bbbb"]), &node()).unwrap();
        assert_eq!(s.gpus, [1].into());
        let s = resolve(&sel(&["MIG-2222", "0"]), &node()).unwrap();
        assert_eq!(s.gpus, [0, 1].into());
        assert_eq!(s.mig_devices, ["MIG-2222".to_string()].into());
        assert_eq!(resolve(&[], &node()).unwrap(), Selection::default());
    }

    #[test]
    fn a_gpu_that_is_not_there_is_one_message_whatever_names_it() {
        for missing in ["9", "GPU-cccc", "MIG-3333"] {
            let e = resolve(&sel(&[missing]), &node()).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "--gpu {missing}: no such GPU or MIG device on this node (GPUs 0 to 1; \
                     `vramguard status` lists them with their UUIDs)"
                )
            );
        }
        let e = resolve(&sel(&["0"]), &[]).unwrap_err().to_string();
        assert!(e.contains("(no GPU;"), "{e}");
    }

    #[test]
    fn a_value_that_is_neither_is_refused_when_parsed() {
        for bad in ["zero", "GPU-\u{1b}]52", "-1", "GPU-a b"] {
            assert!(gpu_selector(bad).is_err(), "{bad}");
        }
        assert_eq!(gpu_selector(" 3 ").unwrap(), GpuSelector::Index(3));
    }
}
