"""``python -m mxload bench``: throughput of mxload on the built-in synthetic
workloads, against in-process loading and, when torch is installed,
``torch.utils.data.DataLoader`` with the same workers.

Every row is one (workload, worker count); the datasets are generated in
memory before anything is timed.  The consumer only reads one element of each
array, so every run is loader-bound by design: the numbers are the loaders'
ceilings, not a training run's speed.

One run of each setting gave verdicts that flipped from run to run (augment at
0.75, 1.66 and 0.95x in-process, "use num_workers=0" at 0.95x): a row's loaders
run in alternated rounds instead (ABC, CBA, ...: drift on a shared machine falls
on each alike), each round a fresh epoch on the same persistent workers, and a
row gives each loader's median and spread.  Workers are advised for or against
only when their rounds and in-process loading's do not overlap; with 5 rounds
each, two equally fast loaders fail to overlap by chance 2 times in C(10, 5) =
252 (under 1%).
"""
from __future__ import annotations

import functools
import io
import os
import platform
import shutil
import textwrap
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from ._cpus import usable_cores
from ._version import __version__
from ._words import count
from .dataloader import DataLoader
from .profiler import profile
from .synthetic import WORKLOADS

WIDTH = 100   # every line of the output fits this many columns


@dataclass
class Run:
    """One loader's rounds on one workload."""

    first_s: float                 # the first round's iter() to its first batch (worker start-up)
    rates: list[float]             # batches per second of each round, after its first batch
    bytes_per_batch: float
    verdicts: list[str] = field(default_factory=list)   # the profiler's, per round (mxload only)

    @property
    def batches_per_s(self) -> float:
        return float(np.median(self.rates))

    @property
    def spread(self) -> float:
        """Half the rounds' range, as a share of their median."""
        return (max(self.rates) - min(self.rates)) / 2 / max(self.batches_per_s, 1e-9)

    @property
    def verdict(self) -> str:
        """The profiler's verdict on the median round."""
        if not self.verdicts:
            return ""
        median = sorted(range(len(self.rates)), key=self.rates.__getitem__)[(len(self.rates) - 1) // 2]
        return self.verdicts[median]


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


def terminal_columns(stream: TextIO) -> int:
    """The width of the terminal `stream` writes to: $COLUMNS when set (as
    shutil.get_terminal_size honours it), else the terminal's own, else shutil's answer
    (which asks stdout's terminal, then falls back to 80)."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(stream.fileno()).columns
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            columns = 0
    return columns if columns > 0 else shutil.get_terminal_size().columns


class Progress:
    """One self-overwriting status line on a terminal; nothing otherwise.

    The line is cut to the terminal's width less one column (read at each update, so a
    resized window is followed): a line that reaches the last column wraps on many
    terminals, and then every update starts a new line (99 columns on an 80-column
    terminal printed ~600 lines a bench).  It is padded only over what the previous
    update left."""

    def __init__(self, stream: TextIO, enabled: bool):
        self.stream = stream
        self.enabled = enabled and stream.isatty()
        self._shown = 0   # columns the line now on the terminal takes

    def show(self, text: str) -> None:
        if self.enabled:
            width = max(terminal_columns(self.stream) - 1, 1)
            text = text[:width]
            self.stream.write("\r" + text.ljust(min(self._shown, width)))
            self.stream.flush()
            self._shown = len(text)

    def clear(self) -> None:
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0


def _time(loader: Iterable[Any], batches: int, tick: Callable[[int], None]) -> tuple[float, float, int]:
    """One round: a fresh epoch's first batch, then `batches` batches timed (over as many
    epochs as it takes); (seconds to the first batch, batches per second, bytes seen)."""
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
    return first, done / elapsed, nbytes


class Timed:
    """One loader's rounds: each call of round() times a fresh epoch (its workers persist)."""

    def __init__(self, loader: Any, profiled: bool):
        self.loader = loader
        self.profiled = profiled
        self.first_s: float | None = None
        self.rates: list[float] = []
        self.verdicts: list[str] = []
        self.nbytes = self.batches = 0

    def round(self, batches: int, tick: Callable[[int], None]) -> None:
        if self.profiled:
            with profile(self.loader) as prof:
                first, rate, nbytes = _time(self.loader, batches, tick)
                self.verdicts.append(prof.report().verdict)
        else:
            first, rate, nbytes = _time(self.loader, batches, tick)
        if self.first_s is None:
            self.first_s = first
        self.rates.append(rate)
        self.nbytes += nbytes
        self.batches += batches + 1

    def result(self) -> Run:
        return Run(self.first_s or 0.0, self.rates, self.nbytes / max(self.batches, 1), self.verdicts)


def alternate(rounds: int, timed: dict[str, Callable[[int], None]]) -> None:
    """Call each of `timed` (name -> one round, given the round's number) `rounds` times,
    in alternated order: ABC, CBA, ABC..."""
    names = list(timed)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            timed[name](r)


def judge(workers: int, mx: Run, in_process: Run) -> str:
    """The verdict on `workers` workers against in-process loading, from their rounds:
    advice only where the rounds do not overlap."""
    ratio = mx.batches_per_s / in_process.batches_per_s
    rounds = f"{len(mx.rates)} alternated rounds"
    span = (f"{min(mx.rates):.1f}-{max(mx.rates):.1f} b/s against "
            f"{min(in_process.rates):.1f}-{max(in_process.rates):.1f}")
    if max(mx.rates) < min(in_process.rates):
        return (f"{count(workers, 'worker')} {'was' if workers == 1 else 'were'} slower than "
                f"in-process loading in all {rounds} "
                f"({ratio:.2f}x; {span}): use num_workers=0 for this workload on this machine; "
                f"profile: {mx.verdict}")
    if min(mx.rates) <= max(in_process.rates):
        return (f"{count(workers, 'worker')} and in-process loading are within noise of each other "
                f"({ratio:.2f}x; {rounds} overlap: {span}): no setting to recommend from this run "
                f"(more --batches or --rounds narrow the spread)")
    return mx.verdict


def run_mxload(dataset: Any, batch_size: int, workers: int) -> Timed:
    loader: DataLoader[Any] = DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=0,
                                         num_workers=workers, persistent_workers=workers > 0)
    return Timed(loader, profiled=True)


def run_torch(torch_loader: Any, dataset: Any, batch_size: int, workers: int) -> Timed:
    loader = torch_loader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                          persistent_workers=workers > 0)
    return Timed(loader, profiled=False)


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
        f"measured: each row's loaders take turns, {args.rounds} alternated rounds of "
        f"{_per_round(args)} batches each (a fresh epoch's batches after its first, workers kept); "
        f"b/s is the rounds' median, ± half their range ('first ms': the first round's iter() to "
        f"its first batch, worker start-up included); shuffled; the loop only reads one element of "
        f"every array, so every run is loader-bound by design (a ceiling, not a training run's speed)",
        "baselines: 'in-process' is mxload with num_workers=0 (x in-proc = mxload / in-process, "
        "medians);",
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


def _per_round(args: Any) -> int:
    """Batches timed per round: --batches in all, over --rounds rounds."""
    return max(1, -(-int(args.batches) // int(args.rounds)))


def _cell(x: float | None, width: int, spec: str = ".1f", suffix: str = "") -> str:
    """`x` right-aligned in `width` columns, or "-" when there is no number."""
    return ("-" if x is None else format(x, spec) + suffix).rjust(width)


def _rate(run: Run | None, width: int) -> str:
    """A loader's median b/s and its spread (± half the rounds' range) in `width` columns."""
    if run is None:
        return "-".rjust(width)
    return f"{run.batches_per_s:.1f} ±{run.spread:.0%}".rjust(width)


def _measure_row(args: Any, name: str, dataset: Any, workers: int, torch_loader: Any,
                 progress: Progress, torch_failures: list[str]) -> tuple[Run, Run, Run | None]:
    """One row's loaders in alternated rounds: (in-process, mxload with `workers` workers (the
    in-process run for 0), torch or None); a torch failure is noted in `torch_failures`."""
    batch_size, per_round = WORKLOADS[name].batch_size, _per_round(args)
    loaders = {"in-process": run_mxload(dataset, batch_size, 0)}
    if workers:
        loaders["mxload"] = run_mxload(dataset, batch_size, workers)
    if torch_loader is not None:
        loaders["torch"] = run_torch(torch_loader, dataset, batch_size, workers)

    def one_round(r: int, who: str) -> None:
        if who not in loaders:   # torch failed in an earlier round
            return

        def tick(done: int) -> None:
            progress.show(f"{name}, {count(workers, 'worker')}, round {r + 1}/{args.rounds}, {who}: "
                          f"{done}/{per_round} batches")
        try:
            loaders[who].round(per_round, tick)
        except Exception as e:   # the torch baseline failing is a finding, not the bench's end
            if who != "torch":
                raise
            torch_failures.append(f"{name}, {count(workers, 'worker')}: torch failed: "
                                  f"{type(e).__name__}: {e}")
            del loaders["torch"]   # its persistent workers end with it

    try:
        alternate(args.rounds, {who: functools.partial(one_round, who=who) for who in loaders})
        in_process = loaders["in-process"].result()
        return (in_process, loaders["mxload"].result() if workers else in_process,
                loaders["torch"].result() if "torch" in loaders else None)
    finally:
        for timed in loaders.values():
            close = getattr(timed.loader, "close", None)   # torch's workers end with the loader
            if close is not None:
                close()
        loaders.clear()
        progress.clear()


def bench(args: Any, out: TextIO, err: TextIO) -> int:
    """Run the bench with parsed, validated `args` (see __main__); print the table to `out`."""
    TorchDataLoader, torch_status = (None, "not used (--no-torch)") if args.no_torch else _import_torch()
    progress = Progress(err, not args.no_progress)
    datasets, sizes = {}, {}
    for name in args.workloads:
        workload = WORKLOADS[name]
        # One epoch holds a round's batches, up to the workload's full size (longer rounds
        # take more epochs rather than more memory).
        n = min(workload.batch_size * (_per_round(args) + 1), max(workload.full_samples, workload.batch_size))
        progress.show(f"generating {name} ({n:,} samples)")
        datasets[name] = workload.build(n)
        sizes[name] = f"{workload.batch_size} per batch, {n:,} samples"
    progress.clear()
    for line in _header(args, torch_status, TorchDataLoader is not None, sizes):
        print(textwrap.fill(line, WIDTH, subsequent_indent="  ", break_on_hyphens=False), file=out)
    columns = (f"{'workload':<17}{'workers':>7}{'mxload b/s':>14}{'MB/s':>7}{'first ms':>9}"
               f"{'in-process':>14}{'x in-proc':>10}{'torch b/s':>13}{'x torch':>9}")
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
            for workers in args.workers:
                in_process, mx, th = _measure_row(args, name, datasets[name], workers, TorchDataLoader,
                                                  progress, torch_failures)
                speedup = mx.batches_per_s / in_process.batches_per_s if workers else None
                print(f"{name:<17}{workers:>7}{_rate(mx, 14)}"
                      f"{_cell(mx.batches_per_s * mx.bytes_per_batch / 1e6, 7, '.0f')}"
                      f"{_cell(mx.first_s * 1e3, 9)}{_rate(in_process, 14)}"
                      f"{_cell(speedup, 10, '.2f', 'x')}{_rate(th, 13)}"
                      f"{_cell(mx.batches_per_s / th.batches_per_s if th else None, 9, '.2f', 'x')}",
                      file=out)
                out.flush()
                verdicts.append((f"{name}, {count(workers, 'worker')}",
                                 judge(workers, mx, in_process) if workers else mx.verdict))
    for failure in torch_failures:
        print(textwrap.fill(failure, WIDTH, subsequent_indent="    "), file=out)
    print("", file=out)
    print("profiler verdicts (mxload runs; python -m mxload profile gives the full report):", file=out)
    for who, verdict in verdicts:
        print(textwrap.fill(verdict, WIDTH, initial_indent=f"  {who}: ", subsequent_indent="    "),
              file=out)
    return 0

