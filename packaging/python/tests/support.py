"""The harness of the Python module's tests: a simulated node made by the vramguard binary
(`vramguard sim init`), GPU holders made by it too (the simulator's holder: a process that
registers memory with the simulated driver and keeps the stand-in device files open), and
the scripts under test run as processes of their own.

`crates/vramguard/tests/python.rs` runs every test here (one Rust test per Python test) with
VRAMGUARD_TEST_BINARY set to the binary cargo built. Every process a test starts is ended by
the test, through a pidfd checked against its start time, never by name.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
FAKE_TORCH = os.path.join(HERE, "fake_torch")


def binary():
    """The vramguard binary under test."""
    path = os.environ.get("VRAMGUARD_TEST_BINARY")
    if not path or not os.access(path, os.X_OK):
        raise AssertionError(
            "VRAMGUARD_TEST_BINARY must name the vramguard binary (crates/vramguard/tests/"
            "python.rs sets it: cargo test -p vramguard --test python)"
        )
    return path


def wait_until(what, condition, secs=20.0):
    """Polls `condition` every 10 ms for `secs` seconds; fails naming `what`."""
    deadline = time.monotonic() + secs
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out after %g s waiting for %s" % (secs, what))
        time.sleep(0.01)


def stat_of(pid):
    """(state letter, start ticks, ppid) of a pid, or None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19]), int(fields[1])


def alive(pid, start):
    """Whether the process `pid` that started at `start` still runs (a zombie has ended)."""
    st = stat_of(pid)
    return st is not None and st[1] == start and st[0] not in ("Z", "X")


def end(pid, start):
    """SIGKILLs `pid` through a pidfd if it still is the process that started at `start`."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if alive(pid, start):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


def holder_spec(state, ready, gib=1, ignore_term=False):
    """The simulator holder's spec: `gib` GiB on GPU 0, at most 60 s of life."""
    return {
        "state": state,
        "holds": [{"gpu": 0, "bytes": gib << 30}],
        "lifetime_ms": 60000,
        "ready_file": ready,
        "ignore_term": ignore_term,
    }


def start_holder(state, gib=1, ignore_term=False):
    """Starts a simulated GPU holder as a child of this process; waits until it holds its
    memory. Returns (Popen, start ticks)."""
    ready = os.path.join(os.path.dirname(state), "ready-%d-%d" % (os.getpid(), time.monotonic_ns()))
    env = dict(os.environ)
    env["VRAMGUARD_HOLDER"] = json.dumps(holder_spec(state, ready, gib, ignore_term))
    # No pipe of the caller's: a holder left alive must not keep a test's read open.
    child = subprocess.Popen([binary()], env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until("holder %d to be ready" % child.pid,
               lambda: os.path.exists(ready) and os.path.getsize(ready) > 0)
    return child, stat_of(child.pid)[1]


class World:
    """A simulated node with one H200 in a temp directory (readable by every user, so that
    a process of another uid can open its device files), removed by `close()`."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="vramguard-py-")
        os.chmod(self.dir, 0o755)
        subprocess.run([binary(), "sim", "init", "--dir", self.dir, "--gpus", "1"],
                       check=True, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self.state = os.path.join(self.dir, "state.json")
        self.dev = os.path.join(self.dir, "dev")
        self.started = []

    def env(self, **extra):
        """The environment of a script under test: this world's simulated driver, the
        binary under test, the module from the source tree, no config file."""
        env = dict(os.environ)
        for name in ("VRAMGUARD_NVML_LIB", "CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK",
                     "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "VRAMGUARD_HOLDER"):
            env.pop(name, None)
        env.update(
            VRAMGUARD_SIM=self.state,
            VRAMGUARD_BINARY=binary(),
            VRAMGUARD_TEST_BINARY=binary(),
            VRAMGUARD_CONFIG="none",
            PYTHONPATH=os.pathsep.join([SRC, HERE, FAKE_TORCH]),
        )
        env.update(extra)
        return env

    def track(self, pid, start):
        """Ends `pid` in `close()` if it still runs."""
        self.started.append((pid, start))

    def holders(self):
        """pid -> bytes on GPU 0, as `vramguard status --json` reports them."""
        out = subprocess.run([binary(), "status", "--json", "--sample", "0ms"],
                             env=self.env(), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             check=False, timeout=30)
        report = json.loads(out.stdout)
        return {h["pid"]: h.get("used_bytes") for h in report["gpus"][0]["holders"]}

    def close(self):
        for pid, start in self.started:
            end(pid, start)
        shutil.rmtree(self.dir, ignore_errors=True)


class Script:
    """A Python script under test, run as a process of its own with `World.env()`. Lines it
    prints as `NAME pid start` (see `report()`) are read as they come."""

    def __init__(self, world, body, **env):
        self.world = world
        path = os.path.join(world.dir, "script-%d.py" % time.monotonic_ns())
        with open(path, "w") as f:
            f.write(body)
        self.proc = subprocess.Popen(
            [sys.executable, path], env=world.env(**env), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        self.seen = {}
        self.lines = []
        # stderr is read as it comes (a test may wait for a log line) into this list.
        self.err = []
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self):
        for line in iter(self.proc.stderr.readline, b""):
            self.err.append(line.decode(errors="replace"))

    def peek_stderr(self):
        """What the script has written on stderr so far."""
        return "".join(self.err)

    def expect(self, name, secs=20.0):
        """Waits for the script's `NAME pid start` line; returns (pid, start) and has the
        process ended at the end of the test."""
        while name not in self.seen:
            line = self.proc.stdout.readline().decode()
            if not line:
                self.proc.wait(timeout=secs)
                self._reader.join(timeout=secs)
                raise AssertionError("the script ended before printing %s:\n%s" % (
                    name, self.peek_stderr()))
            self.lines.append(line)
            words = line.split()
            if len(words) == 3 and words[1].isdigit() and words[2].isdigit():
                self.seen[words[0]] = (int(words[1]), int(words[2]))
                if int(words[2]) > 0:  # a process (start ticks), not a plain figure
                    self.world.track(*self.seen[words[0]])
        return self.seen[name]

    def finish(self, secs=60.0):
        """Waits for the script to end; returns (exit code, stdout, stderr)."""
        # The scripts print a few lines (far below a pipe's buffer): wait, then read what it
        # wrote without waiting for an end of file that a child still holding the pipe
        # would delay.
        try:
            self.proc.wait(timeout=secs)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._reader.join(timeout=5)
            raise AssertionError("the script still ran after %g s; its stderr:\n%s" % (
                secs, self.peek_stderr()))
        os.set_blocking(self.proc.stdout.fileno(), False)
        out = self.proc.stdout.read() or b""
        self._reader.join(timeout=secs)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return self.proc.returncode, "".join(self.lines) + out.decode(), self.peek_stderr()


def report(name, pid):
    """In a script under test: prints `NAME pid start` for the test to read."""
    print(name, pid, stat_of(pid)[1], flush=True)


def hold(gib=1, ignore_term=False):
    """In a script under test: a GPU-holding child of the script, reported as HOLDER."""
    child, _ = start_holder(os.environ["VRAMGUARD_SIM"], gib, ignore_term)
    report("HOLDER", child.pid)
    return child


#: The first lines of every guarded script: the module's log on stderr.
PREAMBLE = """\
import logging, os, signal, subprocess, sys, threading, time
import vramguard
from support import hold, report, wait_until
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
"""
