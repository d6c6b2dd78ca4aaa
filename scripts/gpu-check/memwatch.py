"""Watch a GPU's used memory until it falls to a level: `python3 memwatch.py GPU BELOW_MIB
[TIMEOUT_S] [CSV]`. Reads NVML through pynvml (nvidia-ml-py) every ~2 ms when it can, else
`nvidia-smi --query-gpu=memory.used` (~25 ms a reading). Prints `ready PID`, then
`back after S s` (from the ready line) or `not back after S s`; CSV gets every reading."""

import os
import subprocess
import sys
import time

import common


def reader(gpu):
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        return "pynvml", lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used // (1 << 20)
    except Exception:  # noqa: BLE001 - fall back to nvidia-smi
        argv = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                "-i", str(gpu)]
        return "nvidia-smi", lambda: int(subprocess.check_output(argv, timeout=10).split()[0])


def main():
    gpu = int(sys.argv[1])
    below = int(sys.argv[2])
    timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
    csv = open(sys.argv[4], "w") if len(sys.argv) > 4 else None
    how, used = reader(gpu)
    first = used()
    print("reading with %s; used %d MiB, waiting for <= %d MiB" % (how, first, below), flush=True)
    common.ready(os.getpid())
    t0 = time.monotonic()
    wall0 = time.time()
    while True:
        t = time.monotonic() - t0
        u = used()
        if csv:
            csv.write("%.4f,%d\n" % (t, u))
        if u <= below:
            print("back after %.3f s (used %d MiB; started %.3f)" % (t, u, wall0), flush=True)
            return 0
        if t > timeout:
            print("not back after %.3f s (used %d MiB)" % (t, u), flush=True)
            return 1
        time.sleep(0.002 if how == "pynvml" else 0.0)


if __name__ == "__main__":
    sys.exit(main())
