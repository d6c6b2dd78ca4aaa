//! The deployment assets in `deploy/`, as far as a machine without Slurm, systemd as PID 1 or
//! a Kubernetes cluster allows: the Slurm epilog runs for real against the simulated driver
//! (with a stand-in `scontrol` that records how it was called), the systemd unit goes through
//! `systemd-analyze verify`, and every command line in the Kubernetes manifests is parsed
//! (and, where harmless, run) by the real binary. The Prometheus rules and the Grafana
//! dashboard are tested with a real Prometheus in `tests/agent.rs`.

mod common;
use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use vramguard_sim::state::AfterExit;
use yaml_rust2::{Yaml, YamlLoader};

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .join(path)
}

/// What one epilog run did.
struct Epilog {
    log: String,
    /// The arguments `scontrol` was called with, one call per line.
    scontrol: String,
}

/// Runs the Slurm epilog for a job that used `gpus`, on `world`.
fn epilog(world: &World, gpus: &str) -> Epilog {
    epilog_on(world, gpus, None)
}

/// [`epilog`] on a node whose `scontrol show node` prints `node_line` (nothing by default).
fn epilog_on(world: &World, gpus: &str, node_line: Option<&str>) -> Epilog {
    let dir = world.dir.path().join(format!("epilog-{gpus}"));
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let calls = dir.join("scontrol.calls");
    let shown = dir.join("node.show");
    if let Some(line) = node_line {
        std::fs::write(&shown, format!("{line}\n")).unwrap();
    }
    let scontrol = bin.join("scontrol");
    std::fs::write(
        &scontrol,
        format!(
            "#!/bin/sh\nprintf '%s|' \"$@\" >> {calls}\necho >> {calls}\n\
             if [ \"$1\" = show ] && [ -f {shown} ]; then cat {shown}; fi\n",
            calls = calls.display(),
            shown = shown.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&scontrol, std::fs::Permissions::from_mode(0o755)).unwrap();
    let log = dir.join("epilog.log");
    let out = Command::new("bash")
        .arg(deploy("slurm/epilog.sh"))
        .env_clear()
        .env(
            "PATH",
            format!("{}:/usr/local/bin:/usr/bin:/bin", bin.display()),
        )
        .env("VRAMGUARD", BIN)
        .env("VRAMGUARD_CONFIG", "none")
        .env("VRAMGUARD_SIM", world.state_path())
        .env("VRAMGUARD_EPILOG_LOG", &log)
        .env("VRAMGUARD_AUDIT_LOG", dir.join("audit.jsonl"))
        .env("VRAMGUARD_EPILOG_TRIES", "2")
        .env("VRAMGUARD_EPILOG_SLEEP", "0.2")
        // The stand-in scontrol cannot answer `vramguard slurm heal` (tests/slurm.rs runs it
        // against a real cluster).
        .env("VRAMGUARD_HEAL", "0")
        .env("SLURM_JOB_ID", "4242")
        .env("SLURM_JOB_GPUS", gpus)
        .env("SLURMD_NODENAME", "gpu07")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "an epilog must not fail (Slurm would drain with a useless reason): {out:?}"
    );
    Epilog {
        log: std::fs::read_to_string(&log).unwrap_or_default(),
        scontrol: std::fs::read_to_string(&calls).unwrap_or_default(),
    }
}

/// Memory the driver keeps after its process is gone: only a reset frees it.
fn residue(world: &World, gpu: u32) {
    let mut a = allocation(gpu, 999_999, 3 * GIB);
    a.after_exit = AfterExit::Leak;
    world.allocate(a);
}

#[test]
fn the_slurm_epilog_passes_clean_gpus_and_ignores_other_jobs_gpus() {
    let world = World::new(2);
    residue(&world, 1);
    let e = epilog(&world, "0");
    assert!(e.log.contains("job=4242 GPUs 0 clean"), "{}", e.log);
    assert_eq!(e.scontrol, "", "GPU 1's residue is another job's business");
}

#[test]
fn the_slurm_epilog_reclaims_a_jobs_orphans() {
    let world = World::new(1);
    // The job's leader died; its worker lives on as an orphan holding 2 GiB.
    let mut s = spec(&world, json!([hold(0, 1)]));
    s["group_leader"] = json!(true);
    s["workers"] = json!([{ "argv": ["python3", "train.py"], "spec": {
        "state": world.state_path(), "lifetime_ms": 120_000, "holds": [hold(0, 2)] } }]);
    let mut job = start(&world, &["python3", "train.py"], s);
    job.crash();
    let worker = job.workers[0];
    let e = epilog(&world, "0");
    assert!(
        e.log.contains("not clean after the job; reclaiming"),
        "{}",
        e.log
    );
    assert!(e.log.contains("reclaimed"), "{}", e.log);
    assert_eq!(e.scontrol, "", "nothing left: no drain");
    wait_until(5, "the orphan to be gone", || !alive(worker));
}

/// Without SLURM_JOB_GPUS, the epilog finds its job's leftovers by their `job_N` cgroup and
/// reclaims only those: another job's orphan on the same node is left to that job's epilog.
#[test]
fn without_a_gpu_list_the_slurm_epilog_reclaims_only_its_own_jobs_leftovers() {
    let world = World::new(1);
    let mut cg = TestCgroup::new();
    let ours = start(
        &world,
        &["python3", "train.py"],
        spec(&world, json!([hold(0, 2)])),
    );
    cg.enter(
        "system.slice/slurmstepd.scope/job_4242/step_0/user/task_0",
        ours.pid,
    );
    let theirs = start(
        &world,
        &["python3", "train.py"],
        spec(&world, json!([hold(0, 1)])),
    );
    cg.enter(
        "system.slice/slurmstepd.scope/job_4300/step_0/user/task_0",
        theirs.pid,
    );
    let e = epilog(&world, "");
    assert!(
        e.log
            .contains("no SLURM_JOB_GPUS: reclaimed what job 4242's cgroup still held"),
        "{}",
        e.log
    );
    wait_until(10, "job 4242's orphan to be gone", || !alive(ours.pid));
    assert!(
        alive(theirs.pid),
        "job 4300's orphan is not job 4242's business"
    );
    assert_eq!(e.scontrol, "");
}

#[test]
fn the_slurm_epilog_drains_the_node_with_the_reason_when_residue_stays() {
    let world = World::new(2);
    residue(&world, 1);
    let e = epilog_on(
        &world,
        "1",
        Some("NodeName=gpu07 Arch=x86_64 State=MIXED ThreadsPerCore=1"),
    );
    assert!(e.log.contains("draining gpu07"), "{}", e.log);
    // The node is read first (someone else's drain is left alone), then drained.
    let calls: Vec<&str> = e.scontrol.lines().collect();
    assert_eq!(calls.len(), 2, "{}", e.scontrol);
    assert!(calls[0].starts_with("show|node|gpu07|"), "{}", e.scontrol);
    let calls = &calls[1..];
    let args: Vec<&str> = calls[0].trim_end_matches('|').split('|').collect();
    assert_eq!(&args[..3], ["update", "NodeName=gpu07", "State=DRAIN"]);
    assert!(
        args[3].starts_with("Reason=vramguard: ghost memory: 3.0 GiB on GPU 1"),
        "{}",
        args[3]
    );
    // What the reclaim attempt found is in the epilog's log.
    assert!(
        e.log.contains("only a GPU reset (or reboot) clears it"),
        "{}",
        e.log
    );
}

/// A node an admin drained (or set down) keeps the admin's reason: the epilog reads it first
/// and does not write its own over it (the heal would then take the drain for vramguard's,
/// reset the GPU and resume the node).
#[test]
fn the_slurm_epilog_leaves_a_node_drained_by_someone_else_as_it_is() {
    let world = World::new(2);
    residue(&world, 1);
    let e = epilog_on(
        &world,
        "1",
        Some(
            "NodeName=gpu07 Arch=x86_64 State=MIXED+DRAIN ThreadsPerCore=1 \
             Reason=maintenance: replace PSU [root@2026-12-08T01:00:00]",
        ),
    );
    assert!(
        e.log
            .contains("is drained by someone else already (maintenance: replace PSU"),
        "{}",
        e.log
    );
    assert!(
        !e.scontrol.contains("update|"),
        "the admin's drain was written over: {}",
        e.scontrol
    );
    // vramguard's own drain is updated as before.
    let world = World::new(2);
    residue(&world, 1);
    let e = epilog_on(
        &world,
        "1",
        Some("NodeName=gpu07 State=IDLE+DRAIN Reason=vramguard: ghost memory [root@x]"),
    );
    assert!(
        e.scontrol.contains("update|NodeName=gpu07|State=DRAIN|"),
        "{}",
        e.scontrol
    );
}

#[test]
fn the_systemd_unit_verifies() {
    let Ok(analyze) = which("systemd-analyze") else {
        panic!("systemd-analyze is missing: scripts/test.sh installs systemd");
    };
    // `verify` checks that ExecStart exists: point it at the binary under test.
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(deploy("systemd/vramguard-agent.service")).unwrap();
    assert!(text.contains("ExecStart=/usr/local/bin/vramguard agent "));
    let unit = dir.path().join("vramguard-agent.service");
    std::fs::write(&unit, text.replace("/usr/local/bin/vramguard", BIN)).unwrap();
    let out = Command::new(analyze)
        .arg("verify")
        .arg(&unit)
        .env("SYSTEMD_LOG_LEVEL", "warning")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Missing units it orders itself after (nvidia-persistenced on a machine without a
    // driver) are the only complaint allowed.
    let complaints: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.is_empty() && !l.contains("nvidia-persistenced.service"))
        .collect();
    assert!(complaints.is_empty(), "{stderr}");
    // And the agent runs with that command line: it serves its first collection.
    let exec = text
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart=/usr/local/bin/vramguard "))
        .unwrap();
    let world = World::new(1);
    let cfg = config(&world, "[agent]\nlisten = \"127.0.0.1:0\"\n");
    let args: Vec<String> = exec
        .split_whitespace()
        .map(|a| match a {
            "/etc/vramguard/config.toml" => cfg.display().to_string(),
            _ => a.to_string(),
        })
        .collect();
    agent_serves(&world, &args);
}

/// Starts `vramguard ARGS` (on the simulated driver of `world`) and checks that it is an agent
/// that collects and serves its metrics.
fn agent_serves(world: &World, args: &[String]) {
    let mut cmd = vg_command();
    cmd.env("VRAMGUARD_SIM", world.state_path()).args(args);
    let agent = Agent::spawn(cmd, true);
    let (code, body) = agent.get("/metrics");
    assert_eq!(code, 200);
    assert!(
        sample(&body, "vramguard_up", &["gpu=\"0\""]) == Some(1.0),
        "{body}"
    );
    assert_eq!(agent.get("/healthz").0, 200);
}

fn which(tool: &str) -> Result<PathBuf, ()> {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(|d| Path::new(d).join(tool))
        .chain([
            Path::new("/usr/bin").join(tool),
            Path::new("/bin").join(tool),
        ])
        .find(|p| p.is_file())
        .ok_or(())
}

fn strings(y: &Yaml) -> Vec<String> {
    y.as_vec()
        .map(|v| {
            v.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn the_kubernetes_manifests_hold_together_and_their_commands_run() {
    let text = std::fs::read_to_string(deploy("kubernetes/daemonset.yaml")).unwrap();
    let docs = YamlLoader::load_from_str(&text).expect("valid YAML");
    let kind = |d: &Yaml| d["kind"].as_str().unwrap_or("").to_string();
    let ds = docs
        .iter()
        .find(|d| kind(d) == "DaemonSet")
        .expect("a DaemonSet");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(
        pod["hostPID"].as_bool(),
        Some(true),
        "host pids: orphans are visible"
    );
    assert_eq!(pod["runtimeClassName"].as_str(), Some("nvidia"));
    let agent = &pod["containers"][0];
    let mounts = agent["volumeMounts"].as_vec().unwrap();
    let proc = mounts
        .iter()
        .find(|m| m["mountPath"].as_str() == Some("/host/proc"))
        .expect("the host's /proc");
    assert_eq!(proc["readOnly"].as_bool(), Some(true));
    let caps = strings(&agent["securityContext"]["capabilities"]["add"]);
    assert!(caps.contains(&"SYS_PTRACE".to_string()), "{caps:?}");
    assert_eq!(
        agent["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );

    // The agent's command line and the ConfigMap's config are accepted by the binary.
    let world = World::new(1);
    let cm = docs.iter().find(|d| kind(d) == "ConfigMap").unwrap();
    let shipped = cm["data"]["config.toml"].as_str().unwrap();
    // The agent listens where the pod's port and its probe point.
    let port = agent["ports"][0]["containerPort"].as_i64().unwrap();
    assert_eq!(
        agent["readinessProbe"]["httpGet"]["port"].as_i64(),
        Some(port)
    );
    let listen = format!("listen = \"0.0.0.0:{port}\"");
    assert!(shipped.contains(&listen), "{shipped}");
    // Here on a free loopback port, as the test cannot own port {port}.
    let cfg = config(
        &world,
        &shipped.replace(&listen, "listen = \"127.0.0.1:0\""),
    );
    let args: Vec<String> = strings(&agent["args"])
        .into_iter()
        .map(|a| match a.as_str() {
            "/host/proc" => "/proc".into(),
            "/etc/vramguard/config.toml" => cfg.display().to_string(),
            _ => a,
        })
        .collect();
    assert!(args.iter().any(|a| a == "agent"), "{args:?}");
    agent_serves(&world, &args);
    Vg::new(&world, Path_::InProcess)
        .args(["--config".as_ref(), cfg.as_os_str(), "diagnose".as_ref()])
        .code(0);

    // The example pod: `vramguard run` as the entrypoint (run here on a job that succeeds),
    // and its preStop hook.
    let train = docs
        .iter()
        .find(|d| kind(d) == "Pod")
        .map(|d| &d["spec"]["containers"][0])
        .unwrap();
    let entry = strings(&train["command"]);
    assert_eq!(&entry[..2], ["vramguard", "run"]);
    assert_eq!(entry.last().map(String::as_str), Some("--"));
    Vg::new(&world, Path_::InProcess)
        .args(&entry[1..])
        .args(["true"])
        .code(0);
    let hook = strings(&train["lifecycle"]["preStop"]["exec"]["command"]);
    assert_eq!(hook[0], "vramguard");
    let plan = Vg::new(&world, Path_::InProcess).args(&hook[1..]).json(0);
    assert!(plan.is_object(), "{plan}");
}
