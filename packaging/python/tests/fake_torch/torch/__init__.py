"""A stand-in for PyTorch in the module's tests: only what vramguard looks at (the name of
CUDA's out-of-memory exception). No real PyTorch is installed or needed here."""

from . import cuda  # noqa: F401
