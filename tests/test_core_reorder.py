"""Tests for mxload._core.ReorderBuffer: ordering, blocking waits with the GIL
released, timeouts, close/clear semantics, signal delivery, thread stress and
re-entry from the garbage collector."""
import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
import weakref

import fresh_python
import pytest
from conftest import wait_until

from mxload import _core
from mxload._core import BufferClosedError, ReorderBuffer

pytestmark = pytest.mark.timeout(60)

# Generous slack for "promptly": the buffer waits in 50 ms slices, CI boxes are slow.
SLACK = 1.0
# MXLOAD_LONG_TESTS=1 runs the repeated race and re-entry tests many more times.
LONG = os.environ.get("MXLOAD_LONG_TESTS") == "1"


class Item:
    """A distinct, weak-referenceable payload."""

    __slots__ = ("idx", "__weakref__")

    def __init__(self, idx):
        self.idx = idx

    def __repr__(self):
        return f"Item({self.idx})"


def run_in_thread(fn, *args, **kwargs):
    """Start fn in a daemon thread; return (thread, result dict)."""
    res = {}

    def target():
        res["started"] = time.monotonic()
        try:
            res["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - recorded for the test
            res["error"] = e
        res["finished"] = time.monotonic()

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t, res


# ---------------------------------------------------------------------------
# basics
# ---------------------------------------------------------------------------


def test_exports():
    assert _core.BufferClosedError is BufferClosedError
    assert issubclass(BufferClosedError, RuntimeError)


def test_put_get_in_order():
    buf = ReorderBuffer()
    items = [Item(i) for i in range(10)]
    for i, it in enumerate(items):
        buf.put(i, it)
    assert len(buf) == 10
    for i, it in enumerate(items):
        assert buf.get(i) is it
    assert len(buf) == 0


def test_put_get_out_of_order():
    buf = ReorderBuffer()
    order = list(range(50))
    random.Random(0).shuffle(order)
    items = {i: Item(i) for i in order}
    for i in order:
        buf.put(i, items[i])
    # consumer takes them in order regardless of arrival order
    for i in range(50):
        got = buf.get(i, timeout=1)
        assert got is items[i]
        assert i not in buf
    assert len(buf) == 0


def test_get_removes_only_requested_index():
    buf = ReorderBuffer()
    a, b = Item(1), Item(2)
    buf.put(1, a)
    buf.put(2, b)
    assert buf.get(2) is b
    assert 1 in buf and 2 not in buf
    with pytest.raises(TimeoutError):
        buf.get(2, timeout=0.05)
    assert buf.get(1, timeout=0) is a


def test_items_may_be_any_object_including_none():
    buf = ReorderBuffer()
    buf.put(0, None)
    buf.put(1, 0)
    buf.put(2, (1, 2))
    assert 0 in buf
    assert buf.get(0, timeout=0) is None
    assert buf.get(1) == 0
    assert buf.get(2) == (1, 2)


def test_negative_and_large_indices():
    buf = ReorderBuffer()
    big = 2**62
    buf.put(-5, "neg")
    buf.put(big, "big")
    assert -5 in buf and big in buf
    assert buf.pop_next(timeout=0) == (-5, "neg")
    assert buf.get(big) == "big"


def test_non_integer_index_rejected():
    buf = ReorderBuffer()
    with pytest.raises(TypeError):
        buf.put("a", 1)
    with pytest.raises(TypeError):
        buf.get(1.5, timeout=0)
    assert len(buf) == 0


def test_duplicate_index_raises_keyerror_and_keeps_original():
    buf = ReorderBuffer()
    first, second = Item(3), Item(3)
    buf.put(3, first)
    with pytest.raises(KeyError, match="batch index 3 is already in the ReorderBuffer"):
        buf.put(3, second)
    assert len(buf) == 1
    assert buf.get(3) is first
    # once taken, the index may be used again
    buf.put(3, second)
    assert buf.get(3) is second


def test_try_get():
    buf = ReorderBuffer()
    sentinel = object()
    assert buf.try_get(0) is None
    assert buf.try_get(0, sentinel) is sentinel
    assert buf.try_get(0, default=sentinel) is sentinel
    it = Item(0)
    buf.put(0, it)
    buf.put(1, Item(1))
    assert buf.try_get(0, sentinel) is it
    assert 0 not in buf  # removed
    assert buf.try_get(0, sentinel) is sentinel
    assert len(buf) == 1


def test_pop_next_returns_smallest_available():
    buf = ReorderBuffer()
    for i in (5, 2, 9, 7, 3):
        buf.put(i, f"v{i}")
    out = [buf.pop_next(timeout=0) for _ in range(5)]
    assert out == [(2, "v2"), (3, "v3"), (5, "v5"), (7, "v7"), (9, "v9")]
    assert len(buf) == 0
    # interleaved with puts: always the smallest stored right now
    buf.put(10, "a")
    buf.put(4, "b")
    assert buf.pop_next() == (4, "b")
    buf.put(1, "c")
    assert buf.pop_next() == (1, "c")
    assert buf.pop_next() == (10, "a")


def test_pop_next_returns_tuple_of_index_and_identity():
    buf = ReorderBuffer()
    it = Item(7)
    buf.put(7, it)
    res = buf.pop_next()
    assert isinstance(res, tuple) and len(res) == 2
    assert res[0] == 7 and res[1] is it


def test_len_and_contains():
    buf = ReorderBuffer()
    assert len(buf) == 0
    assert 0 not in buf
    for i in range(0, 20, 2):
        buf.put(i, i)
    assert len(buf) == 10
    assert all(i in buf for i in range(0, 20, 2))
    assert not any(i in buf for i in range(1, 20, 2))
    buf.get(4)
    assert 4 not in buf
    assert len(buf) == 9


def test_clear_returns_removed_items():
    buf = ReorderBuffer()
    items = {i: Item(i) for i in (3, 1, 8)}
    for i, it in items.items():
        buf.put(i, it)
    removed = buf.clear()
    assert isinstance(removed, dict)
    assert set(removed) == {1, 3, 8}
    for i, it in items.items():
        assert removed[i] is it
    assert len(buf) == 0
    assert all(i not in buf for i in items)
    assert buf.clear() == {}
    # the buffer stays usable after clear (it is not a close)
    buf.put(1, "again")
    assert buf.get(1) == "again"
    assert not buf.closed


def test_clear_releases_items_when_caller_drops_them():
    buf = ReorderBuffer()
    it = Item(0)
    ref = weakref.ref(it)
    buf.put(0, it)
    del it
    removed = buf.clear()
    assert ref() is not None  # held by the returned dict
    del removed
    gc.collect()
    assert ref() is None


def test_buffer_dealloc_releases_items():
    buf = ReorderBuffer()
    it = Item(0)
    ref = weakref.ref(it)
    buf.put(0, it)
    del it, buf
    gc.collect()
    assert ref() is None


def test_get_returns_item_without_keeping_reference():
    buf = ReorderBuffer()
    it = Item(0)
    ref = weakref.ref(it)
    buf.put(0, it)
    del it
    got = buf.get(0)
    del got
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------------------
# timeouts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0.05, 0.3])
def test_get_timeout(timeout):
    buf = ReorderBuffer()
    buf.put(1, "other")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after .* s waiting for batch 0"):
        buf.get(0, timeout=timeout)
    elapsed = time.monotonic() - t0
    assert timeout <= elapsed < timeout + SLACK
    assert 1 in buf  # untouched


def test_pop_next_timeout():
    buf = ReorderBuffer()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="waiting for any batch"):
        buf.pop_next(timeout=0.2)
    elapsed = time.monotonic() - t0
    assert 0.2 <= elapsed < 0.2 + SLACK


def test_timeout_zero_is_a_poll():
    buf = ReorderBuffer()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        buf.get(0, timeout=0)
    with pytest.raises(TimeoutError):
        buf.pop_next(timeout=0)
    assert time.monotonic() - t0 < 0.5
    buf.put(0, "x")
    assert buf.get(0, timeout=0) == "x"


def test_integer_timeout_accepted():
    buf = ReorderBuffer()
    buf.put(0, "x")
    assert buf.get(0, timeout=1) == "x"


def test_negative_timeout_rejected():
    buf = ReorderBuffer()
    buf.put(0, "x")
    with pytest.raises(ValueError, match="timeout must be >= 0 or None, got -1"):
        buf.get(0, timeout=-1)
    with pytest.raises(ValueError, match="timeout must be >= 0 or None"):
        buf.pop_next(timeout=-0.5)
    assert 0 in buf  # a rejected call does not consume


def test_get_waits_for_late_put():
    buf = ReorderBuffer()
    it = Item(4)
    t, res = run_in_thread(buf.get, 4, timeout=10)
    wait_until(lambda: buf.waiting == 1, what="get() waiting")
    assert t.is_alive()  # really blocked
    put_at = time.monotonic()
    buf.put(4, it)
    t.join(5)
    assert not t.is_alive()
    assert "error" not in res, res.get("error")
    assert res["value"] is it
    assert res["finished"] - put_at < SLACK
    assert len(buf) == 0


def test_pop_next_waits_for_late_put():
    buf = ReorderBuffer()
    t, res = run_in_thread(buf.pop_next, timeout=10)
    wait_until(lambda: buf.waiting == 1, what="pop_next() waiting")
    assert t.is_alive()
    buf.put(42, "late")
    t.join(5)
    assert res.get("value") == (42, "late")


def test_timed_get_succeeds_if_item_arrives_before_deadline():
    buf = ReorderBuffer()
    timer = threading.Timer(0.1, buf.put, args=(0, "on time"))
    timer.start()
    try:
        t0 = time.monotonic()
        assert buf.get(0, timeout=5) == "on time"
        assert time.monotonic() - t0 < 0.1 + SLACK
    finally:
        timer.join()


# ---------------------------------------------------------------------------
# close
# ---------------------------------------------------------------------------


def test_close_basics():
    buf = ReorderBuffer()
    assert buf.closed is False
    buf.put(0, "x")
    buf.close("loader shut down")
    assert buf.closed is True
    with pytest.raises(BufferClosedError, match="ReorderBuffer is closed: loader shut down"):
        buf.put(1, "y")
    # get/try_get/pop_next on a closed buffer raise even if items are stored
    with pytest.raises(BufferClosedError, match="loader shut down"):
        buf.get(0)
    with pytest.raises(BufferClosedError, match="loader shut down"):
        buf.get(0, timeout=0)
    with pytest.raises(BufferClosedError, match="loader shut down"):
        buf.try_get(0)
    with pytest.raises(BufferClosedError, match="loader shut down"):
        buf.pop_next(timeout=1)
    # BufferClosedError is a RuntimeError
    with pytest.raises(RuntimeError):
        buf.put(2, "z")
    # clear still drains what was stored
    assert buf.clear() == {0: "x"}


def test_close_without_reason():
    buf = ReorderBuffer()
    buf.close()
    with pytest.raises(BufferClosedError) as ei:
        buf.get(0)
    assert str(ei.value) == "ReorderBuffer is closed"


def test_close_reason_is_stringified_and_first_reason_wins():
    buf = ReorderBuffer()
    buf.close(ValueError("worker 2 died"))
    buf.close("second reason")
    assert buf.closed
    with pytest.raises(BufferClosedError) as ei:
        buf.put(0, 1)
    msg = str(ei.value)
    assert "worker 2 died" in msg
    assert "second reason" not in msg


def test_close_wakes_blocked_getter_promptly():
    buf = ReorderBuffer()
    t, res = run_in_thread(buf.get, 7, timeout=30)
    wait_until(lambda: buf.waiting == 1, what="get() waiting")
    assert t.is_alive()
    closed_at = time.monotonic()
    buf.close("worker 3 died")
    t.join(5)
    assert not t.is_alive()
    err = res.get("error")
    assert isinstance(err, BufferClosedError), res
    assert "worker 3 died" in str(err)
    assert res["finished"] - closed_at < SLACK


def test_close_wakes_every_waiter():
    buf = ReorderBuffer()
    threads = [run_in_thread(buf.get, i, timeout=30) for i in range(4)]
    threads += [run_in_thread(buf.pop_next, timeout=30) for _ in range(2)]
    threads += [run_in_thread(buf.get, 99)]  # no timeout at all
    wait_until(lambda: buf.waiting == 7, what="all 7 waiting")
    assert all(t.is_alive() for t, _ in threads)
    closed_at = time.monotonic()
    buf.close("shutdown")
    for t, _ in threads:
        t.join(5)
    for t, res in threads:
        assert not t.is_alive()
        assert isinstance(res.get("error"), BufferClosedError), res
        assert "shutdown" in str(res["error"])
        assert res["finished"] - closed_at < SLACK


# ---------------------------------------------------------------------------
# the GIL is released while waiting
# ---------------------------------------------------------------------------


def _count_for(seconds):
    n = 0
    end = time.perf_counter() + seconds
    while True:
        for _ in range(1000):
            n += 1
        if time.perf_counter() >= end:
            return n


def test_gil_released_while_waiting():
    duration = 0.4
    # Baseline: this counter thread alone, nothing blocked in the buffer.
    t, res = run_in_thread(_count_for, duration)
    t.join(10)
    baseline = res["value"]
    assert baseline > 0

    buf = ReorderBuffer()
    waiters = [run_in_thread(buf.get, i, timeout=30) for i in range(3)]
    waiters.append(run_in_thread(buf.pop_next, timeout=30))
    wait_until(lambda: buf.waiting == 4, what="all 4 waiting")
    assert all(w.is_alive() for w, _ in waiters)

    t, res = run_in_thread(_count_for, duration)
    t.join(10)
    blocked = res["value"]
    assert all(w.is_alive() for w, _ in waiters), "waiters must still be blocked"
    buf.close("done")
    for w, _ in waiters:
        w.join(5)
    assert all(isinstance(r.get("error"), BufferClosedError) for _, r in waiters)
    # If the waiters held the GIL the counter would crawl; allow a lot of
    # scheduling noise but demand substantial progress.
    assert blocked > 0.3 * baseline, (blocked, baseline)


def test_gil_released_while_waiting_main_thread_counts():
    """A pure-Python loop in the main thread keeps running while a consumer
    thread waits in get() without a timeout."""
    buf = ReorderBuffer()
    t, res = run_in_thread(buf.get, 0)
    wait_until(lambda: buf.waiting == 1, what="get() waiting")
    n = _count_for(0.3)
    assert t.is_alive()
    buf.put(0, "go")
    t.join(5)
    assert res.get("value") == "go"
    assert n > 100_000


# ---------------------------------------------------------------------------
# signals reach a consumer blocked in get (this is how Ctrl-C works)
# ---------------------------------------------------------------------------


class Alarm(Exception):
    pass


def _raise_alarm(signum, frame):
    raise Alarm(f"signal {signum}")


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
@pytest.mark.parametrize("method", ["get", "pop_next", "get_no_timeout"])
def test_signal_handler_runs_while_blocked(method):
    assert threading.current_thread() is threading.main_thread()
    buf = ReorderBuffer()
    previous = signal.signal(signal.SIGALRM, _raise_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        with pytest.raises(Alarm, match="signal"):
            if method == "get":
                buf.get(0, timeout=5)
            elif method == "pop_next":
                buf.pop_next(timeout=5)
            else:
                buf.get(0)  # would block forever without the signal
        elapsed = time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert 0.15 <= elapsed < 0.2 + SLACK, elapsed
    # the interrupted wait left the buffer consistent and unlocked
    assert not buf.closed
    buf.put(0, "after")
    assert len(buf) == 1
    assert buf.get(0, timeout=1) == "after"
    t, res = run_in_thread(buf.put, 1, "from thread")
    t.join(5)
    assert not t.is_alive() and "error" not in res
    assert buf.pop_next(timeout=1) == (1, "from thread")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_keyboard_interrupt_reaches_blocked_get():
    assert threading.current_thread() is threading.main_thread()
    buf = ReorderBuffer()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, os.kill, args=(os.getpid(), signal.SIGINT))
    try:
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            buf.get(0, timeout=5)
        elapsed = time.monotonic() - t0
    finally:
        timer.join()
        signal.signal(signal.SIGINT, previous)
    assert elapsed < 0.2 + SLACK
    buf.put(0, 1)
    assert buf.get(0) == 1


# ---------------------------------------------------------------------------
# stress
# ---------------------------------------------------------------------------

N_STRESS = 100_000
N_PUTTERS = 4
N_GETTERS = 4


def _start_all(threads):
    for t in threads:
        t.start()


@pytest.mark.races   # 100k items through 4 putters and 4 takers: the buffer's races, tried at length
def test_stress_get_disjoint_indices():
    buf = ReorderBuffer()
    items = [Item(i) for i in range(N_STRESS)]
    order = list(range(N_STRESS))
    random.Random(1234).shuffle(order)
    put_chunks = [order[p::N_PUTTERS] for p in range(N_PUTTERS)]
    # getter g takes the indices congruent to g, in order, with get()
    get_sets = [list(range(g, N_STRESS, N_GETTERS)) for g in range(N_GETTERS)]
    results = [[] for _ in range(N_GETTERS)]
    errors = []
    go = threading.Event()

    def putter(chunk):
        try:
            go.wait()
            for i in chunk:
                buf.put(i, items[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(("put", e))

    def getter(g):
        out = results[g]
        try:
            for i in get_sets[g]:
                out.append((i, buf.get(i, timeout=30)))
        except BaseException as e:  # noqa: BLE001
            errors.append(("get", g, e))

    getters = [threading.Thread(target=getter, args=(g,), daemon=True) for g in range(N_GETTERS)]
    putters = [threading.Thread(target=putter, args=(c,), daemon=True) for c in put_chunks]
    # getters start first: they are waiting before any item arrives
    _start_all(getters)
    wait_until(lambda: buf.waiting == N_GETTERS, what="every getter waiting")
    assert all(t.is_alive() for t in getters)
    assert len(buf) == 0
    _start_all(putters)
    go.set()
    for t in putters + getters:
        t.join(50)
    if any(t.is_alive() for t in putters + getters):
        buf.close("stress test timed out")
        pytest.fail("stress threads did not finish")
    assert not errors, errors[:5]

    seen = set()
    total = 0
    for g, out in enumerate(results):
        assert [i for i, _ in out] == get_sets[g]
        for i, it in out:
            assert it is items[i], (i, it)
            assert it.idx == i
            seen.add(i)
        total += len(out)
    assert total == N_STRESS  # nothing duplicated
    assert seen == set(range(N_STRESS))  # nothing lost
    assert len(buf) == 0
    assert buf.clear() == {}


# pop_next scans for the smallest stored index (it is O(items stored)), so its
# stress test bounds the buffer like a loader's prefetch window does.
POP_WINDOW = 256


@pytest.mark.races   # 100k items through 4 putters and 4 takers: the buffer's races, tried at length
def test_stress_pop_next():
    buf = ReorderBuffer()
    window = threading.Semaphore(POP_WINDOW)
    items = [Item(i) for i in range(N_STRESS)]
    order = list(range(N_STRESS))
    random.Random(99).shuffle(order)
    put_chunks = [order[p::N_PUTTERS] for p in range(N_PUTTERS)]
    results = [[] for _ in range(N_GETTERS)]
    errors = []
    go = threading.Event()

    def putter(chunk):
        try:
            go.wait()
            for i in chunk:
                if not window.acquire(timeout=30):
                    raise TimeoutError("prefetch window never freed")
                buf.put(i, items[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(("put", e))

    def popper(g):
        out = results[g]
        try:
            while True:
                i, it = buf.pop_next(timeout=30)
                if i >= N_STRESS:  # sentinel: every real item is gone
                    return
                out.append((i, it))
                window.release()
        except BaseException as e:  # noqa: BLE001
            errors.append(("pop", g, e))

    poppers = [threading.Thread(target=popper, args=(g,), daemon=True) for g in range(N_GETTERS)]
    putters = [threading.Thread(target=putter, args=(c,), daemon=True) for c in put_chunks]
    _start_all(poppers)
    wait_until(lambda: buf.waiting == N_GETTERS, what="every popper waiting")
    _start_all(putters)
    go.set()
    for t in putters:
        t.join(50)
    assert not any(t.is_alive() for t in putters)
    # Sentinels sort after every real index, so pop_next hands them out only
    # once all real items are taken; one per popper.
    for k in range(N_GETTERS):
        buf.put(N_STRESS + k, None)
    for t in poppers:
        t.join(50)
    if any(t.is_alive() for t in poppers):
        buf.close("stress test timed out")
        pytest.fail("poppers did not finish")
    assert not errors, errors[:5]

    seen = []
    for out in results:
        for i, it in out:
            assert it is items[i]
        seen.extend(i for i, _ in out)
    assert len(seen) == N_STRESS  # nothing duplicated ...
    assert set(seen) == set(range(N_STRESS))  # ... nothing lost
    assert len(buf) == 0


def test_stress_close_while_busy():
    """Closing while putters and getters are hammering the buffer: every
    thread ends (no deadlock), each with either success or BufferClosedError."""
    buf = ReorderBuffer()
    n = 20_000
    errors = []
    unexpected = []

    def putter(start):
        try:
            for i in range(start, n, 2):
                buf.put(i, i)
        except BufferClosedError as e:
            errors.append(e)
        except BaseException as e:  # noqa: BLE001
            unexpected.append(e)

    taken = [0]

    def getter(start):
        try:
            for i in range(start, n, 2):
                assert buf.get(i, timeout=30) == i
                taken[0] += 1
        except BufferClosedError as e:
            errors.append(e)
        except BaseException as e:  # noqa: BLE001
            unexpected.append(e)

    threads = [threading.Thread(target=f, args=(s,), daemon=True)
               for f in (putter, getter) for s in (0, 1)]
    _start_all(threads)
    # Closed once the hammering is under way (a sleep of 50 ms could close after all 20k items).
    wait_until(lambda: taken[0] > 0, what="the getters taking items")
    buf.close("abort")
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert not unexpected, unexpected
    assert all("abort" in str(e) for e in errors)


def test_pop_next_stays_fast_with_many_items_stored():
    # A heap, not min() over the dict: 50k stored items pop in well under a second
    # (the min() version took ~14 s); generous slack for a loaded machine.
    import time as _time
    buf = ReorderBuffer()
    for i in reversed(range(50_000)):
        buf.put(i, i)
    t0 = _time.monotonic()
    got = [buf.pop_next(timeout=1)[0] for _ in range(50_000)]
    assert got == list(range(50_000))
    assert _time.monotonic() - t0 < 5


def test_pop_next_after_gets_skips_taken_indices():
    buf = ReorderBuffer()
    for i in range(200):
        buf.put(i, i)
    for i in range(0, 200, 2):
        assert buf.get(i) == i
    assert [buf.pop_next()[0] for _ in range(100)] == list(range(1, 200, 2))


@pytest.mark.parametrize("timeout", [float("inf"), 1e12, 2.0 ** 63])
def test_huge_timeouts_mean_wait_forever(timeout):
    buf = ReorderBuffer()
    buf.put(0, "x")
    assert buf.get(0, timeout=timeout) == "x"
    with pytest.raises(ValueError, match="timeout"):
        buf.get(1, timeout=float("nan"))


# ---------------------------------------------------------------------------
# re-entry from the garbage collector
# ---------------------------------------------------------------------------

# Run in a child so that a deadlock fails the test (by its timeout) instead of
# hanging the suite.  Before each operation a collection is armed: freelists
# are drained and the generation-0 count pushed past its threshold with the
# collector disabled, so (on CPython <= 3.11, which collects inline) the first
# container or exception the operation allocates runs a collection right there.
# The collection reaches the same buffer, as an EpochIterator.__del__ does
# (shutdown -> close()): through a gc callback, or the finalizer of cyclic
# garbage.  A buffer that allocates while holding its native mutex locks it a
# second time from the same thread and hangs for ever.
_GC_REENTRY_CHILD = r"""
import gc, sys
from mxload._core import BufferClosedError, ReorderBuffer

rounds, how = int(sys.argv[1]), sys.argv[2]
state = {"buf": None, "in_op": False, "inside": 0, "next": 10_000}


def reach(buf):
    state["inside"] += state["in_op"]
    state["next"] += 1
    len(buf)
    0 in buf
    if state["next"] % 3 == 0:
        buf.close("closed by a collection")
    else:
        try:
            buf.put(state["next"], "from a collection")
        except BufferClosedError:
            pass


def on_collect(phase, info):
    if phase == "start" and state["buf"] is not None:
        reach(state["buf"])


class Reacher:
    def __init__(self, buf):
        self.buf, self.cycle = buf, self

    def __del__(self):
        reach(self.buf)


class Junk:
    pass


def expect(value):
    def check(got, buf):
        assert got == value, (got, value)
    return check


OPS = [
    ("put", lambda b: b.put(1, "y"), None),
    ("put a duplicate", lambda b: b.put(0, "again"), KeyError),
    ("put after close", lambda b: (b.close("closed"), b.put(1, "y")), BufferClosedError),
    ("get", lambda b: b.get(0), expect("x")),
    ("get, timed out", lambda b: b.get(5, timeout=0), TimeoutError),
    ("get after close", lambda b: (b.close("closed"), b.get(0)), BufferClosedError),
    ("try_get", lambda b: b.try_get(0), expect("x")),
    ("try_get after close", lambda b: (b.close("closed"), b.try_get(0)), BufferClosedError),
    ("pop_next", lambda b: b.pop_next(timeout=0), expect((0, "x"))),
    ("pop_next, timed out", lambda b: (b.get(0), b.pop_next(timeout=0)), TimeoutError),
    ("clear", lambda b: b.clear(), None),
    ("close", lambda b: b.close("closed"), None),
    ("len", lambda b: len(b), None),
    ("contains", lambda b: 0 in b, expect(True)),
]

gc.set_threshold(1000)
gc.callbacks.append(on_collect)
for r in range(rounds):
    for name, op, outcome in OPS:
        buf = ReorderBuffer()
        buf.put(0, "x")
        gc.collect(0)
        gc.disable()
        # more than each freelist holds (2000 2-tuples, 80 dicts, 80 lists)
        drain = [(i, i) for i in range(2500)] + [{} for _ in range(100)] + [[] for _ in range(100)]
        junk = [Junk() for _ in range(1000 - 2 * (r % 4))]  # vary where the collection lands
        if how == "finalizer":
            Reacher(buf)
        else:
            state["buf"] = buf
        gc.enable()
        state["in_op"] = True
        try:
            got = op(buf)
        except BufferClosedError:
            assert buf.closed, name  # closed by the operation or by the collection
        except BaseException as e:
            assert isinstance(outcome, type) and isinstance(e, outcome), (name, e)
        else:
            assert not isinstance(outcome, type), (name, "did not raise", outcome)
            if outcome is not None:
                outcome(got, buf)
        state["in_op"] = False
        state["buf"] = None
        del drain, junk
print("collections inside an operation:", state["inside"], "of", rounds * len(OPS), flush=True)
"""


@pytest.mark.parametrize("how", ["gc_callback", "finalizer"])
def test_collection_inside_an_operation_may_reach_the_buffer(how):
    """A collection that runs inside any ReorderBuffer method (allocation of a
    result, an exception, a container) may call back into the same buffer:
    close(), put(), len(), `in`.  Nothing hangs, every operation ends with its
    own result or BufferClosedError."""
    rounds = 300 if LONG else 15
    try:
        proc = fresh_python.run_args("-c", _GC_REENTRY_CHILD, str(rounds), how, timeout=20 + rounds / 10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"deadlock: a collection ({how}) re-entered a ReorderBuffer "
                    f"that held its mutex")
    assert proc.returncode == 0, proc.stderr
    inside = int(proc.stdout.split()[-3])
    # The reproduction is only worth something if collections really ran
    # inside the operations: in each of the 8 that allocate (an exception, a
    # result tuple, a new dict), on CPython <= 3.11; 3.12+ collects between
    # bytecodes.
    if sys.version_info < (3, 12):
        assert inside >= rounds * 7, proc.stdout


# ---------------------------------------------------------------------------
# the clock of the waits
# ---------------------------------------------------------------------------


def test_waits_run_on_the_monotonic_clock():
    """Waits are timed on CLOCK_MONOTONIC where pthreads can (Linux); show_config
    reports the clock."""
    clock = _core.BUILD_INFO["wait_clock"]
    assert clock in ("CLOCK_MONOTONIC", "CLOCK_REALTIME")
    if sys.platform.startswith("linux"):
        assert clock == "CLOCK_MONOTONIC"


# An LD_PRELOAD shim that makes every CLOCK_REALTIME reading in the process an
# hour ahead of the kernel's wall clock: exactly what a program sees when the
# wall clock is stepped back an hour between reading it and waiting.  A wait
# whose deadline is computed on CLOCK_REALTIME then sleeps an hour.
_WALL_CLOCK_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>

int clock_gettime(clockid_t clk, struct timespec *ts)
{
    static int (*real)(clockid_t, struct timespec *);
    if (real == NULL)
        real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int rc = real(clk, ts);
    if (rc == 0 && clk == CLOCK_REALTIME)
        ts->tv_sec += 3600;
    return rc;
}
"""

_WALL_CLOCK_CHILD = r"""
import signal, sys, time
from mxload._core import ReorderBuffer

assert time.time() - float(sys.argv[1]) > 3000, "the wall-clock shim is not active"
buf = ReorderBuffer()
for wait in (lambda: buf.get(0, timeout=0.3), lambda: buf.pop_next(timeout=0.3)):
    t0 = time.monotonic()
    try:
        wait()
    except TimeoutError:
        pass
    print(round(time.monotonic() - t0, 3), flush=True)
# No timeout at all: a signal handler (Ctrl-C's path) runs between wait slices.
def alarm(signum, frame):
    raise InterruptedError("alarm")
signal.signal(signal.SIGALRM, alarm)
signal.setitimer(signal.ITIMER_REAL, 0.2)
t0 = time.monotonic()
try:
    buf.get(0)
except InterruptedError:
    pass
print(round(time.monotonic() - t0, 3), flush=True)
"""


# slow: it builds a C shim and times waits in a fresh interpreter (~1.2 s on 2 cores)
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD shim, Linux")
def test_a_wall_clock_step_does_not_stretch_waits(tmp_path):
    import shutil
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the wall-clock shim")
    (tmp_path / "shim.c").write_text(_WALL_CLOCK_SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(shim), str(tmp_path / "shim.c"),
                    "-ldl"], check=True, capture_output=True, timeout=60)
    env = dict(os.environ, LD_PRELOAD=str(shim))
    try:
        proc = fresh_python.run_args("-c", _WALL_CLOCK_CHILD, str(time.time()), env=env, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("a wait slept past its timeout: it is timed on the wall clock")
    assert proc.returncode == 0, proc.stderr
    timed_get, timed_pop, interrupted = map(float, proc.stdout.split())
    assert 0.3 <= timed_get < 0.3 + SLACK
    assert 0.3 <= timed_pop < 0.3 + SLACK
    assert 0.15 <= interrupted < 0.2 + SLACK
