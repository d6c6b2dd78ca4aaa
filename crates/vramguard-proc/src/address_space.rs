//! Reads of processes' address spaces (`cmdline`, `maps`), each with a deadline.
//!
//! The kernel serves these files under the target's mmap lock. A thread stuck in the driver
//! while it holds that lock (an `munmap` of device memory that never returns), or a writer
//! queued behind such a holder, makes every reader wait for as long as it stays stuck: `ps`
//! and `top` hang on such a process, and vramguard did too, on exactly the nodes it is run
//! on. Here those reads run on worker threads. A read past its deadline is given up: its
//! thread is left to finish on its own (the kernel's wait is killable, so it ends with the
//! read or with this process), its pid is not read again while that read is blocked, and the
//! collection goes on with what it could not read unknown.
//!
//! Other `/proc` reads (`stat`, `status`, fd links) take no such lock and stay where they are.

use crate::procfs::ProcFs;
use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long one read of a process's address space may take before it is given up. Such a
/// read takes microseconds; a lock held for a second is held by something stuck.
pub const READ_DEADLINE: Duration = Duration::from_secs(1);

/// Reads given up on whose threads are still blocked, in this process (every pool
/// together: the agent makes a node, and a pool, for each automatic reclaim and each reload).
/// While this many are blocked no new worker is started and nothing more is read from
/// address spaces (all answers are unknown) until one returns: each holds a thread, and a
/// node where this many are stuck needs a person, not more threads. The pools' live workers
/// (at most 8 each) may still be given up meanwhile, so the count can pass the bound by them.
pub const MAX_BLOCKED_READS: usize = 16;

/// Pids with a given-up read still blocked, and how many.
#[derive(Default)]
struct Blocked(Mutex<BTreeMap<u32, usize>>);

/// The process's own: a pool made later must not read a stuck process again.
static PROCESS_BLOCKED: Blocked = Blocked(Mutex::new(BTreeMap::new()));

impl Blocked {
    fn reads(&self) -> usize {
        lock(&self.0).values().sum()
    }

    fn pids(&self) -> Vec<u32> {
        lock(&self.0).keys().copied().collect()
    }

    /// One more read of `pid` given up.
    fn block(&self, pid: u32) {
        *lock(&self.0).entry(pid).or_default() += 1;
    }

    /// A given-up read of `pid` returned.
    fn unblock(&self, pid: u32) {
        let mut blocked = lock(&self.0);
        if let Some(n) = blocked.get_mut(&pid) {
            *n -= 1;
            if *n == 0 {
                blocked.remove(&pid);
            }
        }
    }
}

/// Stack of a reading thread: the reads keep their buffers on the heap.
const WORKER_STACK: usize = 256 * 1024;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking read leaves nothing half-changed behind these locks.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Worker threads for reads of processes' address spaces, kept between collections.
pub struct AddressSpaceReads {
    shared: Arc<Shared>,
    /// Workers at most (the cores the collector reads on).
    threads: usize,
    deadline: Duration,
}

impl std::fmt::Debug for AddressSpaceReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = lock(&self.shared.inner);
        f.debug_struct("AddressSpaceReads")
            .field("threads", &self.threads)
            .field("deadline", &self.deadline)
            .field("workers", &inner.workers.len())
            .finish()
    }
}

/// A test's hook, called with the pid before each read.
#[cfg(test)]
type ReadHook = Arc<dyn Fn(u32) + Send + Sync>;

struct Shared {
    fs: Arc<ProcFs>,
    /// [`PROCESS_BLOCKED`]; a test's own in tests (they run side by side in one process).
    blocked: &'static Blocked,
    inner: Mutex<Inner>,
    /// Idle workers wait here for the next batch.
    work: Condvar,
    /// Called by each worker before each read: how the tests make one process's read hang.
    #[cfg(test)]
    before_read: Mutex<Option<ReadHook>>,
}

#[derive(Default)]
struct Inner {
    /// The batch being read, with its number; `None` between batches.
    batch: Option<(u64, Arc<dyn Batch>)>,
    batches: u64,
    /// The workers still in the pool (given-up ones are dropped from it).
    workers: Vec<Arc<Worker>>,
    closing: bool,
}

/// What one worker is reading, for the deadline.
#[derive(Default)]
struct Worker {
    state: Mutex<WorkerState>,
}

#[derive(Default)]
struct WorkerState {
    /// Batch number, item, pid and when the read began.
    reading: Option<(u64, usize, u32, Instant)>,
    /// The collector gave up on the read: its answer is dropped and the thread ends.
    given_up: bool,
}

/// One read for many pids, type-erased so that one pool serves every kind of read.
trait Batch: Send + Sync {
    fn pid(&self, item: usize) -> u32;
    /// The next item no worker has taken.
    fn claim(&self) -> Option<usize>;
    /// Takes every item not claimed yet (no worker will read them); returns how many.
    fn claim_rest(&self) -> usize;
    /// Whether the item is not to be read at all (an earlier read of its pid is blocked).
    fn skipped(&self, item: usize) -> bool;
    /// Reads the item and keeps the answer unless, by the time it is there, the collector
    /// gave the read up (checked under the worker's lock). Returns whether it was kept.
    fn read(&self, fs: &ProcFs, item: usize, worker: &Worker) -> bool;
    /// One more item answered (or skipped); wakes the collector when all are.
    fn answered(&self);
    /// One more item given up (by the collector).
    fn given_up(&self, items: usize);
    fn all_answered(&self) -> bool;
}

struct TypedBatch<T, F> {
    pids: Vec<u32>,
    skip: HashSet<u32>,
    read: F,
    answers: Vec<Mutex<Option<T>>>,
    next: AtomicUsize,
    done: AtomicUsize,
    waiter: Thread,
}

impl<T, F> Batch for TypedBatch<T, F>
where
    T: Send,
    F: Fn(&ProcFs, u32) -> T + Send + Sync,
{
    fn pid(&self, item: usize) -> u32 {
        self.pids[item]
    }
    fn claim(&self) -> Option<usize> {
        let item = self.next.fetch_add(1, Ordering::Relaxed);
        (item < self.pids.len()).then_some(item)
    }
    fn claim_rest(&self) -> usize {
        let from = self.next.swap(self.pids.len(), Ordering::Relaxed);
        self.pids.len().saturating_sub(from)
    }
    fn skipped(&self, item: usize) -> bool {
        self.skip.contains(&self.pids[item])
    }
    fn read(&self, fs: &ProcFs, item: usize, worker: &Worker) -> bool {
        let answer = (self.read)(fs, self.pids[item]);
        let mut state = lock(&worker.state);
        if state.given_up {
            return false;
        }
        *lock(&self.answers[item]) = Some(answer);
        state.reading = None;
        true
    }
    fn answered(&self) {
        if self.done.fetch_add(1, Ordering::AcqRel) + 1 >= self.pids.len() {
            self.waiter.unpark();
        }
    }
    fn given_up(&self, items: usize) {
        self.done.fetch_add(items, Ordering::AcqRel);
    }
    fn all_answered(&self) -> bool {
        self.done.load(Ordering::Acquire) >= self.pids.len()
    }
}

impl AddressSpaceReads {
    /// Reads in `fs` on up to `threads` workers, each read within `deadline`.
    pub fn new(fs: Arc<ProcFs>, threads: usize, deadline: Duration) -> Self {
        // Tests run side by side in one process: each pool counts its own blocked reads.
        let blocked = if cfg!(test) {
            Box::leak(Box::default())
        } else {
            &PROCESS_BLOCKED
        };
        Self::with_blocked(fs, threads, deadline, blocked)
    }

    fn with_blocked(
        fs: Arc<ProcFs>,
        threads: usize,
        deadline: Duration,
        blocked: &'static Blocked,
    ) -> Self {
        AddressSpaceReads {
            shared: Arc::new(Shared {
                fs,
                blocked,
                inner: Mutex::new(Inner::default()),
                work: Condvar::new(),
                #[cfg(test)]
                before_read: Mutex::new(None),
            }),
            threads: threads.max(1),
            deadline,
        }
    }

    /// The pids with a given-up read still blocked, in this process (sorted).
    pub fn blocked(&self) -> Vec<u32> {
        self.shared.blocked.pids()
    }

    /// The deadline of one read.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// Runs `read` for every pid on the workers and returns the answers in the same order:
    /// `None` for a read given up at its deadline, and, without reading it, for a pid whose
    /// earlier read is still blocked (and for all when [`MAX_BLOCKED_READS`] are, or no
    /// thread can be started: never a read without a deadline).
    pub fn each<T, F>(&self, pids: &[u32], read: F) -> Vec<Option<T>>
    where
        T: Send + 'static,
        F: Fn(&ProcFs, u32) -> T + Send + Sync + 'static,
    {
        if pids.is_empty() {
            return Vec::new();
        }
        let mut inner = lock(&self.shared.inner);
        let batch = Arc::new(TypedBatch {
            pids: pids.to_vec(),
            skip: self.shared.blocked.pids().into_iter().collect(),
            read,
            answers: pids.iter().map(|_| Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            waiter: std::thread::current(),
        });
        let want = self.threads.min(pids.len());
        // A thread that cannot be started (a limit) leaves fewer workers, or none: then,
        // as with too many reads blocked, nothing is read.
        let _ = self.start_workers(&mut inner, want);
        if inner.workers.is_empty() {
            return pids.iter().map(|_| None).collect();
        }
        inner.batches += 1;
        let number = inner.batches;
        let erased: Arc<dyn Batch> = batch.clone();
        inner.batch = Some((number, erased));
        self.shared.work.notify_all();
        drop(inner);
        // Wake at a quarter of the deadline to look for overdue reads: a read is given up at
        // most a quarter late.
        let tick = (self.deadline / 4).max(Duration::from_millis(1));
        while !batch.all_answered() {
            std::thread::park_timeout(tick);
            if !batch.all_answered() {
                self.give_up_overdue(number, &*batch, want);
            }
        }
        lock(&self.shared.inner).batch = None;
        batch
            .answers
            .iter()
            .map(|a| lock(a).take())
            .collect::<Vec<Option<T>>>()
    }

    /// Starts workers until there are `want`, while fewer than [`MAX_BLOCKED_READS`] reads
    /// are blocked. An error when a thread could not be started.
    fn start_workers(&self, inner: &mut Inner, want: usize) -> std::io::Result<()> {
        while inner.workers.len() < want && self.shared.blocked.reads() < MAX_BLOCKED_READS {
            let worker = Arc::new(Worker::default());
            let (shared, me) = (self.shared.clone(), worker.clone());
            std::thread::Builder::new()
                .name("vramguard-mm-read".into())
                .stack_size(WORKER_STACK)
                .spawn(move || work(shared, me))?;
            inner.workers.push(worker);
        }
        Ok(())
    }

    /// Gives up every read of batch `number` past its deadline: the worker leaves the pool
    /// (it ends when its read returns), the pid is marked blocked, and a new worker takes
    /// its place. With no worker left and none to be started, the items nobody took are
    /// given up too.
    fn give_up_overdue(&self, number: u64, batch: &dyn Batch, want: usize) {
        let now = Instant::now();
        let mut inner = lock(&self.shared.inner);
        let mut given_up = Vec::new();
        inner.workers.retain(|w| {
            let mut state = lock(&w.state);
            match state.reading {
                Some((n, _, pid, since))
                    if n == number && now.saturating_duration_since(since) >= self.deadline =>
                {
                    state.given_up = true;
                    given_up.push(pid);
                    false
                }
                _ => true,
            }
        });
        if given_up.is_empty() {
            return;
        }
        for pid in &given_up {
            self.shared.blocked.block(*pid);
        }
        batch.given_up(given_up.len());
        let _ = self.start_workers(&mut inner, want);
        if inner.workers.is_empty() {
            batch.given_up(batch.claim_rest());
        } else {
            self.shared.work.notify_all();
        }
    }

    /// Makes every read of `pid` call `hook` first (on the worker, before reading).
    #[cfg(test)]
    pub(crate) fn before_read(&self, hook: ReadHook) {
        *lock(&self.shared.before_read) = Some(hook);
    }
}

impl Drop for AddressSpaceReads {
    fn drop(&mut self) {
        lock(&self.shared.inner).closing = true;
        self.shared.work.notify_all();
    }
}

/// A worker: reads the items of each batch until none is left, then waits for the next.
fn work(shared: Arc<Shared>, me: Arc<Worker>) {
    let mut last = 0;
    loop {
        let (number, batch) = {
            let mut inner = lock(&shared.inner);
            loop {
                if inner.closing {
                    return;
                }
                match &inner.batch {
                    Some((n, b)) if *n != last => break (*n, b.clone()),
                    _ => {}
                }
                inner = shared
                    .work
                    .wait(inner)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        };
        last = number;
        while let Some(item) = batch.claim() {
            if batch.skipped(item) {
                batch.answered();
                continue;
            }
            let pid = batch.pid(item);
            lock(&me.state).reading = Some((number, item, pid, Instant::now()));
            #[cfg(test)]
            {
                let hook = lock(&shared.before_read).clone();
                if let Some(hook) = hook {
                    hook(pid);
                }
            }
            let kept = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                batch.read(&shared.fs, item, &me)
            }));
            let kept = match kept {
                Ok(kept) => kept,
                // A read that panicked answers nothing (unknown), and the worker goes on.
                Err(_) => {
                    let mut state = lock(&me.state);
                    if !state.given_up {
                        state.reading = None;
                    }
                    !state.given_up
                }
            };
            if !kept {
                // Given up while blocked: no longer one of the pool's workers.
                shared.blocked.unblock(pid);
                return;
            }
            batch.answered();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    fn reads(threads: usize, deadline_ms: u64) -> (AddressSpaceReads, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let fs = Arc::new(ProcFs::open(dir.path()).unwrap());
        (
            AddressSpaceReads::new(fs, threads, Duration::from_millis(deadline_ms)),
            dir,
        )
    }

    /// A hook under which reads of pid `stuck` block until the returned sender is sent to
    /// (one read) or dropped (all, and none after).
    fn hang(reads: &AddressSpaceReads, stuck: u32) -> mpsc::Sender<()> {
        let (release, wait) = mpsc::channel::<()>();
        let wait = Mutex::new(wait);
        reads.before_read(Arc::new(move |pid| {
            if pid == stuck {
                let _ = lock(&wait).recv();
            }
        }));
        release
    }

    #[test]
    fn every_pid_is_read_in_order() {
        let (reads, _dir) = reads(3, 1000);
        let pids: Vec<u32> = (1..=200).collect();
        let got = reads.each(&pids, |_, pid| pid * 2);
        assert_eq!(got, pids.iter().map(|p| Some(p * 2)).collect::<Vec<_>>());
        // Again on the same workers.
        assert_eq!(reads.each(&[7], |_, pid| pid), vec![Some(7)]);
        assert!(reads.blocked().is_empty());
    }

    /// The seed of this module: one process whose read never returns costs its deadline,
    /// not the collection; the others are read, and its pid is not read again (no second
    /// thread lost to it) until the blocked read returns.
    #[test]
    fn a_read_that_hangs_is_given_up_at_its_deadline_and_its_pid_is_not_read_again() {
        let (reads, _dir) = reads(2, 200);
        let release = hang(&reads, 13);
        let pids: Vec<u32> = (1..=40).collect();
        let began = Instant::now();
        let got = reads.each(&pids, |_, pid| pid);
        let took = began.elapsed();
        assert!(
            took >= Duration::from_millis(200),
            "given up early: {took:?}"
        );
        assert!(took < Duration::from_secs(5), "not given up: {took:?}");
        for (pid, answer) in pids.iter().zip(&got) {
            assert_eq!(*answer, (*pid != 13).then_some(*pid), "pid {pid}");
        }
        assert_eq!(reads.blocked(), vec![13]);
        // Still blocked: answered at once, unread.
        let began = Instant::now();
        assert_eq!(reads.each(&[13, 14], |_, pid| pid), vec![None, Some(14)]);
        assert!(began.elapsed() < Duration::from_millis(150));
        // The read returns (and later ones of pid 13 do not hang): the pid is read again.
        drop(release);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !reads.blocked().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(reads.blocked().is_empty());
        assert_eq!(reads.each(&[13], |_, pid| pid), vec![Some(13)]);
    }

    /// Review finding: the agent makes a new node, and pool, for each automatic reclaim and
    /// reload. A later pool must not read a pid another pool's read of is still blocked on
    /// (each would leave one more stuck thread), and the bound counts them all.
    #[test]
    fn a_pid_blocked_in_one_pool_is_not_read_by_another() {
        let dir = tempfile::tempdir().unwrap();
        let fs = Arc::new(ProcFs::open(dir.path()).unwrap());
        let blocked: &'static Blocked = Box::leak(Box::default());
        let deadline = Duration::from_millis(100);
        let first = AddressSpaceReads::with_blocked(fs.clone(), 2, deadline, blocked);
        let release = hang(&first, 13);
        assert_eq!(first.each(&[12, 13], |_, pid| pid), vec![Some(12), None]);
        let second = AddressSpaceReads::with_blocked(fs, 2, deadline, blocked);
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        second.before_read(Arc::new(move |pid| {
            if pid == 13 {
                counted.fetch_add(1, Ordering::SeqCst);
            }
        }));
        assert_eq!(second.each(&[13, 14], |_, pid| pid), vec![None, Some(14)]);
        assert_eq!(
            tries.load(Ordering::SeqCst),
            0,
            "read again by the second pool"
        );
        assert_eq!(second.blocked(), vec![13]);
        drop(release);
    }

    /// A read that panics answers nothing; the worker goes on, and nothing counts as blocked.
    #[test]
    fn a_read_that_panics_answers_unknown_and_blocks_nothing() {
        let (reads, _dir) = reads(1, 1000);
        let got = reads.each(&[1, 2, 3], |_, pid| {
            assert!(pid != 2, "a read that panics");
            pid
        });
        assert_eq!(got, vec![Some(1), None, Some(3)]);
        assert!(reads.blocked().is_empty());
        assert_eq!(reads.each(&[4], |_, pid| pid), vec![Some(4)]);
    }

    /// Each blocked read holds a thread: past the bound nothing more is read (answers are
    /// unknown at once) until one returns.
    #[test]
    fn blocked_reads_are_bounded() {
        let (reads, _dir) = reads(1, 20);
        let (release, wait) = mpsc::channel::<()>();
        let wait = Mutex::new(wait);
        reads.before_read(Arc::new(move |pid| {
            if pid >= 1000 {
                let _ = lock(&wait).recv();
            }
        }));
        let hanging: Vec<u32> = (1000..1000 + MAX_BLOCKED_READS as u32 + 4).collect();
        let got = reads.each(&hanging, |_, pid| pid);
        assert!(got.iter().all(Option::is_none));
        assert_eq!(reads.blocked().len(), MAX_BLOCKED_READS);
        let began = Instant::now();
        assert_eq!(reads.each(&[1, 2], |_, pid| pid), vec![None, None]);
        assert!(began.elapsed() < Duration::from_millis(100));
        // One returns: a worker can be started again.
        release.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while reads.blocked().len() == MAX_BLOCKED_READS && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(reads.each(&[1, 2], |_, pid| pid), vec![Some(1), Some(2)]);
        drop(release);
    }
}
