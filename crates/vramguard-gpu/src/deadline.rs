//! A deadline on every driver call.
//!
//! A GPU in a bad state can block an NVML call for tens of seconds (calls that hang before
//! `GPU_IS_LOST` or `TIMEOUT`), and a driver in trouble can block every call. vramguard must
//! still answer: `status` in a failing job's OOM hook, the agent's next sample. So the calls
//! run on worker threads ("lanes"): one for the driver-wide calls and one per GPU. The caller
//! waits for each at most the call timeout; a GPU that has not answered by then is reported
//! as not answering (its last known identity kept) while the others are shown. A lane whose
//! call is still blocked gets no new call: until it comes back, that GPU is reported at once
//! as still not answering, so a stuck GPU costs one timeout, not one per sample, and never a
//! pile of blocked threads.

use crate::{DriverHead, DriverSample, GpuReader, GpuSource, SourceError, now_ms, unreachable_gpu};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use vramguard_core::snapshot::{CallError, GpuSample};

type Job = Box<dyn FnOnce() + Send>;

/// One worker thread, and how many of the calls given to it have come back.
struct Lane {
    jobs: Sender<Job>,
    given: u64,
    finished: Arc<AtomicU64>,
    /// When the last call was given.
    given_at: Instant,
    /// Set when a wait for the last call timed out: it is blocked since then.
    stalled: bool,
}

impl Lane {
    fn start(name: String) -> Option<Lane> {
        let (jobs, queue) = mpsc::channel::<Job>();
        let finished = Arc::new(AtomicU64::new(0));
        let count = Arc::clone(&finished);
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for job in queue {
                    job();
                    count.fetch_add(1, Ordering::AcqRel);
                }
            })
            .ok()?;
        Some(Lane {
            jobs,
            given: 0,
            finished,
            given_at: Instant::now(),
            stalled: false,
        })
    }

    /// When the call that timed out was given, while it is still blocked.
    fn still_blocked(&mut self) -> Option<Instant> {
        if self.finished.load(Ordering::Acquire) >= self.given {
            self.stalled = false;
        }
        self.stalled.then_some(self.given_at)
    }

    /// Gives `call` to the thread; its answer arrives in the returned reply.
    fn submit<T: Send + 'static>(
        &mut self,
        call: impl FnOnce() -> T + Send + 'static,
    ) -> Option<Arc<Reply<T>>> {
        let reply = Arc::new(Reply::default());
        let answer = Answer(Some(Arc::clone(&reply)));
        let job: Job = Box::new(move || {
            // The caller may have given up waiting: then the answer has nobody to read it.
            answer.give(call());
        });
        self.jobs.send(job).ok()?;
        self.given += 1;
        self.given_at = Instant::now();
        Some(reply)
    }
}

/// One call's answer, from its lane to the caller. A mutex and a condition variable: a std
/// channel allocated a cache-aligned block per call, which glibc's `posix_memalign` made a
/// twelfth of the agent's CPU per sample.
struct Reply<T> {
    slot: Mutex<Option<Result<T, Panicked>>>,
    ready: Condvar,
}

impl<T> Default for Reply<T> {
    fn default() -> Self {
        Reply {
            slot: Mutex::new(None),
            ready: Condvar::new(),
        }
    }
}

/// The call ended without an answer: it panicked.
struct Panicked;

/// Why no answer came.
enum NoAnswer {
    Timeout,
    Panicked,
}

impl<T> Reply<T> {
    fn put(&self, answer: Result<T, Panicked>) {
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        slot.get_or_insert(answer);
        self.ready.notify_one();
    }

    /// The answer, waiting at most `left` for it.
    fn wait(&self, left: Duration) -> Result<T, NoAnswer> {
        let slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        let (mut slot, _) = self
            .ready
            .wait_timeout_while(slot, left, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        match slot.take() {
            Some(Ok(answer)) => Ok(answer),
            Some(Err(Panicked)) => Err(NoAnswer::Panicked),
            None => Err(NoAnswer::Timeout),
        }
    }
}

/// The lane's side of a [`Reply`]: dropped without an answer (the call panicked), it says so,
/// as a channel's disconnection did.
struct Answer<T>(Option<Arc<Reply<T>>>);

impl<T> Answer<T> {
    fn give(mut self, answer: T) {
        if let Some(reply) = self.0.take() {
            reply.put(Ok(answer));
        }
    }
}

impl<T> Drop for Answer<T> {
    fn drop(&mut self) {
        if let Some(reply) = self.0.take() {
            reply.put(Err(Panicked));
        }
    }
}

/// Wraps a [`GpuReader`] so that no driver call holds the caller longer than the timeout.
pub struct DeadlineSource<R: GpuReader> {
    reader: Arc<R>,
    timeout: Duration,
    driver: Option<Lane>,
    gpus: Vec<Option<Lane>>,
    /// The last good sample's identity of each GPU, to name a GPU that stopped answering.
    known: Vec<Option<KnownGpu>>,
    /// The driver-wide answers of the last full sample, which settled readings reuse.
    head: Option<DriverHead>,
}

/// What names a GPU (a whole sample, with its process list, was cloned at every sample).
#[derive(Debug, Clone, PartialEq)]
struct KnownGpu {
    uuid: Option<String>,
    name: Option<String>,
    pci_bus_id: Option<String>,
    minor_number: Option<u32>,
}

impl KnownGpu {
    fn matches(&self, s: &GpuSample) -> bool {
        self.uuid == s.uuid
            && self.name == s.name
            && self.pci_bus_id == s.pci_bus_id
            && self.minor_number == s.minor_number
    }
}

impl<R: GpuReader> std::fmt::Debug for DeadlineSource<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadlineSource")
            .field("timeout", &self.timeout)
            .field("gpus", &self.gpus.len())
            .finish()
    }
}

/// The error of a call that did not come back within `timeout`, or that is still blocked
/// since an earlier sample.
fn not_answering(what: &str, timeout: Duration, since: Option<Instant>) -> CallError {
    let message = match since {
        Some(at) => format!(
            "not answering: a driver call made {:.0?} ago is still blocked",
            at.elapsed()
        ),
        None => format!("not answering: no reply within {timeout:?}"),
    };
    CallError {
        call: what.to_string(),
        code: None,
        message: format!(
            "{message} (a GPU in a bad state; see `dmesg | grep -iE 'xid|nvrm'`, and `nvidia-smi -q -i` for it)"
        ),
    }
}

impl<R: GpuReader> DeadlineSource<R> {
    /// Reads through `reader`, waiting at most `timeout` for any driver call.
    pub fn new(reader: R, timeout: Duration) -> Self {
        DeadlineSource {
            reader: Arc::new(reader),
            timeout,
            driver: None,
            gpus: Vec::new(),
            known: Vec::new(),
            head: None,
        }
    }

    /// Opens the reader with `open` (`nvmlInit_v2`, which can block like any call) and reads
    /// through it, waiting at most `timeout` for the opening or any later call.
    pub fn open(
        timeout: Duration,
        open: impl FnOnce() -> Result<R, SourceError> + Send + 'static,
    ) -> Result<Self, SourceError> {
        let (tx, rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("nvml-init".into())
            .spawn(move || {
                let _ = tx.send(open());
            })
            .map_err(|e| SourceError::Backend(Box::new(e)))?;
        match rx.recv_timeout(timeout) {
            Ok(reader) => Ok(DeadlineSource::new(reader?, timeout)),
            Err(_) => Err(SourceError::Init {
                error: not_answering("nvmlInit_v2", timeout, None),
                advice: crate::init_advice(None),
            }),
        }
    }

    /// The reader, for calls that are not made through the deadline (resets, tests).
    pub fn reader(&self) -> &R {
        &self.reader
    }

    fn lane(&mut self, gpu: Option<u32>) -> Option<&mut Lane> {
        let slot = match gpu {
            None => &mut self.driver,
            Some(i) => {
                let i = i as usize;
                if self.gpus.len() <= i {
                    self.gpus.resize_with(i + 1, || None);
                }
                &mut self.gpus[i]
            }
        };
        if slot.is_none() {
            let name = match gpu {
                None => "nvml-driver".to_string(),
                Some(i) => format!("nvml-gpu{i}"),
            };
            *slot = Lane::start(name);
        }
        slot.as_mut()
    }

    /// Runs `call` on `gpu`'s lane (the driver's with `None`) and waits until `deadline`.
    fn call_until<T: Send + 'static>(
        &mut self,
        gpu: Option<u32>,
        what: &str,
        deadline: Instant,
        call: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, CallError> {
        let timeout = self.timeout;
        let rx = self.start_call(gpu, what, call)?;
        self.wait(gpu, what, timeout, deadline, rx)
    }

    fn start_call<T: Send + 'static>(
        &mut self,
        gpu: Option<u32>,
        what: &str,
        call: impl FnOnce() -> T + Send + 'static,
    ) -> Result<Arc<Reply<T>>, CallError> {
        let timeout = self.timeout;
        let Some(lane) = self.lane(gpu) else {
            return Err(CallError {
                call: what.to_string(),
                code: None,
                message: "no thread could be started to make the call".into(),
            });
        };
        if let Some(since) = lane.still_blocked() {
            return Err(not_answering(what, timeout, Some(since)));
        }
        lane.submit(call)
            .ok_or_else(|| not_answering(what, timeout, None))
    }

    fn wait<T>(
        &mut self,
        gpu: Option<u32>,
        what: &str,
        timeout: Duration,
        deadline: Instant,
        rx: Arc<Reply<T>>,
    ) -> Result<T, CallError> {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.wait(left) {
            Ok(answer) => Ok(answer),
            Err(NoAnswer::Timeout) => {
                if let Some(lane) = self.lane(gpu) {
                    lane.stalled = true;
                }
                Err(not_answering(what, timeout, None))
            }
            Err(NoAnswer::Panicked) => Err(CallError {
                call: what.to_string(),
                code: None,
                message: "the call panicked".into(),
            }),
        }
    }

    /// A sample for a GPU that did not answer, named as it was last seen.
    fn silent_gpu(&self, index: u32, error: CallError) -> GpuSample {
        let mut sample = unreachable_gpu(index, error);
        if let Some(Some(known)) = self.known.get(index as usize) {
            sample.uuid = known.uuid.clone();
            sample.name = known.name.clone();
            sample.pci_bus_id = known.pci_bus_id.clone();
            sample.minor_number = known.minor_number;
        }
        sample
    }
}

impl<R: GpuReader> DeadlineSource<R> {
    /// Every GPU `head` counts, each read by `read` on its own lane: every read starts before
    /// any is waited for, so they run side by side and the whole sample waits at most one
    /// timeout. A GPU's identity is remembered from a `full` reading.
    fn read_every_gpu(
        &mut self,
        head: &DriverHead,
        full: bool,
        read: impl Fn(&R, u32, &DriverHead) -> GpuSample + Send + Sync + Clone + 'static,
    ) -> Vec<GpuSample> {
        self.reader.begin_sample();
        let started: Vec<_> = (0..head.count)
            .map(|index| {
                let reader = Arc::clone(&self.reader);
                let h = head.clone();
                let read = read.clone();
                (
                    index,
                    self.start_call(Some(index), "reading the GPU", move || {
                        read(&reader, index, &h)
                    }),
                )
            })
            .collect();
        let deadline = Instant::now() + self.timeout;
        let mut gpus = Vec::with_capacity(started.len());
        for (index, rx) in started {
            let timeout = self.timeout;
            let answer =
                rx.and_then(|rx| self.wait(Some(index), "reading the GPU", timeout, deadline, rx));
            gpus.push(match answer {
                Ok(sample) => {
                    if full {
                        self.remember(&sample);
                    }
                    sample
                }
                Err(error) => self.silent_gpu(index, error),
            });
        }
        self.reader.end_sample();
        gpus
    }

    /// Keeps `sample`'s identity, to name its GPU if it stops answering.
    fn remember(&mut self, sample: &GpuSample) {
        let i = sample.index as usize;
        if self.known.len() <= i {
            self.known.resize(i + 1, None);
        }
        if sample.uuid.is_some() && !self.known[i].as_ref().is_some_and(|k| k.matches(sample)) {
            self.known[i] = Some(KnownGpu {
                uuid: sample.uuid.clone(),
                name: sample.name.clone(),
                pci_bus_id: sample.pci_bus_id.clone(),
                minor_number: sample.minor_number,
            });
        }
    }
}

impl<R: GpuReader> GpuSource for DeadlineSource<R> {
    /// Stops the lanes and waits (at most the call timeout) until no call holds the reader,
    /// so that dropping this source right after drops the reader (NVML's shutdown, closing
    /// its device files) before a reset runs. A call still blocked in the driver keeps it:
    /// the reset then names this process as what holds the GPU. Lanes start again at the
    /// next call.
    fn release(&mut self) {
        // A call already known to be blocked will not come back within the timeout either.
        let stalled = self
            .driver
            .iter()
            .chain(self.gpus.iter().flatten())
            .any(|lane| lane.stalled);
        self.driver = None;
        self.gpus.clear();
        if stalled {
            return;
        }
        let deadline = Instant::now() + self.timeout;
        while Arc::strong_count(&self.reader) > 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn sample(&mut self, utilization_window: Duration) -> Result<DriverSample, SourceError> {
        let reader = Arc::clone(&self.reader);
        let deadline = Instant::now() + self.timeout;
        let head = self
            .call_until(None, "nvmlDeviceGetCount_v2", deadline, move || {
                reader.head()
            })
            .map_err(SourceError::Call)??;
        self.head = Some(head.clone());
        let now = now_ms();
        let since = now.saturating_sub(utilization_window.as_millis() as u64);
        let gpus = self.read_every_gpu(&head, true, move |reader, index, head| {
            reader.read_gpu(index, head, now, since)
        });
        Ok(DriverSample {
            driver: head.driver,
            gpus,
        })
    }

    fn settled(&mut self) -> Result<DriverSample, SourceError> {
        // The driver-wide calls are not made again: a GPU that went away fails its own
        // reading, and the full samples that follow count the GPUs anew.
        let Some(head) = self.head.clone() else {
            return self.sample(Duration::ZERO);
        };
        let gpus = self.read_every_gpu(&head, false, |reader, index, head| {
            reader.read_gpu_settled(index, head)
        });
        Ok(DriverSample {
            driver: head.driver,
            gpus,
        })
    }

    fn memory_used(&mut self, gpu: u32) -> Result<u64, CallError> {
        let reader = Arc::clone(&self.reader);
        let deadline = Instant::now() + self.timeout;
        self.call_until(
            Some(gpu),
            "nvmlDeviceGetMemoryInfo_v2",
            deadline,
            move || reader.memory_used(gpu),
        )?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DriverHead;
    use std::sync::Mutex;
    use vramguard_core::snapshot::{DriverFacts, DriverSource};

    /// A reader whose GPUs answer after a scripted delay.
    #[derive(Default)]
    struct Slow {
        delays: Mutex<Vec<Duration>>,
        reads: Mutex<Vec<u32>>,
        settled_reads: Mutex<Vec<u32>>,
        heads: AtomicU64,
    }

    impl GpuReader for Slow {
        fn head(&self) -> Result<DriverHead, SourceError> {
            self.heads.fetch_add(1, Ordering::SeqCst);
            Ok(DriverHead {
                driver: DriverFacts {
                    source: DriverSource::Simulated,
                    library: None,
                    driver_version: None,
                    nvml_version: None,
                },
                count: self.delays.lock().unwrap().len() as u32,
            })
        }
        fn read_gpu(&self, index: u32, _: &DriverHead, _: u64, _: u64) -> GpuSample {
            self.reads.lock().unwrap().push(index);
            self.answer(index)
        }
        fn read_gpu_settled(&self, index: u32, _: &DriverHead) -> GpuSample {
            self.settled_reads.lock().unwrap().push(index);
            // What a settled reading leaves unread.
            GpuSample {
                name: None,
                ..self.answer(index)
            }
        }
        fn memory_used(&self, gpu: u32) -> Result<u64, CallError> {
            std::thread::sleep(self.delays.lock().unwrap()[gpu as usize]);
            Ok(7)
        }
    }

    impl Slow {
        fn answer(&self, index: u32) -> GpuSample {
            let delay = self.delays.lock().unwrap()[index as usize];
            std::thread::sleep(delay);
            let mut s = unreachable_gpu(
                index,
                CallError {
                    call: "x".into(),
                    code: None,
                    message: "y".into(),
                },
            );
            s.failure = None;
            s.uuid = Some(format!("GPU-{index}"));
            s
        }
    }

    fn slow(delays: &[u64]) -> DeadlineSource<Slow> {
        DeadlineSource::new(
            Slow {
                delays: Mutex::new(delays.iter().map(|&ms| Duration::from_millis(ms)).collect()),
                reads: Mutex::new(Vec::new()),
                settled_reads: Mutex::new(Vec::new()),
                heads: AtomicU64::new(0),
            },
            Duration::from_millis(300),
        )
    }

    #[test]
    fn a_stalled_gpu_is_reported_as_not_answering_and_the_others_are_read() {
        let mut source = slow(&[0, 5_000, 0]);
        let started = Instant::now();
        let sample = source.sample(Duration::from_secs(1)).unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "waited for the stall"
        );
        assert_eq!(sample.gpus.len(), 3);
        assert!(sample.gpus[0].failure.is_none());
        assert!(sample.gpus[2].failure.is_none());
        let failure = sample.gpus[1].failure.as_ref().expect("GPU 1 stalled");
        assert!(failure.message.contains("not answering"), "{failure}");
    }

    #[test]
    fn a_gpu_still_blocked_gets_no_second_call_and_is_named_as_last_seen() {
        let mut source = slow(&[0, 0]);
        source.sample(Duration::from_secs(1)).unwrap();
        source.reader.delays.lock().unwrap()[1] = Duration::from_secs(5);
        source.sample(Duration::from_secs(1)).unwrap();
        let started = Instant::now();
        let third = source.sample(Duration::from_secs(1)).unwrap();
        assert!(
            started.elapsed() < Duration::from_millis(250),
            "a GPU known to be blocked was waited for again: {:?}",
            started.elapsed()
        );
        let failure = third.gpus[1].failure.as_ref().expect("still blocked");
        assert!(failure.message.contains("still blocked"), "{failure}");
        assert_eq!(third.gpus[1].uuid.as_deref(), Some("GPU-1"));
        let reads = source.reader.reads.lock().unwrap().clone();
        assert_eq!(reads.iter().filter(|&&i| i == 1).count(), 2, "{reads:?}");
    }

    /// A settled reading (the agent's quiet samples) reads the GPUs the last full sample
    /// counted, without the driver-wide calls, and does not make what it left unread the
    /// name a GPU that stops answering is known by.
    #[test]
    fn a_settled_reading_reuses_the_last_count_and_keeps_the_known_names() {
        let mut src = slow(&[0, 0]);
        let first = src.settled().unwrap();
        assert_eq!(first.gpus.len(), 2);
        assert_eq!(
            src.reader().heads.load(Ordering::SeqCst),
            1,
            "no full sample yet: a full one"
        );
        let sorted = |v: &Mutex<Vec<u32>>| {
            let mut v = v.lock().unwrap().clone();
            v.sort_unstable();
            v
        };
        assert_eq!(sorted(&src.reader().reads), [0, 1]);
        assert!(src.reader().settled_reads.lock().unwrap().is_empty());
        let named = |s: &GpuSample| s.uuid.clone();
        assert_eq!(
            src.sample(Duration::ZERO)
                .unwrap()
                .gpus
                .iter()
                .map(named)
                .collect::<Vec<_>>(),
            [Some("GPU-0".into()), Some("GPU-1".into())]
        );
        assert_eq!(src.reader().heads.load(Ordering::SeqCst), 2);
        let settled = src.settled().unwrap();
        assert_eq!(src.reader().heads.load(Ordering::SeqCst), 2, "no head call");
        assert_eq!(sorted(&src.reader().settled_reads), [0, 1]);
        assert_eq!(settled.gpus.len(), 2);
        assert_eq!(src.known[1].as_ref().unwrap().name, None, "never read");
        // GPU 1 stalls in a settled reading: it is named as the full sample last saw it.
        src.known[1].as_mut().unwrap().name = Some("seen".into());
        let _ = src.settled().unwrap();
        assert_eq!(src.known[1].as_ref().unwrap().name.as_deref(), Some("seen"));
        src.reader().delays.lock().unwrap()[1] = Duration::from_secs(2);
        let stalled = src.settled().unwrap();
        assert!(stalled.gpus[1].failure.is_some());
        assert_eq!(stalled.gpus[1].uuid.as_deref(), Some("GPU-1"));
        assert_eq!(stalled.gpus[1].name.as_deref(), Some("seen"));
    }

    #[test]
    fn a_gpu_that_comes_back_is_read_again() {
        let mut source = slow(&[400]);
        let first = source.sample(Duration::from_secs(1)).unwrap();
        assert!(first.gpus[0].failure.is_some());
        source.reader.delays.lock().unwrap()[0] = Duration::ZERO;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = source.sample(Duration::from_secs(1)).unwrap();
            if s.gpus[0].failure.is_none() {
                break;
            }
            assert!(Instant::now() < deadline, "GPU 0 never read again");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_call_that_panics_is_said_at_once_not_waited_for() {
        // A call timeout far above what a panicking lane takes even on a loaded machine (a
        // 250 ms bound under a 300 ms timeout failed once under CI's load).
        let mut source = DeadlineSource::new(
            Slow {
                delays: Mutex::new(vec![Duration::ZERO]),
                ..Slow::default()
            },
            Duration::from_secs(20),
        );
        let started = Instant::now();
        // GPU 5 is past the scripted delays: the call panics on its lane.
        let error = source.memory_used(5).unwrap_err();
        assert_eq!(error.message, "the call panicked");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the panic was waited for as a timeout: {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn an_init_that_blocks_is_an_error_after_the_timeout() {
        let started = Instant::now();
        let error = DeadlineSource::open(Duration::from_millis(200), || {
            std::thread::sleep(Duration::from_secs(5));
            Ok(Slow::default())
        })
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert!(error.to_string().contains("nvmlInit_v2"), "{error}");
        assert!(error.to_string().contains("not answering"), "{error}");
    }

    #[test]
    fn memory_used_has_the_deadline_too() {
        let mut source = slow(&[2_000]);
        let started = Instant::now();
        let error = source.memory_used(0).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert!(error.message.contains("not answering"), "{error}");
    }
}
