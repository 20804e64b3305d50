"""The loader profiler: where does the training loop's time go, which field's
collation is the hotspot, and is the training loop waiting for data at all?

Recording is a handful of integer appends per batch (timestamps come from the
workers' own messages and from the C kernels' monotonic clock), so it can stay
on in a real run.  ``Profiler.report()`` turns the records into a
:class:`Report`; ``Profiler.save_chrome_trace(path)`` writes a Trace Event
Format file for Perfetto / chrome://tracing.

``Report.stages`` partitions the wall time (first epoch's start to the latest
batch or epoch end) as the training loop lived it; the stages add up to the
wall time, nothing is counted twice:

- ``startup``: starting workers and dispatching the first batches;
- ``sampling``: the sampler producing the epoch's index lists;
- ``consumer_compute``: the training loop's own time between ``next()``
  calls (and between epochs);
- the rest is the training loop blocked in ``next()``, split by where the
  batch it waited for was at that moment:
  ``queued`` (not started: every worker busy with earlier batches),
  ``fetch`` (``__getitem__`` / ``__getitems__`` / transforms in a worker),
  ``collate`` (the batchify kernels in a worker),
  ``transport`` (its trip from the worker to the training loop), and
  ``reorder_wait`` (the loop waited for this batch although a later one was
  already finished: ``in_order=False`` would have yielded that one).

``Report.worker_stages`` has the workers' own totals (fetch, collate and
transport summed over all batches and workers, which run in parallel with the
training loop), and the worker table their busy time and CPU time.

This module collects; the report (its rows, table, JSON and verdict) is made from what it
collected in ``_profile_report.py``.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from . import _trace
from ._profile_report import STAGES, WORKER_STAGES, Collected, Report, report_of

__all__ = ["Profiler", "Report", "profile"]

MAX_TRACE_EVENTS = 200_000
FOLD_AT = 4096   # queued per-batch records aggregated at once


def _now_ns() -> int:
    # CLOCK_MONOTONIC is system-wide on Linux, so worker and main timestamps compare.
    return time.monotonic_ns()


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_cpu_ns(pid: int) -> tuple[int, int] | None:
    """(CPU time used, time spent runnable but waiting for a core) of `pid`'s
    main thread so far, in ns, from /proc (Linux); None where it cannot be
    read (another OS, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            run, wait = f.read().split()[:2]
        return int(run), int(wait)
    except (OSError, ValueError):
        pass
    try:   # no schedstat (kernel without CONFIG_SCHED_INFO): CPU time alone, in clock ticks
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // _CLOCK_TICKS, 0
    except (OSError, IndexError, ValueError):
        return None


def _clip(t: int, lo: int, hi: int) -> int:
    return lo if t < lo else hi if t > hi else t


class Profiler:
    """Collects per-batch, per-field and per-worker timings of one loader.

    Made by ``DataLoader(..., profile=True)`` (as ``loader.profiler``) or by
    :func:`profile`; the loader calls the recording hooks.  Read it with
    :meth:`report` and :meth:`save_chrome_trace`.

    Example:
        >>> import numpy as np, mxload
        >>> loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(8)), batch_size=4, profile=True)
        >>> for batch in loader:
        ...     pass
        >>> loader.profiler.report().batches
        2
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()   # _fold() runs inside report() and the epoch hooks
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded so far."""
        with self._lock:
            self.start_ns: int | None = None
            self.end_ns: int | None = None
            self.stage_ns: dict[str, int] = {s: 0 for s in STAGES}
            self.worker_stage_ns: dict[str, int] = {s: 0 for s in WORKER_STAGES}
            self.samples = 0
            # path -> [kernel, calls, ns, bytes, shape, dtype]
            self.fields: dict[str, list[Any]] = {}
            # worker id -> [busy ns, batches, first start ns, last end ns, pid, restarts]
            self.workers: dict[int, list[Any]] = {}
            self.batches = 0
            # One raw record per batch and side ("batch" from the fetcher, "next"
            # from the consumer, "epoch"), expanded into trace spans only when a
            # trace is saved; bounded so a long run keeps its latest records.
            self.events: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=MAX_TRACE_EVENTS)
            self._last_return_ns: int | None = None
            # batch index -> (start, fetched, collated, ready) of a finished, not yet taken batch
            self._ready: dict[int, tuple[int, int, int, int]] = {}
            self._unmatched: list[tuple[int, int, int]] = []   # taken before its worker record was folded
            self._epoch_start_ns: int | None = None
            self._done_queue: collections.deque[tuple[Any, ...]] = collections.deque()
            self._taken_queue: collections.deque[tuple[Any, ...]] = collections.deque()
            # worker pid -> [(cpu ns, runqueue ns) after its first batch, latest reading,
            #                busy ns of that first batch (not in the CPU figures)]
            self._cpu: dict[int, list[Any]] = {}
            self._main_cpu_ns = 0
            self._main_cpu_start: int | None = None
            self.autotune: Callable[[], dict[str, Any]] | None = None   # num_workers="auto": its report

    # ------------------------------------------------------------ recording

    def epoch_started(self, sampling_ns: int, startup_ns: int) -> None:
        """Recording hook, called by the loader: an epoch's iterator exists;
        `sampling_ns` made its indices, `startup_ns` started workers and
        dispatched the first batches."""
        now = _now_ns()
        begin = now - sampling_ns - startup_ns
        with self._lock:
            self._fold()
            if self.start_ns is None:
                self.start_ns = begin
            elif self.end_ns is not None:
                # Between epochs the training loop did its own work (evaluation, checkpoints).
                self.stage_ns["consumer_compute"] += max(0, begin - self.end_ns)
            self.stage_ns["sampling"] += sampling_ns
            self.stage_ns["startup"] += startup_ns
            self._last_return_ns = None
            self._epoch_start_ns = now
            self.end_ns = now
            self._main_cpu_start = time.process_time_ns()
            self.events.append(("epoch", begin, sampling_ns + startup_ns))

    # The per-batch hooks only append one raw record to a queue: the fetcher
    # and the consumer are on the critical path of every batch (while one
    # runs Python code the other may wait for the GIL), so the aggregation
    # happens later, in _fold(): at report time, at epoch boundaries, or when
    # a queue has FOLD_AT records.  Deque appends and poplefts are atomic.

    def worker_batch(self, worker_id: int, pid: int | None, batch_index: int, start_ns: int,
                     fetch_ns: int, collate_ns: int, sent_ns: int, field_stats: list[Any],
                     field_ns: list[Any], transported: bool = True) -> None:
        """Recording hook, called by the loader: a batch finished in a worker
        (times are the worker's own) and is now in the reorder buffer;
        `transported`: it crossed from another process (sent_ns is then the
        worker's send time)."""
        queue = self._done_queue
        queue.append((worker_id, pid, batch_index, start_ns, fetch_ns, collate_ns,
                      sent_ns if transported else 0, _now_ns(), field_stats, field_ns))
        if transported and pid is not None and pid not in self._cpu:
            # The baseline of the worker's CPU time, while it is surely alive.
            cpu = _process_cpu_ns(pid)
            if cpu is not None:
                # Once per worker, so the lock costs nothing: report() and
                # epoch_ended() iterate the dict, and a snapshot taken without
                # it is not atomic (a collection inside it can switch threads).
                with self._lock:
                    self._cpu.setdefault(pid, [cpu, cpu, fetch_ns + collate_ns])
        if len(queue) >= FOLD_AT:
            self._fold()

    def batch_taken(self, batch_index: int, call_ns: int) -> None:
        """Recording hook, called by the loader: the training loop's next()
        (called at `call_ns`) returned `batch_index`."""
        queue = self._taken_queue
        queue.append((batch_index, call_ns, _now_ns()))
        if len(queue) >= FOLD_AT:
            self._fold()

    def worker_restarted(self, worker_id: int) -> None:
        """Recording hook, called by the loader: worker `worker_id` died and was replaced."""
        with self._lock:
            w = self.workers.setdefault(worker_id, [0, 0, _now_ns(), _now_ns(), None, 0])
            w[5] += 1

    def _fold(self) -> None:
        """Aggregate the queued per-batch records into the stage, field and
        worker totals (and the bounded trace records)."""
        with self._lock:
            worker_stage_ns, workers, fields, events = (self.worker_stage_ns, self.workers, self.fields,
                                                        self.events)
            done, taken = self._done_queue, self._taken_queue
            while done:
                (worker_id, pid, idx, start, fetch_ns, collate_ns, sent, ready,
                 field_stats, field_ns) = done.popleft()
                worker_stage_ns["fetch"] += fetch_ns
                worker_stage_ns["collate"] += collate_ns
                if sent:
                    worker_stage_ns["transport"] += max(0, ready - sent)
                fetched = start + fetch_ns
                collated = fetched + collate_ns
                self._ready[idx] = (start, fetched, collated, max(collated, ready))
                w = workers.get(worker_id)
                if w is None:
                    w = workers[worker_id] = [0, 0, start, sent, pid, 0]
                w[0] += fetch_ns + collate_ns
                w[1] += 1
                w[2] = min(w[2], start)
                w[3] = max(w[3], sent)
                w[4] = pid
                for (path, kernel, nbytes, shape, dtype), ns in zip(field_stats, field_ns):
                    f = fields.get(path)
                    if f is None:
                        f = fields[path] = [kernel, 0, 0, 0, shape, dtype]
                    f[1] += 1
                    f[2] += ns
                    f[3] += nbytes
                    f[4] = shape
                for _path, _kernel, _nbytes, shape, _dtype in field_stats:
                    if shape:
                        self.samples += int(shape[0])
                        break
                events.append(("batch", worker_id, idx, start, fetch_ns, collate_ns, sent, ready))
            if self._unmatched:
                pending, self._unmatched = self._unmatched, []
                for record in pending:
                    self._take(*record)
            while taken:
                self._take(*taken.popleft())

    def _take(self, idx: int, call: int, now: int, final: bool = False) -> None:
        """Account one next() call: the training loop's own time before it,
        and its wait split by where batch `idx` was meanwhile."""
        bounds = self._ready.pop(idx, None)
        if bounds is None and not final:
            # The fetcher thread had not queued this batch's record yet.
            self._unmatched.append((idx, call, now))
            return
        stage_ns = self.stage_ns
        previous = self._last_return_ns if self._last_return_ns is not None else self._epoch_start_ns
        if previous is not None:
            stage_ns["consumer_compute"] += max(0, call - previous)
        if bounds is None:
            stage_ns["transport"] += now - call   # no worker record ever came: only the hand-off is known
        else:
            start, fetched, collated, ready = bounds
            # A later batch finished while the loop waited for this one: the
            # wait from then until this one was ready is head-of-line blocking.
            later = min((b[3] for b in self._ready.values() if b[3] < ready), default=ready)
            cut = _clip(later, call, now)
            q, f, c = _clip(start, call, cut), _clip(fetched, call, cut), _clip(collated, call, cut)
            r = _clip(ready, cut, now)
            stage_ns["queued"] += q - call
            stage_ns["fetch"] += f - q
            stage_ns["collate"] += c - f
            stage_ns["reorder_wait"] += r - cut
            stage_ns["transport"] += (cut - c) + (now - r)
        self.events.append(("next", idx, call, now, self._last_return_ns))
        self._last_return_ns = now
        if self.end_ns is None or now > self.end_ns:
            self.end_ns = now
        self.batches += 1

    def _read_cpu(self) -> None:
        for pid, readings in self._cpu.items():   # lock held: see worker_batch
            cpu = _process_cpu_ns(pid)
            if cpu is not None:
                readings[1] = cpu

    def epoch_ended(self) -> None:
        """Recording hook, called by the loader: the epoch's iterator ended
        (exhausted, closed or failed)."""
        now = _now_ns()
        with self._lock:
            self._fold()
            for record in self._unmatched:
                self._take(*record, final=True)
            self._unmatched = []
            self._read_cpu()   # before the workers of this epoch exit
            if self._main_cpu_start is not None:
                self._main_cpu_ns += time.process_time_ns() - self._main_cpu_start
                self._main_cpu_start = None
            previous = self._last_return_ns if self._last_return_ns is not None else self._epoch_start_ns
            if previous is not None:
                self.stage_ns["consumer_compute"] += max(0, now - previous)
            self._last_return_ns = None
            self._epoch_start_ns = None
            self._ready.clear()
            self.end_ns = now

    # ------------------------------------------------------------ reporting

    def report(self) -> Report:
        """The numbers recorded so far, as a :class:`Report` (with a verdict).

        Returns:
            Report: ``str(report)`` is the table, ``report.to_dict()`` the JSON.
        """
        with self._lock:
            self._fold()
            end = self.end_ns if self.end_ns is not None else _now_ns()
            start = self.start_ns if self.start_ns is not None else end
            if self._epoch_start_ns is not None:
                self._read_cpu()
            main_cpu = self._main_cpu_ns
            if self._main_cpu_start is not None:
                main_cpu += time.process_time_ns() - self._main_cpu_start
            collected = Collected(
                wall_ns=max(1, end - start), stage_ns=dict(self.stage_ns),
                worker_stage_ns=dict(self.worker_stage_ns),
                fields={path: list(row) for path, row in self.fields.items()},
                workers={wid: list(row) for wid, row in self.workers.items()},
                cpu={pid: (r[0], r[1], r[2]) for pid, r in self._cpu.items()}, main_cpu_ns=main_cpu,
                batches=self.batches, samples=self.samples,
                autotune=self.autotune() if self.autotune is not None else None)
        return report_of(collected)

    def save_chrome_trace(self, path: str) -> None:
        """Write the recorded spans in the Trace Event Format (one track per
        worker, the fetcher and the consumer).

        Args:
            path (str): the JSON file to write (open it in https://ui.perfetto.dev
                or chrome://tracing).

        Raises:
            OSError: the file cannot be written.
        """
        with self._lock:
            self._fold()
            records = list(self.events)
        _trace.write_chrome_trace(path, _trace.spans(records), self.start_ns)


@contextmanager
def profile(loader: Any) -> Iterator[Profiler]:
    """Profile `loader` within the block (its ``profiler`` is swapped in and back).

    Args:
        loader (DataLoader): the loader to profile; iterate it inside the block.

    Yields:
        Profiler: the loader's own profiler if it was made with
        ``profile=True``, else a fresh one.

    Example:
        >>> import numpy as np, mxload
        >>> loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(8)), batch_size=4)
        >>> with mxload.profile(loader) as prof:
        ...     for batch in loader:
        ...         pass
        >>> print(prof.report().verdict)  # doctest: +SKIP
    """
    previous = loader.profiler
    prof = previous if previous is not None else Profiler()
    loader.profiler = prof
    try:
        yield prof
    finally:
        loader.profiler = previous
