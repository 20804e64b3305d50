"""The autotuner's producer: an epoch's batches with ``num_workers="auto"``.  It runs the
probe in-process, measures (loads, steps, their CPU time, the cores other processes keep busy,
each window's throughput on the engine), asks the policy (policy.py) what to do, and applies
it: it moves the epoch onto the engine and back, and hands the climb's adjustments to the
engine."""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..._cpus import machine_busy_s, own_cpu_s
from ..results import CLOSED_BY_OTHER, Marker
from .model import batch_nbytes
from .policy import VERDICT_WINDOWS, Adjustable, AutoTuner, Climb

if TYPE_CHECKING:
    from ...profiler import Profiler
    from ..plan import EpochPlan

PROBE_BATCHES = 4            # loaded in-process at an epoch's start (the first one is a warm-up) ...
PROBE_MIN_S = 0.05           # ... for at least this long (/proc/stat counts in 10 ms ticks) ...
PROBE_MAX_BATCHES = 64       # ... and at most this many
MIN_ENGINE_BATCHES = 16      # fewer left after the probe: the epoch stays in-process
WINDOW_BATCHES = 8           # a throughput measurement spans at least this many batches ...
WINDOW_MIN_S = 0.03          # ... and this long (an epoch of fast batches must still reach a verdict)


# What the producer reads of the producers and the engine epoch.py gives it (the epoch imports
# the producer, so the producer names none of its classes: docs/design.md, "Layers").

class Batches(Protocol):
    """A producer the epoch switches between (epoch.InProcessBatches, the engine's)."""

    def next_batch(self) -> tuple[int, Any] | Marker: ...

    def ended_by(self, error: BaseException) -> str | None: ...

    def end(self, release: bool) -> None: ...


class TunedEngine(Adjustable, Protocol):
    """The engine as the producer measures and adjusts it (engine.Engine)."""

    counts: dict[str, int]

    def progress(self) -> tuple[int, int]: ...


class EpochStarts(Protocol):
    """What an epoch's AutoBatches starts (epoch.py provides it)."""

    def inprocess(self, part: EpochPlan) -> Batches:
        """A producer of `part`'s batches in the calling thread."""

    def engine(self, auto: AutoBatches, rest: EpochPlan, workers: int, adopt: Callable[[Any], None]) -> bool:
        """Start `rest` on an engine with `workers` taking tasks, handing its producer to
        `adopt` before a Ctrl-C deferred meanwhile is raised; False if `auto` was ended meanwhile."""


class AutoBatches:
    """An epoch's producer with ``num_workers="auto"``: the probe in-process,
    then in-process or the engine, the adjustments, and the way back to
    in-process when the workers lose to it (see the module's text).

    Every producer of the epoch stores into the epoch's one Handover, and
    every switch happens at the start of a next_batch() call, when its
    `ready` slot is empty: a batch an exception kept there is returned by
    the iterator, whichever producer made it (NOTE [ Signal-safe hand-over ],
    csrc/handoff.pxi)."""

    def __init__(self, tuner: AutoTuner, epoch: int, plan: EpochPlan, starts: EpochStarts,
                 profiler: Profiler | None, persistent: bool):
        assert plan.supply is not None
        self.profiler = profiler
        self._tuner = tuner
        self._epoch = epoch
        self._plan = plan
        self._supply = plan.supply   # every producer of the epoch draws from it in turn
        self._starts = starts
        self._inprocess = starts.inprocess(plan)
        self._ended: list[Any] = []    # producers used up before the current one
        self._current: Any = self._inprocess
        self.engine: TunedEngine | None = None
        # Set by end(), under end_lock, which EpochStarts.engine holds while it starts an engine: an
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
            tuner.unprobed_epoch()
        self._probing = long_enough and not resume and not self._unprobed
        self._switch_to = resume if long_enough else 0   # workers to start at the next call
        self._taken = 0
        self._draining = False         # back to in-process once the engine's dispatched batches are taken
        # In-process after the probe: from when (ns; -1: from the first batch, where there is no
        # probe), how many batches, the latest handed out when.
        self._inprocess_from = -1 if self._unprobed else 0
        self._inprocess_taken = 0
        self._inprocess_last_ns = 0
        # The climb on the engine (the policy's), and the window it judges next.
        self.climb = Climb(tuner, epoch, (0, tuner.per_worker))
        self._window_start = 0
        self._window_count = 0
        self._engine_from = (0, 0)      # (ns, batches taken) when the engine took over
        self._engine_last_ns = 0       # when the engine's latest batch was handed out

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
            last_s = self._tuner.probe_s
            busy = machine_busy_s() if last_s is None or last_s >= PROBE_MIN_S else None
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
        # EpochStarts.engine, after the engine was adopted, and the epoch may go on.
        settled = self._tuner.settled = (workers, self._tuner.per_worker)
        self.climb = Climb(self._tuner, self._epoch, settled)
        self._window_count = 0
        self._window_start = time.perf_counter_ns()
        self._engine_from = (self._window_start, self._taken)
        if not self._starts.engine(self, rest, workers, self._adopt):
            return False
        # The windows start once the engine has (the workers' start is not their throughput).
        self._window_start = time.perf_counter_ns()
        self._engine_from = (self._window_start, self._taken)
        return True

    def _adopt(self, producer: Any) -> None:
        """The engine's producer, taken before a Ctrl-C deferred while it started is raised.
        Plain stores (no signal handler runs between them), `adopted` last: an exception that
        lands before it leaves the epoch in-process and the engine ended."""
        self.engine, self._current, producer.adopted = producer.engine, producer, True
        # Persistent workers this epoch started: their start is not their pace.
        self.climb.cold = self.persistent and producer.engine.counts["epochs"] <= 1

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
        self._inprocess = self._starts.inprocess(rest)
        self._current = self._inprocess
        engine_producer.end(False)   # ends a non-persistent engine's workers now

    def _window_done(self) -> None:
        with self.end_lock:   # it adjusts the engine, which a newer epoch may serve once this one ended
            if not self.closed:
                self._judge_window()

    def _judge_window(self) -> None:
        now = time.perf_counter_ns()
        rate = self._window_count * 1e9 / max(now - self._window_start, 1)
        self._window_start, self._window_count = now, 0
        engine = self.engine
        assert engine is not None
        if self.climb.judge(rate, engine, self._taken, self._room_for_a_try):
            # Draining first: were the workers retired and an exception (a signal handler's) to
            # land before it, nothing would dispatch the epoch's rest.
            self._draining = True
            self.climb.hand_back(rate, engine, self._taken)

    def _room_for_a_try(self) -> bool:
        """Whether the epoch has batches left for a try's switch window and its verdict's."""
        return self._batches_left() >= (VERDICT_WINDOWS + 1) * WINDOW_BATCHES

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
        if self.engine is None or self.climb.windows >= 2 or self._draining or taken < WINDOW_BATCHES \
                or self.climb.cold:
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
        self.climb.cut_short()
        for producer in [*self._ended, self._current]:
            if producer is not self._inprocess and hasattr(producer, "persistent"):
                producer.persistent = self.persistent
            producer.end(release)
