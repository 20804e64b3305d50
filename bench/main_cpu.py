"""What the training process pays per batch: CPU time of its own threads.

    python bench/main_cpu.py [--repeats 7] [--epochs-per-repeat 2] [--rows 102400]
                             [--no-torch]

Workload: ``mxload.ArrayDataset(x, y)`` over a float32 matrix of `rows` x 256
and int64 labels, batches of 1024 drawn by one vectorised ``__getitems__``
per batch, 2 persistent workers (and mxload with 0 workers, where the main
process does the gather itself).  torch's DataLoader iterates the very same
dataset object (torch >= 2.0 calls ``__getitems__`` too).

Each configuration keeps one loader (persistent workers), runs one warm-up
epoch, then `repeats` times takes `epochs-per-repeat` whole epochs; the
configurations run round-robin (rotating order).  Reported, as medians over
the repeats:

* main CPU/batch: user + system CPU time of every thread of this process
  (CLOCK_PROCESS_CPUTIME_ID; the workers are other processes, so they are
  excluded) divided by the batches taken; user and system separately from
  getrusage(RUSAGE_SELF);
* consumer / fetcher: the same, per thread, from /proc/self/task/*/schedstat:
  the thread running the loop, and mxload's fetcher thread;
* GIL (fetcher): time the fetcher thread holds the GIL per batch.  The
  compiled receive path counts it itself (``gil_ns`` in the loader's
  receive statistics); for a fetcher written in Python, which releases the
  GIL only while blocked in select()/recvmsg(), its CPU time is the bound
  shown with ``<=``;
* b/s: batches per second (wall clock; on a loaded machine, noisy);
* other load: cores used by other processes meanwhile (from /proc/stat minus
  this process tree).  CPU time per batch is robust to it; b/s is not.

The consumer only touches one element of each batch, so everything it
spends is the loader's.  Ratios are between rows of the same run.
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import threading
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import busy_s, header, median, optional_torch, table  # noqa: E402

import mxload  # noqa: E402
from mxload import synthetic  # noqa: E402

torch, TorchDataLoader, _TORCH_ERROR = optional_torch()
warnings.filterwarnings("ignore", message=".*worker processes in total.*")

BATCH = 1024
DIM = 256
FETCHER_NAME = "mxload-fetcher"


def thread_ns() -> dict[int, int]:
    """On-CPU ns of every thread of this process, by native thread id."""
    out: dict[int, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass   # the thread ended meanwhile
    return out


def tree_s(pids: list[int]) -> float:
    """CPU seconds this process and the given processes (workers, zygote) used."""
    t = os.times()
    total = t.user + t.system
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def descendants() -> list[int]:
    """Pids of every process below this one (workers, a zygote)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [os.getpid()]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def fetcher_tids() -> set[int]:
    return {t.native_id for t in threading.enumerate()
            if t.name == FETCHER_NAME and t.native_id is not None}


def receive_gil_ns(loader: Any) -> int | None:
    """GIL-held ns the fetcher thread's compiled receive path counted so far
    (None without one: torch, 0 workers, or an mxload before it)."""
    transport = getattr(getattr(loader, "_engine", None), "transport", None)
    stats = getattr(transport, "receive_stats", None)
    return None if stats is None else int(stats["gil_ns"])


class Config:
    def __init__(self, name: str, loader: Any):
        self.name = name
        self.loader = loader
        self.rows: list[dict[str, float]] = []

    def epochs(self, n: int) -> int:
        taken = 0
        for _ in range(n):
            for batch in self.loader:
                batch[0][0, 0]   # touch it, as a training step would
                taken += 1
        return taken

    def measure(self, n_epochs: int) -> None:
        gc.collect()
        others = descendants()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        th0 = thread_ns()
        gil0 = receive_gil_ns(self.loader)
        busy0, tree0 = busy_s(), tree_s(others)
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        me = threading.get_native_id()
        batches = self.epochs(n_epochs)
        c1, w1 = time.process_time_ns(), time.perf_counter_ns()
        th1 = thread_ns()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        gil1 = receive_gil_ns(self.loader)
        foreign = max(0.0, ((busy_s() - busy0) - (tree_s(others) - tree0)) / ((w1 - w0) / 1e9))
        fetchers = fetcher_tids()
        per = 1e3 * batches   # ns -> us per batch
        row = {
            "main": (c1 - c0) / per,
            "user": (r1.ru_utime - r0.ru_utime) * 1e9 / per,
            "sys": (r1.ru_stime - r0.ru_stime) * 1e9 / per,
            "consumer": (th1.get(me, 0) - th0.get(me, 0)) / per,
            "fetcher": sum(th1.get(t, 0) - th0.get(t, 0) for t in fetchers) / per,
            "gil": float("nan") if gil0 is None or gil1 is None else (gil1 - gil0) / per,
            "bps": batches / ((w1 - w0) / 1e9),
            "other": foreign,
        }
        self.rows.append(row)

    def median(self, key: str) -> float:
        return median([r[key] for r in self.rows])

    def close(self) -> None:
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()
        else:   # torch: persistent workers end with the loader's iterator
            it = getattr(self.loader, "_iterator", None)
            if it is not None:
                it._shutdown_workers()


def build(impls: list[str], rows: int) -> tuple[Any, list[Config]]:
    dataset = synthetic.tabular_getitems(synthetic.TabularDataset(rows, DIM))
    configs = [Config("mxload, 0 workers", mxload.DataLoader(dataset, batch_size=BATCH, num_workers=0)),
               Config("mxload, 2 workers", mxload.DataLoader(dataset, batch_size=BATCH, num_workers=2,
                                                             persistent_workers=True))]
    if "torch" in impls:
        configs.append(Config(f"torch {torch.__version__}, 2 workers",
                              TorchDataLoader(dataset, batch_size=BATCH, num_workers=2,
                                              persistent_workers=True)))
    return dataset, configs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--epochs-per-repeat", type=int, default=2)
    p.add_argument("--rows", type=int, default=100 * BATCH, help="rows of the matrix (a multiple of 1024)")
    p.add_argument("--no-torch", action="store_true")
    args = p.parse_args(argv)
    impls = ["mxload"]
    if not args.no_torch:
        if torch is None:
            print(f"# torch is not importable ({_TORCH_ERROR}); mxload only")
        else:
            impls.append("torch")
    print(header("main-process CPU per batch: ArrayDataset.__getitems__, (1024, 256) float32 batches"))
    print(f"# mxload {mxload.__version__}; {args.rows // BATCH} batches per epoch, "
          f"{args.epochs_per_repeat} epochs per repeat, {args.repeats} repeats", flush=True)
    _, configs = build(impls, args.rows)
    try:
        for c in configs:
            c.epochs(1)   # warm-up: workers started, slabs mapped everywhere
        for r in range(args.repeats):
            k = r % len(configs)
            for c in configs[k:] + configs[:k]:
                c.measure(args.epochs_per_repeat)
    finally:
        for c in configs:
            c.close()
    base = {c.name: c.median("main") for c in configs}
    torch_main = next((v for k, v in base.items() if k.startswith("torch")), None)
    rows = []
    for c in configs:
        gil = c.median("gil")
        fetch = c.median("fetcher")
        if gil == gil:   # counted by the compiled receive path
            gil_s = f"{gil:.1f}"
        elif "mxload" in c.name and fetch > 0:
            gil_s = f"<= {fetch:.1f}"
        else:
            gil_s = "-"
        rows.append([c.name, f"{c.median('main'):.1f}", f"{c.median('user'):.1f}",
                     f"{c.median('sys'):.1f}", f"{c.median('consumer'):.1f}",
                     f"{fetch:.1f}" if fetch > 0 else "-", gil_s, f"{c.median('bps'):.0f}",
                     "-" if torch_main is None else f"{torch_main / c.median('main'):.1f}x",
                     f"{c.median('other'):.2f}"])
    print()
    print(table(rows, ["loader", "main CPU us/batch", "user", "sys", "consumer", "fetcher",
                       "GIL (fetcher) us", "b/s", "torch CPU / this", "other load"]))
    print("# us per batch, medians; 'other load': cores used by other processes meanwhile "
          "(CPU times are robust to it, b/s is not)")
    mx2 = base.get("mxload, 2 workers")
    if mx2 is not None:
        print(f"# target: main CPU <= 20 us/batch with 2 workers: {mx2:.1f} us "
              f"{'ok' if mx2 <= 20 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
