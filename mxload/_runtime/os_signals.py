"""Signals and /proc as every kind of worker and the epoch use them: what a worker resets of
the training process's signal set-up, Ctrl-C kept off mxload's own threads, a process's state
for error messages, and whether an exception came from a signal handler.  Neutral: it imports
nothing of mxload, so the local and the Ray transports, the worker loop and the epoch share it
without importing one another (docs/design.md, "Layers")."""
from __future__ import annotations

import os
import signal

__all__ = ["CATCHABLE_SIGNALS", "reset_inherited_signals", "block_sigint_in_this_thread", "process_state",
           "raised_by_signal_handler"]

# The signals a handler can be set for, as plain ints (valid_signals() makes an enum of each
# of its ~64 numbers at every call: 0.1-0.3 ms, taken at every worker start).
CATCHABLE_SIGNALS = tuple(int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


def reset_inherited_signals() -> None:
    """In a zygote or worker: undo what the training process set up for
    itself.  Its Python signal handlers (a SIGTERM handler that checkpoints
    and exits, a SIGALRM step timeout) are the training loop's, not ours:
    SIGTERM must end a worker (the shutdown sends it).  And SIGCHLD ignored
    (SIG_IGN, an anti-zombie idiom, inherited through fork and exec) makes
    the kernel discard our children's exit status: the zygote's waitpid
    would fail and the zygote die, and a worker's own subprocesses could
    not be waited for."""
    reset = set()
    for signum in CATCHABLE_SIGNALS:
        try:
            handler = signal.getsignal(signum)
            if callable(handler) or (signum == signal.SIGCHLD and handler == signal.SIG_IGN):
                signal.signal(signum, signal.SIG_DFL)
                reset.add(signum)
        except (OSError, ValueError):
            pass
    # Blocked by the starting thread (sigint_deferred), now at their
    # defaults: a SIGTERM pending since then ends this process, as meant.
    # SIGINT stays blocked until the caller ignores it.
    reset.discard(signal.SIGINT)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, reset)


def block_sigint_in_this_thread() -> None:
    """For mxload's own threads: Ctrl-C is the main thread's business."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


_PROC_STATES = {"T": "stopped (SIGSTOP or a job-control stop)", "t": "stopped by a debugger",
                "D": "in uninterruptible I/O", "Z": "exited, not yet reaped"}


def process_state(pid: int | None) -> str:
    """'alive', or why a live worker process cannot be making progress."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        if os.path.isdir("/proc/self"):
            return "gone (its process has ended)"
        return "alive"   # no /proc (macOS): nothing more to say
    return _PROC_STATES.get(state, "alive")


def raised_by_signal_handler(error: BaseException) -> bool:
    """Whether `error` was raised by (a function called from) a Python signal
    handler installed now: one of its frames runs a handler's code.  Only a
    handler raises in the middle of a dataset's code that is not the
    dataset's doing (a SIGALRM step timeout, a SIGTERM checkpoint-and-exit)."""
    codes = set()
    for signum in CATCHABLE_SIGNALS:
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        code = getattr(getattr(handler, "__func__", handler), "__code__", None)
        if code is not None:
            codes.add(code)
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return False
