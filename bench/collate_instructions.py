"""Instruction counts of collating one batch, for callgrind (stable under load).

    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/collate_instructions.py dict16 0
    valgrind --tool=callgrind --callgrind-out-file=/dev/null python bench/collate_instructions.py dict16 100

Runs the workload's set-up (bench/collate.py's workloads: images, tabular,
dict16) and one warm-up batch, then collates N more batches with
default_batchify (allocation included); the difference of the two runs'
"Collected" totals divided by N is the instructions per batch.  Counts
move by a few percent with N (garbage collections, allocator state): use
N = 100 for the small workloads, and OPENBLAS_NUM_THREADS=1.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from collate import make_workloads  # noqa: E402

from mxload import batchify as bfy  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "dict16"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    _, samples = make_workloads(np.random.default_rng(0))[name]
    bfy.default_batchify(samples)
    for _ in range(n):
        bfy.default_batchify(samples)


if __name__ == "__main__":
    main()
