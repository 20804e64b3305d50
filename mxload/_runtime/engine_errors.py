"""The engine's error messages: what ended an epoch, in words that name the
worker, its pid and the batch, say what to do, and keep torch's phrases that
programs and people grep logs for."""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from ..errors import EpochAbortedError, LoaderTimeoutError, WorkerError
from . import messages as m
from .remote_errors import unpickled_exception
from .roster import Roster
from .transport import Transport, WorkerLoss

if TYPE_CHECKING:
    from .._options import LoaderOptions


class EngineParts(Protocol):
    """What the engine's error messages read of it (engine.Engine, which imports this module:
    so it is named by what it offers, not by its class)."""

    lock: threading.RLock
    transport: Transport
    roster: Roster
    options: LoaderOptions

    @property
    def epoch(self) -> int: ...


def torch_words(loss: WorkerLoss) -> str:
    """How torch's DataLoader says a worker died: killed by a signal, or exited."""
    if loss.exitcode is not None and loss.exitcode < 0:
        try:
            name = signal.strsignal(-loss.exitcode) or f"signal {-loss.exitcode}"
        except ValueError:
            name = f"signal {-loss.exitcode}"
        return f"DataLoader worker (pid {loss.pid}) is killed by signal: {name}."
    return f"DataLoader worker (pid(s) {loss.pid}) exited unexpectedly:"


def worker_died(loss: WorkerLoss, held: list[int], why_not_restarted: str,
                queued: Sequence[int] = ()) -> WorkerError:
    """A worker that died and is not restarted (`why_not_restarted`: the message's last
    words, "" without max_worker_restarts), holding the tasks of batches `held`; those of
    `queued` were waiting in this process to go to it with a later task."""
    first = held[0] if held else (queued[0] if queued else None)
    return loss.error_type(
        f"{torch_words(loss)} mxload worker {loss.worker_id} (pid {loss.pid}) died ({loss.how}){loss.hint} "
        f"while holding batches {held}" +
        (f" (batches {queued} were queued for it here, not sent yet)" if queued else "") +
        why_not_restarted,
        loss.worker_id, loss.pid, loss.exitcode, first)


def start_failure(failed: m.InitFailed, worker_id: int, pid: int | None) -> WorkerError:
    """A worker process that could not start: a WorkerError (a RuntimeError,
    as torch's for a worker that could not start) with the worker's own error
    text, and what to do about the usual causes."""
    info = failed.error
    hint = ""
    if "__main__" in info.message or "__mp_main__" in info.message or "bootstrapping" in info.message:
        hint = ("\n\nA spawn or forkserver worker imports the main module again, then unpickles the dataset: "
                "classes and functions it uses must be importable (defined in a module, or in a script run "
                "from a file, not with -c or interactively), and the script must start its loaders under "
                "`if __name__ == \"__main__\":`. Or use multiprocessing_context=\"fork\".")
    err = WorkerError(f"mxload worker {worker_id} (pid {pid}) could not start: {failed.starting} raised "
                      f"{info.module}.{info.qualname}: {info.message}{hint}\n\nWorker traceback:\n"
                      f"{info.traceback}", worker_id, pid, None, None)
    original = unpickled_exception(info)[0]
    if original is not None:
        err.__cause__ = original
    return err


def forked_child_error(owner_pid: int) -> RuntimeError:
    """An iterator used in a child that the user's os.fork() made."""
    return RuntimeError(f"this iterator's workers belong to process {owner_pid}, not to this forked child "
                        f"(pid {os.getpid()}); call iter(loader) again in the child to start its own")


def superseded_error() -> RuntimeError:
    """An iterator used after a newer iter() took over its persistent workers."""
    return RuntimeError(
        "this iterator was superseded: a newer iter() of the same DataLoader took over its "
        "persistent workers, which serve one epoch at a time. Finish (or close) an epoch "
        "before starting the next, or use persistent_workers=False for independent "
        "iterators (zip(loader, loader))")


def aborted_error(where: str) -> EpochAbortedError:
    """A signal handler's exception cut short a step that cannot be retried."""
    return EpochAbortedError(
        f"this epoch was aborted: an exception raised inside next() by a signal handler cut short "
        f"{where}, so the epoch's remaining batches can no longer be delivered exactly once. "
        f"Batches delivered before are correct. Start a new epoch with iter(loader) (a checkpoint from "
        f"state_dict() resumes where it stopped); to avoid this, raise from a signal handler only "
        f"outside the loader's code, or set a flag there and act on it in the training loop")


def ended_error(error: BaseException) -> EpochAbortedError:
    """What next() says after `error` (a worker's death, the loader's timeout, the sampler's
    error, whose note names it) ended the epoch:
    the loop may not have seen it (a signal handler's exception can replace it)."""
    notes = "".join(f" ({note})" for note in getattr(error, "__notes__", ()) if isinstance(note, str))
    return EpochAbortedError(
        f"this epoch ended with {type(error).__name__}: {m.safe_text(error)}{notes} -- its remaining batches "
        f"were not delivered. Batches delivered before are correct. Start a new epoch with iter(loader) "
        f"(a checkpoint from state_dict() resumes where it stopped)")


def timeout_error(engine: EngineParts, idx: int) -> LoaderTimeoutError:
    """No batch within the loader's `timeout`: which one was awaited (batch
    `idx`, or any with in_order=False), where its task is, and each live
    worker's (id, pid, state)."""
    transport, options = engine.transport, engine.options
    states = [(wid, transport.pid(wid), transport.describe(wid)) for wid in engine.roster.alive_ids()]
    waited, where = "any batch", ""
    if options.workers.in_order:
        waited = f"batch {idx}"
        with engine.lock:
            holders = engine.roster.holders(engine.epoch, idx)
        if not transport.receiving:
            where = " (the fetcher thread is not running)"
        elif not holders:
            where = " (no worker holds its task: mxload lost track of it; please report this as a bug)"
        else:
            where = "".join(f" (its task is with worker {wid}, pid {transport.pid(wid)})" for wid in holders)
    stopped = any(s.startswith("stopped") for _, _, s in states)
    return LoaderTimeoutError(
        # torch's words first ("DataLoader timed out after N seconds"): programs match them.
        f"DataLoader timed out after {options.workers.timeout} seconds: "
        f"no {waited} within timeout={options.workers.timeout} s{where}; "
        f"workers (id, pid, state): {states}. "
        + ("A stopped worker runs again after SIGCONT (kill -CONT PID). " if stopped else "")
        + "A worker may be stuck in __getitem__; raise `timeout` if batches are "
        "legitimately slow")
