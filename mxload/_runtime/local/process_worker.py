"""A worker process's side of the task loop (../worker.py's serve): its entry point, and its
link to the main process, a socket (wire.py) with the batches collated into shared-memory slabs
(slabs.py).  Its code runs in worker processes only (the launcher names worker_process_main as
their entry point); a thread worker or a Ray actor runs the same loop without loading it."""
from __future__ import annotations

import collections
import os
import pickle
import select
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from ..._collate import plan as _plan
from ..._collate.plan import slab_size_for
from ..._core import Slab, watch_main_process
from .. import messages as m
from ..messages import WorkerConfig
from ..os_signals import reset_inherited_signals
from ..worker import WorkerLink, enter_process, reseed_process, serve
from . import wire
from .heap import freeze_inherited_objects, keep_freed_memory
from .inherit import unpickle_payload
from .slabs import create_shared_fd, map_slab

__all__ = ["worker_process_main", "report_start_failure", "ProcessLink", "Layouts", "MAX_NAMED_LAYOUTS"]


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
        source = config.source(payload[0], payload[1])
        serve(ProcessLink(config, sock), config.worker_id, payload, source, config.epoch)
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


class ProcessLink(WorkerLink[_Encoded]):
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
                # Populated: its pages exist (another process wrote them); faulting them into this
                # one page by page as the batch is copied in took 7 ms for 19 MiB, populating 3.
                self._slabs[task.slab_id] = map_slab(fds[0], task.slab_size, task.slab_id, populate=True)
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
