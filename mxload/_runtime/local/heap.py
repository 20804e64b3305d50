"""A worker process's heap: freed memory is kept for the next batch, not handed
back, and the objects a fork inherited stay out of the garbage collector's way
(freeze_inherited_objects).

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

import gc
import os
import sys

__all__ = ["KEEP_BELOW_BYTES", "TRIM_ABOVE_BYTES", "freeze_inherited_objects", "keep_freed_memory"]

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


def freeze_inherited_objects() -> None:
    """Keep the objects this process inherited from its parent out of its
    garbage collector's way (first thing in a forked process).

    A forked worker inherits the main process's heap: every module a
    training script imported (torch's are a few hundred thousand objects).
    The worker's full collections walked all of them, and wrote to each
    one's header, so every page of that heap was copied into the worker
    too.  Measured (tabular, 2 forked workers, a main process that had
    imported torch): both workers stopped for 85-120 ms at the same batch of
    the second epoch, the epoch taking 125-181 ms against 38-54 ms; frozen,
    37-49 ms.  Frozen objects are never collected here: cyclic garbage the
    parent left behind stays (it costs nothing unless touched), and what the
    worker itself makes is collected as usual."""
    gc.freeze()
