"""DataLoader: arguments, the single-process path, and every worker mode
producing exactly the batches of the single-process loader."""
from __future__ import annotations

import collections
import multiprocessing as mp
import os
import time
import warnings

import numpy as np
import pytest
from conftest import asleep_in, slab_mappings, start_methods
from datasets_for_tests import (
    DictDataset,
    EpochBatches,
    HoldingDescriptors,
    ShardedStream,
    SharedCounting,
    TupleDataset,
    WorkerInfoDataset,
    record_worker_id,
    unusual_arrays_batchify,
)

import mxload
from mxload import batchify
from mxload._runtime.local.slabs import COPY_KEPT_FROM
from mxload.sampler import BatchSampler, SequentialSampler

pytestmark = pytest.mark.timeout(120)

# multiprocessing's shared heap (Value, Array) maps its first arena for the process's life: made
# here, at import, not by the test that first uses one (whose leak check would count it).
_MP_HEAP_ARENA = mp.Value("i", 0, lock=False)


def as_plain(batch):
    """A comparable, hashable form of a batch."""
    if isinstance(batch, np.ndarray):
        return ("a", batch.dtype.str, batch.shape, batch.tobytes())
    if isinstance(batch, (tuple, list)):
        return (type(batch).__name__,) + tuple(as_plain(b) for b in batch)
    if isinstance(batch, dict):
        return tuple((k, as_plain(v)) for k, v in batch.items())
    return batch


def run(loader):
    return [as_plain(b) for b in loader]


# ---------------------------------------------------------------- single process


def test_quick_start_example_rollover():
    ds = mxload.ArrayDataset(np.arange(100, dtype=np.float32).reshape(50, 2), np.arange(50))
    loader = mxload.DataLoader(ds, batch_size=8, shuffle=True, seed=0, last_batch="rollover")
    assert len(loader) == 6
    epoch1 = list(loader)
    assert len(epoch1) == 6 and all(x.shape == (8, 2) and y.shape == (8,) for x, y in epoch1)
    seen1 = np.concatenate([y for _, y in epoch1])
    assert len(set(seen1.tolist())) == 48
    # Rollover: the 2 left over come first next epoch, and the epoch has 50 // 8 = 6 batches.
    assert len(loader) == 6
    epoch2 = list(loader)
    carried = set(range(50)) - set(seen1.tolist())
    assert set(epoch2[0][1][:2].tolist()) == carried
    for x, y in epoch1 + epoch2:
        np.testing.assert_array_equal(
            x, np.stack([np.arange(2 * i, 2 * i + 2) for i in y]).astype(np.float32))


def test_same_seed_same_order_and_fresh_seed_differs():
    ds = mxload.ArrayDataset(np.arange(200))
    a = [b.tolist() for b in mxload.DataLoader(ds, batch_size=10, shuffle=True, seed=7)]
    b = [b.tolist() for b in mxload.DataLoader(ds, batch_size=10, shuffle=True, seed=7)]
    c = [b.tolist() for b in mxload.DataLoader(ds, batch_size=10, shuffle=True)]
    d = [b.tolist() for b in mxload.DataLoader(ds, batch_size=10, shuffle=True)]
    assert a == b
    assert c != d
    assert sorted(sum(a, [])) == list(range(200))


@pytest.mark.parametrize("mode,expected", [("keep", [4, 4, 2]), ("discard", [4, 4])])
def test_last_batch_modes(mode, expected):
    ds = mxload.SimpleDataset(list(range(10)))
    loader = mxload.DataLoader(ds, batch_size=4, last_batch=mode)
    assert [len(b) for b in loader] == expected
    assert len(loader) == len(expected)


def test_drop_last_and_collate_fn_aliases():
    ds = mxload.SimpleDataset(list(range(10)))
    assert [len(b) for b in mxload.DataLoader(ds, batch_size=4, drop_last=True)] == [4, 4]
    out = list(mxload.DataLoader(ds, batch_size=5, collate_fn=lambda s: sum(s)))
    assert out == [10, 35]


@pytest.mark.parametrize("kwargs,match", [
    (dict(batch_size=4, batch_sampler=BatchSampler(SequentialSampler(10), 2)), "batch_sampler.*batch_size"),
    (dict(batch_sampler=BatchSampler(SequentialSampler(10), 2), shuffle=True), "batch_sampler.*shuffle"),
    (dict(batch_size=2, shuffle=True, sampler=SequentialSampler(10)), "shuffle.*sampler"),
    (dict(batch_size=0), "batch_size must be a positive integer"),
    (dict(batch_size=2, num_workers=-1), "num_workers"),
    (dict(batch_size=2, prefetch=0), "prefetch"),
    (dict(batch_size=2, timeout=-1), "timeout"),
    (dict(batch_size=2, num_workers=1, start_method="thread"), "start_method"),
    (dict(batch_size=2, last_batch="sometimes"), "last_batch"),
    (dict(batch_size=2, max_worker_restarts=-1), "max_worker_restarts"),
    (dict(batch_size=2, seed=-3), "seed"),
    (dict(batch_size=2, persistent_workers=True), "persistent_workers.*num_workers > 0"),
    (dict(batch_size=2, thread_pool=True), "thread_pool.*num_workers > 0"),
    (dict(batch_size=2, batchify_fn=batchify.Stack(), collate_fn=batchify.Stack()),
     "batchify_fn or collate_fn"),
    (dict(batch_size=2, drop_last=True, last_batch="keep"), "drop_last=True conflicts"),
])
def test_conflicting_or_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mxload.DataLoader(mxload.SimpleDataset(list(range(10))), **kwargs)


class ListedBatches:
    """A user's batch_sampler: any iterable of batches, with a length."""
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class PlannedBatches(ListedBatches):
    """One that makes the whole epoch at once, as mxload's BatchSampler does."""
    def epoch_batches(self):
        return list(self.batches)


BAD_BATCHES = [
    (np.arange(8).reshape(2, 4), r"batch 1 .*1-D.*shape \(2, 4\)"),
    (np.array([True, False, True]), r"batch 1 .*integer.*dtype bool"),
    (np.array([1.0, 2.5]), r"batch 1 .*integer.*dtype float64"),
    ([1.0, 2.5], r"batch 1 .*integer indices: 'float' object cannot be interpreted as an integer"),
    (["3", "4"], r"batch 1 .*integer.*dtype <U1"),
    ([[1], [2, 3]], r"batch 1 .*integer indices: 'list' object"),
    # Beyond int64: they would wrap to negative indices, that is to other samples.
    ([2**64 - 1], r"batch 1 holds index 18446744073709551615, beyond int64"),
    (np.array([3, 2**63 + 5], np.uint64), r"batch 1 holds index 9223372036854775813, beyond int64"),
    ([1, 2**63], r"batch 1 holds an index beyond int64"),
]


# Every bad batch in process; with workers, those that broke a worker's stream or wrapped in its
# task (2-D, a mask, beyond int64): the check runs where the batch is drawn, in the training
# process, whatever the workers, and each case with workers starts two worker processes.
@pytest.mark.parametrize("num_workers,bad,match", [(0, *b) for b in BAD_BATCHES]
                         + [(2, *BAD_BATCHES[i]) for i in (0, 1, 7, 8)])
@pytest.mark.parametrize("sampler_type", [ListedBatches, PlannedBatches])
def test_a_batch_sampler_batch_that_is_not_1d_integers_is_named_before_it_reaches_a_worker(
        num_workers, sampler_type, bad, match):
    # Sent to a worker as it was, a 2-D batch desynchronised the worker's
    # stream (it died with a protocol error) and a mask became indices 0/1.
    # Checked as it is drawn (batch samplers are drawn lazily, as torch draws them): the batch
    # before it is delivered, then the error, and the epoch ends with its workers.
    loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(100) * 10),
                               batch_sampler=sampler_type([[0, 1], bad, [5]]), num_workers=num_workers)
    it = iter(loader)
    assert next(it).tolist() == [0, 10]
    with pytest.raises(ValueError, match="batch_sampler's " + match):
        next(it)
    assert mp.active_children() == []
    # What numpy alone would make floats or objects of is indexed item by item.
    good = sampler_type([[0, 1], np.array([2], np.uint8), (5,), [np.int64(6), np.uint64(7)],
                         np.array([8, 9], dtype=object), range(3), [np.array(4)]])
    assert [b.tolist() for b in mxload.DataLoader(
        mxload.ArrayDataset(np.arange(100) * 10), batch_sampler=good, num_workers=num_workers)] == [
        [0, 10], [20], [50], [60, 70], [80, 90], [0, 10, 20], [40]]


def test_non_callable_batchify_and_worker_init_rejected():
    ds = mxload.SimpleDataset([1, 2])
    with pytest.raises(TypeError, match="batchify_fn must be callable"):
        mxload.DataLoader(ds, batch_size=1, batchify_fn=3)
    with pytest.raises(TypeError, match="worker_init_fn must be callable"):
        mxload.DataLoader(ds, batch_size=1, num_workers=1, worker_init_fn="x")


def test_iterable_dataset_single_process_and_errors():
    loader = mxload.DataLoader(ShardedStream(10), batch_size=4)
    batches = list(loader)
    assert [len(b[1]) for b in batches] == [4, 4, 2]
    assert np.concatenate([b[1] for b in batches]).tolist() == list(range(10))
    loader = mxload.DataLoader(ShardedStream(10), batch_size=4, last_batch="discard")
    assert [len(b[1]) for b in loader] == [4, 4]
    with pytest.raises(ValueError, match="IterableDataset"):
        mxload.DataLoader(ShardedStream(10), batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match="rollover"):
        mxload.DataLoader(ShardedStream(10), batch_size=4, last_batch="rollover")


def test_getitems_batch_fetch_is_used_once_per_batch():
    calls = []

    class Batched(mxload.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):  # pragma: no cover - must not be used
            raise AssertionError("__getitem__ called although __getitems__ exists")

        def __getitems__(self, idx):
            calls.append(list(idx))
            return [np.array([i]) for i in idx]

    out = [b.ravel().tolist() for b in mxload.DataLoader(Batched(), batch_size=4)]
    assert out == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert calls == out


# ---------------------------------------------------------------- worker modes

MAP_CASES = {
    "tuple": lambda: (TupleDataset(), None),
    "dict-pad": lambda: (DictDataset(), batchify.Dict(seq=batchify.Pad(val=-1, ret_length=True))),
}


def _loader(ds, bfn, **kw):
    return mxload.DataLoader(ds, batch_size=5, shuffle=True, seed=3, batchify_fn=bfn, **kw)


@pytest.mark.parametrize("case", sorted(MAP_CASES))
@pytest.mark.parametrize("num_workers", [1, 2, 4])
@pytest.mark.parametrize("mode", start_methods("fork", "spawn", "thread"))
@pytest.mark.parametrize("in_order", [True, False])
def test_map_dataset_matches_single_process(case, num_workers, mode, in_order):
    ds, bfn = MAP_CASES[case]()
    expected = run(_loader(ds, bfn))
    kw = dict(num_workers=num_workers, in_order=in_order)
    kw.update(thread_pool=True) if mode == "thread" else kw.update(start_method=mode)
    got = run(_loader(ds, bfn, **kw))
    if in_order:
        assert got == expected
    else:
        assert collections.Counter(got) == collections.Counter(expected)


@pytest.mark.parametrize("num_workers", [1, 2, 4])
@pytest.mark.parametrize("mode", start_methods("fork", "spawn", "thread"))
@pytest.mark.parametrize("in_order", [True, False])
def test_iterable_dataset_every_sample_once(num_workers, mode, in_order):
    kw = dict(num_workers=num_workers, in_order=in_order)
    kw.update(thread_pool=True) if mode == "thread" else kw.update(start_method=mode)
    batches = list(mxload.DataLoader(ShardedStream(45), batch_size=4, **kw))
    labels = np.concatenate([b[1] for b in batches]).tolist()
    assert sorted(labels) == list(range(45))
    for x, y in batches:
        np.testing.assert_array_equal(x[:, 0], y)
    if in_order and num_workers > 1:
        # Round-robin: the first batches come from workers 0, 1, ... in turn.
        assert [int(b[1][0]) for b in batches[:num_workers]] == list(range(num_workers))


def test_custom_batchify_objects_survive_and_arrays_use_shared_memory():
    def summarise(samples):
        xs = np.stack([s[0] for s in samples])
        return {"x": xs, "ids": [s[1] for s in samples], "note": "custom"}

    got = list(mxload.DataLoader(TupleDataset(12), batch_size=4, batchify_fn=summarise, num_workers=2))
    assert [b["ids"] for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(b["note"] == "custom" for b in got)
    assert all(isinstance(b["x"].base, np.ndarray) or b["x"].base is not None for b in got)
    assert type(_root(got[0]["x"])).__name__ == "BatchOwner"


def _assert_identical(a, b, path="batch"):
    """Same type and content, down to masks, record fields, attributes and dtype metadata."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_identical(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: {a.dtype!r} != {b.dtype!r}"
        assert a.dtype.metadata == b.dtype.metadata, f"{path}: dtype metadata differs"
        assert a.shape == b.shape, path
        if isinstance(a, np.ma.MaskedArray):
            assert np.array_equal(np.ma.getmaskarray(a), np.ma.getmaskarray(b)), f"{path}: mask differs"
            a, b = a.data, b.data
        assert a.tolist() == b.tolist(), f"{path}: content differs"
        assert getattr(a, "__dict__", {}) == getattr(b, "__dict__", {}), f"{path}: attributes differ"
    else:
        assert a == b, path


@pytest.mark.parametrize("mode", start_methods("thread", "fork", "spawn"))
def test_batches_the_slab_cannot_represent_arrive_exactly_as_in_process(mode):
    """A batchify_fn's masked arrays, ndarray subclasses, object arrays and
    dtypes with metadata come out of every kind of worker exactly as in-process."""
    kwargs = {"thread_pool": True} if mode == "thread" else {"start_method": mode}
    ds = TupleDataset(12)
    expected = list(mxload.DataLoader(ds, batch_size=4, batchify_fn=unusual_arrays_batchify))
    assert expected[0]["masked"].mask.tolist() == [True, False, True, False]
    got = list(mxload.DataLoader(ds, batch_size=4, batchify_fn=unusual_arrays_batchify, num_workers=2,
                                 **kwargs))
    assert len(got) == len(expected) == 3
    for g, e in zip(got, expected):
        _assert_identical(g, e)
    assert type(_root(got[0]["plain"])).__name__ == ("ndarray" if mode == "thread" else "BatchOwner")


def _root(a):
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


# ---------------------------------------------------------------- zero copy & slabs


def test_batches_are_views_of_a_shared_slab():
    loader = mxload.DataLoader(TupleDataset(20), batch_size=5, num_workers=2)
    for x, y, z in loader:
        owners = {id(_root(a)) for a in (x, y, z)}
        assert len(owners) == 1, "all fields of a batch live in one slab"
        owner = _root(x)
        assert type(owner).__name__ == "BatchOwner"
        start = owner.slab.address + owner.offset
        for a in (x, y, z):
            assert start <= a.ctypes.data < start + owner.nbytes
            assert a.ctypes.data % 64 == 0
        break


def test_slabs_are_recycled_over_a_long_epoch():
    ds = mxload.ArrayDataset(np.arange(1000 * 8, dtype=np.float32).reshape(1000, 8))
    loader = mxload.DataLoader(ds, batch_size=1, num_workers=2, prefetch=3)
    total = 0
    for batch in loader:
        total += int(batch[0, 0])
    stats = loader.stats
    assert total == sum(range(0, 8000, 8))
    assert stats["batches"] == 1000
    # prefetch + the batch the consumer holds + one being recycled: bounded, not 1000.
    assert stats["slabs_created"] <= 3 + 3, stats
    assert stats["slabs_reused"] >= 990, stats
    assert stats["batches_copied"] == 0, stats   # a loop that keeps none gets views of the slabs


def test_consumer_keeping_batches_does_not_deadlock():
    ds = mxload.ArrayDataset(np.arange(200, dtype=np.int64))
    loader = mxload.DataLoader(ds, batch_size=4, num_workers=2, prefetch=2)
    kept = list(loader)  # every batch held at once
    assert np.concatenate(kept).tolist() == list(range(200))
    # Each of the first COPY_KEPT_FROM + prefetch pins its slab; the rest, small, are copied out.
    stats = loader.stats
    assert COPY_KEPT_FROM <= stats["slabs_created"] <= COPY_KEPT_FROM + 2 + 3, stats
    assert stats["batches_copied"] >= 50 - COPY_KEPT_FROM - 2 - 3, stats
    del kept


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_loop_keeping_thousands_of_small_batches_pins_no_slab_for_each(workers):
    """Every batch kept (a list of them, a cache): past the first few, a
    small batch is copied out of its slab, which goes back to the pool at
    once, so the loop does not hold a 64 KiB slab and a memory mapping per
    batch (vm.max_map_count, 65530 by default, would end it) and the
    workers keep reusing the pool's slabs.  The batches are right, and stay
    so after the loader is gone."""
    n = 3000
    ds = mxload.ArrayDataset(np.arange(n * 4, dtype=np.float32).reshape(n, 4), np.arange(n))
    before = _mappings()
    loader = mxload.DataLoader(ds, batch_size=1, num_workers=workers, persistent_workers=True)
    kept = list(loader)
    grew = _mappings() - before
    stats = loader.stats
    loader.close()
    del loader
    assert grew < 400, grew   # the workers' sockets, the pool's slabs (3000 before)
    assert stats["slabs_created"] <= 64, stats
    assert stats["batches_copied"] >= n - COPY_KEPT_FROM - 2 * workers - 3, stats
    assert kept[-1][0].base.slab.shared is False
    assert np.concatenate([x for x, _ in kept]).ravel().tolist() == list(range(n * 4))
    assert [int(y[0]) for _, y in kept] == list(range(n))
    kept[-1][0][0, 0] = -1   # writable, as a slab's views are
    del kept


def test_slabs_freed_after_a_loop_kept_many_batches_go_back_as_the_next_epoch_begins():
    """Persistent workers; one epoch keeps every batch (large ones: each pins
    its slab), then drops them: the pool does not keep those slabs for the
    loader's lifetime.  An epoch begins by retiring the slabs that none
    needed since the last began, beyond the window's and a few spare, in the
    main process and in every worker that mapped one."""
    from mxload._runtime.local.transport import SPARE_SLABS

    ds = mxload.ArrayDataset(np.arange(40 * 20_000, dtype=np.float32).reshape(40, 20_000))  # 80 KB each
    most = 2 * 4 + SPARE_SLABS   # the window's 4 and the spare ones, plus the window's again made meanwhile
    with mxload.DataLoader(ds, batch_size=1, num_workers=2, persistent_workers=True) as loader:
        kept = list(loader)
        assert loader.stats["slabs_created"] >= 40 and loader.stats["batches_copied"] == 0
        assert len(slab_mappings()) >= 40
        del kept
        pids = [pid for pid in loader._iterations.engine.worker_pids() if pid is not None]
        # The first epoch after shows which slabs it does not need; the next begins by retiring them.
        for epoch in range(3):
            got = [int(x[0, 0]) for x in loader]
            assert got == list(range(0, 40 * 20_000, 20_000)), epoch
        stats = loader.stats
        assert len(loader._iterations.engine.transport.pool) <= most, stats
        assert stats["slabs_retired"] >= 40 - most, stats
        assert stats["slabs_created"] <= 40 + 4, stats
        assert len(slab_mappings()) <= most
        # A worker maps the pool's slabs it is sent, and unmaps those its next task says are retired.
        assert max(len(slab_mappings(pid)) for pid in pids) <= most, [len(slab_mappings(pid)) for pid in pids]


def test_a_loop_keeping_each_epoch_s_batches_until_the_next_keeps_the_slabs_it_needs():
    """`for epoch: kept = list(loader)` (persistent workers, batches too large
    to copy): each epoch needs every slab again once the previous epoch's
    batches die, so none is retired and remade (a helper measured 56-64 new
    slabs an epoch when the free ones were retired regardless)."""
    ds = mxload.ArrayDataset(np.zeros((40, 20_000), np.float32))   # 80 KB a sample
    with mxload.DataLoader(ds, batch_size=1, num_workers=2, persistent_workers=True) as loader:
        kept = None
        for _epoch in range(5):
            kept = list(loader)
        stats = loader.stats
    del kept
    assert stats["slabs_retired"] <= 8, stats


def test_a_loop_keeping_large_batches_keeps_their_slabs():
    """A batch larger than the smallest slab is never copied: its slab
    holds little more than its own bytes."""
    ds = mxload.ArrayDataset(np.zeros((60, 20_000), np.float32))   # 80 KB a sample
    with mxload.DataLoader(ds, batch_size=1, num_workers=2) as loader:
        kept = list(loader)
        assert loader.stats["batches_copied"] == 0
        assert all(x.base.slab.shared for x in kept)
    del kept


def test_batches_stay_valid_after_the_loader_is_gone():
    loader = mxload.DataLoader(TupleDataset(10), batch_size=5, num_workers=2)
    kept = list(loader)
    del loader
    np.testing.assert_array_equal(kept[1][1], np.arange(5, 10))
    assert kept[1][0][4, 0, 0] == 9


def test_growing_batches_replace_small_slabs():
    class Growing(mxload.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return np.zeros(50_000 * (i + 1), np.uint8) + i

    loader = mxload.DataLoader(Growing(), batch_size=1, num_workers=1, prefetch=1,
                               batchify_fn=batchify.Pad())
    for i, batch in enumerate(loader):
        assert batch.shape == (1, 50_000 * (i + 1)) and (batch == i).all()
    assert loader.stats["slabs_retired"] >= 1


def test_prefetch_bounds_in_flight_batches():
    ds = mxload.ArrayDataset(np.arange(100))
    loader = mxload.DataLoader(ds, batch_size=2, num_workers=2, prefetch=3)
    it = iter(loader)
    next(it)
    engine = it.engine
    assert engine.window.in_flight <= 3
    it.close()


# ---------------------------------------------------------------- workers


@pytest.mark.parametrize("start_method", start_methods("fork", "spawn"))
def test_worker_info_seeds_and_init_fn(start_method):
    def batches(seed):
        loader = mxload.DataLoader(WorkerInfoDataset(), batch_size=2, num_workers=2, seed=seed,
                                   start_method=start_method, worker_init_fn=record_worker_id)
        return [(x.copy(), r.copy()) for x, r in loader]

    first = batches(11)
    wids = {int(w) for x, _ in first for w in x[:, 1]}
    assert wids == {0, 1}
    pids = {int(p) for x, _ in first for p in x[:, 2]}
    assert os.getpid() not in pids and len(pids) == 2
    by_worker = collections.defaultdict(list)
    for x, r in first:
        by_worker[int(x[0, 1])].extend(r.tolist())
    assert by_worker[0] != by_worker[1], "workers must not share a random stream"
    again = batches(11)
    assert [r.tolist() for _, r in again] == [r.tolist() for _, r in first], "fixed seed reproduces"
    other = batches(12)
    assert [r.tolist() for _, r in other] != [r.tolist() for _, r in first]
    assert mxload.get_worker_info() is None


@pytest.mark.parametrize("start_method", start_methods("fork", "spawn"))
def test_persistent_workers_reseed_global_rngs_every_epoch(start_method):
    """Workers' numpy/random global RNGs are seeded from (seed, epoch, worker
    id) every epoch: persistent workers draw what fresh ones would."""
    def draws(persistent):
        loader = mxload.DataLoader(WorkerInfoDataset(), batch_size=2, num_workers=2, seed=5,
                                   start_method=start_method, persistent_workers=persistent)
        with loader:
            return [[r.tolist() for _, r in loader] for _epoch in range(3)]

    fresh, persistent = draws(False), draws(True)
    assert fresh[0] != fresh[1] != fresh[2]
    assert persistent == fresh


def test_unpicklable_dataset_with_spawn_names_the_type():
    class Local(mxload.Dataset):  # local class: cannot be pickled
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.array([i])

    loader = mxload.DataLoader(Local(), batch_size=2, num_workers=2, start_method="spawn")
    with pytest.raises(TypeError, match="Local.*cannot be pickled"):
        iter(loader)


@pytest.mark.parametrize("method", start_methods("fork", "spawn", "forkserver"))
def test_a_dataset_holding_multiprocessing_objects_shares_them_with_every_start_method(method):
    """Locks, events and Value/Array memory pickle only while a process
    starts (multiprocessing's "through inheritance"): torch's loader passes
    its dataset to the worker Process, so they work there; mxload pickles
    the payload once, as multiprocessing would, and passes their descriptors
    with it.  Every worker's loads show in the main process's objects."""
    ctx = mp.get_context(method)
    ds = SharedCounting(ctx, 24, workers=2)
    with mxload.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=method,
                           persistent_workers=True) as loader:
        for _epoch in range(2):
            assert np.concatenate(list(loader)).tolist() == list(range(24))
    assert ds.loads.value == 48 and sum(ds.by_worker) == 48 and min(ds.by_worker) > 0
    assert ds.loaded.is_set()
    assert sorted(ds.indices.recv() for _ in range(48)) == sorted(2 * list(range(24)))
    ds.indices.close()
    ds.sent.close()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_dataset_holding_as_many_descriptors_as_a_worker_can_receive_and_one_more(method):
    """The most descriptors a worker can receive with its dataset depends on how it starts: a
    spawn worker's arrive in one message of ours, a forkserver worker's in one message of
    multiprocessing's fork server, which adds its own and the worker's socket.  The most works;
    one more is a TypeError saying so, before anything is sent (the fork server is shared by
    the whole process: a message it cannot take killed it, and every later forkserver loader
    failed with EOFError, then ConnectionRefusedError)."""
    from mxload._runtime.local.launcher import max_payload_fds
    ctx = mp.get_context(method)
    most = max_payload_fds(method)
    ds = HoldingDescriptors(ctx, most)
    try:
        loader = mxload.DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context=method)
        assert np.concatenate(list(loader)).tolist() == [most] * 4
    finally:
        ds.close()
    ds = HoldingDescriptors(ctx, most + 1)
    try:
        loader = mxload.DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context=method)
        with pytest.raises(TypeError, match=rf"HoldingDescriptors.*multiprocessing objects with {most + 1} "
                                            rf"descriptors.*a {method!r} worker can receive at most {most}"):
            iter(loader)
    finally:
        ds.close()
    # The next loader of this start method in this process works.
    ds = HoldingDescriptors(ctx, 2)
    try:
        loader = mxload.DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=method)
        assert np.concatenate(list(loader)).tolist() == [2] * 4
    finally:
        ds.close()


@pytest.mark.slow
def test_the_fork_server_sends_what_mxload_counts_with_a_worker_s_descriptors(monkeypatch):
    """max_payload_fds("forkserver") counts what multiprocessing's fork server client sends
    with a worker's: measured here (its sendfds watched), so a Python that sends more fails."""
    from multiprocessing import reduction

    from mxload._runtime.local import launcher
    sent: list[int] = []
    real = reduction.sendfds

    def watched(sock, fds):
        sent.append(len(fds))
        return real(sock, fds)

    monkeypatch.setattr(reduction, "sendfds", watched)
    ds = HoldingDescriptors(mp.get_context("forkserver"), 3)
    try:
        loader = mxload.DataLoader(ds, batch_size=2, num_workers=1, multiprocessing_context="forkserver")
        assert np.concatenate(list(loader)).tolist() == [3] * 4
    finally:
        ds.close()
    assert sent == [3 + launcher.WORKER_SOCKET_FDS + launcher.FORK_SERVER_OWN_FDS]


@pytest.mark.slow
def test_multiprocessing_objects_of_a_fork_context_with_spawn_workers_is_an_error_naming_them():
    """As with torch's loader: multiprocessing refuses to share a lock made
    for fork children with a spawned process, and the error says so."""
    ds = SharedCounting(mp.get_context("fork"), 8, workers=1)
    loader = mxload.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(TypeError, match=r"SharedCounting.*cannot be pickled for 'spawn' workers: "
                                        r"A SemLock created in a fork context"):
        iter(loader)
    ds.indices.close()
    ds.sent.close()


def test_persistent_workers_survive_epochs_and_close_ends_them():
    with mxload.DataLoader(TupleDataset(20), batch_size=5, num_workers=2, persistent_workers=True) as loader:
        first = run(loader)
        pids = set(loader._iterations.engine.worker_pids())
        second = run(loader)
        assert first == second
        assert set(loader._iterations.engine.worker_pids()) == pids, "no new processes"
        it = iter(loader)
        next(it)
        del it  # abandoned mid-epoch: workers stay for the next epoch
        assert run(loader) == first
        engine = loader._iterations.engine
    assert engine.state == "closed"
    assert loader._iterations.engine is None


@pytest.mark.torch
def test_torch_from_numpy_keeps_the_slab_alive():
    torch = pytest.importorskip("torch")
    loader = mxload.DataLoader(TupleDataset(10), batch_size=5, num_workers=1)
    tensors = [torch.from_numpy(x) for x, _, _ in loader]
    del loader
    import gc
    gc.collect()
    assert float(tensors[1][4, 0, 0]) == 9.0


class CountingPickles(mxload.Dataset):
    """Counts how often it is pickled (in this process)."""
    pickles = 0

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return np.array([i])

    def __getstate__(self):
        type(self).pickles += 1
        return self.__dict__


@pytest.mark.parametrize("start_method", start_methods("spawn", "forkserver"))
def test_dataset_is_pickled_once_for_all_workers(start_method):
    CountingPickles.pickles = 0
    loader = mxload.DataLoader(CountingPickles(), batch_size=3, num_workers=4, start_method=start_method)
    assert np.concatenate(list(loader)).ravel().tolist() == list(range(12))
    assert CountingPickles.pickles == 1


def test_fork_is_kept_while_another_loaders_thread_runs():
    """The start method is never switched behind the user's back (issue 10
    item 8).  A thread-pool loader's threads run user code, so on Python
    3.12+ forking now gets Python's own warning about it."""
    threads = mxload.DataLoader(TupleDataset(8), batch_size=2, num_workers=1, thread_pool=True)
    it = iter(threads)
    next(it)
    loader = mxload.DataLoader(TupleDataset(8), batch_size=2, num_workers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        it2 = iter(loader)
    assert it2.engine.transport.start_method == "fork"
    assert [b[1].tolist() for b in it2] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    it.close()


# ---------------------------------------------------------------- several iterators (issue 10 item 14)


@pytest.mark.parametrize("mode", ["in-process", "fork", "thread"])
def test_iterators_of_one_loader_are_independent(mode):
    """zip(loader, loader) pairs two whole epochs, and interleaved iterators
    each get every batch once, in order (each has its own workers, as in torch)."""
    kwargs = {"in-process": {}, "fork": {"num_workers": 2},
              "thread": {"num_workers": 2, "thread_pool": True}}[mode]
    loader = mxload.DataLoader(TupleDataset(20), batch_size=4, **kwargs)
    expected = run(loader)
    assert len(expected) == 5
    pairs = list(zip(loader, loader))
    assert len(pairs) == 5
    assert [as_plain(a) for a, _ in pairs] == [as_plain(b) for _, b in pairs] == expected
    first, second = iter(loader), iter(loader)
    got_first = [as_plain(next(first))]
    got_second = [as_plain(b) for b in second]
    got_first += [as_plain(b) for b in first]
    assert got_first == got_second == expected


@pytest.mark.timeout(60)
def test_a_refill_that_waited_for_the_lock_while_a_newer_iter_began_an_epoch_sends_only_the_new_plan():
    """Persistent workers, one thread inside next() of an epoch whose tasks are all out (its
    refill, EngineWindow.dispatch_more, waits for the engine lock), another thread calling iter()
    meanwhile, which holds that lock while it begins a shorter epoch: the refill, once it has the
    lock, fills the window from the new epoch's plan.  It used to fill it from the plan it read
    before taking the lock (the old epoch's): tasks of the new epoch for batches outside its plan,
    with the old epoch's sample indices (a wrong batch for an out-of-order consumer).  And the old
    iterator's next() then ends as superseded: it used to go on waiting and take the new epoch's
    first batch, which the new iterator never saw."""
    from conftest import next_in_thread, wait_until

    with mxload.DataLoader(mxload.ArrayDataset(np.arange(400)), batch_sampler=EpochBatches(8, 2),
                           num_workers=1, prefetch=4, persistent_workers=True, timeout=10) as loader:
        first = iter(loader)
        engine = first.engine
        assert [next(first).tolist() for _ in range(6)] == [[2 * b, 2 * b + 1] for b in range(6)]
        assert engine.progress() == (6, 8) and engine.window.in_flight < engine.prefetch   # all out
        with engine.lock:   # what the newer iter() holds while it begins its epoch
            consumer, got = next_in_thread(first)
            wait_until(lambda: "futex" in asleep_in(os.getpid(), consumer.native_id),
                       what="the consumer's refill waiting for the engine lock")
            second = iter(loader)
            assert second.engine is engine
        consumer.join(10)
        assert not consumer.is_alive()
        out_of_plan = {key: list(indices) for w in engine.roster.workers
                       for key, indices in w.outstanding.items() if key[0] == 1 and key[1] >= 2}
        assert out_of_plan == {}, f"epoch 1 (2 batches) was sent tasks of epoch 0's plan: {out_of_plan}"
        assert engine.window.in_flight <= 2
        assert len(got) == 1 and isinstance(got[0], RuntimeError) and "superseded" in str(got[0]), got
        assert [b.tolist() for b in second] == [[100, 101], [102, 103]]


@pytest.mark.slow   # a worker sleeps 1 s in one batch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("thread_pool", [False, True], ids=["processes", "threads"])
def test_a_next_waiting_in_another_thread_ends_as_superseded_when_a_newer_iter_begins_an_epoch(in_order,
                                                                                               thread_pool):
    """Persistent workers; one thread waits inside next() for epoch 0's batch 6, which its
    worker is slow to make (1 s); meanwhile another thread's iter() begins a 2-batch epoch.  The
    waiting next() raises "superseded" at once, and the new iterator gets its batches, each once.
    It used to go on waiting: in order, for a batch 6 the new epoch never sends (until the
    loader's timeout, forever without one); out of order, until it took the new epoch's first
    batch, which the new iterator then never saw."""
    from conftest import next_waiting_in_thread
    from datasets_for_tests import SlowDataset

    ds = SlowDataset(1.0, n=400, only=frozenset({12}))
    with mxload.DataLoader(ds, batch_sampler=EpochBatches(8, 2), num_workers=1, prefetch=4, in_order=in_order,
                           persistent_workers=True, timeout=10, thread_pool=thread_pool) as loader:
        first = iter(loader)
        assert [next(first).ravel().tolist() for _ in range(6)] == [[2 * b, 2 * b + 1] for b in range(6)]
        consumer, got = next_waiting_in_thread(first, thread_pool, "the consumer waiting for batch 6")
        second = iter(loader)
        consumer.join(0.5)   # the worker sleeps 1 s in batch 6
        assert not consumer.is_alive(), "the superseded next() went on waiting"
        assert len(got) == 1 and isinstance(got[0], RuntimeError) and "superseded" in str(got[0]), got
        assert sorted(b.ravel().tolist() for b in second) == [[100, 101], [102, 103]]


def _iter_during_another_thread_s_epoch(loader, rng) -> tuple[list, list, object]:
    """One thread iterates an epoch of `loader`; after a random number of its batches and a
    random moment more, this thread's iter() begins the next and takes it whole.  (the new
    epoch's batches, the old thread's, how the old thread's loop ended: "exhausted" or the
    exception)."""
    import threading

    from conftest import wait_until

    old = iter(loader)
    got, ended = [], []

    def iterate():
        try:
            for batch in old:
                got.append(batch.tolist())
            ended.append("exhausted")
        except BaseException as e:
            ended.append(e)

    consumer = threading.Thread(target=iterate)
    consumer.start()
    k = rng.randrange(16)
    wait_until(lambda: len(got) >= k or ended, what=f"the old epoch's first {k} batches")
    time.sleep(rng.uniform(0, 0.0005))
    taken = [b.tolist() for b in iter(loader)]
    consumer.join(10)
    assert not consumer.is_alive(), "the superseded thread is still in next()"
    return taken, got, ended[0]


@pytest.mark.races
@pytest.mark.timeout(300)
@pytest.mark.parametrize("in_order", [True, False])
def test_a_newer_iter_at_a_random_moment_of_another_thread_s_epoch_loses_and_repeats_nothing(in_order, seed):
    """Persistent workers: one thread iterates an epoch while another calls iter() at a random
    moment and takes the new epoch whole (race_rounds(20) rounds).  The new iterator gets every
    batch of its epoch once (in order where asked); the old thread gets a prefix of its own epoch
    (all of it if it finished first), then "superseded", never a batch of the new epoch."""
    import random

    from conftest import race_rounds

    rng = random.Random(seed)
    expected = {base: [[base + 2 * b, base + 2 * b + 1] for b in range(16)] for base in (0, 100)}
    with mxload.DataLoader(mxload.ArrayDataset(np.arange(200)), batch_sampler=EpochBatches(16, cycle=2),
                           num_workers=2, prefetch=4, in_order=in_order, persistent_workers=True,
                           timeout=20) as loader:
        for r in range(race_rounds(20)):
            taken, got, ended = _iter_during_another_thread_s_epoch(loader, rng)
            new_base, old_base = (100, 0) if taken and taken[0][0] >= 100 else (0, 100)
            assert (taken if in_order else sorted(taken)) == expected[new_base], f"round {r}: {taken}"
            assert all(b in expected[old_base] for b in got), f"round {r}: the old epoch got {got}"
            assert len(got) == len({tuple(b) for b in got}), f"round {r}: repeated {got}"
            if in_order:
                assert got == expected[old_base][:len(got)], f"round {r}: {got}"
            if ended == "exhausted":
                assert sorted(got) == expected[old_base], f"round {r}: ended early with {got}"
            else:
                assert isinstance(ended, RuntimeError) and "superseded" in str(ended), f"round {r}: {ended!r}"


@pytest.mark.timeout(60)
def test_a_superseded_iterator_s_call_after_the_newer_iter_began_takes_nothing():
    """The gap its iterator's own check leaves: a thread past the check that its epoch is open,
    descheduled while another thread's iter() begins the next epoch on the persistent workers,
    then calling the producer.  The call gets CLOSED_BY_OTHER and the new iterator its whole
    epoch.  It used to take the new epoch's first batch: the call read the epoch count as it
    began, after the new epoch had."""
    from mxload._runtime.results import CLOSED_BY_OTHER

    with mxload.DataLoader(mxload.ArrayDataset(np.arange(200)), batch_sampler=EpochBatches(16, cycle=2),
                           num_workers=2, prefetch=4, persistent_workers=True, timeout=10) as loader:
        first = iter(loader)
        assert [next(first).tolist() for _ in range(3)] == [[0, 1], [2, 3], [4, 5]]
        producer = first._producer   # what first's next() calls once past its check
        second = iter(loader)
        assert producer.next_batch() is CLOSED_BY_OTHER
        assert [b.tolist() for b in second] == [[100 + 2 * b, 101 + 2 * b] for b in range(16)]


@pytest.mark.slow   # a worker sleeps 1 s in one batch
@pytest.mark.timeout(60)
@pytest.mark.parametrize("thread_pool", [False, True], ids=["processes", "threads"])
def test_closing_a_persistent_epoch_from_another_thread_ends_a_next_waiting_in_it(thread_pool):
    """One thread waits inside next() for a batch its worker is slow to make (1 s); another
    closes the iterator.  The wait ends at once (StopIteration, as after any close), and the
    workers stay for the next epoch, which gets every batch.  It used to wait for the slow
    batch."""
    from conftest import next_waiting_in_thread
    from datasets_for_tests import SlowDataset

    ds = SlowDataset(1.0, n=400, only=frozenset({12}))
    with mxload.DataLoader(ds, batch_sampler=EpochBatches(16, cycle=2), num_workers=1, prefetch=4,
                           persistent_workers=True, timeout=10, thread_pool=thread_pool) as loader:
        first = iter(loader)
        engine = first.engine
        assert [next(first).ravel().tolist() for _ in range(6)] == [[2 * b, 2 * b + 1] for b in range(6)]
        consumer, got = next_waiting_in_thread(first, thread_pool, "the consumer waiting for batch 6")
        first.close()
        consumer.join(0.5)   # the worker sleeps 1 s in batch 6
        assert not consumer.is_alive(), "the closed epoch's next() went on waiting"
        assert len(got) == 1 and isinstance(got[0], StopIteration), got
        second = iter(loader)
        assert second.engine is engine
        assert [b.ravel().tolist() for b in second] == [[100 + 2 * b, 101 + 2 * b] for b in range(16)]


def test_an_iterator_superseded_on_persistent_workers_raises_instead_of_losing_data():
    """Persistent workers serve one epoch at a time: a newer iter() takes
    them over, and the older iterator, used again, raises a clear error
    (it used to share the newer epoch's batches silently)."""
    with mxload.DataLoader(TupleDataset(20), batch_size=4, num_workers=2, persistent_workers=True) as loader:
        expected = run(loader)
        first = iter(loader)
        next(first)
        second = iter(loader)
        with pytest.raises(RuntimeError, match="superseded.*persistent workers.*persistent_workers=False"):
            next(first)
        assert [as_plain(b) for b in second] == expected
        with pytest.raises(RuntimeError, match="superseded"):
            list(zip(loader, loader))
        finished = iter(loader)
        assert [as_plain(b) for b in finished] == expected
        assert run(loader) == expected       # an exhausted iterator is not superseded, just done
        with pytest.raises(StopIteration):
            next(finished)


def test_loader_close_ends_every_live_iterator():
    loader = mxload.DataLoader(TupleDataset(40), batch_size=4, num_workers=1)
    its = [iter(loader), iter(loader)]
    engines = [it.engine for it in its]
    loader.close()
    assert [e.state for e in engines] == ["closed", "closed"]
    for it in its:
        with pytest.raises(StopIteration):
            next(it)
