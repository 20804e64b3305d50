"""The worker: one task loop for worker processes and worker threads, with
worker info, seeding, and (processes) the death signal and parent watchdog.

A worker takes Tasks, loads each batch's samples (source.py), collates them
and answers with one result per task (messages.py).  What differs between a
process and a thread is only its link to the main process (_ProcessLink,
_ThreadLink): where tasks come from, where the batch is collated (a
shared-memory slab, or private memory), how results go back, and which
exceptions are a batch's failure rather than the worker's end.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import pickle
import queue
import random
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from .. import _rng
from .._collate import plan as _plan
from .._core import Slab, watch_main_process
from .._torch_compat import enter_worker, torch_numpy_seed
from . import messages as m
from . import wire
from .local.heap import freeze_inherited_objects, keep_freed_memory
from .local.inherit import unpickle_payload
from .local.slabs import create_shared_fd, map_slab, slab_size_for
from .os_signals import reset_inherited_signals
from .source import SampleSource

if TYPE_CHECKING:
    from .._options import LoaderOptions

__all__ = ["WorkerInfo", "WorkerConfig", "get_worker_info", "worker_seed", "in_worker_process",
           "worker_process_main", "thread_worker_main", "answer", "report_start_failure",
           "enter_process", "reseed_process"]


@dataclass(frozen=True)
class WorkerInfo:
    """What :func:`get_worker_info` returns inside a worker.

    Args:
        id (int): this worker's id, 0 .. num_workers - 1.
        num_workers (int): how many workers the loader has.
        seed (int): this worker's seed (``seeding="torch"``: the iteration's
            base seed + id, as torch's; else from the loader's seed, the epoch
            and the id); in a worker process ``random``, numpy's global RNG
            and torch's are already seeded from it.
        dataset: this worker's copy of the dataset.

    Example:
        >>> import mxload
        >>> info = mxload.WorkerInfo(id=0, num_workers=2, seed=7, dataset=None)
        >>> info.id, info.num_workers
        (0, 2)
    """
    id: int
    num_workers: int
    seed: int
    dataset: Any


_process_info: WorkerInfo | None = None
_thread_info = threading.local()


def get_worker_info() -> WorkerInfo | None:
    """Inside a worker: its id, the number of workers, its seed and its copy of
    the dataset (use them to shard an IterableDataset).  None elsewhere.

    Returns:
        WorkerInfo | None: the calling worker's info (process or thread
        worker); ``None`` in the main process and with ``num_workers=0``.

    Example:
        >>> import mxload
        >>> mxload.get_worker_info() is None   # the main process
        True
        >>> class WhoLoads(mxload.Dataset):
        ...     def __len__(self):
        ...         return 4
        ...     def __getitem__(self, i):
        ...         return mxload.get_worker_info().id
        >>> sorted(int(w) for b in mxload.DataLoader(WhoLoads(), batch_size=2, num_workers=2) for w in b)
        [0, 0, 1, 1]
    """
    info = getattr(_thread_info, "info", None)
    return info if info is not None else _process_info


def worker_seed(seed: int, epoch: int, worker_id: int) -> int:
    """A 63-bit seed for one worker in one epoch: distinct per worker and per
    epoch, reproducible from the loader's seed."""
    return _rng.derived_seed(seed, epoch, worker_id)


def in_worker_process() -> bool:
    """True inside a mxload worker process (which must not start workers itself)."""
    return _process_info is not None


# (dataset, batchify_fn, worker_init_fn): the user's objects every worker gets.
Payload = tuple[Any, Callable[..., Any], Callable[[int], None] | None]


@dataclass
class WorkerConfig:
    """Everything a worker needs besides its channel (picklable for spawn)."""
    worker_id: int
    num_workers: int
    seed: int
    epoch: int
    payload: Payload | bytes     # or its pickle (spawn, forkserver: pickled once for all workers)
    iterable: bool
    batch_size: int              # samples per batch of a stream
    drop_last: bool
    # Forked by the zygote: its only thread forked us, so the kernel's parent
    # death signal is sound (armed there).  Otherwise (spawn, forkserver) the parent is the
    # main process or the fork server, and a watchdog thread notices the main
    # process's end of our socket closing instead.
    zygote_child: bool
    # batch_size=None: each task is one sampler key for dataset[key] (_keys.encode_key).
    keyed: bool = False
    # How this worker seeds its global RNGs (_options.SEEDINGS); "torch": from base_seed, the
    # base seed of the iteration that started this engine's workers.
    seeding: str = "per_worker"
    base_seed: int = 0
    # With a pickled payload, the descriptors its multiprocessing objects need (local/inherit.py):
    # a list in the worker; in a forkserver worker's arguments, a ForChild.
    payload_fds: Any = ()

    @classmethod
    def first(cls, options: LoaderOptions, epoch: int) -> WorkerConfig:
        """Worker 0's, for a loader's engine starting at `epoch` (a transport makes the others')."""
        return cls(0, options.num_workers, options.seed, epoch,
                   (options.dataset, options.batchify_fn, options.worker_init_fn),
                   options.iterable, options.fetch_batch_size, options.drop_last,
                   zygote_child=False, keyed=not options.auto_batching, seeding=options.seeding,
                   base_seed=options.base_seed)

    def source(self, dataset: Any) -> SampleSource:
        return SampleSource(dataset, self.iterable, self.batch_size, self.drop_last, self.seed, self.keyed,
                            self.seeding)


R = TypeVar("R")


class _Link(Generic[R]):
    """A worker's side of its transport; `R` is a collated batch ready to send."""
    # Exceptions out of worker_init_fn reported as its failure.
    init_errors: tuple[type[BaseException], ...] = (Exception,)

    def __init__(self) -> None:
        self.doing = "running worker_init_fn"    # for the report of a worker that ends

    def next_task(self) -> m.Task | None:
        """The next task, or None when asked to stop."""
        raise NotImplementedError

    def reseed(self, epoch: int) -> None:
        """A task of a new epoch (persistent workers) is about to run."""

    def collate(self, task: m.Task, samples: Any, batchify_fn: Callable[..., Any],
                t0: int, t1: int) -> R:
        """Collate a batch (fetched from t0 to t1) into its reply."""
        raise NotImplementedError

    def send_batch(self, reply: R) -> None:
        raise NotImplementedError

    def send(self, message: m.Failed | m.Exhausted | m.InitFailed) -> None:
        raise NotImplementedError


def serve(link: _Link[R], worker_id: int, payload: Payload, source: SampleSource, epoch: int) -> None:
    """The task loop of every worker: run worker_init_fn, then answer each
    task until asked to stop."""
    dataset, batchify_fn, worker_init_fn = payload
    if worker_init_fn is not None:
        try:
            worker_init_fn(worker_id)
        except link.init_errors as e:   # sys.exit() there is a failure to report, too (processes)
            link.send(m.InitFailed(m.ExceptionInfo.of(e)))
            return
    seeded_epoch = epoch
    while True:
        link.doing = "waiting for a task"
        task = link.next_task()
        if task is None:
            return
        if task.epoch != seeded_epoch:   # persistent workers (seeding="torch": their streams go on)
            link.reseed(task.epoch)
            seeded_epoch = task.epoch
        answer(link, task, source, batchify_fn)


def answer(link: _Link[R], task: m.Task, source: SampleSource, batchify_fn: Callable[..., Any]) -> None:
    """Load, collate and answer one task: exactly one message through `link`
    (the task loop above, and a Ray actor's call).  Whatever the dataset or
    batchify_fn raises is this batch's failure, SystemExit & co included:
    nothing else raises them in a worker (a process ignores SIGINT and is
    stopped by a message; signal handlers never run in a thread), and
    batch_errors.py makes them an error the training loop can take."""
    link.doing = f"loading batch {task.batch_index}"
    t0 = time.monotonic_ns()
    try:
        samples = source.samples(task.epoch, task.index_array())
        if samples is None:
            link.send(m.Exhausted(task.epoch, task.batch_index))
            return
        reply = link.collate(task, samples, batchify_fn, t0, time.monotonic_ns())
    except BaseException as e:   # noqa: BLE001 - see above
        link.send(m.Failed(task.epoch, task.batch_index, m.ExceptionInfo.of(e)))
        return
    link.send_batch(reply)


# ---------------------------------------------------------------- worker processes


def worker_seeds(config: WorkerConfig, epoch: int) -> tuple[int, Any]:
    """(this worker's seed, numpy's global RNG's seed) for `epoch`: as torch's worker loop seeds
    worker k (``base_seed + k``; numpy from torch's state of (base_seed, k)), or from (seed, epoch,
    worker id)."""
    if config.seeding == "torch":
        return config.base_seed + config.worker_id, torch_numpy_seed(config.base_seed, config.worker_id)
    seed = worker_seed(config.seed, epoch, config.worker_id)
    return seed, seed % (2 ** 32)


def _seed_worker(config: WorkerConfig, epoch: int) -> None:
    """Seed this worker process's global RNGs for `epoch` (and say so in its WorkerInfo)."""
    global _process_info
    seed, numpy_seed = worker_seeds(config, epoch)
    random.seed(seed)
    np.random.seed(numpy_seed)
    if _process_info is not None:
        _process_info = dataclasses.replace(_process_info, seed=seed)
        enter_worker(config.worker_id, config.num_workers, seed, _process_info.dataset, process=True)


def enter_process(config: WorkerConfig, dataset: Any) -> None:
    """This process is worker `config.worker_id` (a worker process, or a Ray
    actor's process): get_worker_info() says so, and its RNGs are seeded."""
    global _process_info
    _process_info = WorkerInfo(config.worker_id, config.num_workers, 0, dataset)
    _seed_worker(config, config.epoch)


def reseed_process(config: WorkerConfig, epoch: int) -> None:
    """A task of a new epoch (persistent workers) is about to run in this worker process: seeded
    afresh for it, except as torch (seeding="torch"), whose persistent workers go on with their
    streams."""
    if config.seeding != "torch":
        _seed_worker(config, epoch)


def worker_process_main(config: WorkerConfig, sock: socket.socket) -> None:
    """Entry point of a worker process."""
    # Ctrl-C goes to the whole process group; the main process owns it and
    # ends us through the shutdown path, so ignore it (no worker tracebacks).
    # It arrives blocked (the starting thread blocked it): a Ctrl-C pending
    # since then is discarded here, never delivered.
    reset_inherited_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    freeze_inherited_objects()   # a fork's inherited heap stays out of the collector's way (local/heap.py)
    keep_freed_memory()   # before the dataset allocates anything (local/heap.py: page faults per batch)
    if not config.zygote_child:   # a zygote child was armed by the zygote (local/zygote.die_with_parent)
        watch_main_process(sock.fileno())
    payload = config.payload
    if isinstance(payload, bytes):
        try:
            payload = unpickle_payload(payload, list(config.payload_fds))
        except Exception as e:
            report_start_failure(sock, e, "unpickling the dataset, batchify_fn and worker_init_fn")
            return
    assert not isinstance(payload, bytes)
    enter_process(config, payload[0])
    try:
        serve(_ProcessLink(config, sock), config.worker_id, payload, config.source(payload[0]), config.epoch)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the main process went away: nothing left to serve


def report_start_failure(sock: socket.socket, error: BaseException, doing: str) -> None:
    """This worker process cannot start (`doing` raised `error`): tell the
    main process why, so its error names the cause, not only an exit code."""
    try:
        wire.send(sock, m.InitFailed(m.ExceptionInfo.of(error), doing))
    except OSError:
        pass   # the main process is gone: nobody to tell


# A batch encoded for its frame, with the new slab's descriptor (-1: none).
_Encoded = tuple[bytes, int]


# Distinct layouts a worker names by id; a batch with another layout goes in full.
MAX_NAMED_LAYOUTS = 64


class Layouts:
    """The layouts this worker named by id (the main process keeps them by
    the same id), so a batch whose layout is known travels as a fixed-size
    BatchRef instead of a pickle."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}

    def lookup(self, plan: Any) -> tuple[int, bool]:
        """(layout id, whether it is new), or (-1, False) when this plan's
        layout cannot be named: it carries per-batch objects, or too many
        layouts were named already."""
        if plan.objects:
            return -1, False
        key = pickle.dumps(plan.layout(), protocol=pickle.HIGHEST_PROTOCOL)
        got = self._ids.get(key)
        if got is not None:
            return got, False
        if len(self._ids) >= MAX_NAMED_LAYOUTS:
            return -1, False
        self._ids[key] = len(self._ids)
        return self._ids[key], True


class _ProcessLink(_Link[_Encoded]):
    """A worker process's socket.  Reads ahead, so a stop request queued
    behind already-dispatched tasks is seen before the next task starts
    (after `break`, queued work is skipped, not done); maps the slab
    descriptors that come with their tasks; collates into shared memory."""
    init_errors = (Exception, SystemExit)

    def __init__(self, config: WorkerConfig, sock: socket.socket):
        super().__init__()
        self._config = config
        self._sock = sock
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        self._pending: collections.deque[m.Task] = collections.deque()
        self._slabs: dict[int, Slab] = {}
        self._stopped = False
        self._layouts = Layouts()

    def _read_one(self) -> None:
        task, fds = wire.recv(self._sock)
        if not isinstance(task, m.Task):
            for fd in fds:
                os.close(fd)
            if not isinstance(task, m.Stop):
                raise wire.ProtocolError(f"a worker received {type(task).__name__}, not a Task or Stop")
            self._stopped = True
            return
        for dropped in task.drop_slabs:
            self._slabs.pop(dropped, None)
        if fds:
            try:
                assert task.slab_id is not None
                self._slabs[task.slab_id] = map_slab(fds[0], task.slab_size, task.slab_id)
            finally:
                os.close(fds[0])
        self._pending.append(task)

    def next_task(self) -> m.Task | None:
        timeout_ms = 0 if self._pending else -1
        while not self._stopped:
            if self._poller.poll(timeout_ms):
                self._read_one()
                timeout_ms = 0          # drain whatever else is already here
                continue
            if self._pending:
                return self._pending.popleft()
            timeout_ms = -1
        return None

    def reseed(self, epoch: int) -> None:
        reseed_process(self._config, epoch)

    def collate(self, task: m.Task, samples: Any, batchify_fn: Callable[..., Any],
                t0: int, t1: int) -> _Encoded:
        new_fd = -1
        try:
            plan = _plan.plan_batch(batchify_fn, samples, task.batch_index)
            slab = self._slabs.get(task.slab_id) if task.slab_id is not None else None
            fill_ns: list[Any] = []
            reply: m.Batch | m.NewSlab
            if plan.nbytes == 0:
                reply = m.Batch(task.epoch, task.batch_index, task.slab_id, 0, plan.layout(), None)
            elif slab is not None and slab.size >= plan.nbytes:
                assert task.slab_id is not None
                _, fill_ns = plan.fill(slab)
                layout_id, new = self._layouts.lookup(plan)
                if layout_id >= 0 and not new and not task.profiling:
                    return wire.encode(m.BatchRef(task.epoch, task.batch_index, task.slab_id, plan.nbytes,
                                               layout_id)), -1
                reply = m.Batch(task.epoch, task.batch_index, task.slab_id, plan.nbytes, plan.layout(), None,
                                layout_id)
            else:
                size = slab_size_for(plan.nbytes, slab.size if slab is not None else 0)
                new_fd = create_shared_fd(size)
                new_slab = map_slab(new_fd, size, None, populate=True)
                _, fill_ns = plan.fill(new_slab)
                del new_slab
                reply = m.NewSlab(task.epoch, task.batch_index, size, plan.nbytes, plan.layout(), None)
            if task.profiling:
                t2 = time.monotonic_ns()
                stats, field_ns = plan.field_stats(fill_ns)
                reply = reply._replace(timings=m.Timings(t0, t1 - t0, t2 - t1, time.monotonic_ns(),
                                                         stats, field_ns))
            # Encoded here, inside the batch's try: an unpicklable object in
            # the batch is reported as this batch's error, not as a dead worker.
            return wire.encode(reply, 1 if new_fd >= 0 else 0), new_fd
        except BaseException:
            if new_fd >= 0:
                os.close(new_fd)
            raise

    def send_batch(self, reply: _Encoded) -> None:
        frame, new_fd = reply
        try:
            wire.send_encoded(self._sock, frame, [new_fd] if new_fd >= 0 else [])
        finally:
            if new_fd >= 0:
                os.close(new_fd)

    def send(self, message: m.Failed | m.Exhausted | m.InitFailed) -> None:
        wire.send(self._sock, message)


# ---------------------------------------------------------------- worker threads

# The engine's side of a thread worker: results, and the end of a thread
# that stopped other than by a stop request (worker id, exception, what it was doing).
Deliver = Callable[[int, m.WorkerResult], None]
Ended = Callable[[int, BaseException, str], None]


class _ThreadLink(_Link[m.Loaded]):
    """A worker thread's queue of tasks; batches are collated into private
    memory and handed to the engine from this thread."""

    def __init__(self, worker_id: int, tasks: queue.SimpleQueue[tuple[int, int, Any, bool] | m.Stop],
                 deliver: Deliver):
        super().__init__()
        self._worker_id = worker_id
        self._tasks = tasks
        self._deliver = deliver

    def next_task(self) -> m.Task | None:
        # A task is put as (epoch, batch index, indices, profiling): one
        # compiled put() in the training loop's thread (see Engine._dispatch_more).
        task = self._tasks.get()
        if isinstance(task, m.Stop):
            return None
        epoch, idx, indices, profiling = task
        return m.Task(epoch, idx, indices, profiling=profiling)

    def collate(self, task: m.Task, samples: Any, batchify_fn: Callable[..., Any],
                t0: int, t1: int) -> m.Loaded:
        epoch, idx = task.epoch, task.batch_index
        if not task.profiling:
            return m.Loaded(epoch, idx, _plan.collate(batchify_fn, samples, idx), None)
        batch, stats, field_ns = _plan.collate_profiled(batchify_fn, samples, idx)
        t2 = time.monotonic_ns()
        return m.Loaded(epoch, idx, batch, m.Timings(t0, t1 - t0, t2 - t1, t2, stats, field_ns))

    def send_batch(self, reply: m.Loaded) -> None:
        self._deliver(self._worker_id, reply)

    def send(self, message: m.Failed | m.Exhausted | m.InitFailed) -> None:
        self._deliver(self._worker_id, message)


def thread_worker_main(config: WorkerConfig, tasks: queue.SimpleQueue[tuple[int, int, Any, bool] | m.Stop],
                       deliver: Deliver, ended: Ended) -> None:
    """Entry point of a worker thread (thread_pool=True).  A thread that ends
    other than by a stop request (SystemExit, any BaseException out of user
    code) tells the engine at once, as a process's death would."""
    payload = config.payload
    assert not isinstance(payload, bytes), "thread workers share the objects"
    seed, _ = worker_seeds(config, config.epoch)   # (the process's RNGs are the training loop's)
    _thread_info.info = WorkerInfo(config.worker_id, config.num_workers, seed, payload[0])
    link = _ThreadLink(config.worker_id, tasks, deliver)
    try:
        serve(link, config.worker_id, payload, config.source(payload[0]), config.epoch)
    except BaseException as e:
        ended(config.worker_id, e, link.doing)
    finally:
        _thread_info.info = None
