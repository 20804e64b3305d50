"""mxload's own threads as the kernel sees them, so a fork that follows them draws no warning.

Python 3.12+ warns when os.fork() runs in a process with more than one thread, and
it counts the kernel's threads (/proc/self/stat), not Python's.  A thread that
Python has joined (a stopped fetcher) still runs its last instructions in the
kernel for a moment, longer on a busy machine, and a wait that only looked for the
count to hold steady (a few ms) could end before it was gone (CI warned once on
3.13; not reproduced locally, so this rests on how the count works).  So every
thread mxload starts is recorded by its native id, and before forking the zygote
waits, with a deadline, until each one Python has seen end is gone from
/proc/self/task.  Threads mxload did not start (a user's just-joined thread) get
a bounded heuristic: wait while the kernel counts more threads than Python knows,
until that count holds steady (a native pool such as BLAS never leaves).

Python counts after the fork, and fork handlers run in between: OpenBLAS's stops
its pool and joins it, and a thread it joined may still be leaving the kernel when
Python counts.  So a warning is dropped only when Python knew no thread but this
one at the fork and the kernel's count falls to one within ENDING_GRACE_S: every
thread counted was already ending.  A thread that lives on keeps it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import warnings

# The bound on waiting for mxload's ended threads: one of them is gone in
# microseconds, but the kernel may have reused an id for a thread that lives on.
OWN_EXIT_WAIT_S = 1.0
# The bound on waiting for threads mxload did not start, and the polls their
# count must hold steady for.
FOREIGN_EXIT_WAIT_S = 0.2
FOREIGN_STEADY_POLLS = 3
FOREIGN_POLL_S = 0.002
POLL_S = 0.0005
# After a fork that warned: how long the threads it counted may take to finish ending.
ENDING_GRACE_S = 0.05
FORK_WARNING = "multi-threaded, use of fork()"
FORK_WARNS = sys.version_info >= (3, 12)   # the DeprecationWarning's first version

_lock = threading.Lock()
_started: dict[int, threading.Thread] = {}   # native id -> one of mxload's threads


def start(thread: threading.Thread) -> None:
    """Start one of mxload's threads and record its native id.

    The thread also leaves `threading._dangling`, a WeakSet (kept for
    CPython's own test suite) whose callback runs Python code when the
    thread object dies, often in a garbage collection: a Ctrl-C landing there
    was swallowed ("Exception ignored in: ... WeakSet ... _remove")."""
    dangling = getattr(threading, "_dangling", None)
    if dangling is not None:
        dangling.discard(thread)
    thread.start()
    tid = thread.native_id   # set before start() returns
    if tid is not None:
        with _lock:
            _started[tid] = thread


def _in_kernel(tid: int) -> bool:
    return os.path.exists(f"/proc/self/task/{tid}")


def os_thread_count() -> int | None:
    """The kernel's count of this process's threads (None where /proc is missing)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[17])   # field 20: num_threads
    except (OSError, ValueError, IndexError):
        return None


def before_fork() -> None:
    """What a fork needs done first: wait_for_ended_threads where the fork would warn (Python
    3.12+); before 3.12 nothing warns, so the ended threads are only forgotten, never waited
    for (the wait took 4-6 ms of every non-persistent epoch's start beside pyarrow's pool)."""
    if FORK_WARNS:
        wait_for_ended_threads()
        return
    with _lock:
        for tid in [tid for tid, thread in _started.items() if not thread.is_alive()]:
            del _started[tid]


def wait_for_ended_threads() -> None:
    """Before forking: wait until the threads that ended have left the kernel too
    (mxload's own: each by its id, within OWN_EXIT_WAIT_S; others: see the module
    docstring).  Threads still running stay, and the fork's warning names them honestly."""
    deadline = time.monotonic() + OWN_EXIT_WAIT_S
    with _lock:
        ended = [tid for tid, thread in _started.items() if not thread.is_alive()]
    for tid in ended:
        gone = not _in_kernel(tid)
        while not gone and time.monotonic() < deadline:
            time.sleep(POLL_S)
            gone = not _in_kernel(tid)
        if gone:
            with _lock:
                if tid in _started and not _started[tid].is_alive():
                    del _started[tid]
    _wait_for_foreign_threads()


def _wait_for_foreign_threads() -> None:
    deadline = time.monotonic() + FOREIGN_EXIT_WAIT_S
    last, steady = os_thread_count(), 0
    while last is not None and last > threading.active_count() and steady < FOREIGN_STEADY_POLLS:
        if time.monotonic() >= deadline:
            return
        time.sleep(FOREIGN_POLL_S)
        count = os_thread_count()
        steady = steady + 1 if count == last else 0
        last = count


def fork_warning_counted_ending_threads(warning: warnings.WarningMessage, python_threads: int) -> bool:
    """Whether `warning` is Python's fork warning about threads that were all ending
    (see the module docstring); `python_threads`: threading.active_count() at the fork."""
    if not issubclass(warning.category, DeprecationWarning) or FORK_WARNING not in str(warning.message):
        return False
    if python_threads > 1 or threading.active_count() > 1:
        return False
    deadline = time.monotonic() + ENDING_GRACE_S
    while True:
        count = os_thread_count()
        if count is not None and count <= 1:
            return True
        if count is None or time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
