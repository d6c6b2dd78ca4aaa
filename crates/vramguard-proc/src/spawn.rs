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
