"""mxload._collate.layout: a batch's wire layout survives pickling (the
worker -> consumer trip) and rebuilds every node kind as views over the
buffer, without copying."""
from __future__ import annotations

import collections
import pickle

import numpy as np
import pytest

from mxload._collate import layout
from mxload._collate.plan import allocate, plan_batch
from mxload.batchify import default_batchify

pytestmark = pytest.mark.timeout(60)

Point = collections.namedtuple("Point", ["x", "y"])


class Tagged(list):
    """A list type default_batchify keeps (rebuilt from a template)."""


def _fields_and_buffer(arrays):
    """(fields, offsets) of `arrays` packed into one aligned buffer, and the buffer."""
    buf = allocate(sum(a.nbytes for a in arrays) + 64 * len(arrays))
    offsets, offset = [], 0
    for a in arrays:
        np.ndarray(a.shape, a.dtype, buffer=buf, offset=offset)[...] = a
        offsets.append(offset)
        offset += -(-a.nbytes // 64) * 64
    return (arrays, offsets), buf


def test_every_node_kind_round_trips_through_pickle():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int64)
    specs, buf = _fields_and_buffer([a, b])
    f0, f1 = layout.field_node(0), layout.field_node(1)
    root = layout.tuple_node(None, [
        f0,
        layout.tuple_node(list, [f1, layout.object_node("meta")]),
        layout.tuple_node(Point, [f0, f1]),
        layout.dict_node(("k",), [f1]),
        layout.sequence_node(Tagged([None]), [f0]),
        layout.sequence_node(tuple, [f1]),
        layout.mapping_node(collections.OrderedDict(), ("z", "y"), [f0, f1]),
        layout.mapping_node(dict, ("w",), [f0]),
    ])
    wire = pickle.loads(pickle.dumps(layout.encode(root, *specs), protocol=pickle.HIGHEST_PROTOCOL))
    out = layout.views_from_layout(wire, buf)
    assert type(out) is tuple and len(out) == 8
    np.testing.assert_array_equal(out[0], a)
    assert type(out[1]) is list and out[1][1] == "meta"
    np.testing.assert_array_equal(out[1][0], b)
    assert type(out[2]) is Point
    assert list(out[3]) == ["k"]
    assert type(out[4]) is Tagged and type(out[5]) is tuple
    assert type(out[6]) is collections.OrderedDict and list(out[6]) == ["z", "y"]
    assert type(out[7]) is dict
    # Views over the buffer, not copies.
    assert np.shares_memory(out[0], buf) and np.shares_memory(out[6]["y"], buf)


def test_dtypes_travel_as_strings_unless_structured():
    rec = np.dtype([("a", np.int32), ("b", np.float64)])
    arrays = [np.zeros(2, ">f8"), np.zeros(2, rec), np.array(["ab", "c"])]
    specs, buf = _fields_and_buffer(arrays)
    _, wire_specs = layout.encode(layout.tuple_node(None, [layout.field_node(i) for i in range(3)]), *specs)
    assert [isinstance(d, str) for _, _, d in wire_specs] == [True, False, True]
    assert wire_specs[1][2] == rec
    out = layout.views_from_layout((layout.tuple_node(None, [layout.field_node(i) for i in range(3)]),
                                    wire_specs), buf)
    assert [o.dtype for o in out] == [a.dtype for a in arrays]


def test_views_start_at_the_base_offset():
    samples = [{"x": np.full(3, i, np.int16), "y": i} for i in range(4)]
    plan = plan_batch(default_batchify, samples)
    raw = allocate(plan.nbytes + 128)
    plan.fill(raw, base_offset=128)
    out = layout.views_from_layout(plan.layout(), raw, base_offset=128)
    assert out["x"].tolist() == [[i] * 3 for i in range(4)] and out["y"].tolist() == [0, 1, 2, 3]


def test_a_buffer_too_small_for_the_layout_is_an_error():
    plan = plan_batch(default_batchify, [np.zeros(16)] * 4)
    with pytest.raises(TypeError, match="buffer is too small"):
        layout.views_from_layout(plan.layout(), bytearray(plan.nbytes - 1))


@pytest.mark.parametrize("shape", ["one array", "flat tuple", "tuple out of order", "tuple of one",
                                   "list", "namedtuple", "nested tuple", "dict"])
def test_a_cached_template_rebuilds_what_the_layout_does(shape):
    """compile_template (the per-batch path: a layout cached by id) takes
    shortcuts for a single array and a plain tuple of fields in order; every
    other structure is rebuilt node by node.  Each gives the same batch as
    views_from_layout, as views over the slab's bytes."""
    import os

    from mxload._core import BatchOwner, Slab
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.int64)
    (fields, offsets), _ = _fields_and_buffer([a, b])
    f0, f1 = layout.field_node(0), layout.field_node(1)
    root, arrays = {
        "one array": (f0, [a]),
        "flat tuple": (layout.tuple_node(None, [f0, f1]), [a, b]),
        "tuple out of order": (layout.tuple_node(None, [f1, f0]), [a, b]),
        "tuple of one": (layout.tuple_node(None, [f0]), [a]),
        "list": (layout.tuple_node(list, [f0, f1]), [a, b]),
        "namedtuple": (layout.tuple_node(Point, [f0, f1]), [a, b]),
        "nested tuple": (layout.tuple_node(None, [f0, layout.tuple_node(None, [f1])]), [a, b]),
        "dict": (layout.dict_node(("x", "y"), [f0, f1]), [a, b]),
    }[shape]
    wire = pickle.loads(pickle.dumps(layout.encode(root, arrays, offsets[:len(arrays)]),
                                     protocol=pickle.HIGHEST_PROTOCOL))
    fd = os.memfd_create("mxload-test-template")
    try:
        os.ftruncate(fd, 4096)
        slab = Slab(fd, 4096)
    finally:
        os.close(fd)
    for arr, off in zip(arrays, offsets):
        np.ndarray(arr.shape, arr.dtype, buffer=slab, offset=off)[...] = arr
    released = []
    owner = BatchOwner(slab, 0, 4096, released.append)
    got = layout.views_from_template(layout.compile_template(wire), owner)
    want = layout.views_from_layout(wire, slab)

    def same(x, y, base):
        assert type(x) is type(y)
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
            assert x.dtype == y.dtype and np.shares_memory(x, slab) and x.base is base
        elif isinstance(x, dict):
            assert list(x) == list(y)
            for k in x:
                same(x[k], y[k], base)
        else:
            assert len(x) == len(y)
            for p, q in zip(x, y):
                same(p, q, base)
    same(got, want, owner)
    del owner, got
    assert released == [slab]   # the last view gone: the slab goes back to its pool
