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
from .batchify import GatheredSamples

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
    """Base class of map-style datasets: implement ``__getitem__`` and ``__len__``."""

    def __getitem__(self, idx: int) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def transform(self, fn: Callable[..., Any], lazy: bool = True) -> Dataset:
        """Return a dataset whose samples are ``fn(sample)``.

        Tuple samples are unpacked: ``fn(*sample)``.  With ``lazy=True`` fn is
        applied on access; with ``lazy=False`` every sample is transformed now
        and the result is a :class:`SimpleDataset`.
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
        """Like :meth:`transform` but only the first element of each tuple sample is passed to fn."""
        _check_fn(fn)
        return self.transform(_TransformFirstClosure(fn), lazy)


class SimpleDataset(Dataset):
    """Wraps any sequence (list, tuple, numpy array, ...) as a dataset."""

    def __init__(self, data: Any):
        if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise TypeError(
                f"SimpleDataset needs a sequence with __getitem__ and __len__, "
                f"got {type(data).__name__}")
        self._data = data

    def __getitem__(self, idx: Any) -> Any:
        return self._data[idx]

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
    than wrapped because they almost always mean a sampler bug.
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

    def _check_index(self, idx: SupportsIndex) -> int:
        try:
            idx = operator.index(idx)
        except TypeError:
            raise TypeError(
                f"ArrayDataset index must be an integer, got {type(idx).__name__}") from None
        if not 0 <= idx < self._length:
            raise IndexError(
                f"index {idx} is out of range for ArrayDataset of length {self._length}")
        return idx

    def __getitem__(self, idx: SupportsIndex) -> Any:
        idx = self._check_index(idx)
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

    Not a :class:`Dataset` subclass: it has no random access.  The loader
    splits the stream among workers.
    """

    def __iter__(self) -> Iterator[Any]:
        raise NotImplementedError

    def transform(self, fn: Callable[..., Any], lazy: bool = True) -> IterableDataset:
        """Return an iterable dataset yielding ``fn(sample)`` (``fn(*sample)`` for tuples).

        Only ``lazy=True`` is supported: a stream may be endless or single-pass,
        so it cannot be materialised up front.
        """
        _check_fn(fn)
        if not lazy:
            raise ValueError("IterableDataset.transform supports only lazy=True")
        if hasattr(self, "__len__"):
            return _SizedLazyTransformIterableDataset(self, fn)
        return _LazyTransformIterableDataset(self, fn)

    def transform_first(self, fn: Callable[..., Any], lazy: bool = True) -> IterableDataset:
        """Like :meth:`transform` but only the first element of each tuple sample is passed to fn."""
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
