"""What profiling costs: the tabular workload, 2 workers, profile=True vs False.

    python bench/profile_overhead.py [--repeats 15] [--batches 150]

Both loaders use persistent workers (so process start-up is not measured) and
run interleaved, the order rotating every round, so drift on a noisy machine
hits both alike.  Reports batches/s medians and the ratio.  profile=False
costs one `is not None` test per batch in the consumer and one flag per task
message; profile=True adds the per-batch records and per-field timings.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import header, median, table  # noqa: E402

import mxload  # noqa: E402
from mxload import synthetic  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(header("mxload profiler overhead (tabular workload)"))
    dataset, batch_size = synthetic.make_workload("tabular", 0.5)
    # One loader, the same worker processes and slabs for both settings; the
    # profiler is switched on and off between runs.
    loader = mxload.DataLoader(dataset, batch_size=batch_size, shuffle=True, seed=0,
                               num_workers=args.workers, persistent_workers=True)

    def one_run(profiled: bool) -> float:
        loader.profiler = mxload.Profiler() if profiled else None
        t0 = time.perf_counter()
        done = 0
        while done < args.batches:
            for batch in loader:
                batch[0][-1, -1]   # touch the batch
                done += 1
                if done == args.batches:
                    break
        return args.batches / (time.perf_counter() - t0)

    rates: dict = {"profile=False": [], "profile=True": []}
    one_run(False)
    one_run(True)           # warm-up: slabs created and mapped everywhere
    for r in range(args.repeats):
        for profiled in ((False, True) if r % 2 == 0 else (True, False)):
            rates[f"profile={profiled}"].append(one_run(profiled))
    loader.close()
    off, on = median(rates["profile=False"]), median(rates["profile=True"])
    # Paired: each round ran both settings back to back, so the per-round
    # ratio cancels the machine's drift between rounds.
    paired = median([t / f for t, f in zip(rates["profile=True"], rates["profile=False"])])
    rows = [[name, f"{median(v):.0f}", f"{min(v):.0f}..{max(v):.0f}"] for name, v in rates.items()]
    print(table(rows, ["loader", "batches/s (median)", "min..max"]))
    print(f"\nprofile=True / profile=False throughput: {on / off:.3f} (medians), "
          f"{paired:.3f} (median of {args.repeats} paired rounds)")
    print(f"overhead of profile=True: {100 * (1 - paired):+.1f}% (target <= 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
