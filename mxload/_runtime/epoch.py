"""One epoch: which batches it delivers (EpochPlan, resumed or not: the
batch sampler drawn as the batches are needed, a BatchSupply), where they
are made (in the calling thread, or by the engine's workers), and the one
EpochIterator the training loop holds, for 0 or N workers."""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .._collate import plan as _plan
from .._core import HandingIterator, Handover, defer_sigint, handing_next, sigint_safe_finalizer
from ..errors import EpochAbortedError
from .autotune import AutoBatches, AutoTuner
from .batch_errors import as_loop_error
from .engine import Engine
from .engine_errors import aborted_error, ended_error, superseded_error
from .os_malloc import keep_freed_memory_in_training_process
from .os_signals import raised_by_signal_handler
from .plan import EpochPlan
from .progress import EpochProgress
from .results import END, BatchFailure, Marker
from .source import SampleSource

if TYPE_CHECKING:
    from .._options import LoaderOptions
    from ..profiler import Profiler
    from ..sampler import EpochBatches

__all__ = ["EpochIterator", "EpochPlan", "EpochRequest", "start_epoch"]


# EpochIterator: a producer's ended_by() for the sampler's own error, which ends the epoch
# (its workers stay, if persistent: they hold nothing of it).
SAMPLER_FAILED = "the batch sampler"


class _Producer(Protocol):
    """Where an EpochIterator's batches come from."""
    profiler: Profiler | None

    @property
    def total_batches(self) -> int | None: ...
    def next_batch(self) -> tuple[int, Any] | Marker: ...
    def end(self, release: bool) -> None: ...
    def ended_by(self, error: BaseException) -> str | None:
        """Why `error`, raised by next_batch, ends the epoch ("" if it
        ends it for its own sake: a worker's death, a timeout), or None if
        the epoch goes on (a signal handler's exception)."""


def raised_by_a_signal(error: BaseException, retryable: bool) -> bool:
    """Whether `error`, raised while the training process loaded a batch itself, came from a
    signal rather than from the dataset: a KeyboardInterrupt where a Ctrl-C can land (the main
    thread, with Python's default SIGINT handler: a Ctrl-C there cannot be told from the
    dataset's own KeyboardInterrupt, and must stay one), or a signal handler's exception (an
    Exception only where the batch can be loaded again, `retryable`: a stream's samples drawn
    already are gone, so it is the batch's failure there; a SystemExit & co always, as a
    SIGTERM handler's sys.exit() must end the program)."""
    if (isinstance(error, KeyboardInterrupt) and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        return True
    if isinstance(error, Exception) and not retryable:
        return False
    return raised_by_signal_handler(error)


class InProcessBatches:
    """num_workers=0: fetch and collate in the calling thread."""

    def __init__(self, options: LoaderOptions, epoch: int, plan: EpochPlan, profiler: Profiler | None,
                 handover: Handover, buffers: _plan.ReusedBuffers | None = None):
        self.profiler = profiler
        self.handover = handover   # the epoch's: its `ready` holds the batch on its way to the loop
        self._batchify = options.batching.batchify_fn
        self._epoch = epoch
        self._plan = plan
        self._position = 0                   # batches handed out
        self._discard = plan.discard
        self._buffers = buffers if buffers is not None else _plan.ReusedBuffers()
        keep_freed_memory_in_training_process()   # once per process (os_malloc.py: page faults per batch)
        derived = options.derived
        self._source = SampleSource(options.dataset, derived.iterable, derived.fetch_batch_size,
                                    options.batching.drop_last, options.seeds.seed,
                                    keyed=not derived.auto_batching, seeding=options.seeds.seeding,
                                    restore=True, gather_tensors=_plan.collates_itself(self._batchify))

    def next_batch(self) -> tuple[int, Any] | Marker:
        """As torch: an error raised for one batch (dataset or collation)
        uses that batch up, so a loop that catches it goes on with the next
        one; a StopIteration or a SystemExit & co is made an error for the
        batch (batch_errors.py), as with workers.  A Ctrl-C, or a signal
        handler's exception, leaves the epoch where it was.  The result is
        also left in the Handover's `ready` (NOTE [ Signal-safe hand-over ],
        csrc/handoff.pxi).  The sampler's error raises as itself and ends the
        epoch (see BatchSupply)."""
        supply = self._plan.supply
        if supply is not None:
            got = supply.peek()   # drawn from the sampler now
            if got is None:
                return END
            idx, indices = got
        else:
            idx, indices = self._plan.discard + self._position, None
        t0 = time.monotonic_ns()
        try:
            samples = (self._source.samples(self._epoch, indices) if supply is not None
                       else self._stream_samples())
            if samples is None:
                return END
            if self.profiler is None:
                batch = _plan.collate(self._batchify, samples, idx, self._buffers)
            else:
                batch = self._collate_profiled(idx, samples, t0)
        except BaseException as e:
            if raised_by_a_signal(e, retryable=supply is not None):
                raise   # not the batch's failure: the next call loads it again
            origin = (f"Raised in the training process (pid {os.getpid()}, no workers) "
                      f"while loading batch {idx}.")
            failure = BatchFailure(as_loop_error(e, origin, None, os.getpid(), idx))
            self.handover.ready = (idx, failure)   # plain stores: no signal handler runs between them
            self._position += 1
            if supply is not None:
                supply.handed = idx + 1
            return idx, failure
        self.handover.ready = (idx, batch)   # (as above)
        self._position += 1
        if supply is not None:
            supply.handed = idx + 1
        return idx, batch

    def ended_by(self, error: BaseException) -> str | None:
        supply = self._plan.supply
        if supply is not None and error is supply.error:
            return SAMPLER_FAILED
        return None   # as a plain loop: the epoch stays where it was

    def _stream_samples(self) -> Any:
        while self._discard:   # resumed: replay the stream, drop what was seen
            if self._source.samples(self._epoch, None) is None:
                return None
            self._discard -= 1
        return self._source.samples(self._epoch, None)

    def _collate_profiled(self, idx: int, samples: Any, t0: int) -> Any:
        profiler = self.profiler
        assert profiler is not None
        t1 = time.monotonic_ns()
        batch, stats, field_ns = _plan.collate_profiled(self._batchify, samples, idx, self._buffers)
        t2 = time.monotonic_ns()
        profiler.worker_batch(-1, os.getpid(), idx, t0, t1 - t0, t2 - t1, t2, stats, field_ns,
                              transported=False)
        return batch

    @property
    def total_batches(self) -> int | None:
        supply = self._plan.supply
        return supply.length if supply is not None else None

    def end(self, release: bool) -> None:
        self._source.close()


class _EngineBatches:
    """N workers: the engine's batches (the engine may outlive the epoch)."""

    def __init__(self, engine: Engine, persistent: bool, generation: int):
        self.engine = engine
        self.profiler = engine.profiler
        self.persistent = persistent
        self.adopted = False   # num_workers="auto": AutoBatches took it (see _engine_batches)
        # One call less per batch; `generation`, begin_epoch's count of this epoch: a call that
        # comes after the epoch is over (another thread's iter() began the next on these
        # persistent workers between this iterator's check that it is open and the call) gets
        # none of the next epoch's batches.
        self.next_batch = functools.partial(engine.next_batch, generation)

    def ended_by(self, error: BaseException) -> str | None:
        window = self.engine.window
        own, window.own_error = window.own_error, None   # (it holds the error's traceback: a cycle)
        if own is error:
            supply = window.supply
            if supply is not None and error is supply.error:
                return SAMPLER_FAILED
            return ""   # a worker's death, a timeout: the engine's own error
        # Another exception (a signal handler's): the epoch goes on, unless
        # it cut short a step that cannot be retried.
        return window.torn

    @property
    def total_batches(self) -> int | None:
        return self.engine.total_batches

    def end(self, release: bool) -> None:
        if release or not self.persistent:
            self.engine.shutdown()
        else:
            self.engine.close_epoch()


class EpochIterator(HandingIterator):
    """What ``iter(loader)`` returns: one epoch of batches.

    Ends its workers (unless persistent) when exhausted, closed, on error, or
    when garbage-collected: ``for batch in loader: break`` stops the workers
    at once, because nothing else holds this object strongly.

    Its batches reach the loop through `handover`, the epoch's Handover
    (NOTE [ Signal-safe hand-over ], csrc/handoff.pxi): its producer leaves
    each batch in it, and __next__ (handing_next) hands it out."""

    def __init__(self, producer: InProcessBatches | _EngineBatches | AutoBatches, progress: EpochProgress,
                 length: Callable[[], int], handover: Handover):
        self._producer: _Producer = producer
        self.handover = handover
        self._progress = progress
        self._length = length
        self._closed = False
        self._superseded = False
        self._aborted: str | None = None

    def __iter__(self) -> EpochIterator:
        return self

    @property
    def engine(self) -> Engine | None:
        """The engine, with workers (persistent_workers: the loader keeps it too); None in-process."""
        return getattr(self._producer, "engine", None)

    def __len__(self) -> int:
        """The batches this epoch delivers (a stream: the loader's len())."""
        total = self._producer.total_batches
        return total if total is not None else self._length()

    def _next(self) -> Any:
        """The next batch; __next__ (handing_next) calls it, the batch the
        last call handed out settled (counted taken) before.

        An exception a signal handler raises in here (a program's step
        timeout, a Ctrl-C the loop catches and ignores) leaves the epoch
        going on, as torch's iterator does: the batch being handed out stays
        in the Handover's `ready` slot and the next call returns it, so a
        loop that catches the exception and goes on gets every batch once,
        in order.  Where it cut short a step that cannot be retried, the
        epoch is aborted and the next call says so (EpochAbortedError),
        never a normal-looking end (NOTE [ Signal-safe hand-over ])."""
        try:
            if self._closed:
                if self._superseded:
                    raise superseded_error()
                if self._aborted is not None:
                    raise EpochAbortedError(self._aborted)
                raise StopIteration
            producer = self._producer
            profiler = producer.profiler
            call_ns = time.monotonic_ns() if profiler is not None else 0
            got = self.handover.ready   # a batch an exception kept from the loop last time
            if got is None:
                try:
                    fresh = producer.next_batch()
                except BaseException as e:
                    ended = producer.ended_by(e)
                    if ended is not None:   # a worker failure or timeout, or a step that cannot be retried
                        # Said again by any later call: the exception raised now may never reach
                        # the loop (a signal handler's, delivered as the shutdown below completes,
                        # replaces it), and the epoch must not then look exhausted.
                        self._aborted = (aborted_error(ended) if ended and ended != SAMPLER_FAILED
                                         else ended_error(e)).args[0]
                    del e
                    if ended is not None:
                        # (The sampler's error leaves persistent workers: they hold nothing of it.)
                        self._end(force=ended != SAMPLER_FAILED)
                    raise
                if fresh is END:
                    self._progress.finished = True
                    self._end()
                    raise StopIteration
                if not isinstance(fresh, tuple):   # CLOSED_BY_OTHER: another thread's close() or iter()
                    self._end()
                    if self._superseded:
                        raise superseded_error()
                    raise StopIteration
                got = fresh
                del fresh   # (an error's traceback keeps this frame: see below)
            idx, batch = got
        except BaseException:
            del self   # the traceback keeps this frame: it must not keep the iterator (see below)
            raise
        if isinstance(batch, BatchFailure):
            # As torch: an error raised for one batch leaves the epoch running;
            # the loop may catch it and take the next batches.  The error's
            # traceback holds this frame: it must reference neither the error
            # (a cycle, freed only by a gc run) nor this iterator, so that a
            # loop abandoned by the error still ends the workers at once.
            error, batch = batch.error, None
            self.handover.handing()   # the loop has it (its error): counted at the next call
            del self, profiler, producer, got
            try:
                raise error
            finally:
                del error
        if profiler is not None:
            profiler.batch_taken(idx, call_ns)
        return batch

    __next__ = handing_next(_next)

    @defer_sigint   # (and __del__ below: NOTE [ Deferred signals ])
    def _end(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self._producer.profiler is not None:
            self._producer.profiler.epoch_ended()
        self._producer.end(force)

    def supersede(self) -> None:
        """A newer iterator takes over the persistent engine: if this epoch is
        still in progress, using this iterator again is an error, not a
        silent share of the newer epoch's batches."""
        if not self._closed:
            self._superseded = True
            self._end()

    def release_engine_at_end(self, engine: Engine) -> bool:
        """The loader is gone: end the workers with this epoch, even if
        persistent.  Whether this epoch ends `engine` (the loader's persistent
        workers) when it ends; if not (it is over: closed, or being finalized,
        which freed the loader's last reference; or it is not on `engine`),
        the caller ends them."""
        state = self.__dict__   # cleared by _finalize, which may be what freed the loader
        producer = state.get("_producer")
        if state.get("_closed", True) or not isinstance(producer, (_EngineBatches, AutoBatches)):
            return False
        producer.persistent = False   # (num_workers="auto": also an engine it starts later)
        return producer.engine is engine

    @defer_sigint
    def close(self) -> None:
        """End this epoch now; without persistent workers, end the workers."""
        self._end()

    shutdown = close

    def __enter__(self) -> EpochIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _finalize(self) -> None:
        if sys.is_finalizing():
            return
        try:
            self._end()
        except Exception:
            pass
        # Free what only this iterator kept alive (the engine, its threads and
        # handles) now, while a Ctrl-C is still held back: a Python finalizer
        # running after this one would swallow it.
        self.__dict__.clear()

    __del__ = sigint_safe_finalizer(_finalize)


@dataclass(frozen=True)
class EpochRequest:
    """What the loader asks for at an epoch's start (start_epoch).

    Args:
        options: the loader's options.
        epoch: the epoch's number.
        batches: begins to draw the epoch's batches of indices from a given batch on
            (sampler.epoch_batches; None: an IterableDataset).
        progress: which batches were taken (a resumed epoch); records those taken from now on.
        profiler: the loader's, if any.
        engine: the loader's persistent engine, if it has one running.
        persistent: persistent_workers.
        length: the loader's len() (a stream's epoch).
        on_engine: receives a new engine before anything can interrupt (a persistent
            engine's owner must learn of it, whatever happens next).
        restarts: the loader's max_worker_restarts spent so far (see Engine).
        tuner: num_workers="auto" (autotune/).
        buffers: the loader's buffers for batches collated in this process (a new pool if None).
        stream_key: a stream's key of the epoch for its workers (EpochPlan.stream_key).
    """
    options: LoaderOptions
    epoch: int
    batches: Callable[[int], EpochBatches] | None
    progress: EpochProgress
    profiler: Profiler | None
    engine: Engine | None
    persistent: bool
    length: Callable[[], int]
    on_engine: Callable[[Engine], None]
    restarts: dict[str, int]
    tuner: AutoTuner | None = None
    buffers: _plan.ReusedBuffers | None = None
    stream_key: Any = None   # (a numpy array)


def start_epoch(request: EpochRequest) -> EpochIterator:
    """Start the epoch `request` asks for: in the calling thread (num_workers=0), on the loader's
    persistent engine if it is still usable, else on a new one, or (num_workers="auto") in the
    calling thread first, AutoBatches moving it onto an engine when it picks workers."""
    t0 = time.monotonic_ns()
    plan = EpochPlan.of(request.batches, request.progress, request.epoch, request.stream_key)
    # The epoch's hand-over, which every producer of the epoch stores into (NOTE [ Signal-safe
    # hand-over ], csrc/handoff.pxi); the progress reads the batch it handed out, not yet counted.
    handover = Handover(request.progress.taken)
    request.progress.handover = handover
    t1 = time.monotonic_ns()
    profiler, tuner = request.profiler, request.tuner
    if tuner is not None and plan.supply is not None:
        if profiler is not None:
            profiler.autotune = tuner.report
        auto = AutoBatches(tuner, request.epoch, plan, _AutoStarts(request, handover), profiler,
                           request.persistent)
        if profiler is not None:
            profiler.epoch_started(time.monotonic_ns() - t0, 0)
        return EpochIterator(auto, request.progress, request.length, handover)
    if request.options.workers.num_workers == 0 or tuner is not None:
        batches = InProcessBatches(request.options, request.epoch, plan, profiler, handover, request.buffers)
        it = EpochIterator(batches, request.progress, request.length, handover)
        if profiler is not None:
            profiler.epoch_started(time.monotonic_ns() - t0, 0)
        return it
    return _start_on_engine(request, plan, t1 - t0, handover)


def _start_on_engine(request: EpochRequest, plan: EpochPlan, sampling_ns: int,
                     handover: Handover) -> EpochIterator:
    """All or nothing: a Ctrl-C meanwhile is raised once the iterator
    exists, whose finalizer then ends a non-persistent engine."""
    made: list[EpochIterator] = []
    _engine_batches(request, plan, request.engine, request.persistent, sampling_ns, None, handover,
                    lambda producer: made.append(EpochIterator(producer, request.progress, request.length,
                                                               handover)))
    return made[0]


@defer_sigint
def _engine_batches(request: EpochRequest, plan: EpochPlan, engine: Engine | None, persistent: bool,
                    sampling_ns: int, active: tuple[int, int] | None, handover: Handover,
                    adopt: Callable[[_EngineBatches], None]) -> None:
    """Start `plan` on `engine` (persistent workers), or on a new engine,
    and hand its producer to `adopt` before a Ctrl-C deferred meanwhile is
    raised; `active`: (workers taking tasks, window) for num_workers="auto";
    `handover`: the epoch's, where the engine leaves the batches it hands out."""
    t1 = time.monotonic_ns()
    producer: _EngineBatches | None = None
    epoch, profiler = request.epoch, request.profiler
    created = engine is None or not engine.usable or engine.began(epoch)
    if engine is None or created:   # (both, for the type checker)
        if engine is not None:
            # Persistent, but failed, with a worker's stream cut, or on this
            # epoch already (its start was interrupted; the loader's epoch
            # did not advance): its tasks' answers may still come.
            engine.shutdown()
        engine = Engine(request.options, epoch, request.restarts)
    try:
        request.on_engine(engine)
        if active is not None:
            engine.set_active(*active)
        generation = engine.begin_epoch(epoch, plan, profiler, handover)
        if profiler is not None:
            profiler.epoch_started(sampling_ns, time.monotonic_ns() - t1)
        producer = _EngineBatches(engine, persistent, generation)
        adopt(producer)
    except BaseException:
        # Once adopted (its last store), the adopter owns the engine, even if an exception (a
        # signal handler's) lands before this returns.
        if created and not persistent and not (producer is not None and producer.adopted):
            engine.shutdown()
        raise


class _AutoStarts:
    """What an epoch's AutoBatches starts (autotune.producer.EpochStarts): its in-process
    producers, and the engine when it picks workers (this loader's persistent one if usable),
    all storing into the epoch's `handover`."""

    def __init__(self, request: EpochRequest, handover: Handover):
        self.request = request
        self.handover = handover

    def inprocess(self, part: EpochPlan) -> InProcessBatches:
        request = self.request
        return InProcessBatches(request.options, request.epoch, part, request.profiler, self.handover,
                                request.buffers)

    def engine(self, auto: AutoBatches, rest: EpochPlan, workers: int,
               adopt: Callable[[_EngineBatches], None]) -> bool:
        """Start `rest` on the engine with `workers` taking tasks; False if `auto` was ended
        meanwhile.  Whole under the epoch's end lock: an epoch ended meanwhile (superseded by
        another thread's iter(), which may already run its own epoch on the loader's persistent
        workers) starts no engine and takes over none."""
        request = self.request
        assert request.tuner is not None
        with auto.end_lock:
            if auto.closed:
                return False
            # The loader is gone (auto.persistent turned False): the workers end with this epoch.
            engine = None if request.persistent and auto.persistent is False else request.engine
            _engine_batches(request, rest, engine, auto.persistent, 0,
                            (workers, request.tuner.window(workers)), self.handover, adopt)
            return True
