"""The profiler's report: from the totals a Profiler collected (profiler.py, as a `Collected`
snapshot) to the per-field and per-worker rows, the table (``str(report)``), the JSON
(``to_dict()``) and the verdict.  Nothing here records or reads a clock: a report is a pure
function of what was collected (and of the usable cores)."""
from __future__ import annotations

import collections
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._cpus import usable_cores
from ._words import count

__all__ = ["Collected", "Report", "STAGES", "WAIT_STAGES", "WORKER_STAGES", "report_of"]

# The training loop is "loader-bound" when it waits for data more than this
# share of the wall time.
LOADER_BOUND_SHARE = 0.2
# Fewer batches than this get no verdict.  An epoch's first wait is the pipeline's fill (every
# worker starts its first batch at once), about one batch's making; where the training step
# takes as long as a batch, that wait alone is 1 / (k + 1) of k batches' wall time, which is
# below LOADER_BOUND_SHARE only from k = 5 on: fewer batches would be called loader-bound for
# starting, not for loading.
MIN_BATCHES_TO_JUDGE = 5
# Cores count as full when the loader's processes use this share of them.
CPU_FULL_SHARE = 0.85
# ... or when the workers spend this share of their runnable time waiting
# for a core (the machine is shared, or there are more workers than cores).
CONTENDED_SHARE = 0.25
# A worker computes (rather than sleeps or waits on I/O) when its CPU time
# is at least this share of its busy time.
COMPUTING_SHARE = 0.7
# Below this many microseconds of __getitem__ per sample, the Python call per
# sample (not the work inside it) dominates, and __getitems__ pays off.
PER_SAMPLE_OVERHEAD_US = 50.0

# A list-valued field (600 boxes in `sample['boxes']`) is collated element by element, each
# element a field path of its own (`sample['boxes'][0]`...).  The report gives the list one
# row: positions under one parent are its elements when there are at least this many and
# they are alike (kernel, dtype, rank; the same shape unless padded).  Two alike positions
# stay two rows: a sample's `(input, target)` pair is two fields, not a list.
LIST_ELEMENTS_FROM = 3

WAIT_STAGES = ("queued", "fetch", "collate", "transport", "reorder_wait")
STAGES = ("startup", "sampling") + WAIT_STAGES + ("consumer_compute",)
WORKER_STAGES = ("fetch", "collate", "transport")

_STAGE_LABELS = {
    "startup": "start-up (workers, first batches)",
    "sampling": "sampling (index lists)",
    "queued": "waiting: batch queued",
    "fetch": "waiting: fetch",
    "collate": "waiting: collate",
    "transport": "waiting: transport",
    "reorder_wait": "waiting: reorder",
    "consumer_compute": "training loop's own time",
}


def _path_parts(path: str) -> tuple[str, ...]:
    """A field path split into its root and its ``[...]`` parts (``sample['a]'][3]`` ->
    ``('sample', "['a]']", '[3]')``): a key's repr may hold brackets of its own."""
    parts: list[str] = []
    start = path.find("[")
    if start < 0:
        return (path,)
    parts.append(path[:start])
    i = start
    while i < len(path):
        j = i + 1
        if j < len(path) and path[j] in "'\"":   # a quoted key: up to its closing quote
            quote, j = path[j], j + 1
            while j < len(path) and path[j] != quote:
                j += 2 if path[j] == "\\" else 1
        j = path.find("]", j)
        if path[i] != "[" or j < 0:   # not a path this module made: one part
            return (path,)
        parts.append(path[i:j + 1])
        i = j + 1
    return tuple(parts)


_ANY = "[*]"
_AS_ONE_ARRAY = ("return the list as one array (np.stack its elements in __getitem__, or pad them to "
                 "one length): one copy per batch instead of one per element")


def _smaller_dtype(dtype: str) -> str | None:
    """What a big field of `dtype` (a numpy dtype string) could be stored as instead, named
    with its own dtype; None where nothing narrower of the same kind exists."""
    try:
        wide = np.dtype(dtype)
    except TypeError:
        return None
    half = wide.itemsize // 2
    if wide.kind == "f" and half >= 2:
        also = (", or uint8 if it holds 8-bit data such as pixels (normalise after the transfer)"
                if half == 2 else "")
        return (f"store it as {np.dtype(f'f{half}').name} instead of {wide.name} if that precision is "
                f"enough{also}")
    if wide.kind in "iu" and half >= 1:
        return f"store it as {np.dtype(f'{wide.kind}{half}').name} instead of {wide.name} if its values fit"
    if wide.kind == "c" and half >= 8:   # complex128 -> complex64 (two float32)
        return f"store it as {np.dtype(f'c{half}').name} instead of {wide.name} if that precision is enough"
    if wide.kind == "f":   # float16
        return f"store it as uint8 instead of {wide.name} if it holds 8-bit data such as pixels"
    return None


def _alike(rows: list[list[Any]]) -> bool:
    kernel, shape, dtype = rows[0][0], rows[0][4], rows[0][5]
    return all(r[0] == kernel and r[5] == dtype and len(r[4]) == len(shape)
               and (kernel == "pad" or tuple(r[4]) == tuple(shape)) for r in rows)


def _list_rows(fields: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """The profiler's per-path totals ([kernel, calls, ns, bytes, shape, dtype]) with the
    elements of list-valued fields summed into one row each (see LIST_ELEMENTS_FROM), as
    path -> [kernel, calls, ns, bytes, shape, dtype, elements]: ``sample['boxes']`` for its
    600 elements, ``sample['boxes'][*]['xy']`` for a part of each of a list's dicts."""
    rows = {_path_parts(path): [*row, 1] for path, row in fields.items()}
    while True:
        groups: dict[tuple[str, ...], list[tuple[str, ...]]] = collections.defaultdict(list)
        for parts in rows:
            last = max((k for k, part in enumerate(parts) if k and part[1:-1].isdigit()), default=0)
            if last:
                groups[parts[:last] + (_ANY,) + parts[last + 1:]].append(parts)
        merged = False
        for key, members in groups.items():
            alike = [rows[m] for m in members]
            if len(members) < LIST_ELEMENTS_FROM or not _alike(alike):
                continue
            first = alike[0]
            rows[key] = [first[0], max(r[1] for r in alike), sum(r[2] for r in alike),
                         sum(r[3] for r in alike), first[4], first[5], sum(r[6] for r in alike)]
            for m in members:
                del rows[m]
            merged = True
        if not merged:
            break
    named = {}
    for parts, row in rows.items():
        while len(parts) > 1 and parts[-1] == _ANY:   # the list itself: sample['boxes']
            parts = parts[:-1]
        named["".join(parts)] = row
    return named


@dataclass(frozen=True)
class Collected:
    """What a Profiler collected, taken whole under its lock (Profiler.report)."""
    wall_ns: int                                  # the first epoch's start to the latest batch or epoch end
    stage_ns: dict[str, int]                      # STAGES
    worker_stage_ns: dict[str, int]               # WORKER_STAGES
    fields: dict[str, list[Any]]                  # path -> [kernel, calls, ns, bytes, shape, dtype]
    workers: dict[int, list[Any]]                 # id -> [busy ns, batches, first, last, pid, restarts]
    # worker pid -> ((cpu ns, runqueue ns) after its first batch, the latest, that first batch's busy ns)
    cpu: dict[int, tuple[tuple[int, int], tuple[int, int], int]]
    main_cpu_ns: int                              # the training process's CPU time over the epochs
    batches: int
    samples: int
    autotune: dict[str, Any] | None               # num_workers="auto": what it chose and why


def report_of(collected: Collected) -> Report:
    """The report of what a profiler collected."""
    c = collected
    wall_ns = c.wall_ns
    worker_total = sum(w[0] for w in c.workers.values()) or 1
    fields = []
    for path, (kernel, calls, ns, nbytes, shape, dtype, elements) in _list_rows(c.fields).items():
        fields.append({
            "path": path, "kernel": kernel, "batches": calls, "seconds": ns / 1e9,
            "share_of_worker_time": ns / worker_total,
            "bytes_per_batch": nbytes / max(calls, 1), "shape": list(shape), "dtype": dtype,
            "elements": elements,
        })
    fields.sort(key=lambda f: f["seconds"], reverse=True)
    cpu_of_pid = {pid: r[1][0] - r[0][0] for pid, r in c.cpu.items()}
    waited_of_pid = {pid: r[1][1] - r[0][1] for pid, r in c.cpu.items()}
    unmeasured_of_pid = {pid: r[2] for pid, r in c.cpu.items()}
    workers = []
    for wid, (busy, n, _first, _last, pid, restarts) in sorted(c.workers.items()):
        cpu = cpu_of_pid.get(pid) if pid is not None else None
        waited = waited_of_pid.get(pid) if pid is not None else None
        measured_busy = busy - unmeasured_of_pid.get(pid, 0) if pid is not None else busy
        if measured_busy < 0.1 * busy:
            cpu_per_busy = None   # nearly all the busy time was the unmeasured first batch
        else:
            cpu_per_busy = None if cpu is None else cpu / max(measured_busy, 1)
        workers.append({
            "worker": wid, "pid": pid, "batches": n, "busy_s": busy / 1e9,
            "idle_s": max(0.0, (wall_ns - busy) / 1e9), "busy_share": min(1.0, busy / wall_ns),
            "cpu_s": None if cpu is None else cpu / 1e9,
            "cpu_share": None if cpu is None else cpu / wall_ns,
            "waited_for_cpu_s": None if waited is None else waited / 1e9,
            # CPU time per second of fetching and collating: ~1 computing, ~0 sleeping or I/O
            "cpu_of_busy": cpu_per_busy,
            "restarts": restarts,
        })
    known = sys.platform.startswith("linux") or not any(w["worker"] >= 0 for w in workers)
    cpu_info: dict[str, Any] = {
        "usable_cores": usable_cores(),
        "main_process_s": c.main_cpu_ns / 1e9,
        "workers_s": sum(cpu_of_pid.values()) / 1e9 if known else None,
        "workers_waited_for_cpu_s": sum(waited_of_pid.values()) / 1e9 if known else None,
    }
    return Report(wall_s=wall_ns / 1e9, startup_s=c.stage_ns["startup"] / 1e9,
                  stages={k: v / 1e9 for k, v in c.stage_ns.items()}, fields=fields, workers=workers,
                  batches=c.batches, worker_stages={k: v / 1e9 for k, v in c.worker_stage_ns.items()},
                  samples=c.samples, cpu=cpu_info, autotune=c.autotune)


class Report:
    """A profile's numbers, a plain-text table (``str(report)``) and a verdict.

    Attributes:
        wall_s (float): seconds from the first epoch's start to the latest
            batch (or epoch end).
        stages (dict[str, float]): the wall time partitioned into ``startup``,
            ``sampling``, ``queued``, ``fetch``, ``collate``, ``transport``,
            ``reorder_wait`` and ``consumer_compute`` seconds (they add up to
            ``wall_s``; see the module docstring).
        worker_stages (dict[str, float]): ``fetch``, ``collate`` and
            ``transport`` seconds summed over every batch and worker.
        fields (list[dict]): per collated field: path, kernel, seconds,
            share of worker time, bytes per batch, shape, dtype, elements; costliest
            first.  A list-valued field is one row (``sample['boxes']``) whose
            ``elements`` were collated one by one (its shape and dtype are one
            element's); a plain field has ``elements`` 1.
        workers (list[dict]): per worker: id (-1: the main process), pid,
            batches, busy and idle seconds, CPU seconds, restarts.
        cpu (dict): ``usable_cores`` (affinity and cgroup quota),
            ``main_process_s`` and ``workers_s`` CPU seconds.
        batches (int): batches the training loop received.
        verdict (str): one line: consumer- or loader-bound, and what to do ("too few
            batches to judge" under 5 batches; "no batches" for none).

    Args:
        wall_s (float): see the attributes; a Report is made by
            :meth:`Profiler.report`, not by hand, and so are the other arguments
            (``startup_s``, ``stages``, ``fields``, ``workers``, ``batches``,
            ``worker_stages``, ``samples``, ``cpu``).

    Example:
        >>> import numpy as np, mxload
        >>> loader = mxload.DataLoader(mxload.ArrayDataset(np.arange(8)), batch_size=4)
        >>> with mxload.profile(loader) as prof:
        ...     batches = list(loader)
        >>> report = prof.report()
        >>> abs(sum(report.stages.values()) - report.wall_s) < 1e-6
        True
    """

    def __init__(self, wall_s: float, startup_s: float, stages: dict[str, float],
                 fields: list[dict[str, Any]], workers: list[dict[str, Any]], batches: int,
                 worker_stages: dict[str, float] | None = None, samples: int = 0,
                 cpu: dict[str, Any] | None = None, autotune: dict[str, Any] | None = None):
        self.wall_s = wall_s
        self.startup_s = startup_s
        self.stages = stages
        self.worker_stages = worker_stages if worker_stages is not None else {s: 0.0 for s in WORKER_STAGES}
        self.fields = fields
        self.workers = workers
        self.batches = batches
        self.samples = samples
        self.cpu: dict[str, Any] = cpu if cpu is not None else {
            "usable_cores": usable_cores(), "main_process_s": 0.0, "workers_s": None,
            "workers_waited_for_cpu_s": None}
        self.autotune = autotune   # num_workers="auto": what it chose and why (loader.autotune)
        self.verdict = self._verdict()

    @property
    def consumer_wait_s(self) -> float:
        """Seconds the training loop spent blocked in ``next()``."""
        return sum(self.stages.get(s, 0.0) for s in WAIT_STAGES)

    @property
    def loader_bound(self) -> bool:
        """True when the training loop waited for data more than 20% of the wall time."""
        return self.consumer_wait_s > LOADER_BOUND_SHARE * self.wall_s

    @property
    def cores_busy(self) -> float | None:
        """Cores the loader's processes (main process and workers) kept busy
        on average over the wall time; None where worker CPU time is unknown."""
        workers = self.cpu.get("workers_s")
        if workers is None:
            return None
        return float(self.cpu["main_process_s"] + workers) / max(self.wall_s, 1e-9)

    @property
    def cpu_contention(self) -> float | None:
        """Share of the workers' busy time (fetching and collating) they spent
        runnable but waiting for a free core (the cores are taken by other
        processes, or there are more busy workers than cores); None if unknown."""
        waited = self.cpu.get("workers_waited_for_cpu_s")
        busy = sum(w["busy_s"] for w in self.workers if w["worker"] >= 0)
        if waited is None or busy <= 0:
            return None
        return min(1.0, float(waited) / float(busy))

    def _verdict(self) -> str:
        if self.batches == 0:
            return ("no batches: the dataset is empty, or the loader was not iterated while "
                    "profiling")
        if self.batches < MIN_BATCHES_TO_JUDGE:
            return (f"too few batches to judge ({self.batches}; at least {MIN_BATCHES_TO_JUDGE}): the "
                    f"first batches are the workers' start and the pipeline's fill, not loading; "
                    f"profile more batches")
        wall = max(self.wall_s, 1e-9)
        wait = self.consumer_wait_s
        if not self.loader_bound:
            return (f"consumer-bound: the training loop waited for data {wait / wall:.0%} of the time "
                    f"and computed {self.stages['consumer_compute'] / wall:.0%}; the loader is not the "
                    f"bottleneck")
        waited = f"the training loop waited for data {wait / wall:.0%} of the time"
        head = f"loader-bound: {waited}"
        s = self.stages
        # While a batch held back later ones (reorder_wait) it was itself still in a worker.
        in_workers = s["queued"] + s["fetch"] + s["collate"] + s["reorder_wait"]
        processes = [w for w in self.workers if w["worker"] >= 0]
        n_workers = len(processes)
        worker_busy = sum(w["busy_share"] for w in processes) / n_workers if n_workers else 1.0
        cores = int(self.cpu["usable_cores"])
        busy = self.cores_busy
        contention = self.cpu_contention
        hotspot = self._hotspot()
        computing = [w["cpu_of_busy"] for w in processes if w["cpu_of_busy"] is not None]
        # Every core has a worker that computes (not sleeps) whenever it is busy.
        cores_taken = (n_workers >= cores and len(computing) == n_workers
                       and sum(computing) / n_workers >= COMPUTING_SHARE)
        if busy is not None and (busy >= CPU_FULL_SHARE * cores or (in_workers >= 0.5 * wait and (
                cores_taken or (contention or 0.0) >= CONTENDED_SHARE))):
            others = ", the rest by other programs" if busy < CPU_FULL_SHARE * cores else ""
            return (f"CPU-bound: the machine's {cores} usable cores are busy ({busy:.1f} used by this "
                    f"process and its workers{others}; the workers waited for a free core "
                    f"{contention or 0.0:.0%} of their busy time) and {waited}; {hotspot}, or run "
                    f"workers on more machines")
        if s["reorder_wait"] >= 0.4 * wait and worker_busy < 0.7:
            # Head-of-line blocking stalls the pipeline only when workers sit idle behind it.
            return (f"{head}, {s['reorder_wait'] / wait:.0%} of it for a slow batch while later ones "
                    f"were ready and the workers {1 - worker_busy:.0%} idle: in_order=False yields "
                    f"batches as they finish (or make the slow samples cheaper)")
        if s["transport"] >= 0.5 * wait and n_workers:
            made = (self.worker_stages["fetch"] + self.worker_stages["collate"]) / max(self.batches, 1)
            moved = s["transport"] / max(self.batches, 1)
            if moved > made:
                return (f"{head}, {s['transport'] / wait:.0%} of it for batches to reach the training "
                        f"loop ({moved * 1e3:.2f} ms per batch, while a worker makes one in "
                        f"{made * 1e3:.2f} ms): batches are cheap to make, so use larger batches, "
                        f"or num_workers=0 (no hand-off at all)")
            return (f"{head}, {s['transport'] / wait:.0%} of it for batches to reach the training loop: "
                    f"the main process is busy (its CPU: {self.cpu['main_process_s'] / wall:.0%} of "
                    f"a core); keep the training loop's Python work off the main thread, or use fewer, "
                    f"larger batches")
        if n_workers == 0:
            spare = f"set num_workers (up to {cores - 1}; " if cores > 1 else "("
            return f"{head}; {hotspot}; {spare}loading runs in the training loop's process now)"
        if in_workers >= 0.5 * wait:
            measured = all(w["cpu_share"] is not None for w in processes)
            cpu = sum(w["cpu_share"] or 0.0 for w in processes) / n_workers
            if measured and cpu < 0.5 * min(1.0, worker_busy):
                return (f"{head}; the workers are busy but use {cpu:.0%} of a core each (waiting on "
                        f"I/O or sleeping): add workers (more than {cores} is fine for I/O), or {hotspot}")
            if n_workers < cores:
                return (f"{head}; {count(n_workers, 'worker')} on {cores} usable cores: add workers, "
                        f"or {hotspot}")
            return f"{head}; {hotspot}"
        return f"{head}; workers idle {1 - worker_busy:.0%}: raise prefetch"

    def _hotspot(self) -> str:
        """What to make cheaper in the workers, from where their time goes."""
        fetch, collate = self.worker_stages["fetch"], self.worker_stages["collate"]
        worker_time = max(fetch + collate, 1e-9)
        copying = sum(f["seconds"] for f in self.fields)   # the C kernels' own time
        if collate > fetch and self.fields:
            top = self.fields[0]
            arrays = sum(f["elements"] for f in self.fields)
            if top["seconds"] / worker_time < 0.25 and arrays > 3:
                spread = (f"collation is {collate / worker_time:.0%} of worker time, spread over "
                          f"{arrays} arrays ({min(copying / max(collate, 1e-9), 1):.0%} of it copying, "
                          f"the rest per-array work)")
                listed = max(self.fields, key=lambda f: f["elements"])
                if 2 * listed["elements"] > arrays:   # most of the per-array work is one list's
                    return (f"{spread}, {listed['elements']} of them the elements of {listed['path']}: "
                            f"{_AS_ONE_ARRAY}")
                return f"{spread}: return fewer, larger arrays (stack related fields into one)"
            if copying >= 0.5 * collate:
                return self._field_hint(top, worker_time)
        if self.samples:
            # Time per sample outside the copy kernels: the Python call of
            # __getitem__ and the per-sample collation bookkeeping.
            per_sample_us = (worker_time - copying) / self.samples * 1e6
            if per_sample_us < PER_SAMPLE_OVERHEAD_US:
                return (f"{per_sample_us:.1f} µs per sample in __getitem__ and collation, mostly "
                        f"Python overhead per sample: implement __getitems__ to fetch a whole batch "
                        f"at once (as ArrayDataset does)")
        share = f"sample fetch (__getitem__ / transforms) is {fetch / worker_time:.0%} of worker time"
        if fetch >= collate:
            if self.samples:
                return (f"{share}, {fetch / self.samples * 1e3:.2f} ms per sample: make __getitem__ "
                        f"cheaper (e.g. a faster decoder, smaller stored images)")
            return f"{share}: make __getitem__ cheaper"
        if self.fields:
            return self._field_hint(self.fields[0], worker_time)
        return f"collation is {collate / worker_time:.0%} of worker time: simplify the batchify function"

    @staticmethod
    def _field_hint(top: dict[str, Any], worker_time: float) -> str:
        mb = top["bytes_per_batch"] / 1e6
        n = top["elements"]
        if n > 1:
            # Each element is collated (and, pickled, serialised) on its own: the per-element
            # work, not the bytes, is what a list costs.
            return (f"collation of {top['path']}, a list of {n} elements, is "
                    f"{top['seconds'] / worker_time:.0%} of worker time ({mb:.2f} MB/batch via "
                    f"{top['kernel']}, element by element): {_AS_ONE_ARRAY}")
        if top["kernel"] == "pickled":
            how, hint = "via pickled fallback", "return a numpy array instead of a list / Python objects"
        elif top["kernel"] == "pad":
            how, hint = "via pad", "bucket samples by length or cap the padded length"
        else:
            how = f"via {top['kernel']}"
            smaller = _smaller_dtype(top["dtype"]) if mb > 1 else None
            hint = smaller or "copy fewer bytes per batch"
        return (f"collation of {top['path']} is {top['seconds'] / worker_time:.0%} of worker time "
                f"({mb:.1f} MB/batch {how}): {hint}")

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-serialisable data (every number of the table)."""
        return {"wall_s": self.wall_s, "startup_s": self.startup_s, "batches": self.batches,
                "samples": self.samples, "stages": dict(self.stages),
                "consumer_wait_s": self.consumer_wait_s, "worker_stages": dict(self.worker_stages),
                "fields": [dict(f) for f in self.fields], "workers": [dict(w) for w in self.workers],
                "cpu": dict(self.cpu), "verdict": self.verdict, "loader_bound": self.loader_bound,
                "autotune": self.autotune}

    def __str__(self) -> str:
        wall = max(self.wall_s, 1e-9)
        lines = [f"mxload profile: {self.batches} batches in {self.wall_s:.3f} s "
                 f"({self.batches / wall:.1f} batches/s, start-up {self.startup_s * 1e3:.1f} ms)", "",
                 "where the training loop's time went (the rows add up to the wall time):",
                 f"{'stage':<36} {'seconds':>9} {'% of wall':>10}"]
        for name in STAGES:
            v = self.stages[name]
            lines.append(f"{_STAGE_LABELS[name]:<36} {v:>9.3f} {v / wall:>10.0%}")
        lines.append(f"{'total':<36} {sum(self.stages.values()):>9.3f} "
                     f"{sum(self.stages.values()) / wall:>10.0%}")
        ws = self.worker_stages
        processes = sum(1 for w in self.workers if w["worker"] >= 0)
        where = f"{count(processes, 'worker')}, in parallel" if processes else "in the main process"
        lines.append(f"worker time ({where}): fetch {ws['fetch']:.3f} s, collate {ws['collate']:.3f} s, "
                     f"transport {ws['transport']:.3f} s")
        busy = self.cores_busy
        contention = self.cpu_contention
        lines.append(f"CPU: {self.cpu['usable_cores']} usable cores"
                     + ("" if busy is None else f", {busy:.1f} used by this process and its workers")
                     + ("" if contention is None else
                        f"; workers waited for a free core {contention:.0%} of their busy time"))
        if self.fields:
            lines += ["", f"{'field':<28} {'kernel':<8} {'seconds':>8} {'% worker':>9} {'MB/batch':>9} "
                          f"{'elements':>8} {'shape':<18} dtype"]
            for f in self.fields[:12]:
                lines.append(f"{f['path'][:28]:<28} {f['kernel']:<8} {f['seconds']:>8.3f} "
                             f"{f['share_of_worker_time']:>8.0%} {f['bytes_per_batch'] / 1e6:>9.2f} "
                             f"{f['elements']:>8} {str(tuple(f['shape'])):<18} {f['dtype']}")
            if len(self.fields) > 12:
                lines.append(f"... and {len(self.fields) - 12} more fields (all of them in to_dict())")
        if self.workers:
            lines += ["", f"{'worker':<8} {'pid':>8} {'batches':>8} {'busy s':>8} {'idle s':>8} "
                          f"{'busy':>6} {'cpu':>6} {'restarts':>8}"]
            for w in self.workers:
                name = "main" if w["worker"] < 0 else str(w["worker"])
                cpu = "-" if w["cpu_share"] is None else f"{w['cpu_share']:.0%}"
                lines.append(f"{name:<8} {str(w['pid']):>8} {w['batches']:>8} {w['busy_s']:>8.3f} "
                             f"{w['idle_s']:>8.3f} {w['busy_share']:>6.0%} {cpu:>6} {w['restarts']:>8}")
        if self.autotune is not None:
            auto, last = self.autotune, self.autotune["last_choice"]
            lines += ["", f"num_workers='auto': {count(auto['workers'], 'worker')}, window {auto['window']} "
                          f"(of at most {auto['max_workers']}); {len(auto['changes'])} adjustments"
                          + (f"; last choice: {last['reason']}" if last is not None else "")]
        lines += ["", f"verdict: {self.verdict}"]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<mxload profile Report: {self.batches} batches, {self.verdict!r}>"
