"""Planning and filling a batch: the planner, its fields, BatchPlan, collate.

Every planned batchify function works in two steps so a whole batch is one
buffer:

1. *plan*: walk the samples' structure, validate every field (the Cython
   ``stack_check``/``pad_check``), and record each batched field (kernel,
   inputs, output shape and dtype) with a :class:`Planner`; a
   :class:`BatchPlan` then places all fields in one 64-byte aligned buffer
   (the Cython layout planner).
2. *fill*: run the kernels (the Cython ones with the GIL released) into a
   caller's buffer: a private allocation in-process (:func:`collate`), a
   shared-memory slab in a worker.

The batch's structure is recorded as the nodes of :mod:`.layout`, which a
worker sends to the consumer with :meth:`BatchPlan.layout`.
"""
from __future__ import annotations

import math
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from .. import _core
from .. import _torch_compat as _torch
from .._torch_compat import is_tensor, tensor_to_numpy
from . import layout
from .layout import Layout, Node
from .rows import RowsOfColumns, TensorColumns

__all__ = [
    "Field", "StackField", "PadField", "PadEveryAxisField", "CopyField", "TakeField", "TreeStackField",
    "TensorField",
    "Planner", "Batchify", "BatchPlan", "plan_batch", "collate", "collate_profiled", "allocate",
    "collates_itself",
    "stack_column", "pad_column", "gather_columns", "TreeCache", "SCALAR_TYPES", "ARRAY_OR_SCALAR",
]

# Sample leaves that stack as numbers (numpy scalars included), and with
# arrays: built once, as isinstance() runs on them for every column.
SCALAR_TYPES = (bool, int, float, complex, np.generic)
ARRAY_OR_SCALAR = (np.ndarray,) + SCALAR_TYPES


class Field:
    """One batched array of a plan: where it goes (shape, dtype) and, in each
    subclass (one per kernel), what it is made of and how it is filled."""

    kernel: ClassVar[str]   # the profiler's name for the kernel

    # Subclasses call Field.__init__ by name: a field is made per column of
    # every batch, and super() costs a third more.

    # torch_dtype: the name of the field's torch dtype where numpy has none
    # (``"torch.bfloat16"``; `dtype` then holds its bytes), or where the batch holds a tensor
    # that must come back as one (a user's collate_fn returned it: TensorField's `as_tensor`);
    # else None.
    __slots__ = ("path", "shape", "dtype", "nbytes", "torch_dtype")

    def __init__(self, path: str, shape: tuple[int, ...], dtype: np.dtype[Any],
                 torch_dtype: str | None = None):
        self.path = path
        self.shape = shape
        self.dtype = dtype
        self.nbytes = math.prod(shape) * dtype.itemsize
        self.torch_dtype = torch_dtype

    def fill(self, out: NDArray[Any]) -> int:
        """Fill `out` (this field's place in the batch buffer); returns the
        nanoseconds the copy took."""
        raise NotImplementedError


class StackField(Field):
    """Same-shape samples (checked by stack_check) on a new axis 0."""

    kernel = "stack"
    __slots__ = ("arrays",)

    def __init__(self, path: str, arrays: list[NDArray[Any]], shape: tuple[int, ...], dtype: np.dtype[Any]):
        Field.__init__(self, path, shape, dtype)
        self.arrays = arrays

    def fill(self, out: NDArray[Any]) -> int:
        return _core.stack_fill(self.arrays, out)


class PadField(Field):
    """Samples ragged along one axis (checked by pad_check), each row's rest
    filled with the pad value's bytes: the compiled kernel."""

    kernel = "pad"
    __slots__ = ("arrays", "axis", "pattern")

    def __init__(self, path: str, arrays: list[NDArray[Any]], shape: tuple[int, ...], dtype: np.dtype[Any],
                 axis: int, pattern: bytes):
        Field.__init__(self, path, shape, dtype)
        self.arrays = arrays
        self.axis = axis
        self.pattern = pattern

    def fill(self, out: NDArray[Any]) -> int:
        return _core.pad_fill(self.arrays, out, self.axis, self.pattern)


class PadEveryAxisField(Field):
    """Samples ragged along several axes, each copied into the corner of its
    row, the rest filled with the pad value (numpy; rarer than PadField)."""

    kernel = "padn"
    __slots__ = ("arrays", "pattern")

    def __init__(self, path: str, arrays: list[NDArray[Any]], shape: tuple[int, ...], dtype: np.dtype[Any],
                 pattern: bytes):
        Field.__init__(self, path, shape, dtype)
        self.arrays = arrays
        self.pattern = pattern

    def fill(self, out: NDArray[Any]) -> int:
        t0 = time.perf_counter_ns()
        out[...] = np.frombuffer(self.pattern, out.dtype)[0]
        for i, a in enumerate(self.arrays):
            out[(i,) + tuple(slice(0, n) for n in a.shape)] = a
        return time.perf_counter_ns() - t0


class CopyField(Field):
    """One finished array copied as it is."""

    kernel = "copy"
    __slots__ = ("array",)

    def __init__(self, path: str, array: NDArray[Any]):
        Field.__init__(self, path, array.shape, array.dtype)
        self.array = array

    def fill(self, out: NDArray[Any]) -> int:
        return _core.copy_into(self.array, out)


class TakeField(Field):
    """Rows of a source array at validated indices (GatheredSamples)."""

    kernel = "take"
    __slots__ = ("source", "indices")

    def __init__(self, path: str, source: NDArray[Any], indices: NDArray[np.int64]):
        Field.__init__(self, path, (len(indices),) + source.shape[1:], source.dtype)
        self.source = source
        self.indices = indices

    def fill(self, out: NDArray[Any]) -> int:
        t0 = time.perf_counter_ns()
        # mode="clip": the indices are validated, and an unbuffered take
        # writes straight into the batch buffer.
        np.take(self.source, self.indices, axis=0, out=out, mode="clip")
        return time.perf_counter_ns() - t0


class TreeStackField(Field):
    """Array leaf `leaf` of samples a SampleTree gathered (:class:`TreeCache`).
    The gathered pointers live in the plan's TreeTable, which fills all its
    leaves in one compiled call (BatchPlan.fill); the field itself holds no
    per-batch data, so one object serves every batch of that shape."""

    kernel = "stack"
    __slots__ = ("leaf",)

    def __init__(self, path: str, leaf: int, shape: tuple[int, ...], dtype: np.dtype[Any]):
        Field.__init__(self, path, shape, dtype)
        self.leaf = leaf

    def fill(self, out: NDArray[Any]) -> int:
        raise TypeError(f"field {self.path} is filled by its plan's TreeTable (BatchPlan.fill), "
                        f"not on its own")


class TensorField(Field):
    """Torch tensors stacked on a new axis 0 (or, `stacked` False, one
    tensor copied as it is) by torch itself, into a tensor over the field's
    place: no sample is converted to numpy.  Any torch dtype; a shape that
    differs or a cast torch refuses is an error naming the batch and the
    field when the field is filled.  `result` is the filled tensor, or,
    where samples carry autograd history, None until :meth:`in_process`
    makes torch.stack's result with that history (a graph never crosses a
    process: a worker's batch is the values, detached).  `as_tensor`: the
    consumer gets a tensor whatever its dtype (the layout names it as a
    torch dtype), not the numpy view the torch face turns into one: a value
    a user's collate_fn returned, where a numpy array beside it stays one."""

    kernel = "stack"
    __slots__ = ("tensors", "stacked", "tdtype", "batch_index", "result", "graph")

    def __init__(self, path: str, tensors: list[Any], stacked: bool, batch_index: int | None,
                 as_tensor: bool = False):
        first = tensors[0]
        dtype, torch_only = _torch.batch_dtype(first.dtype)
        if as_tensor:
            torch_only = str(first.dtype)   # "torch.int64": viewed as that dtype again (layout.py)
        shape = tuple(first.shape)
        Field.__init__(self, path, (len(tensors),) + shape if stacked else shape, dtype, torch_only)
        self.tensors = tensors
        self.stacked = stacked
        self.tdtype = first.dtype
        self.batch_index = batch_index
        self.result: Any = None
        self.graph = False

    def fill(self, out: NDArray[Any]) -> int:
        t0 = time.perf_counter_ns()
        try:
            if self.stacked:
                self.result, self.graph = _torch.stack_into(self.tensors, out, self.tdtype)
            else:
                self.result, self.graph = _torch.copy_into(self.tensors[0], out, self.tdtype)
        except (RuntimeError, TypeError) as e:
            where = f"batch {self.batch_index}, " if self.batch_index is not None else ""
            shapes = "size" in str(e)
            hint = "; use Pad() for fields of varying shape" if shapes else ""
            raise (ValueError if shapes else TypeError)(
                f"cannot collate {where}field {self.path}: {e}{hint}") from None
        return time.perf_counter_ns() - t0

    def in_process(self, view: Any) -> Any:
        """The batch's value for this field where it stays in the process
        that collated it (`view`: its numpy view): the tensors' own stack
        where they carry autograd history, as default_collate's; a tensor
        where numpy has no such dtype; else `view`."""
        if self.graph:
            torch = _torch.torch_module()
            return torch.stack(self.tensors) if self.stacked else self.tensors[0]
        return self.result if self.torch_dtype is not None else view


class Planner:
    """Collects the fields of one batch while batchify functions walk its samples.

    A :class:`Batchify` subclass's ``plan(samples, path, planner)`` gets
    one and returns the description of its part of the batch (opaque) that
    one call gives: another batchify function's ``plan`` (or
    :meth:`plan`), or one of the ``add_*`` methods.  To combine several
    parts, plan them with :class:`Tuple` or :class:`Dict`.  `path` names the
    part in error messages (``sample[0]['x']``).

    Args:
        batch_index (int | None): the batch's index, named in error messages.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import Batchify, Stack
        >>> class Doubled(Batchify):
        ...     '''Stack twice each sample.'''
        ...     def plan(self, samples, path, planner):
        ...         return Stack().plan([2 * np.asarray(s) for s in samples], path, planner)
        >>> Doubled()([np.ones(2), np.zeros(2)]).tolist()
        [[2.0, 2.0], [0.0, 0.0]]
    """

    __slots__ = ("batch_index", "_fields", "_objects", "_tables", "_placed", "_tensors")

    def __init__(self, batch_index: int | None = None):
        self.batch_index = batch_index
        self._fields: list[Field] = []
        self._objects: list[tuple[str, Any]] = []   # (path, value) passed through as objects
        self._tensors: list[int] = []   # the indices of the TensorFields
        # (table, indices of its TreeStackFields): filled by one compiled call each
        self._tables: list[tuple[_core.TreeTable, list[int]]] = []
        # (number of fields, (offsets, total)) when a TreeCache planned them
        # all and knew their layout; still good while no other field follows.
        self._placed: tuple[int, tuple[list[int], int]] | None = None

    def plan(self, fn: Callable[..., Any], samples: Sequence[Any], path: str) -> Node:
        """Plan `samples` with batchify function `fn`: a :class:`Batchify`
        is walked; any other callable runs now and its result is added with
        :meth:`add_value`."""
        if isinstance(fn, Batchify):
            return fn.plan(samples, path, self)
        return self.add_value(path, fn(as_given(samples)), users=True)

    def add_array(self, path: str, array: NDArray[Any]) -> Node:
        """Copy `array` (numbers, bools or fixed-size strings) into the batch buffer as it is."""
        return self._add(CopyField(path, array))

    def add_value(self, path: str, value: Any, users: bool = False) -> Node:
        """Add a finished value (the result of a custom batchify function):
        its plain numpy arrays are copied into the batch buffer (so they
        travel through shared memory), tuples, lists, namedtuples and dicts
        are walked, anything else is passed through as with :meth:`add_object`.
        `users`: a user's function made it, so its tensors come back as tensors
        (TensorField's `as_tensor`) and its arrays as arrays."""
        if _buffer_representable(value):
            return self.add_array(path, value)
        if _torch.collatable_tensor(value) and value.ndim <= _core.MAX_DIMS:
            return self.add_tensor(path, TensorField(path, [value], False, self.batch_index, as_tensor=users))
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return layout.tuple_node(type(value), [self.add_value(f"{path}.{n}", v, users)
                                                   for n, v in zip(value._fields, value)])
        if type(value) in (tuple, list):
            return layout.tuple_node(None if type(value) is tuple else list,
                                     [self.add_value(f"{path}[{i}]", v, users) for i, v in enumerate(value)])
        if type(value) is dict:
            keys = tuple(value.keys())
            return layout.dict_node(keys, [self.add_value(f"{path}[{k!r}]", value[k], users) for k in keys])
        return self.add_object(path, value)

    def add_tensor(self, path: str, field: TensorField) -> Node:
        """Add a field torch fills (stacked tensors, or one tensor as it is)."""
        self._tensors.append(len(self._fields))
        return self._add(field)

    def add_object(self, path: str, value: Any) -> Node:
        """Pass `value` into the batch as it is (across processes: pickled)."""
        self._objects.append((path, value))
        return layout.object_node(value)

    def error(self, exc_type: type[Exception], path: str, message: str) -> Exception:
        """An `exc_type` exception whose message names the batch and the field at `path`."""
        where = f"batch {self.batch_index}, " if self.batch_index is not None else ""
        return exc_type(f"cannot collate {where}field {path}: {message}")

    def _add(self, field: Field) -> Node:
        self._fields.append(field)
        return layout.field_node(len(self._fields) - 1)


def _buffer_representable(value: Any) -> bool:
    """Whether a view rebuilt from (shape, dtype string) is exactly `value`:
    a plain ndarray of plain numbers.  Subclasses (masked, record, user
    arrays with attributes), object arrays and dtypes with metadata would
    come back as a bare ndarray without them."""
    return type(value) is np.ndarray and not value.dtype.hasobject and value.dtype.metadata is None


class Batchify:
    """Base class of planned batchify functions; calling one collates a batch.

    Subclasses implement ``plan(samples, path, planner)`` (see
    :class:`Planner`); compose the built-in ones (:class:`Stack`,
    :class:`Pad`, :class:`Tuple`, :class:`Dict`, :class:`List`) rather
    than subclassing.  Any plain callable taking the list of samples also
    works as a loader's ``batchify_fn``.

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import Stack
        >>> Stack()([np.ones(2), np.zeros(2)]).tolist()
        [[1.0, 1.0], [0.0, 0.0]]
    """

    # Its batch is the value a user's function returned (see collates_itself).
    returns_user_value = False

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        raise NotImplementedError

    def __call__(self, samples: Sequence[Any]) -> Any:
        return collate(self, samples)

    def collate_here(self, samples: Sequence[Any]) -> Any:
        """The batch made without a plan, for the process that collates it and keeps it
        (no workers, thread workers), where this function can make it more cheaply so; None
        (the default): plan it."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class BatchPlan:
    """A planned batch: its structure, its fields and their place in one buffer.

    Made by :func:`plan_batch`; the loader's workers fill it into a
    shared-memory slab.  ``nbytes`` is the buffer size it needs.

    Args:
        root (tuple): the batch's structure node.
        fields (list): the planned fields.
        objects (list): (path, value) of Python objects passed through.
        tables (list | None): (TreeTable, indices of its fields) of the
            fields a SampleTree gathered, each table filled in one call.
        placed (tuple | None): (offsets, total bytes) of `fields` when
            known already (plan_layout's answer for them).
        tensors (list | None): the indices of the fields torch fills (TensorField).

    Example:
        >>> import numpy as np
        >>> from mxload.batchify import Stack, plan_batch
        >>> plan = plan_batch(Stack(), [np.zeros(3, np.float32)] * 4)
        >>> plan.nbytes >= 4 * 3 * 4
        True
    """

    __slots__ = ("root", "fields", "objects", "tables", "tensors", "offsets", "nbytes")

    def __init__(self, root: Node, fields: list[Field], objects: list[tuple[str, Any]],
                 tables: list[tuple[_core.TreeTable, list[int]]] | None = None,
                 placed: tuple[list[int], int] | None = None, tensors: list[int] | None = None):
        self.root = root
        self.fields = fields
        self.objects = objects
        self.tables = tables or []
        self.tensors = tensors or []   # the indices of the TensorFields
        self.offsets: list[int]
        if placed is not None:   # (offsets, total) the planner already knows for these fields
            self.offsets = list(placed[0])
            self.nbytes = placed[1]
            return
        offsets, total = _core.plan_layout([f.nbytes for f in fields])
        self.offsets = offsets.tolist()
        self.nbytes = int(total)

    def fill(self, buffer: Any, base_offset: int = 0) -> tuple[list[NDArray[Any]], list[int]]:
        """Collate every field into `buffer` (anything exporting a writable
        buffer) starting at `base_offset`.  Returns (views, per-field ns)."""
        fields, offsets = self.fields, self.offsets
        if len(self.tables) == 1 and len(self.tables[0][1]) == len(fields):
            # Every field from one table (a dict of arrays, say): one call each.
            times = self.tables[0][0].fill(buffer, base_offset, offsets)
            return _core.field_views(buffer, base_offset, offsets, fields), times
        times = [0] * len(fields)
        for table, indices in self.tables:   # every leaf of a table in one compiled call
            for k, ns in zip(indices, table.fill(buffer, base_offset, [offsets[k] for k in indices])):
                times[k] = ns
        views = _core.field_views(buffer, base_offset, offsets, fields)
        for k, field in enumerate(fields):
            if type(field) is not TreeStackField:
                times[k] = field.fill(views[k])
        return views, times

    def in_process(self, views: list[Any]) -> list[Any]:
        """fill()'s views as the batch's values where it stays in this
        process (collate()): a torch-filled field is a tensor where numpy
        has no such dtype, or torch.stack's own result where its samples
        carry autograd history (TensorField.in_process)."""
        fields = self.fields
        for k in self.tensors:
            field = fields[k]
            assert isinstance(field, TensorField)
            views[k] = field.in_process(views[k])
        return views

    def layout(self) -> Layout:
        """The batch's wire layout (see :mod:`mxload._collate.layout`):
        picklable, structure + (offset, shape, dtype) per field, no data."""
        return layout.encode(self.root, self.fields, self.offsets)

    def field_stats(self, fill_ns: Sequence[int]) -> tuple[list[tuple[Any, ...]], list[int]]:
        """Per-field records for the profiler: ([(path, kernel, nbytes, shape,
        dtype)], [ns]) for the kernel fields (with their `fill_ns`) and the
        objects passed through, which cross processes pickled: their pickling
        is measured here, so this costs something and runs only when profiling."""
        stats: list[tuple[Any, ...]] = [(f.path, f.kernel, f.nbytes, f.shape, f.torch_dtype or f.dtype.str)
                                        for f in self.fields]
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


def allocate(nbytes: int) -> NDArray[np.uint8]:
    """A private, 64-byte aligned uint8 buffer of `nbytes` bytes."""
    raw = np.empty(nbytes + _core.ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % _core.ALIGNMENT
    return raw[start:start + nbytes]


SLAB_GRANULE = 64 * 1024   # buffer sizes are multiples: batches of nearby sizes share buffers


def slab_size_for(nbytes: int, current: int = 0) -> int:
    """Size of a new buffer (a worker's shared slab, an in-process batch's) that must hold
    `nbytes`: rounded up, and grown by at least 1/8 over one found too small so ragged batches
    settle quickly."""
    want = max(nbytes, current + current // 8)
    return max(SLAB_GRANULE, -(-want // SLAB_GRANULE) * SLAB_GRANULE)


class ReusedBuffers:
    """Private buffers for the batches one loader collates in its own process (no workers,
    thread workers), each reused once every view of the batch in it is gone, as a worker's
    slab is.  A fresh buffer per batch had its pages faulted in again by every large batch:
    numpy maps 4 MiB and more afresh (and asks for huge pages), so a batch of 32 images of
    3x128x128 float32 took 505 minor faults and 2.1 ms to collate, against torch's 0.2-0.3 ms
    (torch.stack's allocation is reused by malloc).  At most `keep` free buffers are kept; a
    batch the loop keeps simply keeps its own.  Thread-safe: a buffer comes back from
    whichever thread drops the batch's last view."""

    __slots__ = ("_free", "_keep")

    def __init__(self, keep: int = 4):
        self._free: list[_core.Slab] = []
        self._keep = keep

    def take(self, nbytes: int) -> _core.BatchOwner:
        """A buffer of `nbytes` bytes: a free one that holds them, else a new one."""
        free = self._free
        for i in range(len(free)):   # a buffer given back meanwhile is appended: i stays right
            if free[i].size >= nbytes:
                slab = free.pop(i)
                break
        else:
            slab = _core.Slab(-1, slab_size_for(nbytes), private=True)
        return _core.BatchOwner(slab, 0, nbytes, self._give_back)

    def _give_back(self, slab: _core.Slab) -> None:
        if len(self._free) < self._keep:
            self._free.append(slab)


# ---------------------------------------------------------------------------
# Kernel fields, as the built-in batchify functions plan them


def stack_column(planner: Planner, samples: Sequence[Any], path: str) -> Node:
    """Samples (arrays, numbers or tensors of one shape and dtype) stacked
    on a new axis 0."""
    first = samples[0]
    if not isinstance(first, ARRAY_OR_SCALAR) and is_tensor(first):
        if _torch.collatable_tensor(first):
            if first.ndim + 1 > _core.MAX_DIMS:
                raise planner.error(ValueError, path, f"sample 0 has {first.ndim} dimensions; mxload "
                                    f"collates at most {_core.MAX_DIMS} (the batch dimension included)")
            tensors = samples if type(samples) is list else list(samples)
            return planner.add_tensor(path, TensorField(path, tensors, True, planner.batch_index))
        if first.is_nested:   # torch's words: the test suites of torch users match them
            raise planner.error(RuntimeError, path, "Batches of nested tensors are not currently supported "
                                "by the default collate_fn; please provide a custom collate_fn to handle "
                                "them appropriately.")
        samples = [tensor_to_numpy(x) if is_tensor(x) else x for x in samples]   # on a device: to the host
        first = samples[0]
    if not isinstance(first, np.ndarray) and isinstance(first, SCALAR_TYPES):
        # Scalars: one np.array() call converts the whole column.
        try:
            column = np.array(samples)
        except (ValueError, TypeError):
            column = None
        if (column is not None and column.dtype.kind in "SU"
                and not all(isinstance(s, (str, bytes)) for s in samples)):
            column = None  # numbers mixed with strings: let stack_check name the dtypes
        if column is not None and column.ndim == 1 and not column.dtype.hasobject:
            return planner._add(CopyField(path, column))
    try:
        arrays, shape, dtype = _core.stack_check(samples)
    except (ValueError, TypeError) as e:
        hint = "; use Pad() for fields of varying shape" if "shape" in str(e) else ""
        raise planner.error(type(e), path, f"{e}{hint}") from None
    return planner._add(StackField(path, arrays, shape, dtype))


def pad_column(planner: Planner, arrays: list[NDArray[Any]], path: str, axis: int, pad_val: Any,
               round_to: int | None) -> tuple[Node, NDArray[Any]]:
    """Samples padded to the largest extent along every axis (rounded up to
    a multiple of `round_to`) and stacked; returns the node and each
    sample's length along `axis`.  Raises ValueError/TypeError with the
    problem only: the caller names the batch and the field."""
    first = arrays[0]
    nd = first.ndim
    if nd == 0 or not -nd <= axis < nd:
        # The compiled check words these errors (0-d samples, axis range).
        _core.pad_check(arrays, axis)
    axis %= nd
    shapes = np.array([a.shape if a.ndim == nd else (-1,) * nd for a in arrays], np.int64).reshape(-1, nd)
    target = shapes.max(axis=0)
    if round_to is not None:
        target = -(-target // round_to) * round_to
    others = np.arange(nd) != axis
    one_axis = bool((shapes[:, others] == target[others]).all()) and int(target[axis]) == int(
        shapes[:, axis].max(axis=0))
    if one_axis or any(a.ndim != nd for a in arrays):
        # Ragged along `axis` only (or a dimension mismatch, which the
        # compiled check names): the compiled single-axis kernel.
        checked, shape, dtype, lengths = _core.pad_check(arrays, axis)
        pattern = _core.pad_value_bytes(pad_val, dtype)
        return planner._add(PadField(path, checked, shape, dtype, axis, pattern)), lengths
    dtype = first.dtype
    for i, a in enumerate(arrays):
        if a.dtype != dtype:
            raise ValueError(f"sample {i} has dtype {a.dtype}, expected {dtype} (the dtype of sample 0)")
    if dtype.hasobject:
        raise TypeError(f"sample 0 has dtype {dtype} (Python objects); only fixed-size numeric, bool or "
                        f"string dtypes can be collated")
    pattern = _core.pad_value_bytes(pad_val, dtype)
    shape = (len(arrays),) + tuple(int(n) for n in target)
    return planner._add(PadEveryAxisField(path, arrays, shape, dtype, pattern)), shapes[:, axis].copy()


def gather_columns(planner: Planner, sources: Sequence[Any], indices: NDArray[np.int64], single: bool,
                   path: str, tuples: type | None = None) -> Node | None:
    """A batch gathered from columns (GatheredSamples): each column's rows
    at `indices` taken straight into the batch buffer; None if a column is
    not plainly numeric (the caller then collates sample by sample)."""
    if not all(isinstance(a, np.ndarray) and not a.dtype.hasobject for a in sources):
        return None
    if any(a.ndim == 1 and (a.dtype.kind in "SU" or not a.dtype.isnative) for a in sources):
        # Their elements are numpy scalars that lose the string width or
        # byte order, so the per-sample path would give another dtype.
        return None
    nodes = [planner._add(TakeField(path if single else f"{path}[{i}]", a, indices))
             for i, a in enumerate(sources)]
    return nodes[0] if single else layout.tuple_node(tuples, nodes)


class _TreeShape:
    """Sample 0's structure as TreeCache keeps it between batches: the
    compiled SampleTree, each array leaf's (path, shape, dtype), the
    batch's layout root for a batch with no other leaf planned at field 0
    on, and the array fields made for the batch sizes seen."""

    __slots__ = ("tree", "path", "tuples", "nodes", "arrays", "root0", "_fields", "_placed")

    def __init__(self, first: Any, path: str, tuples: type | None):
        self.tree = _core.SampleTree(first)
        self.path = path
        self.tuples = tuples
        self.nodes = self.tree.nodes
        self.arrays: list[tuple[str, tuple[int, ...], np.dtype[Any]]] = []
        leaves = self.tree.leaves

        def add_array(leaf_path: str) -> Node:
            shape, dtype = leaves[len(self.arrays)]
            self.arrays.append((leaf_path, shape, dtype))
            return layout.field_node(len(self.arrays) - 1)

        root = self.build(path, add_array, layout.object_node)
        self.root0 = root if self.tree.nother == 0 else None
        self._fields: dict[int, list[TreeStackField]] = {}
        self._placed: dict[int, tuple[list[int], int]] = {}

    def fields(self, n: int) -> list[TreeStackField]:
        """The array fields of a batch of `n` samples (made once per n)."""
        got = self._fields.get(n)
        if got is None:
            if len(self._fields) >= 8:   # batch sizes that keep changing: keep the latest
                self._fields.clear()
                self._placed.clear()
            got = [TreeStackField(leaf_path, j, (n,) + shape, dtype)
                   for j, (leaf_path, shape, dtype) in enumerate(self.arrays)]
            offsets, total = _core.plan_layout([f.nbytes for f in got])
            self._placed[n] = (offsets.tolist(), int(total))
            self._fields[n] = got
        return got

    def placed(self, n: int) -> tuple[list[int], int] | None:
        """(offsets, total bytes) of fields(n) in a buffer of their own."""
        return self._placed.get(n)

    def build(self, path: str, add_array: Callable[[str], Node], add_other: Callable[[str], Node]) -> Node:
        """The layout node of the whole structure, calling add_array or
        add_other (with its path) at each leaf, in preorder: the checked
        path's order of fields and errors."""
        return _walk_tree(self.nodes, 0, path, add_array, add_other, self.tuples)[0]


def _walk_tree(nodes: Any, k: int, path: str, add_array: Callable[[str], Node],
               add_other: Callable[[str], Node], tuples: type | None) -> tuple[Node, int]:
    """(node of tree node k, the index after its subtree).  A function of the module, not a
    closure that calls itself: such a closure is a reference cycle, and it held every batch's
    planner (its samples and its buffer) until the cyclic collector ran."""
    kind, nchildren, _ = nodes[k]
    if kind == _core.TREE_ARRAY:
        return add_array(path), k + 1
    if kind == _core.TREE_OTHER:
        return add_other(path), k + 1
    children, keys = [], []
    c = k + 1
    for i in range(nchildren):
        key = nodes[c][2]
        child_path = f"{path}[{key!r}]" if kind == _core.TREE_DICT else f"{path}[{i}]"
        child, c = _walk_tree(nodes, c, child_path, add_array, add_other, tuples)
        children.append(child)
        keys.append(key)
    if kind == _core.TREE_DICT:
        return layout.dict_node(tuple(keys), children), c
    return layout.tuple_node(tuples if kind == _core.TREE_TUPLE else list, children), c


class TreeCache:
    """default_batchify's fast path for samples that are plain dicts,
    tuples and lists (nested or not) of arrays: sample 0's structure is
    compiled once (a SampleTree, kept while batches keep it), every sample
    is checked against it and its arrays' pointers gathered in one compiled
    walk, and all the array fields are filled by one compiled call.  Other
    leaves (numbers, strings, ...) are planned by `plan_other`, column by
    column, as the checked path would.

    :meth:`plan` returns None when a sample differs from sample 0 in any way
    (structure, key order, type, dtype or shape of an array): the caller then
    plans the batch the checked way, which either collates it (dict samples
    with their keys in another order, say) or raises the error that names
    the field and the sample.  The cache does not travel (pickling or copying
    a batchify function starts it empty)."""

    __slots__ = ("_shape", "_tuples")

    def __init__(self, tuples: type | None = None) -> None:
        self._shape: _TreeShape | None = None
        self._tuples = tuples   # what a tuple's fields are collated into: a tuple (None) or a list

    def __reduce__(self) -> tuple[Any, ...]:
        return (TreeCache, (self._tuples,))

    def plan(self, planner: Planner, samples: Sequence[Any], path: str,
             plan_other: Callable[[Sequence[Any], str, Planner], Node]) -> Node | None:
        if type(samples) is not list:
            samples = list(samples)
        shape = self._shape
        got: _core.TreeTable | int = 0
        if shape is not None and shape.path == path:
            got = shape.tree.gather(samples)
        if shape is None or got == 0:
            # No tree yet, or sample 0 differs from the cached one: its own.
            shape = self._shape = _TreeShape(samples[0], path, self._tuples)
            got = shape.tree.gather(samples)
        if isinstance(got, int):
            return None
        fields = planner._fields
        start = len(fields)
        tree_fields = shape.fields(got.n)
        if shape.root0 is not None:   # no other leaf: the fields in a row
            fields.extend(tree_fields)
            planner._tables.append((got, list(range(start, len(fields)))))
            if start == 0:
                placed = shape.placed(got.n)
                planner._placed = None if placed is None else (len(fields), placed)
                return shape.root0
            return shape.build(path, _FieldAt(start), layout.object_node)
        indices: list[int] = []
        columns = iter(got.columns)
        array_fields = iter(tree_fields)

        def add_array(_: str) -> Node:
            indices.append(len(fields))
            return planner._add(next(array_fields))

        def add_other(leaf_path: str) -> Node:
            return plan_other(next(columns), leaf_path, planner)

        root = shape.build(path, add_array, add_other)
        if indices:
            planner._tables.append((got, indices))
        return root


class _FieldAt:
    """add_array for _TreeShape.build: field nodes numbered from `start`."""

    __slots__ = ("next",)

    def __init__(self, start: int):
        self.next = start

    def __call__(self, _: str) -> Node:
        self.next += 1
        return layout.field_node(self.next - 1)


# ---------------------------------------------------------------------------
# Plan and collate a batch


def collates_itself(batchify_fn: Callable[..., Any]) -> bool:
    """Whether the batch is `batchify_fn`'s own collation of the samples (a planned batchify
    function), not the value a user's function returned (any other callable, or batch_size=None's
    wrapper of one: Batchify.returns_user_value).  Such a function collates a batch fetched as
    columns (RowsOfColumns, TensorColumns) from the columns: a user's is given the rows
    (as_given), so fetching columns for it is work thrown away; and the torch face makes its
    arrays tensors, as torch's default_collate does, where a user's value is handed out as made."""
    return isinstance(batchify_fn, Batchify) and not batchify_fn.returns_user_value


def as_given(samples: Sequence[Any]) -> Sequence[Any]:
    """The samples as the dataset returned them, for a function that is not a planned
    batchify function (a user's collate_fn): the list of rows a RowsOfColumns or a TensorColumns
    stands for."""
    return samples.rows() if isinstance(samples, (RowsOfColumns, TensorColumns)) else samples


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
    planner = Planner(batch_index)
    if isinstance(batchify_fn, Batchify):
        root = batchify_fn.plan(samples, "sample", planner)
    else:
        root = planner.add_value("batch", batchify_fn(as_given(samples)), users=True)
    placed = planner._placed
    return BatchPlan(root, planner._fields, planner._objects, planner._tables,
                     placed[1] if placed is not None and placed[0] == len(planner._fields) else None,
                     planner._tensors)


def collate(batchify_fn: Callable[..., Any], samples: Sequence[Any], batch_index: int | None = None,
            buffers: ReusedBuffers | None = None) -> Any:
    """Collate `samples` into one batch held in a single private buffer
    (what the loader does in-process; workers fill a shared-memory slab).

    Args:
        batchify_fn (callable): a :class:`Batchify` or any function of the samples.
        samples (Sequence): the batch's samples.
        batch_index (int | None): named in error messages.
        buffers (ReusedBuffers | None): where the buffer comes from (a loader's own: the
            buffer of a batch no longer referenced is reused); None: a new one.

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
        return batchify_fn(as_given(samples))
    here = batchify_fn.collate_here(samples)
    if here is not None:
        return here
    plan = plan_batch(batchify_fn, samples, batch_index)
    views, _ = plan.fill(_buffer(plan.nbytes, buffers))
    return layout.assemble(plan.root, plan.in_process(views) if plan.tensors else views)


def _buffer(nbytes: int, buffers: ReusedBuffers | None) -> Any:
    return buffers.take(nbytes) if buffers is not None and nbytes else allocate(nbytes)


def collate_profiled(batchify_fn: Callable[..., Any], samples: Sequence[Any], batch_index: int | None = None,
                     buffers: ReusedBuffers | None = None) -> tuple[Any, list[tuple[Any, ...]], list[int]]:
    """collate() that also returns the per-field (stats, ns) for the profiler.
    A plain-callable batchify_fn is one opaque field (its own path)."""
    if not isinstance(batchify_fn, Batchify):
        t0 = time.perf_counter_ns()
        batch = batchify_fn(as_given(samples))
        name = getattr(batchify_fn, "__name__", type(batchify_fn).__name__)
        return batch, [(f"{name}(samples)", "custom", 0, (), type(batch).__name__)], \
            [time.perf_counter_ns() - t0]
    plan = plan_batch(batchify_fn, samples, batch_index)
    views, fill_ns = plan.fill(_buffer(plan.nbytes, buffers))
    stats, times = plan.field_stats(fill_ns)
    return layout.assemble(plan.root, plan.in_process(views)), stats, times
