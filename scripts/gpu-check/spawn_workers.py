"""A launcher of spawned workers: `python3 spawn_workers.py GIB_EACH WORKERS [LIFETIME_S]`.

Starts WORKERS processes with torch.multiprocessing's `spawn` start method; each allocates
and fills GIB_EACH GiB, reports, then idles. The launcher never touches CUDA. It prints
`ready LAUNCHER WORKER... [TRACKER]` (TRACKER: multiprocessing's resource tracker, when one
runs) and idles until it is SIGKILLed. Everything exits after LIFETIME_S (default 90).
"""

import os
import sys
import time

import common


def worker(gib, lifetime, started):
    import torch

    held = common.fill_gib(torch, gib)
    started.put(os.getpid())
    time.sleep(lifetime)
    del held
    os._exit(0)


def main():
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    lifetime = float(sys.argv[3]) if len(sys.argv) > 3 else 90.0
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    started = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(gib, lifetime, started)) for _ in range(count)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 60
    for _ in procs:
        started.get(timeout=max(1.0, deadline - time.monotonic()))
    extra = []
    try:
        from multiprocessing import resource_tracker

        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        if tracker:
            extra.append(tracker)
    except Exception:  # noqa: BLE001 - only a pid to clean up later
        pass
    common.ready(os.getpid(), *[p.pid for p in procs], *extra)
    time.sleep(lifetime)
    os._exit(0)


if __name__ == "__main__":
    main()
