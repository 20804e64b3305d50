"""Task pairing's policy alone (mxload/_runtime/local/pairing.py): how many of a worker's tasks
go in one message, from the window and the tasks sent (no worker started)."""
from __future__ import annotations

import pytest

from mxload._runtime.local.pairing import (
    MAX_TASKS_PER_MESSAGE,
    PAIR_BACKOFF_MAX_TASKS,
    PAIR_BACKOFF_MIN_TASKS,
    PAIR_NEVER,
    PAIR_WHILE_AHEAD,
    Pairing,
)

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("window, workers, ahead, behind", [
    (3, 2, 1, 1), (4, 2, 2, 1), (6, 2, 3, 2), (8, 2, 4, 3), (8, 1, 8, 7), (100, 2, 8, 7), (12, 4, 3, 2),
    (4, 0, 1, 1)])
def test_a_worker_s_share_goes_in_one_message_ahead_and_one_fewer_after_a_stop(window, workers, ahead,
                                                                                behind):
    """window // workers (at most MAX_TASKS_PER_MESSAGE) to a message while the loop is ahead;
    one fewer after it would have waited; never paired under 2 per worker."""
    pairing = Pairing()
    assert pairing.set_window(window, workers, sent=10_000) == ahead
    assert pairing.mode == (PAIR_WHILE_AHEAD if ahead > 1 else PAIR_NEVER)
    stopped = pairing.stop(ahead, sent=10_000, filling=False)
    assert stopped == (behind if ahead > 1 else None)
    assert pairing.resume_at == (10_000 + PAIR_BACKOFF_MIN_TASKS if ahead > 1 else 0)
    assert ahead <= MAX_TASKS_PER_MESSAGE


def test_no_stop_while_the_epoch_s_first_window_fills_or_once_stopped():
    pairing = Pairing()
    assert pairing.set_window(4, 2, sent=0) == 2
    assert pairing.stop(2, sent=100, filling=True) is None   # the workers are just starting
    assert pairing.stop(1, sent=100, filling=False) is None  # already one fewer
    assert pairing.resume_at == 0 and pairing.backoff == PAIR_BACKOFF_MIN_TASKS


def test_pairing_resumes_once_the_stop_s_tasks_are_sent():
    pairing = Pairing()
    pairing.set_window(8, 2, sent=0)
    assert pairing.stop(4, sent=100, filling=False) == 3
    assert pairing.after_send(3, sent=100 + PAIR_BACKOFF_MIN_TASKS - 1) == 3
    assert pairing.after_send(3, sent=100 + PAIR_BACKOFF_MIN_TASKS) == 4
    # A window set during a stop keeps its tasks per message one fewer until it is over.
    assert pairing.set_window(6, 2, sent=100) == 2 and pairing.set_window(6, 2, sent=10_000) == 3


def test_pairing_backs_off_briefly_after_a_long_paired_run_and_longer_when_stops_recur():
    """A stop after a long paired run is the shortest; one soon after pairing resumed doubles the
    last; never beyond PAIR_BACKOFF_MAX_TASKS."""
    pairing = Pairing()
    pairing.set_window(4, 2, sent=0)
    lengths = []

    def stop_at(sent: int) -> None:
        assert pairing.stop(2, sent, filling=False) == 1
        lengths.append(pairing.resume_at - sent)

    stop_at(5000)                        # long after the last resumption: the shortest
    for _ in range(8):                   # each at once after pairing resumed: doubled, capped
        stop_at(pairing.resume_at + 1)
    stop_at(pairing.resume_at + 5000)    # a long paired run again: back to the shortest
    assert lengths == [PAIR_BACKOFF_MIN_TASKS, 32, 64, 128, 256, 512, 1024, 1024, 1024,
                       PAIR_BACKOFF_MIN_TASKS], lengths
    assert max(lengths) == PAIR_BACKOFF_MAX_TASKS


def test_a_transport_that_never_pairs_never_resumes_pairing():
    pairing = Pairing()
    assert pairing.set_window(2, 2, sent=0) == 1
    assert pairing.after_send(1, sent=10**6) == 1
