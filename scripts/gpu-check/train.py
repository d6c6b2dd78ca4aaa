"""A trainer with DataLoader-style workers: `python3 train.py GIB WORKERS [LIFETIME_S]`.

Allocates GIB GiB with torch on the current CUDA device and fills it, then `os.fork()`s
WORKERS idle workers that never touch CUDA (they only inherit the device files, as
DataLoader workers forked after CUDA init do), prints `ready TRAINER WORKER...` and idles.
The check SIGKILLs the trainer; the workers keep the context alive until they exit (at most
LIFETIME_S seconds, default 90) or are reclaimed.
"""

import os
import sys

import common


def main():
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    lifetime = float(sys.argv[3]) if len(sys.argv) > 3 else 90.0
    import torch

    common.wait_go()
    held = common.fill_gib(torch, gib)
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            # A worker: never touches CUDA (it could not: CUDA does not survive fork()).
            common.idle(lifetime)
        pids.append(pid)
    common.ready(os.getpid(), *pids)
    common.idle(lifetime)  # `held` stays allocated until the process dies


if __name__ == "__main__":
    main()
