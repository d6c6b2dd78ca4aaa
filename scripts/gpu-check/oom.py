"""A real torch.OutOfMemoryError with vramguard.explain_oom():
`python3 oom.py PYTHON_MODULE_DIR`.

Imports the vramguard Python module from the repository (packaging/python/src: one pure-Python
file; it runs the binary named by VRAMGUARD_BINARY), installs the OOM hook, then asks for more
than the GPU has free, uncaught, so that the hook prints its explanation under the traceback
on stderr. Prints `ready PID` first and `explain: ...` (the same text, from
`vramguard.explain(error)`) on stdout for the record.
"""

import os
import sys
import time

import common


def main():
    sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "packaging/python/src")
    import torch

    import vramguard

    print("module: %s (binary %s)" % (vramguard.__file__, vramguard.binary()), flush=True)
    common.wait_go()
    torch.cuda.init()
    common.ready(os.getpid())
    vramguard.explain_oom()
    free, total = torch.cuda.mem_get_info()
    print("cuda free %d of %d bytes; asking for %d" % (free, total, free + common.GIB), flush=True)
    t0 = time.monotonic()
    try:
        torch.empty(free + common.GIB, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as e:
        print("oom: %s" % str(e).splitlines()[0], flush=True)
        t1 = time.monotonic()
        print("explain: %s" % vramguard.explain(e), flush=True)
        print("explain took %.0f ms" % ((time.monotonic() - t1) * 1000), flush=True)
        # Raise it again, uncaught: the hook explain_oom() installed prints under the traceback.
        print("raising after %.0f ms" % ((time.monotonic() - t0) * 1000), flush=True)
        raise
    print("no OutOfMemoryError: the allocation succeeded", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main()
