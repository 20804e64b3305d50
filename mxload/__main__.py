"""Command line: ``python -m mxload bench`` (the demo) and ``python -m mxload info``."""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

import numpy as np

from . import DataLoader
from ._info import show_config
from .synthetic import WORKLOADS, make_workload


def _progress(label: str, done: int, total: int) -> None:
    width = 24
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r  {label:<28} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\r" + " " * (width + 45) + "\r")
    sys.stderr.flush()


def _touch(batch: object) -> int:
    """Bytes of a batch, reading one element of each array (pages get mapped)."""
    if isinstance(batch, np.ndarray):
        if batch.size:
            batch.flat[batch.size - 1]
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(_touch(v) for v in batch.values())
    if isinstance(batch, (tuple, list)):
        return sum(_touch(v) for v in batch)
    return 0


def bench(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mxload bench",
                                     description="Run mxload on built-in synthetic workloads.")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batches", type=int, default=60, help="batches timed per run")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args(argv)
    print(f"mxload bench: {args.batches} batches per run, workers {args.workers}")
    print(f"{'workload':<12} {'workers':>7} {'first batch ms':>15} {'batches/s':>10} {'MB/s':>9}")
    for name in args.workloads:
        dataset, batch_size = make_workload(name)
        for workers in args.workers:
            loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=0, num_workers=workers)
            t0 = time.perf_counter()
            it = iter(loader)
            nbytes = _touch(next(it))
            first = time.perf_counter() - t0
            t1 = time.perf_counter()
            done = 0
            for batch in it:
                nbytes += _touch(batch)
                done += 1
                _progress(f"{name}, {workers} workers", done, args.batches)
                if done == args.batches:
                    break
            elapsed = time.perf_counter() - t1
            del it
            print(f"{name:<12} {workers:>7} {first * 1e3:>15.1f} {done / elapsed:>10.1f} "
                  f"{nbytes / elapsed / 1e6:>9.0f}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m mxload {bench,info} [options]\n"
              "  bench  run the loader on built-in synthetic data and print throughput\n"
              "  info   print the build configuration and platform capabilities")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        return bench(rest)
    if command == "info":
        show_config()
        return 0
    print(f"unknown command {command!r}; use bench or info", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
