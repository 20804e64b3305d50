"""A worker process's heap: freed memory is kept for the next batch, not handed
back, and the objects a fork inherited stay out of the garbage collector's way
(freeze_inherited_objects).

glibc's moving malloc thresholds (os_malloc.py) make a worker that decodes a
batch of images fault the same tens of MiB in again every batch.  Measured (jpeg,
2 workers, 64 batches of 32 per epoch, this 2-core VM): the workers took 15k minor
faults in their first epoch, 88k a few epochs later as the threshold rose, and
148k in every epoch from the start where the main process had decoded images
before the workers were forked (num_workers="auto"'s in-process probe: the raised
threshold is inherited), an epoch then taking 880-950 ms against 700-740.  With
both thresholds fixed at the start of the worker (a fixed mmap threshold also
stops glibc moving it), the workers took 2-700 faults an epoch from their second
epoch and 710 ms, whatever the main process had done.

The price is memory: a worker keeps what it freed, up to its largest batch's
working set (and gives back what is above TRIM_ABOVE_BYTES at the heap's
top); blocks of KEEP_BELOW_BYTES or more still come and go with mmap.
MXLOAD_WORKER_MALLOC=system (or MXLOAD_MALLOC=system) in the environment leaves
glibc's own policy, and so does a policy the program set (MALLOC_*_, GLIBC_TUNABLES).
"""
from __future__ import annotations

import gc

from .. import os_malloc

__all__ = ["KEEP_BELOW_BYTES", "TRIM_ABOVE_BYTES", "freeze_inherited_objects", "keep_freed_memory"]

KEEP_BELOW_BYTES = os_malloc.GLIBC_LARGEST_MMAP_THRESHOLD   # blocks below come from the heap
TRIM_ABOVE_BYTES = 256 << 20   # free memory at the heap's top beyond this goes back to the kernel

_OPT_OUT = "MXLOAD_WORKER_MALLOC"


def keep_freed_memory() -> bool:
    """Fix this worker process's malloc thresholds (see the module's docstring); True if done.
    Nothing on another C library, with MXLOAD_WORKER_MALLOC=system or MXLOAD_MALLOC=system, or
    where the program set its own policy (MALLOC_*_, GLIBC_TUNABLES: glibc applied it at start)."""
    return os_malloc.keep_freed_memory(KEEP_BELOW_BYTES, TRIM_ABOVE_BYTES, _OPT_OUT)


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
