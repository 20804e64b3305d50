"""What the training process pays per batch: CPU time of its own threads.

    python bench/main_cpu.py [--repeats 7] [--epochs-per-repeat 2] [--rows 102400]
                             [--step-us 500] [--no-torch]

Workload: ``mxload.ArrayDataset(x, y)`` over a float32 matrix of `rows` x 256
and int64 labels, batches of 1024 drawn by one vectorised ``__getitems__``
per batch, 2 persistent workers (and mxload with 0 workers, where the main
process does the gather itself).  torch's DataLoader iterates the very same
dataset object (torch >= 2.0 calls ``__getitems__`` too).

Two regimes, each a row per loader:

* loader-bound: the consumer takes batches as fast as it can (it only
  touches one element), so it waits for the workers before nearly every
  batch, and each wait is a sleep and a wake-up of the training process;
* training-bound ("+ step"): after each batch the consumer computes for
  `step-us` microseconds (a busy loop standing for the training step), so
  the next batches are ready when it asks.  The step's own CPU time is
  measured and subtracted: what remains is what the loader costs a training
  loop that is not waiting for data.

The training-bound mxload row runs again with prefetch 6 (3 per worker,
where a worker's tasks go three to a message, two after the loop would have
waited), and
with the default window but every task sent on its own (as before
67ae932, from which tasks pair at the default window while the loop finds
its batches ready), so the gain of two tasks per message is a ratio within
one run.  A last row runs the same loop over a list of batches: what the
loop and its measuring cost, which the loader rows include.

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
* GIL (fetcher): time mxload's fetcher thread holds the GIL per batch,
  counted by the compiled receive path (``gil_ns`` in the loader's receive
  statistics).  The consumer receives its batches itself with the GIL
  released; the fetcher thread only watches for workers' deaths;
* msgs/batch: messages that carried tasks to the workers (mxload sends a
  worker's task with its next while the loop is ahead of the workers: one
  wake-up of the worker for two batches);
* sleeps/batch: the loop's waits for a batch (its voluntary context
  switches), each a sleep and a wake-up of the training process;
* b/s: batches per second (wall clock; on a loaded machine, noisy);
* other load: cores used by other processes meanwhile (from /proc/stat minus
  this process tree).  CPU time per batch is robust to it; b/s is not.

Then, once: the Python bytecodes the training thread runs per batch in
mxload's own code (2 workers, `epochs-per-repeat` epochs, counted with
sys.settrace opcode events).  A count does not move with the machine's load,
so it shows a change to the per-batch Python path that CPU times on a shared
machine cannot resolve.

The consumer only touches one element of each batch, so everything it
spends is the loader's.  Ratios are between rows of the same run.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import resource
import sys
import threading
import time
import warnings
from collections.abc import Iterator
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


def consumer_sleeps() -> int:
    """Times this thread slept (voluntary context switches): each is a wait
    for a batch and a wake-up."""
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    return 0


def task_messages(loader: Any) -> int | None:
    """Messages that carried tasks to mxload's workers so far (None: torch, 0 workers)."""
    stats = getattr(loader, "stats", None)
    return None if not stats or "task_messages" not in stats else int(stats["task_messages"])


@contextlib.contextmanager
def one_task_per_message() -> Iterator[None]:
    """Engines made meanwhile send every task on its own, as mxload did
    before a worker's task waited for its next (the same run's baseline)."""
    from mxload._runtime.local import pairing
    from mxload._runtime.local import transport as processes
    init = processes.ProcessTransport.__init__

    def single(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.pairing.mode, self.put_task.per_message = pairing.PAIR_NEVER, 1   # policy overridden
    processes.ProcessTransport.__init__ = single  # type: ignore[method-assign]
    try:
        yield
    finally:
        processes.ProcessTransport.__init__ = init  # type: ignore[method-assign]


def receive_gil_ns(loader: Any) -> int | None:
    """GIL-held ns the fetcher thread's compiled receive path counted so far
    (None without one: torch, 0 workers, or an mxload before it)."""
    transport = getattr(getattr(loader, "_engine", None), "transport", None)
    stats = getattr(transport, "receive_stats", None)
    return None if stats is None else int(stats["gil_ns"])


def loader_bytecodes(loader: Any, epochs: int) -> tuple[float, list[tuple[str, float]]]:
    """Python bytecodes the training thread runs in mxload's own code per
    batch over `epochs` whole epochs (sys.settrace opcode events: a count,
    independent of the machine's load, unlike CPU time), and the functions
    that run most of them."""
    counts: collections.Counter[str] = collections.Counter()
    package = os.path.dirname(mxload.__file__)

    def in_frame(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            counts[frame.f_code.co_name] += 1
        return in_frame

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(package):
            return None
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        return in_frame

    taken = 0
    sys.settrace(on_call)
    try:
        for _ in range(epochs):
            for batch in loader:
                batch[0][0, 0]
                taken += 1
    finally:
        sys.settrace(None)
    per = max(taken, 1)
    return sum(counts.values()) / per, [(name, n / per) for name, n in counts.most_common(6)]


class Config:
    def __init__(self, name: str, loader: Any, step_us: float = 0.0, single_tasks: bool = False):
        self.name = name
        self.loader = loader
        self.single_tasks = single_tasks   # the baseline: one task per message
        self.step_ns = int(step_us * 1e3)
        self.stepped_ns = 0   # CPU time the simulated training steps took (this thread)
        self.rows: list[dict[str, float]] = []

    def warm_up(self) -> None:
        """One epoch: workers started, slabs mapped everywhere."""
        with one_task_per_message() if self.single_tasks else contextlib.nullcontext():
            self.epochs(1)

    def epochs(self, n: int) -> int:
        taken = 0
        step = self.step_ns
        for _ in range(n):
            for batch in self.loader:
                batch[0][0, 0]   # touch it, as a training step would
                taken += 1
                if step:
                    t0 = time.thread_time_ns()
                    end = time.perf_counter_ns() + step
                    while time.perf_counter_ns() < end:
                        pass
                    self.stepped_ns += time.thread_time_ns() - t0
        return taken

    def measure(self, n_epochs: int) -> None:
        gc.collect()
        others = descendants()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        th0 = thread_ns()
        gil0 = receive_gil_ns(self.loader)
        sleeps0, messages0 = consumer_sleeps(), task_messages(self.loader)
        busy0, tree0 = busy_s(), tree_s(others)
        stepped0 = self.stepped_ns
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        me = threading.get_native_id()
        batches = self.epochs(n_epochs)
        c1, w1 = time.process_time_ns(), time.perf_counter_ns()
        stepped = self.stepped_ns - stepped0
        th1 = thread_ns()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        gil1 = receive_gil_ns(self.loader)
        sleeps1, messages1 = consumer_sleeps(), task_messages(self.loader)
        foreign = max(0.0, ((busy_s() - busy0) - (tree_s(others) - tree0)) / ((w1 - w0) / 1e9))
        fetchers = fetcher_tids()
        per = 1e3 * batches   # ns -> us per batch
        row = {
            "main": (c1 - c0 - stepped) / per,
            "user": ((r1.ru_utime - r0.ru_utime) * 1e9 - stepped) / per,   # the step is user time
            "sys": (r1.ru_stime - r0.ru_stime) * 1e9 / per,
            "consumer": (th1.get(me, 0) - th0.get(me, 0) - stepped) / per,
            "fetcher": sum(th1.get(t, 0) - th0.get(t, 0) for t in fetchers) / per,
            "gil": float("nan") if gil0 is None or gil1 is None else (gil1 - gil0) / per,
            "bps": batches / ((w1 - w0) / 1e9),
            "sleeps": (sleeps1 - sleeps0) / batches,
            "messages": (float("nan") if messages0 is None or messages1 is None
                         else (messages1 - messages0) / batches),
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


def build(impls: list[str], rows: int, step_us: float) -> tuple[Any, list[Config]]:
    dataset = synthetic.tabular_getitems(synthetic.TabularDataset(rows, DIM))

    def mx(workers: int, prefetch: int | None = None) -> Any:
        return mxload.DataLoader(dataset, batch_size=BATCH, num_workers=workers,
                                 persistent_workers=workers > 0, prefetch=prefetch)
    configs = [Config("mxload, 0 workers", mx(0)), Config("mxload, 2 workers", mx(2))]
    if "torch" in impls:
        configs.append(Config(f"torch {torch.__version__}, 2 workers",
                              TorchDataLoader(dataset, batch_size=BATCH, num_workers=2,
                                              persistent_workers=True)))
    if step_us > 0:
        configs.append(Config(f"mxload, 2 workers + {step_us:g} us step", mx(2), step_us))
        # prefetch 6 (3 per worker): deep enough that a worker's tasks always share a message.
        configs.append(Config(f"mxload, 2 workers, prefetch 6 + {step_us:g} us step", mx(2, 6), step_us))
        configs.append(Config(f"mxload, 2 workers + {step_us:g} us step, one task per message "
                              "(as before 67ae932)", mx(2), step_us, single_tasks=True))
        # The loop with no loader at all (a list of batches): what the loop and its measuring cost.
        alone = list(mxload.DataLoader(dataset, batch_size=BATCH))
        configs.append(Config(f"the loop alone + {step_us:g} us step (a list of batches)", alone, step_us))
        if "torch" in impls:
            configs.append(Config(f"torch {torch.__version__}, 2 workers + {step_us:g} us step",
                                  TorchDataLoader(dataset, batch_size=BATCH, num_workers=2,
                                                  persistent_workers=True), step_us))
    return dataset, configs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--epochs-per-repeat", type=int, default=2)
    p.add_argument("--rows", type=int, default=100 * BATCH, help="rows of the matrix (a multiple of 1024)")
    p.add_argument("--step-us", type=float, default=500.0,
                   help="simulated training step per batch for the training-bound rows (0: none)")
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
    _, configs = build(impls, args.rows, args.step_us)
    try:
        for c in configs:
            c.warm_up()
        for r in range(args.repeats):
            k = r % len(configs)
            for c in configs[k:] + configs[:k]:
                c.measure(args.epochs_per_repeat)
        two = next(c for c in configs if c.name == "mxload, 2 workers")
        bytecodes, top = loader_bytecodes(two.loader, args.epochs_per_repeat)
    finally:
        for c in configs:
            c.close()
    base = {c.name: c.median("main") for c in configs}

    def torch_main(c: Config) -> float | None:
        """The main CPU of torch's row in the same regime as `c`."""
        return next((base[t.name] for t in configs if t.name.startswith("torch") and t.step_ns == c.step_ns),
                    None)
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
        messages = c.median("messages")
        rows.append([c.name, f"{c.median('main'):.1f}", f"{c.median('user'):.1f}",
                     f"{c.median('sys'):.1f}", f"{c.median('consumer'):.1f}",
                     f"{fetch:.1f}" if fetch > 0 else "-", gil_s,
                     f"{messages:.2f}" if messages == messages else "-", f"{c.median('sleeps'):.2f}",
                     f"{c.median('bps'):.0f}",
                     "-" if torch_main(c) is None or not c.name.startswith("mxload")
                     else f"{torch_main(c) / c.median('main'):.1f}x",
                     f"{c.median('other'):.2f}"])
    print()
    print(table(rows, ["loader", "main CPU us/batch", "user", "sys", "consumer", "fetcher",
                       "GIL (fetcher) us", "msgs/batch", "sleeps/batch", "b/s", "torch CPU / this",
                       "other load"]))
    print("# us per batch, medians; '+ step' rows exclude the step's own CPU time; msgs/batch: messages "
          "that carried tasks to the workers; sleeps/batch: the loop's waits for a batch (voluntary "
          "context switches); 'other load': cores used by other processes meanwhile (CPU times are robust "
          "to it, b/s is not)")
    print(f"# Python bytecodes per batch in mxload's code, training thread (mxload, 2 workers; a count, "
          f"not a time): {bytecodes:.0f}; most in " + ", ".join(f"{name} {n:.0f}" for name, n in top))
    single = next((c for c in configs if c.single_tasks), None)
    if single is not None:
        two_step = next(c for c in configs if c.step_ns == single.step_ns and not c.single_tasks
                        and "prefetch" not in c.name)
        print(f"# default window, tasks paired while the loop is ahead / one per message, same run, "
              f"training-bound: main CPU "
              f"{base[two_step.name] / base[single.name]:.2f}x")
    alone = next((c for c in configs if c.name.startswith("the loop alone")), None)
    if alone is not None:
        print(f"# the loop alone (a list of batches, the same step and clock reads): "
              f"{base[alone.name]:.1f} us per batch of the '+ step' rows is the loop's and its "
              f"measuring's, not the loader's")
    for c in configs:
        if c.name.startswith("mxload, 2 workers"):
            v = base[c.name]
            print(f"# target: main CPU <= 20 us/batch ({c.name}): {v:.1f} us {'ok' if v <= 20 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
