"""What the workers report, as the engine records it: each task's result in
the ReorderBuffer (a batch, a BatchFailure, or a stream's end), a lost
worker restarted or the epoch failed, and the first fatal error.

``Supervisor`` is the engine's ResultSink (transport.py): the transports call
it from their own threads, under the engine's lock."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._core import BufferClosedError, ReorderBuffer
from ..errors import WorkerError
from . import messages as m
from .engine_errors import EngineParts, start_failure, worker_died
from .remote_errors import rebuild_exception
from .shutdown import RUNNING
from .transport import Delivery, WorkerLoss

if TYPE_CHECKING:
    from ..profiler import Profiler


class SupervisedEngine(EngineParts, Protocol):
    """What the Supervisor reads and calls of its engine (engine.Engine, which imports this
    module: so it is named by what it offers)."""

    profiler: Profiler | None
    buffer: ReorderBuffer
    restarts: dict[str, int]

    @property
    def state(self) -> str: ...

    def send(self, wid: int, idx: int, indices: np.ndarray | None) -> None: ...


class BatchFailure:
    """A batch's error (dataset or collation), in place of the batch: the
    consumer raises it and the epoch goes on."""
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class Marker:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return self._name


END = Marker("END")            # the epoch delivered every batch
CLOSED_BY_OTHER = Marker("CLOSED")   # shut down meanwhile (close() from another thread)
EXHAUSTED = Marker("EXHAUSTED")      # a worker's stream ended (not a batch)
_NOT_SENT = Marker("NOT_SENT")


class Supervisor:
    """Records results and losses for one engine, and its first fatal error."""

    def __init__(self, engine: SupervisedEngine):
        self._engine = engine
        self.failure: BaseException | None = None

    def deliver(self, worker_id: int, result: Delivery) -> None:
        engine = self._engine
        with engine.lock:
            pid = engine.transport.pid(worker_id)
            if isinstance(result, m.InitFailed):   # worker_init_fn failed: the worker is unusable
                self.fail(start_failure(result, worker_id, pid) if result.starting
                          else rebuild_exception(result.error, worker_id, pid, -1))
                return
            w = engine.roster.workers[worker_id]
            idx = result.batch_index
            if w.outstanding.pop((result.epoch, idx), _NOT_SENT) is _NOT_SENT or result.epoch != engine.epoch:
                return   # of an abandoned epoch: dropped (its slab returns to the pool)
            if isinstance(result, m.Loaded):
                self._store(idx, result.batch)
                profiler = engine.profiler
                if profiler is not None and result.timings is not None:
                    t = result.timings
                    profiler.worker_batch(worker_id, pid, idx, t.start_ns, t.fetch_ns, t.collate_ns,
                                          t.sent_ns, t.field_stats, t.field_ns,
                                          transported=engine.transport.transported)
            elif isinstance(result, m.Exhausted):
                w.exhausted = True
                engine.roster.changed()
                self._store(idx, EXHAUSTED)
            else:
                self._store(idx, BatchFailure(rebuild_exception(result.error, worker_id, pid, idx)))

    def _store(self, idx: int, item: Any) -> None:
        try:
            self._engine.buffer.put(idx, item)
        except BufferClosedError:
            pass  # the epoch already failed or is shutting down: drop it

    def held(self, worker_id: int) -> list[int]:
        return self._engine.roster.held(worker_id, self._engine.epoch)

    def fail(self, error: BaseException) -> None:
        """Record a fatal error and wake the consumer with it."""
        if self.failure is None:
            self.failure = error
        self._engine.buffer.close(m.safe_text(error))   # a worker_init_fn's error: its str() may raise

    def worker_lost(self, loss: WorkerLoss) -> None:
        engine = self._engine
        with engine.lock:
            wid = loss.worker_id
            engine.roster.lost(wid)
            if engine.state != RUNNING:
                return
            # The worker's tasks, less those still queued for it here (waiting to share a message).
            queued = sorted(idx for epoch, idx in engine.transport.queued(wid) if epoch == engine.epoch)
            held = sorted(set(self.held(wid)) - set(queued))
            if loss.final is not None:
                first = held[0] if held else None
                self.fail(loss.error_type(loss.final(held), wid, loss.pid, loss.exitcode, first))
                return
            options = engine.options
            limit = options.workers.max_worker_restarts
            spent = engine.restarts["worker_restarts"]   # the loader's, over all its epochs
            if spent < limit and not options.derived.iterable and engine.transport.restartable:
                # A stream's position died with its worker: those are never restarted.
                engine.restarts["worker_restarts"] = spent = spent + 1
                if engine.profiler is not None:
                    engine.profiler.worker_restarted(wid)
                warnings.warn(f"mxload worker {wid} (pid {loss.pid}) died ({loss.how}{loss.hint}); "
                              f"restarting it ({spent}/{limit})", RuntimeWarning, stacklevel=1)
                self._restart(wid)
                return
            if not limit:
                why = ""
            elif options.derived.iterable:
                why = (f"; not restarted (max_worker_restarts={limit}): an IterableDataset's worker "
                       f"held its place in the stream, which died with it")
            elif not engine.transport.restartable:
                why = f"; not restarted (max_worker_restarts={limit}): this backend cannot replace a worker"
            else:
                why = f"; max_worker_restarts={limit} exhausted (a budget per loader, over all its epochs)"
            self.fail(worker_died(loss, held, why, queued))

    def _restart(self, wid: int) -> None:
        """Replace a lost worker and dispatch its batches again (engine lock held)."""
        engine = self._engine
        try:
            if not engine.transport.restart(wid, engine.epoch):
                return   # shutting down
        except Exception as e:
            self.fail(WorkerError(f"could not restart worker {wid}: {e}", wid))
            return
        dead = engine.roster.replace(wid)
        for (epoch, idx), indices in sorted(dead.outstanding.items()):
            if epoch == engine.epoch:
                engine.send(wid, idx, indices)
        # The consumer may be asleep waiting for one of these: none is held.
        engine.transport.flush()
