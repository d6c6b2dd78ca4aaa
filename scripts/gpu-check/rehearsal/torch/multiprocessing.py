"""torch.multiprocessing of the stand-in PyTorch: the standard library's."""

from multiprocessing import *  # noqa: F401,F403
from multiprocessing import get_context  # noqa: F401
