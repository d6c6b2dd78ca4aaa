//! The agent's metrics, in OpenMetrics text through `prometheus-client`.
//!
//! Names follow node_exporter: `vramguard_<subsystem>_<name>_<unit>`. Gauges describing the
//! current state are refilled from each sample (a GPU or holder that disappears disappears from
//! the scrape); counters and the release-lag histogram accumulate. The text is rendered once
//! per sample and served as-is: a scrape never touches NVML or `/proc`.
//!
//! Cardinality is bounded: per GPU, the `top_holders` largest holders get their own
//! `vramguard_holder_memory_bytes` series; the rest are summed per class under
//! `pid="other"`. Nothing else is labelled with a pid.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use vramguard_core::report::{Class, Report};
use vramguard_core::snapshot::GpuHealth;
use vramguard_core::trend::Trend;

type F64Gauge = Gauge<f64, AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
    uuid: String,
    model: String,
    /// DCGM's spelling of the same (`UUID`, `modelName`) and `Hostname`, with
    /// `[agent] dcgm_labels`: what joins with dcgm-exporter's series.
    #[prometheus(flatten)]
    dcgm: LabelList,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    gpu: String,
    uuid: String,
    model: String,
    #[prometheus(flatten)]
    dcgm: LabelList,
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HolderLabels {
    gpu: String,
    uuid: String,
    model: String,
    #[prometheus(flatten)]
    dcgm: LabelList,
    pid: String,
    comm: String,
    class: String,
    container: String,
    pod_uid: String,
    /// The holder's job (`slurm:42.0`, `unit:train.service`, `pgid:4121`).
    job: String,
    /// Who to charge, in the names other exporters use: `slurm_job`, `user` (and `namespace`,
    /// `pod` where known); only those known.
    #[prometheus(flatten)]
    owner: LabelList,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuOnly {
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirLabels {
    dir: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabels {
    step: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeStepLabels {
    node: String,
    step: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    rule: String,
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DriverLabels {
    driver_version: String,
    nvml_version: String,
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct XidLabels {
    gpu: String,
    xid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    gpu: String,
    uuid: String,
    model: String,
    #[prometheus(flatten)]
    dcgm: LabelList,
    cause: String,
}

/// Whom a holder's memory is charged to, in the label names dcgm-exporter and Slurm exporters
/// use: its Slurm job id (from a `job_N` cgroup) and its user.
fn owner_labels(h: &vramguard_core::Holder) -> LabelList {
    let slurm_job = h
        .job
        .as_ref()
        .filter(|j| j.kind == vramguard_core::job::JobKind::Slurm)
        .and_then(|j| j.label.strip_prefix("slurm:"))
        .map(|l| l.split('.').next().unwrap_or(l).to_string())
        .unwrap_or_default();
    let user = h
        .user
        .clone()
        .or_else(|| h.uid.map(|u| u.to_string()))
        .unwrap_or_default();
    let (namespace, pod) = h
        .pod
        .as_ref()
        .map(|p| (p.namespace.as_str(), p.name.as_str()))
        .unwrap_or_default();
    LabelList::default()
        .with("namespace", namespace)
        .with("pod", pod)
        .with("slurm_job", &slurm_job)
        .with("user", &user)
}

/// Labels present only when they have a value (an empty label is noise in every scrape).
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
struct LabelList(Vec<(String, String)>);

impl LabelList {
    fn with(mut self, key: &str, value: &str) -> LabelList {
        if !value.is_empty() {
            self.0.push((key.into(), shown(value)));
        }
        self
    }
}

impl EncodeLabelSet for LabelList {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }
}

/// Buckets of the release-lag histogram, seconds: a few hundred ms is normal, tens of seconds
/// have been seen on large GPUs.
const LAG_BUCKETS: [f64; 11] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0];

fn lag_histogram() -> Histogram {
    Histogram::new(LAG_BUCKETS)
}

/// Every metric the agent exports.
pub struct Metrics {
    registry: Registry,
    /// Held while [`Metrics::update`] clears and refills the state series, and while
    /// [`Metrics::render`] encodes them: a scrape never sees a half-refilled sample.
    refill: std::sync::Mutex<()>,
    /// The agent's own heap in use, when tracked ([`Metrics::track_own_heap`]).
    heap: Option<Gauge>,
    /// Device opens watched (1) or not (0), and the openers seen, when tracked
    /// ([`Metrics::track_open_watch`]).
    open_watch: Option<(Gauge, Counter)>,
    /// 1 while the agent lets go of the driver for a reset (`vramguard_agent_paused_for_reset`;
    /// the agent's only, [`Metrics::track_reset_pause`]).
    paused_for_reset: Option<Gauge>,
    up: Family<GpuLabels, Gauge>,
    /// The GPUs of the last good sample: what `up` goes to 0 for when collection fails.
    seen_gpus: std::sync::Mutex<Vec<GpuLabels>>,
    last_sample_age: F64Gauge,
    total: Family<GpuLabels, Gauge>,
    used: Family<GpuLabels, Gauge>,
    free: Family<GpuLabels, Gauge>,
    reserved: Family<GpuLabels, Gauge>,
    class_bytes: Family<ClassLabels, Gauge>,
    holders: Family<ClassLabels, Gauge>,
    ghost: Family<GpuLabels, Gauge>,
    holder_bytes: Family<HolderLabels, Gauge>,
    holder_slope: Family<HolderLabels, F64Gauge>,
    gpu_slope: Family<GpuLabels, F64Gauge>,
    gpu_slope_low: Family<GpuLabels, F64Gauge>,
    release_lag: Family<GpuOnly, Histogram, fn() -> Histogram>,
    release_timeouts: Family<GpuOnly, Counter>,
    reclaim_actions: Family<ActionLabels, Counter>,
    reclaimed_bytes: Family<GpuOnly, Counter>,
    collection_seconds: F64Gauge,
    collections: Family<KindLabels, Counter>,
    errors: Family<KindLabels, Counter>,
    last_collection: F64Gauge,
    alerts: Family<RuleLabels, Gauge>,
    heal_steps: Family<StepLabels, Counter>,
    heal_last: Family<NodeStepLabels, Gauge>,
    heal_last_at: Family<Vec<(String, String)>, F64Gauge>,
    heal_failed: Family<Vec<(String, String)>, Gauge>,
    driver: Family<DriverLabels, Gauge>,
    remapped_rows: Family<CauseLabels, Gauge>,
    remap_pending: Family<GpuLabels, Gauge>,
    remap_failure: Family<GpuLabels, Gauge>,
    retired_pages: Family<CauseLabels, Gauge>,
    retired_pending: Family<GpuLabels, Gauge>,
    xid: Family<XidLabels, Counter>,
    /// The Xid counts already added to `xid`, per (GPU, Xid): the source reports running
    /// totals, the counter takes increments.
    xid_added: std::sync::Mutex<BTreeMap<(u32, u64), u64>>,
    host: HostMetrics,
}

/// The host side: RAM, pressure, shared memory, and the largest holders' host memory.
#[derive(Default)]
struct HostMetrics {
    available: Family<Vec<(String, String)>, Gauge>,
    total: Family<Vec<(String, String)>, Gauge>,
    stalled: Family<Vec<(String, String)>, F64Gauge>,
    shm_size: Family<DirLabels, Gauge>,
    shm_used: Family<DirLabels, Gauge>,
    shm_orphan_bytes: Family<DirLabels, Gauge>,
    shm_orphan_segments: Family<DirLabels, Gauge>,
    holder_rss: Family<HolderLabels, Gauge>,
    holder_pinned: Family<HolderLabels, Gauge>,
    holder_shm: Family<HolderLabels, Gauge>,
}

impl HostMetrics {
    fn register(&self, r: &mut Registry) {
        r.register(
            "host_memory_available_bytes",
            "MemAvailable: host RAM a new job could get without swapping",
            self.available.clone(),
        );
        r.register("host_memory_total_bytes", "MemTotal", self.total.clone());
        r.register(
            "host_memory_stalled_ratio",
            "Share of the last 10 s in which some task stalled waiting for memory (PSI some avg10)",
            self.stalled.clone(),
        );
        r.register(
            "host_shm_size_bytes",
            "Size of a shared-memory filesystem ([shm] dirs)",
            self.shm_size.clone(),
        );
        r.register(
            "host_shm_used_bytes",
            "Bytes in use on a shared-memory filesystem",
            self.shm_used.clone(),
        );
        r.register(
            "host_shm_orphan_bytes",
            "Bytes in shared-memory segments no process maps or holds and whose owner runs no GPU job (as of the last full scan)",
            self.shm_orphan_bytes.clone(),
        );
        r.register(
            "host_shm_orphan_segments",
            "Orphaned shared-memory segments (as of the last full scan)",
            self.shm_orphan_segments.clone(),
        );
        r.register(
            "holder_host_rss_bytes",
            "Host RSS of the largest GPU holders (top_holders per GPU)",
            self.holder_rss.clone(),
        );
        r.register(
            "holder_host_pinned_bytes",
            "Pinned or locked host memory (VmPin, VmLck) of the largest GPU holders, as of the last full scan",
            self.holder_pinned.clone(),
        );
        r.register(
            "holder_host_shm_bytes",
            "Shared memory mapped by the largest GPU holders, as of the last full scan",
            self.holder_shm.clone(),
        );
    }

    fn clear(&self) {
        self.available.clear();
        self.total.clear();
        self.stalled.clear();
        for f in [
            &self.shm_size,
            &self.shm_used,
            &self.shm_orphan_bytes,
            &self.shm_orphan_segments,
        ] {
            f.clear();
        }
        for f in [&self.holder_rss, &self.holder_pinned, &self.holder_shm] {
            f.clear();
        }
    }

    fn update(&self, host: &vramguard_core::host::HostReport) {
        let none = Vec::new();
        if let Some(b) = host.mem_available_bytes {
            self.available.get_or_create(&none).set(b as i64);
        }
        if let Some(b) = host.mem_total_bytes {
            self.total.get_or_create(&none).set(b as i64);
        }
        if let Some(p) = host.pressure {
            self.stalled.get_or_create(&none).set(p.some_avg10 / 100.0);
        }
        for d in host.shm_dirs.iter().filter(|d| d.error.is_none()) {
            let l = DirLabels {
                dir: shown(&d.path),
            };
            if let Some(s) = d.size_bytes {
                self.shm_size.get_or_create(&l).set(s as i64);
            }
            if let Some(u) = d.used_bytes {
                self.shm_used.get_or_create(&l).set(u as i64);
            }
            self.shm_orphan_bytes
                .get_or_create(&l)
                .set(d.orphan_bytes as i64);
            let n = host
                .segments
                .iter()
                .filter(|s| {
                    s.dir == d.path
                        && s.verdict == vramguard_core::host::SegmentVerdict::Reclaimable
                })
                .count();
            self.shm_orphan_segments.get_or_create(&l).set(n as i64);
        }
    }

    fn holder(&self, hl: &HolderLabels, h: &vramguard_core::Holder) {
        if let Some(rss) = h.rss_bytes {
            self.holder_rss.get_or_create(hl).set(rss as i64);
        }
        if let Some(m) = h.host_memory {
            if let Some(p) = m.pinned_bytes.max(m.locked_bytes) {
                self.holder_pinned.get_or_create(hl).set(p as i64);
            }
            if let Some(s) = m.shm_bytes {
                self.holder_shm.get_or_create(hl).set(s as i64);
            }
        }
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics { .. }")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Per-sample facts besides the report.
pub struct SampleFacts<'a> {
    /// How long the collection took.
    pub duration_secs: f64,
    /// `holders`, `new_processes` or `full`.
    pub depth: &'a str,
    /// Seconds since the epoch.
    pub timestamp_secs: f64,
    /// Per-GPU used-memory trends (per second).
    pub gpu_trends: &'a BTreeMap<u32, Trend>,
    /// Per-holder trends, by (gpu, pid).
    pub holder_trends: &'a BTreeMap<(u32, u32), Trend>,
    /// Firing incidents.
    pub firing: &'a [(String, u32)],
    /// How many holders per GPU get their own series.
    pub top_holders: usize,
    /// Per-GPU series also carry dcgm-exporter's `UUID`, `modelName` and `Hostname`.
    pub dcgm_labels: bool,
}

/// The metrics text of a single full collection of `report`, outside an agent: no trends, no
/// alerts, no history (release lags, Xid counts) beyond what the report says.
pub fn one_collection(
    report: &Report,
    top_holders: usize,
    dcgm_labels: bool,
    duration_secs: f64,
    timestamp_secs: f64,
) -> String {
    let m = Metrics::new();
    m.update(
        report,
        &SampleFacts {
            duration_secs,
            depth: "full",
            timestamp_secs,
            gpu_trends: &BTreeMap::new(),
            holder_trends: &BTreeMap::new(),
            firing: &[],
            top_holders,
            dcgm_labels,
        },
    );
    m.render()
}

/// Text another user controls, with control bytes shown as visible escapes.
fn shown(text: &str) -> String {
    vramguard_core::sanitize::escape(text).into_owned()
}

/// Registers vramguard's version (value 1).
fn register_build_info(r: &mut Registry) {
    r.register(
        "build_info",
        "vramguard's version (value 1)",
        Family::<Vec<(String, String)>, Gauge>::default().tap(|f| {
            f.get_or_create(&vec![("version".into(), env!("CARGO_PKG_VERSION").into())])
                .set(1);
        }),
    );
}

impl Metrics {
    /// A registry with every metric, prefixed `vramguard_`.
    pub fn new() -> Metrics {
        let mut r = Registry::with_prefix("vramguard");
        let m = Metrics {
            refill: Default::default(),
            up: Family::default(),
            seen_gpus: Default::default(),
            last_sample_age: F64Gauge::default(),
            total: Family::default(),
            used: Family::default(),
            free: Family::default(),
            reserved: Family::default(),
            class_bytes: Family::default(),
            holders: Family::default(),
            ghost: Family::default(),
            holder_bytes: Family::default(),
            holder_slope: Family::default(),
            gpu_slope: Family::default(),
            gpu_slope_low: Family::default(),
            release_lag: Family::new_with_constructor(lag_histogram),
            release_timeouts: Family::default(),
            reclaim_actions: Family::default(),
            reclaimed_bytes: Family::default(),
            collection_seconds: F64Gauge::default(),
            collections: Family::default(),
            errors: Family::default(),
            last_collection: F64Gauge::default(),
            alerts: Family::default(),
            heal_steps: Family::default(),
            heal_last: Family::default(),
            heal_last_at: Family::default(),
            heal_failed: Family::default(),
            driver: Family::default(),
            remapped_rows: Family::default(),
            remap_pending: Family::default(),
            remap_failure: Family::default(),
            retired_pages: Family::default(),
            retired_pending: Family::default(),
            xid: Family::default(),
            xid_added: Default::default(),
            host: HostMetrics::default(),
            registry: Registry::default(),
            heap: None,
            open_watch: None,
            paused_for_reset: None,
        };
        m.register_gpu_memory(&mut r);
        m.register_trends_and_reclaim(&mut r);
        m.register_collections(&mut r);
        m.register_health(&mut r);
        m.register_heal(&mut r);
        m.host.register(&mut r);
        register_build_info(&mut r);
        Metrics { registry: r, ..m }
    }

    /// Adds the process's own heap in use (glibc's `mallinfo`, every arena): next to its RSS
    /// it tells a leak (both rise) from allocator fragmentation (only RSS rises). For the
    /// long-running agent only: a one-off collection's figure means nothing.
    pub fn track_own_heap(&mut self) {
        let g = Gauge::default();
        self.registry.register(
            "agent_heap_in_use_bytes",
            "Heap memory the agent has allocated and not freed (glibc mallinfo uordblks + hblkhd)",
            g.clone(),
        );
        self.heap = Some(g);
    }

    /// Adds whether the GPU device files are watched for opens, and the processes seen opening
    /// them. For the agent only (a one-off collection watches nothing).
    pub fn track_open_watch(&mut self) {
        let (watching, openers) = (Gauge::default(), Counter::default());
        self.registry.register(
            "agent_watching_opens",
            "The GPU device files are watched for opens (1: new holders are seen at once) or not \
             (0: only /proc scans find them)",
            watching.clone(),
        );
        self.registry.register(
            "agent_device_openers",
            "Openers of a GPU device file, counted once per wake-up of the agent that saw them (each one fd-scanned at its next sample)",
            openers.clone(),
        );
        self.open_watch = Some((watching, openers));
    }

    /// Exports whether the agent lets go of the driver for a reset (the agent's own gauge).
    pub fn track_reset_pause(&mut self) {
        let paused = Gauge::default();
        self.registry.register(
            "agent_paused_for_reset",
            "1 while the agent makes no driver call because a vramguard process resets a GPU \
             (the reset lock); 0 otherwise",
            paused.clone(),
        );
        self.paused_for_reset = Some(paused);
    }

    /// Whether the agent lets go of the driver for a reset a vramguard process does.
    pub fn paused_for_reset(&self, paused: bool) {
        if let Some(g) = &self.paused_for_reset {
            g.set(i64::from(paused));
        }
    }

    /// Whether device opens are watched.
    pub fn open_watch(&self, watching: bool) {
        if let Some((g, _)) = &self.open_watch {
            g.set(i64::from(watching));
        }
    }

    /// Counts processes seen opening a device file.
    pub fn device_opens(&self, openers: u64) {
        if let Some((_, c)) = &self.open_watch {
            c.inc_by(openers);
        }
    }

    /// Registers memory per GPU and per holder class, ghost memory, the largest holders.
    fn register_gpu_memory(&self, r: &mut Registry) {
        r.register(
            "up",
            "Whether the GPU could be read (1) or failed (0); 0 for every GPU while collection fails",
            self.up.clone(),
        );
        r.register(
            "last_sample_age_seconds",
            "Seconds since the last successful collection, when these metrics were rendered",
            self.last_sample_age.clone(),
        );
        r.register(
            "gpu_memory_total_bytes",
            "Installed GPU memory",
            self.total.clone(),
        );
        r.register(
            "gpu_memory_used_bytes",
            "Used GPU memory (nvmlDeviceGetMemoryInfo_v2)",
            self.used.clone(),
        );
        r.register(
            "gpu_memory_free_bytes",
            "Free GPU memory",
            self.free.clone(),
        );
        r.register(
            "gpu_memory_reserved_bytes",
            "GPU memory reserved by the driver",
            self.reserved.clone(),
        );
        r.register(
            "gpu_memory_class_bytes",
            "Used GPU memory by holder class; class=unaccounted: used memory no listed process accounts for",
            self.class_bytes.clone(),
        );
        r.register(
            "gpu_holders",
            "Processes holding the GPU, by class",
            self.holders.clone(),
        );
        r.register(
            "gpu_ghost_bytes",
            "GPU memory held by no live job (orphans, zombies, exited pids kept alive by processes they forked, significant unaccounted memory)",
            self.ghost.clone(),
        );
        r.register(
            "holder_memory_bytes",
            "GPU memory of the largest holders (top N per GPU; the rest summed under pid=\"other\")",
            self.holder_bytes.clone(),
        );
    }

    /// Registers leak trends, release lags and automatic reclaim.
    fn register_trends_and_reclaim(&self, r: &mut Registry) {
        r.register(
            "holder_leak_slope_bytes_per_second",
            "Theil-Sen slope of a holder's GPU memory over the trend window",
            self.holder_slope.clone(),
        );
        r.register(
            "gpu_leak_slope_bytes_per_second",
            "Theil-Sen slope of the GPU's used memory over the trend window",
            self.gpu_slope.clone(),
        );
        r.register(
            "gpu_leak_slope_lower_bytes_per_second",
            "Lower 95% bound of that slope: above 0 means a steady increase",
            self.gpu_slope_low.clone(),
        );
        r.register(
            "release_lag_seconds",
            "Time from a GPU holder's exit to the driver releasing its memory",
            self.release_lag.clone(),
        );
        r.register(
            "release_timeouts",
            "Exits whose memory was not released within 120 s",
            self.release_timeouts.clone(),
        );
        r.register(
            "reclaim_actions",
            "Actions of automatic reclaim (term, kill, reset, skipped)",
            self.reclaim_actions.clone(),
        );
        r.register(
            "reclaimed_bytes",
            "GPU memory freed by automatic reclaim",
            self.reclaimed_bytes.clone(),
        );
    }

    /// Registers the agent itself: collections, errors, alerts, the driver.
    fn register_collections(&self, r: &mut Registry) {
        r.register(
            "collection_duration_seconds",
            "Duration of the last collection",
            self.collection_seconds.clone(),
        );
        r.register(
            "collections",
            "Collections, by depth (cached, holders, new_processes, full; quiet: only the driver asked, nothing changed)",
            self.collections.clone(),
        );
        r.register(
            "collection_errors",
            "Collection errors, by kind (gpu_call, source, proc, audit_log)",
            self.errors.clone(),
        );
        r.register(
            "last_collection_timestamp_seconds",
            "When the last collection finished",
            self.last_collection.clone(),
        );
        r.register(
            "alert_firing",
            "Incidents of the agent's own alert rules that are firing",
            self.alerts.clone(),
        );
        r.register(
            "driver_info",
            "The NVIDIA driver (value 1)",
            self.driver.clone(),
        );
    }

    /// Registers the Slurm heal's steps (from the audit log).
    fn register_heal(&self, r: &mut Registry) {
        r.register(
            "slurm_heal_steps",
            "Steps of vramguard slurm heal seen in the audit log since the agent started \
             (waiting, reset, resumed, failed, timed_out, skipped)",
            self.heal_steps.clone(),
        );
        r.register(
            "slurm_heal_last_step",
            "The latest heal step on this node (value 1 for it, 0 for the others)",
            self.heal_last.clone(),
        );
        r.register(
            "slurm_heal_last_step_timestamp_seconds",
            "When the latest heal step was written",
            self.heal_last_at.clone(),
        );
        r.register(
            "slurm_heal_failed",
            "1 while the latest heal failed (the node stays drained) and no later heal resumed it",
            self.heal_failed.clone(),
        );
    }

    /// Registers memory health: remapped rows, retired pages, Xid events.
    fn register_health(&self, r: &mut Registry) {
        r.register(
            "gpu_remapped_rows",
            "Memory rows remapped to spares, by cause (correctable, uncorrectable); Ampere and later",
            self.remapped_rows.clone(),
        );
        r.register(
            "gpu_row_remap_pending",
            "A row remap waits for the next GPU reset (1) or not (0)",
            self.remap_pending.clone(),
        );
        r.register(
            "gpu_row_remap_failure",
            "A row remap failed: the GPU needs service (1) or not (0)",
            self.remap_failure.clone(),
        );
        r.register(
            "gpu_retired_pages",
            "Retired memory pages, by cause (single_bit_ecc, double_bit_ecc); before Ampere",
            self.retired_pages.clone(),
        );
        r.register(
            "gpu_retired_pages_pending",
            "Pages wait to be retired at the next GPU reset (1) or not (0)",
            self.retired_pending.clone(),
        );
        r.register(
            "gpu_xid_events",
            "Critical Xid events received since the agent started, by Xid",
            self.xid.clone(),
        );
    }

    /// A collection failed as a whole (the driver or `/proc` could not be read): every GPU of
    /// the last good sample is down, and the other series are `age_secs` old.
    pub fn collection_failed(&self, age_secs: f64) {
        for gl in self
            .seen_gpus
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            self.up.get_or_create(gl).set(0);
        }
        self.last_sample_age.set(age_secs);
    }

    /// The heal's state: its steps counted, the latest one, and whether it failed. Nothing
    /// is shown on a node no heal has run on.
    pub fn heal(&self, watch: &crate::heal::HealWatch) {
        for (step, n) in &watch.counts {
            let counter = self
                .heal_steps
                .get_or_create(&StepLabels { step: step.name() });
            let shown = counter.get();
            if *n > shown {
                counter.inc_by(*n - shown);
            }
        }
        self.heal_last.clear();
        self.heal_last_at.clear();
        self.heal_failed.clear();
        if let Some(last) = &watch.last {
            for step in crate::heal::HealStep::ALL {
                self.heal_last
                    .get_or_create(&NodeStepLabels {
                        node: last.node.clone(),
                        step: step.name(),
                    })
                    .set(i64::from(step == last.step));
            }
            let node = vec![("node".to_string(), last.node.clone())];
            self.heal_last_at
                .get_or_create(&node)
                .set(last.at_ms as f64 / 1000.0);
            self.heal_failed
                .get_or_create(&node)
                .set(i64::from(watch.failing()));
        }
    }

    /// Records one collection error.
    pub fn error(&self, kind: &str) {
        self.errors
            .get_or_create(&KindLabels { kind: kind.into() })
            .inc();
    }

    /// Records a measured release lag.
    pub fn release_lag(&self, gpu: u32, secs: f64) {
        self.release_lag
            .get_or_create(&GpuOnly {
                gpu: gpu.to_string(),
            })
            .observe(secs);
    }

    /// Records an exit whose memory never came back.
    pub fn release_timeout(&self, gpu: u32) {
        self.release_timeouts
            .get_or_create(&GpuOnly {
                gpu: gpu.to_string(),
            })
            .inc();
    }

    /// Records reclaim actions.
    pub fn reclaim(&self, action: &str, n: u64) {
        self.reclaim_actions
            .get_or_create(&ActionLabels {
                action: action.into(),
            })
            .inc_by(n);
    }

    /// Records bytes freed by reclaim on a GPU.
    pub fn reclaimed(&self, gpu: u32, bytes: u64) {
        self.reclaimed_bytes
            .get_or_create(&GpuOnly {
                gpu: gpu.to_string(),
            })
            .inc_by(bytes);
    }

    /// Refills the state gauges from a report.
    pub fn update(&self, report: &Report, facts: &SampleFacts<'_>) {
        let _refill = self.refill.lock().unwrap_or_else(|p| p.into_inner());
        self.clear_state();
        self.record_collection(report, facts);
        let mut seen = self.seen_gpus.lock().unwrap_or_else(|p| p.into_inner());
        seen.clear();
        for g in &report.gpus {
            let (uuid, model) = (
                g.uuid.clone().unwrap_or_default(),
                g.name.clone().unwrap_or_default(),
            );
            let dcgm = if facts.dcgm_labels {
                LabelList::default()
                    .with("UUID", &uuid)
                    .with("modelName", &model)
                    .with("Hostname", report.hostname.as_deref().unwrap_or_default())
            } else {
                LabelList::default()
            };
            let gl = GpuLabels {
                gpu: g.index.to_string(),
                uuid,
                model,
                dcgm,
            };
            self.up
                .get_or_create(&gl)
                .set(i64::from(g.failure.is_none()));
            seen.push(gl.clone());
            if let Some(m) = g.memory {
                self.total.get_or_create(&gl).set(m.total as i64);
                self.used.get_or_create(&gl).set(m.used as i64);
                self.free.get_or_create(&gl).set(m.free as i64);
                self.reserved.get_or_create(&gl).set(m.reserved as i64);
            }
            self.gpu_series(&gl, g, facts);
            self.holder_series(&gl, g, facts);
        }
        if let Some(host) = &report.host {
            self.host.update(host);
        }
        for (rule, gpu) in facts.firing {
            self.alerts
                .get_or_create(&RuleLabels {
                    rule: rule.clone(),
                    gpu: gpu.to_string(),
                })
                .set(1);
        }
    }

    /// Drops every state series: GPUs, holders and incidents that are gone disappear.
    fn clear_state(&self) {
        for f in [
            &self.up,
            &self.total,
            &self.used,
            &self.free,
            &self.reserved,
            &self.ghost,
        ] {
            f.clear();
        }
        self.class_bytes.clear();
        self.holders.clear();
        self.holder_bytes.clear();
        self.holder_slope.clear();
        self.gpu_slope.clear();
        self.gpu_slope_low.clear();
        self.alerts.clear();
        self.driver.clear();
        self.remapped_rows.clear();
        self.remap_pending.clear();
        self.remap_failure.clear();
        self.retired_pages.clear();
        self.retired_pending.clear();
        self.host.clear();
    }

    /// A quiet collection (only the driver asked, and it said what it said at the last full
    /// one): its duration and time; every other series keeps the last full one's values.
    pub fn quiet_collection(&self, duration_secs: f64, timestamp_secs: f64) {
        self.collection_seconds.set(duration_secs);
        self.last_collection.set(timestamp_secs);
        self.collections
            .get_or_create(&KindLabels {
                kind: "quiet".into(),
            })
            .inc();
        self.last_sample_age.set(0.0);
    }

    /// This collection: its duration, time, depth and the driver.
    fn record_collection(&self, report: &Report, facts: &SampleFacts<'_>) {
        self.collection_seconds.set(facts.duration_secs);
        self.last_collection.set(facts.timestamp_secs);
        self.collections
            .get_or_create(&KindLabels {
                kind: facts.depth.into(),
            })
            .inc();
        self.driver
            .get_or_create(&DriverLabels {
                driver_version: report.driver.driver_version.clone().unwrap_or_default(),
                nvml_version: report.driver.nvml_version.clone().unwrap_or_default(),
                source: match report.driver.source {
                    vramguard_core::snapshot::DriverSource::Nvml => "nvml".into(),
                    vramguard_core::snapshot::DriverSource::Simulated => "simulated".into(),
                },
            })
            .set(1);
        self.last_sample_age.set(0.0);
    }

    /// One GPU's ghost memory, health, holders and bytes by class, and trend.
    fn gpu_series(&self, gl: &GpuLabels, g: &vramguard_core::GpuReport, facts: &SampleFacts<'_>) {
        self.ghost.get_or_create(gl).set(g.ghost_bytes as i64);
        self.health(gl, g.index, &g.health);
        let class_l = |class: &str| ClassLabels {
            gpu: gl.gpu.clone(),
            uuid: gl.uuid.clone(),
            model: gl.model.clone(),
            dcgm: gl.dcgm.clone(),
            class: class.into(),
        };
        for class in Class::ALL {
            let n = g.holders.iter().filter(|h| h.class == class).count();
            self.holders
                .get_or_create(&class_l(class.as_str()))
                .set(n as i64);
            let bytes = g.bytes_by_class.get(&class).copied().unwrap_or(0);
            self.class_bytes
                .get_or_create(&class_l(class.as_str()))
                .set(bytes as i64);
        }
        let unaccounted = g.unaccounted.as_ref().map_or(0, |u| u.bytes);
        self.class_bytes
            .get_or_create(&class_l("unaccounted"))
            .set(unaccounted as i64);
        if let Some(t) = facts.gpu_trends.get(&g.index) {
            self.gpu_slope.get_or_create(gl).set(t.slope);
            self.gpu_slope_low.get_or_create(gl).set(t.ci_low);
        }
    }

    /// The largest holders of one GPU (top N), the rest summed per class under pid "other".
    fn holder_series(
        &self,
        gl: &GpuLabels,
        g: &vramguard_core::GpuReport,
        facts: &SampleFacts<'_>,
    ) {
        let mut rest: BTreeMap<Class, i64> = BTreeMap::new();
        for (i, h) in g.holders.iter().enumerate() {
            let bytes = h.used_bytes.unwrap_or(0) as i64;
            if i >= facts.top_holders {
                *rest.entry(h.class).or_default() += bytes;
                continue;
            }
            let hl = HolderLabels {
                gpu: gl.gpu.clone(),
                uuid: gl.uuid.clone(),
                model: gl.model.clone(),
                dcgm: gl.dcgm.clone(),
                pid: h.pid.to_string(),
                // Process- and cgroup-supplied text: shown escaped, like everywhere else,
                // so `vramguard metrics` or a `curl` on a terminal obeys no control byte.
                comm: shown(h.comm.as_deref().unwrap_or_default()),
                class: h.class.as_str().into(),
                // Kubernetes' container name when the kubelet named the pod (what
                // dcgm-exporter's `container` holds), else the runtime's id.
                container: h
                    .pod
                    .as_ref()
                    .map(|p| shown(&p.container))
                    .or_else(|| {
                        h.container
                            .as_ref()
                            .map(|c| shown(&c.id.chars().take(12).collect::<String>()))
                    })
                    .unwrap_or_default(),
                pod_uid: shown(h.pod_uid.as_deref().unwrap_or_default()),
                job: h.job.as_ref().map(|j| shown(&j.label)).unwrap_or_default(),
                owner: owner_labels(h),
            };
            self.holder_bytes.get_or_create(&hl).set(bytes);
            self.host.holder(&hl, h);
            if let Some(t) = facts.holder_trends.get(&(g.index, h.pid)) {
                self.holder_slope.get_or_create(&hl).set(t.slope);
            }
        }
        for (class, bytes) in rest {
            let hl = HolderLabels {
                gpu: gl.gpu.clone(),
                uuid: gl.uuid.clone(),
                model: gl.model.clone(),
                dcgm: gl.dcgm.clone(),
                pid: "other".into(),
                comm: "other".into(),
                class: class.as_str().into(),
                container: String::new(),
                pod_uid: String::new(),
                job: String::new(),
                owner: LabelList::default(),
            };
            self.holder_bytes.get_or_create(&hl).set(bytes);
        }
    }

    fn health(&self, gl: &GpuLabels, gpu: u32, health: &GpuHealth) {
        let cause = |cause: &str| CauseLabels {
            gpu: gl.gpu.clone(),
            uuid: gl.uuid.clone(),
            model: gl.model.clone(),
            dcgm: gl.dcgm.clone(),
            cause: cause.into(),
        };
        if let Some(r) = health.remapped_rows {
            let rows = &self.remapped_rows;
            rows.get_or_create(&cause("correctable"))
                .set(r.correctable.into());
            rows.get_or_create(&cause("uncorrectable"))
                .set(r.uncorrectable.into());
            self.remap_pending.get_or_create(gl).set(r.pending.into());
            self.remap_failure.get_or_create(gl).set(r.failure.into());
        }
        if let Some(p) = health.retired_pages {
            let pages = &self.retired_pages;
            pages
                .get_or_create(&cause("single_bit_ecc"))
                .set(p.single_bit_ecc.into());
            pages
                .get_or_create(&cause("double_bit_ecc"))
                .set(p.double_bit_ecc.into());
            self.retired_pending.get_or_create(gl).set(p.pending.into());
        }
        let mut added = self.xid_added.lock().unwrap_or_else(|p| p.into_inner());
        for x in &health.xid_events {
            let before = added.entry((gpu, x.xid)).or_default();
            // A restarted source starts its totals again: count what it reports from there.
            let increment = x.count.checked_sub(*before).unwrap_or(x.count);
            *before = x.count;
            let counter = self.xid.get_or_create(&XidLabels {
                gpu: gl.gpu.clone(),
                xid: x.xid.to_string(),
            });
            counter.inc_by(increment);
        }
    }

    /// The OpenMetrics text.
    pub fn render(&self) -> String {
        if let Some(g) = &self.heap {
            g.set(heap_in_use() as i64);
        }
        let mut out = String::with_capacity(16 * 1024);
        let _refill = self.refill.lock().unwrap_or_else(|p| p.into_inner());
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Bytes the allocator has handed out and not taken back: small blocks in every arena plus
/// mmapped large ones. `mallinfo`, not `mallinfo2`: the latter needs glibc 2.33, and the
/// agent runs on older nodes; its `int` fields suffice for an agent's heap (under 2 GiB).
fn heap_in_use() -> u64 {
    // SAFETY: mallinfo only reads the allocator's own statistics.
    #[allow(deprecated)]
    let info = unsafe { libc::mallinfo() };
    (info.uordblks.max(0) as u64) + (info.hblkhd.max(0) as u64)
}

/// OpenMetrics text as Prometheus' text format 0.0.4, for scrapers that do not ask for
/// OpenMetrics (`curl`, `promtool check metrics`, node_exporter's textfile collector): a
/// counter family is named with its `_total` in HELP and TYPE, an info family becomes a
/// gauge named `_info`, and the `# UNIT` and `# EOF` lines go. Samples are unchanged.
pub fn as_prometheus_text(openmetrics: &str) -> String {
    let mut counters: std::collections::HashSet<&str> = std::collections::HashSet::new();
    let mut infos: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            match rest.split_once(' ') {
                Some((name, "counter")) => {
                    counters.insert(name);
                }
                Some((name, "info")) => {
                    infos.insert(name);
                }
                _ => {}
            }
        }
    }
    // Written in place: a format per HELP and TYPE line was a fifth of the reallocations
    // of the agent's sample (this runs at every one).
    let suffix = |name: &str| {
        if counters.contains(name) {
            "_total"
        } else if infos.contains(name) {
            "_info"
        } else {
            ""
        }
    };
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        for prefix in ["# HELP ", "# TYPE "] {
            if let Some(rest) = line.strip_prefix(prefix) {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let tail = if prefix == "# TYPE " && infos.contains(name) {
                    "gauge"
                } else {
                    tail
                };
                for part in [prefix, name, suffix(name), " ", tail, "\n"] {
                    out.push_str(part);
                }
            }
        }
        if !line.starts_with("# HELP ") && !line.starts_with("# TYPE ") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

trait Tap: Sized {
    fn tap(self, f: impl FnOnce(&Self)) -> Self {
        f(&self);
        self
    }
}
impl<T> Tap for T {}

#[cfg(test)]
mod exposition_tests {
    use super::as_prometheus_text;

    #[test]
    fn openmetrics_becomes_prometheus_text() {
        let om = "# HELP vg_collections Collections.\n# TYPE vg_collections counter\n\
                  vg_collections_total{kind=\"full\"} 3\n# HELP vg_build Version.\n\
                  # TYPE vg_build info\nvg_build_info{version=\"0.1.0\"} 1\n\
                  # HELP vg_up Up.\n# TYPE vg_up gauge\n# UNIT vg_up ratio\nvg_up 1\n# EOF\n";
        assert_eq!(
            as_prometheus_text(om),
            "# HELP vg_collections_total Collections.\n# TYPE vg_collections_total counter\n\
             vg_collections_total{kind=\"full\"} 3\n# HELP vg_build_info Version.\n\
             # TYPE vg_build_info gauge\nvg_build_info{version=\"0.1.0\"} 1\n\
             # HELP vg_up Up.\n# TYPE vg_up gauge\nvg_up 1\n"
        );
    }
}
