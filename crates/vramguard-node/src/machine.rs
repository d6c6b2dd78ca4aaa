//! The real node: a GPU source, a `/proc` collector, a reset backend, pidfd-pinned signals and
//! the system clock.

use crate::clock::{Clock, SystemClock};
use crate::identity::{self, Identity, Refusal, Verified};
use crate::reset::{ResetBackend, ResetError, ResetTarget};
use crate::snapshot::{take_sampled_snapshot, take_snapshot};
use crate::{Node, NodeError};
use rustix::process::Signal;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vramguard_core::Policy;
use vramguard_core::snapshot::{GpuSample, Snapshot};
use vramguard_gpu::GpuSource;
use vramguard_proc::{ProcCollector, ProcFs, ScanDepth, WorkSampler};

/// This machine (or the simulated one, whose source and reset the simulator supplies).
pub struct MachineNode {
    source: Box<dyn GpuSource>,
    collector: ProcCollector,
    policy: Policy,
    reset: ResetBackend,
    /// The `/proc` of vramguard's own PID namespace, where pinned identities are checked.
    signal_proc: PathBuf,
    /// Why no process may be pinned or watched, when `signal_proc` is not the `/proc` of
    /// vramguard's own PID namespace: a pidfd opens the pid in vramguard's namespace, so a
    /// start time read from another tree (a container's `/proc`, a fixture) would vouch for a
    /// different process than the one signalled.
    foreign_proc: Option<String>,
    pinned: BTreeMap<u32, Verified>,
    /// Processes whose exit is watched ([`Node::watch_exits`]), each by its pidfd.
    watched: BTreeMap<Identity, Verified>,
    /// Every watched pidfd in one epoll set, which is readable when one of them is: a wait
    /// polls three descriptors whatever the number of holders (polling 200 pidfds at each
    /// wake-up was a tenth of the agent's CPU per sample). `None` where epoll could not be
    /// had: each pidfd is then polled.
    exit_set: Option<vramguard_proc::exits::ExitSet>,
    /// Processes asked to be watched that had already exited (no pidfd to open, or their pid
    /// taken by another process): the next wait reports them at once. A holder seen by a
    /// sample that exits before its watch starts still has its exit, and its release, timed.
    gone_before_watched: BTreeMap<Identity, Instant>,
    clock: SystemClock,
    kubelet: Option<Kubelet>,
    /// Opens of the device files, once [`Node::watch_opens`] started watching them.
    opens: Option<vramguard_proc::opens::DeviceOpens>,
    /// Openers read by the last waits, for [`Node::take_opens`].
    openers: vramguard_proc::opens::Openers,
}

/// Where and how patiently the kubelet's pod-resources API is asked for pod names.
struct Kubelet {
    socket: PathBuf,
    timeout: Duration,
    /// After a failure the kubelet is left alone for [`KUBELET_BACKOFF`]: a hung kubelet
    /// costs one timeout a minute, not one per sample. With when, the limitation it gave:
    /// every snapshot meanwhile says the same (a command that takes a second snapshot, a
    /// deeper scan, must not lose why).
    failed: Option<(Instant, String)>,
    /// The last answer, when, and the pod UIDs of the snapshot it answered for: reused for
    /// [`KUBELET_REFRESH`] while no new pod appears (the agent samples every second).
    last: Option<(
        Instant,
        BTreeSet<String>,
        Vec<vramguard_core::snapshot::KubePod>,
    )>,
}

/// How long a kubelet answer is reused while the same pods hold GPUs.
const KUBELET_REFRESH: Duration = Duration::from_secs(10);

/// How long a kubelet that failed is left alone.
const KUBELET_BACKOFF: Duration = Duration::from_secs(60);

/// Why `proc` cannot check the identity of a process vramguard signals: it is not the `/proc`
/// of vramguard's own PID namespace (its `self` is not this process). `None` when it is.
fn foreign_proc(proc: &Path) -> Option<String> {
    let own = vramguard_proc::ProcFs::open(proc).is_ok_and(|fs| fs.is_own_namespace());
    (!own).then(|| {
        format!(
            "{} is not the /proc of vramguard's own PID namespace: no process is signalled \
             through it (a pid there may name another process here)",
            proc.display()
        )
    })
}

/// How long a reset waits for this process's other holders of the driver to let go.
const OWN_RELEASE_WAIT: Duration = Duration::from_secs(5);

/// Waits, at most `limit`, until this process holds no NVIDIA device file of `dev_dir`
/// (`/proc/self/fd`); returns whether it holds none.
fn wait_until_no_device_file_held(dev_dir: &Path, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while vramguard_proc::procfs::own_process_holds_device_files(dev_dir) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

impl MachineNode {
    /// A node reading GPUs from `source` and processes through `collector`, classifying with
    /// `policy` (its idle threshold sets how far back utilisation samples are asked for),
    /// resetting through `reset`, and checking identities to signal in `signal_proc`.
    pub fn new(
        source: Box<dyn GpuSource>,
        collector: ProcCollector,
        policy: Policy,
        reset: ResetBackend,
        signal_proc: &Path,
    ) -> MachineNode {
        MachineNode {
            source,
            collector,
            policy,
            reset,
            signal_proc: signal_proc.to_path_buf(),
            foreign_proc: foreign_proc(signal_proc),
            pinned: BTreeMap::new(),
            watched: BTreeMap::new(),
            exit_set: vramguard_proc::exits::ExitSet::new(),
            gone_before_watched: BTreeMap::new(),
            clock: SystemClock,
            kubelet: None,
            opens: None,
            openers: Default::default(),
        }
    }

    /// Asks the kubelet at `socket` (within `timeout`) for the pod names of holders in pod
    /// cgroups. An absent socket is no error: the node is not a Kubernetes node.
    pub fn with_kubelet(mut self, socket: &Path, timeout: Duration) -> MachineNode {
        self.kubelet = Some(Kubelet {
            socket: socket.to_path_buf(),
            timeout,
            failed: None,
            last: None,
        });
        self
    }

    /// Adds the kubelet's pods to `snap` when a process there lives in a pod cgroup; a
    /// failure is one limitation line (pods are then shown by UID).
    fn attach_pods(&mut self, snap: &mut Snapshot) {
        let Some(k) = self.kubelet.as_mut() else {
            return;
        };
        let uids: BTreeSet<String> = snap
            .processes
            .iter()
            .filter_map(|p| p.pod_uid.clone())
            .collect();
        if uids.is_empty() || !k.socket.exists() {
            return;
        }
        if let Some((at, seen, pods)) = &k.last
            && at.elapsed() < KUBELET_REFRESH
            && uids.is_subset(seen)
        {
            snap.kubelet_pods = Some(pods.clone());
            return;
        }
        if let Some((at, said)) = &k.failed
            && at.elapsed() < KUBELET_BACKOFF
        {
            snap.scan.limitations.push(format!(
                "{said}; not asked again for {}s",
                KUBELET_BACKOFF
                    .saturating_sub(at.elapsed())
                    .as_secs()
                    .max(1)
            ));
            return;
        }
        match vramguard_kubelet::list_pods(&k.socket, k.timeout) {
            Ok(pods) => {
                k.failed = None;
                k.last = Some((Instant::now(), uids, pods.clone()));
                snap.kubelet_pods = Some(pods);
            }
            Err(e) => {
                k.last = None;
                // The error carries the kubelet's own message: shown escaped.
                let said = format!(
                    "pod names unavailable: {} (pods are shown by UID)",
                    vramguard_core::sanitize::shown(&e.to_string())
                );
                snap.scan.limitations.push(said.clone());
                k.failed = Some((Instant::now(), said));
            }
        }
    }

    /// The GPU source (for callers that need more than memory, like the probe).
    pub fn source(&mut self) -> &mut dyn GpuSource {
        self.source.as_mut()
    }

    /// The collector (the agent keeps its caches warm between samples).
    pub fn collector(&mut self) -> &mut ProcCollector {
        &mut self.collector
    }

    /// Replaces the classification policy (a reloaded config).
    pub fn set_policy(&mut self, policy: Policy) {
        self.policy = policy;
    }
}

impl Node for MachineNode {
    fn snapshot(&mut self, depth: ScanDepth) -> Result<Snapshot, NodeError> {
        if matches!(
            depth,
            ScanDepth::Full | ScanDepth::Thorough | ScanDepth::NewProcesses
        ) && let Some(opens) = self.opens.as_mut()
        {
            // Device files made since (a new GPU, a driver reload, `nvidia-uvm` loaded on
            // first use) are watched from now on: within a listing period, not a full scan's.
            if let Some(failed) = opens.mark_all() {
                self.openers.unmarked = Some(failed);
            }
        }
        let mut snap = take_snapshot(
            self.source.as_mut(),
            &mut self.collector,
            &self.policy,
            depth,
            &self.clock,
        )?;
        self.attach_pods(&mut snap);
        Ok(snap)
    }

    fn sampled_snapshot_for(
        &mut self,
        depth: ScanDepth,
        window: Duration,
        watch: vramguard_core::WatchFor,
    ) -> Result<Snapshot, NodeError> {
        let mut snap = take_sampled_snapshot(
            self.source.as_mut(),
            &mut self.collector,
            &self.policy,
            depth,
            window,
            watch,
            &self.clock,
        )?;
        self.attach_pods(&mut snap);
        Ok(snap)
    }

    fn gpus(&mut self) -> Result<Vec<GpuSample>, NodeError> {
        let window = Duration::from_secs(self.policy.idle_after_secs.max(1));
        Ok(self.source.sample(window)?.gpus)
    }

    fn settled_gpus(&mut self) -> Result<Vec<GpuSample>, NodeError> {
        Ok(self.source.settled()?.gpus)
    }

    fn memory_used(&mut self, gpu: u32) -> Result<u64, NodeError> {
        self.source
            .memory_used(gpu)
            .map_err(|cause| NodeError::Memory { gpu, cause })
    }

    fn reset(&mut self, gpu: &ResetTarget) -> Result<String, ResetError> {
        // The reset command runs as another process: this one's own NVML handles (and the
        // device files they hold) would make the driver refuse it, as any monitor's do. The
        // source opens the driver again at its next call.
        self.source.release();
        // Another thread of this process (the agent's main loop, while its automatic reclaim
        // resets) lets go when it sees the reset lock: give it a moment.
        wait_until_no_device_file_held(self.collector.dev_dir(), OWN_RELEASE_WAIT);
        self.reset.reset(gpu)
    }

    fn release_driver(&mut self) {
        self.source.release();
    }

    fn proc(&self) -> Option<&ProcFs> {
        Some(self.collector.procfs())
    }

    fn observe_work(&mut self, sampler: &mut WorkSampler, pids: &[u32]) -> Result<(), NodeError> {
        let now = self.clock.wall_ms();
        Ok(sampler.observe(self.collector.procfs(), pids, now)?)
    }

    fn add_descendants(&mut self, snap: &mut Snapshot, roots: &[u32]) -> Result<(), NodeError> {
        if roots.is_empty() {
            return Ok(());
        }
        Ok(crate::snapshot::add_descendants(
            &mut self.collector,
            snap,
            roots,
        )?)
    }

    fn clock(&self) -> &dyn Clock {
        &self.clock
    }

    fn signals_refused(&self) -> Option<String> {
        self.foreign_proc.clone()
    }

    fn pin(&mut self, ids: &[Identity]) -> Vec<Result<(), Refusal>> {
        self.pinned.clear();
        if let Some(why) = &self.foreign_proc {
            return ids
                .iter()
                .map(|_| Err(Refusal::Failed(why.clone())))
                .collect();
        }
        ids.iter()
            .map(|&id| {
                let v = identity::verify(&self.signal_proc, id)?;
                self.pinned.insert(id.pid, v);
                Ok(())
            })
            .collect()
    }

    fn signal(&mut self, id: Identity, sig: Signal) -> Result<(), Refusal> {
        match self.pinned.get(&id.pid) {
            Some(v) if v.identity == id => v.signal(sig),
            _ => Err(Refusal::Failed("not pinned at plan time".into())),
        }
    }

    fn wait_exits(&mut self, ids: &[Identity], deadline: Instant) -> Vec<Option<Instant>> {
        let pinned: Vec<Option<&Verified>> = ids
            .iter()
            .map(|id| self.pinned.get(&id.pid).filter(|v| v.identity == *id))
            .collect();
        let watched: Vec<&Verified> = pinned.iter().flatten().copied().collect();
        let mut exits = identity::wait_all(&watched, deadline).into_iter();
        // A process that was never pinned cannot be watched: it counts as gone now.
        pinned
            .iter()
            .map(|p| match p {
                Some(_) => exits.next().flatten(),
                None => Some(self.clock.now()),
            })
            .collect()
    }

    fn nothing_exited(&mut self) -> bool {
        self.collector.nothing_exited()
    }

    fn watch_exits(&mut self, ids: &[Identity]) -> usize {
        if self.foreign_proc.is_some() {
            // A pidfd would follow whatever process has the pid here: exits are seen by the
            // samples alone.
            return 0;
        }
        let wanted: BTreeSet<Identity> = ids.iter().copied().collect();
        let set = &mut self.exit_set;
        self.watched.retain(|id, v| {
            let keep = wanted.contains(id);
            if !keep && let Some(s) = set.as_ref() {
                s.remove(&*v);
            }
            keep
        });
        self.gone_before_watched.retain(|id, _| wanted.contains(id));
        let now = self.clock.now();
        for id in wanted {
            if self.watched.contains_key(&id) || self.gone_before_watched.contains_key(&id) {
                continue;
            }
            match identity::verify(&self.signal_proc, id) {
                Ok(v) => {
                    if let Some(s) = set.as_ref()
                        && s.add(&v, id.pid).is_err()
                    {
                        // A set that refuses one (out of memory, a limit): every pidfd is
                        // polled from now on, as without epoll.
                        *set = None;
                    }
                    self.watched.insert(id, v);
                }
                // Exited since the sample that saw it: its exit is news for the next wait.
                Err(Refusal::Gone | Refusal::Reused { .. }) => {
                    self.gone_before_watched.insert(id, now);
                }
                // Alive but not watchable (out of fds): left out, as the trait says.
                Err(_) => {}
            }
        }
        self.watched.len()
    }

    fn wait_watched(
        &mut self,
        deadline: Instant,
        wake: Option<std::os::fd::BorrowedFd<'_>>,
        opens: bool,
    ) -> Vec<(Identity, Instant)> {
        use rustix::event::{PollFd, PollFlags, poll};
        // Without the epoll set, every pidfd is polled itself.
        let ids: Vec<Identity> = match self.exit_set {
            Some(_) => Vec::new(),
            None => self.watched.keys().copied().collect(),
        };
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(ids.len() + 3);
        for id in &ids {
            fds.push(PollFd::new(&self.watched[id], PollFlags::IN));
        }
        let set_at = fds.len();
        if let Some(set) = &self.exit_set {
            fds.push(PollFd::new(set, PollFlags::IN));
        }
        if let Some(w) = &wake {
            fds.push(PollFd::from_borrowed_fd(*w, PollFlags::IN));
        }
        let opens_at = fds.len();
        if let Some(watch) = self.opens.as_ref().filter(|_| opens) {
            fds.push(PollFd::from_borrowed_fd(watch.as_fd(), PollFlags::IN));
        }
        // Exits already known are not waited for.
        let timeout = if self.gone_before_watched.is_empty() {
            deadline.saturating_duration_since(self.clock.now())
        } else {
            Duration::ZERO
        };
        let ts = rustix::time::Timespec {
            tv_sec: timeout.as_secs() as i64,
            tv_nsec: timeout.subsec_nanos() as i64,
        };
        // EINTR: nothing new; the caller loops.
        let _ = poll(&mut fds, Some(&ts));
        let now = self.clock.now();
        let fired: Vec<bool> = fds
            .iter()
            .take(ids.len())
            .map(|f| {
                f.revents()
                    .intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR)
            })
            .collect();
        let opened = fds
            .get(opens_at)
            .is_some_and(|f| f.revents().contains(PollFlags::IN));
        let set_fired = self.exit_set.is_some()
            && fds
                .get(set_at)
                .is_some_and(|f| f.revents().contains(PollFlags::IN));
        drop(fds);
        let mut gone_in_set: Vec<Identity> = Vec::new();
        let mut set_failed = false;
        if set_fired && let Some(set) = &self.exit_set {
            let zero = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            match set.ready(self.watched.len()) {
                Ok(ready) => {
                    for pid in ready {
                        // The pid names the process; its pidfd says whether this one exited
                        // (a pid may be watched twice, a reused pid beside the one that left).
                        let of_pid = Identity {
                            pid,
                            start_ticks: 0,
                        }..=Identity {
                            pid,
                            start_ticks: u64::MAX,
                        };
                        for (id, v) in self.watched.range(of_pid) {
                            let mut one = [PollFd::new(v, PollFlags::IN)];
                            if poll(&mut one, Some(&zero)).is_ok()
                                && one[0]
                                    .revents()
                                    .intersects(PollFlags::IN | PollFlags::HUP | PollFlags::ERR)
                            {
                                gone_in_set.push(*id);
                            }
                        }
                    }
                }
                Err(_) => {
                    // A set that cannot be asked stays readable and would spin the loop: each
                    // process's pidfd is polled from now on, as without epoll (the old way,
                    // only dearer).
                    set_failed = true;
                }
            }
        }
        if set_failed {
            self.exit_set = None;
        }
        if opened && let Some(opens) = self.opens.as_mut() {
            match opens.drain() {
                Ok(found) => {
                    self.collector.opened_by(found.pids.iter().copied());
                    self.openers.pids.extend(found.pids);
                    self.openers.overflowed |= found.overflowed;
                }
                Err(e) => {
                    // What it would have said is lost: a full scan makes up for it.
                    self.opens = None;
                    self.openers.overflowed = true;
                    self.openers.stopped = Some(e);
                }
            }
        }
        let mut exits: Vec<(Identity, Instant)> = std::mem::take(&mut self.gone_before_watched)
            .into_iter()
            .collect();
        let polled = ids
            .into_iter()
            .zip(fired)
            .filter_map(|(id, gone)| gone.then_some(id));
        for id in polled.chain(gone_in_set) {
            if let Some(v) = self.watched.remove(&id) {
                if let Some(set) = &self.exit_set {
                    set.remove(&v);
                }
                exits.push((id, now));
            }
        }
        exits
    }

    fn watch_opens(&mut self) -> Result<usize, vramguard_proc::opens::OpenWatchError> {
        use vramguard_proc::opens::{DeviceOpens, OpenWatchError};
        if !self.collector.sees_own_namespace() {
            return Err(OpenWatchError::OtherNamespace);
        }
        // Through pid 1's root as well: in a container whose runtime made its own device
        // nodes, the workloads open the host's, which only that path reaches.
        let host_dev = self.collector.procfs().root().join("1/root/dev");
        let opens = DeviceOpens::of_dirs(&[self.collector.dev_dir().to_path_buf(), host_dev])?;
        let files = opens.watched_files();
        self.opens = Some(opens);
        Ok(files)
    }

    fn set_command_lines(&mut self, read: bool) {
        self.collector.set_command_lines(read);
    }

    fn unwatch_opens(&mut self) {
        self.opens = None;
        self.openers = Default::default();
    }

    fn take_opens(&mut self) -> vramguard_proc::opens::Openers {
        std::mem::take(&mut self.openers)
    }

    fn why_alive(&self, pid: u32) -> String {
        stuck_threads(&self.signal_proc, pid)
    }

    fn remove_segment(
        &mut self,
        segment: &vramguard_core::host::SegmentReport,
    ) -> Result<(), vramguard_proc::host::SegmentRemovalError> {
        vramguard_proc::host::remove_segment(
            Path::new(&segment.dir),
            &segment.name,
            segment.dev,
            segment.inode,
        )
    }
}

/// Threads of `pid` and where they sleep, for a process that survived SIGKILL.
fn stuck_threads(proc_root: &Path, pid: u32) -> String {
    let threads = ProcFs::open(proc_root).and_then(|fs| fs.threads(pid));
    let Ok(vramguard_proc::procfs::Found::Yes(threads)) = threads else {
        return "its threads are unreadable".into();
    };
    let parts: Vec<String> = threads
        .iter()
        .map(|t| {
            // The kernel's symbol names: still escaped, as everything printed from /proc is.
            let wchan = vramguard_core::sanitize::escape(t.wchan.as_deref().unwrap_or(""));
            format!("{} {} {wchan}", t.tid, t.state)
        })
        .collect();
    format!(
        "survived SIGKILL: threads {}; a thread in D state waits for I/O that no signal can \
         interrupt (abort the hung mount or device, or reboot)",
        parts.join(", ")
    )
}

/// The pass-throughs: each answer of the node is the source's, the reset backend's or
/// `/proc`'s, not a constant. (The pinning and signalling are tested on real processes in
/// `crates/vramguard-ops/tests/identity.rs`.)
#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use vramguard_core::snapshot::{CallError, DriverFacts, DriverSource, ProcessListState};
    use vramguard_gpu::{DriverSample, SourceError};

    /// GPU 3, using 12 345 bytes; any other GPU fails. Remembers the utilisation windows asked.
    struct ScriptedSource {
        windows: Arc<Mutex<Vec<Duration>>>,
    }

    fn gpu(index: u32) -> GpuSample {
        GpuSample {
            index,
            uuid: Some(format!("GPU-{index}")),
            name: None,
            pci_bus_id: None,
            minor_number: None,
            memory: None,
            persistence_mode: None,
            processes: Vec::new(),
            process_list: ProcessListState::Complete,
            utilization: None,
            failure: None,
            warnings: Vec::new(),
            health: Default::default(),
            mig_devices: Vec::new(),
            telemetry: None,
        }
    }

    impl GpuSource for ScriptedSource {
        fn sample(&mut self, window: Duration) -> Result<DriverSample, SourceError> {
            self.windows.lock().unwrap().push(window);
            Ok(DriverSample {
                driver: DriverFacts {
                    source: DriverSource::Simulated,
                    library: None,
                    driver_version: None,
                    nvml_version: None,
                },
                gpus: vec![gpu(3)],
            })
        }
        fn memory_used(&mut self, gpu: u32) -> Result<u64, CallError> {
            match gpu {
                3 => Ok(12_345),
                _ => Err(CallError {
                    call: "nvmlDeviceGetMemoryInfo_v2".into(),
                    code: Some(15),
                    message: "GPU is lost".into(),
                }),
            }
        }
    }

    fn node() -> (MachineNode, Arc<Mutex<Vec<Duration>>>) {
        let windows = Arc::new(Mutex::new(Vec::new()));
        let reset = ResetBackend::Function(Arc::new(|index| match index {
            3 => Ok(format!("GPU {index} reset")),
            _ => Err(ResetError::Refused(format!("GPU {index} is busy"))),
        }));
        let node = MachineNode::new(
            Box::new(ScriptedSource {
                windows: windows.clone(),
            }),
            ProcCollector::new(vramguard_proc::OWN_PROC, "/dev").unwrap(),
            Policy::default(),
            reset,
            Path::new(vramguard_proc::OWN_PROC),
        );
        (node, windows)
    }

    /// A node reading another namespace's `/proc` (a container's, here a tree whose pid names
    /// this test's `sleep` with the start time the plan expects) pins nothing and watches
    /// nothing: the pidfd would open the pid here, another process than the one the tree
    /// vouched for.
    #[test]
    fn a_proc_of_another_namespace_vouches_for_no_process_to_signal() {
        /// Killed and reaped on drop, a failed assertion included.
        struct Reaped(std::process::Child);
        impl Drop for Reaped {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let mut sleeper = Reaped(
            std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap(),
        );
        let pid = sleeper.0.id();
        let tree = tempfile::tempdir().unwrap();
        std::fs::create_dir(tree.path().join(pid.to_string())).unwrap();
        std::fs::write(
            tree.path().join(format!("{pid}/stat")),
            format!(
                "{pid} (python3) S 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 4242 0 0\n"
            ),
        )
        .unwrap();
        std::os::unix::fs::symlink("1", tree.path().join("self")).unwrap();
        let mut node = MachineNode::new(
            Box::new(ScriptedSource {
                windows: Arc::new(Mutex::new(Vec::new())),
            }),
            ProcCollector::new(vramguard_proc::OWN_PROC, "/dev").unwrap(),
            Policy::default(),
            ResetBackend::Command(vec!["false".into()]),
            tree.path(),
        );
        let id = Identity {
            pid,
            start_ticks: 4242,
        };
        let pinned = node.pin(&[id]);
        assert!(
            matches!(&pinned[..], [Err(Refusal::Failed(why))] if why.contains("own PID namespace")),
            "{pinned:?}"
        );
        assert!(node.signal(id, Signal::KILL).is_err());
        assert_eq!(node.watch_exits(&[id]), 0);
        assert!(
            sleeper.0.try_wait().unwrap().is_none(),
            "the sleeper was signalled"
        );
    }

    #[test]
    fn gpus_and_memory_are_the_sources_and_the_window_follows_the_policy() {
        let (mut node, windows) = node();
        let gpus = node.gpus().unwrap();
        assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), [3]);
        assert_eq!(node.memory_used(3).unwrap(), 12_345);
        match node.memory_used(7) {
            Err(NodeError::Memory { gpu: 7, cause }) => assert_eq!(cause.message, "GPU is lost"),
            other => panic!("GPU 7's memory: {other:?}"),
        }
        node.set_policy(Policy {
            idle_after_secs: 42,
            ..Policy::default()
        });
        node.gpus().unwrap();
        let asked = windows.lock().unwrap().clone();
        assert_eq!(asked.last(), Some(&Duration::from_secs(42)), "{asked:?}");
    }

    #[test]
    fn a_reset_is_the_backends() {
        let (mut node, _) = node();
        let target = |index| ResetTarget {
            index,
            ..ResetTarget::default()
        };
        assert_eq!(node.reset(&target(3)), Ok("GPU 3 reset".into()));
        assert_eq!(
            node.reset(&target(4)),
            Err(ResetError::Refused("GPU 4 is busy".into()))
        );
    }

    #[test]
    fn proc_and_observed_work_are_the_collectors() {
        let (mut node, _) = node();
        assert_eq!(
            node.proc().map(|fs| fs.root().to_path_buf()),
            Some(PathBuf::from(vramguard_proc::OWN_PROC))
        );
        // Two observations at distinct milliseconds make a sample of this very process.
        let me = std::process::id();
        let mut sampler = WorkSampler::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            node.observe_work(&mut sampler, &[me]).unwrap();
            let seen = sampler.window(0, u64::MAX);
            if seen.processes.iter().any(|p| p.pid == me) {
                break;
            }
            assert!(Instant::now() < deadline, "no work observed for pid {me}");
        }
    }

    #[test]
    fn why_alive_lists_the_threads_or_says_they_are_unreadable() {
        let (node, _) = node();
        let me = std::process::id();
        let why = node.why_alive(me);
        assert!(
            why.starts_with("survived SIGKILL: threads ") && why.contains(&format!("{me} ")),
            "{why}"
        );
        assert_eq!(
            stuck_threads(Path::new("/nonexistent-proc"), me),
            "its threads are unreadable"
        );
    }

    #[test]
    fn a_segment_is_removed_when_it_is_still_the_file_planned() {
        use std::os::unix::fs::MetadataExt;
        let (mut node, _) = node();
        let dir = std::env::temp_dir().join(format!("vg-machine-segment-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("seg");
        std::fs::write(&file, b"x").unwrap();
        let meta = std::fs::metadata(&file).unwrap();
        let segment = vramguard_core::host::SegmentReport {
            dir: dir.to_string_lossy().into_owned(),
            dev: meta.dev(),
            name: "seg".into(),
            inode: meta.ino(),
            bytes: 1,
            uid: meta.uid(),
            age_secs: 0,
            producer: None,
            users: Vec::new(),
            verdict: vramguard_core::host::SegmentVerdict::Reclaimable,
            after_targets: Vec::new(),
        };
        let removed = node.remove_segment(&segment);
        let left = file.exists();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(removed.is_ok(), "{removed:?}");
        assert!(!left, "the segment is gone");
    }

    /// A snapshot whose processes live in the pods `uids` (one process each).
    fn snapshot_in_pods(uids: &[&str]) -> Snapshot {
        Snapshot {
            taken_at_ms: 0,
            host: Default::default(),
            driver: DriverFacts {
                source: DriverSource::Simulated,
                library: None,
                driver_version: None,
                nvml_version: None,
            },
            gpus: Vec::new(),
            processes: uids
                .iter()
                .zip(100..)
                .map(|(uid, pid)| vramguard_core::snapshot::ProcessFacts {
                    pid,
                    pod_uid: Some(uid.to_string()),
                    ..Default::default()
                })
                .collect(),
            departed: Vec::new(),
            scan: Default::default(),
            work: None,
            job_cgroups: Vec::new(),
            kubelet_pods: None,
            host_memory: None,
        }
    }

    fn pod(name: &str) -> vramguard_kubelet::PodResources {
        vramguard_kubelet::PodResources {
            name: name.into(),
            namespace: "ml".into(),
            containers: Vec::new(),
        }
    }

    /// A socket path of this test's own.
    fn kubelet_socket(test: &str) -> PathBuf {
        let socket =
            std::env::temp_dir().join(format!("vg-machine-{test}-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&socket);
        socket
    }

    /// What `attach_pods` added to a snapshot in the pods `uids`.
    fn attach(node: &mut MachineNode, uids: &[&str]) -> (Option<Vec<String>>, Vec<String>) {
        let mut snap = snapshot_in_pods(uids);
        node.attach_pods(&mut snap);
        let names = snap
            .kubelet_pods
            .map(|pods| pods.into_iter().map(|p| p.name).collect());
        (names, snap.scan.limitations)
    }

    #[test]
    fn the_kubelet_is_asked_for_holders_in_pods_once_while_no_new_pod_appears() {
        let socket = kubelet_socket("pods");
        let (node, _) = node();
        let mut node = node.with_kubelet(&socket, Duration::from_secs(10));
        // No socket: not a Kubernetes node, and no complaint.
        assert_eq!(attach(&mut node, &["uid-a"]), (None, Vec::new()));
        let kubelet = vramguard_kubelet::fake::FakeKubelet::start(&socket, vec![pod("a")]);
        // No process in a pod: nothing to ask.
        assert_eq!(attach(&mut node, &[]), (None, Vec::new()));
        assert_eq!(kubelet.calls(), 0, "asked with no process in a pod");
        let named = (Some(vec!["a".to_string()]), Vec::new());
        assert_eq!(attach(&mut node, &["uid-a"]), named);
        assert_eq!(kubelet.calls(), 1);
        // The same pods within the refresh period: the answer is reused.
        assert_eq!(attach(&mut node, &["uid-a"]), named);
        assert_eq!(kubelet.calls(), 1, "asked again for the same pods");
        // A new pod: asked again.
        assert_eq!(attach(&mut node, &["uid-a", "uid-b"]), named);
        assert_eq!(kubelet.calls(), 2, "not asked for a new pod");
    }

    #[test]
    fn a_failed_kubelet_is_left_alone_for_the_back_off() {
        let socket = kubelet_socket("backoff");
        let (node, _) = node();
        let mut node = node.with_kubelet(&socket, Duration::from_millis(50));
        let kubelet = vramguard_kubelet::fake::FakeKubelet::start(&socket, vec![pod("a")]);
        kubelet.slow_down(Duration::from_millis(500));
        let (names, limitations) = attach(&mut node, &["uid-a"]);
        assert_eq!(names, None);
        assert!(
            limitations.len() == 1
                && limitations[0].starts_with("pod names unavailable: ")
                && !limitations[0].contains("not asked again"),
            "{limitations:?}"
        );
        let first = limitations[0].clone();
        assert_eq!(kubelet.calls(), 1);
        // Meanwhile every snapshot says why, as the first did (a command's second, deeper
        // snapshot lost it: `failed recently` alone under CI load).
        let (names, limitations) = attach(&mut node, &["uid-a"]);
        assert_eq!(names, None);
        assert_eq!(limitations.len(), 1, "{limitations:?}");
        assert!(
            limitations[0].starts_with(&first) && limitations[0].contains("not asked again for"),
            "{limitations:?}"
        );
        assert_eq!(kubelet.calls(), 1, "a failed kubelet asked again at once");
    }

    #[test]
    fn a_holder_that_exits_before_its_watch_starts_is_reported_by_the_next_wait() {
        let (mut node, _) = node();
        let proc_root = Path::new(vramguard_proc::OWN_PROC);
        let spawn = || {
            let child = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let start_ticks = identity::start_ticks(proc_root, child.id()).unwrap();
            let id = Identity {
                pid: child.id(),
                start_ticks,
            };
            (child, id)
        };
        let (mut left, left_id) = spawn();
        let (mut stays, stays_id) = spawn();
        // Seen by a sample, then gone before the agent asked for its watch.
        left.kill().unwrap();
        left.wait().unwrap();
        assert_eq!(node.watch_exits(&[left_id, stays_id]), 1);
        let asked = Instant::now();
        let gone = node.wait_watched(asked + Duration::from_secs(10), None, false);
        assert_eq!(
            gone.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            [left_id],
            "the exit before the watch"
        );
        assert!(asked.elapsed() < Duration::from_secs(5), "it waited");
        // Said once: the next wait sleeps to its deadline with the other one alive.
        node.watch_exits(&[stays_id]);
        let gone = node.wait_watched(Instant::now() + Duration::from_millis(50), None, false);
        assert!(gone.is_empty(), "{gone:?}");
        stays.kill().unwrap();
        stays.wait().unwrap();
        let gone = node.wait_watched(Instant::now() + Duration::from_secs(10), None, false);
        assert_eq!(
            gone.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            [stays_id]
        );
    }
}
