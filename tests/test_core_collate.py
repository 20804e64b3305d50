"""Tests for mxload._core's collation kernels (stack, pad, copy_into), the
layout planner and the shared-memory Slab / BatchOwner types."""
import gc
import os
import re
import sys
import time

import fresh_python
import numpy as np
import pytest

from mxload import _core
from mxload._core import BatchOwner, Slab, copy_into, pad, plan_layout, stack

pytestmark = pytest.mark.timeout(60)

STRUCT = np.dtype([("a", "<i4"), ("b", "<f8"), ("c", "U3"), ("d", "u1", (2,))])

DTYPES = [
    np.bool_,
    np.int8, np.int16, np.int32, np.int64,
    np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64,
    np.complex64, np.complex128,
    "U5", "S3", STRUCT,
    ">i4", ">f8", "M8[ms]", "m8[us]",
]
DTYPE_IDS = [np.dtype(d).str if np.dtype(d).names is None else "struct" for d in DTYPES]

SHAPES = [(), (7,), (2, 3, 4)]
SHAPE_IDS = ["0d", "1d", "3d"]


def random_array(shape, dtype, rng):
    """Valid random values of any of DTYPES (no NaN, so == works)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64))
    if dtype.names is not None:
        out = np.zeros(shape, dtype)
        for name in dtype.names:
            sub = dtype[name]
            field_shape = tuple(shape) + sub.shape
            out[name] = random_array(field_shape, sub.base, rng)
        return out
    kind = dtype.kind
    if kind == "b":
        vals = rng.integers(0, 2, size).astype(bool)
    elif kind in "iu":
        info = np.iinfo(dtype)
        vals = rng.integers(info.min, info.max, size, dtype=dtype.newbyteorder("="), endpoint=True)
    elif kind == "f":
        vals = rng.standard_normal(size) * 100
    elif kind == "c":
        vals = rng.standard_normal(size) * 100 + 1j * rng.standard_normal(size)
    elif kind in "US":
        letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
        n = dtype.itemsize // (4 if kind == "U" else 1)
        vals = ["".join(rng.choice(letters, rng.integers(0, n + 1))) for _ in range(size)]
    elif kind in "mM":
        vals = rng.integers(-(10**12), 10**12, size)
    else:  # pragma: no cover - the list above is exhaustive
        raise AssertionError(dtype)
    return np.array(vals).astype(dtype).reshape(shape)


def assert_same(got, ref):
    assert isinstance(got, np.ndarray)
    assert got.dtype == ref.dtype
    assert got.shape == ref.shape
    assert got.flags.c_contiguous
    assert got.tobytes() == np.ascontiguousarray(ref).tobytes()
    np.testing.assert_array_equal(got, ref)


def np_stack(arrays):
    """np.stack, except that like mxload (a byte copy) it keeps the samples'
    byte order; numpy's concatenate returns native byte order."""
    ref = np.stack(arrays)
    dt = np.asarray(arrays[0]).dtype
    if ref.dtype != dt:
        assert ref.dtype == dt.newbyteorder("="), (ref.dtype, dt)
        ref = ref.astype(dt)
    return ref


def pad_reference(arrays, axis, val, dtype):
    nd = arrays[0].ndim
    axis = axis % nd
    longest = max(a.shape[axis] for a in arrays)
    shape = list(arrays[0].shape)
    shape[axis] = longest
    ref = np.empty((len(arrays),) + tuple(shape), dtype)
    ref[...] = np.array(val, dtype=dtype)
    for i, a in enumerate(arrays):
        idx = [slice(None)] * nd
        idx[axis] = slice(0, a.shape[axis])
        ref[(i,) + tuple(idx)] = a
    return ref


PAD_VALUES = {
    "b": True, "i": -7, "u": 7, "f": -1.5, "c": 1.5 - 2j, "U": "pad", "S": b"zz",
    "V": (1, 2.5, "x", (3, 4)), "M": np.datetime64(5, "ms"), "m": np.timedelta64(5, "us"),
}


def pad_value_for(dtype):
    return PAD_VALUES[np.dtype(dtype).kind]


# ---------------------------------------------------------------------------
# stack
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_stack_matches_numpy(dtype, shape):
    rng = np.random.default_rng(abs(hash((str(dtype), shape))) % 2**32)
    arrays = [random_array(shape, dtype, rng) for _ in range(5)]
    got = stack(arrays)
    assert_same(got, np_stack(arrays))
    # the inputs were not modified or aliased
    assert not any(np.shares_memory(got, a) for a in arrays)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_stack_single_sample(dtype):
    rng = np.random.default_rng(1)
    a = random_array((3, 2), dtype, rng)
    assert_same(stack([a]), a[None])


def test_stack_accepts_tuple_generator_and_non_arrays():
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert_same(stack((a, a + 1)), np_stack([a, a + 1]))
    assert_same(stack(x for x in (a, a * 2)), np_stack([a, a * 2]))
    assert_same(stack([1, 2, 3]), np_stack([1, 2, 3]))
    assert_same(stack([np.float32(1.5), np.float32(2.5)]), np.array([1.5, 2.5], np.float32))
    assert_same(stack([[1, 2], [3, 4]]), np.array([[1, 2], [3, 4]]))


def test_stack_ndarray_subclass_is_converted():
    class Sub(np.ndarray):
        pass

    a = np.arange(4.0).view(Sub)
    got = stack([a, a])
    assert type(got) is np.ndarray
    assert_same(got, np_stack([np.asarray(a)] * 2))


def test_stack_equivalent_dtypes_allowed():
    # 'l' and 'q' are distinct dtype objects but the same bytes on LP64
    a = np.arange(3, dtype=np.dtype("q"))
    b = np.arange(3, dtype=np.dtype("l")) + 10
    if np.dtype("q").itemsize != np.dtype("l").itemsize:
        pytest.skip("long is not 64-bit here")
    assert_same(stack([a, b]), np_stack([a, b]))


def test_stack_empty_samples():
    a = np.zeros((0, 3), np.float32)
    assert_same(stack([a, a]), np.zeros((2, 0, 3), np.float32))


def test_stack_many_dims():
    rng = np.random.default_rng(5)
    shape = (2,) * 12
    arrays = [random_array(shape, np.int16, rng) for _ in range(3)]
    # make them non-contiguous in several dims
    arrays = [a.transpose(list(range(11, -1, -1))) for a in arrays]
    assert_same(stack(arrays), np_stack(arrays))


def _layouts(rng, dtype):
    """The same logical (4, 6) sample in many memory layouts."""
    base = random_array((8, 12), dtype, rng)
    c = np.ascontiguousarray(base[:4, :6])
    return {
        "contiguous": c,
        "transposed": np.ascontiguousarray(c.T).T,
        "fortran": np.asfortranarray(c),
        "reversed_rows": np.ascontiguousarray(c[::-1])[::-1],
        "reversed_cols": np.ascontiguousarray(c[:, ::-1])[:, ::-1],
        "reversed_both": np.ascontiguousarray(c[::-1, ::-1])[::-1, ::-1],
        "step_rows": np.repeat(c, 2, axis=0)[::2],
        "step_cols": np.repeat(c, 3, axis=1)[:, ::3],
        "sub_block": np.pad(c, ((1, 2), (3, 1)))[1:5, 3:9],
    }


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.float32, np.float64,
                                   np.complex128, "U5", STRUCT], ids=str)
def test_stack_non_contiguous_inputs(dtype):
    rng = np.random.default_rng(7)
    layouts = _layouts(rng, dtype)
    c = layouts["contiguous"]
    for name, arr in layouts.items():
        np.testing.assert_array_equal(arr, c, err_msg=name)
        assert name == "contiguous" or not arr.flags.c_contiguous, name
    layouts["broadcast_rows"] = np.broadcast_to(c[0], c.shape)  # zero stride
    for arr in layouts.values():
        got = stack([arr, c, arr])
        assert_same(got, np_stack([arr, c, arr]))
    # every layout in one batch
    arrays = list(layouts.values())
    assert_same(stack(arrays), np_stack(arrays))


@pytest.mark.parametrize("shape", [(5,), (3, 4, 5)], ids=["1d", "3d"])
def test_stack_negative_stride_and_step_slices(shape):
    big = tuple(s * 2 for s in shape)
    base = np.arange(np.prod(big), dtype=np.float64).reshape(big)
    sl = tuple(slice(None, None, -2) for _ in shape)
    a = base[sl]
    assert a.shape == shape
    b = base[tuple(slice(1, None, 2) for _ in shape)]
    assert_same(stack([a, b, a]), np_stack([a, b, a]))


# ---- out= ----


def test_stack_out_is_used():
    arrays = [np.full((2, 3), i, np.int32) for i in range(4)]
    out = np.full((4, 2, 3), -1, np.int32)
    res = stack(arrays, out=out)
    assert res is out
    assert_same(out, np_stack(arrays))


def test_stack_out_validation():
    arrays = [np.zeros((2, 3), np.float64) for _ in range(3)]
    with pytest.raises(ValueError, match=re.escape("out has shape (4, 2, 3), expected (3, 2, 3)")):
        stack(arrays, out=np.empty((4, 2, 3)))
    with pytest.raises(ValueError, match=re.escape("out has shape (3, 6), expected (3, 2, 3)")):
        stack(arrays, out=np.empty((3, 6)))
    with pytest.raises(ValueError, match="out has dtype float32, expected float64"):
        stack(arrays, out=np.empty((3, 2, 3), np.float32))
    # any strides are fine (see test_stack_writes_only_out)
    for out in (np.empty((3, 2, 6))[:, :, ::2], np.empty((3, 2, 3), order="F")):
        np.testing.assert_array_equal(stack(arrays, out=out), np_stack(arrays))
    ro = np.empty((3, 2, 3))
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        stack(arrays, out=ro)
    with pytest.raises(TypeError):
        stack(arrays, out=[[0.0] * 3] * 2)


def test_stack_out_1d_shape_message():
    with pytest.raises(ValueError, match=re.escape("out has shape (3,), expected (2,)")):
        stack([np.float64(1), np.float64(2)], out=np.empty(3))


# ---- errors ----


def test_stack_shape_mismatch_names_sample_and_shapes():
    a = np.zeros(3)
    with pytest.raises(ValueError, match=re.escape("sample 2 has shape (4,), expected (3,)")):
        stack([a, a, np.zeros(4), a])
    with pytest.raises(ValueError, match=re.escape("sample 1 has shape (3, 1), expected (3,)")):
        stack([a, np.zeros((3, 1))])
    with pytest.raises(ValueError, match=re.escape("sample 1 has shape (), expected (3,)")):
        stack([a, np.zeros(())])
    with pytest.raises(ValueError, match=re.escape("sample 3 has shape (2, 5), expected (2, 4)")):
        stack([np.zeros((2, 4))] * 3 + [np.zeros((2, 5))])


def test_stack_dtype_mismatch_names_sample_and_dtypes():
    a = np.zeros(3, np.float64)
    with pytest.raises(ValueError, match=r"sample 1 has dtype float32, expected float64"):
        stack([a, np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match=r"sample 2 has dtype int64, expected float64"):
        stack([a, a, np.zeros(3, np.int64)])
    # byte order matters for a byte copy
    with pytest.raises(ValueError, match=r"sample 1 has dtype >i4, expected int32"):
        stack([np.zeros(3, "<i4"), np.zeros(3, ">i4")])
    with pytest.raises(ValueError, match=r"sample 1 has dtype <U4, expected <U5"):
        stack([np.zeros(3, "U5"), np.zeros(3, "U4")])


def test_stack_object_arrays_rejected():
    obj = np.array([1, "a", None], dtype=object)
    with pytest.raises(TypeError, match=r"sample 0 has dtype object \(Python objects\)"):
        stack([obj, obj])
    with pytest.raises(TypeError, match=r"sample 1 has dtype object"):
        stack([np.zeros(3), obj])
    rec = np.zeros(2, dtype=[("a", "i4"), ("b", "O")])
    with pytest.raises(TypeError, match="sample 0 has dtype"):
        stack([rec, rec])


def test_stack_none_sample_rejected():
    with pytest.raises(TypeError, match="sample 1 is None; cannot stack None"):
        stack([np.zeros(2), None])
    with pytest.raises(TypeError, match="sample 0 is None"):
        stack([None])


def test_stack_empty_rejected():
    with pytest.raises(ValueError, match="cannot stack an empty list of samples"):
        stack([])
    with pytest.raises(ValueError, match="cannot stack an empty list"):
        stack(())
    with pytest.raises(ValueError, match="cannot stack an empty list"):
        stack(x for x in [])


def test_stack_does_not_mutate_input_list():
    samples = [np.zeros(2), [1.0, 2.0]]
    stack(samples)
    assert isinstance(samples[1], list)


# ---- lower level ----


def test_stack_check_and_fill():
    a = np.arange(6, dtype=np.int16).reshape(2, 3)
    arrs, shape, dtype = _core.stack_check([a, a.T.copy().T, np.zeros((2, 3), np.int16)])
    assert shape == (3, 2, 3)
    assert dtype == np.int16
    assert isinstance(arrs, list) and len(arrs) == 3
    assert all(type(x) is np.ndarray for x in arrs)
    # a list sample is converted with numpy's default int dtype -> mismatch
    with pytest.raises(ValueError, match="sample 2 has dtype int64, expected int16"):
        _core.stack_check([a, a, [[0, 0, 0], [1, 1, 1]]])
    arrs, shape, dtype = _core.stack_check([a, a * 2])
    out = np.empty(shape, dtype)
    ns = _core.stack_fill(arrs, out)
    assert isinstance(ns, int) and ns >= 0
    assert_same(out, np_stack([a, a * 2]))


# ---------------------------------------------------------------------------
# pad
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("nd", [1, 3], ids=["1d", "3d"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pad_matches_reference(dtype, nd):
    rng = np.random.default_rng(11)
    lengths = [5, 1, 0, 3, 5]
    rest = (2, 3)[: nd - 1]
    arrays = [random_array((n,) + rest, dtype, rng) for n in lengths]
    val = pad_value_for(dtype)
    got, lens = pad(arrays, val=val, ret_length=True)
    assert_same(got, pad_reference(arrays, 0, val, dtype))
    assert lens.dtype == np.int64
    assert lens.tolist() == lengths


def _numeric_pad_cases():
    for dtype in (np.int8, np.uint16, np.int64, np.float32, np.float64, np.complex64):
        for val in (0, 1, -1, 2.5, 100):
            kind = np.dtype(dtype).kind
            if kind in "iu" and (isinstance(val, float) or (kind == "u" and val < 0)):
                continue  # not representable: see test_pad_value_not_representable
            yield pytest.param(dtype, val, id=f"{np.dtype(dtype)}-{val}")


@pytest.mark.parametrize("dtype,val", list(_numeric_pad_cases()))
def test_pad_numeric_values(dtype, val):
    dtype = np.dtype(dtype)
    arrays = [np.arange(n, dtype=dtype) + 1 for n in (4, 2, 7, 0)]
    got = pad(arrays, val=val)
    assert_same(got, pad_reference(arrays, 0, val, dtype))


def test_pad_default_value_is_zero():
    arrays = [np.ones(3, np.float32), np.ones(1, np.float32)]
    assert_same(pad(arrays), np.array([[1, 1, 1], [1, 0, 0]], np.float32))


def test_pad_nan_and_inf_values():
    arrays = [np.ones(3), np.ones(1)]
    got = pad(arrays, val=float("nan"))
    assert np.isnan(got[1, 1:]).all() and (got[0] == 1).all() and got[1, 0] == 1
    got = pad(arrays, val=-np.inf)
    assert (got[1, 1:] == -np.inf).all()


def test_pad_long_rows_non_uniform_pattern():
    # -1.5 as float64 is not one repeated byte: exercises the pattern fill
    arrays = [np.arange(1000.0), np.arange(1.0), np.arange(257.0)]
    assert_same(pad(arrays, val=-1.5), pad_reference(arrays, 0, -1.5, np.float64))
    # -1 as int32 is 0xff bytes: the memset fast path
    arrays = [np.arange(999, dtype=np.int32), np.arange(3, dtype=np.int32)]
    assert_same(pad(arrays, val=-1), pad_reference(arrays, 0, -1, np.int32))


def test_pad_equal_lengths_equals_stack():
    rng = np.random.default_rng(3)
    arrays = [random_array((4, 2), np.float32, rng) for _ in range(3)]
    got, lens = pad(arrays, val=9, ret_length=True)
    assert_same(got, np_stack(arrays))
    assert lens.tolist() == [4, 4, 4]


def test_pad_all_empty():
    got, lens = pad([np.zeros((0, 2)), np.zeros((0, 2))], ret_length=True)
    assert got.shape == (2, 0, 2)
    assert lens.tolist() == [0, 0]


@pytest.mark.parametrize("axis", [1, -2])
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float64, np.complex128, "U5", STRUCT], ids=str)
def test_pad_axis1_and_negative_axis(dtype, axis):
    rng = np.random.default_rng(21)
    lengths = [3, 6, 1, 0]
    arrays = [random_array((2, n, 4), dtype, rng) for n in lengths]
    val = pad_value_for(dtype)
    got, lens = pad(arrays, axis=axis, val=val, ret_length=True)
    assert got.shape == (4, 2, 6, 4)
    assert_same(got, pad_reference(arrays, axis, val, dtype))
    assert lens.tolist() == lengths


def test_pad_last_axis():
    lengths = [2, 5, 3]
    arrays = [np.full((3, n), i + 1, np.int16) for i, n in enumerate(lengths)]
    got, lens = pad(arrays, axis=-1, val=-3, ret_length=True)
    assert got.shape == (3, 3, 5)
    assert_same(got, pad_reference(arrays, -1, -3, np.int16))
    assert lens.tolist() == lengths
    got2 = pad(arrays, axis=1, val=-3)
    assert_same(got2, got)


@pytest.mark.parametrize("axis", [0, 1])
def test_pad_non_contiguous_inputs(axis):
    base = np.arange(20 * 30, dtype=np.float32).reshape(20, 30)
    samples = [
        base[::-1, :4][:7],                  # negative row stride
        base[1:10:3, 2:6],                   # step slice
        np.asfortranarray(base[:5, :4]),     # Fortran order
        base[:4, ::-1][:2, :4],              # negative column stride
        np.broadcast_to(base[0, :4], (6, 4)),  # zero stride
        base[:4, :4].T[::2][:3],             # transposed + step
    ]
    assert all(not a.flags.c_contiguous for a in samples)
    if axis == 1:
        samples = [a.T for a in samples]  # ragged along axis 1, mostly strided
        assert sum(not a.flags.c_contiguous for a in samples) == 5
    got, lens = pad(samples, axis=axis, val=-2.5, ret_length=True)
    assert_same(got, pad_reference(samples, axis, -2.5, np.float32))
    assert lens.tolist() == [a.shape[axis] for a in samples]


def test_pad_out_is_used_and_fully_written():
    arrays = [np.arange(n, dtype=np.int32) for n in (3, 1, 2)]
    out = np.full((3, 3), 12345, np.int32)
    res, lens = pad(arrays, val=-4, out=out, ret_length=True)
    assert res is out
    assert_same(out, pad_reference(arrays, 0, -4, np.int32))
    # axis=1 into stale memory
    arrays = [np.ones((2, n), np.float64) for n in (1, 3)]
    out = np.full((2, 2, 3), 77.0)
    assert pad(arrays, axis=1, out=out) is out
    assert_same(out, pad_reference(arrays, 1, 0, np.float64))


def test_pad_out_validation():
    arrays = [np.zeros(3, np.float32), np.zeros(5, np.float32)]
    with pytest.raises(ValueError, match=re.escape("out has shape (2, 3), expected (2, 5)")):
        pad(arrays, out=np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match="out has dtype float64, expected float32"):
        pad(arrays, out=np.empty((2, 5), np.float64))
    # any strides are fine (see test_pad_writes_only_out)
    out = np.empty((2, 10), np.float32)[:, ::2]
    np.testing.assert_array_equal(pad(arrays, out=out), pad_reference(arrays, 0, 0, np.float32))
    ro = np.empty((2, 5), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        pad(arrays, out=ro)


def test_pad_zero_dim_rejected():
    with pytest.raises(ValueError, match=r"cannot pad 0-d samples \(scalars\)"):
        pad([np.float32(1), np.float32(2)])
    with pytest.raises(ValueError, match="cannot pad 0-d samples"):
        pad([np.zeros(()), np.zeros(())])


def test_pad_axis_out_of_range():
    arrays = [np.zeros((2, 3)), np.zeros((2, 3))]
    with pytest.raises(ValueError, match="pad axis 2 is out of range for samples with 2 dimensions"):
        pad(arrays, axis=2)
    with pytest.raises(ValueError, match="pad axis -3 is out of range for samples with 2 dimensions"):
        pad(arrays, axis=-3)


def test_pad_other_axes_differ():
    with pytest.raises(ValueError, match=re.escape(
            "sample 2 has shape (3, 5), expected (2, 4) except along the pad axis 0")):
        pad([np.zeros((2, 4)), np.zeros((7, 4)), np.zeros((3, 5))])
    with pytest.raises(ValueError, match=re.escape(
            "sample 1 has shape (3, 4), expected (2, 4) except along the pad axis 1")):
        pad([np.zeros((2, 4)), np.zeros((3, 4))], axis=1)
    with pytest.raises(ValueError, match=re.escape(
            "sample 1 has shape (3, 4), expected (2, 4) except along the pad axis 1")):
        pad([np.zeros((2, 4)), np.zeros((3, 4))], axis=-1)


def test_pad_ndim_differs():
    with pytest.raises(ValueError, match=re.escape(
            "sample 1 has 1 dimensions (shape (3,)), expected 2 like sample 0 (shape (2, 4))")):
        pad([np.zeros((2, 4)), np.zeros(3)])


def test_pad_dtype_mismatch():
    with pytest.raises(ValueError, match="sample 1 has dtype int64, expected float64"):
        pad([np.zeros(2), np.zeros(3, np.int64)])


def test_pad_type_errors():
    with pytest.raises(TypeError, match="sample 1 is None; cannot pad None"):
        pad([np.zeros(2), None])
    obj = np.array([None, 1], dtype=object)
    with pytest.raises(TypeError, match=r"sample 0 has dtype object \(Python objects\)"):
        pad([obj])
    with pytest.raises(ValueError, match="cannot pad an empty list of samples"):
        pad([])


@pytest.mark.parametrize("val,dtype,fragment", [
    (300, np.uint8, "pad value 300 cannot be represented as uint8"),
    (-1, np.uint8, "pad value -1 cannot be represented as uint8"),
    (2**40, np.int32, f"pad value {2**40} cannot be represented as int32"),
    ("x", np.float32, "pad value 'x' cannot be represented as float32"),
    ("x", np.int64, "pad value 'x' cannot be represented as int64"),
    (None, np.int16, "pad value None cannot be represented as int16"),
])
def test_pad_value_not_representable(val, dtype, fragment):
    arrays = [np.zeros(3, dtype), np.zeros(1, dtype)]
    with pytest.raises(ValueError, match=re.escape(fragment)):
        pad(arrays, val=val)


def test_pad_value_must_be_scalar():
    arrays = [np.zeros(3), np.zeros(1)]
    # one element's bytes are needed; a sequence is rejected (today by the
    # pattern-length check in pad_fill, hence the loose match)
    with pytest.raises(ValueError, match="pad"):
        pad(arrays, val=[1, 2])


def test_pad_value_bytes():
    assert _core.pad_value_bytes(1.5, np.float32) == np.float32(1.5).tobytes()
    assert _core.pad_value_bytes(1, ">i4") == b"\x00\x00\x00\x01"
    assert _core.pad_value_bytes(-1, np.int16) == b"\xff\xff"
    assert _core.pad_value_bytes(True, np.bool_) == b"\x01"
    assert _core.pad_value_bytes("ab", "U2") == np.array("ab", "U2").tobytes()
    with pytest.raises(ValueError, match="pad value 256 cannot be represented as uint8"):
        _core.pad_value_bytes(256, np.uint8)


def test_pad_check_and_fill():
    arrays = [np.ones((2, n), np.int8) for n in (1, 4)]
    arrs, shape, dtype, lengths = _core.pad_check(arrays, axis=-1)
    assert shape == (2, 2, 4)
    assert dtype == np.int8
    assert lengths.tolist() == [1, 4]
    out = np.empty(shape, dtype)
    ns = _core.pad_fill(arrs, out, 1, _core.pad_value_bytes(5, dtype))
    assert isinstance(ns, int) and ns >= 0
    assert_same(out, pad_reference(arrays, 1, 5, np.int8))
    with pytest.raises(ValueError, match="pad pattern has 2 bytes, expected 1"):
        _core.pad_fill(arrs, out, 1, b"\x00\x00")


# ---------------------------------------------------------------------------
# copy_into
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint16, np.float32, np.int64,
                                   np.complex128, "U5", STRUCT], ids=str)
def test_copy_into_layouts(dtype):
    rng = np.random.default_rng(17)
    layouts = _layouts(rng, dtype)
    c = layouts.pop("contiguous")
    srcs = dict(layouts, contiguous=c, broadcast=np.broadcast_to(c[:1], c.shape))
    for name, src in srcs.items():
        # contiguous destination
        out = np.zeros(c.shape, c.dtype)
        ns = copy_into(src, out)
        assert isinstance(ns, int) and ns >= 0
        assert_same(out, src)
        # non-contiguous destinations
        big = np.zeros((8, 12), c.dtype)
        for dst in (big[::2, ::2], big[:4, :6], big[4:, 6:][::-1, ::-1],
                    np.zeros(c.shape, c.dtype, order="F")):
            dst[...] = np.zeros((), c.dtype)
            copy_into(src, dst)
            np.testing.assert_array_equal(dst, src, err_msg=name)
    # untouched parts of the big destination stay zero
    big = np.zeros((8, 12), np.dtype(dtype))
    copy_into(c, big[1::2, 3:9])
    mask = np.ones(big.shape, bool)
    mask[1::2, 3:9] = False
    assert (big[mask] == np.zeros((), big.dtype)).all()


def test_copy_into_0d_and_3d():
    a = np.array(3.25)
    out = np.zeros(())
    copy_into(a, out)
    assert out == 3.25
    a = np.arange(60, dtype=np.int32).reshape(3, 4, 5).transpose(2, 0, 1)
    out = np.empty(a.shape, np.int32)
    copy_into(a, out)
    assert_same(out, a)


def test_copy_into_errors():
    with pytest.raises(ValueError, match=re.escape("shape mismatch: (3,) vs (4,)")):
        copy_into(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match=re.escape("shape mismatch: (2, 3) vs (3, 2)")):
        copy_into(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match=re.escape("shape mismatch: (6,) vs (2, 3)")):
        copy_into(np.zeros(6), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="dtype mismatch: int32 vs int64"):
        copy_into(np.zeros(3, np.int32), np.zeros(3, np.int64))
    obj = np.array([1, None], dtype=object)
    with pytest.raises(TypeError, match=r"dtype object \(Python objects\) cannot be copied"):
        copy_into(obj, obj.copy())
    with pytest.raises(TypeError):
        copy_into([1, 2], np.zeros(2))


# ---------------------------------------------------------------------------
# plan_layout, clock, constants
# ---------------------------------------------------------------------------


def _check_layout(sizes, offsets, total, alignment):
    assert isinstance(offsets, np.ndarray) and offsets.dtype == np.int64
    assert offsets.shape == (len(sizes),)
    assert all(int(o) % alignment == 0 for o in offsets)
    assert total >= sum(sizes)
    assert total % alignment == 0
    spans = sorted((int(o), int(o) + s) for o, s in zip(offsets, sizes) if s > 0)
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, "fields overlap"
    assert all(end <= total for _, end in spans)
    assert all(0 <= int(o) <= total for o in offsets)


def test_plan_layout_default_alignment():
    assert _core.ALIGNMENT == 64
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(0, 10_000, 50)] + [1, 63, 64, 65, 0, 128]
    offsets, total = plan_layout(sizes)
    _check_layout(sizes, offsets, total, 64)
    assert offsets[0] == 0
    # tight: each field takes its size rounded up to 64
    assert total == sum((s + 63) // 64 * 64 for s in sizes)


def test_plan_layout_small_cases():
    offsets, total = plan_layout([])
    assert offsets.shape == (0,) and total == 0
    offsets, total = plan_layout([10])
    assert offsets.tolist() == [0] and total == 64
    offsets, total = plan_layout([64, 1, 65])
    assert offsets.tolist() == [0, 64, 128] and total == 256
    offsets, total = plan_layout((np.int64(3), np.int32(5)))
    assert offsets.tolist() == [0, 64] and total == 128


@pytest.mark.parametrize("alignment", [1, 8, 4096])
def test_plan_layout_other_alignment(alignment):
    sizes = [1, 4095, 4096, 4097, 7, 0, 12]
    offsets, total = plan_layout(sizes, alignment=alignment)
    _check_layout(sizes, offsets, total, alignment)


@pytest.mark.parametrize("alignment", [0, -64, 3, 48, 100])
def test_plan_layout_bad_alignment(alignment):
    with pytest.raises(ValueError, match=f"alignment must be a positive power of two, got {alignment}"):
        plan_layout([1, 2], alignment=alignment)


def test_plan_layout_negative_size():
    with pytest.raises(ValueError, match="field 1 has negative size -5"):
        plan_layout([8, -5, 3])


def test_monotonic_ns():
    a = _core.monotonic_ns()
    b = _core.monotonic_ns()
    assert isinstance(a, int) and b >= a
    # the same clock as time.monotonic_ns (CLOCK_MONOTONIC): read between two of its readings,
    # never a window a preempted test could overrun
    before = time.monotonic_ns()
    ours = _core.monotonic_ns()
    assert before <= ours <= time.monotonic_ns()
    t0 = _core.monotonic_ns()
    time.sleep(0.02)
    assert _core.monotonic_ns() - t0 >= 19_000_000


# ---------------------------------------------------------------------------
# Slab / BatchOwner
# ---------------------------------------------------------------------------

SLAB_SIZE = 1 << 16

needs_memfd = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs os.memfd_create")


@pytest.fixture
def memfd():
    fd = os.memfd_create("mxload-test")
    os.ftruncate(fd, SLAB_SIZE)
    try:
        yield fd
    finally:
        os.close(fd)


@needs_memfd
def test_slab_shared_between_mappings(memfd):
    s1 = Slab(memfd, SLAB_SIZE, slab_id=3)
    s2 = Slab(memfd, SLAB_SIZE, populate=True)
    assert s1.size == SLAB_SIZE and s2.size == SLAB_SIZE
    assert s1.slab_id == 3 and s2.slab_id is None
    assert s1.address != 0 and s2.address != 0
    assert s1.address != s2.address  # two distinct mappings ...
    assert repr(s1) == f"<Slab id=3 size={SLAB_SIZE}>"
    v1 = np.ndarray((SLAB_SIZE // 4,), np.uint32, buffer=s1)
    v2 = np.frombuffer(s2, np.uint32)
    assert v1.ctypes.data == s1.address  # zero copy
    assert v2.ctypes.data == s2.address
    assert v1.flags.writeable and v2.flags.writeable
    # ... of the same memory
    v1[:] = np.arange(v1.size, dtype=np.uint32) * 3
    np.testing.assert_array_equal(v2, np.arange(v1.size, dtype=np.uint32) * 3)
    v2[5] = 123456
    assert v1[5] == 123456
    # and of the file itself
    assert os.pread(memfd, 8, 20) == v1[5:7].tobytes()
    os.pwrite(memfd, b"\x01\x00\x00\x00", 0)
    assert v1[0] == 1 and v2[0] == 1
    mv = memoryview(s1)
    assert mv.nbytes == SLAB_SIZE and not mv.readonly
    mv.release()


@needs_memfd
def test_slab_outlives_fd_and_views_outlive_slab():
    fd = os.memfd_create("mxload-test")
    try:
        os.ftruncate(fd, SLAB_SIZE)
        slab = Slab(fd, SLAB_SIZE)
    finally:
        os.close(fd)  # the mapping does not need the descriptor
    view = np.ndarray((SLAB_SIZE,), np.uint8, buffer=slab)
    view[:] = 7
    del slab
    gc.collect()
    # the view keeps the mapping alive
    assert (view == 7).all()
    view[-1] = 8
    assert view[-1] == 8


def test_slab_bad_size():
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match="slab size must be positive, got 0"):
            Slab(fd, 0)
        with pytest.raises(ValueError, match="slab size must be positive, got -4096"):
            Slab(fd, -4096)
    finally:
        os.close(fd)


def test_slab_bad_fd():
    with pytest.raises(OSError, match="mmap of 4096 bytes of shared memory failed") as ei:
        Slab(-1, 4096)
    assert ei.value.errno is not None


@needs_memfd
def test_batch_owner_exports_sub_range(memfd):
    slab = Slab(memfd, SLAB_SIZE)
    owner = BatchOwner(slab, 128, 256)
    assert owner.slab is slab and owner.offset == 128 and owner.nbytes == 256
    mv = memoryview(owner)
    assert mv.nbytes == 256 and not mv.readonly
    mv.release()
    arr = np.ndarray((64,), np.int32, buffer=owner)
    assert arr.ctypes.data == slab.address + 128
    arr[:] = np.arange(64)
    whole = np.frombuffer(slab, np.uint8)
    np.testing.assert_array_equal(whole[128:384].view(np.int32), np.arange(64))
    assert (whole[:128] == 0).all() and (whole[384:] == 0).all()
    # edge ranges are fine
    assert memoryview(BatchOwner(slab, SLAB_SIZE, 0)).nbytes == 0
    assert memoryview(BatchOwner(slab, 0, SLAB_SIZE)).nbytes == SLAB_SIZE


@needs_memfd
def test_stack_into_slab_visible_through_other_mapping(memfd):
    writer = Slab(memfd, SLAB_SIZE)
    reader = Slab(memfd, SLAB_SIZE)
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::-1] * i for i in range(5)]
    offsets, total = plan_layout([5 * 3 * 4 * 4, 100])
    assert total <= SLAB_SIZE
    owner = BatchOwner(writer, int(offsets[0]), 5 * 3 * 4 * 4)
    out = np.ndarray((5, 3, 4), np.float32, buffer=owner)
    assert stack(arrays, out=out) is out
    seen = np.ndarray((5, 3, 4), np.float32, buffer=BatchOwner(reader, int(offsets[0]), 240))
    assert_same(seen.copy(), np_stack(arrays))


@needs_memfd
def test_batch_owner_on_release_after_last_view(memfd):
    slab = Slab(memfd, SLAB_SIZE)
    calls = []
    owner = BatchOwner(slab, 64, 4096, on_release=calls.append)
    arr = np.ndarray((32, 32), np.float32, buffer=owner)
    part = arr[3:5]
    col = arr[:, 7]
    flat = part.reshape(-1)
    del owner
    gc.collect()
    assert calls == []
    del arr
    gc.collect()
    assert calls == []
    del part, col
    gc.collect()
    assert calls == []
    flat[0] = 1.0  # still valid memory
    del flat
    gc.collect()
    assert len(calls) == 1
    assert calls[0] is slab
    gc.collect()
    assert len(calls) == 1


@needs_memfd
def test_batch_owner_released_once_without_views(memfd):
    slab = Slab(memfd, SLAB_SIZE)
    calls = []
    BatchOwner(slab, 0, 10, on_release=calls.append)
    gc.collect()
    assert calls == [slab]
    owner = BatchOwner(slab, 0, 10)  # no callback: nothing to call
    del owner


@needs_memfd
def test_batch_owner_keeps_slab_alive(memfd):
    calls = []
    slab = Slab(memfd, SLAB_SIZE, slab_id="s0")
    owner = BatchOwner(slab, 0, 16, on_release=lambda s: calls.append(s.slab_id))
    arr = np.ndarray((16,), np.uint8, buffer=owner)
    del slab, owner
    gc.collect()
    arr[:] = 5
    assert (arr == 5).all()
    del arr
    gc.collect()
    assert calls == ["s0"]


@needs_memfd
def test_batch_owner_detach(memfd):
    slab = Slab(memfd, SLAB_SIZE)
    calls = []
    owner = BatchOwner(slab, 0, 64, on_release=calls.append)
    arr = np.ndarray((8,), np.int64, buffer=owner)
    owner.detach()
    del owner, arr
    gc.collect()
    assert calls == []


@needs_memfd
def test_batch_owner_callback_exception_is_swallowed(memfd):
    slab = Slab(memfd, SLAB_SIZE)
    hits = []
    unraisable = []

    def bad(s):
        hits.append(s)
        raise RuntimeError("pool is gone")

    old_hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        owner = BatchOwner(slab, 0, 8, on_release=bad)
        del owner
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert hits == [slab]
    assert unraisable == []


@needs_memfd
def test_batch_owner_numpy_views_in_a_cycle_released(memfd):
    """The loader's case: batch arrays sit in cyclic garbage, the pool is alive."""
    slab = Slab(memfd, SLAB_SIZE)

    class Pool:
        def __init__(self):
            self.released = []

        def release(self, s):
            self.released.append(s)

    class Holder:
        pass

    pool = Pool()
    owner = BatchOwner(slab, 0, 128, on_release=pool.release)
    arr = np.ndarray((32,), np.int32, buffer=owner)
    h = Holder()
    h.self = h
    h.batch = {"x": arr, "tail": arr[3:]}
    del owner, arr, h
    gc.collect()
    assert pool.released == [slab]


def _run_gc_script(body):
    """Run a GC scenario in a child process: a broken fix can crash the
    interpreter (calling an already tp_clear-ed callback)."""
    import textwrap

    script = textwrap.dedent("""
        import faulthandler, gc, os
        faulthandler.enable()
        from mxload._core import BatchOwner, Slab
        fd = os.memfd_create("mxload-gc-test")
        os.ftruncate(fd, 4096)
        slab = Slab(fd, 4096)
        os.close(fd)
        class Holder:
            pass
        class Pool:
            def __init__(self):
                self.released = []
            def release(self, s):
                self.released.append(s)
    """) + textwrap.dedent(body)
    proc = fresh_python.run_args("-c", script, timeout=50)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    return proc.stdout.split()


@needs_memfd
@pytest.mark.parametrize("with_view", [False, True], ids=["owner", "memoryview"])
def test_batch_owner_referenced_from_cycle_released(with_view):
    out = _run_gc_script(f"""
        pool = Pool()
        # owner created before its holder: the collector meets it first
        owner = BatchOwner(slab, 0, 64, on_release=pool.release)
        h = Holder()
        h.self = h
        h.owner = owner
        if {with_view}:
            h.view = memoryview(owner)
        del owner, h
        gc.collect()
        print(len(pool.released), pool.released[0] is slab if pool.released else "-")
    """)
    assert out == ["1", "True"]


@needs_memfd
def test_batch_owner_garbage_callback_in_cycle_does_not_crash():
    """The callback itself is part of the garbage (a lambda only the owner
    references): whatever the fix for the test above, collecting this must
    not call a callback whose state the collector already cleared."""
    out = _run_gc_script("""
        calls = []
        owner = BatchOwner(slab, 0, 64, on_release=lambda s: calls.append(s))
        h = Holder()
        h.self = h
        h.owner = owner
        del owner, h
        gc.collect()
        print(len(calls))
    """)
    assert out in (["0"], ["1"])


@needs_memfd
@pytest.mark.parametrize("offset,nbytes", [
    (0, SLAB_SIZE + 1), (SLAB_SIZE, 1), (SLAB_SIZE + 64, 0), (-1, 10), (0, -1), (10, SLAB_SIZE),
])
def test_batch_owner_out_of_range(memfd, offset, nbytes):
    slab = Slab(memfd, SLAB_SIZE)
    with pytest.raises(ValueError, match=f"is outside slab of {SLAB_SIZE} bytes"):
        BatchOwner(slab, offset, nbytes)


@needs_memfd
def test_batch_owner_out_of_range_no_overflow(memfd):
    # offset + nbytes overflows a signed 64-bit integer
    slab = Slab(memfd, SLAB_SIZE)
    with pytest.raises(ValueError, match=f"is outside slab of {SLAB_SIZE} bytes"):
        BatchOwner(slab, 1, 2**63 - 1)
    with pytest.raises(ValueError, match=f"is outside slab of {SLAB_SIZE} bytes"):
        BatchOwner(slab, 2**62, 2**62)


def test_batch_owner_requires_slab():
    with pytest.raises(TypeError):
        BatchOwner(None, 0, 0)
    with pytest.raises(TypeError):
        BatchOwner(object(), 0, 0)


def test_pad_value_must_be_scalar_names_the_value():
    with pytest.raises(ValueError, match="pad value must be a scalar"):
        _core.pad([np.ones(2), np.ones(3)], val=[1, 2])


def test_copy_into_rejects_overlap_and_readonly():
    a = np.arange(10)
    with pytest.raises(ValueError, match="overlap"):
        _core.copy_into(a, a[::-1])
    ro = np.zeros(10, a.dtype)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        _core.copy_into(a, ro)


def test_low_level_fills_never_write_outside_out():
    arrs = [np.ones(4), np.ones(4)]
    with pytest.raises(ValueError, match="rows"):
        _core.stack_fill(arrs, np.empty((3, 4)))
    with pytest.raises(ValueError, match="sample 1 does not fit"):
        _core.stack_fill([np.ones(4), np.ones(5)], np.empty((2, 4)))
    with pytest.raises(ValueError, match="sample 0 does not fit"):
        _core.pad_fill([np.ones(6), np.ones(2)], np.empty((2, 4)), 0, np.float64(0).tobytes())
    with pytest.raises(ValueError, match="axis"):
        _core.pad_fill(arrs, np.empty((2, 4)), 1, np.float64(0).tobytes())


@pytest.mark.parametrize("dtype,val", [(np.uint8, 1.5), (np.int8, -129), (np.float32, 1e300)])
def test_pad_value_that_would_change_is_rejected(dtype, val):
    with pytest.raises(ValueError, match="cannot be represented"):
        _core.pad([np.ones(2, dtype), np.ones(3, dtype)], val=val)
    assert _core.pad([np.ones(1, np.float32), np.ones(2, np.float32)], val=float("nan"))[0, 1] != 0


# ---------------------------------------------------------------------------
# out is any view: every kernel writes exactly out's elements, nothing else
# ---------------------------------------------------------------------------

SENTINEL = 0xA5
GUARD_DTYPES = [np.uint8, np.int32, np.float64, np.complex128, "U3", STRUCT]
GUARD_IDS = ["u1", "i4", "f8", "c16", "U3", "struct"]


def _guarded_views(shape, dtype):
    """(name, parent, out): `out` is a view of `shape` inside a parent filled
    with SENTINEL bytes, in layouts whose gaps are parent memory that is not
    part of out."""
    dtype = np.dtype(dtype)
    nd = len(shape)

    def parent_of(pshape):
        p = np.empty(pshape, dtype)
        np.ndarray(p.shape + (dtype.itemsize,), np.uint8, buffer=p)[...] = SENTINEL
        return p

    p = parent_of((2 * shape[0] + 1,) + shape[1:])
    yield "every other row", p, p[1::2]
    p = parent_of((shape[0] + 2,) + shape[1:])
    yield "rows reversed", p, p[shape[0]:0:-1]
    p = parent_of(tuple(2 * s + 2 for s in shape))
    yield "step 2 in every dimension", p, p[tuple(slice(1, 1 + 2 * s, 2) for s in shape)]
    p = parent_of(tuple(s + 2 for s in shape))
    yield "inner block", p, p[tuple(slice(1, 1 + s) for s in shape)]
    p = parent_of(shape[::-1])
    yield "transposed", p, p.transpose(list(range(nd))[::-1])
    if shape[0] == 1:
        # numpy flags this view C-contiguous: a size-1 dimension's stride is ignored
        p = parent_of((9,) + shape[1:])
        out = p[4:9:5]
        assert out.flags.c_contiguous and out.strides[0] == 5 * p.strides[0]
        yield "one row, C-contiguous flag, long row stride", p, out


def _assert_only_out_written(parent, out, expected, name):
    mask = np.zeros(parent.shape, bool)
    np.ndarray(out.shape, bool, buffer=mask, offset=_offset(out, parent),
               strides=tuple(s // parent.itemsize for s in out.strides))[...] = True
    raw = np.ndarray(parent.shape + (parent.itemsize,), np.uint8, buffer=parent)
    changed = np.argwhere((raw[~mask] != SENTINEL).any(axis=-1))
    assert changed.size == 0, f"{name}: {changed.size} elements outside out were written"
    assert np.ascontiguousarray(out).tobytes() == np.ascontiguousarray(expected).tobytes(), name


def _offset(view, parent):
    """Element offset of view's first element in parent (for the bool mask)."""
    return (view.__array_interface__["data"][0] - parent.__array_interface__["data"][0]) \
        // parent.itemsize


@pytest.mark.parametrize("sample_shape", [(), (5,), (3, 4)], ids=["0d", "1d", "2d"])
@pytest.mark.parametrize("dtype", GUARD_DTYPES, ids=GUARD_IDS)
def test_stack_writes_only_out(dtype, sample_shape):
    rng = np.random.default_rng(31)
    for n in (1, 4):
        arrays = [random_array(sample_shape, dtype, rng) for _ in range(n)]
        ref = np_stack(arrays)
        for name, parent, out in _guarded_views(ref.shape, dtype):
            arrs, _, _ = _core.stack_check(arrays)
            _core.stack_fill(arrs, out)
            _assert_only_out_written(parent, out, ref, f"stack_fill, {name}")
        for name, parent, out in _guarded_views(ref.shape, dtype):
            assert stack(arrays, out=out) is out
            _assert_only_out_written(parent, out, ref, f"stack, {name}")


@pytest.mark.parametrize("sample_shape,axis", [
    ((6,), 0), ((6, 3), 0), ((3, 6), 1), ((2, 6, 3), 1), ((2, 3, 6), 2), ((2, 3, 6), 0),
], ids=["1d-axis0", "2d-axis0", "2d-axis1", "3d-axis1", "3d-axis2", "3d-axis0"])
@pytest.mark.parametrize("dtype", GUARD_DTYPES, ids=GUARD_IDS)
def test_pad_writes_only_out(dtype, sample_shape, axis):
    rng = np.random.default_rng(37)
    val = pad_value_for(dtype)
    for lengths in ([6, 0, 3, 6], [4]):
        arrays = []
        for n in lengths:
            shape = list(sample_shape)
            shape[axis] = n
            arrays.append(random_array(tuple(shape), dtype, rng))
        ref = pad_reference(arrays, axis, val, dtype)
        for name, parent, out in _guarded_views(ref.shape, dtype):
            arrs, _, _, _ = _core.pad_check(arrays, axis)
            _core.pad_fill(arrs, out, axis, _core.pad_value_bytes(val, dtype))
            _assert_only_out_written(parent, out, ref, f"pad_fill, {name}")
        for name, parent, out in _guarded_views(ref.shape, dtype):
            assert pad(arrays, axis=axis, val=val, out=out) is out
            _assert_only_out_written(parent, out, ref, f"pad, {name}")
        # pad_fill also pads into an out longer than every sample (one row too)
        shape = list(arrays[0].shape)
        shape[axis] = max(lengths) + 2
        ref = pad_reference(arrays + [random_array(tuple(shape), dtype, rng)], axis, val, dtype)
        for name, parent, out in _guarded_views(ref[:-1].shape, dtype):
            arrs, _, _, _ = _core.pad_check(arrays, axis)
            _core.pad_fill(arrs, out, axis, _core.pad_value_bytes(val, dtype))
            _assert_only_out_written(parent, out, ref[:-1], f"pad_fill (longer out), {name}")


@pytest.mark.parametrize("shape", [(1,), (4,), (1, 5), (3, 4), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("dtype", GUARD_DTYPES, ids=GUARD_IDS)
def test_copy_into_writes_only_out(dtype, shape):
    src = random_array(shape, dtype, np.random.default_rng(41))
    for name, parent, out in _guarded_views(shape, dtype):
        copy_into(src, out)
        _assert_only_out_written(parent, out, src, f"copy_into, {name}")


def test_stack_and_pad_reject_out_overlapping_a_sample():
    base = np.arange(12.0).reshape(3, 4)
    with pytest.raises(ValueError, match="out overlaps sample 1"):
        stack([np.zeros(4), base[0], np.zeros(4)], out=base)
    with pytest.raises(ValueError, match="out overlaps sample 0"):
        pad([base[1, :2], np.zeros(4), np.zeros(3)], out=base)


# ---------------------------------------------------------------------------
# dimension limit
# ---------------------------------------------------------------------------


def _too_many_dims(ndim):
    try:
        return np.zeros((1,) * ndim, np.float32)
    except ValueError:
        pytest.skip(f"this numpy cannot make {ndim}-d arrays")


def test_max_dims_is_numpys_oldest_limit():
    # numpy 1.x's limit: the same arrays collate whatever numpy runs.
    assert _core.MAX_DIMS == 32


def test_too_many_dims_is_a_clear_error():
    limit = _core.MAX_DIMS
    fits = [np.zeros((1,) * (limit - 1), np.float32)] * 2
    assert stack(fits).ndim == limit
    assert pad(fits).ndim == limit
    deep = [_too_many_dims(limit)] * 2
    msg = rf"has {limit + 1} dimensions; mxload collates at most {limit}"
    with pytest.raises(ValueError, match="the batch of 2 samples " + msg):
        stack(deep)
    with pytest.raises(ValueError, match="the batch of 2 samples " + msg):
        _core.stack_check(deep)
    with pytest.raises(ValueError, match="the batch of 2 samples " + msg):
        pad(deep)
    out = _too_many_dims(limit + 1)
    with pytest.raises(ValueError, match="out " + msg):
        _core.stack_fill(deep, out)
    with pytest.raises(ValueError, match="out " + msg):
        _core.pad_fill(deep, out, 0, b"\0" * 4)
    with pytest.raises(ValueError, match="out " + msg):
        copy_into(out.copy(), out)
