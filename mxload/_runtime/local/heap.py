"""A worker process's heap: freed memory is kept for the next batch, not handed back.

glibc's malloc serves a large block (128 KiB and up at first) with its own
mmap and unmaps it when it is freed; the first free of such a block raises
that threshold to the block's size, and the heap then gives memory back to
the kernel whenever its top has more than twice that free.  A worker that
decodes a batch of images allocates and frees the same tens of MiB every
batch, so either way every batch faults its memory in again from the kernel,
page by page.  Measured (jpeg, 2 workers, 64 batches of 32 per epoch, this
2-core VM): the workers took 15k minor faults in their first epoch, 88k a few
epochs later as the threshold rose, and 148k in every epoch from the start
where the main process had decoded images before the workers were forked
(num_workers="auto"'s in-process probe: the raised threshold is inherited),
an epoch then taking 880-950 ms against 700-740.  With both thresholds fixed
at the start of the worker (a fixed mmap threshold also stops glibc moving
it), the workers took 2-700 faults an epoch from their second epoch and 710
ms, whatever the main process had done.

The price is memory: a worker keeps what it freed, up to its largest batch's
working set (and gives back what is above TRIM_ABOVE_BYTES at the heap's
top); blocks of KEEP_BELOW_BYTES or more still come and go with mmap.
MXLOAD_WORKER_MALLOC=system in the environment leaves glibc's own policy.
"""
from __future__ import annotations

import os
import sys

__all__ = ["KEEP_BELOW_BYTES", "TRIM_ABOVE_BYTES", "keep_freed_memory"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

KEEP_BELOW_BYTES = 32 << 20    # blocks below come from the heap (glibc's largest mmap threshold on 64-bit)
TRIM_ABOVE_BYTES = 256 << 20   # free memory at the heap's top beyond this goes back to the kernel

_OPT_OUT = "MXLOAD_WORKER_MALLOC"


def keep_freed_memory() -> bool:
    """Fix this process's malloc thresholds (see the module's docstring); True if done.
    Nothing on another C library, or with MXLOAD_WORKER_MALLOC=system."""
    if os.environ.get(_OPT_OUT, "").strip().lower() == "system":
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):   # "glibc 2.36"; musl has none
            return False
    except (ValueError, OSError):
        return False
    import ctypes  # (imported here: only a worker process needs it)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on an out-of-range value.
    return (bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW_BYTES))
            and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_ABOVE_BYTES)))
