"""The roster's choice of the worker for each task (no workers started)."""
from __future__ import annotations

import pytest

from mxload._runtime.roster import Roster

pytestmark = pytest.mark.timeout(10)


def test_batch_i_goes_to_worker_i_mod_n_wherever_an_epoch_starts():
    roster = Roster(3)
    assert [roster.pick(i, True) for i in (4, 5, 6, 7)] == [1, 2, 0, 1]   # a resumed epoch: same workers


def test_a_streams_tasks_cycle_past_the_workers_whose_stream_ended():
    """torch's cycle: after worker 1's end, the task after one of worker 1's goes to worker 2
    (`idx % workers left` gave worker 0, twice in a row with the task before), whenever the end
    is learnt; each epoch starts again at worker 0."""
    roster = Roster(3)
    assert [roster.pick(i, True, stream=True) for i in range(8)] == [0, 1, 2, 0, 1, 2, 0, 1]
    roster.workers[1].exhausted = True
    roster.changed()
    assert [roster.pick(i, True, stream=True) for i in range(8, 12)] == [2, 0, 2, 0]
    roster.workers[0].exhausted = True
    roster.changed()
    assert [roster.pick(i, True, stream=True) for i in range(12, 14)] == [2, 2]
    roster.new_epoch()
    assert [roster.pick(i, True, stream=True) for i in range(3)] == [0, 1, 2]
