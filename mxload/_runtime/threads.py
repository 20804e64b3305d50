"""Worker threads (thread_pool=True): a queue of tasks per thread; each
thread collates into private memory and delivers its results itself."""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

import numpy as np

from .._core import QueuePut
from . import messages as m
from . import os_threads
from .os_malloc import keep_freed_memory_in_training_process
from .transport import Transport, TransportSetup, WorkerLoss
from .worker import thread_worker_main

__all__ = ["ThreadTransport"]


class ThreadTransport(Transport):
    transported = False

    def __init__(self, setup: TransportSetup):
        super().__init__(setup)
        template = setup.config
        configs = [dataclasses.replace(template, worker_id=wid) for wid in range(template.num_workers)]
        self._queues: list[queue.SimpleQueue[tuple[int, int, Any, bool] | m.Stop]] = [
            queue.SimpleQueue() for _ in configs]
        self.put_task: QueuePut = QueuePut(self._queues)   # compiled (SimpleQueue.put wakes the thread too)
        # Every thread exists before any runs: one may report (a failed
        # worker_init_fn) as soon as it starts.
        self._threads = [
            threading.Thread(target=thread_worker_main, args=(c, q, self._deliver, self._ended),
                             name=f"mxload-worker-thread-{c.worker_id}", daemon=True)
            for c, q in zip(configs, self._queues)]

    def start(self) -> None:
        keep_freed_memory_in_training_process()   # the threads load in this process (os_malloc.py)
        for wid in range(len(self._threads)):
            self.start_thread(wid)

    def start_thread(self, worker_id: int) -> None:
        os_threads.start(self._threads[worker_id])

    def _deliver(self, worker_id: int, result: m.WorkerResult) -> None:
        assert isinstance(result, (m.Loaded, m.Failed, m.Exhausted, m.InitFailed))
        with self.lock:   # also serialises the profiler's hooks between worker threads
            self.sink.deliver(worker_id, result)

    def _ended(self, worker_id: int, error: BaseException, doing: str) -> None:
        """A worker thread's loop ended without a stop request (its thread
        calls this last): the epoch fails now, as for a dead process."""
        def final(held: list[int]) -> str:
            return (f"mxload worker thread {worker_id} ended unexpectedly while {doing}: "
                    f"{type(error).__name__}: {m.safe_text(error)} (holding batches {held}). A thread "
                    f"worker cannot be restarted; catch the exception in the dataset or worker_init_fn")
        with self.lock:
            self.sink.worker_lost(WorkerLoss(worker_id, None, None, "ended", final=final))

    def dispatch(self, worker_id: int, epoch: int, batch_index: int, indices: np.ndarray | None,
                 profiling: bool) -> None:
        self.put_task(worker_id, (epoch, batch_index, indices, profiling))

    def restart(self, worker_id: int, epoch: int) -> bool:
        raise AssertionError("thread workers are never restarted")

    @property
    def restartable(self) -> bool:
        return False

    def pid(self, worker_id: int) -> int | None:
        return None

    # The shutdown phases (NOTE [ Numbered shutdown ], shutdown.py).
    def stop_receiving(self, deadline: float) -> None:
        """Threads deliver their own results; the engine drops those that come late."""

    def refuse_starts(self, deadline: float) -> None:
        """Thread workers all start with the engine, never later."""

    def ask_to_stop(self) -> None:
        """Each thread stops after its current batch: the tasks queued
        behind it are dropped (nobody wants their batches any more), as a
        worker process skips its queued work."""
        for q in self._queues:
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            q.put(m.Stop())

    def end_workers(self, start: float, deadline: float) -> None:
        for t in self._threads:
            if t.ident is not None and t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    def release(self) -> None:
        pass
