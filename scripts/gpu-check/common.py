"""Shared by the gpu-check helpers: bounded waits and the `ready` line.

Every helper prints one line `ready PID [PID...]` on stdout (flushed) once it holds what it
was asked to hold, so that scripts/gpu-check.sh knows every pid it has to kill at the end.
Every helper also bounds its own life (a deadline), so nothing outlives the check by long
even where `timeout` cannot be put in front of it without changing the process tree.
"""

import os
import sys
import time

GIB = 1 << 30


def ready(*pids):
    sys.stdout.write("ready %s\n" % " ".join(str(p) for p in pids))
    sys.stdout.flush()


def wait_go(limit=150.0):
    """If GPU_CHECK_GO names a file, wait (at most `limit` seconds) until it exists: lets the
    script pay for `import torch` before the moment it wants the CUDA work to start."""
    path = os.environ.get("GPU_CHECK_GO")
    if not path:
        return
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit("gpu-check: %s never appeared" % path)
        time.sleep(0.02)


def idle(seconds):
    """Sleep up to `seconds` (no CPU, no GPU work), then exit without cleanup handlers."""
    time.sleep(max(0.0, seconds))
    os._exit(0)


def fill_gib(torch, gib, device="cuda"):
    """Allocate `gib` GiB on the GPU with torch and write every byte (as a trainer's tensors)."""
    x = torch.empty(int(gib * GIB), dtype=torch.uint8, device=device)
    x.fill_(1)
    torch.cuda.synchronize()
    return x
