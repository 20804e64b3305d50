"""Command line: ``python -m mxload bench`` (the demo) and ``python -m mxload info``."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Any

import numpy as np

from . import DataLoader
from ._info import show_config
from .profiler import profile
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


def bench(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mxload bench",
                                     description="Run mxload on built-in synthetic workloads.")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batches", type=int, default=60, help="batches timed per run")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args(argv)
    print(f"mxload bench: {args.batches} batches per run, workers {args.workers}")
    print(f"{'workload':<16} {'workers':>7} {'first batch ms':>15} {'batches/s':>10} {'MB/s':>9}  "
          f"profile verdict (the demo's consumer only touches each batch, so it is loader-bound)")
    for name in args.workloads:
        dataset, batch_size = make_workload(name)
        for workers in args.workers:
            loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=0, num_workers=workers,
                                profile=True)
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
            it.close()
            loader.close()
            verdict = loader.profiler.report().verdict
            print(f"{name:<16} {workers:>7} {first * 1e3:>15.1f} {done / elapsed:>10.1f} "
                  f"{nbytes / elapsed / 1e6:>9.0f}  {verdict}")
    return 0


def _load_factory(spec: str) -> Any:
    """Import MODULE:FACTORY (module may also be a path to a .py file)."""
    if ":" not in spec:
        raise SystemExit(f"expected MODULE:FACTORY, got {spec!r}")
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        sys.path.insert(0, os.path.dirname(path))
        module_name = os.path.splitext(os.path.basename(path))[0]
    else:
        sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise SystemExit(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(factory):
        raise SystemExit(f"{spec} is not callable")
    return factory


def profile_command(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mxload profile",
        description="Profile a loader: FACTORY returns a dataset or a DataLoader.")
    parser.add_argument("factory", metavar="MODULE:FACTORY")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    made = _load_factory(args.factory)()
    if isinstance(made, DataLoader):
        loader = made
    else:
        loader = DataLoader(made, batch_size=args.batch_size, num_workers=args.workers, shuffle=True)
    with profile(loader) as prof:
        it = iter(loader)
        total = min(args.batches, len(it)) if hasattr(it, "__len__") and not loader.iterable else args.batches
        done = 0
        for _ in it:
            done += 1
            _progress("profiling", done, total)
            if done >= total:
                break
        it.close()
        report = prof.report()
        if args.trace:
            prof.save_chrome_trace(args.trace)
    loader.close()
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    if args.trace:
        print(f"\ntrace written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m mxload {bench,profile,info} [options]\n"
              "  bench    run the loader on built-in synthetic data: throughput and profile verdict\n"
              "  profile  MODULE:FACTORY -- profile a loader (report + Chrome trace)\n"
              "  info     print the build configuration and platform capabilities")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        return bench(rest)
    if command == "profile":
        return profile_command(rest)
    if command == "info":
        show_config()
        return 0
    print(f"unknown command {command!r}; use bench, profile or info", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
