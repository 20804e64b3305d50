"""DataLoader: checks its arguments, builds the batch sampler and picks an
iterator (in-process, or the multi-worker engine in ``_engine``)."""
from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ._checkpoint import EpochProgress, check_state
from ._core import defer_sigint, sigint_safe_finalizer
from ._cpus import warn_if_oversubscribed
from ._worker import _SampleSource
from .batchify import collate, collate_profiled, default_batchify
from .dataset import IterableDataset
from .sampler import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    load_sampler_state,
    sampler_state,
)

if TYPE_CHECKING:
    from ._engine import EpochIterator

__all__ = ["DataLoader"]

_START_METHODS = ("fork", "spawn", "forkserver")


def _is_iterable_dataset(dataset: Any) -> bool:
    if isinstance(dataset, IterableDataset):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


class DataLoader:
    """Loads batches from a dataset, in-process or with worker processes/threads.

    Gluon's signature plus the keywords PyTorch users expect:
    ``collate_fn`` is an alias of ``batchify_fn`` and ``drop_last=True`` of
    ``last_batch="discard"``.  Iterating the loader runs one epoch; each batch
    is a structure of numpy arrays (views of one shared-memory slab when
    workers made it; ``torch.from_numpy`` makes zero-copy tensors of them).

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``, and
            optionally ``__getitems__(indices)``, called once per batch) or an
            iterable one (:class:`IterableDataset`, or any object with
            ``__iter__`` and no ``__getitem__``).
        batch_size (int | None): samples per batch; required unless
            `batch_sampler` is given.
        shuffle (bool): draw a new random order every epoch (seeded by
            `seed`). Default ``False``.
        sampler: an iterable of indices with ``__len__`` (a
            :mod:`mxload.sampler` sampler or a torch one); exclusive with
            `shuffle`.
        last_batch (str | None): ``"keep"`` (default), ``"discard"`` or
            ``"rollover"`` (carry the incomplete batch into the next epoch).
        batch_sampler: an iterable of index lists; exclusive with
            `batch_size`, `shuffle`, `sampler` and `last_batch`.
        batchify_fn (callable | None): turns a list of samples into a batch;
            default :func:`mxload.batchify.default_batchify`.
        num_workers (int): worker processes (threads with `thread_pool`);
            ``0`` (default) loads in the calling thread.
        prefetch (int | None): batches in flight across all workers; default
            ``2 * num_workers``.
        thread_pool (bool): workers are threads, not processes. Default ``False``.
        timeout (float | None): seconds to wait for a batch before raising
            :class:`LoaderTimeoutError`; default ``120``, ``None`` waits
            forever.
        worker_init_fn (callable | None): called with the worker id in each
            worker, after seeding.
        seed (int | None): fixes the shuffle order, the workers' RNG seeds and
            :func:`mxload.sample_rng`; default a fresh random seed.
        persistent_workers (bool): keep the workers between epochs (end them
            with :meth:`close` or ``with``). Default ``False``.
        in_order (bool): yield batches in sampler order (default ``True``);
            ``False`` yields them as they complete.
        start_method (str | None): ``"fork"``, ``"spawn"`` or ``"forkserver"``;
            default ``fork`` on Linux.
        max_worker_restarts (int): restart a dead worker and retry its batches
            up to this many times per loader. Default ``0``.
        profile (bool): record per-stage timings in ``loader.profiler``
            (a :class:`Profiler`). Default ``False``.
        collate_fn (callable | None): keyword-only alias of `batchify_fn`.
        drop_last (bool | None): keyword-only; ``True`` is
            ``last_batch="discard"``.
        distributed (bool): shard the data by rank with a
            :class:`mxload.sampler.DistributedSampler`. Default ``False``.

    Raises:
        ValueError: conflicting or out-of-range arguments (the message names them).
        TypeError: `batchify_fn`, `collate_fn` or `worker_init_fn` is not callable.

    While iterating, a worker that dies raises :class:`WorkerError`, a missing
    batch :class:`LoaderTimeoutError`, exhausted shared memory
    :class:`SharedMemoryError`; an exception in the dataset is re-raised as its
    own type with the worker's traceback.  More workers than usable CPU cores
    warns once (``UserWarning``).

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

    def __init__(self, dataset: Any, batch_size: int | None = None, shuffle: bool = False,
                 sampler: Any = None, last_batch: str | None = None, batch_sampler: Any = None,
                 batchify_fn: Callable[..., Any] | None = None, num_workers: int = 0,
                 prefetch: int | None = None, thread_pool: bool = False, timeout: float = 120,
                 worker_init_fn: Callable[[int], None] | None = None, seed: int | None = None,
                 persistent_workers: bool = False, in_order: bool = True,
                 start_method: str | None = None, max_worker_restarts: int = 0,
                 profile: bool = False, *, collate_fn: Callable[..., Any] | None = None,
                 drop_last: bool | None = None, distributed: bool = False):
        if collate_fn is not None:
            if batchify_fn is not None:
                raise ValueError("pass either batchify_fn or collate_fn (its alias), not both")
            batchify_fn = collate_fn
        if drop_last is not None:
            if last_batch is not None and drop_last and last_batch != "discard":
                raise ValueError(f"drop_last=True conflicts with last_batch={last_batch!r}")
            if drop_last:
                last_batch = "discard"
        if batchify_fn is not None and not callable(batchify_fn):
            raise TypeError(f"batchify_fn must be callable, got {type(batchify_fn).__name__}")
        self.dataset = dataset
        self.iterable = _is_iterable_dataset(dataset)
        if distributed:
            clash = [name for name, bad in (("sampler", sampler is not None),
                                            ("batch_sampler", batch_sampler is not None)) if bad]
            if clash:
                raise ValueError(f"distributed=True is mutually exclusive with {', '.join(clash)} "
                                 f"(pass a DistributedSampler as sampler= instead)")
            if self.iterable:
                raise ValueError("distributed=True cannot be used with an IterableDataset "
                                 "(shard the stream by rank in the dataset instead)")

        if batch_sampler is not None:
            conflicts = [name for name, bad in (("batch_size", batch_size is not None),
                                                ("shuffle", bool(shuffle)),
                                                ("sampler", sampler is not None),
                                                ("last_batch", last_batch is not None)) if bad]
            if conflicts:
                raise ValueError(f"batch_sampler is mutually exclusive with {', '.join(conflicts)}")
            if self.iterable:
                raise ValueError("batch_sampler cannot be used with an IterableDataset")
        else:
            if batch_size is None:
                raise ValueError("batch_size must be given unless batch_sampler is")
            if (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                    or batch_size <= 0):
                raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
            if self.iterable:
                if sampler is not None or shuffle:
                    raise ValueError("sampler/shuffle cannot be used with an IterableDataset "
                                     "(it decides its own order)")
                if last_batch not in (None, "keep", "discard"):
                    raise ValueError(f"last_batch={last_batch!r} is not supported for an "
                                     f"IterableDataset; use 'keep' or 'discard'")
            else:
                if sampler is not None and shuffle:
                    raise ValueError("shuffle=True is mutually exclusive with sampler "
                                     "(shuffle with a RandomSampler instead)")
                if sampler is None and distributed:
                    # Every rank must draw the same order, so no random seed here.
                    sampler = DistributedSampler(len(dataset), shuffle=shuffle,
                                                 seed=seed if seed is not None else 0,
                                                 drop_last=last_batch == "discard")
                elif sampler is None:
                    sampler = (RandomSampler(len(dataset), seed=seed) if shuffle
                               else SequentialSampler(len(dataset)))
                batch_sampler = BatchSampler(sampler, int(batch_size), last_batch or "keep")

        if isinstance(num_workers, bool) or not isinstance(num_workers, (int, np.integer)) or num_workers < 0:
            raise ValueError(f"num_workers must be a non-negative integer, got {num_workers!r}")
        if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer))
                                     or prefetch < 1):
            raise ValueError(f"prefetch must be a positive integer or None, got {prefetch!r}")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        if start_method is not None and start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS} or None, got {start_method!r}")
        if isinstance(max_worker_restarts, bool) or not isinstance(max_worker_restarts, (int, np.integer)) \
                or max_worker_restarts < 0:
            raise ValueError(
                f"max_worker_restarts must be a non-negative integer, got {max_worker_restarts!r}")
        if worker_init_fn is not None and not callable(worker_init_fn):
            raise TypeError(f"worker_init_fn must be callable, got {type(worker_init_fn).__name__}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                                 or seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
        if num_workers == 0:
            unsupported = [name for name, used in (("persistent_workers", persistent_workers),
                                                   ("thread_pool", thread_pool),
                                                   ("max_worker_restarts", max_worker_restarts > 0))
                           if used]
            if unsupported:
                raise ValueError(f"{', '.join(unsupported)} need num_workers > 0")

        self.batch_size = batch_size
        self.last_batch = last_batch or "keep"
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)  # e.g. loader.sampler.set_epoch(e)
        self.batchify_fn = batchify_fn if batchify_fn is not None else default_batchify
        self.num_workers = int(num_workers)
        if self.num_workers and not thread_pool:
            warn_if_oversubscribed(self.num_workers)
        self.prefetch = int(prefetch) if prefetch is not None else 2 * max(self.num_workers, 1)
        self.thread_pool = bool(thread_pool)
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.seed = (int(seed) if seed is not None
                     else int(cast(int, np.random.SeedSequence().entropy) % (2 ** 63)))
        self.persistent_workers = bool(persistent_workers)
        self.in_order = bool(in_order)
        self.start_method = start_method
        self.max_worker_restarts = int(max_worker_restarts)
        self.profile = bool(profile)
        self.epoch = 0
        self._engine: Any = None          # persistent workers' engine
        self._live_iter: weakref.ref[_InProcessIterator | EpochIterator] | None = None   # the newest
        # Plain weak references, not a WeakSet: a WeakSet's callback would run
        # Python code as an iterator dies, after its finalizer, where a
        # Ctrl-C the finalizer made pending again would be swallowed.
        self._live_iters: list[weakref.ref[_InProcessIterator | EpochIterator]] = []
        self._stats: dict[str, int] = {}
        self._progress: EpochProgress | None = None   # the latest epoch's (for state_dict)
        self._resume: dict[str, Any] | None = None              # load_state_dict() waiting for __iter__
        self.profiler: Any = None
        if self.profile:
            from .profiler import Profiler
            self.profiler = Profiler()

    # ------------------------------------------------------------------

    def _epoch_batches(self) -> list[Any]:
        """This epoch's batches of indices (advances the sampler's epoch)."""
        epoch_batches: Callable[[], list[Any]] | None = getattr(self.batch_sampler, "epoch_batches", None)
        if epoch_batches is not None:
            return epoch_batches()
        return [np.asarray(b, dtype=np.int64) for b in self.batch_sampler]

    def __iter__(self) -> _InProcessIterator | EpochIterator:
        """A new epoch.  Iterators are independent, as in torch (zip(loader,
        loader) pairs two epochs; each has its own workers), except with
        persistent workers: their one engine serves the newest iterator, and
        an older one still in progress raises RuntimeError when used again
        rather than share (and silently lose) its batches."""
        previous = self._live_iter() if self._live_iter is not None else None
        if previous is not None and self.persistent_workers:
            previous.supersede()
        self._progress = self._new_progress()
        if self.num_workers == 0:
            it: _InProcessIterator | EpochIterator = _InProcessIterator(self)
        else:
            from ._engine import start_epoch
            it = start_epoch(self)
        self.epoch += 1
        self._live_iter = weakref.ref(it)
        self._live_iters = [ref for ref in self._live_iters if ref() is not None] + [self._live_iter]
        return it

    # ------------------------------------------------------------ checkpoints

    def _dataset_state(self) -> Any:
        get = getattr(self.dataset, "state_dict", None)
        return get() if callable(get) else None

    def _new_progress(self) -> EpochProgress:
        """Progress of the epoch about to start; call before the sampler advances."""
        resume, self._resume = self._resume, None
        state = None if self.iterable else sampler_state(self.batch_sampler)
        return EpochProgress(self.epoch, state, self._dataset_state(),
                             resume["done"] if resume is not None else None)

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
        progress = self._progress
        if self._resume is not None:
            return dict(self._resume)
        if progress is None or progress.complete:
            progress = EpochProgress(self.epoch, None if self.iterable else sampler_state(self.batch_sampler),
                                     self._dataset_state())
        return progress.state(self.seed)

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
        state = check_state(state)
        self.close()  # a live epoch or persistent workers belong to the old position
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        if not self.iterable:
            load_sampler_state(self.batch_sampler, state["sampler"])
        if state.get("dataset") is not None:
            load = getattr(self.dataset, "load_state_dict", None)
            if load is None:
                raise ValueError(f"the state carries dataset state but {type(self.dataset).__name__} "
                                 f"has no load_state_dict()")
            load(state["dataset"])
        self._progress = None
        self._resume = state

    def __len__(self) -> int:
        if self.iterable:
            n = len(self.dataset)  # TypeError if the stream has no length
            bs = int(self.batch_size)  # type: ignore[arg-type]  # required unless batch_sampler
            return n // bs if self.last_batch == "discard" else -(-n // bs)
        return len(self.batch_sampler)

    @property
    def stats(self) -> dict[str, int]:
        """Counters of the latest worker engine (batches, slabs created/reused/
        retired, worker restarts); empty before workers ran.

        Example:
            >>> import numpy as np, mxload
            >>> loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(8)), batch_size=4, num_workers=1)
            >>> _ = list(loader)
            >>> loader.stats["batches"]
            2
        """
        return dict(self._stats)

    @defer_sigint
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
        for ref in self._live_iters:
            it = ref()
            if it is not None:
                it.close()
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _finalize(self) -> None:
        # A live epoch may outlive its loader (`for b in DataLoader(...)`):
        # let it finish, then end the persistent workers with it.
        try:
            it = self._live_iter() if self._live_iter is not None else None
            if it is not None and self._engine is not None and hasattr(it, "release_engine_at_end"):
                it.release_engine_at_end()
            elif self._engine is not None:
                self._engine.shutdown()
        except Exception:
            pass
        self.__dict__.clear()   # as EpochIterator._finalize: freed while Ctrl-C is held back

    __del__ = sigint_safe_finalizer(_finalize)

    def __repr__(self) -> str:
        return (f"DataLoader(dataset={type(self.dataset).__name__}, batch_size={self.batch_size}, "
                f"num_workers={self.num_workers}, thread_pool={self.thread_pool})")


class _InProcessIterator:
    """num_workers=0: fetch and collate in the calling thread."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self._batchify = loader.batchify_fn
        self._epoch = loader.epoch
        progress = loader._progress
        assert progress is not None
        self._progress: EpochProgress = progress
        self._position = 0
        self._profiler = loader.profiler
        t0 = time.monotonic_ns()
        self._discard = 0
        self._source = _SampleSource(loader.dataset, loader.iterable, int(loader.batch_size or 0),
                                     loader.last_batch == "discard", loader.seed)
        if loader.iterable:
            self._batches: list[Any] | None = None
            self._order: list[int] | None = None
            self._discard = self._progress.count   # resumed: replay the stream, drop what was seen
        else:
            self._batches = loader._epoch_batches()
            self._order = self._progress.remaining(len(self._batches))
        self._done = False
        if self._profiler is not None:
            self._profiler.epoch_started(time.monotonic_ns() - t0, 0)

    def __iter__(self) -> _InProcessIterator:
        return self

    def __len__(self) -> int:
        if self._order is None:
            return len(self.loader)
        return len(self._order)

    def _next_samples(self) -> Any:
        """(batch index, samples), or None at the end."""
        if self._order is not None:
            if self._position >= len(self._order):
                return None
            idx = self._order[self._position]
            return idx, self._source.samples(self._epoch, self._batches[idx])  # type: ignore[index]
        while True:
            samples = self._source.samples(self._epoch, None)
            if samples is None or not self._discard:
                return None if samples is None else (self._progress.count, samples)
            self._discard -= 1

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        profiler = self._profiler
        t0 = time.monotonic_ns()
        nxt = self._next_samples()
        if nxt is None:
            self._progress.finished = True
            self.close()
            raise StopIteration
        idx, samples = nxt
        if profiler is None:
            batch = collate(self._batchify, samples, idx)
        else:
            t1 = time.monotonic_ns()
            batch, stats, field_ns = collate_profiled(self._batchify, samples, idx)
            t2 = time.monotonic_ns()
            profiler.worker_batch(-1, os.getpid(), idx, t0, t1 - t0, t2 - t1, t2, stats, field_ns,
                                  transported=False)
            profiler.batch_taken(idx, t0)
        self._position += 1
        self._progress.taken(idx)
        return batch

    def close(self) -> None:
        if not self._done and self._profiler is not None:
            self._profiler.epoch_ended()
        self._done = True
        self._source.close()

    def supersede(self) -> None:
        """In-process iterators share nothing: a newer one leaves this one be."""

    def __enter__(self) -> _InProcessIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
