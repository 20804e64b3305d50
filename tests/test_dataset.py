import pickle

import numpy as np
import pytest

from mxload.dataset import ArrayDataset, Dataset, IterableDataset, SimpleDataset


# Module-level helpers so that datasets holding them can be pickled.
def double(x):
    return x * 2


def add(a, b):
    return a + b


def swap(a, b):
    return b, a


class Counting:
    """Picklable callable that records how often it was called."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x + 1


class Squares(Dataset):
    def __init__(self, n):
        self.n = n

    def __getitem__(self, idx):
        return idx * idx

    def __len__(self):
        return self.n


class Stream(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield i, -i


class SizedStream(Stream):
    def __len__(self):
        return self.n


def roundtrip(obj):
    return pickle.loads(pickle.dumps(obj))


# --- Dataset base ------------------------------------------------------------

def test_base_dataset_is_abstract():
    ds = Dataset()
    with pytest.raises(NotImplementedError):
        ds[0]
    with pytest.raises(NotImplementedError):
        len(ds)
    assert not hasattr(ds, "__getitems__")


def test_custom_dataset_transform():
    t = Squares(4).transform(double)
    assert isinstance(t, Dataset)
    assert len(t) == 4
    assert [t[i] for i in range(4)] == [0, 2, 8, 18]
    # No batch fetch on the wrapped dataset -> none on the transform either.
    assert not hasattr(t, "__getitems__")


# --- SimpleDataset -----------------------------------------------------------

def test_simple_dataset_list_and_array():
    ds = SimpleDataset([3, 1, 4])
    assert len(ds) == 3 and ds[2] == 4
    arr = np.arange(6).reshape(3, 2)
    ds = SimpleDataset(arr)
    np.testing.assert_array_equal(ds[1], [2, 3])
    assert len(ds) == 3


def test_simple_dataset_rejects_non_sequence():
    with pytest.raises(TypeError, match="SimpleDataset needs a sequence.*int"):
        SimpleDataset(5)


def test_simple_dataset_pickle():
    ds = roundtrip(SimpleDataset([1, 2, 3]))
    assert [ds[i] for i in range(len(ds))] == [1, 2, 3]


# --- transform / transform_first --------------------------------------------

def test_transform_lazy_is_lazy():
    fn = Counting()
    t = SimpleDataset([1, 2, 3]).transform(fn)
    assert fn.calls == 0
    assert t[1] == 3
    assert fn.calls == 1


def test_transform_eager_materialises():
    fn = Counting()
    t = SimpleDataset([1, 2, 3]).transform(fn, lazy=False)
    assert fn.calls == 3
    assert isinstance(t, SimpleDataset)
    assert [t[i] for i in range(3)] == [2, 3, 4]
    t[0]
    assert fn.calls == 3


def test_transform_unpacks_tuples():
    ds = SimpleDataset([(1, 10), (2, 20)])
    t = ds.transform(add)
    assert [t[0], t[1]] == [11, 22]
    t = ds.transform(swap, lazy=False)
    assert [t[0], t[1]] == [(10, 1), (20, 2)]


def test_transform_does_not_unpack_lists():
    t = SimpleDataset([[1, 2]]).transform(len)
    assert t[0] == 2


def test_transform_first():
    ds = SimpleDataset([(1, "a"), (2, "b")])
    t = ds.transform_first(double)
    assert [t[0], t[1]] == [(2, "a"), (4, "b")]
    t = ds.transform_first(double, lazy=False)
    assert isinstance(t, SimpleDataset)
    assert [t[0], t[1]] == [(2, "a"), (4, "b")]


def test_transform_first_non_tuple_sample():
    t = SimpleDataset([1, 2]).transform_first(double)
    assert [t[0], t[1]] == [2, 4]


def test_transform_chaining():
    t = SimpleDataset([1, 2, 3]).transform(double).transform(double)
    assert [t[i] for i in range(3)] == [4, 8, 12]


def test_transform_rejects_non_callable():
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        SimpleDataset([1]).transform(3)
    with pytest.raises(TypeError, match="fn must be callable, got str"):
        SimpleDataset([1]).transform_first("x")


def test_transform_pickle_roundtrip():
    t = roundtrip(ArrayDataset(np.arange(5), np.arange(5) * 10).transform(add))
    assert t[2] == 22
    assert t.__getitems__([1, 4]) == [11, 44]
    t = roundtrip(SimpleDataset([(1, "a")]).transform_first(double))
    assert t[0] == (2, "a")


def test_transform_with_lambda_not_picklable_but_works():
    t = SimpleDataset([1, 2]).transform(lambda x: x - 1)
    assert t[1] == 1
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(t)


# --- ArrayDataset ------------------------------------------------------------

def test_array_dataset_tuple_samples():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    y = np.array([0, 1, 0, 1])
    names = ["a", "b", "c", "d"]
    ds = ArrayDataset(x, y, names)
    assert len(ds) == 4
    s = ds[2]
    assert isinstance(s, tuple) and len(s) == 3
    np.testing.assert_array_equal(s[0], [6, 7, 8])
    assert s[1] == 0 and s[2] == "c"


def test_array_dataset_single_array_returns_element():
    ds = ArrayDataset(np.array([5, 6, 7]))
    assert ds[1] == 6
    assert not isinstance(ds[1], tuple)
    assert ArrayDataset([1, 2])[0] == 1


def test_array_dataset_numpy_integer_index():
    ds = ArrayDataset([10, 20, 30])
    assert ds[np.int64(2)] == 30


def test_array_dataset_length_mismatch():
    with pytest.raises(ValueError, match="argument 0 has length 3 while argument 2 has length 2"):
        ArrayDataset([1, 2, 3], np.zeros(3), [1, 2])


def test_array_dataset_needs_arrays():
    with pytest.raises(ValueError, match="at least one array"):
        ArrayDataset()
    with pytest.raises(TypeError, match="argument 1 must be an array or sequence, got int"):
        ArrayDataset([1], 7)


@pytest.mark.parametrize("idx", [-1, 3, 100])
def test_array_dataset_getitem_out_of_range(idx):
    ds = ArrayDataset(np.arange(3), [0, 1, 2])
    with pytest.raises(IndexError, match=f"index {idx} is out of range for ArrayDataset of length 3"):
        ds[idx]


@pytest.mark.parametrize("idx", [-1, 3, 100])
def test_simple_dataset_rejects_out_of_range_indices_like_array_dataset(idx):
    """Negative indices are not wrapped (samplers never produce them: one is
    a bug), the same in SimpleDataset as in ArrayDataset."""
    ds = SimpleDataset([10, 11, 12])
    with pytest.raises(IndexError, match=f"index {idx} is out of range for SimpleDataset of length 3"):
        ds[idx]
    assert ds[np.int64(2)] == 12
    with pytest.raises(TypeError, match="SimpleDataset index must be an integer, got float"):
        ds[1.0]


def test_array_dataset_getitem_bad_type():
    with pytest.raises(TypeError, match="index must be an integer, got float"):
        ArrayDataset([1, 2])[1.0]


def test_array_dataset_iteration_stops():
    # Falls back to the __getitem__ protocol, which needs IndexError at the end.
    assert list(ArrayDataset([1, 2, 3])) == [1, 2, 3]


def test_getitems_matches_getitem_multi_column():
    x = np.arange(20, dtype=np.float64).reshape(10, 2)
    y = np.arange(10, dtype=np.int32)
    z = [f"s{i}" for i in range(10)]
    ds = ArrayDataset(x, y, z)
    idx = np.array([7, 0, 3, 3, 9], dtype=np.int64)
    got = ds.__getitems__(idx)
    assert isinstance(got, list) and len(got) == 5
    for i, sample in zip(idx.tolist(), got):
        ref = ds[i]
        assert isinstance(sample, tuple) and len(sample) == 3
        np.testing.assert_array_equal(sample[0], ref[0])
        assert sample[0].dtype == ref[0].dtype
        assert sample[1] == ref[1] and type(sample[1]) is type(ref[1])
        assert sample[2] == ref[2]


def test_getitems_single_column_and_list_indices():
    ds = ArrayDataset(np.arange(10) * 3)
    got = ds.__getitems__([4, 1])
    assert got == [12, 3]
    assert all(isinstance(v, np.integer) for v in got)
    ds = ArrayDataset(list("abcdef"))
    assert ds.__getitems__([5, 0]) == ["f", "a"]


def test_getitems_does_not_alias_source():
    x = np.zeros((4, 2))
    ds = ArrayDataset(x)
    row = ds.__getitems__([1])[0]
    row[:] = 7
    assert not x.any()


def test_getitems_empty():
    ds = ArrayDataset(np.arange(3))
    assert ds.__getitems__([]) == []
    assert ds.__getitems__(np.array([], dtype=np.int64)) == []


@pytest.mark.parametrize("idx,bad", [([0, 5], 5), ([-1, 0], -1), (np.array([2, 1, 9, -3]), 9)])
def test_getitems_out_of_range(idx, bad):
    ds = ArrayDataset(np.arange(5), list(range(5)))
    with pytest.raises(IndexError, match=f"index {bad} is out of range for ArrayDataset of length 5"):
        ds.__getitems__(idx)


@pytest.mark.parametrize("idx", [[0.5, 1.0], [[0, 1]], [True, False]])
def test_getitems_bad_indices(idx):
    with pytest.raises(TypeError, match="indices must be a 1-D sequence of integers"):
        ArrayDataset(np.arange(5)).__getitems__(idx)


def test_array_dataset_pickle():
    ds = roundtrip(ArrayDataset(np.arange(4), ["a", "b", "c", "d"]))
    assert len(ds) == 4
    assert ds[3] == (3, "d")
    assert ds.__getitems__([0, 2]) == [(0, "a"), (2, "c")]


# --- lazy transform + __getitems__ --------------------------------------------

def test_lazy_transform_exposes_getitems():
    ds = ArrayDataset(np.arange(6), np.arange(6) * 10)
    t = ds.transform(add)
    assert hasattr(t, "__getitems__")
    assert t.__getitems__(np.array([5, 1])) == [55, 11]
    assert t.__getitems__([5, 1]) == [t[5], t[1]]


def test_lazy_transform_first_getitems():
    ds = ArrayDataset(np.arange(4), ["w", "x", "y", "z"])
    t = ds.transform_first(double)
    assert t.__getitems__([3, 0]) == [(6, "z"), (0, "w")]


def test_lazy_transform_getitems_propagates_index_error():
    t = ArrayDataset(np.arange(3)).transform(double)
    with pytest.raises(IndexError, match="index 3 is out of range"):
        t.__getitems__([0, 3])


def test_eager_transform_has_no_getitems():
    t = ArrayDataset(np.arange(3)).transform(double, lazy=False)
    assert isinstance(t, SimpleDataset)
    assert not hasattr(t, "__getitems__")
    assert [t[i] for i in range(3)] == [0, 2, 4]


# --- IterableDataset ---------------------------------------------------------

def test_iterable_base_is_abstract():
    with pytest.raises(NotImplementedError):
        iter(IterableDataset())
    assert not isinstance(IterableDataset(), Dataset)


def test_iterable_transform_lazy():
    t = Stream(3).transform(add)
    assert isinstance(t, IterableDataset)
    assert list(t) == [0, 0, 0]
    assert list(t) == [0, 0, 0]  # re-iterable, like the source
    assert not hasattr(t, "__len__")


def test_iterable_transform_is_lazy():
    fn = Counting()

    class Ints(IterableDataset):
        def __iter__(self):
            return iter(range(1000))

    it = iter(Ints().transform(fn))
    assert fn.calls == 0
    assert next(it) == 1 and next(it) == 2
    assert fn.calls == 2


def test_iterable_transform_first():
    t = Stream(3).transform_first(double)
    assert list(t) == [(0, 0), (2, -1), (4, -2)]


def test_iterable_transform_keeps_len_when_sized():
    t = SizedStream(4).transform(swap)
    assert len(t) == 4
    assert list(t)[1] == (-1, 1)


def test_iterable_transform_eager_rejected():
    with pytest.raises(ValueError, match="supports only lazy=True"):
        Stream(3).transform(add, lazy=False)
    with pytest.raises(ValueError, match="supports only lazy=True"):
        Stream(3).transform_first(double, lazy=False)
    with pytest.raises(TypeError, match="fn must be callable"):
        Stream(3).transform(None)


def test_iterable_transform_pickle():
    t = roundtrip(SizedStream(3).transform_first(double))
    assert list(t) == [(0, 0), (2, -1), (4, -2)]
    assert len(t) == 3
