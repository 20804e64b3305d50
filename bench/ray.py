"""Local worker processes vs Ray actors (backend="ray") on the same cores.

    python bench/ray.py [--quick] [--repeats N] [--workloads jpeg images] [--workers 2]
                        [--cycles 100] [--no-latency] [--deaths 5] [--ray-log PATH]

Starts one local Ray instance with as many CPUs as workers (``ray.init(num_cpus=W,
include_dashboard=False)``), so actors and local processes get the same cores.
For each workload (mxload/synthetic.py: ``jpeg``, decode-bound, needs pillow;
``images``, copy-bound 9.6 MB batches), the two backends run with persistent
workers (start-up is not measured), round-robin, and report medians:

* b/s: steady batches per second (after a warm-up epoch slice);
* x local: Ray's b/s / local processes', round by round (each round runs
  both, order alternating), as median [min-max] (goal for jpeg: >= 0.8);
* trainer ms/b: CPU time of the training process per batch (its consumer,
  fetcher and, for Ray, the driver's Ray threads): the scaling model's
  main-process cost;
* MB/b: bytes per batch.

Then, with one worker and prefetch=1 (nothing overlaps), the added latency
per batch: median time of next() with Ray minus with a local process.
Then `--cycles` create/break cycles (``for batch in loader: break``), with
what is left afterwards in Ray (actors not DEAD, object references) and on
this machine (LoaderActor processes, this process's descriptors).  Last,
`--deaths` times: how long from killing an actor's process, or (on a
simulated 2-node cluster) the node its actors run on, to the WorkerError.
Ray's own output (its daemons, its loggers, its warnings) goes to `--ray-log`.
"""
from __future__ import annotations

import argparse
import builtins
import gc
import logging
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import header, median, table  # noqa: E402

# This file is named ray.py: once _common is imported, `import ray` must find
# Ray itself, here and in Ray's workers (which get this process's sys.path).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]

import mxload  # noqa: E402
from mxload import synthetic as D  # noqa: E402
from mxload._runtime.autotune import batch_nbytes  # noqa: E402

warnings.filterwarnings("ignore", message=".*worker processes in total.*")

BATCHES = {"jpeg": (48, 16), "images": (60, 20)}


def _touch(batch: Any) -> None:
    for array in batch if isinstance(batch, (list, tuple)) else [batch]:
        if getattr(array, "size", 0):
            array.flat[0]


def _run(loader: Any, batches: int) -> tuple[float, float, int]:
    """(seconds, trainer CPU seconds, bytes of one batch) for `batches` batches."""
    it = iter(loader)
    first = next(it)
    nbytes = batch_nbytes(first)
    del first
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(batches):
        _touch(next(it))
    t1, c1 = time.perf_counter(), time.process_time()
    it.close()
    return t1 - t0, c1 - c0, nbytes


def _spread(values: list[float], fmt: str) -> str:
    """median [min-max]"""
    return f"{fmt.format(median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def throughput(workloads: list[str], workers: int, repeats: int, quick: bool, ray_backend: Any) -> list:
    rows = []
    for name in workloads:
        dataset, batch_size = D.make_workload(name, 0.25 if quick else 1.0)
        n = min(BATCHES[name][1 if quick else 0], len(dataset) // batch_size - 2)
        common: dict[str, Any] = dict(batch_size=batch_size, shuffle=True, seed=0, num_workers=workers,
                                      persistent_workers=True)
        loaders = {"local": mxload.DataLoader(dataset, **common),
                   "ray": mxload.DataLoader(dataset, backend=ray_backend, **common)}
        for loader in loaders.values():   # start the workers; warm caches
            _run(loader, min(4, n))
        results: dict[str, list] = {k: [] for k in loaders}
        for r in range(repeats):
            order = list(loaders) if r % 2 == 0 else list(loaders)[::-1]
            for key in order:
                results[key].append(_run(loaders[key], n))
        for loader in loaders.values():
            loader.close()
        rates = {k: [n / s for s, _, _ in v] for k, v in results.items()}
        # Each round's ratio compares two runs seconds apart, so load that comes and goes on
        # the machine shows as spread instead of moving one backend's median alone.
        ratios = [remote / local for remote, local in zip(rates["ray"], rates["local"])]
        cpu = {k: median([c / n for _, c, _ in v]) for k, v in results.items()}
        nbytes = results["ray"][0][2]
        for key in loaders:
            ratio = "1" if key == "local" else _spread(ratios, "{:.2f}")
            rows.append([name, key, _spread(rates[key], "{:.1f}"), ratio,
                         f"{cpu[key] * 1e3:.1f}", f"{nbytes / 1e6:.2f}"])
    return rows


def latency(workloads: list[str], repeats: int, ray_backend: Any) -> list:
    rows = []
    for name in workloads:
        dataset, batch_size = D.make_workload(name, 0.25)
        per: dict[str, list[float]] = {}
        for key, extra in (("local", {}), ("ray", {"backend": ray_backend})):
            loader = mxload.DataLoader(dataset, batch_size=batch_size, num_workers=1, prefetch=1,
                                       persistent_workers=True, **extra)
            _run(loader, 3)
            times = []
            for _ in range(repeats):
                it = iter(loader)
                for _ in range(8):
                    t0 = time.perf_counter()
                    _touch(next(it))
                    times.append(time.perf_counter() - t0)
                it.close()
            loader.close()
            per[key] = times
        local, remote = median(per["local"]), median(per["ray"])
        rows.append([name, f"{local * 1e3:.1f}", f"{remote * 1e3:.1f}", f"{(remote - local) * 1e3:+.1f}"])
    return rows


def _actor_processes() -> int:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line.startswith("ray::LoaderActor"))


def cycles(count: int, workers: int, ray_backend: Any) -> list:
    import ray
    from ray._private.state import state
    dataset = mxload.ArrayDataset(__import__("numpy").arange(64))
    fds_before = len(os.listdir("/proc/self/fd"))
    t0 = time.perf_counter()
    for _ in range(count):
        for _batch in mxload.DataLoader(dataset, batch_size=2, num_workers=workers, backend=ray_backend):
            break
    elapsed = time.perf_counter() - t0
    gc.collect()
    time.sleep(1.0)
    job = ray.get_runtime_context().get_job_id()
    alive = [a for a in state.actor_table(None).values()
             if a["JobID"] == job and a["State"] != "DEAD" and a["ActorClassName"].endswith("LoaderActor")]
    refs = ray._private.worker.global_worker.core_worker.get_all_reference_counts()
    fds_after = len(os.listdir("/proc/self/fd"))
    return [[str(count), f"{elapsed / count:.2f}", str(len(alive)), str(len(refs)), str(_actor_processes()),
             f"{fds_after - fds_before:+d}"]]


class _Slow:
    """A batch takes `delay` s per sample (the actors are busy when they die)."""

    def __init__(self, delay: float = 0.05, n: int = 10_000):
        self.delay, self.n = delay, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.delay)
        return i


def _time_to_error(loader: Any, kill: Any) -> tuple[float, float]:
    """Seconds from the start and from the end of kill() to the WorkerError
    (killing a node takes a while: Cluster.remove_node waits for its processes)."""
    it = iter(loader)
    next(it), next(it)
    started = time.perf_counter()
    kill()
    killed = time.perf_counter()
    try:
        for _ in it:
            pass
    except mxload.WorkerError:
        now = time.perf_counter()
        return now - started, now - killed
    raise AssertionError("the epoch ended without a WorkerError")


def _row(what: str, times: list[tuple[float, float]]) -> list[str]:
    since_start, since_end = [t[0] for t in times], [t[1] for t in times]
    return [what, f"{median(since_start) * 1e3:.0f} ms", f"{max(since_start) * 1e3:.0f} ms",
            f"{median(since_end) * 1e3:.0f} ms", f"{max(since_end) * 1e3:.0f} ms"]


def deaths(repeats: int) -> list:
    """Seconds from killing an actor's process (local instance, running) or a
    whole node (a simulated 2-node cluster, health checks every 200 ms) to
    the WorkerError in the training loop."""
    import signal

    import ray
    from ray._private.state import state
    from ray.cluster_utils import Cluster
    rows = []
    times = []
    for _ in range(repeats):
        loader = mxload.DataLoader(_Slow(), batch_size=2, num_workers=2,
                                   backend=mxload.RayBackend(num_cpus_per_worker=0.5))

        def kill_actor() -> None:
            job = ray.get_runtime_context().get_job_id()
            pid = next(a["Pid"] for a in state.actor_table(None).values()
                       if a["JobID"] == job and a["State"] == "ALIVE")
            os.kill(int(pid), signal.SIGKILL)
        times.append(_time_to_error(loader, kill_actor))
    rows.append(_row("actor process SIGKILL", times))
    ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 200, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 0}})
    try:
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        times = []
        for _ in range(repeats):
            node = cluster.add_node(num_cpus=2, resources={"bench_remote": 2})
            cluster.wait_for_nodes()
            loader = mxload.DataLoader(_Slow(), batch_size=2, num_workers=2, backend=mxload.RayBackend(
                num_cpus_per_worker=0.5, resources={"bench_remote": 1}))
            def kill_node(node: Any = node) -> None:
                cluster.remove_node(node, allow_graceful=False)
            times.append(_time_to_error(loader, kill_node))
        rows.append(_row("node removed (health checks 200 ms x 3)", times))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


def _ray_logs_to(path: str) -> tuple[Any, Any]:
    """Send everything Ray says to `path`; return the terminal's (stdout, stderr) for our own.

    Ray's daemons (GCS, raylet, workers) inherit descriptors 1 and 2 when ray.init starts
    them and its C++ core writes to them; its driver threads print the cluster's errors
    ("(raylet) ...") and notices to whatever sys.stdout and sys.stderr are at the time.
    So descriptors 1 and 2 and sys.stdout/sys.stderr all become the file, Ray's Python
    loggers and the warnings its modules raise go there too, and this script prints its
    tables and its own errors to copies of the terminal's descriptors."""
    log = open(path, "a", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    err = os.fdopen(os.dup(2), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    handler = logging.StreamHandler(log)
    for name in ("ray", "py.warnings"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
    logging.captureWarnings(True)
    return out, err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workloads", nargs="*", default=["jpeg", "images"])
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--deaths", type=int, default=5, help="times to kill an actor, then a node (0: skip)")
    parser.add_argument("--ray-log", default=os.path.join(tempfile.gettempdir(), "mxload-bench-ray.log"),
                        help="where Ray's own output goes (default: %(default)s)")
    args = parser.parse_args()
    out, err = _ray_logs_to(args.ray_log)
    try:
        _bench(args, out)
    except BaseException:
        traceback.print_exc(file=err)
        raise SystemExit(1) from None


def _bench(args: argparse.Namespace, out: Any) -> None:
    # Ray puts the driver's working directory first on its workers' sys.path: from the
    # repository root (where the README runs this) that is the source folder mxload/, without
    # a compiled core unless built in place, instead of the installed mxload, and every actor
    # fails to start.  Ray starts from an empty folder instead.
    home = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="mxload-bench-ray-") as empty:
        os.chdir(empty)
        try:
            _bench_in(args, out)
        finally:
            os.chdir(home)


def _bench_in(args: argparse.Namespace, out: Any) -> None:
    def print(*what: Any) -> None:   # our output: the terminal, not Ray's log
        builtins.print(*what, file=out)
    repeats = args.repeats or (3 if args.quick else 5)
    import ray
    t0 = time.perf_counter()
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False, configure_logging=False)
    started = time.perf_counter() - t0
    backend = mxload.RayBackend(num_cpus_per_worker=1)
    print(header("bench/ray.py"))
    print(f"# {args.workers} workers; ray {ray.__version__} local instance with {args.workers} CPUs "
          f"(started in {started:.1f} s); medians of {repeats} [min-max]; Ray's own logs: {args.ray_log}")
    try:
        if args.workloads:
            print(table(throughput(args.workloads, args.workers, repeats, args.quick, backend),
                        ["workload", "backend", "b/s", "x local", "trainer ms/b", "MB/b"]))
        if args.workloads and not args.no_latency:
            print()
            print("one worker, prefetch=1: time of next() (ms)")
            print(table(latency(args.workloads, repeats, backend), ["workload", "local", "ray", "added"]))
        if args.cycles:
            print()
            print("create/break cycles (for batch in loader: break)")
            print(table(cycles(args.cycles, args.workers, backend),
                        ["cycles", "s/cycle", "actors alive", "object refs", "actor processes", "fds"]))
        if args.deaths:
            print()
            print("from a death to the WorkerError in the training loop")
            print(table(deaths(args.deaths), ["what died", "from kill: median", "max",
                                              "from its end: median", "max"]))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
