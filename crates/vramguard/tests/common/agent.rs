//! A running `vramguard agent` for tests, and readers of its endpoints.

use super::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A running agent; killed on drop.
pub struct Agent {
    pub child: Reaped,
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

/// SIGTERM first, as systemd stops it: the agent finishes what its notifier is doing (an
/// alert command's cgroup is removed) before it exits. `Reaped`'s SIGKILL comes only after
/// 5 s (a test that left a delivery hanging).
impl Drop for Agent {
    fn drop(&mut self) {
        let child = &mut self.child.0;
        if let Ok(None) = child.try_wait() {
            // SAFETY: kill(2) on our own child, not reaped yet: its pid cannot be reused.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let t0 = std::time::Instant::now();
            while t0.elapsed() < std::time::Duration::from_secs(5) {
                if !matches!(child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}

impl Agent {
    pub fn start(world: &World, path: Path_, config: &str) -> Agent {
        Agent::start_with_nofile(world, path, config, None)
    }

    /// [`Agent::start`] with the descriptor limit `nofile` (soft and hard), as a unit's
    /// `LimitNOFILE` would set it.
    pub fn start_with_nofile(
        world: &World,
        path: Path_,
        config: &str,
        nofile: Option<u64>,
    ) -> Agent {
        let cmd = Agent::command(world, path, config, nofile, &[]);
        // Behind TLS or a password, plain requests cannot tell; the caller checks.
        Agent::spawn(cmd, !config.contains("web_config"))
    }

    /// [`Agent::start`] with `agent` options of the caller's (`--web.config.file PATH`); it
    /// does not wait for the first collection (behind a password a plain request cannot tell).
    pub fn start_with_args(world: &World, config: &str, args: &[&std::ffi::OsStr]) -> Agent {
        Agent::spawn(
            Agent::command(world, Path_::InProcess, config, None, args),
            false,
        )
    }

    fn command(
        world: &World,
        path: Path_,
        config: &str,
        nofile: Option<u64>,
        args: &[&std::ffi::OsStr],
    ) -> Command {
        let cfg = world
            .dir
            .path()
            .join(format!("agent-{}.toml", std::process::id()));
        std::fs::write(&cfg, config).unwrap();
        let mut cmd = vg_command();
        cmd.env_remove("VRAMGUARD_SIM")
            .args(["--sim".as_ref(), world.state_path().as_os_str()]);
        if path == Path_::Nvml {
            cmd.arg("--nvml-lib").arg(sim_nvml_lib());
        }
        if let Some(n) = nofile {
            use std::os::unix::process::CommandExt;
            // SAFETY: setrlimit is async-signal-safe.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        cmd.args([
            "--config".as_ref(),
            cfg.as_os_str(),
            "agent".as_ref(),
            "--listen".as_ref(),
            "127.0.0.1:0".as_ref(),
        ]);
        cmd.args(args);
        cmd
    }

    /// Starts an agent from a prepared command (its stderr is taken here); waits for the
    /// first collection when `wait_ready`.
    pub fn spawn(mut cmd: Command, wait_ready: bool) -> Agent {
        let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let l2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                l2.lock().unwrap().push(line);
            }
        });
        let child = Reaped(child);
        let mut addr = None;
        wait_until(20, "the agent to listen", || {
            addr = log.lock().unwrap().iter().find_map(|l| {
                let plain = strip_ansi(l);
                plain
                    .split("listen=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse()
                    .ok()
            });
            addr.is_some()
        });
        let agent = Agent {
            child,
            addr: addr.unwrap(),
            log,
        };
        if wait_ready {
            wait_until(20, "the first collection", || {
                agent.get("/healthz").0 == 200
            });
        }
        agent
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        http_get(self.addr, path)
    }

    pub fn metrics(&self) -> String {
        self.get("/metrics").1
    }

    pub fn log_text(&self) -> String {
        self.log
            .lock()
            .unwrap()
            .iter()
            .map(|l| strip_ansi(l))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

pub fn strip_ansi(s: &str) -> String {
    let mut out = String::new();
    let mut esc = false;
    for c in s.chars() {
        match (esc, c) {
            (false, '\x1b') => esc = true,
            (true, 'm') => esc = false,
            (true, _) => {}
            (false, c) => out.push(c),
        }
    }
    out
}

pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(2)) else {
        return (0, String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    );
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    let status = buf
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = buf
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// A GET with an `Accept` header: (status, the response's header lines, body).
pub fn http_get_accepting(addr: SocketAddr, path: &str, accept: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: test\r\nAccept: {accept}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}

/// The value of the first sample of `metric` whose labels contain all of `labels`.
pub fn sample(text: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(metric) && l[metric.len()..].starts_with(['{', ' ']))
        .find(|l| labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The agent's collections so far, of every depth (`vramguard_collections_total`): a test
/// that must let the agent act for a while counts its rounds instead of sleeping, so a
/// loaded machine stretches the window instead of shortening it.
pub fn collections(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| l.starts_with("vramguard_collections_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

impl Agent {
    /// Waits until the agent has collected `n` more times than now (60 s at most).
    pub fn wait_collections(&self, n: u32) {
        let from = collections(&self.metrics());
        wait_until(60, &format!("the agent to collect {n} more times"), || {
            collections(&self.metrics()) >= from + f64::from(n)
        });
    }
}

/// Whether the peer has closed `s` (end of stream or reset), without waiting: a connection
/// the agent closed reads as closed at once, an open silent one would block.
pub fn closed_by_peer(s: &TcpStream) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 1];
    let closed = match s.peek(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    s.set_nonblocking(false).unwrap();
    closed
}
