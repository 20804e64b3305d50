"""The Supervisor's contract (mxload/_runtime/results.py), with a fake engine and transport: no
worker started.  What a worker reports becomes the batch, a BatchFailure or a stream's end in the
reorder buffer, once, for the epoch that sent it; a lost worker is restarted within the loader's
budget, with its tasks sent again, or fails the epoch naming what it held; the first fatal error
is kept and wakes the consumer."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from mxload._core import BufferClosedError
from mxload._runtime import messages as m
from mxload._runtime.results import EXHAUSTED, BatchFailure, Supervisor
from mxload._runtime.roster import Roster
from mxload._runtime.shutdown import RUNNING, SHUTTING_DOWN
from mxload._runtime.transport import WorkerLoss
from mxload.errors import WorkerError

pytestmark = pytest.mark.timeout(10)


class FakeBuffer:
    def __init__(self):
        self.items, self.closed = {}, None

    def put(self, idx, item):
        if self.closed is not None:
            raise BufferClosedError(self.closed)
        self.items[idx] = item

    def close(self, message):
        self.closed = message


class FakeTransport:
    def __init__(self, restartable=True, queued=()):
        self.restartable, self._queued = restartable, list(queued)
        self.restarted, self.flushed = [], 0
        self.transported = "socket"

    def pid(self, wid):
        return 1000 + wid

    def queued(self, wid):
        return self._queued

    def restart(self, wid, epoch):
        self.restarted.append((wid, epoch))
        return True

    def flush(self):
        self.flushed += 1


def engine(num_workers=2, restarts=0, iterable=False, **transport):
    sent = []
    fake = SimpleNamespace(
        lock=threading.RLock(), roster=Roster(num_workers), buffer=FakeBuffer(),
        transport=FakeTransport(**transport), epoch=3, profiler=None, state=RUNNING,
        restarts={"worker_restarts": 0}, sent=sent,
        options=SimpleNamespace(workers=SimpleNamespace(max_worker_restarts=restarts),
                                derived=SimpleNamespace(iterable=iterable)))
    fake.send = lambda wid, idx, indices: sent.append((wid, idx, indices))
    return fake


def test_a_batch_of_an_outstanding_task_is_stored_once():
    e = engine()
    e.roster.workers[1].outstanding[(3, 5)] = None
    sup = Supervisor(e)
    sup.deliver(1, m.Loaded(3, 5, "batch 5", None))
    assert e.buffer.items == {5: "batch 5"} and not e.roster.workers[1].outstanding
    sup.deliver(1, m.Loaded(3, 5, "again", None))   # no longer outstanding: dropped
    assert e.buffer.items == {5: "batch 5"}


def test_a_result_of_an_abandoned_epoch_is_dropped_and_its_task_forgotten():
    e = engine()
    e.roster.workers[0].outstanding[(2, 1)] = None
    Supervisor(e).deliver(0, m.Loaded(2, 1, "old", None))
    assert e.buffer.items == {} and not e.roster.workers[0].outstanding


def test_a_stream_end_marks_the_worker_exhausted_and_takes_it_off_the_takers():
    e = engine()
    e.roster.workers[0].outstanding[(3, 4)] = None
    assert e.roster.pick(0, True) == 0
    Supervisor(e).deliver(0, m.Exhausted(3, 4))
    assert e.buffer.items == {4: EXHAUSTED} and e.roster.workers[0].exhausted
    assert e.roster.pick(0, True) == 1


def test_a_failed_batch_is_a_batch_failure_naming_the_worker_and_batch():
    e = engine()
    e.roster.workers[1].outstanding[(3, 7)] = None
    Supervisor(e).deliver(1, m.Failed(3, 7, m.ExceptionInfo.of(KeyError("bad sample 13"))))
    failure = e.buffer.items[7]
    assert isinstance(failure, BatchFailure) and isinstance(failure.error, KeyError)
    notes = " ".join(getattr(failure.error, "__notes__", []))
    assert "worker 1" in notes and "1001" in notes and "batch 7" in notes, notes


def test_a_result_after_the_buffer_closed_is_dropped_quietly():
    e = engine()
    e.roster.workers[0].outstanding[(3, 0)] = None
    e.buffer.close("shutting down")
    Supervisor(e).deliver(0, m.Loaded(3, 0, "late", None))
    assert e.buffer.items == {}


def test_the_first_fatal_error_is_kept_and_closes_the_buffer_with_its_text():
    e = engine()
    sup = Supervisor(e)
    first, second = WorkerError("first"), WorkerError("second")
    sup.fail(first)
    sup.fail(second)
    assert sup.failure is first and e.buffer.closed == "second"


def test_a_lost_worker_within_the_budget_is_restarted_and_gets_its_tasks_again():
    e = engine(restarts=2)
    e.roster.workers[1].outstanding.update({(3, 4): "indices 4", (3, 2): "indices 2", (2, 9): None})
    sup = Supervisor(e)
    with pytest.warns(RuntimeWarning, match=r"mxload worker 1 \(pid 1001\) died \(killed by SIGKILL\); "
                                            r"restarting it \(1/2\)"):
        sup.worker_lost(WorkerLoss(1, 1001, -9, "killed by SIGKILL"))
    assert e.transport.restarted == [(1, 3)] and e.restarts["worker_restarts"] == 1
    assert e.sent == [(1, 2, "indices 2"), (1, 4, "indices 4")]   # this epoch's, in batch order
    assert e.roster.workers[1].alive and e.transport.flushed == 1 and sup.failure is None


@pytest.mark.parametrize("restarts,iterable,restartable,why", [
    (0, False, True, ""),
    (1, True, True, "an IterableDataset's worker held its place in the stream"),
    (1, False, False, "this backend cannot replace a worker"),
])
def test_a_lost_worker_not_restarted_fails_the_epoch_naming_what_it_held(restarts, iterable, restartable,
                                                                          why):
    e = engine(restarts=restarts, iterable=iterable, restartable=restartable, queued=[(3, 8)])
    e.roster.workers[0].outstanding.update({(3, 6): None, (3, 8): None})
    sup = Supervisor(e)
    sup.worker_lost(WorkerLoss(0, 1000, 1, "exit code 1"))
    error = sup.failure
    assert isinstance(error, WorkerError) and e.buffer.closed is not None and not e.transport.restarted
    text = str(error)
    assert "mxload worker 0 (pid 1000) died (exit code 1) while holding batches [6]" in text, text
    assert "(batches [8] were queued for it here, not sent yet)" in text and why in text
    assert not e.roster.workers[0].alive


def test_a_budget_spent_over_earlier_epochs_is_not_restarted_again():
    e = engine(restarts=1)
    e.restarts["worker_restarts"] = 1
    sup = Supervisor(e)
    sup.worker_lost(WorkerLoss(1, 1001, -11, "killed by SIGSEGV"))
    assert "max_worker_restarts=1 exhausted (a budget per loader, over all its epochs)" in str(sup.failure)


def test_a_loss_with_its_own_words_fails_with_them():
    e = engine(restarts=5)
    e.roster.workers[0].outstanding[(3, 1)] = None
    sup = Supervisor(e)
    sup.worker_lost(WorkerLoss(0, 1000, -9, "killed by SIGKILL",
                               final=lambda held: f"the zygote died; held {held}"))
    assert str(sup.failure).startswith("the zygote died; held [1]") and not e.transport.restarted


def test_a_loss_during_shutdown_only_marks_the_worker_lost():
    e = engine(restarts=5)
    e.state = SHUTTING_DOWN
    sup = Supervisor(e)
    sup.worker_lost(WorkerLoss(0, 1000, -15, "killed by SIGTERM"))
    assert not e.roster.workers[0].alive and sup.failure is None and not e.transport.restarted
