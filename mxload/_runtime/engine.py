"""The multi-worker engine: the prefetch window, dispatch, consuming from
the ReorderBuffer, and the failure record.

One Engine owns one transport's workers (transport.py: processes or
threads) and the ReorderBuffer they fill.  An epoch is iterated through an
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

import dataclasses
import os
import pickle
import signal
import sys
import threading
import warnings
from dataclasses import dataclass
from multiprocessing import util as mp_util
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core import BufferClosedError, RawBatch, ReorderBuffer, defer_sigint
from ..backends import workers_backend
from ..errors import EpochAbortedError, LoaderTimeoutError, WorkerError
from . import messages as m
from . import wire
from .remote_errors import rebuild_exception
from .shutdown import shutdown_sequence
from .transport import Delivery, Transport, TransportSetup, WorkerLoss
from .worker import WorkerConfig

if TYPE_CHECKING:
    from .._options import LoaderOptions
    from ..profiler import Profiler
    from .epoch import EpochPlan

RUNNING, SHUTTING_DOWN, CLOSED = "running", "shutting down", "closed"

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
_EXHAUSTED = Marker("EXHAUSTED")     # a worker's stream ended (not a batch)
_NOT_SENT = Marker("NOT_SENT")


def _torch_words(loss: WorkerLoss) -> str:
    """How torch's DataLoader says a worker died (programs and people grep
    logs for it): killed by a signal, or exited."""
    if loss.exitcode is not None and loss.exitcode < 0:
        try:
            name = signal.strsignal(-loss.exitcode) or f"signal {-loss.exitcode}"
        except ValueError:
            name = f"signal {-loss.exitcode}"
        return f"DataLoader worker (pid {loss.pid}) is killed by signal: {name}."
    return f"DataLoader worker (pid(s) {loss.pid}) exited unexpectedly:"


def start_failure(failed: m.InitFailed, worker_id: int, pid: int | None) -> WorkerError:
    """A worker process that could not start: a WorkerError (a RuntimeError,
    as torch's for a worker that could not start) with the worker's own error
    text, and what to do about the usual causes."""
    info = failed.error
    hint = ""
    if "__main__" in info.message or "__mp_main__" in info.message or "bootstrapping" in info.message:
        hint = ("\n\nA spawn or forkserver worker imports the main module again, then unpickles the dataset: "
                "classes and functions it uses must be importable (defined in a module, or in a script run "
                "from a file, not with -c or interactively), and the script must start its loaders under "
                "`if __name__ == \"__main__\":`. Or use multiprocessing_context=\"fork\".")
    err = WorkerError(f"mxload worker {worker_id} (pid {pid}) could not start: {failed.starting} raised "
                      f"{info.module}.{info.qualname}: {info.message}{hint}\n\nWorker traceback:\n"
                      f"{info.traceback}", worker_id, pid, None, None)
    if info.pickled is not None:
        try:
            err.__cause__ = pickle.loads(info.pickled)
        except Exception:
            pass
    return err


@dataclass
class _Worker:
    """The engine's view of one worker (the transport keeps its channel)."""
    alive: bool = True
    exhausted: bool = False
    # (epoch, batch index) -> indices, in dispatch order: what a restart sends again.
    outstanding: dict[tuple[int, int], np.ndarray | None] = dataclasses.field(default_factory=dict)


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
        self._lock = threading.RLock()          # dispatch, results, the worker table
        self._shutdown_lock = threading.Lock()
        self._rb = ReorderBuffer()
        self._rb.keep_handover = True   # see next_batch
        # Every worker's entry exists before any runs: one may report at once.
        self._workers = [_Worker() for _ in range(options.num_workers)]
        self._failure: BaseException | None = None
        self._restarts = 0
        self._plan: EpochPlan | None = None
        # The consumer's hand-over (next_batch): the batch handed out last,
        # until the iterator has returned it; what the engine raised last;
        # what a signal handler's exception cut short (the epoch is aborted).
        self.ready: tuple[int, Any] | None = None
        self.own_error: BaseException | None = None
        self.torn: str | None = None
        self._discard = 0
        self._next_dispatch = self._yielded = self._in_flight = 0
        # The workers that take tasks (alive, stream not exhausted), by id;
        # None once any worker's state changed (begin_epoch, an Exhausted delivered,
        # worker_lost, _restart, shutdown).
        self._takers: list[int] | None = None
        self._finalizer: mp_util.Finalize | None = None
        config = WorkerConfig(0, options.num_workers, options.seed, epoch,
                              (options.dataset, options.batchify_fn, options.worker_init_fn),
                              options.iterable, options.fetch_batch_size, options.drop_last,
                              zygote_child=False, keyed=not options.auto_batching)
        backend = workers_backend(options.backend, options.thread_pool, options.start_method)
        self.transport: Transport = backend.make_transport(TransportSetup(
            self, self._lock, config, self._rb, type(options.dataset).__name__, self.prefetch,
            options.timeout))
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
        return (self.state == RUNNING and self._failure is None and self.transport.reusable()
                and os.getpid() == self._pid)

    def began(self, epoch: int) -> bool:
        """Whether this engine already began epoch `epoch` (an iter() that a
        Ctrl-C interrupted once its tasks were out): beginning it again would
        mix its answers with the new ones, both named (epoch, batch index)."""
        return self._plan is not None and self.epoch == epoch

    def counters(self) -> list[dict[str, int]]:
        """The counters of this engine and of its transport's components, each owned (and
        counted) by one of them; they stay readable after the engine ends."""
        return [self.counts, *self.transport.counters()]

    @property
    def stats(self) -> dict[str, int]:
        """Every counter, merged (``loader.stats``)."""
        return merge_counters(self.counters())

    def worker_pids(self) -> list[int | None]:
        """Each worker's pid (None for a thread), by worker id."""
        return [self.transport.pid(wid) for wid in range(len(self._workers))]

    @property
    def total_batches(self) -> int | None:
        return None if self._plan is None or self._plan.order is None else len(self._plan.order)

    # ------------------------------------------------------------------ epochs and dispatch

    def begin_epoch(self, epoch: int, plan: EpochPlan, profiler: Profiler | None) -> None:
        """Start delivering `plan` (the batches of epoch `epoch`)."""
        with self._lock:
            if self.state != RUNNING:
                raise RuntimeError(f"the loader's workers are {self.state}")
            self.epoch = epoch
            self.profiler = profiler
            self.counts["epochs"] += 1
            self.transport.epoch_closed = False
            for wid, key in self.transport.drop_held():   # the epoch before's, never sent
                self._workers[wid].outstanding.pop(key, None)
            stale = self._rb.start_epoch(epoch)
            for item in stale.values():
                if isinstance(item, RawBatch):
                    self._claim(item)   # of the epoch before: its slab returns to the pool
                    self._workers[item.slot].outstanding.pop((item.epoch, item.idx), None)
            for w in self._workers:
                w.exhausted = False
            self._takers = None
            self._plan = plan
            self.ready = self.own_error = self.torn = None
            self._discard = plan.discard
            self._next_dispatch = self._yielded = self._in_flight = 0
            self._dispatch_more()
        del stale  # recycled slabs of the previous epoch, released outside the lock

    def close_epoch(self) -> None:
        """The epoch's iterator is closed, the workers stay (persistent): a
        send waiting on a worker that is not reading gives up now.  Without
        the engine lock, which that send's thread holds."""
        self.transport.epoch_closed = True

    def _pick_worker(self, idx: int) -> int | None:
        live = self._takers
        if live is None:
            live = self._takers = [wid for wid, w in enumerate(self._workers) if w.alive and not w.exhausted]
        if not live:
            return None
        n = len(live)
        if self.options.in_order or n == 1:
            # Round-robin by batch index, not least-loaded: which worker loads
            # which batch (and so which per-worker random stream it sees) must
            # not depend on timing, nor on where a resumed epoch starts.
            return live[idx % n]
        # in_order=False gives up that determinism for throughput, as torch's:
        # the worker with the fewest tasks out, so a straggler's queue stays at
        # its share of the window while the others take the rest (ties go
        # round-robin).  Its tasks are popped when their batch is taken.
        workers = self._workers
        start = idx % n
        best, best_load = live[start], len(workers[live[start]].outstanding)
        for k in range(1, n):
            wid = live[(start + k) % n]
            load = len(workers[wid].outstanding)
            if load < best_load:
                best, best_load = wid, load
        return best

    def _dispatch_more(self) -> None:
        """Fill the prefetch window with the plan's next tasks."""
        plan = self._plan
        assert plan is not None
        order, batches = plan.order, plan.batches
        transport = self.transport
        profiling = self.profiler is not None
        with self._lock:
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
                wid = self._pick_worker(idx)
                if wid is None:
                    return
                # This runs in the training loop's thread, where a signal
                # handler may raise after any call made from Python.  So the
                # task enters the books by plain stores, and the worker's
                # queue by one compiled call, last: an exception finds it in
                # both or in neither, never sent twice nor lost.  What was
                # put is sent now or by a later send_queued/flush.
                put = transport.task_putter(wid)
                if put is None:   # (Ray) no such queue: a cut here aborts the epoch
                    self.torn = f"the dispatch of batch {idx}'s task"
                    self._send(wid, idx, indices)
                    self._next_dispatch = n + 1
                    self._in_flight += 1
                    self.torn = None
                    continue
                epoch = self.epoch
                self._workers[wid].outstanding[(epoch, idx)] = indices
                self._next_dispatch = n + 1
                self._in_flight += 1
                put((epoch, idx, indices, profiling))
                transport.send_queued(wid)

    def _send(self, wid: int, idx: int, indices: np.ndarray | None) -> None:
        self._workers[wid].outstanding[(self.epoch, idx)] = indices
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
            raise self._own(RuntimeError(
                f"this iterator's workers belong to process {self._pid}, not to this forked child "
                f"(pid {os.getpid()}); call iter(loader) again in the child to start its own"))
        if self.torn is not None:
            raise self._own(self._aborted_error(self.torn))
        timeout = self.options.timeout
        in_order = self.options.in_order
        rb = self._rb
        while True:
            taken = rb.handover   # a batch an exception kept from the last call
            if taken is None:
                plan = self._plan
                order = plan.order if plan is not None else None
                if order is not None:
                    if self._yielded >= len(order):   # only the consumer moves _yielded
                        return END
                elif self._finished():
                    return END
                idx = -1
                try:
                    if in_order:
                        idx = order[self._yielded] if order is not None else self._yielded
                        self.transport.next_result(rb, idx, False, timeout)
                    else:
                        self.transport.next_result(rb, 0, True, timeout)
                except TimeoutError:
                    raise self._own(self._timeout_error(idx)) from None
                except BufferClosedError:
                    if self._failure is not None:
                        raise self._own(self._failure) from None
                    return CLOSED_BY_OTHER
                taken = rb.handover
                assert taken is not None, "a wait that returned left its batch in the hand-over slot"
            idx, item = taken
            with self._lock:
                if type(item) is RawBatch:
                    key = (item.epoch, item.idx)
                    outstanding = self._workers[item.slot].outstanding
                    try:
                        item = self._claim(item)   # claimed again if a call before was cut short
                    except wire.ProtocolError as e:
                        err = WorkerError(f"mxload could not take batch {idx} in the main process: {e}",
                                          None, None, None, idx)
                        self.fail(err)
                        raise self._own(self._failure or err) from None
                    if item is None:
                        if key[0] != self.epoch:
                            outstanding.pop(key, None)   # of an abandoned epoch
                        rb.handover = None
                        continue   # its worker died meanwhile: the task was dispatched again
                    del outstanding[key]   # (the commit below is plain stores)
                skip = item is _EXHAUSTED or self._discard > 0
                counted = not skip and type(item) is not BatchFailure
                # The commit: plain stores, no call, so no signal handler runs
                # until the batch has moved from the buffer's slot to `ready`.
                self._yielded += 1
                self._in_flight -= 1
                if skip:
                    if item is not _EXHAUSTED:
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

    def _own(self, error: BaseException) -> BaseException:
        """`error`, recorded as one that ends the epoch (next_batch raises it)."""
        self.own_error = error
        return error

    def _aborted_error(self, where: str) -> EpochAbortedError:
        return EpochAbortedError(
            f"this epoch was aborted: an exception raised inside next() by a signal handler cut short "
            f"{where}, so the epoch's remaining batches can no longer be delivered exactly once. "
            f"Batches delivered before are correct. Start a new epoch with iter(loader) (a checkpoint from "
            f"state_dict() resumes where it stopped); to avoid this, raise from a signal handler only "
            f"outside the loader's code, or set a flag there and act on it in the training loop")

    def _claim(self, raw: RawBatch) -> Any:
        """The batch the receive path stored raw, with its task's slab taken
        (the same batch for a RawBatch claimed before); None if the task is
        gone or of an abandoned epoch (engine lock held).  The caller removes
        the task from `outstanding`."""
        batch = self.transport.claim(raw)
        if batch is None:
            return None
        if (raw.epoch, raw.idx) not in self._workers[raw.slot].outstanding or raw.epoch != self.epoch:
            return None   # dropping the batch returns its slab to the pool
        return batch

    def _timeout_error(self, idx: int) -> LoaderTimeoutError:
        states = [(wid, self.transport.pid(wid), self.transport.describe(wid))
                  for wid, w in enumerate(self._workers) if w.alive]
        waited = f"batch {idx}" if self.options.in_order else "any batch"
        stopped = any(s.startswith("stopped") for _, _, s in states)
        return LoaderTimeoutError(
            # torch's words first ("DataLoader timed out after N seconds"): programs match them.
            f"DataLoader timed out after {self.options.timeout} seconds: "
            f"no {waited} within timeout={self.options.timeout} s{self._whereabouts(idx)}; "
            f"workers (id, pid, state): {states}. "
            + ("A stopped worker runs again after SIGCONT (kill -CONT PID). " if stopped else "")
            + "A worker may be stuck in __getitem__; raise `timeout` if batches are "
            "legitimately slow")

    def _whereabouts(self, idx: int) -> str:
        """Where the awaited batch is: which worker holds its task, or why none does."""
        if not self.options.in_order:
            return ""
        with self._lock:
            holders = [wid for wid, w in enumerate(self._workers) if (self.epoch, idx) in w.outstanding]
        if not self.transport.receiving:
            return " (the fetcher thread is not running)"
        if not holders:
            return " (no worker holds its task: mxload lost track of it; please report this as a bug)"
        return "".join(f" (its task is with worker {wid}, pid {self.transport.pid(wid)})" for wid in holders)

    def _finished(self) -> bool:
        with self._lock:
            if self._plan is not None and self._plan.order is not None:
                return self._yielded >= len(self._plan.order)
            return self._in_flight == 0 and all(w.exhausted or not w.alive for w in self._workers)

    # ------------------------------------------------------------------ results (ResultSink)

    def deliver(self, worker_id: int, result: Delivery) -> None:
        with self._lock:
            pid = self.transport.pid(worker_id)
            if isinstance(result, m.InitFailed):   # worker_init_fn failed: the worker is unusable
                self.fail(start_failure(result, worker_id, pid) if result.starting
                          else rebuild_exception(result.error, worker_id, pid, -1))
                return
            w = self._workers[worker_id]
            idx = result.batch_index
            if w.outstanding.pop((result.epoch, idx), _NOT_SENT) is _NOT_SENT or result.epoch != self.epoch:
                return   # of an abandoned epoch: dropped (its slab returns to the pool)
            if isinstance(result, m.Loaded):
                self._store(idx, result.batch)
                if self.profiler is not None and result.timings is not None:
                    t = result.timings
                    self.profiler.worker_batch(worker_id, pid, idx, t.start_ns, t.fetch_ns, t.collate_ns,
                                               t.sent_ns, t.field_stats, t.field_ns,
                                               transported=self.transport.transported)
            elif isinstance(result, m.Exhausted):
                w.exhausted = True
                self._takers = None
                self._store(idx, _EXHAUSTED)
            else:
                self._store(idx, BatchFailure(rebuild_exception(result.error, worker_id, pid, idx)))

    def _store(self, idx: int, item: Any) -> None:
        try:
            self._rb.put(idx, item)
        except BufferClosedError:
            pass  # the epoch already failed or is shutting down: drop it

    def held(self, worker_id: int) -> list[int]:
        return [i for e, i in self._workers[worker_id].outstanding if e == self.epoch]

    def fail(self, error: BaseException) -> None:
        """Record a fatal error and wake the consumer with it."""
        if self._failure is None:
            self._failure = error
        self._rb.close(str(error))

    def worker_lost(self, loss: WorkerLoss) -> None:
        with self._lock:
            wid = loss.worker_id
            self._workers[wid].alive = False
            self._takers = None
            if self.state != RUNNING:
                return
            held = sorted(self.held(wid))
            first = held[0] if held else None
            if loss.final is not None:
                self.fail(loss.error_type(loss.final(held), wid, loss.pid, loss.exitcode, first))
                return
            limit = self.options.max_worker_restarts
            if self._restarts < limit and not self.options.iterable and self.transport.restartable:
                # A stream's position died with its worker: those are never restarted.
                self._restarts += 1
                self.counts["worker_restarts"] += 1
                if self.profiler is not None:
                    self.profiler.worker_restarted(wid)
                warnings.warn(f"mxload worker {wid} (pid {loss.pid}) died ({loss.how}{loss.hint}); "
                              f"restarting it ({self._restarts}/{limit})", RuntimeWarning, stacklevel=1)
                self._restart(wid)
                return
            self.fail(loss.error_type(
                f"{_torch_words(loss)} mxload worker {wid} (pid {loss.pid}) died ({loss.how}){loss.hint} "
                f"while holding batches {held}" +
                (f"; max_worker_restarts={limit} exhausted" if limit else ""),
                wid, loss.pid, loss.exitcode, first))

    def _restart(self, wid: int) -> None:
        """Replace a lost worker and dispatch its batches again (engine lock held)."""
        try:
            if not self.transport.restart(wid, self.epoch):
                return   # shutting down
        except Exception as e:
            self.fail(WorkerError(f"could not restart worker {wid}: {e}", wid))
            return
        dead, self._workers[wid] = self._workers[wid], _Worker()
        self._takers = None
        for (epoch, idx), indices in sorted(dead.outstanding.items()):
            if epoch == self.epoch:
                self._send(wid, idx, indices)
        # The consumer may be asleep waiting for one of these: none is held.
        self.transport.flush()

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
                shutdown_sequence(self.transport, self._rb)
                for w in self._workers:
                    w.outstanding.clear()
                    w.alive = False
                self._takers = None
            finally:
                # Whatever happened above, this engine is finished: never run twice.
                self.state = CLOSED
                if self._finalizer is not None:
                    self._finalizer.cancel()

    def __repr__(self) -> str:
        return f"<mxload Engine {self.state}, {len(self._workers)} workers>"
