"""Epoch planning (mxload/_runtime/epoch.py): which batches an epoch
delivers, fresh or resumed from a state_dict, the same for 0 or N workers."""
import os

import numpy as np
import pytest
from conftest import asleep_in, wait_until

import mxload
from mxload._runtime.plan import EpochPlan
from mxload._runtime.progress import EpochProgress
from mxload.sampler import EpochBatches


def batches(n):
    return [np.arange(2 * i, 2 * i + 2, dtype=np.int64) for i in range(n)]


def plan_of(every, progress, known=True):
    """The plan of an epoch of `every` batch, drawn as the sampler would be (its count known
    before, as mxload's samplers', or only at its end); also what was drawn from the sampler."""
    drawn = []

    def draw(start):
        def batches():
            for i, b in enumerate(every[start:], start):
                drawn.append(i)
                yield b
        n = len(every) if known else None
        return EpochBatches(batches(), n, n, "the sampler")
    return EpochPlan.of(draw, progress, 0), drawn


def handed(plan):
    """Every batch the plan hands out, as its takers take them."""
    out = []
    while (got := plan.supply.peek()) is not None:
        out.append(got[0])
        plan.supply.handed = got[0] + 1
    return out


@pytest.mark.parametrize("known", [True, False], ids=["count known", "count at the end"])
def test_a_fresh_epoch_delivers_every_batch_in_order_drawn_as_needed(known):
    progress = EpochProgress(0, None, None)
    plan, drawn = plan_of(batches(5), progress, known)
    assert plan.discard == 0 and drawn == []   # nothing drawn before a batch is asked for
    assert plan.supply.peek()[0] == 0 and drawn == [0, 1]   # the first, and one ahead
    assert handed(plan) == [0, 1, 2, 3, 4] and progress.total == 5


def test_a_resumed_epoch_leaves_out_exactly_the_batches_taken():
    progress = EpochProgress(3, None, None, {"prefix": 2, "extra": [4]})
    plan, drawn = plan_of(batches(6), progress)
    assert handed(plan) == [2, 3, 5] and plan.discard == 0 and plan.supply.length == 3
    assert progress.total == 6 and drawn == [2, 3, 4, 5]   # the prefix is never drawn


def test_a_resumed_stream_is_replayed_dropping_what_was_taken():
    plan = EpochPlan.of(None, EpochProgress(0, None, None, {"prefix": 3, "extra": [5]}), 0)
    assert plan.supply is None and plan.discard == 4


def test_an_epoch_whose_batches_were_all_taken_is_empty_and_complete():
    done = []
    progress = EpochProgress(0, None, None, {"prefix": 3})
    progress.on_complete = lambda: done.append(True)
    plan, _ = plan_of(batches(3), progress)
    assert handed(plan) == [] and progress.complete and done == [True]


def test_batches_taken_in_order_out_of_order_or_twice_count_once_and_complete_the_epoch_once():
    done = []
    progress = EpochProgress(0, None, None)
    progress.on_complete = lambda: done.append(True)
    plan_of(batches(5), progress)   # the epoch's count (5), known before
    for idx in (0, 1, 3, 1, 3, 2):
        progress.taken(idx)
    assert (progress.prefix, progress.count, progress.done(), done) == (4, 4, (4, []), [])
    progress.taken(4)
    progress.taken(4)
    assert (progress.count, progress.complete, done) == (5, True, [True])


MODES = [dict(num_workers=0), dict(num_workers=2, thread_pool=True), dict(num_workers=2)]


@pytest.mark.parametrize("kwargs", MODES, ids=["in-process", "threads", "processes"])
def test_a_resumed_epoch_yields_the_rest_and_its_length_counts_them(kwargs):
    def loader():
        return mxload.DataLoader(mxload.ArrayDataset(np.arange(22)), batch_size=3, shuffle=True, seed=4,
                                 **kwargs)
    first = loader()
    it = iter(first)
    assert len(it) == 8
    taken = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    rest = [b.tolist() for b in it]
    assert state["done"] == {"prefix": 3, "extra": []} and len(taken + rest) == 8
    resumed = loader()
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    assert len(it2) == 5
    assert [b.tolist() for b in it2] == rest


@pytest.mark.parametrize("kwargs", MODES, ids=["in-process", "threads", "processes"])
def test_a_resumed_stream_yields_the_rest(kwargs):
    class Stream(mxload.IterableDataset):
        def __iter__(self):
            info = mxload.get_worker_info()
            start, step = (0, 1) if info is None else (info.id, info.num_workers)
            return iter(np.arange(start, 20, step))

    def loader():
        return mxload.DataLoader(Stream(), batch_size=4, **kwargs)
    first = loader()
    it = iter(first)
    taken = [next(it).tolist() for _ in range(2)]
    state = first.state_dict()
    rest = [b.tolist() for b in it]
    resumed = loader()
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest
    assert sorted(x for b in taken + rest for x in b) == list(range(20))


@pytest.mark.parametrize("kwargs", [dict(thread_pool=True), dict()], ids=["threads", "processes"])
def test_close_from_another_thread_ends_a_waiting_next_cleanly(kwargs):
    """close() while another thread waits in next(): that next() ends the
    epoch with StopIteration (never the reorder buffer's internal
    BufferClosedError), within the shutdown's bound."""
    import threading
    import time

    from datasets_for_tests import SlowDataset
    loader = mxload.DataLoader(SlowDataset(0.5, n=8), batch_size=2, num_workers=2, **kwargs)
    it = iter(loader)
    consumer = threading.get_native_id()

    def close_once_next_waits():
        wait_until(lambda: asleep_in(os.getpid(), consumer), what="next() asleep in its wait")
        it.close()
    closer = threading.Thread(target=close_once_next_waits)
    closer.start()
    t0 = time.monotonic()
    with pytest.raises(StopIteration):
        next(it)
    assert time.monotonic() - t0 < 5.0
    closer.join()
    with pytest.raises(StopIteration):
        next(it)
