"""Tests of default_batchify's compiled fast path for samples that are plain
dicts, tuples and lists of arrays (mxload._collate.plan.TreeCache, the
Cython SampleTree/TreeTable): the batch, its layout and every error equal
the checked path's, the structure cached between batches never lets a
differing sample through, and the plan owns what it copies."""
from __future__ import annotations

import copy
import gc
import pickle
import threading

import numpy as np
import pytest

from mxload import _core
from mxload._collate.layout import views_from_layout
from mxload._collate.plan import TreeStackField, allocate
from mxload.batchify import Batchify, Planner, collate, default_batchify, plan_batch
from mxload.batchify import _DefaultBatchify as DefaultBatchify

pytestmark = pytest.mark.timeout(60)

KEYS = [f"f{i:02d}" for i in range(16)]


class Checked(Batchify):
    """default_batchify without the fast path: the reference."""

    def plan(self, samples, path, planner):
        return default_batchify._plan_checked(samples, path, planner)


CHECKED = Checked()


def dict16(n=256, seed=0, width=64):
    rng = np.random.default_rng(seed)
    return [{k: rng.standard_normal(width, dtype=np.float32) for k in KEYS} for _ in range(n)]


def assert_same_batch(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same_batch(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_batch(x, y)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


def assert_like_checked(samples, fn=None, batch_index=None):
    """The fast path's batch and layout equal the checked path's."""
    fn = fn if fn is not None else DefaultBatchify()
    fast = plan_batch(fn, samples, batch_index)
    slow = plan_batch(CHECKED, samples, batch_index)
    assert fast.layout() == slow.layout()
    assert [(f.path, f.kernel, f.shape, f.dtype) for f in fast.fields] == \
        [(f.path, f.kernel, f.shape, f.dtype) for f in slow.fields]
    assert_same_batch(collate(fn, samples), collate(CHECKED, samples))
    return fast


def error_of(fn, samples, batch_index=None):
    with pytest.raises((ValueError, TypeError)) as info:
        plan_batch(fn, samples, batch_index)
    return info.type, str(info.value)


def like_checked_or_same_error(fn, samples, batch_index):
    """The fast path collates `samples` as the checked path does, or refuses them with
    the very same error, whose message it returns (None: both collate them)."""
    try:
        ref = error_of(CHECKED, samples, batch_index)
    except pytest.fail.Exception:   # the checked path collates it: so must the fast one
        assert_like_checked(samples, fn)
        return None
    assert error_of(fn, samples, batch_index) == ref
    return ref[1]


# ---------------------------------------------------------------------------
# the batch


def test_dict16_takes_the_fast_path_and_equals_np_stack():
    samples = dict16()
    plan = assert_like_checked(samples)
    assert len(plan.tables) == 1 and all(type(f) is TreeStackField for f in plan.fields)
    batch = default_batchify(samples)
    for k in KEYS:
        np.testing.assert_array_equal(batch[k], np.stack([s[k] for s in samples]))


@pytest.mark.parametrize("make", [
    lambda i: (np.full(3, i, np.int16), np.full((2, 2), i, np.float64)),
    lambda i: [np.full(3, i, np.int8), np.full(1, i, np.uint64)],
    lambda i: {"a": (np.full(2, i), {"b": np.full((1, 2), i, np.float32)}), "c": [np.full(4, i, bool), 3]},
    lambda i: {"x": np.array(i * 1.5), "y": np.array(i, np.int32)},                 # 0-d arrays
    lambda i: {"x": np.zeros((0, 3)), "y": np.full(2, i)},                           # empty arrays
    lambda i: {"s": np.array([f"w{i}"]), "r": np.zeros(1, "f4,i2")},                 # strings, records
    lambda i: {"x": np.full(3, i), "label": i, "w": 0.5 * i, "name": f"n{i}", "f": np.float32(i)},
    lambda i: {"x": np.full(3, i), "none": None if i == 0 else None, "t": ()},      # objects, empty
    lambda i: {0: np.full(2, i), 1: np.full(2, -i)},                                 # int keys
    lambda i: ({},),
])
def test_structures_equal_the_checked_path(make):
    samples = [make(i) for i in range(7)]
    try:
        error_of(CHECKED, samples)
    except pytest.fail.Exception:
        assert_like_checked(samples)
    else:   # the checked path refuses it (None): so must the fast one, alike
        assert error_of(DefaultBatchify(), samples) == error_of(CHECKED, samples)


def test_non_contiguous_and_fortran_arrays():
    rng = np.random.default_rng(1)
    base = [rng.standard_normal((6, 8)) for _ in range(9)]
    samples = [{"strided": b[::2, ::3], "fortran": np.asfortranarray(b), "col": b[:, 1],
                "reversed": b[::-1]} for b in base]
    plan = assert_like_checked(samples)
    assert len(plan.tables) == 1
    batch = default_batchify(samples)
    np.testing.assert_array_equal(batch["strided"], np.stack([b[::2, ::3] for b in base]))
    np.testing.assert_array_equal(batch["reversed"], np.stack([b[::-1] for b in base]))


def test_mixed_layouts_in_one_column():
    """Some samples contiguous, some strided, in the same field."""
    rng = np.random.default_rng(2)
    big = rng.standard_normal((10, 12))
    samples = [{"x": big[i, ::2] if i % 2 else big[i, :6].copy()} for i in range(10)]
    assert_like_checked(samples)


def test_equivalent_dtypes_and_byte_orders():
    le = np.arange(4, dtype="<f4")
    samples = [{"x": le.astype("=f4")}, {"x": le.astype("<f4")}, {"x": le.astype(np.float32)}]
    assert_like_checked(samples)
    swapped = [{"x": np.arange(3, dtype=">i4")}, {"x": np.arange(3, dtype=">i4")}]
    assert_like_checked(swapped)


def test_nested_structure_paths_and_layout():
    samples = [{"img": np.full((2, 2), i, np.uint8),
                "ann": ({"box": np.full(4, i, np.float32)}, [np.int64(i)])} for i in range(5)]
    plan = assert_like_checked(samples)
    assert [f.path for f in plan.fields] == ["sample['img']", "sample['ann'][0]['box']",
                                             "sample['ann'][1][0]"]
    assert plan.fields[2].kernel == "copy"   # the numpy scalar column goes the checked way


def test_inside_other_batchify_functions():
    from mxload.batchify import Dict, Pad, Tuple
    samples = [({"a": np.full(2, i), "b": np.full(3, i)}, np.arange(i + 1)) for i in range(4)]
    batch = Tuple(default_batchify, Pad())(samples)
    ref = Tuple(CHECKED, Pad())(samples)
    assert_same_batch(batch, ref)
    d = [{"t": np.arange(i + 1), "rest": {"a": np.full(2, i)}} for i in range(3)]
    assert_same_batch(Dict(t=Pad())(d), Dict(t=Pad(), rest=CHECKED)(d))


def test_into_a_slab_layout_round_trip():
    samples = dict16(n=33)
    plan = plan_batch(default_batchify, samples)
    buf = allocate(plan.nbytes + 128)
    views, ns = plan.fill(buf, 64)
    assert len(ns) == 16 and all(isinstance(t, int) and t >= 0 for t in ns)
    batch = views_from_layout(plan.layout(), buf, 64)
    assert_same_batch(batch, collate(CHECKED, samples))
    stats, _ = plan.field_stats(ns)
    assert stats[0] == ("sample['f00']", "stack", 33 * 64 * 4, (33, 64), "<f4")


def test_fill_checks_the_buffer():
    samples = dict16(n=4)
    plan = plan_batch(default_batchify, samples)
    with pytest.raises(ValueError, match="outside the buffer"):
        plan.fill(allocate(plan.nbytes - 64))
    with pytest.raises((BufferError, TypeError)):
        plan.fill(bytes(plan.nbytes))
    with pytest.raises(TypeError, match="filled by its plan's TreeTable"):
        plan.fields[0].fill(np.empty(plan.fields[0].shape, np.float32))


def test_table_fill_leaf_any_strides():
    samples = dict16(n=5, width=8)
    tree = _core.SampleTree(samples[0])
    table = tree.gather(samples)
    out = np.zeros((5, 16), np.float32)[:, ::2]
    table.fill_leaf(3, out)
    np.testing.assert_array_equal(out, np.stack([s["f03"] for s in samples]))
    with pytest.raises(ValueError, match="shape"):
        table.fill_leaf(3, np.zeros((4, 8), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        table.fill_leaf(3, np.zeros((5, 8), np.float64))
    with pytest.raises(IndexError):
        table.fill_leaf(16, out)


def test_sample_tree_refuses_a_leaf_root():
    with pytest.raises(TypeError, match="not a plain dict"):
        _core.SampleTree(np.zeros(3))


def test_plan_owns_its_arrays():
    """The samples' arrays may go away between plan and fill."""
    samples = dict16(n=16, width=1000)
    expected = {k: np.stack([s[k] for s in samples]) for k in KEYS}
    plan = plan_batch(default_batchify, samples)
    for s in samples:
        for k in KEYS:
            s[k] = None
    del samples
    gc.collect()
    junk = [np.full(1000, 7, np.float32) for _ in range(16 * 16)]   # reuse freed memory
    views, _ = plan.fill(allocate(plan.nbytes))
    for k, v in zip(KEYS, views):
        np.testing.assert_array_equal(v, expected[k])
    del junk


def test_last_batch_smaller():
    fn = DefaultBatchify()
    samples = dict16(n=10)
    assert collate(fn, samples)["f00"].shape == (10, 64)
    assert collate(fn, samples[:3])["f00"].shape == (3, 64)
    assert_like_checked(samples[:1], fn)


# ---------------------------------------------------------------------------
# the cached structure never lets a differing sample through


def test_cached_plan_rejects_sample_200_of_another_shape_naming_it():
    fn = DefaultBatchify()
    good = dict16(seed=1)
    collate(fn, good)                      # caches the structure
    bad = dict16(seed=2)
    bad[200]["f07"] = np.zeros(65, np.float32)
    typ, msg = error_of(fn, bad, batch_index=9)
    assert (typ, msg) == error_of(CHECKED, bad, batch_index=9)
    assert typ is ValueError
    assert "batch 9" in msg and "sample['f07']" in msg and "sample 200" in msg
    assert "(65,)" in msg and "(64,)" in msg
    assert_like_checked(good, fn)          # and the next good batch still collates


@pytest.mark.parametrize("change, expected", [
    (lambda s: s.__setitem__("f03", s["f03"].astype(np.float64)), "dtype float64, expected float32"),
    (lambda s: s.__setitem__("f03", s["f03"].reshape(8, 8)), "shape (8, 8), expected (64,)"),
    (lambda s: s.__setitem__("f03", None), "None"),
    (lambda s: s.__setitem__("f03", s["f03"].astype(object)), "Python objects"),
    (lambda s: s.pop("f15"), "different keys"),
    (lambda s: s.__setitem__("extra", np.zeros(1)), "different keys"),
    (lambda s: s.__setitem__("f03", list(s["f03"])), ""),
])
@pytest.mark.parametrize("where", [0, 1, 200, 255])
def test_cached_plan_errors_equal_the_checked_path(change, expected, where):
    fn = DefaultBatchify()
    collate(fn, dict16(seed=3))
    bad = dict16(seed=4)
    change(bad[where])
    message = like_checked_or_same_error(fn, bad, 5)
    if message is None:
        return
    assert "batch 5" in message
    if where:   # (a differing sample 0 makes the others the odd ones)
        assert expected in message and f"sample {where} " in message


@pytest.mark.parametrize("change", [
    lambda s: s.__setitem__("k37", s["k37"][:5]),                   # a leaf in the last chunk
    lambda s: s.__setitem__("k16", s["k16"].astype(np.float64)),    # the second chunk's first leaf
    lambda s: s.update({"k15": s.pop("k15")}),                       # key order across chunks
    lambda s: None,                                                  # unchanged
])
def test_wide_dicts_check_every_chunk_of_leaves(change):
    """Flat dicts are gathered GATHER_AHEAD leaves at a time (collate.pxi):
    a sample differing in any chunk is caught as in the first."""
    keys = [f"k{i:02d}" for i in range(40)]
    rng = np.random.default_rng(7)
    fn = DefaultBatchify()
    make = lambda: [{k: rng.standard_normal(6, dtype=np.float32) for k in keys} for _ in range(9)]  # noqa: E731
    collate(fn, make())                    # caches the structure
    samples = make()
    change(samples[6])
    message = like_checked_or_same_error(fn, samples, 2)
    assert message is None or "sample 6 " in message


def test_not_a_dict_in_a_dict_batch():
    fn = DefaultBatchify()
    collate(fn, dict16(n=4))
    bad = dict16(n=4)
    bad[2] = (1, 2)
    assert error_of(fn, bad) == error_of(CHECKED, bad)
    assert "sample 2 is a tuple, expected a dict" in error_of(fn, bad)[1]


def test_other_mappings_and_orders_fall_back_and_collate():
    import collections
    fn = DefaultBatchify()
    samples = dict16(n=6)
    samples[3] = dict(reversed(list(samples[3].items())))          # same keys, other order
    samples[4] = collections.OrderedDict(samples[4])                 # another Mapping type
    assert_like_checked(samples, fn)
    tuples = [(np.full(2, i), np.full(3, i)) for i in range(5)]
    tuples[2] = list(tuples[2])                                      # a list among tuples
    assert_like_checked(tuples, fn)
    tuples[3] = np.ma.masked_array(np.full(2, 3)), np.full(3, 3)     # an ndarray subclass
    assert_like_checked(tuples, fn)


def test_structure_changes_between_batches():
    fn = DefaultBatchify()
    a = dict16(n=8)
    b = [{"x": np.full((2, 3), i, np.int32), "y": (np.full(1, i), i)} for i in range(8)]
    c = [{k: v.astype(np.float16) for k, v in s.items()} for s in a]
    for samples in (a, b, a, c, b, a):
        assert_like_checked(samples, fn)
    assert_like_checked(a, fn, batch_index=3)


def test_keys_equal_but_not_identical():
    fn = DefaultBatchify()
    samples = [{"".join(["ke", "y"]): np.full(2, i), int("1000") + 0: np.full(1, i)} for i in range(4)]
    assert samples[0] is not samples[1] and list(samples[0])[0] is not list(samples[1])[0]
    plan = assert_like_checked(samples, fn)
    assert len(plan.tables) == 1


def test_deep_nesting_is_left_to_the_checked_path():
    def nest(x, depth):
        for _ in range(depth):
            x = [x]
        return x
    samples = [nest(np.full(2, i), _core.TREE_MAX_DEPTH + 3) for i in range(3)]
    assert_like_checked(samples)


def test_cache_does_not_travel_and_threads_share_it():
    fn = DefaultBatchify()
    collate(fn, dict16(n=4))
    for clone in (pickle.loads(pickle.dumps(fn)), copy.deepcopy(fn), copy.copy(fn)):
        assert_like_checked(dict16(n=4), clone)
    pickle.loads(pickle.dumps(default_batchify))

    shapes = [dict16(n=32, width=w, seed=w) for w in (8, 16)]
    errors = []

    def work(samples):
        try:
            for _ in range(50):
                assert_same_batch(collate(fn, samples), collate(CHECKED, samples))
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(shapes[i % 2],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


def test_planner_field_numbering_after_other_fields():
    """A tree planned after other fields numbers its own from there."""
    planner = Planner()
    planner.add_array("first", np.zeros(3))
    samples = [{"a": np.full(2, i), "b": np.full(1, i)} for i in range(3)]
    node = default_batchify.plan(samples, "x", planner)
    assert node == ("d", ("a", "b"), [("f", 1), ("f", 2)])


def test_a_plan_without_fields_fills_any_buffer():
    plan = plan_batch(default_batchify, [["a", "b"], ["c", "d"]])
    assert plan.fields == [] and plan.fill(b"") == ([], [])


def test_sample_0_decides_tuple_or_list_though_the_cache_has_the_other():
    fn = DefaultBatchify()
    as_list = [[np.full(2, i), [np.full(1, i), np.full(3, i)]] for i in range(4)]
    as_tuple = [(np.full(2, i), (np.full(1, i), np.full(3, i))) for i in range(4)]
    inner_tuple = [[np.full(2, i), (np.full(1, i), np.full(3, i))] for i in range(4)]
    mixed = [as_tuple[0]] + as_list[1:]   # the others may be either
    for samples in (as_list, as_tuple, as_list, inner_tuple, as_tuple, mixed, as_list):
        assert_like_checked(samples, fn)
    assert type(collate(fn, as_tuple)) is tuple and type(collate(fn, as_list)) is list
    assert type(collate(fn, inner_tuple)[1]) is tuple
