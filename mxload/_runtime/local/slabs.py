"""Shared-memory slabs: creation (anonymous memfd) and the main process's pool.

A slab is one anonymous shared-memory file mapped by the main process and by
the workers.  Anonymous (memfd_create) memory has no name in /dev/shm, so it
cannot leak: the kernel frees it when the last descriptor and mapping are
gone, even if the whole process tree is SIGKILLed.
"""
from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Callable, Collection

from ..._collate.plan import SLAB_GRANULE
from ..._core import BatchLender, FreeSlabs, Slab
from ...errors import SHARED_MEMORY_ADVICE, SharedMemoryError, WorkerError
from . import fds as _fds

_PAGE = 4096

# A training loop that keeps this many batches alive (their slabs lent to it) keeps batches, not
# just the one in hand and a few in flight to an accelerator: from then on, a batch of at most
# COPY_KEPT_MAX_BYTES (smaller than the smallest slab) is copied out of its slab, which is freed at
# once (see BatchLender).  Larger batches keep their slab (a copy's cost grows with the batch,
# what a slab wastes does not).
COPY_KEPT_FROM = 32
COPY_KEPT_MAX_BYTES = SLAB_GRANULE


def create_shared_fd(size: int) -> int:
    """A file descriptor of `size` bytes of anonymous shared memory."""
    try:
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("mxload-slab", os.MFD_CLOEXEC)
        else:  # pragma: no cover - non-Linux: POSIX shm, unlinked at once
            import _posixshmem  # type: ignore[import-not-found]  # CPython-internal, no stubs
            name = "/mxload-" + secrets.token_hex(8)
            fd = _posixshmem.shm_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            _posixshmem.shm_unlink(name)
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise fd_limit_error("creating a shared-memory slab") from e
        raise SharedMemoryError(f"could not create shared memory: {e}; shared memory exhausted") from e
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        os.close(fd)
        raise SharedMemoryError(
            f"could not allocate {size} bytes of shared memory ({e}); shared memory ran out: "
            f"{SHARED_MEMORY_ADVICE}") from e
    return fd


def map_slab(fd: int, size: int, slab_id: object = None, populate: bool = False) -> Slab:
    """Map `fd` as a Slab (translating mmap failures into SharedMemoryError)."""
    actual = os.fstat(fd).st_size
    if actual < size:  # touching the missing tail would be a SIGBUS
        raise SharedMemoryError(f"shared memory object has {actual} bytes, {size} expected")
    try:
        return Slab(fd, size, slab_id, populate)
    except OSError as e:
        if e.errno == errno.ENOMEM:
            raise SharedMemoryError(_mmap_enomem_message(size)) from e
        raise SharedMemoryError(f"{e}; {SHARED_MEMORY_ADVICE}") from e


def fd_limit_error(doing: str, error_type: type[WorkerError] = SharedMemoryError) -> WorkerError:
    """The error for running out of descriptors: which limit, and what to do
    (a SharedMemoryError for a slab's descriptor, else `error_type`)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        limit = f"RLIMIT_NOFILE allows {soft} (hard limit {hard})"
    except (ImportError, OSError, ValueError):  # pragma: no cover - non-POSIX
        limit = "the process's descriptor limit (RLIMIT_NOFILE) is reached"
    try:
        n_open = f"{len(os.listdir('/proc/self/fd'))} are open"
    except OSError:  # pragma: no cover - no /proc
        n_open = "the table is full"
    return error_type(
        f"out of file descriptors while {doing} (pid {os.getpid()}): {n_open} and {limit}. "
        f"Raise the limit (`ulimit -n`, resource.setrlimit) or close descriptors the program keeps")


def _mmap_enomem_message(size: int) -> str:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            max_maps = int(f.read())
        with open("/proc/self/maps") as f:
            n_maps = sum(1 for _ in f)
    except (OSError, ValueError):  # pragma: no cover - no /proc
        max_maps = n_maps = 0
    if max_maps and n_maps >= max_maps - 16:
        return (f"mapping a {size}-byte slab failed: the process has {n_maps} memory mappings and "
                f"vm.max_map_count is {max_maps}. Keep fewer batches alive (each kept batch maps "
                f"its slab), or raise it: sysctl -w vm.max_map_count={2 * max_maps}")
    return (f"mapping a {size}-byte slab failed: out of memory ({n_maps} mappings, "
            f"vm.max_map_count {max_maps}). Keep fewer batches alive; {SHARED_MEMORY_ADVICE}")


class SlabPool:
    """The main process's slabs: which are pooled (recycled, and sent again
    to workers that have not mapped them yet, so their descriptor is kept),
    which are free.

    At most `max_fds` slabs are pooled.  A slab beyond that (the consumer
    keeps many batches alive) is one-shot: its descriptor is closed as soon
    as it is mapped, and its memory goes when its batch's views die, so kept
    batches cost a mapping each, never a descriptor.

    `acquire` (the task send's, once per task) and `release` (from
    BatchOwner finalizers on any thread, when the consumer drops a batch)
    are the compiled FreeSlabs's: each one C call with the GIL held, so
    they need no lock and cannot deadlock against the dispatcher."""

    def __init__(self, max_fds: int):
        self._slabs: dict[int, Slab] = {}
        self._fds: dict[int, int] = {}
        self._next_id = 0
        self._closed = False
        self.max_fds = max_fds
        self.counts = {"slabs_created": 0, "slabs_reused": 0, "slabs_retired": 0, "batches_copied": 0}
        self._free = FreeSlabs(self._slabs, self.counts)
        # A free slab, or None (the worker then makes a new one): one of the ids the worker maps
        # (its known_slabs) before any other.
        self.acquire: Callable[[Collection[int] | None], Slab | None] = self._free.acquire
        # `slab` is free again (unused, or a batch's last view died).
        self.release: Callable[[Slab], None] = self._free.release
        # The owner of a batch handed to the training loop: its slab's, or a copy's where the loop
        # keeps many (see COPY_KEPT_FROM).
        self.lender = BatchLender(self._free, self.counts, COPY_KEPT_FROM, COPY_KEPT_MAX_BYTES)

    def adopt(self, fd: int, size: int) -> Slab:
        """Take ownership of a descriptor (received from a worker); map it."""
        slab_id = self._next_id
        self._next_id += 1
        try:
            slab = map_slab(fd, size, slab_id)
        except BaseException:
            os.close(fd)
            raise
        self.counts["slabs_created"] += 1
        if self._closed or len(self._fds) >= self.max_fds:
            os.close(fd)   # one-shot: the mapping alone keeps the memory
            return slab
        _fds.own(fd)
        self._slabs[slab_id] = slab
        self._fds[slab_id] = fd
        return slab

    def trim(self, keep: int) -> list[Slab]:
        """Take the free slabs no batch needed since the last trim, beyond the
        first `keep`, out of the free list, for the caller to retire."""
        return self._free.trim(keep)

    def retire(self, slab: Slab) -> None:
        """Forget a slab (too small): its memory goes when its last view does."""
        if self._slabs.pop(slab.slab_id, None) is not None:
            _fds.close_fd(self._fds.pop(slab.slab_id))
            self.counts["slabs_retired"] += 1

    def fd(self, slab_id: int) -> int:
        """The descriptor of a pooled slab, to pass to a worker.  OSError
        (EBADF) once close() ran: another thread may close the pool while
        the consumer is between acquire() and fd(); the send then ends as
        for a gone worker, with the epoch."""
        fd = self._fds.get(slab_id)
        if fd is None:
            raise OSError(errno.EBADF, f"slab {slab_id}'s descriptor is closed: the slab pool was closed")
        return fd

    def get(self, slab_id: int) -> Slab:
        return self._slabs[slab_id]

    def __len__(self) -> int:
        return len(self._slabs)

    def close(self) -> None:
        """Close every descriptor.  Mappings still viewed by live batches stay
        valid until those batches are freed; nothing is recycled any more."""
        self._closed = True
        self._free.close()
        fds, self._fds = self._fds, {}
        self._slabs.clear()
        for fd in fds.values():
            _fds.close_fd(fd)
