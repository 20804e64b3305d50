"""Exceptions mxload raises to its users."""
from __future__ import annotations

import multiprocessing
from typing import Any

from ._core import BufferClosedError

__all__ = ["WorkerError", "WorkerTraceback", "LoaderTimeoutError", "SharedMemoryError", "BufferClosedError",
           "EpochAbortedError"]


class WorkerTraceback(Exception):
    """Where an exception raised in a worker came from: its ``__cause__``, so a traceback
    printed in the training process shows the worker's own traceback above the exception
    (as ``concurrent.futures`` shows a remote one).

    Args:
        text (str): which worker, pid and batch, then the worker's formatted traceback.

    Example:
        >>> import mxload.errors
        >>> print(mxload.errors.WorkerTraceback("Raised in worker 0 (pid 7) while loading batch 3."))
        Raised in worker 0 (pid 7) while loading batch 3.
    """


class WorkerError(RuntimeError):
    """A worker died, or raised an exception that cannot be rebuilt as its own type; or the
    dataset raised a ``SystemExit``, ``KeyboardInterrupt`` or ``GeneratorExit`` (in any mode,
    ``num_workers=0`` included: it is that batch's error, its ``__cause__`` the original).

    Raised by the loader's iterator within about a second of a worker's death
    (whatever the `timeout`), unless ``max_worker_restarts`` allows a restart.
    The message names the worker, its pid, how it ended and the batch.

    Args:
        message (str): what happened, where, and what to do.
        worker_id (int | None): the worker's id (0 .. num_workers - 1).
        pid (int | None): its process id.
        exitcode (int | None): its exit status; negative: killed by that signal.
        batch_index (int | None): the batch it was loading.

    Example:
        >>> import mxload
        >>> try:
        ...     raise mxload.WorkerError("worker 1 (pid 4242) was killed by SIGKILL while loading "
        ...                              "batch 7", worker_id=1, pid=4242, exitcode=-9, batch_index=7)
        ... except mxload.WorkerError as e:
        ...     print(e.worker_id, e.exitcode, e.batch_index)
        1 -9 7
    """

    def __init__(self, message: str, worker_id: int | None = None, pid: int | None = None,
                 exitcode: int | None = None, batch_index: int | None = None):
        super().__init__(message)
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        self.batch_index = batch_index

    def __reduce__(self) -> tuple[Any, ...]:  # keep the attributes across pickling
        return (type(self), (self.args[0], self.worker_id, self.pid, self.exitcode, self.batch_index))


# What limits the slabs, and so what to do when they run out (memfd memory is
# not /dev/shm: enlarging /dev/shm changes nothing).
SHARED_MEMORY_ADVICE = (
    "slabs are anonymous memfd memory, limited by RAM and swap, the container's cgroup memory limit "
    "(memory.max) and RLIMIT_AS/RLIMIT_FSIZE, not by the size of /dev/shm: lower prefetch or the batch "
    "size, or give the process more memory")


class SharedMemoryError(WorkerError):
    """Shared memory ran out (a worker got SIGBUS, or a slab could not be allocated).

    A :class:`WorkerError` subclass with the same attributes.  Slabs are
    anonymous memfd memory, limited by RAM, the cgroup memory limit and
    RLIMIT_AS/RLIMIT_FSIZE, not by the size of ``/dev/shm``: lower `prefetch`
    or the batch size, or give the process more memory.

    Example:
        >>> import mxload
        >>> issubclass(mxload.SharedMemoryError, mxload.WorkerError)
        True
    """


class LoaderTimeoutError(TimeoutError, RuntimeError, multiprocessing.TimeoutError):
    """No batch arrived within the loader's `timeout` (a :class:`TimeoutError`).

    Also a ``RuntimeError`` (what torch's DataLoader raises, "DataLoader timed
    out after N seconds") and a ``multiprocessing.TimeoutError`` (what Gluon
    1.9's worker pool raises), so code written against either catches it.

    The message names the batch and the workers still alive.  Raise `timeout`
    (or pass ``timeout=None``) for datasets that are slow on purpose; a dead
    worker is reported as :class:`WorkerError` instead, whatever the timeout.

    Example:
        >>> import time, mxload
        >>> class Stuck(mxload.Dataset):
        ...     def __len__(self):
        ...         return 2
        ...     def __getitem__(self, i):
        ...         time.sleep(5)
        >>> try:
        ...     next(iter(mxload.DataLoader(Stuck(), batch_size=1, num_workers=1, timeout=0.5)))
        ... except mxload.LoaderTimeoutError as e:
        ...     print("timed out:", isinstance(e, TimeoutError))
        timed out: True
    """


class EpochAbortedError(RuntimeError):
    """An epoch can no longer deliver its remaining batches exactly once.

    Raised by ``next()`` after an exception from a signal handler (a program's
    SIGALRM step timeout, Ctrl-C caught and ignored) cut short a step of the
    loader that cannot be retried (handing a task to a worker).  The loader
    goes on after such an exception everywhere else; when it cannot, it says
    so with this error instead of ending the epoch early as if it were
    exhausted.  Also raised by every ``next()`` after an error ended the
    epoch (a worker's death, the loader's timeout), naming it: a signal
    handler's exception may have reached the loop in its place.  The
    batches delivered before are correct; start a new epoch with
    ``iter(loader)`` (a checkpoint from ``state_dict()`` resumes it).

    Example:
        >>> import mxload
        >>> issubclass(mxload.EpochAbortedError, RuntimeError)
        True
    """


class UnpicklablePayloadError(TypeError):
    """The dataset, collate function or worker_init_fn cannot be pickled for spawn or forkserver
    workers (a TypeError, as multiprocessing's own; its cause is pickle's error).  Internal: so
    mxload.torch can warn as torch's DataLoader does before raising it."""
