"""``python -m mxload bench``: throughput of mxload on the built-in synthetic
workloads, against in-process loading and, when torch is installed,
``torch.utils.data.DataLoader`` with the same workers.

Every row is one (workload, worker count); the datasets are generated in
memory before anything is timed.  The consumer only reads one element of each
array, so every run is loader-bound by design: the numbers are the loaders'
ceilings, not a training run's speed.
"""
from __future__ import annotations

import os
import platform
import textwrap
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from ._cpus import usable_cores
from ._version import __version__
from .dataloader import DataLoader
from .profiler import profile
from .synthetic import WORKLOADS

WIDTH = 100   # every line of the output fits this many columns


@dataclass
class Run:
    """One loader's timing on one workload."""

    first_s: float          # iter() to the first batch
    batches_per_s: float    # after the first batch
    bytes_per_batch: float
    verdict: str = ""


def _leaves(batch: Any) -> Iterator[Any]:
    if isinstance(batch, dict):
        for value in batch.values():
            yield from _leaves(value)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from _leaves(value)
    else:
        yield batch


def _touch(batch: Any) -> int:
    """Bytes of a batch's arrays (numpy or torch), reading one element of each
    so that lazily mapped pages are paid for where a training loop would pay."""
    total = 0
    for leaf in _leaves(batch):
        if isinstance(leaf, np.ndarray):
            if leaf.size:
                leaf.flat[leaf.size - 1]
            total += leaf.nbytes
        elif hasattr(leaf, "numel") and hasattr(leaf, "element_size"):   # a torch tensor
            if leaf.numel():
                leaf.reshape(-1)[-1].item()
            total += leaf.numel() * leaf.element_size()
    return total


class Progress:
    """One self-overwriting status line on a terminal; nothing otherwise."""

    def __init__(self, stream: TextIO, enabled: bool):
        self.stream = stream
        self.enabled = enabled and stream.isatty()

    def show(self, text: str) -> None:
        if self.enabled:
            self.stream.write("\r" + text[:WIDTH - 1].ljust(WIDTH - 1))
            self.stream.flush()

    def clear(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (WIDTH - 1) + "\r")
            self.stream.flush()


def _time(loader: Iterable[Any], batches: int, tick: Callable[[int], None]) -> Run:
    """Time `batches` batches after the first, over as many epochs as it takes."""
    t0 = time.perf_counter()
    it = iter(loader)
    nbytes = _touch(next(it))
    first = time.perf_counter() - t0
    done = 0
    t1 = time.perf_counter()
    while done < batches:
        for batch in it:
            nbytes += _touch(batch)
            done += 1
            tick(done)
            if done == batches:
                break
        else:
            it = iter(loader)   # the epoch ended: the next one (workers persist)
    elapsed = max(time.perf_counter() - t1, 1e-9)
    close = getattr(it, "close", None)
    if close is not None:
        close()
    del it
    return Run(first, done / elapsed, nbytes / (done + 1))


def run_mxload(dataset: Any, batch_size: int, workers: int, batches: int,
               tick: Callable[[int], None]) -> Run:
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=0,
                                         num_workers=workers, persistent_workers=workers > 0)
    with profile(loader) as prof:
        run = _time(loader, batches, tick)
        run.verdict = prof.report().verdict
    loader.close()
    return run


def run_torch(torch_loader: Any, dataset: Any, batch_size: int, workers: int, batches: int,
              tick: Callable[[int], None]) -> Run:
    loader = torch_loader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                          persistent_workers=workers > 0)
    run = _time(loader, batches, tick)
    del loader   # ends torch's persistent workers
    return run


def _import_torch() -> tuple[Any, str]:
    """(torch.utils.data.DataLoader, version) or (None, why not)."""
    try:
        import torch
        from torch.utils.data import DataLoader as TorchDataLoader
    except Exception as e:   # not installed, or a broken install: the baseline is optional
        return None, f"not importable ({type(e).__name__}: {e})"
    return TorchDataLoader, str(torch.__version__)


def _header(args: Any, torch_status: str, torch_ok: bool, sizes: dict[str, str]) -> list[str]:
    cores = usable_cores()
    lines = [
        f"mxload {__version__} bench: batches per second on built-in synthetic workloads",
        f"machine: {cores} usable CPU cores (affinity and cgroup quota; os.cpu_count() "
        f"{os.cpu_count()}), {platform.system()} {platform.machine()}, Python "
        f"{platform.python_version()}, numpy {np.__version__}, torch {torch_status}",
        f"measured: batches/s over {args.batches} batches after the first ('first ms': iter() to "
        f"the first batch,",
        "  worker start-up included); shuffled; the loop only reads one element of every array, "
        "so every",
        "  run is loader-bound by design (a ceiling, not a training run's speed)",
        "baselines: 'in-process' is mxload with num_workers=0 (x in-proc = mxload / in-process);",
    ]
    if torch_ok:
        lines.append("  'torch' is torch.utils.data.DataLoader, same dataset, batch size and num_workers, "
                     "its")
        lines.append("  default collate (x torch = mxload / torch)")
    else:
        lines.append("  the torch baseline is skipped (torch is not installed: pip install 'mxload[bench]')"
                     if "not importable" in torch_status else "  the torch baseline is skipped (--no-torch)")
    lines.append("workloads (samples generated in memory before timing; no files, no network):")
    for name in args.workloads:
        lines.append(f"  {name:<17} {sizes[name]}")
        lines.append(f"  {'':<17} {WORKLOADS[name].description}")
    return lines


def _cell(x: float | None, width: int, spec: str = ".1f", suffix: str = "") -> str:
    """`x` right-aligned in `width` columns, or "-" when there is no number."""
    return ("-" if x is None else format(x, spec) + suffix).rjust(width)


def bench(args: Any, out: TextIO, err: TextIO) -> int:
    """Run the bench with parsed, validated `args` (see __main__); print the table to `out`."""
    TorchDataLoader, torch_status = (None, "not used (--no-torch)") if args.no_torch else _import_torch()
    progress = Progress(err, not args.no_progress)
    datasets, sizes = {}, {}
    for name in args.workloads:
        workload = WORKLOADS[name]
        # One epoch holds every timed batch, up to the workload's full size (longer runs
        # take more epochs rather than more memory).
        n = min(workload.batch_size * (args.batches + 1), max(workload.full_samples, workload.batch_size))
        progress.show(f"generating {name} ({n:,} samples)")
        datasets[name] = workload.build(n)
        sizes[name] = f"{workload.batch_size} per batch, {n:,} samples"
    progress.clear()
    for line in _header(args, torch_status, TorchDataLoader is not None, sizes):
        print(textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False), file=out)
    columns = (f"{'workload':<17}{'workers':>7}{'mxload b/s':>12}{'MB/s':>7}{'first ms':>10}"
               f"{'in-process':>12}{'x in-proc':>10}{'torch b/s':>11}{'x torch':>9}")
    print("", file=out)
    print(columns, file=out)
    print("-" * len(columns), file=out)
    out.flush()
    verdicts: list[tuple[str, str]] = []
    torch_failures: list[str] = []
    with warnings.catch_warnings():
        # More workers than cores is what --workers asked for; the header says the core count.
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        for name in args.workloads:
            workload, dataset = WORKLOADS[name], datasets[name]
            in_process: Run | None = None
            for workers in args.workers:
                def tick(done: int, who: str = "", w: int = workers, name: str = name) -> None:
                    progress.show(f"{name}, {w} workers, {who}: {done}/{args.batches} batches")

                runs: dict[str, Run | None] = {}
                if in_process is None:
                    in_process = run_mxload(dataset, workload.batch_size, 0, args.batches,
                                            lambda d: tick(d, "mxload in-process"))
                runs["mxload"] = (in_process if workers == 0 else
                                  run_mxload(dataset, workload.batch_size, workers, args.batches,
                                             lambda d: tick(d, "mxload")))
                runs["torch"] = None
                if TorchDataLoader is not None:
                    try:
                        runs["torch"] = run_torch(TorchDataLoader, dataset, workload.batch_size, workers,
                                                  args.batches, lambda d: tick(d, "torch"))
                    except Exception as e:   # the baseline failing is a finding, not the bench's end
                        torch_failures.append(f"{name}, {workers} workers: torch failed: "
                                              f"{type(e).__name__}: {e}")
                progress.clear()
                mx, th = runs["mxload"], runs["torch"]
                assert mx is not None and in_process is not None
                speedup = mx.batches_per_s / in_process.batches_per_s if workers else None
                print(f"{name:<17}{workers:>7}{_cell(mx.batches_per_s, 12)}"
                      f"{_cell(mx.batches_per_s * mx.bytes_per_batch / 1e6, 7, '.0f')}"
                      f"{_cell(mx.first_s * 1e3, 10)}{_cell(in_process.batches_per_s, 12)}"
                      f"{_cell(speedup, 10, '.2f', 'x')}{_cell(th.batches_per_s if th else None, 11)}"
                      f"{_cell(mx.batches_per_s / th.batches_per_s if th else None, 9, '.2f', 'x')}",
                      file=out)
                out.flush()
                verdict = mx.verdict
                if workers and mx.batches_per_s < in_process.batches_per_s:
                    ratio = mx.batches_per_s / in_process.batches_per_s
                    verdict = (f"{workers} workers were slower than in-process loading ({ratio:.2f}x): "
                               f"use num_workers=0 for this workload on this machine; profile: {verdict}")
                verdicts.append((f"{name}, {workers} workers", verdict))
    for failure in torch_failures:
        print(textwrap.fill(failure, WIDTH, subsequent_indent="    "), file=out)
    print("", file=out)
    print("profiler verdicts (mxload runs; python -m mxload profile gives the full report):", file=out)
    for who, verdict in verdicts:
        print(textwrap.fill(verdict, WIDTH, initial_indent=f"  {who}: ", subsequent_indent="    "),
              file=out)
    return 0

