//! The Slurm heal loop's steps, as the agent sees them.
//!
//! `vramguard slurm heal` runs on its own (the epilog starts it in a session of its own), and
//! writes each step to the node's audit log: `heal_waiting`, `heal_reset`, `heal_resumed`,
//! `heal_failed`, `heal_timed_out`, `heal_skipped`. The agent follows that file (the one
//! `[reclaim] audit_log` names) and turns the steps into metrics and into one alert, so that a
//! node kept drained after a failed reset reaches the admin by the same sinks as a ghost.
//!
//! The file is root's, but it is read as any file is: never through a link, never a FIFO, in
//! bounded pieces, one bounded line at a time, and every string taken from it is escaped
//! before it reaches a metric label or a notification.

use crate::alerts::Notification;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use vramguard_core::sanitize::fit;
use vramguard_fs::FileError;

/// The most read from the log per poll: a burst of records is taken over several samples.
const READ_MAX: u64 = 256 * 1024;
/// How much of the log's end is read at start to know the latest heal step.
const TAIL: u64 = 64 * 1024;
/// A line longer than this is no record of ours: skipped.
const LINE_MAX: usize = 64 * 1024;

/// The rule name of the heal's alert.
pub const HEAL_RULE: &str = "slurm_heal_failed";

/// One step of a heal, from its audit record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HealStep {
    /// Waiting for the node's jobs to leave.
    Waiting,
    /// The node is idle: the GPUs are being reset.
    Reset,
    /// The GPUs are clean and the node was resumed.
    Resumed,
    /// The reset did not free the memory: the node stays drained, its reason updated.
    Failed,
    /// A job still ran when the wait ended: the node stays drained; the next job's epilog
    /// starts the heal again.
    TimedOut,
    /// Nothing to do: not drained, drained by someone else, or not up.
    Skipped,
}

impl HealStep {
    /// Every step, in the order of [`HealStep::name`]'s table.
    pub const ALL: [HealStep; 6] = [
        HealStep::Waiting,
        HealStep::Reset,
        HealStep::Resumed,
        HealStep::Failed,
        HealStep::TimedOut,
        HealStep::Skipped,
    ];

    /// The step of an audit record's `event`, if it is a heal's.
    pub fn from_event(event: &str) -> Option<HealStep> {
        HealStep::ALL
            .into_iter()
            .find(|s| event.strip_prefix("heal_") == Some(s.name()))
    }

    /// Its name: the metric label, and the audit event without `heal_`.
    pub fn name(self) -> &'static str {
        match self {
            HealStep::Waiting => "waiting",
            HealStep::Reset => "reset",
            HealStep::Resumed => "resumed",
            HealStep::Failed => "failed",
            HealStep::TimedOut => "timed_out",
            HealStep::Skipped => "skipped",
        }
    }
}

/// A heal's audit record, as far as the agent needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealRecord {
    /// The step.
    pub step: HealStep,
    /// The Slurm node, escaped.
    pub node: String,
    /// The drain reason written, or why it waited or skipped, escaped.
    pub detail: Option<String>,
    /// When, ms since the epoch.
    pub at_ms: u64,
}

/// The fields read from a record; anything else in it is ignored.
#[derive(Deserialize)]
struct RawRecord {
    event: String,
    #[serde(default)]
    ts_ms: u64,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    why: Option<String>,
}

/// Parses one line; `None` for a line that is no heal record (or no JSON at all).
fn parse_line(line: &[u8]) -> Option<HealRecord> {
    if line.len() > LINE_MAX {
        return None;
    }
    let raw: RawRecord = serde_json::from_slice(line).ok()?;
    let step = HealStep::from_event(&raw.event)?;
    let detail = match step {
        HealStep::Failed => raw.reason,
        _ => raw.why.or(raw.reason),
    };
    Some(HealRecord {
        step,
        node: fit(raw.node.as_deref().unwrap_or("?"), 64),
        detail: detail.map(|d| fit(&d, 200)),
        at_ms: raw.ts_ms,
    })
}

/// Follows a JSON-lines file that only grows, starting again from its beginning when it is
/// rotated (another inode) or truncated (smaller than what was read).
#[derive(Debug)]
pub struct AuditFollower {
    path: PathBuf,
    /// (device, inode) of the file read so far.
    file: Option<(u64, u64)>,
    /// Bytes of it consumed: every line before this offset was seen.
    offset: u64,
    /// A line longer than a whole read is being skipped up to its newline.
    skipping: bool,
    /// The file's size when the last read reached its end on a line without its newline
    /// (still being written, or torn until the log is repaired): not read again until it
    /// grows.
    torn_at: Option<u64>,
    /// Reads made (what a poll that has nothing to read must not add to).
    reads: u64,
}

impl AuditFollower {
    /// A follower of `path` that has read nothing yet.
    pub fn new(path: &Path) -> AuditFollower {
        AuditFollower {
            path: path.to_path_buf(),
            file: None,
            offset: 0,
            skipping: false,
            torn_at: None,
            reads: 0,
        }
    }

    /// Starts at the file's end; returns the latest heal record among its last [`TAIL`]
    /// bytes (what the node's heal state is now), which [`AuditFollower::poll`] will not
    /// return again. A missing file is a node no heal has run on.
    pub fn start_at_end(&mut self) -> Result<Option<HealRecord>, FileError> {
        let size = match std::fs::symlink_metadata(&self.path) {
            Ok(m) => m.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(cause) => {
                return Err(FileError::Io {
                    path: self.path.clone(),
                    cause,
                });
            }
        };
        let from = size.saturating_sub(TAIL);
        let chunk = vramguard_fs::read_regular_from_no_link(&self.path, from, TAIL)?;
        let mut bytes = &chunk.bytes[..];
        let mut skip = 0;
        if from > 0 {
            // The first line is cut: it starts before the piece read.
            skip = bytes
                .iter()
                .position(|b| *b == b'\n')
                .map_or(bytes.len(), |i| i + 1);
            bytes = &bytes[skip..];
        }
        let whole = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        let latest = bytes[..whole].rsplit(|b| *b == b'\n').find_map(parse_line);
        self.file = Some((chunk.dev, chunk.ino));
        // Up to the last whole line read, not the file's size now: records appended between
        // the size asked and the read are read by the next poll, not skipped.
        self.offset = from + (skip + whole) as u64;
        Ok(latest)
    }

    /// The heal records written since the last call (at most [`READ_MAX`] bytes of them; the
    /// rest at the next). A line still being written is left for the next call.
    pub fn poll(&mut self) -> Result<Vec<HealRecord>, FileError> {
        // A cheap look first: nothing to read when the same file has not grown.
        match std::fs::symlink_metadata(&self.path) {
            Ok(m) => {
                use std::os::unix::fs::MetadataExt;
                let same = self.file == Some((m.dev(), m.ino()));
                // Nothing new, or only the torn line already read once (until it grows).
                if same && (m.len() == self.offset || self.torn_at == Some(m.len())) {
                    return Ok(Vec::new());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(cause) => {
                return Err(FileError::Io {
                    path: self.path.clone(),
                    cause,
                });
            }
        }
        let mut chunk = vramguard_fs::read_regular_from_no_link(&self.path, self.offset, READ_MAX)?;
        if self.file != Some((chunk.dev, chunk.ino)) || chunk.size < self.offset {
            // Rotated or truncated: the new file's records are all new.
            self.file = Some((chunk.dev, chunk.ino));
            self.offset = 0;
            self.skipping = false;
            self.torn_at = None;
            chunk = vramguard_fs::read_regular_from_no_link(&self.path, 0, READ_MAX)?;
        }
        self.reads += 1;
        let reached_end = self.offset + chunk.bytes.len() as u64 >= chunk.size;
        let mut bytes = &chunk.bytes[..];
        let mut consumed = 0usize;
        if self.skipping {
            match bytes.iter().position(|b| *b == b'\n') {
                Some(i) => {
                    consumed = i + 1;
                    bytes = &bytes[i + 1..];
                    self.skipping = false;
                }
                None => {
                    self.offset += bytes.len() as u64;
                    return Ok(Vec::new());
                }
            }
        }
        let whole = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
        if whole == 0 && bytes.len() as u64 == READ_MAX {
            // A whole read without a newline: no record of ours; skip to its end.
            self.offset += (consumed + bytes.len()) as u64;
            self.skipping = true;
            return Ok(Vec::new());
        }
        let records = bytes[..whole]
            .split(|b| *b == b'\n')
            .filter_map(parse_line)
            .collect();
        self.offset += (consumed + whole) as u64;
        // A line still being written (or torn, until the log is repaired) is read again only
        // once the file has grown.
        self.torn_at = (reached_end && self.offset < chunk.size).then_some(chunk.size);
        Ok(records)
    }
}

/// The heal state the agent reports: the steps seen, the latest one, and whether a failed
/// heal's alert is firing.
#[derive(Debug)]
pub struct HealWatch {
    follower: AuditFollower,
    /// Steps seen since the agent started.
    pub counts: BTreeMap<HealStep, u64>,
    /// The latest step, including one read from the log's end at start.
    pub last: Option<HealRecord>,
    /// When the failure being alerted on started, ms since the epoch.
    failing_since: Option<u64>,
    /// The last read error, logged once until it changes or a read succeeds (a log that is
    /// a link would otherwise fill the journal at every sample).
    last_error: Option<String>,
    /// Whether the state changed since [`HealWatch::take_changed`] last asked.
    changed: bool,
    /// The start at the log's end failed (a log that was a link for a moment, EMFILE): it is
    /// tried again before anything is read, never replaced by a read from the log's first
    /// byte, which would send every past heal step again as new.
    start_owed: bool,
}

impl HealWatch {
    /// Follows `audit_log` from its end; the latest heal step already there is the state, and
    /// a failure there is an incident already firing (not notified again: it was, by the agent
    /// that ran then).
    pub fn start(audit_log: &Path) -> HealWatch {
        let mut watch = HealWatch {
            follower: AuditFollower::new(audit_log),
            counts: BTreeMap::new(),
            changed: false,
            last: None,
            failing_since: None,
            last_error: None,
            start_owed: true,
        };
        if let Err(e) = watch.start_at_end() {
            tracing::warn!(
                "following the audit log for heal steps: {e} (tried again at each sample)"
            );
            watch.last_error = Some(e.to_string());
        }
        watch
    }

    /// Takes the state from the log's end, as at start.
    fn start_at_end(&mut self) -> Result<(), FileError> {
        let last = self.follower.start_at_end()?;
        self.start_owed = false;
        self.failing_since = last
            .as_ref()
            .filter(|r| r.step == HealStep::Failed)
            .map(|r| r.at_ms);
        self.changed |= last.is_some();
        self.last = last;
        Ok(())
    }

    /// Whether the counts, the latest step or the failure changed since the last call: the
    /// metrics are redrawn only then, not at every sample.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// Whether the heal's alert is firing.
    pub fn failing(&self) -> bool {
        self.failing_since.is_some()
    }

    /// The `resolved` for a failure this watch alerted on, when its log stops being followed
    /// (a reload that names another audit log): receivers would otherwise keep the incident
    /// open for good.
    pub fn stop_following(&self, host: Option<&str>, now_ms: u64) -> Option<Notification> {
        let since = self.failing_since?;
        Some(Notification {
            status: "resolved",
            rule: HEAL_RULE.into(),
            gpu: None,
            uuid: None,
            host: host.map(str::to_string),
            value: 0.0,
            summary: format!(
                "Slurm heal: {} is no longer followed (config reloaded with another audit log)",
                vramguard_core::sanitize::shown(&self.follower.path.display().to_string())
            ),
            started_at_ms: since,
            at_ms: now_ms,
        })
    }

    /// Reads the new heal steps; returns the notifications they make: one `firing` when a
    /// heal fails (the node stays drained), one `resolved` when a later heal resumes the node
    /// or finds the drain no longer vramguard's.
    ///
    /// A log that cannot be read is an error (the caller counts it); it is logged once until
    /// it changes or a read succeeds.
    pub fn poll(
        &mut self,
        host: Option<&str>,
        now_ms: u64,
    ) -> Result<Vec<Notification>, FileError> {
        let read = if self.start_owed {
            self.start_at_end().map(|()| Vec::new())
        } else {
            self.follower.poll()
        };
        let records = match read {
            Ok(r) => {
                self.last_error = None;
                r
            }
            Err(e) => {
                let text = e.to_string();
                if self.last_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(
                        "following the audit log for heal steps: {text} (heal metrics and the \
                         slurm_heal_failed alert wait until it can be read)"
                    );
                    self.last_error = Some(text);
                }
                return Err(e);
            }
        };
        self.changed |= !records.is_empty();
        let mut out = Vec::new();
        for r in records {
            *self.counts.entry(r.step).or_default() += 1;
            let detail = r.detail.as_deref().unwrap_or("");
            tracing::info!(node = %r.node, step = r.step.name(), "slurm heal: {detail}");
            let note = |status, started_at_ms, summary: String| Notification {
                status,
                rule: HEAL_RULE.into(),
                gpu: None,
                uuid: None,
                host: host.map(str::to_string),
                value: f64::from(u8::from(status == "firing")),
                summary,
                started_at_ms,
                at_ms: now_ms,
            };
            match (r.step, self.failing_since) {
                (HealStep::Failed, None) => {
                    self.failing_since = Some(r.at_ms);
                    out.push(note(
                        "firing",
                        r.at_ms,
                        format!("Slurm node {} kept drained: {detail}", r.node),
                    ));
                }
                (HealStep::Resumed, Some(since)) => {
                    self.failing_since = None;
                    out.push(note(
                        "resolved",
                        since,
                        format!("Slurm node {}: GPUs clean, resumed", r.node),
                    ));
                }
                // Not drained any more, or drained by someone else: not vramguard's to
                // alert on. A node that is down ("node is not up") stays failing.
                (HealStep::Skipped, Some(since)) if detail.contains("drain") => {
                    self.failing_since = None;
                    out.push(note(
                        "resolved",
                        since,
                        format!(
                            "Slurm node {}: no longer drained by vramguard ({detail})",
                            r.node
                        ),
                    ));
                }
                _ => {}
            }
            self.last = Some(r);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn append(path: &Path, text: &str) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    fn rec(event: &str, ms: u64, extra: &str) -> String {
        format!(
            "{{\"ts_ms\":{ms},\"run_id\":\"r\",\"host\":\"h\",\"event\":\"{event}\",\"node\":\"gpu07\"{extra}}}\n"
        )
    }

    fn steps(records: &[HealRecord]) -> Vec<&'static str> {
        records.iter().map(|r| r.step.name()).collect()
    }

    #[test]
    fn every_heal_event_the_heal_loop_writes_is_a_step() {
        for step in HealStep::ALL {
            let event = format!("heal_{}", step.name());
            assert_eq!(HealStep::from_event(&event), Some(step));
        }
        for other in [
            "signal",
            "reset_done",
            "heal",
            "heal_",
            "heal_other",
            "waiting",
        ] {
            assert_eq!(HealStep::from_event(other), None, "{other}");
        }
        // The events the heal loop writes (vramguard-ops/src/slurm.rs).
        let source = include_str!("../../vramguard-ops/src/slurm.rs");
        for step in HealStep::ALL {
            assert!(
                source.contains(&format!("\"heal_{}\"", step.name())),
                "heal_{} is written by nobody",
                step.name()
            );
        }
    }

    #[test]
    fn a_torn_last_line_is_read_again_only_once_the_log_grew() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        append(&path, &rec("signal", 1, ""));
        let mut f = AuditFollower::new(&path);
        f.start_at_end().unwrap();
        let half = rec("heal_failed", 2, "");
        append(&path, &half[..20]);
        assert!(f.poll().unwrap().is_empty());
        let reads = f.reads;
        for _ in 0..3 {
            assert!(f.poll().unwrap().is_empty());
        }
        assert_eq!(f.reads, reads, "the torn line was read again at every poll");
        append(&path, &half[20..]);
        assert_eq!(steps(&f.poll().unwrap()), ["failed"]);
    }

    #[test]
    fn new_records_are_read_once_and_a_torn_line_waits_for_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        append(&path, &rec("heal_failed", 1, ",\"reason\":\"old\""));
        let mut f = AuditFollower::new(&path);
        let latest = f.start_at_end().unwrap().unwrap();
        assert_eq!(latest.step, HealStep::Failed);
        assert!(
            f.poll().unwrap().is_empty(),
            "what was there at start is not new"
        );
        append(&path, &rec("signal", 2, ""));
        append(&path, &rec("heal_waiting", 3, ",\"why\":\"job 7 runs\""));
        let half = rec("heal_reset", 4, "");
        append(&path, &half[..10]);
        let got = f.poll().unwrap();
        assert_eq!(steps(&got), ["waiting"]);
        assert_eq!(got[0].detail.as_deref(), Some("job 7 runs"));
        assert_eq!(got[0].at_ms, 3);
        assert!(f.poll().unwrap().is_empty());
        append(&path, &half[10..]);
        assert_eq!(steps(&f.poll().unwrap()), ["reset"]);
        assert!(f.poll().unwrap().is_empty());
    }

    #[test]
    fn a_rotated_or_truncated_log_is_read_from_its_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        append(&path, &rec("heal_waiting", 1, ""));
        let mut f = AuditFollower::new(&path);
        f.start_at_end().unwrap();
        // logrotate: moved away, a new file in its place.
        std::fs::rename(&path, dir.path().join("audit.jsonl.1")).unwrap();
        append(&path, &rec("heal_reset", 2, ""));
        assert_eq!(steps(&f.poll().unwrap()), ["reset"]);
        // copytruncate: the same inode, emptied (seen at the next poll), then written again.
        std::fs::write(&path, b"").unwrap();
        assert!(f.poll().unwrap().is_empty());
        append(&path, &rec("heal_resumed", 3, ""));
        assert_eq!(steps(&f.poll().unwrap()), ["resumed"]);
        // Removed: nothing, no error.
        std::fs::remove_file(&path).unwrap();
        assert!(f.poll().unwrap().is_empty());
    }

    #[test]
    fn hostile_lines_are_skipped_and_strings_are_escaped_and_cut() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut f = AuditFollower::new(&path);
        f.start_at_end().unwrap();
        // A line longer than a whole read, then garbage, then a record with control bytes.
        append(&path, &"x".repeat(READ_MAX as usize + 10));
        append(&path, "\nnot json\n{\"event\": 5}\n");
        let evil = format!("gpu\u{1b}[2J{}", "n".repeat(500));
        append(
            &path,
            &format!(
                "{{\"ts_ms\":9,\"event\":\"heal_failed\",\"node\":{},\"reason\":\"r\\u0007\"}}\n",
                serde_json::to_string(&evil).unwrap()
            ),
        );
        let mut got = Vec::new();
        for _ in 0..4 {
            got.extend(f.poll().unwrap());
        }
        assert_eq!(steps(&got), ["failed"]);
        assert!(!got[0].node.contains('\u{1b}'), "{}", got[0].node);
        assert!(got[0].node.chars().count() <= 64, "{}", got[0].node);
        assert!(!got[0].detail.as_deref().unwrap().contains('\u{7}'));
        // A link where the log should be is refused, not followed.
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, rec("heal_failed", 10, "")).unwrap();
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert!(f.poll().is_err());
    }

    #[test]
    fn a_failed_heal_fires_once_and_a_resume_resolves_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut w = HealWatch::start(&path);
        assert!(w.poll(Some("n1"), 0).unwrap().is_empty());
        append(&path, &rec("heal_waiting", 1, ",\"why\":\"job 7\""));
        append(&path, &rec("heal_reset", 2, ""));
        assert!(
            w.poll(Some("n1"), 2).unwrap().is_empty(),
            "progress is no alert"
        );
        append(
            &path,
            &rec(
                "heal_failed",
                3,
                ",\"reason\":\"vramguard: GPU reset did not free\"",
            ),
        );
        let n = w.poll(Some("n1"), 3).unwrap();
        assert_eq!(n.len(), 1);
        assert_eq!((n[0].status, n[0].rule.as_str()), ("firing", HEAL_RULE));
        assert_eq!(n[0].gpu, None);
        assert_eq!(n[0].host.as_deref(), Some("n1"));
        assert!(
            n[0].summary
                .contains("Slurm node gpu07 kept drained: vramguard: GPU reset did not free"),
            "{}",
            n[0].summary
        );
        assert!(w.failing());
        // A second failure of the same incident says nothing more.
        append(&path, &rec("heal_failed", 4, ",\"reason\":\"again\""));
        assert!(w.poll(Some("n1"), 4).unwrap().is_empty());
        append(&path, &rec("heal_resumed", 5, ""));
        let n = w.poll(Some("n1"), 5).unwrap();
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].status, "resolved");
        assert_eq!(n[0].started_at_ms, 3);
        assert!(!w.failing());
        assert_eq!(w.counts[&HealStep::Failed], 2);
        assert_eq!(w.counts[&HealStep::Waiting], 1);
        assert_eq!(w.last.as_ref().unwrap().step, HealStep::Resumed);
    }

    #[test]
    fn the_metrics_are_redrawn_only_on_a_change_and_an_unreadable_log_is_an_error_each_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut w = HealWatch::start(&path);
        assert!(!w.take_changed(), "no log, no heal: nothing to show");
        append(&path, &rec("signal", 1, ""));
        w.poll(None, 1).unwrap();
        assert!(!w.take_changed(), "no heal record");
        append(&path, &rec("heal_waiting", 2, ""));
        w.poll(None, 2).unwrap();
        assert!(w.take_changed());
        assert!(!w.take_changed());
        w.poll(None, 3).unwrap();
        assert!(!w.take_changed(), "quiet samples redraw nothing");
        // A link in its place: an error at every poll (counted by the agent), logged once.
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &path).unwrap();
        assert!(w.poll(None, 4).is_err());
        assert!(w.poll(None, 5).is_err());
        assert!(w.last_error.is_some());
        std::fs::remove_file(&path).unwrap();
        w.poll(None, 6).unwrap();
        assert!(w.last_error.is_none());
    }

    #[test]
    fn a_failure_already_in_the_log_at_start_is_firing_and_resolves_without_a_new_firing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        // More than the tail read at start before it: only the end is read.
        append(&path, &"{\"event\":\"filler\"}\n".repeat(10_000));
        append(&path, &rec("heal_failed", 7, ",\"reason\":\"held\""));
        let mut w = HealWatch::start(&path);
        assert!(w.failing());
        assert_eq!(w.last.as_ref().unwrap().step, HealStep::Failed);
        assert!(w.counts.is_empty(), "counted from the agent's start");
        append(
            &path,
            &rec("heal_skipped", 8, ",\"why\":\"drained by someone else\""),
        );
        let n = w.poll(None, 8).unwrap();
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].status, "resolved");
        assert!(
            n[0].summary.contains("drained by someone else"),
            "{}",
            n[0].summary
        );
    }

    #[test]
    fn a_failure_no_longer_followed_is_resolved_and_nothing_else_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        append(&path, &rec("heal_resumed", 1, ""));
        let w = HealWatch::start(&path);
        assert!(w.stop_following(None, 2).is_none(), "nothing was firing");
        append(&path, &rec("heal_failed", 3, ",\"reason\":\"held\""));
        let w = HealWatch::start(&path);
        let n = w.stop_following(Some("gpu07"), 4).unwrap();
        assert_eq!((n.status, n.rule.as_str()), ("resolved", HEAL_RULE));
        assert_eq!((n.started_at_ms, n.at_ms), (3, 4));
    }

    #[test]
    fn a_log_unreadable_at_start_is_started_at_its_end_once_readable_not_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.jsonl");
        let path = dir.path().join("audit.jsonl");
        // Old steps: a failure and its resolution, then a failure still in force.
        append(&real, &rec("heal_failed", 1, ",\"reason\":\"held\""));
        append(&real, &rec("heal_resumed", 2, ""));
        append(&real, &rec("heal_failed", 3, ",\"reason\":\"held\""));
        // At start the log is a link: refused, so the start is owed.
        std::os::unix::fs::symlink(&real, &path).unwrap();
        let mut w = HealWatch::start(&path);
        assert!(!w.failing());
        assert!(w.poll(None, 4).is_err(), "still a link");
        // Once it is a regular file, the state comes from its end; nothing is sent again.
        std::fs::remove_file(&path).unwrap();
        std::fs::rename(&real, &path).unwrap();
        assert_eq!(w.poll(None, 5).unwrap().len(), 0, "old steps sent again");
        assert!(w.failing());
        assert!(w.counts.is_empty());
        append(&path, &rec("heal_resumed", 6, ""));
        let n = w.poll(None, 6).unwrap();
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].status, "resolved");
    }
}
