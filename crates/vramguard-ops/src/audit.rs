//! The audit log: one JSON object per line, appended with a single `write` and made durable
//! with `fsync` before the next action, so a crash (or SIGKILL) between two actions leaves
//! every record whole.

use serde_json::{Map, Value};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// The default audit log.
pub const DEFAULT_AUDIT_LOG: &str = "/var/log/vramguard/audit.jsonl";

/// The log could not be opened or written.
#[derive(Debug, thiserror::Error)]
#[error("audit log {path}: {cause}")]
pub struct AuditError {
    /// The file.
    pub path: PathBuf,
    /// The cause.
    pub cause: std::io::Error,
}

/// An open audit log.
#[derive(Debug)]
pub struct AuditLog {
    file: File,
    path: PathBuf,
    run_id: String,
    host: String,
    /// Records left before writes fail as on a full disk (tests of the executor).
    #[cfg(test)]
    pub(crate) budget: Option<usize>,
}

/// Formats milliseconds since the epoch as RFC 3339 UTC (`2026-12-02T14:49:54.123Z`).
pub fn rfc3339(ms: u64) -> String {
    let secs = (ms / 1000) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        ms % 1000
    )
}

/// The machine's wall clock, for the records written outside a run on a node (opening and
/// repairing the log); a run's records take the node's clock ([`AuditLog::record_at`]).
fn now_ms() -> u64 {
    use vramguard_node::Clock;
    vramguard_node::SystemClock.wall_ms()
}

/// How much of a torn record its `repaired` record keeps.
const TORN_KEPT: u64 = 64 * 1024;

impl AuditLog {
    /// Opens (creating it and its directory) the log at `path` for appending.
    pub fn open(path: &Path, host: &str) -> Result<AuditLog, AuditError> {
        let err = |cause| AuditError {
            path: path.to_path_buf(),
            cause,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o750)
                .create(dir)
                .map_err(err)?;
        }
        // Never through a link, never a FIFO, created 0600: the log is root's record.
        let file = vramguard_fs::open_append(path).map_err(|e| err(e.into_io()))?;
        let mut log = AuditLog {
            file,
            path: path.to_path_buf(),
            run_id: format!("{}-{}", now_ms(), std::process::id()),
            host: host.to_string(),
            #[cfg(test)]
            budget: None,
        };
        log.repair_torn_end().map_err(err)?;
        Ok(log)
    }

    /// A run that died mid-record (a full disk, a crash) leaves a line without its newline;
    /// the next record would be glued to it, and a strict JSON-lines reader fails on it. Cut
    /// the file back to its last complete line and say so in a `repaired` record that keeps
    /// the torn bytes (as text, at most [`TORN_KEPT`] of them), so that every line parses.
    fn repair_torn_end(&mut self) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        // Every writer holds the file shared while it writes a record: with it exclusive, no
        // record is half-written (a write across a page boundary grows the file a page at a
        // time), so the last line is torn only if its writer died.
        let _whole = Flock::new(&self.file, rustix::fs::FlockOperation::LockExclusive)?;
        let len = self.file.metadata()?.len();
        if len == 0 {
            return Ok(());
        }
        let mut last = [0u8; 1];
        self.file.read_exact_at(&mut last, len - 1)?;
        if last[0] == b'\n' {
            return Ok(());
        }
        // The last newline, looked for backwards a block at a time (a record is small; a
        // file with no newline at all is one torn record).
        let mut end = len;
        let mut cut = 0u64;
        let mut block = vec![0u8; 64 * 1024];
        while end > 0 {
            let start = end.saturating_sub(block.len() as u64);
            let chunk = &mut block[..(end - start) as usize];
            self.file.read_exact_at(chunk, start)?;
            if let Some(i) = chunk.iter().rposition(|b| *b == b'\n') {
                cut = start + i as u64 + 1;
                break;
            }
            end = start;
        }
        let torn_len = len - cut;
        let mut torn = vec![0u8; torn_len.min(TORN_KEPT) as usize];
        self.file.read_exact_at(&mut torn, cut)?;
        self.file.set_len(cut)?;
        self.file.sync_data()?;
        drop(_whole);
        self.record(
            "repaired",
            serde_json::json!({
                "reason": "the last record was torn (the disk was full, or vramguard died while writing it); it was cut from the log and is kept here",
                "offset": cut,
                "torn_bytes": torn_len,
                "torn": String::from_utf8_lossy(&torn),
            }),
        )
        .map_err(|e| e.cause)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// This run's id, in every record.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Appends one record: `event` plus `fields` (an object), stamped with the machine's time,
    /// the run and the host.
    pub fn record(&mut self, event: &str, fields: Value) -> Result<(), AuditError> {
        self.record_at(now_ms(), event, fields)
    }

    /// [`AuditLog::record`] stamped `ms` (milliseconds since the epoch): the executor passes
    /// its node's clock, so a run on the fake node's manual clock logs the times it acted at.
    pub fn record_at(&mut self, ms: u64, event: &str, fields: Value) -> Result<(), AuditError> {
        let mut obj = Map::new();
        obj.insert("ts".into(), Value::String(rfc3339(ms)));
        obj.insert("ts_ms".into(), Value::from(ms));
        obj.insert("run_id".into(), Value::String(self.run_id.clone()));
        obj.insert("host".into(), Value::String(self.host.clone()));
        obj.insert("event".into(), Value::String(event.to_string()));
        if let Value::Object(extra) = fields {
            obj.extend(extra);
        }
        let mut line = serde_json::to_vec(&Value::Object(obj)).expect("JSON serialises");
        line.push(b'\n');
        let err = |cause| AuditError {
            path: self.path.clone(),
            cause,
        };
        #[cfg(test)]
        if let Some(left) = self.budget.as_mut() {
            if *left == 0 {
                return Err(err(std::io::Error::from_raw_os_error(libc::ENOSPC)));
            }
            *left -= 1;
        }
        // O_APPEND and one write per record: concurrent writers never interleave a record;
        // shared, so that a repair (exclusive) never sees one half-written.
        let _writing =
            Flock::new(&self.file, rustix::fs::FlockOperation::LockShared).map_err(err)?;
        (&self.file).write_all(&line).map_err(err)?;
        self.file.sync_data().map_err(err)?;
        Ok(())
    }
}

/// An advisory lock on the log, released when dropped.
struct Flock<'a>(&'a std::fs::File);

impl<'a> Flock<'a> {
    /// The lock; where the filesystem has no locks (NFSv3 without lockd, some FUSE mounts),
    /// none, as before locks were taken: the log is still written.
    fn new(file: &'a std::fs::File, how: rustix::fs::FlockOperation) -> std::io::Result<Self> {
        match rustix::fs::flock(file, how) {
            Ok(()) | Err(rustix::io::Errno::NOLCK | rustix::io::Errno::OPNOTSUPP) => {
                Ok(Flock(file))
            }
            Err(e) => Err(e.into()),
        }
    }
}

impl Drop for Flock<'_> {
    fn drop(&mut self) {
        let _ = rustix::fs::flock(self.0, rustix::fs::FlockOperation::Unlock);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_219_394_123), "2026-12-02T13:49:54.123Z");
    }

    /// Red-team finding: a record being written when another run opened the log looked torn
    /// (the file grows a page at a time), and the repair cut the record once complete: a
    /// signal's record lost. The repair waits for writers in progress.
    #[test]
    fn a_record_being_written_is_not_cut_by_another_runs_repair() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        std::fs::write(&path, "{\"event\":\"start\"}\n{\"event\":\"sig").unwrap();
        let mut writer = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        rustix::fs::flock(&writer, rustix::fs::FlockOperation::LockShared).unwrap();
        let opening = {
            let path = path.clone();
            std::thread::spawn(move || AuditLog::open(&path, "n").map(|_| ()))
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(
            !opening.is_finished(),
            "the repair did not wait for the writer"
        );
        writer.write_all(b"nal\"}\n").unwrap();
        rustix::fs::flock(&writer, rustix::fs::FlockOperation::Unlock).unwrap();
        opening.join().unwrap().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "{\"event\":\"start\"}\n{\"event\":\"signal\"}\n");
    }

    #[test]
    fn records_are_lines_of_json() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/audit.jsonl");
        let mut log = AuditLog::open(&path, "node1").unwrap();
        log.record("start", serde_json::json!({"gpus": [0]}))
            .unwrap();
        log.record("signal", serde_json::json!({"pid": 4, "signal": "TERM"}))
            .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1]["event"], "signal");
        assert_eq!(lines[1]["pid"], 4);
        assert_eq!(lines[0]["host"], "node1");
        assert_eq!(lines[0]["run_id"], lines[1]["run_id"]);
    }

    #[test]
    fn a_torn_last_line_is_cut_and_kept_in_a_repaired_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        std::fs::write(&path, b"{\"event\":\"start\"}\n{\"event\":\"sig").unwrap();
        let mut log = AuditLog::open(&path, "node1").unwrap();
        log.record("start", serde_json::json!({})).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(lines[1]["event"], "repaired", "{text}");
        assert_eq!(lines[1]["torn"], "{\"event\":\"sig");
        assert_eq!(lines[1]["torn_bytes"], 13);
        assert_eq!(lines[1]["offset"], 18);
        // A clean end is left alone.
        drop(log);
        AuditLog::open(&path, "node1").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 3);
        // A file that is one torn record, with bytes that are not UTF-8.
        std::fs::write(&path, b"{\"event\":\"x\xff").unwrap();
        AuditLog::open(&path, "node1").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let only: Value = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(only["event"], "repaired");
        assert_eq!(only["offset"], 0);
        assert_eq!(only["torn"], "{\"event\":\"x\u{fffd}");
    }

    #[test]
    fn an_unwritable_place_is_an_error_naming_the_file() {
        // A directory that cannot be made: its parent is a plain file.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("file"), b"").unwrap();
        let path = dir.path().join("file/sub/audit.jsonl");
        let e = AuditLog::open(&path, "h").unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("audit log {}:", path.display())),
            "{e}"
        );
    }

    /// Every day from 1970 to 2500 at 12:34:56.789, against a calendar counted a day at a time:
    /// leap days, the centuries that are not leap years (2100, 2200, 2300) and the one that is
    /// (2400), and the first and last days of Hinnant's 400-year eras (2000-03-01, 2400-02-29).
    #[test]
    fn rfc3339_agrees_with_a_calendar_counted_day_by_day() {
        let leap =
            |y: u64| (y.is_multiple_of(4) && !y.is_multiple_of(100)) || y.is_multiple_of(400);
        let mut day_ms = 0u64;
        for year in 1970..2500u64 {
            for month in 1..=12u64 {
                let days = match month {
                    2 if leap(year) => 29,
                    2 => 28,
                    4 | 6 | 9 | 11 => 30,
                    _ => 31,
                };
                for day in 1..=days {
                    let ms = day_ms + 45_296_789;
                    let want = format!("{year:04}-{month:02}-{day:02}T12:34:56.789Z");
                    assert_eq!(rfc3339(ms), want, "{ms} ms");
                    day_ms += 86_400_000;
                }
            }
        }
        assert_eq!(rfc3339(1_709_164_800_000), "2024-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(4_107_542_400_000), "2100-03-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_868_799_999), "2000-02-29T23:59:59.999Z");
    }

    /// A record's time and the run id are read from the clock: between two readings of it.
    #[test]
    fn a_record_is_stamped_with_the_time_it_was_written_and_the_run_id() {
        let now = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let before = now();
        let mut log = AuditLog::open(&path, "node1").unwrap();
        log.record("start", serde_json::json!({})).unwrap();
        let after = now();
        let text = std::fs::read_to_string(&path).unwrap();
        let line: Value = serde_json::from_str(text.trim_end()).unwrap();
        let ts_ms = line["ts_ms"].as_u64().unwrap();
        assert!(
            (before..=after).contains(&ts_ms),
            "{before} {ts_ms} {after}"
        );
        assert_eq!(line["ts"], rfc3339(ts_ms));
        assert_eq!(line["run_id"], log.run_id());
        let (opened_ms, pid) = log.run_id().split_once('-').unwrap();
        let opened_ms: u64 = opened_ms.parse().unwrap();
        assert!((before..=after).contains(&opened_ms), "{}", log.run_id());
        assert_eq!(pid, std::process::id().to_string());
    }

    /// A torn record longer than the 64 KiB block read backwards: its line start is found two
    /// blocks back, and its first 64 KiB are kept.
    #[test]
    fn a_torn_record_longer_than_a_block_is_cut_at_its_line_and_kept_to_64_kib() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let whole = b"{\"event\":\"start\"}\n";
        let torn: Vec<u8> = (0..100_000).map(|i| b'a' + (i % 26) as u8).collect();
        std::fs::write(&path, [&whole[..], &torn].concat()).unwrap();
        AuditLog::open(&path, "node1").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["event"], "start");
        assert_eq!(lines[1]["event"], "repaired");
        assert_eq!(lines[1]["offset"], whole.len());
        assert_eq!(lines[1]["torn_bytes"], torn.len());
        assert_eq!(
            lines[1]["torn"].as_str().unwrap().as_bytes(),
            &torn[..64 * 1024]
        );
    }
}
