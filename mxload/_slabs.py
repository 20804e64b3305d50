"""Shared-memory slabs: creation (anonymous memfd) and the main process's pool.

A slab is one anonymous shared-memory file mapped by the main process and by
the workers.  Anonymous (memfd_create) memory has no name in /dev/shm, so it
cannot leak: the kernel frees it when the last descriptor and mapping are
gone, even if the whole process tree is SIGKILLed.
"""
from __future__ import annotations

import collections
import os
import secrets

from ._core import Slab
from .errors import SharedMemoryError

_PAGE = 4096
_GRANULE = 64 * 1024


def slab_size_for(nbytes: int, current: int = 0) -> int:
    """Size of a new slab that must hold `nbytes`: rounded up, and grown by at
    least 1/8 over a slab found too small so ragged batches settle quickly."""
    want = max(nbytes, current + current // 8)
    return max(_GRANULE, -(-want // _GRANULE) * _GRANULE)


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
        raise SharedMemoryError(f"could not create shared memory: {e}; too many open files or "
                                f"shared memory exhausted") from e
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        os.close(fd)
        raise SharedMemoryError(
            f"could not allocate {size} bytes of shared memory ({e}); shared memory ran out: "
            f"lower prefetch or the batch size, or enlarge /dev/shm") from e
    return fd


def map_slab(fd: int, size: int, slab_id: object = None, populate: bool = False) -> Slab:
    """Map `fd` as a Slab (translating mmap failures into SharedMemoryError)."""
    actual = os.fstat(fd).st_size
    if actual < size:  # touching the missing tail would be a SIGBUS
        raise SharedMemoryError(f"shared memory object has {actual} bytes, {size} expected")
    try:
        return Slab(fd, size, slab_id, populate)
    except OSError as e:
        raise SharedMemoryError(str(e)) from e


class SlabPool:
    """The main process's slabs: who owns which descriptor, which are free.

    `release` is called from BatchOwner finalizers on any thread (when the
    consumer drops a batch); it only appends to a deque, which is atomic, so
    it needs no lock and cannot deadlock against the dispatcher."""

    def __init__(self, stats: dict[str, int]):
        self._free: collections.deque[Slab] = collections.deque()
        self._slabs: dict[int, Slab] = {}
        self._fds: dict[int, int] = {}
        self._next_id = 0
        self._closed = False
        self.stats = stats

    def adopt(self, fd: int, size: int) -> Slab:
        """Take ownership of a descriptor (received from a worker); map it."""
        slab_id = self._next_id
        self._next_id += 1
        try:
            slab = map_slab(fd, size, slab_id)
        except BaseException:
            os.close(fd)
            raise
        self._slabs[slab_id] = slab
        self._fds[slab_id] = fd
        self.stats["slabs_created"] += 1
        return slab

    def acquire(self) -> Slab | None:
        """A free slab, or None (the worker then makes a new one)."""
        while self._free:
            slab = self._free.popleft()
            if slab.slab_id in self._slabs:
                self.stats["slabs_reused"] += 1
                return slab
        return None

    def release(self, slab: Slab) -> None:
        if not self._closed and slab.slab_id in self._slabs:
            self._free.append(slab)

    def retire(self, slab: Slab) -> None:
        """Forget a slab (too small): its memory goes when its last view does."""
        if self._slabs.pop(slab.slab_id, None) is not None:
            os.close(self._fds.pop(slab.slab_id))
            self.stats["slabs_retired"] += 1

    def fd(self, slab_id: int) -> int:
        return self._fds[slab_id]

    def get(self, slab_id: int) -> Slab:
        return self._slabs[slab_id]

    def __len__(self) -> int:
        return len(self._slabs)

    def close(self) -> None:
        """Close every descriptor.  Mappings still viewed by live batches stay
        valid until those batches are freed; nothing is recycled any more."""
        self._closed = True
        self._free.clear()
        fds, self._fds = self._fds, {}
        self._slabs = {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
