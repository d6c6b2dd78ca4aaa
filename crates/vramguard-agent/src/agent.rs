//! The collector loop.
//!
//! One thread samples on its own schedule: a steady-state collection every `interval`, a
//! `/proc` listing every `discover_every`, a full fd scan every `full_scan_every` and whenever
//! a GPU shows unaccounted memory. While the last full sample left nothing undecided, a
//! sample only reads each GPU's used memory and keeps the last report until something changes
//! ([`Agent::quiet_sample`]). Between samples it sleeps in the node's wait on every GPU
//! holder's exit (a pidfd each) and a wake pipe for signals: when a holder exits, it samples
//! at once, so a ghost left by a kill shows within a second, and it watches that GPU's used memory every 20 ms until
//! the exited holder's memory is back, to measure the driver's release lag.

use crate::alerts::AlertEngine;
use crate::config::{AlertsConfig, Config};
use crate::heal::HealWatch;
use crate::history::History;
use crate::http::{Published, Server, Shared};
use crate::metrics::{Metrics, SampleFacts};
use crate::notify::Notifier;
use rustix::fd::{AsFd, OwnedFd};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use vramguard_core::plan::{ReclaimOptions, plan_reclaim};
use vramguard_core::release::ReleaseWatch;
use vramguard_core::report::{Class, Report, UnaccountedCause};
use vramguard_core::snapshot::{GpuSample, ProcessListState, Snapshot};
use vramguard_core::trend::Trend;
use vramguard_core::{Policy, classify};
use vramguard_node::{Node, NodeError, NodeFactory, SnapshotError};
use vramguard_ops::identity::Identity;
use vramguard_ops::reclaim::ReclaimOutcome;
use vramguard_ops::{AuditLog, ExecuteOptions, StopRequests};
use vramguard_proc::{ScanDepth, WorkSampler};

/// (GPU index, used bytes) of one holder on each GPU it uses.
type HeldMemory = Vec<(u32, Option<u64>)>;

/// Everything the agent needs from the command line.
pub struct AgentSetup {
    /// The config.
    pub config: Config,
    /// Where it came from (re-read on SIGHUP).
    pub config_path: Option<PathBuf>,
    /// Opens the node with a policy (once at the start, again after a reload that changed
    /// the policy, and once for each automatic reclaim, which runs on its own thread).
    pub make_node: NodeFactory,
    /// Set by the caller to stop the agent (tests); SIGTERM and SIGINT set it too.
    pub shutdown: Arc<AtomicBool>,
}

/// A holder whose exit is watched.
struct Watched {
    comm: Option<String>,
    /// (gpu, listed bytes) at the last sample.
    gpus: HeldMemory,
}

/// An exit whose memory is expected back.
struct PendingLag {
    watch: ReleaseWatch,
    exited: Instant,
    deadline: Instant,
}

struct Agent {
    make_node: NodeFactory,
    config: Config,
    node: Box<dyn Node>,
    metrics: Arc<Metrics>,
    history: History,
    alerts: AlertEngine,
    alerts_config: Arc<RwLock<AlertsConfig>>,
    notifier: Notifier,
    shared: Shared,
    started: Instant,
    last_discover: Instant,
    last_recheck: Instant,
    last_full: Option<Instant>,
    needs_full: bool,
    watched: HashMap<(u32, u64), Watched>,
    /// Holders seen exiting: never watched again (an unreaped zombie's pidfd stays readable).
    exited: BTreeSet<(u32, u64)>,
    pending: Vec<PendingLag>,
    /// (used, total) bytes per GPU at the last sample, used at least the bytes the driver
    /// listed: what an exit is measured against.
    last_used: BTreeMap<u32, (u64, u64)>,
    /// Trends from the last fit, and when it was.
    gpu_trends: BTreeMap<u32, Trend>,
    holder_trends: HashMap<(u32, u32, u64), Trend>,
    last_fit: Option<Instant>,
    reclaimable_since: HashMap<(u32, u64), (Class, Instant)>,
    reclaim_job: Option<Receiver<Result<ReclaimOutcome, AutoReclaimError>>>,
    /// An automatic reclaim panicked: none is started again until the agent restarts.
    reclaim_panicked: bool,
    /// SIGTERM and SIGINT, counted: an automatic reclaim running at shutdown finishes the
    /// decision it took on the first, and stops at once on the second.
    reclaim_stop: StopRequests,
    /// CPU and run-state history of the processes of jobs that are gone.
    work: WorkSampler,
    /// When they were last observed.
    last_observed: Option<Instant>,
    /// When the last collection succeeded.
    last_good: Option<Instant>,
    /// The Slurm heal's steps, followed in the audit log.
    heal: HealWatch,
    /// Device opens are watched (fanotify): a new holder wakes the loop, and the full scan
    /// can be rare.
    watching_opens: bool,
    /// Opens lost (a queue overflow): the next collection is a full scan.
    opens_lost: bool,
    /// When the last sample began: a sample asked for by an open waits until
    /// [`OPEN_SAMPLE_GAP`] after it.
    last_sample: Option<Instant>,
    /// When the sample that opens asked for is due; `None` when none is.
    open_sample_due: Option<Instant>,
    /// Why the open watch could not start, as last logged.
    open_watch_failure: Option<String>,
    /// The reset this agent lets go of the driver for, while the reset lock names one.
    reset_pause: Option<vramguard_ops::reset_lock::LockInfo>,
    /// This process's own `/proc`, where the reset lock's pid is checked.
    own_proc: Option<vramguard_proc::ProcFs>,
    /// How often the reset lock is looked at when nothing wakes the loop for it: `None` while
    /// its directory is watched (a new file there wakes the loop, see [`watch_reset_lock`]).
    reset_lock_poll: Option<Duration>,
    /// Set by the watch of the lock's directory when a file appears there: while it is
    /// watched, the directory is listed only then (and while paused), not at every turn of
    /// the loop. `None`: listed at every turn (no watch).
    reset_lock_seen: Option<Arc<LockWatch>>,
    /// A pause for a reset just ended: the next step samples at once.
    sample_now: bool,
    /// The node's name in the last good sample: the heal's alert names it while samples fail.
    last_hostname: Option<String>,
    /// What the last full sample left for quiet samples to compare with, when it left nothing
    /// undecided (see [`Agent::quiet_sample`]); `None` otherwise.
    calm: Option<Calm>,
    /// Something happened since the last full sample that it has not seen (an exit, a device
    /// open, a reload): the next sample is a full one.
    stirred: bool,
}

/// A full sample that left nothing undecided: every GPU read whole, every holder in a live
/// job or the system's, no ghost or unexplained memory, no alert pending or firing, automatic
/// reclaim off. Until something changes, its report still holds.
struct Calm {
    /// Per GPU, what the driver said then and the ghost bytes.
    gpus: BTreeMap<u32, (GpuSample, u64)>,
}

/// A period of the agent: the `configured` one, else `long` while `long_now`, else `short`.
fn period(
    configured: Option<Duration>,
    long_now: bool,
    long: Duration,
    short: Duration,
) -> Duration {
    configured.unwrap_or(if long_now { long } else { short })
}

/// The least time between two samples that opens of the device files ask for: an open is
/// seen within this, and a flood of opens (a `watch nvidia-smi`, a hostile loop) costs at most
/// one extra sample per gap.
const OPEN_SAMPLE_GAP: Duration = Duration::from_millis(250);

/// How often a paused agent looks at the reset lock again.
const RESET_PAUSE_POLL: Duration = Duration::from_millis(100);

/// The longest a running agent goes without looking at the reset lock.
const RESET_LOCK_CHECK: Duration = Duration::from_millis(250);

impl Agent {
    /// One collection, classification, and everything that follows from it.
    /// Now, on the node's clock.
    fn now(&self) -> Instant {
        self.node.clock().now()
    }

    /// How long ago `t` was, on the node's clock.
    fn since(&self, t: Instant) -> Duration {
        self.now().saturating_duration_since(t)
    }

    /// Whether a reset lock names a reset under way (see [`vramguard_ops::reset_lock`]): the
    /// agent then lets go of the driver, and takes it up again once the lock is gone, stale,
    /// or its process has exited.
    fn paused_for_reset(&mut self) -> bool {
        // A lock only begins with a new file in its directory, which the watch reports.
        if let Some(watch) = &self.reset_lock_seen {
            if watch.ended.load(Ordering::SeqCst) {
                tracing::warn!(
                    "the watch of the reset lock's directory ({}) ended (the directory was \
                     removed?): the lock is looked at every {:?}",
                    self.config.reclaim.reset_lock.display(),
                    RESET_LOCK_CHECK
                );
                self.reset_lock_seen = None;
                self.reset_lock_poll = Some(RESET_LOCK_CHECK);
            } else if !watch.seen.swap(false, Ordering::SeqCst) && self.reset_pause.is_none() {
                return false;
            }
        }
        let lock = self.own_proc.as_ref().and_then(|proc| {
            vramguard_ops::reset_lock::active(
                &self.config.reclaim.reset_lock,
                proc,
                self.node.clock().wall_ms(),
            )
        });
        match (lock, self.reset_pause.is_some()) {
            (Some(lock), false) => {
                tracing::info!(
                    pid = lock.pid,
                    gpu = lock.gpu,
                    "a GPU reset is under way: the driver is let go of until it ends"
                );
                self.node.release_driver();
                self.metrics.paused_for_reset(true);
                // Scrapes see the last published metrics: no sample publishes while paused.
                self.publish_metrics_only();
                self.reset_pause = Some(lock);
                true
            }
            (Some(_), true) => {
                // A reload meanwhile may have opened the node again.
                self.node.release_driver();
                true
            }
            (None, true) => {
                tracing::info!("the reset ended: sampling again");
                self.metrics.paused_for_reset(false);
                self.publish_metrics_only();
                self.reset_pause = None;
                // What changed meanwhile (the reset, its memory back) is read in full, now.
                self.needs_full = true;
                self.sample_now = true;
                false
            }
            (None, false) => false,
        }
    }

    fn sample(&mut self) {
        let t0 = self.now();
        self.last_sample = Some(t0);
        self.open_sample_due = None;
        let depth = self.depth_due();
        if depth == ScanDepth::Cached && self.quiet_sample(t0) {
            return;
        }
        self.stirred = false;
        self.calm = None;
        if depth.scans_every_process() && self.config.agent.watch_opens && !self.watching_opens {
            // Before the scan: an open during it (hundreds of ms on a busy node) is then seen
            // now, not at the next full scan.
            self.start_watching_opens();
        }
        // Unless shown, command lines are not even read (a config reload may turn them on).
        self.node.set_command_lines(self.config.agent.show_cmdline);
        let snap = match self.node.snapshot(depth) {
            Ok(s) => s,
            Err(e) => {
                let kind = match e {
                    NodeError::Snapshot(SnapshotError::Proc(_)) | NodeError::Proc(_) => "proc",
                    _ => "source",
                };
                self.metrics.error(kind);
                tracing::error!("collection failed: {e}");
                let age = self.last_good.map_or(0.0, |t| self.since(t).as_secs_f64());
                self.metrics.collection_failed(age);
                // A failed heal matters most when the GPUs cannot be read (a reset that left
                // the driver unable to answer): its steps are followed all the same.
                let host = self.last_hostname.clone();
                self.poll_heal(host.as_deref(), self.node.clock().wall_ms());
                self.publish_metrics_only();
                return;
            }
        };
        let now = self.now();
        match depth {
            ScanDepth::Full | ScanDepth::Thorough => {
                self.opens_lost = false;
                self.last_full = Some(now);
                self.last_discover = now;
                self.last_recheck = now;
            }
            ScanDepth::NewProcesses => {
                self.last_discover = now;
                self.last_recheck = now;
            }
            ScanDepth::Holders => self.last_recheck = now,
            ScanDepth::Cached => {}
        }
        for g in &snap.gpus {
            // A process list the driver would not give is a failed call too: that GPU's
            // holders are unknown for this sample.
            if g.failure.is_some() || matches!(g.process_list, ProcessListState::Unavailable { .. })
            {
                self.metrics.error("gpu_call");
            }
            for _ in &g.warnings {
                self.metrics.error("gpu_call");
            }
        }
        self.last_good = Some(self.now());
        let mut snap = snap;
        if !self.config.agent.show_cmdline {
            // What the HTTP side shows is built from this snapshot: command names only.
            for p in &mut snap.processes {
                p.cmdline = None;
            }
            for d in &mut snap.departed {
                d.cmdline = None;
            }
        }
        let mut report = classify(&snap, &self.config.policy);
        if self.attach_work(&mut snap, &report) {
            report = classify(&snap, &self.config.policy);
        }
        self.needs_full = report.gpus.iter().any(|g| {
            g.unaccounted
                .as_ref()
                .is_some_and(|u| u.significant && u.cause == Some(UnaccountedCause::Unknown))
        });
        let holder_trends = self.record_history(&report, false);
        let wall_ms = self.node.clock().wall_ms();
        self.last_hostname.clone_from(&report.hostname);
        self.poll_heal(report.hostname.as_deref(), wall_ms);
        let gpu_trends = &self.gpu_trends;
        for n in self.alerts.evaluate(&report, gpu_trends, wall_ms) {
            self.notifier.send(n);
        }
        let firing = self.alerts.firing();
        self.metrics.update(
            &report,
            &SampleFacts {
                duration_secs: self.since(t0).as_secs_f64(),
                depth: match depth {
                    ScanDepth::Full | ScanDepth::Thorough => "full",
                    ScanDepth::NewProcesses => "new_processes",
                    ScanDepth::Holders => "holders",
                    ScanDepth::Cached => "cached",
                },
                timestamp_secs: wall_ms as f64 / 1000.0,
                gpu_trends,
                holder_trends: &holder_trends,
                firing: &firing,
                top_holders: self.config.agent.top_holders,
                dcgm_labels: self.config.agent.dcgm_labels,
            },
        );
        self.watch_holders(&report);
        if self.config.reclaim.auto {
            self.track_reclaimable(&snap, &report);
        } else {
            // Not followed while off: a holder must be seen reclaimable for min_age once on.
            self.forget_reclaimable();
        }
        self.calm = self.calm_after(&snap, &report);
        self.publish(report, &firing);
        if depth.scans_every_process() {
            return_free_heap_pages();
        }
    }

    /// A sample that asks only the driver (no `/proc`), when the last full sample left
    /// nothing undecided ([`Calm`]) and nothing has happened since: no exit of a holder or of
    /// a process the collection follows (parents, job leaders), no device open, and the driver
    /// says what it said then ([`GpuSample::settled_alike`]: memory, process lists, Xid
    /// counts). The driver is asked only that ([`Node::settled_gpus`]: 7 of a full reading's
    /// ~27 calls per GPU, and no driver-wide call). Then the last report still holds, and
    /// classifying it again would only repeat it: the sample records the used memory, follows
    /// the heal, and publishes. Anything else, and every sample while automatic reclaim is
    /// on, is a full one; so is every sample a periodic re-read of the holders
    /// (`recheck_every`, 30 s while calm) is due, which bounds how stale what a quiet sample does not read (utilization,
    /// telemetry, retired pages and remapped rows, persistence) can be.
    /// Returns whether it was quiet.
    fn quiet_sample(&mut self, t0: Instant) -> bool {
        if self.stirred
            || self.config.reclaim.auto
            || !self.pending.is_empty()
            || self.calm.is_none()
        {
            return false;
        }
        if !self.node.nothing_exited() {
            return false;
        }
        // What the driver failed to answer is counted as a full sample counts it (a failed
        // call each): the full sample that follows asks again, and may be answered.
        let gpus = match self.node.settled_gpus() {
            Ok(g) => g,
            Err(_) => {
                self.metrics.error("source");
                return false;
            }
        };
        let mut faults = 0;
        for g in &gpus {
            if g.failure.is_some() || matches!(g.process_list, ProcessListState::Unavailable { .. })
            {
                faults += 1;
            }
            faults += g.warnings.len();
        }
        for _ in 0..faults {
            self.metrics.error("gpu_call");
        }
        let Some(calm) = &self.calm else {
            return false;
        };
        if faults > 0
            || gpus.len() != calm.gpus.len()
            || gpus.iter().any(|g| {
                calm.gpus
                    .get(&g.index)
                    .is_none_or(|(then, _)| !g.settled_alike(then))
            })
        {
            return false;
        }
        let Some(report) = self
            .shared
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .report
            .clone()
        else {
            return false;
        };
        let now = self.now();
        self.last_good = Some(now);
        let wall_ms = self.node.clock().wall_ms();
        // The series go on (the last report's values are today's), and the trends are
        // refitted when due: the slopes and the leak rule stay current.
        let fitted = self.last_fit;
        let holder_trends = self.record_history(&report, true);
        let host = self.last_hostname.clone();
        self.poll_heal(host.as_deref(), wall_ms);
        let (duration_secs, timestamp_secs) =
            (self.since(t0).as_secs_f64(), wall_ms as f64 / 1000.0);
        if self.last_fit != fitted {
            for n in self.alerts.evaluate(&report, &self.gpu_trends, wall_ms) {
                self.notifier.send(n);
            }
            let firing = self.alerts.firing();
            self.metrics.update(
                &report,
                &SampleFacts {
                    duration_secs,
                    depth: "quiet",
                    timestamp_secs,
                    gpu_trends: &self.gpu_trends,
                    holder_trends: &holder_trends,
                    firing: &firing,
                    top_holders: self.config.agent.top_holders,
                    dcgm_labels: self.config.agent.dcgm_labels,
                },
            );
            if !self.alerts.is_calm() {
                // A trend made a rule pending: full samples from the next one on.
                self.calm = None;
            }
        } else {
            self.metrics.quiet_collection(duration_secs, timestamp_secs);
        }
        self.republish(|old| Published {
            metrics: Some(self.metrics.clone()),
            report: old.report.clone(),
            timelines: Arc::new(self.history.timeline.clone()),
            firing: old.firing.clone(),
            refresh_secs: old.refresh_secs,
            updated: now,
            samples: old.samples + 1,
            stale_after: old.stale_after,
            ..Published::default()
        });
        true
    }

    /// What quiet samples compare with after this full sample's `report`, if it left nothing
    /// undecided.
    fn calm_after(&self, snap: &Snapshot, report: &Report) -> Option<Calm> {
        if self.config.reclaim.auto || !self.alerts.is_calm() {
            return None;
        }
        // A holder whose verdict needs no watching: computing, the system's, or an unlisted
        // holder of a live job (a DataLoader worker of a running trainer, a monitor) that no
        // plan would take.
        let settled = |h: &vramguard_core::report::Holder| match h.class {
            Class::Active | Class::System => true,
            Class::Hidden => h.dead_job.is_none() && !h.action.reclaimable,
            _ => false,
        };
        let mut gpus = BTreeMap::new();
        for g in &report.gpus {
            let whole = g.failure.is_none()
                && matches!(g.process_list, ProcessListState::Complete)
                && g.ghost_bytes == 0
                && g.unaccounted.as_ref().is_none_or(|u| !u.significant)
                && g.holders.iter().all(settled);
            let sample = snap.gpus.iter().find(|s| s.index == g.index)?;
            if !whole || g.memory.is_none() || !sample.warnings.is_empty() {
                return None;
            }
            gpus.insert(g.index, (sample.clone(), g.ghost_bytes));
        }
        Some(Calm { gpus })
    }

    /// Reads the Slurm heal's new steps from the audit log: notifications and metrics.
    fn poll_heal(&mut self, host: Option<&str>, wall_ms: u64) {
        match self.heal.poll(host, wall_ms) {
            Ok(notes) => notes.into_iter().for_each(|n| self.notifier.send(n)),
            Err(_) => self.metrics.error("audit_log"),
        }
        if self.heal.take_changed() {
            self.metrics.heal(&self.heal);
        }
    }

    /// How deep this collection must look: a full fd scan when one is due (or unaccounted
    /// memory asks for one), a /proc listing for new processes, a re-read of the holders, or
    /// what is cached.
    fn depth_due(&self) -> ScanDepth {
        let full_due = self
            .last_full
            .is_none_or(|t| self.since(t) >= self.full_scan_every())
            || ((self.needs_full || self.opens_lost)
                && self
                    .last_full
                    .is_none_or(|t| self.since(t) >= Duration::from_secs(10)));
        if full_due {
            ScanDepth::Full
        } else if self.since(self.last_discover) >= self.discover_every() {
            ScanDepth::NewProcesses
        } else if self.since(self.last_recheck) >= self.recheck_every() {
            ScanDepth::Holders
        } else {
            ScanDepth::Cached
        }
    }

    /// The `/proc` listing's period: the configured one, else long while nothing is undecided
    /// and opens are watched (a new holder is then seen by its open; one forked from a holder
    /// opens nothing, but its holder's job is alive, and its exit brings a full sample).
    fn discover_every(&self) -> Duration {
        period(
            self.config.agent.discover_every,
            self.calm.is_some() && self.watching_opens,
            vramguard_config::CALM_PERIOD,
            vramguard_config::DISCOVER_EVERY,
        )
    }

    /// The holders' re-read period: the configured one, else long while nothing is
    /// undecided (what it catches that no pidfd announces, a leader thread exiting while
    /// others live on, a process group changing, concerns no verdict there). It also bounds
    /// how old what quiet samples do not read (utilization, telemetry, memory health) gets.
    fn recheck_every(&self) -> Duration {
        period(
            self.config.agent.recheck_every,
            self.calm.is_some(),
            vramguard_config::CALM_PERIOD,
            vramguard_config::RECHECK_EVERY,
        )
    }

    /// The full fd scan's period: the configured one, else long while opens are watched.
    fn full_scan_every(&self) -> Duration {
        period(
            self.config.agent.full_scan_every,
            self.watching_opens,
            vramguard_config::FULL_SCAN_EVERY_WATCHED,
            vramguard_config::FULL_SCAN_EVERY,
        )
    }

    /// Starts watching the device files for opens, when the config asks for it; says once
    /// why not where it cannot.
    fn start_watching_opens(&mut self) {
        self.watching_opens = false;
        if !self.config.agent.watch_opens {
            self.node.unwatch_opens();
            self.metrics.open_watch(false);
            return;
        }
        match self.node.watch_opens() {
            Ok(files) => {
                self.watching_opens = true;
                self.open_watch_failure = None;
                tracing::info!(
                    files,
                    full_scan_every = ?self.full_scan_every(),
                    "watching the GPU device files for opens"
                );
            }
            Err(e) => {
                // Said once per different reason: the watch is tried again at each full scan
                // (device files that appear after boot, a driver loaded late).
                let why = e.to_string();
                if self.open_watch_failure.as_deref() != Some(why.as_str()) {
                    tracing::warn!("{why} (full fd scan every {:?})", self.full_scan_every());
                    self.open_watch_failure = Some(why);
                }
            }
        }
        self.metrics.open_watch(self.watching_opens);
    }

    /// Feeds this sample into the trend and timeline history, refits the trends when a bucket
    /// closed, forgets holders that are gone; returns the holder trends to export, by (gpu, pid).
    /// A `quiet` sample's report is the last full sample's, whose holders were already
    /// pruned against: unless the trends were refitted (and so are exported), it records the
    /// points only, and returns no trends.
    fn record_history(&mut self, report: &Report, quiet: bool) -> BTreeMap<(u32, u32), Trend> {
        let t = self.since(self.started).as_secs_f64();
        let (trend_window, timeline) = (
            self.config.agent.trend_window.as_secs_f64(),
            self.config.agent.timeline.as_secs_f64(),
        );
        let min_span = (trend_window / 10.0).clamp(10.0, 300.0);
        // A fit moves only when a bucket of the series closes: refit at that pace, not at
        // every sample.
        let refit = self
            .last_fit
            .is_none_or(|at| self.since(at).as_secs_f64() >= trend_window / 240.0);
        if refit {
            self.gpu_trends.clear();
            self.holder_trends.clear();
            self.last_fit = Some(self.now());
        }
        for g in &report.gpus {
            if let Some(m) = g.memory {
                self.history
                    .record_gpu(g.index, t, m.used, g.ghost_bytes, trend_window, timeline);
                // The process list is read after the memory: a holder that allocated in
                // between is listed with bytes `used` does not count yet. The listed bytes
                // are then the better floor for what its exit must give back.
                let listed: u64 = g.holders.iter().filter_map(|h| h.used_bytes).sum();
                self.last_used
                    .insert(g.index, (m.used.max(listed), m.total));
            }
            if refit
                && let Some(tr) = self
                    .history
                    .gpu_used
                    .get(&g.index)
                    .and_then(|s| s.trend(min_span))
            {
                self.gpu_trends.insert(g.index, tr);
            }
            for h in g.holders.iter().take(self.config.agent.top_holders) {
                if let (Some(b), Some(start)) = (h.used_bytes, h.start_ticks) {
                    let key = (g.index, h.pid, start);
                    self.history.record_holder(key, t, b, trend_window);
                    if refit
                        && let Some(tr) = self
                            .history
                            .holder_used
                            .get(&key)
                            .and_then(|s| s.trend(min_span))
                    {
                        self.holder_trends.insert(key, tr);
                    }
                }
            }
        }
        if quiet && !refit {
            return BTreeMap::new();
        }
        // Exported under (gpu, pid) for the holders of this sample only.
        let holder_trends: BTreeMap<(u32, u32), Trend> = report
            .holders()
            .filter_map(|(gpu, h)| {
                let tr = self.holder_trends.get(&(gpu, h.pid, h.start_ticks?))?;
                Some(((gpu, h.pid), *tr))
            })
            .collect();
        // A holder that is gone has no trend worth keeping: under churn, keeping its series
        // for a whole trend window made the agent grow for that long.
        let present: std::collections::HashSet<(u32, u32, u64)> = report
            .holders()
            .filter_map(|(gpu, h)| Some((gpu, h.pid, h.start_ticks?)))
            .collect();
        self.history.prune(t, trend_window, &present);
        self.holder_trends.retain(|k, _| present.contains(k));
        holder_trends
    }

    /// Observes the processes of jobs that are gone (at most once a second: CPU time is
    /// cumulative, so sparser observations still cover every moment) and attaches the window
    /// of work the history covers: whether such a holder is `orphan` or `detached` rests on
    /// it, and an automatic reclaim needs it `orphan` in every sample for `min_age`. Returns
    /// whether a window was attached.
    fn attach_work(&mut self, snap: &mut Snapshot, report: &Report) -> bool {
        let now = self.node.clock().wall_ms();
        let every = OBSERVE_EVERY.max(self.config.agent.interval);
        let window_ms = self.config.reclaim.sample.max(every * 3).as_millis() as u64;
        self.work.forget_before(now.saturating_sub(window_ms));
        let watch = watch_for(&self.config);
        let roots = vramguard_core::classify::work_roots(snap, &self.config.policy, report, watch);
        if roots.is_empty() {
            return false;
        }
        // The holders' children that hold no device file are not in a collection: read them,
        // or their work goes unseen and a busy job reads as idle.
        if let Err(e) = self.node.add_descendants(snap, &roots) {
            tracing::warn!("reading the descendants of holders whose job is gone: {e}");
            return false;
        }
        if !self.config.agent.show_cmdline {
            for p in &mut snap.processes {
                p.cmdline = None;
            }
        }
        let pids = vramguard_core::work_watch_list(snap, &self.config.policy, report, watch);
        if pids.is_empty() {
            return false;
        }
        if self.last_observed.is_none_or(|t| self.since(t) >= every) {
            if let Err(e) = self.node.observe_work(&mut self.work, &pids) {
                tracing::warn!("observing work: {e}");
                return false;
            }
            self.last_observed = Some(self.now());
        }
        snap.work = Some(self.work.window(now.saturating_sub(window_ms), now));
        snap.normalize();
        true
    }

    /// Replaces what the HTTP side serves with what `next` makes of the current one. When the
    /// current one was scraped, the metrics are rendered here, before the swap: scrapers that
    /// come at every sample (a dashboard, a benchmark) find them ready, as they did when every
    /// sample rendered them; an agent scraped every 15 s renders once per scrape.
    fn republish(&self, next: impl FnOnce(&Published) -> Published) {
        let old = self
            .shared
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let next = next(&old);
        if old.scraped.load(std::sync::atomic::Ordering::Relaxed) {
            next.prerender();
        }
        *self.shared.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
    }

    fn publish_metrics_only(&self) {
        self.republish(|old| Published {
            metrics: Some(self.metrics.clone()),
            report: old.report.clone(),
            timelines: old.timelines.clone(),
            firing: old.firing.clone(),
            refresh_secs: old.refresh_secs,
            updated: old.updated,
            samples: old.samples,
            stale_after: old.stale_after,
            ..Published::default()
        });
    }

    fn publish(&self, report: Report, firing: &[(String, u32)]) {
        let updated = self.now();
        self.republish(|old| Published {
            metrics: Some(self.metrics.clone()),
            report: Some(Arc::new(report)),
            timelines: Arc::new(self.history.timeline.clone()),
            firing: firing.to_vec(),
            refresh_secs: self.config.agent.interval.as_secs().clamp(2, 30),
            updated,
            samples: old.samples + 1,
            stale_after: (self.config.agent.interval * 5).max(Duration::from_secs(10)),
            ..Published::default()
        });
    }

    /// Has the node watch every holder, to wake at its exit.
    fn watch_holders(&mut self, report: &Report) {
        let mut present: BTreeSet<(u32, u64)> = BTreeSet::new();
        let mut per_holder: HashMap<(u32, u64), (Option<String>, HeldMemory)> = HashMap::new();
        for (gpu, h) in report.holders() {
            let Some(start) = h.start_ticks else { continue };
            if matches!(h.class, Class::Foreign | Class::System | Class::Exited) {
                continue;
            }
            let key = (h.pid, start);
            present.insert(key);
            let e = per_holder
                .entry(key)
                .or_insert((h.comm.clone(), Vec::new()));
            e.1.push((gpu, h.used_bytes));
        }
        self.watched.retain(|k, _| present.contains(k));
        self.exited.retain(|k| present.contains(k));
        for (key, (comm, gpus)) in per_holder {
            if self.exited.contains(&key) {
                continue;
            }
            match self.watched.get_mut(&key) {
                Some(w) => w.gpus = gpus,
                None => {
                    self.watched.insert(key, Watched { comm, gpus });
                }
            }
        }
        let ids: Vec<Identity> = self
            .watched
            .keys()
            .map(|&(pid, start_ticks)| Identity { pid, start_ticks })
            .collect();
        self.node.watch_exits(&ids);
    }

    /// Sleeps until `deadline` (the node's clock), a holder's exit, or the wake pipe;
    /// returns the exits, timed by the node.
    fn wait(&mut self, deadline: Instant, wake: &OwnedFd) -> Vec<(u32, Watched, Instant)> {
        // Once a sample is due for opens, more opens need not wake the loop: they are read
        // at the next wait after that sample.
        let opens = self.open_sample_due.is_none();
        let gone = self.node.wait_watched(deadline, Some(wake.as_fd()), opens);
        // The pipe is non-blocking: empty it whether or not it woke the wait.
        let mut buf = [0u8; 64];
        while matches!(rustix::io::read(wake, &mut buf), Ok(n) if n > 0) {}
        let mut exits = Vec::new();
        for (id, at) in gone {
            let key = (id.pid, id.start_ticks);
            if let Some(w) = self.watched.remove(&key) {
                self.exited.insert(key);
                exits.push((id.pid, w, at));
            }
        }
        exits
    }

    /// One turn of the loop, on the node's clock: the sample when `next` is due, then the
    /// wait for the next one, a holder's exit or the wake pipe, then the exits and the
    /// release lags they started. Returns when the next sample is due.
    fn step(&mut self, mut next: Instant, wake: &OwnedFd) -> Instant {
        if self.paused_for_reset() {
            // No driver call while another vramguard process resets a GPU: the reset is
            // refused while this process holds it. Looked at again shortly; a signal's wake-up
            // byte is taken (the run loop acts on the signal), else the poll would spin.
            let _ = rustix::event::poll(
                &mut [rustix::event::PollFd::new(
                    wake,
                    rustix::event::PollFlags::IN,
                )],
                Some(&rustix::event::Timespec {
                    tv_sec: 0,
                    tv_nsec: RESET_PAUSE_POLL.as_nanos() as i64,
                }),
            );
            let mut drain = [0u8; 64];
            while matches!(rustix::io::read(wake, &mut drain), Ok(n) if n > 0) {}
            return next;
        }
        if std::mem::take(&mut self.sample_now) {
            next = next.min(self.now());
        }
        if self.now() >= next {
            self.sample();
            next = self.now() + self.config.agent.interval;
        }
        let until = if self.pending.is_empty() {
            next
        } else {
            next.min(self.now() + Duration::from_millis(20))
        };
        // Where the lock's directory cannot be watched, it is looked at within
        // RESET_LOCK_CHECK however long the interval: the resetter waits for this process to
        // let go (at most RESET_WAIT, 10 s).
        let until = match self.reset_lock_poll {
            Some(every) => until.min(self.now() + every),
            None => until,
        };
        let exits = self.wait(until, wake);
        if !exits.is_empty() {
            self.stirred = true;
            self.on_exits(exits);
            // A kill may have left a ghost: report it now, not at the next tick.
            next = self.now();
        }
        let opened = self.node.take_opens();
        if opened.overflowed {
            self.opens_lost = true;
        }
        if let Some(e) = opened.stopped {
            self.watching_opens = false;
            self.metrics.open_watch(false);
            tracing::warn!(
                "reading device opens failed ({e}): no longer watched; full fd scans every {:?}",
                self.full_scan_every()
            );
        }
        if let Some((file, e)) = opened.unmarked {
            // Said once per file and reason: the files are marked again at every listing.
            let why = format!(
                "cannot watch {} for opens (fanotify_mark: {e}): its new holders are found by \
                 full fd scans only, every {:?}",
                vramguard_core::sanitize::shown(&file.display().to_string()),
                self.full_scan_every()
            );
            if self.open_watch_failure.as_deref() != Some(why.as_str()) {
                tracing::warn!("{why}");
                self.open_watch_failure = Some(why);
            }
        }
        if !opened.pids.is_empty() || opened.overflowed {
            self.stirred = true;
            self.metrics.device_opens(opened.pids.len() as u64);
            // A new holder: sample soon, at most once per gap however many opens come.
            let soon = self
                .last_sample
                .map_or(self.now(), |t| t + OPEN_SAMPLE_GAP)
                .max(self.now());
            self.open_sample_due = Some(soon);
        }
        if let Some(due) = self.open_sample_due {
            next = next.min(due);
        }
        if !self.pending.is_empty() && self.poll_lags() {
            // Memory came back: sample now, so the ghost and the lag are exported together.
            next = self.now();
        }
        next
    }

    /// Starts measuring the release of exited holders' memory.
    fn on_exits(&mut self, exits: Vec<(u32, Watched, Instant)>) {
        for (pid, w, at) in exits {
            tracing::debug!(pid, comm = ?w.comm, "GPU holder exited");
            for (gpu, bytes) in w.gpus {
                let (Some(bytes), Some((used, total))) = (bytes, self.last_used.get(&gpu).copied())
                else {
                    continue;
                };
                if bytes == 0 {
                    continue;
                }
                self.pending.push(PendingLag {
                    watch: ReleaseWatch::new(gpu, total, used, bytes, &self.config.policy),
                    exited: at,
                    deadline: at + Duration::from_secs(120),
                });
            }
        }
    }

    /// Checks the GPUs with pending releases; true when one ended (the memory came back, or
    /// the wait timed out): the GPU changed, and the metrics should say so.
    fn poll_lags(&mut self) -> bool {
        let before = self.pending.len();
        let gpus: BTreeSet<u32> = self.pending.iter().map(|p| p.watch.gpu).collect();
        let now = self.now();
        for gpu in gpus {
            let used = match self.node.memory_used(gpu) {
                Ok(u) => u,
                Err(_) => continue,
            };
            let metrics = &self.metrics;
            self.pending.retain_mut(|p| {
                if p.watch.gpu != gpu {
                    return true;
                }
                let after = now.saturating_duration_since(p.exited);
                if p.watch.observe(used, after.as_millis() as u64) {
                    metrics.release_lag(gpu, after.as_secs_f64());
                    false
                } else if now >= p.deadline {
                    metrics.release_timeout(gpu);
                    false
                } else {
                    true
                }
            });
        }
        self.pending.len() < before
    }

    /// Why `config`'s automatic reclaim cannot run on this node (it signals nothing), if it is
    /// on and cannot.
    fn auto_reclaim_refused(&self, config: &Config) -> Option<String> {
        config
            .reclaim
            .auto
            .then(|| self.node.signals_refused())
            .flatten()
    }

    /// Forgets since when holders have been reclaimable: `min_age` must be seen whole again.
    /// (After failed collections or a gap in sampling, the first sample has no window of work
    /// for them: they leave the plan, and their `min_age` starts again that way.)
    fn forget_reclaimable(&mut self) {
        self.reclaimable_since.clear();
    }

    fn track_reclaimable(&mut self, snap: &Snapshot, report: &Report) {
        let now = self.now();
        let rc = &self.config.reclaim;
        let opts = ReclaimOptions {
            gpus: None,
            include: rc.include.iter().copied().collect(),
            idle_for_secs: 0,
            mig_devices: None,
            job_of: None,
            job_label: None,
            // The agent never removes files on its own: shared memory goes by `reclaim --include shm`.
            include_shm: None,
            include_keepers: false,
        };
        let plan = plan_reclaim(snap, report, &opts);
        let current: BTreeMap<(u32, u64), Class> = plan
            .targets()
            .map(|t| ((t.pid, t.start_ticks), t.class))
            .collect();
        // By class too: a holder that was an orphan for a while and is idle now has been
        // idle only since it became so (red team: its orphan time counted for idle_after).
        self.reclaimable_since
            .retain(|k, (class, _)| current.get(k) == Some(class));
        for (k, class) in &current {
            self.reclaimable_since.entry(*k).or_insert((*class, now));
        }
        if !rc.auto || self.reclaim_job.is_some() || self.reclaim_panicked {
            return;
        }
        // An idle holder of a live job is taken only once this agent has itself seen it idle
        // in every sample for idle_after: the driver's per-process samples may reach back less
        // far than the idle window, and a job that computed a few minutes ago is not idle.
        let idle_after = Duration::from_secs(self.config.policy.idle_after_secs);
        let eligible: BTreeSet<(u32, u64)> = self
            .reclaimable_since
            .iter()
            .filter(|(k, (_, since))| {
                let seen = now.saturating_duration_since(*since);
                seen >= rc.min_age && (current.get(k) != Some(&Class::Idle) || seen >= idle_after)
            })
            .map(|(k, _)| *k)
            .collect();
        if eligible.is_empty() {
            return;
        }
        let (tx, rx) = channel();
        let make_node = self.make_node.clone();
        let (policy, rc) = (self.config.policy.clone(), rc.clone());
        let host = report.hostname.clone().unwrap_or_default();
        let stop = self.reclaim_stop.clone();
        let spawned = std::thread::Builder::new()
            .name("vramguard-reclaim".into())
            .spawn(move || {
                // A panic is a result too: the agent hears of it and stops reclaiming on its
                // own, instead of waiting for a result that never comes.
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    auto_reclaim(&make_node, &policy, &rc, &host, &eligible, &stop)
                }))
                .unwrap_or_else(|panic| {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "no message".into());
                    Err(AutoReclaimError::Panicked(what))
                });
                let _ = tx.send(r);
            });
        match spawned {
            Ok(_) => self.reclaim_job = Some(rx),
            Err(e) => self.record_reclaim(Err(AutoReclaimError::Thread(e))),
        }
    }

    fn collect_reclaim(&mut self) {
        let Some(rx) = &self.reclaim_job else { return };
        let Ok(result) = rx.try_recv() else { return };
        self.reclaim_job = None;
        self.record_reclaim(result);
    }

    /// At shutdown: an automatic reclaim still running is finished, not cut off by the exit
    /// (its targets sent SIGTERM get SIGKILL at the end of the grace period, and its result is
    /// logged); a second SIGTERM stops it at once with an `interrupted` record.
    fn finish_reclaim(&mut self) {
        let Some(rx) = self.reclaim_job.take() else {
            return;
        };
        if self.reclaim_stop.count() == 0 {
            // Stopped through `AgentSetup::shutdown`, not a signal.
            self.reclaim_stop.request();
        }
        tracing::warn!(
            "an automatic reclaim is running: finishing it before stopping (targets sent \
             SIGTERM get SIGKILL at the end of the grace period; a second SIGTERM stops it at once)"
        );
        if let Ok(result) = rx.recv() {
            self.record_reclaim(result);
        }
    }

    /// Counts and logs what an automatic reclaim did.
    fn record_reclaim(&mut self, result: Result<ReclaimOutcome, AutoReclaimError>) {
        match result {
            Ok(outcome) => {
                let term = outcome
                    .targets
                    .iter()
                    .filter(|t| t.signals.iter().any(|s| s == "TERM"))
                    .count();
                let kill = outcome
                    .targets
                    .iter()
                    .filter(|t| t.signals.iter().any(|s| s == "KILL"))
                    .count();
                let skipped = outcome
                    .targets
                    .iter()
                    .filter(|t| t.signals.is_empty())
                    .count();
                self.metrics.reclaim("term", term as u64);
                self.metrics.reclaim("kill", kill as u64);
                self.metrics.reclaim("skipped", skipped as u64);
                self.metrics.reclaim(
                    "reset",
                    outcome.resets.iter().filter(|r| r.attempted).count() as u64,
                );
                for r in &outcome.releases {
                    self.metrics.reclaimed(r.gpu, r.freed_bytes);
                }
                tracing::warn!(
                    targets = outcome.targets.len(),
                    freed = outcome.releases.iter().map(|r| r.freed_bytes).sum::<u64>(),
                    run = %outcome.run_id,
                    "automatic reclaim done"
                );
            }
            Err(e) => {
                self.metrics.error("reclaim");
                if matches!(e, AutoReclaimError::Panicked(_)) {
                    self.reclaim_panicked = true;
                }
                tracing::error!("automatic reclaim failed: {e}");
            }
        }
    }

    fn reload(&mut self, path: Option<&std::path::Path>) {
        match Config::load(path) {
            Ok(loaded) => {
                if let Some(note) = &loaded.note {
                    tracing::warn!("{note}");
                }
                let mut c = loaded.config;
                // The reset lock is the one the agent started with (a simulated node's lies
                // beside its state, which the file does not say): a new one takes effect at
                // the next restart, as a new listen address does.
                if c.reclaim.reset_lock != self.config.reclaim.reset_lock
                    && c.reclaim.reset_lock.as_os_str()
                        != vramguard_ops::reset_lock::DEFAULT_RESET_LOCK
                {
                    tracing::warn!(
                        "a new reset lock ({}) takes effect at the next restart",
                        c.reclaim.reset_lock.display()
                    );
                }
                c.reclaim.reset_lock = self.config.reclaim.reset_lock.clone();
                self.stirred = true;
                if let Some(why) = self.auto_reclaim_refused(&c) {
                    tracing::error!(
                        "config reload refused, keeping the running config: {}",
                        AgentError::AutoReclaimRefused(why)
                    );
                    return;
                }
                let mut reopened = false;
                let rewatch = c.agent.watch_opens != self.config.agent.watch_opens;
                if c.agent.listen != self.config.agent.listen {
                    tracing::warn!(
                        "a new listen address ({}) takes effect at the next restart",
                        c.agent.listen
                    );
                }
                self.alerts.set_rules(&c.alerts);
                if c.reclaim.audit_log != self.config.reclaim.audit_log {
                    // The counters go on from what they counted; the new log's state is shown.
                    let counts = std::mem::take(&mut self.heal.counts);
                    let wall_ms = self.node.clock().wall_ms();
                    let next = HealWatch::start(&c.reclaim.audit_log);
                    if !next.failing()
                        && let Some(n) = self
                            .heal
                            .stop_following(self.last_hostname.as_deref(), wall_ms)
                    {
                        self.notifier.send(n);
                    }
                    self.heal = next;
                    self.heal.counts = counts;
                    // Drawn from the new log's state, even when it holds no heal step.
                    self.metrics.heal(&self.heal);
                }
                *self.alerts_config.write().expect("alerts config") = c.alerts.clone();
                if c.policy != self.config.policy || c.reclaim != self.config.reclaim {
                    // Time counted towards min_age under the old rules proves nothing under
                    // the new ones (a stricter work threshold, a longer min_age): it starts
                    // again.
                    if !self.reclaimable_since.is_empty() {
                        tracing::info!(
                            holders = self.reclaimable_since.len(),
                            "the policy or [reclaim] changed: min_age is counted again"
                        );
                    }
                    self.forget_reclaimable();
                }
                if c.policy != self.config.policy {
                    // The node asks the driver for utilisation over the policy's idle window.
                    match (self.make_node)(&c.policy) {
                        Ok(node) => {
                            self.node = node;
                            reopened = true;
                        }
                        Err(e) => tracing::error!("reopening the node with the new policy: {e}"),
                    }
                }
                // The listen address and the web config are the server's, read at start.
                let listen = self.config.agent.listen.clone();
                let web_config = self.config.agent.web_config.clone();
                if c.agent.web_config != web_config {
                    // TLS and the users are the server's, set up at start.
                    tracing::warn!(
                        "the web config (TLS, basic_auth_users) is read at start: restart the \
                         agent for a change of web_config, or of the file, to take effect"
                    );
                }
                self.config = c;
                self.config.agent.listen = listen;
                self.config.agent.web_config = web_config;
                if reopened || rewatch {
                    self.start_watching_opens();
                }
                tracing::info!("config reloaded");
            }
            Err(e) => tracing::error!("config reload failed, keeping the running config: {e}"),
        }
    }
}

/// Why the agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The web config is unusable.
    #[error(transparent)]
    WebConfig(#[from] crate::web::WebConfigError),
    /// The listen address could not be bound.
    #[error("listening on {listen}: {cause} (is another agent running? choose [agent] listen)")]
    Listen {
        /// `[agent] listen`.
        listen: String,
        /// Why.
        cause: std::io::Error,
    },
    /// A part of the agent could not be started.
    #[error("starting {what}: {cause}")]
    Start {
        /// Which part.
        what: &'static str,
        /// Why.
        cause: std::io::Error,
    },
    /// The node could not be opened.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// `[reclaim] auto` on a node through which nothing may be signalled.
    #[error(
        "[reclaim] auto = true cannot run here: {0}; turn it off, or run the agent on the \
         default /proc"
    )]
    AutoReclaimRefused(String),
}

impl AgentError {
    /// `Start` for `what`, to map an I/O error with.
    pub fn starting(what: &'static str) -> impl Fn(std::io::Error) -> AgentError {
        move |cause| AgentError::Start { what, cause }
    }
}

/// Why an automatic reclaim did not run to the end.
#[derive(Debug, thiserror::Error)]
pub enum AutoReclaimError {
    /// The node could not be opened or read.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The audit log could not be opened: nothing was signalled.
    #[error("{0}; nothing was signalled")]
    Audit(#[from] vramguard_ops::audit::AuditError),
    /// The executor stopped.
    #[error(transparent)]
    Execute(#[from] vramguard_ops::reclaim::ExecuteError),
    /// The reclaim thread panicked (a bug): automatic reclaim stays off until the agent
    /// restarts; the audit log says what was signalled before.
    #[error(
        "the automatic reclaim panicked ({0}): automatic reclaim is off until the agent \
         restarts; the audit log says what was signalled"
    )]
    Panicked(String),
    /// The reclaim thread could not be started: tried again at the next sample.
    #[error("starting the reclaim thread: {0}; nothing was signalled")]
    Thread(std::io::Error),
}

/// The agent's automatic reclaim, on a node of its own: the same pipeline as `vramguard
/// reclaim`, narrowed to the targets that stayed reclaimable for `min_age`.
fn auto_reclaim(
    make_node: &NodeFactory,
    policy: &Policy,
    rc: &crate::config::ReclaimConfig,
    host: &str,
    eligible: &BTreeSet<(u32, u64)>,
    stop: &StopRequests,
) -> Result<ReclaimOutcome, AutoReclaimError> {
    let mut node = make_node(policy)?;
    let opts = ReclaimOptions {
        gpus: None,
        include: rc.include.iter().copied().collect(),
        idle_for_secs: 0,
        mig_devices: None,
        job_of: None,
        job_label: None,
        include_shm: None,
        include_keepers: false,
    };
    let plan = |snap: &vramguard_core::Snapshot, report: &Report| {
        let mut plan = plan_reclaim(snap, report, &opts);
        // Only targets that have been reclaimable for min_age, re-checked from this snapshot.
        plan.retain_targets(report, |t| eligible.contains(&(t.pid, t.start_ticks)));
        plan
    };
    let prepared = vramguard_ops::prepare(node.as_mut(), policy, rc.sample, plan)?;
    let mut audit = AuditLog::open(&rc.audit_log, host)?;
    // An audit log on slow storage can take long to open: a plan older than the CLI's
    // freshness limit is made again from a new sample, keeping only the targets it had.
    let (prepared, _dropped) = prepared.refreshed(node.as_mut(), plan)?;
    Ok(prepared.run_observed(
        node.as_mut(),
        &mut audit,
        &ExecuteOptions::new(rc.grace, rc.release_timeout, rc.reset)
            .with_reset_lock(&rc.reset_lock),
        &mut (),
        stop,
    )?)
}

impl Agent {
    /// An agent on a node opened from `setup`, publishing into `shared`.
    fn new(setup: &AgentSetup, shared: Shared) -> Result<Agent, NodeError> {
        let node = (setup.make_node)(&setup.config.policy)?;
        let alerts_config = Arc::new(RwLock::new(setup.config.alerts.clone()));
        let now = node.clock().now();
        Ok(Agent {
            make_node: setup.make_node.clone(),
            node,
            metrics: {
                let mut m = Metrics::new();
                m.track_own_heap();
                m.track_open_watch();
                m.track_reset_pause();
                Arc::new(m)
            },
            history: History::default(),
            alerts: AlertEngine::new(&setup.config.alerts),
            notifier: Notifier::start(alerts_config.clone()),
            alerts_config,
            shared,
            started: now,
            last_discover: now,
            last_recheck: now,
            last_full: None,
            needs_full: false,
            watched: HashMap::new(),
            exited: BTreeSet::new(),
            pending: Vec::new(),
            last_used: BTreeMap::new(),
            gpu_trends: BTreeMap::new(),
            holder_trends: HashMap::new(),
            last_fit: None,
            reclaimable_since: HashMap::new(),
            reclaim_panicked: false,
            reclaim_job: None,
            reclaim_stop: StopRequests::new(),
            work: WorkSampler::new(),
            last_observed: None,
            last_good: None,
            heal: HealWatch::start(&setup.config.reclaim.audit_log),
            config: setup.config.clone(),
            watching_opens: false,
            opens_lost: false,
            last_sample: None,
            open_sample_due: None,
            open_watch_failure: None,
            reset_pause: None,
            own_proc: vramguard_proc::ProcFs::own().ok(),
            reset_lock_poll: None,
            reset_lock_seen: None,
            sample_now: false,
            last_hostname: None,
            calm: None,
            stirred: false,
        })
    }
}

/// How often the agent observes the processes of jobs that are gone.
const OBSERVE_EVERY: Duration = Duration::from_secs(1);

/// A running agent's HTTP address, for callers that bound port 0.
pub type BoundAddr = Arc<RwLock<Option<std::net::SocketAddr>>>;

/// Runs the agent until SIGTERM/SIGINT (or `setup.shutdown`). SIGHUP reloads the config.
pub fn run(setup: AgentSetup, bound: Option<BoundAddr>) -> Result<(), AgentError> {
    let (wake_rx, wake_tx) = rustix::pipe::pipe_with(
        rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK,
    )
    .map_err(|e| AgentError::starting("the wake pipe")(e.into()))?;
    let wake_tx = Arc::new(wake_tx);
    let reload = Arc::new(AtomicBool::new(false));
    let shutdown = setup.shutdown.clone();
    let reclaim_stop = StopRequests::new();
    let mut signals = signal_hook::iterator::Signals::new([
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
    ])
    .map_err(AgentError::starting("the signal handlers"))?;
    let signals_handle = signals.handle();
    {
        let (reload, shutdown, wake_tx) = (reload.clone(), shutdown.clone(), wake_tx.clone());
        let reclaim_stop = reclaim_stop.clone();
        std::thread::Builder::new()
            .name("vramguard-signals".into())
            .spawn(move || {
                for sig in signals.forever() {
                    match sig {
                        signal_hook::consts::SIGHUP => reload.store(true, Ordering::SeqCst),
                        _ => {
                            shutdown.store(true, Ordering::SeqCst);
                            reclaim_stop.request();
                        }
                    }
                    let _ = rustix::io::write(&*wake_tx, b"x");
                }
            })
            .map_err(AgentError::starting("the signal thread"))?;
    }

    let shared: Shared = Arc::new(RwLock::new(Arc::new(Published::default())));
    // Before anything listens: a config that cannot run is refused at once.
    let mut agent = Agent::new(&setup, shared.clone())?;
    if let Some(why) = agent.auto_reclaim_refused(&agent.config) {
        return Err(AgentError::AutoReclaimRefused(why));
    }
    let server = Server::start(
        &setup.config.agent.listen,
        shared.clone(),
        setup.config.agent.web_config.as_deref(),
    )?;
    if let Some(b) = &bound {
        *b.write().expect("bound address") = Some(server.addr);
    }
    tracing::info!(listen = %server.addr, interval = ?setup.config.agent.interval, "vramguard agent started");
    agent.reclaim_stop = reclaim_stop;
    // Looked at once before the first sample, then whenever the watch sees a new file.
    let watch = Arc::new(LockWatch {
        seen: AtomicBool::new(true),
        ended: AtomicBool::new(false),
    });
    if let Err(e) = vramguard_ops::reset_lock::check_directory(&agent.config.reclaim.reset_lock) {
        tracing::warn!(
            "[reclaim] reset_lock = {}: its directory is not root's alone, so reset locks there \
             are ignored and a reset by another vramguard process is refused while this agent \
             holds the GPU: {}",
            agent.config.reclaim.reset_lock.display(),
            e
        );
    }
    if watch_reset_lock(
        &agent.config.reclaim.reset_lock,
        wake_tx.clone(),
        watch.clone(),
    ) {
        agent.reset_lock_seen = Some(watch);
    } else {
        tracing::info!(
            "the reset lock's directory ({}) cannot be watched: the lock is looked at every {:?}",
            agent.config.reclaim.reset_lock.display(),
            RESET_LOCK_CHECK
        );
        agent.reset_lock_poll = Some(RESET_LOCK_CHECK);
    }
    agent.start_watching_opens();
    let mut next = agent.now();
    while !shutdown.load(Ordering::SeqCst) {
        if reload.swap(false, Ordering::SeqCst) {
            agent.reload(setup.config_path.as_deref());
        }
        agent.collect_reclaim();
        next = agent.step(next, &wake_rx);
    }
    tracing::info!("vramguard agent stopping");
    agent.finish_reclaim();
    signals_handle.close();
    server.stop();
    agent.notifier.stop();
    Ok(())
}

/// What the watch of the reset lock's directory tells the agent's loop.
struct LockWatch {
    /// A file appeared there since the loop last looked.
    seen: AtomicBool,
    /// The watch ended (the directory was removed, or reading it failed): the loop looks at
    /// the lock by itself from then on.
    ended: AtomicBool,
}

/// Wakes the agent's loop (a byte on `wake`, after setting `watch.seen`) whenever a file is
/// created or renamed into the reset lock's directory (made, root's, mode 0755, if missing),
/// so that a lock is seen at once without polling, and the directory is listed only then.
/// `false` when the directory cannot be watched.
fn watch_reset_lock(lock: &std::path::Path, wake: Arc<OwnedFd>, watch: Arc<LockWatch>) -> bool {
    use rustix::fs::inotify;
    let Some(dir) = lock.parent().filter(|d| !d.as_os_str().is_empty()) else {
        return false;
    };
    if !dir.exists() {
        use std::os::unix::fs::DirBuilderExt;
        let _ = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir);
    }
    let Ok(fd) = inotify::init(inotify::CreateFlags::CLOEXEC) else {
        return false;
    };
    let watched = inotify::add_watch(
        &fd,
        dir,
        inotify::WatchFlags::CREATE | inotify::WatchFlags::MOVED_TO | inotify::WatchFlags::ONLYDIR,
    );
    if watched.is_err() {
        return false;
    }
    std::thread::Builder::new()
        .name("vramguard-reset-lock".into())
        .spawn(move || {
            let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
            let mut events = inotify::Reader::new(&fd, &mut buf);
            loop {
                let ended = match events.next() {
                    // The directory was removed (or unmounted): the kernel drops the watch.
                    Ok(event) => event.events().contains(inotify::ReadFlags::IGNORED),
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(_) => true,
                };
                if ended {
                    watch.ended.store(true, Ordering::SeqCst);
                }
                watch.seen.store(true, Ordering::SeqCst);
                let _ = rustix::io::write(&*wake, b"l");
                if ended {
                    return;
                }
            }
        })
        .is_ok()
}

/// Hands the allocator's free pages back to the kernel after a full scan, the sample that
/// allocates most (every process's fd list and maps). Without it, a soak with holders coming
/// and going showed RSS creeping up while the heap in use stayed flat: freed chunks scattered
/// through the heap keep their pages resident. Costs a walk of the free lists (microseconds
/// for the agent's heap) once per full scan.
fn return_free_heap_pages() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases memory the allocator holds and no one uses.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Whose work the agent observes. As `status`, only where a class rests on it (holders whose
/// job is gone or unknown), unless an automatic reclaim may take idle holders (`[reclaim]
/// auto` with `idle` included): an idle holder's class rests on GPU utilization alone, and
/// reading every idle holder's `/proc` each second was most of the agent's CPU on a busy node.
fn watch_for(config: &Config) -> vramguard_core::WatchFor {
    if config.reclaim.auto
        && config
            .reclaim
            .include
            .contains(&vramguard_core::report::Class::Idle)
    {
        vramguard_core::WatchFor::Reclaim
    } else {
        vramguard_core::WatchFor::Classes
    }
}

#[cfg(test)]
mod tests {
    //! The agent's loop on a scripted node: samples are taken by hand, time moves on the
    //! manual clock, and no process is started.
    use super::*;
    use vramguard_node::fake::FakeNode;

    fn demo() -> FakeNode {
        let node = FakeNode::incident("demo");
        node.holds_hidden(16523, 0, 2 << 30);
        node
    }

    fn agent_on(node: &FakeNode, config: Config) -> Agent {
        let n = node.clone();
        let setup = AgentSetup {
            config,
            config_path: None,
            make_node: Arc::new(move |_: &Policy| -> Result<Box<dyn Node>, NodeError> {
                Ok(Box::new(n.clone()))
            }),
            shutdown: Arc::new(AtomicBool::new(false)),
        };
        Agent::new(
            &setup,
            Arc::new(RwLock::new(Arc::new(Published::default()))),
        )
        .unwrap()
    }

    fn auto_reclaim_config(audit: &std::path::Path) -> Config {
        let mut config = Config::default();
        config.reclaim.auto = true;
        config.reclaim.min_age = Duration::from_secs(60);
        config.reclaim.grace = Duration::from_secs(5);
        config.reclaim.audit_log = audit.to_path_buf();
        config.agent.interval = Duration::from_secs(1);
        config
    }

    /// Waits (on the real clock, for the reclaim thread) until the automatic reclaim is done.
    fn finish_reclaim(agent: &mut Agent) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while agent.reclaim_job.is_some() {
            assert!(
                Instant::now() < deadline,
                "the automatic reclaim did not finish"
            );
            std::thread::sleep(Duration::from_millis(5));
            agent.collect_reclaim();
        }
    }

    /// An agent with automatic reclaim on the demo node, after two samples a second apart:
    /// two observations make a window of work, so the orphans are reclaimable from then on.
    fn warmed_up(node: &FakeNode) -> (Agent, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let mut agent = agent_on(node, auto_reclaim_config(&dir.path().join("audit.jsonl")));
        for _ in 0..2 {
            agent.sample();
            node.manual_clock().advance(Duration::from_secs(1));
        }
        (agent, dir)
    }

    /// The device files are watched for opens before the first full scan, not after it: an
    /// open during the scan (hundreds of ms on a busy node) is then seen at the next sample,
    /// not ten minutes later at the next full scan.
    #[test]
    fn device_opens_are_watched_before_the_full_scan_that_the_watch_lets_wait() {
        let node = demo();
        node.opens_watchable();
        let mut agent = agent_on(&node, Config::default());
        agent.sample();
        assert!(agent.watching_opens);
        let calls = node.calls();
        let watch = calls.iter().position(|c| c == "watch opens");
        let scan = calls.iter().position(|c| c == "snapshot Full");
        assert!(
            matches!((watch, scan), (Some(w), Some(s)) if w < s),
            "the watch must start before the full scan: {calls:?}"
        );
        // With the watch on, the full scan's period is the long one.
        assert_eq!(
            agent.full_scan_every(),
            vramguard_config::FULL_SCAN_EVERY_WATCHED
        );
        node.manual_clock().advance(Duration::from_secs(1));
        agent.sample();
        assert_eq!(
            node.calls().last().map(String::as_str),
            Some("snapshot Cached")
        );
    }

    /// A heal that fails while the GPUs cannot be read (a reset that left the driver unable
    /// to answer) is alerted on all the same: its steps are followed in failed samples too.
    #[test]
    fn a_failed_heal_is_seen_while_every_collection_fails() {
        let dir = tempfile::tempdir().unwrap();
        let audit = dir.path().join("audit.jsonl");
        let mut config = Config::default();
        config.reclaim.audit_log = audit.clone();
        let node = demo();
        let mut agent = agent_on(&node, config);
        agent.sample();
        node.driver_gone(true);
        std::fs::write(
            &audit,
            "{\"ts_ms\":7,\"run_id\":\"r\",\"host\":\"h\",\"event\":\"heal_failed\",\
             \"node\":\"gpu07\",\"reason\":\"held\"}\n",
        )
        .unwrap();
        agent.sample();
        assert!(agent.last_good.is_some(), "the first sample was good");
        assert!(agent.heal.failing(), "the failed heal was not followed");
        let metrics = agent.metrics.render();
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("vramguard_slurm_heal_failed{") && l.ends_with(" 1")),
            "{metrics}"
        );
    }

    /// A reload that names another audit log shows that log's heal state, and nothing of
    /// the old one's (its failure no longer exported, nor left firing).
    /// On a node through which nothing may be signalled (another namespace's `/proc`), a
    /// reload that turns automatic reclaim on is refused whole: the running config stays.
    #[test]
    fn a_reload_turning_on_automatic_reclaim_where_nothing_may_be_signalled_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let node = demo();
        node.refuse_signals("/x/proc is not the /proc of vramguard's own PID namespace");
        let mut agent = agent_on(&node, Config::default());
        let cfg = dir.path().join("vramguard.toml");
        std::fs::write(&cfg, "[reclaim]\nauto = true\n[agent]\ninterval = \"2s\"\n").unwrap();
        agent.reload(Some(&cfg));
        assert!(!agent.config.reclaim.auto);
        assert_eq!(agent.config.agent.interval, Duration::from_secs(1));
        let mut on = Config::default();
        on.reclaim.auto = true;
        let why = agent.auto_reclaim_refused(&on).unwrap();
        assert!(
            AgentError::AutoReclaimRefused(why)
                .to_string()
                .contains("cannot run here: /x/proc is not the /proc of vramguard's own PID namespace; turn it off")
        );
        // Where signals can go, the same reload is taken.
        let mut agent = agent_on(&demo(), Config::default());
        agent.reload(Some(&cfg));
        assert!(agent.config.reclaim.auto);
    }

    #[test]
    fn a_reload_onto_another_audit_log_drops_the_old_logs_heal_state() {
        let dir = tempfile::tempdir().unwrap();
        let (old_log, new_log) = (dir.path().join("old.jsonl"), dir.path().join("new.jsonl"));
        std::fs::write(
            &old_log,
            "{\"ts_ms\":7,\"run_id\":\"r\",\"host\":\"h\",\"event\":\"heal_failed\",\
             \"node\":\"gpu07\",\"reason\":\"held\"}\n",
        )
        .unwrap();
        let mut config = Config::default();
        config.reclaim.audit_log = old_log;
        let node = demo();
        let mut agent = agent_on(&node, config);
        agent.sample();
        let failed_series = |agent: &Agent| {
            agent
                .metrics
                .render()
                .lines()
                .any(|l| l.starts_with("vramguard_slurm_heal_failed{"))
        };
        assert!(agent.heal.failing() && failed_series(&agent));
        let cfg = dir.path().join("vramguard.toml");
        std::fs::write(
            &cfg,
            format!("[reclaim]\naudit_log = \"{}\"\n", new_log.display()),
        )
        .unwrap();
        agent.reload(Some(&cfg));
        assert_eq!(agent.config.reclaim.audit_log, new_log, "reloaded");
        assert!(!agent.heal.failing());
        assert!(
            !failed_series(&agent),
            "the old log's failure is still exported"
        );
    }

    /// Idle holders are watched for work only when an automatic reclaim may take them: else
    /// the agent, like `status`, reads no idle holder's `/proc` each sample.
    #[test]
    fn idle_holders_are_watched_only_when_an_automatic_reclaim_may_take_them() {
        use vramguard_core::WatchFor;
        use vramguard_core::report::Class;
        let mut c = Config::default();
        assert_eq!(watch_for(&c), WatchFor::Classes);
        c.reclaim.auto = true;
        assert_eq!(watch_for(&c), WatchFor::Classes, "auto, without idle");
        c.reclaim.include.push(Class::Idle);
        assert_eq!(watch_for(&c), WatchFor::Reclaim);
        c.reclaim.auto = false;
        assert_eq!(watch_for(&c), WatchFor::Classes, "idle, but no auto");
    }

    #[test]
    fn automatic_reclaim_waits_for_min_age_then_signals_exactly_the_targets() {
        let node = demo();
        let (mut agent, dir) = warmed_up(&node);
        let clock = node.manual_clock().clone();
        let since: BTreeSet<u32> = agent.reclaimable_since.keys().map(|k| k.0).collect();
        assert_eq!(since, [16521, 16522, 16523].into());
        // A sample a second, as configured: 59 s later, not yet.
        for _ in 0..59 {
            agent.sample();
            assert!(agent.reclaim_job.is_none());
            clock.advance(Duration::from_secs(1));
        }
        assert!(node.signals().is_empty(), "{:?}", node.signals());
        agent.sample();
        assert!(
            agent.reclaim_job.is_some(),
            "min_age passed: a reclaim starts"
        );
        finish_reclaim(&mut agent);
        let signalled: BTreeSet<(u32, &str)> =
            node.signals().iter().map(|s| (s.pid, s.signal)).collect();
        assert_eq!(
            signalled,
            [(16521, "TERM"), (16522, "TERM"), (16523, "TERM")].into()
        );
        let metrics = agent.metrics.render();
        assert!(
            metrics.contains("vramguard_reclaim_actions_total{action=\"term\"} 3"),
            "{metrics}"
        );
        let audit = std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap();
        let terms = audit
            .lines()
            .filter(|l| l.contains("\"event\":\"signal\"") && l.contains("\"TERM\""))
            .count();
        assert_eq!(terms, 3, "{audit}");
    }

    /// With `idle` included, a live job's idle holder is taken only after the agent itself
    /// saw it idle in every sample for idle_after (here 120 s), even with a shorter min_age:
    /// the driver's samples may not reach back over the whole idle window (red-team finding).
    #[test]
    fn an_idle_holder_is_taken_only_after_the_agent_saw_it_idle_for_idle_after() {
        let node = FakeNode::incident("an_idle_holder_past_the_configured_threshold");
        let dir = tempfile::tempdir().unwrap();
        let mut config = auto_reclaim_config(&dir.path().join("audit.jsonl"));
        config.reclaim.include = vec![Class::Idle];
        config.policy.idle_after_secs = 120;
        let mut agent = agent_on(&node, config);
        let clock = node.manual_clock().clone();
        let mut became_idle = None;
        let mut reclaimed = None;
        for second in 0..400u64 {
            agent.sample();
            if became_idle.is_none() && !agent.reclaimable_since.is_empty() {
                became_idle = Some(second);
            }
            if agent.reclaim_job.is_some() {
                reclaimed = Some(second);
                break;
            }
            clock.advance(Duration::from_secs(1));
        }
        let became_idle = became_idle.expect("the holders become idle");
        let reclaimed = reclaimed.expect("the idle holders are reclaimed");
        // Idle (class) from about 118 s on; min_age (60 s) alone would have let it go at 178.
        assert!(
            reclaimed - became_idle >= 120,
            "idle from {became_idle} s, reclaimed at {reclaimed} s"
        );
        finish_reclaim(&mut agent);
        assert!(!node.signals().is_empty());
    }

    /// A holder counted reclaimable as an orphan, then idle (its job alive again: here its
    /// group leader is back in the snapshot), has been idle only since it became so: taken
    /// only after idle_after as idle, not after idle_after since it was first a target.
    #[test]
    fn a_holder_idle_after_being_an_orphan_waits_idle_after_from_then() {
        let node = FakeNode::incident("an_idle_holder_past_the_configured_threshold");
        let holders = [15447u32, 15448];
        // First their job is gone: a group whose leader is no process here.
        node.edit_snapshot(|s| {
            for p in s.processes.iter_mut().filter(|p| holders.contains(&p.pid)) {
                p.ppid = Some(1);
                p.pgid = Some(15_000);
                p.sid = Some(15_000);
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let mut config = auto_reclaim_config(&dir.path().join("audit.jsonl"));
        config.reclaim.include = vec![Class::Orphan, Class::Idle];
        config.reclaim.min_age = Duration::from_secs(110);
        config.policy.idle_after_secs = 60;
        let mut agent = agent_on(&node, config);
        let clock = node.manual_clock().clone();
        for _ in 0..100 {
            agent.sample();
            clock.advance(Duration::from_secs(1));
        }
        assert!(
            agent
                .reclaimable_since
                .values()
                .any(|(c, _)| *c == Class::Orphan),
            "orphans first"
        );
        // Now each leads its own group: a live job's idle holders.
        node.edit_snapshot(|s| {
            for p in s.processes.iter_mut().filter(|p| holders.contains(&p.pid)) {
                p.pgid = Some(p.pid);
                p.sid = Some(p.pid);
            }
        });
        let mut became_idle = None;
        let mut reclaimed = None;
        for second in 100..600u64 {
            agent.sample();
            // Told by the holders' class in the metrics, not by the tracking under test.
            let idle_now = agent.metrics.render().lines().any(|l| {
                l.starts_with("vramguard_gpu_holders{")
                    && l.contains("class=\"idle\"")
                    && !l.ends_with(" 0")
            });
            if became_idle.is_none() && idle_now {
                became_idle = Some(second);
            }
            if agent.reclaim_job.is_some() {
                reclaimed = Some(second);
                break;
            }
            clock.advance(Duration::from_secs(1));
        }
        let became_idle = became_idle.expect("the holders become idle");
        let reclaimed = reclaimed.expect("the idle holders are reclaimed");
        assert!(
            reclaimed - became_idle >= 60,
            "idle from {became_idle} s, reclaimed at {reclaimed} s"
        );
        finish_reclaim(&mut agent);
    }

    /// A reclaim thread that panics is a result, not silence: the agent logs and counts it
    /// and starts no automatic reclaim again until it restarts (before, the result never
    /// came and automatic reclaim stopped without a word).
    #[test]
    fn a_panicking_reclaim_is_reported_and_stops_automatic_reclaim() {
        let node = demo();
        let (mut agent, _dir) = warmed_up(&node);
        let clock = node.manual_clock().clone();
        agent.make_node = Arc::new(|_: &Policy| -> Result<Box<dyn Node>, NodeError> {
            panic!("a bug in the node")
        });
        for _ in 0..60 {
            agent.sample();
            clock.advance(Duration::from_secs(1));
        }
        assert!(
            agent.reclaim_job.is_some(),
            "min_age passed: a reclaim starts"
        );
        finish_reclaim(&mut agent);
        assert!(agent.reclaim_panicked);
        assert!(node.signals().is_empty(), "{:?}", node.signals());
        let metrics = agent.metrics.render();
        assert!(
            metrics.contains("vramguard_collection_errors_total{kind=\"reclaim\"} 1"),
            "{metrics}"
        );
        for _ in 0..120 {
            agent.sample();
            assert!(agent.reclaim_job.is_none(), "started again after a panic");
            clock.advance(Duration::from_secs(1));
        }
    }

    /// `min_age` is time in which every sample saw the holder reclaimable: while automatic
    /// reclaim is off, across failed collections and across a gap in sampling, nobody looked,
    /// so it starts again.
    #[test]
    fn min_age_starts_again_after_time_nobody_looked() {
        let node = demo();
        let clock = node.manual_clock().clone();
        let elapse = |agent: &mut Agent, secs: u64| {
            for _ in 0..secs {
                agent.sample();
                clock.advance(Duration::from_secs(1));
            }
        };
        // Seen for 55 s, then 5 s unseen, then seen: min_age (60 s) has not been seen whole.
        // (Switched off, the samples go on but follow nothing; after failures or a gap, the
        // first sample has no window of work for the holders, which leave the plan.)
        let unseen_for_5s = |blind: &dyn Fn(&mut Agent, bool)| {
            let (mut agent, dir) = warmed_up(&node);
            elapse(&mut agent, 55);
            blind(&mut agent, true);
            elapse(&mut agent, 5);
            blind(&mut agent, false);
            agent.sample();
            (agent, dir)
        };
        // Automatic reclaim switched off (a reload), then on.
        let (agent, _dir) = unseen_for_5s(&|a: &mut Agent, off| a.config.reclaim.auto = !off);
        assert!(
            agent.reclaim_job.is_none(),
            "reclaimed at once after auto was off"
        );
        // Failed collections.
        let (agent, _dir) = unseen_for_5s(&|_: &mut Agent, failing| {
            node.driver_gone(failing);
        });
        assert!(
            agent.reclaim_job.is_none(),
            "reclaimed at once after failures"
        );
        assert!(node.signals().is_empty());
        // A gap with no sample at all (the agent stopped for ten minutes).
        let (mut agent, _dir) = warmed_up(&node);
        elapse(&mut agent, 55);
        clock.advance(Duration::from_secs(600));
        agent.sample();
        assert!(agent.reclaim_job.is_none(), "reclaimed at once after a gap");
        assert!(node.signals().is_empty());
        // Seen reclaimable for min_age from then on: reclaimed.
        clock.advance(Duration::from_secs(1));
        elapse(&mut agent, 60);
        agent.sample();
        assert!(agent.reclaim_job.is_some());
        finish_reclaim(&mut agent);
    }

    #[test]
    fn a_holder_that_leaves_the_plan_restarts_its_min_age() {
        let node = demo();
        let (mut agent, _dir) = warmed_up(&node);
        let clock = node.manual_clock().clone();
        assert_eq!(agent.reclaimable_since.len(), 3);
        // 16521 exits on its own: it leaves the plan and is forgotten.
        node.exit(16521);
        clock.advance(Duration::from_secs(1));
        agent.sample();
        assert!(!agent.reclaimable_since.keys().any(|k| k.0 == 16521));
        assert_eq!(agent.reclaimable_since.len(), 2);
    }

    #[test]
    fn without_auto_reclaim_nothing_is_ever_signalled() {
        let dir = tempfile::tempdir().unwrap();
        let node = demo();
        let mut config = auto_reclaim_config(&dir.path().join("audit.jsonl"));
        config.reclaim.auto = false;
        let mut agent = agent_on(&node, config);
        for _ in 0..10 {
            agent.sample();
            node.manual_clock().advance(Duration::from_secs(60));
        }
        assert!(agent.reclaim_job.is_none());
        assert!(node.signals().is_empty());
        let metrics = agent.metrics.render();
        assert!(metrics.contains("vramguard_gpu_ghost_bytes"), "{metrics}");
    }

    /// A non-blocking pipe like the one the agent's signal thread writes to.
    fn wake_pipe() -> (OwnedFd, OwnedFd) {
        rustix::pipe::pipe_with(
            rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK,
        )
        .unwrap()
    }

    #[test]
    fn an_exit_wakes_the_agent_at_once_and_the_release_lag_is_timed_on_the_nodes_clock() {
        use vramguard_node::Clock;
        let node = demo();
        node.release_lag(Duration::from_millis(340));
        let mut config = Config::default();
        config.agent.interval = Duration::from_secs(5);
        let mut agent = agent_on(&node, config);
        let clock = node.manual_clock().clone();
        let (wake_rx, _wake_tx) = wake_pipe();
        let t0 = clock.now();
        // The first turn samples, watches every holder (16521 holds 8 GiB on GPU 0) and,
        // with nothing exiting, sleeps until the next sample is due.
        let next = agent.step(t0, &wake_rx);
        assert_eq!(next, t0 + Duration::from_secs(5));
        assert_eq!(clock.now(), next);
        let key = (16521, node_start(&node, 16521));
        assert!(agent.watched.contains_key(&key));
        // The next turn samples; 16521 exits 1.3 s later: the wait ends then, not at the
        // sample after, 5 s in.
        let t1 = clock.now();
        node.exit_after(16521, Duration::from_millis(1300));
        let next = agent.step(next, &wake_rx);
        let exited = t1 + Duration::from_millis(1300);
        assert_eq!(clock.now(), exited, "woken by the exit");
        assert_eq!(next, clock.now(), "a sample is due at once");
        assert_eq!(
            agent.pending.len(),
            1,
            "the release of its memory is measured"
        );
        // The driver gives the memory back 340 ms after the exit: polled every 20 ms.
        let mut turns = 0;
        let mut next = next;
        while !agent.pending.is_empty() {
            next = agent.step(next, &wake_rx);
            turns += 1;
            assert!(turns < 100, "the release was never seen");
        }
        let lag = clock.now() - exited;
        assert!(
            lag >= Duration::from_millis(340) && lag < Duration::from_millis(361),
            "{lag:?}"
        );
        let metrics = agent.metrics.render();
        let sum = metrics
            .lines()
            .find(|l| l.starts_with("vramguard_release_lag_seconds_sum{gpu=\"0\"}"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no release lag for GPU 0:\n{metrics}"));
        assert!((0.34..0.361).contains(&sum), "{sum}");
        // The exited holder is never watched again.
        agent.step(next, &wake_rx);
        assert!(!agent.watched.contains_key(&key));
    }

    /// Collections of each kind so far, from the metrics.
    fn collections_of(agent: &Agent, kind: &str) -> u64 {
        let metrics = agent.metrics.render();
        let line = format!("vramguard_collections_total{{kind=\"{kind}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map_or(0, |v| v.parse().unwrap())
    }

    /// A quiet sample records the history's points only, but a refit of the trends in one is
    /// still exported.
    #[test]
    fn the_trends_refitted_in_quiet_samples_are_exported() {
        use vramguard_node::Clock;
        let node = FakeNode::incident("a_process_in_a_systemd_unit_belongs_to_the_unit");
        let mut config = Config::default();
        config.agent.interval = Duration::from_secs(1);
        config.alerts.rules.clear();
        // A refit every second; a trend needs 24 s of points. No listing or re-read: every
        // sample after the first is quiet.
        config.agent.trend_window = Duration::from_secs(240);
        config.agent.discover_every = Some(Duration::from_secs(3600));
        config.agent.recheck_every = Some(Duration::from_secs(3600));
        let mut agent = agent_on(&node, config);
        let (wake_rx, _wake_tx) = wake_pipe();
        let clock = node.manual_clock().clone();
        let slopes = |agent: &Agent| {
            agent
                .metrics
                .render()
                .lines()
                .filter(|l| l.starts_with("vramguard_holder_leak_slope_bytes_per_second{"))
                .count()
        };
        let mut next = agent.step(clock.now(), &wake_rx);
        assert_eq!(slopes(&agent), 0, "one point: no trend yet");
        for _ in 0..30 {
            next = agent.step(next, &wake_rx);
        }
        assert_eq!(collections_of(&agent, "quiet"), 30);
        assert!(slopes(&agent) > 0, "{}", agent.metrics.render());
    }

    /// (#28) A node where nothing is undecided (every holder in a live job, no ghost) is
    /// sampled quietly: the used memory is read and the last report kept, no process is
    /// looked at. A change of used memory, an exit, the periodic re-read of the holders, or
    /// automatic reclaim being on makes the sample a full one again.
    #[test]
    fn a_calm_node_is_sampled_quietly_until_something_changes() {
        use vramguard_node::Clock;
        let node = FakeNode::incident("a_process_in_a_systemd_unit_belongs_to_the_unit");
        let mut config = Config::default();
        config.agent.interval = Duration::from_secs(1);
        // No alert rule can be pending here: a pending alert keeps samples full (checked at
        // the end).
        config.alerts.rules.clear();
        let mut agent = agent_on(&node, config);
        let (wake_rx, _wake_tx) = wake_pipe();
        let clock = node.manual_clock().clone();
        let grow = |s: &mut vramguard_core::snapshot::Snapshot| {
            s.gpus[0].memory.as_mut().unwrap().used += 1 << 30;
            let p = s.gpus[0].processes.iter_mut().find(|p| p.pid == 15643);
            *p.unwrap().used_bytes.as_mut().unwrap() += 1 << 30;
        };
        let snapshots = |n: &FakeNode| {
            n.calls()
                .iter()
                .filter(|c| c.starts_with("snapshot"))
                .count()
        };
        let mut next = agent.step(clock.now(), &wake_rx);
        assert!(
            agent.calm.is_some(),
            "the first (full) sample left nothing undecided"
        );
        let published = agent.shared.read().unwrap().clone();
        // Three quiet samples: no snapshot, the same report, a new publication.
        for _ in 0..3 {
            next = agent.step(next, &wake_rx);
        }
        assert_eq!(snapshots(&node), 1, "{:?}", node.calls());
        assert_eq!(collections_of(&agent, "quiet"), 3);
        // Each asked the driver for the settled part of its GPUs only.
        let settled = node.calls().iter().filter(|c| *c == "settled gpus").count();
        assert_eq!(settled, 3, "{:?}", node.calls());
        let now = agent.shared.read().unwrap().clone();
        assert!(Arc::ptr_eq(
            published.report.as_ref().unwrap(),
            now.report.as_ref().unwrap()
        ));
        assert_eq!(now.samples, published.samples + 3);
        // The holder allocates: a full sample.
        node.edit_snapshot(grow);
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), 2);
        // The periodic listing (discover_every, 5 s after the first sample; 5 s here, where
        // device opens are not watched) is a full sample.
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), 3, "{:?}", node.calls());
        // Only the utilization moves: still quiet. A row remap waits for a reset, with the
        // same memory: a quiet sample does not read the remapped rows (the next full sample
        // does). A critical Xid event: a full sample.
        node.edit_snapshot(|s| s.gpus[0].utilization = None);
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), 3, "{:?}", node.calls());
        node.edit_snapshot(|s| {
            s.gpus[0].health.remapped_rows = Some(vramguard_core::snapshot::RemappedRows {
                pending: true,
                ..Default::default()
            })
        });
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), 3, "{:?}", node.calls());
        node.edit_snapshot(|s| {
            s.gpus[0].health.xid_events =
                vec![vramguard_core::snapshot::XidCount { xid: 79, count: 1 }]
        });
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), 4, "{:?}", node.calls());
        let report = agent.shared.read().unwrap().report.clone().unwrap();
        assert!(
            report.gpus[0].health.reset_pending(),
            "the full sample read the remap: {:?}",
            report.gpus[0].health
        );
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), 4, "{:?}", node.calls());
        assert_eq!(collections_of(&agent, "quiet"), 6);
        // The next listing, 10 s after the first sample.
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), 5, "{:?}", node.calls());
        // A process the collection follows (a parent, a job leader; here the holder's
        // parent) exits: the agent does not watch it, the node tells; a full sample follows.
        let before = snapshots(&node);
        node.exit_after(1, Duration::from_millis(10));
        // This turn samples (quietly: nothing exited yet) and sleeps through the exit.
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), before);
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), before + 1, "{:?}", node.calls());
        // The holder exits: the next sample is a full one, whatever the memory shows.
        // (The driver keeps its memory meanwhile, so the memory cannot tell.)
        next = agent.step(next, &wake_rx);
        let before = snapshots(&node);
        node.release_lag(Duration::from_secs(3600));
        node.exit_after(15643, Duration::from_millis(10));
        // The wait ends at the exit and asks for a sample at once: a full one.
        next = agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), before);
        agent.step(next, &wake_rx);
        assert_eq!(snapshots(&node), before + 1, "{:?}", node.calls());
        // With an alert pending (used above 1% for an hour), every sample is full.
        let node = FakeNode::incident("a_process_in_a_systemd_unit_belongs_to_the_unit");
        let config = Config::parse(
            std::path::Path::new("pending.toml"),
            "[[alerts.rule]]\nname = \"used\"\nwhen = \"used_ratio\"\nabove = 0.01\nfor = \"1h\"\n",
        )
        .unwrap();
        let mut agent = agent_on(&node, config);
        let mut next = agent.step(node.manual_clock().now(), &wake_rx);
        for _ in 0..3 {
            next = agent.step(next, &wake_rx);
        }
        assert!(!agent.alerts.is_calm());
        assert_eq!(collections_of(&agent, "quiet"), 0);
        // With automatic reclaim on, every sample is full.
        let node = FakeNode::incident("a_process_in_a_systemd_unit_belongs_to_the_unit");
        let audit = tempfile::tempdir().unwrap();
        let mut agent = agent_on(
            &node,
            auto_reclaim_config(&audit.path().join("audit.jsonl")),
        );
        let mut next = agent.step(node.manual_clock().now(), &wake_rx);
        for _ in 0..3 {
            next = agent.step(next, &wake_rx);
        }
        assert_eq!(collections_of(&agent, "quiet"), 0);
        assert!(agent.calm.is_none());
        // Where something is undecided (the demo's orphans and ghost), too.
        let node = demo();
        let mut agent = agent_on(&node, Config::default());
        let mut next = agent.step(node.manual_clock().now(), &wake_rx);
        for _ in 0..3 {
            next = agent.step(next, &wake_rx);
        }
        assert_eq!(collections_of(&agent, "quiet"), 0);
    }

    /// (#28) While nothing is undecided and device opens are watched, the `/proc` listing and
    /// the holders' re-read come every 30 s instead of every 5 s (unless configured); once
    /// something is undecided, every 5 s again.
    #[test]
    fn a_calm_node_is_listed_and_re_read_every_30_s_unless_configured() {
        use vramguard_node::Clock;
        let full_samples_in = |config: Config, incident: &str, secs: u32| {
            let node = FakeNode::incident(incident);
            node.opens_watchable();
            let mut agent = agent_on(&node, config);
            let (wake_rx, _wake_tx) = wake_pipe();
            let mut next = agent.step(node.manual_clock().now(), &wake_rx);
            for _ in 0..secs {
                next = agent.step(next, &wake_rx);
            }
            node.calls()
                .iter()
                .filter(|c| c.starts_with("snapshot"))
                .cloned()
                .collect::<Vec<_>>()
        };
        let calm = "a_process_in_a_systemd_unit_belongs_to_the_unit";
        let mut config = Config::default();
        config.alerts.rules.clear();
        let calls = full_samples_in(config.clone(), calm, 31);
        assert_eq!(
            calls,
            ["snapshot Full", "snapshot NewProcesses"],
            "one re-read, 30 s after the first sample"
        );
        // Configured periods hold whatever the node's state.
        config.agent.discover_every = Some(Duration::from_secs(10));
        config.agent.recheck_every = Some(Duration::from_secs(5));
        let calls = full_samples_in(config.clone(), calm, 20);
        assert_eq!(
            calls,
            [
                "snapshot Full",
                "snapshot Holders",
                "snapshot NewProcesses",
                "snapshot Holders",
                "snapshot NewProcesses"
            ]
        );
        // Something undecided (the demo's orphans): every sample is full, and the defaults of
        // 5 s hold.
        let mut config = Config::default();
        config.alerts.rules.clear();
        let calls = full_samples_in(config, "demo", 10);
        assert_eq!(calls.len(), 11, "{calls:?}");
        assert_eq!(
            calls
                .iter()
                .filter(|c| *c == "snapshot NewProcesses")
                .count(),
            2,
            "{calls:?}"
        );
    }

    /// A sample renders no metrics: the first scrape after it does, once, and sees what the
    /// sample published (and counters moved since, such as a failed collection's).
    #[test]
    fn metrics_are_rendered_by_the_first_scrape_after_a_sample_not_by_the_sample() {
        let node = demo();
        let mut agent = agent_on(&node, Config::default());
        agent.sample();
        let published = agent.shared.read().unwrap().clone();
        assert!(published.rendered.get().is_none(), "rendered by the sample");
        // Once scraped, the next sample renders before it publishes (scrapers that come at
        // every sample find the text ready); unscraped, it does not.
        let _ = published.rendered();
        agent.sample();
        let scraped_next = agent.shared.read().unwrap().clone();
        assert!(scraped_next.rendered.get().is_some());
        agent.sample();
        let unscraped_next = agent.shared.read().unwrap().clone();
        assert!(unscraped_next.rendered.get().is_none());
        let (openmetrics, text) = published.rendered();
        let openmetrics = String::from_utf8(openmetrics.to_vec()).unwrap();
        assert!(
            openmetrics.contains("vramguard_gpu_memory_used_bytes{gpu=\"0\""),
            "{openmetrics}"
        );
        assert!(openmetrics.ends_with("# EOF\n") && !text.ends_with(b"# EOF\n"));
        // Kept for the next scrapes of the same sample.
        assert_eq!(published.rendered().0, published.rendered.get().unwrap().0);
        // A failed collection publishes anew: its error counter is in the next scrape.
        node.driver_gone(true);
        agent.sample();
        let after = agent.shared.read().unwrap().clone();
        assert!(!Arc::ptr_eq(&published, &after));
        let (openmetrics, _) = after.rendered();
        let openmetrics = String::from_utf8(openmetrics.to_vec()).unwrap();
        assert!(
            openmetrics.contains("vramguard_collection_errors_total{kind=\"source\"} 1"),
            "{openmetrics}"
        );
    }

    /// The driver is asked for the memory before the processes: a holder that allocated in
    /// between is listed with bytes the used memory does not count yet. Its exit right after
    /// is still measured (the listed bytes are the floor), instead of waiting for used memory
    /// to fall below what it never reached and timing out two minutes later.
    #[test]
    fn an_exit_right_after_an_allocation_the_memory_reading_missed_is_still_measured() {
        use vramguard_node::Clock;
        let node = demo();
        node.release_lag(Duration::from_millis(0));
        let listed = |n: &FakeNode| -> u64 {
            let mut n = n.clone();
            let snap = n.snapshot(ScanDepth::Full).unwrap();
            snap.gpus[0]
                .processes
                .iter()
                .filter_map(|p| p.used_bytes)
                .sum()
        };
        let all = listed(&node);
        let of_16521 = {
            let mut n = node.clone();
            let snap = n.snapshot(ScanDepth::Full).unwrap();
            let p = snap.gpus[0].processes.iter().find(|p| p.pid == 16521);
            p.unwrap().used_bytes.unwrap()
        };
        assert!(of_16521 > 0 && all >= of_16521);
        // The sample's memory reading predates 16521's allocation.
        node.edit_snapshot(|s| s.gpus[0].memory.as_mut().unwrap().used = all - of_16521);
        let mut config = Config::default();
        config.agent.interval = Duration::from_secs(5);
        let mut agent = agent_on(&node, config);
        let clock = node.manual_clock().clone();
        let (wake_rx, _wake_tx) = wake_pipe();
        agent.sample();
        // The allocation lands, then 16521 exits and the driver frees it.
        node.edit_snapshot(|s| s.gpus[0].memory.as_mut().unwrap().used = all);
        node.exit_after(16521, Duration::from_millis(100));
        let mut next = agent.step(clock.now() + Duration::from_secs(5), &wake_rx);
        // Polled every 20 ms while pending: 200 turns are 4 s on the node's clock.
        for _ in 0..200 {
            if agent.pending.is_empty() {
                break;
            }
            next = agent.step(next, &wake_rx);
        }
        let metrics = agent.metrics.render();
        assert!(
            metrics.contains("vramguard_release_lag_seconds_count{gpu=\"0\"} 1"),
            "{metrics}"
        );
        assert!(!metrics.contains("vramguard_release_timeouts_total{gpu=\"0\"} 1"));
    }

    /// The start time of `pid` in the node's snapshot.
    fn node_start(node: &FakeNode, pid: u32) -> u64 {
        let mut n = node.clone();
        n.snapshot(ScanDepth::Full)
            .unwrap()
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .and_then(|p| p.start_ticks)
            .unwrap()
    }
}
