"""Shutdown cost and leftovers: create loader -> take one batch -> break.

    python bench/shutdown.py [--cycles 300] [--workers 4] [--loaders mxload torch]

For each loader (mxload, and torch.utils.data.DataLoader when importable),
`cycles` times over the images dataset (mxload/synthetic.py, batch 64):

    loader = DataLoader(ds, batch_size=64, num_workers=4)
    for batch in loader:
        touch(batch); t_break = now
        break
    t_exit = now          # the loop has exited: its iterator was dropped

and then polls /proc until every worker process of that cycle is gone
(exited and reaped; a zombie still counts as there).  Reported per loader:

* first batch: time from creating the loader to the first batch;
* exit: ``t_exit - t_break``, the time the training loop is blocked by the
  shutdown (median, p90, max);
* gone: time from ``break`` until all of the cycle's workers are gone;
* cycles whose workers were not gone within --gone-timeout s;
* after all cycles (measured at once and again after --settle s), against a
  baseline taken after one untimed warm-up cycle: leftover child processes
  (zombies counted apart), new /dev/shm entries, open fd delta and OS-thread
  delta of this process.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import header, optional_torch, table  # noqa: E402

import mxload  # noqa: E402
from mxload import synthetic as D  # noqa: E402

torch, TorchDataLoader, _TORCH_ERROR = optional_torch()

BATCH = 64

# torch warns that 4 workers exceed the suggested number on a 2-core machine.
warnings.filterwarnings("ignore", message=".*worker processes in total.*")


class SlowImageDataset(D.ImageDataset):
    """ImageDataset whose __getitem__ also sleeps (--sample-sleep-ms): batches
    that take a while, so work done by workers after `break` shows."""

    def __init__(self, n: int, sleep_s: float):
        super().__init__(n)
        self.sleep_s = sleep_s

    def __getitem__(self, i: int):
        time.sleep(self.sleep_s)
        return super().__getitem__(i)


# ---------------------------------------------------------------- /proc probes

def children() -> dict[int, str]:
    """Direct children of this process: pid -> state letter (Z = zombie)."""
    me = str(os.getpid())
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            out[int(entry)] = fields[0]
    return out


def present(pids: set[int]) -> set[int]:
    """The pids that still exist (running or zombie)."""
    out = set()
    for pid in pids:
        try:
            os.stat(f"/proc/{pid}")
        except OSError:
            continue
        out.add(pid)
    return out


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def n_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def n_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def snapshot() -> dict:
    kids = children()
    return {"children": {p for p, s in kids.items() if s != "Z"},
            "zombies": {p for p, s in kids.items() if s == "Z"},
            "shm": shm_entries(), "fds": n_fds(), "threads": n_threads(),
            "py_threads": threading.active_count()}


def delta(base: dict, now: dict) -> dict:
    return {"children": len(now["children"] - base["children"]),
            "zombies": len(now["zombies"] - base["zombies"]),
            "shm": len(now["shm"] - base["shm"]),
            "fds": now["fds"] - base["fds"],
            "threads": now["threads"] - base["threads"],
            "py_threads": now["py_threads"] - base["py_threads"]}


# ---------------------------------------------------------------- one cycle

def make_loader(impl: str, ds: Any, workers: int) -> Any:
    if impl == "mxload":
        return mxload.DataLoader(ds, batch_size=BATCH, num_workers=workers)
    return TorchDataLoader(ds, batch_size=BATCH, num_workers=workers)


def touch(batch: Any) -> None:
    x = batch[0]
    if not isinstance(x, np.ndarray):
        x = x.numpy()
    x.reshape(-1)[0]


def cycle(impl: str, ds: Any, workers: int, gone_timeout: float) -> tuple[float, float, float | None]:
    """(first batch s, exit s, gone s or None if the workers outlived gone_timeout)."""
    before = set(children())
    clock = time.perf_counter
    t0 = clock()
    loader = make_loader(impl, ds, workers)
    t_break = t0
    pids: set[int] = set()
    t_probe_end = t0
    for batch in loader:
        touch(batch)
        t_break = clock()
        pids = set(children()) - before     # this cycle's workers (probe not timed)
        t_probe_end = clock()
        break
    t_exit = clock()
    first = t_break - t0
    exit_s = t_exit - t_probe_end
    del batch, loader
    deadline = clock() + gone_timeout
    while present(pids):
        if clock() > deadline:
            return first, exit_s, None
        time.sleep(0.0005)
    gone = clock() - t_probe_end
    return first, exit_s, gone


def run_loader(impl: str, ds: Any, workers: int, cycles: int, gone_timeout: float,
               settle: float) -> dict:
    cycle(impl, ds, workers, gone_timeout)   # warm-up (imports, thread pools, ...)
    gc.collect()
    base = snapshot()
    firsts: list[float] = []
    exits: list[float] = []
    gones: list[float] = []
    stuck = 0
    errors: list[str] = []
    t_start = time.perf_counter()
    for _ in range(cycles):
        try:
            first, exit_s, gone = cycle(impl, ds, workers, gone_timeout)
        except Exception as e:  # keep going: report it
            errors.append(f"{type(e).__name__}: {e}")
            continue
        firsts.append(first)
        exits.append(exit_s)
        if gone is None:
            stuck += 1
        else:
            gones.append(gone)
    elapsed = time.perf_counter() - t_start
    at_once = delta(base, snapshot())
    time.sleep(settle)
    gc.collect()
    settled = delta(base, snapshot())
    return {"firsts": firsts, "exits": exits, "gones": gones, "stuck": stuck, "errors": errors,
            "at_once": at_once, "settled": settled, "elapsed": elapsed}


# ---------------------------------------------------------------- main

def ms(xs: list[float], q: float | None = None) -> str:
    if not xs:
        return "-"
    v = np.max(xs) if q == 100 else (np.median(xs) if q is None else np.percentile(xs, q))
    return f"{v * 1e3:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cycles", type=int, default=300)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--loaders", nargs="+", default=["mxload", "torch"], choices=["mxload", "torch"])
    p.add_argument("--samples", type=int, default=10_000, help="images dataset size")
    p.add_argument("--gone-timeout", type=float, default=10.0,
                   help="seconds to wait for a cycle's workers to disappear")
    p.add_argument("--sample-sleep-ms", type=float, default=0.0,
                   help="sleep this long in every __getitem__ (slow batches)")
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds to wait before the second leftover snapshot")
    args = p.parse_args(argv)

    impls = []
    for impl in args.loaders:
        if impl == "torch" and torch is None:
            print(f"# torch is not importable ({_TORCH_ERROR}); skipping it")
            continue
        impls.append(impl)
    print(header("loader shutdown: create -> one batch -> break"))
    print(f"# mxload {mxload.__version__}" + (f", torch {torch.__version__}" if torch is not None else "")
          + f"; {args.cycles} cycles, {args.workers} workers, images batch {BATCH}; "
          f"leftovers vs a baseline after 1 warm-up cycle"
          + (f"; {args.sample_sleep_ms:g} ms sleep per sample" if args.sample_sleep_ms > 0 else ""))
    sys.stdout.flush()

    ds = (SlowImageDataset(args.samples, args.sample_sleep_ms / 1e3) if args.sample_sleep_ms > 0
          else D.ImageDataset(args.samples))
    results = {}
    for impl in impls:
        results[impl] = r = run_loader(impl, ds, args.workers, args.cycles, args.gone_timeout, args.settle)
        print(f"# {impl}: {len(r['exits'])} cycles in {r['elapsed']:.1f} s"
              + (f", {len(r['errors'])} errors (first: {r['errors'][0]})" if r["errors"] else ""),
              flush=True)

    rows = []
    for impl, r in results.items():
        a, s = r["at_once"], r["settled"]
        rows.append([impl, len(r["exits"]), ms(r["firsts"]), ms(r["exits"]), ms(r["exits"], 90),
                     ms(r["exits"], 100), ms(r["gones"]), ms(r["gones"], 100), r["stuck"],
                     f"{a['children']}/{s['children']}", f"{a['zombies']}/{s['zombies']}",
                     f"{a['shm']}/{s['shm']}", f"{a['fds']}/{s['fds']}", f"{a['threads']}/{s['threads']}"])
    print()
    print(table(rows, ["loader", "cycles", "1st batch ms", "exit ms", "exit p90", "exit max",
                       "gone ms", "gone max", "not gone", "children", "zombies", "/dev/shm",
                       "fds", "threads"]))
    print(f"# exit: break -> loop exited (iterator dropped); gone: break -> every worker of the "
          f"cycle exited and reaped (median, max); leftovers: immediately / after {args.settle:g} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
