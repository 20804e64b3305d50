"""glibc's malloc thresholds, fixed so a process that loads batches reuses the memory it frees.

glibc's malloc serves a large block (128 KiB and up at first) with its own mmap and unmaps it
when it is freed; the first free of such a block raises that threshold to the block's size (at
most GLIBC_LARGEST_MMAP_THRESHOLD, 32 MiB on 64-bit) and the trim threshold to twice it, and
the heap then gives memory back to the kernel whenever its top has more than that free.  Loading
a batch of images allocates and frees the same tens of MiB every batch, in blocks of a few
hundred KiB: under those moving thresholds every batch faults its memory in again, page by page.

Two settings, one per kind of process:

* a worker process (local/heap.py): both thresholds fixed at its start, the trim one high
  (heap.TRIM_ABOVE_BYTES): the worker is mxload's and does nothing but load batches;
* the training process, when an epoch first starts loading there (no workers, auto's
  probe, thread workers): fixed at the largest values glibc's own policy reaches after one
  free of a 32 MiB block (TRAINING_TRIM_ABOVE_BYTES), so the program never keeps more freed
  memory than glibc itself would let it once it has freed one large tensor, as a training
  program does early.  Measured (bench/peers.py's augment, 0 workers, this 2-core VM):
  4,672 minor faults and 8-10 ms of system time a batch of 32, 28-30 batches/s, became
  0 faults and 53 batches/s; jpeg 50 -> 53-56 batches/s.

Nothing is changed where the program chose its own policy (glibc's MALLOC_* or
GLIBC_TUNABLES malloc settings in the environment), on another C library, or with
MXLOAD_MALLOC=system in the environment (MXLOAD_WORKER_MALLOC=system: the workers only).
It imports nothing of mxload: a leaf beside os_signals and os_threads.
"""
from __future__ import annotations

import os
import sys
import threading

__all__ = ["GLIBC_LARGEST_MMAP_THRESHOLD", "TRAINING_TRIM_ABOVE_BYTES", "fix_thresholds", "keep_freed_memory",
           "keep_freed_memory_in_training_process", "opted_out", "program_chose_its_own"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

GLIBC_LARGEST_MMAP_THRESHOLD = 32 << 20    # blocks below come from the heap; above, mmap as always
TRAINING_TRIM_ABOVE_BYTES = 2 * GLIBC_LARGEST_MMAP_THRESHOLD   # glibc's own largest trim threshold

OPT_OUT = "MXLOAD_MALLOC"

_training_process_done: bool | None = None   # once per process: the first epoch loading here decides
_training_lock = threading.Lock()


def opted_out(*variables: str) -> bool:
    """Whether any of `variables` (and MXLOAD_MALLOC) says "system" in the environment."""
    return any(os.environ.get(v, "").strip().lower() == "system" for v in (OPT_OUT, *variables))


def program_chose_its_own() -> bool:
    """glibc reads these at start-up: a program (or its launcher) that set one chose its policy."""
    if "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return True
    return any(name.startswith("MALLOC_") and name.endswith("_") for name in os.environ)


def fix_thresholds(mmap_below: int, trim_above: int) -> bool:
    """Fix this process's malloc thresholds; True if done (glibc only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        if not getattr(os, "confstr", lambda _: None)("CS_GNU_LIBC_VERSION"):   # "glibc 2.36"; musl: none
            return False
    except (ValueError, OSError):
        return False
    import ctypes  # (imported here: only a process that loads batches needs it)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on an out-of-range value.
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_below)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_above))


def keep_freed_memory(mmap_below: int, trim_above: int, *opt_outs: str) -> bool:
    """fix_thresholds, unless MXLOAD_MALLOC or one of `opt_outs` says "system" or the program
    chose its own policy; True if done."""
    if opted_out(*opt_outs) or program_chose_its_own():
        return False
    return fix_thresholds(mmap_below, trim_above)


def keep_freed_memory_in_training_process() -> bool:
    """The training process's thresholds (see the module's docstring), fixed once per process,
    when an epoch starts loading in it (iter() with 0 workers, auto's probe, thread workers
    starting); True if they are fixed (now or before)."""
    global _training_process_done
    with _training_lock:
        if _training_process_done is None:
            _training_process_done = keep_freed_memory(GLIBC_LARGEST_MMAP_THRESHOLD,
                                                       TRAINING_TRIM_ABOVE_BYTES)
        return _training_process_done
