"""The CPU and RSS of a full-screen program (`vramguard top`, `nvitop`) in a 200x50
pseudo-terminal, as a user watching it pays: its output is read and thrown away for SECS
seconds; the CPU is measured over the last SECS - 2 (the first two are its start).

Usage: ptycost.py SECS LABEL -- ARGV...
Prints one line: `LABEL cpu_ms_per_s X rss_kib Y hwm_kib Z window_s W pid P`, or
`LABEL failed: WHY` (exit 1). The program (pid P) is ended with SIGTERM, then SIGKILL, and
reaped, whatever happens.
"""
import fcntl
import os
import pty
import select
import signal
import struct
import sys
import termios
import time

ROWS, COLS = 50, 200


def cpu_ns(pid):
    """CPU time of the whole process in ns, its exited threads included: the process CPU
    clock (the clock ticks of /proc/PID/stat are 10 ms steps, a fifth of what `top` spends in
    the whole window); every live thread's schedstat, then utime + stime, where that clock
    cannot be read."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)
    except OSError:
        pass
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    except OSError:
        pass
    if total > 0:
        return total
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 10**9 // os.sysconf("SC_CLK_TCK")


def status_kib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def drain(fd, until):
    """Reads and discards the terminal's output until the monotonic time `until`."""
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return True
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            try:
                if not os.read(fd, 65536):
                    return False
            except OSError:
                return False  # the program exited: EIO on the master


def main():
    if len(sys.argv) < 5 or sys.argv[3] != "--":
        sys.exit("usage: ptycost.py SECS LABEL -- ARGV...")
    secs, label, argv = float(sys.argv[1]), sys.argv[2], sys.argv[4:]
    if secs <= 3:
        sys.exit("SECS must be above 3")
    pid, fd = pty.fork()
    if pid == 0:
        os.environ["TERM"] = "xterm-256color"
        os.environ["COLUMNS"], os.environ["LINES"] = str(COLS), str(ROWS)
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
    try:
        start = time.monotonic()
        alive = drain(fd, start + 2)
        if alive:
            t0, w0 = cpu_ns(pid), time.monotonic()
            alive = drain(fd, start + secs)
        if not alive:
            print(f"{label} failed: {argv[0]} exited within {time.monotonic() - start:.1f} s")
            return 1
        t1, w1 = cpu_ns(pid), time.monotonic()
        rss, hwm = status_kib(pid, "VmRSS"), status_kib(pid, "VmHWM")
        cpu_ms_per_s = (t1 - t0) / 1e6 / (w1 - w0)
        print(
            f"{label} cpu_ms_per_s {cpu_ms_per_s:.2f} rss_kib {rss} hwm_kib {hwm} "
            f"window_s {w1 - w0:.1f} pid {pid}"
        )
        return 0
    finally:
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
                time.sleep(0.05)
            else:
                continue
            break
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
