"""`vramguard.guard()`: per-process (per-rank) cleanup of the GPU memory this process's own
children hold, on exit, on an exception and on SIGTERM/SIGINT.

Why: a training script's DataLoader workers, spawned helpers or a subprocess that opened the
GPU outlive it when the script dies of an exception or of torchrun's SIGTERM; their memory
stays "used" until someone runs `vramguard reclaim`. The guard ends them itself, and only
them:

- only descendants of `os.getpid()` started inside the block: the processes whose parent
  chain (`/proc/PID/stat` field 4) leads to this process when the guard looks, plus those it
  recorded while it ran (a grandchild whose parent exited is re-parented, but it was ours
  when recorded); those already alive when the block was entered (an outer loop's
  persistent DataLoader workers, a server an earlier notebook cell started) are left alone;
- only those that hold a GPU: an open `nvidiaN` or `nvidia-uvm` device file in
  `/proc/PID/fd` (a monitor that holds only `nvidiactl` holds no memory);
- only processes of this user (real, effective and saved uid all ours), never this process,
  never its parent;
- every signal goes through a pidfd, opened and then checked against the start time
  recorded with the pid, so a reused pid is never signalled. Descendants are recorded as
  (pid, start time): the guard keeps no file open while the job runs.

SIGTERM first; SIGKILL for those still alive after `grace` seconds; then, with the vramguard
binary, a wait (at most `release_timeout` seconds) until `vramguard status` lists none of
them, i.e. their memory is back. Everything it does is logged on the "vramguard" logger.
"""

import errno
import functools
import json
import logging
import os
import select
import signal
import sys
import threading
import time

from . import VramguardError, _run_json, _size, _visible

log = logging.getLogger("vramguard")

#: Seconds between SIGTERM and SIGKILL.
GRACE_SECS = 10.0
#: Seconds to wait, after the exits, for vramguard to list none of the processes ended.
RELEASE_SECS = 30.0
#: Seconds between two looks for new descendants while the guard runs (None or 0: none).
WATCH_SECS = 5.0
#: Seconds to wait for a process to go after SIGKILL (one stuck in D state does not).
KILL_WAIT_SECS = 5.0
#: At most this many of a process's fds are read: a process with a million open files
#: costs no more than this.
MAX_FDS = 65536
#: At most this many descendants are recorded (pid and start time: no file is kept open, so
#: the guard never takes the job's file descriptors).
MAX_TRACKED = 4096
#: The longest `vramguard status` call while cleaning.
STATUS_TIMEOUT_SECS = 5.0


class _Stat:
    """What `/proc/PID/stat` says of a process (proc(5)): its parent, state letter, start
    time (clock ticks after boot: with the pid, its identity) and command name."""

    __slots__ = ("ppid", "state", "start", "comm")

    def __init__(self, ppid, state, start, comm):
        self.ppid, self.state, self.start, self.comm = ppid, state, start, comm


def _stat(pid):
    """`/proc/PID/stat`, or None when the process is gone or the file cannot be read."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read(4096)
    except OSError:
        return None
    # The command name may hold spaces and parentheses: it ends at the last ')'.
    open_, close = data.find(b"("), data.rfind(b")")
    if open_ < 0 or close < open_:
        return None
    fields = data[close + 2 :].split()
    try:
        return _Stat(
            int(fields[1]),
            fields[0].decode("ascii", "replace"),
            int(fields[19]),
            data[open_ + 1 : close].decode("utf-8", "replace"),
        )
    except (IndexError, ValueError):
        return None


def _uids(pid):
    """Real, effective and saved uid of `pid` (`Uid:` of /proc/PID/status), or None."""
    try:
        with open("/proc/%d/status" % pid, "rb") as f:
            text = f.read(16384).decode("ascii", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            try:
                return tuple(int(v) for v in line.split()[1:4])
            except ValueError:
                return None
    return None


def _descendants(root):
    """Every process whose parent chain leads to `root` now: pid -> _Stat."""
    children = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        st = _stat(pid)
        if st is not None:
            children.setdefault(st.ppid, []).append((pid, st))
    found, queue = {}, [root]
    while queue:
        for pid, st in children.get(queue.pop(), ()):
            if pid != root and pid not in found:
                found[pid] = st
                queue.append(pid)
    return found


def dev_dir():
    """The directory of the nvidia* device files: `/dev`, or with `VRAMGUARD_SIM` (the
    simulated driver) the simulator's stand-in directory, as the binary reads it."""
    sim = os.environ.get("VRAMGUARD_SIM")
    if sim:
        try:
            with open(sim, "rb") as f:
                named = json.loads(f.read(1 << 20).decode("utf-8")).get("dev_dir")
            if isinstance(named, str) and named:
                return named.rstrip("/") or "/"
        except (OSError, ValueError, AttributeError) as e:
            log.warning("guard: VRAMGUARD_SIM=%s unreadable (%s): looking for /dev/nvidia*",
                        _visible(sim, 200), _visible(e, 200))
    return "/dev"


def _is_gpu_file(target, devices):
    """Whether an fd's link target is a GPU device file: `nvidiaN` (N: 1 to 4 digits) or
    `nvidia-uvm` in `devices` (what vramguard-proc's `device_file` calls Gpu and Uvm)."""
    prefix = devices.rstrip("/") + "/nvidia"
    if not target.startswith(prefix):
        return False
    name = target[len(prefix) :]
    return name == "-uvm" or (1 <= len(name) <= 4 and name.isascii() and name.isdigit())


def _gpu_files(pid, devices):
    """The GPU device files `pid` holds open (at most MAX_FDS fds read); None if its fds
    cannot be read (gone, or not ours to read)."""
    held = []
    try:
        entries = os.scandir("/proc/%d/fd" % pid)
    except OSError:
        return None
    with entries:
        for n, entry in enumerate(entries):
            if n >= MAX_FDS:
                break
            try:
                target = os.readlink(entry.path)
            except OSError:
                continue
            if _is_gpu_file(target, devices) and target not in held:
                held.append(target)
    return held


def _exited(pidfd):
    """Whether the process behind `pidfd` has exited (a pidfd polls readable then). poll, not
    select: a training process's fds run past select's 1024."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def _wait_exits(tracked, seconds, on_exit=lambda t: None):
    """Waits until every process in `tracked` has exited or `seconds` have passed, calling
    `on_exit` for each as it goes; returns those still alive."""
    deadline = time.monotonic() + seconds
    alive = list(tracked)
    while alive:
        for t in [t for t in alive if _exited(t.pidfd)]:
            alive.remove(t)
            on_exit(t)
        left = deadline - time.monotonic()
        if not alive or left <= 0:
            break
        poller = select.poll()
        for t in alive:
            poller.register(t.pidfd, select.POLLIN)
        poller.poll(max(1, int(left * 1000)))
    return alive


class _Tracked:
    """A descendant as recorded: pid and start time (together, its identity), command name;
    `pidfd` once the cleanup opened one and found it still is that process."""

    __slots__ = ("pid", "start", "comm", "pidfd")

    def __init__(self, pid, start, comm):
        self.pid, self.start, self.comm, self.pidfd = pid, start, comm, None

    def name(self):
        return "pid %d (%s)" % (self.pid, _visible(self.comm, 32))


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "signal %d" % signum


class Guard:
    """A context manager and a decorator: see `guard()`."""

    def __init__(self, grace=GRACE_SECS, release_timeout=RELEASE_SECS, watch=WATCH_SECS,
                 signals=(signal.SIGTERM, signal.SIGINT)):
        for name, value in (("grace", grace), ("release_timeout", release_timeout)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError("guard(): %s must be a number of seconds >= 0" % name)
        if watch is not None and (not isinstance(watch, (int, float)) or watch < 0):
            raise ValueError("guard(): watch must be a number of seconds >= 0, or None")
        self._settings = dict(grace=grace, release_timeout=release_timeout, watch=watch,
                              signals=tuple(signals))
        self.grace = float(grace)
        self.release_timeout = float(release_timeout)
        self.watch = float(watch) if watch else None
        self.signals = tuple(signals)
        self._owner = None
        self._tracked = {}
        # (pid, start time) of the descendants alive when the block was entered: not ours.
        self._before = set()
        # False where /proc is not this process's PID namespace's: nothing is signalled.
        self._proc_is_ours = True
        self._adopts_orphans = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = None
        self._previous = {}
        self._cleaning = False
        self._pending = None

    # -- decorator ---------------------------------------------------------------------
    def __call__(self, func):
        """Runs `func` under a fresh guard with the same settings at each call."""
        settings = self._settings

        @functools.wraps(func)
        def guarded(*args, **kwargs):
            with Guard(**settings):
                return func(*args, **kwargs)

        return guarded

    # -- context manager ---------------------------------------------------------------
    def __enter__(self):
        if self._owner is not None:
            raise RuntimeError("a guard() is entered once; make a new one for each block")
        if not (hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")):
            log.warning("guard: Python %s has no pidfds (3.9 and Linux 5.3 needed): it will "
                        "signal nothing", ".".join(str(v) for v in sys.version_info[:3]))
        self._owner = os.getpid()
        # A pidfd names the pid in this process's PID namespace, /proc/PID the one in /proc's:
        # under `unshare -p` without a /proc of its own they differ, and a check through /proc
        # would vouch for another process than the one signalled.
        try:
            self._proc_is_ours = os.readlink("/proc/self") == str(self._owner)
        except OSError:
            self._proc_is_ours = False
        if not self._proc_is_ours:
            log.warning("guard: /proc is not this process's PID namespace's (unshare -p "
                        "without --mount-proc?): it will signal nothing")
        # PID 1 of a PID namespace (a container's entrypoint without an init) adopts every
        # orphan of the namespace: a process a `docker exec` session left behind reads as its
        # child, and nothing tells the two apart. Such a guard signals nothing.
        self._adopts_orphans = self._owner == 1
        if self._adopts_orphans:
            log.warning("guard: this process is PID 1 of its PID namespace, which adopts every "
                        "orphan there, so its children cannot be told from processes it never "
                        "started: it will signal nothing (run with `docker run --init`, or "
                        "under `vramguard run`)")
        self._before = {(pid, st.start) for pid, st in _descendants(self._owner).items()}
        self._record()
        if threading.current_thread() is threading.main_thread():
            self._install_handlers()
        else:
            log.debug("guard: not the main thread: no signal handlers, cleanup on exit only")
        if self.watch:
            self._watcher = threading.Thread(target=self._watch, name="vramguard-guard",
                                             daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, kind, error, traceback):
        if os.getpid() != self._owner:
            # A forked copy of the guarded process (a DataLoader worker leaving the block):
            # the children are the original's to end.
            return False
        self._cleaning = True
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        try:
            if kind is None:
                why = "exit"
            elif issubclass(kind, KeyboardInterrupt):
                why = "KeyboardInterrupt"
            elif issubclass(kind, SystemExit):
                why = "exit (SystemExit %s)" % _visible(getattr(error, "code", None), 40)
            else:
                why = "exception %s" % _visible(kind.__name__, 80)
            try:
                self._clean(why)
            except Exception:  # noqa: BLE001 - never hide the job's own exception
                log.exception("guard: the cleanup of pid %d failed", self._owner)
        finally:
            self._restore_handlers()
            with self._lock:
                for t in self._tracked.values():
                    if t.pidfd is not None:
                        os.close(t.pidfd)
                self._tracked.clear()
        pending, self._pending = self._pending, None
        if pending is not None and (
            kind is None or not issubclass(kind, (KeyboardInterrupt, SystemExit))
        ):
            # A signal that came while cleaning: its usual effect now (over an exception:
            # the process ends as the signal says, the exception shown as its context).
            self._deliver(pending, self._previous.get(pending), None)
        return False

    # -- signals -----------------------------------------------------------------------
    def _install_handlers(self):
        for signum in self.signals:
            try:
                previous = signal.getsignal(signum)
            except (ValueError, OSError):
                continue
            if previous is signal.SIG_IGN or previous is None:
                # Ignored: the process chose not to die of it. None: a handler installed
                # from C, which could not be restored or called.
                continue
            try:
                signal.signal(signum, self._on_signal)
            except (ValueError, OSError) as e:
                log.debug("guard: no handler for %s: %s", _signal_name(signum), e)
                continue
            self._previous[signum] = previous

    def _restore_handlers(self):
        for signum, previous in self._previous.items():
            # Only our own handler is replaced: one installed after ours stays.
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)

    def _on_signal(self, signum, frame):
        previous = self._previous.get(signum)
        if os.getpid() != self._owner:
            # A forked copy inherited this handler: behave as before the guard.
            self._deliver(signum, previous, frame, forked=True)
            return
        if self._cleaning:
            # Cleaning already: finish it, then the signal has its effect.
            self._pending = signum
            log.info("guard: %s received while cleaning: acted on after the cleanup",
                     _signal_name(signum))
            return
        log.info("guard: %s received: ending the GPU-holding children of pid %d",
                 _signal_name(signum), self._owner)
        self._deliver(signum, previous, frame)

    @staticmethod
    def _deliver(signum, previous, frame, forked=False):
        """The signal's effect without the guard: the previous handler if it was Python's
        (it may raise and so unwind through the guard, or return), else KeyboardInterrupt for
        SIGINT, else an exit with the conventional code 128 + signal number."""
        if callable(previous):
            previous(signum, frame)
            return
        if forked and previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    # -- recording ---------------------------------------------------------------------
    def _watch(self):
        while not self._stop.wait(self.watch):
            try:
                self._record()
            except Exception as e:  # noqa: BLE001 - the watcher must never kill the job
                log.debug("guard: looking for descendants failed: %s", e)

    def _record(self):
        """Records every descendant of the guarded process not recorded yet (pid and start
        time), and forgets recorded ones that have exited (gone, a zombie, or their pid now
        another process's)."""
        found = _descendants(self._owner)
        with self._lock:
            for pid, t in list(self._tracked.items()):
                if pid not in found:
                    st = _stat(pid)
                    if st is None or st.start != t.start or st.state in ("Z", "X"):
                        del self._tracked[pid]
            for pid, st in found.items():
                known = self._tracked.get(pid)
                if known is not None and known.start == st.start:
                    continue
                if known is None and len(self._tracked) >= MAX_TRACKED:
                    continue
                if pid in (self._owner, os.getppid()) or st.state in ("Z", "X"):
                    continue
                if (pid, st.start) in self._before:
                    continue
                if known is not None and known.pidfd is not None:
                    # Being cleaned: its pidfd stays with the process it was opened for.
                    continue
                # New, or its pid now another descendant's (the recorded one exited).
                self._tracked[pid] = _Tracked(pid, st.start, st.comm)

    # -- cleaning ----------------------------------------------------------------------
    def _targets(self):
        """Recorded descendants alive now that hold a GPU and are this user's."""
        devices = dev_dir()
        uid = os.getuid()
        targets = []
        with self._lock:
            tracked = list(self._tracked.values())
        for t in tracked:
            if t.pid in (self._owner, os.getppid()) or t.pidfd is not None:
                continue
            # The pidfd first, then the start time: if it still is the one recorded, the
            # pidfd is that process's (a reused pid would have started later), and while the
            # pidfd says it is alive, /proc/PID is still its.
            try:
                pidfd = os.pidfd_open(t.pid)
            except OSError as e:
                if e.errno not in (errno.ESRCH, errno.EINVAL):
                    log.warning("guard: no pidfd for %s (%s): left alone", t.name(), e)
                continue
            st = _stat(t.pid)
            files = _gpu_files(t.pid, devices)
            uids = _uids(t.pid)
            if (
                _exited(pidfd)
                or st is None
                or st.start != t.start
                or st.state in ("Z", "X")
                or not files
            ):
                os.close(pidfd)
                continue
            if uids is None or any(u != uid for u in uids):
                log.info("guard: %s holds %s but is not this user's: left alone", t.name(),
                         _visible(", ".join(files), 200))
                os.close(pidfd)
                continue
            t.pidfd = pidfd
            targets.append((t, files))
        return targets

    def _clean(self, why):
        if (not hasattr(signal, "pidfd_send_signal") or not self._proc_is_ours
                or self._adopts_orphans):
            return
        self._record()
        targets = self._targets()
        if not targets:
            log.debug("guard: %s of pid %d: no child holds a GPU", why, self._owner)
            return
        before = _gpu_holders()
        for t, files in targets:
            try:
                signal.pidfd_send_signal(t.pidfd, signal.SIGTERM)
            except OSError as e:
                log.warning("guard: SIGTERM to %s failed: %s", t.name(), e)
                continue
            log.info("guard: %s of pid %d: SIGTERM sent to its child %s, which holds %s%s",
                     why, self._owner, t.name(), _visible(", ".join(files), 200),
                     _held_text(before, t.pid))
        ended = [t for t, _ in targets]
        started = time.monotonic()
        alive = _wait_exits(ended, self.grace, lambda t: log.info(
            "guard: %s exited %d ms after SIGTERM", t.name(),
            (time.monotonic() - started) * 1000))
        for t in alive:
            try:
                signal.pidfd_send_signal(t.pidfd, signal.SIGKILL)
                log.warning("guard: %s still alive %g s after SIGTERM: SIGKILL sent",
                            t.name(), self.grace)
            except OSError as e:
                log.warning("guard: SIGKILL to %s failed: %s", t.name(), e)
        for t in _wait_exits(alive, KILL_WAIT_SECS):
            log.warning("guard: %s still alive %g s after SIGKILL (uninterruptible sleep?): "
                        "run `vramguard diagnose`", t.name(), KILL_WAIT_SECS)
        if before is None:
            log.info("guard: the vramguard binary could not be asked: waited for the exits "
                     "only")
            return
        self._wait_for_memory({t.pid for t in ended}, before)

    def _wait_for_memory(self, pids, before):
        """Waits until `vramguard status` lists none of `pids` on any GPU."""
        started = time.monotonic()
        deadline = started + self.release_timeout
        while True:
            holders = _gpu_holders()
            if holders is None:
                log.info("guard: vramguard status failed: not waiting for the memory")
                return
            left = sorted(pids & set(holders))
            if not left:
                freed = sum(b or 0 for p in pids for _, b in before.get(p, ()))
                log.info("guard: GPU memory of pid %s back after %d ms%s",
                         ", ".join(str(p) for p in sorted(pids)),
                         (time.monotonic() - started) * 1000,
                         " (%s)" % _size(freed) if freed else "")
                return
            if time.monotonic() >= deadline:
                log.warning("guard: GPU memory of pid %s still held %g s after the exits: "
                            "run `vramguard diagnose`", ", ".join(str(p) for p in left),
                            self.release_timeout)
                return
            time.sleep(0.2)


def _gpu_holders():
    """pid -> [(GPU index, bytes)] from `vramguard status --json --sample 0ms`, or None when
    the binary is missing or fails."""
    try:
        report = _run_json("status", None, 0, STATUS_TIMEOUT_SECS)
    except VramguardError as e:
        log.debug("guard: vramguard status: %s", e)
        return None
    held = {}
    for g in report.get("gpus") or []:
        for h in g.get("holders") or []:
            pid = h.get("pid")
            if isinstance(pid, int):
                held.setdefault(pid, []).append((g.get("index"), h.get("used_bytes")))
    return held


def _held_text(before, pid):
    if not before or pid not in before:
        return ""
    parts = ["%s on GPU %s" % (_size(b), i) for i, b in before[pid] if b]
    return " (%s)" % ", ".join(parts) if parts else ""


def guard(func=None, *, grace=GRACE_SECS, release_timeout=RELEASE_SECS, watch=WATCH_SECS,
          signals=(signal.SIGTERM, signal.SIGINT)):
    """End this process's own GPU-holding children when it leaves a block or a function,
    by returning, by an exception, or on SIGTERM/SIGINT::

        with vramguard.guard():          # a training script, or one torchrun rank
            train()

        @vramguard.guard(grace=5)
        def main(): ...

    On the way out: every descendant of this process (found through /proc, plus those
    recorded every `watch` seconds while it ran) that holds a GPU device file open and
    belongs to this user gets SIGTERM, SIGKILL after `grace` seconds if still alive, then
    the guard waits (at most `release_timeout` seconds) until `vramguard status` no longer
    lists them. Nothing else is ever signalled: not this process, not its parent, not a
    process of another user, not a child that holds no GPU; signals go through pidfds.
    What it did is logged on the "vramguard" logger (INFO; SIGKILLs and memory still held
    after the wait: WARNING).

    Signals (main thread only; in another thread the guard cleans on exit only): the
    previous handler is chained: Python's default SIGINT handler raises KeyboardInterrupt,
    which unwinds through the guard; a signal with no Python handler (SIGTERM's default)
    becomes `SystemExit(128 + signal)` (143 for SIGTERM) after the cleanup. A handler that
    returns (the program goes on) leaves the children alone until the block ends. Handlers
    are put back on exit. A signal ignored (SIG_IGN) stays ignored.

    Under torchrun each rank guards itself: everything is keyed on `os.getpid()`, no rank
    acts on another's processes. A forked copy of the guarded process (a DataLoader
    worker) neither cleans nor keeps the handlers' effect.
    """
    made = Guard(grace=grace, release_timeout=release_timeout, watch=watch, signals=signals)
    if func is not None:
        if not callable(func):
            raise TypeError("guard(): use guard(grace=...) with keyword arguments")
        return made(func)
    return made
