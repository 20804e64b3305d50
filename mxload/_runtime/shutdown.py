"""The numbered shutdown sequence every way an iteration ends goes through, and its
budget: one deadline for every phase, whatever the transport.

NOTE [ Numbered shutdown ]

Engine.shutdown runs shutdown_sequence once, Ctrl-C deferred, so nothing is left half
ended; each numbered step is one method of the transport seam (transport.py), bounded by the
one deadline it is given, and none of them raises.  The steps, in order, are the body of
shutdown_sequence below; every transport's methods and every caller cite this note."""
from __future__ import annotations

import time

# An engine's states (Engine.state): shutdown_sequence runs once, in SHUTTING_DOWN.  The compiled
# window reads them (it dispatches while RUNNING): they are the core's.
from .._core import CLOSED, RUNNING, SHUTTING_DOWN, ReorderBuffer
from .transport import Transport

__all__ = ["CLOSED", "RUNNING", "SHUTTING_DOWN", "SHUTDOWN_DEADLINE_S", "SHUTDOWN_GRACE_S",
           "SHUTDOWN_TERMINATE_S", "shutdown_sequence"]

# Shutdown budget: a worker between tasks exits within a few ms of the stop
# message; one still inside a batch (whose result nobody wants any more) gets
# SIGTERM after the grace period, SIGKILL after the terminate period; every
# wait shares the one deadline.

SHUTDOWN_GRACE_S = 0.02
SHUTDOWN_TERMINATE_S = 0.5
SHUTDOWN_DEADLINE_S = 1.0


def shutdown_sequence(transport: Transport, buffer: ReorderBuffer) -> None:
    """End an engine's workers and release everything, within SHUTDOWN_DEADLINE_S
    however stuck the workers are.  The engine runs it once, Ctrl-C deferred."""
    start = time.monotonic()
    deadline = start + SHUTDOWN_DEADLINE_S
    # 1. Take no result from now on.  Stop the watcher thread (asleep in the
    #    core's poll() on the workers' pidfds) and join it: the self-pipe wakes
    #    it.  A consumer receiving in next() is woken the same way, and one
    #    handling a worker's death finishes that first.
    transport.stop_receiving(deadline)
    # 2. No worker starts from now on; wait for one under way (a restart),
    #    which then ends its process itself if we stop waiting first.
    transport.refuse_starts(deadline)
    # 3. Wake a consumer blocked in the ReorderBuffer.
    buffer.close("the loader is shutting down")
    # 4. Ask every worker to stop.  The stop message never blocks (a
    #    stuck worker's socket may be full); workers read ahead, so one
    #    that is between tasks skips its queued work and exits at once.
    transport.ask_to_stop()
    # 5. Grace period, then SIGTERM, then SIGKILL, all within the one
    #    deadline (a worker between tasks, which exits 0 on the stop message,
    #    is not sent SIGTERM: it has until SIGKILL); reap every process
    #    (threads: join until the deadline).  One
    #    whose end is not known by then (SIGKILLed; its parent, the fork server,
    #    not run meanwhile) has its descriptors closed all the same.
    #    Then the zygote, which kills and reaps whatever is left of its children.
    transport.end_workers(start, deadline)
    # 6. Close sockets and pipes, drop buffered batches, release slabs
    #    (batches the consumer still holds stay valid until it drops them).
    transport.release()
    buffer.clear()
