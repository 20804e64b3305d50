"""What this machine allows a multi-process loader, whatever the loader.

    python bench/machine_limits.py [--seconds 4] [--workloads images tabular tabular-getitems jpeg]

Two measurements that bound bench/main_cpu.py and bench/loader.py from below
and above:

* wake-up floor: CPU time (of the waiting thread alone) of one round trip to
  another process that answers after 250 us of work: a 1-byte send, a sleep
  in recv() (or in poll() then recv()), a wake-up.  A training process that
  takes batches faster than its workers make them waits like this once per
  batch, so no loader's main-process CPU per batch can go below it there;
* two-process scaling: batches/s of one process loading a workload in
  process (mxload, 0 workers), then of two such processes at once (their
  sum).  The ratio is the most any 2 workers can gain over 0 workers on
  this machine before the hand-off costs anything: memory-bound workloads
  share the memory bandwidth (and the two vCPUs may share a core).  jpeg
  (decode-bound; with pillow) says what bench/loader.py's 90%-of-2x target
  for it can reach here.

Medians of `--repeats` runs; the order of single and paired runs alternates.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import header, median, table  # noqa: E402

ANSWER_AFTER_S = 250e-6


def _answer(sock: socket.socket) -> None:
    """The other process: answer each byte after ANSWER_AFTER_S of work."""
    while True:
        data = sock.recv(64)
        if not data:
            os._exit(0)
        end = time.perf_counter() + ANSWER_AFTER_S
        while time.perf_counter() < end:
            pass
        sock.send(data)


def wake_floor_us(rounds: int, use_poll: bool) -> float:
    """CPU us of the waiting thread per round trip."""
    import select
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        mine.close()
        _answer(theirs)
    theirs.close()
    try:
        poller = select.poll()
        poller.register(mine, select.POLLIN)
        c0 = time.thread_time_ns()
        for _ in range(rounds):
            mine.send(b"x")
            if use_poll:
                poller.poll()
            mine.recv(64)
        return (time.thread_time_ns() - c0) / rounds / 1e3
    finally:
        mine.close()
        os.waitpid(pid, 0)


_LOAD = """
import sys, time, mxload
from mxload import synthetic
ds, bs = synthetic.make_workload(sys.argv[1])
loader = mxload.DataLoader(ds, batch_size=bs, num_workers=0)
it = iter(loader)
for _ in range(3):
    next(it)
print("ready", flush=True)
sys.stdin.readline()   # every copy starts its window at once: the windows overlap whole
t0 = time.perf_counter(); n = 0
while time.perf_counter() - t0 < float(sys.argv[2]):
    try:
        next(it)
    except StopIteration:
        it = iter(loader)
        continue
    n += 1
print(n / (time.perf_counter() - t0))
"""


def in_process_bps(workload: str, seconds: float, copies: int) -> float:
    """Summed batches/s of `copies` processes loading `workload` at once with 0 workers.  Each
    builds its dataset and warms up first; then all start their timed window together (a
    process still building its dataset while another measured left the other one's window
    partly alone on the machine: the sum came out above what two loaders at once can reach)."""
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD, workload, str(seconds)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(copies)]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {workload} limit process failed before its window")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        total = 0.0
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 120)
            total += float(out.strip())
        return total
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _default_workloads() -> list[str]:
    """The memory-bound rows, and the decode-bound one where pillow is installed."""
    try:
        import PIL  # noqa: F401
    except ImportError:
        return ["images", "tabular", "tabular-getitems"]
    return ["images", "tabular", "tabular-getitems", "jpeg"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0, help="per in-process run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4000, help="round trips per wake-up measurement")
    p.add_argument("--workloads", nargs="+", default=_default_workloads())
    args = p.parse_args(argv)
    print(header("machine limits: wake-up floor and two-process scaling"))
    floors = {"recv": [], "poll + recv": []}
    for _ in range(args.repeats):
        floors["recv"].append(wake_floor_us(args.rounds, False))
        floors["poll + recv"].append(wake_floor_us(args.rounds, True))
    print()
    print(table([[k, f"{median(v):.1f}", f"{min(v):.1f}"] for k, v in floors.items()],
                ["wait", "CPU us per round trip (median)", "min"]))
    rows = []
    for w in args.workloads:
        one, two = [], []
        for r in range(args.repeats):
            order = [(1, one), (2, two)] if r % 2 == 0 else [(2, two), (1, one)]
            for copies, into in order:
                into.append(in_process_bps(w, args.seconds, copies))
        rows.append([w, f"{median(one):.0f}", f"{median(two):.0f}", f"{median(two) / median(one):.2f}x"])
    print()
    print(table(rows, ["workload", "1 process b/s", "2 processes b/s (sum)", "scaling"]))
    print("# scaling: the most 2 workers can gain over 0 workers on this machine for that workload")
    return 0


if __name__ == "__main__":
    sys.exit(main())
