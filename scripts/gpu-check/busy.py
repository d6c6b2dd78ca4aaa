"""A working job: `python3 busy.py [LIFETIME_S] [N]` runs a bf16 N x N matmul loop on the GPU
until LIFETIME_S (default 60) have passed, printing `ready PID` after the first products."""

import os
import sys
import time

import common


def main():
    lifetime = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    import torch

    deadline = time.monotonic() + lifetime
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    reserve = common.fill_gib(torch, 4)  # a job's working set, a few GiB like the fixture's
    c = a @ b
    torch.cuda.synchronize()
    common.ready(os.getpid())
    while time.monotonic() < deadline:
        for _ in range(20):
            c = a @ b
        torch.cuda.synchronize()
    del c, reserve
    os._exit(0)


if __name__ == "__main__":
    main()
