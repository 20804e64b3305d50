"""The worker: one task loop for worker processes, worker threads and Ray actors, with
worker info and seeding.

A worker takes Tasks, loads each batch's samples (source.py), collates them
and answers with one result per task (messages.py).  What differs between a
process and a thread is only its link to the main process (a WorkerLink: a process's
is local/process_worker.py's, with the death signal and the parent watchdog; a
thread's is _ThreadLink below): where tasks come from, where the batch is
collated (a shared-memory slab, or private memory), how results go back, and
which exceptions are a batch's failure rather than the worker's end.  This
module is transport-neutral: it imports no transport.
"""
from __future__ import annotations

import dataclasses
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from .. import _rng
from .._collate import plan as _plan
from .._torch_compat import enter_worker, shard_datapipe, torch_numpy_seed
from . import messages as m
from .messages import Payload, WorkerConfig
from .source import SampleSource

__all__ = ["WorkerInfo", "get_worker_info", "worker_seed", "in_worker_process", "serve",
           "thread_worker_main", "answer", "enter_process", "reseed_process"]


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


R = TypeVar("R")


class WorkerLink(Generic[R]):
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


def serve(link: WorkerLink[R], worker_id: int, payload: Payload, source: SampleSource, epoch: int) -> None:
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


def answer(link: WorkerLink[R], task: m.Task, source: SampleSource, batchify_fn: Callable[..., Any]) -> None:
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
    if config.datapipe_shards is not None:   # before worker_init_fn, as torch's worker init does it
        shard_datapipe(dataset, config.num_workers, config.worker_id, *config.datapipe_shards)


def reseed_process(config: WorkerConfig, epoch: int) -> None:
    """A task of a new epoch (persistent workers) is about to run in this worker process: seeded
    afresh for it, except as torch (seeding="torch"), whose persistent workers go on with their
    streams."""
    if config.seeding != "torch":
        _seed_worker(config, epoch)


# ---------------------------------------------------------------- worker threads

# The engine's side of a thread worker: results, and the end of a thread
# that stopped other than by a stop request (worker id, exception, what it was doing).
Deliver = Callable[[int, m.WorkerResult], None]
Ended = Callable[[int, BaseException, str], None]


class _ThreadLink(WorkerLink[m.Loaded]):
    """A worker thread's queue of tasks; batches are collated into private
    memory and handed to the engine from this thread."""

    def __init__(self, worker_id: int, tasks: queue.SimpleQueue[tuple[int, int, Any, bool] | m.Stop],
                 deliver: Deliver):
        super().__init__()
        self._worker_id = worker_id
        self._tasks = tasks
        self._deliver = deliver
        self._buffers = _plan.ReusedBuffers()

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
            return m.Loaded(epoch, idx, _plan.collate(batchify_fn, samples, idx, self._buffers), None)
        batch, stats, field_ns = _plan.collate_profiled(batchify_fn, samples, idx, self._buffers)
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
        serve(link, config.worker_id, payload, config.source(payload[0], payload[1]), config.epoch)
    except BaseException as e:
        ended(config.worker_id, e, link.doing)
    finally:
        _thread_info.info = None
