//! A scripted node over a saved snapshot, with a manual clock.
//!
//! The executor's and the agent's unit tests run on it: each process of the snapshot is given
//! a behaviour (exits some time after SIGTERM, ignores SIGTERM, survives SIGKILL), the driver a
//! release lag, and time moves only when the code under test waits. Nothing is spawned, nothing
//! sleeps, and every signal is recorded with the time it was sent.
//!
//! The memory model: a GPU's used memory is the snapshot's, less what each exited holder held
//! there once the release lag after its exit has passed; the rest that no process explains is
//! residue, which only a reset clears. Clones share the same state and clock (the agent's
//! automatic reclaim opens a second node).

use crate::clock::{Clock, ManualClock};
use crate::identity::{Identity, Refusal};
use crate::reset::{ResetError, ResetTarget};
use crate::{Node, NodeError};
use rustix::process::Signal;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use vramguard_core::snapshot::{CallError, GpuSample, Snapshot};
use vramguard_proc::{ProcFs, ScanDepth, WorkSampler};

/// What a scripted process does when signalled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Exits this long after SIGTERM (or at once after SIGKILL).
    ExitsAfterTerm(Duration),
    /// Ignores SIGTERM; SIGKILL ends it.
    IgnoresTerm,
    /// Survives SIGKILL too (a thread in D state).
    Unkillable,
}

/// A signal the fake received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SentSignal {
    /// Time since the node was made.
    pub at: Duration,
    /// The target.
    pub pid: u32,
    /// `TERM` or `KILL`.
    pub signal: &'static str,
}

#[derive(Debug, Clone)]
struct FakeProcess {
    start_ticks: Option<u64>,
    behaviour: Behaviour,
    term_at: Option<Instant>,
    kill_at: Option<Instant>,
    /// Bytes held per GPU that the driver does not list (a hidden holder).
    hidden: BTreeMap<u32, u64>,
}

impl FakeProcess {
    /// When it exits, given the signals so far (`None`: it does not).
    fn exit_at(&self) -> Option<Instant> {
        let after_term = match self.behaviour {
            Behaviour::ExitsAfterTerm(d) => self.term_at.map(|t| t + d),
            _ => None,
        };
        let after_kill = match self.behaviour {
            Behaviour::Unkillable => None,
            _ => self.kill_at,
        };
        match (after_term, after_kill) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

#[derive(Debug)]
struct FakeState {
    base: Snapshot,
    processes: BTreeMap<u32, FakeProcess>,
    release_lag: Duration,
    /// Per GPU: when a reset cleared its residue.
    reset_at: BTreeMap<u32, Instant>,
    /// How long after a reset its residue clears.
    reset_lag: Duration,
    reset_refusal: Option<String>,
    pinned: Vec<Identity>,
    /// Processes whose exit is watched ([`Node::watch_exits`]).
    watched: BTreeSet<Identity>,
    signals: Vec<SentSignal>,
    resets: Vec<u32>,
    removed_segments: Vec<String>,
    /// Every snapshot fails as a driver that stopped answering would.
    driver_gone: bool,
    /// Whether [`Node::watch_opens`] succeeds (as root on a kernel with fanotify).
    opens_watchable: bool,
    /// [`Node::signals_refused`]: a node over another namespace's `/proc`.
    signals_refused: Option<String>,
    /// Snapshots and open watches, in the order they were asked for.
    calls: Vec<String>,
    /// When the last snapshot was taken: [`Node::nothing_exited`] looks for exits since.
    last_snapshot: Option<Instant>,
}

/// A scripted node; see the module documentation.
#[derive(Debug, Clone)]
pub struct FakeNode {
    clock: ManualClock,
    started: Instant,
    state: Arc<Mutex<FakeState>>,
}

impl FakeNode {
    /// A node whose processes and GPUs are those of `snapshot`. Every process exits 100 ms
    /// after SIGTERM and the driver releases memory 200 ms after an exit, until scripted
    /// otherwise. The clock starts at the snapshot's time.
    pub fn new(mut snapshot: Snapshot) -> FakeNode {
        snapshot.normalize();
        let clock = ManualClock::starting_at(snapshot.taken_at_ms);
        let processes = snapshot
            .processes
            .iter()
            .map(|p| {
                (
                    p.pid,
                    FakeProcess {
                        start_ticks: p.start_ticks,
                        behaviour: Behaviour::ExitsAfterTerm(Duration::from_millis(100)),
                        term_at: None,
                        kill_at: None,
                        hidden: BTreeMap::new(),
                    },
                )
            })
            .collect();
        FakeNode {
            started: clock.now(),
            clock,
            state: Arc::new(Mutex::new(FakeState {
                base: snapshot,
                processes,
                release_lag: Duration::from_millis(200),
                reset_at: BTreeMap::new(),
                reset_lag: Duration::ZERO,
                reset_refusal: None,
                pinned: Vec::new(),
                watched: BTreeSet::new(),
                signals: Vec::new(),
                resets: Vec::new(),
                removed_segments: Vec::new(),
                driver_gone: false,
                opens_watchable: false,
                signals_refused: None,
                calls: Vec::new(),
                last_snapshot: None,
            })),
        }
    }

    /// The node of incident `name` of the corpus (`tests/incidents/NAME.json`). For tests:
    /// panics when the incident is missing or not a snapshot.
    pub fn incident(name: &str) -> FakeNode {
        let path = format!(
            "{}/../../tests/incidents/{name}.json",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        FakeNode::new(serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}")))
    }

    fn state(&self) -> MutexGuard<'_, FakeState> {
        self.state.lock().expect("fake node state")
    }

    /// Scripts what `pid` does when signalled.
    pub fn behave(&self, pid: u32, behaviour: Behaviour) -> &FakeNode {
        if let Some(p) = self.state().processes.get_mut(&pid) {
            p.behaviour = behaviour;
        }
        self
    }

    /// Says that `pid` holds `bytes` on `gpu` without the driver listing it.
    pub fn holds_hidden(&self, pid: u32, gpu: u32, bytes: u64) -> &FakeNode {
        if let Some(p) = self.state().processes.get_mut(&pid) {
            p.hidden.insert(gpu, bytes);
        }
        self
    }

    /// Makes `pid` exit now, unsignalled (it finished, or someone else killed it).
    pub fn exit(&self, pid: u32) -> &FakeNode {
        self.exit_after(pid, Duration::ZERO)
    }

    /// Makes `pid` exit `after` from now, unsignalled (a job that ends on its own).
    pub fn exit_after(&self, pid: u32, after: Duration) -> &FakeNode {
        let at = self.clock.now() + after;
        if let Some(p) = self.state().processes.get_mut(&pid) {
            p.behaviour = Behaviour::IgnoresTerm;
            p.kill_at = Some(at);
        }
        self
    }

    /// How long the driver takes to release a holder's memory after it exits.
    pub fn release_lag(&self, lag: Duration) -> &FakeNode {
        self.state().release_lag = lag;
        self
    }

    /// How long after a successful reset the GPU's residue clears (at once, until scripted
    /// otherwise): a driver that gives memory back a few polls after the reset.
    pub fn reset_lag(&self, lag: Duration) -> &FakeNode {
        self.state().reset_lag = lag;
        self
    }

    /// Makes every snapshot fail (`true`) as a driver that stopped answering would, or work
    /// again (`false`).
    pub fn driver_gone(&self, gone: bool) -> &FakeNode {
        self.state().driver_gone = gone;
        self
    }

    /// Lets the device files be watched for opens (one file), as root on a kernel with
    /// fanotify; by default the watch is refused as unsupported.
    pub fn opens_watchable(&self) -> &FakeNode {
        self.state().opens_watchable = true;
        self
    }

    /// Makes the node one through which nothing may be signalled (another namespace's
    /// `/proc`), saying `why`.
    pub fn refuse_signals(&self, why: &str) -> &FakeNode {
        self.state().signals_refused = Some(why.to_string());
        self
    }

    /// Snapshots (`snapshot Full`, `snapshot Cached`...) and open watches (`watch opens`,
    /// `unwatch opens`), in the order they were asked for.
    pub fn calls(&self) -> Vec<String> {
        self.state().calls.clone()
    }

    /// Makes every reset fail with `reason`.
    pub fn refuse_resets(&self, reason: &str) -> &FakeNode {
        self.state().reset_refusal = Some(reason.to_string());
        self
    }

    /// The manual clock (tests move it between agent samples).
    pub fn manual_clock(&self) -> &ManualClock {
        &self.clock
    }

    /// Every signal received, in order.
    pub fn signals(&self) -> Vec<SentSignal> {
        self.state().signals.clone()
    }

    /// Changes what the node shows from now on (its processes' facts, its host memory): a
    /// process opening a segment, a user changing owner. Processes added here are not
    /// scripted.
    pub fn edit_snapshot(&self, change: impl FnOnce(&mut Snapshot)) -> &FakeNode {
        let mut state = self.state();
        change(&mut state.base);
        state.base.normalize();
        drop(state);
        self
    }

    /// The shared-memory segments removed, by name, in order.
    pub fn removed_segments(&self) -> Vec<String> {
        self.state().removed_segments.clone()
    }

    /// GPU resets done, in order.
    pub fn resets(&self) -> Vec<u32> {
        self.state().resets.clone()
    }

    /// Whether `pid` has exited by now.
    pub fn has_exited(&self, pid: u32) -> bool {
        let now = self.clock.now();
        self.state()
            .processes
            .get(&pid)
            .and_then(FakeProcess::exit_at)
            .is_some_and(|e| e <= now)
    }
}

impl FakeState {
    fn alive(&self, pid: u32, now: Instant) -> bool {
        self.processes
            .get(&pid)
            .is_some_and(|p| p.exit_at().is_none_or(|e| e > now))
    }

    /// What `pid` holds on `gpu`: the driver's listed bytes, else its hidden bytes.
    fn held(&self, pid: u32, gpu: u32) -> u64 {
        let listed = self
            .base
            .gpus
            .iter()
            .find(|g| g.index == gpu)
            .and_then(|g| g.processes.iter().find(|p| p.pid == pid))
            .and_then(|p| p.used_bytes);
        listed.unwrap_or_else(|| {
            self.processes
                .get(&pid)
                .and_then(|p| p.hidden.get(&gpu).copied())
                .unwrap_or(0)
        })
    }

    fn used(&self, gpu: u32, now: Instant) -> Option<u64> {
        let base = self.base.gpus.iter().find(|g| g.index == gpu)?.memory?.used;
        let mut held_alive = 0;
        let mut released = 0;
        for (&pid, p) in &self.processes {
            let bytes = self.held(pid, gpu);
            match p.exit_at() {
                Some(e) if e + self.release_lag <= now => released += bytes,
                _ => held_alive += bytes,
            }
        }
        Some(match self.reset_at.get(&gpu) {
            Some(&r) if r <= now => held_alive,
            _ => base.saturating_sub(released),
        })
    }

    fn snapshot_at(&self, now: Instant, wall_ms: u64) -> Snapshot {
        let mut snap = self.base.clone();
        let shift = wall_ms.saturating_sub(snap.taken_at_ms);
        snap.taken_at_ms = wall_ms;
        snap.processes.retain(|p| self.alive(p.pid, now));
        for g in &mut snap.gpus {
            g.processes.retain(|p| self.alive(p.pid, now));
            let used = self.used(g.index, now);
            if let (Some(m), Some(used)) = (g.memory.as_mut(), used) {
                m.used = used;
                m.free = m.total.saturating_sub(m.reserved + used);
            }
        }
        if let Some(w) = snap.work.as_mut() {
            w.since_ms += shift;
            w.until_ms += shift;
            w.processes.retain(|p| self.alive(p.pid, now));
        }
        // A process that exited maps nothing any more.
        for d in snap.host_memory.iter_mut().flat_map(|h| h.shm.iter_mut()) {
            for s in &mut d.segments {
                s.users.retain(|p| self.alive(*p, now));
            }
        }
        snap
    }
}

impl Node for FakeNode {
    fn watch_opens(&mut self) -> Result<usize, vramguard_proc::opens::OpenWatchError> {
        let mut state = self.state();
        if !state.opens_watchable {
            return Err(vramguard_proc::opens::OpenWatchError::Unsupported);
        }
        state.calls.push("watch opens".into());
        Ok(1)
    }

    fn signals_refused(&self) -> Option<String> {
        self.state().signals_refused.clone()
    }

    fn unwatch_opens(&mut self) {
        self.state().calls.push("unwatch opens".into());
    }

    fn snapshot(&mut self, depth: ScanDepth) -> Result<Snapshot, NodeError> {
        self.state().calls.push(format!("snapshot {depth:?}"));
        if self.state().driver_gone {
            return Err(NodeError::Gpu(vramguard_gpu::SourceError::Call(
                CallError {
                    call: "nvmlDeviceGetCount_v2".into(),
                    code: Some(15),
                    message: "GPU is lost (simulated)".into(),
                },
            )));
        }
        let (now, wall) = (self.clock.now(), self.clock.wall_ms());
        self.state().last_snapshot = Some(now);
        let mut snap = self.state().snapshot_at(now, wall);
        // Like the real node: no window, no work sample.
        snap.work = None;
        Ok(snap)
    }

    fn sampled_snapshot_for(
        &mut self,
        depth: ScanDepth,
        window: Duration,
        _watch: vramguard_core::WatchFor,
    ) -> Result<Snapshot, NodeError> {
        if window.is_zero() {
            return self.snapshot(depth);
        }
        // The saved snapshot's work window stands for what the processes did in `window`.
        self.clock.sleep(window);
        let (now, wall) = (self.clock.now(), self.clock.wall_ms());
        Ok(self.state().snapshot_at(now, wall))
    }

    fn gpus(&mut self) -> Result<Vec<GpuSample>, NodeError> {
        let (now, wall) = (self.clock.now(), self.clock.wall_ms());
        Ok(self.state().snapshot_at(now, wall).gpus)
    }

    fn settled_gpus(&mut self) -> Result<Vec<GpuSample>, NodeError> {
        self.state().calls.push("settled gpus".into());
        Ok(self.gpus()?.iter().map(GpuSample::settled_part).collect())
    }

    fn nothing_exited(&mut self) -> bool {
        let now = self.clock.now();
        let s = self.state();
        s.last_snapshot.is_some_and(|since| {
            !s.processes
                .values()
                .filter_map(FakeProcess::exit_at)
                .any(|e| e > since && e <= now)
        })
    }

    fn memory_used(&mut self, gpu: u32) -> Result<u64, NodeError> {
        let now = self.clock.now();
        self.state()
            .used(gpu, now)
            .ok_or_else(|| NodeError::Memory {
                gpu,
                cause: vramguard_core::snapshot::CallError {
                    call: "nvmlDeviceGetMemoryInfo_v2".into(),
                    code: Some(13),
                    message: "no such GPU in the fake node".into(),
                },
            })
    }

    fn reset(&mut self, gpu: &ResetTarget) -> Result<String, ResetError> {
        let now = self.clock.now();
        let mut s = self.state();
        s.resets.push(gpu.index);
        if let Some(reason) = &s.reset_refusal {
            return Err(ResetError::Refused(reason.clone()));
        }
        let holders: Vec<u32> = s
            .processes
            .keys()
            .copied()
            .filter(|&pid| s.alive(pid, now) && s.held(pid, gpu.index) > 0)
            .collect();
        if !holders.is_empty() {
            return Err(ResetError::Refused(format!(
                "GPU {} is in use by {holders:?}",
                gpu.index
            )));
        }
        let cleared_at = now + s.reset_lag;
        s.reset_at.insert(gpu.index, cleared_at);
        Ok(format!("fake reset of GPU {}", gpu.index))
    }

    fn proc(&self) -> Option<&ProcFs> {
        None
    }

    fn observe_work(&mut self, sampler: &mut WorkSampler, pids: &[u32]) -> Result<(), NodeError> {
        // Each process works as the saved snapshot's window says: its CPU time grows at the
        // rate the window saw, and it is running when the window mostly saw it running.
        let (now, wall) = (self.clock.now(), self.clock.wall_ms());
        let elapsed_ms = (now - self.started).as_millis() as u64;
        let s = self.state();
        let Some(work) = s.base.work.as_ref() else {
            return Ok(());
        };
        for &pid in pids {
            if !s.alive(pid, now) {
                continue;
            }
            if let Some(w) = work.processes.iter().find(|w| w.pid == pid) {
                let rate = w.cpu_ticks as f64 / w.observed_ms.max(1) as f64;
                let cpu = (rate * elapsed_ms as f64) as u64;
                let running = w.running_observations * 2 > w.observations;
                sampler.record(pid, w.start_ticks, cpu, running, wall);
            }
        }
        Ok(())
    }

    fn clock(&self) -> &dyn Clock {
        &self.clock
    }

    fn pin(&mut self, ids: &[Identity]) -> Vec<Result<(), Refusal>> {
        let now = self.clock.now();
        let mut s = self.state();
        s.pinned.clear();
        ids.iter()
            .map(|&id| {
                let p = s.processes.get(&id.pid).ok_or(Refusal::Gone)?;
                if p.start_ticks != Some(id.start_ticks) {
                    return Err(Refusal::Reused {
                        planned: id.start_ticks,
                        now: p.start_ticks,
                    });
                }
                if !s.alive(id.pid, now) {
                    return Err(Refusal::Gone);
                }
                s.pinned.push(id);
                Ok(())
            })
            .collect()
    }

    fn signal(&mut self, id: Identity, sig: Signal) -> Result<(), Refusal> {
        let now = self.clock.now();
        let at = now - self.started;
        let mut s = self.state();
        if !s.pinned.contains(&id) {
            return Err(Refusal::Failed("not pinned at plan time".into()));
        }
        if !s.alive(id.pid, now) {
            return Err(Refusal::Gone);
        }
        let p = s
            .processes
            .get_mut(&id.pid)
            .expect("pinned processes exist");
        let name = if sig == Signal::KILL {
            p.kill_at.get_or_insert(now);
            "KILL"
        } else {
            p.term_at.get_or_insert(now);
            "TERM"
        };
        s.signals.push(SentSignal {
            at,
            pid: id.pid,
            signal: name,
        });
        Ok(())
    }

    fn wait_exits(&mut self, ids: &[Identity], deadline: Instant) -> Vec<Option<Instant>> {
        let exits: Vec<Option<Instant>> = {
            let s = self.state();
            ids.iter()
                .map(|id| {
                    s.processes
                        .get(&id.pid)
                        .and_then(FakeProcess::exit_at)
                        .filter(|&e| e <= deadline)
                })
                .collect()
        };
        let now = self.clock.now();
        let until = if exits.iter().all(Option::is_some) {
            exits.iter().flatten().copied().max().unwrap_or(now)
        } else {
            deadline
        };
        if until > now {
            self.clock.advance(until - now);
        }
        exits.into_iter().map(|e| e.map(|e| e.max(now))).collect()
    }

    fn watch_exits(&mut self, ids: &[Identity]) -> usize {
        let now = self.clock.now();
        let mut s = self.state();
        let watchable: BTreeSet<Identity> = ids
            .iter()
            .copied()
            .filter(|id| {
                // One that exited already stays: the next wait reports it.
                s.processes
                    .get(&id.pid)
                    .is_some_and(|p| p.start_ticks == Some(id.start_ticks))
            })
            .collect();
        let alive = watchable.iter().filter(|id| s.alive(id.pid, now)).count();
        s.watched = watchable;
        alive
    }

    /// Moves the manual clock to the first watched exit or `deadline`, whichever comes
    /// first (`wake` is never readable on a fake node).
    fn wait_watched(
        &mut self,
        deadline: Instant,
        _wake: Option<std::os::fd::BorrowedFd<'_>>,
        _opens: bool,
    ) -> Vec<(Identity, Instant)> {
        let now = self.clock.now();
        let exits: Vec<(Identity, Instant)> = {
            let s = self.state();
            s.watched
                .iter()
                .filter_map(|id| {
                    let at = s.processes.get(&id.pid).and_then(FakeProcess::exit_at)?;
                    Some((*id, at.max(now)))
                })
                .collect()
        };
        let until = exits
            .iter()
            .map(|(_, at)| *at)
            .min()
            .map_or(deadline, |first| first.min(deadline));
        if until > now {
            self.clock.advance(until - now);
        }
        let gone: Vec<(Identity, Instant)> =
            exits.into_iter().filter(|(_, at)| *at <= until).collect();
        let mut s = self.state();
        for (id, _) in &gone {
            s.watched.remove(id);
        }
        gone
    }

    fn why_alive(&self, pid: u32) -> String {
        format!("survived SIGKILL: fake process {pid} is scripted to be unkillable")
    }

    fn remove_segment(
        &mut self,
        segment: &vramguard_core::host::SegmentReport,
    ) -> Result<(), vramguard_proc::host::SegmentRemovalError> {
        let mut state = self.state();
        let found = state
            .base
            .host_memory
            .iter_mut()
            .flat_map(|h| h.shm.iter_mut())
            .filter(|d| d.path == segment.dir)
            .find_map(|d| {
                let i = d.segments.iter().position(|s| s.name == segment.name)?;
                Some((d, i))
            });
        let Some((dir, i)) = found else {
            return Err(vramguard_proc::host::SegmentRemovalError {
                path: std::path::Path::new(&segment.dir).join(&segment.name),
                why: "No such file or directory".into(),
            });
        };
        if dir.segments[i].inode != segment.inode {
            return Err(vramguard_proc::host::SegmentRemovalError {
                path: std::path::Path::new(&segment.dir).join(&segment.name),
                why: "the name now belongs to another file".into(),
            });
        }
        dir.segments.remove(i);
        state.removed_segments.push(segment.name.clone());
        Ok(())
    }
}
