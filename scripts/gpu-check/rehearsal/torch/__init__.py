"""A stand-in for PyTorch on vramguard's simulated driver, so that scripts/gpu-check.sh can be
rehearsed without a GPU (scripts/gpu-check-rehearsal.sh). It has only what the gpu-check
helpers use, and each piece does what the real one does to the driver:

- the first CUDA call of a process creates its context: it maps a stand-in `libcuda.so.1`,
  opens the control, unified-memory and GPU device files (the simulator's stand-ins, under the state's `dev_dir`), and asks
  `vramguard sim attach` to create the context on its own descriptor of the GPU file, with
  512 MiB of context overhead; the context then lives while that open file description does,
  in children forked afterwards too, as a real context does;
- an allocation adds its bytes to the context; more than the GPU has free raises
  `torch.OutOfMemoryError` with the real message's wording;
- a matmul marks the context as computing (90 % SM) and spends CPU as a real loop's
  synchronisation does;
- `torch.multiprocessing` is the standard library's multiprocessing.

The GPU is the first entry of CUDA_VISIBLE_DEVICES (an NVML index), else 0. The state is
VRAMGUARD_SIM, the binary VRAMGUARD_BINARY (else `vramguard` on PATH).
"""

import json
import mmap
import os
import subprocess
import time

from . import cuda  # noqa: F401 - torch.cuda
from . import multiprocessing  # noqa: F401 - torch.multiprocessing

__version__ = "0.0+vramguard.sim"

CONTEXT_BYTES = 512 << 20
MIB = 1 << 20
GIB = 1 << 30


class version:  # noqa: N801 - torch.version
    cuda = "sim"


class dtype:  # noqa: N801 - torch.dtype
    def __init__(self, name, itemsize):
        self.name = name
        self.itemsize = itemsize

    def __repr__(self):
        return "torch." + self.name


uint8 = dtype("uint8", 1)
bfloat16 = dtype("bfloat16", 2)
float16 = dtype("float16", 2)
float32 = dtype("float32", 4)


class OutOfMemoryError(RuntimeError):
    """torch.OutOfMemoryError (also torch.cuda.OutOfMemoryError)."""


cuda.OutOfMemoryError = OutOfMemoryError


def _binary():
    return os.environ.get("VRAMGUARD_BINARY") or "vramguard"


def _state():
    state = os.environ.get("VRAMGUARD_SIM")
    if not state:
        raise RuntimeError("stand-in torch: VRAMGUARD_SIM names no simulated driver state")
    return state


def _gpu():
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


_context = {}  # pid -> (gpu, [fds]): a forked child never uses its parent's context
_libraries = []  # the stand-in libcuda.so.1, mapped for the process's life


def _show():
    out = subprocess.run([_binary(), "--sim", _state(), "sim", "show"], check=True,
                         capture_output=True, timeout=30).stdout
    return json.loads(out)["gpus"][_gpu()]


def _attach(nbytes, sm_util=None):
    gpu, fds = _ensure_context()
    _call_attach(gpu, fds[-1], nbytes, sm_util)


def _call_attach(gpu, fd, nbytes, sm_util=None):
    argv = [_binary(), "--sim", _state(), "sim", "attach", "--gpu", str(gpu),
            "--bytes", str(int(nbytes)), "--fd", str(fd)]
    if sm_util is not None:
        argv += ["--sm-util", str(sm_util)]
    done = subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True, timeout=30)
    if done.returncode == 3:
        g = _show()
        raise OutOfMemoryError(
            "CUDA out of memory. Tried to allocate %.2f GiB. GPU 0 has a total capacity of "
            "%.2f GiB of which %.2f GiB is free. Process %d has %.2f GiB memory in use. "
            "(stand-in torch on the simulated driver)"
            % (nbytes / GIB, g["total"] / GIB, g["free"] / GIB, os.getpid(),
               _own_bytes(g) / GIB))
    if done.returncode != 0:
        raise RuntimeError("stand-in torch: %s" % done.stderr.strip())


def _own_bytes(g):
    return sum(p.get("used_bytes") or 0 for p in g.get("processes", [])
               if p.get("pid") == os.getpid())


def _ensure_context():
    pid = os.getpid()
    if pid not in _context:
        gpu = _gpu()
        with open(_state()) as f:
            dev_dir = json.load(f)["dev_dir"]
        # A real first CUDA call loads the CUDA driver library, which stays mapped (children
        # forked later inherit the mapping): map the simulator's stand-in (`sim attach`
        # creates it if missing) once the context exists.
        fds = [os.open(os.path.join(dev_dir, name), os.O_RDONLY | os.O_CLOEXEC)
               for name in ("nvidiactl", "nvidia-uvm", "nvidia%d" % gpu)]
        try:
            _call_attach(gpu, fds[-1], CONTEXT_BYTES)
            with open(os.path.join(dev_dir, ".driver", "libcuda.so.1"), "rb") as lib:
                _libraries.append(mmap.mmap(lib.fileno(), 0, prot=mmap.PROT_READ))
        except BaseException:
            for fd in fds:  # no context: nothing of it stays open
                os.close(fd)
            raise
        _context[pid] = (gpu, fds)
    return _context[pid]


class Tensor:
    def __init__(self, numel, dt, device):
        self.numel = int(numel)
        self.dtype = dt or float32
        self.device = device
        if device is not None and str(device).startswith("cuda"):
            _attach(self.numel * self.dtype.itemsize)

    def fill_(self, value):  # noqa: ARG002 - the bytes are the driver's, not ours
        return self

    def __matmul__(self, other):
        _busy()
        return self


_computing = set()


def _busy():
    """A kernel: the context computes from now on, and the CPU waits for it as a
    synchronising loop does (about 5 ms of CPU per product)."""
    pid = os.getpid()
    if pid not in _computing:
        _attach(0, sm_util=90)
        _computing.add(pid)
    end = time.monotonic() + 0.005
    while time.monotonic() < end:
        pass


def empty(*size, dtype=None, device=None):
    numel = 1
    for s in size:
        numel *= int(s)
    return Tensor(numel, dtype, device)


def randn(*size, dtype=None, device=None):
    return empty(*size, dtype=dtype, device=device)
