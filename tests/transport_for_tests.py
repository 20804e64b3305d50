"""A transport of the tests' own, plugged in through a backend class: adding a kind of
worker needs this module and nothing else (no edit to the engine, the options or the loader).

Its workers are threads of this process running the one worker loop (as thread_pool=True's
do, written here from the Transport contract alone), and it counts the tasks it was given,
which loader.stats reports beside the engine's counters."""
from __future__ import annotations

import dataclasses
import queue
import threading
import time

from mxload._runtime import messages as m
from mxload._runtime.transport import Transport, TransportSetup, WorkerLoss
from mxload._runtime.worker import thread_worker_main
from mxload.backends import Backend


class CountingTransport(Transport):
    transported = False

    def __init__(self, setup: TransportSetup):
        super().__init__(setup)
        self.counts = {"counted_tasks": 0}
        workers = setup.config.num_workers
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(workers)]
        self._threads = [
            threading.Thread(target=thread_worker_main,
                             args=(dataclasses.replace(setup.config, worker_id=wid), q, self._deliver,
                                   self._ended),
                             name=f"test-counting-worker-{wid}", daemon=True)
            for wid, q in enumerate(self._queues)]

    def counters(self) -> list[dict[str, int]]:
        return [self.counts]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _deliver(self, worker_id: int, result) -> None:
        with self.lock:
            self.sink.deliver(worker_id, result)

    def _ended(self, worker_id: int, error: BaseException, doing: str) -> None:
        with self.lock:
            self.sink.worker_lost(WorkerLoss(
                worker_id, None, None, "ended",
                final=lambda held: f"test worker {worker_id} ended while {doing}: {error!r} (held {held})"))

    def dispatch(self, worker_id, epoch, batch_index, indices, profiling) -> None:
        self.counts["counted_tasks"] += 1
        # The worker loop of thread workers takes (epoch, batch index, indices, profiling).
        self._queues[worker_id].put((epoch, batch_index, indices, profiling))

    def restart(self, worker_id: int, epoch: int) -> bool:
        raise AssertionError("never restarted")

    @property
    def restartable(self) -> bool:
        return False

    def pid(self, worker_id: int) -> int | None:
        return None

    def stop_receiving(self, deadline: float) -> None:
        pass

    def refuse_starts(self, deadline: float) -> None:
        pass

    def ask_to_stop(self) -> None:
        for q in self._queues:
            q.put(m.Stop())

    def end_workers(self, start: float, deadline: float) -> None:
        for thread in self._threads:
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def release(self) -> None:
        pass


class CountingBackend(Backend):
    def make_transport(self, setup: TransportSetup) -> Transport:
        return CountingTransport(setup)
