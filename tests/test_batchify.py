"""Tests of mxload.batchify: Gluon-compatible semantics, one-buffer batches,
the worker->main layout path, GatheredSamples and error messages."""
from __future__ import annotations

import collections
import itertools
import pickle

import numpy as np
import pytest

import mxload
from mxload._collate.layout import views_from_layout
from mxload._collate.plan import allocate
from mxload.batchify import (
    Batchify,
    Dict,
    GatheredSamples,
    List,
    Pad,
    Planner,
    Stack,
    Tuple,
    collate,
    default_batchify,
    plan_batch,
)

pytestmark = pytest.mark.timeout(60)

Point = collections.namedtuple("Point", ["x", "y"])
Sample = collections.namedtuple("Sample", ["image", "meta"])


# ---------------------------------------------------------------------------
# helpers


def arrays_in(obj):
    """Every ndarray of a (nested) batch, depth first."""
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from arrays_in(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from arrays_in(v)


def root_of(a):
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def assert_one_buffer(batch, inputs=()):
    """All arrays of `batch` share one base allocation, are 64-byte aligned,
    do not overlap each other and do not alias any of `inputs`."""
    arrs = list(arrays_in(batch))
    assert arrs, "batch has no arrays"
    roots = {id(root_of(a)) for a in arrs}
    assert len(roots) == 1, f"batch spans {len(roots)} allocations"
    for a in arrs:
        assert a.ctypes.data % 64 == 0, f"field at {a.ctypes.data:#x} is not 64-byte aligned"
        assert a.flags.c_contiguous and a.flags.writeable
    for a, b in itertools.combinations(arrs, 2):
        if a.size and b.size:
            assert not np.shares_memory(a, b), "two fields overlap"
    for a in arrs:
        for x in arrays_in(inputs):
            assert not np.shares_memory(a, x), "batch aliases an input sample"


def assert_same(got, want):
    """Structural equality with exact container types, dtypes and values."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.dtype.str == want.dtype.str, (got.dtype, want.dtype)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
    else:
        assert got == want


def ref_pad(samples, axis=0, val=0, dtype=None):
    arrs = [np.asarray(s, dtype=dtype) for s in samples]
    nd = arrs[0].ndim
    axis = axis % nd
    longest = max(a.shape[axis] for a in arrs)
    out = []
    for a in arrs:
        widths = [(0, 0)] * nd
        widths[axis] = (0, longest - a.shape[axis])
        out.append(np.pad(a, widths, constant_values=np.array(val, a.dtype)))
    return np.stack(out)


DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "int64", "uint64",
          "float16", "float32", "float64", "complex64", "complex128", "bool"]


def sample_array(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 100, size=shape) % (2 if dtype == "bool" else 100)).astype(dtype)


# ---------------------------------------------------------------------------
# default_batchify: leaves


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_arrays_dtype_preserved(dtype):
    samples = [sample_array(dtype, (3, 2), i) for i in range(4)]
    out = default_batchify(samples)
    assert_same(out, np.stack(samples))
    assert_one_buffer(out, samples)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_numpy_scalars_dtype_preserved(dtype):
    samples = [np.dtype(dtype).type(v) for v in (1, 0, 1, 1)]
    out = default_batchify(samples)
    assert_same(out, np.stack([np.asarray(s) for s in samples]))
    assert out.dtype == np.dtype(dtype)
    assert_one_buffer(out)


@pytest.mark.parametrize("samples, dtype", [
    ([1, 2, 3], np.int64),
    ([1.5, -2.0, 3.25], np.float64),
    ([True, False, True], np.bool_),
    ([1 + 2j, 3j], np.complex128),
])
def test_default_python_scalars(samples, dtype):
    out = default_batchify(samples)
    assert_same(out, np.array(samples, dtype=dtype))
    assert_one_buffer(out)


def test_default_python_int_float_promote_like_gluon():
    # Gluon: non-NDArray leaves go through np.asarray(data).
    out = default_batchify([1, 2.5])
    assert_same(out, np.array([1.0, 2.5]))


def test_default_zero_d_arrays_and_mixed_scalar_kinds():
    samples = [np.array(1.5, np.float32), np.float32(2.5), np.array(3, np.float32)]
    out = default_batchify(samples)
    assert_same(out, np.array([1.5, 2.5, 3.0], np.float32))
    assert_one_buffer(out)


def test_default_non_contiguous_inputs():
    base = np.arange(60, dtype=np.int32).reshape(3, 4, 5)
    samples = [base[0].T, base[1, ::2, ::-1], base[2][:2].T[:4]]
    samples = [s[:2, :2] for s in samples]
    out = default_batchify(samples)
    assert_same(out, np.stack(samples))
    assert_one_buffer(out, samples)


def test_default_output_does_not_alias_inputs():
    samples = [np.ones(4, np.float32) for _ in range(3)]
    out = default_batchify(samples)
    out[:] = 7
    assert all((s == 1).all() for s in samples)


def test_default_zero_size_fields():
    out = default_batchify([np.zeros((0, 3)), np.zeros((0, 3))])
    assert_same(out, np.zeros((2, 0, 3)))
    tup = default_batchify([(np.zeros(2), np.zeros(0, np.int8)), (np.ones(2), np.zeros(0, np.int8))])
    assert_same(tup, (np.array([[0.0, 0.0], [1.0, 1.0]]), np.zeros((2, 0), np.int8)))


def test_default_strings_kept_as_list():
    assert default_batchify(["a", "bb", "ccc"]) == ["a", "bb", "ccc"]
    assert default_batchify([b"x", b"yz"]) == [b"x", b"yz"]
    out = default_batchify([("a", 1), ("bb", 2)])
    assert type(out) is tuple
    assert out[0] == ["a", "bb"]
    assert_same(out[1], np.array([1, 2]))


def test_default_numbers_mixed_with_strings_is_an_error():
    with pytest.raises(ValueError, match=r"sample\b.*sample 1 has dtype <U1, expected int64"):
        default_batchify([1, "a"])


def test_default_structured_and_datetime_arrays():
    rec = np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])
    out = default_batchify([rec, rec])
    assert_same(out, np.stack([rec, rec]))
    days = [np.datetime64("2020-01-01"), np.datetime64("2021-06-30")]
    assert_same(default_batchify(days), np.array(days))


# ---------------------------------------------------------------------------
# default_batchify: structure


def test_default_tuple_of_fields():
    samples = [(np.full((2, 2), i, np.float32), i, np.int8(i), f"s{i}") for i in range(3)]
    out = default_batchify(samples)
    want = (np.stack([s[0] for s in samples]), np.array([0, 1, 2]),
            np.array([0, 1, 2], np.int8), ["s0", "s1", "s2"])
    assert_same(out, want)
    assert_one_buffer(out, samples)


def test_default_list_samples_stay_lists():
    samples = [[np.arange(3) + i, float(i)] for i in range(2)]
    out = default_batchify(samples)
    assert_same(out, [np.stack([np.arange(3), np.arange(3) + 1]), np.array([0.0, 1.0])])


def test_default_namedtuple_class_preserved():
    samples = [Point(np.float16(i), np.arange(2) * i) for i in range(3)]
    out = default_batchify(samples)
    assert type(out) is Point
    assert_same(out.x, np.array([0, 1, 2], np.float16))
    assert_same(out.y, np.stack([np.arange(2) * i for i in range(3)]))
    assert_one_buffer(out)


def test_default_dict_key_order_preserved():
    samples = [{"z": np.int8(i), "a": np.zeros(2) + i, "m": f"n{i}"} for i in range(2)]
    out = default_batchify(samples)
    assert list(out) == ["z", "a", "m"]
    assert_same(out, {"z": np.array([0, 1], np.int8),
                      "a": np.array([[0.0, 0.0], [1.0, 1.0]]), "m": ["n0", "n1"]})
    # Later samples may list the keys in another order: sample 0's order wins.
    out2 = default_batchify([{"b": 1, "a": 2}, {"a": 4, "b": 3}])
    assert list(out2) == ["b", "a"]
    assert_same(out2, {"b": np.array([1, 3]), "a": np.array([2, 4])})


def test_default_deeply_nested_all_in_one_buffer():
    def make(i):
        return Sample(
            image=np.full((4, 3), i, np.uint8),
            meta={"label": i, "box": (np.float32(i), [np.arange(2, dtype=np.int16) + i, True]),
                  "name": f"img{i}", "pt": Point(i * 1.0, np.complex64(i))},
        )
    samples = [make(i) for i in range(3)]
    out = default_batchify(samples)
    assert type(out) is Sample
    assert list(out.meta) == ["label", "box", "name", "pt"]
    assert type(out.meta["box"]) is tuple and type(out.meta["box"][1]) is list
    assert type(out.meta["pt"]) is Point
    want = Sample(
        image=np.stack([s.image for s in samples]),
        meta={"label": np.array([0, 1, 2]),
              "box": (np.array([0, 1, 2], np.float32),
                      [np.stack([np.arange(2, dtype=np.int16) + i for i in range(3)]),
                       np.array([True, True, True])]),
              "name": ["img0", "img1", "img2"],
              "pt": Point(np.array([0.0, 1.0, 2.0]), np.array([0, 1, 2], np.complex64))},
    )
    assert_same(out, want)
    assert_one_buffer(out, samples)
    assert len(list(arrays_in(out))) == 7


def test_default_empty_containers():
    assert default_batchify([(), ()]) == ()
    assert default_batchify([{}, {}]) == {}


def test_default_repr_and_call_equals_collate():
    assert repr(default_batchify) == "default_batchify"
    samples = [np.arange(3), np.arange(3)]
    assert_same(default_batchify(samples), collate(default_batchify, samples, batch_index=0))


# ---------------------------------------------------------------------------
# Stack / Pad / Tuple / Dict / List


def test_stack_arrays_scalars_and_lists():
    samples = [np.arange(6, dtype=np.float32).reshape(2, 3) * i for i in range(3)]
    out = Stack()(samples)
    assert_same(out, np.stack(samples))
    assert_one_buffer(out, samples)
    assert_same(Stack()([np.int16(1), np.int16(2)]), np.array([1, 2], np.int16))
    assert_same(Stack()([[1, 2], [3, 4]]), np.array([[1, 2], [3, 4]]))
    assert repr(Stack()) == "Stack()"


def test_stack_ragged_names_pad():
    with pytest.raises(ValueError, match=r"sample 1 has shape \(3,\), expected \(2,\).*Pad\(\)"):
        Stack()([np.zeros(2), np.zeros(3)])


@pytest.mark.parametrize("dtype", ["int32", "float16", "bool", "complex64"])
def test_pad_axis0(dtype):
    samples = [sample_array(dtype, (n,), n) for n in (3, 1, 4, 0)]
    out = Pad()(samples)
    assert_same(out, ref_pad(samples))
    assert_one_buffer(out, samples)


def test_pad_axis0_multidim_val_minus_one():
    samples = [np.ones((n, 2), np.int64) * n for n in (2, 5, 1)]
    out = Pad(val=-1)(samples)
    assert_same(out, ref_pad(samples, val=-1))
    assert (out[0, 2:] == -1).all() and (out[1] == 5).all()


def test_pad_axis1_and_negative_axis():
    samples = [np.arange(2 * n, dtype=np.float32).reshape(2, n) for n in (3, 1, 5)]
    want = ref_pad(samples, axis=1, val=-1)
    out1 = Pad(axis=1, val=-1)(samples)
    assert_same(out1, want)
    assert_one_buffer(out1, samples)
    assert_same(Pad(axis=-1, val=-1)(samples), want)
    # axis=-2 is axis 0 of the samples
    rows = [np.ones((n, 3), np.int8) for n in (1, 3)]
    assert_same(Pad(axis=-2)(rows), ref_pad(rows, axis=0))


def test_pad_middle_axis_3d():
    samples = [np.arange(2 * n * 3).reshape(2, n, 3) for n in (1, 4, 2)]
    out = Pad(axis=1, val=9)(samples)
    assert_same(out, ref_pad(samples, axis=1, val=9))


def test_pad_ret_length():
    samples = [np.arange(n, dtype=np.float32) for n in (2, 4, 3)]
    out = Pad(ret_length=True)(samples)
    assert type(out) is tuple and len(out) == 2
    batch, lengths = out
    assert_same(batch, ref_pad(samples))
    assert lengths.dtype.kind == "i"
    np.testing.assert_array_equal(lengths, [2, 4, 3])
    assert_one_buffer(out, samples)
    # negative axis + ret_length
    two_d = [np.zeros((2, n)) for n in (1, 3)]
    b2, l2 = Pad(axis=-1, ret_length=True)(two_d)
    assert b2.shape == (2, 2, 3)
    np.testing.assert_array_equal(l2, [1, 3])


def test_pad_dtype_cast():
    samples = [[1, 2, 3], [4], np.array([5, 6], np.int64)]
    out = Pad(dtype="float16", val=-1)(samples)
    assert_same(out, np.array([[1, 2, 3], [4, -1, -1], [5, 6, -1]], np.float16))
    assert_one_buffer(out)
    assert "float16" in repr(Pad(dtype=np.float16))


def test_pad_equal_lengths_is_stack():
    samples = [np.arange(3) for _ in range(2)]
    assert_same(Pad()(samples), np.stack(samples))


def test_pad_errors():
    with pytest.raises(ValueError, match=r"cannot pad 0-d samples.*Stack\(\)"):
        Pad()([1, 2])
    with pytest.raises(ValueError, match=r"pad axis 2 is out of range"):
        Pad(axis=2)([np.zeros((2, 2)), np.zeros((2, 2))])
    with pytest.raises(ValueError, match=r"sample 1 has 1 dimensions"):
        Pad()([np.zeros((2, 2)), np.zeros(3)])
    with pytest.raises(ValueError, match=r"(?=.*int32)(?=.*float64)"):
        Pad()([np.zeros(2, np.int32), np.zeros(3)])
    with pytest.raises(ValueError, match=r"pad value -1 cannot be represented as uint8"):
        Pad(val=-1)([np.zeros(2, np.uint8), np.zeros(3, np.uint8)])
    with pytest.raises(ValueError, match=r"batch 4, field sample: sample 1 cannot be cast to float32"):
        collate(Pad(dtype="float32"), [np.array([1.0]), np.array(["a"])], batch_index=4)
    with pytest.raises(TypeError, match=r"batch 4, field sample: sample 1 is None"):
        collate(Pad(dtype="float32"), [np.array([1.0]), None], batch_index=4)


def test_tuple_of_builtins():
    samples = [(np.arange(n), n, f"w{n}", np.ones(2)) for n in (2, 3)]
    out = Tuple(Pad(val=-1), Stack(), List(), default_batchify)(samples)
    assert_same(out, (np.array([[0, 1, -1], [0, 1, 2]]), np.array([2, 3]), ["w2", "w3"],
                      np.ones((2, 2))))
    assert_one_buffer(out, samples)
    # the single-sequence form
    out2 = Tuple([Pad(val=-1), Stack(), List(), default_batchify])(samples)
    assert_same(out2, out)
    assert repr(Tuple(Stack(), List())) == "Tuple(Stack(), List())"


def test_tuple_on_namedtuple_samples_gives_tuple():
    out = Tuple(Stack(), Stack())([Point(1, 2), Point(3, 4)])
    assert_same(out, (np.array([1, 3]), np.array([2, 4])))


def test_tuple_custom_plain_function():
    marker = object()
    seen = []

    def custom(column):
        seen.append(list(column))
        return {"sum": np.sum(column, axis=0), "tags": ["t"] * len(column),
                "obj": marker, "nested": (np.array(len(column), np.int16), [np.float32(1.5)]),
                "pt": Point(np.ones(3, np.float32)[::2], "y")}

    samples = [(np.arange(4) * i, np.full(3, i)) for i in range(3)]
    out = Tuple(custom, Stack())(samples)
    assert len(seen) == 1 and len(seen[0]) == 3
    assert type(out) is tuple
    res = out[0]
    assert list(res) == ["sum", "tags", "obj", "nested", "pt"]
    assert_same(res["sum"], np.sum([s[0] for s in samples], axis=0))
    assert res["tags"] == ["t", "t", "t"]
    assert res["obj"] is marker
    assert type(res["nested"]) is tuple
    assert_same(res["nested"][0], np.array(3, np.int16))
    assert res["nested"][1] == [np.float32(1.5)] and type(res["nested"][1][0]) is np.float32
    assert type(res["pt"]) is Point and res["pt"].y == "y"
    assert_same(res["pt"].x, np.ones(2, np.float32))
    assert_same(out[1], np.stack([s[1] for s in samples]))
    # The custom function's arrays were copied into the batch's single buffer.
    assert_one_buffer(out, samples)


def test_tuple_errors():
    with pytest.raises(ValueError, match="at least one"):
        Tuple()
    with pytest.raises(TypeError, match=r"Tuple\(\) argument 1 is not callable: 3"):
        Tuple(Stack(), 3)
    with pytest.raises(ValueError,
                       match=r"batch 2, field sample: sample 1 is length 3, "
                             r"expected a tuple/list of length 2"):
        collate(Tuple(Stack(), Stack()), [(1, 2), (1, 2, 3)], batch_index=2)
    with pytest.raises(TypeError, match=r"batch 2, field sample: sample 0 is a int, expected a tuple/list"):
        collate(Tuple(Stack(), Stack()), [1, 2], batch_index=2)


def test_dict_named_keys_and_default_for_others():
    samples = [{"name": f"n{n}", "tokens": np.arange(n, dtype=np.int32), "label": n}
               for n in (1, 3)]
    out = Dict(tokens=Pad(val=-1, ret_length=True))(samples)
    assert list(out) == ["name", "tokens", "label"]
    assert out["name"] == ["n1", "n3"]
    assert_same(out["tokens"], (np.array([[0, -1, -1], [0, 1, 2]], np.int32), np.array([1, 3])))
    assert_same(out["label"], np.array([1, 3]))
    assert_one_buffer(out, samples)
    # positional mapping form, merged with kwargs
    out2 = Dict({"tokens": Pad(val=-1, ret_length=True)}, name=List())(samples)
    assert_same(out2, out)
    assert "tokens" in repr(Dict(tokens=Pad()))


def test_dict_errors():
    with pytest.raises(TypeError, match=r"Dict\(\) function for key 'a' is not callable: 3"):
        Dict(a=3)
    with pytest.raises(TypeError, match="not callable"):
        Dict({"a": "Stack"})
    with pytest.raises(ValueError,
                       match=r"batch 7, field sample: "
                             r"samples have no key\(s\) \['label'\] named in Dict\(\)"):
        collate(Dict(label=Stack()), [{"x": 1}, {"x": 2}], batch_index=7)
    with pytest.raises(ValueError,
                       match=r"batch 7, field sample: "
                             r"sample 1 has different keys.*missing \['b'\], extra \['c'\]"):
        collate(Dict(), [{"a": 1, "b": 2}, {"a": 1, "c": 2}], batch_index=7)
    with pytest.raises(TypeError, match=r"batch 7, field sample: sample 0 is a tuple, expected a dict"):
        collate(Dict(), [(1, 2), (3, 4)], batch_index=7)
    with pytest.raises(TypeError, match=r"sample 1 is a NoneType, expected a dict"):
        Dict()([{"a": 1}, None])


def test_list_keeps_samples():
    a, b = object(), object()
    out = List()([a, b])
    assert type(out) is list and out[0] is a and out[1] is b
    assert repr(List()) == "List()"
    arrs = [np.zeros(2), np.ones(3)]
    out = List()(arrs)
    assert out[0] is arrs[0] and out[1] is arrs[1]


# ---------------------------------------------------------------------------
# plan_batch / fill / layout (the worker -> main path)


def test_plan_custom_plain_function_and_layout_roundtrip():
    marker = "passed-through"

    def batchify(samples):
        return {"x": np.stack([s["x"] for s in samples]),
                "names": [s["name"] for s in samples],
                "meta": {"n": np.array(len(samples), np.int64), "s": marker,
                         "pair": (np.float16([1, 2]), None)},
                "ragged": [np.arange(3, dtype=np.uint8), np.arange(5, dtype=np.uint8)]}

    samples = [{"x": np.full((2, 3), i, np.float32), "name": f"s{i}"} for i in range(4)]
    plan = plan_batch(batchify, samples, batch_index=0)
    assert plan.nbytes % 64 == 0
    assert all(int(o) % 64 == 0 for o in plan.offsets)
    stats, _ = plan.field_stats([0] * len(plan.fields))
    paths = [f[0] for f in stats]
    assert paths == ["batch['x']", "batch['meta']['n']", "batch['meta']['pair'][0]",
                     "batch['ragged'][0]", "batch['ragged'][1]",
                     "batch['names'][0]", "batch['names'][1]", "batch['names'][2]", "batch['names'][3]",
                     "batch['meta']['s']", "batch['meta']['pair'][1]"]
    assert [kernel for _, kernel, *_ in stats] == ["copy"] * 5 + ["pickled"] * 6

    buf = allocate(plan.nbytes)
    views, times = plan.fill(buf)
    assert len(views) == len(times) == 5
    layout = pickle.loads(pickle.dumps(plan.layout()))  # what a worker sends
    out = views_from_layout(layout, buf)
    want = batchify(samples)
    assert_same(out, want)
    assert out["meta"]["s"] == marker and out["meta"]["pair"][1] is None
    assert_one_buffer(out, samples)
    for a in arrays_in(out):
        assert root_of(a) is root_of(buf)


def test_plan_builtin_fill_at_offset_matches_collate():
    samples = [(np.arange(n, dtype=np.int16), {"y": float(n), "s": "t"}) for n in (1, 4, 2)]
    fn = Tuple(Pad(val=-1, ret_length=True), default_batchify)
    plan = plan_batch(fn, samples, batch_index=3)
    assert [s[1] for s in plan.field_stats([0] * 3)[0]] == ["pad", "copy", "copy", "pickled"]
    raw = allocate(plan.nbytes + 256)
    plan.fill(raw, base_offset=128)
    out = views_from_layout(plan.layout(), raw, base_offset=128)
    assert_same(out, fn(samples))
    assert_one_buffer(out, samples)
    # Also works over a bytearray (any writable buffer).
    ba = bytearray(plan.nbytes)
    plan.fill(ba)
    assert_same(views_from_layout(plan.layout(), ba), fn(samples))


def test_plan_layout_has_no_data():
    samples = [np.zeros(1000, np.float64) for _ in range(8)]
    plan = plan_batch(default_batchify, samples)
    assert len(pickle.dumps(plan.layout())) < 1000
    assert plan.nbytes == 8 * 1000 * 8


def test_collate_plain_function_is_called_directly():
    calls = []

    def fn(samples):
        calls.append(samples)
        return "result"

    assert collate(fn, [1, 2], batch_index=0) == "result"
    assert calls == [[1, 2]]


def test_plain_function_errors_propagate():
    def boom(samples):
        raise KeyError("from user")

    with pytest.raises(KeyError, match="from user"):
        plan_batch(boom, [1])
    with pytest.raises(KeyError, match="from user"):
        Tuple(boom)([(1,)])


# ---------------------------------------------------------------------------
# Planner: what a Batchify subclass's plan() may do with the planner it gets


class _Normalised(Batchify):
    """Scales the samples, then lets Stack plan them (composition)."""

    def plan(self, samples, path, planner):
        return Stack().plan([np.asarray(s, np.float32) / 2 for s in samples], path, planner)


class _Planned(Batchify):
    """Plans its samples with one call of the planner it gets."""

    def __init__(self, how):
        self.how = how

    def plan(self, samples, path, planner):
        if any(s is None for s in samples):
            raise planner.error(ValueError, path, "a sample is None")
        return self.how(planner, samples, path)


@pytest.mark.parametrize("how,want", [
    (lambda p, s, path: p.plan(Pad(val=-1), s, path), [[0, 1, 2], [0, -1, -1]]),
    (lambda p, s, path: p.plan(lambda x: [len(a) for a in x], s, path), [3, 1]),   # plain callable
    (lambda p, s, path: p.add_array(path, np.array([len(a) for a in s], np.int32)), [3, 1]),
    (lambda p, s, path: p.add_value(path, {"n": np.array([len(a) for a in s]), "tag": "raw"}),
     {"n": [3, 1], "tag": "raw"}),
    (lambda p, s, path: p.add_object(path, "raw"), "raw"),
])
def test_planner_public_methods(how, want):
    samples = [np.arange(3), np.arange(1)]
    plan = plan_batch(_Planned(how), samples, batch_index=7)
    buf = allocate(plan.nbytes)
    plan.fill(buf)
    out = views_from_layout(pickle.loads(pickle.dumps(plan.layout())), buf)   # as a worker sends it
    if isinstance(out, dict):
        out = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in out.items()}
    elif isinstance(out, np.ndarray):
        assert np.shares_memory(out, buf)
        out = out.tolist()
    assert out == want
    assert _Planned(how)(samples) is not None   # the same plan, collated in-process
    with pytest.raises(ValueError, match=r"^cannot collate batch 7, field sample: a sample is None$"):
        plan_batch(_Planned(how), [None, np.zeros(1)], batch_index=7)


def test_planner_composes_a_builtin():
    assert_same(_Normalised()([np.ones(2), np.full(2, 4.0)]), np.array([[0.5, 0.5], [2, 2]], np.float32))


def test_planner_is_public_in_plan_signatures():
    import inspect
    import typing

    import mxload.batchify as bfy
    hints = typing.get_type_hints(Batchify.plan, vars(bfy))
    assert hints["planner"] is Planner and "Planner" in bfy.__all__
    assert Planner.__module__.startswith("mxload.") and not Planner.__name__.startswith("_")
    assert "planner" in inspect.signature(GatheredSamples.plan_columns).parameters


# ---------------------------------------------------------------------------
# GatheredSamples


def _gathered_cases():
    rng = np.random.default_rng(0)
    n = 10
    return {
        "multi": (rng.standard_normal((n, 3, 2)).astype(np.float32), np.arange(n),
                  rng.integers(0, 2, n).astype(bool), np.arange(n, dtype=np.float16),
                  np.arange(2 * n, dtype=np.complex64).reshape(n, 2)),
        "single_2d": (np.arange(n * 4, dtype=np.int8).reshape(n, 4),),
        "single_1d": (np.arange(n, dtype=np.uint16),),
        # index 1 (never gathered below) holds the widest string
        "strings": (np.array(["a", "longest!", "cc", "a", "b", "cc", "a", "dd", "c", "d"]),
                    np.arange(n), np.array([["x", "yy"]] * n)),
        "bytes": (np.array([b"a", b"longest!", b"cc", b"a", b"b", b"cc", b"a", b"dd", b"c", b"d"]),),
        "big_endian": (np.arange(n, dtype=">i4"), np.arange(n * 2, dtype=">f8").reshape(n, 2)),
        "structured": (np.zeros(n, dtype=[("a", "<i4"), ("b", "<f8")]),),
    }


@pytest.mark.parametrize("case", list(_gathered_cases()))
def test_gathered_samples_match_per_sample_path(case):
    cols = _gathered_cases()[case]
    ds = mxload.ArrayDataset(*cols)
    idx = [7, 0, 3, 3, 9]
    gathered = ds.__getitems__(idx)
    assert isinstance(gathered, GatheredSamples)
    per_sample = [ds[i] for i in idx]
    assert len(gathered) == len(idx)
    assert_same(list(gathered), per_sample)
    out_g = collate(default_batchify, gathered, batch_index=1)
    out_s = collate(default_batchify, per_sample, batch_index=1)
    assert_same(out_g, out_s)
    assert_one_buffer(out_g, cols)
    # the plans describe the same layout
    lay_g = plan_batch(default_batchify, gathered).layout()
    lay_s = plan_batch(default_batchify, per_sample).layout()
    assert [(s, np.dtype(d).str) for _, s, d in lay_g[1]] == [(s, np.dtype(d).str) for _, s, d in lay_s[1]]


def test_gathered_samples_with_explicit_batchify():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    y = np.arange(10)
    ds = mxload.ArrayDataset(x, y)
    gathered = ds.__getitems__([1, 5, 2])
    per_sample = [ds[i] for i in (1, 5, 2)]
    fn = Tuple(Stack(), List())
    assert_same(fn(gathered), fn(per_sample))
    assert_same(List()(gathered), per_sample)


def test_gathered_samples_sequence_behaviour():
    ds = mxload.ArrayDataset(np.arange(5), np.arange(5) * 10)
    g = ds.__getitems__(np.array([4, 1]))
    assert len(g) == 2
    assert g[0] == (4, 40) and g[-1] == (1, 10)
    assert list(g) == [(4, 40), (1, 10)]
    assert g == ds.__getitems__([4, 1])
    assert g != [(4, 40)]
    assert "GatheredSamples" in repr(g)
    single = mxload.ArrayDataset(np.arange(5)).__getitems__([2, 3])
    assert single.single and list(single) == [2, 3]
    with pytest.raises(TypeError):
        hash(g)


# ---------------------------------------------------------------------------
# Error paths: batch index + field path in every message


def test_error_ragged_without_pad():
    samples = [{"image": np.zeros((3, 2)), "label": 1}, {"image": np.zeros((4, 2)), "label": 2}]
    with pytest.raises(ValueError, match=r"cannot collate batch 5, field sample\['image'\]: "
                                         r"sample 1 has shape \(4, 2\), expected \(3, 2\).*use Pad\(\)"):
        collate(default_batchify, samples, batch_index=5)
    with pytest.raises(ValueError, match=r"batch 5, field sample\['image'\].*Pad"):
        plan_batch(default_batchify, samples, batch_index=5)


def test_error_mixed_dtypes_names_both():
    samples = [(np.zeros(2, np.float32), np.zeros(2, np.float32)),
               (np.zeros(2, np.float32), np.zeros(2, np.int64))]
    with pytest.raises(ValueError, match=r"batch 2, field sample\[1\]: sample 1 has dtype int64, "
                                         r"expected float32") as info:
        collate(default_batchify, samples, batch_index=2)
    assert "Pad" not in str(info.value)
    with pytest.raises(ValueError, match=r"(?=.*int8)(?=.*uint8)"):
        Stack()([np.zeros(2, np.int8), np.zeros(2, np.uint8)])


def test_error_object_arrays():
    obj = np.array([1, None], dtype=object)
    with pytest.raises(TypeError, match=r"batch 0, field sample\['x'\]: sample 0 has dtype object"):
        collate(default_batchify, [{"x": obj}, {"x": obj}], batch_index=0)
    with pytest.raises(TypeError, match=r"sample 1 has dtype object"):
        collate(Stack(), [np.zeros(2), obj], batch_index=0)
    with pytest.raises(TypeError, match=r"object"):
        collate(Pad(), [np.zeros(2), obj], batch_index=0)


def test_error_inconsistent_dict_keys():
    samples = [{"a": 1, "b": 2}, {"a": 1, "b": 2}, {"a": 3, "c": 4, "d": 5}]
    with pytest.raises(ValueError, match=r"batch 9, field sample: sample 2 has different keys than "
                                         r"sample 0 \(missing \['b'\], extra \['c', 'd'\]\)"):
        collate(default_batchify, samples, batch_index=9)
    nested = [({"a": 1},), ({"b": 1},)]
    with pytest.raises(ValueError, match=r"field sample\[0\]: .*missing \['a'\], extra \['b'\]"):
        collate(default_batchify, nested, batch_index=9)


def test_error_none_sample():
    with pytest.raises(TypeError, match=r"batch 1, field sample: sample 0 is None"):
        collate(default_batchify, [None, np.zeros(2)], batch_index=1)
    with pytest.raises(TypeError, match=r"batch 1, field sample: sample 1 is None"):
        collate(default_batchify, [np.zeros(2), None], batch_index=1)
    with pytest.raises(TypeError, match=r"batch 1, field sample: sample 1 is None"):
        collate(default_batchify, [(1, 2), None], batch_index=1)
    with pytest.raises(TypeError, match=r"batch 1, field sample\[1\]: sample 1 is None"):
        collate(default_batchify, [(1, 2), (1, None)], batch_index=1)
    with pytest.raises(TypeError, match=r"field sample\['y'\]: sample 0 is None"):
        default_batchify([{"y": None}, {"y": 1}])
    with pytest.raises(TypeError, match=r"sample 1 is None"):
        Stack()([1.0, None])


def test_error_tuple_lengths_differ():
    with pytest.raises(ValueError, match=r"batch 4, field sample: sample 2 is length 3, "
                                         r"expected a tuple/list of length 2"):
        collate(default_batchify, [(1, 2), (3, 4), (5, 6, 7)], batch_index=4)
    with pytest.raises(ValueError, match=r"field sample\.y: sample 1 is length 1"):
        default_batchify([Point(1, (1, 2)), Point(2, (3,))])


def test_error_empty_sample_list():
    with pytest.raises(ValueError, match=r"cannot collate batch 6: it has no samples"):
        collate(default_batchify, [], batch_index=6)
    with pytest.raises(ValueError, match=r"batch 6: it has no samples"):
        plan_batch(Stack(), [], batch_index=6)
    with pytest.raises(ValueError, match="no samples"):
        default_batchify([])
    with pytest.raises(ValueError, match="no samples"):
        plan_batch(lambda s: s, [])


def test_error_unknown_type():
    class Widget:
        pass

    with pytest.raises(TypeError, match=r"batch 3, field sample\[0\]: sample 0 has type Widget, "
                                        r"which default_batchify cannot collate; pass a batchify_fn"):
        collate(default_batchify, [(Widget(), 1), (Widget(), 2)], batch_index=3)
    with pytest.raises(TypeError, match=r"has type set"):
        default_batchify([{1}, {2}])


def test_error_paths_in_nested_structures():
    samples = [Sample(np.zeros(2), {"box": (1, np.zeros(2))}),
               Sample(np.zeros(2), {"box": (1, np.zeros(3))})]
    with pytest.raises(ValueError, match=r"field sample\.meta\['box'\]\[1\]: sample 1 has shape"):
        collate(default_batchify, samples, batch_index=0)
    with pytest.raises(ValueError, match=r"batch 8, field sample\[1\]: sample 1 has dtype int32, "
                                         r"expected float64"):
        collate(Tuple(Stack(), Pad(axis=1)), [(1, np.zeros((2, 2))), (2, np.zeros((3, 3), np.int32))],
                batch_index=8)
    with pytest.raises(ValueError, match=r"field sample\['t'\]: .*Pad"):
        collate(Dict(t=Stack()), [{"t": np.zeros(1)}, {"t": np.zeros(2)}])


def test_error_without_batch_index_has_no_batch_word():
    with pytest.raises(ValueError) as info:
        Stack()([np.zeros(1), np.zeros(2)])
    assert str(info.value).startswith("cannot collate field sample: ")
