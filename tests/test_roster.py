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


def test_dead_and_exhausted_workers_take_no_task_until_the_roster_is_told():
    roster = Roster(3)
    assert roster.pick(1, True) == 1
    roster.lost(1)                      # lost() recounts the takers itself
    assert [roster.pick(i, True) for i in range(4)] == [0, 2, 0, 2]
    roster.workers[0].exhausted = True  # a field set directly: counted again after changed()
    assert roster.pick(0, True) == 0
    roster.changed()
    assert roster.pick(0, True) == 2
    roster.workers[2].alive = False
    roster.changed()
    assert roster.pick(0, True) is None and roster.all_done()


def test_only_the_active_workers_take_tasks_and_the_others_keep_theirs():
    roster = Roster(4)
    roster.workers[3].outstanding[(0, 7)] = None
    roster.set_active(2)
    assert {roster.pick(i, True) for i in range(6)} == {0, 1}
    assert roster.held(3, 0) == [7] and roster.holders(0, 7) == [3]
    roster.set_active(4)
    assert {roster.pick(i, True) for i in range(8)} == {0, 1, 2, 3}


def test_out_of_order_the_least_loaded_worker_takes_the_task_ties_round_robin():
    roster = Roster(3)
    roster.workers[0].outstanding.update({(0, 0): None, (0, 3): None})
    roster.workers[1].outstanding[(0, 1)] = None
    assert roster.pick(4, False) == 2            # 2 holds none
    roster.workers[2].outstanding.update({(0, 4): None, (0, 5): None})
    assert roster.pick(6, False) == 1            # 0: 2, 1: 1, 2: 2
    roster.workers[1].outstanding[(0, 6)] = None
    assert roster.pick(7, False) == 1            # all hold 2: the round-robin start (7 % 3)
    assert roster.pick(7, True) == 1 and roster.pick(8, True) == 2   # in order: load ignored


def test_held_and_holders_read_the_outstanding_tasks_of_an_epoch():
    roster = Roster(2)
    roster.workers[0].outstanding.update({(1, 4): None, (2, 0): None, (1, 2): None})
    roster.workers[1].outstanding[(1, 5)] = None
    assert roster.held(0, 1) == [4, 2] and roster.held(0, 2) == [0] and roster.held(1, 2) == []
    assert roster.holders(1, 5) == [1] and roster.holders(1, 9) == []


def test_a_replaced_worker_gets_a_fresh_record_and_the_dead_ones_tasks_are_returned():
    roster = Roster(2)
    roster.workers[1].outstanding[(0, 3)] = None
    roster.lost(1)
    assert roster.alive_ids() == [0] and roster.pick(3, True) == 0
    dead = roster.replace(1)
    assert dict(dead.outstanding) == {(0, 3): None} and not dead.alive
    assert roster.workers[1].alive and not roster.workers[1].outstanding
    assert roster.alive_ids() == [0, 1] and roster.pick(3, True) == 1


def test_forget_all_leaves_no_worker_alive_and_no_task_held():
    roster = Roster(3)
    for wid in range(3):
        roster.workers[wid].outstanding[(0, wid)] = None
    roster.forget_all()
    assert roster.alive_ids() == [] and roster.pick(0, True) is None
    assert all(not w.outstanding for w in roster.workers) and roster.all_done()


def test_a_new_epoch_makes_every_exhausted_stream_take_tasks_again():
    roster = Roster(2)
    roster.workers[0].exhausted = roster.workers[1].exhausted = True
    roster.changed()
    assert roster.all_done() and roster.pick(0, True, stream=True) is None
    roster.new_epoch()
    assert not roster.all_done() and [roster.pick(i, True, stream=True) for i in range(3)] == [0, 1, 0]
