"""A batch's wire layout: how a worker describes the batch it collated into
a shared-memory slab, and how the consumer rebuilds it as numpy views over
the same slab, without copying.

Cross-process format: this module and ``mxload/_runtime/messages.py`` / ``local/wire.py`` are
the only ones that define a format crossing processes (wire.py frames
the messages; a batch's message carries its Layout, pickled).  Change one
of the node kinds below and a worker and its consumer disagree.

A :data:`Layout` is ``(root, specs)``: `root` is the batch's structure (a
tree of small tuples, cheap to pickle; no array data) and `specs` one
``(offset, shape, dtype)`` per array field, the offset counted from the
batch's start in the buffer, the dtype a string (``dtype.str``, far smaller
and faster to pickle than a dtype object) unless it is structured; a field
of a torch dtype numpy lacks (bfloat16) names it (``"torch.bfloat16"``) and
is handed out as a tensor of it over the same bytes.

Structure nodes, one constructor each below:

- ``("f", i)``: array field i;
- ``("t", kind, children)``: a tuple (kind None), a list (kind ``list``) or
  a namedtuple (kind: its class);
- ``("d", keys, children)``: a dict;
- ``("s", template, children)`` / ``("m", template, keys, children)``: a
  sequence / mapping of another type, rebuilt from a template (an emptied
  copy of sample 0, or its type), as torch's default_collate keeps them;
- ``("o", value)``: a Python object passed through as it is.
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .. import _torch_compat
from .._core import VIEWS_ASSEMBLE, VIEWS_ONE_ARRAY, VIEWS_TUPLE, ViewTemplate

__all__ = [
    "Node", "FieldSpec", "Layout", "ArrayField", "field_node", "object_node", "tuple_node", "dict_node",
    "sequence_node", "mapping_node", "encode", "views_from_layout", "assemble",
    "compile_template", "views_from_template",
]

Node = tuple[Any, ...]
FieldSpec = tuple[int, tuple[int, ...], "str | np.dtype[Any]"]
Layout = tuple[Node, list[FieldSpec]]


def field_node(index: int) -> Node:
    return ("f", index)


def object_node(value: Any) -> Node:
    """`value` (any user object) travels in the layout itself, pickled."""
    return ("o", value)


def tuple_node(kind: type | None, children: list[Node]) -> Node:
    """kind: None (a tuple), ``list``, or a namedtuple class."""
    return ("t", kind, children)


def dict_node(keys: tuple[Any, ...], children: list[Node]) -> Node:
    return ("d", keys, children)


def sequence_node(template: Any, children: list[Node]) -> Node:
    """template: a mutable sequence emptied of sample 0's values, or a type
    called with the list of items."""
    return ("s", template, children)


def mapping_node(template: Any, keys: tuple[Any, ...], children: list[Node]) -> Node:
    """template: an emptied mapping to update, or a type called with a dict."""
    return ("m", template, keys, children)


class ArrayField(Protocol):
    """What encode() reads of a planned field."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]


def encode(root: Node, fields: Sequence[ArrayField], offsets: Sequence[int]) -> Layout:
    """The layout of a batch whose array fields are `fields`, at `offsets`
    (a planned field's `torch_dtype`, where set, names a torch-only dtype)."""
    return (root, [(offset, f.shape, getattr(f, "torch_dtype", None)
                    or (f.dtype.str if f.dtype.fields is None else f.dtype))
                   for f, offset in zip(fields, offsets)])


def _is_torch_only(dtype: Any) -> bool:
    return isinstance(dtype, str) and dtype.startswith(_torch_compat.TORCH_DTYPE_PREFIX)


def _numpy_dtype(dtype: Any) -> np.dtype[Any]:
    """A spec's dtype as the numpy dtype its view is made with."""
    return _torch_compat.viewing_dtype(dtype) if _is_torch_only(dtype) else np.dtype(dtype)


def views_from_layout(layout: Layout, buffer: Any, base_offset: int = 0) -> Any:
    """The batch a layout describes, as numpy views over `buffer` (anything
    exporting a buffer: a slab, bytes) from `base_offset` on; no copy (a
    torch-only dtype's field: a tensor over its view)."""
    root, specs = layout
    arrays = [np.ndarray(shape, _numpy_dtype(dtype), buffer=buffer, offset=base_offset + offset)
              for offset, shape, dtype in specs]
    return _TorchOnly.wrap(specs, assemble)(root, arrays)


def compile_template(layout: Layout) -> ViewTemplate:
    """`layout` as every later batch of that shape takes it (a layout cached
    by id): dtype objects made once, shapes as tuples, and the shortcut from
    field arrays to batch (see _shortcut)."""
    root, specs = layout
    build = _TorchOnly.wrap(specs, assemble)
    return ViewTemplate(root, [(off, tuple(shape), _numpy_dtype(dt)) for off, shape, dt in specs],
                        _shortcut(root, len(specs)) if build is assemble else VIEWS_ASSEMBLE, build)


class _TorchOnly:
    """assemble() for a layout with fields of torch-only dtypes: those
    fields' views (their bytes) become tensors of their dtype first."""

    __slots__ = ("fields", "build")

    def __init__(self, fields: list[tuple[int, str]], build: Any):
        self.fields = fields
        self.build = build

    @classmethod
    def wrap(cls, specs: Sequence[FieldSpec], build: Any) -> Any:
        fields = [(k, dt) for k, (_, _, dt) in enumerate(specs) if isinstance(dt, str) and _is_torch_only(dt)]
        return cls(fields, build) if fields else build

    def __call__(self, root: Node, arrays: Sequence[Any]) -> Any:
        arrays = list(arrays)
        for k, name in self.fields:
            arrays[k] = _torch_compat.as_torch_dtype(arrays[k], name)
        return self.build(root, arrays)


def _shortcut(root: Node, nfields: int) -> int:
    """The batch's structure as one step for the common shapes: a single
    array, or a plain tuple of the field arrays in order (an (x, y)
    dataset); else assemble() rebuilds it."""
    if root == ("f", 0) and nfields == 1:
        return VIEWS_ONE_ARRAY
    if (root[0] == "t" and root[1] is None and len(root[2]) == nfields
            and all(child == ("f", i) for i, child in enumerate(root[2]))):
        return VIEWS_TUPLE
    return VIEWS_ASSEMBLE


def views_from_template(template: ViewTemplate, owner: Any) -> Any:
    """The batch `template` describes, as numpy views over a BatchOwner's
    bytes (made in C, each with `owner` as its base; no copy)."""
    return template.views(owner)


def assemble(node: Node, arrays: Sequence[Any]) -> Any:
    """Rebuild a batch's structure from a node and its field arrays."""
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
