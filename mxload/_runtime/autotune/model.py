"""The autotuner's model: the time per batch with k workers, from what a probe measured (the
load of one batch L, the loop's step S, its CPU time S_cpu, the usable cores C and the bytes
of a batch).  Pure functions of their arguments: no clock, no state."""
from __future__ import annotations

from typing import Any

MAIN_OVERHEAD_NS = 60_000    # the loop's own CPU per batch with workers (bench/main_cpu.py: 29-51 us)
# What a worker pays per batch beyond loading it in-process: its copy into shared memory (page
# faults on the slab included), the messages and wake-ups.  bench/autotune.py's sweep, 2 cores,
# runs of 2 s (2026-12-06; the 300-batch runs of 0.2-0.4 s before charged the workers' start to
# every batch): 2 workers' time per batch, less half the in-process load, came to 0.14-0.28 ms
# for the 1 MB batches of tabular, tabular-getitems and dict16 and 0.40 ms for 9.6 MB of images.
WORKER_BATCH_NS = 200_000
WORKER_NS_PER_BYTE = 0.025


def worker_cost_ns(batch_bytes: int) -> float:
    """A worker's cost per batch beyond the load itself (WORKER_BATCH_NS)."""
    return WORKER_BATCH_NS + WORKER_NS_PER_BYTE * batch_bytes


def predict_ns(k: int, load_ns: float, step_ns: float, step_cpu_ns: float, cores: float,
               batch_bytes: int = 0) -> float:
    """Predicted time per batch with k workers: in-process, the step and the
    load add up; with workers, a batch takes the longest of the loop's own
    path (step plus its per-batch overhead), the workers' share of the load
    and of their own per-batch cost, and the CPU time of all of it spread over
    the usable cores."""
    if k == 0:
        return step_ns + load_ns
    loop = step_ns + MAIN_OVERHEAD_NS
    work = load_ns + worker_cost_ns(batch_bytes)
    return max(loop, work / k, (step_cpu_ns + MAIN_OVERHEAD_NS + work) / cores)


def optimistic_ns(k: int, load_ns: float, step_ns: float, step_cpu_ns: float, cores: float) -> float:
    """predict_ns without the costs the model only estimates (the loop's and the workers' own per
    batch): where even this does not beat in-process, k workers cannot."""
    if k == 0:
        return step_ns + load_ns
    return max(step_ns, load_ns / k, (step_cpu_ns + load_ns) / cores)


def probe_rate(loads: list[int], steps: list[int]) -> float | None:
    """A probe's own throughput (batches/s): every batch after the warm-up, slow ones included (a
    page fault or a collection in-process is the in-process rate's too)."""
    measured = loads[1:] or loads
    total_ns = sum(measured) + sum(steps[-len(measured):])
    return len(measured) * 1e9 / total_ns if total_ns > 0 else None


def batch_nbytes(batch: Any) -> int:
    """Bytes of the arrays in a batch (tuples, lists and dicts of them)."""
    if isinstance(batch, (tuple, list)):
        return sum(batch_nbytes(b) for b in batch)
    if isinstance(batch, dict):
        return sum(batch_nbytes(b) for b in batch.values())
    return int(getattr(batch, "nbytes", 0))
