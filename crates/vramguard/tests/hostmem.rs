//! The host side of dead GPU jobs, with real processes: pinned/locked and shared memory per
//! holder, and `reclaim --include shm`, which removes only orphaned shared-memory segments.
//!
//! The reclaim test runs in a private PID and mount namespace: its tmpfs disappears with it, its
//! processes die with it, and every process in it is one vramguard can read (the users check
//! refuses to call a segment orphaned while any process's maps are unreadable).

mod common;
use common::*;
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn python() -> Option<&'static str> {
    ["/usr/bin/python3", "/usr/local/bin/python3"]
        .into_iter()
        .find(|p| Path::new(p).exists())
}

/// A shell scenario run as PID 1 of a fresh PID and mount namespace; its stdout.
fn in_namespace(script: &str) -> String {
    let out = Command::new("unshare")
        .args(["--mount", "--pid", "--fork", "--mount-proc", "bash", "-c"])
        .arg(script)
        .output()
        .expect("unshare");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success(),
        "scenario failed ({:?})\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    stdout
}

#[test]
fn only_orphaned_shared_memory_is_removed_and_every_other_segment_is_kept() {
    let Some(py) = python() else {
        panic!("python3 is needed to map a segment without an fd");
    };
    let world = World::new(1);
    let dir = world.dir.path();
    let shm = dir.join("shm");
    let outside = dir.join("outside");
    std::fs::create_dir_all(&shm).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("victim"), "keep me").unwrap();
    let cfg = config(
        &world,
        &format!("[shm]\ndirs = [\"{}\"]\nmin_age = \"1s\"\n", shm.display()),
    );
    let audit = dir.join("audit.jsonl");
    let script = format!(
        r#"set -e
SHM={shm}
mount -t tmpfs -o size=16m tmpfs "$SHM"
# Orphaned: a dead job's PyTorch segment, owned by a user with no process left.
head -c 2097152 /dev/zero > "$SHM/torch_orphan"; chown 4242 "$SHM/torch_orphan"
# Held open by a live process (no mapping).
head -c 4096 /dev/zero > "$SHM/nccl-open"; chown 4242 "$SHM/nccl-open"
sleep 120 < "$SHM/nccl-open" &
# Mapped by a live process that closed its fd.
head -c 8192 /dev/zero > "$SHM/psm_mapped"; chown 4242 "$SHM/psm_mapped"
{py} -c '
import ctypes, os, sys, time
libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDWR)
assert libc.mmap(None, 8192, 3, 1, fd, 0) not in (None, ctypes.c_void_p(-1).value)
os.close(fd)  # Python mmap would keep a dup of the fd: this maps with no fd left
print("mapped", flush=True); time.sleep(120)' "$SHM/psm_mapped" > "$SHM/../mapped.txt" &
# No known producer's name.
head -c 4096 /dev/zero > "$SHM/PostgreSQL.1234"; chown 4242 "$SHM/PostgreSQL.1234"
# A link and a FIFO with a producer's name.
ln -s {outside}/victim "$SHM/torch_link"
mkfifo "$SHM/torch_fifo"
# Owned by a user (root) whose GPU job is alive.
head -c 4096 /dev/zero > "$SHM/torch_owner_busy"
{bin} --sim {state} sim hold --gpu 0 --bytes 1GiB --lifetime 120s &
for i in $(seq 100); do grep -q mapped "$SHM/../mapped.txt" 2>/dev/null && break; sleep 0.05; done
# The orphan must be older than min_age (1 s) when judged: wait on its age itself (its last
# change, as the judge reads it), not for a fixed time.
{py} -c '{older}' "$SHM/torch_orphan" 1.05
# Too young (written just now).
head -c 4096 /dev/zero > "$SHM/torch_young"; chown 4242 "$SHM/torch_young"
{bin} --sim {state} --config {cfg} status --json > {dir}/status.json
rc=0; NO_COLOR=1 COLUMNS=200 {bin} --sim {state} --config {cfg} reclaim --include shm --yes --json --audit-log {audit} > {dir}/outcome.json || rc=$?
echo $rc > {dir}/reclaim.rc
ls -A "$SHM" | sort
test "$(cat {outside}/victim)" = "keep me"
"#,
        shm = shm.display(),
        outside = outside.display(),
        bin = BIN,
        state = world.state_path().display(),
        cfg = cfg.display(),
        dir = dir.display(),
        audit = audit.display(),
        older = OLDER_THAN,
    );
    let left = in_namespace(&script);
    let left: Vec<&str> = left.lines().collect();
    assert_eq!(
        left,
        [
            "PostgreSQL.1234",
            "nccl-open",
            "psm_mapped",
            "torch_fifo",
            "torch_link",
            "torch_owner_busy",
            "torch_young"
        ],
        "exactly the orphan is gone"
    );

    let status: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("status.json")).unwrap()).unwrap();
    let verdict = |name: &str| -> String {
        status["host"]["segments"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("{name} not in {}", status["host"]))["verdict"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(verdict("torch_orphan"), "reclaimable");
    assert_eq!(verdict("nccl-open"), "in_use");
    assert_eq!(verdict("psm_mapped"), "in_use");
    assert_eq!(verdict("PostgreSQL.1234"), "unknown_producer");
    assert_eq!(verdict("torch_owner_busy"), "owner_active");
    assert_eq!(verdict("torch_young"), "too_young");
    assert!(
        status["host"]["segments"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["name"] != "torch_link" && s["name"] != "torch_fifo"),
        "links and FIFOs are not segments: {}",
        status["host"]
    );
    assert_eq!(status["host"]["orphan_shm_bytes"], 2 << 20);

    let outcome: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("outcome.json")).unwrap()).unwrap();
    // Nothing it was asked for is left: 0, said both ways.
    assert_eq!(outcome["exit_code"], 0, "{outcome}");
    assert_eq!(
        std::fs::read_to_string(dir.join("reclaim.rc"))
            .unwrap()
            .trim(),
        "0",
        "{outcome}"
    );
    let segments = outcome["segments"].as_array().expect("segment outcomes");
    assert_eq!(segments.len(), 1, "{outcome}");
    assert_eq!(segments[0]["name"], "torch_orphan");
    assert_eq!(segments[0]["result"], "removed");
    assert!(outcome["host_available"]["before"].is_u64(), "{outcome}");
    assert!(outcome["host_available"]["after"].is_u64(), "{outcome}");

    let records: Vec<Value> = std::fs::read_to_string(&audit)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let unlinked: Vec<&Value> = records.iter().filter(|r| r["event"] == "unlink").collect();
    assert_eq!(unlinked.len(), 1, "{records:?}");
    assert_eq!(unlinked[0]["name"], "torch_orphan");
    assert_eq!(unlinked[0]["uid"], 4242);
    assert_eq!(unlinked[0]["bytes"], 2 << 20);
    // The record came before the result.
    let order: Vec<&str> = records
        .iter()
        .filter_map(|r| r["event"].as_str())
        .filter(|e| e.starts_with("segment") || *e == "unlink")
        .collect();
    assert_eq!(order, ["segment", "unlink", "segment_result"]);
}

#[test]
fn a_holders_locked_and_shared_host_memory_is_reported_with_its_dead_job() {
    let Some(py) = python() else {
        panic!("python3 is needed to lock memory");
    };
    let world = World::new(1);
    let dir = world.dir.path();
    // A segment of this test's own in the host's /dev/shm, removed at the end.
    let segment = RemovedOnDrop(
        Path::new("/dev/shm").join(format!("torch_vramguard_test_{}", std::process::id())),
    );
    std::fs::write(&segment.0, vec![0u8; 8 << 20]).unwrap();
    let segment = &segment.0;
    let cfg = config(&world, "[shm]\ndirs = [\"/dev/shm\"]\n");
    // A worker whose launcher (a session leader) exits at once: it maps the 8 MiB segment and
    // locks 4 MiB of anonymous memory (what cudaHostAlloc's pinned buffers are to the kernel).
    let worker = r#"
import ctypes, mmap, time, sys
devices = [open(p, "rb") for p in sys.argv[3:]]
f = open(sys.argv[1], "r+b"); m = mmap.mmap(f.fileno(), 0); f.close(); m[:] = b"x" * len(m)
a = mmap.mmap(-1, 4 << 20); a[:] = b"y" * len(a)
buf = ctypes.c_char.from_buffer(a)
libc = ctypes.CDLL(None)
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
assert libc.mlock(ctypes.addressof(buf), len(a)) == 0
open(sys.argv[2], "w").write("ready")
time.sleep(120)
"#;
    let ready = dir.join("ready");
    let out = Command::new("setsid")
        .arg("bash")
        .arg("-c")
        .arg(format!(
            "{py} -c '{worker}' {} {} {} {} > /dev/null 2>&1 & echo $!",
            segment.display(),
            ready.display(),
            world.dev("nvidia0").display(),
            world.dev("nvidiactl").display(),
        ))
        .output()
        .unwrap();
    let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let mut started = Spawned::default();
    started.track(pid);
    wait_until(20, "the worker to map and lock its memory", || {
        ready.exists()
    });
    world.allocate(allocation(0, pid, 2 << 30));

    let report = status_with_config(&world, &cfg);
    let h = holder(&report, 0, pid);
    let memory = &h["host_memory"];
    assert!(
        memory["locked_bytes"].as_u64().unwrap_or(0) >= 4 << 20,
        "VmLck: {h}"
    );
    assert_eq!(memory["shm_bytes"].as_u64(), Some(8 << 20), "{memory}");
    assert!(h["rss_bytes"].as_u64().unwrap() >= 12 << 20, "{h}");
    let job = report["host"]["dead_jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["pids"].as_array().unwrap().contains(&pid.into()))
        .unwrap_or_else(|| panic!("no dead job holds {pid}: {}", report["host"]));
    assert_eq!(job["gpu_bytes"].as_u64(), Some(2 << 30));
    assert_eq!(job["shm_bytes"].as_u64(), Some(8 << 20));
    assert!(job["pinned_bytes"].as_u64().unwrap() >= 4 << 20, "{job}");

    let text = stdout(
        &Vg::new(&world, Path_::InProcess)
            .arg_path("--config", &cfg)
            .args(["status"])
            .code(0),
    );
    // From 240 columns each holder's row has its pinned and shared memory.
    let wide = stdout(
        &Vg::new(&world, Path_::InProcess)
            .arg_path("--config", &cfg)
            .args(["status"])
            .env("COLUMNS", "240")
            .code(0),
    );
    assert!(wide.contains("PINNED") && wide.contains("SHM"), "{wide}");
    let row = wide
        .lines()
        .find(|l| l.trim_start().starts_with(&pid.to_string()))
        .unwrap_or_else(|| panic!("no row for {pid}:\n{wide}"));
    assert!(row.contains("8.0 MiB") && row.contains("4.0 MiB"), "{row}");
    let line = text
        .lines()
        .find(|l| l.contains("(gone):"))
        .unwrap_or_else(|| panic!("no dead-job line:\n{text}"));
    assert!(
        line.contains("2.0 GiB GPU") && line.contains("8.0 MiB of it in shared memory"),
        "{line}"
    );
    // The segment is mapped: whatever else, it is not orphaned.
    let seg = report["host"]["segments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| Path::new("/dev/shm").join(s["name"].as_str().unwrap()) == *segment)
        .unwrap_or_else(|| panic!("{} not listed", segment.display()))
        .clone();
    assert_ne!(seg["verdict"], "reclaimable", "{seg}");

    started.kill_all();
}

/// A Python program: waits until the file `argv[1]` was last changed (modified or its inode
/// changed, whichever is later, as the segment judge reads it) at least `argv[2]` seconds ago;
/// 30 s at most. A test of `min_age` waits on the age itself, never a fixed time.
const OLDER_THAN: &str = "import os, sys, time
deadline = time.time() + 30
def age():
    st = os.stat(sys.argv[1])
    return time.time() - max(st.st_mtime, st.st_ctime)
while age() < float(sys.argv[2]):
    assert time.time() < deadline, \"timed out waiting for \" + sys.argv[1] + \" to age\"
    time.sleep(0.01)";

/// A file this test made, removed however the test ends.
struct RemovedOnDrop(std::path::PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The whole incident: a training job was killed, its DataLoader worker lives on holding 2 GiB
/// of GPU memory and mapping the job's PyTorch segment. `reclaim --include shm` stops the
/// worker first, then (the segment judged again, now unused) removes the segment.
#[test]
fn a_dead_jobs_worker_and_the_segment_it_maps_are_reclaimed_in_that_order() {
    let Some(py) = python() else {
        panic!("python3 is needed for the worker");
    };
    let world = World::new(1);
    let dir = world.dir.path().to_path_buf();
    let shm = dir.join("shm");
    std::fs::create_dir_all(&shm).unwrap();
    let cfg = config(
        &world,
        &format!("[shm]\ndirs = [\"{}\"]\nmin_age = \"1s\"\n", shm.display()),
    );
    let worker = r#"
import mmap, sys, time
devices = [open(p, "rb") for p in sys.argv[3:]]
f = open(sys.argv[1], "r+b"); m = mmap.mmap(f.fileno(), 0); m[:] = b"x" * len(m)
open(sys.argv[2], "w").write("ready")
time.sleep(120)
"#;
    std::fs::write(dir.join("worker.py"), worker).unwrap();
    let script = format!(
        r#"set -e
mount -t tmpfs -o size=16m tmpfs {shm}
head -c 4194304 /dev/zero > {shm}/torch_7_1
# The launcher (a session leader) starts the worker and dies.
setsid bash -c '{py} {dir}/worker.py {shm}/torch_7_1 {dir}/ready {dev0} {ctl} > /dev/null 2>&1 & echo $! > {dir}/worker.pid'
for i in $(seq 200); do test -e {dir}/ready && break; sleep 0.05; done
touch {dir}/need-allocation
for i in $(seq 200); do test -e {dir}/allocated && break; sleep 0.05; done
# The segment (last written by the worker) must be older than min_age (1 s) once the worker
# is gone: wait on its age itself, not for a fixed time.
{py} -c '{older}' {shm}/torch_7_1 1.05
{bin} --sim {state} --config {cfg} status --json > {dir}/status.json
rc=0; NO_COLOR=1 {bin} --sim {state} --config {cfg} reclaim --include orphan,hidden,shm --yes --json --grace 2s --audit-log {dir}/audit.jsonl > {dir}/outcome.json || rc=$?
echo $rc > {dir}/reclaim.rc
ls -A {shm}
"#,
        shm = shm.display(),
        dir = dir.display(),
        dev0 = world.dev("nvidia0").display(),
        ctl = world.dev("nvidiactl").display(),
        bin = BIN,
        state = world.state_path().display(),
        cfg = cfg.display(),
        older = OLDER_THAN,
    );
    let child = Command::new("unshare")
        .args([
            "--mount",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            "bash",
            "-c",
        ])
        .arg(&script)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Reaped(child);
    // The worker's pid in the namespace is the one the simulated driver reports there.
    wait_until(20, "the worker", || dir.join("need-allocation").exists());
    let pid: u32 = std::fs::read_to_string(dir.join("worker.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    world.allocate(allocation(0, pid, 2 << 30));
    std::fs::write(dir.join("allocated"), "").unwrap();
    let mut out = String::new();
    use std::io::Read;
    child
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let mut err = String::new();
    child
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(child.0.wait().unwrap().success(), "{out}\n{err}");

    let status: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("status.json")).unwrap()).unwrap();
    let seg = &status["host"]["segments"][0];
    assert_eq!(
        seg["verdict"], "in_use",
        "before: the worker maps it: {seg}"
    );
    assert_eq!(seg["users"], serde_json::json!([pid]));
    let outcome: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("outcome.json")).unwrap())
            .unwrap_or_else(|e| panic!("{e}: {out}\n{err}"));
    let targets: Vec<u64> = outcome["targets"]
        .as_array()
        .unwrap_or_else(|| panic!("no targets: {outcome}\n{err}"))
        .iter()
        .map(|t| t["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(targets, [u64::from(pid)], "{outcome}");
    // The worker and the segment are both gone: nothing asked for is left.
    assert_eq!(outcome["exit_code"], 0, "{outcome}");
    assert_eq!(
        std::fs::read_to_string(dir.join("reclaim.rc"))
            .unwrap()
            .trim(),
        "0",
        "{outcome}\n{err}"
    );
    assert_eq!(
        outcome["plan"]["segments"][0]["after_targets"],
        serde_json::json!([pid])
    );
    assert_eq!(outcome["segments"][0]["result"], "removed", "{outcome}");
    assert_eq!(out.trim(), "", "the segment is gone: {out}");
    let audit = std::fs::read_to_string(dir.join("audit.jsonl")).unwrap();
    let events: Vec<String> = audit
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["event"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let term = events.iter().position(|e| e == "signal").unwrap();
    let unlink = events.iter().position(|e| e == "unlink").unwrap();
    assert!(
        term < unlink,
        "the worker is signalled before its segment goes: {events:?}"
    );
}
