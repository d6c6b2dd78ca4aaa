//! Which job a process belongs to, from the strongest evidence to the weakest:
//! 1. the cgroup it lives in, when that names a job: a `vramguard run` leaf whose supervisor
//!    lives, a Kubernetes pod, a container, a Slurm job step, a systemd unit other than a
//!    login session;
//! 2. the process tree: a process whose parent lives belongs to its parent's job, and one
//!    re-parented to a live job supervisor (`vramguard run`, tini, dumb-init, docker-init)
//!    belongs to that supervisor's job;
//! 3. the process group, as the weakest fallback.
//!
//! This module only reads cgroup paths; [`crate::classify`] combines them with the process
//! table and the liveness facts of [`crate::snapshot::JobCgroupFacts`].

use crate::snapshot::ProcessFacts;
use serde::{Deserialize, Serialize};

/// What kind of thing a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    /// A Kubernetes pod (kubelet's `kubepods` cgroups).
    Pod,
    /// A Docker, containerd, CRI-O or Podman container outside Kubernetes.
    Container,
    /// A Slurm job step (`job_N/step_M`, cgroup v1 and v2 layouts).
    Slurm,
    /// A systemd service or scope (`systemd-run`, a `.service`), not a login session.
    Unit,
    /// A process group: the fallback when the cgroup names no job.
    ProcessGroup,
    /// A job under a live supervisor that ends with it: `vramguard run` (`run:<pid>`, by its
    /// cgroup or as the subreaper its escaped processes were re-parented to), or a container
    /// init that adopted them (`tini:<pid>`, `dumb-init:<pid>`, `docker-init:<pid>`).
    Supervised,
}

/// A job named by a cgroup path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupJob {
    /// Its kind.
    pub kind: JobKind,
    /// Its name in output and metrics: `pod:<uid>`, `docker:<id12>`, `slurm:1234.0`,
    /// `unit:train.service`.
    pub label: String,
    /// The cgroup path of the job's root: the directory whose subtree holds the whole job.
    pub root: String,
}

/// The systemd system service `p`'s cgroup lies in (`/system.slice/NAME.service` or below it:
/// a sub-unit or a container of the service's own counts as the service's), whatever names
/// its job. Never a user manager's unit: its name is the user's.
pub fn system_service(p: &ProcessFacts) -> Option<String> {
    p.cgroup
        .as_deref()?
        .strip_prefix("/system.slice/")?
        .split('/')
        .next()
        .filter(|name| name.ends_with(".service"))
        .map(str::to_string)
}

/// The cgroup of the system service `unit`: its subtree holds everything `systemctl stop`
/// ends.
pub fn system_service_root(unit: &str) -> String {
    format!("/system.slice/{unit}")
}

fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}

/// The job a process's cgroup names, if any. `p.container` and `p.pod_uid` are the container
/// and pod the `/proc` reader already recognised in the same path.
pub fn cgroup_job(p: &ProcessFacts) -> Option<CgroupJob> {
    let path = p.cgroup.as_deref()?;
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let root_through = |i: usize| format!("/{}", segments[..=i].join("/"));

    if let Some(uid) = &p.pod_uid {
        let underscored = uid.replace('-', "_");
        if let Some(i) = segments
            .iter()
            .position(|s| s.contains(uid.as_str()) || s.contains(underscored.as_str()))
        {
            return Some(CgroupJob {
                kind: JobKind::Pod,
                label: format!("pod:{uid}"),
                root: root_through(i),
            });
        }
    }
    if let Some(c) = &p.container
        && let Some(i) = segments.iter().position(|s| s.contains(c.id.as_str()))
    {
        return Some(CgroupJob {
            kind: JobKind::Container,
            // The name its runtime gave it, when known: what its owner calls it.
            label: format!(
                "{}:{}",
                c.runtime,
                c.name.as_deref().unwrap_or_else(|| short(&c.id))
            ),
            root: root_through(i),
        });
    }
    if let Some(job) = slurm_job(&segments) {
        return Some(job);
    }
    unit_job(&segments)
}

/// Whether a cgroup path names a Slurm job (`job_N`, with or without a step below): what
/// `/proc/PID/cgroup`'s reader looks for among a hybrid host's v1 hierarchies, where Slurm's
/// cgroup/v1 plugin puts a job (`freezer:/slurm_<node>/uid_0/job_3/step_batch`) while the
/// unified line names slurmd's own unit or the root.
pub fn names_slurm_job(path: &str) -> bool {
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    slurm_job(&segments).is_some()
}

/// `job_N` where Slurm puts a job, followed (anywhere below) by `step_M`: right below `uid_N`
/// (cgroup/v1, below the site's `CgroupPrepend`, `/slurm` by default:
/// `/slurm/uid_1000/job_42/step_0/task_0`, `/slurm_gpu07/uid_0/job_3/step_batch`), or right
/// below `slurmstepd.scope` or `<node>_slurmstepd.scope` (cgroup/v2:
/// `/system.slice/slurmstepd.scope/job_42/step_0/user/task_0`). A `job_N` anywhere else
/// (another batch system's name) is no Slurm job: a Slurm job whose daemon is gone is a dead
/// job, so the name alone must not make one; a directory a user made in Slurm's shape is told
/// apart by its owner (see `classify`).
fn slurm_job(segments: &[&str]) -> Option<CgroupJob> {
    let numbered = |s: &str, prefix: &str| {
        s.strip_prefix(prefix)
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .is_some()
    };
    let slurm_parent = |i: usize| {
        let stepd_scope = i >= 1
            && (segments[i - 1] == "slurmstepd.scope"
                || segments[i - 1].ends_with("_slurmstepd.scope"));
        let v1 = i >= 1 && numbered(segments[i - 1], "uid_");
        stepd_scope || v1
    };
    let (i, id) = segments.iter().enumerate().find_map(|(i, s)| {
        let n = s.strip_prefix("job_")?;
        (numbered(s, "job_") && slurm_parent(i)).then_some((i, n))
    })?;
    let step = segments[i + 1..]
        .iter()
        .find_map(|s| s.strip_prefix("step_"))
        .filter(|s| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        });
    Some(CgroupJob {
        kind: JobKind::Slurm,
        label: match step {
            Some(step) => format!("slurm:{id}.{step}"),
            None => format!("slurm:{id}"),
        },
        root: format!("/{}", segments[..=i].join("/")),
    })
}

/// The innermost systemd service or scope that is not a login session, a user manager or
/// the init scope.
fn unit_job(segments: &[&str]) -> Option<CgroupJob> {
    let is_job_unit = |s: &str| {
        let service = s.ends_with(".service");
        let scope = s.ends_with(".scope");
        (service || scope)
            && !s.starts_with("session-")
            && !s.starts_with("user@")
            && !s.starts_with("user-runtime-dir@")
            && s != "init.scope"
            // Terminal and desktop applications of a user manager.
            && !(scope && s.starts_with("app-"))
    };
    let i = segments.iter().rposition(|s| is_job_unit(s))?;
    Some(CgroupJob {
        kind: JobKind::Unit,
        label: format!("unit:{}", segments[i]),
        root: format!("/{}", segments[..=i].join("/")),
    })
}

/// The prefix of the cgroup leaf `vramguard run` makes for its job, below its own cgroup:
/// `vramguard-run-<pid of the supervisor>` (see `vramguard_ops::supervise`).
pub const RUN_CGROUP_PREFIX: &str = "vramguard-run-";

/// A `vramguard run` cgroup a process lives in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunCgroup {
    /// The supervisor's pid, as its cgroup names it (in the supervisor's PID namespace).
    pub supervisor: u32,
    /// The job's cgroup: the path through the `vramguard-run-<pid>` segment.
    pub root: String,
    /// The cgroup the supervisor made it in, and lives in itself.
    pub parent: String,
}

/// The `vramguard run` cgroups `p` lives in, innermost first (a `run` inside a `run` nests
/// them).
pub fn run_cgroups(p: &ProcessFacts) -> Vec<RunCgroup> {
    // Most processes are in no `run` cgroup: asked for each holder at every sample, the
    // split below was a tenth of classification's allocations.
    let Some(path) = p
        .cgroup
        .as_deref()
        .filter(|p| p.contains(RUN_CGROUP_PREFIX))
    else {
        return Vec::new();
    };
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let mut out: Vec<RunCgroup> = segments
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let n = s.strip_prefix(RUN_CGROUP_PREFIX)?;
            if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let supervisor = n.parse::<u32>().ok().filter(|pid| *pid > 0)?;
            Some(RunCgroup {
                supervisor,
                root: format!("/{}", segments[..=i].join("/")),
                parent: format!("/{}", segments[..i].join("/")),
            })
        })
        .collect();
    out.reverse();
    out
}

/// The nearest live ancestor of `p` (not vramguard itself) that is a job
/// supervisor ([`job_supervisor`]): its job is that supervisor's, which ends it with the job,
/// whatever the job's cgroup or process group says. A group whose leader is outside this PID
/// namespace, or a Slurm step run as `srun vramguard run …`, hides it from the job views;
/// the planner and the keeper rule ask this directly.
pub fn live_supervisor_above<'a>(
    snap: &'a crate::snapshot::Snapshot,
    p: &ProcessFacts,
) -> Option<&'a ProcessFacts> {
    let mut q = p;
    for _ in 0..64 {
        let parent = snap.process(q.ppid.filter(|pp| *pp > 0)?)?;
        if parent.is_finished() || parent.is_kernel_thread() {
            return None;
        }
        // Pid 1 too: a container's init, seen from inside the container.
        if parent.pid != snap.host.self_pid && job_supervisor(parent).is_some() {
            return Some(parent);
        }
        if parent.pid == 1 {
            return None;
        }
        q = parent;
    }
    None
}

/// Why nothing is done to a holder below the live job supervisor `sup`
/// ([`live_supervisor_above`]): the report's action and the planner's refusal say the same.
pub fn supervised_by(sup: &ProcessFacts) -> String {
    format!(
        "its ancestor {} ({}) is a live job supervisor, which ends its job with it: stop that \
         job to free it",
        sup.pid,
        crate::sanitize::shown(sup.comm.as_deref().unwrap_or("?"))
    )
}

/// Container inits that run one job and end with it: a process re-parented to a live one
/// belongs to its job.
pub const CONTAINER_INIT_COMMS: &[&str] = &["tini", "dumb-init", "docker-init"];

/// What kind of job supervisor `p` is by its command, when it is one that runs exactly one job
/// and ends with it: `run` for `vramguard run`, or the container init's name (`tini`,
/// `dumb-init`, `docker-init`, also as `tini-static`). `None` for everything else, including
/// the other subreapers (`systemd`, `init`, `containerd-shim`, `conmon`): they outlive the
/// jobs they adopt orphans of, so their life says nothing about a job.
///
/// Names and command lines are the process's own word. Believing them only ever keeps a job
/// alive (a process named `tini` keeps what it adopted exactly as any live parent keeps its
/// children; the subreaper exception is what it would give up), so that is all a spoofed
/// name can do. A `vramguard` process whose command line is unreadable is taken as a `run`.
pub fn job_supervisor(p: &ProcessFacts) -> Option<&'static str> {
    let comm = p.comm.as_deref()?;
    let named = |name: &str| {
        comm.strip_prefix(name)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
    };
    if let Some(init) = CONTAINER_INIT_COMMS.iter().find(|n| named(n)) {
        return Some(*init);
    }
    if comm != "vramguard" {
        return None;
    }
    match &p.cmdline {
        // `run` before the job's own arguments (`--`): `vramguard [GLOBAL OPTIONS] run …`.
        Some(args) if !args.is_empty() => args[1..]
            .iter()
            .take_while(|a| a.as_str() != "--")
            .any(|a| a == "run")
            .then_some("run"),
        _ => Some("run"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::ContainerRef;

    fn facts(path: &str) -> ProcessFacts {
        ProcessFacts {
            cgroup: Some(path.into()),
            ..Default::default()
        }
    }

    #[test]
    fn slurm_v1_and_v2_layouts() {
        let v1 = cgroup_job(&facts("/slurm/uid_1000/job_42/step_0/task_0")).unwrap();
        assert_eq!(v1.kind, JobKind::Slurm);
        assert_eq!(v1.label, "slurm:42.0");
        assert_eq!(v1.root, "/slurm/uid_1000/job_42");
        let v2 = cgroup_job(&facts(
            "/system.slice/slurmstepd.scope/job_1234/step_batch/user/task_0",
        ))
        .unwrap();
        assert_eq!(v2.label, "slurm:1234.batch");
        assert_eq!(v2.root, "/system.slice/slurmstepd.scope/job_1234");
        // Slurm 22.05's cgroup/v1 plugin, a node name in the top directory (#31).
        let node = cgroup_job(&facts("/slurm_gpu07/uid_0/job_3/step_batch")).unwrap();
        assert_eq!(
            (node.kind, node.label.as_str()),
            (JobKind::Slurm, "slurm:3.batch")
        );
        assert_eq!(node.root, "/slurm_gpu07/uid_0/job_3");
        let ext = cgroup_job(&facts("/slurm_gpu07/uid_1000/job_421/step_extern/task_0")).unwrap();
        assert_eq!(ext.label, "slurm:421.extern");
        assert!(names_slurm_job("/slurm_gpu07/uid_0/job_3/step_0"));
        assert!(names_slurm_job("/slurm/uid_0/job_3"));
        assert!(!names_slurm_job("/slurm_gpu07/uid_0"));
        assert!(!names_slurm_job(
            "/sandbox_api/7f949ce43bd1007dbdfb115eee0d4ad7"
        ));
        assert!(!names_slurm_job("/slurm/uid_0/job_/step_0"));
        // A site's own `CgroupPrepend`.
        assert_eq!(
            cgroup_job(&facts("/cluster/uid_1000/job_9/step_0/task_0"))
                .unwrap()
                .label,
            "slurm:9.0"
        );
        // Multiple slurmd on one host name their scope after the node.
        let multi = cgroup_job(&facts(
            "/system.slice/gpu07_slurmstepd.scope/job_12/step_batch/user/task_0",
        ))
        .unwrap();
        assert_eq!(multi.label, "slurm:12.batch");
        assert_eq!(multi.root, "/system.slice/gpu07_slurmstepd.scope/job_12");
        // Slurm inside a container: the container's cgroup above it.
        assert!(names_slurm_job(
            "/system.slice/docker-ab12.scope/system.slice/slurmstepd.scope/job_5/step_0"
        ));
        // `job_N` where Slurm never puts one: a user's directories in a delegated subtree,
        // another scheme's names. The first `job_N` in Slurm's place is the job.
        for not_slurm in [
            "/user.slice/user-1000.slice/user@1000.service/app.slice/job_1/step_0",
            "/user.slice/user-1000.slice/user@1000.service/job_1/step_0",
            "/job_1/step_0",
            "/batch/job_17/step_0/task_0",
            "/slurm/job_3/step_0",
            "/system.slice/notslurmstepd.scope/job_3/step_0",
            "/system.slice/slurmstepd.scope/step_0/job_3",
        ] {
            assert!(!names_slurm_job(not_slurm), "{not_slurm}");
        }
        let first = cgroup_job(&facts(
            "/slurm/uid_1000/job_5/step_0/slurm/uid_0/job_9/step_0",
        ))
        .unwrap();
        assert_eq!(first.label, "slurm:5.0");
        let no_step = cgroup_job(&facts("/slurm/uid_0/job_7")).unwrap();
        assert_eq!(no_step.label, "slurm:7");
        assert!(
            cgroup_job(&facts("/slurm/uid_0/job_x/step_0"))
                .is_none_or(|j| j.kind != JobKind::Slurm)
        );
    }

    #[test]
    fn run_cgroups_innermost_first() {
        let p = facts("/user.slice/session-3.scope/vramguard-run-44/vramguard-run-7/sub");
        let runs = run_cgroups(&p);
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0].supervisor, 7);
        assert_eq!(
            runs[0].root,
            "/user.slice/session-3.scope/vramguard-run-44/vramguard-run-7"
        );
        assert_eq!(
            runs[0].parent,
            "/user.slice/session-3.scope/vramguard-run-44"
        );
        assert_eq!(runs[1].supervisor, 44);
        assert_eq!(runs[1].parent, "/user.slice/session-3.scope");
        assert_eq!(run_cgroups(&facts("/vramguard-run-9"))[0].parent, "/");
        for bad in [
            "/vramguard-run-",
            "/vramguard-run-x1",
            "/vramguard-run-0",
            "/vramguard-run-99999999999",
            "/xvramguard-run-1",
        ] {
            assert!(run_cgroups(&facts(bad)).is_empty(), "{bad}");
        }
    }

    #[test]
    fn supervisors_by_command() {
        let p = |comm: &str, cmdline: Option<&[&str]>| ProcessFacts {
            comm: Some(comm.into()),
            cmdline: cmdline.map(|c| c.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        };
        let run = ["vramguard", "--sim", "s.json", "run", "--", "python", "x"];
        assert_eq!(job_supervisor(&p("vramguard", Some(&run))), Some("run"));
        assert_eq!(job_supervisor(&p("vramguard", None)), Some("run"));
        let after = ["vramguard", "sim", "--", "run"];
        assert_eq!(job_supervisor(&p("vramguard", Some(&after))), None);
        assert_eq!(
            job_supervisor(&p("vramguard", Some(&["vramguard", "agent"]))),
            None
        );
        assert_eq!(job_supervisor(&p("tini", None)), Some("tini"));
        assert_eq!(job_supervisor(&p("tini-static", None)), Some("tini"));
        assert_eq!(job_supervisor(&p("dumb-init", None)), Some("dumb-init"));
        assert_eq!(job_supervisor(&p("docker-init", None)), Some("docker-init"));
        for other in [
            "systemd",
            "init",
            "containerd-shim",
            "conmon",
            "tinix",
            "python",
        ] {
            assert_eq!(job_supervisor(&p(other, Some(&run))), None, "{other}");
        }
    }

    #[test]
    fn units_but_not_sessions() {
        let u = cgroup_job(&facts("/system.slice/train.service")).unwrap();
        assert_eq!(
            (u.kind, u.label.as_str()),
            (JobKind::Unit, "unit:train.service")
        );
        let run = cgroup_job(&facts("/system.slice/run-u42.scope")).unwrap();
        assert_eq!(run.label, "unit:run-u42.scope");
        assert!(cgroup_job(&facts("/user.slice/user-1000.slice/session-3.scope")).is_none());
        assert!(cgroup_job(&facts("/init.scope")).is_none());
        assert!(
            cgroup_job(&facts(
                "/user.slice/user-1000.slice/user@1000.service/app.slice/app-gnome-x-1.scope"
            ))
            .is_none()
        );
        let user_unit = cgroup_job(&facts(
            "/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service",
        ))
        .unwrap();
        assert_eq!(user_unit.label, "unit:jupyter.service");
        assert!(cgroup_job(&facts("/")).is_none());
        assert!(cgroup_job(&facts("/batch_api/d20ad3a701470fa7d24f8c5b576e4710")).is_none());
    }

    #[test]
    fn containers_and_pods_root_at_their_own_cgroup() {
        let id = "4f2a".repeat(16);
        let mut p = facts(&format!("/system.slice/docker-{id}.scope"));
        p.container = Some(ContainerRef {
            runtime: "docker".into(),
            id: id.clone(),
            name: None,
        });
        let c = cgroup_job(&p).unwrap();
        assert_eq!(c.kind, JobKind::Container);
        assert_eq!(c.label, format!("docker:{}", &id[..12]));
        // Named by its runtime: the name.
        p.container.as_mut().unwrap().name = Some("llama-train-7".into());
        assert_eq!(cgroup_job(&p).unwrap().label, "docker:llama-train-7");
        p.container.as_mut().unwrap().name = None;
        assert_eq!(c.root, format!("/system.slice/docker-{id}.scope"));

        let uid = "1b2c3d4e-0000-4000-8000-123456789abc";
        let mut k = facts(&format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-{id}.scope",
            uid.replace('-', "_")
        ));
        k.pod_uid = Some(uid.into());
        k.container = p.container.clone();
        let pod = cgroup_job(&k).unwrap();
        assert_eq!(pod.kind, JobKind::Pod);
        assert_eq!(pod.label, format!("pod:{uid}"));
        assert!(pod.root.ends_with(".slice"), "{}", pod.root);
    }
}
