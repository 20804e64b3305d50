"""Exceptions mxload raises to its users."""
from __future__ import annotations

from typing import Any

from ._core import BufferClosedError

__all__ = ["WorkerError", "LoaderTimeoutError", "SharedMemoryError", "BufferClosedError"]


class WorkerError(RuntimeError):
    """A worker died, or raised an exception that cannot be rebuilt as its own type.

    Attributes: worker_id, pid, exitcode (negative: killed by that signal), batch_index."""

    def __init__(self, message: str, worker_id: int | None = None, pid: int | None = None,
                 exitcode: int | None = None, batch_index: int | None = None):
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        self.batch_index = batch_index

    def __reduce__(self) -> tuple[Any, ...]:  # keep the attributes across pickling
        return (type(self), (self.args[0], self.worker_id, self.pid, self.exitcode, self.batch_index))


class SharedMemoryError(WorkerError):
    """Shared memory ran out (a worker got SIGBUS, or a slab could not be allocated)."""


class LoaderTimeoutError(TimeoutError):
    """No batch arrived within the loader's `timeout`."""
