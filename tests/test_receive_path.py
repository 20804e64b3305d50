"""The loader's compiled receive path end to end: batches whose layout a
worker named before cross the main process as fixed-size frames stored
without the GIL, and nothing about the batches changes (values, order,
exactly once) whatever the layouts, epochs or worker deaths."""
from __future__ import annotations

import os
import random
import signal
import threading
import time
import warnings

import numpy as np
import pytest
from conftest import once_and_as_race, race_rounds, tries

import mxload
from mxload._runtime.local import process_worker as _worker


class Rows(mxload.Dataset):
    def __init__(self, n: int = 4096, dim: int = 8):
        self.x = np.arange(n * dim, dtype=np.float32).reshape(n, dim)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], i


class Ragged(mxload.Dataset):
    """Sample i has length i % 97 + 1: with Pad, nearly every batch has a layout of its own."""

    def __len__(self) -> int:
        return 600

    def __getitem__(self, i: int):
        return np.full(i % 97 + 1, i, np.int32), f"name-{i}" if i % 5 == 0 else i


def _receiver_stats(loader):
    return loader._iterations.engine.transport.receive_stats


def test_steady_batches_take_the_binary_frames_and_are_exact():
    loader = mxload.DataLoader(Rows(), batch_size=64, num_workers=2, persistent_workers=True)
    try:
        for _ in range(2):   # two epochs over the same workers and layouts
            got = [(x.copy(), y.copy()) for x, y in loader]
            assert len(got) == 64
            for k, (x, y) in enumerate(got):
                assert y.tolist() == list(range(64 * k, 64 * k + 64))
                assert np.array_equal(x, loader.dataset.x[64 * k:64 * k + 64])
        stats = _receiver_stats(loader)
        # Pickled: each worker's first batch in a slab it made (one per batch
        # in flight) and the first naming its layout; the rest are binary.
        # (The fetcher counts a stored batch just after the consumer may have taken it.)
        assert stats["stored"] + stats["passed_up"] >= 2 * 64 - 1 and stats["passed_up"] <= 24, stats
    finally:
        loader.close()


def test_many_layouts_and_per_batch_objects_fall_back_to_pickle():
    batchify = mxload.batchify.Tuple(mxload.batchify.Pad(), mxload.batchify.List())
    loader = mxload.DataLoader(Ragged(), batch_size=3, num_workers=2, persistent_workers=True,
                               batchify_fn=batchify)
    try:
        for _ in range(2):
            n = 0
            for k, (x, names) in enumerate(loader):
                idx = list(range(3 * k, 3 * k + 3))
                assert x.shape == (3, max(i % 97 + 1 for i in idx))
                assert [int(r[0]) for r in x] == idx
                assert names == [f"name-{i}" if i % 5 == 0 else i for i in idx]
                n += 1
            assert n == 200
    finally:
        loader.close()


def test_layout_cache_is_bounded():
    layouts = _worker.Layouts()

    class Plan:
        objects: list = []

        def __init__(self, k):
            self.k = k

        def layout(self):
            return (("f", 0), [(0, (self.k,), "<f4")])
    ids = [layouts.lookup(Plan(k)) for k in range(_worker.MAX_NAMED_LAYOUTS + 5)]
    assert ids[:3] == [(0, True), (1, True), (2, True)]
    assert ids[-1] == (-1, False)
    assert layouts.lookup(Plan(1)) == (1, False)


@pytest.mark.parametrize("tries", [range(5)])
def test_a_worker_killed_with_batches_stored_loses_and_repeats_none(tries):
    """Batches the receiver stored for a worker that then dies are delivered
    once; its other tasks are dispatched again (restart)."""
    for _ in tries:
        loader = mxload.DataLoader(Rows(2048), batch_size=16, num_workers=2, prefetch=8,
                                   max_worker_restarts=1)
        seen = []
        it = iter(loader)
        with pytest.warns(RuntimeWarning, match="restarting it"):
            for k, (_, y) in enumerate(it):
                seen.append(y[0] // 16)
                if k == 10:
                    os.kill(it.engine.worker_pids()[0], signal.SIGKILL)
        assert seen == list(range(128))


def _switches(tid: int) -> int:
    """Voluntary context switches of thread `tid` of this process so far (each a sleep)."""
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def test_no_thread_but_the_consumer_wakes_for_a_batch():
    """The consumer receives its batches itself: over 300 batches the
    fetcher thread (asleep on the workers' sentinels) hardly wakes, where it
    used to wake for every batch."""
    loader = mxload.DataLoader(Rows(300 * 4), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        assert len(list(loader)) == 300   # warm-up: layouts named, slabs mapped
        fetcher = next(t for t in threading.enumerate() if t.name == "mxload-fetcher")
        before = _switches(fetcher.native_id)
        stored = _receiver_stats(loader)["stored"]
        t0 = time.monotonic()
        assert sum(1 for _ in loader) == 300
        seconds = time.monotonic() - t0
        woke = _switches(fetcher.native_id) - before
        assert _receiver_stats(loader)["stored"] - stored >= 290
        # One wake-up per second of its 1 s watch() slices, and the epoch's start.
        assert woke <= seconds + 5, f"the fetcher thread woke {woke} times in {seconds:.1f} s for 300 batches"
    finally:
        loader.close()


@pytest.mark.faults
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_worker_dying_while_the_consumer_trains_is_replaced_at_once(start_method):
    """Nobody is in next(): the fetcher thread notices the death (its
    sentinel), takes what the worker sent and restarts it; the epoch then
    delivers every batch exactly once."""
    loader = mxload.DataLoader(Rows(64 * 16), batch_size=16, num_workers=2, max_worker_restarts=1,
                               start_method=start_method, timeout=60)
    it = iter(loader)
    seen = [int(next(it)[1][0]) // 16]
    victim = it.engine.worker_pids()[0]
    with pytest.warns(RuntimeWarning, match="restarting it"):
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        # Until the replacement is in place (the restart count goes up just before).
        while it.engine.worker_pids()[0] == victim and time.monotonic() < deadline:
            time.sleep(0.01)   # "training": the loader is not called
        assert loader.stats["worker_restarts"] == 1, "the death was not noticed while the consumer trained"
        assert it.engine.worker_pids()[0] != victim, "no replacement while the consumer trained"
        seen += [int(y[0]) // 16 for _, y in it]
    assert seen == list(range(64))


class _CountingReceiver:
    """The fetcher's FrameReceiver, counting attach() calls."""

    def __init__(self, inner):
        self.inner = inner
        self.attached = 0

    def attach(self, *args):
        self.attached += 1
        return self.inner.attach(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_resumed_fetcher_does_not_attach_its_workers_again():
    """Attaching resets a channel, dropping frames the receiver holds (those
    after one handed to Python, or half received): a fetcher thread started
    after a pause must keep the channels as they are."""
    loader = mxload.DataLoader(Rows(), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        it = iter(loader)
        next(it)
        transport = loader._iterations.engine.transport
        assert transport.pause()
        fetcher = transport._fetcher
        fetcher.receiver = spy = _CountingReceiver(fetcher.receiver)
        transport.resume()
        assert sum(1 for _ in it) == 1023
        assert spy.attached == 0
    finally:
        loader.close()


@pytest.mark.races
def test_a_paused_fetcher_keeps_half_received_frames():
    """Another loader forking its zygote pauses this one's fetcher thread and
    starts a new one: frames the receiver holds in part survive (50 rounds)."""
    loader = mxload.DataLoader(Rows(4096, dim=2048), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        for _ in range(race_rounds(50)):
            it = iter(loader)
            next(it)
            transport = loader._iterations.engine.transport
            for _ in range(3):
                if transport.pause():
                    transport.resume()
            assert sum(1 for _ in it) == 1023
    finally:
        loader.close()


def _slab_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "mxload-slab" in target:
            out.append(f"{fd}->{target}")
    return out


@pytest.mark.parametrize("rounds", once_and_as_race(20))
def test_shutdown_closes_descriptors_the_receiver_holds(rounds):
    """A batch's error ends the loop while results carrying new slabs'
    descriptors wait in the receiver behind it: shutting down closes them,
    even while something (a traceback) still holds the engine (20 rounds in the races tier)."""
    from datasets_for_tests import RaisingDataset
    for _ in range(tries(rounds)):
        loader = mxload.DataLoader(RaisingDataset(at=4), batch_size=2, num_workers=2, prefetch=12)
        it = iter(loader)
        engine = it.engine
        with pytest.raises(ValueError):
            list(it)
        it.close()
        assert engine.state == "closed"
        assert _slab_fds() == []
        del engine, it


def test_a_forked_child_cannot_take_the_parents_batches():
    """The check costs no system call per batch (a fork counter, not
    os.getpid()) and still refuses a child's next()."""
    import warnings
    loader = mxload.DataLoader(Rows(256), batch_size=16, num_workers=2)
    it = iter(loader)
    next(it)
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # our own fork, threads alive
        pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            next(it)
            os.write(w, b"took a batch")
        except RuntimeError as e:
            os.write(w, str(e).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    assert "not to this forked child" in said and "call iter(loader) again in the child" in said, said
    assert sum(1 for _ in it) == 15


@pytest.mark.faults
def test_close_from_another_thread_while_the_consumer_handles_deaths():
    """The consumer thread handles its workers' deaths itself (restarts them)
    while another thread closes the iterator: close() waits for that handling
    before it ends the processes, so it never trips over a half-forgotten
    worker, the consumer just stops, and nothing is left (30 rounds; before,
    close() raised 'Invalid file descriptor' 2 times in 60 and leaked the zygote)."""
    rng = random.Random(3)
    for _ in range(30):
        loader = mxload.DataLoader(Rows(100_000), batch_size=4, num_workers=2, max_worker_restarts=100,
                                   timeout=20)
        it = iter(loader)
        next(it)
        outcome: list[str] = []

        def consume(it=it, outcome=outcome):
            try:
                for _ in it:
                    pass
                outcome.append("stopped")
            except BaseException as e:  # noqa: BLE001 - the test reports whatever it was
                outcome.append(f"{type(e).__name__}: {e}")
        consumer = threading.Thread(target=consume)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # "restarting it"
            consumer.start()
            time.sleep(0.01)
            for pid in it.engine.worker_pids():
                os.kill(pid, signal.SIGKILL)
            time.sleep(rng.choice([0.0005, 0.001, 0.002, 0.004]))
            it.close()
            consumer.join(10)
        assert outcome == ["stopped"]
        del it, loader
