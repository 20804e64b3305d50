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
(``_core.defer_sigint``): a Ctrl-C that lands inside them lets them finish,
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

from .._core import BufferClosedError, RawBatch, ReorderBuffer, defer_sigint
from ..backends import workers_backend
from ..errors import WorkerError
from . import wire
from .engine_errors import aborted_error, forked_child_error, timeout_error
from .results import CLOSED_BY_OTHER, END, EXHAUSTED, BatchFailure, Marker, Supervisor
from .roster import Roster
from .shutdown import CLOSED, RUNNING, SHUTTING_DOWN, shutdown_sequence
from .transport import Transport, TransportSetup
from .worker import WorkerConfig

if TYPE_CHECKING:
    from .._options import LoaderOptions
    from ..profiler import Profiler
    from .epoch import EpochPlan

# Forks of this process so far, as seen in the child: a batch is taken only in
# the process that made the engine, and comparing this costs nothing per batch
# where os.getpid() is a system call (glibc caches no pid).
_forks = 0


# loader.stats always has these, whatever the transport counts.
REPORTED_COUNTERS = ("batches", "slabs_created", "slabs_reused", "slabs_retired", "worker_restarts", "epochs")


def merge_counters(counters: list[dict[str, int]]) -> dict[str, int]:
    merged = dict.fromkeys(REPORTED_COUNTERS, 0)
    for owned in counters:
        merged.update(owned)
    return merged


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)


class Engine:
    """Workers, reorder buffer and failure record for one loader."""

    def __init__(self, options: LoaderOptions, epoch: int):
        self.options = options
        self.prefetch = max(options.prefetch, 1)
        self.counts = {"batches": 0, "worker_restarts": 0, "epochs": 0}
        self.state = RUNNING
        self.epoch = epoch
        self.profiler: Profiler | None = None
        self._pid = os.getpid()                 # only this process may end the workers
        self._forks = _forks
        self.lock = threading.RLock()           # dispatch, results, the roster
        self._shutdown_lock = threading.Lock()
        self.buffer = ReorderBuffer()
        self.buffer.keep_handover = True   # see next_batch
        self.roster = Roster(options.num_workers)
        self.supervisor = Supervisor(self)
        self._plan: EpochPlan | None = None
        # The consumer's hand-over (next_batch): the batch handed out last,
        # until the iterator has returned it; what the engine raised last;
        # what a signal handler's exception cut short (the epoch is aborted).
        self.ready: tuple[int, Any] | None = None
        self.own_error: BaseException | None = None
        self.torn: str | None = None
        self._discard = 0
        self._next_dispatch = self._yielded = self._in_flight = 0
        self._finalizer: mp_util.Finalize | None = None
        backend = workers_backend(options.backend, options.thread_pool, options.start_method)
        self.transport: Transport = backend.make_transport(TransportSetup(
            self.supervisor, self.lock, WorkerConfig.first(options, epoch), self.buffer,
            type(options.dataset).__name__, self.prefetch, options.timeout))
        try:
            self.transport.start()
        except BaseException:
            self.shutdown()
            raise
        # Runs at interpreter exit before multiprocessing's own teardown.
        self._finalizer = mp_util.Finalize(None, self.shutdown, exitpriority=100)

    @property
    def usable(self) -> bool:
        """Able to serve another epoch: running, not failed, every worker's
        stream whole, and in the process that created it (a forked child's
        copy is inert)."""
        return (self.state == RUNNING and self.supervisor.failure is None and self.transport.reusable()
                and os.getpid() == self._pid)

    def began(self, epoch: int) -> bool:
        """Whether this engine already began epoch `epoch` (an iter() that a Ctrl-C interrupted once
        its tasks were out): beginning it again would mix its answers with the new ones."""
        return self._plan is not None and self.epoch == epoch

    def counters(self) -> list[dict[str, int]]:
        """This engine's and its transport's counters (each owned by one); readable after it ends."""
        return [self.counts, *self.transport.counters()]

    def worker_pids(self) -> list[int | None]:
        """Each worker's pid (None for a thread), by worker id."""
        return [self.transport.pid(wid) for wid in range(len(self.roster))]

    @property
    def total_batches(self) -> int | None:
        return None if self._plan is None or self._plan.order is None else len(self._plan.order)

    # ------------------------------------------------------------------ epochs and dispatch

    def begin_epoch(self, epoch: int, plan: EpochPlan, profiler: Profiler | None) -> None:
        """Start delivering `plan` (the batches of epoch `epoch`)."""
        with self.lock:
            if self.state != RUNNING:
                raise RuntimeError(f"the loader's workers are {self.state}")
            self.epoch = epoch
            self.profiler = profiler
            self.counts["epochs"] += 1
            self.transport.epoch_closed = False
            for wid, key in self.transport.drop_held():   # the epoch before's, never sent
                self.roster.workers[wid].outstanding.pop(key, None)
            stale = self.buffer.start_epoch(epoch)
            for item in stale.values():
                if isinstance(item, RawBatch):
                    self._claim(item)   # of the epoch before: its slab returns to the pool
                    self.roster.workers[item.slot].outstanding.pop((item.epoch, item.idx), None)
            self.roster.new_epoch()
            self._plan = plan
            self.ready = self.own_error = self.torn = None
            self._discard = plan.discard
            self._next_dispatch = self._yielded = self._in_flight = 0
            self._dispatch_more()
        del stale  # recycled slabs of the previous epoch, released outside the lock

    def progress(self) -> tuple[int, int]:
        """(batches taken, tasks dispatched) of this epoch's plan."""
        return self._yielded, self._next_dispatch

    def set_active(self, workers: int, window: int) -> None:
        """num_workers="auto": `workers` take tasks (a retired one answers what it holds), `window`
        in flight."""
        with self.lock:
            self.roster.set_active(workers)
            self.prefetch = max(window, 1)
            self.transport.set_window(self.prefetch, workers)

    def close_epoch(self) -> None:
        """The epoch's iterator is closed, the workers stay (persistent): a send waiting on a worker
        that is not reading gives up now.  Without the engine lock, which that send's thread holds."""
        self.transport.epoch_closed = True

    def _dispatch_more(self) -> None:
        """Fill the prefetch window with the plan's next tasks."""
        plan = self._plan
        assert plan is not None
        order, batches = plan.order, plan.batches
        transport = self.transport
        roster, in_order = self.roster, self.options.in_order
        profiling = self.profiler is not None
        put = transport.put_task
        with self.lock:
            while self._in_flight < self.prefetch and self.state == RUNNING:
                n = self._next_dispatch
                if order is not None:
                    if n >= len(order):
                        transport.flush()   # the epoch's last tasks: none waits for another
                        return
                    idx = order[n]
                    assert batches is not None
                    indices = batches[idx]
                else:
                    idx, indices = n, None
                wid = roster.pick(idx, in_order)
                if wid is None:
                    return
                # This runs in the training loop's thread, where a signal
                # handler may raise after any call made from Python.  So the
                # task enters the books by plain stores, and the worker's
                # queue by one compiled call (put_task), last: an exception
                # finds it in both or in neither, never sent twice nor lost.
                # What was put is sent now or by a later send_queued/flush.
                if put is None:   # (Ray) no such queue: a cut here aborts the epoch
                    self.torn = f"the dispatch of batch {idx}'s task"
                    self.send(wid, idx, indices)
                    self._next_dispatch = n + 1
                    self._in_flight += 1
                    self.torn = None
                    continue
                epoch = self.epoch
                roster.workers[wid].outstanding[(epoch, idx)] = indices
                self._next_dispatch = n + 1
                self._in_flight += 1
                if put(wid, (epoch, idx, indices, profiling)):
                    transport.send_queued(wid)

    def send(self, wid: int, idx: int, indices: np.ndarray | None) -> None:
        self.roster.workers[wid].outstanding[(self.epoch, idx)] = indices
        self.transport.dispatch(wid, self.epoch, idx, indices, self.profiler is not None)

    # ------------------------------------------------------------------ consumer

    def next_batch(self) -> tuple[int, Any] | Marker:
        """(batch index, batch or BatchFailure), END, or CLOSED_BY_OTHER.
        Raises what ended the epoch (recorded in `own_error`).

        The batch is also left in `ready` until the caller sets it back to
        None: a signal handler may raise between any two bytecodes here or in
        the caller (a program's SIGALRM step timeout, Ctrl-C caught as "skip
        to validation"), and the loop that catches it and goes on must get
        every batch once, in order.  So the hand-over is a sequence of slots,
        each moved to the next by plain stores (no handler runs between them):
        the buffer's `handover` (filled by the wait itself), then `ready`.
        What is not retry-safe (a dispatch) marks the epoch `torn` while it
        runs."""
        if _forks != self._forks:
            raise self._own(forked_child_error(self._pid))
        if self.torn is not None:
            raise self._own(aborted_error(self.torn))
        rb = self.buffer
        while True:
            taken = rb.handover   # a batch an exception kept from the last call
            if taken is None:
                if self._in_flight < self.prefetch:
                    # The dispatch after the last commit was cut short (an exception from a
                    # signal handler): with nothing in flight, the wait below would wait for
                    # a batch no worker was asked for.
                    self._dispatch_more()
                waited = self._wait_for_next()
                if isinstance(waited, Marker):
                    return waited
                taken = waited
            idx, item = taken
            with self.lock:
                if type(item) is RawBatch:
                    key = (item.epoch, item.idx)
                    outstanding = self.roster.workers[item.slot].outstanding
                    try:
                        item = self._claim(item)   # claimed again if a call before was cut short
                    except wire.ProtocolError as e:
                        err = WorkerError(f"mxload could not take batch {idx} in the main process: {e}",
                                          None, None, None, idx)
                        self.supervisor.fail(err)
                        raise self._own(self.supervisor.failure or err) from None
                    if item is None:
                        if key[0] != self.epoch:
                            outstanding.pop(key, None)   # of an abandoned epoch
                        rb.handover = None
                        continue   # its worker died meanwhile: the task was dispatched again
                    del outstanding[key]   # (the commit below is plain stores)
                skip = item is EXHAUSTED or self._discard > 0
                counted = not skip and type(item) is not BatchFailure
                # The commit: plain stores, no call, so no signal handler runs
                # until the batch has moved from the buffer's slot to `ready`.
                self._yielded += 1
                self._in_flight -= 1
                if skip:
                    if item is not EXHAUSTED:
                        self._discard -= 1   # replayed stream batch, already seen before the checkpoint
                else:
                    self.ready = (idx, item)
                    if counted:
                        self.counts["batches"] += 1
                rb.handover = None
                self._dispatch_more()
            if skip:
                continue
            return idx, item

    def _wait_for_next(self) -> tuple[int, Any] | Marker:
        """Wait for the next batch (in order: the next of the plan; else any)
        and return what the wait left in the buffer's hand-over slot; END or
        CLOSED_BY_OTHER.  Nothing is committed here: an exception leaves the
        batch in the slot for the next call."""
        plan = self._plan
        order = plan.order if plan is not None else None
        if order is not None:
            if self._yielded >= len(order):   # only the consumer moves _yielded
                return END
        else:
            with self.lock:   # a stream: every worker's ended, and no task is out
                if self._in_flight == 0 and self.roster.all_done():
                    return END
        idx = -1
        rb = self.buffer
        filling = self._yielded < self.prefetch   # the epoch's first window: a wait is the workers' start
        try:
            if self.options.in_order:
                idx = order[self._yielded] if order is not None else self._yielded
                self.transport.next_result(rb, idx, False, self.options.timeout, filling)
            else:
                self.transport.next_result(rb, 0, True, self.options.timeout, filling)
        except TimeoutError:
            raise self._own(timeout_error(self, idx)) from None
        except BufferClosedError:
            if self.supervisor.failure is not None:
                raise self._own(self.supervisor.failure) from None
            return CLOSED_BY_OTHER
        taken: tuple[int, Any] | None = rb.handover
        assert taken is not None, "a wait that returned left its batch in the hand-over slot"
        return taken

    def _own(self, error: BaseException) -> BaseException:
        """`error`, recorded as one that ends the epoch (next_batch raises it)."""
        self.own_error = error
        return error

    def _claim(self, raw: RawBatch) -> Any:
        """The batch the receive path stored raw, with its task's slab taken
        (the same batch for a RawBatch claimed before); None if the task is
        gone or of an abandoned epoch (engine lock held).  The caller removes
        the task from `outstanding`."""
        batch = self.transport.claim(raw)
        if batch is None:
            return None
        if (raw.epoch, raw.idx) not in self.roster.workers[raw.slot].outstanding or raw.epoch != self.epoch:
            return None   # dropping the batch returns its slab to the pool
        return batch

    # ------------------------------------------------------------------ shutdown

    @defer_sigint
    def shutdown(self) -> None:
        """End the workers and release everything; idempotent, thread-safe,
        bounded by shutdown.SHUTDOWN_DEADLINE_S however stuck the workers
        are.  In a forked child (a user's os.fork()) the inherited copy is
        inert: the workers belong to the process that created them.  A
        Ctrl-C meanwhile is raised once the sequence is complete."""
        if self.state == CLOSED:
            return
        if os.getpid() != self._pid:
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
