"""Task pairing: how many of a worker's tasks go in one message.

A task waits (held on its worker's handle, by the core's TaskHold) for the next ones of its
worker while the training loop is served from the buffer, and one message wakes the worker
once for all: on this kind of machine that wake-up is most of what a batch costs the main
process (a send that wakes a sleeping process: 6-12 us of CPU, against 20-27 us per batch in
all).  With k = window // workers tasks in flight per worker: while the loop finds its batches
ready, a worker's task waits for all k of its share.  Where the workers were barely ahead of the
loop, holding cost ~10% batches/s at k = 2 (the loop slept 2.5-4x as often), while a loop that
never waits pays 21 us per batch paired against 28 us one to a message.  So a loop about to
wait with a task held, past its epoch's first window (the workers are just starting), holds one
task fewer for the next tasks: k - 1, which always leaves a sent task queued behind the one the
worker is making (so never idles it), one to a message at k = 2.  For PAIR_BACKOFF_MIN_TASKS
after a long paired run (a stall of a busy machine), twice the last stop's where pairing lasted
less than that, up to PAIR_BACKOFF_MAX_TASKS; a loader-bound loop so pays one late task in that
many.

The policy alone: it counts on the tasks sent it is told of and says how many go in one message
(the transport, local/transport.py, holds and sends them)."""
from __future__ import annotations

# How a worker's tasks share messages, by the window per worker taking tasks (k).
PAIR_NEVER = 0        # k < 2: a held task would leave its worker idle
PAIR_WHILE_AHEAD = 1  # k >= 2: all k to a message while the loop finds its batches ready, k - 1 after
                      # it would have waited (k - 1 keeps a task queued on the worker; 1 where k = 2)
# The most tasks one message carries (the core's frames per message).
MAX_TASKS_PER_MESSAGE = 8
# Adaptive pairing, after the loop would have waited for a batch with a task held: the tasks sent
# one to a message before pairing is tried again.  The first stop after a long paired run (a
# passing stall on a busy machine) backs off the least; each stop that follows its resumption
# sooner than its own backoff (the workers are not ahead: the loop keeps waiting) doubles it.
PAIR_BACKOFF_MIN_TASKS = 16
PAIR_BACKOFF_MAX_TASKS = 1024

__all__ = ["MAX_TASKS_PER_MESSAGE", "PAIR_BACKOFF_MAX_TASKS", "PAIR_BACKOFF_MIN_TASKS", "PAIR_NEVER",
           "PAIR_WHILE_AHEAD", "Pairing"]


class Pairing:
    """How many of a worker's tasks go in one message (see the module's text).  Each method
    takes the tasks sent so far and returns the tasks per message from now on."""

    def __init__(self) -> None:
        self.mode = PAIR_NEVER
        self.ahead = self.behind = 1           # tasks per message while the loop is ahead, after a stop
        self.resume_at = 0                     # the tasks sent at which pairing resumes after a stop
        self.backoff = PAIR_BACKOFF_MIN_TASKS  # the last stop's length, in tasks

    def set_window(self, window: int, workers: int, sent: int) -> int:
        """`window` tasks in flight over `workers` workers taking tasks."""
        per_worker = min(window // workers, MAX_TASKS_PER_MESSAGE) if workers > 0 else 1
        if per_worker < 2:
            self.mode, self.ahead, self.behind = PAIR_NEVER, 1, 1
        else:
            self.mode, self.ahead, self.behind = PAIR_WHILE_AHEAD, per_worker, per_worker - 1
        return self.ahead if sent >= self.resume_at else self.behind

    def stop(self, per_message: int, sent: int, filling: bool) -> int | None:
        """The loop is about to wait, maybe for a held task: the tasks per message after the stop,
        or None where pairing goes on as it was (it was stopped already, never pairs, or
        `filling`: the epoch's first window, the workers starting)."""
        if self.mode != PAIR_WHILE_AHEAD or per_message <= self.behind or filling:
            return None
        if sent - self.resume_at < self.backoff:   # paired for less than the last stop lasted
            self.backoff = min(2 * self.backoff, PAIR_BACKOFF_MAX_TASKS)
        else:
            self.backoff = PAIR_BACKOFF_MIN_TASKS
        self.resume_at = sent + self.backoff
        return self.behind

    def after_send(self, per_message: int, sent: int) -> int:
        """Tasks were sent (`sent` in all): pairing resumes once the stop's backoff is over."""
        if self.mode == PAIR_WHILE_AHEAD and per_message < self.ahead and sent >= self.resume_at:
            return self.ahead
        return per_message
