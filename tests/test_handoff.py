"""The main process's per-batch hand-off, compiled (csrc/handoff.pxi,
csrc/task.pxi): a stored batch claimed as views of its task's slab, and a
worker's tasks sent in as few messages as the slabs' descriptors allow; and
the loader-level guarantees of holding a task back for its worker's next.
(conftest.py checks after every test that no process, thread, descriptor
or slab is left.)"""
from __future__ import annotations

import faulthandler
import gc
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_core_receive import batch_frame, receiver

import mxload
from mxload import _core
from mxload._collate import layout
from mxload._runtime.local import receiver as fetcher
from mxload._runtime.local import wire
from mxload._runtime.local.slabs import SlabPool, create_shared_fd

pytestmark = pytest.mark.timeout(60)


def _slab(slab_id: int, size: int = 4096) -> _core.Slab:
    fd = os.memfd_create("mxload-test-handoff")
    try:
        os.ftruncate(fd, size)
        return _core.Slab(fd, size, slab_id)
    finally:
        os.close(fd)


def _raw_batch(epoch: int, idx: int, slab_id: int, nbytes: int, layout_id: int,
               tag: int = 7) -> _core.RawBatch:
    """A RawBatch as the receive path stores it (from a real frame)."""
    main, worker = socket.socketpair()
    wake_r, wake_w = os.pipe()
    rb = _core.ReorderBuffer()
    rcv = receiver(1, wake_r, rb)
    try:
        rcv.attach(0, main.fileno(), -1, tag)
        rb.start_epoch(epoch)
        worker.sendall(batch_frame(epoch, idx, slab_id, nbytes, layout_id))
        event, _, _, raw = rcv.get(idx, False, 5.0)
        assert event == _core.EV_READY and isinstance(raw, _core.RawBatch)
        return raw
    finally:
        rcv.close()
        for fd in (wake_r, wake_w):
            os.close(fd)
        main.close()
        worker.close()


def _xy_template() -> _core.ViewTemplate:
    root = layout.tuple_node(None, [layout.field_node(0), layout.field_node(1)])
    return layout.compile_template((root, [(0, (2, 3), "<f4"), (64, (2,), "<i8")]))


class _Handle(_core.WorkerChannel):
    """A worker's channel as the compiled send and hand-off read it, plus what errors name."""


def _handle(tag: int = 7, **kw) -> _Handle:
    handle = _Handle()
    for name, value in dict(worker_id=0, pid=123, tag=tag, **kw).items():
        setattr(handle, name, value)
    return handle


def test_a_claimed_batch_is_views_of_its_tasks_slab_and_recycles_it():
    slab = _slab(5)
    np.ndarray((2, 3), np.float32, buffer=slab)[...] = np.arange(6).reshape(2, 3)
    np.ndarray((2,), np.int64, buffer=slab, offset=64)[...] = [10, 11]
    handle = _handle(slabs={(3, 4): slab}, layouts={1: (None, _xy_template())})
    released = []
    x, y = _core.claim_batch(_raw_batch(3, 4, 5, 80, 1), [handle], released.append)
    assert x.tolist() == [[0, 1, 2], [3, 4, 5]] and y.tolist() == [10, 11]
    assert np.shares_memory(x, np.frombuffer(slab, np.uint8)) and handle.slabs == {}
    assert released == []
    del x, y
    gc.collect()
    assert released == [slab]


def _lender(copy_from_lent: int, copy_max_bytes: int):
    pooled, counts = {}, {"slabs_reused": 0, "batches_copied": 0}
    free = _core.FreeSlabs(pooled, counts)
    return _core.BatchLender(free, counts, copy_from_lent, copy_max_bytes), free, pooled, counts


def test_a_lender_gives_views_of_the_slab_until_the_loop_keeps_many_then_copies_small_batches():
    """Below `copy_from_lent` batches alive, a batch is views of its slab,
    which comes back when they die; from then on one of at most
    `copy_max_bytes` is a private copy (equal, writable, independent) and
    its slab is free at once; a larger one still gets its slab."""
    lender, free, pooled, counts = _lender(copy_from_lent=2, copy_max_bytes=32)
    slabs = [_slab(i) for i in range(5)]
    for i, slab in enumerate(slabs):
        pooled[i] = slab
        np.ndarray((4,), np.int64, buffer=slab)[...] = np.arange(4) + 10 * i
    kept = [np.ndarray((4,), np.int64, buffer=lender.owner(slab, 32)) for slab in slabs[:4]]
    assert lender.lent == 2 and counts["batches_copied"] == 2
    assert [bool(np.shares_memory(k, np.frombuffer(s, np.uint8))) for k, s in zip(kept, slabs)] == \
        [True, True, False, False]
    assert [k.base.slab.shared for k in kept] == [True, True, False, False]
    assert len(free) == 2   # the copied batches' slabs, free at once
    assert [k.tolist() for k in kept] == [[10 * i + j for j in range(4)] for i in range(4)]
    np.ndarray((4,), np.int64, buffer=slabs[3])[...] = -1   # the slab reused: the copy keeps its values
    kept[3][0] = 99
    assert kept[3].tolist() == [99, 31, 32, 33]
    big = np.ndarray((4,), np.int64, buffer=lender.owner(slabs[4], 64))   # over copy_max_bytes
    assert big.base.slab is slabs[4] and lender.lent == 3 and counts["batches_copied"] == 2
    del kept[:2], big
    gc.collect()
    assert lender.lent == 0 and len(free) == 5
    assert np.ndarray((4,), np.int64, buffer=lender.owner(slabs[0], 32)).base.slab.shared


def _free_slabs(n):
    """A FreeSlabs with `n` pooled slabs (ids 0..n-1) released in order: (free, pooled, counts, slabs)."""
    pooled, counts = {}, {"slabs_reused": 0}
    free = _core.FreeSlabs(pooled, counts)
    slabs = [_slab(i) for i in range(n)]
    for slab in slabs:
        pooled[slab.slab_id] = slab
        free.release(slab)
    return free, pooled, counts, slabs


def test_a_worker_gets_a_free_slab_it_has_mapped_before_the_oldest_one_it_has_not():
    """acquire(known): the oldest free slab among those the worker already maps
    (no descriptor to send, no page to fault in again); else the oldest free one."""
    free, pooled, counts, slabs = _free_slabs(4)
    assert free.acquire({2, 3}) is slabs[2]
    assert free.acquire({9}) is slabs[0]              # none known is free: the oldest
    assert free.acquire() is slabs[1]                 # no worker named: the oldest
    del pooled[3]                                     # retired: never handed out, known or not
    assert free.acquire({3}) is None and len(free) == 0
    assert counts["slabs_reused"] == 3


def test_trimming_the_free_slabs_hands_out_those_free_since_the_last_trim_beyond_the_first_kept():
    """trim(keep): of the slabs no acquire needed since the last trim, those
    beyond the first `keep` still pooled (the last freed first)."""
    free, pooled, _, slabs = _free_slabs(6)
    assert free.trim(2) == []   # none known to be unused yet (the pool's first trim)
    del pooled[1]   # retired meanwhile: not counted, not handed out
    taken = free.acquire()       # the fewest free since that trim: 5
    assert taken is slabs[0]
    free.release(taken)
    assert free.trim(2) == [slabs[0], slabs[5], slabs[4]]   # of the 5 pooled, all but the 2 kept
    assert len(free) == 2 and free.acquire() is slabs[2] and free.acquire() is slabs[3]
    assert free.trim(0) == [] and free.acquire() is None
    # A slab needed each epoch (the free list ran dry) is never retired.
    free.release(slabs[2])
    free.release(slabs[3])
    assert free.trim(0) == []


def test_a_private_slab_is_heap_memory_of_its_size():
    slab = _core.Slab(-1, 100, "copy", private=True)
    assert not slab.shared and slab.size == 100 and slab.slab_id == "copy"
    assert slab.address % 64 == 0   # as a slab's fields are
    view = np.frombuffer(slab, np.uint8)
    view[:] = 7
    assert view.sum() == 700
    with pytest.raises(ValueError, match="slab size must be positive"):
        _core.Slab(-1, 0, private=True)
    assert _slab(1).shared


def test_a_batch_whose_task_is_gone_is_not_claimed():
    """Its worker was replaced (another tag in the slot), the slot is
    unknown, or the handle holds no such task: None, nothing released."""
    slab = _slab(5)
    raw = _raw_batch(3, 4, 5, 80, 1, tag=7)
    released = []
    replaced = _handle(tag=8, slabs={(3, 4): slab}, layouts={1: (None, _xy_template())})
    assert _core.claim_batch(raw, [replaced], released.append) is None
    assert _core.claim_batch(raw, [], released.append) is None
    assert _core.claim_batch(raw, [_handle(layouts={1: (None, _xy_template())})], released.append) is None
    assert released == [] and replaced.slabs == {(3, 4): slab}


@pytest.mark.parametrize("case", ["another slab", "no slab", "unknown layout"])
def test_a_batch_contradicting_its_task_is_a_protocol_error_naming_both(case):
    slab = _slab(5)
    task_slab = {"another slab": _slab(6), "no slab": None, "unknown layout": slab}[case]
    layouts = {} if case == "unknown layout" else {1: (None, _xy_template())}
    handle = _handle(slabs={(3, 4): task_slab}, layouts=layouts)
    pool = SimpleNamespace(released=[], lender=None)
    pool.release = pool.released.append
    raw = _raw_batch(3, 4, 5, 80, 1)
    got = _core.claim_batch(raw, [handle], pool.release)
    assert isinstance(got, _core.ClaimMismatch)
    assert got.task_slab_id == (None if task_slab is None else task_slab.slab_id)
    assert pool.released == ([] if task_slab is None else [task_slab])   # the slab is not lost
    handle.slabs[(3, 4)] = task_slab
    with pytest.raises(wire.ProtocolError,
                       match=r"worker 0 \(pid 123\) sent batch 4 in slab 5 with layout 1; "
                             r"its task had slab (6|None|5) and it named layouts \[(1)?\]"):
        fetcher.adopt_raw(raw, [handle], pool)


class _Pool:
    """A SlabPool holding `n` free slabs, with the descriptors it would pass."""

    def __init__(self, n: int):
        self.pool = SlabPool(8)
        self.stats = self.pool.counts
        self.slabs = [self.pool.adopt(create_shared_fd(65536), 65536) for _ in range(n)]
        for slab in self.slabs:
            self.pool.release(slab)

    def close(self) -> None:
        self.pool.close()
        self.slabs.clear()   # the fixture's value outlives the test: keep no mapping


@pytest.fixture
def channel():
    main, worker = socket.socketpair()
    pool = _Pool(3)
    yield main, worker, pool
    pool.close()
    main.close()
    worker.close()


def _tasks(epoch: int, *indices: int) -> list[tuple[int, int, np.ndarray, bool]]:
    return [(epoch, i, np.arange(i, i + 3, dtype=np.int64), False) for i in indices]


def test_tasks_of_known_slabs_go_in_one_message(channel):
    main, worker, pool = channel
    handle = _handle(sock=main, known_slabs={s.slab_id for s in pool.slabs}, pending_drops=[41, 42])
    done, messages, unsent = _core.send_tasks(handle, pool.pool, wire.TASK_PREFIX, _tasks(2, 10, 12, 14))
    assert (done, messages, unsent) == (3, 1, None)
    assert handle.slabs == {(2, 10): pool.slabs[0], (2, 12): pool.slabs[1], (2, 14): pool.slabs[2]}
    assert handle.pending_drops == []
    got = [wire.recv(worker) for _ in range(3)]
    assert [(t.epoch, t.batch_index, t.slab_id, t.drop_slabs, fds) for t, fds in got] == [
        (2, 10, pool.slabs[0].slab_id, (41, 42), []), (2, 12, pool.slabs[1].slab_id, (), []),
        (2, 14, pool.slabs[2].slab_id, (), [])]
    assert [t.index_array().tolist() for t, _ in got] == [[10, 11, 12], [12, 13, 14], [14, 15, 16]]


def test_a_slab_new_to_the_worker_leads_a_message_with_its_descriptor(channel):
    """A descriptor travels with a message's first byte: the frame whose
    slab the worker has not seen starts a message of its own."""
    main, worker, pool = channel
    first, second, third = pool.slabs
    handle = _handle(sock=main, known_slabs={first.slab_id, third.slab_id})
    done, messages, unsent = _core.send_tasks(handle, pool.pool, wire.TASK_PREFIX, _tasks(0, 1, 3, 5))
    assert (done, messages, unsent) == (3, 2, None)
    assert handle.known_slabs == {first.slab_id, second.slab_id, third.slab_id}
    got = [wire.recv(worker) for _ in range(3)]
    assert [(t.batch_index, t.slab_id, len(fds)) for t, fds in got] == [   # the known ones first
        (1, first.slab_id, 0), (3, third.slab_id, 0), (5, second.slab_id, 1)]
    for _, fds in got:
        for fd in fds:
            assert os.fstat(fd).st_size == second.size
            os.close(fd)
    assert pool.stats["slabs_reused"] == 3


def test_without_a_free_slab_the_worker_makes_one(channel):
    main, worker, _ = channel
    empty = SlabPool(8)
    handle = _handle(sock=main)
    assert _core.send_tasks(handle, empty, wire.TASK_PREFIX, _tasks(0, 1, 2)) == (2, 1, None)
    assert handle.slabs == {(0, 1): None, (0, 2): None}
    assert [wire.recv(worker)[0].slab_id for _ in range(2)] == [None, None]


def test_a_full_socket_leaves_the_rest_of_the_message_to_finish(channel):
    """The worker is not reading: the frames that did not fit come back with
    the descriptor still to pass, and finish_send delivers them whole once
    the worker reads again."""
    main, worker, pool = channel
    main.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = [(0, i, np.arange(i, i + 20_000, dtype=np.int64), False) for i in (1, 2)]
    # Only the first slab is free (new to the worker); the second task gets none.
    for other in pool.slabs[1:]:
        assert pool.pool.acquire({other.slab_id}) is other
    handle = _handle(sock=main)
    done, messages, unsent = _core.send_tasks(handle, pool.pool, wire.TASK_PREFIX, big)
    assert (done, messages) == (2, 1) and unsent is not None
    rest, fd = unsent
    assert fd == -1 and 0 < len(rest) < 2 * 20_000 * 8   # the descriptor went with the first byte
    got = []
    reader = threading.Thread(target=lambda: got.extend(wire.recv(worker) for _ in range(2)))
    reader.start()
    assert wire.finish_send(main, memoryview(rest), fd, 10.0, None)
    reader.join(10)
    assert [t.index_array()[[0, -1]].tolist() for t, _ in got] == [[1, 20_000], [2, 20_001]]
    assert len(got[0][1]) == 1 and got[1][1] == []
    os.close(got[0][1][0])


def test_a_closed_worker_end_is_an_oserror(channel):
    main, worker, pool = channel
    worker.close()
    with pytest.raises(OSError):
        _core.send_tasks(_handle(sock=main), pool.pool, wire.TASK_PREFIX, _tasks(0, 1))


def test_a_pool_closed_while_tasks_are_packed_is_an_oserror(channel):
    """close() from another thread may empty the pool between a slab's
    acquire and its descriptor's lookup: the send ends as for a gone
    worker (OSError, which the transport takes as the epoch ending), never
    with a KeyError out of next()."""
    main, worker, pool = channel

    class ClosingPool:
        def acquire(self, known=None):
            slab = pool.pool.acquire(known)
            pool.pool.close()   # the other thread's close() lands here
            return slab

        def fd(self, slab_id):
            return pool.pool.fd(slab_id)

        def release(self, slab):   # the slab of the message that did not go
            pool.pool.release(slab)

    handle = _handle(sock=main)   # the worker knows no slab: its descriptor is needed
    with pytest.raises(OSError, match="closed"):
        _core.send_tasks(handle, ClosingPool(), wire.TASK_PREFIX, _tasks(0, 1))
    worker.setblocking(False)
    with pytest.raises(BlockingIOError):
        worker.recv(1)   # nothing was sent


# ---------------------------------------------------------------- the loader


def _step(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.parametrize("prefetch, at_least", [(6, 1.4), (8, 2.5)])
def test_a_loop_slower_than_its_workers_gets_its_worker_s_whole_share_per_message(prefetch, at_least):
    """Workers faster than the loop: each worker's task waits for the rest of
    its share of the window (prefetch / num_workers), and one message
    carries them all (one wake-up of the worker, not one a task).  Every
    batch still arrives once, in order."""
    ds = mxload.ArrayDataset(np.arange(4000, dtype=np.int64).reshape(1000, 4))
    with mxload.DataLoader(ds, batch_size=10, num_workers=2, persistent_workers=True,
                           prefetch=prefetch) as loader:
        for epoch in range(2):
            got = []
            for batch in loader:
                got.append(batch[:, 0] // 4)
                _step(0.003)
            assert np.concatenate(got).tolist() == list(range(1000)), epoch
        stats = loader.stats
    assert stats["tasks_sent"] == 200
    # prefetch // 2 unless a starved machine made the loop wait (each wait sends what is held at
    # once, and holds one task fewer for a while); 2.0 at most before each worker's whole share.
    assert stats["tasks_sent"] / stats["task_messages"] >= at_least, stats


@pytest.mark.parametrize("window, workers, ahead, behind", [
    (3, 2, 1, 1), (4, 2, 2, 1), (6, 2, 3, 2), (8, 2, 4, 3), (8, 1, 8, 7), (100, 2, 8, 7), (12, 4, 3, 2)])
def test_tasks_per_message_are_the_worker_s_share_ahead_and_one_fewer_after_the_loop_would_wait(
        window, workers, ahead, behind):
    """The transport's rule: a worker's whole share of the window
    (window // workers, at most MAX_TASKS_PER_MESSAGE) to a message while
    the loop finds its batches ready; one fewer after it would have waited
    (k - 1 still leaves a sent task queued behind the one the worker makes),
    until the backoff's tasks are sent; never paired under 2 per worker.  (The backoff's rule
    alone: tests/test_pairing.py.)"""
    from mxload._runtime.local import pairing as T

    ds = mxload.ArrayDataset(np.arange(8, dtype=np.int64))
    with mxload.DataLoader(ds, batch_size=1, num_workers=workers, persistent_workers=True) as loader:
        assert len(list(loader)) == 8
        engine = loader._iterations.engine
        assert engine is not None
        tr = engine.transport
        with engine.lock:
            saved = dict(tr.counts)
            tr.counts["tasks_sent"], tr.pairing.resume_at = 10_000, 0   # paired long since the last stop
            tr.set_window(window, workers)
            assert tr.put_task.per_message == ahead
            tr._flush_before_wait(False)
            assert tr.put_task.per_message == behind
            assert tr.pairing.resume_at == (10_000 + T.PAIR_BACKOFF_MIN_TASKS if ahead > 1 else 0)
            tr._flush_before_wait(True)   # the epoch's first window: no stop
            assert tr.put_task.per_message == behind
            tr.counts.update(saved)   # (what the test set is not stats)
            tr.pairing.resume_at = 0
            tr.set_window(2 * workers, workers)


def test_a_loop_waiting_for_its_workers_is_never_kept_waiting_by_a_held_task():
    """Workers slower than the loop: the loop waits for nearly every batch,
    and a task held back is sent the moment it would wait; the epoch takes
    about as long as its loading (never a timeout), in order."""
    class Slow(mxload.Dataset):
        def __len__(self):
            return 60

        def __getitem__(self, i):
            time.sleep(0.002)
            return np.int64(i)

    with mxload.DataLoader(Slow(), batch_size=2, num_workers=2, timeout=20, prefetch=6) as loader:
        t0 = time.monotonic()
        got = np.concatenate(list(loader)).tolist()
        took = time.monotonic() - t0
    assert got == list(range(60))
    assert took < 10, took   # 30 batches of ~4 ms on 2 workers: well under a second unstarved


def test_at_the_default_window_tasks_pair_while_the_loop_finds_its_batches_ready():
    """At 2 tasks per worker, a loop slower than its workers never waits
    past its epoch's first window: each worker's task waits for its next
    one and both go in one message (one wake-up of the worker, not two).
    Every batch still arrives once, in order."""
    ds = mxload.ArrayDataset(np.arange(400, dtype=np.int64))
    with mxload.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True) as loader:
        for epoch in range(2):
            got = []
            for batch in loader:
                got.append(batch)
                _step(0.003)
            assert np.concatenate(got).tolist() == list(range(400)), epoch
        del batch, got
        stats = loader.stats
    assert stats["tasks_sent"] == 200
    # 2.0 unless a starved machine made the loop wait (each wait sends what is held at once).
    assert stats["tasks_sent"] / stats["task_messages"] >= 1.4, stats


def test_at_the_default_window_a_waiting_loop_stops_the_pairing():
    """Workers slower than the loop: the first time it would wait with a
    task held (past the epoch's first window), that task goes at once and
    the next tasks each go on their own, so a worker is never left idle with
    its next task held; each stop that follows its resumption at once
    doubles the next one's length, so such a loop pairs only a few tasks in
    all; every batch arrives, in order."""
    from mxload._runtime.local.pairing import PAIR_BACKOFF_MIN_TASKS

    class Slow(mxload.Dataset):
        def __len__(self):
            return 400

        def __getitem__(self, i):
            time.sleep(0.001)
            return np.int64(i)

    with mxload.DataLoader(Slow(), batch_size=2, num_workers=2, persistent_workers=True,
                           timeout=20) as loader:
        got = np.concatenate(list(loader)).tolist()
        stats = loader.stats
    assert got == list(range(400))
    assert stats["tasks_sent"] == 200
    # Stops after 16, 32, 64 tasks sent one to a message (then 128 more): at most 4 in 200 tasks.
    assert 1 <= stats["pairing_stops"] <= 200 // PAIR_BACKOFF_MIN_TASKS // 3, stats
    assert stats["task_messages"] >= 180, stats   # paired only for a few tasks after each stop


def test_a_window_change_sends_what_is_held():
    """num_workers="auto" retiring a worker or narrowing the window: a task
    held for a pair goes at once (a retired worker gets no next task to
    pair with), and the epoch is whole, in order."""
    ds = mxload.ArrayDataset(np.arange(400, dtype=np.int64))
    with mxload.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True) as loader:
        it = iter(loader)
        got = []
        engine = loader._iterations.engine
        assert engine is not None
        for _ in range(40):   # a slow loop: the workers are ahead, a task waits for its pair
            got.append(next(it))
            _step(0.003)
            if len(got) > 8 and engine.transport._holding:
                break
        assert engine.transport._holding, "no task was ever held for a pair"
        engine.set_active(1, 2)
        assert not engine.transport._holding
        assert [len(h.held) for h in engine.transport._handles] == [0, 0]
        got.extend(it)
        assert np.concatenate(got).tolist() == list(range(400))
        del got


def test_early_ended_persistent_epochs_leave_no_task_behind():
    """Tasks held when an epoch is abandoned (break) are forgotten with it:
    nothing of theirs stays on the engine, and later epochs are whole."""
    ds = mxload.ArrayDataset(np.arange(400, dtype=np.int64))
    with mxload.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True, prefetch=6) as loader:
        for _ in range(5):
            for i, _batch in enumerate(loader):
                _step(0.002)
                if i == 7:
                    break
        assert np.concatenate(list(loader)).tolist() == list(range(400))
        engine = loader._iterations.engine
        assert engine is not None
        outstanding = [len(w.outstanding) for w in engine.roster.workers]
        held = [len(h.held) for h in engine.transport._handles]
    assert outstanding == [0, 0] and held == [0, 0]


class _DiesLoadingTheLastSample(mxload.Dataset):
    """Sample i is i; the first worker to load the last one dies there
    (SIGKILL), after a pause that leaves the loop asleep waiting for it."""

    def __init__(self, n: int, marker: str):
        self.n = n
        self.marker = marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.n - 1:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return np.int64(i)
            time.sleep(0.3)
            faulthandler.disable()   # the death is the test: no "Fatal Python error" in the output
            os.kill(os.getpid(), signal.SIGKILL)
        return np.int64(i)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_task_sent_again_by_a_restart_goes_at_once_to_a_loop_already_asleep(num_workers, tmp_path):
    """A worker dies while the loop sleeps waiting for its last batch: the
    restart (the watcher thread's) sends that task again at once, though it
    is alone (no next task of that worker to share a message with): the
    loop is asleep, it would never send it.  Before (no flush after a
    restart), the loop slept until its timeout: a LoaderTimeoutError here, however slow the
    machine is to restart a worker (a bound on the seconds taken depended on its speed)."""
    ds = _DiesLoadingTheLastSample(20, str(tmp_path / "died"))
    with mxload.DataLoader(ds, batch_size=2, num_workers=num_workers, max_worker_restarts=1,
                           timeout=30, prefetch=3 * num_workers) as loader:
        with pytest.warns(RuntimeWarning, match="restarting"):
            got = np.concatenate(list(loader)).tolist()
        stats = loader.stats
    assert got == list(range(20))
    assert stats["worker_restarts"] == 1 and stats["tasks_sent"] == 11, stats


def test_the_compiled_send_and_claim_take_only_a_typed_worker_channel():
    """The core reads a worker's channel through the typed fields of WorkerChannel
    (csrc/mxload/_core.pxd): an object that merely has attributes of those names is refused,
    so a renamed field cannot be read by name at run time."""
    lookalike = SimpleNamespace(worker_id=0, pid=1, tag=7, slabs={}, layouts={}, known_slabs=set(),
                                pending_drops=[], sock=None)
    with pytest.raises(TypeError, match="WorkerChannel"):
        _core.send_tasks(lookalike, None, wire.TASK_PREFIX, [])
    with pytest.raises(TypeError, match="WorkerChannel"):
        _core.claim_batch(_raw_batch(0, 1, 5, 64, 1), [lookalike], lambda slab: None)


def test_task_hold_puts_a_task_and_says_when_a_message_is_due():
    """The process transport's compiled put: the task joins its worker's
    held tasks and the worker the holding set in one call; True once the
    worker holds per_message tasks.  A bad worker id or task changes
    nothing."""
    channels = [_core.WorkerChannel(), _core.WorkerChannel()]
    holding: set[int] = set()
    put = _core.TaskHold(channels, holding, 2)
    assert put(1, (0, 5, None, False)) is False
    assert holding == {1} and channels[1].held == [(0, 5, None, False)] and channels[0].held == []
    assert put(1, (0, 7, None, False)) is True
    assert [t[1] for t in channels[1].held] == [5, 7]
    put.per_message = 1
    assert put(0, (0, 6, None, False)) is True and holding == {0, 1}
    for wid in (2, -1):
        with pytest.raises(IndexError, match=f"no worker {wid}"):
            put(wid, (0, 8, None, False))
    with pytest.raises(TypeError):
        put(0, [0, 8, None, False])
    assert [len(c.held) for c in channels] == [1, 2] and holding == {0, 1}


def test_queue_put_puts_into_the_workers_queue():
    import queue
    queues: list[queue.SimpleQueue] = [queue.SimpleQueue(), queue.SimpleQueue()]
    put = _core.QueuePut(queues)
    assert put(1, (0, 3, None, True)) is False
    assert queues[0].empty() and queues[1].get_nowait() == (0, 3, None, True)
    with pytest.raises(IndexError, match="no worker 2"):
        put(2, (0, 4, None, True))


# ---------------------------------------------------------------- the hand-over to the loop
# NOTE [ Signal-safe hand-over ] (csrc/handoff.pxi): the contract of its one object.

class _Counted:
    """A progress's taken(idx) that records its calls, and raises while `fail` is set."""
    def __init__(self) -> None:
        self.calls: list[int] = []
        self.fail = False

    def __call__(self, idx: int) -> None:
        self.calls.append(idx)
        if self.fail:
            raise KeyboardInterrupt(f"cut short while counting batch {idx}")


def test_a_new_handover_is_empty_and_settling_or_handing_it_changes_nothing():
    taken = _Counted()
    h = _core.Handover(taken)
    assert (h.ready, h.pending) == (None, -1)
    h.settle()
    assert h.handing() == -1
    assert (h.ready, h.pending, taken.calls) == (None, -1, [])
    with pytest.raises(TypeError, match="callable counting a batch taken"):
        _core.Handover(None)


def test_handing_moves_the_ready_batch_to_pending_and_settle_counts_it_once():
    taken = _Counted()
    h = _core.Handover(taken)
    h.ready = (4, "batch 4")                       # holding: on its way to the loop
    assert h.handing() == 4                        # handed: the loop has it, not counted yet
    assert (h.ready, h.pending, taken.calls) == (None, 4, [])
    h.settle()                                     # counted, then empty
    assert (h.ready, h.pending, taken.calls) == (None, -1, [4])
    h.settle()
    assert taken.calls == [4]


def test_a_settle_cut_short_keeps_the_batch_pending_and_the_next_settle_counts_it():
    taken = _Counted()
    h = _core.Handover(taken)
    h.ready = (0, "batch 0")
    h.handing()
    taken.fail = True
    with pytest.raises(KeyboardInterrupt, match="batch 0"):
        h.settle()
    assert h.pending == 0                          # not forgotten: taken() may not have counted it
    taken.fail = False
    h.settle()
    assert (h.pending, taken.calls) == (-1, [0, 0])   # taken() counts an index once however often


def test_handing_settles_a_batch_still_pending_first_and_changes_nothing_if_that_is_cut_short():
    taken = _Counted()
    h = _core.Handover(taken)
    h.ready = (0, "batch 0")
    h.handing()
    h.ready = (1, "batch 1")
    taken.fail = True
    with pytest.raises(KeyboardInterrupt):
        h.handing()
    assert (h.ready, h.pending) == ((1, "batch 1"), 0)   # both where they were
    taken.fail = False
    assert h.handing() == 1
    assert (h.ready, h.pending, taken.calls) == (None, 1, [0, 0])


class _Iterator(_core.HandingIterator):
    """A HandingIterator whose _next makes batch i, or raises what `cut` holds after making it."""
    def __init__(self, taken) -> None:
        self.handover = _core.Handover(taken)
        self.made = 0
        self.cut: BaseException | None = None
        self.held_lock: list[bool] = []

    def _next(self):
        self.held_lock.append(self.handover.lock.locked())
        got = self.handover.ready
        if got is None:
            got = self.handover.ready = (self.made, f"batch {self.made}")
            self.made += 1
        if self.cut is not None:
            cut, self.cut = self.cut, None
            raise cut
        return got[1]

    __next__ = _core.handing_next(_next)


def test_the_compiled_next_settles_the_last_batch_then_hands_out_the_next_under_the_lock():
    taken = _Counted()
    it = _Iterator(taken)
    assert next(it) == "batch 0"
    assert (it.handover.pending, taken.calls) == (0, [])   # counted once the loop asks again
    assert next(it) == "batch 1"
    assert (it.handover.pending, taken.calls) == (1, [0])
    assert it.held_lock == [True, True] and not it.handover.lock.locked()


def test_an_exception_inside_next_keeps_the_batch_for_the_next_call_and_releases_the_lock():
    taken = _Counted()
    it = _Iterator(taken)
    assert next(it) == "batch 0"
    it.cut = KeyboardInterrupt("a signal handler's")
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert it.handover.ready == (1, "batch 1") and not it.handover.lock.locked()
    assert taken.calls == [0]
    assert next(it) == "batch 1" and it.made == 2   # the kept batch, not a new one
    assert next(it) == "batch 2" and taken.calls == [0, 1]


def test_the_compiled_next_takes_only_an_iterator_with_a_handover():
    class NoHandover(_core.HandingIterator):
        __next__ = _core.handing_next(lambda it: None)

    with pytest.raises(RuntimeError, match="NoHandover has no Handover"):
        next(NoHandover())

    class NotHanding:
        __next__ = _core.handing_next(lambda it: None)

    with pytest.raises(TypeError):
        next(NotHanding())


def test_the_engine_states_are_the_cores():
    from mxload._runtime import shutdown
    assert (shutdown.RUNNING, shutdown.SHUTTING_DOWN, shutdown.CLOSED) == \
        (_core.RUNNING, _core.SHUTTING_DOWN, _core.CLOSED) == ("running", "shutting down", "closed")
