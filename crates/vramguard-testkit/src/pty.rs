//! Pseudo-terminals for tests and benchmarks of the live view: a program started on one
//! sees a real terminal (its own session, the pty as controlling terminal, a window size),
//! and everything it writes is collected.

use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

/// A pseudo-terminal of `rows` × `cols`: (master, slave).
pub fn pair(rows: u16, cols: u16) -> std::io::Result<(OwnedFd, OwnedFd)> {
    use rustix::pty::{OpenptFlags, grantpt, openpt, ptsname, unlockpt};
    let master = openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY)?;
    grantpt(&master)?;
    unlockpt(&master)?;
    let name = ptsname(&master, Vec::new())?;
    let slave: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name.to_bytes()))?
        .into();
    rustix::termios::tcsetwinsize(
        &master,
        rustix::termios::Winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        },
    )?;
    Ok((master, slave))
}

/// Starts `cmd` on the terminal `slave`, as a shell would: in its own session, with the pty
/// as its controlling terminal and as stdin, stdout and stderr.
pub fn spawn_on(cmd: &mut Command, slave: &OwnedFd) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::from(slave.try_clone()?))
        .stdout(Stdio::from(slave.try_clone()?))
        .stderr(Stdio::from(slave.try_clone()?));
    // SAFETY: setsid and an ioctl on an inherited fd, between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::setsid()?;
            rustix::process::ioctl_tiocsctty(std::io::stdin().as_fd())?;
            Ok(())
        });
    }
    cmd.spawn()
}

/// Everything written to a terminal's master side, collected by a thread.
#[derive(Clone)]
pub struct Collected(Arc<Mutex<Vec<u8>>>);

impl Collected {
    /// Reads `master` until the terminal closes.
    pub fn start(master: &OwnedFd) -> std::io::Result<Collected> {
        let mut reader = std::fs::File::from(master.try_clone()?);
        let bytes = Arc::new(Mutex::new(Vec::new()));
        let sink = bytes.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&buf[..n]);
            }
        });
        Ok(Collected(bytes))
    }
    /// How many bytes so far.
    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
    /// Whether nothing came yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// What came, escape sequences included.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }
}
