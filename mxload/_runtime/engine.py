"""The multi-worker engine: the prefetch window, dispatch, and consuming
from the ReorderBuffer.

One Engine owns one transport's workers (transport.py: processes, threads
or Ray actors) and the ReorderBuffer they fill; its Supervisor (results.py)
records what the transport reports (results, lost workers, the first fatal
error) and its Roster (roster.py) which worker holds which task.  An epoch is iterated through an
EpochIterator (epoch.py); when it ends, the engine shuts down, unless the
loader keeps it for persistent workers.

States: RUNNING -> SHUTTING_DOWN -> CLOSED.  ``Engine.shutdown`` is the only
place that ends workers (shutdown.shutdown_sequence); every way an
iteration can end goes through it.

Ctrl-C: the start-up and the shutdown run with SIGINT deferred
(``_core.defer_sigint``, NOTE [ Deferred signals ]): a Ctrl-C that lands inside them lets them finish,
so no worker, thread or descriptor is left half made or half ended, and is
then raised once; one that lands in a finalizer (``__del__`` after
``break``) is made pending again for the code the finalizer interrupted
instead of being printed as "Exception ignored".
"""
from __future__ import annotations

import os
import sys
import threading
from multiprocessing import util as mp_util
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core import EngineWindow, Handover, RawBatch, ReorderBuffer, defer_sigint
from ..backends import workers_backend
from ..errors import WorkerError
from .engine_errors import aborted_error, forked_child_error, timeout_error
from .messages import ProtocolError, WorkerConfig
from .results import CLOSED_BY_OTHER, END, EXHAUSTED, BatchFailure, Supervisor
from .roster import Roster
from .shutdown import CLOSED, RUNNING, SHUTTING_DOWN, shutdown_sequence
from .transport import Capabilities, Transport, TransportSetup
from .transports import make_transport

if TYPE_CHECKING:
    from .._options import LoaderOptions
    from ..profiler import Profiler
    from .plan import EpochPlan

# loader.stats always has these, whatever the transport counts.
REPORTED_COUNTERS = ("batches", "slabs_created", "slabs_reused", "slabs_retired", "worker_restarts", "epochs")


def merge_counters(counters: list[dict[str, int]]) -> dict[str, int]:
    merged = dict.fromkeys(REPORTED_COUNTERS, 0)
    for owned in counters:
        merged.update(owned)
    return merged


class Engine:
    """Workers, reorder buffer and failure record for one loader.  What runs
    once per batch in the training loop's thread (the prefetch window, the
    wait, the claim and hand-over of each batch) is compiled: `window`, an
    EngineWindow (csrc/window.pxi), whose next_batch is this engine's."""

    def __init__(self, options: LoaderOptions, epoch: int, restarts: dict[str, int]):
        """`restarts`: the loader's {"worker_restarts": n}, the max_worker_restarts spent so far
        (a budget per loader, as documented: each epoch without persistent workers has its own
        engine, and a worker OOM-killed once an epoch must still exhaust it)."""
        self.options = options
        self.counts = {"batches": 0, "epochs": 0}
        self.restarts = restarts
        self.profiler: Profiler | None = None
        self._pid = os.getpid()                 # only this process may end the workers
        self.lock = threading.RLock()           # dispatch, results, the roster
        self._shutdown_lock = threading.Lock()
        self.buffer = ReorderBuffer()
        self.buffer.keep_handover = True   # see EngineWindow.next_batch
        self.roster = Roster(options.workers.num_workers)
        self.supervisor = Supervisor(self)
        self._plan: EpochPlan | None = None
        # The window and the consumer's hand-over (compiled: they run once per batch).
        self.window = EngineWindow(self.lock, self.roster, self.buffer, self.counts,
                                   (END, CLOSED_BY_OTHER, EXHAUSTED, BatchFailure, ProtocolError),
                                   forked_error=self._forked_error, aborted_error=self._aborted_error,
                                   timed_out=self._timed_out, claim_failed=self._claim_failed,
                                   failure=self._failure, dispatch_unqueued=self._dispatch_unqueued)
        window = self.window
        workers = options.workers
        window.prefetch = max(workers.prefetch, 1)
        window.in_order = workers.in_order
        window.timeout = workers.timeout
        window.epoch = epoch
        self.next_batch = window.next_batch
        self._finalizer: mp_util.Finalize | None = None
        backend = workers_backend(workers.backend, workers.thread_pool, workers.start_method)
        self.transport: Transport = make_transport(backend, TransportSetup(
            self.supervisor, self.lock, WorkerConfig.first(options, epoch), self.buffer,
            type(options.dataset).__name__, window.prefetch, workers.timeout))
        window.transport = self.transport
        try:
            self.transport.start()
        except BaseException:
            self.shutdown()
            raise
        capabilities = Capabilities.of(self.transport)   # once: the window calls them unasked
        window.put_task, window.receive = capabilities.put_task, capabilities.receive
        window.claim_raw, window.claim_mismatch = capabilities.claim_raw, capabilities.claim_mismatch
        # Runs at interpreter exit before multiprocessing's own teardown.
        self._finalizer = mp_util.Finalize(None, self.shutdown, exitpriority=100)

    # What the window holds that the rest of the runtime reads (or shutdown sets).
    @property
    def state(self) -> str:
        """RUNNING -> SHUTTING_DOWN -> CLOSED."""
        return self.window.state

    @state.setter
    def state(self, value: str) -> None:
        self.window.state = value

    @property
    def epoch(self) -> int:
        """The epoch being served."""
        return self.window.epoch

    @property
    def prefetch(self) -> int:
        """Tasks in flight at most."""
        return self.window.prefetch

    @property
    def usable(self) -> bool:
        """Able to serve another epoch: running, not failed, every worker's
        stream whole, and in the process that created it (a forked child's
        copy is inert)."""
        return (self.state == RUNNING and self.supervisor.failure is None and self.transport.reusable()
                and not self.window.forked)

    def began(self, epoch: int) -> bool:
        """Whether this engine already began epoch `epoch` (an iter() that a Ctrl-C interrupted once
        its tasks were out): beginning it again would mix its answers with the new ones."""
        return self._plan is not None and self.epoch == epoch

    def counters(self) -> list[dict[str, int]]:
        """This engine's, the loader's restarts and its transport's counters (each owned by one);
        readable after it ends."""
        return [self.counts, self.restarts, *self.transport.counters()]

    def worker_pids(self) -> list[int | None]:
        """Each worker's pid (None for a thread), by worker id."""
        return [self.transport.pid(wid) for wid in range(len(self.roster))]

    def worker_processes(self) -> list[Any]:
        """Each worker's local process object (transport.process), by worker id; [] for threads
        or Ray actors."""
        processes = [self.transport.process(wid) for wid in range(len(self.roster))]
        return [p for p in processes if p is not None]

    @property
    def total_batches(self) -> int | None:
        return None if self._plan is None or self._plan.supply is None else self._plan.supply.length

    # ------------------------------------------------------------------ epochs and dispatch

    def begin_epoch(self, epoch: int, plan: EpochPlan, profiler: Profiler | None, handover: Handover) -> int:
        """Start delivering `plan` (the batches of epoch `epoch`) into `handover`, the epoch's;
        returns the buffer's epoch count for it, which its producer passes to next_batch
        (EngineWindow.next_batch)."""
        window = self.window
        with self.lock:
            if self.state != RUNNING:
                raise RuntimeError(f"the loader's workers are {self.state}")
            window.epoch = epoch
            self.profiler = profiler
            self.counts["epochs"] += 1
            self.transport.epoch_closed = False
            for wid, key in self.transport.drop_held():   # the epoch before's, never sent
                self.roster.workers[wid].outstanding.pop(key, None)
            self.transport.tidy_between_epochs()
            stale = self.buffer.start_epoch(epoch)
            for item in stale.values():
                if isinstance(item, RawBatch):
                    window.claim(item)   # of the epoch before: its slab returns to the pool
                    self.roster.workers[item.slot].outstanding.pop((item.epoch, item.idx), None)
            self.roster.new_epoch()
            self._plan = plan
            window.supply, window.profiling = plan.supply, profiler is not None
            window.stream_indices = plan.stream_key
            window.due.clear()
            window.handover = handover
            window.own_error = window.torn = None
            window.discard = plan.discard
            window.next_dispatch = window.yielded = window.in_flight = 0
            window.waited = -1
            window.dispatch_more()
            generation = self.buffer.epochs
        del stale  # recycled slabs of the previous epoch, released outside the lock
        return generation

    def progress(self) -> tuple[int, int]:
        """(batches taken, tasks dispatched) of this epoch."""
        return self.window.yielded, self.window.next_dispatch

    def set_active(self, workers: int, window: int) -> None:
        """num_workers="auto": `workers` take tasks (a retired one answers what it holds), `window`
        in flight."""
        with self.lock:
            self.roster.set_active(workers)
            self.window.prefetch = max(window, 1)
            self.transport.set_window(self.window.prefetch, workers)

    def close_epoch(self) -> None:
        """The epoch's iterator is closed, the workers stay (persistent): a send waiting on a worker
        that is not reading gives up now, and a next() of the epoch waiting in another thread
        ends (the buffer's end_epoch).  Without the engine lock, which that send's thread holds."""
        self.transport.epoch_closed = True
        self.buffer.end_epoch()

    def send(self, wid: int, idx: int, indices: np.ndarray | None) -> None:
        self.roster.workers[wid].outstanding[(self.epoch, idx)] = indices
        self.transport.dispatch(wid, self.epoch, idx, indices, self.profiler is not None)

    # ------------------------------------------------------------------ consumer
    #
    # next_batch is the window's (EngineWindow.next_batch, compiled): the
    # consumer's wait, the claim of the batch (views of its slab), the commit
    # and the window's refill.  The batch is also left in the epoch's
    # Handover (`window.handover.ready`) until it reached the loop: see
    # NOTE [ Signal-safe hand-over ] (csrc/handoff.pxi).  What is not
    # retry-safe (a dispatch without put_task) marks the epoch `torn` while
    # it runs.  The methods below are the window's ways out: the errors that
    # end the epoch, and the dispatch of a transport without put_task.

    def _dispatch_unqueued(self, wid: int, idx: int, indices: np.ndarray | None) -> None:
        """The window's dispatch for a transport without put_task (Ray): a
        signal handler's exception meanwhile aborts the epoch."""
        window = self.window
        window.torn = f"the dispatch of batch {idx}'s task"
        self.send(wid, idx, indices)
        window.next_dispatch += 1
        window.in_flight += 1
        window.torn = None

    def _own(self, error: BaseException) -> BaseException:
        """`error`, recorded as one that ends the epoch (next_batch raises it)."""
        self.window.own_error = error
        return error

    def _forked_error(self) -> BaseException:
        return self._own(forked_child_error(self._pid))

    def _aborted_error(self) -> BaseException:
        return self._own(aborted_error(self.window.torn or "a step of the epoch"))

    def _timed_out(self, idx: int) -> BaseException:
        return self._own(timeout_error(self, idx))

    def _failure(self) -> BaseException | None:
        """What failed the engine (it closed the buffer), or None."""
        return self.supervisor.failure

    def _claim_failed(self, idx: int, error: Exception) -> BaseException:
        err = WorkerError(f"mxload could not take batch {idx} in the main process: {error}",
                          None, None, None, idx)
        self.supervisor.fail(err)
        return self._own(self.supervisor.failure or err)

    # ------------------------------------------------------------------ shutdown

    @defer_sigint
    def shutdown(self) -> None:
        """End the workers and release everything; idempotent, thread-safe,
        bounded by shutdown.SHUTDOWN_DEADLINE_S however stuck the workers
        are.  In a forked child (a user's os.fork()) the inherited copy is
        inert: the workers belong to the process that created them.  A
        Ctrl-C meanwhile is raised once the sequence is complete
        (NOTE [ Numbered shutdown ])."""
        if self.state == CLOSED:
            return
        if self.window.forked:
            self.state = CLOSED   # local/fds.py closed the inherited descriptors at fork
            return
        if sys.is_finalizing():
            return  # the zygote (or each worker's watchdog) sees the sockets hang up
        with self._shutdown_lock:
            if self.state == CLOSED:
                return
            self.state = SHUTTING_DOWN
            try:
                shutdown_sequence(self.transport, self.buffer)
                self.roster.forget_all()
            finally:
                # Whatever happened above, this engine is finished: never run twice.
                self.state = CLOSED
                if self._finalizer is not None:
                    self._finalizer.cancel()

    def __repr__(self) -> str:
        return f"<mxload Engine {self.state}, {len(self.roster)} workers>"
