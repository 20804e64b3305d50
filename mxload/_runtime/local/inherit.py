"""A spawn or forkserver worker's payload (dataset, batchify_fn, worker_init_fn), pickled once
for all workers as multiprocessing pickles a Process's arguments.

multiprocessing's synchronisation objects and shared memory (``Lock``, ``Semaphore``,
``Event``, ``Condition``, ``Value``, ``Array``) refuse to be pickled except while a process is
being started ("should only be shared between processes through inheritance"): multiprocessing
then has a "spawning" Popen that passes what they need to the child.  torch's DataLoader gives
its dataset to ``Process(args=...)``, so a dataset holding a ``Value`` works there with every
start method.  mxload pickles the payload itself, once, so it stands in for that Popen while it
does: the locks travel by name (as multiprocessing's do on POSIX), and the descriptors of
``Value``/``Array`` memory are collected here and passed to each worker with its payload
(SCM_RIGHTS in a spawn worker's Handover; in the arguments multiprocessing's fork server
passes, for a forkserver worker).  The worker unpickles with them at hand.
"""
from __future__ import annotations

import copyreg
import io
import os
import pickle
from multiprocessing import context, reduction
from typing import Any

__all__ = ["ForChild", "pickle_payload", "unpickle_payload"]

# The descriptors a worker received with its payload, while unpickling it (PassedFd reads them).
_received: list[int] = []


class PassedFd:
    """Where a descriptor of the payload's went: its index in what the worker receives.  As
    multiprocessing's own spawn does, detach() in the worker gives the descriptor (a copy of the
    one received: a descriptor shared by two objects is detached once by each)."""

    def __init__(self, index: int):
        self.index = index

    def detach(self) -> int:
        return os.dup(_received[self.index])


class _SpawningStandIn:
    """multiprocessing's spawning Popen, as far as pickling asks it: descriptors are collected
    for passing (duplicate_for_child) and stand for themselves by index (DupFd)."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1

    def DupFd(self, index: int) -> PassedFd:  # noqa: N802  (multiprocessing's name)
        return PassedFd(index)


def pickle_payload(payload: Any) -> tuple[bytes, list[int]]:
    """`payload` pickled for any number of workers, and the descriptors each must receive with
    it (those of multiprocessing shared memory it holds; the caller keeps them open)."""
    stand_in = _SpawningStandIn()
    # This thread's only: another thread's pickling is unaffected.  (typeshed names the Popen types.)
    context.set_spawning_popen(stand_in)  # type: ignore[arg-type]
    try:
        out = io.BytesIO()
        pickler = pickle.Pickler(out, pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = {**copyreg.dispatch_table, **_multiprocessing_reducers()}
        pickler.dump(payload)
    finally:
        context.set_spawning_popen(None)
    return out.getvalue(), stand_in.fds


def _multiprocessing_reducers() -> dict[type, Any]:
    """The reducers multiprocessing registered with its pickler (shared memory's arenas, ctypes
    in it, sockets, connections).  Only multiprocessing's own: torch registers its tensors'
    there too, which would move a dataset's tensors to shared memory and hold a descriptor for
    each (the "too many open files" of torch's spawn workers); here they are pickled, copied,
    as before."""
    reducers = getattr(reduction.ForkingPickler, "_extra_reducers", {})
    return {kind: reduce for kind, reduce in reducers.items()
            if getattr(reduce, "__module__", "").startswith("multiprocessing.")}


def unpickle_payload(data: bytes, fds: list[int]) -> Any:
    """The payload, in a worker, from its pickle and the descriptors that came with it (closed
    here: what the payload keeps are its own copies)."""
    global _received
    _received = fds
    try:
        return pickle.loads(data)
    finally:
        _received = []
        for fd in fds:
            os.close(fd)


class ForChild:
    """Descriptors to pass to a forkserver worker in its Process arguments: multiprocessing's
    own spawning Popen passes them, and the worker finds them as a list of its descriptors."""

    def __init__(self, fds: list[int]):
        self.fds = fds

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _detach_all, (tuple(reduction.DupFd(fd) for fd in self.fds),)


def _detach_all(passed: tuple[Any, ...]) -> list[int]:
    return [p.detach() for p in passed]
