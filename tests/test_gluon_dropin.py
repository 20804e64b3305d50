"""A Gluon user changes only the import: the scenarios of MXNet's Gluon data
tests (tests/python/unittest/test_gluon_data.py), replayed against mxload.
Each test names the Gluon scenario it mirrors; batches are numpy arrays where
Gluon's are NDArrays (docs/migration.md lists this divergence)."""
from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from conftest import wait_until

import mxload
from mxload import batchify
from mxload.sampler import BatchSampler, IntervalSampler, RandomSampler, SequentialSampler

pytestmark = pytest.mark.timeout(120)


class Ones(mxload.Dataset):
    """Gluon's test_multi_worker dataset: sample i is an array filled with i."""

    def __len__(self):
        return 50

    def __getitem__(self, i):
        return np.full((10,), i, np.float32)


class ImageLabel(mxload.Dataset):
    def __len__(self):
        return 50

    def __getitem__(self, i):
        return np.full((3, 4, 4), i, np.uint8), i


def _gluon_style_batchify(samples):
    data, labels = zip(*samples)
    return np.stack(data).astype(np.float32), np.array(labels)


def test_array_dataset():
    x = np.random.default_rng(0).uniform(size=(10, 20))
    y = np.arange(10.0)
    for i, (bx, by) in enumerate(mxload.DataLoader(mxload.ArrayDataset(x, y), 2)):
        np.testing.assert_array_equal(bx, x[2 * i:2 * i + 2])
        np.testing.assert_array_equal(by, y[2 * i:2 * i + 2])
    for i, bx in enumerate(mxload.DataLoader(mxload.ArrayDataset(x), 2)):
        np.testing.assert_array_equal(bx, x[2 * i:2 * i + 2])


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_list_dataset(num_workers):
    # A plain Python list is a dataset.
    out = list(mxload.DataLoader([([1, 2], 0), ([3, 4], 1)], batch_size=1, num_workers=num_workers))
    assert [(np.asarray(d).ravel().tolist(), int(y[0])) for d, y in out] == [([1, 2], 0), ([3, 4], 1)]


def test_sampler():
    assert list(SequentialSampler(10)) == list(range(10))
    assert sorted(RandomSampler(10)) == list(range(10))
    seq = SequentialSampler(10)
    # Gluon 1.9's BatchSampler yields lists: they add up.
    assert sum(list(BatchSampler(seq, 3, "keep")), []) == list(range(10))
    assert sum(list(BatchSampler(seq, 3, "discard")), []) == list(range(9))
    rand_keep = BatchSampler(RandomSampler(10), 3, "keep")
    assert sorted(sum(list(rand_keep), [])) == list(range(10))
    assert sorted(IntervalSampler(10, 3)) == list(range(10))
    assert list(IntervalSampler(13, 3)) == [0, 3, 6, 9, 12, 1, 4, 7, 10, 2, 5, 8, 11]
    assert list(IntervalSampler(10, 3, rollover=False)) == [0, 3, 6, 9]
    assert len(IntervalSampler(10, 3, False)) == 4
    assert list(SequentialSampler(3, start=4)) == [4, 5, 6]
    with pytest.raises(ValueError, match="interval"):
        IntervalSampler(3, 3)


def test_rollover_counts_match_gluon_after_an_abandoned_epoch():
    # Gluon's BatchSampler hands the leftovers on only when an epoch is
    # consumed to its end; an abandoned epoch has used up the previous carry.
    ds = mxload.SimpleDataset(list(range(10)))
    for num_workers in (0, 2):
        loader = mxload.DataLoader(ds, batch_size=3, last_batch="rollover", num_workers=num_workers)
        assert len(loader) == 3 and len(list(loader)) == 3       # 9 left over
        assert len(loader) == 3                                     # (1 + 10) // 3
        it = iter(loader)
        assert next(it).tolist() == [9, 0, 1]
        del it                                                      # abandoned after its first batch
        assert len(loader) == 3                                     # 10 // 3: nothing carried
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
        assert len(loader) == 3 and next(iter(loader)).tolist() == [9, 0, 1]


def test_rollover_sampler_direct_iteration():
    bs = BatchSampler(SequentialSampler(10), 3, "rollover")
    assert list(bs)[-1] == [6, 7, 8]
    it = iter(bs)
    assert next(it) == [9, 0, 1]
    del it
    assert len(bs) == 3 and list(bs)[0] == [0, 1, 2]


@pytest.mark.parametrize("thread_pool", [False, True])
def test_multi_worker(thread_pool):
    loader = mxload.DataLoader(Ones(), batch_size=1, num_workers=5, thread_pool=thread_pool)
    for i, batch in enumerate(loader):
        assert (batch == i).all()


@pytest.mark.parametrize("thread_pool", [False, True])
def test_multi_worker_shape(thread_pool):
    batch_size = 64
    data = mxload.ArrayDataset(np.ones((batch_size + 1, 11, 12)))
    loader = mxload.DataLoader(data, batch_size=batch_size, num_workers=3, last_batch="keep",
                               thread_pool=thread_pool)
    assert [b.shape for b in loader] == [(batch_size, 11, 12), (1, 11, 12)]


@pytest.mark.parametrize("thread_pool", [False, True])
def test_multi_worker_forked_data_loader(thread_pool):
    loader = mxload.DataLoader(ImageLabel(), batch_size=2, shuffle=True, batchify_fn=_gluon_style_batchify,
                               num_workers=2, pin_memory=True, thread_pool=thread_pool)
    with pytest.warns(UserWarning, match="pin_memory"):
        for i, (x, y) in enumerate(loader):
            assert x.shape == (2, 3, 4, 4) and x.dtype == np.float32 and (x[:, 0, 0, 0] == y).all()
            if i == 10:
                break


def test_multi_worker_dataloader_release_pool():
    # Loaders made and dropped in a row leave nothing behind (the autouse
    # leak check proves it; Gluon's test makes 10, 4 show the same).
    for _ in range(4):
        loader = mxload.DataLoader(Ones(), batch_size=5, num_workers=2)
        next(iter(loader))
        del loader
        gc.collect()


def _make_iterator():
    loader = mxload.DataLoader(Ones(), batch_size=5, num_workers=2)
    return iter(loader)


def test_dataloader_scope():
    # The loader goes out of scope while its iterator is still used.
    it = _make_iterator()
    gc.collect()
    assert len(list(it)) == 10


def test_dataloader_context():
    # pin_memory / pin_device_id are accepted; without an accelerator torch's
    # warning says the memory stays pageable, and batches are the same.
    x = np.random.default_rng(1).uniform(size=(10, 20))
    plain = [b.copy() for b in mxload.DataLoader(mxload.ArrayDataset(x), 8)]
    with pytest.warns(UserWarning, match="pin_memory"):
        pinned = list(mxload.DataLoader(mxload.ArrayDataset(x), 8, pin_memory=True, pin_device_id=1))
    for a, b in zip(plain, pinned):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="pin_device_id"):
        mxload.DataLoader(mxload.ArrayDataset(x), 8, pin_memory=True, pin_device_id=-1)


def test_gluon_positional_order():
    # dataset, batch_size, shuffle, sampler, last_batch, batch_sampler,
    # batchify_fn, num_workers, pin_memory, pin_device_id, prefetch,
    # thread_pool, timeout, auto_reload
    loader = mxload.DataLoader(Ones(), 4, False, None, "discard", None, batchify.Stack(), 2, False, 0, 3,
                               True, 60, False)
    assert (loader.last_batch, loader.num_workers, loader.prefetch, loader.thread_pool, loader.timeout) == (
        "discard", 2, 3, True, 60)
    assert len(list(loader)) == 12


def test_auto_reload_prefetches_the_next_epoch():
    calls = []

    class Recording(mxload.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            calls.append(i)
            return i

    loader = mxload.DataLoader(Recording(), 2, num_workers=0, auto_reload=True)
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    threads = mxload.DataLoader(Recording(), 2, num_workers=1, thread_pool=True, auto_reload=True)
    with threads:
        assert [b.tolist() for b in threads] == [[0, 1], [2, 3]]
        assert threads._iterations.ahead is not None   # the next epoch is already loading
        assert [b.tolist() for b in threads] == [[0, 1], [2, 3]]


def test_try_nopython_accepted():
    assert len(list(mxload.DataLoader(Ones(), 10, try_nopython=True))) == 5


# ------------------------------------------------------------------ datasets


def test_dataset_filter():
    a = mxload.SimpleDataset(list(range(100)))
    filtered = a.filter(lambda x: x % 10 == 0)
    assert len(filtered) == 10 and all(s % 10 == 0 for s in filtered)
    # on a lazily transformed dataset the filter sees transformed samples
    xformed = a.transform(lambda x: x + 1).filter(lambda x: x % 10 == 0)
    assert len(xformed) == 10 and [xformed[i] for i in range(10)] == list(range(10, 101, 10))
    with pytest.raises(TypeError, match="callable"):
        a.filter(3)


def test_dataset_shard():
    a = mxload.SimpleDataset(list(range(9)))
    shards = [a.shard(4, i) for i in range(4)]
    assert [len(s) for s in shards] == [3, 2, 2, 2]
    assert sum(sum(s[i] for i in range(len(s))) for s in shards) == sum(range(9))
    assert [shards[0][i] for i in range(3)] == [0, 1, 2] and [shards[3][i] for i in range(2)] == [7, 8]
    with pytest.raises(ValueError, match="shard index 4"):
        a.shard(4, 4)
    with pytest.raises(ValueError, match="num_shards"):
        a.shard(0, 0)


def test_dataset_take():
    a = mxload.SimpleDataset(list(range(100)))
    assert len(a.take(1000)) == 100 and len(a.take(None)) == 100
    ten = a.take(10)
    assert [ten[i] for i in range(10)] == list(range(10))
    xformed = a.transform(lambda x: x * 10).take(10)
    assert [xformed[i] for i in range(10)] == list(range(0, 100, 10))
    with pytest.raises(IndexError):
        ten[10]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sampled_datasets_keep_batch_fetch_and_load(num_workers):
    arr = mxload.ArrayDataset(np.arange(20), np.arange(20) * 2)
    part = arr.shard(2, 1).filter(lambda s: s[0] % 2 == 0)
    assert hasattr(part, "__getitems__")   # the vectorised gather survives
    xs = np.concatenate([x for x, _ in mxload.DataLoader(part, 2, num_workers=num_workers)])
    assert xs.tolist() == [10, 12, 14, 16, 18]
    assert [len(b) for b in mxload.DataLoader(mxload.SimpleDataset(list(range(9))).sample(
        IntervalSampler(9, 4)), 4, num_workers=num_workers)] == [4, 4, 1]


# ------------------------------------------------------------------ batchify


def test_batchify_stack():
    a = [[1, 2, 3, 4], [5, 6, 7, 8]]
    b = [[5, 8, 0, 1], [1, 2, 3, 4]]
    out = batchify.Stack()([a, b])
    assert out.shape == (2, 2, 4) and out.tolist() == [a, b]


def test_batchify_pad():
    a = np.array([[1, 2, 3, 4], [11, 12, 13, 14]])
    b = np.array([[4, 5, 6]])
    c = np.array([[9, 10]])
    out = batchify.Pad(val=-1)([a, b, c])   # Gluon 2.x: every axis padded to the largest
    assert out.shape == (3, 2, 4)
    assert out.tolist() == [[[1, 2, 3, 4], [11, 12, 13, 14]],
                            [[4, 5, 6, -1], [-1, -1, -1, -1]],
                            [[9, 10, -1, -1], [-1, -1, -1, -1]]]
    # GluonNLP / Gluon 1.x keywords
    padded, lengths = batchify.Pad(axis=0, pad_val=-1, ret_length=True, dtype="float32")([[1, 2], [3]])
    assert padded.dtype == np.float32 and padded.tolist() == [[1, 2], [3, -1]] and lengths.tolist() == [2, 1]
    assert batchify.Pad(round_to=4)([[1, 2, 3], [4]]).shape == (2, 4)
    with pytest.raises(ValueError, match="pad_val or val"):
        batchify.Pad(pad_val=1, val=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batchify_pad_every_axis_in_workers(num_workers):
    ds = mxload.SimpleDataset([np.ones((i % 3 + 1, 3 - i % 3), np.int16) * i for i in range(6)])
    for b in mxload.DataLoader(ds, 3, batchify_fn=batchify.Pad(pad_val=-1), num_workers=num_workers):
        assert b.shape == (3, 3, 3) and b.dtype == np.int16
        assert b[0, 0, 0] != -1 and b[0, 2, 2] == -1


def test_batchify_group_and_append_and_aslist():
    a = [[1, 2, 3, 4], [5, 6, 7, 8]]
    b = [[4, 5, 6], [8, 2, 1]]
    stacked, padded = batchify.Group(batchify.Stack(), batchify.Pad(val=-1))([(a, b), (a, [[1]])])
    assert stacked.shape == (2, 2, 4) and padded.tolist() == [b, [[1, -1, -1], [-1, -1, -1]]]
    assert type(batchify.Group([batchify.Stack()])([(1,), (2,)])) is tuple
    out = batchify.Append()([[1, 2, 3, 4], [4, 5, 6], [8, 2]])
    assert [x.tolist() for x in out] == [[[1, 2, 3, 4]], [[4, 5, 6]], [[8, 2]]]
    assert [x.shape for x in batchify.Append(expand=False)([np.zeros(2), np.zeros(3)])] == [(2,), (3,)]
    assert batchify.AsList()(["I am", "Gluon"]) == ["I am", "Gluon"]


def test_append_in_workers_uses_shared_memory():
    ds = mxload.SimpleDataset([np.arange(i + 1) for i in range(6)])
    out = list(mxload.DataLoader(ds, 3, batchify_fn=batchify.Append(), num_workers=2))
    assert [[x.tolist() for x in b] for b in out] == [
        [[[0]], [[0, 1]], [[0, 1, 2]]], [[[0, 1, 2, 3]], [[0, 1, 2, 3, 4]], [[0, 1, 2, 3, 4, 5]]]]


def test_rollover_epoch_too_short_for_a_batch_carries_its_samples_into_a_checkpoint():
    # Found by the resume property test: an epoch with no batch is complete at once.
    loader = mxload.DataLoader(mxload.SimpleDataset([7]), batch_size=2, last_batch="rollover")
    it = iter(loader)
    state = loader.state_dict()
    del it
    assert state["sampler"]["carry"] == [0]
    resumed = mxload.DataLoader(mxload.SimpleDataset([7]), batch_size=2, last_batch="rollover")
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[7, 7]]


# ------------------------------------------------ constructor conflicts and timeout= (Gluon 1.9's DataLoader)


@pytest.mark.parametrize("kwargs", [
    dict(batch_size=2, shuffle=True, sampler=SequentialSampler(50)),
    dict(batch_size=4, batch_sampler=BatchSampler(SequentialSampler(50), 2)),
    dict(shuffle=True, batch_sampler=BatchSampler(SequentialSampler(50), 2)),
    dict(sampler=SequentialSampler(50), batch_sampler=BatchSampler(SequentialSampler(50), 2)),
    dict(last_batch="keep", batch_sampler=BatchSampler(SequentialSampler(50), 2)),
    dict(last_batch="discard", batch_sampler=BatchSampler(SequentialSampler(50), 2)),
    dict(last_batch="rollover", batch_sampler=BatchSampler(SequentialSampler(50), 2)),
    dict(shuffle=True, sampler=SequentialSampler(50), batch_sampler=BatchSampler(SequentialSampler(50), 2)),
    dict(batch_size=2, last_batch="sometimes"),
])
def test_conflicting_arguments_raise_value_error_as_gluon(kwargs):
    with pytest.raises(ValueError):
        mxload.DataLoader(Ones(), **kwargs)


class Late(mxload.Dataset):
    """Its samples come only once `released` is set: never in a forked worker, in a thread once
    the epoch is closed, so only the loader's timeout can end a wait for a batch, however slow
    the machine (a sample that slept 0.6 s against a 0.5 s bound depended on its speed)."""

    def __init__(self):
        self.released = threading.Event()

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.released.wait(60)
        return np.float32(i)


@pytest.mark.parametrize("thread_pool", [False, True])
def test_timeout_raises_when_a_batch_is_late_as_gluon(thread_pool):
    import multiprocessing
    import time
    dataset = Late()
    loader = mxload.DataLoader(dataset, batch_size=1, num_workers=1, thread_pool=thread_pool, timeout=0.2)
    it = iter(loader)
    # A thread cannot be killed: its epoch ends once its current sample returns (its queued
    # batch is dropped, not loaded), which the shutdown waits for up to its 1 s bound.  Released
    # once the timeout has closed the epoch's buffer (no batch can reach the loop any more), it
    # returns at once.  (test_epoch's close from another thread keeps a thread busy through the
    # whole bound.)  A worker process is ended still waiting.
    buffer = it.engine.buffer

    def release_once_closed():
        try:
            wait_until(lambda: buffer.closed, what="the epoch's buffer closed")
        finally:
            dataset.released.set()
    releaser = threading.Thread(target=release_once_closed)
    if thread_pool:
        releaser.start()
    start = time.monotonic()
    # Gluon 1.9 raises multiprocessing's TimeoutError from its pool's get(timeout); torch a
    # RuntimeError "DataLoader timed out after N seconds": LoaderTimeoutError is both.
    try:
        with pytest.raises(multiprocessing.TimeoutError) as info:
            next(it)
        waited = time.monotonic() - start
    finally:
        dataset.released.set()
        if thread_pool:
            releaser.join()
    # When the batch's wait exceeds timeout (no batch ever comes here), never sooner.
    assert 0.2 <= waited, waited
    error = info.value
    assert isinstance(error, mxload.LoaderTimeoutError) and isinstance(error, TimeoutError)
    assert isinstance(error, RuntimeError) and "DataLoader timed out after 0.2 seconds" in str(error)
    # The epoch is over (its workers were ended) and says why, every time: never a StopIteration, which
    # would pass for an exhausted epoch where a signal handler's exception replaced the timeout's.
    for _ in range(2):
        with pytest.raises(mxload.EpochAbortedError,
                           match="ended with LoaderTimeoutError: DataLoader timed out"):
            next(it)
    del it, info, error
