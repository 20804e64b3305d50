"""mxload: a fast, reliable multi-process data loader with a compiled core.

Public names only; everything else lives in private modules."""
try:
    from . import _core  # noqa: F401  (first: every module below needs it)
except ImportError as _error:
    from ._missing_core import explain_missing_core

    raise ImportError(explain_missing_core(_error)) from None  # the original misleads (see _missing_core)

import importlib as _importlib

from . import batchify, sampler
from ._info import show_config
from ._rng import sample_rng
from ._runtime.worker import WorkerInfo, get_worker_info
from ._version import __version__
from .backends import RayBackend
from .dataloader import DataLoader
from .dataset import ArrayDataset, Dataset, IterableDataset, SimpleDataset
from .errors import EpochAbortedError, LoaderTimeoutError, SharedMemoryError, WorkerError
from .profiler import Profiler, Report, profile

# numpy.random now, a Ctrl-C meanwhile held back and raised once it is imported: numpy 2 imports
# it at its first use, and its Cython modules' initialization drops any exception raised while it
# registers their memoryview types (NOTE [ No memoryviews in the core ], csrc/_core.pyx).  The
# first DataLoader() (its fresh seed) imported it inside the training loop, where a Ctrl-C landing
# there was lost.
_core.defer_sigint(_importlib.import_module)("numpy.random")

__all__ = [
    "__version__", "DataLoader", "Dataset", "ArrayDataset", "SimpleDataset", "IterableDataset",
    "WorkerError", "LoaderTimeoutError", "SharedMemoryError", "EpochAbortedError", "WorkerInfo",
    "get_worker_info",
    "batchify", "sampler", "show_config", "Profiler", "Report", "profile", "sample_rng", "RayBackend",
]
