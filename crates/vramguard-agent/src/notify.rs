//! Delivers alert notifications to the configured sinks, off the sampling path: a log line, a
//! webhook (a JSON POST, retried with exponential backoff), and commands (argv without a shell,
//! the alert in environment variables).
//!
//! Each sink has a worker thread of its own behind a bounded queue, so a webhook that never
//! answers delays neither a collection nor the other sinks. The queue keeps one entry per
//! incident (rule and GPU): a rule flapping while the sink is slow takes one slot, not all of
//! them (a queue full of distinct incidents drops the newest, with a log line). A command runs in a cgroup of its own (a process group
//! where cgroups cannot be made) and everything in it is killed on timeout, at shutdown, and
//! once the command has exited. Shutdown waits at most a deadline; what is left is dropped, said in
//! the log.

use crate::alerts::Notification;
use crate::config::{AlertsConfig, Exec, Webhook};
use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Notifications waiting per sink before new ones are dropped.
const QUEUE: usize = 64;
/// How long shutdown waits for deliveries in progress.
pub const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(10);

/// The notifier's end: send notifications here.
pub struct Notifier {
    tx: Option<Sender<Notification>>,
    handle: Option<JoinHandle<()>>,
    /// Set at shutdown: retries stop, commands are killed.
    stopping: Arc<AtomicBool>,
}

impl Notifier {
    /// Starts the dispatcher; sinks are read from `config` at each notification, so a reload
    /// takes effect for the next one.
    pub fn start(config: Arc<RwLock<AlertsConfig>>) -> Notifier {
        let (tx, rx) = channel();
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let handle = std::thread::Builder::new()
            .name("vramguard-notify".into())
            .spawn(move || dispatch(rx, config, stop))
            .expect("spawn the notifier thread");
        Notifier {
            tx: Some(tx),
            handle: Some(handle),
            stopping,
        }
    }

    /// Queues a notification; never blocks.
    pub fn send(&self, n: Notification) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(n);
        }
    }

    /// Delivers what is queued within [`SHUTDOWN_DEADLINE`], then stops.
    pub fn stop(&mut self) {
        self.stop_within(SHUTDOWN_DEADLINE);
    }

    /// Delivers what is queued within `deadline`; after it, retries stop, commands are killed
    /// and what is left is dropped (logged). Returns within `deadline` plus a moment.
    pub fn stop_within(&mut self, deadline: Duration) {
        drop(self.tx.take());
        let Some(h) = self.handle.take() else {
            return;
        };
        let until = Instant::now() + deadline;
        while !h.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        if !h.is_finished() {
            self.stopping.store(true, Ordering::SeqCst);
            tracing::warn!(
                "alert delivery still busy after {deadline:?} at shutdown: dropping what is left"
            );
            let grace = Instant::now() + Duration::from_secs(1);
            while !h.is_finished() && Instant::now() < grace {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        if h.is_finished() {
            let _ = h.join();
        }
    }
}

/// A sink's queue, one entry per incident (rule and GPU): a newer state of an incident that
/// is still waiting replaces it where it stands, so a rule flapping while the sink is slow
/// costs one slot, and the queue fills only with [`QUEUE`] distinct incidents (then the newest
/// is dropped, with a log line).
#[derive(Default)]
struct Queue {
    state: std::sync::Mutex<(std::collections::VecDeque<Notification>, bool)>,
    ready: std::sync::Condvar,
}

/// What [`Queue::push`] did.
#[derive(Debug, PartialEq, Eq)]
enum Queued {
    /// Waiting at the end.
    Added,
    /// An earlier state of the same incident, still waiting, was replaced.
    Replaced,
    /// Full of other incidents: dropped.
    Dropped,
}

impl Queue {
    fn push(&self, n: Notification) -> Queued {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (waiting, _) = &mut *guard;
        let queued = if let Some(same) = waiting
            .iter_mut()
            .find(|q| q.rule == n.rule && q.gpu == n.gpu)
        {
            // The first time it began holding is kept with the latest state.
            let started = same.started_at_ms.min(n.started_at_ms);
            *same = n;
            same.started_at_ms = started;
            Queued::Replaced
        } else if waiting.len() >= QUEUE {
            Queued::Dropped
        } else {
            waiting.push_back(n);
            Queued::Added
        };
        self.ready.notify_one();
        queued
    }

    /// The next notification; `None` once closed and empty.
    fn pop(&self) -> Option<Notification> {
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let (waiting, closed) = &mut *guard;
            if let Some(n) = waiting.pop_front() {
                return Some(n);
            }
            if *closed {
                return None;
            }
            guard = self.ready.wait(guard).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// No more pushes: the worker ends once it has delivered what is waiting.
    fn close(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        self.ready.notify_all();
    }
}

/// A sink's worker: its queue and its thread.
struct Worker {
    queue: Arc<Queue>,
    handle: JoinHandle<()>,
}

/// A sink by its whole configuration: a reload that changes it starts a new worker.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
enum SinkKey {
    Webhook(String),
    Exec(String),
}

fn webhook_key(w: &Webhook) -> SinkKey {
    SinkKey::Webhook(format!("{w:?}"))
}

fn exec_key(x: &Exec) -> SinkKey {
    SinkKey::Exec(format!("{x:?}"))
}

fn spawn_worker(key: &SinkKey, cfg: &AlertsConfig, stop: Arc<AtomicBool>) -> Worker {
    let queue = Arc::new(Queue::default());
    let rx = queue.clone();
    let key = key.clone();
    let webhook = cfg.webhooks.iter().find(|w| webhook_key(w) == key).cloned();
    let exec_sink = cfg.execs.iter().find(|x| exec_key(x) == key).cloned();
    let handle = std::thread::Builder::new()
        .name("vramguard-sink".into())
        .spawn(move || {
            while let Some(n) = rx.pop() {
                if stop.load(Ordering::SeqCst) {
                    tracing::warn!(rule = %n.rule, "alert dropped at shutdown");
                    continue;
                }
                if let Some(w) = &webhook
                    && let Err(e) = post(w, &n, &stop)
                {
                    // Scheme and host only: webhook URLs carry their tokens (Slack, Teams,
                    // ?token=, user:password@).
                    tracing::error!(url = %url_host(&w.url), rule = %n.rule, "webhook failed: {e}");
                }
                if let Some(x) = &exec_sink
                    && let Err(e) = exec(x, &n, &stop)
                {
                    // The program only: its arguments may carry a token.
                    tracing::error!(command = %x.argv[0], rule = %n.rule, "alert command failed: {e}");
                }
            }
        })
        .expect("spawn a sink thread");
    Worker { queue, handle }
}

fn dispatch(rx: Receiver<Notification>, config: Arc<RwLock<AlertsConfig>>, stop: Arc<AtomicBool>) {
    let mut workers: BTreeMap<SinkKey, Worker> = BTreeMap::new();
    while let Ok(n) = rx.recv() {
        let cfg = config.read().unwrap_or_else(|p| p.into_inner()).clone();
        if cfg.log {
            match n.status {
                "firing" => {
                    tracing::warn!(rule = %n.rule, gpu = n.gpu, value = n.value, "alert firing: {}", n.summary)
                }
                _ => tracing::info!(rule = %n.rule, gpu = n.gpu, "alert resolved: {}", n.summary),
            }
        }
        let keys: Vec<SinkKey> = cfg
            .webhooks
            .iter()
            .map(webhook_key)
            .chain(cfg.execs.iter().map(exec_key))
            .collect();
        // A reload removed a sink: its worker finishes what it has and ends.
        workers.retain(|k, w| {
            let keep = keys.contains(k);
            if !keep {
                w.queue.close();
            }
            keep
        });
        for key in keys {
            let w = workers
                .entry(key.clone())
                .or_insert_with(|| spawn_worker(&key, &cfg, stop.clone()));
            if w.queue.push(n.clone()) == Queued::Dropped {
                tracing::warn!(rule = %n.rule, "alert sink busy ({QUEUE} incidents queued): notification dropped");
            }
        }
    }
    // Shutdown: close every queue, wait for the workers (the caller bounds the wait).
    let handles: Vec<JoinHandle<()>> = std::mem::take(&mut workers)
        .into_values()
        .map(|w| {
            w.queue.close();
            w.handle
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
}

/// Sleeps `d` unless shutdown starts; returns whether it is stopping.
fn pause(d: Duration, stop: &AtomicBool) -> bool {
    let until = Instant::now() + d;
    while Instant::now() < until {
        if stop.load(Ordering::SeqCst) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20).min(until - Instant::now()));
    }
    stop.load(Ordering::SeqCst)
}

/// The webhook body.
pub fn body(n: &Notification) -> String {
    serde_json::json!({
        "source": "vramguard",
        "status": n.status,
        "rule": n.rule,
        "gpu": n.gpu,
        "uuid": n.uuid,
        "host": n.host,
        "value": n.value,
        "summary": n.summary,
        "started_at": vramguard_ops::audit::rfc3339(n.started_at_ms),
        "at": vramguard_ops::audit::rfc3339(n.at_ms),
    })
    .to_string()
}

/// Why a notification did not reach its sink.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    /// The webhook answered with an error, or could not be reached, on the last try.
    #[error(transparent)]
    Http(#[from] ureq::Error),
    /// The agent is stopping: no more retries.
    #[error("{last} (retries stopped at shutdown)")]
    RetriesStopped {
        /// The last try's error.
        last: ureq::Error,
    },
    /// The webhook answered with a redirect, which is not followed.
    #[error("answered {0}, a redirect: not followed (give the final URL)")]
    Redirected(u16),
    /// The command could not be started.
    #[error("starting {program}: {cause}")]
    NotStarted {
        /// argv[0].
        program: String,
        /// Why.
        cause: std::io::Error,
    },
    /// The command failed.
    #[error("exited with {0}")]
    Failed(std::process::ExitStatus),
    /// The command outlived its timeout.
    #[error("killed (with everything it started) after {0:?}")]
    TimedOut(Duration),
    /// The agent stopped while the command ran.
    #[error("killed at shutdown")]
    Shutdown,
    /// Waiting for the command failed.
    #[error("waiting for the command: {0}")]
    Wait(std::io::Error),
}

/// `scheme://host[:port]` of a URL, without user information, path or query (where tokens
/// are).
fn url_host(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    vramguard_core::sanitize::fit(&format!("{scheme}://{host}"), 120)
}

fn post(w: &Webhook, n: &Notification, stop: &AtomicBool) -> Result<(), DeliveryError> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(w.timeout))
        .http_status_as_error(true)
        // A redirect is not followed: the receiver (or whoever answers for it) could send the
        // agent, running as root, to an internal address.
        .max_redirects(0)
        .build()
        .into();
    let payload = body(n);
    let mut backoff = Duration::from_millis(500);
    let mut attempt = 0;
    loop {
        let last = match agent
            .post(&w.url)
            .header("content-type", "application/json")
            .send(payload.as_str())
        {
            Ok(r) if r.status().is_redirection() => {
                return Err(DeliveryError::Redirected(r.status().as_u16()));
            }
            Ok(_) => return Ok(()),
            Err(e) => e,
        };
        if attempt >= w.retries {
            return Err(DeliveryError::Http(last));
        }
        if pause(backoff, stop) {
            return Err(DeliveryError::RetriesStopped { last });
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
        attempt += 1;
    }
}

/// A cgroup of its own for one alert command, where cgroup v2 is writable: `setsid` and
/// double forks cannot leave it, and `cgroup.kill` ends everything in it. `None` where it
/// cannot be made (no cgroup2, not root): the process group is the fallback.
fn command_cgroup() -> Option<vramguard_ops::cgroup::JobCgroup> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    static SWEPT: std::sync::Once = std::sync::Once::new();
    // An agent killed while a command ran (SIGKILL, a crash, outside systemd, which would
    // remove the unit's cgroups itself) left that command's empty cgroup behind.
    SWEPT.call_once(|| {
        let n = vramguard_ops::cgroup::remove_stale(ALERT_CGROUP_PREFIX);
        if n > 0 {
            tracing::info!("removed {n} empty alert-command cgroups a killed agent left");
        }
    });
    static SAID: std::sync::Once = std::sync::Once::new();
    let n = N.fetch_add(1, Ordering::Relaxed);
    match vramguard_ops::cgroup::JobCgroup::create(&format!(
        "{ALERT_CGROUP_PREFIX}{}-{n}",
        std::process::id()
    )) {
        Ok(cg) => Some(cg),
        Err(e) => {
            // Said once: commands then run in a process group of their own, which a command
            // that calls setsid can leave.
            SAID.call_once(|| {
                tracing::warn!(
                    "alert commands run without a cgroup of their own ({e}); a command that \
                     starts its own session outlives its time limit"
                )
            });
            None
        }
    }
}

/// Alert commands' cgroups are named `<this><agent pid>-<n>`.
const ALERT_CGROUP_PREFIX: &str = "vramguard-alert-";

/// Kills what an alert command started: its cgroup when it has one (then removed), else its
/// process group; reaps the command.
fn kill_command(
    child: &mut std::process::Child,
    cgroup: Option<&vramguard_ops::cgroup::JobCgroup>,
) {
    if let Some(cg) = cgroup {
        cg.kill();
    }
    // SAFETY: kill(2) on the process group the child leads; the child is not reaped yet,
    // so the group id cannot have been reused.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let _ = child.wait();
}

/// Whether `child` has exited, without reaping it (`waitid` with `WNOWAIT`).
fn has_exited_unreaped(child: &std::process::Child) -> bool {
    use rustix::process::{Pid, WaitId, WaitIdOptions, waitid};
    let Some(pid) = Pid::from_raw(child.id() as i32) else {
        return false;
    };
    matches!(
        waitid(
            WaitId::Pid(pid),
            WaitIdOptions::EXITED | WaitIdOptions::NOWAIT | WaitIdOptions::NOHANG,
        ),
        Ok(Some(_))
    )
}

fn exec(x: &Exec, n: &Notification, stop: &AtomicBool) -> Result<(), DeliveryError> {
    let cgroup = command_cgroup();
    let result = exec_in(x, n, stop, cgroup.as_ref());
    if let Some(cg) = &cgroup {
        // Whatever the command left behind (a `setsid` grandchild) ends with it.
        cg.kill();
        cg.wait_empty(Duration::from_secs(5));
        cg.remove();
    }
    result
}

fn exec_in(
    x: &Exec,
    n: &Notification,
    stop: &AtomicBool,
    cgroup: Option<&vramguard_ops::cgroup::JobCgroup>,
) -> Result<(), DeliveryError> {
    use std::os::unix::process::CommandExt;
    let procs = cgroup.map(|cg| {
        std::ffi::CString::new(cg.procs_file().into_os_string().into_encoded_bytes())
            .expect("no NUL in a cgroup path")
    });
    let mut cmd = Command::new(&x.argv[0]);
    // SAFETY: the closure runs between fork and exec and makes only async-signal-safe calls.
    unsafe {
        cmd.pre_exec(move || {
            if let Some(path) = &procs {
                let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::close(fd);
            }
            Ok(())
        });
    }
    let mut child = cmd
        .args(&x.argv[1..])
        .env("VRAMGUARD_ALERT_STATUS", n.status)
        .env("VRAMGUARD_ALERT_RULE", &n.rule)
        .env(
            "VRAMGUARD_ALERT_GPU",
            n.gpu.map(|g| g.to_string()).unwrap_or_default(),
        )
        .env("VRAMGUARD_ALERT_UUID", n.uuid.as_deref().unwrap_or(""))
        .env("VRAMGUARD_ALERT_HOST", n.host.as_deref().unwrap_or(""))
        .env("VRAMGUARD_ALERT_VALUE", n.value.to_string())
        .env("VRAMGUARD_ALERT_SUMMARY", &n.summary)
        .env(
            "VRAMGUARD_ALERT_STARTED_AT",
            vramguard_ops::audit::rfc3339(n.started_at_ms),
        )
        .env("VRAMGUARD_ALERT_JSON", body(n))
        .stdin(Stdio::null())
        // A group of its own: a timeout kills whatever the command started too.
        .process_group(0)
        .spawn()
        .map_err(|cause| DeliveryError::NotStarted {
            program: x.argv[0].clone(),
            cause,
        })?;
    let deadline = Instant::now() + x.timeout;
    let kill_group = |child: &mut std::process::Child| kill_command(child, cgroup);
    loop {
        if cgroup.is_none() && has_exited_unreaped(&child) {
            // Without a cgroup, what the command left in its group (a `cmd &`) ends with it:
            // while the exited leader is not reaped, its group id cannot name another group.
            // SAFETY: kill(2) of the group the unreaped child leads.
            unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
        }
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(DeliveryError::Failed(status)),
            Ok(None) if Instant::now() >= deadline => {
                kill_group(&mut child);
                return Err(DeliveryError::TimedOut(x.timeout));
            }
            Ok(None) if stop.load(Ordering::SeqCst) => {
                kill_group(&mut child);
                return Err(DeliveryError::Shutdown);
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(DeliveryError::Wait(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn notification() -> Notification {
        Notification {
            status: "firing",
            rule: "ghost".into(),
            gpu: Some(0),
            uuid: None,
            host: None,
            value: 1.0,
            summary: "test".into(),
            started_at_ms: 0,
            at_ms: 0,
        }
    }

    /// Red-team findings: a webhook's redirect was followed (the root agent sent to an
    /// internal address), and a failed delivery logged the whole URL with its token.
    #[test]
    fn a_webhook_redirect_is_not_followed_and_the_url_is_logged_without_its_token() {
        use std::io::{Read, Write};
        let internal = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        internal.set_nonblocking(true).unwrap();
        let receiver = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let to = format!("http://{}/latest/meta-data", internal.local_addr().unwrap());
        let url = format!(
            "http://{}/hook?token=s3cret",
            receiver.local_addr().unwrap()
        );
        let answer = std::thread::spawn(move || {
            let (mut c, _) = receiver.accept().unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            // The whole request (headers and body) is read before the answer: a socket closed
            // with unread bytes resets the connection, and the client saw a reset, not the
            // redirect (flaky under load).
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
                if let Some(end) = text.find("\r\n\r\n") {
                    let length = text
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if got.len() >= end + 4 + length {
                        break;
                    }
                }
                match c.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
            let _ = write!(
                c,
                "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        });
        let hook = Webhook {
            url: url.clone(),
            timeout: Duration::from_secs(5),
            retries: 0,
        };
        let r = post(&hook, &notification(), &AtomicBool::new(false));
        answer.join().unwrap();
        assert!(matches!(r, Err(DeliveryError::Redirected(302))), "{r:?}");
        assert!(internal.accept().is_err(), "the redirect was followed");
        let shown = url_host(&url);
        assert!(
            !shown.contains("s3cret") && !shown.contains("hook"),
            "{shown}"
        );
        assert_eq!(
            url_host("https://bot:pa55@hooks.example.com:8443/services/T0/B0/XyZ"),
            "https://hooks.example.com:8443"
        );
    }

    /// Red-team finding: without a cgroup, what a command that exited normally left in its
    /// process group ran on. It is killed with the group before the command is reaped.
    #[test]
    fn without_a_cgroup_what_a_command_left_in_its_group_ends_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("left");
        let x = Exec {
            argv: vec![
                "sh".into(),
                "-c".into(),
                "sleep 30 & echo $! > \"$0\"".into(),
                pid_file.display().to_string(),
            ],
            timeout: Duration::from_secs(10),
        };
        exec_in(&x, &notification(), &AtomicBool::new(false), None).unwrap();
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let gone = || {
            std::fs::read_to_string(format!("{}/{pid}/stat", vramguard_proc::OWN_PROC))
                .map_or(true, |s| {
                    s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z'))
                })
        };
        let ended = wait_for(2, gone);
        if !ended {
            // SAFETY: kill(2) of the sleep this test's command started, still running.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        assert!(ended, "the command's background child {pid} outlived it");
    }

    /// Red-team finding: a user toggling an orphan every sample made a rule fire and resolve
    /// twice a second; with a slow sink its 64-slot queue filled and a real alert of another
    /// rule was dropped. One slot per incident now: the flapping takes one, its latest state.
    #[test]
    fn a_flapping_rule_takes_one_slot_and_keeps_its_latest_state() {
        let q = Queue::default();
        let at = |status: &'static str, rule: &str, gpu: u32, t: u64| Notification {
            status,
            rule: rule.into(),
            gpu: Some(gpu),
            started_at_ms: t,
            at_ms: t,
            ..notification()
        };
        assert_eq!(q.push(at("firing", "orphan_holders", 0, 10)), Queued::Added);
        for t in 11..1000 {
            let status = if t % 2 == 0 { "firing" } else { "resolved" };
            assert_eq!(q.push(at(status, "orphan_holders", 0, t)), Queued::Replaced);
        }
        for gpu in 1..QUEUE as u32 {
            assert_eq!(q.push(at("firing", "ghost", gpu, 5)), Queued::Added);
        }
        // Full of distinct incidents: a new one is dropped, a newer state of one is not.
        assert_eq!(q.push(at("firing", "gpu_lost", 0, 7)), Queued::Dropped);
        assert_eq!(q.push(at("resolved", "ghost", 3, 8)), Queued::Replaced);
        q.close();
        let first = q.pop().unwrap();
        assert_eq!(
            (first.status, first.at_ms, first.started_at_ms),
            ("resolved", 999, 10)
        );
        let mut rest = 0;
        while let Some(n) = q.pop() {
            if n.gpu == Some(3) {
                assert_eq!(n.status, "resolved");
            }
            rest += 1;
        }
        assert_eq!(rest, QUEUE - 1);
    }

    /// A webhook receiver that accepts connections and never answers.
    fn black_hole() -> (std::net::TcpListener, String) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/hook", l.local_addr().unwrap());
        (l, url)
    }

    fn config(url: &str, argv: Vec<String>, exec_timeout: Duration) -> Arc<RwLock<AlertsConfig>> {
        Arc::new(RwLock::new(AlertsConfig {
            log: false,
            rules: vec![],
            webhooks: vec![Webhook {
                url: url.into(),
                timeout: Duration::from_secs(5),
                retries: 5,
            }],
            execs: vec![Exec {
                argv,
                timeout: exec_timeout,
            }],
        }))
    }

    fn wait_for(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(secs);
        while Instant::now() < until {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn a_webhook_that_never_answers_delays_neither_the_caller_nor_the_other_sinks() {
        let (_hole, url) = black_hole();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("ran");
        let argv = vec![
            "sh".into(),
            "-c".into(),
            format!("echo $VRAMGUARD_ALERT_RULE > {}", out.display()),
        ];
        let mut n = Notifier::start(config(&url, argv, Duration::from_secs(5)));
        let t = Instant::now();
        n.send(notification());
        assert!(
            t.elapsed() < Duration::from_millis(100),
            "send never blocks"
        );
        assert!(
            wait_for(3, || std::fs::read_to_string(&out)
                .is_ok_and(|s| s.trim() == "ghost")),
            "the command ran while the webhook hung"
        );
        // Shutdown is bounded although the webhook still hangs with retries left.
        let t = Instant::now();
        n.stop_within(Duration::from_millis(300));
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    }

    /// Runs `sh -c "<start> sleep 300 & echo $! > PIDFILE; wait"` as an alert command with a
    /// 300 ms timeout, and asserts the background sleep is gone after it (killed, then
    /// cleaned up by pid if not).
    fn assert_child_dies_with_a_timed_out_command(start: &str) {
        let (_hole, url) = black_hole();
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pid");
        let argv = vec![
            "sh".into(),
            "-c".into(),
            format!("{start}sleep 300 & echo $! > {}; wait", pidfile.display()),
        ];
        let mut n = Notifier::start(config(&url, argv, Duration::from_millis(300)));
        n.send(notification());
        assert!(wait_for(3, || std::fs::read_to_string(&pidfile)
            .is_ok_and(|s| !s.trim().is_empty())));
        let pid: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Gone once kill(pid, 0) finds no such process (init reaps the orphaned child).
        // SAFETY: signal 0 only checks that the pid exists.
        let gone = || unsafe { libc::kill(pid, 0) } != 0;
        let killed = wait_for(5, gone);
        if !killed {
            // SAFETY: kill(2) on the pid our own command started, to clean up.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        n.stop_within(Duration::from_millis(300));
        assert!(
            killed,
            "the command's child {pid} ({start:?}) outlived the timeout"
        );
    }

    #[test]
    fn a_setsid_grandchild_of_a_timed_out_command_is_killed_too() {
        // A new session and process group: only the command's cgroup still holds it.
        assert_child_dies_with_a_timed_out_command("setsid ");
    }

    #[test]
    fn a_command_that_times_out_is_killed_with_everything_it_started() {
        assert_child_dies_with_a_timed_out_command("");
    }
}
