"""Collation throughput: mxload's planned batchify vs np.stack vs a plain copy.

    python bench/collate.py [--repeats N] [--quick] [--only NAME ...] [--check]

Workloads:
  images   64 samples of (224, 224, 3) uint8
  tabular  1024 samples of (256,) float32
  dict16   256 samples, each a dict of 16 fields of (64,) float32

Rows per workload (each a median over --repeats batches, methods timed
round-robin so drift on a noisy machine hits them all alike):
  copyto    np.copyto of one contiguous buffer of the batch's total bytes,
            src and dst preallocated, src a separate allocation (not the
            batch itself): the memory-bandwidth limit
  np.stack  np.stack(samples) (dict16: np.stack per field)
  mxload prealloc   plan_batch(default_batchify, samples) + plan.fill(buf)
                    into a preallocated buffer (what a worker does into a slab)
  mxload batchify   default_batchify(samples), allocation included

"% bw" = copyto time / row time; "vs stack" = np.stack time / row time.
A breakdown table splits "mxload prealloc" into plan, fill and the time the
C kernels report for themselves (GIL released) to show where the time goes.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from _common import fmt_time, header, median, table, time_interleaved  # noqa: E402

import mxload  # noqa: E402
from mxload import batchify as bfy  # noqa: E402
from mxload._collate.plan import allocate  # noqa: E402

TARGET_BW = 0.80      # images: mxload >= 80% of the copyto bandwidth limit
TARGET_SPEEDUP = 3.0  # tabular, dict16: mxload >= 3x np.stack


def make_workloads(rng: np.random.Generator) -> dict:
    # Every sample is its own allocation, as a Dataset would return it.
    images = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(64)]
    tabular = [rng.standard_normal(256, dtype=np.float32) for _ in range(1024)]
    keys = [f"f{i:02d}" for i in range(16)]
    dict16 = [{k: rng.standard_normal(64, dtype=np.float32) for k in keys} for _ in range(256)]
    return {
        "images": ("64 x (224,224,3) uint8", images),
        "tabular": ("1024 x (256,) float32", tabular),
        "dict16": ("256 x dict of 16 x (64,) float32", dict16),
    }


def np_stack_fn(samples):
    if isinstance(samples[0], dict):
        keys = list(samples[0])
        return lambda: {k: np.stack([s[k] for s in samples]) for k in keys}
    return lambda: np.stack(samples)


def check_same(samples) -> None:
    """mxload's batch must equal np.stack's before we time anything."""
    ref = np_stack_fn(samples)()
    got = bfy.default_batchify(samples)
    if isinstance(ref, dict):
        assert list(got) == list(ref), "dict keys differ"
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k])
    else:
        np.testing.assert_array_equal(got, ref)


def bench_one(name: str, samples, repeats: int, warmup: int):
    plan0 = bfy.plan_batch(bfy.default_batchify, samples)
    nbytes = plan0.nbytes
    check_same(samples)

    # Bandwidth limit: one contiguous copy of the batch's bytes.  Both buffers
    # are preallocated and touched; src is a separate allocation of the same
    # size, so it is in no warmer a cache state than the samples themselves.
    src = np.empty(nbytes, np.uint8)
    src.fill(1)
    dst = np.empty(nbytes, np.uint8)
    dst.fill(0)

    prealloc = allocate(nbytes)
    prealloc.fill(0)
    kernel_ns = []

    def mx_prealloc():
        plan = bfy.plan_batch(bfy.default_batchify, samples)
        plan.fill(prealloc)

    def mx_plan():
        bfy.plan_batch(bfy.default_batchify, samples)

    def mx_fill():
        _, ns = plan0.fill(prealloc)
        kernel_ns.append(sum(ns))

    fns = {
        "copyto": lambda: np.copyto(dst, src),
        "np.stack": np_stack_fn(samples),
        "mxload prealloc": mx_prealloc,
        "mxload batchify": lambda: bfy.default_batchify(samples),
        "plan": mx_plan,
        "fill": mx_fill,
    }
    times = time_interleaved(fns, repeats, warmup)
    med = {k: median(v) for k, v in times.items()}
    kernel_ns = kernel_ns[warmup:]
    med["kernels"] = median(kernel_ns)
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    return nbytes, len(plan0.fields), med, spread


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30, help="timed batches per method (default 30)")
    ap.add_argument("--quick", action="store_true", help="5 repeats, 1 warm-up: a smoke run")
    ap.add_argument("--only", nargs="+", choices=["images", "tabular", "dict16"],
                    help="run only these workloads")
    ap.add_argument("--check", action="store_true", help="exit with status 1 if a target is missed")
    args = ap.parse_args(argv)
    repeats = 5 if args.quick else max(1, args.repeats)
    warmup = 1 if args.quick else 5

    print(header("mxload collation benchmark"))
    print(f"# mxload {getattr(mxload, '__version__', '?')}, repeats {repeats}, warm-up {warmup}, "
          f"times are medians per batch")
    print()

    workloads = make_workloads(np.random.default_rng(0))
    rows, brk, verdicts = [], [], []
    missed = False
    for name, (desc, samples) in workloads.items():
        if args.only and name not in args.only:
            continue
        nbytes, nfields, med, spread = bench_one(name, samples, repeats, warmup)
        bw = med["copyto"]
        st = med["np.stack"]
        label = f"{name}: {desc}, {nbytes / 2**20:.2f} MiB"
        for i, meth in enumerate(["copyto", "np.stack", "mxload prealloc", "mxload batchify"]):
            t = med[meth]
            lo, hi = spread[meth]
            rows.append([
                label if i == 0 else "",
                meth,
                fmt_time(t),
                f"{fmt_time(lo)}..{fmt_time(hi)}",
                f"{nbytes / t:.2f}",
                f"{100 * bw / t:.0f}%",
                f"{st / t:.2f}x",
            ])
        brk.append([name, str(nfields), fmt_time(med["mxload prealloc"]), fmt_time(med["plan"]),
                    fmt_time(med["fill"]), fmt_time(med["kernels"]),
                    fmt_time(max(0.0, med["fill"] - med["kernels"])),
                    f"{100 * med['kernels'] / med['mxload prealloc']:.0f}%"])
        for meth in ("mxload prealloc", "mxload batchify"):
            if name == "images":
                eff = bw / med[meth]
                missed |= eff < TARGET_BW
                verdicts.append(f"{name:8s} {meth:16s} {100 * eff:5.1f}% of bandwidth limit "
                                f"(target >= {100 * TARGET_BW:.0f}%): "
                                f"{'OK' if eff >= TARGET_BW else 'MISSED'}")
            else:
                sp = st / med[meth]
                missed |= sp < TARGET_SPEEDUP
                verdicts.append(f"{name:8s} {meth:16s} {sp:5.2f}x vs np.stack "
                                f"(target >= {TARGET_SPEEDUP:.0f}x): "
                                f"{'OK' if sp >= TARGET_SPEEDUP else 'MISSED'}")

    print(table(rows, ["workload", "method", "median", "min..max", "GB/s", "% bw", "vs stack"]))
    print()
    print("breakdown of 'mxload prealloc' (medians of separately timed calls; "
          "kernels = time the C copy loops report, GIL released):")
    print(table(brk, ["workload", "fields", "plan+fill", "plan", "fill", "kernels",
                      "fill-kernels", "kernels/total"]))
    print()
    print("targets:")
    for v in verdicts:
        print("  " + v)
    return 1 if (args.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
