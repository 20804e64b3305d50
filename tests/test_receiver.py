"""The receiver's taking of a worker's message (mxload/_runtime/local/receiver.py: take_result,
retire_everywhere), with worker handles over no process and a fake slab pool: a result frees its
task's slab entry (a failure or a stream's end returns the slab to the pool), a frame that
contradicts the protocol is a ProtocolError saying what was wrong, and a retired slab is dropped
by exactly the workers that mapped it.  (The compiled receive path, with real workers:
test_receive_path.py and test_core_receive.py.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from mxload._runtime import messages as m
from mxload._runtime.local.launcher import ProcessHandle
from mxload._runtime.local.receiver import retire_everywhere, take_result
from mxload._runtime.local.wire import ProtocolError

pytestmark = pytest.mark.timeout(10)

ERROR = m.ExceptionInfo.of(ValueError("bad sample 3"))


class FakePool:
    def __init__(self):
        self.released, self.retired = [], []

    def release(self, slab):
        self.released.append(slab)

    def retire(self, slab):
        self.retired.append(slab)


def _handle(worker_id=0):
    return ProcessHandle(worker_id, None, 4000 + worker_id, None)


def test_a_start_failure_passes_through_untouched():
    handle, pool = _handle(), FakePool()
    msg = m.InitFailed(ERROR, "unpickling the dataset")
    assert take_result(msg, [], handle, [handle], pool) is msg and pool.released == []


@pytest.mark.parametrize("msg", [m.Failed(2, 5, ERROR), m.Exhausted(2, 5)], ids=["failed", "exhausted"])
def test_a_result_without_a_batch_returns_its_tasks_slab_to_the_pool(msg):
    handle, pool = _handle(), FakePool()
    slab = SimpleNamespace(slab_id=9)
    handle.slabs[(2, 5)] = slab
    handle.slabs[(2, 6)] = None
    assert take_result(msg, [], handle, [handle], pool) is msg
    assert pool.released == [slab] and list(handle.slabs) == [(2, 6)]


def test_a_result_of_a_task_without_a_slab_releases_nothing():
    handle, pool = _handle(), FakePool()
    handle.slabs[(2, 5)] = None
    take_result(m.Exhausted(2, 5), [], handle, [handle], pool)
    assert pool.released == [] and not handle.slabs


def test_a_batch_ref_to_a_layout_never_named_is_a_protocol_error():
    handle, pool = _handle(), FakePool()
    with pytest.raises(ProtocolError, match=r"a worker sent a BatchRef to layout 3, which it never named"):
        take_result(m.BatchRef(2, 5, 1, 64, 3), [], handle, [handle], pool)


def test_a_message_that_is_no_result_is_a_protocol_error():
    handle, pool = _handle(), FakePool()
    with pytest.raises(ProtocolError, match=r"^a worker sent Stop, not a result$"):
        take_result(m.Stop(), [], handle, [handle], pool)


def test_a_retired_slab_is_dropped_by_the_workers_that_mapped_it_and_only_them():
    a, b, c = _handle(0), _handle(1), _handle(2)
    a.known_slabs.update({7, 8})
    c.known_slabs.add(7)
    pool, slab = FakePool(), SimpleNamespace(slab_id=7)
    retire_everywhere(slab, pool, [a, b, c])
    assert pool.retired == [slab]
    assert (a.known_slabs, a.pending_drops) == ({8}, [7])
    assert (b.known_slabs, b.pending_drops) == (set(), [])
    assert (c.known_slabs, c.pending_drops) == (set(), [7])
