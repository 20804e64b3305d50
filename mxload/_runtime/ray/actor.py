"""The Ray actor that is one of a loader's workers (backend="ray").

The same task loop as a local worker process (worker.answer, with the same
sample source, seeding and worker info), behind Ray's actor calls instead of
a socket: ``load(task)`` answers one Task with a RemoteBatch (collated with
mxload's kernels into one uint8 buffer, which Ray's object store carries to
the trainer without a copy on its node), Failed or Exhausted.  The dataset is
put into the object store once by the trainer and fetched here by each
actor, inside a try, so a class that cannot be imported on this node is a
clear worker_init failure, not an actor that dies before it can say why.

This module does not import ray at import time: the trainer imports it to
wrap ``LoaderActor`` with ``ray.remote`` only when it starts Ray workers.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, cast

from ..._collate import plan as _plan
from .. import messages as m
from ..messages import WorkerConfig
from ..worker import WorkerLink, answer, enter_process, reseed_process
from .errors import plain

__all__ = ["LoaderActor"]

RESULT_TYPES = (m.RemoteBatch, m.Failed, m.Exhausted)


class _ActorLink(WorkerLink[m.RemoteBatch]):
    """One task's answer, kept for the actor call to return."""

    def __init__(self) -> None:
        super().__init__()
        self.result: m.RemoteBatch | m.Failed | m.Exhausted | None = None
        # Reused for every batch: Ray copies a call's result into its object
        # store before the actor runs the next call, and a fresh buffer per
        # batch would cost its page faults every time.
        self._buffer = _plan.allocate(0)

    def _take(self, nbytes: int) -> Any:
        if self._buffer.size < nbytes:
            self._buffer = _plan.allocate(max(nbytes, self._buffer.size * 5 // 4))
        return self._buffer[:nbytes]

    def collate(self, task: m.Task, samples: Any, batchify_fn: Callable[..., Any],
                t0: int, t1: int) -> m.RemoteBatch:
        plan = _plan.plan_batch(batchify_fn, samples, task.batch_index)
        buffer = self._take(plan.nbytes) if plan.nbytes else None
        _, fill_ns = plan.fill(buffer) if buffer is not None else ([], [])
        timings = None
        if task.profiling:
            t2 = time.monotonic_ns()
            stats, field_ns = plan.field_stats(fill_ns)
            timings = m.Timings(t0, t1 - t0, t2 - t1, time.monotonic_ns(), stats, field_ns)
        return m.RemoteBatch(task.epoch, task.batch_index, plan.layout(), buffer, timings)

    def send_batch(self, reply: m.RemoteBatch) -> None:
        self.result = reply

    def send(self, message: m.Failed | m.Exhausted | m.InitFailed) -> None:
        assert not isinstance(message, m.InitFailed)
        self.result = message


class LoaderActor:
    """Worker `config.worker_id` of one loader, as a Ray actor.

    Args:
        config: the worker's configuration (its payload is not used: the
            user's objects come through `payload`).
        payload: ``[ObjectRef]`` of (dataset, batchify_fn, worker_init_fn),
            wrapped in a list so that Ray hands the reference over instead
            of resolving it before this constructor can catch its errors.
    """

    def __init__(self, config: WorkerConfig, payload: list[Any]):
        self._config = config
        self._epoch = config.epoch
        self._init_failed: m.InitFailed | None = None
        self._link = _ActorLink()
        try:
            import ray
            dataset, self._batchify_fn, worker_init_fn = ray.get(payload[0])
        except Exception as e:
            self._init_failed = m.InitFailed(m.ExceptionInfo.of(RuntimeError(
                f"mxload worker {config.worker_id} (a Ray actor on node {_node_ip()}) could not receive the "
                f"dataset, batchify_fn and worker_init_fn: {type(e).__name__}: {plain(str(e))}. Their "
                f"classes and functions must be importable on every node that runs workers: ship the code "
                f"with RayBackend(runtime_env={{'working_dir': ...}}) or {{'py_modules': [...]}}")))
            return
        enter_process(config, dataset)
        self._source = config.source(dataset, self._batchify_fn)
        if worker_init_fn is not None:
            try:
                worker_init_fn(config.worker_id)
            except (Exception, SystemExit) as e:   # sys.exit() there is a failure to report, too
                self._init_failed = m.InitFailed(m.ExceptionInfo.of(e))

    def ready(self) -> m.ActorReady:
        """Where this actor runs, and whether it can serve tasks."""
        import ray
        context = ray.get_runtime_context()
        return m.ActorReady(os.getpid(), context.get_node_id(), _node_ip(), self._init_failed)

    def load(self, task: m.Task) -> m.RemoteBatch | m.Failed | m.Exhausted:
        """Answer one task."""
        if self._init_failed is not None:
            raise RuntimeError("this worker's worker_init_fn failed; it serves no task")
        if task.epoch != self._epoch:   # persistent workers: reseed per epoch, as fresh ones are
            reseed_process(self._config, task.epoch)
            self._epoch = task.epoch
        self._link.result = None
        answer(self._link, task, self._source, self._batchify_fn)
        result, self._link.result = self._link.result, None
        assert isinstance(result, RESULT_TYPES)
        return result


def _node_ip() -> str:
    try:
        import ray
        node_ip = cast(Callable[[], str], ray.util.get_node_ip_address)   # untyped in Ray
        return node_ip()
    except Exception:
        return "unknown"
