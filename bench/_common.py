"""Tiny helpers shared by the bench scripts: timing, medians, headers, tables."""
from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["time_ns", "time_interleaved", "median", "header", "table", "fmt_time", "optional_torch"]


def time_ns(fn: Callable[[], object], repeats: int, warmup: int = 3,
            setup: Callable[[], object] | None = None) -> list:
    """Run fn() `warmup` times, then time it `repeats` times; return the ns of
    each timed call.  `setup` (untimed) runs before every call."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    out = []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def time_interleaved(fns: dict, repeats: int, warmup: int = 3) -> dict:
    """Time several callables round-robin (one call of each per round, the
    order rotating every round) so drift on a noisy machine hits them all
    alike.  Returns {name: [ns per timed call]}."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    out = {name: [] for name in names}
    clock = time.perf_counter_ns
    for r in range(repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn = fns[name]
            t0 = clock()
            fn()
            out[name].append(clock() - t0)
    return out


def busy_s() -> float:
    """CPU seconds every process on this machine has used (/proc/stat); NaN without it."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    # user nice system idle iowait irq softirq steal ...
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf("SC_CLK_TCK")


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def fmt_time(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def header(title: str) -> str:
    """Command line, Python/numpy versions and core counts, one per line."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    lines = [
        f"# {title}",
        f"# command: {' '.join(shlex.quote(a) for a in [sys.executable] + sys.argv)}",
        f"# python {platform.python_version()}, numpy {np.__version__}, "
        f"{platform.machine()} {platform.system()}",
        f"# cores: {os.cpu_count()} (usable by this process: {usable})",
    ]
    return "\n".join(lines)


def table(rows: Sequence[Sequence[object]], head: Sequence[str]) -> str:
    """Plain-text table; the first column is left aligned, the others right."""
    cells = [[str(h) for h in head]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))
    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def optional_torch() -> tuple:
    """(torch, torch.utils.data.DataLoader, "") or (None, None, why it is missing):
    torch is an optional comparison baseline."""
    try:
        import torch
        from torch.utils.data import DataLoader
    except Exception as e:  # pragma: no cover - torch is optional
        return None, None, f"{type(e).__name__}: {e}"
    return torch, DataLoader, ""


def compile_mxload(package_dir: str) -> None:
    """Write mxload's bytecode beside its sources, as pip does when it installs the wheel (torch,
    numpy and PIL come compiled so).  A source checkout under PYTHONDONTWRITEBYTECODE=1 (as on
    these machines) otherwise compiles every mxload module again in each fresh process a bench
    starts: 20-25 ms of the first epoch of a torch_pipelines run, charged to mxload alone."""
    import compileall
    compileall.compile_dir(package_dir, quiet=2)
