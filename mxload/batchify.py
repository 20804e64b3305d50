"""Batchify functions: turn a list of samples into one batch.

The built-in functions (:class:`Stack`, :class:`Pad`, :class:`Tuple` /
:class:`Group`, :class:`Dict`, :class:`List` / :class:`AsList`,
:class:`Append`, :data:`default_batchify`, :data:`default_convert`) are
*planned*: they describe the batch to a :class:`Planner` first, so that
every numeric field of a batch lands in one 64-byte aligned buffer (a
shared-memory slab, from workers), filled by compiled kernels with the GIL
released.  Any plain function of the list of samples works as a loader's
``batchify_fn`` too.

:class:`Batchify`, :class:`Planner`, :class:`BatchPlan`, :func:`plan_batch`,
:func:`collate` and :class:`GatheredSamples` are the planning machinery
(``mxload._collate``), public here for custom batchify functions and datasets.
"""
from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence, Sized
from typing import Any

import numpy as np
from numpy.typing import DTypeLike, NDArray

from . import _core
from ._collate import layout
from ._collate.gathered import GatheredSamples
from ._collate.layout import Node
from ._collate.plan import (
    ARRAY_OR_SCALAR,
    Batchify,
    BatchPlan,
    Planner,
    TensorField,
    TreeCache,
    collate,
    pad_column,
    plan_batch,
    stack_column,
)
from ._collate.rows import RowsOfColumns, TensorColumns
from ._torch_compat import collatable_tensor, is_tensor, stack_rows, tensor_to_numpy

__all__ = [
    "Batchify", "Stack", "Pad", "Tuple", "Group", "Dict", "List", "AsList", "Append",
    "default_batchify", "default_convert", "BatchPlan", "plan_batch", "collate", "GatheredSamples",
    "Planner",
]


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

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        return stack_column(planner, samples, path)


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

    def __init__(self, axis: int = 0, pad_val: Any = None, ret_length: bool = False,
                 dtype: DTypeLike | None = None, round_to: int | None = None, *, val: Any = None,
                 use_shared_mem: bool = False):
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

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        try:
            items = [_as_sample_array(x, i, "pad") for i, x in enumerate(samples)]
            if self.dtype is not None:
                items = [_cast_sample(x, i, self.dtype) for i, x in enumerate(items)]
            arrays = [x if isinstance(x, np.ndarray) else np.asarray(x) for x in items]
            node, lengths = pad_column(planner, arrays, path, self.axis, self.val, self.round_to)
        except (ValueError, TypeError) as e:
            raise planner.error(type(e), path, str(e)) from None
        if not self.ret_length:
            return node
        return layout.tuple_node(None, [node, planner.add_array(path + ".lengths", lengths)])

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

    def __init__(self, *fns: Callable[..., Any] | Sequence[Callable[..., Any]]):
        given: Sequence[object] = fns[0] if len(fns) == 1 and isinstance(fns[0], (list, tuple)) else fns
        if not given:
            raise ValueError("Tuple() needs at least one batchify function")
        checked: list[Callable[..., Any]] = []
        for i, fn in enumerate(given):
            if not callable(fn):
                raise TypeError(f"Tuple() argument {i} is not callable: {fn!r}")
            checked.append(fn)
        self.fns = tuple(checked)

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        columns = _columns(samples, len(self.fns), path, planner)
        return layout.tuple_node(None, [planner.plan(fn, col, f"{path}[{i}]")
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

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
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
            children.append(planner.add_array(f"{path}[{i}]", a))
        return layout.tuple_node(list, children)

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

    def __init__(self, fns: Mapping[Any, Callable[..., Any]] | None = None, **kwargs: Callable[..., Any]):
        merged = dict(fns or {}, **kwargs)
        for k, fn in merged.items():
            if not callable(fn):
                raise TypeError(f"Dict() function for key {k!r} is not callable: {fn!r}")
        self.fns = merged

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        keys, columns = _dict_columns(samples, path, planner)
        missing = [k for k in self.fns if k not in keys]
        if missing:
            raise planner.error(ValueError, path, f"samples have no key(s) {missing!r} named in Dict(); "
                                                  f"sample keys: {list(keys)!r}")
        children = [planner.plan(self.fns.get(k, default_batchify), column, f"{path}[{k!r}]")
                    for k, column in zip(keys, columns)]
        return layout.dict_node(keys, children)

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

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        return planner.add_object(path, list(samples))


AsList = List   # Gluon 2.x's name


class _DefaultBatchify(Batchify):
    """The default batchify function (``mxload.batchify.default_batchify``),
    like torch's ``default_collate`` but returning numpy arrays: arrays,
    numbers and torch tensors are stacked (tensors by ``torch.stack`` into
    the batch's buffer; a field of a torch dtype numpy lacks, bfloat16, is a
    tensor, and so is one whose samples carry autograd history when the batch
    is collated in the training process); namedtuples, tuples, lists and
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

    def __init__(self, tuples_as_lists: bool = False) -> None:
        # torch's default_collate makes a list of a tuple's fields ("backwards compatibility" in
        # torch's words); mxload's default keeps the tuple.  mxload.torch collates with the former.
        self._tuples: type | None = list if tuples_as_lists else None
        self._trees = TreeCache(self._tuples)

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        if type(samples) is list and type(samples[0]) in _TREE_TYPES:
            # Plain dicts/tuples/lists: every sample checked and every array
            # field filled in one compiled pass each; a batch it does not take
            # (samples that differ) is planned the checked way below.
            node = self._trees.plan(planner, samples, path, self._plan_checked)
            if node is not None:
                return node
        elif isinstance(samples, GatheredSamples):
            node = samples.plan_columns(path, planner, self._tuples)
            if node is not None:
                return node
        elif isinstance(samples, RowsOfColumns) and len(samples):
            return self._plan_columns(samples, path, planner)
        elif isinstance(samples, TensorColumns) and len(samples):
            return self._plan_tensor_columns(samples, path, planner)
        return self._plan_checked(samples, path, planner)

    def collate_here(self, samples: Sequence[Any]) -> Any:
        """mxload.torch's (tuples made lists): samples of CPU tensors and numbers stacked by
        torch, as its default_collate does in the main process (stack_rows); None: planned."""
        if self._tuples is list:
            if type(samples) is list:
                return stack_rows(samples)
            if isinstance(samples, TensorColumns):
                return list(samples.columns)   # each the stack of its rows already
        return None

    def _plan_columns(self, samples: RowsOfColumns, path: str, planner: Planner) -> Node:
        """Rows of one dict as the rows themselves would plan: a tensor column copied once (its
        rows' stack, bit for bit), any other column planned from its rows."""
        keys = tuple(samples.batch)
        children = []
        for key in keys:
            column, field_path = samples.batch[key], f"{path}[{key!r}]"
            if (collatable_tensor(column) and 1 <= column.ndim <= _core.MAX_DIMS
                    and column.shape[0] == samples.n and not column.requires_grad):
                children.append(_copied_tensor(planner, field_path, column))
            else:
                rows = [column[i] for i in range(samples.n)]
                children.append(self._plan_checked(rows, field_path, planner))
        return layout.dict_node(keys, children)

    def _plan_tensor_columns(self, samples: TensorColumns, path: str, planner: Planner) -> Node:
        """A TensorDataset's rows as the rows themselves would plan: each gathered column copied
        once (its rows' stack, bit for bit)."""
        if not all(column.ndim <= _core.MAX_DIMS for column in samples.columns):
            return self._plan_checked(samples.rows(), path, planner)
        return layout.tuple_node(self._tuples, [_copied_tensor(planner, f"{path}[{i}]", column)
                                                for i, column in enumerate(samples.columns)])

    def _plan_checked(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        """Plan field by field, checking every sample (with the errors that
        name the field and the sample)."""
        first = samples[0]
        if isinstance(first, ARRAY_OR_SCALAR):
            return stack_column(planner, samples, path)
        if isinstance(first, tuple) and hasattr(first, "_fields"):  # namedtuple
            columns = _columns(samples, len(first), path, planner)
            return layout.tuple_node(type(first), [self._plan_checked(c, f"{path}.{name}", planner)
                                                   for name, c in zip(first._fields, columns)])
        if type(first) in (tuple, list):
            columns = _columns(samples, len(first), path, planner)
            return layout.tuple_node(self._tuples if isinstance(first, tuple) else list,
                                     [self._plan_checked(c, f"{path}[{i}]", planner)
                                      for i, c in enumerate(columns)])
        if type(first) is dict:
            keys, columns = _dict_columns(samples, path, planner)
            return layout.dict_node(keys, [self._plan_checked(c, f"{path}[{k!r}]", planner)
                                           for k, c in zip(keys, columns)])
        if isinstance(first, (str, bytes)):
            return planner.add_object(path, list(samples))
        if isinstance(first, Mapping):
            keys, columns = _dict_columns(samples, path, planner)
            children = [self._plan_checked(c, f"{path}[{k!r}]", planner) for k, c in zip(keys, columns)]
            template = _mapping_template(first, keys)
            if template is None:
                return layout.dict_node(keys, children)
            return layout.mapping_node(template, keys, children)
        if isinstance(first, Sequence):   # range, user sequences, list/tuple subclasses
            columns = _columns(samples, len(first), path, planner, kinds=(Sequence,))
            children = [self._plan_checked(c, f"{path}[{i}]", planner) for i, c in enumerate(columns)]
            tuple_to_list = self._tuples is list and isinstance(first, tuple)
            template = None if tuple_to_list else _sequence_template(first)
            if template is None:
                return layout.tuple_node(list, children)
            return layout.sequence_node(template, children)
        if first is None:
            raise planner.error(TypeError, path, "sample 0 is None; return an array, a number or a "
                                                 "tuple/dict of them from the dataset")
        if is_tensor(first):
            return stack_column(planner, samples, path)
        try:
            arr = np.asarray(first)
        except Exception:
            arr = None
        if arr is None or arr.dtype.hasobject:
            raise planner.error(TypeError, path, f"sample 0 has type {type(first).__name__}, which "
                                                 f"default_batchify cannot collate; pass a batchify_fn")
        return stack_column(planner, [np.asarray(s) for s in samples], path)

    def __repr__(self) -> str:
        return "default_batchify" if self._tuples is None else "torch_default_collate"


_TREE_TYPES = (dict, tuple, list)


def _copied_tensor(planner: Planner, path: str, column: Any) -> Node:
    """A column of a batch's rows already gathered as one tensor (a Hugging Face tensor column, a
    TensorDataset's rows): copied into the batch once by torch, its rows' stack bit for bit."""
    return planner.add_tensor(path, TensorField(path, [column], False, planner.batch_index))


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

    def __init__(self, tuples_as_lists: bool = False) -> None:
        self._tuples_as_lists = tuples_as_lists   # torch's default_convert: a tuple becomes a list

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        # CPU tensors go to the planner as they are: torch copies each into
        # the batch buffer (any dtype; a bfloat16 one stays a tensor).
        return planner.add_value(path, _convert(samples[0], self._tuples_as_lists, keep_tensors=True))

    def __call__(self, sample: Any) -> Any:   # one sample, as torch's
        return _convert(sample, self._tuples_as_lists)

    def __repr__(self) -> str:
        return "torch_default_convert" if self._tuples_as_lists else "default_convert"


def _convert(x: Any, tuples_as_lists: bool, keep_tensors: bool = False) -> Any:
    if isinstance(x, np.ndarray):
        return x
    if is_tensor(x):
        return x if keep_tensors and collatable_tensor(x) else tensor_to_numpy(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_convert(v, tuples_as_lists, keep_tensors) for v in x))
    if type(x) in (tuple, list):
        items = [_convert(v, tuples_as_lists, keep_tensors) for v in x]
        return items if type(x) is list or tuples_as_lists else tuple(items)
    if type(x) is dict:
        return {k: _convert(v, tuples_as_lists, keep_tensors) for k, v in x.items()}
    return x


class _Unbatched(Batchify):
    """``batch_size=None``: each "batch" is one sample, given to the user's
    collate_fn alone (not in a list), as torch does without auto-batching."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self.returns_user_value = not isinstance(fn, _Convert)

    def plan(self, samples: Sequence[Any], path: str, planner: Planner) -> Node:
        if isinstance(self.fn, _Convert):
            return self.fn.plan(samples, path, planner)
        return planner.add_value("batch", self.fn(samples[0]), users=True)

    def __repr__(self) -> str:
        return f"unbatched({self.fn!r})"


default_batchify = _DefaultBatchify()
default_convert = _Convert()
# mxload.torch's natives for torch's default_collate and default_convert: the same, with a tuple's
# fields collated into a list, as torch's functions give them.
torch_default_collate = _DefaultBatchify(tuples_as_lists=True)
torch_default_convert = _Convert(tuples_as_lists=True)


def _as_sample_array(x: Any, i: int, what: str) -> Any:
    """A sample as the collation kernels take it: torch tensors become numpy
    arrays (sharing memory where torch allows); None is an error."""
    if x is None:
        raise TypeError(f"sample {i} is None; cannot {what} None")
    if not isinstance(x, np.ndarray) and is_tensor(x):
        return tensor_to_numpy(x)
    return x


def _cast_sample(x: Any, i: int, dtype: np.dtype[Any]) -> NDArray[Any]:
    if x is None:  # np.asarray(None, float) would silently be nan
        raise TypeError(f"sample {i} is None; cannot pad None")
    try:
        return np.asarray(x, dtype=dtype)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"sample {i} cannot be cast to {dtype}: {e}") from None


def _columns(samples: Sequence[Any], width: int, path: str, planner: Planner,
             kinds: tuple[type[Sized], ...] = (tuple, list)) -> list[Any]:
    for i, s in enumerate(samples):
        if s is None or not isinstance(s, kinds) or isinstance(s, (str, bytes)) or len(s) != width:
            ok = isinstance(s, kinds) and not isinstance(s, (str, bytes))
            what = "None" if s is None else (f"length {len(s)}" if ok else f"a {type(s).__name__}")
            raise planner.error(ValueError if ok else TypeError, path,
                                f"sample {i} is {what}, expected a tuple/list of length {width}")
    return [list(c) for c in zip(*samples)]


def _dict_columns(samples: Sequence[Any], path: str, planner: Planner) -> tuple[Any, ...]:
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


def _dict_keys(samples: Sequence[Any], path: str, planner: Planner) -> tuple[Any, ...]:
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
