"""The multi-worker engine: dispatch, the fetcher thread, and shutdown.

One Engine owns the workers (processes or threads), the slab pool, the
ReorderBuffer and (for processes) the fetcher thread.  An epoch is iterated
through an EpochIterator, a thin object the training loop holds: when it is
exhausted, closed, or garbage-collected (``for ...: break``), the engine shuts
down, unless the loader keeps it for persistent workers.

States: RUNNING -> SHUTTING_DOWN -> CLOSED.  ``Engine.shutdown`` is the only
place that ends workers; every way an iteration can end goes through it.

Ctrl-C: the start-up (``start_epoch``) and the shutdown run with SIGINT
deferred (``_core.defer_sigint``): a Ctrl-C that lands inside them lets them
finish, so no worker, thread or descriptor is left half made or half ended,
and is then raised once; one that lands in a finalizer (``__del__`` after
``break``) is made pending again for the code the finalizer interrupted
instead of being printed as "Exception ignored".
"""
from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import os
import pickle
import queue
import select
import selectors
import signal
import socket
import sys
import threading
import time
import warnings
import weakref
from multiprocessing import connection as mp_connection
from multiprocessing import util as mp_util
from typing import Any

import numpy as np

from . import _fds
from ._core import BatchOwner, BufferClosedError, ReorderBuffer, defer_sigint, sigint_safe_finalizer
from ._procs import SpawnedWorker, Zygote, block_sigint_in_this_thread, ensure_fork_server, sigint_deferred
from ._slabs import SlabPool
from ._worker import (
    WorkerConfig,
    in_worker_process,
    recv_frame,
    send_frame,
    thread_worker_main,
    worker_process_main,
    worker_seed,
)
from .batchify import views_from_layout
from .errors import SHARED_MEMORY_ADVICE, LoaderTimeoutError, SharedMemoryError, WorkerError

RUNNING, SHUTTING_DOWN, CLOSED = "running", "shutting down", "closed"

# Shutdown budget: a worker between tasks exits within a few ms of the stop
# message; one still inside a batch (whose result nobody wants any more) gets
# SIGTERM after the grace period, SIGKILL after the terminate period; every
# wait shares the one deadline.
SHUTDOWN_GRACE_S = 0.02
SHUTDOWN_TERMINATE_S = 0.5
SHUTDOWN_DEADLINE_S = 1.0

_END = object()
_CLOSED = object()
_EXHAUSTED = object()

# Slab descriptors the main process keeps for recycling (beyond this, kept
# batches cost a mapping each, never a descriptor; see SlabPool).
MAX_POOLED_SLABS = 64

# Every engine of this process: forking a zygote pauses the others' fetcher
# threads, so that mxload never forks while a thread of its own runs.
_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_fork_lock = threading.Lock()


class _Closing(Exception):
    """A worker start was refused or undone: the engine is shutting down."""


def _forget_inherited_workers() -> None:
    """In a forked child: the engines' worker processes are the parent's.
    Take them out of multiprocessing's children, whose exit handler would
    otherwise terminate them when this child exits."""
    children = getattr(mp.process, "_children", None)
    if children is None:
        return
    for engine in list(_engines):
        for proc in list(engine._processes):
            children.discard(proc)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_inherited_workers)


def _zygote_worker_entry(template: WorkerConfig, worker_id: int, epoch: int, sock: socket.socket) -> None:
    worker_process_main(dataclasses.replace(template, worker_id=worker_id, epoch=epoch), sock)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exit code {exitcode}"


# /proc/PID/stat states worth naming when a worker does not answer.
_PROC_STATES = {"T": "stopped (SIGSTOP or a job-control stop)", "t": "stopped by a debugger",
                "D": "in uninterruptible I/O", "Z": "exited, not yet reaped"}


def _worker_state(w: _WorkerHandle) -> str:
    """'alive', or why a live worker process cannot be making progress."""
    if w.pid is None or w.tasks is not None:
        return "alive"   # a thread
    try:
        with open(f"/proc/{w.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "alive"   # no /proc (macOS): nothing more to say
    return _PROC_STATES.get(state, "alive")


def _rebuild_exception(info: tuple[Any, ...], worker_id: int, pid: int | None,
                       batch_index: int) -> BaseException:
    """The consumer-side exception for one raised in a worker: the same type
    where it can be rebuilt from a message, else WorkerError naming it."""
    module, qualname, message, tb, blob = info
    where = (f"loading batch {batch_index}" if batch_index >= 0 else "running worker_init_fn")
    text = (f"{message}\n\nRaised in worker {worker_id} (pid {pid}) while {where}. "
            f"Worker traceback:\n{tb}")
    original = None
    if blob is not None:
        try:
            original = pickle.loads(blob)
        except Exception:
            original = None
    if original is not None:
        try:
            rebuilt = type(original)(text)
            # Not SystemExit & co: re-raised here they would end the training program.
            if isinstance(rebuilt, Exception):
                return rebuilt  # the text already carries the worker's traceback
        except Exception:
            pass
    err = WorkerError(f"{module}.{qualname}: {text}", worker_id, pid, None,
                      batch_index if batch_index >= 0 else None)
    err.__cause__ = original
    return err


class _Failure:
    """A failure stored in the ReorderBuffer in place of a batch."""
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class _WorkerHandle:
    """The main process's view of one worker."""

    def __init__(self, worker_id: int):
        self.worker_id = worker_id
        self.process: Any = None        # mp.Process, _procs.ZygoteWorker or threading.Thread
        self.sock: socket.socket | None = None   # process mode: the task socket (see _worker)
        self.tasks: queue.Queue[Any] | None = None   # thread mode
        self.known_slabs: set[Any] = set()
        self.pending_drops: list[int] = []
        # (epoch, batch idx) -> (indices, slab).  Tasks of an abandoned epoch
        # stay here until their result arrives: the worker may still be
        # writing into their slab, so it must not be handed out again.
        self.outstanding: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.pid: int | None = None     # kept: the process object is closed once it is reaped
        self.alive = True
        self.exhausted = False


class Engine:
    """Workers, slabs, reorder buffer and fetcher for one loader."""

    def __init__(self, loader: Any):
        self.num_workers = loader.num_workers
        self.prefetch = max(loader.prefetch, 1)
        self.timeout = loader.timeout
        self.in_order = loader.in_order
        self.iterable = loader.iterable
        self.batch_size = loader._fetch_batch_size   # samples per batch of a stream (0: none)
        self.drop_last = loader.last_batch == "discard"
        self.seed = loader.seed
        self.use_threads = loader.thread_pool
        self.max_restarts = loader.max_worker_restarts
        self.payload = (loader.dataset, loader.batchify_fn, loader.worker_init_fn)
        self.dataset_type = type(loader.dataset).__name__
        self.stats: dict[str, int] = {
            "batches": 0, "slabs_created": 0, "slabs_reused": 0, "slabs_retired": 0,
            "worker_restarts": 0, "epochs": 0,
        }
        self.state = RUNNING
        self.epoch = loader.epoch
        self._pid = os.getpid()                 # only this process may end the workers
        self._lock = threading.RLock()          # dispatch + worker table
        self._shutdown_lock = threading.Lock()
        self._rb = ReorderBuffer()
        self._pool = SlabPool(self.stats, MAX_POOLED_SLABS)
        self._workers: list[_WorkerHandle] = []
        self._zygote: Zygote | None = None
        # Every worker process started and not yet closed, registered under
        # _start_lock the moment it exists; once _closing is set, no start
        # begins and one that was under way ends its process itself.
        self._processes: list[Any] = []
        self._start_lock = threading.Lock()
        self._closing = False
        self._fetcher: threading.Thread | None = None
        self._fetcher_lock = threading.Lock()   # swapping the fetcher thread (pause/resume)
        self._stop_fetcher = False
        self._pause_fetcher = False
        self._wake_r, self._wake_w = (-1, -1)
        self._failure: BaseException | None = None
        self._restarts = 0
        self._batches: list[Any] | None = None
        self._order: list[Any] | None = None     # batch indices this epoch delivers, in order
        self._discard = 0                      # stream batches to drop (IterableDataset resume)
        self._next_dispatch = 0
        self._next_yield = 0
        self._yielded = 0
        self._in_flight = 0
        self.last_index = -1
        self.profiler: Any = None
        self._start_method = self._choose_start_method(loader.start_method)
        self._spawn_payload: bytes | None = None
        self._finalizer: Any = None
        _engines.add(self)
        try:
            if self.use_threads:
                # Every handle exists before any thread runs: a thread may
                # report (a failed worker_init_fn) as soon as it starts.
                self._workers = [self._thread_worker(wid) for wid in range(self.num_workers)]
                for w in self._workers:
                    self._start_thread_worker(w)
            else:
                self._start_processes()
                self._wake_r, self._wake_w = os.pipe()
                _fds.own(self._wake_r)
                _fds.own(self._wake_w)
                self._start_fetcher()
        except BaseException:
            self.shutdown()
            raise
        # Runs at interpreter exit before multiprocessing's own teardown.
        self._finalizer = mp_util.Finalize(None, self.shutdown, exitpriority=100)

    # ------------------------------------------------------------------ start

    @staticmethod
    def _choose_start_method(requested: str | None) -> str:
        if requested is not None:
            return requested
        return "fork" if sys.platform.startswith("linux") else mp.get_start_method()

    @property
    def start_method(self) -> str:
        """How this engine's workers, and their replacements, are started."""
        return self._start_method

    @property
    def zygote_pid(self) -> int | None:
        """The pid of the process that forks the workers (start method fork)."""
        return self._zygote.pid if self._zygote is not None else None

    @property
    def usable(self) -> bool:
        """Running, and in the process that created it (a forked child's copy is inert)."""
        return self.state == RUNNING and os.getpid() == self._pid

    def _pickled_payload(self) -> bytes:
        try:
            return pickle.dumps(self.payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(
                f"the dataset ({self.dataset_type}), batchify_fn or worker_init_fn cannot be pickled "
                f"for {self._start_method!r} workers: {e}. Make them picklable (module-level "
                f"functions and classes) or use start_method='fork'") from e

    def _start_processes(self) -> None:
        """The first workers (and, for fork, the zygote that forks them)."""
        if in_worker_process():
            raise RuntimeError(
                "cannot start worker processes inside a mxload worker process; inside a dataset "
                "use num_workers=0 or thread_pool=True")
        if self._start_method != "fork":
            self._spawn_payload = self._pickled_payload()
        with sigint_deferred():
            if self._start_method == "fork":
                template = WorkerConfig(0, self.num_workers, self.seed, self.epoch, self.payload,
                                        self.iterable, self.batch_size, self.drop_last, zygote_child=True)
                with _fork_lock:
                    paused = [e for e in list(_engines) if e is not self and e._pause()]
                    try:
                        self._zygote = Zygote(functools.partial(_zygote_worker_entry, template))
                    finally:
                        for e in paused:
                            e._resume()
            for wid in range(self.num_workers):
                self._workers.append(self._start_worker(wid, hand_over=False))
            for w in self._workers:
                if isinstance(w.process, SpawnedWorker) and w.sock is not None:
                    w.process.hand_over(w.sock)   # all their interpreters start meanwhile

    def _start_worker(self, wid: int, hand_over: bool = True) -> _WorkerHandle:
        """Start worker `wid` (at start-up, or replacing a dead one from the
        fetcher thread); raises _Closing once shutdown has begun.  A spawn
        worker gets its dataset now, or (hand_over=False) from the caller."""
        handle = _WorkerHandle(wid)
        parent_end, child_end = socket.socketpair()
        _fds.own(parent_end)
        try:
            with sigint_deferred(), self._start_lock:
                if self._closing:
                    raise _Closing()
                proc: Any
                if self._zygote is not None:
                    proc = self._zygote.start(wid, self.epoch, child_end)
                else:
                    config = WorkerConfig(wid, self.num_workers, self.seed, self.epoch,
                                          self._spawn_payload or self._pickled_payload(), self.iterable,
                                          self.batch_size, self.drop_last, zygote_child=False)
                    if self._start_method == "spawn":
                        proc = SpawnedWorker(config, child_end)
                        if hand_over:
                            proc.hand_over(parent_end)
                    else:
                        ensure_fork_server()
                        ctx: Any = mp.get_context(self._start_method)  # typeshed's BaseContext lacks Process
                        proc = ctx.Process(target=worker_process_main, args=(config, child_end),
                                           name=f"mxload-worker-{wid}", daemon=True)
                        proc.start()
                if self._closing:
                    # Shutdown began while this one started and did not wait
                    # for it: it is not in the list shutdown ends, so end it here.
                    now = time.monotonic()
                    self._end_processes([proc], now, now + SHUTDOWN_DEADLINE_S)
                    raise _Closing()
                self._processes.append(proc)
        except BaseException:
            _fds.close_socket(parent_end)
            raise
        finally:
            child_end.close()
        handle.process = proc
        handle.pid = proc.pid
        handle.sock = parent_end
        return handle

    def _thread_worker(self, wid: int) -> _WorkerHandle:
        handle = _WorkerHandle(wid)
        handle.tasks = queue.Queue()
        handle.process = threading.Thread(
            target=thread_worker_main,
            args=(self, wid, self.num_workers, worker_seed(self.seed, self.epoch, wid), handle.tasks),
            name=f"mxload-worker-thread-{wid}", daemon=True)
        return handle

    def _start_thread_worker(self, handle: _WorkerHandle) -> None:
        handle.process.start()

    # ------------------------------------------------------------------ epochs

    def begin_epoch(self, epoch: int, batches: list[Any] | None, order: list[int] | None,
                    profiler: Any = None, discard: int = 0) -> None:
        """Start an epoch: `batches` of indices and the `order` of the batch
        indices to deliver (a resumed epoch leaves out those already taken), or
        both None for an IterableDataset, whose resumed stream drops its first
        `discard` batches."""
        with self._lock:
            if self.state != RUNNING:
                raise RuntimeError(f"the loader's workers are {self.state}")
            self.epoch = epoch
            self.profiler = profiler
            self.stats["epochs"] += 1
            stale = self._rb.clear()
            for w in self._workers:
                w.exhausted = False
            self._batches = batches
            self._order = order
            self._discard = discard
            self._next_dispatch = self._next_yield = self._yielded = self._in_flight = 0
            self._dispatch_more()
        del stale  # recycled slabs of the previous epoch, released outside the lock

    @property
    def total_batches(self) -> int | None:
        return None if self._order is None else len(self._order)

    def _pick_worker(self, idx: int) -> _WorkerHandle | None:
        live = [w for w in self._workers if w.alive and not w.exhausted]
        if not live:
            return None
        # Round-robin by batch index, not least-loaded: which worker loads
        # which batch (and so which per-worker random stream it sees) must not
        # depend on timing, nor on where a resumed epoch starts.
        return live[idx % len(live)]

    def _dispatch_more(self) -> None:
        with self._lock:
            while self.state == RUNNING and self._in_flight < self.prefetch:
                if self._order is not None:
                    if self._next_dispatch >= len(self._order):
                        return
                    idx = self._order[self._next_dispatch]
                    indices = self._batches[idx]  # type: ignore[index]  # set with _order
                else:
                    idx, indices = self._next_dispatch, None
                worker = self._pick_worker(idx)
                if worker is None:
                    return
                self._send_task(worker, idx, indices)
                self._next_dispatch += 1
                self._in_flight += 1

    def _send_task(self, worker: _WorkerHandle, idx: int, indices: Any) -> None:
        if self.use_threads:
            worker.outstanding[(self.epoch, idx)] = (indices, None)
            assert worker.tasks is not None
            worker.tasks.put((self.epoch, idx, indices, self.profiler is not None))
            return
        slab = self._pool.acquire()
        worker.outstanding[(self.epoch, idx)] = (indices, slab)
        slab_id = slab.slab_id if slab is not None else None
        fd_follows = slab is not None and slab_id not in worker.known_slabs
        drops, worker.pending_drops = worker.pending_drops, []
        try:
            raw = None if indices is None else np.ascontiguousarray(indices, np.int64).tobytes()
            assert worker.sock is not None
            send_frame(worker.sock, (self.epoch, idx, raw, slab_id, slab.size if slab is not None else 0,
                                     fd_follows, drops, self.profiler is not None),
                       [self._pool.fd(slab_id)] if fd_follows else [])  # type: ignore[arg-type]
            if fd_follows:
                worker.known_slabs.add(slab_id)
        except OSError:
            pass  # the worker is dead; the fetcher reports it and re-dispatches or fails

    # ------------------------------------------------------------------ consumer

    def next_batch(self) -> Any:
        """The next batch for the consumer, a _Failure (the dataset or collation
        raised for that batch), or _END.  Raises what ended the epoch."""
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this iterator's workers belong to process {self._pid}, not to this forked child "
                f"(pid {os.getpid()}); call iter(loader) again in the child to start its own")
        while True:
            if self._finished():
                return _END
            try:
                if self.in_order:
                    idx = self._order[self._next_yield] if self._order is not None else self._next_yield
                    item = self._rb.get(idx, self.timeout)
                else:
                    idx, item = self._rb.pop_next(self.timeout)
            except TimeoutError:
                states = [(w.worker_id, w.pid, _worker_state(w)) for w in self._workers if w.alive]
                waited = f"batch {idx}" if self.in_order else "any batch"
                stopped = any(s.startswith("stopped") for _, _, s in states)
                raise LoaderTimeoutError(
                    f"no {waited} within timeout={self.timeout} s{self._whereabouts(idx)}; "
                    f"workers (id, pid, state): {states}. "
                    + ("A stopped worker runs again after SIGCONT (kill -CONT PID). " if stopped else "")
                    + "A worker may be stuck in __getitem__; raise `timeout` if batches are "
                    "legitimately slow") from None
            except BufferClosedError:
                if self._failure is not None:
                    raise self._failure from None
                return _CLOSED   # shut down meanwhile (close() from another thread)
            with self._lock:
                self.last_index = idx
                self._next_yield += 1
                self._yielded += 1
                self._in_flight -= 1
                self._dispatch_more()
            if item is _EXHAUSTED:
                continue
            if self._discard:
                self._discard -= 1   # replayed stream batch, already seen before the checkpoint
                continue
            if isinstance(item, _Failure):
                return item   # this batch's error: the consumer raises it, the epoch goes on
            self.stats["batches"] += 1
            return item

    def _whereabouts(self, idx: int) -> str:
        """Where the awaited batch is: which worker holds its task, or why none does."""
        if not self.in_order:
            return ""
        with self._lock:
            holders = [w for w in self._workers if (self.epoch, idx) in w.outstanding]
            fetcher = self._fetcher
        if not self.use_threads and (fetcher is None or not fetcher.is_alive()):
            return " (the fetcher thread is not running)"
        if not holders:
            return " (no worker holds its task: mxload lost track of it; please report this as a bug)"
        return "".join(f" (its task is with worker {w.worker_id}, pid {w.pid})" for w in holders)

    def _finished(self) -> bool:
        with self._lock:
            if self._order is not None:
                return self._yielded >= len(self._order)
            return self._in_flight == 0 and all(w.exhausted or not w.alive for w in self._workers)

    # ------------------------------------------------------------------ results

    def deliver_thread_result(self, worker_id: int, msg: tuple[Any, ...]) -> None:
        """Thread workers hand results here (their thread, not the fetcher's)."""
        with self._lock:   # also serialises the profiler hooks between thread workers
            worker = self._workers[worker_id]
            profiled = self._handle_message(worker, msg)
            if profiled is not None:
                self._profile(worker, *profiled)

    def thread_worker_ended(self, worker_id: int, error: BaseException, doing: str) -> None:
        """A worker thread's loop ended without a stop request (its thread
        calls this last): fail the epoch now, as a dead process would."""
        with self._lock:
            worker = self._workers[worker_id]
            worker.alive = False
            if self.state != RUNNING:
                return
            held = sorted(i for e, i in worker.outstanding if e == self.epoch)
            self._fail(WorkerError(
                f"mxload worker thread {worker_id} ended unexpectedly while {doing}: "
                f"{type(error).__name__}: {error} (holding batches {held}). A thread worker cannot be "
                f"restarted; catch the exception in the dataset or worker_init_fn",
                worker_id, None, None, held[0] if held else None))

    def _handle_message(self, worker: _WorkerHandle, msg: tuple[Any, ...],
                        fds: list[int] | None = None) -> tuple[int, Any] | None:
        """Act on one worker message (and the descriptors that came with it);
        returns (batch idx, timings) of a delivered batch, for the profiler
        (called outside the engine lock)."""
        kind, epoch, idx = msg[0], msg[1], msg[2]
        if idx < 0 and kind == "error":   # worker_init_fn failed: the worker is unusable
            self._fail(_rebuild_exception(msg[3], worker.worker_id, worker.pid, -1))
            return None
        task = worker.outstanding.pop((epoch, idx), None)
        assigned = task[1] if task is not None else None
        if epoch != self.epoch:
            task = None  # a result of an abandoned epoch: only its slab matters
        if kind == "new_slab":
            assert fds, "recv_frame checks that a frame carries the descriptors it announces"
            slab = self._pool.adopt(fds.pop(), msg[3])
            if assigned is not None:
                # Too small for this batch: retire it everywhere.
                self._pool.retire(assigned)
                for w in self._workers:
                    if assigned.slab_id in w.known_slabs:
                        w.known_slabs.discard(assigned.slab_id)
                        w.pending_drops.append(assigned.slab_id)
            assigned = slab
            kind = "ok"
            nbytes, layout = msg[4], msg[5]
        elif kind == "ok":
            nbytes, layout = msg[4], msg[5]
        if task is None:   # stale result from an abandoned epoch
            if assigned is not None:
                self._pool.release(assigned)
            return None
        if kind == "ok":
            if nbytes == 0 or assigned is None:
                if assigned is not None:
                    self._pool.release(assigned)
                batch = views_from_layout(layout, b"")
            else:
                owner = BatchOwner(assigned, 0, nbytes, self._pool.release)
                batch = views_from_layout(layout, owner)
            self._store(idx, batch)
            return idx, msg[6]
        if kind == "batch":   # thread worker, private memory
            self._store(idx, msg[3])
            return idx, msg[4]
        if kind == "exhausted":
            worker.exhausted = True
            self._store(idx, _EXHAUSTED)
        elif kind == "error":
            if assigned is not None:
                self._pool.release(assigned)
            self._store(idx, _Failure(_rebuild_exception(msg[3], worker.worker_id, worker.pid, idx)))
        return None

    def _profile(self, worker: _WorkerHandle, idx: int, timings: tuple[Any, ...] | None) -> None:
        profiler = self.profiler
        if profiler is not None and timings is not None:
            start, fetch_ns, collate_ns, sent, stats, field_ns = timings
            profiler.worker_batch(worker.worker_id, worker.pid, idx, start, fetch_ns, collate_ns, sent,
                                  stats, field_ns, transported=not self.use_threads)

    def _store(self, idx: int, item: Any) -> None:
        try:
            self._rb.put(idx, item)
        except BufferClosedError:
            pass  # the epoch already failed or is shutting down: drop it

    def _start_fetcher(self) -> None:
        with self._fetcher_lock:
            if self._stop_fetcher:
                return
            self._pause_fetcher = False
            thread = threading.Thread(target=self._fetch_loop, name="mxload-fetcher", daemon=True)
            thread.start()
            self._fetcher = thread

    def _pause(self) -> bool:
        """Stop the fetcher thread for a moment (another engine forks its
        zygote); False if it is not running or did not stop in time."""
        with self._fetcher_lock:
            thread = self._fetcher
            if thread is None or not thread.is_alive() or self._stop_fetcher:
                return False
            self._pause_fetcher = True
            self._wake()
            thread.join(timeout=SHUTDOWN_DEADLINE_S)
            if thread.is_alive():
                self._pause_fetcher = False   # busy (e.g. starting a worker): let it be
                return False
            return True

    def _resume(self) -> None:
        if self.state == RUNNING:
            self._start_fetcher()

    def _wake(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    def _fetch_loop(self) -> None:
        """Fetcher thread: move worker results into the ReorderBuffer and
        notice dead workers at once (their sentinels become ready)."""
        block_sigint_in_this_thread()
        selector = selectors.DefaultSelector()
        registered: dict[int, tuple[Any, ...]] = {}
        try:
            selector.register(self._wake_r, selectors.EVENT_READ, None)
            while not (self._stop_fetcher or self._pause_fetcher):
                self._sync_selector(selector, registered)
                events = selector.select(timeout=1.0)
                if self._stop_fetcher or self._pause_fetcher:
                    return
                dead = []
                for key, _ in events:
                    if key.data is None:
                        try:
                            os.read(self._wake_r, 64)   # a pause request's wake-up
                        except OSError:
                            pass
                        continue
                    what, worker = key.data
                    if worker in dead:
                        continue
                    if what == "sock":
                        # One message per readiness event: the selector is
                        # level-triggered, so more data wakes us again.
                        if not self._receive(worker):
                            dead.append(worker)
                    else:  # sentinel: the process ended; take what it sent first
                        while self._receive(worker, only_if_ready=True):
                            pass
                        dead.append(worker)
                for worker in dead:
                    if worker.alive:
                        self._on_worker_death(worker)
        except BaseException as e:  # never die silently: the consumer must not hang
            if not self._stop_fetcher:
                self._fail(WorkerError(f"mxload fetcher thread failed: {type(e).__name__}: {e}"))
        finally:
            selector.close()

    def _sync_selector(self, selector: selectors.BaseSelector,
                       registered: dict[int, tuple[Any, ...]]) -> None:
        """Watch exactly the live workers (a restart replaces a handle).
        `registered` maps worker id -> (handle, socket fd, sentinel fd).  A
        dead worker's descriptors are closed by the time we get here, and a
        replacement may have reused their numbers (several workers can die
        in one round): so first unregister every stale entry, by number,
        then register the new ones."""
        with self._lock:
            workers = list(self._workers)
        wanted = {w.worker_id: w for w in workers if w.alive and w.sock is not None}
        for wid, (handle, *fds) in list(registered.items()):
            if wanted.get(wid) is not handle:
                for fd in fds:
                    try:
                        selector.unregister(fd)
                    except (KeyError, ValueError):
                        pass
                del registered[wid]
        for wid, w in wanted.items():
            if wid not in registered:
                assert w.sock is not None
                sock_fd, sentinel = w.sock.fileno(), w.process.sentinel
                selector.register(sock_fd, selectors.EVENT_READ, ("sock", w))
                selector.register(sentinel, selectors.EVENT_READ, ("sentinel", w))
                registered[wid] = (w, sock_fd, sentinel)

    def _receive(self, worker: _WorkerHandle, only_if_ready: bool = False) -> bool:
        """Handle one message from `worker`; False if its channel is closed or
        broken, i.e. the worker died, even in the middle of a message (or,
        with only_if_ready, if nothing is waiting)."""
        sock = worker.sock
        if sock is None:
            return False
        try:
            if only_if_ready and not select.select([sock], [], [], 0)[0]:
                return False
            msg, fds = recv_frame(sock)
        except (EOFError, OSError, pickle.UnpicklingError):
            return False
        except SharedMemoryError as e:   # out of descriptors here, in the main process
            self._fail(e)
            return False
        except Exception as e:   # a whole frame whose objects cannot be rebuilt here
            self._fail(self._main_side_error(worker, None, "unpickling its result", e))
            return True
        try:
            with self._lock:
                profiled = self._handle_message(worker, msg, fds)
        except Exception as e:   # mapping its slab, building its views: the batch's error, not the fetcher's
            self._fail(self._main_side_error(worker, msg, "taking its result", e))
            profiled = None
        finally:
            for fd in fds:   # any the message did not take
                os.close(fd)
        if profiled is not None:
            self._profile(worker, *profiled)
        return True

    def _main_side_error(self, worker: _WorkerHandle, msg: Any, doing: str,
                         error: Exception) -> WorkerError:
        """An error naming the batch whose result failed in the main process.
        Without the message (it did not unpickle) it is the worker's oldest
        outstanding batch: a worker answers its tasks in order."""
        idx = msg[2] if isinstance(msg, tuple) and len(msg) > 2 else None
        if idx is None:
            with self._lock:
                idx = next((i for e, i in worker.outstanding if e == self.epoch), None)
        error_type = SharedMemoryError if isinstance(error, SharedMemoryError) else WorkerError
        hint = (" (classes of objects a batch carries must be importable in the main process: "
                "define them in a module, not in a worker-only or __main__-only place)"
                if doing.startswith("unpickling") else "")
        err = error_type(f"mxload could not take batch {idx} from worker {worker.worker_id} "
                         f"(pid {worker.pid}) in the main process while {doing}: "
                         f"{type(error).__name__}: {error}{hint}",
                         worker.worker_id, worker.pid, None, idx)
        err.__cause__ = error
        return err

    def _on_worker_death(self, worker: _WorkerHandle) -> None:
        proc = worker.process
        proc.join(timeout=0.5)
        exitcode = proc.exitcode
        with self._lock:
            worker.alive = False
            if exitcode is not None:
                self._forget_process(proc)
            if self.state != RUNNING:
                return
            how = _describe_exit(exitcode)
            zygote_death = self._zygote.death() if self._zygote is not None else None
            if zygote_death is not None:
                # Nothing can fork a replacement, nor any other worker: fail now, saying why.
                assert self._zygote is not None
                held = sorted(i for e, i in worker.outstanding if e == self.epoch)
                self._fail(WorkerError(
                    f"mxload worker {worker.worker_id} (pid {worker.pid}) died ({how}) while holding "
                    f"batches {held}: the worker zygote (pid {self._zygote.pid}), which forks this "
                    f"loader's workers, died ({zygote_death}), and its workers die with it. No worker "
                    f"can be restarted; iterate the loader again to start new workers",
                    worker.worker_id, worker.pid, exitcode, held[0] if held else None))
                return
            error_type = WorkerError
            hint = ""
            if exitcode == -signal.SIGBUS:
                error_type = SharedMemoryError
                hint = f" (SIGBUS: shared memory ran out; {SHARED_MEMORY_ADVICE})"
            if self._restarts < self.max_restarts and self._restartable():
                self._restarts += 1
                self.stats["worker_restarts"] += 1
                if self.profiler is not None:
                    self.profiler.worker_restarted(worker.worker_id)
                warnings.warn(f"mxload worker {worker.worker_id} (pid {worker.pid}) died ({how}{hint}); "
                              f"restarting it ({self._restarts}/{self.max_restarts})", RuntimeWarning,
                              stacklevel=1)
                self._restart(worker)
                return
            held = sorted(i for e, i in worker.outstanding if e == self.epoch)
            self._fail(error_type(
                f"mxload worker {worker.worker_id} (pid {worker.pid}) died unexpectedly ({how}){hint} "
                f"while holding batches {held}" +
                (f"; max_worker_restarts={self.max_restarts} exhausted" if self.max_restarts else ""),
                worker.worker_id, worker.pid, exitcode, held[0] if held else None))

    def _forget_process(self, proc: Any) -> None:
        """A reaped worker: release its sentinel now (restarts may be many)."""
        with self._start_lock:
            if proc in self._processes:
                self._processes.remove(proc)
                proc.close()

    def _restartable(self) -> bool:
        return not self.iterable  # a stream's position died with its worker

    def _restart(self, dead: _WorkerHandle) -> None:
        """Replace a dead worker, started exactly as the original was, and
        dispatch its batches again (fetcher thread, engine lock held)."""
        try:
            new = self._start_worker(dead.worker_id)
        except _Closing:
            return
        except Exception as e:
            self._fail(WorkerError(f"could not restart worker {dead.worker_id}: {e}", dead.worker_id))
            return
        self._close_worker_channels(dead)
        self._workers[dead.worker_id] = new
        for (epoch, idx), (indices, slab) in sorted(dead.outstanding.items()):
            if slab is not None:
                self._pool.release(slab)   # its writer is dead
            if epoch == self.epoch:
                self._send_task(new, idx, indices)
        dead.outstanding.clear()

    def _fail(self, error: BaseException) -> None:
        """Record a fatal error and wake the consumer with it."""
        if self._failure is None:
            self._failure = error
        self._rb.close(str(error))

    # ------------------------------------------------------------------ shutdown

    @defer_sigint
    def shutdown(self) -> None:
        """End the workers and release everything; idempotent, thread-safe,
        bounded by SHUTDOWN_DEADLINE_S however stuck the workers are.  In a
        forked child (a user's os.fork()) the inherited copy is inert: the
        workers belong to the process that created them.  A Ctrl-C meanwhile
        is raised once the sequence is complete."""
        if self.state == CLOSED:
            return
        if os.getpid() != self._pid:
            self.state = CLOSED   # _fds closed the inherited descriptors at fork
            return
        if sys.is_finalizing():
            return  # the zygote (or each worker's watchdog) sees the sockets hang up
        with self._shutdown_lock:
            if self.state == CLOSED:
                return
            self.state = SHUTTING_DOWN
            try:
                self._shutdown_sequence()
            finally:
                # Whatever happened above, this engine is finished: never run twice.
                self.state = CLOSED
                if self._finalizer is not None:
                    self._finalizer.cancel()

    def _shutdown_sequence(self) -> None:
        start = time.monotonic()
        deadline = start + SHUTDOWN_DEADLINE_S
        # 1. Stop the fetcher thread and join it: wake its select() through
        #    the self-pipe, so it is never left blocked on a worker socket.
        with self._fetcher_lock:
            self._stop_fetcher = True
            fetcher = self._fetcher
        self._wake()
        if fetcher is not None and fetcher.ident is not None and fetcher is not threading.current_thread():
            fetcher.join(timeout=max(0.0, deadline - time.monotonic()))
        # 2. No worker starts from now on; wait for one under way (a restart),
        #    which then ends its process itself if we stop waiting first.
        self._closing = True
        locked = self._start_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
        procs = list(self._processes)
        if locked:
            self._start_lock.release()
        # 3. Wake a consumer blocked in the ReorderBuffer.
        self._rb.close("the loader is shutting down")
        # 4. Ask every worker to stop.  The stop message never blocks (a
        #    stuck worker's socket may be full); workers read ahead, so one
        #    that is between tasks skips its queued work and exits at once.
        for w in self._workers:
            try:
                if w.tasks is not None:
                    w.tasks.put(None)
                elif w.sock is not None:
                    w.sock.setblocking(False)
                    send_frame(w.sock, None)
            except (OSError, ValueError):
                pass
        # 5. Grace period, then SIGTERM, then SIGKILL, all within the one
        #    deadline; reap every process (threads: join until the deadline).
        #    Then the zygote, which kills and reaps whatever is left of its children.
        if self.use_threads:
            for w in self._workers:
                if w.process.ident is not None and w.process is not threading.current_thread():
                    w.process.join(timeout=max(0.0, deadline - time.monotonic()))
        else:
            self._end_processes(procs, start, deadline)
            if self._zygote is not None:
                self._zygote.close(deadline)
                for p in procs:
                    p.close()   # whatever the zygote did not report, its end ended them too
        # 6. Close sockets and pipes, drop buffered batches, release slabs
        #    (batches the consumer still holds stay valid until it drops them).
        for w in self._workers:
            self._close_worker_channels(w)
            w.outstanding.clear()
            w.alive = False
        for fd in (self._wake_r, self._wake_w):
            _fds.close_fd(fd)
        self._wake_r = self._wake_w = -1
        self._rb.clear()
        self._pool.close()

    def _end_processes(self, procs: list[Any], start: float, deadline: float) -> None:
        """Grace, then SIGTERM, then SIGKILL, all within one deadline; reap all."""
        self._wait_exit(procs, start + SHUTDOWN_GRACE_S)
        alive = [p for p in procs if p.exitcode is None]
        for p in alive:
            try:
                p.terminate()
            except (OSError, ValueError):
                pass
        self._wait_exit(alive, min(deadline, start + SHUTDOWN_TERMINATE_S))
        for p in alive:
            if p.exitcode is None:
                try:
                    p.kill()
                except (OSError, ValueError):
                    pass
        self._wait_exit(alive, deadline)
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))  # reap: no zombies
            if p.exitcode is not None:
                p.close()

    @staticmethod
    def _wait_exit(procs: list[Any], until: float) -> None:
        pending = [p for p in procs if p.exitcode is None]
        while pending:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return
            ended = set(mp_connection.wait([p.sentinel for p in pending], timeout=remaining))
            for p in pending:
                if p.sentinel in ended:
                    p.join(timeout=max(0.0, until - time.monotonic()))   # its exit status follows
            pending = [p for p in pending if p.exitcode is None]

    @staticmethod
    def _close_worker_channels(w: _WorkerHandle) -> None:
        _fds.close_socket(w.sock)
        w.sock = None

    def __repr__(self) -> str:
        return f"<mxload Engine {self.state}, {self.num_workers} workers>"


class EpochIterator:
    """What ``iter(loader)`` returns with workers: one epoch of batches.

    Ends its engine (unless persistent) when exhausted, closed, on error, or
    when garbage-collected: ``for batch in loader: break`` stops the workers
    at once, because nothing else holds this object strongly."""

    def __init__(self, engine: Engine, persistent: bool, progress: Any):
        self.engine = engine
        self._persistent = persistent
        self._progress = progress
        self._closed = False
        self._superseded = False
        # Threads sharing this iterator take turns: each batch goes to one of them.
        self._next_lock = threading.Lock()

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        total = self.engine.total_batches
        if total is None:
            raise TypeError("the number of batches of an IterableDataset is not known")
        return total

    def __next__(self) -> Any:
        with self._next_lock:
            try:
                return self._next()
            except BaseException:
                del self   # the traceback keeps this frame: it must not keep the iterator (see _next)
                raise

    def _next(self) -> Any:
        if self._closed:
            if self._superseded:
                raise RuntimeError(
                    "this iterator was superseded: a newer iter() of the same DataLoader took over its "
                    "persistent workers, which serve one epoch at a time. Finish (or close) an epoch "
                    "before starting the next, or use persistent_workers=False for independent "
                    "iterators (zip(loader, loader))")
            raise StopIteration
        profiler = self.engine.profiler
        call_ns = time.monotonic_ns() if profiler is not None else 0
        try:
            batch = self.engine.next_batch()
        except BaseException:
            # Worker failure, timeout or Ctrl-C: the epoch is over either way.
            self._end(force=True)
            raise
        if batch is _END:
            self._progress.finished = True
            self._end()
            raise StopIteration
        if batch is _CLOSED:   # close() from another thread while this one waited
            self._end()
            raise StopIteration
        self._progress.taken(self.engine.last_index)
        if isinstance(batch, _Failure):
            # As torch: an error raised for one batch leaves the epoch running;
            # the loop may catch it and take the next batches.  The error's
            # traceback holds this frame: it must reference neither the error
            # (a cycle, freed only by a gc run) nor this iterator, so that a
            # loop abandoned by the error still ends the workers at once.
            error, batch = batch.error, None
            del self, profiler
            try:
                raise error
            finally:
                del error
        if profiler is not None:
            profiler.batch_taken(self.engine.last_index, call_ns)
        return batch

    @defer_sigint
    def _end(self, force: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self.engine.profiler is not None:
            self.engine.profiler.epoch_ended()
        if force or not self._persistent:
            self.engine.shutdown()

    def supersede(self) -> None:
        """A newer iterator takes over the persistent engine: if this epoch is
        still in progress, using this iterator again is an error, not a
        silent share of the newer epoch's batches."""
        if not self._closed:
            self._superseded = True
            self._end()

    def release_engine_at_end(self) -> None:
        """The loader is gone: end the workers with this epoch, even if persistent."""
        self._persistent = False
        if self._closed:
            self.engine.shutdown()

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


def start_epoch(loader: Any) -> EpochIterator:
    """Start one epoch of `loader` on its (possibly persistent) engine."""
    t0 = time.monotonic_ns()
    batches = None if loader.iterable else loader._epoch_batches()
    t1 = time.monotonic_ns()
    return _start_engine_epoch(loader, batches, t0, t1)


@defer_sigint
def _start_engine_epoch(loader: Any, batches: list[Any] | None, t0: int, t1: int) -> EpochIterator:
    """The engine part of start_epoch, all or nothing: a Ctrl-C meanwhile is
    raised once the iterator exists, whose finalizer then ends a
    non-persistent engine."""
    engine = loader._engine
    created = engine is None or not engine.usable
    if created:
        engine = Engine(loader)
        if loader.persistent_workers:
            loader._engine = engine
    try:
        loader._stats = engine.stats
        progress = loader._progress
        if loader.iterable:
            engine.begin_epoch(loader.epoch, None, None, loader.profiler, discard=progress.count)
        else:
            assert batches is not None
            engine.begin_epoch(loader.epoch, batches, progress.remaining(len(batches)), loader.profiler)
        if loader.profiler is not None:
            loader.profiler.epoch_started(t1 - t0, time.monotonic_ns() - t1)
        it = EpochIterator(engine, loader.persistent_workers, progress)
    except BaseException:
        if created and not loader.persistent_workers:
            engine.shutdown()
        raise
    return it
