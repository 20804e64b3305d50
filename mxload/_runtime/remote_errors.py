"""An exception raised in a worker, as the training loop gets it.

Where the exception pickles (ExceptionInfo.of checked the round trip in the worker: as itself,
or as its class, args and attributes without calling its __init__), the loop gets that very
object, its attributes kept, with the worker's traceback as its ``__cause__`` (a
WorkerTraceback) and a note naming the worker, its pid and the batch.  Where it does not
pickle but its class can be imported here and built from a message, it is rebuilt by type and
text.  Otherwise it is a WorkerError naming it.  A StopIteration, or a BaseException that is
not an Exception (SystemExit & co), is then made what the loop can take (batch_errors.py).

The rebuild runs in the receive path: it never raises (one batch's error must never become
the epoch's failure, nor lose its batch), whatever the exception's class does there.
"""
from __future__ import annotations

import importlib
import pickle

from ..errors import WorkerError, WorkerTraceback
from . import messages as m
from .batch_errors import as_loop_error

__all__ = ["rebuild_exception", "unpickled_exception"]


def _worker_words(worker_id: int, pid: int | None) -> str:
    """How an error names a worker: its pid, or (pid None) that it is a thread."""
    return f"worker {worker_id} (pid {pid})" if pid is not None else f"worker {worker_id} (a thread)"


def rebuild_exception(info: m.ExceptionInfo, worker_id: int, pid: int | None,
                      batch_index: int) -> BaseException:
    """The error the loop gets for `info`, raised in worker `worker_id` while loading batch
    `batch_index` (-1: while running worker_init_fn).  Never raises."""
    where = f"loading batch {batch_index}" if batch_index >= 0 else "running worker_init_fn"
    origin = f"Raised in {_worker_words(worker_id, pid)} while {where}."
    cause = WorkerTraceback(f"{origin} Worker traceback:\n{info.traceback}")
    original, why = unpickled_exception(info)
    try:
        if original is not None:
            original.__cause__ = cause
            original.add_note(f"{origin} (The worker's traceback is this exception's cause, above.)")
            return as_loop_error(original, origin, worker_id, pid, batch_index)
        rebuilt = _rebuilt_by_type(info, f"{info.message}\n\n{origin}")
        if rebuilt is not None:
            rebuilt.__cause__ = cause
            return as_loop_error(rebuilt, origin, worker_id, pid, batch_index)
    except BaseException as e:   # noqa: BLE001 - its class refused the note or the cause
        why = f"it refused the note or the cause naming worker and batch ({_failure(e)})"
    error = WorkerError(f"{info.module}.{info.qualname}: {info.message}\n\n{origin} It could not be rebuilt "
                        f"here as its own type" + (f": {why}" if why else "") +
                        f". Worker traceback:\n{info.traceback}",
                        worker_id, pid, None, batch_index if batch_index >= 0 else None)
    error.__cause__ = original if original is not None else cause
    return error


def _failure(error: BaseException) -> str:
    return f"{type(error).__name__}: {m.safe_text(error)}"


def unpickled_exception(info: m.ExceptionInfo) -> tuple[BaseException | None, str]:
    """The exception `info` carries, or None and why not (never raises)."""
    if info.pickled is None:
        return None, ""
    try:
        original = pickle.loads(info.pickled)
    except BaseException as e:   # noqa: BLE001 - SystemExit from a __setstate__ is the exception's, not ours
        return None, f"unpickling it here raised {_failure(e)}"
    if not isinstance(original, BaseException):
        return None, f"it unpickled as a {type(original).__name__}"
    return original, ""


def _rebuilt_by_type(info: m.ExceptionInfo, text: str) -> Exception | None:
    """`info`'s class, imported here, built from `text`; None where that fails or the class
    is not an Exception (a SystemExit & co, whose pickle failed, is a WorkerError naming it)."""
    try:
        kind: object = importlib.import_module(info.module)
        for name in info.qualname.split("."):
            kind = getattr(kind, name)
        if isinstance(kind, type) and issubclass(kind, Exception):
            return kind(text)
    except BaseException:   # noqa: BLE001 - importing or building it may raise anything
        pass
    return None
