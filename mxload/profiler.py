"""The loader profiler: where does a batch's time go, which field's collation
is the hotspot, and is the training loop waiting for data at all?

Recording is a handful of integer appends per batch (timestamps come from the
workers' own messages and from the C kernels' monotonic clock), so it can stay
on in a real run.  ``Profiler.report()`` turns the records into a
:class:`Report`; ``Profiler.save_chrome_trace(path)`` writes a Trace Event
Format file for Perfetto / chrome://tracing.

Stages of one batch:

- ``sampling``: the sampler producing the epoch's index lists (main process);
- ``fetch``: ``__getitem__`` / ``__getitems__`` / transforms (worker);
- ``collate``: the batchify planner and kernels (worker);
- ``transport``: from the worker sending the result to the batch being in the
  reorder buffer (queue, slab hand-off, views built);
- ``reorder_wait``: the batch sat finished but out of order;
- ``consumer_wait``: the training loop blocked in ``next()``;
- ``consumer_compute``: the training loop's own time between ``next()`` calls.

``consumer_wait + consumer_compute + startup`` is the wall time; the worker
stages run in parallel with them and are reported per worker too.
"""
from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

__all__ = ["Profiler", "Report", "profile"]

# The training loop is "loader-bound" when it waits for data more than this
# share of the wall time.
LOADER_BOUND_SHARE = 0.2

MAX_TRACE_EVENTS = 200_000
FOLD_AT = 4096   # queued per-batch records aggregated at once

STAGES = ("sampling", "fetch", "collate", "transport", "reorder_wait", "consumer_wait", "consumer_compute")


def _now_ns() -> int:
    # CLOCK_MONOTONIC is system-wide on Linux, so worker and main timestamps compare.
    return time.monotonic_ns()


class Profiler:
    """Collects per-batch, per-field and per-worker timings of one loader."""

    def __init__(self) -> None:
        self._lock = threading.RLock()   # _fold() runs inside report() and the epoch hooks
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.start_ns: int | None = None
            self.end_ns: int | None = None
            self.stage_ns: dict[str, int] = {s: 0 for s in STAGES}
            self.startup_ns = 0
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
            self._put_ns: dict[int, int] = {}
            self._epoch_start_ns: int | None = None
            self._done_queue: collections.deque[tuple[Any, ...]] = collections.deque()
            self._taken_queue: collections.deque[tuple[Any, ...]] = collections.deque()

    # ------------------------------------------------------------ recording

    def epoch_started(self, sampling_ns: int, startup_ns: int) -> None:
        """An epoch's iterator exists: `sampling_ns` made its indices,
        `startup_ns` started workers and dispatched the first batches."""
        now = _now_ns()
        with self._lock:
            self._fold()
            if self.start_ns is None:
                self.start_ns = now - sampling_ns - startup_ns
            self.stage_ns["sampling"] += sampling_ns
            self.startup_ns += startup_ns
            self._last_return_ns = None
            self._epoch_start_ns = now
            self.events.append(("epoch", now - sampling_ns - startup_ns, sampling_ns + startup_ns))

    # The per-batch hooks only append one raw record to a queue: the fetcher
    # and the consumer are on the critical path of every batch (while one
    # runs Python code the other may wait for the GIL), so the aggregation
    # happens later, in _fold(): at report time, at epoch boundaries, or when
    # a queue has FOLD_AT records.  Deque appends and poplefts are atomic.

    def worker_batch(self, worker_id: int, pid: int | None, batch_index: int, start_ns: int,
                     fetch_ns: int, collate_ns: int, sent_ns: int, field_stats: list[Any],
                     field_ns: list[Any], transported: bool = True) -> None:
        """A batch finished in a worker (times are the worker's own) and is
        now in the reorder buffer; `transported`: it crossed from another
        process (sent_ns is then the worker's send time)."""
        queue = self._done_queue
        queue.append((worker_id, pid, batch_index, start_ns, fetch_ns, collate_ns,
                      sent_ns if transported else 0, _now_ns(), field_stats, field_ns))
        if len(queue) >= FOLD_AT:
            self._fold()

    def batch_taken(self, batch_index: int, call_ns: int) -> None:
        """The consumer's next() (called at `call_ns`) returned `batch_index`."""
        queue = self._taken_queue
        queue.append((batch_index, call_ns, _now_ns()))
        if len(queue) >= FOLD_AT:
            self._fold()

    def worker_restarted(self, worker_id: int) -> None:
        with self._lock:
            w = self.workers.setdefault(worker_id, [0, 0, _now_ns(), _now_ns(), None, 0])
            w[5] += 1

    def _fold(self) -> None:
        """Aggregate the queued per-batch records into the stage, field and
        worker totals (and the bounded trace records)."""
        with self._lock:
            stage_ns, workers, fields, events = self.stage_ns, self.workers, self.fields, self.events
            done, taken = self._done_queue, self._taken_queue
            while done:
                (worker_id, pid, idx, start, fetch_ns, collate_ns, sent, ready,
                 field_stats, field_ns) = done.popleft()
                stage_ns["fetch"] += fetch_ns
                stage_ns["collate"] += collate_ns
                if sent:
                    stage_ns["transport"] += max(0, ready - sent)
                self._put_ns[idx] = ready
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
                events.append(("batch", worker_id, idx, start, fetch_ns, collate_ns, sent, ready))
            while taken:
                idx, call, now = taken.popleft()
                previous = self._last_return_ns
                if previous is not None:
                    stage_ns["consumer_compute"] += max(0, call - previous)
                elif self._epoch_start_ns is not None:
                    stage_ns["consumer_compute"] += max(0, call - self._epoch_start_ns)
                stage_ns["consumer_wait"] += now - call
                put = self._put_ns.pop(idx, None)
                if put is not None:
                    stage_ns["reorder_wait"] += max(0, now - put)
                events.append(("next", idx, call, now, previous))
                self._last_return_ns = now
                self.end_ns = now
                self.batches += 1

    def epoch_ended(self) -> None:
        now = _now_ns()
        with self._lock:
            self._fold()
            if self._last_return_ns is not None:
                self.stage_ns["consumer_compute"] += max(0, now - self._last_return_ns)
            self._last_return_ns = None
            self._put_ns.clear()
            self.end_ns = now

    # ------------------------------------------------------------ reporting

    def report(self) -> Report:
        with self._lock:
            self._fold()
            end = self.end_ns if self.end_ns is not None else _now_ns()
            start = self.start_ns if self.start_ns is not None else end
            wall_ns = max(1, end - start)
            stages = {k: v / 1e9 for k, v in self.stage_ns.items()}
            worker_total = sum(w[0] for w in self.workers.values()) or 1
            fields = []
            for path, (kernel, calls, ns, nbytes, shape, dtype) in self.fields.items():
                fields.append({
                    "path": path, "kernel": kernel, "batches": calls, "seconds": ns / 1e9,
                    "share_of_worker_time": ns / worker_total,
                    "bytes_per_batch": nbytes / max(calls, 1), "shape": list(shape), "dtype": dtype,
                })
            fields.sort(key=lambda f: f["seconds"], reverse=True)
            workers = []
            for wid, (busy, n, _first, _last, pid, restarts) in sorted(self.workers.items()):
                span = max(1, end - start)
                workers.append({
                    "worker": wid, "pid": pid, "batches": n, "busy_s": busy / 1e9,
                    "idle_s": max(0.0, (span - busy) / 1e9), "busy_share": min(1.0, busy / span),
                    "restarts": restarts,
                })
            return Report(wall_s=wall_ns / 1e9, startup_s=self.startup_ns / 1e9, stages=stages,
                          fields=fields, workers=workers, batches=self.batches)

    def _spans(self) -> list[tuple[str, str, int | None, int, int]]:
        """The raw records as (track, label, batch index or None, start ns, dur ns)."""
        with self._lock:
            self._fold()
            records = list(self.events)
        spans: list[tuple[str, str, int | None, int, int]] = []
        for record in records:
            kind = record[0]
            if kind == "batch":
                _, worker_id, idx, start, fetch_ns, collate_ns, sent, ready = record
                # In-process loading (worker -1) happens inside the consumer's next().
                track = f"worker {worker_id}" if worker_id >= 0 else "consumer"
                spans.append((track, "fetch", idx, start, fetch_ns))
                spans.append((track, "collate", idx, start + fetch_ns, collate_ns))
                if sent:
                    spans.append(("fetcher", "transport", idx, sent, max(0, ready - sent)))
            elif kind == "next":
                _, idx, call, now, previous = record
                if previous is not None:
                    spans.append(("consumer", "compute", None, previous, max(0, call - previous)))
                spans.append(("consumer", "next() ->", idx, call, now - call))
            else:  # "epoch"
                spans.append(("consumer", "start epoch", None, record[1], record[2]))
        return spans

    def save_chrome_trace(self, path: str) -> None:
        """Write the recorded spans in the Trace Event Format (one track per
        worker, the fetcher and the consumer)."""
        spans = self._spans()
        origin = self.start_ns or (min(sp[3] for sp in spans) if spans else 0)
        pid = os.getpid()
        tracks = sorted({sp[0] for sp in spans}, key=_track_order)
        tids = {name: i + 1 for i, name in enumerate(tracks)}
        trace: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "mxload"}}]
        for name, tid in tids.items():
            trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
            trace.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                          "args": {"sort_index": tid}})
        for track, label, batch_index, start, dur in spans:
            name = label if batch_index is None else f"{label} batch {batch_index}"
            trace.append({"name": name, "cat": track.split()[0], "ph": "X", "pid": pid, "tid": tids[track],
                          "ts": (start - origin) / 1e3, "dur": max(dur, 0) / 1e3,
                          "args": {} if batch_index is None else {"batch": batch_index}})
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def _track_order(name: str) -> tuple[Any, ...]:
    kind = name.split()[0]
    rank = {"consumer": 0, "fetcher": 1, "worker": 2}.get(kind, 3)
    return (rank, int(name.split()[1]) if kind == "worker" else 0)


class Report:
    """A profile's numbers, a plain-text table (``str()``) and a verdict."""

    def __init__(self, wall_s: float, startup_s: float, stages: dict[str, float],
                 fields: list[dict[str, Any]], workers: list[dict[str, Any]], batches: int):
        self.wall_s = wall_s
        self.startup_s = startup_s
        self.stages = stages
        self.fields = fields
        self.workers = workers
        self.batches = batches
        self.verdict = self._verdict()

    @property
    def loader_bound(self) -> bool:
        return self.stages["consumer_wait"] > LOADER_BOUND_SHARE * self.wall_s

    def _verdict(self) -> str:
        wall = max(self.wall_s, 1e-9)
        wait_share = self.stages["consumer_wait"] / wall
        if not self.loader_bound:
            return (f"consumer-bound: the training loop waited for data {wait_share:.0%} of the time "
                    f"and computed {self.stages['consumer_compute'] / wall:.0%}; the loader is not the "
                    f"bottleneck")
        head = f"loader-bound: the training loop waited for data {wait_share:.0%} of the time"
        fetch, collate = self.stages["fetch"], self.stages["collate"]
        worker_time = max(fetch + collate, 1e-9)
        busy = [w["busy_share"] for w in self.workers if w["worker"] >= 0]
        if busy and sum(busy) / len(busy) < 0.5:
            return (f"{head}; workers idle {1 - sum(busy) / len(busy):.0%}: raise prefetch (or the "
                    f"main process is saturated: transport took {self.stages['transport']:.3f} s)")
        if collate > fetch and self.fields:
            top = self.fields[0]
            top_share = top["seconds"] / worker_time
            in_kernels = sum(f["seconds"] for f in self.fields) / max(collate, 1e-9)
            if top_share < 0.25 and len(self.fields) > 3:
                return (f"{head}; collation is {collate / worker_time:.0%} of worker time, spread over "
                        f"{len(self.fields)} fields ({min(in_kernels, 1):.0%} of it copying, the rest "
                        f"per-field work): return fewer, larger arrays (stack related fields into one)")
            mb = top["bytes_per_batch"] / 1e6
            if top["kernel"] == "pickled":
                how, hint = "via pickled fallback", "return a numpy array instead of a list / Python objects"
            elif top["kernel"] == "pad":
                how, hint = "via pad", "bucket samples by length or cap the padded length"
            else:
                how = f"via {top['kernel']}"
                try:
                    wide = np.dtype(top["dtype"]).itemsize > 1
                except TypeError:
                    wide = False
                hint = ("use a smaller dtype (e.g. uint8 or float16 instead of float32) or add workers"
                        if mb > 1 and wide else "add workers")
            return (f"{head}; collation of {top['path']} is {top_share:.0%} of worker time: "
                    f"{mb:.1f} MB/batch {how}; {hint}")
        return (f"{head}; sample fetch (__getitem__ / transforms) is {fetch / worker_time:.0%} of worker "
                f"time: add workers, or implement __getitems__ to fetch a batch at once")

    def to_dict(self) -> dict[str, Any]:
        return {"wall_s": self.wall_s, "startup_s": self.startup_s, "batches": self.batches,
                "stages": dict(self.stages), "fields": [dict(f) for f in self.fields],
                "workers": [dict(w) for w in self.workers], "verdict": self.verdict,
                "loader_bound": self.loader_bound}

    def __str__(self) -> str:
        wall = max(self.wall_s, 1e-9)
        lines = [f"mxload profile: {self.batches} batches in {self.wall_s:.3f} s "
                 f"({self.batches / wall:.1f} batches/s, start-up {self.startup_s * 1e3:.1f} ms)", "",
                 f"{'stage':<18} {'seconds':>9} {'% of wall':>10}"]
        for name in STAGES:
            v = self.stages[name]
            lines.append(f"{name:<18} {v:>9.3f} {v / wall:>9.0%}")
        lines.append("(fetch, collate and transport run in the workers, in parallel with the consumer)")
        if self.fields:
            lines += ["", f"{'field':<28} {'kernel':<8} {'seconds':>8} {'% worker':>9} {'MB/batch':>9} "
                          f"{'shape':<18} dtype"]
            for f in self.fields[:12]:
                lines.append(f"{f['path'][:28]:<28} {f['kernel']:<8} {f['seconds']:>8.3f} "
                             f"{f['share_of_worker_time']:>8.0%} {f['bytes_per_batch'] / 1e6:>9.2f} "
                             f"{str(tuple(f['shape'])):<18} {f['dtype']}")
            if len(self.fields) > 12:
                lines.append(f"... and {len(self.fields) - 12} more fields (all of them in to_dict())")
        if self.workers:
            lines += ["", f"{'worker':<8} {'pid':>8} {'batches':>8} {'busy s':>8} {'idle s':>8} "
                          f"{'busy':>6} {'restarts':>8}"]
            for w in self.workers:
                name = "main" if w["worker"] < 0 else str(w["worker"])
                lines.append(f"{name:<8} {str(w['pid']):>8} {w['batches']:>8} {w['busy_s']:>8.3f} "
                             f"{w['idle_s']:>8.3f} {w['busy_share']:>6.0%} {w['restarts']:>8}")
        lines += ["", f"verdict: {self.verdict}"]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<mxload profile Report: {self.batches} batches, {self.verdict!r}>"


@contextmanager
def profile(loader: Any) -> Iterator[Profiler]:
    """Profile `loader` within the block: ``with mxload.profile(loader) as prof:``."""
    previous = loader.profiler
    prof = previous if previous is not None else Profiler()
    loader.profiler = prof
    try:
        yield prof
    finally:
        loader.profiler = previous
