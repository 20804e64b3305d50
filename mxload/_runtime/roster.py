"""The engine's record of its workers: which are alive, whose stream is
exhausted, which tasks each holds, and which worker takes the next task.

The transport keeps each worker's channel; this keeps only what the engine
decides with.  Every method runs under the engine's lock.  The compiled window
reads the records and the takers as typed fields (their base, WorkerBooks, and
WorkerRecord are the core's: csrc/books.pxi, mxload/_core.pxd)."""
from __future__ import annotations

from .._core import WorkerBooks, WorkerRecord

__all__ = ["Roster", "WorkerRecord"]


class Roster(WorkerBooks):
    """One record per worker id; every worker's exists before any runs (one may report at once)."""

    def __init__(self, num_workers: int):
        self.workers = [WorkerRecord() for _ in range(num_workers)]
        # `takers`: the ids of the workers that take tasks (alive, stream not exhausted);
        # None once any worker's state changed (see changed()).
        self.takers = None
        self.active = num_workers   # num_workers="auto": only workers below this id take tasks
        # A stream's last task went to this worker (None: none yet this epoch); see pick().
        self._last_stream_worker: int | None = None

    def __len__(self) -> int:
        return len(self.workers)

    def changed(self) -> None:
        """A worker's `alive` or `exhausted` changed: the takers are counted again."""
        self.takers = None

    def set_active(self, workers: int) -> None:
        """Only workers 0..workers-1 take tasks from now on; the others keep,
        and answer, the tasks they hold."""
        self.active = workers
        self.takers = None

    def new_epoch(self) -> None:
        for w in self.workers:
            w.exhausted = False
        self.takers = None
        self._last_stream_worker = None

    def pick(self, idx: int, in_order: bool, stream: bool = False) -> int | None:
        """The worker that takes batch `idx`'s task (`stream`: the `idx`-th task of an
        IterableDataset's epoch); None if none can."""
        live = self.takers
        if live is None:
            live = self.takers = [wid for wid, w in enumerate(self.workers)
                                   if w.alive and not w.exhausted and wid < self.active]
        if not live:
            return None
        n = len(live)
        if stream and in_order:
            # As torch's loader: the worker after the last task's, skipping those whose stream
            # ended (a cycle from worker 0 each epoch).  A task sent to a worker before its end
            # was known yields nothing, so the batches come in the same order whenever that end
            # is learnt; `idx % n` over the workers left would not (a worker twice in a row).
            last = self._last_stream_worker
            after = -1 if last is None else last
            wid = next((w for w in live if w > after), live[0])
            self._last_stream_worker = wid
            return wid
        if in_order or n == 1:
            # Round-robin by batch index, not least-loaded: which worker loads
            # which batch (and so which per-worker random stream it sees, torch's
            # worker i % num_workers) must not depend on timing, nor on where a
            # resumed epoch starts.
            return live[idx % n]
        # in_order=False gives up that determinism for throughput, as torch's:
        # the worker with the fewest tasks out, so a straggler's queue stays at
        # its share of the window while the others take the rest (ties go
        # round-robin).  Its tasks are popped when their batch is taken.
        workers = self.workers
        start = idx % n
        best, best_load = live[start], len(workers[live[start]].outstanding)
        for k in range(1, n):
            wid = live[(start + k) % n]
            load = len(workers[wid].outstanding)
            if load < best_load:
                best, best_load = wid, load
        return best

    def held(self, wid: int, epoch: int) -> list[int]:
        """The batches of `epoch` whose tasks worker `wid` holds, in dispatch order."""
        return [i for e, i in self.workers[wid].outstanding if e == epoch]

    def holders(self, epoch: int, idx: int) -> list[int]:
        """The workers holding batch `idx`'s task (one, unless mxload lost track of it)."""
        return [wid for wid, w in enumerate(self.workers) if (epoch, idx) in w.outstanding]

    def alive_ids(self) -> list[int]:
        return [wid for wid, w in enumerate(self.workers) if w.alive]

    def all_done(self) -> bool:
        """Every worker's stream ended, or the worker did."""
        return all(w.exhausted or not w.alive for w in self.workers)

    def lost(self, wid: int) -> None:
        self.workers[wid].alive = False
        self.takers = None

    def replace(self, wid: int) -> WorkerRecord:
        """A fresh record for a restarted worker; returns the dead one's."""
        dead, self.workers[wid] = self.workers[wid], WorkerRecord()
        self.takers = None
        return dead

    def forget_all(self) -> None:
        """Shutdown: no worker is alive, no task held."""
        for w in self.workers:
            w.outstanding.clear()
            w.alive = False
        self.takers = None
