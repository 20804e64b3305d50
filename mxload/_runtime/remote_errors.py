"""An exception raised in a worker, as the training loop gets it.

Where the exception pickles (ExceptionInfo.of checked the round trip in the worker), the
loop gets that very object, its attributes kept, with the worker's traceback as its
``__cause__`` (a WorkerTraceback) and a note naming the worker, its pid and the batch.
Where it does not pickle but its class can be imported here and built from a message, it is
rebuilt by type and text.  Otherwise, and for a BaseException that is not an Exception
(SystemExit & co: raised in the training loop they would end the program), it is a
WorkerError naming it.
"""
from __future__ import annotations

import importlib
import pickle

from ..errors import WorkerError, WorkerTraceback
from . import messages as m

__all__ = ["rebuild_exception"]


def rebuild_exception(info: m.ExceptionInfo, worker_id: int, pid: int | None,
                      batch_index: int) -> BaseException:
    where = f"loading batch {batch_index}" if batch_index >= 0 else "running worker_init_fn"
    origin = f"Raised in worker {worker_id} (pid {pid}) while {where}."
    cause = WorkerTraceback(f"{origin} Worker traceback:\n{info.traceback}")
    original = _unpickled(info)
    if isinstance(original, Exception):
        original.add_note(f"{origin} (The worker's traceback is this exception's cause, above.)")
        original.__cause__ = cause
        return original
    if original is None:
        rebuilt = _rebuilt_by_type(info, f"{info.message}\n\n{origin}")
        if rebuilt is not None:
            rebuilt.__cause__ = cause
            return rebuilt
    error = WorkerError(f"{info.module}.{info.qualname}: {info.message}\n\n{origin} Worker traceback:\n"
                        f"{info.traceback}", worker_id, pid, None, batch_index if batch_index >= 0 else None)
    error.__cause__ = original if original is not None else cause
    return error


def _unpickled(info: m.ExceptionInfo) -> BaseException | None:
    if info.pickled is None:
        return None
    try:
        original = pickle.loads(info.pickled)
    except Exception:
        return None
    return original if isinstance(original, BaseException) else None


def _rebuilt_by_type(info: m.ExceptionInfo, text: str) -> Exception | None:
    """`info`'s class, imported here, built from `text`; None where that fails or the class
    is not an Exception."""
    try:
        kind: object = importlib.import_module(info.module)
        for name in info.qualname.split("."):
            kind = getattr(kind, name)
        if isinstance(kind, type) and issubclass(kind, Exception):
            return kind(text)
    except Exception:
        pass
    return None
