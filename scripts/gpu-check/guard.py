"""vramguard.guard() with real PyTorch: `python3 guard.py PYTHON_MODULE_DIR [GIB]`.

The script takes 1 GiB of its own, then, under `vramguard.guard(grace=3)`, forks a worker
after CUDA is initialised (as a DataLoader worker is: it inherits the device files and holds
no context of its own) and starts one with torch.multiprocessing's spawn (its own context,
GIB GiB, 1 by default). It prints `ready SCRIPT FORKED SPAWNED`, leaves the block, and prints
the guard's log (the "vramguard" logger, on stdout), how long the guard took, whether each
worker is gone (`gone: PID yes|no`) and CUDA's free memory before and after.
"""

import logging
import os
import sys
import time

import common


def spawned(gib, queue):
    import torch

    held = common.fill_gib(torch, gib)  # noqa: F841 - held until the process ends
    queue.put(os.getpid())
    common.idle(90)


def gone(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def main():
    sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "packaging/python/src")
    gib = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    import torch
    import torch.multiprocessing as mp

    import vramguard

    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.cuda.init()
    own = common.fill_gib(torch, 1)  # noqa: F841 - the script's own memory: never touched
    with vramguard.guard(grace=3):
        forked = os.fork()
        if forked == 0:
            common.idle(90)
        context = mp.get_context("spawn")
        queue = context.Queue()
        worker = context.Process(target=spawned, args=(gib, queue))
        worker.start()
        spawned_pid = queue.get(timeout=60)
        common.ready(os.getpid(), forked, spawned_pid)
        print("cuda free before: %d of %d bytes" % torch.cuda.mem_get_info(), flush=True)
        began = time.monotonic()
    print("guard took %.0f ms" % ((time.monotonic() - began) * 1000), flush=True)
    for pid in (forked, spawned_pid):
        print("gone: %d %s" % (pid, "yes" if gone(pid) else "no"), flush=True)
    print("cuda free after: %d of %d bytes" % torch.cuda.mem_get_info(), flush=True)
    worker.join(timeout=5)
    os.waitpid(forked, os.WNOHANG)


if __name__ == "__main__":
    main()
