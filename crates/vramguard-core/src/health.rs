//! What a GPU's memory health means for its admin: row remapping, page retirement, Xids.
//!
//! A pending row remap or page retirement only takes effect at the next GPU reset, and the
//! reset is refused while any process holds the device: it is one more reason a node needs a
//! drain-and-reset, and it belongs in the same list as ghost memory.

use crate::snapshot::GpuHealth;
use serde::{Deserialize, Serialize};

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Severity {
    /// Worth a look; the GPU works.
    Warn,
    /// The GPU needs a reset or service.
    Fail,
}

/// What a finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// Row remapping: a state that lasts until a reset (pending) or service (failure).
    RowRemap,
    /// Page retirement: pending until a reset.
    PageRetirement,
    /// Xid events: counts since the reader started.
    Xid,
}

/// One finding about a GPU's memory health.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthFinding {
    /// What it is about.
    pub kind: FindingKind,
    /// How bad.
    pub severity: Severity,
    /// One line: what, and what to do.
    pub message: String,
    /// The command that shows more or fixes it.
    pub command: String,
}

/// What a critical Xid means, for the ones a GPU admin meets most.
pub fn xid_meaning(xid: u64) -> Option<&'static str> {
    Some(match xid {
        13 => "graphics engine exception (usually the application)",
        31 => "GPU memory page fault (usually the application)",
        43 => "GPU stopped processing (usually the application)",
        45 => "preemptive cleanup after an earlier error or a killed process",
        48 => "double-bit ECC error",
        61 | 62 => "internal micro-controller error",
        63 => "ECC page retirement or row remap recorded",
        64 => "ECC page retirement or row remap failed",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error (only the affected application was stopped)",
        95 => "uncontained ECC error (every application on the GPU was stopped)",
        119 | 120 => "GSP firmware error",
        _ => return None,
    })
}

/// Xids after which the GPU itself needs a reset, a reboot or service.
fn xid_needs_action(xid: u64) -> bool {
    matches!(xid, 48 | 64 | 74 | 79 | 95 | 119 | 120)
}

/// The findings for one GPU, worst first; empty when all is well.
pub fn findings(gpu: u32, health: &GpuHealth) -> Vec<HealthFinding> {
    let mut out = Vec::new();
    let reset = format!("nvidia-smi --gpu-reset -i {gpu}");
    if let Some(rows) = health.remapped_rows {
        if rows.failure {
            out.push(HealthFinding {
                kind: FindingKind::RowRemap,
                severity: Severity::Fail,
                message: "row remapping failed: the GPU needs service; drain the node".into(),
                command: format!("nvidia-smi -q -d ROW_REMAPPER -i {gpu}"),
            });
        }
        if rows.pending {
            out.push(HealthFinding {
                kind: FindingKind::RowRemap,
                severity: Severity::Warn,
                message: format!(
                    "row remap pending ({} correctable, {} uncorrectable so far): a GPU reset, \
                     once no process uses it, applies it",
                    rows.correctable, rows.uncorrectable
                ),
                command: reset.clone(),
            });
        }
    }
    if let Some(pages) = health.retired_pages
        && pages.pending
    {
        out.push(HealthFinding {
            kind: FindingKind::PageRetirement,
            severity: Severity::Warn,
            message: format!(
                "page retirement pending ({} single-bit, {} double-bit so far): a GPU reset, \
                 once no process uses it, applies it",
                pages.single_bit_ecc, pages.double_bit_ecc
            ),
            command: reset.clone(),
        });
    }
    for x in &health.xid_events {
        let meaning = xid_meaning(x.xid).unwrap_or("see NVIDIA's Xid catalogue");
        out.push(HealthFinding {
            kind: FindingKind::Xid,
            severity: if xid_needs_action(x.xid) {
                Severity::Fail
            } else {
                Severity::Warn
            },
            message: format!("Xid {} ({meaning}) reported {} time(s)", x.xid, x.count),
            command: "dmesg | grep -i xid".into(),
        });
    }
    out.sort_by_key(|f| std::cmp::Reverse(f.severity));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::{RemappedRows, RetiredPages, XidCount};

    #[test]
    fn a_healthy_gpu_has_no_findings() {
        let h = GpuHealth {
            remapped_rows: Some(RemappedRows {
                correctable: 2,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(
            findings(0, &h).is_empty(),
            "remapped and applied rows are fine"
        );
        assert!(findings(0, &GpuHealth::default()).is_empty());
    }

    #[test]
    fn pending_work_asks_for_a_reset_and_failures_come_first() {
        let h = GpuHealth {
            remapped_rows: Some(RemappedRows {
                correctable: 1,
                uncorrectable: 1,
                pending: true,
                failure: false,
            }),
            retired_pages: Some(RetiredPages {
                single_bit_ecc: 0,
                double_bit_ecc: 1,
                pending: true,
            }),
            xid_events: vec![
                XidCount { xid: 45, count: 3 },
                XidCount { xid: 79, count: 1 },
            ],
        };
        let f = findings(3, &h);
        assert_eq!(f.len(), 4);
        assert_eq!(f[0].severity, Severity::Fail);
        assert!(
            f[0].message
                .starts_with("Xid 79 (GPU has fallen off the bus)"),
            "{f:?}"
        );
        assert_eq!(f[1].command, "nvidia-smi --gpu-reset -i 3", "{f:?}");
        assert!(
            f.iter()
                .any(|x| x.message.starts_with("page retirement pending"))
        );
        assert!(
            f.iter()
                .any(|x| x.message.starts_with("Xid 45") && x.severity == Severity::Warn)
        );
    }

    #[test]
    fn a_failed_remap_needs_service() {
        let h = GpuHealth {
            remapped_rows: Some(RemappedRows {
                failure: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        let f = findings(0, &h);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].severity, Severity::Fail);
        assert!(f[0].message.contains("service"));
    }
}
