"""Index samplers.

Every sampler exposes ``epoch_indices()``, which returns the next epoch's
indices as a 1-D ``np.int64`` array and advances the epoch.  ``__iter__`` is
built on top of it.  The loader calls it directly (through
``BatchSampler.batch_arrays()``), so an epoch is one array made by one numpy
call (``arange``, ``permutation``), each batch is a view of it, and a batch's
indices reach its worker as raw int64 bytes with its task: no Python int is
made per index (an epoch of 10 million samples as a list would be 10 million
objects, seconds to build and hundreds of MB), and a worker only ever sees
the indices of the batches it loads.

Any other sampler (a user's, torch's) is iterated as the batches need its
indices, as torch does (:func:`epoch_batches`): an infinite one works, and
the first batch does not wait for the epoch to be drawn.
"""

import itertools
import operator
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
import numpy.typing as npt

from ._checks import check_int
from ._core import CheckedBatches, DrawnBatches
from ._keys import encode_key
from ._torch_compat import torch_process_group

__all__ = [
    "Sampler",
    "SequentialSampler",
    "RandomSampler",
    "BatchSampler",
    "DistributedSampler",
    "IntervalSampler",
    "FilterSampler",
]

# Converting to Python ints in chunks keeps __iter__ fast (tolist is C-speed)
# without materialising a list as long as the epoch.
_ITER_CHUNK = 4096

_LAST_BATCH_MODES = ("keep", "discard", "rollover")

IndexArray = npt.NDArray[np.int64]


class SizedIndices(Protocol):
    """What BatchSampler accepts as a sampler: any iterable of indices with a length."""

    def __iter__(self) -> Iterator[Any]: ...
    def __len__(self) -> int: ...


def _int_from_env(var: str, default: int) -> int:
    raw = os.environ.get(var)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not an integer") from None


def _permutation(seed: int, epoch: int, n: int) -> IndexArray:
    # Depends only on (seed, epoch), so every process that shares the seed
    # (e.g. all distributed ranks) derives the same order without talking.
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64, copy=False)


def _iter_ints(indices: IndexArray) -> Iterator[int]:
    for start in range(0, len(indices), _ITER_CHUNK):
        yield from indices[start:start + _ITER_CHUNK].tolist()


def _sampler_indices(sampler: Any) -> IndexArray:
    """Next epoch's indices of any sampler as a 1-D int64 array."""
    get = getattr(sampler, "epoch_indices", None)
    if get is not None:
        indices = np.asarray(get())
    elif isinstance(sampler, np.ndarray):
        indices = sampler
    else:
        # User-defined samplers may be any iterable of ints (even a list);
        # operator.index rejects floats that fromiter would silently truncate.
        indices = np.fromiter(map(operator.index, sampler), dtype=np.int64)
    return _checked_indices(indices, None)


def _drawn_whole(sampler: Any) -> bool:
    """Whether a sampler's epoch is drawn as one array (mxload's samplers: one numpy call), or
    is one already (a list, a range): else it is drawn index by index, as the batches need them."""
    return (getattr(sampler, "epoch_indices", None) is not None
            or isinstance(sampler, (np.ndarray, list, tuple, range)))


def _slices(indices: IndexArray, size: int, start: int) -> Iterator[IndexArray]:
    """Views of `indices`, `size` at a time, from the `start`-th on: made as they are drawn, by
    C code only (no Python frame a signal handler's exception could cut short)."""
    first, n = start * size, len(indices)
    return map(indices.__getitem__, map(slice, range(first, n, size), range(first + size, n + size, size)))


def _key_batch(key: Any, position: int) -> Any:
    """batch_size=None: an integer key is the one-index batch [key]; any other (a list of
    indices, a slice...) is passed to ``dataset[...]`` as it is, as torch does, so it travels
    encoded (``_keys.encode_key``)."""
    try:
        return np.array([operator.index(key)], np.int64)
    except (TypeError, OverflowError):
        return encode_key(key)


_INT64 = np.dtype(np.int64)
_INT64_MAX = np.iinfo(np.int64).max


def batch_sampler_indices(batch: Any, position: int) -> IndexArray:
    """Batch number `position` of a batch_sampler as a 1-D int64 array.

    Checked in the main process, where the error can name the batch: sent to a
    worker as it was, a 2-D batch would not match its frame's length and a
    boolean mask would be taken as indices 0 and 1."""
    if type(batch) is np.ndarray and batch.dtype is _INT64 and batch.ndim == 1:
        return batch
    try:
        indices = np.asarray(batch)
    except (TypeError, ValueError, OverflowError):   # ragged nesting, ints beyond 64 bits
        indices = None
    if indices is not None and indices.dtype.kind != "O" and (
            indices.dtype.kind != "f" or isinstance(batch, np.ndarray)):
        return _checked_indices(indices, position)
    # numpy made floats or objects of it: a list mixing int64 and uint64
    # scalars (promoted to float64), an object array, nested lists.  Index
    # each item as Python would; floats are refused there, not truncated.
    try:
        return np.fromiter(map(operator.index, batch), dtype=np.int64)
    except TypeError as e:
        raise ValueError(f"{_what(position)} must be a 1-D sequence of integer indices: {e}") from e
    except OverflowError as e:
        raise ValueError(f"{_what(position)} holds an index beyond int64: {e}") from e


def _what(position: int | None) -> str:
    return "a sampler's epoch" if position is None else f"the batch_sampler's batch {position}"


def _checked_indices(indices: np.ndarray, position: int | None) -> IndexArray:
    """`indices` as int64 if they are a 1-D array of integers that fit; else
    ValueError naming the sampler's epoch (None) or the batch (`position`)."""
    if indices.ndim != 1:
        raise ValueError(f"{_what(position)} must be a 1-D sequence of indices, got shape {indices.shape}")
    dtype = indices.dtype
    if dtype is _INT64:
        return indices
    if indices.size and dtype.kind not in "iu":
        raise ValueError(f"{_what(position)} must hold integer indices, got dtype {dtype}")
    if dtype.kind == "u" and dtype.itemsize == 8 and indices.size:
        largest = int(indices.max())
        if largest > _INT64_MAX:   # would wrap to a negative index, a wrong sample
            raise ValueError(f"{_what(position)} holds index {largest}, beyond int64")
    return indices.astype(np.int64)


class Sampler:
    """Base class: subclasses implement ``epoch_indices()`` and ``__len__``.

    Iterating a sampler draws one epoch's indices (and advances its epoch).
    Any iterable of ints with ``__len__`` also works as a loader's sampler;
    subclassing adds checkpointing (:meth:`state_dict`) and fast int64 arrays.

    Example:
        >>> import numpy as np, mxload
        >>> class Reversed(mxload.sampler.Sampler):
        ...     def __init__(self, n):
        ...         self.n = n
        ...     def epoch_indices(self):
        ...         return np.arange(self.n - 1, -1, -1, dtype=np.int64)
        ...     def __len__(self):
        ...         return self.n
        >>> list(Reversed(3))
        [2, 1, 0]
    """

    def epoch_indices(self) -> IndexArray:
        """Return the next epoch's indices as a 1-D int64 array and advance the epoch."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Any]:
        # Not a generator function: the epoch advances when iter() is called,
        # not lazily on the first next().
        return _iter_ints(self.epoch_indices())

    def __len__(self) -> int:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What decides the next epoch's order (JSON-serialisable): the epoch
        counter and the seed, for samplers that have them."""
        return {k: getattr(self, k) for k in ("epoch", "seed") if hasattr(self, k)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (from state_dict(), possibly of another
        process).  ValueError naming the field for anything state_dict()
        does not write; nothing is changed then."""
        if not isinstance(state, dict):
            raise ValueError(f"{type(self).__name__} state must be a dict from state_dict(), got {state!r}")
        values = {}
        for key in ("epoch", "seed"):
            if key in state:
                if not hasattr(self, key):
                    raise ValueError(f"{type(self).__name__} has no {key!r} to restore")
                value = state[key]
                if type(value) is not int or value < 0:
                    raise ValueError(f"{type(self).__name__} state field {key!r} must be an int >= 0, "
                                     f"got {value!r}: load a state that state_dict() returned")
                values[key] = value
        for key, value in values.items():
            setattr(self, key, value)


def sampler_state(sampler: Any) -> Any:
    """state_dict() of any sampler; None for user samplers without one (they
    are then resumed by replaying and skipping)."""
    get = getattr(sampler, "state_dict", None)
    return get() if get is not None else None


def load_sampler_state(sampler: Any, state: Any) -> None:
    if state is None:
        return
    load = getattr(sampler, "load_state_dict", None)
    if load is None:
        raise ValueError(f"cannot restore the state of {type(sampler).__name__}: it has no load_state_dict()")
    load(state)


class SequentialSampler(Sampler):
    """Yields ``start, start + 1, ..., start + n - 1`` in order, every epoch.

    Args:
        n (int): the number of samples.
        start (int): the first index (Gluon 2.x). Default ``0``.

    Raises:
        ValueError: `n` or `start` is negative or not an integer.

    Example:
        >>> from mxload.sampler import SequentialSampler
        >>> list(SequentialSampler(4)), list(SequentialSampler(3, start=5))
        ([0, 1, 2, 3], [5, 6, 7])
    """

    def __init__(self, n: int, start: int = 0):
        self._n = check_int("n", n, 0)
        self._start = check_int("start", start, 0)

    def epoch_indices(self) -> IndexArray:
        return np.arange(self._start, self._start + self._n, dtype=np.int64)

    def _resize(self, n: int) -> None:
        # The loader's own sampler follows a dataset whose len() changed (torch's reads it each time).
        self._n = check_int("len(dataset)", n, 0)

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"SequentialSampler(n={self._n}" + (f", start={self._start})" if self._start else ")")


class IntervalSampler(Sampler):
    """Gluon's IntervalSampler: ``0, interval, 2 * interval, ...`` below
    `length`; with `rollover` then ``1, 1 + interval, ...`` and so on until
    every index was visited once.

    Args:
        length (int): the number of samples.
        interval (int): the step, in ``[1, length)``.
        rollover (bool): go on from the skipped indices. Default ``True``.

    Raises:
        ValueError: `interval` is out of range.

    Example:
        >>> from mxload.sampler import IntervalSampler
        >>> list(IntervalSampler(7, 3)), list(IntervalSampler(7, 3, rollover=False))
        ([0, 3, 6, 1, 4, 2, 5], [0, 3, 6])
    """

    def __init__(self, length: int, interval: int, rollover: bool = True):
        self._n = check_int("length", length, 0)
        self._interval = check_int("interval", interval)
        if not 0 < self._interval < self._n:
            raise ValueError(f"interval must be in [1, length) = [1, {self._n}), got {self._interval}")
        self._rollover = bool(rollover)

    def epoch_indices(self) -> IndexArray:
        starts = range(self._interval) if self._rollover else range(1)
        return np.concatenate([np.arange(s, self._n, self._interval, dtype=np.int64) for s in starts])

    def __len__(self) -> int:
        return self._n if self._rollover else -(-self._n // self._interval)

    def __repr__(self) -> str:
        return f"IntervalSampler(length={self._n}, interval={self._interval}, rollover={self._rollover})"


class FilterSampler(Sampler):
    """Gluon's FilterSampler: the indices of the samples of `dataset` for
    which ``fn(sample)`` is true (decided once, now), in order.

    Args:
        fn (callable): sample -> bool.
        dataset: a map-style dataset.

    Raises:
        TypeError: `fn` is not callable.

    Example:
        >>> from mxload.sampler import FilterSampler
        >>> list(FilterSampler(lambda x: x % 2 == 0, [5, 6, 7, 8]))
        [1, 3]
    """

    def __init__(self, fn: Any, dataset: Any):
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._indices = np.array([i for i in range(len(dataset)) if fn(dataset[i])], dtype=np.int64)

    def epoch_indices(self) -> IndexArray:
        return self._indices.copy()

    def __len__(self) -> int:
        return len(self._indices)

    def __repr__(self) -> str:
        return f"FilterSampler({len(self._indices)} indices)"


class RandomSampler(Sampler):
    """Yields a fresh permutation of ``range(n)`` every epoch.

    Epoch ``e`` uses ``np.random.default_rng([seed, e]).permutation(n)``, so a
    given (seed, epoch) pair always reproduces the same order.

    Args:
        n (int): the number of samples.
        seed (int | None): the permutations' seed; ``None`` (default) draws
            one at random, kept in ``.seed``.

    Raises:
        ValueError: `n` or `seed` is negative or not an integer.

    Example:
        >>> from mxload.sampler import RandomSampler
        >>> s = RandomSampler(5, seed=0)
        >>> first, second = list(s), list(s)
        >>> sorted(first), first == second
        ([0, 1, 2, 3, 4], False)
        >>> s.set_epoch(0); list(s) == first
        True
    """

    def __init__(self, n: int, seed: int | None = None):
        self._n = check_int("n", n, 0)
        fresh = seed is None
        self.seed = cast(int, np.random.SeedSequence().entropy) if fresh else check_int("seed", seed, 0)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next epoch use permutation number ``epoch``."""
        self.epoch = check_int("epoch", epoch, 0)

    def _resize(self, n: int) -> None:
        # The loader's own sampler follows a dataset whose len() changed (torch's reads it each time).
        self._n = check_int("len(dataset)", n, 0)

    def epoch_indices(self) -> IndexArray:
        indices = _permutation(self.seed, self.epoch, self._n)
        self.epoch += 1
        return indices

    def __len__(self) -> int:
        return self._n

    def __repr__(self) -> str:
        return f"RandomSampler(n={self._n}, seed={self.seed}, epoch={self.epoch})"


class BatchSampler(Sampler):
    """Groups a sampler's indices into batches: iterated, each batch is a
    list of ints, as Gluon 1.9's (``sum(list(bs), [])`` works); the loader
    takes them as 1-D ``np.int64`` arrays (:meth:`epoch_batches`).

    ``last_batch`` decides what happens to an incomplete final batch:
    ``"keep"`` yields it, ``"discard"`` drops it, ``"rollover"`` carries
    the leftover indices over and puts them first in the next epoch.

    Args:
        sampler: a :class:`Sampler` or any iterable of ints (e.g. a list; one
            without ``__len__``, an infinite one, is drawn as its batches are).
        batch_size (int): indices per batch.
        last_batch (str): ``"keep"`` (default), ``"discard"`` or ``"rollover"``.

    Raises:
        ValueError: `sampler` is None, `batch_size` is not a positive integer,
            or `last_batch` is not one of the three.

    Example:
        >>> from mxload.sampler import BatchSampler, SequentialSampler
        >>> list(BatchSampler(SequentialSampler(5), 2, "keep"))
        [[0, 1], [2, 3], [4]]
        >>> roll = BatchSampler(SequentialSampler(5), 2, "rollover")
        >>> list(roll), list(roll)
        ([[0, 1], [2, 3]], [[4, 0], [1, 2], [3, 4]])
    """

    def __init__(self, sampler: SizedIndices, batch_size: int, last_batch: str = "keep"):
        if sampler is None:
            raise ValueError("sampler must not be None")
        batch_size = check_int("batch_size", batch_size, 1)
        if not isinstance(last_batch, str) or last_batch not in _LAST_BATCH_MODES:
            raise ValueError(
                f"last_batch must be one of {', '.join(map(repr, _LAST_BATCH_MODES))}; "
                f"got {last_batch!r}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.last_batch = last_batch
        self._carry = np.empty(0, dtype=np.int64)
        # Rollover: what this epoch leaves over.  It becomes the carry only
        # when the epoch is consumed to its end (end_epoch), as in Gluon,
        # whose generator sets it after its last batch: an abandoned epoch
        # has used up the old carry and passes nothing on.
        self._pending: IndexArray | None = None
        # The epoch drawn as its batches are (batch_arrays): its leftovers, once drawn to its end.
        self._drawn: DrawnBatches | None = None

    def epoch_indices(self) -> IndexArray:
        """Return the flat indices covered by the next epoch's batches and advance.

        Batches are consecutive ``batch_size`` slices of this array; only the
        last one can be shorter (``last_batch="keep"``).
        """
        indices = _sampler_indices(self.sampler)
        if self.last_batch == "rollover":
            if self._carry.size:
                indices = np.concatenate((self._carry, indices))
            n_full = len(indices) // self.batch_size * self.batch_size
            self._carry = np.empty(0, dtype=np.int64)
            # Copy so the carry does not pin this whole epoch's buffer.
            self._pending = indices[n_full:].copy()
            return indices[:n_full]
        if self.last_batch == "discard":
            return indices[:len(indices) // self.batch_size * self.batch_size]
        return indices

    def state_dict(self) -> dict[str, Any]:
        """The rollover carry and the inner sampler's state: enough to rebuild
        the next epoch's batches exactly."""
        return {"carry": self._carry.tolist(), "sampler": sampler_state(self.sampler)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"BatchSampler state must be a dict from state_dict(), got {state!r}")
        carry = state.get("carry", [])
        if not isinstance(carry, list) or any(type(i) is not int or i < 0 for i in carry):
            raise ValueError(f"BatchSampler state field 'carry' must be a list of sample indices "
                             f"(ints >= 0), got {carry!r}: load a state that state_dict() returned")
        load_sampler_state(self.sampler, state.get("sampler"))
        self._carry = np.asarray(carry, dtype=np.int64)

    def end_epoch(self) -> None:
        """The epoch's batches were all consumed: its rollover leftovers open
        the next epoch (the loader calls this when the last batch is taken)."""
        drawn, self._drawn = self._drawn, None
        pending = drawn.rest if drawn is not None else self._pending
        self._pending = None
        if pending is not None:
            self._carry = pending

    def epoch_batches(self) -> list[IndexArray]:
        """Return the next epoch's batches as a list of int64 array views and advance."""
        return list(self.batch_arrays()[0])

    def batch_arrays(self, start: int = 0) -> tuple[Iterator[IndexArray], int | None]:
        """The next epoch's batches as 1-D int64 arrays, from batch `start` on, drawn as they are
        iterated, and how many the epoch has where known now (advances the epoch).

        mxload's samplers (and lists, ranges, arrays) give the epoch as one array, each batch
        a view of it; any other sampler is iterated as the batches need its indices (an
        infinite one works), with the count known only at its end."""
        if _drawn_whole(self.sampler):
            self._drawn = None
            indices = self.epoch_indices()
            return _slices(indices, self.batch_size, start), -(-len(indices) // self.batch_size)
        carry, self._carry = self._carry, np.empty(0, dtype=np.int64)
        self._pending = None
        # (Compiled: a signal handler's exception raised in mxload's code never lands in a draw.)
        self._drawn = batches = DrawnBatches(iter(self.sampler), self.batch_size, carry, self.last_batch)
        return (itertools.islice(batches, start, None) if start else batches), None

    def __iter__(self) -> Iterator[list[int]]:
        # The epoch advances on iter(); the rollover carry is passed on
        # only if the iteration runs to its end.
        return self._consume(self.batch_arrays()[0])

    def _consume(self, batches: Iterator[IndexArray]) -> Iterator[list[int]]:
        for batch in batches:
            yield batch.tolist()
        self.end_epoch()

    def __len__(self) -> int:
        n = len(self.sampler)
        if self.last_batch == "keep":
            return -(-n // self.batch_size)
        if self.last_batch == "discard":
            return n // self.batch_size
        return (len(self._carry) + n) // self.batch_size

    def __repr__(self) -> str:
        return (f"BatchSampler({self.sampler!r}, batch_size={self.batch_size}, "
                f"last_batch={self.last_batch!r})")


class DistributedSampler(Sampler):
    """Gives each of ``num_replicas`` ranks its own shard of ``range(n)``.

    Follows PyTorch's ``DistributedSampler``: all ranks shuffle with the same
    (seed, epoch) permutation ``np.random.default_rng([seed, epoch])
    .permutation(n)`` (or ``arange(n)`` with ``shuffle=False``) and rank ``r``
    takes ``indices[r::R]`` of it.

    * ``drop_last=False`` (default): the list is padded to
      ``total_size = ceil(n / R) * R`` by repeating indices from its start
      (cyclically, if the padding is longer than ``n``), so every rank gets
      ``ceil(n / R)`` indices.  The union of the shards is all of
      ``range(n)``; the shards are disjoint except for the
      ``total_size - n`` padding entries, which repeat the first indices of
      the epoch's order.
    * ``drop_last=True``: the last ``n % R`` indices of the order are dropped,
      every rank gets ``floor(n / R)`` and the shards are disjoint.

    Either way every rank gets the same number of indices, hence (with the
    same ``batch_size`` and ``last_batch``) the same number of batches, which
    collective ops in the training step need.

    ``num_replicas`` / ``rank``, when not given, come from the first of:
    torch's default process group (only if ``torch.distributed`` is already
    imported and ``is_available() and is_initialized()``; torch is never
    imported by mxload), the ``WORLD_SIZE`` / ``RANK`` environment variables
    (set by ``torchrun``), else 1 / 0.  They are read once, in ``__init__``.

    Epochs: like :class:`RandomSampler`, the epoch also advances by itself
    after each epoch (a deviation from PyTorch, whose sampler repeats epoch 0
    until ``set_epoch`` is called).  Calling ``set_epoch(e)`` before each
    epoch, with the same ``e`` on every rank -- PyTorch's idiom, e.g.
    ``loader.sampler.set_epoch(e)`` -- gives exactly PyTorch's behaviour; the
    loader draws an epoch's indices when it is iterated (``iter(loader)``),
    so ``set_epoch`` must come before the ``for`` loop.

    Args:
        n (int): the data set's size.
        num_replicas (int | None): the number of ranks (world size).
        rank (int | None): this rank, 0 .. num_replicas - 1.
        shuffle (bool): a seeded permutation per epoch (default ``True``).
        seed (int): the permutations' seed, the same on every rank. Default ``0``.
        drop_last (bool): drop the tail instead of padding. Default ``False``.

    Raises:
        ValueError: a negative or non-integer argument, or `rank` outside
            ``[0, num_replicas)`` (naming ``RANK``/``WORLD_SIZE`` when they
            came from there).

    Example:
        >>> from mxload.sampler import DistributedSampler
        >>> [list(DistributedSampler(5, num_replicas=2, rank=r, shuffle=False)) for r in (0, 1)]
        [[0, 2, 4], [1, 3, 0]]
        >>> [list(DistributedSampler(5, 2, r, shuffle=False, drop_last=True)) for r in (0, 1)]
        [[0, 2], [1, 3]]
    """

    def __init__(self, n: int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        self._n = check_int("n", n, 0)
        group = torch_process_group() if num_replicas is None or rank is None else None
        # Name where a bad value came from, so a broken launcher env is obvious.
        if num_replicas is not None:
            num_replicas = check_int("num_replicas", num_replicas)
            r_src = ""
        elif group is not None:
            num_replicas = group[0]
            r_src = " (from torch.distributed)"
        else:
            num_replicas = _int_from_env("WORLD_SIZE", 1)
            r_src = " (from WORLD_SIZE)" if "WORLD_SIZE" in os.environ else ""
        if num_replicas < 1:
            raise ValueError(f"num_replicas{r_src} must be >= 1, got {num_replicas}")
        if rank is None and group is not None:
            rank = group[1]
            k_src = " (from torch.distributed)"
        elif rank is None:
            rank = _int_from_env("RANK", 0)
            k_src = " (from RANK)" if "RANK" in os.environ else ""
        else:
            rank = check_int("rank", rank)
            k_src = ""
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank{k_src} must be in [0, {num_replicas}) for "
                f"num_replicas={num_replicas}, got rank={rank}")
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = check_int("seed", seed, 0)  # SeedSequence takes no negative entropy
        self.drop_last = bool(drop_last)
        self.epoch = 0
        if self.drop_last:
            self.num_samples = self._n // num_replicas
        else:
            self.num_samples = -(-self._n // num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Make the next epoch use permutation number ``epoch``.

        Call it with the same value on every rank, before iterating the loader
        (which draws the epoch's indices in ``iter()``).  The epoch then
        advances by one after each epoch, as without ``set_epoch``.
        """
        self.epoch = check_int("epoch", epoch, 0)

    def epoch_indices(self) -> IndexArray:
        if self.shuffle:
            indices = _permutation(self.seed, self.epoch, self._n)
        else:
            indices = np.arange(self._n, dtype=np.int64)
        self.epoch += 1
        if self.drop_last:
            indices = indices[:self.total_size]
        elif self.total_size > self._n:
            # np.resize repeats the array cyclically, which matches PyTorch's
            # padding even when the padding is longer than the dataset.
            indices = np.resize(indices, self.total_size)
        return np.ascontiguousarray(indices[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"DistributedSampler(n={self._n}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last})")


@dataclass(frozen=True)
class EpochBatches:
    """An epoch's batches of indices, drawn from its batch sampler as they are iterated.

    Args:
        batches: the batches (1-D int64 arrays, or encoded keys), from the first one asked for on.
        total: how many the epoch has, where known before it is drawn (mxload's samplers).
        expected: what the batch sampler's len() says (None: it has none, or refuses).
        what: the sampler, in words, for its errors.
    """
    batches: Iterator[Any]
    total: int | None
    expected: int | None
    what: str


def epoch_batches(batch_sampler: Any, start: int = 0) -> EpochBatches:
    """The next epoch's batches of indices from `batch_sampler` (advancing its epoch: it is
    iterated now), from batch `start` on (a resumed epoch), each checked to be a 1-D sequence
    of integers as it is drawn."""
    expected = _length(batch_sampler)   # before it is iterated (its length may change with its epoch)
    if type(batch_sampler) is BatchSampler:
        batches, total = batch_sampler.batch_arrays(start)   # checked as a whole, or as drawn
        what = f"the sampler {type(batch_sampler.sampler).__name__}"
    else:
        draw: Any = getattr(batch_sampler, "epoch_batches", None)   # (a subclass of mxload's)
        raw = iter(draw()) if draw is not None else iter(batch_sampler)
        batches = CheckedBatches(itertools.islice(raw, start, None) if start else raw, batch_sampler_indices,
                                 start)
        total, what = None, f"the batch sampler {type(batch_sampler).__name__}"
    return EpochBatches(batches, total, total if total is not None else expected, what)


def epoch_keys(sampler: Any, start: int = 0) -> EpochBatches:
    """batch_size=None: the next epoch's batches, one per key `sampler` yields, from batch
    `start` on, drawn as they are iterated."""
    expected = _length(sampler)
    total: int | None = None
    # (A list may hold keys that are no integers: taken one by one.)
    if getattr(sampler, "epoch_indices", None) is not None or isinstance(sampler, np.ndarray):
        indices = _sampler_indices(sampler)
        batches: Iterator[Any] = _slices(indices, 1, start)
        total = len(indices)
    else:
        keys = iter(sampler)
        batches = CheckedBatches(itertools.islice(keys, start, None) if start else keys, _key_batch, start)
    return EpochBatches(batches, total, total if total is not None else expected,
                        f"the sampler {type(sampler).__name__}")


def _length(obj: Any) -> int | None:
    """len(obj), or None where it has none (an infinite sampler) or refuses."""
    try:
        return len(obj)
    except TypeError:
        return None
