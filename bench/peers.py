"""mxload against Grain, SPDL and torch's DataLoader, each set up as its own docs advise.

    python bench/peers.py [--quick] [--repeats 3] [--workloads images tabular dict16 jpeg augment]
                          [--workers 0 2] [--loaders mxload torch grain ...] [--limit-seconds S]

Every measurement runs in a fresh Python process (this script with --child): it builds
the workload's dataset (bench/_workloads.py, mxload/synthetic.py), opens the loader,
takes the first batch (ttfb: includes starting workers or threads), then a fixed
number of batches (b/s: steady batches per second after the first), touching one
element of every array as bench/loader.py does, and closes it.  The configurations of
a workload run in alternated rounds (ABC, CBA, ...; mxload._bench.alternate) so drift
on a noisy machine falls on all alike; the table shows each configuration's median
and its spread (min-max over the rounds).

The physical limits run in the same rounds (bench/machine_limits.py's in_process_bps):
the workload loaded in process (mxload, 0 workers) by one plain process, and by two at
once (their sum). A loader with 0 workers is set against the first, with 2 workers
against the second ("of limit").  The paired columns take the same two ratios round by round
and give their median: a round's measurements run minutes apart at most, so a slow drift of
the machine's speed between rounds falls on both sides of each ratio.

own CPU ms/b: CPU time of the measuring process (all its threads, not its worker
processes) per steady batch: for a thread-based loader it includes the loading itself.

Peers (the `peers` extra: pip install 'mxload[peers]'); one that is not installed is
skipped with the reason printed:

* torch: torch.utils.data.DataLoader(ds, batch_size, num_workers), its defaults.
* grain: grain.python.DataLoader over the dataset as its RandomAccessDataSource, an
  IndexSampler (one epoch, in order), a Batch operation (drop_remainder) and
  worker_count = workers; ReadOptions(num_threads=0): Grain's docs advise no read
  threads for data already in memory (they contend for the GIL).
* grain-threads: the same with ReadOptions(num_threads=2, prefetch_buffer_size=2
  batches), on jpeg and augment only: read threads pay only where a sample's work
  releases the GIL (on tabular they took 0.6 b/s against 26 without).
* spdl-threads: a PipelineBuilder pipeline (SPDL's MT model): a source of index
  batches (as a batch sampler gives), one stage that fetches and stacks a batch with
  concurrency = max(1, workers) in a thread pool of that size (build(num_threads)),
  output in input order, a sink of 3; with 0 workers it is one background thread.
* spdl-processes: the same stage given a ProcessPoolExecutor of `workers` processes
  (SPDL's MP model; a batch crosses back pickled); needs >= 1 worker.
* spdl-subprocess: the spdl-threads pipeline with `workers` threads run whole in one
  subprocess by run_pipeline_in_subprocess (SPDL's MTP model; batches cross back
  pickled); needs >= 1 worker.
* spdl-subprocess-arena: the same with its batches handed back through shared memory
  (arena=SharedMemorySegmentPool: a segment of one batch + 1 MiB, 5 segments: the sink's
  3 and 2 held by the loop), zero-copy views on the main side.
* spdl-torch: spdl.dataloader.get_pytorch_dataloader (SPDL's drop-in for torch's loader:
  the dataset in shared memory, shared queues); needs torch and >= 1 worker.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import busy_s, header, median, table  # noqa: E402
from _workloads import ALL, BATCHES, QUICK_SCALE, build_datasets, close_iter, own_cpu_s, touch  # noqa: E402

WORKLOADS = [w for w in ("images", "tabular", "dict16", "jpeg", "augment") if w in ALL]
CHILD_TIMEOUT_S = 300

# ---------------------------------------------------------------- the peers

Opened = tuple[Iterator[Any], Callable[[], None]]   # batches, and how to close them


@dataclass(frozen=True)
class Peer:
    """A loader: the modules it needs, one line on its settings, `open(dataset, batch_size,
    workers)` -> (batch iterator, close), the fewest workers it runs with and the workloads
    it is meant for."""

    name: str
    needs: tuple[str, ...]
    settings: str
    open: Callable[[Any, int, int], Opened]
    min_workers: int = 0
    workloads: tuple[str, ...] = ()    # the only workloads it runs (all when empty)
    max_workers: int | None = None     # the most workers it runs with (None: any)

    def missing(self) -> str:
        """Why this peer cannot run here ("" when it can)."""
        absent = [m for m in self.needs if importlib.util.find_spec(m) is None]
        if not absent:
            return ""
        return f"{', '.join(absent)} not installed (pip install 'mxload[peers]')"


def _iterate(loader: Any) -> Opened:
    it = iter(loader)
    return it, lambda: close_iter(it)


def _open_mxload(ds: Any, bs: int, workers: int) -> Opened:
    import mxload
    return _iterate(mxload.DataLoader(ds, batch_size=bs, num_workers=workers))


def _open_mxload_threads(ds: Any, bs: int, workers: int) -> Opened:
    import mxload
    return _iterate(mxload.DataLoader(ds, batch_size=bs, num_workers=2, thread_pool=True))


def _open_torch(ds: Any, bs: int, workers: int) -> Opened:
    from torch.utils.data import DataLoader
    return _iterate(DataLoader(ds, batch_size=bs, num_workers=workers))


def _grain(read_threads: int) -> Callable[[Any, int, int], Opened]:
    def open_grain(ds: Any, bs: int, workers: int) -> Opened:
        import grain.python as gp
        read = (gp.ReadOptions(num_threads=0) if read_threads == 0 else
                gp.ReadOptions(num_threads=read_threads, prefetch_buffer_size=2 * bs))
        loader = gp.DataLoader(
            data_source=ds, sampler=gp.IndexSampler(len(ds), shuffle=False, num_epochs=1, seed=0),
            operations=[gp.Batch(bs, drop_remainder=True)], worker_count=workers, read_options=read)
        it = iter(loader)
        # Grain's iterator has no close: its worker processes stop when it is collected.
        return it, lambda: None
    return open_grain


def stack_samples(samples: list[Any]) -> Any:
    """The samples of a batch stacked field by field (numpy), as Grain's Batch and torch's
    default collation do: SPDL leaves collation to the pipeline's author."""
    first = samples[0]
    if isinstance(first, dict):
        return {k: stack_samples([s[k] for s in samples]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(stack_samples(list(f)) for f in zip(*samples))
    return np.stack(samples) if isinstance(first, np.ndarray) else np.asarray(samples)


_DATASET: Any = None   # the dataset an SPDL process-pool worker reads (set by _share)


def _share(ds: Any) -> None:
    global _DATASET
    _DATASET = ds


def _fetch_from(ds: Any, indices: list[int]) -> Any:
    return stack_samples([ds[i] for i in indices])


def _fetch_batch(indices: list[int]) -> Any:
    """_fetch_from the dataset of this process: a process pool pickles its callable with
    every task, so its workers hold the dataset (_share) and the task names only indices."""
    return _fetch_from(_DATASET, indices)


def _spdl(where: str) -> Callable[[Any, int, int], Opened]:
    """SPDL's pipeline with its stage on threads (MT), on a process pool (MP), or whole in
    one subprocess on threads (MTP: run_pipeline_in_subprocess), its batches pickled back
    or (subprocess-arena) handed back in shared memory."""
    def open_spdl(ds: Any, bs: int, workers: int) -> Opened:
        from concurrent.futures import ProcessPoolExecutor

        from spdl.pipeline import PipelineBuilder, run_pipeline_in_subprocess
        concurrency = max(1, workers)
        # A list, not a generator: the subprocess model pickles the source.
        batches = [list(range(i, i + bs)) for i in range(0, len(ds) - bs + 1, bs)]
        if where.startswith("subprocess"):
            config = (PipelineBuilder().add_source(batches)
                      .pipe(functools.partial(_fetch_from, ds), concurrency=concurrency, output_order="input")
                      .add_sink(3).get_config())
            arena = {}
            if where == "subprocess-arena":
                from spdl.pipeline import SharedMemorySegmentPool

                # A segment holds one batch (its arrays' bytes, measured on batch 0, and
                # slack for what travels beside them); the sink's 3 and the 2 the loop may
                # hold: the segment count SharedMemorySegmentPool's docs advise.
                one_batch = touch(_fetch_from(ds, batches[0]), False)
                arena["arena"] = SharedMemorySegmentPool(one_batch + (1 << 20), 3 + 2)
            return _iterate(run_pipeline_in_subprocess(config, num_threads=concurrency, **arena))
        _share(ds)
        executor = (ProcessPoolExecutor(workers, initializer=_share, initargs=(ds,))
                    if where == "processes" else None)
        pipeline = (PipelineBuilder().add_source(batches)
                    .pipe(_fetch_batch, concurrency=concurrency, executor=executor, output_order="input")
                    .add_sink(3).build(num_threads=concurrency))
        pipeline.start()

        def close() -> None:
            pipeline.stop()
            if executor is not None:
                executor.shutdown(cancel_futures=True)
        return pipeline.get_iterator(timeout=CHILD_TIMEOUT_S), close
    return open_spdl


def _open_spdl_torch(ds: Any, bs: int, workers: int) -> Opened:
    from spdl.dataloader import get_pytorch_dataloader
    return _iterate(get_pytorch_dataloader(ds, batch_size=bs, num_workers=workers, drop_last=True))


PEERS: dict[str, Peer] = {p.name: p for p in [
    Peer("mxload", (), "mxload.DataLoader(ds, batch_size, num_workers), its defaults", _open_mxload),
    Peer("mxload-threads", (), "mxload.DataLoader(ds, batch_size, num_workers=2, thread_pool=True): "
         "two loading threads in the training process, no worker process (the 0-worker rows only, "
         "beside grain-threads)", _open_mxload_threads, max_workers=0),
    Peer("torch", ("torch",), "torch.utils.data.DataLoader(ds, batch_size, num_workers), its defaults",
         _open_torch),
    Peer("grain", ("grain",), "grain.python.DataLoader: IndexSampler, Batch, worker_count=workers, "
         "ReadOptions(num_threads=0) (docs: in-memory data)", _grain(0)),
    Peer("grain-threads", ("grain",), "the same with ReadOptions(num_threads=2, "
         "prefetch_buffer_size=2 batches), on jpeg and augment only", _grain(2),
         workloads=("jpeg", "augment")),
    Peer("spdl-threads", ("spdl",), "PipelineBuilder: index batches -> pipe(fetch+stack, "
         "concurrency=max(1,workers)) -> sink(3), build(num_threads=max(1,workers))", _spdl("threads")),
    Peer("spdl-processes", ("spdl",), "the same stage on ProcessPoolExecutor(workers)",
         _spdl("processes"), min_workers=1),
    Peer("spdl-subprocess", ("spdl",), "the same pipeline, `workers` threads, in one subprocess "
         "(run_pipeline_in_subprocess)", _spdl("subprocess"), min_workers=1),
    Peer("spdl-subprocess-arena", ("spdl",), "the same, batches handed back in a "
         "SharedMemorySegmentPool(one batch + 1 MiB, 5 segments)", _spdl("subprocess-arena"),
         min_workers=1),
    Peer("spdl-torch", ("spdl", "torch"), "spdl.dataloader.get_pytorch_dataloader(ds, batch_size, "
         "num_workers, drop_last=True)", _open_spdl_torch, min_workers=1),
]}


# ---------------------------------------------------------------- one measurement (the child)

def descendants_cpu_s() -> float:
    """CPU seconds used so far by the live descendants of this process (a loader's worker
    processes, which it reaps only when it closes, if at all): /proc; 0 without it."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:          # it ended meanwhile
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick    # utime, stime
    mine, total = {os.getpid()}, 0.0
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                total += cpu[pid]
                grew = True
    return total


def measure(opened: Callable[[], Opened], n_batches: int) -> dict[str, float]:
    """Open a loader, take n_batches, close it: seconds to the first batch, steady
    batches/s after it, own CPU ms per steady batch and the other processes' load (the
    machine's busy time less this process's and its descendants', up to the last batch)."""
    clock = time.perf_counter
    busy0, own0 = busy_s(), own_cpu_s()
    t0 = clock()
    it, close = opened()
    touch(next(it), False)
    t1, cpu1 = clock(), time.process_time()
    for _ in range(n_batches - 1):
        touch(next(it), False)
    t2, cpu2 = clock(), time.process_time()
    busy2, own2 = busy_s(), own_cpu_s() + descendants_cpu_s()
    close()
    foreign = max(0.0, ((busy2 - busy0) - (own2 - own0)) / (t2 - t0))
    steady = max(t2 - t1, 1e-9)
    return {"ttfb_s": t1 - t0, "bps": (n_batches - 1) / steady,
            "cpu_ms": (cpu2 - cpu1) * 1e3 / (n_batches - 1), "other_load": foreign}


def child(spec: dict[str, Any]) -> int:
    warnings.filterwarnings("ignore")
    peer = PEERS[spec["loader"]]
    ds = build_datasets([spec["workload"]], spec["scale"])[spec["workload"]]
    bs = ALL[spec["workload"]].batch_size
    n_batches = max(2, min(spec["batches"], len(ds) // bs))
    out = measure(lambda: peer.open(ds, bs, spec["workers"]), n_batches)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ---------------------------------------------------------------- the rounds (the parent)

def run_child(spec: dict[str, Any]) -> dict[str, float] | str:
    """One measurement in a fresh process: its figures, or why it failed (one line)."""
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"no result in {CHILD_TIMEOUT_S} s"
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    last = [ln for ln in done.stderr.splitlines() if ln.strip()]
    return f"exit {done.returncode}: {last[-1] if last else 'no output'}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"smaller datasets ({QUICK_SCALE:g} of full), fewer batches, 1 round by default")
    p.add_argument("--repeats", type=int, default=None, help="alternated rounds (default 3, quick 1)")
    p.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=list(ALL))
    p.add_argument("--workers", nargs="+", type=int, default=[0, 2])
    p.add_argument("--loaders", nargs="+", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--batches", type=int, default=None, help="batches per measurement (default per workload)")
    p.add_argument("--limit-seconds", type=float, default=None,
                   help="seconds per physical-limit run (default 4, quick 1.5)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}" if len(xs) > 1 else "-"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    from machine_limits import in_process_bps

    from mxload._bench import alternate
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    scale = QUICK_SCALE if args.quick else 1.0
    limit_s = args.limit_seconds or (1.5 if args.quick else 4.0)
    print(header("mxload against Grain, SPDL and torch's DataLoader"))
    loaders = []
    for name in args.loaders:
        why = PEERS[name].missing()
        if why:
            print(f"# {name} skipped: {why}")
        else:
            loaders.append(name)
    versions = []
    for module in ("mxload", "torch", "grain", "spdl"):
        if importlib.util.find_spec(module) is not None:
            try:
                versions.append(f"{module} {version(module)}")
            except PackageNotFoundError:
                versions.append(f"{module} (not an installed distribution)")
    print(f"# {', '.join(versions)}; {repeats} alternated rounds, fresh process each, scale {scale:g}"
          f"{' (--quick)' if args.quick else ''}")
    for name in loaders:
        print(f"#   {name}: {PEERS[name].settings}")
    sys.stdout.flush()

    results: dict[tuple[str, str, int], list[dict[str, float]]] = {}
    failures: dict[tuple[str, str, int], str] = {}
    limits: dict[tuple[str, int], list[float]] = {}
    t_start = time.perf_counter()
    for workload in args.workloads:
        batches = args.batches or BATCHES[workload][1 if args.quick else 0]
        timed: dict[str, Callable[[int], None]] = {}
        for name in loaders:
            for w in args.workers:
                peer = PEERS[name]
                if w < peer.min_workers or (peer.max_workers is not None and w > peer.max_workers) \
                        or (peer.workloads and workload not in peer.workloads):
                    continue
                key = (workload, name, w)
                spec = {"loader": name, "workload": workload, "workers": w, "batches": batches,
                        "scale": scale}

                def one(_round: int, key: tuple[str, str, int] = key, spec: dict[str, Any] = spec) -> None:
                    if key in failures:
                        return
                    got = run_child(spec)
                    if isinstance(got, str):
                        failures[key] = got
                    else:
                        results.setdefault(key, []).append(got)
                timed[f"{name} w{w}"] = one
        for copies in (1, 2):
            def limit(_round: int, copies: int = copies, workload: str = workload) -> None:
                limits.setdefault((workload, copies), []).append(in_process_bps(workload, limit_s, copies))
            timed[f"limit {copies}"] = limit
        alternate(repeats, timed)
        print(f"# {workload}: {batches} batches of {ALL[workload].batch_size} per measurement "
              f"({time.perf_counter() - t_start:.0f} s elapsed)", flush=True)

    print()
    print(table(rows(args, loaders, results, failures, limits),
                ["workload", "loader", "workers", "ttfb ms", "b/s", "spread", "own CPU ms/b",
                 "mxload / this", "of limit", "other load", "paired mx / this", "paired of limit"]))
    print("# limit: the workload in process (mxload, 0 workers) in 1 plain process (for 0 workers) and"
          " in 2 at once (their sum, for 2 workers), measured in the same rounds")
    print("# paired: the median over the rounds of each round's own ratio (mxload / this, this / limit)")
    worst = max((median([r["other_load"] for r in v]) for v in results.values()), default=0.0)
    print(f"# other load: cores busy with other processes meanwhile (median); "
          f"{'the machine was quiet' if worst < 0.2 else 'NOISY: other processes competed for the CPUs'}")
    for key, why in failures.items():
        print(f"# {key[1]} failed on {key[0]} with {key[2]} workers: {why}")
    print(f"# total {time.perf_counter() - t_start:.0f} s")
    return 0


def rows(args: argparse.Namespace, loaders: list[str], results: dict[tuple[str, str, int], list],
         failures: dict[tuple[str, str, int], str], limits: dict[tuple[str, int], list[float]]) -> list:
    out: list[list[str]] = []
    for workload in args.workloads:
        for copies in (1, 2):
            got = limits.get((workload, copies), [])
            if got:
                out.append([workload, f"limit {copies} proc", "-", "-", f"{median(got):.1f}", _spread(got),
                            "-", "-", "-", "-", "-", "-"])
        for w in args.workers:
            limit = limits.get((workload, 1 if w == 0 else 2))
            mx = results.get((workload, "mxload", w))
            for name in loaders:
                key = (workload, name, w)
                if key in failures:
                    out.append([workload, name, str(w), "failed"] + ["-"] * 8)
                if key not in results:
                    continue
                runs = results[key]
                bps = median([r["bps"] for r in runs])
                vs_mx = f"{median([r['bps'] for r in mx]) / bps:.2f}x" if mx and name != "mxload" else "-"
                of_limit = f"{bps / median(limit):.2f}" if limit and w in (0, 2) else "-"
                # The same ratios round by round (a round's measurements are minutes apart at
                # most: a slow drift of the machine's speed falls on both sides of each ratio).
                paired_mx = (f"{median([a['bps'] / b['bps'] for a, b in zip(mx, runs)]):.2f}x"
                             if mx and name != "mxload" else "-")
                paired_limit = (f"{median([a['bps'] / b for a, b in zip(runs, limit)]):.2f}"
                                if limit and w in (0, 2) else "-")
                out.append([workload, name, str(w), f"{median([r['ttfb_s'] for r in runs]) * 1e3:.0f}",
                            f"{bps:.1f}", _spread([r["bps"] for r in runs]),
                            f"{median([r['cpu_ms'] for r in runs]):.1f}", vs_mx, of_limit,
                            f"{median([r['other_load'] for r in runs]):.2f}", paired_mx, paired_limit])
    return out


if __name__ == "__main__":
    sys.exit(main())
