"""Instructions the training process executes per batch, counted by callgrind.

    python bench/instructions.py [--rows 102400] [--runs 5] [--python PYTHON] [--keep DIR]

bench/main_cpu.py's workload (``ArrayDataset.__getitems__``, (1024, 256)
float32 batches, 2 persistent workers).  The main process runs under
``valgrind --tool=callgrind`` twice, taking 1 and then 4 epochs after a
warm-up epoch; the difference, divided by the batches of 3 epochs, is the
cost of one batch without start-up and shutdown.  Reported: ``next()``'s
inclusive instructions (the loader's whole per-batch path in the training
process), and the compiled parts inside it and beside it, as the median and
the range of ``--runs`` such pairs.  One pair varies by several thousand
instructions a batch (how many tasks share a message, and how often the
consumer finds its batch stored rather than receiving it, depend on the
workers' timing): quote the median.  ``--keep DIR`` keeps each run's
callgrind output there, for ``callgrind_annotate``.

Instruction counts do not depend on the machine's load, where CPU times on a
shared 2-core VM vary by 50% from one run to the next: compare two commits
with ``--python`` set to each tree's interpreter, in the same run.  The
workers run as forkserver children, outside valgrind (it does not trace
them, and it cannot run pidfd_open, which the fork start method's zygote
uses).  Needs valgrind and callgrind_annotate (``apt install valgrind``).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import header, table  # noqa: E402

_CHILD = """
import sys
import numpy as np
import mxload
def main():
    rows, epochs = int(sys.argv[1]), int(sys.argv[2])
    ds = mxload.ArrayDataset(np.ones((rows, 256), np.float32), np.arange(rows, dtype=np.int64))
    loader = mxload.DataLoader(ds, batch_size=1024, num_workers=2, persistent_workers=True,
                               start_method="forkserver")
    for _ in loader:
        pass
    n = 0
    for _ in range(epochs):
        for _ in loader:
            n += 1
    loader.close()
    print(n)
if __name__ == "__main__":
    main()
"""

# (label, pattern of the function's name in callgrind_annotate's inclusive
# listing; Cython numbers its wrappers, so the number is matched loosely)
PARTS = [
    ("next(), inclusive", "slot_tp_iternext"),
    ("  receiving (FrameReceiver's next_result)", r"__pyx_f_6mxload_5_core_\d+FrameReceiver__next_result"),
    ("  sending the tasks (send_tasks)", r"__pyx_pw_6mxload_5_core_\d+send_tasks"),
    ("  the batch's views (claim_batch)", r"__pyx_f_6mxload_5_core__claim_batch"),
    ("slab back to the pool (BatchOwner dealloc)", "__pyx_tp_dealloc_6mxload_5_core_BatchOwner"),
]


def _inclusive(annotated: str, function: str) -> int:
    """The first (whole-function) inclusive count of the function whose name
    matches `function`, 0 if absent."""
    pattern = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+\S*:" + function + r" ")
    for line in annotated.splitlines():
        m = pattern.match(line)
        if m:
            return int(m.group(1).replace(",", ""))
    return 0


def count(python: str, rows: int, epochs: int, workdir: str, out: str) -> tuple[str, int]:
    """callgrind_annotate's inclusive listing of one run (its callgrind output in `out`), and its
    batches."""
    script = os.path.join(workdir, "child.py")
    with open(script, "w") as f:
        f.write(_CHILD)
    run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", python, script,
                          str(rows), str(epochs)], capture_output=True, text=True, timeout=1800)
    if run.returncode != 0:
        raise SystemExit(f"valgrind run failed ({run.returncode}):\n{run.stderr[-2000:]}")
    batches = int(run.stdout.split()[-1])
    annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out],
                               capture_output=True, text=True, check=True).stdout
    return annotated, batches


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=102400)
    p.add_argument("--runs", type=int, default=5, help="pairs of runs (the median and range are reported)")
    p.add_argument("--python", default=sys.executable, help="the interpreter (and so the mxload) to count")
    p.add_argument("--keep", metavar="DIR", help="keep each run's callgrind output in DIR")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    for tool in ("valgrind", "callgrind_annotate"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (apt install valgrind)")
    print(header("instructions per batch in the training process (callgrind)"))
    print(f"# counting: {args.python}")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    runs: list[list[float]] = []   # per run: each part's instructions per batch
    with tempfile.TemporaryDirectory() as workdir:
        kept = args.keep or workdir
        for r in range(args.runs):
            short, n1 = count(args.python, args.rows, 1, workdir, os.path.join(kept, f"cg.{r}.1.out"))
            long, n4 = count(args.python, args.rows, 4, workdir, os.path.join(kept, f"cg.{r}.4.out"))
            batches = n4 - n1
            runs.append([(_inclusive(long, fn) - _inclusive(short, fn)) / batches for _, fn in PARTS])
            print(f"# run {r + 1}/{args.runs}: next() {runs[-1][0]:,.0f}", flush=True)
    rows = []
    for k, (label, _) in enumerate(PARTS):
        each = [run[k] for run in runs]
        rows.append([label, f"{statistics.median(each):,.0f}", f"{min(each):,.0f} - {max(each):,.0f}"])
    print(table(rows, ["per batch", f"median of {args.runs}", "range"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
