"""Profile your own dataset: where does the training loop's time go, and what to change?

    python examples/profile_my_dataset.py                     # seconds
    mxload profile examples/profile_my_dataset.py:make_dataset --batch-size 32 --workers 2

The dataset below is a stand-in for yours: each sample costs some CPU work in
``__getitem__`` (like decoding) and returns a dict of arrays.  The script runs
it twice, with a fast training loop (the loader is the bottleneck) and with a
slow one (the training loop is), prints both reports, and saves a trace of each for
https://ui.perfetto.dev (in --trace-dir, or a fresh temporary folder: never a fixed
name another run or user would overwrite).  numpy only.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

import mxload


class MyDataset(mxload.Dataset):
    """Replace with yours: a 'decode' of `work_ms` of CPU, a (32, 32, 3) image and a label."""

    def __init__(self, n: int = 512, work_ms: float = 1.0):
        self.n = n
        self.work_s = work_ms / 1e3

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, np.ndarray | int]:
        end = time.thread_time() + self.work_s
        pixels = np.zeros((32, 32, 3), np.uint8)
        while time.thread_time() < end:   # CPU work, as a decoder would do
            pixels += 1
        return {"image": pixels, "label": i % 10}


def make_dataset() -> MyDataset:
    """The factory `mxload profile MODULE:FACTORY` calls: a module-level function."""
    return MyDataset()


def profile_run(loader: mxload.DataLoader, step_s: float, batches: int, trace: str) -> mxload.Report:
    with mxload.profile(loader) as prof:
        for k, _ in enumerate(loader):
            if step_s:
                time.sleep(step_s)          # the training step
            if k + 1 == batches:
                break
        report = prof.report()
        prof.save_chrome_trace(trace)
    loader.close()
    print(report)
    print(f"(trace: {trace})\n")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--trace-dir", help="folder for the two traces (default: a new temporary folder)")
    args = parser.parse_args()
    folder = args.trace_dir or tempfile.mkdtemp(prefix="mxload-example-traces-")
    dataset = make_dataset()
    print("== a fast training loop: the loader is the bottleneck\n")
    profile_run(mxload.DataLoader(dataset, batch_size=32, shuffle=True, seed=0, num_workers=args.workers),
                0.0, args.batches, os.path.join(folder, "fast-loop.json"))
    print("== a slow training loop (100 ms per step): the loader keeps up\n")
    report = profile_run(mxload.DataLoader(dataset, batch_size=32, shuffle=True, seed=0,
                                           num_workers=args.workers), 0.1, args.batches,
                         os.path.join(folder, "slow-loop.json"))
    # The stages partition the wall time: nothing is counted twice.
    assert abs(sum(report.stages.values()) - report.wall_s) < 0.01 * report.wall_s + 0.002


if __name__ == "__main__":
    main()
