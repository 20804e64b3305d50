"""DataLoader: turns its arguments into LoaderOptions (``_options``, where
every check lives), builds the batch sampler, and starts each epoch on the
runtime (``_runtime/epoch.py``: in-process, or on the multi-worker engine)."""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any, Generic, Self, TypeVar, cast, overload

from ._checkpoint import LoaderPosition
from ._checks import suggesting_keywords
from ._collate.plan import collates_itself
from ._core import HandingIterator, defer_sigint, handing_next, sigint_safe_finalizer
from ._cpus import warn_if_oversubscribed
from ._iterations import Iterations
from ._options import LoaderOptions
from ._runtime.engine import merge_counters
from ._runtime.epoch import EpochRequest, start_epoch
from ._seeding import RunSeed
from ._torch_compat import pin_batch, pinning_for_loader, to_tensors
from .sampler import (
    BatchSampler,
    DistributedSampler,
    EpochBatches,
    RandomSampler,
    SequentialSampler,
    epoch_batches,
    epoch_keys,
)

__all__ = ["DataLoader", "WorkerProcess"]

# torch raises ValueError when these are set on a constructed DataLoader: the
# epoch machinery was built from them.
_FROZEN_ATTRIBUTES = frozenset(("batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                                "persistent_workers"))
_INITIALIZED = "_DataLoader__initialized"

_T = TypeVar("_T")
# What a batch is (torch's DataLoader is Generic[T_co]: ``DataLoader[list[Tensor]]``
# in an annotation is evaluated at run time in a module without postponed annotations).
_T_co = TypeVar("_T_co", covariant=True)


class _Option(Generic[_T]):
    # A DataLoader attribute that is one of its LoaderOptions.  Setting one
    # (torch allows it for all but the frozen attributes) replaces
    # loader._options, so the next epoch runs with the new value; the value is
    # not checked again, as torch does not check it either.  `torch`: one of
    # torch's DataLoader attributes: mxload.torch.DataLoader keeps torch's view
    # of it in the instance dict (as torch's loader holds it: what code that
    # rebuilds a loader from vars() reads), and reads it from there.  No
    # docstring: an instance would show it as every option attribute's documentation.

    def __init__(self, field: str | None = None, torch: bool = False):
        self._field = field or ""
        self._name = ""
        self._torch = torch

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self._field = self._field or name
        self._name = name

    @overload
    def __get__(self, loader: None, owner: type[Any]) -> _Option[_T]: ...
    @overload
    def __get__(self, loader: _Settings, owner: type[Any]) -> _T: ...

    def __get__(self, loader: _Settings | None, owner: type[Any]) -> _T | _Option[_T]:
        if loader is None:
            return self
        if self._torch and loader._torch_view:
            return cast(_T, loader.__dict__[self._name])
        return cast(_T, loader._options.value(self._field))

    def __set__(self, loader: _Settings, value: _T) -> None:
        loader._options = loader._options.changed(self._field, value)
        if self._name in loader.__dict__:
            loader.__dict__[self._name] = value


def _make_samplers(options: LoaderOptions) -> tuple[Any, Any]:
    """(sampler, batch_sampler) of mxload's own making: the user's, or a batch
    sampler over the user's sampler, or over a sequential/random/distributed
    one; (None, None) for a stream (it batches itself)."""
    batching = options.batching
    if batching.batch_sampler is not None or options.derived.iterable:
        return getattr(batching.batch_sampler, "sampler", None), batching.batch_sampler
    sampler = batching.sampler
    n = len(options.dataset) if sampler is None else 0
    if sampler is None and batching.distributed:
        # Every rank must draw the same order, so never a fresh seed here.
        sampler = DistributedSampler(n, shuffle=batching.shuffle, seed=options.seeds.distributed_seed,
                                     drop_last=batching.drop_last)
    elif sampler is None:
        sampler = RandomSampler(n, seed=options.seeds.seed) if batching.shuffle else SequentialSampler(n)
    return sampler, BatchSampler(sampler, batching.batch_size or 1, batching.last_batch)


class _Settings:
    """A DataLoader's settings as attributes, each read from (and set into)
    its LoaderOptions, ``self._options`` (see _Option)."""

    _options: LoaderOptions
    _iterations: Iterations
    sampler: Any
    batch_sampler: Any
    # Whether torch's attributes read torch's view of them (mxload.torch.DataLoader, see _Option).
    _torch_view = False
    dataset = _Option[Any](torch=True)
    batch_size = _Option[int | None](torch=True)
    last_batch = _Option[str]()
    batchify_fn = _Option[Callable[..., Any]]()
    collate_fn = _Option[Callable[..., Any]](torch=True)
    num_workers = _Option[int](torch=True)
    prefetch = _Option[int]()
    prefetch_factor = _Option[int | None](torch=True)
    thread_pool = _Option[bool]()
    timeout = _Option[float | None](torch=True)
    worker_init_fn = _Option[Callable[[int], None] | None](torch=True)
    persistent_workers = _Option[bool](torch=True)
    in_order = _Option[bool](torch=True)
    start_method = _Option[str | None]()
    max_worker_restarts = _Option[int]()
    profile = _Option[bool]()
    generator = _Option[Any](torch=True)
    multiprocessing_context = _Option[str | BaseContext | None](torch=True)
    pin_memory = _Option[bool](torch=True)
    pin_memory_device = _Option[str](torch=True)
    pin_device_id = _Option[int]()
    auto_reload = _Option[bool]()
    try_nopython = _Option[bool | None]()
    iterable = _Option[bool]()
    seeding = _Option[str]()   # how worker processes seed the global RNGs (_options.SEEDINGS)
    _fetch_batch_size = _Option[int]("fetch_batch_size")

    @property
    def autotune(self) -> dict[str, Any] | None:
        """With ``num_workers="auto"``: the workers and window in use, the latest epoch's choice
        (measured load, step, cores, the predicted ms per batch of each count, why) and each
        adjustment (epoch, batches taken, workers before, after, why); else None."""
        tuner = self._iterations.tuner
        return tuner.report() if tuner is not None else None

    @property
    def drop_last(self) -> bool:
        """torch's name: whether an incomplete last batch is dropped."""
        return self._options.batching.drop_last

    def _check_worker_count(self, stacklevel: int) -> None:
        """torch's check: more worker processes than usable cores warns (at
        construction and when an iteration starts workers, as torch's)."""
        if self.num_workers and not self.thread_pool and self._options.workers.backend is None:
            warn_if_oversubscribed(self.num_workers, stacklevel)

    @property
    def _index_sampler(self) -> Any:
        """torch's: what draws the epoch's keys: the batch sampler, else (no automatic batching
        in mxload.torch) the sampler; None for a stream of mxload's own."""
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    def __setattr__(self, name: str, value: Any) -> None:
        # torch's flag (its name mangled in torch's DataLoader class), which code working around
        # the freeze sets (timm's MultiEpochsDataLoader replaces batch_sampler between False and True).
        if name in _FROZEN_ATTRIBUTES and self.__dict__.get(_INITIALIZED):
            raise ValueError(f"{name} attribute should not be set after {type(self).__name__} is "
                             f"initialized (build a new DataLoader instead)")
        super().__setattr__(name, value)


class _Lifetime(_Settings):
    """What a loader is asked besides its epochs: its position (state_dict, load_state_dict),
    its counters (stats), and its end (close, ``with``, its collection)."""

    _position: LoaderPosition
    epoch: int
    seed: int

    def state_dict(self) -> dict[str, Any]:
        """The loader's position, at any point of an epoch.

        Returns:
            dict: small and JSON-serialisable (seed, epoch, the sampler's state
            at the epoch's start, which batches were taken; no sample data).
            A fresh loader over the same dataset given it with
            :meth:`load_state_dict` yields exactly the batches not yet
            yielded, in the same order, with the same ``sample_rng()`` draws.

        Example:
            >>> import numpy as np, mxload
            >>> loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(6)), batch_size=2,
            ...                            shuffle=True, seed=1)
            >>> it = iter(loader); first = next(it)
            >>> state = loader.state_dict()
            >>> resumed = mxload.DataLoader(mxload.ArrayDataset(np.arange(6)), batch_size=2,
            ...                             shuffle=True, seed=1)
            >>> resumed.load_state_dict(state)
            >>> [b.tolist() for b in resumed] == [b.tolist() for b in it]
            True
        """
        return self._position.state(self, redrawn=self._iterations.ahead_is_stale(self._index_sampler,
                                                                                  self.iterable))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next ``iter()`` resumes that epoch.

        Args:
            state (dict): what :meth:`state_dict` returned (also after a JSON
                round trip).

        Raises:
            ValueError: `state` is not a loader state, or carries dataset state
                the dataset cannot load (no ``load_state_dict``).

        Example:
            >>> import numpy as np, mxload
            >>> loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(4)), batch_size=2)
            >>> loader.load_state_dict({**loader.state_dict()})
            >>> [b.tolist() for b in loader]
            [[0, 1], [2, 3]]
        """
        state = self._position.load(self, state)
        self.close()  # a live epoch or persistent workers belong to the old position
        self.seed = state["seed"]
        self.epoch = state["epoch"]
        self._position.resume_from(state)

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the latest worker engine (batches, slabs created/reused/
        retired; with worker processes, tasks sent and the messages that
        carried them, and the small batches copied out of their slabs because
        the loop kept many alive) and the loader's worker restarts, over all
        its epochs; empty before workers ran.

        Example:
            >>> import numpy as np, mxload
            >>> loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(8)), batch_size=4, num_workers=1)
            >>> _ = list(loader)
            >>> loader.stats["batches"]
            2
        """
        counters = self._iterations.counters
        return merge_counters(counters) if counters else {}

    @defer_sigint   # (and __del__: NOTE [ Deferred signals ])
    def close(self) -> None:
        """End every live iteration and any persistent workers; idempotent.
        ``with DataLoader(...) as loader:`` calls it on exit.

        Example:
            >>> import numpy as np, mxload
            >>> with mxload.DataLoader(mxload.ArrayDataset(np.arange(8)), batch_size=4, num_workers=1,
            ...                        persistent_workers=True) as loader:
            ...     for epoch in range(2):
            ...         _ = list(loader)
        """
        self._iterations.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _finalize(self) -> None:
        try:
            self._iterations.loader_collected()
        except Exception:
            pass
        self.__dict__.clear()   # as EpochIterator._finalize: freed while Ctrl-C is held back

    __del__ = sigint_safe_finalizer(_finalize)


class DataLoader(_Lifetime, Generic[_T_co]):
    """Loads batches from a dataset, in-process or with worker processes/threads.

    Positional arguments follow Gluon 1.9's DataLoader (its first four -- dataset, batch_size,
    shuffle, sampler -- are also torch's); every other argument of ``torch.utils.data.DataLoader``
    (2.x) is accepted by keyword with its torch meaning (docs/migration.md lists each one).
    Iterating the loader runs one epoch; each batch is a structure of numpy arrays (views of one
    shared-memory slab when workers made it; ``torch.from_numpy`` makes zero-copy tensors of them).

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``, and optionally
            ``__getitems__(indices)``, called once per batch) or an iterable one
            (:class:`IterableDataset`, torch's, or any object with ``__iter__`` and no ``__getitem__``).
        batch_size (int | None): samples per batch. Default ``1`` (torch's); ``None`` disables
            batching: each sample is one "batch", passed alone to `collate_fn` (default
            :data:`mxload.batchify.default_convert`).
        shuffle (bool | None): draw a new random order every epoch. Default ``None`` (no shuffle;
            a torch IterDataPipe's shufflers left as they are, as torch's DataLoader leaves them).
        sampler: an iterable of indices (a :mod:`mxload.sampler` sampler or a torch one; drawn as
            the batches need them, so an infinite one works); exclusive with `shuffle`.
        last_batch (str | None): ``"keep"`` (default), ``"discard"`` or ``"rollover"`` (carry the
            incomplete batch into the next epoch when this one is consumed to its end).
        batch_sampler: an iterable of index lists; exclusive with `batch_size`, `shuffle`, `sampler`
            and `last_batch`/`drop_last`. Each batch must be a 1-D sequence of integers: ``iter()``
            raises ValueError naming the first that is not.
        batchify_fn (callable | None): turns a list of samples into a batch; default
            :data:`mxload.batchify.default_batchify`.
        num_workers (int | str): worker processes (threads with `thread_pool`); ``0`` (default) loads
            in the calling thread; ``"auto"``: measured and adjusted while loading (``loader.autotune``),
            processes or, with `thread_pool`, threads.
        pin_memory (bool): hand out batches in page-locked memory (still numpy arrays) when torch
            has an accelerator; without one, warn once as torch does. Default ``False``.
        pin_device_id (int): Gluon's pinned-memory device; accepted (torch pins for its current
            accelerator). Default ``0``.
        prefetch (int | str | None): batches in flight across all workers; default (or ``"auto"``):
            ``2 * num_workers``, with ``num_workers="auto"`` two per worker taking tasks.
        thread_pool (bool): workers are threads, not processes. Default ``False``.
        timeout (float | None): seconds to wait for a batch before raising
            :class:`LoaderTimeoutError`; default ``120``; ``0`` or ``None`` waits forever.
        auto_reload (bool): Gluon's: start loading the next epoch as soon as one ends (and the
            first at construction). Default ``False``.
        collate_fn (callable | None): torch's name of `batchify_fn`.
        drop_last (bool | None): torch's; ``True`` is ``last_batch="discard"``.
        worker_init_fn (callable | None): called with the worker id in each worker, after seeding.
        multiprocessing_context (str | context | None): torch's; a start method name or a
            ``multiprocessing`` context object (same as `start_method`).
        generator (torch.Generator | None): seeds the shuffle and the worker seeds, as in torch
            (exclusive with `seed`).
        prefetch_factor (int | None): torch's batches in flight per worker
            (``prefetch = prefetch_factor * num_workers``).
        persistent_workers (bool): keep the workers between epochs (end them with :meth:`close` or
            ``with``). Default ``False``.
        pin_memory_device (str): torch's deprecated pinning device; ignored with torch's
            deprecation warning.
        in_order (bool): yield batches in sampler order (default ``True``); ``False`` yields them as
            they complete.
        seed (int | None): fixes the shuffle order, the workers' RNG seeds and
            :func:`mxload.sample_rng`; default drawn from `generator`, else from torch's global RNG
            when the program imported torch (at ``iter()``, drawing from torch's RNGs what torch's
            loader draws there), else fresh.
        start_method (str | None): ``"fork"``, ``"spawn"`` or ``"forkserver"``; default: the one set
            with ``multiprocessing.set_start_method()`` (as torch), else ``fork`` on Linux.
        max_worker_restarts (int): restart a dead worker and retry its batches up to this many
            times per loader (over all its epochs, persistent workers or not). Default ``0``. Worker
            processes of a map-style dataset only: an IterableDataset's worker holds its place in the
            stream, and a thread worker (``thread_pool=True``) cannot be replaced; their deaths are
            errors that say so.
        profile (bool): record per-stage timings in ``loader.profiler`` (a :class:`Profiler`).
            Default ``False``.
        distributed (bool): shard the data by rank with a
            :class:`mxload.sampler.DistributedSampler`. Default ``False``.
        try_nopython (bool | None): Gluon 2's; accepted (collation always runs in compiled code).
        backend (str | RayBackend | None): where the workers run: ``None`` (default) local
            processes, or threads with `thread_pool`; ``"ray"`` or a :class:`mxload.RayBackend` for
            Ray actors anywhere in a Ray cluster (the ``mxload[ray]`` extra).
        seeding (str | None): how worker processes seed Python's ``random``, numpy's global RNG and
            (when the program uses torch) torch's. ``"per_worker"`` (this class's default): from
            (`seed`, epoch, worker id), again at every epoch. ``"torch"`` (``mxload.torch``'s
            default): as torch's DataLoader, worker k gets ``base_seed + k`` with a base seed drawn
            at each ``iter()`` (once with persistent workers, whose streams go on across epochs), so
            the batches are torch's for the same `num_workers`. ``"per_sample"``: every sample's
            load seeds all three from (`seed`, epoch, sample index), so random augmentation drawn
            from them is the same for any `num_workers` (worker processes or ``num_workers=0``;
            in-process, the training loop's RNG states are put back after each batch).
            docs/migration.md compares them.

    Raises:
        ValueError: conflicting or out-of-range arguments (the message names them).
        TypeError: a callable argument is not callable, a batch sampler sits in the fifth
            (`last_batch`) position, `generator` is not a torch.Generator, a switch (`shuffle`,
            `drop_last`, `in_order`, ...) is not True or False (numpy's bools are; ``"no"`` would
            mean True; ``mxload.torch.DataLoader`` takes them as torch does), or a keyword is
            unknown (the nearest one is named: ``num_worker`` -> ``num_workers``).

    While iterating, a worker that dies raises :class:`WorkerError`, a missing batch
    :class:`LoaderTimeoutError`, exhausted shared memory :class:`SharedMemoryError`; an exception in
    the dataset is re-raised as the worker's own exception object, the worker's traceback as its
    cause.  More workers than usable CPU cores warns, as torch's (``UserWarning``).  Setting `batch_size`,
    `sampler`, `batch_sampler`, `drop_last`, `dataset` or `persistent_workers` after construction
    raises ``ValueError``, as in torch.

    Example:
        >>> import numpy as np, mxload
        >>> ds = mxload.ArrayDataset(np.arange(10, dtype=np.float32).reshape(5, 2), np.arange(5))
        >>> loader = mxload.DataLoader(ds, batch_size=2, last_batch="discard")
        >>> len(loader)
        2
        >>> for x, y in loader:
        ...     print(x.shape, x.dtype, y.tolist())
        (2, 2) float32 [0, 1]
        (2, 2) float32 [2, 3]
    """

    # mxload.torch.DataLoader hands out torch tensors instead of numpy arrays.
    _as_tensors = False
    # mxload.torch.DataLoader takes switches (shuffle, in_order, ...) as torch does: any truthy value.
    _torch_switches = False
    # How workers' global RNGs are seeded when seeding= is not given (_options.SEEDINGS).
    _seeding = "per_worker"

    @suggesting_keywords
    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 sampler: Any = None, last_batch: str | None = None, batch_sampler: Any = None,
                 batchify_fn: Callable[..., Any] | None = None, num_workers: int | str = 0,
                 pin_memory: bool = False, pin_device_id: int = 0, prefetch: int | str | None = None,
                 thread_pool: bool = False, timeout: float | None = 120, auto_reload: bool = False, *,
                 collate_fn: Callable[..., Any] | None = None, drop_last: bool | None = None,
                 worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: Any = None,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, seed: int | None = None,
                 start_method: str | None = None, max_worker_restarts: int = 0, profile: bool = False,
                 distributed: bool = False, try_nopython: bool | None = None, backend: Any = None,
                 seeding: str | None = None):
        given = dict(locals())   # every argument, by name, as given
        del given["self"]
        self.__dict__[_INITIALIZED] = False
        self._options = LoaderOptions.from_arguments(**given, torch_switches=self._torch_switches,
                                                     default_seeding=self._seeding)
        # loader.sampler: e.g. loader.sampler.set_epoch(e)
        self.sampler, self.batch_sampler = self._make_samplers(self._options)
        self.__dict__.update(self._attribute_views(given))
        self.epoch = 0
        self._run_seed = RunSeed(self._options.derived.torch_seeded)
        self._iterations = Iterations(self._options)
        self._position = LoaderPosition()
        self._pin_checked = False
        self._pin_device: str | None = None
        # len(loader) of an IterableDataset, for the overrun warning (torch's name).
        self._IterableDataset_len_called: int | None = None
        self.profiler: Any = None
        if self.profile:
            from .profiler import Profiler
            self.profiler = Profiler()
        self.__dict__[_INITIALIZED] = True
        self._check_worker_count(stacklevel=5)   # the caller of DataLoader(), past suggesting_keywords'
        if self.auto_reload:   # the first epoch starts loading now
            self._iterations.load_ahead(self._start_iter, self._index_sampler, self.iterable)

    # How the samplers are made (mxload.torch.DataLoader: torch's, as torch makes them).
    _make_samplers = staticmethod(_make_samplers)

    def _attribute_views(self, given: dict[str, Any]) -> dict[str, Any]:
        """What the instance dict holds besides the loader's own state (mxload.torch.DataLoader:
        torch's attributes, as torch's loader holds them): nothing here, the options are read
        through their attributes."""
        return {}

    @property
    def seed(self) -> int:
        """The run's seed: given, or drawn from torch (at the first ``iter()``, as torch draws its
        base seed; asking for it earlier draws it now), or fresh."""
        if self._run_seed.pending:
            self._seeded(self._run_seed.draw(self.generator))
        return self._options.seeds.seed

    @seed.setter
    def seed(self, value: int) -> None:
        self._run_seed.pending = False
        self._options = self._options.replaced(seed=value)

    def _seeded(self, seed: int) -> None:
        """The run's seed, drawn from torch (RunSeed.draw): also the first iteration's workers'
        base seed, and the seed of the loader's own RandomSampler."""
        self.seed = seed
        self._options = self._options.replaced(base_seed=seed)
        if self._options.own_sampler and isinstance(self.sampler, RandomSampler):
            self.sampler.seed = seed

    def _epoch_batches(self, start: int) -> EpochBatches:
        """This epoch's batches of indices from batch `start` on, drawn as they are needed
        (advances the sampler's epoch: it is iterated now)."""
        self._follow_dataset_length()
        if not self._options.derived.auto_batching and self._options.batching.batch_sampler is None:
            return epoch_keys(self.sampler, start)   # batch_size=None: one sampler key per batch
        return epoch_batches(self.batch_sampler, start)

    def __iter__(self) -> Any:
        """A new epoch.  Iterators are independent, as in torch (zip(loader, loader) pairs two
        epochs; each has its own workers), except with persistent workers: their one engine serves
        the newest iterator, and an older one still in progress raises RuntimeError when used
        again rather than share (and silently lose) its batches."""
        ahead, dropped = self._iterations.take_ahead(self._index_sampler, self.iterable)
        if ahead is not None:
            return ahead   # auto_reload: this epoch started loading when the last one ended
        if dropped:
            self.epoch -= 1   # drawn again now, as without auto_reload, under the same epoch number
        return self._start_iter()

    def _start_iter(self) -> Any:
        self._position.before_draws(self)
        resume = self._position.resume   # a state_dict() resumed: its IterDataPipe seed, if any
        resumed_seed = None if resume is None else resume.get("datapipe_seed")
        stream_key = self._run_seed.datapipe_epoch_starts(self._options, self.epoch, not self.num_workers,
                                                          resumed_seed)
        drawn, base = self._run_seed.iteration_starts(self._options, self.epoch,
                                                      self.persistent_workers and bool(self.num_workers),
                                                      self.generator, self.sampler)
        if drawn is not None:
            self._seeded(drawn)
        elif base is not None:
            self._options = self._options.replaced(base_seed=base)
        if stream_key is not None and self.num_workers and base is not None:
            self._run_seed.datapipe_workers_start(self._options)
        runs = self._iterations
        # Persistent workers already running were checked when they started; "auto" takes at most
        # the usable cores (and its epochs in-process paid 0.33 ms each for the cgroup reads).
        if runs.engine is None and not self._options.workers.autotune:
            self._check_worker_count(stacklevel=5)   # the caller of iter()
        previous = runs.newest()
        if previous is not None and self.persistent_workers:
            previous.supersede()
        if self.pin_memory and not self._pin_checked:
            self._pin_checked = True
            self._pin_device = pinning_for_loader(self.pin_memory_device, stacklevel=3)
        progress = self._position.epoch_starting(self)
        if stream_key is not None:   # what a checkpoint of the epoch needs to replay its stream
            progress.datapipe_seed = int(stream_key[0])
        it = start_epoch(EpochRequest(
            options=self._options, epoch=self.epoch, batches=None if self.iterable else self._epoch_batches,
            progress=progress, profiler=self.profiler, engine=runs.engine, persistent=self.persistent_workers,
            length=self.__len__, restarts=runs.restarts, tuner=runs.tuner, buffers=runs.buffers,
            on_engine=functools.partial(runs.use_engine, persistent=self.persistent_workers),
            stream_key=stream_key))
        self.epoch += 1
        runs.started(it)
        if self._pin_device is not None or self.auto_reload or self.iterable or self._as_tensors:
            return _LoaderIterator(self, it)
        return it

    def _follow_dataset_length(self) -> None:
        # mxload's own samplers are sized at construction; torch's read len(dataset) themselves.
        sampler = self.sampler
        if self._options.own_sampler and isinstance(sampler, (RandomSampler, SequentialSampler)):
            n = len(self.dataset)
            if n != len(sampler):
                sampler._resize(n)

    def __len__(self) -> int:
        if self.iterable:
            n = len(self.dataset)  # TypeError if the stream has no length
            bs = self._fetch_batch_size
            self._IterableDataset_len_called = n // bs if self.last_batch == "discard" else -(-n // bs)
            return self._IterableDataset_len_called
        self._follow_dataset_length()
        return len(self._index_sampler)

    def __repr__(self) -> str:
        return (f"DataLoader(dataset={type(self.dataset).__name__}, batch_size={self.batch_size}, "
                f"num_workers={self.num_workers}, thread_pool={self.thread_pool})")


class WorkerProcess:
    """One worker process as torch's DataLoader iterator lists it (``it._workers``: its
    multiprocessing.Process objects): `pid`, ``is_alive()``, ``join(timeout)``, `exitcode`,
    ``terminate()``, ``kill()``."""

    def __init__(self, process: Any):
        self._process = process
        self.pid: int = process.pid

    # A forkserver worker's Process object is closed once the shutdown reaped it (it then
    # refuses every question with ValueError): it has ended, with the exit code it kept.

    def is_alive(self) -> bool:
        try:
            return bool(self._process.is_alive())
        except ValueError:
            return False

    def join(self, timeout: float | None = None) -> None:
        try:
            self._process.join(timeout)
        except ValueError:
            pass

    def terminate(self) -> None:
        """SIGTERM, if it still runs (the loader ends its workers itself: this is for code
        written for torch's Process objects)."""
        if self.is_alive():
            self._process.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._process.kill()

    @property
    def exitcode(self) -> int | None:
        """None while it runs; then its exit code (negative: the signal that ended it)."""
        try:
            return cast("int | None", self._process.exitcode)
        except ValueError:
            return cast("int | None", getattr(self._process, "final_exitcode", None))

    def __repr__(self) -> str:
        return f"<mxload worker process pid={self.pid} {'alive' if self.is_alive() else 'ended'}>"


class _LoaderIterator(HandingIterator):
    """What the loader adds around an epoch's iterator, when needed: pinned
    memory, auto_reload (the next epoch starts loading when this one ends),
    and torch's warning when an IterableDataset yields more than its len()."""

    def __init__(self, loader: DataLoader[Any], inner: Any):
        self.loader = loader
        self.inner = inner
        self._pin = loader._pin_device is not None
        # The torch face's own collation makes tensors of every array, as torch's default_collate
        # and default_convert do; what a user's collate_fn returns is the batch as it made it.
        self._as_tensors = loader._as_tensors and collates_itself(loader._options.batching.batchify_fn)
        self._yielded = 0
        # As torch: the length the loader reported before this iteration
        # began (len(loader) asked meanwhile is the next iteration's).
        self._reported = loader._IterableDataset_len_called
        # The epoch's hand-over: one batch to one caller, and the slot where a batch stays until
        # it reached the loop (NOTE [ Signal-safe hand-over ], csrc/handoff.pxi).
        self.handover = inner.handover
        # torch's iterator attribute: its worker processes, kept after they ended (code written for
        # torch joins them, or reads their pids); none in-process, with threads or Ray actors.
        engine = inner.engine
        self._workers = [WorkerProcess(p) for p in engine.worker_processes()] if engine is not None else []

    def __iter__(self) -> _LoaderIterator:
        return self

    def _next(self) -> Any:
        """The epoch's next batch, pinned or made tensors; __next__
        (handing_next) calls it.  A signal handler's exception in here
        leaves the batch in the epoch's slot for the next call."""
        loader = self.loader
        again = self.handover.ready is not None   # a batch an exception kept from the loop last time
        try:
            batch = self.inner._next()
        except StopIteration:
            runs = loader._iterations
            if loader.auto_reload and runs.ahead is None and self.inner is runs.newest():
                runs.load_ahead(loader._start_iter, loader._index_sampler, loader.iterable)
            raise
        except BaseException:
            del self, loader   # the traceback must not keep the epoch alive (see EpochIterator._next)
            raise
        if not again:
            self._yielded += 1
        reported = self._reported
        if reported is not None and self._yielded > reported:
            self._warn_overrun(reported)
        if self._pin:
            batch = pin_batch(batch)
        return to_tensors(batch) if self._as_tensors else batch

    def _warn_overrun(self, reported: int) -> None:
        """As torch, at every batch past the length len(loader) reported
        (each message differs, so Python's default filter shows each)."""
        loader = self.loader
        what = "samples" if loader._fetch_batch_size <= 1 else "batches"
        more = (" For multiprocessing data-loading, this could be caused by not properly configuring the "
                "IterableDataset replica at each worker: each worker's copy must yield its own part of "
                "the stream (split it with get_worker_info(), torch's or mxload's)."
                if loader.num_workers else "")
        warnings.warn(f"Length of IterableDataset {loader.dataset} was reported to be {reported} {what} "
                      f"(when accessing len(dataloader)), but {self._yielded} {what} have been fetched."
                      + more, stacklevel=3)

    __next__ = handing_next(_next)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self) -> _LoaderIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
