"""``num_workers="auto"``: the loader picks its worker count and window, and
keeps adjusting them while the epoch runs.

An epoch starts in the training loop's thread: its first batches (at least
PROBE_BATCHES and PROBE_MIN_S, at most PROBE_MAX_BATCHES) are loaded
in-process (they are the epoch's own first batches, not extra work) while the
tuner measures what one batch costs to load (fetch and collate: L), how long
the loop's step between two ``next()`` calls takes (S), how much of that step
is CPU time of the loop's own thread (S_cpu), and how many cores this process
may use (affinity and cgroup quota) less those other processes kept busy
meanwhile (/proc/stat): C.  A model
(`predict_ns`) gives the time per batch with k workers; the tuner takes the
fastest k, 0 included, asking a worker count to beat in-process loading by
WORKERS_MARGIN (the model does not see page faults or wake-ups); where only
the per-batch costs it estimates make workers lose, by at most CLOSE_CALL,
it measures them instead.  From the
second epoch on, the throughput the workers really reached (an epoch's best
window, or its whole engine phase where it ended before a window's verdict;
not the epoch that started persistent workers, which measured their start; the
upper median of the last ENGINE_RATES_KEPT epochs') is compared with
in-process's (the upper median of the last INPROCESS_RATES_KEPT measured:
probes, and the runs of epochs that stayed in-process after theirs): a machine
where workers lose gets 0 for the next 1, 2, 4 ... up to MAX_INPROCESS_EPOCHS
epochs; one where they win starts the next epoch on them, without a probe (once
in-process was measured RESUME_INPROCESS_RATES times, or for RESUMES_ON_ONE_RATE epochs
on fewer: a run's first probe is cold).
Where a probe found workers clearly slower (beyond CLOSE_CALL), the epochs of the
next REPROBE_S stay in-process without one and time their whole run instead; one
that runs SLOWED_PROBE below the kept in-process rate makes the next epoch probe.

With k >= 1 the rest of the epoch runs on the engine, whose `max_workers`
processes exist but only k take tasks; the window (``prefetch="auto"``)
starts at WINDOW_PER_WORKER tasks per worker taking tasks.  Every window of
WINDOW_BATCHES batches and WINDOW_MIN_S the tuner measures the loop's throughput and, every
few windows, tries a neighbour, in turn: one worker more, one
fewer, twice the tasks per worker, half.  A window that holds a switch (the
engine's start, a try's, an undone try's) mixes two settings' pipelines and
gets no verdict; a try is judged on the VERDICT_WINDOWS after its switch,
against the settled setting's last SETTLED_WINDOWS: kept if it was faster by
TRY_GAIN, else undone, and the next try waits twice as long (up
to MAX_TRY_EVERY windows; a kept change resets it).  That schedule is the
tuner's, not the epoch's: a setting whose tries did not pay is not tried again
at every epoch's start.  A try TRY_UNDO_LOSS slower than the settled rate in
a window that does not flatter it is undone at once (the switch's window
flatters a try toward less: a worker fewer, a smaller window).  Workers hand the epoch back to in-process
after LOSING_WINDOWS settled windows in a row below the probe's rate.  What
the climb settled on carries over
to the next epoch when the probe agrees that workers are worth it.  A
retired worker takes no new task; the tasks it holds are delivered as usual,
so no batch is lost, repeated or reordered, and which worker loads a batch
never changes what it holds (``sample_rng`` is keyed by seed, epoch and
sample, not by worker).
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._cpus import machine_busy_s, own_cpu_s
from .._words import count
from .results import CLOSED_BY_OTHER, Marker

if TYPE_CHECKING:
    from ..profiler import Profiler
    from .engine import Engine
    from .epoch import EpochPlan, InProcessBatches

PROBE_BATCHES = 4            # loaded in-process at an epoch's start (the first one is a warm-up) ...
PROBE_MIN_S = 0.05           # ... for at least this long (/proc/stat counts in 10 ms ticks) ...
PROBE_MAX_BATCHES = 64       # ... and at most this many
MIN_ENGINE_BATCHES = 16      # fewer left after the probe: the epoch stays in-process
WINDOW_BATCHES = 8           # a throughput measurement spans at least this many batches ...
WINDOW_MIN_S = 0.03          # ... and this long (an epoch of fast batches must still reach a verdict)
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
MAIN_OVERHEAD_NS = 60_000    # the loop's own CPU per batch with workers (bench/main_cpu.py: 29-51 us)
# What a worker pays per batch beyond loading it in-process: its copy into shared memory (page
# faults on the slab included), the messages and wake-ups.  bench/autotune.py's sweep, 2 cores,
# runs of 2 s (2026-12-06; the 300-batch runs of 0.2-0.4 s before charged the workers' start to
# every batch): 2 workers' time per batch, less half the in-process load, came to 0.14-0.28 ms
# for the 1 MB batches of tabular, tabular-getitems and dict16 and 0.40 ms for 9.6 MB of images.
WORKER_BATCH_NS = 200_000
WORKER_NS_PER_BYTE = 0.025
MAX_AUTO_WORKERS = 16
MAX_INPROCESS_EPOCHS = 8     # after workers lost to in-process, epochs before trying them again (at most)
INPROCESS_RATES_KEPT = 5     # workers are compared with the last this many in-process rates measured
ENGINE_RATES_KEPT = 3        # ... by the rates of the last this many epochs on workers
# In-process rates measured before workers that beat them start an epoch without a probe: a run's
# first probe alone (cold: page faults, caches) kept workers at 0.94x of in-process a whole run.
# On fewer, this many epochs still resume (a probe at once cost two-epoch runs of augment and jpeg
# 5-10%), then one probes.
RESUME_INPROCESS_RATES = 2
RESUMES_ON_ONE_RATE = 1


def worker_cost_ns(batch_bytes: int) -> float:
    """A worker's cost per batch beyond the load itself (WORKER_BATCH_NS)."""
    return WORKER_BATCH_NS + WORKER_NS_PER_BYTE * batch_bytes


def predict_ns(k: int, load_ns: float, step_ns: float, step_cpu_ns: float, cores: float,
               batch_bytes: int = 0) -> float:
    """Predicted time per batch with k workers: in-process, the step and the
    load add up; with workers, a batch takes the longest of the loop's own
    path (step plus its per-batch overhead), the workers' share of the load
    and of their own per-batch cost, and the CPU time of all of it spread over
    the usable cores."""
    if k == 0:
        return step_ns + load_ns
    loop = step_ns + MAIN_OVERHEAD_NS
    work = load_ns + worker_cost_ns(batch_bytes)
    return max(loop, work / k, (step_cpu_ns + MAIN_OVERHEAD_NS + work) / cores)


def optimistic_ns(k: int, load_ns: float, step_ns: float, step_cpu_ns: float, cores: float) -> float:
    """predict_ns without the costs the model only estimates (the loop's and the workers' own per
    batch): where even this does not beat in-process, k workers cannot."""
    if k == 0:
        return step_ns + load_ns
    return max(step_ns, load_ns / k, (step_cpu_ns + load_ns) / cores)


def probe_rate(loads: list[int], steps: list[int]) -> float | None:
    """A probe's own throughput (batches/s): every batch after the warm-up, slow ones included (a
    page fault or a collection in-process is the in-process rate's too)."""
    measured = loads[1:] or loads
    total_ns = sum(measured) + sum(steps[-len(measured):])
    return len(measured) * 1e9 / total_ns if total_ns > 0 else None


def batch_nbytes(batch: Any) -> int:
    """Bytes of the arrays in a batch (tuples, lists and dicts of them)."""
    if isinstance(batch, (tuple, list)):
        return sum(batch_nbytes(b) for b in batch)
    if isinstance(batch, dict):
        return sum(batch_nbytes(b) for b in batch.values())
    return int(getattr(batch, "nbytes", 0))


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
    probe_s: float = PROBE_MIN_S   # how long the last probe took
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
        self._probe_due_ns = time.perf_counter_ns() + int(REPROBE_S * 1e9) if clear else 0
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
        return time.perf_counter_ns() < self._probe_due_ns

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


class AutoBatches:
    """An epoch's producer with ``num_workers="auto"``: the probe in-process,
    then in-process or the engine, the adjustments, and the way back to
    in-process when the workers lose to it (see the module's text).

    Every switch happens at the start of a next_batch() call, when the
    epoch's ready slot is empty: a batch an exception kept there is never
    looked for in a producer that did not make it."""

    def __init__(self, tuner: AutoTuner, epoch: int, plan: EpochPlan,
                 make_inprocess: Callable[[EpochPlan], InProcessBatches],
                 start_engine: Callable[[EpochPlan, int, Callable[[Any], None]], bool],
                 profiler: Profiler | None, persistent: bool):
        assert plan.supply is not None
        self.profiler = profiler
        self._tuner = tuner
        self._epoch = epoch
        self._plan = plan
        self._supply = plan.supply   # every producer of the epoch draws from it in turn
        self._make_inprocess = make_inprocess
        self._inprocess = make_inprocess(plan)
        self._ended: list[Any] = []    # producers used up before the current one
        self._current: Any = self._inprocess
        self._slot: Any = self._inprocess
        self._start_engine = start_engine
        self.engine: Engine | None = None
        # Set by end(), under end_lock, which start_engine holds while it starts an engine: an
        # epoch ended from another thread (a newer iter() superseding it) starts no engine after,
        # nor adjusts one that now serves the next epoch.
        self.end_lock = threading.RLock()
        self.closed = False
        # persistent_workers, until the loader is collected (EpochIterator.release_engine_at_end).
        self.persistent = persistent
        self._loads: list[int] = []
        self._steps: list[int] = []
        self._step_cpus: list[int] = []
        self._returned_ns = 0
        self._returned_cpu_ns = 0
        self._batch_bytes = 0           # of the probe's first batch
        self._probe_start: tuple[int, float | None, float] = (0, None, 0.0)
        resume = tuner.resume_workers()
        length = plan.supply.length   # (None: an infinite sampler, or one without len())
        long_enough = length is None or length > PROBE_BATCHES + MIN_ENGINE_BATCHES
        # Long enough for a probe but without one: the last probe found in-process clearly faster.
        self._unprobed = long_enough and not resume and tuner.probe_skipped()
        if self._unprobed:
            tuner._unprobed_epochs += 1
        self._probing = long_enough and not resume and not self._unprobed
        self._switch_to = resume if long_enough else 0   # workers to start at the next call
        self._taken = 0
        self._draining = False         # back to in-process once the engine's dispatched batches are taken
        # In-process after the probe: from when (ns; -1: from the first batch, where there is no
        # probe), how many batches, the latest handed out when.
        self._inprocess_from = -1 if self._unprobed else 0
        self._inprocess_taken = 0
        self._inprocess_last_ns = 0
        # The climb on the engine.
        self._window_start = 0
        self._window_count = 0
        self._engine_from = (0, 0)      # (ns, batches taken) when the engine took over
        self._engine_last_ns = 0       # when the engine's latest batch was handed out
        self._cold_workers = False     # the engine's persistent workers started in this epoch
        self._windows = 0
        self._settled = (0, tuner.per_worker)   # (workers, tasks per worker) in force, unless a try runs
        self._trying: tuple[int, int] | None = None
        # The current window holds a switch of setting (the engine's start, a try's, an undone
        # try's): it mixes two settings' pipelines and gets no verdict.
        self._switched = False
        self._rates: deque[float] = deque(maxlen=SETTLED_WINDOWS)   # the settled setting's, since its switch
        self._verdicts: list[float] = []   # the try's windows after its switch
        self._losing = 0               # settled windows in a row below the in-process rate

    # The slot where the batch being handed out stays (EpochIterator._next): the current
    # producer's (an engine's is its window's).
    @property
    def ready(self) -> tuple[int, Any] | None:
        return self._slot.ready  # type: ignore[no-any-return]

    @ready.setter
    def ready(self, value: tuple[int, Any] | None) -> None:
        self._slot.ready = value

    @property
    def total_batches(self) -> int | None:
        return self._supply.length

    def next_batch(self) -> tuple[int, Any] | Marker:
        if self.closed:
            return CLOSED_BY_OTHER   # ended by another thread since its iterator's check
        if self._switch_to:
            if not self._to_engine():
                return CLOSED_BY_OTHER
        elif self._draining and self._engine_drained():
            self._to_inprocess()
        if self._probing:
            return self._probe()
        got = self._current.next_batch()
        if self.engine is None:
            if type(got) is tuple:
                now = time.perf_counter_ns()
                if self._inprocess_from >= 0:
                    self._inprocess_taken += 1
                else:   # an epoch without a probe: its run is timed from its first batch on
                    self._inprocess_from = now
                self._inprocess_last_ns = now
        elif self._current is not self._inprocess and type(got) is tuple:
            self._taken += 1
            self._window_count += 1
            self._engine_last_ns = time.perf_counter_ns()
            if self._window_count >= WINDOW_BATCHES and not self._draining \
                    and time.perf_counter_ns() - self._window_start >= WINDOW_MIN_S * 1e9:
                self._window_done()
        return got  # type: ignore[no-any-return]

    def _probe(self) -> tuple[int, Any] | Marker:
        # The step's CPU time on its first PROBE_BATCHES only: thread_time_ns is a system call
        # (2 us a call on this VM, 4% of tabular-getitems' 0.09 ms batches when on every one).
        timing_cpu = len(self._loads) <= PROBE_BATCHES
        called_ns, called_cpu_ns = time.perf_counter_ns(), time.thread_time_ns() if timing_cpu else 0
        if not self._loads:
            # /proc/stat costs 0.1 ms a read: not read where the last probe was too short to use it.
            busy = machine_busy_s() if self._tuner.probe_s >= PROBE_MIN_S else None
            self._probe_start = (called_ns, busy, own_cpu_s())
        if self._returned_ns:
            self._steps.append(called_ns - self._returned_ns)
            if timing_cpu:
                self._step_cpus.append(called_cpu_ns - self._returned_cpu_ns)
        got = self._inprocess.next_batch()
        self._returned_ns = time.perf_counter_ns()
        self._loads.append(self._returned_ns - called_ns)
        if timing_cpu:
            self._returned_cpu_ns = time.thread_time_ns()
        if type(got) is tuple:
            self._taken += 1
            if not self._batch_bytes:
                self._batch_bytes = batch_nbytes(got[1])
        n = len(self._loads)
        length = self._supply.length
        if n >= PROBE_MAX_BATCHES or (length is not None and n >= length // 4) or (
                n >= PROBE_BATCHES and self._returned_ns - self._probe_start[0] >= PROBE_MIN_S * 1e9):
            self._probing = False
            self._inprocess_from = self._returned_ns
            self._switch_to = self._tuner.choose(self._epoch, self._loads, self._steps, self._step_cpus,
                                                 self._others_busy(), self._batch_bytes)
        return got

    def _others_busy(self) -> float:
        """Cores other processes kept busy during the probe (0 where /proc/stat is missing).  A
        probe shorter than PROBE_MIN_S (a quarter of a short epoch of fast batches: 2.4 ms for
        tabular-getitems) is too short for /proc/stat's 10 ms ticks, where one tick read as 4
        cores busy: the last probe long enough to tell is taken instead."""
        start_ns, busy0, own0 = self._probe_start
        wall = (time.perf_counter_ns() - start_ns) / 1e9
        tuner = self._tuner
        tuner.probe_s = wall
        busy = machine_busy_s() if wall >= PROBE_MIN_S and busy0 is not None else None
        if busy is None or busy0 is None:
            return tuner.others_busy
        tuner.others_busy = max(0.0, ((busy - busy0) - (own_cpu_s() - own0)) / wall)
        return tuner.others_busy

    def _to_engine(self) -> bool:
        """Start the rest of the epoch on the engine with `_switch_to` workers taking tasks;
        False if the epoch was ended meanwhile (by another thread)."""
        workers, self._switch_to = self._switch_to, 0
        rest = self._plan   # its supply goes on from the first batch in-process did not hand out
        self._ended.append(self._inprocess)
        # The climb's state first: a Ctrl-C deferred while the engine starts is raised out of
        # _start_engine, after the engine was adopted, and the epoch may go on.
        self._settled = self._tuner.settled = (workers, self._tuner.per_worker)
        self._window_count = self._windows = 0
        self._switched = True   # the first window fills the pipeline
        self._window_start = time.perf_counter_ns()
        self._engine_from = (self._window_start, self._taken)
        if not self._start_engine(rest, workers, self._adopt):
            return False
        # The windows start once the engine has (the workers' start is not their throughput).
        self._window_start = time.perf_counter_ns()
        self._engine_from = (self._window_start, self._taken)
        return True

    def _adopt(self, producer: Any) -> None:
        """The engine's producer, taken before a Ctrl-C deferred while it started is raised.
        Plain stores (no signal handler runs between them), `adopted` last: an exception that
        lands before it leaves the epoch in-process and the engine ended."""
        self.engine, self._current, self._slot, producer.adopted = \
            producer.engine, producer, producer.engine.window, True
        # Persistent workers this epoch started: their start is not their pace.
        self._cold_workers = self.persistent and producer.engine.counts["epochs"] <= 1

    def _engine_drained(self) -> bool:
        """Every task sent to the workers has its batch taken (the engine's own count, which a
        signal handler's exception cannot make wrong)."""
        assert self.engine is not None
        taken, dispatched = self.engine.progress()
        return taken >= dispatched

    def _to_inprocess(self) -> None:
        """The engine's batches are all taken: the rest of the epoch in-process."""
        self._draining = False
        rest = self._plan   # its supply goes on from the first batch the engine did not dispatch
        engine_producer = self._current
        engine_producer.persistent = self.persistent
        self._ended.append(engine_producer)
        self._inprocess = self._make_inprocess(rest)
        self._current = self._slot = self._inprocess
        engine_producer.end(False)   # ends a non-persistent engine's workers now

    def _window_done(self) -> None:
        with self.end_lock:   # it adjusts the engine, which a newer epoch may serve once this one ended
            if not self.closed:
                self._judge_window()

    def _judge_window(self) -> None:
        now = time.perf_counter_ns()
        rate = self._window_count * 1e9 / max(now - self._window_start, 1)
        self._window_start, self._window_count = now, 0
        self._windows += 1
        switched, self._switched = self._switched, False
        if self._trying is not None:
            self._judge_try(rate, switched)
            return
        if switched:
            return
        self._rates.append(rate)
        tuner, engine = self._tuner, self.engine
        assert engine is not None
        if not self._cold_workers:   # (what the next epoch compares: see _rate_without_verdict)
            tuner.engine_rate(rate)
        # One slow window is not a loss (a wake-up missed, another program's burst): two in a row are.
        self._losing = self._losing + 1 if tuner.losing_to_inprocess(rate) else 0
        if self._losing >= LOSING_WINDOWS:
            # Draining first: were the workers retired and an exception (a signal handler's) to
            # land before it, nothing would dispatch the epoch's rest.
            self._draining = True
            tuner.changed(self._epoch, self._taken, self._settled, (0, self._settled[1]),
                          f"workers reached {rate:.0f} batches/s, below in-process: back to in-process")
            tuner.handed_back(rate)
            engine.set_active(0, 1)   # nothing more is dispatched; what was is taken first
            return
        # A try the epoch's end would cut short gets no verdict: none starts there.
        if not tuner.schedule.due(room=self._batches_left() >= (VERDICT_WINDOWS + 1) * WINDOW_BATCHES):
            return
        neighbours = self._neighbours()
        if neighbours:
            self._trying = neighbours[tuner.schedule.turn % len(neighbours)]
            tuner.schedule.turn += 1
            self._switched, self._verdicts = True, []
            engine.set_active(self._trying[0], tuner.window(*self._trying))

    def _judge_try(self, rate: float, switched: bool) -> None:
        """The verdict on the try in force, from the window just ended (`switched`: the try's own
        switch), against the settled setting's recent windows.  The switch's window flatters a
        try toward less (a retired worker still answers the tasks it holds, a smaller window
        still drains the larger one's) and penalises one toward more (a new worker's pipeline
        fills): it drifted augment from 2 workers to 1.  So the verdict is on the
        VERDICT_WINDOWS after it (one window of 8 batches varies by 15% here: jpeg kept a
        window 0.93x as fast), unless a try loses by TRY_UNDO_LOSS where it is not flattered."""
        tried, settled, tuner, engine = self._trying, self._settled, self._tuner, self.engine
        assert tried is not None and engine is not None
        base = statistics.fmean(self._rates)
        hopeless = rate < base * (1 - TRY_UNDO_LOSS)
        # (A neighbour differs from the settled setting in one of the two: tuples compare as "less".)
        if switched and not (hopeless and tried < settled):
            return
        if not switched:
            self._verdicts.append(rate)
            if not hopeless and len(self._verdicts) < VERDICT_WINDOWS:
                return
        # The calls first, `_trying` cleared last in plain stores: an exception a signal handler
        # raises in between leaves the try to be judged again at the next window.
        verdict = statistics.fmean(self._verdicts) if not hopeless else 0.0   # (all of them are in)
        if verdict > base * (1 + TRY_GAIN):
            tuner.changed(self._epoch, self._taken, settled, tried,
                          f"{count(tried[0], 'worker')}, window {tuner.window(*tried)}: {verdict:.0f} "
                          f"batches/s vs {base:.0f}")
            tuner.engine_rate(verdict)
            rates = deque(self._verdicts, maxlen=SETTLED_WINDOWS)
            self._settled, self._rates, self._trying = tried, rates, None
            return
        engine.set_active(settled[0], tuner.window(*settled))
        tuner.schedule.undone()
        self._switched, self._trying = True, None   # the settled setting's pipeline refills

    def _neighbours(self) -> list[tuple[int, int]]:
        """The settings one step from the settled one: (prefetch="auto") twice or half the tasks
        per worker, and a worker more or fewer, in the order the model ranks them (a window's
        change, which it does not see, ranks as the settled count).  A short run thus tries the
        likeliest first: on 2 cores, a worker fewer than 2 (predicted twice as slow on decode-bound
        data) was the first try, and the dearest."""
        k, per = self._settled
        tuner = self._tuner
        if not k:
            return []   # (in-process: no window to move)
        out = []
        if tuner.auto_window:
            i = PER_WORKER_CHOICES.index(per) if per in PER_WORKER_CHOICES else 1
            out += [(k, PER_WORKER_CHOICES[j]) for j in (i + 1, i - 1) if 0 <= j < len(PER_WORKER_CHOICES)]
        out += [(w, per) for w in (k + 1, k - 1) if 1 <= w <= tuner.max_workers]
        predicted = tuner.choices[-1].predicted_ms if tuner.choices else {}
        return sorted(out, key=lambda setting: predicted.get(setting[0], 0.0))

    def ended_by(self, error: BaseException) -> str | None:
        return self._current.ended_by(error)  # type: ignore[no-any-return]

    def _rate_without_verdict(self) -> None:
        """An epoch that ended on the engine before two windows (the first only fills the
        pipeline) still tells the next epoch what the workers reached: every batch the engine
        handed out over the time it took, pipeline fill included (a verdict the next probe acts
        on, where otherwise short epochs of fast batches never get one).  Not where the
        epoch started persistent workers: that rate is their start (images, dict16: cold workers
        measured below in-process sent the next epoch back in-process), and the next epoch
        measures them warm; workers that end with the epoch pay their start every epoch."""
        start_ns, taken0 = self._engine_from
        taken = self._taken - taken0
        if self.engine is None or self._windows >= 2 or self._draining or taken < WINDOW_BATCHES \
                or self._cold_workers:
            return
        self._tuner.engine_rate(taken * 1e9 / max(self._engine_last_ns - start_ns, 1))

    def _batches_left(self) -> int:
        """The epoch's batches the engine has yet to hand out, as far as known (an infinite
        sampler's: as many as there can be)."""
        assert self.engine is not None
        taken, dispatched = self.engine.progress()
        left = self._supply.left
        return left + dispatched - taken if left is not None else sys.maxsize

    def _inprocess_run_rate(self) -> None:
        """An epoch that stayed in-process after its probe: what in-process reached over it."""
        if self.engine is None and self._inprocess_from > 0 and self._inprocess_taken >= WINDOW_BATCHES:
            span = max(self._inprocess_last_ns - self._inprocess_from, 1)
            self._inprocess_from = 0   # once
            rate = self._inprocess_taken * 1e9 / span
            if self._unprobed:
                self._tuner.unprobed_run(rate)
            else:
                self._tuner.inprocess_measured(rate)

    def end(self, release: bool) -> None:
        with self.end_lock:
            self.closed = True
            self._end(release)

    def _end(self, release: bool) -> None:
        self._rate_without_verdict()
        self._inprocess_run_rate()
        if self._trying is not None:   # cut short (a window longer than its batches, a break)
            self._trying = None
            self._tuner.schedule.undone()
        for producer in [*self._ended, self._current]:
            if producer is not self._inprocess and hasattr(producer, "persistent"):
                producer.persistent = self.persistent
            producer.end(release)
