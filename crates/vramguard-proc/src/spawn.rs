//! Starting processes whose reaction to signals is measured or relied on.

/// Gives `cmd` the default disposition of every signal a kill experiment sends, and an empty
/// signal mask. A process started from a non-interactive shell's background job inherits
/// SIGINT and SIGQUIT ignored (POSIX), which would make "how does the holder die of SIGINT"
/// measure the caller's shell instead.
pub fn with_default_signals(cmd: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: signal() and sigprocmask() are async-signal-safe; nothing is allocated.
    unsafe {
        cmd.pre_exec(|| {
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGQUIT, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_DFL);
            }
            let mut none: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut none);
            libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
            Ok(())
        })
    }
}

/// What a command run by [`run_bounded`] gave.
#[derive(Debug)]
pub struct Bounded {
    /// How it ended.
    pub status: std::process::ExitStatus,
    /// Its standard output, at most the bound asked for.
    pub stdout: Vec<u8>,
    /// Its standard error, at most the bound asked for.
    pub stderr: Vec<u8>,
}

/// Why a bounded command gave no status.
#[derive(Debug, thiserror::Error)]
pub enum BoundedError {
    /// It could not be started.
    #[error("could not start it: {0}")]
    Start(std::io::Error),
    /// It gave no answer in time and was killed.
    #[error("no answer within {}s: killed", .0.as_secs())]
    Timeout(std::time::Duration),
    /// Waiting for it failed.
    #[error("waiting for it: {0}")]
    Wait(std::io::Error),
}

/// Runs `cmd` (stdin closed, stdout and stderr captured, each cut at `max_output` bytes) for at
/// most `timeout`, then kills it by its handle (our own child: the kill cannot reach another
/// process). Output a descendant keeps writing after it exits is given up on after a second.
pub fn run_bounded(
    cmd: &mut std::process::Command,
    timeout: std::time::Duration,
    max_output: u64,
) -> Result<Bounded, BoundedError> {
    use std::io::Read;
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(BoundedError::Start)?;
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        let (tx, rx) = std::sync::mpsc::channel();
        if let Some(pipe) = pipe {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = pipe.take(max_output).read_to_end(&mut buf);
                let _ = tx.send(buf);
            });
        }
        rx
    };
    let out = read(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = read(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                // A command stuck in the driver does not die until its call returns: reaped
                // if it goes within a second, else left behind (a zombie until this process
                // ends) rather than waited for without limit.
                let until = Instant::now() + Duration::from_secs(1);
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(20));
                }
                return Err(BoundedError::Timeout(timeout));
            }
            Err(e) => return Err(BoundedError::Wait(e)),
        }
    };
    let take = |rx: std::sync::mpsc::Receiver<Vec<u8>>| {
        rx.recv_timeout(Duration::from_secs(1)).unwrap_or_default()
    };
    Ok(Bounded {
        status,
        stdout: take(out),
        stderr: take(err),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::{Duration, Instant};

    #[test]
    fn a_bounded_command_gives_its_output_and_a_hung_one_is_killed_in_time() {
        let done = run_bounded(
            Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
            Duration::from_secs(5),
            1024,
        )
        .unwrap();
        assert_eq!(done.status.code(), Some(3));
        assert_eq!(done.stdout, b"out\n");
        assert_eq!(done.stderr, b"err\n");
        let cut = run_bounded(
            Command::new("sh").args(["-c", "yes | head -c 100000"]),
            Duration::from_secs(5),
            10,
        )
        .unwrap();
        assert_eq!(cut.stdout.len(), 10);
        let t = Instant::now();
        let hung = run_bounded(
            Command::new("sleep").arg("30"),
            Duration::from_millis(300),
            1024,
        );
        assert!(matches!(hung, Err(BoundedError::Timeout(_))), "{hung:?}");
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // A descendant that keeps the pipe open after the command exits holds nothing up.
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        let t = Instant::now();
        let left = run_bounded(
            Command::new("sh")
                .args(["-c", "sleep 30 & echo $! > \"$1\""])
                .arg("sh")
                .arg(&pid_file),
            Duration::from_secs(5),
            1024,
        )
        .unwrap();
        assert!(left.status.success());
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // The sleep this test started, by its pid.
        if let Ok(pid) = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse::<i32>()
        {
            // SAFETY: kill(2) of the process this test started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}
