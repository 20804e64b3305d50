"""The autotuner's policy: what to do with the measurements.  At an epoch's start, `AutoTuner`
picks the worker count from a probe's measurements (the model's predictions, checked against
the throughputs that earlier epochs really reached); on the engine, `Climb` judges each window
and tries a neighbouring setting now and then.  It reads no clock of its own but the one it is
given (`AutoTuner.clock`), and starts or ends nothing: the producer (producer.py) measures and
applies what it decides."""
from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..._words import count
from .model import optimistic_ns, predict_ns, probe_rate

TRY_EVERY = 4                # windows at a settled setting before the first try
MAX_TRY_EVERY = 32           # ... and at most, after tries that did not pay
LOSING_WINDOWS = 2           # settled windows in a row below in-process before handing back
TRY_GAIN = 0.05              # a tried setting is kept if it was this much faster ...
VERDICT_WINDOWS = 2          # ... over this many windows after its switch (one alone: 8 batches' noise)
SETTLED_WINDOWS = 4          # ... than the settled setting's last (at most) this many windows
TRY_UNDO_LOSS = 0.15         # a try toward less this much slower in its (flattering) switch window has lost
WORKERS_MARGIN = 0.15        # workers must be predicted this much faster than in-process ...
CLOSE_CALL = 0.3             # ... or, predicted at most this much slower, are tried and measured
SLOWED_PROBE = 0.25          # ... unless the probe ran this much below the last ones' in-process rate
# After a probe that found workers clearly slower (by more than CLOSE_CALL), epochs skip their probe
# (and its choice) for this long, timing their whole in-process run instead: tabular-getitems' 97
# batches of 0.09 ms an epoch lost 4-7% of their throughput to a probe in every epoch.
REPROBE_S = 0.25
WINDOW_PER_WORKER = 2        # prefetch="auto": tasks in flight per worker taking tasks, at first
PER_WORKER_CHOICES = (1, 2, 4, 8)
MAX_INPROCESS_EPOCHS = 8     # after workers lost to in-process, epochs before trying them again (at most)
INPROCESS_RATES_KEPT = 5     # workers are compared with the last this many in-process rates measured
ENGINE_RATES_KEPT = 3        # ... by the rates of the last this many epochs on workers
# In-process rates measured before workers that beat them start an epoch without a probe: a run's
# first probe alone (cold: page faults, caches) kept workers at 0.94x of in-process a whole run.
# On fewer, this many epochs still resume (a probe at once cost two-epoch runs of augment and jpeg
# 5-10%), then one probes.
RESUME_INPROCESS_RATES = 2
RESUMES_ON_ONE_RATE = 1


@dataclass
class Choice:
    """What the tuner chose at an epoch's start, and from what."""
    epoch: int
    workers: int
    load_ms: float
    step_ms: float
    step_cpu_ms: float
    cores: int
    free_cores: float            # the usable cores less those other processes kept busy
    predicted_ms: dict[int, float]
    reason: str
    batch_mb: float = 0.0          # the probe's first batch (a worker copies it into shared memory)


class TrySchedule:
    """When the climb tries a neighbour next.  Kept by the tuner across epochs, so a settled
    setting whose tries did not pay is tried less and less often, not again at every epoch's
    start (jpeg, 64 batches an epoch: a try of 1 worker in place of 2 cost every epoch a
    quarter of its throughput)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.every = TRY_EVERY       # settled windows between two tries
        self.since = 0               # settled windows since the last try
        self.turn = 0                # which neighbour comes next

    def due(self, room: bool = True) -> bool:
        """One more settled window: whether a try is due now (one due without `room` for it,
        near an epoch's end, is due at the next window that has it)."""
        self.since += 1
        if self.since < self.every or not room:
            return False
        self.since = 0
        return True

    def undone(self) -> None:
        self.every = min(self.every * 2, MAX_TRY_EVERY)

    def kept(self) -> None:
        self.every = TRY_EVERY


@dataclass
class AutoTuner:
    """The loader's tuner: its choices and adjustments across epochs."""
    max_workers: int
    cores: int
    auto_window: bool
    fixed_window: int
    choices: list[Choice] = field(default_factory=list)
    # (epoch, batches taken in the epoch, workers before, after, why)
    changes: list[tuple[int, int, int, int, str]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"auto_workers": 0, "auto_window": 0,
                                                            "auto_changes": 0})
    # What the climb settled on (workers, tasks per worker), kept for the next epoch.
    settled: tuple[int, int] | None = None
    per_worker: int = WINDOW_PER_WORKER
    schedule: TrySchedule = field(default_factory=TrySchedule)
    others_busy: float = 0.0     # cores other processes kept busy, at the last probe long enough to tell
    probe_s: float | None = None   # how long the last probe took (the producer's measurement)
    # The last epoch's measured throughput with workers, and the last probes' in-process ones.
    _engine_rate: float | None = None
    _engine_rates: deque[float] = field(default_factory=lambda: deque(maxlen=ENGINE_RATES_KEPT))
    _measured: float | None = None   # their upper median, until a choice uses it
    _inprocess_rates: deque[float] = field(default_factory=lambda: deque(maxlen=INPROCESS_RATES_KEPT))
    _lost = False                # the last epoch's workers lost to in-process and handed back
    # After workers lost: epochs to stay in-process before trying them again (1, 2, 4, ... up to
    # MAX_INPROCESS_EPOCHS after each loss in a row), and how many are left.
    _backoff = 0
    _inprocess_epochs = 0
    # perf_counter_ns before which an epoch stays in-process without a probe (the last probe found
    # workers clearly slower), and how many epochs did.
    _probe_due_ns = 0
    _unprobed_epochs = 0
    _thin_resumes = 0            # epochs resumed with fewer than RESUME_INPROCESS_RATES rates
    # The clock REPROBE_S is counted on (ns): the producer's, or a test's fake.
    clock: Callable[[], int] = field(default=time.perf_counter_ns, repr=False)

    @property
    def _inprocess_rate(self) -> float | None:
        """In-process throughput to compare workers' with: the upper median of the last few
        measured (one probe slowed by a hiccup made workers at 0.74x of in-process look 2x faster,
        and kept them for the rest of the run; the best of them let one flattering probe send
        workers that won by 1.6x back in-process)."""
        return statistics.median_high(self._inprocess_rates) if self._inprocess_rates else None

    def inprocess_measured(self, rate: float) -> None:
        """In-process reached `rate` batches/s: a probe, or the rest of an epoch after its probe
        (which, as the workers' rate, pays for what the first batches do not: images' probes
        said 1350-1700 batches/s where whole in-process runs made 1243, so workers at 1650 kept
        losing to them and went back in-process every other epoch)."""
        self._inprocess_rates.append(rate)

    def handed_back(self, rate: float) -> None:
        """Workers at `rate` batches/s lost to in-process: the epoch goes on in-process."""
        self._engine_rate, self._lost, self.settled = rate, True, None
        self.schedule.reset()
        self._backoff = min(max(1, self._backoff * 2), MAX_INPROCESS_EPOCHS)
        self._inprocess_epochs = self._backoff

    def window(self, k: int, per_worker: int | None = None) -> int:
        per = self.per_worker if per_worker is None else per_worker
        return max(1, per * k) if self.auto_window else self.fixed_window

    def choose(self, epoch: int, loads: list[int], steps: list[int], step_cpus: list[int],
               others_busy: float = 0.0, batch_bytes: int = 0) -> int:
        """The worker count for the rest of epoch `epoch`, from the probe's measurements (ns), the
        cores other processes kept busy meanwhile and the bytes of one batch."""
        load = statistics.median(loads[1:] or loads)
        step = statistics.median(steps) if steps else 0.0
        step_cpu = min(statistics.median(step_cpus), step) if step_cpus else 0.0
        online = max(os.cpu_count() or 1, self.cores)
        free = max(1.0, min(float(self.cores), online - others_busy))
        predicted = {k: predict_ns(k, load, step, step_cpu, free, batch_bytes)
                     for k in range(self.max_workers + 1)}
        rate = probe_rate(loads, steps)
        kept_rate = self._inprocess_rate
        # A probe well below the last ones (a hiccup: tabular-getitems' 0.24 ms a batch where the
        # others took 0.097) does not send workers to be measured as a close call.
        slowed = rate is not None and kept_rate is not None and rate < kept_rate * (1 - SLOWED_PROBE)
        workers, reason = self._pick(predicted, slowed,
                                     lambda k: optimistic_ns(k, load, step, step_cpu, free))
        self._fold_engine_rate()
        measured_rate, lost = self._measured, self._lost
        inprocess_before, self._lost = kept_rate, False
        if rate is not None:
            self.inprocess_measured(rate)
        if workers and self._inprocess_epochs > 0:
            self._inprocess_epochs -= 1
            detail = (f" ({measured_rate:.0f} vs {inprocess_before or 0:.0f} batches/s)"
                      if lost and measured_rate is not None else "")
            reason = (f"workers lost to in-process in an earlier epoch{detail}: in-process for this and "
                      f"{self._inprocess_epochs} more epoch(s) "
                      f"(the model predicted {count(workers, 'worker')})")
            workers = 0
        elif workers and measured_rate is not None and self._inprocess_rate is not None \
                and measured_rate < self._inprocess_rate * (1 - TRY_GAIN):
            # A loss as a hand-back is one: the same wait before workers are tried again.
            self._backoff = min(max(1, self._backoff * 2), MAX_INPROCESS_EPOCHS)
            self._inprocess_epochs = self._backoff - 1   # this epoch is the first of them
            reason = (f"the last epoch's workers reached {measured_rate:.0f} batches/s, in-process "
                      f"{self._inprocess_rate:.0f}: in-process for this and {self._inprocess_epochs} more "
                      f"epoch(s) (the model predicted {count(workers, 'worker')})")
            workers = 0
        if workers and self.settled is not None and self.settled[0] != workers:
            reason += (f"; starting where the last epoch's adjustments settled: "
                       f"{count(self.settled[0], 'worker')}")
            workers = self.settled[0]
        if not workers:
            self.settled = None
        # Workers clearly slower by the model: the next epochs skip their probe a while.
        fastest = min((predicted[k] for k in range(1, self.max_workers + 1)), default=float("inf"))
        clear = not workers and fastest > predicted[0] * (1 + CLOSE_CALL)
        self._probe_due_ns = self.clock() + int(REPROBE_S * 1e9) if clear else 0
        self.schedule.reset()   # a fresh probe: the climb starts over
        self.choices.append(Choice(epoch, workers, load / 1e6, step / 1e6, step_cpu / 1e6, self.cores,
                                   round(free, 2), {k: v / 1e6 for k, v in predicted.items()}, reason,
                                   round(batch_bytes / 1e6, 3)))
        self.counts["auto_workers"] = workers
        self.counts["auto_window"] = self.window(workers) if workers else 0
        self._measured = None   # used
        return workers

    def _pick(self, predicted: dict[int, float], slowed: bool,
              optimistic: Callable[[int], float]) -> tuple[int, str]:
        """The model's pick (workers, why) from its predictions (ns per batch for 0..max_workers)."""
        best = min(range(1, self.max_workers + 1), key=lambda k: (predicted[k], k), default=0)
        if not best:
            return 0, "no worker allowed"
        # The fewest workers within 3% of the best prediction: more would only burn cores.
        fewest = min(k for k in range(1, self.max_workers + 1) if predicted[k] <= predicted[best] * 1.03)
        inprocess = predicted[0]
        versus = f"{predicted[fewest] / 1e6:.3f} ms/batch vs {inprocess / 1e6:.3f} in-process"
        if predicted[best] <= inprocess * (1 - WORKERS_MARGIN):
            return fewest, f"{count(fewest, 'worker')} predicted {versus}"
        if predicted[best] <= inprocess * (1 + CLOSE_CALL) and not slowed and \
                optimistic(best) < inprocess * (1 - WORKERS_MARGIN):
            # Workers would win but for the costs the model only estimates, which are as large as
            # their gain (images, 2 cores: 2 workers predicted 1.25x slower than in-process with
            # the earlier estimates, measured 1.37x faster over 2 s runs).  They are measured: from
            # the next epoch on, the measurement decides (losing workers back off as in choose).
            return fewest, f"a close call, measured: {count(fewest, 'worker')} predicted {versus}"
        return 0, (f"in-process is as fast: {count(best, 'worker')} predicted {predicted[best] / 1e6:.3f} "
                   f"ms/batch vs {inprocess / 1e6:.3f} in-process")

    def changed(self, epoch: int, taken: int, before: tuple[int, int], after: tuple[int, int],
                why: str) -> None:
        """The climb kept `after` (workers, tasks per worker) in place of `before`."""
        self.changes.append((epoch, taken, before[0], after[0], why))
        self.settled, self.per_worker = (after if after[0] else None), after[1]
        self.schedule.kept()
        self.counts["auto_workers"] = after[0]
        self.counts["auto_window"] = self.window(*after)
        self.counts["auto_changes"] += 1

    def probe_skipped(self) -> bool:
        """Whether an epoch starting now stays in-process without a probe (the last one found
        workers clearly slower, less than REPROBE_S ago)."""
        return self.clock() < self._probe_due_ns

    def unprobed_epoch(self) -> None:
        """An epoch starts in-process without a probe (probe_skipped)."""
        self._unprobed_epochs += 1

    def unprobed_run(self, rate: float) -> None:
        """An epoch that skipped its probe ran in-process at `rate` batches/s: one far below the
        in-process rates kept (dearer samples, a busier machine) makes the next epoch probe."""
        kept = self._inprocess_rate
        if kept is not None and rate < kept * (1 - SLOWED_PROBE):
            self._probe_due_ns = 0
        self.inprocess_measured(rate)

    def resume_workers(self) -> int:
        """Workers to start an epoch with, without a probe: where the last epoch's climb settled,
        when its workers beat the in-process rates (at least RESUME_INPROCESS_RATES of them, or
        fewer for RESUMES_ON_ONE_RATE epochs); else 0 (probe first)."""
        self._fold_engine_rate()
        measured = self._measured
        thin = len(self._inprocess_rates) < RESUME_INPROCESS_RATES
        if self.settled is None or measured is None or self._inprocess_rate is None \
                or (thin and self._thin_resumes >= RESUMES_ON_ONE_RATE) \
                or measured < self._inprocess_rate * (1 + TRY_GAIN):
            return 0   # the probe's choice weighs the measurement
        self._thin_resumes += thin
        self._backoff = 0   # workers won
        workers = self.settled[0]
        self.counts["auto_workers"], self.counts["auto_window"] = workers, self.window(*self.settled)
        self._measured = None   # used
        return workers

    def _fold_engine_rate(self) -> None:
        """The last epoch's rate on workers (if it measured one) joins the last ENGINE_RATES_KEPT
        epochs': their upper median is what in-process is compared with until a choice uses it
        (an engine phase of 30 ms varies by 20%: tabular's workers, 1.5x in-process, lost one
        epoch in three to it and went back in-process)."""
        if self._engine_rate is not None:
            self._engine_rates.append(self._engine_rate)
            self._measured = statistics.median_high(self._engine_rates)
            self._engine_rate = None

    def losing_to_inprocess(self, rate: float) -> bool:
        """Whether workers at `rate` batches/s lose to this epoch's in-process probe."""
        return self._inprocess_rate is not None and rate < self._inprocess_rate * (1 - TRY_GAIN)

    def engine_rate(self, rate: float) -> None:
        """The throughput the workers reached at their settled count (the best window of the epoch)."""
        self._engine_rate = rate if self._engine_rate is None else max(self._engine_rate, rate)

    def report(self) -> dict[str, Any]:
        """What was chosen and why (``loader.autotune``)."""
        last = self.choices[-1] if self.choices else None
        return {"workers": self.counts["auto_workers"], "window": self.counts["auto_window"],
                "max_workers": self.max_workers, "cores": self.cores,
                "last_choice": last.__dict__ if last is not None else None,
                # (epoch, workers) chosen at each epoch's start that probed
                "choices": [(c.epoch, c.workers) for c in self.choices],
                "epochs_without_probe": self._unprobed_epochs,
                "changes": list(self.changes)}




class Adjustable(Protocol):
    """What the climb adjusts: the engine's workers taking tasks and its window."""

    def set_active(self, workers: int, window: int) -> None: ...


class Climb:
    """An epoch's climb on the engine, from the setting it started on: the verdict on each
    window's throughput (the producer measures it), the tries of a neighbouring setting and
    their verdicts, and the hand-back to in-process when the workers lose to it.

    Its state changes and the engine's adjustments come in the order that keeps a window
    judged again, never lost, where an exception (a signal handler's) lands between two of
    them (see judge_try)."""

    def __init__(self, tuner: AutoTuner, epoch: int, settled: tuple[int, int]):
        self.tuner = tuner
        self.epoch = epoch
        self.settled = settled      # (workers, tasks per worker) in force, unless a try runs
        self.trying: tuple[int, int] | None = None
        # The current window holds a switch of setting (the engine's start, a try's, an undone
        # try's): it mixes two settings' pipelines and gets no verdict.
        self.switched = True        # the first window fills the pipeline
        self.windows = 0
        self.cold = False           # persistent workers started in this epoch: their start is not their pace
        self.rates: deque[float] = deque(maxlen=SETTLED_WINDOWS)   # the settled setting's, since its switch
        self.verdicts: list[float] = []   # the try's windows after its switch
        self.losing = 0             # settled windows in a row below the in-process rate

    def judge(self, rate: float, engine: Adjustable, taken: int, room: Callable[[], bool]) -> bool:
        """A window ran at `rate` batches/s (`taken`: the epoch's batches so far; `room()`: whether
        the epoch has batches enough left for a try's verdict).  True where the workers lost to
        in-process: the caller stops dispatching more to them, then calls hand_back."""
        self.windows += 1
        switched, self.switched = self.switched, False
        if self.trying is not None:
            self.judge_try(rate, switched, engine, taken)
            return False
        if switched:
            return False
        self.rates.append(rate)
        tuner = self.tuner
        if not self.cold:   # (what the next epoch compares: see AutoBatches._rate_without_verdict)
            tuner.engine_rate(rate)
        # One slow window is not a loss (a wake-up missed, another program's burst): two in a row are.
        self.losing = self.losing + 1 if tuner.losing_to_inprocess(rate) else 0
        if self.losing >= LOSING_WINDOWS:
            return True
        # A try the epoch's end would cut short gets no verdict: none starts there.
        if not tuner.schedule.due(room=room()):
            return False
        neighbours = self.neighbours()
        if neighbours:
            self.trying = neighbours[tuner.schedule.turn % len(neighbours)]
            tuner.schedule.turn += 1
            self.switched, self.verdicts = True, []
            engine.set_active(self.trying[0], tuner.window(*self.trying))
        return False

    def hand_back(self, rate: float, engine: Adjustable, taken: int) -> None:
        """The workers at `rate` lost (judge said so): nothing more is dispatched to them; what
        was is taken first."""
        tuner = self.tuner
        tuner.changed(self.epoch, taken, self.settled, (0, self.settled[1]),
                      f"workers reached {rate:.0f} batches/s, below in-process: back to in-process")
        tuner.handed_back(rate)
        engine.set_active(0, 1)

    def judge_try(self, rate: float, switched: bool, engine: Adjustable, taken: int) -> None:
        """The verdict on the try in force, from the window just ended (`switched`: the try's own
        switch), against the settled setting's recent windows.  The switch's window flatters a
        try toward less (a retired worker still answers the tasks it holds, a smaller window
        still drains the larger one's) and penalises one toward more (a new worker's pipeline
        fills): it drifted augment from 2 workers to 1.  So the verdict is on the
        VERDICT_WINDOWS after it (one window of 8 batches varies by 15% here: jpeg kept a
        window 0.93x as fast), unless a try loses by TRY_UNDO_LOSS where it is not flattered."""
        tried, settled, tuner = self.trying, self.settled, self.tuner
        assert tried is not None
        base = statistics.fmean(self.rates)
        hopeless = rate < base * (1 - TRY_UNDO_LOSS)
        # (A neighbour differs from the settled setting in one of the two: tuples compare as "less".)
        if switched and not (hopeless and tried < settled):
            return
        if not switched:
            self.verdicts.append(rate)
            if not hopeless and len(self.verdicts) < VERDICT_WINDOWS:
                return
        # The calls first, `trying` cleared last in plain stores: an exception a signal handler
        # raises in between leaves the try to be judged again at the next window.
        verdict = statistics.fmean(self.verdicts) if not hopeless else 0.0   # (all of them are in)
        if verdict > base * (1 + TRY_GAIN):
            tuner.changed(self.epoch, taken, settled, tried,
                          f"{count(tried[0], 'worker')}, window {tuner.window(*tried)}: {verdict:.0f} "
                          f"batches/s vs {base:.0f}")
            tuner.engine_rate(verdict)
            rates = deque(self.verdicts, maxlen=SETTLED_WINDOWS)
            self.settled, self.rates, self.trying = tried, rates, None
            return
        engine.set_active(settled[0], tuner.window(*settled))
        tuner.schedule.undone()
        self.switched, self.trying = True, None   # the settled setting's pipeline refills

    def neighbours(self) -> list[tuple[int, int]]:
        """The settings one step from the settled one: (prefetch="auto") twice or half the tasks
        per worker, and a worker more or fewer, in the order the model ranks them (a window's
        change, which it does not see, ranks as the settled count).  A short run thus tries the
        likeliest first: on 2 cores, a worker fewer than 2 (predicted twice as slow on decode-bound
        data) was the first try, and the dearest."""
        k, per = self.settled
        tuner = self.tuner
        if not k:
            return []   # (in-process: no window to move)
        out = []
        if tuner.auto_window:
            i = PER_WORKER_CHOICES.index(per) if per in PER_WORKER_CHOICES else 1
            out += [(k, PER_WORKER_CHOICES[j]) for j in (i + 1, i - 1) if 0 <= j < len(PER_WORKER_CHOICES)]
        out += [(w, per) for w in (k + 1, k - 1) if 1 <= w <= tuner.max_workers]
        predicted = tuner.choices[-1].predicted_ms if tuner.choices else {}
        return sorted(out, key=lambda setting: predicted.get(setting[0], 0.0))

    def cut_short(self) -> None:
        """The epoch ended (a window longer than its batches, a break): a try in force counts
        as one that did not pay."""
        if self.trying is not None:
            self.trying = None
            self.tuner.schedule.undone()
