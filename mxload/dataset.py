"""Datasets with Gluon semantics.

Map-style datasets (:class:`Dataset`) implement ``__getitem__`` and
``__len__``; they may also implement ``__getitems__(indices)`` to fetch a
whole batch at once, which the loader prefers when present.
:class:`IterableDataset` is the stream-style counterpart (``__iter__`` only).

Every class here stores only its data and the user's function, so instances
pickle whenever those do (needed for spawn-based workers).
"""
from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any, SupportsIndex

import numpy as np

from . import _rng
from ._collate.gathered import GatheredSamples

__all__ = [
    "Dataset",
    "SimpleDataset",
    "ArrayDataset",
    "IterableDataset",
]


def _apply(fn: Callable[..., Any], sample: Any) -> Any:
    # Gluon unpacks tuple samples into positional arguments.
    if isinstance(sample, tuple):
        return fn(*sample)
    return fn(sample)


class _TransformFirstClosure:
    """Applies ``fn`` to the first element of a tuple sample only.

    A class rather than a closure so that it pickles.
    """

    def __init__(self, fn: Callable[..., Any]):
        self._fn = fn

    def __call__(self, x: Any, *args: Any) -> Any:
        if args:
            return (self._fn(x),) + args
        return self._fn(x)


def _check_fn(fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")


class Dataset:
    """Base class of map-style datasets: implement ``__getitem__`` and ``__len__``.

    Optionally implement ``__getitems__(indices)`` to fetch a whole batch at
    once (the loader calls it instead of ``__getitem__`` per sample, with a
    list of Python ints, as torch does).  Any
    object with ``__getitem__`` and ``__len__`` works as a dataset; this base
    class adds :meth:`transform` and :meth:`transform_first`.  Subclasses are
    defined at module level so that spawn workers can pickle them.

    Example:
        >>> import numpy as np, mxload
        >>> class Squares(mxload.Dataset):
        ...     def __len__(self):
        ...         return 4
        ...     def __getitem__(self, i):
        ...         return np.float32(i * i)
        >>> [b.tolist() for b in mxload.DataLoader(Squares(), batch_size=2)]
        [[0.0, 1.0], [4.0, 9.0]]
    """

    def __getitem__(self, idx: int) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def transform(self, fn: Callable[..., Any], lazy: bool = True) -> Dataset:
        """Return a dataset whose samples are ``fn(sample)``.

        Args:
            fn (callable): applied to each sample; tuple samples are unpacked
                (``fn(*sample)``).  Inside it, :func:`mxload.sample_rng` gives
                the sample's own random stream.
            lazy (bool): ``True`` (default) applies `fn` on access; ``False``
                transforms every sample now and returns a :class:`SimpleDataset`.

        Returns:
            Dataset: the transformed dataset (keeps ``__getitems__`` if this one has it).

        Raises:
            TypeError: `fn` is not callable.

        Example:
            >>> import mxload
            >>> ds = mxload.SimpleDataset([1, 2, 3]).transform(lambda x: x * 10)
            >>> ds[2]
            30
        """
        _check_fn(fn)
        trans: _LazyTransformDataset
        if hasattr(self, "__getitems__"):
            trans = _LazyTransformBatchDataset(self, fn)
        else:
            trans = _LazyTransformDataset(self, fn)
        if lazy:
            return trans
        return SimpleDataset([trans[i] for i in range(len(trans))])

    def transform_first(self, fn: Callable[..., Any], lazy: bool = True) -> Dataset:
        """Like :meth:`transform`, but `fn` gets only the first element of each
        tuple sample (the image of an (image, label) pair); the rest pass through.

        Args:
            fn (callable): applied to the first element.
            lazy (bool): as in :meth:`transform`. Default ``True``.

        Returns:
            Dataset: the transformed dataset.

        Raises:
            TypeError: `fn` is not callable.

        Example:
            >>> import numpy as np, mxload
            >>> ds = mxload.ArrayDataset([1, 2], ["cat", "dog"])
            >>> ds.transform_first(lambda x: x * 10)[1]
            (20, 'dog')
        """
        _check_fn(fn)
        return self.transform(_TransformFirstClosure(fn), lazy)

    def filter(self, fn: Callable[[Any], Any]) -> Dataset:
        """A dataset of the samples for which ``fn(sample)`` is true (Gluon's
        ``Dataset.filter``).  Every sample is read once now to decide; on a
        lazily transformed dataset fn sees the transformed samples.

        Example:
            >>> from mxload import SimpleDataset
            >>> evens = SimpleDataset(list(range(10))).filter(lambda x: x % 2 == 0)
            >>> len(evens), evens[4]
            (5, 8)
        """
        _check_fn(fn)
        keep = [i for i in range(len(self)) if fn(self[i])]
        return self.sample(keep)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Part `index` of `num_shards` contiguous parts of this dataset (Gluon's
        ``Dataset.shard``): the first ``len % num_shards`` parts get one sample
        more.  Shard before shuffling so each part is a distinct subset.

        Example:
            >>> from mxload import SimpleDataset
            >>> ds = SimpleDataset(list(range(9)))
            >>> [len(ds.shard(4, i)) for i in range(4)], ds.shard(4, 3)[0]
            ([3, 2, 2, 2], 7)
        """
        num_shards = _as_index(num_shards, "num_shards")
        index = _as_index(index, "index")
        if num_shards < 1:
            raise ValueError(f"num_shards must be a positive integer, got {num_shards}")
        if not 0 <= index < num_shards:
            raise ValueError(f"shard index {index} is out of range for num_shards={num_shards}")
        size, rest = divmod(len(self), num_shards)
        start = size * index + min(index, rest)
        return self.sample(range(start, start + size + (index < rest)))

    def take(self, count: int | None) -> Dataset:
        """The first `count` samples (all of them when count is None or larger
        than the dataset), as Gluon's ``Dataset.take``.

        Example:
            >>> from mxload import SimpleDataset
            >>> len(SimpleDataset(list(range(100))).take(10)), len(SimpleDataset([1, 2]).take(None))
            (10, 2)
        """
        n = len(self)
        if count is not None:
            count = _as_index(count, "count")
            if count < 0:
                raise ValueError(f"count must be a non-negative integer or None, got {count}")
        return self.sample(range(n if count is None else min(count, n)))

    def sample(self, sampler: Any) -> Dataset:
        """A dataset of the samples at the indices `sampler` yields (a sampler
        or any iterable of indices), in that order (Gluon's ``Dataset.sample``).

        Example:
            >>> from mxload import SimpleDataset
            >>> picked = SimpleDataset(["a", "b", "c"]).sample([2, 0])
            >>> [picked[i] for i in range(len(picked))]
            ['c', 'a']
        """
        indices = np.fromiter((operator.index(i) for i in sampler), dtype=np.int64)
        n = len(self)
        bad = (indices < 0) | (indices >= n)
        if bad.any():
            raise IndexError(f"index {int(indices[np.flatnonzero(bad)[0]])} is out of range for a dataset "
                             f"of length {n}")
        if hasattr(self, "__getitems__"):
            return _SampledBatchDataset(self, indices)
        return _SampledDataset(self, indices)


def _as_index(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


class _SampledDataset(Dataset):
    """The samples of `data` at `indices` (an int64 array), in that order."""

    def __init__(self, data: Any, indices: np.ndarray):
        self._data = data
        self._indices = indices

    def __getitem__(self, idx: SupportsIndex) -> Any:
        i = operator.index(idx)
        if not 0 <= i < len(self._indices):
            raise IndexError(f"index {i} is out of range for a dataset of length {len(self._indices)}")
        return self._data[int(self._indices[i])]

    def __len__(self) -> int:
        return len(self._indices)

    def __repr__(self) -> str:
        return f"{type(self._data).__name__}[{len(self._indices)} of {len(self._data)} samples]"


class _SampledBatchDataset(_SampledDataset):
    # A separate class so that __getitems__ exists only when `data` has one.
    def __getitems__(self, indices: Any) -> Any:
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self._indices)):
            bad = int(idx[(idx < 0) | (idx >= len(self._indices))][0])
            raise IndexError(f"index {bad} is out of range for a dataset of length {len(self._indices)}")
        keys = self._indices[idx]
        return self._data.__getitems__(keys if takes_index_arrays(self._data) else keys.tolist())


def takes_index_arrays(dataset: Any) -> bool:
    """Whether `dataset`'s ``__getitems__`` is one of mxload's that gather with numpy and take
    the batch's int64 index array as it is; any other gets a list of Python ints, as torch
    passes them (what a dataset written for torch expects)."""
    return getattr(type(dataset), "__getitems__", None) in _ARRAY_GETITEMS


def _check_index(dataset: Dataset, idx: SupportsIndex, length: int) -> int:
    """`idx` as an int in [0, length).  Negative indices are rejected rather
    than wrapped, in every dataset here: samplers only produce [0, len), so
    one almost always means a sampler bug."""
    name = type(dataset).__name__
    try:
        i = operator.index(idx)
    except TypeError:
        raise TypeError(f"{name} index must be an integer, got {type(idx).__name__}") from None
    if not 0 <= i < length:
        raise IndexError(f"index {i} is out of range for {name} of length {length}")
    return i


class SimpleDataset(Dataset):
    """Wraps any sequence (list, tuple, numpy array, ...) as a dataset.

    Indices must lie in ``[0, len)``, as for :class:`ArrayDataset`.

    Args:
        data: anything with ``__getitem__`` and ``__len__``.

    Raises:
        TypeError: `data` is not a sequence.

    Example:
        >>> import mxload
        >>> ds = mxload.SimpleDataset(["a", "b", "c"])
        >>> len(ds), ds[1]
        (3, 'b')
    """

    def __init__(self, data: Any):
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise TypeError(
                f"SimpleDataset needs a sequence with __getitem__ and __len__, "
                f"got {type(data).__name__}")
        self._data = data

    def __getitem__(self, idx: SupportsIndex) -> Any:
        return self._data[_check_index(self, idx, len(self._data))]

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"SimpleDataset(len={len(self)})"


class _LazyTransformDataset(Dataset):
    """Applies ``fn`` to each sample of ``data`` on access."""

    def __init__(self, data: Any, fn: Callable[..., Any]):
        self._data = data
        self._fn = fn

    def __getitem__(self, idx: Any) -> Any:
        return _apply(self._fn, self._data[idx])

    def __len__(self) -> int:
        return len(self._data)


class _LazyTransformBatchDataset(_LazyTransformDataset):
    """Lazy transform over a dataset that supports ``__getitems__``.

    A separate class so that ``hasattr(ds, "__getitems__")`` stays truthful
    for wrapped datasets without batch fetching.
    """

    def __getitems__(self, indices: Any) -> list[Any]:
        fn = self._fn
        samples = self._data.__getitems__(indices)
        out = []
        # The transform sees one sample at a time: give it that sample's
        # sample_rng() stream, as __getitem__ would.
        for i, s in zip(np.asarray(indices).tolist(), samples):
            with _rng.sample_scope(i):
                out.append(_apply(fn, s))
        return out


class ArrayDataset(Dataset):
    """Zips equally long arrays/sequences: ``ds[i] == (a[i], b[i], ...)``.

    With a single argument ``ds[i]`` is just ``a[i]`` (as in Gluon).
    Indices must lie in ``[0, len)``; negative indices are rejected rather
    than wrapped because they almost always mean a sampler bug.  Its
    ``__getitems__`` gathers a whole batch with one ``np.take`` per column,
    straight into the batch buffer: the fastest way to load in-memory arrays.

    Args:
        *args: one or more arrays or sequences of the same length.

    Raises:
        ValueError: no argument, or the lengths differ (the message names them).
        TypeError: an argument is not an array or sequence.

    Example:
        >>> import numpy as np, mxload
        >>> ds = mxload.ArrayDataset(np.zeros((3, 2), np.float32), np.array([5, 6, 7]))
        >>> x, y = ds[2]
        >>> x.shape, int(y)
        ((2,), 7)
        >>> [y.tolist() for x, y in mxload.DataLoader(ds, batch_size=2)]
        [[5, 6], [7]]
    """

    def __init__(self, *args: Any):
        if not args:
            raise ValueError("ArrayDataset needs at least one array")
        for i, a in enumerate(args):
            if not (hasattr(a, "__getitem__") and hasattr(a, "__len__")):
                raise TypeError(
                    f"ArrayDataset argument {i} must be an array or sequence, "
                    f"got {type(a).__name__}")
        self._length = len(args[0])
        for i, a in enumerate(args[1:], 1):
            if len(a) != self._length:
                raise ValueError(
                    f"All arrays must have the same length; argument 0 has length "
                    f"{self._length} while argument {i} has length {len(a)}")
        self._data = args

    def __getitem__(self, idx: SupportsIndex) -> Any:
        idx = _check_index(self, idx, self._length)
        if len(self._data) == 1:
            return self._data[0][idx]
        return tuple(a[idx] for a in self._data)

    def __getitems__(self, indices: Any) -> list[Any] | GatheredSamples:
        """Return ``[self[i] for i in indices]``, gathering numpy columns in one step."""
        idx = np.asarray(indices)
        if idx.size == 0:
            return []
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise TypeError(
                f"indices must be a 1-D sequence of integers, got dtype {idx.dtype} "
                f"and shape {idx.shape}")
        bad = (idx < 0) | (idx >= self._length)
        if bad.any():
            raise IndexError(
                f"index {int(idx[np.flatnonzero(bad)[0]])} is out of range for ArrayDataset "
                f"of length {self._length}")
        if all(isinstance(a, np.ndarray) for a in self._data):
            # Keep the gathered columns: default collation copies each one
            # once instead of splitting it into samples and stacking again.
            return GatheredSamples(self._data, idx.astype(np.int64, copy=False), single=len(self._data) == 1)
        columns = []
        for a in self._data:
            if isinstance(a, np.ndarray):
                # One fancy-index per column; iterating the result then yields
                # the same per-sample types a[i] would (scalars or row views).
                columns.append(list(a[idx]))
            else:
                columns.append([a[i] for i in idx.tolist()])
        if len(columns) == 1:
            return columns[0]
        return list(zip(*columns))

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return f"ArrayDataset(len={self._length}, arrays={len(self._data)})"


class IterableDataset:
    """Base class of stream-style datasets: implement ``__iter__``.

    Not a :class:`Dataset` subclass: it has no random access.  Each worker
    iterates its own copy of the dataset: shard the stream with
    :func:`mxload.get_worker_info` (as with PyTorch), or every worker yields
    every sample.  An optional ``__len__`` gives the loader a length.

    Example:
        >>> import mxload
        >>> class Stream(mxload.IterableDataset):
        ...     def __iter__(self):
        ...         info = mxload.get_worker_info()
        ...         start, step = (0, 1) if info is None else (info.id, info.num_workers)
        ...         return iter(range(start, 6, step))
        >>> [b.tolist() for b in mxload.DataLoader(Stream(), batch_size=3)]
        [[0, 1, 2], [3, 4, 5]]
    """

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError

    def transform(self, fn: Callable[..., Any], lazy: bool = True) -> IterableDataset:
        """Return an iterable dataset yielding ``fn(sample)`` (``fn(*sample)`` for tuples).

        Args:
            fn (callable): applied to each sample as it streams.
            lazy (bool): must be ``True`` (default): a stream may be endless or
                single-pass, so it cannot be materialised up front.

        Returns:
            IterableDataset: the transformed stream.

        Raises:
            TypeError: `fn` is not callable.
            ValueError: ``lazy=False``.

        Example:
            >>> import mxload
            >>> class Three(mxload.IterableDataset):
            ...     def __iter__(self):
            ...         return iter([1, 2, 3])
            >>> list(Three().transform(lambda x: -x))
            [-1, -2, -3]
        """
        _check_fn(fn)
        if not lazy:
            raise ValueError("IterableDataset.transform supports only lazy=True")
        if hasattr(self, "__len__"):
            return _SizedLazyTransformIterableDataset(self, fn)
        return _LazyTransformIterableDataset(self, fn)

    def transform_first(self, fn: Callable[..., Any], lazy: bool = True) -> IterableDataset:
        """Like :meth:`transform`, but `fn` gets only the first element of each tuple sample.

        Args:
            fn (callable): applied to the first element.
            lazy (bool): must be ``True`` (default).

        Returns:
            IterableDataset: the transformed stream.

        Raises:
            TypeError: `fn` is not callable.
            ValueError: ``lazy=False``.

        Example:
            >>> import mxload
            >>> class Pairs(mxload.IterableDataset):
            ...     def __iter__(self):
            ...         return iter([(1, "a"), (2, "b")])
            >>> list(Pairs().transform_first(lambda x: x + 100))
            [(101, 'a'), (102, 'b')]
        """
        _check_fn(fn)
        return self.transform(_TransformFirstClosure(fn), lazy)


class _LazyTransformIterableDataset(IterableDataset):
    def __init__(self, data: Any, fn: Callable[..., Any]):
        self._data = data
        self._fn = fn

    def __iter__(self) -> Iterator[Any]:
        fn = self._fn
        for sample in self._data:
            yield _apply(fn, sample)


class _SizedLazyTransformIterableDataset(_LazyTransformIterableDataset):
    # Separate class so __len__ exists only when the wrapped stream has one.
    def __len__(self) -> int:
        return len(self._data)


# The __getitems__ of mxload's datasets that take the int64 index array (see takes_index_arrays;
# a subclass that overrides __getitems__ gets a list, as torch passes it).
_ARRAY_GETITEMS = frozenset((ArrayDataset.__getitems__, _SampledBatchDataset.__getitems__))
