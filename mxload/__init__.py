"""mxload: a fast, reliable multi-process data loader with a compiled core.

Public names only; everything else lives in private modules."""
from . import batchify, sampler
from ._info import show_config
from ._rng import sample_rng
from ._version import __version__
from ._worker import WorkerInfo, get_worker_info
from .dataloader import DataLoader
from .dataset import ArrayDataset, Dataset, IterableDataset, SimpleDataset
from .errors import LoaderTimeoutError, SharedMemoryError, WorkerError
from .profiler import Profiler, Report, profile

__all__ = [
    "__version__", "DataLoader", "Dataset", "ArrayDataset", "SimpleDataset", "IterableDataset",
    "WorkerError", "LoaderTimeoutError", "SharedMemoryError", "WorkerInfo", "get_worker_info",
    "batchify", "sampler", "show_config", "Profiler", "Report", "profile", "sample_rng",
]
