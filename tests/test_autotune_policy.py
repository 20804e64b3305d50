"""The autotuner's policy alone (mxload/_runtime/autotune/policy.py): the choice at an epoch's
start and the climb's verdicts, fed made-up measurements on a fake clock (no loader, no
worker, no wall clock)."""
from __future__ import annotations

import pytest

from mxload._runtime.autotune import policy
from mxload._runtime.autotune.policy import AutoTuner, Climb

pytestmark = pytest.mark.timeout(10)

WINDOW_BATCHES = 8   # the producer's window, as the rates below were measured over


class SwitchesOnly:
    """An engine that records the settings the climb puts in force."""

    def __init__(self, left: int = 400):
        self.active: list[tuple[int, int]] = []
        self.left = left   # the epoch's batches still to hand out

    def set_active(self, workers: int, window: int) -> None:
        self.active.append((workers, window))


class Epoch:
    """One epoch's climb on SwitchesOnly, fed window by window."""

    def __init__(self, tuner: AutoTuner, settled: tuple[int, int] = (2, 2)):
        self.tuner, self.engine = tuner, SwitchesOnly()
        self.climb = Climb(tuner, 0, settled)
        tuner.settled = settled
        self.handed_back = False

    def window(self, rate: float) -> None:
        """A window that ran at `rate` batches/s ends."""
        room = lambda: self.engine.left >= (policy.VERDICT_WINDOWS + 1) * WINDOW_BATCHES  # noqa: E731
        if self.climb.judge(rate, self.engine, 100, room):
            self.handed_back = True
            self.climb.hand_back(rate, self.engine, 100)


def two_cores(monkeypatch) -> AutoTuner:
    """A tuner on 2 cores that chose 2 workers for decode-bound batches (40 ms each: 25 a second
    in-process, below any rate the tests feed)."""
    monkeypatch.setattr(policy.os, "cpu_count", lambda: 2)
    tuner = AutoTuner(max_workers=2, cores=2, auto_window=True, fixed_window=4)
    assert tuner.choose(0, [40_000_000] * 8, [0] * 7, [0] * 7) == 2
    return tuner


def test_the_climb_tries_first_what_the_model_ranks_closest(monkeypatch):
    """On 2 cores, with 2 workers settled, a worker fewer (predicted twice as slow) is tried
    last, after the windows the model cannot rank."""
    tuner = two_cores(monkeypatch)
    climb = Epoch(tuner).climb
    assert climb.neighbours() == [(2, 4), (2, 1), (1, 2)]
    tuner.choices[-1].predicted_ms[1] = 1.0   # a worker fewer predicted the fastest
    assert climb.neighbours()[0] == (1, 2)
    assert Climb(tuner, 0, (0, 2)).neighbours() == []   # in-process: nothing to move


def test_a_try_toward_less_that_loses_even_in_its_switch_window_is_undone_at_once(monkeypatch):
    """jpeg on 2 cores: a try of 1 worker in place of 2 ran at 0.6x even in the window that
    flatters it; waiting for its verdict window cost another window at half speed."""
    tuner = two_cores(monkeypatch)
    tuner.schedule.turn = 1   # the second neighbour: half the window
    epoch = Epoch(tuner)
    for rate in [50, 100, 100, 100, 100]:   # the pipeline's fill, then 4 settled windows
        epoch.window(rate)
    assert epoch.engine.active == [(2, 2)]
    epoch.window(60)
    assert epoch.engine.active == [(2, 2), (2, 4)] and epoch.climb.trying is None
    assert tuner.schedule.every == 2 * policy.TRY_EVERY and not tuner.changes


@pytest.mark.parametrize("turn, tried, switch_rate", [(1, (2, 1), 95), (0, (2, 4), 60)])
def test_a_try_gets_its_verdict_after_the_switch_window_unless_it_lost_toward_less(
        monkeypatch, turn, tried, switch_rate):
    """A try toward less within TRY_UNDO_LOSS in its switch window, and any try toward more
    (its switch window penalises it), waits for the next window's verdict."""
    tuner = two_cores(monkeypatch)
    tuner.schedule.turn = turn
    epoch = Epoch(tuner)
    for rate in [50, 100, 100, 100, 100]:
        epoch.window(rate)
    epoch.window(switch_rate)
    assert epoch.climb.trying == tried and epoch.engine.active == [(2, tuner.window(*tried))]
    epoch.window(120)   # the verdict, over VERDICT_WINDOWS: faster by more than TRY_GAIN, kept
    assert epoch.climb.trying == tried
    epoch.window(100)
    assert epoch.climb.trying is None and epoch.climb.settled == tuner.settled == tried
    assert len(tuner.changes) == 1 and tuner.schedule.every == policy.TRY_EVERY


def test_the_wait_between_tries_that_did_not_pay_carries_over_to_the_next_epoch(monkeypatch):
    """The try schedule is the tuner's: a settled setting whose tries lost is not tried again
    at every epoch's start."""
    tuner = two_cores(monkeypatch)
    epoch = Epoch(tuner)
    for rate in [50, 100, 100, 100, 100, 90, 90, 90]:   # ... a try of a larger window that lost
        epoch.window(rate)
    assert epoch.engine.active == [(2, 8), (2, 4)] and tuner.schedule.every == 8
    for settled_windows in (4, 3):   # two short epochs: no try is due in either
        epoch = Epoch(tuner)
        for rate in [50] + [100] * settled_windows:
            epoch.window(rate)
        assert epoch.engine.active == [], settled_windows
    epoch.window(100)   # the 8th settled window since the try: the next neighbour, in turn
    assert epoch.engine.active == [(2, 2)]
    # A fresh probe starts the climb over.
    tuner.choose(3, [4_000_000] * 8, [0] * 7, [0] * 7)
    assert tuner.schedule.every == policy.TRY_EVERY and tuner.schedule.since == 0


@pytest.mark.parametrize("verdicts, kept", [([118, 88], False), ([112, 100], True), ([70], False)])
def test_a_try_is_judged_on_its_verdict_windows_together(monkeypatch, verdicts, kept):
    """One window of 8 batches varies by 15% on a busy machine (jpeg kept a window 0.93x as fast
    on one lucky one): the verdict is the mean of VERDICT_WINDOWS, against the settled setting's
    last windows; a window TRY_UNDO_LOSS slower ends the try at once."""
    tuner = two_cores(monkeypatch)
    epoch = Epoch(tuner)
    for rate in [50, 96, 104, 100, 100]:   # the settled setting: 100 a second
        epoch.window(rate)
    assert epoch.climb.trying == (2, 4)
    epoch.window(60)   # its switch: a larger window's pipeline fills, no verdict
    for rate in verdicts:
        epoch.window(rate)
    assert epoch.climb.trying is None
    assert (tuner.settled == (2, 4)) is kept and len(tuner.changes) == int(kept)
    assert epoch.engine.active == [(2, 8)] + ([] if kept else [(2, 4)])


def test_no_try_starts_where_the_epoch_would_cut_it_short_and_a_cut_one_counts_as_lost(monkeypatch):
    """A try needs its switch and VERDICT_WINDOWS more: near the epoch's end none starts (jpeg's
    64-batch epochs ended in a try's switch window, and the unjudged try came back every epoch);
    one an epoch's end cuts all the same is undone and waits twice as long."""
    tuner = two_cores(monkeypatch)
    epoch = Epoch(tuner)
    epoch.engine.left = (policy.VERDICT_WINDOWS + 1) * WINDOW_BATCHES - 1
    for rate in [50, 100, 100, 100, 100, 100]:
        epoch.window(rate)
    assert epoch.engine.active == []   # due, but no room for it
    epoch.engine.left = 400
    epoch.window(100)
    assert epoch.engine.active == [(2, 8)]
    epoch.climb.cut_short()
    assert epoch.climb.trying is None and tuner.schedule.every == 2 * policy.TRY_EVERY


def test_two_settled_windows_in_a_row_below_in_process_hand_the_epoch_back(monkeypatch):
    """One slow window is not a loss; two in a row are: the engine takes no more tasks, the
    next epochs stay in-process (1, then 2 ...), and the tuner forgets where it settled."""
    tuner = two_cores(monkeypatch)   # in-process: 25 batches/s
    epoch = Epoch(tuner)
    for rate in [5, 10, 100, 10]:   # the fill, a slow window, a fast one, a slow one
        epoch.window(rate)
    assert not epoch.handed_back
    epoch.window(10)
    assert epoch.handed_back and epoch.engine.active == [(0, 1)]
    assert tuner.settled is None and tuner.changes[-1][2:4] == (2, 0)
    assert "workers reached 10 batches/s, below in-process" in tuner.changes[-1][4]
    assert tuner.choose(1, [40_000_000] * 8, [0] * 7, [0] * 7) == 0
    assert "in-process for this and 0 more epoch(s)" in tuner.choices[-1].reason


def test_cold_workers_windows_are_not_the_workers_rate(monkeypatch):
    """Persistent workers started by this epoch: their windows judge tries but do not tell the
    next epoch what the workers reach."""
    tuner = two_cores(monkeypatch)
    for cold in (True, False):
        epoch = Epoch(tuner)
        epoch.climb.cold = cold
        for rate in [50, 100]:
            epoch.window(rate)
        assert (tuner._engine_rate is None) == cold


class FakeClock:
    def __init__(self) -> None:
        self.ns = 10**12

    def __call__(self) -> int:
        return self.ns


def test_reprobe_is_counted_on_the_clock_the_tuner_is_given(monkeypatch):
    """After a probe that found workers clearly slower, epochs skip theirs for REPROBE_S of the
    tuner's clock, and no longer."""
    monkeypatch.setattr(policy, "predict_ns", lambda k, *_: 1e6 * (k + 1))   # workers 2x slower
    clock = FakeClock()
    tuner = AutoTuner(max_workers=2, cores=2, auto_window=True, fixed_window=4, clock=clock)
    assert tuner.choose(0, [1_000_000] * 8, [0] * 7, [0] * 7) == 0
    assert tuner.probe_skipped()
    clock.ns += int(policy.REPROBE_S * 1e9) - 1
    assert tuner.probe_skipped()
    clock.ns += 1
    assert not tuner.probe_skipped()
    tuner.unprobed_epoch()
    assert tuner.report()["epochs_without_probe"] == 1


def test_an_unprobed_run_far_below_the_kept_rates_makes_the_next_epoch_probe(monkeypatch):
    monkeypatch.setattr(policy, "predict_ns", lambda k, *_: 1e6 * (k + 1))
    tuner = AutoTuner(max_workers=2, cores=2, auto_window=True, fixed_window=4, clock=FakeClock())
    tuner.choose(0, [1_000_000] * 8, [0] * 7, [0] * 7)   # in-process: 1000 batches/s
    tuner.unprobed_run(900.0)   # within SLOWED_PROBE
    assert tuner.probe_skipped()
    tuner.unprobed_run(1000.0 * (1 - policy.SLOWED_PROBE) - 1)
    assert not tuner.probe_skipped()


def test_fixed_prefetch_keeps_its_window_and_auto_scales_with_workers():
    fixed = AutoTuner(max_workers=4, cores=4, auto_window=False, fixed_window=6)
    assert fixed.window(3) == fixed.window(1, 8) == 6
    auto = AutoTuner(max_workers=4, cores=4, auto_window=True, fixed_window=6)
    assert auto.window(3) == 3 * policy.WINDOW_PER_WORKER and auto.window(3, 4) == 12
    assert auto.window(0) == 1
    assert Climb(fixed, 0, (2, 2)).neighbours() == [(3, 2), (1, 2)]   # no window to move
