"""The torch-facing DataLoader: ``from mxload.torch import DataLoader`` in
place of ``from torch.utils.data import DataLoader`` and nothing else changes:
it is a ``torch.utils.data.DataLoader`` (a subclass), its attributes are
torch's (its samplers torch's own classes, made as torch makes them, so the
shuffle order is torch's), and its batches are torch tensors, as torch's
DataLoader gives them.

The tensors share the memory of mxload's batches (``torch.from_numpy``, no
copy: the shared-memory slab stays alive as long as a tensor does).
``mxload.DataLoader`` itself hands out numpy arrays and never imports torch;
this module is for programs that use torch anyway, and imports it.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any, TypeVar

from ._options import LoaderOptions
from .dataloader import DataLoader as _NumpyDataLoader
from .dataloader import _make_samplers
from .errors import UnpicklablePayloadError

torch: Any = importlib.import_module("torch")   # fail here, clearly, if torch is missing
_data: Any = importlib.import_module("torch.utils.data")
_torch_loader: Any = importlib.import_module("torch.utils.data.dataloader")

__all__ = ["DataLoader"]

_T_co = TypeVar("_T_co", covariant=True)

# Word for word what torch 2.x warns when a worker Process's arguments cannot be pickled
# (before it raises the error): programs and tests match it.
PICKLE_ERROR_WARNING = (
    "Got pickle error when attempting to start a worker Process. This might be because the worker "
    "Process arguments are not picklable. Python 3.14+ changed the multiprocessing start method in "
    "non-Mac POSIX platforms to 'forkserver', which requires the worker Process arguments to be "
    "picklable. You can also try multiprocessing.set_start_method('fork').")

# The attributes torch's DataLoader.__init__ stores, read as torch holds them (see _torch_view).
_TORCH_AS_GIVEN = ("pin_memory", "pin_memory_device", "timeout", "worker_init_fn", "in_order", "generator",
                   "persistent_workers")
# mxload's own arguments (a rebuild from vars() passes them back as given; read as resolved).
_MXLOAD_ONLY = ("last_batch", "batchify_fn", "pin_device_id", "prefetch", "thread_pool", "auto_reload",
                "seed", "start_method", "max_worker_restarts", "profile", "distributed", "try_nopython",
                "backend", "seeding")


def _torch_samplers(options: LoaderOptions) -> tuple[Any, Any]:
    """(sampler, batch_sampler) as torch's DataLoader.__init__ makes them: torch's
    RandomSampler(dataset, generator=generator) or SequentialSampler(dataset) unless given, a
    BatchSampler over it with automatic batching, an infinite constant sampler for a stream.
    mxload's own (worker-count-independent, checkpointed by seed) where mxload's options ask for
    them: seed= (mxload's determinism, opted into), distributed=True, or last_batch="rollover"
    (torch's BatchSampler cannot carry a batch into the next epoch)."""
    batching = options.batching
    if options.derived.iterable or batching.batch_sampler is not None:
        pass
    elif batching.last_batch == "rollover" or (batching.sampler is None and (
            not options.derived.torch_seeded or batching.distributed)):
        if batching.shuffle and batching.sampler is None:
            _data.RandomSampler(options.dataset)   # torch's check: it refuses an empty dataset
        return _make_samplers(options)
    sampler = batching.sampler
    if sampler is None:
        if options.derived.iterable:
            sampler = _torch_loader._InfiniteConstantSampler()
        elif batching.shuffle:
            sampler = _data.RandomSampler(options.dataset, generator=options.seeds.generator)
        else:
            sampler = _data.SequentialSampler(options.dataset)
    batch_sampler = batching.batch_sampler
    if batching.batch_size is not None and batch_sampler is None:
        batch_sampler = _data.BatchSampler(sampler, batching.batch_size, batching.drop_last)
    return sampler, batch_sampler


class DataLoader(_NumpyDataLoader[_T_co], _data.DataLoader[_T_co]):  # type: ignore[misc]
    """:class:`mxload.DataLoader` as a ``torch.utils.data.DataLoader``: the same arguments, torch's
    types out (batches are zero-copy tensor views of its numpy batches), torch's samplers and
    attributes.

    It is a subclass of torch's DataLoader whose ``__init__`` is mxload's (torch's worker machinery
    never runs): ``isinstance(loader, torch.utils.data.DataLoader)`` holds, and code that reads a
    loader's attributes (``dataset``, ``batch_size``, ``sampler``, ``batch_sampler``,
    ``collate_fn``, ``num_workers``, ``generator``, ``drop_last``, ``timeout``, ...) reads what
    torch's loader would hold.  Code that rebuilds a loader from ``vars(loader)`` and its
    ``__init__`` signature (Lightning, accelerate) gets an mxload loader back, mxload's own
    arguments (``thread_pool``, ``max_worker_restarts``, ...) included, as given.

    Args:
        *args: :class:`mxload.DataLoader`'s positional arguments.
        **kwargs: its keyword arguments (all of torch's DataLoader's).

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from mxload.torch import DataLoader
        >>> x, y = next(iter(DataLoader(TensorDataset(torch.zeros(4, 2), torch.arange(4)), batch_size=4)))
        >>> type(x).__name__, x.shape, y.tolist()
        ('Tensor', torch.Size([4, 2]), [0, 1, 2, 3])
    """

    _as_tensors = True
    _torch_switches = True
    # Workers seeded as torch's: the same batches as torch's DataLoader for the same num_workers.
    _seeding = "torch"
    _torch_view = True
    _make_samplers = staticmethod(_torch_samplers)

    def _attribute_views(self, given: dict[str, Any]) -> dict[str, Any]:
        """torch's attributes as torch's DataLoader.__init__ stores them in the instance dict
        (read from there: see mxload.dataloader._Option), and mxload's own arguments as given."""
        options = self._options
        context = given["multiprocessing_context"]
        if isinstance(context, str):
            context = torch.multiprocessing.get_context(context)
        kind = _torch_loader._DatasetKind
        collate = options.torch.collate_fn
        if given["collate_fn"] is None and given["batchify_fn"] is None:   # torch's, collated natively
            collate = _data.default_collate if self.batch_sampler is not None else _data.default_convert
        view = {name: given[name] for name in _TORCH_AS_GIVEN + _MXLOAD_ONLY}
        view.update(
            dataset=options.dataset, num_workers=options.workers.num_workers,
            prefetch_factor=options.torch.prefetch_factor, multiprocessing_context=context,
            batch_size=options.batching.batch_size, drop_last=options.batching.drop_last, collate_fn=collate,
            _dataset_kind=kind.Iterable if options.derived.iterable else kind.Map, _iterator=None)
        return view

    def _start_iter(self) -> Any:
        try:
            return super()._start_iter()
        except UnpicklablePayloadError:
            warnings.warn(PICKLE_ERROR_WARNING, stacklevel=3)   # the caller of iter()
            raise
