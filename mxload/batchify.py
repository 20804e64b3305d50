"""Batchify functions: turn a list of samples into one batch.

Every built-in batchify works in two steps so a whole batch is one buffer:

1. *plan*: walk the samples' structure, validate every field (the Cython
   ``stack_check``/``pad_check``), and record each batched field (kernel,
   inputs, output shape and dtype) in a :class:`BatchPlan`.  The Cython layout
   planner then places all fields in one 64-byte aligned buffer.
2. *fill*: run the Cython kernels (GIL released) into a caller-provided
   buffer: a private allocation in-process, a shared-memory slab in a worker.

A plan's ``layout`` (structure + offsets/shapes/dtypes, no data) is what a
worker sends to the main process, which rebuilds the batch as numpy views over
the same slab without copying.

Structure nodes (small tuples, cheap to pickle):
``("f", i)`` field i; ``("t", kind, children)`` a tuple (kind None), list
(kind list) or namedtuple (kind = its class); ``("d", keys, children)`` a dict;
``("s", template, children)`` / ``("m", template, keys, children)`` a
sequence / mapping of another type (rebuilt from an emptied copy of sample 0,
or its type), as torch's default_collate keeps them; ``("o", value)`` a
Python object passed through as is.
"""
from __future__ import annotations

import copy
import math
import operator
import pickle
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

import numpy as np

from . import _core
from ._torch_compat import is_tensor, tensor_to_numpy

__all__ = [
    "Batchify", "Stack", "Pad", "Tuple", "Group", "Dict", "List", "AsList", "Append",
    "default_batchify", "default_convert", "BatchPlan", "plan_batch", "collate", "GatheredSamples",
]

_SCALAR_TYPES = (bool, int, float, complex, np.generic)


class _Field:
    """One batched array of the plan."""

    __slots__ = ("path", "kernel", "arrays", "shape", "dtype", "axis", "pattern", "nbytes")

    def __init__(self, path: str, kernel: str, arrays: Any, shape: tuple[Any, ...], dtype: np.dtype,
                 axis: int = 0, pattern: bytes = b""):
        self.path = path
        self.kernel = kernel        # "stack" | "pad" | "copy" | "take"
        self.arrays = arrays        # samples' arrays; one array ("copy"); (source, indices) ("take")
        self.shape = shape
        self.dtype = dtype
        self.axis = axis
        self.pattern = pattern
        self.nbytes = math.prod(shape) * dtype.itemsize


class _Planner:
    """Collects the fields of one batch while its structure is walked."""

    __slots__ = ("fields", "objects", "batch_index")

    def __init__(self, batch_index: int | None):
        self.fields: list[_Field] = []
        self.objects: list[tuple[str, Any]] = []   # (path, value) passed through as objects
        self.batch_index = batch_index

    def add(self, field: _Field) -> tuple[str, int]:
        self.fields.append(field)
        return ("f", len(self.fields) - 1)

    def add_object(self, path: str, value: Any) -> tuple[str, Any]:
        self.objects.append((path, value))
        return ("o", value)

    def error(self, exc_type: type[Exception], path: str, message: str) -> Exception:
        where = f"batch {self.batch_index}, " if self.batch_index is not None else ""
        return exc_type(f"cannot collate {where}field {path}: {message}")


class BatchPlan:
    """A planned batch: its structure, its fields and their place in one buffer.

    Made by :func:`plan_batch`; the loader's workers fill it into a
    shared-memory slab.  ``nbytes`` is the buffer size it needs.

    Args:
        root (tuple): the batch's structure node.
        fields (list): the planned fields.
        objects (list): (path, value) of Python objects passed through.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import Stack, plan_batch
        >>> plan = plan_batch(Stack(), [np.zeros(3, np.float32)] * 4)
        >>> plan.nbytes >= 4 * 3 * 4
        True
    """

    __slots__ = ("root", "fields", "objects", "offsets", "nbytes")

    def __init__(self, root: tuple[Any, ...], fields: list[_Field], objects: list[tuple[str, Any]]):
        self.root = root
        self.fields = fields
        self.objects = objects
        offsets, total = _core.plan_layout([f.nbytes for f in fields])
        self.offsets = offsets.tolist()
        self.nbytes = int(total)

    def fill(self, buffer: Any, base_offset: int = 0) -> tuple[list[Any], list[Any]]:
        """Collate every field into `buffer` (anything exporting a writable
        buffer) starting at `base_offset`.  Returns (views, per-field ns)."""
        views = []
        times = []
        for field, off in zip(self.fields, self.offsets):
            out = np.ndarray(field.shape, field.dtype, buffer=buffer, offset=base_offset + off)
            if field.kernel == "stack":
                ns = _core.stack_fill(field.arrays, out)
            elif field.kernel == "pad":
                ns = _core.pad_fill(field.arrays, out, field.axis, field.pattern)
            elif field.kernel == "padn":
                ns = _pad_every_axis(field.arrays, out, field.pattern)
            elif field.kernel == "take":
                source, indices = field.arrays
                t0 = time.perf_counter_ns()
                # mode="clip": the indices are validated, and an unbuffered
                # take writes straight into the batch buffer.
                np.take(source, indices, axis=0, out=out, mode="clip")
                ns = time.perf_counter_ns() - t0
            else:
                ns = _core.copy_into(field.arrays, out)
            views.append(out)
            times.append(ns)
        return views, times

    def layout(self) -> tuple[Any, ...]:
        """Picklable description of the batch: structure + (offset, shape, dtype) per field."""
        # dtype strings pickle far smaller/faster than dtype objects; structured ones stay objects.
        return (self.root, [(o, f.shape, f.dtype.str if f.dtype.fields is None else f.dtype)
                            for f, o in zip(self.fields, self.offsets)])

    def field_stats(self, fill_ns: Sequence[int]) -> tuple[list[Any], list[Any]]:
        """Per-field records for the profiler: ([(path, kernel, nbytes, shape,
        dtype)], [ns]) for the kernel fields (with their `fill_ns`) and the
        objects passed through, which cross processes pickled: their pickling
        is measured here, so this costs something and runs only when profiling."""
        stats = [(f.path, f.kernel, f.nbytes, f.shape, f.dtype.str) for f in self.fields]
        times = list(fill_ns)
        for path, value in self.objects:
            t0 = time.perf_counter_ns()
            try:
                size = len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception:
                size = 0
            times.append(time.perf_counter_ns() - t0)
            stats.append((path, "pickled", size, (), type(value).__name__))
        return stats, times


def assemble(node: tuple[Any, ...], arrays: Sequence[Any]) -> Any:
    """Rebuild a batch's structure from a plan node and its field arrays."""
    tag = node[0]
    if tag == "f":
        return arrays[node[1]]
    if tag == "t":
        kind, children = node[1], node[2]
        items = [assemble(c, arrays) for c in children]
        if kind is None:
            return tuple(items)
        if kind is list:
            return items
        return kind(*items)  # namedtuple
    if tag == "d":
        return {k: assemble(c, arrays) for k, c in zip(node[1], node[2])}
    if tag == "s":
        return _rebuild_sequence(node[1], [assemble(c, arrays) for c in node[2]])
    if tag == "m":
        return _rebuild_mapping(node[1], {k: assemble(c, arrays) for k, c in zip(node[2], node[3])})
    return node[1]


def _rebuild_sequence(template: Any, items: list[Any]) -> Any:
    if isinstance(template, type):
        return template(items)
    clone = copy.copy(template)
    for i, item in enumerate(items):
        clone[i] = item
    return clone


def _rebuild_mapping(template: Any, items: dict[Any, Any]) -> Any:
    if isinstance(template, type):
        return template(items)
    clone = copy.copy(template)
    clone.update(items)
    return clone


def _pad_every_axis(arrays: list[np.ndarray], out: np.ndarray, pattern: bytes) -> int:
    """The "padn" kernel: samples ragged along several axes, each copied into
    the corner of its row of `out`, the rest filled with the pad value."""
    t0 = time.perf_counter_ns()
    out[...] = np.frombuffer(pattern, out.dtype)[0]
    for i, a in enumerate(arrays):
        out[(i,) + tuple(slice(0, n) for n in a.shape)] = a
    return time.perf_counter_ns() - t0


def views_from_layout(layout: tuple[Any, ...], buffer: Any, base_offset: int = 0) -> Any:
    """The batch a layout describes, as numpy views over `buffer` (no copy)."""
    root, specs = layout
    arrays = [np.ndarray(shape, dtype, buffer=buffer, offset=base_offset + off)
              for off, shape, dtype in specs]
    return assemble(root, arrays)


def allocate(nbytes: int) -> np.ndarray:
    """A private, 64-byte aligned uint8 buffer of `nbytes` bytes."""
    raw = np.empty(nbytes + _core.ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % _core.ALIGNMENT
    return raw[start:start + nbytes]


# ---------------------------------------------------------------------------
# Batchify functions


class Batchify:
    """Base class of planned batchify functions; calling one collates a batch.

    Subclasses implement ``plan(samples, path, planner)``; compose the built-in
    ones (:class:`Stack`, :class:`Pad`, :class:`Tuple`, :class:`Dict`,
    :class:`List`) rather than subclassing.  Any plain callable taking the
    list of samples also works as a loader's ``batchify_fn``.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import Stack
        >>> Stack()([np.ones(2), np.zeros(2)]).tolist()
        [[1.0, 1.0], [0.0, 0.0]]
    """

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        raise NotImplementedError

    def __call__(self, samples: Sequence[Any]) -> Any:
        return collate(self, samples)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Stack(Batchify):
    """Stack samples (arrays or scalars of one shape and dtype) on a new axis 0.

    Raises:
        ValueError: the samples' shapes differ (the message names the batch,
            the field and the first sample that differs; use :class:`Pad`).
        TypeError: the samples' dtypes differ or cannot be stacked.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import Stack
        >>> Stack()([np.arange(3), np.arange(3)]).shape
        (2, 3)
    """

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        return planner.add(_stack_field(samples, path, planner))


class Pad(Batchify):
    """Pad samples to the largest extent along every axis and stack them
    (Gluon 2.x semantics; samples ragged along one axis only, as in Gluon 1.x
    and GluonNLP, take the compiled single-axis kernel).

    Args:
        axis (int): the axis whose per-sample lengths `ret_length` returns
            (the ragged axis, in Gluon 1.x / GluonNLP terms). Default ``0``.
        pad_val (int | float | None): the padding value (``val`` is Gluon
            2.x's keyword for it). Default ``0``.
        ret_length (bool): also return each sample's length along `axis` (an
            int64 array): the batch becomes ``(padded, lengths)``. Default ``False``.
        dtype (numpy dtype | None): cast the samples to it first.
        round_to (int | None): round every padded extent up to a multiple of it.
        use_shared_mem (bool): accepted for Gluon code; batches made by
            workers always live in shared memory.

    Raises:
        ValueError: the samples differ in dtype or number of dimensions, or
            `val` does not fit the dtype (the message names the batch and field).

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import Pad
        >>> padded, lengths = Pad(pad_val=-1, ret_length=True)([np.array([1, 2, 3]), np.array([4])])
        >>> padded.tolist(), lengths.tolist()
        ([[1, 2, 3], [4, -1, -1]], [3, 1])
        >>> Pad()([np.ones((1, 2)), np.ones((2, 1))]).tolist()   # every axis
        [[[1.0, 1.0], [0.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]]
    """

    def __init__(self, axis: int = 0, pad_val: Any = None, ret_length: bool = False, dtype: Any = None,
                 round_to: int | None = None, *, val: Any = None, use_shared_mem: bool = False):
        if pad_val is not None and val is not None:
            raise ValueError("pass pad_val or val (its Gluon 2.x name), not both")
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"Pad axis must be an integer, got {axis!r}")
        if round_to is not None and (isinstance(round_to, bool) or not isinstance(round_to, (int, np.integer))
                                     or round_to < 1):
            raise ValueError(f"round_to must be a positive integer or None, got {round_to!r}")
        self.axis = int(axis)
        self.val = pad_val if pad_val is not None else (val if val is not None else 0)
        self.ret_length = ret_length
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.round_to = None if round_to is None else int(round_to)

    @property
    def pad_val(self) -> Any:
        return self.val

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        try:
            items = [_as_sample_array(x, i, "pad") for i, x in enumerate(samples)]
            if self.dtype is not None:
                items = [_cast_sample(x, i, self.dtype) for i, x in enumerate(items)]
            field, lengths = self._plan_field(items, path)
        except (ValueError, TypeError) as e:
            raise planner.error(type(e), path, str(e)) from None
        node = planner.add(field)
        if not self.ret_length:
            return node
        length_node = planner.add(_Field(path + ".lengths", "copy", lengths, lengths.shape, lengths.dtype))
        return ("t", None, [node, length_node])

    def _plan_field(self, items: list[Any], path: str) -> tuple[_Field, np.ndarray]:
        arrays = [x if isinstance(x, np.ndarray) else np.asarray(x) for x in items]
        first = arrays[0]
        nd = first.ndim
        if nd == 0 or not -nd <= self.axis < nd:
            # The compiled check words these errors (0-d samples, axis range).
            _core.pad_check(arrays, self.axis)
        axis = self.axis % nd
        shapes = np.array([a.shape if a.ndim == nd else (-1,) * nd for a in arrays], np.int64).reshape(-1, nd)
        target = shapes.max(axis=0)
        if self.round_to is not None:
            target = -(-target // self.round_to) * self.round_to
        others = np.arange(nd) != axis
        one_axis = bool((shapes[:, others] == target[others]).all()) and int(target[axis]) == int(
            shapes[:, axis].max(axis=0))
        if one_axis or any(a.ndim != nd for a in arrays):
            # Ragged along `axis` only (or a dimension mismatch, which the
            # compiled check names): the compiled single-axis kernel.
            checked, shape, dtype, lengths = _core.pad_check(arrays, axis)
            pattern = _core.pad_value_bytes(self.val, dtype)
            return _Field(path, "pad", checked, shape, dtype, axis, pattern), lengths
        dtype = first.dtype
        for i, a in enumerate(arrays):
            if a.dtype != dtype:
                raise ValueError(f"sample {i} has dtype {a.dtype}, expected {dtype} (the dtype of sample 0)")
        if dtype.hasobject:
            raise TypeError(f"sample 0 has dtype {dtype} (Python objects); only fixed-size numeric, bool or "
                            f"string dtypes can be collated")
        pattern = _core.pad_value_bytes(self.val, dtype)
        shape = (len(arrays),) + tuple(int(n) for n in target)
        return _Field(path, "padn", arrays, shape, dtype, axis, pattern), shapes[:, axis].copy()

    def __repr__(self) -> str:
        round_to = f", round_to={self.round_to}" if self.round_to is not None else ""
        return (f"Pad(axis={self.axis}, pad_val={self.val!r}, ret_length={self.ret_length}, "
                f"dtype={self.dtype}{round_to})")


class Tuple(Batchify):
    """Apply the i-th function to the i-th element of every (tuple) sample.

    Args:
        *fns: one batchify function per element (or one list of them).

    Raises:
        ValueError: no function given.
        TypeError: an argument is not callable.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import Pad, Stack, Tuple
        >>> tokens, label = Tuple(Pad(), Stack())([(np.array([5, 6]), 0), (np.array([7]), 1)])
        >>> tokens.tolist(), label.tolist()
        ([[5, 6], [7, 0]], [0, 1])
    """

    def __init__(self, *fns: Any):
        if len(fns) == 1 and isinstance(fns[0], (list, tuple)):
            fns = tuple(fns[0])
        if not fns:
            raise ValueError("Tuple() needs at least one batchify function")
        for i, fn in enumerate(fns):
            if not callable(fn):
                raise TypeError(f"Tuple() argument {i} is not callable: {fn!r}")
        self.fns = fns

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        columns = _columns(samples, len(self.fns), path, planner)
        return ("t", None, [_plan_with(fn, col, f"{path}[{i}]", planner)
                            for i, (fn, col) in enumerate(zip(self.fns, columns))])

    def __repr__(self) -> str:
        return f"Tuple({', '.join(map(repr, self.fns))})"


class Group(Tuple):
    """Gluon 2.x's name for :class:`Tuple`: the i-th function batches field i
    of every (tuple) sample; the batch is a tuple.

    Args:
        *fns: one batchify function per field, or a single list/tuple of them.

    Raises:
        ValueError: no function; TypeError: one is not callable.

    Example:
        >>> from mxload.batchify import Group, Pad, Stack
        >>> tokens, label = Group(Pad(pad_val=-1), Stack())([([1, 2, 3], 0), ([4], 1)])
        >>> tokens.tolist(), label.tolist()
        ([[1, 2, 3], [4, -1, -1]], [0, 1])
    """

    def __repr__(self) -> str:
        return f"Group({', '.join(map(repr, self.fns))})"


class Append(Batchify):
    """Keep samples of any shapes as a list of arrays, one per sample (Gluon's
    Append).  Every array travels through shared memory.

    Args:
        expand (bool): give each array a batch axis of length 1. Default ``True``.
        batch_axis (int): where that axis goes. Default ``0``.
        use_shared_mem (bool): accepted for Gluon code (always shared).

    Raises:
        TypeError: a sample holds Python objects (use :class:`List`).

    Example:
        >>> from mxload.batchify import Append
        >>> [a.shape for a in Append()([[1, 2, 3], [4, 5]])]
        [(1, 3), (1, 2)]
    """

    def __init__(self, expand: bool = True, batch_axis: int = 0, use_shared_mem: bool = False):
        self.expand = bool(expand)
        self.batch_axis = int(batch_axis)

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        children = []
        for i, x in enumerate(samples):
            try:
                a = np.asarray(_as_sample_array(x, i, "append"))
                if self.expand:
                    a = np.expand_dims(a, self.batch_axis)
            except (ValueError, TypeError) as e:   # numpy's AxisError is a ValueError
                raise planner.error(TypeError if isinstance(e, TypeError) else ValueError,
                                    path, f"sample {i}: {e}") from None
            if a.dtype.hasobject:
                raise planner.error(TypeError, path, f"sample {i} has dtype {a.dtype} (Python objects); "
                                                     f"use List() to keep objects")
            children.append(planner.add(_Field(f"{path}[{i}]", "copy", a, a.shape, a.dtype)))
        return ("t", list, children)

    def __repr__(self) -> str:
        return f"Append(expand={self.expand}, batch_axis={self.batch_axis})"


class Dict(Batchify):
    """Apply per-key functions to dict samples; keys without one use default_batchify.

    Args:
        fns (Mapping | None): key -> batchify function.
        **kwargs: more key=function pairs.

    Raises:
        TypeError: a function is not callable.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import Dict, Pad
        >>> batch = Dict(text=Pad())([{"text": np.array([1, 2]), "y": 0}, {"text": np.array([3]), "y": 1}])
        >>> batch["text"].tolist(), batch["y"].tolist()
        ([[1, 2], [3, 0]], [0, 1])
    """

    def __init__(self, fns: Mapping[Any, Any] | None = None, **kwargs: Any):
        merged = dict(fns or {}, **kwargs)
        for k, fn in merged.items():
            if not callable(fn):
                raise TypeError(f"Dict() function for key {k!r} is not callable: {fn!r}")
        self.fns = merged

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        keys, columns = _dict_columns(samples, path, planner)
        missing = [k for k in self.fns if k not in keys]
        if missing:
            raise planner.error(ValueError, path, f"samples have no key(s) {missing!r} named in Dict(); "
                                                  f"sample keys: {list(keys)!r}")
        children = [_plan_with(self.fns.get(k, default_batchify), column, f"{path}[{k!r}]", planner)
                    for k, column in zip(keys, columns)]
        return ("d", keys, children)

    def __repr__(self) -> str:
        return f"Dict({self.fns!r})"


class List(Batchify):
    """Keep the samples as a plain Python list (no collation).

    With workers the list travels pickled (the profiler shows it as
    ``pickled``): prefer numpy arrays for anything large.

    Example:
        >>> from mxload.batchify import List
        >>> List()(["a cat", "a dog"])
        ['a cat', 'a dog']
    """

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        return planner.add_object(path, list(samples))


AsList = List   # Gluon 2.x's name


class _DefaultBatchify(Batchify):
    """The default batchify function (``mxload.batchify.default_batchify``),
    like torch's ``default_collate`` but returning numpy arrays: arrays,
    numbers and torch tensors are stacked; namedtuples, tuples, lists and
    dicts are walked field by field and keep their type, as do other
    Sequence and Mapping types where they can be rebuilt (``range`` becomes a
    list); strings and bytes are kept as lists.  Anything else is an error
    naming the field.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import default_batchify
        >>> x, y = default_batchify([(np.zeros(2), 1), (np.ones(2), 2)])
        >>> x.shape, y.tolist()
        ((2, 2), [1, 2])
    """

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        if isinstance(samples, GatheredSamples):
            node = samples.plan_columns(path, planner)
            if node is not None:
                return node
        first = samples[0]
        if isinstance(first, (np.ndarray,) + _SCALAR_TYPES):
            return planner.add(_stack_field(samples, path, planner))
        if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
            columns = _columns(samples, len(first), path, planner)
            return ("t", type(first), [self.plan(c, f"{path}.{name}", planner)
                                       for name, c in zip(first._fields, columns)])
        if type(first) in (tuple, list):
            columns = _columns(samples, len(first), path, planner)
            return ("t", None if isinstance(first, tuple) else list,
                    [self.plan(c, f"{path}[{i}]", planner) for i, c in enumerate(columns)])
        if type(first) is dict:
            keys, columns = _dict_columns(samples, path, planner)
            return ("d", keys, [self.plan(c, f"{path}[{k!r}]", planner)
                                for k, c in zip(keys, columns)])
        if isinstance(first, (str, bytes)):
            return planner.add_object(path, list(samples))
        if isinstance(first, Mapping):
            keys, columns = _dict_columns(samples, path, planner)
            children = [self.plan(c, f"{path}[{k!r}]", planner) for k, c in zip(keys, columns)]
            template = _mapping_template(first, keys)
            return ("d", keys, children) if template is None else ("m", template, keys, children)
        if isinstance(first, Sequence):   # range, user sequences, list/tuple subclasses
            columns = _columns(samples, len(first), path, planner, kinds=Sequence)
            children = [self.plan(c, f"{path}[{i}]", planner) for i, c in enumerate(columns)]
            template = _sequence_template(first)
            return ("t", list, children) if template is None else ("s", template, children)
        if first is None:
            raise planner.error(TypeError, path, "sample 0 is None; return an array, a number or a "
                                                 "tuple/dict of them from the dataset")
        if is_tensor(first):
            return planner.add(_stack_field(samples, path, planner))
        try:
            arr = np.asarray(first)
        except Exception:
            arr = None
        if arr is None or arr.dtype.hasobject:
            raise planner.error(TypeError, path, f"sample 0 has type {type(first).__name__}, which "
                                                 f"default_batchify cannot collate; pass a batchify_fn")
        return planner.add(_stack_field([np.asarray(s) for s in samples], path, planner))

    def __repr__(self) -> str:
        return "default_batchify"


def _travels(cls: type) -> bool:
    """Whether a class pickles by reference (so a layout naming it can cross
    to the main process): not one defined inside a function."""
    return "<locals>" not in getattr(cls, "__qualname__", "<locals>")


def _sequence_template(first: Sequence[Any]) -> Any:
    """How to rebuild a batch of sample 0's sequence type (torch's rule): a
    mutable one as an emptied copy of sample 0 filled position by position,
    another by calling its type on a list; None means a plain list."""
    cls = type(first)
    if not _travels(cls):
        return None
    try:
        if isinstance(first, MutableSequence):
            template = copy.copy(first)
            for i in range(len(first)):
                template[i] = None   # sample 0's values must not travel with the layout
            return template
        cast_cls: Any = cls
        cast_cls([None] * len(first))    # e.g. range: no constructor from a list
        return cls
    except Exception:
        return None


def _mapping_template(first: Mapping[Any, Any], keys: tuple[Any, ...]) -> Any:
    """Like _sequence_template, for mappings (OrderedDict, defaultdict, ...)."""
    cls = type(first)
    if not _travels(cls):
        return None
    try:
        if isinstance(first, MutableMapping):
            template = copy.copy(first)
            template.clear()
            return template
        cast_cls: Any = cls
        cast_cls({k: None for k in keys})
        return cls
    except Exception:
        return None


class _Convert(Batchify):
    """``mxload.batchify.default_convert``, torch's default for
    ``batch_size=None`` (no batching): called with one sample, it returns it
    as it is, with torch tensors turned into numpy arrays (containers keep
    their types); from workers its numpy arrays travel through shared memory.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import default_convert
        >>> default_convert({"x": np.arange(2), "label": 3})
        {'x': array([0, 1]), 'label': 3}
    """

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        return _describe(_convert(samples[0]), path, planner)

    def __call__(self, sample: Any) -> Any:   # one sample, as torch's
        return _convert(sample)

    def __repr__(self) -> str:
        return "default_convert"


def _convert(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        return x
    if is_tensor(x):
        return tensor_to_numpy(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_convert(v) for v in x))
    if type(x) in (tuple, list):
        return type(x)(_convert(v) for v in x)
    if type(x) is dict:
        return {k: _convert(v) for k, v in x.items()}
    return x


class _Unbatched(Batchify):
    """``batch_size=None``: each "batch" is one sample, given to the user's
    collate_fn alone (not in a list), as torch does without auto-batching."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def plan(self, samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
        if self.fn is default_convert:
            return default_convert.plan(samples, path, planner)
        return _describe(self.fn(samples[0]), "batch", planner)

    def __repr__(self) -> str:
        return f"unbatched({self.fn!r})"


default_batchify = _DefaultBatchify()
default_convert = _Convert()


def _stack_field(samples: Sequence[Any], path: str, planner: _Planner) -> _Field:
    first = samples[0]
    if not isinstance(first, (np.ndarray,) + _SCALAR_TYPES) and is_tensor(first):
        samples = [tensor_to_numpy(x) if is_tensor(x) else x for x in samples]
        first = samples[0]
    if not isinstance(first, np.ndarray) and isinstance(first, _SCALAR_TYPES):
        # Scalars: one np.array() call converts the whole column.
        try:
            column = np.array(samples)
        except (ValueError, TypeError):
            column = None
        if (column is not None and column.dtype.kind in "SU"
                and not all(isinstance(s, (str, bytes)) for s in samples)):
            column = None  # numbers mixed with strings: let stack_check name the dtypes
        if column is not None and column.ndim == 1 and not column.dtype.hasobject:
            return _Field(path, "copy", column, column.shape, column.dtype)
    try:
        arrays, shape, dtype = _core.stack_check(samples)
    except (ValueError, TypeError) as e:
        hint = "; use Pad() for fields of varying shape" if "shape" in str(e) else ""
        raise planner.error(type(e), path, f"{e}{hint}") from None
    return _Field(path, "stack", arrays, shape, dtype)


def _as_sample_array(x: Any, i: int, what: str) -> Any:
    """A sample as the collation kernels take it: torch tensors become numpy
    arrays (sharing memory where torch allows); None is an error."""
    if x is None:
        raise TypeError(f"sample {i} is None; cannot {what} None")
    if not isinstance(x, np.ndarray) and is_tensor(x):
        return tensor_to_numpy(x)
    return x


def _cast_sample(x: Any, i: int, dtype: np.dtype) -> np.ndarray:
    if x is None:  # np.asarray(None, float) would silently be nan
        raise TypeError(f"sample {i} is None; cannot pad None")
    try:
        return np.asarray(x, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"sample {i} cannot be cast to {dtype}: {e}") from None


def _columns(samples: Sequence[Any], width: int, path: str, planner: _Planner,
             kinds: Any = (tuple, list)) -> list[Any]:
    for i, s in enumerate(samples):
        if s is None or not isinstance(s, kinds) or isinstance(s, (str, bytes)) or len(s) != width:
            ok = isinstance(s, kinds) and not isinstance(s, (str, bytes))
            what = "None" if s is None else (f"length {len(s)}" if ok else f"a {type(s).__name__}")
            raise planner.error(ValueError if ok else TypeError, path,
                                f"sample {i} is {what}, expected a tuple/list of length {width}")
    return [list(c) for c in zip(*samples)]


def _dict_columns(samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
    """(keys, one list per key) of dict samples that all have sample 0's keys.

    Fast path for plain dicts: same type, same length and every key of sample
    0 present means the same key set; itemgetter + zip do the per-sample work
    in C.  Anything else takes the checked path (with its error messages)."""
    if type(samples[0]) is dict and set(map(type, samples)) == {dict}:
        keys = tuple(samples[0].keys())
        n = len(keys)
    else:
        n = 0
    if n > 1 and set(map(len, samples)) == {n}:
        try:
            rows = list(map(operator.itemgetter(*keys), samples))
        except KeyError:
            rows = None
        if rows is not None:
            return keys, list(map(list, zip(*rows)))
    keys = _dict_keys(samples, path, planner)
    return keys, [[s[k] for s in samples] for k in keys]


def _dict_keys(samples: Sequence[Any], path: str, planner: _Planner) -> tuple[Any, ...]:
    if not isinstance(samples[0], Mapping):
        raise planner.error(TypeError, path, f"sample 0 is a {type(samples[0]).__name__}, expected a dict")
    keys = tuple(samples[0].keys())
    key_set = set(keys)
    for i, s in enumerate(samples):
        if not isinstance(s, Mapping):
            raise planner.error(TypeError, path, f"sample {i} is a {type(s).__name__}, expected a dict "
                                                 f"like sample 0")
        if len(s) != len(keys) or set(s.keys()) != key_set:
            extra = "[" + ", ".join(sorted(map(repr, set(s.keys()) - key_set))) + "]"
            missing = "[" + ", ".join(sorted(map(repr, key_set - set(s.keys())))) + "]"
            raise planner.error(ValueError, path, f"sample {i} has different keys than sample 0 "
                                                  f"(missing {missing}, extra {extra})")
    return keys


def _plan_with(fn: Callable[..., Any], samples: Sequence[Any], path: str,
               planner: _Planner) -> tuple[Any, ...]:
    if isinstance(fn, Batchify):
        return fn.plan(samples, path, planner)
    return _describe(fn(samples), path, planner)


def _slab_representable(value: Any) -> bool:
    """Whether a shared-memory view rebuilt from (shape, dtype string) is
    exactly `value`: a plain ndarray of plain numbers.  Subclasses (masked,
    record, user arrays with attributes), object arrays and dtypes with
    metadata would come back as a bare ndarray without them."""
    return type(value) is np.ndarray and not value.dtype.hasobject and value.dtype.metadata is None


def _describe(value: Any, path: str, planner: _Planner) -> tuple[Any, ...]:
    """Plan the result of a custom batchify function: its plain numpy arrays
    become copied fields (so they travel through shared memory), containers
    are walked, anything else is passed through (pickled across processes)."""
    if _slab_representable(value):
        return planner.add(_Field(path, "copy", value, value.shape, value.dtype))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return ("t", type(value), [_describe(v, f"{path}.{n}", planner)
                                   for n, v in zip(value._fields, value)])
    if type(value) in (tuple, list):
        return ("t", None if type(value) is tuple else list,
                [_describe(v, f"{path}[{i}]", planner) for i, v in enumerate(value)])
    if type(value) is dict:
        keys = tuple(value.keys())
        return ("d", keys, [_describe(value[k], f"{path}[{k!r}]", planner) for k in keys])
    return planner.add_object(path, value)


class GatheredSamples(Sequence[Any]):
    """Samples fetched by a vectorised ``__getitems__`` (see ArrayDataset).

    Behaves as the list of samples, but default collation sees the source
    arrays and the indices instead: each column is gathered once, straight
    into the batch buffer (``np.take(..., out=)``), with no per-sample
    Python and no intermediate copy.  Return one from your own
    ``__getitems__`` over in-memory numpy columns.

    Args:
        sources (Sequence[numpy.ndarray]): the columns, indexed along axis 0.
        indices (numpy.ndarray): the batch's validated 1-D int64 indices.
        single (bool): samples are bare elements of ``sources[0]``, not tuples.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import GatheredSamples, default_batchify
        >>> samples = GatheredSamples([np.arange(10) * 2], np.array([3, 1]), single=True)
        >>> [int(s) for s in samples], default_batchify(samples).tolist()
        ([6, 2], [6, 2])
    """

    __slots__ = ("sources", "indices", "single", "_columns", "_samples")

    def __init__(self, sources: Sequence[Any], indices: np.ndarray, single: bool):
        self.sources = tuple(sources)     # numpy arrays, indexed along axis 0
        self.indices = indices            # validated, 1-D int64
        self.single = single              # samples are bare elements, not tuples
        self._columns: tuple[Any, ...] | None = None
        self._samples: list[Any] | None = None

    @property
    def columns(self) -> tuple[Any, ...]:
        if self._columns is None:
            self._columns = tuple(a[self.indices] for a in self.sources)
        return self._columns

    def _materialise(self) -> list[Any]:
        if self._samples is None:
            if self.single:
                self._samples = list(self.columns[0])
            else:
                self._samples = list(zip(*self.columns))
        return self._samples

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: Any) -> Any:
        return self._materialise()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._materialise())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, GatheredSamples)):
            return self._materialise() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"GatheredSamples({self._materialise()!r})"

    def plan_columns(self, path: str, planner: _Planner) -> tuple[Any, ...] | None:
        """Plan the columns as gathers, or None if one is not plainly numeric."""
        if not all(isinstance(a, np.ndarray) and not a.dtype.hasobject for a in self.sources):
            return None
        if any(a.ndim == 1 and (a.dtype.kind in "SU" or not a.dtype.isnative) for a in self.sources):
            # Their elements are numpy scalars that lose the string width or
            # byte order, so the per-sample path would give another dtype.
            return None
        fields = [planner.add(_Field(path if self.single else f"{path}[{i}]", "take", (a, self.indices),
                                     (len(self.indices),) + a.shape[1:], a.dtype))
                  for i, a in enumerate(self.sources)]
        return fields[0] if self.single else ("t", None, fields)


# ---------------------------------------------------------------------------


def plan_batch(batchify_fn: Callable[..., Any], samples: Sequence[Any],
               batch_index: int | None = None) -> BatchPlan:
    """Plan one batch: planned batchify functions are walked; any other
    callable runs now and its result's arrays become copied fields.

    Args:
        batchify_fn (callable): a :class:`Batchify` or any function of the samples.
        samples (Sequence): the batch's samples.
        batch_index (int | None): named in error messages.

    Returns:
        BatchPlan: the plan (structure, fields, buffer size).

    Raises:
        ValueError: no samples, or fields that cannot be collated (naming
            the batch and the field).

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import default_batchify, plan_batch
        >>> plan_batch(default_batchify, [(np.zeros(2), 1)] * 3).nbytes >= 3 * 2 * 8 + 3 * 8
        True
    """
    if len(samples) == 0:
        raise ValueError(f"cannot collate batch {batch_index}: it has no samples")
    planner = _Planner(batch_index)
    if isinstance(batchify_fn, Batchify):
        root = batchify_fn.plan(samples, "sample", planner)
    else:
        root = _describe(batchify_fn(samples), "batch", planner)
    return BatchPlan(root, planner.fields, planner.objects)


def collate(batchify_fn: Callable[..., Any], samples: Sequence[Any], batch_index: int | None = None) -> Any:
    """Collate `samples` into one batch held in a single private buffer
    (what the loader does in-process; workers fill a shared-memory slab).

    Args:
        batchify_fn (callable): a :class:`Batchify` or any function of the samples.
        samples (Sequence): the batch's samples.
        batch_index (int | None): named in error messages.

    Returns:
        the batch: numpy arrays in the samples' structure.

    Raises:
        ValueError, TypeError: a field cannot be collated (the message names
            the batch, the field and the sample that differs).

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import collate, default_batchify
        >>> collate(default_batchify, [{"x": np.ones(2)}, {"x": np.zeros(2)}])["x"].tolist()
        [[1.0, 1.0], [0.0, 0.0]]
    """
    if not isinstance(batchify_fn, Batchify):
        return batchify_fn(samples)
    plan = plan_batch(batchify_fn, samples, batch_index)
    views, _ = plan.fill(allocate(plan.nbytes))
    return assemble(plan.root, views)


def collate_profiled(batchify_fn: Callable[..., Any], samples: Sequence[Any],
                     batch_index: int | None = None) -> tuple[Any, list[Any], list[Any]]:
    """collate() that also returns the per-field (stats, ns) for the profiler.
    A plain-callable batchify_fn is one opaque field (its own path)."""
    if not isinstance(batchify_fn, Batchify):
        t0 = time.perf_counter_ns()
        batch = batchify_fn(samples)
        name = getattr(batchify_fn, "__name__", type(batchify_fn).__name__)
        return batch, [(f"{name}(samples)", "custom", 0, (), type(batch).__name__)], \
            [time.perf_counter_ns() - t0]
    plan = plan_batch(batchify_fn, samples, batch_index)
    views, fill_ns = plan.fill(allocate(plan.nbytes))
    stats, times = plan.field_stats(fill_ns)
    return assemble(plan.root, views), stats, times
